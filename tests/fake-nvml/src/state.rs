//! Global fake-GPU state: the configuration (`FAKE_NVML_CONFIG`), per-GPU
//! health, event sets, the injection directory (`FAKE_NVML_INJECT_DIR`) and
//! the watcher thread that polls it.
//!
//! Everything lives behind one `Mutex<Global>`; every event set has its own
//! condvar, all used with that one mutex, so there is a single lock and no
//! lock-ordering hazard.

use std::collections::{BTreeMap, HashSet, VecDeque};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::config::{self, Config, ConfigKey, GpuSpec, MAX_GPUS};
pub use crate::identity::Fabric;
use crate::inject::{self, Command, GpuSel};
use crate::types::{self, NvmlDevice, NvmlReturn, event_type as ev};

/// Environment variable naming the injection directory.
pub const INJECT_DIR_ENV: &str = "FAKE_NVML_INJECT_DIR";
/// Environment variable making `nvmlInit` fail with that `nvmlReturn_t`.
pub const INIT_ERROR_ENV: &str = "FAKE_NVML_INIT_ERROR";
/// Injection-directory poll interval of the watcher thread.
pub const INJECT_POLL: Duration = Duration::from_millis(2);
/// A `*.json` file that ends mid-document is retried for this long (from
/// its mtime) before it is declared bad: it may still be being written.
pub const TRUNCATED_GRACE: Duration = Duration::from_secs(1);
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
    /// Identity and capabilities from the configuration (kept by `reset`).
    pub spec: GpuSpec,
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
    /// MPS clients: pid and the GPU memory it uses in MiB (None: NOT_AVAILABLE).
    pub procs: Vec<(u32, Option<u64>)>,
    /// Processes in the plain compute list only (`compute_processes`): CUDA processes that
    /// run outside MPS, beside the clients.
    pub compute_only: Vec<(u32, Option<u64>)>,
    pub compute_mode: u32,
    pub pcie_replay: u32,
    pub pcie_gen: u32,
    pub pcie_width: u32,
    /// `nvmlDeviceGetPersistenceMode` (enabled by default).
    pub persistence: bool,
    /// Fabric registration: state (`fabric_state`), status, clique id, cluster UUID.
    pub fabric: Fabric,
    /// Per NVLink: down (`nvmlDeviceGetNvLinkState` disabled) and the five error counters
    /// (DL_REPLAY, DL_RECOVERY, DL_CRC_FLIT, DL_CRC_DATA, DL_ECC_DATA).
    pub nvlinks: Vec<NvLink>,
    /// Events raised while no set was registered for them (see README).
    pub backlog: VecDeque<Event>,
}

/// One NVLink.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NvLink {
    pub down: bool,
    pub counters: [u64; 5],
}

impl Gpu {
    /// The GPU as its specification starts it: the architecture's defaults, or what a dump
    /// (`FAKE_NVML_PROFILE`) showed.
    fn healthy(spec: GpuSpec) -> Gpu {
        Gpu {
            lost: false,
            temp_c: 34,
            throttle: spec.clock_reasons,
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
            compute_only: Vec::new(),
            compute_mode: 0,
            pcie_replay: spec.pcie_replay,
            pcie_gen: spec.pcie_now.0,
            pcie_width: spec.pcie_now.1,
            persistence: spec.persistence,
            fabric: spec.fabric,
            nvlinks: vec![NvLink::default(); spec.nvlinks as usize],
            backlog: VecDeque::new(),
            spec,
        }
    }

