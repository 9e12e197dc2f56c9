//! DCGM's diagnostics through `dcgmi diag -r N -j` (docs/diagnose.md).

use std::path::PathBuf;
use std::time::Duration;

use crate::model::diagnosis::{GpuDiagnosis, Level, Tier, TierRun};

#[derive(Debug, Clone)]
pub struct DcgmPlan {
    pub binary: PathBuf,
    pub level: Level,
    /// NVML indexes to test; `None`: every GPU DCGM sees.
    pub gpus: Option<Vec<u32>>,
    pub timeout: Duration,
}

/// Runs `dcgmi diag` and reads its JSON. Not written yet: tells nothing.
pub fn run(plan: &DcgmPlan) -> (TierRun, Vec<GpuDiagnosis>) {
    let _ = plan;
    super::off(Tier::Dcgm, "not built yet")
}
