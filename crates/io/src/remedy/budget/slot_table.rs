//! The fleet budget's slot table carried out (`[fleet] table`): read the group's item, ask
//! `slots::decide`, write what it says (conditionally), and act only once a commit of ours has
//! been written. The ECS/Auto Scaling view still runs first (kill switches, the breaker, and
//! the instances in remediation that hold no entry), and every gpu-medic of a group removes
//! the entries of terminated instances: with each read here, and in
//! [`SlotBudget::sweep`] (so a slot held by a terminated instance is released even when no
//! other instance wants one), paced so the whole group sweeps about [`SWEEPS_PER_PERIOD`]
//! times per `retry_after` whatever its size.
//!
//! The reads that depend on nothing (Auto Scaling's group, the item, the cluster's container
//! instances) go out together, beside the drain's own status read ([`FirstReads`]).
//!
//! A table that throttles, cannot be reached, refuses the call or holds an unreadable item
//! means no drain: the order is deferred with a line that says why (the instance stays
//! quarantined). An instance with no Auto Scaling group has no slot to hold and never drains.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use aws_config::SdkConfig;
use tokio_util::sync::CancellationToken;

use super::group_view::{GroupView, SlotsSummary};
use super::slot_rules::{self as slots, Decision, Facts, Phase, Stamp, WriteKind};
use super::{Common, FirstReads, FleetBudget, Here, Released, Slot, Whoami, group_only};
use crate::aws::calls::Calls;
use crate::aws::dynamo::{SWEEPS_PER_PERIOD, SlotItem, SlotTable, TableError};
use crate::aws::ec2::Ec2;
use crate::aws::identity::Identity;
use crate::model::{Order, Timestamp};
use crate::remedy::calls::CallsExt;
use crate::remedy::{BoxFuture, RemedyError};

/// One attempt's fixed facts, for the decisions after the first read.
struct Steps<'a> {
    me: &'a str,
    group: &'a str,
    /// The group's desired capacity, recorded in the item (the sweep's pacing).
    members: u32,
    budget: u32,
    stamp: &'a Stamp,
    view: &'a GroupView,
}

/// Lost races in a row (the item changed between our read and our write) before deferring.
const MAX_CONFLICTS: u32 = 4;
/// A holder EC2 said was not terminated is not asked about again for this long.
const ALIVE_FOR: Duration = Duration::from_secs(10);
/// The first window of the full-jitter wait after a lost race, before the re-read (doubling
/// with each race lost in a row, at most [`CONFLICT_CAP`]).
pub(super) const CONFLICT_BACKOFF: Duration = Duration::from_millis(50);
pub(super) const CONFLICT_CAP: Duration = Duration::from_secs(1);
/// One attempt in this many, while deferred, reads the group in full instead of the item
/// alone ([`SlotBudget::item_full`]).
const FULL_READ_EVERY: u32 = 4;
/// Decisions in one attempt: reserve, commit, act, removals of terminated holders, re-reads.
const MAX_STEPS: u32 = 16;

/// The slot table protocol, with EC2 for its terminated holders.
pub struct SlotBudget {
    c: Common,
    table: SlotTable,
    ec2: Ec2,
    /// The reservations this gpu-medic has seen in the table, by its own monotonic clock.
    seen: Mutex<slots::Seen>,
    /// When this gpu-medic last read the table with rule 1 (an attempt): the sweep skips a
    /// period that had one.
    swept: Mutex<Option<Instant>>,
    /// Why the last check for terminated holders failed (for the next deferral's reason).
    ec2_note: Mutex<Option<String>>,
    /// Fleet incidents: the group's fleet document beside its slot item.
    gate: super::fleet_gate::FleetGate,
    /// Holders EC2 said were not terminated, and when (by the monotonic clock).
    alive: Mutex<std::collections::BTreeMap<String, Instant>>,
}

