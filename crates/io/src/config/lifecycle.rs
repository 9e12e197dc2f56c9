//! `[lifecycle]`: the Auto Scaling lifecycle hooks (terminate, launch gate).

use std::time::Duration;

use serde::Deserialize;

use super::{de_positive_duration, yes};

/// Our Auto Scaling lifecycle hooks (never anyone else's): the IMDS watcher that starts the
/// drain on termination, and the launch gate (`gpu-medic check --lifecycle`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LifecycleConfig {
    /// Watch IMDS `autoscaling/target-lifecycle-state` in `run` (only with `[aws] enabled`).
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default = "default_terminate_hook")]
    pub terminate_hook: String,
    #[serde(default = "default_launch_hook")]
    pub launch_hook: String,
    /// How often IMDS is asked for the target lifecycle state.
    #[serde(
        default = "default_lifecycle_poll",
        deserialize_with = "de_positive_duration"
    )]
    pub poll_interval: Duration,
    /// Launch gate: what a check that still "could not tell" at `check_deadline` completes
    /// the launch hook with (`continue`: in service, marked `<prefix>.health=pending`).
    #[serde(default)]
    pub on_unknown: OnUnknown,
    /// Launch gate: how long a "could not tell" check is retried.
    #[serde(default = "default_check_deadline", with = "humantime_serde")]
    pub check_deadline: Duration,
    /// Launch gate: the pause between two tries of a "could not tell" check.
    #[serde(
        default = "default_check_retry_delay",
        deserialize_with = "de_positive_duration"
    )]
    pub check_retry_delay: Duration,
    /// Launch-failure breaker: after this many abandoned launches in the group within
    /// `abandon_window`, an unhealthy instance is kept (CONTINUE) quarantined instead.
    #[serde(default = "default_abandon_limit")]
    pub abandon_limit: u32,
    #[serde(
        default = "default_abandon_window",
        deserialize_with = "de_positive_duration"
    )]
    pub abandon_window: Duration,
}

/// What the launch gate does when the health check could not tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnUnknown {
    /// In service but marked `pending`: no placement under `== ok` until a check passes.
    #[default]
    Continue,
    /// Handed back to Auto Scaling like an unhealthy instance (the breaker applies).
    Abandon,
}

fn default_lifecycle_poll() -> Duration {
    Duration::from_secs(5)
}

fn default_check_deadline() -> Duration {
    Duration::from_secs(180)
}

fn default_check_retry_delay() -> Duration {
    Duration::from_secs(15)
}

fn default_abandon_limit() -> u32 {
    3
}

fn default_abandon_window() -> Duration {
    Duration::from_secs(3600)
}

fn default_terminate_hook() -> String {
    "gpu-medic-terminate".to_string()
}

fn default_launch_hook() -> String {
    "gpu-medic-launch".to_string()
}

impl Default for LifecycleConfig {
    fn default() -> Self {
        LifecycleConfig {
            enabled: true,
            terminate_hook: default_terminate_hook(),
            launch_hook: default_launch_hook(),
            poll_interval: default_lifecycle_poll(),
            on_unknown: OnUnknown::default(),
            check_deadline: default_check_deadline(),
            check_retry_delay: default_check_retry_delay(),
            abandon_limit: default_abandon_limit(),
            abandon_window: default_abandon_window(),
        }
    }
}
