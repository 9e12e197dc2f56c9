//! The fleet budget on a DynamoDB table (`[fleet] table`): the slot protocol's decisions, as a
//! pure function of one consistent read of the group's item.
//!
//! A faithful transcription of models/README.md, "Slot protocol: implementation contract",
//! which `models/fleet/slots.pml` checks with spin: reserve -> commit -> only then act; every
//! write a compare-and-set on the version read (the adapter, `crate::aws::dynamo`, makes each
//! write conditional); a committed entry never expires on a timer; a reservation is taken over
//! only when this gpu-medic's own monotonic clock has seen the same token for
//! `reservation_lifetime` (never another machine's clock, never `since`); an entry whose
//! instance is terminated (a fact that never reverts) is removed by anyone. The rules are
//! tried in the contract's order, 1 to 5.
//!
//! No I/O, no clock: the caller hands in the item, the terminated instances, what it has seen
//! and `now`; it writes what [`decide`] says and, after a successful write, decides again from
//! the item it wrote.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use crate::aws::dynamo::{Holder, HolderState, SlotItem};

/// This instance's own state, as the contract names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// In service and faulted, or draining: wants a drain (or a replacement), or holds it.
    Wants,
    /// Back in service (restored, the remediation aborted).
    Done,
}

/// What a write of ours is for (the journal and the logs say it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteKind {
    /// Rule 1: the holder's instance is terminated.
    RemoveTerminated(String),
    /// Rule 2 or 3: our entry leaves (remediation over, or a reservation no longer needed).
    Release,
    /// Rule 3: our reservation becomes committed; the drain may start once this write succeeded.
    Commit,
    /// Rule 4: a free slot.
    Reserve,
    /// Rule 4: the budget is full and a reservation has not changed for its lifetime.
    TakeOver(String),
}

/// What to do next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Write `item` (conditional on the version read); on success decide again from it.
    Write { kind: WriteKind, item: SlotItem },
    /// Rule 2: we hold a committed entry and want to act: start the drain (no write).
    Act { token: u64 },
    /// Rule 4: the budget is full; try again after `retry_after`.
    Defer(String),
    /// Rule 5 (or holding while remediating): nothing to write.
    Nothing,
}

/// What goes into an entry we write: for people and `gpu-medic status` only.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stamp {
    pub incident: Option<String>,
    /// Our wall clock, RFC 3339. Nobody ever compares it.
    pub since: String,
}

/// The reservations this gpu-medic has seen, with the token each had and since when (its own
/// monotonic clock) it has seen that token in every read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    reserved: BTreeMap<String, (u64, Instant)>,
}

impl Seen {
    /// Takes in one read (or a write of ours): a reservation with a new token starts over; one
    /// that is gone, or committed, is forgotten.
    pub fn observe(&mut self, item: &SlotItem, now: Instant) {
        self.reserved.retain(|id, (token, _)| {
            item.holders
                .get(id)
                .is_some_and(|h| h.state == HolderState::Reserved && h.token == *token)
        });
        for (id, h) in &item.holders {
            if h.state == HolderState::Reserved {
                self.reserved.entry(id.clone()).or_insert((h.token, now));
            }
        }
    }

    /// How long `id`'s reservation with `token` has been seen unchanged.
    pub fn unchanged_for(&self, id: &str, token: u64, now: Instant) -> Option<Duration> {
        self.reserved
            .get(id)
            .filter(|(t, _)| *t == token)
            .map(|(_, since)| now.saturating_duration_since(*since))
    }
}

/// The facts [`decide`] works from, besides the item.
#[derive(Debug, Clone, Copy)]
pub struct Facts<'a> {
    /// This instance's id.
    pub me: &'a str,
    pub phase: Phase,
    /// The writer's own budget (a share of desired capacity, less the instances in
    /// remediation that hold no entry), at least 0.
    pub budget: u32,
    /// Holders known to be terminated (EC2 `terminated` or unknown, Auto Scaling `Terminated`).
    pub terminated: &'a BTreeSet<String>,
    pub seen: &'a Seen,
    pub now: Instant,
    pub reservation_lifetime: Duration,
    pub stamp: &'a Stamp,
}

