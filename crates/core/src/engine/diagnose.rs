//! The diagnose step: a drained node's GPUs are tested before the node is trusted with tasks
//! again (docs/diagnose.md; the policy's `[diagnose]`). It runs, with the node's fleet-budget
//! slot still held,
//!
//! - after a reboot's boot check (`after_reboot`): a pass returns the node to service, a
//!   failure replaces it, "could not tell" does what `on_unknown` says;
//! - after the drain of a `drain` verdict (`after_drain`): a pass returns the node to service
//!   (the incident closes as diagnosed healthy), a failure climbs to `on_fail` (`reboot`,
//!   through the ladder, or `replace`), "could not tell" does what `on_unknown` says.
//!
//! A node with no tool that can run (`Capabilities::diagnose` none) skips the step and is
//! judged as before. Only a diagnosis a tool was seen to pass returns a node: an order that
//! failed, overran its deadline or brought no diagnosis is "could not tell". One that passed
//! with configuration findings ("needs configuration": DCGM's Deployment tests) returns it too,
//! the findings in the incident: they never drain or replace a node by themselves.
//!
//! "Could not tell" is bounded: the diagnosis is ordered again every `[diagnose] retry_delay`
//! until `retry_within` from the step's first one (nv-hostengine may still be starting after
//! a boot); then after a reboot `boot_on_unknown` (`return` on the passive checks, or
//! `replace`: never kept, so the slot and the node are never held for ever), after a drain
//! `on_unknown`.

use super::{Cx, Goal, NodePhase, Step};
use crate::model::diagnosis::{DiagResult, Diagnosis};
use crate::model::{Command, IncidentId, IncidentState, Verdict};
use crate::policy::diagnose::OnUnknown;

/// The rule recorded when a failed diagnosis moves a node up the ladder.
pub const RULE_DIAGNOSIS_FAILED: &str = "diagnosis-failed";
/// The rule recorded when a diagnosis that could not tell replaces a node (`on_unknown`).
pub const RULE_DIAGNOSIS_UNKNOWN: &str = "diagnosis-unknown";

