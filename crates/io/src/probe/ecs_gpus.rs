//! ECS's view of this instance's GPUs against NVML's. ECS places MPS tasks by what
//! DescribeContainerInstances says of each GPU (`gpuDevices`: `gpuId`, `sharingMode`,
//! `containerCount`, `remainingMemoryInMiB`; facts and sources in docs/aws.md#gpudevices), and
//! ECS computes that from its own allocations, never from the GPU. So ECS keeps placing tasks
//! on a GPU NVML reports lost or no longer sees, and counts memory as free that something
//! else holds. This probe reads ECS's view on a slow interval (`[ecs] gpu_view_interval`) and
//! after every GPU signal (the supervisor wakes it, at most every 30 s), compares it with the
//! NVML poller's latest view ([`NvmlView`]), and reports what disagrees:
//!
//! - `ecs-gpu-missing`: a GPU ECS lists that NVML reports lost, or does not see at all;
//! - `ecs-gpu-count-mismatch`: ECS and NVML count the GPUs differently;
//! - `ecs-gpu-memory-in-use`: a GPU on which ECS believes more memory is free for new MPS
//!   tasks than NVML shows free (value: the excess in MiB; the policy's threshold is the
//!   tolerance).
//!
//! It also gives `[nvml] expected_gpus` its default while the key is unset ([`ExpectedGpus`]):
//! the instance type's count (`crate::aws::instance_types`, from IMDS `instance-type`), and
//! nothing else. ECS's count is an orchestrator's record, not a reading of the hardware: the
//! agent registered it once, and keeps the registration across reboots (its state under
//! `/var/lib/ecs/data`), so it can say more GPUs than the instance has now without any GPU
//! having failed. It never becomes the expected count: a wrong expected count would replace a
//! healthy node (`device-count-mismatch`). On a type the table does not know, with
//! `[nvml] expected_gpus` unset, the count is not checked; NVML's own signals (a GPU lost, XID
//! 79) still act on any type. A disagreement between ECS and NVML is `ecs-gpu-count-mismatch`
//! (logged), never `device-count-mismatch`; GPUs ECS lists that NVML does not see are that
//! count mismatch, not `ecs-gpu-missing` (which replaces), unless the hardware's count (the
//! type's, or the one the operator set) says a GPU is missing; a GPU NVML reports lost is
//! `ecs-gpu-missing` on any type (NVML's fact).
//!
//! A read that fails (throttled, denied, unreachable) is never a GPU signal: it is retried, and
//! after 3 failures in a row (or one that cannot succeed) it is a self-fault of component
//! `ecs-gpu-view`, resolved by the next good read. The last comparison is kept in
//! `state_dir/ecs-gpus.json` for `gpu-medic status`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, mpsc};
use tokio_util::sync::CancellationToken;

use super::nvml::view::{ExpectedGpus, NvmlView, ViewSnapshot};
use crate::aws::calls::{CallError, Calls};
use crate::aws::ecs::{Ecs, GpuDevice, InstanceState};
use crate::aws::{identity, imds, instance_types};
use crate::config::Config;
pub use crate::model::gpu_view::{Comparison, Expected, GpuLine};
use crate::model::{Observation, Signal, Timestamp};
use crate::probe::Source;

/// The self-fault component of a view that cannot be read.
pub const COMPONENT: &str = "ecs-gpu-view";
/// The observations' source.
pub const SOURCE: &str = "ecs-gpus";
/// A GPU signal re-reads ECS's view at most this often (or every `gpu_view_interval`, if
/// shorter).
pub const WAKE_SPACING: Duration = Duration::from_secs(30);
/// Failed reads in a row that make a self-fault.
const FAILURES_FOR_SELF_FAULT: u32 = 3;
/// How long a read waits for the NVML poller's first view.
const FIRST_POLL_WAIT: Duration = Duration::from_secs(30);
const MIB: u64 = 1024 * 1024;

/// ECS's view of this instance's GPUs at one read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EcsRead {
    pub devices: Vec<GpuDevice>,
    /// The registered `GPU` resource's ids.
    pub registered: Vec<String>,
    /// The ECS agent's `ACCELERATED_COMPUTE` verdict (status, detail), from the same call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_health: Option<(String, String)>,
}

impl EcsRead {
    pub fn from_instance(s: &InstanceState) -> Self {
        EcsRead {
            devices: s.gpu_devices.clone(),
            registered: s.registered_gpus.clone(),
            agent_health: s.accelerated_health.clone(),
        }
    }

    /// The GPUs ECS places tasks on: `gpuDevices`, else the registered resource's ids.
    pub fn gpus(&self) -> Vec<GpuDevice> {
        if !self.devices.is_empty() {
            return self.devices.clone();
        }
        self.registered
            .iter()
            .map(|id| GpuDevice {
                id: id.clone(),
                ..GpuDevice::default()
            })
            .collect()
    }

