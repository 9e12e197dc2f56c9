//! The exported C ABI (`nvml*` symbols).
//!
//! Common safety contract (NVML's own): every pointer argument is either NULL
//! or valid for the access the NVML documentation describes (one element for
//! scalar out-parameters, `length` bytes for string buffers, `*count`
//! elements for arrays), suitably aligned, and not aliased by other live
//! references for the duration of the call. NULL out-pointers yield
//! `NVML_ERROR_INVALID_ARGUMENT`.
//!
//! SAFETY (every `#[unsafe(no_mangle)]` below): each exported name is an NVML
//! ABI symbol defined exactly once in this library, with the C signature from
//! `nvml.h`, so it cannot clash with another definition inside the cdylib.
//! Consumers load it with `dlopen(RTLD_LOCAL)` (nvml-wrapper does) and must
//! not also load a real `libnvidia-ml` into the global symbol namespace.
#![allow(non_snake_case)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_ulonglong};

use crate::config::GpuSpec;
use crate::identity;
use crate::state::{self, Global};
use crate::types::{self, *};

// ---------------------------------------------------------------- helpers

/// Writes `v` through `p`.
///
/// # Safety
/// `p` must be NULL or valid and aligned for writing one `T`.
unsafe fn put<T>(p: *mut T, v: T) -> NvmlReturn {
    if p.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: `p` is non-null and, by this function's contract, valid for a write.
    unsafe { p.write(v) };
    SUCCESS
}

/// Copies `s` and a NUL into `buf` (`len` bytes); INSUFFICIENT_SIZE if it does not fit.
///
/// # Safety
/// `buf` must be NULL or valid for writing `len` bytes.
unsafe fn put_str(buf: *mut c_char, len: c_uint, s: &str) -> NvmlReturn {
    if buf.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    if s.len() + 1 > len as usize {
        return ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: `buf` is valid for `len` bytes and `s.len() + 1 <= len`; a Rust
    // string cannot overlap a caller-owned C buffer.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr().cast::<c_char>(), buf, s.len());
        buf.add(s.len()).write(0);
    }
    SUCCESS
}

/// Reads a C string argument.
///
/// # Safety
/// `p` must be NULL or point to a NUL-terminated string.
unsafe fn get_str<'a>(p: *const c_char) -> Option<&'a str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated by contract.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

fn status(r: Result<(), NvmlReturn>) -> NvmlReturn {
    r.err().unwrap_or(SUCCESS)
}

/// Device-scoped getter: runs `f` and writes its result through `out`.
///
/// # Safety
/// `out` must be NULL or valid and aligned for writing one `T`.
unsafe fn dev_get<T>(
    name: &str,
    dev: NvmlDevice,
    out: *mut T,
    f: impl FnOnce(&mut Global, usize) -> Result<T, NvmlReturn>,
) -> NvmlReturn {
    if out.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    match state::device_call(name, dev, f) {
        // SAFETY: `out` is non-null and valid per this function's contract.
        Ok(v) => unsafe { put(out, v) },
        Err(e) => e,
    }
}

/// Device-scoped string getter.
///
/// # Safety
/// `buf` must be NULL or valid for writing `len` bytes.
unsafe fn dev_str(
    name: &str,
    dev: NvmlDevice,
    buf: *mut c_char,
    len: c_uint,
    f: impl FnOnce(&mut Global, usize) -> String,
) -> NvmlReturn {
    if buf.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    match state::device_call(name, dev, |g, i| Ok(f(g, i))) {
        // SAFETY: forwarded contract of this function.
        Ok(s) => unsafe { put_str(buf, len, &s) },
        Err(e) => e,
    }
}

/// System-scoped string getter.
///
/// # Safety
/// `buf` must be NULL or valid for writing `len` bytes.
unsafe fn sys_str(
    name: &str,
    buf: *mut c_char,
    len: c_uint,
    f: impl FnOnce(&mut Global) -> String,
) -> NvmlReturn {
    if buf.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    match state::system_call(name, |g| Ok(f(g))) {
        // SAFETY: forwarded contract of this function.
        Ok(s) => unsafe { put_str(buf, len, &s) },
        Err(e) => e,
    }
}

fn cbuf<const N: usize>(s: &str) -> [c_char; N] {
    let mut out = [0 as c_char; N];
    for (dst, src) in out.iter_mut().zip(s.bytes().take(N - 1)) {
        *dst = src as c_char;
    }
    out
}

fn pci_info(spec: &GpuSpec) -> PciInfo {
    let (domain, bus, device, _) = spec.pci;
    PciInfo {
        bus_id_legacy: cbuf(&spec.bus_id_legacy()),
        domain,
        bus,
        device,
        pci_device_id: spec.pci_device_id,
        pci_sub_system_id: spec.pci_sub_system_id,
        bus_id: cbuf(&spec.bus_id()),
    }
}

const SET_SHIFT: u32 = 4;

fn encode_set(id: usize) -> NvmlEventSet {
    std::ptr::without_provenance_mut(id << SET_SHIFT)
}

fn decode_set(set: NvmlEventSet) -> Option<usize> {
    let raw = set as usize;
    (raw != 0 && raw & ((1 << SET_SHIFT) - 1) == 0).then_some(raw >> SET_SHIFT)
}

/// Finds a visible GPU by predicate for the `nvmlDeviceGetHandleBy*` family.
///
/// # Safety
/// `device` must be NULL or valid for writing one handle.
unsafe fn handle_by(
    name: &str,
    device: *mut NvmlDevice,
    matches: impl Fn(&GpuSpec) -> bool,
) -> NvmlReturn {
    if device.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let r = state::with_global(|g| {
        let idx = (0..g.hw.visible)
            .find(|&i| matches(&g.hw.gpus[i as usize].spec))
            .ok_or(ERROR_NOT_FOUND)?;
        g.check_gpu(name, idx as usize)?;
        Ok(state::device_handle(idx))
    });
    match r {
        // SAFETY: `device` is non-null and valid per this function's contract.
        Ok(h) => unsafe { put(device, h) },
        Err(e) => e,
    }
}

// ------------------------------------------------------- tier 0: lifecycle

/// `nvmlInit_v2`: reads `FAKE_NVML_CONFIG` and `FAKE_NVML_INJECT_DIR` (see README.md).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    state::called("nvmlInit_v2");
    state::init()
}

/// Legacy `nvmlInit` (same as `nvmlInit_v2`).
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit() -> NvmlReturn {
    state::called("nvmlInit");
    state::init()
}

/// `nvmlInitWithFlags`: flags (NO_GPUS, NO_ATTACH) are accepted and ignored.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> NvmlReturn {
    state::called("nvmlInitWithFlags");
    state::init()
}

