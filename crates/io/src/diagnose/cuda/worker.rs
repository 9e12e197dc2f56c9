//! The check's worker (`gpu-medic __cuda-worker`): loads the driver, runs the tests on each
//! GPU in turn and prints one [`Event`] per line on stdout. It knows nothing of deadlines:
//! the parent ([`super::run`]) kills it.
//!
//! Timing uses CUDA events on the default stream (what the GPU itself measured, not the
//! host's view of launch and synchronisation).

use std::ffi::{CStr, c_void};
use std::io::Write;
use std::time::Instant;

use super::ffi::{self, Api, CuDevice, CuError, HostBuf, Module};
use super::{Event, WorkerArgs, format_uuid};
use crate::model::diagnosis::{Level, TestResult, TestStatus, Tier};

/// The check's kernels, hand-written PTX (ISA 6.0, sm_52: every GPU a current driver runs,
/// JIT-compiled by the driver for the GPU at hand).
///
/// - `gm_index(out, n)`: `out[i] = i * 3 + 7` for `i < n` (a known answer per element).
/// - `gm_fma(out, n, iters)`: four independent chains per thread, each `x = x * A + B`
///   (fused, round-to-nearest) `iters` times from `x0 = (i % 16) / 16 + k / 4`, `k` = 0..3;
///   `out[i]` = the chains' sum `(x0 + x1) + (x2 + x3)`. `.rn` everywhere keeps ptxas from
///   contracting or reordering, so the host computes the same bits ([`fma_expected`]).
pub const PTX: &CStr = c"
.version 6.0
.target sm_52
.address_size 64

.visible .entry gm_index(
    .param .u64 gm_index_out,
    .param .u32 gm_index_n
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [gm_index_out];
    ld.param.u32 %r1, [gm_index_n];
    mov.u32 %r2, %ctaid.x;
    mov.u32 %r3, %ntid.x;
    mov.u32 %r4, %tid.x;
    mad.lo.u32 %r5, %r2, %r3, %r4;
    setp.ge.u32 %p1, %r5, %r1;
    @%p1 bra GM_INDEX_DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r5, 4;
    add.u64 %rd4, %rd2, %rd3;
    mul.lo.u32 %r6, %r5, 3;
    add.u32 %r7, %r6, 7;
    st.global.u32 [%rd4], %r7;
GM_INDEX_DONE:
    ret;
}

.visible .entry gm_fma(
    .param .u64 gm_fma_out,
    .param .u32 gm_fma_n,
    .param .u32 gm_fma_iters
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<12>;
    .reg .f32 %f<12>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [gm_fma_out];
    ld.param.u32 %r1, [gm_fma_n];
    ld.param.u32 %r2, [gm_fma_iters];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.u32 %r6, %r3, %r4, %r5;
    setp.ge.u32 %p1, %r6, %r1;
    @%p1 bra GM_FMA_DONE;
    and.b32 %r7, %r6, 15;
    cvt.rn.f32.u32 %f5, %r7;
    mul.rn.f32 %f1, %f5, 0f3D800000;
    add.rn.f32 %f2, %f1, 0f3E800000;
    add.rn.f32 %f3, %f1, 0f3F000000;
    add.rn.f32 %f4, %f1, 0f3F400000;
    mov.f32 %f9, 0f3F7FBE77;
    mov.f32 %f10, 0f3A83126F;
    mov.u32 %r8, 0;
GM_FMA_LOOP:
    setp.ge.u32 %p2, %r8, %r2;
    @%p2 bra GM_FMA_STORE;
    fma.rn.f32 %f1, %f1, %f9, %f10;
    fma.rn.f32 %f2, %f2, %f9, %f10;
    fma.rn.f32 %f3, %f3, %f9, %f10;
    fma.rn.f32 %f4, %f4, %f9, %f10;
    add.u32 %r8, %r8, 1;
    bra GM_FMA_LOOP;
GM_FMA_STORE:
    add.rn.f32 %f6, %f1, %f2;
    add.rn.f32 %f7, %f3, %f4;
    add.rn.f32 %f8, %f6, %f7;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r6, 4;
    add.u64 %rd4, %rd2, %rd3;
    st.global.f32 [%rd4], %f8;
GM_FMA_DONE:
    ret;
}
";

