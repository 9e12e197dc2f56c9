//! Wiring: probes feed observations into one channel; one task owns the engine state, takes
//! what is waiting as a batch (fatal signals first), stamps each input with the clock, steps
//! the engine, and commits the batch: inputs, then incident records, then state, one fsync
//! each; only then are orders handed to the executor and sources' cursors moved (at least
//! once from every source, duplicates dropped by position). Outcomes come back as inputs.
//! One shutdown token fans out to every task; orders in flight get a grace period to reach a
//! safe point, then state is saved. A commit that fails (a full disk) is a self-fault, not an
//! exit: see [`Unsaved`] for what waits and which orders still run (docs/journal.md).

pub mod drill_gate;
pub mod evidence;

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::engine::{self, State};
use crate::journal::{self, JsonlWriter};
use crate::metrics::Metrics;
use crate::model::{
    Action, IncidentEvent, Input, Observation, Order, Outcome, Record, StampedInput, Timestamp,
};
use crate::policy::Policy;
use crate::probe::Source;
use crate::remedy::Executor;
use crate::sys::clock::{SharedClock, SystemClock};
use crate::sys::error::JournalError;

#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    #[error(transparent)]
    Journal(#[from] JournalError),
}

/// How long in-flight orders get to finish after a shutdown signal.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(20);

pub struct Supervisor {
    cfg: Config,
    policy: Policy,
    executor: Arc<dyn Executor>,
    sources: Vec<Box<dyn Source>>,
    metrics: Option<Arc<Metrics>>,
    gpu_signal: Option<Arc<tokio::sync::Notify>>,
    /// The clock every input is stamped with (the engine reads none of its own).
    clock: SharedClock,
    /// What the start does with `state.json` and the reboots kept outside it.
    opening: Opening,
}

/// How the start opens the state: whether it reads a newer gpu-medic's `state.json`
/// (`gpu-medic run --accept-newer-state`), and the reboots read from the instance's tag
/// (`[aws]` on, `reboots.json` missing: a lost disk), handed in by `run`.
#[derive(Debug, Clone)]
pub struct Opening {
    pub newer: journal::Newer,
    pub tagged: Option<Vec<crate::model::repair::Repair>>,
}

impl Default for Opening {
    fn default() -> Self {
        Opening {
            newer: journal::Newer::Refuse,
            tagged: None,
        }
    }
}

/// This boot's id, read once: for the engine (only with the reboot rung, which is all that
/// needs it; without it no reboot is ever ordered) and for every source (empty when it
/// cannot be read).
fn boot_id(cfg: &Config, reboot: bool) -> (Option<String>, String) {
    match crate::sys::limits::read_boot_id(&cfg.repair.boot_id_path) {
        Ok(id) => (reboot.then(|| id.clone()), id),
        Err(_) if !reboot => (None, String::new()),
        Err(e) => {
            tracing::warn!(
                "cannot read the kernel boot id ({e}); the reboot rung replaces instead of rebooting"
            );
            (None, String::new())
        }
    }
}

/// Why the state was rebuilt from the journal.
enum LostState {
    SetAside(journal::SetAside),
    /// Missing, or with no history: what was wrong with it.
    Missing(String),
}

/// `state.json` could not be read and was set aside, or was missing (or empty of any history)
/// beside a journal that has some: journaled as a self-fault that is already over (the state
/// was rebuilt from the incident journal), saying what the rebuild left out.
fn report_lost_state(
    engine: &mut Keeper,
    cfg: &Config,
    lost: &LostState,
    rebuilt: Option<&journal::Rebuilt>,
) -> Result<(), SupervisorError> {
    let what = match lost {
        LostState::SetAside(aside) => {
            tracing::error!(moved_to = %aside.moved_to.display(), "state.json unreadable ({}); set aside, resuming from the incident journal", aside.why);
            format!(
                "could not be read ({}); set aside as {}",
                aside.why,
                aside.moved_to.display()
            )
        }
        LostState::Missing(why) => {
            tracing::error!(
                "state.json {why} while the incident journal has records; resuming from the incident journal"
            );
            why.clone()
        }
    };
    let left_out = rebuilt
        .map(ToString::to_string)
        .filter(|t| !t.is_empty())
        .map_or(String::new(), |t| format!("; left out: {t}"));
    let detail = format!(
        "{} {what}; resumed from the incident journal: {} open incident(s), {} order(s) in flight, {} reboot(s) in the repair history, next incident id {}, node {}{left_out}",
        cfg.state_path().display(),
        engine.state.incidents.open.len(),
        engine.state.orders.in_flight.len(),
        engine.state.repair.history.len(),
        engine.state.incidents.last_id.saturating_add(1),
        engine.state.node.phase.as_str()
    );
    report_state_file(
        engine,
        detail,
        "started from the journal; a new state.json is written",
    )
}

/// Why the loaded state cannot be trusted and is rebuilt from the journal, if it cannot. A
/// state with no history (none, or one that never counted an incident) beside a journal that
/// has records was lost (deleted, replaced by `{}`): it is rebuilt like an unreadable one, so
/// no guarantee (the reboot ladder, the incident ids) starts over. A state saved before the
/// first input (a crash before the first commit) is no loss: the inputs journaled right after
/// it explain the records, and the replay steps them again.
fn lost_state(cfg: &Config, loaded: &journal::Loaded) -> Option<LostState> {
    let journal_has = || journal::has_records(&cfg.incidents_path());
    let explained = |s: &State| {
        let applied = s.delivery.applied;
        journal::inputs_after(&cfg.inputs_path(), applied, 1).is_ok_and(|(tail, last)| {
            tail.first().map(|e| e.seq) == Some(applied + 1) && last - applied <= REPLAY_MAX as u64
        })
    };
    match (&loaded.state, &loaded.set_aside) {
        (_, Some(aside)) => Some(LostState::SetAside(aside.clone())),
        (None, None) if journal_has() => Some(LostState::Missing("is missing".into())),
        (Some(s), None)
            if s.incidents.last_id == 0
                && s.orders.last_id == 0
                && journal_has()
                && !explained(s) =>
        {
            Some(LostState::Missing("holds no history".into()))
        }
        _ => None,
    }
}

/// Reboots kept outside the state, with where they were read.
type Kept = (Vec<crate::model::repair::Repair>, String);

/// The reboots kept outside `state.json` for the engine (`Input::Reboots`): the state
/// directory's ledger, else (it is gone: a lost disk) those `run` read from the instance's
/// tag. Also the ledger as read, so the first commit rewrites it only when it changes.
fn kept_reboots(
    cfg: &Config,
    tagged: Option<Vec<crate::model::repair::Repair>>,
) -> (Option<Kept>, Option<Vec<crate::model::repair::Repair>>) {
    let files = cfg.files();
    let from_tag = |t| {
        (
            t,
            format!("the instance tag {}", crate::model::repair::REBOOTS_TAG),
        )
    };
    match files.load_reboots() {
        Ok(Some(r)) => (
            Some((r.clone(), files.reboots().display().to_string())),
            Some(r),
        ),
        Ok(None) => (tagged.map(from_tag), None),
        Err(why) => {
            tracing::error!(
                "the reboot ledger cannot be read ({why}); it is written anew from the state"
            );
            (tagged.map(from_tag), None)
        }
    }
}