/// `nvmlShutdown`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    state::called("nvmlShutdown");
    state::shutdown()
}

/// `nvmlErrorString`: static strings.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: NvmlReturn) -> *const c_char {
    state::called("nvmlErrorString");
    types::error_string(result).as_ptr()
}

// ---------------------------------------------------------- tier 1: system

/// `nvmlSystemGetDriverVersion`.
///
/// # Safety
/// `version` must be NULL or valid for writing `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetDriverVersion(
    version: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    state::called("nvmlSystemGetDriverVersion");
    // SAFETY: forwarded contract.
    unsafe {
        sys_str("nvmlSystemGetDriverVersion", version, length, |g| {
            g.hw.driver_version.clone()
        })
    }
}

/// `nvmlSystemGetNVMLVersion`.
///
/// # Safety
/// `version` must be NULL or valid for writing `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetNVMLVersion(
    version: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    state::called("nvmlSystemGetNVMLVersion");
    // SAFETY: forwarded contract.
    unsafe {
        sys_str("nvmlSystemGetNVMLVersion", version, length, |g| {
            g.hw.nvml_version()
        })
    }
}

/// `nvmlSystemGetCudaDriverVersion_v2`.
///
/// # Safety
/// `cuda_driver_version` must be NULL or valid for writing one `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion_v2(
    cuda_driver_version: *mut c_int,
) -> NvmlReturn {
    state::called("nvmlSystemGetCudaDriverVersion_v2");
    if cuda_driver_version.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    match state::system_call("nvmlSystemGetCudaDriverVersion_v2", |g| {
        Ok(g.hw.cuda_version())
    }) {
        // SAFETY: non-null and valid by contract.
        Ok(v) => unsafe { put(cuda_driver_version, v) },
        Err(e) => e,
    }
}

/// `nvmlSystemGetCudaDriverVersion`.
///
/// # Safety
/// `cuda_driver_version` must be NULL or valid for writing one `int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetCudaDriverVersion(
    cuda_driver_version: *mut c_int,
) -> NvmlReturn {
    state::called("nvmlSystemGetCudaDriverVersion");
    // SAFETY: forwarded contract.
    unsafe { nvmlSystemGetCudaDriverVersion_v2(cuda_driver_version) }
}

/// `nvmlSystemGetProcessName`: the first word of `/proc/PID/cmdline` (else
/// `comm`), cropped to `length`; NOT_FOUND for a PID that does not exist.
///
/// # Safety
/// `name` must be NULL or valid for writing `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlSystemGetProcessName(
    pid: c_uint,
    name: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    state::called("nvmlSystemGetProcessName");
    if name.is_null() || length == 0 {
        return ERROR_INVALID_ARGUMENT;
    }
    let r = state::system_call("nvmlSystemGetProcessName", |_| {
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok();
        let first = cmdline
            .as_deref()
            .and_then(|c| c.split(|&b| b == 0).next())
            .filter(|w| !w.is_empty())
            .map(|w| String::from_utf8_lossy(w).into_owned());
        match first {
            Some(n) => Ok(n),
            None => std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim_end().to_string())
                .map_err(|_| ERROR_NOT_FOUND),
        }
    });
    match r {
        Ok(mut n) => {
            let max = length as usize - 1;
            if n.len() > max {
                let mut cut = max;
                while !n.is_char_boundary(cut) {
                    cut -= 1;
                }
                n.truncate(cut);
            }
            // SAFETY: forwarded contract; `n` now fits in `length`.
            unsafe { put_str(name, length, &n) }
        }
        Err(e) => e,
    }
}

// ------------------------------------------------------ tier 1: enumeration

/// `nvmlDeviceGetCount_v2`: the configured GPUs, or what a `count` injection set. Counted in
/// `FAKE_NVML_POLLS` when set, whatever it returns.
///
/// # Safety
/// `device_count` must be NULL or valid for writing one `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(device_count: *mut c_uint) -> NvmlReturn {
    state::called("nvmlDeviceGetCount_v2");
    state::count_poll();
    if device_count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    match state::system_call("nvmlDeviceGetCount_v2", |g| Ok(g.hw.visible)) {
        // SAFETY: non-null and valid by contract.
        Ok(n) => unsafe { put(device_count, n) },
        Err(e) => e,
    }
}

/// Legacy `nvmlDeviceGetCount`.
///
/// # Safety
/// `device_count` must be NULL or valid for writing one `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount(device_count: *mut c_uint) -> NvmlReturn {
    state::called("nvmlDeviceGetCount");
    // SAFETY: forwarded contract.
    unsafe { nvmlDeviceGetCount_v2(device_count) }
}

/// `nvmlDeviceGetHandleByIndex_v2`.
///
/// # Safety
/// `device` must be NULL or valid for writing one handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    state::called("nvmlDeviceGetHandleByIndex_v2");
    if device.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let r = state::with_global(|g| {
        if index >= g.hw.visible {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        g.check_gpu("nvmlDeviceGetHandleByIndex_v2", index as usize)?;
        Ok(state::device_handle(index))
    });
    match r {
        // SAFETY: non-null and valid by contract.
        Ok(h) => unsafe { put(device, h) },
        Err(e) => e,
    }
}

/// Legacy `nvmlDeviceGetHandleByIndex`.
///
/// # Safety
/// `device` must be NULL or valid for writing one handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex(
    index: c_uint,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    state::called("nvmlDeviceGetHandleByIndex");
    // SAFETY: forwarded contract.
    unsafe { nvmlDeviceGetHandleByIndex_v2(index, device) }
}

/// `nvmlDeviceGetHandleByUUID`.
///
/// # Safety
/// `uuid` must be NULL or NUL-terminated; `device` NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const c_char,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    state::called("nvmlDeviceGetHandleByUUID");
    // SAFETY: `uuid` is NULL or NUL-terminated by contract.
    let Some(want) = (unsafe { get_str(uuid) }) else {
        return ERROR_INVALID_ARGUMENT;
    };
    // SAFETY: forwarded contract for `device`.
    unsafe {
        handle_by("nvmlDeviceGetHandleByUUID", device, |spec| {
            spec.uuid == want
        })
    }
}

/// `nvmlDeviceGetHandleByPciBusId_v2`: accepts `busId` or `busIdLegacy` forms.
///
/// # Safety
/// `pci_bus_id` must be NULL or NUL-terminated; `device` NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId_v2(
    pci_bus_id: *const c_char,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    state::called("nvmlDeviceGetHandleByPciBusId_v2");
    // SAFETY: `pci_bus_id` is NULL or NUL-terminated by contract.
    let Some(text) = (unsafe { get_str(pci_bus_id) }) else {
        return ERROR_INVALID_ARGUMENT;
    };
    let Some(want) = identity::parse_pci_bus_id(text) else {
        return ERROR_INVALID_ARGUMENT;
    };
    // SAFETY: forwarded contract for `device`.
    unsafe {
        handle_by("nvmlDeviceGetHandleByPciBusId_v2", device, |spec| {
            spec.pci == want
        })
    }
}

