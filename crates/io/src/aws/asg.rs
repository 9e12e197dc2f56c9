//! The Auto Scaling calls gpu-medic makes. Capacity is never given up: replacement goes
//! through SetInstanceHealth Unhealthy (ShouldRespectGracePeriod=false), which honours the
//! group's instance maintenance policy and the ReplaceUnhealthy kill switch; the optional
//! TerminateInstanceInAutoScalingGroup fallback always keeps desired capacity.

use std::time::Duration;

use aws_sdk_autoscaling::Client;
use aws_sdk_autoscaling::types::LifecycleState;

use super::calls::{CallError, Calls};
use crate::model::LifecycleResult;

/// One instance as its group sees it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AsgInstance {
    pub instance_id: String,
    pub lifecycle: Option<String>,
    pub health: Option<String>,
}

/// An Auto Scaling group, as much as the fleet budget reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupState {
    pub name: String,
    pub desired: u32,
    pub instances: Vec<AsgInstance>,
    pub suspended: Vec<String>,
    pub tags: Vec<(String, String)>,
}

#[derive(Debug, Clone)]
pub struct Asg {
    pub client: Client,
}

impl Asg {
    /// A client with the SDK's configuration (the commands have no SDK crate).
    pub fn from_sdk(sdk: &aws_config::SdkConfig) -> Self {
        Asg::new(Client::new(sdk))
    }

    pub fn new(client: Client) -> Self {
        Asg { client }
    }

    /// The group an instance belongs to, with its state there; None: not in a group.
    pub async fn instance(
        &self,
        calls: &mut Calls,
        instance_id: &str,
    ) -> Result<Option<(String, AsgInstance)>, CallError> {
        let r = self
            .client
            .describe_auto_scaling_instances()
            .instance_ids(instance_id)
            .send()
            .await;
        let r = calls.track("DescribeAutoScalingInstances", r)?;
        Ok(r.auto_scaling_instances().iter().find_map(|d| {
            Some((
                d.auto_scaling_group_name()?.to_string(),
                AsgInstance {
                    instance_id: d.instance_id()?.to_string(),
                    lifecycle: d.lifecycle_state().map(str::to_string),
                    health: d.health_status().map(str::to_string),
                },
            ))
        }))
    }

    pub async fn group(&self, calls: &mut Calls, name: &str) -> Result<GroupState, CallError> {
        const OP: &str = "DescribeAutoScalingGroups";
        let r = self
            .client
            .describe_auto_scaling_groups()
            .auto_scaling_group_names(name)
            .send()
            .await;
        let r = calls.track(OP, r)?;
        let g = r
            .auto_scaling_groups()
            .iter()
            .find(|g| g.auto_scaling_group_name() == Some(name))
            .ok_or_else(|| {
                CallError::terminal(OP, format!("Auto Scaling group {name} not found"))
            })?;
        Ok(GroupState {
            name: name.to_string(),
            desired: g
                .desired_capacity()
                .and_then(|d| u32::try_from(d).ok())
                .unwrap_or(0),
            instances: g
                .instances()
                .iter()
                .filter_map(|i| {
                    Some(AsgInstance {
                        instance_id: i.instance_id()?.to_string(),
                        lifecycle: i
                            .lifecycle_state()
                            .map(|s: &LifecycleState| s.as_str().to_string()),
                        health: i.health_status().map(str::to_string),
                    })
                })
                .collect(),
            suspended: g
                .suspended_processes()
                .iter()
                .filter_map(|p| p.process_name().map(str::to_string))
                .collect(),
            tags: g
                .tags()
                .iter()
                .filter_map(|t| {
                    Some((
                        t.key()?.to_string(),
                        t.value().unwrap_or_default().to_string(),
                    ))
                })
                .collect(),
        })
    }

    /// SetInstanceHealth Unhealthy, skipping the grace period: Auto Scaling replaces it.
    pub async fn set_unhealthy(
        &self,
        calls: &mut Calls,
        instance_id: &str,
    ) -> Result<(), CallError> {
        let r = self
            .client
            .set_instance_health()
            .instance_id(instance_id)
            .health_status("Unhealthy")
            .should_respect_grace_period(false)
            .send()
            .await;
        calls.track("SetInstanceHealth", r).map(|_| ())
    }

    /// TerminateInstanceInAutoScalingGroup, never decrementing desired capacity.
    pub async fn terminate_keep_capacity(
        &self,
        calls: &mut Calls,
        instance_id: &str,
    ) -> Result<(), CallError> {
        let r = self
            .client
            .terminate_instance_in_auto_scaling_group()
            .instance_id(instance_id)
            .should_decrement_desired_capacity(false)
            .send()
            .await;
        calls
            .track("TerminateInstanceInAutoScalingGroup", r)
            .map(|_| ())
    }

