//! The command line: one module per command. `main.rs` only parses and maps errors to exit
//! codes; everything a command prints is built here.
//!
//! Every command prints through [`out`]: the `println!`, `print!` and `eprintln!` macros are
//! redefined below for this module and all of its children, so that
//! - a closed stdout or stderr (`gpu-medic incidents list | head -1`, `status | true`) ends
//!   the output quietly, with the command's own exit code, instead of panicking the way std's
//!   macros do on EPIPE;
//! - text others wrote (a process name, a task name, a driver or MPS message) is shown
//!   escaped: each `println!` writes exactly one line, escaped whole
//!   ([`crate::model::escape`]), so no value can start a row of its own or carry a terminal
//!   escape. A line break in gpu-medic's own text is a `println!` of its own.
//!
//! Defining them here covers every print path, including ones added later. JSON goes through
//! [`print_json`], which writes JSON.

/// `println!` for the commands: one escaped line, see [`out`].
macro_rules! println {
    () => { $crate::cli::out::line(format_args!("")) };
    ($($arg:tt)*) => { $crate::cli::out::line(format_args!($($arg)*)) };
}

/// `print!` for the commands: escaped text, see [`out`].
#[allow(unused_macros)]
macro_rules! print {
    ($($arg:tt)*) => { $crate::cli::out::text(format_args!($($arg)*)) };
}

/// `eprintln!` for the commands: one escaped line, see [`out`].
macro_rules! eprintln {
    ($($arg:tt)*) => { $crate::cli::out::eline(format_args!($($arg)*)) };
}

pub mod out;

pub mod check;
pub mod demo;
pub mod diagnose;
pub mod drill;
mod drill_notice;
pub mod evidence;
pub mod fleet;
pub mod fleet_admin;
pub mod incidents;
pub mod log;
pub mod policy;
pub mod run;
pub mod status;
pub mod tasks;

use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};

use crate::config::{Config, DEFAULT_CONFIG_PATH};
use crate::policy::Policy;
use crate::sys::error::FileError;

/// Exit codes, documented in docs/operations.md ("Commands").
pub mod exit {
    /// Success; `check`: healthy.
    pub const OK: i32 = 0;
    /// `check`: unhealthy. Other commands: a runtime failure.
    pub const UNHEALTHY: i32 = 1;
    /// `check`: could not tell. Also clap's code for a usage error.
    pub const UNKNOWN: i32 = 2;
    /// The incident (or other named thing) does not exist.
    pub const NOT_FOUND: i32 = 3;
    /// A configuration or policy error (`file:line: message`), like sysexits' EX_CONFIG.
    pub const CONFIG: i32 = 78;
    /// `drill`: refused on this instance (`[drill] allow` is not true).
    pub const REFUSED: i32 = 4;
    /// A second SIGTERM/SIGINT forced the daemon out without its graceful stop.
    pub const FORCED: i32 = 130;
}

/// The default policy, built in so `policy explain` works on any machine.
pub const BUILTIN_DEFAULT_POLICY: &str = include_str!("../../policies/default.toml");

