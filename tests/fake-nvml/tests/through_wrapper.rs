//! Drives `libfake_nvml.so` through the real `nvml-wrapper` 0.13, the way
//! gpu-medic will.
//!
//! The fake reads its scenario from the environment at `nvmlInit` and keeps
//! process-global state, so all scenarios run sequentially inside the single
//! `#[test]` below (this binary must contain no other test).
//!
//! The library is found at `$FAKE_NVML_LIB`, else in this test binary's
//! directory (`target/debug/deps/libfake_nvml.so`, which `cargo test -p
//! fake-nvml` always rebuilds), else `target/debug/libfake_nvml.so` (from
//! `cargo build -p fake-nvml`); a clear panic says so when none exists.

use std::ffi::CString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::device::ThrottleReasons;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{
    Brand, EccCounter, MemoryError, RetirementCause, TemperatureSensor,
};
use nvml_wrapper::enums::device::{DeviceArchitecture, SampleValue, UsedGpuMemory};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{EventSet, FieldIdScheme};

use fake_nvml::identity;

const SCENARIO_VARS: [&str; 7] = [
    "FAKE_NVML_GPUS",
    "FAKE_NVML_ARCH",
    "FAKE_NVML_INIT_ERROR",
    "FAKE_NVML_DRIVER_VERSION",
    "FAKE_NVML_CONTROL",
    "FAKE_NVML_SCRIPT",
    "FAKE_NVML_EVENT_BACKLOG",
];

fn lib_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FAKE_NVML_LIB").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        // This binary is target/<profile>/deps/through_wrapper-<hash>.
        // `cargo test -p fake-nvml` (re)builds deps/libfake_nvml.so;
        // `cargo build -p fake-nvml` also links it into target/<profile>/.
        if let Some(deps) = exe.parent() {
            candidates.push(deps.join("libfake_nvml.so"));
            if let Some(profile) = deps.parent() {
                candidates.push(profile.join("libfake_nvml.so"));
            }
        }
    }
    candidates
        .push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/libfake_nvml.so"));
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| {
            panic!(
                "libfake_nvml.so not found (looked at {candidates:?}); \
                 run `cargo build -p fake-nvml` or set FAKE_NVML_LIB"
            )
        })
}

/// Replaces every `FAKE_NVML_*` scenario variable.
fn set_scenario(vars: &[(&str, &str)]) {
    for k in SCENARIO_VARS {
        // SAFETY: this binary has a single test; the harness runs it while
        // no other thread reads or writes the environment (the fake's
        // watcher thread never touches it).
        unsafe { std::env::remove_var(k) };
    }
    for (k, v) in vars {
        // SAFETY: as above.
        unsafe { std::env::set_var(k, v) };
    }
}

fn init() -> Result<Nvml, NvmlError> {
    let path = lib_path();
    Nvml::builder().lib_path(path.as_os_str()).init()
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fake-nvml-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Appends lines to a control file.
struct Control(PathBuf);

impl Control {
    fn new(dir: &Path) -> Control {
        let path = dir.join("control");
        std::fs::File::create(&path).unwrap();
        Control(path)
    }
    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
    fn send(&self, line: &str) {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.0)
            .unwrap();
        writeln!(f, "{line}").unwrap();
    }
}

fn wait_event<'n>(
    set: &EventSet<'n>,
    ms: u32,
) -> Result<nvml_wrapper::struct_wrappers::event::EventData<'n>, NvmlError> {
    set.wait(ms)
}

