//! Wiring: probes feed observations into one channel; one task owns the engine state, stamps
//! each input with the clock, persists it, steps the engine, journals the records and hands
//! orders to the executor; outcomes come back as inputs. One shutdown token fans out to every
//! task; orders in flight get a grace period to reach a safe point, then state is saved.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::engine::{self, State};
use crate::error::JournalError;
use crate::journal::{self, JsonlWriter};
use crate::metrics::Metrics;
use crate::model::{
    Action, IncidentEvent, Input, Observation, Order, Outcome, Record, StampedInput, Timestamp,
};
use crate::policy::Policy;

/// A sense: turns the world into observations until shutdown.
pub trait Source: Send + 'static {
    fn name(&self) -> &'static str;
    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// The hands: carries out one order and reports how it ended. Must be idempotent: an order
/// in flight when the supervisor stopped is handed over again on the next start.
pub trait Executor: Send + Sync + 'static {
    fn execute(&self, order: Order) -> Pin<Box<dyn Future<Output = Outcome> + Send + '_>>;
    /// Which kinds of order it can carry out; the engine records the others as what would
    /// have been done instead of issuing them.
    fn capabilities(&self) -> crate::model::Capabilities {
        crate::model::Capabilities::default()
    }
}

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
}

struct Engine {
    state: State,
    policy: Policy,
    cfg: Config,
    metrics: Option<Arc<Metrics>>,
    incidents: JsonlWriter<Record>,
    inputs: JsonlWriter<StampedInput>,
}

