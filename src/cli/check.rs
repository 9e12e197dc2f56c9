//! `gpu-medic check`: a one-shot health verdict from every enabled probe, judged by the
//! policy. Exit 0 healthy, 1 unhealthy, 2 could not tell. `--json` is for the launch gate.
//!
//! The verdict is [`engine::check`]'s (a finding fails the check when the policy would act
//! on it; debounce windows do not apply to a one-shot look): this file runs the probes and
//! formats what the judge said.

use serde::Serialize;

use super::{CliError, ConfigArg, exit, print_json, resolve_policy};
use crate::engine::{
    self,
    check::{Checked, Look},
};
use crate::model::Health;
use crate::policy::Policy;
use crate::probe;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    #[command(flatten)]
    config: ConfigArg,
    #[arg(long)]
    json: bool,
    /// Launch gate: heartbeat and complete our Auto Scaling launch hook with the verdict
    /// (CONTINUE, ABANDON, or CONTINUE quarantined by the launch-failure breaker). Exit 0
    /// continued healthy, 1 abandoned or quarantined, 2 the hook could not be completed.
    #[arg(long)]
    lifecycle: bool,
}

#[derive(Debug, Serialize)]
pub struct CheckReport {
    /// The verdict, the GPUs, the findings and each probe's result ([`engine::check`]).
    #[serde(flatten)]
    pub checked: Checked,
    /// ECS's view of the GPUs against NVML's (`[ecs] gpu_view`; absent when off or when this
    /// instance is not registered with ECS yet).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ecs_gpus: Option<EcsGpuCheck>,
    /// The launch gate's active test of the GPUs (`[diagnose] launch_level`), run once the
    /// passive checks found the node healthy; absent where no diagnosis tool can run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diagnosis: Option<crate::model::diagnosis::Diagnosis>,
}

#[derive(Debug, Serialize)]
pub struct EcsGpuCheck {
    pub ecs_count: u32,
    pub nvml_count: u32,
    /// The expected GPU count and where it came from (`[nvml] expected_gpus`, ECS, the
    /// instance type).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected: Option<crate::probe::nvml::view::Expected>,
    pub gpus: Vec<crate::probe::ecs_gpus::GpuLine>,
}

/// Runs every enabled snapshot probe and has [`engine::check`] judge what they saw.
pub fn examine(cfg: &crate::config::Config, policy: &Policy) -> CheckReport {
    let mut looks = Vec::new();
    // ECS's view first: it gives the expected GPU count before NVML is polled.
    let view = probe::gpu_view_enabled(cfg).then(|| read_gpu_view(cfg, &mut looks));
    let probe_view = view.as_ref().map(|(_, v, e)| (v.clone(), e.clone()));
    for p in probe::snapshot_probes(cfg, probe_view).iter_mut() {
        looks.push(match p.snapshot() {
            Ok(r) => Look {
                probe: p.name(),
                observations: r.observations,
                problems: r.problems,
                notes: r.notes,
                gpus: r.gpus,
                error: None,
            },
            Err(e) => Look::failed(p.name(), e.to_string()),
        });
    }
    let mut extra = Vec::new();
    let mut ecs_gpus = None;
    if let Some((Some(read), nvml_view, expected)) = &view
        && let Some(nvml) = nvml_view.latest()
    {
        // The hardware's count, as `run` holds ECS's list to it: the instance type's, or a
        // set `[nvml] expected_gpus` the type does not contradict; never ECS's.
        let hardware = expected.resolve(cfg.nvml.expected_gpus).expected;
        let (found, lines) = crate::probe::ecs_gpus::compare(read, &nvml, hardware.as_ref());
        extra.extend(found);
        ecs_gpus = Some(EcsGpuCheck {
            ecs_count: read.count(),
            nvml_count: nvml.count,
            expected: hardware,
            gpus: lines,
        });
    }
    CheckReport {
        checked: engine::check::check(looks, extra, policy),
        ecs_gpus,
        diagnosis: None,
    }
}

/// What `check` reads once of the GPUs: ECS's read (None: not read), NVML's view and the
/// expected count.
type GpuReadings = (
    Option<crate::probe::ecs_gpus::EcsRead>,
    crate::probe::nvml::view::NvmlView,
    crate::probe::nvml::view::ExpectedGpus,
);

