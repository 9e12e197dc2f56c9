//! Active tests of the GPUs (`gpu-medic diagnose`, docs/diagnose.md): what a GPU does when it
//! is made to work, not only what it reports. Two tiers, each an adapter to a tool outside
//! gpu-medic, each run with a deadline in a process tree that is killed whole at it:
//!
//! - [`dcgm`]: NVIDIA DCGM's diagnostics (`dcgmi diag -r 1|2|3 -j`) where DCGM is installed.
//! - [`cuda`]: a built-in check through the driver's `libcuda.so.1` (no toolkit): a context,
//!   a share of free memory written and verified, a kernel with a known answer, copy and
//!   arithmetic figures held against the GPU's siblings. Run in a child process of its own,
//!   as an MPS client of the node's daemon when gpu-medic manages MPS.
//!
//! [`run`] runs the tiers for the GPUs asked and puts their findings together
//! ([`Diagnosis::combine`]): only what a tool was seen to pass is a pass.
//!
//! DCGM's diagnostic needs the GPUs without an MPS server on them (its tests make CUDA
//! contexts of their own; an MPS server holding a GPU in exclusive-process mode makes them
//! fail "busy or unavailable"). Where gpu-medic manages MPS ([`MpsAround`]) the DCGM tier
//! looks for the daemon first: on a drained node or in the boot check (`--stop-mps`, what the
//! daemon's `diagnose` order passes) it stops the daemon through the restart remedy's path
//! (`systemctl stop <unit>` under systemd, whose `Restart=always` would start it again),
//! runs DCGM, and starts it again, saying so in the tier's notes; otherwise, while the daemon
//! is up, DCGM does not run ("MPS up"). It never stops a daemon whose servers serve clients.

pub mod cuda;
pub mod dcgm;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use std::sync::Arc;

use crate::model::diagnosis::{Cause, DiagResult, Diagnosis, GpuDiagnosis, Level, Tier, TierRun};

/// What is done about the node's MPS daemon around DCGM's run.
#[derive(Clone)]
pub enum MpsAround {
    /// gpu-medic does not manage MPS here (`[mps] enabled = false`): DCGM runs as the node
    /// is, and its words for a busy GPU are read as such.
    Unmanaged,
    /// The daemon is left alone (a hand run, the launch gate, where the supervisor watches it
    /// at the same time): while it is up DCGM does not run ("MPS up").
    Leave(Arc<dyn MpsControl>),
    /// The node is drained or in the boot check: the daemon is stopped for DCGM's run and
    /// started again after (`gpu-medic diagnose --stop-mps`).
    Stop(Arc<dyn MpsControl>),
}

impl std::fmt::Debug for MpsAround {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MpsAround::Unmanaged => "Unmanaged",
            MpsAround::Leave(_) => "Leave",
            MpsAround::Stop(_) => "Stop",
        })
    }
}

/// What is up of the MPS daemon gpu-medic manages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsSeen {
    /// Its pipe directory, for messages.
    pub pipe: String,
    pub daemons: Vec<u32>,
    /// Servers serve clients: someone still uses the GPUs.
    pub servers: Vec<u32>,
}

/// The MPS daemon as the caller reaches it (the MPS adapter and the restart remedy's path,
/// which live above this layer). Errors are the words to show.
pub trait MpsControl: Send + Sync {
    /// What serves the pipe directory now.
    fn look(&self) -> Result<MpsSeen, String>;
    /// Stops the daemon for DCGM's run; says what was done.
    fn stop(&self) -> Result<String, String>;
    /// Starts it again and waits until it answers; says what was done.
    fn start(&self) -> Result<String, String>;
}

/// What to test and with what.
#[derive(Debug, Clone)]
pub struct Plan {
    pub level: Level,
    /// The GPUs asked for (NVML index, UUID); empty: every GPU a tier finds.
    pub gpus: Vec<(u32, String)>,
    /// Whether `gpus` was asked by the caller (`--gpu`) rather than found by NVML.
    pub explicit: bool,
    /// `dcgmi`; `None` turns the DCGM tier off.
    pub dcgmi: Option<PathBuf>,
    /// `dcgmi --host`, if any.
    pub dcgm_host: Option<String>,
    /// The CUDA tier; `None` turns it off.
    pub cuda: Option<cuda::CudaPlan>,
    /// Each tier's deadline.
    pub timeout: Duration,
    /// The MPS daemon around DCGM's run.
    pub mps: MpsAround,
}

