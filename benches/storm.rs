//! An XID storm through the real `gpu-medic run` binary (issues 13 and 26): thousands of
//! distinct XIDs arrive at once or as a stream, with XID 79s among them. Measured: how long
//! after it was handed over each 79 is decided (the stamp of the incident record that carries
//! it), when the storm is absorbed (the process's CPU use falls back to idle), the CPU time
//! the storm cost (also per 1,000 storm signals), the process's peak RSS (`VmHWM`) and the
//! size of `state.json` after it. Run with `scripts/bench.sh storm` (release build).
//!
//! `BENCH_ONLY` picks the scenarios (comma-separated, default `gap`):
//! - `gap`: `BENCH_STORM` (default 3000) distinct XIDs, codes no rule names, on 4 GPUs, in one
//!   write to the kernel log, then an XID 79 one second later;
//! - `same`: the same storm with the 79 at the end of the same write;
//! - `nvml-gap`, `nvml`: the same two through NVML events (one injection file of the fake
//!   libnvidia-ml holding the whole storm; the 79 one second later in a file of its own, or
//!   last in the same file);
//! - `sustained`: `BENCH_RATE` (default 10000) distinct XIDs a second for `BENCH_SECONDS`
//!   (default 60) through the kernel log (`BENCH_SOURCE=nvml`: through NVML events), in
//!   writes every 10 ms, on 8 GPUs, with an XID 79 on a GPU of its own every
//!   `BENCH_EVERY_S` (default 9) seconds, last in its write.
//!
//! `BENCH_RUNS` (default 1) runs each one-shot scenario that many times, each on a fresh
//! daemon; the 79's latency is summarised over all runs. The kernel log is a regular file
//! the bench appends to (the reader follows it like `/dev/kmsg`). `GPU_MEDIC_BIN=path` runs
//! another gpu-medic binary (an older release, for the side-by-side figure in BENCHMARKS.md;
//! `BENCH_POLICY=path` then gives it the policy of its own tree); `BENCH_TIMEOUT_S` (default
//! 900) bounds the wait for a 79.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use gpu_medic_testkit::proc::{clk_tck, cpu_ticks, status_field};
use gpu_medic_testkit::stats::{machine, summary};
use gpu_medic_testkit::{Daemon, default_policy, fake_nvml, gpus_json, now_ms, parse_at};

/// PCI buses of the fake library's default GPUs 0-7 (tests/fake-nvml/src/identity.rs).
const BUSES: [u32; 8] = [0x1B, 0x29, 0x43, 0x52, 0x9D, 0xC3, 0xD1, 0xDF];

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds (user + system) the process has used.
fn cpu_s(pid: u32) -> f64 {
    cpu_ticks(pid).map_or(0.0, |t| t.own as f64) / clk_tck()
}

/// Reads the lines appended to a file since the last call.
#[derive(Default)]
struct Follow {
    offset: u64,
    pending: String,
    /// Complete lines read but not yet looked at (a search stops at its match; the lines
    /// after it are the next search's).
    lines: std::collections::VecDeque<String>,
}

impl Follow {
    /// The next complete line, reading what was appended since the last call when none is
    /// waiting.
    fn next_line(&mut self, path: &Path) -> Option<String> {
        if self.lines.is_empty()
            && let Ok(mut f) = std::fs::File::open(path)
        {
            let _ = f.seek(SeekFrom::Start(self.offset));
            let mut buf = String::new();
            if let Ok(n) = f.read_to_string(&mut buf) {
                self.offset += n as u64;
                self.pending.push_str(&buf);
            }
            while let Some(i) = self.pending.find('\n') {
                self.lines.push_back(self.pending.drain(..=i).collect());
            }
        }
        self.lines.pop_front()
    }
}

/// The `at` stamp (ms) of the first line of `path` that `pred` accepts, following the file
/// until `deadline`.
fn stamp_of(path: &Path, deadline: Instant, pred: impl Fn(&str) -> bool) -> Option<f64> {
    stamp_after(&mut Follow::default(), path, deadline, pred)
}

