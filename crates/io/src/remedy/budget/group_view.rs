//! The fleet budget: may this instance start a drain or a replacement now? Decided from ECS
//! and Auto Scaling state only (no coordinator, no extra infrastructure), so that every
//! gpu-medic in a group reaches the same answer from the same facts.
//!
//! This module is pure: `Member`s in, a `Gate` out. The rule (docs/aws.md#fleet-budget):
//! - an instance is *in remediation* when it is DRAINING in ECS, holds a live claim, is
//!   Unhealthy or Pending/Terminating/Standby in Auto Scaling, is not (yet) registered with
//!   ECS, or registered less than `warmup` ago;
//! - kill switches (suspended ReplaceUnhealthy/HealthCheck/Launch/Terminate, the pause tag)
//!   stop everything but quarantine;
//! - the circuit breaker: in a group of more than 5, more unhealthy instances (in remediation,
//!   quarantined, agent disconnected) than `max_unhealthy` holds new remediation, but for the
//!   one repair it always lets through: when nothing of the group is in remediation, the
//!   waiting instance with the lowest id goes ahead (so two faults at once never hold each
//!   other for ever; `models/fleet/breaker.pml`);
//! - the budget: at most max(1, `max_parallel`) in remediation, ourselves included;
//! - two instances deciding at once both write a claim (`<prefix>.claim.<unix ms>`), wait, and
//!   re-read: claims rank by (time, instance id) and only those within the budget go ahead;
//!   with `[fleet] table` the slot table (`slot_rules.rs`) takes the claims' place, and this view
//!   still counts what the table does not hold (`admit_table`).

use std::fmt;
use std::time::Duration;

use crate::aws::ecs::EcsStatus;
use crate::config::FleetConfig;

/// Groups of this size or smaller never trip the breaker (EKS managed node groups' rule).
pub const BREAKER_MIN_FLEET: u32 = 6;

/// Auto Scaling processes whose suspension means "hands off".
pub const KILL_SWITCH_PROCESSES: [&str; 4] =
    ["ReplaceUnhealthy", "HealthCheck", "Launch", "Terminate"];

/// One instance of the group, as ECS and Auto Scaling see it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Member {
    pub instance_id: String,
    /// ECS container instance status; None: not registered.
    pub ecs_status: Option<EcsStatus>,
    /// Our `<prefix>.health` attribute.
    pub health: Option<String>,
    /// Our claim's time (unix ms), from the `<prefix>.claim.<ms>` attribute.
    pub claim_ms: Option<u64>,
    /// When the container instance registered with ECS (unix ms).
    pub registered_ms: Option<u64>,
    pub agent_connected: bool,
    /// Auto Scaling lifecycle state and health; None: not in the group (ECS-only view).
    pub lifecycle: Option<String>,
    pub asg_health: Option<String>,
    /// Its drain is held for an operator by a fleet incident (the `<prefix>.held` attribute):
    /// it counts as unhealthy, but the breaker never waits for it to go first.
    pub held: bool,
}

/// The group and its kill switches.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupView {
    /// The Auto Scaling group (or the cluster, for an instance outside any group).
    pub group: String,
    pub desired: u32,
    pub members: Vec<Member>,
    /// Kill-switch processes found suspended.
    pub suspended: Vec<String>,
    /// The pause tag is set.
    pub paused: bool,
}

/// Why a step may not start now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    KillSwitch(String),
    Breaker {
        unhealthy: u32,
        desired: u32,
        limit: u32,
    },
    /// `busy` names them (the replacement gap listed up to [`GAP_LISTED`]); `count` is how
    /// many there are.
    Budget {
        busy: Vec<String>,
        count: u32,
        budget: u32,
    },
    /// Claims were written at once and ours ranks outside the budget.
    Outranked {
        ahead: Vec<String>,
        count: u32,
        budget: u32,
    },
}