/// A tier that was turned off: it ran nothing and says so.
pub fn off(tier: Tier, why: &str) -> (TierRun, Vec<GpuDiagnosis>) {
    not_run(tier, why.to_string(), Cause::NoTool)
}

/// A tier that did not run, why, and what kept it from running.
fn not_run(tier: Tier, why: String, cause: Cause) -> (TierRun, Vec<GpuDiagnosis>) {
    (
        TierRun {
            tier,
            ran: false,
            result: DiagResult::Unknown,
            why,
            cause: Some(cause),
            notes: Vec::new(),
            duration_ms: 0,
            raw: String::new(),
        },
        Vec::new(),
    )
}

/// Runs every tier the plan names, one after the other (DCGM first: it wants the GPUs to
/// itself), and judges the whole.
pub fn run(plan: &Plan) -> Diagnosis {
    let start = Instant::now();
    let indexes: Option<Vec<u32>> = if plan.gpus.is_empty() {
        None
    } else {
        Some(plan.gpus.iter().map(|(i, _)| *i).collect())
    };
    let mut tiers = Vec::new();
    let mut mps_down: Option<String> = None;
    tiers.push(match &plan.dcgmi {
        Some(binary) => {
            let dplan = dcgm::DcgmPlan {
                binary: binary.clone(),
                level: plan.level,
                gpus: indexes.clone(),
                timeout: plan.timeout,
                host: plan.dcgm_host.clone(),
            };
            let (run, left_down) = dcgm_around_mps(&dplan, &plan.mps);
            mps_down = left_down;
            run
        }
        None => off(Tier::Dcgm, "turned off ([diagnose] dcgmi = \"\")"),
    });
    tiers.push(match (&plan.cuda, &mps_down) {
        (Some(c), Some(why)) if c.mps_pipe.is_some() => (
            TierRun {
                tier: Tier::Cuda,
                ran: true,
                result: DiagResult::Unknown,
                why: format!(
                    "the check through MPS could not run: the MPS daemon stopped for DCGM could not be started again ({why})"
                ),
                cause: Some(Cause::Mps),
                notes: Vec::new(),
                duration_ms: 0,
                raw: String::new(),
            },
            Vec::new(),
        ),
        (Some(c), _) => {
            let mut c = c.clone();
            c.level = plan.level;
            c.gpus = plan.gpus.clone();
            c.timeout = plan.timeout;
            cuda::run(&c)
        }
        (None, _) => off(Tier::Cuda, "turned off ([diagnose] cuda_library = \"\")"),
    });
    let asked: Vec<(u32, String)> = if plan.gpus.is_empty() {
        // No NVML list: every GPU a tier that ran found.
        let mut found: Vec<(u32, String)> = tiers
            .iter()
            .flat_map(|(_, g)| g.iter().map(|g| (g.index, g.uuid.clone())))
            .collect();
        found.sort();
        found.dedup_by_key(|(i, _)| *i);
        found
    } else {
        plan.gpus.clone()
    };
    let ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
    Diagnosis::combine(plan.level, &asked, tiers, ms)
}

/// DCGM's tier with the MPS daemon as `mps` says; the second value says why the daemon
/// stopped for it could not be started again, if it could not.
fn dcgm_around_mps(
    plan: &dcgm::DcgmPlan,
    mps: &MpsAround,
) -> ((TierRun, Vec<GpuDiagnosis>), Option<String>) {
    let (control, stop) = match mps {
        MpsAround::Unmanaged => return (dcgm::run(plan), None),
        MpsAround::Leave(c) => (c, false),
        MpsAround::Stop(c) => (c, true),
    };
    let seen = match control.look() {
        Ok(s) => s,
        Err(e) => {
            // Nothing to go on: DCGM runs, and its words for a busy GPU still count.
            let mut run = dcgm::run(plan);
            run.0
                .notes
                .push(format!("could not look for the MPS daemon: {e}"));
            return (run, None);
        }
    };
    if seen.daemons.is_empty() && seen.servers.is_empty() {
        return (dcgm::run(plan), None);
    }
    let up = format!(
        "MPS up: the MPS control daemon (pid {:?}) serves {}{}",
        seen.daemons,
        seen.pipe,
        if seen.servers.is_empty() {
            String::new()
        } else {
            format!(", its server(s) pid {:?} serving clients", seen.servers)
        }
    );
    if !stop {
        return (
            not_run(
                Tier::Dcgm,
                format!(
                    "{up}; DCGM's diagnostic needs the GPUs without an MPS server, and the daemon is left alone here (the daemon's diagnose order on a drained node stops it; by hand: `gpu-medic diagnose --stop-mps` on a drained node)"
                ),
                Cause::Mps,
            ),
            None,
        );
    }
    if !seen.servers.is_empty() {
        return (
            not_run(
                Tier::Dcgm,
                format!(
                    "{up}: clients still use the GPUs (tasks left on the node?), so the daemon is not stopped and DCGM does not run"
                ),
                Cause::Mps,
            ),
            None,
        );
    }
    let stopped = match control.stop() {
        Ok(how) => how,
        Err(e) => {
            return (
                not_run(
                    Tier::Dcgm,
                    format!("{up}, and it could not be stopped for DCGM's run: {e}"),
                    Cause::Mps,
                ),
                None,
            );
        }
    };
    let (mut run, gpus) = dcgm::run(plan);
    run.notes.insert(
        0,
        format!(
            "the MPS daemon of {} was stopped for DCGM's run (it needs the GPUs without an MPS server): {stopped}",
            seen.pipe
        ),
    );
    let down = start_again(control.as_ref(), &mut run);
    ((run, gpus), down)
}