/// `A` and `B` of the FMA chains (0.999 and 0.001 as f32): the chains converge, never
/// overflow, and no value is subnormal.
const FMA_A: u32 = 0x3F7F_BE77;
const FMA_B: u32 = 0x3A83_126F;

/// `gm_index`'s answer at `i`.
pub fn index_expected(i: u32) -> u32 {
    i.wrapping_mul(3).wrapping_add(7)
}

/// `gm_fma`'s answer for thread `i` after `iters` iterations: 16 distinct values, by `i % 16`.
pub fn fma_expected(iters: u32) -> [f32; 16] {
    let a = f32::from_bits(FMA_A);
    let b = f32::from_bits(FMA_B);
    // The chains start at j / 16 for j = 0..28 (i % 16 plus 0, 4, 8, 12 sixteenths).
    let mut ends = [0f32; 28];
    for (j, end) in ends.iter_mut().enumerate() {
        let mut x = (j as f32) * 0.0625;
        for _ in 0..iters {
            x = x.mul_add(a, b);
        }
        *end = x;
    }
    let mut out = [0f32; 16];
    for (k, o) in out.iter_mut().enumerate() {
        let e = |m: usize| ends.get(k + 4 * m).copied().unwrap_or(f32::NAN);
        *o = (e(0) + e(1)) + (e(2) + e(3));
    }
    out
}

/// A pattern the memory test writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    Word(u32),
    /// Each word holds its own word offset in the region (low 32 bits): catches addressing
    /// faults (two addresses reaching one cell) that constant patterns cannot.
    AddressInWord,
}

impl Pattern {
    pub const ALL: [Pattern; 5] = [
        Pattern::Word(0x0000_0000),
        Pattern::Word(0xFFFF_FFFF),
        Pattern::Word(0xAAAA_AAAA),
        Pattern::Word(0x5555_5555),
        Pattern::AddressInWord,
    ];

    pub fn name(self) -> String {
        match self {
            Pattern::Word(w) => format!("0x{w:08X}"),
            Pattern::AddressInWord => "address-in-word".to_string(),
        }
    }

    /// The word at word offset `at` of the region.
    pub fn word(self, at: u64) -> u32 {
        match self {
            Pattern::Word(w) => w,
            Pattern::AddressInWord => at as u32,
        }
    }
}

/// Fills `buf` with `p` as it lies at word offset `first` of the region.
pub fn fill(buf: &mut [u32], p: Pattern, first: u64) {
    match p {
        Pattern::Word(w) => buf.fill(w),
        Pattern::AddressInWord => {
            for (j, x) in buf.iter_mut().enumerate() {
                *x = p.word(first + j as u64);
            }
        }
    }
}

/// The first wrong word of a chunk and how many were wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Miscompare {
    /// Word offset in the region.
    pub word: u64,
    pub expected: u32,
    pub got: u32,
    pub count: u64,
}

/// Checks `buf` (read back from word offset `first` of the region) against `p`.
pub fn verify(buf: &[u32], p: Pattern, first: u64) -> Option<Miscompare> {
    // The common case first, in a loop the compiler vectorises: every word right.
    let all_right = match p {
        Pattern::Word(w) => buf.iter().all(|&x| x == w),
        Pattern::AddressInWord => buf.iter().zip(first..).all(|(&x, at)| x == at as u32),
    };
    if all_right {
        return None;
    }
    let mut found: Option<Miscompare> = None;
    for (j, &got) in buf.iter().enumerate() {
        let at = first + j as u64;
        let expected = p.word(at);
        if got != expected {
            match &mut found {
                Some(m) => m.count += 1,
                None => {
                    found = Some(Miscompare {
                        word: at,
                        expected,
                        got,
                        count: 1,
                    })
                }
            }
        }
    }
    found
}

const MIB: u64 = 1024 * 1024;
const GIB: u64 = 1024 * MIB;
/// The host staging buffers (two of them) and the largest single copy.
const CHUNK: u64 = 64 * MIB;
/// The memory test never asks for less than this when halving after a refused allocation.
const MIN_REGION: u64 = 64 * MIB;

