//! The fleet view: incidents of every instance of a cluster, read back from CloudWatch Logs
//! (the instances themselves may be long gone). The service filters (the log group, the
//! instance's stream, the start time, a JSON filter pattern on the record's fields); the
//! records are checked again here, duplicates (same record id: at-least-once delivery) are
//! dropped, and each incident is folded from its records in journal order.
//!
//! moto 5.2.5 ignores JSON filter patterns (it returns every event): the check here makes
//! the result the same (docs/aws.md).

use std::collections::{BTreeMap, HashSet};

use super::Shipped;
use crate::aws::calls::{CallError, Calls};
use crate::aws::logs::{Logs, Query, Scan};
use crate::model::{Incident, IncidentEvent, Record};

/// At most this many events are read per query.
pub const MAX_EVENTS: usize = 200_000;

/// What to read.
#[derive(Debug, Clone, Default)]
pub struct FleetQuery {
    pub log_group: String,
    /// One instance (its stream) only.
    pub instance: Option<String>,
    /// One incident only (with `instance`): its whole timeline.
    pub incident: Option<u64>,
    /// Records from this time on (ms since the epoch).
    pub since_ms: Option<u64>,
}

/// The events a list needs: what sets an incident's row (opening, signals, escalations,
/// outcomes, closing), not every step.
const LIST_EVENTS: &[&str] = &["opened", "signal", "escalated", "action-finished", "closed"];

impl FleetQuery {
    /// The CloudWatch Logs filter pattern for this query.
    pub fn pattern(&self) -> String {
        match self.incident {
            Some(id) => format!("{{ $.incident = {id} }}"),
            None => {
                let alts: Vec<String> = LIST_EVENTS
                    .iter()
                    .map(|e| format!("($.event = \"{e}\")"))
                    .collect();
                format!("{{ {} }}", alts.join(" || "))
            }
        }
    }

    fn wants(&self, s: &Shipped) -> bool {
        self.instance.as_ref().is_none_or(|i| *i == s.instance_id)
            && self.since_ms.is_none_or(|t| s.record.at.0 >= t)
            && match self.incident {
                Some(id) => s.record.incident.0 == id,
                None => LIST_EVENTS.contains(&event_name(&s.record.event)),
            }
    }
}

fn event_name(e: &IncidentEvent) -> &'static str {
    match e {
        IncidentEvent::Opened { .. } => "opened",
        IncidentEvent::Signal { .. } => "signal",
        IncidentEvent::Escalated { .. } => "escalated",
        IncidentEvent::ActionStarted { .. } => "action-started",
        IncidentEvent::ActionFinished { .. } => "action-finished",
        IncidentEvent::DeadlineMissed { .. } => "deadline-missed",
        IncidentEvent::Note { .. } => "note",
        IncidentEvent::Closed { .. } => "closed",
    }
}

/// One instance's incident.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetIncident {
    pub instance_id: String,
    pub incident: Incident,
}

/// Application faults of one program across the fleet (`incidents list --fleet`): "task
/// definition X faulted on 9 instances last night" as one line, for its owner rather than
/// on-call for the GPUs (docs/attribution.md).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct AppFaultGroup {
    /// `family:revision`, else `task <id>`, else `executable <path>` (a process outside
    /// ECS: its executable's path, as the instances share it; the device and inode that tell
    /// programs apart on one instance are that instance's own).
    pub program: String,
    pub incidents: usize,
    pub instances: Vec<String>,
    /// Each signal (`xid 13`) and how many incidents it opened.
    pub signals: BTreeMap<String, usize>,
    pub first: crate::model::Timestamp,
    pub last: crate::model::Timestamp,
}

