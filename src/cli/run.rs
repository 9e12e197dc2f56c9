//! `gpu-medic run`: the daemon. Sets up logging (journald under systemd, text or JSON
//! otherwise), the tokio runtime, signal handling (the first SIGTERM/SIGINT stops gracefully,
//! a second forces exit, SIGHUP reloads a validated config and policy), and the supervisor
//! with the probes and remedies the config enables.

use std::path::Path;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use super::{CliError, ConfigArg, exit};
use crate::mps::control::ControlClient;
use crate::policy::Policy;
use crate::remedy::Remedies;
use crate::remedy::aws::AwsControlPlane;
use crate::remedy::mps::MpsDaemon;
use crate::supervisor::Supervisor;
use crate::sys::clock::SystemClock;

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Log format: auto (journald under systemd, else text), text, json, journald.
    #[arg(long, default_value = "auto", value_parser = ["auto", "text", "json", "journald"])]
    log_format: String,
    /// Read a state.json written by a newer gpu-medic (refused otherwise, exit 78): what this
    /// version does not know is dropped, and the file is written back in its format.
    #[arg(long)]
    accept_newer_state: bool,
}

/// `GPU_MEDIC_LOG`'s directives, or `default` when it is unset or does not parse.
fn log_filter(default: &str) -> EnvFilter {
    std::env::var("GPU_MEDIC_LOG")
        .ok()
        .and_then(|spec| EnvFilter::try_new(crate_targets(&spec)).ok())
        .unwrap_or_else(|| EnvFilter::new(default))
}

/// A directive for a `gpu_medic` target also names the crates its modules live in
/// (`gpu_medic::probe::mps=debug` is `gpu_medic_io::probe::mps=debug` too, as the probe's
/// events are that crate's): the targets an operator knows keep working across the split
/// into crates (docs/architecture.md, "Layers").
fn crate_targets(spec: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    for d in spec.split(',') {
        out.push(d.to_string());
        let t = d.trim_start();
        let names_ours = t
            .strip_prefix("gpu_medic")
            .is_some_and(|rest| rest.is_empty() || rest.starts_with("::") || rest.starts_with('='));
        if names_ours {
            for krate in ["gpu_medic_io", "gpu_medic_core"] {
                out.push(t.replacen("gpu_medic", krate, 1));
            }
        }
    }
    out.join(",")
}

pub fn init_logging(format: &str) {
    let filter = log_filter("info");
    let under_systemd = std::env::var_os("JOURNAL_STREAM").is_some();
    let journald = match format {
        "journald" => true,
        "auto" => under_systemd,
        _ => false,
    };
    let registry = tracing_subscriber::registry().with(filter);
    // Text others wrote is escaped in each format (src/cli/log.rs).
    if journald && let Ok(layer) = tracing_journald::layer() {
        let layer = layer.with_syslog_identifier("gpu-medic".into());
        let _ = registry.with(super::log::journald(layer)).try_init();
        return;
    }
    if format == "json" {
        let _ = registry.with(super::log::json(std::io::stderr)).try_init();
    } else {
        let _ = registry
            .with(super::log::text(std::io::stderr, stderr_is_terminal()))
            .try_init();
    }
}

/// Colours for a person at a terminal, not for a file or journald's stream.
fn stderr_is_terminal() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// Warnings and errors only, as text on stderr (for `demo`, whose stdout is the show).
pub fn init_logging_quiet() {
    let filter = log_filter("error");
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(super::log::text(std::io::stderr, stderr_is_terminal()))
        .try_init();
}

