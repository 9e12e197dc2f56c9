//! Keeping our lifecycle hook's action alive while gpu-medic works: a task sends
//! RecordLifecycleActionHeartbeat for *our* hook (by instance id, no token needed) every third
//! of the hook's heartbeat timeout, read from DescribeLifecycleHooks, until stopped or until
//! Auto Scaling says no action is waiting any more (a ValidationError: completed by someone,
//! or timed out). Other errors are retried on the next beat (docs/aws.md).
//!
//! Used twice: by the drain when Auto Scaling is terminating the instance (so a drain longer
//! than the heartbeat timeout does not let the hook expire), and by the launch gate while the
//! GPU checks run.
//!
//! The hook name always comes from `[lifecycle]`; ECS's `ecs-managed-draining-termination-hook`
//! is never heartbeated (the config refuses that name).

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::asg::{Asg, HookInfo};
use super::calls::Calls;

/// What a heartbeat task did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HeartbeatLog {
    pub hook: String,
    pub interval: Duration,
    pub sent: u32,
    pub failed: u32,
    /// Why it stopped before being asked to (no action waiting any more).
    pub ended: Option<String>,
    pub calls: Calls,
}

impl HeartbeatLog {
    /// One line for an order's detail.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} heartbeat(s) for lifecycle hook {} (every {})",
            self.sent,
            self.hook,
            humantime::format_duration(self.interval)
        );
        if self.failed > 0 {
            s.push_str(&format!(", {} failed", self.failed));
        }
        if let Some(e) = &self.ended {
            s.push_str(&format!("; stopped: {e}"));
        }
        s
    }
}

/// A running heartbeat task.
pub struct Heartbeat {
    pub hook: HookInfo,
    /// When it started: the hook's global timeout counts from about then.
    pub started: Instant,
    stop: CancellationToken,
    task: JoinHandle<HeartbeatLog>,
}

impl Heartbeat {
    /// Starts heartbeating `hook` for `instance_id` after `first_in`, then every interval.
    pub fn start(
        asg: Asg,
        group: String,
        hook: HookInfo,
        instance_id: String,
        first_in: Duration,
    ) -> Heartbeat {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let name = hook.name.clone();
        let interval = hook.heartbeat_interval();
        tracing::info!(
            lifecycle_hook = %name,
            auto_scaling_group = %group,
            interval = %humantime::format_duration(interval),
            "heartbeating our lifecycle hook"
        );
        let task = tokio::spawn(async move {
            let mut log = HeartbeatLog {
                hook: name.clone(),
                interval,
                ..HeartbeatLog::default()
            };
            tokio::select! {
                _ = token.cancelled() => return log,
                _ = tokio::time::sleep(first_in) => {}
            }
            loop {
                match asg
                    .heartbeat(&mut log.calls, &group, &name, &instance_id)
                    .await
                {
                    Ok(true) => log.sent += 1,
                    Ok(false) => {
                        log.ended = Some(format!(
                            "no active lifecycle action for {name} (completed or timed out)"
                        ));
                        tracing::info!(lifecycle_hook = %name, "no active lifecycle action any more; heartbeats stopped");
                        return log;
                    }
                    Err(e) => {
                        log.failed += 1;
                        tracing::warn!(lifecycle_hook = %name, "lifecycle heartbeat failed, trying again next beat: {e}");
                    }
                }
                tokio::select! {
                    _ = token.cancelled() => return log,
                    _ = tokio::time::sleep(interval) => {}
                }
            }
        });
        Heartbeat {
            hook,
            started: Instant::now(),
            stop,
            task,
        }
    }

    /// When the action must be completed by: the hook's global timeout, less two beats.
    pub fn must_complete_by(&self) -> Instant {
        self.started + self.hook.budget()
    }

    /// Stops the task and returns what it did.
    pub async fn finish(self) -> HeartbeatLog {
        self.stop.cancel();
        let hook = self.hook.name.clone();
        self.task.await.unwrap_or_else(|e| HeartbeatLog {
            hook,
            ended: Some(format!("heartbeat task failed: {e}")),
            ..HeartbeatLog::default()
        })
    }
}
