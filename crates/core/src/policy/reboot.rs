//! The reboot rung's ladder (`[reboot]` in the policy): how many reboots a node may take
//! before the same kind of fault goes straight to `replace`, and how soon after a reboot a
//! fault counts as "it came back". The engine keeps the repair history per instance in its
//! state (it survives the reboots it counts); these are the limits it judges it by.
//!
//! Defaults: 2 reboots within 7 days, after NVIDIA's gpud (`DefaultRebootThreshold = 2`,
//! then hardware inspection) and NVSentinel (repeated remediation within 7 days goes to a
//! person); a fault within 24 hours of a reboot's return to service is taken as not mended
//! by it (our choice: docs/repair.md).

use std::time::Duration;

use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RebootPolicy {
    /// At most this many reboots within `window`; a reboot verdict beyond it is `replace`.
    pub limit: u32,
    pub window: Duration,
    /// A reboot verdict within this time of the last reboot's return to service is `replace`.
    pub recur_within: Duration,
}

impl Default for RebootPolicy {
    fn default() -> Self {
        RebootPolicy {
            limit: 2,
            window: Duration::from_secs(7 * 24 * 3600),
            recur_within: Duration::from_secs(24 * 3600),
        }
    }
}

/// `[reboot]` as the file says it.
#[derive(Debug, Deserialize, Default, Clone, Copy)]
#[serde(deny_unknown_fields)]
pub(super) struct FileReboot {
    #[serde(default, deserialize_with = "super::limits::de_reboot_limit")]
    pub limit: Option<u32>,
    #[serde(default, deserialize_with = "super::limits::de_reboot_window")]
    pub window: Option<Duration>,
    #[serde(default, deserialize_with = "super::limits::de_reboot_window")]
    pub recur_within: Option<Duration>,
}

impl FileReboot {
    /// Overlay wins key by key.
    pub fn merge(base: Option<FileReboot>, overlay: Option<FileReboot>) -> FileReboot {
        let (b, o) = (base.unwrap_or_default(), overlay.unwrap_or_default());
        FileReboot {
            limit: o.limit.or(b.limit),
            window: o.window.or(b.window),
            recur_within: o.recur_within.or(b.recur_within),
        }
    }

    pub fn build(self) -> Result<RebootPolicy, String> {
        let d = RebootPolicy::default();
        let p = RebootPolicy {
            limit: self.limit.unwrap_or(d.limit),
            window: self.window.unwrap_or(d.window),
            recur_within: self.recur_within.unwrap_or(d.recur_within),
        };
        if p.limit > 0 && p.window.is_zero() {
            return Err("[reboot] window must be > 0 when limit > 0".into());
        }
        Ok(p)
    }
}
