//! Senses: each probe turns part of the world into `Observation`s. A probe never decides
//! anything; it reports what it saw, and degrades to an observation or a warning (never a
//! panic) when its source is missing.
//!
//! - [`nvml`]: the GPUs (events and counters).
//! - [`mps`]: the MPS control daemon (control pipe probe, process identity, log tail).
//! - [`tasks`]: which ECS task a process belongs to; [`identity`]: whether a process is one of
//!   the installed programs that hold a GPU outside MPS by design, by its executable as a file.
//! - [`lifecycle`]: Auto Scaling's target lifecycle state (IMDS), for termination.
//! - [`node`]: the ECS agent answering, and space for the journal.
//! - [`ecs_gpus`]: ECS's view of the GPUs (`gpuDevices`) against NVML's, and the ECS agent's
//!   own health verdict (`healthStatus`) from the same call.
//! - [`planned`]: disruptions AWS plans (IMDS scheduled events, Spot notice, rebalance).
//! - [`fabric_manager`]: NVIDIA Fabric Manager on instance types with NVSwitches.
//! - [`efa`]: the EFA / RDMA ports (sysfs). [`sxid`]: NVSwitch errors in the kernel log.

pub mod attribution;
pub mod ecs_gpus;
pub mod efa;
pub mod fabric_manager;
pub mod identity;
pub mod kernel_record;
pub mod kmsg;
pub mod lifecycle;
pub mod mps;
pub mod mps_view;
pub mod node;
pub mod nvml;
pub mod planned;
pub mod sxid;
pub mod tasks;

use std::future::Future;
use std::pin::Pin;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::model::{GpuId, Observation};
use crate::mps::control::ControlClient;

/// A sense: turns the world into observations until shutdown. `resume` holds the cursors
/// the journal has committed (the supervisor owns the state and hands them in): a source
/// that reads a stream starts after them; the others ignore it.
pub trait Source: Send + 'static {
    fn name(&self) -> &'static str;
    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        resume: crate::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>>;
}

/// Which signals the running policy takes the node out of service for
/// ([`crate::policy::Policy::is_fatal`]). A reader that takes a burst of records at once (the
/// kernel log, NVML's event queue) hands these over first, so a fatal signal never waits
/// behind a storm that arrived with it. It only orders a reader's hand-over: the supervisor
/// judges every observation again with its own policy. The default knows no policy and
/// finds nothing urgent (records keep their order).
#[derive(Clone, Default)]
pub struct Urgency(Option<std::sync::Arc<UrgencyTable>>);

/// The policy's verdicts on XIDs, worked out once (a storm asks for every record): per code
/// a rule names and per decode, and per decode for every other code (the catch-all's).
struct UrgencyTable {
    policy: crate::policy::Policy,
    named: std::collections::HashMap<(u32, Option<crate::model::XidDecode>), bool>,
    named_codes: std::collections::HashSet<u32>,
    other: std::collections::HashMap<Option<crate::model::XidDecode>, bool>,
}

impl Urgency {
    pub fn of(policy: &crate::policy::Policy) -> Urgency {
        use crate::model::{Signal, XidDecode};
        let named_codes: std::collections::HashSet<u32> = policy
            .rules
            .iter()
            .filter_map(|r| r.xids.as_ref())
            .flatten()
            .copied()
            .collect();
        let decodes = || {
            XidDecode::ALL
                .into_iter()
                .map(Some)
                .chain(std::iter::once(None))
        };
        let fatal = |code, decode| policy.is_fatal(&Signal::Xid { code, decode }, 0);
        let named = named_codes
            .iter()
            .flat_map(|&code| decodes().map(move |d| (code, d)))
            .map(|(code, d)| ((code, d), fatal(code, d)))
            .collect();
        // A code no rule names: the lowest one (rules name few).
        let unnamed = (0..=u32::MAX)
            .find(|c| !named_codes.contains(c))
            .unwrap_or(u32::MAX);
        let other = decodes().map(|d| (d, fatal(unnamed, d))).collect();
        Urgency(Some(std::sync::Arc::new(UrgencyTable {
            policy: policy.clone(),
            named,
            named_codes,
            other,
        })))
    }

