//! `gpu-medic policy check|explain|simulate`: make a policy reviewable like code.

use std::path::PathBuf;

use clap::Subcommand;
use serde::Serialize;

use super::{CliError, exit, print_json, resolve_policy};
use crate::engine::{self, State};
use crate::model::{
    Action, IncidentEvent, RecoveryAction, Signal, SignalKind, StampedInput, XidDecode,
};
use crate::policy::{Policy, Rule};

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Parse and validate a policy file (following `extends`); print a summary.
    Check {
        file: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Say which rule judges a signal, what it decides and why.
    Explain {
        /// An XID code.
        #[arg(long, conflicts_with = "signal")]
        xid: Option<u32>,
        /// With --xid: the decode class of an NVLink5 XID (144-150) or XID 159: reset-gpu,
        /// ignore, xid-154-eval, undecoded (docs/xid-catalog.md). Default: undecoded.
        #[arg(long, requires = "xid")]
        decode: Option<String>,
        /// A signal kind (e.g. mps-down, gpu-lost, recovery-action).
        #[arg(long)]
        signal: Option<String>,
        /// For recovery-action: the driver's verdict (none, gpu-reset, node-reboot, drain-p2p, drain-and-reset).
        #[arg(long)]
        recovery: Option<String>,
        /// The signal's value, for threshold rules.
        #[arg(long, default_value_t = u64::MAX)]
        value: u64,
        /// Policy file (default: the config's policy, else the built-in default).
        #[arg(long)]
        policy: Option<PathBuf>,
        #[arg(long, value_name = "PATH", env = "GPU_MEDIC_CONFIG")]
        config: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// Replay recorded inputs (the daemon's inputs.jsonl) through the engine; print the decisions.
    Simulate {
        inputs: PathBuf,
        #[arg(long)]
        policy: Option<PathBuf>,
        #[arg(long, value_name = "PATH", env = "GPU_MEDIC_CONFIG")]
        config: Option<PathBuf>,
        /// Replay as observe-only (what a dry-run daemon recorded).
        #[arg(long)]
        observe_only: bool,
        /// One JSON action per line: journal records and orders, as the engine emitted them.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: PolicyCommand) -> Result<i32, CliError> {
    match cmd {
        PolicyCommand::Check { file, json } => check(file, json),
        PolicyCommand::Explain {
            xid,
            decode,
            signal,
            recovery,
            value,
            policy,
            config,
            json,
        } => {
            let p = resolve_policy(policy.as_deref(), config.as_deref())?;
            let decode = decode
                .map(|d| {
                    XidDecode::parse(&d).ok_or_else(|| {
                        CliError::Usage(format!(
                            "unknown decode `{d}` (reset-gpu, ignore, xid-154-eval, undecoded)"
                        ))
                    })
                })
                .transpose()?;
            let sig = match (xid, signal.as_deref()) {
                (Some(code), _) => Signal::Xid { code, decode },
                (None, Some(s)) => parse_signal(s, recovery.as_deref())?,
                (None, None) => {
                    return Err(CliError::Usage("give --xid N or --signal KIND".into()));
                }
            };
            explain(&p, sig, value, json)
        }
        PolicyCommand::Simulate {
            inputs,
            policy,
            config,
            observe_only,
            json,
        } => {
            let mut p = resolve_policy(policy.as_deref(), config.as_deref())?;
            p.observe_only |= observe_only;
            simulate(&p, inputs, json)
        }
    }
}

#[derive(Serialize)]
struct CheckSummary<'a> {
    file: String,
    ok: bool,
    observe_only: bool,
    rules: usize,
    xids_named: usize,
    uncovered_signals: Vec<&'a str>,
    /// Catalog XIDs (docs/xid-catalog.csv) that only the catch-all judges, or nothing.
    catalog_xids_left_to_catch_all: Vec<u32>,
    /// Fatal signals judged `ignore`/`log` (with `silences_fatal = true`) or by no rule.
    silenced_fatal: Vec<SilencedFatal>,
    /// Rules per action (`reboot`: the rules on the reboot rung).
    actions: std::collections::BTreeMap<&'static str, usize>,
    /// The reboot rung's ladder (`[reboot]`).
    reboot_ladder: String,
    /// Where the GPUs are tested before a node is trusted again (`[diagnose]`).
    diagnosis: String,
}

#[derive(Serialize)]
struct SilencedFatal {
    signal: String,
    /// The rule that silences it; absent when no rule judges it at all.
    #[serde(skip_serializing_if = "Option::is_none")]
    rule: Option<String>,
    action: String,
}

fn check(file: PathBuf, json: bool) -> Result<i32, CliError> {
    let p = crate::config::load_policy(&file)?;
    let uncovered: Vec<&str> = p.uncovered_signals().iter().map(|k| k.as_str()).collect();
    let xids: usize = p
        .rules
        .iter()
        .filter_map(|r| r.xids.as_ref())
        .map(|x| x.len())
        .sum();
    let left = p.catalog_xids_left_to_catch_all();
    let silenced: Vec<SilencedFatal> = p
        .silenced_fatal_signals()
        .into_iter()
        .map(|(sig, r)| SilencedFatal {
            signal: sig.to_string(),
            rule: r.map(|r| r.name.clone()),
            action: r.map_or("log", |r| r.action.as_str()).to_string(),
        })
        .collect();
    let mut actions = std::collections::BTreeMap::new();
    for r in &p.rules {
        *actions.entry(r.action.as_str()).or_insert(0) += 1;
    }
    let s = CheckSummary {
        actions,
        reboot_ladder: ladder(&p),
        diagnosis: diagnosis(&p),
        file: file.display().to_string(),
        ok: true,
        observe_only: p.observe_only,
        rules: p.rules.len(),
        xids_named: xids,
        uncovered_signals: uncovered.clone(),
        catalog_xids_left_to_catch_all: left.clone(),
        silenced_fatal: silenced,
    };
    if json {
        print_json(&s);
    } else {
        println!(
            "{}: ok: {} rules, {} XIDs named{}",
            s.file,
            s.rules,
            s.xids_named,
            if p.observe_only { ", observe-only" } else { "" }
        );
        let counts: Vec<String> = s.actions.iter().map(|(a, n)| format!("{n} {a}")).collect();
        println!("  actions: {}", counts.join(", "));
        if s.actions.contains_key("reboot") {
            println!("  reboot ladder: {}", s.reboot_ladder);
        }
        println!("  diagnosis: {}", s.diagnosis);
        if !uncovered.is_empty() {
            println!(
                "warning: no rule judges {}; such signals are only logged",
                uncovered.join(", ")
            );
        }
        if !left.is_empty() {
            let list: Vec<String> = left.iter().map(|x| x.to_string()).collect();
            println!(
                "warning: {} XIDs of NVIDIA's catalog fall to the catch-all (or to no rule): {}",
                left.len(),
                list.join(", ")
            );
        }
        for f in &s.silenced_fatal {
            match &f.rule {
                Some(r) => println!(
                    "warning: fatal signal `{}` is silenced ({}) by rule `{r}` (silences_fatal = true)",
                    f.signal, f.action
                ),
                None => println!(
                    "warning: fatal signal `{}` is judged by no rule; it is only logged",
                    f.signal
                ),
            }
        }
    }
    Ok(exit::OK)
}

/// Which rule judges a signal, its action and why (`policy explain`, `drill`).
#[derive(Serialize)]
pub struct Explanation {
    pub signal: String,
    pub action: String,
    pub rule: String,
    pub reason: String,
    pub source: String,
    pub origin: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threshold: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub confirm: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub escalate: Option<String>,
    /// For `reboot`: when the ladder sends it on to `replace` instead.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ladder: Option<String>,
    /// For `drain` and `reboot`: the diagnosis before the node is trusted again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub diagnosis: Option<String>,
    /// For application-class XIDs judged by who faulted and where (`suspect`, `culprit`):
    /// NVIDIA's workflow as gpu-medic applies it on a shared GPU (docs/attribution.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workflow: Option<String>,
}

/// How a rule with `suspect` or `culprit` judges an application fault, in words.
fn workflow(r: &Rule) -> Option<String> {
    if r.suspect.is_none() && r.culprit.is_none() {
        return None;
    }
    let mut w = vec![
        "each fault is charged to its program: the process the driver names (pid=, name=), its \
         ECS task and task definition through its cgroup and the ECS agent; when the driver names \
         the MPS server, the GPU's client task at that moment (several: any of them)"
            .to_string(),
        format!(
            "one program faulting again and again, on one GPU or many, is its own bug: `{}`, one \
             incident per program naming its task definition (EventBridge \"GPU Medic Application \
             Fault\"); the node and every other tenant stay in service",
            r.action
        ),
    ];
    if let Some(s) = r.suspect {
        let place = match s.at {
            crate::policy::attribution::Place::Location => {
                "the same place of one GPU (XID 13: GPC and TPC; NVIDIA's WORKFLOW_XID_13, \
                 \"repeats at the same GPC/TPC\")"
            }
            crate::policy::attribution::Place::Gpu => {
                "the same GPU (NVIDIA's WORKFLOW_XID_31, \"repeated MMU faults on the same GPU\")"
            }
        };
        w.push(format!(
            "{} different programs faulting at {place} within {} are the GPU's: {} (suspect)",
            s.programs,
            humantime::format_duration(s.window),
            s.action
        ));
    }
    if let Some(c) = r.culprit {
        w.push(format!(
            "one program's {}th fault within {} stops its task on this node (culprit): {}",
            c.count,
            humantime::format_duration(c.window),
            c.action
        ));
    }
    Some(w.join("; "))
}

/// Where the policy tests the GPUs before it trusts a node again, in words.
fn diagnosis(p: &Policy) -> String {
    let d = p.diagnose;
    let mut when = Vec::new();
    if d.after_drain {
        when.push(format!(
            "after the drain of a drain verdict (pass: back in service; fail: {}{})",
            d.on_fail,
            if d.on_fail == crate::model::Verdict::Reboot {
                ", the ladder applies"
            } else {
                ""
            }
        ));
    }
    if d.after_reboot {
        when.push("after a reboot's boot check (pass: back in service; fail: replace)".into());
    }
    if when.is_empty() {
        return "never: a drained node is kept for an operator, a rebooted one returns on the passive checks".into();
    }
    format!(
        "gpu-medic diagnose (DCGM's diagnostics, the built-in CUDA check; config [diagnose]) {}; could not tell: tried again every {} for {} (retry_delay, retry_within), then after a drain {} (on_unknown), after a reboot {} (boot_on_unknown); needs configuration: back in service, reported; deadline {}; a node with no tool that can run skips it",
        when.join(" and "),
        humantime::format_duration(d.retry_delay),
        humantime::format_duration(d.retry_within),
        d.on_unknown.as_str(),
        d.boot_on_unknown.as_str(),
        humantime::format_duration(p.deadlines.diagnose)
    )
}

/// The reboot rung's ladder in words.
fn ladder(p: &Policy) -> String {
    let l = p.reboot;
    format!(
        "replace instead once the instance had {} reboot(s) within {}, or a fault comes within {} of a reboot's return to service, or the node has no reboot rung ([repair] reboot = \"off\", [aws] disabled)",
        l.limit,
        humantime::format_duration(l.window),
        humantime::format_duration(l.recur_within)
    )
}

fn explain(p: &Policy, sig: Signal, value: u64, json: bool) -> Result<i32, CliError> {
    print_explanation(&explanation_for(p, &sig, value), json);
    Ok(exit::OK)
}

/// The rule that judges `sig` at `value` and why, or the engine's "recorded only".
pub fn explanation_for(p: &Policy, sig: &Signal, value: u64) -> Explanation {
    let mut e = match p.rule_for(sig, value) {
        Some(r) => explanation(sig, r),
        None => Explanation {
            signal: sig.to_string(),
            action: "log".into(),
            rule: engine::RULE_NONE.into(),
            reason: format!("no rule judges `{sig}`; gpu-medic records it only"),
            source: String::new(),
            origin: p.origin.clone(),
            threshold: None,
            confirm: None,
            escalate: None,
            ladder: None,
            diagnosis: None,
            workflow: None,
        },
    };
    if e.action == "reboot" {
        let own = p
            .rule_named(&e.rule)
            .and_then(|r| r.reboots)
            .map(|k| {
                format!(
                    "this rule reboots at most {k} time(s) within {}; ",
                    humantime::format_duration(p.reboot.window)
                )
            })
            .unwrap_or_default();
        e.ladder = Some(format!("{own}{}", ladder(p)));
    }
    let escalates_to_drain = e
        .escalate
        .as_deref()
        .is_some_and(|x| x.contains("drain") || x.contains("reboot"))
        || p.rule_named(&e.rule)
            .and_then(|r| r.suspect)
            .is_some_and(|s| s.action.is_node_remediation());
    if matches!(e.action.as_str(), "drain" | "reboot") || escalates_to_drain {
        e.diagnosis = Some(diagnosis(p));
    }
    e
}

fn print_explanation(e: &Explanation, json: bool) {
    if json {
        print_json(e);
    } else {
        println!(
            "{} -> {}  (rule `{}`, {})",
            e.signal, e.action, e.rule, e.origin
        );
        println!("  why:      {}", e.reason);
        if !e.source.is_empty() {
            println!("  source:   {}", e.source);
        }
        if let Some(t) = e.threshold {
            println!("  when:     value >= {t}");
        }
        if let Some(c) = &e.confirm {
            println!("  confirm:  {c}");
        }
        if let Some(x) = &e.escalate {
            println!("  escalate: {x}");
        }
        if let Some(l) = &e.ladder {
            println!("  ladder:   {l}");
        }
        if let Some(w) = &e.workflow {
            println!("  workflow: {w}");
        }
        if let Some(d) = &e.diagnosis {
            println!("  diagnose: {d}");
        }
    }
}

fn explanation(sig: &Signal, r: &Rule) -> Explanation {
    Explanation {
        signal: sig.to_string(),
        action: r.action.as_str().into(),
        rule: r.name.clone(),
        reason: r.reason.clone(),
        source: r.source.clone(),
        origin: r.origin.clone(),
        threshold: r.threshold,
        confirm: r.confirm.map(|c| {
            format!(
                "act only when seen {} times within {}",
                c.count,
                humantime::format_duration(c.window)
            )
        }),
        escalate: r.escalate.map(|e| {
            format!(
                "{} times on one GPU within {} -> {}",
                e.count,
                humantime::format_duration(e.window),
                e.action
            )
        }),
        ladder: None,
        diagnosis: None,
        workflow: workflow(r),
    }
}

fn parse_signal(s: &str, recovery: Option<&str>) -> Result<Signal, CliError> {
    let kind: SignalKind = serde_json::from_value(serde_json::Value::String(s.to_string()))
        .map_err(|_| CliError::Usage(format!("unknown signal `{s}`")))?;
    let plain = |k: SignalKind| -> Option<Signal> {
        let v = serde_json::json!({ "kind": k.as_str() });
        serde_json::from_value(v).ok()
    };
    match kind {
        SignalKind::Xid => Err(CliError::Usage("use --xid N for XIDs".into())),
        SignalKind::RecoveryAction => {
            let r = recovery.ok_or_else(|| {
                CliError::Usage("--signal recovery-action needs --recovery VALUE".into())
            })?;
            let action: RecoveryAction =
                serde_json::from_value(serde_json::Value::String(r.to_string()))
                    .map_err(|_| CliError::Usage(format!("unknown recovery action `{r}`")))?;
            Ok(Signal::RecoveryAction { action })
        }
        SignalKind::Lifecycle | SignalKind::MpsUp => Err(CliError::Usage(format!(
            "`{s}` is handled by gpu-medic itself, not by policy rules"
        ))),
        k => plain(k).ok_or_else(|| CliError::Usage(format!("unknown signal `{s}`"))),
    }
}

fn simulate(p: &Policy, inputs: PathBuf, json: bool) -> Result<i32, CliError> {
    if !inputs.exists() {
        return Err(CliError::NotFound(format!(
            "{}: no such inputs file",
            inputs.display()
        )));
    }
    // Streamed: memory is one line, whatever the file's size; the file is capped.
    let mut state = State::default();
    crate::journal::stream_jsonl::<StampedInput>(
        std::slice::from_ref(&inputs),
        Some(crate::sys::limits::MAX_SIMULATE_BYTES),
        |e| {
            match e {
                crate::journal::Entry::Item(s) => {
                    let (next, actions) = engine::step(&state, s.input, s.at, p);
                    state = next;
                    for a in actions {
                        if json {
                            print_json(&a);
                        } else {
                            println!("{}", describe(&a));
                        }
                    }
                }
                crate::journal::Entry::Skipped { line, .. } => {
                    eprintln!("warning: {}: {line}", inputs.display())
                }
            }
            true
        },
    )?;
    Ok(exit::OK)
}

/// One readable line for an engine action.
pub fn describe(a: &Action) -> String {
    match a {
        Action::Execute(o) => format!(
            "execute {} ({}, incident {}, attempt {}, deadline {})",
            o.command.name(),
            o.id,
            o.incident,
            o.attempt,
            o.deadline
        ),
        Action::Log(r) => format!(
            "{}  incident {}  {}",
            r.at,
            r.incident,
            event_line(&r.event)
        ),
    }
}

/// One readable line for a journal event.
pub fn event_line(e: &IncidentEvent) -> String {
    match e {
        IncidentEvent::Opened {
            observation,
            rule,
            verdict,
            ..
        } => {
            let on = observation
                .gpu
                .as_ref()
                .map(|g| format!(" on {g}"))
                .unwrap_or_default();
            let seen = observation
                .detail
                .as_deref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default();
            format!(
                "opened: {}{on}{seen} -> {verdict} (rule `{rule}`)",
                observation.signal
            )
        }
        IncidentEvent::Signal { observation } => {
            let on = observation
                .gpu
                .as_ref()
                .map(|g| format!(" on GPU {}", g.index))
                .unwrap_or_default();
            let seen = observation
                .detail
                .as_deref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default();
            format!("signal: {}{on}{seen}", observation.signal)
        }
        IncidentEvent::Escalated {
            verdict,
            rule,
            reason,
        } => format!("escalated -> {verdict} (rule `{rule}`): {reason}"),
        IncidentEvent::ActionStarted { order, dry_run } => format!(
            "{} {} ({}, attempt {})",
            if *dry_run { "would start" } else { "started" },
            order.command.name(),
            order.id,
            order.attempt
        ),
        IncidentEvent::ActionFinished { outcome } => {
            let ids = if outcome.request_ids.is_empty() {
                String::new()
            } else {
                format!(" [requests {}]", outcome.request_ids.join(", "))
            };
            let status = match &outcome.status {
                crate::model::OutcomeStatus::Done => "done".to_string(),
                crate::model::OutcomeStatus::Failed { retryable: true } => {
                    "failed (retryable)".into()
                }
                crate::model::OutcomeStatus::Failed { retryable: false } => "failed".into(),
                crate::model::OutcomeStatus::Deferred { retry_after } => {
                    format!("deferred {}", humantime::format_duration(*retry_after))
                }
            };
            let detail = if outcome.detail.is_empty() {
                String::new()
            } else {
                format!(": {}", outcome.detail)
            };
            format!("{} {status}{detail}{ids}", outcome.action)
        }
        IncidentEvent::DeadlineMissed { action, escalation } => {
            format!("deadline missed by {action}: {escalation}")
        }
        IncidentEvent::Note { text } => format!("note: {text}"),
        IncidentEvent::Closed { state, summary } => format!("closed {}: {summary}", state.as_str()),
    }
}