/// A self-fault of component `state-file` that is already over (`detail` says what was
/// found and done), journaled with the start.
fn report_state_file(
    engine: &mut Keeper,
    detail: String,
    done: &str,
) -> Result<(), SupervisorError> {
    let component = "state-file".to_string();
    let fault = Observation::new(crate::model::Signal::SelfFault {
        component: component.clone(),
    })
    .with_detail(detail)
    .from_source("journal");
    let ok = Observation::new(crate::model::Signal::SelfRecovered { component })
        .with_detail(done)
        .from_source("journal");
    engine.handle_batch(Batch {
        observations: vec![fault, ok],
        ..Batch::default()
    })?;
    Ok(())
}

/// A newer gpu-medic's `state.json` read because the operator said so
/// (`--accept-newer-state`): journaled, so the incident says what was done and by whom.
fn report_newer_state(
    engine: &mut Keeper,
    cfg: &Config,
    writer: &str,
) -> Result<(), SupervisorError> {
    let ours = format!(
        "{} (state format {})",
        engine::writer(),
        engine::STATE_FORMAT
    );
    tracing::warn!(
        "{} was written by {writer}; read as {ours} because of --accept-newer-state: what this version does not know is dropped",
        cfg.state_path().display()
    );
    report_state_file(
        engine,
        format!(
            "{} was written by {writer}; read as {ours} because gpu-medic run was started with --accept-newer-state: what this version does not know was dropped",
            cfg.state_path().display()
        ),
        "started from it; it is written back in this version's format",
    )
}

/// The task that owns the state and both journals: it steps the engine over each batch.
struct Keeper {
    state: State,
    policy: Policy,
    cfg: Config,
    metrics: Option<Arc<Metrics>>,
    gpu_signal: Option<Arc<tokio::sync::Notify>>,
    clock: SharedClock,
    incidents: JsonlWriter<Record>,
    inputs: JsonlWriter<journal::JournaledInput>,
    /// The sequence number of the last input written to `inputs.jsonl`.
    seq: u64,
    /// While the journal or the state cannot be written (a full disk): see [`Unsaved`].
    unsaved: Unsaved,
    /// The reboot ledger (`reboots.json`) as last written or read: it is written again when
    /// the repair history differs.
    ledger: Option<Vec<crate::model::repair::Repair>>,
    /// Records of this batch the executor is shown ([`Executor::observe`]): the openings of
    /// application faults (a poison task across the fleet, docs/fleet-scale.md).
    observed: Vec<Record>,
}

/// A journal or state write that fails (a full disk under `state_dir`, an I/O error) is a
/// self-fault of gpu-medic (component [`JOURNAL_COMPONENT`]), not an exit: healing goes on.
///
/// What must hold is *state before orders*: an order is started only once a restart would
/// know it. While the state cannot be saved that holds only for orders a restart gives again
/// by itself: the orders that take the node out of service (quarantine, drain, replace).
/// Their signal's stream cursor is not on disk either, so a restart reads the signal again and
/// decides the same order, which the control plane carries out idempotently. Those run at
/// once; every other order (an MPS restart, a reboot, a task stop) waits here until the state
/// is saved. Unwritten inputs and records wait in the journals' memory, in order (bounded by
/// [`journal::MAX_PENDING`]), and are written first when the disk takes them again; the log
/// says once which inputs wait, and again how many were written late or dropped.
#[derive(Default)]
struct Unsaved {
    /// Why the last commit failed; `None` while journaling works.
    failing: Option<String>,
    /// Orders waiting for their state to be saved.
    held: Vec<Order>,
    /// The inputs of this batch (sequence number and signal), for the log if it fails.
    batch: Vec<String>,
    /// Inputs journaled late so far, and when the last reminder was logged.
    waiting: usize,
    reminded: Option<std::time::Instant>,
    /// The self-fault or its recovery, stepped with the next batch.
    say: Vec<Observation>,
}

/// The self-fault component of a journal or state that cannot be written.
pub const JOURNAL_COMPONENT: &str = "journal";

/// The orders that run while the state cannot be saved (see [`Unsaved`]).
fn runs_unsaved(order: &Order) -> bool {
    matches!(
        order.command,
        crate::model::Command::Quarantine
            | crate::model::Command::Drain { .. }
            | crate::model::Command::Replace
    )
}

/// At most this many inputs are stepped between two commits: one write and one fsync of each
/// journal and one state write per batch, so a storm costs one disk round per batch instead
/// of one per input, and the delay a batch adds is bounded.
pub const BATCH_MAX: usize = 1024;
/// Capacity of the probes' channel (a full channel makes probes wait; the kernel log and MPS
/// logs are re-read from their cursors, nothing is dropped).
const CHANNEL: usize = 8 * 1024;
/// At most this many observations wait in the supervisor, taken off the channel but not yet
/// stepped ([`Pending`]): a fatal signal overtakes up to this many (plus [`CHANNEL`]) others;
/// beyond them the probes wait, which bounds memory (a few hundred bytes each).
pub const PENDING_MAX: usize = 64 * 1024;
/// How long one batch of non-fatal observations may take to step: a fatal signal that
/// arrives meanwhile waits at most this (and one commit) before it is stepped.
const STEP_BUDGET: Duration = Duration::from_millis(20);
/// At most this many unapplied inputs are replayed at start (a crash leaves one batch).
const REPLAY_MAX: usize = 16 * BATCH_MAX;
/// How long a stop asked for while the supervisor starts waits for the start to end (then
/// stops gracefully, the state saved) before it leaves the start behind.
const START_GRACE: Duration = Duration::from_secs(2);

impl Supervisor {
    pub fn new(cfg: Config, mut policy: Policy, executor: Arc<dyn Executor>) -> Self {
        if cfg.dry_run {
            policy.observe_only = true;
        }
        // The operator's choices for AWS-planned disruptions travel with the policy.
        policy.planned = cfg.planned.rules();
        Supervisor {
            cfg,
            policy,
            executor,
            sources: Vec::new(),
            metrics: None,
            gpu_signal: None,
            clock: SystemClock::shared(),
            opening: Opening::default(),
        }
    }

    /// How the start opens the state (see [`Opening`]).
    pub fn opening(&mut self, opening: Opening) {
        self.opening = opening;
    }

    /// Stamps inputs with `clock` instead of the system's (a test's clock follows tokio's
    /// paused time, so deadlines expire in virtual time).
    pub fn with_clock(&mut self, clock: SharedClock) {
        self.clock = clock;
    }

    /// Notifies `wake` at every GPU signal (a finding about a GPU or the GPU count, from any
    /// probe but the ECS GPU view itself), so that probe reads ECS's view again after it.
    pub fn notify_gpu_signals(&mut self, wake: Arc<tokio::sync::Notify>) {
        self.gpu_signal = Some(wake);
    }

    /// Keeps `metrics` up to date with every engine step.
    pub fn with_metrics(&mut self, metrics: Arc<Metrics>) {
        self.metrics = Some(metrics);
    }

    pub fn add_source(&mut self, source: Box<dyn Source>) {
        self.sources.push(source);
    }