impl SlotBudget {
    pub(crate) fn new(sdk: &SdkConfig, table: &str, c: Common) -> Self {
        let slots = SlotTable::new(aws_sdk_dynamodb::Client::new(sdk), table);
        SlotBudget {
            gate: super::fleet_gate::FleetGate::new(sdk, &c.cfg, slots.clone(), c.clock.clone()),
            c,
            table: slots,
            ec2: Ec2::new(sdk),
            seen: Mutex::new(slots::Seen::default()),
            swept: Mutex::new(None),
            ec2_note: Mutex::new(None),
            alive: Mutex::new(std::collections::BTreeMap::new()),
        }
    }

    /// The monotonic clock (tokio's, through the clock handed in).
    fn instant(&self) -> Instant {
        self.c.clock.instant().into_std()
    }

    /// Marks the container instance with the slot it drains under (an operator sees who holds
    /// what); the text for the order's detail. A failed mark does not stop the drain (the
    /// slot is held in the table either way): it is said in the detail.
    async fn note_slot(&self, calls: &mut Calls, here: Here<'_>, slot: &Slot) -> String {
        let Slot::Table { group, token } = slot else {
            return String::new();
        };
        let id = here.id;
        let table = self.table.table.as_str();
        let value = format!("{group}/{token}");
        let attr = self.c.slot_attr();
        match here
            .ecs
            .put_attribute(calls, &id.container_instance_arn, &attr, Some(&value))
            .await
        {
            Ok(()) => format!("; fleet slot {value} committed in table {table} ({attr}={value})"),
            Err(e) => {
                tracing::warn!(instance_id = %id.instance_id, "cannot mark the container instance with its slot: {e}");
                format!("; fleet slot {value} committed in table {table} ({attr} not set: {e})")
            }
        }
    }

    /// Reserve -> commit in the slot table, then the caller acts: the committed entry's group
    /// and token. Deferred when the budget is full or the table cannot be used.
    async fn table_slot(
        &self,
        calls: &mut Calls,
        here: Here<'_>,
        first: FirstReads,
        order: &Order,
    ) -> Result<Slot, RemedyError> {
        let fleet = &self.c.cfg.fleet;
        let table = &self.table;
        let me = here.id.instance_id.as_str();
        let Some(group) = here.id.auto_scaling_group.as_deref() else {
            return Err(self.c.defer(format!(
                "{me} is in no Auto Scaling group: the slot table {} keeps one budget per group, so this instance holds no slot and must not drain; staying quarantined (no drain, no replacement)",
                table.table
            )));
        };
        calls.entries.extend(first.calls.entries);
        // Auto Scaling: the kill switches, the budget, and who is terminated.
        let g = match first.group {
            Some(Ok(g)) => g,
            Some(Err(e)) => return Err(std::mem::take(calls).fail(e)),
            None => self
                .c
                .asg
                .group(calls, group)
                .await
                .map_err(|e| std::mem::take(calls).fail(e))?,
        };
        let asg_view = group_only(&g, &fleet.pause_tag);
        let g_desired = g.desired;
        if let Some(d) = asg_view.kill_switch() {
            return Err(self.c.defer(d.to_string()));
        }
        let item = match first.item {
            Some(Ok(item)) => {
                self.observe(group, &item);
                item
            }
            Some(Err(e)) => return Err(self.table_unusable(&e)),
            None => self.read_item(calls, group).await?,
        };
        let terminated = self
            .terminated_holders(calls, &item, me, Some(&asg_view))
            .await;
        if let Ok(mut s) = self.swept.lock() {
            *s = Some(self.instant());
        }
        let stamp = Stamp {
            incident: Some(order.incident.to_string()),
            since: humantime::format_rfc3339_seconds(
                std::time::UNIX_EPOCH + Duration::from_millis(self.c.clock.now_ms()),
            )
            .to_string(),
        };
        // A deferral at the whole budget is a deferral at any smaller one: the group's
        // container instances are described only when a slot may be had.
        let seen = self.seen_now();
        let at_most = Facts {
            me,
            phase: Phase::Wants,
            budget: asg_view.budget(fleet),
            terminated: &terminated,
            seen: &seen,
            now: self.instant(),
            reservation_lifetime: fleet.reservation_lifetime,
            stamp: &stamp,
        };
        if let Decision::Defer(why) = slots::decide(&item, &at_most) {
            return Err(self.c.defer(self.with_ec2_note(why)));
        }
        let (view, outside) = self.group_view(calls, here, g, first.arns, &item).await?;
        let budget = view.budget(fleet).saturating_sub(outside);
        let steps = Steps {
            me,
            group,
            members: g_desired,
            budget,
            stamp: &stamp,
            view: &view,
        };
        self.reserve_and_commit(calls, steps, item, terminated)
            .await
            .map(|token| Slot::Table {
                group: group.to_string(),
                token,
            })
    }

