//! The CUDA driver API calls the built-in check makes, bound at run time from `libcuda.so.1`
//! with `libloading` (the crate nvml-wrapper already brings in): no CUDA toolkit, no link-time
//! dependency, and a node without the driver still runs every other part of gpu-medic.
//!
//! Only the driver API (`cu*`), never the runtime (`cuda*`): the driver library ships with the
//! kernel driver on every GPU node, the runtime does not. The signatures are those of `cuda.h`
//! (CUDA driver API reference, docs.nvidia.com/cuda/cuda-driver-api); the `_v2` entry points
//! are the 64-bit ones every driver since CUDA 3.2 exports under those names. `CUdeviceptr` is
//! 64 bits and `CUresult` a C `int` on the 64-bit Linux this runs on.
//!
//! Every call goes through a method that checks its result; handles (context, device memory,
//! pinned host memory, module, event) are guards released on drop.

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::path::Path;

/// `CUresult`.
pub type CuResult = c_int;
/// `CUdevice`: an ordinal handle.
pub type CuDevice = c_int;
/// `CUdeviceptr`.
pub type DevPtr = u64;
/// `CUcontext`, `CUmodule`, `CUfunction`, `CUevent`, `CUstream`: opaque pointers.
pub type Handle = *mut c_void;

pub const CUDA_SUCCESS: CuResult = 0;
pub const CUDA_ERROR_OUT_OF_MEMORY: CuResult = 2;
pub const CUDA_ERROR_INVALID_IMAGE: CuResult = 200;
pub const CUDA_ERROR_NO_BINARY_FOR_GPU: CuResult = 209;
pub const CUDA_ERROR_INVALID_PTX: CuResult = 218;
pub const CUDA_ERROR_JIT_COMPILER_NOT_FOUND: CuResult = 221;
pub const CUDA_ERROR_UNSUPPORTED_PTX_VERSION: CuResult = 222;
/// 805..=810: `CUDA_ERROR_MPS_CONNECTION_FAILED`, `_RPC_FAILURE`, `_SERVER_NOT_READY`,
/// `_MAX_CLIENTS_REACHED`, `_MAX_CONNECTIONS_REACHED`, `_CLIENT_TERMINATED`.
pub const CUDA_ERROR_MPS_FIRST: CuResult = 805;
pub const CUDA_ERROR_MPS_LAST: CuResult = 810;

/// Whether `code` is one of the MPS client errors.
pub fn is_mps_error(code: CuResult) -> bool {
    (CUDA_ERROR_MPS_FIRST..=CUDA_ERROR_MPS_LAST).contains(&code)
}

/// Whether `code` says the module image (our PTX) was refused, rather than the GPU failing:
/// a JIT that cannot take it tells nothing about the GPU.
pub fn is_image_error(code: CuResult) -> bool {
    matches!(
        code,
        CUDA_ERROR_INVALID_IMAGE
            | CUDA_ERROR_NO_BINARY_FOR_GPU
            | CUDA_ERROR_INVALID_PTX
            | CUDA_ERROR_JIT_COMPILER_NOT_FOUND
            | CUDA_ERROR_UNSUPPORTED_PTX_VERSION
    )
}

/// The names of the errors the check is most likely to meet, for a driver too old to have
/// `cuGetErrorName` (CUDA < 6.0) or a code it does not know.
pub fn known_name(code: CuResult) -> Option<&'static str> {
    Some(match code {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        46 => "CUDA_ERROR_DEVICES_UNAVAILABLE",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        214 => "CUDA_ERROR_ECC_UNCORRECTABLE",
        218 => "CUDA_ERROR_INVALID_PTX",
        221 => "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        222 => "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        500 => "CUDA_ERROR_NOT_FOUND",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        805 => "CUDA_ERROR_MPS_CONNECTION_FAILED",
        806 => "CUDA_ERROR_MPS_RPC_FAILURE",
        807 => "CUDA_ERROR_MPS_SERVER_NOT_READY",
        808 => "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED",
        809 => "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED",
        810 => "CUDA_ERROR_MPS_CLIENT_TERMINATED",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return None,
    })
}

