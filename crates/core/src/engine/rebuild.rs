//! Rebuilding the engine's state from the incident journal, for a `state.json` that could not
//! be read (a disk error, a hand edit). Without it the supervisor could not start and the
//! node would go unwatched; with an empty state it would forget remediations under way.
//!
//! The journal says which incidents are open, with their verdicts, and which orders were
//! handed out and not finished. From that: open incidents; orders still in flight (resumed:
//! every remedy is idempotent); the node remediation, MPS restart and stop-tasks work each
//! open incident owns (an open one with no order in flight gets its next step scheduled at
//! once, because the retry it was waiting for is only in the lost state); the node phase
//! the last closed node incident left; gpu-medic's own open faults; the counters, so no
//! incident or action id is reused; and the reboot ladder's history (every reboot order,
//! whether the boot after it happened, when the node went back into service), so a lost
//! state never turns a `replace` the ladder owes back into another reboot. A reboot whose
//! call was accepted with no new boot seen yet is waited for (`[deadlines] reboot` from the
//! acceptance), never ordered again. Confirmation windows and repeat counts start over.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::repair::{RULE_LADDER, RULE_REBOOT_FAILED, Repair, RepairResult};
use super::{
    Goal, GpuHealth, GpuStatus, MpsPhase, NodePhase, OpenIncident, Remediation, Scheduled,
    SelfFault, State, Step,
};
use crate::model::{
    ActionId, Command, GpuId, IncidentEvent, IncidentId, IncidentState, MAX_OPEN_INCIDENTS,
    MAX_REBUILT_ID, Observation, Order, OutcomeStatus, Record, Signal, Timestamp, Verdict,
};

fn insert_capped(set: &mut BTreeSet<IncidentId>, id: IncidentId) {
    if set.len() >= MAX_TRACKED {
        set.pop_first();
    }
    set.insert(id);
}

/// Folds journal records, oldest first, into a state. Memory is bounded whatever the journal
/// holds: at most [`MAX_OPEN_INCIDENTS`] open incidents (past it the oldest is left out,
/// counted as abandoned: [`Rebuild::abandoned`]) and [`MAX_TRACKED`] of each kind of order.
#[derive(Default)]
pub struct Rebuild {
    st: State,
    first: BTreeMap<IncidentId, Observation>,
    orders: BTreeMap<ActionId, Order>,
    skipped: u64,
    abandoned: Abandoned,
    /// Reboot orders handed out, by action: their incident.
    reboots: BTreeMap<ActionId, IncidentId>,
    /// Reboot calls accepted (no new boot seen since), by incident: when.
    accepted: BTreeMap<IncidentId, Timestamp>,
    /// Incidents whose quarantine (resp. drain) was carried out.
    quarantined: BTreeSet<IncidentId>,
    drained: BTreeSet<IncidentId>,
    /// Every non-dry-run order seen, by action: its incident and command, for outcomes.
    started: BTreeMap<ActionId, (IncidentId, StartedKind)>,
    reboot_deadline: Duration,
}

/// Incidents open in the journal beyond the newest [`MAX_OPEN_INCIDENTS`]: left out of the
/// rebuilt state (the engine would have closed them `abandoned`), counted with the first and
/// last of their ids.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Abandoned {
    pub count: u64,
    pub first: Option<IncidentId>,
    pub last: Option<IncidentId>,
}

impl Abandoned {
    fn add(&mut self, id: IncidentId) {
        self.count = self.count.saturating_add(1);
        self.first = Some(self.first.map_or(id, |f| f.min(id)));
        self.last = Some(self.last.map_or(id, |l| l.max(id)));
    }
}

impl std::fmt::Display for Abandoned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.first, self.last) {
            (Some(a), Some(b)) => write!(
                f,
                "{} incident(s) open in the journal beyond the newest {MAX_OPEN_INCIDENTS} left out as abandoned (ids {a} to {b})",
                self.count
            ),
            _ => write!(f, "no incident abandoned"),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum StartedKind {
    Quarantine,
    Drain,
    Other,
}

/// The boot id a note of `repair::boot` names: `new boot <id> (was <before>): ...`.
fn new_boot_in(text: &str) -> Option<&str> {
    let rest = text.strip_prefix("new boot ")?;
    rest.split_once(" (was ").map(|(id, _)| id)
}

/// At most this many reboot orders are remembered while folding (the ledger keeps
/// [`MAX_HISTORY`](super::repair::MAX_HISTORY)); old ones are forgotten oldest first.
const MAX_REBOOT_ACTIONS: usize = 4 * super::repair::MAX_HISTORY;
/// At most this many finished quarantines/drains and started orders are remembered while
/// folding (for open incidents only ever a handful matter).
const MAX_TRACKED: usize = 4096;

impl Rebuild {
    pub fn new() -> Self {
        Rebuild::default()
    }

