//! `gpu-medic drill`: rehearses a fault on this instance through the real path, so that an
//! operator sees a drain, a restart or a replacement happen on staging before trusting it
//! with a fleet.
//!
//! - `xid N --gpu I`, `gpu-lost` and `ecc` cannot be played through a real source without
//!   breaking the hardware (and only the driver's own kernel-log records are XIDs: a line
//!   written to the kernel log is refused like any forged one): their observation travels in
//!   the request itself, marked as a drill (source `drill`), and the daemon judges it as if
//!   its probe had reported it, so the engine, the fleet budget and the remedies all run for
//!   real;
//! - `mps-hang` stops (SIGSTOP) and `mps-crash` kills (SIGKILL) the real MPS control daemon,
//!   for the MPS probe to find.
//!
//! Every drill first asks the running daemon (`state_dir/requests/`) to arm it: the incident
//! its signal opens carries the drill's id in every record (incidents list/show, the metrics'
//! `drill` label, CloudWatch Logs, EventBridge, `--fleet`), and with `--observe` that
//! incident's orders are journaled and none is executed. Before
//! anything happens the drill prints what the policy will do. Refused (exit 4) unless the
//! config says `[drill] allow = true` or the instance carries the EC2 tag
//! `gpu-medic:drills=allowed` (read through IMDS); the daemon checks its own config and the
//! tag again, whatever the request's writer was allowed (src/supervisor/drill_gate.rs). The planned-event drills (`spot`,
//! `maintenance`) and `drill clear` are in src/cli/drill_notice.rs.

use std::path::Path;
use std::time::{Duration, Instant};

use clap::{Args, Subcommand};

use super::{CliError, ConfigArg, drill_notice, exit};
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
    /// An XID, as the kernel log reader reports the NVIDIA driver's line (injected through
    /// the daemon, marked as a drill).
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
    /// A Spot interruption notice, as IMDS `spot/instance-action` gives it two minutes ahead
    /// (injected through the daemon); it stays until `drill clear`.
    Spot {
        /// What AWS would do to the instance.
        #[arg(long, default_value = "terminate", value_parser = ["terminate", "stop", "hibernate"])]
        action: String,
        #[command(flatten)]
        common: Common,
    },
    /// An AWS scheduled event, as IMDS `events/maintenance/scheduled` lists it (injected
    /// through the daemon); it stays until `drill clear`.
    Maintenance {
        /// The event's code.
        #[arg(long, default_value = "system-maintenance", value_parser = [
            "system-maintenance", "system-reboot", "instance-reboot", "instance-retirement", "instance-stop",
        ])]
        code: String,
        /// How far ahead its NotBefore is (within `[planned] lead` the drain starts at once).
        #[arg(long = "in", value_parser = humantime::parse_duration, default_value = "5m")]
        not_before_in: Duration,
        #[command(flatten)]
        common: Common,
    },
    /// Ends a `spot` or `maintenance` drill: its notice is gone, as if IMDS no longer listed
    /// it, and what it started is undone (the instance returns to service).
    Clear {
        /// The drill's id (`drill-<ms>-<pid>`, as the drill printed it and `incidents list` shows).
        drill: String,
        #[command(flatten)]
        config: ConfigArg,
        /// Who clears it (default: $SUDO_USER, $USER).
        #[arg(long)]
        by: Option<String>,
        /// How long to follow the return to service.
        #[arg(long, value_parser = humantime::parse_duration, default_value = "2m")]
        wait: Duration,
    },
}

/// How a drill is played.
enum Play {
    /// A signal to the MPS control daemon.
    Mps { sig: libc::c_int },
    /// The observation travels in the request.
    Inject,
}

