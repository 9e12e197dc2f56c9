//! Per-architecture constants and the default per-GPU identity. Everything
//! here is a pure function of (architecture, GPU index), so tests can compute
//! the identity the fake will report without loading it. The configuration
//! file (`crate::config`) may override any of it per GPU.

/// GPU architecture (`architecture` in the configuration).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Arch {
    Volta,
    Turing,
    Ampere,
    Ada,
    Hopper,
    Blackwell,
}

impl Arch {
    /// Parses an `architecture` value (case-insensitive).
    pub fn parse(s: &str) -> Option<Arch> {
        match s.trim().to_ascii_lowercase().as_str() {
            "volta" => Some(Arch::Volta),
            "turing" => Some(Arch::Turing),
            "ampere" => Some(Arch::Ampere),
            // "Ada Lovelace" is how nvidia-smi prints it.
            "ada" | "ada-lovelace" | "ada lovelace" | "lovelace" => Some(Arch::Ada),
            "hopper" => Some(Arch::Hopper),
            "blackwell" => Some(Arch::Blackwell),
            _ => None,
        }
    }

    /// `nvmlDeviceArchitecture_t`.
    pub fn nvml_arch(self) -> u32 {
        match self {
            Arch::Volta => 5,
            Arch::Turing => 6,
            Arch::Ampere => 7,
            Arch::Ada => 8,
            Arch::Hopper => 9,
            Arch::Blackwell => 10,
        }
    }

    /// Product name reported by `nvmlDeviceGetName`.
    pub fn product_name(self) -> &'static str {
        match self {
            Arch::Volta => "Tesla V100-SXM2-32GB",
            Arch::Turing => "Tesla T4",
            Arch::Ampere => "NVIDIA A100-SXM4-80GB",
            Arch::Ada => "NVIDIA L4",
            Arch::Hopper => "NVIDIA H200",
            Arch::Blackwell => "NVIDIA B200",
        }
    }

    /// Ampere and newer remap rows; older GPUs retire pages instead.
    pub fn has_row_remapping(self) -> bool {
        self >= Arch::Ampere
    }

    /// Pre-Ampere dynamic page retirement.
    pub fn has_page_retirement(self) -> bool {
        !self.has_row_remapping()
    }

    /// Whether `nvmlDeviceGetMigMode` is supported (data-center Ampere/Hopper/Blackwell).
    pub fn mig_capable(self) -> bool {
        matches!(self, Arch::Ampere | Arch::Hopper | Arch::Blackwell)
    }

    /// `nvmlBrandType_t`: TESLA (2) before Ampere, NVIDIA (14) after.
    pub fn brand(self) -> u32 {
        if self >= Arch::Ampere { 14 } else { 2 }
    }

    /// PCI device id (`pciDeviceId`: device << 16 | vendor).
    pub fn pci_device_id(self) -> u32 {
        match self {
            Arch::Volta => 0x1DB5_10DE,
            Arch::Turing => 0x1EB8_10DE,
            Arch::Ampere => 0x20B2_10DE,
            Arch::Ada => 0x27B8_10DE,
            Arch::Hopper => 0x2335_10DE,
            Arch::Blackwell => 0x2901_10DE,
        }
    }

    /// PCI subsystem id.
    pub fn pci_sub_system_id(self) -> u32 {
        match self {
            Arch::Volta => 0x1249_10DE,
            Arch::Turing => 0x12A2_10DE,
            Arch::Ampere => 0x1463_10DE,
            Arch::Ada => 0x16CA_10DE,
            Arch::Hopper => 0x18BE_10DE,
            Arch::Blackwell => 0x1999_10DE,
        }
    }

    /// Framebuffer size in MiB.
    pub fn memory_mib(self) -> u64 {
        match self {
            Arch::Volta => 32_768,
            Arch::Turing => 15_360,
            Arch::Ampere => 81_920,
            Arch::Ada => 23_034,
            Arch::Hopper => 143_771,
            Arch::Blackwell => 183_359,
        }
    }

    /// Enforced power limit in mW.
    pub fn power_limit_mw(self) -> u32 {
        match self {
            Arch::Volta => 300_000,
            Arch::Turing => 70_000,
            Arch::Ampere => 400_000,
            Arch::Ada => 72_000,
            Arch::Hopper => 700_000,
            Arch::Blackwell => 1_000_000,
        }
    }

    /// Maximum PCIe generation.
    pub fn pcie_gen(self) -> u32 {
        match self {
            Arch::Volta | Arch::Turing => 3,
            Arch::Ampere | Arch::Ada => 4,
            Arch::Hopper => 5,
            Arch::Blackwell => 6,
        }
    }

    /// Number of NVLink links (0: no NVLink, calls return NOT_SUPPORTED).
    pub fn nvlink_count(self) -> u32 {
        match self {
            Arch::Volta => 6,
            Arch::Turing | Arch::Ada => 0,
            Arch::Ampere => 12,
            Arch::Hopper | Arch::Blackwell => 18,
        }
    }

    /// Banks reported by the row-remapper histogram on a healthy GPU.
    pub fn remap_banks(self) -> u32 {
        match self {
            Arch::Hopper | Arch::Blackwell => 2560,
            _ => 640,
        }
    }
}

/// A GPU's NVLink fabric registration (`nvmlGpuFabricInfo_t`): state (`fabric_state`), status
/// (an `nvmlReturn_t`), clique id and cluster UUID.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fabric {
    pub state: u8,
    pub status: u32,
    pub clique_id: u32,
    pub cluster_uuid: [u8; 16],
}

