//! Which ECS task and container a process belongs to, so an incident can name the tasks that
//! were on a faulting GPU and stop-tasks can stop exactly those.
//!
//! Two steps (docs/mps.md#client-pid-to-ecs-task): `/proc/<pid>/cgroup` gives the task id
//! (when ECS made task cgroups) and the Docker container id; the ECS agent's introspection
//! `/v1/tasks` maps the container id to its task ARN, family and container name. Layouts: cgroup
//! v2 with task limits `0::/ecstasks.slice/ecstasks-<taskId>.slice/docker-<id>.scope`; cgroup v1
//! `/ecs/<taskId>/<id>`; without task cgroups Docker's own `docker-<id>.scope` or `/docker/<id>`,
//! where only the agent knows the task. A pid that cannot be named is named by pid with why.

use std::path::{Path, PathBuf};

use crate::aws::agent::{Agent, AgentTask, task_id_from_cgroup};
use crate::model::{Observation, Signal};

/// The ECS task ids of `pids`, in order, without duplicates; processes outside ECS tasks or
/// already gone are left out. Reads each cgroup (bounded) every call: the NVML poller uses
/// [`Placements`], which reads it once per process.
pub fn task_ids(proc_root: &Path, pids: &[u32]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for pid in pids {
        let path = proc_root.join(pid.to_string()).join("cgroup");
        let Ok(text) = crate::sys::limits::read_pseudo(&path, CGROUP_FILE_MAX, "a cgroup file")
        else {
            continue;
        };
        if let Some(id) = task_id_from_cgroup(&text)
            && !out.contains(&id)
        {
            out.push(id);
        }
    }
    out
}

/// Every this many polls a cached pid is checked to be the same process (spread over the
/// polls by pid): the bound on how long a pid reused by another MPS client between two polls
/// keeps the first one's task (at the default 10 s poll, 60 s).
pub const REVALIDATE_POLLS: u64 = 6;

/// The task and container of the NVML poller's MPS clients, by pid: each process's
/// `/proc/<pid>/cgroup` is read once in its life (bounded: [`CGROUP_FILE_MAX`]), not twice
/// a poll. A pid is forgotten at the end of the first poll whose client lists do not name
/// it. A cached pid is checked every [`REVALIDATE_POLLS`] polls with one `stat` of
/// `/proc/<pid>`: its inode number and change time are those of the process's procfs
/// directory, which a new process with the same pid never shares (procfs makes a new inode
/// for a new process), so a reused pid is read again; a process that moved between cgroups
/// is seen the same way at most when its procfs inode is made again. A cgroup that could not
/// be read (other than gone) is read again at that check.
#[derive(Debug)]
pub struct Placements {
    proc_root: PathBuf,
    entries: std::collections::HashMap<u32, Placed>,
    poll: u64,
    /// cgroup files read since the start (for the bench and tests).
    reads: u64,
}

/// One cached pid.
#[derive(Debug)]
struct Placed {
    /// `/proc/<pid>`'s (inode, change time in ns).
    id: (u64, i64),
    /// (task id, container id); None: not in an ECS task.
    placement: Option<(String, Option<String>)>,
    /// The cgroup could not be read: read it again at the next check.
    unread: bool,
    seen: u64,
}

impl Placements {
    pub fn new(proc_root: &Path) -> Placements {
        Placements {
            proc_root: proc_root.to_path_buf(),
            entries: std::collections::HashMap::new(),
            poll: 0,
            reads: 0,
        }
    }

    /// Starts a poll.
    pub fn begin_poll(&mut self) {
        self.poll += 1;
    }

    /// Ends a poll: pids no client list named in it are forgotten.
    pub fn end_poll(&mut self) {
        let poll = self.poll;
        self.entries.retain(|_, e| e.seen == poll);
    }

    /// Places every pid of `pids` not placed yet (or due for its check).
    pub fn resolve(&mut self, pids: &[u32]) {
        for &pid in pids {
            let due = (self.poll.wrapping_add(u64::from(pid))).is_multiple_of(REVALIDATE_POLLS);
            let keep = match self.entries.get(&pid) {
                Some(_) if !due => true,
                Some(e) => !e.unread && self.proc_id(pid) == Some(e.id),
                None => false,
            };
            match self.entries.get_mut(&pid) {
                Some(e) if keep => e.seen = self.poll,
                _ => self.read(pid),
            }
        }
    }