/// Reads ECS's view of the GPUs once; a failure is a look that could not be made.
fn read_gpu_view(cfg: &crate::config::Config, looks: &mut Vec<Look>) -> GpuReadings {
    use crate::probe::ecs_gpus::{self, ReadError};
    use crate::probe::nvml::view::{ExpectedGpus, NvmlView};
    let read = match ecs_gpus::read_once(cfg) {
        Ok(r) => r,
        Err(e) => {
            let message = match e {
                ReadError::Failed { message, .. } | ReadError::NotRegistered(message) => message,
            };
            looks.push(Look::failed(
                ecs_gpus::SOURCE,
                format!("cannot read ECS's view of the GPUs: {message} (not a GPU signal)"),
            ));
            None
        }
    };
    // Learnt also when `[nvml] expected_gpus` is set: the instance type checks it.
    let expected = ExpectedGpus::new();
    ecs_gpus::learn_expected_once(cfg, read.as_ref(), &expected);
    (read, NvmlView::new(), expected)
}

pub fn run(a: CheckArgs) -> Result<i32, CliError> {
    let (cfg, text) = crate::config::Config::load_with_text(&a.config.config)?;
    let mistake = crate::launch::preflight::check(
        &cfg,
        &a.config.config,
        &text,
        crate::launch::preflight::Mode::Check,
    );
    for w in crate::launch::preflight::warnings(&cfg, std::path::Path::new("systemctl")) {
        eprintln!("warning: {w}");
    }
    // A taken metrics port is a warning, not a verdict: `run` goes on without the endpoint.
    if let Some(w) = crate::metrics::server::port_taken(&cfg.metrics) {
        eprintln!("warning: {w}");
    }
    let policy = resolve_policy(Some(&cfg.policy), None)?;
    if a.lifecycle {
        // The gate must still answer the launch hook: a mistake on this machine is "could not
        // tell" (on_unknown applies: in service, no placement under `== ok`), never a verdict
        // on the GPUs, and never an ABANDON that would loop through the fleet.
        return launch_gate(cfg, policy, a.json, mistake.err());
    }
    mistake?;
    let report = examine(&cfg, &policy);
    let code = match report.checked.verdict {
        Health::Healthy => exit::OK,
        Health::Unhealthy => exit::UNHEALTHY,
        Health::Unknown => exit::UNKNOWN,
    };
    if a.json {
        print_json(&report);
    } else {
        print_report(&report, &a.config.config);
    }
    Ok(code)
}

/// `check`'s human-readable report.
fn print_report(report: &CheckReport, config: &std::path::Path) {
    let c = &report.checked;
    println!("verdict: {}", c.verdict);
    if !c.gpus.is_empty() {
        println!("{:>3}  {:<42}  {:<16}  HEALTH", "GPU", "UUID", "PCI");
        for g in &c.gpus {
            println!(
                "{:>3}  {:<42}  {:<16}  {}",
                g.gpu.index, g.gpu.uuid, g.gpu.pci_bus_id, g.health
            );
        }
    }
    for f in &c.findings {
        let gpu = f.gpu.map(|g| format!("GPU {g}: ")).unwrap_or_default();
        let detail = f
            .detail
            .as_deref()
            .map(|d| format!(" ({d})"))
            .unwrap_or_default();
        println!(
            "  {gpu}{}{detail} -> {} (rule `{}`)",
            f.signal, f.action, f.rule
        );
    }
    if let Some(e) = &report.ecs_gpus {
        println!(
            "ecs gpu view: {}",
            counts_line(e.ecs_count, e.nvml_count, e.expected.as_ref())
        );
        for g in &e.gpus {
            println!("  {}", gpu_line(g));
        }
    }
    if c.probes.is_empty() {
        println!(
            "  no probe is enabled in {}: nothing was checked",
            config.display()
        );
    }
    for p in &c.probes {
        match &p.error {
            Some(e) => println!("  probe {}: could not look: {e}", p.probe),
            None if p.problems.is_empty() => println!("  probe {}: ok", p.probe),
            None => {
                for problem in &p.problems {
                    println!("  probe {}: {problem}", p.probe);
                }
            }
        }
        for note in &p.notes {
            println!("  probe {}: note: {note}", p.probe);
        }
    }
}

/// "ECS lists 4, NVML counts 3; expected 4 (instance type g5.12xlarge)", as `check` and `status`
/// print it.
pub fn counts_line(
    ecs: u32,
    nvml: u32,
    expected: Option<&crate::probe::nvml::view::Expected>,
) -> String {
    let expected = expected
        .map(|x| format!("; expected {} ({})", x.count, x.source))
        .unwrap_or_default();
    format!("ECS lists {ecs}, NVML counts {nvml}{expected}")
}

