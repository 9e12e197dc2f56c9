//! The MPS contract, per process (docs/mps.md#the-mps-contract-and-what-gpu-medic-checks):
//! every CUDA process on a node that MPS serves is an MPS client, and every client of an ECS
//! task runs with the limits ECS set in its environment.
//!
//! - **Outside MPS** ([`Contract::outsiders`]): NVML's compute lists against its MPS client
//!   lists, judged once every GPU of the poll was read. The node is *served by MPS* when this
//!   poll lists an MPS client on any GPU, or any compute list holds the installed MPS server
//!   (on Volta and later NVML lists the server as a compute process and the clients in the
//!   MPS list). Then a pid in a compute list and in no MPS list is outside MPS, on whichever
//!   GPU (a GPU with no client yet included), unless it is one of the installed programs that
//!   hold a GPU outside MPS by design, **by its executable as a file, the file's owner and its
//!   cgroup** ([`crate::probe::identity`]): the MPS server and control daemon, DCGM
//!   (`nv-hostengine`, `dcgmi`, `nvvs`), gpu-medic itself (its `diagnose` and `__cuda-worker`
//!   children). Its name exempts nothing; a process whose name claims one of them is reported
//!   with the fact that failed. A GPU that ECS says is `DEDICATED` (one container has it whole,
//!   without MPS) is not judged. The compute list is read before the MPS list, so a client that
//!   starts between the two reads is never taken for an outsider; one that exits between them
//!   is gone from `/proc` and skipped. A process is reported when two polls in a row found it
//!   outside (the same pid and start time), once per process: a reused pid (another start
//!   time) is another process.
//! - **Limits in force** ([`Contract::limits`]): each client's `/proc/<pid>/environ`, read
//!   once per process and at most [`ENVIRON_MAX`] bytes (an environment of megabytes is not
//!   read whole), for `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` and
//!   `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, read as CUDA reads them: the **first** entry of each
//!   (libc's `getenv`), and a value whose reading by CUDA is not documented counted as no
//!   limit, with why ([`parse_environ`]; docs/mps.md#how-the-limits-are-read). A cached
//!   client's start time is checked every few polls, not every poll ([`Contract::limits`]).
//!   What they are compared with is the accounting wing's (`crate::accounting::contract`): the
//!   task definition is read there.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

pub use crate::accounting::contract::{ClientLimits, Limits};
use crate::model::{GpuId, Observation, Signal};
use crate::probe::identity::{self, Identity, Installed, shown};

/// The most of a process's environment read (ECS's variables are short; a larger
/// environment is read to here only).
pub const ENVIRON_MAX: u64 = 64 << 10;
/// The most of `/proc/<pid>/cmdline` read for the program's name.
const CMDLINE_MAX: u64 = 4096;
/// `/proc/<pid>/stat` is one line of a few hundred bytes.
const STAT_MAX: u64 = 4096;
/// The pinned memory limit's variable.
pub const PINNED_VAR: &str = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
/// The active thread percentage's variable.
pub const THREADS_VAR: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

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

/// A process's program, as it names itself (for display only: it decides nothing): the file
/// name of its `argv[0]` (bounded read), else its `comm`, escaped and clipped.
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
    crate::mps::control::clip(&shown(&name), 64)
}

/// MiB in one size of `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` as NVIDIA documents it: digits, then
/// `M`, `MB` or `G` (binary multiples). Anything else (no unit, another unit or case, a sign,
/// a fraction, a limit of 0, a value past 2^64 bytes) is Err with why: how CUDA reads it is
/// not documented, and gpu-medic counts it as no limit.
pub fn size_mib(s: &str) -> Result<u64, String> {
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (n, unit) = s.split_at(digits);
    if n.is_empty() {
        return Err("not digits then M or G".into());
    }
    let n: u64 = n.parse().map_err(|_| "a number past 2^64".to_string())?;
    let mib = match unit {
        "M" | "MB" => Some(n),
        "G" => n.checked_mul(1024),
        "" => return Err("no unit (M or G)".into()),
        _ => return Err(format!("unit {} (not M or G)", shown(unit))),
    };
    match mib {
        Some(0) => Err("a limit of 0 (none, or nothing: not documented)".into()),
        Some(m) if m <= u64::MAX >> 20 => Ok(m),
        _ => Err("more bytes than 2^64".into()),
    }
}

/// A device of a `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Device {
    Ordinal(u32),
    /// `GPU-<hex and dashes>`, compared case-insensitively.
    Uuid(String),
}

fn device(d: &str) -> Result<Device, String> {
    if !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()) {
        return d
            .parse()
            .map(Device::Ordinal)
            .map_err(|_| format!("device {d} is past any ordinal"));
    }
    match d.strip_prefix("GPU-") {
        Some(h) if !h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-') => {
            Ok(Device::Uuid(d.to_ascii_lowercase()))
        }
        _ => Err(format!(
            "device {} is neither an ordinal nor a GPU UUID",
            shown(d)
        )),
    }
}

