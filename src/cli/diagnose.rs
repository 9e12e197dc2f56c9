//! `gpu-medic diagnose`: test the GPUs before trusting them (docs/diagnose.md). Runs DCGM's
//! diagnostics where `dcgmi` is installed and the built-in CUDA check through the driver's
//! library, on every GPU NVML lists or the ones `--gpu` names. Exit 0 only when something ran
//! and passed on every GPU asked; 1 when a test failed (the GPU's index and UUID, the test and
//! the tool's own message); 2 when nothing could tell (saying what it could not read); 3 when
//! every GPU passed and a tool found configuration to fix ("needs configuration").
//!
//! The daemon runs this command as a child of its own for a `diagnose` order (after a reboot,
//! after a drain), so a tool that crashes or hangs never takes the supervisor down; the launch
//! gate runs [`diagnose_node`] in its own process.

use std::path::PathBuf;

use super::{CliError, ConfigArg, exit, print_json};
use crate::config::Config;
use crate::diagnose::{self, MpsAround, Plan, cuda::CudaPlan};
use crate::model::diagnosis::{DiagResult, Diagnosis, Level};

#[derive(Debug, clap::Args)]
pub struct DiagnoseArgs {
    #[command(flatten)]
    config: ConfigArg,
    /// A GPU to test, by NVML index or UUID (repeat for several); default every GPU.
    #[arg(long = "gpu", value_name = "INDEX|UUID")]
    gpus: Vec<String>,
    /// quick, standard or long (DCGM's run levels 1, 2, 3); default `[diagnose] level`.
    #[arg(long, value_parser = parse_level)]
    level: Option<Level>,
    /// Print the whole diagnosis as JSON (each GPU's result per test, each tier's run).
    #[arg(long)]
    json: bool,
    /// Keep each tool's raw output in the JSON (what the evidence bundle keeps).
    #[arg(long, hide = true)]
    raw: bool,
    /// Also write the whole diagnosis, raw output kept, to this file (the daemon's
    /// `diagnose` order reads it).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
    /// Stop the MPS daemon gpu-medic manages for DCGM's run and start it again after (DCGM
    /// needs the GPUs without an MPS server). Only on a drained node: the daemon's diagnose
    /// order passes it; without it DCGM does not run while MPS is up.
    #[arg(long)]
    stop_mps: bool,
}

fn parse_level(s: &str) -> Result<Level, String> {
    Level::parse(s).ok_or_else(|| format!("{s:?}: expected quick, standard or long"))
}

pub fn run(args: DiagnoseArgs) -> Result<i32, CliError> {
    let cfg = if args.config.config.exists() {
        args.config.load().map_err(CliError::Config)?
    } else {
        // No config on this machine (an operator's first look): the defaults.
        Config::parse(&args.config.config, "").map_err(CliError::Config)?
    };
    let level = args.level.unwrap_or(cfg.diagnose.level);
    let d = match diagnose_node(&cfg, level, &args.gpus, args.stop_mps) {
        Ok(d) => d,
        Err(why) => {
            eprintln!("gpu-medic diagnose: {why}");
            return Ok(exit::UNKNOWN);
        }
    };
    if let Some(path) = &args.out
        && let Err(e) =
            crate::sys::fs::write_json_atomic(path, &d, crate::sys::fs::Durability::Atomic)
    {
        eprintln!("gpu-medic diagnose: cannot write {}: {e}", path.display());
    }
    if args.json {
        print_json(&if args.raw { d.clone() } else { d.without_raw() });
    } else {
        print_text(&d);
    }
    Ok(d.result.exit_code())
}

/// The GPUs NVML lists (index, UUID), or why it cannot list them.
pub fn nvml_gpus(cfg: &Config) -> Result<Vec<(u32, String)>, String> {
    let nvml = crate::probe::nvml::open(&cfg.nvml.library).map_err(|e| match e {
        crate::probe::nvml::OpenError::NoDriver(m)
        | crate::probe::nvml::OpenError::Unusable(m)
        | crate::probe::nvml::OpenError::Other(m) => m,
    })?;
    let n = nvml
        .device_count()
        .map_err(|e| format!("NVML device count: {e}"))?;
    let mut out = Vec::new();
    for i in 0..n.min(crate::model::MAX_ITEMS as u32) {
        let uuid = nvml
            .device_by_index(i)
            .and_then(|d| d.uuid())
            .unwrap_or_default();
        out.push((i, uuid));
    }
    Ok(out)
}

