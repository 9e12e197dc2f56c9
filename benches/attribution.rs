//! What charging an application XID to its program costs (issue 36, docs/attribution.md):
//!
//! - `cost`: `probe::attribution::Attributor::context` per XID line, in process: the first
//!   XID of a process (a `stat` of `/proc/<pid>`, its `comm` and cgroup read) and every later
//!   one (the `stat` only), against the same XID with no program to name (code 79: the line's
//!   place and cause are still decoded). `BENCH_XIDS` (default 10000) lines per round.
//! - `storm`: through the real `gpu-medic run` binary (fake libnvidia-ml, a kernel-log file):
//!   one program raises `BENCH_XIDS` XID 13s on GPU 0 in one write with an XID 79 on GPU 3 at
//!   its end; measured: how long after the write the 79 is decided (the stamp of its incident
//!   record), and how many incidents the storm opened (one); then the same storm with lines
//!   that name no process, the floor. `BENCH_RUNS` (default 3) runs each.
//!
//! `BENCH_ONLY=cost` or `storm` picks one. Dev profile: `cargo test --locked --bench
//! attribution` (`GPU_MEDIC_BIN=path` runs another binary for the storm).

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed bench

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use gpu_medic::probe::attribution::Attributor;
use gpu_medic_testkit::stats::{machine, summary};
use gpu_medic_testkit::{Daemon, FOUR_GPUS, now_ms, parse_at, wait_sync};

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn per_call_us(n: usize, mut f: impl FnMut(usize)) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let t = Instant::now();
            f(i);
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect()
}

/// Microseconds as the kit's summary prints milliseconds.
fn us(v: &[f64]) -> String {
    summary(v).replace(" ms", " us")
}

fn cost(n: usize) {
    let me = std::process::id();
    let comm = std::fs::read_to_string(format!("/proc/{me}/comm")).unwrap();
    // Stamped now (after this process started), by the driver's format.
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let usec = (uptime * 1e6) as u64;
    let line = |code: u32| {
        gpu_medic::probe::kmsg::parse_line(&format!(
            "4,1,{usec},-;NVRM: Xid (PCI:0000:10:00): {code}, pid={me}, name={}, Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address",
            comm.trim()
        ))
        .unwrap()
    };
    let (x13, x79) = (line(13), line(79));
    let mut first = Vec::new();
    for _ in 0..200 {
        let mut a = Attributor::new(Path::new("/proc"), None);
        let t = Instant::now();
        std::hint::black_box(a.context(&x13, None, None));
        first.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut a = Attributor::new(Path::new("/proc"), None);
    a.context(&x13, None, None);
    let cached = per_call_us(n, |_| {
        std::hint::black_box(a.context(&x13, None, None));
    });
    let none = per_call_us(n, |_| {
        std::hint::black_box(a.context(&x79, None, None));
    });
    println!("attribution per XID line ({n} lines):");
    println!(
        "  first XID of a process (stat, comm, cgroup): {}",
        us(&first)
    );
    println!(
        "  every later one (stat only):                 {}",
        us(&cached)
    );
    println!(
        "  an XID charged to no program (79):           {}",
        us(&none)
    );
    println!(
        "  cgroup reads for {} XIDs of one process:     {}",
        n + 1,
        a.reads
    );
}

/// `named`: the line names its process (the storm is charged to it); else it names none, the
/// floor the attribution is compared with.
fn xid_line(seq: u64, bus: &str, code: u32, text: &str, named: bool) -> String {
    let who = if named {
        "pid=4200000, name=storm, "
    } else {
        ""
    };
    format!(
        "4,{seq},{},-;NVRM: Xid (PCI:{bus}): {code}, {who}{text}",
        seq * 1000
    )
}

fn storm(n: usize, runs: usize, named: bool) {
    let mut latency = Vec::new();
    for run in 0..runs {
        let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"1s\"");
        d.gpus(FOUR_GPUS);
        if let Ok(bin) = std::env::var("GPU_MEDIC_BIN") {
            d.binary(bin.into());
        }
        d.start();
        d.wait_polled();
        let mut text = String::new();
        for i in 0..n as u64 {
            let place = format!(
                "Graphics SM Warp Exception on (GPC {}, TPC {}, SM 0): Out Of Range Address",
                i % 8,
                i % 9
            );
            text.push_str(&xid_line(1 + i, "0000:10:00", 13, &place, named));
            text.push('\n');
        }
        text.push_str(&xid_line(
            n as u64 + 10,
            "0000:40:00",
            79,
            "GPU has fallen off the bus.",
            false,
        ));
        text.push('\n');
        let before = now_ms();
        std::fs::OpenOptions::new()
            .append(true)
            .open(d.path("kmsg"))
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        let r = d.wait_record("the XID 79", Duration::from_secs(300), "opened", |r| {
            r["observation"]["signal"]["code"] == 79
        });
        latency.push(parse_at(r["at"].as_str().unwrap()).unwrap() - before);
        wait_sync(
            "the storm journaled",
            Duration::from_secs(300),
            || {
                std::fs::read_to_string(d.path("state/inputs.jsonl"))
                    .unwrap_or_default()
                    .lines()
                    .count()
                    > n
            },
            || d.log(),
        );
        let incidents = gpu_medic_testkit::journal::events(&d.records(), "opened")
            .iter()
            .filter(|r| r["observation"]["xid"]["culprit"]["program"] == "storm")
            .count();
        println!(
            "  run {run}: XID 79 decided {:.0} ms after the write; the storm opened {incidents} incident(s)",
            latency[run]
        );
        d.signal(libc::SIGTERM);
    }
    let whose = if named {
        "one program"
    } else {
        "no program named (floor)"
    };
    println!(
        "XID 79 after {n} XID 13 of {whose}, same write: {}",
        summary(&latency)
    );
}

fn main() {
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    let n: usize = env_or("BENCH_XIDS", 10_000);
    println!("{}", machine());
    if only.is_empty() || only == "cost" {
        cost(n);
    }
    if only.is_empty() || only == "storm" {
        storm(n, env_or("BENCH_RUNS", 3), true);
        storm(n, env_or("BENCH_RUNS", 3), false);
    }
}
