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
//!
//! This file is the coordinator: `step` routes each input, `judge` finds the rule, `dispatch`
//! hands the verdict to the concern that carries it out, and an order's end goes back to the
//! concern that issued it (`outcome`, `tick`). Each concern is a file with its own part of
//! [`State`] (`incidents`, `orders`, `node`, `mps`, `gpus`, `drills`, `evidence`, `repair`,
//! `diagnose`, `planned`, `attribution`); the rules between concerns are written here
//! (docs/architecture.md, "How it works": the concern table and an XID 79 followed through).

pub mod attribution;
pub mod check;
pub mod diagnose;
mod drills;
mod evidence;
mod gpus;
mod incidents;
mod mps;
mod node;
mod orders;
pub mod planned;
pub mod rebuild;
pub mod repair;
mod state;

pub use evidence::EvidenceWait;

pub use drills::{ArmedDrill, DrillMark, Drills, MAX_ARMED_DRILLS, MAX_DRILL_INCIDENTS};
pub use gpus::{GpuHealth, GpuStatus, Gpus};
pub use incidents::{Incidents, OpenIncident, RecentLog, SelfFault};
pub use mps::{MpsPhase, MpsState, OwnExit};
pub use node::{Goal, Node, NodePhase, Remediation, Step, Withheld};
pub use orders::{Orders, Scheduled};
pub use state::{Delivery, MAX_COUNTER, STATE_FORMAT, Sightings, State, StreamCursor, writer};

use std::time::Duration;

