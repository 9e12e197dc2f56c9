//! The exported C ABI (`cu*` symbols, the signatures of `cuda.h`).
//!
//! Common safety contract (the driver's own): every pointer argument is either NULL or valid
//! for the access the CUDA documentation describes (one element for scalar out-parameters,
//! `len` bytes for name buffers, `ByteCount` bytes for host copy buffers, one pointer per
//! kernel parameter), suitably aligned, and not aliased for the duration of the call. NULL
//! out-pointers yield CUDA_ERROR_INVALID_VALUE. The functions are `unsafe extern "C"` for
//! that contract; it is stated once here rather than on each.
//!
//! SAFETY (every `#[unsafe(no_mangle)]` below): each exported name is a CUDA driver symbol
//! defined exactly once in this library with its `cuda.h` signature. The check loads the
//! library with `dlopen(RTLD_LOCAL)` (libloading's default) and never a real libcuda
//! alongside.
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};

use crate::config::{BAD_CELL, Fault, WRONG_ELEMENT};
use crate::state::{self, *};

type Handle = *mut c_void;

fn code(r: Result<(), CuResult>) -> CuResult {
    r.err().unwrap_or(SUCCESS)
}

/// Writes `v` through `p`.
///
/// # Safety
/// `p` must be NULL or valid and aligned for writing one `T`.
unsafe fn put<T>(p: *mut T, v: T) -> Result<(), CuResult> {
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: non-null and, by the contract, valid for one write.
    unsafe { p.write(v) };
    Ok(())
}

fn as_handle(h: usize) -> Handle {
    h as Handle
}