    /// Runs until `shutdown` is cancelled. `ready` is called once the first state is saved.
    pub async fn run(
        self,
        shutdown: CancellationToken,
        ready: impl FnOnce(),
    ) -> Result<(), SupervisorError> {
        let capabilities = self.executor.capabilities();
        // The start (state, journal replay) runs off the runtime's threads, so a SIGTERM
        // that arrives meanwhile is answered at once: nothing was handed out yet, and what the
        // start wrote is crash-safe like every write of the journal and the state.
        let starting = tokio::task::spawn_blocking(move || {
            Keeper::start(
                self.cfg,
                self.policy,
                self.metrics,
                self.gpu_signal,
                self.clock,
                capabilities,
                self.opening,
            )
        });
        let Some((mut engine, boot_read)) = started_or_stopped(starting, &shutdown).await? else {
            return Ok(());
        };
        let cfg = engine.cfg.clone();
        let (obs_tx, mut obs_rx) = mpsc::channel::<Observation>(CHANNEL);
        let (out_tx, mut out_rx) = mpsc::channel::<Outcome>(64);
        let mut sources = JoinSet::new();
        // Each source resumes after what the journal holds (the state's committed cursors),
        // with the one reading of this boot's id.
        let resume = crate::model::Resume::new(engine.state.delivery.clone()).with_boot(boot_read);
        for s in self.sources {
            tracing::info!(source = s.name(), "starting probe");
            sources.spawn(s.run(obs_tx.clone(), shutdown.child_token(), resume.clone()));
        }
        drop(obs_tx);

        let mut orders = JoinSet::new();
        // Orders in flight when the supervisor last stopped: hand them over again.
        let resumed: Vec<Order> = engine.state.orders.in_flight.values().cloned().collect();
        for order in resumed {
            tracing::warn!(action_id = %order.id, incident_id = %order.incident, action = order.command.name(), "resuming order left in flight");
            dispatch(&mut orders, &self.executor, &out_tx, order);
        }
        ready();

        let mut tick = tokio::time::interval(cfg.tick_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut probes_open = true;
        let mut pending = Pending::default();
        let mut pace = Pace::default();
        let mut gate = drill_gate::Gate::new(&cfg);
        loop {
            let mut batch = Batch::default();
            if pending.is_empty() {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    o = obs_rx.recv(), if probes_open => match o {
                        Some(o) => pending.push(o, &engine.policy),
                        None => { probes_open = false; continue; }
                    },
                    Some(outcome) = out_rx.recv() => batch.outcomes.push(outcome),
                    _ = tick.tick() => tick_batch(&mut batch, &cfg, &mut gate),
                    Some(_) = orders.join_next(), if !orders.is_empty() => continue,
                }
            } else {
                // Observations are waiting: look at shutdown and the tick without waiting.
                if shutdown.is_cancelled() {
                    break;
                }
                tokio::select! {
                    biased;
                    _ = tick.tick() => tick_batch(&mut batch, &cfg, &mut gate),
                    _ = std::future::ready(()) => {}
                }
                while orders.try_join_next().is_some() {}
            }
            // Whatever else is waiting is taken off the channel (up to `PENDING_MAX`), so
            // a fatal signal behind a storm is seen now, not after the storm is stepped.
            probes_open &= pending.take_from(&mut obs_rx, &engine.policy);
            while let Ok(outcome) = out_rx.try_recv() {
                batch.outcomes.push(outcome);
            }
            batch.observations = pending.next_batch(&engine.state.delivery, pace.chunk());
            let stepped = batch.observations.len();
            let t0 = std::time::Instant::now();
            for order in engine.handle_batch(batch)? {
                dispatch(&mut orders, &self.executor, &out_tx, order);
            }
            for record in engine.observed.drain(..) {
                self.executor.observe(&record);
            }
            pace.took(stepped, t0.elapsed());
        }

        engine
            .stop(&mut pending, &mut obs_rx, &mut out_rx, &mut orders)
            .await?;
        sources.shutdown().await;
        if let Some(why) = &engine.unsaved.failing {
            // The last saved state stays: the next start replays what the journal holds past
            // it, and the streams are read again from its cursors.
            tracing::error!(
                component = JOURNAL_COMPONENT,
                inputs_not_journaled = engine.inputs.pending_lines(),
                records_not_journaled = engine.incidents.pending_lines(),
                "gpu-medic supervisor stopped with the journal failing ({why}); the last saved state is kept"
            );
            return Ok(());
        }
        journal::save_state(&cfg.state_path(), &engine.state)?;
        tracing::info!("gpu-medic supervisor stopped; state saved");
        Ok(())
    }
}

/// The start's end, or `None` when a stop asked for meanwhile leaves it behind. An ordinary
/// start ends within moments: it is waited for ([`START_GRACE`]), and the stop that follows is
/// the graceful one (state saved). One that does not (a huge journal, a stuck disk) is left;
/// nothing was handed out yet.
async fn started_or_stopped(
    mut starting: tokio::task::JoinHandle<Result<(Keeper, String), SupervisorError>>,
    shutdown: &CancellationToken,
) -> Result<Option<(Keeper, String)>, SupervisorError> {
    let started = tokio::select! {
        _ = shutdown.cancelled() => match tokio::time::timeout(START_GRACE, &mut starting).await {
            Ok(started) => started,
            Err(_) => {
                tracing::info!("gpu-medic supervisor stopped while starting; nothing was ordered");
                return Ok(None);
            }
        },
        started = &mut starting => started,
    };
    match started {
        Ok(r) => r.map(Some),
        Err(e) => Err(SupervisorError::Journal(JournalError::Corrupt {
            path: std::path::PathBuf::new(),
            line: 0,
            message: format!("the start did not finish: {e}"),
        })),
    }
}

impl Keeper {
    /// Loads the state (or sets a bad one aside and rebuilds it from the journal), opens both
    /// journals, replays what was not applied, saves the state and steps the start: the
    /// reboots kept outside the state, this boot's id and what the remedies can do. Also
    /// returns the boot id as read, for sources.
    fn start(
        cfg: Config,
        policy: Policy,
        metrics: Option<Arc<Metrics>>,
        gpu_signal: Option<Arc<tokio::sync::Notify>>,
        clock: SharedClock,
        capabilities: crate::model::Capabilities,
        opening: Opening,
    ) -> Result<(Keeper, String), SupervisorError> {
        let started = Timestamp(clock.now_ms());
        let loaded = journal::load_state_or_set_aside(&cfg.state_path(), started, opening.newer)?;
        let lost = lost_state(&cfg, &loaded);
        let resumed_state = loaded.state.is_some() && lost.is_none();
        let (state, rebuilt) = match (loaded.state, &lost) {
            (_, Some(_)) => {
                let (s, r) = journal::rebuild_from_journal(
                    &cfg.incidents_path(),
                    started,
                    policy.deadlines.reboot,
                    journal::read_cap(cfg.journal.max_file_size_mib),
                )?;
                (s, Some(r))
            }
            (Some(s), None) => (s, None),
            (None, None) => (State::default(), None),
        };
        let rotation = journal::Rotation {
            max_bytes: cfg.journal.max_file_size_mib.saturating_mul(1024 * 1024),
            keep: cfg.journal.keep_files,
        };
        let (kept, ledger) = kept_reboots(&cfg, opening.tagged);
        let mut engine = Keeper {
            incidents: JsonlWriter::open_rotating(&cfg.incidents_path(), rotation)?,
            inputs: JsonlWriter::open_rotating(&cfg.inputs_path(), rotation)?,
            state,
            policy,
            cfg: cfg.clone(),
            metrics,
            gpu_signal,
            clock,
            seq: 0,
            unsaved: Unsaved::default(),
            ledger,
            observed: Vec::new(),
        };
        engine.recover(resumed_state)?;
        match journal::save_state(&cfg.state_path(), &engine.state) {
            Ok(()) => {}
            // A full disk at start: gpu-medic starts all the same, with the journal's
            // self-fault, so a node that fails while its disk is full is still healed; the
            // state is saved with the first commit the disk takes.
            Err(e) if e.is_out_of_space() => engine.journaling_failed(&e),
            Err(e) => return Err(e.into()),
        }
        // The kernel's boot id, stepped before any order is resumed: a reboot the engine
        // ordered that has happened is finished here, never handed out again. The reboots
        // kept outside the state before it, so the ladder counts them from the first fault.
        let (boot, boot_read) = boot_id(&cfg, capabilities.reboot);
        engine.handle_batch(Batch {
            reboots: kept,
            started: Some(capabilities),
            boot,
            ..Batch::default()
        })?;
        if let Some(lost) = lost {
            report_lost_state(&mut engine, &cfg, &lost, rebuilt.as_ref())?;
        }
        if let Some(writer) = loaded.newer {
            report_newer_state(&mut engine, &cfg, &writer)?;
        }
        tracing::info!(
            policy = %engine.policy.origin,
            observe_only = engine.policy.observe_only,
            state_dir = %cfg.state_dir.display(),
            node_phase = engine.state.node.phase.as_str(),
            "gpu-medic supervisor started"
        );

        Ok((engine, boot_read))
    }

