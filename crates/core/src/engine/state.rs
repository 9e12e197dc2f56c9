//! What the engine remembers between inputs. It is persisted as `state.json` before any
//! order is handed to a remedy, so a restarted supervisor resumes where it stopped.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::attribution::AppFaults;
use super::drills::{ArmedDrill, DrillMark, Drills, MAX_ARMED_DRILLS, MAX_DRILL_INCIDENTS};
use super::evidence::EvidenceWait;
use super::gpus::{GpuHealth, Gpus};
use super::incidents::{Incidents, OpenIncident, RecentLog, SelfFault};
use super::mps::MpsState;
use super::node::{Node, NodePhase, Remediation, Withheld};
use super::orders::{Orders, Scheduled};
use super::planned::Planned;
use super::repair::Ledger;
use super::{MAX_RECENT_LOGS, MAX_SIGHTING_KEYS};
use crate::model::Capabilities;
use crate::model::bounded::{BoundedMap, BoundedVec};
pub use crate::model::cursor::{Delivery, StreamCursor};
use crate::model::{ActionId, IncidentId, Order, Timestamp};

/// Everything the engine remembers, one part per concern; each part's type lives with the
/// concern that changes it (`engine/<concern>.rs`). The coordinator (`engine/mod.rs`) is the
/// only code that reaches into more than one part for one rule.
///
/// `state.json` keeps the flat format every release wrote (`StateFile`): the parts are how
/// the code holds it, not how the file spells it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct State {
    /// Incidents: ids, the open ones and their signals, log-only repeats, own faults.
    pub incidents: Incidents,
    /// Orders: ids, those a remedy holds, those to issue later.
    pub orders: Orders,
    /// The node's phase and its one remediation.
    pub node: Node,
    /// Each judged GPU, and the stop-tasks work per GPU.
    pub gpus: Gpus,
    /// The MPS daemon and its restart budget.
    pub mps: MpsState,
    /// Recent sightings per `rule@target`, for confirmation and escalation windows (the
    /// coordinator's judge).
    pub sightings: BoundedMap<String, Sightings, MAX_SIGHTING_KEYS>,
    /// What this node's remedies can do (from `Input::Started`).
    pub capabilities: Capabilities,
    /// The reboot rung: this boot's id and the instance's repair history (it survives the
    /// reboots it records).
    pub repair: Ledger,
    /// Disruptions AWS plans for this instance, and the ECS agent's verdict
    /// (`engine::planned`).
    pub planned: Planned,
    /// Delivery bookkeeping, kept by the supervisor; the engine never reads or changes it.
    pub delivery: Delivery,
    /// The evidence collection in flight, and the step waiting for it (engine/evidence.rs).
    pub evidence: Option<EvidenceWait>,
    /// Drills armed, and the incidents that are drills.
    pub drills: Drills,
    /// Application faults by program and place, and the XIDs a later one may join
    /// (`engine::attribution`).
    pub app: AppFaults,
}

/// `state.json` as it is read: one flat object, in the format every release wrote. A field
/// without `default` must be present (a file without it was not written by the engine).
#[derive(Deserialize)]
struct StateFile {
    next_incident: u64,
    next_action: u64,
    node: NodePhase,
    gpus: BTreeMap<u32, GpuHealth>,
    mps: MpsState,
    remediation: Option<Remediation>,
    gpu_jobs: BTreeMap<u32, IncidentId>,
    in_flight: BTreeMap<ActionId, Order>,
    scheduled: Vec<Scheduled>,
    sightings: BoundedMap<String, Sightings, MAX_SIGHTING_KEYS>,
    open: BTreeMap<IncidentId, OpenIncident>,
    #[serde(default)]
    node_incident: Option<IncidentId>,
    #[serde(default)]
    attached: BTreeMap<IncidentId, BTreeSet<String>>,
    #[serde(default)]
    recent_logs: BoundedMap<String, RecentLog, MAX_RECENT_LOGS>,
    #[serde(default)]
    self_faults: BTreeMap<String, SelfFault>,
    #[serde(default)]
    withheld: Option<Withheld>,
    #[serde(default)]
    capabilities: Capabilities,
    #[serde(default)]
    repair: Ledger,
    #[serde(default)]
    planned: Planned,
    #[serde(default)]
    delivery: Delivery,
    #[serde(default)]
    evidence: Option<EvidenceWait>,
    #[serde(default)]
    armed_drills: BoundedVec<ArmedDrill, MAX_ARMED_DRILLS>,
    #[serde(default)]
    drills: BoundedMap<IncidentId, DrillMark, MAX_DRILL_INCIDENTS>,
    #[serde(default)]
    app: AppFaults,
}

/// The format of `state.json` this engine writes. It goes up whenever a release writes
/// something an older one would drop or misread (a new field that holds a guarantee, a new
/// word in a field): an older release refuses a newer format instead of losing it silently
/// (`journal::load_state`; `gpu-medic run --accept-newer-state` reads it anyway).
///
/// 1: every release before the field (a file without `format`). 2: `format` and
/// `written_by`; a repair result `unknown` (a reboot known only from the instance's tag).
pub const STATE_FORMAT: u32 = 2;

