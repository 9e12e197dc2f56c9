//! The fake shaped by real `nvidia-smi -q` dumps (`FAKE_NVML_PROFILE`,
//! tests/fake-nvml/src/profile.rs), read back through the real nvml-wrapper 0.13 as gpu-medic
//! reads a driver: for every dump in tests/fixtures/gpus/ (t4.xml, a10g.xml,
//! a100-sxm4-mig.xml, h100-r535.txt; the families with no real dump there are listed in its
//! README), each GPU answers what the dump showed, as tests/fixtures/gpus/expected.tsv writes it
//! down by hand (names, PCI ids and bus ids, memory, ECC, MIG and persistence modes, the PCIe
//! link and its replay counter, clock event reasons, row remapping and page retirement, the
//! remapper's banks, the fabric registration, serials and UUIDs); a one-GPU dump asked for
//! several GPUs gives distinct copies.
//!
//! The fake reads its environment at `nvmlInit` and keeps process-global state, so every dump
//! is read in turn inside the single `#[test]` below (this binary must contain no other test).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use nvml_wrapper::Device;
use nvml_wrapper::error::NvmlError;

mod common;
use common::{init, set_env};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/gpus")
}

/// expected.tsv's rows, each by column name.
fn expected() -> Vec<BTreeMap<String, String>> {
    fake_nvml::fixtures::tsv(&fixtures().join("expected.tsv")).unwrap()
}

/// `ok`, or the NVML return code a raw call gave.
fn raw<T>(r: u32, v: T) -> Result<T, u32> {
    if r == 0 { Ok(v) } else { Err(r) }
}

/// (state, clique, cluster UUID) of `nvmlDeviceGetGpuFabricInfo`, or its error code.
fn fabric(nvml: &nvml_wrapper::Nvml, d: &Device<'_>) -> Result<(u8, u32, String), u32> {
    let mut info: nvml_wrapper_sys::bindings::nvmlGpuFabricInfo_t =
        // SAFETY: plain C struct; all-zero is a valid value.
        unsafe { std::mem::zeroed() };
    // SAFETY: a valid handle of this `nvml` and a valid out-pointer.
    let r = unsafe { nvml.lib().nvmlDeviceGetGpuFabricInfo(d.handle(), &mut info) };
    let hex: String = info
        .clusterUuid
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let uuid = format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    );
    raw(r, (info.state, info.cliqueId, uuid))
}

/// Every column of `row` against what GPU 0 (and the last GPU) answer; the mismatches.
fn check(nvml: &nvml_wrapper::Nvml, row: &BTreeMap<String, String>) -> Vec<String> {
    let mut bad = Vec::new();
    let mut expect = |what: &str, got: String| {
        let want = row[what].clone();
        if got != want {
            bad.push(format!("{what}: got {got:?}, want {want:?}"));
        }
    };
    let count = nvml.device_count().unwrap();
    expect("gpus", count.to_string());
    expect("driver", nvml.sys_driver_version().unwrap());
    let last = nvml.device_by_index(count - 1).unwrap();
    expect("uuid_last", last.uuid().unwrap());
    expect("bus_last", last.pci_info().unwrap().bus_id);
    let d = nvml.device_by_index(0).unwrap();
    let pci = d.pci_info().unwrap();
    expect("name", d.name().unwrap());
    expect("uuid", d.uuid().unwrap());
    expect("serial", d.serial().unwrap());
    expect("bus", pci.bus_id);
    expect("device_id", format!("0x{:08X}", pci.pci_device_id));
    let sub = pci.pci_sub_system_id.unwrap_or(0);
    expect("subsystem", format!("0x{sub:08X}"));
    expect(
        "memory_mib",
        (d.memory_info().unwrap().total >> 20).to_string(),
    );
    let on = |b: bool| if b { "on" } else { "off" }.to_string();
    expect("ecc", on(d.is_ecc_enabled().unwrap().currently_enabled));
    expect(
        "mig",
        match d.mig_mode() {
            Ok(m) => format!("{}/{}", on(m.current == 1), on(m.pending == 1)),
            Err(NvmlError::NotSupported) => "-".into(),
            Err(e) => format!("{e}"),
        },
    );
    expect("persistence", on(d.is_in_persistent_mode().unwrap()));
    expect(
        "pcie",
        format!(
            "{}x{}/{}x{}",
            d.current_pcie_link_gen().unwrap(),
            d.current_pcie_link_width().unwrap(),
            d.max_pcie_link_gen().unwrap(),
            d.max_pcie_link_width().unwrap()
        ),
    );
    expect("replays", d.pcie_replay_counter().unwrap().to_string());
    expect(
        "reasons",
        format!("{:#x}", d.current_throttle_reasons().unwrap().bits()),
    );
    let mut v = [0u32; 4];
    let [a, b, c, e] = &mut v;
    // SAFETY: a valid handle and four valid out-pointers.
    let rows = unsafe { nvml.lib().nvmlDeviceGetRemappedRows(d.handle(), a, b, c, e) };
    let yes = |r: bool| if r { "yes" } else { "no" }.to_string();
    expect("rows", yes(rows == 0));
    expect("pages", yes(d.are_pages_pending_retired().is_ok()));
    if row["banks"] != "-" {
        let mut hist: nvml_wrapper_sys::bindings::nvmlRowRemapperHistogramValues_t =
            // SAFETY: plain C struct; all-zero is a valid value.
            unsafe { std::mem::zeroed() };
        // SAFETY: a valid handle and out-pointer.
        let r = unsafe {
            nvml.lib()
                .nvmlDeviceGetRowRemapperHistogram(d.handle(), &mut hist)
        };
        expect(
            "banks",
            format!("{:?}", raw(r, hist.max))
                .replace("Ok(", "")
                .replace(')', ""),
        );
    }
    expect(
        "fabric",
        match fabric(nvml, &d) {
            Err(3) => "none".into(),
            Ok((3, clique, cluster)) => format!("completed:{clique}:{cluster}"),
            other => format!("{other:?}"),
        },
    );
    bad
}

