//! Which processes serve a pipe directory, and signals to them.
//!
//! Both MPS binaries show as `nvidia-cuda-mps` in `comm`, and r535 writes no pid file, so a
//! process is the daemon of our pipe directory when its command line names the control
//! binary in daemon mode (`-d` or `-f`) and its environment holds our
//! `CUDA_MPS_PIPE_DIRECTORY` (unset means NVIDIA's default, `/tmp/nvidia-mps`). A server is
//! an `nvidia-cuda-mps-server` with the same environment or a daemon as parent. Everything
//! is read from `/proc`, bounded (see [`Scanner`]), as is the lock on `control_lock` and the
//! state checked while waiting for a death.
//! A zombie is dead: `kill -0` succeeds on it but it serves nothing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::control::normalize;

pub const DAEMON_NAME: &str = "nvidia-cuda-mps-control";
pub const SERVER_NAME: &str = "nvidia-cuda-mps-server";
/// NVIDIA's pipe directory when `CUDA_MPS_PIPE_DIRECTORY` is unset.
pub const DEFAULT_PIPE_DIR: &str = "/tmp/nvidia-mps";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Daemon,
    Server,
}

/// A live (non-zombie) MPS process of our pipe directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsProcess {
    pub pid: u32,
    pub parent: Option<u32>,
    pub role: Role,
    /// The state letter from `/proc/<pid>/status` (`S`, `R`, `T` stopped, `D`, ...).
    pub state: char,
    /// `argv[0]` when scanned; checked again before every signal.
    pub arg0: String,
}

impl MpsProcess {
    /// Stopped by a signal (SIGSTOP) or a tracer: it cannot answer until continued.
    pub fn is_stopped(&self) -> bool {
        matches!(self.state, 'T' | 't')
    }
}

/// The MPS processes serving one pipe directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Found {
    pub daemons: Vec<MpsProcess>,
    pub servers: Vec<MpsProcess>,
    /// Front-ends talking to the daemon of our pipe directory now: the control binary run
    /// in client mode (the ECS agent's probe, an operator's query). The daemon serves one
    /// such session at a time; a second one fails (tests/support/MPS-FACTS.md, section 3).
    pub clients: Vec<u32>,
}

impl Found {
    pub fn daemon_pids(&self) -> Vec<u32> {
        self.daemons.iter().map(|p| p.pid).collect()
    }
}

/// Lists processes from `/proc`, reading what it needs of each and never more: every
/// process's `stat` (its `comm`, state and parent) and executable's name; command line and
/// environment only of the few whose name is an MPS binary's, each capped ([`MAX_CMDLINE`],
/// [`MAX_ENVIRON`]). A workload's processes with command lines of megabytes cost nothing.
pub struct Scanner {
    control_binary: PathBuf,
    pipe_dir: PathBuf,
}

/// What is read of a candidate's command line and environment.
const MAX_CMDLINE: u64 = 64 * 1024;
const MAX_ENVIRON: u64 = 256 * 1024;
/// `/proc/<pid>/stat` is one line of a few hundred bytes.
const MAX_STAT: u64 = 4096;
/// The kernel keeps 15 bytes of a program's name as its `comm`.
const COMM_LEN: usize = 15;

impl Scanner {
    pub fn new(control_binary: &Path, pipe_dir: &Path) -> Self {
        Scanner {
            control_binary: control_binary.to_path_buf(),
            pipe_dir: pipe_dir.to_path_buf(),
        }
    }

    /// Scans without blocking the runtime.
    pub async fn scan(&mut self) -> Result<Found, String> {
        let (binary, pipe) = (self.control_binary.clone(), self.pipe_dir.clone());
        tokio::task::spawn_blocking(move || scan_with(Path::new("/proc"), &binary, &pipe))
            .await
            .map_err(|e| format!("process scan failed: {e}"))?
    }