    /// The (task id, container id) of a placed pid; None when it is in no ECS task, gone,
    /// or not placed.
    pub fn get(&self, pid: u32) -> Option<(&str, Option<&str>)> {
        self.entries
            .get(&pid)
            .and_then(|e| e.placement.as_ref())
            .map(|(t, c)| (t.as_str(), c.as_deref()))
    }

    /// The ECS task ids of `pids` (placed), in order, without duplicates.
    pub fn task_ids(&self, pids: &[u32]) -> Vec<String> {
        let mut seen = std::collections::HashSet::new();
        pids.iter()
            .filter_map(|p| self.get(*p))
            .filter(|(t, _)| seen.insert(*t))
            .map(|(t, _)| t.to_string())
            .collect()
    }

    /// Pids cached now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// cgroup files read since the start.
    pub fn reads(&self) -> u64 {
        self.reads
    }

    fn proc_id(&self, pid: u32) -> Option<(u64, i64)> {
        proc_identity(&self.proc_root, pid)
    }

    /// Reads a pid's cgroup (its procfs identity first, so a process that replaces it
    /// between the two is caught at the next check); a pid already gone is not cached.
    fn read(&mut self, pid: u32) {
        let Some(id) = self.proc_id(pid) else {
            self.entries.remove(&pid);
            return;
        };
        self.reads += 1;
        let path = self.proc_root.join(pid.to_string()).join("cgroup");
        let (placement, unread) =
            match crate::sys::limits::read_pseudo(&path, CGROUP_FILE_MAX, "a cgroup file") {
                Ok(text) => (
                    crate::aws::agent::task_and_container_from_cgroup(&text),
                    false,
                ),
                Err(e) if e.is_not_found() => {
                    self.entries.remove(&pid);
                    return;
                }
                Err(_) => (None, true),
            };
        self.entries.insert(
            pid,
            Placed {
                id,
                placement,
                unread,
                seen: self.poll,
            },
        );
    }
}

/// A process the NVML poller saw on a GPU, as the kernel had it then: so that an XID whose
/// process exited before the kernel log reader could look at it is still charged to the
/// right task, and never to the process that took its pid since.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenProc {
    /// Its start (clock ticks after boot): a record stamped before it is not its own.
    pub start_ticks: u64,
    /// (task id, container id) from its cgroup; None: in no ECS task.
    pub placement: Option<(String, Option<String>)>,
    /// Its executable (`<device>:<inode> <path>`), for a process in no task.
    pub exe: Option<String>,
    pub comm: Vec<u8>,
    /// `/proc/<pid>`'s identity when it was seen ([`proc_identity`]).
    id: (u64, i64),
    /// The poll that last saw it.
    poll: u64,
}

/// The processes the NVML poller saw on the GPUs, by pid: at most [`SEEN_MAX`], each kept
/// for [`SEEN_POLLS`] polls after the last that listed it (a process that faulted and exited
/// between two polls is still known when its XID is read), the stalest dropped first.
#[derive(Debug, Default)]
pub struct SeenProcs {
    by_pid: std::collections::HashMap<u32, SeenProc>,
    poll: u64,
}

/// At most this many processes are remembered.
pub const SEEN_MAX: usize = 4096;
/// How many polls a process is remembered after the last that listed it.
pub const SEEN_POLLS: u64 = 30;

impl SeenProcs {
    /// Starts a poll: what was not listed for [`SEEN_POLLS`] polls is forgotten.
    pub fn begin_poll(&mut self) {
        self.poll += 1;
        let poll = self.poll;
        self.by_pid
            .retain(|_, p| poll.saturating_sub(p.poll) <= SEEN_POLLS);
    }

