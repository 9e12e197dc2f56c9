//! What the kernel keeps about a process, as opposed to what the process says of itself.
//!
//! A process chooses its own `comm` (`prctl(PR_SET_NAME)`), its `argv[0]` (`exec -a`), its
//! environment and the path it runs from (a bind mount in its own mount namespace can put any
//! file at any path). None of that says who it is. The kernel's facts do, and only they decide
//! who a process is in gpu-medic (docs/attribution.md, "What a tenant can and cannot do"):
//!
//! - its **executable as a file**: `stat("/proc/<pid>/exe")` follows the kernel's own link to
//!   the file the process was started from, whatever mount namespace it runs in, so the
//!   device and inode ([`FileId`]) are the host's, and a copy or bind mount elsewhere is
//!   another file (a bind mount of the same file is the same inode: who may run it is then
//!   told by the cgroup and parent);
//! - its **cgroup** (`/proc/<pid>/cgroup`): a process cannot leave its container's;
//! - its **real uid** (`/proc/<pid>/status`, `Uid:`) and **parent** and **start time**
//!   (`/proc/<pid>/stat`, fields 4 and 22; the `comm` before them may hold spaces and
//!   parentheses and ends at the last `)`).
//!
//! Everything is read bounded ([`crate::sys::limits`]); a process that is gone is `None`.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// `/proc/<pid>/stat` is one line of a few hundred bytes.
const STAT_MAX: u64 = 4096;
/// `/proc/<pid>/status` is a few kilobytes.
const STATUS_MAX: u64 = 16 * 1024;
/// A cgroup file names one path per hierarchy (v1) or one (v2).
pub const CGROUP_MAX: u64 = 16 * 1024;

/// A file as the kernel knows it: device and inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

impl FileId {
    /// The file at `path` (symlinks followed); None when there is none.
    pub fn of(path: &Path) -> Option<FileId> {
        let m = std::fs::metadata(path).ok()?;
        Some(FileId {
            dev: m.dev(),
            ino: m.ino(),
        })
    }
}

impl std::fmt::Display for FileId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:x}:{}", self.dev, self.ino)
    }
}

/// The executable a process runs, as a file: its identity and its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exe {
    pub id: FileId,
    /// The file's owner (`st_uid`).
    pub owner: u32,
}

/// What `/proc/<pid>/stat` says: state letter, parent and start time (clock ticks after boot).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub state: char,
    pub parent: Option<u32>,
    pub start_ticks: u64,
}

