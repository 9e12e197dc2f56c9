//! Raw NVML calls where nvml-wrapper 0.13 has no wrapper (remapped rows, the remapper
//! histogram) or loses information (event types above 0x100, such as the driver's recovery
//! action 0x8000, are truncated by its `EventSet`). Every symbol is looked up through the
//! wrapper's `Result` fields first, so a missing symbol is an error, never a panic.

use std::ptr;

use nvml_wrapper::Device;
use nvml_wrapper::Nvml;
use nvml_wrapper::error::{NvmlError, nvml_sym, nvml_try};
use nvml_wrapper_sys::bindings::{
    nvmlDevice_t, nvmlEventData_t, nvmlEventSet_t, nvmlRowRemapperHistogramValues_t,
};

/// Event type bits of `nvmlEventType` (docs/nvml.md#events).
pub const EVENT_XID: u64 = 0x8;
/// nvmlEventTypeDoubleBitEccError (0x4 is nvmlEventTypePState).
pub const EVENT_DOUBLE_BIT_ECC: u64 = 0x2;
pub const EVENT_RECOVERY_ACTION: u64 = 0x8000;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemappedRows {
    pub correctable: u64,
    pub uncorrectable: u64,
    pub pending: bool,
    pub failure: bool,
}

pub fn remapped_rows(nvml: &Nvml, device: &Device<'_>) -> Result<RemappedRows, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceGetRemappedRows.as_ref())?;
    let (mut corr, mut unc, mut pending, mut failure) = (0u32, 0u32, 0u32, 0u32);
    // SAFETY: the handle comes from a live `Device` of this `Nvml`; the four out-pointers are
    // valid, distinct locals that outlive the call.
    nvml_try(unsafe {
        f(
            device.handle(),
            &mut corr,
            &mut unc,
            &mut pending,
            &mut failure,
        )
    })?;
    Ok(RemappedRows {
        correctable: corr as u64,
        uncorrectable: unc as u64,
        pending: pending != 0,
        failure: failure != 0,
    })
}

/// Memory banks with no spare rows left (the histogram's `none` bucket).
pub fn remapper_banks_exhausted(nvml: &Nvml, device: &Device<'_>) -> Result<u64, NvmlError> {
    let f = nvml_sym(nvml.lib().nvmlDeviceGetRowRemapperHistogram.as_ref())?;
    let mut values = nvmlRowRemapperHistogramValues_t {
        max: 0,
        high: 0,
        partial: 0,
        low: 0,
        none: 0,
    };
    // SAFETY: live device handle; `values` is a valid, initialised struct of the C layout.
    nvml_try(unsafe { f(device.handle(), &mut values) })?;
    Ok(values.none as u64)
}

/// An NVML event set owned by the event watcher; freed on drop.
pub struct EventSet<'n> {
    nvml: &'n Nvml,
    set: nvmlEventSet_t,
}

/// One event as NVML delivered it, with the full 64-bit type.
#[derive(Debug, Clone, Copy)]
pub struct Event {
    pub device: nvmlDevice_t,
    pub event_type: u64,
    pub data: u64,
}

/// How a wait ended.
pub enum Wait {
    Event(Event),
    Timeout,
    Error(NvmlError),
}

impl<'n> EventSet<'n> {
    pub fn create(nvml: &'n Nvml) -> Result<Self, NvmlError> {
        let create = nvml_sym(nvml.lib().nvmlEventSetCreate.as_ref())?;
        // Dropping needs this symbol; refuse early rather than leak.
        nvml_sym(nvml.lib().nvmlEventSetFree.as_ref())?;
        let mut set: nvmlEventSet_t = ptr::null_mut();
        // SAFETY: `set` is a valid out-pointer; NVML fills it on success.
        nvml_try(unsafe { create(&mut set) })?;
        Ok(EventSet { nvml, set })
    }

    /// The event types the device supports, masked with `wanted`.
    pub fn supported(&self, device: &Device<'_>, wanted: u64) -> Result<u64, NvmlError> {
        let f = nvml_sym(self.nvml.lib().nvmlDeviceGetSupportedEventTypes.as_ref())?;
        let mut types = 0u64;
        // SAFETY: live device handle and a valid out-pointer.
        nvml_try(unsafe { f(device.handle(), &mut types) })?;
        Ok(types & wanted)
    }

    pub fn register(&self, device: &Device<'_>, types: u64) -> Result<(), NvmlError> {
        let f = nvml_sym(self.nvml.lib().nvmlDeviceRegisterEvents.as_ref())?;
        // SAFETY: live device handle and a live set created by this `Nvml`.
        nvml_try(unsafe { f(device.handle(), types, self.set) })
    }

