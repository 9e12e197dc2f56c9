//! What the fleet budget saw of the group at its last read, as an order's outcome carries
//! it to the engine, the journal and the metrics (`gpu_medic_fleet_budget_in_use`,
//! `gpu_medic_fleet_budget_capacity`). Plain data: the budget remedy fills it
//! (crates/io/src/remedy/budget/mod.rs), crates/io/src/metrics.rs reads it from the outcome.

use serde::{Deserialize, Serialize};

use super::Timestamp;

/// The group as the fleet budget judged it for one drain or replacement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetBudgetView {
    /// `Auto Scaling group <name>`, or `cluster <name>` outside any group.
    pub group: String,
    /// Desired capacity of the group.
    pub desired: u32,
    /// How many instances may be in remediation at once (`[fleet]` of desired capacity).
    pub capacity: u32,
    /// How many were in remediation (draining, Unhealthy, a live claim, a replacement not
    /// yet in the group) when the budget read the group.
    pub in_use: u32,
    pub observed_at: Timestamp,
}
