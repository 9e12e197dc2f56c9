//! The counter poller: ECC, row remapping, retired pages, the driver's recovery action,
//! temperature, hardware slowdown, device count and MPS clients, read every poll interval.
//!
//! Contract with the engine: an abnormal *state* (a pending remap, a lost GPU, a hot GPU) is
//! reported on every poll, so debounce windows can count it; a *counter* is reported as the
//! increase since the last poll. The engine keeps repeats out of the journal.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::structs::device::FieldId;
use nvml_wrapper::{Device, Nvml};

use super::{contract, raw, usage, view};
use crate::model::{GpuId, Observation, RecoveryAction, Signal};
use crate::probe::tasks;
use nvml_wrapper::enums::device::UsedGpuMemory;

/// NVML field id of the driver's recovery action (`NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`).
pub const FIELD_RECOVERY_ACTION: u32 = 230;
/// Temperatures at or above this are reported; the policy's thresholds decide.
pub const HOT_CELSIUS: u64 = 80;
/// `HW_SLOWDOWN | HW_THERMAL_SLOWDOWN | HW_POWER_BRAKE_SLOWDOWN` clock event reasons.
pub const HW_SLOWDOWN_MASK: u64 = 0x8 | 0x40 | 0x80;

/// How long the event watcher holds an NVLink5 XID for its kernel log line. The driver prints
/// the line when it raises the event; a reader that is running sees it within milliseconds.
pub const TEXT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// How long the event watcher holds such an XID while the configured reader has not started
/// yet (it starts after NVML's first poll): on a loaded node that may take seconds, and an XID
/// judged without its text is judged wrong.
pub const START_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// State shared between the poller and the event watcher.
#[derive(Default)]
pub struct Shared {
    /// Last seen volatile uncorrected ECC count per GPU: whoever sees an increase first
    /// reports it, so an event and a poll do not count one error twice.
    pub ecc_uncorrected: BTreeMap<u32, u64>,
    /// MPS clients per GPU at the last poll (pids, ECS task ids).
    pub clients: BTreeMap<u32, (Vec<u32>, Vec<String>)>,
    /// The processes the poller saw on the GPUs lately, as the kernel had them: the kernel
    /// log reader charges an XID of a process gone since to what was seen of it.
    pub seen: tasks::SeenProcs,
    /// Identities of the GPUs, by index.
    pub gpus: BTreeMap<u32, GpuId>,
    /// XIDs reported recently, by (GPU, code): the event watcher and the kernel log see the
    /// same XID; the first to claim it reports it.
    pub recent_xids: XidClaims,
    /// A kernel log reader is configured and has not given up (set from the config before
    /// the event watcher starts, not when the reader gets going): an XID whose verdict
    /// depends on its text (NVLink5) is then held by the event watcher until the reader
    /// brings the text, also one that arrives while the reader is still starting.
    pub kmsg_active: bool,
    /// When the reader started reading: a held XID waits [`TEXT_WAIT`]
    /// from then at the earliest; while it has not started, up to
    /// [`START_WAIT`] from the event.
    pub kmsg_started: Option<std::time::Instant>,
    /// XIDs the event watcher saw and holds for their kernel log text
    /// (`kmsg::held_for_text`), by (GPU, code), with when they were seen, oldest first.
    pub awaiting_text: std::collections::VecDeque<(u32, u32, std::time::Instant)>,
}