/// What a level does: share of free memory tested (percent) and its cap, copies per
/// direction timed, timed runs of the arithmetic kernel.
///
/// The memory test moves each byte tested ten times over PCIe (five patterns, each written
/// and read back) and fills and checks it ten times on the host, at roughly 10 GB/s on one
/// core: about 1.2 s per GiB tested. Quick's 2 GiB cap keeps it to a few seconds per GPU;
/// standard (up to 32 GiB) and long (up to 64 GiB) take minutes on an 8-GPU node and need a
/// deadline to match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizing {
    pub share_pct: u64,
    pub cap: u64,
    pub copies: u32,
    pub runs: u32,
}

pub fn sizing(level: Level) -> Sizing {
    match level {
        Level::Quick => Sizing {
            share_pct: 5,
            cap: 2 * GIB,
            copies: 4,
            runs: 2,
        },
        Level::Standard => Sizing {
            share_pct: 25,
            cap: 32 * GIB,
            copies: 8,
            runs: 5,
        },
        Level::Long => Sizing {
            share_pct: 50,
            cap: 64 * GIB,
            copies: 16,
            runs: 10,
        },
    }
}

/// Bytes of memory tested given `free` bytes: the level's share, capped, whole 4 KiB pages.
pub fn region_bytes(free: u64, level: Level) -> u64 {
    let s = sizing(level);
    let want = (free.saturating_mul(s.share_pct) / 100).min(s.cap);
    want / 4096 * 4096
}

/// Elements of the index kernel's answer (4 MiB).
const INDEX_N: u32 = 1 << 20;
/// Threads of the arithmetic kernel and its iterations: 2^20 threads x 2^16 iterations x 4
/// chains x 2 flops = 550 GFLOP, a few ms on an H200, ~100 ms on a T4.
const FMA_N: u32 = 1 << 20;
const FMA_ITERS: u32 = 1 << 16;
const BLOCK: u32 = 256;

fn emit(e: &Event) {
    if let Ok(s) = serde_json::to_string(e) {
        // stdout is line-buffered: each event reaches the parent as it happens. A parent
        // that went away is not the worker's concern (it is about to be killed).
        let _ = writeln!(std::io::stdout(), "{s}");
    }
}

fn ms_since(t: Instant) -> Option<u64> {
    Some(u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX))
}

fn result(test: &str, status: TestStatus, message: String, t: Instant) -> TestResult {
    TestResult {
        tier: Tier::Cuda,
        test: test.to_string(),
        status,
        message,
        duration_ms: ms_since(t),
        value: None,
        unit: String::new(),
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB as f64)
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes / MIB)
}

/// A listed GPU's handle and UUID, or why the driver cannot give them.
type Listed = Result<(CuDevice, String), CuError>;

/// Runs the check; always 0 (what it found is in the events).
pub fn worker_main(args: &WorkerArgs) -> i32 {
    if let Some((api, count)) = start_driver(args) {
        // Every GPU the driver lists: ordinal, handle and UUID (or why not).
        let listed: Vec<(u32, Listed)> = (0..count)
            .map(|o| {
                let id = api
                    .device(o)
                    .and_then(|d| api.device_uuid(d).map(|u| (d, format_uuid(&u))));
                (o, id)
            })
            .collect();
        let mut fma = None;
        for (asked, ordinal) in targets(args, &listed, count) {
            match ordinal {
                Some(ordinal) => one_gpu(&api, &listed, asked, ordinal, args, &mut fma),
                None => unlisted(asked, &listed),
            }
        }
    }
    emit(&Event::End);
    0
}

/// Loads the library and starts the driver; or says why the tier can tell nothing (or, as
/// an MPS client, that the daemon refused it).
fn start_driver(args: &WorkerArgs) -> Option<(Api, u32)> {
    let api = match Api::load(&args.library) {
        Ok(a) => a,
        Err(e) => {
            emit(&Event::Unusable { why: e.to_string() });
            return None;
        }
    };
    if let Err(e) = api.init() {
        emit(&if args.mps && ffi::is_mps_error(e.code) {
            Event::MpsRefused {
                why: format!("the CUDA driver cannot start as a client of the MPS daemon: {e}"),
            }
        } else {
            Event::Unusable {
                why: format!("the CUDA driver cannot start: {e}"),
            }
        });
        return None;
    }
    match api.device_count() {
        Ok(0) => {
            emit(&Event::Unusable {
                why: "the CUDA driver lists no GPU".to_string(),
            });
            None
        }
        Ok(n) => Some((api, n)),
        Err(e) => {
            emit(&Event::Unusable {
                why: format!("the CUDA driver cannot list GPUs: {e}"),
            });
            None
        }
    }
}