/// Legacy `nvmlDeviceGetHandleByPciBusId`.
///
/// # Safety
/// As `nvmlDeviceGetHandleByPciBusId_v2`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByPciBusId(
    pci_bus_id: *const c_char,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    state::called("nvmlDeviceGetHandleByPciBusId");
    // SAFETY: forwarded contract.
    unsafe { nvmlDeviceGetHandleByPciBusId_v2(pci_bus_id, device) }
}

/// `nvmlDeviceGetHandleBySerial`.
///
/// # Safety
/// `serial` must be NULL or NUL-terminated; `device` NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleBySerial(
    serial: *const c_char,
    device: *mut NvmlDevice,
) -> NvmlReturn {
    state::called("nvmlDeviceGetHandleBySerial");
    // SAFETY: `serial` is NULL or NUL-terminated by contract.
    let Some(want) = (unsafe { get_str(serial) }) else {
        return ERROR_INVALID_ARGUMENT;
    };
    // SAFETY: forwarded contract for `device`.
    unsafe {
        handle_by("nvmlDeviceGetHandleBySerial", device, |spec| {
            spec.serial == want
        })
    }
}

// ---------------------------------------------------------- tier 1: identity

/// `nvmlDeviceGetIndex`.
///
/// # Safety
/// `index` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(device: NvmlDevice, index: *mut c_uint) -> NvmlReturn {
    state::called("nvmlDeviceGetIndex");
    // SAFETY: forwarded contract.
    unsafe { dev_get("nvmlDeviceGetIndex", device, index, |_, i| Ok(i as c_uint)) }
}

/// `nvmlDeviceGetMinorNumber` (= index).
///
/// # Safety
/// `minor_number` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: NvmlDevice,
    minor_number: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetMinorNumber");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetMinorNumber", device, minor_number, |_, i| {
            Ok(i as c_uint)
        })
    }
}

/// `nvmlDeviceGetUUID`.
///
/// # Safety
/// `uuid` must be NULL or valid for writing `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    device: NvmlDevice,
    uuid: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetUUID");
    // SAFETY: forwarded contract.
    unsafe {
        dev_str("nvmlDeviceGetUUID", device, uuid, length, |g, i| {
            g.hw.gpus[i].spec.uuid.clone()
        })
    }
}

/// `nvmlDeviceGetSerial`.
///
/// # Safety
/// `serial` must be NULL or valid for writing `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSerial(
    device: NvmlDevice,
    serial: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetSerial");
    // SAFETY: forwarded contract.
    unsafe {
        dev_str("nvmlDeviceGetSerial", device, serial, length, |g, i| {
            g.hw.gpus[i].spec.serial.clone()
        })
    }
}

/// `nvmlDeviceGetName`.
///
/// # Safety
/// `name` must be NULL or valid for writing `length` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetName(
    device: NvmlDevice,
    name: *mut c_char,
    length: c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetName");
    // SAFETY: forwarded contract.
    unsafe {
        dev_str("nvmlDeviceGetName", device, name, length, |g, i| {
            g.hw.gpus[i].spec.name.clone()
        })
    }
}

/// `nvmlDeviceGetPciInfo_v3`.
///
/// # Safety
/// `pci` must be NULL or valid for writing one `nvmlPciInfo_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v3(
    device: NvmlDevice,
    pci: *mut PciInfo,
) -> NvmlReturn {
    state::called("nvmlDeviceGetPciInfo_v3");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetPciInfo_v3", device, pci, |g, i| {
            Ok(pci_info(&g.hw.gpus[i].spec))
        })
    }
}

/// `nvmlDeviceGetPciInfo_v2` (same layout).
///
/// # Safety
/// As `nvmlDeviceGetPciInfo_v3`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPciInfo_v2(
    device: NvmlDevice,
    pci: *mut PciInfo,
) -> NvmlReturn {
    state::called("nvmlDeviceGetPciInfo_v2");
    // SAFETY: forwarded contract.
    unsafe { nvmlDeviceGetPciInfo_v3(device, pci) }
}

/// `nvmlDeviceGetArchitecture`.
///
/// # Safety
/// `arch` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetArchitecture(
    device: NvmlDevice,
    arch: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetArchitecture");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetArchitecture", device, arch, |g, i| {
            Ok(g.hw.gpus[i].spec.arch.nvml_arch())
        })
    }
}

/// `nvmlDeviceGetBrand`.
///
/// # Safety
/// `brand` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetBrand(device: NvmlDevice, brand: *mut c_uint) -> NvmlReturn {
    state::called("nvmlDeviceGetBrand");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetBrand", device, brand, |g, i| {
            Ok(g.hw.gpus[i].spec.arch.brand())
        })
    }
}

/// `nvmlDeviceGetComputeMode`.
///
/// # Safety
/// `mode` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeMode(
    device: NvmlDevice,
    mode: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetComputeMode");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetComputeMode", device, mode, |g, i| {
            Ok(g.hw.gpus[i].compute_mode)
        })
    }
}

/// `nvmlDeviceSetComputeMode`: 0..=3 accepted.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceSetComputeMode(device: NvmlDevice, mode: c_uint) -> NvmlReturn {
    state::called("nvmlDeviceSetComputeMode");
    status(state::device_call(
        "nvmlDeviceSetComputeMode",
        device,
        |g, i| {
            if mode > 3 {
                return Err(ERROR_INVALID_ARGUMENT);
            }
            g.hw.gpus[i].compute_mode = mode;
            Ok(())
        },
    ))
}

/// `nvmlDeviceGetPersistenceMode`: enabled unless injected off.
///
/// # Safety
/// `mode` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPersistenceMode(
    device: NvmlDevice,
    mode: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetPersistenceMode");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetPersistenceMode", device, mode, |g, i| {
            Ok(if g.hw.gpus[i].persistence {
                FEATURE_ENABLED
            } else {
                FEATURE_DISABLED
            })
        })
    }
}

/// `nvmlDeviceGetMigMode`: the GPU's (current, pending) mode (disabled/disabled on MIG-capable
/// GPUs unless a profile says otherwise), else NOT_SUPPORTED.
///
/// # Safety
/// `current` and `pending` must each be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMigMode(
    device: NvmlDevice,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetMigMode");
    if current.is_null() || pending.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let r = state::device_call("nvmlDeviceGetMigMode", device, |g, i| {
        g.hw.gpus[i].spec.mig.ok_or(ERROR_NOT_SUPPORTED)
    });
    let (now, next) = match r {
        Ok(m) => m,
        Err(e) => return e,
    };
    let mode = |on: bool| {
        if on {
            FEATURE_ENABLED
        } else {
            FEATURE_DISABLED
        }
    };
    // SAFETY: both non-null and valid by contract.
    unsafe {
        current.write(mode(now));
        pending.write(mode(next));
    }
    SUCCESS
}

