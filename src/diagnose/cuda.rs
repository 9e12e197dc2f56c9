//! The built-in CUDA check through the driver's `libcuda.so.1` (docs/diagnose.md).

use std::path::PathBuf;
use std::time::Duration;

use crate::model::diagnosis::{GpuDiagnosis, Level, Tier, TierRun};

#[derive(Debug, Clone)]
pub struct CudaPlan {
    /// The driver's library (`libcuda.so.1`, found by the dynamic loader, or a path).
    pub library: PathBuf,
    pub level: Level,
    /// The GPUs asked for (NVML index, UUID); empty: every GPU the driver lists.
    pub gpus: Vec<(u32, String)>,
    pub timeout: Duration,
    /// The node's MPS pipe directory when the check is to run as an MPS client.
    pub mps_pipe: Option<PathBuf>,
    /// The gpu-medic binary whose hidden worker command runs the check in a child.
    pub exe: PathBuf,
}

/// Runs the check in a child process. Not written yet: tells nothing.
pub fn run(plan: &CudaPlan) -> (TierRun, Vec<GpuDiagnosis>) {
    let _ = plan;
    super::off(Tier::Cuda, "not built yet")
}