/// Whose claim: (GPU index, XID code, source).
type ClaimKey = (u32, u32, &'static str);

/// The XIDs each source reported within [`XID_DEDUPE_WINDOW`], for [`Shared::claim_xid`]:
/// one queue per (GPU, code, source) and one of everything in arrival order, so a claim costs
/// constant time however many XIDs a storm brings (a scan of every recent XID per claim made
/// a storm of 50,000 quadratic).
#[derive(Default)]
pub struct XidClaims {
    /// Per key, the ids and times of its claims still in the window, oldest first.
    by_key: std::collections::HashMap<ClaimKey, std::collections::VecDeque<(u64, Instant)>>,
    /// Every claim in arrival order, for expiry.
    order: std::collections::VecDeque<(ClaimKey, u64, Instant)>,
    next_id: u64,
}

impl XidClaims {
    /// Claims an XID seen by `source` at `now`: false when the other source reported the same
    /// (GPU, code) within the window (that report is then used up: one pairing per XID).
    pub fn claim(
        &mut self,
        index: u32,
        code: u32,
        source: &'static str,
        now: std::time::Instant,
    ) -> bool {
        while let Some((key, id, at)) = self.order.front().copied() {
            if now.saturating_duration_since(at) < XID_DEDUPE_WINDOW {
                break;
            }
            self.order.pop_front();
            if let Some(q) = self.by_key.get_mut(&key) {
                // Claims leave a key's queue oldest first (expired or paired), so an expired
                // claim still held is at its front.
                if q.front().is_some_and(|(i, _)| *i == id) {
                    q.pop_front();
                }
                if q.is_empty() {
                    self.by_key.remove(&key);
                }
            }
        }
        let other = if source == "nvml" { "kmsg" } else { "nvml" };
        if let Some(q) = self.by_key.get_mut(&(index, code, other))
            && q.pop_front().is_some()
        {
            if q.is_empty() {
                self.by_key.remove(&(index, code, other));
            }
            return false;
        }
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let key = (index, code, source);
        self.by_key.entry(key).or_default().push_back((id, now));
        self.order.push_back((key, id, now));
        true
    }
}

impl XidClaims {
    /// Whether `source` reported (gpu `index`, `code`) within the window: that report is
    /// used up (one pairing per XID), and nothing is claimed for the asker.
    pub fn reported_by(&mut self, index: u32, code: u32, source: &'static str) -> bool {
        let key = (index, code, source);
        let now = Instant::now();
        let Some(q) = self.by_key.get_mut(&key) else {
            return false;
        };
        while q
            .front()
            .is_some_and(|(_, at)| now.saturating_duration_since(*at) >= XID_DEDUPE_WINDOW)
        {
            q.pop_front();
        }
        let found = q.pop_front().is_some();
        if q.is_empty() {
            self.by_key.remove(&key);
        }
        found
    }
}

/// An XID seen by both sources within this window is one XID.
pub const XID_DEDUPE_WINDOW: std::time::Duration = std::time::Duration::from_secs(10);

pub type SharedState = Arc<Mutex<Shared>>;

/// Locks the shared state; a poisoned lock (a panic elsewhere) still holds usable data.
pub fn lock(s: &SharedState) -> std::sync::MutexGuard<'_, Shared> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    /// Claims an XID seen by `source` (`nvml` or `kmsg`) for reporting. The event watcher
    /// and the kernel log each see every XID: one seen by the other source within
    /// `XID_DEDUPE_WINDOW` is the same XID and is not reported again. Repeats from one source
    /// are distinct XIDs.
    pub fn claim_xid(&mut self, index: u32, code: u32, source: &'static str) -> bool {
        self.recent_xids
            .claim(index, code, source, std::time::Instant::now())
    }

    /// The kernel log reader has the text of an XID the event watcher holds: hand it over
    /// (true) so the reader reports it, decoded.
    pub fn take_awaiting(&mut self, index: u32, code: u32) -> bool {
        match self
            .awaiting_text
            .iter()
            .position(|x| x.0 == index && x.1 == code)
        {
            Some(pos) => {
                self.awaiting_text.remove(pos);
                true
            }
            None => false,
        }
    }

    /// Held XIDs whose text did not come within `wait`: the event watcher reports them
    /// undecoded.
    pub fn expired_awaiting(&mut self, wait: std::time::Duration) -> Vec<(u32, u32)> {
        let now = std::time::Instant::now();
        let (active, started) = (self.kmsg_active, self.kmsg_started);
        let expired = |seen: std::time::Instant| match (active, started) {
            // Nothing will bring the text.
            (false, _) => true,
            (true, Some(t)) => now.saturating_duration_since(seen.max(t)) >= wait,
            (true, None) => now.saturating_duration_since(seen) >= START_WAIT,
        };
        let (gone, keep) = std::mem::take(&mut self.awaiting_text)
            .into_iter()
            .partition(|x| expired(x.2));
        self.awaiting_text = keep;
        gone.into_iter().map(|(i, c, _)| (i, c)).collect()
    }

    /// Adds the GPU's identity and its current MPS clients to an observation.
    pub fn annotate(&self, mut obs: Observation, index: u32) -> Observation {
        let gpu = self
            .gpus
            .get(&index)
            .cloned()
            .unwrap_or_else(|| GpuId::index_only(index));
        if let Some((pids, tasks)) = self.clients.get(&index) {
            if obs.pids.is_empty() {
                obs.pids = pids.clone();
            }
            if obs.tasks.is_empty() {
                obs.tasks = tasks.clone();
            }
        }
        obs.source = "nvml".into();
        obs.on_gpu(gpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_xid_seen_by_both_sources_is_claimed_once_but_repeats_are_not_merged() {
        let mut s = Shared::default();
        assert!(s.claim_xid(1, 79, "nvml"));
        assert!(!s.claim_xid(1, 79, "kmsg"), "same XID from the kernel log");
        assert!(s.claim_xid(1, 79, "nvml"), "a second event is a second XID");
        assert!(s.claim_xid(1, 13, "kmsg"));
        assert!(s.claim_xid(2, 79, "kmsg"), "another GPU");
    }
}

#[derive(Debug, Default)]
pub struct PollReport {
    pub observations: Vec<Observation>,
    /// Unexpected errors (a counter that stopped answering): reported, never fatal.
    pub problems: Vec<String>,
    pub gpus: Vec<GpuId>,
    /// GPU memory per task and container on each GPU that answered.
    pub usage: crate::accounting::usage::Snapshot,
    /// Every GPU of this poll, lost ones included, with its memory (for the ECS cross-check).
    pub view: view::ViewSnapshot,
    /// Each answering GPU's fabric, NVLinks, PCIe link and clock event reasons
    /// ([`super::links`]), when `[links]` is on.
    pub links: Vec<super::links::GpuLinks>,
    /// The MPS clients of ECS tasks with the limits they run with, for the accounting wing's
    /// comparison with their reservations.
    pub clients: Vec<contract::ClientLimits>,
    /// How many GPUs the node should have, when known (`[nvml] expected_gpus`, ECS, the
    /// instance type), and how many NVML counted.
    pub expected: Option<u32>,
    pub counted: u32,
}

/// The self-fault component of an `[nvml] expected_gpus` that contradicts the instance type.
pub const EXPECTED_GPUS: &str = "expected-gpus";

pub struct Poller {
    expected_gpus: Option<u32>,
    /// The expected count learnt at run time (ECS, the instance type): used when
    /// `expected_gpus` is unset, and checking it when set ([`view::ExpectedGpus::resolve`]).
    learnt: Option<view::ExpectedGpus>,
    corrected: BTreeMap<u32, u64>,
    warned: BTreeSet<String>,
    /// NVML could not count the GPUs on the last poll (a self-fault is open).
    count_failed: bool,
    /// Why `[nvml] expected_gpus` is not used, while it contradicts the instance type (a
    /// self-fault is open).
    expected_mistake: Option<String>,
    /// The links of each GPU (`[links]`), when enabled.
    links: Option<super::links::LinkReader>,
    /// The MPS clients' tasks, by pid: each cgroup read once per process.
    placements: tasks::Placements,
    /// Processes outside MPS and the clients' limits ([`contract`]).
    contract: contract::Contract,
    proc_root: PathBuf,
}

impl Poller {
    /// `installed`: the programs that may hold a GPU outside MPS, by their files
    /// ([`crate::probe::identity::Installed`], looked up once at start).
    pub fn new(
        expected_gpus: Option<u32>,
        proc_root: PathBuf,
        installed: crate::probe::identity::Installed,
    ) -> Self {
        Poller {
            expected_gpus,
            learnt: None,
            corrected: BTreeMap::new(),
            warned: BTreeSet::new(),
            count_failed: false,
            expected_mistake: None,
            links: None,
            placements: tasks::Placements::new(&proc_root),
            contract: contract::Contract::new(&proc_root, installed),
            proc_root,
        }
    }

    /// Also reads each GPU's links ([`super::links`]) as `cfg` says.
    pub fn with_links(mut self, cfg: crate::config::LinksConfig) -> Self {
        self.links = cfg.enabled.then(|| super::links::LinkReader::new(cfg));
        self
    }

    /// Reads the expected GPU count from `learnt` ([`view::ExpectedGpus::resolve`]).
    pub fn learning_expected(mut self, learnt: view::ExpectedGpus) -> Self {
        self.learnt = Some(learnt);
        self
    }

    /// A set `[nvml] expected_gpus` that contradicts the instance type is gpu-medic's fault
    /// (component [`EXPECTED_GPUS`]), said once when it appears and once when it clears:
    /// never a device-count mismatch.
    fn say_expected_mistake(&mut self, mistake: Option<String>, report: &mut PollReport) {
        if mistake == self.expected_mistake {
            return;
        }
        match &mistake {
            Some(why) => {
                tracing::error!(probe = "nvml", "{why}");
                report.observations.push(
                    Observation::new(Signal::SelfFault {
                        component: EXPECTED_GPUS.into(),
                    })
                    .with_detail(why.clone())
                    .from_source("nvml"),
                );
            }
            None => report.observations.push(
                Observation::new(Signal::SelfRecovered {
                    component: EXPECTED_GPUS.into(),
                })
                .with_detail("[nvml] expected_gpus agrees with the instance type")
                .from_source("nvml"),
            ),
        }
        self.expected_mistake = mistake;
    }

    /// Logs a warning once per key (NOT_SUPPORTED counters, missing symbols).
    fn warn_once(&mut self, key: String, msg: String) {
        if self.warned.insert(key) {
            tracing::warn!(probe = "nvml", "{msg}");
        }
    }

    /// Sorts an error into "not available here" (warned once) or a problem.
    fn failed(&mut self, report: &mut PollReport, gpu: u32, what: &str, e: &NvmlError) {
        match e {
            NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_) => self.warn_once(
                format!("{what}@{gpu}"),
                format!("GPU {gpu}: {what} is not available ({e}); not watched"),
            ),
            _ => {
                let msg = format!("GPU {gpu}: {what} failed: {e}");
                self.warn_once(format!("{what}@{gpu}:{e}"), msg.clone());
                report.problems.push(msg);
            }
        }
    }

    pub fn poll(&mut self, nvml: &Nvml, shared: &SharedState) -> PollReport {
        let mut report = PollReport::default();
        let count = match nvml.device_count() {
            Ok(n) => {
                if std::mem::take(&mut self.count_failed) {
                    report.observations.push(super::self_recovered(&format!(
                        "NVML counts {n} GPU(s) again"
                    )));
                }
                n
            }
            Err(e) => {
                // gpu-medic cannot tell anything about the GPUs: "could not tell", journaled
                // as a self-fault (once), never taken for "no GPU raised a signal".
                let msg = format!("NVML cannot count the GPUs: {e}");
                report.problems.push(msg.clone());
                if !self.count_failed {
                    self.count_failed = true;
                    tracing::error!(probe = "nvml", "{msg}");
                }
                report.observations.push(super::self_fault(msg));
                return report;
            }
        };
        report.view.count = count;
        let resolved = match &self.learnt {
            Some(l) => l.resolve(self.expected_gpus),
            None => view::ExpectedGpus::new().resolve(self.expected_gpus),
        };
        self.say_expected_mistake(resolved.mistake, &mut report);
        let expected = resolved.expected;
        report.expected = expected.as_ref().map(|e| e.count);
        report.counted = count;
        if let Some(expected) = expected
            && count < expected.count
        {
            report.observations.push(
                Observation::new(Signal::DeviceCountMismatch)
                    .with_value(count as u64)
                    .with_detail(format!(
                        "expected {} GPUs ({}), NVML sees {count}",
                        expected.count, expected.source
                    ))
                    .from_source("nvml"),
            );
        }
        let known: Vec<u32> = lock(shared).gpus.keys().copied().collect();
        let indices: BTreeSet<u32> = (0..count).chain(known).collect();
        self.placements.begin_poll();
        self.contract.begin_poll();
        lock(shared).seen.begin_poll();
        for index in indices {
            self.poll_gpu(nvml, shared, index, count, &mut report);
        }
        self.judge_outsiders(&mut report);
        self.placements.end_poll();
        self.contract.end_poll();
        report
    }

    /// One GPU's poll: its identity and memory, its MPS clients (every observation of the
    /// GPU names them), then one reading per counter. A reading that fails is a problem of
    /// this poll ([`Poller::failed`]), never a finding.
    fn poll_gpu(
        &mut self,
        nvml: &Nvml,
        shared: &SharedState,
        index: u32,
        count: u32,
        report: &mut PollReport,
    ) {
        let device = match nvml.device_by_index(index) {
            Ok(d) => d,
            Err(NvmlError::GpuLost) => return gpu_lost(shared, index, report),
            Err(_) if index >= count => return, // gone from the count: device-count-mismatch says so
            Err(e) => return self.failed(report, index, "device handle", &e),
        };
        if !self.read_identity(&device, shared, index, report) {
            return;
        }
        self.read_clients(&device, shared, index, report);
        let mut found = Vec::new();
        self.read_ecc(&device, shared, index, report, &mut found);
        self.read_row_remap(nvml, &device, index, report, &mut found);
        self.read_retired_pages(&device, index, report, &mut found);
        self.read_recovery_action(&device, index, report, &mut found);
        self.read_thermal(&device, index, report, &mut found);
        self.read_links(nvml, &device, index, report, &mut found);
        let s = lock(shared);
        for obs in found {
            report.observations.push(s.annotate(obs, index));
        }
    }

    /// Identity, refreshed each poll (cheap, and a lost GPU keeps its last known one), and
    /// memory use for the view. False when the GPU is lost (nothing more to read).
    fn read_identity(
        &mut self,
        device: &Device<'_>,
        shared: &SharedState,
        index: u32,
        report: &mut PollReport,
    ) -> bool {
        let g = match identity(device, index) {
            Ok(g) => g,
            Err(NvmlError::GpuLost) => {
                gpu_lost(shared, index, report);
                return false;
            }
            Err(e) => {
                self.failed(report, index, "identity", &e);
                return true;
            }
        };
        lock(shared).gpus.insert(index, g.clone());
        report.gpus.push(g.clone());
        report.usage.gpus.insert(index, (g.clone(), Vec::new()));
        let memory = match device.memory_info() {
            Ok(m) => Some((m.used, m.total)),
            Err(e) => {
                self.failed(report, index, "memory info", &e);
                None
            }
        };
        report.view.gpus.insert(
            index,
            view::GpuView {
                gpu: g,
                lost: false,
                memory,
            },
        );
        true
    }

    /// MPS clients: their pids and ECS tasks, each task's GPU memory, the limits each client
    /// of a task runs with, and the processes outside MPS ([`contract`]). The compute list is
    /// read before the MPS list: a client that starts between the two is in the second only.
    fn read_clients(
        &mut self,
        device: &Device<'_>,
        shared: &SharedState,
        index: u32,
        report: &mut PollReport,
    ) {
        let compute = match device.running_compute_processes() {
            Ok(p) => Some(p),
            Err(e) => {
                self.failed(report, index, "compute process list", &e);
                None
            }
        };
        let procs = match device.mps_running_compute_processes() {
            Ok(p) => p,
            Err(e) => return self.failed(report, index, "MPS client list", &e),
        };
        let pids: Vec<u32> = procs.iter().map(|p| p.pid).collect();
        self.placements.resolve(&pids);
        let tasks = self.placements.task_ids(&pids);
        let gpu = {
            let mut s = lock(shared);
            for &pid in &pids {
                s.seen.note(&self.proc_root, pid, self.placements.get(pid));
            }
            s.clients.insert(index, (pids.clone(), tasks));
            s.gpus.get(&index).cloned()
        }
        .unwrap_or_else(|| GpuId::index_only(index));
        self.read_contract(&gpu, compute.as_deref(), &pids, report);
        if let Some((_, per_task)) = report.usage.gpus.get_mut(&index) {
            let clients: Vec<usage::Client> = procs
                .iter()
                .map(|p| usage::Client {
                    pid: p.pid,
                    used_bytes: match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect();
            let placements = &self.placements;
            *per_task = usage::sum_placed(&clients, |pid| placements.get(pid));
        }
    }

    /// The limits of this GPU's clients in ECS tasks, and its lists for the outside-MPS
    /// check at the poll's end.
    fn read_contract(
        &mut self,
        gpu: &GpuId,
        compute: Option<&[nvml_wrapper::struct_wrappers::device::ProcessInfo]>,
        clients: &[u32],
        report: &mut PollReport,
    ) {
        let uuid = Some(gpu.uuid.as_str()).filter(|u| !u.is_empty());
        for &pid in clients {
            let Some((task, container)) = self
                .placements
                .get(pid)
                .map(|(t, c)| (t.to_string(), c.map(str::to_string)))
            else {
                continue;
            };
            if let Some((start, limits)) = self.contract.limits(pid, uuid) {
                report.clients.push(contract::ClientLimits {
                    gpu: gpu.index,
                    pid,
                    start,
                    task,
                    container,
                    limits,
                });
            }
        }
        let listed = compute.map(|compute| {
            compute
                .iter()
                .map(|p| {
                    let bytes = match p.used_gpu_memory {
                        UsedGpuMemory::Used(b) => Some(b),
                        UsedGpuMemory::Unavailable => None,
                    };
                    (p.pid, bytes)
                })
                .collect()
        });
        self.contract.listed(gpu, listed, clients);
    }

    /// The processes outside MPS on every GPU of this poll, judged together: whether MPS
    /// serves the node is a fact of all of them ([`contract::Contract::outsiders`]). A GPU
    /// ECS gave whole to one container (`DEDICATED`, as ECS said last) is not judged.
    fn judge_outsiders(&mut self, report: &mut PollReport) {
        let root = self.proc_root.clone();
        let placed = |pid: u32| tasks::placement_of(&root, pid).is_ok();
        let dedicated = self
            .learnt
            .as_ref()
            .map(view::ExpectedGpus::dedicated)
            .unwrap_or_default();
        let (found, counts) = self.contract.outsiders(placed, |g| {
            !g.uuid.is_empty() && dedicated.contains(&g.uuid)
        });
        report.observations.extend(found);
        report.usage.outside_mps.extend(counts);
    }

    /// ECC: uncorrected volatile (shared with the event watcher), corrected volatile.
    fn read_ecc(
        &mut self,
        device: &Device<'_>,
        shared: &SharedState,
        index: u32,
        report: &mut PollReport,
        found: &mut Vec<Observation>,
    ) {
        match device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
            Ok(now) => {
                let mut s = lock(shared);
                let before = s.ecc_uncorrected.insert(index, now);
                let delta = now.saturating_sub(before.unwrap_or(0));
                if delta > 0 {
                    found.push(
                        Observation::new(Signal::EccUncorrected)
                            .with_value(delta)
                            .with_detail(format!("volatile uncorrected ECC errors: {now}")),
                    );
                }
            }
            Err(e) => self.failed(report, index, "uncorrected ECC count", &e),
        }
        match device.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile) {
            Ok(now) => {
                if let Some(before) = self.corrected.insert(index, now)
                    && now > before
                {
                    found.push(
                        Observation::new(Signal::EccCorrected)
                            .with_value(now - before)
                            .with_detail(format!("volatile corrected ECC errors: {now}")),
                    );
                }
            }
            Err(e) => self.failed(report, index, "corrected ECC count", &e),
        }
    }

    /// Row remapping (Ampere and later), through raw calls: the wrapper has none.
    fn read_row_remap(
        &mut self,
        nvml: &Nvml,
        device: &Device<'_>,
        index: u32,
        report: &mut PollReport,
        found: &mut Vec<Observation>,
    ) {
        match raw::remapped_rows(nvml, device) {
            Ok(r) => {
                if r.pending {
                    found.push(
                        Observation::new(Signal::RowRemapPending)
                            .with_detail("a row remap waits for a GPU reset"),
                    );
                }
                if r.failure {
                    found.push(
                        Observation::new(Signal::RowRemapFailure)
                            .with_detail("the row remapper reported a failure"),
                    );
                }
                if r.uncorrectable > 0 {
                    found.push(
                        Observation::new(Signal::RowRemapUncorrectable)
                            .with_value(r.uncorrectable)
                            .with_detail(format!(
                                "rows remapped for uncorrectable errors: {}, correctable: {}",
                                r.uncorrectable, r.correctable
                            )),
                    );
                }
            }
            Err(e) => self.failed(report, index, "remapped rows", &e),
        }
        match raw::remapper_banks_exhausted(nvml, device) {
            Ok(0) => {}
            Ok(n) => found.push(
                Observation::new(Signal::RowRemapFailure)
                    .with_value(n)
                    .with_detail(format!("{n} memory banks have no spare rows left")),
            ),
            Err(e) => self.failed(report, index, "row remapper histogram", &e),
        }
    }

    /// Retired pages (before Ampere).
    fn read_retired_pages(
        &mut self,
        device: &Device<'_>,
        index: u32,
        report: &mut PollReport,
        found: &mut Vec<Observation>,
    ) {
        match device.are_pages_pending_retired() {
            Ok(true) => found.push(
                Observation::new(Signal::RetiredPagesPending)
                    .with_detail("a page retirement waits for a GPU reset"),
            ),
            Ok(false) => {}
            Err(e) => self.failed(report, index, "retired pages pending", &e),
        }
        match retired_total(device) {
            Ok(0) => {}
            Ok(n) => found.push(
                Observation::new(Signal::RetiredPages)
                    .with_value(n)
                    .with_detail(format!("retired pages (SBE + DBE): {n}")),
            ),
            Err(e) => self.failed(report, index, "retired pages", &e),
        }
    }

    /// The driver's own verdict.
    fn read_recovery_action(
        &mut self,
        device: &Device<'_>,
        index: u32,
        report: &mut PollReport,
        found: &mut Vec<Observation>,
    ) {
        match recovery_action(device) {
            Ok(Some(action)) if action != RecoveryAction::None => {
                found.push(Observation::new(Signal::RecoveryAction { action }))
            }
            Ok(_) => {}
            Err(e) => self.failed(report, index, "recovery action field", &e),
        }
    }

    /// Temperature and hardware clock slowdowns.
    fn read_thermal(
        &mut self,
        device: &Device<'_>,
        index: u32,
        report: &mut PollReport,
        found: &mut Vec<Observation>,
    ) {
        match device.temperature(TemperatureSensor::Gpu) {
            Ok(t) if t as u64 >= HOT_CELSIUS => found.push(
                Observation::new(Signal::Thermal)
                    .with_value(t as u64)
                    .with_detail(format!("GPU temperature {t} °C")),
            ),
            Ok(_) => {}
            Err(e) => self.failed(report, index, "temperature", &e),
        }
        match device.current_throttle_reasons() {
            Ok(r) if r.bits() & HW_SLOWDOWN_MASK != 0 => found.push(
                Observation::new(Signal::HwSlowdown)
                    .with_value(r.bits())
                    .with_detail(format!("hardware slowdown reasons {:?}", r)),
            ),
            Ok(_) => {}
            Err(e) => self.failed(report, index, "clock event reasons", &e),
        }
    }

    /// Fabric, NVLink, clocks, PCIe and persistence ([`super::links`]): an unsupported reading
    /// is said once and not watched, a failed one is a problem of this poll.
    fn read_links(
        &mut self,
        nvml: &Nvml,
        device: &Device<'_>,
        index: u32,
        report: &mut PollReport,
        found: &mut Vec<Observation>,
    ) {
        if let Some(mut links) = self.links.take() {
            let mut errors: Vec<(String, bool, String)> = Vec::new();
            let got = links.read(
                nvml,
                device,
                index,
                std::time::Instant::now(),
                &mut |what, e| {
                    let unavailable = matches!(
                        e,
                        NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)
                    );
                    errors.push((what.to_string(), unavailable, e.to_string()));
                },
            );
            self.links = Some(links);
            for (what, unavailable, e) in errors {
                if unavailable {
                    self.warn_once(
                        format!("{what}@{index}"),
                        format!("GPU {index}: {what} is not available ({e}); not watched"),
                    );
                } else {
                    let msg = format!("GPU {index}: {what} failed: {e}");
                    self.warn_once(format!("{what}@{index}:{e}"), msg.clone());
                    report.problems.push(msg);
                }
            }
            found.extend(got.observations);
            report.problems.extend(got.pending);
            report.links.push(got.view);
        }
    }
}

