//! The scenario: `FAKE_NVML_CONFIG=path.json`, read at `nvmlInit`.
//!
//! ```json
//! {"driver_version": "570.172.08",
//!  "gpus": [{"uuid": "GPU-…", "name": "NVIDIA H200", "pci_bus_id": "00000000:1B:00.0",
//!            "serial": "1654923000001", "memory_mib": 143771, "ecc": true,
//!            "architecture": "hopper"}]}
//! ```
//!
//! Every key is optional; a missing per-GPU key takes the default derived
//! from the GPU's index (see [`GpuSpec::default_for`]). Without the variable
//! the fake has [`DEFAULT_GPUS`] default Hopper GPUs. Parsing is pure, so
//! tests can compute what the library will report.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use serde::Deserialize;

use crate::identity::{self, Arch, Fabric};

/// Most GPUs a configuration may have.
pub const MAX_GPUS: usize = 64;
/// GPUs without `FAKE_NVML_CONFIG` (or without a `gpus` key).
pub const DEFAULT_GPUS: u32 = 4;
/// Default `driver_version`.
pub const DEFAULT_DRIVER_VERSION: &str = "570.172.08";
/// Environment variable naming the configuration file.
pub const CONFIG_ENV: &str = "FAKE_NVML_CONFIG";

/// Identity and static capabilities of one GPU, and the state it starts in: the
/// architecture's defaults ([`GpuSpec::default_for`]), keys of the JSON configuration, or what
/// an `nvidia-smi -q` dump showed (`crate::profile`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSpec {
    pub uuid: String,
    pub name: String,
    /// (domain, bus, device, function).
    pub pci: (u32, u32, u32, u32),
    pub serial: String,
    pub memory_mib: u64,
    pub ecc: bool,
    pub arch: Arch,
    /// `pciDeviceId` and `pciSubSystemId` (device << 16 | vendor).
    pub pci_device_id: u32,
    pub pci_sub_system_id: u32,
    /// `nvmlDeviceGetMigMode` (current, pending); `None`: NOT_SUPPORTED.
    pub mig: Option<(bool, bool)>,
    /// Persistence mode at start.
    pub persistence: bool,
    /// The PCIe link's maximum (generation, width), and the current one at start.
    pub pcie_max: (u32, u32),
    pub pcie_now: (u32, u32),
    /// The PCIe replay counter at start.
    pub pcie_replay: u32,
    /// Clock event reasons at start (`nvmlClocksEventReason*` bits; 0x1 GPU idle).
    pub clock_reasons: u64,
    /// Whether row remapping (Ampere and newer) and page retirement (older) answer; else
    /// NOT_SUPPORTED.
    pub row_remapping: bool,
    pub page_retirement: bool,
    /// Banks the row-remapper histogram reports at `max` on a healthy GPU.
    pub remap_banks: u32,
    /// The fabric registration at start (`Fabric::NONE`: NOT_SUPPORTED).
    pub fabric: Fabric,
    /// NVLinks (0: NOT_SUPPORTED).
    pub nvlinks: u32,
}

impl GpuSpec {
    /// The GPU at `index` when its configuration entry is empty.
    pub fn default_for(index: u32) -> GpuSpec {
        Self::with_arch(index, Arch::Hopper)
    }

    pub fn with_arch(index: u32, arch: Arch) -> GpuSpec {
        let (domain, bus, device) = identity::pci_location(index);
        GpuSpec {
            uuid: identity::uuid(index),
            name: arch.product_name().to_string(),
            pci: (domain, bus, device, 0),
            serial: identity::serial(index),
            memory_mib: arch.memory_mib(),
            ecc: true,
            arch,
            pci_device_id: arch.pci_device_id(),
            pci_sub_system_id: arch.pci_sub_system_id(),
            mig: arch.mig_capable().then_some((false, false)),
            persistence: true,
            pcie_max: (arch.pcie_gen(), 16),
            pcie_now: (arch.pcie_gen(), 16),
            pcie_replay: 0,
            clock_reasons: 0x1,
            row_remapping: arch.has_row_remapping(),
            page_retirement: arch.has_page_retirement(),
            remap_banks: arch.remap_banks(),
            fabric: arch.fabric(),
            nvlinks: arch.nvlink_count(),
        }
    }