/// The GPUs to test: (the `--gpu` argument, the CUDA ordinal it names if the driver lists
/// it); every listed GPU when none was asked.
fn targets(
    args: &WorkerArgs,
    listed: &[(u32, Listed)],
    count: u32,
) -> Vec<(Option<String>, Option<u32>)> {
    if args.gpus.is_empty() {
        return listed.iter().map(|(o, _)| (None, Some(*o))).collect();
    }
    args.gpus
        .iter()
        .map(|a| {
            let by_uuid = listed.iter().find(|(_, id)| {
                id.as_ref()
                    .is_ok_and(|(_, u)| u.eq_ignore_ascii_case(a.trim()))
            });
            let ordinal = match by_uuid {
                Some((o, _)) => Some(*o),
                None => a.trim().parse::<u32>().ok().filter(|o| *o < count),
            };
            (Some(a.clone()), ordinal)
        })
        .collect()
}

/// A GPU asked for that the driver does not list: it fails `device`.
fn unlisted(asked: Option<String>, listed: &[(u32, Listed)]) {
    let shown = asked.clone().unwrap_or_default();
    emit(&Event::Device {
        asked,
        ordinal: None,
        uuid: if shown.starts_with("GPU-") {
            shown.clone()
        } else {
            String::new()
        },
        name: String::new(),
    });
    let uuids: Vec<String> = listed
        .iter()
        .filter_map(|(_, id)| id.as_ref().ok().map(|(_, u)| u.clone()))
        .collect();
    emit(&Event::Test {
        result: result(
            "device",
            TestStatus::Fail,
            format!(
                "the CUDA driver does not list {shown} (it lists {} GPU(s): {})",
                listed.len(),
                uuids.join(", ")
            ),
            Instant::now(),
        ),
    });
}

/// Announces the GPU at `ordinal` and tests it; a GPU the driver cannot open fails `device`.
fn one_gpu(
    api: &Api,
    listed: &[(u32, Listed)],
    asked: Option<String>,
    ordinal: u32,
    args: &WorkerArgs,
    fma: &mut Option<[f32; 16]>,
) {
    let t = Instant::now();
    let Some((_, id)) = listed.iter().find(|(o, _)| *o == ordinal) else {
        return;
    };
    let (dev, uuid) = match id {
        Ok(x) => x.clone(),
        Err(e) => {
            emit(&Event::Device {
                asked,
                ordinal: Some(ordinal),
                uuid: String::new(),
                name: String::new(),
            });
            emit(&Event::Test {
                result: result(
                    "device",
                    TestStatus::Fail,
                    format!("the CUDA driver cannot open ordinal {ordinal}: {e}"),
                    t,
                ),
            });
            return;
        }
    };
    let name = api.device_name(dev).unwrap_or_default();
    emit(&Event::Device {
        asked,
        ordinal: Some(ordinal),
        uuid,
        name: name.clone(),
    });
    test_gpu(api, dev, ordinal, &name, args, fma);
}

/// Runs `test`, announcing it first and printing its result.
fn step(test: &str, f: impl FnOnce(Instant) -> TestResult) -> TestStatus {
    emit(&Event::Begin {
        test: test.to_string(),
    });
    let r = f(Instant::now());
    let status = r.status;
    emit(&Event::Test { result: r });
    status
}