/// (total, reserved, used) bytes: 512 MiB reserved (at most a quarter of
/// the memory), 4 MiB + each MPS client's and compute-only process's `used_mib` (1 GiB when
/// not given) used.
fn memory_numbers(g: &Global, i: usize) -> (u64, u64, u64) {
    let gpu = &g.hw.gpus[i];
    let total = gpu.spec.memory_mib.saturating_mul(1 << 20);
    let reserved = (512u64 << 20).min(total / 4);
    let clients = gpu
        .procs
        .iter()
        .chain(&gpu.compute_only)
        .fold(0u64, |sum, (_, mib)| {
            sum.saturating_add(mib.map_or(1 << 30, |m| m.saturating_mul(1 << 20)))
        });
    let used = (4u64 << 20).saturating_add(clients);
    (total, reserved, used.min(total - reserved))
}

/// `nvmlDeviceGetMemoryInfo_v2`: checks the struct version.
///
/// # Safety
/// `memory` must be NULL or valid for reading and writing one `nvmlMemory_v2_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: NvmlDevice,
    memory: *mut MemoryV2,
) -> NvmlReturn {
    state::called("nvmlDeviceGetMemoryInfo_v2");
    if memory.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null and valid for reads by contract.
    let version = unsafe { (*memory).version };
    if version != MEMORY_V2_VERSION {
        return ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetMemoryInfo_v2", device, memory, |g, i| {
            let (total, reserved, used) = memory_numbers(g, i);
            Ok(MemoryV2 {
                version,
                total,
                reserved,
                free: total - reserved - used,
                used,
            })
        })
    }
}

/// Legacy `nvmlDeviceGetMemoryInfo`.
///
/// # Safety
/// `memory` must be NULL or valid for writing one `nvmlMemory_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: NvmlDevice,
    memory: *mut Memory,
) -> NvmlReturn {
    state::called("nvmlDeviceGetMemoryInfo");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetMemoryInfo", device, memory, |g, i| {
            let (total, reserved, used) = memory_numbers(g, i);
            Ok(Memory {
                total,
                free: total - reserved - used,
                used: used + reserved,
            })
        })
    }
}

// ------------------------------------------------------------ tier 2: events

/// `nvmlEventSetCreate`.
///
/// # Safety
/// `set` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetCreate(set: *mut NvmlEventSet) -> NvmlReturn {
    state::called("nvmlEventSetCreate");
    if set.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    match state::system_call("nvmlEventSetCreate", |g| Ok(g.create_set())) {
        // SAFETY: non-null and valid by contract.
        Ok(id) => unsafe { put(set, encode_set(id)) },
        Err(e) => e,
    }
}

/// `nvmlEventSetFree`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlEventSetFree(set: NvmlEventSet) -> NvmlReturn {
    state::called("nvmlEventSetFree");
    let Some(id) = decode_set(set) else {
        return ERROR_INVALID_ARGUMENT;
    };
    status(state::system_call("nvmlEventSetFree", |g| g.free_set(id)))
}

/// `nvmlDeviceRegisterEvents`: NOT_SUPPORTED (nothing registered) if any
/// requested type is unsupported; GPU_IS_LOST on a lost GPU.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceRegisterEvents(
    device: NvmlDevice,
    event_types: c_ulonglong,
    set: NvmlEventSet,
) -> NvmlReturn {
    state::called("nvmlDeviceRegisterEvents");
    let Some(id) = decode_set(set) else {
        return ERROR_INVALID_ARGUMENT;
    };
    status(state::device_call(
        "nvmlDeviceRegisterEvents",
        device,
        |g, i| g.register(id, i, event_types),
    ))
}

/// `nvmlDeviceGetSupportedEventTypes`.
///
/// # Safety
/// `event_types` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedEventTypes(
    device: NvmlDevice,
    event_types: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetSupportedEventTypes");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetSupportedEventTypes",
            device,
            event_types,
            |g, i| Ok(g.hw.supported_events(i)),
        )
    }
}

/// `nvmlEventSetWait_v2`: SUCCESS + data, TIMEOUT, GPU_IS_LOST or UNKNOWN.
///
/// # Safety
/// `data` must be NULL or valid for writing one `nvmlEventData_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlEventSetWait_v2(
    set: NvmlEventSet,
    data: *mut EventData,
    timeoutms: c_uint,
) -> NvmlReturn {
    state::called("nvmlEventSetWait_v2");
    if data.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let Some(id) = decode_set(set) else {
        return ERROR_INVALID_ARGUMENT;
    };
    match state::wait_event(id, timeoutms) {
        Ok(ev) => {
            let out = EventData {
                device: state::device_handle(ev.gpu),
                event_type: ev.event_type,
                event_data: ev.data,
                gpu_instance_id: NO_MIG_INSTANCE,
                compute_instance_id: NO_MIG_INSTANCE,
            };
            // SAFETY: non-null and valid by contract.
            unsafe { put(data, out) }
        }
        Err(e) => e,
    }
}

// ------------------------------------------------------ tier 3: ECC & memory

fn ecc_mode(spec: &GpuSpec) -> c_uint {
    if spec.ecc {
        FEATURE_ENABLED
    } else {
        FEATURE_DISABLED
    }
}

/// ECC counter `[error_type][counter_type]` of GPU `i`; NOT_SUPPORTED with
/// ECC disabled.
fn ecc_counter(
    g: &Global,
    i: usize,
    error_type: c_uint,
    counter_type: c_uint,
) -> Result<u64, NvmlReturn> {
    let gpu = &g.hw.gpus[i];
    if !gpu.spec.ecc {
        return Err(ERROR_NOT_SUPPORTED);
    }
    gpu.ecc
        .get(error_type as usize)
        .and_then(|row| row.get(counter_type as usize))
        .copied()
        .ok_or(ERROR_INVALID_ARGUMENT)
}

/// `nvmlDeviceGetEccMode`: enabled/enabled, or disabled/disabled for a GPU
/// configured with `"ecc": false`.
///
/// # Safety
/// `current` and `pending` must each be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEccMode(
    device: NvmlDevice,
    current: *mut c_uint,
    pending: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetEccMode");
    if current.is_null() || pending.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let mode = match state::device_call("nvmlDeviceGetEccMode", device, |g, i| {
        Ok(ecc_mode(&g.hw.gpus[i].spec))
    }) {
        Ok(m) => m,
        Err(e) => return e,
    };
    // SAFETY: both non-null and valid by contract.
    unsafe {
        current.write(mode);
        pending.write(mode);
    }
    SUCCESS
}

