//! The daemon's configuration (`/etc/gpu-medic/config.toml`), parsed once at start.
//! Unknown keys are rejected and every error names the file and line, so a typo in an AMI
//! build fails the build instead of silently disabling a probe.

pub mod state_dir;

pub use state_dir::{StateDir, View};

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::sys::error::FileError;

mod aws;
pub mod diagnose;
pub mod drill;
mod evidence;
mod export;
mod fleet;
mod journal;
mod lifecycle;
mod metrics;
mod mps;
mod node;
mod nvml;
pub mod planned;
pub mod repair;

pub use aws::{AwsConfig, EcsConfig, IdentityConfig};
pub use diagnose::DiagnoseConfig;
pub use drill::DrillConfig;
pub use evidence::{EvidenceConfig, SafeMode, Sse, valid_bucket};
pub use export::ExportConfig;
pub use fleet::{FleetConfig, FleetLimit};
pub use journal::JournalConfig;
pub use lifecycle::{LifecycleConfig, OnUnknown};
pub use metrics::MetricsConfig;
pub use mps::{
    ECS_AMI_PIPE, ECS_AMI_UNIT, MpsConfig, MpsLogs, MpsManage, MpsPreset, parse_pinned_limits,
};
pub use node::NodeConfig;
pub use nvml::{NvmlConfig, Share};
pub mod links;
pub use links::LinksConfig;
pub use planned::PlannedConfig;
pub use repair::{RebootMethod, RepairConfig};

pub const DEFAULT_CONFIG_PATH: &str = "/etc/gpu-medic/config.toml";

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where `incidents.jsonl`, `inputs.jsonl` and `state.json` live.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// Observe-only regardless of the policy: decisions are journaled, nothing is executed.
    #[serde(default)]
    pub dry_run: bool,
    /// The policy file; relative paths are resolved against the config file's folder.
    #[serde(default = "default_policy")]
    pub policy: PathBuf,
    /// How often the engine checks deadlines and scheduled retries.
    #[serde(default = "default_tick", with = "humantime_serde")]
    pub tick_interval: Duration,
    #[serde(default)]
    pub nvml: NvmlConfig,
    #[serde(default)]
    pub mps: MpsConfig,
    #[serde(default)]
    pub aws: AwsConfig,
    #[serde(default)]
    pub identity: IdentityConfig,
    #[serde(default)]
    pub ecs: EcsConfig,
    #[serde(default)]
    pub fleet: FleetConfig,
    #[serde(default)]
    pub lifecycle: LifecycleConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub node: NodeConfig,
    #[serde(default)]
    pub journal: JournalConfig,
    #[serde(default)]
    pub export: ExportConfig,
    #[serde(default)]
    pub evidence: EvidenceConfig,
    #[serde(default)]
    pub links: LinksConfig,
    #[serde(default)]
    pub drill: DrillConfig,
    #[serde(default)]
    pub repair: RepairConfig,
    #[serde(default)]
    pub planned: PlannedConfig,
    #[serde(default)]
    pub diagnose: DiagnoseConfig,
}

fn de_positive_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let v: Duration = humantime_serde::deserialize(d)?;
    if v.is_zero() {
        return Err(serde::de::Error::custom("must be greater than zero"));
    }
    Ok(v)
}

fn yes() -> bool {
    true
}
fn default_state_dir() -> PathBuf {
    PathBuf::from("/var/lib/gpu-medic")
}
fn default_policy() -> PathBuf {
    PathBuf::from("/etc/gpu-medic/policies/default.toml")
}
fn default_tick() -> Duration {
    Duration::from_secs(1)
}

impl Config {
    /// Reads and checks a config file. Relative paths inside it are resolved against its folder.
    pub fn load(path: &Path) -> Result<Config, FileError> {
        Config::load_with_text(path).map(|(cfg, _)| cfg)
    }

