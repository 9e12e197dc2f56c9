//! `[aws]`, `[identity]`, `[ecs]`: AWS remediation, who this instance is, and how ECS is
//! driven (attributes, drains, the agent).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::yes;

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

/// Six hours: at 10,000 instances about 0.5 DescribeContainerInstances a second in a
/// Region, 2 % of ECS's read rate (docs/fleet-scale.md); GPU signals read it sooner.
fn default_gpu_view_interval() -> Duration {
    Duration::from_secs(6 * 3600)
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