/// `nvmlDeviceGetTotalEccErrors(errorType 0|1, counterType 0|1)`.
///
/// # Safety
/// `ecc_counts` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTotalEccErrors(
    device: NvmlDevice,
    error_type: c_uint,
    counter_type: c_uint,
    ecc_counts: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetTotalEccErrors");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetTotalEccErrors", device, ecc_counts, |g, i| {
            ecc_counter(g, i, error_type, counter_type)
        })
    }
}

/// `nvmlDeviceGetMemoryErrorCounter`: DRAM (2) mirrors the totals; other
/// locations (0..=7) read 0.
///
/// # Safety
/// `count` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryErrorCounter(
    device: NvmlDevice,
    error_type: c_uint,
    counter_type: c_uint,
    location_type: c_uint,
    count: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetMemoryErrorCounter");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetMemoryErrorCounter", device, count, |g, i| {
            let total = ecc_counter(g, i, error_type, counter_type)?;
            match location_type {
                2 => Ok(total),
                0..=7 => Ok(0),
                _ => Err(ERROR_INVALID_ARGUMENT),
            }
        })
    }
}

/// `nvmlDeviceClearEccErrorCounts(counterType)`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlDeviceClearEccErrorCounts(
    device: NvmlDevice,
    counter_type: c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceClearEccErrorCounts");
    status(state::device_call(
        "nvmlDeviceClearEccErrorCounts",
        device,
        |g, i| {
            let c = counter_type as usize;
            if !g.hw.gpus[i].spec.ecc {
                return Err(ERROR_NOT_SUPPORTED);
            }
            if c > 1 {
                return Err(ERROR_INVALID_ARGUMENT);
            }
            for row in &mut g.hw.gpus[i].ecc {
                row[c] = 0;
            }
            Ok(())
        },
    ))
}

/// Shared body of `nvmlDeviceGetRetiredPages(_v2)`.
///
/// # Safety
/// `page_count` NULL or valid for read+write; `addresses` and `timestamps`
/// NULL or valid for `*page_count` writes.
unsafe fn retired_pages(
    name: &str,
    device: NvmlDevice,
    cause: c_uint,
    page_count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> NvmlReturn {
    if page_count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let pages = match state::device_call(name, device, |g, i| {
        if !g.hw.gpus[i].spec.page_retirement {
            return Err(ERROR_NOT_SUPPORTED);
        }
        if cause > 1 {
            return Err(ERROR_INVALID_ARGUMENT);
        }
        Ok(g.hw.gpus[i].retired_pages(i as u32, cause as usize))
    }) {
        Ok(p) => p,
        Err(e) => return e,
    };
    // SAFETY: non-null and valid for reads by contract.
    let capacity = unsafe { page_count.read() } as usize;
    let n = pages.len() as c_uint;
    if capacity < pages.len() {
        // SAFETY: non-null and valid for writes by contract.
        unsafe { page_count.write(n) };
        return ERROR_INSUFFICIENT_SIZE;
    }
    if !pages.is_empty() && addresses.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    for (k, (addr, ts)) in pages.into_iter().enumerate() {
        // SAFETY: k < n <= *page_count, the number of elements the caller's
        // arrays hold; `timestamps` is only used when non-null.
        unsafe {
            addresses.add(k).write(addr);
            if !timestamps.is_null() {
                timestamps.add(k).write(ts);
            }
        }
    }
    // SAFETY: non-null and valid for writes by contract.
    unsafe { page_count.write(n) };
    SUCCESS
}

/// `nvmlDeviceGetRetiredPages` (pre-Ampere; NOT_SUPPORTED on Ampere+).
///
/// # Safety
/// `page_count` NULL or valid for read+write; `addresses` NULL or valid for
/// `*page_count` writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages(
    device: NvmlDevice,
    cause: c_uint,
    page_count: *mut c_uint,
    addresses: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetRetiredPages");
    // SAFETY: forwarded contract.
    unsafe {
        retired_pages(
            "nvmlDeviceGetRetiredPages",
            device,
            cause,
            page_count,
            addresses,
            std::ptr::null_mut(),
        )
    }
}

/// `nvmlDeviceGetRetiredPages_v2` (adds timestamps).
///
/// # Safety
/// As `nvmlDeviceGetRetiredPages`; `timestamps` likewise.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPages_v2(
    device: NvmlDevice,
    cause: c_uint,
    page_count: *mut c_uint,
    addresses: *mut c_ulonglong,
    timestamps: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetRetiredPages_v2");
    // SAFETY: forwarded contract.
    unsafe {
        retired_pages(
            "nvmlDeviceGetRetiredPages_v2",
            device,
            cause,
            page_count,
            addresses,
            timestamps,
        )
    }
}

/// `nvmlDeviceGetRetiredPagesPendingStatus` (pre-Ampere).
///
/// # Safety
/// `is_pending` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRetiredPagesPendingStatus(
    device: NvmlDevice,
    is_pending: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetRetiredPagesPendingStatus");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetRetiredPagesPendingStatus",
            device,
            is_pending,
            |g, i| {
                if !g.hw.gpus[i].spec.page_retirement {
                    return Err(ERROR_NOT_SUPPORTED);
                }
                Ok(c_uint::from(g.hw.gpus[i].retired_pending))
            },
        )
    }
}

/// `nvmlDeviceGetRemappedRows` (Ampere+; NOT_SUPPORTED before).
///
/// # Safety
/// All four out-pointers must each be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRemappedRows(
    device: NvmlDevice,
    corr_rows: *mut c_uint,
    unc_rows: *mut c_uint,
    is_pending: *mut c_uint,
    failure_occurred: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetRemappedRows");
    if corr_rows.is_null()
        || unc_rows.is_null()
        || is_pending.is_null()
        || failure_occurred.is_null()
    {
        return ERROR_INVALID_ARGUMENT;
    }
    let r = state::device_call("nvmlDeviceGetRemappedRows", device, |g, i| {
        let gpu = &g.hw.gpus[i];
        if !gpu.spec.row_remapping {
            return Err(ERROR_NOT_SUPPORTED);
        }
        Ok((
            gpu.remap_corr,
            gpu.remap_unc,
            c_uint::from(gpu.remap_pending),
            c_uint::from(gpu.remap_failure),
        ))
    });
    match r {
        Ok((c, u, p, f)) => {
            // SAFETY: all four non-null and valid by contract.
            unsafe {
                corr_rows.write(c);
                unc_rows.write(u);
                is_pending.write(p);
                failure_occurred.write(f);
            }
            SUCCESS
        }
        Err(e) => e,
    }
}