    /// The group as ECS and Auto Scaling show it, kept for `gpu-medic status`, and how many
    /// instances out of service hold no slot in the table (they count against the budget).
    async fn group_view(
        &self,
        calls: &mut Calls,
        here: Here<'_>,
        g: crate::aws::asg::GroupState,
        arns: Option<Result<Vec<String>, crate::aws::calls::CallError>>,
        item: &SlotItem,
    ) -> Result<(GroupView, u32), RemedyError> {
        let fleet = &self.c.cfg.fleet;
        let me = here.id.instance_id.as_str();
        let arns = match arns {
            Some(a) => a,
            None => here.ecs.list_instances(calls).await,
        };
        let view = match arns {
            Ok(arns) => self.c.view(calls, here, Some(g), arns).await,
            Err(e) => Err(e),
        };
        let view = match view {
            Ok((v, _)) => v,
            Err(e) => return Err(std::mem::take(calls).fail(e)),
        };
        let now = self.c.clock.now_ms();
        self.c.record_fleet(&view.summary(now, fleet));
        let mut outside = 0;
        if !item.holders.contains_key(me) {
            let holders: BTreeSet<String> = item.holders.keys().cloned().collect();
            outside = match view.admit_table(me, &holders, now, fleet) {
                Ok(n) => n,
                Err(d) => return Err(self.c.defer(d.to_string())),
            };
        }
        Ok((view, outside))
    }

    /// The decisions of one attempt from the item read: reserve, commit, removals of
    /// terminated holders, re-reads after a lost race; the committed token.
    async fn reserve_and_commit(
        &self,
        calls: &mut Calls,
        st: Steps<'_>,
        mut item: SlotItem,
        mut terminated: BTreeSet<String>,
    ) -> Result<u64, RemedyError> {
        let (me, group, table) = (st.me, st.group, &self.table);
        let mut conflicts = 0;
        for _ in 0..MAX_STEPS {
            let seen = self.seen_now();
            let facts = Facts {
                me,
                phase: Phase::Wants,
                budget: st.budget,
                terminated: &terminated,
                seen: &seen,
                now: self.instant(),
                reservation_lifetime: self.c.cfg.fleet.reservation_lifetime,
                stamp: st.stamp,
            };
            match slots::decide(&item, &facts) {
                Decision::Act { token } => {
                    tracing::info!(
                        instance_id = me,
                        group,
                        token,
                        "fleet budget: slot committed in the slot table"
                    );
                    return Ok(token);
                }
                Decision::Defer(why) => return Err(self.c.defer(self.with_ec2_note(why))),
                Decision::Nothing => {
                    return Err(self.c.defer(format!(
                        "slot table {}: nothing to do for an instance that wants a slot (item version {}); retrying",
                        table.table, item.version
                    )));
                }
                Decision::Write {
                    kind,
                    item: mut new,
                } => {
                    new.members = Some(st.members);
                    match table.write(calls, group, &item, &new).await {
                        Ok(()) => {
                            log_write(&kind, me, group, new.version);
                            item = new;
                            self.observe(group, &item);
                        }
                        Err(TableError::Conflict) => {
                            conflicts += 1;
                            if conflicts > MAX_CONFLICTS {
                                return Err(self.c.defer(format!(
                                    "slot table {}: {conflicts} writes in a row lost the race for group {group}'s item; retrying later",
                                    table.table
                                )));
                            }
                            // Of the writers that read one version one wins; the others
                            // spread their re-reads instead of meeting again at once.
                            tokio::time::sleep(crate::sys::backoff::full_jitter(
                                CONFLICT_BACKOFF,
                                conflicts - 1,
                                CONFLICT_CAP,
                            ))
                            .await;
                            item = self.read_item(calls, group).await?;
                            if item
                                .holders
                                .keys()
                                .any(|h| h != me && !terminated.contains(h))
                            {
                                terminated = self
                                    .terminated_holders(calls, &item, me, Some(st.view))
                                    .await;
                            }
                        }
                        Err(e) => return Err(self.table_unusable(&e)),
                    }
                }
            }
        }
        Err(self.c.defer(format!(
            "slot table {}: no decision for group {group} after {MAX_STEPS} steps; retrying",
            table.table
        )))
    }

