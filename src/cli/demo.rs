//! `gpu-medic demo`: the real supervisor on a simulated node, on any machine (no GPU, no
//! AWS, no root). Four GPUs come from the fake libnvidia-ml built with this repository; the
//! MPS daemon is NVIDIA's real one when it is installed; the control plane records the ECS
//! and Auto Scaling calls it would make (EC2's `RebootInstances` too). A short script plays
//! three faults and the demo ends by printing the incidents as on-call would read them.
//!
//! The third fault shows the repair path end to end: XID 79 is rebooted, not replaced. The
//! reboot is recorded, then the demo plays the boot as a real node has it: the supervisor
//! stops, the kernel's boot id (a file of the demo's, `[repair] boot_id_path`) changes, and a
//! new supervisor starts over the same state; the engine sees the new boot and resumes:
//! quarantine, the launch gate's passive checks, the diagnosis (`gpu-medic diagnose` run as a
//! child, the built-in CUDA check on the fake libcuda built with this repository), and the
//! return to service.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::incidents::{print_table, print_timeline};
use super::{BUILTIN_DEFAULT_POLICY, CliError, exit};
use crate::config::Config;
use crate::journal::read_jsonl;
use crate::model::diagnosis::Diagnosis;
use crate::model::{Incident, IncidentEvent, IncidentState, Record};
use crate::mps::control::ControlClient;
use crate::mps::procs::{self, Scanner};
use crate::policy::Policy;
use crate::remedy::Remedies;
use crate::remedy::diagnose::DiagnoseCommand;
use crate::remedy::mps::MpsDaemon;
use crate::remedy::recorder::{RecordingControlPlane, SimulatedReboot};
use crate::supervisor::{Supervisor, SupervisorError};

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Keep the demo's state folder (config, journal) instead of deleting it.
    #[arg(long)]
    keep: bool,
    /// The fake NVML library (default: libfake_nvml.so next to this binary).
    #[arg(long, env = "GPU_MEDIC_DEMO_NVML")]
    nvml: Option<PathBuf>,
    /// The fake CUDA driver library the diagnosis tests (default: libfake_cuda.so next to
    /// this binary). Without it the diagnosis after the boot is skipped.
    #[arg(long, env = "GPU_MEDIC_DEMO_CUDA")]
    cuda: Option<PathBuf>,
}

/// Finds a fake library built by `cargo build --workspace`: `explicit`, else `name` next to
/// this binary or in its `deps/`.
fn find_fake(explicit: Option<PathBuf>, name: &str) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return p.exists().then_some(p);
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [dir.join(name), dir.join("deps").join(name)]
        .into_iter()
        .find(|p| p.is_file())
}

/// The demo's kernel boot id before the simulated reboot, and after it.
const BOOT_BEFORE: &str = "demo-boot-1";
const BOOT_AFTER: &str = "demo-boot-2";

struct Stage {
    dir: PathBuf,
    inject: PathBuf,
    n: u32,
}

impl Stage {
    /// Drops one injection into the fake library's folder (written, then renamed, so it is
    /// never read half-written).
    fn inject(&mut self, json: &str) -> Result<(), CliError> {
        self.n += 1;
        let dst = self.inject.join(format!("{:04}.json", self.n));
        // Atomic only: the fake library must never read half an injection; the demo's
        // folder does not outlive the demo.
        crate::sys::fs::write_atomic(&dst, json.as_bytes(), crate::sys::fs::Durability::Atomic)
            .map_err(|e| CliError::Runtime(format!("demo: cannot inject a fault: {e}")))
    }

    fn incidents(&self) -> Vec<Incident> {
        let (records, _) =
            read_jsonl::<Record>(&self.dir.join("state/incidents.jsonl")).unwrap_or_default();
        Incident::fold(records)
    }

    /// The remediation's current step in the saved state (`await-boot`, ...), if any.
    fn step(&self) -> Option<String> {
        let text = std::fs::read_to_string(self.dir.join("state/state.json")).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        v.get("remediation")?
            .get("step")?
            .as_str()
            .map(str::to_string)
    }

    /// Waits until the remediation reaches `step` (false after the timeout).
    async fn wait_step(&self, step: &str) -> bool {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20) {
            if self.step().as_deref() == Some(step) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!("   (gave up waiting for the remediation step {step})");
        false
    }

    /// Waits until an incident matches `pred` (or the timeout passes).
    async fn wait_for(&self, what: &str, pred: impl Fn(&Incident) -> bool) -> Option<Incident> {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(20) {
            if let Some(i) = self.incidents().into_iter().find(|i| pred(i)) {
                return Some(i);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!("   (gave up waiting for {what})");
        None
    }
}

/// The real MPS control daemon, if installed.
fn find_mps_control() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("nvidia-cuda-mps-control"))
        .find(|p| p.is_file())
}

