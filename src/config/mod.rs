//! The daemon's configuration (`/etc/gpu-medic/config.toml`), parsed once at start.
//! Unknown keys are rejected and every error names the file and line, so a typo in an AMI
//! build fails the build instead of silently disabling a probe.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::sys::error::FileError;

mod evidence;
pub use evidence::{EvidenceConfig, SafeMode, Sse, valid_bucket};

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
}

/// Incidents shipped off the instance (`src/export`): every journal record to CloudWatch
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

/// Size-based rotation of `incidents.jsonl` and `inputs.jsonl`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalConfig {
    /// A journal file is rotated (`NAME.1`, `NAME.2`, ...) once it reaches this size, in MiB.
    #[serde(default = "default_journal_size", deserialize_with = "de_journal_size")]
    pub max_file_size_mib: u64,
    /// Rotated files kept per journal; the oldest beyond it is deleted.
    #[serde(default = "default_journal_keep")]
    pub keep_files: u32,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            max_file_size_mib: default_journal_size(),
            keep_files: default_journal_keep(),
        }
    }
}

fn default_journal_size() -> u64 {
    64
}

fn default_journal_keep() -> u32 {
    4
}

fn de_journal_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let v = u64::deserialize(d)?;
    if !(1..=1024 * 1024).contains(&v) {
        return Err(serde::de::Error::custom(format!(
            "max_file_size_mib: {v} is not in 1..=1048576"
        )));
    }
    Ok(v)
}

/// Checks of the node around the GPUs: the ECS agent (when `[aws]` is on) and the disk
/// holding `state_dir`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default = "default_node_interval", with = "humantime_serde")]
    pub interval: Duration,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            enabled: true,
            interval: default_node_interval(),
        }
    }
}

fn default_node_interval() -> Duration {
    Duration::from_secs(30)
}

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
    /// How many GPUs this instance type has; fewer is a fault. Unset: what ECS registered for
    /// the instance, else the instance type's count (`[ecs] gpu_view`, `[aws]` enabled).
    #[serde(default)]
    pub expected_gpus: Option<u32>,
    /// The kernel log, read for `NVRM: Xid` lines; `""` turns it off.
    #[serde(default = "default_kmsg")]
    pub kmsg: Option<PathBuf>,
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

fn de_positive_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let v: Duration = humantime_serde::deserialize(d)?;
    if v.is_zero() {
        return Err(serde::de::Error::custom("must be greater than zero"));
    }
    Ok(v)
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
    /// After SetInstanceHealth Unhealthy, terminate the instance through Auto Scaling
    /// (never decrementing desired capacity) if it has not started terminating within
    /// `replace_fallback_after`. Off by default: it bypasses the instance maintenance policy.
    #[serde(default)]
    pub replace_fallback_terminate: bool,
    #[serde(default = "default_replace_fallback_after", with = "humantime_serde")]
    pub replace_fallback_after: Duration,
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

/// The ECS side: the agent, our attribute names, how a drain is driven.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EcsConfig {
    /// The ECS agent's introspection API (cluster and container instance ARN).
    #[serde(default = "default_agent_url")]
    pub agent_url: String,
    /// How long identity discovery waits for the agent before falling back to `ecs_config`.
    #[serde(default = "default_agent_wait", with = "humantime_serde")]
    pub agent_wait: Duration,
    /// The agent's config file (`ECS_CLUSTER=`), the fallback when the agent does not answer.
    #[serde(default = "default_ecs_config_file")]
    pub ecs_config_file: PathBuf,
    /// Prefix of our container-instance attributes: `<prefix>.health`, `<prefix>.claim.<ms>`.
    #[serde(default = "default_attribute_prefix")]
    pub attribute_prefix: String,
    /// Standalone tasks (not started by a service) are stopped this long after the drain began.
    #[serde(default = "default_standalone_grace", with = "humantime_serde")]
    pub standalone_grace: Duration,
    /// How often a drain re-reads the instance and its tasks.
    #[serde(default = "default_drain_poll_interval", with = "humantime_serde")]
    pub drain_poll_interval: Duration,
    /// How long before the drain deadline every task still running is stopped.
    #[serde(default = "default_force_stop_lead", with = "humantime_serde")]
    pub force_stop_lead: Duration,
    /// How long a drain waits on an agent that ECS reports disconnected before giving up.
    #[serde(default = "default_agent_disconnected_wait", with = "humantime_serde")]
    pub agent_disconnected_wait: Duration,
    /// Compare ECS's view of this instance's GPUs (DescribeContainerInstances `gpuDevices`)
    /// with NVML's, and default `[nvml] expected_gpus` from it (only with `[aws]` enabled).
    #[serde(default = "yes")]
    pub gpu_view: bool,
    /// How often ECS's view is read (also after every GPU signal, at most every 10 s).
    #[serde(default = "default_gpu_view_interval", with = "humantime_serde")]
    pub gpu_view_interval: Duration,
}