fn test_gpu(
    api: &Api,
    dev: CuDevice,
    ordinal: u32,
    name: &str,
    args: &WorkerArgs,
    fma: &mut Option<[f32; 16]>,
) {
    let ctx_test = if args.mps { "mps-client" } else { "context" };
    let mut ctx = None;
    step(ctx_test, |t| match api.context(dev) {
        Ok(c) => {
            ctx = Some(c);
            let total = api.device_total_mem(dev).unwrap_or(0) as u64;
            let free = api.mem_info().map(|(f, _)| f as u64).unwrap_or(0);
            let how = if args.mps {
                "MPS client context"
            } else {
                "context"
            };
            result(
                ctx_test,
                TestStatus::Pass,
                format!(
                    "{how} on {name} (CUDA ordinal {ordinal}); {} free of {}",
                    gib(free),
                    gib(total)
                ),
                t,
            )
        }
        Err(e) => {
            let why = if args.mps && ffi::is_mps_error(e.code) {
                format!("the MPS server cannot serve this GPU: {e}")
            } else {
                format!("cannot create a context: {e}")
            };
            result(ctx_test, TestStatus::Fail, why, t)
        }
    });
    let Some(ctx) = ctx else { return };
    let level = args.level;
    // Staging buffers no larger than the region the memory test will ask for.
    let free = api.mem_info().map(|(f, _)| f as u64).unwrap_or(0);
    let staging = CHUNK.min(region_bytes(free, level)).max(4096);
    let mut w = api.host(words(staging));
    let mut r = api.host(words(staging));
    step("memory", |t| memory(api, level, &mut w, &mut r, t));
    // The module once for both kernels. A JIT that refuses our PTX says nothing of the GPU.
    let module = api.module(PTX);
    step("kernel", |t| match &module {
        Ok(m) => kernel(api, m, t),
        Err(e) => refused("kernel", e, t),
    });
    step("bandwidth", |t| bandwidth(api, level, &mut w, &mut r, t));
    step("throughput", |t| match &module {
        Ok(m) => throughput(api, m, level, fma, t),
        Err(e) => refused("throughput", e, t),
    });
    // Releasing what the tests held can hang on a faulty GPU too: announced, so a timeout
    // here is charged to this GPU rather than to the next.
    emit(&Event::Begin {
        test: "teardown".to_string(),
    });
    drop(module);
    drop(w);
    drop(r);
    drop(ctx);
    emit(&Event::Released);
}

fn words(bytes: u64) -> usize {
    usize::try_from(bytes / 4).unwrap_or(usize::MAX)
}

fn refused(test: &str, e: &CuError, t: Instant) -> TestResult {
    if ffi::is_image_error(e.code) {
        result(
            test,
            TestStatus::Unknown,
            format!("the driver refused the check's kernel image: {e}"),
            t,
        )
    } else {
        result(
            test,
            TestStatus::Fail,
            format!("cannot load a module: {e}"),
            t,
        )
    }
}

/// Allocates `want` bytes, halving on refusal down to [`MIN_REGION`] (memory the MPS daemon's
/// limit or a task took since `cuMemGetInfo`).
fn alloc_halving(api: &Api, want: u64) -> Result<ffi::DeviceBuf<'_>, (u64, CuError)> {
    let floor = want.min(MIN_REGION);
    let mut size = want;
    loop {
        match api.alloc(usize::try_from(size).unwrap_or(usize::MAX)) {
            Ok(b) => return Ok(b),
            Err(e)
                if e.code == ffi::CUDA_ERROR_OUT_OF_MEMORY && size / 2 >= floor && size > floor =>
            {
                size = (size / 2) / 4096 * 4096;
            }
            Err(e) => return Err((size, e)),
        }
    }
}

