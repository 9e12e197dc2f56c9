//! `gpu-medic tasks`: how much GPU memory each task definition really needs. From the
//! history the daemon keeps in `state_dir` (per minute, the peak of each task definition
//! revision's containers and of the task as a whole; `crate::accounting::history`), per
//! family, revision and container: the minutes observed, the peak, the 99th percentile of the
//! per-minute peaks, the reservation (`sharingStrategy.nvidiaMps.memory`) and a suggested
//! `memory`: the peak plus `MARGIN_PERCENT`, rounded up to `ROUND_MIB` (docs/operations.md: "Sizing GPU
//! memory"). The file is only read: a line that is not a row is skipped and counted, a file
//! over the cap is read from its last `MAX_READ` bytes, both with a warning.

use std::collections::BTreeMap;

use serde::Serialize;

use super::{CliError, ConfigArg, exit, print_json};
use crate::accounting::history::{self, Row};

/// The safety margin over the observed peak, in percent.
pub const MARGIN_PERCENT: u64 = 20;
/// Suggestions are rounded up to a multiple of this many MiB.
pub const ROUND_MIB: u64 = 64;
/// The most of the history file read.
pub const MAX_READ: u64 = history::MAX_FILE_SET_ASIDE;

const MIB: u64 = 1 << 20;

#[derive(Debug, clap::Args)]
pub struct TasksArgs {
    #[command(flatten)]
    config: ConfigArg,
    #[arg(long)]
    json: bool,
    /// Only this task definition family.
    #[arg(long, value_name = "FAMILY")]
    family: Option<String>,
}

/// One family, revision and container (or the whole task) in the report.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sizing {
    pub family: String,
    pub revision: String,
    /// The container; `None` for the task as a whole (all its containers and GPUs).
    pub container: Option<String>,
    /// Minutes with a reading.
    pub minutes: usize,
    pub first_minute: String,
    pub last_minute: String,
    pub peak_mib: u64,
    pub p99_mib: u64,
    /// The reservation last seen (`None`: none, or the task definition was not read).
    pub reserved_mib: Option<u64>,
    /// Peak plus the margin, rounded up.
    pub suggested_mib: u64,
    /// The peak is over the reservation.
    pub over_reservation: bool,
    /// A container's most GPU processes at once (`None` for the whole task, or not recorded).
    pub processes: Option<u32>,
    /// A container's pinned memory limit in force last seen (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`,
    /// the largest its clients ran with), beside the reservation; `None`: not read.
    pub limit_mib: Option<u64>,
    /// The largest per-minute SM utilization (percent of a GPU's SMs, its processes summed);
    /// `None`: never read (a driver without per-process utilization, or rows of earlier
    /// builds).
    pub sm_peak_percent: Option<u32>,
    /// The 99th percentile of the per-minute SM peaks, where read.
    pub sm_p99_percent: Option<u32>,
    /// A container's active thread percentage in force last seen
    /// (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, else the MPS daemon's default).
    pub sm_limit_percent: Option<u32>,
}

#[derive(Serialize)]
struct Report<'a> {
    history: String,
    margin_percent: u64,
    round_mib: u64,
    skipped_lines: usize,
    sizes: &'a [Sizing],
}

/// The suggested `memory` (MiB) for a peak of `peak_bytes`.
pub fn suggest(peak_bytes: u64) -> u64 {
    let with_margin = peak_bytes
        .saturating_mul(100 + MARGIN_PERCENT)
        .div_ceil(100)
        .div_ceil(MIB);
    with_margin.div_ceil(ROUND_MIB).max(1) * ROUND_MIB
}