    pub fn count(&self) -> u32 {
        u32::try_from(self.gpus().len()).unwrap_or(u32::MAX)
    }
}

/// ECS believes more of a shared GPU free for new MPS tasks than NVML shows free: the
/// finding, and NVML's free memory on `line`.
fn memory_in_use(
    d: &GpuDevice,
    g: &super::nvml::view::GpuView,
    placement: &str,
    line: &mut GpuLine,
) -> Option<Observation> {
    let (used, total) = g.memory?;
    let free = total.saturating_sub(used) / MIB;
    line.nvml_free_mib = Some(free);
    let shared = d.sharing_mode.as_deref() != Some("DEDICATED");
    let remaining = u64::try_from(d.remaining_mib.filter(|_| shared)?).unwrap_or(0);
    (remaining > free).then(|| {
        Observation::new(Signal::EcsGpuMemoryInUse)
            .on_gpu(g.gpu.clone())
            .with_value(remaining - free)
            .with_detail(format!(
                "ECS believes {remaining} MiB of {} free for new MPS tasks{placement}; NVML shows {free} MiB free ({} of {} MiB in use): {} MiB that ECS would place is not there",
                d.id,
                used / MIB,
                total / MIB,
                remaining - free
            ))
    })
}

/// What an `ecs-gpu-count` finding says: both counts, the hardware's when known, and why
/// ECS's registration is not a count of hardware where it is not (`unseen`: what ECS lists
/// beyond NVML when that is ECS's registration, not hardware missing).
fn count_detail(
    ecs: u32,
    nvml: u32,
    hardware: Option<&Expected>,
    implausible: bool,
    unseen: Option<&[String]>,
) -> String {
    let mut detail = format!("ECS registered {ecs} GPU(s) for this instance, NVML counts {nvml}");
    match hardware {
        Some(h) if h.source.starts_with("instance type") => {
            detail.push_str(&format!("; the {} has {}", h.source, h.count));
        }
        Some(h) => detail.push_str(&format!("; {} = {}", h.source, h.count)),
        None => detail.push_str(
            "; the hardware's GPU count is not known (neither an instance type in docs/gpu-instance-types.md nor a usable [nvml] expected_gpus), so ECS's registration alone is not taken for the hardware",
        ),
    }
    if implausible {
        detail.push_str(&format!(
            " (ECS's count is more than any instance type has, {}: not a count of hardware)",
            instance_types::max_gpu_count()
        ));
    }
    if let Some(unseen) = unseen {
        detail.push_str(&format!(
            "; ECS lists {} GPU(s) NVML does not see, not hardware missing: {}",
            unseen.len(),
            cap_list(unseen)
        ));
    }
    detail
}

/// Compares ECS's view with NVML's: the observations (every disagreement, each a finding,
/// never a routine reading) and a line per GPU ECS lists. Nothing is compared when ECS lists
/// no GPU (it then places no GPU task here). `hardware`: the hardware's GPU count, when known
/// (the instance type's, or a set `[nvml] expected_gpus`: [`ExpectedGpus::resolve`]), never
/// ECS's.
pub fn compare(
    read: &EcsRead,
    nvml: &ViewSnapshot,
    hardware: Option<&Expected>,
) -> (Vec<Observation>, Vec<GpuLine>) {
    let mut found = Vec::new();
    let mut lines = Vec::new();
    let ecs_gpus = read.gpus();
    if ecs_gpus.is_empty() {
        return (found, lines);
    }
    let mut unseen = Vec::new();
    // GPUs lost before NVML could name them (lost since this process started): an ECS GPU
    // no named GPU matches may be one of them.
    let unnamed_lost = nvml
        .gpus
        .values()
        .filter(|g| g.lost && g.gpu.uuid.is_empty())
        .count();
    for d in &ecs_gpus {
        let g = nvml.find(&d.id);
        let placement = describe(d);
        let mut line = GpuLine {
            id: d.id.clone(),
            index: g.map(|g| g.gpu.index),
            nvml: match g {
                Some(g) if g.lost => "lost",
                Some(_) => "ok",
                None if unnamed_lost > 0 => "lost or missing",
                None => "missing",
            }
            .to_string(),
            sharing_mode: d.sharing_mode.clone(),
            containers: d.containers,
            ecs_remaining_mib: d.remaining_mib,
            nvml_free_mib: None,
        };
        match g {
            None => unseen.push(format!("{}{placement}", d.id)),
            Some(g) if g.lost => found.push(
                Observation::new(Signal::EcsGpuMissing)
                    .on_gpu(g.gpu.clone())
                    .with_value(count(d.containers))
                    .with_detail(format!(
                        "ECS still schedules onto {}{placement}, which NVML reports lost",
                        d.id
                    )),
            ),
            Some(g) => found.extend(memory_in_use(d, g, &placement, &mut line)),
        }
        lines.push(line);
    }
    let ecs = read.count();
    let implausible = !instance_types::plausible_gpu_count(ecs);
    // NVML sees every GPU the hardware's count says (or ECS counts more GPUs than any
    // instance has, or no hardware count is known to hold ECS's list to): what ECS lists
    // beyond them is ECS's registration, not hardware that went missing.
    let all_there = hardware.is_some_and(|h| nvml.count >= h.count && unnamed_lost == 0);
    // With no hardware count, NVML reporting a GPU lost that it cannot name is NVML's own
    // fact, and what ECS lists beyond what NVML sees may be that GPU.
    let unknown = hardware.is_none() && unnamed_lost == 0;
    let not_hardware = !unseen.is_empty() && (all_there || implausible || unknown);
    if !unseen.is_empty() && !not_hardware {
        // One observation for all of them: they have no NVML index to tell them apart, and
        // two in one read must not count as a repeat.
        found.push(
            Observation::new(Signal::EcsGpuMissing)
                .with_value(unseen.len() as u64)
                .with_detail(format!(
                    "ECS still schedules onto {} GPU(s) NVML does not see: {}{}",
                    unseen.len(),
                    unseen.join("; "),
                    if unnamed_lost > 0 {
                        format!(" (NVML reports {unnamed_lost} GPU(s) lost that it cannot name)")
                    } else {
                        String::new()
                    }
                )),
        );
    }
    if ecs != nvml.count {
        let unseen = not_hardware.then_some(&unseen[..]);
        found.push(
            Observation::new(Signal::EcsGpuCountMismatch)
                .with_value(u64::from(ecs.abs_diff(nvml.count)))
                .with_detail(count_detail(ecs, nvml.count, hardware, implausible, unseen)),
        );
    }
    let found = found.into_iter().map(|o| o.from_source(SOURCE)).collect();
    (found, lines)
}

