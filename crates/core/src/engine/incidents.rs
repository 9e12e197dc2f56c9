//! Incidents as the journal tells them: opening one (and the drill it belongs to), a signal
//! attached once, notes, escalations, closing; log-only findings and their repeats;
//! gpu-medic's own faults; decisions this node cannot carry out.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{
    Cx, LOG_REPEAT_WINDOW, MAX_ATTACHED_PER_INCIDENT, MAX_RECENT_LOGS, RULE_LAUNCH_GATE,
    RULE_SELF_FAULT, attach_key,
};
use crate::model::bounded::BoundedMap;
use crate::model::{
    Action, Command, IncidentEvent, IncidentId, IncidentState, LifecycleState, Observation, Order,
    Record, Signal, Verdict,
};
use crate::model::{MAX_OPEN_INCIDENTS, Timestamp};

/// The incidents' state: the last id handed out, the incidents not yet closed and the
/// signals each holds, the log-only classes a repeat joins, and gpu-medic's own faults.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Incidents {
    /// The last incident id handed out (`state.json`: `next_incident`).
    pub last_id: u64,
    /// Incidents not yet closed.
    pub open: BTreeMap<IncidentId, OpenIncident>,
    /// Signals already in each incident's timeline (see `attach`).
    pub attached: BTreeMap<IncidentId, BTreeSet<String>>,
    /// The last log-only incident per `rule@target`, for repeat suppression.
    pub recent_logs: BoundedMap<String, RecentLog, MAX_RECENT_LOGS>,
    /// gpu-medic's own faults by component (`nvml`, `mps-control`), each with its open
    /// incident: journaled once, shown by `status`, never remediated.
    pub self_faults: BTreeMap<String, SelfFault>,
}

