//! `[planned]`: disruptions AWS plans for this instance, read from IMDS ahead of time
//! (docs/planned-events.md): scheduled events, the Spot interruption notice and the rebalance
//! recommendation, and what gpu-medic does about each. The probe's settings (how often, how
//! much it reads, where the boot id is) and the operator's choices (how long ahead to drain,
//! whether a rebalance drains) live here; the engine receives the choices as
//! [`crate::policy::planned::PlannedRules`].

use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::policy::planned::{PlannedRules, Rebalance};
use crate::sys::error::FileError;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannedConfig {
    /// Poll IMDS for planned disruptions in `run` (only with `[aws] enabled`).
    #[serde(default = "yes")]
    pub enabled: bool,
    /// How often the three IMDS documents are read.
    #[serde(default = "default_poll_interval", with = "humantime_serde")]
    pub poll_interval: Duration,
    /// The largest document accepted, in bytes; a bigger one is refused with a warning and
    /// decides nothing.
    #[serde(default = "default_max_document")]
    pub max_document: usize,
    /// Scheduled events: the drain starts this long before the event's NotBefore.
    #[serde(default = "default_lead", with = "humantime_serde")]
    pub lead: Duration,
    /// A planned drain ends this long before AWS acts (NotBefore, the Spot interruption time):
    /// tasks still running then, standalone ones included, are stopped before it.
    #[serde(default = "default_margin", with = "humantime_serde")]
    pub margin: Duration,
    /// `instance-retirement` / `instance-stop`: after the drain, mark the instance Unhealthy so
    /// Auto Scaling replaces it before AWS stops it (false: drain only).
    #[serde(default = "yes")]
    pub replace_on_stop: bool,
    /// A rebalance recommendation: `log` (default) or `drain` (within the fleet budget).
    #[serde(default)]
    pub rebalance: Rebalance,
}

fn yes() -> bool {
    true
}
fn default_poll_interval() -> Duration {
    Duration::from_secs(5)
}
fn default_max_document() -> usize {
    64 * 1024
}
fn default_lead() -> Duration {
    Duration::from_secs(30 * 60)
}
fn default_margin() -> Duration {
    Duration::from_secs(15)
}

impl Default for PlannedConfig {
    fn default() -> Self {
        PlannedConfig {
            enabled: true,
            poll_interval: default_poll_interval(),
            max_document: default_max_document(),
            lead: default_lead(),
            margin: default_margin(),
            replace_on_stop: true,
            rebalance: Rebalance::default(),
        }
    }
}

/// The largest `max_document` accepted: IMDS documents are a few hundred bytes.
pub const MAX_DOCUMENT_CEILING: usize = 1024 * 1024;

impl PlannedConfig {
    /// The operator's choices, for the engine.
    pub fn rules(&self) -> PlannedRules {
        PlannedRules {
            lead: self.lead,
            margin: self.margin,
            replace_on_stop: self.replace_on_stop,
            rebalance: self.rebalance,
        }
    }

    /// Values that parse but cannot work, refused with their line.
    pub fn check(&self, path: &Path, text: &str) -> Result<(), FileError> {
        let line = |key: &str| super::key_line(text, Some("planned"), key);
        if self.poll_interval < Duration::from_millis(100) {
            return Err(FileError::new(
                path,
                line("poll_interval"),
                "[planned] poll_interval: at least 100ms (IMDS is asked for three documents each time)",
            ));
        }
        if self.poll_interval > Duration::from_secs(60) {
            return Err(FileError::new(
                path,
                line("poll_interval"),
                "[planned] poll_interval: at most 60s (a Spot interruption gives two minutes of notice)",
            ));
        }
        if !(256..=MAX_DOCUMENT_CEILING).contains(&self.max_document) {
            return Err(FileError::new(
                path,
                line("max_document"),
                format!("[planned] max_document: between 256 and {MAX_DOCUMENT_CEILING} bytes"),
            ));
        }
        if self.lead > Duration::from_secs(7 * 24 * 3600) {
            return Err(FileError::new(
                path,
                line("lead"),
                "[planned] lead: at most 7 days",
            ));
        }
        if self.margin > Duration::from_secs(90) {
            return Err(FileError::new(
                path,
                line("margin"),
                "[planned] margin: at most 90s (a Spot interruption gives two minutes of notice)",
            ));
        }
        Ok(())
    }
}
