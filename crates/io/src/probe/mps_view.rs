//! MPS's own view of its servers and clients, cross-checked with NVML's
//! (docs/mps.md#mpss-own-view).
//!
//! The MPS probe, on its own turn and under the control lock, lists the daemon's servers
//! (`get_server_list`, in the probe's own session) and, when there is one, each server's
//! clients (`get_client_list <server>`, one session per server, at most [`MAX_SERVERS`]); the
//! NVML poller publishes its latest MPS client and compute lists of every GPU to an
//! [`Exchange`] the two share. [`compare`] places the daemon's clients against NVML's lists and
//! against the kernel's facts about each process (start time, real uid, cgroup: [`Facts`]),
//! never against what a process says of itself, and gives the tree `gpu-medic status` shows and
//! the findings:
//!
//! - a client the daemon lists that NVML lists on no GPU as an MPS client
//!   (`mps-client-not-on-gpu`; judged only when every GPU's MPS list was read);
//! - an MPS client NVML lists that no server of the daemon lists (`mps-client-no-server`;
//!   judged only when every server's clients were listed, and only for a live process);
//! - a server that lists no client and holds GPU memory in NVML's compute list
//!   (`mps-server-idle-memory`, the value in MiB);
//! - a client whose real uid is not its server's, where the server runs as a user other than
//!   root (`mps-wrong-server`).
//!
//! The daemon's list and NVML's are taken at different instants: a client that starts or
//! exits between the two is in one only. [`Judge`] therefore reports a finding when two looks
//! in a row, each on a newer NVML poll, saw the same one (the same kind, process and GPU; a
//! process is its pid and start time), once, and again only after it cleared.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use crate::model::mps_view::{MAX_TREE_CLIENTS, MpsTree, TreeClient, TreeGpu, TreeServer};
use crate::model::{GpuId, Observation, Signal, Timestamp};

/// Servers whose clients are listed per turn (one session each). A daemon runs one server
/// per user at a time, one in all under `-multiuser-server` (the ECS GPU AMI).
pub const MAX_SERVERS: usize = 4;
/// Findings taken from one comparison (the rest wait for a later one).
pub const MAX_FINDINGS: usize = 64;
/// Processes taken from one NVML list.
pub const MAX_NVML_PROCS: usize = 1024;

/// One process in an NVML list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    pub pid: u32,
    /// `usedGpuMemory`, when NVML knows it.
    pub bytes: Option<u64>,
    /// Its SM utilization at the poll, when NVML's process utilization could be read.
    pub sm_percent: Option<u32>,
}

/// One GPU's lists at an NVML poll; `None`: that list could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuLists {
    pub gpu: GpuId,
    pub mps: Option<Vec<Proc>>,
    pub compute: Option<Vec<Proc>>,
}

/// NVML's lists of every GPU at its latest poll, numbered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NvmlLists {
    /// Counts the polls published: a comparison with the same number saw nothing newer.
    pub seq: u64,
    pub gpus: BTreeMap<u32, GpuLists>,
}

/// What the NVML poller and the MPS probe share: NVML's latest lists, and the daemon's
/// default active thread percentage the probe last read (the thread limit of a client that
/// sets none).
#[derive(Debug, Clone, Default)]
pub struct Exchange(Arc<Mutex<Shared>>);

#[derive(Debug, Default)]
struct Shared {
    nvml: Option<Arc<NvmlLists>>,
    polls: u64,
    default_percent: Option<f64>,
}

impl Exchange {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Shared> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// One NVML poll's lists (each list cut at [`MAX_NVML_PROCS`]).
    pub fn publish(&self, mut gpus: BTreeMap<u32, GpuLists>) {
        for g in gpus.values_mut() {
            for l in [&mut g.mps, &mut g.compute].into_iter().flatten() {
                l.truncate(MAX_NVML_PROCS);
            }
        }
        let mut s = self.lock();
        s.polls = s.polls.wrapping_add(1);
        let seq = s.polls;
        s.nvml = Some(Arc::new(NvmlLists { seq, gpus }));
    }

    /// NVML's latest lists; `None` before its first poll.
    pub fn nvml(&self) -> Option<Arc<NvmlLists>> {
        self.lock().nvml.clone()
    }

    /// The number of NVML's latest poll (0 before the first).
    pub fn seq(&self) -> u64 {
        self.lock().polls
    }

    /// The daemon's default active thread percentage, as the probe just read it.
    pub fn set_default_percent(&self, p: f64) {
        self.lock().default_percent = (p.is_finite() && p > 0.0 && p <= 100.0).then_some(p);
    }

    pub fn default_percent(&self) -> Option<f64> {
        self.lock().default_percent
    }
}

/// The daemon's servers and each one's clients, as one probe turn listed them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Listing {
    pub servers: Vec<ServerListing>,
    /// Servers past [`MAX_SERVERS`], not listed this turn.
    pub unlisted: Vec<u32>,
}

