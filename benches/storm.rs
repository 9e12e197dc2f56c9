//! An XID storm through the real `gpu-medic run` binary (issue 13, item 3): thousands of
//! distinct XIDs land in the kernel log at once, then, a second later, an XID 79. Measured:
//! how long after it was written the 79 is decided (its `opened` record's stamp), when the
//! storm is absorbed (the process's CPU use falls back to idle), the CPU time the storm cost,
//! and the size of `state.json` after it. Run with `scripts/bench.sh storm` (release build).
//!
//! `BENCH_STORM` (default 3000) distinct XIDs, codes no rule names, on 4 GPUs; the kernel log
//! is a regular file the bench appends to (the reader follows it like `/dev/kmsg`).
//! `GPU_MEDIC_BIN=path` runs another gpu-medic binary (an older release, for the side-by-side
//! figure in BENCHMARKS.md; `BENCH_POLICY=path` then gives it the policy of its own tree);
//! `BENCH_TIMEOUT_S` (default 900) bounds the wait for the 79.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use gpu_medic_testkit::proc::{clk_tck, cpu_ticks};
use gpu_medic_testkit::{Daemon, default_policy, fake_nvml, now_ms, parse_at};

/// PCI buses of the fake library's default GPUs 0-3 (tests/fake-nvml/src/identity.rs).
const BUSES: [u32; 4] = [0x1B, 0x29, 0x43, 0x52];

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
}

impl Follow {
    fn new_lines(&mut self, path: &Path) -> Vec<String> {
        let mut out = Vec::new();
        if let Ok(mut f) = std::fs::File::open(path) {
            let _ = f.seek(SeekFrom::Start(self.offset));
            let mut buf = String::new();
            if let Ok(n) = f.read_to_string(&mut buf) {
                self.offset += n as u64;
                self.pending.push_str(&buf);
            }
            while let Some(i) = self.pending.find('\n') {
                out.push(self.pending.drain(..=i).collect());
            }
        }
        out
    }
}

/// The `at` stamp (ms) of the first line of `path` that `pred` accepts, following the file
/// until `deadline`.
fn stamp_of(path: &Path, deadline: Instant, pred: impl Fn(&str) -> bool) -> Option<f64> {
    let mut follow = Follow::default();
    loop {
        if let Some(line) = follow.new_lines(path).into_iter().find(|l| pred(l)) {
            let v: serde_json::Value = serde_json::from_str(line.trim()).ok()?;
            return parse_at(v["at"].as_str()?);
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

fn main() {
    let storm: u32 = env_or("BENCH_STORM", 3000);
    let timeout = Duration::from_secs(env_or("BENCH_TIMEOUT_S", 900));
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
    d.start();
    let pid = d.pid().unwrap();
    std::thread::sleep(Duration::from_millis(2000));
    let cpu_before = cpu_s(pid);
    let kmsg = d.path("kmsg");

    // The storm: every line at once, as a burst in the kernel log.
    let mut text = String::new();
    for i in 0..storm {
        let bus = BUSES[(i % 4) as usize];
        text.push_str(&format!(
            "4,{},{},-;NVRM: Xid (PCI:0000:{bus:02x}:00): {}, pid={i}, name=app, storm\n",
            100 + i,
            1_000_000 + i,
            100_000 + i
        ));
    }
    let t_storm = Instant::now();
    let t_storm_ms = now_ms();
    append(&kmsg, &text);
    std::thread::sleep(Duration::from_secs(1));
    let t79 = now_ms();
    append(
        &kmsg,
        &format!(
            "4,{},{},-;NVRM: Xid (PCI:0000:{:02x}:00): 79, pid=1, name=train, GPU has fallen off the bus.\n",
            100 + storm,
            1_000_000 + storm,
            BUSES[1]
        ),
    );
    let t79_instant = Instant::now();

    // The 79's decision: its `opened` record's stamp.
    let journal = d.path("state/incidents.jsonl");
    let deadline = t79_instant + timeout;
    let decided_at = stamp_of(&journal, deadline, |l| {
        l.contains("\"opened\"") && l.contains("\"code\":79")
    });
    // The last XID of the storm stepped: its input's stamp.
    let last = format!("\"code\":{}", 100_000 + storm - 1);
    let last_at = stamp_of(&d.path("state/inputs.jsonl"), deadline, |l| {
        l.contains(&last)
    });

    // Absorbed: the first second after which the process used under 2 % of a core.
    let mut absorbed = None;
    let mut last = (Instant::now(), cpu_s(pid));
    while t_storm.elapsed() < timeout + Duration::from_secs(60) {
        std::thread::sleep(Duration::from_secs(1));
        let now = (Instant::now(), cpu_s(pid));
        let rate = (now.1 - last.1) / now.0.duration_since(last.0).as_secs_f64();
        if rate < 0.02 {
            absorbed = Some(last.0.duration_since(t_storm));
            break;
        }
        last = now;
    }
    let storm_cpu = cpu_s(pid) - cpu_before;
    // Idle after: CPU over the next 5 seconds.
    let c0 = cpu_s(pid);
    std::thread::sleep(Duration::from_secs(5));
    let idle_rate = (cpu_s(pid) - c0) / 5.0;
    let opened = std::fs::read_to_string(&journal)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"opened\""))
        .count();
    let state_bytes = std::fs::metadata(d.path("state/state.json"))
        .map(|m| m.len())
        .unwrap_or(0);
    d.stop(Duration::from_secs(25));

    println!(
        "XID storm: {storm} distinct XIDs at once, an XID 79 one second later ({})",
        gpu_medic_testkit::bin().display()
    );
    match decided_at {
        Some(at) => println!("  XID 79 decided {:.0} ms after it was written", at - t79),
        None => println!("  XID 79 not decided within {timeout:?}"),
    }
    match last_at {
        Some(at) => println!(
            "  last XID of the storm stepped {:.2} s after the storm was written",
            (at - t_storm_ms) / 1000.0
        ),
        None => println!("  the storm's last XID not stepped within the wait"),
    }
    match absorbed {
        Some(a) => println!(
            "  storm absorbed (CPU < 2 % of a core) {:.1} s after it began",
            a.as_secs_f64()
        ),
        None => println!("  storm not absorbed within the wait"),
    }
    println!(
        "  CPU time for the storm: {storm_cpu:.2} s; afterwards {:.1} % of a core",
        idle_rate * 100.0
    );
    println!("  incidents opened: {opened}; state.json {state_bytes} bytes");
}
