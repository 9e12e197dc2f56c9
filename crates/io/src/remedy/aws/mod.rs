//! The control plane's hands: `AwsControlPlane` routes each order to the file that carries it
//! out through ECS and Auto Scaling (docs/aws.md):
//!
//! - `quarantine.rs`: `<prefix>.health=faulted`, so placement constraints avoid the instance;
//! - `stop_tasks.rs`: the ECS tasks on one GPU;
//! - `drain.rs`: the drain workflow (the fleet budget's slot, DRAINING, the pure `DrainPlan`,
//!   the termination watch and the heartbeats of `lifecycle_hook.rs`);
//! - `replace.rs`: Unhealthy in Auto Scaling, with the flagged terminate fallback;
//! - `restore.rs`: back in service after an abort, the budget's slot released;
//! - `lifecycle_hook.rs`: our terminate hook, heartbeated during a drain and completed.
//!
//! The fleet budget is [`crate::remedy::budget`], one protocol chosen at construction.
//!
//! Every step is idempotent and reconciles from what ECS and Auto Scaling say rather than from
//! memory, so an order handed over again after a crash resumes where the last one stopped: an
//! instance already DRAINING keeps its slot and skips the claim and the drain call; one
//! already Unhealthy is not marked again. Each order's `Done` or error lists the calls made
//! with their request ids (drain polls excepted: they would flood the journal).
//!
//! The SDK, the ECS and Auto Scaling wrappers and identity discovery are adapters in
//! [`crate::aws`]; this module decides nothing the engine did not order.

pub mod drain;
pub mod lifecycle_hook;
mod quarantine;
pub mod reboot;
mod replace;
mod restore;
mod stop_tasks;

pub use crate::remedy::calls::CallsExt;

use std::sync::Arc;

use aws_config::SdkConfig;
use aws_sdk_ecs::config::SharedHttpClient;
use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use super::budget::{self, FleetBudget, Whoami};
use super::{BoxFuture, ControlPlane, Done, JournalFlush, RemedyError};
use crate::aws::asg::Asg;
use crate::aws::calls::Calls;
use crate::aws::ecs::Ecs;
use crate::aws::identity::{self, Identity};
use crate::aws::{http_client, loader};
use crate::config::Config;
use crate::model::{LifecycleHook, LifecycleResult, Order, Timestamp};
use crate::sys::clock::{SharedClock, SystemClock};

/// What every remedy here works with: the configuration, the clients, the clock, the fleet
/// budget and the export's flush.
pub(crate) struct Hands {
    cfg: Config,
    ecs: aws_sdk_ecs::Client,
    asg: Asg,
    http: SharedHttpClient,
    clock: SharedClock,
    budget: Arc<dyn FleetBudget>,
    /// The incident export, flushed before the instance goes away (none: export is off).
    flush: Option<Arc<dyn JournalFlush>>,
    /// The journal's incidents (a drain's fleet gate asks for its incident's first signal);
    /// none: no fleet gate.
    records: Option<Arc<dyn crate::remedy::evidence::Records>>,
    /// The fleet incident this instance's `<prefix>.held` mark names, when it set one.
    held: std::sync::Mutex<Option<String>>,
}

impl Hands {
    fn ecs_for(&self, id: &Identity) -> Ecs {
        Ecs::new(self.ecs.clone(), id.cluster.clone())
    }

    fn health_attr(&self) -> String {
        format!("{}.health", self.cfg.ecs.attribute_prefix)
    }

    fn now(&self) -> Timestamp {
        Timestamp(self.clock.now_ms())
    }

    /// Marks the container instance as held by fleet incident `fleet` (`<prefix>.held`), or,
    /// with None, removes a mark set before; each change is one call, done once.
    async fn mark_held(&self, id: &Identity, ecs: &Ecs, fleet: Option<&str>) {
        let now = self.held.lock().map(|h| h.clone()).unwrap_or_default();
        if now.as_deref() == fleet {
            return;
        }
        let name = self.budget.held_attr();
        if name.is_empty() {
            return;
        }
        let mut calls = Calls::new();
        let arn = &id.container_instance_arn;
        let r = match fleet {
            Some(f) => ecs.put_attribute(&mut calls, arn, &name, Some(f)).await,
            None => ecs.delete_attribute(&mut calls, arn, &name).await,
        };
        match r {
            Ok(()) => {
                if let Ok(mut h) = self.held.lock() {
                    *h = fleet.map(str::to_string);
                }
            }
            Err(e) => tracing::warn!(container_instance = %arn, "cannot set {name}: {e}"),
        }
    }

    /// The first signal of `incident` as the journal says it (`xid 79`), when the journal's
    /// incidents were handed in: what a drain's fleet gate fingerprints.
    fn first_signal(&self, incident: crate::model::IncidentId) -> Option<String> {
        let records = self.records.as_ref()?;
        let signal = records.incident(incident)?.signal;
        (!signal.is_empty()).then_some(signal)
    }

    /// Delivers the journal before the instance goes away, waiting `[export] flush_wait` at
    /// most; what happened, for the order's detail (nothing when export is off).
    async fn flush_export(&self, before: &str) -> String {
        let Some(f) = &self.flush else {
            return String::new();
        };
        let r = f.flush(self.cfg.export.flush_wait).await;
        if r.complete {
            tracing::info!("before {before}: {r}");
        } else {
            tracing::warn!("before {before}: {r}");
        }
        format!("; before {before}: {r}")
    }
}

