//! Hands: each remedy carries out one kind of order and reports how it went. They sit behind
//! narrow traits so tests can put the real thing (NVIDIA's MPS daemon, moto) or a double
//! behind them, and the router below turns an `Order` into a call and the result into an
//! `Outcome` for the engine.
//!
//! Every remedy must be idempotent: an order in flight when gpu-medic stopped is handed over
//! again on the next start.

pub mod aws;
pub mod budget;
pub mod calls;
pub mod diagnose;
pub mod evidence;
pub mod mps;
pub mod mps_clients;
pub mod recorder;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::model::{Command, LifecycleHook, LifecycleResult, Order, Outcome, OutcomeStatus};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The hands: carries out one order and reports how it ended. Must be idempotent: an order
/// in flight when the supervisor stopped is handed over again on the next start.
pub trait Executor: Send + Sync + 'static {
    fn execute(&self, order: Order) -> Pin<Box<dyn Future<Output = Outcome> + Send + '_>>;
    /// Which kinds of order it can carry out; the engine records the others as what would
    /// have been done instead of issuing them.
    fn capabilities(&self) -> crate::model::Capabilities {
        crate::model::Capabilities::default()
    }
    /// Shown each journaled opening of an application fault (a record the export sends as
    /// `GPU Medic Application Fault`), after the engine decided it: what it does there decides
    /// nothing on this node (a fleet incident for a poison task, docs/fleet-scale.md). Must
    /// not block: work is spawned.
    fn observe(&self, record: &crate::model::Record) {
        let _ = record;
    }
}

/// What a remedy did, for the journal.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Done {
    pub detail: String,
    /// AWS request ids of the calls made.
    pub request_ids: Vec<String>,
}

impl Done {
    pub fn new(detail: impl Into<String>) -> Self {
        Done {
            detail: detail.into(),
            request_ids: Vec::new(),
        }
    }
}

/// Why a remedy did not succeed, and whether trying again may help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RemedyError {
    /// Throttling, a timeout, a busy daemon: the engine retries after its delay.
    #[error("{message}")]
    Retryable {
        message: String,
        request_ids: Vec<String>,
    },
    /// A bad request, missing permission, nothing to act on: retrying will not help.
    #[error("{message}")]
    Fatal {
        message: String,
        request_ids: Vec<String>,
    },
    /// Not attempted for a reason that will pass (the fleet budget is full).
    #[error("{message}")]
    Deferred {
        message: String,
        retry_after: Duration,
    },
}

impl RemedyError {
    pub fn retryable(message: impl Into<String>) -> Self {
        RemedyError::Retryable {
            message: message.into(),
            request_ids: Vec::new(),
        }
    }

    pub fn fatal(message: impl Into<String>) -> Self {
        RemedyError::Fatal {
            message: message.into(),
            request_ids: Vec::new(),
        }
    }
}

/// The MPS control daemon's hands (crates/io/src/remedy/mps.rs).
pub trait MpsRemedy: Send + Sync + 'static {
    /// Restarts the daemon and returns once it answers a probe again (or fails).
    fn restart(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>>;
    /// Has the daemon terminate those of `pids` that are its clients
    /// ([`mps_clients::terminate_clients`]); says per pid what was done.
    fn terminate_clients<'a>(
        &'a self,
        pids: &'a [u32],
    ) -> BoxFuture<'a, Result<Done, RemedyError>> {
        let _ = pids;
        Box::pin(async {
            Err(RemedyError::fatal(
                "this MPS remedy cannot terminate single clients",
            ))
        })
    }
}

/// The reboot rung's hands (crates/io/src/remedy/aws/reboot.rs): the reboot itself and the check
/// after the boot.
pub trait RepairRemedy: Send + Sync + 'static {
    /// Reboots this instance (EC2 `RebootInstances`, or the OS's reboot). Done once the
    /// reboot is accepted, or when the boot id shows it already happened.
    fn reboot(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>>;
    /// Waits for the GPUs and the MPS daemon, then runs the launch gate's checks: done when
    /// healthy, fatal when not.
    fn boot_check(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>>;
}

/// Delivers what the incident journal holds before the instance goes away (the exporter,
/// `crate::export`, implements it): the drain and the terminate hook wait on it, bounded.
pub trait JournalFlush: Send + Sync + 'static {
    /// Delivers every record journaled before the call, waiting at most `wait`.
    fn flush(&self, wait: Duration) -> BoxFuture<'_, FlushReport>;
}