impl fmt::Display for Denial {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Denial::KillSwitch(why) => write!(f, "kill switch: {why}; staying quarantined"),
            Denial::Breaker {
                unhealthy,
                desired,
                limit,
            } => write!(
                f,
                "circuit breaker open: {unhealthy} of {desired} instances unhealthy (limit {limit}); staying quarantined"
            ),
            Denial::Budget {
                busy,
                count,
                budget,
            } => write!(
                f,
                "fleet budget full: {count} of {budget} in remediation ({}); staying quarantined",
                busy.join(", ")
            ),
            Denial::Outranked { ahead, budget, .. } => write!(
                f,
                "fleet budget full: claims ahead of ours ({}) fill the {budget} slot(s); staying quarantined",
                ahead.join(", ")
            ),
        }
    }
}

/// The replacement gap's entries listed by name at most (the rest are counted in one entry).
pub const GAP_LISTED: u32 = 8;

/// The instances in a group that a rule counts, with why.
fn in_remediation(m: &Member, now_ms: u64, cfg: &FleetConfig) -> Option<&'static str> {
    if m.ecs_status == Some(EcsStatus::Draining) {
        return Some("draining");
    }
    if m.asg_health.as_deref() == Some("Unhealthy") {
        return Some("unhealthy");
    }
    if let Some(state) = m.lifecycle.as_deref()
        && [
            "Pending",
            "Terminating",
            "EnteringStandby",
            "Standby",
            "Detaching",
        ]
        .iter()
        .any(|p| state.starts_with(p))
    {
        return Some("lifecycle");
    }
    match m.ecs_status {
        None => return Some("not registered with ECS"),
        Some(EcsStatus::Registering | EcsStatus::Deregistering) => return Some("registering"),
        _ => {}
    }
    if let Some(r) = m.registered_ms
        && now_ms.saturating_sub(r) < ms(cfg.warmup)
    {
        return Some("warming up");
    }
    None
}

/// Whether a claim made at `claim_ms` still has time to finish: at least two settle periods
/// of its TTL left (one to settle and re-read, one to act). An older claim is withdrawn and
/// made anew, or another instance may already see it as expired while we act on it.
pub fn claim_fresh(claim_ms: u64, now_ms: u64, cfg: &FleetConfig) -> bool {
    let age = now_ms.saturating_sub(claim_ms);
    age.saturating_add(ms(cfg.claim_settle).saturating_mul(2)) < ms(cfg.claim_ttl)
}

fn claim_live(m: &Member, now_ms: u64, cfg: &FleetConfig) -> bool {
    m.claim_ms
        .is_some_and(|c| now_ms.saturating_sub(c) < ms(cfg.claim_ttl))
}

fn ms(d: Duration) -> u64 {
    d.as_millis() as u64
}

/// What the fleet gate saw last, kept in `state_dir/fleet.json` for `gpu-medic status`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FleetSummary {
    pub observed_at: crate::model::Timestamp,
    pub group: String,
    pub desired: u32,
    pub budget: u32,
    /// Instances in remediation, with why (`i-0abc draining`).
    pub in_remediation: Vec<String>,
    pub unhealthy: u32,
    pub breaker_limit: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kill_switch: Option<String>,
}

/// What the slot table held when this gpu-medic last read or wrote it, kept in
/// `state_dir/slots.json` for `gpu-medic status` (which stays a local read).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlotsSummary {
    pub observed_at: crate::model::Timestamp,
    pub table: String,
    pub group: String,
    pub version: u64,
    /// The budget its last writer enforced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<u32>,
    pub holders: std::collections::BTreeMap<String, crate::aws::dynamo::Holder>,
}