/// Who wrote a `state.json`: `gpu-medic <version>` (the workspace's version; the core's
/// equals it, a test keeps them equal).
pub fn writer() -> String {
    format!("gpu-medic {}", env!("CARGO_PKG_VERSION"))
}

/// `state.json` as it is written: [`StateFile`]'s fields, in its order, borrowed from the
/// parts, after the format and the writer.
#[derive(Serialize)]
struct StateFileRef<'a> {
    format: u32,
    written_by: String,
    next_incident: u64,
    next_action: u64,
    node: NodePhase,
    gpus: &'a BTreeMap<u32, GpuHealth>,
    mps: &'a MpsState,
    remediation: Option<Remediation>,
    gpu_jobs: &'a BTreeMap<u32, IncidentId>,
    in_flight: &'a BTreeMap<ActionId, Order>,
    scheduled: &'a [Scheduled],
    sightings: &'a BoundedMap<String, Sightings, MAX_SIGHTING_KEYS>,
    open: &'a BTreeMap<IncidentId, OpenIncident>,
    node_incident: Option<IncidentId>,
    attached: &'a BTreeMap<IncidentId, BTreeSet<String>>,
    recent_logs: &'a BoundedMap<String, RecentLog, MAX_RECENT_LOGS>,
    self_faults: &'a BTreeMap<String, SelfFault>,
    withheld: Option<&'a Withheld>,
    capabilities: &'a Capabilities,
    repair: &'a Ledger,
    planned: &'a Planned,
    delivery: &'a Delivery,
    #[serde(skip_serializing_if = "Option::is_none")]
    evidence: Option<&'a EvidenceWait>,
    #[serde(skip_serializing_if = "Option::is_none")]
    armed_drills: Option<&'a BoundedVec<ArmedDrill, MAX_ARMED_DRILLS>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    drills: Option<&'a BoundedMap<IncidentId, DrillMark, MAX_DRILL_INCIDENTS>>,
    app: &'a AppFaults,
}

impl Serialize for State {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        StateFileRef {
            format: STATE_FORMAT,
            written_by: writer(),
            next_incident: self.incidents.last_id,
            next_action: self.orders.last_id,
            node: self.node.phase,
            gpus: &self.gpus.health,
            mps: &self.mps,
            remediation: self.node.remediation,
            gpu_jobs: &self.gpus.jobs,
            in_flight: &self.orders.in_flight,
            scheduled: &self.orders.scheduled,
            sightings: &self.sightings,
            open: &self.incidents.open,
            node_incident: self.node.incident,
            attached: &self.incidents.attached,
            recent_logs: &self.incidents.recent_logs,
            self_faults: &self.incidents.self_faults,
            withheld: self.node.withheld.as_ref(),
            capabilities: &self.capabilities,
            repair: &self.repair,
            planned: &self.planned,
            delivery: &self.delivery,
            evidence: self.evidence.as_ref(),
            armed_drills: (!self.drills.armed.is_empty()).then_some(&self.drills.armed),
            drills: (!self.drills.incidents.is_empty()).then_some(&self.drills.incidents),
            app: &self.app,
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for State {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let f = StateFile::deserialize(deserializer)?;
        Ok(State {
            incidents: Incidents {
                last_id: f.next_incident,
                open: f.open,
                attached: f.attached,
                recent_logs: f.recent_logs,
                self_faults: f.self_faults,
            },
            orders: Orders {
                last_id: f.next_action,
                in_flight: f.in_flight,
                scheduled: f.scheduled,
            },
            node: Node {
                phase: f.node,
                remediation: f.remediation,
                incident: f.node_incident,
                withheld: f.withheld,
            },
            gpus: Gpus {
                health: f.gpus,
                jobs: f.gpu_jobs,
            },
            mps: f.mps,
            sightings: f.sightings,
            capabilities: f.capabilities,
            repair: f.repair,
            planned: f.planned,
            delivery: f.delivery,
            evidence: f.evidence,
            drills: Drills {
                armed: f.armed_drills,
                incidents: f.drills,
            },
            app: f.app,
        })
    }
}

/// The times one `rule@target` was seen, oldest first: no count the policy accepts needs
/// more than the newest [`MAX_SIGHTINGS`](crate::policy::limits::MAX_SIGHTINGS).
pub type Sightings = BoundedVec<Timestamp, { crate::policy::limits::MAX_SIGHTINGS }>;

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
        check("next_incident", self.incidents.last_id)?;
        check("next_action", self.orders.last_id)?;
        check("delivery.applied", self.delivery.applied)?;
        for (stream, c) in &self.delivery.cursors {
            check(&format!("delivery.cursors.{stream}.pos"), c.pos)?;
        }
        for id in self.incidents.open.keys() {
            check("an open incident's id", id.0)?;
        }
        for id in self.orders.in_flight.keys() {
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
        bounded(
            "open",
            self.incidents.open.len(),
            crate::model::MAX_OPEN_INCIDENTS,
        )?;
        for a in self.incidents.attached.values() {
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
