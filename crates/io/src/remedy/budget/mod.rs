//! The fleet budget: may this instance start a drain or a replacement now? One trait,
//! [`FleetBudget`], with the two protocols gpu-medic knows as its implementations, chosen once
//! at start ([`for_config`]):
//!
//! - the claim protocol ([`claims`]: `<prefix>.claim.<ms>` attributes ranked after a settle),
//!   when `[fleet] table` is unset;
//! - the DynamoDB slot table ([`slot_rules`] decides, [`slot_table`] reads, writes and sweeps),
//!   when it is set.
//!
//! Both judge the group through [`group_view`] (kill switches, the circuit breaker, the budget
//! of desired capacity), pure rules over what ECS and Auto Scaling say. A budget only
//! decides and records whether a slot is held; the drain or replacement is the caller's.
//! With the table, fleet incidents ([`patterns`], [`fleet_gate`]) may hold a drain for an
//! operator first: one fingerprint on many instances is one incident, not many drains.

pub mod claims;
pub mod fleet_gate;
pub mod group_view;
pub mod patterns;
pub mod slot_rules;
pub mod slot_table;

use std::sync::Arc;

use aws_config::SdkConfig;
use tokio_util::sync::CancellationToken;

use self::group_view::{FleetSummary, GroupView, KILL_SWITCH_PROCESSES, Member};
use crate::aws::asg::{Asg, GroupState};
use crate::aws::calls::{CallError, Calls};
use crate::aws::dynamo::{SlotItem, TableError};
use crate::aws::ecs::{Ecs, InstanceState};
use crate::aws::identity::Identity;
use crate::config::Config;
use crate::model::Order;
use crate::remedy::{BoxFuture, RemedyError};
use crate::sys::clock::SharedClock;

/// The budget slot a drain or replacement goes ahead with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Slot {
    /// None needed: Auto Scaling is terminating the instance anyway.
    None,
    /// The claim protocol's claim (its time, unix ms).
    Claim(u64),
    /// The slot table's committed entry: its group and fencing token.
    Table { group: String, token: u64 },
}

/// Where the caller stands: who we are, ECS for our cluster, and our own container instance
/// when the caller has described it already (it is then not described again).
#[derive(Clone, Copy)]
pub struct Here<'a> {
    pub id: &'a Identity,
    pub ecs: &'a Ecs,
    pub me: Option<&'a InstanceState>,
}

/// The reads a budget makes before deciding that need nothing but who we are (the Auto
/// Scaling group, the cluster's container instances, the slot table's item): started
/// together, beside the drain's own status read, and handed to [`FleetBudget::acquire`].
#[derive(Default)]
pub struct FirstReads {
    calls: Calls,
    group: Option<Result<GroupState, CallError>>,
    arns: Option<Result<Vec<String>, CallError>>,
    item: Option<Result<SlotItem, TableError>>,
}

impl FirstReads {
    /// The calls made, when the reads go unused (a drain that resumes): they are still listed.
    pub fn into_calls(self) -> Vec<String> {
        self.calls.entries
    }
}

/// What a release did, for the order's detail.
#[derive(Debug, Default)]
pub struct Released {
    /// Claim and slot attributes removed from the container instance.
    pub marks: usize,
    /// The slot table's part ("; fleet slot g/3 released in table t"), empty for claims.
    pub note: String,
}

/// Tells the budget's background work who this instance is, once discovery has succeeded.
pub trait Whoami: Send + Sync {
    fn whoami(&self) -> BoxFuture<'_, Option<Identity>>;
}

