//! `gpu-medic status`: the live state of the daemon on this node, from its `state.json`.

use serde::Serialize;

use super::{CliError, ConfigArg, exit, print_json};
use crate::config::{StateDir, View};
use crate::engine::State;
use crate::journal::load_state;
use crate::model::Timestamp;
use crate::model::gpu_view::Comparison;
use crate::model::links::{GpuLinks, Port};
use crate::model::mps_view::MpsTree;
use crate::remedy::budget::group_view::{FleetSummary, SlotsSummary};

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    config: ConfigArg,
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct StatusView<'a> {
    /// When the daemon last saved its state.
    updated_at: Option<Timestamp>,
    node_phase: &'a str,
    mps_phase: &'a str,
    #[serde(flatten)]
    state: &'a State,
    /// What the fleet budget's admission check saw last (absent before the first drain or
    /// replacement).
    fleet: Option<FleetSummary>,
    /// The slot table as this node last read or wrote it (`[fleet] table`; absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    slots: Option<SlotsSummary>,
    /// ECS's view of the GPUs against NVML's at the last read (`[ecs] gpu_view`).
    ecs_gpus: Option<Comparison>,
    /// Each GPU's fabric, NVLinks, PCIe link and clock event reasons at the last poll.
    #[serde(skip_serializing_if = "Option::is_none")]
    links: Option<Vec<GpuLinks>>,
    /// The EFA / RDMA ports at the last look.
    #[serde(skip_serializing_if = "Option::is_none")]
    ports: Option<Vec<Port>>,
    /// MPS's own view of its servers and clients against NVML's, at the MPS probe's last look
    /// (GPU -> server -> client -> task).
    #[serde(skip_serializing_if = "Option::is_none")]
    mps_view: Option<MpsTree>,
}

/// MPS's own view as a tree: GPU -> server -> client pid -> ECS task.
fn print_mps_view(files: &StateDir) {
    let Some((tree, age)) = files.load_view_aged::<MpsTree>(View::MpsView) else {
        return;
    };
    let default = tree
        .default_thread_percent
        .map(|p| format!("; default active thread percentage {p:.1}"))
        .unwrap_or_default();
    println!("mps view:    listed {} ({age} s ago){default}", tree.at);
    for line in tree.lines() {
        println!("             {line}");
    }
}

/// One line per GPU's links, one per RDMA port.
fn print_links(state_dir: &std::path::Path) {
    if let Some(gpus) = StateDir::new(state_dir).load_view::<Vec<GpuLinks>>(View::Links) {
        for g in gpus {
            let fabric = match &g.fabric_state {
                Some(s) => format!(
                    "fabric {s} (status {}, clique {})",
                    g.fabric_status, g.clique_id
                ),
                None => "no fabric".into(),
            };
            let down = if g.nvlinks_down.is_empty() {
                String::new()
            } else {
                format!(", down {:?}", g.nvlinks_down)
            };
            let [cg, cw, mg, mw] = g.pcie;
            println!(
                "links:       GPU {}: {fabric}; nvlinks {} up{down} (CRC {}/min, replay {}/min, recovery {}/min); PCIe Gen{cg} x{cw} of Gen{mg} x{mw} ({} replays/min); persistence {}; clock events {}",
                g.index,
                g.nvlinks.saturating_sub(g.nvlinks_down.len() as u32),
                g.nvlink_crc_per_min,
                g.nvlink_replay_per_min,
                g.nvlink_recovery_per_min,
                g.pcie_replays_per_min,
                match g.persistence {
                    Some(true) => "on",
                    Some(false) => "off",
                    None => "unknown",
                },
                if g.clock_event_reasons.is_empty() {
                    "none".to_string()
                } else {
                    g.clock_event_reasons.join(",")
                }
            );
        }
    }
    if let Some(ports) = StateDir::new(state_dir).load_view::<Vec<Port>>(View::Ports) {
        for p in ports {
            let errors: u64 = p.errors.values().fold(0u64, |a, v| a.saturating_add(*v));
            println!(
                "port:        {}/{}: {} ({errors} errors counted)",
                p.device, p.port, p.state
            );
        }
    }
}

pub fn run(a: StatusArgs) -> Result<i32, CliError> {
    let cfg = a.config.load()?;
    let path = cfg.state_path();
    let Some(state) = load_state(&path)? else {
        return Err(CliError::NotFound(format!(
            "{}: no state yet; is `gpu-medic run` running with this config?",
            path.display()
        )));
    };
    let updated_at = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| Timestamp(d.as_millis() as u64));
    if a.json {
        print_json(&StatusView {
            updated_at,
            node_phase: state.node.phase.as_str(),
            mps_phase: state.mps.phase.as_str(),
            state: &state,
            fleet: cfg.files().load_view::<FleetSummary>(View::Fleet),
            slots: cfg.files().load_view::<SlotsSummary>(View::Slots),
            ecs_gpus: cfg.files().load_view::<Comparison>(View::GpuView),
            links: cfg.files().load_view(View::Links),
            ports: cfg.files().load_view(View::Ports),
            mps_view: cfg.files().load_view(View::MpsView),
        });
        return Ok(exit::OK);
    }
    print_node(&state, updated_at);
    print_mps_view(&cfg.files());
    print_gpus(&state);
    print_gpu_view(&cfg);
    print_orders(&state);
    print_fleet(&cfg.files());
    Ok(exit::OK)
}

