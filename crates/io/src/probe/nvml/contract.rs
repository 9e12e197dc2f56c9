//! The MPS contract, per process (docs/mps.md#the-mps-contract-and-what-gpu-medic-checks):
//! every CUDA process on a GPU that MPS serves is an MPS client, and every client of an ECS
//! task runs with the limits ECS set in its environment.
//!
//! - **Outside MPS** ([`Contract::outsiders`]): NVML's compute list against its MPS client
//!   list. A GPU is *served by MPS* when this poll lists an MPS client on it or its compute
//!   list holds the MPS server (`nvidia-cuda-mps-server`; on Volta and later NVML lists the
//!   server as a compute process and the clients in the MPS list). A pid in the compute list
//!   and not in the MPS list is outside MPS, unless it is the MPS server or control daemon,
//!   DCGM (`nv-hostengine`, `dcgmi`, `nvvs`) or gpu-medic itself (its `diagnose` and
//!   `__cuda-worker` children run gpu-medic's own executable). The compute list is read
//!   before the MPS list, so a client that starts between the two reads is never taken for
//!   an outsider; one that exits between them is gone from `/proc` and skipped. A process is
//!   reported when two polls in a row found it outside (the same pid and start time), once
//!   per process: a reused pid (another start time) is another process.
//! - **Limits in force** ([`Contract::limits`]): each client's `/proc/<pid>/environ`, read
//!   once per process and at most [`ENVIRON_MAX`] bytes (an environment of megabytes is not
//!   read whole), for `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` and
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (a cached client's start time is checked every few
//!   polls, not every poll: [`Contract::limits`]). What they are compared with is the accounting
//!   wing's (`crate::accounting::contract`): the task definition is read there.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

pub use crate::accounting::contract::{ClientLimits, Limits};
use crate::model::{GpuId, Observation, Signal};

/// The MPS server's program name.
pub const MPS_SERVER: &str = "nvidia-cuda-mps-server";
/// Programs that hold a GPU outside MPS by design: the MPS server and control daemon, DCGM's
/// host engine, its CLI and its diagnostic.
pub const EXEMPT_PROGRAMS: &[&str] = &[
    MPS_SERVER,
    "nvidia-cuda-mps-control",
    "nv-hostengine",
    "dcgmi",
    "nvvs",
];
/// The most of a process's environment read (ECS's variables are short; a larger
/// environment is read to here only).
pub const ENVIRON_MAX: u64 = 64 << 10;
/// The most of `/proc/<pid>/cmdline` read for the program's name.
const CMDLINE_MAX: u64 = 4096;
/// `/proc/<pid>/stat` is one line of a few hundred bytes.
const STAT_MAX: u64 = 4096;

/// A process: its pid and start time (clock ticks after boot), so that a reused pid is
/// another process.
pub type ProcKey = (u32, u64);

/// The start time of a live process (field 22 of `/proc/<pid>/stat`); None when it is gone
/// (or a zombie: it runs nothing).
pub fn start_ticks(proc_root: &Path, pid: u32) -> Option<u64> {
    let path = proc_root.join(pid.to_string()).join("stat");
    let s = crate::sys::limits::read_pseudo(&path, STAT_MAX, "a stat file").ok()?;
    // Fields after `(comm)`, which may hold spaces and parentheses: state is field 3.
    let rest = s.get(s.rfind(')')? + 2..)?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    if matches!(f.first(), Some(&"Z") | Some(&"X")) {
        return None;
    }
    f.get(22 - 3)?.parse().ok()
}

/// A process's program: the file name of its `argv[0]` (bounded read), else its `comm`.
pub fn program(proc_root: &Path, pid: u32) -> String {
    let dir = proc_root.join(pid.to_string());
    let argv0 = crate::sys::limits::read_head(&dir.join("cmdline"), CMDLINE_MAX, "a cmdline")
        .ok()
        .and_then(|b| {
            let first = b.split(|c| *c == 0).next()?.to_vec();
            let s = String::from_utf8_lossy(&first).to_string();
            let name = s.rsplit('/').next()?.trim().to_string();
            (!name.is_empty()).then_some(name)
        });
    let name = argv0.unwrap_or_else(|| {
        crate::sys::limits::read_pseudo(&dir.join("comm"), 64, "a comm file")
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    });
    crate::mps::control::clip(&name, 64)
}

/// MiB in a size as the MPS docs write it (`1G`, `512MB`): a number with an optional unit `K`,
/// `M`, `G` or `T` (also `KB`, `MiB`, ..., any case), binary multiples; a bare number is read as
/// MiB. None: not a size (or too large).
pub fn size_mib(s: &str) -> Option<u64> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n: u64 = s.get(..digits)?.parse().ok()?;
    let unit = s.get(digits..)?.trim().to_ascii_uppercase();
    match unit.as_str() {
        "" | "M" | "MB" | "MIB" => Some(n),
        "G" | "GB" | "GIB" => n.checked_mul(1024),
        "T" | "TB" | "TIB" => n.checked_mul(1024 * 1024),
        "K" | "KB" | "KIB" => Some(n.div_ceil(1024)),
        _ => None,
    }
}

