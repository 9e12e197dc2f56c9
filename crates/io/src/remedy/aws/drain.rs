//! The drain, a workflow of its own: the order's first reads go out together (our container
//! instance; the fleet budget's group, item and cluster reads, or, for a termination, our
//! lifecycle hook); the budget's slot; DRAINING; then polls of the container instance handed
//! to the pure [`DrainPlan`] until no task is left or the deadline nears. While Auto Scaling
//! terminates the instance, our terminate hook is heartbeated (`lifecycle_hook.rs`) and the
//! drain is bounded by the hook's global timeout, so the hook is completed by us (CONTINUE)
//! before Auto Scaling gives up on it.
//!
//! The order says whether the engine knew of the termination when it gave it (the fact
//! travels Observation -> engine -> Order). One that begins mid-drain is asked of the world
//! by the drain itself, beside its polls: IMDS's target lifecycle state every poll, Auto
//! Scaling's `Terminating:Wait` at once and then every 30 s. Nothing is shared with the
//! lifecycle probe.
//!
//! The plan's timing rules, driven in virtual time: what to do after each poll of the
//! container instance, given how long the drain has run. The workflow polls ECS, hands each
//! reading to [`DrainPlan::observe`], carries out the stops it asks for, reports each stop
//! back, and sleeps until [`DrainPlan::next_poll`]. No clock and no I/O in the plan, so every
//! rule is tested by stepping time, not by waiting.
//!
//! The rules (all times from the drain's start in this process):
//! - **drained**: no task listed and none running or pending: done.
//! - **restored**: the instance is ACTIVE again (an operator or `incidents abort`): stop.
//! - **standalone grace**: tasks not started by a service (ECS draining leaves them alone) are
//!   stopped once `standalone_grace` has passed since the drain began (counted from the claim's
//!   time when the drain resumes after a restart);
//! - **force-stop lead**: `force_stop_lead` before the deadline, everything left is stopped once
//!   (again after a retryable failure);
//! - **agent disconnected**: ECS cannot stop tasks on an instance whose agent is gone; after
//!   `agent_disconnected_wait` of that, the drain gives up;
//! - **deadline**: the drain returns a little before the order's deadline (a tenth of the time
//!   left, at most 5 s), so the engine hears the outcome before it escalates.

use std::collections::HashSet;
use std::time::Duration;

use super::Hands;
use super::lifecycle_hook::{Termination, asg_terminating, merge, start_heartbeat, termination_in};
use crate::aws::calls::{CallError, Calls};
use crate::aws::ecs::{Ecs, EcsStatus, InstanceState, TaskInfo};
use crate::aws::heartbeat::Heartbeat;
use crate::aws::identity::Identity;
use crate::aws::imds::{imds_client, target_terminated};
use crate::model::{Command, Order, Timestamp};
use crate::remedy::budget::{FirstReads, Here, Slot};
use crate::remedy::calls::CallsExt;
use crate::remedy::{Done, RemedyError};

/// The timing settings of a drain (`[ecs]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainTimes {
    pub standalone_grace: Duration,
    pub force_stop_lead: Duration,
    pub agent_disconnected_wait: Duration,
    pub poll_interval: Duration,
}

/// One task as the plan needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskView {
    pub arn: String,
    pub id: String,
    pub service: bool,
}

/// One reading of the container instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    pub status: EcsStatus,
    pub running: i32,
    pub pending: i32,
    pub agent_connected: bool,
    pub tasks: Vec<TaskView>,
}

/// Why a task is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopKind {
    /// A standalone task, after the grace.
    Standalone,
    /// Whatever was left at the force-stop lead.
    Forced,
}

/// What to do after a reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Stop these tasks (report each with [`DrainPlan::stopped`]), then, if `deadline` says so,
    /// end the drain as incomplete; otherwise poll again at [`DrainPlan::next_poll`].
    Act {
        stop: Vec<(String, StopKind)>,
        deadline: Option<String>,
    },
    /// The drain is over: nothing runs any more.
    Drained(String),
    /// The drain ends without finishing (restored, agent gone).
    GiveUp(String),
}

