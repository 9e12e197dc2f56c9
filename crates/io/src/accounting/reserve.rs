//! GPU memory reservations of ECS tasks, compared with what their MPS clients use.
//!
//! A container that shares a GPU through MPS reserves `sharingStrategy.nvidiaMps.memory` MiB;
//! ECS places all such containers of a task on one GPU with that much free for them together,
//! and limits each *process* to it (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`), so an application that
//! runs several processes can use more than its task reserved and crowd the other tasks on the
//! GPU (docs/aws.md#gpu-memory-reservations-under-mps). Here:
//!
//! - [`Reservations`] reads each task definition revision once (`DescribeTaskDefinition`, in a
//!   task of its own so a slow control plane never delays a poll) and keeps the answers in a
//!   bounded cache (`MAX_DEFINITIONS`, least recently used dropped first; a failed read is
//!   tried again after `RETRY_AFTER`, or `RETRY_TERMINAL` when retrying cannot help);
//! - [`per_task`] sums each task's use over its containers and GPUs (what ECS's placement
//!   counts) next to its reservation;
//! - [`Crossings`] reports a task whose use crosses `[nvml] reservation_alert` of its
//!   reservation once, and again only after it went back under: the crossing is the event (as
//!   an ECC counter's increase is), so a task that stays over for a day is one incident, not
//!   one per poll.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::usage::Snapshot;
use crate::aws::taskdef::ContainerReservation;
use crate::config::{AwsConfig, Share};
use crate::model::{GpuId, Observation, Signal};

/// Task definition revisions remembered at once.
pub const MAX_DEFINITIONS: usize = 256;
/// A read that failed and may succeed later is tried again after this long.
pub const RETRY_AFTER: Duration = Duration::from_secs(60);
/// A read that failed for good (no permission, no such definition) is tried again after this.
pub const RETRY_TERMINAL: Duration = Duration::from_secs(3600);
/// Reads started per poll at most (a node with many new tasks catches up over a few polls).
pub const MAX_READS_PER_POLL: usize = 8;

const MIB: u64 = 1 << 20;

#[derive(Debug, Clone)]
enum Entry {
    Reading,
    Known(Vec<ContainerReservation>),
    Failed { retry_at: Instant },
}

#[derive(Debug, Default)]
struct Cache {
    /// `family:revision` → entry, with when it was last used.
    entries: BTreeMap<String, (Entry, u64)>,
    uses: u64,
    /// A failed read was logged (once until one succeeds again).
    warned: bool,
}

/// Task definitions' MPS reservations, read from ECS and cached.
#[derive(Clone)]
pub struct Reservations {
    aws: AwsConfig,
    client: Arc<tokio::sync::OnceCell<aws_sdk_ecs::Client>>,
    cache: Arc<Mutex<Cache>>,
}

