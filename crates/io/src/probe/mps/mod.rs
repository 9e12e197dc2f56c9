//! The MPS control daemon, through its own control client and its logs.
//!
//! Every `probe_interval` the probe runs `control_binary` in client mode against the
//! configured pipe directory and sends `get_default_active_thread_percentage` and
//! `get_server_list` in one session, with `probe_timeout` as the deadline. The reply must
//! parse: exit 0 with empty output is what a busy daemon gives a second client. Then:
//!
//! - answered: `mps-up` (value = latency in ms); the engine closes MPS incidents on it.
//! - no answer, but a daemon process serves the pipe directory (hung, stopped, busy,
//!   garbage): `mps-unresponsive` (value = consecutive failed probes; the policy's
//!   threshold counts them).
//! - no daemon process ("Cannot find MPS control daemon process", stale sockets after a
//!   crash): `mps-down` (value = consecutive failed probes).
//!
//! A control binary that cannot be run at all (missing, not executable) is not a daemon
//! fault: restarting the daemon would need the same binary. It is a `self-fault` of
//! gpu-medic (component `mps-control`), reported once, and the daemon's state is unknown
//! until the binary runs again (`self-recovered`).
//!
//! Under `manage = "systemd"` each turn also reads the unit (`systemctl show`, see
//! [`crate::mps::systemd`]): systemd restarts a daemon that exits (`Restart=always` on the
//! ECS GPU AMI) within a second, so a daemon that keeps dying may answer every probe. Restarts
//! systemd made (`NRestarts` rising) are each an `mps-crash` (source `mps-unit`); how many
//! make a loop is the policy's (rule `mps-crash-loop`), and the one restart each of
//! gpu-medic's own restarts causes is the engine's to discount. A failed probe while systemd is itself
//! bringing the daemon back (`auto-restart`, `activating`) is not reported as `mps-down`: a
//! restart by gpu-medic would race systemd's. What systemd cannot see stays gpu-medic's: a
//! hung daemon (the probe deadline; the unit is `active/running`), servers that keep dying
//! (the daemon's lines), and the restart budget (the engine).
//!
//! While a restart holds the control lock the probe skips its turn: the restart's outcome
//! speaks for the daemon. The daemon's lines (`control.log` and `server.log`, or the unit's
//! journal for a daemon run with `-f`, per `[mps] logs`) are read each turn for server crash
//! loops and fatal faults ([`logs`], [`journald`]); a fault's client pids are named as ECS tasks
//! ([`super::tasks`]). Process identity: [`procs`]. The control client
//! and its lock are shared with the remedy ([`control`]).

pub mod cadence;
pub mod journald;
pub mod logs;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use self::logs::LogWatch;
use super::tasks::TaskNamer;
use super::{ProbeError, Snapshot, SnapshotReport};
use crate::aws::agent::Agent;
use crate::config::{MpsConfig, MpsManage};
use crate::model::{Observation, Signal};
use crate::mps::control::{ControlClient, ControlError};
use crate::mps::procs::Scanner;
use crate::mps::systemd::{Systemctl, UnitState};
use crate::mps::{Answer, PROBE_COMMAND, SERVER_LIST_COMMAND, parse_reply};
use crate::probe::Source;

/// The probe's state between turns: the client, consecutive failures, the log tails.
pub struct MpsProbe {
    cfg: MpsConfig,
    client: ControlClient,
    scanner: Scanner,
    logs: LogWatch,
    failures: u64,
    was_up: Option<bool>,
    /// The daemon processes found at the last failed probe: another daemon (a restart, by
    /// gpu-medic or anyone) starts the count of consecutive failures over.
    failed_daemons: Option<Vec<u32>>,
    /// The control binary could not be run on the last probe (a self-fault is open).
    unrunnable: bool,
    /// An all-clear to report with the next turn.
    recovered: Option<Observation>,
    /// The daemon's unit under `manage = "systemd"`.
    unit: Option<UnitWatch>,
    /// Names the ECS tasks of a server fault's clients.
    namer: TaskNamer,
    /// When others (the ECS agent) talk to the daemon.
    cadence: cadence::Cadence,
}