/// The GPUs `wanted` names (index or UUID) among `listed`; every listed one when `wanted` is
/// empty. A name NVML does not list is an error (a mistake, not a GPU that failed).
pub fn select(listed: &[(u32, String)], wanted: &[String]) -> Result<Vec<(u32, String)>, String> {
    if wanted.is_empty() {
        return Ok(listed.to_vec());
    }
    let mut out = Vec::new();
    for w in wanted {
        let hit = listed.iter().find(|(i, u)| {
            w.parse::<u32>().ok() == Some(*i) || (!u.is_empty() && u.eq_ignore_ascii_case(w))
        });
        match hit {
            Some(g) if !out.contains(g) => out.push(g.clone()),
            Some(_) => {}
            None if listed.is_empty() => match w.parse::<u32>() {
                // NVML cannot list: an index is taken as the tools number it.
                Ok(i) => out.push((i, String::new())),
                Err(_) => return Err(format!("--gpu {w}: NVML cannot list the GPUs to find it")),
            },
            None => {
                return Err(format!(
                    "--gpu {w}: no such GPU (NVML lists {})",
                    listed
                        .iter()
                        .map(|(i, u)| format!("{i} {u}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
    }
    Ok(out)
}

/// The plan for this node: the tiers `[diagnose]` turns on, the CUDA check as an MPS client
/// when gpu-medic manages MPS and `through_mps` is on, and the MPS daemon stopped for DCGM's
/// run when `stop_mps` (a drained node) or else left alone.
pub fn plan(
    cfg: &Config,
    level: Level,
    gpus: Vec<(u32, String)>,
    explicit: bool,
    stop_mps: bool,
) -> Plan {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("gpu-medic"));
    let d = &cfg.diagnose;
    let mps = match (cfg.mps.enabled, stop_mps) {
        (false, _) => MpsAround::Unmanaged,
        (true, false) => MpsAround::Leave(std::sync::Arc::new(NodeMps(cfg.mps.clone()))),
        (true, true) => MpsAround::Stop(std::sync::Arc::new(NodeMps(cfg.mps.clone()))),
    };
    Plan {
        level,
        gpus: gpus.clone(),
        explicit,
        dcgmi: d.dcgmi(),
        dcgm_host: d.dcgm_host(),
        cuda: d.cuda_library().map(|library| CudaPlan {
            library,
            level,
            gpus,
            timeout: d.timeout,
            mps_pipe: (cfg.mps.enabled && d.through_mps).then(|| cfg.mps.pipe_directory.clone()),
            exe,
            env: Vec::new(),
        }),
        timeout: d.timeout,
        mps,
    }
}

/// Diagnoses this node's GPUs (`wanted`: indexes or UUIDs; empty: all; `stop_mps`: the node
/// is drained, the MPS daemon may be stopped for DCGM). Err only for a mistake in what was
/// asked (a GPU that does not exist).
pub fn diagnose_node(
    cfg: &Config,
    level: Level,
    wanted: &[String],
    stop_mps: bool,
) -> Result<Diagnosis, String> {
    let (listed, unlisted) = match nvml_gpus(cfg) {
        Ok(listed) => (listed, None),
        Err(why) => (Vec::new(), Some(why)),
    };
    let gpus = select(&listed, wanted)?;
    let mut d = diagnose::run(&plan(cfg, level, gpus, !wanted.is_empty(), stop_mps));
    // "No GPU to test" says why when NVML could not list them (a driver that is not loaded).
    if let Some(why) = unlisted
        && d.gpus.is_empty()
    {
        d.summary = format!("{} (NVML cannot list the GPUs: {why})", d.summary);
    }
    Ok(d)
}

/// The MPS daemon gpu-medic manages, reached as the MPS probe finds it (its processes in
/// `/proc`) and stopped and started again through the restart remedy's path.
struct NodeMps(crate::config::MpsConfig);

impl crate::diagnose::MpsControl for NodeMps {
    fn look(&self) -> Result<crate::diagnose::MpsSeen, String> {
        let found = crate::mps::procs::Scanner::new(&self.0.control_binary, &self.0.pipe_directory)
            .scan_blocking()?;
        Ok(crate::diagnose::MpsSeen {
            pipe: self.0.pipe_directory.display().to_string(),
            daemons: found.daemon_pids(),
            servers: found.servers.iter().map(|s| s.pid).collect(),
        })
    }

    fn stop(&self) -> Result<String, String> {
        let remedy = crate::remedy::mps::MpsDaemon::new(self.0.clone());
        on_own_runtime(|| async move { remedy.stop_for_diagnosis().await })?
            .map_err(|e| e.to_string())
    }

    fn start(&self) -> Result<String, String> {
        let remedy = crate::remedy::mps::MpsDaemon::new(self.0.clone());
        on_own_runtime(|| async move { remedy.start_after_diagnosis().await })?
            .map_err(|e| e.to_string())
    }
}

/// Runs an async job to its end on a runtime of its own, on a thread of its own (the caller
/// may be inside a runtime already, where another cannot block).
fn on_own_runtime<F, Fut, T>(job: F) -> Result<T, String>
where
    F: FnOnce() -> Fut + Send,
    Fut: std::future::Future<Output = T>,
    T: Send,
{
    std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start a runtime: {e}"))?;
            Ok(rt.block_on(job()))
        })
        .join()
        .unwrap_or_else(|_| Err("the MPS job panicked".to_string()))
    })
}

fn print_text(d: &Diagnosis) {
    println!("diagnosis ({}): {}", d.level.as_str(), d.result.as_str());
    println!("  {}", d.summary);
    for line in lines(d) {
        println!("{line}");
    }
    match d.result {
        DiagResult::Unknown => println!(
            "could not tell ({}): this is not a pass",
            d.cause.map_or("unknown", |c| c.as_str())
        ),
        DiagResult::Config => {
            println!("needs configuration: not a hardware fault, reported for an operator")
        }
        DiagResult::Pass | DiagResult::Fail => {}
    }
}

/// A diagnosis in one line: `diagnosis (quick): unknown [host-engine]: <summary>`, the cause
/// of one that could not tell in brackets (`incidents show`, the launch gate's report).
pub fn headline(d: &Diagnosis) -> String {
    let cause = d
        .cause
        .map(|c| format!(" [{}]", c.as_str()))
        .unwrap_or_default();
    format!(
        "diagnosis ({}): {}{cause}: {}",
        d.level.as_str(),
        d.result.as_str(),
        d.summary
    )
}

/// Each tier's run and each GPU's result per test, one line each (`diagnose` and
/// `incidents show`).
pub fn lines(d: &Diagnosis) -> Vec<String> {
    let mut out = Vec::new();
    for t in &d.tiers {
        let state = if t.ran {
            t.result.as_str()
        } else {
            "did not run"
        };
        let why = if t.why.is_empty() {
            String::new()
        } else {
            format!(": {}", t.why)
        };
        let cause = t
            .cause
            .filter(|_| !t.ran || t.result == DiagResult::Unknown)
            .map(|c| format!(" [{}]", c.as_str()))
            .unwrap_or_default();
        out.push(format!(
            "  {:<5} {state}{cause} ({:.1}s){why}",
            t.tier.as_str(),
            t.duration_ms as f64 / 1000.0
        ));
        for n in &t.notes {
            out.push(format!("        note: {n}"));
        }
    }
    for g in &d.gpus {
        out.push(format!(
            "  GPU {} {}: {}",
            g.index,
            if g.uuid.is_empty() { "?" } else { &g.uuid },
            g.result.as_str()
        ));
        for t in &g.tests {
            let figure = t
                .value
                .map(|v| format!(" {v:.1} {}", t.unit))
                .unwrap_or_default();
            let msg = if t.message.is_empty() {
                String::new()
            } else {
                format!(": {}", t.message)
            };
            out.push(format!(
                "    {:<5} {:<12} {}{figure}{msg}",
                t.tier.as_str(),
                t.test,
                t.status.as_str()
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listed() -> Vec<(u32, String)> {
        vec![(0, "GPU-aaa".into()), (1, "GPU-bbb".into())]
    }

    #[test]
    fn gpus_by_index_or_uuid() {
        assert_eq!(select(&listed(), &[]).unwrap(), listed());
        assert_eq!(
            select(&listed(), &["1".into(), "gpu-AAA".into(), "1".into()]).unwrap(),
            vec![(1, "GPU-bbb".to_string()), (0, "GPU-aaa".to_string())]
        );
        let e = select(&listed(), &["7".into()]).unwrap_err();
        assert!(e.contains("no such GPU"), "{e}");
        assert_eq!(
            select(&[], &["3".into()]).unwrap(),
            vec![(3, String::new())]
        );
        assert!(select(&[], &["GPU-x".into()]).is_err());
    }
}
