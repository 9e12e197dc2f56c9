//! A control plane that records the ECS and Auto Scaling calls it would make and makes none,
//! and a reboot rung that records EC2's `RebootInstances` the same way ([`SimulatedReboot`]).
//! They stand in for AWS where none exists: the demo on a laptop, and tests of the wiring.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::aws::reboot::BootCheck;
use super::{BoxFuture, ControlPlane, Done, RemedyError, RepairRemedy};
use crate::model::{Command, Health, LifecycleHook, LifecycleResult, Order};

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

/// The reboot rung on a simulated node: the reboot is recorded as EC2's `RebootInstances` on
/// the [`RecordingControlPlane`] (whoever plays the node then plays the boot: a new boot id at
/// `boot_id_path` and gpu-medic started again), and the check after the boot is the real one
/// handed in (the launch gate's passive checks, as `gpu-medic run` does).
pub struct SimulatedReboot {
    pub control_plane: RecordingControlPlane,
    /// Where the kernel's boot id is read (the boot tells the reboot happened).
    pub boot_id_path: PathBuf,
    pub check: BootCheck,
    /// How often the check looks again while the node is not healthy yet.
    pub check_interval: Duration,
    /// For this long an unhealthy or unclear node is looked at again; then the check fails.
    pub settle: Duration,
}

impl SimulatedReboot {
    fn do_reboot(&self, order: &Order) -> Result<Done, RemedyError> {
        let Command::Reboot { boot } = &order.command else {
            return Err(RemedyError::fatal("internal: not a reboot order"));
        };
        let now = crate::sys::limits::read_boot_id(&self.boot_id_path).map_err(|e| {
            RemedyError::fatal(format!(
                "cannot read the boot id ({e}): a reboot that could not be told apart is not made"
            ))
        })?;
        if !boot.is_empty() && &now != boot {
            return Ok(Done::new(format!(
                "the instance already rebooted (boot id {now}; the order was given in boot {boot}); not rebooting again"
            )));
        }
        let mut done = self.control_plane.record(&[(
            "ec2:RebootInstances",
            "InstanceIds=[this instance]".to_string(),
        )])?;
        done.detail = format!("{} accepted (boot {now})", done.detail);
        Ok(done)
    }

    async fn do_boot_check(&self) -> Result<Done, RemedyError> {
        let t0 = tokio::time::Instant::now();
        let mut looks = 0u32;
        loop {
            looks = looks.saturating_add(1);
            let check = self.check.clone();
            let (health, found) = tokio::task::spawn_blocking(move || (*check)())
                .await
                .unwrap_or_else(|e| (Health::Unknown, format!("the check panicked: {e}")));
            if health == Health::Healthy {
                return Ok(Done::new(format!(
                    "healthy after the boot ({looks} look(s)): {found}"
                )));
            }
            if t0.elapsed() >= self.settle {
                return Err(RemedyError::fatal(format!(
                    "not healthy after the boot ({looks} look(s); {health}): {found}"
                )));
            }
            tokio::time::sleep(self.check_interval).await;
        }
    }
}

impl RepairRemedy for SimulatedReboot {
    fn reboot(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.do_reboot(&order) })
    }

    fn boot_check(&self, _order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        Box::pin(self.do_boot_check())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ActionId, IncidentId, Timestamp};

    fn reboot(boot: &str) -> Order {
        Order {
            id: ActionId(4),
            incident: IncidentId(3),
            command: Command::Reboot { boot: boot.into() },
            attempt: 1,
            deadline: Timestamp(u64::MAX / 2),
            planned: false,
        }
    }

    #[tokio::test]
    async fn the_simulated_reboot_records_one_call_and_never_reboots_twice() {
        let dir = tempfile::tempdir().unwrap();
        let boot_id_path = dir.path().join("boot_id");
        std::fs::write(&boot_id_path, "boot-1\n").unwrap();
        let cp = RecordingControlPlane::default();
        let r = SimulatedReboot {
            control_plane: cp.clone(),
            boot_id_path: boot_id_path.clone(),
            check: Arc::new(|| (Health::Healthy, "4 GPU(s), no finding".to_string())),
            check_interval: Duration::from_millis(10),
            settle: Duration::from_millis(50),
        };
        let done = r.reboot(&reboot("boot-1")).await.unwrap();
        assert_eq!(done.request_ids, vec!["simulated-0001".to_string()]);
        assert_eq!(cp.calls()[0].api, "ec2:RebootInstances");
        // The order handed over again after the boot: already rebooted, no second call.
        std::fs::write(&boot_id_path, "boot-2\n").unwrap();
        let again = r.reboot(&reboot("boot-1")).await.unwrap();
        assert!(
            again.detail.contains("already rebooted"),
            "{}",
            again.detail
        );
        assert_eq!(cp.calls().len(), 1);
        let checked = r.boot_check(&reboot("")).await.unwrap();
        assert!(checked.detail.contains("healthy after the boot"));
        // An unreadable boot id: no reboot.
        std::fs::remove_file(&boot_id_path).unwrap();
        assert!(matches!(
            r.reboot(&reboot("boot-2")).await,
            Err(RemedyError::Fatal { .. })
        ));
    }

    #[tokio::test]
    async fn the_simulated_boot_check_fails_a_node_still_unhealthy_after_settle() {
        let r = SimulatedReboot {
            control_plane: RecordingControlPlane::default(),
            boot_id_path: PathBuf::from("/nonexistent"),
            check: Arc::new(|| (Health::Unhealthy, "xid 79 on GPU 0".to_string())),
            check_interval: Duration::from_millis(10),
            settle: Duration::from_millis(50),
        };
        let Err(RemedyError::Fatal { message, .. }) = r.boot_check(&reboot("")).await else {
            panic!("an unhealthy node fails the check")
        };
        assert!(message.contains("xid 79 on GPU 0"), "{message}");
    }
}