impl GroupView {
    /// The view as `gpu-medic status` shows it.
    pub fn summary(&self, now_ms: u64, cfg: &FleetConfig) -> FleetSummary {
        let busy: Vec<String> = self
            .members
            .iter()
            .filter_map(|m| {
                let why = in_remediation(m, now_ms, cfg)
                    .or_else(|| claim_live(m, now_ms, cfg).then_some("claimed"))?;
                Some(format!("{} {why}", m.instance_id))
            })
            .chain(self.gap_entries().0)
            .collect();
        let unhealthy = self
            .members
            .iter()
            .filter(|m| {
                in_remediation(m, now_ms, cfg).is_some()
                    || claim_live(m, now_ms, cfg)
                    || m.health.as_deref() == Some("faulted")
                    || (m.ecs_status.is_some() && !m.agent_connected)
            })
            .count() as u32;
        FleetSummary {
            observed_at: crate::model::Timestamp(now_ms),
            group: self.group.clone(),
            desired: self.desired,
            budget: self.budget(cfg),
            unhealthy,
            breaker_limit: cfg.max_unhealthy.of(self.desired),
            kill_switch: self.kill_switch().map(|d| d.to_string()),
            in_remediation: busy,
        }
    }

    /// Instances the group wants but does not have: Auto Scaling terminated a replaced
    /// instance before its successor shows up (no instance maintenance policy). Each counts as
    /// in remediation, or a second instance would drain in the gap.
    pub fn replacement_gap(&self) -> u32 {
        self.desired.saturating_sub(self.members.len() as u32)
    }

    /// The replacement gap as entries of a list (at most [`GAP_LISTED`] of them, then one
    /// that says how many more: the group's desired capacity is AWS's number, and a list as
    /// long as it could be would not fit in memory) and as a count.
    fn gap_entries(&self) -> (Vec<String>, u32) {
        let gap = self.replacement_gap();
        let mut out: Vec<String> = (0..gap.min(GAP_LISTED))
            .map(|i| format!("(replacement {} of {gap}) not yet in the group", i + 1))
            .collect();
        if gap > GAP_LISTED {
            out.push(format!(
                "({} more replacements) not yet in the group",
                gap - GAP_LISTED
            ));
        }
        (out, gap)
    }

    /// The budget for this group: max(1, `max_parallel` of desired capacity).
    pub fn budget(&self, cfg: &FleetConfig) -> u32 {
        cfg.max_parallel.of(self.desired).max(1)
    }

    /// Whether `me` already holds a slot (a resumed step needs no new one).
    pub fn holds_slot(&self, me: &str, now_ms: u64, cfg: &FleetConfig) -> bool {
        self.members.iter().any(|m| {
            m.instance_id == me
                && (matches!(
                    in_remediation(m, now_ms, cfg),
                    Some("draining" | "unhealthy")
                ) || claim_live(m, now_ms, cfg))
        })
    }

    pub fn kill_switch(&self) -> Option<Denial> {
        if self.paused {
            return Some(Denial::KillSwitch(format!(
                "{} is paused by its tag",
                self.group
            )));
        }
        if !self.suspended.is_empty() {
            return Some(Denial::KillSwitch(format!(
                "{} has {} suspended",
                self.group,
                self.suspended.join(", ")
            )));
        }
        None
    }

    /// Before claiming: kill switches, the breaker, then the budget (ourselves not counted).
    pub fn admit(&self, me: &str, now_ms: u64, cfg: &FleetConfig) -> Result<(), Denial> {
        if let Some(d) = self.kill_switch() {
            return Err(d);
        }
        self.breaker(me, now_ms, cfg)?;
        let budget = self.budget(cfg);
        let (busy, count) = self.busy(me, now_ms, cfg, |_| false);
        if count >= budget {
            return Err(Denial::Budget {
                busy,
                count,
                budget,
            });
        }
        Ok(())
    }