    /// `busId`: `00000000:1B:00.0`.
    pub fn bus_id(&self) -> String {
        let (d, b, v, f) = self.pci;
        identity::format_bus_id(d, b, v, f)
    }

    /// `busIdLegacy`: `0000:1B:00.0`.
    pub fn bus_id_legacy(&self) -> String {
        let (d, b, v, f) = self.pci;
        identity::format_bus_id_legacy(d, b, v, f)
    }
}

/// A parsed configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    pub driver_version: String,
    /// Keep critical events nobody is registered for (README, "Events").
    pub event_backlog: bool,
    pub gpus: Vec<GpuSpec>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            driver_version: DEFAULT_DRIVER_VERSION.to_string(),
            event_backlog: true,
            gpus: (0..DEFAULT_GPUS).map(GpuSpec::default_for).collect(),
        }
    }
}

#[derive(Deserialize)]
struct RawConfig {
    driver_version: Option<String>,
    event_backlog: Option<bool>,
    gpus: Option<Vec<RawGpu>>,
    #[serde(flatten)]
    unknown: BTreeMap<String, serde_json::Value>,
}

#[derive(Deserialize)]
struct RawGpu {
    uuid: Option<String>,
    name: Option<String>,
    pci_bus_id: Option<String>,
    serial: Option<String>,
    memory_mib: Option<u64>,
    ecc: Option<bool>,
    architecture: Option<String>,
    #[serde(flatten)]
    unknown: BTreeMap<String, serde_json::Value>,
}

/// NVML string buffer sizes (`NVML_DEVICE_*_BUFFER_SIZE`, NUL included).
const UUID_MAX: usize = 80;
const NAME_MAX: usize = 96;
const SERIAL_MAX: usize = 30;
const DRIVER_MAX: usize = 80;

fn check_len(what: &str, s: &str, max: usize) -> Result<(), String> {
    if s.len() >= max || s.contains('\0') {
        return Err(format!(
            "{what} {s:?} does not fit NVML's {max}-byte buffer"
        ));
    }
    Ok(())
}

fn warn_unknown(what: &str, unknown: &BTreeMap<String, serde_json::Value>) {
    for key in unknown.keys() {
        eprintln!("fake-nvml: {CONFIG_ENV}: ignoring unknown key {key:?} in {what}");
    }
}

impl Config {
    /// Parses the JSON text of a configuration file.
    pub fn parse(text: &str) -> Result<Config, String> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        warn_unknown("the top level", &raw.unknown);
        let driver_version = raw
            .driver_version
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| DEFAULT_DRIVER_VERSION.to_string());
        let gpus = match raw.gpus {
            None => Config::default().gpus,
            Some(list) => {
                if list.len() > MAX_GPUS {
                    return Err(format!(
                        "{} GPUs configured; at most {MAX_GPUS}",
                        list.len()
                    ));
                }
                list.into_iter()
                    .enumerate()
                    .map(|(i, g)| gpu_spec(i as u32, g).map_err(|e| format!("gpus[{i}]: {e}")))
                    .collect::<Result<Vec<_>, _>>()?
            }
        };
        Config::checked(driver_version, raw.event_backlog.unwrap_or(true), gpus)
    }

    /// A configuration of `gpus`, refused where two share a UUID, serial or PCI address or
    /// a string does not fit NVML's buffers.
    pub fn checked(
        driver_version: String,
        event_backlog: bool,
        gpus: Vec<GpuSpec>,
    ) -> Result<Config, String> {
        check_len("driver_version", &driver_version, DRIVER_MAX)?;
        if gpus.len() > MAX_GPUS {
            return Err(format!(
                "{} GPUs configured; at most {MAX_GPUS}",
                gpus.len()
            ));
        }
        let mut uuids = BTreeSet::new();
        let mut serials = BTreeSet::new();
        let mut pcis = BTreeSet::new();
        for (i, g) in gpus.iter().enumerate() {
            check_len("uuid", &g.uuid, UUID_MAX)?;
            check_len("name", &g.name, NAME_MAX)?;
            check_len("serial", &g.serial, SERIAL_MAX)?;
            if !uuids.insert(g.uuid.as_str()) {
                return Err(format!("gpus[{i}]: duplicate uuid {:?}", g.uuid));
            }
            if !serials.insert(g.serial.as_str()) {
                return Err(format!("gpus[{i}]: duplicate serial {:?}", g.serial));
            }
            if !pcis.insert(g.pci) {
                return Err(format!("gpus[{i}]: duplicate pci_bus_id {:?}", g.bus_id()));
            }
        }
        Ok(Config {
            driver_version,
            event_backlog,
            gpus,
        })
    }
}