impl Cx<'_> {
    /// Whether this node diagnoses at this point of a remediation.
    pub(super) fn diagnoses_after(&self, done: Step, goal: Goal, incident: IncidentId) -> bool {
        if self.st.capabilities.diagnose.is_none() {
            return false;
        }
        let p = self.policy.diagnose;
        match (done, goal) {
            (Step::BootCheck, Goal::Reboot) => p.after_reboot,
            (Step::Drain, Goal::Drain) => {
                // A drain ahead of AWS's planned event waits for the event, not a test.
                p.after_drain && self.st.planned.by_incident(incident).is_none()
            }
            _ => false,
        }
    }

    /// A `diagnose` order came back with a diagnosis (or without one: could not tell).
    pub(super) fn diagnosed(&mut self, incident: IncidentId, d: Option<&Diagnosis>) {
        let Some(rem) = self.st.node.remediation.filter(|r| r.incident == incident) else {
            return;
        };
        let Some(d) = d else {
            return self.diagnosis_unknown(incident, "the remedy brought back no diagnosis");
        };
        let level = d.level.as_str();
        match d.result {
            DiagResult::Pass | DiagResult::Config => {
                let passed = if d.result == DiagResult::Config {
                    "passed with configuration findings (needs configuration, not a hardware fault: reported, not acted on)"
                } else {
                    "passed"
                };
                self.note(
                    incident,
                    format!(
                        "diagnosis ({level}) {passed}: {}; returning the instance to service",
                        d.summary
                    ),
                );
                if let Some(r) = self.st.node.remediation.as_mut() {
                    r.diagnosed = true;
                    r.diagnose_since = None;
                    r.diagnoses = 0;
                }
                self.start_step(incident, Step::Restore, 1);
            }
            DiagResult::Fail => {
                if let Some(r) = self.st.node.remediation.as_mut() {
                    r.diagnose_since = None;
                    r.diagnoses = 0;
                }
                let why = format!("diagnosis ({level}) failed: {}", d.summary);
                if rem.rebooted || rem.goal != Goal::Drain {
                    // After a reboot the node had its repair: a failure replaces it.
                    self.reboot_failed(Step::Diagnose, &why);
                } else {
                    self.climb_after_diagnosis(incident, why);
                }
            }
            DiagResult::Unknown => {
                let why = format!("diagnosis ({level}) could not tell: {}", d.summary);
                self.diagnosis_unknown(incident, &why);
            }
        }
    }

    /// A drained node failed its diagnosis: the policy's next rung (`on_fail`).
    fn climb_after_diagnosis(&mut self, incident: IncidentId, why: String) {
        let wanted = self.policy.diagnose.on_fail;
        self.escalated(
            incident,
            wanted,
            RULE_DIAGNOSIS_FAILED,
            format!("{why}: the GPU is suspected; the next rung is `{wanted}`"),
        );
        let verdict = self.climb(incident, wanted);
        let (goal, step) = if verdict == Verdict::Reboot {
            (Goal::Reboot, Step::Reboot)
        } else {
            (Goal::Replace, Step::Replace)
        };
        if let Some(r) = self.st.node.remediation.as_mut() {
            r.goal = goal;
            r.until = None;
        }
        self.start_step(incident, step, 1);
    }

    /// The diagnosis could not tell (no tool answered, a timeout, the order failed): ordered
    /// again within `[diagnose] retry_within`; then, after a reboot, what `boot_on_unknown`
    /// says, after a drain what `on_unknown` says. Never a pass.
    pub(super) fn diagnosis_unknown(&mut self, incident: IncidentId, why: &str) {
        let Some(rem) = self.st.node.remediation.filter(|r| r.incident == incident) else {
            return;
        };
        let p = self.policy.diagnose;
        let since = rem.diagnose_since.unwrap_or(self.now);
        let until = since.plus(p.retry_within);
        if self.now.plus(p.retry_delay) < until {
            let attempt = rem.diagnoses.saturating_add(1);
            self.note(
                incident,
                format!(
                    "{why}; diagnosing again in {} (attempt {attempt}; [diagnose] retry_within = {}: until {until})",
                    humantime::format_duration(p.retry_delay),
                    humantime::format_duration(p.retry_within)
                ),
            );
            let level = self
                .st
                .capabilities
                .diagnose
                .unwrap_or(crate::model::diagnosis::Level::Quick);
            self.schedule(
                incident,
                Command::Diagnose { level },
                attempt,
                p.retry_delay,
            );
            return;
        }
        if let Some(r) = self.st.node.remediation.as_mut() {
            r.diagnose_since = None;
            r.diagnoses = 0;
        }
        let why = format!(
            "{why} ({} diagnosis(es) within {}, [diagnose] retry_within)",
            rem.diagnoses.max(1),
            humantime::format_duration(self.now.since(since))
        );
        if rem.rebooted {
            return self.boot_diagnosis_unknown(incident, &why);
        }
        match p.on_unknown {
            OnUnknown::Keep => {
                self.st.node.end(NodePhase::Drained);
                self.close(
                    incident,
                    IncidentState::Drained,
                    format!(
                        "{why}; after the drain the instance stays quarantined and drained for an operator ([diagnose] on_unknown = \"keep\"); the fleet budget slot stays held"
                    ),
                );
            }
            OnUnknown::Return => {
                self.note(
                    incident,
                    format!("{why}; returning the instance to service on the passive checks ([diagnose] on_unknown = \"return\")"),
                );
                if let Some(r) = self.st.node.remediation.as_mut() {
                    r.returned_untested = true;
                }
                self.start_step(incident, Step::Restore, 1);
            }
            OnUnknown::Replace => {
                self.escalated(
                    incident,
                    Verdict::Replace,
                    RULE_DIAGNOSIS_UNKNOWN,
                    format!("{why}: replacing ([diagnose] on_unknown = \"replace\")"),
                );
                if let Some(r) = self.st.node.remediation.as_mut() {
                    r.goal = Goal::Replace;
                }
                self.start_step(incident, Step::Replace, 1);
            }
        }
    }

    /// After a reboot the diagnosis still could not tell: `boot_on_unknown`. The node passed
    /// the boot check (the passive checks); it never stays drained holding its slot.
    fn boot_diagnosis_unknown(&mut self, incident: IncidentId, why: &str) {
        match self.policy.diagnose.boot_on_unknown {
            OnUnknown::Replace => {
                self.reboot_failed(
                    Step::Diagnose,
                    &format!("{why}; [diagnose] boot_on_unknown = \"replace\""),
                );
            }
            // `keep` is refused when the policy is read: it would hold the slot for ever.
            OnUnknown::Return | OnUnknown::Keep => {
                self.note(
                    incident,
                    format!(
                        "{why}; returning the instance to service on the boot check's passive checks, which it passed ([diagnose] boot_on_unknown = \"return\"); the fleet budget slot is released"
                    ),
                );
                if let Some(r) = self.st.node.remediation.as_mut() {
                    r.returned_untested = true;
                }
                self.start_step(incident, Step::Restore, 1);
            }
        }
    }

    /// The diagnose order failed for good or overran its deadline: could not tell.
    pub(super) fn diagnosis_not_run(&mut self, incident: IncidentId, why: &str) {
        let why = format!("the diagnosis could not run ({why})");
        self.diagnosis_unknown(incident, &why);
    }

    /// What observe-only records for a remediation's `steps`, the diagnosis after them when
    /// this node diagnoses there (`wanted`).
    pub(super) fn with_diagnosis(&self, mut steps: Vec<Command>, wanted: bool) -> Vec<Command> {
        if let Some(level) = self.st.capabilities.diagnose.filter(|_| wanted) {
            steps.push(Command::Diagnose { level });
        }
        steps
    }

    /// Back in service on the passive checks after a drained node's diagnosis could not tell
    /// (`on_unknown = "return"`).
    pub(super) fn returned_untested(&mut self, incident: IncidentId) {
        self.back_in_service(incident);
        self.close(
            incident,
            IncidentState::Resolved,
            "returned to service on the passive checks: the diagnosis could not tell (see the note before); quarantine cleared, container instance ACTIVE, fleet budget slot released",
        );
    }

    /// Back in service after a diagnosis passed on a drained node (no reboot).
    pub(super) fn diagnosed_healthy(&mut self, incident: IncidentId) {
        self.back_in_service(incident);
        self.close(
            incident,
            IncidentState::Resolved,
            "diagnosed healthy: the GPUs passed their diagnosis after the drain; quarantine cleared, container instance ACTIVE, fleet budget slot released",
        );
    }
}

#[cfg(test)]
mod tests;
