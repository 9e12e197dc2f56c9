//! `[links]`: the links between the GPUs and out of the instance (docs/fabric.md): the NVLink
//! fabric registration, Fabric Manager on instance types with NVSwitches, NVLink and PCIe
//! error rates, persistence mode, and the EFA / RDMA ports. The windows and deadlines below
//! are what the probes measure over; what each signal leads to is the policy's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::sys::error::FileError;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinksConfig {
    /// Read fabric, NVLink, PCIe and persistence state with the NVML counters.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// The EC2 instance type (e.g. `p5.48xlarge`); empty: asked from IMDS when `[aws]` is
    /// on. Fabric Manager is checked only on types with NVSwitches
    /// (`crate::aws::instance_types::has_nvswitch`); an unknown type is not checked.
    #[serde(default)]
    pub instance_type: String,
    /// A GPU whose fabric registration has not completed this long after boot is a
    /// `fabric-not-completed` signal; before it, `check` says it cannot tell yet.
    #[serde(default = "default_fabric_deadline", with = "humantime_serde")]
    pub fabric_deadline: Duration,
    /// Where the time since boot is read (`/proc/uptime` form: seconds first).
    #[serde(default = "default_uptime_file")]
    pub uptime_file: PathBuf,
    /// NVLink error counters are turned into rates over this window.
    #[serde(default = "default_window", with = "humantime_serde")]
    pub nvlink_window: Duration,
    /// The PCIe replay counter is turned into a rate over this window.
    #[serde(default = "default_window", with = "humantime_serde")]
    pub pcie_window: Duration,
    /// Persistence mode must be on (the ECS GPU AMI runs nvidia-persistenced).
    #[serde(default = "yes")]
    pub expect_persistence: bool,
    /// Watch Fabric Manager's unit on instance types with NVSwitches.
    #[serde(default = "yes")]
    pub fabric_manager: bool,
    #[serde(default = "default_fm_unit")]
    pub fabric_manager_unit: String,
    /// The `systemctl` that reads the unit (`systemctl show`).
    #[serde(default = "default_systemctl")]
    pub systemctl: PathBuf,
    #[serde(default = "default_fm_interval", with = "humantime_serde")]
    pub fabric_manager_interval: Duration,
    /// systemd restarting Fabric Manager `fabric_manager_flaps` times within this window is
    /// `fabric-manager-flapping`.
    #[serde(default = "default_flap_window", with = "humantime_serde")]
    pub fabric_manager_flap_window: Duration,
    #[serde(default = "default_flaps")]
    pub fabric_manager_flaps: u32,
    /// Watch the EFA / RDMA ports under `infiniband_root` (none there: nothing is watched).
    #[serde(default = "yes")]
    pub efa: bool,
    #[serde(default = "default_infiniband_root")]
    pub infiniband_root: PathBuf,
    #[serde(default = "default_efa_interval", with = "humantime_serde")]
    pub efa_interval: Duration,
    /// Port error counters are turned into rates over this window.
    #[serde(default = "default_window", with = "humantime_serde")]
    pub efa_window: Duration,
    /// Port state changes are counted over this window (`efa-port-flapping`).
    #[serde(default = "default_flap_window", with = "humantime_serde")]
    pub efa_flap_window: Duration,
}

impl Default for LinksConfig {
    fn default() -> Self {
        LinksConfig {
            enabled: true,
            instance_type: String::new(),
            fabric_deadline: default_fabric_deadline(),
            uptime_file: default_uptime_file(),
            nvlink_window: default_window(),
            pcie_window: default_window(),
            expect_persistence: true,
            fabric_manager: true,
            fabric_manager_unit: default_fm_unit(),
            systemctl: default_systemctl(),
            fabric_manager_interval: default_fm_interval(),
            fabric_manager_flap_window: default_flap_window(),
            fabric_manager_flaps: default_flaps(),
            efa: true,
            infiniband_root: default_infiniband_root(),
            efa_interval: default_efa_interval(),
            efa_window: default_window(),
            efa_flap_window: default_flap_window(),
        }
    }
}

fn yes() -> bool {
    true
}

/// Fabric Manager trains the NVLinks and registers every GPU within a few minutes of boot.
fn default_fabric_deadline() -> Duration {
    Duration::from_secs(300)
}