pub fn run(a: RunArgs) -> Result<i32, CliError> {
    // gpu-medic's files are private whatever umask it was started with (the unit's is
    // 0077; a shell's is often 0022): folders 0700, files 0600 (also set in `main` for every
    // command; again here for `run` called as a library).
    // SAFETY: umask(2) has no preconditions and cannot fail.
    unsafe {
        libc::umask(0o077);
    }
    let (cfg, policy) = validate(&a.config).map_err(CliError::Config)?;
    init_logging(&a.log_format);
    if let Err(e) = crate::sys::fs::make_private(&cfg.state_dir) {
        tracing::warn!(state_dir = %cfg.state_dir.display(), "cannot make the state directory private: {e}");
    }
    // Descriptors in reserve (crates/io/src/sys/fds.rs): the hard limit, not systemd's soft 1,024.
    match crate::sys::fds::raise_nofile_limit() {
        Ok((before, after)) if after > before => {
            tracing::debug!("open-file limit raised from {before} to {after}");
        }
        Ok(_) => {}
        Err(e) => tracing::warn!("cannot raise the open-file limit: {e}"),
    }
    for w in crate::launch::preflight::warnings(&cfg, Path::new("systemctl")) {
        tracing::warn!("{w}");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("gpu-medic")
        .build()
        .map_err(|e| CliError::Runtime(format!("cannot start the runtime: {e}")))?;
    let config_arg = a.config.clone();
    let config_arg_path = a.config.config.clone();
    let newer = if a.accept_newer_state {
        crate::journal::Newer::Accept
    } else {
        crate::journal::Newer::Refuse
    };
    let result = rt.block_on(async move {
        let control = Control::default();
        spawn_signal_handler(control.clone(), config_arg)?;
        let mut current = Some((cfg, policy));
        while let Some((cfg, policy)) = current.take() {
            let shutdown = control.begin();
            serve(cfg, policy, shutdown, &config_arg_path, newer).await?;
            current = control.take_reload();
            if current.is_some() {
                tracing::info!("configuration and policy reloaded; supervisor restarted");
            }
        }
        Ok(exit::OK)
    });
    // The state is saved: blocking work still running (a probe's call that does not
    // return) does not hold the process past its stop.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

/// The checks a configuration passes before a life starts on it, at start and on SIGHUP
/// alike: the config (preflight included), the kernel log it names (a FIFO or a directory
/// cannot be followed), and the policy. Every file is opened without blocking and checked
/// for its kind and size first ([`crate::sys::limits::read_text`]), so none of this hangs.
fn validate(
    config: &super::ConfigArg,
) -> Result<(crate::config::Config, Policy), crate::sys::error::FileError> {
    let cfg = config.load_for(crate::launch::preflight::Mode::Run)?;
    if cfg.nvml.enabled
        && let Some(kmsg) = cfg.nvml.kmsg.as_deref().filter(|p| {
            !p.as_os_str().is_empty() && *p != std::path::Path::new(crate::probe::kmsg::JOURNALD)
        })
    {
        crate::probe::kmsg::check_path(kmsg)
            .map_err(|m| crate::sys::error::FileError::new(&config.config, None, m))?;
    }
    let policy = crate::config::load_policy(&cfg.policy)?;
    Ok((cfg, policy))
}

/// One life of the supervisor with one configuration, until `shutdown`.
async fn serve(
    cfg: crate::config::Config,
    policy: Policy,
    shutdown: CancellationToken,
    config_file: &Path,
    newer: crate::journal::Newer,
) -> Result<(), CliError> {
    // Handed to both sides: the MPS probe and remedy share one control client (and its lock).
    let mps_client = ControlClient::new(&cfg.mps);
    // The one clock above the engine: the supervisor stamps inputs with it, the control plane
    // reads deadlines and claims from it.
    let clock = SystemClock::shared();
    let accounting = crate::accounting::usage::Accounting::new();
    // Notified by the supervisor at every GPU signal: ECS's view of the GPUs is read again.
    let gpu_signal = Arc::new(tokio::sync::Notify::new());
    let sources = crate::probe::sources_with_gpu_view(
        &cfg,
        crate::probe::Urgency::of(&policy),
        &mps_client,
        cfg.metrics.enabled.then_some(&accounting),
        Some(gpu_signal.clone()),
    );
    // The incident export runs beside the supervisor; the control plane flushes it before the
    // instance goes away.
    let exporter = crate::export::Exporter::start(&cfg).await;
    let mut remedies = Remedies::default();
    if cfg.aws.enabled {
        // Identity discovery waits for the first order: the ECS agent may not be up yet. The
        // fleet budget's protocol (`[fleet] table` or the claims) is chosen here, once.
        let mut cp = AwsControlPlane::from_config(&cfg, clock.clone()).await;
        if let Some(x) = &exporter {
            cp = cp.with_flush(x.flush.clone());
        }
        // A drain's fleet gate fingerprints its incident's first signal (docs/fleet-scale.md).
        cp = cp.with_records(Arc::new(crate::supervisor::evidence::JournalRecords::new(
            &cfg,
        )));
        let cp = Arc::new(cp);
        // The budget's upkeep (with `[fleet] table`: entries of terminated instances are
        // removed now and then).
        tokio::spawn(AwsControlPlane::upkeep(cp.clone(), shutdown.child_token()));
        if cfg.repair.reboot != crate::config::RebootMethod::Off {
            remedies.repair = Some(Arc::new(
                crate::remedy::aws::reboot::Rebooter::from_config(
                    &cfg,
                    cp.clone(),
                    boot_check(&cfg, &policy),
                )
                .await,
            ));
        }
        remedies.control_plane = Some(cp);
    }
    remedies.evidence = evidence(&cfg, config_file, &shutdown, clock.clone()).await;
    remedies.diagnose = diagnose(&cfg, config_file, &mps_client);
    if cfg.mps.enabled {
        remedies.mps = Some(Arc::new(
            MpsDaemon::with_client(cfg.mps.clone(), mps_client).with_clock(clock.clone()),
        ));
    }
    let metrics_cfg = cfg.metrics.clone();
    let link_views = cfg.files();
    let flush_wait = cfg.export.flush_wait;
    let tagged = tagged_reboots(&cfg).await;
    let mut supervisor = Supervisor::new(cfg, policy, Arc::new(remedies));
    supervisor.opening(crate::supervisor::Opening { newer, tagged });
    supervisor.with_clock(clock);
    supervisor.notify_gpu_signals(gpu_signal);
    for s in sources {
        supervisor.add_source(s);
    }
    if metrics_cfg.enabled {
        let lag = exporter.as_ref().map(|x| x.lag.clone()).unwrap_or_default();
        let metrics = Arc::new(
            crate::metrics::Metrics::new()
                .with_accounting(accounting)
                .with_link_views(link_views)
                .with_export_lag(lag),
        );
        supervisor.with_metrics(metrics.clone());
        // A port that cannot be bound is a self-fault, never an exit (the endpoint tries
        // again); the endpoint ends with this life, so a reload binds the address again.
        supervisor.add_source(Box::new(MetricsEndpoint(
            crate::metrics::server::Endpoint::new(&metrics_cfg, metrics),
        )));
    }
    supervisor
        .run(shutdown, || {
            let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
        })
        .await?;
    // The last records (the stop itself) leave before the process does, bounded.
    if let Some(x) = exporter {
        x.finish(flush_wait).await;
    }
    Ok(())
}

/// How long the start waits for the instance's reboots tag (IMDS, one EC2 call).
const TAG_READ: std::time::Duration = std::time::Duration::from_secs(5);

/// The reboots the instance's tag keeps, read only when the state directory has no reboot
/// ledger (a first start, or a lost disk) and the reboot rung is on with `[aws]`: the ladder
/// then still counts the reboots this instance had (docs/repair.md). Bounded; a failure is
/// said and the start goes on without it.
async fn tagged_reboots(cfg: &crate::config::Config) -> Option<Vec<crate::model::repair::Repair>> {
    let rung = cfg.aws.enabled && cfg.repair.reboot != crate::config::RebootMethod::Off;
    if !rung || cfg.files().reboots().exists() {
        return None;
    }
    match crate::remedy::aws::reboot::read_tag(cfg, TAG_READ).await {
        Ok(Some(r)) => {
            tracing::warn!(
                reboots = r.len(),
                "no reboot ledger in the state directory: the reboots this instance had are read from its tag {}",
                crate::model::repair::REBOOTS_TAG
            );
            Some(r)
        }
        Ok(None) => None,
        Err(e) => {
            tracing::warn!(
                "no reboot ledger in the state directory, and the instance's tag {} cannot be read ({e}): reboots before a lost disk are not counted",
                crate::model::repair::REBOOTS_TAG
            );
            None
        }
    }
}

/// With `[evidence] enabled`: the evidence remedy, its spool swept now (archives made before
/// a reboot or while S3 was down go up) and then every few minutes until `shutdown`.
async fn evidence(
    cfg: &crate::config::Config,
    config_file: &Path,
    shutdown: &CancellationToken,
    clock: crate::sys::clock::SharedClock,
) -> Option<Arc<dyn crate::remedy::evidence::EvidenceRemedy>> {
    if !cfg.evidence.enabled {
        return None;
    }
    let ev = Arc::new(
        crate::remedy::evidence::Evidence::from_config(
            cfg,
            Some(config_file.to_path_buf()),
            Arc::new(crate::supervisor::evidence::JournalRecords::new(cfg)),
        )
        .await
        .with_clock(clock),
    );
    tokio::spawn(crate::remedy::evidence::sweep_loop(
        ev.clone(),
        shutdown.child_token(),
    ));
    Some(ev)
}

/// With a `[diagnose]` tier that can run here, the diagnose order's remedy; the tiers that
/// cannot are said once (a drained node is then judged by the passive checks alone).
fn diagnose(
    cfg: &crate::config::Config,
    config_file: &Path,
    mps_client: &ControlClient,
) -> Option<Arc<dyn crate::remedy::diagnose::DiagnoseRemedy>> {
    let d = &cfg.diagnose;
    let (ok, not) = crate::diagnose::usable(d.dcgmi().as_deref(), d.cuda_library().as_deref());
    for why in &not {
        tracing::info!(target: "gpu_medic::diagnose", "diagnosis tier unavailable: {why}");
    }
    if ok.is_empty() {
        tracing::warn!(
            target: "gpu_medic::diagnose",
            "no diagnosis tool can run on this node: a drained or rebooted node is returned on the passive checks alone"
        );
        return None;
    }
    let mut command = crate::remedy::diagnose::DiagnoseCommand::from_config(cfg, config_file);
    if cfg.mps.enabled {
        command = command.with_mps(mps_client.clone());
    }
    Some(Arc::new(command))
}

/// The check after a reboot: `gpu-medic check`, the launch gate's checks, with its findings
/// in a line for the journal (also the demo's, on its simulated node).
pub(super) fn boot_check(
    cfg: &crate::config::Config,
    policy: &Policy,
) -> crate::remedy::aws::reboot::BootCheck {
    let (cfg, policy) = (cfg.clone(), policy.clone());
    Arc::new(move || {
        let r = super::check::examine(&cfg, &policy).checked;
        let mut found: Vec<String> = r
            .findings
            .iter()
            .map(|f| match f.gpu {
                Some(g) => format!("{} on GPU {g} ({})", f.signal, f.action),
                None => format!("{} ({})", f.signal, f.action),
            })
            .collect();
        found.extend(
            r.probes
                .iter()
                .filter(|p| !p.ok)
                .map(|p| format!("{}: {}", p.probe, p.error.clone().unwrap_or_default())),
        );
        let gpus = r.gpus.len();
        let text = if found.is_empty() {
            format!("{gpus} GPU(s), no finding")
        } else {
            format!("{gpus} GPU(s); {}", found.join("; "))
        };
        (r.verdict, text)
    })
}

/// What the signal handler tells the main loop: the current life's shutdown token, and the
/// configuration a SIGHUP validated for the next life.
#[derive(Clone, Default)]
struct Control {
    inner: Arc<std::sync::Mutex<ControlState>>,
}

#[derive(Default)]
struct ControlState {
    shutdown: CancellationToken,
    reload: Option<(crate::config::Config, Policy)>,
    stopping: bool,
}

impl Control {
    fn lock(&self) -> std::sync::MutexGuard<'_, ControlState> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A fresh token for the next life (already cancelled if a stop came in between).
    fn begin(&self) -> CancellationToken {
        let mut s = self.lock();
        s.shutdown = CancellationToken::new();
        if s.stopping {
            s.shutdown.cancel();
        }
        s.shutdown.clone()
    }

    fn take_reload(&self) -> Option<(crate::config::Config, Policy)> {
        let mut s = self.lock();
        if s.stopping { None } else { s.reload.take() }
    }

    fn stop(&self) {
        let mut s = self.lock();
        s.stopping = true;
        s.reload = None;
        s.shutdown.cancel();
    }

    fn reload(&self, cfg: crate::config::Config, policy: Policy) {
        let mut s = self.lock();
        if s.stopping {
            return;
        }
        s.reload = Some((cfg, policy));
        s.shutdown.cancel();
    }
}

/// First SIGTERM/SIGINT: stop gracefully. Second: exit at once. SIGHUP: reload. The new
/// config and policy are validated first (the same checks as at start, preflight included);
/// a bad one is refused with its `file:line` and the daemon goes on with the old one. A good
/// one stops the supervisor gracefully (orders in flight reach a safe point, state is saved)
/// and starts it again in this process with the new files (systemd sees RELOADING=1, then
/// READY=1).
/// A reload's checked configuration, or why it was refused.
type Checked = Result<(crate::config::Config, Policy), crate::sys::error::FileError>;

fn spawn_signal_handler(control: Control, config: super::ConfigArg) -> Result<(), CliError> {
    use tokio::signal::unix::{SignalKind, signal};
    let watch = |kind: SignalKind, name: &str| {
        signal(kind).map_err(|e| CliError::Runtime(format!("cannot watch {name}: {e}")))
    };
    let mut term = watch(SignalKind::terminate(), "SIGTERM")?;
    let mut int = watch(SignalKind::interrupt(), "SIGINT")?;
    let mut hup = watch(SignalKind::hangup(), "SIGHUP")?;
    // The reload's checks run on a thread of their own, so that the loop below answers
    // SIGTERM whatever a check meets (a stop never waits for a reload). One check at a time:
    // SIGHUPs that come during a check are answered by one more check once it ends, on the
    // files as they are then (each answer is applied in turn). The thread is detached: a
    // process that stops does not wait for it (a runtime's blocking pool would).
    let (checked_tx, mut checked_rx) = tokio::sync::mpsc::unbounded_channel::<Checked>();
    let spawn_check = move |config: super::ConfigArg| {
        let tx = checked_tx.clone();
        std::thread::Builder::new()
            .name("gpu-medic-reload".into())
            .spawn(move || {
                let _ = tx.send(validate(&config));
            })
            .map_err(|e| tracing::error!("SIGHUP: reload check could not start ({e}); still running with the previous configuration"))
            .is_ok()
    };
    tokio::spawn(async move {
        let mut seen = 0;
        let (mut checking, mut again) = (false, false);
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
                _ = hup.recv() => {
                    if checking {
                        again = true;
                    } else {
                        checking = spawn_check(config.clone());
                    }
                    continue;
                }
                Some(checked) = checked_rx.recv() => {
                    checking = false;
                    if std::mem::take(&mut again) {
                        // The files may have changed since this check began: this answer is
                        // applied, and they are checked again.
                        checking = spawn_check(config.clone());
                    }
                    match checked {
                        Ok((cfg, policy)) => {
                            tracing::info!(policy = %policy.origin, "SIGHUP: configuration and policy valid; restarting the supervisor with them");
                            let _ = sd_notify::notify(&[sd_notify::NotifyState::Reloading]);
                            control.reload(cfg, policy);
                        }
                        Err(e) => tracing::error!("SIGHUP: reload refused, still running with the previous configuration: {e}"),
                    }
                    continue;
                }
            }
            seen += 1;
            if seen == 1 {
                tracing::info!("stop requested; finishing (send the signal again to force)");
                control.stop();
            } else {
                tracing::warn!("second stop signal: exiting now");
                std::process::exit(exit::FORCED);
            }
        }
    });
    Ok(())
}