fn memory(
    api: &Api,
    level: Level,
    w: &mut HostBuf<'_>,
    r: &mut HostBuf<'_>,
    t: Instant,
) -> TestResult {
    let fail = |m: String| result("memory", TestStatus::Fail, m, t);
    let free = match api.mem_info() {
        Ok((f, _)) => f as u64,
        Err(e) => return fail(format!("cannot read free memory: {e}")),
    };
    let want = region_bytes(free, level);
    if want == 0 {
        return result(
            "memory",
            TestStatus::Unknown,
            format!("too little free memory to test ({} free)", mib(free)),
            t,
        );
    }
    let region = match alloc_halving(api, want) {
        Ok(b) => b,
        Err((size, e)) => {
            return fail(format!(
                "cannot allocate {} of {} free: {e}",
                mib(size),
                mib(free)
            ));
        }
    };
    let bytes = region.bytes as u64;
    let staged = (w.as_mut_slice().len().min(r.as_mut_slice().len()) as u64) * 4;
    let chunk = staged.min(bytes);
    if chunk == 0 {
        return fail("no host staging buffer".into());
    }
    for p in Pattern::ALL {
        // Write the whole region, then read it all back: each cell holds its value while
        // the rest is written.
        let mut off = 0u64;
        while off < bytes {
            let len = words(chunk.min(bytes - off));
            let Some(buf) = w.as_mut_slice().get_mut(..len) else {
                return fail("host buffer too small".into());
            };
            fill(buf, p, off / 4);
            if let Err(e) = api.htod(region.ptr + off, buf) {
                return fail(format!("writing {} at offset 0x{off:x}: {e}", p.name()));
            }
            off += chunk;
        }
        let mut off = 0u64;
        while off < bytes {
            let len = words(chunk.min(bytes - off));
            let Some(buf) = r.as_mut_slice().get_mut(..len) else {
                return fail("host buffer too small".into());
            };
            if let Err(e) = api.dtoh(buf, region.ptr + off) {
                return fail(format!("reading {} at offset 0x{off:x}: {e}", p.name()));
            }
            if let Some(m) = verify(buf, p, off / 4) {
                return fail(format!(
                    "miscompare at offset 0x{:x} with pattern {}: wrote 0x{:08X}, read 0x{:08X} \
                     ({} wrong word(s) in the {} read there)",
                    m.word * 4,
                    p.name(),
                    m.expected,
                    m.got,
                    m.count,
                    mib(chunk)
                ));
            }
            off += chunk;
        }
    }
    result(
        "memory",
        TestStatus::Pass,
        format!(
            "{} of {} free written and verified with {} patterns",
            mib(bytes),
            mib(free),
            Pattern::ALL.len()
        ),
        t,
    )
}

/// Launches `f` over `n` threads with `params` and waits for it.
///
/// # Safety
/// As [`Api::launch`]: one pointer per kernel parameter, device buffers large enough.
unsafe fn launch_sync(
    api: &Api,
    f: ffi::Handle,
    n: u32,
    params: &mut [*mut c_void],
) -> Result<(), CuError> {
    let grid = n.div_ceil(BLOCK);
    // SAFETY: forwarded from this function's contract.
    unsafe { api.launch(f, grid, BLOCK, params) }?;
    api.synchronize()
}

/// A kernel of the module and a device buffer of `n` 32-bit words for it, or why not.
fn kernel_and_buffer<'a>(
    api: &'a Api,
    m: &Module<'_>,
    name: &std::ffi::CStr,
    n: u32,
) -> Result<(ffi::Handle, ffi::DeviceBuf<'a>), String> {
    let f = m
        .function(name)
        .map_err(|e| format!("cannot find the kernel: {e}"))?;
    let buf = api
        .alloc(n as usize * 4)
        .map_err(|e| format!("cannot allocate {}: {e}", mib(u64::from(n) * 4)))?;
    Ok((f, buf))
}

fn kernel(api: &Api, m: &Module<'_>, t: Instant) -> TestResult {
    let fail = |s: String| result("kernel", TestStatus::Fail, s, t);
    let n = INDEX_N;
    let (f, buf) = match kernel_and_buffer(api, m, c"gm_index", n) {
        Ok(x) => x,
        Err(why) => return fail(why),
    };
    let mut host = vec![0u32; n as usize];
    // Zeroed first: an answer left by an earlier run cannot pass for this one.
    if let Err(e) = api.htod(buf.ptr, &host) {
        return fail(format!("cannot clear the answer buffer: {e}"));
    }
    let mut out = buf.ptr;
    let mut count = n;
    let mut params = [
        (&raw mut out).cast::<c_void>(),
        (&raw mut count).cast::<c_void>(),
    ];
    // SAFETY: gm_index takes (u64 out, u32 n): `out` is a u64 device pointer to n u32 and
    // `count` a u32, both alive across the call.
    if let Err(e) = unsafe { launch_sync(api, f, n, &mut params) } {
        return fail(format!("the kernel failed: {e}"));
    }
    if let Err(e) = api.dtoh(&mut host, buf.ptr) {
        return fail(format!("cannot read the answer back: {e}"));
    }
    let mut wrong = host
        .iter()
        .enumerate()
        .filter(|(i, v)| **v != index_expected(*i as u32));
    if let Some((i, v)) = wrong.next() {
        let more = wrong.count();
        return fail(format!(
            "wrong answer at element {i}: expected {}, got {v} ({} wrong of {n})",
            index_expected(i as u32),
            more + 1
        ));
    }
    result(
        "kernel",
        TestStatus::Pass,
        format!("{n} elements computed and verified"),
        t,
    )
}