/// " (NVIDIA_MPS, 2 container(s), 30000 MiB remaining)" from what ECS said.
fn describe(d: &GpuDevice) -> String {
    let mut parts = Vec::new();
    if let Some(m) = &d.sharing_mode {
        parts.push(m.clone());
    }
    if let Some(c) = d.containers {
        parts.push(format!("{c} container(s)"));
    }
    if let Some(r) = d.remaining_mib {
        parts.push(match d.total_mib {
            Some(t) => format!("{r} of {t} MiB remaining"),
            None => format!("{r} MiB remaining"),
        });
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

fn count(c: Option<i64>) -> u64 {
    c.and_then(|c| u64::try_from(c).ok()).unwrap_or(0)
}

/// The first few of `items`, joined, and how many more: a detail stays short whatever ECS
/// lists.
fn cap_list(items: &[String]) -> String {
    const SHOWN: usize = 8;
    let mut s = items
        .iter()
        .take(SHOWN)
        .map(|i| crate::mps::control::clip(i, 200))
        .collect::<Vec<_>>()
        .join("; ");
    if items.len() > SHOWN {
        s.push_str(&format!(" and {} more", items.len() - SHOWN));
    }
    s
}

/// Sets the GPUs ECS gave whole to one container ([`ExpectedGpus::dedicated`]) and the
/// expected GPU count: the instance type's (the hardware's), kept apart too, which a set
/// `[nvml] expected_gpus` is checked against. ECS's registered count is never the expected
/// count (see the module's doc: a wrong one would replace a healthy node).
fn learn_expected(expected: &ExpectedGpus, read: Option<&EcsRead>, instance_type: Option<&str>) {
    if let Some(r) = read {
        expected.set_dedicated(
            r.devices
                .iter()
                .filter(|d| d.sharing_mode.as_deref() == Some("DEDICATED"))
                .map(|d| d.id.clone())
                .collect(),
        );
    }
    if let Some((t, n)) = learn_type_count(expected, instance_type) {
        expected.set(n, format!("instance type {t}"));
    }
}

/// The instance type's GPU count (docs/gpu-instance-types.md), kept apart in `expected`;
/// `None` for a type not in the table.
fn learn_type_count<'a>(
    expected: &ExpectedGpus,
    instance_type: Option<&'a str>,
) -> Option<(&'a str, u32)> {
    let by_type = instance_type.and_then(|t| Some((t, instance_types::gpu_count(t)?)));
    if let Some((t, n)) = by_type {
        expected.set_type(n, t);
    }
    by_type
}

/// Why a read did not give ECS's view.
#[derive(Debug)]
pub enum ReadError {
    /// This instance is not registered with ECS yet (boot): nothing to compare, no fault.
    NotRegistered(String),
    /// The read failed.
    Failed { message: String, retryable: bool },
}

impl From<CallError> for ReadError {
    fn from(e: CallError) -> Self {
        ReadError::Failed {
            retryable: e.retryable,
            message: e.to_string(),
        }
    }
}

/// Reads this instance's container instance. `target` caches (ECS, container instance ARN)
/// once found.
async fn read_instance(
    cfg: &Config,
    client: &aws_sdk_ecs::Client,
    http: &aws_sdk_ecs::config::SharedHttpClient,
    target: &mut Option<(Ecs, String)>,
) -> Result<EcsRead, ReadError> {
    let mut calls = Calls::new();
    if target.is_none() {
        let view = identity::agent_view(cfg).await;
        let ecs = Ecs::new(client.clone(), view.cluster.clone());
        let arn = match view.container_instance_arn {
            Some(a) => a,
            None => {
                let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
                let id = identity::instance_id(cfg, http.clone(), deadline)
                    .await
                    .map_err(|e| ReadError::NotRegistered(format!("no instance id: {e}")))?;
                identity::find_container_instance(&ecs, &id, &mut calls)
                    .await?
                    .ok_or_else(|| {
                        ReadError::NotRegistered(format!(
                            "{id} is not registered in cluster {}",
                            view.cluster
                        ))
                    })?
            }
        };
        *target = Some((ecs, arn));
    }
    let Some((ecs, arn)) = target.as_ref() else {
        return Err(ReadError::NotRegistered("no container instance".into()));
    };
    let state = ecs.describe_one(&mut calls, arn, true).await?;
    Ok(EcsRead::from_instance(&state))
}

/// The continuous probe for `gpu-medic run` (with `[aws]`, `[nvml]` and `[ecs] gpu_view`).
pub struct EcsGpuSource {
    cfg: Config,
    view: NvmlView,
    expected: ExpectedGpus,
    wake: Arc<Notify>,
}

impl EcsGpuSource {
    /// `view`: the NVML poller's; `expected`: what the poller reads while
    /// `[nvml] expected_gpus` is unset; `wake`: notified by the supervisor at each GPU signal.
    pub fn new(cfg: Config, view: NvmlView, expected: ExpectedGpus, wake: Arc<Notify>) -> Self {
        EcsGpuSource {
            cfg,
            view,
            expected,
            wake,
        }
    }
}

impl Source for EcsGpuSource {
    fn name(&self) -> &'static str {
        SOURCE
    }

    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        _resume: crate::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move { self.watch(tx, shutdown).await })
    }
}

