//! The node's remediation, one at a time: quarantine, drain, replace or terminate, step by
//! step (`Goal` and `Step`), what a failed step climbs to, the lifecycle hook, and an
//! operator's abort.

use serde::{Deserialize, Serialize};

use super::{AWS_DISABLED, Cx, GpuStatus, RULE_LIFECYCLE_TERMINATE};
use crate::model::Timestamp;
use crate::model::{
    Command, IncidentId, IncidentState, LifecycleHook, LifecycleResult, LifecycleState,
    Observation, Verdict,
};

/// The node's state: its phase, the one node remediation in progress, the incident later
/// signals join, and a decision this node's remedies could not carry out.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Node {
    pub phase: NodePhase,
    /// The one node-level remediation (drain, replace, terminate) in progress.
    pub remediation: Option<Remediation>,
    /// The last node remediation's incident; signals after it joins it
    /// (`state.json`: `node_incident`).
    pub incident: Option<IncidentId>,
    /// A node remediation the policy decided and this node's remedies cannot carry out
    /// (`[aws] enabled = false`): what would have been done, for `status`.
    pub withheld: Option<Withheld>,
}

/// A decision nobody could carry out: "would drain: AWS remediation disabled".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Withheld {
    pub incident: IncidentId,
    pub verdict: Verdict,
    pub why: String,
    pub since: Timestamp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum NodePhase {
    #[default]
    InService,
    Quarantined,
    Draining,
    /// Drained and left for an operator.
    Drained,
    Replacing,
    /// Auto Scaling has been told to replace the instance.
    Replaced,
    /// Reboot ordered: the call, then waiting for the new boot.
    Rebooting,
    /// Back from a reboot: checked before it takes tasks again.
    Verifying,
    /// Auto Scaling is terminating the instance (lifecycle hook pending).
    Terminating,
    Terminated,
}