/// The drain's progress.
#[derive(Debug, Clone)]
pub struct DrainPlan {
    times: DrainTimes,
    grace_at: Duration,
    force_at: Duration,
    end: Duration,
    prefix: &'static str,
    stopped: HashSet<String>,
    forced: bool,
    disconnected_since: Option<Duration>,
    polls: u32,
    transient: u32,
    stopped_standalone: usize,
    stopped_forced: usize,
}

impl DrainPlan {
    /// `remaining`: the time left until the order's deadline; `since_start`: how long ago the
    /// drain began (zero for a new drain, the claim's age for a resumed one).
    pub fn new(
        times: DrainTimes,
        remaining: Duration,
        since_start: Duration,
        resumed: bool,
    ) -> DrainPlan {
        let margin = (remaining / 10).min(Duration::from_secs(5));
        DrainPlan {
            times,
            grace_at: times.standalone_grace.saturating_sub(since_start),
            force_at: remaining.saturating_sub(times.force_stop_lead.max(margin)),
            end: remaining.saturating_sub(margin),
            prefix: if resumed { "resumed drain: " } else { "" },
            stopped: HashSet::new(),
            forced: false,
            disconnected_since: None,
            polls: 0,
            transient: 0,
            stopped_standalone: 0,
            stopped_forced: 0,
        }
    }

    /// When the drain must have ended, from its start.
    pub fn end(&self) -> Duration {
        self.end
    }

    /// A poll that failed with a retryable error at `at`: `Some(message)` when the deadline
    /// has come (the drain ends incomplete).
    pub fn poll_failed(&mut self, at: Duration) -> Option<String> {
        self.polls = self.polls.saturating_add(1);
        self.transient = self.transient.saturating_add(1);
        (at >= self.end).then(|| {
            format!(
                "{}drain incomplete at the deadline: the instance could not be read ({} failed poll(s))",
                self.prefix, self.transient
            )
        })
    }

    /// The next step after reading the instance at `at`.
    pub fn observe(&mut self, at: Duration, r: &Reading) -> Next {
        self.polls = self.polls.saturating_add(1);
        let prefix = self.prefix;
        if r.status == EcsStatus::Active {
            return Next::GiveUp(format!(
                "{prefix}drain stopped: the container instance is ACTIVE again (an operator, or `gpu-medic incidents abort`, restored it)"
            ));
        }
        if r.tasks.is_empty() && r.running == 0 && r.pending == 0 {
            return Next::Drained(format!(
                "{prefix}drained: no task left; {} standalone task(s) stopped after the grace, {} stopped at the deadline; {} poll(s){}",
                self.stopped_standalone,
                self.stopped_forced,
                self.polls,
                if self.transient > 0 {
                    format!(", {} failed", self.transient)
                } else {
                    String::new()
                }
            ));
        }
        let left = r.tasks.len().max(usize::try_from(r.running).unwrap_or(0));
        if r.agent_connected {
            self.disconnected_since = None;
        } else {
            let since = *self.disconnected_since.get_or_insert(at);
            if at.saturating_sub(since) >= self.times.agent_disconnected_wait {
                return Next::GiveUp(format!(
                    "ECS agent disconnected for {}: ECS cannot stop the {left} task(s) left; giving up the drain",
                    humantime::format_duration(self.times.agent_disconnected_wait),
                ));
            }
        }
        let mut stop = Vec::new();
        if at >= self.grace_at {
            for t in r.tasks.iter().filter(|t| !t.service) {
                if self.stopped.insert(t.arn.clone()) {
                    stop.push((t.arn.clone(), StopKind::Standalone));
                }
            }
        }
        if at >= self.force_at && !self.forced {
            self.forced = true;
            for t in &r.tasks {
                if self.stopped.insert(t.arn.clone()) {
                    stop.push((t.arn.clone(), StopKind::Forced));
                }
            }
        }
        let deadline = (at >= self.end).then(|| {
            let ids: Vec<&str> = r.tasks.iter().map(|t| t.id.as_str()).collect();
            format!(
                "{prefix}drain incomplete at the deadline: {left} task(s) still running ({})",
                ids.join(", ")
            )
        });
        Next::Act { stop, deadline }
    }