    /// Shutting down: what the probes already handed over is journaled; orders in flight get
    /// `SHUTDOWN_GRACE` to reach a safe point (the rest resume on the next start).
    async fn stop(
        &mut self,
        pending: &mut Pending,
        obs_rx: &mut mpsc::Receiver<Observation>,
        out_rx: &mut mpsc::Receiver<Outcome>,
        orders: &mut JoinSet<()>,
    ) -> Result<(), SupervisorError> {
        tracing::info!(
            in_flight = orders.len(),
            "shutting down: letting orders in flight reach a safe point"
        );
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        // What the probes already handed over is journaled before stopping; what they had not
        // is read again after the restart from their cursors.
        obs_rx.close();
        loop {
            pending.take_from(obs_rx, &self.policy);
            let batch = Batch {
                observations: pending.next_batch(&self.state.delivery, BATCH_MAX),
                ..Batch::default()
            };
            if batch.observations.is_empty() {
                break;
            }
            for order in self.handle_batch(batch)? {
                tracing::info!(action_id = %order.id, action = order.command.name(), "order deferred to next start");
            }
        }
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        while !orders.is_empty() {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(in_flight = orders.len(), "orders still in flight at shutdown; they resume on next start");
                    orders.abort_all();
                    break;
                }
                Some(outcome) = out_rx.recv() => {
                    let batch = Batch { outcomes: vec![outcome], ..Batch::default() };
                    for order in self.handle_batch(batch)? {
                        // Follow-up steps wait for the next start; they are in state.json.
                        tracing::info!(action_id = %order.id, action = order.command.name(), "follow-up order deferred to next start");
                    }
                }
                _ = orders.join_next() => {}
            }
        }
        let mut rest = Batch::default();
        while let Ok(outcome) = out_rx.try_recv() {
            rest.outcomes.push(outcome);
        }
        self.handle_batch(rest)?;
        Ok(())
    }
}

/// What arrived while the engine was busy, stepped together and committed once. Order within
/// a batch: operator requests, then observations whose rule takes the node out of service
/// (drain, replace: XID 79, a lost GPU, ...), then the other observations in arrival order,
/// then outcomes, then the tick. A fatal signal thus never waits behind lower classes for more
/// than the batch being stepped when it arrived. Outcomes come after the observations: a probe
/// result read before an order finished (an `mps-down` from before the restart) must not be
/// judged after the outcome, as a new fault.
#[derive(Default)]
struct Batch {
    /// The reboots kept outside the state, and where they were read (first, once, at start).
    reboots: Option<Kept>,
    /// The remedies this supervisor has (once, at start).
    started: Option<crate::model::Capabilities>,
    /// The kernel's boot id (right after `started`, once, at start).
    boot: Option<String>,
    requests: Vec<crate::model::OperatorRequest>,
    outcomes: Vec<Outcome>,
    observations: Vec<Observation>,
    tick: bool,
}

impl Batch {
    /// The inputs in stepping order, and the observations' stream positions in arrival
    /// order (see [`Keeper::handle_batch`]).
    fn into_inputs(self, policy: &Policy) -> (Vec<Input>, Vec<crate::model::Cursor>) {
        let arrived: Vec<crate::model::Cursor> = self
            .observations
            .iter()
            .filter_map(|o| o.cursor.clone())
            .collect();
        let (first, rest): (Vec<Observation>, Vec<Observation>) = self
            .observations
            .into_iter()
            .partition(|o| policy.is_fatal(&o.signal, o.value));
        let started = self
            .started
            .map(|capabilities| Input::Started { capabilities });
        let reboots = self
            .reboots
            .map(|(reboots, from)| Input::Reboots { reboots, from });
        let inputs = reboots
            .into_iter()
            .chain(started)
            .chain(self.boot.map(|id| Input::Boot { id }))
            .chain(self.requests.into_iter().map(Input::Operator))
            .chain(first.into_iter().map(Input::Observation))
            .chain(rest.into_iter().map(Input::Observation))
            .chain(self.outcomes.into_iter().map(Input::Outcome))
            .chain(self.tick.then_some(Input::Tick))
            .collect();
        (inputs, arrived)
    }
}

/// The tick's part of a batch: the watchdog ping and the operator's requests.
/// A drill request is the daemon's to allow, by its own config (or the instance tag), and
/// gets only what a drill may do ([`drill_gate`]).
fn tick_batch(batch: &mut Batch, cfg: &Config, gate: &mut drill_gate::Gate) {
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
    for request in gate.admit(journal::take_requests(&cfg.state_dir)) {
        tracing::warn!(request = ?request, "operator request");
        batch.requests.push(request);
    }
    batch.tick = true;
}

/// Observations taken off the probes' channel and not yet stepped: the fatal ones (by the
/// policy, as [`Batch`] orders them) apart, so each is stepped in a batch of its own before
/// the storm it arrived with. At most [`PENDING_MAX`].
#[derive(Default)]
struct Pending {
    fatal: std::collections::VecDeque<Observation>,
    /// In arrival order.
    other: std::collections::VecDeque<Observation>,
}

impl Pending {
    fn is_empty(&self) -> bool {
        self.fatal.is_empty() && self.other.is_empty()
    }

    fn len(&self) -> usize {
        self.fatal.len() + self.other.len()
    }

    fn push(&mut self, o: Observation, policy: &Policy) {
        if policy.is_fatal(&o.signal, o.value) {
            self.fatal.push_back(o);
        } else {
            self.other.push_back(o);
        }
    }

    /// Takes what the channel holds, up to [`PENDING_MAX`] waiting. False once every
    /// probe is gone and the channel is empty.
    fn take_from(&mut self, rx: &mut mpsc::Receiver<Observation>, policy: &Policy) -> bool {
        while self.len() < PENDING_MAX {
            match rx.try_recv() {
                Ok(o) => self.push(o, policy),
                Err(mpsc::error::TryRecvError::Empty) => return true,
                Err(mpsc::error::TryRecvError::Disconnected) => return false,
            }
        }
        true
    }