/// One fleet-budget protocol.
pub trait FleetBudget: Send + Sync {
    /// The reads `acquire` needs first, all at once (no call depends on another).
    fn first_reads<'a>(&'a self, id: &'a Identity, ecs: &'a Ecs) -> BoxFuture<'a, FirstReads>;

    /// Before anything else a drain does: a fleet incident (the same fingerprint, `signal` the
    /// order's incident's first signal, on many instances of the group) may hold it for an
    /// operator (`Deferred`, naming the incident). Only with the slot table.
    /// Some: the deferral, with the fleet incident's id when one holds the drain (none when
    /// this instance's sighting could not be recorded yet: it is tried again).
    fn fleet_gate<'a>(
        &'a self,
        _id: &'a Identity,
        _signal: &'a str,
    ) -> BoxFuture<'a, Option<(Option<String>, RemedyError)>> {
        Box::pin(async { None })
    }

    /// An application fault of this instance charged to task definition `definition`: the
    /// poison-task pattern (a fleet incident naming it at `[fleet] task_threshold`
    /// instances; holds nothing). Only with the slot table.
    fn task_pattern<'a>(&'a self, _id: &'a Identity, _definition: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }

    /// The attribute that marks an instance whose drain a fleet incident holds
    /// (`<prefix>.held`; the breaker's one repair never waits for it).
    fn held_attr(&self) -> String {
        String::new()
    }

    /// Before any other read of a drain's attempt: a deferral the budget can tell from its
    /// own record alone, or None (the attempt goes on and reads the group). The slot table's
    /// item full of other holders is one (docs/fleet-scale.md, "A waiting fleet reads the
    /// table only"): a waiting instance then costs one GetItem per attempt, not the group's
    /// Auto Scaling and ECS state. It only ever defers where a full attempt would defer too.
    fn precheck<'a>(&'a self, _id: &'a Identity) -> BoxFuture<'a, Option<RemedyError>> {
        Box::pin(async { None })
    }

    /// A slot for this instance's drain or replacement, or why not (`Deferred`). An instance
    /// that already holds one (DRAINING, Unhealthy, a live claim or a committed entry from
    /// before a restart) keeps it.
    fn acquire<'a>(
        &'a self,
        calls: &'a mut Calls,
        here: Here<'a>,
        first: FirstReads,
        order: &'a Order,
    ) -> BoxFuture<'a, Result<Slot, RemedyError>>;

    /// After the drain call, off its critical path: marks the container instance with the
    /// slot it drains under; the text for the order's detail.
    fn note<'a>(
        &'a self,
        calls: &'a mut Calls,
        here: Here<'a>,
        slot: &'a Slot,
    ) -> BoxFuture<'a, String>;

    /// Remediation over (restored): gives the slot back. `here.me` must be described.
    fn release<'a>(
        &'a self,
        calls: &'a mut Calls,
        here: Here<'a>,
    ) -> BoxFuture<'a, Result<Released, RemedyError>>;

    /// The group as the last `acquire` read it, taken (None: no read since the last take):
    /// the drain's or replacement's outcome carries it to the engine and the metrics.
    fn take_view(&self) -> Option<crate::model::FleetBudgetView> {
        None
    }

    /// Background upkeep until `shutdown` (the slot table's sweep of terminated holders).
    fn upkeep<'a>(
        &'a self,
        _who: &'a dyn Whoami,
        _shutdown: CancellationToken,
    ) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }
}

/// The protocol `[fleet]` names: the slot table with `table`, else the claims.
pub fn for_config(sdk: &SdkConfig, cfg: &Config, clock: SharedClock) -> Arc<dyn FleetBudget> {
    let common = Common {
        cfg: cfg.clone(),
        asg: Asg::new(aws_sdk_autoscaling::Client::new(sdk)),
        clock,
        last: std::sync::Mutex::new(None),
        deferrals: std::sync::atomic::AtomicU32::new(0),
    };
    match &cfg.fleet.table {
        Some(t) => Arc::new(slot_table::SlotBudget::new(sdk, t, common)),
        None => Arc::new(claims::ClaimBudget::new(common)),
    }
}

/// The longest deferral window, in `retry_after`s (8: one minute's retry_after grows to at
/// most eight minutes, drawn uniformly below it).
pub const DEFERRAL_CAP: u32 = 8;

/// What both protocols work with.
pub(crate) struct Common {
    pub cfg: Config,
    pub asg: Asg,
    pub clock: SharedClock,
    /// The group as the last admission read it, until the order's outcome takes it.
    pub last: std::sync::Mutex<Option<crate::model::FleetBudgetView>>,
    /// Deferrals in a row since a step last got its slot (or failed otherwise): the window
    /// of the next deferral's full jitter doubles with each ([`Common::defer`]).
    pub deferrals: std::sync::atomic::AtomicU32,
}

impl Common {
    fn prefix(&self) -> &str {
        &self.cfg.ecs.attribute_prefix
    }

    fn health_attr(&self) -> String {
        format!("{}.health", self.prefix())
    }

    /// `<prefix>.slot`: `<group>/<token>` of the committed entry, on the container instance.
    fn slot_attr(&self) -> String {
        format!("{}.slot", self.prefix())
    }

    /// `<prefix>.held`: the fleet incident that holds this instance's drain for an operator.
    pub(crate) fn held_attr(&self) -> String {
        format!("{}.held", self.prefix())
    }

    /// A deferral, retried after a full-jitter delay ([`crate::sys::backoff`]) over a window
    /// that starts at `retry_after` and doubles with each deferral in a row, up to
    /// [`DEFERRAL_CAP`] × `retry_after`: a fleet of waiting instances neither re-reads in
    /// lockstep nor keeps reading the group at the rate of its first retry while the wait
    /// goes on (docs/fleet-scale.md, "Deferrals").
    fn defer(&self, message: String) -> RemedyError {
        tracing::info!("{message}");
        let n = self
            .deferrals
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let base = self.cfg.fleet.retry_after;
        RemedyError::Deferred {
            message,
            retry_after: crate::sys::backoff::full_jitter(
                base,
                n,
                base.saturating_mul(DEFERRAL_CAP),
            ),
        }
    }