    /// Whether the policy takes the node out of service for `signal`.
    pub fn is_urgent(&self, signal: &crate::model::Signal) -> bool {
        let Some(t) = &self.0 else {
            return false;
        };
        match signal {
            crate::model::Signal::Xid { code, decode } if t.named_codes.contains(code) => {
                t.named.get(&(*code, *decode)).copied().unwrap_or(false)
            }
            crate::model::Signal::Xid { decode, .. } => {
                t.other.get(decode).copied().unwrap_or(false)
            }
            other => t.policy.is_fatal(other, 0),
        }
    }
}

#[cfg(test)]
mod urgency_tests {
    use super::*;
    use crate::model::{RecoveryAction, Signal, XidDecode};

    /// The table answers as the policy does, for named and unnamed codes and every decode.
    #[test]
    fn urgency_is_the_policys_verdict() {
        let policy = crate::config::load_policy(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies/default.toml"),
        )
        .unwrap();
        let u = Urgency::of(&policy);
        let decodes = XidDecode::ALL.into_iter().map(Some).chain([None]);
        for code in (0..400).chain([100_000, u32::MAX]) {
            for d in decodes.clone() {
                let s = Signal::Xid { code, decode: d };
                assert_eq!(u.is_urgent(&s), policy.is_fatal(&s, 0), "{s:?}");
            }
        }
        assert!(u.is_urgent(&Signal::xid(79)));
        assert!(!u.is_urgent(&Signal::xid(13)));
        for action in [RecoveryAction::None, RecoveryAction::GpuReset] {
            let s = Signal::RecoveryAction { action };
            assert_eq!(u.is_urgent(&s), policy.is_fatal(&s, 0));
        }
        assert!(!Urgency::default().is_urgent(&Signal::xid(79)));
    }
}

/// A probe that can also answer once, for `gpu-medic check` and the launch gate.
pub trait Snapshot {
    fn name(&self) -> &'static str;
    /// What the probe sees right now. `Err` means it could not look at all.
    fn snapshot(&mut self) -> Result<SnapshotReport, ProbeError>;
}

#[derive(Debug, Default)]
pub struct SnapshotReport {
    pub observations: Vec<Observation>,
    /// Parts it could not read (a counter that failed unexpectedly).
    pub problems: Vec<String>,
    /// What it left out on purpose, to say: no problem (a kernel log file's records of
    /// earlier boots).
    pub notes: Vec<String>,
    /// The GPUs it saw.
    pub gpus: Vec<GpuId>,
}

/// Why a probe could not look. `retryable` says whether looking again may succeed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{probe}: {message}")]
pub struct ProbeError {
    pub probe: &'static str,
    pub message: String,
    pub retryable: bool,
}

/// The one-shot probes enabled by `cfg`; the NVML probe publishes its GPUs to `view` and
/// expects the count it holds while `[nvml] expected_gpus` is unset (the ECS GPU view,
/// `gpu-medic check`).
pub fn snapshot_probes(
    cfg: &Config,
    view: Option<(nvml::view::NvmlView, nvml::view::ExpectedGpus)>,
) -> Vec<Box<dyn Snapshot>> {
    let mut out: Vec<Box<dyn Snapshot>> = Vec::new();
    if cfg.nvml.enabled {
        let installed = identity::Installed::from_config(&cfg.mps, &cfg.diagnose);
        let mut p = nvml::NvmlSnapshot::new(cfg.nvml.clone(), installed)
            .with_links(cfg.links.clone())
            .with_boot_id_path(cfg.repair.boot_id_path.clone());
        if let Some((v, e)) = view {
            p = p.with_view(v, e);
        }
        out.push(Box::new(p));
    }
    if cfg.mps.enabled {
        out.push(Box::new(mps::MpsSnapshot::new(cfg.mps.clone())));
    }
    if fabric_manager::snapshot_enabled(cfg) {
        out.push(Box::new(fabric_manager::FabricManagerSnapshot::new(
            cfg.clone(),
        )));
    }
    // Only an instance with RDMA devices has ports to look at: elsewhere this probe would
    // pass for a look at nothing.
    if cfg.links.efa && !efa::read_ports(&cfg.links.infiniband_root).is_empty() {
        out.push(Box::new(efa::EfaSnapshot {
            cfg: cfg.links.clone(),
        }));
    }
    out
}