    /// How a stop asked for by [`observe`](Self::observe) went. A retryable failure asks for
    /// the stop again at the next poll (and, for a forced stop, the force-stop round again).
    pub fn stopped(&mut self, arn: &str, kind: StopKind, ok: bool) {
        if ok {
            match kind {
                StopKind::Standalone => self.stopped_standalone += 1,
                StopKind::Forced => self.stopped_forced += 1,
            }
        } else {
            self.stopped.remove(arn);
            if kind == StopKind::Forced {
                self.forced = false;
            }
        }
    }

    /// When to poll next, from the drain's start, after a poll at `at`.
    pub fn next_poll(&self, at: Duration) -> Duration {
        at.saturating_add(self.times.poll_interval).min(self.end)
    }
}

/// How often a drain that is not (yet) for a termination re-asks Auto Scaling whether one has
/// begun (IMDS is asked on every drain poll).
const ASG_RECHECK: Duration = Duration::from_secs(30);

/// One drain order on this instance.
struct Drain<'a> {
    h: &'a Hands,
    id: &'a Identity,
    ecs: Ecs,
    order: Order,
}

/// Carries out a drain order: returns when drained, or just before the order's deadline.
pub(super) async fn run(h: &Hands, id: &Identity, order: Order) -> Result<Done, RemedyError> {
    let d = Drain {
        h,
        id,
        ecs: h.ecs_for(id),
        order,
    };
    d.run().await
}