    /// Before reserving in the slot table (`slot_rules.rs`): kill switches, the breaker, then the
    /// budget less the instances this view shows in remediation that hold no entry of the
    /// table (drains, replacements and instance refreshes gpu-medic did not start, the
    /// replacement gap). Ok: how many of those there are; the table's budget is the rest.
    pub fn admit_table(
        &self,
        me: &str,
        holders: &std::collections::BTreeSet<String>,
        now_ms: u64,
        cfg: &FleetConfig,
    ) -> Result<u32, Denial> {
        if let Some(d) = self.kill_switch() {
            return Err(d);
        }
        self.breaker(me, now_ms, cfg)?;
        let budget = self.budget(cfg);
        let (busy, count) = self.busy(me, now_ms, cfg, |id| holders.contains(id));
        if count >= budget {
            return Err(Denial::Budget {
                busy,
                count,
                budget,
            });
        }
        Ok(count)
    }

    /// The others in remediation or with a live claim, and the replacement gap, except those
    /// `skip` names: as a list, and how many.
    fn busy(
        &self,
        me: &str,
        now_ms: u64,
        cfg: &FleetConfig,
        skip: impl Fn(&str) -> bool,
    ) -> (Vec<String>, u32) {
        let mut busy: Vec<String> = self
            .members
            .iter()
            .filter(|m| m.instance_id != me && !skip(&m.instance_id))
            .filter_map(|m| {
                let why = in_remediation(m, now_ms, cfg)
                    .or_else(|| claim_live(m, now_ms, cfg).then_some("claimed"))?;
                Some(format!("{} {why}", m.instance_id))
            })
            .collect();
        let (gap, gap_count) = self.gap_entries();
        let count = (busy.len() as u32).saturating_add(gap_count);
        busy.extend(gap);
        (busy, count)
    }

    /// The circuit breaker: in a group of more than 5, more unhealthy instances (ourselves
    /// included) than `max_unhealthy` holds new remediation. It never holds every repair: with
    /// nothing of the group in remediation (no drain, no Unhealthy, no replacement, no live
    /// claim), the waiting instance (quarantined: `faulted`, and not held for an operator by a
    /// fleet incident) with the lowest id goes ahead,
    /// one at a time, as ECS Managed Instances drain one at a time in small groups; the budget
    /// and its protocol still decide after this.
    fn breaker(&self, me: &str, now_ms: u64, cfg: &FleetConfig) -> Result<(), Denial> {
        let busy =
            |m: &Member| in_remediation(m, now_ms, cfg).is_some() || claim_live(m, now_ms, cfg);
        let waiting = |m: &Member| m.instance_id == me || m.health.as_deref() == Some("faulted");
        let unhealthy = self
            .members
            .iter()
            .filter(|m| waiting(m) || busy(m) || (m.ecs_status.is_some() && !m.agent_connected))
            .count() as u32;
        let limit = cfg.max_unhealthy.of(self.desired);
        if self.desired < BREAKER_MIN_FLEET || unhealthy <= limit {
            return Ok(());
        }
        let in_progress = self.members.iter().any(|m| m.instance_id != me && busy(m));
        // An instance held for an operator (a fleet incident) will not go: the breaker's one
        // repair goes to the next (issue 51: otherwise a held instance with the lowest id
        // holds every other repair of the group).
        let first = self
            .members
            .iter()
            .filter(|m| waiting(m) && !busy(m) && !m.held)
            .map(|m| m.instance_id.as_str())
            .chain(std::iter::once(me))
            .min();
        if !in_progress && first == Some(me) {
            return Ok(());
        }
        Err(Denial::Breaker {
            unhealthy,
            desired: self.desired,
            limit,
        })
    }