    /// The precheck: a deferral when the group's item alone shows the budget full (other
    /// holders at least `max_parallel` of the group size the item records, ours not among
    /// them), read with one consistent GetItem. Every [`FULL_READ_EVERY`]th attempt in a row
    /// skips it and reads the group in full (a terminated holder removed, a grown group's
    /// budget seen), and so does any attempt the item cannot settle (no item, no size, ours
    /// in it, a read that failed: the full attempt says why).
    async fn item_full(&self, id: &Identity) -> Option<RemedyError> {
        let group = id.auto_scaling_group.as_deref()?;
        let deferred = self.c.deferrals.load(std::sync::atomic::Ordering::Relaxed);
        if deferred % FULL_READ_EVERY == FULL_READ_EVERY - 1 {
            return None;
        }
        let mut calls = Calls::new();
        let item = self.table.read(&mut calls, group).await.ok()?;
        self.observe(group, &item);
        if !item.exists || item.holders.contains_key(&id.instance_id) {
            return None;
        }
        let budget = self.c.cfg.fleet.max_parallel.of(item.members?).max(1);
        let held = u32::try_from(item.holders.len()).unwrap_or(u32::MAX);
        (held >= budget).then(|| {
            self.c.defer(format!(
                "{} (group {group} of {} as the table records it; only the table was read)",
                slots::full(&item, budget),
                item.members.unwrap_or_default()
            ))
        })
    }

    /// Removes our entry (remediation over: restored). The text for the order's detail.
    async fn release_table_slot(
        &self,
        calls: &mut Calls,
        id: &Identity,
    ) -> Result<String, RemedyError> {
        let table = &self.table;
        let me = id.instance_id.as_str();
        let Some(group) = id.auto_scaling_group.as_deref() else {
            return Ok(String::new());
        };
        let fail = |e: &TableError| RemedyError::Retryable {
            message: format!(
                "slot table {}: {e}; our entry is not released yet (restore retried)",
                table.table
            ),
            request_ids: Vec::new(),
        };
        let none = BTreeSet::new();
        let stamp = Stamp::default();
        for _ in 0..=MAX_CONFLICTS {
            let item = table.read(calls, group).await.map_err(|e| fail(&e))?;
            self.observe(group, &item);
            let seen = self.seen_now();
            let facts = Facts {
                me,
                phase: Phase::Done,
                budget: item.budget.unwrap_or(1),
                terminated: &none,
                seen: &seen,
                now: self.instant(),
                reservation_lifetime: self.c.cfg.fleet.reservation_lifetime,
                stamp: &stamp,
            };
            let token = item.holders.get(me).map(|h| h.token);
            match slots::decide(&item, &facts) {
                Decision::Write { kind, item: new } => {
                    match table.write(calls, group, &item, &new).await {
                        Ok(()) => {
                            log_write(&kind, me, group, new.version);
                            self.observe(group, &new);
                            return Ok(format!(
                                "; fleet slot {group}/{} released in table {}",
                                token.unwrap_or_default(),
                                table.table
                            ));
                        }
                        Err(TableError::Conflict) => continue,
                        Err(e) => return Err(fail(&e)),
                    }
                }
                _ => return Ok(format!("; no fleet slot of ours in table {}", table.table)),
            }
        }
        Err(fail(&TableError::Conflict))
    }