    /// Scans on the calling thread.
    pub fn scan_blocking(&mut self) -> Result<Found, String> {
        scan_with(Path::new("/proc"), &self.control_binary, &self.pipe_dir)
    }
}

fn basename(s: &std::ffi::OsStr) -> &std::ffi::OsStr {
    Path::new(s).file_name().unwrap_or(s)
}

/// What `/proc/<pid>/stat` says of a process: its `comm`, state letter and parent.
fn read_stat(dir: &Path) -> Option<(Vec<u8>, char, Option<u32>)> {
    let buf = crate::sys::limits::read_head(&dir.join("stat"), MAX_STAT, "a process stat").ok()?;
    // "pid (comm) S ppid ...": the comm may hold spaces and parentheses; it ends at the last ')'.
    let open = buf.iter().position(|b| *b == b'(')?;
    let close = buf.iter().rposition(|b| *b == b')')?;
    let comm = buf.get(open + 1..close)?.to_vec();
    let rest = String::from_utf8_lossy(buf.get(close + 1..)?).into_owned();
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let parent = fields
        .next()
        .and_then(|p| p.parse::<u32>().ok())
        .filter(|p| *p > 0);
    Some((comm, state, parent))
}

/// At most `cap` bytes of a `\0`-separated `/proc` file, split.
fn read_list(path: &Path, cap: u64) -> Vec<std::ffi::OsString> {
    use std::os::unix::ffi::OsStringExt;
    let Ok(buf) = crate::sys::limits::read_head(path, cap, "a process list") else {
        return Vec::new();
    };
    buf.split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| std::ffi::OsString::from_vec(a.to_vec()))
        .collect()
}

fn scan_with(proc_root: &Path, control_binary: &Path, pipe_dir: &Path) -> Result<Found, String> {
    use std::os::unix::ffi::OsStrExt;
    let binary_name = control_binary
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    let comm_of = |name: &[u8]| name[..name.len().min(COMM_LEN)].to_vec();
    let names: Vec<Vec<u8>> = [
        DAEMON_NAME.as_bytes(),
        SERVER_NAME.as_bytes(),
        binary_name.as_bytes(),
    ]
    .iter()
    .filter(|n| !n.is_empty())
    .map(|n| comm_of(n))
    .collect();
    let rd = std::fs::read_dir(proc_root)
        .map_err(|e| format!("cannot list processes in {}: {e}", proc_root.display()))?;
    let want = normalize(pipe_dir);
    let mut found = Found::default();
    let mut daemon_pids = Vec::new();
    let mut servers = Vec::new();
    for entry in rd.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let dir = entry.path();
        let Some((comm, state, parent)) = read_stat(&dir) else {
            continue; // gone since the listing
        };
        if matches!(state, 'Z' | 'X') {
            continue;
        }
        let exe = std::fs::read_link(dir.join("exe")).ok();
        let exe_name = exe.as_deref().and_then(|e| e.file_name()).map(|n| {
            n.as_bytes()
                .strip_suffix(b" (deleted)")
                .unwrap_or(n.as_bytes())
                .to_vec()
        });
        // Only a process named like an MPS binary is looked at further.
        let by_exe = |n: &str| exe_name.as_deref() == Some(n.as_bytes());
        if !names.contains(&comm) && !by_exe(DAEMON_NAME) && !by_exe(SERVER_NAME) {
            continue;
        }
        let cmd = read_list(&dir.join("cmdline"), MAX_CMDLINE);
        let arg0 = cmd.first().map(|a| basename(a));
        let named = |n: &str| arg0 == Some(n.as_ref()) || by_exe(n);
        let role = if named(DAEMON_NAME)
            || (!binary_name.is_empty() && arg0 == Some(binary_name.as_os_str()))
        {
            let daemon_mode = cmd.iter().skip(1).any(|a| a == "-d" || a == "-f");
            if !daemon_mode {
                // A front-end, not the daemon: one of ours only when it talks to our pipe.
                if serves(&read_list(&dir.join("environ"), MAX_ENVIRON), &want) {
                    found.clients.push(pid);
                }
                continue;
            }
            Role::Daemon
        } else if named(SERVER_NAME) {
            Role::Server
        } else {
            continue;
        };
        let ours = serves(&read_list(&dir.join("environ"), MAX_ENVIRON), &want);
        let proc = MpsProcess {
            pid,
            parent,
            role,
            state,
            arg0: cmd
                .first()
                .map(|a| a.to_string_lossy().into_owned())
                .unwrap_or_default(),
        };
        match role {
            Role::Daemon if ours => {
                daemon_pids.push(proc.pid);
                found.daemons.push(proc);
            }
            Role::Server => servers.push((proc, ours)),
            Role::Daemon => {}
        }
    }
    for (s, ours) in servers {
        if ours || s.parent.is_some_and(|pp| daemon_pids.contains(&pp)) {
            found.servers.push(s);
        }
    }
    found.daemons.sort_by_key(|p| p.pid);
    found.servers.sort_by_key(|p| p.pid);
    Ok(found)
}