/// A driver call that failed: its code and the driver's own words for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{call}: {name} ({text})")]
pub struct CuError {
    pub call: &'static str,
    pub code: CuResult,
    pub name: String,
    pub text: String,
}

/// Why the library could not be used at all.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("cannot load {0}: {1}")]
    Open(String, libloading::Error),
    #[error("{0} has no {1}: not a CUDA driver library, or one too old")]
    Symbol(String, &'static str),
}

type FnInit = unsafe extern "C" fn(c_uint) -> CuResult;
type FnOutInt = unsafe extern "C" fn(*mut c_int) -> CuResult;
type FnDeviceGet = unsafe extern "C" fn(*mut CuDevice, c_int) -> CuResult;
type FnDeviceName = unsafe extern "C" fn(*mut c_char, c_int, CuDevice) -> CuResult;
type FnDeviceUuid = unsafe extern "C" fn(*mut [u8; 16], CuDevice) -> CuResult;
type FnDeviceMem = unsafe extern "C" fn(*mut usize, CuDevice) -> CuResult;
type FnCtxCreate = unsafe extern "C" fn(*mut Handle, c_uint, CuDevice) -> CuResult;
type FnHandle = unsafe extern "C" fn(Handle) -> CuResult;
type FnVoid = unsafe extern "C" fn() -> CuResult;
type FnMemInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;
type FnMemAlloc = unsafe extern "C" fn(*mut DevPtr, usize) -> CuResult;
type FnMemFree = unsafe extern "C" fn(DevPtr) -> CuResult;
type FnHostAlloc = unsafe extern "C" fn(*mut *mut c_void, usize) -> CuResult;
type FnHostFree = unsafe extern "C" fn(*mut c_void) -> CuResult;
type FnHtoD = unsafe extern "C" fn(DevPtr, *const c_void, usize) -> CuResult;
type FnDtoH = unsafe extern "C" fn(*mut c_void, DevPtr, usize) -> CuResult;
type FnModuleLoad = unsafe extern "C" fn(*mut Handle, *const c_void) -> CuResult;
type FnGetFunction = unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> CuResult;
type FnLaunch = unsafe extern "C" fn(
    Handle,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    c_uint,
    Handle,
    *mut *mut c_void,
    *mut *mut c_void,
) -> CuResult;
type FnEventCreate = unsafe extern "C" fn(*mut Handle, c_uint) -> CuResult;
type FnEventRecord = unsafe extern "C" fn(Handle, Handle) -> CuResult;
type FnElapsed = unsafe extern "C" fn(*mut f32, Handle, Handle) -> CuResult;
type FnErrorText = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

/// The bound driver API. Holds the library open for as long as it lives.
pub struct Api {
    init: FnInit,
    device_get_count: FnOutInt,
    device_get: FnDeviceGet,
    device_get_name: FnDeviceName,
    device_get_uuid: FnDeviceUuid,
    device_total_mem: FnDeviceMem,
    ctx_create: FnCtxCreate,
    ctx_destroy: FnHandle,
    ctx_synchronize: FnVoid,
    mem_get_info: FnMemInfo,
    mem_alloc: FnMemAlloc,
    mem_free: FnMemFree,
    mem_alloc_host: Option<FnHostAlloc>,
    mem_free_host: Option<FnHostFree>,
    memcpy_htod: FnHtoD,
    memcpy_dtoh: FnDtoH,
    module_load_data: FnModuleLoad,
    module_unload: FnHandle,
    module_get_function: FnGetFunction,
    launch_kernel: FnLaunch,
    event_create: FnEventCreate,
    event_record: FnEventRecord,
    event_synchronize: FnHandle,
    event_elapsed_time: FnElapsed,
    event_destroy: FnHandle,
    get_error_name: Option<FnErrorText>,
    get_error_string: Option<FnErrorText>,
    // Last: the function pointers above point into it.
    _lib: libloading::Library,
}