/// How a flush went, for the order's detail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlushReport {
    /// Every lane delivered what it was asked for within the wait.
    pub complete: bool,
    pub detail: String,
}

impl std::fmt::Display for FlushReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

/// The control plane's hands: ECS and Auto Scaling (crates/io/src/remedy/aws/mod.rs routes each order to
/// its file there; the fleet budget is crates/io/src/remedy/budget/mod.rs).
pub trait ControlPlane: Send + Sync + 'static {
    /// Marks the container instance so placement constraints keep new tasks off.
    fn quarantine(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>>;
    /// Stops the ECS tasks using one GPU (by MPS client pid, task id or the task's gpuIds).
    fn stop_tasks(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>>;
    /// Drains the container instance; returns when drained or at `order.deadline`.
    fn drain(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>>;
    /// Has Auto Scaling replace the instance (never decrementing desired capacity).
    fn replace(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>>;
    /// Undoes quarantine and drain (an operator abort): the instance is ACTIVE again, marked
    /// healthy, and its fleet-budget claim is released.
    fn restore(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>>;
    /// Completes our own lifecycle hook.
    fn complete_lifecycle(
        &self,
        order: &Order,
        hook: LifecycleHook,
        result: LifecycleResult,
    ) -> BoxFuture<'_, Result<Done, RemedyError>>;
    /// An application fault of this instance was charged to task definition `definition`
    /// (`family:revision`): the fleet's poison-task pattern (with `[fleet] table`).
    fn application_fault(&self, definition: String) -> BoxFuture<'_, ()> {
        let _ = definition;
        Box::pin(async {})
    }
    /// The group as the fleet budget last read it for a drain or replacement, taken (None:
    /// no read since): the order's outcome carries it.
    fn take_fleet_view(&self) -> Option<crate::model::FleetBudgetView> {
        None
    }
}

/// Routes orders to the configured remedies; an order with no remedy fails with a clear note.
#[derive(Default, Clone)]
pub struct Remedies {
    pub mps: Option<Arc<dyn MpsRemedy>>,
    pub control_plane: Option<Arc<dyn ControlPlane>>,
    /// `[evidence]`: collect-evidence (crates/io/src/remedy/evidence).
    pub evidence: Option<Arc<dyn evidence::EvidenceRemedy>>,
    /// The reboot rung (`[repair] reboot` not `off`, with the control plane).
    pub repair: Option<Arc<dyn RepairRemedy>>,
    /// The active test of the GPUs (`[diagnose]`, a tier that can run on this node).
    pub diagnose: Option<Arc<dyn diagnose::DiagnoseRemedy>>,
}

impl Executor for Remedies {
    fn capabilities(&self) -> crate::model::Capabilities {
        crate::model::Capabilities {
            aws: self.control_plane.is_some(),
            mps: self.mps.is_some(),
            evidence: self.evidence.as_ref().map(|e| e.plan()),
            reboot: self.control_plane.is_some() && self.repair.is_some(),
            diagnose: self.diagnose.as_ref().map(|d| d.level()),
        }
    }

    /// An application fault charged to a named ECS task's definition (by the kernel's facts:
    /// the pid's cgroup, the ECS agent's record of that task; never the process's own name)
    /// is shown to the control plane for the fleet's poison-task pattern.
    fn observe(&self, record: &crate::model::Record) {
        let crate::model::IncidentEvent::Opened { observation, .. } = &record.event else {
            return;
        };
        let Some(c) = observation.culprit() else {
            return;
        };
        let (Some(definition), Some(_), true) = (
            c.definition.clone(),
            c.task.as_ref(),
            c.via != crate::model::attribution::Via::MpsAmbiguous,
        ) else {
            return;
        };
        let Some(cp) = self.control_plane.clone() else {
            return;
        };
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { cp.application_fault(definition).await });
        }
    }

    fn execute(&self, order: Order) -> BoxFuture<'_, Outcome> {
        Box::pin(async move {
            if order.command == Command::CollectEvidence {
                return match &self.evidence {
                    Some(e) => match e.collect(&order).await {
                        Ok((done, r)) => {
                            let mut o = outcome(&order, Ok(done));
                            o.evidence = Some(Box::new(r));
                            o
                        }
                        Err(err) => outcome(&order, Err(err)),
                    },
                    None => outcome(
                        &order,
                        Err(RemedyError::fatal(
                            "evidence collection is disabled ([evidence] enabled = false)",
                        )),
                    ),
                };
            }
            if let Command::Diagnose { level } = order.command {
                return match &self.diagnose {
                    Some(d) => match d.diagnose(&order, level).await {
                        Ok(diagnosis) => {
                            let mut o = outcome(&order, Ok(Done::new(diagnosis.summary.clone())));
                            o.diagnosis = Some(Box::new(diagnosis.without_raw()));
                            o
                        }
                        Err(err) => outcome(&order, Err(err)),
                    },
                    None => outcome(
                        &order,
                        Err(RemedyError::fatal(
                            "no diagnosis tool can run on this node ([diagnose])",
                        )),
                    ),
                };
            }
            if let Command::StopTasks { pids, .. } = &order.command
                && !pids.is_empty()
                && let Some(mps) = &self.mps
            {
                let r = mps_clients::stop_finest(
                    mps.as_ref(),
                    self.control_plane.as_deref(),
                    &order,
                    pids,
                )
                .await;
                return outcome(&order, r);
            }
            let result = match &order.command {
                Command::RestartMps => match &self.mps {
                    Some(m) => m.restart(&order).await,
                    None => Err(RemedyError::fatal(
                        "MPS remediation is disabled ([mps] enabled = false)",
                    )),
                },
                Command::Reboot { .. } | Command::BootCheck => match &self.repair {
                    Some(r) if matches!(order.command, Command::BootCheck) => {
                        r.boot_check(&order).await
                    }
                    Some(r) => r.reboot(&order).await,
                    None => Err(RemedyError::fatal(
                        "the reboot rung is off ([repair] reboot = \"off\", or [aws] disabled)",
                    )),
                },
                other => match &self.control_plane {
                    None => Err(RemedyError::fatal(
                        "AWS remediation is disabled ([aws] enabled = false)",
                    )),
                    Some(cp) => match other {
                        Command::Quarantine => cp.quarantine(&order).await,
                        Command::StopTasks { .. } => cp.stop_tasks(&order).await,
                        Command::Drain { .. } | Command::Replace => {
                            let r = if order.command == Command::Replace {
                                cp.replace(&order).await
                            } else {
                                cp.drain(&order).await
                            };
                            let mut o = outcome(&order, r);
                            o.fleet = cp.take_fleet_view().map(Box::new);
                            return o;
                        }
                        Command::Restore => cp.restore(&order).await,
                        Command::CompleteLifecycle { hook, result } => {
                            cp.complete_lifecycle(&order, *hook, *result).await
                        }
                        Command::RestartMps
                        | Command::Reboot { .. }
                        | Command::BootCheck
                        | Command::CollectEvidence
                        | Command::Diagnose { .. } => unreachable_restart(),
                    },
                },
            };
            outcome(&order, result)
        })
    }
}

/// `RestartMps`, `Reboot` and `BootCheck` are routed above; kept as a value so no panic
/// path exists.
fn unreachable_restart() -> Result<Done, RemedyError> {
    Err(RemedyError::fatal(
        "internal: restart-mps, reboot or boot-check routed to the control plane",
    ))
}

/// Converts a remedy result into the engine's `Outcome`.
pub fn outcome(order: &Order, result: Result<Done, RemedyError>) -> Outcome {
    let (status, detail, request_ids) = match result {
        Ok(d) => (OutcomeStatus::Done, d.detail, d.request_ids),
        Err(RemedyError::Retryable {
            message,
            request_ids,
        }) => (
            OutcomeStatus::Failed { retryable: true },
            message,
            request_ids,
        ),
        Err(RemedyError::Fatal {
            message,
            request_ids,
        }) => (
            OutcomeStatus::Failed { retryable: false },
            message,
            request_ids,
        ),
        Err(RemedyError::Deferred {
            message,
            retry_after,
        }) => (OutcomeStatus::Deferred { retry_after }, message, vec![]),
    };
    Outcome {
        action: order.id,
        status,
        detail,
        request_ids,
        evidence: None,
        fleet: None,
        diagnosis: None,
    }
}
