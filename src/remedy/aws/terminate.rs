//! A drain while Auto Scaling terminates the instance: our terminate hook is heartbeated
//! ([`crate::aws::heartbeat`]) for as long as the drain runs, and the drain is bounded by the
//! hook's global timeout, so the hook is completed by us (CONTINUE) before Auto Scaling gives
//! up on it. The drain order says whether the engine knew of the termination when it gave the
//! order; one that begins mid-drain is learned from the lifecycle watcher's [`TargetState`]
//! (handed to the control plane at construction) or from Auto Scaling itself.
//!
//! [`TargetState`]: crate::aws::imds::TargetState

use std::time::Duration;

use tokio::time::Instant;

use super::AwsControlPlane;
use crate::aws::asg::HookInfo;
use crate::aws::calls::Calls;
use crate::aws::ecs::Ecs;
use crate::aws::heartbeat::{Heartbeat, HeartbeatLog};
use crate::aws::identity::Identity;
use crate::model::{Order, Timestamp};
use crate::remedy::{Done, RemedyError};

/// The Auto Scaling lifecycle state of an instance held in a terminate wait.
pub const TERMINATING_WAIT: &str = "Terminating:Wait";

/// How often a drain that is not (yet) for a termination re-asks Auto Scaling whether one has
/// begun (IMDS, through the lifecycle probe, is checked on every drain poll).
const ASG_RECHECK: Duration = Duration::from_secs(30);

/// Adds a heartbeat log to an order's result: its summary and its calls' request ids.
pub fn merge(result: Result<Done, RemedyError>, log: HeartbeatLog) -> Result<Done, RemedyError> {
    let line = log.summary();
    let ids = log.calls.entries;
    match result {
        Ok(mut d) => {
            d.detail = format!("{}; {line}", d.detail);
            d.request_ids.extend(ids);
            Ok(d)
        }
        Err(RemedyError::Fatal {
            message,
            mut request_ids,
        }) => {
            request_ids.extend(ids);
            Err(RemedyError::Fatal {
                message: format!("{message}; {line}"),
                request_ids,
            })
        }
        Err(RemedyError::Retryable {
            message,
            mut request_ids,
        }) => {
            request_ids.extend(ids);
            Err(RemedyError::Retryable {
                message: format!("{message}; {line}"),
                request_ids,
            })
        }
        Err(d @ RemedyError::Deferred { .. }) => Err(d),
    }
}

/// Auto Scaling is terminating the instance; `hook` is ours when the group has it.
#[derive(Debug, Clone)]
pub struct Termination {
    pub group: String,
    pub hook: Option<HookInfo>,
}

impl AwsControlPlane {
    /// Whether Auto Scaling is terminating this instance: the drain order says so (the engine
    /// had the lifecycle watcher's observation), or the watcher's last reading does (no call on
    /// the drain's critical path; Auto Scaling's own view is read beside the drain,
    /// `watch_for_termination`). With our terminate hook's settings when the group has it.
    pub(super) async fn termination(
        &self,
        calls: &mut Calls,
        id: &Identity,
        order_says: bool,
    ) -> Option<Termination> {
        let group = id.auto_scaling_group.as_deref()?;
        if !order_says && !self.target_state.terminating() {
            return None;
        }
        self.termination_in(calls, group).await
    }

    /// Whether the group holds this instance in `Terminating:Wait`.
    async fn asg_terminating(&self, id: &Identity) -> bool {
        let mut quiet = Calls::new();
        match self.asg.instance(&mut quiet, &id.instance_id).await {
            Ok(Some((_, i))) => i.lifecycle.as_deref() == Some(TERMINATING_WAIT),
            Ok(None) => false,
            Err(e) => {
                tracing::debug!("lifecycle state not read: {e}");
                false
            }
        }
    }

    async fn termination_in(&self, calls: &mut Calls, group: &str) -> Option<Termination> {
        let name = &self.cfg.lifecycle.terminate_hook;
        let hook = match self.asg.lifecycle_hook(calls, group, name).await {
            Ok(Some(h)) => Some(h),
            Ok(None) => {
                tracing::info!(lifecycle_hook = %name, auto_scaling_group = %group, "Auto Scaling is terminating the instance, but the group has no hook of ours: nothing to heartbeat");
                None
            }
            Err(e) => {
                tracing::warn!(lifecycle_hook = %name, "cannot read our lifecycle hook, draining without heartbeats: {e}");
                None
            }
        };
        Some(Termination {
            group: group.to_string(),
            hook,
        })
    }

