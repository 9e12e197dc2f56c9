//! An incident journal far over its own cap (`[journal] max_file_size_mib`, 64 MiB by
//! default), through the binary (issue 48, item 5: start under 1 s, `incidents list` under
//! 2 s): `gpu-medic run`'s start and `gpu-medic incidents list` over a state directory whose
//! `incidents.jsonl` is
//! - `small`: as a short run left it (the baseline);
//! - `sparse`: 2 GB (`BENCH_GB`), a hole of zeros, then the run's own records;
//! - `dense`: 2 GB of real records (closed incidents, ids going up), then the run's own;
//!
//! each with `state.json` present, and `sparse` and `dense` again with it lost (the start
//! rebuilds from the journal, reading each file within its cap).
//!
//! The start is timed from the spawn to the log line `gpu-medic supervisor started` (state
//! loaded or rebuilt, journals opened, the replay and the first commit done), then the daemon
//! is stopped; `incidents list` is timed to its exit, stdout to /dev/null. Each run starts
//! from the same files (a run rotates the big file away: it is put back). `BENCH_RUNS`
//! (default 5) runs per figure: min, median, max. `GPU_MEDIC_BIN=path` times another binary
//! (the tree before, for the side-by-side figures); `BENCH_TIMEOUT_S` (default 120) stops a
//! run that does not start.
//!
//! Run in the dev profile as the workspace is built: `cargo test --locked --bench
//! journal_caps` (`cargo bench` would build release).

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpu_medic_testkit::stats::{machine, median};
use gpu_medic_testkit::{bin, default_policy};

