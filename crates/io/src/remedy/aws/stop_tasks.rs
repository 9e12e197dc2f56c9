//! Stop-tasks: the ECS tasks that use one GPU (named by the order, else found by the tasks'
//! `gpuIds`) are stopped, so MPS can recover without draining the instance.

use super::Hands;
use crate::aws::calls::Calls;
use crate::aws::identity::Identity;
use crate::model::{Command, Order};
use crate::remedy::calls::CallsExt;
use crate::remedy::{Done, RemedyError};

pub(super) async fn run(h: &Hands, id: &Identity, order: Order) -> Result<Done, RemedyError> {
    let Command::StopTasks { gpu, pids, tasks } = &order.command else {
        return Err(RemedyError::fatal("internal: not a stop-tasks order"));
    };
    let ecs = h.ecs_for(id);
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
