//! Names the program behind an application-class XID (docs/attribution.md): the process the
//! driver printed in its own `pid=` field, who that process is by the kernel's facts (its
//! start time, executable, cgroup and parent: `sys::procfs`), its ECS task through its cgroup
//! and the ECS agent, or, when the process is the MPS server, the GPU's client task at that
//! moment. The place on the GPU is decoded from the driver's message; the cause is the
//! driver's own field (`model::driver_line`).
//!
//! What a process says of itself decides nothing here: its name (the driver's `name=`, its
//! `comm`, its `argv[0]`) is shown, never judged by. A process is the MPS server when it runs
//! the installed server binary outside every container with the control daemon as parent
//! (`probe::identity::mps_role`), whatever it calls itself. A record stamped before the
//! process now on its pid started is not that process's (pids are reused): the poller's own
//! table of the processes it saw on the GPUs (`tasks::SeenProcs`) names the one that was.
//!
//! Runs in the kernel log reader's thread, once per XID line, so everything is bounded and
//! cached: one `stat` of `/proc/<pid>` per XID, the cgroup, `comm`, start time and executable
//! read once per process (a new process on a reused pid has a new procfs inode and is read
//! again), and the agent's task list asked at most every [`AGENT_REFRESH`] and only for a
//! task it did not list before, with a short deadline: a storm of one task's XIDs costs one
//! cgroup read and one agent call.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::aws::agent::{Agent, AgentTask};
use crate::model::attribution::{Culprit, Via, XidContext, decode_site};
use crate::model::driver_line::KernelXid;
use crate::mps::procs::Role;
use crate::probe::identity::{Installed, mps_role};
use crate::probe::tasks::{Placement, SeenProc, name_tasks, placement_of};
use crate::sys::procfs;

/// Least time between two questions to the ECS agent.
pub const AGENT_REFRESH: Duration = Duration::from_secs(5);

/// The agent's deadline here: the kernel log reader waits for it.
pub const AGENT_DEADLINE: Duration = Duration::from_secs(1);

/// At most this many processes and tasks are remembered.
const MAX_CACHED: usize = 4096;

pub use crate::policy::xid_catalog::attributable;

/// One process as read once.
#[derive(Debug, Clone)]
struct Process {
    /// `/proc/<pid>`'s inode and change time: another process on the same pid differs.
    id: (u64, i64),
    comm: Vec<u8>,
    /// Clock ticks after boot; None when `stat` could not be read.
    start_ticks: Option<u64>,
    /// What it is by the kernel's facts, when it is one of the MPS binaries.
    mps: Option<Role>,
    /// Its executable (`<device>:<inode> <path>`), for a process in no task.
    exe: Option<String>,
    placement: Result<Placement, String>,
}

/// The culprit finder of the kernel log reader.
pub struct Attributor {
    proc_root: PathBuf,
    agent: Option<Agent>,
    /// The installed programs' files: who the MPS server is.
    installed: Installed,
    ticks_per_second: u64,
    processes: HashMap<u32, Process>,
    tasks: HashMap<String, AgentTask>,
    asked: Option<Instant>,
    runtime: Option<tokio::runtime::Runtime>,
    /// cgroup files read (for the bench and tests).
    pub reads: u64,
}

/// Who held a pid when a record was written.
enum Holder {
    /// The process on the pid now, running since before the record.
    Live(Process),
    /// A process the poller saw there and that is gone since (or whose pid a newer one holds).
    Seen(SeenProc),
    /// Nobody known: gone before anything of it was read, or the pid's process now started
    /// after the record (`why`).
    Unknown(String),
}

impl Attributor {
    /// `agent_url`: the ECS agent's introspection API (None: tasks are named by id only).
    pub fn new(proc_root: &Path, agent_url: Option<&str>) -> Attributor {
        Attributor {
            proc_root: proc_root.to_path_buf(),
            agent: agent_url.map(|u| Agent::new(u).with_timeout(AGENT_DEADLINE)),
            installed: Installed::none(),
            ticks_per_second: procfs::ticks_per_second(),
            processes: HashMap::new(),
            tasks: HashMap::new(),
            asked: None,
            runtime: None,
            reads: 0,
        }
    }

