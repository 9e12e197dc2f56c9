//! Rebuilding the engine's state from the incident journal, for a `state.json` that could not
//! be read (a disk error, a hand edit). Without it the supervisor could not start and the
//! node would go unwatched; with an empty state it would forget remediations under way.
//!
//! The journal says which incidents are open, with their verdicts, and which orders were
//! handed out and not finished. From that: open incidents; orders still in flight (resumed:
//! every remedy is idempotent); the node remediation, MPS restart and stop-tasks work each
//! open incident owns (an open one with no order in flight gets its next step scheduled at
//! once, because the retry it was waiting for is only in the lost state); the node phase
//! the last closed node incident left; gpu-medic's own open faults; and the counters, so no
//! incident or action id is reused. Confirmation windows and repeat counts start over.

use std::collections::BTreeMap;

use super::state::{
    Goal, GpuHealth, GpuStatus, MpsPhase, NodePhase, OpenIncident, Remediation, Scheduled,
    SelfFault, State, Step,
};
use crate::model::{
    ActionId, Command, GpuId, IncidentEvent, IncidentId, IncidentState, Observation, Order, Record,
    Signal, Timestamp, Verdict,
};

/// Folds journal records, oldest first, into a state.
#[derive(Default)]
pub struct Rebuild {
    st: State,
    first: BTreeMap<IncidentId, Observation>,
    orders: BTreeMap<ActionId, Order>,
    skipped: u64,
}

impl Rebuild {
    pub fn new() -> Self {
        Rebuild::default()
    }

    /// Folds one record. A record whose incident or action id is beyond
    /// [`MAX_COUNTER`](super::MAX_COUNTER) is not one this journal wrote (a counter there
    /// could never advance): it is left out and counted in [`skipped`](Self::skipped).
    pub fn add(&mut self, r: &Record) {
        let id = r.incident;
        let action = match &r.event {
            IncidentEvent::ActionStarted { order, .. } => Some(order.id),
            IncidentEvent::ActionFinished { outcome } => Some(outcome.action),
            IncidentEvent::DeadlineMissed { action, .. } => Some(*action),
            _ => None,
        };
        if id.0 > super::MAX_COUNTER || action.is_some_and(|a| a.0 > super::MAX_COUNTER) {
            self.skipped += 1;
            return;
        }
        self.st.next_incident = self.st.next_incident.max(id.0);
        match &r.event {
            IncidentEvent::Opened {
                observation,
                rule,
                verdict,
                ..
            } => {
                self.st.open.insert(
                    id,
                    OpenIncident {
                        opened_at: r.at,
                        verdict: *verdict,
                        rule: rule.clone(),
                        gpu: observation.gpu.as_ref().map(|g| g.index),
                    },
                );
                self.first.insert(id, observation.clone());
            }
            IncidentEvent::Escalated { verdict, .. } => {
                if let Some(o) = self.st.open.get_mut(&id) {
                    o.verdict = o.verdict.max(*verdict);
                }
            }
            IncidentEvent::ActionStarted { order, dry_run } => {
                self.st.next_action = self.st.next_action.max(order.id.0);
                if !dry_run {
                    self.orders.insert(order.id, order.clone());
                }
            }
            IncidentEvent::ActionFinished { outcome } => {
                self.orders.remove(&outcome.action);
            }
            IncidentEvent::DeadlineMissed { action, .. } => {
                self.orders.remove(action);
            }
            IncidentEvent::Closed { state, .. } => {
                self.st.open.remove(&id);
                self.first.remove(&id);
                self.orders.retain(|_, o| o.incident != id);
                let phase = match state {
                    IncidentState::Drained => Some(NodePhase::Drained),
                    IncidentState::Replaced => Some(NodePhase::Replaced),
                    IncidentState::Terminated => Some(NodePhase::Terminated),
                    IncidentState::Aborted | IncidentState::Repaired => Some(NodePhase::InService),
                    _ => None,
                };
                if let Some(p) = phase {
                    self.st.node = p;
                    self.st.node_incident = Some(id);
                }
            }
            IncidentEvent::Signal { .. } | IncidentEvent::Note { .. } => {}
        }
    }

    /// Records left out: their ids are out of range (see [`add`](Self::add)).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// The state, with work for open incidents resumed or scheduled at `now`.
    pub fn finish(mut self, now: Timestamp) -> State {
        let open: Vec<(IncidentId, OpenIncident)> =
            self.st.open.iter().map(|(k, v)| (*k, v.clone())).collect();
        for (id, inc) in open {
            let obs = self.first.get(&id).cloned();
            if let Some(Observation {
                signal: Signal::SelfFault { component },
                detail,
                ..
            }) = &obs
            {
                self.st.self_faults.insert(
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
                        self.st.gpu_jobs.insert(g.index, id);
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
        let open = &self.st.open;
        self.st.in_flight = self
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
        if self.st.remediation.is_some() {
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
        self.st.remediation = Some(Remediation::new(id, goal, step));
        self.st.node_incident = Some(id);
        self.st.node = match step {
            Step::Quarantine => NodePhase::Quarantined,
            Step::Drain => NodePhase::Draining,
            Step::Replace => NodePhase::Replacing,
            Step::CompleteLifecycle => NodePhase::Terminating,
            Step::Restore => self.st.node,
            Step::Reboot | Step::AwaitBoot => NodePhase::Rebooting,
            Step::BootCheck | Step::Diagnose => NodePhase::Verifying,
        };
        if let Some(g) = gpu {
            self.st.gpus.insert(
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
        if order.is_none() {
            self.schedule(id, command, now);
        }
    }

    fn schedule(&mut self, incident: IncidentId, command: Command, now: Timestamp) {
        self.st.scheduled.push(Scheduled {
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
            include_str!("../../policies/default.toml"),
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
        let quarantine = st.in_flight.values().next().unwrap().clone();
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
            rebuilt.open.keys().collect::<Vec<_>>(),
            st.open.keys().collect::<Vec<_>>()
        );
        assert_eq!(rebuilt.in_flight, st.in_flight);
        assert_eq!(rebuilt.node, NodePhase::Draining);
        assert_eq!(rebuilt.remediation.map(|r| r.step), Some(Step::Drain));
        assert_eq!(rebuilt.next_incident, st.next_incident);
        assert_eq!(rebuilt.next_action, st.next_action);
        assert_eq!(rebuilt.gpus[&1].status, GpuStatus::Faulted);
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
        assert_eq!(st.scheduled.len(), 1);
        assert_eq!(st.scheduled[0].command, Command::Quarantine);
        assert_eq!(st.scheduled[0].at, Timestamp(9));
        assert_eq!(st.next_incident, 4);
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
        assert!(st.open.is_empty() && st.scheduled.is_empty() && st.remediation.is_none());
        assert_eq!(st.node, NodePhase::Replaced);
    }
}