/// systemd's own restarts of the daemon's unit.
struct UnitWatch {
    systemctl: Systemctl,
    /// `NRestarts` at the last look.
    last: Option<u64>,
    /// The state at the last look.
    state: Option<UnitState>,
    warned: bool,
}

/// At most this many `mps-crash` observations from one look at the unit (a counter that
/// jumped by thousands is one storm, not thousands of findings).
const MAX_UNIT_CRASHES: u64 = 8;

impl UnitWatch {
    fn new(systemctl: Systemctl) -> UnitWatch {
        UnitWatch {
            systemctl,
            last: None,
            state: None,
            warned: false,
        }
    }

    /// Reads the unit; one `mps-crash` per restart systemd made since the last look.
    async fn look(&mut self) -> Vec<Observation> {
        let state = match self.systemctl.show().await {
            Ok(s) if s.exists() => s,
            Ok(_) => {
                self.state = None;
                return Vec::new();
            }
            Err(e) => {
                if !std::mem::replace(&mut self.warned, true) {
                    tracing::warn!(
                        probe = "mps",
                        "cannot read the MPS daemon's unit: {e}; systemd's own restarts are not counted"
                    );
                }
                self.state = None;
                return Vec::new();
            }
        };
        self.warned = false;
        let before = self.last.replace(state.n_restarts);
        let mut out = Vec::new();
        if let Some(b) = before
            && state.n_restarts > b
        {
            let new = (state.n_restarts - b).min(MAX_UNIT_CRASHES);
            for _ in 0..new {
                out.push(
                    Observation::new(Signal::MpsCrash)
                        .with_value(1)
                        .with_detail(format!(
                            "systemd restarted the MPS control daemon (Restart=; NRestarts {b} -> {}); {}",
                            state.n_restarts,
                            state.describe(self.systemctl.unit())
                        ))
                        .from_source(crate::model::MPS_UNIT_SOURCE),
                );
            }
        }
        self.state = Some(state);
        out
    }
}

/// The self-fault component name of a control binary that cannot be run.
pub const COMPONENT: &str = "mps-control";

impl MpsProbe {
    /// A probe with a control client of its own (nothing else talks to this daemon).
    pub fn new(cfg: MpsConfig) -> Self {
        let client = ControlClient::new(&cfg);
        MpsProbe::with_client(cfg, client)
    }

    /// A probe that shares `client` (and its lock) with whoever else holds a clone of it.
    pub fn with_client(cfg: MpsConfig, client: ControlClient) -> Self {
        MpsProbe {
            client,
            scanner: Scanner::new(&cfg.control_binary, &cfg.pipe_directory),
            logs: LogWatch::for_config(&cfg),
            failures: 0,
            was_up: None,
            failed_daemons: None,
            unrunnable: false,
            recovered: None,
            unit: (cfg.manage == MpsManage::Systemd)
                .then(|| UnitWatch::new(Systemctl::new("systemctl", &cfg.unit, cfg.probe_timeout))),
            namer: TaskNamer::new(None),
            cadence: cadence::Cadence::default(),
            cfg,
        }
    }

    /// Names the ECS tasks of server faults through this agent's `/v1/tasks` (without one,
    /// by the task ids in the clients' cgroups only).
    pub fn with_agent(mut self, agent: Option<Agent>) -> Self {
        self.namer = TaskNamer::new(agent);
        self
    }

    /// Reads the unit with another `systemctl` (tests), or not at all (`None`).
    pub fn with_systemctl(mut self, systemctl: Option<&std::path::Path>) -> Self {
        self.unit = systemctl
            .map(|p| UnitWatch::new(Systemctl::new(p, &self.cfg.unit, self.cfg.probe_timeout)));
        self
    }

    pub fn client(&self) -> &ControlClient {
        &self.client
    }

    /// Consecutive failed probes so far.
    pub fn failures(&self) -> u64 {
        self.failures
    }

