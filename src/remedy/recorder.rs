//! A control plane that records the ECS and Auto Scaling calls it would make and makes none.
//! It stands in for AWS where none exists: the demo on a laptop, and tests of the wiring.

use std::sync::{Arc, Mutex};

use super::{BoxFuture, ControlPlane, Done, RemedyError};
use crate::model::{Command, LifecycleHook, LifecycleResult, Order};

/// One call that a real control plane would have made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedCall {
    pub request_id: String,
    pub api: &'static str,
    pub detail: String,
}

#[derive(Debug, Clone, Default)]
pub struct RecordingControlPlane {
    calls: Arc<Mutex<Vec<RecordedCall>>>,
}

impl RecordingControlPlane {
    pub fn calls(&self) -> Vec<RecordedCall> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn record(&self, steps: &[(&'static str, String)]) -> Result<Done, RemedyError> {
        let mut calls = self.calls.lock().unwrap_or_else(|p| p.into_inner());
        let mut done = Done::default();
        let mut parts = Vec::new();
        for (api, detail) in steps {
            let request_id = format!("simulated-{:04}", calls.len() + 1);
            parts.push(format!("{api}({detail})"));
            done.request_ids.push(request_id.clone());
            calls.push(RecordedCall {
                request_id,
                api,
                detail: detail.clone(),
            });
        }
        done.detail = format!("simulated control plane: {}", parts.join(", then "));
        Ok(done)
    }
}

impl ControlPlane for RecordingControlPlane {
    fn quarantine(&self, _order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        Box::pin(async move {
            self.record(&[("ecs:PutAttributes", "gpu-medic.health=faulted".to_string())])
        })
    }

    fn stop_tasks(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let tasks = match &order.command {
            Command::StopTasks { tasks, gpu, .. } if tasks.is_empty() => {
                vec![format!("tasks on GPU {}", gpu.index)]
            }
            Command::StopTasks { tasks, .. } => tasks.clone(),
            _ => vec![],
        };
        Box::pin(async move {
            let steps: Vec<(&'static str, String)> =
                tasks.into_iter().map(|t| ("ecs:StopTask", t)).collect();
            self.record(&steps)
        })
    }

    fn drain(&self, _order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        Box::pin(async move {
            self.record(&[(
                "ecs:UpdateContainerInstancesState",
                "status=DRAINING".to_string(),
            )])
        })
    }

    fn replace(&self, _order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        Box::pin(async move {
            self.record(&[(
                "autoscaling:SetInstanceHealth",
                "HealthStatus=Unhealthy, ShouldRespectGracePeriod=false".to_string(),
            )])
        })
    }

    fn restore(&self, _order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        Box::pin(async move {
            self.record(&[
                (
                    "ecs:UpdateContainerInstancesState",
                    "status=ACTIVE".to_string(),
                ),
                ("ecs:PutAttributes", "gpu-medic.health=ok".to_string()),
            ])
        })
    }

    fn complete_lifecycle(
        &self,
        _order: &Order,
        hook: LifecycleHook,
        result: LifecycleResult,
    ) -> BoxFuture<'_, Result<Done, RemedyError>> {
        Box::pin(async move {
            self.record(&[(
                "autoscaling:CompleteLifecycleAction",
                format!("hook={hook:?}, result={result:?}"),
            )])
        })
    }
}
