//! `gpu-medic run`: the daemon. Sets up logging (journald under systemd, text or JSON
//! otherwise), the tokio runtime, signal handling (the first SIGTERM/SIGINT stops gracefully,
//! a second forces exit), and the supervisor with the probes and remedies the config enables.

use std::path::Path;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use super::{CliError, ConfigArg, exit};
use crate::aws::imds::TargetState;
use crate::mps::control::ControlClient;
use crate::policy::Policy;
use crate::remedy::Remedies;
use crate::remedy::aws::AwsControlPlane;
use crate::remedy::mps::MpsDaemon;
use crate::supervisor::Supervisor;

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// Log format: auto (journald under systemd, else text), text, json, journald.
    #[arg(long, default_value = "auto", value_parser = ["auto", "text", "json", "journald"])]
    log_format: String,
}

pub fn init_logging(format: &str) {
    let filter =
        EnvFilter::try_from_env("GPU_MEDIC_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    let under_systemd = std::env::var_os("JOURNAL_STREAM").is_some();
    let journald = match format {
        "journald" => true,
        "auto" => under_systemd,
        _ => false,
    };
    let registry = tracing_subscriber::registry().with(filter);
    if journald && let Ok(layer) = tracing_journald::layer() {
        let _ = registry
            .with(layer.with_syslog_identifier("gpu-medic".into()))
            .try_init();
        return;
    }
    if format == "json" {
        let _ = registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr),
            )
            .try_init();
    } else {
        let _ = registry
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .try_init();
    }
}

/// Warnings and errors only, as text on stderr (for `demo`, whose stdout is the show).
pub fn init_logging_quiet() {
    let filter =
        EnvFilter::try_from_env("GPU_MEDIC_LOG").unwrap_or_else(|_| EnvFilter::new("error"));
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .try_init();
}

pub fn run(a: RunArgs) -> Result<i32, CliError> {
    let cfg = a.config.load_for(crate::preflight::Mode::Run)?;
    // A kernel log that cannot be followed (a FIFO, a directory) is a mistake: refused here.
    if cfg.nvml.enabled
        && let Some(kmsg) = cfg
            .nvml
            .kmsg
            .as_deref()
            .filter(|p| !p.as_os_str().is_empty())
    {
        crate::probe::nvml::kmsg::check_path(kmsg).map_err(|m| {
            CliError::Config(crate::error::FileError::new(&a.config.config, None, m))
        })?;
    }
    let policy = Policy::load(&cfg.policy)?;
    init_logging(&a.log_format);
    for w in crate::preflight::warnings(&cfg, Path::new("systemctl")) {
        tracing::warn!("{w}");
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("gpu-medic")
        .build()
        .map_err(|e| CliError::Runtime(format!("cannot start the runtime: {e}")))?;
    rt.block_on(async move {
        let shutdown = CancellationToken::new();
        spawn_signal_handler(shutdown.clone())?;
        // Handed to both sides: the MPS probe and remedy share one control client (and its
        // lock); the lifecycle watcher writes what the control plane's drain reads.
        let mps_client = ControlClient::new(&cfg.mps);
        let target_state = TargetState::new();
        let sources = crate::probe::sources(&cfg, &mps_client, &target_state);
        let mut remedies = Remedies::default();
        if cfg.aws.enabled {
            // Identity discovery waits for the first order: the ECS agent may not be up yet.
            remedies.control_plane = Some(Arc::new(
                AwsControlPlane::from_config(&cfg)
                    .await
                    .with_target_state(target_state),
            ));
        }
        if cfg.mps.enabled {
            remedies.mps = Some(Arc::new(MpsDaemon::with_client(
                cfg.mps.clone(),
                mps_client,
            )));
        }
        let metrics_cfg = cfg.metrics.clone();
        let mut supervisor = Supervisor::new(cfg, policy, Arc::new(remedies));
        for s in sources {
            supervisor.add_source(s);
        }
        if metrics_cfg.enabled {
            let metrics = Arc::new(crate::metrics::Metrics::new());
            supervisor.with_metrics(metrics.clone());
            let listener = tokio::net::TcpListener::bind(metrics_cfg.listen)
                .await
                .map_err(|e| {
                    CliError::Runtime(format!(
                        "metrics: cannot listen on {}: {e}",
                        metrics_cfg.listen
                    ))
                })?;
            tokio::spawn(crate::metrics::serve(listener, metrics, shutdown.clone()));
        }
        supervisor
            .run(shutdown, || {
                let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
            })
            .await?;
        Ok(exit::OK)
    })
}

/// First SIGTERM/SIGINT: cancel `shutdown`. Second: exit at once.
fn spawn_signal_handler(shutdown: CancellationToken) -> Result<(), CliError> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| CliError::Runtime(format!("cannot watch SIGTERM: {e}")))?;
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| CliError::Runtime(format!("cannot watch SIGINT: {e}")))?;
    tokio::spawn(async move {
        let mut seen = 0;
        loop {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            seen += 1;
            if seen == 1 {
                tracing::info!("stop requested; finishing (send the signal again to force)");
                shutdown.cancel();
            } else {
                tracing::warn!("second stop signal: exiting now");
                std::process::exit(exit::FORCED);
            }
        }
    });
    Ok(())
}
