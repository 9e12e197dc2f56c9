//! Adapters to AWS: the SDK set up once (region, credentials and `AWS_ENDPOINT_URL*` from the
//! environment and profiles, rustls on ring as the only TLS stack, a pinned behaviour version,
//! timeouts so a hung endpoint cannot outlive an order's deadline), thin wrappers over the ECS
//! and Auto Scaling calls gpu-medic makes ([`ecs`], [`asg`]), the fleet budget's DynamoDB slot
//! table ([`dynamo`]) and the EC2 fact it needs ([`ec2`]), the classification of every call's
//! outcome ([`calls`]), IMDSv2 ([`imds`]), the ECS agent's introspection API ([`agent`]), this
//! instance's identity, discovered once ([`identity`]), lifecycle-hook heartbeats
//! ([`heartbeat`]), and where incidents are shipped: CloudWatch Logs ([`logs`]) and
//! EventBridge ([`events`]); the evidence archives' S3 uploads ([`s3`]).
//!
//! Probes, remedies and the launch gate build on these; nothing here imports a probe, a remedy,
//! the engine or the CLI. The call sequences and moto's gaps: docs/aws.md.

pub mod agent;
pub mod asg;
pub mod calls;
pub mod dynamo;
pub mod ec2;
pub mod ecs;
pub mod events;
pub mod heartbeat;
pub mod identity;
pub mod imds;
pub mod instance_types;
pub mod logs;
pub mod s3;
pub mod signed;
pub mod taskdef;

use std::time::Duration;

use aws_config::retry::RetryConfig;
use aws_config::timeout::TimeoutConfig;
use aws_config::{BehaviorVersion, ConfigLoader, Region};
use aws_sdk_ecs::config::SharedHttpClient;
use aws_smithy_http_client::tls;

use crate::config::AwsConfig;

/// The HTTPS client every AWS call uses: hyper with rustls on ring (no aws-lc, no OpenSSL).
pub fn http_client() -> SharedHttpClient {
    let builder = aws_smithy_http_client::Builder::new().tls_provider(RUSTLS_RING);
    match no_ca_context() {
        Some(ctx) => builder.tls_context(ctx).build_https(),
        None => builder.build_https(),
    }
}

/// The same client as one connector, for the calls made without a service crate
/// ([`signed`]): the SDK's pool, TLS and connect timeout.
pub(crate) fn connector(
    settings: aws_smithy_runtime_api::client::http::HttpConnectorSettings,
) -> aws_smithy_http_client::Connector {
    let builder = aws_smithy_http_client::Connector::builder()
        .connector_settings(settings)
        .sleep_impl(aws_smithy_async::rt::sleep::TokioSleep::new())
        .tls_provider(RUSTLS_RING);
    match no_ca_context() {
        Some(ctx) => builder.tls_context(ctx).build(),
        None => builder.build(),
    }
}

const RUSTLS_RING: tls::Provider = tls::Provider::Rustls(tls::rustls_provider::CryptoMode::Ring);

/// No CA certificates on the host: the SDK's client would assert on an empty native trust
/// store (a panic in debug builds). An empty store instead makes every HTTPS call fail with a
/// certificate error (typed, retried, reported), and the start warns
/// ([`crate::launch::preflight::warnings`]). Plain-HTTP endpoints (a local test double) still
/// work. `None`: the host has certificates, the default context reads them.
fn no_ca_context() -> Option<tls::TlsContext> {
    if ca_bundle().is_some() {
        return None;
    }
    tls::TlsContext::builder()
        .with_trust_store(tls::TrustStore::empty().with_native_roots(false))
        .build()
        .ok()
}

/// Where the host keeps its CA certificates, if anywhere: `SSL_CERT_FILE` / `SSL_CERT_DIR`,
/// else the bundle paths of the distributions gpu-medic runs on (Amazon Linux and RHEL,
/// Debian and Ubuntu, SUSE, Alpine), else a non-empty `/etc/ssl/certs`. The SDK reads the
/// same places (rustls-native-certs through openssl-probe).
pub fn ca_bundle() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let non_empty_file =
        |p: &std::path::Path| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.len() > 0);
    let non_empty_dir =
        |p: &std::path::Path| std::fs::read_dir(p).is_ok_and(|mut d| d.next().is_some());
    if let Some(f) = std::env::var_os("SSL_CERT_FILE").map(PathBuf::from)
        && non_empty_file(&f)
    {
        return Some(f);
    }
    if let Some(d) = std::env::var_os("SSL_CERT_DIR").map(PathBuf::from)
        && non_empty_dir(&d)
    {
        return Some(d);
    }
    const BUNDLES: [&str; 6] = [
        "/etc/pki/tls/certs/ca-bundle.crt",
        "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/ssl/ca-bundle.pem",
        "/etc/ssl/cert.pem",
        "/etc/pki/tls/cacert.pem",
    ];
    if let Some(b) = BUNDLES
        .iter()
        .map(PathBuf::from)
        .find(|p| non_empty_file(p))
    {
        return Some(b);
    }
    let dir = PathBuf::from("/etc/ssl/certs");
    non_empty_dir(&dir).then_some(dir)
}

/// The SDK configuration loader: the standard environment and profile chain, plus what
/// `[aws]` overrides. Tests add their own credentials before `load()`.
pub fn loader(aws: &AwsConfig) -> ConfigLoader {
    let mut l = aws_config::defaults(BehaviorVersion::v2026_01_12())
        .http_client(http_client())
        .retry_config(RetryConfig::standard().with_max_attempts(3))
        .timeout_config(
            TimeoutConfig::builder()
                .connect_timeout(Duration::from_secs(5))
                .operation_attempt_timeout(Duration::from_secs(20))
                .operation_timeout(Duration::from_secs(60))
                .build(),
        );
    if let Some(r) = &aws.region {
        l = l.region(Region::new(r.clone()));
    }
    if let Some(u) = &aws.endpoint_url {
        l = l.endpoint_url(u);
    }
    l
}