    /// One turn: the unit, the logs, then the daemon probe.
    pub async fn tick(&mut self) -> Vec<Observation> {
        let looped = match &mut self.unit {
            Some(u) => u.look().await,
            None => Vec::new(),
        };
        // The logs first: the sessions in them say when others talk to the daemon.
        let mut read = self.logs.poll();
        let sessions = self.logs.take_sessions();
        if !sessions.is_empty() {
            let offset = crate::probe::kernel_record::BootClock::now().map_or(0, |c| c.utc_offset);
            self.cadence.seen(&sessions, offset);
        }
        let mut seen = self.probe().await;
        if let Some(o) = &seen
            && o.signal == Signal::MpsDown
            && let Some(state) = self.unit.as_ref().and_then(|u| u.state.as_ref())
            && state.restarting()
        {
            // systemd is bringing the daemon back itself: a restart now would race it.
            tracing::debug!(
                probe = "mps",
                "{}; systemd is restarting it",
                state.describe(&self.cfg.unit)
            );
            self.failures = self.failures.saturating_sub(1);
            seen = None;
        }
        let mut out: Vec<Observation> = self.recovered.take().into_iter().collect();
        out.extend(looped);
        out.extend(seen);
        self.namer.name(&mut read).await;
        out.extend(read);
        out
    }

    /// Probes the daemon once. `None`: a restart holds the control lock, no verdict.
    ///
    /// One prober on one pipe: the daemon serves one front-end session at a time, and a
    /// second one fails (tests/support/MPS-FACTS.md, section 3): the ECS agent probes the
    /// same daemon (`get_default_active_thread_percentage`, 3 s deadline, instance impaired
    /// after 3 failures). So the probe waits while another front-end of our pipe talks to
    /// the daemon (up to [`FRONT_END_WAIT`]), and a failure that a concurrent session
    /// causes (refused, an empty reply) is tried once more after a jittered pause before it
    /// counts. A deadline passed or no daemon at all counts at once.
    pub async fn probe(&mut self) -> Option<Observation> {
        let timeout = self.cfg.probe_timeout;
        let hold = self.cadence.hold(now_ms(), AGENT_GUARD);
        if !hold.is_zero() {
            tracing::debug!(
                probe = "mps",
                ?hold,
                "another prober's session is due; keeping away from it"
            );
            tokio::time::sleep(hold).await;
        }
        let guard = self.client.lock_within(timeout).await?;
        self.wait_for_other_front_ends().await;
        let mut sent = self
            .client
            .send(&guard, &[PROBE_COMMAND, SERVER_LIST_COMMAND], timeout)
            .await;
        let busy = match &sent {
            Ok(reply) => parse_reply(&reply.stdout).is_err(),
            Err(ControlError::Failed { .. }) => true,
            Err(_) => false,
        };
        if busy {
            tokio::time::sleep(jitter(RETRY_PAUSE)).await;
            self.wait_for_other_front_ends().await;
            sent = self
                .client
                .send(&guard, &[PROBE_COMMAND, SERVER_LIST_COMMAND], timeout)
                .await;
        }
        drop(guard);
        if let Err(ControlError::Spawn {
            missing: true,
            message,
            binary,
        }) = &sent
        {
            if self.unrunnable {
                // Said once; each later probe only at debug (tests count them).
                tracing::debug!(
                    probe = "mps",
                    "still cannot run the MPS control client {binary}: {message}"
                );
            } else {
                tracing::error!(
                    probe = "mps",
                    "cannot run the MPS control client {binary}: {message}; the daemon's state is unknown (self-fault; it is not restarted for this)"
                );
            }
            self.unrunnable = true;
            return Some(
                Observation::new(Signal::SelfFault {
                    component: COMPONENT.into(),
                })
                .with_detail(format!(
                    "cannot run the MPS control client {binary}: {message}; the daemon's state is unknown"
                ))
                .from_source("mps"),
            );
        }
        if std::mem::take(&mut self.unrunnable) {
            self.recovered = Some(
                Observation::new(Signal::SelfRecovered {
                    component: COMPONENT.into(),
                })
                .with_detail(format!("{} runs again", self.cfg.control_binary.display()))
                .from_source("mps"),
            );
        }
        let failure = match sent {
            Ok(reply) => match parse_reply(&reply.stdout) {
                Ok(answer) => return Some(self.up(&answer, reply.elapsed)),
                Err(why) => Failure::Reply(why),
            },
            Err(e) => Failure::Control(e),
        };
        Some(self.down_or_unresponsive(failure).await)
    }

