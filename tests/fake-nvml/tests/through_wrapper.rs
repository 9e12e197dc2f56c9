//! Drives `libfake_nvml.so` through the real `nvml-wrapper` 0.13, the way
//! gpu-medic will, using the documented contract: a JSON configuration file
//! (`FAKE_NVML_CONFIG`) and JSON injection files dropped into
//! `FAKE_NVML_INJECT_DIR`.
//!
//! The fake reads its environment at `nvmlInit` and keeps process-global
//! state, so all scenarios run sequentially inside the single `#[test]` below
//! (this binary must contain no other test).
//!
//! The library is found at `$FAKE_NVML_LIB`, else in this test binary's
//! directory (`target/debug/deps/libfake_nvml.so`, which `cargo test -p
//! fake-nvml` always rebuilds), else `target/debug/libfake_nvml.so` (from
//! `cargo build -p fake-nvml`); a clear panic says so when none exists.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    Brand, EccCounter, MemoryError, MemoryLocation, RetirementCause, TemperatureSensor,
};
use nvml_wrapper::enums::device::{DeviceArchitecture, SampleValue, UsedGpuMemory};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::struct_wrappers::event::EventData;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{EventSet, FieldIdScheme};

use fake_nvml::identity;

mod common;
use common::{init, lib_path, set_env};

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fake-nvml-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes `json` as the configuration file in `dir`.
fn write_config(dir: &Path, json: &str) -> PathBuf {
    let path = dir.join("config.json");
    std::fs::write(&path, json).unwrap();
    path
}

/// Writes injection files the way the contract asks: `NNNNNN.json.tmp`,
/// then an atomic rename to `NNNNNN.json`.
struct Injector {
    dir: PathBuf,
    seq: AtomicU32,
}

impl Injector {
    fn new(dir: PathBuf) -> Injector {
        std::fs::create_dir_all(&dir).unwrap();
        Injector {
            dir,
            seq: AtomicU32::new(0),
        }
    }

    /// Drops one injection file; returns its final path.
    fn send(&self, json: &str) -> PathBuf {
        let n = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let path = self.dir.join(format!("{n:06}.json"));
        let tmp = self.dir.join(format!("{n:06}.json.tmp"));
        std::fs::write(&tmp, json).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        path
    }

    /// Drops a file and waits, without any NVML call, until the fake's
    /// watcher has taken it; returns how long that took.
    fn send_and_wait(&self, json: &str) -> Duration {
        let path = self.send(json);
        wait_gone(&path)
    }

    fn entries(&self) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(&self.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }
}

/// Polls until `path` no longer exists (panics after 5 s).
fn wait_gone(path: &Path) -> Duration {
    let t0 = Instant::now();
    while path.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{} was not picked up",
            path.display()
        );
        std::thread::sleep(Duration::from_micros(200));
    }
    t0.elapsed()
}

fn wait_event<'n>(set: &EventSet<'n>, ms: u32) -> Result<EventData<'n>, NvmlError> {
    set.wait(ms)
}

fn remapped_rows(nvml: &Nvml, index: u32) -> (u32, [u32; 4]) {
    let d = nvml.device_by_index(index).unwrap();
    let mut v = [0u32; 4];
    let [a, b, c, e] = &mut v;
    // SAFETY: valid handle and four valid out-pointers.
    let r = unsafe { nvml.lib().nvmlDeviceGetRemappedRows(d.handle(), a, b, c, e) };
    (r, v)
}

fn field(d: &nvml_wrapper::Device<'_>, id: u32) -> Result<SampleValue, NvmlError> {
    let mut f = d.field_values_for(&[FieldId(id)]).unwrap();
    f.remove(0).unwrap().value
}

fn layouts_match_nvml_wrapper_sys() {
    use fake_nvml::types as t;
    use nvml_wrapper_sys::bindings as b;
    use std::mem::{align_of, size_of};
    assert_eq!(size_of::<t::PciInfo>(), size_of::<b::nvmlPciInfo_t>());
    assert_eq!(size_of::<t::EventData>(), size_of::<b::nvmlEventData_t>());
    assert_eq!(
        size_of::<t::ProcessInfo>(),
        size_of::<b::nvmlProcessInfo_t>()
    );
    assert_eq!(size_of::<t::MemoryV2>(), size_of::<b::nvmlMemory_v2_t>());
    assert_eq!(size_of::<t::FieldValue>(), size_of::<b::nvmlFieldValue_t>());
    assert_eq!(
        align_of::<t::FieldValue>(),
        align_of::<b::nvmlFieldValue_t>()
    );
    assert_eq!(
        size_of::<t::RowRemapperHistogram>(),
        size_of::<b::nvmlRowRemapperHistogramValues_t>()
    );
    assert_eq!(
        size_of::<t::Utilization>(),
        size_of::<b::nvmlUtilization_t>()
    );
}

