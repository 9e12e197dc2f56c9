//! The decision engine: a pure function from (state, input, time, policy) to a new state
//! and a list of actions. No clock, no I/O, no environment: the supervisor feeds it, tests
//! script it, and `gpu-medic policy simulate` replays a recorded stream through it.
//!
//! What it enforces:
//! - debounce (`confirm`) and escalation (`escalate`) windows per rule and GPU;
//! - the MPS restart budget, then the policy's fallback (`[mps] on_failed`);
//! - one node remediation (quarantine, drain, replace) at a time: later verdicts join it;
//! - a deadline on every order: an overrun escalates to the next step instead of hanging;
//! - retries of retryable failures, and deferrals (fleet budget full) without giving up;
//! - observe-only: every decision is journaled, no order is ever emitted;
//! - a verdict whose remedy this node lacks (`Input::Started`: `[aws]` or `[mps]`
//!   disabled) is recorded as what would have been done, never issued, and the node phase
//!   never claims a step that did not happen;
//! - gpu-medic's own faults (`Signal::SelfFault`) open one incident per component while
//!   they last and are never remediated.

pub mod attribution;
pub mod check;
pub mod diagnose;
mod evidence;
pub mod planned;
pub mod rebuild;
pub mod repair;
mod state;

pub use evidence::EvidenceWait;

pub use state::{
    ArmedDrill, Delivery, DrillMark, Goal, GpuHealth, GpuStatus, MAX_ARMED_DRILLS, MAX_COUNTER,
    MAX_DRILL_INCIDENTS, MpsPhase, MpsState, NodePhase, OpenIncident, OwnExit, RecentLog,
    Remediation, Scheduled, SelfFault, Sightings, State, Step, StreamCursor, Withheld,
};

use std::time::Duration;

use crate::model::{
    Action, ActionId, Command, DRILL_ARM_WINDOW, Drill, GpuId, IncidentEvent, IncidentId,
    IncidentState, Input, LifecycleHook, LifecycleResult, LifecycleState, Observation,
    OperatorRequest, Order, Outcome, OutcomeStatus, Record, Signal, SignalKind, Timestamp, Verdict,
};
use crate::policy::Policy;

/// The rule name recorded when the MPS restart budget runs out.
pub const RULE_MPS_BUDGET: &str = "mps-restart-budget";
/// The rule name recorded for Auto Scaling terminating the instance.
pub const RULE_LIFECYCLE_TERMINATE: &str = "lifecycle-terminate";
/// The rule name recorded for a launch gate run.
pub const RULE_LAUNCH_GATE: &str = "launch-gate";
/// The rule name recorded for a signal kind the policy has no rule for.
pub const RULE_NONE: &str = "no-rule";
/// The rule name recorded for gpu-medic's own faults.
pub const RULE_SELF_FAULT: &str = "self-fault";
/// Why a decision that needs ECS or Auto Scaling was not carried out.
const AWS_DISABLED: &str = "AWS remediation disabled ([aws] enabled = false)";
/// Why a restart-mps decision was not carried out.
const MPS_NOT_MANAGED: &str =
    "gpu-medic does not manage the MPS daemon ([mps] enabled = false); it is not restarted";
/// A log-only finding that repeats within this window (same rule, same GPU, same XID) opens
/// no new incident; the next incident says how many repeats there were.
pub const LOG_REPEAT_WINDOW: Duration = Duration::from_secs(600);
/// Bound on the distinct signals kept in one incident's timeline.
pub const MAX_ATTACHED_PER_INCIDENT: usize = 64;
/// Bound on the log-only classes remembered for repeat suppression (the stalest goes first).
pub const MAX_RECENT_LOGS: usize = 256;
/// Bound on the distinct signals counted per log-only class (the rest are counted together).
pub const MAX_COUNTED_SIGNALS: usize = 16;
/// How long after a restart of ours ended systemd's restart of the daemon it stopped may still
/// be reported (`RestartSec` is 1 s on the ECS GPU AMI; the probe reads the unit every turn).
pub const OWN_EXIT_MATCH: Duration = Duration::from_secs(30);
/// Bound on the confirmation and escalation windows tracked at once (the stalest goes first).
pub const MAX_SIGHTING_KEYS: usize = 1024;

/// Advances the engine by one input.
pub fn step(state: &State, input: Input, now: Timestamp, policy: &Policy) -> (State, Vec<Action>) {
    // One bound for every caller (the live loop, the replay at start, `policy simulate`):
    // what comes in and what goes out is cut the same way, so a replay reproduces the
    // records the journal holds, and every record fits the journal's line cap.
    let mut input = input;
    input.bound();
    let mut cx = Cx {
        st: state.clone(),
        out: Vec::new(),
        now,
        policy,
        drill: None,
    };
    match input {
        Input::Observation(obs) => cx.observation(obs),
        Input::Outcome(outcome) => cx.outcome(outcome),
        Input::Tick => cx.tick(),
        Input::Boot { id } => cx.boot(id),
        Input::Started { capabilities } => cx.st.capabilities = capabilities,
        Input::Operator(OperatorRequest::Abort { incident, by }) => cx.abort(incident, &by),
        Input::Operator(OperatorRequest::LaunchGate {
            health,
            summary,
            findings,
            request_ids,
        }) => cx.launch_gate(&health, &summary, &findings, &request_ids),
        Input::Operator(OperatorRequest::Drill { drill }) => cx.drill(drill),
        Input::Operator(OperatorRequest::DrillClear { drill, by }) => cx.drill_clear(&drill, &by),
    }
    for action in &mut cx.out {
        match action {
            Action::Log(record) => record.bound(),
            Action::Execute(order) => order.bound(),
        }
    }
    (cx.st, cx.out)
}

struct Cx<'p> {
    st: State,
    out: Vec<Action>,
    now: Timestamp,
    policy: &'p Policy,
    /// The armed drill whose signal this step judges: the incident it opens is the drill's.
    drill: Option<String>,
}