    pub fn wait(&self, timeout_ms: u32) -> Wait {
        let f = match nvml_sym(self.nvml.lib().nvmlEventSetWait_v2.as_ref()) {
            Ok(f) => f,
            Err(e) => return Wait::Error(e),
        };
        let mut data = nvmlEventData_t {
            device: ptr::null_mut(),
            eventType: 0,
            eventData: 0,
            gpuInstanceId: 0,
            computeInstanceId: 0,
        };
        // SAFETY: live set; `data` is a valid, initialised struct of the C layout.
        match nvml_try(unsafe { f(self.set, &mut data, timeout_ms) }) {
            Ok(()) => Wait::Event(Event {
                device: data.device,
                event_type: data.eventType,
                data: data.eventData,
            }),
            Err(NvmlError::Timeout) => Wait::Timeout,
            Err(e) => Wait::Error(e),
        }
    }
}

impl Drop for EventSet<'_> {
    fn drop(&mut self) {
        if let Ok(free) = nvml_sym(self.nvml.lib().nvmlEventSetFree.as_ref()) {
            // SAFETY: the set was created by this `Nvml` and is freed exactly once, here.
            let _ = unsafe { free(self.set) };
        }
    }
}

/// `nvmlGpuFabricState_t`.
pub const FABRIC_NOT_SUPPORTED: u8 = 0;
pub const FABRIC_NOT_STARTED: u8 = 1;
pub const FABRIC_IN_PROGRESS: u8 = 2;
pub const FABRIC_COMPLETED: u8 = 3;

/// `nvmlGpuFabricInfo_v3`: the version word of the v3 struct (`NVML_STRUCT_VERSION(GpuFabricInfo,
/// 3)`: its size, and the version in the top byte).
pub const FABRIC_INFO_V3_VERSION: u32 =
    (std::mem::size_of::<nvml_wrapper_sys::bindings::nvmlGpuFabricInfoV_t>() as u32) | (3 << 24);

/// A GPU's NVLink fabric registration (`nvmlDeviceGetGpuFabricInfoV`, docs/fabric.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FabricInfo {
    pub state: u8,
    /// The registration's `nvmlReturn_t` (0: success).
    pub status: u32,
    pub clique_id: u32,
    pub cluster_uuid: [u8; 16],
}

/// The fabric registration, through `nvmlDeviceGetGpuFabricInfoV` (version 3, the NVML 13
/// form) or, where the driver has no V entry point or refuses the version, the older
/// `nvmlDeviceGetGpuFabricInfo`. NOT_SUPPORTED on GPUs without a fabric (no NVSwitch).
pub fn fabric_info(nvml: &Nvml, device: &Device<'_>) -> Result<FabricInfo, NvmlError> {
    use nvml_wrapper_sys::bindings::{nvmlGpuFabricInfo_t, nvmlGpuFabricInfoV_t};
    if let Ok(f) = nvml_sym(nvml.lib().nvmlDeviceGetGpuFabricInfoV.as_ref()) {
        let mut info = nvmlGpuFabricInfoV_t {
            version: FABRIC_INFO_V3_VERSION,
            clusterUuid: [0; 16],
            status: 0,
            cliqueId: 0,
            state: 0,
            healthMask: 0,
            healthSummary: 0,
        };
        // SAFETY: live device handle; `info` is an initialised v3 struct whose version word
        // says so.
        match nvml_try(unsafe { f(device.handle(), &mut info) }) {
            Ok(()) => {
                return Ok(FabricInfo {
                    state: info.state,
                    status: info.status,
                    clique_id: info.cliqueId,
                    cluster_uuid: info.clusterUuid,
                });
            }
            Err(NvmlError::Unknown) | Err(NvmlError::UnexpectedVariant(_)) => {}
            Err(e) => return Err(e),
        }
    }
    let f = nvml_sym(nvml.lib().nvmlDeviceGetGpuFabricInfo.as_ref())?;
    let mut info = nvmlGpuFabricInfo_t {
        clusterUuid: [0; 16],
        status: 0,
        cliqueId: 0,
        state: 0,
    };
    // SAFETY: live device handle; `info` is a valid, initialised struct of the C layout.
    nvml_try(unsafe { f(device.handle(), &mut info) })?;
    Ok(FabricInfo {
        state: info.state,
        status: info.status,
        clique_id: info.cliqueId,
        cluster_uuid: info.clusterUuid,
    })
}

/// Every clock event reason set now (`nvmlDeviceGetCurrentClocksEventReasons`, the NVML 13
/// name; the wrapper calls the deprecated `…ThrottleReasons` and drops unknown bits).
pub fn clock_event_reasons(nvml: &Nvml, device: &Device<'_>) -> Result<u64, NvmlError> {
    let f = match nvml_sym(nvml.lib().nvmlDeviceGetCurrentClocksEventReasons.as_ref()) {
        Ok(f) => f,
        Err(_) => return device.current_throttle_reasons().map(|r| r.bits()),
    };
    let mut reasons = 0u64;
    // SAFETY: live device handle and a valid out-pointer.
    nvml_try(unsafe { f(device.handle(), &mut reasons) })?;
    Ok(reasons)
}
