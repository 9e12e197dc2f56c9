//! The GPUs, through NVML (`nvml-wrapper`, loaded from `[nvml] library`): an event watcher
//! thread for XIDs, double-bit ECC and the driver's recovery action, and a poller for
//! counters. Degrades, never crashes. An unloaded driver (the library loads and says so) is
//! the one hardware case: a `driver-not-loaded` observation, retried every poll and judged by
//! the policy with its confirmation window. A library that cannot be loaded at all is a
//! mistake, not a fault of the GPUs: `run` and `check` refuse to start with it (exit 78, see
//! `crate::launch::preflight`), and if it stops loading later (a driver upgrade removed it) it is a
//! `self-fault` of gpu-medic, never a reason to drain. A missing symbol or NOT_SUPPORTED
//! counter is a one-time warning, an unexpected counter error a reported problem.

pub mod contract;
mod events;
pub mod header;
pub mod links;
pub(crate) mod poll;
mod raw;
pub mod view;

use std::ffi::OsStr;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::error::NvmlError;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use poll::{FIELD_RECOVERY_ACTION, PollReport, Poller, Shared, SharedState};

use super::{ProbeError, Snapshot, SnapshotReport};
use crate::accounting::{history, reserve, usage};
use crate::config::NvmlConfig;
use crate::model::{Observation, Signal};
use crate::probe::{Source, kmsg};

/// Why NVML could not be opened.
pub enum OpenError {
    /// The node cannot serve GPU tasks: the library loaded and says the driver is not loaded.
    NoDriver(String),
    /// The library cannot be loaded or is not NVML: a mistake (a wrong `[nvml] library`, a
    /// driver package missing), not a hardware fault.
    Unusable(String),
    /// Anything else (reported; the probe tries again).
    Other(String),
}

/// Opens NVML from a library name or path.
pub fn open(library: &str) -> Result<Nvml, OpenError> {
    // `dlopen` opens the path itself, blocking: a FIFO there would hang it for ever.
    if library.contains('/')
        && let Err(why) = crate::sys::limits::check_path_kind(
            std::path::Path::new(library),
            crate::sys::limits::Kind::Regular,
        )
    {
        return Err(OpenError::Unusable(format!(
            "[nvml] library {library} {why}"
        )));
    }
    match Nvml::builder().lib_path(OsStr::new(library)).init() {
        Ok(n) => Ok(n),
        Err(NvmlError::DriverNotLoaded) => Err(OpenError::NoDriver(format!(
            "NVML ({library}) says the NVIDIA driver is not loaded"
        ))),
        Err(NvmlError::LibloadingError(e)) => {
            Err(OpenError::Unusable(format!("cannot load {library}: {e}")))
        }
        Err(NvmlError::FailedToLoadSymbol(e)) => Err(OpenError::Unusable(format!(
            "{library} is not a usable NVML library: {e}"
        ))),
        Err(e) => Err(OpenError::Other(format!(
            "NVML init ({library}) failed: {e}"
        ))),
    }
}

/// The self-fault of an NVML that cannot be used (component `nvml`).
pub fn self_fault(detail: String) -> Observation {
    Observation::new(Signal::SelfFault {
        component: COMPONENT.into(),
    })
    .with_detail(detail)
    .from_source("nvml")
}

/// The all-clear for [`self_fault`].
pub fn self_recovered(detail: &str) -> Observation {
    Observation::new(Signal::SelfRecovered {
        component: COMPONENT.into(),
    })
    .with_detail(detail)
    .from_source("nvml")
}

/// The self-fault component name of the NVML probe.
pub const COMPONENT: &str = "nvml";

fn no_driver(detail: String) -> Observation {
    Observation::new(Signal::DriverNotLoaded)
        .with_detail(detail)
        .from_source("nvml")
}