/// The item after a write of ours: the next version, with `holders` as given.
/// Only after [`decide`] checked that the version can advance (below `MAX_VERSION`).
fn next(item: &SlotItem, holders: BTreeMap<String, Holder>, f: &Facts<'_>) -> SlotItem {
    SlotItem {
        version: item.version + 1,
        exists: true,
        holders,
        budget: Some(f.budget),
        updated_by: Some(f.me.to_string()),
        members: item.members,
    }
}

/// Our entry with `state`, carrying the token of the write that puts it there.
fn mine(item: &SlotItem, state: HolderState, f: &Facts<'_>) -> Holder {
    Holder {
        state,
        token: item.version + 1,
        incident: f.stamp.incident.clone(),
        since: f.stamp.since.clone(),
    }
}

/// Rule 1 alone: the first holder other than `me` whose instance is terminated, removed.
/// Every gpu-medic of the group runs it with each read, whatever its own phase.
pub fn remove_terminated(
    item: &SlotItem,
    me: &str,
    terminated: &BTreeSet<String>,
) -> Option<(String, BTreeMap<String, Holder>)> {
    let gone = item
        .holders
        .keys()
        .find(|h| h.as_str() != me && terminated.contains(h.as_str()))?
        .clone();
    let mut holders = item.holders.clone();
    holders.remove(&gone);
    Some((gone, holders))
}

/// The contract's rules 1 to 5, in that order, on one consistent read.
pub fn decide(item: &SlotItem, f: &Facts<'_>) -> Decision {
    // A write's token is the version after this one: one that cannot advance fences nothing,
    // so nothing is written (`dynamo::parse_item` already refuses such an item).
    if item.version >= crate::aws::dynamo::MAX_VERSION {
        return Decision::Defer(format!(
            "the slot table's version {} cannot advance",
            item.version
        ));
    }
    // 1. Remove a terminated holder.
    if let Some((gone, holders)) = remove_terminated(item, f.me, f.terminated) {
        return Decision::Write {
            kind: WriteKind::RemoveTerminated(gone),
            item: next(item, holders, f),
        };
    }
    let without_me = || {
        let mut h = item.holders.clone();
        h.remove(f.me);
        h
    };
    match item.holders.get(f.me) {
        // 2. My committed entry.
        Some(h) if h.state == HolderState::Committed => match f.phase {
            Phase::Wants => Decision::Act { token: h.token },
            Phase::Done => Decision::Write {
                kind: WriteKind::Release,
                item: next(item, without_me(), f),
            },
        },
        // 3. My reserved entry.
        Some(_) => match f.phase {
            Phase::Wants => {
                let mut holders = item.holders.clone();
                holders.insert(f.me.to_string(), mine(item, HolderState::Committed, f));
                Decision::Write {
                    kind: WriteKind::Commit,
                    item: next(item, holders, f),
                }
            }
            Phase::Done => Decision::Write {
                kind: WriteKind::Release,
                item: next(item, without_me(), f),
            },
        },
        // 4. No entry of mine, and I want one.
        None if f.phase == Phase::Wants => {
            let mut holders = item.holders.clone();
            if (holders.len() as u64) < u64::from(f.budget) {
                holders.insert(f.me.to_string(), mine(item, HolderState::Reserved, f));
                return Decision::Write {
                    kind: WriteKind::Reserve,
                    item: next(item, holders, f),
                };
            }
            let stale = item.holders.iter().find(|(id, h)| {
                h.state == HolderState::Reserved
                    && f.seen
                        .unchanged_for(id, h.token, f.now)
                        .is_some_and(|d| d >= f.reservation_lifetime)
            });
            if let Some((id, _)) = stale {
                let id = id.clone();
                holders.remove(&id);
                holders.insert(f.me.to_string(), mine(item, HolderState::Reserved, f));
                return Decision::Write {
                    kind: WriteKind::TakeOver(id),
                    item: next(item, holders, f),
                };
            }
            Decision::Defer(full(item, f.budget))
        }
        // 5. Otherwise nothing.
        None => Decision::Nothing,
    }
}

