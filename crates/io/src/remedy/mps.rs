//! Restarts the MPS control daemon (`restart-mps`), under systemd or directly.
//!
//! The sequence, all of it under the control lock shared with the probe (the daemon serves
//! one client at a time, and a probe in the middle of a restart would only see noise):
//!
//! 1. stop: `quit` with `quit_timeout` (skipped for a SIGSTOPped daemon, which cannot
//!    answer), then SIGCONT + SIGTERM, then SIGKILL to a daemon that is still there, then
//!    the same for leftover `nvidia-cuda-mps-server` processes of the pipe directory;
//! 2. clean: remove stale `control`, `control_privileged`, `control_lock` and `log` from the
//!    pipe directory, only when no live process holds the `control_lock` lock (a crash
//!    leaves them all; `quit` leaves the sockets);
//! 3. start: `systemctl start <unit>` (`manage = "systemd"`, ECS's `nvidia-mps.service`),
//!    unless systemd's own `Restart=` already brought it back or is about to (`systemctl show`:
//!    `auto-restart`, `activating`, or running again): never a second restart. A unit that
//!    systemd is restarting when the order arrives is not stopped at all, only waited for;
//!    or `control_binary -d` with the pipe and log directories in its environment, after
//!    `mkdir -p` of both (the daemon does not create the pipe directory) and with every
//!    inherited descriptor marked close-on-exec (the daemon keeps what it inherits);
//! 4. wait until the daemon answers a probe, within `start_timeout`;
//! 5. re-apply `default_active_thread_percentage` and `default_pinned_device_mem_limit`,
//!    which every restart resets, and read them back;
//! 6. verify with a full probe.
//!
//! A failed attempt is retried once after a full-jitter delay (`sys::backoff`); more
//! would second-guess the engine, which owns the restart budget and the fallback when it
//! runs out. Errors say whether trying again can help: a missing binary, an unknown unit, a
//! pipe directory that cannot be created, a default the daemon rejects are `Fatal`; a daemon
//! that is slow to start or refuses to die is `Retryable`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::{BoxFuture, Done, MpsRemedy, RemedyError};
use crate::config::{MpsConfig, MpsManage};
use crate::model::{Order, Timestamp};
use crate::mps::control::{ControlClient, ControlError, ControlGuard, clip};
use crate::mps::procs::{self, Found, MpsProcess, Scanner};
use crate::mps::systemd::{Systemctl, UnitState};
use crate::mps::{PROBE_COMMAND, SERVER_LIST_COMMAND, parse_percentage, parse_reply};
use crate::sys::child::{self, AfterExit, RunError};
use crate::sys::clock::{SharedClock, SystemClock};

/// Attempts per order; the engine's budget decides about more.
const ATTEMPTS: usize = 2;
/// How long a daemon gets to exit after `quit` returned, and after SIGTERM.
const TERM_GRACE: Duration = Duration::from_secs(1);
/// How long the kernel gets to finish a SIGKILLed process.
const KILL_GRACE: Duration = Duration::from_secs(2);
/// What the daemon leaves in the pipe directory.
const PIPE_ENTRIES: [&str; 4] = ["control", "control_privileged", "control_lock", "log"];

/// The `MpsRemedy` for NVIDIA's real daemon.
pub struct MpsDaemon {
    cfg: MpsConfig,
    client: ControlClient,
    systemctl: PathBuf,
    attempts: usize,
    min_delay: Duration,
    /// The daemon's one clock: an order's deadline is read against it.
    clock: SharedClock,
}

impl MpsDaemon {
    /// A remedy with a control client of its own (nothing else talks to this daemon).
    pub fn new(cfg: MpsConfig) -> Self {
        let client = ControlClient::new(&cfg);
        MpsDaemon::with_client(cfg, client)
    }