fn gpu_of(s: &State, dev: c_int) -> Result<usize, CuResult> {
    usize::try_from(dev)
        .ok()
        .filter(|d| *d < s.gpus.len())
        .ok_or(INVALID_DEVICE)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(_flags: c_uint) -> CuResult {
    state::init()
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CuResult {
    code(with(|s| {
        let n = c_int::try_from(s.gpus.len()).unwrap_or(0);
        // SAFETY: the common contract.
        unsafe { put(count, n) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CuResult {
    code(with(|s| {
        let g = gpu_of(s, ordinal)?;
        // SAFETY: the common contract.
        unsafe { put(dev, g as c_int) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CuResult {
    code(with(|s| {
        let g = gpu_of(s, dev)?;
        let text = s.gpus.get(g).map(|x| x.name.clone()).unwrap_or_default();
        let len = usize::try_from(len).map_err(|_| INVALID_VALUE)?;
        if name.is_null() || len == 0 {
            return Err(INVALID_VALUE);
        }
        // As the driver: cut to fit, always NUL-terminated.
        let n = text.len().min(len - 1);
        // SAFETY: `name` is valid for `len` bytes (the contract) and `n + 1 <= len`.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr().cast::<c_char>(), name, n);
            name.add(n).write(0);
        }
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: c_int) -> CuResult {
    code(with(|s| {
        let g = gpu_of(s, dev)?;
        let b = s.gpus.get(g).map(|x| x.uuid_bytes).unwrap_or_default();
        // SAFETY: the common contract (`CUuuid` is 16 bytes).
        unsafe { put(uuid, b) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: c_int) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CuResult {
    code(with(|s| {
        let g = gpu_of(s, dev)?;
        let mib = s.gpus.get(g).map_or(0, |x| x.memory_mib);
        // SAFETY: the common contract.
        unsafe { put(bytes, (mib * 1024 * 1024) as usize) }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v2(ctx: *mut Handle, _flags: c_uint, dev: c_int) -> CuResult {
    code(with(|s| {
        let g = gpu_of(s, dev)?;
        if s.gpus.get(g).is_some_and(|x| x.fault == Fault::ContextFail) {
            return Err(MPS_CONNECTION_FAILED);
        }
        let h = s.handle();
        s.contexts.insert(h, g);
        s.current = Some(g);
        // SAFETY: the common contract.
        unsafe { put(ctx, as_handle(h)) }
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> CuResult {
    code(with(|s| {
        let g = s.contexts.remove(&(ctx as usize)).ok_or(INVALID_CONTEXT)?;
        if s.current == Some(g) {
            s.current = None;
        }
        Ok(())
    }))
}

/// Hangs (outside the lock) if a kernel was launched on a hanging GPU.
fn wait_for_gpu() -> CuResult {
    match with(|s| Ok(s.hang_pending)) {
        Ok(true) => state::hang(),
        Ok(false) => SUCCESS,
        Err(e) => e,
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    wait_for_gpu()
}

fn current(s: &State) -> Result<usize, CuResult> {
    s.current.ok_or(INVALID_CONTEXT)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CuResult {
    code(with(|s| {
        let g = current(s)?;
        let spec = s.gpus.get(g).ok_or(INVALID_CONTEXT)?;
        let used = s.used.get(g).copied().unwrap_or(0);
        let f = (spec.free_mib * 1024 * 1024).saturating_sub(used);
        let t = spec.memory_mib * 1024 * 1024;
        // SAFETY: the common contract.
        unsafe {
            put(free, f as usize)?;
            put(total, t as usize)
        }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut u64, bytes: usize) -> CuResult {
    code(with(|s| {
        let g = current(s)?;
        let spec = s.gpus.get(g).ok_or(INVALID_CONTEXT)?;
        if bytes == 0 {
            return Err(INVALID_VALUE);
        }
        let bytes = bytes as u64;
        let room =
            (spec.free_mib * 1024 * 1024).saturating_sub(s.used.get(g).copied().unwrap_or(0));
        if spec.fault == Fault::AllocFail || bytes > room {
            return Err(OUT_OF_MEMORY);
        }
        let data = vec![0u8; usize::try_from(bytes).map_err(|_| OUT_OF_MEMORY)?];
        let at = s.next.get(g).copied().ok_or(INVALID_CONTEXT)?;
        if let Some(n) = s.next.get_mut(g) {
            *n = at + bytes.div_ceil(256) * 256;
        }
        if let Some(u) = s.used.get_mut(g) {
            *u += bytes;
        }
        s.allocs.insert(at, Alloc { gpu: g, data });
        // SAFETY: the common contract.
        unsafe { put(dptr, at) }
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: u64) -> CuResult {
    code(with(|s| {
        let a = s.allocs.remove(&dptr).ok_or(INVALID_VALUE)?;
        if let Some(u) = s.used.get_mut(a.gpu) {
            *u = u.saturating_sub(a.data.len() as u64);
        }
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CuResult {
    code(with(|s| {
        let layout =
            std::alloc::Layout::from_size_align(bytes.max(1), 4096).map_err(|_| INVALID_VALUE)?;
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { std::alloc::alloc(layout) };
        if p.is_null() {
            return Err(OUT_OF_MEMORY);
        }
        s.hosts.insert(p as usize, layout);
        // SAFETY: the common contract.
        unsafe { put(pp, p.cast()) }
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CuResult {
    code(with(|s| {
        let layout = s.hosts.remove(&(p as usize)).ok_or(INVALID_VALUE)?;
        // SAFETY: `p` came from `alloc` with this layout (it was in `hosts`) and is freed once.
        unsafe { std::alloc::dealloc(p.cast(), layout) };
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(dst: u64, src: *const c_void, n: usize) -> CuResult {
    code(with(|s| {
        if src.is_null() {
            return Err(INVALID_VALUE);
        }
        let (start, a) = s.find(dst, n as u64).ok_or(INVALID_VALUE)?;
        let off = usize::try_from(dst - start).map_err(|_| INVALID_VALUE)?;
        let gpu = a.gpu;
        let to = a.data.get_mut(off..off + n).ok_or(INVALID_VALUE)?;
        // SAFETY: `src` is valid for `n` bytes (the contract); `to` is `n` bytes of our own
        // buffer, which the caller cannot alias.
        unsafe { std::ptr::copy_nonoverlapping(src.cast::<u8>(), to.as_mut_ptr(), n) };
        s.copy_time(gpu, n as u64);
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: u64, n: usize) -> CuResult {
    code(with(|s| {
        if dst.is_null() {
            return Err(INVALID_VALUE);
        }
        let (start, a) = s.find(src, n as u64).ok_or(INVALID_VALUE)?;
        let off = usize::try_from(src - start).map_err(|_| INVALID_VALUE)?;
        let gpu = a.gpu;
        let from = a.data.get(off..off + n).ok_or(INVALID_VALUE)?;
        // SAFETY: `dst` is valid for `n` bytes (the contract); `from` is `n` bytes of our own.
        unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), dst.cast::<u8>(), n) };
        if s.gpus
            .get(gpu)
            .is_some_and(|g| g.fault == Fault::MemoryCorrupt)
        {
            let bad = base(gpu) + BAD_CELL;
            if (src..src + n as u64).contains(&bad) {
                let at = usize::try_from(bad - src).map_err(|_| INVALID_VALUE)?;
                // SAFETY: `at < n`, inside the `n` bytes just written.
                unsafe {
                    let p = dst.cast::<u8>().add(at);
                    p.write(p.read() ^ 0x08);
                }
            }
        }
        s.copy_time(gpu, n as u64);
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CuResult {
    code(with(|s| {
        if image.is_null() {
            return Err(INVALID_VALUE);
        }
        current(s)?;
        // SAFETY: a PTX image is a NUL-terminated string (the contract).
        let text = unsafe { CStr::from_ptr(image.cast::<c_char>()) }.to_string_lossy();
        let entries: Vec<String> = text
            .split(".entry")
            .skip(1)
            .filter_map(|rest| {
                let name: String = rest
                    .trim_start()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                (!name.is_empty()).then_some(name)
            })
            .collect();
        if entries.is_empty() {
            return Err(218); // CUDA_ERROR_INVALID_PTX
        }
        let h = s.handle();
        s.modules.insert(h, entries);
        // SAFETY: the common contract.
        unsafe { put(module, as_handle(h)) }
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: Handle) -> CuResult {
    code(with(|s| {
        s.modules
            .remove(&(module as usize))
            .map(|_| ())
            .ok_or(INVALID_HANDLE)
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut Handle,
    module: Handle,
    name: *const c_char,
) -> CuResult {
    code(with(|s| {
        if name.is_null() {
            return Err(INVALID_VALUE);
        }
        // SAFETY: NUL-terminated (the contract).
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let entries = s.modules.get(&(module as usize)).ok_or(INVALID_HANDLE)?;
        if !entries.contains(&name) {
            return Err(NOT_FOUND);
        }
        let kernel = match name.as_str() {
            "gm_index" => Kernel::Index,
            "gm_fma" => Kernel::Fma,
            _ => return Err(NOT_FOUND),
        };
        let h = s.handle();
        s.functions.insert(h, kernel);
        // SAFETY: the common contract.
        unsafe { put(f, as_handle(h)) }
    }))
}

/// Reads kernel parameter `i` as a `T`.
///
/// # Safety
/// `params` must hold at least `i + 1` pointers, the `i`-th to a valid `T`.
unsafe fn param<T: Copy>(params: *mut *mut c_void, i: usize) -> Result<T, CuResult> {
    if params.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: by this function's contract.
    let p = unsafe { params.add(i).read() };
    if p.is_null() {
        return Err(INVALID_VALUE);
    }
    // SAFETY: by this function's contract; unaligned reads cost nothing here.
    Ok(unsafe { p.cast::<T>().read_unaligned() })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    _shared: c_uint,
    _stream: Handle,
    params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CuResult {
    code(with(|s| {
        let g = current(s)?;
        let kernel = *s.functions.get(&(f as usize)).ok_or(INVALID_HANDLE)?;
        let threads = [gx, gy, gz, bx, by, bz]
            .iter()
            .try_fold(1u64, |acc, d| acc.checked_mul(u64::from(*d)))
            .ok_or(INVALID_VALUE)?;
        // SAFETY: the kernels' documented parameters: (u64 out, u32 n[, u32 iters]).
        let (out, n) = unsafe { (param::<u64>(params, 0)?, param::<u32>(params, 1)?) };
        if threads < u64::from(n) {
            return Err(INVALID_VALUE);
        }
        let spec = s.gpus.get(g).cloned().ok_or(INVALID_CONTEXT)?;
        let mut ms = 0.01;
        let values: Vec<u32> = match kernel {
            Kernel::Index => (0..n)
                .map(|i| {
                    let v = i.wrapping_mul(3).wrapping_add(7);
                    if spec.fault == Fault::WrongResult && i == WRONG_ELEMENT.min(n - 1) {
                        v ^ 0x0100
                    } else {
                        v
                    }
                })
                .collect(),
            Kernel::Fma => {
                // SAFETY: gm_fma's third parameter is a u32.
                let iters = unsafe { param::<u32>(params, 2)? };
                let answer = s.fma(iters);
                ms += f64::from(n) * f64::from(iters) * 8.0 / (spec.gflops * 1e9) * 1e3;
                (0..n)
                    .map(|i| answer.get((i % 16) as usize).map_or(0, |v| v.to_bits()))
                    .collect()
            }
        };
        let (start, a) = s.find(out, u64::from(n) * 4).ok_or(700)?; // ILLEGAL_ADDRESS
        let off = usize::try_from(out - start).map_err(|_| INVALID_VALUE)?;
        for (k, v) in values.iter().enumerate() {
            if let Some(cell) = a.data.get_mut(off + 4 * k..off + 4 * k + 4) {
                cell.copy_from_slice(&v.to_ne_bytes());
            }
        }
        if spec.fault == Fault::Slow {
            ms *= 10.0;
        }
        if spec.fault == Fault::Hang {
            s.hang_pending = true;
        }
        if let Some(c) = s.clock_ms.get_mut(g) {
            *c += ms;
        }
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(e: *mut Handle, _flags: c_uint) -> CuResult {
    code(with(|s| {
        let h = s.handle();
        s.events.insert(h, None);
        // SAFETY: the common contract.
        unsafe { put(e, as_handle(h)) }
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventRecord(e: Handle, _stream: Handle) -> CuResult {
    code(with(|s| {
        let g = current(s)?;
        let now = s.clock_ms.get(g).copied().unwrap_or(0.0);
        let slot = s.events.get_mut(&(e as usize)).ok_or(INVALID_HANDLE)?;
        *slot = Some((g, now));
        Ok(())
    }))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(e: Handle) -> CuResult {
    let known = with(|s| {
        s.events
            .get(&(e as usize))
            .map(|_| ())
            .ok_or(INVALID_HANDLE)
    });
    match known {
        Ok(()) => wait_for_gpu(),
        Err(c) => c,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CuResult {
    code(with(|s| {
        let a = s.events.get(&(start as usize)).ok_or(INVALID_HANDLE)?;
        let b = s.events.get(&(end as usize)).ok_or(INVALID_HANDLE)?;
        match (a, b) {
            (Some((_, a)), Some((_, b))) => {
                // SAFETY: the common contract.
                unsafe { put(ms, (b - a) as f32) }
            }
            _ => Err(NOT_READY),
        }
    }))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: Handle,
    end: Handle,
) -> CuResult {
    // SAFETY: the same contract.
    unsafe { cuEventElapsedTime(ms, start, end) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(e: Handle) -> CuResult {
    code(with(|s| {
        s.events
            .remove(&(e as usize))
            .map(|_| ())
            .ok_or(INVALID_HANDLE)
    }))
}

/// The names and descriptions the fake knows.
fn error_text(code: CuResult) -> Option<(&'static CStr, &'static CStr)> {
    Some(match code {
        0 => (c"CUDA_SUCCESS", c"no error"),
        1 => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        2 => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        3 => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        100 => (
            c"CUDA_ERROR_NO_DEVICE",
            c"no CUDA-capable device is detected",
        ),
        101 => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        201 => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        218 => (c"CUDA_ERROR_INVALID_PTX", c"a PTX JIT compilation failed"),
        400 => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        500 => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        600 => (c"CUDA_ERROR_NOT_READY", c"device not ready"),
        700 => (
            c"CUDA_ERROR_ILLEGAL_ADDRESS",
            c"an illegal memory access was encountered",
        ),
        805 => (
            c"CUDA_ERROR_MPS_CONNECTION_FAILED",
            c"MPS client failed to connect to the MPS control daemon or the MPS server",
        ),
        807 => (
            c"CUDA_ERROR_MPS_SERVER_NOT_READY",
            c"the MPS server is not ready to accept new MPS client requests",
        ),
        999 => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
        _ => return None,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(code: CuResult, out: *mut *const c_char) -> CuResult {
    let found = error_text(code);
    // SAFETY: the common contract.
    let r = unsafe { put(out, found.map_or(std::ptr::null(), |(n, _)| n.as_ptr())) };
    match (r, found) {
        (Err(e), _) => e,
        (Ok(()), None) => INVALID_VALUE,
        (Ok(()), Some(_)) => SUCCESS,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(code: CuResult, out: *mut *const c_char) -> CuResult {
    let found = error_text(code);
    // SAFETY: the common contract.
    let r = unsafe { put(out, found.map_or(std::ptr::null(), |(_, t)| t.as_ptr())) };
    match (r, found) {
        (Err(e), _) => e,
        (Ok(()), None) => INVALID_VALUE,
        (Ok(()), Some(_)) => SUCCESS,
    }
}