/// "fleet budget full: ..." with every holder, for the incident.
pub(crate) fn full(item: &SlotItem, budget: u32) -> String {
    let held: Vec<String> = item
        .holders
        .iter()
        .map(|(id, h)| format!("{id} {} (token {})", h.state.as_str(), h.token))
        .collect();
    format!(
        "fleet budget full: {} slot(s) of {budget} held in the slot table ({}); staying quarantined",
        item.holders.len(),
        if held.is_empty() {
            "none: instances in remediation outside the table fill it".to_string()
        } else {
            held.join(", ")
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(state: HolderState, token: u64) -> Holder {
        Holder {
            state,
            token,
            incident: None,
            since: "t".into(),
        }
    }

    fn item(version: u64, holders: &[(&str, HolderState, u64)]) -> SlotItem {
        SlotItem {
            version,
            exists: version > 0,
            holders: holders
                .iter()
                .map(|(id, s, t)| (id.to_string(), holder(*s, *t)))
                .collect(),
            budget: None,
            updated_by: None,
            members: None,
        }
    }

    use HolderState::{Committed as C, Reserved as R};

    struct World {
        terminated: BTreeSet<String>,
        seen: Seen,
        t0: Instant,
        stamp: Stamp,
    }

    impl World {
        fn new() -> Self {
            World {
                terminated: BTreeSet::new(),
                seen: Seen::default(),
                t0: Instant::now(),
                stamp: Stamp {
                    incident: Some("3".into()),
                    since: "2026-11-30T00:00:00Z".into(),
                },
            }
        }

        fn facts<'a>(&'a self, me: &'a str, phase: Phase, budget: u32, at: u64) -> Facts<'a> {
            Facts {
                me,
                phase,
                budget,
                terminated: &self.terminated,
                seen: &self.seen,
                now: self.t0 + Duration::from_secs(at),
                reservation_lifetime: Duration::from_secs(30),
                stamp: &self.stamp,
            }
        }
    }

    fn written(d: Decision) -> (WriteKind, SlotItem) {
        match d {
            Decision::Write { kind, item } => (kind, item),
            other => panic!("expected a write, got {other:?}"),
        }
    }

    #[test]
    fn rule_1_removes_a_terminated_holder_first_whatever_its_state() {
        let mut w = World::new();
        w.terminated.insert("i-b".into());
        for state in [R, C] {
            let it = item(5, &[("i-a", C, 4), ("i-b", state, 5)]);
            // Even before acting on our own committed entry.
            let (kind, new) = written(decide(&it, &w.facts("i-a", Phase::Wants, 2, 0)));
            assert_eq!(kind, WriteKind::RemoveTerminated("i-b".into()));
            assert_eq!(new.version, 6);
            assert!(new.holders.contains_key("i-a") && !new.holders.contains_key("i-b"));
        }
        // Never ourselves, and not a holder that is merely absent from some list.
        w.terminated.insert("i-a".into());
        let it = item(5, &[("i-a", C, 4)]);
        assert_eq!(
            decide(&it, &w.facts("i-a", Phase::Wants, 1, 0)),
            Decision::Act { token: 4 }
        );
        // Any phase runs it, including one with no interest in a slot.
        let it = item(5, &[("i-b", C, 4)]);
        let (kind, _) = written(decide(&it, &w.facts("i-c", Phase::Done, 1, 0)));
        assert_eq!(kind, WriteKind::RemoveTerminated("i-b".into()));
    }

    #[test]
    fn rule_2_a_committed_entry_acts_or_is_released() {
        let w = World::new();
        let it = item(7, &[("i-a", C, 6), ("i-b", R, 7)]);
        assert_eq!(
            decide(&it, &w.facts("i-a", Phase::Wants, 1, 0)),
            Decision::Act { token: 6 },
            "a restart between commit and drain acts without a write (and with budget 1)"
        );
        let (kind, new) = written(decide(&it, &w.facts("i-a", Phase::Done, 2, 0)));
        assert_eq!(kind, WriteKind::Release);
        assert_eq!(new.version, 8);
        assert_eq!(new.holders.keys().collect::<Vec<_>>(), ["i-b"]);
    }

    #[test]
    fn rule_3_a_reservation_commits_with_the_new_token_or_is_removed() {
        let w = World::new();
        let it = item(9, &[("i-a", R, 9)]);
        let (kind, new) = written(decide(&it, &w.facts("i-a", Phase::Wants, 1, 0)));
        assert_eq!(kind, WriteKind::Commit);
        assert_eq!(new.version, 10);
        assert_eq!(new.holders["i-a"].state, C);
        assert_eq!(
            new.holders["i-a"].token, 10,
            "the token is the version written"
        );
        assert_eq!(new.holders["i-a"].incident.as_deref(), Some("3"));
        // Only once the commit is written may we act: deciding from the written item.
        assert_eq!(
            decide(&new, &w.facts("i-a", Phase::Wants, 1, 0)),
            Decision::Act { token: 10 }
        );
        // Even when the budget shrank meanwhile: the reservation was within the budget.
        let (kind, _) = written(decide(&it, &w.facts("i-a", Phase::Wants, 0, 0)));
        assert_eq!(kind, WriteKind::Commit);
        let (kind, new) = written(decide(&it, &w.facts("i-a", Phase::Done, 1, 0)));
        assert_eq!(kind, WriteKind::Release);
        assert!(new.holders.is_empty());
    }

    #[test]
    fn rule_4_reserves_within_the_budget_only() {
        let w = World::new();
        let empty = SlotItem::default();
        let (kind, new) = written(decide(&empty, &w.facts("i-a", Phase::Wants, 1, 0)));
        assert_eq!(kind, WriteKind::Reserve);
        assert_eq!((new.version, new.exists), (1, true));
        assert_eq!(new.holders["i-a"], {
            let mut h = holder(R, 1);
            h.incident = Some("3".into());
            h.since = w.stamp.since.clone();
            h
        });
        assert_eq!(new.budget, Some(1));
        assert_eq!(new.updated_by.as_deref(), Some("i-a"));
        let it = item(3, &[("i-b", C, 2)]);
        let (kind, new) = written(decide(&it, &w.facts("i-a", Phase::Wants, 2, 0)));
        assert_eq!(kind, WriteKind::Reserve);
        assert_eq!(new.holders.len(), 2);
        let Decision::Defer(why) = decide(&it, &w.facts("i-a", Phase::Wants, 1, 0)) else {
            panic!("full")
        };
        assert!(why.contains("i-b committed (token 2)"), "{why}");
        // A budget reduced to nothing by instances in remediation outside the table.
        assert!(matches!(
            decide(&empty, &w.facts("i-a", Phase::Wants, 0, 0)),
            Decision::Defer(_)
        ));
        // Entries above a budget that shrank stay; nobody joins.
        let it = item(3, &[("i-b", C, 2), ("i-c", C, 3)]);
        assert!(matches!(
            decide(&it, &w.facts("i-a", Phase::Wants, 1, 0)),
            Decision::Defer(_)
        ));
    }

    #[test]
    fn rule_4_takes_over_a_reservation_seen_unchanged_for_its_lifetime_by_our_own_clock() {
        let mut w = World::new();
        let it = item(4, &[("i-b", R, 4)]);
        w.seen.observe(&it, w.t0);
        assert!(matches!(
            decide(&it, &w.facts("i-a", Phase::Wants, 1, 29)),
            Decision::Defer(_)
        ));
        let (kind, new) = written(decide(&it, &w.facts("i-a", Phase::Wants, 1, 30)));
        assert_eq!(kind, WriteKind::TakeOver("i-b".into()));
        assert_eq!(new.holders.keys().collect::<Vec<_>>(), ["i-a"]);
        assert_eq!(new.holders["i-a"].state, R);
        // Never seen before by us: the lifetime starts now, whatever `since` says.
        let fresh = World::new();
        assert!(matches!(
            decide(&it, &fresh.facts("i-a", Phase::Wants, 1, 3600)),
            Decision::Defer(_)
        ));
        // A new token (the holder wrote again) starts the lifetime over.
        let mut w2 = World::new();
        w2.seen.observe(&it, w2.t0);
        let again = item(6, &[("i-b", R, 6)]);
        w2.seen.observe(&again, w2.t0 + Duration::from_secs(20));
        assert!(matches!(
            decide(&again, &w2.facts("i-a", Phase::Wants, 1, 45)),
            Decision::Defer(_)
        ));
        assert!(matches!(
            decide(&again, &w2.facts("i-a", Phase::Wants, 1, 50)),
            Decision::Write { .. }
        ));
    }

    #[test]
    fn a_committed_entry_is_never_taken_over_however_long_it_is_held() {
        // The model's MUTANT_LEASE: a committed holder that expires like a reservation lets
        // two instances act at once.
        let mut w = World::new();
        let it = item(4, &[("i-b", C, 4)]);
        w.seen.observe(&it, w.t0);
        for at in [0, 30, 3600, 86_400 * 365] {
            assert!(matches!(
                decide(&it, &w.facts("i-a", Phase::Wants, 1, at)),
                Decision::Defer(_)
            ));
        }
        assert_eq!(w.seen, Seen::default(), "committed entries are not tracked");
    }

    #[test]
    fn every_write_moves_the_version_by_one_from_the_version_read() {
        // The adapter makes each write conditional on `read.version`; here: each decision's
        // item is exactly the next version (MUTANT_BLIND_COMMIT writes without that).
        let mut w = World::new();
        w.terminated.insert("i-z".into());
        let cases = [
            (item(0, &[]), "i-a", Phase::Wants),
            (item(3, &[("i-z", C, 3)]), "i-a", Phase::Wants),
            (item(3, &[("i-a", R, 3)]), "i-a", Phase::Wants),
            (item(3, &[("i-a", C, 3)]), "i-a", Phase::Done),
            (item(3, &[("i-a", R, 3)]), "i-a", Phase::Done),
        ];
        for (it, me, phase) in cases {
            let (_, new) = written(decide(&it, &w.facts(me, phase, 1, 0)));
            assert_eq!(new.version, it.version + 1, "{it:?}");
            assert!(new.exists);
        }
        for top in [crate::aws::dynamo::MAX_VERSION, u64::MAX] {
            let d = decide(&item(top, &[]), &w.facts("i-a", Phase::Wants, 1, 0));
            assert!(
                matches!(&d, Decision::Defer(why) if why.contains("cannot advance")),
                "a version that cannot advance is never written over, never saturated: {d:?}"
            );
        }
    }

    #[test]
    fn rule_5_nothing_without_an_entry_or_a_wish() {
        let w = World::new();
        let it = item(2, &[("i-b", C, 2)]);
        assert_eq!(
            decide(&it, &w.facts("i-a", Phase::Done, 1, 0)),
            Decision::Nothing
        );
    }

    #[test]
    fn seen_forgets_what_changed() {
        let mut s = Seen::default();
        let t0 = Instant::now();
        s.observe(&item(1, &[("i-a", R, 1)]), t0);
        s.observe(
            &item(2, &[("i-a", R, 1), ("i-b", R, 2)]),
            t0 + Duration::from_secs(5),
        );
        assert_eq!(
            s.unchanged_for("i-a", 1, t0 + Duration::from_secs(10)),
            Some(Duration::from_secs(10))
        );
        assert_eq!(
            s.unchanged_for("i-b", 2, t0 + Duration::from_secs(10)),
            Some(Duration::from_secs(5))
        );
        s.observe(&item(3, &[("i-b", C, 3)]), t0 + Duration::from_secs(11));
        assert_eq!(
            s.unchanged_for("i-a", 1, t0 + Duration::from_secs(12)),
            None
        );
        assert_eq!(
            s.unchanged_for("i-b", 2, t0 + Duration::from_secs(12)),
            None
        );
    }
}
