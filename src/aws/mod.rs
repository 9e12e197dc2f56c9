//! Adapters to AWS: the SDK set up once (region, credentials and `AWS_ENDPOINT_URL*` from the
//! environment and profiles, rustls on ring as the only TLS stack, a pinned behaviour version,
//! timeouts so a hung endpoint cannot outlive an order's deadline), thin wrappers over the ECS
//! and Auto Scaling calls gpu-medic makes ([`ecs`], [`asg`]), the fleet budget's DynamoDB slot
//! table ([`dynamo`]) and the EC2 fact it needs ([`ec2`]), the classification of every call's
//! outcome ([`calls`]), IMDSv2 ([`imds`]), the ECS agent's introspection API ([`agent`]), this
//! instance's identity, discovered once ([`identity`]), lifecycle-hook heartbeats
//! ([`heartbeat`]), and where incidents are shipped: CloudWatch Logs ([`logs`]) and
//! EventBridge ([`events`]).
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
    aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(
            tls::rustls_provider::CryptoMode::Ring,
        ))
        .build_https()
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