/// One GPU of ECS's view against NVML's, as `check` and `status` print it.
pub fn gpu_line(g: &crate::probe::ecs_gpus::GpuLine) -> String {
    let mut s = format!(
        "{}: NVML {}{}",
        g.id,
        g.nvml,
        g.index.map(|i| format!(" (GPU {i})")).unwrap_or_default()
    );
    if let Some(m) = &g.sharing_mode {
        s.push_str(&format!("; ECS {m}"));
    }
    if let Some(c) = g.containers {
        s.push_str(&format!(", {c} container(s)"));
    }
    if let Some(r) = g.ecs_remaining_mib {
        s.push_str(&format!(", {r} MiB free to ECS"));
    }
    if let Some(f) = g.nvml_free_mib {
        s.push_str(&format!(", {f} MiB free to NVML"));
    }
    s
}

/// Hands the gate's verdict to the daemon for the incident journal (through
/// `state_dir/requests/`: only the daemon numbers incidents). A daemon that is not running yet
/// journals it when it starts.
fn journal_gate(
    cfg: &crate::config::Config,
    report: &crate::launch::gate::LaunchReport<CheckReport>,
) {
    let health = format!("{:?}", report.health).to_lowercase();
    let mut summary = format!(
        "launch gate: {health}; decision {:?}; hook {} {}",
        report.decision,
        report.hook,
        report.result.unwrap_or("not completed")
    );
    if let Some(a) = &report.attribute {
        summary.push_str(&format!("; {a}"));
    }
    if report.breaker.as_ref().is_some_and(|b| b.tripped) {
        summary.push_str("; LAUNCH-FAILURE BREAKER TRIPPED");
    }
    let findings = report
        .check
        .as_ref()
        .map(|c| {
            c.checked
                .findings
                .iter()
                .map(|f| {
                    let gpu = f.gpu.map(|g| format!("GPU {g}: ")).unwrap_or_default();
                    format!("{gpu}{} -> {} (rule `{}`)", f.signal, f.action, f.rule)
                })
                .collect()
        })
        .unwrap_or_default();
    let request = crate::model::OperatorRequest::LaunchGate {
        health,
        summary,
        findings,
        request_ids: report.request_ids.clone(),
    };
    if let Err(e) = crate::journal::submit_request(&cfg.state_dir, &request) {
        tracing::warn!("cannot hand the launch gate's verdict to the journal: {e}");
    }
}

/// `check --lifecycle`: the launch gate (crates/io/src/launch/gate.rs) around `examine`.
fn launch_gate(
    cfg: crate::config::Config,
    policy: Policy,
    json: bool,
    mistake: Option<crate::sys::error::FileError>,
) -> Result<i32, CliError> {
    use crate::launch::gate;
    if !cfg.aws.enabled {
        return Err(CliError::Usage(
            "check --lifecycle completes an Auto Scaling lifecycle hook: it needs [aws] enabled = true"
                .into(),
        ));
    }
    super::run::init_logging("auto");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| CliError::Runtime(format!("cannot start the runtime: {e}")))?;
    let check_cfg = cfg.clone();
    // The gate's own clock: every diagnosis it runs ends before `check_deadline`, so a tool
    // that hangs (dcgmi with no host engine answering) never holds the hook past it.
    let gate_deadline = std::time::Instant::now() + cfg.lifecycle.check_deadline;
    if let Some(e) = &mistake {
        tracing::error!("configuration error: {e}; the launch gate cannot tell");
    }
    let report = rt.block_on(gate::gate(&cfg, move || {
        let r = match &mistake {
            Some(e) => CheckReport {
                checked: engine::check::check(
                    vec![Look::failed("config", e.to_string())],
                    vec![],
                    &policy,
                ),
                ecs_gpus: None,
                diagnosis: None,
            },
            None => examine(&check_cfg, &policy),
        };
        let mut r = r;
        let verdict = launch_diagnosis(&check_cfg, &mut r, gate_deadline);
        (verdict, r)
    }));
    let saved = cfg.files().launch_gate();
    if let Err(e) = std::fs::create_dir_all(&cfg.state_dir).and_then(|_| {
        std::fs::write(
            &saved,
            serde_json::to_vec_pretty(&report).unwrap_or_default(),
        )
    }) {
        tracing::warn!(path = %saved.display(), "cannot keep the launch gate report: {e}");
    }
    journal_gate(&cfg, &report);
    if json {
        print_json(&report);
    } else {
        print_gate(&report);
    }
    Ok(report.exit_code)
}

