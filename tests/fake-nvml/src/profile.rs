//! GPUs shaped as a real node's: `FAKE_NVML_PROFILE=<dump>`, an `nvidia-smi -q -x` (XML) or
//! `nvidia-smi -q` (text) dump, read at `nvmlInit` instead of `FAKE_NVML_CONFIG`.
//!
//! Why: the fake's defaults are ours; a dump is what a driver printed for a real GPU. The
//! GPUs take the dump's driver version, names, architecture, PCI device, subsystem and bus
//! ids, memory, ECC mode, MIG mode, persistence mode, PCIe link (maximum and current), PCIe
//! replay counter, clock event reasons, fabric registration, serials and UUIDs, whether row
//! remapping and page retirement answer (`N/A` in the dump: NOT_SUPPORTED) and the
//! row-remapper's banks. What `-q` does not print (NVLinks, power limits) stays the
//! architecture's. `FAKE_NVML_PROFILE_GPUS=N` asks for N GPUs: GPU i is the dump's GPU
//! `i % len`, and a copy beyond the dump's own takes a UUID, serial and bus id of its own
//! (derived, not real), so a one-GPU dump can stand for a four-GPU instance.
//!
//! Only the keys this reads are looked at: the fixtures keep only those
//! (tests/fixtures/gpus/README.md). Pure: the text in, the configuration out.

use std::collections::{BTreeMap, BTreeSet};

use crate::config::{Config, GpuSpec, MAX_GPUS};
use crate::identity::{self, Arch, Fabric};
use crate::types::fabric_state;

/// Environment variable naming the dump.
pub const PROFILE_ENV: &str = "FAKE_NVML_PROFILE";
/// Environment variable asking for that many GPUs of the dump's.
pub const PROFILE_GPUS_ENV: &str = "FAKE_NVML_PROFILE_GPUS";

/// One GPU's keys as the dump printed them: `pci/pci_device_id` (XML element paths under
/// `<gpu>`) or `PCI/Device Id` (text keys under `GPU <bus id>`, by indentation).
type Keys = BTreeMap<String, String>;

/// A parsed dump: the top-level keys and each GPU's.
#[derive(Debug, Default)]
struct Dump {
    top: Keys,
    gpus: Vec<Keys>,
}

/// Reads an `nvidia-smi -q -x` or `-q` dump into a configuration of `gpus` GPUs (the dump's
/// own count when `None`).
pub fn parse(text: &str, gpus: Option<usize>) -> Result<Config, String> {
    let dump = if text.trim_start().starts_with('<') {
        xml(text)?
    } else {
        plain(text)
    };
    if dump.gpus.is_empty() {
        return Err("the dump has no GPU".into());
    }
    let driver = field(&dump.top, &["driver_version", "Driver Version"])
        .ok_or("the dump has no driver version")?;
    let own: Vec<GpuSpec> = dump
        .gpus
        .iter()
        .enumerate()
        .map(|(i, k)| spec(i as u32, k).map_err(|e| format!("GPU {i} of the dump: {e}")))
        .collect::<Result<_, _>>()?;
    let want = gpus.unwrap_or(own.len());
    if want == 0 || want > MAX_GPUS {
        return Err(format!("{want} GPUs asked for; 1 to {MAX_GPUS}"));
    }
    Config::checked(driver.to_string(), true, copies(&own, want))
}

/// `n` GPUs from the dump's: the dump's own first, then copies with identities of their own.
fn copies(own: &[GpuSpec], n: usize) -> Vec<GpuSpec> {
    let mut taken: BTreeSet<(u32, u32, u32, u32)> = own.iter().map(|g| g.pci).collect();
    (0..n)
        .map(|i| {
            let mut g = own[i % own.len()].clone();
            let k = (i / own.len()) as u32;
            if k > 0 {
                g.uuid = copy_uuid(&g.uuid, k);
                g.serial = copy_serial(&g.serial, k);
                let (d, mut b, v, f) = g.pci;
                while taken.contains(&(d, b, v, f)) {
                    b = (b + 1) & 0xFF;
                }
                taken.insert((d, b, v, f));
                g.pci = (d, b, v, f);
            }
            g
        })
        .collect()
}

