//! Our terminate lifecycle hook: found in the group (DescribeLifecycleHooks), heartbeated
//! ([`crate::aws::heartbeat`]) while a drain runs for a termination (the drain, `drain.rs`,
//! starts and stops the heartbeats), and completed when the engine orders it
//! (CompleteLifecycleAction, after the incident export is flushed).

use std::time::Duration;

use super::Hands;
use crate::aws::asg::HookInfo;
use crate::aws::calls::Calls;
use crate::aws::heartbeat::{Heartbeat, HeartbeatLog};
use crate::aws::identity::Identity;
use crate::model::{LifecycleHook, LifecycleResult};
use crate::remedy::calls::CallsExt;
use crate::remedy::{Done, RemedyError};

/// The Auto Scaling lifecycle state of an instance held in a terminate wait.
pub const TERMINATING_WAIT: &str = "Terminating:Wait";

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

/// Auto Scaling is terminating the instance in `group`: our hook's settings, when the group
/// has our hook.
pub(super) async fn termination_in(h: &Hands, calls: &mut Calls, group: &str) -> Termination {
    let name = &h.cfg.lifecycle.terminate_hook;
    let hook = match h.asg.lifecycle_hook(calls, group, name).await {
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
    Termination {
        group: group.to_string(),
        hook,
    }
}

/// Whether the group holds this instance in `Terminating:Wait`.
pub(super) async fn asg_terminating(h: &Hands, id: &Identity) -> bool {
    let mut quiet = Calls::new();
    match h.asg.instance(&mut quiet, &id.instance_id).await {
        Ok(Some((_, i))) => i.lifecycle.as_deref() == Some(TERMINATING_WAIT),
        Ok(None) => false,
        Err(e) => {
            tracing::debug!("lifecycle state not read: {e}");
            false
        }
    }
}

/// Heartbeats for our hook, from now (none: the group has no hook of ours).
pub(super) fn start_heartbeat(h: &Hands, id: &Identity, t: &Termination) -> Option<Heartbeat> {
    let hook = t.hook.clone()?;
    Some(Heartbeat::start(
        h.asg.clone(),
        t.group.clone(),
        hook,
        id.instance_id.clone(),
        Duration::ZERO,
    ))
}

/// Completes our launch or terminate hook with `result` (the terminate hook after the
/// incident export is flushed). A gone action is success.
pub(super) async fn complete(
    h: &Hands,
    id: &Identity,
    hook: LifecycleHook,
    result: LifecycleResult,
) -> Result<Done, RemedyError> {
    let Some(group) = id.auto_scaling_group.as_deref() else {
        return Err(RemedyError::fatal(format!(
            "{} is in no Auto Scaling group: no lifecycle hook to complete",
            id.instance_id
        )));
    };
    let name = match hook {
        LifecycleHook::Terminate => &h.cfg.lifecycle.terminate_hook,
        LifecycleHook::Launch => &h.cfg.lifecycle.launch_hook,
    };
    let r = match result {
        LifecycleResult::Continue => "CONTINUE",
        LifecycleResult::Abandon => "ABANDON",
    };
    let flushed = match hook {
        LifecycleHook::Terminate => h.flush_export("completing the terminate hook").await,
        LifecycleHook::Launch => String::new(),
    };
    let mut calls = Calls::new();
    match h
        .asg
        .complete_lifecycle(&mut calls, group, name, &id.instance_id, result)
        .await
    {
        Ok(true) => Ok(calls.done(format!("lifecycle hook {name} completed with {r}{flushed}"))),
        Ok(false) => Ok(calls.done(format!(
            "no active lifecycle action for hook {name}: already completed or timed out"
        ))),
        Err(e) => Err(calls.fail(e)),
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
