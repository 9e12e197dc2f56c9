//! `[metrics]`: the Prometheus endpoint.

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::sys::error::FileError;

/// The default port: 9469. 9400 is dcgm-exporter's, 9100 node_exporter's and 9835
/// nvidia_gpu_exporter's, all commonly on the same GPU node; 9469 is none of theirs.
pub const DEFAULT_PORT: u16 = 9469;

/// The most connections `max_connections` may allow (the endpoint's descriptors stay well
/// inside systemd's default soft limit of 1,024).
pub const MAX_CONNECTIONS_CEILING: usize = 512;

/// The optional Prometheus endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    #[serde(default)]
    pub enabled: bool,
    /// A loopback address; others are refused (the endpoint has no authentication).
    #[serde(default = "default_metrics_listen")]
    pub listen: std::net::SocketAddr,
    /// Connections served at once; one beyond is closed at once.
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// How often an address that could not be bound (the port is taken) is tried again.
    #[serde(default = "default_retry", with = "humantime_serde")]
    pub retry: Duration,
    /// One CloudWatch embedded-metric-format line per task, container and GPU per NVML poll
    /// on stdout (journald, then the CloudWatch agent), independent of `enabled`.
    #[serde(default)]
    pub emf: bool,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            enabled: false,
            listen: default_metrics_listen(),
            max_connections: default_max_connections(),
            retry: default_retry(),
            emf: false,
        }
    }
}

impl MetricsConfig {
    /// `max_connections` within 1..=[`MAX_CONNECTIONS_CEILING`], `retry` within 1s..=1h.
    pub fn check(&self, path: &Path, text: &str) -> Result<(), FileError> {
        let line = |key: &str| super::key_line(text, Some("metrics"), key);
        if !(1..=MAX_CONNECTIONS_CEILING).contains(&self.max_connections) {
            return Err(FileError::new(
                path,
                line("max_connections"),
                format!(
                    "[metrics] max_connections: between 1 and {MAX_CONNECTIONS_CEILING} (each \
                     connection holds a file descriptor the supervisor may need)"
                ),
            ));
        }
        if !(Duration::from_secs(1)..=Duration::from_secs(3600)).contains(&self.retry) {
            return Err(FileError::new(
                path,
                line("retry"),
                "[metrics] retry: between 1s and 1h",
            ));
        }
        Ok(())
    }
}

fn default_metrics_listen() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], DEFAULT_PORT))
}

fn default_max_connections() -> usize {
    64
}

fn default_retry() -> Duration {
    Duration::from_secs(30)
}