fn gpu_spec(index: u32, raw: RawGpu) -> Result<GpuSpec, String> {
    warn_unknown(&format!("gpus[{index}]"), &raw.unknown);
    let arch = match raw.architecture {
        None => Arch::Hopper,
        Some(a) => Arch::parse(&a).ok_or_else(|| {
            format!("unknown architecture {a:?} (volta, turing, ampere, ada, hopper, blackwell)")
        })?,
    };
    let mut spec = GpuSpec::with_arch(index, arch);
    if let Some(uuid) = raw.uuid {
        check_len("uuid", &uuid, UUID_MAX)?;
        spec.uuid = uuid;
    }
    if let Some(name) = raw.name {
        check_len("name", &name, NAME_MAX)?;
        spec.name = name;
    }
    if let Some(serial) = raw.serial {
        check_len("serial", &serial, SERIAL_MAX)?;
        spec.serial = serial;
    }
    if let Some(bus_id) = raw.pci_bus_id {
        spec.pci = identity::parse_pci_bus_id(&bus_id)
            .filter(|&(_, b, v, f)| b <= 0xFF && v <= 0x1F && f <= 7)
            .ok_or_else(|| format!("bad pci_bus_id {bus_id:?} (want DDDDDDDD:BB:DD.F)"))?;
    }
    if let Some(mib) = raw.memory_mib {
        spec.memory_mib = mib;
    }
    if let Some(ecc) = raw.ecc {
        spec.ecc = ecc;
    }
    Ok(spec)
}

/// Where the configuration came from and its exact text: hardware state
/// survives `nvmlShutdown` + `nvmlInit` while this is unchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigKey {
    pub path: Option<PathBuf>,
    pub content: Option<String>,
}

