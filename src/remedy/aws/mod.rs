//! The control plane's hands: `AwsControlPlane` carries out quarantine, stop-tasks, drain,
//! replace and complete-lifecycle orders through ECS and Auto Scaling
//! (docs/aws.md), behind the fleet budget (`fleet.rs`).
//!
//! Every step is idempotent and reconciles from what ECS and Auto Scaling say rather than from
//! memory, so an order handed over again after a crash resumes where the last one stopped: an
//! instance already DRAINING keeps its slot and skips the claim and the drain call; one
//! already Unhealthy is not marked again. Each order's `Done` or error lists the calls made
//! with their request ids (drain polls excepted: they would flood the journal).
//!
//! With `[fleet] table` the budget's slot comes from the DynamoDB slot table instead of a
//! claim (`table.rs` carries it out, `slots.rs` decides); without it, from the claim protocol.
//!
//! The SDK, the ECS and Auto Scaling wrappers and identity discovery are adapters in
//! [`crate::aws`]; this module decides nothing the engine did not order.

pub mod drain;
pub mod fleet;
pub mod slots;
mod table;
pub use table::slots_path;
pub mod terminate;

use std::time::Duration;

use aws_config::SdkConfig;
use aws_sdk_ecs::config::SharedHttpClient;
use tokio::sync::OnceCell;
use tokio::time::Instant;

use self::drain::{DrainPlan, DrainTimes, Next, Reading, StopKind, TaskView};
use self::fleet::{FleetView, KILL_SWITCH_PROCESSES, Member, claim_fresh};
use super::{BoxFuture, ControlPlane, Done, RemedyError};
use crate::aws::asg::Asg;
use crate::aws::calls::{CallError, Calls};
use crate::aws::ecs::{Ecs, EcsStatus, InstanceState};
use crate::aws::identity::{self, Identity};
use crate::aws::imds::TargetState;
use crate::aws::{http_client, loader};
use crate::config::Config;
use crate::model::{Command, LifecycleHook, LifecycleResult, Order, Timestamp};

/// ECS and Auto Scaling, for this instance.
pub struct AwsControlPlane {
    cfg: Config,
    ecs: aws_sdk_ecs::Client,
    asg: Asg,
    http: SharedHttpClient,
    identity: OnceCell<Identity>,
    /// The lifecycle watcher's last reading (a termination that begins mid-drain).
    target_state: TargetState,
    /// The incident export, flushed before the instance goes away (none: export is off).
    flush: Option<crate::export::Flush>,
    /// The fleet budget's slot table (`[fleet] table`), and EC2 for its terminated holders.
    slots: Option<crate::aws::dynamo::SlotTable>,
    ec2: crate::aws::ec2::Ec2,
    /// The reservations this gpu-medic has seen in the table, by its own monotonic clock.
    seen: std::sync::Mutex<slots::Seen>,
    /// When this gpu-medic last read the table with rule 1 (an attempt): the sweep skips a
    /// period that had one.
    swept: std::sync::Mutex<Option<std::time::Instant>>,
    /// Why the last check for terminated holders failed (for the next deferral's reason).
    ec2_note: std::sync::Mutex<Option<String>>,
}

/// A remedy's view of a finished or failed series of AWS calls: the outcome carries every
/// request id the calls left.
pub trait CallsExt {
    /// The remedy's error for a failed call, carrying every request id so far.
    fn fail(self, err: CallError) -> RemedyError;
    fn fatal(self, message: impl Into<String>) -> RemedyError;
    fn done(self, detail: impl Into<String>) -> Done;
}

impl CallsExt for Calls {
    fn fail(self, err: CallError) -> RemedyError {
        let message = err.to_string();
        if err.retryable {
            RemedyError::Retryable {
                message,
                request_ids: self.entries,
            }
        } else {
            RemedyError::Fatal {
                message,
                request_ids: self.entries,
            }
        }
    }

    fn fatal(self, message: impl Into<String>) -> RemedyError {
        RemedyError::Fatal {
            message: message.into(),
            request_ids: self.entries,
        }
    }

