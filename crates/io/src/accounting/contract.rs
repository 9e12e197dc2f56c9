//! The MPS contract of each ECS task, checked against its task definition
//! (docs/mps.md#the-mps-contract-and-what-gpu-medic-checks): ECS sets each MPS container's
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` to its `sharingStrategy.nvidiaMps.memory` (and
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` to its `maxComputePercent`, when given), and places
//! tasks by those reservations alone. Here:
//!
//! - [`LimitWatch`]: a client that runs without those limits, or with larger ones, is
//!   `mps-limit-mismatch`, once per process (pid and start time); what the NVML poller read
//!   in its environment ([`ClientLimits`]) is compared with its container's reservation, once
//!   the task definition was read. An environment cut at the read cap before the memory
//!   limit, or unreadable, is not judged.
//! - [`ContainerCrossings`]: several GPU processes of one container that together use more
//!   than the container reserves are `container-gpu-memory-over-reservation`, once per
//!   crossing (each may stay under its per-process limit).
//! - [`annotate`]: each container's process count and the limit in force, for
//!   `gpu-medic tasks`, the metrics and the EMF lines.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use super::reserve::{Reservations, TaskMemory};
use super::usage::Snapshot;
use crate::model::{GpuId, Observation, Signal};

const MIB: u64 = 1 << 20;

/// The pinned memory limit and thread percentage a client runs with, as its environment says
/// and as CUDA reads it (the first entry of each variable; docs/mps.md#how-the-limits-are-read).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Limits {
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` as written (escaped, clipped), when set.
    pub memory_text: Option<String>,
    /// The limit on the client's GPU in MiB, when the value reads as one.
    pub memory_mib: Option<u64>,
    /// Why a set `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` is not read as a limit: it is counted as
    /// none (how CUDA reads such a value is not documented, and none is the reading that
    /// makes it a finding).
    pub memory_unread: Option<String>,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` as written (escaped, clipped), when set.
    pub threads_text: Option<String>,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, when set and a whole number from 1 to 100.
    pub threads: Option<u64>,
    /// Why a set `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` is not read as a limit (counted as none).
    pub threads_unread: Option<String>,
    /// The environment is larger than the read cap: a variable not found in its head is not
    /// known (the first entry, which CUDA reads, may lie past it); one found there is.
    pub truncated: bool,
    /// The environment could not be read (why), e.g. the process is gone.
    pub unreadable: Option<String>,
}

impl Limits {
    /// Whether the memory limit can be judged: false when the environment was unreadable,
    /// or cut short before the variable was found.
    pub fn known(&self) -> bool {
        self.unreadable.is_none() && !(self.truncated && self.memory_text.is_none())
    }

    /// Whether the thread percentage can be judged, likewise.
    pub fn threads_known(&self) -> bool {
        self.unreadable.is_none() && !(self.truncated && self.threads_text.is_none())
    }
}

/// One MPS client of an ECS task at a poll, with the limits it runs with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientLimits {
    /// The GPU's index (its identity is in the snapshot).
    pub gpu: u32,
    pub pid: u32,
    /// Start time (clock ticks after boot): with the pid, the process.
    pub start: u64,
    /// ECS task id and Docker container id (from its cgroup).
    pub task: String,
    pub container: Option<String>,
    pub limits: Limits,
}

/// Clients whose limits do not match, by (GPU, limit, why): the metric's series, bounded
/// (limit: `memory` or `threads`; why: `none` or `larger`).
pub type Mismatches = BTreeMap<(u32, &'static str, &'static str), u32>;

/// What a client's container is: the task's names and the container's reservation.
struct Known<'a> {
    gpu: &'a GpuId,
    task: &'a TaskMemory,
    container: String,
    reserved_mib: u64,
    max_compute_percent: Option<u64>,
}

/// The snapshot's tasks and per-GPU usages by key, built once per poll: a lookup per task
/// container instead of a scan of every task (2,048 clients in 2,048 tasks made the scans
/// quadratic).
struct Index<'a> {
    tasks: std::collections::HashMap<&'a str, &'a TaskMemory>,
    usages: std::collections::HashMap<
        (u32, &'a str, Option<&'a str>),
        (&'a GpuId, &'a super::usage::TaskUsage),
    >,
}