/// Calls `fakenvml_command` in the already-loaded library.
fn fakenvml_command(line: &str) -> u32 {
    let path = CString::new(lib_path().into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: `path` is a valid C string; RTLD_NOLOAD only returns a handle
    // to the copy nvml-wrapper already loaded.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    assert!(!handle.is_null(), "fake library is not loaded");
    // SAFETY: valid handle and symbol name.
    let sym = unsafe { libc::dlsym(handle, c"fakenvml_command".as_ptr()) };
    assert!(!sym.is_null(), "fakenvml_command missing");
    // SAFETY: the symbol has this exact signature (see src/ffi.rs).
    let f: unsafe extern "C" fn(*const libc::c_char) -> u32 = unsafe { std::mem::transmute(sym) };
    let line = CString::new(line).unwrap();
    // SAFETY: NUL-terminated argument; then drop the extra reference.
    unsafe {
        let r = f(line.as_ptr());
        libc::dlclose(handle);
        r
    }
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

fn scenario_identity() {
    set_scenario(&[]);
    let nvml = init().expect("init");
    assert_eq!(nvml.device_count().unwrap(), 4);
    assert_eq!(nvml.sys_driver_version().unwrap(), "570.172.08");
    assert_eq!(nvml.sys_nvml_version().unwrap(), "12.570.172.08");
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 12080);
    assert_eq!(nvml.field_id_scheme(), FieldIdScheme::V12);
    let mut uuids = Vec::new();
    let mut bus_ids = Vec::new();
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
        uuids.push(uuid);
        bus_ids.push(pci.bus_id);
    }
    uuids.sort();
    uuids.dedup();
    bus_ids.sort();
    bus_ids.dedup();
    assert_eq!((uuids.len(), bus_ids.len()), (4, 4));
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

fn remapped_rows(nvml: &Nvml, index: u32) -> (u32, [u32; 4]) {
    let d = nvml.device_by_index(index).unwrap();
    let mut v = [0u32; 4];
    let [a, b, c, e] = &mut v;
    // SAFETY: valid handle and four valid out-pointers.
    let r = unsafe { nvml.lib().nvmlDeviceGetRemappedRows(d.handle(), a, b, c, e) };
    (r, v)
}

fn scenario_live_faults() {
    let dir = scratch_dir("live");
    let ctl = Control::new(&dir);
    set_scenario(&[("FAKE_NVML_CONTROL", ctl.path())]);
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

    // XID through the control file, delivered by the watcher while blocked.
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            ctl.send("xid 2 79");
        });
        let ev = wait_event(&set, 5000).expect("xid event");
        assert_eq!(ev.device.index().unwrap(), 2);
        assert_eq!(ev.device.uuid().unwrap(), identity::uuid(2));
        assert_eq!(ev.event_type, EventTypes::CRITICAL_XID_ERROR);
        assert_eq!(ev.event_data, Some(XidError::Value(79)));
    });
    assert!(t0.elapsed() < Duration::from_secs(2));

    ctl.send("xid 0 999");
    let ev = wait_event(&set, 2000).unwrap();
    assert_eq!(ev.event_data, Some(XidError::Unknown));

    // ECC: counters and events.
    let d1 = &devices[1];
    assert_eq!(
        d1.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .unwrap(),
        0
    );
    ctl.send("ecc-dbe 1");
    let ev = wait_event(&set, 2000).unwrap();
    assert_eq!(ev.event_type, EventTypes::DOUBLE_BIT_ECC_ERROR);
    assert_eq!(ev.device.index().unwrap(), 1);
    assert_eq!(ev.event_data, None);
    for counter in [EccCounter::Volatile, EccCounter::Aggregate] {
        assert_eq!(
            d1.total_ecc_errors(MemoryError::Uncorrected, counter)
                .unwrap(),
            1
        );
    }
    ctl.send("ecc-sbe 1 5");
    let ev = wait_event(&set, 2000).unwrap();
    assert_eq!(ev.event_type, EventTypes::SINGLE_BIT_ECC_ERROR);
    assert_eq!(
        d1.total_ecc_errors(MemoryError::Corrected, EccCounter::Aggregate)
            .unwrap(),
        5
    );
    assert_eq!(
        d1.memory_error_counter(
            MemoryError::Corrected,
            EccCounter::Volatile,
            nvml_wrapper::enum_wrappers::device::MemoryLocation::Device
        )
        .unwrap(),
        5
    );
    let fields = d1
        .field_values_for(&[FieldId(3), FieldId(4), FieldId(6)])
        .unwrap();
    let values: Vec<SampleValue> = fields
        .into_iter()
        .map(|f| f.unwrap().value.unwrap())
        .collect();
    assert_eq!(
        values,
        [
            SampleValue::U64(5),
            SampleValue::U64(1),
            SampleValue::U64(1)
        ]
    );

    // UNKNOWN exactly once.
    ctl.send("unknown");
    assert!(matches!(wait_event(&set, 2000), Err(NvmlError::Unknown)));
    assert!(matches!(wait_event(&set, 30), Err(NvmlError::Timeout)));

    // Recovery action: field 230 + event 0x8000, which the wrapper truncates,
    // so read it with a raw wait on a dedicated set.
    let raw_set = nvml.create_event_set().unwrap();
    let raw_set = devices[0]
        .register_events(EventTypes::from_bits_retain(0x8000), raw_set)
        .unwrap();
    ctl.send("recovery 0 node-reboot");
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
    let f = devices[0].field_values_for(&[FieldId(230)]).unwrap();
    assert_eq!(
        f[0].as_ref().unwrap().value.as_ref().unwrap(),
        &SampleValue::U32(2)
    );
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

    // Row remapping (Hopper), raw call plus histogram and field values.
    assert_eq!(remapped_rows(&nvml, 0), (0, [0, 0, 0, 0]));
    ctl.send("remap 0 2 1");
    ctl.send("remap-pending 0");
    ctl.send("remap-failure 0");
    assert_eq!(remapped_rows(&nvml, 0), (0, [2, 1, 1, 1]));
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
    let f: Vec<SampleValue> = devices[0]
        .field_values_for(&[FieldId(142), FieldId(143), FieldId(144), FieldId(145)])
        .unwrap()
        .into_iter()
        .map(|f| f.unwrap().value.unwrap())
        .collect();
    assert_eq!(
        f,
        [
            SampleValue::U32(2),
            SampleValue::U32(1),
            SampleValue::U32(1),
            SampleValue::U32(1)
        ]
    );

    // Temperature, throttle reasons, processes.
    ctl.send("temp 3 91");
    ctl.send("throttle 3 0x48");
    ctl.send("mps-procs 3 4242,4343");
    let d3 = &devices[3];
    assert_eq!(d3.temperature(TemperatureSensor::Gpu).unwrap(), 91);
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

    // Per-function failure injection.
    ctl.send("fail nvmlDeviceGetTemperature 3 999 1");
    assert!(matches!(
        d3.temperature(TemperatureSensor::Gpu),
        Err(NvmlError::Unknown)
    ));
    assert_eq!(d3.temperature(TemperatureSensor::Gpu).unwrap(), 91);

    // Synchronous injection through the exported function.
    assert_eq!(fakenvml_command("temp 2 77"), 0);
    assert_eq!(devices[2].temperature(TemperatureSensor::Gpu).unwrap(), 77);
    assert_eq!(fakenvml_command("bogus"), 2);

    // Missing GPU.
    ctl.send("count 3");
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
    ctl.send("xid 3 79");
    ctl.send("lost 3");
    let ev = wait_event(&set, 2000).unwrap();
    assert_eq!(ev.event_data, Some(XidError::Value(79)));
    assert!(matches!(wait_event(&set, 2000), Err(NvmlError::GpuLost)));
    assert!(matches!(d3.uuid(), Err(NvmlError::GpuLost)));
    assert!(matches!(
        d3.temperature(TemperatureSensor::Gpu),
        Err(NvmlError::GpuLost)
    ));
    ctl.send("count 4");
    assert_eq!(nvml.device_count().unwrap(), 4, "lost GPUs stay counted");
    assert!(matches!(nvml.device_by_index(3), Err(NvmlError::GpuLost)));
    assert_eq!(devices[0].uuid().unwrap(), identity::uuid(0));

    // Reset heals everything.
    ctl.send("reset");
    assert_eq!(d3.uuid().unwrap(), identity::uuid(3));
    assert_eq!(d3.temperature(TemperatureSensor::Gpu).unwrap(), 34);
    assert_eq!(remapped_rows(&nvml, 0), (0, [0, 0, 0, 0]));
    assert!(matches!(wait_event(&set, 30), Err(NvmlError::Timeout)));

    // Hardware state survives nvmlShutdown + dlclose + nvmlInit with an
    // unchanged scenario, and control lines are not applied twice.
    ctl.send("lost 2");
    drop(set);
    drop(devices);
    drop(nvml);
    let nvml = init().expect("re-init");
    assert!(matches!(nvml.device_by_index(2), Err(NvmlError::GpuLost)));
    let set = nvml
        .device_by_index(0)
        .unwrap()
        .register_events(
            EventTypes::CRITICAL_XID_ERROR,
            nvml.create_event_set().unwrap(),
        )
        .unwrap();
    assert!(matches!(wait_event(&set, 100), Err(NvmlError::Timeout)));
    drop(set);
    drop(nvml);
    std::fs::remove_dir_all(&dir).unwrap();
}