/// The largest per-device limit of a `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` value, in MiB:
/// `0=8192M` (the ECS agent's form), `0=1G,1=2G`, or a bare size for every device. None when
/// an entry does not parse.
pub fn pinned_limit_mib(v: &str) -> Option<u64> {
    let mut max: Option<u64> = None;
    for entry in v.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let size = match entry.split_once('=') {
            Some((dev, size)) => {
                let dev = dev.trim();
                let is_dev = !dev.is_empty()
                    && (dev.chars().all(|c| c.is_ascii_digit()) || dev.starts_with("GPU-"));
                if !is_dev {
                    return None;
                }
                size
            }
            None => entry,
        };
        let mib = size_mib(size)?;
        max = Some(max.map_or(mib, |m| m.max(mib)));
    }
    max
}

/// The limits in an environment's bytes (`NAME=value` entries separated by NUL), of which
/// `truncated` says whether it was cut at [`ENVIRON_MAX`].
pub fn parse_environ(bytes: &[u8], truncated: bool) -> Limits {
    let mut out = Limits {
        truncated,
        ..Limits::default()
    };
    // A cut environment's last entry may be cut too: it is not read.
    let mut entries: Vec<&[u8]> = bytes.split(|b| *b == 0).collect();
    if truncated {
        entries.pop();
    }
    for e in entries {
        if let Some(v) = e.strip_prefix(b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=") {
            let v = String::from_utf8_lossy(v);
            out.memory_mib = pinned_limit_mib(&v);
            out.memory_text = Some(crate::mps::control::clip(&v, 120));
        } else if let Some(v) = e.strip_prefix(b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=") {
            out.threads = String::from_utf8_lossy(v).trim().parse().ok();
        }
    }
    out
}

/// A process's limits from `/proc/<pid>/environ` (bounded).
pub fn read_limits(proc_root: &Path, pid: u32) -> Limits {
    let path = proc_root.join(pid.to_string()).join("environ");
    match crate::sys::limits::read_head(&path, ENVIRON_MAX + 1, "an environ file") {
        Ok(mut b) => {
            let truncated = b.len() as u64 > ENVIRON_MAX;
            b.truncate(ENVIRON_MAX as usize);
            parse_environ(&b, truncated)
        }
        Err(e) => Limits {
            unreadable: Some(e.to_string()),
            ..Limits::default()
        },
    }
}

/// One client's limits, read once per process.
#[derive(Debug)]
struct Cached {
    /// `/proc/<pid>`'s identity ([`crate::probe::tasks::proc_identity`]).
    id: (u64, i64),
    start: u64,
    limits: Limits,
    seen: u64,
}

/// What the contract checks remember between polls.
#[derive(Debug)]
pub struct Contract {
    proc_root: PathBuf,
    /// gpu-medic's own executable: its children (`diagnose`, `__cuda-worker`) are exempt.
    own_exe: Option<PathBuf>,
    /// Clients' start times and limits, by pid, with the poll that last listed them; kept
    /// while NVML lists the pid.
    limits: HashMap<u32, Cached>,
    /// Processes outside MPS at the last poll and at this one.
    outside_before: HashSet<ProcKey>,
    outside_now: HashSet<ProcKey>,
    /// Processes reported outside MPS; kept while they stay outside.
    reported: HashSet<ProcKey>,
    poll: u64,
    /// Environments read since the start (for the bench and tests).
    reads: u64,
}