/// Looks up `name` (NUL-terminated) in `lib` as a `T`.
///
/// # Safety
/// `T` must be the function pointer type of the symbol's C declaration in `cuda.h`.
unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &'static [u8]) -> Option<T> {
    // SAFETY: the caller promises `T` is the symbol's C type; the pointer is copied out and
    // used only while `Api` keeps `lib` loaded.
    unsafe { lib.get::<T>(name).ok().map(|s| *s) }
}

impl Api {
    /// Opens the driver library (`libcuda.so.1`, looked up by the dynamic loader, or a path)
    /// and binds every call. Does not call `cuInit`.
    pub fn load(library: &Path) -> Result<Api, LoadError> {
        let shown = library.display().to_string();
        // SAFETY: loading a shared library runs its initialisers. The library is the NVIDIA
        // driver's (or the configured path the operator chose as one); it is loaded in the
        // check's own worker process, which does nothing else, so a misbehaving initialiser
        // harms no other part of gpu-medic.
        let lib = unsafe { libloading::Library::new(library.as_os_str()) }
            .map_err(|e| LoadError::Open(shown.clone(), e))?;
        macro_rules! need {
            ($name:literal) => {{
                // SAFETY: the field this initialises is declared with the C signature of
                // this very symbol in cuda.h (see the types above).
                match unsafe { sym(&lib, concat!($name, "\0").as_bytes()) } {
                    Some(f) => f,
                    None => return Err(LoadError::Symbol(shown, $name)),
                }
            }};
        }
        macro_rules! want {
            ($name:literal) => {{
                // SAFETY: as in `need!`: the field's type is the symbol's C signature.
                unsafe { sym(&lib, concat!($name, "\0").as_bytes()) }
            }};
        }
        // cuDeviceGetUuid_v2 (CUDA 11.4) and cuDeviceGetUuid (9.2) share a signature; the
        // first names MIG instances correctly, both the same for a whole GPU.
        let device_get_uuid = match want!("cuDeviceGetUuid_v2") {
            Some(f) => f,
            None => need!("cuDeviceGetUuid"),
        };
        // cuEventElapsedTime_v2 (CUDA 12.8) has the same signature as the original.
        let event_elapsed_time = match want!("cuEventElapsedTime_v2") {
            Some(f) => f,
            None => need!("cuEventElapsedTime"),
        };
        Ok(Api {
            init: need!("cuInit"),
            device_get_count: need!("cuDeviceGetCount"),
            device_get: need!("cuDeviceGet"),
            device_get_name: need!("cuDeviceGetName"),
            device_get_uuid,
            device_total_mem: need!("cuDeviceTotalMem_v2"),
            ctx_create: need!("cuCtxCreate_v2"),
            ctx_destroy: need!("cuCtxDestroy_v2"),
            ctx_synchronize: need!("cuCtxSynchronize"),
            mem_get_info: need!("cuMemGetInfo_v2"),
            mem_alloc: need!("cuMemAlloc_v2"),
            mem_free: need!("cuMemFree_v2"),
            mem_alloc_host: want!("cuMemAllocHost_v2"),
            mem_free_host: want!("cuMemFreeHost"),
            memcpy_htod: need!("cuMemcpyHtoD_v2"),
            memcpy_dtoh: need!("cuMemcpyDtoH_v2"),
            module_load_data: need!("cuModuleLoadData"),
            module_unload: need!("cuModuleUnload"),
            module_get_function: need!("cuModuleGetFunction"),
            launch_kernel: need!("cuLaunchKernel"),
            event_create: need!("cuEventCreate"),
            event_record: need!("cuEventRecord"),
            event_synchronize: need!("cuEventSynchronize"),
            event_elapsed_time,
            event_destroy: need!("cuEventDestroy_v2"),
            get_error_name: want!("cuGetErrorName"),
            get_error_string: want!("cuGetErrorString"),
            _lib: lib,
        })
    }