    /// [`load`](Self::load), also returning the file's text (for `file:line` in later checks).
    pub fn load_with_text(path: &Path) -> Result<(Config, String), FileError> {
        let text =
            crate::sys::limits::read_text(path, crate::sys::limits::MAX_CONFIG_BYTES, "config")
                .map_err(|e| FileError::new(path, None, e.to_string()))?;
        let cfg = Config::parse(path, &text)?;
        Ok((cfg, text))
    }

    pub fn parse(path: &Path, text: &str) -> Result<Config, FileError> {
        let mut cfg: Config =
            toml::from_str(text).map_err(|e| FileError::from_toml(path, text, &e))?;
        let base = path.parent().unwrap_or_else(|| Path::new("."));
        for p in [&mut cfg.state_dir, &mut cfg.policy] {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        }
        cfg.check(path, text)?;
        Ok(cfg)
    }

    fn check(&self, path: &Path, text: &str) -> Result<(), FileError> {
        let line_of_key = |key: &str| {
            text.lines()
                .position(|l| l.trim_start().starts_with(key))
                .map(|i| i + 1)
        };
        self.check_durations(path, text)?;
        self.links.check(path, text)?;
        if self.mps.probe_timeout >= self.mps.probe_interval {
            return Err(FileError::new(
                path,
                key_line(text, Some("mps"), "probe_timeout"),
                "probe_timeout: must be shorter than probe_interval",
            ));
        }
        self.check_aws(path, &line_of_key)?;
        self.check_export(path, text)?;
        self.planned.check(path, text)?;
        self.evidence.check(path, text)?;
        self.metrics.check(path, text)?;
        if !self.metrics.listen.ip().is_loopback() {
            return Err(FileError::new(
                path,
                line_of_key("listen"),
                format!(
                    "listen: {} is not a loopback address; the metrics endpoint has no authentication",
                    self.metrics.listen
                ),
            ));
        }
        if self.repair.reboot == RebootMethod::Systemd
            && self.repair.command.first().is_none_or(|c| c.is_empty())
        {
            return Err(FileError::new(
                path,
                key_line(text, Some("repair"), "command"),
                "[repair] command: the reboot program is empty (reboot = \"systemd\" runs it)",
            ));
        }
        if self.nvml.expected_gpus == Some(0) {
            return Err(FileError::new(
                path,
                line_of_key("expected_gpus"),
                "expected_gpus: must be at least 1 (omit it to skip the check)",
            ));
        }
        Ok(())
    }

