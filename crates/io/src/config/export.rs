//! `[export]`: incidents shipped off the instance (`crates/io/src/export`).

use std::time::Duration;

use serde::Deserialize;

use super::yes;

/// Incidents shipped off the instance (`crates/io/src/export`): every journal record to CloudWatch
/// Logs, every incident transition to EventBridge. Off unless enabled (and `[aws]` is on).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportConfig {
    #[serde(default)]
    pub enabled: bool,
    /// The log group; `{cluster}` is replaced by the ECS cluster's name.
    #[serde(default = "default_log_group")]
    pub log_group: String,
    /// Every record to CloudWatch Logs (one stream per instance id).
    #[serde(default = "yes")]
    pub logs: bool,
    /// Every incident transition to EventBridge.
    #[serde(default = "yes")]
    pub events: bool,
    /// The EventBridge bus: a name or an ARN.
    #[serde(default = "default_event_bus")]
    pub event_bus: String,
    /// How often the journal is read for records not yet delivered.
    #[serde(default = "default_export_interval", with = "humantime_serde")]
    pub interval: Duration,
    /// How long completing the terminate hook or marking the instance Unhealthy waits for
    /// the records still pending to be delivered.
    #[serde(default = "default_flush_wait", with = "humantime_serde")]
    pub flush_wait: Duration,
}

impl Default for ExportConfig {
    fn default() -> Self {
        ExportConfig {
            enabled: false,
            log_group: default_log_group(),
            logs: true,
            events: true,
            event_bus: default_event_bus(),
            interval: default_export_interval(),
            flush_wait: default_flush_wait(),
        }
    }
}

impl ExportConfig {
    /// The log group of `cluster`.
    pub fn log_group_for(&self, cluster: &str) -> String {
        self.log_group.replace("{cluster}", cluster)
    }
}

fn default_log_group() -> String {
    "/gpu-medic/{cluster}".into()
}

fn default_event_bus() -> String {
    "default".into()
}

fn default_export_interval() -> Duration {
    Duration::from_secs(2)
}

fn default_flush_wait() -> Duration {
    Duration::from_secs(10)
}