pub fn run(a: DrillArgs) -> Result<i32, CliError> {
    let class = &a.class;
    let common = match class {
        DrillClass::Clear {
            drill,
            config,
            by,
            wait,
        } => return drill_notice::clear(config, drill, by.clone(), *wait),
        DrillClass::Xid { common, .. }
        | DrillClass::MpsHang { common }
        | DrillClass::MpsCrash { common }
        | DrillClass::GpuLost { common, .. }
        | DrillClass::Ecc { common, .. }
        | DrillClass::Spot { common, .. }
        | DrillClass::Maintenance { common, .. } => common.clone(),
    };
    let cfg = common.config.load()?;
    let allowed_by = match drill_notice::allowed(&cfg) {
        Ok(how) => how,
        Err(why) => {
            eprintln!("{}", drill_notice::refusal(&common.config.config, &why));
            return Ok(exit::REFUSED);
        }
    };
    let policy = crate::config::load_policy(&cfg.policy)?;
    let me = std::process::id();
    let id = format!("drill-{}-{me}", crate::model::Timestamp::now().0);
    let by = common.by.clone().unwrap_or_else(whoami);

    let (label, signal, value, expect, play, inject) = plan(&cfg, class, &id)?;
    let notice = matches!(
        class,
        DrillClass::Spot { .. } | DrillClass::Maintenance { .. }
    );
    let e = if notice {
        drill_notice::explain(&policy, &signal, &id)
    } else {
        super::policy::explanation_for(&policy, &signal, value)
    };
    announce(&cfg, &policy, &common, &id, &label, &by, e);
    println!("  allowed: {allowed_by}");
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
    arm(&cfg, &request, "drill request", "nothing was played")?;
    // The daemon decides by its own config (or the instance tag it reads), whatever this
    // command's config says: nothing is played before it armed the drill.
    if let Err(why) = decided_by_daemon(&cfg, &id) {
        eprintln!("gpu-medic drill: refused by the daemon: {why}; nothing was played");
        return Ok(exit::REFUSED);
    }
    let stopped = play_it(&cfg, &common, play)?;
    let code = follow(&cfg, &id, common.wait, notice);
    if notice {
        println!(
            "  notice:  it stays until cleared: `gpu-medic drill clear {id}` (the instance then returns to service)"
        );
    }
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

fn plan(cfg: &Config, class: &DrillClass, id: &str) -> Result<Planned, CliError> {
    Ok(match class {
        DrillClass::Spot { .. } | DrillClass::Maintenance { .. } | DrillClass::Clear { .. } => {
            plan_notice(class, id)
        }
        DrillClass::Xid { code, gpu, .. } => plan_xid(cfg, *code, *gpu),
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

/// `spot` and `maintenance`: the notice travels in the request, as IMDS would show it.
fn plan_notice(class: &DrillClass, id: &str) -> Planned {
    let now = crate::model::Timestamp::now();
    let (label, obs, kind) = match class {
        DrillClass::Spot { action, .. } => (
            format!("spot interruption ({action})"),
            drill_notice::spot_observation(action, now),
            SignalKind::SpotInterruption,
        ),
        DrillClass::Maintenance {
            code,
            not_before_in,
            ..
        } => (
            format!("scheduled event {code}"),
            drill_notice::maintenance_observation(id, code, now.plus(*not_before_in)),
            SignalKind::MaintenanceEvent,
        ),
        _ => (
            String::new(),
            Observation::new(Signal::GpuLost),
            SignalKind::GpuLost,
        ),
    };
    let expect = DrillExpect {
        signals: vec![kind],
        code: None,
        gpu: None,
        pid: None,
    };
    let signal = obs.signal.clone();
    (label, signal, 0, expect, Play::Inject, Some(obs))
}

/// `xid N --gpu I`: an XID observation, as the kernel log reader would report the driver's
/// line, handed to the daemon in the request and marked as a drill (its source is `drill`, its
/// text says so). Nothing is written to the kernel log: only the driver's own records are
/// XIDs there, and a forged one would be refused like any other.
fn plan_xid(cfg: &Config, code: u32, gpu: u32) -> Planned {
    let g = gpu_id(cfg, gpu).unwrap_or_else(|_| GpuId::index_only(gpu));
    let text = xid_text(code);
    let (decode, why) = crate::probe::kmsg::decode_xid(
        code,
        Some(&text),
        Path::new(crate::probe::kmsg::UVM_REFCNT),
    );
    let mut detail = format!("drill: XID {code}, {text}, injected by gpu-medic drill");
    if let Some(why) = why {
        detail = format!("{detail}; {why}");
    }
    let signal = Signal::Xid { code, decode };
    let obs = Observation::new(signal.clone())
        .on_gpu(g)
        .with_detail(detail)
        .from_source("drill");
    let expect = DrillExpect {
        signals: vec![SignalKind::Xid],
        code: Some(code),
        gpu: Some(gpu),
        pid: None,
    };
    (
        format!("xid {code} on GPU {gpu}"),
        signal,
        0,
        expect,
        Play::Inject,
        Some(obs),
    )
}

/// Says what will happen before it does: the rule that judges the signal (`e`), and whether
/// its orders run.
fn announce(
    cfg: &Config,
    policy: &Policy,
    common: &Common,
    id: &str,
    label: &str,
    by: &str,
    mut e: super::policy::Explanation,
) {
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
    } else if !cfg.aws.enabled
        && [
            Verdict::StopTasks,
            Verdict::Drain,
            Verdict::Reboot,
            Verdict::Replace,
        ]
        .iter()
        .any(|v| v.as_str() == e.action)
    {
        println!(
            "  mode:    AWS remediation is disabled here ([aws] enabled = false): the decision is recorded, nothing is executed (would {what})"
        );
    } else {
        println!("  mode:    LIVE: gpu-medic will {what} for real");
    }
}

/// Hands the request to the running daemon and waits until it took it: whatever the drill
/// plays after this is judged after the drill is armed.
pub(super) fn arm(
    cfg: &Config,
    request: &OperatorRequest,
    what: &str,
    undone: &str,
) -> Result<(), CliError> {
    let path = crate::journal::submit_request(&cfg.state_dir, request)?;
    let taken_within = cfg.tick_interval.saturating_mul(4) + Duration::from_secs(10);
    let t0 = Instant::now();
    while path.exists() {
        if t0.elapsed() > taken_within {
            let _ = std::fs::remove_file(&path);
            return Err(CliError::Runtime(format!(
                "the daemon did not take the {what} within {} (is `gpu-medic run` running on this config?); {undone}",
                humantime::format_duration(taken_within)
            )));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let head = if what == "drill request" {
        "armed:  "
    } else {
        "taken:  "
    };
    println!("  {head} the daemon took the request");
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

/// Follows the drill's incident: prints its records as they come, until it closes (for a
/// planned notice: or its drain is done) or `wait` passes.
fn follow(cfg: &Config, id: &str, wait: Duration, notice: bool) -> Result<i32, CliError> {
    let t0 = Instant::now();
    let open_within = DRILL_ARM_WINDOW.min(wait);
    let mut incident = None;
    let mut printed = 0usize;
    let mut drains: Vec<crate::model::ActionId> = Vec::new();
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
        let mut drained = false;
        for r in mine.iter().skip(printed) {
            println!("    {}  {}", r.at, super::policy::event_line(&r.event));
            match &r.event {
                crate::model::IncidentEvent::ActionStarted { order, .. }
                    if matches!(order.command, crate::model::Command::Drain { .. }) =>
                {
                    drains.push(order.id)
                }
                crate::model::IncidentEvent::ActionFinished { outcome } => {
                    drained |= drains.contains(&outcome.action)
                        && outcome.status == crate::model::OutcomeStatus::Done;
                }
                _ => {}
            }
        }
        printed = printed.max(mine.len());
        if notice && drained {
            println!("  drained: the instance is out of service for the rehearsed notice");
            return Ok(exit::OK);
        }
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

/// How long the daemon may take to decide on a drill it took (it may read the instance tag).
const DECIDED_WITHIN: Duration = Duration::from_secs(30);

/// Waits for the daemon's decision on drill `id`, taken: `Err` with its reason when it refused
/// the drill (it allows drills by its own config, whatever this command's config says) or
/// did not decide in time.
fn decided_by_daemon(cfg: &Config, id: &str) -> Result<(), String> {
    let dir = crate::journal::requests_dir(&cfg.state_dir);
    let (Some(armed), Some(refused)) = (
        crate::supervisor::drill_gate::decision_name(id, true),
        crate::supervisor::drill_gate::decision_name(id, false),
    ) else {
        return Err(format!("{id} is no drill id"));
    };
    let (armed, refused) = (dir.join(armed), dir.join(refused));
    let t0 = Instant::now();
    while t0.elapsed() < DECIDED_WITHIN {
        if std::fs::remove_file(&armed).is_ok() {
            return Ok(());
        }
        if let Ok(why) = crate::sys::limits::read_text(&refused, 4096, "drill refusal") {
            let _ = std::fs::remove_file(&refused);
            return Err(why.trim().to_string());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(format!(
        "it took the request but did not arm the drill within {}",
        humantime::format_duration(DECIDED_WITHIN)
    ))
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

/// The text the driver prints after the code, from NVIDIA's catalog where it has one.
fn xid_text(code: u32) -> String {
    match crate::policy::xid_catalog::get(code) {
        Some(x) if !x.description.is_empty() => x.description.clone(),
        _ => "drill".into(),
    }
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

pub(super) fn whoami() -> String {
    std::env::var("SUDO_USER")
        .or_else(|_| std::env::var("USER"))
        .unwrap_or_else(|_| "operator".into())
}

#[cfg(test)]
mod tests {
    use super::*;

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