    /// After our claim settled: do we rank within the budget? Instances in remediation for
    /// other reasons take slots first; claims then rank by (time, instance id).
    pub fn rank(
        &self,
        me: &str,
        my_claim_ms: u64,
        now_ms: u64,
        cfg: &FleetConfig,
    ) -> Result<(), Denial> {
        let budget = self.budget(cfg);
        let (mut ahead, gap) = self.gap_entries();
        let mut count = gap;
        for m in self.members.iter().filter(|m| m.instance_id != me) {
            if let Some(why) = in_remediation(m, now_ms, cfg) {
                ahead.push(format!("{} {why}", m.instance_id));
                count = count.saturating_add(1);
            } else if let Some(c) = m.claim_ms
                && claim_live(m, now_ms, cfg)
                && (c, m.instance_id.as_str()) < (my_claim_ms, me)
            {
                ahead.push(format!("{} claimed", m.instance_id));
                count = count.saturating_add(1);
            }
        }
        if count >= budget {
            return Err(Denial::Outranked {
                ahead,
                count,
                budget,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FleetLimit;

    const NOW: u64 = 10_000_000;

    fn cfg(parallel: u32) -> FleetConfig {
        FleetConfig {
            max_parallel: FleetLimit::Count(parallel),
            max_unhealthy: FleetLimit::Percent(50.0),
            warmup: Duration::from_secs(60),
            claim_ttl: Duration::from_secs(600),
            ..FleetConfig::default()
        }
    }

    fn healthy(id: &str) -> Member {
        Member {
            instance_id: id.into(),
            ecs_status: Some(EcsStatus::Active),
            registered_ms: Some(0),
            agent_connected: true,
            lifecycle: Some("InService".into()),
            asg_health: Some("Healthy".into()),
            ..Member::default()
        }
    }

    fn fleet(n: usize) -> GroupView {
        GroupView {
            group: "g".into(),
            desired: n as u32,
            members: (0..n).map(|i| healthy(&format!("i-{i}"))).collect(),
            ..GroupView::default()
        }
    }

    #[test]
    fn budget_counts_draining_unhealthy_claimed_and_young_instances() {
        let mut f = fleet(10);
        assert!(f.admit("i-0", NOW, &cfg(2)).is_ok());
        f.members[1].ecs_status = Some(EcsStatus::Draining);
        assert!(f.admit("i-0", NOW, &cfg(2)).is_ok());
        f.members[2].registered_ms = Some(NOW - 1000);
        let Err(Denial::Budget {
            busy, budget: 2, ..
        }) = f.admit("i-0", NOW, &cfg(2))
        else {
            panic!("two in flight fill a budget of 2")
        };
        assert_eq!(busy, ["i-1 draining", "i-2 warming up"]);
        f.members[2].registered_ms = Some(0);
        f.members[3].claim_ms = Some(NOW - 1000);
        assert!(f.admit("i-0", NOW, &cfg(2)).is_err());
        // An expired claim on an instance that never drained does not count.
        f.members[3].claim_ms = Some(NOW - 700_000);
        assert!(f.admit("i-0", NOW, &cfg(2)).is_ok());
        f.members[4].asg_health = Some("Unhealthy".into());
        assert!(f.admit("i-0", NOW, &cfg(2)).is_err());
    }

    #[test]
    fn percent_budget_is_at_least_one() {
        let mut f = fleet(4);
        let c = FleetConfig {
            warmup: Duration::ZERO,
            ..FleetConfig::default()
        };
        assert_eq!(f.budget(&c), 1);
        f.members[1].ecs_status = Some(EcsStatus::Draining);
        assert!(matches!(
            f.admit("i-0", NOW, &c),
            Err(Denial::Budget { .. })
        ));
        assert_eq!(fleet(10).budget(&c), 2);
    }

    #[test]
    fn breaker_trips_above_the_unhealthy_share() {
        let mut f = fleet(10);
        let mut c = cfg(5);
        c.max_unhealthy = FleetLimit::Percent(20.0);
        f.members[1].health = Some("faulted".into());
        assert!(f.admit("i-0", NOW, &c).is_ok(), "2 of 10 is not above 20%");
        f.members[2].agent_connected = false;
        assert!(matches!(
            f.admit("i-3", NOW, &c),
            Err(Denial::Breaker {
                unhealthy: 3,
                limit: 2,
                ..
            })
        ));
        // Small groups never trip it.
        let mut small = fleet(5);
        small.members[1].health = Some("faulted".into());
        small.members[2].health = Some("faulted".into());
        assert!(small.admit("i-0", NOW, &c).is_ok());
    }

    /// Faulted instances waiting while the breaker is open: the lowest id goes ahead when
    /// nothing is in remediation, and only then; the others wait for it (never for ever).
    fn breaker_lets_one_through(n: usize, faulted: &[usize]) {
        let mut f = fleet(n);
        let mut c = cfg(1);
        c.max_unhealthy = FleetLimit::Percent(20.0);
        for i in faulted {
            f.members[*i].health = Some("faulted".into());
        }
        let ids: Vec<String> = faulted.iter().map(|i| format!("i-{i}")).collect();
        let first = ids.iter().min().unwrap().clone();
        for id in &ids {
            let got = f.admit(id, NOW, &c);
            if *id == first {
                assert!(
                    got.is_ok(),
                    "{n} instances, {faulted:?}: {id} goes first: {got:?}"
                );
            } else {
                assert!(matches!(got, Err(Denial::Breaker { .. })), "{id}: {got:?}");
            }
        }
        // The first one in remediation: every other waits, the first keeps going.
        let at = faulted
            .iter()
            .find(|i| format!("i-{i}") == first)
            .copied()
            .unwrap();
        f.members[at].ecs_status = Some(EcsStatus::Draining);
        for id in ids.iter().filter(|id| **id != first) {
            assert!(
                f.admit(id, NOW, &c).is_err(),
                "{id} waits while {first} drains"
            );
        }
        // Back in service: the next lowest goes.
        f.members[at].ecs_status = Some(EcsStatus::Active);
        f.members[at].health = None;
        let next = ids.iter().filter(|id| **id != first).min().unwrap();
        assert!(f.admit(next, NOW, &c).is_ok(), "{next} next");
    }

    /// An instance held for an operator (a fleet incident) with the lowest id does not keep
    /// the breaker's one repair from the others: it still counts as unhealthy.
    #[test]
    fn a_held_instance_never_holds_the_breakers_one_repair() {
        let mut f = fleet(8);
        let mut c = cfg(1);
        c.max_unhealthy = FleetLimit::Percent(20.0);
        for i in [1, 3, 5] {
            f.members[i].health = Some("faulted".into());
        }
        f.members[1].held = true;
        assert!(f.admit("i-3", NOW, &c).is_ok(), "i-1 is held: i-3 goes");
        assert!(matches!(
            f.admit("i-5", NOW, &c),
            Err(Denial::Breaker { unhealthy: 3, .. })
        ));
    }

    #[test]
    fn the_breaker_never_holds_every_repair_at_8_and_at_20() {
        // Two at once in a group of 8 (20 %: limit 1): today's deadlock.
        breaker_lets_one_through(8, &[3, 5]);
        // 30 % of 20 at once (limit 4).
        breaker_lets_one_through(20, &[2, 4, 7, 11, 13, 19]);
    }

    #[test]
    fn kill_switches_come_first() {
        let mut f = fleet(10);
        f.suspended = vec!["ReplaceUnhealthy".into()];
        assert!(matches!(
            f.admit("i-0", NOW, &cfg(2)),
            Err(Denial::KillSwitch(_))
        ));
        f.suspended.clear();
        f.paused = true;
        let e = f.admit("i-0", NOW, &cfg(2)).unwrap_err();
        assert!(e.to_string().contains("paused"), "{e}");
    }

    #[test]
    fn simultaneous_claims_rank_by_time_then_instance_id() {
        let mut f = fleet(10);
        let c = cfg(1);
        f.members[3].claim_ms = Some(NOW);
        f.members[5].claim_ms = Some(NOW);
        f.members[7].claim_ms = Some(NOW - 5);
        // i-7 claimed first: it goes, both others withdraw.
        assert!(f.rank("i-7", NOW - 5, NOW, &c).is_ok());
        assert!(f.rank("i-3", NOW, NOW, &c).is_err());
        assert!(f.rank("i-5", NOW, NOW, &c).is_err());
        // With two slots the tie between i-3 and i-5 goes to the lower id.
        assert!(f.rank("i-3", NOW, NOW, &cfg(2)).is_ok());
        assert!(f.rank("i-5", NOW, NOW, &cfg(2)).is_err());
    }

    #[test]
    fn resumed_instances_hold_their_slot() {
        let mut f = fleet(3);
        let c = cfg(1);
        assert!(!f.holds_slot("i-0", NOW, &c));
        f.members[0].ecs_status = Some(EcsStatus::Draining);
        assert!(f.holds_slot("i-0", NOW, &c));
        f.members[0].ecs_status = Some(EcsStatus::Active);
        f.members[0].claim_ms = Some(NOW - 10);
        assert!(f.holds_slot("i-0", NOW, &c));
    }

    #[test]
    fn the_replacement_gap_counts_as_in_remediation() {
        // Auto Scaling terminated a replaced instance and has not launched its successor yet:
        // 10 desired, 9 members. With a budget of 1 nobody else may drain in that gap.
        let mut f = fleet(10);
        f.members.pop();
        let c = cfg(1);
        assert_eq!(f.replacement_gap(), 1);
        let Err(Denial::Budget { busy, .. }) = f.admit("i-0", NOW, &c) else {
            panic!("the gap takes the slot")
        };
        assert!(busy[0].contains("not yet in the group"), "{busy:?}");
        assert!(f.rank("i-0", NOW, NOW, &c).is_err());
        assert_eq!(f.summary(NOW, &c).in_remediation.len(), 1);
        assert!(
            f.admit("i-0", NOW, &cfg(2)).is_ok(),
            "a second slot is free"
        );
        // Scale-in (desired below members) is no gap.
        let mut f = fleet(10);
        f.desired = 8;
        assert_eq!(f.replacement_gap(), 0);
    }

    /// A desired capacity of billions (AWS's number, however it came to be) is counted, never
    /// listed: the gap fills the budget at once, in a few entries.
    #[test]
    fn a_huge_replacement_gap_is_counted_not_listed() {
        let mut f = fleet(10);
        f.desired = u32::MAX;
        let c = cfg(1_000_000);
        let Err(Denial::Budget { busy, count, .. }) = f.admit("i-0", NOW, &c) else {
            panic!("the gap fills the budget")
        };
        assert_eq!(count, u32::MAX - 10);
        assert_eq!(busy.len() as u32, GAP_LISTED + 1);
        assert!(
            busy.last().unwrap().contains("more replacements"),
            "{busy:?}"
        );
        let Err(Denial::Outranked { ahead, count, .. }) = f.rank("i-0", NOW, NOW, &c) else {
            panic!("the gap ranks ahead")
        };
        assert_eq!((ahead.len() as u32, count), (GAP_LISTED + 1, u32::MAX - 10));
        assert!(f.summary(NOW, &c).in_remediation.len() as u32 <= GAP_LISTED + 1);
        assert!(f.admit_table("i-0", &Default::default(), NOW, &c).is_err());
    }

    #[test]
    fn a_claim_needs_two_settle_periods_of_its_ttl_left() {
        let c = FleetConfig {
            claim_ttl: Duration::from_secs(600),
            claim_settle: Duration::from_secs(10),
            ..cfg(1)
        };
        assert!(claim_fresh(NOW, NOW, &c));
        assert!(claim_fresh(NOW - 579_999, NOW, &c));
        assert!(!claim_fresh(NOW - 580_000, NOW, &c), "20 s left of 600 s");
        assert!(!claim_fresh(0, u64::MAX, &c), "no overflow");
        assert!(
            claim_fresh(NOW + 5_000, NOW, &c),
            "a claim from the future is young"
        );
    }
}
