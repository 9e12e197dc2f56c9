//! The reboot rung: repair in place before replacing (docs/repair.md).
//!
//! A `reboot` verdict runs quarantine -> drain -> reboot, the fleet budget's slot held from
//! the drain to the end. The reboot order is journaled (and the state saved) before the
//! remedy makes the call; the kernel's boot id the engine saw when it gave the order travels
//! with it. After the boot the supervisor reports the new boot id (`Input::Boot`): the
//! repair resumes with a quarantine of the container instance (it may have come back under a
//! new ARN), the launch gate's checks (`Command::BootCheck`), and the return to service
//! (`Command::Restore`: attribute cleared, ACTIVE, slot released), closing the incident as
//! repaired. A reboot that does not happen (the call refused, the node still up past
//! `[deadlines] reboot`) or a node that fails the check goes on to `replace`, its slot still
//! held.
//!
//! The ladder: the history of reboots per instance lives in the state (it survives the
//! reboots it counts). A reboot verdict goes straight to `replace` when the node had
//! `[reboot] limit` reboots within `[reboot] window`, when its rule's own `reboots` are spent
//! (XID 79: the first time only), or when it comes within `[reboot] recur_within` of the
//! last reboot's return to service. Each climb is an `escalated` record saying why.

use serde::{Deserialize, Serialize};

use super::{Cx, Goal, NodePhase, Step};
pub use crate::model::repair::{Repair, RepairResult};
use crate::model::{
    Command, IncidentEvent, IncidentId, IncidentState, Outcome, OutcomeStatus, Signal, Timestamp,
    Verdict,
};

/// The rule name recorded when the ladder sends a reboot verdict on to `replace`.
pub const RULE_LADDER: &str = "reboot-ladder";
/// The rule name recorded when a reboot does not happen or does not mend the node.
pub const RULE_REBOOT_FAILED: &str = "reboot-failed";
/// At most this many repairs are remembered (the oldest goes first); the number lives below
/// both the engine and the policy, which bounds `[reboot] limit` by it.
pub use crate::model::MAX_REBOOT_HISTORY as MAX_HISTORY;

/// This boot and the instance's repair history.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Ledger {
    /// The kernel boot id the supervisor reported at its last start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot: Option<String>,
    /// Reboots ordered on this instance, oldest first.
    #[serde(default)]
    pub history: crate::model::bounded::BoundedVec<Repair, MAX_HISTORY>,
}

impl Ledger {
    /// The pending repair of `incident` ends with `result` (and why); a repaired one records
    /// when the node came back.
    pub fn settle(
        &mut self,
        incident: IncidentId,
        result: RepairResult,
        why: &str,
        now: Timestamp,
    ) {
        if let Some(r) = self.pending_mut(incident) {
            r.result = result;
            r.why = why.to_string();
            if result == RepairResult::Repaired {
                r.back_at = Some(now);
            }
        }
    }

    /// Takes in the reboots kept outside `state.json` (`Input::Reboots`): one the history
    /// lacks (the same incident ordered at the same time) is added; one it has is completed
    /// with what the kept copy knows and the history does not (the boot after it, the return
    /// to service, a settled result where the history still says pending: a rebuilt history
    /// may have lost the records that said so). The newest [`MAX_HISTORY`] stay, oldest first.
    /// The engine's own history is never made to forget a reboot.
    pub fn merge(&mut self, kept: Vec<Repair>) {
        let mut all: Vec<Repair> = self.history.to_vec();
        for k in kept {
            match all
                .iter_mut()
                .find(|r| r.incident == k.incident && r.at == k.at)
            {
                Some(r) => {
                    if r.boot_after.is_none() {
                        r.boot_after = k.boot_after;
                    }
                    if r.back_at.is_none() {
                        r.back_at = k.back_at;
                    }
                    if r.result == RepairResult::Pending && k.result != RepairResult::Pending {
                        r.result = k.result;
                        r.why = k.why;
                    }
                }
                None => all.push(k),
            }
        }
        all.sort_by_key(|r| r.at);
        self.history = crate::model::bounded::BoundedVec::newest(&all);
    }

    /// The repair of `incident` still under way.
    pub fn pending(&self, incident: IncidentId) -> Option<&Repair> {
        self.history
            .iter()
            .rev()
            .find(|r| r.incident == incident && r.result == RepairResult::Pending)
    }