/// One server and its clients, or why they could not be listed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerListing {
    pub pid: u32,
    pub clients: Result<Vec<u32>, String>,
}

impl Listing {
    /// Every server's clients were listed: a client no server lists is served by none.
    pub fn complete(&self) -> bool {
        self.unlisted.is_empty() && self.servers.iter().all(|s| s.clients.is_ok())
    }

    fn server_pids(&self) -> Vec<u32> {
        self.servers.iter().map(|s| s.pid).collect()
    }
}

/// What the kernel says of a live process.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcFacts {
    /// Start time, clock ticks after boot: with the pid, the process.
    pub start: u64,
    /// Real uid.
    pub uid: Option<u32>,
    /// ECS task id and Docker container id, from its cgroup.
    pub task: Option<String>,
    pub container: Option<String>,
}

/// The kernel's facts about processes; `None`: gone (or a zombie). `fresh`: read now (a
/// finding is judged on what the kernel says now); otherwise what was read at an earlier
/// look may do (the tree), as long as the process is the same.
pub trait Facts {
    fn of(&mut self, pid: u32, fresh: bool) -> Option<ProcFacts>;
    /// A look is over: `seen` are the pids it named (the others are forgotten).
    fn end_look(&mut self, _seen: &HashSet<u32>) {}
}

/// Facts read from a `/proc` (bounded reads: `stat`, `status`, `cgroup`), kept per process
/// between looks: a process's cgroup and uid are read when it is first seen (and again when its
/// start time says its pid was reused); a kept process's `stat` is read again when a finding
/// needs it, and for one pid in [`RECHECK_EVERY`] at each look otherwise, so a process gone or
/// a pid reused shows in the tree within that many looks. Forgotten when no list names it.
#[derive(Debug, Clone)]
pub struct ProcRoot {
    root: PathBuf,
    known: HashMap<u32, ProcFacts>,
    looks: u64,
    /// Process reads made (`stat`, `status`, `cgroup` each count one): for tests.
    reads: u64,
}

/// A kept process's `stat` is read again at one look in this many.
pub const RECHECK_EVERY: u64 = 6;

impl ProcRoot {
    pub fn new(root: PathBuf) -> ProcRoot {
        ProcRoot {
            root,
            known: HashMap::new(),
            looks: 0,
            reads: 0,
        }
    }

    /// Process files read so far.
    pub fn reads(&self) -> u64 {
        self.reads
    }
}

impl Facts for ProcRoot {
    fn of(&mut self, pid: u32, fresh: bool) -> Option<ProcFacts> {
        let due = (u64::from(pid).wrapping_add(self.looks)) % RECHECK_EVERY == 0;
        if !fresh
            && !due
            && let Some(f) = self.known.get(&pid)
        {
            return Some(f.clone());
        }
        self.reads += 1;
        let Some(stat) = crate::sys::procfs::stat(&self.root, pid).filter(|s| !s.is_dead()) else {
            self.known.remove(&pid);
            return None;
        };
        if let Some(f) = self.known.get_mut(&pid)
            && f.start == stat.start_ticks
        {
            if fresh {
                // A uid may change (setuid); the cgroup of a running process does not leave
                // its container.
                self.reads += 1;
                f.uid = crate::sys::procfs::uid(&self.root, pid);
            }
            return Some(f.clone());
        }
        self.reads += 2;
        let (task, container) = match crate::probe::tasks::placement_of(&self.root, pid) {
            Ok(p) => (p.task_id, p.container_id),
            Err(_) => (None, None),
        };
        let f = ProcFacts {
            start: stat.start_ticks,
            uid: crate::sys::procfs::uid(&self.root, pid),
            task,
            container,
        };
        self.known.insert(pid, f.clone());
        Some(f)
    }

    fn end_look(&mut self, seen: &HashSet<u32>) {
        self.known.retain(|pid, _| seen.contains(pid));
        self.looks = self.looks.wrapping_add(1);
    }
}

/// What a finding is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    ClientNotOnGpu,
    ClientNoServer,
    ServerIdleMemory,
    WrongServer,
}

impl Kind {
    fn signal(self) -> Signal {
        match self {
            Kind::ClientNotOnGpu => Signal::MpsClientNotOnGpu,
            Kind::ClientNoServer => Signal::MpsClientNoServer,
            Kind::ServerIdleMemory => Signal::MpsServerIdleMemory,
            Kind::WrongServer => Signal::MpsWrongServer,
        }
    }
}

/// One mismatch between the daemon's view and NVML's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finding {
    pub kind: Kind,
    pub pid: u32,
    /// The process's start time (`None`: it is gone).
    pub start: Option<u64>,
    pub gpu: Option<GpuId>,
    pub value: u64,
    pub detail: String,
}

