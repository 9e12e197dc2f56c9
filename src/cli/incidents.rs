//! `gpu-medic incidents list|show`: the journal as on-call reads it, or stable JSON.

use std::time::Duration;

use clap::Subcommand;
use serde::Serialize;

use super::policy::event_line;
use super::{CliError, ConfigArg, exit, print_json};
use crate::journal::{read_jsonl, submit_request};
use crate::model::{
    GpuId, Incident, IncidentEvent, IncidentId, IncidentState, OperatorRequest, Record, Timestamp,
};

#[derive(Debug, Subcommand)]
pub enum IncidentsCommand {
    /// One line per incident, newest last.
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
        /// Only incidents still open.
        #[arg(long)]
        open: bool,
        /// Only incidents in this state (open, logged, resolved, drained, replaced, terminated,
        /// observed, failed).
        #[arg(long)]
        state: Option<String>,
        /// Only incidents on this GPU index.
        #[arg(long)]
        gpu: Option<u32>,
        /// Only incidents opened since this long ago (e.g. 2h) or this time (RFC 3339).
        #[arg(long)]
        since: Option<String>,
    },
    /// Stop a quarantine or drain that has not reached Auto Scaling and return the
    /// instance to service (asks the running daemon through state_dir/requests/).
    Abort {
        id: u64,
        #[command(flatten)]
        config: ConfigArg,
        /// Who asks, for the journal.
        #[arg(long, default_value_t = whoami())]
        by: String,
        /// How long to wait for the daemon's answer.
        #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
        wait: Duration,
    },
    /// One incident's timeline.
    Show {
        id: u64,
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        json: bool,
    },
}

/// The stable `--json` shape of an incident in a list.
#[derive(Debug, Serialize)]
pub struct IncidentLine<'a> {
    pub id: u64,
    pub opened_at: Timestamp,
    pub signal: &'a str,
    pub gpu: Option<&'a GpuId>,
    pub action: &'a str,
    pub state: &'a str,
    pub rule: &'a str,
    pub closed_at: Option<Timestamp>,
    pub summary: &'a str,
    pub tasks: &'a [String],
    pub request_ids: &'a [String],
}

impl<'a> From<&'a Incident> for IncidentLine<'a> {
    fn from(i: &'a Incident) -> Self {
        IncidentLine {
            id: i.id.0,
            opened_at: i.opened_at,
            signal: &i.signal,
            gpu: i.gpu.as_ref(),
            action: i.action.as_str(),
            state: i.state.as_str(),
            rule: &i.rule,
            closed_at: i.closed_at,
            summary: &i.summary,
            tasks: &i.tasks,
            request_ids: &i.request_ids,
        }
    }
}

pub fn run(cmd: IncidentsCommand) -> Result<i32, CliError> {
    match cmd {
        IncidentsCommand::List {
            config,
            json,
            open,
            state,
            gpu,
            since,
        } => {
            let since = since.as_deref().map(parse_since).transpose()?;
            let state: Option<IncidentState> = state
                .map(|s| {
                    serde_json::from_value(serde_json::Value::String(s.clone())).map_err(|_| {
                        CliError::Usage(format!("--state {s:?}: not an incident state"))
                    })
                })
                .transpose()?;
            let incidents = load(&config)?;
            let shown = incidents.iter().filter(|i| {
                (!open || i.state == IncidentState::Open)
                    && state.is_none_or(|s| i.state == s)
                    && gpu.is_none_or(|g| i.gpu.as_ref().is_some_and(|x| x.index == g))
                    && since.is_none_or(|t| i.opened_at >= t)
            });
            if json {
                for i in shown {
                    print_json(&IncidentLine::from(i));
                }
            } else {
                print_table(shown);
            }
            Ok(exit::OK)
        }
        IncidentsCommand::Abort {
            id,
            config,
            by,
            wait,
        } => abort(id, &config, by, wait),
        IncidentsCommand::Show { id, config, json } => {
            let incidents = load(&config)?;
            let Some(i) = incidents.iter().find(|i| i.id.0 == id) else {
                return Err(CliError::NotFound(format!(
                    "no incident {id} in {}",
                    config.load()?.incidents_path().display()
                )));
            };
            if json {
                print_json(i);
            } else {
                print_timeline(i);
            }
            Ok(exit::OK)
        }
    }
}

fn whoami() -> String {
    std::env::var("SUDO_USER")
        .or_else(|_| std::env::var("USER"))
        .unwrap_or_else(|_| "operator".into())
}