/// Whether an environment selects `want` as its pipe directory.
fn serves(environ: &[std::ffi::OsString], want: &Path) -> bool {
    const KEY: &[u8] = b"CUDA_MPS_PIPE_DIRECTORY=";
    use std::os::unix::ffi::OsStrExt;
    let dir = environ
        .iter()
        .find_map(|e| e.as_bytes().strip_prefix(KEY))
        .map(|v| Path::new(std::ffi::OsStr::from_bytes(v)).to_path_buf())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_PIPE_DIR));
    normalize(&dir) == want
}

/// The `State:` letter of `/proc/<pid>/status`; `None` when the process is gone. A status
/// that cannot be read for another reason is `Some('?')`: a process that is there but
/// unreadable (a name that is not UTF-8 is read lossily) must never count as gone.
pub fn state_letter(pid: u32) -> Option<char> {
    let path = PathBuf::from(format!("/proc/{pid}/status"));
    match crate::sys::limits::read_pseudo(&path, MAX_STATUS, "a process status") {
        Ok(text) => Some(
            text.lines()
                .find_map(|l| l.strip_prefix("State:"))
                .and_then(|s| s.trim_start().chars().next())
                .unwrap_or('?'),
        ),
        Err(e) if e.is_not_found() => None,
        Err(crate::sys::limits::ReadError::Io { source, .. })
            if source.raw_os_error() == Some(libc::ESRCH) =>
        {
            None
        }
        Err(_) => Some('?'),
    }
}

/// `/proc/<pid>/status` is about 1.5 KiB.
const MAX_STATUS: u64 = 64 * 1024;
/// What is read of `/proc/<pid>/cmdline` for its `argv[0]` (the whole can be 6 MiB).
const MAX_ARG0: u64 = 4096;
/// How much of `/proc/locks` is looked through, and its longest line: a workload may hold
/// millions of locks, and the file lists every one on the machine.
const MAX_LOCKS_SCAN: u64 = 256 * 1024 * 1024;
const MAX_LOCKS_LINE: usize = 1024;

/// Alive and not a zombie.
pub fn is_alive(pid: u32) -> bool {
    !matches!(state_letter(pid), None | Some('Z') | Some('X'))
}