/// Copy `k`'s UUID: the last group's first four hex digits replaced by `k`.
fn copy_uuid(uuid: &str, k: u32) -> String {
    match uuid.rsplit_once('-') {
        Some((head, last)) if last.len() > 4 => format!("{head}-{k:04x}{}", &last[4..]),
        _ => format!("{uuid}-{k}"),
    }
}

/// Copy `k`'s serial: the last three digits replaced by `k` (a masked `0000000000000` too).
fn copy_serial(serial: &str, k: u32) -> String {
    match serial.len().checked_sub(3) {
        Some(cut) if serial.is_char_boundary(cut) => format!("{}{:03}", &serial[..cut], k % 1000),
        _ => format!("{serial}{k}"),
    }
}

/// The first of `keys` the dump has, unless it printed `N/A`.
fn field<'a, S: AsRef<str>>(k: &'a Keys, keys: &[S]) -> Option<&'a str> {
    keys.iter()
        .filter_map(|key| k.get(key.as_ref()))
        .map(|v| v.trim())
        .find(|v| !v.is_empty() && *v != "N/A")
}

/// The number the first of `keys` holds (hexadecimal with `hex`), where it fits 32 bits.
fn num32<S: AsRef<str>>(k: &Keys, keys: &[S], hex: bool) -> Option<u32> {
    field(k, keys)
        .and_then(|v| number(v, hex))
        .and_then(|v| u32::try_from(v).ok())
}

