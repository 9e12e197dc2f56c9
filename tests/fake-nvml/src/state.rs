//! Global fake-GPU state: scenario (from the environment), per-GPU health,
//! event sets, the control-file cursor and the watcher thread.
//!
//! Everything lives behind one `Mutex<Global>`; every event set has its own
//! condvar, all used with that one mutex, so there is a single lock and no
//! lock-ordering hazard.

use std::collections::{BTreeMap, VecDeque};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::command::{self, Command, GpuSel};
use crate::identity::Arch;
use crate::types::{self, NvmlDevice, NvmlReturn, event_type as ev};

/// Most GPUs a scenario may have.
pub const MAX_GPUS: usize = 64;
/// Default `FAKE_NVML_GPUS`.
pub const DEFAULT_GPUS: u32 = 4;
/// Default `FAKE_NVML_DRIVER_VERSION`.
pub const DEFAULT_DRIVER_VERSION: &str = "570.172.08";
/// Control-file poll interval of the watcher thread.
pub const CONTROL_POLL: Duration = Duration::from_millis(20);
/// Events kept per GPU while nobody has registered for them.
const BACKLOG_CAP: usize = 64;
/// Event types that are kept in the backlog when no set is registered for them.
pub const BACKLOG_TYPES: u64 = ev::DOUBLE_BIT_ECC_ERROR
    | ev::XID_CRITICAL_ERROR
    | ev::DRAM_RETIREMENT_FAILURE
    | ev::FATAL_POISON_ERROR
    | ev::GPU_UNAVAILABLE_ERROR
    | ev::GPU_RECOVERY_ACTION;

/// Backing storage for device handles: `nvmlDevice_t` for GPU `i` is the
/// address of `DEVICE_TAGS[i]`, stable for the life of the process.
static DEVICE_TAGS: [u64; MAX_GPUS] = [0; MAX_GPUS];

/// The stable `nvmlDevice_t` of GPU `index` (`index < MAX_GPUS`).
pub fn device_handle(index: u32) -> NvmlDevice {
    let i = (index as usize).min(MAX_GPUS - 1);
    (&raw const DEVICE_TAGS[i]).cast_mut().cast()
}

/// Maps a device handle back to its GPU index.
pub fn device_index(dev: NvmlDevice) -> Option<u32> {
    let base = DEVICE_TAGS.as_ptr() as usize;
    let size = std::mem::size_of::<u64>();
    let off = (dev as usize).checked_sub(base)?;
    if off % size != 0 || off / size >= MAX_GPUS {
        return None;
    }
    u32::try_from(off / size).ok()
}

/// One queued event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub gpu: u32,
    pub event_type: u64,
    pub data: u64,
}

/// Health state of one GPU.
#[derive(Clone, Debug)]
pub struct Gpu {
    pub lost: bool,
    pub temp_c: u32,
    pub throttle: u64,
    /// `[errorType][counterType]`: CORRECTED=0/UNCORRECTED=1 x VOLATILE=0/AGGREGATE=1.
    pub ecc: [[u64; 2]; 2],
    pub remap_corr: u32,
    pub remap_unc: u32,
    pub remap_pending: bool,
    pub remap_failure: bool,
    /// Retired pages by cause: MULTIPLE_SINGLE_BIT_ECC_ERRORS=0, DOUBLE_BIT_ECC_ERROR=1.
    pub retired: [u32; 2],
    pub retired_pending: bool,
    pub retired_ts: u64,
    pub recovery_action: u32,
    pub procs: Vec<u32>,
    pub compute_mode: u32,
    pub pcie_replay: u32,
    pub pcie_gen: u32,
    pub pcie_width: u32,
    /// Events raised while no set was registered for them (see README).
    pub backlog: VecDeque<Event>,
}

impl Gpu {
    fn healthy(arch: Arch) -> Gpu {
        Gpu {
            lost: false,
            temp_c: 34,
            throttle: 0x1,
            ecc: [[0; 2]; 2],
            remap_corr: 0,
            remap_unc: 0,
            remap_pending: false,
            remap_failure: false,
            retired: [0; 2],
            retired_pending: false,
            retired_ts: 0,
            recovery_action: 0,
            procs: Vec::new(),
            compute_mode: 0,
            pcie_replay: 0,
            pcie_gen: arch.pcie_gen(),
            pcie_width: 16,
            backlog: VecDeque::new(),
        }
    }

