//! Detection latency: from a fault injected into the fake libnvidia-ml to the engine's
//! decision in the journal, through the real `gpu-medic run` binary and the real NVML
//! bindings. Run with `scripts/bench.sh` (release build); prints median, p99 and max over
//! N injections (default 200) and the floor it is measured against.
//!
//! Each injection is an XID with a code no rule names, on a rotating GPU, so every one opens
//! its own incident (the engine folds repeats of one code). The decision time is the
//! incident's `at` stamp (millisecond resolution); the injection time is taken just before
//! the file is renamed into the fake library's folder, which it polls every 2 ms.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

fn parse_at(s: &str) -> Option<f64> {
    let t = humantime::parse_rfc3339_weak(s).ok()?;
    Some(t.duration_since(UNIX_EPOCH).ok()?.as_secs_f64() * 1000.0)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn main() {
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_gpu-medic"));
    let lib = bin.parent().unwrap().join("libfake_nvml.so");
    assert!(
        lib.exists(),
        "{} missing: build the workspace in this profile first (scripts/bench.sh does)",
        lib.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("inject")).unwrap();
    std::fs::write(d.join("kmsg"), "").unwrap();
    let policy = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/default.toml");
    std::fs::write(
        d.join("config.toml"),
        format!(
            "state_dir = \"state\"\npolicy = \"{}\"\n[nvml]\nlibrary = \"{}\"\nkmsg = \"{}\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
            policy.display(),
            lib.display(),
            d.join("kmsg").display()
        ),
    )
    .unwrap();
    let mut child = Command::new(&bin)
        .args(["run", "--log-format", "json", "--config"])
        .arg(d.join("config.toml"))
        .env("FAKE_NVML_INJECT_DIR", d.join("inject"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let journal = d.join("state/incidents.jsonl");
    let start = Instant::now();
    while !d.join("state/state.json").exists() && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(1500));

    let mut latencies = Vec::with_capacity(runs);
    for i in 0..runs {
        let code = 100_000 + i as u32;
        let gpu = i % 4;
        let tmp = d.join(format!("inject/{i:05}.json.tmp"));
        std::fs::write(&tmp, format!("{{\"gpu\": {gpu}, \"xid\": {code}}}")).unwrap();
        let t0 = now_ms();
        std::fs::rename(&tmp, d.join(format!("inject/{i:05}.json"))).unwrap();
        let needle = format!("\"code\":{code}");
        let waited = Instant::now();
        let at = loop {
            let text = std::fs::read_to_string(&journal).unwrap_or_default();
            if let Some(line) = text
                .lines()
                .find(|l| l.contains(&needle) && l.contains("\"opened\""))
            {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                break parse_at(v["at"].as_str().unwrap()).unwrap();
            }
            assert!(
                waited.elapsed() < Duration::from_secs(10),
                "no decision for injection {i}"
            );
            std::thread::sleep(Duration::from_millis(1));
        };
        latencies.push((at - t0).max(0.0));
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let _ = child.wait();

    latencies.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!("detection latency, injection file -> engine decision ({runs} injections)");
    println!(
        "  median {:.1} ms   p99 {:.1} ms   max {:.1} ms   min {:.1} ms",
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        latencies[latencies.len() - 1],
        latencies[0]
    );
    println!(
        "  floor: the fake library polls its inject folder every 2 ms; journal stamps are in ms"
    );
}
