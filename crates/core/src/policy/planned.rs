//! What the engine does about disruptions AWS plans (docs/planned-events.md): the operator's
//! choices from `[planned]` in the config, handed to the engine with the policy.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What a rebalance recommendation leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Rebalance {
    /// Recorded only.
    #[default]
    Log,
    /// Drained, within the fleet budget (a recommendation is no deadline).
    Drain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlannedRules {
    /// A scheduled event's drain starts this long before its NotBefore.
    pub lead: Duration,
    /// A planned drain ends this long before AWS acts.
    pub margin: Duration,
    /// Retirement and stop events: replace through Auto Scaling after the drain.
    pub replace_on_stop: bool,
    pub rebalance: Rebalance,
}

impl Default for PlannedRules {
    fn default() -> Self {
        PlannedRules {
            lead: Duration::from_secs(30 * 60),
            margin: Duration::from_secs(15),
            replace_on_stop: true,
            rebalance: Rebalance::Log,
        }
    }
}
