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

pub mod cuda;
pub mod dcgm;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::model::diagnosis::{DiagResult, Diagnosis, GpuDiagnosis, Level, TierRun};

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
}

/// A tier that was turned off: it ran nothing and says so.
pub fn off(tier: crate::model::diagnosis::Tier, why: &str) -> (TierRun, Vec<GpuDiagnosis>) {
    (
        TierRun {
            tier,
            ran: false,
            result: DiagResult::Unknown,
            why: why.to_string(),
            duration_ms: 0,
            raw: String::new(),
        },
        Vec::new(),
    )
}

/// Runs every tier the plan names, one after the other (DCGM first: it wants the GPUs to
/// itself), and judges the whole.
pub fn run(plan: &Plan) -> Diagnosis {
    use crate::model::diagnosis::Tier;
    let start = Instant::now();
    let indexes: Option<Vec<u32>> = if plan.gpus.is_empty() {
        None
    } else {
        Some(plan.gpus.iter().map(|(i, _)| *i).collect())
    };
    let mut tiers = Vec::new();
    tiers.push(match &plan.dcgmi {
        Some(binary) => dcgm::run(&dcgm::DcgmPlan {
            binary: binary.clone(),
            level: plan.level,
            gpus: indexes.clone(),
            timeout: plan.timeout,
            host: plan.dcgm_host.clone(),
        }),
        None => off(Tier::Dcgm, "turned off ([diagnose] dcgmi = \"\")"),
    });
    tiers.push(match &plan.cuda {
        Some(c) => {
            let mut c = c.clone();
            c.level = plan.level;
            c.gpus = plan.gpus.clone();
            c.timeout = plan.timeout;
            cuda::run(&c)
        }
        None => off(Tier::Cuda, "turned off ([diagnose] cuda_library = \"\")"),
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

/// Which tiers can run on this machine, and why the others cannot (said once at start; a
/// tier that cannot run is a configuration or installation matter, never a GPU fault).
pub fn usable(
    dcgmi: Option<&std::path::Path>,
    cuda_library: Option<&std::path::Path>,
) -> (Vec<crate::model::diagnosis::Tier>, Vec<String>) {
    use crate::model::diagnosis::Tier;
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
