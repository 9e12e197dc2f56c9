//! Names the program behind an application-class XID (docs/attribution.md): the process the
//! driver printed (`pid=`, `name=`), its ECS task through its cgroup and the ECS agent, or,
//! when the driver names the MPS server, the GPU's client task at that moment. The place on
//! the GPU and the XID it follows from are decoded from the same text
//! (`model::attribution`).
//!
//! Runs in the kernel log reader's thread, once per XID line, so everything is bounded and
//! cached: one `stat` of `/proc/<pid>` per XID, the cgroup and `comm` read once per process
//! (a new process on a reused pid has a new procfs inode and is read again), and the agent's
//! task list asked at most every [`AGENT_REFRESH`] and only for a task it did not list before,
//! with a short deadline: a storm of one task's XIDs costs one cgroup read and one agent call.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::aws::agent::{Agent, AgentTask};
use crate::model::attribution::{Culprit, Via, XidContext, decode_after, decode_site};
use crate::probe::kmsg::KernelXid;
use crate::probe::tasks::{Placement, name_tasks, placement_of};

/// The process name the MPS server runs under, as the kernel keeps it (`comm`: the first 15
/// bytes of `nvidia-cuda-mps-server`; the control daemon's is the same, and neither runs
/// CUDA work of its own).
pub const MPS_SERVER_COMM: &str = "nvidia-cuda-mps";

/// Least time between two questions to the ECS agent.
pub const AGENT_REFRESH: Duration = Duration::from_secs(5);

/// The agent's deadline here: the kernel log reader waits for it.
pub const AGENT_DEADLINE: Duration = Duration::from_secs(1);

/// At most this many processes and tasks are remembered.
const MAX_CACHED: usize = 4096;

pub use crate::policy::xid_catalog::attributable;

/// Whether an XID line may be charged through the GPU's MPS clients: an application-class XID
/// whose line names the MPS server, or no process at all (then `/proc/<pid>/comm` may).
pub fn may_name_the_server(x: &KernelXid) -> bool {
    attributable(x.code)
        && x.process
            .as_deref()
            .is_none_or(|p| p.starts_with(MPS_SERVER_COMM))
}

/// One process as read once.
struct Process {
    /// `/proc/<pid>`'s inode and change time: another process on the same pid differs.
    id: (u64, i64),
    comm: String,
    placement: Result<Placement, String>,
}

/// The culprit finder of the kernel log reader.
pub struct Attributor {
    proc_root: PathBuf,
    agent: Option<Agent>,
    processes: HashMap<u32, Process>,
    tasks: HashMap<String, AgentTask>,
    asked: Option<Instant>,
    runtime: Option<tokio::runtime::Runtime>,
    /// cgroup files read (for the bench and tests).
    pub reads: u64,
}

impl Attributor {
    /// `agent_url`: the ECS agent's introspection API (None: tasks are named by id only).
    pub fn new(proc_root: &Path, agent_url: Option<&str>) -> Attributor {
        Attributor {
            proc_root: proc_root.to_path_buf(),
            agent: agent_url.map(|u| Agent::new(u).with_timeout(AGENT_DEADLINE)),
            processes: HashMap::new(),
            tasks: HashMap::new(),
            asked: None,
            runtime: None,
            reads: 0,
        }
    }

    /// What the XID line tells beyond its code. `clients`: the MPS client pids and their
    /// task ids on the XID's GPU at the last poll.
    pub fn context(
        &mut self,
        x: &KernelXid,
        clients: Option<&(Vec<u32>, Vec<String>)>,
    ) -> XidContext {
        let mut ctx = XidContext {
            culprit: None,
            site: decode_site(x.code, &x.text),
            after: decode_after(&x.text),
        };
        if attributable(x.code) {
            ctx.culprit = self.culprit(x, clients);
        }
        ctx
    }

    fn culprit(
        &mut self,
        x: &KernelXid,
        clients: Option<&(Vec<u32>, Vec<String>)>,
    ) -> Option<Culprit> {
        let named = x.process.clone().unwrap_or_default();
        let proc = x.pid.and_then(|p| {
            self.process(p)
                .map(|q| (q.comm.clone(), q.placement.clone()))
        });
        let comm = proc.as_ref().map(|(c, _)| c.as_str());
        let is_server = named.starts_with(MPS_SERVER_COMM)
            || (named.is_empty() && comm.is_some_and(|c| c.starts_with(MPS_SERVER_COMM)));
        if is_server {
            return Some(self.mps_client(clients));
        }
        if x.pid.is_none() && named.is_empty() {
            return None;
        }
        let mut c = Culprit::program(
            if named.is_empty() {
                comm.unwrap_or("")
            } else {
                &named
            },
            x.pid,
        );
        match proc {
            None => c.why = Some("exited before it could be looked up".into()),
            // The kernel prints `comm` too: a different one is another program on a reused pid.
            Some((comm, _)) if !named.is_empty() && !same_comm(&named, &comm) => {
                c.why = Some(format!(
                    "pid {} now runs {comm:?}: the process that faulted exited and its pid was reused",
                    x.pid.unwrap_or(0)
                ));
            }
            Some((_, Err(why))) => c.why = Some(why),
            Some((_, Ok(p))) => self.name_task(&mut c, x.pid.unwrap_or(0), p),
        }
        Some(c)
    }