fn scenario_defaults() {
    // No FAKE_NVML_CONFIG: four default Hopper GPUs.
    set_env(&[]);
    let nvml = init().expect("init");
    assert_eq!(nvml.device_count().unwrap(), 4);
    assert_eq!(nvml.sys_driver_version().unwrap(), "570.172.08");
    assert_eq!(nvml.sys_nvml_version().unwrap(), "12.570.172.08");
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12080);
    assert_eq!(nvml.field_id_scheme(), FieldIdScheme::V12);
    for i in 0..4u32 {
        let d = nvml.device_by_index(i).unwrap();
        let uuid = d.uuid().unwrap();
        assert_eq!(uuid, identity::uuid(i));
        assert!(uuid.starts_with("GPU-") && uuid.len() == 40, "{uuid}");
        let pci = d.pci_info().unwrap();
        assert_eq!(pci.bus_id, identity::pci_bus_id(i));
        assert_eq!(pci.pci_device_id, 0x2335_10DE);
        assert_eq!(d.name().unwrap(), "NVIDIA H200");
        assert_eq!(d.index().unwrap(), i);
        assert_eq!(d.minor_number().unwrap(), i);
        assert_eq!(d.serial().unwrap(), identity::serial(i));
        assert_eq!(d.architecture().unwrap(), DeviceArchitecture::Hopper);
        assert_eq!(d.brand().unwrap(), Brand::Nvidia);
        assert!(d.is_ecc_enabled().unwrap().currently_enabled);
        assert_eq!(d.mig_mode().unwrap().current, 0);
        let mem = d.memory_info().unwrap();
        assert_eq!(mem.total, 143_771 << 20);
        assert!(mem.free > 0 && mem.used > 0);
        assert_eq!(d.temperature(TemperatureSensor::Gpu).unwrap(), 34);
        assert!(d.is_in_persistent_mode().unwrap());
        assert!(d.running_compute_processes().unwrap().is_empty());
        assert!(d.mps_running_compute_processes().unwrap().is_empty());
        assert_eq!(d.max_pcie_link_gen().unwrap(), 5);
        let by_uuid = nvml.device_by_uuid(uuid.as_str()).unwrap();
        assert_eq!(by_uuid.index().unwrap(), i);
        let by_pci = nvml
            .device_by_pci_bus_id(identity::pci_bus_id_legacy(i))
            .unwrap();
        assert_eq!(by_pci.index().unwrap(), i);
    }
    assert!(matches!(
        nvml.device_by_uuid("GPU-00000000-0000-0000-0000-000000000000"),
        Err(NvmlError::NotFound)
    ));
    assert!(matches!(
        nvml.device_by_index(4),
        Err(NvmlError::InvalidArg)
    ));

    let d0 = nvml.device_by_index(0).unwrap();
    let supported = d0.supported_event_types().unwrap();
    assert!(supported.contains(
        EventTypes::CRITICAL_XID_ERROR
            | EventTypes::DOUBLE_BIT_ECC_ERROR
            | EventTypes::SINGLE_BIT_ECC_ERROR
    ));
    // The recovery-action bit (0x8000) is not in the wrapper's bitflags; read raw.
    let mut raw: u64 = 0;
    // SAFETY: valid handle from this `nvml`, valid out-pointer.
    let r = unsafe {
        nvml.lib()
            .nvmlDeviceGetSupportedEventTypes(d0.handle(), &mut raw)
    };
    assert_eq!(r, 0);
    assert_ne!(raw & 0x8000, 0, "recovery action supported on 570+");
    // Ampere+: retired pages are not supported.
    assert!(matches!(
        d0.retired_pages(RetirementCause::DoubleBitEccError),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(
        d0.are_pages_pending_retired(),
        Err(NvmlError::NotSupported)
    ));
}