    fn done(self, detail: impl Into<String>) -> Done {
        Done {
            detail: detail.into(),
            request_ids: self.entries,
        }
    }
}

impl AwsControlPlane {
    /// Loads the SDK configuration from the environment and `[aws]`. Identity discovery waits
    /// for the first order (the ECS agent may not be up yet at boot).
    pub async fn from_config(cfg: &Config) -> Self {
        let sdk = loader(&cfg.aws).load().await;
        AwsControlPlane::new(&sdk, cfg)
    }

    pub fn new(sdk: &SdkConfig, cfg: &Config) -> Self {
        AwsControlPlane {
            cfg: cfg.clone(),
            ecs: aws_sdk_ecs::Client::new(sdk),
            asg: Asg::new(aws_sdk_autoscaling::Client::new(sdk)),
            http: sdk.http_client().unwrap_or_else(http_client),
            identity: OnceCell::new(),
            target_state: TargetState::new(),
            flush: None,
            slots: cfg.fleet.table.as_ref().map(|t| {
                crate::aws::dynamo::SlotTable::new(aws_sdk_dynamodb::Client::new(sdk), t.clone())
            }),
            ec2: crate::aws::ec2::Ec2::new(aws_sdk_ec2::Client::new(sdk)),
            seen: std::sync::Mutex::new(slots::Seen::default()),
            swept: std::sync::Mutex::new(None),
            ec2_note: std::sync::Mutex::new(None),
        }
    }

    /// Flushes the incident export before completing the terminate hook or marking the
    /// instance Unhealthy (shared with the exporter).
    pub fn with_flush(mut self, flush: crate::export::Flush) -> Self {
        self.flush = Some(flush);
        self
    }

    /// Delivers the journal before the instance goes away, waiting `[export] flush_wait` at
    /// most; what happened, for the order's detail (nothing when export is off).
    async fn flush_export(&self, before: &str) -> String {
        let Some(f) = &self.flush else {
            return String::new();
        };
        let r = f.flush(self.cfg.export.flush_wait).await;
        if r.complete {
            tracing::info!("before {before}: {r}");
        } else {
            tracing::warn!("before {before}: {r}");
        }
        format!("; before {before}: {r}")
    }

    /// Reads the lifecycle watcher's readings from `seen` (shared with the lifecycle probe).
    pub fn with_target_state(mut self, seen: TargetState) -> Self {
        self.target_state = seen;
        self
    }

    /// This instance's identity, discovered once (a failure is retried by the next order).
    pub async fn identity(&self) -> Result<&Identity, RemedyError> {
        self.identity
            .get_or_try_init(|| async {
                let mut calls = Calls::new();
                identity::discover(
                    &self.cfg,
                    self.http.clone(),
                    &self.ecs,
                    &self.asg,
                    &mut calls,
                )
                .await
                .map_err(|e| {
                    let message = format!("identity discovery: {e}");
                    if e.is_retryable() {
                        RemedyError::Retryable {
                            message,
                            request_ids: calls.entries,
                        }
                    } else {
                        RemedyError::Fatal {
                            message,
                            request_ids: calls.entries,
                        }
                    }
                })
            })
            .await
    }

    fn ecs_for(&self, id: &Identity) -> Ecs {
        Ecs::new(self.ecs.clone(), id.cluster.clone())
    }

    fn prefix(&self) -> &str {
        &self.cfg.ecs.attribute_prefix
    }

    fn health_attr(&self) -> String {
        format!("{}.health", self.prefix())
    }

    /// A deferral with jitter, so a fleet of waiting instances does not re-read in lockstep.
    fn defer(&self, message: String) -> RemedyError {
        tracing::info!("{message}");
        RemedyError::Deferred {
            message,
            retry_after: jittered(self.cfg.fleet.retry_after),
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
        }
    }