    /// The next batch: every fatal signal waiting (up to [`BATCH_MAX`]) on its own, else up
    /// to `chunk` others in arrival order. A fatal record stepped before earlier records of
    /// its stream that are still waiting is marked as journaled ahead (its stream's cursor
    /// does not move with it, see [`crate::model::cursor::Delivery::ahead`]); when no more
    /// can be, it waits in its stream's order instead.
    fn next_batch(&mut self, delivery: &crate::model::Delivery, chunk: usize) -> Vec<Observation> {
        if self.fatal.is_empty() {
            let n = chunk.clamp(1, BATCH_MAX).min(self.other.len());
            return self.other.drain(..n).collect();
        }
        let mut room = delivery.ahead_left();
        // The lowest position waiting per stream, found in one pass: whether a fatal record
        // has earlier records of its stream still waiting is then one lookup, however many
        // fatal records a storm brings.
        let mut lowest: std::collections::HashMap<&crate::model::StreamId, u64> =
            std::collections::HashMap::new();
        for c in self.other.iter().filter_map(|e| e.cursor.as_ref()) {
            lowest
                .entry(&c.stream)
                .and_modify(|p| *p = (*p).min(c.pos))
                .or_insert(c.pos);
        }
        let mut out = Vec::new();
        let mut wait = Vec::new();
        while out.len() < BATCH_MAX
            && let Some(mut o) = self.fatal.pop_front()
        {
            let earlier = o
                .cursor
                .as_ref()
                .filter(|c| c.token.is_none())
                .is_some_and(|c| lowest.get(&c.stream).is_some_and(|p| *p < c.pos));
            match (earlier, o.cursor.as_mut()) {
                (true, Some(c)) if room > 0 => {
                    c.ahead = true;
                    room -= 1;
                    out.push(o);
                }
                (true, _) => wait.push(o),
                _ => out.push(o),
            }
        }
        // No room to journal these ahead: each waits in its stream's order, after the last
        // earlier record of its stream (rare: more than `MAX_AHEAD` fatal records at once).
        for o in wait {
            let at = o.cursor.as_ref().and_then(|c| {
                self.other.iter().rposition(|e| {
                    e.cursor
                        .as_ref()
                        .is_some_and(|ec| ec.stream == c.stream && ec.pos < c.pos)
                })
            });
            match at {
                Some(i) => self.other.insert(i + 1, o),
                None => self.other.push_back(o),
            }
        }
        if out.is_empty() {
            let n = chunk.clamp(1, BATCH_MAX).min(self.other.len());
            return self.other.drain(..n).collect();
        }
        out
    }
}

/// How many non-fatal observations one batch takes: as many as step within
/// [`STEP_BUDGET`] at the pace of the last batches.
struct Pace {
    /// Average stepping time per observation, in nanoseconds.
    per_input_ns: u64,
}

impl Default for Pace {
    fn default() -> Pace {
        Pace {
            per_input_ns: 50_000,
        }
    }
}

impl Pace {
    fn chunk(&self) -> usize {
        let n = STEP_BUDGET.as_nanos() / u128::from(self.per_input_ns.max(1));
        usize::try_from(n).unwrap_or(BATCH_MAX).clamp(16, BATCH_MAX)
    }

    fn took(&mut self, inputs: usize, elapsed: Duration) {
        if inputs < 16 {
            return;
        }
        let per = u64::try_from(elapsed.as_nanos() / inputs as u128).unwrap_or(u64::MAX);
        self.per_input_ns = (self.per_input_ns.saturating_mul(3) / 4).saturating_add(per / 4);
    }
}

fn dispatch(
    orders: &mut JoinSet<()>,
    executor: &Arc<dyn Executor>,
    out_tx: &mpsc::Sender<Outcome>,
    order: Order,
) {
    let executor = executor.clone();
    let out_tx = out_tx.clone();
    orders.spawn(async move {
        let outcome = executor.execute(order).await;
        let _ = out_tx.send(outcome).await;
    });
}

impl Keeper {
    /// Brings the saved state up to the journal: inputs journaled after the state was last
    /// saved (a crash between the two writes of a batch) are stepped again with their own
    /// time stamps; their records are appended unless the journal already ends with them.
    /// Orders they start are in the state and resume like any order in flight.
    fn recover(&mut self, resumed_state: bool) -> Result<(), SupervisorError> {
        let applied = self.state.delivery.applied;
        let (tail, last) = journal::inputs_after(self.inputs.path(), applied, REPLAY_MAX)?;
        self.seq = last.max(applied);
        if !resumed_state {
            // A first start (or a state set aside): the journal is history, not a backlog.
            self.state.delivery.applied = self.seq;
            return Ok(());
        }
        if tail.is_empty() {
            return Ok(());
        }
        tracing::warn!(
            inputs = tail.len(),
            from_seq = applied + 1,
            "replaying inputs journaled after the last saved state"
        );
        let mut records = Vec::new();
        for entry in tail {
            let input = entry.stamped.input;
            let cursor = match &input {
                Input::Observation(o) => o.cursor.clone(),
                _ => None,
            };
            let (mut state, actions) =
                engine::step(&self.state, input, entry.stamped.at, &self.policy);
            state.delivery.applied = state.delivery.applied.max(entry.seq);
            if let Some(c) = cursor {
                state.delivery.advance_cursor(&c, entry.stamped.at);
            }
            self.state = state;
            records.extend(actions.into_iter().filter_map(|a| match a {
                Action::Log(r) => Some(r),
                Action::Execute(_) => None,
            }));
        }
        let journaled: Vec<Record> = journal::last_records(self.incidents.path(), records.len())?;
        let done = (0..=records.len().min(journaled.len()))
            .rev()
            .find(|&j| journaled[journaled.len() - j..] == records[..j])
            .unwrap_or(0);
        for r in &records[done..] {
            trace_record(r);
            self.incidents.write(r)?;
        }
        self.incidents.commit()?;
        Ok(())
    }