/// The limit in force on the client's GPU, in MiB, from a `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`
/// value: a comma list of `<device>=<size>` ([`size_mib`]); the client's GPU is device `0`
/// (an ECS container sees its one GPU as 0) or `uuid`. Err with why when the value cannot be
/// read as CUDA would (counted as no limit): empty, spaces or control characters, an empty
/// entry, a size without a device, a device that is neither an ordinal nor a GPU UUID, a
/// device given twice, an odd size, or no entry for the client's GPU (that GPU is unlimited,
/// whatever the other entries say).
pub fn pinned_limit_mib(v: &str, uuid: Option<&str>) -> Result<u64, String> {
    if v.is_empty() {
        return Err("empty".into());
    }
    if v.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("spaces or control characters in it".into());
    }
    let mut seen: Vec<(Device, u64)> = Vec::new();
    for entry in v.split(',') {
        if entry.is_empty() {
            return Err("an empty entry".into());
        }
        let Some((d, size)) = entry.split_once('=') else {
            return Err(format!("{}: a size without a device", shown(entry)));
        };
        let d = device(d)?;
        let mib = size_mib(size).map_err(|why| format!("{}: {why}", shown(entry)))?;
        if seen.iter().any(|(s, _)| *s == d) {
            return Err(format!("{}: its device is given twice", shown(entry)));
        }
        seen.push((d, mib));
    }
    let uuid = uuid.filter(|u| !u.is_empty()).map(str::to_ascii_lowercase);
    let mine: Vec<u64> = seen
        .iter()
        .filter(|(d, _)| match d {
            Device::Ordinal(o) => *o == 0,
            Device::Uuid(u) => Some(u) == uuid.as_ref(),
        })
        .map(|(_, m)| *m)
        .collect();
    match mine.as_slice() {
        [m] => Ok(*m),
        [] => Err("no entry for device 0 or this GPU's UUID: this GPU has no limit".into()),
        _ => Err("this GPU is given twice (as 0 and by its UUID)".into()),
    }
}

/// A `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` value: a whole number from 1 to 100. Err with why
/// otherwise (counted as no limit): empty, a sign, spaces, a fraction, 0, above 100 (limits
/// nothing), past 2^64.
pub fn thread_percentage(v: &str) -> Result<u64, String> {
    if v.is_empty() {
        return Err("empty".into());
    }
    if !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err("not a whole number from 1 to 100".into());
    }
    match v.parse::<u64>() {
        Ok(0) => Err("0 % (how CUDA reads it is not documented)".into()),
        Ok(p) if p > 100 => Err("above 100 %: it limits nothing".into()),
        Ok(p) => Ok(p),
        Err(_) => Err("a number past 2^64".into()),
    }
}

/// The limits in an environment's bytes (`NAME=value` entries separated by NUL), of which
/// `truncated` says whether it was cut at [`ENVIRON_MAX`], for a client on the GPU `uuid`.
/// Each variable's **first** entry counts, as libc's `getenv` (glibc, musl) returns it to the
/// CUDA driver; a later entry of the same name is never read. A value CUDA's reading of which
/// is not documented is no limit ([`pinned_limit_mib`], [`thread_percentage`]), its raw text
/// kept (escaped, clipped) with why.
pub fn parse_environ(bytes: &[u8], truncated: bool, uuid: Option<&str>) -> Limits {
    let mut out = Limits {
        truncated,
        ..Limits::default()
    };
    // A cut environment's last entry may be cut too: it is not read.
    let mut entries: Vec<&[u8]> = bytes.split(|b| *b == 0).collect();
    if truncated {
        entries.pop();
    }
    let first = |name: &str| {
        let key = format!("{name}=");
        entries
            .iter()
            .find_map(|e| e.strip_prefix(key.as_bytes()))
            .map(|v| match std::str::from_utf8(v) {
                Ok(s) => (shown(s), Ok(s)),
                Err(_) => (
                    shown(&String::from_utf8_lossy(v)),
                    Err("bytes that are not UTF-8"),
                ),
            })
    };
    if let Some((text, v)) = first(PINNED_VAR) {
        match v
            .map_err(str::to_string)
            .and_then(|v| pinned_limit_mib(v, uuid))
        {
            Ok(m) => out.memory_mib = Some(m),
            Err(why) => out.memory_unread = Some(why),
        }
        out.memory_text = Some(text);
    }
    if let Some((text, v)) = first(THREADS_VAR) {
        match v.map_err(str::to_string).and_then(thread_percentage) {
            Ok(p) => out.threads = Some(p),
            Err(why) => out.threads_unread = Some(why),
        }
        out.threads_text = Some(text);
    }
    out
}