    /// Row-remapper histogram derived from the remap state.
    pub fn histogram(&self, arch: Arch) -> types::RowRemapperHistogram {
        let mut h = types::RowRemapperHistogram {
            max: arch.remap_banks(),
            ..Default::default()
        };
        let used = self.remap_corr.saturating_add(self.remap_unc).min(h.max);
        h.max -= used;
        h.high += used;
        if self.remap_failure {
            if h.max > 0 {
                h.max -= 1;
            } else {
                h.high = h.high.saturating_sub(1);
            }
            h.none += 1;
        }
        h
    }

    /// Retired pages of `cause` as (address, timestamp).
    pub fn retired_pages(&self, gpu: u32, cause: usize) -> Vec<(u64, u64)> {
        let n = self.retired.get(cause).copied().unwrap_or(0);
        (0..u64::from(n))
            .map(|k| {
                let addr = (u64::from(gpu) << 32) | ((cause as u64 + 1) << 28) | (k << 12);
                (addr, self.retired_ts)
            })
            .collect()
    }
}

/// The scenario read from the environment at `nvmlInit`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    pub gpus: u32,
    pub arch: Arch,
    pub driver_version: String,
    pub script: Option<String>,
    pub control: Option<PathBuf>,
    pub backlog: bool,
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Scenario {
    pub fn from_env() -> Scenario {
        let gpus = match env_nonempty("FAKE_NVML_GPUS").map(|v| v.trim().parse::<u32>()) {
            None => DEFAULT_GPUS,
            Some(Ok(n)) if n as usize <= MAX_GPUS => n,
            Some(Ok(n)) => {
                eprintln!("fake-nvml: FAKE_NVML_GPUS={n} is above {MAX_GPUS}; using {MAX_GPUS}");
                MAX_GPUS as u32
            }
            Some(Err(_)) => {
                eprintln!("fake-nvml: FAKE_NVML_GPUS is not a number; using {DEFAULT_GPUS}");
                DEFAULT_GPUS
            }
        };
        let arch = match env_nonempty("FAKE_NVML_ARCH") {
            None => Arch::Hopper,
            Some(v) => Arch::parse(&v).unwrap_or_else(|| {
                eprintln!("fake-nvml: unknown FAKE_NVML_ARCH {v:?}; using hopper");
                Arch::Hopper
            }),
        };
        let driver_version = env_nonempty("FAKE_NVML_DRIVER_VERSION")
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| DEFAULT_DRIVER_VERSION.to_string());
        let backlog = !matches!(
            env_nonempty("FAKE_NVML_EVENT_BACKLOG")
                .map(|v| v.trim().to_ascii_lowercase())
                .as_deref(),
            Some("0" | "false" | "off" | "no")
        );
        Scenario {
            gpus,
            arch,
            driver_version,
            script: env_nonempty("FAKE_NVML_SCRIPT"),
            control: env_nonempty("FAKE_NVML_CONTROL").map(PathBuf::from),
            backlog,
        }
    }
}

/// `FAKE_NVML_INIT_ERROR`, if set to a non-zero number.
fn env_init_error() -> Option<NvmlReturn> {
    let v = env_nonempty("FAKE_NVML_INIT_ERROR")?;
    match v.trim().parse::<NvmlReturn>() {
        Ok(0) => None,
        Ok(code) => Some(code),
        Err(_) => {
            eprintln!("fake-nvml: FAKE_NVML_INIT_ERROR={v:?} is not a number; ignored");
            None
        }
    }
}

/// A `fail` rule: `function` on `gpu` returns `code`, `remaining` more times
/// (`None`: until `unfail`/`reset`).
#[derive(Clone, Debug)]
struct FailRule {
    function: String,
    gpu: GpuSel,
    code: NvmlReturn,
    remaining: Option<u32>,
}

/// Simulated hardware; persists across `nvmlShutdown`/`nvmlInit` while the
/// scenario environment is unchanged (like real GPUs).
#[derive(Debug)]
pub struct Hardware {
    pub scenario: Option<Scenario>,
    pub arch: Arch,
    pub driver_version: String,
    pub gpus: Vec<Gpu>,
    /// What `nvmlDeviceGetCount_v2` reports (`count N`).
    pub visible: u32,
    pub unknown_once: bool,
    fails: Vec<FailRule>,
}