    /// The group as the fleet rule sees it: the Auto Scaling group's instances joined with
    /// their container instances (or, outside any group, the cluster's instances).
    async fn fleet_view(
        &self,
        calls: &mut Calls,
        id: &Identity,
        ecs: &Ecs,
    ) -> Result<FleetView, CallError> {
        let group = match &id.auto_scaling_group {
            Some(g) => Some(self.asg.group(calls, g).await?),
            None => None,
        };
        self.fleet_view_of(calls, id, ecs, group).await
    }

    /// The same, with the Auto Scaling group already read.
    async fn fleet_view_of(
        &self,
        calls: &mut Calls,
        id: &Identity,
        ecs: &Ecs,
        group: Option<crate::aws::asg::GroupState>,
    ) -> Result<FleetView, CallError> {
        let arns = ecs.list_instances(calls).await?;
        let states = ecs.describe(calls, &arns, false).await?;
        let Some(g) = group else {
            let members: Vec<Member> = states.iter().map(|s| self.member(s)).collect();
            return Ok(FleetView {
                group: format!("cluster {}", id.cluster),
                desired: members.len() as u32,
                members,
                ..FleetView::default()
            });
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
        Ok(view)
    }

    /// Takes a slot in the fleet budget for this instance, or explains why not (Deferred).
    /// Returns the claim's time. An instance that already holds a slot (DRAINING, Unhealthy,
    /// or a live claim from before a restart) keeps it without a new claim.
    /// Keeps what the fleet gate saw for `gpu-medic status` (best effort: status only).
    fn record_fleet(&self, summary: &fleet::FleetSummary) {
        let path = fleet_path(&self.cfg.state_dir);
        // Atomic only: a status file, rewritten at the next admission.
        let written =
            crate::sys::fs::write_json_atomic(&path, summary, crate::sys::fs::Durability::Atomic);
        if let Err(e) = written {
            tracing::debug!(path = %path.display(), "cannot keep the fleet view: {e}");
        }
    }

    /// A slot of the fleet budget for this instance's drain or replacement, from the slot
    /// table when `[fleet] table` is set, else from the claim protocol; or why not (Deferred).
    async fn acquire_slot(
        &self,
        calls: &mut Calls,
        id: &Identity,
        ecs: &Ecs,
        order: &Order,
    ) -> Result<Slot, RemedyError> {
        if let Some(table) = &self.slots {
            let (group, token) = self.table_slot(calls, id, ecs, table, order).await?;
            return Ok(Slot::Table { group, token });
        }
        Ok(match self.acquire_claim(calls, id, ecs).await? {
            Some(ms) => Slot::Claim(ms),
            None => Slot::None,
        })
    }

    async fn acquire_claim(
        &self,
        calls: &mut Calls,
        id: &Identity,
        ecs: &Ecs,
    ) -> Result<Option<u64>, RemedyError> {
        let fleet = &self.cfg.fleet;
        let me = id.instance_id.as_str();
        let view = match self.fleet_view(calls, id, ecs).await {
            Ok(v) => v,
            Err(e) => return Err(std::mem::take(calls).fail(e)),
        };
        let now = now_ms();
        self.record_fleet(&view.summary(now, fleet));
        if let Some(d) = view.kill_switch() {
            return Err(self.defer(d.to_string()));
        }
        let mine = ecs
            .describe_one(calls, &id.container_instance_arn, true)
            .await
            .map_err(|e| std::mem::take(calls).fail(e))?;
        let own_claim = mine.claim(self.prefix());
        if view.holds_slot(me, now, fleet) {
            match &own_claim {
                Some((name, ms)) if mine.status == EcsStatus::Active => {
                    let (name, ms) = (name.clone(), *ms);
                    // A claim from before a restart. Not yet acted on: settle again and rank
                    // it anew (others may not have seen it yet), unless it is too old to
                    // finish, in which case it is withdrawn and made anew below.
                    if claim_fresh(ms, now, fleet) {
                        return self.settle_and_rank(calls, id, ecs, &name, ms).await;
                    }
                    tracing::info!(instance_id = me, claim = %name, "fleet budget: our claim from before a restart is too old to finish; claiming anew");
                }
                Some((_, ms)) => return Ok(Some(*ms)),
                None => return Ok(None),
            }
        }
        if let Some((name, _)) = own_claim {
            // Expired or too old: it no longer counts; remove it before claiming anew.
            let _ = ecs
                .delete_attribute(calls, &id.container_instance_arn, &name)
                .await;
        }
        if let Err(d) = view.admit(me, now, fleet) {
            return Err(self.defer(d.to_string()));
        }
        let claim_ms = now_ms();
        let claim = format!("{}.claim.{claim_ms}", self.prefix());
        if let Err(e) = ecs
            .put_attribute(calls, &id.container_instance_arn, &claim, None)
            .await
        {
            return Err(std::mem::take(calls).fail(e));
        }
        self.settle_and_rank(calls, id, ecs, &claim, claim_ms).await
    }

    /// Waits `claim_settle` for our claim to become visible, re-reads the group and ranks the
    /// claim; withdraws it when outranked, or when it is too old to finish by the time the
    /// ranking is done (checked just before acting). The caller acts at once.
    async fn settle_and_rank(
        &self,
        calls: &mut Calls,
        id: &Identity,
        ecs: &Ecs,
        claim: &str,
        claim_ms: u64,
    ) -> Result<Option<u64>, RemedyError> {
        let fleet = &self.cfg.fleet;
        let me = id.instance_id.as_str();
        tokio::time::sleep(fleet.claim_settle).await;
        let view = match self.fleet_view(calls, id, ecs).await {
            Ok(v) => v,
            Err(e) => return Err(std::mem::take(calls).fail(e)),
        };
        let now = now_ms();
        let verdict = view
            .rank(me, claim_ms, now, fleet)
            .map_err(|d| d.to_string())
            .and_then(|()| {
                claim_fresh(claim_ms, now, fleet).then_some(()).ok_or_else(|| {
                    format!("our claim {claim} is too old to act on safely (the settle and re-read took too long); withdrawn, claiming anew")
                })
            });
        if let Err(why) = verdict {
            let _ = ecs
                .delete_attribute(calls, &id.container_instance_arn, claim)
                .await;
            return Err(self.defer(why));
        }
        tracing::info!(instance_id = me, claim = %claim, "fleet budget: slot taken");
        Ok(Some(claim_ms))
    }

    async fn do_quarantine(&self, order: &Order) -> Result<Done, RemedyError> {
        let id = self.identity().await?;
        let ecs = self.ecs_for(id);
        let mut calls = Calls::new();
        let attr = self.health_attr();
        match ecs
            .put_attribute(&mut calls, &id.container_instance_arn, &attr, Some("faulted"))
            .await
        {
            Ok(()) => Ok(calls.done(format!(
                "{attr}=faulted on {} (incident {}): placements with memberOf \"attribute:{attr} != faulted\" avoid it",
                id.container_instance_arn, order.incident
            ))),
            Err(e) => Err(calls.fail(e)),
        }
    }

    async fn do_stop_tasks(&self, order: &Order) -> Result<Done, RemedyError> {
        let Command::StopTasks { gpu, pids, tasks } = &order.command else {
            return Err(RemedyError::fatal("internal: not a stop-tasks order"));
        };
        let id = self.identity().await?;
        let ecs = self.ecs_for(id);
        let mut calls = Calls::new();
        let targets: Vec<String> = if !tasks.is_empty() {
            tasks.clone()
        } else {
            match ecs
                .running_tasks(&mut calls, &id.container_instance_arn, false)
                .await
            {
                Ok(running) => running
                    .iter()
                    .filter(|t| t.uses_gpu(gpu.index, &gpu.uuid))
                    .map(|t| t.arn.clone())
                    .collect(),
                Err(e) => return Err(calls.fail(e)),
            }
        };
        if targets.is_empty() {
            if pids.is_empty() {
                return Ok(calls.done(format!("no ECS task holds {gpu}; nothing to stop")));
            }
            return Err(calls.fatal(format!(
                "no ECS task found for pids {pids:?} on {gpu} (no task ids, no matching gpuIds)"
            )));
        }
        let reason = format!(
            "gpu-medic: fault on {gpu} (incident {}), stopping its tasks so MPS can recover",
            order.incident
        );
        for t in &targets {
            if let Err(e) = ecs.stop_task(&mut calls, t, &reason).await {
                return Err(calls.fail(e));
            }
        }
        let ids: Vec<&str> = targets
            .iter()
            .map(|t| t.rsplit('/').next().unwrap_or(t))
            .collect();
        Ok(calls.done(format!(
            "stopped {} task(s) on {gpu}: {}",
            targets.len(),
            ids.join(", ")
        )))
    }

    /// Undoes quarantine and drain: ACTIVE again, `<prefix>.health=ok`, claim released.
    async fn do_restore(&self, order: &Order) -> Result<Done, RemedyError> {
        let id = self.identity().await?;
        let ecs = self.ecs_for(id);
        let mut calls = Calls::new();
        let arn = &id.container_instance_arn;
        let me = match ecs.describe_one(&mut calls, arn, false).await {
            Ok(m) => m,
            Err(e) => return Err(calls.fail(e)),
        };
        if me.status == EcsStatus::Draining
            && let Err(e) = ecs.set_active(&mut calls, arn).await
        {
            return Err(calls.fail(e));
        }
        let attr = self.health_attr();
        if let Err(e) = ecs.put_attribute(&mut calls, arn, &attr, Some("ok")).await {
            return Err(calls.fail(e));
        }
        // The slot table's entry first: once it is gone another instance may drain.
        let table = match &self.slots {
            Some(t) => self.release_table_slot(&mut calls, id, t).await?,
            None => String::new(),
        };
        let mut released = 0;
        let head = format!("{}.claim.", self.prefix());
        let slot_attr = self.slot_attr();
        let claims: Vec<String> = me
            .attributes
            .iter()
            .filter(|(n, _)| n.starts_with(&head) || *n == slot_attr)
            .map(|(n, _)| n.clone())
            .collect();
        for name in claims {
            match ecs.delete_attribute(&mut calls, arn, &name).await {
                Ok(()) => released += 1,
                Err(e) => return Err(calls.fail(e)),
            }
        }
        Ok(calls.done(format!(
            "{arn} was {}, now ACTIVE with {attr}=ok (incident {}); {released} fleet-budget claim(s) released{table}",
            me.status, order.incident
        )))
    }

    async fn do_drain(&self, order: &Order) -> Result<Done, RemedyError> {
        let id = self.identity().await?;
        let ecs = self.ecs_for(id);
        let mut calls = Calls::new();
        let arn = &id.container_instance_arn;
        let me = match ecs.describe_one(&mut calls, arn, false).await {
            Ok(m) => m,
            Err(e) => return Err(calls.fail(e)),
        };
        let order_says = matches!(order.command, Command::Drain { terminating: true });
        let term = self.termination(&mut calls, id, order_says).await;
        let mut slot_note = String::new();
        let (started_ms, resumed) = match &me.status {
            EcsStatus::Draining => (me.claim(self.prefix()).map(|(_, ms)| ms), true),
            EcsStatus::Active => {
                // An instance Auto Scaling is terminating leaves anyway: its drain takes no
                // budget slot and no kill switch holds it.
                let slot = match term {
                    Some(_) => Slot::None,
                    None => self.acquire_slot(&mut calls, id, &ecs, order).await?,
                };
                let ranked = Instant::now();
                if let Err(e) = ecs.set_draining(&mut calls, arn).await {
                    return Err(calls.fail(e));
                }
                // After the drain call, off its critical path (the slot is held in the table).
                slot_note = self.note_slot(&mut calls, id, &ecs, &slot).await;
                let settle = self.cfg.fleet.claim_settle;
                let claim = match slot {
                    Slot::Claim(ms) => Some(ms),
                    Slot::Table { .. } => Some(now_ms()),
                    Slot::None => None,
                };
                if matches!(slot, Slot::Claim(_)) && ranked.elapsed() > settle / 2 {
                    // The claim protocol assumes the re-read and the drain are close together
                    // (README, "The fleet budget: which protocol"): a slow DrainContainerInstances call eats
                    // into the margin another instance's view relies on.
                    tracing::warn!(
                        container_instance = %arn,
                        took_ms = ranked.elapsed().as_millis() as u64,
                        "fleet budget: from the claim's ranking to DRAINING took longer than half the claim settle ({}); the claim protocol's margin is thin",
                        humantime::format_duration(settle)
                    );
                }
                tracing::warn!(container_instance = %arn, incident_id = order.incident.0, "container instance set to DRAINING");
                (claim, false)
            }
            other => {
                return Ok(calls.done(format!("container instance is {other}; nothing to drain")));
            }
        };
        self.drain_with_heartbeats(
            term,
            calls,
            order,
            &ecs,
            id,
            started_ms.unwrap_or_else(now_ms),
            resumed,
        )
        .await
        .map(|mut d| {
            d.detail.push_str(&slot_note);
            d
        })
    }

    /// Waits for the instance to run no task, stopping standalone tasks after the grace and
    /// everything left `force_stop_lead` before the deadline; returns just before the deadline.
    async fn wait_drained(
        &self,
        mut calls: Calls,
        order: &Order,
        ecs: &Ecs,
        arn: &str,
        started_ms: u64,
        resumed: bool,
    ) -> Result<Done, RemedyError> {
        let e = &self.cfg.ecs;
        let t0 = Instant::now();
        let mut plan = DrainPlan::new(
            DrainTimes {
                standalone_grace: e.standalone_grace,
                force_stop_lead: e.force_stop_lead,
                agent_disconnected_wait: e.agent_disconnected_wait,
                poll_interval: e.drain_poll_interval,
            },
            order.deadline.since(Timestamp::now()),
            Duration::from_millis(now_ms().saturating_sub(started_ms)),
            resumed,
        );
        let reason = |kind: StopKind| match kind {
            StopKind::Standalone => format!(
                "gpu-medic: instance draining (incident {}); standalone task stopped after the grace",
                order.incident
            ),
            StopKind::Forced => format!(
                "gpu-medic: drain deadline reached (incident {}); stopping what is left",
                order.incident
            ),
        };
        loop {
            let poll = async {
                let me = ecs.describe_one(&mut calls, arn, true).await?;
                let tasks = ecs.running_tasks(&mut calls, arn, true).await?;
                Ok::<_, CallError>((me, tasks))
            }
            .await;
            let at = t0.elapsed();
            match poll {
                Err(err) if err.retryable => {
                    tracing::warn!(container_instance = %arn, "drain poll failed, will retry: {err}");
                    if let Some(why) = plan.poll_failed(at) {
                        return Err(calls.fatal(why));
                    }
                }
                Err(err) => return Err(calls.fail(err)),
                Ok((me, tasks)) => {
                    let reading = Reading {
                        status: me.status,
                        running: me.running,
                        pending: me.pending,
                        agent_connected: me.agent_connected,
                        tasks: tasks
                            .iter()
                            .map(|t| TaskView {
                                arn: t.arn.clone(),
                                id: t.id().to_string(),
                                service: t.is_service(),
                            })
                            .collect(),
                    };
                    match plan.observe(at, &reading) {
                        Next::Drained(detail) => return Ok(calls.done(detail)),
                        Next::GiveUp(why) => return Err(calls.fatal(why)),
                        Next::Act { stop, deadline } => {
                            for (task, kind) in stop {
                                match ecs.stop_task(&mut calls, &task, &reason(kind)).await {
                                    Ok(()) => plan.stopped(&task, kind, true),
                                    Err(err) if err.retryable => plan.stopped(&task, kind, false),
                                    Err(err) => return Err(calls.fail(err)),
                                }
                            }
                            if let Some(why) = deadline {
                                return Err(calls.fatal(why));
                            }
                        }
                    }
                }
            }
            tokio::time::sleep_until(t0 + plan.next_poll(t0.elapsed())).await;
        }
    }

    async fn do_replace(&self, order: &Order) -> Result<Done, RemedyError> {
        let id = self.identity().await?;
        let Some(group) = id.auto_scaling_group.clone() else {
            return Err(RemedyError::fatal(format!(
                "{} is in no Auto Scaling group: nothing can replace it",
                id.instance_id
            )));
        };
        let ecs = self.ecs_for(id);
        let mut calls = Calls::new();
        let me = match self.asg.instance(&mut calls, &id.instance_id).await {
            Ok(Some((_, i))) => i,
            Ok(None) => {
                return Ok(calls.done(format!(
                    "{} is no longer in {group}; nothing to replace",
                    id.instance_id
                )));
            }
            Err(e) => return Err(calls.fail(e)),
        };
        let already = me.health.as_deref() == Some("Unhealthy");
        let mut flushed = String::new();
        if already {
            tracing::info!(instance_id = %id.instance_id, "already Unhealthy in Auto Scaling; not marking again");
        } else {
            // Kill switches and, for an instance that holds no slot yet, the budget.
            let slot = self.acquire_slot(&mut calls, id, &ecs, order).await?;
            flushed = self.note_slot(&mut calls, id, &ecs, &slot).await;
            flushed.push_str(&self.flush_export("marking it Unhealthy").await);
            if let Err(e) = self.asg.set_unhealthy(&mut calls, &id.instance_id).await {
                return Err(calls.fail(e));
            }
            tracing::warn!(instance_id = %id.instance_id, auto_scaling_group = %group, incident_id = order.incident.0, "instance marked Unhealthy");
        }
        let mut detail = format!(
            "{}{} marked Unhealthy in {group} (grace period skipped); Auto Scaling replaces it, desired capacity unchanged",
            if already { "already " } else { "" },
            id.instance_id
        );
        detail.push_str(&flushed);
        if self.cfg.aws.replace_fallback_terminate {
            detail = self
                .fallback_terminate(&mut calls, order, id, detail)
                .await?;
        }
        Ok(calls.done(detail))
    }

    /// The flagged fallback: if Auto Scaling has not started terminating the instance within
    /// `replace_fallback_after` (bounded by the deadline), terminate it, keeping capacity.
    async fn fallback_terminate(
        &self,
        calls: &mut Calls,
        order: &Order,
        id: &Identity,
        detail: String,
    ) -> Result<String, RemedyError> {
        let remaining = order.deadline.since(Timestamp::now());
        let margin = (remaining / 10).min(Duration::from_secs(5));
        let wait = self
            .cfg
            .aws
            .replace_fallback_after
            .min(remaining.saturating_sub(margin));
        let until = Instant::now() + wait;
        loop {
            match self.asg.instance(calls, &id.instance_id).await {
                Ok(None) => return Ok(format!("{detail}; it has left the group")),
                Ok(Some((_, i)))
                    if i.lifecycle
                        .as_deref()
                        .is_some_and(|l| l.starts_with("Terminat")) =>
                {
                    return Ok(format!("{detail}; Auto Scaling is terminating it"));
                }
                Ok(Some(_)) => {}
                Err(e) if e.retryable => {}
                Err(e) => return Err(std::mem::take(calls).fail(e)),
            }
            if Instant::now() >= until {
                break;
            }
            let next = (Instant::now() + self.cfg.ecs.drain_poll_interval).min(until);
            tokio::time::sleep_until(next).await;
        }
        match self
            .asg
            .terminate_keep_capacity(calls, &id.instance_id)
            .await
        {
            Ok(()) => Ok(format!(
                "{detail}; not replaced within {}, so terminated through Auto Scaling (replace_fallback_terminate, desired capacity kept)",
                humantime::format_duration(wait)
            )),
            Err(e) => Err(std::mem::take(calls).fail(e)),
        }
    }

    async fn do_complete_lifecycle(
        &self,
        hook: LifecycleHook,
        result: LifecycleResult,
    ) -> Result<Done, RemedyError> {
        let id = self.identity().await?;
        let Some(group) = id.auto_scaling_group.as_deref() else {
            return Err(RemedyError::fatal(format!(
                "{} is in no Auto Scaling group: no lifecycle hook to complete",
                id.instance_id
            )));
        };
        let name = match hook {
            LifecycleHook::Terminate => &self.cfg.lifecycle.terminate_hook,
            LifecycleHook::Launch => &self.cfg.lifecycle.launch_hook,
        };
        let r = match result {
            LifecycleResult::Continue => "CONTINUE",
            LifecycleResult::Abandon => "ABANDON",
        };
        let flushed = match hook {
            LifecycleHook::Terminate => self.flush_export("completing the terminate hook").await,
            LifecycleHook::Launch => String::new(),
        };
        let mut calls = Calls::new();
        match self
            .asg
            .complete_lifecycle(&mut calls, group, name, &id.instance_id, result)
            .await
        {
            Ok(true) => {
                Ok(calls.done(format!("lifecycle hook {name} completed with {r}{flushed}")))
            }
            Ok(false) => Ok(calls.done(format!(
                "no active lifecycle action for hook {name}: already completed or timed out"
            ))),
            Err(e) => Err(calls.fail(e)),
        }
    }
}

impl ControlPlane for AwsControlPlane {
    fn quarantine(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.do_quarantine(&order).await })
    }

    fn stop_tasks(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.do_stop_tasks(&order).await })
    }

    fn drain(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.do_drain(&order).await })
    }

    fn replace(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.do_replace(&order).await })
    }

    fn restore(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.do_restore(&order).await })
    }

    fn complete_lifecycle(
        &self,
        _order: &Order,
        hook: LifecycleHook,
        result: LifecycleResult,
    ) -> BoxFuture<'_, Result<Done, RemedyError>> {
        Box::pin(async move { self.do_complete_lifecycle(hook, result).await })
    }
}

