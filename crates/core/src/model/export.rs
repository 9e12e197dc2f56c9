//! How far the incident export is behind the journal, per lane, as the exporter
//! (crates/io/src/export/mod.rs) publishes it after each round and crates/io/src/metrics.rs reads it at each
//! scrape (`gpu_medic_export_lag_seconds`, `gpu_medic_export_lag_records`). Plain data.

use serde::{Deserialize, Serialize};

use super::Timestamp;

/// One lane's standing after its last round.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportLag {
    /// `logs` (CloudWatch Logs) or `events` (EventBridge).
    pub lane: String,
    /// Journal lines not yet delivered when the last round ended (0: caught up).
    pub records: u64,
    /// When the oldest record not yet delivered was journaled (None: caught up).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behind_since: Option<Timestamp>,
}

impl ExportLag {
    /// Seconds the lane is behind at `now`: how long the oldest record not yet delivered
    /// has waited (0 when caught up).
    pub fn seconds_at(&self, now: Timestamp) -> u64 {
        self.behind_since.map_or(0, |t| now.since(t).as_secs())
    }
}