/// Nearest-rank percentile `p` of sorted values.
fn percentile(sorted: &[u64], p: u64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = (sorted.len() as u64 * p).div_ceil(100).max(1) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

fn minute_text(m: u64) -> String {
    crate::model::Timestamp(m.saturating_mul(1000)).to_string()
}

/// What the rows of one family, revision and container say.
#[derive(Default)]
struct Seen {
    /// Per minute the largest peak (a minute written twice is one minute).
    minutes: BTreeMap<u64, u64>,
    /// The reservation of the latest minute that had one, as (minute, bytes).
    reserved: Option<(u64, u64)>,
    processes: Option<u32>,
    /// The pinned limit of the latest minute that had one.
    limit: Option<(u64, u64)>,
    /// Per minute the largest SM peak, where read.
    sm: BTreeMap<u64, u32>,
    /// The thread percentage of the latest minute that had one.
    sm_limit: Option<(u64, u32)>,
}

impl Seen {
    fn take(&mut self, r: &Row) {
        let m = self.minutes.entry(r.minute).or_insert(0);
        *m = (*m).max(r.peak_bytes);
        if let Some(res) = r.reserved_bytes
            && self.reserved.is_none_or(|(at, _)| r.minute >= at)
        {
            self.reserved = Some((r.minute, res));
        }
        if let Some(p) = r.processes {
            self.processes = Some(self.processes.unwrap_or(0).max(p));
        }
        if let Some(l) = r.limit_bytes
            && self.limit.is_none_or(|(at, _)| r.minute >= at)
        {
            self.limit = Some((r.minute, l));
        }
        if let Some(p) = r.peak_sm_percent {
            let m = self.sm.entry(r.minute).or_insert(0);
            *m = (*m).max(p);
        }
        if let Some(l) = r.sm_limit_percent
            && self.sm_limit.is_none_or(|(at, _)| r.minute >= at)
        {
            self.sm_limit = Some((r.minute, l));
        }
    }
}

/// The report from history rows: one entry per family, revision and container (the task as
/// a whole first), sorted.
pub fn sizes(rows: &[Row]) -> Vec<Sizing> {
    type Key = (String, String, Option<String>);
    let mut by: BTreeMap<Key, Seen> = BTreeMap::new();
    for r in rows {
        by.entry((r.family.clone(), r.revision.clone(), r.container.clone()))
            .or_default()
            .take(r);
    }
    by.into_iter()
        .map(|((family, revision, container), seen)| {
            let mut peaks: Vec<u64> = seen.minutes.values().copied().collect();
            peaks.sort_unstable();
            let peak = peaks.last().copied().unwrap_or(0);
            let reserved = seen.reserved.map(|(_, b)| b);
            let mut sm: Vec<u64> = seen.sm.values().map(|p| u64::from(*p)).collect();
            sm.sort_unstable();
            let sm_percent = |v: u64| u32::try_from(v).ok();
            Sizing {
                family,
                revision,
                container,
                minutes: peaks.len(),
                first_minute: seen
                    .minutes
                    .keys()
                    .next()
                    .map_or_else(String::new, |m| minute_text(*m)),
                last_minute: seen
                    .minutes
                    .keys()
                    .next_back()
                    .map_or_else(String::new, |m| minute_text(*m)),
                peak_mib: peak.div_ceil(MIB),
                p99_mib: percentile(&peaks, 99).div_ceil(MIB),
                reserved_mib: reserved.map(|b| b.div_ceil(MIB)),
                suggested_mib: suggest(peak),
                over_reservation: reserved.is_some_and(|r| peak > r),
                processes: seen.processes,
                limit_mib: seen.limit.map(|(_, b)| b.div_ceil(MIB)),
                sm_peak_percent: sm.last().copied().and_then(sm_percent),
                sm_p99_percent: (!sm.is_empty())
                    .then(|| percentile(&sm, 99))
                    .and_then(sm_percent),
                sm_limit_percent: seen.sm_limit.map(|(_, p)| p),
            }
        })
        .collect()
}

pub fn run(a: TasksArgs) -> Result<i32, CliError> {
    let cfg = a.config.load()?;
    let path = cfg.files().gpu_memory_history();
    let (mut rows, skipped) = history::read_rows(&path, MAX_READ)
        .map_err(|e| CliError::Runtime(format!("{}: {e}", path.display())))?;
    if std::fs::metadata(&path).is_ok_and(|m| m.len() > MAX_READ) {
        eprintln!(
            "gpu-medic: {} is larger than {} MiB: only its last {} MiB were read",
            path.display(),
            MAX_READ >> 20,
            MAX_READ >> 20
        );
    }
    if skipped > 0 {
        eprintln!(
            "gpu-medic: {}: {skipped} line(s) are not history rows and were skipped",
            path.display()
        );
    }
    if let Some(f) = &a.family {
        rows.retain(|r| &r.family == f);
    }
    let sizes = sizes(&rows);
    if a.json {
        print_json(&Report {
            history: path.display().to_string(),
            margin_percent: MARGIN_PERCENT,
            round_mib: ROUND_MIB,
            skipped_lines: skipped,
            sizes: &sizes,
        });
        return Ok(exit::OK);
    }
    if sizes.is_empty() {
        match &a.family {
            Some(f) => println!("no GPU memory history for family {f} in {}", path.display()),
            None => println!(
                "no GPU memory history in {} yet (the daemon records tasks the ECS agent names, once a minute)",
                path.display()
            ),
        }
        return Ok(exit::OK);
    }
    print_sizes(&sizes);
    Ok(exit::OK)
}

/// The sizes as `gpu-medic tasks` prints them: a row per container (and the whole task), then
/// what each column means and the minutes the history covers.
fn print_sizes(sizes: &[Sizing]) {
    println!(
        "{:<32} {:<16} {:>7} {:>9} {:>9} {:>9} {:>9} {:>5} {:>9} {:>7} {:>6} {:>6}",
        "FAMILY:REVISION",
        "CONTAINER",
        "MINUTES",
        "PEAK MiB",
        "P99 MiB",
        "RESERVED",
        "SUGGEST",
        "PROCS",
        "LIMIT",
        "SM PEAK",
        "SM P99",
        "SM LIM"
    );
    let dash = |v: Option<u64>| v.map_or_else(|| "-".to_string(), |r| r.to_string());
    for s in sizes {
        let reserved = dash(s.reserved_mib);
        let note = if s.over_reservation {
            "  peak over reservation"
        } else {
            ""
        };
        let percent = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |p| format!("{p}%"));
        println!(
            "{:<32} {:<16} {:>7} {:>9} {:>9} {:>9} {:>9} {:>5} {:>9} {:>7} {:>6} {:>6}{note}",
            format!("{}:{}", s.family, s.revision),
            s.container.as_deref().unwrap_or("(whole task)"),
            s.minutes,
            s.peak_mib,
            s.p99_mib,
            reserved,
            s.suggested_mib,
            dash(s.processes.map(u64::from)),
            dash(s.limit_mib),
            percent(s.sm_peak_percent),
            percent(s.sm_p99_percent),
            percent(s.sm_limit_percent),
        );
    }
    println!();
    println!(
        "SUGGEST: a container's `memory` (sharingStrategy.nvidiaMps.memory, MiB) = its peak + {MARGIN_PERCENT}%, \
         rounded up to {ROUND_MIB} MiB; (whole task) is all its containers and processes together, \
         what ECS places by. PROCS: a container's most GPU processes at once; LIMIT: the pinned \
         memory limit its clients ran with (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, MiB), beside RESERVED. \
         SM PEAK and SM P99: the per-minute peaks of its processes' SM utilization (NVML's \
         process utilization samples, percent of a GPU's SMs); SM LIM: the active thread \
         percentage they ran with (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, else the MPS daemon's \
         default). Peaks are per-minute maxima of NVML's per-process usedGpuMemory from {} to {}.",
        sizes
            .iter()
            .map(|s| s.first_minute.as_str())
            .min()
            .unwrap_or(""),
        sizes
            .iter()
            .map(|s| s.last_minute.as_str())
            .max()
            .unwrap_or("")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(minute: u64, container: Option<&str>, mib: u64, reserved: Option<u64>) -> Row {
        Row {
            minute,
            family: "infer".into(),
            revision: "3".into(),
            container: container.map(str::to_string),
            peak_bytes: mib * MIB,
            reserved_bytes: reserved.map(|r| r * MIB),
            processes: container.map(|_| 1),
            limit_bytes: None,
            peak_sm_percent: container.map(|_| (mib % 100) as u32),
            sm_limit_percent: container.map(|_| 50),
        }
    }

    #[test]
    fn the_suggestion_is_the_peak_plus_the_margin_rounded_up() {
        assert_eq!(suggest(1000 * MIB), 1216, "1200 MiB rounded up to 64");
        assert_eq!(suggest(0), ROUND_MIB, "never 0: ECS's minimum is 1");
        assert_eq!(suggest(1), ROUND_MIB);
        assert_eq!(suggest(u64::MAX) % ROUND_MIB, 0, "saturates, no panic");
    }

    #[test]
    fn peaks_and_p99_come_from_the_per_minute_peaks() {
        let mut rows: Vec<Row> = (0..200)
            .map(|i| row(i * 60, Some("app"), 1000 + i, Some(4096)))
            .collect();
        rows.push(row(0, Some("app"), 5000, Some(4096))); // minute 0 written twice
        rows.push(row(60, None, 7000, None));
        let s = sizes(&rows);
        assert_eq!(s.len(), 2);
        let task = s.iter().find(|s| s.container.is_none()).unwrap();
        assert_eq!((task.peak_mib, task.reserved_mib), (7000, None));
        let app = s.iter().find(|s| s.container.is_some()).unwrap();
        assert_eq!(app.minutes, 200, "a minute written twice counts once");
        assert_eq!(app.peak_mib, 5000);
        assert_eq!(
            app.p99_mib, 1198,
            "the 198th of 200 sorted per-minute peaks"
        );
        assert_eq!(app.reserved_mib, Some(4096));
        assert!(app.over_reservation);
        assert_eq!(app.suggested_mib, suggest(5000 * MIB));
        assert_eq!(
            (app.sm_peak_percent, app.sm_limit_percent),
            (Some(99), Some(50)),
            "the largest per-minute SM peak and the limit"
        );
        assert_eq!(
            app.sm_p99_percent,
            Some(98),
            "the 198th of 200 per-minute SM peaks"
        );
        assert_eq!(task.sm_peak_percent, None, "not read: no figure");
        assert!(sizes(&[]).is_empty());
    }
}