    /// CompleteLifecycleAction by instance id. Ok(false): there was no active action (someone
    /// completed it, or it timed out), which counts as done.
    pub async fn complete_lifecycle(
        &self,
        calls: &mut Calls,
        group: &str,
        hook: &str,
        instance_id: &str,
        result: LifecycleResult,
    ) -> Result<bool, CallError> {
        let r = self
            .client
            .complete_lifecycle_action()
            .auto_scaling_group_name(group)
            .lifecycle_hook_name(hook)
            .instance_id(instance_id)
            .lifecycle_action_result(match result {
                LifecycleResult::Continue => "CONTINUE",
                LifecycleResult::Abandon => "ABANDON",
            })
            .send()
            .await;
        match calls.track("CompleteLifecycleAction", r) {
            Ok(_) => Ok(true),
            Err(e) if is_no_active_action(&e) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// One of our lifecycle hooks, as DescribeLifecycleHooks reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookInfo {
    pub name: String,
    /// `autoscaling:EC2_INSTANCE_LAUNCHING` or `autoscaling:EC2_INSTANCE_TERMINATING`.
    pub transition: String,
    pub heartbeat_timeout: Duration,
    /// The most an instance can wait: min(48 h, 100 x heartbeat timeout).
    pub global_timeout: Duration,
}

/// Heartbeats never come more often than this, whatever the hook says.
const MIN_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// Nor less often than this (docs/aws.md#heartbeats).
const MAX_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(300);

impl HookInfo {
    /// RecordLifecycleActionHeartbeat every third of the heartbeat timeout (at most 5 min): two
    /// heartbeats can be lost before the hook times out.
    pub fn heartbeat_interval(&self) -> Duration {
        (self.heartbeat_timeout / 3).clamp(MIN_HEARTBEAT_INTERVAL, MAX_HEARTBEAT_INTERVAL)
    }

    /// How long after the action began it can still be completed by us: the global timeout
    /// less two heartbeat intervals.
    pub fn budget(&self) -> Duration {
        self.global_timeout
            .saturating_sub(self.heartbeat_interval() * 2)
            .max(self.heartbeat_interval())
    }
}

impl Asg {
    /// Our hook `name` on `group`; None when the group has no hook of that name.
    pub async fn lifecycle_hook(
        &self,
        calls: &mut Calls,
        group: &str,
        name: &str,
    ) -> Result<Option<HookInfo>, CallError> {
        let r = self
            .client
            .describe_lifecycle_hooks()
            .auto_scaling_group_name(group)
            .lifecycle_hook_names(name)
            .send()
            .await;
        let r = calls.track("DescribeLifecycleHooks", r)?;
        let secs = |v: Option<i32>, default: u64| {
            Duration::from_secs(v.and_then(|v| u64::try_from(v).ok()).unwrap_or(default))
        };
        Ok(r.lifecycle_hooks()
            .iter()
            .find(|h| h.lifecycle_hook_name() == Some(name))
            .map(|h| {
                let heartbeat_timeout = secs(h.heartbeat_timeout(), 3600);
                HookInfo {
                    name: name.to_string(),
                    transition: h.lifecycle_transition().unwrap_or_default().to_string(),
                    heartbeat_timeout,
                    global_timeout: secs(
                        h.global_timeout(),
                        (heartbeat_timeout.as_secs() * 100).min(172_800),
                    ),
                }
            }))
    }

    /// RecordLifecycleActionHeartbeat by instance id. Ok(false): a ValidationError, i.e. no
    /// action is waiting for this hook (completed, timed out, or never started).
    pub async fn heartbeat(
        &self,
        calls: &mut Calls,
        group: &str,
        hook: &str,
        instance_id: &str,
    ) -> Result<bool, CallError> {
        let r = self
            .client
            .record_lifecycle_action_heartbeat()
            .auto_scaling_group_name(group)
            .lifecycle_hook_name(hook)
            .instance_id(instance_id)
            .send()
            .await;
        match calls.track("RecordLifecycleActionHeartbeat", r) {
            Ok(_) => Ok(true),
            Err(e) if e.code.as_deref() == Some("ValidationError") => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// CreateOrUpdateTags: one tag on the group, not propagated to instances.
    pub async fn set_tag(
        &self,
        calls: &mut Calls,
        group: &str,
        key: &str,
        value: &str,
    ) -> Result<(), CallError> {
        let tag = aws_sdk_autoscaling::types::Tag::builder()
            .resource_id(group)
            .resource_type("auto-scaling-group")
            .key(key)
            .value(value)
            .propagate_at_launch(false)
            .build();
        let r = self.client.create_or_update_tags().tags(tag).send().await;
        calls.track("CreateOrUpdateTags", r).map(|_| ())
    }
}

/// "No active Lifecycle Action found with instance ID i-..." (a ValidationError).
pub fn is_no_active_action(e: &CallError) -> bool {
    e.code.as_deref() == Some("ValidationError")
        && e.message
            .to_ascii_lowercase()
            .contains("no active lifecycle action")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_completed_action_is_recognised() {
        let e = CallError {
            op: "CompleteLifecycleAction",
            code: Some("ValidationError".into()),
            message: "ValidationError: No active Lifecycle Action found with instance ID i-1"
                .into(),
            retryable: false,
            request_id: None,
        };
        assert!(is_no_active_action(&e));
        let other = CallError {
            message: "ValidationError: hook not found".into(),
            ..e
        };
        assert!(!is_no_active_action(&other));
    }

    #[test]
    fn heartbeats_come_every_third_of_the_timeout_within_bounds() {
        let hook = |hb: u64, global: u64| HookInfo {
            name: "h".into(),
            transition: String::new(),
            heartbeat_timeout: Duration::from_secs(hb),
            global_timeout: Duration::from_secs(global),
        };
        assert_eq!(hook(30, 3000).heartbeat_interval(), Duration::from_secs(10));
        assert_eq!(
            hook(3600, 172_800).heartbeat_interval(),
            Duration::from_secs(300)
        );
        assert_eq!(hook(2, 200).heartbeat_interval(), Duration::from_secs(1));
        assert_eq!(hook(30, 3000).budget(), Duration::from_secs(2980));
        assert_eq!(hook(3, 3).budget(), Duration::from_secs(1));
    }
}
