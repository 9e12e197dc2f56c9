//! GPU memory per ECS task and container, per GPU: the numbers AWS does not emit for
//! MPS-shared GPUs. Every poll, NVML's MPS client list (pid, used GPU memory) is summed per
//! (GPU, task, container), with each pid mapped to its task and container through its cgroup
//! ([`crate::probe::tasks`]). The latest sums are kept in an [`Accounting`] the metrics
//! endpoint reads; they replace the previous poll's, so a task that is gone has no series.
//!
//! NVML may report a client's memory as not available (`NVML_VALUE_NOT_AVAILABLE`, e.g. a
//! driver that does not account per MPS client): such a process is counted in `unknown`,
//! never as 0 bytes.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use crate::model::GpuId;

/// One MPS client as NVML lists it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Client {
    pub pid: u32,
    /// Bytes of GPU memory; `None` when NVML does not know.
    pub used_bytes: Option<u64>,
    /// Its SM utilization in percent since the last poll (NVML's process utilization
    /// samples, `crate::probe::nvml::utilization`); `None` when they cannot be read.
    pub sm_percent: Option<u32>,
}

/// What one task's container uses on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskUsage {
    /// The ECS task id (the last part of its ARN).
    pub task: String,
    /// The container's Docker id, where the cgroup path names it.
    pub container: Option<String>,
    /// Sum of the known `used_bytes` of its processes.
    pub bytes: u64,
    /// Its MPS client processes on this GPU.
    pub processes: u32,
    /// Of those, processes whose memory NVML did not report.
    pub unknown: u32,
    /// From the ECS agent, once it listed the task: ARN, family, revision, container name.
    pub names: Option<Names>,
    /// The SM utilization of its processes on this GPU, summed (percent of the GPU's SMs);
    /// `None` when NVML's process utilization could not be read.
    pub sm_percent: Option<u32>,
    /// The active thread percentage in force for its processes: the largest of its clients'
    /// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, else the daemon's default;
    /// `super::contract::annotate`); `None` when not known.
    pub sm_limit_percent: Option<u32>,
}

/// What the ECS agent tells about a task's container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    pub arn: String,
    pub family: String,
    pub revision: String,
    /// `None` when the agent does not list the container id.
    pub container: Option<String>,
}

/// The MPS clients of one GPU summed per (task, container), sorted; processes outside ECS
/// tasks or already gone are left out. Reads each client's cgroup (bounded) on every call;
/// the NVML poller places its clients once per process and calls [`sum_placed`].
pub fn sum(proc_root: &Path, clients: &[Client]) -> Vec<TaskUsage> {
    let placed: Vec<Option<(String, Option<String>)>> = clients
        .iter()
        .map(|c| {
            let path = proc_root.join(c.pid.to_string()).join("cgroup");
            let text = crate::sys::limits::read_pseudo(&path, 64 << 10, "a cgroup file").ok()?;
            crate::aws::agent::task_and_container_from_cgroup(&text)
        })
        .collect();
    let by_pid: std::collections::HashMap<u32, (&str, Option<&str>)> = clients
        .iter()
        .zip(&placed)
        .filter_map(|(c, p)| p.as_ref().map(|(t, k)| (c.pid, (t.as_str(), k.as_deref()))))
        .collect();
    sum_placed(clients, |pid| by_pid.get(&pid).copied())
}

/// The MPS clients of one GPU summed per (task, container), sorted, each placed by `place`
/// (its task id and container id; None: outside ECS tasks or gone, left out). One map
/// update per client; the names are copied once per (task, container).
pub fn sum_placed<'a>(
    clients: &[Client],
    place: impl Fn(u32) -> Option<(&'a str, Option<&'a str>)>,
) -> Vec<TaskUsage> {
    #[derive(Default)]
    struct Sum {
        bytes: u64,
        processes: u32,
        unknown: u32,
        sm: Option<u32>,
    }
    let mut by: BTreeMap<(&'a str, Option<&'a str>), Sum> = BTreeMap::new();
    for c in clients {
        let Some(key) = place(c.pid) else {
            continue;
        };
        let u = by.entry(key).or_default();
        u.processes += 1;
        match c.used_bytes {
            Some(b) => u.bytes = u.bytes.saturating_add(b),
            None => u.unknown += 1,
        }
        if let Some(p) = c.sm_percent {
            u.sm = Some(u.sm.unwrap_or(0).saturating_add(p));
        }
    }
    by.into_iter()
        .map(|((task, container), u)| TaskUsage {
            task: task.to_string(),
            container: container.map(str::to_string),
            bytes: u.bytes,
            processes: u.processes,
            unknown: u.unknown,
            names: None,
            sm_percent: u.sm,
            sm_limit_percent: None,
        })
        .collect()
}

