//! A systemd unit, as `systemctl show` reports it: what systemd itself does about a service
//! gpu-medic watches, so that gpu-medic neither races systemd's own restart nor misses a crash
//! loop that systemd hides by restarting the service every second. Used for the MPS daemon
//! (`nvidia-mps.service`, `Restart=always`, `RestartSec=1` on the ECS GPU AMI; docs/mps.md,
//! `crate::mps::systemd`) and Fabric Manager (`nvidia-fabricmanager.service`, docs/fabric.md).
//! [`RestartWindow`] counts systemd's own restarts (`NRestarts` rising) within a window.
//!
//! `systemctl show --property=...` prints `Name=value` lines and is documented as the
//! machine-readable way to read a unit's properties [systemctl(1)]; it needs no D-Bus client
//! library in gpu-medic. Every call has a deadline and runs in its own process group.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::sys::child::{self, AfterExit, RunError};

fn clip(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let mut out: String = s.chars().take(max).collect();
    out.push('…');
    out
}

/// systemd's own restarts of a unit (`NRestarts` rising between looks) within a window.
#[derive(Debug, Clone)]
pub struct RestartWindow {
    window: Duration,
    last: Option<u64>,
    seen: std::collections::VecDeque<std::time::Instant>,
}

impl RestartWindow {
    pub fn new(window: Duration) -> Self {
        RestartWindow {
            window,
            last: None,
            seen: Default::default(),
        }
    }

    /// Takes a look's `NRestarts`; returns the restarts within the window, this look's
    /// included. The first look only sets the base (restarts before gpu-medic started are
    /// not counted); a count that goes down (the unit was reset) starts over.
    pub fn observe(&mut self, n_restarts: u64, now: std::time::Instant) -> usize {
        let window = self.window;
        self.seen.retain(|t| now.duration_since(*t) < window);
        if let Some(before) = self.last.replace(n_restarts)
            && n_restarts > before
        {
            // At most one window's worth is remembered, however far the counter jumped.
            for _ in 0..(n_restarts - before).min(1024) {
                self.seen.push_back(now);
            }
        }
        self.seen.len()
    }

    /// Forgets the restarts counted so far (after they were reported).
    pub fn clear(&mut self) {
        self.seen.clear();
    }
}

/// What `systemctl show` says about a unit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UnitState {
    /// `loaded`, `not-found`, `masked`, ...
    pub load_state: String,
    /// `active`, `activating`, `deactivating`, `inactive`, `failed`.
    pub active_state: String,
    /// `running`, `auto-restart`, `exited`, `dead`, `failed`, ...
    pub sub_state: String,
    /// 0 when no process runs.
    pub main_pid: u32,
    /// Restarts systemd made by itself (`Restart=`) since the unit was last started by hand.
    pub n_restarts: u64,
    /// The exit status of the last main process.
    pub exec_main_status: i64,
    /// `Result=`: `success`, `exit-code`, `signal`, `start-limit-hit`, ...
    pub result: String,
    /// `Environment=` of the unit, as one line (`A=b C=d`).
    pub environment: String,
}

/// systemd's words for a unit's load state: `systemctl --state=help` lists them, from
/// systemd's own table (`unit_load_state_table`, src/basic/unit-def.c).
pub const LOAD_STATES: &[&str] = &[
    "stub",
    "loaded",
    "not-found",
    "bad-setting",
    "error",
    "merged",
    "masked",
];

/// systemd's words for a unit's active state (`systemctl --state=help`;
/// `unit_active_state_table`, src/basic/unit-def.c; systemctl(1), `is-active`).
pub const ACTIVE_STATES: &[&str] = &[
    "active",
    "reloading",
    "inactive",
    "failed",
    "activating",
    "deactivating",
    "maintenance",
    "refreshing",
];

/// What a unit's state says of its service, in systemd's own words only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Activity {
    /// `active` (or reloading, refreshing) with a main process.
    Running,
    /// Stopped, by systemd's words: `inactive` or `failed`, or a unit that cannot run
    /// (`not-found`, `masked`, `bad-setting`, `error`); the words, for the journal.
    Stopped(String),
    /// systemd is starting or stopping it (`activating`, `deactivating`, `maintenance`,
    /// loading `stub`/`merged`): neither, for now. A start that hangs ends `failed` at the
    /// unit's start timeout, and restarts are counted apart (`NRestarts`).
    Changing(String),
    /// Not systemd's words (a state no systemd prints), or words that contradict each other
    /// (`active` with no main process): gpu-medic could not tell. What it read, for the
    /// self-fault.
    Unknown(String),
}

