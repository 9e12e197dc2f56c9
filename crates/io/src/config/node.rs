//! `[node]`: the node probe (the ECS agent answering, space for the journal).

use std::time::Duration;

use serde::Deserialize;

use super::yes;

/// Checks of the node around the GPUs: the ECS agent (when `[aws]` is on) and the disk
/// holding `state_dir`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    #[serde(default = "yes")]
    pub enabled: bool,
    #[serde(default = "default_node_interval", with = "humantime_serde")]
    pub interval: Duration,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            enabled: true,
            interval: default_node_interval(),
        }
    }
}

fn default_node_interval() -> Duration {
    Duration::from_secs(30)
}