    /// Rule 1 on its own, every `retry_after x ceil(members / SWEEPS_PER_PERIOD)` (drawn from
    /// half to one and a half times that) until `shutdown`, `members` being the group size the
    /// item records: entries held by terminated instances are removed even when no instance
    /// of the group wants a slot. A sweep that finds no other holder has nothing to do, and
    /// the next waits twice as long, up to [`MAX_SWEEP_PERIOD`] (a group at rest costs a few
    /// reads an hour, not one per instance per `retry_after`: docs/fleet-scale.md); a holder
    /// seen brings the pace back. Only with `[fleet] table` and an Auto Scaling group;
    /// failures are logged and retried.
    async fn sweep(&self, who: &dyn Whoami, shutdown: CancellationToken) {
        // The group's size as the item last recorded it: the whole group sweeps about
        // SWEEPS_PER_PERIOD times per retry_after, whatever its size.
        let mut members: u32 = 1;
        let mut idle: u32 = 0;
        loop {
            let period = crate::sys::backoff::spread(idle_sweep_period(
                sweep_period(self.c.cfg.fleet.retry_after, members),
                idle,
            ));
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(period) => {}
            }
            // An attempt of ours ran rule 1 on a fresh read within two retry periods (an
            // attempt is retried after retry_after jittered up to 1.5x, plus its own calls): a
            // deferred instance's attempts stand in for the sweep.
            let longest = self.c.cfg.fleet.retry_after.saturating_mul(2);
            let recent = self
                .swept
                .lock()
                .ok()
                .and_then(|s| *s)
                .is_some_and(|t| self.instant().saturating_duration_since(t) < longest);
            if recent {
                idle = 0;
                continue;
            }
            match self.sweep_once(who).await {
                Ok((m, others)) => {
                    members = m.unwrap_or(members);
                    idle = if others { 0 } else { idle.saturating_add(1) };
                }
                Err(why) => {
                    tracing::warn!(
                        "fleet slot table: removal of terminated holders not done: {why}"
                    );
                }
            }
        }
    }

    /// One pass of rule 1: the group size the item records (for pacing), when it has one,
    /// and whether another instance held an entry.
    async fn sweep_once(&self, who: &dyn Whoami) -> Result<(Option<u32>, bool), String> {
        let table = &self.table;
        let Some(id) = who.whoami().await else {
            tracing::debug!("fleet slot table: no identity yet");
            return Ok((None, true));
        };
        let Some(group) = id.auto_scaling_group.as_deref() else {
            return Ok((None, false));
        };
        let me = id.instance_id.as_str();
        let mut calls = Calls::new();
        for _ in 0..=MAX_CONFLICTS {
            let item = table
                .read(&mut calls, group)
                .await
                .map_err(|e| e.to_string())?;
            self.observe(group, &item);
            let members = item.members;
            if !item.holders.keys().any(|h| h != me) {
                return Ok((members, false));
            }
            let terminated = self.terminated_holders(&mut calls, &item, me, None).await;
            let Some((gone, holders)) = slots::remove_terminated(&item, me, &terminated) else {
                return Ok((members, true));
            };
            let new = SlotItem {
                version: item.version.saturating_add(1),
                exists: true,
                holders,
                budget: item.budget,
                updated_by: Some(me.to_string()),
                members: item.members,
            };
            match table.write(&mut calls, group, &item, &new).await {
                Ok(()) => {
                    log_write(&WriteKind::RemoveTerminated(gone), me, group, new.version);
                    self.observe(group, &new);
                }
                Err(TableError::Conflict) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok((None, true))
    }

    /// A consistent read of the group's item, taken in (reservations seen, status); a failure
    /// defers the order.
    async fn read_item(&self, calls: &mut Calls, group: &str) -> Result<SlotItem, RemedyError> {
        match self.table.read(calls, group).await {
            Ok(item) => {
                self.observe(group, &item);
                Ok(item)
            }
            Err(e) => Err(self.table_unusable(&e)),
        }
    }

    /// No drain without the table: the order is deferred with the reason.
    fn table_unusable(&self, e: &TableError) -> RemedyError {
        let table = &self.table;
        let hint = if e.is_retryable() {
            ""
        } else {
            " (check [fleet] table, the table's key schema `group` (String) and the IAM policy: dynamodb:GetItem and dynamodb:PutItem on the table)"
        };
        self.c.defer(format!(
            "fleet slot table {}: {e}{hint}; no drain without the table: staying quarantined, retrying later",
            table.table
        ))
    }

    /// The holders other than `me` whose instances are terminated: EC2 `terminated` or
    /// unknown, or `Terminated` in the group's view. An EC2 failure removes nobody (logged).
    async fn terminated_holders(
        &self,
        calls: &mut Calls,
        item: &SlotItem,
        me: &str,
        view: Option<&GroupView>,
    ) -> BTreeSet<String> {
        let others: Vec<String> = item
            .holders
            .keys()
            .filter(|h| h.as_str() != me)
            .cloned()
            .collect();
        if others.is_empty() {
            if let Ok(mut n) = self.ec2_note.lock() {
                *n = None;
            }
            return BTreeSet::new();
        }
        let mut out: BTreeSet<String> = view
            .map(|v| {
                v.members
                    .iter()
                    .filter(|m| m.lifecycle.as_deref() == Some("Terminated"))
                    .filter(|m| others.contains(&m.instance_id))
                    .map(|m| m.instance_id.clone())
                    .collect()
            })
            .unwrap_or_default();
        // Holders EC2 said were running a moment ago are not asked again (a burst of
        // instances racing for the item re-reads it after every lost race: issue 51 measured
        // 1,413 DescribeInstances for 30 claims at N = 100). Asking later only delays the
        // removal of a terminated holder, never makes it wrong.
        let now = self.instant();
        let ask: Vec<String> = match self.alive.lock() {
            Ok(alive) => others
                .iter()
                .filter(|h| {
                    alive
                        .get(*h)
                        .is_none_or(|t| now.saturating_duration_since(*t) >= ALIVE_FOR)
                })
                .cloned()
                .collect(),
            Err(_) => others.clone(),
        };
        if ask.is_empty() {
            return out;
        }
        let note = match self.ec2.terminated(calls, &ask).await {
            Ok(t) => {
                if let Ok(mut alive) = self.alive.lock() {
                    alive.retain(|h, _| others.contains(h));
                    for h in ask.iter().filter(|h| !t.contains(*h)) {
                        alive.insert(h.clone(), now);
                    }
                }
                out.extend(t);
                None
            }
            Err(e) => {
                tracing::warn!(
                    "fleet slot table: cannot tell whether holders {others:?} are terminated: {e}"
                );
                Some(format!(
                    "cannot tell whether holders {} are terminated (EC2 DescribeInstances: {e}{}), so none is removed",
                    others.join(", "),
                    if e.retryable {
                        ""
                    } else {
                        "; check the IAM policy: ec2:DescribeInstances"
                    }
                ))
            }
        };
        if let Ok(mut n) = self.ec2_note.lock() {
            *n = note;
        }
        out
    }

    /// A deferral's reason, with why terminated holders could not be removed (a missing
    /// permission would otherwise keep a gone instance's slot, silently).
    fn with_ec2_note(&self, why: String) -> String {
        match self.ec2_note.lock().ok().and_then(|n| n.clone()) {
            Some(note) => format!("{why}; {note}"),
            None => why,
        }
    }

    fn seen_now(&self) -> slots::Seen {
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Takes in a read or a write of ours: the reservations seen, and what status shows.
    fn observe(&self, group: &str, item: &SlotItem) {
        if let Ok(mut s) = self.seen.lock() {
            s.observe(item, self.instant());
        }
        let summary = SlotsSummary {
            observed_at: Timestamp(self.c.clock.now_ms()),
            table: self.table.table.clone(),
            group: group.to_string(),
            version: item.version,
            budget: item.budget,
            holders: item.holders.clone(),
        };
        self.c
            .cfg
            .files()
            .save_view(crate::config::View::Slots, &summary);
    }
}

impl FleetBudget for SlotBudget {
    fn take_view(&self) -> Option<crate::model::FleetBudgetView> {
        self.c.take_view()
    }

    /// Auto Scaling's group, the group's item and the cluster's container instances, at once
    /// (nothing for an instance in no group: it holds no slot).
    fn first_reads<'a>(
        &'a self,
        id: &'a Identity,
        ecs: &'a crate::aws::ecs::Ecs,
    ) -> BoxFuture<'a, FirstReads> {
        Box::pin(async move {
            let Some(group) = id.auto_scaling_group.as_deref() else {
                return FirstReads::default();
            };
            let mut c = Calls::new();
            let (mut first, item) = tokio::join!(
                self.c.group_and_arns(id, ecs),
                self.table.read(&mut c, group)
            );
            first.calls.entries.extend(c.entries);
            first.item = Some(item);
            first
        })
    }

    fn precheck<'a>(&'a self, id: &'a Identity) -> BoxFuture<'a, Option<RemedyError>> {
        Box::pin(self.item_full(id))
    }

    fn fleet_gate<'a>(
        &'a self,
        id: &'a Identity,
        signal: &'a str,
    ) -> BoxFuture<'a, Option<(Option<String>, RemedyError)>> {
        Box::pin(self.gate.check(id, signal, |m| self.c.defer(m)))
    }

    fn task_pattern<'a>(&'a self, id: &'a Identity, definition: &'a str) -> BoxFuture<'a, ()> {
        Box::pin(async move {
            self.gate.task(id, definition).await;
        })
    }

    fn held_attr(&self) -> String {
        self.c.held_attr()
    }

    fn acquire<'a>(
        &'a self,
        calls: &'a mut Calls,
        here: Here<'a>,
        first: FirstReads,
        order: &'a Order,
    ) -> BoxFuture<'a, Result<Slot, RemedyError>> {
        Box::pin(async move {
            let slot = self.table_slot(calls, here, first, order).await;
            self.c.settled(&slot);
            slot
        })
    }

    fn note<'a>(
        &'a self,
        calls: &'a mut Calls,
        here: Here<'a>,
        slot: &'a Slot,
    ) -> BoxFuture<'a, String> {
        Box::pin(self.note_slot(calls, here, slot))
    }

    /// The table's entry first (once it is gone another instance may drain), then the marks.
    fn release<'a>(
        &'a self,
        calls: &'a mut Calls,
        here: Here<'a>,
    ) -> BoxFuture<'a, Result<Released, RemedyError>> {
        Box::pin(async move {
            let note = self.release_table_slot(calls, here.id).await?;
            match self.c.clear_marks(calls, here).await {
                Ok(marks) => Ok(Released { marks, note }),
                Err(e) => Err(std::mem::take(calls).fail(e)),
            }
        })
    }

    fn upkeep<'a>(&'a self, who: &'a dyn Whoami, shutdown: CancellationToken) -> BoxFuture<'a, ()> {
        Box::pin(self.sweep(who, shutdown))
    }
}

