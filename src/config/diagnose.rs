//! `[diagnose]`: the active test of the GPUs (`gpu-medic diagnose`, docs/diagnose.md) and where
//! the daemon runs it: after a reboot's boot check, at the launch gate, and after the drain of
//! a `drain` verdict, before the node is trusted with tasks again.
//!
//! - `dcgmi`: DCGM's command-line client; `""` turns the DCGM tier off. Where it is not
//!   installed the tier says so and tells nothing (never a pass, never a fault).
//! - `cuda_library`: the driver's `libcuda.so.1` for the built-in check; `""` turns it off.
//! - `level`, `launch_level`: how deep (`quick`, `standard`, `long`: DCGM's `-r 1|2|3`).
//! - `timeout`: each tier's deadline; at it the tier's whole process tree is killed and the
//!   answer is "could not tell".
//! - `through_mps`: the CUDA check runs as a client of the node's MPS daemon (`[mps]
//!   pipe_directory`) when gpu-medic manages MPS: proof that the MPS server starts and serves
//!   each GPU, which is what ECS tasks need.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::model::diagnosis::Level;

/// The longest a tier may run: DCGM's long level takes tens of minutes on a large GPU.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(2 * 3600);

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiagnoseConfig {
    #[serde(default = "default_dcgmi")]
    pub dcgmi: PathBuf,
    #[serde(default = "default_cuda_library")]
    pub cuda_library: PathBuf,
    /// After a reboot, after a drain and on suspicion.
    #[serde(default = "default_level")]
    pub level: Level,
    /// The launch gate's (`check --lifecycle`), under the hook's heartbeats.
    #[serde(default = "default_level")]
    pub launch_level: Level,
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    #[serde(default = "super::yes")]
    pub through_mps: bool,
}

impl Default for DiagnoseConfig {
    fn default() -> Self {
        DiagnoseConfig {
            dcgmi: default_dcgmi(),
            cuda_library: default_cuda_library(),
            level: default_level(),
            launch_level: default_level(),
            timeout: default_timeout(),
            through_mps: true,
        }
    }
}

impl DiagnoseConfig {
    /// `dcgmi`, unless turned off.
    pub fn dcgmi(&self) -> Option<PathBuf> {
        Some(self.dcgmi.clone()).filter(|p| !p.as_os_str().is_empty())
    }

    /// The CUDA library, unless turned off.
    pub fn cuda_library(&self) -> Option<PathBuf> {
        Some(self.cuda_library.clone()).filter(|p| !p.as_os_str().is_empty())
    }

    /// Whether any tier is configured at all.
    pub fn enabled(&self) -> bool {
        self.dcgmi().is_some() || self.cuda_library().is_some()
    }
}

fn default_dcgmi() -> PathBuf {
    PathBuf::from("/usr/bin/dcgmi")
}

fn default_cuda_library() -> PathBuf {
    PathBuf::from("libcuda.so.1")
}

fn default_level() -> Level {
    Level::Quick
}

fn default_timeout() -> Duration {
    Duration::from_secs(600)
}
