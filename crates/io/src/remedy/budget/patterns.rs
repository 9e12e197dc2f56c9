//! Fleet incidents: one pattern on many instances of a group is one incident, not many
//! remediations. The same fatal XID on the same driver version, AMI and instance type on M or
//! more instances within a window is probably the driver or the image, not M GPUs: ONE fleet
//! incident, opened by one conditional write, and further drains for that fingerprint wait
//! for an operator (`gpu-medic fleet ack <id>`) while other faults go on within the budget.
//!
//! Two more patterns open fleet incidents of the same shape (one document, one page, one
//! `fleet ack`):
//! - **a poison task**: application XIDs (13/31/43…, judged the program's own) charged to
//!   the same ECS task definition (gpu-medic's own attribution: the pid's cgroup names the
//!   task, the ECS agent its definition) on `task_threshold` instances within the window: ONE
//!   fleet incident naming the task definition. It holds nothing: no instance is drained for
//!   an application's fault anyway.
//! - **a bad image**: the launch-failure breaker tripping (new instances failing the launch
//!   gate) opens ONE fleet incident for the AMI of the instance that tripped it, naming the
//!   instances of that AMI that failed the gate within the window.
//!
//! This module is pure: the group's fleet document in, what to write and what it means out.
//! The document lives beside the group's slot item in the slot table (partition key
//! `<group>#fleet`, [`crate::aws::dynamo::FleetTable`]); every write is conditional on the
//! version read, so of two instances that see the threshold reached at once exactly one
//! opens the incident (and pages), the other finds it opened. Its result enters the engine
//! as an order's outcome (a drain deferred, naming the incident), never as a decision the
//! engine did not make (docs/fleet-scale.md, "Fleet incidents").

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Sightings kept per pattern at most (the oldest go first), and patterns kept at most: the
/// document stays far below DynamoDB's 400 KB item limit (about 60 bytes per sighting).
pub const MAX_SIGHTINGS: usize = 512;
pub const MAX_PATTERNS: usize = 64;
/// Fleet incidents kept at most (acknowledged ones older than the window go first).
pub const MAX_INCIDENTS: usize = 64;

/// What a pattern is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// The same fatal signal, driver version, AMI and instance type.
    Fingerprint,
    /// Application faults charged to one ECS task definition (`family:revision`).
    Task,
    /// New instances of one AMI failing the launch gate (the launch-failure breaker).
    Image,
}

impl Kind {
    fn prefix(self) -> &'static str {
        match self {
            Kind::Fingerprint => "fp",
            Kind::Task => "task",
            Kind::Image => "img",
        }
    }
}

/// One pattern: its kind and its key (for a fingerprint `xid 79 | 570.172.08 | ami-… | p5.48xlarge`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    pub kind: Kind,
    pub key: String,
}

impl Pattern {
    /// A fingerprint from its four parts.
    pub fn fingerprint(signal: &str, driver: &str, ami: &str, instance_type: &str) -> Pattern {
        Pattern {
            kind: Kind::Fingerprint,
            key: format!("{signal} | {driver} | {ami} | {instance_type}"),
        }
    }

    /// A poison task: the task definition (`family:revision`) application faults were
    /// charged to.
    pub fn task(definition: &str) -> Pattern {
        Pattern {
            kind: Kind::Task,
            key: definition.to_string(),
        }
    }

    /// A bad image: the AMI of instances failing the launch gate.
    pub fn image(ami: &str) -> Pattern {
        Pattern {
            kind: Kind::Image,
            key: ami.to_string(),
        }
    }

    /// The fleet incident's id: the kind's prefix and eight hex digits of the key's FNV-1a
    /// hash (stable across versions and machines: it is what an operator types).
    pub fn id(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.key.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        format!("{}-{:08x}", self.kind.prefix(), h & 0xffff_ffff)
    }

    fn slot(&self) -> String {
        format!("{}:{}", self.kind.prefix(), self.key)
    }
}

/// An operator's acknowledgement.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack {
    pub by: String,
    pub at_ms: u64,
}

