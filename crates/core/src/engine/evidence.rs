//! Evidence collection in the engine (docs/evidence.md): a `collect-evidence` order issued
//! beside the quarantine when a node remediation starts (as the rule's `evidence`, or else
//! `[evidence] mode`, says: off, on fatal, always), the reboot, replacement or lifecycle
//! completion held back while it runs but never past its deadline, and what was not
//! collected noted in the incident.

use serde::{Deserialize, Serialize};

use super::{Cx, Step};
use crate::model::{
    ActionId, Command, EvidenceMode, IncidentId, Observation, Order, Outcome, Signal,
};
use crate::policy::xid_catalog;

/// A collection in flight and the step that waits for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvidenceWait {
    pub incident: IncidentId,
    pub action: ActionId,
    /// The step held back until the collection ends (outcome or deadline), with its attempt.
    #[serde(default)]
    pub held: Option<(Step, u32)>,
}

/// Whether NVIDIA's catalog calls the signal fatal (a reset or more).
fn is_fatal(signal: &Signal) -> bool {
    xid_catalog::fatal_signals()
        .iter()
        .any(|f| match (f, signal) {
            (
                Signal::Xid {
                    code: a,
                    decode: da,
                },
                Signal::Xid {
                    code: b,
                    decode: db,
                },
            ) => a == b && (da.is_none() || da == db),
            (a, b) => a == b,
        })
}

impl Cx<'_> {
    /// Orders a collection for a node remediation that just started, if the mode says so.
    pub(super) fn evidence_begin(&mut self, incident: IncidentId, obs: &Observation) {
        let Some(plan) = self.st.capabilities.evidence else {
            return;
        };
        // The rule's own `evidence`, where it has one, in place of `[evidence] mode`.
        let rule_mode = self.st.incidents.open.get(&incident).and_then(|o| {
            let name = crate::policy::base_rule(&o.rule);
            self.policy.rule_named(name).and_then(|r| r.evidence)
        });
        let wanted = match rule_mode.unwrap_or(plan.mode) {
            EvidenceMode::Off => false,
            EvidenceMode::OnFatal => is_fatal(&obs.signal),
            EvidenceMode::Always => true,
        };
        if !wanted || self.st.evidence.is_some() || self.policy.observe_only {
            return;
        }
        if let Some(action) = self.issue(incident, Command::CollectEvidence, 1) {
            self.st.evidence = Some(EvidenceWait {
                incident,
                action,
                held: None,
            });
        }
    }

    /// Lets go of the step an incident's collection holds back (the step is dropped; the
    /// collection runs on and its archive is recorded).
    pub(super) fn evidence_release(&mut self, incident: IncidentId) {
        if let Some(w) = self.st.evidence.as_mut().filter(|w| w.incident == incident) {
            w.held = None;
        }
    }

    /// Holds `step` back while a collection of the same incident runs. Returns true when held.
    pub(super) fn evidence_holds(
        &mut self,
        incident: IncidentId,
        step: Step,
        attempt: u32,
    ) -> bool {
        if !matches!(step, Step::Reboot | Step::Replace | Step::CompleteLifecycle) {
            return false;
        }
        let Some(w) = self.st.evidence.as_mut() else {
            return false;
        };
        let Some(order) = self.st.orders.in_flight.get(&w.action) else {
            self.st.evidence = None;
            return false;
        };
        w.held = Some((step, attempt));
        let (action, deadline) = (order.id, order.deadline);
        let what = match step {
            Step::Reboot => "the reboot",
            Step::Replace => "the replacement",
            _ => "completing the lifecycle hook",
        };
        self.note(
            incident,
            format!(
                "{what} waits for the evidence collection ({action}), at most until {deadline}"
            ),
        );
        true
    }

    /// A collection ended (outcome, failure or deadline): record what is missing and let the
    /// held step go.
    pub(super) fn evidence_ended(&mut self, order: &Order, outcome: Option<&Outcome>, why: &str) {
        let done = outcome.and_then(|o| o.evidence.as_deref());
        match done {
            Some(e) if !e.missing.is_empty() => {
                let parts: Vec<String> = e
                    .missing
                    .iter()
                    .map(|m| format!("{} ({})", m.part, m.why))
                    .collect();
                self.note(
                    order.incident,
                    format!("evidence not collected: {}", parts.join("; ")),
                );
            }
            Some(_) => {}
            None => self.note(
                order.incident,
                format!("no evidence archive: {why}; the repair goes on without it"),
            ),
        }
        let Some(w) = self.st.evidence.take() else {
            return;
        };
        if w.action != order.id {
            self.st.evidence = Some(w);
            return;
        }
        if let Some((step, attempt)) = w.held {
            let still = self
                .st
                .node
                .remediation
                .is_some_and(|r| r.incident == w.incident);
            if still {
                self.start_step(w.incident, step, attempt);
            }
        }
    }
}
