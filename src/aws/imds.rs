//! The instance metadata service (IMDSv2), through aws-config's client on our HTTP stack
//! (session token with its TTL header; `AWS_EC2_METADATA_SERVICE_ENDPOINT` honoured): the
//! instance id and type, and Auto Scaling's target lifecycle state (read by the lifecycle
//! probe, and by a running drain that must learn of a termination beginning mid-drain).

use std::time::Duration;

use aws_config::imds;
use aws_config::imds::client::error::ImdsError;
use aws_config::provider_config::ProviderConfig;
use aws_sdk_ecs::config::SharedHttpClient;
use tokio::time::Instant;

use super::calls::error_chain;

/// The IMDS path of the target lifecycle state.
pub const TARGET_STATE_PATH: &str = "/latest/meta-data/autoscaling/target-lifecycle-state";
/// The IMDS path of the instance id.
pub const INSTANCE_ID_PATH: &str = "/latest/meta-data/instance-id";
/// The IMDS path of the instance type (`p5.48xlarge`).
pub const INSTANCE_TYPE_PATH: &str = "/latest/meta-data/instance-type";

/// What asking IMDS went wrong with.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("IMDS {path}: {message}")]
pub struct ImdsFailure {
    pub path: &'static str,
    pub message: String,
}

/// An IMDSv2 client on our HTTP stack, with short timeouts: IMDS is local, and a poll must
/// not outlast the interval by much.
pub fn imds_client(http: SharedHttpClient, max_attempts: u32) -> imds::Client {
    imds::Client::builder()
        .configure(&ProviderConfig::without_region().with_http_client(http))
        .max_attempts(max_attempts)
        .connect_timeout(Duration::from_secs(1))
        .read_timeout(Duration::from_secs(2))
        .build()
}

/// GETs an IMDS path. Ok(None): 404 (not there on this instance).
pub async fn get(client: &imds::Client, path: &'static str) -> Result<Option<String>, ImdsFailure> {
    match client.get(path).await {
        Ok(v) => Ok(Some(v.as_ref().trim().to_string())),
        Err(ImdsError::ErrorResponse(r)) if r.response().status().as_u16() == 404 => Ok(None),
        Err(e) => Err(ImdsFailure {
            path,
            message: error_chain(&e),
        }),
    }
}

/// The instance id from IMDSv2, retried with backoff until `deadline` (IMDS may come up after
/// us at boot). The one instance-id lookup: identity discovery and the launch gate use it.
pub async fn instance_id(http: SharedHttpClient, deadline: Instant) -> Result<String, String> {
    let client = imds_client(http, 2);
    let mut delay = Duration::from_millis(500);
    loop {
        let err = match get(&client, INSTANCE_ID_PATH).await {
            Ok(Some(id)) if !id.is_empty() => return Ok(id),
            Ok(_) => "IMDS has no instance-id".to_string(),
            Err(e) => e.to_string(),
        };
        if Instant::now() + delay >= deadline {
            return Err(err);
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// The instance type from IMDSv2 (one attempt with the client's own retry). Ok(None): IMDS
/// has none.
pub async fn instance_type(http: SharedHttpClient) -> Result<Option<String>, ImdsFailure> {
    let client = imds_client(http, 2);
    Ok(get(&client, INSTANCE_TYPE_PATH)
        .await?
        .filter(|t| !t.is_empty()))
}

/// Whether IMDS says Auto Scaling is terminating the instance (target lifecycle state
/// `Terminated`). Asked by the drain itself on every poll: the lifecycle probe shares its
/// readings with the engine only.
pub async fn target_terminated(client: &imds::Client) -> Result<bool, ImdsFailure> {
    Ok(get(client, TARGET_STATE_PATH).await?.as_deref() == Some("Terminated"))
}