/// [`stamp_of`] from where `follow` stopped.
fn stamp_after(
    follow: &mut Follow,
    path: &Path,
    deadline: Instant,
    pred: impl Fn(&str) -> bool,
) -> Option<f64> {
    loop {
        while let Some(line) = follow.next_line(path) {
            if pred(&line) {
                let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
                return parse_at(v["at"].as_str()?);
            }
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn append(path: &Path, text: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

/// Where the storm comes from.
#[derive(Clone, Copy, PartialEq)]
enum Feed {
    Kmsg,
    Nvml,
}

/// One storm XID `i` (code `100_000 + i`, no rule names it) on one of the first `gpus` GPUs:
/// its kernel log record (sequence `100 + i`), or its injection object for the fake library.
fn storm_xid(feed: Feed, i: u64, gpus: u64) -> String {
    let gpu = i % gpus;
    match feed {
        Feed::Kmsg => format!(
            "4,{},{},-;NVRM: Xid (PCI:0000:{:02x}:00): {}, pid={i}, name=app, storm\n",
            100 + i,
            1_000_000 + i,
            BUSES[gpu as usize],
            100_000 + i
        ),
        Feed::Nvml => format!("{{\"gpu\":{gpu},\"xid\":{}}}", 100_000 + i),
    }
}

/// An XID 79 on `gpu` whose kernel log text carries `mark`, as record `seq`. Through NVML the
/// event carries only the code.
fn xid79(feed: Feed, seq: u64, gpu: usize, mark: &str) -> String {
    match feed {
        Feed::Kmsg => format!(
            "4,{},{},-;NVRM: Xid (PCI:0000:{:02x}:00): 79, pid=1, name=train, GPU has fallen off the bus. {mark}\n",
            100 + seq,
            1_000_000 + seq,
            BUSES[gpu]
        ),
        Feed::Nvml => format!("{{\"gpu\":{gpu},\"xid\":79}}"),
    }
}

/// Hands one write to the daemon: appended to the kernel log, or one injection file holding
/// every object.
fn deliver(d: &mut Daemon, feed: Feed, items: &[String]) {
    match feed {
        Feed::Kmsg => append(&d.path("kmsg"), &items.concat()),
        Feed::Nvml => d.inject(&format!("[{}]", items.join(","))),
    }
}

fn daemon(gpus: usize) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{}\"\n[nvml]\nlibrary = \"{}\"\nkmsg = \"{}\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
        std::env::var("BENCH_POLICY")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|_| default_policy())
            .display(),
        fake_nvml().display(),
        dir.path().join("kmsg").display()
    );
    let mut d = Daemon::in_temp(dir, &config);
    std::fs::write(d.path("kmsg"), "").unwrap();
    d.env("RUST_LOG", "error");
    // The daemon's own cost: the fake does not count its polls (a file append each).
    d.env_remove("FAKE_NVML_POLLS");
    if gpus != 4 {
        d.gpus(&gpus_json(gpus));
    }
    d.start();
    std::thread::sleep(Duration::from_millis(2000));
    d
}

/// Whether an incident journal line carries an XID 79 (and `mark`, where the text has one).
fn is_79(line: &str, mark: Option<&str>) -> bool {
    line.contains("\"code\":79") && mark.is_none_or(|m| line.contains(m))
}

/// Waits until the process used under 2 % of a core for a whole second; returns when that
/// second began, after `since`.
fn absorbed(pid: u32, since: Instant, limit: Duration) -> Option<Duration> {
    let mut last = (Instant::now(), cpu_s(pid));
    while since.elapsed() < limit {
        std::thread::sleep(Duration::from_secs(1));
        let now = (Instant::now(), cpu_s(pid));
        let rate = (now.1 - last.1) / now.0.duration_since(last.0).as_secs_f64();
        if rate < 0.02 {
            return Some(last.0.duration_since(since));
        }
        last = now;
    }
    None
}

/// What one run measured.
struct Run {
    /// Storm signals handed over (the 79s not counted).
    storm: u64,
    latencies_ms: Vec<f64>,
    /// Through NVML, the same from when the fake library had queued the events (it deletes
    /// the injection file then): without the library's own parsing of the file.
    queued_ms: Vec<f64>,
    missed: usize,
    last_stepped_s: Option<f64>,
    absorbed_s: Option<f64>,
    storm_cpu_s: f64,
    idle_rate: f64,
    hwm_kib: u64,
    opened: usize,
    state_bytes: u64,
}

/// The storm in one write (through `feed`), the 79 last in it (`gap` false) or a second
/// later.
fn one_shot(feed: Feed, storm: u64, gap: bool, timeout: Duration) -> Run {
    let mut d = daemon(4);
    let pid = d.pid().unwrap();
    let cpu_before = cpu_s(pid);
    let mut items: Vec<String> = (0..storm).map(|i| storm_xid(feed, i, 4)).collect();
    let t_storm = Instant::now();
    let t_storm_ms = now_ms();
    let t79;
    if gap {
        deliver(&mut d, feed, &items);
        std::thread::sleep(Duration::from_secs(1));
        t79 = now_ms();
        deliver(&mut d, feed, &[xid79(feed, storm, 1, "mark-0")]);
    } else {
        items.push(xid79(feed, storm, 1, "mark-0"));
        t79 = now_ms();
        deliver(&mut d, feed, &items);
    }
    let queued = (feed == Feed::Nvml && !gap).then(|| applied_at(d.path("inject")));
    drop(items);
    let deadline = Instant::now() + timeout;
    let journal = d.path("state/incidents.jsonl");
    let decided_at = stamp_of(&journal, deadline, |l| is_79(l, None));
    let last = format!("\"code\":{}", 100_000 + storm - 1);
    let last_at = stamp_of(&d.path("state/inputs.jsonl"), deadline, |l| {
        l.contains(&last)
    });
    let absorbed = absorbed(pid, t_storm, timeout + Duration::from_secs(60));
    let queued_at = queued.and_then(|t| t.join().ok().flatten());
    let mut run = finish(
        &mut d,
        pid,
        storm,
        cpu_before,
        decided_at.map(|at| at - t79).into_iter().collect(),
        usize::from(decided_at.is_none()),
        last_at.map(|at| (at - t_storm_ms) / 1000.0),
        absorbed,
    );
    run.queued_ms = decided_at
        .zip(queued_at)
        .map(|(at, q)| at - q)
        .into_iter()
        .collect();
    run
}

/// When the fake library had applied (and so deleted) every injection file in `dir`, in the
/// clock of [`now_ms`], looked at every millisecond for up to 120 s.
fn applied_at(dir: std::path::PathBuf) -> std::thread::JoinHandle<Option<f64>> {
    std::thread::spawn(move || {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(120) {
            let pending = std::fs::read_dir(&dir).map_or(0, |entries| {
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
                    .count()
            });
            if pending == 0 {
                return Some(now_ms());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        None
    })
}

/// `rate` distinct XIDs a second for `seconds`, in writes every 10 ms, with an XID 79 on a
/// GPU of its own every `every` seconds, last in its write.
fn sustained(feed: Feed, rate: u64, seconds: u64, every: u64, timeout: Duration) -> Run {
    const GPUS: usize = 8;
    let mut d = daemon(GPUS);
    let pid = d.pid().unwrap();
    let cpu_before = cpu_s(pid);
    let per_write = (rate / 100).max(1);
    let writes = seconds * 100;
    let t_storm = Instant::now();
    let mut next = 0u64;
    let mut marks: Vec<(String, f64)> = Vec::new();
    let every_writes = (every * 100).max(1);
    for w in 0..writes {
        let due = t_storm + Duration::from_millis(10 * w);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        // Storm XIDs on GPUs 0 and 1; each 79 on a GPU of its own from 2 on.
        let mut items: Vec<String> = (0..per_write)
            .map(|k| storm_xid(feed, next + k, 2))
            .collect();
        next += per_write;
        let with_79 = w % every_writes == every_writes / 2 && marks.len() < GPUS - 2;
        if with_79 {
            let mark = format!("mark-{}", marks.len());
            items.push(xid79(feed, next, 2 + marks.len(), &mark));
            next += 1;
            marks.push((mark, now_ms()));
        }
        deliver(&mut d, feed, &items);
    }
    let storm = next - marks.len() as u64;
    let deadline = Instant::now() + timeout;
    let journal = d.path("state/incidents.jsonl");
    let mut latencies = Vec::new();
    let mut follow = Follow::default();
    // Through NVML a 79 carries no text: the k-th 79 record is the k-th 79 (each on a GPU of
    // its own, so each opens an incident or joins one as a new signal).
    for (mark, t) in &marks {
        let m = (feed == Feed::Kmsg).then_some(mark.as_str());
        match stamp_after(&mut follow, &journal, deadline, |l| is_79(l, m)) {
            Some(at) => latencies.push(at - t),
            None => break,
        }
    }
    let missed = marks.len() - latencies.len();
    let absorbed = absorbed(pid, t_storm, Duration::from_secs(seconds) + timeout);
    finish(
        &mut d, pid, storm, cpu_before, latencies, missed, None, absorbed,
    )
}

#[allow(clippy::too_many_arguments)]
fn finish(
    d: &mut Daemon,
    pid: u32,
    storm: u64,
    cpu_before: f64,
    latencies_ms: Vec<f64>,
    missed: usize,
    last_stepped_s: Option<f64>,
    absorbed: Option<Duration>,
) -> Run {
    let storm_cpu_s = cpu_s(pid) - cpu_before;
    let c0 = cpu_s(pid);
    std::thread::sleep(Duration::from_secs(5));
    let idle_rate = (cpu_s(pid) - c0) / 5.0;
    let hwm_kib = status_field(pid, "VmHWM").unwrap_or(0);
    let opened = std::fs::read_to_string(d.path("state/incidents.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"opened\""))
        .count();
    let state_bytes = std::fs::metadata(d.path("state/state.json"))
        .map(|m| m.len())
        .unwrap_or(0);
    d.stop(Duration::from_secs(25));
    Run {
        storm,
        latencies_ms,
        queued_ms: Vec::new(),
        missed,
        last_stepped_s,
        absorbed_s: absorbed.map(|a| a.as_secs_f64()),
        storm_cpu_s,
        idle_rate,
        hwm_kib,
        opened,
        state_bytes,
    }
}

fn report(title: &str, runs: &[Run]) {
    println!("{title} ({})", gpu_medic_testkit::bin().display());
    let lat: Vec<f64> = runs.iter().flat_map(|r| r.latencies_ms.clone()).collect();
    let missed: usize = runs.iter().map(|r| r.missed).sum();
    println!(
        "  XID 79 decided after it was handed over: {}",
        summary(&lat)
    );
    let queued: Vec<f64> = runs.iter().flat_map(|r| r.queued_ms.clone()).collect();
    if !queued.is_empty() {
        println!(
            "  XID 79 decided after the fake library had queued the events: {}",
            summary(&queued)
        );
    }
    if missed > 0 {
        println!("  XID 79s not decided within the wait: {missed}");
    }
    for (k, r) in runs.iter().enumerate() {
        let ms_per_1000 = r.storm_cpu_s * 1e6 / r.storm.max(1) as f64;
        println!(
            "  run {k}: 79s {:?} ms; last storm XID stepped {}; absorbed {}; CPU {:.2} s ({:.0} ms per 1,000 storm signals), afterwards {:.1} % of a core; peak RSS (VmHWM) {:.1} MiB; opened {}; state.json {} bytes",
            r.latencies_ms.iter().map(|l| l.round()).collect::<Vec<_>>(),
            r.last_stepped_s.map_or("-".into(), |s| format!(
                "{s:.2} s after the storm was written"
            )),
            r.absorbed_s
                .map_or("not within the wait".into(), |s| format!(
                    "{s:.1} s after the storm began"
                )),
            r.storm_cpu_s,
            ms_per_1000,
            r.idle_rate * 100.0,
            r.hwm_kib as f64 / 1024.0,
            r.opened,
            r.state_bytes
        );
    }
}

fn main() {
    let storm: u64 = env_or("BENCH_STORM", 3000);
    let runs: usize = env_or("BENCH_RUNS", 1);
    let timeout = Duration::from_secs(env_or("BENCH_TIMEOUT_S", 900));
    let only = std::env::var("BENCH_ONLY").unwrap_or_else(|_| "gap".into());
    println!("machine: {}", machine());
    for mode in only.split(',').map(str::trim) {
        let (feed, gap, what) = match mode {
            "gap" => (Feed::Kmsg, true, "kernel log, an XID 79 one second later"),
            "same" => (
                Feed::Kmsg,
                false,
                "kernel log, the XID 79 last in the same write",
            ),
            "nvml-gap" => (Feed::Nvml, true, "NVML events, an XID 79 one second later"),
            "nvml" => (
                Feed::Nvml,
                false,
                "NVML events, the XID 79 last in the same batch",
            ),
            "sustained" => {
                let rate: u64 = env_or("BENCH_RATE", 10_000);
                let seconds: u64 = env_or("BENCH_SECONDS", 60);
                let every: u64 = env_or("BENCH_EVERY_S", 9);
                let feed = match std::env::var("BENCH_SOURCE").as_deref() {
                    Ok("nvml") => Feed::Nvml,
                    _ => Feed::Kmsg,
                };
                let r = sustained(feed, rate, seconds, every, timeout);
                let n = r.storm;
                report(
                    &format!(
                        "XID storm, sustained: {rate} distinct XIDs a second for {seconds} s ({n} in all) through {}, an XID 79 every {every} s",
                        if feed == Feed::Kmsg {
                            "the kernel log"
                        } else {
                            "NVML events"
                        }
                    ),
                    &[r],
                );
                continue;
            }
            other => panic!(
                "BENCH_ONLY: unknown scenario {other:?} (gap, same, nvml-gap, nvml, sustained)"
            ),
        };
        let results: Vec<Run> = (0..runs)
            .map(|_| one_shot(feed, storm, gap, timeout))
            .collect();
        report(
            &format!("XID storm: {storm} distinct XIDs at once through the {what}"),
            &results,
        );
    }
}