/// ECS and Auto Scaling, for this instance.
pub struct AwsControlPlane {
    hands: Hands,
    identity: OnceCell<Identity>,
}

impl AwsControlPlane {
    /// Loads the SDK configuration from the environment and `[aws]`. Identity discovery waits
    /// for the first order (the ECS agent may not be up yet at boot).
    pub async fn from_config(cfg: &Config, clock: SharedClock) -> Self {
        let sdk = loader(&cfg.aws).load().await;
        AwsControlPlane::with_clock(&sdk, cfg, clock)
    }

    /// With the system's clock.
    pub fn new(sdk: &SdkConfig, cfg: &Config) -> Self {
        AwsControlPlane::with_clock(sdk, cfg, SystemClock::shared())
    }

    /// The fleet budget's protocol is chosen here, once (`[fleet] table`).
    pub fn with_clock(sdk: &SdkConfig, cfg: &Config, clock: SharedClock) -> Self {
        AwsControlPlane {
            hands: Hands {
                cfg: cfg.clone(),
                ecs: aws_sdk_ecs::Client::new(sdk),
                asg: Asg::new(aws_sdk_autoscaling::Client::new(sdk)),
                http: sdk.http_client().unwrap_or_else(http_client),
                budget: budget::for_config(sdk, cfg, clock.clone()),
                clock,
                flush: None,
                records: None,
                held: std::sync::Mutex::new(None),
            },
            identity: OnceCell::new(),
        }
    }

    /// Flushes the incident export before completing the terminate hook or marking the
    /// instance Unhealthy (shared with the exporter).
    pub fn with_flush(mut self, flush: impl JournalFlush) -> Self {
        self.hands.flush = Some(Arc::new(flush));
        self
    }

    /// The journal's incidents, for the fleet gate of a drain (the incident's first signal).
    pub fn with_records(mut self, records: Arc<dyn crate::remedy::evidence::Records>) -> Self {
        self.hands.records = Some(records);
        self
    }

    /// This instance's identity, discovered once (a failure is retried by the next order).
    pub async fn identity(&self) -> Result<&Identity, RemedyError> {
        let h = &self.hands;
        self.identity
            .get_or_try_init(|| async {
                let mut calls = Calls::new();
                identity::discover(&h.cfg, h.http.clone(), &h.ecs, &h.asg, &mut calls)
                    .await
                    .map_err(|e| {
                        let message = format!("identity discovery: {e}");
                        if e.is_retryable() {
                            RemedyError::Retryable {
                                message,
                                request_ids: calls.entries,
                            }
                        } else {
                            RemedyError::Fatal {
                                message,
                                request_ids: calls.entries,
                            }
                        }
                    })
            })
            .await
    }

    /// The fleet budget's background work until `shutdown` (with `[fleet] table`: entries of
    /// terminated instances removed now and then; nothing for the claim protocol).
    pub async fn upkeep(self: Arc<Self>, shutdown: CancellationToken) {
        let budget = self.hands.budget.clone();
        budget.upkeep(self.as_ref(), shutdown).await;
    }

    /// Runs one order against this instance, once its identity is known.
    async fn with_identity<'a, F, Fut>(&'a self, f: F) -> Result<Done, RemedyError>
    where
        F: FnOnce(&'a Hands, &'a Identity) -> Fut,
        Fut: std::future::Future<Output = Result<Done, RemedyError>>,
    {
        let id = self.identity().await?;
        f(&self.hands, id).await
    }
}

impl Whoami for AwsControlPlane {
    fn whoami(&self) -> BoxFuture<'_, Option<Identity>> {
        Box::pin(async move {
            match self.identity().await {
                Ok(id) => Some(id.clone()),
                Err(e) => {
                    tracing::debug!("no identity yet: {e}");
                    None
                }
            }
        })
    }
}

impl ControlPlane for AwsControlPlane {
    fn quarantine(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move {
            self.with_identity(|h, id| quarantine::run(h, id, order))
                .await
        })
    }

    fn stop_tasks(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move {
            self.with_identity(|h, id| stop_tasks::run(h, id, order))
                .await
        })
    }

    fn drain(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.with_identity(|h, id| drain::run(h, id, order)).await })
    }

    fn replace(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.with_identity(|h, id| replace::run(h, id, order)).await })
    }

    fn restore(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.with_identity(|h, id| restore::run(h, id, order)).await })
    }

    fn take_fleet_view(&self) -> Option<crate::model::FleetBudgetView> {
        self.hands.budget.take_view()
    }

    fn application_fault(&self, definition: String) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            match self.identity().await {
                Ok(id) => self.hands.budget.task_pattern(id, &definition).await,
                Err(e) => tracing::warn!(
                    task_definition = %definition,
                    "fleet incidents: application fault not recorded for the fleet: {e}"
                ),
            }
        })
    }

    fn complete_lifecycle(
        &self,
        _order: &Order,
        hook: LifecycleHook,
        result: LifecycleResult,
    ) -> BoxFuture<'_, Result<Done, RemedyError>> {
        Box::pin(async move {
            self.with_identity(|h, id| lifecycle_hook::complete(h, id, hook, result))
                .await
        })
    }
}