    /// Waits, at most [`FRONT_END_WAIT`], while another front-end talks to the daemon of
    /// our pipe (our own cannot: the control lock is held).
    async fn wait_for_other_front_ends(&mut self) {
        let until = tokio::time::Instant::now() + FRONT_END_WAIT;
        loop {
            match self.scanner.scan().await {
                Ok(found) if !found.clients.is_empty() => {
                    tracing::debug!(probe = "mps", clients = ?found.clients, "another front-end talks to the MPS daemon; waiting for it");
                }
                _ => return,
            }
            if tokio::time::Instant::now() >= until {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn up(&mut self, answer: &Answer, latency: Duration) -> Observation {
        if self.was_up == Some(false) {
            tracing::info!(
                probe = "mps",
                failures = self.failures,
                "MPS control daemon answers again"
            );
        }
        self.was_up = Some(true);
        self.failures = 0;
        self.failed_daemons = None;
        let mut detail = format!(
            "answered {:.1} in {} ms; servers: {:?}",
            answer.percentage,
            latency.as_millis(),
            answer.servers
        );
        if !answer.noise.is_empty() {
            detail.push_str(&format!("; unexpected lines: {:?}", answer.noise));
        }
        Observation::new(Signal::MpsUp)
            .with_value(latency.as_millis() as u64)
            .with_detail(detail)
            .from_source("mps")
    }

    async fn down_or_unresponsive(&mut self, failure: Failure) -> Observation {
        let why = failure.to_string();
        let scanned = self.scanner.scan().await;
        if let Ok(found) = &scanned {
            let mut pids: Vec<u32> = found.daemons.iter().map(|d| d.pid).collect();
            pids.sort_unstable();
            if self.failed_daemons.as_ref().is_some_and(|p| *p != pids) {
                self.failures = 0; // another daemon than the one that failed before
            }
            self.failed_daemons = Some(pids);
        }
        self.failures = self.failures.saturating_add(1);
        let pipe = self.cfg.pipe_directory.display();
        let (signal, detail) = match &scanned {
            Ok(found) if !found.daemons.is_empty() => {
                let states: Vec<String> = found
                    .daemons
                    .iter()
                    .map(|d| {
                        let stopped = if d.is_stopped() { ", stopped" } else { "" };
                        format!("{} (state {}{stopped})", d.pid, d.state)
                    })
                    .collect();
                let held = if found.clients.is_empty() {
                    String::new()
                } else {
                    let pids: Vec<String> =
                        found.clients.iter().take(8).map(u32::to_string).collect();
                    format!(
                        "; another front-end holds a session with it: pid {}",
                        pids.join(", ")
                    )
                };
                (
                    Signal::MpsUnresponsive,
                    format!(
                        "{why}; daemon for {pipe} is running: pid {}{held}",
                        states.join(", ")
                    ),
                )
            }
            Ok(_) => {
                let stale = if self.cfg.pipe_directory.join("control").exists() {
                    " (stale control socket left behind)"
                } else {
                    ""
                };
                (
                    Signal::MpsDown,
                    format!("{why}; no MPS control daemon serves {pipe}{stale}"),
                )
            }
            Err(e) => {
                let signal = if matches!(failure, Failure::Control(ControlError::NotFound)) {
                    Signal::MpsDown
                } else {
                    Signal::MpsUnresponsive
                };
                (signal, format!("{why}; {e}"))
            }
        };
        if self.was_up != Some(false) {
            tracing::warn!(probe = "mps", signal = %signal, "MPS control daemon probe failed: {detail}");
        } else {
            tracing::debug!(probe = "mps", signal = %signal, failures = self.failures, "{detail}");
        }
        self.was_up = Some(false);
        Observation::new(signal)
            .with_value(self.failures)
            .with_detail(detail)
            .from_source("mps")
    }
}

/// Why a probe failed.
#[derive(Debug)]
enum Failure {
    Control(ControlError),
    Reply(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Control(e) => write!(f, "{e}"),
            Failure::Reply(why) => f.write_str(why),
        }
    }
}

/// How far a probe keeps from another prober's next session (its cadence learnt from the
/// daemon's log, [`cadence`]): the agent's probe takes milliseconds, its schedule drifts.
pub const AGENT_GUARD: Duration = Duration::from_secs(1);

/// Now, in milliseconds since the epoch (UTC).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// How long a probe waits while another front-end (the ECS agent's probe: 3 s at most) talks
/// to the daemon.
pub const FRONT_END_WAIT: Duration = Duration::from_secs(4);
/// The pause before a probe that a concurrent session may have failed is tried again: a
/// random part of it (full jitter), so two probers that collided do not collide again.
pub const RETRY_PAUSE: Duration = Duration::from_millis(500);

/// A pause drawn uniformly from `[0, most]`: the process's random hasher keys seeded each
/// draw apart (no clock: two processes started together still draw differently).
fn jitter(most: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(most.as_nanos() as u64);
    let unit = (h.finish() >> 11) as f64 / (1u64 << 53) as f64;
    most.mul_f64(unit)
}

/// The continuous MPS probe for `gpu-medic run`.
pub struct MpsSource {
    cfg: MpsConfig,
    client: ControlClient,
    /// The ECS agent that names a server fault's tasks.
    agent: Option<Agent>,
}

impl MpsSource {
    /// `client` is shared with the MPS remedy, so the two never talk to the daemon at once.
    pub fn new(cfg: MpsConfig, client: ControlClient) -> Self {
        MpsSource {
            cfg,
            client,
            agent: None,
        }
    }

    /// A server fault's client pids are named as ECS tasks through this agent
    /// (`[ecs] agent_url`, `/v1/tasks`).
    pub fn naming_tasks_with(mut self, agent: Agent) -> Self {
        self.agent = Some(agent);
        self
    }
}

impl Source for MpsSource {
    fn name(&self) -> &'static str {
        "mps"
    }

    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        resume: crate::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut probe = MpsProbe::with_client(self.cfg.clone(), self.client.clone())
                .with_agent(self.agent.clone());
            // The log tails resume where the journal ends (lines written while gpu-medic
            // was down are read).
            probe.logs.resume_from(&resume);
            let mut every = tokio::time::interval(self.cfg.probe_interval);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = every.tick() => {}
                }
                // A probe cut short by shutdown kills its client (see control.rs).
                let seen = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    seen = probe.tick() => seen,
                };
                for obs in seen {
                    if tx.send(obs).await.is_err() {
                        return;
                    }
                }
            }
        })
    }
}