    /// `Ok` or the error with the driver's name and description for it.
    fn check(&self, call: &'static str, code: CuResult) -> Result<(), CuError> {
        if code == CUDA_SUCCESS {
            return Ok(());
        }
        let text_of = |f: Option<FnErrorText>| -> Option<String> {
            let f = f?;
            let mut p: *const c_char = std::ptr::null();
            // SAFETY: cuGetErrorName/String write a pointer to a static NUL-terminated
            // string (or leave it NULL for an unknown code) through the valid `&mut p`.
            let r = unsafe { f(code, &mut p) };
            if r != CUDA_SUCCESS || p.is_null() {
                return None;
            }
            // SAFETY: non-null, and the driver documents it as a NUL-terminated static.
            let s = unsafe { CStr::from_ptr(p) };
            Some(s.to_string_lossy().chars().take(200).collect())
        };
        let name = text_of(self.get_error_name)
            .or_else(|| known_name(code).map(str::to_string))
            .unwrap_or_else(|| format!("CUDA error {code}"));
        let text = text_of(self.get_error_string).unwrap_or_else(|| format!("code {code}"));
        Err(CuError {
            call,
            code,
            name,
            text,
        })
    }

    pub fn init(&self) -> Result<(), CuError> {
        // SAFETY: cuInit takes flags by value; 0 is the only documented value.
        self.check("cuInit", unsafe { (self.init)(0) })
    }

    pub fn device_count(&self) -> Result<u32, CuError> {
        let mut n: c_int = 0;
        // SAFETY: writes one int through a valid pointer.
        self.check("cuDeviceGetCount", unsafe {
            (self.device_get_count)(&mut n)
        })?;
        Ok(u32::try_from(n).unwrap_or(0))
    }

    pub fn device(&self, ordinal: u32) -> Result<CuDevice, CuError> {
        let mut d: CuDevice = 0;
        let ordinal = c_int::try_from(ordinal).unwrap_or(c_int::MAX);
        // SAFETY: writes one CUdevice through a valid pointer.
        self.check("cuDeviceGet", unsafe { (self.device_get)(&mut d, ordinal) })?;
        Ok(d)
    }

    pub fn device_name(&self, dev: CuDevice) -> Result<String, CuError> {
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL included, into `buf`.
        self.check("cuDeviceGetName", unsafe {
            (self.device_get_name)(buf.as_mut_ptr(), 255, dev)
        })?;
        // SAFETY: `buf` holds at most 255 written bytes and its last byte stays 0, so it is
        // NUL-terminated within its bounds.
        let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(s.to_string_lossy().into_owned())
    }

    pub fn device_uuid(&self, dev: CuDevice) -> Result<[u8; 16], CuError> {
        let mut uuid = [0u8; 16];
        // SAFETY: `CUuuid` is `struct { char bytes[16]; }`: 16 bytes, alignment 1.
        self.check("cuDeviceGetUuid", unsafe {
            (self.device_get_uuid)(&mut uuid, dev)
        })?;
        Ok(uuid)
    }

    pub fn device_total_mem(&self, dev: CuDevice) -> Result<usize, CuError> {
        let mut n: usize = 0;
        // SAFETY: writes one size_t through a valid pointer.
        self.check("cuDeviceTotalMem", unsafe {
            (self.device_total_mem)(&mut n, dev)
        })?;
        Ok(n)
    }

