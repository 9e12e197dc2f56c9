//! The launch gate (`gpu-medic check --lifecycle`): a new instance waits in `Pending:Wait` on
//! our launch hook until its GPUs are proven, so a node with a dead GPU, fatal XIDs since
//! boot, bad ECC/remap state or no MPS daemon is handed back to Auto Scaling instead of
//! taking tasks (docs/aws.md).
//!
//! 1. Who: the instance id (IMDSv2 or `[identity]`), its group (DescribeAutoScalingInstances),
//!    our hook `[lifecycle] launch_hook` (DescribeLifecycleHooks). A first heartbeat tells
//!    whether an action is waiting; without one (no hook, already in service) the check still
//!    runs and marks the container instance, but no lifecycle call is made.
//! 2. The check (`examine`, the same as `gpu-medic check`, judged by `engine::check`),
//!    heartbeating the hook every third of its heartbeat timeout. "Could not tell" is retried every `check_retry_delay` until
//!    `check_deadline`.
//! 3. The decision:
//!    - healthy: CONTINUE, `<prefix>.health=ok`;
//!    - unhealthy: ABANDON (Auto Scaling terminates it and launches another), recorded on the
//!      group's `gpu-medic/abandoned-launches` tag (unix seconds, the last 20);
//!    - unhealthy with `abandon_limit` abandons already within `abandon_window`: the
//!      launch-failure breaker. CONTINUE with `<prefix>.health=faulted` instead, and an error
//!      in the log, so a bad AMI or driver rollout cannot burn capacity in an
//!      abandon/relaunch loop;
//!    - could not tell: `on_unknown = "continue"` (default) CONTINUEs with
//!      `<prefix>.health=pending`: in service, but no GPU placement under the
//!      `== ok` constraint until a later `check --lifecycle` passes; `"abandon"` treats it as
//!      unhealthy (breaker included);
//!    - with `[fleet] table`, every unhealthy launch is also recorded in the group's fleet
//!      document under its AMI, and the breaker's trip opens ONE fleet incident for that AMI
//!      (a bad image; paged once, shown by `gpu-medic fleet status`, docs/fleet-scale.md).
//! 4. The attribute is set before a quarantined CONTINUE (and after a healthy one) when the
//!    ECS agent has registered the instance; if it has not, the report says so (register the
//!    agent with `ECS_INSTANCE_ATTRIBUTES`, packaging/LIFECYCLE.md).
//!
//! Exit codes: 0 continued healthy; 1 abandoned or quarantined (pending included); 2 the hook
//! could not be completed (or the instance could not be identified). The last report is kept
//! in `<state_dir>/launch-gate.json`.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use tokio::time::Instant;

use crate::aws::asg::{Asg, HookInfo};
use crate::aws::calls::{CallError, Calls};
use crate::aws::ecs::Ecs;
use crate::aws::heartbeat::{Heartbeat, HeartbeatLog};
use crate::aws::identity;
use crate::config::{Config, OnUnknown};
use crate::model::{Health, LifecycleResult};

/// The group tag holding recent abandoned launches (unix seconds, space separated).
pub const ABANDON_TAG: &str = "gpu-medic/abandoned-launches";
/// At most this many timestamps are kept (an Auto Scaling tag value holds 256 characters).
const MAX_TAG_ENTRIES: usize = 20;

/// What the gate decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Decision {
    /// CONTINUE, `health=ok`.
    Continue,
    /// CONTINUE, `health=pending`: the check could not tell.
    ContinuePending,
    /// CONTINUE, `health=faulted`: unhealthy, but the launch-failure breaker is tripped (or no
    /// action was waiting to be abandoned).
    Quarantine,
    /// ABANDON, `health=faulted`.
    Abandon,
}

impl Decision {
    fn health_value(self) -> &'static str {
        match self {
            Decision::Continue => "ok",
            Decision::ContinuePending => "pending",
            Decision::Quarantine | Decision::Abandon => "faulted",
        }
    }

    fn result(self) -> LifecycleResult {
        match self {
            Decision::Abandon => LifecycleResult::Abandon,
            _ => LifecycleResult::Continue,
        }
    }
}