/// `systemctl show` output this long or longer is not an answer (it prints a few lines).
pub const MAX_SHOW: usize = 16 * 1024;

/// The properties read.
pub const PROPERTIES: &str =
    "LoadState,ActiveState,SubState,MainPID,NRestarts,ExecMainStatus,Result,Environment";

impl UnitState {
    /// Parses `systemctl show` output; unknown lines are ignored, a missing number is 0.
    pub fn parse(text: &str) -> UnitState {
        let mut s = UnitState::default();
        for line in text.lines() {
            let Some((k, v)) = line.split_once('=') else {
                continue;
            };
            let v = v.trim();
            match k.trim() {
                "LoadState" => s.load_state = v.to_string(),
                "ActiveState" => s.active_state = v.to_string(),
                "SubState" => s.sub_state = v.to_string(),
                "MainPID" => s.main_pid = v.parse().unwrap_or(0),
                "NRestarts" => s.n_restarts = v.parse().unwrap_or(0),
                "ExecMainStatus" => s.exec_main_status = v.parse().unwrap_or(0),
                "Result" => s.result = v.to_string(),
                "Environment" => s.environment = v.to_string(),
                _ => {}
            }
        }
        s
    }

    /// Parses `systemctl show` output that must be a readable answer: text (UTF-8), within
    /// [`MAX_SHOW`], naming `LoadState` and `ActiveState`, every number present a number.
    /// Anything else is no answer (`Err` says why): unreadable is not down.
    pub fn parse_answer(bytes: &[u8]) -> Result<UnitState, String> {
        if bytes.len() >= MAX_SHOW {
            return Err(format!(
                "the output is {} bytes or more, not the few lines `systemctl show` prints",
                MAX_SHOW
            ));
        }
        let text =
            std::str::from_utf8(bytes).map_err(|e| format!("the output is not text ({e})"))?;
        let mut seen = (false, false);
        for line in text.lines() {
            let Some((k, v)) = line.split_once('=') else {
                continue;
            };
            let (k, v) = (k.trim(), v.trim());
            match k {
                "LoadState" => seen.0 = true,
                "ActiveState" => seen.1 = true,
                "MainPID" | "NRestarts" | "ExecMainStatus"
                    if !v.is_empty() && v.parse::<i128>().is_err() =>
                {
                    return Err(format!("{k}={} is not a number", clip(v, 40)));
                }
                _ => {}
            }
        }
        if seen != (true, true) {
            return Err(format!(
                "the output names no LoadState or ActiveState; it begins {:?}",
                clip(text.trim(), 80)
            ));
        }
        Ok(UnitState::parse(text))
    }

    /// Whether systemd knows the unit.
    pub fn exists(&self) -> bool {
        !self.load_state.is_empty() && self.load_state != "not-found"
    }

    /// Whether systemd is bringing the daemon back by itself right now (`Restart=` pending,
    /// or a start in progress): a restart by gpu-medic would race it.
    pub fn restarting(&self) -> bool {
        self.sub_state == "auto-restart"
            || self.active_state == "activating"
            || self.sub_state == "start"
    }

    /// The unit's service as systemd's words say it ([`Activity`]): anything but those words
    /// is [`Activity::Unknown`], never stopped.
    pub fn activity(&self, unit: &str) -> Activity {
        let (load, active) = (self.load_state.as_str(), self.active_state.as_str());
        if !LOAD_STATES.contains(&load) || !ACTIVE_STATES.contains(&active) {
            return Activity::Unknown(format!(
                "{unit}: LoadState={} ActiveState={} are not systemd's words",
                clip(load, 40),
                clip(active, 40)
            ));
        }
        match (load, active) {
            ("not-found", _) => {
                Activity::Stopped(format!("{unit} is not installed (LoadState={load})"))
            }
            ("masked" | "bad-setting" | "error", _) => {
                Activity::Stopped(format!("{unit} cannot run (LoadState={load})"))
            }
            ("stub" | "merged", _) => {
                Activity::Changing(format!("{unit} is being loaded (LoadState={load})"))
            }
            (_, "inactive" | "failed") => Activity::Stopped(self.describe(unit)),
            (_, "active" | "reloading" | "refreshing") if self.main_pid != 0 => Activity::Running,
            (_, "active" | "reloading" | "refreshing") => Activity::Unknown(format!(
                "{} (ActiveState={active} with no main process)",
                self.describe(unit)
            )),
            _ => Activity::Changing(self.describe(unit)),
        }
    }