impl Hardware {
    const fn empty() -> Hardware {
        Hardware {
            scenario: None,
            arch: Arch::Hopper,
            driver_version: String::new(),
            gpus: Vec::new(),
            visible: 0,
            unknown_once: false,
            fails: Vec::new(),
        }
    }

    fn build(s: &Scenario) -> Hardware {
        Hardware {
            scenario: Some(s.clone()),
            arch: s.arch,
            driver_version: s.driver_version.clone(),
            gpus: (0..s.gpus).map(|_| Gpu::healthy(s.arch)).collect(),
            visible: s.gpus,
            unknown_once: false,
            fails: Vec::new(),
        }
    }

    fn reset(&mut self) {
        let arch = self.arch;
        for g in &mut self.gpus {
            *g = Gpu::healthy(arch);
        }
        self.visible = self.gpus.len() as u32;
        self.unknown_once = false;
        self.fails.clear();
    }

    /// Major driver version (570 for "570.172.08").
    pub fn driver_major(&self) -> u32 {
        let digits: String = self
            .driver_version
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().unwrap_or(0)
    }

    /// `nvmlSystemGetNVMLVersion`.
    pub fn nvml_version(&self) -> String {
        let api = if self.driver_major() >= 580 { 13 } else { 12 };
        format!("{api}.{}", self.driver_version)
    }

    /// `nvmlSystemGetCudaDriverVersion(_v2)`.
    pub fn cuda_version(&self) -> i32 {
        match self.driver_major() {
            580.. => 13000,
            575.. => 12090,
            570.. => 12080,
            560.. => 12060,
            550.. => 12040,
            535.. => 12020,
            _ => 12000,
        }
    }

    /// Event types `nvmlDeviceGetSupportedEventTypes` reports.
    pub fn supported_events(&self) -> u64 {
        let mut m = ev::SINGLE_BIT_ECC_ERROR
            | ev::DOUBLE_BIT_ECC_ERROR
            | ev::PSTATE
            | ev::XID_CRITICAL_ERROR
            | ev::CLOCK;
        if self.arch.mig_capable() {
            m |= ev::MIG_CONFIG_CHANGE;
        }
        if self.driver_major() >= 570 {
            m |= ev::GPU_RECOVERY_ACTION;
        }
        m
    }

    /// Whether field 230 / the recovery-action event exist (driver 570+).
    pub fn has_recovery_action(&self) -> bool {
        self.driver_major() >= 570
    }

    /// Consumes a matching `fail` rule, if any.
    fn take_failure(&mut self, function: &str, gpu: Option<usize>) -> Option<NvmlReturn> {
        let pos = self.fails.iter().position(|r| {
            r.function == function
                && match (r.gpu, gpu) {
                    (GpuSel::Any, _) => true,
                    (GpuSel::One(want), Some(have)) => want as usize == have,
                    (GpuSel::One(_), None) => false,
                }
        })?;
        let code = self.fails[pos].code;
        if let Some(n) = self.fails[pos].remaining.as_mut() {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.fails.remove(pos);
            }
        }
        Some(code)
    }
}

/// One event set: FIFO, registrations and its condvar.
#[derive(Debug)]
pub struct EventSetState {
    queue: VecDeque<Event>,
    /// GPU index -> registered event-type mask.
    regs: BTreeMap<u32, u64>,
    cv: Arc<Condvar>,
}

/// Reads appended lines from the control file.
#[derive(Debug)]
struct ControlCursor {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
    file_id: Option<(u64, u64)>,
}

impl ControlCursor {
    fn new(path: PathBuf) -> ControlCursor {
        ControlCursor {
            path,
            offset: 0,
            partial: Vec::new(),
            file_id: None,
        }
    }