fn self_fault(detail: String) -> Observation {
    Observation::new(Signal::SelfFault {
        component: COMPONENT.into(),
    })
    .with_detail(detail)
    .from_source(SOURCE)
}

impl EcsGpuSource {
    async fn watch(self, tx: mpsc::Sender<Observation>, shutdown: CancellationToken) {
        let sdk = crate::aws::loader(&self.cfg.aws).load().await;
        let client = aws_sdk_ecs::Client::new(&sdk);
        let http = sdk.http_client().unwrap_or_else(crate::aws::http_client);
        let interval = self.cfg.ecs.gpu_view_interval;
        let spacing = WAKE_SPACING.min(interval);
        let mut w = Watch::new();
        loop {
            let Some((out, retry_soon)) = w.turn(&self, &client, &http, &shutdown).await else {
                return;
            };
            for o in out {
                if tx.send(o).await.is_err() {
                    return;
                }
            }
            // A failed read: full jitter over a window doubling from 30 s, at most the
            // interval or 5 minutes; a good one: the interval, spread over [0.5, 1.5) of it so
            // a fleet started together does not read ECS together (`sys::backoff`).
            let wait = if retry_soon {
                crate::sys::backoff::full_jitter(
                    Duration::from_secs(30),
                    w.failures.saturating_sub(1),
                    interval.min(Duration::from_secs(300)),
                )
                .min(interval)
            } else {
                crate::sys::backoff::spread(interval)
            };
            let started = tokio::time::Instant::now();
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(wait) => {}
                _ = self.wake.notified() => {
                    // A GPU signal: read again, but not more often than `spacing`.
                    tokio::select! {
                        _ = shutdown.cancelled() => return,
                        _ = tokio::time::sleep_until(started + spacing) => {}
                    }
                }
            }
        }
    }

    /// ECS's view against NVML's latest, saved for `status`; the mismatches found.
    fn compare_and_save(&self, read: &EcsRead, nvml: &ViewSnapshot) -> Vec<Observation> {
        // The hardware's count: the instance type's, or the one the operator set.
        let expected = self.expected.resolve(self.cfg.nvml.expected_gpus).expected;
        let (found, gpus) = compare(read, nvml, expected.as_ref());
        let kept = Comparison {
            observed_at: Timestamp::now(),
            ecs_count: read.count(),
            nvml_count: nvml.count,
            expected,
            gpus,
            observations: found.clone(),
        };
        self.cfg
            .files()
            .save_view(crate::config::View::GpuView, &kept);
        found
    }
}

/// The source's state between reads.
struct Watch {
    /// IMDS is asked until it answers (it may have no type: then `instance_type` stays None).
    instance_type: Option<String>,
    type_known: bool,
    said_unregistered: bool,
    target: Option<(Ecs, String)>,
    failures: u32,
    faulted: bool,
    warned_no_gpus: bool,
    agent: AgentWatch,
}