fn abort(id: u64, config: &ConfigArg, by: String, wait: Duration) -> Result<i32, CliError> {
    let cfg = config.load()?;
    let incidents = load(config)?;
    let Some(before) = incidents.iter().find(|i| i.id.0 == id) else {
        return Err(CliError::NotFound(format!("no incident {id}")));
    };
    if before.state != IncidentState::Open {
        println!(
            "incident {id} is already {}: nothing to abort",
            before.state.as_str()
        );
        return Ok(exit::OK);
    }
    let seen = before.records.len();
    let request = OperatorRequest::Abort {
        incident: IncidentId(id),
        by: by.clone(),
    };
    let path = submit_request(&cfg.state_dir, &request)?;
    println!(
        "abort of incident {id} requested by {by} ({})",
        path.display()
    );
    let start = std::time::Instant::now();
    while start.elapsed() < wait {
        std::thread::sleep(Duration::from_millis(200));
        let now = load(config)?;
        let Some(i) = now.into_iter().find(|i| i.id.0 == id) else {
            continue;
        };
        let answered = i.records[seen.min(i.records.len())..].iter().any(|r| {
            matches!(&r.event, IncidentEvent::Note { text } if text.starts_with("abort requested"))
                || matches!(&r.event, IncidentEvent::Escalated { rule, .. } if rule == "operator-abort")
        });
        if i.state != IncidentState::Open || answered {
            for r in &i.records[seen.min(i.records.len())..] {
                println!("  {}  {}", r.at, event_line(&r.event));
            }
            if i.state == IncidentState::Open {
                println!(
                    "(the instance is being returned to service; follow with `gpu-medic incidents show {id}`)"
                );
            }
            return Ok(exit::OK);
        }
    }
    println!(
        "the daemon has not answered yet (is `gpu-medic run` running?); the request waits in {}",
        path.display()
    );
    Ok(exit::UNKNOWN)
}

/// Reads and folds the journal, warning (never failing) on unreadable lines.
pub fn load(config: &ConfigArg) -> Result<Vec<Incident>, CliError> {
    let cfg = config.load()?;
    let path = cfg.incidents_path();
    let (records, skipped) = read_jsonl::<Record>(&path)?;
    for s in &skipped {
        eprintln!("warning: {}: {s}", path.display());
    }
    Ok(Incident::fold(records))
}

fn parse_since(s: &str) -> Result<Timestamp, CliError> {
    if let Ok(d) = humantime::parse_duration(s) {
        return Ok(Timestamp::now().minus(d));
    }
    Timestamp::parse(s).map_err(|_| {
        CliError::Usage(format!(
            "--since {s:?}: give a duration (2h, 30m) or a time (2026-11-30T05:00:00Z)"
        ))
    })
}

fn gpu_short(g: Option<&GpuId>) -> String {
    g.map(|g| g.index.to_string()).unwrap_or_else(|| "-".into())
}

pub fn print_table<'a>(incidents: impl Iterator<Item = &'a Incident>) {
    let rows: Vec<&Incident> = incidents.collect();
    if rows.is_empty() {
        println!("no incidents");
        return;
    }
    println!(
        "{:>4}  {:<24}  {:>3}  {:<22}  {:<11}  {:<10}  RULE",
        "ID", "OPENED", "GPU", "SIGNAL", "ACTION", "STATE"
    );
    for i in rows {
        println!(
            "{:>4}  {:<24}  {:>3}  {:<22}  {:<11}  {:<10}  {}",
            i.id.0,
            i.opened_at.to_string(),
            gpu_short(i.gpu.as_ref()),
            i.signal,
            i.action.as_str(),
            i.state.as_str(),
            i.rule
        );
    }
}

pub fn print_timeline(i: &Incident) {
    println!(
        "Incident {}: {} -> {} ({})",
        i.id,
        i.signal,
        i.action,
        i.state.as_str()
    );
    match &i.gpu {
        Some(g) => {
            let serial = g
                .serial
                .as_deref()
                .map(|s| format!(", serial {s}"))
                .unwrap_or_default();
            println!("  gpu:      {g}{serial}");
        }
        None => println!("  gpu:      - (node-level signal)"),
    }
    if !i.tasks.is_empty() || !i.pids.is_empty() {
        let pids: Vec<String> = i.pids.iter().map(|p| p.to_string()).collect();
        println!(
            "  tasks:    {}  (pids {})",
            i.tasks.join(", "),
            pids.join(", ")
        );
    }
    println!("  rule:     {}", i.rule);
    println!("  why:      {}", i.reason);
    let took = i
        .closed_at
        .map(|c| {
            format!(
                " (after {})",
                humantime::format_duration(round_secs(c.since(i.opened_at)))
            )
        })
        .unwrap_or_default();
    println!("  opened:   {}", i.opened_at);
    match i.closed_at {
        Some(c) => println!("  closed:   {c}{took}: {}", i.summary),
        None => println!("  now:      open, being handled"),
    }
    if !i.request_ids.is_empty() {
        println!("  requests: {}", i.request_ids.join(", "));
    }
    println!("  timeline:");
    for r in &i.records {
        let offset = humantime::format_duration(round_secs(r.at.since(i.opened_at)));
        println!(
            "    {}  +{:<8}  {}",
            r.at,
            offset.to_string(),
            event_line(&r.event)
        );
    }
}

fn round_secs(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64 / 100 * 100)
}
