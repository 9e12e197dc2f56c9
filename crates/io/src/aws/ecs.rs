//! The ECS calls gpu-medic makes, each written once with moto 5.2.5's quirks in mind: custom
//! attributes go by full ARN without `targetType`, are read back through
//! DescribeContainerInstances (not ListAttributes), and the ones we delete carry no value;
//! ListTasks always names `desiredStatus`; `failures[]` of a 200 response is an error.

use aws_sdk_ecs::Client;
use aws_sdk_ecs::types::{Attribute, ContainerInstanceStatus, DesiredStatus};

use super::calls::{CallError, Calls};

/// A container instance's status in ECS.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum EcsStatus {
    Active,
    Draining,
    Registering,
    Deregistering,
    RegistrationFailed,
    Inactive,
    /// A status this version does not know (kept verbatim).
    Other(String),
    /// The response named none.
    #[default]
    Unknown,
}

impl EcsStatus {
    pub fn parse(s: &str) -> EcsStatus {
        match s {
            "ACTIVE" => EcsStatus::Active,
            "DRAINING" => EcsStatus::Draining,
            "REGISTERING" => EcsStatus::Registering,
            "DEREGISTERING" => EcsStatus::Deregistering,
            "REGISTRATION_FAILED" => EcsStatus::RegistrationFailed,
            "INACTIVE" => EcsStatus::Inactive,
            "" => EcsStatus::Unknown,
            other => EcsStatus::Other(other.to_string()),
        }
    }

    pub fn as_str(&self) -> &str {
        match self {
            EcsStatus::Active => "ACTIVE",
            EcsStatus::Draining => "DRAINING",
            EcsStatus::Registering => "REGISTERING",
            EcsStatus::Deregistering => "DEREGISTERING",
            EcsStatus::RegistrationFailed => "REGISTRATION_FAILED",
            EcsStatus::Inactive => "INACTIVE",
            EcsStatus::Other(s) => s,
            EcsStatus::Unknown => "(unknown)",
        }
    }
}

impl std::fmt::Display for EcsStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A container instance, as much of it as gpu-medic reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct InstanceState {
    pub arn: String,
    pub ec2_instance_id: Option<String>,
    pub status: EcsStatus,
    pub agent_connected: bool,
    pub running: i32,
    pub pending: i32,
    pub registered_ms: Option<u64>,
    /// Custom and built-in attributes: (name, value).
    pub attributes: Vec<(String, Option<String>)>,
    /// ECS's view of each GPU (`gpuDevices`; empty where ECS reports none).
    pub gpu_devices: Vec<GpuDevice>,
    /// The ids of the registered `GPU` resource (its `stringSetValue`: the GPU UUIDs the agent
    /// registered; empty on an instance without GPUs).
    pub registered_gpus: Vec<String>,
    /// The ECS agent's verdict on the accelerators: the `ACCELERATED_COMPUTE` detail of
    /// `healthStatus` (asked for with `include=CONTAINER_INSTANCE_HEALTH`), as (status, what
    /// the agent says of it: its `statusReason`, the overall status, when it changed); None
    /// where the agent reports no such check.
    pub accelerated_health: Option<(String, String)>,
}

/// One GPU as ECS sees it (DescribeContainerInstances `gpuDevices`, API type `GpuDevice`;
/// every field is optional in the API). docs/aws.md#gpudevices.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct GpuDevice {
    /// `gpuId`: the GPU's UUID, as in the `gpuIds` of the containers ECS assigned to it.
    pub id: String,
    /// `sharingMode`: `IDLE`, `NVIDIA_MPS` or `DEDICATED`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharing_mode: Option<String>,
    /// `totalMemoryInMiB`: what the agent reported available to containers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_mib: Option<i64>,
    /// `remainingMemoryInMiB`: what ECS can still allocate to new `nvidiaMps` containers,
    /// computed from allocations, not from use.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remaining_mib: Option<i64>,
    /// `containerCount`: containers ECS assigned to the GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub containers: Option<i64>,
}

impl InstanceState {
    pub fn attribute(&self, name: &str) -> Option<&(String, Option<String>)> {
        self.attributes.iter().find(|(n, _)| n == name)
    }

