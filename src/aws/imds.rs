//! The instance metadata service (IMDSv2), through aws-config's client on our HTTP stack
//! (session token with its TTL header; `AWS_EC2_METADATA_SERVICE_ENDPOINT` honoured): the
//! instance id and type, and Auto Scaling's target lifecycle state.
//!
//! [`TargetState`] is the lifecycle watcher's last reading, handed at construction to the
//! lifecycle probe (which writes it) and the control plane (whose drain reads it to learn that
//! a termination began mid-drain). It is an object passed to both, not a process-wide static.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
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

/// What IMDS last said of the target lifecycle state, shared between the lifecycle watcher
/// (the writer) and the drain (a reader). Clones share one reading.
#[derive(Debug, Clone, Default)]
pub struct TargetState(Arc<AtomicU8>);

const SEEN_NOTHING: u8 = 0;
const SEEN_IN_SERVICE: u8 = 1;
const SEEN_TERMINATED: u8 = 2;
const SEEN_OTHER: u8 = 3;

impl TargetState {
    pub fn new() -> Self {
        TargetState::default()
    }

    /// Records a reading (`None`: IMDS had no target state, e.g. 404).
    pub fn remember(&self, state: Option<&str>) {
        let v = match state {
            Some("Terminated") => SEEN_TERMINATED,
            Some("InService") => SEEN_IN_SERVICE,
            Some(_) => SEEN_OTHER,
            None => SEEN_NOTHING,
        };
        self.0.store(v, Ordering::Relaxed);
    }

    /// Whether IMDS last said `Terminated`.
    pub fn terminating(&self) -> bool {
        self.0.load(Ordering::Relaxed) == SEEN_TERMINATED
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_state_is_shared_by_clones() {
        let a = TargetState::new();
        let b = a.clone();
        assert!(!b.terminating());
        a.remember(Some("Terminated"));
        assert!(b.terminating());
        a.remember(Some("InService"));
        assert!(!b.terminating());
        a.remember(None);
        assert!(!b.terminating());
        assert!(
            !TargetState::new().terminating(),
            "a new reading is not shared"
        );
    }
}