#[derive(Debug, Parser)]
#[command(
    name = "gpu-medic",
    version,
    about = "Self-healing supervisor for GPU container instances in Amazon ECS that share GPUs through NVIDIA MPS",
    long_about = "gpu-medic watches every GPU through NVML and the MPS control daemon through its control pipe, \
judges each signal with a policy file, and heals the node: it restarts the MPS daemon, stops poisoned tasks, \
or quarantines, drains and has Auto Scaling replace the instance, never taking more of the fleet out than the \
budget allows. Every decision is an incident in the journal (`gpu-medic incidents`).\n\n\
Exit codes: 0 ok/healthy; 1 unhealthy (check) or runtime failure; 2 could not tell (check) or usage error; \
3 not found; 4 drill refused on this instance; 78 configuration or policy error (printed as file:line: message); 130 forced stop."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the supervisor daemon.
    ///
    /// Watches the GPUs (NVML events and counters, the kernel log), the MPS control daemon and
    /// the node, judges every signal with the policy, and acts: restarts the MPS daemon, stops
    /// poisoned tasks, quarantines, drains and has Auto Scaling replace the instance within the
    /// fleet budget. Writes incidents.jsonl, inputs.jsonl and state.json under state_dir.
    /// Under systemd it sends READY and WATCHDOG (Type=notify). The first SIGTERM/SIGINT lets
    /// orders in flight reach a safe point and saves state (they resume on the next start); a
    /// second forces exit (130). SIGHUP reloads: the config and policy are validated as at
    /// start; a bad one is refused (logged with file:line) and the daemon keeps running with
    /// the old one; a good one restarts the supervisor gracefully in the same process. Logs go
    /// to journald under systemd, else to stderr.
    Run(run::RunArgs),
    /// Play three faults on a simulated node (no GPU, no AWS, no root) and show the incidents.
    Demo(demo::DemoArgs),
    /// One-shot health verdict: exit 0 healthy, 1 unhealthy, 2 could not tell.
    ///
    /// Runs every enabled probe once (NVML counters and the kernel log since boot, the MPS
    /// daemon) and judges what it sees with the policy: a finding whose rule would stop tasks,
    /// restart MPS, drain or replace makes the node unhealthy. --json prints the report for
    /// tools; --lifecycle is the Auto Scaling launch gate (see packaging/LIFECYCLE.md).
    Check(check::CheckArgs),
    /// Read the incident journal (and abort a drain).
    ///
    /// Every incident runs from its first signal to its outcome: the GPU (index, UUID, PCI id),
    /// the tasks on it, the rule that fired and why, each action with its result and AWS
    /// request ids, and its state (open, logged, resolved, drained, replaced, terminated,
    /// observed, aborted, failed).
    #[command(subcommand)]
    Incidents(incidents::IncidentsCommand),
    /// Collects an incident's evidence now (nvidia-bug-report, nvidia-smi, logs) and uploads
    /// it to the `[evidence]` bucket.
    Evidence(evidence::EvidenceArgs),
    /// Review a policy: check it, explain a signal, replay recorded inputs through it.
    #[command(subcommand)]
    Policy(policy::PolicyCommand),
    /// The live state of the daemon on this node.
    Status(status::StatusArgs),
    /// The fleet as the budget sees it, live from the slot table and Auto Scaling.
    ///
    /// `status` (text or --json): the budget's capacity and slots in use, the breaker, kill
    /// switches, and the fleet incidents (one fingerprint on many instances: probably the
    /// driver or the image; one task definition's application faults on many instances: a
    /// poison task; new instances of one AMI tripping the launch-failure breaker: a bad image)
    /// with whether each is acknowledged; `ack <id>`: the drains a fingerprint's incident
    /// holds go on, within the budget. Needs [fleet] table.
    #[command(subcommand)]
    Fleet(fleet_admin::FleetCommand),
    /// GPU memory per ECS task definition: observed peak, p99, reservation, suggested size.
    ///
    /// From the per-minute peaks the daemon keeps in state_dir (a few days): per task
    /// definition family, revision and container, and per task as a whole (what ECS places
    /// by), with a suggested sharingStrategy.nvidiaMps.memory = peak + 20 %, rounded up to
    /// 64 MiB. --json for tools; --family F for one family.
    Tasks(tasks::TasksArgs),
    /// Rehearse a fault on this instance through the real path (staging only).
    ///
    /// `xid N --gpu I` writes a driver-shaped XID line to the kernel log the daemon reads;
    /// `mps-hang` / `mps-crash` stop or kill the real MPS control daemon; `gpu-lost` and `ecc`
    /// hand the daemon that observation. The incident is tagged as a drill everywhere it
    /// shows; the drill prints what the policy will do first; `--observe` journals every
    /// order and executes none; without it the real drain, restart or replacement runs.
    /// Refused (exit 4) unless the config says `[drill] allow = true`.
    Drill(drill::DrillArgs),
    /// Test the GPUs before trusting them: DCGM's diagnostics and the built-in CUDA check.
    ///
    /// Runs `dcgmi diag` where DCGM is installed and gpu-medic's own check through the
    /// driver's libcuda (a context, memory written and verified, a kernel with a known answer,
    /// copy and arithmetic figures held against the GPU's siblings; as an MPS client when
    /// gpu-medic manages MPS), each in a child process with `[diagnose] timeout`. Exit 0 only
    /// when something ran and passed on every GPU asked; 1 a test failed (the GPU's index and
    /// UUID, the test, the tool's message); 2 nothing could tell (no tool ran, a timeout).
    Diagnose(diagnose::DiagnoseArgs),
    /// The CUDA tier's worker (`diagnose` starts it in a process group of its own).
    #[command(hide = true, name = "__cuda-worker")]
    CudaWorker(crate::diagnose::cuda::WorkerArgs),
}