/// The latest poll's GPUs and their per-task use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Every GPU NVML answered for, by index, with its tasks' use (empty: no ECS client).
    pub gpus: BTreeMap<u32, (GpuId, Vec<TaskUsage>)>,
    /// Each task's use summed over its containers and GPUs, with its reservation where
    /// known ([`super::reserve::per_task`]).
    pub tasks: Vec<super::reserve::TaskMemory>,
    /// Processes outside MPS on each GPU MPS serves, at the last poll
    /// ([`super::contract`]).
    pub outside_mps: BTreeMap<u32, u32>,
    /// MPS clients of ECS tasks whose limits do not match their reservation.
    pub mismatches: super::contract::Mismatches,
}

/// Shared between the NVML poller (writes) and the metrics endpoint (reads).
#[derive(Debug, Clone, Default)]
pub struct Accounting(Arc<Mutex<Snapshot>>);

impl Accounting {
    pub fn new() -> Self {
        Self::default()
    }

    /// Replaces the snapshot with one poll's.
    pub fn publish(&self, s: Snapshot) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }

    /// A copy of the latest snapshot.
    pub fn snapshot(&self) -> Snapshot {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

/// The agent's task list, asked again only when a task it has not listed shows up (and at
/// most every `REFRESH`); tasks no longer on a GPU are forgotten.
#[derive(Debug, Default)]
pub struct TaskNames {
    known: BTreeMap<String, crate::aws::agent::AgentTask>,
    asked: Option<std::time::Instant>,
    warned: bool,
}

/// Least time between two task lists.
pub const REFRESH: std::time::Duration = std::time::Duration::from_secs(10);

impl TaskNames {
    /// Fills in `names` of every task in `snap`, asking the agent at `url` if one is new.
    pub async fn label(&mut self, url: &str, snap: &mut Snapshot) {
        let seen: std::collections::BTreeSet<String> = snap
            .gpus
            .values()
            .flat_map(|(_, tasks)| tasks.iter().map(|t| t.task.clone()))
            .collect();
        self.known.retain(|id, _| seen.contains(id));
        let due = self.asked.is_none_or(|t| t.elapsed() >= REFRESH);
        if due && seen.iter().any(|id| !self.known.contains_key(id)) {
            self.asked = Some(std::time::Instant::now());
            match crate::aws::agent::Agent::new(url).tasks().await {
                Ok(tasks) => {
                    self.warned = false;
                    for t in tasks {
                        if seen.contains(t.id()) {
                            self.known.insert(t.id().to_string(), t);
                        }
                    }
                }
                Err(e) => {
                    if !std::mem::replace(&mut self.warned, true) {
                        tracing::warn!(
                            probe = "nvml",
                            "cannot list the ECS agent's tasks ({e}): GPU memory is labelled by task id only"
                        );
                    }
                }
            }
        }
        for (_, tasks) in snap.gpus.values_mut() {
            for u in tasks {
                if let Some(t) = self.known.get(&u.task) {
                    u.names = Some(Names {
                        arn: t.arn.clone(),
                        family: t.family.clone(),
                        revision: t.version.clone(),
                        container: u
                            .container
                            .as_ref()
                            .and_then(|c| t.container(c))
                            .map(|k| k.name.clone()),
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc_with(dir: &Path, pid: u32, cgroup: &str) {
        std::fs::create_dir_all(dir.join(pid.to_string())).unwrap();
        std::fs::write(dir.join(format!("{pid}/cgroup")), cgroup).unwrap();
    }

    #[test]
    fn sums_per_task_and_container_and_keeps_unknown_apart() {
        let dir = tempfile::tempdir().unwrap();
        let v2 =
            |t: &str, c: &str| format!("0::/ecstasks.slice/ecstasks-{t}.slice/docker-{c}.scope\n");
        proc_with(dir.path(), 10, &v2("aa", "c1"));
        proc_with(dir.path(), 11, &v2("aa", "c1"));
        proc_with(dir.path(), 12, &v2("aa", "c2"));
        proc_with(dir.path(), 13, "8:pids:/ecs/bb/c3\n");
        proc_with(dir.path(), 14, "0::/system.slice/sshd.service\n");
        let c = |pid, mib: Option<u64>| Client {
            pid,
            used_bytes: mib.map(|m| m << 20),
            sm_percent: Some(pid % 10),
        };
        let got = sum(
            dir.path(),
            &[
                c(10, Some(100)),
                c(11, Some(50)),
                c(12, None),
                c(13, Some(7)),
                c(14, Some(999)),
                c(15, Some(999)), // gone
            ],
        );
        let row = |t: &str, ct: &str, mib: u64, p, u, sm| TaskUsage {
            task: t.into(),
            container: Some(ct.into()),
            bytes: mib << 20,
            processes: p,
            unknown: u,
            names: None,
            sm_percent: Some(sm),
            sm_limit_percent: None,
        };
        assert_eq!(
            got,
            vec![
                row("aa", "c1", 150, 2, 0, 1),
                row("aa", "c2", 0, 1, 1, 2),
                row("bb", "c3", 7, 1, 0, 3)
            ]
        );
    }
}
