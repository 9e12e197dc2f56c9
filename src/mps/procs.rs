//! Which processes serve a pipe directory, and signals to them.
//!
//! Both MPS binaries show as `nvidia-cuda-mps` in `comm`, and r535 writes no pid file, so a
//! process is the daemon of our pipe directory when its command line names the control
//! binary in daemon mode (`-d` or `-f`) and its environment holds our
//! `CUDA_MPS_PIPE_DIRECTORY` (unset means NVIDIA's default, `/tmp/nvidia-mps`). A server is
//! an `nvidia-cuda-mps-server` with the same environment or a daemon as parent. `sysinfo`
//! lists processes with their command lines, environments and states; `/proc` answers what
//! it does not (the lock on `control_lock`, a cheap state check while waiting for a death).
//! A zombie is dead: `kill -0` succeeds on it but it serves nothing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sysinfo::{ProcessRefreshKind, ProcessStatus, ProcessesToUpdate, System, UpdateKind};

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
}

impl Found {
    pub fn daemon_pids(&self) -> Vec<u32> {
        self.daemons.iter().map(|p| p.pid).collect()
    }
}

/// Lists processes through `sysinfo`, keeping its tables between scans.
pub struct Scanner {
    sys: Option<System>,
    control_binary: PathBuf,
    pipe_dir: PathBuf,
}

impl Scanner {
    pub fn new(control_binary: &Path, pipe_dir: &Path) -> Self {
        Scanner {
            sys: None,
            control_binary: control_binary.to_path_buf(),
            pipe_dir: pipe_dir.to_path_buf(),
        }
    }

    /// Scans without blocking the runtime.
    pub async fn scan(&mut self) -> Result<Found, String> {
        let sys = self.sys.take();
        let (binary, pipe) = (self.control_binary.clone(), self.pipe_dir.clone());
        let job = tokio::task::spawn_blocking(move || {
            let mut sys = match sys {
                Some(s) => s,
                None => System::new().map_err(|e| format!("cannot list processes: {e}"))?,
            };
            let found = scan_with(&mut sys, &binary, &pipe);
            Ok::<_, String>((sys, found))
        });
        match job.await {
            Ok(Ok((sys, found))) => {
                self.sys = Some(sys);
                Ok(found)
            }
            Ok(Err(e)) => Err(e),
            Err(e) => Err(format!("process scan failed: {e}")),
        }
    }

    /// Scans on the calling thread.
    pub fn scan_blocking(&mut self) -> Result<Found, String> {
        if self.sys.is_none() {
            self.sys = Some(System::new().map_err(|e| format!("cannot list processes: {e}"))?);
        }
        match self.sys.as_mut() {
            Some(sys) => Ok(scan_with(sys, &self.control_binary, &self.pipe_dir)),
            None => Err("cannot list processes".into()),
        }
    }
}

fn basename(s: &std::ffi::OsStr) -> &std::ffi::OsStr {
    Path::new(s).file_name().unwrap_or(s)
}

fn scan_with(sys: &mut System, control_binary: &Path, pipe_dir: &Path) -> Found {
    let binary_name = control_binary
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    // Pass 1: command lines and executables of everything (cheap), to pick candidates.
    sys.refresh_processes_specifics(
        ProcessesToUpdate::All,
        true,
        ProcessRefreshKind::nothing()
            .without_tasks()
            .with_cmd(UpdateKind::Always)
            .with_exe(UpdateKind::Always),
    );
    let mut candidates = Vec::new();
    for (pid, p) in sys.processes() {
        if p.status() == ProcessStatus::Zombie || p.status() == ProcessStatus::Dead {
            continue;
        }
        let arg0 = p.cmd().first().map(|a| basename(a));
        let exe = p.exe().and_then(|e| e.file_name());
        let named = |n: &str| arg0 == Some(n.as_ref()) || exe == Some(n.as_ref());
        let role = if named(DAEMON_NAME)
            || (!binary_name.is_empty() && arg0 == Some(binary_name.as_os_str()))
        {
            let daemon_mode = p.cmd().iter().skip(1).any(|a| a == "-d" || a == "-f");
            if !daemon_mode {
                continue; // a control client, not the daemon
            }
            Role::Daemon
        } else if named(SERVER_NAME) {
            Role::Server
        } else {
            continue;
        };
        candidates.push((*pid, role));
    }
    if candidates.is_empty() {
        return Found::default();
    }
    // Pass 2: environments of the candidates only.
    let pids: Vec<sysinfo::Pid> = candidates.iter().map(|(p, _)| *p).collect();
    sys.refresh_processes_specifics(
        ProcessesToUpdate::Some(&pids),
        true,
        ProcessRefreshKind::nothing()
            .without_tasks()
            .with_environ(UpdateKind::Always),
    );
    let want = normalize(pipe_dir);
    let mut found = Found::default();
    let mut daemon_pids = Vec::new();
    let mut servers = Vec::new();
    for (pid, role) in candidates {
        let Some(p) = sys.process(pid) else { continue };
        let ours = serves(p.environ(), &want);
        let proc = MpsProcess {
            pid: pid.as_u32(),
            parent: p.parent().map(|x| x.as_u32()),
            role,
            state: state_letter(pid.as_u32()).unwrap_or('?'),
            arg0: p
                .cmd()
                .first()
                .map(|a| a.to_string_lossy().into_owned())
                .unwrap_or_default(),
        };
        if proc.state == 'Z' || proc.state == 'X' {
            continue;
        }
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
    found
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

/// The `State:` letter of `/proc/<pid>/status`; `None` when the process is gone.
pub fn state_letter(pid: u32) -> Option<char> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("State:"))
        .and_then(|s| s.trim_start().chars().next())
}

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
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
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
    let locks = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    Some(parse_lock_holder(&locks, &id))
}

fn parse_lock_holder(locks: &str, id: &str) -> Option<u32> {
    for line in locks.lines() {
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
        assert_eq!(parse_lock_holder(locks, "00:2f:1234"), Some(6424));
        assert_eq!(parse_lock_holder(locks, "08:01:55"), Some(99));
        assert_eq!(parse_lock_holder(locks, "00:2f:9"), None);
        assert_eq!(parse_lock_holder("garbage\n\n", "00:2f:9"), None);
    }

    #[test]
    fn our_own_process_is_alive_and_unknown_pids_are_not() {
        assert!(is_alive(std::process::id()));
        assert!(!is_alive(u32::MAX - 1));
        assert_eq!(state_letter(u32::MAX - 1), None);
    }
}
