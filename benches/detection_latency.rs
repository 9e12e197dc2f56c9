//! Detection latency: from a fault injected into the fake libnvidia-ml to the engine's
//! decision in the journal, through the real `gpu-medic run` binary and the real NVML
//! bindings. Run with `scripts/bench.sh` (release build); prints median, p99 and max over
//! N injections (default 200) and the floor it is measured against.
//!
//! Each injection is an XID with a code no rule names, on a rotating GPU. The decision time is
//! the stamp the engine gave the input in `inputs.jsonl` (millisecond resolution; the engine
//! folds log-only findings per GPU and class, so not every code opens an incident); the
//! injection time is taken just before the file is renamed into the fake library's folder,
//! which it polls every 2 ms.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::stats::summary;
use gpu_medic_testkit::{Daemon, now_ms, parse_at};

fn main() {
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let mut d = Daemon::fake_gpu_node("", "");
    d.start();
    std::thread::sleep(Duration::from_millis(1500));

    let journal = d.path("state/inputs.jsonl");
    let mut latencies = Vec::with_capacity(runs);
    for i in 0..runs {
        let code = 100_000 + i as u32;
        let gpu = i % 4;
        let tmp = d.path(&format!("inject/{i:05}.json.tmp"));
        std::fs::write(&tmp, format!("{{\"gpu\": {gpu}, \"xid\": {code}}}")).unwrap();
        let t0 = now_ms();
        std::fs::rename(&tmp, d.path(&format!("inject/{i:05}.json"))).unwrap();
        let needle = format!("\"code\":{code}");
        let waited = std::time::Instant::now();
        let at = loop {
            let text = std::fs::read_to_string(&journal).unwrap_or_default();
            if let Some(line) = text
                .lines()
                .find(|l| l.contains(&needle) && l.contains("\"xid\""))
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
    d.stop(Duration::from_secs(25));

    println!("detection latency, injection file -> engine decision ({runs} injections)");
    println!("  {}", summary(&latencies));
    println!(
        "  floor: the fake library polls its inject folder every 2 ms; journal stamps are in ms"
    );
}