impl Reservations {
    pub fn new(aws: AwsConfig) -> Self {
        Reservations {
            aws,
            client: Arc::default(),
            cache: Arc::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts a read of every revision in `snap` not known yet (at most
    /// `MAX_READS_PER_POLL`); the answers arrive for a later poll.
    pub fn request(&self, snap: &Snapshot) {
        let wanted: BTreeSet<(String, String)> = snap
            .gpus
            .values()
            .flat_map(|(_, tasks)| tasks.iter())
            .filter_map(|t| t.names.as_ref())
            .filter(|n| !n.family.is_empty() && !n.revision.is_empty())
            .map(|n| (n.family.clone(), n.revision.clone()))
            .collect();
        let now = Instant::now();
        let mut started = 0;
        let mut c = self.lock();
        for (family, revision) in wanted {
            let key = format!("{family}:{revision}");
            c.uses += 1;
            let uses = c.uses;
            match c.entries.get_mut(&key) {
                Some((Entry::Failed { retry_at }, _)) if *retry_at <= now => {}
                Some((_, used)) => {
                    *used = uses;
                    continue;
                }
                None => {}
            }
            if started >= MAX_READS_PER_POLL {
                continue;
            }
            started += 1;
            if !c.entries.contains_key(&key) && c.entries.len() >= MAX_DEFINITIONS {
                let stalest = c
                    .entries
                    .iter()
                    .filter(|(_, (e, _))| !matches!(e, Entry::Reading))
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(k, _)| k.clone());
                match stalest {
                    Some(k) => {
                        c.entries.remove(&k);
                    }
                    None => continue,
                }
            }
            c.entries.insert(key.clone(), (Entry::Reading, uses));
            let me = self.clone();
            tokio::spawn(async move { me.read(key, family, revision).await });
        }
    }

    async fn read(&self, key: String, family: String, revision: String) {
        let aws = self.aws.clone();
        let client = self
            .client
            .get_or_init(|| async move {
                aws_sdk_ecs::Client::new(&crate::aws::loader(&aws).load().await)
            })
            .await;
        let mut calls = crate::aws::calls::Calls::new();
        let got =
            crate::aws::taskdef::mps_reservations(client, &mut calls, &family, &revision).await;
        let mut c = self.lock();
        let entry = match got {
            Ok(r) => {
                c.warned = false;
                Entry::Known(r)
            }
            Err(e) => {
                let wait = if e.retryable {
                    RETRY_AFTER
                } else {
                    RETRY_TERMINAL
                };
                if !std::mem::replace(&mut c.warned, true) {
                    tracing::warn!(
                        probe = "nvml",
                        "cannot read task definition {key} ({e}; retried in {}): GPU memory \
                         reservations are not checked until it can",
                        humantime::format_duration(wait)
                    );
                }
                Entry::Failed {
                    retry_at: Instant::now() + wait,
                }
            }
        };
        if let Some(slot) = c.entries.get_mut(&key) {
            slot.0 = entry;
        }
    }

    /// The MPS reservations of a revision, when read.
    pub fn get(&self, family: &str, revision: &str) -> Option<Vec<ContainerReservation>> {
        match &self.lock().entries.get(&format!("{family}:{revision}"))?.0 {
            Entry::Known(r) => Some(r.clone()),
            _ => None,
        }
    }

    /// Puts a revision's reservations in the cache (tests, benchmarks).
    pub fn insert(&self, family: &str, revision: &str, r: Vec<ContainerReservation>) {
        let mut c = self.lock();
        c.uses += 1;
        let uses = c.uses;
        c.entries
            .insert(format!("{family}:{revision}"), (Entry::Known(r), uses));
    }

    /// Revisions in the cache.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One container of a task: its GPU memory in use and its reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ContainerMemory {
    /// The container's name (the Docker id when the agent did not name it).
    pub name: String,
    pub used_bytes: u64,
    /// `None`: the container reserves no MPS memory, or the definition is not read yet.
    pub reserved_bytes: Option<u64>,
    /// Its GPU processes (MPS clients, on every GPU).
    pub processes: u32,
    /// The pinned memory limit in force: the largest `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` its
    /// clients run with (`crate::accounting::contract`); `None` when none was read.
    pub limit_bytes: Option<u64>,
    /// Its processes' SM utilization, summed over its GPUs (percent of a GPU's SMs); `None`
    /// when NVML's process utilization could not be read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sm_percent: Option<u32>,
    /// The active thread percentage in force: the largest its clients run with
    /// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, else the MPS daemon's default); `None` when not
    /// known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sm_limit_percent: Option<u32>,
}

/// One task's GPU memory, summed over its containers and GPUs, next to its reservation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TaskMemory {
    /// The task id (last part of the ARN).
    pub task: String,
    /// ARN, family and revision, once the ECS agent listed the task (else empty).
    pub arn: String,
    pub family: String,
    pub revision: String,
    pub used_bytes: u64,
    /// Processes whose memory NVML did not report (their use is not in `used_bytes`).
    pub unknown: u32,
    /// Use per GPU, largest first.
    pub gpus: Vec<(GpuId, u64)>,
    pub containers: Vec<ContainerMemory>,
    /// The sum of its containers' reservations; `None` when not known (yet).
    pub reserved_bytes: Option<u64>,
    /// Use is over `[nvml] reservation_alert` of the reservation.
    pub over: bool,
    /// Its processes' SM utilization, summed over its containers and GPUs; `None` when not
    /// read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sm_percent: Option<u32>,
}

impl TaskMemory {
    /// The task's name for people: its ARN, else its id.
    pub fn name(&self) -> &str {
        if self.arn.is_empty() {
            &self.task
        } else {
            &self.arn
        }
    }
}

/// Two SM utilizations summed; unknown only when both are.
fn add_sm(a: Option<u32>, b: Option<u32>) -> Option<u32> {
    match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0).saturating_add(b.unwrap_or(0))),
    }
}

