//! Orders handed to remedies (`Orders`): ids and deadlines, issuing and scheduling them, the
//! end of each (recorded, then deferred, retried or handed on) and those past their
//! deadline. Which concern an order's end goes back to is the coordinator's rule
//! (`engine/mod.rs`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::Cx;
use crate::model::{
    Action, ActionId, Command, IncidentEvent, IncidentId, Order, Outcome, OutcomeStatus, Timestamp,
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
    /// The next action id (`MAX_COUNTER` bounds it: a state whose counter cannot advance is
    /// refused as it is read).
    pub fn next_id(&mut self) -> ActionId {
        self.last_id = self.last_id.saturating_add(1);
        ActionId(self.last_id)
    }

    /// Whether an order of this command is in a remedy's hands.
    pub fn in_flight_any(&self, command: &Command) -> bool {
        self.in_flight.values().any(|o| &o.command == command)
    }

    /// Drops an incident's orders: those scheduled, and those in flight that `pick` picks
    /// (their late outcomes are then ignored).
    pub fn cancel(&mut self, incident: IncidentId, pick: impl Fn(&Command) -> bool) {
        self.take_in_flight(incident, pick);
        self.scheduled.retain(|s| s.incident != incident);
    }

    /// Takes an incident's orders that `pick` picks out of the remedies' hands (their late
    /// outcomes are then ignored), and drops those of them scheduled; returns the ids taken.
    pub fn take_in_flight(
        &mut self,
        incident: IncidentId,
        pick: impl Fn(&Command) -> bool,
    ) -> Vec<ActionId> {
        let taken: Vec<ActionId> = self
            .in_flight
            .values()
            .filter(|o| o.incident == incident && pick(&o.command))
            .map(|o| o.id)
            .collect();
        for id in &taken {
            self.in_flight.remove(id);
        }
        self.scheduled
            .retain(|s| s.incident != incident || !pick(&s.command));
        taken
    }
    /// Takes the orders past their deadline out of the remedies' hands.
    pub fn take_overdue(&mut self, now: Timestamp) -> Vec<Order> {
        let overdue: Vec<ActionId> = self
            .in_flight
            .values()
            .filter(|o| o.deadline <= now)
            .map(|o| o.id)
            .collect();
        overdue
            .iter()
            .filter_map(|id| self.in_flight.remove(id))
            .collect()
    }

    /// Takes the scheduled orders that are due, in the order they were scheduled.
    pub fn take_due(&mut self, now: Timestamp) -> Vec<Scheduled> {
        let (due, later) = std::mem::take(&mut self.scheduled)
            .into_iter()
            .partition(|s| s.at <= now);
        self.scheduled = later;
        due
    }

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
    /// Returns the executable order's id, `None` when only recorded.
    pub(super) fn issue(
        &mut self,
        incident: IncidentId,
        command: Command,
        attempt: u32,
    ) -> Option<ActionId> {
        let id = self.st.orders.next_id();
        let (planned_deadline, planned) = self.planned_order(incident, &command);
        let order = Order {
            id,
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
            return None;
        }
        self.st.orders.in_flight.insert(order.id, order.clone());
        self.out.push(Action::Execute(order));
        Some(id)
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

    /// The orders' side of an outcome: the order leaves the remedy's hands and its end is
    /// recorded. `None` for an outcome of an order already escalated past its deadline.
    pub(super) fn order_finished(&mut self, outcome: &Outcome) -> Option<Order> {
        let order = self.st.orders.in_flight.remove(&outcome.action)?;
        self.record(
            order.incident,
            IncidentEvent::ActionFinished {
                outcome: outcome.clone(),
            },
        );
        Some(order)
    }

    /// What an outcome leaves for the concern that issued the order: `None` when the orders
    /// took it (deferred, or a retryable failure with attempts left: scheduled again);
    /// otherwise done, or failed and why. An MPS restart is never retried here (its budget is
    /// the MPS concern's), nor is an evidence upload (its remedy retries).
    pub(super) fn order_retry(
        &mut self,
        order: &Order,
        outcome: &Outcome,
    ) -> Option<Result<(), String>> {
        match outcome.status {
            OutcomeStatus::Done => Some(Ok(())),
            OutcomeStatus::Deferred { retry_after } => {
                self.schedule(
                    order.incident,
                    order.command.clone(),
                    order.attempt,
                    retry_after,
                );
                None
            }
            OutcomeStatus::Failed { retryable } => {
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
                    None
                } else {
                    Some(Err(failure(outcome)))
                }
            }
        }
    }

    /// The orders past their deadline, taken from the remedies' hands with the escalation
    /// recorded; the coordinator fails each one to the concern that issued it.
    pub(super) fn orders_overdue(&mut self) -> Vec<Order> {
        let overdue = self.st.orders.take_overdue(self.now);
        for order in &overdue {
            self.record(
                order.incident,
                IncidentEvent::DeadlineMissed {
                    action: order.id,
                    escalation: escalation(&order.command).to_string(),
                },
            );
        }
        overdue
    }
}

/// What an outcome says went wrong ("failed" when the remedy said nothing).
pub(super) fn failure(outcome: &Outcome) -> String {
    if outcome.detail.is_empty() {
        "failed".to_string()
    } else {
        outcome.detail.clone()
    }
}

/// What a missed deadline leads to, for the record.
fn escalation(command: &Command) -> &'static str {
    match command {
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
    }
}