/// The launch-failure breaker, as read from the group's tag.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Breaker {
    /// Abandoned launches within the window (before this one).
    pub recent: usize,
    pub limit: u32,
    pub window: String,
    pub tripped: bool,
}

/// What the gate did, printed by `check --lifecycle` and kept in `launch-gate.json`.
#[derive(Debug, Serialize)]
pub struct LaunchReport<T> {
    pub health: Health,
    pub decision: Decision,
    /// `CONTINUE` or `ABANDON` when a waiting action was completed (or found completed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub result: Option<&'static str>,
    pub hook: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_scaling_group: Option<String>,
    /// `<prefix>.health=<value>` when it was set on the container instance.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attribute: Option<String>,
    pub attempts: u32,
    pub heartbeats: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub breaker: Option<Breaker>,
    /// The bad-image fleet incident of this instance's AMI, when one is open (`[fleet]
    /// table`): its id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fleet_incident: Option<String>,
    pub notes: Vec<String>,
    pub request_ids: Vec<String>,
    pub exit_code: i32,
    /// The last check's full report.
    pub check: Option<T>,
}

/// Why the gate could not do its part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GateError {
    #[error("cannot tell which instance this is: {0}")]
    Identity(String),
    #[error(transparent)]
    Call(#[from] CallError),
}

/// Runs the gate. `examine` is the (blocking) GPU check; it is run on a blocking thread and
/// may be called again while the verdict is "could not tell".
pub async fn gate<T, F>(cfg: &Config, examine: F) -> LaunchReport<T>
where
    T: Send + 'static,
    F: FnMut() -> (Health, T) + Send + 'static,
{
    let mut g = Gate {
        cfg,
        sdk: None,
        asg: None,
        ecs: None,
        calls: Calls::new(),
        notes: Vec::new(),
    };
    g.run(examine).await
}

struct Gate<'a> {
    cfg: &'a Config,
    sdk: Option<aws_config::SdkConfig>,
    asg: Option<Asg>,
    ecs: Option<aws_sdk_ecs::Client>,
    calls: Calls,
    notes: Vec<String>,
}

/// Who the gate acts for.
struct Me {
    instance_id: String,
    group: Option<String>,
    /// Our hook, when the group has it and an action is waiting on it (or may be: the first
    /// heartbeat failed for another reason).
    hook: Option<HookInfo>,
}