    /// A remedy that shares `client` (and its lock) with the MPS probe.
    pub fn with_client(cfg: MpsConfig, client: ControlClient) -> Self {
        MpsDaemon {
            client,
            cfg,
            systemctl: PathBuf::from("systemctl"),
            attempts: ATTEMPTS,
            min_delay: Duration::from_millis(500),
            clock: SystemClock::shared(),
        }
    }

    /// Reads order deadlines against `clock` (the supervisor's).
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    /// Uses another `systemctl` (tests).
    pub fn with_systemctl(mut self, path: impl Into<PathBuf>) -> Self {
        self.systemctl = path.into();
        self
    }

    /// Attempts per restart (at least 1) and the first backoff delay.
    pub fn with_attempts(mut self, attempts: usize, min_delay: Duration) -> Self {
        self.attempts = attempts.max(1);
        self.min_delay = min_delay;
        self
    }

    pub fn client(&self) -> &ControlClient {
        &self.client
    }

    /// The whole restart, with its internal retry.
    pub async fn restart_now(&self) -> Result<Done, RemedyError> {
        let guard = self.client.lock().await;
        let mut tries = 0usize;
        let result = loop {
            tries += 1;
            match self.attempt(&guard).await {
                Err(e @ RemedyError::Retryable { .. }) if tries < self.attempts => {
                    // Full jitter over a window doubling from min_delay to 8x it.
                    let delay = crate::sys::backoff::full_jitter(
                        self.min_delay,
                        u32::try_from(tries - 1).unwrap_or(u32::MAX),
                        self.min_delay.saturating_mul(8),
                    );
                    tracing::warn!(
                        pipe_dir = %self.cfg.pipe_directory.display(),
                        "MPS restart attempt failed: {e}; retrying in {delay:?}"
                    );
                    tokio::time::sleep(delay).await;
                }
                other => break other,
            }
        };
        result.map_err(|e| {
            let message = format!(
                "MPS control daemon restart failed ({} mode, pipe directory {}, {} attempt(s)): {e}",
                self.mode(),
                self.cfg.pipe_directory.display(),
                tries
            );
            match e {
                RemedyError::Fatal { .. } => RemedyError::fatal(message),
                _ => RemedyError::retryable(message),
            }
        })
    }

    /// Stops the daemon and its servers for a diagnosis that needs the GPUs without an MPS
    /// server (DCGM's), under the control lock: under systemd `systemctl stop <unit>` (the
    /// ECS GPU AMI's `Restart=always` would start a daemon that merely exited again at once),
    /// then whatever the unit left, as a restart stops it; directly `quit`, then signals.
    /// Says what was done.
    pub async fn stop_for_diagnosis(&self) -> Result<String, RemedyError> {
        let guard = self.client.lock().await;
        let unit = match self.cfg.manage {
            MpsManage::Systemd => {
                let unit = self.cfg.unit.as_str();
                self.systemctl(&["stop", unit])
                    .await
                    .map_err(|(msg, fatal)| {
                        if fatal {
                            RemedyError::fatal(msg)
                        } else {
                            RemedyError::retryable(msg)
                        }
                    })?;
                format!("`systemctl stop {unit}`; ")
            }
            MpsManage::Direct => String::new(),
        };
        let (old, stopped) = self.stop(&guard).await?;
        Ok(format!("{unit}daemon {}: {stopped}", pids(&old)))
    }

    /// Starts the daemon again after such a diagnosis (`systemctl start <unit>`, or
    /// `control_binary -d`), waits until it answers and re-applies its defaults. Says what was
    /// done.
    pub async fn start_after_diagnosis(&self) -> Result<String, RemedyError> {
        let guard = self.client.lock().await;
        let cleaned = self.clean_stale().await?;
        let started = self.start().await?;
        let ready_in = self.wait_ready(&guard).await?;
        let defaults = self.apply_defaults(&guard).await?;
        Ok(format!(
            "{cleaned}; {started}; answering after {} ms; defaults: {defaults}",
            ready_in.as_millis()
        ))
    }

