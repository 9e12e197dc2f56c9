//! `gpu-medic incidents list` on a large journal (issue 26 item 6: "streams 100,000
//! incidents in seconds"), through the binary: a journal of N incidents is written to a
//! state directory (`incidents.jsonl`, one file), then `incidents list`, `incidents list
//! --open` and `incidents list --json` are run `BENCH_RUNS` times each (default 5), their
//! stdout to a file. Per command: wall time median and p99 (over so few runs, p99 is the
//! slowest), peak RSS of the child (`ru_maxrss` from `wait4`), rows printed.
//!
//! Journals: `closed` (each incident opened by an XID 13 and closed `logged` after the next
//! one opens: what a node's journal holds) and `open` (every incident still open: the case
//! that ran past 60 s, each record past the 4,096th scanned every pending incident), at
//! `BENCH_SIZES` incidents (default 10000,100000). A run past `BENCH_TIMEOUT_S` (default
//! 300) is killed and reported as such.
//!
//! `GPU_MEDIC_BIN=path` runs another gpu-medic binary (an older build, for before/after).
//! Run with `cargo bench --bench incidents_list` (release), or, in the dev profile, build it
//! with the other targets (`cargo build --workspace --all-targets --locked`) and run
//! `target/debug/deps/incidents_list-*` (or `cargo test --bench incidents_list`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpu_medic::model::{
    GpuId, IncidentEvent, IncidentId, IncidentState, Observation, Record, Signal, Timestamp,
    Verdict,
};
use gpu_medic_testkit::stats::{machine, percentile};

/// Incident `i`'s record of `event`, `offset_ms` into its second.
fn record(i: u64, offset_ms: u64, event: IncidentEvent) -> Record {
    Record {
        at: Timestamp(1_780_000_000_000 + offset_ms + i * 1000),
        incident: IncidentId(i),
        drill: None,
        event,
    }
}

fn opened(i: u64) -> Record {
    record(
        i,
        0,
        IncidentEvent::Opened {
            observation: Observation::new(Signal::xid(13))
                .on_gpu(GpuId::index_only((i % 8) as u32))
                .with_detail("Graphics Engine Exception"),
            rule: "xid-13".into(),
            reason: "XID 13: an application fault; logged".into(),
            verdict: Verdict::Log,
        },
    )
}

fn closed(i: u64) -> Record {
    record(
        i,
        500,
        IncidentEvent::Closed {
            state: IncidentState::Logged,
            summary: "logged".into(),
        },
    )
}

/// Writes a state directory with a journal of `n` incidents; returns its config file.
fn journal(dir: &Path, n: u64, open: bool) -> std::path::PathBuf {
    let state = dir.join("state");
    std::fs::create_dir_all(&state).unwrap();
    let mut w =
        std::io::BufWriter::new(std::fs::File::create(state.join("incidents.jsonl")).unwrap());
    for i in 1..=n {
        serde_json::to_writer(&mut w, &opened(i)).unwrap();
        w.write_all(b"\n").unwrap();
        if !open && i > 1 {
            serde_json::to_writer(&mut w, &closed(i - 1)).unwrap();
            w.write_all(b"\n").unwrap();
        }
    }
    if !open {
        serde_json::to_writer(&mut w, &closed(n)).unwrap();
        w.write_all(b"\n").unwrap();
    }
    w.flush().unwrap();
    let cfg = dir.join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"{}\"\npolicy = \"{}\"\n[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
            state.display(),
            gpu_medic_testkit::default_policy().display()
        ),
    )
    .unwrap();
    cfg
}

/// One run: wall time, peak RSS in KiB, rows printed; None when killed at the timeout.
fn run(
    bin: &Path,
    args: &[&str],
    cfg: &Path,
    out: &Path,
    timeout: Duration,
) -> Option<(f64, u64, usize)> {
    let t = Instant::now();
    // Reaped by wait4 below, which also gives its peak RSS (std's wait does not).
    #[allow(clippy::zombie_processes)]
    let child = Command::new(bin)
        .args(args)
        .arg("--config")
        .arg(cfg)
        .env_remove("GPU_MEDIC_CONFIG")
        .stdout(Stdio::from(std::fs::File::create(out).unwrap()))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: waiting for our own child, with valid pointers to locals.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        if r == pid {
            break;
        }
        if t.elapsed() > timeout {
            // SAFETY: killing and reaping our own child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::wait4(pid, &mut status, 0, &mut usage);
            }
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let wall = t.elapsed().as_secs_f64();
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{args:?}: exit {status}"
    );
    let rows = std::fs::read_to_string(out).unwrap().lines().count();
    Some((wall, usage.ru_maxrss as u64, rows))
}

fn main() {
    let env = |k: &str, d: &str| std::env::var(k).unwrap_or_else(|_| d.to_string());
    let runs: usize = env("BENCH_RUNS", "5").parse().unwrap();
    let timeout = Duration::from_secs(env("BENCH_TIMEOUT_S", "300").parse().unwrap());
    let sizes: Vec<u64> = env("BENCH_SIZES", "10000,100000")
        .split(',')
        .map(|s| s.trim().parse().unwrap())
        .collect();
    let bin = gpu_medic_testkit::bin();
    println!("{}", machine());
    println!("binary: {}", bin.display());
    println!("| journal | command | runs | median | p99 | peak RSS | rows |");
    println!("|---|---|---|---|---|---|---|");
    for &n in &sizes {
        for open in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let cfg = journal(dir.path(), n, open);
            let size = std::fs::metadata(dir.path().join("state/incidents.jsonl"))
                .unwrap()
                .len();
            let out = dir.path().join("out");
            for args in [
                &["incidents", "list"][..],
                &["incidents", "list", "--open"][..],
                &["incidents", "list", "--json"][..],
            ] {
                let mut wall = Vec::new();
                let mut rss = 0;
                let mut rows = 0;
                let mut killed = false;
                for _ in 0..runs {
                    match run(&bin, args, &cfg, &out, timeout) {
                        Some((w, r, n)) => {
                            wall.push(w);
                            rss = rss.max(r);
                            rows = n;
                        }
                        None => {
                            killed = true;
                            break;
                        }
                    }
                }
                let journal = format!(
                    "{n} incidents, {} ({:.1} MB)",
                    if open { "all open" } else { "closed" },
                    size as f64 / 1e6
                );
                if killed {
                    println!(
                        "| {journal} | `{}` | {} | killed after {} s | | | |",
                        args.join(" "),
                        wall.len() + 1,
                        timeout.as_secs()
                    );
                    continue;
                }
                wall.sort_by(|a, b| a.partial_cmp(b).unwrap());
                println!(
                    "| {journal} | `{}` | {runs} | {:.2} s | {:.2} s | {:.1} MiB | {rows} |",
                    args.join(" "),
                    percentile(&wall, 0.5),
                    percentile(&wall, 0.99),
                    rss as f64 / 1024.0,
                );
            }
        }
    }
}