    /// A context on `dev`, current on this thread until dropped.
    pub fn context(&self, dev: CuDevice) -> Result<Context<'_>, CuError> {
        let mut ctx: Handle = std::ptr::null_mut();
        // SAFETY: writes one CUcontext through a valid pointer; flags 0 = CU_CTX_SCHED_AUTO.
        self.check("cuCtxCreate", unsafe {
            (self.ctx_create)(&mut ctx, 0, dev)
        })?;
        Ok(Context { api: self, ctx })
    }

    pub fn synchronize(&self) -> Result<(), CuError> {
        // SAFETY: no arguments; acts on the current context.
        self.check("cuCtxSynchronize", unsafe { (self.ctx_synchronize)() })
    }

    /// (free, total) bytes of the current context's device.
    pub fn mem_info(&self) -> Result<(usize, usize), CuError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two size_t through valid pointers.
        self.check("cuMemGetInfo", unsafe {
            (self.mem_get_info)(&mut free, &mut total)
        })?;
        Ok((free, total))
    }

    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuf<'_>, CuError> {
        let mut ptr: DevPtr = 0;
        // SAFETY: writes one CUdeviceptr through a valid pointer.
        self.check("cuMemAlloc", unsafe { (self.mem_alloc)(&mut ptr, bytes) })?;
        Ok(DeviceBuf {
            api: self,
            ptr,
            bytes,
        })
    }

    /// A host buffer of `words` u32, page-locked (`cuMemAllocHost`) where the driver gives
    /// one, else ordinary heap memory (copies from it are slower).
    pub fn host(&self, words: usize) -> HostBuf<'_> {
        if let (Some(alloc), Some(_)) = (self.mem_alloc_host, self.mem_free_host) {
            let mut p: *mut c_void = std::ptr::null_mut();
            let bytes = words.saturating_mul(4);
            // SAFETY: writes one pointer through a valid pointer.
            let r = unsafe { alloc(&mut p, bytes) };
            if r == CUDA_SUCCESS && !p.is_null() && p.align_offset(4) == 0 {
                let p = p.cast::<u32>();
                // SAFETY: the driver allocated `bytes` = 4 * `words` bytes at `p`, aligned
                // for u32 (checked); zeroing makes every element initialised.
                unsafe { std::ptr::write_bytes(p, 0, words) };
                return HostBuf::Pinned {
                    api: self,
                    ptr: p,
                    words,
                };
            }
            if r == CUDA_SUCCESS && !p.is_null() {
                self.free_host(p);
            }
        }
        HostBuf::Heap(vec![0u32; words])
    }

    fn free_host(&self, p: *mut c_void) {
        if let Some(free) = self.mem_free_host {
            // SAFETY: `p` came from cuMemAllocHost and is freed once.
            unsafe {
                free(p);
            }
        }
    }

    /// Copies `src` to device address `dst`.
    pub fn htod(&self, dst: DevPtr, src: &[u32]) -> Result<(), CuError> {
        // SAFETY: `src` is valid for reading its whole length in bytes; the caller names a
        // device range inside one of its allocations (the driver checks it too).
        self.check("cuMemcpyHtoD", unsafe {
            (self.memcpy_htod)(dst, src.as_ptr().cast(), std::mem::size_of_val(src))
        })
    }

    /// Copies from device address `src` into `dst`.
    pub fn dtoh(&self, dst: &mut [u32], src: DevPtr) -> Result<(), CuError> {
        // SAFETY: `dst` is valid for writing its whole length in bytes, and any bit pattern
        // is a valid u32.
        self.check("cuMemcpyDtoH", unsafe {
            (self.memcpy_dtoh)(dst.as_mut_ptr().cast(), src, std::mem::size_of_val(dst))
        })
    }

    /// Loads a module from a NUL-terminated PTX text (JIT-compiled by the driver).
    pub fn module(&self, ptx: &CStr) -> Result<Module<'_>, CuError> {
        let mut m: Handle = std::ptr::null_mut();
        // SAFETY: `ptx` is a NUL-terminated image, as cuModuleLoadData requires for PTX.
        self.check("cuModuleLoadData", unsafe {
            (self.module_load_data)(&mut m, ptx.as_ptr().cast())
        })?;
        Ok(Module { api: self, m })
    }

    /// Launches `f` on the default stream with `params`, one pointer per kernel parameter.
    ///
    /// # Safety
    /// `params` must hold exactly one pointer per parameter of the kernel, each to a value of
    /// that parameter's type that lives until the call returns; device pointers among them
    /// must name allocations large enough for the grid.
    pub unsafe fn launch(
        &self,
        f: Handle,
        grid: u32,
        block: u32,
        params: &mut [*mut c_void],
    ) -> Result<(), CuError> {
        // SAFETY: by this function's contract; no shared memory, the NULL (default) stream,
        // no `extra`.
        self.check("cuLaunchKernel", unsafe {
            (self.launch_kernel)(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    pub fn event(&self) -> Result<Event<'_>, CuError> {
        let mut e: Handle = std::ptr::null_mut();
        // SAFETY: writes one CUevent; flags 0 = CU_EVENT_DEFAULT (timing enabled).
        self.check("cuEventCreate", unsafe { (self.event_create)(&mut e, 0) })?;
        Ok(Event { api: self, e })
    }
}

/// A context; destroyed on drop.
pub struct Context<'a> {
    api: &'a Api,
    ctx: Handle,
}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from cuCtxCreate and is destroyed once.
        unsafe {
            (self.api.ctx_destroy)(self.ctx);
        }
    }
}