    fn mode(&self) -> &'static str {
        match self.cfg.manage {
            MpsManage::Systemd => "systemd",
            MpsManage::Direct => "direct",
        }
    }

    async fn attempt(&self, guard: &ControlGuard) -> Result<Done, RemedyError> {
        let t0 = Instant::now();
        let pending = match self.cfg.manage {
            MpsManage::Systemd => self.unit_state().await.filter(UnitState::restarting),
            MpsManage::Direct => None,
        };
        let (old, stopped, cleaned, started) = match pending {
            // systemd is bringing the daemon back already: wait for it, do not race it.
            Some(s) => (
                Vec::new(),
                "not stopped".to_string(),
                "pipe directory left to the new daemon".to_string(),
                format!(
                    "systemd was restarting the daemon itself ({}); no second restart",
                    s.describe(&self.cfg.unit)
                ),
            ),
            None => {
                // Under systemd's Restart= a stopped daemon is started again and counted in
                // NRestarts: the engine discounts that one (it knows this order ran).
                let (old, stopped) = self.stop(guard).await?;
                let cleaned = self.clean_stale().await?;
                let started = self.start().await?;
                (old, stopped, cleaned, started)
            }
        };
        let ready_in = self.wait_ready(guard).await?;
        let defaults = self.apply_defaults(guard).await?;
        let answer = self
            .client
            .send(
                guard,
                &[PROBE_COMMAND, SERVER_LIST_COMMAND],
                self.cfg.probe_timeout,
            )
            .await
            .map_err(|e| RemedyError::retryable(format!("verification probe failed: {e}")))
            .and_then(|r| {
                parse_reply(&r.stdout)
                    .map_err(|e| RemedyError::retryable(format!("verification probe failed: {e}")))
            })?;
        let new = self
            .scan()
            .await
            .map(|f| f.daemon_pids())
            .unwrap_or_default();
        let detail = format!(
            "MPS control daemon restarted ({}): old daemon {}: {stopped}; {cleaned}; {started}; \
             answering after {} ms (new daemon {}, default active threads {:.1}%); defaults: {defaults}; took {} ms",
            self.mode(),
            pids(&old),
            ready_in.as_millis(),
            pids(&new),
            answer.percentage,
            t0.elapsed().as_millis()
        );
        tracing::info!(pipe_dir = %self.cfg.pipe_directory.display(), "{detail}");
        Ok(Done::new(detail))
    }

    async fn scan(&self) -> Result<Found, RemedyError> {
        Scanner::new(&self.cfg.control_binary, &self.cfg.pipe_directory)
            .scan()
            .await
            .map_err(RemedyError::retryable)
    }

    /// Stops whatever daemon serves the pipe directory, and its servers. Returns the old
    /// daemon pids and how they went.
    async fn stop(&self, guard: &ControlGuard) -> Result<(Vec<u32>, String), RemedyError> {
        let found = self.scan().await?;
        let old = found.daemon_pids();
        let mut notes: Vec<String> = Vec::new();
        let mut grace = Duration::ZERO;
        if old.is_empty() {
            notes.push("no daemon was running".into());
        } else if found.daemons.iter().any(MpsProcess::is_stopped) {
            notes.push("daemon was stopped (SIGSTOP): quit skipped".into());
        } else if !self.cfg.quit_timeout.is_zero() {
            match self
                .client
                .send(guard, &["quit"], self.cfg.quit_timeout)
                .await
            {
                Ok(_) => {
                    notes.push("quit".into());
                    grace = TERM_GRACE;
                }
                Err(ControlError::Timeout(t)) => notes.push(format!("quit unanswered in {t:?}")),
                Err(e) => notes.push(format!("quit failed ({e})")),
            }
        }
        let alive = procs::wait_gone(&old, grace).await;
        if !alive.is_empty() {
            let (left, how) = terminate(&found.daemons, &alive).await;
            if !left.is_empty() {
                return Err(RemedyError::retryable(format!(
                    "daemon pid {left:?} survived SIGKILL (uninterruptible sleep in the driver?)"
                )));
            }
            notes.push(format!("{} ended by {how}", pids(&alive)));
        }
        // Servers: those seen with the old daemon, and any the daemon's death orphaned.
        let again = self.scan().await?;
        let mut servers = found.servers.clone();
        for s in again.servers {
            let owned_by_live_daemon = s
                .parent
                .is_some_and(|pp| again.daemons.iter().any(|d| d.pid == pp));
            if !owned_by_live_daemon && !servers.iter().any(|x| x.pid == s.pid) {
                servers.push(s);
            }
        }
        let server_pids: Vec<u32> = servers.iter().map(|s| s.pid).collect();
        let alive = procs::wait_gone(&server_pids, Duration::ZERO).await;
        if !alive.is_empty() {
            let (left, how) = terminate(&servers, &alive).await;
            if left.is_empty() {
                notes.push(format!("leftover servers {alive:?} ended by {how}"));
            } else {
                notes.push(format!("servers {left:?} survived SIGKILL"));
            }
        }
        Ok((old, notes.join(", ")))
    }

    /// Removes the entries a dead daemon left, unless a live one holds the lock.
    async fn clean_stale(&self) -> Result<String, RemedyError> {
        let dir = &self.cfg.pipe_directory;
        if !dir.is_dir() {
            return Ok("no pipe directory".into());
        }
        if let Some(Some(pid)) = procs::lock_holder(&dir.join("control_lock"))
            && procs::is_alive(pid)
        {
            return Ok(format!(
                "pipe directory held by live pid {pid}; not cleaned"
            ));
        }
        if !self.scan().await?.daemons.is_empty() {
            return Ok("a daemon is running again; pipe directory not cleaned".into());
        }
        let mut removed = Vec::new();
        for name in PIPE_ENTRIES {
            let path = dir.join(name);
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if meta.is_dir() {
                continue;
            }
            match std::fs::remove_file(&path) {
                Ok(()) => removed.push(name),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(RemedyError::fatal(format!(
                        "cannot remove stale {}: {e}",
                        path.display()
                    )));
                }
            }
        }
        Ok(if removed.is_empty() {
            "pipe directory clean".into()
        } else {
            format!("stale {} removed", removed.join(", "))
        })
    }

    async fn start(&self) -> Result<String, RemedyError> {
        match self.cfg.manage {
            MpsManage::Direct => self.start_direct().await,
            MpsManage::Systemd => self.start_systemd().await,
        }
    }

    async fn start_direct(&self) -> Result<String, RemedyError> {
        for dir in [&self.cfg.pipe_directory, &self.cfg.log_directory] {
            std::fs::create_dir_all(dir)
                .map_err(|e| RemedyError::fatal(format!("cannot create {}: {e}", dir.display())))?;
        }
        let mut cmd = tokio::process::Command::new(&self.cfg.control_binary);
        cmd.arg("-d");
        for (k, v) in self.client.env() {
            cmd.env(k, v);
        }
        close_inherited_fds_on_exec(&mut cmd);
        let binary = self.cfg.control_binary.display();
        // `-d` returns once the daemon listens; the daemon itself points 0-2 at /dev/null.
        // The daemon it forks may share its process group: the group is left alone after a
        // normal exit, and killed (with the half-started daemon) after a timeout.
        let run = child::output_within(&mut cmd, self.cfg.start_timeout, AfterExit::KeepGroup);
        let out = match run.await {
            Err(RunError::Timeout(_)) => {
                return Err(RemedyError::retryable(format!(
                    "`{binary} -d` did not return within {:?}",
                    self.cfg.start_timeout
                )));
            }
            Err(RunError::Wait(e)) => {
                return Err(RemedyError::retryable(format!(
                    "waiting for `{binary} -d` failed: {e}"
                )));
            }
            Err(RunError::Spawn(e)) => {
                let msg = format!("cannot run `{binary} -d`: {e}");
                return Err(match e.kind() {
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied => {
                        RemedyError::fatal(msg)
                    }
                    _ => RemedyError::retryable(msg),
                });
            }
            Ok(out) => out,
        };
        let text = format!(
            "{} {}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let text = text.trim();
        if out.status.success() {
            return Ok(format!("started `{binary} -d`"));
        }
        if text.contains("already running") {
            return Ok("another daemon instance is already running on the pipe directory".into());
        }
        let socket = self.cfg.pipe_directory.join("control");
        if text.contains("Cannot access") {
            return Err(RemedyError::fatal(format!(
                "`{binary} -d` cannot use the pipe directory ({})",
                clip(text, 200)
            )));
        }
        if socket.as_os_str().len() > 107 {
            return Err(RemedyError::fatal(format!(
                "`{binary} -d` failed: {} is longer than a unix socket path may be (107 bytes)",
                socket.display()
            )));
        }
        Err(RemedyError::retryable(format!(
            "`{binary} -d` exited with {}: {}",
            out.status,
            if text.is_empty() { "no output" } else { text }
        )))
    }

    /// The unit's state, when systemctl can tell it (`None`: unknown, act as without it).
    async fn unit_state(&self) -> Option<UnitState> {
        let sc = Systemctl::new(&self.systemctl, &self.cfg.unit, self.cfg.probe_timeout);
        sc.show().await.ok().filter(UnitState::exists)
    }

    async fn start_systemd(&self) -> Result<String, RemedyError> {
        let unit = self.cfg.unit.as_str();
        // Restart= brings a daemon that exited back by itself (within RestartSec): once it
        // has, or while it is about to, a start of ours would be a second restart.
        if let Some(s) = self.unit_state().await
            && (s.restarting() || s.running())
        {
            return Ok(format!(
                "systemd restarts the daemon itself ({}); no second restart",
                s.describe(unit)
            ));
        }
        // A unit that hit systemd's own start rate limit refuses to start; the engine's
        // budget is the limit that counts here.
        let _ = self.systemctl(&["reset-failed", unit]).await;
        // `start`, not `restart`: the old daemon is stopped already, and a start of a unit
        // that systemd brought back in the meantime changes nothing.
        match self.systemctl(&["start", unit]).await {
            Ok(()) => Ok(format!("`systemctl start {unit}`")),
            Err((msg, fatal)) => Err(if fatal {
                RemedyError::fatal(msg)
            } else {
                RemedyError::retryable(msg)
            }),
        }
    }

    /// Runs systemctl; `Err((message, fatal))`.
    async fn systemctl(&self, args: &[&str]) -> Result<(), (String, bool)> {
        let mut cmd = tokio::process::Command::new(&self.systemctl);
        cmd.args(args);
        let shown = format!("{} {}", self.systemctl.display(), args.join(" "));
        let run = child::output_within(&mut cmd, self.cfg.start_timeout, AfterExit::KillGroup);
        let out = match run.await {
            Err(RunError::Timeout(_)) => {
                return Err((
                    format!(
                        "`{shown}` did not return within {:?}",
                        self.cfg.start_timeout
                    ),
                    false,
                ));
            }
            Err(RunError::Spawn(e)) => {
                let fatal = e.kind() == std::io::ErrorKind::NotFound;
                return Err((format!("cannot run `{shown}`: {e}"), fatal));
            }
            Err(RunError::Wait(e)) => {
                return Err((format!("waiting for `{shown}` failed: {e}"), false));
            }
            Ok(out) => out,
        };
        if out.status.success() {
            return Ok(());
        }
        let text = format!(
            "{} {}",
            String::from_utf8_lossy(&out.stdout).trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        let lower = text.to_ascii_lowercase();
        let fatal = lower.contains("not found")
            || lower.contains("not loaded")
            || lower.contains("does not exist")
            || lower.contains("not been booted with systemd");
        Err((
            format!(
                "`{shown}` exited with {}: {}",
                out.status,
                clip(text.trim(), 300)
            ),
            fatal,
        ))
    }

    /// Waits until the daemon answers; returns how long it took.
    async fn wait_ready(&self, guard: &ControlGuard) -> Result<Duration, RemedyError> {
        let t0 = Instant::now();
        let deadline = t0 + self.cfg.start_timeout;
        let socket = self.cfg.pipe_directory.join("control");
        let mut last = String::from("control socket never appeared");
        loop {
            let now = Instant::now();
            if now >= deadline {
                return Err(RemedyError::retryable(format!(
                    "daemon did not answer within {:?} of starting: {last}",
                    self.cfg.start_timeout
                )));
            }
            if socket.exists() {
                let wait = self.cfg.probe_timeout.min(deadline - now);
                match self.client.send(guard, &[PROBE_COMMAND], wait).await {
                    Ok(r) if r.stdout.lines().next().and_then(parse_percentage).is_some() => {
                        return Ok(t0.elapsed());
                    }
                    Ok(r) => last = format!("unexpected reply {:?}", clip(r.stdout.trim(), 80)),
                    Err(e) => last = e.to_string(),
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sets the configured defaults and reads them back.
    async fn apply_defaults(&self, guard: &ControlGuard) -> Result<String, RemedyError> {
        let mut applied = Vec::new();
        let t = self.cfg.probe_timeout;
        let talk = |cmd: String| async move {
            self.client
                .send(guard, &[cmd.as_str()], t)
                .await
                .map_err(|e| RemedyError::retryable(format!("`{cmd}` failed: {e}")))
        };
        if let Some(pct) = self.cfg.default_active_thread_percentage {
            talk(format!("set_default_active_thread_percentage {pct}")).await?;
            let got = talk(PROBE_COMMAND.to_string()).await?;
            let value = got.stdout.lines().next().and_then(parse_percentage);
            if value.is_none_or(|v| (v - f64::from(pct)).abs() > 0.05) {
                return Err(RemedyError::fatal(format!(
                    "the daemon did not take default_active_thread_percentage = {pct}: it reports {:?}",
                    clip(got.stdout.trim(), 80)
                )));
            }
            applied.push(format!("active thread percentage {pct}"));
        }
        for (dev, size) in self.cfg.pinned_limits() {
            talk(format!("set_default_device_pinned_mem_limit {dev} {size}")).await?;
            // The daemon reads limits back only for device ordinals.
            if dev.bytes().all(|b| b.is_ascii_digit()) {
                let got = talk(format!("get_default_device_pinned_mem_limit {dev}")).await?;
                let reply = got.stdout.trim();
                if !same_limit(&size, reply) {
                    return Err(RemedyError::fatal(format!(
                        "the daemon did not take pinned memory limit {dev}={size}: it reports {:?}",
                        clip(reply, 80)
                    )));
                }
            }
            applied.push(format!("pinned memory {dev}={size}"));
        }
        Ok(if applied.is_empty() {
            "none configured".into()
        } else {
            applied.join(", ")
        })
    }
}

/// `pid 12`, `pids [12, 13]`, `none`.
fn pids(p: &[u32]) -> String {
    match p {
        [] => "none".into(),
        [one] => format!("pid {one}"),
        many => format!("pids {many:?}"),
    }
}

/// `2G`, `4096M` as MiB.
fn mib(s: &str) -> Option<u64> {
    let s = s.trim();
    if let Some(g) = s.strip_suffix('G') {
        return g.parse::<u64>().ok()?.checked_mul(1024);
    }
    s.strip_suffix('M').unwrap_or(s).parse().ok()
}

/// The daemon shows limits of 1 GiB and more as whole GiB, rounded down.
fn same_limit(configured: &str, reply: &str) -> bool {
    match (mib(configured), mib(reply)) {
        (Some(want), Some(got)) => got == want || (want >= 1024 && got == want / 1024 * 1024),
        _ => false,
    }
}

/// SIGCONT + SIGTERM, then SIGKILL; returns the pids still alive after that and the last
/// signal that was needed.
async fn terminate(procs_seen: &[MpsProcess], alive: &[u32]) -> (Vec<u32>, &'static str) {
    let targets: Vec<&MpsProcess> = procs_seen
        .iter()
        .filter(|p| alive.contains(&p.pid))
        .collect();
    for p in &targets {
        // A stopped process acts on SIGTERM only once continued.
        procs::signal(p, libc::SIGCONT);
        procs::signal(p, libc::SIGTERM);
    }
    let left = procs::wait_gone(alive, TERM_GRACE).await;
    if left.is_empty() {
        return (left, "SIGTERM");
    }
    for p in targets.iter().filter(|p| left.contains(&p.pid)) {
        tracing::warn!(pid = p.pid, "MPS process ignored SIGTERM; sending SIGKILL");
        procs::signal(p, libc::SIGKILL);
    }
    (procs::wait_gone(&left, KILL_GRACE).await, "SIGKILL")
}

/// Marks every descriptor above stderr close-on-exec in the child: the daemon keeps every
/// descriptor it inherits open for its whole life (a pipe of ours would never see EOF).
fn close_inherited_fds_on_exec(cmd: &mut tokio::process::Command) {
    // SAFETY: sysconf has no memory-safety preconditions.
    let max_fd = match unsafe { libc::sysconf(libc::_SC_OPEN_MAX) } {
        n if n > 0 => n.min(65_536) as libc::c_int,
        _ => 1024,
    };
    // SAFETY: the closure runs in the forked child before exec. It only makes
    // async-signal-safe system calls (close_range, fcntl) on plain integers, allocates
    // nothing and touches no locks. Marking the exec-error pipe of std close-on-exec again
    // changes nothing (it already is).
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::syscall(
                libc::SYS_close_range,
                3 as libc::c_uint,
                libc::c_uint::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
            if r != 0 {
                // Kernels before 5.11: one descriptor at a time.
                for fd in 3..max_fd {
                    let flags = libc::fcntl(fd, libc::F_GETFD);
                    if flags >= 0 && flags & libc::FD_CLOEXEC == 0 {
                        libc::fcntl(fd, libc::F_SETFD, flags | libc::FD_CLOEXEC);
                    }
                }
            }
            Ok(())
        });
    }
}

impl MpsRemedy for MpsDaemon {
    fn terminate_clients<'a>(
        &'a self,
        pids: &'a [u32],
    ) -> BoxFuture<'a, Result<Done, RemedyError>> {
        Box::pin(super::mps_clients::terminate_clients(
            &self.client,
            self.cfg.probe_timeout,
            pids,
        ))
    }

    fn restart(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let (incident, attempt, deadline) = (order.incident, order.attempt, order.deadline);
        Box::pin(async move {
            tracing::warn!(
                incident_id = incident.0,
                attempt,
                pipe_dir = %self.cfg.pipe_directory.display(),
                mode = self.mode(),
                "restarting the MPS control daemon"
            );
            let left = deadline.since(Timestamp(self.clock.now_ms()));
            if left.is_zero() {
                return self.restart_now().await;
            }
            match tokio::time::timeout(left, self.restart_now()).await {
                Ok(r) => r,
                Err(_) => Err(RemedyError::retryable(format!(
                    "MPS restart did not finish before its deadline ({deadline})"
                ))),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pinned_limits_compare_as_the_daemon_shows_them() {
        assert!(same_limit("2G", "2G"));
        assert!(same_limit("4096M", "4G"));
        assert!(same_limit("1044M", "1G"));
        assert!(same_limit("512M", "512M"));
        assert!(!same_limit("512M", ""));
        assert!(!same_limit("2G", "1G"));
        assert!(!same_limit("2G", "garbage"));
    }
}