/// `nvmlDeviceGetRowRemapperHistogram` (Ampere+).
///
/// # Safety
/// `values` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetRowRemapperHistogram(
    device: NvmlDevice,
    values: *mut RowRemapperHistogram,
) -> NvmlReturn {
    state::called("nvmlDeviceGetRowRemapperHistogram");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetRowRemapperHistogram",
            device,
            values,
            |g, i| {
                let gpu = &g.hw.gpus[i];
                if !gpu.spec.row_remapping {
                    return Err(ERROR_NOT_SUPPORTED);
                }
                Ok(gpu.histogram())
            },
        )
    }
}

// ----------------------------------------------------- tier 3: other health

/// Every clock-event reason bit NVML defines (0x1..=0x100).
const ALL_CLOCK_REASONS: c_ulonglong = 0x1FF;

/// `nvmlDeviceGetCurrentClocksThrottleReasons` (what nvml-wrapper calls).
///
/// # Safety
/// `reasons` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksThrottleReasons(
    device: NvmlDevice,
    reasons: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetCurrentClocksThrottleReasons");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            device,
            reasons,
            |g, i| Ok(g.hw.gpus[i].throttle),
        )
    }
}

/// `nvmlDeviceGetCurrentClocksEventReasons` (NVML 13 name; same bits).
///
/// # Safety
/// `reasons` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrentClocksEventReasons(
    device: NvmlDevice,
    reasons: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetCurrentClocksEventReasons");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetCurrentClocksEventReasons",
            device,
            reasons,
            |g, i| Ok(g.hw.gpus[i].throttle),
        )
    }
}

/// `nvmlDeviceGetSupportedClocksThrottleReasons`.
///
/// # Safety
/// `reasons` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedClocksThrottleReasons(
    device: NvmlDevice,
    reasons: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetSupportedClocksThrottleReasons");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetSupportedClocksThrottleReasons",
            device,
            reasons,
            |_, _| Ok(ALL_CLOCK_REASONS),
        )
    }
}

/// `nvmlDeviceGetSupportedClocksEventReasons`.
///
/// # Safety
/// `reasons` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetSupportedClocksEventReasons(
    device: NvmlDevice,
    reasons: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetSupportedClocksEventReasons");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetSupportedClocksEventReasons",
            device,
            reasons,
            |_, _| Ok(ALL_CLOCK_REASONS),
        )
    }
}

/// `nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU = 0)`.
///
/// # Safety
/// `temp` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperature(
    device: NvmlDevice,
    sensor_type: c_uint,
    temp: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetTemperature");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetTemperature", device, temp, |g, i| {
            if sensor_type != 0 {
                return Err(ERROR_INVALID_ARGUMENT);
            }
            Ok(g.hw.gpus[i].temp_c)
        })
    }
}

/// `nvmlDeviceGetTemperatureThreshold`: SHUTDOWN 92, SLOWDOWN 89, MEM_MAX 95, GPU_MAX 87.
///
/// # Safety
/// `temp` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetTemperatureThreshold(
    device: NvmlDevice,
    threshold_type: c_uint,
    temp: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetTemperatureThreshold");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetTemperatureThreshold",
            device,
            temp,
            |_, _| match threshold_type {
                0 => Ok(92),
                1 => Ok(89),
                2 => Ok(95),
                3 => Ok(87),
                _ => Err(ERROR_NOT_SUPPORTED),
            },
        )
    }
}

/// `nvmlDeviceGetPowerUsage` (mW).
///
/// # Safety
/// `power` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPowerUsage(
    device: NvmlDevice,
    power: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetPowerUsage");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetPowerUsage", device, power, |g, i| {
            Ok(g.hw.gpus[i].spec.arch.power_limit_mw() / 8)
        })
    }
}

/// `nvmlDeviceGetEnforcedPowerLimit` (mW).
///
/// # Safety
/// `limit` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetEnforcedPowerLimit(
    device: NvmlDevice,
    limit: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetEnforcedPowerLimit");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetEnforcedPowerLimit", device, limit, |g, i| {
            Ok(g.hw.gpus[i].spec.arch.power_limit_mw())
        })
    }
}

/// `nvmlDeviceGetPerformanceState`: P0.
///
/// # Safety
/// `p_state` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPerformanceState(
    device: NvmlDevice,
    p_state: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetPerformanceState");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetPerformanceState", device, p_state, |_, _| {
            Ok(0)
        })
    }
}

/// `nvmlDeviceGetUtilizationRates`: 0 % / 0 %.
///
/// # Safety
/// `utilization` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: NvmlDevice,
    utilization: *mut Utilization,
) -> NvmlReturn {
    state::called("nvmlDeviceGetUtilizationRates");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetUtilizationRates",
            device,
            utilization,
            |_, _| Ok(Utilization { gpu: 0, memory: 0 }),
        )
    }
}

/// `nvmlDeviceGetPcieReplayCounter`.
///
/// # Safety
/// `value` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetPcieReplayCounter(
    device: NvmlDevice,
    value: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetPcieReplayCounter");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetPcieReplayCounter", device, value, |g, i| {
            Ok(g.hw.gpus[i].pcie_replay)
        })
    }
}

/// `nvmlDeviceGetCurrPcieLinkGeneration`.
///
/// # Safety
/// `gen` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkGeneration(
    device: NvmlDevice,
    link_gen: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetCurrPcieLinkGeneration");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetCurrPcieLinkGeneration",
            device,
            link_gen,
            |g, i| Ok(g.hw.gpus[i].pcie_gen),
        )
    }
}

/// `nvmlDeviceGetCurrPcieLinkWidth`.
///
/// # Safety
/// `width` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCurrPcieLinkWidth(
    device: NvmlDevice,
    width: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetCurrPcieLinkWidth");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetCurrPcieLinkWidth", device, width, |g, i| {
            Ok(g.hw.gpus[i].pcie_width)
        })
    }
}

/// `nvmlDeviceGetMaxPcieLinkGeneration`.
///
/// # Safety
/// `link_gen` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkGeneration(
    device: NvmlDevice,
    link_gen: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetMaxPcieLinkGeneration");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetMaxPcieLinkGeneration",
            device,
            link_gen,
            |g, i| Ok(g.hw.gpus[i].spec.pcie_max.0),
        )
    }
}

/// `nvmlDeviceGetMaxPcieLinkWidth`: x16 unless a profile says otherwise.
///
/// # Safety
/// `width` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMaxPcieLinkWidth(
    device: NvmlDevice,
    width: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetMaxPcieLinkWidth");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetMaxPcieLinkWidth", device, width, |g, i| {
            Ok(g.hw.gpus[i].spec.pcie_max.1)
        })
    }
}