/// The continuous NVML probe for `gpu-medic run`.
pub struct NvmlSource {
    cfg: NvmlConfig,
    proc_root: PathBuf,
    state_dir: PathBuf,
    accounting: Option<usage::Accounting>,
    /// The ECS agent's introspection API, to label tasks (`[aws]` on).
    agent_url: Option<String>,
    /// Every poll's GPUs and their memory, for the ECS cross-check.
    view: Option<view::NvmlView>,
    /// The expected GPU count learnt at run time (`[nvml] expected_gpus` unset).
    expected: Option<view::ExpectedGpus>,
    /// Task definitions' GPU memory reservations (`[aws]` on).
    reservations: Option<reserve::Reservations>,
    /// One embedded-metric-format line per task, container and GPU per poll on stdout.
    emf: bool,
    /// `[links]`: each GPU's fabric, NVLinks and PCIe link, read with the counters.
    links: Option<crate::config::LinksConfig>,
    /// What the event watcher and the kernel log reader hand over first from a burst.
    urgency: crate::probe::Urgency,
    /// The programs that may hold a GPU outside MPS, by their files, looked up once.
    installed: crate::probe::identity::Installed,
    /// `[repair] boot_id_path`: the boot a kernel log file's records are placed against.
    boot_id_path: Option<PathBuf>,
}

impl NvmlSource {
    /// `installed`: the installed programs that may hold a GPU outside MPS
    /// ([`crate::probe::identity::Installed::from_config`], looked up once at start).
    pub fn new(
        cfg: NvmlConfig,
        state_dir: PathBuf,
        installed: crate::probe::identity::Installed,
    ) -> Self {
        NvmlSource {
            installed,
            cfg,
            proc_root: PathBuf::from("/proc"),
            state_dir,
            accounting: None,
            agent_url: None,
            view: None,
            expected: None,
            reservations: None,
            emf: false,
            links: None,
            urgency: crate::probe::Urgency::default(),
            boot_id_path: None,
        }
    }

    /// Places a kernel log file's records against the boot `[repair] boot_id_path` tells.
    pub fn with_boot_id_path(mut self, path: PathBuf) -> Self {
        self.boot_id_path = Some(path);
        self
    }

    /// Hands fatal signals of a burst (by the running policy) over first.
    pub fn with_urgency(mut self, urgency: crate::probe::Urgency) -> Self {
        self.urgency = urgency;
        self
    }

    /// Reads each GPU's links with the counters (`[links]`), and keeps the latest poll's in
    /// `links.json` for `status`.
    pub fn with_links(mut self, cfg: crate::config::LinksConfig) -> Self {
        self.links = Some(cfg);
        self
    }

    /// Publishes every poll's GPUs to `view`, and expects the GPU count `expected` holds
    /// while `[nvml] expected_gpus` is unset.
    pub fn with_view(mut self, view: view::NvmlView, expected: view::ExpectedGpus) -> Self {
        self.view = Some(view);
        self.expected = Some(expected);
        self
    }

    fn poller(&self) -> Poller {
        let mut p = Poller::new(
            self.cfg.expected_gpus,
            self.proc_root.clone(),
            self.installed.clone(),
        );
        if let Some(l) = &self.links {
            p = p.with_links(l.clone());
        }
        match &self.expected {
            Some(e) => p.learning_expected(e.clone()),
            None => p,
        }
    }

    /// Publishes every poll's GPUs and per-task GPU memory to `accounting`.
    pub fn with_accounting(mut self, accounting: usage::Accounting) -> Self {
        self.accounting = Some(accounting);
        self
    }

    /// Names tasks through the ECS agent at `agent_url` and reads their task definitions'
    /// GPU memory reservations from ECS (`aws`).
    pub fn with_ecs(mut self, agent_url: String, aws: crate::config::AwsConfig) -> Self {
        self.agent_url = Some(agent_url);
        self.reservations = Some(reserve::Reservations::new(aws));
        self
    }

    /// Writes per-task GPU memory as CloudWatch embedded-metric-format lines on stdout.
    pub fn with_emf(mut self, on: bool) -> Self {
        self.emf = on;
        self
    }
}

impl Source for NvmlSource {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        resume: crate::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move { self.watch(tx, shutdown, resume).await })
    }
}

impl NvmlSource {
    async fn watch(
        self,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        resume: crate::model::Resume,
    ) {
        let mut opener = Opener::default();
        let mut wing = Wing {
            names: usage::TaskNames::default(),
            crossings: reserve::Crossings::default(),
            limits: crate::accounting::contract::LimitWatch::default(),
            containers: crate::accounting::contract::ContainerCrossings::default(),
            history: history::Writer::open(&self.state_dir),
            emf: crate::accounting::emf::Writer::default(),
        };
        loop {
            let nvml = match opener.open(&self, &tx, &shutdown).await {
                Opened::Nvml(n) => n,
                Opened::Again => continue,
                Opened::Stop => return,
            };
            tracing::info!(probe = "nvml", library = %self.cfg.library, "NVML opened");
            let ended = self.serve(nvml, &mut wing, &tx, &shutdown, &resume).await;
            if ended || shutdown.is_cancelled() {
                return;
            }
        }
    }