fn scenario_backlog() {
    // Events raised before anyone registered are handed to the first set
    // registering for them (default), or dropped with BACKLOG=0.
    for (backlog, expect) in [("1", true), ("0", false)] {
        set_scenario(&[
            ("FAKE_NVML_GPUS", "2"),
            ("FAKE_NVML_SCRIPT", "xid 1 48; ecc-sbe 1 2"),
            ("FAKE_NVML_EVENT_BACKLOG", backlog),
        ]);
        let nvml = init().expect("init");
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
    }
}

fn scenario_init_errors() {
    set_scenario(&[("FAKE_NVML_INIT_ERROR", "9")]);
    assert!(matches!(init(), Err(NvmlError::DriverNotLoaded)));
    set_scenario(&[("FAKE_NVML_INIT_ERROR", "18")]);
    assert!(matches!(init(), Err(NvmlError::LibRmVersionMismatch)));
    set_scenario(&[]);
    assert!(init().is_ok());
}

fn scenario_volta() {
    set_scenario(&[
        ("FAKE_NVML_GPUS", "2"),
        ("FAKE_NVML_ARCH", "volta"),
        (
            "FAKE_NVML_SCRIPT",
            "retired 0 3 1; retired-pending 0; ecc-sbe 1 7",
        ),
    ]);
    let nvml = init().expect("init");
    assert_eq!(nvml.device_count().unwrap(), 2);
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
    let f = d0
        .field_values_for(&[FieldId(29), FieldId(30), FieldId(142)])
        .unwrap();
    assert_eq!(
        f[0].as_ref().unwrap().value.as_ref().unwrap(),
        &SampleValue::U64(3)
    );
    assert_eq!(
        f[1].as_ref().unwrap().value.as_ref().unwrap(),
        &SampleValue::U64(1)
    );
    assert!(matches!(
        f[2].as_ref().unwrap().value,
        Err(NvmlError::NotSupported)
    ));
}

fn scenario_driver_580() {
    set_scenario(&[
        ("FAKE_NVML_ARCH", "ampere"),
        ("FAKE_NVML_DRIVER_VERSION", "580.82.07"),
    ]);
    let nvml = init().expect("init");
    assert_eq!(nvml.field_id_scheme(), FieldIdScheme::V13Update1);
    assert_eq!(nvml.sys_cuda_driver_version().unwrap(), 13000);
    let d = nvml.device_by_index(0).unwrap();
    assert_eq!(d.name().unwrap(), "NVIDIA A100-SXM4-80GB");
    assert_eq!(remapped_rows(&nvml, 0), (0, [0, 0, 0, 0]));
}

#[test]
fn fake_nvml_through_nvml_wrapper() {
    let path = lib_path();
    eprintln!("using {}", path.display());
    layouts_match_nvml_wrapper_sys();
    scenario_identity();
    scenario_live_faults();
    scenario_backlog();
    scenario_init_errors();
    scenario_volta();
    scenario_driver_580();
}