    fn start_heartbeat(&self, id: &Identity, t: &Termination) -> Option<Heartbeat> {
        let hook = t.hook.clone()?;
        Some(Heartbeat::start(
            self.asg.clone(),
            t.group.clone(),
            hook,
            id.instance_id.clone(),
            Duration::ZERO,
        ))
    }

    /// Waits for the drain (`wait_drained`) and, while Auto Scaling terminates the instance,
    /// heartbeats our terminate hook. A termination known at the start also bounds the drain
    /// by the hook's global timeout (tasks still running are stopped before it); one that
    /// begins during the drain starts the heartbeats then, and the drain is cut short at the
    /// hook's global timeout.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn drain_with_heartbeats(
        &self,
        term: Option<Termination>,
        calls: Calls,
        order: &Order,
        ecs: &Ecs,
        id: &Identity,
        started_ms: u64,
        resumed: bool,
    ) -> Result<Done, RemedyError> {
        let mut hb = term.as_ref().and_then(|t| self.start_heartbeat(id, t));
        let mut bounded = order.clone();
        if let Some(h) = &hb {
            let cap = Timestamp::now().plus(h.hook.budget());
            if cap < bounded.deadline {
                tracing::info!(lifecycle_hook = %h.hook.name, "drain bounded by the hook's global timeout");
                bounded.deadline = cap;
            }
        }
        let arn = &id.container_instance_arn;
        let drain = self.wait_drained(calls, &bounded, ecs, arn, started_ms, resumed);
        let result = if term.is_none() {
            tokio::pin!(drain);
            tokio::select! {
                r = &mut drain => r,
                why = self.watch_for_termination(id, &mut hb) => Err(RemedyError::fatal(why)),
            }
        } else {
            drain.await
        };
        match hb {
            Some(h) => merge(result, h.finish().await),
            None => result,
        }
    }

    /// Runs beside a drain that began without a termination: when one begins (IMDS, checked
    /// every drain poll, or Auto Scaling's `Terminating:Wait`, read at once and then every
    /// 30 s), starts the heartbeats, then returns (ending the drain) when the hook's global
    /// timeout nears.
    async fn watch_for_termination(&self, id: &Identity, hb: &mut Option<Heartbeat>) -> String {
        let Some(group) = id.auto_scaling_group.clone() else {
            return std::future::pending().await;
        };
        let poll = self.cfg.ecs.drain_poll_interval;
        let mut last_asg_check: Option<Instant> = None;
        loop {
            let asg_due = last_asg_check.is_none_or(|t| t.elapsed() >= ASG_RECHECK);
            let terminating = self.target_state.terminating()
                || (asg_due && {
                    last_asg_check = Some(Instant::now());
                    self.asg_terminating(id).await
                });
            if terminating {
                let mut calls = Calls::new();
                if let Some(t) = self.termination_in(&mut calls, &group).await {
                    tracing::warn!(instance_id = %id.instance_id, "Auto Scaling began terminating the instance during the drain");
                    let Some(h) = self.start_heartbeat(id, &t) else {
                        // No hook of ours to keep alive: the drain goes on to its own deadline.
                        return std::future::pending().await;
                    };
                    let until = h.must_complete_by();
                    let hook = h.hook.clone();
                    *hb = Some(h);
                    tokio::time::sleep_until(until).await;
                    return format!(
                        "drain cut short: lifecycle hook {} reaches its global timeout ({}) soon",
                        hook.name,
                        humantime::format_duration(hook.global_timeout)
                    );
                }
            }
            tokio::time::sleep(poll).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heartbeat_log_joins_the_order_result() {
        let mut calls = Calls::new();
        calls.record("RecordLifecycleActionHeartbeat", Some("r-1"));
        let log = HeartbeatLog {
            hook: "gpu-medic-terminate".into(),
            interval: Duration::from_secs(10),
            sent: 3,
            failed: 0,
            ended: None,
            calls,
        };
        let d = merge(Ok(Done::new("drained")), log.clone()).unwrap();
        assert_eq!(
            d.detail,
            "drained; 3 heartbeat(s) for lifecycle hook gpu-medic-terminate (every 10s)"
        );
        assert_eq!(d.request_ids, ["RecordLifecycleActionHeartbeat r-1"]);
        let Err(RemedyError::Fatal { request_ids, .. }) =
            merge(Err(RemedyError::fatal("incomplete")), log)
        else {
            panic!("a fatal error stays fatal")
        };
        assert_eq!(request_ids.len(), 1);
    }
}