/// Every task in `snap` with its use and, where `reservations` knows its revision, its
/// reservation; sorted by task id. `over` is set against `alert`.
pub fn per_task(
    snap: &Snapshot,
    reservations: Option<&Reservations>,
    alert: Share,
) -> Vec<TaskMemory> {
    let mut by: BTreeMap<String, TaskMemory> = BTreeMap::new();
    for (gpu, tasks) in snap.gpus.values() {
        for u in tasks {
            let t = by.entry(u.task.clone()).or_insert_with(|| TaskMemory {
                task: u.task.clone(),
                arn: String::new(),
                family: String::new(),
                revision: String::new(),
                used_bytes: 0,
                unknown: 0,
                gpus: Vec::new(),
                containers: Vec::new(),
                reserved_bytes: None,
                over: false,
                sm_percent: None,
            });
            if let Some(n) = &u.names
                && t.arn.is_empty()
            {
                t.arn.clone_from(&n.arn);
                t.family.clone_from(&n.family);
                t.revision.clone_from(&n.revision);
            }
            t.used_bytes = t.used_bytes.saturating_add(u.bytes);
            t.unknown = t.unknown.saturating_add(u.unknown);
            t.sm_percent = add_sm(t.sm_percent, u.sm_percent);
            match t.gpus.iter_mut().find(|(g, _)| g.index == gpu.index) {
                Some((_, b)) => *b = b.saturating_add(u.bytes),
                None => t.gpus.push((gpu.clone(), u.bytes)),
            }
            let name = u
                .names
                .as_ref()
                .and_then(|n| n.container.clone())
                .or_else(|| u.container.clone())
                .unwrap_or_default();
            match t.containers.iter_mut().find(|c| c.name == name) {
                Some(c) => {
                    c.used_bytes = c.used_bytes.saturating_add(u.bytes);
                    c.processes = c.processes.saturating_add(u.processes);
                    c.sm_percent = add_sm(c.sm_percent, u.sm_percent);
                    c.sm_limit_percent = c.sm_limit_percent.max(u.sm_limit_percent);
                }
                None => t.containers.push(ContainerMemory {
                    name,
                    used_bytes: u.bytes,
                    reserved_bytes: None,
                    processes: u.processes,
                    limit_bytes: None,
                    sm_percent: u.sm_percent,
                    sm_limit_percent: u.sm_limit_percent,
                }),
            }
        }
    }
    let mut out: Vec<TaskMemory> = by.into_values().collect();
    for t in &mut out {
        t.gpus
            .sort_by(|a, b| b.1.cmp(&a.1).then(a.0.index.cmp(&b.0.index)));
        let Some(res) = reservations.and_then(|r| r.get(&t.family, &t.revision)) else {
            continue;
        };
        if res.is_empty() {
            continue;
        }
        for r in &res {
            let bytes = r.memory_mib.saturating_mul(MIB);
            match t.containers.iter_mut().find(|c| c.name == r.container) {
                Some(c) => c.reserved_bytes = Some(bytes),
                None => t.containers.push(ContainerMemory {
                    name: r.container.clone(),
                    used_bytes: 0,
                    reserved_bytes: Some(bytes),
                    processes: 0,
                    limit_bytes: None,
                    sm_percent: None,
                    sm_limit_percent: None,
                }),
            }
        }
        let total = res.iter().fold(0u64, |a, r| {
            a.saturating_add(r.memory_mib.saturating_mul(MIB))
        });
        t.reserved_bytes = Some(total);
        t.over = t.used_bytes > alert.of(total);
    }
    out
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", bytes.div_ceil(MIB))
}

