//! `gpu-medic incidents list|show`: the journal as on-call reads it, or stable JSON. The
//! journal is streamed across its rotated files in linear time; memory grows with the
//! incidents still open (a summary each), never with the journal's size.

use std::time::Duration;

use clap::Subcommand;
use serde::Serialize;

use super::policy::event_line;
use super::{CliError, ConfigArg, exit, print_json};
use crate::journal::{self, Entry, journal_files, stream_journal, submit_request};
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
        /// Every instance of the cluster, from CloudWatch Logs (`[export]`), including
        /// instances that no longer exist; IDs are INSTANCE/ID.
        #[arg(long)]
        fleet: bool,
        /// With --fleet: this cluster's log group instead of this instance's cluster.
        #[arg(long, requires = "fleet")]
        cluster: Option<String>,
        /// With --fleet: list application faults one by one instead of one line per task
        /// definition.
        #[arg(long, requires = "fleet")]
        ungrouped: bool,
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
    /// One incident's timeline (ID, or INSTANCE/ID with --fleet).
    Show {
        id: String,
        #[command(flatten)]
        config: ConfigArg,
        #[arg(long)]
        json: bool,
        /// Read it from CloudWatch Logs (`[export]`): any instance of the cluster, even one
        /// that no longer exists.
        #[arg(long)]
        fleet: bool,
        /// With --fleet: this cluster's log group instead of this instance's cluster.
        #[arg(long, requires = "fleet")]
        cluster: Option<String>,
    },
}

/// The stable `--json` shape of an incident in a list.
#[derive(Debug, Serialize)]
pub struct IncidentLine<'a> {
    /// The instance, in the fleet view only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<&'a str>,
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
    /// The evidence archive in S3 (docs/evidence.md).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evidence: Option<&'a crate::model::EvidenceRef>,
    /// The drill's id when the incident is a rehearsal (`gpu-medic drill`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drill: Option<&'a str>,
}

impl<'a> From<&'a Incident> for IncidentLine<'a> {
    fn from(i: &'a Incident) -> Self {
        IncidentLine {
            instance_id: None,
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
            evidence: i.evidence.as_ref(),
            drill: i.drill.as_deref(),
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
            fleet,
            cluster,
            ungrouped,
        } => {
            let filter = Filter::new(open, state, gpu, since)?;
            if fleet {
                list_fleet(&config, cluster.as_deref(), &filter, json, !ungrouped)
            } else {
                list_local(&config, &filter, json)
            }
        }
        IncidentsCommand::Abort {
            id,
            config,
            by,
            wait,
        } => abort(id, &config, by, wait),
        IncidentsCommand::Show {
            id,
            config,
            json,
            fleet: true,
            cluster,
        } => show_fleet(&id, &config, cluster.as_deref(), json),
        IncidentsCommand::Show {
            id, config, json, ..
        } => show_local(&id, &config, json),
    }
}

/// Which incidents `incidents list` shows.
struct Filter {
    open: bool,
    state: Option<IncidentState>,
    gpu: Option<u32>,
    since: Option<Timestamp>,
}

impl Filter {
    fn new(
        open: bool,
        state: Option<String>,
        gpu: Option<u32>,
        since: Option<String>,
    ) -> Result<Filter, CliError> {
        let since = since.as_deref().map(parse_since).transpose()?;
        let state: Option<IncidentState> = state
            .map(|s| {
                serde_json::from_value(serde_json::Value::String(s.clone()))
                    .map_err(|_| CliError::Usage(format!("--state {s:?}: not an incident state")))
            })
            .transpose()?;
        Ok(Filter {
            open,
            state,
            gpu,
            since,
        })
    }

    fn shown(&self, i: &Incident) -> bool {
        (!self.open || i.state == IncidentState::Open)
            && self.state.is_none_or(|s| i.state == s)
            && self
                .gpu
                .is_none_or(|g| i.gpu.as_ref().is_some_and(|x| x.index == g))
            && self.since.is_none_or(|t| i.opened_at >= t)
    }
}

