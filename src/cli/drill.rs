//! `gpu-medic drill`: rehearses a fault on this instance through the real path, so that an
//! operator sees a drain, a restart or a replacement happen on staging before trusting it
//! with a fleet.
//!
//! - `xid N --gpu I` writes a line shaped like the NVIDIA driver's
//!   (`NVRM: Xid (PCI:0000:3b:00): 79, pid=..., name=..., ...`) to the kernel log the
//!   daemon reads (`[nvml] kmsg`: `/dev/kmsg` as root, or a file), so the kernel-log reader,
//!   the engine, the fleet budget and the remedies all run for real;
//! - `mps-hang` stops (SIGSTOP) and `mps-crash` kills (SIGKILL) the real MPS control daemon,
//!   for the MPS probe to find;
//! - `gpu-lost` and `ecc` cannot be played through a real source without breaking the
//!   hardware: their observation travels in the request itself and the daemon judges it as
//!   if NVML had reported it.
//!
//! Every drill first asks the running daemon (`state_dir/requests/`) to arm it: the incident
//! its signal opens carries the drill's id in every record (incidents list/show, the metrics'
//! `drill` label, CloudWatch Logs, EventBridge, `--fleet`), and with `--observe` that
//! incident's orders are journaled and none is executed. A drill's kernel-log XID names the
//! drill's own pid, so a real XID arriving at the same time is never mistaken for it. Before
//! anything happens the drill prints what the policy will do. Refused (exit 4) unless the
//! config says `[drill] allow = true`.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};

use super::{CliError, ConfigArg, exit};
use crate::config::Config;
use crate::model::{
    DRILL_ARM_WINDOW, Drill, DrillExpect, GpuId, IncidentState, Observation, OperatorRequest,
    Record, Signal, SignalKind, Verdict,
};
use crate::policy::Policy;

#[derive(Debug, Args)]
pub struct DrillArgs {
    #[command(subcommand)]
    pub class: DrillClass,
}

/// What every drill takes.
#[derive(Debug, Clone, Args)]
pub struct Common {
    #[command(flatten)]
    pub config: ConfigArg,
    /// Journal every order of the drill's incident and execute none.
    #[arg(long)]
    pub observe: bool,
    /// How long to follow the incident before leaving it to `incidents show`.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "5m")]
    pub wait: Duration,
    /// Who runs the drill (default: $SUDO_USER, $USER).
    #[arg(long)]
    pub by: Option<String>,
}

#[derive(Debug, Subcommand)]
pub enum DrillClass {
    /// An XID in the kernel log, shaped like the NVIDIA driver's line.
    Xid {
        /// The XID code (79: fallen off the bus; 13: an application fault; ...).
        code: u32,
        /// The GPU (NVML index).
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        #[command(flatten)]
        common: Common,
    },
    /// Stops (SIGSTOP) the MPS control daemon: it no longer answers its pipe.
    MpsHang {
        #[command(flatten)]
        common: Common,
    },
    /// Kills (SIGKILL) the MPS control daemon.
    MpsCrash {
        #[command(flatten)]
        common: Common,
    },
    /// A GPU that fell off the bus as NVML reports it (injected through the daemon).
    GpuLost {
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        #[command(flatten)]
        common: Common,
    },
    /// A new uncorrected (double-bit) ECC error (injected through the daemon).
    Ecc {
        #[arg(long, default_value_t = 0)]
        gpu: u32,
        #[command(flatten)]
        common: Common,
    },
}

/// How a drill is played.
enum Play {
    /// A driver-shaped line to the kernel log.
    Kmsg {
        line: String,
        path: std::path::PathBuf,
    },
    /// A signal to the MPS control daemon.
    Mps { sig: libc::c_int },
    /// The observation travels in the request.
    Inject,
}