/// Device memory; freed on drop.
pub struct DeviceBuf<'a> {
    api: &'a Api,
    pub ptr: DevPtr,
    pub bytes: usize,
}

impl Drop for DeviceBuf<'_> {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from cuMemAlloc and is freed once.
        unsafe {
            (self.api.mem_free)(self.ptr);
        }
    }
}

/// A host staging buffer of u32 words.
pub enum HostBuf<'a> {
    Pinned {
        api: &'a Api,
        ptr: *mut u32,
        words: usize,
    },
    Heap(Vec<u32>),
}

impl HostBuf<'_> {
    pub fn pinned(&self) -> bool {
        matches!(self, HostBuf::Pinned { .. })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u32] {
        match self {
            // SAFETY: `ptr` holds `words` initialised u32 (zeroed at allocation), owned by
            // this buffer until drop, and `&mut self` makes the borrow exclusive.
            HostBuf::Pinned { ptr, words, .. } => unsafe {
                std::slice::from_raw_parts_mut(*ptr, *words)
            },
            HostBuf::Heap(v) => v.as_mut_slice(),
        }
    }
}

impl Drop for HostBuf<'_> {
    fn drop(&mut self) {
        if let HostBuf::Pinned { api, ptr, .. } = self {
            api.free_host(ptr.cast());
        }
    }
}

/// A loaded module; unloaded on drop.
pub struct Module<'a> {
    api: &'a Api,
    m: Handle,
}

impl Module<'_> {
    pub fn function(&self, name: &CStr) -> Result<Handle, CuError> {
        let mut f: Handle = std::ptr::null_mut();
        // SAFETY: writes one CUfunction; `name` is NUL-terminated; `m` is loaded.
        self.api.check("cuModuleGetFunction", unsafe {
            (self.api.module_get_function)(&mut f, self.m, name.as_ptr())
        })?;
        Ok(f)
    }
}

impl Drop for Module<'_> {
    fn drop(&mut self) {
        // SAFETY: `m` came from cuModuleLoadData and is unloaded once.
        unsafe {
            (self.api.module_unload)(self.m);
        }
    }
}

/// A timing event; destroyed on drop.
pub struct Event<'a> {
    api: &'a Api,
    e: Handle,
}

impl Event<'_> {
    /// Records the event on the default stream.
    pub fn record(&self) -> Result<(), CuError> {
        // SAFETY: a live event and the NULL (default) stream.
        self.api.check("cuEventRecord", unsafe {
            (self.api.event_record)(self.e, std::ptr::null_mut())
        })
    }

    /// Milliseconds from `start` to this event, once this event has completed.
    pub fn since(&self, start: &Event<'_>) -> Result<f32, CuError> {
        // SAFETY: a live event.
        self.api.check("cuEventSynchronize", unsafe {
            (self.api.event_synchronize)(self.e)
        })?;
        let mut ms = 0f32;
        // SAFETY: writes one float; both events are live and recorded.
        self.api.check("cuEventElapsedTime", unsafe {
            (self.api.event_elapsed_time)(&mut ms, start.e, self.e)
        })?;
        Ok(ms)
    }
}

impl Drop for Event<'_> {
    fn drop(&mut self) {
        // SAFETY: `e` came from cuEventCreate and is destroyed once.
        unsafe {
            (self.api.event_destroy)(self.e);
        }
    }
}