/// Groups the application faults of `incidents` (`Incident::application_fault`) by their
/// program, most incidents first; returns the groups and the other incidents.
pub fn group_application_faults(
    incidents: &[FleetIncident],
) -> (Vec<AppFaultGroup>, Vec<&FleetIncident>) {
    let mut groups: BTreeMap<String, AppFaultGroup> = BTreeMap::new();
    let mut rest = Vec::new();
    for f in incidents {
        let Some(c) = f.incident.application_fault() else {
            rest.push(f);
            continue;
        };
        let program = match (&c.definition, &c.task) {
            (Some(d), _) => d.clone(),
            (None, Some(t)) => format!("task {t}"),
            (None, None) => match c.exe.as_deref() {
                Some(e) => format!("executable {}", e.split_once(' ').map_or(e, |(_, p)| p)),
                None => format!("program {}", c.program),
            },
        };
        let at = f.incident.opened_at;
        let g = groups
            .entry(program.clone())
            .or_insert_with(|| AppFaultGroup {
                program,
                incidents: 0,
                instances: Vec::new(),
                signals: BTreeMap::new(),
                first: at,
                last: at,
            });
        g.incidents += 1;
        if !g.instances.contains(&f.instance_id) {
            g.instances.push(f.instance_id.clone());
        }
        *g.signals.entry(f.incident.signal.clone()).or_default() += 1;
        g.first = g.first.min(at);
        g.last = g.last.max(at);
    }
    let mut out: Vec<AppFaultGroup> = groups.into_values().collect();
    out.sort_by(|a, b| {
        b.incidents
            .cmp(&a.incidents)
            .then(a.program.cmp(&b.program))
    });
    (out, rest)
}

/// The answer: incidents oldest first, and how the reading went.
#[derive(Debug, Default)]
pub struct FleetView {
    pub incidents: Vec<FleetIncident>,
    pub scan: Scan,
    /// Events dropped as duplicates of one already read.
    pub duplicates: usize,
    /// Events that are not gpu-medic records (another writer in the group).
    pub foreign: usize,
}

/// Reads the incidents `q` asks for. With `since_ms`, incidents whose opening record is
/// before it are left out (their rows would be partial).
pub async fn read(logs: &Logs, q: &FleetQuery) -> Result<FleetView, CallError> {
    let mut calls = Calls::new();
    let query = Query {
        group: q.log_group.clone(),
        streams: q.instance.iter().cloned().collect(),
        pattern: Some(q.pattern()),
        start_ms: q.since_ms,
        max_events: MAX_EVENTS,
    };
    let mut seen: HashSet<String> = HashSet::new();
    let mut by: BTreeMap<(String, u64), BTreeMap<u64, Record>> = BTreeMap::new();
    let (mut foreign, mut duplicates) = (0, 0);
    let scan = logs
        .filter(&mut calls, &query, |found| {
            let Ok(s) = serde_json::from_str::<Shipped>(&found.message) else {
                foreign += 1;
                return;
            };
            if !q.wants(&s) {
                return;
            }
            if !seen.insert(s.record_id.clone()) {
                duplicates += 1;
                return;
            }
            let seq = s.seq();
            by.entry((s.instance_id, s.record.incident.0))
                .or_default()
                .insert(seq, s.record);
        })
        .await?;
    let mut view = FleetView {
        scan,
        duplicates,
        foreign,
        ..FleetView::default()
    };
    for ((instance_id, _), records) in by {
        let mut it = records.into_values();
        let Some(first) = it.next() else { continue };
        let opened = matches!(first.event, IncidentEvent::Opened { .. });
        if q.since_ms.is_some() && !opened {
            continue;
        }
        let mut inc = Incident::stub(&first);
        inc.push(first);
        for r in it {
            inc.push(r);
        }
        view.incidents.push(FleetIncident {
            instance_id,
            incident: inc,
        });
    }
    view.incidents.sort_by(|a, b| {
        (a.incident.opened_at, &a.instance_id).cmp(&(b.incident.opened_at, &b.instance_id))
    });
    Ok(view)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_select_on_the_record_fields() {
        let q = FleetQuery {
            incident: Some(7),
            ..FleetQuery::default()
        };
        assert_eq!(q.pattern(), "{ $.incident = 7 }");
        let list = FleetQuery::default().pattern();
        assert!(list.starts_with("{ ($.event = \"opened\") || "), "{list}");
        assert!(list.contains("($.event = \"closed\")"), "{list}");
    }
}