    /// Notes `pid` as listed on a GPU this poll, placed as `placement`: read once per process
    /// (one `stat` to know it is the same one).
    pub fn note(&mut self, proc_root: &Path, pid: u32, placement: Option<(&str, Option<&str>)>) {
        let Some(id) = proc_identity(proc_root, pid) else {
            return;
        };
        if let Some(p) = self.by_pid.get_mut(&pid)
            && p.id == id
        {
            p.poll = self.poll;
            return;
        }
        let Some(stat) = crate::sys::procfs::stat(proc_root, pid) else {
            return;
        };
        let placement = placement.map(|(t, c)| (t.to_string(), c.map(str::to_string)));
        let exe = if placement.is_none() {
            exe_unit(proc_root, pid)
        } else {
            None
        };
        if self.by_pid.len() >= SEEN_MAX
            && !self.by_pid.contains_key(&pid)
            && let Some(stalest) = self
                .by_pid
                .iter()
                .min_by_key(|(_, p)| p.poll)
                .map(|(k, _)| *k)
        {
            self.by_pid.remove(&stalest);
        }
        self.by_pid.insert(
            pid,
            SeenProc {
                start_ticks: stat.start_ticks,
                placement,
                exe,
                comm: comm_bytes(proc_root, pid).unwrap_or_default(),
                id,
                poll: self.poll,
            },
        );
    }

    pub fn get(&self, pid: u32) -> Option<SeenProc> {
        self.by_pid.get(&pid).cloned()
    }
}

impl SeenProc {
    /// A seen process, for tests elsewhere in the crate.
    #[cfg(test)]
    pub(crate) fn for_test(
        start_ticks: u64,
        placement: Option<(&str, Option<&str>)>,
        exe: Option<&str>,
        comm: &[u8],
    ) -> SeenProc {
        SeenProc {
            start_ticks,
            placement: placement.map(|(t, c)| (t.to_string(), c.map(str::to_string))),
            exe: exe.map(str::to_string),
            comm: comm.to_vec(),
            id: (0, 0),
            poll: 0,
        }
    }
}

impl SeenProcs {
    pub fn len(&self) -> usize {
        self.by_pid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_pid.is_empty()
    }
}

/// A process's `comm` as the kernel keeps it, raw (its trailing newline dropped).
pub fn comm_bytes(proc_root: &Path, pid: u32) -> Option<Vec<u8>> {
    let mut b = crate::sys::limits::read_head(
        &proc_root.join(pid.to_string()).join("comm"),
        64,
        "a process name",
    )
    .ok()?;
    if b.last() == Some(&b'\n') {
        b.pop();
    }
    Some(b)
}

/// The unit of a process in no ECS task: its executable as the kernel knows the file,
/// `<device>:<inode> <path>` (the path as the process sees it, for reading only: the device
/// and inode are what tell two programs apart).
pub fn exe_unit(proc_root: &Path, pid: u32) -> Option<String> {
    let exe = crate::sys::procfs::exe(proc_root, pid)?;
    let path = crate::sys::procfs::exe_path(proc_root, pid).unwrap_or_default();
    Some(format!(
        "{} {}",
        exe.id,
        crate::mps::control::clip(&path, 200)
    ))
}

/// A process's procfs identity: `/proc/<pid>`'s inode number and change time (one `stat`),
/// which a new process with the same pid never shares; None when it is gone.
pub fn proc_identity(proc_root: &Path, pid: u32) -> Option<(u64, i64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(proc_root.join(pid.to_string())).ok()?;
    Some((
        m.ino(),
        // An identity, not a count: wrapping keeps it distinct without overflowing.
        m.ctime()
            .wrapping_mul(1_000_000_000)
            .wrapping_add(m.ctime_nsec()),
    ))
}

/// The Docker container id in a cgroup file's text: the last path part that is
/// `docker-<id>.scope` (systemd driver), or the part after `docker` or after `ecs/<taskId>`
/// (cgroupfs driver). Ids are hex, 12 to 64 digits.
pub fn container_id_from_cgroup(text: &str) -> Option<String> {
    for line in text.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
        for (i, part) in parts.iter().enumerate().rev() {
            let candidate = if let Some(rest) = part.strip_prefix("docker-") {
                rest.strip_suffix(".scope")
            } else if (i >= 1 && parts[i - 1] == "docker") || (i >= 2 && parts[i - 2] == "ecs") {
                Some(*part)
            } else {
                None
            };
            if let Some(id) = candidate
                && is_container_id(id)
            {
                return Some(id.to_string());
            }
        }
    }
    None
}