impl Gate<'_> {
    fn note(&mut self, text: impl Into<String>) {
        let text = text.into();
        tracing::info!("launch gate: {text}");
        self.notes.push(text);
    }

    /// Runs the GPU check, again after `[lifecycle] check_retry_delay` while it cannot tell,
    /// until `deadline`: its health, its report (none when the check panicked) and how many
    /// times it ran.
    async fn check_until_known<T, F>(
        &mut self,
        mut examine: F,
        deadline: Instant,
    ) -> (Health, Option<T>, u32)
    where
        T: Send + 'static,
        F: FnMut() -> (Health, T) + Send + 'static,
    {
        let cfg = self.cfg;
        let lc = &cfg.lifecycle;
        let mut attempts = 0u32;
        let (health, check) = loop {
            attempts += 1;
            let job = tokio::task::spawn_blocking(move || {
                let r = examine();
                (examine, r)
            })
            .await;
            let (f, (health, check)) = match job {
                Ok(v) => v,
                Err(e) => {
                    // The check panicked: nothing to retry with.
                    self.note(format!("the GPU check failed: {e}"));
                    break (Health::Unknown, None);
                }
            };
            examine = f;
            if health != Health::Unknown || Instant::now() + lc.check_retry_delay >= deadline {
                break (health, Some(check));
            }
            tracing::info!(
                attempt = attempts,
                "launch gate: the GPU check could not tell; trying again in {}",
                humantime::format_duration(lc.check_retry_delay)
            );
            tokio::time::sleep(lc.check_retry_delay).await;
        };
        (health, check, attempts)
    }

    async fn run<T, F>(&mut self, examine: F) -> LaunchReport<T>
    where
        T: Send + 'static,
        F: FnMut() -> (Health, T) + Send + 'static,
    {
        let cfg = self.cfg;
        let lc = &cfg.lifecycle;
        let deadline = Instant::now() + lc.check_deadline;
        let sdk = crate::aws::loader(&self.cfg.aws).load().await;
        let asg = Asg::new(aws_sdk_autoscaling::Client::new(&sdk));
        self.asg = Some(asg.clone());
        self.ecs = Some(aws_sdk_ecs::Client::new(&sdk));
        self.sdk = Some(sdk);

        let me = match self.who_am_i(&asg, deadline).await {
            Ok(me) => Some(me),
            Err(e) => {
                tracing::error!("launch gate: {e}");
                self.notes.push(e.to_string());
                None
            }
        };
        let heartbeat = me.as_ref().and_then(|m| {
            let (hook, group) = (m.hook.clone()?, m.group.clone()?);
            let interval = hook.heartbeat_interval();
            Some(Heartbeat::start(
                asg.clone(),
                group,
                hook,
                m.instance_id.clone(),
                interval,
            ))
        });

        // The check, again while it cannot tell.
        let (health, check, attempts) = self.check_until_known(examine, deadline).await;
        if health == Health::Unknown {
            self.note(format!(
                "the GPU check could not tell after {attempts} attempt(s) within {}",
                humantime::format_duration(lc.check_deadline)
            ));
        }
        let hb: Option<HeartbeatLog> = match heartbeat {
            Some(h) => Some(h.finish().await),
            None => None,
        };
        let heartbeats = hb.as_ref().map_or(0, |l| l.sent);

        let mut report = LaunchReport {
            health,
            decision: Decision::Continue,
            result: None,
            hook: lc.launch_hook.clone(),
            instance_id: me.as_ref().map(|m| m.instance_id.clone()),
            auto_scaling_group: me.as_ref().and_then(|m| m.group.clone()),
            attribute: None,
            attempts,
            heartbeats,
            breaker: None,
            fleet_incident: None,
            notes: Vec::new(),
            request_ids: Vec::new(),
            exit_code: 0,
            check,
        };
        if let Some(l) = &hb {
            if let Some(e) = &l.ended {
                self.note(e.clone());
            }
            self.calls.entries.extend(l.calls.entries.iter().cloned());
        }
        let waiting = me.as_ref().is_some_and(|m| m.hook.is_some());
        let decision = self.decide(health, waiting, me.as_ref(), &mut report).await;
        report.decision = decision;

        let mut exit = match decision {
            Decision::Continue => 0,
            _ => 1,
        };
        match &me {
            Some(me) => {
                if !self.answer(me, decision, waiting, &mut report).await {
                    exit = 2;
                }
            }
            None => exit = 2,
        }
        report.exit_code = exit;
        report.notes = std::mem::take(&mut self.notes);
        report.request_ids = std::mem::take(&mut self.calls.entries);
        report
    }

    /// Marks the container instance and answers our launch hook when an action waits on it:
    /// false when the hook could not be completed (its DefaultResult then applies).
    async fn answer<T>(
        &mut self,
        me: &Me,
        decision: Decision,
        waiting: bool,
        report: &mut LaunchReport<T>,
    ) -> bool {
        let cfg = self.cfg;
        let lc = &cfg.lifecycle;
        let mut answered = true;
        // Marks first when the instance is to take no tasks, so it never runs unmarked.
        if decision != Decision::Continue {
            report.attribute = self.mark(me, decision.health_value()).await;
        }
        if waiting {
            match self.complete(me, decision).await {
                Ok(r) => report.result = r,
                Err(e) => {
                    tracing::error!(
                        "launch gate: could not complete lifecycle hook {}: {e}; its DefaultResult applies at its timeout",
                        lc.launch_hook
                    );
                    self.notes.push(format!(
                        "could not complete lifecycle hook {}: {e}; its DefaultResult applies at its timeout",
                        lc.launch_hook
                    ));
                    answered = false;
                }
            }
        }
        if decision == Decision::Continue {
            report.attribute = self.mark(me, decision.health_value()).await;
        }
        answered
    }

    /// The instance, its group and, when an action waits on it, our launch hook.
    async fn who_am_i(&mut self, asg: &Asg, deadline: Instant) -> Result<Me, GateError> {
        let cfg = self.cfg;
        let instance_id = identity::instance_id(cfg, crate::aws::http_client(), deadline)
            .await
            .map_err(GateError::Identity)?;
        let group = match &cfg.identity.auto_scaling_group {
            Some(g) => Some(g.clone()),
            None => {
                let found = retry_until(deadline, || {
                    let mut c = Calls::new();
                    let asg = asg.clone();
                    let iid = instance_id.clone();
                    async move {
                        let r = asg.instance(&mut c, &iid).await;
                        (r, c)
                    }
                })
                .await;
                let (r, c) = found;
                self.calls.entries.extend(c.entries);
                match r? {
                    Some((g, i)) => {
                        self.note(format!(
                            "{instance_id} is {} in Auto Scaling group {g}",
                            i.lifecycle.as_deref().unwrap_or("(state unknown)")
                        ));
                        Some(g)
                    }
                    None => None,
                }
            }
        };
        let mut me = Me {
            instance_id,
            group,
            hook: None,
        };
        let Some(group) = me.group.clone() else {
            self.note(format!(
                "{} is in no Auto Scaling group: no lifecycle hook to complete",
                me.instance_id
            ));
            return Ok(me);
        };
        let name = cfg.lifecycle.launch_hook.clone();
        let Some(hook) = asg.lifecycle_hook(&mut self.calls, &group, &name).await? else {
            self.note(format!(
                "group {group} has no lifecycle hook {name}: nothing to complete"
            ));
            return Ok(me);
        };
        // A first heartbeat: is an action waiting on our hook?
        match asg
            .heartbeat(&mut self.calls, &group, &name, &me.instance_id)
            .await
        {
            Ok(true) => me.hook = Some(hook),
            Ok(false) => self.note(format!(
                "no lifecycle action waits on {name} for {} (not in Pending:Wait): nothing to complete",
                me.instance_id
            )),
            Err(e) => {
                self.note(format!(
                    "first heartbeat failed ({e}); completing the hook anyway"
                ));
                me.hook = Some(hook);
            }
        }
        Ok(me)
    }

    /// The decision for a verdict; the breaker is read (and an abandon recorded) here.
    async fn decide<T>(
        &mut self,
        health: Health,
        waiting: bool,
        me: Option<&Me>,
        report: &mut LaunchReport<T>,
    ) -> Decision {
        let cfg = self.cfg;
        let lc = &cfg.lifecycle;
        let bad = match health {
            Health::Healthy => return Decision::Continue,
            Health::Unknown if lc.on_unknown == OnUnknown::Continue => {
                self.note(
                    "on_unknown = \"continue\": in service, marked pending until a check passes",
                );
                return Decision::ContinuePending;
            }
            _ => health,
        };
        let (Some(me), true) = (me, waiting) else {
            self.note(format!(
                "{}: no lifecycle action to abandon; quarantined instead",
                if bad == Health::Unknown {
                    "could not tell"
                } else {
                    "unhealthy"
                }
            ));
            return Decision::Quarantine;
        };
        let Some(group) = me.group.clone() else {
            return Decision::Quarantine;
        };
        let Some(asg) = self.asg.clone() else {
            return Decision::Quarantine;
        };
        let now = unix_secs();
        let stamps = match asg.group(&mut self.calls, &group).await {
            Ok(g) => g
                .tags
                .iter()
                .find(|(k, _)| k == ABANDON_TAG)
                .map(|(_, v)| parse_stamps(v))
                .unwrap_or_default(),
            Err(e) => {
                self.note(format!(
                    "cannot read the launch-failure breaker ({e}); abandoning"
                ));
                Vec::new()
            }
        };
        let recent = recent_stamps(&stamps, now, lc.abandon_window);
        let tripped = lc.abandon_limit > 0 && recent.len() >= lc.abandon_limit as usize;
        report.breaker = Some(Breaker {
            recent: recent.len(),
            limit: lc.abandon_limit,
            window: humantime::format_duration(lc.abandon_window).to_string(),
            tripped,
        });
        report.fleet_incident = self
            .bad_image(&group, &me.instance_id, tripped.then_some(lc.abandon_limit))
            .await;
        if tripped {
            let text = format!(
                "LAUNCH-FAILURE BREAKER TRIPPED: {} launches of group {group} were abandoned within {}; this unhealthy instance is kept in service QUARANTINED (health=faulted) instead of abandoned. A bad AMI, driver or instance type? An operator is needed (clear the {ABANDON_TAG} tag to re-arm).",
                recent.len(),
                humantime::format_duration(lc.abandon_window)
            );
            tracing::error!("{text}");
            self.notes.push(text);
            return Decision::Quarantine;
        }
        if !cfg.dry_run {
            let value = with_stamp(&recent, now);
            if let Err(e) = asg
                .set_tag(&mut self.calls, &group, ABANDON_TAG, &value)
                .await
            {
                self.note(format!(
                    "could not record this abandon on {ABANDON_TAG} ({e})"
                ));
            }
        }
        Decision::Abandon
    }

    /// With `[fleet] table` (not in a dry run): records this unhealthy launch under its AMI
    /// in the group's fleet document; with the breaker `tripped` (at `limit` abandons), opens
    /// the AMI's fleet incident (once: the conditional write lets one gate in, which pages).
    /// The incident's id when one is open.
    async fn bad_image(&mut self, group: &str, me: &str, tripped: Option<u32>) -> Option<String> {
        let cfg = self.cfg;
        let table = cfg.fleet.table.as_deref()?;
        if cfg.dry_run {
            return None;
        }
        let sdk = self.sdk.as_ref()?;
        let slots = crate::aws::dynamo::SlotTable::new(aws_sdk_dynamodb::Client::new(sdk), table);
        let gate = crate::remedy::budget::fleet_gate::FleetGate::new(
            sdk,
            cfg,
            slots,
            crate::sys::clock::SystemClock::shared(),
        );
        let inc = gate
            .image(group, me, cfg.identity.cluster.as_deref(), tripped)
            .await?;
        self.note(inc.summary());
        Some(inc.id)
    }

    /// CompleteLifecycleAction, retrying what may pass for up to half the heartbeat timeout.
    /// Ok(None): no action was waiting any more.
    async fn complete(
        &mut self,
        me: &Me,
        decision: Decision,
    ) -> Result<Option<&'static str>, CallError> {
        let (Some(group), Some(hook), Some(asg)) = (&me.group, &me.hook, self.asg.clone()) else {
            return Ok(None);
        };
        let result = decision.result();
        let word = match result {
            LifecycleResult::Continue => "CONTINUE",
            LifecycleResult::Abandon => "ABANDON",
        };
        if self.cfg.dry_run {
            self.note(format!("dry run: would complete {} with {word}", hook.name));
            return Ok(None);
        }
        // A3.6: retry for up to half the heartbeat timeout; past that, DefaultResult applies.
        let until = Instant::now() + (hook.heartbeat_timeout / 2).max(Duration::from_secs(5));
        let mut delay = Duration::from_millis(500);
        loop {
            match asg
                .complete_lifecycle(&mut self.calls, group, &hook.name, &me.instance_id, result)
                .await
            {
                Ok(true) => {
                    let text = format!("lifecycle hook {} completed with {word}", hook.name);
                    if decision == Decision::Abandon {
                        tracing::warn!(
                            "launch gate: {text}: Auto Scaling terminates this instance and launches another"
                        );
                    }
                    self.note(text);
                    return Ok(Some(word));
                }
                Ok(false) => {
                    self.note(format!(
                        "no active lifecycle action for {} (already completed or timed out)",
                        hook.name
                    ));
                    return Ok(None);
                }
                Err(e) if e.retryable && Instant::now() + delay < until => {
                    tracing::warn!("launch gate: CompleteLifecycleAction failed, retrying: {e}");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(10));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Sets `<prefix>.health=<value>` on the container instance, when the agent has
    /// registered it. Returns what was set.
    async fn mark(&mut self, me: &Me, value: &str) -> Option<String> {
        let attr = format!("{}.health", self.cfg.ecs.attribute_prefix);
        if self.cfg.dry_run {
            self.note(format!("dry run: would set {attr}={value}"));
            return None;
        }
        let client = self.ecs.clone()?;
        let found = self.container_instance(&client, &me.instance_id).await;
        match found {
            Ok(Some((cluster, arn))) => {
                let ecs = Ecs::new(client, cluster);
                match ecs
                    .put_attribute(&mut self.calls, &arn, &attr, Some(value))
                    .await
                {
                    Ok(()) => {
                        self.note(format!("{attr}={value} set on {arn}"));
                        Some(format!("{attr}={value}"))
                    }
                    Err(e) => {
                        tracing::error!("launch gate: cannot set {attr}={value}: {e}");
                        self.notes.push(format!("cannot set {attr}={value}: {e}"));
                        None
                    }
                }
            }
            Ok(None) => {
                self.note(format!(
                    "the ECS agent has not registered {} yet: {attr}={value} not set (register the agent with ECS_INSTANCE_ATTRIBUTES={{\"{attr}\":\"pending\"}}, see packaging/LIFECYCLE.md)",
                    me.instance_id
                ));
                None
            }
            Err(e) => {
                self.note(format!(
                    "cannot find the container instance ({e}): {attr}={value} not set"
                ));
                None
            }
        }
    }

    /// (cluster, container instance ARN), found the way identity discovery finds them. None:
    /// not registered (yet).
    async fn container_instance(
        &mut self,
        client: &aws_sdk_ecs::Client,
        instance_id: &str,
    ) -> Result<Option<(String, String)>, CallError> {
        let view = identity::agent_view(self.cfg).await;
        if let Some(arn) = view.container_instance_arn {
            return Ok(Some((view.cluster, arn)));
        }
        let ecs = Ecs::new(client.clone(), view.cluster.clone());
        let found = identity::find_container_instance(&ecs, instance_id, &mut self.calls).await?;
        Ok(found.map(|arn| (view.cluster, arn)))
    }
}

/// Retries a call while it fails with a retryable error and `deadline` allows.
async fn retry_until<T, F, Fut>(deadline: Instant, mut f: F) -> (Result<T, CallError>, Calls)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = (Result<T, CallError>, Calls)>,
{
    let mut all = Calls::new();
    let mut delay = Duration::from_millis(500);
    loop {
        let (r, c) = f().await;
        all.entries.extend(c.entries);
        match r {
            Err(e) if e.retryable && Instant::now() + delay < deadline => {
                tracing::warn!("launch gate: {e}; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(10));
            }
            r => return (r, all),
        }
    }
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The timestamps in a tag value; anything unreadable is dropped.
pub fn parse_stamps(value: &str) -> Vec<u64> {
    value
        .split([' ', ','])
        .filter_map(|s| s.trim().parse().ok())
        .collect()
}

/// The stamps within `window` of `now`, oldest first.
pub fn recent_stamps(stamps: &[u64], now: u64, window: Duration) -> Vec<u64> {
    let mut v: Vec<u64> = stamps
        .iter()
        .copied()
        .filter(|t| *t <= now && now - *t <= window.as_secs())
        .collect();
    v.sort_unstable();
    v
}

/// The tag value with `now` added, bounded to the last `MAX_TAG_ENTRIES`.
pub fn with_stamp(recent: &[u64], now: u64) -> String {
    let mut v = recent.to_vec();
    v.push(now);
    let skip = v.len().saturating_sub(MAX_TAG_ENTRIES);
    v[skip..]
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_breaker_counts_abandons_within_its_window_only() {
        let now = 10_000;
        let stamps = parse_stamps("100 9000 9500, junk 9999 20000");
        let w = Duration::from_secs(3600);
        assert_eq!(recent_stamps(&stamps, now, w), vec![9000, 9500, 9999]);
        assert_eq!(
            recent_stamps(&stamps, now, Duration::from_secs(600)),
            vec![9500, 9999]
        );
        assert_eq!(with_stamp(&[1, 2], 3), "1 2 3");
        let many: Vec<u64> = (0..30).collect();
        let v = with_stamp(&many, 99);
        assert_eq!(v.split(' ').count(), MAX_TAG_ENTRIES);
        assert!(v.ends_with(" 99") && v.starts_with("11 "), "{v}");
        assert!(v.len() <= 256);
    }

    #[test]
    fn decisions_map_to_results_and_attributes() {
        assert_eq!(Decision::Abandon.result(), LifecycleResult::Abandon);
        assert_eq!(Decision::Quarantine.result(), LifecycleResult::Continue);
        assert_eq!(Decision::ContinuePending.health_value(), "pending");
        assert_eq!(
            serde_json::to_string(&Health::Unknown).unwrap(),
            "\"unknown\"",
            "the report's JSON keeps check's words"
        );
    }
}