/// `incidents list --fleet`: every instance's incidents from CloudWatch Logs; application
/// faults one line per task definition unless `grouped` is off (docs/attribution.md).
fn list_fleet(
    config: &ConfigArg,
    cluster: Option<&str>,
    filter: &Filter,
    json: bool,
    grouped: bool,
) -> Result<i32, CliError> {
    let view = super::fleet::read(config, cluster, None, filter.since)?;
    let shown: Vec<crate::export::fleet_incidents::FleetIncident> = view
        .incidents
        .into_iter()
        .filter(|f| filter.shown(&f.incident))
        .collect();
    let (groups, rest) = if grouped {
        crate::export::fleet_incidents::group_application_faults(&shown)
    } else {
        (Vec::new(), shown.iter().collect())
    };
    let mut table = Table {
        id_width: rest
            .iter()
            .map(|f| f.instance_id.len() + 1 + f.incident.id.0.to_string().len())
            .max()
            .unwrap_or(0),
        ..Table::default()
    };
    for f in &rest {
        if json {
            print_json(&IncidentLine {
                instance_id: Some(&f.instance_id),
                ..IncidentLine::from(&f.incident)
            });
        } else {
            table.row_as(&format!("{}/{}", f.instance_id, f.incident.id), &f.incident);
        }
    }
    print_app_groups(&groups, json);
    if !json && table.rows == 0 && groups.is_empty() {
        println!("no incidents");
    }
    Ok(exit::OK)
}

/// One line per program whose faults were judged its own, across the fleet.
fn print_app_groups(groups: &[crate::export::fleet_incidents::AppFaultGroup], json: bool) {
    if json {
        #[derive(Serialize)]
        struct Line<'a> {
            kind: &'static str,
            #[serde(flatten)]
            group: &'a crate::export::fleet_incidents::AppFaultGroup,
        }
        for g in groups {
            print_json(&Line {
                kind: "application-faults",
                group: g,
            });
        }
        return;
    }
    if groups.is_empty() {
        return;
    }
    println!();
    println!("Application faults, judged each program's own (the GPUs stayed in service):");
    for g in groups {
        let signals: Vec<String> = g.signals.iter().map(|(s, n)| format!("{s} x{n}")).collect();
        println!(
            "  {}: {} incident{} on {} instance{} ({}), {} to {}",
            g.program,
            g.incidents,
            if g.incidents == 1 { "" } else { "s" },
            g.instances.len(),
            if g.instances.len() == 1 { "" } else { "s" },
            signals.join(", "),
            g.first,
            g.last
        );
    }
}

/// `incidents list`: this instance's journal.
fn list_local(config: &ConfigArg, filter: &Filter, json: bool) -> Result<i32, CliError> {
    let mut table = Table::default();
    stream_incidents(config, |i| {
        if !filter.shown(&i) {
            return;
        }
        if json {
            print_json(&IncidentLine::from(&i));
        } else {
            table.row(&i);
        }
    })?;
    if !json && table.rows == 0 {
        println!("no incidents");
    }
    Ok(exit::OK)
}

/// `incidents show INSTANCE/ID --fleet`: one incident of any instance, from CloudWatch Logs.
fn show_fleet(
    id: &str,
    config: &ConfigArg,
    cluster: Option<&str>,
    json: bool,
) -> Result<i32, CliError> {
    let (instance, n) = id
        .rsplit_once('/')
        .and_then(|(i, n)| Some((i.to_string(), n.parse::<u64>().ok()?)))
        .filter(|(i, _)| !i.is_empty())
        .ok_or_else(|| {
            CliError::Usage(format!(
                "{id:?}: give INSTANCE/ID (e.g. i-0abc/7) with --fleet"
            ))
        })?;
    let view = super::fleet::read(config, cluster, Some((&instance, n)), None)?;
    let Some(f) = view.incidents.into_iter().next() else {
        return Err(CliError::NotFound(format!(
            "no incident {instance}/{n} in CloudWatch Logs"
        )));
    };
    if json {
        print_json(&super::fleet::Shown {
            instance_id: &f.instance_id,
            incident: &f.incident,
        });
    } else {
        println!("Instance {}", f.instance_id);
        print_timeline(&f.incident);
    }
    Ok(exit::OK)
}

