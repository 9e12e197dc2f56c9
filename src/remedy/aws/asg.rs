//! The Auto Scaling calls gpu-medic makes. Capacity is never given up: replacement goes
//! through SetInstanceHealth Unhealthy (ShouldRespectGracePeriod=false), which honours the
//! group's instance maintenance policy and the ReplaceUnhealthy kill switch; the optional
//! TerminateInstanceInAutoScalingGroup fallback always keeps desired capacity.

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
}