pub fn run(a: DrillArgs) -> Result<i32, CliError> {
    let (common, class) = match &a.class {
        DrillClass::Xid { common, .. }
        | DrillClass::MpsHang { common }
        | DrillClass::MpsCrash { common }
        | DrillClass::GpuLost { common, .. }
        | DrillClass::Ecc { common, .. } => (common.clone(), &a.class),
    };
    let cfg = common.config.load()?;
    if !cfg.drill.allow {
        eprintln!(
            "gpu-medic drill: refused: drills are not allowed on this instance ({}: [drill] allow is not true). \
             A drill really drains, restarts or replaces; allow it only on a staging instance \
             (`[drill] allow = true`).",
            common.config.config.display()
        );
        return Ok(exit::REFUSED);
    }
    let policy = Policy::load(&cfg.policy)?;
    let me = std::process::id();
    let id = format!("drill-{}-{me}", crate::model::Timestamp::now().0);
    let by = common.by.clone().unwrap_or_else(whoami);

    let (label, signal, value, expect, play, inject) = plan(&cfg, class, me)?;
    announce(&cfg, &policy, &common, &id, &label, &by, &signal, value);
    let request = OperatorRequest::Drill {
        drill: Drill {
            id: id.clone(),
            class: label.clone(),
            observe: common.observe,
            by,
            expect,
            inject,
        },
    };
    arm(&cfg, &request)?;
    let stopped = play_it(&cfg, &common, play)?;
    let code = follow(&cfg, &id, common.wait);
    if let Some(d) = stopped
        && crate::mps::procs::state_letter(d.pid).is_some_and(|c| matches!(c, 'T' | 't'))
        && crate::mps::procs::signal(&d, libc::SIGCONT)
    {
        println!(
            "  undone:  MPS control daemon pid {} continued (SIGCONT)",
            d.pid
        );
    }
    code
}

/// The drill's label, its signal and value for the policy, what its observation looks
/// like, how it is played, and the observation itself for the injected classes.
type Planned = (String, Signal, u64, DrillExpect, Play, Option<Observation>);

fn plan(cfg: &Config, class: &DrillClass, me: u32) -> Result<Planned, CliError> {
    Ok(match class {
        DrillClass::Xid { code, gpu, .. } => plan_xid(cfg, *code, *gpu, me)?,
        DrillClass::MpsHang { .. } | DrillClass::MpsCrash { .. } => {
            if !cfg.mps.enabled {
                return Err(CliError::Usage(
                    "gpu-medic does not watch the MPS daemon here ([mps] enabled = false): nothing would see an MPS drill".into(),
                ));
            }
            let hang = matches!(class, DrillClass::MpsHang { .. });
            let (label, signal, sig) = if hang {
                ("mps-hang", Signal::MpsUnresponsive, libc::SIGSTOP)
            } else {
                ("mps-crash", Signal::MpsDown, libc::SIGKILL)
            };
            let expect = DrillExpect {
                signals: vec![SignalKind::MpsUnresponsive, SignalKind::MpsDown],
                code: None,
                gpu: None,
                pid: None,
            };
            (
                label.to_string(),
                signal,
                u64::MAX,
                expect,
                Play::Mps { sig },
                None,
            )
        }
        DrillClass::GpuLost { gpu, .. } | DrillClass::Ecc { gpu, .. } => {
            let lost = matches!(class, DrillClass::GpuLost { .. });
            let g = gpu_id(cfg, *gpu).unwrap_or_else(|_| GpuId::index_only(*gpu));
            let (label, signal, value, detail) = if lost {
                (
                    "gpu-lost",
                    Signal::GpuLost,
                    0,
                    "drill: GPU is lost (NVML_ERROR_GPU_IS_LOST), injected by gpu-medic drill",
                )
            } else {
                (
                    "ecc",
                    Signal::EccUncorrected,
                    1,
                    "drill: 1 new uncorrected (double-bit) ECC error, injected by gpu-medic drill",
                )
            };
            let obs = Observation::new(signal.clone())
                .on_gpu(g)
                .with_value(value)
                .with_detail(detail)
                .from_source("drill");
            let expect = DrillExpect {
                signals: vec![signal.kind()],
                code: None,
                gpu: Some(*gpu),
                pid: None,
            };
            (
                format!("{label} on GPU {gpu}"),
                signal,
                value,
                expect,
                Play::Inject,
                Some(obs),
            )
        }
    })
}