impl<'a> Index<'a> {
    fn new(snap: &'a Snapshot) -> Index<'a> {
        let tasks = snap.tasks.iter().map(|t| (t.task.as_str(), t)).collect();
        let usages = snap
            .gpus
            .iter()
            .flat_map(|(i, (gpu, us))| {
                us.iter()
                    .map(move |u| ((*i, u.task.as_str(), u.container.as_deref()), (gpu, u)))
            })
            .collect();
        Index { tasks, usages }
    }
}

/// Finds a client's task, container name and reservation; None while not known.
fn known<'a>(
    c: &ClientLimits,
    index: &Index<'a>,
    reservations: &Reservations,
) -> Option<Known<'a>> {
    let (gpu, usage) = index
        .usages
        .get(&(c.gpu, c.task.as_str(), c.container.as_deref()))?;
    let names = usage.names.as_ref()?;
    let container = names.container.clone()?;
    let task = *index.tasks.get(c.task.as_str())?;
    let r = reservations
        .get(&names.family, &names.revision)?
        .into_iter()
        .find(|r| r.container == container)?;
    Some(Known {
        gpu,
        task,
        container,
        reserved_mib: r.memory_mib,
        max_compute_percent: r.max_compute_percent,
    })
}

/// Why a limit does not match (`none`, `larger`), or None when it does.
fn verdict(limit: Option<u64>, reserved: u64) -> Option<&'static str> {
    match limit {
        None => Some("none"),
        Some(l) if l > reserved => Some("larger"),
        Some(_) => None,
    }
}

/// Clients reported, kept while they are clients.
#[derive(Debug, Default)]
pub struct LimitWatch {
    reported: HashSet<(u32, u64)>,
}

impl LimitWatch {
    /// The observations for clients whose limits do not match their reservation (each once),
    /// and every mismatching client of this poll by GPU, limit and why.
    pub fn update(
        &mut self,
        clients: &[ClientLimits],
        snap: &Snapshot,
        reservations: Option<&Reservations>,
    ) -> (Vec<Observation>, Mismatches) {
        let mut out = Vec::new();
        let mut counts = Mismatches::new();
        let live: HashSet<(u32, u64)> = clients.iter().map(|c| (c.pid, c.start)).collect();
        self.reported.retain(|k| live.contains(k));
        let Some(reservations) = reservations else {
            return (out, counts);
        };
        let index = Index::new(snap);
        // Once per (GPU, task, container), not per client.
        type Key<'c> = (u32, &'c str, Option<&'c str>);
        let mut memo: std::collections::HashMap<Key<'_>, Option<Known<'_>>> =
            std::collections::HashMap::new();
        for c in clients.iter().filter(|c| c.limits.known()) {
            let key = (c.gpu, c.task.as_str(), c.container.as_deref());
            let Some(k) = memo
                .entry(key)
                .or_insert_with(|| known(c, &index, reservations))
            else {
                continue;
            };
            let memory = verdict(c.limits.memory_mib, k.reserved_mib);
            let threads = k
                .max_compute_percent
                .filter(|_| c.limits.threads_known())
                .and_then(|p| verdict(c.limits.threads, p));
            for (limit, why) in [("memory", memory), ("threads", threads)] {
                if let Some(why) = why {
                    *counts.entry((c.gpu, limit, why)).or_default() += 1;
                }
            }
            if (memory.is_none() && threads.is_none()) || !self.reported.insert((c.pid, c.start)) {
                continue;
            }
            out.push(observation(c, k, memory.is_some(), threads.is_some()));
        }
        (out, counts)
    }
}

/// How a client runs with a variable: unset, set, or set to what CUDA's reading of is not
/// known (with why: counted as no limit).
fn set_as(var: &str, text: Option<&str>, unread: Option<&str>) -> String {
    match (text, unread) {
        (None, _) => format!("no {var}"),
        (Some(t), None) => format!("{var}={t}"),
        (Some(t), Some(why)) => {
            format!("{var}=\"{t}\" (unreadable: {why}; counted as no limit)")
        }
    }
}