/// The metrics endpoint beside the probes: its self-faults (a port that cannot be bound) and
/// recoveries reach the engine on the probes' channel. The wiring joins the two, so the
/// metrics import no probe.
struct MetricsEndpoint(crate::metrics::server::Endpoint);

impl crate::probe::Source for MetricsEndpoint {
    fn name(&self) -> &'static str {
        crate::metrics::server::COMPONENT
    }

    fn run(
        self: Box<Self>,
        tx: tokio::sync::mpsc::Sender<crate::model::Observation>,
        shutdown: CancellationToken,
        _resume: crate::model::Resume,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        Box::pin(self.0.run(tx, shutdown))
    }
}

#[cfg(test)]
mod tests {
    use super::crate_targets;

    #[test]
    fn a_gpu_medic_target_names_the_crates_its_modules_are_in() {
        assert_eq!(
            crate_targets("info,gpu_medic::probe::mps=debug"),
            "info,gpu_medic::probe::mps=debug,gpu_medic_io::probe::mps=debug,gpu_medic_core::probe::mps=debug"
        );
        assert_eq!(
            crate_targets("gpu_medic=trace"),
            "gpu_medic=trace,gpu_medic_io=trace,gpu_medic_core=trace"
        );
        // Another crate, or one of ours named by its own name, is left as written.
        assert_eq!(crate_targets("hyper=warn"), "hyper=warn");
        assert_eq!(
            crate_targets("gpu_medic_io::aws=debug"),
            "gpu_medic_io::aws=debug"
        );
    }
}