/// The fleet budget: how much of the Auto Scaling group may be in remediation at once.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// Most instances in remediation at once: a count (`2`) or a share of desired capacity
    /// (`"20%"`); never less than 1.
    #[serde(default = "default_fleet_share")]
    pub max_parallel: FleetLimit,
    /// Circuit breaker: with more unhealthy instances than this (fleets over 5 instances), no
    /// drain or replace starts; instances stay quarantined.
    #[serde(default = "default_fleet_share")]
    pub max_unhealthy: FleetLimit,
    /// An instance registered with ECS less recently than this counts as in remediation.
    #[serde(default = "default_warmup", with = "humantime_serde")]
    pub warmup: Duration,
    /// An Auto Scaling group tag that pauses drains and replacements (value `true`).
    #[serde(default = "default_pause_tag")]
    pub pause_tag: String,
    /// How long a new claim settles before the claims are re-read and ranked.
    #[serde(default = "default_claim_settle", with = "humantime_serde")]
    pub claim_settle: Duration,
    /// A claim on an instance that never started draining expires after this.
    #[serde(default = "default_claim_ttl", with = "humantime_serde")]
    pub claim_ttl: Duration,
    /// When a full budget, the breaker or a kill switch defers a step, retry after about this
    /// long (with jitter).
    #[serde(default = "default_fleet_retry_after", with = "humantime_serde")]
    pub retry_after: Duration,
    /// The DynamoDB table of the slot protocol (models/README.md); unset: the claim protocol
    /// on container instance attributes.
    #[serde(default, deserialize_with = "de_table_name")]
    pub table: Option<String>,
    /// Slot table: a reservation this gpu-medic has seen unchanged for this long (its own
    /// monotonic clock) may be taken over. Only has to exceed reserve-to-commit (two writes).
    #[serde(default = "default_reservation_lifetime", with = "humantime_serde")]
    pub reservation_lifetime: Duration,
}

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

/// A number of instances, or a share of the Auto Scaling group's desired capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FleetLimit {
    Count(u32),
    Percent(f64),
}

impl FleetLimit {
    /// The limit for a group of `desired` instances (shares round down).
    pub fn of(self, desired: u32) -> u32 {
        match self {
            FleetLimit::Count(c) => c,
            FleetLimit::Percent(p) => ((p / 100.0) * f64::from(desired)).floor() as u32,
        }
    }

    pub fn parse(s: &str) -> Result<FleetLimit, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("bad share {s:?}: expected e.g. \"20%\""))?;
            if !(0.0..=100.0).contains(&v) {
                return Err(format!("bad share {s:?}: must be between 0% and 100%"));
            }
            return Ok(FleetLimit::Percent(v));
        }
        t.parse()
            .map(FleetLimit::Count)
            .map_err(|_| format!("bad limit {s:?}: expected a count (2) or a share (\"20%\")"))
    }
}