/// One of gpu-medic's own faults (see `Signal::SelfFault`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelfFault {
    pub incident: IncidentId,
    pub since: Timestamp,
    #[serde(default)]
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecentLog {
    pub incident: IncidentId,
    pub at: Timestamp,
    pub repeats: u32,
    /// Repeats by signal (`xid 13`), at most `MAX_COUNTED_SIGNALS` of them.
    #[serde(default)]
    pub counts: BoundedMap<String, u32, { super::MAX_COUNTED_SIGNALS }>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenIncident {
    pub opened_at: Timestamp,
    pub verdict: Verdict,
    pub rule: String,
    #[serde(default)]
    pub gpu: Option<u32>,
}

impl Incidents {
    /// A log-only finding of `class` within [`LOG_REPEAT_WINDOW`] of the last one: counted as
    /// its repeat (per signal, up to the bound), no new incident. Returns whether it was one.
    pub fn log_repeat(&mut self, class: &str, obs: &Observation, now: Timestamp) -> bool {
        match self.recent_logs.get_mut(class) {
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

    /// Incident `id` is the last log-only finding of `class` (the stalest class makes room).
    pub fn remember_log(&mut self, class: &str, id: IncidentId, now: Timestamp) {
        self.recent_logs.insert_evicting(
            class.to_string(),
            RecentLog {
                incident: id,
                at: now,
                repeats: 0,
                counts: Default::default(),
            },
            |r| r.at,
        );
    }

    /// Forgets the log-only classes whose repeat window ended with no repeat to report.
    pub fn forget_stale_logs(&mut self, now: Timestamp) {
        self.recent_logs
            .retain(|_, r| now.since(r.at) < LOG_REPEAT_WINDOW || r.repeats > 0);
    }
}

impl Cx<'_> {
    pub(super) fn record(&mut self, incident: IncidentId, event: IncidentEvent) {
        self.out.push(Action::Log(Record {
            at: self.now,
            incident,
            drill: self
                .st
                .drills
                .incidents
                .get(&incident)
                .map(|d| d.id.clone()),
            event,
        }));
    }

    pub(super) fn open(
        &mut self,
        obs: &Observation,
        rule: &str,
        reason: &str,
        verdict: Verdict,
    ) -> IncidentId {
        self.st.incidents.last_id = self.st.incidents.last_id.saturating_add(1);
        let id = IncidentId(self.st.incidents.last_id);
        self.st.incidents.open.insert(
            id,
            OpenIncident {
                opened_at: self.now,
                verdict,
                rule: rule.to_string(),
                gpu: obs.gpu.as_ref().map(|g| g.index),
            },
        );
        self.st
            .incidents
            .attached
            .entry(id)
            .or_default()
            .insert(attach_key(obs));
        let drill = self.drill.take().and_then(|d| self.st.drills.claim(&d, id));
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
        self.st.app.remember_xid(obs, id, self.now);
        self.abandon_excess();
        id
    }

    /// More than [`MAX_OPEN_INCIDENTS`] open: the oldest that no work holds is closed
    /// `abandoned`, saying why. The engine never comes near the bound by its own work (one
    /// node remediation, one MPS restart, stop-tasks per GPU, its own faults): only a state
    /// or journal it did not write gets there, and memory and `state.json` stay bounded.
    fn abandon_excess(&mut self) {
        while self.st.incidents.open.len() > MAX_OPEN_INCIDENTS {
            let Some(id) = self
                .st
                .incidents
                .open
                .keys()
                .copied()
                .find(|id| !self.holds(*id))
            else {
                return;
            };
            self.close(
                id,
                IncidentState::Abandoned,
                format!(
                    "abandoned: more than {MAX_OPEN_INCIDENTS} incidents were open at once (no work of gpu-medic's opens that many); this was the oldest that no order, remediation or fault held, closed so the state stays bounded"
                ),
            );
        }
    }

    /// Whether some work holds incident `id`: the node's remediation or withheld decision,
    /// the MPS restart, a GPU's stop-tasks, one of gpu-medic's own faults, an order in flight
    /// or scheduled, an evidence collection.
    fn holds(&self, id: IncidentId) -> bool {
        let st = &self.st;
        st.node.incident == Some(id)
            || st.node.remediation.is_some_and(|r| r.incident == id)
            || st.node.withheld.as_ref().is_some_and(|w| w.incident == id)
            || st.mps.incident == Some(id)
            || st.gpus.jobs.values().any(|i| *i == id)
            || st.incidents.self_faults.values().any(|f| f.incident == id)
            || st.orders.in_flight.values().any(|o| o.incident == id)
            || st.orders.scheduled.iter().any(|o| o.incident == id)
            || st.evidence.as_ref().is_some_and(|e| e.incident == id)
    }

    /// Whether an order of `incident` is only journaled: observe-only, or an observe drill.
    pub(super) fn dry(&self, incident: IncidentId) -> bool {
        self.policy.observe_only || self.st.drills.observes(incident)
    }

    pub(super) fn close(
        &mut self,
        id: IncidentId,
        state: IncidentState,
        summary: impl Into<String>,
    ) {
        if self.st.incidents.open.remove(&id).is_some() {
            // A closed incident no longer takes signals unless a GPU or the node points at it.
            // The withheld incident (`[aws]` off) goes on taking the node's later faults.
            let referenced = self.st.node.incident == Some(id)
                || self
                    .st
                    .node
                    .withheld
                    .as_ref()
                    .is_some_and(|w| w.incident == id)
                || self.st.gpus.health.values().any(|g| g.incident == Some(id));
            if !referenced {
                self.st.incidents.attached.remove(&id);
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
    pub(super) fn attach(&mut self, id: IncidentId, obs: &Observation) {
        let key = attach_key(obs);
        let seen = self.st.incidents.attached.entry(id).or_default();
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

    pub(super) fn note(&mut self, id: IncidentId, text: impl Into<String>) {
        self.record(id, IncidentEvent::Note { text: text.into() });
    }

    pub(super) fn escalated(
        &mut self,
        id: IncidentId,
        verdict: Verdict,
        rule: &str,
        reason: String,
    ) {
        if let Some(o) = self.st.incidents.open.get_mut(&id) {
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

    /// gpu-medic cannot do part of its job. One incident per component while it lasts; a
    /// probe reporting it on every poll changes nothing. Never an order: a missing library
    /// or binary is not the hardware's fault, and draining for it would spread the mistake
    /// to the fleet.
    pub(super) fn self_fault(&mut self, obs: &Observation, component: String) {
        if self.st.incidents.self_faults.contains_key(&component) {
            return;
        }
        let reason = format!(
            "gpu-medic itself cannot work ({component}): a fault of gpu-medic or its configuration, \
             not of the hardware; nothing is drained, replaced or restarted for it, and what it \
             cannot see is unknown until it is fixed"
        );
        let id = self.open(obs, RULE_SELF_FAULT, &reason, Verdict::Log);
        self.st.incidents.self_faults.insert(
            component,
            SelfFault {
                incident: id,
                since: self.now,
                detail: obs.detail.clone().unwrap_or_default(),
            },
        );
    }

    pub(super) fn self_recovered(&mut self, obs: &Observation, component: &str) {
        let Some(fault) = self.st.incidents.self_faults.remove(component) else {
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
    pub(super) fn would(
        &mut self,
        incident: IncidentId,
        commands: Vec<Command>,
        what: &str,
        why: &str,
    ) {
        for command in commands {
            let order = Order {
                id: self.st.orders.next_id(),
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

    /// Opens and closes a log-only incident, first in its class for `LOG_REPEAT_WINDOW`.
    pub(super) fn log_incident(
        &mut self,
        obs: &Observation,
        rule: &str,
        reason: &str,
        class: &str,
    ) {
        let id = self.open(obs, rule, reason, Verdict::Log);
        if let Some(prev) = self.st.incidents.recent_logs.remove(class)
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
        self.st.incidents.remember_log(class, id, self.now);
        self.close(id, IncidentState::Logged, format!("recorded: {reason}"));
    }

    /// Journals a launch gate run: the gate decided and completed the hook itself.
    pub(super) fn launch_gate(
        &mut self,
        health: &str,
        summary: &str,
        findings: &[String],
        ids: &[String],
    ) {
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
}