    /// Complete lines appended since the last call. A replaced (new inode) or
    /// truncated file is read again from the start.
    fn read_lines(&mut self) -> Vec<String> {
        let Ok(mut file) = File::open(&self.path) else {
            return Vec::new();
        };
        let Ok(meta) = file.metadata() else {
            return Vec::new();
        };
        let id = (meta.dev(), meta.ino());
        if self.file_id != Some(id) || meta.len() < self.offset {
            self.file_id = Some(id);
            self.offset = 0;
            self.partial.clear();
        }
        if meta.len() == self.offset {
            return Vec::new();
        }
        let mut buf = Vec::new();
        if file.seek(SeekFrom::Start(self.offset)).is_err() || file.read_to_end(&mut buf).is_err() {
            return Vec::new();
        }
        self.offset += buf.len() as u64;
        self.partial.extend_from_slice(&buf);
        let Some(last_nl) = self.partial.iter().rposition(|&b| b == b'\n') else {
            return Vec::new();
        };
        let rest = self.partial.split_off(last_nl + 1);
        let complete = std::mem::replace(&mut self.partial, rest);
        String::from_utf8_lossy(&complete)
            .lines()
            .map(str::to_string)
            .collect()
    }
}

/// Everything behind the global lock.
#[derive(Debug)]
pub struct Global {
    pub init_count: u32,
    pub hw: Hardware,
    sets: BTreeMap<usize, EventSetState>,
    next_set: usize,
    control: Option<ControlCursor>,
    watcher_gen: u64,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    init_count: 0,
    hw: Hardware::empty(),
    sets: BTreeMap::new(),
    next_set: 1,
    control: None,
    watcher_gen: 0,
});

/// Locks the global state without reading the control file. A panic while
/// the lock was held cannot leave the state torn in a way that matters for a
/// test double, so poisoning is ignored.
fn lock_raw() -> MutexGuard<'static, Global> {
    GLOBAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Locks the global state and applies control-file lines appended so far, so
/// any NVML call made after a line was written observes it.
pub fn lock() -> MutexGuard<'static, Global> {
    let mut g = lock_raw();
    if g.init_count > 0 {
        g.sync_control();
    }
    g
}

/// Runs `f` on the initialised state (UNINITIALIZED otherwise).
pub fn with_global<R>(
    f: impl FnOnce(&mut Global) -> Result<R, NvmlReturn>,
) -> Result<R, NvmlReturn> {
    let mut g = lock();
    if g.init_count == 0 {
        return Err(types::ERROR_UNINITIALIZED);
    }
    f(&mut g)
}

/// Runs a system-scoped function `name`: init check, then `fail` rules.
pub fn system_call<R>(
    name: &str,
    f: impl FnOnce(&mut Global) -> Result<R, NvmlReturn>,
) -> Result<R, NvmlReturn> {
    with_global(|g| {
        if let Some(code) = g.hw.take_failure(name, None) {
            return Err(code);
        }
        f(g)
    })
}

/// Runs a device-scoped function `name` on `dev`: init check, handle check,
/// `fail` rules, lost GPU; then `f` with the GPU index.
pub fn device_call<R>(
    name: &str,
    dev: NvmlDevice,
    f: impl FnOnce(&mut Global, usize) -> Result<R, NvmlReturn>,
) -> Result<R, NvmlReturn> {
    with_global(|g| {
        let idx = device_index(dev)
            .map(|i| i as usize)
            .filter(|&i| i < g.hw.gpus.len())
            .ok_or(types::ERROR_INVALID_ARGUMENT)?;
        g.check_gpu(name, idx)?;
        f(g, idx)
    })
}

/// `nvmlInit_v2` / `nvmlInitWithFlags`.
pub fn init() -> NvmlReturn {
    if let Some(code) = env_init_error() {
        return code;
    }
    let scenario = Scenario::from_env();
    let mut g = lock_raw();
    g.init_count += 1;
    if g.init_count > 1 {
        return types::SUCCESS;
    }
    if g.control.as_ref().map(|c| &c.path) != scenario.control.as_ref() {
        g.control = scenario.control.clone().map(ControlCursor::new);
    }
    if g.hw.scenario.as_ref() != Some(&scenario) {
        g.hw = Hardware::build(&scenario);
        if let Some(script) = &scenario.script {
            for line in script.split(';') {
                g.apply_line(line, "FAKE_NVML_SCRIPT");
            }
        }
    }
    g.sync_control();
    g.watcher_gen += 1;
    if g.control.is_some() {
        let generation = g.watcher_gen;
        let spawned = std::thread::Builder::new()
            .name("fake-nvml-control".into())
            .spawn(move || watch_control(generation));
        if let Err(e) = spawned {
            eprintln!("fake-nvml: cannot start the control-file watcher: {e}");
        }
    }
    types::SUCCESS
}

