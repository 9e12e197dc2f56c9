//! The fleet-incident gate (with `[fleet] table`). Of a drain (with a `fingerprint_threshold`
//! above 0):
//! before anything else a drain does, this instance's fingerprint (the incident's first
//! signal, the driver's version, the AMI, the instance type) is recorded in the group's fleet
//! document ([`patterns`], the item `<group>#fleet` of the slot table), by a conditional write.
//! When the fingerprint has reached the threshold within the window, the write that crosses
//! it opens ONE fleet incident (exactly one writer wins the conditional write), and that
//! writer pages once (EventBridge `GPU Medic Fleet Incident Opened`, with `[export] events`).
//! While the incident is not acknowledged (`gpu-medic fleet ack <id>`), a drain of that
//! fingerprint is deferred with the incident's words: its result enters the engine as the
//! order's outcome. Anything that keeps the gate from deciding (the table unreachable, a
//! document it cannot read) lets the drain go on to the budget, which says what is wrong:
//! the gate never holds a repair because of its own trouble.
//!
//! The same document and page serve the other fleet incidents ([`patterns`]): a poison task
//! ([`FleetGate::task`], after an application fault charged to a task definition: nothing is
//! held) and a bad image ([`FleetGate::image`], from the launch gate, when the launch-failure
//! breaker trips).

use std::time::Duration;

use aws_config::SdkConfig;
use aws_sdk_ecs::config::SharedHttpClient;

use super::patterns::{self, Doc, FleetIncident, Pattern};
use crate::aws::calls::Calls;
use crate::aws::dynamo::{SlotTable, TableError};
use crate::aws::events::{Event, Events};
use crate::aws::identity::Identity;
use crate::config::Config;
use crate::remedy::RemedyError;
use crate::sys::clock::SharedClock;

/// The EventBridge detail-type of the page.
pub const OPENED: &str = "GPU Medic Fleet Incident Opened";
/// Lost races in a row before one attempt gives up. Each lost race waits a full-jitter draw
/// before the re-read, as the slot table's do. A fingerprint's sighting that still lost
/// defers its drain (the next attempt sights again) rather than letting it go on unrecorded:
/// at N = 100, 32 instances of one fingerprint faulting within 10 s left 2 sightings
/// unrecorded after 8 lost races each, those 2 were replaced, and with a threshold of 32 the
/// incident never opened.
const MAX_CONFLICTS: u32 = 8;

/// What makes this instance's fingerprint besides the signal, read once per process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    pub driver: String,
    pub ami: String,
    pub instance_type: String,
}

pub struct FleetGate {
    table: SlotTable,
    cfg: Config,
    http: SharedHttpClient,
    clock: SharedClock,
    events: Option<Events>,
    facts: tokio::sync::OnceCell<NodeFacts>,
}

impl FleetGate {
    pub fn new(sdk: &SdkConfig, cfg: &Config, table: SlotTable, clock: SharedClock) -> Self {
        let events = (cfg.export.enabled && cfg.export.events)
            .then(|| Events::new(sdk, cfg.export.event_bus.clone()));
        FleetGate {
            table,
            cfg: cfg.clone(),
            http: sdk.http_client().unwrap_or_else(crate::aws::http_client),
            clock,
            events,
            facts: tokio::sync::OnceCell::new(),
        }
    }

