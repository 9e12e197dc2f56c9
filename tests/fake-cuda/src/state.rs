//! The simulated driver's state: one per process, behind a mutex, made at `cuInit`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard};

use crate::config::{self, Gpu};

pub type CuResult = i32;
pub const SUCCESS: CuResult = 0;
pub const INVALID_VALUE: CuResult = 1;
pub const OUT_OF_MEMORY: CuResult = 2;
pub const NOT_INITIALIZED: CuResult = 3;
pub const NO_DEVICE: CuResult = 100;
pub const INVALID_DEVICE: CuResult = 101;
pub const INVALID_CONTEXT: CuResult = 201;
pub const INVALID_HANDLE: CuResult = 400;
pub const NOT_FOUND: CuResult = 500;
pub const NOT_READY: CuResult = 600;
pub const MPS_CONNECTION_FAILED: CuResult = 805;
pub const UNKNOWN: CuResult = 999;

/// A kernel the fake knows how to "run".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Index,
    Fma,
}

pub struct Alloc {
    pub gpu: usize,
    pub data: Vec<u8>,
}

pub struct State {
    pub gpus: Vec<Gpu>,
    /// Bytes allocated per GPU.
    pub used: Vec<u64>,
    /// The simulated clock per GPU, in milliseconds.
    pub clock_ms: Vec<f64>,
    /// The next free device address per GPU (addresses are never reused).
    pub next: Vec<u64>,
    pub allocs: BTreeMap<u64, Alloc>,
    pub contexts: HashMap<usize, usize>,
    pub current: Option<usize>,
    pub modules: HashMap<usize, Vec<String>>,
    pub functions: HashMap<usize, Kernel>,
    /// Event handle → (GPU, simulated time) once recorded.
    pub events: HashMap<usize, Option<(usize, f64)>>,
    pub hosts: HashMap<usize, std::alloc::Layout>,
    pub next_handle: usize,
    /// A kernel was launched on a GPU whose fault is `hang`.
    pub hang_pending: bool,
    pub fma_cache: HashMap<u32, [f32; 16]>,
}

pub static STATE: Mutex<Option<State>> = Mutex::new(None);

/// Where GPU `g`'s device addresses start (1 TiB apart, never 0).
pub fn base(g: usize) -> u64 {
    0x7000_0000_0000 + ((g as u64) << 40)
}

impl State {
    pub fn new(gpus: Vec<Gpu>) -> State {
        let n = gpus.len();
        State {
            gpus,
            used: vec![0; n],
            clock_ms: vec![0.0; n],
            next: (0..n).map(base).collect(),
            allocs: BTreeMap::new(),
            contexts: HashMap::new(),
            current: None,
            modules: HashMap::new(),
            functions: HashMap::new(),
            events: HashMap::new(),
            hosts: HashMap::new(),
            next_handle: 0x1000,
            hang_pending: false,
            fma_cache: HashMap::new(),
        }
    }

    pub fn handle(&mut self) -> usize {
        self.next_handle += 0x10;
        self.next_handle
    }

    /// The allocation holding `[ptr, ptr + len)`: its start and itself.
    pub fn find(&mut self, ptr: u64, len: u64) -> Option<(u64, &mut Alloc)> {
        let (start, a) = self.allocs.range_mut(..=ptr).next_back()?;
        let end = start.checked_add(a.data.len() as u64)?;
        if ptr.checked_add(len)? <= end {
            Some((*start, a))
        } else {
            None
        }
    }

    /// Advances GPU `g`'s clock by `bytes` copied.
    pub fn copy_time(&mut self, g: usize, bytes: u64) {
        let Some(spec) = self.gpus.get(g) else { return };
        let mut ms = bytes as f64 / (spec.copy_gbps * 1e9) * 1e3;
        if spec.fault == config::Fault::Slow {
            ms *= 10.0;
        }
        if let Some(c) = self.clock_ms.get_mut(g) {
            *c += ms;
        }
    }

    pub fn fma(&mut self, iters: u32) -> [f32; 16] {
        *self
            .fma_cache
            .entry(iters)
            .or_insert_with(|| config::fma_answer(iters))
    }
}

/// The state, initialised; NOT_INITIALIZED before `cuInit`, UNKNOWN if poisoned.
pub fn with<T>(f: impl FnOnce(&mut State) -> Result<T, CuResult>) -> Result<T, CuResult> {
    let mut g: MutexGuard<'_, Option<State>> = STATE.lock().map_err(|_| UNKNOWN)?;
    match g.as_mut() {
        Some(s) => f(s),
        None => Err(NOT_INITIALIZED),
    }
}

/// Reads the configuration and (re)initialises; the error `cuInit` returns.
pub fn init() -> CuResult {
    if let Some(code) = std::env::var("FAKE_CUDA_INIT_ERROR")
        .ok()
        .and_then(|v| v.trim().parse::<i32>().ok())
        .filter(|c| *c != 0)
    {
        return code;
    }
    let text = match std::env::var_os("FAKE_CUDA_CONFIG").filter(|p| !p.is_empty()) {
        Some(p) => match std::fs::read_to_string(&p) {
            Ok(t) => Some(t),
            Err(e) => {
                eprintln!("fake-cuda: cannot read {}: {e}", p.to_string_lossy());
                return INVALID_VALUE;
            }
        },
        None => None,
    };
    let gpus = match config::parse(text.as_deref()) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("fake-cuda: {e}");
            return INVALID_VALUE;
        }
    };
    if gpus.is_empty() {
        return NO_DEVICE;
    }
    let Ok(mut g) = STATE.lock() else {
        return UNKNOWN;
    };
    if g.is_none() {
        *g = Some(State::new(gpus));
    }
    SUCCESS
}

/// Never returns: what a hung GPU does to the thread that waits for it. First starts a helper
/// process (as the driver's own threads and helpers would outlive a plain kill of the
/// waiting thread) and writes both pids to `FAKE_CUDA_PID_FILE`, if set.
pub fn hang() -> ! {
    let helper = std::process::Command::new("sleep")
        .arg("3600")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok();
    if let Some(path) = std::env::var_os("FAKE_CUDA_PID_FILE") {
        let mut text = format!("worker {}\n", std::process::id());
        if let Some(h) = &helper {
            text.push_str(&format!("helper {}\n", h.id()));
        }
        let _ = std::fs::write(path, text);
    }
    loop {
        std::thread::sleep(std::time::Duration::from_secs(3600));
    }
}