/// A finding's identity between looks: kind, process, GPU.
type Key = (Kind, u32, Option<u64>, Option<u32>);

impl Finding {
    fn key(&self) -> Key {
        (
            self.kind,
            self.pid,
            self.start,
            self.gpu.as_ref().map(|g| g.index),
        )
    }

    /// The observation (its ECS task is named by the probe, [`super::tasks::TaskNamer`]).
    pub fn observation(&self) -> Observation {
        let mut o = Observation::new(self.kind.signal())
            .with_value(self.value)
            .with_pids(vec![self.pid])
            .with_detail(self.detail.clone())
            .from_source("mps");
        o.gpu = self.gpu.clone();
        o
    }
}

/// The tree and the findings of one comparison.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Comparison {
    pub tree: MpsTree,
    pub findings: Vec<Finding>,
}

/// NVML's lists indexed by pid: on which GPUs each process is, with what.
#[derive(Default)]
struct Placed {
    mps: HashMap<u32, Vec<(u32, Proc)>>,
    compute: HashMap<u32, Vec<(u32, Proc)>>,
}

impl Placed {
    fn new(nvml: &NvmlLists) -> Placed {
        let mut p = Placed::default();
        for (index, g) in &nvml.gpus {
            for q in g.mps.iter().flatten() {
                p.mps.entry(q.pid).or_default().push((*index, *q));
            }
            for q in g.compute.iter().flatten() {
                p.compute.entry(q.pid).or_default().push((*index, *q));
            }
        }
        p
    }

    fn on(map: &HashMap<u32, Vec<(u32, Proc)>>, pid: u32, gpu: u32) -> Option<Proc> {
        map.get(&pid)?
            .iter()
            .find(|(i, _)| *i == gpu)
            .map(|(_, p)| *p)
    }
}

/// The kernel's facts, each process asked once per comparison (fresh once at most).
struct Memo<'f> {
    facts: &'f mut dyn Facts,
    seen: HashMap<u32, (Option<ProcFacts>, bool)>,
}

impl Memo<'_> {
    /// What is known of `pid`, an earlier look's reading allowed (the tree).
    fn of(&mut self, pid: u32) -> Option<ProcFacts> {
        if let Some((f, _)) = self.seen.get(&pid) {
            return f.clone();
        }
        let f = self.facts.of(pid, false);
        self.seen.insert(pid, (f.clone(), false));
        f
    }

    /// What the kernel says of `pid` now (a finding).
    fn fresh(&mut self, pid: u32) -> Option<ProcFacts> {
        if let Some((f, true)) = self.seen.get(&pid) {
            return f.clone();
        }
        let f = self.facts.of(pid, true);
        self.seen.insert(pid, (f.clone(), true));
        f
    }

    fn client(&mut self, pid: u32, on: Option<Proc>) -> TreeClient {
        let f = self.of(pid);
        TreeClient {
            pid,
            uid: f.as_ref().and_then(|f| f.uid),
            task: f.as_ref().and_then(|f| f.task.clone()),
            container: f.as_ref().and_then(|f| f.container.clone()),
            memory_bytes: on.and_then(|p| p.bytes),
            sm_percent: on.and_then(|p| p.sm_percent),
            gone: f.is_none(),
        }
    }
}

/// Keeps at most [`MAX_TREE_CLIENTS`] and counts the rest.
fn capped(mut v: Vec<TreeClient>) -> (Vec<TreeClient>, u32) {
    let more = v.len().saturating_sub(MAX_TREE_CLIENTS);
    v.truncate(MAX_TREE_CLIENTS);
    (v, u32::try_from(more).unwrap_or(u32::MAX))
}

/// Places `listing` against `nvml` (its latest lists; `None` before NVML's first poll) and
/// `facts`: the tree at `at` and the findings of this look.
pub fn compare(
    listing: &Listing,
    nvml: Option<&NvmlLists>,
    default_percent: Option<f64>,
    facts: &mut dyn Facts,
    at: Timestamp,
) -> Comparison {
    let mut memo = Memo {
        facts,
        seen: HashMap::new(),
    };
    let c = compare_with(listing, nvml, default_percent, &mut memo, at);
    let seen: HashSet<u32> = memo.seen.keys().copied().collect();
    memo.facts.end_look(&seen);
    c
}