/// Tasks over their reservation at the last poll: a task is reported when it crosses, and
/// again only after it went back under (or went away and came back).
#[derive(Debug, Default)]
pub struct Crossings {
    over: BTreeSet<String>,
}

impl Crossings {
    /// The observations for the tasks that crossed since the last poll.
    pub fn update(&mut self, tasks: &[TaskMemory], alert: Share) -> Vec<Observation> {
        let mut out = Vec::new();
        let now: BTreeSet<&str> = tasks
            .iter()
            .filter(|t| t.over)
            .map(|t| t.task.as_str())
            .collect();
        self.over.retain(|t| now.contains(t.as_str()));
        for t in tasks.iter().filter(|t| t.over) {
            if !self.over.insert(t.task.clone()) {
                continue;
            }
            let Some(reserved) = t.reserved_bytes else {
                continue;
            };
            let pct = t.used_bytes.saturating_mul(100) / reserved.max(1);
            let containers: Vec<String> = t
                .containers
                .iter()
                .map(|c| match c.reserved_bytes {
                    Some(r) => format!("{} {} of {}", c.name, mib(c.used_bytes), mib(r)),
                    None => format!("{} {} (no reservation)", c.name, mib(c.used_bytes)),
                })
                .collect();
            let gpus: Vec<String> = t
                .gpus
                .iter()
                .map(|(g, b)| format!("{} {}", g, mib(*b)))
                .collect();
            let family = if t.family.is_empty() {
                String::new()
            } else {
                format!(" ({}:{})", t.family, t.revision)
            };
            let unknown = if t.unknown > 0 {
                format!("; {} process(es) of unknown memory not counted", t.unknown)
            } else {
                String::new()
            };
            let mut obs = Observation::new(Signal::GpuMemoryOverReservation)
                .with_value(pct)
                .with_detail(format!(
                    "task {}{family} uses {} of GPU memory, reservation {} ({pct}%, alert at {alert}); \
                     containers: {}; on {}{unknown}",
                    t.name(),
                    mib(t.used_bytes),
                    mib(reserved),
                    containers.join(", "),
                    gpus.join(", "),
                ))
                .from_source("nvml");
            obs.tasks = vec![t.name().to_string()];
            if let Some((g, _)) = t.gpus.first() {
                obs = obs.on_gpu(g.clone());
            }
            out.push(obs);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accounting::usage::{Names, TaskUsage};

    fn gpu(i: u32) -> GpuId {
        GpuId {
            index: i,
            uuid: format!("GPU-{i}"),
            ..GpuId::default()
        }
    }

    fn usage(task: &str, container: &str, mib: u64) -> TaskUsage {
        TaskUsage {
            task: task.into(),
            container: Some(format!("{container}-docker-id")),
            bytes: mib * MIB,
            processes: 1,
            unknown: 0,
            names: Some(Names {
                arn: format!("arn:aws:ecs:us-east-1:1:task/c/{task}"),
                family: "infer".into(),
                revision: "3".into(),
                container: Some(container.into()),
            }),
            sm_percent: Some(10),
            sm_limit_percent: Some(50),
        }
    }

    fn snap(rows: Vec<(u32, Vec<TaskUsage>)>) -> Snapshot {
        let mut s = Snapshot::default();
        for (i, t) in rows {
            s.gpus.insert(i, (gpu(i), t));
        }
        s
    }

    fn reservations() -> Reservations {
        let r = Reservations::new(AwsConfig::default());
        r.insert(
            "infer",
            "3",
            vec![
                ContainerReservation {
                    container: "app".into(),
                    memory_mib: 4096,
                    max_compute_percent: None,
                },
                ContainerReservation {
                    container: "sidecar".into(),
                    memory_mib: 1024,
                    max_compute_percent: None,
                },
            ],
        );
        r
    }

    #[test]
    fn a_tasks_use_is_summed_over_containers_and_gpus_against_its_reservation() {
        let r = reservations();
        let s = snap(vec![
            (0, vec![usage("t1", "app", 3000), usage("t2", "app", 100)]),
            (1, vec![usage("t1", "sidecar", 2200)]),
        ]);
        let tasks = per_task(&s, Some(&r), Share(100.0));
        assert_eq!(tasks.len(), 2);
        let t1 = &tasks[0];
        assert_eq!(t1.used_bytes, 5200 * MIB);
        assert_eq!(t1.reserved_bytes, Some(5120 * MIB));
        assert!(t1.over, "5200 MiB > 5120 MiB");
        assert_eq!(t1.gpus[0].0.index, 0, "largest use first");
        let sidecar = t1.containers.iter().find(|c| c.name == "sidecar").unwrap();
        assert_eq!(
            (sidecar.used_bytes, sidecar.reserved_bytes),
            (2200 * MIB, Some(1024 * MIB))
        );
        assert_eq!(
            (sidecar.sm_percent, sidecar.sm_limit_percent, t1.sm_percent),
            (Some(10), Some(50), Some(20)),
            "SM use summed per container and task, the limit carried"
        );
        let t2 = &tasks[1];
        assert!(!t2.over);
        assert!(
            t2.containers
                .iter()
                .any(|c| c.name == "sidecar" && c.used_bytes == 0),
            "a reserved container with no client is listed with 0 use"
        );
        // A lower alert share.
        let tasks = per_task(&s, Some(&r), Share(1.0));
        assert!(tasks[1].over, "100 MiB > 1% of 5120 MiB");
        // Unknown revision: no reservation, never over.
        let tasks = per_task(&s, None, Share(100.0));
        assert!(tasks.iter().all(|t| t.reserved_bytes.is_none() && !t.over));
    }

    #[test]
    fn a_crossing_is_reported_once_and_again_only_after_going_back_under() {
        let r = reservations();
        let alert = Share(100.0);
        let mut c = Crossings::default();
        let poll = |c: &mut Crossings, mib: u64| {
            let s = snap(vec![(2, vec![usage("t1", "app", mib)])]);
            c.update(&per_task(&s, Some(&r), alert), alert)
        };
        assert!(poll(&mut c, 5000).is_empty(), "under");
        let first = poll(&mut c, 6000);
        assert_eq!(first.len(), 1);
        let o = &first[0];
        assert_eq!(o.signal, Signal::GpuMemoryOverReservation);
        assert_eq!(o.value, 117, "6000 of 5120 MiB");
        assert_eq!(o.gpu.as_ref().unwrap().index, 2);
        assert_eq!(
            o.tasks,
            vec!["arn:aws:ecs:us-east-1:1:task/c/t1".to_string()]
        );
        let d = o.detail.as_deref().unwrap();
        for part in [
            "task arn:aws:ecs:us-east-1:1:task/c/t1 (infer:3)",
            "uses 6000 MiB",
            "reservation 5120 MiB",
            "app 6000 MiB of 4096 MiB",
            "sidecar 0 MiB of 1024 MiB",
            "GPU 2 (GPU-2)",
        ] {
            assert!(d.contains(part), "{part} in {d}");
        }
        assert!(poll(&mut c, 7000).is_empty(), "still over: no repeat");
        assert!(poll(&mut c, 100).is_empty(), "back under");
        assert_eq!(poll(&mut c, 6000).len(), 1, "crossed again");
        // The task goes away while over, and comes back over: a new crossing.
        assert!(c.update(&[], alert).is_empty());
        assert_eq!(poll(&mut c, 6000).len(), 1);
    }

    #[test]
    fn the_cache_is_bounded() {
        let r = Reservations::new(AwsConfig::default());
        {
            let mut c = r.lock();
            for i in 0..MAX_DEFINITIONS {
                c.uses += 1;
                let u = c.uses;
                c.entries
                    .insert(format!("f:{i}"), (Entry::Known(vec![]), u));
            }
        }
        assert_eq!(r.len(), MAX_DEFINITIONS);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let s = snap(vec![(0, vec![usage("t9", "app", 1)])]);
            r.request(&s);
        });
        assert_eq!(
            r.len(),
            MAX_DEFINITIONS,
            "the stalest was dropped for the new one"
        );
        assert!(r.lock().entries.contains_key("infer:3"));
        assert!(
            !r.lock().entries.contains_key("f:0"),
            "the least recently used went"
        );
    }
}