    /// Steps every input of a batch, then commits: the inputs (one fsync), the incident
    /// records (one fsync), the state (one atomic write), and only then hands out the orders.
    /// A source's cursor moves with the state, so a restart reads again exactly what did not
    /// reach the journal. An observation at or before its source's cursor *as the batch
    /// began* is a duplicate (read again after a restart) and is dropped, and so is a second
    /// copy of one record within the batch: each record is judged by its own position, never
    /// by its neighbours'. Fatal signals are stepped first, but the cursors move only after
    /// the whole batch is stepped, in arrival order: a batch holds every record of a stream
    /// between its first and its last (a source hands them over in order), so the cursor
    /// never passes a record that is not in this commit.
    fn handle_batch(&mut self, mut batch: Batch) -> Result<Vec<Order>, SupervisorError> {
        if self.unsaved.failing.is_none() {
            for j in [
                self.inputs.rotate_if_due().map(|_| ()),
                self.incidents.rotate_if_due().map(|_| ()),
            ] {
                if let Err(e) = j {
                    tracing::warn!("journal rotation failed (tried again later): {e}");
                }
            }
        }
        batch.observations.splice(0..0, self.unsaved.say.drain(..));
        let mut orders = Vec::new();
        // While journaling fails, every batch (a tick at the latest) tries again.
        let mut dirty = self.unsaved.failing.is_some();
        let (inputs, arrived) = batch.into_inputs(&self.policy);
        let mut in_batch: std::collections::HashSet<(crate::model::StreamId, u64)> =
            std::collections::HashSet::new();
        for mut input in inputs {
            // Bounded before it is looked at or journaled (the engine bounds it again, the
            // same way, for every caller).
            input.bound();
            let cursor = match &input {
                Input::Observation(o) => o.cursor.clone(),
                _ => None,
            };
            if let Some(c) = &cursor
                && c.token.is_none()
                && (self.state.delivery.seen_cursor(c)
                    || !in_batch.insert((c.stream.clone(), c.pos)))
            {
                tracing::debug!(stream = %c.stream, pos = c.pos, "duplicate after restart dropped");
                continue;
            }
            let now = Timestamp(self.clock.now_ms());
            let (mut state, actions) = engine::step(&self.state, input.clone(), now, &self.policy);
            if let Some(m) = &self.metrics {
                m.record(&input, &actions, &state, &self.policy);
            }
            if let (Some(wake), Input::Observation(o)) = (&self.gpu_signal, &input)
                && is_gpu_signal(o, &self.policy)
            {
                wake.notify_one();
            }
            // An input that changes nothing (an MPS probe that answered, a quiet tick) is not
            // recorded: the engine is a pure function of state and input, so leaving it out of
            // inputs.jsonl changes no replay. A record read from a stream (a kernel-log XID
            // the policy ignores) is journaled all the same: every record read is in the
            // journal exactly once.
            if !actions.is_empty() || state != self.state || cursor.is_some() {
                self.seq = next_seq(self.seq, self.inputs.path())?;
                if let Input::Observation(o) = &input {
                    self.unsaved
                        .batch
                        .push(format!("#{} {}", self.seq, o.signal));
                }
                self.inputs.write(&journal::JournaledInput {
                    seq: self.seq,
                    stamped: StampedInput { at: now, input },
                })?;
                state.delivery.applied = self.seq;
                dirty = true;
            }
            self.state = state;
            for action in actions {
                match action {
                    Action::Log(record) => {
                        trace_record(&record);
                        self.incidents.write(&record)?;
                        if crate::export::detail_type(&record.event)
                            == Some(crate::export::APPLICATION_FAULT)
                        {
                            self.observed.push(record);
                        }
                    }
                    Action::Execute(order) => orders.push(order),
                }
            }
        }
        if !arrived.is_empty() {
            let now = Timestamp(self.clock.now_ms());
            for c in &arrived {
                self.state.delivery.advance_cursor(c, now);
            }
            dirty = true;
        }
        if dirty {
            return self.commit(orders);
        }
        self.unsaved.batch.clear();
        Ok(orders)
    }