impl Watch {
    fn new() -> Self {
        Watch {
            instance_type: None,
            type_known: false,
            said_unregistered: false,
            target: None,
            failures: 0,
            faulted: false,
            warned_no_gpus: false,
            agent: AgentWatch::default(),
        }
    }

    /// One read: the observations, and whether to read again soon. `None`: gpu-medic stops.
    async fn turn(
        &mut self,
        src: &EcsGpuSource,
        client: &aws_sdk_ecs::Client,
        http: &aws_sdk_ecs::config::SharedHttpClient,
        shutdown: &CancellationToken,
    ) -> Option<(Vec<Observation>, bool)> {
        // The instance type's count is learnt whether `[nvml] expected_gpus` is set or not:
        // it is the default when unset and the check when set.
        if !self.type_known {
            let asked = tokio::select! {
                _ = shutdown.cancelled() => return None,
                r = imds::instance_type(http.clone()) => r,
            };
            match asked {
                Ok(t) => {
                    self.instance_type = t;
                    self.type_known = true;
                }
                Err(e) => tracing::debug!(probe = SOURCE, "IMDS instance-type: {e}"),
            }
            // Told before the first read of ECS: the poller holds a set
            // `[nvml] expected_gpus` to the type's count from its first comparison on.
            learn_type_count(&src.expected, self.instance_type.as_deref());
            src.expected.type_asked();
        }
        let read = tokio::select! {
            _ = shutdown.cancelled() => return None,
            r = read_instance(&src.cfg, client, http, &mut self.target) => r,
        };
        let mut out = Vec::new();
        let retry_soon = match read {
            Ok(read) => {
                self.answered(src, &read, &mut out);
                let nvml = tokio::select! {
                    _ = shutdown.cancelled() => return None,
                    v = src.view.first(FIRST_POLL_WAIT) => v,
                };
                match nvml {
                    Some(nvml) => {
                        out.extend(src.compare_and_save(&read, &nvml));
                        false
                    }
                    None => true,
                }
            }
            Err(ReadError::NotRegistered(why)) => {
                if !std::mem::replace(&mut self.said_unregistered, true) {
                    tracing::info!(probe = SOURCE, "ECS GPU view not read yet: {why}");
                }
                self.learn_type(src, None);
                self.target = None;
                true
            }
            Err(ReadError::Failed { message, retryable }) => {
                self.failed(src, &message, retryable, &mut out);
                true
            }
        };
        Some((out, retry_soon))
    }

    /// Learns the count (used while `[nvml] expected_gpus` is unset, checking it when set).
    fn learn_type(&self, src: &EcsGpuSource, read: Option<&EcsRead>) {
        learn_expected(&src.expected, read, self.instance_type.as_deref());
    }

    /// ECS answered: a self-fault recovered, the agent's health, the count learned.
    fn answered(&mut self, src: &EcsGpuSource, read: &EcsRead, out: &mut Vec<Observation>) {
        self.failures = 0;
        if std::mem::take(&mut self.faulted) {
            out.push(
                Observation::new(Signal::SelfRecovered {
                    component: COMPONENT.into(),
                })
                .with_detail("DescribeContainerInstances answers again")
                .from_source(SOURCE),
            );
        }
        self.learn_type(src, Some(read));
        out.extend(self.agent.read(read.agent_health.as_ref()));
        if read.count() == 0 && !self.warned_no_gpus {
            self.warned_no_gpus = true;
            tracing::info!(
                probe = SOURCE,
                "ECS lists no GPU for this container instance (no gpuDevices, no GPU resource): nothing to compare"
            );
        }
    }

    /// A read that failed: never a GPU signal; a self-fault after a few in a row (or one that
    /// retrying cannot fix).
    fn failed(
        &mut self,
        src: &EcsGpuSource,
        message: &str,
        retryable: bool,
        out: &mut Vec<Observation>,
    ) {
        self.failures += 1;
        if !retryable {
            // Perhaps the instance was registered anew: find it again.
            self.target = None;
        }
        tracing::warn!(
            probe = SOURCE,
            failures = self.failures,
            retryable,
            "cannot read ECS's view of the GPUs: {message} (never a GPU signal)"
        );
        self.learn_type(src, None);
        if !self.faulted && (self.failures >= FAILURES_FOR_SELF_FAULT || !retryable) {
            self.faulted = true;
            out.push(self_fault(format!(
                "DescribeContainerInstances failed {} time(s) in a row: {message}",
                self.failures
            )));
        }
    }
}