/// The node, gpu-medic's own faults, the MPS daemon and the remediation.
fn print_node(state: &State, updated_at: Option<Timestamp>) {
    println!("node:        {}", state.node.phase.as_str());
    if let Some(w) = &state.node.withheld {
        println!(
            "             would {}: {} (incident {}, since {})",
            w.verdict, w.why, w.incident, w.since
        );
    }
    if let Some(t) = updated_at {
        println!("updated:     {t}");
    }
    for (component, f) in &state.incidents.self_faults {
        println!(
            "self-fault:  {component} since {} (incident {}): {}; gpu-medic cannot tell what it does not see",
            f.since, f.incident, f.detail
        );
    }
    if let Some(f) = state
        .incidents
        .self_faults
        .get(crate::probe::mps::COMPONENT)
    {
        println!(
            "mps daemon:  unknown: the control client cannot be run (self-fault, incident {})",
            f.incident
        );
    } else if state.capabilities.mps {
        println!(
            "mps daemon:  {} ({} restarts in the budget window)",
            state.mps.phase.as_str(),
            state.mps.restarts.len()
        );
    } else {
        println!("mps daemon:  not managed by gpu-medic ([mps] enabled = false)");
    }
    match &state.node.remediation {
        Some(r) => println!(
            "remediation: incident {} heading to {:?}, at step {:?}",
            r.incident, r.goal, r.step
        ),
        None => println!("remediation: none"),
    }
    // AWS-planned disruptions with their plan, and the ECS agent's verdict beside ours.
    for line in crate::engine::planned::status_lines(state) {
        println!("{line}");
    }
}

/// Each GPU that raised a signal.
fn print_gpus(state: &State) {
    if let Some(f) = state
        .incidents
        .self_faults
        .get(crate::probe::nvml::COMPONENT)
    {
        println!(
            "gpus:        unknown: NVML cannot be used (self-fault, incident {})",
            f.incident
        );
    } else if state.gpus.health.is_empty() {
        println!("gpus:        no GPU has raised a signal");
    }
    for (i, g) in &state.gpus.health {
        println!(
            "gpu {i}:       {:?} since {} (rule `{}`{})",
            g.status,
            g.since,
            g.rule,
            g.incident
                .map(|x| format!(", incident {x}"))
                .unwrap_or_default()
        );
    }
}

/// ECS's view of the GPUs against NVML's at the last read, after each GPU's links.
fn print_gpu_view(cfg: &crate::config::Config) {
    print_links(&cfg.state_dir);
    if let Some(c) = cfg.files().load_view::<Comparison>(View::GpuView) {
        // What the policy takes at its value; the rest (a few MiB apart) is a routine reading.
        let policy = crate::config::load_policy(&cfg.policy).ok();
        let findings: Vec<&crate::model::Observation> = c
            .observations
            .iter()
            .filter(|o| {
                policy
                    .as_ref()
                    .is_none_or(|p| p.rule_for(&o.signal, o.value).is_some())
            })
            .collect();
        println!(
            "ecs gpu view: {}; read {}{}",
            super::check::counts_line(c.ecs_count, c.nvml_count, c.expected.as_ref()),
            c.observed_at,
            if findings.is_empty() {
                ": the views agree"
            } else {
                ""
            }
        );
        for g in &c.gpus {
            println!("              {}", super::check::gpu_line(g));
        }
        for o in findings {
            println!(
                "              disagrees: {}: {}",
                o.signal,
                o.detail.as_deref().unwrap_or_default()
            );
        }
    }
}

/// Orders in flight and scheduled, and the open incidents.
fn print_orders(state: &State) {
    for o in state.orders.in_flight.values() {
        println!(
            "in flight:   {} {} for incident {} (attempt {}, deadline {})",
            o.id,
            o.command.name(),
            o.incident,
            o.attempt,
            o.deadline
        );
    }
    for s in &state.orders.scheduled {
        println!(
            "scheduled:   {} for incident {} at {}",
            s.command.name(),
            s.incident,
            s.at
        );
    }
    println!("open incidents: {}", state.incidents.open.len());
}

/// The fleet budget and the slot table as this node last saw them.
fn print_fleet(files: &StateDir) {
    match files.load_view::<FleetSummary>(View::Fleet) {
        Some(f) => {
            println!(
                "fleet budget:  {} of {} slot(s) used in {} (desired {}), seen {}",
                f.in_remediation.len(),
                f.budget,
                f.group,
                f.desired,
                f.observed_at
            );
            for m in &f.in_remediation {
                println!("               {m}");
            }
            println!(
                "circuit breaker: {} unhealthy, limit {}{}",
                f.unhealthy,
                f.breaker_limit,
                f.kill_switch
                    .as_deref()
                    .map(|k| format!("; kill switch: {k}"))
                    .unwrap_or_default()
            );
        }
        None => println!(
            "fleet budget:  no fleet view recorded (the AWS control plane has not checked it on this node)"
        ),
    }
    if let Some(t) = files.load_view::<SlotsSummary>(View::Slots) {
        println!(
            "slot table:    {} group {}: {} holder(s), version {}, seen {}",
            t.table,
            t.group,
            t.holders.len(),
            t.version,
            t.observed_at
        );
        for (id, h) in &t.holders {
            println!(
                "               {id} {} token {} incident {} since {}",
                h.state.as_str(),
                h.token,
                h.incident.as_deref().unwrap_or("-"),
                h.since
            );
        }
    }
}