fn bandwidth(
    api: &Api,
    level: Level,
    w: &mut HostBuf<'_>,
    r: &mut HostBuf<'_>,
    t: Instant,
) -> TestResult {
    let fail = |s: String| result("bandwidth", TestStatus::Fail, s, t);
    let bytes = (w.as_mut_slice().len().min(r.as_mut_slice().len()) as u64) * 4;
    let buf = match api.alloc(bytes as usize) {
        Ok(b) => b,
        Err(e) => return fail(format!("cannot allocate {}: {e}", mib(bytes))),
    };
    let copies = sizing(level).copies;
    let pinned = w.pinned() && r.pinned();
    let (Some(src), Some(dst)) = (
        w.as_mut_slice().get_mut(..words(bytes)),
        r.as_mut_slice().get_mut(..words(bytes)),
    ) else {
        return fail("host buffer too small".into());
    };
    let timed = |dir: &str, f: &mut dyn FnMut() -> Result<(), CuError>| -> Result<f64, String> {
        let (a, b) = match (api.event(), api.event()) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Err(format!("cannot create an event: {e}")),
        };
        // One untimed copy first: the first touches page tables and DMA mappings.
        f().map_err(|e| format!("{dir}: {e}"))?;
        a.record().map_err(|e| e.to_string())?;
        for _ in 0..copies {
            f().map_err(|e| format!("{dir}: {e}"))?;
        }
        b.record().map_err(|e| e.to_string())?;
        let ms = b.since(&a).map_err(|e| e.to_string())?;
        let total = bytes as f64 * f64::from(copies);
        Ok(total / (f64::from(ms.max(1e-3)) * 1e6))
    };
    let h2d = timed("host to device", &mut || api.htod(buf.ptr, src));
    let d2h = timed("device to host", &mut || api.dtoh(dst, buf.ptr));
    let (h2d, d2h) = match (h2d, d2h) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return fail(e),
    };
    let mut r = result(
        "bandwidth",
        TestStatus::Pass,
        format!(
            "host to device {h2d:.1} GB/s, device to host {d2h:.1} GB/s ({} x {}, {} host memory)",
            copies,
            mib(bytes),
            if pinned { "page-locked" } else { "pageable" }
        ),
        t,
    );
    r.value = Some(h2d.min(d2h));
    r.unit = "GB/s".to_string();
    r
}