impl Stat {
    /// A zombie (or a dead task) runs nothing.
    pub fn is_dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Reads `/proc/<pid>/stat`; None when the process is gone or the file does not parse.
pub fn stat(proc_root: &Path, pid: u32) -> Option<Stat> {
    let path = proc_root.join(pid.to_string()).join("stat");
    let buf = crate::sys::limits::read_head(&path, STAT_MAX, "a stat file").ok()?;
    parse_stat(&buf)
}

/// The fields after `(comm)` of a stat line.
pub fn parse_stat(buf: &[u8]) -> Option<Stat> {
    let close = buf.iter().rposition(|b| *b == b')')?;
    let rest = String::from_utf8_lossy(buf.get(close + 1..)?).into_owned();
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Field 3 (state) is f[0]; field N is f[N - 3].
    let state = f.first()?.chars().next()?;
    let parent = f.get(4 - 3)?.parse::<u32>().ok().filter(|p| *p > 0);
    let start_ticks = f.get(22 - 3)?.parse().ok()?;
    Some(Stat {
        state,
        parent,
        start_ticks,
    })
}

/// The executable of a live process as a file; None when it is gone, a kernel thread, or
/// not readable (another user's process without the right to read it).
pub fn exe(proc_root: &Path, pid: u32) -> Option<Exe> {
    let m = std::fs::metadata(proc_root.join(pid.to_string()).join("exe")).ok()?;
    Some(Exe {
        id: FileId {
            dev: m.dev(),
            ino: m.ino(),
        },
        owner: m.uid(),
    })
}

/// The path the executable has in the process's own view (for display only: it is no
/// identity, a bind mount can show any file under any path).
pub fn exe_path(proc_root: &Path, pid: u32) -> Option<String> {
    let p = std::fs::read_link(proc_root.join(pid.to_string()).join("exe")).ok()?;
    Some(p.to_string_lossy().into_owned())
}

/// The real uid of a live process (`Uid:` of `/proc/<pid>/status`, its first field).
pub fn uid(proc_root: &Path, pid: u32) -> Option<u32> {
    let path = proc_root.join(pid.to_string()).join("status");
    let text = crate::sys::limits::read_pseudo(&path, STATUS_MAX, "a status file").ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// The text of `/proc/<pid>/cgroup` (bounded); None when the process is gone or it cannot be
/// read.
pub fn cgroup(proc_root: &Path, pid: u32) -> Option<String> {
    let path = proc_root.join(pid.to_string()).join("cgroup");
    crate::sys::limits::read_pseudo(&path, CGROUP_MAX, "a cgroup file").ok()
}

/// Whether one folder of a cgroup path is a container's: an ECS task slice (`ecstasks-…`,
/// cgroup v2) or task folder (`ecs`, cgroup v1), Docker (`docker-<id>.scope` of the systemd
/// driver, `docker` of cgroupfs), containerd's CRI (`cri-containerd-…`), CRI-O (`crio-…`),
/// Podman (`libpod-…`), LXC (`lxc.payload…`), Kubernetes pods (`kubepods…`) or systemd's
/// machines (`machine.slice`). The daemons themselves (`docker.service`,
/// `containerd.service`, `ecs.service`) are not containers.
fn container_folder(part: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "ecstasks",
        "cri-containerd-",
        "crio-",
        "libpod-",
        "lxc.payload",
        "kubepods",
    ];
    part == "ecs"
        || part == "docker"
        || part == "machine.slice"
        || (part.starts_with("docker-") && part.ends_with(".scope"))
        || PREFIXES.iter().any(|p| part.starts_with(p))
}

/// Whether a cgroup file's text puts the process in a container (an ECS task, a Docker,
/// containerd, CRI-O or Podman container, a Kubernetes pod, a machine): by the folders of
/// its path, which a process cannot leave.
pub fn in_container(cgroup_text: &str) -> bool {
    cgroup_text.lines().any(|line| {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        path.split('/').any(container_folder)
    })
}

/// Clock ticks per second for [`Stat::start_ticks`] (`sysconf(_SC_CLK_TCK)`, 100 on Linux).
pub fn ticks_per_second() -> u64 {
    // SAFETY: sysconf only reads a constant of the running system.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(t).ok().filter(|t| *t > 0).unwrap_or(100)
}

/// Whether a kernel record stamped `record_usec` after boot was written before a process that
/// started at `start_ticks` after boot existed: such a record is another process's, whatever
/// its pid says (pids are reused). A start time is known to the tick (10 ms at 100 Hz): a
/// record before the start of the tick the process started in is before it.
pub fn record_predates(record_usec: u64, start_ticks: u64, ticks_per_second: u64) -> bool {
    let start_usec = u128::from(start_ticks) * 1_000_000 / u128::from(ticks_per_second.max(1));
    u128::from(record_usec) < start_usec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_read_after_the_last_parenthesis() {
        let line = b"4242 (a) b) (c ) S 17 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 123456 1000 10 18446744073709551615\n";
        let s = parse_stat(line).unwrap();
        assert_eq!(s.state, 'S');
        assert_eq!(s.parent, Some(17));
        assert_eq!(s.start_ticks, 123456);
        assert!(parse_stat(b"12 (x").is_none());
        assert!(parse_stat(b"").is_none());
    }

    #[test]
    fn the_live_process_has_facts() {
        let me = std::process::id();
        let root = Path::new("/proc");
        let s = stat(root, me).unwrap();
        assert!(!s.is_dead());
        assert!(s.start_ticks > 0);
        let exe = exe(root, me).unwrap();
        assert_eq!(
            Some(exe.id),
            FileId::of(&std::env::current_exe().unwrap()),
            "the exe link is the file the test runs from"
        );
        assert!(uid(root, me).is_some());
        assert!(cgroup(root, me).is_some());
        assert!(stat(root, u32::MAX).is_none());
    }

    #[test]
    fn container_cgroups_are_told_from_host_ones() {
        for c in [
            "0::/ecstasks.slice/ecstasks-0f1e2d3c4b5a69788796a5b4c3d2e1f0.slice/docker-0123456789ab.scope",
            "12:memory:/ecs/0f1e2d3c4b5a69788796a5b4c3d2e1f0/0123456789abcdef",
            "0::/system.slice/docker-0123456789abcdef.scope",
            "0::/docker/0123456789abcdef",
            "0::/kubepods.slice/kubepods-besteffort.slice/x",
            "0::/kubepods/burstable/pod1/x",
            "0::/system.slice/cri-containerd-0123.scope",
            "0::/machine.slice/libpod-0123.scope",
        ] {
            assert!(in_container(c), "{c}");
        }
        for c in [
            "0::/system.slice/nvidia-mps.service",
            "0::/system.slice/gpu-medic.service",
            "0::/user.slice/user-0.slice/session-1.scope",
            "0::/",
            "0::/init.scope",
            "0::/system.slice/ecs.service",
            "0::/system.slice/docker.service",
            "0::/system.slice/containerd.service",
        ] {
            assert!(!in_container(c), "{c}");
        }
    }

    #[test]
    fn a_record_before_the_start_of_a_process_is_not_its_own() {
        // Started at tick 1000 (10 s at 100 Hz).
        assert!(record_predates(9_999_999, 1000, 100));
        assert!(!record_predates(10_000_000, 1000, 100));
        assert!(
            !record_predates(u64::MAX, 0, 100),
            "no overflow at the ends"
        );
        assert!(record_predates(u64::MAX, u64::MAX, 100));
        assert!(record_predates(0, u64::MAX, 1));
    }
}