fn compare_with(
    listing: &Listing,
    nvml: Option<&NvmlLists>,
    default_percent: Option<f64>,
    memo: &mut Memo<'_>,
    at: Timestamp,
) -> Comparison {
    let mut tree = MpsTree {
        at,
        default_thread_percent: default_percent,
        ..MpsTree::default()
    };
    for s in &listing.servers {
        if let Err(why) = &s.clients {
            tree.unread.push(format!(
                "server {}: its clients could not be listed: {why}",
                s.pid
            ));
        }
    }
    for pid in &listing.unlisted {
        tree.unread.push(format!(
            "server {pid}: past the {MAX_SERVERS} servers listed per look"
        ));
    }
    let Some(nvml) = nvml else {
        tree.unread
            .push("NVML's process lists: not read yet (no poll so far)".into());
        for s in &listing.servers {
            let clients = s.clients.as_deref().unwrap_or_default();
            let (clients, clients_more) =
                capped(clients.iter().map(|c| memo.client(*c, None)).collect());
            tree.off_gpu.push(TreeServer {
                pid: s.pid,
                uid: memo.of(s.pid).and_then(|f| f.uid),
                memory_bytes: None,
                clients,
                clients_more,
            });
        }
        return Comparison {
            tree,
            findings: Vec::new(),
        };
    };
    let placed = Placed::new(nvml);
    // The findings first: what they read now, the tree shows too.
    let mut findings = Vec::new();
    not_on_gpu(listing, nvml, &placed, memo, &mut findings);
    no_server(listing, nvml, memo, &mut findings);
    idle_memory(listing, nvml, &placed, memo, &mut findings);
    wrong_server(listing, nvml, &placed, memo, &mut findings);
    tree.gpus = gpus(listing, nvml, &placed, memo);
    tree.off_gpu = off_gpu(listing, &placed, memo);
    findings.truncate(MAX_FINDINGS);
    Comparison { tree, findings }
}

/// Each GPU with the servers on it (a client, or their own process, there) and its MPS
/// clients no server lists.
fn gpus(listing: &Listing, nvml: &NvmlLists, placed: &Placed, memo: &mut Memo<'_>) -> Vec<TreeGpu> {
    let served: HashSet<u32> = listing
        .servers
        .iter()
        .filter_map(|s| s.clients.as_ref().ok())
        .flatten()
        .copied()
        .collect();
    let mut out = Vec::new();
    for (index, g) in &nvml.gpus {
        let mut tg = TreeGpu {
            index: *index,
            uuid: g.gpu.uuid.clone(),
            ..TreeGpu::default()
        };
        for s in &listing.servers {
            let own = Placed::on(&placed.compute, s.pid, *index);
            let clients: Vec<TreeClient> = s
                .clients
                .as_deref()
                .unwrap_or_default()
                .iter()
                .filter_map(|c| Placed::on(&placed.mps, *c, *index).map(|p| (*c, p)))
                .map(|(c, p)| memo.client(c, Some(p)))
                .collect();
            if own.is_none() && clients.is_empty() {
                continue;
            }
            let (clients, clients_more) = capped(clients);
            tg.servers.push(TreeServer {
                pid: s.pid,
                uid: memo.of(s.pid).and_then(|f| f.uid),
                memory_bytes: own.and_then(|p| p.bytes),
                clients,
                clients_more,
            });
        }
        let unserved: Vec<TreeClient> = g
            .mps
            .iter()
            .flatten()
            .filter(|p| !served.contains(&p.pid))
            .map(|p| memo.client(p.pid, Some(*p)))
            .collect();
        (tg.unserved, tg.unserved_more) = capped(unserved);
        out.push(tg);
    }
    out
}

/// The servers with clients NVML lists on no GPU, and servers on no GPU at all.
fn off_gpu(listing: &Listing, placed: &Placed, memo: &mut Memo<'_>) -> Vec<TreeServer> {
    let mut out = Vec::new();
    for s in &listing.servers {
        let Ok(clients) = &s.clients else { continue };
        let off: Vec<TreeClient> = clients
            .iter()
            .filter(|c| !placed.mps.contains_key(c))
            .map(|c| memo.client(*c, None))
            .collect();
        let nowhere = !placed.compute.contains_key(&s.pid)
            && clients.iter().all(|c| !placed.mps.contains_key(c));
        if off.is_empty() && !nowhere {
            continue;
        }
        let (clients, clients_more) = capped(off);
        out.push(TreeServer {
            pid: s.pid,
            uid: memo.of(s.pid).and_then(|f| f.uid),
            memory_bytes: None,
            clients,
            clients_more,
        });
    }
    out
}

/// The GPUs NVML lists `pid` on as a compute process, for a detail.
fn compute_gpus(placed: &Placed, pid: u32) -> Vec<u32> {
    placed
        .compute
        .get(&pid)
        .map(|v| v.iter().map(|(i, _)| *i).collect())
        .unwrap_or_default()
}