    /// Every interval and timeout between its floor and a year: an interval of "1ns" makes a
    /// loop spin on a core, a zero timeout fails every call, and a tick longer than half of
    /// systemd's watchdog has gpu-medic killed in a loop.
    fn check_durations(&self, path: &Path, text: &str) -> Result<(), FileError> {
        const YEAR: Duration = Duration::from_secs(365 * 24 * 3600);
        let ms = Duration::from_millis;
        let (n, m, e, f, l) = (
            &self.nvml,
            &self.mps,
            &self.ecs,
            &self.fleet,
            &self.lifecycle,
        );
        // (section, key, value, floor, ceiling)
        let table: [(Option<&str>, &str, Duration, Duration, Duration); 27] = [
            (
                Some("diagnose"),
                "timeout",
                self.diagnose.timeout,
                ms(100),
                diagnose::MAX_TIMEOUT,
            ),
            (
                Some("repair"),
                "check_interval",
                self.repair.check_interval,
                ms(100),
                YEAR,
            ),
            (
                Some("repair"),
                "settle",
                self.repair.settle,
                Duration::ZERO,
                YEAR,
            ),
            (None, "tick_interval", self.tick_interval, ms(50), MAX_TICK),
            (
                Some("nvml"),
                "poll_interval",
                n.poll_interval,
                ms(100),
                YEAR,
            ),
            (
                Some("mps"),
                "probe_interval",
                m.probe_interval,
                ms(100),
                YEAR,
            ),
            (Some("mps"), "probe_timeout", m.probe_timeout, ms(10), YEAR),
            (
                Some("mps"),
                "quit_timeout",
                m.quit_timeout,
                Duration::ZERO,
                YEAR,
            ),
            (Some("mps"), "start_timeout", m.start_timeout, ms(100), YEAR),
            (
                Some("aws"),
                "replace_fallback_after",
                self.aws.replace_fallback_after,
                ms(100),
                YEAR,
            ),
            (
                Some("ecs"),
                "agent_wait",
                e.agent_wait,
                Duration::ZERO,
                YEAR,
            ),
            (
                Some("ecs"),
                "standalone_grace",
                e.standalone_grace,
                Duration::ZERO,
                YEAR,
            ),
            (
                Some("ecs"),
                "drain_poll_interval",
                e.drain_poll_interval,
                ms(100),
                YEAR,
            ),
            (
                Some("ecs"),
                "force_stop_lead",
                e.force_stop_lead,
                Duration::ZERO,
                YEAR,
            ),
            (
                Some("ecs"),
                "agent_disconnected_wait",
                e.agent_disconnected_wait,
                ms(100),
                YEAR,
            ),
            (
                Some("ecs"),
                "gpu_view_interval",
                e.gpu_view_interval,
                ms(100),
                YEAR,
            ),
            (Some("fleet"), "warmup", f.warmup, Duration::ZERO, YEAR),
            (
                Some("fleet"),
                "claim_settle",
                f.claim_settle,
                Duration::ZERO,
                YEAR,
            ),
            (Some("fleet"), "claim_ttl", f.claim_ttl, ms(100), YEAR),
            (Some("fleet"), "retry_after", f.retry_after, ms(100), YEAR),
            (
                Some("fleet"),
                "reservation_lifetime",
                f.reservation_lifetime,
                ms(100),
                YEAR,
            ),
            (
                Some("fleet"),
                "pattern_window",
                f.pattern_window,
                Duration::from_secs(60),
                YEAR,
            ),
            (
                Some("lifecycle"),
                "poll_interval",
                l.poll_interval,
                ms(100),
                YEAR,
            ),
            (
                Some("lifecycle"),
                "check_retry_delay",
                l.check_retry_delay,
                ms(100),
                YEAR,
            ),
            (Some("node"), "interval", self.node.interval, ms(100), YEAR),
            (
                Some("lifecycle"),
                "check_deadline",
                l.check_deadline,
                Duration::ZERO,
                YEAR,
            ),
            (
                Some("lifecycle"),
                "abandon_window",
                l.abandon_window,
                ms(100),
                YEAR,
            ),
        ];
        for (section, key, v, floor, ceiling) in table {
            let line = || key_line(text, section, key);
            let name = match section {
                Some(s) => format!("[{s}] {key}"),
                None => key.to_string(),
            };
            if v < floor {
                let why = if floor.is_zero() || v.is_zero() {
                    "must be greater than zero".to_string()
                } else {
                    format!(
                        "{} is below the minimum of {} (a loop this fast only burns CPU)",
                        humantime::format_duration(v),
                        humantime::format_duration(floor)
                    )
                };
                return Err(FileError::new(path, line(), format!("{name}: {why}")));
            }
            if v > ceiling {
                let why = if key == "tick_interval" {
                    format!(
                        "{} is more than half of the packaged unit's WatchdogSec ({}): systemd would kill gpu-medic between two watchdog pings; at most {}",
                        humantime::format_duration(v),
                        humantime::format_duration(PACKAGED_WATCHDOG),
                        humantime::format_duration(ceiling)
                    )
                } else {
                    format!(
                        "{} is longer than {}",
                        humantime::format_duration(v),
                        humantime::format_duration(ceiling)
                    )
                };
                return Err(FileError::new(path, line(), format!("{name}: {why}")));
            }
        }
        Ok(())
    }