    fn pending_mut(&mut self, incident: IncidentId) -> Option<&mut Repair> {
        self.history
            .iter_mut()
            .rev()
            .find(|r| r.incident == incident && r.result == RepairResult::Pending)
    }
}

fn base_rule(rule: &str) -> &str {
    crate::policy::base_rule(rule)
}

impl Cx<'_> {
    /// A reboot verdict on a node that cannot reboot (`[repair] reboot = "off"`, or no AWS
    /// control plane) is carried out as `replace`, and says so.
    pub(super) fn rung_available(&self, verdict: Verdict, reason: &str) -> (Verdict, String) {
        if verdict == Verdict::Reboot && !self.st.capabilities.reboot {
            return (
                Verdict::Replace,
                format!(
                    "{reason} (the policy says reboot; this node has no reboot rung ([repair] reboot = \"off\" or AWS remediation disabled), so it is replaced)"
                ),
            );
        }
        (verdict, reason.to_string())
    }

    /// The ladder: whether a reboot verdict for `incident` stays a reboot. When it goes up,
    /// the incident says why and `replace` is returned.
    pub(super) fn climb(&mut self, incident: IncidentId, verdict: Verdict) -> Verdict {
        if verdict != Verdict::Reboot {
            return verdict;
        }
        if !self.st.capabilities.reboot {
            let why = "the policy says reboot; this node has no reboot rung ([repair] reboot = \"off\" or AWS remediation disabled): replacing";
            self.escalated(incident, Verdict::Replace, RULE_LADDER, why.to_string());
            return Verdict::Replace;
        }
        let now = self.now;
        let lad = self.policy.reboot;
        let rule = self
            .st
            .incidents
            .open
            .get(&incident)
            .map(|o| base_rule(&o.rule).to_string())
            .unwrap_or_default();
        let rebooted: Vec<&Repair> = self
            .st
            .repair
            .history
            .iter()
            .filter(|r| r.rebooted() && now.since(r.at) <= lad.window)
            .collect();
        let window = humantime::format_duration(lad.window);
        let n = u32::try_from(rebooted.len()).unwrap_or(u32::MAX);
        let same =
            u32::try_from(rebooted.iter().filter(|r| r.rule == rule).count()).unwrap_or(u32::MAX);
        let per_rule = self.policy.rule_named(&rule).and_then(|r| r.reboots);
        let recent = self
            .st
            .repair
            .history
            .iter()
            .rev()
            .find_map(|r| r.back_at.map(|b| (r.incident, b)))
            .filter(|(_, b)| now.since(*b) <= lad.recur_within);
        let why = if n >= lad.limit {
            Some(format!(
                "reboot ladder: this instance was rebooted {n} time(s) within {window} (limit {}, gpud's threshold): a node that keeps needing reboots is replaced",
                lad.limit
            ))
        } else if let Some(k) = per_rule.filter(|k| same >= *k) {
            Some(format!(
                "reboot ladder: rule `{rule}` allows {k} reboot(s) within {window} and this instance had {same} for it: the same fault again is replaced"
            ))
        } else {
            recent.map(|(id, back)| {
                format!(
                    "reboot ladder: a fault {} after incident {id}'s reboot returned the instance to service (within {}): the reboot did not mend it",
                    humantime::format_duration(std::time::Duration::from_secs(now.since(back).as_secs())),
                    humantime::format_duration(lad.recur_within)
                )
            })
        };
        match why {
            Some(why) => {
                self.escalated(incident, Verdict::Replace, RULE_LADDER, why);
                Verdict::Replace
            }
            None => {
                self.note(
                    incident,
                    format!(
                        "reboot rung: {n} reboot(s) of this instance within {window} (limit {}){}; rebooting",
                        lad.limit,
                        per_rule.map_or(String::new(), |k| format!(
                            ", {same} of {k} for rule `{rule}`"
                        ))
                    ),
                );
                Verdict::Reboot
            }
        }
    }

    /// The reboot order, with the boot it is meant to end; `None` (and the repair goes on to
    /// `replace`) when the boot id is unknown: a reboot gpu-medic could not tell apart from
    /// the boot before is never ordered.
    pub(super) fn reboot_command(&mut self, incident: IncidentId) -> Option<Command> {
        let Some(boot) = self.st.repair.boot.clone().filter(|b| !b.is_empty()) else {
            self.escalated(
                incident,
                Verdict::Replace,
                RULE_REBOOT_FAILED,
                "the kernel boot id is unknown ([repair] boot_id_path could not be read at start): gpu-medic could not tell the boot after a reboot apart, so it does not reboot; replacing".into(),
            );
            return None;
        };
        if self.st.repair.pending(incident).is_none() {
            let rule = self
                .st
                .incidents
                .open
                .get(&incident)
                .map(|o| base_rule(&o.rule).to_string())
                .unwrap_or_default();
            self.st.repair.history.push_evicting(Repair {
                incident,
                rule,
                at: self.now,
                boot_before: boot.clone(),
                boot_after: None,
                back_at: None,
                result: RepairResult::Pending,
                why: String::new(),
            });
        }
        Some(Command::Reboot { boot })
    }

    /// The supervisor started in boot `id`. A new boot during a repair's reboot means it
    /// happened: the reboot order is finished (never handed out again) and the check after
    /// the boot begins.
    pub(super) fn boot(&mut self, id: String) {
        self.st.repair.boot = Some(id.clone());
        let Some(rem) = self.st.node.remediation else {
            return;
        };
        if !matches!(rem.step, Step::Reboot | Step::AwaitBoot) {
            return;
        }
        let Some(before) = self
            .st
            .repair
            .pending(rem.incident)
            .map(|r| r.boot_before.clone())
        else {
            return;
        };
        if before == id {
            return; // gpu-medic restarted; the instance did not
        }
        if let Some(r) = self.st.repair.pending_mut(rem.incident) {
            r.boot_after = Some(id.clone());
        }
        let reboots = self
            .st
            .orders
            .take_in_flight(rem.incident, |c| matches!(c, Command::Reboot { .. }));
        for action in reboots {
            self.record(
                rem.incident,
                IncidentEvent::ActionFinished {
                    outcome: Outcome {
                        action,
                        status: OutcomeStatus::Done,
                        detail: format!(
                            "the instance rebooted (gpu-medic stopped before the call returned): boot id {id}, was {before}"
                        ),
                        request_ids: Vec::new(),
                        evidence: None, fleet: None,
                    diagnosis: None,
                    },
                },
            );
        }
        self.note(
            rem.incident,
            format!("new boot {id} (was {before}): the reboot happened; checking the node before it takes tasks again"),
        );
        if let Some(r) = self.st.node.remediation.as_mut() {
            r.rebooted = true;
            r.until = None;
        }
        match rem.goal {
            Goal::Reboot => self.start_step(rem.incident, Step::Quarantine, 1),
            Goal::Terminate => self.start_step(rem.incident, Step::CompleteLifecycle, 1),
            Goal::Drain | Goal::Replace => self.start_step(rem.incident, Step::Drain, 1),
        }
    }

    /// The reboot call was accepted: wait for the new boot until `[deadlines] reboot`.
    pub(super) fn reboot_accepted(&mut self, incident: IncidentId) {
        let Some(rem) = self.st.node.remediation.filter(|r| r.incident == incident) else {
            return;
        };
        match rem.goal {
            Goal::Reboot => {
                let until = self.now.plus(self.policy.deadlines.reboot);
                if let Some(r) = self.st.node.remediation.as_mut() {
                    r.step = Step::AwaitBoot;
                    r.until = Some(until);
                }
                self.st.node.phase = NodePhase::Rebooting;
                self.note(
                    incident,
                    format!("reboot accepted; waiting for the new boot until {until}"),
                );
            }
            Goal::Terminate => self.start_step(incident, Step::CompleteLifecycle, 1),
            Goal::Drain | Goal::Replace => self.start_step(incident, Step::Replace, 1),
        }
    }

    /// The reboot did not happen, or did not mend the node: on to `replace`, the slot held.
    pub(super) fn reboot_failed(&mut self, step: Step, why: &str) {
        let Some(rem) = self.st.node.remediation else {
            return;
        };
        let id = rem.incident;
        if rem.goal == Goal::Terminate {
            self.start_step(id, Step::CompleteLifecycle, 1);
            return;
        }
        let (result, reason, next) = match step {
            Step::Reboot | Step::AwaitBoot => (
                RepairResult::NotRebooted,
                format!("the reboot did not happen ({why}): replacing"),
                Step::Replace,
            ),
            _ => (
                RepairResult::Escalated,
                format!("the node is not healthy after the reboot ({why}): replacing"),
                Step::Drain,
            ),
        };
        self.st.repair.settle(id, result, why, self.now);
        if let Some(r) = self.st.node.remediation.as_mut() {
            r.goal = Goal::Replace;
            r.until = None;
        }
        if rem.goal == Goal::Replace {
            // Already on its way to replace (the fault came back): say why, once.
            self.note(id, reason);
        } else {
            self.escalated(id, Verdict::Replace, RULE_REBOOT_FAILED, reason);
        }
        self.start_step(id, next, 1);
    }

    /// A fault while a reboot repair is under way. Before the reboot it joins the repair;
    /// after it (or a `replace` verdict at any time) the repair goes on to `replace`.
    pub(super) fn fault_during_repair(&mut self, verdict: Verdict, rule: &str, reason: &str) {
        let Some(rem) = self.st.node.remediation.filter(|r| r.goal == Goal::Reboot) else {
            return;
        };
        let came_back = rem.rebooted && verdict >= Verdict::Reboot;
        if verdict != Verdict::Replace && !came_back {
            return;
        }
        let why = if came_back && verdict != Verdict::Replace {
            format!("the fault came back after the reboot: {reason}")
        } else {
            format!("upgraded from reboot to replace: {reason}")
        };
        if rem.rebooted {
            self.st
                .repair
                .settle(rem.incident, RepairResult::Escalated, &why, self.now);
        } else {
            self.st
                .repair
                .settle(rem.incident, RepairResult::Aborted, &why, self.now);
        }
        if let Some(r) = self.st.node.remediation.as_mut() {
            r.goal = Goal::Replace;
        }
        self.escalated(rem.incident, Verdict::Replace, rule, why);
        if rem.step == Step::AwaitBoot {
            if let Some(r) = self.st.node.remediation.as_mut() {
                r.until = None;
            }
            self.start_step(rem.incident, Step::Replace, 1);
        }
    }

    /// Back in service after the boot check.
    pub(super) fn repaired(&mut self, incident: IncidentId) {
        let untested = self
            .st
            .node
            .remediation
            .is_some_and(|r| r.returned_untested);
        self.back_in_service(incident);
        let boot = self.st.repair.boot.clone().unwrap_or_default();
        // A pending row remap takes effect at the reset a reboot makes; the boot check found
        // none pending (its rule is itself a reboot verdict), so it was applied.
        let pending = format!("{}@", Signal::RowRemapPending);
        let remapped: Vec<&str> = self
            .st
            .incidents
            .attached
            .get(&incident)
            .into_iter()
            .flatten()
            .filter_map(|k| k.strip_prefix(pending.as_str()))
            .collect();
        let applied = if remapped.is_empty() {
            String::new()
        } else {
            format!(
                "; the pending row remap on GPU {} applied (none pending at the check after the boot)",
                remapped.join(", ")
            )
        };
        self.st
            .repair
            .settle(incident, RepairResult::Repaired, "", self.now);
        self.close(
            incident,
            IncidentState::Repaired,
            if untested {
                format!(
                    "repaired by reboot: passed the boot check (boot id {boot}); the diagnosis could not tell (see the note before), so it returned on the passive checks ([diagnose] boot_on_unknown = \"return\"); quarantine cleared, container instance ACTIVE, fleet budget slot released{applied}"
                )
            } else {
                format!(
                    "repaired by reboot: healthy after the boot (boot id {boot}); quarantine cleared, container instance ACTIVE, fleet budget slot released{applied}"
                )
            },
        );
    }

    /// An operator stopped the repair: it is no longer pending.
    pub(super) fn repair_aborted(&mut self, incident: IncidentId) {
        self.st.repair.settle(
            incident,
            RepairResult::Aborted,
            "aborted by an operator",
            self.now,
        );
    }

    /// Past `[deadlines] reboot` with the instance still up.
    pub(super) fn await_boot_overdue(&mut self) {
        let Some(rem) = self.st.node.remediation else {
            return;
        };
        let Some(until) = rem
            .until
            .filter(|u| rem.step == Step::AwaitBoot && *u <= self.now)
        else {
            return;
        };
        let why = format!(
            "the instance is still up at {until}, {} after the reboot was accepted",
            humantime::format_duration(self.policy.deadlines.reboot)
        );
        self.reboot_failed(Step::AwaitBoot, &why);
    }
}

#[cfg(test)]
mod tests;