/// Clients the daemon lists that NVML lists on no GPU's MPS list (judged only when every
/// GPU's MPS list was read).
fn not_on_gpu(
    listing: &Listing,
    nvml: &NvmlLists,
    placed: &Placed,
    memo: &mut Memo<'_>,
    out: &mut Vec<Finding>,
) {
    if nvml.gpus.values().any(|g| g.mps.is_none()) {
        return;
    }
    for s in &listing.servers {
        let Ok(clients) = &s.clients else { continue };
        for c in clients.iter().filter(|c| !placed.mps.contains_key(c)) {
            let facts = memo.fresh(*c);
            let mut detail = format!(
                "the MPS daemon lists pid {c} as a client of its server {}; NVML lists it on no \
                 GPU as an MPS client",
                s.pid
            );
            let compute = compute_gpus(placed, *c);
            if !compute.is_empty() {
                detail.push_str(&format!(
                    " (it is in the compute list of GPU {compute:?}, as a process outside MPS)"
                ));
            }
            if facts.is_none() {
                detail.push_str("; the process is gone: the server still holds it");
            }
            out.push(Finding {
                kind: Kind::ClientNotOnGpu,
                pid: *c,
                start: facts.as_ref().map(|f| f.start),
                gpu: None,
                value: u64::from(facts.is_none()),
                detail,
            });
        }
    }
}

/// NVML's MPS clients no server of the daemon lists (judged only when every server's clients
/// were listed; a process gone since NVML's poll is skipped).
fn no_server(listing: &Listing, nvml: &NvmlLists, memo: &mut Memo<'_>, out: &mut Vec<Finding>) {
    if !listing.complete() {
        return;
    }
    let served: HashSet<u32> = listing
        .servers
        .iter()
        .filter_map(|s| s.clients.as_ref().ok())
        .flatten()
        .copied()
        .collect();
    let servers = listing.server_pids();
    for g in nvml.gpus.values() {
        for p in g.mps.iter().flatten().filter(|p| !served.contains(&p.pid)) {
            let Some(facts) = memo.fresh(p.pid) else {
                continue;
            };
            let servers = if servers.is_empty() {
                "it runs no server".to_string()
            } else {
                format!("its servers: {servers:?}")
            };
            out.push(Finding {
                kind: Kind::ClientNoServer,
                pid: p.pid,
                start: Some(facts.start),
                gpu: Some(g.gpu.clone()),
                value: 0,
                detail: format!(
                    "NVML lists pid {} as an MPS client on {}, and no server of the MPS \
                     daemon lists it ({servers}): another MPS daemon serves it",
                    p.pid, g.gpu
                ),
            });
        }
    }
}

/// Servers that list no client and hold GPU memory (their own process in NVML's compute
/// list).
fn idle_memory(
    listing: &Listing,
    nvml: &NvmlLists,
    placed: &Placed,
    memo: &mut Memo<'_>,
    out: &mut Vec<Finding>,
) {
    for s in &listing.servers {
        if !s.clients.as_ref().is_ok_and(Vec::is_empty) {
            continue;
        }
        let Some(facts) = memo.fresh(s.pid) else {
            continue;
        };
        for (index, p) in placed.compute.get(&s.pid).into_iter().flatten() {
            let Some(bytes) = p.bytes.filter(|b| *b > 0) else {
                continue;
            };
            let Some(g) = nvml.gpus.get(index) else {
                continue;
            };
            out.push(Finding {
                kind: Kind::ServerIdleMemory,
                pid: s.pid,
                start: Some(facts.start),
                gpu: Some(g.gpu.clone()),
                value: bytes >> 20,
                detail: format!(
                    "MPS server {} lists no client and holds {} MiB on {} (NVML's compute list)",
                    s.pid,
                    bytes >> 20,
                    g.gpu
                ),
            });
        }
    }
}

/// Clients whose real uid is not their server's, where the server runs as a user other than
/// root (a root server is `-multiuser-server`'s, or root's own).
fn wrong_server(
    listing: &Listing,
    nvml: &NvmlLists,
    placed: &Placed,
    memo: &mut Memo<'_>,
    out: &mut Vec<Finding>,
) {
    for s in &listing.servers {
        let Ok(clients) = &s.clients else { continue };
        let Some(server_uid) = memo.fresh(s.pid).and_then(|f| f.uid).filter(|u| *u != 0) else {
            continue;
        };
        for c in clients {
            let Some(facts) = memo.fresh(*c) else {
                continue;
            };
            let Some(uid) = facts.uid.filter(|u| *u != server_uid) else {
                continue;
            };
            let gpu = placed
                .mps
                .get(c)
                .and_then(|v| v.first())
                .and_then(|(i, _)| nvml.gpus.get(i))
                .map(|g| g.gpu.clone());
            out.push(Finding {
                kind: Kind::WrongServer,
                pid: *c,
                start: Some(facts.start),
                gpu,
                value: 0,
                detail: format!(
                    "MPS client {c} runs as uid {uid} and is served by server {}, which runs as \
                     uid {server_uid}: a per-user server serves its own user's clients only",
                    s.pid
                ),
            });
        }
    }
}

