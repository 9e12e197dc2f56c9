//! `gpu-medic fleet status` and `gpu-medic fleet ack <id>`: the group as the fleet budget
//! sees it, read live (the slot table's item and fleet document, the Auto Scaling group), and
//! an operator's acknowledgement of a fleet incident (docs/fleet-scale.md, "Fleet incidents";
//! docs/operations.md). Both need `[fleet] table` and this instance's Auto Scaling group
//! (`[identity] auto_scaling_group`, or `--group`).

use serde::Serialize;

use super::{CliError, ConfigArg};
use crate::aws::asg::Asg;
use crate::aws::calls::Calls;
use crate::aws::dynamo::{Holder, SlotTable, TableError};
use crate::config::View;
use crate::remedy::budget::group_view::{FleetSummary, KILL_SWITCH_PROCESSES};
use crate::remedy::budget::patterns::{self, Doc, FleetIncident};

/// `fleet status` and `fleet ack`.
#[derive(Debug, clap::Subcommand)]
pub enum FleetCommand {
    /// The group's fleet budget: capacity and slots in use, the breaker as this instance
    /// last saw it, kill switches, and the fleet incidents (fingerprints, poison task
    /// definitions, bad images) with whether each is acknowledged. Read live from the slot
    /// table and Auto Scaling.
    Status(StatusArgs),
    /// Acknowledge a fleet incident: the drains a fingerprint's holds go on, within the
    /// budget; a poison task's or a bad image's is marked seen.
    Ack(AckArgs),
}

#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub config: ConfigArg,
    /// The Auto Scaling group (default: `[identity] auto_scaling_group`).
    #[arg(long)]
    pub group: Option<String>,
    /// One JSON object.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, clap::Args)]
pub struct AckArgs {
    /// The fleet incident's id (`fp-…`, `task-…`, `img-…`, from `fleet status`).
    pub id: String,
    /// Who acknowledges (default: $USER).
    #[arg(long)]
    pub by: Option<String>,
    #[command(flatten)]
    pub config: ConfigArg,
    #[arg(long)]
    pub group: Option<String>,
}

/// What `fleet status --json` prints.
#[derive(Debug, Serialize)]
pub struct FleetStatus {
    pub group: String,
    pub table: String,
    pub desired: u32,
    /// max(1, `max_parallel` of desired capacity).
    pub capacity: u32,
    /// Entries of the slot table (reserved or committed).
    pub in_use: u32,
    pub holders: std::collections::BTreeMap<String, Holder>,
    /// Kill-switch processes suspended, and the pause tag.
    pub suspended: Vec<String>,
    pub paused: bool,
    /// The breaker as this instance's last full read saw it (None: no read yet).
    pub breaker: Option<Breaker>,
    pub fleet_incidents: Vec<FleetIncident>,
}

#[derive(Debug, Serialize)]
pub struct Breaker {
    pub open: bool,
    pub unhealthy: u32,
    pub limit: u32,
    pub observed_at: crate::model::Timestamp,
}

pub fn run(c: FleetCommand) -> Result<i32, CliError> {
    match c {
        FleetCommand::Status(a) => status(&a),
        FleetCommand::Ack(a) => ack(&a),
    }
    .map(|()| super::exit::OK)
}

/// The config, the table, the group and a runtime with the SDK.
fn setup(
    config: &ConfigArg,
    group: Option<&str>,
) -> Result<
    (
        crate::config::Config,
        String,
        String,
        tokio::runtime::Runtime,
    ),
    CliError,
> {
    let cfg = config.load()?;
    let table = cfg.fleet.table.clone().ok_or_else(|| {
        CliError::Usage("fleet status and fleet ack need [fleet] table (the slot table)".into())
    })?;
    let group = group
        .map(str::to_string)
        .or_else(|| cfg.identity.auto_scaling_group.clone())
        .ok_or_else(|| {
            CliError::Usage(
                "no Auto Scaling group: give --group or [identity] auto_scaling_group".into(),
            )
        })?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Runtime(format!("cannot start the runtime: {e}")))?;
    Ok((cfg, table, group, rt))
}

fn table_error(table: &str, e: TableError) -> CliError {
    CliError::Runtime(format!("slot table {table}: {e}"))
}