/// `nvmlShutdown`: the last one drops all event sets and stops the watcher.
pub fn shutdown() -> NvmlReturn {
    let mut g = lock_raw();
    if g.init_count == 0 {
        return types::ERROR_UNINITIALIZED;
    }
    g.init_count -= 1;
    if g.init_count == 0 {
        for set in g.sets.values() {
            set.cv.notify_all();
        }
        g.sets.clear();
        g.watcher_gen += 1;
    }
    types::SUCCESS
}

/// Watcher thread body: polls the control file until its generation ends.
fn watch_control(generation: u64) {
    loop {
        std::thread::sleep(CONTROL_POLL);
        let mut g = lock_raw();
        if g.watcher_gen != generation || g.init_count == 0 {
            return;
        }
        g.sync_control();
    }
}

/// Applies one command line from outside any NVML session (`fakenvml_command`).
pub fn apply_external(line: &str) -> NvmlReturn {
    let mut g = lock();
    if g.hw.scenario.is_none() {
        return types::ERROR_UNINITIALIZED;
    }
    match command::parse(line) {
        Ok(None) => types::SUCCESS,
        Ok(Some(cmd)) => match g.apply(cmd) {
            Ok(()) => types::SUCCESS,
            Err(e) => {
                eprintln!("fake-nvml: ignoring command {line:?}: {e}");
                types::ERROR_INVALID_ARGUMENT
            }
        },
        Err(e) => {
            eprintln!("fake-nvml: ignoring command {line:?}: {e}");
            types::ERROR_INVALID_ARGUMENT
        }
    }
}