/// The group as Auto Scaling alone shows it: its kill switches, desired capacity and members'
/// lifecycle and health (no ECS state yet).
fn group_only(g: &crate::aws::asg::GroupState, pause_tag: &str) -> FleetView {
    FleetView {
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

/// The budget slot a drain or replacement goes ahead with.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Slot {
    /// None needed: Auto Scaling is terminating the instance anyway.
    None,
    /// The claim protocol's claim (its time, unix ms).
    Claim(u64),
    /// The slot table's committed entry: its group and fencing token.
    Table { group: String, token: u64 },
}

/// Where the last fleet view is kept.
pub fn fleet_path(state_dir: &std::path::Path) -> std::path::PathBuf {
    state_dir.join("fleet.json")
}

fn now_ms() -> u64 {
    Timestamp::now().0
}

/// `d` scaled by a factor in [0.5, 1.5), from the clock's nanoseconds (no RNG needed for this).
fn jittered(d: Duration) -> Duration {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|t| t.subsec_nanos())
        .unwrap_or(0);
    d.mul_f64(0.5 + f64::from(n % 1000) / 1000.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_call_keeps_every_request_id_and_its_class() {
        let mut c = Calls::new();
        c.record("PutAttributes", Some("r-1"));
        c.record("StopTask", None);
        let RemedyError::Retryable { request_ids, .. } = c
            .clone()
            .fail(CallError::transient("StopTask", "slow down"))
        else {
            panic!("transient errors are retryable")
        };
        assert_eq!(request_ids.len(), 2);
        let RemedyError::Fatal { request_ids, .. } =
            c.fail(CallError::terminal("StopTask", "no such task"))
        else {
            panic!("terminal errors are fatal")
        };
        assert_eq!(request_ids.len(), 2);
    }
}
