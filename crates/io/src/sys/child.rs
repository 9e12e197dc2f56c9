//! Process hygiene for every program gpu-medic runs (the MPS control client, `control_binary
//! -d`, `systemctl`): each starts in a process group of its own, dies with gpu-medic, and on a
//! timeout (or when the future waiting for it is dropped, as at shutdown) its whole group is
//! SIGKILLed and reaped. A child that ignores SIGTERM, or a wrapper script that forked helpers
//! of its own, therefore leaves nothing behind. [`executable`] finds a program the way the
//! kernel and the shell would (a bare name through `PATH`).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use tokio::io::AsyncReadExt;

/// At most this much of a child's stdout and of its stderr is kept.
pub const MAX_OUTPUT: u64 = 64 * 1024;
/// How long a killed child gets to be reaped.
const REAP_GRACE: Duration = Duration::from_secs(2);

/// Puts the child in a process group of its own, kills it if the `Child` is dropped, and has
/// the kernel SIGKILL it if gpu-medic dies.
pub fn contain(cmd: &mut tokio::process::Command) {
    cmd.process_group(0).kill_on_drop(true);
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl,
    // which is async-signal-safe and touches no memory shared with the parent. The kernel
    // then kills the child when the thread that spawned it exits: children are spawned from
    // runtime worker threads, which live as long as gpu-medic.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Finds `p` like the kernel and the shell would (a bare name through `PATH`) and checks it is
/// an executable file.
pub fn executable(p: &Path) -> Result<PathBuf, String> {
    let candidates: Vec<PathBuf> = if p.components().count() > 1 || p.is_absolute() {
        vec![p.to_path_buf()]
    } else {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path).map(|d| d.join(p)).collect()
    };
    let mut last = "not found in PATH".to_string();
    for c in candidates {
        match std::fs::metadata(&c) {
            Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => return Ok(c),
            Ok(m) if m.is_file() => last = format!("{} is not executable", c.display()),
            Ok(_) => last = format!("{} is not a file", c.display()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if p.is_absolute() || p.components().count() > 1 {
                    last = "does not exist".into();
                }
            }
            Err(e) => last = format!("{}: {e}", c.display()),
        }
    }
    Err(last)
}

/// Why [`output_within`] has no output.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The program could not be started (missing, not executable).
    #[error("{0}")]
    Spawn(std::io::Error),
    /// It did not exit in time; its whole process group was killed.
    #[error("did not exit within {0:?} (its process group was killed)")]
    Timeout(Duration),
    /// Waiting for it failed.
    #[error("{0}")]
    Wait(std::io::Error),
}

/// What happens to the child's process group once the child exited by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterExit {
    /// Kill what is left in it (helpers a script forked).
    KillGroup,
    /// Leave it: the child started a daemon on purpose (`control_binary -d`).
    KeepGroup,
}

/// Runs `cmd` (made [`contain`]ed here, stdin from /dev/null, output captured and capped)
/// and waits at most `timeout` for it. On a timeout the whole group is killed either way.
pub async fn output_within(
    cmd: &mut tokio::process::Command,
    timeout: Duration,
    after: AfterExit,
) -> Result<Output, RunError> {
    contain(cmd);
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().map_err(RunError::Spawn)?;
    let mut group = GroupKill::new(child.id());
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let talk = async {
        let (out, err, status) =
            tokio::join!(read_capped(stdout), read_capped(stderr), child.wait());
        (out, err, status)
    };
    match tokio::time::timeout(timeout, talk).await {
        Ok((stdout, stderr, status)) => {
            let status = status.map_err(RunError::Wait)?;
            match after {
                AfterExit::KillGroup => group.kill(),
                AfterExit::KeepGroup => group.disarm(),
            }
            Ok(Output {
                status,
                stdout,
                stderr,
            })
        }
        Err(_) => {
            group.kill_tree();
            let _ = tokio::time::timeout(REAP_GRACE, child.wait()).await;
            Err(RunError::Timeout(timeout))
        }
    }
}

/// [`output_within`] for code that runs before the runtime or outside it (the start
/// checks): `cmd` in a process group of its own, stdin from /dev/null, stderr dropped, at
/// most [`MAX_OUTPUT`] of stdout kept, and its whole group killed when it does not exit
/// within `timeout` or once it has.
pub fn stdout_within_blocking(
    cmd: &mut std::process::Command,
    timeout: Duration,
) -> Result<(std::process::ExitStatus, Vec<u8>), RunError> {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(RunError::Spawn)?;
    let mut group = GroupKill::new(Some(child.id()));
    let stdout = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(out) = stdout {
            let _ = out.take(MAX_OUTPUT).read_to_end(&mut buf);
        }
        buf
    });
    let until = std::time::Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ok(s),
            Ok(None) if std::time::Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => break Err(RunError::Timeout(timeout)),
            Err(e) => break Err(RunError::Wait(e)),
        }
    };
    // The group is killed either way: what the child left behind holds the pipe open. Not
    // reaped yet, a child past its deadline is killed with every descendant.
    if status.is_err() {
        group.kill_tree();
    }
    group.kill();
    let _ = child.wait();
    let out = reader.join().unwrap_or_default();
    status.map(|s| (s, out))
}