/// Kills every MPS process serving the demo's pipe directory.
async fn kill_mps(cfg: &crate::config::MpsConfig) -> usize {
    let mut scanner = Scanner::new(&cfg.control_binary, &cfg.pipe_directory);
    let Ok(found) = scanner.scan().await else {
        return 0;
    };
    let mut n = 0;
    for p in found.daemons.iter().chain(found.servers.iter()) {
        if procs::signal(p, libc::SIGKILL) {
            n += 1;
        }
    }
    n
}

/// What the demo runs on, printed before it starts.
fn banner(lib: &Path, mps_binary: Option<&Path>, cuda: Option<&Path>, dir: &Path) {
    println!("gpu-medic demo: the real supervisor on a simulated node");
    println!(
        "  GPUs:          4 x NVIDIA H200 from the fake libnvidia-ml ({})",
        lib.display()
    );
    match mps_binary {
        Some(b) => println!(
            "  MPS daemon:    NVIDIA's real control daemon ({})",
            b.display()
        ),
        None => println!(
            "  MPS daemon:    not installed here (Debian non-free: nvidia-cuda-mps); that part is skipped"
        ),
    }
    println!(
        "  control plane: simulated (records the ECS, Auto Scaling and EC2 calls it would make)"
    );
    match cuda {
        Some(c) => println!(
            "  diagnosis:     gpu-medic diagnose, the built-in CUDA check on the fake libcuda ({}); DCGM off",
            c.display()
        ),
        None => println!(
            "  diagnosis:     the fake libcuda (libfake_cuda.so) was not found: skipped (the node returns on the passive checks)"
        ),
    }
    println!("  policy:        the default policy (policies/default.toml)");
    println!("  state:         {}", dir.join("state").display());
    println!();
}

pub fn run(a: DemoArgs) -> Result<i32, CliError> {
    let Some(lib) = find_fake(a.nvml, "libfake_nvml.so") else {
        eprintln!("gpu-medic demo needs the fake libnvidia-ml built with this repository:");
        eprintln!("  cargo build --workspace && target/debug/gpu-medic demo");
        return Ok(exit::UNKNOWN);
    };
    let cuda = find_fake(a.cuda, "libfake_cuda.so");
    // Short: the MPS pipe path must stay under the socket path limit (107 bytes).
    let dir = PathBuf::from(format!("/tmp/gpu-medic-demo-{}", std::process::id()));
    let mps_binary = find_mps_control();
    let inject = dir.join("inject");
    std::fs::create_dir_all(&inject)
        .map_err(|e| CliError::Runtime(format!("demo: cannot create {}: {e}", dir.display())))?;
    let policy_path = dir.join("default.toml");
    let config_path = dir.join("config.toml");
    let write = |p: &Path, text: &str| {
        std::fs::write(p, text)
            .map_err(|e| CliError::Runtime(format!("demo: cannot write {}: {e}", p.display())))
    };
    write(&policy_path, BUILTIN_DEFAULT_POLICY)?;
    // A kernel log of the demo's own: this machine's /dev/kmsg holds whatever its driver (or
    // an earlier drill) printed, which is no part of the simulated node.
    let kmsg = dir.join("kmsg");
    write(&kmsg, "")?;
    // The simulated node's kernel boot id: the simulated reboot changes it.
    let boot_id = dir.join("boot_id");
    write(&boot_id, &format!("{BOOT_BEFORE}\n"))?;
    write(
        &config_path,
        &format!(
            "state_dir = \"state\"\npolicy = \"default.toml\"\ntick_interval = \"200ms\"\n\
             [nvml]\nlibrary = \"{}\"\npoll_interval = \"1s\"\nexpected_gpus = 4\nkmsg = \"{}\"\n\
             {}[aws]\nenabled = false\n\
             [repair]\nboot_id_path = \"{}\"\ncheck_interval = \"200ms\"\nsettle = \"5s\"\n\
             [diagnose]\ndcgmi = \"\"\ncuda_library = \"{}\"\ntimeout = \"30s\"\n",
            lib.display(),
            kmsg.display(),
            match &mps_binary {
                Some(b) => format!(
                    "[mps]\ncontrol_binary = \"{}\"\nmanage = \"direct\"\npipe_directory = \"{}\"\n\
                     log_directory = \"{}\"\nprobe_interval = \"500ms\"\nprobe_timeout = \"300ms\"\n",
                    b.display(),
                    dir.join("mps").display(),
                    dir.join("mps-log").display()
                ),
                None => "[mps]\nenabled = false\n".to_string(),
            },
            boot_id.display(),
            cuda.as_deref()
                .map(Path::display)
                .map(|d| d.to_string())
                .unwrap_or_default(),
        ),
    )?;
    // SAFETY: set before any thread is started (the runtime is built below); the fake NVML
    // library reads these when gpu-medic opens it, the fake CUDA library (in the diagnosis's
    // worker, which inherits them) at cuInit: its defaults are fake NVML's four H200s.
    unsafe {
        std::env::set_var("FAKE_NVML_INJECT_DIR", &inject);
        std::env::remove_var("FAKE_NVML_CONFIG");
        std::env::remove_var("FAKE_CUDA_CONFIG");
        std::env::remove_var("FAKE_CUDA_INIT_ERROR");
    }
    let cfg = Config::load(&config_path)?;
    let policy = crate::config::load_policy(&cfg.policy)?;
    crate::cli::run::init_logging_quiet();

    banner(&lib, mps_binary.as_deref(), cuda.as_deref(), &dir);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::Runtime(format!("cannot start the runtime: {e}")))?;
    let control_plane = RecordingControlPlane::default();
    let diagnose = cuda
        .is_some()
        .then(|| DiagnoseCommand::from_config(&cfg, &config_path));
    let result = rt.block_on(play(
        cfg,
        policy,
        control_plane.clone(),
        diagnose,
        Stage {
            dir: dir.clone(),
            inject,
            n: 0,
        },
    ));
    drop(rt);
    if a.keep {
        println!();
        println!(
            "kept: {} (try: gpu-medic incidents list --config {})",
            dir.display(),
            config_path.display()
        );
    } else {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

/// The simulated node: what a start of gpu-medic on it needs.
struct Node {
    cfg: Config,
    policy: Policy,
    remedies: Arc<Remedies>,
    mps_client: ControlClient,
}

/// One life of the supervisor: until its token is cancelled.
struct Life {
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), SupervisorError>>,
}