    /// Row-remapper histogram derived from the remap state.
    pub fn histogram(&self) -> types::RowRemapperHistogram {
        let mut h = types::RowRemapperHistogram {
            max: self.spec.remap_banks,
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

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `FAKE_NVML_INIT_ERROR`, if set to a non-zero number.
fn env_init_error() -> Option<NvmlReturn> {
    let v = env_nonempty(INIT_ERROR_ENV)?;
    match v.trim().parse::<NvmlReturn>() {
        Ok(0) => None,
        Ok(code) => Some(code),
        Err(_) => {
            eprintln!("fake-nvml: {INIT_ERROR_ENV}={v:?} is not a number; ignored");
            None
        }
    }
}

/// A `fail` rule: `function` on `gpu` returns `code`, `remaining` more times
/// (`None`: until removed or `reset`).
#[derive(Clone, Debug)]
struct FailRule {
    function: String,
    gpu: GpuSel,
    code: NvmlReturn,
    remaining: Option<u32>,
}

/// Simulated hardware; persists across `nvmlShutdown`/`nvmlInit` while the
/// configuration (path and content) is unchanged, like real GPUs.
#[derive(Debug)]
pub struct Hardware {
    pub key: Option<ConfigKey>,
    pub driver_version: String,
    pub event_backlog: bool,
    pub gpus: Vec<Gpu>,
    /// What `nvmlDeviceGetCount_v2` reports (`count`).
    pub visible: u32,
    pub unknown_once: bool,
    fails: Vec<FailRule>,
}

impl Hardware {
    const fn empty() -> Hardware {
        Hardware {
            key: None,
            driver_version: String::new(),
            event_backlog: true,
            gpus: Vec::new(),
            visible: 0,
            unknown_once: false,
            fails: Vec::new(),
        }
    }

    fn build(key: ConfigKey, config: Config) -> Hardware {
        let visible = config.gpus.len() as u32;
        Hardware {
            key: Some(key),
            driver_version: config.driver_version,
            event_backlog: config.event_backlog,
            gpus: config.gpus.into_iter().map(Gpu::healthy).collect(),
            visible,
            unknown_once: false,
            fails: Vec::new(),
        }
    }

    fn reset(&mut self) {
        for g in &mut self.gpus {
            *g = Gpu::healthy(g.spec.clone());
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

    /// Event types `nvmlDeviceGetSupportedEventTypes` reports for GPU `i`.
    pub fn supported_events(&self, i: usize) -> u64 {
        let Some(spec) = self.gpus.get(i).map(|g| &g.spec) else {
            return 0;
        };
        let mut m = ev::PSTATE | ev::XID_CRITICAL_ERROR | ev::CLOCK;
        if spec.ecc {
            m |= ev::SINGLE_BIT_ECC_ERROR | ev::DOUBLE_BIT_ECC_ERROR;
        }
        if spec.mig.is_some() {
            m |= ev::MIG_CONFIG_CHANGE;
        }
        if self.has_recovery_action() {
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

/// One `*.json` file found in the injection directory.
#[derive(Debug)]
pub struct InjectFile {
    pub path: PathBuf,
    /// Parsed commands, or why the file is bad.
    pub result: Result<Vec<Command>, String>,
    id: (u64, u64),
}

/// The injection directory: `*.json` files, taken in name order, each applied
/// and then deleted (bad ones renamed to `*.json.bad`).
#[derive(Debug)]
pub struct InjectDir {
    pub path: PathBuf,
    /// (dev, inode) of files that could be neither deleted nor renamed, so
    /// they are not applied again.
    stuck: HashSet<(u64, u64)>,
    /// (dev, inode) of the configuration file, never taken as an injection.
    config_id: Option<(u64, u64)>,
}

impl InjectDir {
    pub fn new(path: PathBuf) -> InjectDir {
        InjectDir {
            path,
            stuck: HashSet::new(),
            config_id: None,
        }
    }

    /// Reads and parses the `*.json` files present now, in name order. A
    /// missing directory is empty. A file that ends mid-document and was
    /// modified within [`TRUNCATED_GRACE`] is left for a later call.
    pub fn collect(&self) -> Vec<InjectFile> {
        let Ok(entries) = std::fs::read_dir(&self.path) else {
            return Vec::new();
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".json") && !n.starts_with('.'))
            .collect();
        names.sort();
        let mut out = Vec::new();
        for name in names {
            let path = self.path.join(&name);
            let Ok(meta) = std::fs::metadata(&path) else {
                continue;
            };
            let id = (meta.dev(), meta.ino());
            if !meta.is_file() || self.stuck.contains(&id) || self.config_id == Some(id) {
                continue;
            }
            let text = match std::fs::read_to_string(&path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => {
                    out.push(InjectFile {
                        path,
                        result: Err(e.to_string()),
                        id,
                    });
                    continue;
                }
            };
            let result = match serde_json::from_str::<serde_json::Value>(&text) {
                Ok(v) => inject::from_value(v),
                Err(e) => {
                    let young = meta
                        .modified()
                        .ok()
                        .and_then(|m| m.elapsed().ok())
                        .is_none_or(|age| age < TRUNCATED_GRACE);
                    if e.is_eof() && young {
                        continue;
                    }
                    Err(e.to_string())
                }
            };
            out.push(InjectFile { path, result, id });
        }
        out
    }

    /// Removes an applied file, or renames a bad one to `*.bad` after
    /// reporting `error` on stderr.
    pub fn finish(&mut self, file: &InjectFile, error: Option<&str>) {
        let gone = |r: std::io::Result<()>| match r {
            Ok(()) => true,
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        let path = &file.path;
        match error {
            None => {
                if !gone(std::fs::remove_file(path)) {
                    eprintln!(
                        "fake-nvml: cannot delete applied injection file {}; \
                         it will not be applied again",
                        path.display()
                    );
                    self.stuck.insert(file.id);
                }
            }
            Some(e) => {
                let mut bad = path.clone().into_os_string();
                bad.push(".bad");
                let bad = PathBuf::from(bad);
                if gone(std::fs::rename(path, &bad)) {
                    eprintln!(
                        "fake-nvml: bad injection file {} (renamed to {}): {e}",
                        path.display(),
                        bad.display()
                    );
                } else if gone(std::fs::remove_file(path)) {
                    eprintln!(
                        "fake-nvml: bad injection file {} (deleted): {e}",
                        path.display()
                    );
                } else {
                    eprintln!(
                        "fake-nvml: bad injection file {} (ignored): {e}",
                        path.display()
                    );
                    self.stuck.insert(file.id);
                }
            }
        }
    }
}

/// Everything behind the global lock.
#[derive(Debug)]
pub struct Global {
    pub init_count: u32,
    pub hw: Hardware,
    sets: BTreeMap<usize, EventSetState>,
    next_set: usize,
    inject: Option<InjectDir>,
    watcher_gen: u64,
}

static GLOBAL: Mutex<Global> = Mutex::new(Global {
    init_count: 0,
    hw: Hardware::empty(),
    sets: BTreeMap::new(),
    next_set: 1,
    inject: None,
    watcher_gen: 0,
});

/// Locks the global state without looking at the injection directory. A
/// panic while the lock was held cannot leave the state torn in a way that
/// matters for a test double, so poisoning is ignored.
fn lock_raw() -> MutexGuard<'static, Global> {
    GLOBAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Locks the global state and applies the injection files present, so any
/// NVML call made after a file was renamed into place observes it.
pub fn lock() -> MutexGuard<'static, Global> {
    let mut g = lock_raw();
    if g.init_count > 0 {
        g.sync_inject();
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
    let mut g = lock_raw();
    if g.init_count > 0 {
        g.init_count += 1;
        return types::SUCCESS;
    }
    let (key, config) = match config::load_from_env() {
        Ok(loaded) => loaded,
        Err(e) => {
            eprintln!("fake-nvml: nvmlInit fails with NVML_ERROR_UNKNOWN: {e}");
            return types::ERROR_UNKNOWN;
        }
    };
    if g.hw.key.as_ref() != Some(&key) {
        g.hw = Hardware::build(key, config);
    }
    let inject_path = env_nonempty(INJECT_DIR_ENV).map(PathBuf::from);
    if g.inject.as_ref().map(|d| &d.path) != inject_path.as_ref() {
        g.inject = inject_path.map(InjectDir::new);
    }
    let config_id =
        g.hw.key
            .as_ref()
            .and_then(|k| k.path.as_ref())
            .and_then(|p| std::fs::metadata(p).ok())
            .map(|m| (m.dev(), m.ino()));
    if let Some(dir) = g.inject.as_mut() {
        dir.config_id = config_id;
    }
    g.init_count = 1;
    g.sync_inject();
    g.watcher_gen += 1;
    if g.inject.is_some() {
        let generation = g.watcher_gen;
        let spawned = std::thread::Builder::new()
            .name("fake-nvml-inject".into())
            .spawn(move || watch_inject(generation));
        if let Err(e) = spawned {
            eprintln!("fake-nvml: cannot start the injection-directory watcher: {e}");
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

/// Watcher thread body: polls the injection directory until its generation ends.
fn watch_inject(generation: u64) {
    loop {
        std::thread::sleep(INJECT_POLL);
        let mut g = lock_raw();
        if g.watcher_gen != generation || g.init_count == 0 {
            return;
        }
        g.sync_inject();
    }
}

/// Blocks up to `timeout_ms` for an event on set `id`.
pub fn wait_event(id: usize, timeout_ms: u32) -> Result<Event, NvmlReturn> {
    let deadline = Instant::now() + Duration::from_millis(u64::from(timeout_ms));
    // Events already queued are returned as a driver returns them, without a look at the
    // injection directory per call (a directory scan per event made reading a storm of
    // 50,000 cost this library 15 us an event); with none queued, the files present are
    // applied first. The watcher thread applies new files meanwhile either way.
    let mut guard = lock_raw();
    if guard.init_count > 0 && guard.sets.get(&id).is_none_or(|s| s.queue.is_empty()) {
        guard.sync_inject();
    }
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

    /// Applies (then deletes) the injection files present, in name order.
    fn sync_inject(&mut self) {
        let Some(mut dir) = self.inject.take() else {
            return;
        };
        for file in dir.collect() {
            let checked = match &file.result {
                Ok(cmds) => self.validate(cmds),
                Err(e) => Err(e.clone()),
            };
            match checked {
                Ok(()) => {
                    for cmd in file.result.iter().flatten() {
                        self.apply(cmd.clone());
                    }
                    dir.finish(&file, None);
                }
                Err(e) => dir.finish(&file, Some(&e)),
            }
        }
        self.inject = Some(dir);
    }

    /// Checks GPU indices and `count` against the configuration, so a file
    /// is applied entirely or not at all.
    pub fn validate(&self, cmds: &[Command]) -> Result<(), String> {
        let n = self.hw.gpus.len();
        for cmd in cmds {
            if let Some(gpu) = cmd.gpu()
                && gpu as usize >= n
            {
                return Err(format!(
                    "GPU {gpu} out of range (the configuration has {n})"
                ));
            }
            if let Command::Count { n: want } = cmd
                && *want as usize > n
            {
                return Err(format!("count {want} is above the {n} configured GPUs"));
            }
        }
        Ok(())
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
        if !delivered
            && self.hw.event_backlog
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
        if mask & !self.hw.supported_events(gpu) != 0 {
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

    /// Applies one command whose GPU index passed [`Global::validate`].
    pub fn apply(&mut self, cmd: Command) {
        let gpu_idx = cmd.gpu().map_or(0, |i| i as usize);
        if cmd.gpu().is_some() && gpu_idx >= self.hw.gpus.len() {
            return;
        }
        match cmd {
            Command::Reset => self.hw.reset(),
            Command::Count { n } => self.hw.visible = n.min(self.hw.gpus.len() as u32),
            Command::ComputeMode { mode, .. } => self.hw.gpus[gpu_idx].compute_mode = mode,
            Command::Temp { celsius, .. } => self.hw.gpus[gpu_idx].temp_c = celsius,
            Command::Throttle { mask, .. } => self.hw.gpus[gpu_idx].throttle = mask,
            Command::PcieReplay { n, .. } => self.hw.gpus[gpu_idx].pcie_replay = n,
            Command::PcieLink {
                generation, width, ..
            } => {
                let g = &mut self.hw.gpus[gpu_idx];
                g.pcie_gen = generation.unwrap_or(g.pcie_gen);
                g.pcie_width = width.unwrap_or(g.pcie_width);
            }
            Command::Persistence { on, .. } => self.hw.gpus[gpu_idx].persistence = on,
            Command::Fabric { fabric, .. } => {
                let f = &mut self.hw.gpus[gpu_idx].fabric;
                f.state = fabric.state.unwrap_or(f.state);
                f.status = fabric.status.unwrap_or(f.status);
                f.clique_id = fabric.clique_id.unwrap_or(f.clique_id);
                f.cluster_uuid = fabric.cluster_uuid.unwrap_or(f.cluster_uuid);
            }
            Command::NvLink { link, change, .. } => {
                let links = &mut self.hw.gpus[gpu_idx].nvlinks;
                let selected: Vec<usize> = match link {
                    Some(l) => vec![l as usize],
                    None => (0..links.len()).collect(),
                };
                for l in selected {
                    let Some(nl) = links.get_mut(l) else { continue };
                    if let Some(active) = change.active {
                        nl.down = !active;
                    }
                    for (c, d) in nl.counters.iter_mut().zip(change.counters) {
                        *c = c.saturating_add(d);
                    }
                }
            }
            Command::MpsClients { pids, .. } => {
                self.hw.gpus[gpu_idx].procs =
                    pids.into_iter().map(|c| (c.pid, c.used_mib)).collect()
            }
            Command::ComputeProcesses { pids, .. } => {
                self.hw.gpus[gpu_idx].compute_only =
                    pids.into_iter().map(|c| (c.pid, c.used_mib)).collect()
            }
            Command::Ecc { gpu, delta } => {
                let ecc = &mut self.hw.gpus[gpu_idx].ecc;
                let add = |c: &mut u64, d: u64| *c = c.saturating_add(d);
                add(&mut ecc[0][0], delta.corrected_volatile);
                add(&mut ecc[0][1], delta.corrected_aggregate);
                add(&mut ecc[1][0], delta.uncorrected_volatile);
                add(&mut ecc[1][1], delta.uncorrected_aggregate);
                if delta.uncorrected_volatile > 0 {
                    self.raise(gpu, ev::DOUBLE_BIT_ECC_ERROR, 0);
                }
                if delta.corrected_volatile > 0 {
                    self.raise(gpu, ev::SINGLE_BIT_ECC_ERROR, 0);
                }
            }
            Command::RemappedRows { rows, .. } => {
                let g = &mut self.hw.gpus[gpu_idx];
                g.remap_corr = rows.correctable.unwrap_or(g.remap_corr);
                g.remap_unc = rows.uncorrectable.unwrap_or(g.remap_unc);
                g.remap_pending = rows.pending.unwrap_or(g.remap_pending);
                g.remap_failure = rows.failure.unwrap_or(g.remap_failure);
            }
            Command::RetiredPages { sbe, dbe, .. } => {
                let g = &mut self.hw.gpus[gpu_idx];
                g.retired[0] = sbe.unwrap_or(g.retired[0]);
                g.retired[1] = dbe.unwrap_or(g.retired[1]);
                g.retired_ts = now_secs();
            }
            Command::RetiredPending { pending, .. } => {
                self.hw.gpus[gpu_idx].retired_pending = pending;
            }
            Command::Fail {
                function,
                gpu,
                code,
                times,
            } => {
                self.hw
                    .fails
                    .retain(|r| !(r.function == function && r.gpu == gpu));
                self.hw.fails.push(FailRule {
                    function,
                    gpu,
                    code,
                    remaining: times,
                });
            }
            Command::Unfail { function, gpu } => self
                .hw
                .fails
                .retain(|r| !(r.function == function && r.gpu == gpu)),
            Command::Recovery { gpu, action } => {
                self.hw.gpus[gpu_idx].recovery_action = action;
                self.raise(gpu, ev::GPU_RECOVERY_ACTION, u64::from(action));
            }
            Command::Xid { gpu, code, message } => {
                self.raise(gpu, ev::XID_CRITICAL_ERROR, code);
                // The real driver also prints every XID to the kernel log; its text is the
                // only place some XIDs (NVLink5) say how bad they are.
                if let Some(path) = env_nonempty(KMSG_ENV) {
                    let pci = self.hw.gpus[gpu_idx].spec.pci;
                    kmsg_append(&PathBuf::from(path), pci, code, message.as_deref());
                }
            }
            Command::Event {
                gpu,
                event_type,
                data,
            } => self.raise(gpu, event_type, data),
            Command::Unknown => {
                self.hw.unknown_once = true;
                self.notify_all_sets();
            }
            Command::Lost { lost, .. } => {
                self.hw.gpus[gpu_idx].lost = lost;
                self.notify_all_sets();
            }
        }
    }
}

/// `FAKE_NVML_POLLS`: a file the fake appends one line (the calling process's pid) to at every
/// `nvmlDeviceGetCount_v2`, the first call of each of gpu-medic's NVML polls, so a test can wait
/// for "polled N more times since" instead of sleeping. Read at each call. Unset: nothing.
pub const POLLS_ENV: &str = "FAKE_NVML_POLLS";

/// Counts one `nvmlDeviceGetCount_v2` call in `FAKE_NVML_POLLS`, if set.
pub fn count_poll() {
    let Some(path) = env_nonempty(POLLS_ENV) else {
        return;
    };
    let line = format!("{}\n", std::process::id());
    if let Err(e) = append(Path::new(&path), &line) {
        eprintln!("fake-nvml: {POLLS_ENV}={path}: {e}");
    }
}

/// Appends `text` to the file at `path` (created if missing) in one `write`: in append mode,
/// lines from concurrent writers never interleave.
fn append(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
}

/// `FAKE_NVML_CALLS`: a file the fake appends the name of each NVML function to the first time
/// this process calls it, whatever the call returns, so a test can list the NVML functions a
/// program calls (tests/real_nvml.rs looks each up in NVIDIA's real library). Read at each
/// call of a function not listed yet. Unset: nothing is written.
pub const CALLS_ENV: &str = "FAKE_NVML_CALLS";

/// The functions already written to `FAKE_NVML_CALLS` by this process.
static CALLED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());

/// Notes a call of the exported function `name` (every one calls this first) in
/// `FAKE_NVML_CALLS`, once per process and name.
pub fn called(name: &'static str) {
    let mut seen = CALLED.lock().unwrap_or_else(PoisonError::into_inner);
    if seen.contains(&name) {
        return;
    }
    let Some(path) = env_nonempty(CALLS_ENV) else {
        return;
    };
    match append(Path::new(&path), &format!("{name}\n")) {
        Ok(()) => seen.push(name),
        Err(e) => eprintln!("fake-nvml: {CALLS_ENV}={path}: {e}"),
    }
}

/// `FAKE_NVML_KMSG`: a file the fake appends the driver's `NVRM: Xid` line to for every
/// injected XID, in `/dev/kmsg` record form (`prio,seq,usec,flags;message`).
pub const KMSG_ENV: &str = "FAKE_NVML_KMSG";

/// Appends one kernel log record for an XID, as the driver prints it:
/// `NVRM: Xid (PCI:0000:1b:00): 149, <message>`. Without a message the text is a generic one
/// with the `pid=`/`name=` fields of an application XID.
fn kmsg_append(
    path: &std::path::Path,
    pci: (u32, u32, u32, u32),
    code: u64,
    message: Option<&str>,
) {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // The kernel stamps a record in microseconds since boot.
    let usec = std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0, |secs| (secs * 1e6) as u64);
    let text = message.map_or_else(
        || format!("pid='<unknown>', name=<unknown>, fake-nvml injected Xid {code}"),
        str::to_string,
    );
    let line = format!(
        "4,{seq},{usec},-;NVRM: Xid (PCI:{:04x}:{:02x}:{:02x}): {code}, {text}\n",
        pci.0, pci.1, pci.2
    );
    if let Err(e) = append(path, &line) {
        eprintln!("fake-nvml: {KMSG_ENV}={}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Arch;
    use std::path::Path;

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
        let mut g = Gpu::healthy(GpuSpec::with_arch(0, Arch::Ampere));
        assert_eq!(
            g.histogram(),
            types::RowRemapperHistogram {
                max: 640,
                ..Default::default()
            }
        );
        g.remap_corr = 2;
        g.remap_unc = 1;
        g.remap_failure = true;
        let h = g.histogram();
        assert_eq!((h.max, h.high, h.none), (636, 3, 1));
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fake-nvml-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn inject_dir_takes_json_files_in_name_order() {
        let dir = scratch("inject-order");
        let mut d = InjectDir::new(dir.clone());
        assert!(d.collect().is_empty());
        std::fs::write(dir.join("b.json"), r#"{"gpu": 1, "xid": 48}"#).unwrap();
        std::fs::write(dir.join("a.json"), r#"{"gpu": 0, "xid": 79}"#).unwrap();
        std::fs::write(dir.join("c.json.tmp"), r#"{"gpu": 0, "xid": 1}"#).unwrap();
        std::fs::write(dir.join("d.json"), r#"{"gpu": 0, "bogus": 1}"#).unwrap();
        std::fs::write(dir.join("e.json"), "{\"gpu\": 0, ").unwrap();
        let files = d.collect();
        let got: Vec<_> = files
            .iter()
            .map(|f| {
                (
                    f.path.file_name().unwrap().to_str().unwrap().to_string(),
                    f.result.is_ok(),
                )
            })
            .collect();
        // e.json ends mid-document and is fresh: left for later.
        assert_eq!(
            got,
            [
                ("a.json".to_string(), true),
                ("b.json".to_string(), true),
                ("d.json".to_string(), false)
            ]
        );
        assert_eq!(
            files[0].result.as_ref().unwrap(),
            &[Command::Xid {
                gpu: 0,
                code: 79,
                message: None
            }]
        );
        for f in &files {
            let err = f.result.as_ref().err().cloned();
            d.finish(f, err.as_deref());
        }
        assert_eq!(names(&dir), ["c.json.tmp", "d.json.bad", "e.json"]);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(d.collect().is_empty(), "missing directory");
    }

    #[test]
    fn missing_gpu_fails_validation() {
        let mut g = Global {
            init_count: 1,
            hw: Hardware::build(
                ConfigKey {
                    path: None,
                    content: None,
                },
                Config::default(),
            ),
            sets: BTreeMap::new(),
            next_set: 1,
            inject: None,
            watcher_gen: 0,
        };
        assert!(
            g.validate(&[Command::Xid {
                gpu: 4,
                code: 1,
                message: None
            }])
            .is_err()
        );
        assert!(g.validate(&[Command::Count { n: 5 }]).is_err());
        assert!(g.validate(&[Command::Count { n: 4 }]).is_ok());
        g.apply(Command::Ecc {
            gpu: 1,
            delta: inject::EccDelta {
                uncorrected_volatile: 2,
                corrected_aggregate: 3,
                ..Default::default()
            },
        });
        assert_eq!(g.hw.gpus[1].ecc, [[0, 3], [2, 0]]);
        // No set registered: the DBE event is backlogged, the SBE one is not.
        assert_eq!(g.hw.gpus[1].backlog.len(), 1);
    }
}