impl std::fmt::Display for FleetLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FleetLimit::Count(c) => write!(f, "{c}"),
            FleetLimit::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl<'de> Deserialize<'de> for FleetLimit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = FleetLimit;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a count (2) or a share of desired capacity (\"20%\")")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<FleetLimit, E> {
                u32::try_from(v)
                    .map(FleetLimit::Count)
                    .map_err(|_| E::custom(format!("bad limit {v}: must be 0 or more")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<FleetLimit, E> {
                u32::try_from(v)
                    .map(FleetLimit::Count)
                    .map_err(|_| E::custom(format!("bad limit {v}: too large")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<FleetLimit, E> {
                FleetLimit::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
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
fn default_kmsg() -> Option<PathBuf> {
    Some(PathBuf::from("/dev/kmsg"))
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
fn default_mps_unit() -> String {
    "nvidia-mps.service".to_string()
}
fn default_quit_timeout() -> Duration {
    Duration::from_secs(5)
}
fn default_start_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_replace_fallback_after() -> Duration {
    Duration::from_secs(600)
}
fn default_agent_url() -> String {
    "http://127.0.0.1:51678".to_string()
}
fn default_agent_wait() -> Duration {
    Duration::from_secs(30)
}
fn default_ecs_config_file() -> PathBuf {
    PathBuf::from("/etc/ecs/ecs.config")
}
fn default_attribute_prefix() -> String {
    "gpu-medic".to_string()
}
fn default_standalone_grace() -> Duration {
    Duration::from_secs(120)
}
fn default_drain_poll_interval() -> Duration {
    Duration::from_secs(10)
}
fn default_force_stop_lead() -> Duration {
    Duration::from_secs(90)
}
fn default_agent_disconnected_wait() -> Duration {
    Duration::from_secs(120)
}
fn default_gpu_view_interval() -> Duration {
    Duration::from_secs(300)
}
fn default_fleet_share() -> FleetLimit {
    FleetLimit::Percent(20.0)
}
fn default_warmup() -> Duration {
    Duration::from_secs(900)
}
fn default_pause_tag() -> String {
    "gpu-medic/paused".to_string()
}
fn default_claim_settle() -> Duration {
    Duration::from_secs(10)
}
fn default_claim_ttl() -> Duration {
    Duration::from_secs(900)
}
fn default_fleet_retry_after() -> Duration {
    Duration::from_secs(60)
}
fn default_reservation_lifetime() -> Duration {
    Duration::from_secs(30)
}

/// A DynamoDB table name: 3 to 255 of `[A-Za-z0-9_.-]`, or a table ARN (DynamoDB accepts
/// either as `TableName`). A typo is caught at startup, not on the first fault.
fn de_table_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let s = String::deserialize(d)?;
    let name = s.strip_prefix("arn:").map_or(s.as_str(), |arn| {
        arn.rsplit_once(":table/").map_or("", |(_, n)| n)
    });
    let ok = (3..=255).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !ok {
        return Err(serde::de::Error::custom(format!(
            "{s:?} is not a DynamoDB table name (3 to 255 of A-Z a-z 0-9 _ - .) or table ARN"
        )));
    }
    Ok(Some(s))
}
fn default_terminate_hook() -> String {
    "gpu-medic-terminate".to_string()
}
fn default_launch_hook() -> String {
    "gpu-medic-launch".to_string()
}

impl Default for NvmlConfig {
    fn default() -> Self {
        NvmlConfig {
            enabled: true,
            library: default_nvml_library(),
            poll_interval: default_poll(),
            expected_gpus: None,
            kmsg: default_kmsg(),
            reservation_alert: default_reservation_alert(),
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

impl Default for AwsConfig {
    fn default() -> Self {
        AwsConfig {
            enabled: true,
            region: None,
            endpoint_url: None,
            replace_fallback_terminate: false,
            replace_fallback_after: default_replace_fallback_after(),
        }
    }
}

impl Default for EcsConfig {
    fn default() -> Self {
        EcsConfig {
            agent_url: default_agent_url(),
            agent_wait: default_agent_wait(),
            ecs_config_file: default_ecs_config_file(),
            attribute_prefix: default_attribute_prefix(),
            standalone_grace: default_standalone_grace(),
            drain_poll_interval: default_drain_poll_interval(),
            force_stop_lead: default_force_stop_lead(),
            agent_disconnected_wait: default_agent_disconnected_wait(),
            gpu_view: true,
            gpu_view_interval: default_gpu_view_interval(),
        }
    }
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            max_parallel: default_fleet_share(),
            max_unhealthy: default_fleet_share(),
            warmup: default_warmup(),
            pause_tag: default_pause_tag(),
            claim_settle: default_claim_settle(),
            claim_ttl: default_claim_ttl(),
            retry_after: default_fleet_retry_after(),
            table: None,
            reservation_lifetime: default_reservation_lifetime(),
        }
    }
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
        if self.mps.probe_timeout >= self.mps.probe_interval {
            return Err(FileError::new(
                path,
                key_line(text, Some("mps"), "probe_timeout"),
                "probe_timeout: must be shorter than probe_interval",
            ));
        }
        self.check_aws(path, &line_of_key)?;
        self.check_export(path, text)?;
        self.evidence.check(path, text)?;
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
        let table: [(Option<&str>, &str, Duration, Duration, Duration); 23] = [
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

/// `WatchdogSec` of the packaged `gpu-medic.service` (a test keeps the two equal).
pub const PACKAGED_WATCHDOG: Duration = Duration::from_secs(30);
/// The longest tick: half the packaged watchdog, so one missed ping is not fatal.
pub const MAX_TICK: Duration = Duration::from_secs(15);

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