fn log_write(kind: &WriteKind, me: &str, group: &str, version: u64) {
    match kind {
        WriteKind::RemoveTerminated(h) => {
            tracing::warn!(instance_id = me, group, version, holder = %h, "fleet slot table: removed the entry of a terminated instance")
        }
        WriteKind::Release => tracing::info!(
            instance_id = me,
            group,
            version,
            "fleet slot table: our entry released"
        ),
        WriteKind::Commit => tracing::info!(
            instance_id = me,
            group,
            version,
            "fleet slot table: committed"
        ),
        WriteKind::Reserve => tracing::info!(
            instance_id = me,
            group,
            version,
            "fleet slot table: reserved"
        ),
        WriteKind::TakeOver(h) => {
            tracing::warn!(instance_id = me, group, version, holder = %h, "fleet slot table: took over a reservation unchanged for its lifetime")
        }
    }
}
/// How long one gpu-medic waits between sweeps in a group of `members` instances: the group
/// as a whole sweeps about [`SWEEPS_PER_PERIOD`] times per `retry_after`.
fn sweep_period(retry_after: Duration, members: u32) -> Duration {
    retry_after
        .saturating_mul(members.div_ceil(SWEEPS_PER_PERIOD).max(1))
        .min(MAX_SWEEP_PERIOD.max(retry_after))
}