    /// Our claim (`<prefix>.claim.<unix ms>`), if any: (attribute name, time).
    pub fn claim(&self, prefix: &str) -> Option<(String, u64)> {
        let head = format!("{prefix}.claim.");
        self.attributes
            .iter()
            .filter_map(|(n, _)| Some((n.clone(), n.strip_prefix(&head)?.parse().ok()?)))
            .max_by_key(|(_, ms)| *ms)
    }
}

/// A task on the instance.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TaskInfo {
    pub arn: String,
    pub group: Option<String>,
    pub started_by: Option<String>,
    pub last_status: Option<String>,
    /// Every container's `gpuIds` (GPU UUIDs on ECS; indexes in some setups).
    pub gpu_ids: Vec<String>,
}

impl TaskInfo {
    /// The task id (the ARN's last segment).
    pub fn id(&self) -> &str {
        self.arn.rsplit('/').next().unwrap_or(&self.arn)
    }

    /// Started by a service (ECS draining replaces it); otherwise standalone (RunTask,
    /// StartTask, scheduled), which ECS draining leaves alone.
    pub fn is_service(&self) -> bool {
        self.group
            .as_deref()
            .is_some_and(|g| g.starts_with("service:"))
            || self
                .started_by
                .as_deref()
                .is_some_and(|s| s.starts_with("ecs-svc/"))
    }

    /// Whether the task holds the GPU with this index or UUID.
    pub fn uses_gpu(&self, index: u32, uuid: &str) -> bool {
        let idx = index.to_string();
        self.gpu_ids
            .iter()
            .any(|g| g == &idx || (!uuid.is_empty() && g.eq_ignore_ascii_case(uuid)))
    }
}

/// ECS, for one cluster.
#[derive(Debug, Clone)]
pub struct Ecs {
    pub client: Client,
    pub cluster: String,
}

impl Ecs {
    pub fn new(client: Client, cluster: impl Into<String>) -> Self {
        Ecs {
            client,
            cluster: cluster.into(),
        }
    }

    /// Sets (or replaces) one custom attribute on a container instance. `value: None` makes a
    /// marker attribute, which DeleteAttributes removes on AWS and moto alike.
    pub async fn put_attribute(
        &self,
        calls: &mut Calls,
        target_arn: &str,
        name: &str,
        value: Option<&str>,
    ) -> Result<(), CallError> {
        const OP: &str = "PutAttributes";
        let attr = Attribute::builder()
            .name(name)
            .set_value(value.map(str::to_string))
            .target_id(target_arn)
            .build()
            .map_err(|e| CallError::terminal(OP, e.to_string()))?;
        let r = self
            .client
            .put_attributes()
            .cluster(&self.cluster)
            .attributes(attr)
            .send()
            .await;
        calls.track(OP, r).map(|_| ())
    }

    /// Deletes a marker attribute (name only, as AWS asks for custom attributes).
    pub async fn delete_attribute(
        &self,
        calls: &mut Calls,
        target_arn: &str,
        name: &str,
    ) -> Result<(), CallError> {
        const OP: &str = "DeleteAttributes";
        let attr = Attribute::builder()
            .name(name)
            .target_id(target_arn)
            .build()
            .map_err(|e| CallError::terminal(OP, e.to_string()))?;
        let r = self
            .client
            .delete_attributes()
            .cluster(&self.cluster)
            .attributes(attr)
            .send()
            .await;
        calls.track(OP, r).map(|_| ())
    }

    /// Every container instance ARN of the cluster (all states but INACTIVE).
    pub async fn list_instances(&self, calls: &mut Calls) -> Result<Vec<String>, CallError> {
        let mut out = Vec::new();
        let mut token = None;
        loop {
            let r = self
                .client
                .list_container_instances()
                .cluster(&self.cluster)
                .set_next_token(token)
                .send()
                .await;
            let r = calls.track("ListContainerInstances", r)?;
            out.extend(r.container_instance_arns().iter().cloned());
            token = r.next_token().map(str::to_string);
            if token.is_none() {
                return Ok(out);
            }
        }
    }