/// The continuous probes enabled by `cfg`, for `gpu-medic run`. `urgency` orders bursts by
/// the running policy ([`Urgency`]); `mps` is the control client the MPS remedy also holds.
///
/// `accounting` receives every NVML poll's GPUs and per-task GPU memory (for the metrics).
/// Per-task GPU memory is also checked against reservations (with `[aws]` on), kept in the
/// history `gpu-medic tasks` reads, and written as EMF lines (`[metrics] emf`) either way.
pub fn sources(
    cfg: &Config,
    urgency: Urgency,
    mps: &ControlClient,
    accounting: Option<&crate::accounting::usage::Accounting>,
) -> Vec<Box<dyn Source>> {
    sources_with_gpu_view(cfg, urgency, mps, accounting, None)
}

/// Whether ECS's view of the GPUs is compared with NVML's (`[ecs] gpu_view`, with `[aws]` and
/// `[nvml]` enabled).
pub fn gpu_view_enabled(cfg: &Config) -> bool {
    cfg.aws.enabled && cfg.nvml.enabled && cfg.ecs.gpu_view
}

/// [`sources`], plus the ECS GPU view ([`ecs_gpus`]) when enabled: `wake` is notified by the
/// supervisor at every GPU signal, so ECS's view is read again after it.
pub fn sources_with_gpu_view(
    cfg: &Config,
    urgency: Urgency,
    mps: &ControlClient,
    accounting: Option<&crate::accounting::usage::Accounting>,
    wake: Option<std::sync::Arc<tokio::sync::Notify>>,
) -> Vec<Box<dyn Source>> {
    let mut out: Vec<Box<dyn Source>> = Vec::new();
    // MPS's own view against NVML's: the NVML poller publishes its process lists, the MPS
    // probe compares the daemon's servers and clients with them (both must run).
    let exchange = (cfg.nvml.enabled && cfg.mps.enabled).then(mps_view::Exchange::new);
    if cfg.nvml.enabled {
        // The installed files of the programs that may hold a GPU outside MPS, once, at start.
        let installed = identity::Installed::from_config(&cfg.mps, &cfg.diagnose);
        let mut source = nvml::NvmlSource::new(cfg.nvml.clone(), cfg.state_dir.clone(), installed)
            .with_urgency(urgency)
            .with_emf(cfg.metrics.emf)
            .with_links(cfg.links.clone())
            .with_boot_id_path(cfg.repair.boot_id_path.clone());
        if cfg.aws.enabled {
            source = source.with_ecs(cfg.ecs.agent_url.clone(), cfg.aws.clone());
        }
        if let Some(a) = accounting {
            source = source.with_accounting(a.clone());
        }
        if let Some(x) = &exchange {
            source = source.with_mps_view(x.clone());
        }
        if let Some(wake) = wake.filter(|_| gpu_view_enabled(cfg)) {
            let view = nvml::view::NvmlView::new();
            let expected = nvml::view::ExpectedGpus::learning();
            source = source.with_view(view.clone(), expected.clone());
            out.push(Box::new(ecs_gpus::EcsGpuSource::new(
                cfg.clone(),
                view,
                expected,
                wake,
            )));
        }
        out.push(Box::new(source));
    }
    if cfg.mps.enabled {
        let mut source = mps::MpsSource::new(cfg.mps.clone(), mps.clone())
            .naming_tasks_with(crate::aws::agent::Agent::new(&cfg.ecs.agent_url));
        if let Some(x) = exchange {
            source = source.with_view(x, cfg.state_dir.clone());
        }
        out.push(Box::new(source));
    }
    if cfg.aws.enabled && cfg.lifecycle.enabled {
        out.push(Box::new(lifecycle::LifecycleSource::new(
            cfg.lifecycle.poll_interval,
            crate::aws::http_client(),
        )));
    }
    if cfg.links.fabric_manager {
        out.push(Box::new(fabric_manager::FabricManagerSource::new(
            cfg.clone(),
        )));
    }
    if cfg.links.efa {
        out.push(Box::new(efa::EfaSource {
            cfg: cfg.links.clone(),
            state_dir: cfg.state_dir.clone(),
        }));
    }
    if cfg.aws.enabled && cfg.planned.enabled {
        out.push(Box::new(planned::PlannedSource::new(
            cfg.planned.clone(),
            crate::aws::http_client(),
        )));
    }
    if cfg.node.enabled {
        out.push(Box::new(node::NodeSource {
            agent_url: cfg.aws.enabled.then(|| cfg.ecs.agent_url.clone()),
            state_dir: cfg.state_dir.clone(),
            interval: cfg.node.interval,
        }));
    }
    out
}