    /// Polls one opened NVML until a poll hangs (false: reopen) or gpu-medic stops (true),
    /// with the event thread and the kernel log reader beside it.
    /// The kernel log reader `[nvml] kmsg` configures, not started yet.
    fn kmsg_reader(
        &self,
        resume: &crate::model::Resume,
        shared: &SharedState,
        tx: &mpsc::Sender<Observation>,
        stop: &Arc<AtomicBool>,
    ) -> Option<kmsg::KmsgReader> {
        self.cfg
            .kmsg
            .clone()
            .filter(|p| !p.as_os_str().is_empty())
            .map(|path| kmsg::KmsgReader {
                path,
                cursor_file: kmsg::cursor_path(&self.state_dir),
                committed: resume.clone(),
                shared: shared.clone(),
                tx: tx.clone(),
                stop: stop.clone(),
                urgency: self.urgency.clone(),
                attributor: std::cell::RefCell::new(
                    crate::probe::attribution::Attributor::new(
                        &self.proc_root,
                        self.agent_url.as_deref(),
                    )
                    .with_mps(self.installed.clone()),
                ),
                boot_id_path: self.boot_id_path.clone(),
                journal_directory: self.cfg.kmsg_journal_directory.clone(),
            })
    }

    /// The NVML event thread, beside the poll; an error when it cannot start (polling only).
    fn start_events(
        &self,
        nvml: &Arc<Nvml>,
        shared: &SharedState,
        tx: &mpsc::Sender<Observation>,
        stop: &Arc<AtomicBool>,
    ) -> std::io::Result<std::thread::JoinHandle<()>> {
        let watcher = events::Watcher {
            nvml: nvml.clone(),
            shared: shared.clone(),
            tx: tx.clone(),
            stop: stop.clone(),
            urgency: self.urgency.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("nvml-events".into())
            .spawn(move || watcher.run());
        if let Err(e) = &thread {
            tracing::error!(
                probe = "nvml",
                "cannot start the event thread: {e}; polling only"
            );
        }
        thread
    }

    async fn serve(
        &self,
        nvml: Arc<Nvml>,
        wing: &mut Wing,
        tx: &mpsc::Sender<Observation>,
        shutdown: &CancellationToken,
        resume: &crate::model::Resume,
    ) -> bool {
        let interval = self.cfg.poll_interval;
        // One NVML call may hang on a broken GPU: a poll gets this long before it is abandoned.
        let poll_deadline = interval.max(Duration::from_secs(5)).saturating_mul(3);
        let shared = SharedState::default();
        // A configured reader holds the XIDs that need their text from the first event on,
        // before it starts (after the first poll): a start-up race must not decide a verdict.
        poll::lock(&shared).kmsg_active = self
            .cfg
            .kmsg
            .as_ref()
            .is_some_and(|p| !p.as_os_str().is_empty());
        let stop = Arc::new(AtomicBool::new(false));
        // The threads beside the poll stop with it however it ends, also when the supervisor
        // drops this task mid-await (a stop or a reload): a reader left running would follow
        // the kernel log for the rest of the process.
        struct StopOnDrop(Arc<AtomicBool>);
        impl Drop for StopOnDrop {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop_on_drop = StopOnDrop(stop.clone());
        let thread = self.start_events(&nvml, &shared, tx, &stop);
        // The kernel log maps PCI ids through the GPU list the first poll fills in.
        let mut kmsg = self.kmsg_reader(resume, &shared, tx, &stop);
        let mut poller = Some(self.poller());
        let mut first = true;
        let mut closed = false;
        while let Some(mut p) = poller.take() {
            let (n, s) = (nvml.clone(), shared.clone());
            let job = tokio::task::spawn_blocking(move || {
                let report = p.poll(&n, &s);
                (p, report)
            });
            match tokio::time::timeout(poll_deadline, job).await {
                Ok(Ok((p, report))) => {
                    poller = Some(p);
                    let gpus = report.gpus.len();
                    if self.take(report, wing, tx).await.is_err() {
                        closed = true;
                        break;
                    }
                    if let Some(reader) = kmsg.take() {
                        start_kmsg(reader);
                    }
                    if std::mem::take(&mut first) {
                        // A fact to wait on (tests, operators): what happens to a counter
                        // from now on is a change, not its starting value.
                        tracing::info!(
                            probe = "nvml",
                            gpus,
                            "first NVML poll done: counter baselines set"
                        );
                    }
                }
                Ok(Err(e)) => {
                    tracing::error!(probe = "nvml", "poll task failed: {e}");
                    poller = Some(self.poller());
                }
                Err(_) => {
                    // The blocked call keeps its thread; NVML is reopened with a new poller.
                    tracing::error!(
                        probe = "nvml",
                        "an NVML poll did not return within {:?}; reopening NVML",
                        poll_deadline
                    );
                    break;
                }
            }
            if sleep_or_stop(shutdown, interval).await {
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        if let Ok(t) = thread {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
        closed
    }

    /// One poll's report: the views for status, per-task GPU memory to the accounting wing,
    /// then its observations to the supervisor. `Err`: the supervisor is gone.
    async fn take(
        &self,
        report: poll::PollReport,
        wing: &mut Wing,
        tx: &mpsc::Sender<Observation>,
    ) -> Result<(), ()> {
        if let Some(v) = &self.view {
            v.publish(report.view.clone());
        }
        if self.links.as_ref().is_some_and(|l| l.enabled) {
            crate::config::StateDir::new(&self.state_dir)
                .save_view(crate::config::View::Links, &report.links);
        }
        let mut snap = report.usage;
        if let Some(url) = &self.agent_url {
            wing.names.label(url, &mut snap).await;
        }
        if let Some(r) = &self.reservations {
            r.request(&snap);
        }
        let alert = self.cfg.reservation_alert;
        snap.tasks = reserve::per_task(&snap, self.reservations.as_ref(), alert);
        let mut crossed = wing.crossings.update(&snap.tasks, alert);
        crate::accounting::contract::annotate(&mut snap, &report.clients);
        let (mismatched, counts) =
            wing.limits
                .update(&report.clients, &snap, self.reservations.as_ref());
        snap.mismatches = counts;
        crossed.extend(mismatched);
        crossed.extend(wing.containers.update(&snap.tasks));
        let mut observations = report.observations;
        self.name_outsiders(&mut observations).await;
        let now = crate::model::Timestamp::now();
        wing.history.observe(&snap.tasks, now.0 / 1000);
        if self.emf {
            wing.emf.write(&crate::accounting::emf::lines(&snap, now.0));
        }
        if let Some(a) = &self.accounting {
            a.publish(snap);
        }
        for obs in crossed.into_iter().chain(observations) {
            tx.send(obs).await.map_err(|_| ())?;
        }
        Ok(())
    }
}

impl NvmlSource {
    /// Names the ECS task of each process outside MPS (its cgroup, then the agent's task
    /// list, as for a server fault): `tasks` is what stop-tasks stops, and the value says
    /// whether there is one (1) or not (0), so the policy stops a task's process and logs
    /// any other.
    async fn name_outsiders(&self, obs: &mut [Observation]) {
        if !obs.iter().any(|o| o.signal == Signal::MpsBypass) {
            return;
        }
        let agent = self.agent_url.as_deref().map(crate::aws::agent::Agent::new);
        crate::probe::tasks::TaskNamer::new(agent).name(obs).await;
        for o in obs.iter_mut().filter(|o| o.signal == Signal::MpsBypass) {
            o.value = u64::from(!o.tasks.is_empty());
        }
    }
}

/// The accounting wing's state the poller feeds between polls: task names, reservation
/// crossings, the usage history and the EMF writer.
struct Wing {
    names: usage::TaskNames,
    crossings: reserve::Crossings,
    limits: crate::accounting::contract::LimitWatch,
    containers: crate::accounting::contract::ContainerCrossings,
    history: history::Writer,
    emf: crate::accounting::emf::Writer,
}

fn start_kmsg(reader: kmsg::KmsgReader) {
    let spawned = std::thread::Builder::new()
        .name("kmsg".into())
        .spawn(move || reader.run());
    if let Err(e) = spawned {
        tracing::warn!(probe = "kmsg", "cannot start the kernel log reader: {e}");
    }
}

/// What one try at opening NVML gave.
enum Opened {
    Nvml(Arc<Nvml>),
    /// Not usable now: tried again (after `poll_interval`).
    Again,
    /// gpu-medic stops.
    Stop,
}

/// Opens NVML, reporting an unusable library once per episode (the engine keeps one incident
/// while it lasts) and its recovery.
#[derive(Default)]
struct Opener {
    unusable: bool,
    warned_other: bool,
}

impl Opener {
    async fn open(
        &mut self,
        src: &NvmlSource,
        tx: &mpsc::Sender<Observation>,
        shutdown: &CancellationToken,
    ) -> Opened {
        let library = src.cfg.library.clone();
        let report = match tokio::task::spawn_blocking(move || open(&library)).await {
            Ok(Ok(n)) => {
                if std::mem::take(&mut self.unusable)
                    && tx
                        .send(self_recovered(&format!("{} loads again", src.cfg.library)))
                        .await
                        .is_err()
                {
                    return Opened::Stop;
                }
                return Opened::Nvml(Arc::new(n));
            }
            Ok(Err(OpenError::Unusable(detail))) => {
                if std::mem::replace(&mut self.unusable, true) {
                    None
                } else {
                    tracing::error!(
                        probe = "nvml",
                        "{detail}: gpu-medic cannot watch the GPUs (self-fault; nothing is drained for it)"
                    );
                    Some(self_fault(detail))
                }
            }
            Ok(Err(OpenError::NoDriver(detail))) => Some(no_driver(detail)),
            Ok(Err(OpenError::Other(msg))) => {
                if !std::mem::replace(&mut self.warned_other, true) {
                    tracing::warn!(probe = "nvml", "{msg}; retrying");
                }
                None
            }
            Err(e) => {
                tracing::error!(probe = "nvml", "NVML open task failed: {e}");
                return Opened::Stop;
            }
        };
        if let Some(obs) = report
            && tx.send(obs).await.is_err()
        {
            return Opened::Stop;
        }
        if sleep_or_stop(shutdown, src.cfg.poll_interval).await {
            Opened::Stop
        } else {
            Opened::Again
        }
    }
}

/// Sleeps `d`; returns true if shutdown came first.
async fn sleep_or_stop(shutdown: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(d) => false,
    }
}

/// The one-shot NVML probe for `gpu-medic check`.
pub struct NvmlSnapshot {
    cfg: NvmlConfig,
    links: Option<crate::config::LinksConfig>,
    /// Where the one poll's GPUs are published, and the expected count learnt meanwhile.
    view: Option<(view::NvmlView, view::ExpectedGpus)>,
    /// The programs that may hold a GPU outside MPS, by their files.
    installed: crate::probe::identity::Installed,
    /// `[repair] boot_id_path`: the boot a kernel log file's records are placed against.
    boot_id_path: Option<PathBuf>,
}

impl NvmlSnapshot {
    /// The kernel log's XIDs and SXids of this boot as observations (a file's records of
    /// earlier boots skipped and noted, a record that cannot stand alone marked unwitnessed).
    /// `expected`, `counted`: the GPUs the node should have (when known) and those NVML
    /// counted.
    fn since_boot(
        &self,
        path: &std::path::Path,
        shared: &SharedState,
        (expected, counted): (Option<u32>, u32),
        observations: &mut Vec<Observation>,
        notes: &mut Vec<String>,
    ) {
        if std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
            notes.push(format!(
                "the kernel log is a file ({}): records of earlier boots are skipped; an XID from a syslog line, from a file anyone but root may write, or one its stamps cannot place in this boot fails no check alone (a second witness is needed; /dev/kmsg is the kernel's own)",
                path.display()
            ));
        }
        let read = if path == std::path::Path::new(kmsg::JOURNALD) {
            let boot = self
                .boot_id_path
                .as_deref()
                .and_then(|p| crate::sys::limits::read_boot_id(p).ok())
                .unwrap_or_default();
            kmsg::read_journal_since_boot(&boot, self.cfg.kmsg_journal_directory.clone())
        } else {
            kmsg::read_since_boot(path, self.boot_id_path.as_deref())
        };
        let since = match read {
            Ok(since) => since,
            Err(e) => {
                tracing::warn!(
                    probe = "kmsg",
                    path = %path.display(),
                    "cannot read the kernel log ({e}); XIDs and SXids since boot are not checked"
                );
                return;
            }
        };
        if since.earlier > 0 {
            notes.push(format!(
                "{}: {} driver record(s) of earlier boots skipped (never judged now)",
                path.display(),
                since.earlier
            ));
        }
        // Every GPU the node should have is listed: an XID at another address is no GPU's.
        let all_listed = expected.is_some_and(|e| counted >= e);
        let s = poll::lock(shared);
        for (x, doubt) in since.xids {
            let index = s
                .gpus
                .values()
                .find(|g| kmsg::same_pci(&x.pci, &g.pci_bus_id))
                .map(|g| g.index);
            if index.is_none() && all_listed {
                notes.push(format!(
                    "XID {} at PCI {}: no GPU is at that address and every expected GPU is listed; not judged",
                    x.code, x.pci
                ));
                continue;
            }
            let mut obs = kmsg::observation(
                &x,
                format!("kernel log since boot (PCI {}): {}", x.pci, x.text),
            );
            // A device NVML no longer lists while GPUs are missing (fallen off the bus) is
            // judged for the node.
            if let Some(index) = index {
                obs = s.annotate(obs, index);
            }
            obs.unwitnessed = doubt;
            observations.push(obs.from_source("kmsg"));
        }
        // NVSwitch errors since boot, for the node.
        observations.extend(since.sxids.into_iter().map(|(x, doubt)| {
            let mut o = x.observation();
            o.detail = o.detail.map(|d| format!("kernel log since boot: {d}"));
            o.unwitnessed = doubt;
            o
        }));
    }

    /// `installed` as [`NvmlSource::new`]'s.
    pub fn new(cfg: NvmlConfig, installed: crate::probe::identity::Installed) -> Self {
        NvmlSnapshot {
            installed,
            cfg,
            links: None,
            view: None,
            boot_id_path: None,
        }
    }

    /// Places a kernel log file's records against the boot `[repair] boot_id_path` tells.
    pub fn with_boot_id_path(mut self, path: PathBuf) -> Self {
        self.boot_id_path = Some(path);
        self
    }

    /// Also reads each GPU's links (`[links]`): a fabric still registering before its
    /// deadline makes the check "could not tell" (asked again by the launch gate).
    pub fn with_links(mut self, cfg: crate::config::LinksConfig) -> Self {
        self.links = Some(cfg);
        self
    }

    /// Publishes the poll's GPUs to `view`; expects `expected`'s count when
    /// `[nvml] expected_gpus` is unset.
    pub fn with_view(mut self, view: view::NvmlView, expected: view::ExpectedGpus) -> Self {
        self.view = Some((view, expected));
        self
    }
}

impl Snapshot for NvmlSnapshot {
    fn name(&self) -> &'static str {
        "nvml"
    }

    fn snapshot(&mut self) -> Result<SnapshotReport, ProbeError> {
        let nvml = match open(&self.cfg.library) {
            Ok(n) => n,
            Err(OpenError::NoDriver(detail)) => {
                return Ok(SnapshotReport {
                    observations: vec![no_driver(detail)],
                    ..SnapshotReport::default()
                });
            }
            Err(OpenError::Unusable(message)) => {
                return Err(ProbeError {
                    probe: "nvml",
                    message: format!(
                        "{message} (a self-fault of gpu-medic: the GPUs were not checked)"
                    ),
                    retryable: false,
                });
            }
            Err(OpenError::Other(message)) => {
                return Err(ProbeError {
                    probe: "nvml",
                    message,
                    retryable: true,
                });
            }
        };
        let shared = SharedState::default();
        let mut poller = Poller::new(
            self.cfg.expected_gpus,
            PathBuf::from("/proc"),
            self.installed.clone(),
        );
        if let Some(l) = &self.links {
            poller = poller.with_links(l.clone());
        }
        if let Some((_, expected)) = &self.view {
            poller = poller.learning_expected(expected.clone());
        }
        let mut report = poller.poll(&nvml, &shared);
        if let Some((v, _)) = &self.view {
            v.publish(report.view.clone());
        }
        // XIDs raised before anyone watched NVML events (at boot, for the launch gate) are
        // only in the kernel log.
        let mut notes = Vec::new();
        if let Some(path) = self.cfg.kmsg.as_ref().filter(|p| !p.as_os_str().is_empty()) {
            let count = (report.expected, report.counted);
            self.since_boot(path, &shared, count, &mut report.observations, &mut notes);
        }
        Ok(SnapshotReport {
            observations: report.observations,
            problems: report.problems,
            notes,
            gpus: report.gpus,
        })
    }
}