    /// The driver named the MPS server: the GPU's client task, when it had one.
    fn mps_client(&mut self, clients: Option<&(Vec<u32>, Vec<String>)>) -> Culprit {
        let (pids, tasks) = clients.cloned().unwrap_or_default();
        let mut c = Culprit::program("", None);
        c.via = Via::MpsClient;
        match (tasks.as_slice(), pids.as_slice()) {
            ([_], _) => {
                // The pids of that one task: the first one placed in it names the program.
                let placed = pids.iter().find_map(|p| {
                    let q = self.process(*p)?;
                    let comm = q.comm.clone();
                    q.placement.clone().ok().map(|pl| (*p, comm, pl))
                });
                match placed {
                    Some((pid, comm, placement)) => {
                        c.program = comm;
                        c.pid = Some(pid);
                        self.name_task(&mut c, pid, placement);
                    }
                    None => c.task = tasks.first().cloned(),
                }
            }
            ([], [pid]) => {
                c.pid = Some(*pid);
                c.program = self
                    .process(*pid)
                    .map(|q| q.comm.clone())
                    .unwrap_or_default();
                c.why = Some("not in an ECS task".into());
            }
            _ => {
                c.via = Via::MpsAmbiguous;
                c.candidates = if tasks.is_empty() {
                    pids.iter().map(|p| format!("pid {p}")).collect()
                } else {
                    tasks
                };
            }
        }
        c
    }

    /// Sets the task, its definition and container from the process's placement and the
    /// agent's list.
    fn name_task(&mut self, c: &mut Culprit, pid: u32, p: Placement) {
        if let Some(id) = &p.task_id
            && !self.tasks.contains_key(id)
        {
            self.refresh();
        }
        let tasks: Vec<AgentTask> = p
            .task_id
            .as_ref()
            .and_then(|id| self.tasks.get(id).cloned())
            .into_iter()
            .collect();
        let agent: Result<&[AgentTask], &str> = if self.agent.is_some() {
            Ok(&tasks)
        } else {
            Err("no agent URL configured")
        };
        let naming = name_tasks(&[(pid, Ok(p))], agent);
        match naming.tasks.into_iter().next() {
            Some(t) => {
                c.task = Some(t.target);
                c.definition = t.definition;
                c.container = t.containers.into_iter().next();
                if c.definition.is_none() {
                    c.why = t.note;
                }
            }
            None => c.why = naming.unresolved.into_iter().next().map(|(_, w)| w),
        }
    }

    /// Asks the agent for its tasks, at most every [`AGENT_REFRESH`].
    fn refresh(&mut self) {
        let Some(agent) = self.agent.clone() else {
            return;
        };
        if self.asked.is_some_and(|t| t.elapsed() < AGENT_REFRESH) {
            return;
        }
        self.asked = Some(Instant::now());
        if self.runtime.is_none() {
            self.runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| tracing::warn!(probe = "kmsg", "no runtime to ask the ECS agent: {e}"))
                .ok();
        }
        let Some(rt) = &self.runtime else { return };
        match rt.block_on(agent.tasks()) {
            Ok(list) => {
                self.tasks.clear();
                for t in list.into_iter().take(MAX_CACHED) {
                    self.tasks.insert(t.id().to_string(), t);
                }
            }
            Err(e) => tracing::debug!(probe = "kmsg", "ECS agent: {e}"),
        }
    }

    /// The process on `pid` now, read once per process; None when it is gone.
    fn process(&mut self, pid: u32) -> Option<&Process> {
        let dir = self.proc_root.join(pid.to_string());
        let id = crate::probe::tasks::proc_identity(&self.proc_root, pid)?;
        if self.processes.get(&pid).is_none_or(|p| p.id != id) {
            if self.processes.len() >= MAX_CACHED {
                self.processes.clear();
            }
            self.reads += 1;
            let comm = crate::sys::limits::read_pseudo(&dir.join("comm"), 256, "a process name")
                .map(|t| t.trim_end_matches('\n').to_string())
                .unwrap_or_default();
            let placement = placement_of(&self.proc_root, pid);
            self.processes.insert(
                pid,
                Process {
                    id,
                    comm,
                    placement,
                },
            );
        }
        self.processes.get(&pid)
    }
}