    /// Whether the unit runs a main process.
    pub fn running(&self) -> bool {
        self.active_state == "active" && self.main_pid != 0
    }

    /// The value of `var` in the unit's `Environment=`.
    pub fn env(&self, var: &str) -> Option<&str> {
        self.environment
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(var)?.strip_prefix('='))
    }

    /// One line for a journal detail.
    pub fn describe(&self, unit: &str) -> String {
        format!(
            "{unit}: {}/{} (main pid {}, NRestarts {}, last exit status {}, result {})",
            clip(&self.active_state, 40),
            clip(&self.sub_state, 40),
            self.main_pid,
            self.n_restarts,
            self.exec_main_status,
            clip(&self.result, 40)
        )
    }
}

/// Why `systemctl` gave no state.
#[derive(Debug, thiserror::Error)]
pub enum SystemctlError {
    /// Not installed or not executable: a configuration fault, not the daemon's.
    #[error("cannot run {binary}: {message}")]
    Spawn { binary: String, message: String },
    #[error("{binary} {args} did not finish within {timeout:?}")]
    Timeout {
        binary: String,
        args: String,
        timeout: Duration,
    },
    /// It ran, but what it printed is not a readable answer (not text, far too long, not
    /// `systemctl show`'s lines): a fault of gpu-medic's view, never the unit's state.
    #[error("{binary} {args}: unreadable answer: {why}")]
    Unreadable {
        binary: String,
        args: String,
        why: String,
    },
    #[error("{binary} {args} failed ({status}): {output}")]
    Failed {
        binary: String,
        args: String,
        status: String,
        output: String,
    },
}

impl SystemctlError {
    /// Whether trying again can help.
    pub fn retryable(&self) -> bool {
        !matches!(self, SystemctlError::Spawn { .. })
    }
}

/// `systemctl` for one unit.
#[derive(Debug, Clone)]
pub struct Systemctl {
    binary: PathBuf,
    unit: String,
    timeout: Duration,
}

impl Systemctl {
    pub fn new(binary: impl Into<PathBuf>, unit: &str, timeout: Duration) -> Self {
        Systemctl {
            binary: binary.into(),
            unit: unit.to_string(),
            timeout,
        }
    }