impl Cx<'_> {
    // ---- journal helpers ----

    fn record(&mut self, incident: IncidentId, event: IncidentEvent) {
        self.out.push(Action::Log(Record {
            at: self.now,
            incident,
            drill: self.st.drills.get(&incident).map(|d| d.id.clone()),
            event,
        }));
    }

    fn open(
        &mut self,
        obs: &Observation,
        rule: &str,
        reason: &str,
        verdict: Verdict,
    ) -> IncidentId {
        self.st.next_incident = self.st.next_incident.saturating_add(1);
        let id = IncidentId(self.st.next_incident);
        self.st.open.insert(
            id,
            OpenIncident {
                opened_at: self.now,
                verdict,
                rule: rule.to_string(),
                gpu: obs.gpu.as_ref().map(|g| g.index),
            },
        );
        self.st
            .attached
            .entry(id)
            .or_default()
            .insert(attach_key(obs));
        let drill = self.take_drill();
        if let Some(d) = &drill {
            // The oldest drill incident (the smallest id) makes room.
            self.st.drills.insert_evicting(
                id,
                DrillMark {
                    id: d.id.clone(),
                    observe: d.observe,
                },
                |_| (),
            );
        }
        self.record(
            id,
            IncidentEvent::Opened {
                observation: obs.clone(),
                rule: rule.to_string(),
                reason: reason.to_string(),
                verdict,
            },
        );
        if let Some(d) = drill {
            let who = if d.by.is_empty() {
                "an operator"
            } else {
                &d.by
            };
            let how = if d.observe {
                "observe: every order is journaled and none is executed"
            } else {
                "the real remedies run"
            };
            self.note(
                id,
                format!("drill {} ({}) by {who}: a rehearsal; {how}", d.id, d.class),
            );
        }
        self.corroborate(id, obs);
        self.remember_xid(obs, id);
        id
    }

    /// Whether an order of `incident` is only journaled: observe-only, or an observe drill.
    fn dry(&self, incident: IncidentId) -> bool {
        self.policy.observe_only || self.st.drills.get(&incident).is_some_and(|d| d.observe)
    }

    // ---- drills ----

    /// Arms a drill; one that brings its observation is judged at once.
    fn drill(&mut self, drill: Drill) {
        self.expire_drills();
        self.st.armed_drills.retain(|a| a.drill.id != drill.id);
        let inject = drill.inject.clone();
        let id = drill.id.clone();
        self.st.armed_drills.push_evicting(ArmedDrill {
            drill,
            at: self.now,
        });
        if let Some(obs) = inject {
            self.drill = Some(id.clone());
            self.observe(obs);
            self.drill = None;
            // Judged once: it does not wait for another signal.
            self.st.armed_drills.retain(|a| a.drill.id != id);
        }
    }

    fn expire_drills(&mut self) {
        let now = self.now;
        self.st
            .armed_drills
            .retain(|a| now.since(a.at) <= DRILL_ARM_WINDOW);
    }

    /// The armed drill this step's incident belongs to, taken out of the armed list.
    fn take_drill(&mut self) -> Option<Drill> {
        let id = self.drill.take()?;
        let at = self.st.armed_drills.iter().position(|a| a.drill.id == id)?;
        Some(self.st.armed_drills.remove(at).drill)
    }

    /// An observation from a probe: the drill it is the signal of, if one is armed for it.
    fn observation(&mut self, obs: Observation) {
        if !self.st.armed_drills.is_empty() {
            self.expire_drills();
            self.drill = self
                .st
                .armed_drills
                .iter()
                .find(|a| a.drill.expect.matches(&obs))
                .map(|a| a.drill.id.clone());
        }
        self.observe(obs);
        self.drill = None;
    }

    fn close(&mut self, id: IncidentId, state: IncidentState, summary: impl Into<String>) {
        if self.st.open.remove(&id).is_some() {
            // A closed incident no longer takes signals unless a GPU or the node points at it.
            // The withheld incident (`[aws]` off) goes on taking the node's later faults.
            let referenced = self.st.node_incident == Some(id)
                || self.st.withheld.as_ref().is_some_and(|w| w.incident == id)
                || self.st.gpus.values().any(|g| g.incident == Some(id));
            if !referenced {
                self.st.attached.remove(&id);
            }
            self.record(
                id,
                IncidentEvent::Closed {
                    state,
                    summary: summary.into(),
                },
            );
        }
    }

    /// Adds a signal to an incident's timeline, once per distinct signal and GPU: a fault
    /// that a probe reports on every poll does not flood the journal.
    fn attach(&mut self, id: IncidentId, obs: &Observation) {
        let key = attach_key(obs);
        let seen = self.st.attached.entry(id).or_default();
        if seen.len() >= MAX_ATTACHED_PER_INCIDENT || !seen.insert(key) {
            return;
        }
        self.record(
            id,
            IncidentEvent::Signal {
                observation: obs.clone(),
            },
        );
    }

    fn note(&mut self, id: IncidentId, text: impl Into<String>) {
        self.record(id, IncidentEvent::Note { text: text.into() });
    }

    fn escalated(&mut self, id: IncidentId, verdict: Verdict, rule: &str, reason: String) {
        if let Some(o) = self.st.open.get_mut(&id) {
            o.verdict = o.verdict.max(verdict);
        }
        self.record(
            id,
            IncidentEvent::Escalated {
                verdict,
                rule: rule.to_string(),
                reason,
            },
        );
    }

    fn deadline_for(&self, command: &Command) -> Duration {
        let d = &self.policy.deadlines;
        match command {
            Command::RestartMps => d.restart_mps,
            Command::StopTasks { .. } => d.stop_tasks,
            Command::Quarantine => d.quarantine,
            Command::Drain { .. } => d.drain,
            Command::Replace | Command::Restore => d.replace,
            Command::Reboot { .. } => d.reboot,
            Command::BootCheck => d.boot_check,
            Command::Diagnose { .. } => d.diagnose,
            Command::CompleteLifecycle { .. } => d.lifecycle,
            Command::CollectEvidence => self
                .st
                .capabilities
                .evidence
                .map_or(d.drain, |p| p.deadline),
        }
    }

    /// Hands an order to a remedy, or in observe-only mode records what would have been done.
    /// Returns whether an executable order was emitted.
    fn issue(&mut self, incident: IncidentId, command: Command, attempt: u32) -> bool {
        self.st.next_action = self.st.next_action.saturating_add(1);
        let (planned_deadline, planned) = self.planned_order(incident, &command);
        let order = Order {
            id: ActionId(self.st.next_action),
            incident,
            deadline: planned_deadline
                .unwrap_or_else(|| self.now.plus(self.deadline_for(&command))),
            command,
            attempt,
            planned,
        };
        let dry_run = self.dry(incident);
        self.record(
            incident,
            IncidentEvent::ActionStarted {
                order: order.clone(),
                dry_run,
            },
        );
        if dry_run {
            return false;
        }
        self.st.in_flight.insert(order.id, order.clone());
        self.out.push(Action::Execute(order));
        true
    }

    fn schedule(&mut self, incident: IncidentId, command: Command, attempt: u32, after: Duration) {
        let at = self.now.plus(after);
        self.note(
            incident,
            format!(
                "{} attempt {} scheduled for {}",
                command.name(),
                attempt,
                at
            ),
        );
        self.st.scheduled.push(Scheduled {
            at,
            incident,
            command,
            attempt,
        });
    }

    // ---- observations ----

    fn observe(&mut self, obs: Observation) {
        if planned::handles(&obs.signal) {
            self.planned_observe(obs);
            return;
        }
        match &obs.signal {
            Signal::MpsUp => self.mps_up(&obs),
            Signal::Lifecycle { state } => {
                let state = *state;
                self.lifecycle(&obs, state)
            }
            Signal::SelfFault { component } => {
                let component = component.clone();
                self.self_fault(&obs, component)
            }
            Signal::SelfRecovered { component } => {
                let component = component.clone();
                self.self_recovered(&obs, &component)
            }
            _ => self.judge(obs),
        }
    }

    /// gpu-medic cannot do part of its job. One incident per component while it lasts; a
    /// probe reporting it on every poll changes nothing. Never an order: a missing library
    /// or binary is not the hardware's fault, and draining for it would spread the mistake
    /// to the fleet.
    fn self_fault(&mut self, obs: &Observation, component: String) {
        if self.st.self_faults.contains_key(&component) {
            return;
        }
        let reason = format!(
            "gpu-medic itself cannot work ({component}): a fault of gpu-medic or its configuration, \
             not of the hardware; nothing is drained, replaced or restarted for it, and what it \
             cannot see is unknown until it is fixed"
        );
        let id = self.open(obs, RULE_SELF_FAULT, &reason, Verdict::Log);
        self.st.self_faults.insert(
            component,
            SelfFault {
                incident: id,
                since: self.now,
                detail: obs.detail.clone().unwrap_or_default(),
            },
        );
    }

    fn self_recovered(&mut self, obs: &Observation, component: &str) {
        let Some(fault) = self.st.self_faults.remove(component) else {
            return;
        };
        self.attach(fault.incident, obs);
        self.close(
            fault.incident,
            IncidentState::Resolved,
            format!("{component} works again"),
        );
    }

    /// Records a decision this node cannot carry out: the orders it would have given (as
    /// not executed) and why, then closes the incident as observed.
    fn would(&mut self, incident: IncidentId, commands: Vec<Command>, what: &str, why: &str) {
        for command in commands {
            self.st.next_action = self.st.next_action.saturating_add(1);
            let order = Order {
                id: ActionId(self.st.next_action),
                incident,
                deadline: self.now.plus(self.deadline_for(&command)),
                command,
                attempt: 1,
                planned: false,
            };
            self.record(
                incident,
                IncidentEvent::ActionStarted {
                    order,
                    dry_run: true,
                },
            );
        }
        self.close(
            incident,
            IncidentState::Observed,
            format!("would have {what}: {why}"),
        );
    }

    fn judge(&mut self, obs: Observation) {
        let kind = obs.signal.kind();
        if self.own_exit(&obs) || self.join_cause(&obs) {
            return;
        }
        let Some(rule) = self.policy.rule_for(&obs.signal, obs.value) else {
            if self.policy.rules.iter().any(|r| r.signal == kind) {
                return; // below every threshold: not a finding
            }
            let class = format!("{RULE_NONE}/{}@{}", kind.as_str(), class_target(&obs));
            if self.log_is_repeat(&class, &obs) {
                return;
            }
            let reason = format!("no rule judges `{}`; recorded only", kind.as_str());
            self.log_incident(&obs, RULE_NONE, &reason, &class);
            return;
        };
        if rule.action == Verdict::Ignore {
            return;
        }
        if rule.suspect.is_some() || rule.culprit.is_some() {
            self.judge_app(obs, rule);
            return;
        }
        if matches!(kind, SignalKind::MpsUnresponsive | SignalKind::MpsDown)
            && self.st.mps.phase == MpsPhase::Up
        {
            self.st.mps.phase = MpsPhase::Unresponsive;
        }
        let target = target_key(&obs);
        let key = format!("{}@{}", rule.name, target);
        let keep = rule
            .confirm
            .map(|c| c.window)
            .into_iter()
            .chain(rule.escalate.map(|e| e.window))
            .max()
            .unwrap_or_default();
        let now = self.now;
        // A new `rule@target` in a full table takes the place of the one seen longest ago;
        // a storm of one signal keeps its newest sightings (`Sightings`).
        let seen = self
            .st
            .sightings
            .get_or_insert_evicting(key.clone(), Sightings::default, |v| v.last().copied());
        seen.retain(|t| now.since(*t) <= keep);
        seen.push_evicting(now);
        let count_within = |seen: &Sightings, w: Duration| {
            u32::try_from(seen.iter().filter(|t| now.since(**t) <= w).count()).unwrap_or(u32::MAX)
        };
        if let Some(c) = rule.confirm
            && count_within(seen, c.window) < c.count
        {
            if let Some(gpu) = &obs.gpu {
                self.mark_gpu(gpu, GpuStatus::Suspect, &rule.name, rule.action, None);
            }
            return;
        }
        let mut verdict = rule.action;
        let mut reason = rule.reason.clone();
        let mut rule_name = rule.name.clone();
        if let Some(e) = rule.escalate {
            let n = count_within(seen, e.window);
            if n >= e.count {
                verdict = e.action;
                reason = format!(
                    "{} seen {} times on {} within {} (escalation of rule `{}`: {})",
                    obs.signal,
                    n,
                    target,
                    humantime::format_duration(e.window),
                    rule.name,
                    rule.reason
                );
                rule_name = format!("{}/escalated", rule.name);
                self.st.sightings.remove(&key);
            }
        }
        // A rule without windows keeps no sightings: a storm of distinct codes leaves none.
        if keep.is_zero() || self.st.sightings.get(&key).is_none_or(|v| v.is_empty()) {
            self.st.sightings.remove(&key);
        }
        // Log-only findings coalesce per rule and GPU (every code of a rule, every unknown
        // code of the catch-all), not per code: a storm of distinct XIDs is one incident per
        // GPU and class, with counts.
        let class = format!("{rule_name}@{}", class_target(&obs));
        if verdict == Verdict::Log && self.log_is_repeat(&class, &obs) {
            return;
        }
        self.dispatch(obs, verdict, &rule_name, &reason, &class);
    }

    /// Whether a log-only finding repeats one of its class recorded within
    /// `LOG_REPEAT_WINDOW`; repeats are counted per signal and mentioned by the next incident
    /// of that class.
    fn log_is_repeat(&mut self, class: &str, obs: &Observation) -> bool {
        let now = self.now;
        match self.st.recent_logs.get_mut(class) {
            Some(r) if now.since(r.at) < LOG_REPEAT_WINDOW => {
                r.repeats = r.repeats.saturating_add(1);
                let signal = obs.signal.to_string();
                if let Some(n) = r.counts.get_mut(&signal) {
                    *n = n.saturating_add(1);
                } else {
                    // Past the bound, a new signal is counted only in `repeats`.
                    let _ = r.counts.try_insert(signal, 1);
                }
                true
            }
            _ => false,
        }
    }

    /// Opens and closes a log-only incident, first in its class for `LOG_REPEAT_WINDOW`.
    fn log_incident(&mut self, obs: &Observation, rule: &str, reason: &str, class: &str) {
        let id = self.open(obs, rule, reason, Verdict::Log);
        if let Some(prev) = self.st.recent_logs.remove(class)
            && prev.repeats > 0
        {
            let counted: u32 = prev.counts.values().fold(0, |a, n| a.saturating_add(*n));
            let mut by: Vec<String> = prev
                .counts
                .iter()
                .map(|(signal, n)| format!("{signal} x{n}"))
                .collect();
            if prev.repeats > counted {
                by.push(format!("others x{}", prev.repeats - counted));
            }
            self.note(
                id,
                format!(
                    "{} repeats after incident {} were recorded only as inputs ({})",
                    prev.repeats,
                    prev.incident,
                    by.join(", ")
                ),
            );
        }
        self.remember_log(class, id);
        self.close(id, IncidentState::Logged, format!("recorded: {reason}"));
    }

    /// Starts a repeat-suppression window for `class` (at most `MAX_RECENT_LOGS` of them, the
    /// stalest dropped first).
    fn remember_log(&mut self, class: &str, id: IncidentId) {
        self.st.recent_logs.insert_evicting(
            class.to_string(),
            RecentLog {
                incident: id,
                at: self.now,
                repeats: 0,
                counts: Default::default(),
            },
            |r| r.at,
        );
    }

    fn dispatch(
        &mut self,
        obs: Observation,
        verdict: Verdict,
        rule: &str,
        reason: &str,
        key: &str,
    ) {
        // A GPU already judged at least this severely: the signal joins its incident.
        if let Some(gpu) = &obs.gpu
            && let Some(h) = self.st.gpus.get(&gpu.index)
            && h.status == GpuStatus::Faulted
            && h.verdict >= verdict
            && let Some(id) = h.incident
        {
            self.attach(id, &obs);
            // The same fault seen again after the reboot that was to mend it.
            if self
                .st
                .remediation
                .is_some_and(|r| r.incident == id && r.rebooted)
            {
                let (verdict, reason) = self.rung_available(verdict, reason);
                self.fault_during_repair(verdict, rule, &reason);
            }
            return;
        }
        let (verdict, reason) = self.rung_available(verdict, reason);
        let reason = reason.as_str();
        match verdict {
            Verdict::Ignore => {}
            Verdict::Log => self.log_incident(&obs, rule, reason, key),
            Verdict::RestartMps => self.mps_request(&obs, rule, reason),
            Verdict::StopTasks => self.stop_tasks(obs, rule, reason),
            Verdict::Drain | Verdict::Reboot | Verdict::Replace => {
                self.node_remediate(obs, verdict, rule, reason)
            }
        }
    }

    fn mark_gpu(
        &mut self,
        gpu: &GpuId,
        status: GpuStatus,
        rule: &str,
        verdict: Verdict,
        incident: Option<IncidentId>,
    ) {
        let now = self.now;
        let entry = self.st.gpus.entry(gpu.index).or_insert_with(|| GpuHealth {
            gpu: gpu.clone(),
            status: GpuStatus::Healthy,
            rule: String::new(),
            verdict: Verdict::Ignore,
            incident: None,
            since: now,
        });
        if entry.status == GpuStatus::Faulted && status != GpuStatus::Faulted {
            return; // faults are sticky
        }
        if !gpu.uuid.is_empty() {
            entry.gpu = gpu.clone();
        }
        if entry.status != status {
            entry.since = now;
        }
        entry.status = status;
        entry.rule = rule.to_string();
        entry.verdict = entry.verdict.max(verdict);
        if incident.is_some() {
            entry.incident = incident;
        }
    }

    // ---- stop-tasks (MPS server faults) ----

    fn stop_tasks(&mut self, obs: Observation, rule: &str, reason: &str) {
        let Some(gpu) = obs.gpu.clone() else {
            let id = self.open(&obs, rule, reason, Verdict::Log);
            self.close(
                id,
                IncidentState::Logged,
                "stop-tasks needs a GPU and the signal named none; recorded only",
            );
            return;
        };
        if let Some(id) = self.st.gpu_jobs.get(&gpu.index).copied() {
            self.attach(id, &obs);
            return;
        }
        let id = self.open(&obs, rule, reason, Verdict::StopTasks);
        if !self.st.capabilities.aws {
            let command = Command::StopTasks {
                gpu: gpu.clone(),
                pids: obs.pids.clone(),
                tasks: obs.tasks.clone(),
            };
            self.would(
                id,
                vec![command],
                &format!("stopped the tasks on {gpu}"),
                AWS_DISABLED,
            );
            return;
        }
        let command = Command::StopTasks {
            gpu: gpu.clone(),
            pids: obs.pids.clone(),
            tasks: obs.tasks.clone(),
        };
        if self.issue(id, command, 1) {
            self.st.gpu_jobs.insert(gpu.index, id);
        } else {
            self.close(
                id,
                IncidentState::Observed,
                format!("observe-only: would have stopped the tasks on {gpu}"),
            );
        }
    }

    // ---- MPS daemon ----

    fn mps_request(&mut self, obs: &Observation, rule: &str, reason: &str) {
        if !self.st.capabilities.mps {
            let key = format!("{rule}@{}", target_key(obs));
            if self.log_is_repeat(&key, obs) {
                return;
            }
            let id = self.open(obs, rule, reason, Verdict::RestartMps);
            self.remember_log(&key, id);
            self.would(
                id,
                vec![Command::RestartMps],
                "restarted the MPS control daemon",
                MPS_NOT_MANAGED,
            );
            return;
        }
        if let Some(id) = self.st.mps.incident {
            // Already being handled (restart in flight or scheduled, failed, or observed).
            self.attach(id, obs);
            return;
        }
        let id = self.open(obs, rule, reason, Verdict::RestartMps);
        self.st.mps.incident = Some(id);
        self.mps_try_restart(id);
    }

    /// Whether `obs` is systemd's restart of the daemon that our own restart caused (its stop
    /// of the running daemon): expected once per restart, while the order runs and for
    /// [`OWN_EXIT_MATCH`] after it ended.
    fn own_exit(&mut self, obs: &Observation) -> bool {
        if obs.signal != Signal::MpsCrash || obs.source != crate::model::MPS_UNIT_SOURCE {
            return false;
        }
        let Some(own) = self.st.mps.own_exit.take() else {
            return false;
        };
        !own.ended || self.now.since(own.at) <= OWN_EXIT_MATCH
    }

    /// Restarts the daemon if the budget allows; otherwise declares it failed.
    fn mps_try_restart(&mut self, incident: IncidentId) {
        let window = self.policy.mps.restart_window;
        let now = self.now;
        self.st.mps.restarts.retain(|t| now.since(*t) < window);
        let used = u32::try_from(self.st.mps.restarts.len()).unwrap_or(u32::MAX);
        if used < self.policy.mps.restart_budget {
            if self.issue(incident, Command::RestartMps, used.saturating_add(1)) {
                self.st.mps.restarts.push(now);
                self.st.mps.phase = MpsPhase::Restarting;
                self.st.mps.own_exit = Some(OwnExit {
                    at: now,
                    ended: false,
                });
            } else {
                self.close(
                    incident,
                    IncidentState::Observed,
                    "observe-only: would have restarted the MPS control daemon",
                );
            }
            return;
        }
        self.st.mps.phase = MpsPhase::Failed;
        let fallback = self.policy.mps.on_failed;
        let reason = format!(
            "MPS daemon restarted {} times within {} without recovering; declared failed; policy fallback: {}",
            used,
            humantime::format_duration(window),
            fallback
        );
        self.escalated(incident, fallback, RULE_MPS_BUDGET, reason.clone());
        if fallback.is_node_remediation() {
            self.remediate_in(incident, fallback);
        } else {
            self.close(incident, IncidentState::Failed, reason);
        }
    }

    fn mps_up(&mut self, obs: &Observation) {
        // An answer ends the daemon's "down" and "not answering" sightings, not its crashes:
        // a daemon whose servers (or itself, under systemd's Restart=) keep dying may answer
        // every probe in between.
        let liveness: Vec<String> = self
            .policy
            .rules
            .iter()
            .filter(|r| matches!(r.signal, SignalKind::MpsDown | SignalKind::MpsUnresponsive))
            .map(|r| format!("{}@mps", r.name))
            .collect();
        self.st.sightings.retain(|k, _| !liveness.contains(k));
        let restart_in_flight = self
            .st
            .in_flight
            .values()
            .any(|o| o.command == Command::RestartMps);
        if restart_in_flight {
            return; // the restart's own outcome closes the incident
        }
        self.st
            .scheduled
            .retain(|s| s.command != Command::RestartMps);
        let was = self.st.mps.phase;
        self.st.mps.phase = MpsPhase::Up;
        if let Some(id) = self.st.mps.incident.take() {
            let node_owned = self.st.remediation.is_some_and(|r| r.incident == id);
            if node_owned {
                self.note(
                    id,
                    "MPS daemon answers again; the node remediation continues",
                );
            } else if self.st.open.contains_key(&id) {
                self.attach(id, obs);
                self.close(
                    id,
                    IncidentState::Resolved,
                    format!("MPS daemon answers again (was {})", was.as_str()),
                );
            }
        }
    }

    // ---- node remediation ----

    fn node_remediate(&mut self, obs: Observation, verdict: Verdict, rule: &str, reason: &str) {
        if let Some(w) = self.st.withheld.as_ref()
            && w.verdict >= verdict
            && !self.st.capabilities.aws
        {
            // Already recorded as what would have been done: later faults join it.
            let id = w.incident;
            self.attach(id, &obs);
            if let Some(gpu) = &obs.gpu {
                self.mark_gpu(gpu, GpuStatus::Faulted, rule, verdict, Some(id));
            }
            return;
        }
        if let Some(rem) = self.st.remediation {
            self.attach(rem.incident, &obs);
            if let Some(gpu) = &obs.gpu {
                self.mark_gpu(gpu, GpuStatus::Faulted, rule, verdict, Some(rem.incident));
            }
            if verdict == Verdict::Replace && rem.goal == Goal::Drain {
                if let Some(r) = self.st.remediation.as_mut() {
                    r.goal = Goal::Replace;
                }
                self.escalated(
                    rem.incident,
                    Verdict::Replace,
                    rule,
                    format!("upgraded from drain to replace: {reason}"),
                );
            }
            self.fault_during_repair(verdict, rule, reason);
            return;
        }
        let finished = match self.st.node {
            NodePhase::Replaced | NodePhase::Terminating | NodePhase::Terminated => true,
            NodePhase::Drained => verdict <= Verdict::Reboot,
            _ => false,
        };
        if finished {
            // The node is already out of service: the signal joins the last node incident.
            match self.st.node_incident {
                Some(last) => {
                    self.attach(last, &obs);
                    if let Some(gpu) = &obs.gpu {
                        self.mark_gpu(gpu, GpuStatus::Faulted, rule, verdict, Some(last));
                    }
                }
                None => {
                    let id = self.open(&obs, rule, reason, verdict);
                    let phase = self.st.node.as_str();
                    self.close(
                        id,
                        IncidentState::Logged,
                        format!("node is already {phase}; nothing more to do"),
                    );
                    self.st.node_incident = Some(id);
                }
            }
            return;
        }
        let id = self.open(&obs, rule, reason, verdict);
        if let Some(gpu) = &obs.gpu {
            self.mark_gpu(gpu, GpuStatus::Faulted, rule, verdict, Some(id));
        }
        self.remediate_in(id, verdict);
        if self.st.remediation.is_some_and(|r| r.incident == id) {
            self.evidence_begin(id, &obs);
        }
    }

    /// Starts a node remediation within an existing incident.
    fn remediate_in(&mut self, incident: IncidentId, verdict: Verdict) {
        let verdict = if self.st.remediation.is_none() {
            self.climb(incident, verdict)
        } else {
            verdict
        };
        let Some(goal) = Goal::from_verdict(verdict) else {
            return;
        };
        if let Some(rem) = self.st.remediation {
            if rem.incident != incident {
                // The node is already on its way out under another incident: this one ends
                // here, pointing at it, rather than staying open with nothing left to do.
                self.close(
                    incident,
                    IncidentState::Failed,
                    format!(
                        "joins the node remediation of incident {}, already under way",
                        rem.incident
                    ),
                );
            }
            if goal > rem.goal
                && rem.goal != Goal::Terminate
                && let Some(r) = self.st.remediation.as_mut()
            {
                r.goal = goal;
            }
            return;
        }
        if self.dry(incident) {
            self.would_remediate(incident, goal);
            return;
        }
        if !self.st.capabilities.aws {
            let (what, steps) = match goal {
                Goal::Drain => (
                    "quarantined and drained the instance",
                    vec![Command::Quarantine, Command::Drain { terminating: false }],
                ),
                _ => (
                    "quarantined, drained and replaced the instance",
                    vec![
                        Command::Quarantine,
                        Command::Drain { terminating: false },
                        Command::Replace,
                    ],
                ),
            };
            self.st.withheld = Some(Withheld {
                incident,
                verdict,
                why: AWS_DISABLED.to_string(),
                since: self.now,
            });
            self.would(incident, steps, what, AWS_DISABLED);
            return;
        }
        let step = if self.st.node == NodePhase::Drained {
            Step::Replace
        } else {
            Step::Quarantine
        };
        self.st.remediation = Some(Remediation::new(incident, goal, step));
        self.st.node_incident = Some(incident);
        self.start_step(incident, step, 1);
    }

    /// Observe-only (or a dry run): the remediation's orders recorded, none executed, and the
    /// incident closed saying what would have been done.
    fn would_remediate(&mut self, incident: IncidentId, goal: Goal) {
        let boot = self.st.repair.boot.clone().unwrap_or_default();
        let steps = match goal {
            Goal::Drain => self.with_diagnosis(
                vec![Command::Quarantine, Command::Drain { terminating: false }],
                self.policy.diagnose.after_drain,
            ),
            Goal::Reboot => self.with_diagnosis(
                vec![
                    Command::Quarantine,
                    Command::Drain { terminating: false },
                    Command::Reboot { boot },
                ],
                self.policy.diagnose.after_reboot,
            ),
            _ => vec![
                Command::Quarantine,
                Command::Drain { terminating: false },
                Command::Replace,
            ],
        };
        let diagnoses = steps.iter().any(|c| matches!(c, Command::Diagnose { .. }));
        for c in steps {
            self.issue(incident, c, 1);
        }
        let what = match goal {
            Goal::Drain if diagnoses => {
                "quarantined and drained the instance, then diagnosed its GPUs (back in service on a pass, the next rung on a failure)"
            }
            Goal::Drain => "quarantined and drained the instance",
            Goal::Reboot => {
                "quarantined, drained and rebooted the instance (then checked it after the boot and returned it to service, or replaced it)"
            }
            _ => "quarantined, drained and replaced the instance",
        };
        self.close(
            incident,
            IncidentState::Observed,
            format!("observe-only: would have {what}"),
        );
    }

    fn start_step(&mut self, incident: IncidentId, step: Step, attempt: u32) {
        if self.evidence_holds(incident, step, attempt) {
            return;
        }
        if let Some(r) = self.st.remediation.as_mut() {
            r.step = step;
        }
        let (command, phase) = match step {
            Step::Quarantine => (Command::Quarantine, NodePhase::Quarantined),
            Step::Drain => (
                Command::Drain {
                    terminating: self.st.node == NodePhase::Terminating,
                },
                NodePhase::Draining,
            ),
            Step::Replace => (Command::Replace, NodePhase::Replacing),
            Step::CompleteLifecycle => (
                Command::CompleteLifecycle {
                    hook: LifecycleHook::Terminate,
                    result: LifecycleResult::Continue,
                },
                NodePhase::Terminating,
            ),
            Step::Restore => (Command::Restore, self.st.node),
            Step::Reboot => match self.reboot_command(incident) {
                Some(c) => (c, NodePhase::Rebooting),
                None => {
                    if let Some(r) = self.st.remediation.as_mut() {
                        r.goal = Goal::Replace;
                    }
                    return self.start_step(incident, Step::Replace, 1);
                }
            },
            // Waiting for the boot has no order: `tick` enforces `Remediation::until`.
            Step::AwaitBoot => return,
            Step::BootCheck => (Command::BootCheck, NodePhase::Verifying),
            Step::Diagnose => (
                Command::Diagnose {
                    level: self
                        .st
                        .capabilities
                        .diagnose
                        .unwrap_or(crate::model::diagnosis::Level::Quick),
                },
                NodePhase::Verifying,
            ),
        };
        let phase = match (self.st.remediation, step) {
            (Some(r), Step::Quarantine | Step::Restore) if r.rebooted && r.goal == Goal::Reboot => {
                NodePhase::Verifying
            }
            _ => phase,
        };
        if self.st.node != NodePhase::Terminating || step == Step::CompleteLifecycle {
            self.st.node = phase;
        }
        self.issue(incident, command, attempt);
    }

    /// The step after `done` for the current goal, or the end of the remediation.
    fn advance(&mut self, done: Step) {
        let Some(rem) = self.st.remediation.as_mut() else {
            return;
        };
        match done {
            Step::Quarantine => rem.quarantined = true,
            Step::Drain => rem.drained = true,
            _ => {}
        }
        let rem = *rem;
        let next = match (done, rem.goal) {
            (Step::Quarantine, Goal::Reboot) if rem.rebooted => Some(Step::BootCheck),
            (Step::Quarantine, _) => Some(Step::Drain),
            (Step::Drain, Goal::Drain) if self.diagnoses_after(done, rem.goal, rem.incident) => {
                Some(Step::Diagnose)
            }
            (Step::Drain, Goal::Drain) => None,
            (Step::Drain, Goal::Reboot) => Some(Step::Reboot),
            (Step::Drain, Goal::Replace) => Some(Step::Replace),
            (Step::Drain | Step::Replace, Goal::Terminate) => Some(Step::CompleteLifecycle),
            (Step::BootCheck, Goal::Reboot)
                if self.diagnoses_after(done, rem.goal, rem.incident) =>
            {
                Some(Step::Diagnose)
            }
            (Step::BootCheck, Goal::Reboot) => Some(Step::Restore),
            (Step::BootCheck, Goal::Terminate) => Some(Step::CompleteLifecycle),
            (Step::BootCheck, _) => Some(Step::Drain),
            (Step::Replace, _) | (Step::CompleteLifecycle, _) | (Step::Restore, _) => None,
            (Step::Reboot | Step::AwaitBoot | Step::Diagnose, _) => None,
        };
        match next {
            Some(step) => self.start_step(rem.incident, step, 1),
            None => {
                self.st.remediation = None;
                let (phase, state, summary) = match (done, rem.goal) {
                    (Step::Drain, _) => (
                        NodePhase::Drained,
                        IncidentState::Drained,
                        "instance quarantined and drained; left for an operator",
                    ),
                    (Step::Replace, _) => (
                        NodePhase::Replaced,
                        IncidentState::Replaced,
                        "instance drained and marked Unhealthy; Auto Scaling replaces it",
                    ),
                    _ => (
                        NodePhase::Terminated,
                        IncidentState::Terminated,
                        "instance drained; lifecycle hook completed with CONTINUE",
                    ),
                };
                self.st.node = phase;
                if done == Step::Drain
                    && rem.goal == Goal::Drain
                    && self.planned_drained(rem.incident)
                {
                    return;
                }
                let summary = self
                    .planned_summary(rem.incident, state)
                    .unwrap_or_else(|| summary.to_string());
                self.close(rem.incident, state, summary);
            }
        }
    }

    /// A step failed for good (or overran its deadline): move on or give up.
    fn step_failed(&mut self, step: Step, why: &str) {
        let Some(rem) = self.st.remediation else {
            return;
        };
        let id = rem.incident;
        match (step, rem.goal) {
            (Step::Quarantine, Goal::Reboot) if rem.rebooted => {
                self.note(
                    id,
                    format!("quarantine after the boot failed ({why}); checking the node anyway"),
                );
                self.start_step(id, Step::BootCheck, 1);
            }
            (Step::Reboot | Step::AwaitBoot | Step::BootCheck, _) => self.reboot_failed(step, why),
            (Step::Diagnose, _) => self.diagnosis_not_run(id, why),
            (Step::Drain, Goal::Reboot) => {
                self.note(
                    id,
                    format!("drain did not finish ({why}); rebooting anyway, ECS reschedules what is left"),
                );
                self.start_step(id, Step::Reboot, 1);
            }
            (Step::Quarantine, _) => {
                self.note(id, format!("quarantine failed ({why}); draining anyway"));
                self.start_step(id, Step::Drain, 1);
            }
            (Step::Drain, Goal::Replace) => {
                self.note(
                    id,
                    format!("drain did not finish ({why}); replacing anyway, ECS reschedules what is left"),
                );
                self.start_step(id, Step::Replace, 1);
            }
            (Step::Drain, Goal::Terminate) => {
                self.note(
                    id,
                    format!("drain did not finish ({why}); completing the lifecycle hook anyway"),
                );
                self.start_step(id, Step::CompleteLifecycle, 1);
            }
            (Step::Drain, Goal::Drain) => {
                self.st.remediation = None;
                let left = if rem.quarantined {
                    self.st.node = NodePhase::Quarantined;
                    "instance left quarantined"
                } else {
                    self.st.node = NodePhase::InService;
                    "the quarantine did not take either: the instance is still in service"
                };
                self.close(
                    id,
                    IncidentState::Failed,
                    format!("drain did not finish ({why}); {left}; operator needed"),
                );
            }
            (Step::Replace, Goal::Terminate) => {
                self.start_step(id, Step::CompleteLifecycle, 1);
            }
            (Step::Replace, _) => {
                self.st.remediation = None;
                let (phase, left) = if rem.drained {
                    (NodePhase::Drained, "it stays drained")
                } else if rem.quarantined {
                    (
                        NodePhase::Quarantined,
                        "it stays quarantined (the drain did not finish)",
                    )
                } else {
                    (
                        NodePhase::InService,
                        "neither quarantine nor drain took effect: the instance is still in service",
                    )
                };
                self.st.node = phase;
                self.close(
                    id,
                    IncidentState::Failed,
                    format!("could not have Auto Scaling replace the instance ({why}); {left}; operator needed"),
                );
            }
            (Step::CompleteLifecycle, _) => {
                self.st.remediation = None;
                self.close(
                    id,
                    IncidentState::Failed,
                    format!("could not complete the lifecycle hook ({why}); Auto Scaling's hook timeout applies"),
                );
            }
            (Step::Restore, _) => {
                self.st.remediation = None;
                self.close(
                    id,
                    IncidentState::Failed,
                    format!("could not return the instance to service ({why}); it may still be quarantined or draining; operator needed"),
                );
            }
        }
    }

    // ---- lifecycle ----

    fn lifecycle(&mut self, obs: &Observation, state: LifecycleState) {
        if state != LifecycleState::Terminating
            || matches!(self.st.node, NodePhase::Terminating | NodePhase::Terminated)
        {
            return;
        }
        let previous = self.st.node;
        self.st.node = NodePhase::Terminating;
        if let Some(rem) = self.st.remediation {
            self.attach(rem.incident, obs);
            self.note(
                rem.incident,
                "Auto Scaling is terminating the instance: finish draining, then complete the hook",
            );
            if let Some(r) = self.st.remediation.as_mut() {
                r.goal = Goal::Terminate;
                r.until = None;
            }
            if rem.step == Step::AwaitBoot {
                self.start_step(rem.incident, Step::CompleteLifecycle, 1);
            }
            return;
        }
        let reason =
            "Auto Scaling is terminating the instance: drain it, then complete our lifecycle hook";
        let id = self.open(obs, RULE_LIFECYCLE_TERMINATE, reason, Verdict::Drain);
        if self.policy.observe_only {
            self.issue(id, Command::Drain { terminating: true }, 1);
            self.close(
                id,
                IncidentState::Observed,
                "observe-only: would have drained and completed the lifecycle hook",
            );
            return;
        }
        let step = if matches!(previous, NodePhase::Drained | NodePhase::Replaced) {
            Step::CompleteLifecycle
        } else {
            Step::Drain
        };
        self.st.remediation = Some(Remediation::new(id, Goal::Terminate, step));
        self.st.node_incident = Some(id);
        self.start_step(id, step, 1);
    }

    // ---- outcomes, deadlines, retries ----

    fn outcome(&mut self, outcome: Outcome) {
        let Some(order) = self.st.in_flight.remove(&outcome.action) else {
            return; // late outcome of an order already escalated past its deadline
        };
        self.record(
            order.incident,
            IncidentEvent::ActionFinished {
                outcome: outcome.clone(),
            },
        );
        if order.command == Command::RestartMps
            && let Some(own) = &mut self.st.mps.own_exit
        {
            *own = OwnExit {
                at: self.now,
                ended: true,
            };
        }
        if matches!(order.command, Command::Diagnose { .. })
            && outcome.status == OutcomeStatus::Done
        {
            self.diagnosed(order.incident, outcome.diagnosis.as_deref());
            return;
        }
        if order.command == Command::CollectEvidence {
            // Its own retries are the remedy's (the upload backs off); the engine only records
            // the end and lets a held step go.
            let why = if outcome.detail.is_empty() {
                "failed".to_string()
            } else {
                outcome.detail.clone()
            };
            self.evidence_ended(&order, Some(&outcome), &why);
            return;
        }
        match outcome.status {
            OutcomeStatus::Done => self.order_done(&order),
            OutcomeStatus::Deferred { retry_after } => self.schedule(
                order.incident,
                order.command.clone(),
                order.attempt,
                retry_after,
            ),
            OutcomeStatus::Failed { retryable } => {
                let why = if outcome.detail.is_empty() {
                    "failed".to_string()
                } else {
                    outcome.detail.clone()
                };
                if retryable
                    && order.attempt < self.policy.retry.max_attempts
                    && order.command != Command::RestartMps
                    && order.command != Command::CollectEvidence
                {
                    let delay = self.policy.retry.delay;
                    self.schedule(
                        order.incident,
                        order.command.clone(),
                        order.attempt.saturating_add(1),
                        delay,
                    );
                } else {
                    self.order_failed(&order, &why);
                }
            }
        }
    }

    fn order_done(&mut self, order: &Order) {
        match &order.command {
            Command::RestartMps => {
                self.st.mps.phase = MpsPhase::Up;
                self.st.sightings.retain(|k, _| !k.ends_with("@mps"));
                if self.st.mps.incident == Some(order.incident) {
                    self.st.mps.incident = None;
                }
                self.close(
                    order.incident,
                    IncidentState::Resolved,
                    "MPS control daemon restarted and answering",
                );
            }
            Command::StopTasks { gpu, .. } => {
                self.st.gpu_jobs.remove(&gpu.index);
                self.close(
                    order.incident,
                    IncidentState::Resolved,
                    format!("tasks on {gpu} stopped; the MPS server can recover"),
                );
            }
            Command::Quarantine => self.advance(Step::Quarantine),
            Command::Drain { .. } => self.advance(Step::Drain),
            Command::Replace => self.advance(Step::Replace),
            Command::CompleteLifecycle { .. } => self.advance(Step::CompleteLifecycle),
            Command::CollectEvidence => self.evidence_ended(order, None, "no archive reported"),
            Command::Reboot { .. } => self.reboot_accepted(order.incident),
            Command::BootCheck => self.advance(Step::BootCheck),
            Command::Diagnose { .. } => self.diagnosed(order.incident, None),
            Command::Restore
                if self
                    .st
                    .remediation
                    .is_some_and(|r| r.diagnosed && !r.rebooted) =>
            {
                self.diagnosed_healthy(order.incident)
            }
            Command::Restore
                if self
                    .st
                    .remediation
                    .is_some_and(|r| r.goal == Goal::Reboot && r.rebooted) =>
            {
                self.repaired(order.incident)
            }
            Command::Restore => {
                self.st.remediation = None;
                self.st.node = NodePhase::InService;
                let incident = order.incident;
                self.st.gpus.retain(|_, g| g.incident != Some(incident));
                match self.planned_restored(incident) {
                    Some(summary) => self.close(incident, IncidentState::Resolved, summary),
                    None => self.close(
                        incident,
                        IncidentState::Aborted,
                        "aborted by an operator: the instance is ACTIVE and takes tasks again",
                    ),
                }
            }
        }
    }

    fn order_failed(&mut self, order: &Order, why: &str) {
        match &order.command {
            Command::RestartMps => {
                self.st.mps.phase = MpsPhase::Unresponsive;
                self.note(order.incident, format!("MPS restart failed: {why}"));
                let used = u32::try_from(self.st.mps.restarts.len()).unwrap_or(u32::MAX);
                if used < self.policy.mps.restart_budget {
                    self.schedule(
                        order.incident,
                        Command::RestartMps,
                        used.saturating_add(1),
                        self.policy.retry.delay,
                    );
                } else {
                    self.mps_try_restart(order.incident);
                }
            }
            Command::StopTasks { gpu, .. } if !self.st.capabilities.mps => {
                self.st.gpu_jobs.remove(&gpu.index);
                self.close(
                    order.incident,
                    IncidentState::Failed,
                    format!("could not stop the tasks on {gpu} ({why}); {MPS_NOT_MANAGED}; operator needed"),
                );
            }
            Command::StopTasks { gpu, .. } => {
                self.st.gpu_jobs.remove(&gpu.index);
                let reason = format!(
                    "could not stop the tasks on {gpu} ({why}); restarting the MPS daemon clears its servers"
                );
                self.escalated(
                    order.incident,
                    Verdict::RestartMps,
                    "stop-tasks-failed",
                    reason,
                );
                if self.st.mps.incident.is_none() {
                    self.st.mps.incident = Some(order.incident);
                    self.mps_try_restart(order.incident);
                } else {
                    self.close(
                        order.incident,
                        IncidentState::Failed,
                        "an MPS restart is already under way",
                    );
                }
            }
            Command::Quarantine => self.step_failed(Step::Quarantine, why),
            Command::Drain { .. } => self.step_failed(Step::Drain, why),
            Command::Replace => self.step_failed(Step::Replace, why),
            Command::CompleteLifecycle { .. } => self.step_failed(Step::CompleteLifecycle, why),
            Command::Restore => self.step_failed(Step::Restore, why),
            Command::CollectEvidence => self.evidence_ended(order, None, why),
            Command::Reboot { .. } => self.step_failed(Step::Reboot, why),
            Command::BootCheck => self.step_failed(Step::BootCheck, why),
            Command::Diagnose { .. } => self.step_failed(Step::Diagnose, why),
        }
    }

    // ---- operator requests ----

    /// Stops a node remediation that has not reached Auto Scaling yet and returns the
    /// instance to service. Later steps are refused: once Auto Scaling was told to replace
    /// the instance, undoing it is Auto Scaling's business.
    fn abort(&mut self, incident: IncidentId, by: &str) {
        let who = if by.is_empty() { "an operator" } else { by };
        let Some(rem) = self.st.remediation.filter(|r| r.incident == incident) else {
            if self.st.open.contains_key(&incident) || self.st.node_incident == Some(incident) {
                self.note(
                    incident,
                    format!("abort requested by {who}: no quarantine or drain of this incident is in progress; nothing to undo"),
                );
            }
            return;
        };
        let refuse = match (rem.goal, rem.step) {
            (Goal::Terminate, _) => Some("Auto Scaling is terminating the instance"),
            (_, Step::Replace | Step::CompleteLifecycle) => {
                Some("Auto Scaling has already been asked to replace the instance")
            }
            (_, Step::Reboot | Step::AwaitBoot) => {
                Some("the instance has been asked to reboot; abort after the boot")
            }
            _ => None,
        };
        if let Some(why) = refuse {
            self.note(incident, format!("abort requested by {who} refused: {why}"));
            return;
        }
        // An evidence collection changes nothing on the node: it runs on and its archive is
        // recorded, but the step it held back is dropped with the rest of the repair.
        let cancelled: Vec<ActionId> = self
            .st
            .in_flight
            .values()
            .filter(|o| o.incident == incident && o.command != Command::CollectEvidence)
            .map(|o| o.id)
            .collect();
        for id in &cancelled {
            self.st.in_flight.remove(id);
        }
        if let Some(w) = self.st.evidence.as_mut().filter(|w| w.incident == incident) {
            w.held = None;
        }
        self.st.scheduled.retain(|s| s.incident != incident);
        self.repair_aborted(incident);
        self.escalated(
            incident,
            Verdict::Log,
            "operator-abort",
            format!("abort requested by {who}: returning the instance to service"),
        );
        self.st.remediation = Some(Remediation {
            step: Step::Restore,
            goal: if rem.goal == Goal::Reboot {
                Goal::Drain
            } else {
                rem.goal
            },
            ..rem
        });
        self.issue(incident, Command::Restore, 1);
    }

    /// Journals a launch gate run: the gate decided and completed the hook itself.
    fn launch_gate(&mut self, health: &str, summary: &str, findings: &[String], ids: &[String]) {
        let obs = Observation::new(Signal::Lifecycle {
            state: LifecycleState::Pending,
        })
        .with_detail(format!("launch gate: {health}"))
        .from_source("launch-gate");
        let reason = "the launch gate checked the GPUs before the instance entered service";
        let id = self.open(&obs, RULE_LAUNCH_GATE, reason, Verdict::Log);
        for f in findings {
            self.note(id, format!("finding: {f}"));
        }
        if !ids.is_empty() {
            self.note(id, format!("requests: {}", ids.join(", ")));
        }
        self.close(id, IncidentState::Logged, summary.to_string());
    }

    fn tick(&mut self) {
        self.expire_drills();
        let now = self.now;
        let overdue: Vec<Order> = self
            .st
            .in_flight
            .values()
            .filter(|o| o.deadline <= now)
            .cloned()
            .collect();
        for order in overdue {
            self.st.in_flight.remove(&order.id);
            let escalation = match &order.command {
                Command::RestartMps => "counted as a failed restart",
                Command::StopTasks { .. } => "escalating to an MPS restart",
                Command::Quarantine => "moving on to the drain",
                Command::Drain { .. } => "moving on without a finished drain",
                Command::Replace => "giving up on the replacement",
                Command::Restore => "giving up on returning the instance to service",
                Command::Reboot { .. } => "the reboot did not happen: replacing",
                Command::BootCheck => "not healthy after the reboot: replacing",
                Command::Diagnose { .. } => "the diagnosis did not finish: it could not tell",
                Command::CompleteLifecycle { .. } => "leaving the hook to its timeout",
                Command::CollectEvidence => "the repair goes on without the evidence",
            };
            self.record(
                order.incident,
                IncidentEvent::DeadlineMissed {
                    action: order.id,
                    escalation: escalation.to_string(),
                },
            );
            let why = format!("{} overran its deadline", order.command.name());
            self.order_failed(&order, &why);
        }
        let (due, later): (Vec<Scheduled>, Vec<Scheduled>) = std::mem::take(&mut self.st.scheduled)
            .into_iter()
            .partition(|s| s.at <= now);
        self.st.scheduled = later;
        for s in due {
            self.reissue(s);
        }
        self.await_boot_overdue();
        self.planned_tick();
        self.st
            .recent_logs
            .retain(|_, r| now.since(r.at) < LOG_REPEAT_WINDOW || r.repeats > 0);
        let keep: std::collections::BTreeSet<IncidentId> = self
            .st
            .open
            .keys()
            .copied()
            .chain(self.st.gpus.values().filter_map(|g| g.incident))
            .chain(self.st.node_incident)
            .chain(self.st.withheld.as_ref().map(|w| w.incident))
            .collect();
        self.st.attached.retain(|id, _| keep.contains(id));
        let longest = self.longest_window();
        self.st.sightings.retain(|_, seen| {
            seen.retain(|t| now.since(*t) <= longest);
            !seen.is_empty()
        });
    }

    fn reissue(&mut self, s: Scheduled) {
        match &s.command {
            Command::RestartMps => {
                if self.st.mps.phase != MpsPhase::Up && self.st.mps.incident == Some(s.incident) {
                    self.mps_try_restart(s.incident);
                }
            }
            Command::StopTasks { gpu, .. } => {
                if self.st.gpu_jobs.get(&gpu.index) == Some(&s.incident) {
                    self.issue(s.incident, s.command.clone(), s.attempt);
                }
            }
            _ => {
                let Some(rem) = self.st.remediation else {
                    return;
                };
                if rem.incident == s.incident {
                    let step = match s.command {
                        Command::Quarantine => Step::Quarantine,
                        Command::Drain { .. } => Step::Drain,
                        Command::Replace => Step::Replace,
                        Command::Restore => Step::Restore,
                        Command::Reboot { .. } => Step::Reboot,
                        Command::BootCheck => Step::BootCheck,
                        Command::Diagnose { .. } => Step::Diagnose,
                        _ => Step::CompleteLifecycle,
                    };
                    self.start_step(s.incident, step, s.attempt);
                }
            }
        }
    }

    fn longest_window(&self) -> Duration {
        self.policy
            .rules
            .iter()
            .flat_map(|r| {
                r.confirm
                    .map(|c| c.window)
                    .into_iter()
                    .chain(r.escalate.map(|e| e.window))
            })
            .max()
            .unwrap_or_default()
    }
}