/// `xid N --gpu I`: a driver-shaped line for the kernel log, naming the drill's pid.
fn plan_xid(cfg: &Config, code: u32, gpu: u32, me: u32) -> Result<Planned, CliError> {
    let Some(path) = cfg.nvml.kmsg.clone().filter(|p| !p.as_os_str().is_empty()) else {
        return Err(CliError::Usage(
            "the kernel log reader is off ([nvml] kmsg = \"\"): an XID drill has nowhere to go"
                .into(),
        ));
    };
    crate::probe::kmsg::check_path(&path).map_err(CliError::Usage)?;
    let g = gpu_id(cfg, gpu)?;
    let pci = kernel_pci(&g.pci_bus_id).ok_or_else(|| {
        CliError::Runtime(format!(
            "GPU {gpu}: NVML gave no usable PCI bus id ({:?})",
            g.pci_bus_id
        ))
    })?;
    let text = xid_text(code);
    let line = format!("NVRM: Xid (PCI:{pci}): {code}, pid={me}, name=gpu-medic, {text}");
    let (decode, _) = crate::probe::kmsg::decode_xid(
        code,
        Some(&text),
        Path::new(crate::probe::kmsg::UVM_REFCNT),
    );
    let expect = DrillExpect {
        signals: vec![SignalKind::Xid],
        code: Some(code),
        gpu: Some(gpu),
        pid: Some(me),
    };
    Ok((
        format!("xid {code} on GPU {gpu}"),
        Signal::Xid { code, decode },
        0,
        expect,
        Play::Kmsg { line, path },
        None,
    ))
}

/// Says what will happen before it does: the rule that judges the signal, and whether its
/// orders run.
#[allow(clippy::too_many_arguments)]
fn announce(
    cfg: &Config,
    policy: &Policy,
    common: &Common,
    id: &str,
    label: &str,
    by: &str,
    signal: &Signal,
    value: u64,
) {
    let mut e = super::policy::explanation_for(policy, signal, value);
    let observe = common.observe || cfg.dry_run || policy.observe_only;
    // The engine sends a `reboot` verdict on to `replace` where this node has no reboot rung.
    let no_rung = e.action == Verdict::Reboot.as_str()
        && (cfg.repair.reboot == crate::config::RebootMethod::Off || !cfg.aws.enabled);
    if no_rung {
        e.action = Verdict::Replace.as_str().into();
    }
    println!("drill {id}: {label}, by {by}");
    println!(
        "  policy:  {} -> {} (rule `{}`, {})",
        e.signal, e.action, e.rule, e.origin
    );
    if no_rung {
        println!(
            "  rung:    the rule says reboot; this node has no reboot rung ([repair] reboot = \"off\" or [aws] disabled), so it is replaced"
        );
    } else if let Some(l) = &e.ladder {
        println!("  ladder:  {l}");
    }
    println!("  why:     {}", e.reason);
    if let Some(c) = &e.confirm {
        println!("  confirm: {c}");
    }
    let what = [
        Verdict::Ignore,
        Verdict::Log,
        Verdict::StopTasks,
        Verdict::RestartMps,
        Verdict::Drain,
        Verdict::Reboot,
        Verdict::Replace,
    ]
    .into_iter()
    .find(|v| v.as_str() == e.action)
    .map_or("act", consequence);
    if common.observe {
        println!("  mode:    observe: every order is journaled, none is executed (would {what})");
    } else if observe {
        println!(
            "  mode:    the daemon is observe-only (dry_run or the policy): nothing is executed (would {what})"
        );
    } else {
        println!("  mode:    LIVE: gpu-medic will {what} for real");
    }
}