    /// This instance's driver version, AMI and instance type (IMDS, each bounded to 2 s;
    /// what cannot be read is "unknown", and counts as one value).
    async fn facts(&self) -> &NodeFacts {
        self.facts
            .get_or_init(|| async {
                let imds = crate::aws::imds::imds_client(self.http.clone(), 1);
                let ask = |path: &'static str| {
                    let imds = imds.clone();
                    async move {
                        match tokio::time::timeout(
                            Duration::from_secs(2),
                            crate::aws::imds::get(&imds, path),
                        )
                        .await
                        {
                            Ok(Ok(Some(v))) => v.trim().to_string(),
                            _ => "unknown".to_string(),
                        }
                    }
                };
                let (ami, instance_type) = tokio::join!(
                    ask("/latest/meta-data/ami-id"),
                    ask(crate::aws::imds::INSTANCE_TYPE_PATH)
                );
                NodeFacts {
                    driver: driver_version(&self.cfg.fleet.driver_version_file),
                    ami,
                    instance_type,
                }
            })
            .await
    }

    /// Records this instance's fingerprint for `signal`. A deferral (made by `defer`) when an
    /// unacknowledged fleet incident of that fingerprint holds the drain (with the incident's
    /// id), or when the sighting lost every race for the fleet document this time (no id: the
    /// drain's next attempt sights again, so no sighting is lost to a busy document). None:
    /// the drain goes on (also when the document cannot be read or written at all, said in
    /// the log; the slot claim that follows needs the same table).
    pub async fn check(
        &self,
        id: &Identity,
        signal: &str,
        defer: impl Fn(String) -> RemedyError,
    ) -> Option<(Option<String>, RemedyError)> {
        let threshold = self.cfg.fleet.fingerprint_threshold;
        let group = id.auto_scaling_group.as_deref()?;
        if threshold == 0 {
            return None;
        }
        let f = self.facts().await;
        let p = Pattern::fingerprint(signal, &f.driver, &f.ami, &f.instance_type);
        let s = match self
            .judge(
                group,
                &id.instance_id,
                Some(&id.cluster),
                &p,
                Open::AtCount(threshold),
            )
            .await
        {
            Ok(s) => s,
            Err(Unjudged::Busy) => {
                return Some((
                    None,
                    defer(format!(
                        "fleet incidents: this instance's sighting of {} lost {MAX_CONFLICTS} races in a row for the fleet document of group {group}; the drain waits and sights again (staying quarantined)",
                        p.key
                    )),
                ));
            }
            Err(Unjudged::Failed) => return None,
        };
        s.held.map(|inc| (Some(inc.id.clone()), defer(held(&inc))))
    }

    /// A poison task: records that an application fault of this instance was charged to task
    /// definition `definition` (`family:revision`, as the ECS agent named the task the
    /// pid's cgroup is in); `task_threshold` instances within the window open ONE fleet
    /// incident naming it (paged once). It holds nothing. The incident when it is open.
    pub async fn task(&self, id: &Identity, definition: &str) -> Option<FleetIncident> {
        let threshold = self.cfg.fleet.task_threshold;
        let group = id.auto_scaling_group.as_deref()?;
        if threshold == 0 || definition.is_empty() {
            return None;
        }
        let p = Pattern::task(definition);
        let s = self
            .judge(
                group,
                &id.instance_id,
                Some(&id.cluster),
                &p,
                Open::AtCount(threshold),
            )
            .await
            .ok()?;
        s.opens.or(s.known)
    }

    /// A bad image: this new instance (`me`, of `group`) failed the launch gate. Recorded per
    /// AMI; when the launch-failure breaker `tripped` (with `limit` abandons), this opens ONE
    /// fleet incident for the AMI (paged once; not again while the document keeps it). The
    /// incident when it is open.
    pub async fn image(
        &self,
        group: &str,
        me: &str,
        cluster: Option<&str>,
        tripped: Option<u32>,
    ) -> Option<FleetIncident> {
        let f = self.facts().await;
        let p = Pattern::image(&f.ami);
        let open = match tripped {
            Some(limit) => Open::Now(limit),
            None => Open::AtCount(0),
        };
        let s = self.judge(group, me, cluster, &p, open).await.ok()?;
        s.opens.or(s.known)
    }

    /// Records `me`'s sighting of `p` in `group`'s fleet document (conditionally on the
    /// version read, again after a lost race), and pages when this write opened its
    /// incident. Unjudged when it could not be (said in the log).
    async fn judge(
        &self,
        group: &str,
        me: &str,
        cluster: Option<&str>,
        p: &Pattern,
        open: Open,
    ) -> Result<Judged, Unjudged> {
        let window = u64::try_from(self.cfg.fleet.pattern_window.as_millis()).unwrap_or(u64::MAX);
        for lost in 0..MAX_CONFLICTS {
            if lost > 0 {
                // Of the writers that read one version one wins; the others spread their
                // re-reads instead of meeting again at once.
                tokio::time::sleep(crate::sys::backoff::full_jitter(
                    super::slot_table::CONFLICT_BACKOFF,
                    lost - 1,
                    super::slot_table::CONFLICT_CAP,
                ))
                .await;
            }
            let mut calls = Calls::new();
            let read = match self.table.read_fleet(&mut calls, group).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(
                        instance_id = me,
                        "fleet incidents: cannot read the fleet document: {e}"
                    );
                    return Err(Unjudged::Failed);
                }
            };
            let doc: Doc = match serde_json::from_str(&read.doc) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(
                        instance_id = me,
                        "fleet incidents: the fleet document of group {group} is unreadable ({e}); not judged"
                    );
                    return Err(Unjudged::Failed);
                }
            };
            let now = self.clock.now_ms();
            let s = match open {
                Open::AtCount(t) => patterns::sight(&doc, p, me, now, window, t),
                Open::Now(limit) => patterns::trip(&doc, p, me, now, window, limit),
            };
            if let Some(next) = &s.write {
                let text = match serde_json::to_string(next) {
                    Ok(t) => t,
                    Err(e) => {
                        tracing::warn!("fleet incidents: cannot encode the fleet document: {e}");
                        return Err(Unjudged::Failed);
                    }
                };
                match self
                    .table
                    .write_fleet(&mut calls, group, &read, &text, me)
                    .await
                {
                    Ok(()) => {}
                    Err(TableError::Conflict) => continue,
                    Err(e) => {
                        tracing::warn!(
                            instance_id = me,
                            "fleet incidents: cannot write the fleet document: {e}"
                        );
                        return Err(Unjudged::Failed);
                    }
                }
            }
            if let Some(inc) = &s.opens {
                tracing::error!(instance_id = me, fleet_incident = %inc.id, "{}", inc.summary());
                self.page(cluster, group, inc).await;
            }
            let known = s
                .write
                .as_ref()
                .unwrap_or(&doc)
                .incidents
                .get(&p.id())
                .cloned();
            return Ok(Judged {
                opens: s.opens,
                held: s.held,
                known,
            });
        }
        tracing::warn!(
            instance_id = me,
            "fleet incidents: {MAX_CONFLICTS} writes in a row lost the race; not judged this time"
        );
        Err(Unjudged::Busy)
    }

    /// The page: one EventBridge event, sent by the instance whose write opened the incident.
    async fn page(&self, cluster: Option<&str>, group: &str, inc: &FleetIncident) {
        let Some(events) = &self.events else {
            tracing::warn!(fleet_incident = %inc.id, "fleet incident not paged: [export] events is off");
            return;
        };
        let detail = serde_json::json!({
            "fleet_incident": inc,
            "summary": inc.summary(),
            "cluster": cluster,
            "auto_scaling_group": group,
            "ack": format!("gpu-medic fleet ack {}", inc.id),
        });
        let event = Event {
            detail_type: OPENED,
            detail: detail.to_string(),
            time_ms: self.clock.now_ms(),
            resources: Vec::new(),
        };
        let mut calls = Calls::new();
        if let Err(e) = events.put(&mut calls, std::slice::from_ref(&event)).await {
            tracing::warn!(fleet_incident = %inc.id, "fleet incident not paged: {e}");
        }
    }
}