/// One fleet incident.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetIncident {
    pub id: String,
    pub kind: Kind,
    pub key: String,
    pub opened_ms: u64,
    /// The instance whose write opened it (and paged).
    pub opened_by: String,
    /// The instances seen with the pattern when it opened, and since (at most
    /// [`MAX_SIGHTINGS`]).
    pub instances: Vec<String>,
    /// The threshold it reached.
    pub threshold: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acked: Option<Ack>,
}

impl FleetIncident {
    /// What it says, for the deferral, `fleet status` and the page.
    pub fn summary(&self) -> String {
        let n = self.instances.len();
        let who = self
            .instances
            .iter()
            .take(8)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ");
        match self.kind {
            Kind::Fingerprint => format!(
                "fleet incident {}: {} on {n} instances within the window ({who}): probably the driver or image, not {n} GPUs",
                self.id, self.key,
            ),
            Kind::Task => format!(
                "fleet incident {}: task definition {} faulted (application XIDs) on {n} instances within the window ({who}): a poison task, the application's fault, not {n} GPUs; no instance is drained for it; page the task definition's owner",
                self.id, self.key,
            ),
            Kind::Image => format!(
                "fleet incident {}: new instances from {} failed the launch gate ({n} within the window: {who}) and the launch-failure breaker tripped: probably the image; unhealthy launches are kept quarantined, not abandoned, so no replacement follows (clear the group's gpu-medic/abandoned-launches tag to re-arm)",
                self.id, self.key,
            ),
        }
    }

    /// Whether it holds the drains of its pattern while not acknowledged (a fingerprint's
    /// only: a poison task drains nothing, a bad image's launches are held by the breaker).
    pub fn holds_drains(&self) -> bool {
        self.kind == Kind::Fingerprint
    }
}

/// The group's fleet document.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Doc {
    /// Per pattern (`fp:<key>`): instance → when it was last seen with it (ms).
    #[serde(default)]
    pub sightings: BTreeMap<String, BTreeMap<String, u64>>,
    /// By id.
    #[serde(default)]
    pub incidents: BTreeMap<String, FleetIncident>,
}

/// What a sighting means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sighting {
    /// The document to write (conditionally), when it changed.
    pub write: Option<Doc>,
    /// The fleet incident this write opens (the writer pages once it succeeded).
    pub opens: Option<FleetIncident>,
    /// The unacknowledged fleet incident of the pattern: the step waits for an operator.
    pub held: Option<FleetIncident>,
}

/// `me` sees `p` at `now_ms`: the sighting is recorded (older than `window_ms` forgotten);
/// with `threshold` or more instances within the window and no incident for `p` yet, this
/// write opens it. A pattern with an unacknowledged incident holds the step; an acknowledged
/// one lets it go (within the budget).
pub fn sight(
    doc: &Doc,
    p: &Pattern,
    me: &str,
    now_ms: u64,
    window_ms: u64,
    threshold: u32,
) -> Sighting {
    record(doc, p, me, now_ms, window_ms, threshold, false)
}

/// `me` sees `p` at `now_ms` and something else already decided that it is a fleet incident
/// (the launch-failure breaker tripped, with `limit` abandons): the sighting is recorded and,
/// when `p` has no incident yet, this write opens it, whatever the count. Once opened it is
/// not opened again (an acknowledged one neither) while the document keeps it.
pub fn trip(doc: &Doc, p: &Pattern, me: &str, now_ms: u64, window_ms: u64, limit: u32) -> Sighting {
    record(doc, p, me, now_ms, window_ms, limit, true)
}