    /// Tells the MPS server by the installed files (without them no process is the server).
    pub fn with_mps(mut self, installed: Installed) -> Attributor {
        self.installed = installed;
        self
    }

    /// The `comm` the kernel has for `pid` now, raw, when that process was already running at
    /// `usec` (a record's stamp; unknown: any): the driver printed it in the record.
    pub fn comm_before(&mut self, pid: u32, usec: Option<u64>) -> Option<Vec<u8>> {
        let hz = self.ticks_per_second;
        let p = self.process(pid)?;
        let after = matches!((usec, p.start_ticks), (Some(u), Some(s)) if procfs::record_predates(u, s, hz));
        (!after).then(|| p.comm.clone())
    }

    /// What the XID line tells beyond its code. `clients`: the MPS client pids and their
    /// task ids on the XID's GPU at the last poll; `seen`: what the poller saw last of the
    /// line's pid.
    pub fn context(
        &mut self,
        x: &KernelXid,
        clients: Option<&(Vec<u32>, Vec<String>)>,
        seen: Option<&SeenProc>,
    ) -> XidContext {
        let mut ctx = XidContext {
            culprit: None,
            site: decode_site(x.code, &x.text),
            after: x.cause,
        };
        if attributable(x.code) {
            ctx.culprit = self.culprit(x, clients, seen);
        }
        ctx
    }

    /// Who held `pid` when the record stamped `usec` was written.
    fn holder(&mut self, pid: u32, usec: Option<u64>, seen: Option<&SeenProc>) -> Holder {
        let hz = self.ticks_per_second;
        let predates = |start: u64| usec.is_some_and(|u| procfs::record_predates(u, start, hz));
        let live = self.process(pid).cloned();
        let reused = match &live {
            Some(p) if !p.start_ticks.is_some_and(predates) => return Holder::Live(p.clone()),
            Some(_) => true,
            None => false,
        };
        let live_start = live.as_ref().and_then(|p| p.start_ticks);
        match seen {
            Some(s) if !predates(s.start_ticks) && live_start.is_none_or(|l| s.start_ticks < l) => {
                Holder::Seen(s.clone())
            }
            _ if reused => Holder::Unknown(format!(
                "pid {pid} belongs to a process that started after the record was written: the one that faulted exited and its pid was reused"
            )),
            _ => Holder::Unknown("exited before it could be looked up".into()),
        }
    }