    /// How long a reboot accepted before the state was lost is waited for, from its
    /// acceptance (`[deadlines] reboot`); zero (the default) replaces at the first tick a node
    /// that has not rebooted.
    pub fn with_reboot_deadline(mut self, d: Duration) -> Self {
        self.reboot_deadline = d;
        self
    }

    /// An escalation: the incident's verdict, and a reboot repair it settled.
    fn escalated(&mut self, id: IncidentId, verdict: Verdict, rule: &str) {
        if let Some(o) = self.st.incidents.open.get_mut(&id) {
            o.verdict = o.verdict.max(verdict);
        }
        // A reboot that did not happen or did not mend the node, or a fault that
        // took the repair on to replace: the repair is settled (`repair::settle`).
        if verdict == Verdict::Replace && rule != RULE_LADDER {
            self.accepted.remove(&id);
            if let Some(p) = self.pending_mut(id) {
                p.result = match (p.boot_after.is_some(), rule == RULE_REBOOT_FAILED) {
                    (true, _) => RepairResult::Escalated,
                    (false, true) => RepairResult::NotRebooted,
                    (false, false) => RepairResult::Aborted,
                };
            }
        }
    }

    /// An incident's close: its repair settled, the node phase it left.
    fn closed(&mut self, id: IncidentId, state: IncidentState, at: Timestamp) {
        self.accepted.remove(&id);
        if let Some(p) = self.pending_mut(id) {
            match state {
                IncidentState::Repaired => {
                    p.result = RepairResult::Repaired;
                    p.back_at = Some(at);
                }
                _ if p.boot_after.is_some() => p.result = RepairResult::Escalated,
                _ => p.result = RepairResult::Aborted,
            }
        }
        self.st.incidents.open.remove(&id);
        self.first.remove(&id);
        self.orders.retain(|_, o| o.incident != id);
        let phase = match state {
            IncidentState::Drained => Some(NodePhase::Drained),
            IncidentState::Replaced => Some(NodePhase::Replaced),
            IncidentState::Terminated => Some(NodePhase::Terminated),
            IncidentState::Aborted | IncidentState::Repaired => Some(NodePhase::InService),
            // A drained node diagnosed healthy is back in service.
            IncidentState::Resolved if self.drained.contains(&id) => Some(NodePhase::InService),
            _ => None,
        };
        if let Some(p) = phase {
            self.st.node.phase = p;
            self.st.node.incident = Some(id);
        }
    }