fn is_container_id(s: &str) -> bool {
    (12..=64).contains(&s.len()) && s.chars().all(|c| c.is_ascii_hexdigit())
}

/// Where a process runs, as far as its cgroup tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub task_id: Option<String>,
    pub container_id: Option<String>,
}

/// The task and container of one process, or why there is none (gone, unreadable, in no
/// container at all).
pub fn placement_of(proc_root: &Path, pid: u32) -> Result<Placement, String> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    let text = match crate::sys::limits::read_pseudo(&path, CGROUP_FILE_MAX, "a cgroup file") {
        Ok(t) => t,
        Err(crate::sys::limits::ReadError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return Err("exited before it could be looked up".into());
        }
        Err(e) => return Err(format!("{}: {e}", path.display())),
    };
    let p = Placement {
        task_id: task_id_from_cgroup(&text),
        container_id: container_id_from_cgroup(&text),
    };
    if p.task_id.is_none() && p.container_id.is_none() {
        let first = text.lines().next().unwrap_or("").trim();
        return Err(format!(
            "not in a container: cgroup {}",
            crate::mps::control::clip(first, 120)
        ));
    }
    Ok(p)
}

/// `/proc/<pid>/cgroup` has one line per hierarchy (a dozen under v1): 64 KiB is plenty.
const CGROUP_FILE_MAX: u64 = 64 << 10;

/// One task named for an incident.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedTask {
    /// What StopTask is given: the task ARN from the agent, or the task id from the cgroup
    /// when the agent did not know it (StopTask takes either).
    pub target: String,
    /// `family:revision`, from the agent.
    pub definition: Option<String>,
    /// The containers of the task the pids run in (names from the task definition).
    pub containers: Vec<String>,
    pub pids: Vec<u32>,
    /// Why the agent did not tell more, when it did not.
    pub note: Option<String>,
}

impl std::fmt::Display for NamedTask {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (", self.target)?;
        if let Some(d) = &self.definition {
            write!(f, "{d}; ")?;
        }
        if !self.containers.is_empty() {
            write!(f, "container {}; ", self.containers.join(", "))?;
        }
        let pids: Vec<String> = self.pids.iter().map(u32::to_string).collect();
        write!(f, "pid {}", pids.join(", "))?;
        if let Some(n) = &self.note {
            write!(f, "; {n}")?;
        }
        f.write_str(")")
    }
}

/// The tasks of a set of pids, and the pids that could not be named, with why.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Naming {
    pub tasks: Vec<NamedTask>,
    pub unresolved: Vec<(u32, String)>,
}

/// Names the tasks of `placements` with the agent's task list (or why there is none). Pure:
/// the cgroups were read and the agent asked by the caller.
pub fn name_tasks(
    placements: &[(u32, Result<Placement, String>)],
    agent: Result<&[AgentTask], &str>,
) -> Naming {
    let mut out = Naming::default();
    for (pid, placement) in placements {
        let p = match placement {
            Ok(p) => p,
            Err(why) => {
                out.unresolved.push((*pid, why.clone()));
                continue;
            }
        };
        let short = |c: &str| c.chars().take(12).collect::<String>();
        let found = match agent {
            Ok(tasks) => {
                let by_container = p.container_id.as_deref().and_then(|c| {
                    tasks
                        .iter()
                        .find_map(|t| t.container(c).map(|k| (t, Some(k.name.clone()))))
                });
                let by_task = || {
                    p.task_id
                        .as_deref()
                        .and_then(|id| tasks.iter().find(|t| t.id() == id).map(|t| (t, None)))
                };
                match by_container.or_else(by_task) {
                    Some((t, container)) => Ok((
                        t.arn.clone(),
                        Some(format!("{}:{}", t.family, t.version)),
                        container,
                        None,
                    )),
                    None => Err(format!(
                        "the ECS agent lists no task with {}",
                        match (&p.container_id, &p.task_id) {
                            (Some(c), _) => format!("container {}", short(c)),
                            (None, Some(t)) => format!("id {t}"),
                            (None, None) => "it".into(),
                        }
                    )),
                }
            }
            Err(why) => Err(format!("ECS agent: {why}")),
        };
        let (target, definition, container, note) = match (found, &p.task_id) {
            (Ok(named), _) => named,
            // Stoppable by its id even though the agent could not tell more.
            (Err(why), Some(id)) => (id.clone(), None, None, Some(why)),
            (Err(why), None) => {
                let c = p.container_id.as_deref().map(short).unwrap_or_default();
                out.unresolved
                    .push((*pid, format!("container {c}, not an ECS task's: {why}")));
                continue;
            }
        };
        match out.tasks.iter_mut().find(|t| t.target == target) {
            Some(t) => {
                if let Some(c) = container
                    && !t.containers.contains(&c)
                {
                    t.containers.push(c);
                }
                if !t.pids.contains(pid) {
                    t.pids.push(*pid);
                }
            }
            None => out.tasks.push(NamedTask {
                target,
                definition,
                containers: container.into_iter().collect(),
                pids: vec![*pid],
                note,
            }),
        }
    }
    out
}