    pub fn unit(&self) -> &str {
        &self.unit
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The unit's state now. Output that is not a readable answer is
    /// [`SystemctlError::Unreadable`], never a state.
    pub async fn show(&self) -> Result<UnitState, SystemctlError> {
        let args = ["show", &format!("--property={PROPERTIES}"), &self.unit];
        let out = self.call_bytes(&args).await?;
        UnitState::parse_answer(&out).map_err(|why| SystemctlError::Unreadable {
            binary: self.binary.display().to_string(),
            args: args.join(" "),
            why,
        })
    }

    /// Runs `systemctl <args...>` (the unit appended by the caller) and returns its stdout as
    /// it came (at most [`child::MAX_OUTPUT`] bytes). The call is contained like every child
    /// (`crate::sys::child`): on a timeout its whole process group is killed, so a hung
    /// systemctl leaves nothing behind.
    async fn call_bytes(&self, args: &[&str]) -> Result<Vec<u8>, SystemctlError> {
        let mut cmd = tokio::process::Command::new(&self.binary);
        cmd.args(args).env("SYSTEMD_PAGER", "");
        let joined = args.join(" ");
        let binary = self.binary.display().to_string();
        let out = match child::output_within(&mut cmd, self.timeout, AfterExit::KillGroup).await {
            Ok(o) => o,
            Err(RunError::Spawn(e)) => {
                return Err(SystemctlError::Spawn {
                    binary,
                    message: e.to_string(),
                });
            }
            Err(RunError::Timeout(_)) => {
                return Err(SystemctlError::Timeout {
                    binary,
                    args: joined,
                    timeout: self.timeout,
                });
            }
            Err(RunError::Wait(e)) => {
                return Err(SystemctlError::Failed {
                    binary,
                    args: joined,
                    status: "wait failed".into(),
                    output: e.to_string(),
                });
            }
        };
        if !out.status.success() {
            let stdout = String::from_utf8_lossy(&out.stdout);
            let err = String::from_utf8_lossy(&out.stderr);
            return Err(SystemctlError::Failed {
                binary,
                args: joined,
                status: out.status.to_string(),
                output: clip(format!("{} {}", stdout.trim(), err.trim()).trim(), 300),
            });
        }
        Ok(out.stdout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_are_counted_within_the_window_from_the_first_look() {
        let t0 = std::time::Instant::now();
        let s = Duration::from_secs;
        let mut w = RestartWindow::new(s(600));
        assert_eq!(
            w.observe(40, t0),
            0,
            "restarts before the first look do not count"
        );
        assert_eq!(w.observe(41, t0 + s(10)), 1);
        assert_eq!(w.observe(43, t0 + s(20)), 3);
        assert_eq!(w.observe(43, t0 + s(700)), 0, "out of the window");
        assert_eq!(w.observe(0, t0 + s(710)), 0, "reset");
        assert_eq!(w.observe(1, t0 + s(720)), 1);
    }

    #[test]
    fn show_output_parses_and_tells_a_pending_restart() {
        let s = UnitState::parse(
            "LoadState=loaded\nActiveState=activating\nSubState=auto-restart\nMainPID=0\nNRestarts=7\nExecMainStatus=1\nResult=exit-code\nEnvironment=CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs X=y\ngarbage\n",
        );
        assert!(s.exists() && s.restarting() && !s.running());
        assert_eq!((s.n_restarts, s.exec_main_status), (7, 1));
        assert_eq!(s.env("CUDA_MPS_PIPE_DIRECTORY"), Some("/run/mps-ecs"));
        assert_eq!(s.env("CUDA_MPS"), None);
        let s = UnitState::parse(
            "LoadState=not-found\nActiveState=inactive\nSubState=dead\nMainPID=0\nNRestarts=0\n",
        );
        assert!(!s.exists() && !s.restarting());
        let s = UnitState::parse(
            "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=42\nNRestarts=x\n",
        );
        assert!(s.running() && !s.restarting());
        assert_eq!(s.n_restarts, 0);
        assert_eq!(UnitState::parse(""), UnitState::default());
    }

    /// Only systemd's words: active with a main process runs; inactive, failed or a unit that
    /// cannot load is stopped; starting or stopping is neither; anything else (a word systemd
    /// has not, active without a process) could not be told, never stopped.
    #[test]
    fn only_systemds_words_say_running_or_stopped() {
        let a = |t: &str| UnitState::parse(t).activity("fm");
        assert_eq!(
            a("LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=9\n"),
            Activity::Running
        );
        for stopped in [
            "LoadState=loaded\nActiveState=inactive\nSubState=dead\nMainPID=0\n",
            "LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\n",
            "LoadState=not-found\nActiveState=inactive\n",
            "LoadState=masked\nActiveState=inactive\n",
        ] {
            assert!(matches!(a(stopped), Activity::Stopped(_)), "{stopped}");
        }
        for changing in [
            "LoadState=loaded\nActiveState=activating\nSubState=auto-restart\nMainPID=0\n",
            "LoadState=loaded\nActiveState=deactivating\nSubState=stop-sigterm\nMainPID=9\n",
        ] {
            assert!(matches!(a(changing), Activity::Changing(_)), "{changing}");
        }
        for unknown in [
            "LoadState=loaded\nActiveState=banana\nMainPID=0\n",
            "LoadState=kaputt\nActiveState=inactive\n",
            "LoadState=loaded\nActiveState=Inactive\n",
            "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=0\n",
        ] {
            assert!(matches!(a(unknown), Activity::Unknown(_)), "{unknown}");
        }
    }

    /// Unreadable is not down: bytes that are not text, an answer far too long, one with no
    /// LoadState/ActiveState (empty), a number that is not one: each is no answer at all.
    #[test]
    fn an_unreadable_show_is_no_answer() {
        let ok = b"LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=42\n";
        assert!(UnitState::parse_answer(ok).unwrap().running());
        let mut bad = ok.to_vec();
        bad.extend_from_slice(&[0xff, 0xfe, b'\n']);
        assert!(
            UnitState::parse_answer(&bad)
                .unwrap_err()
                .contains("not text")
        );
        let long = format!(
            "{}{}",
            "LoadState=loaded\nActiveState=active\n",
            "x".repeat(MAX_SHOW)
        );
        assert!(UnitState::parse_answer(long.as_bytes()).is_err());
        assert!(UnitState::parse_answer(b"").is_err());
        assert!(UnitState::parse_answer(b"garbage\n").is_err());
        assert!(
            UnitState::parse_answer(b"LoadState=loaded\nActiveState=active\nMainPID=x1\n")
                .unwrap_err()
                .contains("MainPID")
        );
        let gone = UnitState::parse_answer(b"LoadState=not-found\nActiveState=inactive\n").unwrap();
        assert!(
            !gone.exists(),
            "a unit systemd does not know is still an answer"
        );
    }
}