fn status(a: &StatusArgs) -> Result<(), CliError> {
    let (cfg, table, group, rt) = setup(&a.config, a.group.as_deref())?;
    let s = rt.block_on(async {
        let sdk = crate::aws::loader(&cfg.aws).load().await;
        let t = SlotTable::from_sdk(&sdk, &table);
        let asg = Asg::from_sdk(&sdk);
        let mut calls = Calls::new();
        let slots = t
            .read(&mut calls, &group)
            .await
            .map_err(|e| table_error(&table, e))?;
        let fleet = t
            .read_fleet(&mut calls, &group)
            .await
            .map_err(|e| table_error(&table, e))?;
        let g = asg
            .group(&mut calls, &group)
            .await
            .map_err(|e| CliError::Runtime(format!("Auto Scaling group {group}: {e}")))?;
        let doc: Doc = serde_json::from_str(&fleet.doc).map_err(|e| {
            CliError::Runtime(format!(
                "the fleet document of group {group} is unreadable: {e}"
            ))
        })?;
        let breaker = cfg
            .files()
            .load_view::<FleetSummary>(View::Fleet)
            .filter(|f| f.group.ends_with(&group))
            .map(|f| Breaker {
                open: f.desired >= crate::remedy::budget::group_view::BREAKER_MIN_FLEET
                    && f.unhealthy > f.breaker_limit,
                unhealthy: f.unhealthy,
                limit: f.breaker_limit,
                observed_at: f.observed_at,
            });
        Ok::<_, CliError>(FleetStatus {
            capacity: cfg.fleet.max_parallel.of(g.desired).max(1),
            desired: g.desired,
            in_use: u32::try_from(slots.holders.len()).unwrap_or(u32::MAX),
            holders: slots.holders,
            suspended: g
                .suspended
                .iter()
                .filter(|p| KILL_SWITCH_PROCESSES.contains(&p.as_str()))
                .cloned()
                .collect(),
            paused: g
                .tags
                .iter()
                .any(|(k, v)| *k == cfg.fleet.pause_tag && v.trim().eq_ignore_ascii_case("true")),
            breaker,
            fleet_incidents: doc.incidents.into_values().collect(),
            group,
            table,
        })
    })?;
    if a.json {
        super::print_json(&s);
    } else {
        print_text(&s);
    }
    Ok(())
}

fn print_text(s: &FleetStatus) {
    println!(
        "group {} (table {}): {} desired",
        s.group, s.table, s.desired
    );
    println!(
        "budget: {} of {} slot(s) in use{}",
        s.in_use,
        s.capacity,
        if s.holders.is_empty() {
            String::new()
        } else {
            let h: Vec<String> = s
                .holders
                .iter()
                .map(|(i, h)| format!("{i} {}", h.state.as_str()))
                .collect();
            format!(" ({})", h.join(", "))
        }
    );
    match &s.breaker {
        Some(b) => println!(
            "breaker: {} ({} unhealthy, limit {}; as this instance saw it at {})",
            if b.open {
                "open: one repair at a time"
            } else {
                "closed"
            },
            b.unhealthy,
            b.limit,
            b.observed_at
        ),
        None => println!("breaker: not read by this instance yet"),
    }
    if s.suspended.is_empty() && !s.paused {
        println!("kill switches: none");
    } else {
        println!(
            "kill switches: {}{}",
            s.suspended.join(", "),
            if s.paused { " (paused by its tag)" } else { "" }
        );
    }
    if s.fleet_incidents.is_empty() {
        println!("fleet incidents: none");
    }
    for i in &s.fleet_incidents {
        let state = match &i.acked {
            Some(a) => format!(
                "acknowledged by {} at {}",
                a.by,
                crate::model::Timestamp(a.at_ms)
            ),
            None => format!("NOT acknowledged: `gpu-medic fleet ack {}`", i.id),
        };
        println!("{}  {}", i.summary(), state);
    }
}

fn ack(a: &AckArgs) -> Result<(), CliError> {
    let (cfg, table, group, rt) = setup(&a.config, a.group.as_deref())?;
    let by =
        a.by.clone()
            .or_else(|| std::env::var("USER").ok())
            .unwrap_or_else(|| "operator".into());
    rt.block_on(async {
        let sdk = crate::aws::loader(&cfg.aws).load().await;
        let t = SlotTable::from_sdk(&sdk, &table);
        for _ in 0..5 {
            let mut calls = Calls::new();
            let read = t
                .read_fleet(&mut calls, &group)
                .await
                .map_err(|e| table_error(&table, e))?;
            let doc: Doc = serde_json::from_str(&read.doc).map_err(|e| {
                CliError::Runtime(format!(
                    "the fleet document of group {group} is unreadable: {e}"
                ))
            })?;
            let Some(inc) = doc.incidents.get(&a.id) else {
                return Err(CliError::NotFound(format!(
                    "no fleet incident {} in group {group}",
                    a.id
                )));
            };
            let now = crate::model::Timestamp::now().0;
            let Some(next) = patterns::ack(&doc, &a.id, &by, now) else {
                println!("{} was acknowledged already ({:?})", a.id, inc.acked);
                return Ok(());
            };
            let text = serde_json::to_string(&next)
                .map_err(|e| CliError::Runtime(format!("cannot encode the fleet document: {e}")))?;
            match t.write_fleet(&mut calls, &group, &read, &text, &by).await {
                Ok(()) => {
                    if inc.holds_drains() {
                        println!(
                            "{} acknowledged by {by}: the drains it held go on, within the budget",
                            a.id
                        );
                    } else {
                        println!("{} acknowledged by {by}: it held nothing", a.id);
                    }
                    return Ok(());
                }
                Err(TableError::Conflict) => continue,
                Err(e) => return Err(table_error(&table, e)),
            }
        }
        Err(CliError::Runtime(format!(
            "slot table {table}: five writes in a row lost the race; try again"
        )))
    })
}
