//! C ABI types and constants, laid out as in `nvml.h` (NVML_API_VERSION 13,
//! x86-64 / aarch64 natural alignment). The integration tests compare every
//! struct's size with the `nvml-wrapper-sys` 0.10 bindings.

use std::ffi::{c_char, c_int, c_longlong, c_uint, c_ulong, c_ulonglong, c_ushort, c_void};

/// `nvmlReturn_t`.
pub type NvmlReturn = c_uint;
/// `nvmlDevice_t`: opaque; the fake hands out stable pointers into a static table.
pub type NvmlDevice = *mut c_void;
/// `nvmlEventSet_t`: opaque; the fake encodes a set id, never dereferenced.
pub type NvmlEventSet = *mut c_void;

pub const SUCCESS: NvmlReturn = 0;
pub const ERROR_UNINITIALIZED: NvmlReturn = 1;
pub const ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
pub const ERROR_NOT_SUPPORTED: NvmlReturn = 3;
pub const ERROR_NO_PERMISSION: NvmlReturn = 4;
pub const ERROR_NOT_FOUND: NvmlReturn = 6;
pub const ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
pub const ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
pub const ERROR_TIMEOUT: NvmlReturn = 10;
pub const ERROR_GPU_IS_LOST: NvmlReturn = 15;
pub const ERROR_RESET_REQUIRED: NvmlReturn = 16;
pub const ERROR_ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;
pub const ERROR_UNKNOWN: NvmlReturn = 999;

/// Event type bits (`nvmlEventType*`).
pub mod event_type {
    pub const SINGLE_BIT_ECC_ERROR: u64 = 0x1;
    pub const DOUBLE_BIT_ECC_ERROR: u64 = 0x2;
    pub const PSTATE: u64 = 0x4;
    pub const XID_CRITICAL_ERROR: u64 = 0x8;
    pub const CLOCK: u64 = 0x10;
    pub const MIG_CONFIG_CHANGE: u64 = 0x100;
    pub const DRAM_RETIREMENT_FAILURE: u64 = 0x800;
    pub const FATAL_POISON_ERROR: u64 = 0x2000;
    pub const GPU_UNAVAILABLE_ERROR: u64 = 0x4000;
    pub const GPU_RECOVERY_ACTION: u64 = 0x8000;
}

/// `nvmlFieldValue_t.valueType`.
pub mod value_type {
    pub const UINT: u32 = 1;
    pub const ULL: u32 = 3;
}

/// `nvmlEnableState_t`.
pub const FEATURE_DISABLED: c_uint = 0;
pub const FEATURE_ENABLED: c_uint = 1;

/// `NVML_VALUE_NOT_AVAILABLE` as stored in 64-bit fields.
pub const VALUE_NOT_AVAILABLE_U64: u64 = u64::MAX;

/// `0xFFFFFFFF`: not attributable to a MIG instance.
pub const NO_MIG_INSTANCE: c_uint = 0xFFFF_FFFF;

/// `nvmlGpuFabricState_t` values.
pub mod fabric_state {
    pub const NOT_SUPPORTED: u8 = 0;
    pub const NOT_STARTED: u8 = 1;
    pub const IN_PROGRESS: u8 = 2;
    pub const COMPLETED: u8 = 3;
}

/// `nvmlGpuFabricInfo_t` (`nvmlDeviceGetGpuFabricInfo`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GpuFabricInfo {
    pub cluster_uuid: [u8; 16],
    pub status: NvmlReturn,
    pub clique_id: c_uint,
    pub state: u8,
}

/// `nvmlGpuFabricInfo_v3_t` (`nvmlGpuFabricInfoV_t`, `nvmlDeviceGetGpuFabricInfoV`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GpuFabricInfoV3 {
    pub version: c_uint,
    pub cluster_uuid: [u8; 16],
    pub status: NvmlReturn,
    pub clique_id: c_uint,
    pub state: u8,
    pub health_mask: c_uint,
    pub health_summary: u8,
}

/// `nvmlGpuFabricInfo_v3` (`NVML_STRUCT_VERSION(GpuFabricInfo, 3)`).
pub const FABRIC_INFO_V3_VERSION: c_uint =
    (std::mem::size_of::<GpuFabricInfoV3>() as c_uint) | (3 << 24);
/// `nvmlGpuFabricInfo_v2` (`NVML_STRUCT_VERSION(GpuFabricInfo, 2)`): the v2 struct is the v3
/// one up to and including `health_mask`, 36 bytes with the padding after `state`. (This was
/// `32 | (2 << 24)` until NVIDIA's header said otherwise: scripts/nvml-header-check.py.)
pub const FABRIC_INFO_V2_VERSION: c_uint = (std::mem::offset_of!(GpuFabricInfoV3, health_mask)
    + std::mem::size_of::<c_uint>()) as c_uint
    | (2 << 24);

/// `nvmlPciInfo_t` (as filled by `nvmlDeviceGetPciInfo_v3`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PciInfo {
    pub bus_id_legacy: [c_char; 16],
    pub domain: c_uint,
    pub bus: c_uint,
    pub device: c_uint,
    pub pci_device_id: c_uint,
    pub pci_sub_system_id: c_uint,
    pub bus_id: [c_char; 32],
}

