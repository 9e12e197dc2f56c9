//! What the engine remembers between inputs. It is persisted as `state.json` before any
//! order is handed to a remedy, so a restarted supervisor resumes where it stopped.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::bounded::{BoundedMap, BoundedVec};
pub use crate::model::cursor::{Delivery, StreamCursor};
use crate::model::{ActionId, Command, GpuId, IncidentId, Order, Timestamp, Verdict};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct State {
    pub next_incident: u64,
    pub next_action: u64,
    pub node: NodePhase,
    /// GPUs that have been judged (healthy GPUs never seen in a signal are absent).
    pub gpus: BTreeMap<u32, GpuHealth>,
    pub mps: MpsState,
    /// The one node-level remediation (drain, replace, terminate) in progress.
    pub remediation: Option<Remediation>,
    /// Stop-tasks work per GPU index, by incident.
    pub gpu_jobs: BTreeMap<u32, IncidentId>,
    /// Orders handed to remedies, awaiting an outcome.
    pub in_flight: BTreeMap<ActionId, Order>,
    /// Orders to issue later (retries, deferrals).
    pub scheduled: Vec<Scheduled>,
    /// Recent sightings per `rule@target`, for confirmation and escalation windows.
    pub sightings: BoundedMap<String, Sightings, { super::MAX_SIGHTING_KEYS }>,
    /// Incidents not yet closed.
    pub open: BTreeMap<IncidentId, OpenIncident>,
    /// The last node remediation's incident; signals after it joins it.
    #[serde(default)]
    pub node_incident: Option<IncidentId>,
    /// Signals already in each incident's timeline (see `attach`).
    #[serde(default)]
    pub attached: BTreeMap<IncidentId, std::collections::BTreeSet<String>>,
    /// The last log-only incident per `rule@target`, for repeat suppression.
    #[serde(default)]
    pub recent_logs: BoundedMap<String, RecentLog, { super::MAX_RECENT_LOGS }>,
    /// gpu-medic's own faults by component (`nvml`, `mps-control`), each with its open
    /// incident: journaled once, shown by `status`, never remediated.
    #[serde(default)]
    pub self_faults: BTreeMap<String, SelfFault>,
    /// A node remediation the policy decided and this node's remedies cannot carry out
    /// (`[aws] enabled = false`): what would have been done, for `status`.
    #[serde(default)]
    pub withheld: Option<Withheld>,
    /// What this node's remedies can do (from `Input::Started`).
    #[serde(default)]
    pub capabilities: crate::model::Capabilities,
    /// The reboot rung: this boot's id and the instance's repair history (it survives the
    /// reboots it records).
    #[serde(default)]
    pub repair: super::repair::Ledger,
    /// Disruptions AWS plans for this instance, and the ECS agent's verdict
    /// (`engine::planned`).
    #[serde(default)]
    pub planned: super::planned::Planned,
    /// Delivery bookkeeping, kept by the supervisor; the engine never reads or changes it.
    #[serde(default)]
    pub delivery: Delivery,
    /// The evidence collection in flight, and the step waiting for it (engine/evidence.rs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<super::evidence::EvidenceWait>,
    /// Drills asked for (`gpu-medic drill`) whose signal has not opened an incident yet.
    #[serde(default, skip_serializing_if = "BoundedVec::is_empty")]
    pub armed_drills: BoundedVec<ArmedDrill, MAX_ARMED_DRILLS>,
    /// Incidents that are drills: their records carry the drill's id, and an observe drill's
    /// orders are journaled, not executed. The newest [`MAX_DRILL_INCIDENTS`] are kept.
    #[serde(default, skip_serializing_if = "BoundedMap::is_empty")]
    pub drills: BoundedMap<IncidentId, DrillMark, MAX_DRILL_INCIDENTS>,
    /// Application faults by program and place, and the XIDs a later one may join
    /// (`engine::attribution`).
    #[serde(default)]
    pub app: super::attribution::AppFaults,
}

/// The times one `rule@target` was seen, oldest first: no count the policy accepts needs
/// more than the newest [`MAX_SIGHTINGS`](crate::policy::limits::MAX_SIGHTINGS).
pub type Sightings = BoundedVec<Timestamp, { crate::policy::limits::MAX_SIGHTINGS }>;

/// Bound on the drills armed at once (the oldest goes first).
pub const MAX_ARMED_DRILLS: usize = 8;
/// Bound on the drill incidents remembered (the oldest goes first).
pub const MAX_DRILL_INCIDENTS: usize = 64;