impl Drain<'_> {
    async fn run(&self) -> Result<Done, RemedyError> {
        let (h, id) = (self.h, self.id);
        let arn = &id.container_instance_arn;
        // Auto Scaling is terminating the instance (the engine knew): its drain takes no
        // budget slot and no kill switch holds it.
        let terminating = matches!(self.order.command, Command::Drain { terminating: true });
        if !terminating && !self.order.planned {
            // A fleet incident of this fingerprint holds the drain for an operator; then a
            // budget full by its own record alone defers before anything else is read (a
            // waiting fleet reads the slot table only: docs/fleet-scale.md).
            if let Some(signal) = h.first_signal(self.order.incident) {
                match h.budget.fleet_gate(id, &signal).await {
                    Some((held_by, deferred)) => {
                        // Not yet sighted (a busy document) leaves the mark as it was.
                        if let Some(f) = held_by {
                            h.mark_held(id, &self.ecs, Some(&f)).await;
                        }
                        return Err(deferred);
                    }
                    None => h.mark_held(id, &self.ecs, None).await,
                }
            }
            if let Some(deferred) = h.budget.precheck(id).await {
                return Err(deferred);
            }
        }
        let mut calls = Calls::new();
        let mut hook_calls = Calls::new();
        let own = self.ecs.describe_one(&mut calls, arn, false);
        let hook = async {
            match id.auto_scaling_group.as_deref() {
                Some(g) if terminating => Some(termination_in(h, &mut hook_calls, g).await),
                _ => None,
            }
        };
        // Nor does a disruption AWS planned: AWS takes the instance out of service anyway
        // (docs/planned-events.md).
        let first = async {
            if terminating || self.order.planned {
                None
            } else {
                Some(h.budget.first_reads(id, &self.ecs).await)
            }
        };
        let (me, term, first) = tokio::join!(own, hook, first);
        let me = match me {
            Ok(m) => m,
            Err(e) => return Err(calls.fail(e)),
        };
        calls.entries.extend(hook_calls.entries);
        let mut slot_note = String::new();
        let (started_ms, resumed) = match &me.status {
            EcsStatus::Draining => {
                calls
                    .entries
                    .extend(first.map(FirstReads::into_calls).unwrap_or_default());
                (
                    me.claim(&h.cfg.ecs.attribute_prefix).map(|(_, ms)| ms),
                    true,
                )
            }
            EcsStatus::Active => {
                let (started, note) = self.begin(&mut calls, &me, first).await?;
                slot_note = note;
                (started, false)
            }
            other => {
                return Ok(calls.done(format!("container instance is {other}; nothing to drain")));
            }
        };
        let started_ms = started_ms.unwrap_or_else(|| h.clock.now_ms());
        self.with_heartbeats(term, calls, started_ms, resumed)
            .await
            .map(|mut d| {
                d.detail.push_str(&slot_note);
                d
            })
    }

    /// The budget's slot (none for a termination), then DRAINING, then the slot's mark:
    /// when the drain's clock starts (the claim's time), and the slot's line for the detail.
    async fn begin(
        &self,
        calls: &mut Calls,
        me: &InstanceState,
        first: Option<FirstReads>,
    ) -> Result<(Option<u64>, String), RemedyError> {
        let h = self.h;
        let arn = &self.id.container_instance_arn;
        let here = Here {
            id: self.id,
            ecs: &self.ecs,
            me: Some(me),
        };
        let slot = match first {
            None => Slot::None,
            Some(first) => h.budget.acquire(calls, here, first, &self.order).await?,
        };
        let ranked = h.clock.instant();
        if let Err(e) = self.ecs.set_draining(calls, arn).await {
            return Err(std::mem::take(calls).fail(e));
        }
        // After the drain call, off its critical path (the slot is held in the table).
        let note = h.budget.note(calls, here, &slot).await;
        let settle = h.cfg.fleet.claim_settle;
        let took = h.clock.instant().saturating_duration_since(ranked);
        if matches!(slot, Slot::Claim(_)) && took > settle / 2 {
            // The claim protocol assumes the re-read and the drain are close together
            // (docs/install.md, "The fleet budget: which protocol"): a slow DrainContainerInstances
            // call eats into the margin another instance's view relies on.
            tracing::warn!(
                container_instance = %arn,
                took_ms = took.as_millis() as u64,
                "fleet budget: from the claim's ranking to DRAINING took longer than half the claim settle ({}); the claim protocol's margin is thin",
                humantime::format_duration(settle)
            );
        }
        tracing::warn!(container_instance = %arn, incident_id = self.order.incident.0, "container instance set to DRAINING");
        let started = match slot {
            Slot::Claim(ms) => Some(ms),
            Slot::Table { .. } => Some(h.clock.now_ms()),
            Slot::None => None,
        };
        Ok((started, note))
    }

    /// Waits for the drain (`wait_drained`) and, while Auto Scaling terminates the instance,
    /// heartbeats our terminate hook. A termination known at the start also bounds the drain
    /// by the hook's global timeout (tasks still running are stopped before it); one that
    /// begins during the drain starts the heartbeats then, and the drain is cut short at the
    /// hook's global timeout.
    async fn with_heartbeats(
        &self,
        term: Option<Termination>,
        calls: Calls,
        started_ms: u64,
        resumed: bool,
    ) -> Result<Done, RemedyError> {
        let h = self.h;
        let mut hb = term.as_ref().and_then(|t| start_heartbeat(h, self.id, t));
        let mut deadline = self.order.deadline;
        if let Some(beat) = &hb {
            let cap = h.now().plus(beat.hook.budget());
            if cap < deadline {
                tracing::info!(lifecycle_hook = %beat.hook.name, "drain bounded by the hook's global timeout");
                deadline = cap;
            }
        }
        let drain = self.wait_drained(calls, deadline, started_ms, resumed);
        let result = if term.is_none() {
            tokio::pin!(drain);
            tokio::select! {
                r = &mut drain => r,
                why = self.watch_for_termination(&mut hb) => Err(RemedyError::fatal(why)),
            }
        } else {
            drain.await
        };
        match hb {
            Some(beat) => merge(result, beat.finish().await),
            None => result,
        }
    }

    /// Runs beside a drain that began without a termination: when one begins (IMDS, asked
    /// every drain poll, or Auto Scaling's `Terminating:Wait`, read at once and then every
    /// 30 s), starts the heartbeats, then returns (ending the drain) when the hook's global
    /// timeout nears.
    async fn watch_for_termination(&self, hb: &mut Option<Heartbeat>) -> String {
        let (h, id) = (self.h, self.id);
        let Some(group) = id.auto_scaling_group.clone() else {
            return std::future::pending().await;
        };
        let poll = h.cfg.ecs.drain_poll_interval;
        let imds = imds_client(h.http.clone(), 1);
        let mut last_asg_check: Option<tokio::time::Instant> = None;
        loop {
            let now = h.clock.instant();
            let asg_due =
                last_asg_check.is_none_or(|t| now.saturating_duration_since(t) >= ASG_RECHECK);
            if asg_due {
                last_asg_check = Some(now);
            }
            let by_imds = async {
                match tokio::time::timeout(poll, target_terminated(&imds)).await {
                    Ok(Ok(t)) => t,
                    Ok(Err(e)) => {
                        tracing::debug!("target lifecycle state not read: {e}");
                        false
                    }
                    Err(_) => false,
                }
            };
            let by_asg = async { asg_due && asg_terminating(h, id).await };
            let (by_imds, by_asg) = tokio::join!(by_imds, by_asg);
            if by_imds || by_asg {
                let mut calls = Calls::new();
                let t = termination_in(h, &mut calls, &group).await;
                tracing::warn!(instance_id = %id.instance_id, "Auto Scaling began terminating the instance during the drain");
                let Some(beat) = start_heartbeat(h, id, &t) else {
                    // No hook of ours to keep alive: the drain goes on to its own deadline.
                    return std::future::pending().await;
                };
                let until = beat.must_complete_by();
                let hook = beat.hook.clone();
                *hb = Some(beat);
                tokio::time::sleep_until(until).await;
                return format!(
                    "drain cut short: lifecycle hook {} reaches its global timeout ({}) soon",
                    hook.name,
                    humantime::format_duration(hook.global_timeout)
                );
            }
            tokio::time::sleep(poll).await;
        }
    }

    /// Waits for the instance to run no task, stopping standalone tasks after the grace and
    /// everything left `force_stop_lead` before the deadline; returns just before the deadline.
    async fn wait_drained(
        &self,
        mut calls: Calls,
        deadline: Timestamp,
        started_ms: u64,
        resumed: bool,
    ) -> Result<Done, RemedyError> {
        let (h, ecs) = (self.h, &self.ecs);
        let arn = &self.id.container_instance_arn;
        let e = &h.cfg.ecs;
        let t0 = h.clock.instant();
        let mut plan = DrainPlan::new(
            DrainTimes {
                standalone_grace: e.standalone_grace,
                force_stop_lead: e.force_stop_lead,
                agent_disconnected_wait: e.agent_disconnected_wait,
                poll_interval: e.drain_poll_interval,
            },
            deadline.since(h.now()),
            Duration::from_millis(h.clock.now_ms().saturating_sub(started_ms)),
            resumed,
        );
        loop {
            let poll = async {
                let me = ecs.describe_one(&mut calls, arn, true).await?;
                let tasks = ecs.running_tasks(&mut calls, arn, true).await?;
                Ok::<_, CallError>((me, tasks))
            }
            .await;
            let at = h.clock.instant().saturating_duration_since(t0);
            match poll {
                Err(err) if err.retryable => {
                    tracing::warn!(container_instance = %arn, "drain poll failed, will retry: {err}");
                    if let Some(why) = plan.poll_failed(at) {
                        return Err(calls.fatal(why));
                    }
                }
                Err(err) => return Err(calls.fail(err)),
                Ok((me, tasks)) => match plan.observe(at, &reading(&me, &tasks)) {
                    Next::Drained(detail) => return Ok(calls.done(detail)),
                    Next::GiveUp(why) => return Err(calls.fatal(why)),
                    Next::Act { stop, deadline } => {
                        self.stop(&mut calls, &mut plan, stop).await?;
                        if let Some(why) = deadline {
                            return Err(calls.fatal(why));
                        }
                    }
                },
            }
            let at = h.clock.instant().saturating_duration_since(t0);
            tokio::time::sleep_until(t0 + plan.next_poll(at)).await;
        }
    }

    /// Stops what the plan asks for and tells it how each stop went.
    async fn stop(
        &self,
        calls: &mut Calls,
        plan: &mut DrainPlan,
        stop: Vec<(String, StopKind)>,
    ) -> Result<(), RemedyError> {
        let incident = self.order.incident;
        for (task, kind) in stop {
            let reason = match kind {
                StopKind::Standalone => format!(
                    "gpu-medic: instance draining (incident {incident}); standalone task stopped after the grace"
                ),
                StopKind::Forced => format!(
                    "gpu-medic: drain deadline reached (incident {incident}); stopping what is left"
                ),
            };
            match self.ecs.stop_task(calls, &task, &reason).await {
                Ok(()) => plan.stopped(&task, kind, true),
                Err(err) if err.retryable => plan.stopped(&task, kind, false),
                Err(err) => return Err(std::mem::take(calls).fail(err)),
            }
        }
        Ok(())
    }
}