    /// The `[ecs]`, `[fleet]` and `[lifecycle]` values AWS would reject or misread.
    /// Log group names: 1-512 of `a-zA-Z0-9_-/.#` (CloudWatch Logs); the bus: a name or ARN.
    /// Intervals: at least 100 ms (a loop must not spin), at most an hour.
    fn check_export(&self, path: &Path, text: &str) -> Result<(), FileError> {
        let x = &self.export;
        let err =
            |key: &str, msg: String| FileError::new(path, key_line(text, Some("export"), key), msg);
        let group = x.log_group_for("c");
        let ok_char = |c: char| c.is_ascii_alphanumeric() || "_-/.#".contains(c);
        if group.is_empty() || group.len() > 480 || !group.chars().all(ok_char) {
            return Err(err(
                "log_group",
                format!(
                    "log_group: {:?} must be letters, digits, '_', '-', '/', '.', '#' (and {{cluster}}), under 480 characters",
                    x.log_group
                ),
            ));
        }
        if x.event_bus.trim().is_empty() || x.event_bus.len() > 1600 {
            return Err(err(
                "event_bus",
                "event_bus: must be a bus name or ARN".into(),
            ));
        }
        for (key, d) in [("interval", x.interval), ("flush_wait", x.flush_wait)] {
            if d < Duration::from_millis(100) || d > Duration::from_secs(3600) {
                return Err(err(
                    key,
                    format!(
                        "{key}: {} is not between 100ms and 1h",
                        humantime::format_duration(d)
                    ),
                ));
            }
        }
        Ok(())
    }

    fn check_aws(
        &self,
        path: &Path,
        line_of_key: &dyn Fn(&str) -> Option<usize>,
    ) -> Result<(), FileError> {
        let err = |key: &str, msg: String| FileError::new(path, line_of_key(key), msg);
        if !self.ecs.agent_url.starts_with("http://") {
            return Err(err(
                "agent_url",
                format!("agent_url: {:?} must be an http:// URL", self.ecs.agent_url),
            ));
        }
        // ECS attribute names: 1-128 letters, digits, `- _ / \ .`; ours add ".claim.<ms>".
        let p = &self.ecs.attribute_prefix;
        let ok_char = |c: char| c.is_ascii_alphanumeric() || "-_/\\.".contains(c);
        if p.is_empty() || p.len() > 100 || !p.chars().all(ok_char) {
            return Err(err(
                "attribute_prefix",
                format!(
                    "attribute_prefix: {p:?} must be 1-100 letters, digits, '-', '_', '/', '\\' or '.'"
                ),
            ));
        }
        if self.fleet.pause_tag.trim().is_empty() {
            return Err(err("pause_tag", "pause_tag: must not be empty".into()));
        }
        for (key, hook) in [
            ("terminate_hook", &self.lifecycle.terminate_hook),
            ("launch_hook", &self.lifecycle.launch_hook),
        ] {
            if hook.is_empty() || hook.len() > 255 {
                return Err(err(key, format!("{key}: must be 1-255 characters")));
            }
        }
        if self.lifecycle.terminate_hook == "ecs-managed-draining-termination-hook" {
            return Err(err(
                "terminate_hook",
                "terminate_hook: that is ECS's own hook; gpu-medic never completes it".into(),
            ));
        }
        Ok(())
    }

    /// The files under `state_dir` ([`StateDir`]).
    pub fn files(&self) -> StateDir {
        StateDir::new(&self.state_dir)
    }

    pub fn incidents_path(&self) -> PathBuf {
        self.files().incidents()
    }

    pub fn inputs_path(&self) -> PathBuf {
        self.files().inputs()
    }

    pub fn state_path(&self) -> PathBuf {
        self.files().state()
    }
}

