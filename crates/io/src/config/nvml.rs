//! `[nvml]`: the GPUs through NVML, the kernel log, and per-task GPU memory checks.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::yes;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvmlConfig {
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Library name (searched by the dynamic loader) or path.
    #[serde(default = "default_nvml_library")]
    pub library: String,
    #[serde(default = "default_poll", with = "humantime_serde")]
    pub poll_interval: Duration,
    /// How many GPUs this instance type has; fewer is a fault. Unset: the instance type's count
    /// (`[ecs] gpu_view`, `[aws]` enabled), else not checked; ECS's registered count is never
    /// used (it is not the hardware's: crates/io/src/probe/ecs_gpus.rs).
    #[serde(default)]
    pub expected_gpus: Option<u32>,
    /// The kernel log, read for `NVRM: Xid` lines; `""` turns it off. `/dev/kmsg` is the
    /// kernel's own; `"journald"` reads the kernel's records from the systemd journal
    /// (`_TRANSPORT=kernel`, this boot); an XID read only from a syslog file needs a second
    /// witness to act (docs/operations.md, "Which kernel log to read").
    #[serde(default = "default_kmsg")]
    pub kmsg: Option<PathBuf>,
    /// With `kmsg = "journald"`: read the journal files in this directory instead of the
    /// system journal (`journalctl --directory`: a host journal mounted into a container).
    #[serde(default)]
    pub kmsg_journal_directory: Option<PathBuf>,
    /// The share of a task's GPU memory reservation whose crossing is a
    /// `gpu-memory-over-reservation` signal ("100%": using more than reserved).
    #[serde(default = "default_reservation_alert")]
    pub reservation_alert: Share,
}

fn default_reservation_alert() -> Share {
    Share(100.0)
}

/// A share of something, written `"90%"`; more than 0 % and at most 1000 %.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Share(pub f64);

impl Share {
    pub fn parse(s: &str) -> Result<Share, String> {
        let v: f64 = s
            .trim()
            .strip_suffix('%')
            .and_then(|p| p.trim().parse().ok())
            .ok_or_else(|| format!("bad share {s:?}: expected e.g. \"100%\""))?;
        if !(v > 0.0 && v <= 1000.0) {
            return Err(format!(
                "bad share {s:?}: must be more than 0% and at most 1000%"
            ));
        }
        Ok(Share(v))
    }

    /// `whole` times this share, rounded down.
    pub fn of(self, whole: u64) -> u64 {
        (whole as f64 * self.0 / 100.0) as u64
    }
}

impl std::fmt::Display for Share {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}%", self.0)
    }
}

impl<'de> Deserialize<'de> for Share {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Share;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a share such as \"100%\" (a string with %)")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Share, E> {
                Share::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_str(V)
    }
}

fn default_nvml_library() -> String {
    "libnvidia-ml.so.1".to_string()
}

fn default_kmsg() -> Option<PathBuf> {
    Some(PathBuf::from("/dev/kmsg"))
}

fn default_poll() -> Duration {
    Duration::from_secs(10)
}

impl Default for NvmlConfig {
    fn default() -> Self {
        NvmlConfig {
            enabled: true,
            library: default_nvml_library(),
            poll_interval: default_poll(),
            expected_gpus: None,
            kmsg: default_kmsg(),
            kmsg_journal_directory: None,
            reservation_alert: default_reservation_alert(),
        }
    }
}