/// `run_gpus` GPUs of a one-GPU dump: the dump's GPU first, distinct copies after it.
fn check_copies(nvml: &nvml_wrapper::Nvml, row: &BTreeMap<String, String>) -> Vec<String> {
    let want: u32 = row["run_gpus"].parse().unwrap();
    let count = nvml.device_count().unwrap();
    let gpus: Vec<Device<'_>> = (0..count)
        .map(|i| nvml.device_by_index(i).unwrap())
        .collect();
    let uuids: std::collections::BTreeSet<String> =
        gpus.iter().map(|g| g.uuid().unwrap()).collect();
    let buses: std::collections::BTreeSet<String> =
        gpus.iter().map(|g| g.pci_info().unwrap().bus_id).collect();
    let mut bad = Vec::new();
    if count != want || uuids.len() != want as usize || buses.len() != want as usize {
        bad.push(format!(
            "{count} GPUs, {} UUIDs, {} bus ids; want {want} of each",
            uuids.len(),
            buses.len()
        ));
    }
    if gpus[0].uuid().unwrap() != row["uuid"]
        || gpus.iter().any(|g| g.name().unwrap() != row["name"])
    {
        bad.push("GPU 0 is not the dump's, or a copy has another name".into());
    }
    bad
}

#[test]
fn every_dump_shapes_the_fake_as_it_shows() {
    let rows = expected();
    let mut dumps: Vec<String> = std::fs::read_dir(fixtures())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".xml") || n.ends_with(".txt"))
        .collect();
    dumps.sort();
    let listed: Vec<String> = rows.iter().map(|r| r["file"].clone()).collect();
    let mut sorted = listed.clone();
    sorted.sort();
    assert_eq!(
        dumps, sorted,
        "every dump has one row in expected.tsv, and only those"
    );
    let mut bad = Vec::new();
    for row in &rows {
        let dump = fixtures().join(&row["file"]);
        set_env(&[("FAKE_NVML_PROFILE", &dump)]);
        let nvml = init().unwrap_or_else(|e| panic!("{}: {e}", row["file"]));
        bad.extend(
            check(&nvml, row)
                .into_iter()
                .map(|b| format!("{}: {b}", row["file"])),
        );
        drop(nvml);
        if row["run_gpus"] != "-" {
            let n = PathBuf::from(&row["run_gpus"]);
            set_env(&[("FAKE_NVML_PROFILE", &dump), ("FAKE_NVML_PROFILE_GPUS", &n)]);
            let nvml = init().unwrap();
            bad.extend(
                check_copies(&nvml, row)
                    .into_iter()
                    .map(|b| format!("{} x{}: {b}", row["file"], row["run_gpus"])),
            );
        }
    }
    // Both variables at once are refused, as an unreadable dump is.
    let dump = fixtures().join(&rows[0]["file"]);
    set_env(&[("FAKE_NVML_PROFILE", &dump), ("FAKE_NVML_CONFIG", &dump)]);
    assert!(matches!(init(), Err(NvmlError::Unknown)));
    set_env(&[("FAKE_NVML_PROFILE", &fixtures().join("expected.tsv"))]);
    assert!(matches!(init(), Err(NvmlError::Unknown)));
    set_env(&[]);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
