//! The diagnose order's hands: `gpu-medic diagnose` run as a child of the daemon
//! (docs/diagnose.md). The tools it drives load the GPU driver, allocate GPU memory and can
//! hang or crash with the driver; in a child process with a deadline none of that can take
//! the supervisor down. The child writes its whole diagnosis (each tool's raw output kept) to
//! `state_dir/diagnoses/<incident>-<action>.json`; the order's outcome carries it without the
//! raw output, and the file stays for the evidence bundle and for people (the newest
//! [`KEEP`] are kept).
//!
//! Where gpu-medic manages MPS, a diagnosis runs only on a drained node (after the drain, or
//! in the check after a reboot), so the child gets `--stop-mps`: it stops the MPS daemon for
//! DCGM's run and starts it again (docs/diagnose.md, "DCGM and MPS"). Meanwhile this remedy
//! holds the MPS control lock it shares with the MPS probe and the restart remedy: the probe
//! gives no verdict on a daemon stopped on purpose, and no restart races the diagnosis.

use std::path::PathBuf;
use std::time::Duration;

use super::{BoxFuture, RemedyError};
use crate::model::Order;
use crate::model::diagnosis::{Diagnosis, Level};

/// The diagnoses kept in `state_dir/diagnoses`.
pub const KEEP: usize = 32;
/// The largest diagnosis file read back (the raw output is capped per tier).
const MAX_FILE: u64 = 4 * 1024 * 1024;

/// Tests the GPUs of this node.
pub trait DiagnoseRemedy: Send + Sync + 'static {
    /// The level the daemon diagnoses at (`[diagnose] level`).
    fn level(&self) -> Level;
    fn diagnose(
        &self,
        order: &Order,
        level: Level,
    ) -> BoxFuture<'_, Result<Diagnosis, RemedyError>>;
}

/// `gpu-medic diagnose --config CONFIG --level L --json --out FILE` as a child.
pub struct DiagnoseCommand {
    pub exe: PathBuf,
    pub config: PathBuf,
    pub level: Level,
    pub dir: PathBuf,
    /// The child's deadline: both tiers' `[diagnose] timeout` and a margin.
    pub timeout: Duration,
    /// The MPS control client shared with the probe and the restart remedy, when gpu-medic
    /// manages MPS: its lock is held while the child runs, which is then given `--stop-mps`.
    pub mps: Option<crate::mps::control::ControlClient>,
}

impl DiagnoseCommand {
    pub fn from_config(cfg: &crate::config::Config, config_file: &std::path::Path) -> Self {
        DiagnoseCommand {
            exe: std::env::current_exe().unwrap_or_else(|_| PathBuf::from("gpu-medic")),
            config: config_file.to_path_buf(),
            level: cfg.diagnose.level,
            dir: cfg.files().diagnoses(),
            timeout: cfg
                .diagnose
                .timeout
                .saturating_mul(2)
                .saturating_add(Duration::from_secs(60)),
            mps: None,
        }
    }

    /// Diagnoses with the MPS daemon stopped for DCGM's run, holding `client`'s lock (the one
    /// the MPS probe and the restart remedy share).
    pub fn with_mps(mut self, client: crate::mps::control::ControlClient) -> Self {
        self.mps = Some(client);
        self
    }

    fn file_for(&self, order: &Order) -> PathBuf {
        self.dir
            .join(format!("{}-{}.json", order.incident.0, order.id.0))
    }

    /// Keeps the newest [`KEEP`] diagnosis files.
    fn prune(&self) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut files: Vec<(std::time::SystemTime, PathBuf)> = rd
            .flatten()
            .take(4 * KEEP)
            .filter_map(|e| {
                let m = e.metadata().ok()?;
                m.is_file()
                    .then(|| (m.modified().unwrap_or(std::time::UNIX_EPOCH), e.path()))
            })
            .collect();
        files.sort();
        let excess = files.len().saturating_sub(KEEP);
        for (_, p) in files.into_iter().take(excess) {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl DiagnoseRemedy for DiagnoseCommand {
    fn level(&self) -> Level {
        self.level
    }

    fn diagnose(
        &self,
        order: &Order,
        level: Level,
    ) -> BoxFuture<'_, Result<Diagnosis, RemedyError>> {
        let file = self.file_for(order);
        Box::pin(async move {
            if let Err(e) = std::fs::create_dir_all(&self.dir) {
                return Err(RemedyError::fatal(format!(
                    "cannot create {}: {e}",
                    self.dir.display()
                )));
            }
            let _ = std::fs::remove_file(&file);
            // Held until the child has exited: the daemon is stopped and started on purpose.
            let _mps_lock = match &self.mps {
                Some(client) => Some(client.lock().await),
                None => None,
            };
            let mut cmd = tokio::process::Command::new(&self.exe);
            cmd.arg("diagnose")
                .arg("--config")
                .arg(&self.config)
                .arg("--level")
                .arg(level.as_str())
                .arg("--json")
                .arg("--out")
                .arg(&file);
            if self.mps.is_some() {
                cmd.arg("--stop-mps");
            }
            let run = crate::sys::child::output_within(
                &mut cmd,
                self.timeout,
                crate::sys::child::AfterExit::KillGroup,
            )
            .await;
            let out = match run {
                Ok(o) => o,
                Err(crate::sys::child::RunError::Timeout(t)) => {
                    return Err(RemedyError::fatal(format!(
                        "gpu-medic diagnose did not exit within {} (its process group was killed)",
                        humantime::format_duration(t)
                    )));
                }
                Err(e) => {
                    return Err(RemedyError::fatal(format!(
                        "cannot run {} diagnose: {e}",
                        self.exe.display()
                    )));
                }
            };
            let text =
                crate::sys::limits::read_text(&file, MAX_FILE, "diagnosis").map_err(|e| {
                    let stderr = String::from_utf8_lossy(&out.stderr);
                    RemedyError::fatal(format!(
                        "gpu-medic diagnose ({}) left no diagnosis: {e}; {}",
                        out.status,
                        stderr.trim()
                    ))
                })?;
            self.prune();
            let d: Diagnosis = serde_json::from_str(&text).map_err(|e| {
                RemedyError::fatal(format!(
                    "the diagnosis in {} cannot be read: {e}",
                    file.display()
                ))
            })?;
            Ok(d)
        })
    }
}