    fn culprit(
        &mut self,
        x: &KernelXid,
        clients: Option<&(Vec<u32>, Vec<String>)>,
        seen: Option<&SeenProc>,
    ) -> Option<Culprit> {
        // The driver's pid field, or nobody: a name alone names nobody.
        let pid = x.pid?;
        let named = x.process.clone().unwrap_or_default();
        match self.holder(pid, x.usec, seen) {
            Holder::Live(p) if p.mps.is_some() => Some(self.mps_client(clients)),
            Holder::Live(p) => {
                let shown = if named.is_empty() {
                    String::from_utf8_lossy(&p.comm).into_owned()
                } else {
                    named.clone()
                };
                let mut c = Culprit::program(shown, Some(pid));
                // Without a stamp a reused pid can only be told by the name the driver
                // printed: when it is not this process's, nobody is charged.
                if x.usec.is_none() && !named.is_empty() && !same_comm(named.as_bytes(), &p.comm) {
                    c.why = Some(format!(
                        "pid {pid} now runs {:?} and the record has no time stamp: the process that faulted may have exited and its pid been reused",
                        String::from_utf8_lossy(&p.comm)
                    ));
                    return Some(c);
                }
                match p.placement {
                    Ok(placement) => self.name_task(&mut c, pid, placement),
                    Err(why) => {
                        c.exe = p.exe;
                        c.why = Some(why);
                    }
                }
                Some(c)
            }
            Holder::Seen(s) => {
                let shown = if named.is_empty() {
                    String::from_utf8_lossy(&s.comm).into_owned()
                } else {
                    named.clone()
                };
                let mut c = Culprit::program(shown, Some(pid));
                match s.placement {
                    Some((task, container)) => {
                        let placement = Placement {
                            task_id: Some(task),
                            container_id: container,
                        };
                        self.name_task(&mut c, pid, placement);
                    }
                    None => c.exe = s.exe,
                }
                c.why = Some(c.why.map_or_else(
                    || "exited; as the GPU poll saw it".to_string(),
                    |w| format!("exited; as the GPU poll saw it; {w}"),
                ));
                Some(c)
            }
            Holder::Unknown(why) => {
                let mut c = Culprit::program(named, Some(pid));
                c.why = Some(why);
                Some(c)
            }
        }
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
                    let comm = String::from_utf8_lossy(&q.comm).into_owned();
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
                let q = self.process(*pid).cloned();
                c.program = q
                    .as_ref()
                    .map(|q| String::from_utf8_lossy(&q.comm).into_owned())
                    .unwrap_or_default();
                c.exe = q.and_then(|q| q.exe);
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
        let id = crate::probe::tasks::proc_identity(&self.proc_root, pid)?;
        if self.processes.get(&pid).is_none_or(|p| p.id != id) {
            if self.processes.len() >= MAX_CACHED {
                self.processes.clear();
            }
            self.reads += 1;
            let placement = placement_of(&self.proc_root, pid);
            let exe = placement
                .is_err()
                .then(|| crate::probe::tasks::exe_unit(&self.proc_root, pid))
                .flatten();
            let p = Process {
                id,
                comm: crate::probe::tasks::comm_bytes(&self.proc_root, pid).unwrap_or_default(),
                start_ticks: procfs::stat(&self.proc_root, pid).map(|s| s.start_ticks),
                mps: mps_role(&self.proc_root, pid, &self.installed),
                exe,
                placement,
            };
            self.processes.insert(pid, p);
        }
        self.processes.get(&pid)
    }
}