/// Names the tasks of server faults as they are read: cgroups first (at once, while the
/// poisoned clients still run), then one `/v1/tasks` for all of them.
#[derive(Debug, Clone)]
pub struct TaskNamer {
    proc_root: PathBuf,
    /// None: no agent to ask (tasks are named by the ids in their cgroups only).
    agent: Option<Agent>,
}

impl TaskNamer {
    pub fn new(agent: Option<Agent>) -> TaskNamer {
        TaskNamer {
            proc_root: PathBuf::from("/proc"),
            agent,
        }
    }

    /// Reads cgroups under another `/proc` (unit tests).
    #[cfg(test)]
    pub fn with_proc_root(mut self, proc_root: &Path) -> TaskNamer {
        self.proc_root = proc_root.to_path_buf();
        self
    }

    /// Sets `tasks` (what stop-tasks stops) and extends the detail of every server fault in
    /// `obs` that names client pids, of every process outside MPS (`mps-bypass`), and of each
    /// client MPS's own view found out of place (`mps-client-not-on-gpu`,
    /// `mps-client-no-server`, `mps-wrong-server`); other observations are left as they are.
    pub async fn name(&self, obs: &mut [Observation]) {
        let wanted = |o: &Observation| {
            matches!(
                o.signal,
                Signal::MpsServerFault
                    | Signal::MpsBypass
                    | Signal::MpsClientNotOnGpu
                    | Signal::MpsClientNoServer
                    | Signal::MpsWrongServer
            ) && !o.pids.is_empty()
                && o.tasks.is_empty()
        };
        let mut placements: Vec<(u32, Result<Placement, String>)> = Vec::new();
        for o in obs.iter().filter(|o| wanted(o)) {
            for pid in &o.pids {
                if !placements.iter().any(|(p, _)| p == pid) {
                    placements.push((*pid, placement_of(&self.proc_root, *pid)));
                }
            }
        }
        if placements.is_empty() {
            return;
        }
        let agent: Result<Vec<AgentTask>, String> = if placements.iter().all(|(_, p)| p.is_err()) {
            Ok(Vec::new())
        } else {
            match &self.agent {
                Some(a) => a.tasks().await.map_err(|e| e.to_string()),
                None => Err("no agent URL configured".into()),
            }
        };
        if let Err(e) = &agent {
            tracing::warn!(probe = "mps", "naming the tasks of a server fault: {e}");
        }
        for o in obs.iter_mut().filter(|o| wanted(o)) {
            let mine: Vec<(u32, Result<Placement, String>)> = placements
                .iter()
                .filter(|(p, _)| o.pids.contains(p))
                .cloned()
                .collect();
            let naming = name_tasks(&mine, agent.as_deref().map_err(String::as_str));
            apply(o, &naming);
        }
    }
}