/// `nvmlEventData_t` (32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EventData {
    pub device: NvmlDevice,
    pub event_type: c_ulonglong,
    pub event_data: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `nvmlProcessInfo_t` (= `nvmlProcessInfo_v2_t`, 24 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessInfo {
    pub pid: c_uint,
    pub used_gpu_memory: c_ulonglong,
    pub gpu_instance_id: c_uint,
    pub compute_instance_id: c_uint,
}

/// `nvmlProcessUtilizationSample_t` (32 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ProcessUtilizationSample {
    pub pid: c_uint,
    pub time_stamp: c_ulonglong,
    pub sm_util: c_uint,
    pub mem_util: c_uint,
    pub enc_util: c_uint,
    pub dec_util: c_uint,
}

/// `nvmlMemory_t` (v1).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Memory {
    pub total: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MemoryV2 {
    pub version: c_uint,
    pub total: c_ulonglong,
    pub reserved: c_ulonglong,
    pub free: c_ulonglong,
    pub used: c_ulonglong,
}

/// `nvmlMemory_v2` version word: `sizeof(nvmlMemory_v2_t) | (2 << 24)`.
pub const MEMORY_V2_VERSION: c_uint = (std::mem::size_of::<MemoryV2>() as c_uint) | (2 << 24);

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Utilization {
    pub gpu: c_uint,
    pub memory: c_uint,
}

/// `nvmlRowRemapperHistogramValues_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RowRemapperHistogram {
    pub max: c_uint,
    pub high: c_uint,
    pub partial: c_uint,
    pub low: c_uint,
    pub none: c_uint,
}

/// `nvmlValue_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union Value {
    pub d_val: f64,
    pub si_val: c_int,
    pub ui_val: c_uint,
    pub ul_val: c_ulong,
    pub ull_val: c_ulonglong,
    pub sll_val: c_longlong,
    pub us_val: c_ushort,
}

/// `nvmlFieldValue_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FieldValue {
    pub field_id: c_uint,
    pub scope_id: c_uint,
    pub timestamp: c_longlong,
    pub latency_usec: c_longlong,
    pub value_type: c_uint,
    pub nvml_return: NvmlReturn,
    pub value: Value,
}

const _: () = {
    assert!(std::mem::size_of::<PciInfo>() == 68);
    assert!(std::mem::size_of::<EventData>() == 32);
    assert!(std::mem::size_of::<ProcessInfo>() == 24);
    assert!(std::mem::size_of::<ProcessUtilizationSample>() == 32);
    assert!(std::mem::size_of::<MemoryV2>() == 40);
    assert!(std::mem::size_of::<FieldValue>() == 40);
    assert!(std::mem::size_of::<RowRemapperHistogram>() == 20);
    assert!(FABRIC_INFO_V2_VERSION == 36 | (2 << 24));
};

/// Field ids served by `nvmlDeviceGetFieldValues`.
pub mod field {
    pub const ECC_CURRENT: u32 = 1;
    pub const ECC_PENDING: u32 = 2;
    pub const ECC_SBE_VOL_TOTAL: u32 = 3;
    pub const ECC_DBE_VOL_TOTAL: u32 = 4;
    pub const ECC_SBE_AGG_TOTAL: u32 = 5;
    pub const ECC_DBE_AGG_TOTAL: u32 = 6;
    pub const RETIRED_SBE: u32 = 29;
    pub const RETIRED_DBE: u32 = 30;
    pub const RETIRED_PENDING: u32 = 31;
    pub const RETIRED_PENDING_SBE: u32 = 92;
    pub const RETIRED_PENDING_DBE: u32 = 93;
    pub const PCIE_REPLAY_COUNTER: u32 = 94;
    pub const PCIE_REPLAY_ROLLOVER_COUNTER: u32 = 95;
    pub const REMAPPED_COR: u32 = 142;
    pub const REMAPPED_UNC: u32 = 143;
    pub const REMAPPED_PENDING: u32 = 144;
    pub const REMAPPED_FAILURE: u32 = 145;
    pub const GET_GPU_RECOVERY_ACTION: u32 = 230;
}

/// Static, NUL-terminated text for `nvmlErrorString`.
pub fn error_string(code: NvmlReturn) -> &'static std::ffi::CStr {
    match code {
        0 => c"Success",
        1 => c"Uninitialized",
        2 => c"Invalid Argument",
        3 => c"Not Supported",
        4 => c"Insufficient Permissions",
        5 => c"Already Initialized",
        6 => c"Not Found",
        7 => c"Insufficient Size",
        8 => c"Insufficient External Power",
        9 => c"Driver Not Loaded",
        10 => c"Timeout",
        11 => c"Interrupt request issue",
        12 => c"NVML Shared Library Not Found",
        13 => c"Function Not Found",
        14 => c"Corrupted infoROM",
        15 => c"GPU is lost",
        16 => c"GPU requires reset",
        17 => c"GPU access blocked by the operating system",
        18 => c"Driver/library version mismatch",
        19 => c"In use by another client",
        20 => c"Insufficient Memory",
        21 => c"No data",
        25 => c"Argument version mismatch",
        _ => c"Unknown Error",
    }
}