    /// Describes container instances, 100 per call. `quiet`: successful calls are not
    /// recorded (drain polls).
    pub async fn describe(
        &self,
        calls: &mut Calls,
        arns: &[String],
        quiet: bool,
    ) -> Result<Vec<InstanceState>, CallError> {
        const OP: &str = "DescribeContainerInstances";
        let mut out = Vec::new();
        for chunk in arns.chunks(100) {
            let r = self
                .client
                .describe_container_instances()
                .cluster(&self.cluster)
                .set_container_instances(Some(chunk.to_vec()))
                .include(aws_sdk_ecs::types::ContainerInstanceField::ContainerInstanceHealth)
                .send()
                .await;
            let r = calls.track_unless(quiet, OP, r)?;
            for ci in r.container_instances() {
                out.push(InstanceState {
                    arn: ci.container_instance_arn().unwrap_or_default().to_string(),
                    ec2_instance_id: ci.ec2_instance_id().map(str::to_string),
                    status: EcsStatus::parse(ci.status().unwrap_or_default()),
                    agent_connected: ci.agent_connected(),
                    running: ci.running_tasks_count(),
                    pending: ci.pending_tasks_count(),
                    registered_ms: ci
                        .registered_at()
                        .and_then(|t| t.to_millis().ok())
                        .and_then(|ms| u64::try_from(ms).ok()),
                    attributes: ci
                        .attributes()
                        .iter()
                        .map(|a| (a.name().to_string(), a.value().map(str::to_string)))
                        .collect(),
                    gpu_devices: ci
                        .gpu_devices()
                        .iter()
                        .map(|g| GpuDevice {
                            id: g.gpu_id().unwrap_or_default().to_string(),
                            sharing_mode: g.sharing_mode().map(|m| m.as_str().to_string()),
                            total_mib: g.total_memory_in_mib().map(i64::from),
                            remaining_mib: g.remaining_memory_in_mib().map(i64::from),
                            containers: g.container_count().map(i64::from),
                        })
                        .collect(),
                    registered_gpus: ci
                        .registered_resources()
                        .iter()
                        .filter(|r| r.name() == Some("GPU"))
                        .flat_map(|r| r.string_set_value().iter().cloned())
                        .collect(),
                    accelerated_health: ci.health_status().and_then(|h| {
                        h.details()
                            .iter()
                            .find(|d| d.r#type().map(|t| t.as_str()) == Some("ACCELERATED_COMPUTE"))
                            .map(|d| {
                                let status = d.status().map_or("", |s| s.as_str()).to_string();
                                let since = d
                                    .last_status_change()
                                    .and_then(|t| u64::try_from(t.secs()).ok())
                                    .map(|secs| {
                                        let at = crate::model::Timestamp(secs.saturating_mul(1000));
                                        format!("; changed {at}")
                                    })
                                    .unwrap_or_default();
                                let overall = h
                                    .overall_status()
                                    .map(|o| format!("overall {}", o.as_str()))
                                    .unwrap_or_default();
                                // The agent's own words (a probe that timed out, a wedged
                                // daemon): shown beside its verdict, never judged; clipped.
                                let reason = d
                                    .status_reason()
                                    .map(str::trim)
                                    .filter(|r| !r.is_empty())
                                    .map(|r| {
                                        let mut r = r.to_string();
                                        crate::model::cut(&mut r, 200);
                                        format!("reason: {r}; ")
                                    })
                                    .unwrap_or_default();
                                (status, format!("{reason}{overall}{since}"))
                            })
                    }),
                });
            }
        }
        Ok(out)
    }

    /// One container instance; an unknown ARN is a terminal error.
    pub async fn describe_one(
        &self,
        calls: &mut Calls,
        arn: &str,
        quiet: bool,
    ) -> Result<InstanceState, CallError> {
        self.describe(calls, &[arn.to_string()], quiet)
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| {
                CallError::terminal(
                    "DescribeContainerInstances",
                    format!(
                        "container instance {arn} not found in cluster {}",
                        self.cluster
                    ),
                )
            })
    }

    /// UpdateContainerInstancesState DRAINING. Repeating it is harmless.
    pub async fn set_draining(&self, calls: &mut Calls, arn: &str) -> Result<(), CallError> {
        self.set_status(calls, arn, ContainerInstanceStatus::Draining)
            .await
    }

    /// UpdateContainerInstancesState ACTIVE (an aborted drain). Repeating it is harmless.
    pub async fn set_active(&self, calls: &mut Calls, arn: &str) -> Result<(), CallError> {
        self.set_status(calls, arn, ContainerInstanceStatus::Active)
            .await
    }

