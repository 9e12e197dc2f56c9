//! `[drill]`: whether `gpu-medic drill` may rehearse a fault on this instance. Off by
//! default, so that nobody drills a production instance by accident: a staging AMI or an
//! instance's own config turns it on.

use serde::Deserialize;

/// `[drill]` (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct DrillConfig {
    /// `gpu-medic drill` runs only where this is true; elsewhere it is refused (exit 4).
    #[serde(default = "default_allow")]
    pub allow: bool,
}

fn default_allow() -> bool {
    false
}