/// Whether the driver's `name=` and `/proc/<pid>/comm` are one name (the kernel keeps 15
/// bytes; the driver may print fewer, a U+FFFD where a byte was not UTF-8).
fn same_comm(printed: &[u8], comm: &[u8]) -> bool {
    let a = String::from_utf8_lossy(printed);
    let b = String::from_utf8_lossy(comm);
    let a: Vec<char> = a.chars().take(15).collect();
    let b: Vec<char> = b.chars().take(15).collect();
    a == b || (!a.is_empty() && b.starts_with(&a)) || (!b.is_empty() && a.starts_with(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/proc/<pid>` with `comm`, `cgroup`, a `stat` (parent, start tick) and `exe`
    /// pointing at `exe`.
    fn proc_with(
        dir: &Path,
        pid: u32,
        comm: &str,
        cgroup: &str,
        parent: u32,
        start: u64,
        exe: &Path,
    ) {
        let d = dir.join(pid.to_string());
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("comm"), format!("{comm}\n")).unwrap();
        std::fs::write(d.join("cgroup"), cgroup).unwrap();
        std::fs::write(
            d.join("stat"),
            format!("{pid} ({comm}) S {parent} {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {start} 1000 10\n"),
        )
        .unwrap();
        let _ = std::fs::remove_file(d.join("exe"));
        std::os::unix::fs::symlink(exe, d.join("exe")).unwrap();
    }

    /// A record stamped `secs` after boot, by the driver's format.
    fn xid(code: u32, pid: u32, name: &str, text: &str, secs: u64) -> KernelXid {
        crate::probe::kmsg::parse_line(&format!(
            "4,1,{},-;NVRM: Xid (PCI:0000:3b:00): {code}, pid={pid}, name={name}, {text}",
            secs * 1_000_000
        ))
        .unwrap()
    }

    const V2: &str = "0::/ecstasks.slice/ecstasks-abc123.slice/docker-0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef.scope\n";
    const HOST: &str = "0::/system.slice/nvidia-mps.service\n";

    fn file(dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, name).unwrap();
        p
    }

    #[test]
    fn a_process_in_a_task_is_charged_to_its_task_and_read_once() {
        let dir = tempfile::tempdir().unwrap();
        let bin = file(dir.path(), "python3");
        proc_with(dir.path(), 4242, "python3", V2, 1, 100, &bin);
        let mut a = Attributor::new(dir.path(), None);
        let x = xid(
            13,
            4242,
            "python3",
            "Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Illegal Instruction Encoding",
            60,
        );
        for _ in 0..100 {
            let ctx = a.context(&x, None, None);
            let c = ctx.culprit.unwrap();
            assert_eq!(c.task.as_deref(), Some("abc123"));
            assert_eq!(c.unit(), "task abc123");
            assert_eq!(ctx.site.unwrap().key().as_deref(), Some("GPC 1, TPC 2"));
        }
        assert_eq!(a.reads, 1, "one read per process, however many XIDs");
    }

    #[test]
    fn a_gone_or_reused_pid_charges_nobody_by_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = Attributor::new(dir.path(), None);
        let c = a
            .context(&xid(31, 7, "python3", "", 60), None, None)
            .culprit
            .unwrap();
        assert!(!c.is_attributed(), "{c:?}");
        assert!(c.why.unwrap().contains("exited"));
        // A process that started (at 100 s) after the record (at 60 s) holds the pid now.
        let bin = file(dir.path(), "nginx");
        proc_with(dir.path(), 8, "python3", V2, 1, 10_000, &bin);
        let c = a
            .context(&xid(31, 8, "python3", "", 60), None, None)
            .culprit
            .unwrap();
        assert!(
            !c.is_attributed(),
            "a name equal to the faulting one changes nothing: {c:?}"
        );
        assert!(c.why.unwrap().contains("reused"));
        // What the poller saw on that pid before is charged.
        let seen = SeenProc::for_test(500, Some(("def456", None)), None, b"python3");
        let c = a
            .context(&xid(31, 8, "python3", "", 60), None, Some(&seen))
            .culprit
            .unwrap();
        assert_eq!(c.unit(), "task def456", "{c:?}");
        // But not a seen process that started after the record either.
        let late = SeenProc::for_test(7_000, Some(("def456", None)), None, b"python3");
        let c = a
            .context(&xid(31, 9, "python3", "", 60), None, Some(&late))
            .culprit
            .unwrap();
        assert!(!c.is_attributed(), "{c:?}");
    }

    #[test]
    fn a_process_in_no_task_is_its_executable_not_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let (one, two) = (file(dir.path(), "a.out"), file(dir.path(), "b.out"));
        proc_with(dir.path(), 10, "same-name", HOST, 1, 100, &one);
        proc_with(dir.path(), 11, "same-name", HOST, 1, 100, &two);
        proc_with(dir.path(), 12, "other-name", HOST, 1, 100, &one);
        let mut a = Attributor::new(dir.path(), None);
        let unit = |a: &mut Attributor, pid, name| {
            a.context(&xid(13, pid, name, "x", 60), None, None)
                .culprit
                .unwrap()
                .unit()
        };
        let (u10, u11, u12) = (
            unit(&mut a, 10, "same-name"),
            unit(&mut a, 11, "same-name"),
            unit(&mut a, 12, "other-name"),
        );
        assert!(u10.starts_with("executable "), "{u10}");
        assert_ne!(u10, u11, "one name, two executables: two programs");
        assert_eq!(u10, u12, "two names, one executable: one program");
    }

    #[test]
    fn the_mps_server_is_known_by_its_executable_and_parent_not_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let (control, server, tenant) = (
            file(dir.path(), "nvidia-cuda-mps-control"),
            file(dir.path(), "nvidia-cuda-mps-server"),
            file(dir.path(), "python3"),
        );
        let binaries = Installed::new(vec![
            (crate::probe::identity::MPS_CONTROL, vec![control.clone()]),
            (crate::probe::identity::MPS_SERVER, vec![server.clone()]),
        ]);
        proc_with(dir.path(), 90, "nvidia-cuda-mps", HOST, 1, 10, &control);
        proc_with(dir.path(), 100, "nvidia-cuda-mps", HOST, 90, 20, &server);
        proc_with(dir.path(), 500, "worker", V2, 1, 100, &tenant);
        // A tenant calling itself the server, in its task.
        let mut v2b = V2.replace("abc123", "bad999");
        v2b.push('\n');
        proc_with(dir.path(), 600, "nvidia-cuda-mps", &v2b, 1, 100, &tenant);
        // A tenant running the real server binary (bind-mounted into its container).
        proc_with(dir.path(), 700, "nvidia-cuda-mps", &v2b, 1, 100, &server);
        let mut a = Attributor::new(dir.path(), None).with_mps(binaries);
        let mmu = "MMU Fault: ENGINE GRAPHICS GPC3 GPCCLIENT_T1_0 faulted @ 0x1000";
        let one = (vec![500], vec!["abc123".to_string()]);
        let c = a
            .context(&xid(31, 100, "nvidia-cuda-mps", mmu, 60), Some(&one), None)
            .culprit
            .unwrap();
        assert_eq!(c.via, Via::MpsClient);
        assert_eq!(c.unit(), "task abc123");
        assert_eq!(c.pid, Some(500));
        for pid in [600, 700] {
            let c = a
                .context(&xid(31, pid, "nvidia-cuda-mps", mmu, 60), Some(&one), None)
                .culprit
                .unwrap();
            assert_eq!(c.via, Via::Driver, "pid {pid}: {c:?}");
            assert_eq!(
                c.unit(),
                "task bad999",
                "charged to itself, never the client"
            );
        }
        let two = (
            vec![500, 501],
            vec!["abc123".to_string(), "def456".to_string()],
        );
        let c = a
            .context(&xid(31, 100, "anything", mmu, 60), Some(&two), None)
            .culprit
            .unwrap();
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
            a.context(&xid(79, 1, "x", "", 60), None, None)
                .culprit
                .is_none()
        );
        // No pid printed: nobody, whatever the name.
        let x = crate::probe::kmsg::parse_line(
            "4,1,5,-;NVRM: Xid (PCI:0000:3b:00): 13, Graphics Exception: ESR 0x1",
        )
        .unwrap();
        assert!(a.context(&x, None, None).culprit.is_none());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 300, .. Default::default() })]

        /// Whatever a tenant puts in its comm (up to 15 bytes, any byte but NUL, printed as
        /// `/dev/kmsg` prints it), the XID is charged to the task of the pid the driver printed
        /// and struck where the driver's message says: never to the GPU's other client, never
        /// at a place the name wrote.
        #[test]
        fn no_comm_changes_who_is_charged_or_where(
            comm in proptest::collection::vec(1u8..=255, 0..=15),
            gpc in 0u32..8,
            tpc in 0u32..9,
        ) {
            let dir = tempfile::tempdir().unwrap();
            let bin = file(dir.path(), "python3");
            proc_with(dir.path(), 4242, "tenant", V2, 1, 100, &bin);
            let victim = V2.replace("abc123", "victim1");
            proc_with(dir.path(), 500, "worker", &victim, 1, 100, &bin);
            let mut a = Attributor::new(dir.path(), None);
            let mut printed = String::new();
            for &c in &comm {
                if !(b' '..127).contains(&c) || c == b'\\' {
                    printed.push_str(&format!("\\x{c:02x}"));
                } else {
                    printed.push(c as char);
                }
            }
            let msg = format!("Graphics SM Warp Exception on (GPC {gpc}, TPC {tpc}, SM 0): Out Of Range Address");
            let x = xid(13, 4242, &printed, &msg, 60);
            let clients = (vec![500], vec!["victim1".to_string()]);
            let ctx = a.context(&x, Some(&clients), None);
            let c = ctx.culprit.unwrap();
            proptest::prop_assert_eq!(c.unit(), "task abc123");
            proptest::prop_assert_eq!(c.pid, Some(4242));
            if let Some(site) = ctx.site {
                proptest::prop_assert_eq!(site.key(), Some(format!("GPC {gpc}, TPC {tpc}")));
            }
        }
    }
}