    /// An attempt ended other than deferred (a slot, or a failure): the next deferral's
    /// window starts again at `retry_after`.
    fn settled(&self, r: &Result<Slot, RemedyError>) {
        if !matches!(r, Err(RemedyError::Deferred { .. })) {
            self.deferrals
                .store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The Auto Scaling group and the cluster's container instances, read together.
    async fn group_and_arns(&self, id: &Identity, ecs: &Ecs) -> FirstReads {
        let (mut a, mut b) = (Calls::new(), Calls::new());
        let group = async {
            match &id.auto_scaling_group {
                Some(g) => Some(self.asg.group(&mut a, g).await),
                None => None,
            }
        };
        let (group, arns) = tokio::join!(group, ecs.list_instances(&mut b));
        let mut calls = a;
        calls.entries.extend(b.entries);
        FirstReads {
            calls,
            group,
            arns: Some(arns),
            item: None,
        }
    }

    fn member(&self, s: &InstanceState) -> Member {
        Member {
            instance_id: s.ec2_instance_id.clone().unwrap_or_default(),
            ecs_status: Some(s.status.clone()),
            health: s
                .attribute(&self.health_attr())
                .and_then(|(_, v)| v.clone()),
            claim_ms: s.claim(self.prefix()).map(|(_, ms)| ms),
            registered_ms: s.registered_ms,
            agent_connected: s.agent_connected,
            lifecycle: None,
            asg_health: None,
            held: s.attribute(&self.held_attr()).is_some(),
        }
    }

    /// The group as the budget sees it: the Auto Scaling group's instances joined with their
    /// container instances (or, outside any group, the cluster's instances). `arns` are the
    /// cluster's container instances; `here.me`, when described, is not described again.
    async fn view(
        &self,
        calls: &mut Calls,
        here: Here<'_>,
        group: Option<GroupState>,
        arns: Vec<String>,
    ) -> Result<(GroupView, Vec<InstanceState>), CallError> {
        let skip = here.me.map(|m| m.arn.as_str());
        let wanted: Vec<String> = arns
            .into_iter()
            .filter(|a| Some(a.as_str()) != skip)
            .collect();
        let mut states = if wanted.is_empty() {
            Vec::new()
        } else {
            here.ecs.describe(calls, &wanted, false).await?
        };
        if let Some(me) = here.me {
            states.push(me.clone());
        }
        let Some(g) = group else {
            let members: Vec<Member> = states.iter().map(|s| self.member(s)).collect();
            let view = GroupView {
                group: format!("cluster {}", here.id.cluster),
                desired: members.len() as u32,
                members,
                ..GroupView::default()
            };
            return Ok((view, states));
        };
        let mut view = group_only(&g, &self.cfg.fleet.pause_tag);
        view.members = g
            .instances
            .iter()
            .map(|i| {
                let mut m = states
                    .iter()
                    .find(|s| s.ec2_instance_id.as_deref() == Some(i.instance_id.as_str()))
                    .map(|s| self.member(s))
                    .unwrap_or_default();
                m.instance_id = i.instance_id.clone();
                m.lifecycle = i.lifecycle.clone();
                m.asg_health = i.health.clone();
                m
            })
            .collect();
        Ok((view, states))
    }

    /// The group as the last admission read it, taken.
    fn take_view(&self) -> Option<crate::model::FleetBudgetView> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Keeps what the fleet gate saw for `gpu-medic status` (best effort: status only), and
    /// for the order's outcome.
    fn record_fleet(&self, summary: &FleetSummary) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) =
            Some(crate::model::FleetBudgetView {
                group: summary.group.clone(),
                desired: summary.desired,
                capacity: summary.budget,
                in_use: u32::try_from(summary.in_remediation.len()).unwrap_or(u32::MAX),
                observed_at: summary.observed_at,
            });
        self.cfg
            .files()
            .save_view(crate::config::View::Fleet, summary);
    }

    /// Removes our claim and slot attributes from the container instance (`here.me`).
    async fn clear_marks(&self, calls: &mut Calls, here: Here<'_>) -> Result<usize, CallError> {
        let Some(me) = here.me else {
            return Ok(0);
        };
        let head = format!("{}.claim.", self.prefix());
        let (slot_attr, held_attr) = (self.slot_attr(), self.held_attr());
        let marks: Vec<&String> = me
            .attributes
            .iter()
            .filter(|(n, _)| n.starts_with(&head) || *n == slot_attr || *n == held_attr)
            .map(|(n, _)| n)
            .collect();
        for name in &marks {
            here.ecs.delete_attribute(calls, &me.arn, name).await?;
        }
        Ok(marks.len())
    }
}

/// The group as Auto Scaling alone shows it: its kill switches, desired capacity and members'
/// lifecycle and health (no ECS state yet).
fn group_only(g: &GroupState, pause_tag: &str) -> GroupView {
    GroupView {
        group: format!("Auto Scaling group {}", g.name),
        desired: g.desired,
        members: g
            .instances
            .iter()
            .map(|i| Member {
                instance_id: i.instance_id.clone(),
                lifecycle: i.lifecycle.clone(),
                asg_health: i.health.clone(),
                ..Member::default()
            })
            .collect(),
        suspended: g
            .suspended
            .iter()
            .filter(|p| KILL_SWITCH_PROCESSES.contains(&p.as_str()))
            .cloned()
            .collect(),
        paused: g
            .tags
            .iter()
            .any(|(k, v)| k == pause_tag && v.trim().eq_ignore_ascii_case("true")),
    }
}