impl Node {
    /// Starts gpu-medic on the node (the probes, the engine over `state_dir`, the remedies)
    /// and returns once its first state is saved, plus the first NVML poll.
    async fn start(&self) -> Life {
        let sources = crate::probe::sources(
            &self.cfg,
            crate::probe::Urgency::of(&self.policy),
            &self.mps_client,
            None,
        );
        let mut supervisor =
            Supervisor::new(self.cfg.clone(), self.policy.clone(), self.remedies.clone());
        for s in sources {
            supervisor.add_source(s);
        }
        let shutdown = CancellationToken::new();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let token = shutdown.clone();
        let task = tokio::spawn(async move {
            supervisor
                .run(token, move || {
                    let _ = ready_tx.send(());
                })
                .await
        });
        let _ = ready_rx.await;
        tokio::time::sleep(Duration::from_millis(1500)).await; // first NVML poll
        Life { shutdown, task }
    }
}

impl Life {
    /// Stops this life of gpu-medic as a shutdown does (the state saved).
    async fn stop(self) -> Result<(), CliError> {
        self.shutdown.cancel();
        match self.task.await {
            Ok(r) => Ok(r?),
            Err(e) => Err(CliError::Runtime(format!("demo supervisor failed: {e}"))),
        }
    }
}

async fn play(
    cfg: Config,
    policy: Policy,
    control_plane: RecordingControlPlane,
    diagnose: Option<DiagnoseCommand>,
    mut stage: Stage,
) -> Result<i32, CliError> {
    let mps_client = ControlClient::new(&cfg.mps);
    let mps_cfg = cfg.mps.enabled.then(|| cfg.mps.clone());
    let mut remedies = Remedies {
        mps: None,
        control_plane: Some(Arc::new(control_plane.clone())),
        evidence: None,
        // The reboot rung: RebootInstances recorded, the check after the boot the real one.
        repair: Some(Arc::new(SimulatedReboot {
            control_plane: control_plane.clone(),
            boot_id_path: cfg.repair.boot_id_path.clone(),
            check: super::run::boot_check(&cfg, &policy),
            check_interval: cfg.repair.check_interval,
            settle: cfg.repair.settle,
        })),
        diagnose: diagnose.map(|d| Arc::new(d) as Arc<dyn crate::remedy::diagnose::DiagnoseRemedy>),
    };
    if let Some(m) = &mps_cfg {
        let daemon = MpsDaemon::with_client(m.clone(), mps_client.clone());
        // The demo node's daemon is started the way gpu-medic restarts one.
        if let Err(e) = daemon.restart_now().await {
            println!("   (could not start the MPS daemon: {e}; that part is skipped)");
        }
        remedies.mps = Some(Arc::new(daemon));
    }
    let node = Node {
        cfg,
        policy,
        remedies: Arc::new(remedies),
        mps_client,
    };
    let life = node.start().await;
    let played = acts(&mut stage, &node, life, mps_cfg.as_ref()).await;
    if let Some(m) = &mps_cfg {
        kill_mps(m).await;
    }
    played?;

    epilogue(&stage, &control_plane);
    Ok(exit::OK)
}