fn record(
    doc: &Doc,
    p: &Pattern,
    me: &str,
    now_ms: u64,
    window_ms: u64,
    threshold: u32,
    force: bool,
) -> Sighting {
    let mut next = doc.clone();
    let cutoff = now_ms.saturating_sub(window_ms);
    for seen in next.sightings.values_mut() {
        seen.retain(|_, at| *at >= cutoff);
    }
    next.sightings.retain(|_, seen| !seen.is_empty());
    let slot = p.slot();
    let seen = next.sightings.entry(slot).or_default();
    seen.insert(me.to_string(), now_ms);
    while seen.len() > MAX_SIGHTINGS {
        let oldest = seen
            .iter()
            .min_by_key(|(_, at)| **at)
            .map(|(i, _)| i.clone());
        if let Some(o) = oldest {
            seen.remove(&o);
        }
    }
    let count = seen.len();
    let instances: Vec<String> = seen.keys().cloned().collect();
    let id = p.id();
    let mut opens = None;
    match next.incidents.get_mut(&id) {
        Some(inc)
            if !inc.instances.iter().any(|i| i == me) && inc.instances.len() < MAX_SIGHTINGS =>
        {
            inc.instances.push(me.to_string());
        }
        Some(_) => {}
        None if force || (threshold > 0 && count >= threshold as usize) => {
            let inc = FleetIncident {
                id: id.clone(),
                kind: p.kind,
                key: p.key.clone(),
                opened_ms: now_ms,
                opened_by: me.to_string(),
                instances,
                threshold,
                acked: None,
            };
            next.incidents.insert(id.clone(), inc.clone());
            opens = Some(inc);
        }
        None => {}
    }
    bound(&mut next, cutoff);
    let held = next
        .incidents
        .get(&id)
        .filter(|i| i.acked.is_none() && i.holds_drains())
        .cloned();
    // A sighting already recorded (same instance, within the window) writes nothing new
    // but its time: only a changed membership or incident is worth a write.
    let changed = opens.is_some() || !same_membership(doc, &next);
    Sighting {
        write: changed.then_some(next),
        opens,
        held,
    }
}

/// Whether two documents hold the same instances per pattern and the same incidents (times
/// aside).
fn same_membership(a: &Doc, b: &Doc) -> bool {
    a.incidents == b.incidents
        && a.sightings.len() == b.sightings.len()
        && a.sightings
            .iter()
            .zip(&b.sightings)
            .all(|((ka, va), (kb, vb))| ka == kb && va.keys().eq(vb.keys()))
}

/// Keeps the document within its bounds: the patterns seen last, the incidents that are
/// open or recent.
fn bound(doc: &mut Doc, cutoff: u64) {
    while doc.sightings.len() > MAX_PATTERNS {
        let oldest = doc
            .sightings
            .iter()
            .min_by_key(|(_, s)| s.values().max().copied().unwrap_or(0))
            .map(|(k, _)| k.clone());
        if let Some(k) = oldest {
            doc.sightings.remove(&k);
        }
    }
    while doc.incidents.len() > MAX_INCIDENTS {
        let oldest = doc
            .incidents
            .values()
            .filter(|i| i.acked.is_some() && i.opened_ms < cutoff)
            .min_by_key(|i| i.opened_ms)
            .or_else(|| doc.incidents.values().min_by_key(|i| i.opened_ms))
            .map(|i| i.id.clone());
        if let Some(id) = oldest {
            doc.incidents.remove(&id);
        }
    }
}