/// Blocks up to `timeout_ms` for an event on set `id`.
pub fn wait_event(id: usize, timeout_ms: u32) -> Result<Event, NvmlReturn> {
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    let mut guard = lock();
    loop {
        let g: &mut Global = &mut guard;
        if g.init_count == 0 {
            return Err(types::ERROR_UNINITIALIZED);
        }
        if let Some(code) = g.hw.take_failure("nvmlEventSetWait_v2", None) {
            return Err(code);
        }
        if g.hw.unknown_once {
            g.hw.unknown_once = false;
            return Err(types::ERROR_UNKNOWN);
        }
        let Some(set) = g.sets.get_mut(&id) else {
            return Err(types::ERROR_INVALID_ARGUMENT);
        };
        if let Some(event) = set.queue.pop_front() {
            return Ok(event);
        }
        let gpus = &g.hw.gpus;
        if set
            .regs
            .keys()
            .any(|&i| gpus.get(i as usize).is_some_and(|gpu| gpu.lost))
        {
            return Err(types::ERROR_GPU_IS_LOST);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(types::ERROR_TIMEOUT);
        }
        let cv = Arc::clone(&set.cv);
        guard = cv
            .wait_timeout(guard, deadline - now)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Microseconds since the epoch (field-value timestamps).
pub fn now_micros() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

impl Global {
    /// `fail` rules, then the lost flag, for GPU `idx`.
    pub fn check_gpu(&mut self, name: &str, idx: usize) -> Result<(), NvmlReturn> {
        if let Some(code) = self.hw.take_failure(name, Some(idx)) {
            return Err(code);
        }
        if self.hw.gpus.get(idx).is_none_or(|g| g.lost) {
            return Err(types::ERROR_GPU_IS_LOST);
        }
        Ok(())
    }

    fn sync_control(&mut self) {
        let lines = match self.control.as_mut() {
            Some(c) => c.read_lines(),
            None => return,
        };
        for line in lines {
            self.apply_line(&line, "control file");
        }
    }

    fn apply_line(&mut self, line: &str, source: &str) {
        let result = command::parse(line).and_then(|cmd| match cmd {
            Some(cmd) => self.apply(cmd),
            None => Ok(()),
        });
        if let Err(e) = result {
            eprintln!("fake-nvml: ignoring {source} line {:?}: {e}", line.trim());
        }
    }

    fn notify_all_sets(&self) {
        for set in self.sets.values() {
            set.cv.notify_all();
        }
    }

    /// Queues an event on every set registered for it; otherwise keeps
    /// critical events in the GPU's backlog.
    fn raise(&mut self, gpu: u32, event_type: u64, data: u64) {
        let event = Event {
            gpu,
            event_type,
            data,
        };
        let mut delivered = false;
        for set in self.sets.values_mut() {
            if set.regs.get(&gpu).is_some_and(|m| m & event_type != 0) {
                set.queue.push_back(event);
                set.cv.notify_all();
                delivered = true;
            }
        }
        let backlog_on = self.hw.scenario.as_ref().is_some_and(|s| s.backlog);
        if !delivered
            && backlog_on
            && event_type & BACKLOG_TYPES != 0
            && let Some(g) = self.hw.gpus.get_mut(gpu as usize)
        {
            if g.backlog.len() >= BACKLOG_CAP {
                g.backlog.pop_front();
            }
            g.backlog.push_back(event);
        }
    }

    /// `nvmlEventSetCreate`.
    pub fn create_set(&mut self) -> usize {
        let id = self.next_set;
        self.next_set += 1;
        self.sets.insert(
            id,
            EventSetState {
                queue: VecDeque::new(),
                regs: BTreeMap::new(),
                cv: Arc::new(Condvar::new()),
            },
        );
        id
    }

    /// `nvmlEventSetFree`.
    pub fn free_set(&mut self, id: usize) -> Result<(), NvmlReturn> {
        let set = self.sets.remove(&id).ok_or(types::ERROR_INVALID_ARGUMENT)?;
        set.cv.notify_all();
        Ok(())
    }

    /// `nvmlDeviceRegisterEvents`: all-or-nothing like NVML; hands over any
    /// backlogged events that match.
    pub fn register(&mut self, id: usize, gpu: usize, mask: u64) -> Result<(), NvmlReturn> {
        if mask & !self.hw.supported_events() != 0 {
            return Err(types::ERROR_NOT_SUPPORTED);
        }
        let set = self
            .sets
            .get_mut(&id)
            .ok_or(types::ERROR_INVALID_ARGUMENT)?;
        *set.regs.entry(gpu as u32).or_default() |= mask;
        if let Some(g) = self.hw.gpus.get_mut(gpu) {
            let (matching, rest): (VecDeque<Event>, VecDeque<Event>) =
                g.backlog.drain(..).partition(|e| e.event_type & mask != 0);
            g.backlog = rest;
            if !matching.is_empty() {
                set.queue.extend(matching);
                set.cv.notify_all();
            }
        }
        Ok(())
    }

    /// Applies one injection command.
    pub fn apply(&mut self, cmd: Command) -> Result<(), String> {
        let n = self.hw.gpus.len();
        let check = |gpu: u32| -> Result<usize, String> {
            let i = gpu as usize;
            if i < n {
                Ok(i)
            } else {
                Err(format!("GPU {gpu} out of range (scenario has {n})"))
            }
        };
        match cmd {
            Command::Xid { gpu, code } => {
                check(gpu)?;
                self.raise(gpu, ev::XID_CRITICAL_ERROR, code);
            }
            Command::EccDbe { gpu } => {
                let g = &mut self.hw.gpus[check(gpu)?];
                for c in &mut g.ecc[1] {
                    *c = c.saturating_add(1);
                }
                self.raise(gpu, ev::DOUBLE_BIT_ECC_ERROR, 0);
            }
            Command::EccSbe { gpu, n } => {
                let g = &mut self.hw.gpus[check(gpu)?];
                for c in &mut g.ecc[0] {
                    *c = c.saturating_add(n);
                }
                self.raise(gpu, ev::SINGLE_BIT_ECC_ERROR, 0);
            }
            Command::Lost { gpu } => {
                self.hw.gpus[check(gpu)?].lost = true;
                self.notify_all_sets();
            }
            Command::Unknown => {
                self.hw.unknown_once = true;
                self.notify_all_sets();
            }
            Command::RemapPending { gpu } => self.hw.gpus[check(gpu)?].remap_pending = true,
            Command::RemapFailure { gpu } => self.hw.gpus[check(gpu)?].remap_failure = true,
            Command::Remap { gpu, corr, unc } => {
                let g = &mut self.hw.gpus[check(gpu)?];
                g.remap_corr = corr;
                g.remap_unc = unc;
            }
            Command::RetiredPending { gpu } => self.hw.gpus[check(gpu)?].retired_pending = true,
            Command::Retired { gpu, sbe, dbe } => {
                let g = &mut self.hw.gpus[check(gpu)?];
                g.retired = [sbe, dbe];
                g.retired_ts = now_secs();
            }
            Command::Recovery { gpu, action } => {
                self.hw.gpus[check(gpu)?].recovery_action = action;
                self.raise(gpu, ev::GPU_RECOVERY_ACTION, u64::from(action));
            }
            Command::Temp { gpu, celsius } => self.hw.gpus[check(gpu)?].temp_c = celsius,
            Command::Throttle { gpu, mask } => self.hw.gpus[check(gpu)?].throttle = mask,
            Command::MpsProcs { gpu, pids } => self.hw.gpus[check(gpu)?].procs = pids,
            Command::Count { n: want } => {
                if want as usize > n {
                    self.hw.visible = n as u32;
                    return Err(format!("count {want} is above the {n} GPUs; using {n}"));
                }
                self.hw.visible = want;
            }
            Command::Reset => self.hw.reset(),
            Command::Event {
                gpu,
                event_type,
                data,
            } => {
                check(gpu)?;
                self.raise(gpu, event_type, data);
            }
            Command::PcieReplay { gpu, n } => self.hw.gpus[check(gpu)?].pcie_replay = n,
            Command::PcieLink {
                gpu,
                generation,
                width,
            } => {
                let g = &mut self.hw.gpus[check(gpu)?];
                g.pcie_gen = generation;
                g.pcie_width = width;
            }
            Command::ComputeMode { gpu, mode } => {
                if mode > 3 {
                    return Err(format!("compute mode {mode} is not 0..=3"));
                }
                self.hw.gpus[check(gpu)?].compute_mode = mode;
            }
            Command::Fail {
                function,
                gpu,
                code,
                times,
            } => {
                if let GpuSel::One(i) = gpu {
                    check(i)?;
                }
                self.hw
                    .fails
                    .retain(|r| !(r.function == function && r.gpu == gpu));
                if times != Some(0) {
                    self.hw.fails.push(FailRule {
                        function,
                        gpu,
                        code,
                        remaining: times,
                    });
                }
            }
            Command::Unfail { function, gpu } => self
                .hw
                .fails
                .retain(|r| !(r.function == function && r.gpu == gpu)),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_handles_round_trip() {
        for i in 0..MAX_GPUS as u32 {
            assert_eq!(device_index(device_handle(i)), Some(i));
        }
        assert_eq!(device_index(std::ptr::null_mut()), None);
        let odd = (device_handle(1) as usize + 1) as NvmlDevice;
        assert_eq!(device_index(odd), None);
    }

    #[test]
    fn histogram_model() {
        let mut g = Gpu::healthy(Arch::Ampere);
        assert_eq!(
            g.histogram(Arch::Ampere),
            types::RowRemapperHistogram {
                max: 640,
                ..Default::default()
            }
        );
        g.remap_corr = 2;
        g.remap_unc = 1;
        g.remap_failure = true;
        let h = g.histogram(Arch::Ampere);
        assert_eq!((h.max, h.high, h.none), (636, 3, 1));
    }

    #[test]
    fn control_cursor_reads_appended_complete_lines() {
        use std::io::Write;
        let dir = std::env::temp_dir().join(format!("fake-nvml-cursor-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ctl");
        let mut f = File::create(&path).unwrap();
        let mut c = ControlCursor::new(path.clone());
        assert!(c.read_lines().is_empty());
        write!(f, "xid 0 79\nlost").unwrap();
        assert_eq!(c.read_lines(), ["xid 0 79"]);
        writeln!(f, " 1").unwrap();
        assert_eq!(c.read_lines(), ["lost 1"]);
        assert!(c.read_lines().is_empty());
        // Truncation restarts at the beginning.
        let mut f = File::create(&path).unwrap();
        writeln!(f, "reset").unwrap();
        assert_eq!(c.read_lines(), ["reset"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