/// Reads `FAKE_NVML_CONFIG`, or `FAKE_NVML_PROFILE` (a dump, `crate::profile`; both set is an
/// error); neither: the default configuration.
pub fn load_from_env() -> Result<(ConfigKey, Config), String> {
    use crate::profile::{PROFILE_ENV, PROFILE_GPUS_ENV};
    let profile = std::env::var_os(PROFILE_ENV).filter(|p| !p.is_empty());
    if let Some(path) = profile {
        if std::env::var_os(CONFIG_ENV).is_some_and(|p| !p.is_empty()) {
            return Err(format!(
                "{CONFIG_ENV} and {PROFILE_ENV} are both set: set one"
            ));
        }
        let path = PathBuf::from(path);
        let gpus = match std::env::var(PROFILE_GPUS_ENV) {
            Ok(n) if !n.trim().is_empty() => Some(
                n.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("{PROFILE_GPUS_ENV}={n:?} is not a number"))?,
            ),
            _ => None,
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("{PROFILE_ENV}={}: {e}", path.display()))?;
        let config = crate::profile::parse(&text, gpus)
            .map_err(|e| format!("{PROFILE_ENV}={}: {e}", path.display()))?;
        let key = ConfigKey {
            path: Some(path),
            content: Some(format!("{text}\n{PROFILE_GPUS_ENV}={gpus:?}")),
        };
        return Ok((key, config));
    }
    let Some(path) = std::env::var_os(CONFIG_ENV).filter(|p| !p.is_empty()) else {
        let key = ConfigKey {
            path: None,
            content: None,
        };
        return Ok((key, Config::default()));
    };
    let path = PathBuf::from(path);
    let content = std::fs::read_to_string(&path)
        .map_err(|e| format!("{CONFIG_ENV}={}: {e}", path.display()))?;
    let config =
        Config::parse(&content).map_err(|e| format!("{CONFIG_ENV}={}: {e}", path.display()))?;
    let key = ConfigKey {
        path: Some(path),
        content: Some(content),
    };
    Ok((key, config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_object_is_the_default() {
        assert_eq!(Config::parse("{}").unwrap(), Config::default());
        let d = Config::default();
        assert_eq!(d.gpus.len(), 4);
        assert_eq!(d.gpus[1].uuid, identity::uuid(1));
        assert_eq!(d.gpus[1].bus_id(), identity::pci_bus_id(1));
        assert_eq!(d.gpus[1].name, "NVIDIA H200");
        assert!(d.gpus.iter().all(|g| g.ecc && g.arch == Arch::Hopper));
    }

    #[test]
    fn per_gpu_keys_and_index_defaults() {
        let c = Config::parse(
            r#"{"driver_version": "580.82.07", "event_backlog": false, "gpus": [
                {"uuid": "GPU-aaaa", "pci_bus_id": "0000:3b:00.0", "ecc": false},
                {"architecture": "Volta", "memory_mib": 1024, "serial": "42", "name": "X"}
            ]}"#,
        )
        .unwrap();
        assert_eq!(c.driver_version, "580.82.07");
        assert!(!c.event_backlog);
        let (a, b) = (&c.gpus[0], &c.gpus[1]);
        assert_eq!(a.uuid, "GPU-aaaa");
        assert_eq!(a.bus_id(), "00000000:3B:00.0");
        assert_eq!(a.bus_id_legacy(), "0000:3B:00.0");
        assert!(!a.ecc);
        assert_eq!(a.serial, identity::serial(0));
        assert_eq!(a.arch, Arch::Hopper);
        assert_eq!(b.arch, Arch::Volta);
        assert_eq!(b.uuid, identity::uuid(1));
        assert_eq!(b.bus_id(), identity::pci_bus_id(1));
        assert_eq!(
            (b.memory_mib, b.serial.as_str(), b.name.as_str()),
            (1024, "42", "X")
        );
        assert_eq!(Config::parse(r#"{"gpus": []}"#).unwrap().gpus.len(), 0);
    }

    #[test]
    fn rejects_bad_configs() {
        for bad in [
            "",
            "[]",
            r#"{"gpus": [{"architecture": "pascal"}]}"#,
            r#"{"gpus": [{"pci_bus_id": "nonsense"}]}"#,
            r#"{"gpus": [{"uuid": "GPU-1"}, {"uuid": "GPU-1"}]}"#,
            r#"{"gpus": [{}, {"pci_bus_id": "0:1B:00.0"}]}"#,
            r#"{"gpus": [{"memory_mib": -1}]}"#,
            r#"{"gpus": [{"ecc": "yes"}]}"#,
        ] {
            assert!(Config::parse(bad).is_err(), "{bad}");
        }
        let many = format!(r#"{{"gpus": [{}]}}"#, vec!["{}"; 65].join(","));
        assert!(Config::parse(&many).is_err());
    }
}