/// "min / median / max s" of `v` (seconds).
fn fig(v: &[f64]) -> String {
    if v.is_empty() {
        return "did not start".into();
    }
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(0.0, f64::max);
    format!("{min:.2} / {:.2} / {max:.2} s", median(v))
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn config(dir: &Path) -> PathBuf {
    let p = dir.join("config.toml");
    std::fs::write(
        &p,
        format!(
            "state_dir = \"{}\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n\
             [nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n\
             [node]\nenabled = false\n",
            dir.join("state").display(),
            default_policy().display()
        ),
    )
    .unwrap();
    p
}

fn command(args: &[&str], cfg: &Path) -> Command {
    let mut c = Command::new(bin());
    c.args(args)
        .arg("--config")
        .arg(cfg)
        .env_remove("GPU_MEDIC_CONFIG")
        .env_remove("JOURNAL_STREAM")
        .stdin(Stdio::null());
    c
}

/// Starts `run`, waits for its start's end in the log, stops it: the start's wall time, or
/// `None` past the timeout.
fn start(cfg: &Path, log: &Path, timeout: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    let mut child = command(&["run", "--log-format", "json"], cfg)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    let started = loop {
        if std::fs::read_to_string(log)
            .unwrap_or_default()
            .contains("gpu-medic supervisor started")
        {
            break Some(t0.elapsed());
        }
        if t0.elapsed() > timeout || child.try_wait().unwrap().is_some() {
            break None;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();
    started
}

/// `incidents list`'s wall time and what it said it skipped.
fn list(cfg: &Path) -> (Duration, String) {
    let t0 = Instant::now();
    let out = command(&["incidents", "list"], cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    (
        t0.elapsed(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The files a run starts from: `state.json`, `inputs.jsonl` (put back with it: an input
/// journal ahead of the state is a crash's, which the start replays) and the small journal.
struct Seed {
    state: Vec<u8>,
    inputs: Vec<u8>,
    journal: Vec<u8>,
}

/// A state directory as a short run leaves it: the daemon started once with a launch gate's
/// report to journal.
fn seed(dir: &Path, cfg: &Path) -> Seed {
    let requests = dir.join("state/requests");
    std::fs::create_dir_all(&requests).unwrap();
    let req = requests.join("0001-1.json");
    std::fs::write(
        &req,
        r#"{"request":"launch-gate","health":"healthy","summary":"bench"}"#,
    )
    .unwrap();
    let log = dir.join("seed.log");
    let mut child = command(&["run", "--log-format", "json"], cfg)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while req.exists() && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    child.wait().unwrap();
    Seed {
        state: std::fs::read(dir.join("state/state.json")).unwrap(),
        inputs: std::fs::read(dir.join("state/inputs.jsonl")).unwrap(),
        journal: std::fs::read(dir.join("state/incidents.jsonl")).unwrap(),
    }
}

/// Writes the big journal of `kind` at `path`, ending with `tail`.
fn big(path: &Path, kind: &str, bytes: u64, tail: &[u8]) {
    let f = std::fs::File::create(path).unwrap();
    match kind {
        "sparse" => f.set_len(bytes).unwrap(),
        _ => {
            let mut w = std::io::BufWriter::with_capacity(1 << 20, f);
            let (mut n, mut id) = (0u64, 1_000u64);
            while n < bytes {
                let line = format!(
                    r#"{{"at":"2026-12-01T00:00:00.000Z","incident":{id},"event":"closed","state":"logged","summary":"a logged XID 13 closed long ago"}}"#
                );
                writeln!(w, "{line}").unwrap();
                n += line.len() as u64 + 1;
                id += 1;
            }
            w.flush().unwrap();
        }
    }
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(b"\n").unwrap();
    f.write_all(tail).unwrap();
}

/// Puts the state directory back as the scenario starts: the big journal (or the small one)
/// live, no rotated file, `state.json` as seeded or lost.
fn reset(dir: &Path, journal: &Path, with_state: bool, seed: &Seed) {
    let s = dir.join("state");
    let live = s.join("incidents.jsonl");
    for n in 1..=8 {
        let rotated = s.join(format!("incidents.jsonl.{n}"));
        if rotated.exists() && std::fs::metadata(&rotated).unwrap().len() > 1 << 30 {
            std::fs::rename(&rotated, journal).unwrap();
        }
        let _ = std::fs::remove_file(&rotated);
        let _ = std::fs::remove_file(s.join(format!("inputs.jsonl.{n}")));
    }
    if journal == live {
        // The small journal: as seeded, not grown by the runs before.
        std::fs::write(&live, &seed.journal).unwrap();
    } else {
        let _ = std::fs::remove_file(&live);
        std::fs::rename(journal, &live).unwrap();
    }
    for e in std::fs::read_dir(&s).unwrap().filter_map(Result::ok) {
        if e.file_name().to_string_lossy().starts_with("state.json") {
            std::fs::remove_file(e.path()).unwrap();
        }
    }
    std::fs::write(s.join("inputs.jsonl"), &seed.inputs).unwrap();
    if with_state {
        std::fs::write(s.join("state.json"), &seed.state).unwrap();
    }
}

fn main() {
    // `cargo test --bench` passes the test harness's arguments; none are ours.
    let runs = env_u64("BENCH_RUNS", 5);
    let bytes = env_u64("BENCH_GB", 2) * 1_000_000_000;
    let timeout = Duration::from_secs(env_u64("BENCH_TIMEOUT_S", 120));
    println!("journal_caps: {} ({})", bin().display(), machine());
    let dir = tempfile::Builder::new()
        .prefix("gm-journal-caps-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let cfg = config(dir.path());
    let seeded = seed(dir.path(), &cfg);
    let live = dir.path().join("state/incidents.jsonl");
    let parked = dir.path().join("big.jsonl");
    println!(
        "| journal | state.json | run: started (min / median / max) | incidents list | what the list said |"
    );
    println!("|---|---|---|---|---|");
    for kind in ["small", "sparse", "dense"] {
        if kind == "small" {
            std::fs::write(&live, &seeded.journal).unwrap();
        } else {
            big(&parked, kind, bytes, &seeded.journal);
        }
        let journal = if kind == "small" { &live } else { &parked };
        for with_state in [true, false] {
            if kind == "small" && !with_state {
                continue;
            }
            let (mut starts, mut lists, mut said) = (Vec::new(), Vec::new(), String::new());
            for r in 0..runs {
                reset(dir.path(), journal, with_state, &seeded);
                let (t, err) = list(&cfg);
                lists.push(t.as_secs_f64());
                said = err.lines().next().unwrap_or("").chars().take(160).collect();
                match start(&cfg, &dir.path().join(format!("{kind}-{r}.log")), timeout) {
                    Some(t) => starts.push(t.as_secs_f64()),
                    None => println!("{kind}: run {r} did not start within {timeout:?}"),
                }
                // The run rotated the big file away: park it again for the next run.
                if kind != "small" {
                    let s = dir.path().join("state");
                    let rotated = s.join("incidents.jsonl.1");
                    let from = if rotated.exists()
                        && std::fs::metadata(&rotated).unwrap().len() > 1 << 30
                    {
                        rotated
                    } else {
                        live.clone()
                    };
                    std::fs::rename(from, &parked).unwrap();
                }
            }
            println!(
                "| {kind} | {} | {} | {} | {} |",
                if with_state { "present" } else { "lost" },
                fig(&starts),
                fig(&lists),
                if said.is_empty() { "-".into() } else { said }
            );
        }
        if kind != "small" {
            let _ = std::fs::remove_file(&parked);
        }
    }
}