/// The demo's acts: an application XID tolerated, the MPS daemon crashing and restarted,
/// a GPU off the bus rebooted, checked, diagnosed and returned to service. Ends with the
/// supervisor stopped.
async fn acts(
    stage: &mut Stage,
    node: &Node,
    mut life: Life,
    mps_cfg: Option<&crate::config::MpsConfig>,
) -> Result<(), CliError> {
    println!("1. An application bug on GPU 2 raises XID 13 (graphics engine exception).");
    stage.inject(r#"{"gpu": 2, "xid": 13}"#)?;
    if let Some(i) = stage
        .wait_for("the XID 13 incident", |i| i.signal == "xid 13")
        .await
    {
        println!(
            "   -> incident {}: {} (rule `{}`): tolerated, nothing done.",
            i.id,
            i.state.as_str(),
            i.rule
        );
        println!();
    }

    if let Some(m) = mps_cfg {
        println!("2. The MPS control daemon crashes (SIGKILL), leaving a stale pipe directory.");
        kill_mps(m).await;
        if let Some(i) = stage
            .wait_for("the MPS incident to heal", |i| {
                i.signal == "mps-down" && i.state != IncidentState::Open
            })
            .await
        {
            println!(
                "   -> incident {}: {} (rule `{}`): daemon restarted and answering; tasks can use MPS again.",
                i.id,
                i.state.as_str(),
                i.rule
            );
            println!();
        }
    }

    println!(
        "{}. GPU 0 falls off the PCIe bus: XID 79.",
        if mps_cfg.is_some() { 3 } else { 2 }
    );
    stage.inject(r#"{"gpu": 0, "xid": 79}"#)?;
    if stage.wait_step("await-boot").await {
        let id = stage
            .incidents()
            .into_iter()
            .find(|i| i.signal == "xid 79")
            .map(|i| format!("{} (rule `{}`)", i.id, i.rule))
            .unwrap_or_default();
        println!(
            "   -> incident {id}: quarantined, drained, reboot requested (ec2:RebootInstances): the first time, the policy reboots before it replaces."
        );
        println!(
            "   The node reboots (simulated): gpu-medic stops, the kernel comes back with a new boot id and the GPUs reset, gpu-medic starts again over the same state."
        );
        life.stop().await?;
        reboot_node(stage, &node.cfg)?;
        life = node.start().await;
    }
    if let Some(i) = stage
        .wait_for("the XID 79 incident to finish", |i| {
            i.signal == "xid 79" && i.state != IncidentState::Open
        })
        .await
    {
        let diagnosis = match last_diagnosis(&i) {
            Some(d) => format!(
                "diagnosis ({}) {}: {}",
                d.level.as_str(),
                d.result.as_str(),
                d.summary
            ),
            None => "no diagnosis (no tool here: returned on the passive checks)".to_string(),
        };
        println!(
            "   -> incident {}: {} (rule `{}`): quarantined again, boot check passed, {diagnosis}; back in service.",
            i.id,
            i.state.as_str(),
            i.rule
        );
        println!();
    }
    life.stop().await
}

/// The simulated boot: a new kernel boot id and a new (empty) kernel log. The GPU reset a
/// reboot makes needs nothing here: the fake library's XID left no lasting state on GPU 0.
fn reboot_node(stage: &Stage, cfg: &Config) -> Result<(), CliError> {
    let write = |p: &Path, text: &str| {
        crate::sys::fs::write_atomic(p, text.as_bytes(), crate::sys::fs::Durability::Atomic)
            .map_err(|e| CliError::Runtime(format!("demo: cannot write {}: {e}", p.display())))
    };
    write(&cfg.repair.boot_id_path, &format!("{BOOT_AFTER}\n"))?;
    write(&stage.dir.join("kmsg"), "")
}

/// The last diagnosis an incident's orders brought back.
fn last_diagnosis(i: &Incident) -> Option<&Diagnosis> {
    i.records.iter().rev().find_map(|r| match &r.event {
        IncidentEvent::ActionFinished { outcome } => outcome.diagnosis.as_deref(),
        _ => None,
    })
}

/// What on-call sees afterwards, and the calls the control plane would have made.
fn epilogue(stage: &Stage, control_plane: &RecordingControlPlane) {
    println!("What on-call sees: gpu-medic incidents list");
    let incidents = stage.incidents();
    print_table(incidents.iter());
    if let Some(i) = incidents.iter().find(|i| i.signal == "xid 79") {
        println!();
        println!("gpu-medic incidents show {}", i.id);
        print_timeline(i);
    }
    println!();
    println!("Calls the control plane would have made:");
    for c in control_plane.calls() {
        println!("  {}  {}({})", c.request_id, c.api, c.detail);
    }
}