    /// Folds one record. A record whose incident or action id is beyond
    /// [`MAX_REBUILT_ID`] (half of [`MAX_COUNTER`](super::MAX_COUNTER)) is not one a
    /// journal of this engine's holds: it is left out and counted in
    /// [`skipped`](Self::skipped), so the rebuilt counters keep room to advance (a forged id
    /// near the ceiling would otherwise push the next one past it, and the state would be set
    /// aside again at every start).
    pub fn add(&mut self, r: &Record) {
        let id = r.incident;
        let action = match &r.event {
            IncidentEvent::ActionStarted { order, .. } => Some(order.id),
            IncidentEvent::ActionFinished { outcome } => Some(outcome.action),
            IncidentEvent::DeadlineMissed { action, .. } => Some(*action),
            _ => None,
        };
        if id.0 > MAX_REBUILT_ID || action.is_some_and(|a| a.0 > MAX_REBUILT_ID) {
            self.skipped += 1;
            return;
        }
        self.st.incidents.last_id = self.st.incidents.last_id.max(id.0);
        match &r.event {
            IncidentEvent::Opened {
                observation,
                rule,
                verdict,
                ..
            } => {
                self.st.incidents.open.insert(
                    id,
                    OpenIncident {
                        opened_at: r.at,
                        verdict: *verdict,
                        rule: rule.clone(),
                        gpu: observation.gpu.as_ref().map(|g| g.index),
                    },
                );
                self.first.insert(id, observation.clone());
                while self.st.incidents.open.len() > MAX_OPEN_INCIDENTS {
                    let Some((old, _)) = self.st.incidents.open.pop_first() else {
                        break;
                    };
                    self.first.remove(&old);
                    self.abandoned.add(old);
                }
            }
            IncidentEvent::Escalated { verdict, rule, .. } => self.escalated(id, *verdict, rule),
            IncidentEvent::ActionStarted { order, dry_run } => {
                self.st.orders.last_id = self.st.orders.last_id.max(order.id.0);
                if !dry_run {
                    if self.orders.len() >= MAX_TRACKED {
                        self.orders.pop_first();
                    }
                    self.orders.insert(order.id, order.clone());
                    let kind = match order.command {
                        Command::Quarantine => StartedKind::Quarantine,
                        Command::Drain { .. } => StartedKind::Drain,
                        _ => StartedKind::Other,
                    };
                    if self.started.len() >= MAX_TRACKED {
                        self.started.pop_first();
                    }
                    self.started.insert(order.id, (id, kind));
                    if let Command::Reboot { boot } = &order.command {
                        self.reboot_ordered(id, order.id, boot, r.at);
                    }
                }
            }
            IncidentEvent::ActionFinished { outcome } => {
                self.orders.remove(&outcome.action);
                if outcome.status == OutcomeStatus::Done {
                    match self.started.get(&outcome.action) {
                        Some((inc, StartedKind::Quarantine)) => {
                            insert_capped(&mut self.quarantined, *inc);
                        }
                        Some((inc, StartedKind::Drain)) => insert_capped(&mut self.drained, *inc),
                        _ => {}
                    }
                    if self.reboots.contains_key(&outcome.action) {
                        if self.accepted.len() >= MAX_TRACKED {
                            self.accepted.pop_first();
                        }
                        self.accepted.insert(id, r.at);
                    }
                }
            }
            IncidentEvent::DeadlineMissed { action, .. } => {
                self.orders.remove(action);
            }
            IncidentEvent::Note { text } => {
                if let Some(boot) = new_boot_in(text) {
                    self.accepted.remove(&id);
                    if let Some(p) = self.pending_mut(id) {
                        p.boot_after = Some(boot.to_string());
                    }
                }
            }
            IncidentEvent::Closed { state, .. } => self.closed(id, *state, r.at),
            IncidentEvent::Signal { .. } => {}
        }
    }

    /// A reboot order for `incident` (`repair::reboot_command`): a pending repair, once per
    /// repair (a retried order is the same reboot).
    fn reboot_ordered(
        &mut self,
        incident: IncidentId,
        action: ActionId,
        boot: &str,
        at: Timestamp,
    ) {
        if self.reboots.len() >= MAX_REBOOT_ACTIONS {
            self.reboots.pop_first();
        }
        self.reboots.insert(action, incident);
        if self.pending_mut(incident).is_some() {
            return;
        }
        let rule = self
            .st
            .incidents
            .open
            .get(&incident)
            .map(|o| crate::policy::base_rule(&o.rule).to_string())
            .unwrap_or_default();
        self.st.repair.history.push_evicting(Repair {
            incident,
            rule,
            at,
            boot_before: boot.to_string(),
            boot_after: None,
            back_at: None,
            result: RepairResult::Pending,
            why: String::new(),
        });
    }

    fn pending_mut(&mut self, incident: IncidentId) -> Option<&mut Repair> {
        self.st
            .repair
            .history
            .iter_mut()
            .rev()
            .find(|r| r.incident == incident && r.result == RepairResult::Pending)
    }

    /// Records left out: their ids are out of range (see [`add`](Self::add)).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// Incidents left out because more than [`MAX_OPEN_INCIDENTS`] were open.
    pub fn abandoned(&self) -> Abandoned {
        self.abandoned
    }

