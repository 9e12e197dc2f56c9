//! `[mps]`: the MPS control daemon: where it is, how it is probed, managed and restarted.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use super::{de_positive_duration, yes};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MpsConfig {
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default = "default_control_binary")]
    pub control_binary: PathBuf,
    #[serde(default = "default_pipe_directory")]
    pub pipe_directory: PathBuf,
    #[serde(default = "default_log_directory")]
    pub log_directory: PathBuf,
    /// Where the daemon's lines are read from: the journal of `unit` (a daemon run with
    /// `-f`), the files in `log_directory` (a daemon run with `-d`), or both (`auto`).
    #[serde(default)]
    pub logs: MpsLogs,
    /// Read journal files from this directory (`journalctl --directory`) instead of the
    /// system journal: a host journal mounted into a container.
    #[serde(default)]
    pub journal_directory: Option<PathBuf>,
    /// A set of defaults for a known platform; `ecs-ami` is the ECS GPU AMI's
    /// `nvidia-mps.service`.
    #[serde(default)]
    pub preset: Option<MpsPreset>,
    #[serde(default = "default_probe_interval", with = "humantime_serde")]
    pub probe_interval: Duration,
    #[serde(default = "default_probe_timeout", with = "humantime_serde")]
    pub probe_timeout: Duration,
    /// Who (re)starts the daemon: systemd (`systemctl restart <unit>`) or gpu-medic itself
    /// (`control_binary -d`).
    #[serde(default)]
    pub manage: MpsManage,
    /// The systemd unit that runs the daemon (`manage = "systemd"`).
    #[serde(default = "default_mps_unit")]
    pub unit: String,
    /// Re-applied after every restart (`set_default_active_thread_percentage`), 1-100.
    #[serde(default, deserialize_with = "de_percentage")]
    pub default_active_thread_percentage: Option<u32>,
    /// Re-applied after every restart (`set_default_device_pinned_mem_limit`), in the
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` format: `"0=2G,1=512M"` (device ordinal or UUID,
    /// size in G or M).
    #[serde(default, deserialize_with = "de_pinned_limits")]
    pub default_pinned_device_mem_limit: Option<String>,
    /// How long a graceful `quit` may take before the daemon is signalled.
    #[serde(default = "default_quit_timeout", with = "humantime_serde")]
    pub quit_timeout: Duration,
    /// How long a started daemon may take to answer a probe.
    #[serde(
        default = "default_start_timeout",
        deserialize_with = "de_positive_duration"
    )]
    pub start_timeout: Duration,
}

/// Where the daemon's log lines are read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MpsLogs {
    /// The systemd journal of `unit` (`journalctl`), for a daemon run with `-f`.
    Journald,
    /// `control.log` and `server.log` in `log_directory`, for a daemon run with `-d`.
    Files,
    /// The files, and the journal of `unit` when `manage = "systemd"`.
    #[default]
    Auto,
}

impl MpsLogs {
    pub fn as_str(self) -> &'static str {
        match self {
            MpsLogs::Journald => "journald",
            MpsLogs::Files => "files",
            MpsLogs::Auto => "auto",
        }
    }
}

/// A platform whose daemon gpu-medic knows how it is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MpsPreset {
    /// The Amazon ECS GPU AMI: `nvidia-mps.service` (`nvidia-cuda-mps-control -f`,
    /// `Restart=always`), pipe directory `/run/mps-ecs`, lines in the journal.
    EcsAmi,
}

/// The ECS GPU AMI's pipe directory and unit (docs/mps.md#the-daemon-on-the-ecs-gpu-ami).
pub const ECS_AMI_PIPE: &str = "/run/mps-ecs";

pub const ECS_AMI_UNIT: &str = "nvidia-mps.service";

/// How the MPS control daemon is run on this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MpsManage {
    /// A systemd unit runs it (the ECS GPU AMI's `nvidia-mps.service`).
    #[default]
    Systemd,
    /// gpu-medic starts it with `control_binary -d`.
    Direct,
}

impl MpsConfig {
    /// Whether the journal of `unit` is read.
    pub fn reads_journal(&self) -> bool {
        match self.logs {
            MpsLogs::Journald => true,
            MpsLogs::Files => false,
            MpsLogs::Auto => self.manage == MpsManage::Systemd,
        }
    }

    /// Whether the files in `log_directory` are tailed.
    pub fn reads_files(&self) -> bool {
        match self.logs {
            MpsLogs::Journald => false,
            MpsLogs::Files => true,
            // The AMI's daemon runs with -f: there are no files to tail.
            MpsLogs::Auto => self.preset != Some(MpsPreset::EcsAmi),
        }
    }

    /// What the config says that does not fit its preset, for a warning at start: each a
    /// plain sentence. Nothing for a config without a preset.
    pub fn preset_warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.preset != Some(MpsPreset::EcsAmi) {
            return out;
        }
        if let Some(p) = self.default_active_thread_percentage {
            out.push(format!(
                "[mps] default_active_thread_percentage = {p} under preset \"ecs-ami\": ECS sets CUDA_MPS_ACTIVE_THREAD_PERCENTAGE per container from the task definition, and a daemon-wide default caps every container that asked for none; remove it"
            ));
        }
        if let Some(l) = &self.default_pinned_device_mem_limit {
            out.push(format!(
                "[mps] default_pinned_device_mem_limit = {l:?} under preset \"ecs-ami\": ECS sets CUDA_MPS_PINNED_DEVICE_MEM_LIMIT per container from the task definition, and a daemon-wide default caps every container that asked for none; remove it"
            ));
        }
        if self.pipe_directory != Path::new(ECS_AMI_PIPE) {
            out.push(format!(
                "[mps] pipe_directory = {:?} under preset \"ecs-ami\": the AMI's daemon listens in {ECS_AMI_PIPE}",
                self.pipe_directory.display()
            ));
        }
        if self.unit != ECS_AMI_UNIT {
            out.push(format!(
                "[mps] unit = {:?} under preset \"ecs-ami\": the AMI's unit is {ECS_AMI_UNIT}",
                self.unit
            ));
        }
        if self.manage != MpsManage::Systemd {
            out.push(
                "[mps] manage = \"direct\" under preset \"ecs-ami\": systemd runs the AMI's daemon and restarts it itself; gpu-medic would race it".into(),
            );
        }
        if !self.reads_journal() {
            out.push(
                "[mps] logs = \"files\" under preset \"ecs-ami\": the AMI's daemon runs with -f and writes no log files; server faults and crash loops are only in the journal".into(),
            );
        }
        out
    }

    /// `default_pinned_device_mem_limit` as `(device, size)` pairs, e.g. `("0", "2G")`.
    pub fn pinned_limits(&self) -> Vec<(String, String)> {
        self.default_pinned_device_mem_limit
            .as_deref()
            .and_then(|s| parse_pinned_limits(s).ok())
            .unwrap_or_default()
    }
}

/// Parses `"0=2G,1=512M"`: device ordinal or UUID, size as digits plus `G` or `M`.
pub fn parse_pinned_limits(s: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (dev, size) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?}: expected <device>=<size>, e.g. 0=2G"))?;
        let (dev, size) = (dev.trim(), size.trim());
        if dev.is_empty() || !dev.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(format!("{part:?}: device must be an ordinal or a GPU UUID"));
        }
        let digits = size.strip_suffix(['G', 'M']).unwrap_or("");
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(format!(
                "{part:?}: size must be digits then G or M, e.g. 512M"
            ));
        }
        out.push((dev.to_string(), size.to_string()));
    }
    if out.is_empty() {
        return Err("empty limit list; omit the key instead".into());
    }
    Ok(out)
}

fn de_percentage<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let v = Option::<u32>::deserialize(d)?;
    match v {
        Some(p) if !(1..=100).contains(&p) => Err(serde::de::Error::custom(format!(
            "default_active_thread_percentage: {p} is not in 1..=100"
        ))),
        v => Ok(v),
    }
}

fn de_pinned_limits<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let v = Option::<String>::deserialize(d)?;
    if let Some(s) = &v {
        parse_pinned_limits(s).map_err(|e| {
            serde::de::Error::custom(format!("default_pinned_device_mem_limit: {e}"))
        })?;
    }
    Ok(v)
}

fn default_control_binary() -> PathBuf {
    PathBuf::from("nvidia-cuda-mps-control")
}

fn default_pipe_directory() -> PathBuf {
    PathBuf::from("/run/mps-ecs")
}

fn default_log_directory() -> PathBuf {
    PathBuf::from("/var/log/nvidia-mps")
}

fn default_probe_interval() -> Duration {
    Duration::from_secs(5)
}

fn default_probe_timeout() -> Duration {
    Duration::from_secs(3)
}

fn default_mps_unit() -> String {
    "nvidia-mps.service".to_string()
}

fn default_quit_timeout() -> Duration {
    Duration::from_secs(5)
}

fn default_start_timeout() -> Duration {
    Duration::from_secs(10)
}

impl Default for MpsConfig {
    fn default() -> Self {
        MpsConfig {
            enabled: true,
            control_binary: default_control_binary(),
            pipe_directory: default_pipe_directory(),
            log_directory: default_log_directory(),
            logs: MpsLogs::default(),
            journal_directory: None,
            preset: None,
            probe_interval: default_probe_interval(),
            probe_timeout: default_probe_timeout(),
            manage: MpsManage::default(),
            unit: default_mps_unit(),
            default_active_thread_percentage: None,
            default_pinned_device_mem_limit: None,
            quit_timeout: default_quit_timeout(),
            start_timeout: default_start_timeout(),
        }
    }
}