impl NodePhase {
    pub const ALL: [NodePhase; 10] = [
        NodePhase::InService,
        NodePhase::Quarantined,
        NodePhase::Draining,
        NodePhase::Drained,
        NodePhase::Replacing,
        NodePhase::Replaced,
        NodePhase::Rebooting,
        NodePhase::Verifying,
        NodePhase::Terminating,
        NodePhase::Terminated,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            NodePhase::InService => "in-service",
            NodePhase::Quarantined => "quarantined",
            NodePhase::Draining => "draining",
            NodePhase::Drained => "drained",
            NodePhase::Replacing => "replacing",
            NodePhase::Replaced => "replaced",
            NodePhase::Rebooting => "rebooting",
            NodePhase::Verifying => "verifying",
            NodePhase::Terminating => "terminating",
            NodePhase::Terminated => "terminated",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Remediation {
    pub incident: IncidentId,
    pub goal: Goal,
    pub step: Step,
    /// Steps that were carried out (not merely tried): the node phase after a failure says
    /// what really happened, never more.
    #[serde(default)]
    pub quarantined: bool,
    #[serde(default)]
    pub drained: bool,
    /// The reboot happened (a new boot id): what follows is the check after the boot.
    #[serde(default)]
    pub rebooted: bool,
    /// While waiting for the new boot (`Step::AwaitBoot`): when a node still up is replaced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<Timestamp>,
    /// The GPUs passed a diagnosis: the restore that follows closes the incident as
    /// diagnosed healthy.
    #[serde(default)]
    pub diagnosed: bool,
    /// When the diagnose step's first diagnosis was ordered: a diagnosis that could not tell
    /// is ordered again until `[diagnose] retry_within` from here.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnose_since: Option<Timestamp>,
    /// Diagnoses ordered in the step so far.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub diagnoses: u32,
    /// The diagnosis could not tell and the node went back on the passive checks
    /// (`on_unknown` / `boot_on_unknown` = `return`): the restore says so.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub returned_untested: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl Remediation {
    pub fn new(incident: IncidentId, goal: Goal, step: Step) -> Self {
        Remediation {
            incident,
            goal,
            step,
            quarantined: false,
            drained: false,
            rebooted: false,
            until: None,
            diagnosed: false,
            diagnose_since: None,
            diagnoses: 0,
            returned_untested: false,
        }
    }
}

/// Where a node remediation is headed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Goal {
    /// Drain and leave the instance for an operator.
    Drain,
    /// Drain, reboot, check after the boot, return to service.
    Reboot,
    /// Drain, then have Auto Scaling replace it.
    Replace,
    /// Auto Scaling is terminating it: drain, then complete our lifecycle hook.
    Terminate,
}

impl Goal {
    pub fn from_verdict(v: Verdict) -> Option<Goal> {
        match v {
            Verdict::Drain => Some(Goal::Drain),
            Verdict::Reboot => Some(Goal::Reboot),
            Verdict::Replace => Some(Goal::Replace),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Step {
    Quarantine,
    Drain,
    Replace,
    CompleteLifecycle,
    /// Undoing quarantine and drain after an operator abort, or returning the instance to
    /// service after a reboot that mended it.
    Restore,
    /// The reboot order is out.
    Reboot,
    /// The reboot call was accepted; waiting for the new boot (until `Remediation::until`).
    AwaitBoot,
    /// After the boot: the launch gate's checks.
    BootCheck,
    /// The GPUs tested on the drained node (`gpu-medic diagnose`) before it is trusted again.
    Diagnose,
}

impl Node {
    /// A remediation takes the node: later signals join its incident.
    pub fn begin(&mut self, remediation: Remediation) {
        self.incident = Some(remediation.incident);
        self.remediation = Some(remediation);
    }

    /// The remediation is over and leaves the node in `phase`.
    pub fn end(&mut self, phase: NodePhase) {
        self.remediation = None;
        self.phase = phase;
    }
}

impl Step {
    /// The step an order carries out, for the node's orders.
    pub fn of(command: &Command) -> Option<Step> {
        Some(match command {
            Command::Quarantine => Step::Quarantine,
            Command::Drain { .. } => Step::Drain,
            Command::Replace => Step::Replace,
            Command::Restore => Step::Restore,
            Command::Reboot { .. } => Step::Reboot,
            Command::BootCheck => Step::BootCheck,
            Command::Diagnose { .. } => Step::Diagnose,
            Command::CompleteLifecycle { .. } => Step::CompleteLifecycle,
            Command::RestartMps | Command::StopTasks { .. } | Command::CollectEvidence => {
                return None;
            }
        })
    }
}

impl Cx<'_> {
    pub(super) fn node_remediate(
        &mut self,
        obs: Observation,
        verdict: Verdict,
        rule: &str,
        reason: &str,
    ) {
        if let Some(w) = self.st.node.withheld.as_ref()
            && w.verdict >= verdict
            && !self.st.capabilities.aws
        {
            // Already recorded as what would have been done: later faults join it.
            let id = w.incident;
            self.attach(id, &obs);
            if let Some(gpu) = &obs.gpu {
                self.mark_gpu(gpu, GpuStatus::Faulted, rule, verdict, Some(id));
            }
            return;
        }
        if let Some(rem) = self.st.node.remediation {
            self.attach(rem.incident, &obs);
            if let Some(gpu) = &obs.gpu {
                self.mark_gpu(gpu, GpuStatus::Faulted, rule, verdict, Some(rem.incident));
            }
            if verdict == Verdict::Replace && rem.goal == Goal::Drain {
                if let Some(r) = self.st.node.remediation.as_mut() {
                    r.goal = Goal::Replace;
                }
                self.escalated(
                    rem.incident,
                    Verdict::Replace,
                    rule,
                    format!("upgraded from drain to replace: {reason}"),
                );
            }
            self.fault_during_repair(verdict, rule, reason);
            return;
        }
        let finished = match self.st.node.phase {
            NodePhase::Replaced | NodePhase::Terminating | NodePhase::Terminated => true,
            NodePhase::Drained => verdict <= Verdict::Reboot,
            _ => false,
        };
        if finished {
            // The node is already out of service: the signal joins the last node incident.
            match self.st.node.incident {
                Some(last) => {
                    self.attach(last, &obs);
                    if let Some(gpu) = &obs.gpu {
                        self.mark_gpu(gpu, GpuStatus::Faulted, rule, verdict, Some(last));
                    }
                }
                None => {
                    let id = self.open(&obs, rule, reason, verdict);
                    let phase = self.st.node.phase.as_str();
                    self.close(
                        id,
                        IncidentState::Logged,
                        format!("node is already {phase}; nothing more to do"),
                    );
                    self.st.node.incident = Some(id);
                }
            }
            return;
        }
        let id = self.open(&obs, rule, reason, verdict);
        if let Some(gpu) = &obs.gpu {
            self.mark_gpu(gpu, GpuStatus::Faulted, rule, verdict, Some(id));
        }
        self.remediate_in(id, verdict);
        if self.st.node.remediation.is_some_and(|r| r.incident == id) {
            self.evidence_begin(id, &obs);
        }
    }

    /// Starts a node remediation within an existing incident.
    pub(super) fn remediate_in(&mut self, incident: IncidentId, verdict: Verdict) {
        let verdict = if self.st.node.remediation.is_none() {
            self.climb(incident, verdict)
        } else {
            verdict
        };
        let Some(goal) = Goal::from_verdict(verdict) else {
            return;
        };
        if let Some(rem) = self.st.node.remediation {
            if rem.incident != incident {
                // The node is already on its way out under another incident: this one ends
                // here, pointing at it, rather than staying open with nothing left to do.
                self.close(
                    incident,
                    IncidentState::Failed,
                    format!(
                        "joins the node remediation of incident {}, already under way",
                        rem.incident
                    ),
                );
            }
            if goal > rem.goal
                && rem.goal != Goal::Terminate
                && let Some(r) = self.st.node.remediation.as_mut()
            {
                r.goal = goal;
            }
            return;
        }
        if self.dry(incident) {
            self.would_remediate(incident, goal);
            return;
        }
        if !self.st.capabilities.aws {
            let (what, steps) = match goal {
                Goal::Drain => (
                    "quarantined and drained the instance",
                    vec![Command::Quarantine, Command::Drain { terminating: false }],
                ),
                _ => (
                    "quarantined, drained and replaced the instance",
                    vec![
                        Command::Quarantine,
                        Command::Drain { terminating: false },
                        Command::Replace,
                    ],
                ),
            };
            self.st.node.withheld = Some(Withheld {
                incident,
                verdict,
                why: AWS_DISABLED.to_string(),
                since: self.now,
            });
            self.would(incident, steps, what, AWS_DISABLED);
            return;
        }
        let step = if self.st.node.phase == NodePhase::Drained {
            Step::Replace
        } else {
            Step::Quarantine
        };
        self.st.node.begin(Remediation::new(incident, goal, step));
        self.start_step(incident, step, 1);
    }

    /// Observe-only (or a dry run): the remediation's orders recorded, none executed, and the
    /// incident closed saying what would have been done.
    pub(super) fn would_remediate(&mut self, incident: IncidentId, goal: Goal) {
        let boot = self.st.repair.boot.clone().unwrap_or_default();
        let steps = match goal {
            Goal::Drain => self.with_diagnosis(
                vec![Command::Quarantine, Command::Drain { terminating: false }],
                self.policy.diagnose.after_drain,
            ),
            Goal::Reboot => self.with_diagnosis(
                vec![
                    Command::Quarantine,
                    Command::Drain { terminating: false },
                    Command::Reboot { boot },
                ],
                self.policy.diagnose.after_reboot,
            ),
            _ => vec![
                Command::Quarantine,
                Command::Drain { terminating: false },
                Command::Replace,
            ],
        };
        let diagnoses = steps.iter().any(|c| matches!(c, Command::Diagnose { .. }));
        for c in steps {
            self.issue(incident, c, 1);
        }
        let what = match goal {
            Goal::Drain if diagnoses => {
                "quarantined and drained the instance, then diagnosed its GPUs (back in service on a pass, the next rung on a failure)"
            }
            Goal::Drain => "quarantined and drained the instance",
            Goal::Reboot => {
                "quarantined, drained and rebooted the instance (then checked it after the boot and returned it to service, or replaced it)"
            }
            _ => "quarantined, drained and replaced the instance",
        };
        self.close(
            incident,
            IncidentState::Observed,
            format!("observe-only: would have {what}"),
        );
    }

    pub(super) fn start_step(&mut self, incident: IncidentId, step: Step, attempt: u32) {
        if self.evidence_holds(incident, step, attempt) {
            return;
        }
        if let Some(r) = self.st.node.remediation.as_mut() {
            r.step = step;
        }
        let (command, phase) = match step {
            Step::Quarantine => (Command::Quarantine, NodePhase::Quarantined),
            Step::Drain => (
                Command::Drain {
                    terminating: self.st.node.phase == NodePhase::Terminating,
                },
                NodePhase::Draining,
            ),
            Step::Replace => (Command::Replace, NodePhase::Replacing),
            Step::CompleteLifecycle => (
                Command::CompleteLifecycle {
                    hook: LifecycleHook::Terminate,
                    result: LifecycleResult::Continue,
                },
                NodePhase::Terminating,
            ),
            Step::Restore => (Command::Restore, self.st.node.phase),
            Step::Reboot => match self.reboot_command(incident) {
                Some(c) => (c, NodePhase::Rebooting),
                None => {
                    if let Some(r) = self.st.node.remediation.as_mut() {
                        r.goal = Goal::Replace;
                    }
                    return self.start_step(incident, Step::Replace, 1);
                }
            },
            // Waiting for the boot has no order: `tick` enforces `Remediation::until`.
            Step::AwaitBoot => return,
            Step::BootCheck => (Command::BootCheck, NodePhase::Verifying),
            Step::Diagnose => {
                let now = self.now;
                if let Some(r) = self.st.node.remediation.as_mut() {
                    r.diagnose_since.get_or_insert(now);
                    r.diagnoses = r.diagnoses.saturating_add(1);
                }
                (
                    Command::Diagnose {
                        level: self
                            .st
                            .capabilities
                            .diagnose
                            .unwrap_or(crate::model::diagnosis::Level::Quick),
                    },
                    NodePhase::Verifying,
                )
            }
        };
        let phase = match (self.st.node.remediation, step) {
            (Some(r), Step::Quarantine | Step::Restore) if r.rebooted && r.goal == Goal::Reboot => {
                NodePhase::Verifying
            }
            _ => phase,
        };
        if self.st.node.phase != NodePhase::Terminating || step == Step::CompleteLifecycle {
            self.st.node.phase = phase;
        }
        self.issue(incident, command, attempt);
    }

    /// The step after `done` for the current goal, or the end of the remediation.
    pub(super) fn advance(&mut self, done: Step) {
        let Some(rem) = self.st.node.remediation.as_mut() else {
            return;
        };
        match done {
            Step::Quarantine => rem.quarantined = true,
            Step::Drain => rem.drained = true,
            _ => {}
        }
        let rem = *rem;
        let diagnose = self.diagnoses_after(done, rem.goal, rem.incident);
        let next = next_step(done, rem.goal, rem.rebooted, diagnose);
        match next {
            Some(step) => self.start_step(rem.incident, step, 1),
            None => {
                self.st.node.remediation = None;
                let (phase, state, summary) = match (done, rem.goal) {
                    (Step::Drain, _) => (
                        NodePhase::Drained,
                        IncidentState::Drained,
                        "instance quarantined and drained; left for an operator",
                    ),
                    (Step::Replace, _) => (
                        NodePhase::Replaced,
                        IncidentState::Replaced,
                        "instance drained and marked Unhealthy; Auto Scaling replaces it",
                    ),
                    _ => (
                        NodePhase::Terminated,
                        IncidentState::Terminated,
                        "instance drained; lifecycle hook completed with CONTINUE",
                    ),
                };
                self.st.node.phase = phase;
                if done == Step::Drain
                    && rem.goal == Goal::Drain
                    && self.planned_drained(rem.incident)
                {
                    return;
                }
                let summary = self
                    .planned_summary(rem.incident, state)
                    .unwrap_or_else(|| summary.to_string());
                self.close(rem.incident, state, summary);
            }
        }
    }

    /// A step failed for good (or overran its deadline): move on or give up.
    pub(super) fn step_failed(&mut self, step: Step, why: &str) {
        let Some(rem) = self.st.node.remediation else {
            return;
        };
        let id = rem.incident;
        match (step, rem.goal) {
            (Step::Quarantine, Goal::Reboot) if rem.rebooted => {
                self.note(
                    id,
                    format!("quarantine after the boot failed ({why}); checking the node anyway"),
                );
                self.start_step(id, Step::BootCheck, 1);
            }
            (Step::Reboot | Step::AwaitBoot | Step::BootCheck, _) => self.reboot_failed(step, why),
            (Step::Diagnose, _) => self.diagnosis_not_run(id, why),
            (Step::Drain, Goal::Reboot) => {
                self.note(
                    id,
                    format!("drain did not finish ({why}); rebooting anyway, ECS reschedules what is left"),
                );
                self.start_step(id, Step::Reboot, 1);
            }
            (Step::Quarantine, _) => {
                self.note(id, format!("quarantine failed ({why}); draining anyway"));
                self.start_step(id, Step::Drain, 1);
            }
            (Step::Drain, Goal::Replace) => {
                self.note(
                    id,
                    format!("drain did not finish ({why}); replacing anyway, ECS reschedules what is left"),
                );
                self.start_step(id, Step::Replace, 1);
            }
            (Step::Drain, Goal::Terminate) => {
                self.note(
                    id,
                    format!("drain did not finish ({why}); completing the lifecycle hook anyway"),
                );
                self.start_step(id, Step::CompleteLifecycle, 1);
            }
            (Step::Drain, Goal::Drain) => {
                self.st.node.remediation = None;
                let left = if rem.quarantined {
                    self.st.node.phase = NodePhase::Quarantined;
                    "instance left quarantined"
                } else {
                    self.st.node.phase = NodePhase::InService;
                    "the quarantine did not take either: the instance is still in service"
                };
                self.close(
                    id,
                    IncidentState::Failed,
                    format!("drain did not finish ({why}); {left}; operator needed"),
                );
            }
            (Step::Replace, Goal::Terminate) => {
                self.start_step(id, Step::CompleteLifecycle, 1);
            }
            (Step::Replace, _) => {
                self.st.node.remediation = None;
                let (phase, left) = if rem.drained {
                    (NodePhase::Drained, "it stays drained")
                } else if rem.quarantined {
                    (
                        NodePhase::Quarantined,
                        "it stays quarantined (the drain did not finish)",
                    )
                } else {
                    (
                        NodePhase::InService,
                        "neither quarantine nor drain took effect: the instance is still in service",
                    )
                };
                self.st.node.phase = phase;
                self.close(
                    id,
                    IncidentState::Failed,
                    format!("could not have Auto Scaling replace the instance ({why}); {left}; operator needed"),
                );
            }
            (Step::CompleteLifecycle, _) => {
                self.st.node.remediation = None;
                self.close(
                    id,
                    IncidentState::Failed,
                    format!("could not complete the lifecycle hook ({why}); Auto Scaling's hook timeout applies"),
                );
            }
            (Step::Restore, _) => {
                self.st.node.remediation = None;
                self.close(
                    id,
                    IncidentState::Failed,
                    format!("could not return the instance to service ({why}); it may still be quarantined or draining; operator needed"),
                );
            }
        }
    }

    pub(super) fn lifecycle(&mut self, obs: &Observation, state: LifecycleState) {
        if state != LifecycleState::Terminating
            || matches!(
                self.st.node.phase,
                NodePhase::Terminating | NodePhase::Terminated
            )
        {
            return;
        }
        let previous = self.st.node.phase;
        self.st.node.phase = NodePhase::Terminating;
        if let Some(rem) = self.st.node.remediation {
            self.attach(rem.incident, obs);
            self.note(
                rem.incident,
                "Auto Scaling is terminating the instance: finish draining, then complete the hook",
            );
            if let Some(r) = self.st.node.remediation.as_mut() {
                r.goal = Goal::Terminate;
                r.until = None;
            }
            if rem.step == Step::AwaitBoot {
                self.start_step(rem.incident, Step::CompleteLifecycle, 1);
            }
            return;
        }
        let reason =
            "Auto Scaling is terminating the instance: drain it, then complete our lifecycle hook";
        let id = self.open(obs, RULE_LIFECYCLE_TERMINATE, reason, Verdict::Drain);
        if self.policy.observe_only {
            self.issue(id, Command::Drain { terminating: true }, 1);
            self.close(
                id,
                IncidentState::Observed,
                "observe-only: would have drained and completed the lifecycle hook",
            );
            return;
        }
        let step = if matches!(previous, NodePhase::Drained | NodePhase::Replaced) {
            Step::CompleteLifecycle
        } else {
            Step::Drain
        };
        self.st
            .node
            .begin(Remediation::new(id, Goal::Terminate, step));
        self.start_step(id, step, 1);
    }

    /// Stops a node remediation that has not reached Auto Scaling yet and returns the
    /// instance to service. Later steps are refused: once Auto Scaling was told to replace
    /// the instance, undoing it is Auto Scaling's business.
    pub(super) fn abort(&mut self, incident: IncidentId, by: &str) {
        let who = if by.is_empty() { "an operator" } else { by };
        let Some(rem) = self.st.node.remediation.filter(|r| r.incident == incident) else {
            if self.st.incidents.open.contains_key(&incident)
                || self.st.node.incident == Some(incident)
            {
                self.note(
                    incident,
                    format!("abort requested by {who}: no quarantine or drain of this incident is in progress; nothing to undo"),
                );
            }
            return;
        };
        let refuse = match (rem.goal, rem.step) {
            (Goal::Terminate, _) => Some("Auto Scaling is terminating the instance"),
            (_, Step::Replace | Step::CompleteLifecycle) => {
                Some("Auto Scaling has already been asked to replace the instance")
            }
            (_, Step::Reboot | Step::AwaitBoot) => {
                Some("the instance has been asked to reboot; abort after the boot")
            }
            _ => None,
        };
        if let Some(why) = refuse {
            self.note(incident, format!("abort requested by {who} refused: {why}"));
            return;
        }
        // An evidence collection changes nothing on the node: it runs on and its archive is
        // recorded, but the step it held back is dropped with the rest of the repair.
        self.st
            .orders
            .cancel(incident, |c| *c != Command::CollectEvidence);
        self.evidence_release(incident);
        self.repair_aborted(incident);
        self.escalated(
            incident,
            Verdict::Log,
            "operator-abort",
            format!("abort requested by {who}: returning the instance to service"),
        );
        self.st.node.remediation = Some(Remediation {
            step: Step::Restore,
            goal: if rem.goal == Goal::Reboot {
                Goal::Drain
            } else {
                rem.goal
            },
            ..rem
        });
        self.issue(incident, Command::Restore, 1);
    }
}

/// The ladder: the step after `done` succeeded, for a remediation toward `goal`; `None` when
/// the goal is reached. `rebooted`: the instance came back from the reboot we ordered;
/// `diagnose`: the policy tests the GPUs after this step (`Cx::diagnoses_after`). What a step
/// that failed for good climbs to is `Cx::step_failed`.
pub(super) fn next_step(done: Step, goal: Goal, rebooted: bool, diagnose: bool) -> Option<Step> {
    match (done, goal) {
        (Step::Quarantine, Goal::Reboot) if rebooted => Some(Step::BootCheck),
        (Step::Quarantine, _) => Some(Step::Drain),
        (Step::Drain, Goal::Drain) if diagnose => Some(Step::Diagnose),
        (Step::Drain, Goal::Drain) => None,
        (Step::Drain, Goal::Reboot) => Some(Step::Reboot),
        (Step::Drain, Goal::Replace) => Some(Step::Replace),
        (Step::Drain | Step::Replace, Goal::Terminate) => Some(Step::CompleteLifecycle),
        (Step::BootCheck, Goal::Reboot) if diagnose => Some(Step::Diagnose),
        (Step::BootCheck, Goal::Reboot) => Some(Step::Restore),
        (Step::BootCheck, Goal::Terminate) => Some(Step::CompleteLifecycle),
        (Step::BootCheck, _) => Some(Step::Drain),
        (Step::Replace | Step::CompleteLifecycle | Step::Restore, _) => None,
        // The reboot's own steps and the diagnosis move on by their outcomes
        // (`engine::repair`, `engine::diagnose`), not by this table.
        (Step::Reboot | Step::AwaitBoot | Step::Diagnose, _) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each goal's climb from quarantine to its end, as operators read it in docs/repair.md.
    #[test]
    fn each_goal_climbs_its_ladder() {
        let climb = |goal: Goal, rebooted: bool, diagnose: bool| {
            let mut steps = vec![Step::Quarantine];
            while let Some(next) = next_step(
                *steps.last().unwrap_or(&Step::Quarantine),
                goal,
                rebooted,
                diagnose,
            ) {
                steps.push(next);
                assert!(steps.len() < 10, "{goal:?} loops: {steps:?}");
            }
            steps
        };
        use Step::*;
        assert_eq!(climb(Goal::Drain, false, false), [Quarantine, Drain]);
        assert_eq!(
            climb(Goal::Drain, false, true),
            [Quarantine, Drain, Diagnose]
        );
        assert_eq!(
            climb(Goal::Replace, false, false),
            [Quarantine, Drain, Replace]
        );
        assert_eq!(
            climb(Goal::Terminate, false, false),
            [Quarantine, Drain, CompleteLifecycle]
        );
        assert_eq!(
            climb(Goal::Reboot, false, false),
            [Quarantine, Drain, Reboot]
        );
        // After the boot: quarantined again, checked, then back in service or tested first.
        assert_eq!(
            climb(Goal::Reboot, true, false),
            [Quarantine, BootCheck, Restore]
        );
        assert_eq!(
            climb(Goal::Reboot, true, true),
            [Quarantine, BootCheck, Diagnose]
        );
        assert_eq!(
            next_step(BootCheck, Goal::Replace, true, false),
            Some(Drain)
        );
        assert_eq!(
            next_step(BootCheck, Goal::Terminate, true, false),
            Some(CompleteLifecycle)
        );
    }
}