/// How a sighting may open its pattern's incident.
#[derive(Debug, Clone, Copy)]
enum Open {
    /// At this many instances within the window (0: never).
    AtCount(u32),
    /// Now (something else decided: the launch-failure breaker, at this many abandons).
    Now(u32),
}

/// Why a sighting was not judged.
enum Unjudged {
    /// Every write lost its race for the document (others are writing it): try again later.
    Busy,
    /// The document could not be read, decoded or written (said in the log).
    Failed,
}

/// What a judged sighting found.
struct Judged {
    /// The incident this write opened (and paged).
    opens: Option<FleetIncident>,
    /// The unacknowledged incident that holds a drain of the pattern.
    held: Option<FleetIncident>,
    /// The pattern's incident as the document now holds it.
    known: Option<FleetIncident>,
}

/// The deferral's words for a drain held by a fleet incident.
pub fn held(inc: &FleetIncident) -> String {
    format!(
        "held for an operator: {}; `gpu-medic fleet ack {}` lets the drains of this fingerprint go on (within the budget); staying quarantined",
        inc.summary(),
        inc.id
    )
}

/// The driver's version from the first line of `path` (`/proc/driver/nvidia/version`: "NVRM
/// version: NVIDIA UNIX x86_64 Kernel Module  570.172.08  ..."): its first token that is
/// digits and dots with at least one dot; the whole line when none is; "unknown" when the
/// file cannot be read.
pub fn driver_version(path: &std::path::Path) -> String {
    let Ok(text) = crate::sys::limits::read_text(path, 64 * 1024, "driver version") else {
        return "unknown".into();
    };
    let line = text.lines().next().unwrap_or("").trim();
    line.split_whitespace()
        .find(|t| t.contains('.') && t.chars().all(|c| c.is_ascii_digit() || c == '.'))
        .unwrap_or(line)
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_driver_version_is_read_from_the_drivers_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("version");
        std::fs::write(&p, "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.172.08  Tue Jul  8 18:21:20 UTC 2025\nGCC version: gcc 11\n").unwrap();
        assert_eq!(driver_version(&p), "570.172.08");
        std::fs::write(&p, "580.82\n").unwrap();
        assert_eq!(driver_version(&p), "580.82");
        assert_eq!(driver_version(&dir.path().join("none")), "unknown");
    }
}