/// `WatchdogSec` of the packaged `gpu-medic.service` (a test keeps the two equal).
pub const PACKAGED_WATCHDOG: Duration = Duration::from_secs(30);
/// The longest tick: half the packaged watchdog, so one missed ping is not fatal.
pub const MAX_TICK: Duration = Duration::from_secs(15);

/// Loads the policy file at `path` and the files its `extends` chain names, each capped at
/// [`crate::sys::limits::MAX_POLICY_BYTES`] and refused unless a regular file.
pub fn load_policy(path: &Path) -> Result<crate::policy::Policy, FileError> {
    crate::policy::Policy::load_with(path, &|p| {
        crate::sys::limits::read_text(p, crate::sys::limits::MAX_POLICY_BYTES, "policy").map_err(
            |e| crate::policy::Unread {
                missing: e.is_not_found(),
                message: e.to_string(),
            },
        )
    })
}

/// The 1-based line of `key` in `[section]` (`None`: the top level, before any section), or
/// of the section's header when the key is absent (a default is in use), or `None`.
pub fn key_line(text: &str, section: Option<&str>, key: &str) -> Option<usize> {
    let mut current: Option<String> = None;
    let mut header = None;
    for (i, raw) in text.lines().enumerate() {
        let l = raw.trim();
        if let Some(rest) = l.strip_prefix('[') {
            let name = rest.trim_start_matches('[');
            let name = name.split(']').next().unwrap_or("").trim();
            current = Some(name.to_string());
            if section == Some(name) && header.is_none() {
                header = Some(i + 1);
            }
            continue;
        }
        if current.as_deref() != section {
            continue;
        }
        if let Some(rest) = l.strip_prefix(key)
            && rest.trim_start().starts_with('=')
        {
            return Some(i + 1);
        }
    }
    header
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, FileError> {
        Config::parse(Path::new("/etc/gpu-medic/config.toml"), text)
    }

    #[test]
    fn empty_file_gives_documented_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/gpu-medic"));
        assert_eq!(c.mps.pipe_directory, PathBuf::from("/run/mps-ecs"));
        assert_eq!(c.mps.probe_interval, Duration::from_secs(5));
        assert_eq!(c.nvml.library, "libnvidia-ml.so.1");
        assert!(c.aws.enabled && !c.dry_run);
    }

    #[test]
    fn durations_and_relative_paths() {
        let c = parse(
            "state_dir = \"state\"\n[mps]\nprobe_interval = \"10s\"\nprobe_timeout = \"1500ms\"\n",
        )
        .unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/etc/gpu-medic/state"));
        assert_eq!(c.mps.probe_timeout, Duration::from_millis(1500));
    }

    #[test]
    fn unknown_key_is_rejected_with_its_line() {
        let e = parse("dry_run = true\n\n[mps]\nprobe_intervall = \"5s\"\n").unwrap_err();
        assert_eq!(e.line, Some(4), "{e}");
        assert!(
            e.to_string().starts_with("/etc/gpu-medic/config.toml:4: "),
            "{e}"
        );
        assert!(e.message.contains("probe_intervall"), "{e}");
    }

    #[test]
    fn bad_duration_names_its_line() {
        let e = parse("[mps]\nprobe_interval = \"five seconds\"\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
    }

    #[test]
    fn timeout_must_be_shorter_than_interval() {
        let e = parse("[mps]\nprobe_interval = \"2s\"\nprobe_timeout = \"3s\"\n").unwrap_err();
        assert_eq!(e.line, Some(3), "{e}");
    }

    #[test]
    fn aws_sections_have_documented_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.ecs.agent_url, "http://127.0.0.1:51678");
        assert_eq!(c.ecs.attribute_prefix, "gpu-medic");
        assert_eq!(c.fleet.max_parallel, FleetLimit::Percent(20.0));
        assert_eq!(c.fleet.pause_tag, "gpu-medic/paused");
        assert_eq!(c.lifecycle.terminate_hook, "gpu-medic-terminate");
        assert!(!c.aws.replace_fallback_terminate);
    }

    #[test]
    fn the_reservation_alert_is_a_share_of_more_than_zero() {
        let p = Path::new("/x.toml");
        let c = Config::parse(p, "[nvml]\nreservation_alert = \"90%\"\n").unwrap();
        assert_eq!(c.nvml.reservation_alert, Share(90.0));
        assert_eq!(c.nvml.reservation_alert.of(1000), 900);
        assert_eq!(
            Config::parse(p, "").unwrap().nvml.reservation_alert,
            Share(100.0)
        );
        for bad in ["\"0%\"", "\"-5%\"", "\"2000%\"", "\"90\"", "90", "\"x%\""] {
            let e = Config::parse(p, &format!("[nvml]\nreservation_alert = {bad}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(":2:"), "{bad}: {e}");
        }
    }

    #[test]
    fn fleet_limits_take_counts_and_shares() {
        let c = parse("[fleet]\nmax_parallel = 2\nmax_unhealthy = \"50%\"\n").unwrap();
        assert_eq!(c.fleet.max_parallel, FleetLimit::Count(2));
        assert_eq!(c.fleet.max_unhealthy.of(10), 5);
        assert_eq!(FleetLimit::Percent(20.0).of(9), 1);
        assert_eq!(FleetLimit::Percent(20.0).of(8), 1);
        let e = parse("[fleet]\nmax_parallel = \"120%\"\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
        let e = parse("[ecs]\nattribute_prefix = \"gpu medic\"\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
        let e = parse("[fleet]\nmax_paralel = 2\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
    }

    #[test]
    fn mps_restart_keys_default_and_parse() {
        let c = parse("").unwrap();
        assert_eq!(c.mps.manage, MpsManage::Systemd);
        assert_eq!(c.mps.unit, "nvidia-mps.service");
        assert_eq!(c.mps.quit_timeout, Duration::from_secs(5));
        assert_eq!(c.mps.start_timeout, Duration::from_secs(10));
        assert_eq!(c.mps.default_active_thread_percentage, None);
        assert!(c.mps.pinned_limits().is_empty());
        assert_eq!(c.mps, MpsConfig::default());
        let c = parse(
            "[mps]\nmanage = \"direct\"\nunit = \"mps.service\"\n\
             default_active_thread_percentage = 25\n\
             default_pinned_device_mem_limit = \"0=2G, GPU-0a1b=512M\"\n\
             quit_timeout = \"1s\"\nstart_timeout = \"3s\"\n",
        )
        .unwrap();
        assert_eq!(c.mps.manage, MpsManage::Direct);
        assert_eq!(c.mps.default_active_thread_percentage, Some(25));
        assert_eq!(
            c.mps.pinned_limits(),
            vec![
                ("0".to_string(), "2G".to_string()),
                ("GPU-0a1b".to_string(), "512M".to_string())
            ]
        );
        assert_eq!(c.mps.start_timeout, Duration::from_secs(3));
    }

    #[test]
    fn bad_mps_restart_keys_name_their_line() {
        for (text, line) in [
            ("[mps]\nmanage = \"docker\"\n", 2),
            ("[mps]\n\ndefault_active_thread_percentage = 0\n", 3),
            ("[mps]\ndefault_active_thread_percentage = 101\n", 2),
            ("[mps]\ndefault_pinned_device_mem_limit = \"0=2T\"\n", 2),
            ("[mps]\ndefault_pinned_device_mem_limit = \"2G\"\n", 2),
            ("[mps]\ndefault_pinned_device_mem_limit = \"\"\n", 2),
            ("[mps]\nstart_timeout = \"0s\"\n", 2),
        ] {
            let e = parse(text).unwrap_err();
            assert_eq!(e.line, Some(line), "{text:?}: {e}");
        }
    }

    #[test]
    fn malformed_toml_names_its_line() {
        let e = parse("dry_run = true\n[nvml\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
    }
}