/// Hands the request to the running daemon and waits until it took it: whatever the drill
/// plays after this is judged after the drill is armed.
fn arm(cfg: &Config, request: &OperatorRequest) -> Result<(), CliError> {
    let path = crate::journal::submit_request(&cfg.state_dir, request)?;
    let taken_within = cfg.tick_interval.saturating_mul(4) + Duration::from_secs(10);
    let t0 = Instant::now();
    while path.exists() {
        if t0.elapsed() > taken_within {
            let _ = std::fs::remove_file(&path);
            return Err(CliError::Runtime(format!(
                "the daemon did not take the drill request within {} (is `gpu-medic run` running on this config?); nothing was played",
                humantime::format_duration(taken_within)
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("  armed:   the daemon took the request");
    Ok(())
}

/// Plays the fault; returns the MPS daemon it stopped, to continue it once the drill is over.
fn play_it(
    cfg: &Config,
    common: &Common,
    play: Play,
) -> Result<Option<crate::mps::procs::MpsProcess>, CliError> {
    let mut stopped: Option<crate::mps::procs::MpsProcess> = None;
    match play {
        Play::Kmsg { line, path } => {
            write_kmsg(&path, &line).map_err(|e| {
                CliError::Runtime(format!(
                    "cannot write to the kernel log {}: {e}",
                    path.display()
                ))
            })?;
            println!("  played:  {line}  -> {}", path.display());
        }
        Play::Mps { sig } => {
            let mut scan =
                crate::mps::procs::Scanner::new(&cfg.mps.control_binary, &cfg.mps.pipe_directory);
            let found = scan.scan_blocking().map_err(CliError::Runtime)?;
            let Some(daemon) = found.daemons.first().cloned() else {
                return Err(CliError::Runtime(format!(
                    "no MPS control daemon serves {} (is it running?); nothing was played",
                    cfg.mps.pipe_directory.display()
                )));
            };
            if !crate::mps::procs::signal(&daemon, sig) {
                return Err(CliError::Runtime(format!(
                    "cannot signal the MPS control daemon (pid {}): {}",
                    daemon.pid,
                    std::io::Error::last_os_error()
                )));
            }
            let verb = if sig == libc::SIGSTOP {
                "stopped (SIGSTOP)"
            } else {
                "killed (SIGKILL)"
            };
            println!("  played:  MPS control daemon pid {} {verb}", daemon.pid);
            if sig == libc::SIGSTOP {
                stopped = Some(daemon);
            } else if common.observe {
                println!(
                    "  note:    observe: gpu-medic will not restart it; systemd does if its unit restarts it"
                );
            }
        }
        Play::Inject => println!("  played:  the observation was handed to the daemon"),
    }
    Ok(stopped)
}

/// Follows the drill's incident: prints its records as they come, until it closes or
/// `wait` passes.
fn follow(cfg: &Config, id: &str, wait: Duration) -> Result<i32, CliError> {
    let t0 = Instant::now();
    let open_within = DRILL_ARM_WINDOW.min(wait);
    let mut incident = None;
    let mut printed = 0usize;
    loop {
        let recs: Vec<Record> = crate::journal::last_records(&cfg.incidents_path(), 512)?;
        let mine: Vec<&Record> = match incident {
            None => match recs.iter().find(|r| r.drill.as_deref() == Some(id)) {
                Some(r) => {
                    incident = Some(r.incident);
                    println!(
                        "  incident {}: `gpu-medic incidents show {}`",
                        r.incident, r.incident
                    );
                    recs.iter().filter(|x| x.incident == r.incident).collect()
                }
                None => Vec::new(),
            },
            Some(i) => recs.iter().filter(|x| x.incident == i).collect(),
        };
        // `last_records` is a window: count what was printed by record time.
        for r in mine.iter().skip(printed) {
            println!("    {}  {}", r.at, super::policy::event_line(&r.event));
        }
        printed = printed.max(mine.len());
        if let Some(closed) = mine.iter().find_map(|r| match &r.event {
            crate::model::IncidentEvent::Closed { state, .. } => Some(*state),
            _ => None,
        }) {
            println!("  closed:  {}", closed.as_str());
            return Ok(if closed == IncidentState::Failed {
                exit::UNHEALTHY
            } else {
                exit::OK
            });
        }
        if incident.is_none() && t0.elapsed() > open_within {
            eprintln!(
                "gpu-medic drill: no incident opened within {} (the signal joined an incident already open, \
                 was below its rule's threshold or confirmation, or the source did not see it; see `gpu-medic status`)",
                humantime::format_duration(open_within)
            );
            return Ok(exit::UNHEALTHY);
        }
        if t0.elapsed() > wait {
            println!(
                "  still open after {}: follow with `gpu-medic incidents show {}`",
                humantime::format_duration(wait),
                incident.map(|i| i.to_string()).unwrap_or_default()
            );
            return Ok(exit::OK);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The NVML view of GPU `index` (its UUID and PCI bus id), through the config's library.
fn gpu_id(cfg: &Config, index: u32) -> Result<GpuId, CliError> {
    let nvml = crate::probe::nvml::open(&cfg.nvml.library).map_err(|e| {
        use crate::probe::nvml::OpenError;
        let why = match e {
            OpenError::NoDriver(w) | OpenError::Unusable(w) | OpenError::Other(w) => w,
        };
        CliError::Runtime(format!("cannot open NVML to find GPU {index}: {why}"))
    })?;
    let dev = nvml
        .device_by_index(index)
        .map_err(|e| CliError::Usage(format!("GPU {index}: NVML does not list it ({e})")))?;
    let uuid = dev.uuid().unwrap_or_default();
    let pci = dev.pci_info().map(|p| p.bus_id).unwrap_or_default();
    Ok(GpuId {
        index,
        uuid,
        pci_bus_id: pci,
        serial: None,
    })
}

/// NVML's `00000000:3B:00.0` as the driver prints it in an XID line: `0000:3b:00`.
pub fn kernel_pci(nvml: &str) -> Option<String> {
    let s = nvml.split('.').next()?;
    let mut it = s.split(':').map(|p| u32::from_str_radix(p.trim(), 16));
    let (d, b, dev) = (it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?);
    Some(format!("{:04x}:{b:02x}:{dev:02x}", d & 0xffff))
}

/// The text the driver prints after the code, from NVIDIA's catalog where it has one.
fn xid_text(code: u32) -> String {
    match crate::policy::xid_catalog::get(code) {
        Some(x) if !x.description.is_empty() => x.description.clone(),
        _ => "drill".into(),
    }
}

/// Appends one line to the kernel log: a single write, as `/dev/kmsg` takes one record per
/// write (with the driver's error level, `<3>`), or a line appended to a regular file.
fn write_kmsg(path: &Path, line: &str) -> std::io::Result<()> {
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::metadata(path)?;
    let body = if meta.file_type().is_char_device() {
        format!("<3>{line}\n")
    } else if meta.is_file() {
        format!("{line}\n")
    } else {
        return Err(std::io::Error::other(
            "not the kernel log device or a regular file",
        ));
    };
    let mut f = std::fs::OpenOptions::new().append(true).open(path)?;
    f.write_all(body.as_bytes())
}

/// What a verdict does to this instance, in words.
fn consequence(v: Verdict) -> &'static str {
    match v {
        Verdict::Ignore => "ignore it",
        Verdict::Log => "record it only",
        Verdict::StopTasks => "stop the ECS tasks on that GPU",
        Verdict::RestartMps => "restart the MPS control daemon",
        Verdict::Drain => "quarantine and drain this instance",
        Verdict::Reboot => {
            "quarantine, drain and reboot this instance, check it after the boot and return it to service (or replace it)"
        }
        Verdict::Replace => "quarantine and drain this instance and have Auto Scaling replace it",
    }
}

fn whoami() -> String {
    std::env::var("SUDO_USER")
        .or_else(|_| std::env::var("USER"))
        .unwrap_or_else(|_| "operator".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_bus_ids_read_as_the_driver_prints_them() {
        assert_eq!(
            kernel_pci("00000000:3B:00.0").as_deref(),
            Some("0000:3b:00")
        );
        assert_eq!(kernel_pci("0000:07:1f.0").as_deref(), Some("0000:07:1f"));
        assert_eq!(kernel_pci("nope"), None);
        let line = format!(
            "NVRM: Xid (PCI:{}): 79, pid=42, name=gpu-medic, x",
            kernel_pci("00000000:3B:00.0").unwrap_or_default()
        );
        let x = crate::probe::kmsg::parse_line(&line).unwrap();
        assert!(crate::probe::kmsg::same_pci(&x.pci, "00000000:3B:00.0"));
        assert_eq!((x.code, x.pid), (79, Some(42)));
    }

    #[test]
    fn a_drill_matches_only_its_own_signal() {
        let e = DrillExpect {
            signals: vec![SignalKind::Xid],
            code: Some(79),
            gpu: Some(1),
            pid: Some(42),
        };
        let obs = |code, gpu, pid| {
            Observation::new(Signal::xid(code))
                .on_gpu(GpuId::index_only(gpu))
                .with_pids(vec![pid])
        };
        assert!(e.matches(&obs(79, 1, 42)));
        assert!(!e.matches(&obs(79, 1, 43)), "a real XID of another process");
        assert!(!e.matches(&obs(79, 0, 42)));
        assert!(!e.matches(&obs(13, 1, 42)));
        assert!(!e.matches(&Observation::new(Signal::GpuLost)));
    }
}