    /// The state, with work for open incidents resumed or scheduled at `now`.
    pub fn finish(mut self, now: Timestamp) -> State {
        let open: Vec<(IncidentId, OpenIncident)> = self
            .st
            .incidents
            .open
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        for (id, inc) in open {
            let obs = self.first.get(&id).cloned();
            if let Some(Observation {
                signal: Signal::SelfFault { component },
                detail,
                ..
            }) = &obs
            {
                self.st.incidents.self_faults.insert(
                    component.clone(),
                    SelfFault {
                        incident: id,
                        since: inc.opened_at,
                        detail: detail.clone().unwrap_or_default(),
                    },
                );
                continue;
            }
            // An evidence collection is not a step of the remediation: the step is the other order.
            let order = self
                .orders
                .values()
                .find(|o| o.incident == id && o.command != Command::CollectEvidence)
                .cloned();
            let gpu = obs.as_ref().and_then(|o| o.gpu.clone());
            match inc.verdict {
                Verdict::Drain | Verdict::Reboot | Verdict::Replace => {
                    self.node_remediation(id, &inc, order, gpu, now);
                }
                Verdict::RestartMps => {
                    self.st.mps.incident = Some(id);
                    self.st.mps.phase = if order.is_some() {
                        MpsPhase::Restarting
                    } else {
                        self.schedule(id, Command::RestartMps, now);
                        MpsPhase::Unresponsive
                    };
                }
                Verdict::StopTasks => {
                    if let Some(g) = gpu {
                        self.st.gpus.jobs.insert(g.index, id);
                        if order.is_none() {
                            self.schedule(
                                id,
                                Command::StopTasks {
                                    gpu: g,
                                    pids: obs.as_ref().map(|o| o.pids.clone()).unwrap_or_default(),
                                    tasks: obs.map(|o| o.tasks).unwrap_or_default(),
                                },
                                now,
                            );
                        }
                    }
                }
                Verdict::Log | Verdict::Ignore => {}
            }
        }
        let open = &self.st.incidents.open;
        self.st.orders.in_flight = self
            .orders
            .into_iter()
            .filter(|(_, o)| open.contains_key(&o.incident))
            .collect();
        self.st
    }

    /// An open drain, reboot or replace incident: the node remediation it was at, resumed
    /// from its last order (or started again from the quarantine).
    fn node_remediation(
        &mut self,
        id: IncidentId,
        inc: &OpenIncident,
        order: Option<Order>,
        gpu: Option<GpuId>,
        now: Timestamp,
    ) {
        if self.st.node.remediation.is_some() {
            return;
        }
        let goal = match (&order, inc.verdict) {
            (Some(o), _) if matches!(o.command, Command::CompleteLifecycle { .. }) => {
                Goal::Terminate
            }
            (_, Verdict::Drain) => Goal::Drain,
            (_, Verdict::Reboot) => Goal::Reboot,
            _ => Goal::Replace,
        };
        let (step, command) = match order.as_ref().map(|o| &o.command) {
            Some(Command::Drain { terminating }) => (
                Step::Drain,
                Command::Drain {
                    terminating: *terminating,
                },
            ),
            Some(Command::Replace) => (Step::Replace, Command::Replace),
            Some(Command::Restore) => (Step::Restore, Command::Restore),
            Some(c @ Command::Reboot { .. }) => (Step::Reboot, c.clone()),
            Some(Command::BootCheck) => (Step::BootCheck, Command::BootCheck),
            Some(c @ Command::Diagnose { .. }) => (Step::Diagnose, c.clone()),
            Some(c @ Command::CompleteLifecycle { .. }) => (Step::CompleteLifecycle, c.clone()),
            _ => (Step::Quarantine, Command::Quarantine),
        };
        let rebooted = self
            .st
            .repair
            .history
            .iter()
            .rev()
            .find(|r| r.incident == id && r.result == RepairResult::Pending)
            .is_some_and(|r| r.boot_after.is_some());
        // The reboot call was accepted and no new boot is in the journal: wait for it (the
        // boot id stepped at start settles it), never order it again.
        let awaiting = match (&order, self.accepted.get(&id)) {
            (None, Some(at)) if !rebooted && goal == Goal::Reboot => Some(*at),
            _ => None,
        };
        let step = if awaiting.is_some() {
            Step::AwaitBoot
        } else {
            step
        };
        let mut rem = Remediation::new(id, goal, step);
        rem.quarantined = self.quarantined.contains(&id);
        rem.drained = self.drained.contains(&id);
        rem.rebooted = rebooted;
        rem.until = awaiting.map(|at| at.plus(self.reboot_deadline));
        self.st.node.begin(rem);
        self.st.node.phase = match step {
            Step::Quarantine => NodePhase::Quarantined,
            Step::Drain => NodePhase::Draining,
            Step::Replace => NodePhase::Replacing,
            Step::CompleteLifecycle => NodePhase::Terminating,
            Step::Restore => self.st.node.phase,
            Step::Reboot | Step::AwaitBoot => NodePhase::Rebooting,
            Step::BootCheck | Step::Diagnose => NodePhase::Verifying,
        };
        if let Some(g) = gpu {
            self.st.gpus.health.insert(
                g.index,
                GpuHealth {
                    gpu: g,
                    status: GpuStatus::Faulted,
                    rule: inc.rule.clone(),
                    verdict: inc.verdict,
                    incident: Some(id),
                    since: inc.opened_at,
                },
            );
        }
        if order.is_none() && awaiting.is_none() {
            self.schedule(id, command, now);
        }
    }

