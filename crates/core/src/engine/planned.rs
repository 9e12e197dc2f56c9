//! Disruptions AWS plans for this instance (docs/planned-events.md), judged ahead of time:
//!
//! - **instance-retirement / instance-stop**: the drain starts `[planned] lead` before the
//!   event's NotBefore; then Auto Scaling is asked to replace the instance (`replace_on_stop`),
//!   so the replacement is in service before AWS stops this one;
//! - **instance-reboot / system-reboot / system-maintenance**: the drain starts at the lead; the
//!   instance stays drained until AWS reports the event completed and, for a reboot, the
//!   instance runs a new boot (a new boot id); then it returns to service (quarantine lifted,
//!   ACTIVE);
//! - **Spot interruption**: the drain starts at once and ends `margin` before the interruption
//!   time, stopping what is left (standalone tasks included) before it; a terminate lifecycle
//!   action that follows is completed by the usual terminate flow; a container instance the ECS
//!   agent already set DRAINING is never set back;
//! - **rebalance recommendation**: logged, or drained within the fleet budget when the operator
//!   says so (`[planned] rebalance = "drain"`);
//! - **canceled**: what the event started is undone (quarantine lifted, ACTIVE again);
//! - an event whose window already ended, or a code this gpu-medic does not know: recorded only.
//!
//! A planned drain or replacement is never deferred by the fleet budget (AWS takes the
//! instance out of service anyway: its orders say `planned`), but while it runs it is the node
//! remediation, so a fault's drain joins it instead of starting another.
//!
//! The ECS agent's own verdict (`ecs-agent-impaired`) is a second opinion: it is shown beside
//! gpu-medic's own in the incidents it concerns and in `status`, and on its own it is judged
//! by the policy (default: recorded, no drain). INSUFFICIENT_DATA is no fault.

use std::collections::BTreeSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Cx, RULE_SELF_FAULT};
use super::{Goal, NodePhase, Remediation, State, Step};
use crate::model::{
    AgentVerdict, Command, EventClass, EventState, IncidentId, IncidentState, Observation,
    ScheduledEvent, Signal, SignalKind, Timestamp, Verdict,
};
use crate::policy::planned::Rebalance;

/// Rule names of planned disruptions start with this (`planned-instance-retirement`).
pub const RULE_PREFIX: &str = "planned-";
/// The key of the Spot interruption notice (there is at most one).
pub const SPOT_KEY: &str = "spot";
/// The key of the rebalance recommendation.
pub const REBALANCE_KEY: &str = "rebalance";
/// At most this many disruptions are remembered (finished ones go first).
pub const MAX_PLANNED: usize = 64;
/// A planned drain has at least this long, even when AWS acts sooner.
const MIN_DRAIN: Duration = Duration::from_secs(10);

/// What a planned disruption does to the instance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Disruption {
    /// Retirement or stop: the instance goes away.
    Stop,
    /// The instance reboots (instance-reboot, system-reboot).
    Reboot,
    /// The host is worked on (system-maintenance).
    Maintenance,
    /// A Spot interruption (terminate, stop or hibernate).
    Spot,
    /// A rebalance recommendation.
    Rebalance,
    /// A code this gpu-medic does not know.
    Unknown,
}

/// Where gpu-medic is with one planned disruption.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PlannedPhase {
    /// Known; the drain starts at `drain_at`.
    Waiting,
    /// The drain (and replacement) is under way.
    Started,
    /// Drained ahead of a reboot or maintenance; waiting for it to be over.
    Drained,
    /// Nothing more to do.
    Done,
}

impl PlannedPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            PlannedPhase::Waiting => "waiting",
            PlannedPhase::Started => "started",
            PlannedPhase::Drained => "drained",
            PlannedPhase::Done => "done",
        }
    }
}

/// One planned disruption as the engine tracks it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlannedEvent {
    /// The event's code (`instance-retirement`), or `spot-interruption <action>`,
    /// `rebalance-recommendation`.
    pub what: String,
    pub disruption: Disruption,
    pub state: EventState,
    /// When AWS may act (the Spot interruption time; the rebalance notice time).
    pub not_before: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_after: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incident: Option<IncidentId>,
    /// When the drain starts (or started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_at: Option<Timestamp>,
    pub verdict: Verdict,
    pub phase: PlannedPhase,
    /// The boot id when the event was first seen: a new one after it means a reboot.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub boot_id: String,
    /// AWS takes the instance out of service anyway: no fleet-budget slot (false for a
    /// rebalance drain, which waits for the budget).
    pub planned: bool,
    /// What closes the incident once the instance is back in service.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub restore_summary: String,
    /// Completed without a new boot yet (said once).
    #[serde(default)]
    pub awaiting_boot: bool,
}

/// The planned disruptions known, and the ECS agent's verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Planned {
    /// By event id (`SPOT_KEY`, `REBALANCE_KEY` for those).
    #[serde(default)]
    pub events: crate::model::bounded::BoundedMap<String, PlannedEvent, MAX_PLANNED>,
    /// The ECS agent's verdict at its last change (None: never read).
    #[serde(default)]
    pub agent: Option<AgentVerdict>,
}

impl Planned {
    /// Keeps `e` under `key`. Full: the oldest finished disruption makes room; with every one
    /// of them under way the newest is judged, not kept.
    fn remember(&mut self, key: String, e: PlannedEvent) {
        let events = &mut self.events;
        if let Err((key, e)) = events.try_insert(key, e) {
            let oldest = events
                .iter()
                .filter(|(_, e)| e.phase == PlannedPhase::Done)
                .min_by_key(|(_, e)| e.not_before)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                events.remove(&k);
                let _ = events.try_insert(key, e);
            }
        }
    }

    fn set_phase(&mut self, key: &str, phase: PlannedPhase) {
        if let Some(e) = self.events.get_mut(key) {
            e.phase = phase;
        }
    }

    /// Events not finished (for `status` and the metrics).
    pub fn pending(&self) -> impl Iterator<Item = (&String, &PlannedEvent)> {
        self.events
            .iter()
            .filter(|(_, e)| e.phase != PlannedPhase::Done)
    }

    pub(super) fn by_incident(&self, id: IncidentId) -> Option<String> {
        self.events
            .iter()
            .find(|(_, e)| e.incident == Some(id) && e.phase != PlannedPhase::Done)
            .map(|(k, _)| k.clone())
    }

    fn spot_pending(&self) -> bool {
        self.events
            .get(SPOT_KEY)
            .is_some_and(|e| e.phase != PlannedPhase::Done || e.state == EventState::Active)
    }
}

/// Whether the engine hands this signal to this module.
pub fn handles(signal: &Signal) -> bool {
    matches!(
        signal.kind(),
        SignalKind::MaintenanceEvent
            | SignalKind::SpotInterruption
            | SignalKind::RebalanceRecommendation
            | SignalKind::SpotNoticeGone
            | SignalKind::EcsAgentImpaired
            | SignalKind::EcsAgentHealth
    )
}