/// `incidents show ID`: one incident of this instance, with its repair's rung and history.
fn show_local(id: &str, config: &ConfigArg, json: bool) -> Result<i32, CliError> {
    let id: u64 = id.parse().map_err(|_| {
        CliError::Usage(format!(
            "{id:?}: not an incident id (INSTANCE/ID needs --fleet)"
        ))
    })?;
    let Some(i) = load_one(config, id)? else {
        return Err(CliError::NotFound(format!(
            "no incident {id} in {}",
            config.load()?.incidents_path().display()
        )));
    };
    let repair = repair_view(config, &i);
    if json {
        print_json(&ShownLocal {
            incident: &i,
            repair,
        });
    } else {
        print_timeline(&i);
        if let Some(r) = &repair {
            print_repair(r);
        }
    }
    Ok(exit::OK)
}

/// `incidents show` of a node remediation: the incident plus its rung of the repair ladder.
#[derive(Serialize)]
struct ShownLocal<'a> {
    #[serde(flatten)]
    incident: &'a Incident,
    #[serde(skip_serializing_if = "Option::is_none")]
    repair: Option<RepairView>,
}

/// Where a node remediation stands on the ladder drain / reboot / replace, and why.
#[derive(Serialize)]
struct RepairView {
    /// The rung in force (`reboot`, `replace`, ...).
    rung: crate::model::Verdict,
    /// The rung the first signal asked for.
    asked: crate::model::Verdict,
    /// Each climb: `rule: reason`.
    climbed: Vec<String>,
    /// This instance's reboots (state.json), oldest first.
    history: Vec<crate::engine::repair::Repair>,
}

fn repair_view(config: &ConfigArg, i: &Incident) -> Option<RepairView> {
    use crate::model::{IncidentEvent, Verdict};
    let asked = i.records.iter().find_map(|r| match &r.event {
        IncidentEvent::Opened { verdict, .. } => Some(*verdict),
        _ => None,
    })?;
    if !i.action.is_node_remediation() && !asked.is_node_remediation() {
        return None;
    }
    let climbed = i
        .records
        .iter()
        .filter_map(|r| match &r.event {
            IncidentEvent::Escalated {
                verdict,
                rule,
                reason,
            } if *verdict >= Verdict::Drain => Some(format!("{rule} -> {verdict}: {reason}")),
            _ => None,
        })
        .collect();
    let history = config
        .load()
        .ok()
        .and_then(|cfg| crate::journal::load_state(&cfg.state_path()).ok().flatten())
        .map(|st| st.repair.history.to_vec())
        .unwrap_or_default();
    Some(RepairView {
        rung: i.action,
        asked,
        climbed,
        history,
    })
}

fn print_repair(r: &RepairView) {
    println!("  rung:     {} (asked: {})", r.rung, r.asked);
    for c in &r.climbed {
        println!("  went up:  {c}");
    }
    if r.history.is_empty() {
        println!("  reboot history: none on this instance");
        return;
    }
    println!("  reboot history (this instance):");
    for h in &r.history {
        let after = h.boot_after.as_deref().unwrap_or("-");
        let why = if h.why.is_empty() {
            String::new()
        } else {
            format!(": {}", h.why)
        };
        println!(
            "    {}  incident {}  {}  boot {} -> {after}  {}{why}",
            h.at,
            h.incident,
            h.rule,
            h.boot_before,
            h.result.as_str()
        );
    }
}

fn whoami() -> String {
    std::env::var("SUDO_USER")
        .or_else(|_| std::env::var("USER"))
        .unwrap_or_else(|_| "operator".into())
}

