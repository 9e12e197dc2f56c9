//! The control client: `control_binary` run in client mode, one session per call, with a
//! deadline. Shared by the probe and the remedy.
//!
//! Why it looks like this (measured on the real r535 daemon, tests/support/MPS-FACTS.md):
//! - A hung (stopped, wedged) daemon accepts the connection and never answers, so every call
//!   has a deadline; on expiry the client's whole process group is killed (a wrapper script
//!   as `control_binary` must not leave its real client behind) and reaped.
//! - The daemon serves one UI session at a time; a second client gets an error, or exit 0
//!   with empty output. All calls for one pipe directory therefore go through one async
//!   mutex, owned by the client: `gpu-medic run` builds one client and hands clones of it to
//!   the probe and the remedy (clones share the lock). Callers must parse replies: exit 0
//!   proves nothing.
//! - The client block-buffers stdout on a pipe, so replies are read after it exits.
//! - "Cannot find MPS control daemon process" (stderr, exit 1) means no daemon listens on
//!   the pipe directory (none started, or stale sockets after a crash).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Mutex, OwnedMutexGuard};

use crate::config::MpsConfig;

/// The daemon's reply when nothing listens on the pipe directory.
pub const NOT_FOUND: &str = "Cannot find MPS control daemon process";
/// At most this much of a reply is kept (a garbage-spewing client cannot exhaust memory).
const MAX_REPLY: u64 = 64 * 1024;
/// How long a killed client gets to be reaped.
const REAP_GRACE: Duration = Duration::from_secs(2);

/// Proof that the caller holds the control lock of a pipe directory.
pub type ControlGuard = OwnedMutexGuard<()>;

/// What the client printed, and how long it took.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

/// Why a control call did not produce a reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ControlError {
    /// The client could not be started at all (missing binary, no permission).
    #[error("cannot run {binary}: {message}")]
    Spawn {
        binary: String,
        message: String,
        /// The binary does not exist or is not executable: a configuration problem.
        missing: bool,
    },
    /// No reply before the deadline; the client was killed.
    #[error("no reply within {0:?} (control client killed)")]
    Timeout(Duration),
    /// No daemon listens on the pipe directory.
    #[error("{NOT_FOUND}")]
    NotFound,
    /// The client exited non-zero for another reason (e.g. the daemon was busy).
    #[error("control client {status}: {output}")]
    Failed { status: String, output: String },
    /// Waiting for or talking to the client failed locally.
    #[error("control client I/O: {0}")]
    Io(String),
}

/// What the probe and the remedy of one pipe directory share: the control lock, so the two
/// never talk to the daemon at once. Nothing else: a restart gpu-medic made reaches the
/// probe's judge as the order's outcome, through the engine.
#[derive(Debug, Default)]
struct Shared {
    lock: Arc<Mutex<()>>,
}

/// `/run/mps-ecs/` and `/run/mps-ecs` name the same directory.
pub fn normalize(p: &Path) -> PathBuf {
    p.components().collect()
}

/// Talks to the control daemon of one pipe directory.
#[derive(Debug, Clone)]
pub struct ControlClient {
    binary: PathBuf,
    pipe_dir: PathBuf,
    log_dir: PathBuf,
    shared: Arc<Shared>,
}

impl ControlClient {
    /// A client for `cfg`'s pipe directory with a lock of its own. Clones share the lock: hand
    /// clones to everything that talks to this daemon.
    pub fn new(cfg: &MpsConfig) -> Self {
        ControlClient {
            binary: cfg.control_binary.clone(),
            pipe_dir: cfg.pipe_directory.clone(),
            log_dir: cfg.log_directory.clone(),
            shared: Arc::new(Shared::default()),
        }
    }