fn throughput(
    api: &Api,
    m: &Module<'_>,
    level: Level,
    fma: &mut Option<[f32; 16]>,
    t: Instant,
) -> TestResult {
    let fail = |s: String| result("throughput", TestStatus::Fail, s, t);
    let n = FMA_N;
    let (f, buf) = match kernel_and_buffer(api, m, c"gm_fma", n) {
        Ok(x) => x,
        Err(why) => return fail(why),
    };
    let mut out = buf.ptr;
    let mut count = n;
    let mut iters: u32 = 64;
    let mut launch = |iters_now: u32| -> Result<(), CuError> {
        iters = iters_now;
        let mut params = [
            (&raw mut out).cast::<c_void>(),
            (&raw mut count).cast::<c_void>(),
            (&raw mut iters).cast::<c_void>(),
        ];
        // SAFETY: gm_fma takes (u64 out, u32 n, u32 iters): `out` points to n f32 on the
        // device, `count` and `iters` are u32; all live across the call.
        unsafe { api.launch(f, n.div_ceil(BLOCK), BLOCK, &mut params) }
    };
    // Warm-up: JIT, clocks.
    if let Err(e) = launch(64).and_then(|()| api.synchronize()) {
        return fail(format!("the kernel failed: {e}"));
    }
    let (a, b) = match (api.event(), api.event()) {
        (Ok(a), Ok(b)) => (a, b),
        (Err(e), _) | (_, Err(e)) => return fail(format!("cannot create an event: {e}")),
    };
    let mut best = f32::INFINITY;
    for _ in 0..sizing(level).runs {
        let ms = a
            .record()
            .and_then(|()| launch(FMA_ITERS))
            .and_then(|()| b.record())
            .and_then(|()| b.since(&a));
        match ms {
            Ok(ms) => best = best.min(ms),
            Err(e) => return fail(format!("the kernel failed: {e}")),
        }
    }
    let mut host = vec![0u32; n as usize];
    if let Err(e) = api.dtoh(&mut host, buf.ptr) {
        return fail(format!("cannot read the answer back: {e}"));
    }
    // The same for every GPU: computed once per worker.
    let expected = *fma.get_or_insert_with(|| fma_expected(FMA_ITERS));
    if let Some((i, v)) = host
        .iter()
        .enumerate()
        .find(|(i, v)| expected.get(i % 16).is_none_or(|e| e.to_bits() != **v))
    {
        return fail(format!(
            "wrong arithmetic at element {i}: expected {}, got {}",
            expected.get(i % 16).copied().unwrap_or(f32::NAN),
            f32::from_bits(*v)
        ));
    }
    let flops = f64::from(n) * f64::from(FMA_ITERS) * 4.0 * 2.0;
    let gflops = flops / (f64::from(best.max(1e-3)) * 1e6);
    let mut r = result(
        "throughput",
        TestStatus::Pass,
        format!(
            "{gflops:.0} GFLOP/s FP32 FMA (best of {} runs of {:.1} GFLOP, {best:.2} ms), answer verified",
            sizing(level).runs,
            flops / 1e9
        ),
        t,
    );
    r.value = Some(gflops);
    r.unit = "GFLOP/s".to_string();
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_fill_and_verify() {
        let mut buf = vec![0u32; 1000];
        for p in Pattern::ALL {
            fill(&mut buf, p, 5000);
            assert_eq!(verify(&buf, p, 5000), None, "{p:?}");
        }
        fill(&mut buf, Pattern::AddressInWord, 5000);
        assert_eq!(buf[3], 5003);
        buf[10] ^= 1 << 7;
        buf[20] = 0;
        let m = verify(&buf, Pattern::AddressInWord, 5000).unwrap();
        assert_eq!(
            m,
            Miscompare {
                word: 5010,
                expected: 5010,
                got: 5010 ^ 0x80,
                count: 2
            }
        );
        // Verified as if from another offset: every word is wrong.
        assert_eq!(
            verify(&buf[..4], Pattern::AddressInWord, 0).unwrap().count,
            4
        );
        assert_eq!(Pattern::Word(0xAAAA_AAAA).name(), "0xAAAAAAAA");
    }

    #[test]
    fn the_share_of_memory_per_level() {
        let free = 140 * GIB;
        assert_eq!(region_bytes(free, Level::Quick), 2 * GIB);
        assert_eq!(region_bytes(20 * GIB, Level::Quick), GIB);
        assert_eq!(region_bytes(free, Level::Standard), 32 * GIB);
        assert_eq!(region_bytes(free, Level::Long), 64 * GIB);
        assert_eq!(region_bytes(256 * MIB, Level::Quick) % 4096, 0);
        assert_eq!(region_bytes(1000, Level::Quick), 0);
    }

    #[test]
    fn the_kernels_answers() {
        assert_eq!(index_expected(0), 7);
        assert_eq!(index_expected(10), 37);
        let e = fma_expected(0);
        // No iteration: the sum of the four starts, i/16 * 4 + 1.5.
        assert_eq!(e[0], 1.5);
        assert_eq!(e[4], 2.5);
        let e = fma_expected(1 << 12);
        // The chains converge to B / (1 - A) = 1: the sum approaches 4.
        assert!(e.iter().all(|v| (v - 4.0).abs() < 0.1), "{e:?}");
        assert!(PTX.to_bytes().windows(7).any(|w| w == b".target"));
    }
}