fn observation(c: &ClientLimits, k: &Known<'_>, memory: bool, threads: bool) -> Observation {
    let mut parts = Vec::new();
    if memory {
        let set = set_as(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
            c.limits.memory_text.as_deref(),
            c.limits.memory_unread.as_deref(),
        );
        parts.push(format!(
            "{set}, its container reserves {} MiB (sharingStrategy.nvidiaMps.memory)",
            k.reserved_mib
        ));
    }
    if threads {
        let set = set_as(
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
            c.limits.threads_text.as_deref(),
            c.limits.threads_unread.as_deref(),
        );
        parts.push(format!(
            "{set}, its container's maxComputePercent is {}",
            k.max_compute_percent.unwrap_or(100)
        ));
    }
    let family = if k.task.family.is_empty() {
        String::new()
    } else {
        format!(" ({}:{})", k.task.family, k.task.revision)
    };
    let mut obs = Observation::new(Signal::MpsLimitMismatch)
        .with_value(c.limits.memory_mib.unwrap_or(0))
        .with_pids(vec![c.pid])
        .with_detail(format!(
            "task {}{family}, container {}, pid {} on {}: runs with {}",
            k.task.name(),
            k.container,
            c.pid,
            k.gpu,
            parts.join("; ")
        ))
        .from_source("nvml")
        .on_gpu(k.gpu.clone());
    obs.tasks = vec![k.task.name().to_string()];
    obs
}

/// The active thread percentage a client runs with: its `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
/// (which can only lower the server's), else the daemon's default (`daemon`, as the MPS probe
/// read it: `get_default_active_thread_percentage`, rounded up); `None` when neither is known
/// (the environment was not read, or the daemon not asked). A per-server percentage
/// (`set_active_thread_percentage <server>`) is not read.
pub fn thread_limit(limits: &Limits, daemon: Option<f64>) -> Option<u32> {
    let daemon = daemon
        .filter(|d| d.is_finite() && *d > 0.0)
        .map(|d| d.min(100.0).ceil() as u32);
    let own = limits
        .threads
        .filter(|_| limits.threads_known())
        .and_then(|t| u32::try_from(t).ok());
    match (own, daemon) {
        (Some(o), Some(d)) => Some(o.min(d)),
        (Some(o), None) => Some(o),
        (None, d) if limits.threads_known() => d,
        (None, _) => None,
    }
}

/// Sets the thread percentage in force on each (GPU, task, container) usage and container:
/// the largest its clients run with ([`thread_limit`]).
fn annotate_threads(snap: &mut Snapshot, clients: &[ClientLimits], daemon: Option<f64>) {
    let mut per: BTreeMap<(u32, String, Option<String>), u32> = BTreeMap::new();
    for c in clients {
        if let Some(p) = thread_limit(&c.limits, daemon) {
            let e = per
                .entry((c.gpu, c.task.clone(), c.container.clone()))
                .or_default();
            *e = (*e).max(p);
        }
    }
    let mut by: BTreeMap<(String, String), u32> = BTreeMap::new();
    for (index, (_, usages)) in snap.gpus.iter_mut() {
        for u in usages.iter_mut() {
            let Some(p) = per.get(&(*index, u.task.clone(), u.container.clone())) else {
                continue;
            };
            u.sm_limit_percent = Some(*p);
            let name = u
                .names
                .as_ref()
                .and_then(|n| n.container.clone())
                .or_else(|| u.container.clone())
                .unwrap_or_default();
            let e = by.entry((u.task.clone(), name)).or_default();
            *e = (*e).max(*p);
        }
    }
    for t in &mut snap.tasks {
        for k in &mut t.containers {
            if let Some(p) = by.get(&(t.task.clone(), k.name.clone())) {
                k.sm_limit_percent = Some(*p);
            }
        }
    }
}

/// Sets each container's limits in force: the largest pinned limit its clients run with, and
/// the largest thread percentage ([`thread_limit`], `daemon`: the MPS daemon's default as last
/// read).
pub fn annotate(snap: &mut Snapshot, clients: &[ClientLimits], daemon: Option<f64>) {
    annotate_threads(snap, clients, daemon);
    // The largest per (GPU, task, container id) first, without copying a name per client.
    let mut per: BTreeMap<(u32, &str, Option<&str>), u64> = BTreeMap::new();
    for c in clients {
        if let Some(mib) = c.limits.memory_mib {
            let e = per
                .entry((c.gpu, c.task.as_str(), c.container.as_deref()))
                .or_default();
            *e = (*e).max(mib.saturating_mul(MIB));
        }
    }
    let mut by: BTreeMap<(String, String), u64> = BTreeMap::new();
    let index = Index::new(snap);
    for ((gpu, task, container), bytes) in per {
        let name = index
            .usages
            .get(&(gpu, task, container))
            .and_then(|(_, u)| u.names.as_ref().and_then(|n| n.container.clone()))
            .or_else(|| container.map(str::to_string))
            .unwrap_or_default();
        let e = by.entry((task.to_string(), name)).or_default();
        *e = (*e).max(bytes);
    }
    drop(index);
    for t in &mut snap.tasks {
        for k in &mut t.containers {
            if let Some(b) = by.get(&(t.task.clone(), k.name.clone())) {
                k.limit_bytes = Some(*b);
            }
        }
    }
}