/// The document with incident `id` acknowledged by `by` at `now_ms`; None when there is no
/// such incident or it was acknowledged already (nothing to write).
pub fn ack(doc: &Doc, id: &str, by: &str, now_ms: u64) -> Option<Doc> {
    let mut next = doc.clone();
    let inc = next.incidents.get_mut(id)?;
    if inc.acked.is_some() {
        return None;
    }
    inc.acked = Some(Ack {
        by: by.to_string(),
        at_ms: now_ms,
    });
    Some(next)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: u64 = 3_600_000;

    fn fp() -> Pattern {
        Pattern::fingerprint("xid 79", "570.172.08", "ami-1", "p5.48xlarge")
    }

    /// Sightings accumulate; the M-th opens ONE incident, once; later sightings are held by
    /// it and join it; an acknowledgement lets them go.
    #[test]
    fn the_mth_sighting_opens_one_incident_and_holds_until_acknowledged() {
        let mut doc = Doc::default();
        for i in 0..2 {
            let s = sight(&doc, &fp(), &format!("i-{i}"), 1000 + i, H, 3);
            assert!(s.opens.is_none() && s.held.is_none(), "{s:?}");
            doc = s.write.unwrap();
        }
        let third = sight(&doc, &fp(), "i-2", 1002, H, 3);
        let inc = third.opens.clone().unwrap();
        assert_eq!(inc.id, fp().id());
        assert_eq!((inc.instances.len(), inc.opened_by.as_str()), (3, "i-2"));
        assert_eq!(third.held.as_ref(), Some(&inc), "the opener waits too");
        assert!(
            inc.summary()
                .contains("probably the driver or image, not 3 GPUs")
        );
        // A racing writer that read the document before the third write opens it as well:
        // the conditional write lets exactly one of them in; whoever reads after finds it.
        doc = third.write.unwrap();
        let fourth = sight(&doc, &fp(), "i-3", 1003, H, 3);
        assert!(fourth.opens.is_none());
        assert!(fourth.held.is_some());
        doc = fourth.write.unwrap();
        assert_eq!(doc.incidents[&fp().id()].instances.len(), 4);
        // The same instance again: held, nothing new to write.
        assert!(sight(&doc, &fp(), "i-3", 1004, H, 3).write.is_none());
        // Another fingerprint is not held.
        let other = Pattern::fingerprint("xid 79", "580.82", "ami-1", "p5.48xlarge");
        let s = sight(&doc, &other, "i-9", 1005, H, 3);
        assert!(s.held.is_none() && s.opens.is_none());
        // Acknowledged: held no more, never opened again.
        let acked = ack(&doc, &fp().id(), "operator", 2000).unwrap();
        assert!(ack(&acked, &fp().id(), "operator", 2001).is_none());
        assert!(ack(&acked, "fp-nope", "operator", 2001).is_none());
        let s = sight(&acked, &fp(), "i-5", 2002, H, 3);
        assert!(s.held.is_none() && s.opens.is_none(), "{s:?}");
    }

    #[test]
    fn sightings_older_than_the_window_do_not_count_and_zero_turns_it_off() {
        let mut doc = Doc::default();
        doc = sight(&doc, &fp(), "i-0", 0, H, 2).write.unwrap();
        let late = sight(&doc, &fp(), "i-1", 2 * H, H, 2);
        assert!(late.opens.is_none(), "the first sighting aged out");
        assert_eq!(
            late.write.unwrap().sightings.values().next().unwrap().len(),
            1
        );
        let mut doc = Doc::default();
        for i in 0..10 {
            doc = sight(&doc, &fp(), &format!("i-{i}"), i, H, 0)
                .write
                .unwrap();
        }
        assert!(doc.incidents.is_empty(), "threshold 0: off");
    }

    /// A poison task: the same task definition's application faults on 3 instances open ONE
    /// incident naming it; the same instance faulting again and again is one instance; it
    /// holds nothing; another revision is another task definition.
    #[test]
    fn a_task_definition_faulting_on_three_instances_is_one_incident_that_holds_nothing() {
        let poison = Pattern::task("trainer:7");
        let mut doc = Doc::default();
        for t in 0..5 {
            let s = sight(&doc, &poison, "i-0", 1000 + t, H, 3);
            assert!(s.opens.is_none(), "one instance, however often: {s:?}");
            if let Some(w) = s.write {
                doc = w;
            }
        }
        doc = sight(&doc, &poison, "i-1", 1010, H, 3).write.unwrap();
        // The fingerprint and the task are apart, even with the same key text.
        let fp = sight(
            &doc,
            &Pattern::fingerprint("trainer:7", "", "", ""),
            "i-2",
            1011,
            H,
            3,
        );
        assert!(fp.opens.is_none());
        let other = sight(&doc, &Pattern::task("trainer:8"), "i-2", 1012, H, 3);
        assert!(other.opens.is_none(), "another revision: {other:?}");
        let third = sight(&doc, &poison, "i-2", 1013, H, 3);
        let inc = third.opens.clone().expect("the third instance opens it");
        assert_eq!(inc.kind, Kind::Task);
        assert!(
            inc.id.starts_with("task-") && inc.id.len() == 13,
            "{}",
            inc.id
        );
        assert_eq!(inc.instances, vec!["i-0", "i-1", "i-2"]);
        assert!(third.held.is_none(), "a poison task holds no drain");
        let words = inc.summary();
        assert!(
            words.contains("task definition trainer:7") && words.contains("no instance is drained"),
            "{words}"
        );
        doc = third.write.unwrap();
        let fourth = sight(&doc, &poison, "i-3", 1014, H, 3);
        assert!(fourth.opens.is_none() && fourth.held.is_none());
        doc = fourth.write.unwrap();
        assert_eq!(doc.incidents.len(), 1);
        assert_eq!(doc.incidents[&inc.id].instances.len(), 4);
        // Acknowledged like any fleet incident; never opened again.
        let acked = ack(&doc, &inc.id, "owner", 2000).unwrap();
        assert!(sight(&acked, &poison, "i-9", 2001, H, 3).opens.is_none());
        // Three instances spread wider than the window: no incident.
        let mut doc = Doc::default();
        for i in 0..3u64 {
            if let Some(w) = sight(&doc, &poison, &format!("i-{i}"), i * H, H / 2, 3).write {
                doc = w;
            }
        }
        assert!(doc.incidents.is_empty(), "{doc:?}");
    }

    /// A bad image: failing launches are recorded per AMI without opening anything; the
    /// breaker's trip opens ONE incident for the AMI, naming them; a second trip (another
    /// instance, another gate run) does not open another.
    #[test]
    fn the_launch_breaker_opens_one_incident_for_the_ami() {
        let bad = Pattern::image("ami-0bad");
        let mut doc = Doc::default();
        for i in 0..3 {
            let s = sight(&doc, &bad, &format!("i-{i}"), 1000 + i, H, 0);
            assert!(s.opens.is_none() && s.held.is_none());
            doc = s.write.unwrap();
        }
        let t = trip(&doc, &bad, "i-3", 1003, H, 3);
        let inc = t.opens.clone().expect("the trip opens it");
        assert_eq!((inc.kind, inc.threshold), (Kind::Image, 3));
        assert!(inc.id.starts_with("img-"), "not an AMI id: {}", inc.id);
        assert_eq!(inc.instances.len(), 4);
        assert!(
            t.held.is_none(),
            "the breaker holds launches, not the incident"
        );
        assert!(
            inc.summary().contains("new instances from ami-0bad"),
            "{}",
            inc.summary()
        );
        doc = t.write.unwrap();
        let again = trip(&doc, &bad, "i-4", 1004, H, 3);
        assert!(again.opens.is_none(), "once");
        doc = again.write.unwrap();
        assert_eq!(doc.incidents.len(), 1);
        assert_eq!(doc.incidents[&inc.id].instances.len(), 5);
        // A trip with another instance's AMI is that AMI's own incident.
        let other = trip(&doc, &Pattern::image("ami-0other"), "i-5", 1005, H, 3);
        assert!(other.opens.is_some());
    }

    #[test]
    fn the_document_stays_bounded() {
        let mut doc = Doc::default();
        for p in 0..(MAX_PATTERNS as u64 + 10) {
            let pat = Pattern::fingerprint(&format!("xid {p}"), "d", "a", "t");
            for i in 0..3 {
                if let Some(w) = sight(&doc, &pat, &format!("i-{i}"), p * 10 + i, H, 2).write {
                    doc = w;
                }
            }
        }
        assert!(doc.sightings.len() <= MAX_PATTERNS);
        assert!(doc.incidents.len() <= MAX_INCIDENTS);
        let json = serde_json::to_string(&doc).unwrap();
        assert!(json.len() < 200 * 1024, "{} bytes", json.len());
        assert_eq!(fp().id(), fp().id(), "ids are stable");
        assert!(fp().id().starts_with("fp-") && fp().id().len() == 11);
    }
}
