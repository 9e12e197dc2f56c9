//! Orders handed to remedies: their deadlines, issuing and scheduling them, what their
//! outcomes mean, and the tick that retries, expires and forgets.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Cx, Goal, LOG_REPEAT_WINDOW, MPS_NOT_MANAGED, MpsPhase, NodePhase, OwnExit, Step};
use crate::model::Timestamp;
use crate::model::{
    Action, ActionId, Command, IncidentEvent, IncidentId, IncidentState, Order, Outcome,
    OutcomeStatus, Verdict,
};
use std::time::Duration;

/// The orders' state: the last id handed out, the orders a remedy holds, and those to issue
/// later.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Orders {
    /// The last action id handed out (`state.json`: `next_action`).
    pub last_id: u64,
    /// Orders handed to remedies, awaiting an outcome.
    pub in_flight: BTreeMap<ActionId, Order>,
    /// Orders to issue later (retries, deferrals).
    pub scheduled: Vec<Scheduled>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scheduled {
    pub at: Timestamp,
    pub incident: IncidentId,
    pub command: Command,
    pub attempt: u32,
}

impl Orders {
    /// Orders that take the node out of service and are in flight or scheduled.
    #[cfg(test)]
    pub fn node_orders_pending(&self) -> usize {
        let is_node = |c: &Command| {
            matches!(
                c,
                Command::Quarantine
                    | Command::Drain { .. }
                    | Command::Replace
                    | Command::Restore
                    | Command::Reboot { .. }
                    | Command::BootCheck
            )
        };
        self.in_flight
            .values()
            .filter(|o| is_node(&o.command))
            .count()
            + self
                .scheduled
                .iter()
                .filter(|s| is_node(&s.command))
                .count()
    }
}

impl Cx<'_> {
    pub(super) fn deadline_for(&self, command: &Command) -> Duration {
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
    pub(super) fn issue(&mut self, incident: IncidentId, command: Command, attempt: u32) -> bool {
        self.st.orders.last_id = self.st.orders.last_id.saturating_add(1);
        let (planned_deadline, planned) = self.planned_order(incident, &command);
        let order = Order {
            id: ActionId(self.st.orders.last_id),
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
        self.st.orders.in_flight.insert(order.id, order.clone());
        self.out.push(Action::Execute(order));
        true
    }

    pub(super) fn schedule(
        &mut self,
        incident: IncidentId,
        command: Command,
        attempt: u32,
        after: Duration,
    ) {
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
        self.st.orders.scheduled.push(Scheduled {
            at,
            incident,
            command,
            attempt,
        });
    }

    pub(super) fn outcome(&mut self, outcome: Outcome) {
        let Some(order) = self.st.orders.in_flight.remove(&outcome.action) else {
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

    pub(super) fn order_done(&mut self, order: &Order) {
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
                self.st.gpus.jobs.remove(&gpu.index);
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
                    .node
                    .remediation
                    .is_some_and(|r| r.diagnosed && !r.rebooted) =>
            {
                self.diagnosed_healthy(order.incident)
            }
            Command::Restore
                if self
                    .st
                    .node
                    .remediation
                    .is_some_and(|r| r.goal == Goal::Reboot && r.rebooted) =>
            {
                self.repaired(order.incident)
            }
            Command::Restore => {
                self.st.node.remediation = None;
                self.st.node.phase = NodePhase::InService;
                let incident = order.incident;
                self.st
                    .gpus
                    .health
                    .retain(|_, g| g.incident != Some(incident));
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

    pub(super) fn order_failed(&mut self, order: &Order, why: &str) {
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
                self.st.gpus.jobs.remove(&gpu.index);
                self.close(
                    order.incident,
                    IncidentState::Failed,
                    format!("could not stop the tasks on {gpu} ({why}); {MPS_NOT_MANAGED}; operator needed"),
                );
            }
            Command::StopTasks { gpu, .. } => {
                self.st.gpus.jobs.remove(&gpu.index);
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

    pub(super) fn tick(&mut self) {
        self.expire_drills();
        let now = self.now;
        let overdue: Vec<Order> = self
            .st
            .orders
            .in_flight
            .values()
            .filter(|o| o.deadline <= now)
            .cloned()
            .collect();
        for order in overdue {
            self.st.orders.in_flight.remove(&order.id);
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
        let (due, later): (Vec<Scheduled>, Vec<Scheduled>) =
            std::mem::take(&mut self.st.orders.scheduled)
                .into_iter()
                .partition(|s| s.at <= now);
        self.st.orders.scheduled = later;
        for s in due {
            self.reissue(s);
        }
        self.await_boot_overdue();
        self.planned_tick();
        self.st
            .incidents
            .recent_logs
            .retain(|_, r| now.since(r.at) < LOG_REPEAT_WINDOW || r.repeats > 0);
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
        let longest = self.longest_window();
        self.st.sightings.retain(|_, seen| {
            seen.retain(|t| now.since(*t) <= longest);
            !seen.is_empty()
        });
    }

    pub(super) fn reissue(&mut self, s: Scheduled) {
        match &s.command {
            Command::RestartMps => {
                if self.st.mps.phase != MpsPhase::Up && self.st.mps.incident == Some(s.incident) {
                    self.mps_try_restart(s.incident);
                }
            }
            Command::StopTasks { gpu, .. } => {
                if self.st.gpus.jobs.get(&gpu.index) == Some(&s.incident) {
                    self.issue(s.incident, s.command.clone(), s.attempt);
                }
            }
            _ => {
                let Some(rem) = self.st.node.remediation else {
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

    pub(super) fn longest_window(&self) -> Duration {
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
