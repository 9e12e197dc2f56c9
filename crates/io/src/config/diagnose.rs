//! `[diagnose]`: the active test of the GPUs (`gpu-medic diagnose`, docs/diagnose.md) and where
//! the daemon runs it: after a reboot's boot check, at the launch gate, and after the drain of
//! a `drain` verdict, before the node is trusted with tasks again.
//!
//! - `dcgmi`: DCGM's command-line client; `""` turns the DCGM tier off. Where it is not
//!   installed the tier says so and tells nothing (never a pass, never a fault).
//! - `dcgm_host`: the host engine dcgmi reaches; `"auto"` finds the ECS GPU AMI's socket.
//! - `cuda_library`: the driver's `libcuda.so.1` for the built-in check; `""` turns it off.
//! - `level`, `launch_level`: how deep (`quick`, `standard`, `long`: DCGM's `-r 1|2|3`).
//! - `timeout`: each tier's deadline; at it the tier's whole process tree is killed and the
//!   answer is "could not tell". At the launch gate it is cut to what is left of
//!   `[lifecycle] check_deadline`. How long a diagnosis that could not tell is tried again, and
//!   what follows, is the policy's `[diagnose]` (`retry_within`, `boot_on_unknown`): the
//!   engine decides it.
//! - `through_mps`: the CUDA check runs as a client of the node's MPS daemon (`[mps]
//!   pipe_directory`) when gpu-medic manages MPS: proof that the MPS server starts and serves
//!   each GPU, which is what ECS tasks need.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::model::diagnosis::Level;

/// Where the AL2023 ECS GPU AMI's nv-hostengine listens (its `install-dcgm.sh` overrides the
/// unit to a Unix socket; aws/amazon-ecs-ami, release 20260708).
pub const AMI_HOSTENGINE: &str = "/run/nvidia-dcgm/nv-hostengine";

/// The longest a tier may run: DCGM's long level takes tens of minutes on a large GPU.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(2 * 3600);

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiagnoseConfig {
    #[serde(default = "default_dcgmi")]
    pub dcgmi: PathBuf,
    /// The host engine `dcgmi` talks to (`--host`): `"auto"` (the ECS GPU AMI's socket
    /// [`AMI_HOSTENGINE`] when it exists, else dcgmi's default, which falls back to an
    /// embedded engine), `""` (dcgmi's default), or an address (`unix:///path`, `host:port`).
    #[serde(default = "default_dcgm_host")]
    pub dcgm_host: String,
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
            dcgm_host: default_dcgm_host(),
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

    /// The `--host` to give dcgmi, if any.
    pub fn dcgm_host(&self) -> Option<String> {
        match self.dcgm_host.as_str() {
            "" => None,
            "auto" => std::path::Path::new(AMI_HOSTENGINE)
                .exists()
                .then(|| format!("unix://{AMI_HOSTENGINE}")),
            h => Some(h.to_string()),
        }
    }

    /// Whether any tier is configured at all.
    pub fn enabled(&self) -> bool {
        self.dcgmi().is_some() || self.cuda_library().is_some()
    }
}

fn default_dcgmi() -> PathBuf {
    PathBuf::from("/usr/bin/dcgmi")
}

fn default_dcgm_host() -> String {
    "auto".into()
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