impl Contract {
    pub fn new(proc_root: &Path) -> Contract {
        Contract {
            proc_root: proc_root.to_path_buf(),
            own_exe: std::env::current_exe().ok(),
            limits: HashMap::new(),
            outside_before: HashSet::new(),
            outside_now: HashSet::new(),
            reported: HashSet::new(),
            poll: 0,
            reads: 0,
        }
    }

    pub fn begin_poll(&mut self) {
        self.poll += 1;
        self.outside_before = std::mem::take(&mut self.outside_now);
    }

    /// Forgets the processes this poll did not list.
    pub fn end_poll(&mut self) {
        let poll = self.poll;
        self.limits.retain(|_, c| c.seen == poll);
        let now = &self.outside_now;
        self.reported.retain(|k| now.contains(k));
    }

    /// Environments read since the start.
    pub fn reads(&self) -> u64 {
        self.reads
    }

    /// The start time and limits of a client in an ECS task; None when it is gone. Its
    /// environment is read once per process: a cached pid's start time is read again every
    /// [`crate::probe::tasks::REVALIDATE_POLLS`] polls (spread by pid, as the placements'
    /// checks are, by one `stat` of `/proc/<pid>`, whose inode a reused pid never shares), and
    /// a new process reads its start time and environment again. Between two checks nothing
    /// is read: a poll costs a map lookup per client.
    pub fn limits(&mut self, pid: u32) -> Option<(u64, Limits)> {
        let poll = self.poll;
        let due = poll
            .wrapping_add(u64::from(pid))
            .is_multiple_of(crate::probe::tasks::REVALIDATE_POLLS);
        if !due && let Some(c) = self.limits.get_mut(&pid) {
            c.seen = poll;
            return Some((c.start, c.limits.clone()));
        }
        // The check: one `stat` of `/proc/<pid>`; the start time is read for a new process only.
        let Some(id) = crate::probe::tasks::proc_identity(&self.proc_root, pid) else {
            self.limits.remove(&pid);
            return None;
        };
        if let Some(c) = self.limits.get_mut(&pid)
            && c.id == id
        {
            c.seen = poll;
            return Some((c.start, c.limits.clone()));
        }
        let Some(start) = start_ticks(&self.proc_root, pid) else {
            self.limits.remove(&pid);
            return None;
        };
        self.reads += 1;
        let limits = read_limits(&self.proc_root, pid);
        self.limits.insert(
            pid,
            Cached {
                id,
                start,
                limits: limits.clone(),
                seen: poll,
            },
        );
        Some((start, limits))
    }

    fn exempt(&self, pid: u32, program: &str) -> bool {
        if EXEMPT_PROGRAMS.contains(&program) {
            return true;
        }
        let exe = std::fs::read_link(self.proc_root.join(pid.to_string()).join("exe")).ok();
        exe.is_some() && exe == self.own_exe
    }