/// The one-shot MPS probe for `gpu-medic check`. A failure is probed once more at once, so
/// the value (consecutive failures) reaches the policy's confirmation threshold only when
/// the daemon fails twice in a row.
pub struct MpsSnapshot {
    cfg: MpsConfig,
}

impl MpsSnapshot {
    pub fn new(cfg: MpsConfig) -> Self {
        MpsSnapshot { cfg }
    }
}

impl Snapshot for MpsSnapshot {
    fn name(&self) -> &'static str {
        "mps"
    }

    fn snapshot(&mut self) -> Result<SnapshotReport, ProbeError> {
        let cfg = self.cfg.clone();
        // Own thread and runtime: works whether or not the caller is inside a runtime.
        let joined = std::thread::scope(|s| {
            s.spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(rt.block_on(async move {
                    let mut probe = MpsProbe::new(cfg);
                    let mut last = None;
                    for _ in 0..2 {
                        last = probe.probe().await;
                        match &last {
                            Some(o) if o.signal == Signal::MpsUnresponsive => {
                                tokio::time::sleep(Duration::from_millis(200)).await;
                            }
                            _ => break,
                        }
                    }
                    last
                }))
            })
            .join()
        });
        let obs = match joined {
            Ok(Ok(obs)) => obs,
            Ok(Err(message)) => {
                return Err(ProbeError {
                    probe: "mps",
                    message,
                    retryable: true,
                });
            }
            Err(_) => {
                return Err(ProbeError {
                    probe: "mps",
                    message: "the MPS probe thread panicked".into(),
                    retryable: true,
                });
            }
        };
        Ok(SnapshotReport {
            // mps-up is the all-clear, not a finding.
            observations: obs
                .into_iter()
                .filter(|o| o.signal != Signal::MpsUp)
                .collect(),
            ..SnapshotReport::default()
        })
    }
}