    /// The environment the daemon and its clients need.
    pub fn env(&self) -> [(&'static str, &Path); 2] {
        [
            ("CUDA_MPS_PIPE_DIRECTORY", self.pipe_dir.as_path()),
            ("CUDA_MPS_LOG_DIRECTORY", self.log_dir.as_path()),
        ]
    }

    /// Waits for the control lock.
    pub async fn lock(&self) -> ControlGuard {
        self.shared.lock.clone().lock_owned().await
    }

    /// Waits at most `wait` for the control lock.
    pub async fn lock_within(&self, wait: Duration) -> Option<ControlGuard> {
        tokio::time::timeout(wait, self.lock()).await.ok()
    }

    /// Whether someone (a restart) holds the control lock right now.
    pub fn is_busy(&self) -> bool {
        self.shared.lock.try_lock().is_err()
    }

    /// Sends `commands` (one per line) in one session and returns the reply, or kills the
    /// client after `timeout`. The caller holds the lock (`guard`).
    pub async fn send(
        &self,
        guard: &ControlGuard,
        commands: &[&str],
        timeout: Duration,
    ) -> Result<Reply, ControlError> {
        debug_assert!(
            Arc::ptr_eq(OwnedMutexGuard::mutex(guard), &self.shared.lock),
            "control guard of another pipe directory"
        );
        let started = Instant::now();
        let mut cmd = tokio::process::Command::new(&self.binary);
        for (k, v) in self.env() {
            cmd.env(k, v);
        }
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Own process group, killed with gpu-medic, whole group SIGKILLed on a timeout.
        crate::sys::child::contain(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| ControlError::Spawn {
            binary: self.binary.display().to_string(),
            message: e.to_string(),
            missing: matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
            ),
        })?;
        // Kills the client's whole group if this future is dropped or times out.
        let mut group = crate::sys::child::GroupKill::new(child.id());
        let mut input = commands.join("\n");
        input.push('\n');
        let stdin = child.stdin.take();
        let stdout = child.stdout.take();
        let stderr = child.stderr.take();
        let talk = async {
            if let Some(mut s) = stdin {
                // A client that exits without reading (daemon missing) closes the pipe: fine.
                let _ = s.write_all(input.as_bytes()).await;
                drop(s);
            }
            let (out, err, status) =
                tokio::join!(read_capped(stdout), read_capped(stderr), child.wait());
            (out, err, status)
        };
        let (out, err, status) = match tokio::time::timeout(timeout, talk).await {
            Ok(r) => r,
            Err(_) => {
                group.kill();
                let _ = tokio::time::timeout(REAP_GRACE, child.wait()).await;
                return Err(ControlError::Timeout(timeout));
            }
        };
        let status = status.map_err(|e| ControlError::Io(e.to_string()))?;
        // The client is done: anything a wrapper script left in its group goes with it.
        group.kill();
        let reply = Reply {
            stdout: out,
            stderr: err,
            elapsed: started.elapsed(),
        };
        if status.success() {
            return Ok(reply);
        }
        if reply.stdout.contains(NOT_FOUND) || reply.stderr.contains(NOT_FOUND) {
            return Err(ControlError::NotFound);
        }
        let output = format!("{} {}", reply.stdout.trim(), reply.stderr.trim());
        Err(ControlError::Failed {
            status: status.to_string(),
            output: clip(output.trim(), 300),
        })
    }

    /// [`send`](Self::send) under the lock.
    pub async fn send_locked(
        &self,
        commands: &[&str],
        timeout: Duration,
    ) -> Result<Reply, ControlError> {
        let guard = self.lock().await;
        self.send(&guard, commands, timeout).await
    }
}

async fn read_capped<R: tokio::io::AsyncRead + Unpin>(r: Option<R>) -> String {
    let Some(r) = r else {
        return String::new();
    };
    let mut buf = Vec::new();
    let _ = r.take(MAX_REPLY).read_to_end(&mut buf).await;
    String::from_utf8_lossy(&buf).into_owned()
}

/// Shortens `s` to at most `max` characters for a journal line.
pub fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max).collect();
    out.push('…');
    out
}
