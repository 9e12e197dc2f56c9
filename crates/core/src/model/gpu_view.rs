//! ECS's view of this instance's GPUs against NVML's, as the ECS GPU view probe
//! (crates/io/src/probe/ecs_gpus.rs) keeps it for `gpu-medic status` and `check`
//! (the daemon's `config::View::GpuView`).

use serde::{Deserialize, Serialize};

use super::{Observation, Timestamp};

/// Where the expected GPU count came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Expected {
    pub count: u32,
    /// `[nvml] expected_gpus` (set in the config) or `instance type p5.48xlarge`; never ECS's
    /// registered count (crates/io/src/probe/ecs_gpus.rs). Older views may say `registered
    /// with ECS`.
    pub source: String,
}

/// One GPU of the comparison, for `status` and `check`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLine {
    /// ECS's `gpuId`.
    pub id: String,
    /// NVML's index, where NVML knows the GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    /// `ok`, `lost` or `missing` (NVML does not see it).
    pub nvml: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing_mode: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub containers: Option<i64>,
    /// What ECS believes is free for new MPS tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecs_remaining_mib: Option<i64>,
    /// What NVML shows free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml_free_mib: Option<u64>,
}

/// The last comparison, kept in `state_dir/ecs-gpus.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Comparison {
    pub observed_at: Timestamp,
    pub ecs_count: u32,
    pub nvml_count: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected: Option<Expected>,
    pub gpus: Vec<GpuLine>,
    /// Every disagreement, as sent to the engine; the policy decides which are findings (a
    /// 4 MiB excess is below `ecs-gpu-memory-in-use`'s tolerance, a routine reading).
    pub observations: Vec<Observation>,
}