    /// The processes on `gpu` outside MPS, reported once each, and how many there are now:
    /// `compute` is NVML's compute list (read first), `clients` its MPS list. `placed` tells
    /// whether a pid runs in a container (its cgroup names a task or a container).
    pub fn outsiders(
        &mut self,
        gpu: &GpuId,
        compute: &[(u32, Option<u64>)],
        clients: &[u32],
        placed: impl Fn(u32) -> bool,
    ) -> (Vec<Observation>, u32) {
        let mut out = Vec::new();
        let mut count = 0;
        let others: Vec<(u32, Option<u64>, String)> = compute
            .iter()
            .filter(|(pid, _)| !clients.contains(pid))
            .map(|(pid, b)| (*pid, *b, program(&self.proc_root, *pid)))
            .collect();
        let served = !clients.is_empty() || others.iter().any(|(_, _, p)| p == MPS_SERVER);
        if !served {
            return (out, count);
        }
        for (pid, bytes, program) in others {
            if self.exempt(pid, &program) {
                continue;
            }
            let Some(start) = start_ticks(&self.proc_root, pid) else {
                continue; // exited between the lists, or a zombie
            };
            let key = (pid, start);
            self.outside_now.insert(key);
            count += 1;
            if !self.outside_before.contains(&key) || !self.reported.insert(key) {
                continue;
            }
            let in_task = placed(pid);
            let memory = match bytes {
                Some(b) => format!("{} MiB of GPU memory", b.div_ceil(1 << 20)),
                None => "GPU memory not reported".to_string(),
            };
            let whose = if in_task {
                "in an ECS task"
            } else {
                "in no ECS task"
            };
            out.push(
                Observation::new(Signal::MpsBypass)
                    .with_value(u64::from(in_task))
                    .with_pids(vec![pid])
                    .with_detail(format!(
                        "pid {pid} ({program}) runs outside MPS on {gpu}, {whose}: NVML lists it \
                         as a compute process, not an MPS client ({memory}); it has no MPS \
                         memory limit and the whole GPU's compute"
                    ))
                    .from_source("nvml")
                    .on_gpu(gpu.clone()),
            );
        }
        (out, count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_pinned_limits_in_every_documented_form() {
        assert_eq!(size_mib("8192M"), Some(8192));
        assert_eq!(size_mib("8192"), Some(8192));
        assert_eq!(size_mib("1G"), Some(1024));
        assert_eq!(size_mib("512MB"), Some(512));
        assert_eq!(size_mib("2gb"), Some(2048));
        assert_eq!(size_mib("1536K"), Some(2));
        assert_eq!(size_mib("x"), None);
        assert_eq!(size_mib("1Q"), None);
        assert_eq!(size_mib(""), None);
        assert_eq!(size_mib("99999999999999999999G"), None);
        assert_eq!(pinned_limit_mib("0=8192M"), Some(8192));
        assert_eq!(pinned_limit_mib("0=1G,1=2G"), Some(2048));
        assert_eq!(pinned_limit_mib("0=1G, 1=512MB"), Some(1024));
        assert_eq!(pinned_limit_mib("2G"), Some(2048));
        assert_eq!(pinned_limit_mib("GPU-1234=1G"), Some(1024));
        assert_eq!(pinned_limit_mib("a=1G"), None);
        assert_eq!(pinned_limit_mib("0=lots"), None);
        assert_eq!(pinned_limit_mib(""), None);
    }

    #[test]
    fn the_environment_gives_both_limits_and_a_cut_one_is_not_judged() {
        let env = b"PATH=/bin\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M\0CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25\0";
        let l = parse_environ(env, false);
        assert_eq!(l.memory_mib, Some(4096));
        assert_eq!(l.memory_text.as_deref(), Some("0=4096M"));
        assert_eq!(l.threads, Some(25));
        assert!(l.known());
        let none = parse_environ(b"PATH=/bin\0", false);
        assert_eq!((none.memory_mib, none.threads), (None, None));
        assert!(none.known(), "no limit at all is a finding");
        // Cut inside the variable: its partial value is not read.
        let cut = parse_environ(b"PATH=/bin\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40", true);
        assert_eq!(cut.memory_text, None);
        assert!(!cut.known());
        let bad = parse_environ(b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=plenty\0", false);
        assert_eq!(bad.memory_mib, None);
        assert!(bad.known());
    }

    #[test]
    fn a_large_environment_is_read_to_the_cap_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("7");
        std::fs::create_dir_all(&p).unwrap();
        let mut env = b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50\0BIG=".to_vec();
        env.extend(std::iter::repeat_n(b'x', 1 << 20));
        env.extend(b"\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G\0");
        std::fs::write(p.join("environ"), &env).unwrap();
        let l = read_limits(dir.path(), 7);
        assert!(l.truncated);
        assert_eq!(l.threads, Some(50));
        assert_eq!(l.memory_mib, None, "past the cap");
        assert!(!l.known());
        assert!(read_limits(dir.path(), 8).unreadable.is_some());
    }

    fn fake_proc(dir: &Path, pid: u32, start: u64, argv0: &str) {
        let p = dir.join(pid.to_string());
        std::fs::create_dir_all(&p).unwrap();
        let mut stat = format!("{pid} (a b) S");
        for i in 4..=22 {
            stat.push_str(&format!(" {}", if i == 22 { start } else { 0 }));
        }
        std::fs::write(p.join("stat"), stat + " 0 0\n").unwrap();
        std::fs::write(p.join("cmdline"), format!("{argv0}\0--flag\0")).unwrap();
    }

    #[test]
    fn a_clients_environment_is_read_once_per_process() {
        let dir = tempfile::tempdir().unwrap();
        fake_proc(dir.path(), 10, 100, "client");
        std::fs::write(
            dir.path().join("10/environ"),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G\0",
        )
        .unwrap();
        let mut c = Contract::new(dir.path());
        for _ in 0..(3 * crate::probe::tasks::REVALIDATE_POLLS) {
            c.begin_poll();
            let (start, l) = c.limits(10).unwrap();
            assert_eq!((start, l.memory_mib), (100, Some(1024)));
            c.end_poll();
        }
        assert_eq!(c.reads(), 1);
        // The pid is reused: a new procfs directory (a new inode, past the file system's
        // timestamp granularity, as a new process's), read again within the revalidation bound.
        std::fs::remove_dir_all(dir.path().join("10")).unwrap();
        std::fs::create_dir_all(dir.path().join("spacer")).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        fake_proc(dir.path(), 10, 200, "client");
        std::fs::write(dir.path().join("10/environ"), "PATH=/bin\0").unwrap();
        let mut polls = 0;
        loop {
            c.begin_poll();
            let (start, l) = c.limits(10).unwrap();
            c.end_poll();
            if start == 200 {
                assert_eq!(l.memory_mib, None);
                break;
            }
            polls += 1;
            assert!(polls < crate::probe::tasks::REVALIDATE_POLLS);
        }
        assert_eq!(c.reads(), 2);
        // Gone at its next check: not listed.
        std::fs::remove_dir_all(dir.path().join("10")).unwrap();
        let mut gone = false;
        for _ in 0..crate::probe::tasks::REVALIDATE_POLLS {
            c.begin_poll();
            gone |= c.limits(10).is_none();
            c.end_poll();
        }
        assert!(gone);
    }

    #[test]
    fn outsiders_are_reported_at_the_second_poll_once_per_process() {
        let dir = tempfile::tempdir().unwrap();
        fake_proc(dir.path(), 10, 100, "/usr/bin/python3");
        fake_proc(dir.path(), 11, 100, "/usr/bin/nvidia-cuda-mps-server");
        fake_proc(dir.path(), 12, 100, "/usr/bin/nv-hostengine");
        fake_proc(dir.path(), 20, 100, "client");
        let gpu = GpuId::index_only(1);
        let mut c = Contract::new(dir.path());
        let compute = [
            (10, Some(1 << 30)),
            (11, None),
            (12, None),
            (20, None),
            (30, None),
        ];
        let poll = |c: &mut Contract, clients: &[u32]| {
            c.begin_poll();
            let (o, n) = c.outsiders(&gpu, &compute, clients, |p| p == 10);
            c.end_poll();
            assert_eq!(
                n, 1,
                "python3 only: the server, DCGM and the gone pid 30 are not counted"
            );
            o
        };
        assert!(poll(&mut c, &[20]).is_empty(), "confirmed at the next poll");
        let o = poll(&mut c, &[20]);
        assert_eq!(o.len(), 1, "{o:?}");
        assert_eq!(o[0].pids, [10]);
        assert_eq!(o[0].value, 1);
        let d = o[0].detail.as_deref().unwrap();
        assert!(
            d.contains("pid 10 (python3)") && d.contains("1024 MiB"),
            "{d}"
        );
        assert!(poll(&mut c, &[20]).is_empty(), "once per process");
        // The pid is reused by another process: reported again, after its confirmation.
        fake_proc(dir.path(), 10, 200, "/usr/bin/python3");
        assert!(poll(&mut c, &[20]).is_empty());
        assert_eq!(poll(&mut c, &[20]).len(), 1);
        // Without an MPS client or server on the GPU, MPS does not serve it.
        let mut c = Contract::new(dir.path());
        let solo = [(10, None)];
        for _ in 0..3 {
            c.begin_poll();
            assert!(c.outsiders(&gpu, &solo, &[], |_| false).0.is_empty());
            c.end_poll();
        }
        // The server alone makes the GPU served.
        let with_server = [(10, None), (11, None)];
        let mut got = Vec::new();
        for _ in 0..2 {
            c.begin_poll();
            got.extend(c.outsiders(&gpu, &with_server, &[], |_| false).0);
            c.end_poll();
        }
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].value, 0);
    }
}