fn disruption_of(class: EventClass) -> Disruption {
    match class {
        EventClass::Stop => Disruption::Stop,
        EventClass::Reboot => Disruption::Reboot,
        EventClass::Maintenance => Disruption::Maintenance,
        EventClass::Unknown => Disruption::Unknown,
    }
}

fn fmt_d(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(d)
}

impl Cx<'_> {
    pub(super) fn planned_observe(&mut self, obs: Observation) {
        match &obs.signal {
            Signal::MaintenanceEvent { event } => {
                let event = event.clone();
                self.scheduled_event(&obs, event)
            }
            Signal::SpotInterruption { action, time } => {
                let (action, time) = (action.clone(), *time);
                self.spot(&obs, &action, time)
            }
            Signal::RebalanceRecommendation { notice } => {
                let notice = *notice;
                self.rebalance(&obs, notice)
            }
            Signal::SpotNoticeGone { time, .. } => {
                let time = *time;
                self.spot_gone(&obs, time)
            }
            Signal::EcsAgentImpaired => self.agent_impaired(obs),
            Signal::EcsAgentHealth { status } => {
                let status = status.clone();
                self.agent_health(&obs, status)
            }
            _ => {}
        }
    }

    /// Records a planned disruption that needs nothing done, as a closed incident.
    fn planned_log(&mut self, obs: &Observation, rule: &str, reason: &str) -> IncidentId {
        let id = self.open(obs, rule, reason, Verdict::Log);
        self.close(id, IncidentState::Logged, format!("recorded: {reason}"));
        id
    }

    // ---- scheduled events ----

    fn scheduled_event(&mut self, obs: &Observation, ev: ScheduledEvent) {
        let key = if ev.id.is_empty() {
            format!("{}@{}", ev.code, ev.not_before)
        } else {
            ev.id.clone()
        };
        let Some(known) = self.st.planned.events.get(&key).cloned() else {
            self.new_event(obs, key, &ev);
            return;
        };
        let state_changed = known.state != ev.state;
        let times_changed = known.not_before != ev.not_before || known.not_after != ev.not_after;
        let rebooted =
            !ev.boot_id.is_empty() && !known.boot_id.is_empty() && ev.boot_id != known.boot_id;
        if times_changed
            && let Some(why) =
                crate::model::planned::implausible_event(self.now, ev.not_before, ev.not_after)
        {
            // Moved to times AWS never gives: the event keeps the times it had.
            if let Some(id) = known
                .incident
                .filter(|id| self.st.incidents.open.contains_key(id))
            {
                self.note(
                    id,
                    format!("implausible reschedule ignored: {why} (docs/planned-events.md#plausible-notices)"),
                );
            }
            return;
        }
        if let Some(e) = self.st.planned.events.get_mut(&key) {
            e.state = ev.state;
            e.not_before = ev.not_before;
            e.not_after = ev.not_after;
        }
        if let Some(id) = known.incident
            && (state_changed || times_changed)
            && self.st.incidents.open.contains_key(&id)
        {
            self.attach(id, obs);
        }
        match ev.state {
            EventState::Canceled if state_changed => {
                let text = format!(
                    "AWS canceled {}: quarantine lifted, the instance is ACTIVE and takes tasks again",
                    known.what
                );
                self.undo(
                    &key,
                    "AWS canceled the event before its drain began; nothing to undo",
                    text,
                );
            }
            EventState::Completed if state_changed || rebooted => self.completed(&key, rebooted),
            EventState::Active if times_changed => self.rescheduled(&key),
            _ => {}
        }
    }

    fn new_event(&mut self, obs: &Observation, key: String, ev: &ScheduledEvent) {
        let disruption = disruption_of(ev.class());
        let rules = self.policy.planned;
        let rule = format!("{RULE_PREFIX}{}", ev.code);
        let mut entry = PlannedEvent {
            what: format!("{} {}", ev.code, key),
            disruption,
            state: ev.state,
            not_before: ev.not_before,
            not_after: ev.not_after,
            incident: None,
            drain_at: None,
            verdict: Verdict::Log,
            phase: PlannedPhase::Done,
            boot_id: ev.boot_id.clone(),
            planned: true,
            restore_summary: String::new(),
            awaiting_boot: false,
        };
        if ev.state != EventState::Active {
            // First seen already over (a history AWS keeps listing): nothing to do about it.
            self.st.planned.remember(key, entry);
            return;
        }
        let end = ev.not_after.unwrap_or(ev.not_before);
        if end <= self.now {
            let reason = format!(
                "AWS lists {} (NotBefore {}) whose window ended at {end}: an event in the past; nothing is drained",
                entry.what, ev.not_before
            );
            entry.incident = Some(self.planned_log(obs, &rule, &reason));
            self.st.planned.remember(key, entry);
            return;
        }
        if let Some(why) =
            crate::model::planned::implausible_event(self.now, ev.not_before, ev.not_after)
        {
            let reason = format!(
                "implausible notice: {} {why}; not AWS's practice (docs/planned-events.md#plausible-notices), so nothing is drained",
                entry.what
            );
            entry.incident = Some(self.planned_log(obs, &rule, &reason));
            self.st.planned.remember(key, entry);
            return;
        }
        if disruption == Disruption::Unknown {
            let reason = format!(
                "AWS scheduled {} at {}, a code this gpu-medic does not know; recorded only (docs/planned-events.md)",
                entry.what, ev.not_before
            );
            entry.incident = Some(self.planned_log(obs, &rule, &reason));
            self.st.planned.remember(key, entry);
            return;
        }
        let verdict = match disruption {
            Disruption::Stop if rules.replace_on_stop => Verdict::Replace,
            _ => Verdict::Drain,
        };
        let drain_at = ev.not_before.minus(rules.lead).max(self.now);
        let after = match (disruption, verdict) {
            (Disruption::Stop, Verdict::Replace) => {
                "then Auto Scaling replaces the instance before AWS stops it"
            }
            (Disruption::Stop, _) => {
                "the instance is left drained for AWS to stop ([planned] replace_on_stop = false)"
            }
            (Disruption::Reboot, _) => {
                "after the reboot (a new boot id, the event completed) the instance returns to service"
            }
            _ => "once AWS reports the event completed the instance returns to service",
        };
        let reason = format!(
            "AWS scheduled {} for {}{}: a planned disruption, not a GPU fault; drained ahead ({} lead), never deferred by the fleet budget",
            entry.what,
            ev.not_before,
            ev.not_after.map(|t| format!(" to {t}")).unwrap_or_default(),
            fmt_d(rules.lead)
        );
        let id = self.open(obs, &rule, &reason, verdict);
        self.note(id, format!("drain starts at {drain_at}; {after}"));
        entry.incident = Some(id);
        entry.drain_at = Some(drain_at);
        entry.verdict = verdict;
        entry.phase = PlannedPhase::Waiting;
        self.st.planned.remember(key.clone(), entry);
        if drain_at <= self.now {
            self.planned_start(&key);
        }
    }

    fn rescheduled(&mut self, key: &str) {
        let lead = self.policy.planned.lead;
        let now = self.now;
        let Some(e) = self.st.planned.events.get_mut(key) else {
            return;
        };
        let Some(id) = e.incident else {
            return;
        };
        let nb = e.not_before;
        let text = match e.phase {
            PlannedPhase::Waiting => {
                let at = nb.minus(lead).max(now);
                e.drain_at = Some(at);
                format!(
                    "AWS rescheduled {} to NotBefore {nb}: drain starts at {at}",
                    e.what
                )
            }
            PlannedPhase::Done => return,
            _ => format!(
                "AWS rescheduled {} to NotBefore {nb}; the drain already began and goes on",
                e.what
            ),
        };
        let waiting = e.phase == PlannedPhase::Waiting && e.drain_at.is_some_and(|t| t <= now);
        self.note(id, text);
        if waiting {
            self.planned_start(key);
        }
    }

    fn completed(&mut self, key: &str, rebooted: bool) {
        let Some(e) = self.st.planned.events.get(key).cloned() else {
            return;
        };
        let Some(id) = e.incident else {
            self.st.planned.set_phase(key, PlannedPhase::Done);
            return;
        };
        match e.disruption {
            Disruption::Reboot if !rebooted && e.phase != PlannedPhase::Waiting => {
                if !e.awaiting_boot {
                    if let Some(x) = self.st.planned.events.get_mut(key) {
                        x.awaiting_boot = true;
                    }
                    self.note(
                        id,
                        format!(
                            "AWS reports {} completed, but this boot is the one before it (same boot id): the instance stays out of service until it runs a new boot",
                            e.what
                        ),
                    );
                }
            }
            Disruption::Reboot | Disruption::Maintenance => {
                let text = if rebooted {
                    format!(
                        "{} completed and the instance rebooted (new boot id): quarantine lifted, the instance is ACTIVE and takes tasks again",
                        e.what
                    )
                } else {
                    format!(
                        "{} completed: quarantine lifted, the instance is ACTIVE and takes tasks again",
                        e.what
                    )
                };
                self.undo(
                    key,
                    "AWS completed the event before its drain began; nothing to undo",
                    text,
                );
            }
            _ => {
                if e.phase == PlannedPhase::Waiting {
                    self.st.planned.set_phase(key, PlannedPhase::Done);
                    self.close(
                        id,
                        IncidentState::Resolved,
                        format!("AWS reports {} completed before its drain began", e.what),
                    );
                } else {
                    self.note(id, format!("AWS reports {} completed", e.what));
                }
            }
        }
    }

    /// Undoes what a planned disruption started (canceled, or over): `early` closes an
    /// incident whose drain had not begun; `restored` closes one returned to service.
    fn undo(&mut self, key: &str, early: &str, restored: String) {
        let Some(e) = self.st.planned.events.get(key).cloned() else {
            return;
        };
        let Some(id) = e.incident else {
            self.st.planned.set_phase(key, PlannedPhase::Done);
            return;
        };
        match e.phase {
            PlannedPhase::Done => {}
            PlannedPhase::Waiting => {
                self.st.planned.set_phase(key, PlannedPhase::Done);
                self.close(id, IncidentState::Resolved, early.to_string());
            }
            PlannedPhase::Started | PlannedPhase::Drained => {
                self.restore_planned(key, id, restored)
            }
        }
    }

    fn restore_planned(&mut self, key: &str, id: IncidentId, summary: String) {
        if key != SPOT_KEY && self.st.planned.spot_pending() {
            self.note(
                id,
                "a Spot interruption is pending: the instance stays draining (never set back ACTIVE against the ECS agent's own Spot draining)",
            );
            return;
        }
        let rem = self.st.node.remediation.filter(|r| r.incident == id);
        let owns_node = self.st.node.incident == Some(id)
            && matches!(
                self.st.node.phase,
                NodePhase::Drained | NodePhase::Quarantined | NodePhase::Draining
            );
        if let Some(r) = rem {
            if r.goal == Goal::Terminate
                || matches!(r.step, Step::Replace | Step::CompleteLifecycle)
            {
                self.note(
                    id,
                    "too late to undo: Auto Scaling has already been asked to replace or terminate the instance",
                );
                return;
            }
            if r.step == Step::Restore {
                return; // already on its way back
            }
        } else if !owns_node {
            // Nothing of ours holds the instance (observe-only, another incident's drain).
            self.st.planned.set_phase(key, PlannedPhase::Done);
            if self.st.incidents.open.contains_key(&id) {
                self.close(id, IncidentState::Resolved, summary);
            }
            return;
        }
        self.st.orders.cancel(id, |_| true);
        if let Some(x) = self.st.planned.events.get_mut(key) {
            x.restore_summary = summary;
        }
        let base = rem.unwrap_or_else(|| Remediation::new(id, Goal::Drain, Step::Restore));
        self.st.node.begin(Remediation {
            step: Step::Restore,
            ..base
        });
        self.start_step(id, Step::Restore, 1);
    }

    /// The drain of a waiting scheduled event is due (or a Spot notice, a rebalance drain).
    fn planned_start(&mut self, key: &str) {
        let Some(e) = self.st.planned.events.get(key).cloned() else {
            return;
        };
        let Some(id) = e.incident else {
            return;
        };
        self.st.planned.set_phase(key, PlannedPhase::Started);
        if let Some(rem) = self.st.node.remediation.filter(|r| r.incident != id) {
            self.note(
                rem.incident,
                format!(
                    "AWS's planned {} at {} (incident {id}) finds this remediation under way: it already takes the instance out of service",
                    e.what, e.not_before
                ),
            );
            if e.verdict == Verdict::Replace && rem.goal == Goal::Drain {
                if let Some(r) = self.st.node.remediation.as_mut() {
                    r.goal = Goal::Replace;
                }
                self.escalated(
                    rem.incident,
                    Verdict::Replace,
                    &format!("{RULE_PREFIX}{}", e.what),
                    format!(
                        "upgraded from drain to replace: AWS stops the instance at {}",
                        e.not_before
                    ),
                );
            }
            self.st.planned.set_phase(key, PlannedPhase::Done);
            self.close(
                id,
                IncidentState::Logged,
                format!(
                    "joins the node remediation of incident {}, already under way",
                    rem.incident
                ),
            );
            return;
        }
        let gone = matches!(
            self.st.node.phase,
            NodePhase::Replacing
                | NodePhase::Replaced
                | NodePhase::Terminating
                | NodePhase::Terminated
        );
        let drained_by_other = self.st.node.phase == NodePhase::Drained
            && self.st.node.incident != Some(id)
            && e.verdict != Verdict::Replace;
        if gone || drained_by_other {
            self.st.planned.set_phase(key, PlannedPhase::Done);
            self.close(
                id,
                IncidentState::Logged,
                format!(
                    "the instance is already {} (incident {}); nothing more to do ahead of {}",
                    self.st.node.phase.as_str(),
                    self.st
                        .node
                        .incident
                        .map_or("-".to_string(), |i| i.to_string()),
                    e.what
                ),
            );
            return;
        }
        self.remediate_in(id, e.verdict);
    }

    pub(super) fn planned_tick(&mut self) {
        let now = self.now;
        let due: Vec<String> = self
            .st
            .planned
            .events
            .iter()
            .filter(|(_, e)| {
                e.phase == PlannedPhase::Waiting && e.drain_at.is_some_and(|t| t <= now)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            self.planned_start(&key);
        }
    }

    // ---- Spot and rebalance ----

    fn spot(&mut self, obs: &Observation, action: &str, time: Timestamp) {
        if self
            .st
            .planned
            .events
            .get(SPOT_KEY)
            .is_some_and(|e| e.not_before == time)
        {
            return;
        }
        let margin = self.policy.planned.margin;
        let rule = format!("{RULE_PREFIX}spot-interruption");
        let mut entry = PlannedEvent {
            what: format!("spot-interruption {action}"),
            disruption: Disruption::Spot,
            state: EventState::Active,
            not_before: time,
            not_after: None,
            incident: None,
            drain_at: Some(self.now),
            verdict: Verdict::Drain,
            phase: PlannedPhase::Done,
            boot_id: String::new(),
            planned: true,
            restore_summary: String::new(),
            awaiting_boot: false,
        };
        if time <= self.now {
            let reason = format!(
                "AWS's Spot interruption ({action}) time {time} has already passed: an event in the past; nothing is drained"
            );
            entry.incident = Some(self.planned_log(obs, &rule, &reason));
            self.st.planned.remember(SPOT_KEY.to_string(), entry);
            return;
        }
        if let Some(why) = crate::model::planned::implausible_spot(self.now, time) {
            let reason = format!(
                "implausible notice: Spot interruption ({action}): {why}; not AWS's practice (docs/planned-events.md#plausible-notices), so nothing is drained"
            );
            entry.incident = Some(self.planned_log(obs, &rule, &reason));
            self.st.planned.remember(SPOT_KEY.to_string(), entry);
            return;
        }
        let reason = format!(
            "AWS interrupts this Spot instance ({action}) at {time}: a planned disruption, not a GPU fault; drained at once, never deferred by the fleet budget"
        );
        let id = self.open(obs, &rule, &reason, Verdict::Drain);
        self.note(
            id,
            format!(
                "drain starts now; what still runs at {} (standalone tasks included) is stopped; a DRAINING set by the ECS agent is kept",
                time.minus(margin)
            ),
        );
        entry.incident = Some(id);
        entry.phase = PlannedPhase::Waiting;
        self.st.planned.remember(SPOT_KEY.to_string(), entry);
        self.planned_start(SPOT_KEY);
    }

    fn rebalance(&mut self, obs: &Observation, notice: Timestamp) {
        if self
            .st
            .planned
            .events
            .get(REBALANCE_KEY)
            .is_some_and(|e| e.not_before == notice)
        {
            return;
        }
        let rule = format!("{RULE_PREFIX}rebalance-recommendation");
        let mut entry = PlannedEvent {
            what: "rebalance-recommendation".into(),
            disruption: Disruption::Rebalance,
            state: EventState::Active,
            not_before: notice,
            not_after: None,
            incident: None,
            drain_at: None,
            verdict: Verdict::Log,
            phase: PlannedPhase::Done,
            boot_id: String::new(),
            planned: false,
            restore_summary: String::new(),
            awaiting_boot: false,
        };
        // A recommendation is dated when AWS issued it: one dated well ahead is not AWS's.
        if let Some(why) = crate::model::planned::implausible_spot(self.now, notice) {
            let reason = format!(
                "implausible notice: rebalance recommendation: {why}; not AWS's practice (docs/planned-events.md#plausible-notices), so nothing is drained"
            );
            entry.incident = Some(self.planned_log(obs, &rule, &reason));
            self.st.planned.remember(REBALANCE_KEY.to_string(), entry);
            return;
        }
        if self.policy.planned.rebalance == Rebalance::Log {
            let reason = format!(
                "AWS recommends moving work off this Spot instance (rebalance recommendation of {notice}); logged only ([planned] rebalance = \"log\")"
            );
            entry.incident = Some(self.planned_log(obs, &rule, &reason));
            self.st.planned.remember(REBALANCE_KEY.to_string(), entry);
            return;
        }
        let reason = format!(
            "AWS recommends moving work off this Spot instance (rebalance recommendation of {notice}): drained within the fleet budget ([planned] rebalance = \"drain\")"
        );
        let id = self.open(obs, &rule, &reason, Verdict::Drain);
        entry.incident = Some(id);
        entry.verdict = Verdict::Drain;
        entry.drain_at = Some(self.now);
        entry.phase = PlannedPhase::Waiting;
        self.st.planned.remember(REBALANCE_KEY.to_string(), entry);
        self.planned_start(REBALANCE_KEY);
    }

    // ---- notices that are gone ----

    /// IMDS no longer lists the Spot notice (404 again) and the instance still runs: AWS did
    /// not take it. What the notice started is undone, as for a canceled event.
    fn spot_gone(&mut self, obs: &Observation, time: Timestamp) {
        let Some(e) = self.st.planned.events.get(SPOT_KEY).cloned() else {
            return;
        };
        if e.not_before != time || e.state != EventState::Active {
            return;
        }
        if let Some(id) = e.incident {
            self.attach(id, obs);
        }
        let why = format!("IMDS no longer lists the {} at {time}", e.what);
        self.notice_gone(SPOT_KEY, &why);
    }

    /// A planned notice is gone (IMDS no longer lists it, or the operator cleared a drill's):
    /// what it started is undone like a canceled event's, and a notice whose drain finished
    /// (a Spot notice's incident closes once drained) gives the instance back too.
    fn notice_gone(&mut self, key: &str, why: &str) {
        let Some(e) = self.st.planned.events.get(key).cloned() else {
            return;
        };
        if let Some(x) = self.st.planned.events.get_mut(key) {
            x.state = EventState::Canceled;
        }
        let Some(id) = e.incident else {
            return;
        };
        if e.phase == PlannedPhase::Done {
            let held = self.st.node.incident == Some(id)
                && matches!(
                    self.st.node.phase,
                    NodePhase::Drained | NodePhase::Quarantined | NodePhase::Draining
                );
            if !held {
                self.note(id, format!("{why}: nothing of it holds the instance now"));
                return;
            }
            // Drained for it and left so: it is the notice's again to undo.
            self.st.planned.set_phase(key, PlannedPhase::Drained);
        }
        self.note(id, format!("{why}: what it started is undone"));
        self.undo(
            key,
            &format!("{why} before its drain began; nothing to undo"),
            format!("{why}: quarantine lifted, the instance is ACTIVE and takes tasks again"),
        );
    }

    /// `gpu-medic drill clear <id>`: the drill's rehearsed notice is gone, as if IMDS no
    /// longer listed it. A drill not yet judged is disarmed.
    pub(super) fn drill_clear(&mut self, drill: &str, by: &str) {
        self.st.drills.disarm(drill);
        let who = if by.is_empty() { "an operator" } else { by };
        let incidents: Vec<IncidentId> = self
            .st
            .drills
            .incidents
            .iter()
            .filter(|(_, m)| m.id == drill)
            .map(|(i, _)| *i)
            .collect();
        for id in incidents {
            let key = self
                .st
                .planned
                .events
                .iter()
                .find(|(_, e)| e.incident == Some(id) && e.state == EventState::Active)
                .map(|(k, _)| k.clone());
            if let Some(key) = key {
                let why = format!(
                    "drill {drill} cleared by {who}: the rehearsed notice is gone, as if IMDS no longer listed it"
                );
                self.notice_gone(&key, &why);
            }
        }
    }

    // ---- hooks the rest of the engine calls ----

    /// The deadline and budget exemption of an order for a planned disruption's incident
    /// (None, false: not one).
    pub(super) fn planned_order(
        &self,
        incident: IncidentId,
        command: &Command,
    ) -> (Option<Timestamp>, bool) {
        let Some(key) = self.st.planned.by_incident(incident) else {
            return (None, false);
        };
        let Some(e) = self.st.planned.events.get(&key) else {
            return (None, false);
        };
        let deadline = match command {
            Command::Drain { .. } if e.planned => {
                let by = e.not_before.minus(self.policy.planned.margin);
                let longest = self.now.plus(self.policy.deadlines.drain);
                Some(by.max(self.now.plus(MIN_DRAIN)).min(longest))
            }
            _ => None,
        };
        (deadline, e.planned)
    }

    /// A planned drain finished. Returns true when the incident stays open (drained ahead of a
    /// reboot or maintenance, waiting for it to be over).
    pub(super) fn planned_drained(&mut self, incident: IncidentId) -> bool {
        let Some(key) = self.st.planned.by_incident(incident) else {
            return false;
        };
        let Some(e) = self.st.planned.events.get(&key).cloned() else {
            return false;
        };
        if !matches!(e.disruption, Disruption::Reboot | Disruption::Maintenance) {
            return false;
        }
        self.st.planned.set_phase(&key, PlannedPhase::Drained);
        self.st.node.phase = NodePhase::Drained;
        self.note(
            incident,
            format!(
                "drained ahead of {} (NotBefore {}); the instance returns to service once it is over{}",
                e.what,
                e.not_before,
                if e.disruption == Disruption::Reboot {
                    " (a new boot id, the event completed)"
                } else {
                    " (the event completed)"
                }
            ),
        );
        true
    }

    /// How a planned disruption's incident reads when its remediation ends in `state`.
    pub(super) fn planned_summary(
        &mut self,
        incident: IncidentId,
        state: IncidentState,
    ) -> Option<String> {
        let key = self.st.planned.by_incident(incident)?;
        let e = self.st.planned.events.get(&key)?.clone();
        self.st.planned.set_phase(&key, PlannedPhase::Done);
        Some(match (e.disruption, state) {
            (Disruption::Stop, IncidentState::Replaced) => format!(
                "drained ahead of {} and marked Unhealthy: Auto Scaling replaces the instance before AWS stops it at {}",
                e.what, e.not_before
            ),
            (Disruption::Spot, IncidentState::Drained) => format!(
                "drained ahead of the {} at {}; AWS reclaims the instance",
                e.what, e.not_before
            ),
            (_, IncidentState::Drained) => format!(
                "drained ahead of {} at {}; left drained",
                e.what, e.not_before
            ),
            (_, IncidentState::Terminated) => format!(
                "drained ahead of {}; Auto Scaling terminates the instance, lifecycle hook completed with CONTINUE",
                e.what
            ),
            _ => return None,
        })
    }

    /// A planned disruption's instance is back in service: how its incident closes.
    pub(super) fn planned_restored(&mut self, incident: IncidentId) -> Option<String> {
        let key = self.st.planned.by_incident(incident)?;
        let summary = self.st.planned.events.get(&key)?.restore_summary.clone();
        self.st.planned.set_phase(&key, PlannedPhase::Done);
        Some(summary)
    }

    // ---- the ECS agent's verdict ----

    /// gpu-medic's own incidents the agent's verdict concerns: those open for a GPU or node
    /// fault, and the one that holds the node out of service.
    fn fault_incidents(&self) -> BTreeSet<IncidentId> {
        let mut out: BTreeSet<IncidentId> = self
            .st
            .incidents
            .open
            .iter()
            .filter(|(_, o)| {
                o.rule != RULE_SELF_FAULT
                    && !o.rule.starts_with(RULE_PREFIX)
                    && o.verdict > Verdict::Log
            })
            .map(|(id, _)| *id)
            .collect();
        out.extend(self.st.gpus.health.values().filter_map(|g| g.incident));
        if self.st.node.phase != NodePhase::InService
            && let Some(id) = self.st.node.incident
            && self.st.planned.by_incident(id).is_none()
        {
            out.insert(id);
        }
        out
    }

    fn agent_impaired(&mut self, obs: Observation) {
        if self
            .st
            .planned
            .agent
            .as_ref()
            .is_some_and(AgentVerdict::impaired)
        {
            return;
        }
        let detail = obs.detail.clone().unwrap_or_default();
        self.st.planned.agent = Some(AgentVerdict {
            status: "IMPAIRED".into(),
            since: self.now,
            detail: detail.clone(),
        });
        let targets = self.fault_incidents();
        for id in &targets {
            self.attach(*id, &obs);
            self.note(
                *id,
                format!("the ECS agent's own verdict, beside gpu-medic's: ACCELERATED_COMPUTE IMPAIRED ({detail})"),
            );
        }
        let acts = self
            .policy
            .rule_for(&obs.signal, obs.value)
            .is_some_and(|r| r.action > Verdict::Log);
        if acts || targets.is_empty() {
            self.judge(obs);
        }
    }

    fn agent_health(&mut self, obs: &Observation, status: String) {
        let was = self.st.planned.agent.clone();
        if was.as_ref().is_some_and(|a| a.status == status) {
            return;
        }
        self.st.planned.agent = Some(AgentVerdict {
            status: status.clone(),
            since: self.now,
            detail: obs.detail.clone().unwrap_or_default(),
        });
        if was.as_ref().is_some_and(AgentVerdict::impaired) {
            for id in self.fault_incidents() {
                if self.st.incidents.open.contains_key(&id) {
                    self.note(id, format!("the ECS agent's verdict is {status} again"));
                }
            }
        }
    }

    /// A new incident of gpu-medic's own while the ECS agent says IMPAIRED: the incident
    /// shows both verdicts.
    pub(super) fn corroborate(&mut self, id: IncidentId, obs: &Observation) {
        let kind = obs.signal.kind();
        if kind == SignalKind::EcsAgentImpaired || !SignalKind::JUDGED.contains(&kind) {
            return;
        }
        let Some(a) = self.st.planned.agent.clone().filter(AgentVerdict::impaired) else {
            return;
        };
        self.note(
            id,
            format!(
                "beside gpu-medic's verdict, the ECS agent's own: ACCELERATED_COMPUTE IMPAIRED since {} ({})",
                a.since, a.detail
            ),
        );
    }
}