/// `nvmlDeviceGetGpuFabricInfo`: the registration on Hopper and Blackwell (completed by
/// default); NOT_SUPPORTED elsewhere.
///
/// # Safety
/// `info` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfo(
    device: NvmlDevice,
    info: *mut GpuFabricInfo,
) -> NvmlReturn {
    state::called("nvmlDeviceGetGpuFabricInfo");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetGpuFabricInfo", device, info, |g, i| {
            let f = g.hw.gpus[i].fabric;
            if f.state == fabric_state::NOT_SUPPORTED {
                return Err(ERROR_NOT_SUPPORTED);
            }
            Ok(GpuFabricInfo {
                cluster_uuid: f.cluster_uuid,
                status: f.status,
                clique_id: f.clique_id,
                state: f.state,
            })
        })
    }
}

/// `nvmlDeviceGetGpuFabricInfoV`: versions 2 and 3 (checks the version word).
///
/// # Safety
/// `info` must be NULL or valid for reading and writing one struct of the version it names.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetGpuFabricInfoV(
    device: NvmlDevice,
    info: *mut GpuFabricInfoV3,
) -> NvmlReturn {
    state::called("nvmlDeviceGetGpuFabricInfoV");
    if info.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null and valid for reads by contract (the version word comes first).
    let version = unsafe { (*info).version };
    if version != FABRIC_INFO_V3_VERSION && version != FABRIC_INFO_V2_VERSION {
        return ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    let got = state::device_call("nvmlDeviceGetGpuFabricInfoV", device, |g, i| {
        let f = g.hw.gpus[i].fabric;
        if f.state == fabric_state::NOT_SUPPORTED {
            return Err(ERROR_NOT_SUPPORTED);
        }
        Ok(f)
    });
    match got {
        Ok(f) => {
            // SAFETY: valid for writes of the named version; v2 ends before `health_summary`.
            unsafe {
                (*info).cluster_uuid = f.cluster_uuid;
                (*info).status = f.status;
                (*info).clique_id = f.clique_id;
                (*info).state = f.state;
                (*info).health_mask = 0;
                if version == FABRIC_INFO_V3_VERSION {
                    (*info).health_summary = 0;
                }
            }
            SUCCESS
        }
        Err(e) => e,
    }
}

fn check_link(g: &Global, i: usize, link: c_uint) -> Result<(), NvmlReturn> {
    match g.hw.gpus[i].spec.nvlinks {
        0 => Err(ERROR_NOT_SUPPORTED),
        n if link >= n => Err(ERROR_INVALID_ARGUMENT),
        _ => Ok(()),
    }
}

/// `nvmlDeviceGetNvLinkState`: active unless injected down; NOT_SUPPORTED without
/// NVLink, INVALID_ARGUMENT past the last link.
///
/// # Safety
/// `is_active` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkState(
    device: NvmlDevice,
    link: c_uint,
    is_active: *mut c_uint,
) -> NvmlReturn {
    state::called("nvmlDeviceGetNvLinkState");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get("nvmlDeviceGetNvLinkState", device, is_active, |g, i| {
            check_link(g, i, link)?;
            Ok(if g.hw.gpus[i].nvlinks[link as usize].down {
                FEATURE_DISABLED
            } else {
                FEATURE_ENABLED
            })
        })
    }
}

/// `nvmlDeviceGetNvLinkErrorCounter`: counters 0..=4 as injected (0 by default).
///
/// # Safety
/// `counter_value` must be NULL or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetNvLinkErrorCounter(
    device: NvmlDevice,
    link: c_uint,
    counter: c_uint,
    counter_value: *mut c_ulonglong,
) -> NvmlReturn {
    state::called("nvmlDeviceGetNvLinkErrorCounter");
    // SAFETY: forwarded contract.
    unsafe {
        dev_get(
            "nvmlDeviceGetNvLinkErrorCounter",
            device,
            counter_value,
            |g, i| {
                check_link(g, i, link)?;
                if counter > 4 {
                    return Err(ERROR_INVALID_ARGUMENT);
                }
                Ok(g.hw.gpus[i].nvlinks[link as usize].counters[counter as usize])
            },
        )
    }
}

/// Shared body of the `*ComputeRunningProcesses_v3` pair.
///
/// # Safety
/// `info_count` NULL or valid for read+write; `infos` NULL or valid for
/// `*info_count` writes.
unsafe fn processes(
    name: &str,
    device: NvmlDevice,
    info_count: *mut c_uint,
    infos: *mut ProcessInfo,
    unknown_memory: u64,
    with_compute_only: bool,
) -> NvmlReturn {
    if info_count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let pids = match state::device_call(name, device, |g, i| {
        let gpu = &g.hw.gpus[i];
        let mut p = gpu.procs.clone();
        if with_compute_only {
            p.extend(gpu.compute_only.iter().copied());
        }
        Ok(p)
    }) {
        Ok(p) => p,
        Err(e) => return e,
    };
    let capacity = if infos.is_null() {
        0
    } else {
        // SAFETY: non-null and valid for reads by contract.
        unsafe { info_count.read() as usize }
    };
    let n = pids.len() as c_uint;
    if pids.len() > capacity {
        // SAFETY: non-null and valid for writes by contract.
        unsafe { info_count.write(n) };
        return ERROR_INSUFFICIENT_SIZE;
    }
    for (k, (pid, mib)) in pids.into_iter().enumerate() {
        let info = ProcessInfo {
            pid,
            used_gpu_memory: mib.map_or(unknown_memory, |m| m.saturating_mul(1 << 20)),
            gpu_instance_id: NO_MIG_INSTANCE,
            compute_instance_id: NO_MIG_INSTANCE,
        };
        // SAFETY: k < n <= capacity = *info_count, the caller's array length
        // (infos is non-null whenever n > 0, since then capacity > 0).
        unsafe { infos.add(k).write(info) };
    }
    // SAFETY: non-null and valid for writes by contract.
    unsafe { info_count.write(n) };
    SUCCESS
}

/// `nvmlDeviceGetComputeRunningProcesses_v3`: the `mps_clients` PIDs, then the
/// `compute_processes` PIDs, with their `used_mib`, 1 GiB each where not given.
///
/// # Safety
/// `info_count` NULL or valid for read+write; `infos` NULL or valid for
/// `*info_count` writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: NvmlDevice,
    info_count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    state::called("nvmlDeviceGetComputeRunningProcesses_v3");
    // SAFETY: forwarded contract.
    unsafe {
        processes(
            "nvmlDeviceGetComputeRunningProcesses_v3",
            device,
            info_count,
            infos,
            1 << 30,
            true,
        )
    }
}

