//! What the link probes saw at their latest look, as `status` and the metrics show it: the
//! fabric, NVLinks and PCIe link of each GPU (`links.json`, written by the NVML poll) and the
//! EFA / RDMA ports (`ports.json`, written by the port watch). Plain data: the probes fill it
//! (crates/io/src/probe/nvml/links.rs, crates/io/src/probe/efa.rs), `status` and crates/io/src/metrics.rs read it back
//! through the daemon's `config::StateDir`. docs/fabric.md says what each field comes from.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// At most this much of `links.json` is read back (64 GPUs of a few hundred bytes each).
pub const MAX_LINKS_VIEW_BYTES: u64 = 256 * 1024;

/// At most this much of `ports.json` is read back (16 ports of up to 256 counters each).
pub const MAX_PORTS_VIEW_BYTES: u64 = 1024 * 1024;

/// What one GPU's links look like at a poll (for `status` and metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLinks {
    pub index: u32,
    /// `not-started`, `in-progress`, `completed`; absent where the GPU has no fabric.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fabric_state: Option<String>,
    #[serde(default)]
    pub fabric_status: u32,
    #[serde(default)]
    pub clique_id: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cluster_uuid: String,
    /// NVLinks that answered, and those of them down.
    #[serde(default)]
    pub nvlinks: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlinks_down: Vec<u32>,
    /// Worst link's CRC, replay and recovery errors per minute over the window.
    #[serde(default)]
    pub nvlink_crc_per_min: u64,
    #[serde(default)]
    pub nvlink_replay_per_min: u64,
    #[serde(default)]
    pub nvlink_recovery_per_min: u64,
    /// PCIe `[current generation, current width, maximum generation, maximum width]` (0:
    /// unknown).
    #[serde(default)]
    pub pcie: [u32; 4],
    #[serde(default)]
    pub pcie_replays_per_min: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistence: Option<bool>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub clock_event_reasons: Vec<String>,
}

/// One port at one look.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Port {
    pub device: String,
    pub port: String,
    /// `ACTIVE`, `DOWN`, `INIT`, ... (the name after `N: `).
    pub state: String,
    /// Error counters by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub errors: BTreeMap<String, u64>,
}