/// The ECS agent's `ACCELERATED_COMPUTE` verdict (`healthStatus`, read by the same
/// DescribeContainerInstances call as the GPU view), reported when it changes:
/// `ecs-agent-impaired` when it turns IMPAIRED (a second opinion the policy judges, default
/// corroborating only), `ecs-agent-health` for any other status (INSUFFICIENT_DATA is no
/// fault). docs/planned-events.md#the-ecs-agents-verdict.
#[derive(Debug, Default)]
pub struct AgentWatch {
    last: Option<String>,
}

impl AgentWatch {
    pub fn read(&mut self, health: Option<&(String, String)>) -> Option<Observation> {
        let (status, detail) = health?;
        if self.last.as_deref() == Some(status.as_str()) || status.is_empty() {
            return None;
        }
        self.last = Some(status.clone());
        let text = format!(
            "ECS agent (DescribeContainerInstances healthStatus): ACCELERATED_COMPUTE {status}{}",
            if detail.is_empty() {
                String::new()
            } else {
                format!(", {detail}")
            }
        );
        tracing::info!(probe = SOURCE, agent_status = %status, "{text}");
        let signal = if status == "IMPAIRED" {
            Signal::EcsAgentImpaired
        } else {
            Signal::EcsAgentHealth {
                status: status.clone(),
            }
        };
        Some(
            Observation::new(signal)
                .with_detail(text)
                .from_source(SOURCE),
        )
    }
}

/// `gpu-medic check`: reads ECS's view once (None when this instance is not registered yet,
/// e.g. the launch gate at boot), so the expected GPU count can be learnt before NVML is
/// polled and the views compared after.
pub fn read_once(cfg: &Config) -> Result<Option<EcsRead>, ReadError> {
    let mut quick = cfg.clone();
    // A one-shot look does not wait for an agent that is not up.
    quick.ecs.agent_wait = quick.ecs.agent_wait.min(Duration::from_secs(2));
    block_on(async {
        let sdk = crate::aws::loader(&quick.aws).load().await;
        let client = aws_sdk_ecs::Client::new(&sdk);
        let http = sdk.http_client().unwrap_or_else(crate::aws::http_client);
        match read_instance(&quick, &client, &http, &mut None).await {
            Ok(r) => Ok(Some(r)),
            Err(ReadError::NotRegistered(why)) => {
                tracing::info!(probe = SOURCE, "ECS GPU view not read: {why}");
                Ok(None)
            }
            Err(e) => Err(e),
        }
    })
    .unwrap_or_else(|e| {
        Err(ReadError::Failed {
            message: e,
            retryable: true,
        })
    })
}

/// Runs `f` to completion from blocking code: on the runtime this thread belongs to (the
/// launch gate runs the check on a blocking thread of its runtime), else on a runtime of its
/// own.
fn block_on<F: Future>(f: F) -> Result<F::Output, String> {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => Ok(h.block_on(f)),
        Err(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map(|rt| rt.block_on(f))
            .map_err(|e| format!("cannot start a runtime: {e}")),
    }
}