fn abort(id: u64, config: &ConfigArg, by: String, wait: Duration) -> Result<i32, CliError> {
    let cfg = config.load()?;
    let Some(before) = load_one(config, id)? else {
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
        let Some(i) = load_one(config, id)? else {
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

/// Streams the journal (every rotated file, oldest first, each within its cap:
/// `journal::read_cap`), warning (never failing) on unreadable lines, on what a file over its
/// cap had skipped, and on records whose incident id is out of range (over
/// `MAX_REBUILT_ID`: no journal of gpu-medic's holds one; a forged one would otherwise hide
/// every incident after it, taken for an id already listed).
fn stream_records(config: &ConfigArg, mut f: impl FnMut(Record)) -> Result<(), CliError> {
    let cfg = config.load()?;
    let files = journal_files(&cfg.incidents_path());
    let mut out_of_range = 0u64;
    stream_journal::<Record>(
        &files,
        journal::read_cap(cfg.journal.max_file_size_mib),
        |e| {
            match e {
                Entry::Item(r) if r.incident.0 > crate::model::MAX_REBUILT_ID => {
                    out_of_range += 1;
                }
                Entry::Item(r) => f(r),
                Entry::Skipped { path, line } if line.line == 0 => {
                    eprintln!("warning: {}: {}", path.display(), line.message);
                }
                Entry::Skipped { path, line } => eprintln!("warning: {}: {line}", path.display()),
            }
            true
        },
    )?;
    if out_of_range > 0 {
        eprintln!(
            "warning: {out_of_range} record(s) with out-of-range incident ids (over {}) skipped: not written by gpu-medic",
            crate::model::MAX_REBUILT_ID
        );
    }
    Ok(())
}

/// One incident with its whole timeline; memory is that incident's records.
pub fn load_one(config: &ConfigArg, id: u64) -> Result<Option<Incident>, CliError> {
    let mut out: Option<Incident> = None;
    stream_records(config, |r| {
        if r.incident.0 == id {
            out.get_or_insert_with(|| Incident::stub(&r)).push(r);
        }
    })?;
    Ok(out)
}

/// At most this many finished incidents wait for an older open one before they are listed
/// anyway (out of id order).
const LIST_PENDING_MAX: usize = 4096;

/// Folds the journal into incidents without their timelines and hands each over once it is
/// closed, in id order; those still open come last. Memory is the incidents that are open
/// (a summary each, no timeline) plus at most [`LIST_PENDING_MAX`] closed ones waiting
/// behind an open one, not the journal's size; the work is linear in the records (one map
/// update per record, each incident handed over once). Records of an incident already
/// handed over (a signal after its close) are not folded in.
pub fn stream_incidents(config: &ConfigArg, mut f: impl FnMut(Incident)) -> Result<(), CliError> {
    let mut folder = Folder::default();
    stream_records(config, |r| folder.push(&r, &mut f))?;
    folder.finish(&mut f);
    Ok(())
}

/// The state of [`stream_incidents`] between two records.
#[derive(Default)]
struct Folder {
    /// Incidents not handed over yet, by id: open ones, and closed ones behind an open one.
    pending: std::collections::BTreeMap<IncidentId, Incident>,
    /// The ids of those in `pending` that are closed (so that no record scans them all).
    closed: std::collections::BTreeSet<IncidentId>,
    /// The highest id seen: an id at or below it not in `pending` was handed over.
    highest: Option<IncidentId>,
}

impl Folder {
    fn push(&mut self, r: &Record, f: &mut impl FnMut(Incident)) {
        let id = r.incident;
        if !self.pending.contains_key(&id) {
            if self.highest.is_some_and(|h| id <= h) {
                return; // handed over already
            }
            self.highest = Some(id);
            self.pending.insert(id, Incident::stub(r));
        }
        let Some(inc) = self.pending.get_mut(&id) else {
            return;
        };
        let was_open = inc.state == IncidentState::Open;
        inc.fold_record(r);
        match (was_open, inc.state == IncidentState::Open) {
            (true, false) => {
                self.closed.insert(id);
            }
            (false, true) => {
                self.closed.remove(&id);
            }
            _ => {}
        }
        // The oldest ones, as long as they are closed, in id order.
        while let Some(first) = self.pending.first_entry()
            && first.get().state != IncidentState::Open
        {
            let i = first.remove();
            self.closed.remove(&i.id);
            f(i);
        }
        // More open than the daemon keeps: the oldest is handed over as the daemon would
        // have closed it (`abandoned`), so memory stays bounded whatever the journal holds.
        if self.pending.len() - self.closed.len() > crate::model::MAX_OPEN_INCIDENTS
            && let Some(mut i) = self.pending.pop_first().map(|(_, i)| i)
        {
            i.state = IncidentState::Abandoned;
            i.summary = format!(
                "abandoned: more than {} incidents open at once in the journal; this, the oldest, is listed as the daemon would have closed it",
                crate::model::MAX_OPEN_INCIDENTS
            );
            f(i);
        }
        // Too many closed ones behind an open one: all of them go now (each incident is
        // handed over once, so this pass is paid for by the LIST_PENDING_MAX records that
        // filled it).
        if self.closed.len() > LIST_PENDING_MAX {
            for k in std::mem::take(&mut self.closed) {
                if let Some(i) = self.pending.remove(&k) {
                    f(i);
                }
            }
        }
    }

    /// The closed ones still waiting, then the open ones, each in id order.
    fn finish(self, f: &mut impl FnMut(Incident)) {
        let (closed, open): (Vec<Incident>, Vec<Incident>) = self
            .pending
            .into_values()
            .partition(|i| i.state != IncidentState::Open);
        for i in closed.into_iter().chain(open) {
            f(i);
        }
    }
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
    let mut table = Table::default();
    for i in incidents {
        table.row(i);
    }
    if table.rows == 0 {
        println!("no incidents");
    }
}

/// The incident table, printed a row at a time (the header before the first row).
#[derive(Default)]
pub struct Table {
    pub rows: usize,
    /// The ID column's width (at least 4; the fleet view's INSTANCE/ID is wider).
    pub id_width: usize,
}

impl Table {
    pub fn row(&mut self, i: &Incident) {
        self.row_as(&i.id.0.to_string(), i);
    }

    /// A row whose ID column reads `id`.
    pub fn row_as(&mut self, id: &str, i: &Incident) {
        let w = self.id_width.max(4);
        if self.rows == 0 {
            println!(
                "{:>w$}  {:<24}  {:>3}  {:<22}  {:<11}  {:<10}  RULE",
                "ID", "OPENED", "GPU", "SIGNAL", "ACTION", "STATE"
            );
        }
        self.rows += 1;
        println!(
            "{:>w$}  {:<24}  {:>3}  {:<22}  {:<11}  {:<10}  {}",
            id,
            i.opened_at.to_string(),
            gpu_short(i.gpu.as_ref()),
            match i.drill {
                Some(_) => format!("{} [drill]", i.signal),
                None => i.signal.clone(),
            },
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
    if let Some(d) = &i.drill {
        println!("  drill:    {d} (a rehearsal: `gpu-medic drill`)");
    }
    if !i.tasks.is_empty() || !i.pids.is_empty() {
        let pids: Vec<String> = i.pids.iter().map(|p| p.to_string()).collect();
        println!(
            "  tasks:    {}  (pids {})",
            i.tasks.join(", "),
            pids.join(", ")
        );
    }
    if let Some(c) = &i.culprit {
        println!("  who:      {}", c.describe());
    }
    if let Some(s) = &i.site {
        println!("  where:    {}", s.describe());
    }
    if let Some(j) = i.judgement() {
        println!("  judged:   {j}");
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
    if let Some(e) = &i.evidence {
        println!("  evidence: {}", e.summary());
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
        if let crate::model::IncidentEvent::ActionFinished { outcome } = &r.event
            && let Some(d) = &outcome.diagnosis
        {
            println!("      {}", super::diagnose::headline(d));
            for line in super::diagnose::lines(d) {
                println!("      {line}");
            }
        }
    }
}

fn round_secs(d: Duration) -> Duration {
    Duration::from_millis(d.as_millis() as u64 / 100 * 100)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{IncidentEvent, Timestamp};

    fn note(i: u64) -> Record {
        Record {
            at: Timestamp(1_700_000_000_000 + i),
            incident: IncidentId(i),
            drill: None,
            event: IncidentEvent::Note { text: "n".into() },
        }
    }

    /// Incident `i` closed as logged.
    fn closed(i: u64) -> Record {
        Record {
            at: Timestamp(1_700_000_000_000 + i),
            incident: crate::model::IncidentId(i),
            drill: None,
            event: IncidentEvent::Closed {
                state: IncidentState::Logged,
                summary: format!("r{i}"),
            },
        }
    }

    fn fold_all(records: &[Record]) -> Vec<(u64, IncidentState)> {
        let mut out = Vec::new();
        let mut folder = Folder::default();
        let mut f = |i: Incident| out.push((i.id.0, i.state));
        for r in records {
            folder.push(r, &mut f);
        }
        folder.finish(&mut f);
        out
    }

    #[test]
    fn every_incident_is_handed_over_once_closed_in_id_order_and_open_ones_last() {
        // 20,000 incidents: every third stays open; the others close after the next opens.
        let n = 20_000u64;
        let mut records = Vec::new();
        for i in 1..=n {
            records.push(note(i));
            if i > 1 && (i - 1) % 3 != 0 {
                records.push(closed(i - 1));
            }
        }
        records.push(closed(n));
        // A record of an incident handed over already is not folded in again.
        records.push(note(2));
        let got = fold_all(&records);
        assert_eq!(got.len(), n as usize, "each incident once");
        let mut ids: Vec<u64> = got.iter().map(|g| g.0).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), n as usize);
        let of = |state: IncidentState| -> Vec<u64> {
            got.iter().filter(|g| g.1 == state).map(|g| g.0).collect()
        };
        let (open, abandoned) = (of(IncidentState::Open), of(IncidentState::Abandoned));
        // Never more open at once than the daemon keeps: the oldest past the bound are handed
        // over as abandoned, in id order, each older than every one still open.
        assert_eq!(open.len() + abandoned.len(), (n as usize - 1) / 3);
        assert!(
            open.len() <= crate::model::MAX_OPEN_INCIDENTS,
            "{}",
            open.len()
        );
        assert!(
            open.len() + 2 >= crate::model::MAX_OPEN_INCIDENTS,
            "{}",
            open.len()
        );
        assert!(abandoned.windows(2).all(|w| w[0] < w[1]));
        assert!(abandoned.last() < open.first());
        // The open ones come last, in id order.
        let tail = &got[got.len() - open.len()..];
        assert!(tail.iter().all(|g| g.1 == IncidentState::Open));
        assert!(open.windows(2).all(|w| w[0] < w[1]));
        // Closed ones before the first open one are in id order.
        assert_eq!(got[0], (1, IncidentState::Logged));
        assert_eq!(got[1], (2, IncidentState::Logged));
    }

    #[test]
    fn a_hundred_thousand_open_incidents_fold_in_linear_time() {
        let records: Vec<Record> = (1..=100_000).map(note).collect();
        // Before, every record past the 4,096th scanned all pending incidents (minutes here);
        // the time is the bench's (benches/incidents_list.rs), this checks the result.
        let got = fold_all(&records);
        assert_eq!(got.len(), 100_000);
        assert!(got.windows(2).all(|w| w[0].0 < w[1].0), "in id order");
        // The newest MAX_OPEN_INCIDENTS stay open; the older ones were handed over as the
        // daemon would have closed them.
        let (old, newest) = got.split_at(100_000 - crate::model::MAX_OPEN_INCIDENTS);
        assert!(old.iter().all(|g| g.1 == IncidentState::Abandoned));
        assert!(newest.iter().all(|g| g.1 == IncidentState::Open));
    }
}
