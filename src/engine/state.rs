//! What the engine remembers between inputs. It is persisted as `state.json` before any
//! order is handed to a remedy, so a restarted supervisor resumes where it stopped.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

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
    pub sightings: BTreeMap<String, Vec<Timestamp>>,
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
    pub recent_logs: BTreeMap<String, RecentLog>,
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
    /// Delivery bookkeeping, kept by the supervisor; the engine never reads or changes it.
    #[serde(default)]
    pub delivery: Delivery,
}

/// The largest counter or position accepted from a file (`state.json`, `inputs.jsonl`, the
/// export cursor): far beyond what a node's lifetime reaches (2^62 inputs), far enough below
/// `u64::MAX` that every counter can still advance. A larger value is corruption, refused
/// where it is read, never saturated later.
pub const MAX_COUNTER: u64 = 1 << 62;

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

/// How far the inputs and the sources are applied to this state. Saved with it, so that the
/// state, the journal and every source's cursor agree after any restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Delivery {
    /// The sequence number of the last `inputs.jsonl` entry this state includes.
    #[serde(default)]
    pub applied: u64,
    /// Per source stream (`kmsg:<boot id>`, `mps-log:<file>`), the highest position applied:
    /// a record at or below it, read again after a restart, is a duplicate.
    #[serde(default)]
    pub cursors: BTreeMap<String, StreamCursor>,
}

/// At most this many streams are remembered (a stream of an earlier boot is dropped first).
pub const MAX_STREAMS: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamCursor {
    pub pos: u64,
    /// When it last moved, to drop the stalest stream first.
    pub at: Timestamp,
    /// The source's opaque position (a journald cursor), see `model::Cursor::token`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl Delivery {
    /// Whether the record at `c` is already applied. A stream with a token resumes after its
    /// token (its reader never hands a record out twice), so nothing of it is a duplicate.
    pub fn seen_cursor(&self, c: &crate::model::Cursor) -> bool {
        c.token.is_none() && self.seen(&c.stream, c.pos)
    }

    /// Moves the stream of `c` past it. A token stream follows its reader's order (a
    /// journald entry's time stamp may step back with the clock; its cursor still moves).
    pub fn advance_cursor(&mut self, c: &crate::model::Cursor, at: Timestamp) {
        if c.token.is_none() {
            self.advance(&c.stream, c.pos, at);
            return;
        }
        self.cursors.remove(&c.stream);
        self.advance(&c.stream, c.pos, at);
        if let Some(sc) = self.cursors.get_mut(&c.stream) {
            sc.token = c.token.clone();
        }
    }

    /// The token last applied for `stream` (a journald cursor to resume after).
    pub fn token(&self, stream: &str) -> Option<&str> {
        self.cursors.get(stream)?.token.as_deref()
    }

    /// Whether `pos` of `stream` is already applied.
    pub fn seen(&self, stream: &str, pos: u64) -> bool {
        self.cursors.get(stream).is_some_and(|c| pos <= c.pos)
    }

    /// Moves a stream's cursor forward (never back).
    pub fn advance(&mut self, stream: &str, pos: u64, at: Timestamp) {
        match self.cursors.get_mut(stream) {
            Some(c) => {
                if pos > c.pos {
                    c.pos = pos;
                    c.at = at;
                }
            }
            None => {
                while self.cursors.len() >= MAX_STREAMS {
                    let Some(stalest) = self
                        .cursors
                        .iter()
                        .min_by_key(|(_, c)| c.at)
                        .map(|(k, _)| k.clone())
                    else {
                        break;
                    };
                    self.cursors.remove(&stalest);
                }
                self.cursors.insert(
                    stream.to_string(),
                    StreamCursor {
                        pos,
                        at,
                        token: None,
                    },
                );
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecentLog {
    pub incident: IncidentId,
    pub at: Timestamp,
    pub repeats: u32,
    /// Repeats by signal (`xid 13`), at most `MAX_COUNTED_SIGNALS` of them.
    #[serde(default)]
    pub counts: BTreeMap<String, u32>,
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
    /// Auto Scaling is terminating the instance (lifecycle hook pending).
    Terminating,
    Terminated,
}

impl NodePhase {
    pub const ALL: [NodePhase; 8] = [
        NodePhase::InService,
        NodePhase::Quarantined,
        NodePhase::Draining,
        NodePhase::Drained,
        NodePhase::Replacing,
        NodePhase::Replaced,
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
}

impl Remediation {
    pub fn new(incident: IncidentId, goal: Goal, step: Step) -> Self {
        Remediation {
            incident,
            goal,
            step,
            quarantined: false,
            drained: false,
        }
    }
}

/// Where a node remediation is headed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Goal {
    /// Drain and leave the instance for an operator.
    Drain,
    /// Drain, then have Auto Scaling replace it.
    Replace,
    /// Auto Scaling is terminating it: drain, then complete our lifecycle hook.
    Terminate,
}

impl Goal {
    pub fn from_verdict(v: Verdict) -> Option<Goal> {
        match v {
            Verdict::Drain => Some(Goal::Drain),
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
    /// Undoing quarantine and drain after an operator abort.
    Restore,
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
    pub fn node_orders_pending(&self) -> usize {
        let is_node = |c: &Command| {
            matches!(
                c,
                Command::Quarantine | Command::Drain { .. } | Command::Replace | Command::Restore
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