/// A drill waiting for its signal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArmedDrill {
    pub drill: crate::model::Drill,
    pub at: Timestamp,
}

/// What the engine keeps of a drill once it opened its incident.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrillMark {
    pub id: String,
    #[serde(default)]
    pub observe: bool,
}

pub use crate::model::MAX_COUNTER;

impl State {
    /// Whether every counter read from a file can still advance (see [`MAX_COUNTER`]).
    pub fn check_ranges(&self) -> Result<(), String> {
        let check = |what: &str, v: u64| {
            if v > MAX_COUNTER {
                Err(format!("{what} = {v} is beyond {MAX_COUNTER}"))
            } else {
                Ok(())
            }
        };
        check("next_incident", self.next_incident)?;
        check("next_action", self.next_action)?;
        check("delivery.applied", self.delivery.applied)?;
        for (stream, c) in &self.delivery.cursors {
            check(&format!("delivery.cursors.{stream}.pos"), c.pos)?;
        }
        for id in self.open.keys() {
            check("an open incident's id", id.0)?;
        }
        for id in self.in_flight.keys() {
            check("an order's id", id.0)?;
        }
        self.check_sizes()
    }

    /// Whether no collection holds more than the engine ever keeps in it: a state that does
    /// was not written by the engine (a hand, a corrupt writer), and would cost its size in
    /// memory and time on every step, so it is refused like a number out of range.
    fn check_sizes(&self) -> Result<(), String> {
        let bounded = |what: &str, len: usize, max: usize| {
            if len > max {
                Err(format!(
                    "{what} holds {len} entries, more than the engine keeps ({max})"
                ))
            } else {
                Ok(())
            }
        };
        for a in self.attached.values() {
            bounded(
                "an incident's attached signals",
                a.len(),
                super::MAX_ATTACHED_PER_INCIDENT,
            )?;
        }
        self.app.check_sizes()?;
        bounded(
            "delivery.cursors",
            self.delivery.cursors.len(),
            crate::model::cursor::MAX_STREAMS,
        )?;
        bounded(
            "delivery.ahead",
            self.delivery.ahead.len(),
            crate::model::cursor::MAX_AHEAD,
        )?;
        for (_, pos) in &self.delivery.ahead {
            if *pos > MAX_COUNTER {
                return Err(format!("delivery.ahead holds {pos}, beyond {MAX_COUNTER}"));
            }
        }
        Ok(())
    }
}

/// One of gpu-medic's own faults (see `Signal::SelfFault`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelfFault {
    pub incident: IncidentId,
    pub since: Timestamp,
    #[serde(default)]
    pub detail: String,
}

/// A decision nobody could carry out: "would drain: AWS remediation disabled".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Withheld {
    pub incident: IncidentId,
    pub verdict: Verdict,
    pub why: String,
    pub since: Timestamp,
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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHealth {
    pub gpu: GpuId,
    pub status: GpuStatus,
    /// The rule behind the status and its verdict.
    pub rule: String,
    pub verdict: Verdict,
    pub incident: Option<IncidentId>,
    pub since: Timestamp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuStatus {
    Healthy,
    /// A signal was seen and awaits confirmation.
    Suspect,
    /// Judged faulty; sticky until the instance is replaced.
    Faulted,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct MpsState {
    pub phase: MpsPhase,
    /// When each restart was issued (pruned to the budget window).
    pub restarts: Vec<Timestamp>,
    pub incident: Option<IncidentId>,
    /// A restart of ours stops the running daemon; under systemd's `Restart=` the unit then
    /// starts it again and counts it in `NRestarts`. The one `mps-crash` from the unit that
    /// follows is that, not a crash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_exit: Option<OwnExit>,
}

/// A restart of ours whose exit systemd may still report ([`MpsState::own_exit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnExit {
    /// When the restart was issued, or when it ended once `ended`.
    pub at: Timestamp,
    pub ended: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum MpsPhase {
    #[default]
    Up,
    Unresponsive,
    Restarting,
    /// The restart budget is spent; the policy's fallback applies.
    Failed,
}

impl MpsPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            MpsPhase::Up => "up",
            MpsPhase::Unresponsive => "unresponsive",
            MpsPhase::Restarting => "restarting",
            MpsPhase::Failed => "failed",
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

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Scheduled {
    pub at: Timestamp,
    pub incident: IncidentId,
    pub command: Command,
    pub attempt: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenIncident {
    pub opened_at: Timestamp,
    pub verdict: Verdict,
    pub rule: String,
    #[serde(default)]
    pub gpu: Option<u32>,
}

impl State {
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
