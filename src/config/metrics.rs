//! `[metrics]`: the Prometheus endpoint.

use serde::Deserialize;

/// The optional Prometheus endpoint.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    #[serde(default)]
    pub enabled: bool,
    /// A loopback address; others are refused (the endpoint has no authentication).
    #[serde(default = "default_metrics_listen")]
    pub listen: std::net::SocketAddr,
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
            emf: false,
        }
    }
}

fn default_metrics_listen() -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], 9400))
}