/// `gpu-medic status` lines: upcoming disruptions with their plan, and the ECS agent's
/// verdict beside gpu-medic's.
pub fn status_lines(st: &State) -> Vec<String> {
    let mut out = Vec::new();
    for (_, e) in st.planned.pending() {
        let inc = e
            .incident
            .map_or(String::new(), |i| format!(", incident {i}"));
        let plan = match e.phase {
            PlannedPhase::Waiting => match e.drain_at {
                Some(t) => format!(
                    "drain starts at {t}{}",
                    if e.verdict == Verdict::Replace {
                        ", then Auto Scaling replaces the instance"
                    } else {
                        ""
                    }
                ),
                None => "recorded".to_string(),
            },
            PlannedPhase::Started => "drain under way".to_string(),
            PlannedPhase::Drained => "drained; back in service once it is over".to_string(),
            PlannedPhase::Done => continue,
        };
        out.push(format!(
            "planned:     {} ({}) at {}{}: {plan}{inc}",
            e.what,
            e.state.as_str(),
            e.not_before,
            e.not_after.map(|t| format!(" to {t}")).unwrap_or_default(),
        ));
    }
    for e in st.planned.events.values() {
        let Some(d) = e.incident.and_then(|i| st.drills.incidents.get(&i)) else {
            continue;
        };
        if e.state == EventState::Active {
            out.push(format!(
                "drill:       {} is rehearsed by drill {} until cleared: `gpu-medic drill clear {}`",
                e.what, d.id, d.id
            ));
        }
    }
    if let Some(a) = &st.planned.agent {
        let own = if st
            .gpus
            .health
            .values()
            .any(|g| g.status == super::GpuStatus::Faulted)
        {
            let faulted: Vec<String> = st
                .gpus
                .health
                .iter()
                .filter(|(_, g)| g.status == super::GpuStatus::Faulted)
                .map(|(i, g)| format!("GPU {i} faulted (rule `{}`)", g.rule))
                .collect();
            faulted.join(", ")
        } else {
            "no GPU fault".to_string()
        };
        let note = match a.status.as_str() {
            "IMPAIRED" => "corroborating only",
            "INSUFFICIENT_DATA" => "no data, not a fault",
            _ => "",
        };
        out.push(format!(
            "ecs agent:   ACCELERATED_COMPUTE {} since {}{}{}; gpu-medic: {own}",
            a.status,
            a.since,
            if a.detail.is_empty() {
                String::new()
            } else {
                format!(" ({})", a.detail)
            },
            if note.is_empty() {
                String::new()
            } else {
                format!(" [{note}]")
            },
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    //! The planned-disruption rules in virtual time: the clock is the `now` handed to `step`.

    use std::path::Path;

    use super::*;
    use crate::engine::step;
    use crate::model::{Action, Input, Order, Outcome, OutcomeStatus, Record};
    use crate::policy::Policy;

    const MIN: u64 = 60_000;
    const T0: u64 = 1_900_000_000_000;

    fn policy() -> Policy {
        let mut p = Policy::load_with(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies/default.toml"),
            &crate::policy::read_file,
        )
        .unwrap();
        p.planned.lead = Duration::from_secs(5 * 60);
        p
    }

    fn event(id: &str, code: &str, state: EventState, nb: u64, boot: &str) -> Input {
        Input::Observation(Observation::new(Signal::MaintenanceEvent {
            event: ScheduledEvent {
                id: id.into(),
                code: code.into(),
                state,
                not_before: Timestamp(nb),
                not_after: Some(Timestamp(nb + 20 * MIN)),
                description: String::new(),
                boot_id: boot.into(),
            },
        }))
    }

    struct Run {
        st: State,
        p: Policy,
        log: Vec<Record>,
    }

    impl Run {
        fn new(p: Policy) -> Run {
            Run {
                st: State::default(),
                p,
                log: Vec::new(),
            }
        }

        fn step(&mut self, input: Input, at: u64) -> Vec<Order> {
            let (st, actions) = step(&self.st, input, Timestamp(at), &self.p);
            self.st = st;
            let mut orders = Vec::new();
            for a in actions {
                match a {
                    Action::Log(r) => self.log.push(r),
                    Action::Execute(o) => orders.push(o),
                }
            }
            orders
        }

        fn done(&mut self, o: &Order, at: u64) -> Vec<Order> {
            self.step(
                Input::Outcome(Outcome {
                    action: o.id,
                    status: OutcomeStatus::Done,
                    detail: String::new(),
                    request_ids: vec![],
                    evidence: None,
                    fleet: None,
                    diagnosis: None,
                }),
                at,
            )
        }

        /// Runs every order to success, in time order, returning the commands.
        fn finish(&mut self, mut orders: Vec<Order>, at: u64) -> Vec<String> {
            let mut names = Vec::new();
            while let Some(o) = orders.pop() {
                names.push(o.command.name().to_string());
                orders.extend(self.done(&o, at));
            }
            names
        }

        fn text(&self) -> String {
            self.log
                .iter()
                .map(|r| serde_json::to_string(&r.event).unwrap())
                .collect::<Vec<_>>()
                .join("\n")
        }

        fn closed(&self, id: u64) -> Option<(IncidentState, String)> {
            self.log.iter().find_map(|r| match &r.event {
                crate::model::IncidentEvent::Closed { state, summary } if r.incident.0 == id => {
                    Some((*state, summary.clone()))
                }
                _ => None,
            })
        }
    }

    #[test]
    fn retirement_drains_at_the_lead_and_replaces_before_not_before() {
        let mut r = Run::new(policy());
        let nb = T0 + 10 * MIN;
        assert!(
            r.step(
                event("e1", "instance-retirement", EventState::Active, nb, "b1"),
                T0
            )
            .is_empty()
        );
        assert!(r.text().contains("drain starts at"), "{}", r.text());
        // One tick before the lead: nothing; at the lead: quarantine, then drain, then replace.
        assert!(r.step(Input::Tick, nb - 5 * MIN - 1).is_empty());
        let orders = r.step(Input::Tick, nb - 5 * MIN);
        assert_eq!(orders.len(), 1);
        assert_eq!(orders[0].command, Command::Quarantine);
        assert!(orders[0].planned, "a planned order takes no budget slot");
        let drain = r.done(&orders[0], nb - 5 * MIN);
        assert!(matches!(drain[0].command, Command::Drain { .. }));
        assert!(drain[0].planned);
        assert!(
            drain[0].deadline <= Timestamp(nb).minus(r.p.planned.margin),
            "the drain ends before AWS acts"
        );
        let replace = r.done(&drain[0], nb - 4 * MIN);
        assert_eq!(replace[0].command, Command::Replace);
        assert!(replace[0].planned);
        assert!(r.done(&replace[0], nb - 3 * MIN).is_empty());
        let (state, summary) = r.closed(1).unwrap();
        assert_eq!(state, IncidentState::Replaced);
        assert!(summary.contains("before AWS stops it"), "{summary}");
        assert!(status_lines(&r.st).is_empty(), "nothing pending");
    }

    #[test]
    fn a_fault_drain_joins_a_planned_drain_under_way() {
        let mut r = Run::new(policy());
        let nb = T0 + 2 * MIN; // within the lead: drains at once
        let q = r.step(
            event("e1", "system-reboot", EventState::Active, nb, "b1"),
            T0,
        );
        assert_eq!(q[0].command, Command::Quarantine);
        let xid = Input::Observation(
            Observation::new(Signal::xid(79)).on_gpu(crate::model::GpuId::index_only(0)),
        );
        assert!(r.step(xid, T0 + 1).is_empty(), "no second remediation");
        assert_eq!(r.st.node.remediation.unwrap().incident, IncidentId(1));
    }

    #[test]
    fn a_reboot_event_returns_to_service_after_a_new_boot() {
        let mut r = Run::new(policy());
        let nb = T0 + 10 * MIN;
        r.step(
            event("e2", "system-reboot", EventState::Active, nb, "b1"),
            T0,
        );
        let o = r.step(Input::Tick, nb - 5 * MIN);
        r.finish(o, nb - 5 * MIN);
        assert_eq!(r.st.node.phase, NodePhase::Drained);
        assert!(r.closed(1).is_none(), "open until the reboot is over");
        assert!(
            status_lines(&r.st)[0].contains("drained; back in service"),
            "{:?}",
            status_lines(&r.st)
        );
        // Completed, same boot: stays out.
        assert!(
            r.step(
                event("e2", "system-reboot", EventState::Completed, nb, "b1"),
                nb + MIN
            )
            .is_empty()
        );
        // The instance rebooted (a new boot id): back in service.
        let o = r.step(
            event("e2", "system-reboot", EventState::Completed, nb, "b2"),
            nb + 2 * MIN,
        );
        assert_eq!(o[0].command, Command::Restore);
        r.finish(o, nb + 2 * MIN);
        let (state, summary) = r.closed(1).unwrap();
        assert_eq!(state, IncidentState::Resolved);
        assert!(summary.contains("rebooted (new boot id)"), "{summary}");
        assert_eq!(r.st.node.phase, NodePhase::InService);
    }

    #[test]
    fn canceled_events_undo_what_they_started() {
        let mut r = Run::new(policy());
        let nb = T0 + 10 * MIN;
        // Canceled before its drain: nothing to undo.
        r.step(
            event("e3", "instance-stop", EventState::Active, nb, "b1"),
            T0,
        );
        assert!(
            r.step(
                event("e3", "instance-stop", EventState::Canceled, nb, "b1"),
                T0 + MIN
            )
            .is_empty()
        );
        assert_eq!(r.closed(1).unwrap().0, IncidentState::Resolved);
        // Canceled mid-drain: restored.
        r.step(
            event("e4", "instance-retirement", EventState::Active, nb, "b1"),
            T0 + MIN,
        );
        let q = r.step(Input::Tick, nb - 5 * MIN);
        let d = r.done(&q[0], nb - 5 * MIN);
        assert!(matches!(d[0].command, Command::Drain { .. }));
        let o = r.step(
            event("e4", "instance-retirement", EventState::Canceled, nb, "b1"),
            nb - 4 * MIN,
        );
        assert_eq!(o[0].command, Command::Restore);
        assert!(
            r.st.orders
                .in_flight
                .values()
                .all(|x| x.command == Command::Restore),
            "the drain is dropped"
        );
        r.finish(o, nb - 4 * MIN);
        let (state, summary) = r.closed(2).unwrap();
        assert_eq!(state, IncidentState::Resolved);
        assert!(
            summary.contains("AWS canceled") && summary.contains("ACTIVE"),
            "{summary}"
        );
    }

    #[test]
    fn rescheduling_moves_the_drain() {
        let mut r = Run::new(policy());
        let nb = T0 + 10 * MIN;
        r.step(
            event("e5", "instance-retirement", EventState::Active, nb, "b"),
            T0,
        );
        r.step(
            event(
                "e5",
                "instance-retirement",
                EventState::Active,
                nb + 60 * MIN,
                "b",
            ),
            T0 + MIN,
        );
        assert!(
            r.step(Input::Tick, nb - 5 * MIN).is_empty(),
            "not at the old time"
        );
        assert_eq!(
            r.step(Input::Tick, nb + 55 * MIN).len(),
            1,
            "at the new one"
        );
        assert!(r.text().contains("rescheduled"), "{}", r.text());
    }

    #[test]
    fn past_and_unknown_events_and_rebalance_decide_nothing_by_default() {
        let mut r = Run::new(policy());
        assert!(
            r.step(
                event(
                    "e6",
                    "instance-stop",
                    EventState::Active,
                    T0 - 60 * MIN,
                    "b"
                ),
                T0
            )
            .is_empty()
        );
        assert_eq!(r.closed(1).unwrap().0, IncidentState::Logged);
        assert!(r.text().contains("an event in the past"), "{}", r.text());
        assert!(
            r.step(
                event("e7", "instance-explode", EventState::Active, T0 + MIN, "b"),
                T0
            )
            .is_empty()
        );
        assert_eq!(r.closed(2).unwrap().0, IncidentState::Logged);
        let rb = Input::Observation(Observation::new(Signal::RebalanceRecommendation {
            notice: Timestamp(T0),
        }));
        assert!(r.step(rb.clone(), T0).is_empty());
        assert_eq!(r.closed(3).unwrap().0, IncidentState::Logged);
        assert!(r.step(rb, T0 + 1).is_empty(), "a repeat is nothing new");
        assert_eq!(r.st.incidents.last_id, 3);
        // Configured to drain: within the fleet budget (not planned).
        let mut p = policy();
        p.planned.rebalance = Rebalance::Drain;
        let mut r = Run::new(p);
        let o = r.step(
            Input::Observation(Observation::new(Signal::RebalanceRecommendation {
                notice: Timestamp(T0),
            })),
            T0,
        );
        assert_eq!(o[0].command, Command::Quarantine);
        assert!(!o[0].planned, "a rebalance drain waits for the budget");
    }

    #[test]
    fn a_spot_notice_drains_at_once_and_ends_before_the_interruption() {
        let mut r = Run::new(policy());
        let time = T0 + 2 * MIN;
        let spot = Input::Observation(Observation::new(Signal::SpotInterruption {
            action: "terminate".into(),
            time: Timestamp(time),
        }));
        let q = r.step(spot.clone(), T0);
        assert_eq!(q[0].command, Command::Quarantine);
        let d = r.done(&q[0], T0);
        assert!(d[0].planned);
        assert_eq!(d[0].deadline, Timestamp(time).minus(r.p.planned.margin));
        assert!(
            r.step(spot, T0 + 1).is_empty(),
            "the same notice again is nothing new"
        );
        // Auto Scaling then terminates it: the drain finishes and our hook is completed.
        let lc = Input::Observation(Observation::new(Signal::Lifecycle {
            state: crate::model::LifecycleState::Terminating,
        }));
        r.step(lc, T0 + 1000);
        let c = r.done(&d[0], T0 + 2000);
        assert!(
            matches!(c[0].command, Command::CompleteLifecycle { .. }),
            "{c:?}"
        );
    }

    #[test]
    fn the_agents_verdict_corroborates_and_never_drains_alone() {
        let mut r = Run::new(policy());
        let imp =
            Input::Observation(Observation::new(Signal::EcsAgentImpaired).with_detail("dcgm"));
        assert!(
            r.step(imp.clone(), T0).is_empty(),
            "no drain on the agent's word alone"
        );
        assert_eq!(r.closed(1).unwrap().0, IncidentState::Logged);
        assert!(
            status_lines(&r.st)[0].contains("IMPAIRED"),
            "{:?}",
            status_lines(&r.st)
        );
        // An XID after it: its incident shows both verdicts.
        let xid = Input::Observation(
            Observation::new(Signal::xid(79)).on_gpu(crate::model::GpuId::index_only(0)),
        );
        assert!(!r.step(xid, T0 + 1).is_empty());
        assert!(
            r.text()
                .contains("beside gpu-medic's verdict, the ECS agent's own"),
            "{}",
            r.text()
        );
        // INSUFFICIENT_DATA is no fault.
        let mut r = Run::new(policy());
        let nd = Input::Observation(Observation::new(Signal::EcsAgentHealth {
            status: "INSUFFICIENT_DATA".into(),
        }));
        assert!(r.step(nd, T0).is_empty());
        assert!(r.log.is_empty());
    }

    #[test]
    fn a_spot_notice_imds_stops_listing_gives_the_drained_instance_back() {
        let mut r = Run::new(policy());
        let time = T0 + 2 * MIN;
        let spot = Input::Observation(Observation::new(Signal::SpotInterruption {
            action: "stop".into(),
            time: Timestamp(time),
        }));
        let q = r.step(spot, T0);
        let d = r.done(&q[0], T0);
        assert!(r.done(&d[0], T0 + 1000).is_empty());
        assert_eq!(r.closed(1).unwrap().0, IncidentState::Drained);
        assert_eq!(r.st.node.phase, NodePhase::Drained);
        let gone = |t: u64| {
            Input::Observation(Observation::new(Signal::SpotNoticeGone {
                action: "stop".into(),
                time: Timestamp(t),
            }))
        };
        assert!(
            r.step(gone(time + 1), T0 + 2000).is_empty(),
            "another notice's"
        );
        let o = r.step(gone(time), T0 + 2000);
        assert_eq!(o.len(), 1, "{o:?}");
        assert_eq!(o[0].command, Command::Restore);
        assert!(r.text().contains("IMDS no longer lists"), "{}", r.text());
        assert!(r.done(&o[0], T0 + 3000).is_empty());
        assert_eq!(r.st.node.phase, NodePhase::InService);
        assert!(!r.st.planned.spot_pending());
    }

    #[test]
    fn a_cleared_drill_notice_is_gone_and_undone() {
        let mut r = Run::new(policy());
        let drill = |obs: Observation| {
            Input::Operator(crate::model::OperatorRequest::Drill {
                drill: crate::model::Drill {
                    id: "drill-1".into(),
                    class: "maintenance".into(),
                    observe: false,
                    by: "ops".into(),
                    expect: crate::model::DrillExpect {
                        signals: vec![obs.signal.kind()],
                        code: None,
                        gpu: None,
                        pid: None,
                    },
                    inject: Some(obs),
                },
            })
        };
        let Input::Observation(ev) = event(
            "drill-1",
            "system-maintenance",
            EventState::Active,
            T0 + MIN,
            "",
        ) else {
            unreachable!()
        };
        let q = r.step(drill(ev), T0);
        assert_eq!(q[0].command, Command::Quarantine);
        let d = r.done(&q[0], T0);
        assert!(
            r.done(&d[0], T0 + 1000).is_empty(),
            "drained, waiting for the event to be over"
        );
        assert!(
            status_lines(&r.st)
                .iter()
                .any(|l| l.contains("gpu-medic drill clear drill-1")),
            "{:?}",
            status_lines(&r.st)
        );
        let clear = |who: &str| {
            Input::Operator(crate::model::OperatorRequest::DrillClear {
                drill: "drill-1".into(),
                by: who.into(),
            })
        };
        let o = r.step(clear("ops"), T0 + 2000);
        assert_eq!(o.len(), 1, "{o:?}");
        assert_eq!(o[0].command, Command::Restore);
        assert!(r.done(&o[0], T0 + 3000).is_empty());
        let (state, _) = r.closed(1).unwrap();
        assert_eq!(state, IncidentState::Resolved);
        assert!(r.log.iter().all(|x| x.drill.as_deref() == Some("drill-1")));
        assert!(r.text().contains("cleared by ops"), "{}", r.text());
        // Cleared again: nothing more to do, nothing issued.
        assert!(r.step(clear("ops"), T0 + 4000).is_empty());
        assert!(
            !status_lines(&r.st)
                .iter()
                .any(|l| l.contains("drill clear"))
        );
    }
}