    fn schedule(&mut self, incident: IncidentId, command: Command, now: Timestamp) {
        self.st.orders.scheduled.push(Scheduled {
            at: now,
            incident,
            command,
            attempt: 1,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::step;
    use crate::model::{Input, Observation, Outcome, OutcomeStatus};

    fn policy() -> crate::policy::Policy {
        crate::policy::Policy::parse(
            std::path::Path::new("default.toml"),
            include_str!("../../../../policies/default.toml"),
        )
        .unwrap()
    }

    fn records(actions: &[crate::model::Action]) -> Vec<Record> {
        actions
            .iter()
            .filter_map(|a| match a {
                crate::model::Action::Log(r) => Some(r.clone()),
                _ => None,
            })
            .collect()
    }

    /// A replace under way when state.json was lost: the rebuilt state knows the incident,
    /// the order in flight, the remediation and the faulted GPU, and reuses no id.
    #[test]
    fn a_remediation_in_flight_is_rebuilt_from_the_journal() {
        let p = policy();
        let mut st = State::default();
        let mut journal = Vec::new();
        let xid = Observation::new(Signal::xid(79))
            .on_gpu(crate::model::GpuId::index_only(1))
            .from_source("nvml");
        let (s, a) = step(&st, Input::Observation(xid), Timestamp(1_000), &p);
        st = s;
        journal.extend(records(&a));
        let quarantine = st.orders.in_flight.values().next().unwrap().clone();
        let done = Outcome {
            action: quarantine.id,
            status: OutcomeStatus::Done,
            detail: String::new(),
            request_ids: vec![],
            evidence: None,
            fleet: None,
            diagnosis: None,
        };
        let (s, a) = step(&st, Input::Outcome(done), Timestamp(2_000), &p);
        st = s;
        journal.extend(records(&a));
        let mut r = Rebuild::new();
        for rec in &journal {
            r.add(rec);
        }
        let rebuilt = r.finish(Timestamp(3_000));
        assert_eq!(
            rebuilt.incidents.open.keys().collect::<Vec<_>>(),
            st.incidents.open.keys().collect::<Vec<_>>()
        );
        assert_eq!(rebuilt.orders.in_flight, st.orders.in_flight);
        assert_eq!(rebuilt.node.phase, NodePhase::Draining);
        assert_eq!(rebuilt.node.remediation.map(|r| r.step), Some(Step::Drain));
        assert_eq!(rebuilt.incidents.last_id, st.incidents.last_id);
        assert_eq!(rebuilt.orders.last_id, st.orders.last_id);
        assert_eq!(rebuilt.gpus.health[&1].status, GpuStatus::Faulted);
    }

    /// An open node incident whose order was not in flight (a retry was scheduled) gets its
    /// step scheduled at once; closed incidents leave only the node phase.
    #[test]
    fn open_work_without_an_order_is_scheduled_and_closed_work_is_not() {
        let mut r = Rebuild::new();
        let obs = Observation::new(Signal::GpuLost).from_source("nvml");
        r.add(&Record {
            at: Timestamp(1),
            incident: IncidentId(4),
            drill: None,
            event: IncidentEvent::Opened {
                observation: obs.clone(),
                rule: "gpu-lost".into(),
                reason: String::new(),
                verdict: Verdict::Replace,
            },
        });
        let st = r.finish(Timestamp(9));
        assert_eq!(st.orders.scheduled.len(), 1);
        assert_eq!(st.orders.scheduled[0].command, Command::Quarantine);
        assert_eq!(st.orders.scheduled[0].at, Timestamp(9));
        assert_eq!(st.incidents.last_id, 4);
        let mut r = Rebuild::new();
        r.add(&Record {
            at: Timestamp(1),
            incident: IncidentId(4),
            drill: None,
            event: IncidentEvent::Opened {
                observation: obs,
                rule: "gpu-lost".into(),
                reason: String::new(),
                verdict: Verdict::Replace,
            },
        });
        r.add(&Record {
            at: Timestamp(2),
            incident: IncidentId(4),
            drill: None,
            event: IncidentEvent::Closed {
                state: IncidentState::Replaced,
                summary: String::new(),
            },
        });
        let st = r.finish(Timestamp(9));
        assert!(
            st.incidents.open.is_empty()
                && st.orders.scheduled.is_empty()
                && st.node.remediation.is_none()
        );
        assert_eq!(st.node.phase, NodePhase::Replaced);
    }

    fn opened(id: u64, verdict: Verdict) -> Record {
        Record {
            at: Timestamp(id),
            incident: IncidentId(id),
            drill: None,
            event: IncidentEvent::Opened {
                observation: Observation::new(Signal::xid(13)).from_source("test"),
                rule: "r".into(),
                reason: String::new(),
                verdict,
            },
        }
    }

    /// A forged line at the counters' ceiling (or at `u64::MAX`) is left out: the rebuilt
    /// counter has room, and the state the engine saves after its next incident reads back
    /// (before, it was past the ceiling and set aside at every start).
    #[test]
    fn forged_ids_at_the_ceiling_leave_the_counters_room_to_advance() {
        let p = policy();
        let mut r = Rebuild::new();
        r.add(&opened(7, Verdict::Log));
        for id in [
            crate::model::MAX_COUNTER,
            crate::model::MAX_REBUILT_ID + 1,
            u64::MAX,
        ] {
            r.add(&opened(id, Verdict::Log));
        }
        assert_eq!(r.skipped(), 3);
        let st = r.finish(Timestamp(9));
        assert_eq!(st.incidents.last_id, 7);
        let (st, _) = step(
            &st,
            Input::Observation(Observation::new(Signal::xid(13)).from_source("nvml")),
            Timestamp(10),
            &p,
        );
        assert_eq!(st.incidents.last_id, 8);
        st.check_ranges().unwrap();
        // The most a rebuild trusts still leaves 2^61 ids of room.
        let mut r = Rebuild::new();
        r.add(&opened(crate::model::MAX_REBUILT_ID, Verdict::Log));
        let st = r.finish(Timestamp(9));
        let (st, _) = step(
            &st,
            Input::Observation(Observation::new(Signal::xid(13)).from_source("nvml")),
            Timestamp(10),
            &p,
        );
        st.check_ranges().unwrap();
    }

    /// A journal of incidents that never closed: the newest `MAX_OPEN_INCIDENTS` stay open,
    /// the rest are counted (with their first and last ids), and the state passes its own
    /// size check.
    #[test]
    fn the_newest_open_incidents_are_kept_and_the_rest_counted_abandoned() {
        let mut r = Rebuild::new();
        let n = MAX_OPEN_INCIDENTS as u64 + 500;
        for id in 1..=n {
            r.add(&opened(id, Verdict::Log));
        }
        let a = r.abandoned();
        assert_eq!(
            (a.count, a.first, a.last),
            (500, Some(IncidentId(1)), Some(IncidentId(500)))
        );
        assert!(
            a.to_string()
                .contains("500 incident(s) open in the journal beyond the newest 1024")
        );
        let st = r.finish(Timestamp(1));
        assert_eq!(st.incidents.open.len(), MAX_OPEN_INCIDENTS);
        assert_eq!(st.incidents.open.keys().next(), Some(&IncidentId(501)));
        assert_eq!(st.incidents.last_id, n);
        st.check_ranges().unwrap();
        // One more than the engine keeps is refused as it is read.
        let mut over = st.clone();
        over.incidents.open.insert(
            IncidentId(n + 1),
            crate::engine::OpenIncident {
                opened_at: Timestamp(1),
                verdict: Verdict::Log,
                rule: "r".into(),
                gpu: None,
            },
        );
        assert!(over.check_ranges().unwrap_err().contains("open holds 1025"));
    }
}