fn attach_key(obs: &Observation) -> String {
    let gpu = obs
        .gpu
        .as_ref()
        .map_or("node".to_string(), |g| g.index.to_string());
    format!("{}@{gpu}", obs.signal)
}

/// The class target of a log-only finding: a GPU, the MPS daemon or the node, whatever the
/// code.
fn class_target(obs: &Observation) -> String {
    if obs.signal.kind().is_mps() && obs.signal.kind() != SignalKind::MpsServerFault {
        return "mps".to_string();
    }
    // A task over its GPU memory reservation is the task's matter: two tasks crossing on one
    // GPU are two incidents, not one coalesced class.
    // So are a task's processes outside MPS or without their limits, and a container over
    // its reservation; a process outside MPS in no task is its own matter.
    let per_task = matches!(
        obs.signal.kind(),
        SignalKind::GpuMemoryOverReservation
            | SignalKind::MpsBypass
            | SignalKind::MpsLimitMismatch
            | SignalKind::ContainerGpuMemoryOverReservation
    );
    if per_task && let Some(task) = obs.tasks.first() {
        // Each client off its limits is a finding of its own (once per process).
        if obs.signal.kind() == SignalKind::MpsLimitMismatch
            && let Some(pid) = obs.pids.first()
        {
            return format!("task/{task}/pid/{pid}");
        }
        return format!("task/{task}");
    }
    if obs.signal.kind() == SignalKind::MpsBypass
        && let Some(pid) = obs.pids.first()
    {
        return format!("pid/{pid}");
    }
    match &obs.gpu {
        Some(g) => format!("gpu{}", g.index),
        None => "node".to_string(),
    }
}

/// What a sighting counts against: a GPU, the MPS daemon, or the node.
fn target_key(obs: &Observation) -> String {
    let target = class_target(obs);
    // "The same XID repeating on a GPU": each code counts on its own, even when one rule
    // names several.
    match obs.signal {
        Signal::Xid { code, .. } => format!("{target}/xid{code}"),
        _ => target,
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod trust_tests;