/// The leading number of a value (`23028 MiB`, `16x`, `0x233010DE`, `20B210DE`).
fn number(v: &str, hex: bool) -> Option<u64> {
    let v = v.trim();
    if hex {
        let h = v.strip_prefix("0x").unwrap_or(v);
        return u64::from_str_radix(h, 16).ok();
    }
    let digits: String = v.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// One GPU's specification from its keys, the architecture's defaults where the dump is silent.
fn spec(index: u32, k: &Keys) -> Result<GpuSpec, String> {
    let arch_name = field(k, &["product_architecture", "Product Architecture"])
        .ok_or("no product architecture")?;
    let arch = Arch::parse(arch_name).ok_or(format!("unknown architecture {arch_name:?}"))?;
    let mut g = GpuSpec::with_arch(index, arch);
    if let Some(v) = field(k, &["product_name", "Product Name"]) {
        g.name = v.to_string();
    }
    if let Some(v) = field(k, &["uuid", "GPU UUID"]) {
        g.uuid = v.to_string();
    }
    if let Some(v) = field(k, &["serial", "Serial Number"]) {
        g.serial = v.to_string();
    }
    if let Some(v) = field(k, &["pci/pci_bus_id", "PCI/Bus Id"]) {
        g.pci = identity::parse_pci_bus_id(v).ok_or(format!("bad bus id {v:?}"))?;
    }
    g.pci_device_id =
        num32(k, &["pci/pci_device_id", "PCI/Device Id"], true).unwrap_or(g.pci_device_id);
    g.pci_sub_system_id = num32(k, &["pci/pci_sub_system_id", "PCI/Sub System Id"], true)
        .unwrap_or(g.pci_sub_system_id);
    g.memory_mib = field(k, &["fb_memory_usage/total", "FB Memory Usage/Total"])
        .and_then(|v| number(v, false))
        .unwrap_or(g.memory_mib);
    if let Some(v) = k.get("ecc_mode/current_ecc").or(k.get("ECC Mode/Current")) {
        g.ecc = v.trim() == "Enabled";
    }
    if let Some(v) = k.get("persistence_mode").or(k.get("Persistence Mode")) {
        g.persistence = v.trim() == "Enabled";
    }
    mig(&mut g, k);
    pcie(&mut g, k);
    g.clock_reasons = clock_reasons(k).unwrap_or(g.clock_reasons);
    memory_repair(&mut g, k);
    fabric(&mut g, k);
    Ok(g)
}

/// MIG mode: `Enabled`/`Disabled` for current and pending, `N/A`: not supported.
fn mig(g: &mut GpuSpec, k: &Keys) {
    let current = k.get("mig_mode/current_mig").or(k.get("MIG Mode/Current"));
    let pending = k.get("mig_mode/pending_mig").or(k.get("MIG Mode/Pending"));
    if let Some(c) = current.map(|v| v.trim()) {
        let on = |v: &str| v == "Enabled";
        g.mig = (c != "N/A").then(|| (on(c), pending.map(|p| on(p.trim())).unwrap_or(on(c))));
    }
}

/// The PCIe link's maximum and current generation and width, and the replay counter.
fn pcie(g: &mut GpuSpec, k: &Keys) {
    // (XML element, text key) below the link's section in each form.
    let n = |xml: &str, text: &str| {
        let keys = [
            format!("pci/pci_gpu_link_info/{xml}"),
            format!("PCI/GPU Link Info/{text}"),
        ];
        num32(k, &keys, false)
    };
    let max_gen = n("pcie_gen/max_link_gen", "PCIe Generation/Max");
    let now_gen = n("pcie_gen/current_link_gen", "PCIe Generation/Current");
    let max_w = n("link_widths/max_link_width", "Link Width/Max");
    let now_w = n("link_widths/current_link_width", "Link Width/Current");
    g.pcie_max = (
        max_gen.unwrap_or(g.pcie_max.0),
        max_w.unwrap_or(g.pcie_max.1),
    );
    g.pcie_now = (
        now_gen.unwrap_or(g.pcie_max.0),
        now_w.unwrap_or(g.pcie_max.1),
    );
    g.pcie_replay =
        num32(k, &["pci/replay_counter", "PCI/Replays Since Reset"], false).unwrap_or(0);
}

/// `nvmlClocksEventReason*` bits by the names `-q` (text) and `-q -x` (XML, after its
/// `clocks_event_reason_`/`clocks_throttle_reason_` prefix) print, lower-cased, letters and
/// digits only.
const REASONS: [(u64, &[&str]); 9] = [
    (0x1, &["idle", "gpuidle"]),
    (0x2, &["applicationsclockssetting"]),
    (0x4, &["swpowercap"]),
    (0x8, &["hwslowdown"]),
    (0x10, &["syncboost"]),
    (0x20, &["swthermalslowdown"]),
    (0x40, &["hwthermalslowdown"]),
    (0x80, &["hwpowerbrakeslowdown"]),
    (0x100, &["displayclocksetting", "displayclockssetting"]),
];

/// The clock event reasons the dump shows `Active`; `None` where it prints none.
fn clock_reasons(k: &Keys) -> Option<u64> {
    let sections = [
        "clocks_event_reasons/",
        "clocks_throttle_reasons/",
        "Clocks Event Reasons/",
        "Clocks Throttle Reasons/",
    ];
    let mut seen = false;
    let mut mask = 0;
    for (key, value) in k {
        if !sections.iter().any(|s| key.starts_with(s)) {
            continue;
        }
        seen = true;
        let last = key.rsplit('/').next().unwrap_or("");
        let last = last
            .trim_start_matches("clocks_event_reason_")
            .trim_start_matches("clocks_throttle_reason_");
        let name: String = last
            .chars()
            .filter(char::is_ascii_alphanumeric)
            .map(|c| c.to_ascii_lowercase())
            .collect();
        if value.trim() == "Active"
            && let Some((bit, _)) = REASONS
                .iter()
                .find(|(_, names)| names.contains(&name.as_str()))
        {
            mask |= bit;
        }
    }
    seen.then_some(mask)
}

/// Row remapping and page retirement: a section the dump prints as `N/A` does not answer;
/// the histogram's healthy banks where it shows them.
fn memory_repair(g: &mut GpuSpec, k: &Keys) {
    let na = |keys: &[&str]| {
        keys.iter()
            .any(|key| k.get(*key).is_some_and(|v| v.trim() == "N/A"))
    };
    let has = |prefixes: &[&str]| {
        k.keys()
            .any(|key| prefixes.iter().any(|p| key.starts_with(p)))
    };
    if na(&["remapped_rows", "Remapped Rows"]) {
        g.row_remapping = false;
    } else if has(&["remapped_rows/", "Remapped Rows/"]) {
        g.row_remapping = true;
    }
    let banks = [
        "remapped_rows/row_remapper_histogram/row_remapper_histogram_max",
        "Remapped Rows/Bank Remap Availability Histogram/Max",
    ];
    g.remap_banks = num32(k, &banks, false).unwrap_or(g.remap_banks);
    let pending = [
        "retired_pages/pending_retirement",
        "Retired Pages/Pending Page Retirement",
        "Retired Pages/Pending Page Blacklist",
    ];
    if let Some(v) = pending.iter().find_map(|key| k.get(*key)) {
        g.page_retirement = v.trim() != "N/A";
    }
}

/// The fabric registration: `N/A` or `Not Supported` none, else its state, status, clique and
/// cluster UUID.
fn fabric(g: &mut GpuSpec, k: &Keys) {
    let Some(state) = k.get("fabric/state").or(k.get("Fabric/State")) else {
        return;
    };
    let state = match state.trim() {
        "Completed" => fabric_state::COMPLETED,
        "In Progress" => fabric_state::IN_PROGRESS,
        "Not Started" => fabric_state::NOT_STARTED,
        _ => {
            g.fabric = Fabric::NONE;
            return;
        }
    };
    let status = match field(k, &["fabric/status", "Fabric/Status"]) {
        Some("Success") | None => 0,
        // Any other text is an error the fake cannot name: NVML_ERROR_UNKNOWN.
        Some(_) => 999,
    };
    let clique = num32(k, &["fabric/cliqueId", "Fabric/CliqueId"], false).unwrap_or(0);
    let mut cluster = [0u8; 16];
    if let Some(v) = field(k, &["fabric/clusterUuid", "Fabric/ClusterUUID"]) {
        let hex: String = v.chars().filter(char::is_ascii_hexdigit).collect();
        for (i, b) in cluster.iter_mut().enumerate() {
            *b = hex
                .get(i * 2..i * 2 + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .unwrap_or(0);
        }
    }
    g.fabric = Fabric {
        state,
        status,
        clique_id: clique,
        cluster_uuid: cluster,
    };
}

/// `nvidia-smi -q`: `Key : value` lines; a line without a value opens a section its more
/// indented lines belong to; `GPU <bus id>` at the left margin begins a GPU.
fn plain(text: &str) -> Dump {
    let mut dump = Dump::default();
    let mut stack: Vec<(usize, String)> = Vec::new();
    for line in text.lines() {
        let body = line.trim_end();
        if body.trim().is_empty() || body.starts_with("====") {
            continue;
        }
        let indent = body.len() - body.trim_start().len();
        let body = body.trim_start();
        if indent == 0 && body.starts_with("GPU ") && !body.contains(": ") {
            dump.gpus.push(Keys::new());
            stack.clear();
            continue;
        }
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        let (key, value) = match body.split_once(": ") {
            Some((k, v)) => (k.trim(), Some(v.trim())),
            None => (body.trim_end_matches(':').trim(), None),
        };
        let mut path: Vec<&str> = stack.iter().map(|(_, k)| k.as_str()).collect();
        path.push(key);
        let path = path.join("/");
        if let Some(v) = value {
            match dump.gpus.last_mut() {
                Some(g) if indent > 0 => g.insert(path, v.to_string()),
                _ => dump.top.insert(path, v.to_string()),
            };
        }
        stack.push((indent, key.to_string()));
    }
    dump
}

/// `nvidia-smi -q -x`: each element's text by its path below `<gpu>` (or below the root for
/// the top-level keys).
fn xml(text: &str) -> Result<Dump, String> {
    let mut dump = Dump::default();
    let mut path: Vec<String> = Vec::new();
    for token in xmlparser::Tokenizer::from(text) {
        match token.map_err(|e| format!("not XML: {e}"))? {
            xmlparser::Token::ElementStart { local, .. } => {
                path.push(local.as_str().to_string());
                if path.len() == 2 && path[1] == "gpu" {
                    dump.gpus.push(Keys::new());
                }
            }
            xmlparser::Token::ElementEnd { end, .. } => match end {
                xmlparser::ElementEnd::Open => {}
                xmlparser::ElementEnd::Close(..) | xmlparser::ElementEnd::Empty => {
                    path.pop();
                }
            },
            xmlparser::Token::Text { text } => {
                let value = text.as_str().trim();
                if value.is_empty() || path.len() < 2 {
                    continue;
                }
                let value = unescape(value);
                match (path[1].as_str(), dump.gpus.last_mut()) {
                    ("gpu", Some(g)) if path.len() > 2 => {
                        g.insert(path[2..].join("/"), value);
                    }
                    _ => {
                        dump.top.insert(path[1..].join("/"), value);
                    }
                }
            }
            _ => {}
        }
    }
    Ok(dump)
}

/// XML's five predefined entities.
fn unescape(v: &str) -> String {
    v.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", "\"")
        .replace("&apos;", "'")
        .replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    const XML: &str = r#"<?xml version="1.0" ?>
<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">
<nvidia_smi_log>
    <driver_version>535.54.03</driver_version>
    <gpu id="00000000:01:00.0">
        <product_name>NVIDIA A100-SXM4-80GB</product_name>
        <product_architecture>Ampere</product_architecture>
        <persistence_mode>Disabled</persistence_mode>
        <mig_mode><current_mig>Enabled</current_mig><pending_mig>Disabled</pending_mig></mig_mode>
        <serial>1650522003820</serial>
        <uuid>GPU-513536b6-7d19-9063-b049-1e69664bb298</uuid>
        <pci>
            <pci_device_id>20B210DE</pci_device_id>
            <pci_bus_id>00000000:01:00.0</pci_bus_id>
            <pci_gpu_link_info>
                <pcie_gen><max_link_gen>4</max_link_gen><current_link_gen>1</current_link_gen></pcie_gen>
                <link_widths><max_link_width>16x</max_link_width><current_link_width>8x</current_link_width></link_widths>
            </pci_gpu_link_info>
            <replay_counter>3</replay_counter>
        </pci>
        <clocks_event_reasons>
            <clocks_event_reason_gpu_idle>Active</clocks_event_reason_gpu_idle>
            <clocks_event_reason_hw_slowdown>Not Active</clocks_event_reason_hw_slowdown>
        </clocks_event_reasons>
        <fb_memory_usage><total>81920 MiB</total></fb_memory_usage>
        <ecc_mode><current_ecc>Enabled</current_ecc></ecc_mode>
        <retired_pages><pending_retirement>N/A</pending_retirement></retired_pages>
        <remapped_rows>N/A</remapped_rows>
        <fabric><state>N/A</state><status>N/A</status></fabric>
    </gpu>
</nvidia_smi_log>
"#;

    // `-q`'s layout, ours: GPU 0 of tests/fixtures/gpus/h100-r535.txt (name, serial, UUID,
    // bus, ids, link, replays, reasons, banks) under a later driver version, with the two
    // fabric lines r550 and later print (CliqueId, ClusterUUID; values ours).
    const TEXT: &str = "
==============NVSMI LOG==============

Driver Version                            : 565.57.01
Attached GPUs                             : 1
GPU 00000000:19:00.0
    Product Name                          : NVIDIA H100 80GB HBM3
    Product Architecture                  : Hopper
    Persistence Mode                      : Enabled
    MIG Mode
        Current                           : Disabled
        Pending                           : Disabled
    Serial Number                         : 1650124031592
    GPU UUID                              : GPU-ee7954ec-da95-fd7a-ddfd-c6b32cc2f8aa
    PCI
        Device Id                         : 0x233010DE
        Bus Id                            : 00000000:19:00.0
        Sub System Id                     : 0x16C110DE
        GPU Link Info
            PCIe Generation
                Max                       : 5
                Current                   : 5
            Link Width
                Max                       : 16x
                Current                   : 16x
        Replays Since Reset               : 67
    Clocks Event Reasons
        Idle                              : Not Active
        HW Slowdown                       : Active
            HW Thermal Slowdown           : Not Active
            HW Power Brake Slowdown       : Active
    FB Memory Usage
        Total                             : 81559 MiB
    ECC Mode
        Current                           : Enabled
    Retired Pages
        Pending Page Blacklist            : N/A
    Remapped Rows
        Pending                           : No
        Bank Remap Availability Histogram
            Max                           : 2560 bank(s)
    Fabric
        State                             : Completed
        Status                            : Success
        CliqueId                          : 0
        ClusterUUID                       : 00000000-0000-0000-0000-0000000000ab
";

    #[test]
    fn an_xml_dump_shapes_its_gpu() {
        let c = parse(XML, None).unwrap();
        assert_eq!(c.driver_version, "535.54.03");
        let g = &c.gpus[0];
        assert_eq!(
            (g.name.as_str(), g.arch),
            ("NVIDIA A100-SXM4-80GB", Arch::Ampere)
        );
        assert_eq!(g.uuid, "GPU-513536b6-7d19-9063-b049-1e69664bb298");
        assert_eq!(
            (g.bus_id(), g.pci_device_id),
            ("00000000:01:00.0".into(), 0x20B2_10DE)
        );
        assert_eq!(
            g.pci_sub_system_id,
            Arch::Ampere.pci_sub_system_id(),
            "not in the dump"
        );
        assert_eq!((g.memory_mib, g.ecc, g.persistence), (81920, true, false));
        assert_eq!(g.mig, Some((true, false)));
        assert_eq!(
            (g.pcie_max, g.pcie_now, g.pcie_replay),
            ((4, 16), (1, 8), 3)
        );
        assert_eq!(g.clock_reasons, 0x1);
        assert!(!g.row_remapping && !g.page_retirement, "N/A in the dump");
        assert_eq!(g.fabric, Fabric::NONE);
        assert_eq!(g.nvlinks, Arch::Ampere.nvlink_count());
    }

    #[test]
    fn a_text_dump_shapes_its_gpu() {
        let c = parse(TEXT, None).unwrap();
        assert_eq!(c.driver_version, "565.57.01");
        let g = &c.gpus[0];
        assert_eq!(
            (g.name.as_str(), g.arch),
            ("NVIDIA H100 80GB HBM3", Arch::Hopper)
        );
        assert_eq!(
            (g.serial.as_str(), g.bus_id()),
            ("1650124031592", "00000000:19:00.0".into())
        );
        assert_eq!(
            (g.pci_device_id, g.pci_sub_system_id),
            (0x2330_10DE, 0x16C1_10DE)
        );
        assert_eq!(
            (g.memory_mib, g.persistence, g.mig),
            (81559, true, Some((false, false)))
        );
        assert_eq!(
            (g.pcie_max, g.pcie_now, g.pcie_replay),
            ((5, 16), (5, 16), 67)
        );
        assert_eq!(g.clock_reasons, 0x8 | 0x80, "HW slowdown and power brake");
        assert!(g.row_remapping && !g.page_retirement);
        assert_eq!(g.remap_banks, 2560);
        assert_eq!(
            (g.fabric.state, g.fabric.status),
            (fabric_state::COMPLETED, 0)
        );
        assert_eq!((g.fabric.clique_id, g.fabric.cluster_uuid[15]), (0, 0xab));
    }

    #[test]
    fn copies_of_a_one_gpu_dump_are_distinct() {
        let c = parse(TEXT, Some(4)).unwrap();
        assert_eq!(c.gpus.len(), 4);
        assert_eq!(c.gpus[0].uuid, "GPU-ee7954ec-da95-fd7a-ddfd-c6b32cc2f8aa");
        assert_eq!(c.gpus[1].uuid, "GPU-ee7954ec-da95-fd7a-ddfd-00012cc2f8aa");
        assert_eq!(c.gpus[3].serial, "1650124031003");
        let buses: BTreeSet<String> = c.gpus.iter().map(GpuSpec::bus_id).collect();
        assert_eq!(buses.len(), 4);
        assert!(c.gpus.iter().all(|g| g.name == c.gpus[0].name));
    }

    #[test]
    fn refuses_what_is_no_dump() {
        for bad in [
            "",
            "<nvidia_smi_log></nvidia_smi_log>",
            "<a><b>",
            "Driver Version : 1\n",
        ] {
            assert!(parse(bad, None).is_err(), "{bad:?}");
        }
        assert!(parse(TEXT, Some(0)).is_err());
        assert!(parse(TEXT, Some(MAX_GPUS + 1)).is_err());
        let no_arch = TEXT.replace("Product Architecture", "Product Brand");
        assert!(parse(&no_arch, None).unwrap_err().contains("architecture"));
    }
}