/// Starts the MPS daemon stopped for DCGM's run again, saying so in `run`'s notes; one that
/// cannot be started makes the tier could not tell (`mps`, unless a GPU failed) and says why.
fn start_again(control: &dyn MpsControl, run: &mut TierRun) -> Option<String> {
    match control.start() {
        Ok(how) => {
            run.notes.push(format!(
                "the MPS daemon was started again after DCGM's run: {how}"
            ));
            None
        }
        Err(e) => {
            run.notes.push(format!(
                "the MPS daemon could not be started again after DCGM's run: {e}"
            ));
            if run.result != DiagResult::Fail {
                run.result = DiagResult::Unknown;
                run.cause = Some(Cause::Mps);
                run.why = format!(
                    "the MPS daemon stopped for DCGM's run could not be started again: {e}{}",
                    if run.why.is_empty() {
                        String::new()
                    } else {
                        format!("; {}", run.why)
                    }
                );
            }
            Some(e)
        }
    }
}

/// Which tiers can run on this machine, and why the others cannot (said once at start; a
/// tier that cannot run is a configuration or installation matter, never a GPU fault).
pub fn usable(
    dcgmi: Option<&std::path::Path>,
    cuda_library: Option<&std::path::Path>,
) -> (Vec<crate::model::diagnosis::Tier>, Vec<String>) {
    let mut ok = Vec::new();
    let mut not = Vec::new();
    match dcgmi {
        None => not.push("dcgm: turned off ([diagnose] dcgmi = \"\")".to_string()),
        Some(p) => match executable(p) {
            Ok(()) => ok.push(Tier::Dcgm),
            Err(why) => not.push(format!("dcgm: {} {why}", p.display())),
        },
    }
    match cuda_library {
        None => not.push("cuda: turned off ([diagnose] cuda_library = \"\")".to_string()),
        Some(p) => match loadable(p) {
            Ok(()) => ok.push(Tier::Cuda),
            Err(why) => not.push(format!("cuda: {why}")),
        },
    }
    (ok, not)
}

fn executable(p: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let m = std::fs::metadata(p).map_err(|e| format!("cannot be run: {e}"))?;
    if !m.is_file() || m.permissions().mode() & 0o111 == 0 {
        return Err("is not an executable file".into());
    }
    Ok(())
}

/// Whether the dynamic loader can load `library` (a name it searches for, or a path).
fn loadable(library: &std::path::Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    if library.as_os_str().as_bytes().contains(&b'/') {
        // dlopen opens a path itself, blocking: a FIFO there would hang it.
        crate::sys::limits::check_path_kind(library, crate::sys::limits::Kind::Regular)
            .map_err(|why| format!("{} {why}", library.display()))?;
    }
    let name = std::ffi::CString::new(library.as_os_str().as_bytes())
        .map_err(|_| format!("{} has a NUL byte", library.display()))?;
    // SAFETY: `name` is a NUL-terminated string that lives across the call. RTLD_LAZY |
    // RTLD_LOCAL loads the library without binding its symbols into the process; the handle
    // is closed at once and nothing from the library is used, so no symbol outlives it.
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            return Err(format!("{} cannot be loaded", library.display()));
        }
        libc::dlclose(h);
    }
    Ok(())
}