/// `nvmlDeviceGetMPSComputeRunningProcesses_v3`: the `mps_clients` PIDs,
/// usedGpuMemory = their `used_mib` in bytes, NVML_VALUE_NOT_AVAILABLE where not given.
///
/// # Safety
/// `info_count` NULL or valid for read+write; `infos` NULL or valid for
/// `*info_count` writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMPSComputeRunningProcesses_v3(
    device: NvmlDevice,
    info_count: *mut c_uint,
    infos: *mut ProcessInfo,
) -> NvmlReturn {
    state::called("nvmlDeviceGetMPSComputeRunningProcesses_v3");
    // SAFETY: forwarded contract.
    unsafe {
        processes(
            "nvmlDeviceGetMPSComputeRunningProcesses_v3",
            device,
            info_count,
            infos,
            VALUE_NOT_AVAILABLE_U64,
            false,
        )
    }
}

/// One field for `nvmlDeviceGetFieldValues`: (valueType, value) or a per-entry error.
fn field_value(g: &Global, i: usize, field_id: u32) -> Result<(u32, Value), NvmlReturn> {
    let gpu = &g.hw.gpus[i];
    let spec = &gpu.spec;
    let ull = |v: u64| Ok((value_type::ULL, Value { ull_val: v }));
    let uint = |v: u32| Ok((value_type::UINT, Value { ui_val: v }));
    let ecc = |v: u64| {
        if gpu.spec.ecc {
            ull(v)
        } else {
            Err(ERROR_NOT_SUPPORTED)
        }
    };
    let retire = |v: u64| {
        if spec.page_retirement {
            ull(v)
        } else {
            Err(ERROR_NOT_SUPPORTED)
        }
    };
    let remap = |v: u32| {
        if spec.row_remapping {
            uint(v)
        } else {
            Err(ERROR_NOT_SUPPORTED)
        }
    };
    match field_id {
        field::ECC_CURRENT | field::ECC_PENDING => uint(ecc_mode(&gpu.spec)),
        field::ECC_SBE_VOL_TOTAL => ecc(gpu.ecc[0][0]),
        field::ECC_DBE_VOL_TOTAL => ecc(gpu.ecc[1][0]),
        field::ECC_SBE_AGG_TOTAL => ecc(gpu.ecc[0][1]),
        field::ECC_DBE_AGG_TOTAL => ecc(gpu.ecc[1][1]),
        field::RETIRED_SBE => retire(u64::from(gpu.retired[0])),
        field::RETIRED_DBE => retire(u64::from(gpu.retired[1])),
        field::RETIRED_PENDING => retire(u64::from(gpu.retired_pending)),
        field::RETIRED_PENDING_SBE => retire(u64::from(gpu.retired_pending && gpu.retired[0] > 0)),
        field::RETIRED_PENDING_DBE => retire(u64::from(gpu.retired_pending && gpu.retired[1] > 0)),
        field::PCIE_REPLAY_COUNTER => ull(u64::from(gpu.pcie_replay)),
        field::PCIE_REPLAY_ROLLOVER_COUNTER => ull(0),
        field::REMAPPED_COR => remap(gpu.remap_corr),
        field::REMAPPED_UNC => remap(gpu.remap_unc),
        field::REMAPPED_PENDING => remap(u32::from(gpu.remap_pending)),
        field::REMAPPED_FAILURE => remap(u32::from(gpu.remap_failure)),
        field::GET_GPU_RECOVERY_ACTION if g.hw.has_recovery_action() => uint(gpu.recovery_action),
        _ => Err(ERROR_NOT_SUPPORTED),
    }
}

/// `nvmlDeviceGetFieldValues`: fills valueType/value/timestamp and a
/// per-entry nvmlReturn (NOT_SUPPORTED for unknown ids).
///
/// # Safety
/// `values` must be NULL or valid for reading and writing `values_count` entries.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetFieldValues(
    device: NvmlDevice,
    values_count: c_int,
    values: *mut FieldValue,
) -> NvmlReturn {
    state::called("nvmlDeviceGetFieldValues");
    let Ok(count) = usize::try_from(values_count) else {
        return ERROR_INVALID_ARGUMENT;
    };
    if count > 0 && values.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    status(state::device_call(
        "nvmlDeviceGetFieldValues",
        device,
        |g, i| {
            let now = state::now_micros();
            for k in 0..count {
                // SAFETY: k < values_count, the caller's array length; the
                // caller keeps no other reference to the array during the call.
                let entry = unsafe { &mut *values.add(k) };
                entry.timestamp = now;
                entry.latency_usec = 0;
                match field_value(g, i, entry.field_id) {
                    Ok((value_type, value)) => {
                        entry.value_type = value_type;
                        entry.value = value;
                        entry.nvml_return = SUCCESS;
                    }
                    Err(e) => entry.nvml_return = e,
                }
            }
            Ok(())
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_handles_round_trip() {
        for id in [1usize, 2, 77, 1 << 20] {
            assert_eq!(decode_set(encode_set(id)), Some(id));
        }
        assert_eq!(decode_set(std::ptr::null_mut()), None);
        assert_eq!(decode_set(std::ptr::without_provenance_mut(3)), None);
    }

    #[test]
    fn put_str_respects_length() {
        let mut buf = [1 as c_char; 8];
        // SAFETY: `buf` is 8 writable bytes.
        unsafe {
            assert_eq!(put_str(buf.as_mut_ptr(), 8, "1234567"), SUCCESS);
            assert_eq!(buf[7], 0);
            assert_eq!(
                put_str(buf.as_mut_ptr(), 8, "12345678"),
                ERROR_INSUFFICIENT_SIZE
            );
        }
    }

    /// Every exported function notes its call first (`FAKE_NVML_CALLS`), under its own name.
    #[test]
    fn every_exported_function_notes_its_call() {
        let src = include_str!("ffi.rs");
        let mut n = 0;
        for part in src.split("#[unsafe(no_mangle)]\n").skip(1) {
            let name = part
                .split_once("fn ")
                .and_then(|(_, rest)| rest.split_once('('))
                .map(|(name, _)| name)
                .unwrap_or_default();
            let body = part.split_once(" {\n").map(|(_, b)| b).unwrap_or_default();
            assert!(
                body.trim_start()
                    .starts_with(&format!("state::called(\"{name}\");")),
                "{name} does not begin with state::called(\"{name}\")"
            );
            n += 1;
        }
        assert!(n > 60, "{n} exported functions found");
    }

    #[test]
    fn cbuf_truncates_and_terminates() {
        let b: [c_char; 4] = cbuf("abcdef");
        assert_eq!(b, [b'a' as c_char, b'b' as c_char, b'c' as c_char, 0]);
    }
}