fn scenario_custom_config() {
    let dir = scratch_dir("custom");
    let config = write_config(
        &dir,
        r#"{"driver_version": "575.51.03",
            "gpus": [
              {"uuid": "GPU-11111111-2222-3333-4444-555555555555",
               "pci_bus_id": "00000000:3B:00.0", "serial": "1320000000001",
               "name": "NVIDIA A10G", "memory_mib": 23028, "architecture": "ampere"},
              {"uuid": "GPU-66666666-7777-8888-9999-000000000000",
               "pci_bus_id": "0000:5e:00.0", "ecc": false}
            ]}"#,
    );
    set_env(&[("FAKE_NVML_CONFIG", &config)]);
    let nvml = init().expect("init");
    assert_eq!(nvml.device_count().unwrap(), 2);
    assert_eq!(nvml.sys_driver_version().unwrap(), "575.51.03");
    let d0 = nvml.device_by_index(0).unwrap();
    let d1 = nvml.device_by_index(1).unwrap();
    assert_eq!(
        d0.uuid().unwrap(),
        "GPU-11111111-2222-3333-4444-555555555555"
    );
    assert_eq!(
        d1.uuid().unwrap(),
        "GPU-66666666-7777-8888-9999-000000000000"
    );
    assert_eq!(d0.pci_info().unwrap().bus_id, "00000000:3B:00.0");
    assert_eq!(d1.pci_info().unwrap().bus_id, "00000000:5E:00.0");
    assert_eq!(d0.serial().unwrap(), "1320000000001");
    assert_eq!(d1.serial().unwrap(), identity::serial(1), "index default");
    assert_eq!(d0.name().unwrap(), "NVIDIA A10G");
    assert_eq!(d1.name().unwrap(), "NVIDIA H200", "architecture default");
    assert_eq!(d0.architecture().unwrap(), DeviceArchitecture::Ampere);
    assert_eq!(d0.memory_info().unwrap().total, 23_028 << 20);
    let by_uuid = nvml
        .device_by_uuid("GPU-66666666-7777-8888-9999-000000000000")
        .unwrap();
    assert_eq!(by_uuid.index().unwrap(), 1);
    let by_pci = nvml.device_by_pci_bus_id("0000:3B:00.0").unwrap();
    assert_eq!(by_pci.index().unwrap(), 0);
    // nvml-wrapper deprecates the by-serial lookup (dual-GPU boards).
    #[allow(deprecated)]
    let by_serial = nvml.device_by_serial("1320000000001").unwrap();
    assert_eq!(by_serial.index().unwrap(), 0);
    assert!(matches!(
        nvml.device_by_uuid(identity::uuid(0).as_str()),
        Err(NvmlError::NotFound)
    ));

    // `"ecc": false`: mode disabled, counters and ECC events not supported.
    assert!(d0.is_ecc_enabled().unwrap().currently_enabled);
    assert!(!d1.is_ecc_enabled().unwrap().currently_enabled);
    assert!(matches!(
        d1.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
        Err(NvmlError::NotSupported)
    ));
    assert!(matches!(field(&d1, 4), Err(NvmlError::NotSupported)));
    assert!(
        !d1.supported_event_types()
            .unwrap()
            .intersects(EventTypes::DOUBLE_BIT_ECC_ERROR | EventTypes::SINGLE_BIT_ECC_ERROR)
    );
    assert_eq!(
        d0.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .unwrap(),
        0
    );
    drop(nvml);

    // A configuration that does not parse makes nvmlInit fail (stderr says why).
    let bad = write_config(&dir, r#"{"gpus": [{"architecture": "pascal"}]}"#);
    set_env(&[("FAKE_NVML_CONFIG", &bad)]);
    assert!(matches!(init(), Err(NvmlError::Unknown)));
    set_env(&[("FAKE_NVML_CONFIG", &dir.join("missing.json"))]);
    assert!(matches!(init(), Err(NvmlError::Unknown)));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn scenario_injections() {
    let dir = scratch_dir("live");
    let config = write_config(&dir, "{}");
    let inj = Injector::new(dir.join("inject"));
    set_env(&[
        ("FAKE_NVML_CONFIG", &config),
        ("FAKE_NVML_INJECT_DIR", &inj.dir),
    ]);
    let nvml = init().expect("init");
    let devices: Vec<_> = (0..4).map(|i| nvml.device_by_index(i).unwrap()).collect();

    // One set with XID + ECC events on every GPU.
    let mut set = nvml.create_event_set().unwrap();
    let wanted = EventTypes::CRITICAL_XID_ERROR
        | EventTypes::DOUBLE_BIT_ECC_ERROR
        | EventTypes::SINGLE_BIT_ECC_ERROR;
    for d in &devices {
        set = d.register_events(wanted, set).unwrap();
    }
    assert!(matches!(wait_event(&set, 30), Err(NvmlError::Timeout)));

    // XID through an injection file, delivered by the watcher while blocked.
    let t0 = Instant::now();
    let written = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            let path = inj.send(r#"{"gpu": 2, "xid": 79}"#);
            (path, Instant::now())
        });
        let ev = wait_event(&set, 5000).expect("xid event");
        let arrived = Instant::now();
        assert_eq!(ev.device.index().unwrap(), 2);
        assert_eq!(ev.device.uuid().unwrap(), identity::uuid(2));
        assert_eq!(ev.event_type, EventTypes::CRITICAL_XID_ERROR);
        assert_eq!(ev.event_data, Some(XidError::Value(79)));
        let (path, sent) = writer.join().unwrap();
        eprintln!("xid event arrived {:?} after the rename", arrived - sent);
        path
    });
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert!(!written.exists(), "injection file deleted after pickup");

    // Pickup by the watcher alone, no NVML call in between (contract: 10 ms;
    // generous bound here against a loaded CI machine).
    let took = inj.send_and_wait(r#"{"gpu": 0, "xid": 999}"#);
    eprintln!("watcher picked up an injection file in {took:?}");
    assert!(took < Duration::from_millis(500), "{took:?}");
    let ev = wait_event(&set, 0).unwrap();
    assert_eq!(ev.event_data, Some(XidError::Unknown));

    // Files are also applied synchronously by the next NVML call.
    inj.send(r#"{"gpu": 3, "temperature": 95}"#);
    assert_eq!(devices[3].temperature(TemperatureSensor::Gpu).unwrap(), 95);

    // ECC: each key adds to its own counter; uncorrected_volatile raises
    // the DBE event, corrected_volatile the SBE event.
    let d1 = &devices[1];
    inj.send(r#"{"gpu": 1, "ecc": {"uncorrected_volatile": 1}}"#);
    let ev = wait_event(&set, 2000).unwrap();
    assert_eq!(ev.event_type, EventTypes::DOUBLE_BIT_ECC_ERROR);
    assert_eq!(ev.device.index().unwrap(), 1);
    assert_eq!(ev.event_data, None);
    let count = |e, c| d1.total_ecc_errors(e, c).unwrap();
    assert_eq!(count(MemoryError::Uncorrected, EccCounter::Volatile), 1);
    assert_eq!(count(MemoryError::Uncorrected, EccCounter::Aggregate), 0);
    inj.send(
        r#"{"gpu": 1, "ecc": {"uncorrected_volatile": 2, "uncorrected_aggregate": 3,
                               "corrected_volatile": 5, "corrected_aggregate": 6}}"#,
    );
    let ev = wait_event(&set, 2000).unwrap();
    assert_eq!(ev.event_type, EventTypes::DOUBLE_BIT_ECC_ERROR);
    let ev = wait_event(&set, 2000).unwrap();
    assert_eq!(ev.event_type, EventTypes::SINGLE_BIT_ECC_ERROR);
    assert_eq!(count(MemoryError::Uncorrected, EccCounter::Volatile), 3);
    assert_eq!(count(MemoryError::Uncorrected, EccCounter::Aggregate), 3);
    assert_eq!(count(MemoryError::Corrected, EccCounter::Volatile), 5);
    assert_eq!(count(MemoryError::Corrected, EccCounter::Aggregate), 6);
    assert_eq!(
        d1.memory_error_counter(
            MemoryError::Corrected,
            EccCounter::Volatile,
            MemoryLocation::Device
        )
        .unwrap(),
        5
    );
    let values: Vec<SampleValue> = [3, 4, 5, 6].map(|id| field(d1, id).unwrap()).into();
    assert_eq!(
        values,
        [
            SampleValue::U64(5),
            SampleValue::U64(3),
            SampleValue::U64(6),
            SampleValue::U64(3)
        ]
    );
    // An aggregate-only change raises nothing.
    inj.send(r#"{"gpu": 1, "ecc": {"uncorrected_aggregate": 1}}"#);
    assert!(matches!(wait_event(&set, 30), Err(NvmlError::Timeout)));

    // UNKNOWN exactly once.
    inj.send(r#"{"unknown": true}"#);
    assert!(matches!(wait_event(&set, 2000), Err(NvmlError::Unknown)));
    assert!(matches!(wait_event(&set, 30), Err(NvmlError::Timeout)));

    // Recovery action: field 230 + event 0x8000, which the wrapper truncates,
    // so read it with a raw wait on a dedicated set.
    let raw_set = nvml.create_event_set().unwrap();
    let raw_set = devices[0]
        .register_events(EventTypes::from_bits_retain(0x8000), raw_set)
        .unwrap();
    inj.send(r#"{"gpu": 0, "recovery_action": 2}"#);
    let mut data: nvml_wrapper_sys::bindings::nvmlEventData_t =
        // SAFETY: plain C struct; all-zero is a valid value.
        unsafe { std::mem::zeroed() };
    // SAFETY: valid set handle and out-pointer.
    let r = unsafe {
        nvml.lib()
            .nvmlEventSetWait_v2(raw_set.handle(), &mut data, 2000)
    };
    assert_eq!(r, 0);
    assert_eq!((data.eventType, data.eventData), (0x8000, 2));
    // SAFETY: reading back the handle the fake wrote.
    assert_eq!(data.device, unsafe { devices[0].handle() });
    assert_eq!(
        (data.gpuInstanceId, data.computeInstanceId),
        (u32::MAX, u32::MAX)
    );
    assert_eq!(field(&devices[0], 230).unwrap(), SampleValue::U32(2));
    // The XID set is not registered for 0x8000: nothing arrives there.
    assert!(matches!(wait_event(&set, 50), Err(NvmlError::Timeout)));
    drop(raw_set);

    // Unsupported types are refused (and nvml-wrapper frees the set).
    let spare = nvml.create_event_set().unwrap();
    assert!(
        devices[0]
            .register_events(EventTypes::POWER_SOURCE_CHANGE, spare)
            .is_err()
    );

    // Row remapping (Hopper): raw call, histogram, field values.
    assert_eq!(remapped_rows(&nvml, 0), (0, [0, 0, 0, 0]));
    inj.send(
        r#"{"gpu": 0, "remapped_rows": {"pending": true, "failure": true, "uncorrectable": 3}}"#,
    );
    assert_eq!(remapped_rows(&nvml, 0), (0, [0, 3, 1, 1]));
    inj.send(r#"{"gpu": 0, "remapped_rows": {"correctable": 2}}"#);
    assert_eq!(
        remapped_rows(&nvml, 0),
        (0, [2, 3, 1, 1]),
        "absent keys kept"
    );
    let mut hist: nvml_wrapper_sys::bindings::nvmlRowRemapperHistogramValues_t =
        // SAFETY: plain C struct; all-zero is a valid value.
        unsafe { std::mem::zeroed() };
    // SAFETY: valid handle and out-pointer.
    let r = unsafe {
        nvml.lib()
            .nvmlDeviceGetRowRemapperHistogram(devices[0].handle(), &mut hist)
    };
    assert_eq!(r, 0);
    assert_eq!(hist.none, 1);
    let f: Vec<SampleValue> = [142, 143, 144, 145]
        .map(|id| field(&devices[0], id).unwrap())
        .into();
    assert_eq!(
        f,
        [
            SampleValue::U32(2),
            SampleValue::U32(3),
            SampleValue::U32(1),
            SampleValue::U32(1)
        ]
    );
    // Pre-Ampere only.
    inj.send(r#"{"gpu": 0, "retired_pages_pending": true}"#);
    assert!(matches!(
        devices[0].are_pages_pending_retired(),
        Err(NvmlError::NotSupported)
    ));

    // Throttle reasons, MPS clients.
    inj.send(r#"{"gpu": 3, "throttle": 72}"#);
    inj.send(r#"{"gpu": 3, "mps_clients": [4242, 4343]}"#);
    let d3 = &devices[3];
    assert_eq!(
        d3.current_throttle_reasons().unwrap(),
        ThrottleReasons::HW_SLOWDOWN | ThrottleReasons::HW_THERMAL_SLOWDOWN
    );
    let mps = d3.mps_running_compute_processes().unwrap();
    assert_eq!(mps.iter().map(|p| p.pid).collect::<Vec<_>>(), [4242, 4343]);
    assert_eq!(mps[0].used_gpu_memory, UsedGpuMemory::Unavailable);
    assert_eq!(mps[0].gpu_instance_id, None);
    let compute = d3.running_compute_processes().unwrap();
    assert_eq!(
        compute.iter().map(|p| p.pid).collect::<Vec<_>>(),
        [4242, 4343]
    );
    // Used memory per client, changing with each injection.
    for mib in [2048u64, 3072] {
        inj.send(&format!(
            r#"{{"gpu": 3, "mps_clients": [4242, {{"pid": 4343, "used_mib": {mib}}}]}}"#
        ));
        let mps = d3.mps_running_compute_processes().unwrap();
        assert_eq!(mps[0].used_gpu_memory, UsedGpuMemory::Unavailable);
        assert_eq!(mps[1].used_gpu_memory, UsedGpuMemory::Used(mib << 20));
        let used = d3.memory_info().unwrap().used;
        assert_eq!(used, (4 << 20) + (1 << 30) + (mib << 20));
    }
    // A process outside MPS: in the compute list only, after the clients, and counted in
    // the memory in use.
    inj.send(r#"{"gpu": 3, "compute_processes": [{"pid": 4444, "used_mib": 100}]}"#);
    let mps = d3.mps_running_compute_processes().unwrap();
    assert_eq!(mps.iter().map(|p| p.pid).collect::<Vec<_>>(), [4242, 4343]);
    let compute = d3.running_compute_processes().unwrap();
    assert_eq!(
        compute.iter().map(|p| p.pid).collect::<Vec<_>>(),
        [4242, 4343, 4444]
    );
    assert_eq!(compute[2].used_gpu_memory, UsedGpuMemory::Used(100 << 20));
    assert_eq!(
        d3.memory_info().unwrap().used,
        (4 << 20) + (1 << 30) + (3072 << 20) + (100 << 20)
    );
    inj.send(r#"{"gpu": 3, "mps_clients": []}"#);
    assert!(d3.mps_running_compute_processes().unwrap().is_empty());
    let compute = d3.running_compute_processes().unwrap();
    assert_eq!(compute.iter().map(|p| p.pid).collect::<Vec<_>>(), [4444]);
    inj.send(r#"{"gpu": 3, "compute_processes": []}"#);
    assert!(d3.running_compute_processes().unwrap().is_empty());

    // Per-function failure: that function on that GPU returns the code
    // until removed ("code": 0) or reset; "times" limits it.
    inj.send(r#"{"gpu": 1, "fail": {"function": "nvmlDeviceGetTotalEccErrors", "code": 999}}"#);
    for _ in 0..3 {
        assert!(matches!(
            d1.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile),
            Err(NvmlError::Unknown)
        ));
    }
    assert_eq!(
        devices[2]
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .unwrap(),
        0,
        "other GPUs unaffected"
    );
    assert!(d1.temperature(TemperatureSensor::Gpu).is_ok());
    inj.send(r#"{"gpu": 1, "fail": {"function": "nvmlDeviceGetTotalEccErrors", "code": 0}}"#);
    assert_eq!(count(MemoryError::Uncorrected, EccCounter::Volatile), 3);
    inj.send(r#"{"fail": {"function": "nvmlDeviceGetTemperature", "code": 15, "times": 1}}"#);
    assert!(matches!(
        d3.temperature(TemperatureSensor::Gpu),
        Err(NvmlError::GpuLost)
    ));
    assert_eq!(d3.temperature(TemperatureSensor::Gpu).unwrap(), 95);

    // A bad file is reported on stderr and renamed to *.bad; later files
    // still apply and nothing else is disturbed. Non-*.json names are ignored.
    let bad = inj.send(r#"{"gpu": 0, "xid": "#);
    let bad_key = inj.send(r#"{"gpu": 0, "exploded": true}"#);
    let bad_gpu = inj.send(r#"{"gpu": 9, "xid": 79}"#);
    std::fs::write(inj.dir.join("notes.txt"), "{}").unwrap();
    std::fs::write(inj.dir.join("later.json.tmp"), r#"{"gpu": 0, "xid": 1}"#).unwrap();
    let good = inj.send(r#"{"gpu": 2, "temperature": 77}"#);
    for p in [&bad_key, &bad_gpu, &good] {
        wait_gone(p);
    }
    assert_eq!(devices[2].temperature(TemperatureSensor::Gpu).unwrap(), 77);
    assert!(matches!(wait_event(&set, 30), Err(NvmlError::Timeout)));
    let name = |p: &Path| p.file_name().unwrap().to_str().unwrap().to_string();
    let mut left = vec![
        format!("{}.bad", name(&bad_key)),
        format!("{}.bad", name(&bad_gpu)),
        "later.json.tmp".to_string(),
        "notes.txt".to_string(),
    ];
    // The truncated file is retried for 1 s (it might still be being
    // written), then renamed too.
    wait_gone(&bad);
    left.push(format!("{}.bad", name(&bad)));
    left.sort();
    assert_eq!(inj.entries(), left);
    for l in &left {
        std::fs::remove_file(inj.dir.join(l)).unwrap();
    }

    // Several injections in one file: an array, applied in order.
    inj.send(r#"[{"gpu": 0, "temperature": 50}, {"gpu": 0, "temperature": 51}]"#);
    assert_eq!(devices[0].temperature(TemperatureSensor::Gpu).unwrap(), 51);

    // Hidden GPU.
    inj.send(r#"{"count": 3}"#);
    assert_eq!(nvml.device_count().unwrap(), 3);
    assert!(matches!(
        nvml.device_by_index(3),
        Err(NvmlError::InvalidArg)
    ));
    assert!(matches!(
        nvml.device_by_uuid(identity::uuid(3).as_str()),
        Err(NvmlError::NotFound)
    ));

    // Lost GPU: queued events drain first, then waits report GpuLost.
    inj.send(r#"[{"gpu": 3, "xid": 79}, {"gpu": 3, "lost": true}]"#);
    let ev = wait_event(&set, 2000).unwrap();
    assert_eq!(ev.event_data, Some(XidError::Value(79)));
    assert!(matches!(wait_event(&set, 2000), Err(NvmlError::GpuLost)));
    assert!(matches!(d3.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(
        d3.temperature(TemperatureSensor::Gpu),
        Err(NvmlError::GpuLost)
    ));
    inj.send(r#"{"count": 4}"#);
    assert_eq!(nvml.device_count().unwrap(), 4, "lost GPUs stay counted");
    assert!(matches!(nvml.device_by_index(3), Err(NvmlError::GpuLost)));
    assert_eq!(devices[0].uuid().unwrap(), identity::uuid(0));

    // Reset heals everything.
    inj.send(r#"{"reset": true}"#);
    assert_eq!(d3.uuid().unwrap(), identity::uuid(3));
    assert_eq!(d3.temperature(TemperatureSensor::Gpu).unwrap(), 34);
    assert_eq!(remapped_rows(&nvml, 0), (0, [0, 0, 0, 0]));
    assert!(matches!(wait_event(&set, 30), Err(NvmlError::Timeout)));

    // Hardware state survives nvmlShutdown + dlclose + nvmlInit with an
    // unchanged configuration; files dropped while NVML is shut down wait
    // for the next nvmlInit.
    inj.send_and_wait(r#"{"gpu": 2, "lost": true}"#);
    drop(set);
    drop(devices);
    drop(nvml);
    let waiting = inj.send(r#"{"gpu": 1, "temperature": 66}"#);
    std::thread::sleep(Duration::from_millis(30));
    assert!(waiting.exists(), "not applied while shut down");
    let nvml = init().expect("re-init");
    assert!(!waiting.exists());
    assert!(matches!(nvml.device_by_index(2), Err(NvmlError::GpuLost)));
    assert_eq!(
        nvml.device_by_index(1)
            .unwrap()
            .temperature(TemperatureSensor::Gpu)
            .unwrap(),
        66
    );
    drop(nvml);

    // A changed configuration (same path, new content) rebuilds healthy GPUs.
    write_config(&dir, r#"{"driver_version": "570.172.08"}"#);
    let nvml = init().expect("re-init with a new config");
    assert_eq!(
        nvml.device_by_index(2).unwrap().uuid().unwrap(),
        identity::uuid(2)
    );
    drop(nvml);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn scenario_config_inside_inject_dir() {
    // The configuration file is never taken as an injection, even when it
    // sits in the injection directory under a *.json name.
    let dir = scratch_dir("shared");
    let config = write_config(&dir, r#"{"gpus": [{}]}"#);
    set_env(&[
        ("FAKE_NVML_CONFIG", &config),
        ("FAKE_NVML_INJECT_DIR", &dir),
    ]);
    let nvml = init().expect("init");
    let inj = Injector::new(dir.clone());
    inj.send_and_wait(r#"{"gpu": 0, "temperature": 40}"#);
    let d = nvml.device_by_index(0).unwrap();
    assert_eq!(d.temperature(TemperatureSensor::Gpu).unwrap(), 40);
    assert_eq!(inj.entries(), ["config.json"]);
    drop(nvml);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn scenario_polls_counted() {
    // FAKE_NVML_POLLS: one line (this process's pid) per nvmlDeviceGetCount_v2, failed ones
    // too; nothing else is counted.
    let dir = scratch_dir("polls");
    let polls = dir.join("polls");
    let inject = dir.join("inject");
    std::fs::create_dir_all(&inject).unwrap();
    set_env(&[
        ("FAKE_NVML_POLLS", &polls),
        ("FAKE_NVML_INJECT_DIR", &inject),
    ]);
    let nvml = init().expect("init");
    let lines = || std::fs::read_to_string(&polls).unwrap_or_default();
    let before = lines().lines().count();
    assert_eq!(nvml.device_count().unwrap(), 4);
    let d = nvml.device_by_index(1).unwrap();
    d.temperature(TemperatureSensor::Gpu).unwrap();
    assert_eq!(lines().lines().count(), before + 1, "{}", lines());
    Injector::new(inject.clone()).send_and_wait(
        r#"{"fail": {"function": "nvmlDeviceGetCount_v2", "code": 999, "times": 1}}"#,
    );
    assert!(nvml.device_count().is_err());
    let text = lines();
    assert_eq!(text.lines().count(), before + 2, "{text}");
    let me = std::process::id().to_string();
    assert!(text.lines().all(|l| l == me), "{text}");
    drop(nvml);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn scenario_backlog() {
    // Events injected before anyone registered are handed to the first set
    // registering for them (default), or dropped with "event_backlog": false.
    // Files already in the directory are applied at nvmlInit.
    for (backlog, expect) in [(true, true), (false, false)] {
        let dir = scratch_dir("backlog");
        let config = write_config(
            &dir,
            &format!(r#"{{"event_backlog": {backlog}, "gpus": [{{}}, {{}}]}}"#),
        );
        let inj = Injector::new(dir.join("inject"));
        inj.send(r#"{"gpu": 1, "xid": 48}"#);
        inj.send(r#"{"gpu": 1, "ecc": {"corrected_volatile": 2}}"#);
        set_env(&[
            ("FAKE_NVML_CONFIG", &config),
            ("FAKE_NVML_INJECT_DIR", &inj.dir),
        ]);
        let nvml = init().expect("init");
        assert_eq!(nvml.device_count().unwrap(), 2);
        assert!(inj.entries().is_empty(), "applied at init");
        let d = nvml.device_by_index(1).unwrap();
        let set = d
            .register_events(
                EventTypes::CRITICAL_XID_ERROR | EventTypes::SINGLE_BIT_ECC_ERROR,
                nvml.create_event_set().unwrap(),
            )
            .unwrap();
        let got = wait_event(&set, 50);
        if expect {
            assert_eq!(got.unwrap().event_data, Some(XidError::Value(48)));
        } else {
            assert!(matches!(got, Err(NvmlError::Timeout)));
        }
        // SBE events are never backlogged.
        assert!(matches!(wait_event(&set, 30), Err(NvmlError::Timeout)));
        drop(set);
        drop(nvml);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

fn scenario_init_errors() {
    let nine = Path::new("9");
    let eighteen = Path::new("18");
    set_env(&[("FAKE_NVML_INIT_ERROR", nine)]);
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));
    set_env(&[("FAKE_NVML_INIT_ERROR", eighteen)]);
    assert!(matches!(init(), Err(NvmlError::LibRmVersionMismatch)));
    set_env(&[]);
    assert!(init().is_ok());
}

fn scenario_volta_and_mixed() {
    let dir = scratch_dir("volta");
    let config = write_config(
        &dir,
        r#"{"gpus": [{"architecture": "volta"}, {"architecture": "volta"},
                     {"architecture": "ampere"}]}"#,
    );
    let inj = Injector::new(dir.join("inject"));
    set_env(&[
        ("FAKE_NVML_CONFIG", &config),
        ("FAKE_NVML_INJECT_DIR", &inj.dir),
    ]);
    let nvml = init().expect("init");
    inj.send(
        r#"[{"gpu": 0, "retired_pages": {"sbe": 3, "dbe": 1}},
            {"gpu": 0, "retired_pages_pending": true},
            {"gpu": 1, "ecc": {"corrected_volatile": 7}}]"#,
    );
    assert_eq!(nvml.device_count().unwrap(), 3);
    let d0 = nvml.device_by_index(0).unwrap();
    assert_eq!(d0.name().unwrap(), "Tesla V100-SXM2-32GB");
    assert_eq!(d0.architecture().unwrap(), DeviceArchitecture::Volta);
    assert_eq!(d0.brand().unwrap(), Brand::Tesla);
    let sbe = d0
        .retired_pages(RetirementCause::MultipleSingleBitEccErrors)
        .unwrap();
    assert_eq!(sbe.len(), 3);
    assert!(sbe.iter().all(|p| p.timestamp > 0));
    let dbe = d0
        .retired_pages(RetirementCause::DoubleBitEccError)
        .unwrap();
    assert_eq!(dbe.len(), 1);
    assert!(d0.are_pages_pending_retired().unwrap());
    assert!(
        nvml.device_by_index(1)
            .unwrap()
            .retired_pages(RetirementCause::DoubleBitEccError)
            .unwrap()
            .is_empty()
    );
    assert_eq!(remapped_rows(&nvml, 0).0, 3, "NOT_SUPPORTED before Ampere");
    assert!(matches!(d0.mig_mode(), Err(NvmlError::NotSupported)));
    assert_eq!(
        nvml.device_by_index(1)
            .unwrap()
            .total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile)
            .unwrap(),
        7
    );
    assert_eq!(field(&d0, 29).unwrap(), SampleValue::U64(3));
    assert_eq!(field(&d0, 30).unwrap(), SampleValue::U64(1));
    assert!(matches!(field(&d0, 142), Err(NvmlError::NotSupported)));
    // GPU 2 is an Ampere in the same machine: remapped rows, no retired pages.
    let d2 = nvml.device_by_index(2).unwrap();
    assert_eq!(d2.name().unwrap(), "NVIDIA A100-SXM4-80GB");
    assert_eq!(remapped_rows(&nvml, 2), (0, [0, 0, 0, 0]));
    assert!(matches!(
        d2.retired_pages(RetirementCause::DoubleBitEccError),
        Err(NvmlError::NotSupported)
    ));
    assert_eq!(d2.mig_mode().unwrap().current, 0);
    drop(nvml);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn scenario_driver_580() {
    let dir = scratch_dir("580");
    let config = write_config(
        &dir,
        r#"{"driver_version": "580.82.07", "gpus": [{"architecture": "ampere"}]}"#,
    );
    set_env(&[("FAKE_NVML_CONFIG", &config)]);
    let nvml = init().expect("init");
    assert_eq!(nvml.field_id_scheme(), FieldIdScheme::V13Update1);
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 13000);
    let d = nvml.device_by_index(0).unwrap();
    assert_eq!(d.name().unwrap(), "NVIDIA A100-SXM4-80GB");
    assert_eq!(remapped_rows(&nvml, 0), (0, [0, 0, 0, 0]));
    drop(nvml);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fake_nvml_through_nvml_wrapper() {
    let path = lib_path();
    eprintln!("using {}", path.display());
    layouts_match_nvml_wrapper_sys();
    scenario_defaults();
    scenario_custom_config();
    scenario_injections();
    scenario_config_inside_inject_dir();
    scenario_polls_counted();
    scenario_backlog();
    scenario_init_errors();
    scenario_volta_and_mixed();
    scenario_driver_580();
}
