//! `gpu-medic check`: a one-shot health verdict from every enabled probe, judged by the
//! policy. Exit 0 healthy, 1 unhealthy, 2 could not tell. `--json` is for the launch gate.

use serde::Serialize;

use super::{CliError, ConfigArg, exit, print_json, resolve_policy};
use crate::model::{Observation, Verdict};
use crate::probe;

#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    #[command(flatten)]
    config: ConfigArg,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Serialize)]
pub struct Finding {
    pub signal: String,
    pub gpu: Option<u32>,
    pub action: String,
    pub rule: String,
    pub detail: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct CheckReport {
    /// `healthy`, `unhealthy` or `unknown`.
    pub verdict: &'static str,
    pub probes: Vec<ProbeResult>,
    pub findings: Vec<Finding>,
}

#[derive(Debug, Serialize)]
pub struct ProbeResult {
    pub probe: &'static str,
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

pub fn run(a: CheckArgs) -> Result<i32, CliError> {
    let cfg = a.config.load()?;
    let policy = resolve_policy(Some(&cfg.policy), None)?;
    let mut probes = probe::snapshot_probes(&cfg);
    let mut results = Vec::new();
    let mut seen: Vec<Observation> = Vec::new();
    for p in probes.iter_mut() {
        match p.snapshot() {
            Ok(obs) => {
                results.push(ProbeResult {
                    probe: p.name(),
                    ok: true,
                    error: None,
                });
                seen.extend(obs);
            }
            Err(e) => results.push(ProbeResult {
                probe: p.name(),
                ok: false,
                error: Some(e.to_string()),
            }),
        }
    }
    let mut findings = Vec::new();
    let mut unhealthy = false;
    for o in &seen {
        let Some(rule) = policy.rule_for(&o.signal, o.value) else {
            continue;
        };
        if rule.action <= Verdict::Ignore {
            continue;
        }
        // Anything that would take the node out of service, or restart MPS, fails the check.
        unhealthy |= rule.action >= Verdict::RestartMps;
        findings.push(Finding {
            signal: o.signal.to_string(),
            gpu: o.gpu.as_ref().map(|g| g.index),
            action: rule.action.as_str().to_string(),
            rule: rule.name.clone(),
            detail: o.detail.clone(),
        });
    }
    let could_not_look = results.is_empty() || results.iter().any(|r| !r.ok);
    let (verdict, code) = if unhealthy {
        ("unhealthy", exit::UNHEALTHY)
    } else if could_not_look {
        ("unknown", exit::UNKNOWN)
    } else {
        ("healthy", exit::OK)
    };
    let report = CheckReport {
        verdict,
        probes: results,
        findings,
    };
    if a.json {
        print_json(&report);
    } else {
        println!("verdict: {}", report.verdict);
        if report.probes.is_empty() {
            println!(
                "  no probe is enabled in {}: nothing was checked",
                a.config.config.display()
            );
        }
        for p in &report.probes {
            match &p.error {
                None => println!("  probe {}: ok", p.probe),
                Some(e) => println!("  probe {}: could not look: {e}", p.probe),
            }
        }
        for f in &report.findings {
            let gpu = f.gpu.map(|g| format!(" on GPU {g}")).unwrap_or_default();
            println!("  {}{gpu}: {} (rule `{}`)", f.signal, f.action, f.rule);
        }
    }
    Ok(code)
}