/// Whether the driver's `name=` and `/proc/<pid>/comm` are one name (the kernel keeps 15
/// bytes; the driver may print fewer, a U+FFFD where a byte was not UTF-8).
fn same_comm(printed: &str, comm: &str) -> bool {
    let a: Vec<char> = printed.chars().take(15).collect();
    let b: Vec<char> = comm.chars().take(15).collect();
    a == b || (!a.is_empty() && b.starts_with(&a)) || (!b.is_empty() && a.starts_with(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proc_with(dir: &Path, pid: u32, comm: &str, cgroup: &str) {
        std::fs::create_dir_all(dir.join(pid.to_string())).unwrap();
        std::fs::write(dir.join(format!("{pid}/comm")), format!("{comm}\n")).unwrap();
        std::fs::write(dir.join(format!("{pid}/cgroup")), cgroup).unwrap();
    }

    fn xid(code: u32, pid: Option<u32>, name: Option<&str>, text: &str) -> KernelXid {
        KernelXid {
            seq: 0,
            pci: "0000:3b:00".into(),
            code,
            pid,
            process: name.map(str::to_string),
            text: text.into(),
        }
    }

    const V2: &str = "0::/ecstasks.slice/ecstasks-abc123.slice/docker-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n";

    #[test]
    fn a_process_in_a_task_is_charged_to_its_task_and_read_once() {
        let dir = tempfile::tempdir().unwrap();
        proc_with(dir.path(), 4242, "python3", V2);
        let mut a = Attributor::new(dir.path(), None);
        let x = xid(
            13,
            Some(4242),
            Some("python3"),
            "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Illegal Instruction Encoding",
        );
        for _ in 0..100 {
            let ctx = a.context(&x, None);
            let c = ctx.culprit.unwrap();
            assert_eq!(c.task.as_deref(), Some("abc123"));
            assert_eq!(c.unit(), "task abc123");
            assert_eq!(ctx.site.unwrap().key().as_deref(), Some("GPC 1, TPC 2"));
        }
        assert_eq!(a.reads, 1, "one read per process, however many XIDs");
    }

    #[test]
    fn a_gone_or_reused_pid_leaves_the_program_as_the_unit() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = Attributor::new(dir.path(), None);
        let c = a
            .context(&xid(31, Some(7), Some("python3"), ""), None)
            .culprit
            .unwrap();
        assert_eq!(c.unit(), "program python3");
        assert!(c.why.unwrap().contains("exited"));
        proc_with(dir.path(), 8, "nginx", V2);
        let c = a
            .context(&xid(31, Some(8), Some("python3"), ""), None)
            .culprit
            .unwrap();
        assert_eq!(
            c.unit(),
            "program python3",
            "the pid belongs to another program now"
        );
        assert!(c.why.unwrap().contains("reused"));
        // A name with bytes that were not UTF-8 (read lossily) is still one program.
        let c = a
            .context(&xid(13, Some(9), Some("tr\u{fffd}in"), ""), None)
            .culprit
            .unwrap();
        assert_eq!(c.unit(), "program tr\u{fffd}in");
    }

    #[test]
    fn the_mps_server_is_charged_to_the_gpus_only_client_task_or_no_one() {
        let dir = tempfile::tempdir().unwrap();
        proc_with(dir.path(), 500, "worker", V2);
        let mut a = Attributor::new(dir.path(), None);
        let x = xid(
            31,
            Some(100),
            Some("nvidia-cuda-mps"),
            "MMU Fault: ENGINE GRAPHICS GPC3 GPCCLIENT_T1_0 faulted @ 0x1000",
        );
        let one = (vec![500], vec!["abc123".to_string()]);
        let c = a.context(&x, Some(&one)).culprit.unwrap();
        assert_eq!(c.via, Via::MpsClient);
        assert_eq!(c.unit(), "task abc123");
        assert_eq!(c.pid, Some(500));
        let two = (
            vec![500, 501],
            vec!["abc123".to_string(), "def456".to_string()],
        );
        let c = a.context(&x, Some(&two)).culprit.unwrap();
        assert_eq!(c.via, Via::MpsAmbiguous);
        assert!(!c.is_attributed());
        assert_eq!(c.candidates.len(), 2);
    }

    #[test]
    fn only_application_class_xids_are_attributed() {
        for code in [13, 31, 43, 45, 68, 69] {
            assert!(attributable(code), "{code}");
        }
        for code in [48, 63, 79, 94, 95, 119, 154] {
            assert!(!attributable(code), "{code}");
        }
        let mut a = Attributor::new(Path::new("/nonexistent"), None);
        assert!(
            a.context(&xid(79, Some(1), Some("x"), ""), None)
                .culprit
                .is_none()
        );
    }
}