/// The launch gate tests the GPUs of a node the passive checks found healthy, at `[diagnose]
/// launch_level`, where a diagnosis tool can run: a failure makes the node unhealthy, "could
/// not tell" makes the gate look again (under the hook's heartbeats) until its deadline. Each
/// tier's deadline is cut to what is left of the gate's (`deadline`), so no diagnosis runs
/// past it. The MPS daemon is left alone here (the supervisor watches it at the same time):
/// while it is up, DCGM does not run.
fn launch_diagnosis(
    cfg: &crate::config::Config,
    r: &mut CheckReport,
    deadline: std::time::Instant,
) -> Health {
    let verdict = r.checked.verdict;
    let d = &cfg.diagnose;
    let (tiers, _) = crate::diagnose::usable(d.dcgmi().as_deref(), d.cuda_library().as_deref());
    if verdict != Health::Healthy || tiers.is_empty() {
        return verdict;
    }
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    // The tiers run one after the other: each gets its share of what is left (less a margin
    // for the answer to the hook), less the grace a killed tree gets where there is room.
    let tier_count = u32::try_from(tiers.len()).unwrap_or(1).max(1);
    let margin = (left / 10).min(std::time::Duration::from_secs(1));
    let share = (left.saturating_sub(margin) / tier_count).min(d.timeout);
    let grace = crate::diagnose::dcgm::TERM_GRACE;
    let share = if share > grace * 2 {
        share - grace
    } else {
        share
    };
    if share < std::time::Duration::from_millis(100) {
        let why = format!(
            "could not tell: no time left for a diagnosis within [lifecycle] check_deadline ({} left)",
            humantime::format_duration(std::time::Duration::from_millis(left.as_millis() as u64))
        );
        tracing::warn!("launch gate: {why}");
        r.diagnosis = Some(crate::model::diagnosis::Diagnosis {
            level: d.launch_level,
            result: crate::model::diagnosis::DiagResult::Unknown,
            gpus: Vec::new(),
            tiers: Vec::new(),
            summary: why,
            cause: Some(crate::model::diagnosis::Cause::Timeout),
            duration_ms: 0,
        });
        return Health::Unknown;
    }
    let mut cfg = cfg.clone();
    cfg.diagnose.timeout = cfg.diagnose.timeout.min(share);
    let cfg = &cfg;
    let d = &cfg.diagnose;
    let diagnosis = match super::diagnose::diagnose_node(cfg, d.launch_level, &[], false) {
        Ok(x) => x.without_raw(),
        Err(why) => {
            tracing::warn!("launch gate: the diagnosis could not be asked: {why}");
            return Health::Unknown;
        }
    };
    tracing::info!(
        "launch gate: diagnosis ({}): {}",
        diagnosis.level.as_str(),
        diagnosis.summary
    );
    let health = match diagnosis.result {
        // Configuration findings are reported, never a reason to abandon a launch.
        crate::model::diagnosis::DiagResult::Pass | crate::model::diagnosis::DiagResult::Config => {
            Health::Healthy
        }
        crate::model::diagnosis::DiagResult::Fail => Health::Unhealthy,
        crate::model::diagnosis::DiagResult::Unknown => Health::Unknown,
    };
    r.diagnosis = Some(diagnosis);
    health
}

/// `check --lifecycle`'s human-readable report.
fn print_gate(report: &crate::launch::gate::LaunchReport<CheckReport>) {
    let result = report.result.unwrap_or("(no lifecycle action completed)");
    println!(
        "launch gate: {:?} -> {:?}, hook {} {result}",
        report.health, report.decision, report.hook
    );
    if let Some(a) = &report.attribute {
        println!("  attribute: {a}");
    }
    if let Some(b) = &report.breaker {
        println!(
            "  launch-failure breaker: {} abandoned within {} (limit {}){}",
            b.recent,
            b.window,
            b.limit,
            if b.tripped { ": TRIPPED" } else { "" }
        );
    }
    println!(
        "  {} check attempt(s), {} heartbeat(s)",
        report.attempts, report.heartbeats
    );
    for n in &report.notes {
        println!("  {n}");
    }
    if let Some(c) = &report.check {
        for f in &c.checked.findings {
            let gpu = f.gpu.map(|g| format!("GPU {g}: ")).unwrap_or_default();
            println!(
                "  finding: {gpu}{} -> {} (rule `{}`)",
                f.signal, f.action, f.rule
            );
        }
        for p in c.checked.probes.iter().filter(|p| !p.ok) {
            println!(
                "  probe {}: {}",
                p.probe,
                p.error.clone().unwrap_or_else(|| p.problems.join("; "))
            );
        }
        if let Some(d) = &c.diagnosis {
            println!("  {}", super::diagnose::headline(d));
        }
    }
}