/// `--config PATH`, shared by the commands that read the daemon's files.
#[derive(Debug, Clone, clap::Args)]
pub struct ConfigArg {
    /// Configuration file.
    #[arg(long, short = 'c', value_name = "PATH", default_value = DEFAULT_CONFIG_PATH, env = "GPU_MEDIC_CONFIG")]
    pub config: PathBuf,
}

impl ConfigArg {
    pub fn load(&self) -> Result<Config, FileError> {
        Config::load(&self.config)
    }

    /// Loads the config and checks it against this machine ([`crate::launch::preflight`]).
    pub fn load_for(&self, mode: crate::launch::preflight::Mode) -> Result<Config, FileError> {
        let (cfg, text) = Config::load_with_text(&self.config)?;
        crate::launch::preflight::check(&cfg, &self.config, &text, mode)?;
        Ok(cfg)
    }
}

/// Loads `--policy FILE` if given, else the config's policy if the config exists, else the
/// built-in default.
pub fn resolve_policy(explicit: Option<&Path>, config: Option<&Path>) -> Result<Policy, FileError> {
    if let Some(p) = explicit {
        return crate::config::load_policy(p);
    }
    if let Some(c) = config
        && c.exists()
    {
        let cfg = Config::load(c)?;
        return crate::config::load_policy(&cfg.policy);
    }
    Policy::parse(Path::new("(built-in default.toml)"), BUILTIN_DEFAULT_POLICY)
}

/// Prints a value as one JSON line ([`out::json`]).
pub fn print_json<T: serde::Serialize>(v: &T) {
    match serde_json::to_string(v) {
        Ok(s) => out::json(&s),
        Err(e) => eprintln!("gpu-medic: cannot encode JSON: {e}"),
    }
}

/// What a command can fail with; each maps to a documented exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(transparent)]
    Config(#[from] FileError),
    #[error(transparent)]
    Journal(#[from] crate::sys::error::JournalError),
    #[error(transparent)]
    Supervisor(#[from] crate::supervisor::SupervisorError),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Runtime(String),
}

impl CliError {
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Config(_) => exit::CONFIG,
            // A newer gpu-medic's state: the operator's decision, like a configuration.
            CliError::Journal(e)
            | CliError::Supervisor(crate::supervisor::SupervisorError::Journal(e))
                if e.is_newer() =>
            {
                exit::CONFIG
            }
            CliError::NotFound(_) => exit::NOT_FOUND,
            CliError::Usage(_) => exit::UNKNOWN,
            CliError::Journal(_) | CliError::Supervisor(_) | CliError::Runtime(_) => {
                exit::UNHEALTHY
            }
        }
    }
}

/// Runs a parsed command; returns the exit code.
pub fn dispatch(cli: Cli) -> Result<i32, CliError> {
    match cli.command {
        Command::Run(a) => run::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Check(a) => check::run(a),
        Command::Incidents(c) => incidents::run(c),
        Command::Evidence(a) => evidence::run(a),
        Command::Policy(c) => policy::run(c),
        Command::Status(a) => status::run(a),
        Command::Fleet(c) => fleet_admin::run(c),
        Command::Tasks(a) => tasks::run(a),
        Command::Drill(a) => drill::run(a),
        Command::Diagnose(a) => diagnose::run(a),
        Command::CudaWorker(a) => Ok(crate::diagnose::cuda::worker_main(&a)),
    }
}