/// One poll as the plan reads it.
fn reading(me: &InstanceState, tasks: &[TaskInfo]) -> Reading {
    Reading {
        status: me.status.clone(),
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn times() -> DrainTimes {
        DrainTimes {
            standalone_grace: 60 * S,
            force_stop_lead: 30 * S,
            agent_disconnected_wait: 20 * S,
            poll_interval: 5 * S,
        }
    }

    fn task(n: u32, service: bool) -> TaskView {
        TaskView {
            arn: format!("arn:task/{n}"),
            id: n.to_string(),
            service,
        }
    }

    fn draining(tasks: Vec<TaskView>) -> Reading {
        Reading {
            status: EcsStatus::Draining,
            running: tasks.len() as i32,
            pending: 0,
            agent_connected: true,
            tasks,
        }
    }

    fn stops(n: &Next) -> Vec<(String, StopKind)> {
        match n {
            Next::Act { stop, .. } => stop.clone(),
            other => panic!("expected Act, got {other:?}"),
        }
    }

    #[test]
    fn standalone_tasks_wait_for_the_grace_and_services_for_the_force_lead() {
        // 600 s to the deadline: margin 5 s, force at 570 s, end at 595 s.
        let mut p = DrainPlan::new(times(), 600 * S, Duration::ZERO, false);
        let r = draining(vec![task(1, true), task(2, false)]);
        assert!(stops(&p.observe(59 * S, &r)).is_empty(), "within the grace");
        assert_eq!(
            stops(&p.observe(60 * S, &r)),
            [("arn:task/2".to_string(), StopKind::Standalone)]
        );
        p.stopped("arn:task/2", StopKind::Standalone, true);
        assert!(
            stops(&p.observe(65 * S, &r)).is_empty(),
            "stopped once only"
        );
        assert_eq!(
            stops(&p.observe(570 * S, &r)),
            [("arn:task/1".to_string(), StopKind::Forced)]
        );
        p.stopped("arn:task/1", StopKind::Forced, true);
        let Next::Act { deadline, .. } = p.observe(595 * S, &r) else {
            panic!()
        };
        assert!(deadline.unwrap().contains("incomplete at the deadline"));
        let Next::Drained(msg) = p.observe(596 * S, &draining(vec![])) else {
            panic!()
        };
        assert!(
            msg.contains("1 standalone task(s) stopped after the grace, 1 stopped at the deadline"),
            "{msg}"
        );
    }

    #[test]
    fn a_resumed_drain_counts_the_grace_from_its_first_start() {
        let mut p = DrainPlan::new(times(), 600 * S, 50 * S, true);
        let r = draining(vec![task(2, false)]);
        assert_eq!(
            stops(&p.observe(10 * S, &r)).len(),
            1,
            "50 s + 10 s = the grace"
        );
        let Next::Drained(msg) = p.observe(11 * S, &draining(vec![])) else {
            panic!()
        };
        assert!(msg.starts_with("resumed drain: "), "{msg}");
    }

    #[test]
    fn a_failed_stop_is_asked_for_again() {
        let mut p = DrainPlan::new(times(), 600 * S, Duration::ZERO, false);
        let r = draining(vec![task(1, true)]);
        assert_eq!(stops(&p.observe(570 * S, &r)).len(), 1);
        p.stopped("arn:task/1", StopKind::Forced, false);
        assert_eq!(stops(&p.observe(575 * S, &r)).len(), 1, "forced again");
    }

    #[test]
    fn a_disconnected_agent_ends_the_drain_after_its_wait_and_reconnecting_resets_it() {
        let mut p = DrainPlan::new(times(), 600 * S, Duration::ZERO, false);
        let mut r = draining(vec![task(1, true)]);
        r.agent_connected = false;
        assert!(matches!(p.observe(10 * S, &r), Next::Act { .. }));
        r.agent_connected = true;
        assert!(matches!(p.observe(25 * S, &r), Next::Act { .. }));
        r.agent_connected = false;
        assert!(matches!(p.observe(30 * S, &r), Next::Act { .. }));
        assert!(matches!(p.observe(49 * S, &r), Next::Act { .. }));
        let Next::GiveUp(msg) = p.observe(50 * S, &r) else {
            panic!()
        };
        assert!(msg.contains("ECS agent disconnected for 20s"), "{msg}");
    }

    #[test]
    fn an_instance_active_again_stops_the_drain() {
        let mut p = DrainPlan::new(times(), 600 * S, Duration::ZERO, false);
        let mut r = draining(vec![task(1, true)]);
        r.status = EcsStatus::Active;
        assert!(matches!(p.observe(S, &r), Next::GiveUp(m) if m.contains("ACTIVE again")));
    }

    #[test]
    fn failed_polls_end_at_the_deadline_and_polls_never_pass_it() {
        let mut p = DrainPlan::new(times(), 20 * S, Duration::ZERO, false);
        // 20 s left: margin 2 s, end at 18 s; the force lead (30 s) is already due.
        assert_eq!(p.end(), 18 * S);
        assert_eq!(p.next_poll(15 * S), 18 * S);
        assert_eq!(p.poll_failed(10 * S), None);
        let msg = p.poll_failed(18 * S).unwrap();
        assert!(msg.contains("2 failed poll(s)"), "{msg}");
        let r = draining(vec![task(1, true)]);
        assert_eq!(stops(&p.observe(S, &r)).len(), 1, "forced at once");
    }

    #[test]
    fn no_time_left_is_no_panic() {
        let mut p = DrainPlan::new(times(), Duration::ZERO, Duration::MAX, false);
        assert_eq!(p.end(), Duration::ZERO);
        let r = draining(vec![task(1, false)]);
        let Next::Act { stop, deadline } = p.observe(Duration::ZERO, &r) else {
            panic!()
        };
        assert_eq!(stop.len(), 1);
        assert!(deadline.is_some());
        assert_eq!(p.next_poll(Duration::MAX), Duration::ZERO);
    }
}