    /// Commits the batch (inputs, records, state) and hands out its orders; a commit that
    /// fails is a self-fault, and only the orders that may run unsaved are handed out (see
    /// [`Unsaved`]).
    fn commit(&mut self, mut orders: Vec<Order>) -> Result<Vec<Order>, SupervisorError> {
        // State before orders: an order is never started that a restart would not know
        // (while the state cannot be saved, see `Unsaved`).
        let committed = self
            .inputs
            .commit()
            .and_then(|_| self.incidents.commit())
            .and_then(|_| journal::save_state(&self.cfg.state_path(), &self.state))
            .and_then(|_| self.save_ledger());
        match committed {
            Ok(()) => {
                self.unsaved.batch.clear();
                self.journaling_resumed();
                orders.splice(0..0, self.unsaved.held.drain(..));
                Ok(orders)
            }
            Err(e) if e.is_retryable() => {
                self.journaling_failed(&e);
                self.unsaved.batch.clear();
                let (run, hold): (Vec<Order>, Vec<Order>) =
                    orders.into_iter().partition(runs_unsaved);
                for o in &run {
                    tracing::warn!(action_id = %o.id, incident_id = %o.incident, action = o.command.name(), "state not saved: this order takes the node out of service and runs anyway (a restart decides it again)");
                }
                for o in &hold {
                    tracing::warn!(action_id = %o.id, incident_id = %o.incident, action = o.command.name(), "state not saved: this order waits until it is");
                }
                self.unsaved.held.extend(hold);
                Ok(run)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Writes the reboot ledger when the repair history changed since it was last written
    /// (a reboot ordered, its boot seen, its end): before the batch's orders are handed out,
    /// so a reboot is on disk, outside the state and the journal, before it is called.
    fn save_ledger(&mut self) -> Result<(), JournalError> {
        let history: &[crate::model::repair::Repair] = &self.state.repair.history;
        let unchanged = match &self.ledger {
            Some(l) => l.as_slice() == history,
            None => history.is_empty(),
        };
        if unchanged {
            return Ok(());
        }
        let files = self.cfg.files();
        files
            .save_reboots(history)
            .map_err(|e| JournalError::io(&files.reboots(), e))?;
        self.ledger = Some(history.to_vec());
        Ok(())
    }

    /// A commit failed: said once in full (why, which inputs and how many records wait), then
    /// a reminder a minute at most; the self-fault is stepped with the next batch.
    fn journaling_failed(&mut self, e: &JournalError) {
        let u = &mut self.unsaved;
        u.waiting += u.batch.len();
        let (inputs, records) = (self.inputs.pending_lines(), self.incidents.pending_lines());
        if u.failing.is_none() {
            let why = e.to_string();
            tracing::error!(
                component = JOURNAL_COMPONENT,
                inputs_waiting = inputs,
                records_waiting = records,
                "cannot write the journal or the state ({why}): healing goes on, orders that take the node out of service still run, the others wait; {inputs} input line(s) and {records} record(s) wait in memory and the state is not saved; this batch's inputs: {}",
                u.batch.join(", ")
            );
            u.say.push(
                Observation::new(crate::model::Signal::SelfFault {
                    component: JOURNAL_COMPONENT.to_string(),
                })
                .with_detail(format!(
                    "{why}; {inputs} input(s) and {records} record(s) wait in memory until the disk takes them"
                ))
                .from_source("journal"),
            );
            u.failing = Some(why);
            u.reminded = Some(std::time::Instant::now());
        } else if u
            .reminded
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(60))
        {
            tracing::warn!(
                component = JOURNAL_COMPONENT,
                inputs_waiting = inputs,
                records_waiting = records,
                "the journal still cannot be written ({e}); {inputs} input line(s) and {records} record(s) wait in memory; this batch's inputs: {}",
                u.batch.join(", ")
            );
            u.reminded = Some(std::time::Instant::now());
        } else {
            tracing::debug!(
                inputs_waiting = inputs,
                "the journal still cannot be written: {e}"
            );
        }
        let dropped = self.inputs.take_dropped() + self.incidents.take_dropped();
        if dropped > 0 {
            tracing::error!(
                component = JOURNAL_COMPONENT,
                dropped,
                "journal lines waiting too long dropped (over {} in memory)",
                crate::sys::limits::human_bytes(journal::MAX_PENDING as u64)
            );
        }
    }

    /// A commit succeeded after failing: said once, the recovery stepped with the next batch.
    fn journaling_resumed(&mut self) {
        let Some(why) = self.unsaved.failing.take() else {
            return;
        };
        let late = std::mem::take(&mut self.unsaved.waiting);
        tracing::warn!(
            component = JOURNAL_COMPONENT,
            inputs_written_late = late,
            orders_released = self.unsaved.held.len(),
            "the journal and the state are written again (they failed with: {why})"
        );
        self.unsaved.say.push(
            Observation::new(crate::model::Signal::SelfRecovered {
                component: JOURNAL_COMPONENT.to_string(),
            })
            .with_detail(format!(
                "journal and state written again; {late} input(s) written late"
            ))
            .from_source("journal"),
        );
    }
}

/// The sequence number after `seq`. Numbers read back are range-checked (at most
/// `engine::MAX_COUNTER`, far beyond any journal's life); one that cannot advance is a
/// refusal naming the journal, never a wrap or a repeat.
fn next_seq(seq: u64, inputs: &std::path::Path) -> Result<u64, crate::sys::error::JournalError> {
    seq.checked_add(1)
        .filter(|n| *n <= engine::MAX_COUNTER)
        .ok_or_else(|| crate::sys::error::JournalError::Corrupt {
            path: inputs.to_path_buf(),
            line: 0,
            message: format!("input sequence number {seq} cannot advance"),
        })
}

/// A finding about a GPU or the node's GPUs ([`Policy::is_gpu_finding`]), not raised by the
/// ECS GPU view (which would wake itself).
fn is_gpu_signal(o: &Observation, policy: &Policy) -> bool {
    o.source != crate::probe::ecs_gpus::SOURCE && policy.is_gpu_finding(o)
}

/// Emits a journal record as a structured log event with stable field names.
fn trace_record(r: &Record) {
    let incident_id = r.incident.0;
    match &r.event {
        IncidentEvent::Opened {
            observation,
            rule,
            verdict,
            reason,
        } => tracing::warn!(
            incident_id,
            signal = %observation.signal,
            gpu_index = observation.gpu.as_ref().map(|g| g.index),
            gpu_uuid = observation.gpu.as_ref().map(|g| g.uuid.as_str()),
            rule = rule.as_str(),
            action = verdict.as_str(),
            "incident opened: {reason}"
        ),
        IncidentEvent::Signal { observation } => tracing::info!(
            incident_id,
            signal = %observation.signal,
            gpu_index = observation.gpu.as_ref().map(|g| g.index),
            "signal joins incident"
        ),
        IncidentEvent::Escalated {
            verdict,
            rule,
            reason,
        } => tracing::warn!(
            incident_id,
            action = verdict.as_str(),
            rule = rule.as_str(),
            "incident escalated: {reason}"
        ),
        IncidentEvent::ActionStarted { order, dry_run } => tracing::warn!(
            incident_id,
            action_id = order.id.0,
            action = order.command.name(),
            attempt = order.attempt,
            dry_run,
            "action started"
        ),
        IncidentEvent::ActionFinished { outcome } => tracing::info!(
            incident_id,
            action_id = outcome.action.0,
            status = ?outcome.status,
            request_ids = ?outcome.request_ids,
            "action finished: {}",
            outcome.detail
        ),
        IncidentEvent::DeadlineMissed { action, escalation } => tracing::error!(
            incident_id,
            action_id = action.0,
            "deadline missed: {escalation}"
        ),
        IncidentEvent::Note { text } => tracing::info!(incident_id, "{text}"),
        IncidentEvent::Closed { state, summary } => tracing::warn!(
            incident_id,
            state = state.as_str(),
            "incident closed: {summary}"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{GpuId, Signal};
    use std::pin::Pin;

    /// Never called: the inputs below start no order. A double only because the test needs
    /// no remedy at all.
    struct NoRemedy;
    impl Executor for NoRemedy {
        fn execute(&self, _: Order) -> Pin<Box<dyn Future<Output = Outcome> + Send + '_>> {
            Box::pin(async { unreachable!("no order is started in this test") })
        }
    }

    fn shipped_policy() -> crate::policy::Policy {
        crate::policy::Policy::parse(
            std::path::Path::new("default.toml"),
            include_str!("../../policies/default.toml"),
        )
        .unwrap()
    }

    fn xid_input(seq: u64, pos: u64) -> journal::JournaledInput {
        let obs = Observation::new(Signal::xid(13))
            .on_gpu(GpuId::index_only(0))
            .from_source("kmsg")
            .at_cursor("kmsg:boot", pos);
        journal::JournaledInput {
            seq,
            stamped: StampedInput {
                at: Timestamp(1_700_000_000_000 + seq),
                input: Input::Observation(obs),
            },
        }
    }

    async fn start_and_stop(cfg: &Config) {
        let policy = shipped_policy();
        let sup = Supervisor::new(cfg.clone(), policy, Arc::new(NoRemedy));
        let stop = CancellationToken::new();
        let s2 = stop.clone();
        sup.run(stop, move || s2.cancel()).await.unwrap();
    }

    /// What wakes the ECS GPU view: a finding about a GPU or the GPU count, never a
    /// routine reading, a node-level signal, or the view's own findings.
    #[test]
    fn gpu_findings_wake_the_ecs_gpu_view_and_nothing_else_does() {
        let policy = shipped_policy();
        let gpu = || GpuId::index_only(1);
        let wakes = [
            Observation::new(Signal::xid(13)).on_gpu(gpu()),
            Observation::new(Signal::GpuLost).on_gpu(gpu()),
            Observation::new(Signal::DeviceCountMismatch).with_value(3),
            Observation::new(Signal::Thermal)
                .on_gpu(gpu())
                .with_value(90),
        ];
        for o in &wakes {
            assert!(is_gpu_signal(o, &policy), "{o:?}");
        }
        let quiet = [
            // A reading: 81 °C is below every thermal rule.
            Observation::new(Signal::Thermal)
                .on_gpu(gpu())
                .with_value(81),
            Observation::new(Signal::MpsDown),
            Observation::new(Signal::StateDiskFull).with_value(99),
            Observation::new(Signal::EcsGpuMissing)
                .on_gpu(gpu())
                .from_source(crate::probe::ecs_gpus::SOURCE),
        ];
        for o in &quiet {
            assert!(!is_gpu_signal(o, &policy), "{o:?}");
        }
    }

    /// A crash between the journal and the state write of a batch: the next start steps the
    /// journaled inputs past the state again, appends the records the journal lacks (not
    /// those it has), and moves the source's cursor, so nothing is lost or doubled.
    #[tokio::test]
    async fn inputs_journaled_after_the_last_state_are_replayed_once() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config::parse(
            &dir.path().join("config.toml"),
            "state_dir = \"state\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
        )
        .unwrap();
        journal::save_state(&cfg.state_path(), &State::default()).unwrap();
        let mut inputs = JsonlWriter::open(&cfg.inputs_path()).unwrap();
        inputs.append(&xid_input(1, 41)).unwrap();
        inputs.append(&xid_input(2, 42)).unwrap();
        // The first input's records reached the journal before the crash, the second's not.
        let (_, first) = engine::step(
            &State::default(),
            xid_input(1, 41).stamped.input,
            xid_input(1, 41).stamped.at,
            &crate::policy::Policy::parse(
                std::path::Path::new("default.toml"),
                include_str!("../../policies/default.toml"),
            )
            .unwrap(),
        );
        let mut incidents = JsonlWriter::<Record>::open(&cfg.incidents_path()).unwrap();
        for a in first {
            if let Action::Log(r) = a {
                incidents.append(&r).unwrap();
            }
        }
        let before = journal::read_jsonl::<Record>(&cfg.incidents_path())
            .unwrap()
            .0
            .len();
        assert!(before >= 2, "opened and closed");

        start_and_stop(&cfg).await;
        let state = journal::load_state(&cfg.state_path()).unwrap().unwrap();
        // 2, or 3 when the first tick (stamped now, years after the inputs) pruned windows.
        assert!(state.delivery.applied >= 2, "{:?}", state.delivery);
        assert!(state.delivery.seen(&"kmsg:boot".into(), 42));
        let after = journal::read_jsonl::<Record>(&cfg.incidents_path())
            .unwrap()
            .0;
        // The second XID repeats the first (a log-only class): it adds no record, and the
        // first's records are not written twice.
        assert_eq!(after.len(), before, "{after:?}");
        assert_eq!(
            state
                .incidents
                .recent_logs
                .values()
                .map(|r| r.repeats)
                .sum::<u32>(),
            1
        );

        // A second start has nothing to replay.
        start_and_stop(&cfg).await;
        let again = journal::load_state(&cfg.state_path()).unwrap().unwrap();
        assert_eq!(again.delivery.cursors, state.delivery.cursors);
        assert_eq!(
            journal::read_jsonl::<Record>(&cfg.incidents_path())
                .unwrap()
                .0
                .len(),
            before
        );
    }

    /// A state that cannot be saved (here a directory where its temp file goes; a full disk
    /// in tests/full_disk.rs) is no error: the orders that take the node out of service are
    /// handed out, every other order waits, and all of them are out once the state saves.
    #[test]
    fn orders_that_take_the_node_out_of_service_run_while_the_state_cannot_be_saved() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config::parse(
            &dir.path().join("config.toml"),
            "state_dir = \"state\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
        )
        .unwrap();
        let caps = crate::model::Capabilities::default();
        let (mut keeper, _) = Keeper::start(
            cfg.clone(),
            shipped_policy(),
            None,
            None,
            SystemClock::shared(),
            caps,
            Opening::default(),
        )
        .unwrap();
        let blocker = crate::sys::fs::temp_path(&cfg.state_path());
        std::fs::create_dir_all(&blocker).unwrap();
        let gpu = GpuId::index_only(0);
        let batch = Batch {
            observations: vec![
                Observation::new(Signal::xid(79))
                    .on_gpu(gpu.clone())
                    .with_pids(vec![7]),
                Observation::new(Signal::MpsDown).with_value(100),
            ],
            ..Batch::default()
        };
        let run = keeper.handle_batch(batch).unwrap();
        assert!(!run.is_empty(), "the XID 79's orders run");
        assert!(run.iter().all(runs_unsaved), "{run:?}");
        assert!(keeper.unsaved.failing.is_some());
        let held = keeper.unsaved.held.len();
        std::fs::remove_dir(&blocker).unwrap();
        let released = keeper
            .handle_batch(Batch {
                tick: true,
                ..Batch::default()
            })
            .unwrap();
        assert!(keeper.unsaved.failing.is_none());
        assert!(released.len() >= held, "{released:?}");
        assert!(keeper.unsaved.held.is_empty());
        // The self-fault was stepped with that batch; its recovery goes with the next.
        assert!(
            keeper
                .state
                .incidents
                .open
                .values()
                .any(|i| i.rule == "self-fault"),
            "{:?}",
            keeper.state.incidents.open
        );
        assert!(matches!(
            &keeper.unsaved.say[..],
            [o] if matches!(o.signal, Signal::SelfRecovered { .. })
        ));
        let saved = journal::load_state(&cfg.state_path()).unwrap().unwrap();
        assert_eq!(saved.delivery.applied, keeper.state.delivery.applied);
    }

    /// Fatal first: in a batch, observations whose rule drains or replaces are stepped
    /// before the rest (in arrival order otherwise), outcomes after them.
    #[test]
    fn a_batch_steps_fatal_signals_before_lower_classes() {
        let policy = shipped_policy();
        let x = |code| Observation::new(Signal::xid(code)).on_gpu(GpuId::index_only(0));
        let batch = Batch {
            observations: vec![x(13), x(100_001), x(79), x(31), x(48)],
            outcomes: vec![Outcome {
                action: crate::model::ActionId(1),
                status: crate::model::OutcomeStatus::Done,
                detail: String::new(),
                request_ids: vec![],
                evidence: None,
                fleet: None,
                diagnosis: None,
            }],
            tick: true,
            ..Batch::default()
        };
        let order: Vec<String> = batch
            .into_inputs(&policy)
            .0
            .into_iter()
            .map(|i| match i {
                Input::Observation(o) => o.signal.to_string(),
                Input::Tick => "tick".into(),
                Input::Outcome(_) => "outcome".into(),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(
            order,
            [
                "xid 79",
                "xid 48",
                "xid 13",
                "xid 100001",
                "xid 31",
                "outcome",
                "tick"
            ]
        );
    }

    /// A fatal signal behind a storm of one stream is stepped first, journaled ahead of the
    /// storm's records; a crash right after leaves the storm to be read again, which
    /// journals its records and drops the 79 as already journaled: no record twice.
    #[test]
    fn a_fatal_signal_overtakes_a_storm_and_a_crash_journals_every_record_once() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = Config::parse(
            &dir.path().join("config.toml"),
            "state_dir = \"state\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
        )
        .unwrap();
        let stream = "kmsg:boot";
        let storm = |n: u64| -> Vec<Observation> {
            (0..n)
                .map(|i| {
                    Observation::new(Signal::xid(100_000 + i as u32))
                        .on_gpu(GpuId::index_only((i % 4) as u32))
                        .from_source("kmsg")
                        .at_cursor(stream, 100 + i)
                })
                .collect()
        };
        let fatal = Observation::new(Signal::xid(79))
            .on_gpu(GpuId::index_only(1))
            .from_source("kmsg")
            .at_cursor(stream, 100 + 3000);
        let start = || {
            Keeper::start(
                cfg.clone(),
                shipped_policy(),
                None,
                None,
                SystemClock::shared(),
                crate::model::Capabilities::default(),
                Opening::default(),
            )
            .unwrap()
            .0
        };
        let read = || {
            let mut pending = Pending::default();
            let policy = shipped_policy();
            for o in storm(3000).into_iter().chain([fatal.clone()]) {
                pending.push(o, &policy);
            }
            pending
        };

        let mut keeper = start();
        let mut pending = read();
        let first = pending.next_batch(&keeper.state.delivery, 256);
        assert_eq!(first.len(), 1, "the 79 alone, before the storm");
        assert!(first[0].cursor.as_ref().unwrap().ahead);
        keeper
            .handle_batch(Batch {
                observations: first,
                ..Batch::default()
            })
            .unwrap();
        let d = &keeper.state.delivery;
        assert!(d.seen(&stream.into(), 3100), "the 79 is journaled");
        assert!(
            !d.seen(&stream.into(), 100),
            "the storm is not: its cursor did not move"
        );
        // A crash: the storm was never stepped. The next start reads everything again.
        drop(keeper);
        let mut keeper = start();
        let mut pending = read();
        while !pending.is_empty() {
            let observations = pending.next_batch(&keeper.state.delivery, 256);
            keeper
                .handle_batch(Batch {
                    observations,
                    ..Batch::default()
                })
                .unwrap();
        }
        let d = &keeper.state.delivery;
        assert!(
            d.seen(&stream.into(), 3099) && d.seen(&stream.into(), 3100),
            "{d:?}"
        );
        assert!(
            d.ahead.len() <= 1,
            "forgotten once a later record passes it: {d:?}"
        );
        let journaled = journal::read_jsonl::<journal::JournaledInput>(&cfg.inputs_path())
            .unwrap()
            .0;
        let mut positions: Vec<u64> = journaled
            .iter()
            .filter_map(|e| match &e.stamped.input {
                Input::Observation(o) => o.cursor.as_ref().map(|c| c.pos),
                _ => None,
            })
            .collect();
        // (A repeat that changes nothing is not journaled, see `handle_batch`.)
        let n = positions.len();
        assert!(n > 1000, "{n}");
        assert_eq!(
            positions.iter().filter(|p| **p == 3100).count(),
            1,
            "the 79 once"
        );
        positions.sort_unstable();
        positions.dedup();
        assert_eq!(positions.len(), n, "no record twice");
    }
}