/// A lost GPU: the observation (with its last known identity) and its place in the view.
fn gpu_lost(shared: &SharedState, index: u32, report: &mut PollReport) {
    let obs = lock(shared).annotate(Observation::new(Signal::GpuLost), index);
    report.view.gpus.insert(index, lost_view(&obs, index));
    report.observations.push(obs);
}

/// A lost GPU in the view, with the identity it was last known by.
fn lost_view(obs: &Observation, index: u32) -> view::GpuView {
    view::GpuView {
        gpu: obs.gpu.clone().unwrap_or_else(|| GpuId::index_only(index)),
        lost: true,
        memory: None,
    }
}

fn identity(device: &nvml_wrapper::Device<'_>, index: u32) -> Result<GpuId, NvmlError> {
    Ok(GpuId {
        index,
        uuid: device.uuid()?,
        pci_bus_id: device.pci_info()?.bus_id,
        serial: device.serial().ok(),
    })
}

fn retired_total(device: &nvml_wrapper::Device<'_>) -> Result<u64, NvmlError> {
    use nvml_wrapper::enum_wrappers::device::RetirementCause;
    let sbe = device.retired_pages(RetirementCause::MultipleSingleBitEccErrors)?;
    let dbe = device.retired_pages(RetirementCause::DoubleBitEccError)?;
    Ok((sbe.len() + dbe.len()) as u64)
}

fn recovery_action(device: &nvml_wrapper::Device<'_>) -> Result<Option<RecoveryAction>, NvmlError> {
    use nvml_wrapper::enums::device::SampleValue;
    let values = device.field_values_for(&[FieldId(FIELD_RECOVERY_ACTION)])?;
    let Some(sample) = values.into_iter().next() else {
        return Ok(None);
    };
    let v = match sample?.value? {
        SampleValue::U32(v) => v as u64,
        SampleValue::U64(v) => v,
        SampleValue::I64(v) => v.max(0) as u64,
        SampleValue::F64(v) => v.max(0.0) as u64,
    };
    Ok(RecoveryAction::from_nvml(v))
}
