//! The daemon's configuration (`/etc/gpu-medic/config.toml`), parsed once at start.
//! Unknown keys are rejected and every error names the file and line, so a typo in an AMI
//! build fails the build instead of silently disabling a probe.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::error::FileError;

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
}

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
    /// How many GPUs this instance type has; fewer is a fault. Unset: not checked.
    #[serde(default)]
    pub expected_gpus: Option<u32>,
}

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
    #[serde(default = "default_probe_interval", with = "humantime_serde")]
    pub probe_interval: Duration,
    #[serde(default = "default_probe_timeout", with = "humantime_serde")]
    pub probe_timeout: Duration,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AwsConfig {
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Overrides the region from the environment or IMDS.
    #[serde(default)]
    pub region: Option<String>,
    /// Overrides every service endpoint (tests, VPC endpoints). The standard
    /// `AWS_ENDPOINT_URL*` variables work when this is unset.
    #[serde(default)]
    pub endpoint_url: Option<String>,
}

/// Optional overrides of identity discovery (IMDS, the ECS agent, Auto Scaling).
#[derive(Debug, Clone, PartialEq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    #[serde(default)]
    pub instance_id: Option<String>,
    #[serde(default)]
    pub cluster: Option<String>,
    #[serde(default)]
    pub container_instance_arn: Option<String>,
    #[serde(default)]
    pub auto_scaling_group: Option<String>,
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
fn default_nvml_library() -> String {
    "libnvidia-ml.so.1".to_string()
}
fn default_poll() -> Duration {
    Duration::from_secs(10)
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

impl Default for NvmlConfig {
    fn default() -> Self {
        NvmlConfig {
            enabled: true,
            library: default_nvml_library(),
            poll_interval: default_poll(),
            expected_gpus: None,
        }
    }
}

impl Default for MpsConfig {
    fn default() -> Self {
        MpsConfig {
            enabled: true,
            control_binary: default_control_binary(),
            pipe_directory: default_pipe_directory(),
            log_directory: default_log_directory(),
            probe_interval: default_probe_interval(),
            probe_timeout: default_probe_timeout(),
        }
    }
}

impl Default for AwsConfig {
    fn default() -> Self {
        AwsConfig {
            enabled: true,
            region: None,
            endpoint_url: None,
        }
    }
}

impl Config {
    /// Reads and checks a config file. Relative paths inside it are resolved against its folder.
    pub fn load(path: &Path) -> Result<Config, FileError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| FileError::new(path, None, format!("cannot read config: {e}")))?;
        Config::parse(path, &text)
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
        let positive = [
            ("tick_interval", self.tick_interval),
            ("poll_interval", self.nvml.poll_interval),
            ("probe_interval", self.mps.probe_interval),
            ("probe_timeout", self.mps.probe_timeout),
        ];
        for (key, d) in positive {
            if d.is_zero() {
                return Err(FileError::new(
                    path,
                    line_of_key(key),
                    format!("{key}: must be greater than zero"),
                ));
            }
        }
        if self.mps.probe_timeout >= self.mps.probe_interval {
            return Err(FileError::new(
                path,
                line_of_key("probe_timeout"),
                "probe_timeout: must be shorter than probe_interval",
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

    pub fn incidents_path(&self) -> PathBuf {
        self.state_dir.join("incidents.jsonl")
    }

    pub fn inputs_path(&self) -> PathBuf {
        self.state_dir.join("inputs.jsonl")
    }

    pub fn state_path(&self) -> PathBuf {
        self.state_dir.join("state.json")
    }
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
    fn malformed_toml_names_its_line() {
        let e = parse("dry_run = true\n[nvml\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
    }
}