async fn read_capped<R: tokio::io::AsyncRead + Unpin>(r: Option<R>) -> Vec<u8> {
    let mut buf = Vec::new();
    if let Some(r) = r {
        let _ = r.take(MAX_OUTPUT).read_to_end(&mut buf).await;
    }
    buf
}

/// SIGKILLs a child's process group when told to or when dropped, unless disarmed.
pub struct GroupKill(Option<i32>);

impl GroupKill {
    /// The group of a child started by [`contain`] (its pid is the group id).
    pub fn new(pid: Option<u32>) -> Self {
        GroupKill(pid.and_then(|p| i32::try_from(p).ok()).filter(|p| *p > 1))
    }

    pub fn kill(&mut self) {
        if let Some(pgid) = self.0.take() {
            // SAFETY: kill(2) has no memory-safety preconditions. `-pgid` names the group the
            // child was started in (process_group(0) makes its pid the group id). Until the
            // child is reaped its pid, and so the group id, cannot be reused; after, the group
            // may still hold its helpers, and a reused id would need a new process to have
            // made itself leader of a group with that exact number.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
    }

    /// [`kill`](Self::kill), and before it every descendant of the child, found by walking
    /// `/proc` parent links from it, in whatever group or session it put itself (a helper
    /// that called `setsid` left the group). Only while the child is not reaped: its pid
    /// then still names it, and its descendants' parent links lead to it. Each is stopped
    /// first (a stopped process forks nothing), the walk repeated until it finds no new one,
    /// then all are killed.
    pub fn kill_tree(&mut self) {
        let Some(root) = self.0 else {
            return;
        };
        let mut found: Vec<i32> = Vec::new();
        for _ in 0..MAX_TREE_PASSES {
            let now = descendants(root);
            let new: Vec<i32> = now.into_iter().filter(|p| !found.contains(p)).collect();
            if new.is_empty() {
                break;
            }
            for p in &new {
                // SAFETY: kill(2) has no memory-safety preconditions; `p` is a descendant of
                // the unreaped child, found an instant ago.
                unsafe {
                    libc::kill(*p, libc::SIGSTOP);
                }
            }
            found.extend(new);
        }
        self.kill();
        for p in found {
            // SAFETY: as above; stopped, the process cannot have exited since.
            unsafe {
                libc::kill(p, libc::SIGKILL);
            }
        }
    }

    /// Leaves the group alone (a daemon started on purpose lives in it).
    pub fn disarm(&mut self) {
        self.0 = None;
    }
}

/// Walks of `/proc` made by [`GroupKill::kill_tree`] at most.
const MAX_TREE_PASSES: usize = 5;
/// `/proc` entries looked at in one walk at most.
const MAX_PROC_SCAN: usize = 1 << 20;
/// Descendants found at most.
const MAX_DESCENDANTS: usize = 4096;

/// The parent pid in a `/proc/<pid>/stat` line (the field after the command name, which may
/// itself hold spaces and parentheses).
fn stat_ppid(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(1)?.parse().ok()
}

/// The descendants of `root` now, by their parent links in `/proc`.
fn descendants(root: i32) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut links: Vec<(i32, i32)> = Vec::new();
    for e in rd.filter_map(Result::ok).take(MAX_PROC_SCAN) {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(bytes) = crate::sys::limits::read_head(&e.path().join("stat"), 4096, "process stat")
        else {
            continue;
        };
        if let Some(ppid) = stat_ppid(&String::from_utf8_lossy(&bytes)) {
            links.push((pid, ppid));
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(parent) = frontier.pop() {
        for (pid, _) in links.iter().filter(|(_, pp)| *pp == parent) {
            if *pid != root && !out.contains(pid) && out.len() < MAX_DESCENDANTS {
                out.push(*pid);
                frontier.push(*pid);
            }
        }
    }
    out
}

impl Drop for GroupKill {
    fn drop(&mut self) {
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_names_its_parent_whatever_the_command() {
        assert_eq!(stat_ppid("42 (a) b (c)) S 7 42 42 0"), Some(7));
        assert_eq!(stat_ppid("42 (sleep) S 1 42 42 0"), Some(1));
        assert_eq!(stat_ppid("garbage"), None);
    }
}
