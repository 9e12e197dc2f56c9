//! Senses: each probe turns part of the world into `Observation`s. A probe never decides
//! anything; it reports what it saw, and degrades to an observation or a warning (never a
//! panic) when its source is missing.

use crate::config::Config;
use crate::model::Observation;

/// A probe that can also answer once, for `gpu-medic check` and the launch gate.
pub trait Snapshot {
    fn name(&self) -> &'static str;
    /// What the probe sees right now. `Err` means it could not look.
    fn snapshot(&mut self) -> Result<Vec<Observation>, ProbeError>;
}

/// Why a probe could not look. `retryable` says whether looking again may succeed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{probe}: {message}")]
pub struct ProbeError {
    pub probe: &'static str,
    pub message: String,
    pub retryable: bool,
}

/// The one-shot probes enabled by `cfg`.
pub fn snapshot_probes(cfg: &Config) -> Vec<Box<dyn Snapshot>> {
    let _ = cfg;
    Vec::new()
}