/// Containers whose several processes were over the container's reservation at the last
/// poll, by (task, container): reported when they cross, again only after going back under.
#[derive(Debug, Default)]
pub struct ContainerCrossings {
    over: BTreeSet<(String, String)>,
}

impl ContainerCrossings {
    pub fn update(&mut self, tasks: &[TaskMemory]) -> Vec<Observation> {
        let mut out = Vec::new();
        let mut now = BTreeSet::new();
        for t in tasks {
            for c in &t.containers {
                let Some(reserved) = c.reserved_bytes else {
                    continue;
                };
                if c.processes < 2 || c.used_bytes <= reserved {
                    continue;
                }
                let key = (t.task.clone(), c.name.clone());
                now.insert(key.clone());
                if self.over.contains(&key) {
                    continue;
                }
                let mut obs = Observation::new(Signal::ContainerGpuMemoryOverReservation)
                    .with_value(u64::from(c.processes))
                    .with_detail(format!(
                        "task {}, container {}: its {} GPU processes together use {} MiB, \
                         the container reserves {} MiB (each process's pinned limit is per \
                         process; AWS recommends one GPU process per container, sized for the \
                         combined peak when there are several)",
                        t.name(),
                        c.name,
                        c.processes,
                        c.used_bytes.div_ceil(MIB),
                        reserved.div_ceil(MIB),
                    ))
                    .from_source("nvml");
                obs.tasks = vec![t.name().to_string()];
                if let Some((g, _)) = t.gpus.first() {
                    obs = obs.on_gpu(g.clone());
                }
                out.push(obs);
            }
        }
        self.over = now;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accounting::reserve::per_task;
    use crate::accounting::usage::{Names, TaskUsage};
    use crate::aws::taskdef::ContainerReservation;
    use crate::config::{AwsConfig, Share};

    fn gpu() -> GpuId {
        GpuId::index_only(1)
    }

    fn snapshot(processes: u32, mib: u64) -> Snapshot {
        let mut s = Snapshot::default();
        s.gpus.insert(
            1,
            (
                gpu(),
                vec![TaskUsage {
                    task: "t1".into(),
                    container: Some("c0ffee".into()),
                    bytes: mib * MIB,
                    processes,
                    unknown: 0,
                    names: Some(Names {
                        arn: "arn:aws:ecs:us-east-1:1:task/c/t1".into(),
                        family: "infer".into(),
                        revision: "3".into(),
                        container: Some("app".into()),
                    }),
                    sm_percent: Some(40),
                    sm_limit_percent: None,
                }],
            ),
        );
        s
    }

    fn reservations(threads: Option<u64>) -> Reservations {
        let r = Reservations::new(AwsConfig::default());
        r.insert(
            "infer",
            "3",
            vec![ContainerReservation {
                container: "app".into(),
                memory_mib: 4096,
                max_compute_percent: threads,
            }],
        );
        r
    }

    fn client(pid: u32, mem: Option<u64>, threads: Option<u64>) -> ClientLimits {
        ClientLimits {
            gpu: 1,
            pid,
            start: 7,
            task: "t1".into(),
            container: Some("c0ffee".into()),
            limits: Limits {
                memory_text: mem.map(|m| format!("0={m}M")),
                memory_mib: mem,
                threads,
                ..Limits::default()
            },
        }
    }

    #[test]
    fn limits_missing_or_larger_than_reserved_are_reported_once_per_process() {
        let r = reservations(Some(50));
        let mut s = snapshot(4, 100);
        s.tasks = per_task(&s, Some(&r), Share(100.0));
        let clients = [
            client(1, Some(4096), Some(50)),
            client(2, None, Some(50)),
            client(3, Some(8192), Some(50)),
            client(4, Some(4096), None),
        ];
        let mut w = LimitWatch::default();
        let (obs, counts) = w.update(&clients, &s, Some(&r));
        let pids: Vec<u32> = obs.iter().map(|o| o.pids[0]).collect();
        assert_eq!(pids, [2, 3, 4], "{obs:#?}");
        assert_eq!(obs[0].value, 0);
        assert_eq!(obs[1].value, 8192);
        assert_eq!(obs[0].tasks, ["arn:aws:ecs:us-east-1:1:task/c/t1"]);
        let d = obs[1].detail.as_deref().unwrap();
        assert!(
            d.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M, its container reserves 4096 MiB"),
            "{d}"
        );
        assert!(
            obs[2]
                .detail
                .as_deref()
                .unwrap()
                .contains("no CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
        );
        assert_eq!(counts.get(&(1, "memory", "none")), Some(&1));
        assert_eq!(counts.get(&(1, "memory", "larger")), Some(&1));
        assert_eq!(counts.get(&(1, "threads", "none")), Some(&1));
        // The next poll: still counted, not reported again.
        let (again, counts) = w.update(&clients, &s, Some(&r));
        assert!(again.is_empty());
        assert_eq!(counts.values().sum::<u32>(), 3);
        // Unknown reservation or a cut environment: not judged.
        let (none, _) = LimitWatch::default().update(&clients, &s, None);
        assert!(none.is_empty());
        let mut cut = client(9, None, None);
        cut.limits.truncated = true;
        let (none, _) = LimitWatch::default().update(&[cut], &s, Some(&r));
        assert!(none.is_empty());
        // Without maxComputePercent the thread percentage is not required.
        let r = reservations(None);
        let (obs, _) = LimitWatch::default().update(&clients[3..], &s, Some(&r));
        assert!(obs.is_empty());
    }

    #[test]
    fn several_processes_over_the_containers_reservation_cross_once() {
        let r = reservations(None);
        let mut x = ContainerCrossings::default();
        let tasks = |processes, mib| {
            let s = snapshot(processes, mib);
            per_task(&s, Some(&r), Share(100.0))
        };
        assert!(x.update(&tasks(2, 4000)).is_empty(), "under");
        assert!(
            x.update(&tasks(1, 5000)).is_empty(),
            "one process: the pinned limit's matter"
        );
        let o = x.update(&tasks(2, 5000));
        assert_eq!(o.len(), 1);
        assert_eq!(o[0].value, 2);
        assert!(o[0].detail.as_deref().unwrap().contains("container app: its 2 GPU processes together use 5000 MiB, the container reserves 4096 MiB"));
        assert!(x.update(&tasks(2, 5000)).is_empty(), "once per crossing");
        assert!(x.update(&tasks(2, 100)).is_empty());
        assert_eq!(x.update(&tasks(3, 6000)).len(), 1, "crossed again");
    }

    #[test]
    fn the_limit_in_force_is_the_largest_of_the_containers_clients() {
        let r = reservations(None);
        let mut s = snapshot(2, 100);
        s.tasks = per_task(&s, Some(&r), Share(100.0));
        annotate(
            &mut s,
            &[client(1, Some(1024), None), client(2, Some(2048), None)],
            None,
        );
        let app = &s.tasks[0].containers[0];
        assert_eq!((app.processes, app.limit_bytes), (2, Some(2048 * MIB)));
        assert_eq!(app.sm_limit_percent, None, "no thread limit known");
        // Thread percentages: the clients' own, else the daemon's default, the largest.
        annotate(
            &mut s,
            &[client(1, Some(1024), Some(30)), client(2, Some(1024), None)],
            Some(75.0),
        );
        let app = &s.tasks[0].containers[0];
        assert_eq!(
            app.sm_limit_percent,
            Some(75),
            "client 2 runs at the default"
        );
        assert_eq!(s.gpus[&1].1[0].sm_limit_percent, Some(75), "per GPU too");
        annotate(&mut s, &[client(1, Some(1024), Some(30))], Some(20.0));
        assert_eq!(
            s.tasks[0].containers[0].sm_limit_percent,
            Some(20),
            "a client's own percentage cannot raise the daemon's"
        );
    }

    #[test]
    fn a_clients_thread_limit_is_its_own_else_the_daemons() {
        let l = |threads: Option<u64>, known: bool| Limits {
            threads,
            unreadable: (!known).then(|| "gone".to_string()),
            ..Limits::default()
        };
        assert_eq!(thread_limit(&l(Some(40), true), Some(100.0)), Some(40));
        assert_eq!(thread_limit(&l(Some(40), true), None), Some(40));
        assert_eq!(thread_limit(&l(None, true), Some(33.3)), Some(34));
        assert_eq!(thread_limit(&l(None, true), None), None);
        assert_eq!(thread_limit(&l(None, false), Some(100.0)), None, "not read");
        for bad in [f64::NAN, -1.0, 0.0] {
            assert_eq!(thread_limit(&l(None, true), Some(bad)), None);
        }
        assert_eq!(thread_limit(&l(None, true), Some(1e9)), Some(100));
    }
}