    async fn set_status(
        &self,
        calls: &mut Calls,
        arn: &str,
        status: ContainerInstanceStatus,
    ) -> Result<(), CallError> {
        const OP: &str = "UpdateContainerInstancesState";
        let r = self
            .client
            .update_container_instances_state()
            .cluster(&self.cluster)
            .container_instances(arn)
            .status(status)
            .send()
            .await;
        let r = calls.track(OP, r)?;
        if let Some(f) = r.failures().first() {
            return Err(CallError::terminal(
                OP,
                format!(
                    "{}: {}{}",
                    f.arn().unwrap_or(arn),
                    f.reason().unwrap_or("failed"),
                    f.detail().map(|d| format!(" ({d})")).unwrap_or_default()
                ),
            ));
        }
        Ok(())
    }

    /// The tasks ECS wants running on the instance (desiredStatus RUNNING), described.
    pub async fn running_tasks(
        &self,
        calls: &mut Calls,
        instance_arn: &str,
        quiet: bool,
    ) -> Result<Vec<TaskInfo>, CallError> {
        let mut arns = Vec::new();
        let mut token = None;
        loop {
            let r = self
                .client
                .list_tasks()
                .cluster(&self.cluster)
                .container_instance(instance_arn)
                .desired_status(DesiredStatus::Running)
                .set_next_token(token)
                .send()
                .await;
            let r = calls.track_unless(quiet, "ListTasks", r)?;
            arns.extend(r.task_arns().iter().cloned());
            token = r.next_token().map(str::to_string);
            if token.is_none() {
                break;
            }
        }
        self.describe_tasks(calls, &arns, quiet).await
    }

    pub async fn describe_tasks(
        &self,
        calls: &mut Calls,
        arns: &[String],
        quiet: bool,
    ) -> Result<Vec<TaskInfo>, CallError> {
        const OP: &str = "DescribeTasks";
        let mut out = Vec::new();
        for chunk in arns.chunks(100) {
            let r = self
                .client
                .describe_tasks()
                .cluster(&self.cluster)
                .set_tasks(Some(chunk.to_vec()))
                .send()
                .await;
            let r = calls.track_unless(quiet, OP, r)?;
            for t in r.tasks() {
                out.push(TaskInfo {
                    arn: t.task_arn().unwrap_or_default().to_string(),
                    group: t.group().map(str::to_string),
                    started_by: t.started_by().map(str::to_string),
                    last_status: t.last_status().map(str::to_string),
                    gpu_ids: t
                        .containers()
                        .iter()
                        .flat_map(|c| c.gpu_ids().iter().cloned())
                        .collect(),
                });
            }
        }
        Ok(out)
    }

    /// StopTask (SIGTERM, then SIGKILL after the container's stop timeout). Stopping a task
    /// that already stopped is harmless.
    pub async fn stop_task(
        &self,
        calls: &mut Calls,
        task: &str,
        reason: &str,
    ) -> Result<(), CallError> {
        let reason: String = reason.chars().take(255).collect();
        let r = self
            .client
            .stop_task()
            .cluster(&self.cluster)
            .task(task)
            .reason(reason)
            .send()
            .await;
        calls.track("StopTask", r).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_tasks_are_told_apart_from_standalone_ones() {
        let mut t = TaskInfo {
            arn: "arn:aws:ecs:us-east-1:1:task/c/abc".into(),
            group: Some("family:train".into()),
            ..TaskInfo::default()
        };
        assert_eq!(t.id(), "abc");
        assert!(!t.is_service());
        t.group = Some("service:web".into());
        assert!(t.is_service());
        t.group = None;
        t.started_by = Some("ecs-svc/1234".into());
        assert!(t.is_service());
    }

    #[test]
    fn gpu_ids_match_by_index_or_uuid() {
        let t = TaskInfo {
            gpu_ids: vec!["GPU-aaaa".into(), "3".into()],
            ..TaskInfo::default()
        };
        assert!(t.uses_gpu(3, ""));
        assert!(t.uses_gpu(0, "gpu-AAAA"));
        assert!(!t.uses_gpu(1, "GPU-bbbb"));
    }

    #[test]
    fn the_newest_claim_is_ours() {
        let s = InstanceState {
            attributes: vec![
                ("gpu-medic.health".into(), Some("faulted".into())),
                ("gpu-medic.claim.100".into(), None),
                ("gpu-medic.claim.200".into(), None),
                ("other.claim.300".into(), None),
            ],
            ..InstanceState::default()
        };
        assert_eq!(
            s.claim("gpu-medic"),
            Some(("gpu-medic.claim.200".into(), 200))
        );
    }
}