/// Writes a naming into an observation: the targets into `tasks`, the names into the detail.
fn apply(o: &mut Observation, naming: &Naming) {
    o.tasks = naming.tasks.iter().map(|t| t.target.clone()).collect();
    let mut detail = o.detail.take().unwrap_or_default();
    if !naming.tasks.is_empty() {
        let named: Vec<String> = naming.tasks.iter().map(NamedTask::to_string).collect();
        detail.push_str(&format!("; ECS tasks: {}", named.join(", ")));
    }
    if !naming.unresolved.is_empty() {
        let why: Vec<String> = naming
            .unresolved
            .iter()
            .map(|(pid, why)| format!("pid {pid} ({why})"))
            .collect();
        detail.push_str(&format!("; no ECS task for {}", why.join(", ")));
    }
    o.detail = Some(detail);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_v2_ecs_task_slice() {
        let t = "0::/ecstasks.slice/ecstasks-3f1c9c2e8a7b4d0f9e6a5b4c3d2e1f0a.slice/docker-0123abcd.scope\n";
        assert_eq!(
            task_id_from_cgroup(t).as_deref(),
            Some("3f1c9c2e8a7b4d0f9e6a5b4c3d2e1f0a")
        );
    }

    #[test]
    fn cgroup_v1_ecs_path() {
        let t =
            "12:memory:/ecs/5d2f0e7c1b9a4c8e/abcdef0123\n11:cpu:/ecs/5d2f0e7c1b9a4c8e/abcdef0123\n";
        assert_eq!(task_id_from_cgroup(t).as_deref(), Some("5d2f0e7c1b9a4c8e"));
    }

    #[test]
    fn the_container_id_comes_with_the_task_in_both_layouts() {
        use crate::aws::agent::task_and_container_from_cgroup;
        let v2 = "0::/ecstasks.slice/ecstasks-aa11.slice/docker-0123abcd.scope\n";
        assert_eq!(
            task_and_container_from_cgroup(v2),
            Some(("aa11".into(), Some("0123abcd".into())))
        );
        let v1 = "8:pids:/ecs/bb22/c0ffee\n";
        assert_eq!(
            task_and_container_from_cgroup(v1),
            Some(("bb22".into(), Some("c0ffee".into())))
        );
        assert_eq!(
            task_and_container_from_cgroup("8:pids:/ecs/bb22\n"),
            Some(("bb22".into(), None))
        );
    }

    #[test]
    fn processes_outside_ecs_have_no_task() {
        assert_eq!(task_id_from_cgroup("0::/system.slice/sshd.service\n"), None);
        assert_eq!(task_id_from_cgroup("0::/user.slice/user-0.slice\n"), None);
    }

    const CID_A: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";
    const CID_B: &str = "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";
    const CID_C: &str = "1234567890abcdef1234567890abcdef1234567890abcdef1234567890abcdef";

    #[test]
    fn container_ids_in_every_documented_layout() {
        for (text, want) in [
            (
                format!("0::/ecstasks.slice/ecstasks-aa11.slice/docker-{CID_A}.scope\n"),
                Some(CID_A),
            ),
            (format!("12:memory:/ecs/aa11/{CID_A}\n"), Some(CID_A)),
            (
                format!("0::/system.slice/docker-{CID_B}.scope\n"),
                Some(CID_B),
            ),
            (format!("4:pids:/docker/{CID_B}\n"), Some(CID_B)),
            ("0::/system.slice/docker.service\n".into(), None),
            ("0::/ecs/aa11\n".into(), None),
            ("0::/system.slice/docker-xyz.scope\n".into(), None),
            ("garbage without colons".into(), None),
        ] {
            assert_eq!(container_id_from_cgroup(&text).as_deref(), want, "{text}");
        }
    }

    fn proc_tree(entries: &[(u32, String)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (pid, cg) in entries {
            std::fs::create_dir_all(dir.path().join(pid.to_string())).unwrap();
            std::fs::write(dir.path().join(format!("{pid}/cgroup")), cg).unwrap();
        }
        dir
    }

    #[test]
    fn one_pid_is_placed_or_says_why_not() {
        let dir = proc_tree(&[
            (
                10,
                format!("0::/ecstasks.slice/ecstasks-aa11.slice/docker-{CID_A}.scope\n"),
            ),
            (12, "0::/system.slice/sshd.service\n".into()),
        ]);
        let p = placement_of(dir.path(), 10).unwrap();
        assert_eq!(p.task_id.as_deref(), Some("aa11"));
        assert_eq!(p.container_id.as_deref(), Some(CID_A));
        let e = placement_of(dir.path(), 11).unwrap_err();
        assert!(e.contains("exited"), "{e}");
        let e = placement_of(dir.path(), 12).unwrap_err();
        assert!(
            e.contains("not in a container") && e.contains("sshd"),
            "{e}"
        );
    }

    fn task(arn: &str, containers: &[(&str, &str)]) -> AgentTask {
        AgentTask {
            arn: arn.into(),
            family: "trainer".into(),
            version: "3".into(),
            desired_status: "RUNNING".into(),
            known_status: "RUNNING".into(),
            containers: containers
                .iter()
                .map(|(id, name)| crate::aws::agent::AgentContainer {
                    docker_id: id.to_string(),
                    docker_name: format!("ecs-{name}"),
                    name: name.to_string(),
                })
                .collect(),
        }
    }

    fn placed(task: Option<&str>, container: Option<&str>) -> Result<Placement, String> {
        Ok(Placement {
            task_id: task.map(str::to_string),
            container_id: container.map(str::to_string),
        })
    }

    #[test]
    fn the_agent_turns_containers_into_task_arns_and_names() {
        let tasks = [
            task(
                "arn:aws:ecs:us-east-1:1:task/c/aa11",
                &[(CID_A, "main"), (CID_C, "sidecar")],
            ),
            task("arn:aws:ecs:us-east-1:1:task/c/bb22", &[(CID_B, "worker")]),
        ];
        let placements = vec![
            (1, placed(Some("aa11"), Some(CID_A))),
            (2, placed(Some("aa11"), Some(CID_C))),
            // No task cgroups: only the agent knows the task.
            (3, placed(None, Some(CID_B))),
            (4, placed(None, Some(&CID_B.replace('f', "e")))),
            (5, Err("exited before it could be looked up".into())),
            // A task cgroup the agent has forgotten: stoppable by its id.
            (6, placed(Some("cc33"), None)),
        ];
        let n = name_tasks(&placements, Ok(&tasks));
        let targets: Vec<&str> = n.tasks.iter().map(|t| t.target.as_str()).collect();
        assert_eq!(
            targets,
            [
                "arn:aws:ecs:us-east-1:1:task/c/aa11",
                "arn:aws:ecs:us-east-1:1:task/c/bb22",
                "cc33"
            ]
        );
        assert_eq!(
            n.tasks[0].to_string(),
            "arn:aws:ecs:us-east-1:1:task/c/aa11 (trainer:3; container main, sidecar; pid 1, 2)"
        );
        assert_eq!(n.tasks[1].containers, ["worker"]);
        assert!(
            n.tasks[2]
                .note
                .as_deref()
                .unwrap()
                .contains("lists no task with id cc33"),
            "{:?}",
            n.tasks[2]
        );
        assert_eq!(n.unresolved.len(), 2, "{:?}", n.unresolved);
        assert_eq!(n.unresolved[0].0, 4);
        assert!(
            n.unresolved[0].1.contains("not an ECS task's"),
            "{:?}",
            n.unresolved
        );
        assert_eq!(n.unresolved[1].0, 5);
    }

    #[test]
    fn without_the_agent_task_ids_still_name_and_containers_say_why() {
        let placements = vec![
            (1, placed(Some("aa11"), Some(CID_A))),
            (3, placed(None, Some(CID_B))),
        ];
        let n = name_tasks(&placements, Err("connection refused"));
        assert_eq!(n.tasks.len(), 1);
        assert_eq!(n.tasks[0].target, "aa11");
        assert!(
            n.tasks[0]
                .to_string()
                .contains("ECS agent: connection refused")
        );
        assert_eq!(n.unresolved.len(), 1);
        assert!(n.unresolved[0].1.contains("ECS agent: connection refused"));
    }

    #[tokio::test]
    async fn the_namer_fills_server_faults_only_and_asks_no_agent_for_nothing() {
        let dir = proc_tree(&[(
            10,
            format!("0::/ecstasks.slice/ecstasks-aa11.slice/docker-{CID_A}.scope\n"),
        )]);
        // An agent URL nothing listens on: its error is the note.
        let namer =
            TaskNamer::new(Some(Agent::new("http://127.0.0.1:9"))).with_proc_root(dir.path());
        let mut obs = vec![
            Observation::new(Signal::MpsServerFault)
                .with_pids(vec![10, 11])
                .with_detail("fault"),
            Observation::new(Signal::MpsCrash).with_pids(vec![10]),
        ];
        namer.name(&mut obs).await;
        assert_eq!(obs[0].tasks, ["aa11"]);
        let d = obs[0].detail.as_deref().unwrap();
        assert!(d.contains("ECS tasks: aa11 (pid 10; ECS agent:"), "{d}");
        assert!(d.contains("no ECS task for pid 11 (exited"), "{d}");
        assert!(obs[1].tasks.is_empty(), "only server faults name tasks");

        // Only gone pids: nothing to ask the agent (a missing agent is not even noted).
        let mut gone = vec![Observation::new(Signal::MpsServerFault).with_pids(vec![77])];
        TaskNamer::new(None)
            .with_proc_root(dir.path())
            .name(&mut gone)
            .await;
        let d = gone[0].detail.as_deref().unwrap();
        assert_eq!(
            d,
            "; no ECS task for pid 77 (exited before it could be looked up)"
        );
    }

    #[test]
    fn reads_proc_and_skips_vanished_pids() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("10")).unwrap();
        std::fs::write(
            dir.path().join("10/cgroup"),
            "0::/ecstasks.slice/ecstasks-aa11.slice/docker-1.scope\n",
        )
        .unwrap();
        assert_eq!(
            task_ids(dir.path(), &[10, 11, 10]),
            vec!["aa11".to_string()]
        );
    }

    fn write_cgroup(dir: &Path, pid: u32, task: &str) {
        std::fs::create_dir_all(dir.join(pid.to_string())).unwrap();
        std::fs::write(
            dir.join(format!("{pid}/cgroup")),
            format!("0::/ecstasks.slice/ecstasks-{task}.slice/docker-{CID_A}.scope\n"),
        )
        .unwrap();
    }

    fn poll(c: &mut Placements, pids: &[u32]) -> Vec<String> {
        c.begin_poll();
        c.resolve(pids);
        let t = c.task_ids(pids);
        c.end_poll();
        t
    }

    #[test]
    fn placements_read_each_cgroup_once_and_forget_pids_that_leave() {
        let dir = tempfile::tempdir().unwrap();
        write_cgroup(dir.path(), 10, "aa11");
        write_cgroup(dir.path(), 11, "bb22");
        std::fs::create_dir_all(dir.path().join("12")).unwrap();
        std::fs::write(
            dir.path().join("12/cgroup"),
            "0::/system.slice/sshd.service\n",
        )
        .unwrap();
        let mut c = Placements::new(dir.path());
        for _ in 0..(3 * REVALIDATE_POLLS) {
            assert_eq!(poll(&mut c, &[10, 11, 12, 10]), ["aa11", "bb22"]);
        }
        // One read per pid, also for the one outside ECS: the checks are stats only.
        assert_eq!(c.reads(), 3);
        assert_eq!(c.get(10), Some(("aa11", Some(CID_A))));
        assert_eq!(c.get(12), None);
        // 11 leaves NVML's list: forgotten at the end of that poll.
        assert_eq!(poll(&mut c, &[10, 12]), ["aa11"]);
        assert_eq!(c.len(), 2);
        assert_eq!(c.get(11), None);
        // A gone pid (no /proc entry) is not cached and names no task.
        assert_eq!(poll(&mut c, &[10, 77]), ["aa11"]);
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn a_reused_pid_is_read_again_within_the_revalidation_bound() {
        let dir = tempfile::tempdir().unwrap();
        write_cgroup(dir.path(), 10, "aa11");
        let mut c = Placements::new(dir.path());
        assert_eq!(poll(&mut c, &[10]), ["aa11"]);
        // The process exits and another one gets pid 10 between two polls: its procfs
        // directory is a new inode.
        std::fs::remove_dir_all(dir.path().join("10")).unwrap();
        std::fs::create_dir_all(dir.path().join("spacer")).unwrap();
        // Past the file system's timestamp granularity, as a new process is.
        std::thread::sleep(std::time::Duration::from_millis(30));
        write_cgroup(dir.path(), 10, "cc33");
        let mut polls = 0;
        while poll(&mut c, &[10]) != ["cc33"] {
            polls += 1;
            assert!(
                polls < REVALIDATE_POLLS,
                "still the old task after {polls} polls"
            );
        }
        assert_eq!(c.reads(), 2);
    }
}