/// The wait after `idle` sweeps in a row found no other holder: `base` doubled with each, at
/// most [`MAX_SWEEP_PERIOD`] (or `base`, when that is longer).
fn idle_sweep_period(base: Duration, idle: u32) -> Duration {
    base.saturating_mul(1 << idle.min(16))
        .min(MAX_SWEEP_PERIOD.max(base))
}

/// The longest wait between two sweeps of one instance: `members` is a number read from the
/// table (any writer's), and a group of billions must not stop the sweep for centuries. Past
/// about 1,800 instances at the default `retry_after` the group sweeps more often than
/// [`SWEEPS_PER_PERIOD`].
const MAX_SWEEP_PERIOD: Duration = Duration::from_secs(6 * 3600);

#[cfg(test)]
mod tests {
    use super::*;

    /// A group at rest (nobody holds a slot) sweeps less and less: at the default
    /// retry_after one instance's sweeps are 6 h apart after 9 idle ones, and any holder seen
    /// brings back the base pace.
    #[test]
    fn a_group_at_rest_sweeps_less_and_less() {
        let r = Duration::from_secs(60);
        assert_eq!(idle_sweep_period(r, 0), r);
        assert_eq!(idle_sweep_period(r, 3), r * 8);
        assert_eq!(idle_sweep_period(r, 9), MAX_SWEEP_PERIOD);
        assert_eq!(idle_sweep_period(r, u32::MAX), MAX_SWEEP_PERIOD);
        let long = Duration::from_secs(7 * 3600);
        assert_eq!(idle_sweep_period(long, 5), long);
    }

    #[test]
    fn the_group_sweeps_about_five_times_per_retry_after_whatever_its_size() {
        let r = Duration::from_secs(60);
        assert_eq!(sweep_period(r, 0), r);
        assert_eq!(sweep_period(r, 3), r);
        assert_eq!(sweep_period(r, 10), r * 2);
        for n in [10u32, 100, 1000] {
            let sweeps_per_period =
                f64::from(n) * r.as_secs_f64() / sweep_period(r, n).as_secs_f64();
            assert!(
                (4.0..=5.0).contains(&sweeps_per_period),
                "{n}: {sweeps_per_period}"
            );
        }
        assert_eq!(
            sweep_period(r, 5000),
            MAX_SWEEP_PERIOD,
            "past 1,800: the cap"
        );
        assert_eq!(sweep_period(r, u32::MAX), MAX_SWEEP_PERIOD);
        let long = Duration::from_secs(7 * 3600);
        assert_eq!(sweep_period(long, u32::MAX), long);
    }
}
