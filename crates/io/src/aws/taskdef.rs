//! Task definitions: each container's GPU memory reservation under MPS sharing, read with
//! ECS `DescribeTaskDefinition`. A container that shares a GPU through MPS asks for it in its
//! `resourceRequirements` entry of type `GPU` with `sharingStrategy.nvidiaMps.memory` (MiB);
//! ECS places the task on one GPU with that much memory free for all such containers of the
//! task together, and sets `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` per container (and
//! `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` from `maxComputePercent`, when given)
//! (docs/aws.md#gpu-memory-reservations-under-mps). The ECS agent's introspection API does
//! not list resource requirements, so this is the one place they are read.

use aws_sdk_ecs::Client;
use aws_sdk_ecs::types::{ResourceType, SharingStrategy};

use super::calls::{CallError, Calls};

/// One container's MPS reservation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ContainerReservation {
    /// The container's name in the task definition.
    pub container: String,
    /// `sharingStrategy.nvidiaMps.memory`, in MiB.
    pub memory_mib: u64,
    /// `sharingStrategy.nvidiaMps.maxComputePercent`, when set (a limit ECS passes as
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`).
    #[serde(default)]
    pub max_compute_percent: Option<u64>,
}

/// Reads a task definition revision (`family:revision`) and returns the MPS memory of each
/// container that has one, in the definition's order. A definition without MPS containers
/// is an empty list, not an error.
pub async fn mps_reservations(
    client: &Client,
    calls: &mut Calls,
    family: &str,
    revision: &str,
) -> Result<Vec<ContainerReservation>, CallError> {
    const OP: &str = "DescribeTaskDefinition";
    let r = client
        .describe_task_definition()
        .task_definition(format!("{family}:{revision}"))
        .send()
        .await;
    let r = calls.quiet(OP, r)?;
    let Some(td) = r.task_definition() else {
        return Err(CallError::terminal(OP, "the answer has no task definition"));
    };
    Ok(td
        .container_definitions()
        .iter()
        .filter_map(|c| {
            let mps: Vec<_> = c
                .resource_requirements()
                .iter()
                .filter(|r| *r.r#type() == ResourceType::Gpu)
                .filter_map(|r| match r.sharing_strategy() {
                    Some(SharingStrategy::NvidiaMps(m)) => Some(m),
                    _ => None,
                })
                .collect();
            let mib: u64 = mps
                .iter()
                .filter_map(|m| u64::try_from(m.memory()).ok())
                .sum();
            let max_compute_percent = mps
                .iter()
                .filter_map(|m| m.max_compute_percent())
                .filter_map(|p| u64::try_from(p).ok())
                .max();
            (mib > 0).then(|| ContainerReservation {
                container: c.name().unwrap_or_default().to_string(),
                memory_mib: mib,
                max_compute_percent,
            })
        })
        .collect())
}