/// `gpu-medic check`: the expected count from the instance type (IMDS), else ECS's read.
/// The type is always asked: it is the hardware's count, which ECS's never overrides.
pub fn learn_expected_once(cfg: &Config, read: Option<&EcsRead>, expected: &ExpectedGpus) {
    let instance_type = block_on(async {
        let sdk = crate::aws::loader(&cfg.aws).load().await;
        let http = sdk.http_client().unwrap_or_else(crate::aws::http_client);
        imds::instance_type(http).await.ok().flatten()
    })
    .ok()
    .flatten();
    learn_expected(expected, read, instance_type.as_deref());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GpuId;
    use crate::probe::nvml::view::{self, GpuView};

    const GIB: u64 = 1024 * MIB;

    /// The count of instance type g5.12xlarge as [`ExpectedGpus::resolve`] gives it.
    fn by_type(count: u32) -> Expected {
        Expected {
            count,
            source: "instance type g5.12xlarge".into(),
        }
    }

    /// (index, uuid, lost, (used, total) bytes).
    type Gpu<'a> = (u32, &'a str, bool, Option<(u64, u64)>);

    fn nvml(gpus: &[Gpu<'_>], count: u32) -> ViewSnapshot {
        let mut v = ViewSnapshot {
            count,
            ..ViewSnapshot::default()
        };
        for (i, uuid, lost, memory) in gpus {
            v.gpus.insert(
                *i,
                GpuView {
                    gpu: GpuId {
                        index: *i,
                        uuid: uuid.to_string(),
                        ..GpuId::default()
                    },
                    lost: *lost,
                    memory: *memory,
                },
            );
        }
        v
    }

    fn mps(id: &str, remaining: i64, containers: i64) -> GpuDevice {
        GpuDevice {
            id: id.into(),
            sharing_mode: Some("NVIDIA_MPS".into()),
            total_mib: Some(81_559),
            remaining_mib: Some(remaining),
            containers: Some(containers),
        }
    }

    fn kinds(o: &[Observation]) -> Vec<String> {
        o.iter().map(|o| o.signal.to_string()).collect()
    }

    #[test]
    fn agreeing_views_raise_nothing() {
        let read = EcsRead {
            devices: vec![mps("GPU-a", 40_000, 1), mps("GPU-b", 80_000, 0)],
            registered: vec![],
            agent_health: None,
        };
        let v = nvml(
            &[
                (0, "GPU-a", false, Some((30 * GIB, 80 * GIB))),
                (1, "GPU-b", false, Some((GIB / 2, 80 * GIB))),
            ],
            2,
        );
        let (found, lines) = compare(&read, &v, None);
        assert!(found.is_empty(), "{found:?}");
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].nvml, "ok");
        assert_eq!(lines[0].nvml_free_mib, Some(50 * 1024));
    }

    #[test]
    fn a_lost_gpu_ecs_still_lists_is_reported_with_the_numbers() {
        let read = EcsRead {
            devices: vec![mps("GPU-a", 40_000, 2), mps("GPU-b", 81_559, 0)],
            registered: vec![],
            agent_health: None,
        };
        let v = nvml(
            &[
                (0, "GPU-a", true, None),
                (1, "GPU-b", false, Some((0, 80 * GIB))),
            ],
            2,
        );
        let (found, lines) = compare(&read, &v, None);
        assert_eq!(kinds(&found), ["ecs-gpu-missing"]);
        assert_eq!(found[0].gpu.as_ref().map(|g| g.index), Some(0));
        assert_eq!(found[0].value, 2);
        let d = found[0].detail.as_deref().unwrap();
        assert!(
            d.contains("GPU-a") && d.contains("2 container(s)") && d.contains("40000 of 81559"),
            "{d}"
        );
        assert_eq!(lines[0].nvml, "lost");
        assert_eq!(found[0].source, SOURCE);
    }

    #[test]
    fn gpus_nvml_does_not_see_are_one_finding_and_the_counts_disagree() {
        let read = EcsRead {
            devices: vec![],
            registered: vec!["GPU-a".into(), "GPU-b".into(), "GPU-c".into()],
            agent_health: None,
        };
        let v = nvml(&[(0, "GPU-a", false, None)], 1);
        // No hardware count: ECS's list alone is a count mismatch (logged), naming them.
        let (found, _) = compare(&read, &v, None);
        assert_eq!(kinds(&found), ["ecs-gpu-count-mismatch"]);
        assert!(
            found[0]
                .detail
                .as_deref()
                .is_some_and(|d| d.contains("GPU-b") && d.contains("not hardware missing")),
            "{found:?}"
        );
        // The instance type has 3: two are missing.
        let (found, lines) = compare(&read, &v, Some(&by_type(3)));
        assert_eq!(kinds(&found), ["ecs-gpu-missing", "ecs-gpu-count-mismatch"]);
        assert!(found[0].gpu.is_none());
        assert_eq!(found[0].value, 2);
        assert!(found[0].detail.as_deref().unwrap().contains("GPU-b"));
        assert_eq!(found[1].value, 2);
        assert_eq!(
            lines.iter().map(|l| l.nvml.as_str()).collect::<Vec<_>>(),
            ["ok", "missing", "missing"]
        );
    }

    #[test]
    fn a_gpu_lost_before_nvml_named_it_is_lost_or_missing() {
        let read = EcsRead {
            devices: vec![mps("GPU-a", 40_000, 1), mps("GPU-b", 40_000, 1)],
            registered: vec![],
            agent_health: None,
        };
        let v = nvml(&[(0, "GPU-a", false, None), (1, "", true, None)], 2);
        // No hardware count is needed: NVML itself reports the GPU lost.
        let (found, lines) = compare(&read, &v, None);
        assert_eq!(kinds(&found), ["ecs-gpu-missing"]);
        assert!(
            found[0]
                .detail
                .as_deref()
                .unwrap()
                .contains("1 GPU(s) lost that it cannot name"),
            "{found:?}"
        );
        assert_eq!(lines[1].nvml, "lost or missing");
    }

    #[test]
    fn memory_ecs_believes_free_that_nvml_shows_in_use_is_the_excess() {
        // ECS: 40000 MiB remaining; NVML: 70 of 80 GiB in use (10240 MiB free).
        let read = EcsRead {
            devices: vec![mps("GPU-a", 40_000, 1)],
            registered: vec![],
            agent_health: None,
        };
        let v = nvml(&[(0, "GPU-a", false, Some((70 * GIB, 80 * GIB)))], 1);
        let (found, _) = compare(&read, &v, None);
        assert_eq!(kinds(&found), ["ecs-gpu-memory-in-use"]);
        assert_eq!(found[0].value, 40_000 - 10_240);
        // A dedicated GPU's remaining memory means nothing for MPS placement.
        let mut dedicated = read.clone();
        dedicated.devices[0].sharing_mode = Some("DEDICATED".into());
        assert!(compare(&dedicated, &v, None).0.is_empty());
    }

    #[test]
    fn an_instance_ecs_lists_no_gpu_for_is_not_compared() {
        let v = nvml(&[(0, "GPU-a", false, None)], 1);
        assert!(compare(&EcsRead::default(), &v, None).0.is_empty());
    }

    #[test]
    fn the_gpus_ecs_dedicates_to_one_container_are_learnt_and_a_failed_read_keeps_them() {
        let e = ExpectedGpus::new();
        let mut dedicated = mps("GPU-b", 0, 1);
        dedicated.sharing_mode = Some("DEDICATED".into());
        let read = EcsRead {
            devices: vec![mps("GPU-a", 1024, 1), dedicated],
            ..EcsRead::default()
        };
        learn_expected(&e, Some(&read), None);
        assert_eq!(e.dedicated(), ["GPU-b".to_string()].into());
        learn_expected(&e, None, None);
        assert_eq!(
            e.dedicated(),
            ["GPU-b".to_string()].into(),
            "not read: kept"
        );
        learn_expected(&e, Some(&EcsRead::default()), None);
        assert!(e.dedicated().is_empty());
    }

    #[test]
    fn the_expected_count_comes_from_the_instance_type_never_from_ecs() {
        let e = ExpectedGpus::new();
        learn_expected(&e, None, Some("m5.large"));
        assert_eq!(e.get(), None, "a type without GPUs sets nothing");
        learn_expected(&e, Some(&EcsRead::default()), Some("p5.48xlarge"));
        assert_eq!(
            e.get().map(|x| (x.count, x.source)),
            Some((8, "instance type p5.48xlarge".into()))
        );
        let read = |n: usize| EcsRead {
            registered: (0..n).map(|i| format!("GPU-{i}")).collect(),
            ..EcsRead::default()
        };
        learn_expected(&e, Some(&read(2)), Some("p5.48xlarge"));
        assert_eq!(
            e.get().map(|x| (x.count, x.source)),
            Some((8, "instance type p5.48xlarge".into())),
            "the orchestrator's count never overrides the hardware's"
        );
        let e = ExpectedGpus::new();
        learn_expected(&e, Some(&read(10_000)), None);
        assert_eq!(e.get(), None, "a count beyond any instance type is ignored");
        learn_expected(&e, Some(&read(4)), Some("an-unknown.type"));
        assert_eq!(
            e.get(),
            None,
            "an unknown type: ECS's count is not the hardware's"
        );
        learn_expected(&e, Some(&read(4)), None);
        assert_eq!(e.get(), None, "no type at all: the same");
    }

    /// ECS lists GPUs NVML does not see on an instance where NVML sees every GPU the type
    /// has: a count mismatch (logged), not missing hardware (replace).
    #[test]
    fn extra_gpus_ecs_lists_beside_all_the_hardware_are_a_count_mismatch() {
        let v = nvml(
            &[
                (0, "GPU-0", false, None),
                (1, "GPU-1", false, None),
                (2, "GPU-2", false, None),
                (3, "GPU-3", false, None),
            ],
            4,
        );
        let read = EcsRead {
            registered: (0..8).map(|i| format!("GPU-{i}")).collect(),
            ..EcsRead::default()
        };
        let (found, _) = compare(&read, &v, Some(&by_type(4)));
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!(found[0].signal, Signal::EcsGpuCountMismatch, "{found:#?}");
        assert!(
            found[0]
                .detail
                .as_deref()
                .is_some_and(|d| d.contains("the instance type g5.12xlarge has 4")),
            "{found:#?}"
        );
        let (found, _) = compare(&read, &v, None);
        assert_eq!(found.len(), 1, "{found:#?}");
        assert_eq!(
            found[0].signal,
            Signal::EcsGpuCountMismatch,
            "type unknown: ECS's list alone is not missing hardware"
        );
        assert!(
            found[0]
                .detail
                .as_deref()
                .is_some_and(|d| d.contains("is not known")),
            "{found:#?}"
        );
        let set = Expected {
            count: 8,
            source: view::CONFIGURED.into(),
        };
        let (found, _) = compare(&read, &v, Some(&set));
        assert!(
            found.iter().any(|o| o.signal == Signal::EcsGpuMissing),
            "the hardware's count says GPUs are missing: {found:#?}"
        );
        assert!(
            found.iter().any(|o| o
                .detail
                .as_deref()
                .is_some_and(|d| d.contains("; [nvml] expected_gpus = 8"))),
            "{found:#?}"
        );
        let huge = EcsRead {
            registered: (0..10_000).map(|i| format!("GPU-{i}")).collect(),
            ..EcsRead::default()
        };
        let (found, _) = compare(&huge, &v, None);
        assert_eq!(found.len(), 1, "{}", found.len());
        assert_eq!(found[0].signal, Signal::EcsGpuCountMismatch);
        assert!(found[0].detail.as_deref().is_some_and(|d| d.len() < 2048));
    }
}