use crate::model::{
    Action, Command, IncidentId, IncidentState, Input, Observation, OperatorRequest, Order,
    Outcome, OutcomeStatus, Signal, SignalKind, Timestamp, Verdict,
};
use crate::policy::{Policy, Rule};

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
        Input::Reboots { reboots, .. } => cx.st.repair.merge(reboots),
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
    /// An observation from a probe, judged as the signal of the drill armed for it if any
    /// (the incident it opens is the drill's).
    fn observation(&mut self, obs: Observation) {
        self.drill = self.st.drills.matching(&obs, self.now);
        self.observe(obs);
        self.drill = None;
    }

    fn observe(&mut self, obs: Observation) {
        if planned::handles(&obs.signal) {
            self.planned_observe(obs);
            return;
        }
        match &obs.signal {
            Signal::MpsUp => {
                // An answer ends the daemon's "down" and "not answering" windows, not its
                // crashes: a daemon whose servers (or itself, under systemd's Restart=) keep
                // dying may answer every probe in between.
                let liveness: Vec<String> = self
                    .policy
                    .rules
                    .iter()
                    .filter(|r| {
                        matches!(r.signal, SignalKind::MpsDown | SignalKind::MpsUnresponsive)
                    })
                    .map(|r| format!("{}@mps", r.name))
                    .collect();
                self.st.sightings.retain(|k, _| !liveness.contains(k));
                self.mps_up(&obs)
            }
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

    /// A record nothing else witnessed may be anyone's text (`Observation::unwitnessed`): it
    /// is recorded under its rule, never acted on, and never counted toward a rule's windows,
    /// `suspect` or `culprit` (a forged record must not make a real one act).
    fn unwitnessed(&mut self, obs: &Observation, rule: &crate::policy::Rule, why: &str) {
        let class = format!("{}/unwitnessed@{}", rule.name, class_target(obs));
        if self.st.incidents.log_repeat(&class, obs, self.now) {
            return;
        }
        let reason = format!(
            "{} by rule `{}` would be `{}`; not taken: {why}; it needs a second witness (NVML's event for the same XID, or the GPU's own state)",
            obs.signal,
            rule.name,
            rule.action.as_str()
        );
        self.log_incident(obs, &rule.name, &reason, &class);
    }

    fn judge(&mut self, obs: Observation) {
        let kind = obs.signal.kind();
        if self.st.mps.own_exit(&obs, self.now) || self.join_cause(&obs) {
            return;
        }
        let Some(rule) = self.policy.rule_for(&obs.signal, obs.value) else {
            if self.policy.rules.iter().any(|r| r.signal == kind) {
                return; // below every threshold: not a finding
            }
            let class = format!("{RULE_NONE}/{}@{}", kind.as_str(), class_target(&obs));
            if self.st.incidents.log_repeat(&class, &obs, self.now) {
                return;
            }
            let reason = format!("no rule judges `{}`; recorded only", kind.as_str());
            self.log_incident(&obs, RULE_NONE, &reason, &class);
            return;
        };
        if rule.action == Verdict::Ignore {
            return;
        }
        if let Some(why) = obs.unwitnessed.clone() {
            self.unwitnessed(&obs, rule, &why);
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
        let keep = rule.window();
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
        if verdict == Verdict::Log && self.st.incidents.log_repeat(&class, &obs, self.now) {
            return;
        }
        self.dispatch(obs, verdict, &rule_name, &reason, &class);
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
            && let Some(h) = self.st.gpus.health.get(&gpu.index)
            && h.status == GpuStatus::Faulted
            && h.verdict >= verdict
            && let Some(id) = h.incident
        {
            self.attach(id, &obs);
            // The same fault seen again after the reboot that was to mend it.
            if self
                .st
                .node
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
}

/// The rules between concerns: an order's end goes back to the concern that issued it, and
/// a tick sweeps each concern in turn. Every call from one concern's state into another's
/// is here or in `judge`/`dispatch` above.
impl Cx<'_> {
    fn outcome(&mut self, outcome: Outcome) {
        let Some(order) = self.order_finished(&outcome) else {
            return; // late outcome of an order already escalated past its deadline
        };
        if order.command == Command::RestartMps {
            self.st.mps.restart_ended(self.now);
        }
        match &order.command {
            // Its own retries are the remedy's (the upload backs off); the engine only records
            // the end and lets a held step go.
            Command::CollectEvidence => {
                self.evidence_ended(&order, Some(&outcome), &orders::failure(&outcome));
                return;
            }
            Command::Diagnose { .. } if outcome.status == OutcomeStatus::Done => {
                self.diagnosed(order.incident, outcome.diagnosis.as_deref());
                return;
            }
            _ => {}
        }
        match self.order_retry(&order, &outcome) {
            Some(Ok(())) => self.order_done(&order),
            Some(Err(why)) => self.order_failed(&order, &why),
            None => {}
        }
    }

    fn order_done(&mut self, order: &Order) {
        let incident = order.incident;
        match &order.command {
            Command::RestartMps => {
                // A daemon restarted afresh starts its windows afresh.
                self.st.sightings.retain(|k, _| !k.ends_with("@mps"));
                self.mps_restarted(incident);
            }
            Command::StopTasks { gpu, .. } => self.tasks_stopped(incident, gpu),
            Command::CollectEvidence => self.evidence_ended(order, None, "no archive reported"),
            Command::Reboot { .. } => self.reboot_accepted(incident),
            Command::Diagnose { .. } => self.diagnosed(incident, None),
            Command::Restore => match self.st.node.remediation {
                Some(r) if r.diagnosed && !r.rebooted => self.diagnosed_healthy(incident),
                Some(r) if r.returned_untested && !r.rebooted => self.returned_untested(incident),
                Some(r) if r.goal == Goal::Reboot && r.rebooted => self.repaired(incident),
                _ => {
                    self.back_in_service(incident);
                    match self.planned_restored(incident) {
                        Some(summary) => self.close(incident, IncidentState::Resolved, summary),
                        None => self.close(
                            incident,
                            IncidentState::Aborted,
                            "aborted by an operator: the instance is ACTIVE and takes tasks again",
                        ),
                    }
                }
            },
            command => {
                if let Some(step) = Step::of(command) {
                    self.advance(step);
                }
            }
        }
    }

    fn order_failed(&mut self, order: &Order, why: &str) {
        let incident = order.incident;
        match &order.command {
            Command::RestartMps => self.mps_restart_failed(incident, why),
            Command::StopTasks { gpu, .. } => {
                self.st.gpus.jobs.remove(&gpu.index);
                if !self.st.capabilities.mps {
                    self.close(
                        incident,
                        IncidentState::Failed,
                        format!("could not stop the tasks on {gpu} ({why}); {MPS_NOT_MANAGED}; operator needed"),
                    );
                    return;
                }
                // Tasks that would not stop: restarting the daemon clears its servers.
                let reason = format!(
                    "could not stop the tasks on {gpu} ({why}); restarting the MPS daemon clears its servers"
                );
                self.escalated(incident, Verdict::RestartMps, "stop-tasks-failed", reason);
                if self.st.mps.incident.is_none() {
                    self.st.mps.incident = Some(incident);
                    self.mps_try_restart(incident);
                } else {
                    self.close(
                        incident,
                        IncidentState::Failed,
                        "an MPS restart is already under way",
                    );
                }
            }
            Command::CollectEvidence => self.evidence_ended(order, None, why),
            command => {
                if let Some(step) = Step::of(command) {
                    self.step_failed(step, why);
                }
            }
        }
    }

    /// The node is back in service: its remediation is over, and the GPUs its incident
    /// judged are forgotten (they passed what brought the node back).
    pub(super) fn back_in_service(&mut self, incident: IncidentId) {
        self.st.node.end(NodePhase::InService);
        self.st.gpus.forget(incident);
    }

    /// A scheduled order comes due: issued again if its concern still wants it.
    fn reissue(&mut self, s: Scheduled) {
        match &s.command {
            Command::RestartMps => self.mps_retry(s.incident),
            Command::StopTasks { gpu, .. } => {
                if self.st.gpus.jobs.get(&gpu.index) == Some(&s.incident) {
                    self.issue(s.incident, s.command.clone(), s.attempt);
                }
            }
            command => {
                if let Some(step) = Step::of(command)
                    && self
                        .st
                        .node
                        .remediation
                        .is_some_and(|r| r.incident == s.incident)
                {
                    self.start_step(s.incident, step, s.attempt);
                }
            }
        }
    }

    fn tick(&mut self) {
        self.st.drills.expire(self.now);
        for order in self.orders_overdue() {
            let why = format!("{} overran its deadline", order.command.name());
            self.order_failed(&order, &why);
        }
        for s in self.st.orders.take_due(self.now) {
            self.reissue(s);
        }
        self.await_boot_overdue();
        self.planned_tick();
        let now = self.now;
        self.st.incidents.forget_stale_logs(now);
        // An incident's attached signals are kept while anything still names it.
        let keep: std::collections::BTreeSet<IncidentId> = self
            .st
            .incidents
            .open
            .keys()
            .copied()
            .chain(self.st.gpus.health.values().filter_map(|g| g.incident))
            .chain(self.st.node.incident)
            .chain(self.st.node.withheld.as_ref().map(|w| w.incident))
            .collect();
        self.st.incidents.attached.retain(|id, _| keep.contains(id));
        let longest = self
            .policy
            .rules
            .iter()
            .map(Rule::window)
            .max()
            .unwrap_or_default();
        self.st.sightings.retain(|_, seen| {
            seen.retain(|t| now.since(*t) <= longest);
            !seen.is_empty()
        });
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
            | SignalKind::MpsClientNotOnGpu
            | SignalKind::MpsClientNoServer
            | SignalKind::MpsWrongServer
    );
    // Findings about one process (once per process): each is its own matter, in its task
    // or in none.
    let per_process = matches!(
        obs.signal.kind(),
        SignalKind::MpsLimitMismatch
            | SignalKind::MpsClientNotOnGpu
            | SignalKind::MpsClientNoServer
            | SignalKind::MpsWrongServer
    );
    if per_task && let Some(task) = obs.tasks.first() {
        // Each client off its limits is a finding of its own (once per process).
        if per_process && let Some(pid) = obs.pids.first() {
            return format!("task/{task}/pid/{pid}");
        }
        return format!("task/{task}");
    }
    if (per_process || obs.signal.kind() == SignalKind::MpsBypass)
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