/// A process's limits from `/proc/<pid>/environ` (bounded), for a client on the GPU `uuid`.
pub fn read_limits(proc_root: &Path, pid: u32, uuid: Option<&str>) -> Limits {
    let path = proc_root.join(pid.to_string()).join("environ");
    match crate::sys::limits::read_head(&path, ENVIRON_MAX + 1, "an environ file") {
        Ok(mut b) => {
            let truncated = b.len() as u64 > ENVIRON_MAX;
            b.truncate(ENVIRON_MAX as usize);
            parse_environ(&b, truncated, uuid)
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

/// One GPU's lists at this poll, judged with the others' at its end.
#[derive(Debug)]
struct Listed {
    gpu: GpuId,
    /// NVML's compute list (pid, bytes), when it could be read.
    compute: Option<Vec<(u32, Option<u64>)>>,
    /// NVML's MPS client list.
    clients: Vec<u32>,
}

/// What the contract checks remember between polls.
#[derive(Debug)]
pub struct Contract {
    proc_root: PathBuf,
    /// The installed programs that may hold a GPU outside MPS, by their files.
    installed: Installed,
    /// Clients' start times and limits, by pid, with the poll that last listed them; kept
    /// while NVML lists the pid.
    limits: HashMap<u32, Cached>,
    /// This poll's lists, per GPU.
    listed: Vec<Listed>,
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
    /// `installed`: the files of the programs that may hold a GPU outside MPS, looked up
    /// once at start ([`Installed::from_config`]) and refreshed here when a process that
    /// claims one of them runs a file it does not know.
    pub fn new(proc_root: &Path, installed: Installed) -> Contract {
        Contract {
            proc_root: proc_root.to_path_buf(),
            installed,
            limits: HashMap::new(),
            listed: Vec::new(),
            outside_before: HashSet::new(),
            outside_now: HashSet::new(),
            reported: HashSet::new(),
            poll: 0,
            reads: 0,
        }
    }

    pub fn begin_poll(&mut self) {
        self.poll += 1;
        self.listed.clear();
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

    /// The start time and limits of a client in an ECS task on the GPU `uuid`; None when it
    /// is gone. Its environment is read once per process: a cached pid's start time is read
    /// again every [`crate::probe::tasks::REVALIDATE_POLLS`] polls (spread by pid, as the
    /// placements' checks are, by one `stat` of `/proc/<pid>`, whose inode a reused pid never
    /// shares), and a new process reads its start time and environment again. Between two
    /// checks nothing is read: a poll costs a map lookup per client.
    pub fn limits(&mut self, pid: u32, uuid: Option<&str>) -> Option<(u64, Limits)> {
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
        let limits = read_limits(&self.proc_root, pid, uuid);
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

    /// Keeps one GPU's lists of this poll for [`Contract::outsiders`]: `compute` is NVML's
    /// compute list (read first; None when it could not be read), `clients` its MPS list.
    pub fn listed(
        &mut self,
        gpu: &GpuId,
        compute: Option<Vec<(u32, Option<u64>)>>,
        clients: &[u32],
    ) {
        self.listed.push(Listed {
            gpu: gpu.clone(),
            compute,
            clients: clients.to_vec(),
        });
    }

    /// Who each compute process in no MPS list is, once per pid: looked up again after one
    /// [`Installed::refresh`] when a process that claims an installed program runs a file
    /// the last look did not find (a package upgrade since).
    fn identities(&mut self, clients: &HashSet<u32>) -> HashMap<u32, Identity> {
        let mut ids: HashMap<u32, Identity> = HashMap::new();
        for l in &self.listed {
            for (pid, _) in l.compute.iter().flatten() {
                if !clients.contains(pid) && !ids.contains_key(pid) {
                    ids.insert(
                        *pid,
                        identity::identify(&self.proc_root, *pid, &self.installed),
                    );
                }
            }
        }
        let unknown = |i: &Identity| {
            matches!(
                i,
                Identity::Other {
                    unknown_file: true,
                    ..
                }
            )
        };
        if ids.values().any(unknown) {
            self.installed.refresh();
            for (pid, id) in ids.iter_mut().filter(|(_, i)| unknown(i)) {
                *id = identity::identify(&self.proc_root, *pid, &self.installed);
            }
        }
        ids
    }

    /// The processes outside MPS on this poll's GPUs ([`Contract::listed`]), reported once
    /// each, and how many there are now on each GPU whose compute list was read (by index).
    /// `placed` tells whether a pid runs in an ECS task or container (by its cgroup);
    /// `dedicated` whether ECS gave a GPU to one container whole (`DEDICATED`): such a GPU is
    /// not judged.
    pub fn outsiders(
        &mut self,
        placed: impl Fn(u32) -> bool,
        dedicated: impl Fn(&GpuId) -> bool,
    ) -> (Vec<Observation>, Vec<(u32, u32)>) {
        let clients: HashSet<u32> = self
            .listed
            .iter()
            .flat_map(|l| l.clients.iter().copied())
            .collect();
        let ids = self.identities(&clients);
        let server = |pid: &u32| ids.get(pid) == Some(&Identity::Installed(identity::MPS_SERVER));
        let listed = std::mem::take(&mut self.listed);
        let served_on: Vec<u32> = listed
            .iter()
            .filter(|l| !l.clients.is_empty() || l.compute.iter().flatten().any(|(p, _)| server(p)))
            .map(|l| l.gpu.index)
            .collect();
        let mut out = Vec::new();
        let mut counts = Vec::new();
        for l in &listed {
            let Some(compute) = &l.compute else { continue };
            let mut count = 0;
            if !served_on.is_empty() && !dedicated(&l.gpu) {
                for (pid, bytes) in compute {
                    if clients.contains(pid) {
                        continue;
                    }
                    let why = match ids.get(pid) {
                        Some(Identity::Installed(_)) => continue,
                        Some(Identity::Other { why, .. }) => why.as_deref(),
                        None => None,
                    };
                    let Some(start) = start_ticks(&self.proc_root, *pid) else {
                        continue; // exited between the lists, or a zombie
                    };
                    let key = (*pid, start);
                    self.outside_now.insert(key);
                    count += 1;
                    if !self.outside_before.contains(&key) || !self.reported.insert(key) {
                        continue;
                    }
                    let alone = (!served_on.contains(&l.gpu.index)).then_some(served_on.as_slice());
                    out.push(self.outsider(&l.gpu, *pid, *bytes, placed(*pid), why, alone));
                }
            }
            counts.push((l.gpu.index, count));
        }
        (out, counts)
    }

    /// The finding of one process outside MPS: `why` the fact that kept it from an
    /// exemption it claims, `alone` the GPUs MPS serves when this one has no client yet.
    fn outsider(
        &self,
        gpu: &GpuId,
        pid: u32,
        bytes: Option<u64>,
        in_task: bool,
        why: Option<&str>,
        alone: Option<&[u32]>,
    ) -> Observation {
        let program = program(&self.proc_root, pid);
        let memory = match bytes {
            Some(b) => format!("{} MiB of GPU memory", b.div_ceil(1 << 20)),
            None => "GPU memory not reported".to_string(),
        };
        let whose = if in_task {
            "in an ECS task"
        } else {
            "in no ECS task"
        };
        let mut detail = format!(
            "pid {pid} ({program}) runs outside MPS on {gpu}, {whose}: NVML lists it as a \
             compute process, not an MPS client ({memory}); it has no MPS memory limit and the \
             whole GPU's compute"
        );
        if let Some(served) = alone {
            let gpus: Vec<String> = served.iter().map(|i| format!("GPU {i}")).collect();
            detail.push_str(&format!(
                "; no MPS client runs on this GPU yet, and MPS serves this node ({})",
                gpus.join(", ")
            ));
        }
        if let Some(why) = why {
            detail.push_str(&format!("; not exempt: {why}"));
        }
        Observation::new(Signal::MpsBypass)
            .with_value(u64::from(in_task))
            .with_pids(vec![pid])
            .with_detail(detail)
            .from_source("nvml")
            .on_gpu(gpu.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::procfs::FileId;

    const UUID: &str = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6";

    #[test]
    fn sizes_and_pinned_limits_in_every_documented_form() {
        assert_eq!(size_mib("8192M"), Ok(8192));
        assert_eq!(size_mib("512MB"), Ok(512));
        assert_eq!(size_mib("1G"), Ok(1024));
        assert_eq!(pinned_limit_mib("0=8192M", None), Ok(8192));
        assert_eq!(
            pinned_limit_mib("0=1G,1=512MB", None),
            Ok(1024),
            "device 0's"
        );
        assert_eq!(pinned_limit_mib("1=512MB,0=2G", None), Ok(2048));
        let upper = UUID
            .to_ascii_uppercase()
            .replace("GPU-", "gpu-")
            .replace("gpu-", "GPU-");
        assert_eq!(
            pinned_limit_mib(&format!("{UUID}=3G"), Some(&upper)),
            Ok(3072)
        );
        assert_eq!(
            pinned_limit_mib(&format!("{UUID}=3G,1=1G"), Some(UUID)),
            Ok(3072)
        );
    }

    /// Every odd value is no limit, with why (`Err`): nobody outside NVIDIA knows how CUDA
    /// reads it, and no limit is the reading that makes it a finding.
    #[test]
    fn every_odd_pinned_limit_is_no_limit_with_why() {
        let why = |v: &str| pinned_limit_mib(v, Some(UUID)).unwrap_err();
        for (v, says) in [
            ("", "empty"),
            ("0=-1G", "not digits"),
            ("0=+1G", "not digits"),
            ("0=99999999999999999999G", "past 2^64"),
            ("0=17592186044416G", "more bytes than 2^64"),
            (" 0=1G", "spaces"),
            ("0=1G ", "spaces"),
            ("0= 1G", "spaces"),
            ("0=1G,\t1=1G", "spaces"),
            ("0=1G\n", "control"),
            ("0=1G,", "an empty entry"),
            (",0=1G", "an empty entry"),
            ("0=1T", "unit T"),
            ("0=1K", "unit K"),
            ("0=1g", "unit g"),
            ("0=1GB", "unit GB"),
            ("0=1MiB", "unit MiB"),
            ("0=1.5G", "unit .5G"),
            ("0=8192", "no unit"),
            ("0=0M", "a limit of 0"),
            ("2G", "a size without a device"),
            ("a=1G", "neither an ordinal nor a GPU UUID"),
            ("-0=1G", "neither an ordinal nor a GPU UUID"),
            ("GPU-=1G", "neither an ordinal nor a GPU UUID"),
            ("GPU-xyz=1G", "neither an ordinal nor a GPU UUID"),
            ("MIG-GPU-1/1/1=1G", "neither an ordinal nor a GPU UUID"),
            ("99999999999=1G", "past any ordinal"),
            ("0=1G,0=64G", "given twice"),
            ("1=1G", "no entry for device 0"),
            ("GPU-1234=1G", "no entry for device 0"),
        ] {
            let w = why(v);
            assert!(w.contains(says), "{v:?}: {w}");
        }
        let both = format!("0=1G,{UUID}=2G");
        assert!(why(&both).contains("given twice (as 0 and by its UUID)"));
    }

    #[test]
    fn thread_percentages_are_whole_numbers_from_1_to_100() {
        assert_eq!(thread_percentage("1"), Ok(1));
        assert_eq!(thread_percentage("100"), Ok(100));
        assert_eq!(thread_percentage("050"), Ok(50));
        for (v, says) in [
            ("", "empty"),
            ("0", "0 %"),
            ("101", "above 100"),
            ("-5", "not a whole number"),
            (" 50", "not a whole number"),
            ("50 ", "not a whole number"),
            ("50.0", "not a whole number"),
            ("50%", "not a whole number"),
            ("99999999999999999999", "past 2^64"),
        ] {
            let w = thread_percentage(v).unwrap_err();
            assert!(w.contains(says), "{v:?}: {w}");
        }
    }

    #[test]
    fn the_first_entry_of_each_variable_is_the_one_cuda_reads() {
        let env = b"PATH=/bin\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G\0CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25\0\
                    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=64G\0CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100\0";
        let l = parse_environ(env, false, None);
        assert_eq!(l.memory_mib, Some(1024));
        assert_eq!(l.memory_text.as_deref(), Some("0=1G"));
        assert_eq!(l.threads, Some(25));
        assert_eq!(l.threads_text.as_deref(), Some("25"));
        // The other way round: the large one first is the one in force.
        let env =
            b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=64G\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G\0";
        assert_eq!(parse_environ(env, false, None).memory_mib, Some(65536));
        // An odd first entry is not made good by a later one: the first is read, and is no
        // limit.
        let env = b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G\0\
                    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=150\0CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=10\0";
        let l = parse_environ(env, false, None);
        assert_eq!((l.memory_mib, l.threads), (None, None));
        assert_eq!(l.memory_text.as_deref(), Some(""));
        assert_eq!(l.memory_unread.as_deref(), Some("empty"));
        assert_eq!(l.threads_text.as_deref(), Some("150"));
        assert!(
            l.threads_unread
                .as_deref()
                .unwrap_or("")
                .contains("above 100")
        );
        assert!(l.known() && l.threads_known());
        // A name without `=` is no entry (getenv skips it); a longer name is another variable.
        let env = b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT_X=0=9G\0\
                    CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2G\0";
        assert_eq!(parse_environ(env, false, None).memory_mib, Some(2048));
    }

    #[test]
    fn raw_values_are_kept_escaped_and_clipped_and_bytes_that_are_not_utf8_are_no_limit() {
        let mut env = b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G\x1b[2J\xff\0".to_vec();
        env.extend(b"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=");
        env.extend(std::iter::repeat_n(b'9', 1000));
        env.push(0);
        let l = parse_environ(&env, false, None);
        assert_eq!(l.memory_mib, None);
        let text = l.memory_text.unwrap();
        assert!(text.starts_with("0=1G\\u{1b}[2J"), "{text}");
        assert!(!text.contains('\u{1b}'));
        assert_eq!(l.memory_unread.as_deref(), Some("bytes that are not UTF-8"));
        assert_eq!(l.threads, None);
        assert!(l.threads_text.unwrap().chars().count() <= 121);
    }

    #[test]
    fn the_environment_gives_both_limits_and_a_cut_one_is_not_judged() {
        let env = b"PATH=/bin\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M\0CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25\0";
        let l = parse_environ(env, false, None);
        assert_eq!(l.memory_mib, Some(4096));
        assert_eq!(l.memory_text.as_deref(), Some("0=4096M"));
        assert_eq!(l.threads, Some(25));
        assert!(l.known());
        let none = parse_environ(b"PATH=/bin\0", false, None);
        assert_eq!((none.memory_mib, none.threads), (None, None));
        assert!(none.known(), "no limit at all is a finding");
        // Cut inside the variable: its partial value is not read.
        let cut = parse_environ(
            b"PATH=/bin\0CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40",
            true,
            None,
        );
        assert_eq!(cut.memory_text, None);
        assert!(!cut.known() && !cut.threads_known());
        // Cut after the first entry: that is the one CUDA reads, whatever follows.
        let head = parse_environ(b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G\0X=", true, None);
        assert!(head.known());
        let bad = parse_environ(b"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=plenty\0", false, None);
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
        let l = read_limits(dir.path(), 7, None);
        assert!(l.truncated);
        assert_eq!(l.threads, Some(50));
        assert_eq!(l.memory_mib, None, "past the cap");
        assert!(!l.known());
        assert!(read_limits(dir.path(), 8, None).unreadable.is_some());
    }

    /// A fake `/proc/<pid>` in `dir`: its stat (start time), argv[0], comm, cgroup, and its
    /// `exe` linked to `exe`.
    fn fake_proc(dir: &Path, pid: u32, start: u64, argv0: &str, exe: &Path, cgroup: &str) {
        let p = dir.join(pid.to_string());
        std::fs::create_dir_all(&p).unwrap();
        let mut stat = format!("{pid} (a b) S");
        for i in 4..=22 {
            stat.push_str(&format!(" {}", if i == 22 { start } else { 0 }));
        }
        std::fs::write(p.join("stat"), stat + " 0 0\n").unwrap();
        std::fs::write(p.join("cmdline"), format!("{argv0}\0--flag\0")).unwrap();
        let comm: String = argv0.rsplit('/').next().unwrap().chars().take(15).collect();
        std::fs::write(p.join("comm"), comm + "\n").unwrap();
        std::fs::write(p.join("cgroup"), format!("{cgroup}\n")).unwrap();
        let _ = std::fs::remove_file(p.join("exe"));
        std::os::unix::fs::symlink(exe, p.join("exe")).unwrap();
    }

    #[test]
    fn a_clients_environment_is_read_once_per_process() {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("client");
        std::fs::write(&exe, "x").unwrap();
        fake_proc(dir.path(), 10, 100, "client", &exe, "0::/");
        std::fs::write(
            dir.path().join("10/environ"),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1G\0",
        )
        .unwrap();
        let mut c = Contract::new(dir.path(), Installed::none());
        for _ in 0..(3 * crate::probe::tasks::REVALIDATE_POLLS) {
            c.begin_poll();
            let (start, l) = c.limits(10, None).unwrap();
            assert_eq!((start, l.memory_mib), (100, Some(1024)));
            c.end_poll();
        }
        assert_eq!(c.reads(), 1);
        // The pid is reused: a new procfs directory (a new inode, past the file system's
        // timestamp granularity, as a new process's), read again within the revalidation bound.
        std::fs::remove_dir_all(dir.path().join("10")).unwrap();
        std::fs::create_dir_all(dir.path().join("spacer")).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        fake_proc(dir.path(), 10, 200, "client", &exe, "0::/");
        std::fs::write(dir.path().join("10/environ"), "PATH=/bin\0").unwrap();
        let mut polls = 0;
        loop {
            c.begin_poll();
            let (start, l) = c.limits(10, None).unwrap();
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
            gone |= c.limits(10, None).is_none();
            c.end_poll();
        }
        assert!(gone);
    }

    /// A GPU's lists at a poll: its index, compute list (pid, bytes), MPS clients.
    type Gpu<'a> = (u32, &'a [(u32, Option<u64>)], &'a [u32]);

    /// One poll of `gpus`; what was reported and how many are outside on each GPU.
    fn poll(
        c: &mut Contract,
        gpus: &[Gpu<'_>],
        placed: impl Fn(u32) -> bool,
        dedicated: &[u32],
    ) -> (Vec<Observation>, Vec<(u32, u32)>) {
        c.begin_poll();
        for (i, compute, clients) in gpus {
            c.listed(&GpuId::index_only(*i), Some(compute.to_vec()), clients);
        }
        let out = c.outsiders(placed, |g| dedicated.contains(&g.index));
        c.end_poll();
        out
    }

    fn root_owned() -> bool {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() == 0 }
    }

    /// A fake proc root with installed files (the MPS server, nv-hostengine) and a workload's,
    /// and processes on the host running them: 10 python3, 11 the server, 12 nv-hostengine.
    struct Node {
        dir: tempfile::TempDir,
        installed: Installed,
        server: PathBuf,
        engine: PathBuf,
        other: PathBuf,
    }

    fn node() -> Node {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path().join("usr/bin");
        std::fs::create_dir_all(&bin).unwrap();
        let server = bin.join(identity::MPS_SERVER);
        let engine = bin.join(identity::HOST_ENGINE);
        let other = bin.join("python3");
        for f in [&server, &engine, &other] {
            std::fs::write(f, f.display().to_string()).unwrap();
        }
        let installed = Installed::new(vec![
            (identity::MPS_SERVER, vec![server.clone()]),
            (identity::HOST_ENGINE, vec![engine.clone()]),
        ]);
        let d = dir.path();
        fake_proc(d, 10, 100, "/usr/bin/python3", &other, "0::/");
        fake_proc(
            d,
            11,
            100,
            "/usr/bin/nvidia-cuda-mps-server",
            &server,
            "0::/",
        );
        fake_proc(d, 12, 100, "/usr/bin/nv-hostengine", &engine, "0::/");
        Node {
            dir,
            installed,
            server,
            engine,
            other,
        }
    }

    #[test]
    fn outsiders_are_reported_at_the_second_poll_once_per_process() {
        let n = node();
        let d = n.dir.path();
        fake_proc(d, 20, 100, "client", &n.other, "0::/");
        let mut c = Contract::new(d, n.installed.clone());
        let compute = [
            (10, Some(1 << 30)),
            (11, None),
            (12, None),
            (20, None),
            (30, None),
        ];
        let gpus: [Gpu<'_>; 1] = [(1, &compute, &[20])];
        let exempt = if root_owned() { 1 } else { 3 };
        let once = |c: &mut Contract| {
            let (o, counts) = poll(c, &gpus, |p| p == 10, &[]);
            assert_eq!(
                counts,
                [(1, exempt)],
                "python3 (and the server and DCGM unless their files are root's); the gone pid 30 is not counted"
            );
            o.into_iter().filter(|o| o.pids == [10]).collect::<Vec<_>>()
        };
        assert!(once(&mut c).is_empty(), "confirmed at the next poll");
        let o = once(&mut c);
        assert_eq!(o.len(), 1, "{o:?}");
        assert_eq!(o[0].value, 1);
        let det = o[0].detail.as_deref().unwrap();
        assert!(
            det.contains("pid 10 (python3)") && det.contains("1024 MiB"),
            "{det}"
        );
        assert!(!det.contains("not exempt"), "a plain workload: {det}");
        assert!(once(&mut c).is_empty(), "once per process");
        // The pid is reused by another process: reported again, after its confirmation.
        fake_proc(d, 10, 200, "/usr/bin/python3", &n.other, "0::/");
        assert!(once(&mut c).is_empty());
        assert_eq!(once(&mut c).len(), 1);
    }

    #[test]
    fn a_name_exempts_nothing_and_the_finding_says_which_fact_failed() {
        let n = node();
        let d = n.dir.path();
        // A copy of nv-hostengine elsewhere (what a bind mount in a tenant's namespace shows
        // at the installed path): another file.
        let copy = d.join("copy-of-nv-hostengine");
        std::fs::copy(&n.engine, &copy).unwrap();
        fake_proc(d, 40, 100, "nv-hostengine", &copy, "0::/");
        fake_proc(
            d,
            41,
            100,
            "/usr/bin/nv-hostengine",
            &n.engine,
            "0::/ecstasks.slice/ecstasks-0f1e.slice/docker-0123.scope",
        );
        fake_proc(
            d,
            42,
            100,
            "/usr/bin/nvidia-cuda-mps-server",
            &n.server,
            "0::/",
        );
        fake_proc(d, 20, 100, "client", &n.other, "0::/");
        let mut c = Contract::new(d, n.installed.clone());
        let compute = [(40, None), (41, None)];
        let gpus: [Gpu<'_>; 2] = [(0, &[(20, None), (42, None)], &[20]), (1, &compute, &[])];
        poll(&mut c, &gpus, |_| false, &[]);
        let (o, counts) = poll(&mut c, &gpus, |_| false, &[]);
        let detail = |pid: u32| {
            o.iter()
                .find(|o| o.pids == [pid])
                .and_then(|o| o.detail.clone())
                .unwrap_or_else(|| panic!("pid {pid} not reported: {o:?}"))
        };
        let w = detail(40);
        let engine_id = FileId::of(&n.engine).unwrap();
        assert!(
            w.contains("runs outside MPS on GPU 1")
                && w.contains(
                    "no MPS client runs on this GPU yet, and MPS serves this node (GPU 0)"
                )
                && w.contains("not exempt: argv[0] says nv-hostengine but its executable is ")
                && w.contains(&FileId::of(&copy).unwrap().to_string())
                && w.contains(&format!(
                    "not the installed {} ({engine_id})",
                    n.engine.display()
                )),
            "{w}"
        );
        let w = detail(41);
        if root_owned() {
            assert!(
                w.contains("not exempt: it runs the installed")
                    && w.contains("in container cgroup 0::/ecstasks.slice"),
                "{w}"
            );
            assert_eq!(
                counts,
                [(0, 0), (1, 2)],
                "the real server, root's, on the host: exempt"
            );
        } else {
            assert!(w.contains("owned by uid"), "{w}");
            assert_eq!(counts, [(0, 1), (1, 2)]);
        }
    }

    #[test]
    fn mps_serves_the_node_when_any_gpu_has_a_client_or_the_real_server() {
        let n = node();
        let d = n.dir.path();
        let fake_server = d.join("nvidia-cuda-mps-server");
        std::fs::write(&fake_server, "not it").unwrap();
        fake_proc(
            d,
            12,
            100,
            "/usr/bin/nvidia-cuda-mps-server",
            &fake_server,
            "0::/",
        );
        let twice = |c: &mut Contract, gpus: &[Gpu<'_>], dedicated: &[u32]| {
            poll(c, gpus, |_| false, dedicated);
            poll(c, gpus, |_| false, dedicated)
        };
        // No client, no server anywhere: MPS serves nothing here.
        let mut c = Contract::new(d, n.installed.clone());
        let (o, counts) = twice(&mut c, &[(0, &[(10, None)], &[]), (1, &[], &[])], &[]);
        assert!(o.is_empty() && counts == [(0, 0), (1, 0)], "{o:?}");
        // A process named like the server that is not its file serves nothing either.
        let mut c = Contract::new(d, n.installed.clone());
        let (o, _) = twice(&mut c, &[(0, &[(10, None), (12, None)], &[])], &[]);
        assert!(o.is_empty(), "{o:?}");
        // The real server on GPU 0 serves the node: python3 on GPU 1 is outside MPS.
        if root_owned() {
            let mut c = Contract::new(d, n.installed.clone());
            let (o, counts) = twice(
                &mut c,
                &[(0, &[(11, None)], &[]), (1, &[(10, None)], &[])],
                &[],
            );
            assert_eq!(counts, [(0, 0), (1, 1)]);
            assert_eq!(o.len(), 1);
            assert_eq!(o[0].value, 0);
        }
        // A client on GPU 0 serves the node; a GPU ECS gave whole to one container is left alone.
        let mut c = Contract::new(d, n.installed.clone());
        let gpus: [Gpu<'_>; 2] = [(0, &[], &[20]), (1, &[(10, None)], &[])];
        let (o, counts) = twice(&mut c, &gpus, &[1]);
        assert!(o.is_empty() && counts == [(0, 0), (1, 0)], "{o:?}");
        // A client of MPS on one GPU listed as a compute process on another is a client.
        let mut c = Contract::new(d, n.installed.clone());
        let gpus: [Gpu<'_>; 2] = [(0, &[], &[10]), (1, &[(10, None)], &[])];
        let (o, _) = twice(&mut c, &gpus, &[]);
        assert!(o.is_empty(), "{o:?}");
    }

    #[test]
    fn on_the_real_proc_this_process_is_exempt_only_as_the_installed_file() {
        let me = std::process::id();
        let root = Path::new("/proc");
        let own = std::env::current_exe().unwrap();
        let gpus: [Gpu<'_>; 2] = [(0, &[], &[1]), (1, &[(me, None)], &[])];
        // Installed as gpu-medic: exempt when its file is root's and it runs in no container.
        let mut c = Contract::new(root, Installed::new(vec![(identity::GPU_MEDIC, vec![own])]));
        poll(&mut c, &gpus, |_| false, &[]);
        let (_, counts) = poll(&mut c, &gpus, |_| false, &[]);
        let exe = crate::sys::procfs::exe(root, me).unwrap();
        let cg = crate::sys::procfs::cgroup(root, me).unwrap_or_default();
        let fits = exe.owner == 0 && !crate::sys::procfs::in_container(&cg);
        assert_eq!(counts[1], (1, u32::from(!fits)));
        // Nothing installed: the same process is outside MPS.
        let mut c = Contract::new(root, Installed::none());
        poll(&mut c, &gpus, |_| false, &[]);
        let (o, counts) = poll(&mut c, &gpus, |_| false, &[]);
        assert_eq!(counts[1], (1, 1));
        assert_eq!(o.len(), 1);
    }
}