impl Supervisor {
    pub fn new(cfg: Config, mut policy: Policy, executor: Arc<dyn Executor>) -> Self {
        if cfg.dry_run {
            policy.observe_only = true;
        }
        Supervisor {
            cfg,
            policy,
            executor,
            sources: Vec::new(),
            metrics: None,
        }
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
        let cfg = self.cfg;
        let started = Timestamp::now();
        let (state, set_aside) = journal::load_state_or_set_aside(&cfg.state_path(), started)?;
        let state = match (&state, &set_aside) {
            (Some(s), _) => s.clone(),
            (None, Some(_)) => journal::rebuild_from_journal(&cfg.incidents_path(), started)?,
            (None, None) => State::default(),
        };
        let mut engine = Engine {
            incidents: JsonlWriter::open(&cfg.incidents_path())?,
            inputs: JsonlWriter::open(&cfg.inputs_path())?,
            state,
            policy: self.policy,
            cfg: cfg.clone(),
            metrics: self.metrics,
        };
        journal::save_state(&cfg.state_path(), &engine.state)?;
        let capabilities = self.executor.capabilities();
        engine.handle(Input::Started { capabilities })?;
        if let Some(aside) = set_aside {
            tracing::error!(moved_to = %aside.moved_to.display(), "state.json unreadable ({}); set aside, resuming from the incident journal", aside.why);
            let detail = format!(
                "{} could not be read ({}); set aside as {}; resumed from the incident journal: {} open incident(s), {} order(s) in flight, node {}",
                cfg.state_path().display(),
                aside.why,
                aside.moved_to.display(),
                engine.state.open.len(),
                engine.state.in_flight.len(),
                engine.state.node.as_str()
            );
            let component = "state-file".to_string();
            let fault = Observation::new(crate::model::Signal::SelfFault {
                component: component.clone(),
            })
            .with_detail(detail)
            .from_source("journal");
            engine.handle(Input::Observation(fault))?;
            let ok = Observation::new(crate::model::Signal::SelfRecovered { component })
                .with_detail("started from the journal; a new state.json is written")
                .from_source("journal");
            engine.handle(Input::Observation(ok))?;
        }
        tracing::info!(
            policy = %engine.policy.origin,
            observe_only = engine.policy.observe_only,
            state_dir = %cfg.state_dir.display(),
            node_phase = engine.state.node.as_str(),
            "gpu-medic supervisor started"
        );

        let (obs_tx, mut obs_rx) = mpsc::channel::<Observation>(1024);
        let (out_tx, mut out_rx) = mpsc::channel::<Outcome>(64);
        let mut sources = JoinSet::new();
        for s in self.sources {
            tracing::info!(source = s.name(), "starting probe");
            sources.spawn(s.run(obs_tx.clone(), shutdown.child_token()));
        }
        drop(obs_tx);

        let mut orders = JoinSet::new();
        // Orders in flight when the supervisor last stopped: hand them over again.
        let resumed: Vec<Order> = engine.state.in_flight.values().cloned().collect();
        for order in resumed {
            tracing::warn!(action_id = %order.id, incident_id = %order.incident, action = order.command.name(), "resuming order left in flight");
            dispatch(&mut orders, &self.executor, &out_tx, order);
        }
        ready();

        let mut tick = tokio::time::interval(cfg.tick_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut probes_open = true;
        loop {
            let input = tokio::select! {
                _ = shutdown.cancelled() => break,
                o = obs_rx.recv(), if probes_open => match o {
                    Some(o) => Input::Observation(o),
                    None => { probes_open = false; continue; }
                },
                Some(outcome) = out_rx.recv() => Input::Outcome(outcome),
                _ = tick.tick() => {
                    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
                    for request in journal::take_requests(&cfg.state_dir) {
                        tracing::warn!(request = ?request, "operator request");
                        for order in engine.handle(Input::Operator(request))? {
                            dispatch(&mut orders, &self.executor, &out_tx, order);
                        }
                    }
                    Input::Tick
                }
                Some(_) = orders.join_next(), if !orders.is_empty() => continue,
            };
            for order in engine.handle(input)? {
                dispatch(&mut orders, &self.executor, &out_tx, order);
            }
        }

        tracing::info!(
            in_flight = orders.len(),
            "shutting down: letting orders in flight reach a safe point"
        );
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
        let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
        while !orders.is_empty() {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(in_flight = orders.len(), "orders still in flight at shutdown; they resume on next start");
                    orders.abort_all();
                    break;
                }
                Some(outcome) = out_rx.recv() => {
                    for order in engine.handle(Input::Outcome(outcome))? {
                        // Follow-up steps wait for the next start; they are in state.json.
                        tracing::info!(action_id = %order.id, action = order.command.name(), "follow-up order deferred to next start");
                    }
                }
                _ = orders.join_next() => {}
            }
        }
        while let Ok(outcome) = out_rx.try_recv() {
            engine.handle(Input::Outcome(outcome))?;
        }
        sources.shutdown().await;
        journal::save_state(&cfg.state_path(), &engine.state)?;
        tracing::info!("gpu-medic supervisor stopped; state saved");
        Ok(())
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

impl Engine {
    /// Records the input, steps the engine, persists state, journals; returns orders to run.
    fn handle(&mut self, input: Input) -> Result<Vec<Order>, SupervisorError> {
        let now = Timestamp::now();
        let (state, actions) = engine::step(&self.state, input.clone(), now, &self.policy);
        if let Some(m) = &self.metrics {
            m.record(&input, &actions, &state);
        }
        // An input that changes nothing (an MPS probe that answered, a quiet tick) is not
        // recorded: the engine is a pure function of state and input, so leaving it out of
        // inputs.jsonl changes no replay.
        if actions.is_empty() && state == self.state {
            return Ok(vec![]);
        }
        self.inputs.append(&StampedInput { at: now, input })?;
        self.state = state;
        // State first: an order is never started that a restart would not know about.
        journal::save_state(&self.cfg.state_path(), &self.state)?;
        let mut orders = Vec::new();
        for action in actions {
            match action {
                Action::Log(record) => {
                    trace_record(&record);
                    self.incidents.append(&record)?;
                }
                Action::Execute(order) => orders.push(order),
            }
        }
        Ok(orders)
    }
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