fn default_uptime_file() -> PathBuf {
    PathBuf::from("/proc/uptime")
}

/// DCGM's health watches judge NVLink and PCIe error rates per minute.
fn default_window() -> Duration {
    Duration::from_secs(60)
}

fn default_fm_unit() -> String {
    "nvidia-fabricmanager.service".into()
}

fn default_systemctl() -> PathBuf {
    PathBuf::from("systemctl")
}

fn default_fm_interval() -> Duration {
    Duration::from_secs(30)
}

fn default_flap_window() -> Duration {
    Duration::from_secs(600)
}

fn default_flaps() -> u32 {
    3
}

fn default_infiniband_root() -> PathBuf {
    PathBuf::from("/sys/class/infiniband")
}

fn default_efa_interval() -> Duration {
    Duration::from_secs(10)
}

impl LinksConfig {
    /// Refuses values that would make a probe spin or never judge, with the key's line.
    pub fn check(&self, path: &Path, text: &str) -> Result<(), FileError> {
        const DAY: Duration = Duration::from_secs(24 * 3600);
        let s = Duration::from_secs;
        let table: [(&str, Duration, Duration, Duration); 8] = [
            ("fabric_deadline", self.fabric_deadline, s(1), DAY),
            ("nvlink_window", self.nvlink_window, s(1), DAY),
            ("pcie_window", self.pcie_window, s(1), DAY),
            (
                "fabric_manager_interval",
                self.fabric_manager_interval,
                Duration::from_millis(100),
                DAY,
            ),
            (
                "fabric_manager_flap_window",
                self.fabric_manager_flap_window,
                s(1),
                DAY,
            ),
            (
                "efa_interval",
                self.efa_interval,
                Duration::from_millis(100),
                DAY,
            ),
            ("efa_window", self.efa_window, s(1), DAY),
            ("efa_flap_window", self.efa_flap_window, s(1), DAY),
        ];
        for (key, v, floor, ceiling) in table {
            if v < floor || v > ceiling {
                return Err(FileError::new(
                    path,
                    super::key_line(text, Some("links"), key),
                    format!(
                        "[links] {key}: {} is outside {} ..= {}",
                        humantime::format_duration(v),
                        humantime::format_duration(floor),
                        humantime::format_duration(ceiling)
                    ),
                ));
            }
        }
        if !(2..=1000).contains(&self.fabric_manager_flaps) {
            return Err(FileError::new(
                path,
                super::key_line(text, Some("links"), "fabric_manager_flaps"),
                format!(
                    "[links] fabric_manager_flaps: {} is outside 2 ..= 1000 (one restart is not a flap)",
                    self.fabric_manager_flaps
                ),
            ));
        }
        if self.fabric_manager_unit.trim().is_empty() {
            return Err(FileError::new(
                path,
                super::key_line(text, Some("links"), "fabric_manager_unit"),
                "[links] fabric_manager_unit: empty (the default is nvidia-fabricmanager.service)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::LinksConfig;

    /// packaging/config.toml lists every `[links]` key (so the generated reference in
    /// docs/configuration.md does), each at its compiled-in default.
    #[test]
    fn the_packaged_links_section_is_every_default() {
        let text = include_str!("../../../../packaging/config.toml");
        let table: toml::Table = toml::from_str(text).unwrap();
        let links = table["links"].as_table().unwrap();
        let parsed: LinksConfig = toml::Value::Table(links.clone()).try_into().unwrap();
        let want = LinksConfig {
            instance_type: String::new(),
            ..LinksConfig::default()
        };
        assert_eq!(parsed, want);
        // Every field is written (instance_type as a commented example: unset means IMDS).
        let written: Vec<&str> = text
            .split("\n[links]\n")
            .nth(1)
            .and_then(|s| s.split("\n[").next())
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with("# ") || l.contains(" = \""))
            .filter_map(|l| l.trim_start_matches("# ").split_once(" = "))
            .map(|(k, _)| k)
            .collect();
        // deny_unknown_fields makes each a field; 18 distinct names are all of LinksConfig's
        // fields (a field added to the struct is added here and to packaging/config.toml).
        let mut distinct = written.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 18, "{written:?}");
    }
}