/// Reports a finding once two looks in a row, each on a newer NVML poll, saw it; a finding
/// about a process once, and again only after it cleared; a server holding memory (a state the
/// policy's confirmation window counts) at every look while it lasts.
#[derive(Debug, Default)]
pub struct Judge {
    last_seq: Option<u64>,
    pending: HashSet<Key>,
    reported: HashSet<Key>,
}

impl Judge {
    /// The findings of a look on NVML's poll `seq` that are confirmed now. A look on the same
    /// poll as the last confirms and clears nothing.
    pub fn judge(&mut self, seq: u64, found: Vec<Finding>) -> Vec<Finding> {
        if self.last_seq == Some(seq) {
            return Vec::new();
        }
        self.last_seq = Some(seq);
        let keys: HashSet<Key> = found.iter().map(Finding::key).collect();
        self.reported.retain(|k| keys.contains(k));
        let mut out = Vec::new();
        let mut pending = HashSet::new();
        for f in found {
            let k = f.key();
            if self.reported.contains(&k) {
                if f.kind == Kind::ServerIdleMemory {
                    out.push(f);
                }
                continue;
            }
            if self.pending.contains(&k) {
                self.reported.insert(k);
                out.push(f);
            } else {
                pending.insert(k);
            }
        }
        self.pending = pending;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Facts from a table: pid -> (start, uid, task).
    struct Table(HashMap<u32, ProcFacts>);

    impl Facts for Table {
        fn of(&mut self, pid: u32, _fresh: bool) -> Option<ProcFacts> {
            self.0.get(&pid).cloned()
        }
    }

    fn facts(rows: &[(u32, u32, Option<&str>)]) -> Table {
        Table(
            rows.iter()
                .map(|(pid, uid, task)| {
                    (
                        *pid,
                        ProcFacts {
                            start: u64::from(*pid) * 10,
                            uid: Some(*uid),
                            task: task.map(str::to_string),
                            container: task.map(|_| "c0ffee".to_string()),
                        },
                    )
                })
                .collect(),
        )
    }

    fn proc(pid: u32, mib: u64) -> Proc {
        Proc {
            pid,
            bytes: Some(mib << 20),
            sm_percent: Some(10),
        }
    }

    fn nvml(seq: u64, gpus: &[(u32, Vec<Proc>, Vec<Proc>)]) -> NvmlLists {
        NvmlLists {
            seq,
            gpus: gpus
                .iter()
                .map(|(i, mps, compute)| {
                    (
                        *i,
                        GpuLists {
                            gpu: GpuId::index_only(*i),
                            mps: Some(mps.clone()),
                            compute: Some(compute.clone()),
                        },
                    )
                })
                .collect(),
        }
    }

    fn server(pid: u32, clients: &[u32]) -> ServerListing {
        ServerListing {
            pid,
            clients: Ok(clients.to_vec()),
        }
    }

    fn kinds(c: &Comparison) -> Vec<(Kind, u32, u64)> {
        c.findings
            .iter()
            .map(|f| (f.kind, f.pid, f.value))
            .collect()
    }

    #[test]
    fn a_consistent_node_is_a_tree_and_no_finding() {
        let listing = Listing {
            servers: vec![server(100, &[10, 11, 20])],
            unlisted: vec![],
        };
        let n = nvml(
            1,
            &[
                (0, vec![proc(10, 500), proc(11, 300)], vec![proc(100, 200)]),
                (1, vec![proc(20, 700)], vec![proc(100, 200)]),
                (2, vec![], vec![]),
            ],
        );
        let mut f = facts(&[
            (100, 0, None),
            (10, 1000, Some("t1")),
            (11, 1000, Some("t1")),
            (20, 2000, Some("t2")),
        ]);
        let c = compare(&listing, Some(&n), Some(100.0), &mut f, Timestamp(5));
        assert!(c.findings.is_empty(), "{:?}", c.findings);
        let t = &c.tree;
        assert_eq!(t.gpus.len(), 3);
        assert_eq!(t.gpus[0].servers[0].pid, 100);
        assert_eq!(t.gpus[0].servers[0].memory_bytes, Some(200 << 20));
        let pids: Vec<u32> = t.gpus[0].servers[0].clients.iter().map(|c| c.pid).collect();
        assert_eq!(pids, [10, 11]);
        assert_eq!(t.gpus[1].servers[0].clients[0].task.as_deref(), Some("t2"));
        assert!(t.gpus[2].servers.is_empty(), "no server on GPU 2");
        assert!(t.off_gpu.is_empty() && t.unread.is_empty());
        assert_eq!(t.default_thread_percent, Some(100.0));
    }

    #[test]
    fn each_mismatch_is_a_finding_of_its_kind() {
        // Server 100 (root) serves 10 (on GPU 0) and 12 (on no GPU: gone) and 13 (running,
        // NVML lists it only as a compute process); server 200 (uid 1000) serves 21 of uid
        // 2000; server 300 lists no client and holds 3 GiB on GPU 1; NVML lists 30 as an MPS
        // client of no server.
        let listing = Listing {
            servers: vec![
                server(100, &[10, 12, 13]),
                server(200, &[21]),
                server(300, &[]),
            ],
            unlisted: vec![],
        };
        let n = nvml(
            1,
            &[
                (0, vec![proc(10, 1), proc(21, 1)], vec![proc(13, 64)]),
                (1, vec![proc(30, 1)], vec![proc(300, 3072), proc(100, 0)]),
            ],
        );
        let mut f = facts(&[
            (100, 0, None),
            (200, 1000, None),
            (300, 0, None),
            (10, 0, Some("t1")),
            (13, 0, None),
            (21, 2000, Some("t2")),
            (30, 1000, Some("t3")),
        ]);
        let c = compare(&listing, Some(&n), None, &mut f, Timestamp(5));
        assert_eq!(
            kinds(&c),
            [
                (Kind::ClientNotOnGpu, 12, 1),
                (Kind::ClientNotOnGpu, 13, 0),
                (Kind::ClientNoServer, 30, 0),
                (Kind::ServerIdleMemory, 300, 3072),
                (Kind::WrongServer, 21, 0),
            ]
        );
        let d: Vec<&str> = c.findings.iter().map(|f| f.detail.as_str()).collect();
        assert!(d[0].contains("the process is gone"), "{}", d[0]);
        assert!(d[1].contains("compute list of GPU [0]"), "{}", d[1]);
        assert!(d[2].contains("its servers: [100, 200, 300]"), "{}", d[2]);
        assert!(
            d[4].contains("uid 2000") && d[4].contains("uid 1000"),
            "{}",
            d[4]
        );
        assert_eq!(c.findings[2].gpu.as_ref().map(|g| g.index), Some(1));
        // The tree has each of them where it belongs.
        let t = &c.tree;
        assert_eq!(t.gpus[1].unserved[0].pid, 30);
        let off: Vec<(u32, Vec<u32>)> = t
            .off_gpu
            .iter()
            .map(|s| (s.pid, s.clients.iter().map(|c| c.pid).collect()))
            .collect();
        assert_eq!(off, [(100, vec![12, 13])]);
        assert!(t.off_gpu[0].clients[0].gone);
        assert_eq!(
            t.gpus[1].servers.iter().map(|s| s.pid).collect::<Vec<_>>(),
            [100, 300],
            "servers on GPU 1 by their own process"
        );
        let obs = c.findings[2].observation();
        assert_eq!(obs.signal, Signal::MpsClientNoServer);
        assert_eq!((obs.pids.clone(), obs.source.as_str()), (vec![30], "mps"));
    }

    #[test]
    fn what_was_not_read_is_not_judged() {
        // A server whose clients could not be listed: NVML's clients are not "of no server".
        let listing = Listing {
            servers: vec![ServerListing {
                pid: 100,
                clients: Err("Cannot send command".into()),
            }],
            unlisted: vec![],
        };
        let n = nvml(1, &[(0, vec![proc(30, 1)], vec![])]);
        let mut f = facts(&[(100, 0, None), (30, 0, None)]);
        let c = compare(&listing, Some(&n), None, &mut f, Timestamp(5));
        assert!(c.findings.is_empty(), "{:?}", c.findings);
        assert!(c.tree.unread[0].contains("Cannot send command"));
        // Servers past the cap: likewise.
        let listing = Listing {
            servers: vec![server(100, &[])],
            unlisted: vec![101],
        };
        let c = compare(&listing, Some(&n), None, &mut f, Timestamp(5));
        assert!(c.findings.is_empty(), "{:?}", c.findings);
        // A GPU whose MPS list NVML could not read: no client is "on no GPU".
        let listing = Listing {
            servers: vec![server(100, &[30, 31])],
            unlisted: vec![],
        };
        let mut n = nvml(1, &[(0, vec![proc(30, 1)], vec![]), (1, vec![], vec![])]);
        if let Some(g) = n.gpus.get_mut(&1) {
            g.mps = None;
        }
        let c = compare(&listing, Some(&n), None, &mut f, Timestamp(5));
        assert!(c.findings.is_empty(), "{:?}", c.findings);
        // NVML not polled yet: the daemon's servers alone, no finding.
        let c = compare(&listing, None, None, &mut f, Timestamp(5));
        assert!(c.findings.is_empty());
        assert_eq!(c.tree.off_gpu[0].clients.len(), 2);
        // An NVML client gone since the poll is not a finding (it exited between the lists).
        let listing = Listing::default();
        let n = nvml(1, &[(0, vec![proc(99, 1)], vec![])]);
        let c = compare(&listing, Some(&n), None, &mut f, Timestamp(5));
        assert!(c.findings.is_empty(), "{:?}", c.findings);
        assert_eq!(c.tree.gpus[0].unserved[0].pid, 99);
    }

    #[test]
    fn a_finding_is_reported_at_its_second_look_on_a_newer_poll_once() {
        let f = |pid, start| Finding {
            kind: Kind::ClientNoServer,
            pid,
            start: Some(start),
            gpu: None,
            value: 0,
            detail: String::new(),
        };
        let mut j = Judge::default();
        assert!(j.judge(1, vec![f(30, 1)]).is_empty(), "first look");
        assert!(j.judge(1, vec![f(30, 1)]).is_empty(), "same NVML poll");
        assert_eq!(j.judge(2, vec![f(30, 1)]), vec![f(30, 1)], "second look");
        assert!(j.judge(3, vec![f(30, 1)]).is_empty(), "once");
        // A reused pid is another process.
        assert!(j.judge(4, vec![f(30, 2)]).is_empty());
        assert_eq!(j.judge(5, vec![f(30, 2)]), vec![f(30, 2)]);
        // A look that does not see it clears it: it takes two looks again.
        assert!(j.judge(6, vec![]).is_empty());
        assert!(j.judge(7, vec![f(30, 2)]).is_empty());
        assert_eq!(j.judge(8, vec![f(30, 2)]).len(), 1);
        // Seen, then not, then seen: never two in a row.
        let mut j = Judge::default();
        for seq in 0..6 {
            let found = if seq % 2 == 0 { vec![f(40, 1)] } else { vec![] };
            assert!(j.judge(seq, found).is_empty());
        }
        // A server holding memory is a state: at every look once confirmed.
        let idle = Finding {
            kind: Kind::ServerIdleMemory,
            ..f(50, 1)
        };
        let mut j = Judge::default();
        assert!(j.judge(1, vec![idle.clone()]).is_empty());
        for seq in 2..5 {
            assert_eq!(j.judge(seq, vec![idle.clone()]), vec![idle.clone()]);
        }
    }

    #[test]
    fn the_exchange_keeps_the_latest_poll_numbered_and_bounded() {
        let x = Exchange::new();
        assert!(x.nvml().is_none());
        let many: Vec<Proc> = (0..(MAX_NVML_PROCS as u32 + 10))
            .map(|p| proc(p, 1))
            .collect();
        let gpu = |mps: Vec<Proc>| GpuLists {
            gpu: GpuId::index_only(0),
            mps: Some(mps),
            compute: None,
        };
        x.publish([(0, gpu(many))].into());
        x.publish([(0, gpu(vec![proc(1, 1)]))].into());
        let n = x.nvml().unwrap();
        assert_eq!(n.seq, 2);
        assert_eq!(n.gpus[&0].mps.as_ref().map(Vec::len), Some(1));
        x.publish([(0, gpu((0..5000).map(|p| proc(p, 1)).collect()))].into());
        assert_eq!(
            x.nvml().unwrap().gpus[&0].mps.as_ref().map(Vec::len),
            Some(MAX_NVML_PROCS)
        );
        for bad in [f64::NAN, 0.0, -1.0, 100.5, f64::INFINITY] {
            x.set_default_percent(bad);
            assert_eq!(x.default_percent(), None, "{bad}");
        }
        x.set_default_percent(33.3);
        assert_eq!(x.default_percent(), Some(33.3));
    }

    #[test]
    fn the_real_proc_gives_facts_read_once_per_process_and_checked_in_turn() {
        let me = std::process::id();
        let mut p = ProcRoot::new(PathBuf::from("/proc"));
        let f = p.of(me, false).expect("this process");
        assert!(f.start > 0);
        // SAFETY: getuid has no preconditions.
        assert_eq!(f.uid, Some(unsafe { libc::getuid() }));
        assert!(p.of(u32::MAX, false).is_none());
        let seen: HashSet<u32> = [me].into();
        let first = p.reads();
        // Kept between looks: its stat read again at one look in RECHECK_EVERY only.
        for _ in 0..RECHECK_EVERY {
            p.end_look(&seen);
            assert_eq!(p.of(me, false), Some(f.clone()));
        }
        assert_eq!(p.reads() - first, 1, "one stat in {RECHECK_EVERY} looks");
        // A finding reads it now: stat and uid.
        let before = p.reads();
        assert_eq!(p.of(me, true).map(|f| f.start), Some(f.start));
        assert_eq!(p.reads() - before, 2);
        // Forgotten when no list names it.
        p.end_look(&HashSet::new());
        let before = p.reads();
        p.of(me, false);
        assert_eq!(p.reads() - before, 3, "read whole again");
    }
}