/// Waits until none of `pids` is alive; returns those still alive at the deadline.
pub async fn wait_gone(pids: &[u32], within: Duration) -> Vec<u32> {
    let deadline = Instant::now() + within;
    loop {
        let alive: Vec<u32> = pids.iter().copied().filter(|p| is_alive(*p)).collect();
        if alive.is_empty() || Instant::now() >= deadline {
            return alive;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `sig` to `p` if its pid still runs the same program (guards against the pid
/// being reused between the scan and the signal). Returns whether it was sent.
pub fn signal(p: &MpsProcess, sig: libc::c_int) -> bool {
    if arg0_of(p.pid).as_deref() != Some(p.arg0.as_str()) {
        return false;
    }
    let Ok(pid) = libc::pid_t::try_from(p.pid) else {
        return false;
    };
    if pid <= 1 {
        return false;
    }
    // SAFETY: kill(2) has no memory-safety preconditions; `pid` is a positive pid that was
    // just checked to still run the MPS program we mean to signal.
    unsafe { libc::kill(pid, sig) == 0 }
}

/// `argv[0]` of a live process.
fn arg0_of(pid: u32) -> Option<String> {
    let path = PathBuf::from(format!("/proc/{pid}/cmdline"));
    let cmdline = crate::sys::limits::read_head(&path, MAX_ARG0, "a command line").ok()?;
    let arg0 = cmdline.split(|b| *b == 0).next()?;
    if arg0.is_empty() {
        return None; // a zombie or kernel thread
    }
    Some(String::from_utf8_lossy(arg0).into_owned())
}

/// Whether some process holds a POSIX lock on `path` (the daemon locks `control_lock` for
/// its whole life; `/proc/locks` names the holder). `None`: the file does not exist.
pub fn lock_holder(path: &Path) -> Option<Option<u32>> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    let dev = meta.dev();
    let id = format!(
        "{:02x}:{:02x}:{}",
        libc::major(dev),
        libc::minor(dev),
        meta.ino()
    );
    let Ok(file) = crate::sys::limits::open_checked(
        Path::new("/proc/locks"),
        crate::sys::limits::Kind::Regular,
        u64::MAX,
        "/proc/locks",
    ) else {
        return Some(None);
    };
    Some(parse_lock_holder(std::io::BufReader::new(file), &id))
}

/// The holder of the lock on `id` in a `/proc/locks` listing, read line by line (each line
/// capped, at most [`MAX_LOCKS_SCAN`] bytes in all).
fn parse_lock_holder(mut locks: impl std::io::BufRead, id: &str) -> Option<u32> {
    use crate::sys::lines::{CappedLine, read_capped_line};
    let mut buf = Vec::new();
    let mut scanned = 0u64;
    while scanned < MAX_LOCKS_SCAN {
        let line = match read_capped_line(
            &mut locks,
            &mut buf,
            MAX_LOCKS_LINE,
            MAX_LOCKS_SCAN - scanned,
        ) {
            Ok(Some(CappedLine::Text { text, .. })) => text,
            Ok(Some(CappedLine::TooLong { len })) => {
                scanned = scanned.saturating_add(len as u64 + 1);
                continue;
            }
            Ok(None) | Err(_) => return None,
        };
        scanned = scanned.saturating_add(line.len() as u64 + 1);
        let fields: Vec<&str> = line.split_whitespace().collect();
        // "1: POSIX  ADVISORY  WRITE 6424 00:2f:1234 0 EOF"; waiters carry a "->" field.
        let Some(pos) = fields.iter().position(|f| *f == id) else {
            continue;
        };
        if line.contains("->") {
            continue;
        }
        if let Some(pid) = pos.checked_sub(1).and_then(|i| fields[i].parse().ok()) {
            return Some(pid);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsString;

    #[test]
    fn environment_selects_the_pipe_directory() {
        let env = |v: &str| vec![OsString::from("PATH=/bin"), OsString::from(v)];
        let want = normalize(Path::new("/run/mps-ecs"));
        assert!(serves(&env("CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs"), &want));
        assert!(serves(&env("CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs/"), &want));
        assert!(!serves(
            &env("CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs2"),
            &want
        ));
        assert!(!serves(&env("X=1"), &want));
        let default = normalize(Path::new(DEFAULT_PIPE_DIR));
        assert!(serves(&env("X=1"), &default));
    }

    #[test]
    fn lock_holder_is_read_from_proc_locks() {
        let locks = "1: POSIX  ADVISORY  WRITE 6424 00:2f:1234 0 EOF\n\
                     1: -> POSIX  ADVISORY  WRITE 7777 00:2f:1234 0 EOF\n\
                     2: FLOCK  ADVISORY  WRITE 99 08:01:55 0 EOF\n";
        let holder = |text: &str, id: &str| parse_lock_holder(text.as_bytes(), id);
        assert_eq!(holder(locks, "00:2f:1234"), Some(6424));
        assert_eq!(holder(locks, "08:01:55"), Some(99));
        assert_eq!(holder(locks, "00:2f:9"), None);
        assert_eq!(holder("garbage\n\n", "00:2f:9"), None);
        // An overlong line is skipped, never held; the holder after it is still found.
        let long = format!("{}\n{locks}", "x".repeat(10 * MAX_LOCKS_LINE));
        assert_eq!(holder(&long, "08:01:55"), Some(99));
    }

    /// A process whose name is not UTF-8 (its program's file name, here) is alive: its
    /// status is read lossily, never taken for a process that is gone.
    #[test]
    fn a_process_named_with_bytes_that_are_not_utf8_is_alive() {
        use std::os::unix::ffi::OsStrExt;
        let dir = tempfile::tempdir().unwrap();
        let name = dir
            .path()
            .join(std::ffi::OsStr::from_bytes(b"sl\xff\xfeep"));
        std::os::unix::fs::symlink("/bin/sleep", &name).unwrap();
        let mut child = std::process::Command::new(&name).arg("30").spawn().unwrap();
        let pid = child.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read(format!("/proc/{pid}/status"))
            .is_ok_and(|s| s.windows(2).any(|w| w == b"\xff\xfe"))
        {
            assert!(Instant::now() < deadline, "the child never showed its name");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(std::fs::read_to_string(format!("/proc/{pid}/status")).is_err());
        assert!(is_alive(pid));
        assert_eq!(
            state_letter(pid).map(|c| c.is_ascii_alphabetic()),
            Some(true)
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(!is_alive(pid));
    }

    /// A server is found by its name and its environment, read from `/proc` within caps: a
    /// command line of a megabyte is no cost and no error.
    #[test]
    fn a_server_is_found_by_name_and_environment_from_proc() {
        let dir = tempfile::tempdir().unwrap();
        let server = dir.path().join(SERVER_NAME);
        std::os::unix::fs::symlink("/bin/sleep", &server).unwrap();
        let pipe = dir.path().join("pipe");
        std::fs::create_dir(&pipe).unwrap();
        let mut child = std::process::Command::new(&server)
            .arg("30")
            // Another 0 seconds, ten times, a megabyte in all (one argument may be 128 KiB).
            .args(std::iter::repeat_n("0".repeat(100 * 1024), 10))
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .spawn()
            .unwrap();
        let pid = child.id();
        let control = Path::new(DAEMON_NAME);
        let deadline = Instant::now() + Duration::from_secs(10);
        let found = loop {
            let f = Scanner::new(control, &pipe).scan_blocking().unwrap();
            if !f.servers.is_empty() || Instant::now() > deadline {
                break f;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let s = found
            .servers
            .iter()
            .find(|s| s.pid == pid)
            .unwrap_or_else(|| panic!("the stand-in server {pid} was not found: {found:?}"));
        assert_eq!(s.role, Role::Server);
        assert!(s.arg0.ends_with(SERVER_NAME), "{}", s.arg0);
        let other = Scanner::new(control, &dir.path().join("elsewhere"))
            .scan_blocking()
            .unwrap();
        assert!(other.servers.iter().all(|s| s.pid != pid));
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn our_own_process_is_alive_and_unknown_pids_are_not() {
        assert!(is_alive(std::process::id()));
        assert!(!is_alive(u32::MAX - 1));
        assert_eq!(state_letter(u32::MAX - 1), None);
    }
}