impl Fabric {
    /// No fabric: the calls answer NOT_SUPPORTED.
    pub const NONE: Fabric = Fabric {
        state: crate::types::fabric_state::NOT_SUPPORTED,
        status: 0,
        clique_id: 0,
        cluster_uuid: [0; 16],
    };
}

impl Arch {
    /// Hopper and Blackwell report a completed registration (status SUCCESS, clique 1);
    /// older GPUs none.
    pub fn fabric(self) -> Fabric {
        if matches!(self, Arch::Hopper | Arch::Blackwell) {
            Fabric {
                state: crate::types::fabric_state::COMPLETED,
                status: 0,
                clique_id: 1,
                cluster_uuid: [0x5a; 16],
            }
        } else {
            Fabric::NONE
        }
    }
}

/// SplitMix64: a fixed, well-mixed function used to derive stable identities.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Default UUID `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, stable for a given index.
pub fn uuid(index: u32) -> String {
    let hi = mix(0x6770_752d_6d65_6469 ^ u64::from(index));
    let lo = mix(hi ^ u64::from(index).rotate_left(32));
    format!(
        "GPU-{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xFFFF,
        hi & 0xFFFF,
        lo >> 48,
        lo & 0xFFFF_FFFF_FFFF
    )
}

/// PCI bus numbers of an 8-GPU HGX board; GPU `i` sits on domain `i / 8`.
const BUSES: [u32; 8] = [0x1B, 0x29, 0x43, 0x52, 0x9D, 0xC3, 0xD1, 0xDF];

/// (domain, bus, device) of GPU `index`.
pub fn pci_location(index: u32) -> (u32, u32, u32) {
    (index / 8, BUSES[(index % 8) as usize], 0)
}

/// `busId` of the default GPU `index`: `00000000:1B:00.0`.
pub fn pci_bus_id(index: u32) -> String {
    let (domain, bus, device) = pci_location(index);
    format_bus_id(domain, bus, device, 0)
}

/// `busIdLegacy` of the default GPU `index`: `0000:1B:00.0`.
pub fn pci_bus_id_legacy(index: u32) -> String {
    let (domain, bus, device) = pci_location(index);
    format_bus_id_legacy(domain, bus, device, 0)
}

/// `busId` form: `00000000:1B:00.0`.
pub fn format_bus_id(domain: u32, bus: u32, device: u32, function: u32) -> String {
    format!("{domain:08X}:{bus:02X}:{device:02X}.{function:X}")
}

/// `busIdLegacy` form: `0000:1B:00.0` (the domain is cropped to 16 bits).
pub fn format_bus_id_legacy(domain: u32, bus: u32, device: u32, function: u32) -> String {
    format!(
        "{:04X}:{bus:02X}:{device:02X}.{function:X}",
        domain & 0xFFFF
    )
}

/// Parses `[domain:]bus:device.function` (hex, any case, any zero padding)
/// into (domain, bus, device, function).
pub fn parse_pci_bus_id(s: &str) -> Option<(u32, u32, u32, u32)> {
    let s = s.trim();
    let (head, function) = s.rsplit_once('.')?;
    let parts: Vec<&str> = head.split(':').collect();
    let (domain, bus, device) = match parts.as_slice() {
        [d, b, v] => (*d, *b, *v),
        [b, v] => ("0", *b, *v),
        _ => return None,
    };
    let hex = |t: &str| u32::from_str_radix(t, 16).ok();
    Some((hex(domain)?, hex(bus)?, hex(device)?, hex(function)?))
}

/// Board serial number of the default GPU `index` (13 digits).
pub fn serial(index: u32) -> String {
    format!("165492300{:04}", index + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_stable_distinct_and_well_formed() {
        let all: Vec<String> = (0..64).map(uuid).collect();
        for (i, u) in all.iter().enumerate() {
            assert_eq!(u, &uuid(i as u32));
            assert_eq!(u.len(), 40, "{u}");
            let groups: Vec<usize> = u["GPU-".len()..].split('-').map(str::len).collect();
            assert_eq!(groups, [8, 4, 4, 4, 12]);
        }
        let mut dedup = all.clone();
        dedup.sort();
        dedup.dedup();
        assert_eq!(dedup.len(), all.len());
    }

    #[test]
    fn bus_ids() {
        assert_eq!(pci_bus_id(0), "00000000:1B:00.0");
        assert_eq!(pci_bus_id_legacy(0), "0000:1B:00.0");
        assert_eq!(pci_bus_id(9), "00000001:29:00.0");
        assert_eq!(parse_pci_bus_id("0000:1b:00.0"), Some((0, 0x1B, 0, 0)));
        assert_eq!(parse_pci_bus_id("00000000:1B:00.0"), Some((0, 0x1B, 0, 0)));
        assert_eq!(parse_pci_bus_id("1B:00.0"), Some((0, 0x1B, 0, 0)));
        assert_eq!(parse_pci_bus_id("garbage"), None);
        let ids: std::collections::BTreeSet<String> = (0..64).map(pci_bus_id).collect();
        assert_eq!(ids.len(), 64);
    }

    #[test]
    fn arch_parsing() {
        assert_eq!(Arch::parse("Hopper"), Some(Arch::Hopper));
        assert_eq!(Arch::parse("volta"), Some(Arch::Volta));
        assert_eq!(Arch::parse("pascal"), None);
        assert!(Arch::Ampere.has_row_remapping());
        assert!(Arch::Turing.has_page_retirement());
    }
}
