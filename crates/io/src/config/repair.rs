//! `[repair]`: how the reboot rung reboots this instance and how it knows the boot after.
//!
//! - `reboot = "ec2"` (default): EC2 `RebootInstances` on this instance (IAM lets the instance
//!   reboot only itself: packaging/iam-policy.json). EC2 hard-reboots an OS that has not shut
//!   down within about four minutes, so a hung OS still reboots.
//! - `reboot = "systemd"`: the OS's own reboot, `command` (default `systemctl reboot`).
//! - `reboot = "off"`: no reboot rung; a `reboot` verdict is carried out as `replace`.
//!
//! Either way the rung needs `[aws] enabled` (quarantine, drain and the return to service
//! are ECS calls). The kernel's boot id (`boot_id_path`) tells the boot after the reboot from
//! the one before; `check_interval` and `settle` pace the check after the boot (GPUs and the
//! MPS daemon take a while to come up: a finding within `settle` is looked at again).

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RebootMethod {
    Ec2,
    Systemd,
    Off,
}

impl RebootMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            RebootMethod::Ec2 => "ec2",
            RebootMethod::Systemd => "systemd",
            RebootMethod::Off => "off",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RepairConfig {
    #[serde(default = "default_reboot")]
    pub reboot: RebootMethod,
    /// `reboot = "systemd"`: the program and its arguments.
    #[serde(default = "default_command")]
    pub command: Vec<String>,
    /// The kernel's boot id, a new one at every boot.
    #[serde(default = "default_boot_id_path")]
    pub boot_id_path: PathBuf,
    /// How often the check after the boot looks again while the node is not healthy yet.
    #[serde(default = "default_check_interval", with = "humantime_serde")]
    pub check_interval: Duration,
    /// For this long after the check starts an unhealthy finding is looked at again (the
    /// GPUs and the MPS daemon coming up); after it, an unhealthy node is replaced.
    #[serde(default = "default_settle", with = "humantime_serde")]
    pub settle: Duration,
}

impl Default for RepairConfig {
    fn default() -> Self {
        RepairConfig {
            reboot: default_reboot(),
            command: default_command(),
            boot_id_path: default_boot_id_path(),
            check_interval: default_check_interval(),
            settle: default_settle(),
        }
    }
}

fn default_reboot() -> RebootMethod {
    RebootMethod::Ec2
}

fn default_command() -> Vec<String> {
    vec!["systemctl".into(), "reboot".into()]
}

fn default_boot_id_path() -> PathBuf {
    PathBuf::from("/proc/sys/kernel/random/boot_id")
}

fn default_check_interval() -> Duration {
    Duration::from_secs(5)
}

fn default_settle() -> Duration {
    Duration::from_secs(180)
}
