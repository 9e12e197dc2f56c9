//! The fleet budget's two protocols side by side, through the real `gpu-medic run` against
//! moto behind the recording proxy (`tests/kit/src/proxy.rs`). Run with
//! `scripts/bench.sh fleet_budget` (or `cargo bench --bench fleet_budget`).
//!
//! - `latency`: XID 79 injected into the fake libnvidia-ml until the drain call
//!   (`UpdateContainerInstancesState`) reaches the control plane, with the slot table
//!   (`[fleet] table`) and with the claim protocol (default `claim_settle` 10 s). Each run
//!   seeds a fresh group of 3 in moto and starts a fresh gpu-medic (a node remediation happens
//!   once per node). `BENCH_RUNS` (default 20) runs per protocol.
//! - `calls`: a group of N (`BENCH_SIZES`, default 3,10,30) whose budget (1) is held by
//!   another instance; one faulted gpu-medic defers and retries every `retry_after` (1 s here).
//!   Over `BENCH_WINDOW_S` (default 20) s the proxy counts its AWS calls by operation; the
//!   bench prints calls per attempt (attempts = its DescribeAutoScalingGroups calls: one per
//!   attempt in both protocols). With the default `retry_after` of 60 s (jittered 0.5-1.5x,
//!   mean 1x) that is the number of calls per deferred instance per minute.
//!
//! `BENCH_ONLY=latency|calls` picks one.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use gpu_medic_testkit::stats::{machine, summary};
use gpu_medic_testkit::{Daemon, Proxy, aws, bin, default_policy, fake_nvml, now_ms, wait_until};

fn main() {
    let only = std::env::var("BENCH_ONLY").unwrap_or_else(|_| "latency,calls".into());
    println!("machine: {}", machine());
    println!("binary: {}", bin().display());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let proxy = rt.block_on(Proxy::to(aws::moto().addr));
    let table = aws::unique("bench-slots");
    rt.block_on(async {
        let sdk = aws::sdk(&aws::moto().url).await;
        aws::create_slot_table(&sdk, &table).await;
    });
    if only.split(',').any(|s| s == "latency") {
        let runs: usize = env("BENCH_RUNS", 20);
        for (name, fleet) in [
            ("slot table", format!("table = \"{table}\"\n")),
            ("claims", String::new()),
        ] {
            latency(&rt, &proxy, runs, name, &fleet);
        }
    }
    if only.split(',').any(|s| s == "calls") {
        let sizes: Vec<usize> = std::env::var("BENCH_SIZES")
            .unwrap_or_else(|_| "3,10,30".into())
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        let window = Duration::from_secs(env("BENCH_WINDOW_S", 20) as u64);
        for n in sizes {
            for (name, fleet) in [
                ("slot table", format!("table = \"{table}\"\n")),
                ("claims", String::new()),
            ] {
                calls(&rt, &proxy, n, window, name, &fleet, &table);
            }
        }
    }
}

fn env(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A gpu-medic for node `i` of `s` in `dir`: fake GPUs, MPS and the lifecycle watcher off.
fn node(dir: std::path::PathBuf, s: &aws::Seeded, i: usize, proxy: &Proxy, fleet: &str) -> Daemon {
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{policy}\"\n\
         [nvml]\nlibrary = \"{lib}\"\nkmsg = \"{kmsg}\"\n\
         [mps]\nenabled = false\n[lifecycle]\nenabled = false\n{identity}\
         [fleet]\nwarmup = \"0s\"\nmax_parallel = 1\nmax_unhealthy = \"100%\"\n{fleet}",
        policy = default_policy().display(),
        lib = fake_nvml().display(),
        kmsg = dir.join("kmsg").display(),
        identity = aws::sections(s, i, ""),
    );
    let mut d = Daemon::in_dir(dir, &config);
    d.aws(Some(&proxy.url));
    d
}

fn latency(rt: &tokio::runtime::Runtime, proxy: &Proxy, runs: usize, name: &str, fleet: &str) {
    let root = tempfile::Builder::new()
        .prefix("gm-bench-fleet-")
        .tempdir()
        .unwrap();
    let mut to_drain = Vec::new();
    let mut quarantine_to_drain = Vec::new();
    let mut trips = Vec::new();
    let mut path_ops = String::new();
    let t_all = Instant::now();
    for i in 0..runs {
        let s = rt.block_on(async {
            let sdk = aws::sdk(&aws::moto().url).await;
            aws::seed(&sdk, "bench-fleet", 3).await
        });
        let dir = root.path().join(format!("run{i}"));
        let mut d = node(dir.clone(), &s, 0, proxy, fleet);
        d.start();
        std::thread::sleep(Duration::from_millis(300));
        proxy.take_calls();
        let tmp = d.path("inject/1.json.tmp");
        std::fs::write(&tmp, r#"{"gpu": 0, "xid": 79}"#).unwrap();
        let t0 = now_ms();
        std::fs::rename(&tmp, d.path("inject/1.json")).unwrap();
        let mut seen = None;
        let ok = wait_until(Duration::from_secs(60), || {
            let calls = proxy.calls();
            let q = calls
                .iter()
                .find(|c| c.op == "PutAttributes" && c.body.contains("faulted"))
                .map(|c| c.arrived_ms);
            let drain = calls
                .iter()
                .find(|c| c.op == "UpdateContainerInstancesState")
                .map(|c| c.arrived_ms);
            seen = q.zip(drain);
            seen.is_some()
        });
        d.signal(libc::SIGKILL);
        assert!(ok, "{name} run {i}: no drain within 60 s; log: {}", d.log());
        let (q, drain) = seen.unwrap();
        let (depth, ops) = round_trips(&proxy.calls(), q, drain);
        trips.push(depth);
        path_ops = ops;
        to_drain.push(drain - t0);
        quarantine_to_drain.push(drain - q);
        drop(d);
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!();
    println!(
        "{name}: XID 79 injected -> drain call (UpdateContainerInstancesState) at the proxy, {runs} runs, fresh group and gpu-medic each ({:.0} s)",
        t_all.elapsed().as_secs_f64()
    );
    println!("  injection -> drain call:   {}", summary(&to_drain));
    println!(
        "  quarantine -> drain call:  {}",
        summary(&quarantine_to_drain)
    );
    trips.sort_unstable();
    println!(
        "  round trips in series, quarantine -> drain call (the drain call included): median {} max {} (n = {}); last run's calls (trip:operation): {path_ops}",
        trips.get(trips.len() / 2).copied().unwrap_or(0),
        trips.last().copied().unwrap_or(0),
        trips.len()
    );
}

/// The round trips in series from the quarantine call to the drain call: the longest chain of
/// calls each sent after the one before it was answered (calls in flight together count
/// once), the drain call included; and the calls in that window, in order of arrival.
fn round_trips(
    calls: &[gpu_medic_testkit::proxy::Call],
    quarantine_ms: f64,
    drain_ms: f64,
) -> (u32, String) {
    let mut window: Vec<&gpu_medic_testkit::proxy::Call> = calls
        .iter()
        .filter(|c| c.arrived_ms > quarantine_ms && c.arrived_ms <= drain_ms)
        .collect();
    window.sort_by(|a, b| a.arrived_ms.total_cmp(&b.arrived_ms));
    let mut depth: Vec<u32> = Vec::with_capacity(window.len());
    for (i, c) in window.iter().enumerate() {
        let before = (0..i)
            .filter(|&j| window[j].answered_ms <= c.arrived_ms)
            .map(|j| depth[j])
            .max()
            .unwrap_or(0);
        depth.push(before + 1);
    }
    let ops = window
        .iter()
        .zip(&depth)
        .map(|(c, d)| format!("{}:{}", d, c.op))
        .collect::<Vec<_>>()
        .join(" ");
    (depth.last().copied().unwrap_or(0), ops)
}

fn calls(
    rt: &tokio::runtime::Runtime,
    proxy: &Proxy,
    n: usize,
    window: Duration,
    name: &str,
    fleet: &str,
    table: &str,
) {
    let (s, sdk) = rt.block_on(async {
        let sdk = aws::sdk(&aws::moto().url).await;
        (aws::seed(&sdk, "bench-calls", n).await, sdk)
    });
    // Node 1 holds the budget: DRAINING in ECS and, for the table, a committed entry.
    rt.block_on(async {
        aws_sdk_ecs::Client::new(&sdk)
            .update_container_instances_state()
            .cluster(&s.cluster)
            .container_instances(&s.nodes[1].arn)
            .status(aws_sdk_ecs::types::ContainerInstanceStatus::Draining)
            .send()
            .await
            .unwrap();
        if !fleet.is_empty() {
            aws::put_slot_holder(&sdk, table, &s.asg, &s.nodes[1].instance_id).await;
        }
    });
    let root = tempfile::Builder::new()
        .prefix("gm-bench-calls-")
        .tempdir()
        .unwrap();
    let mut d = node(
        root.path().join("n0"),
        &s,
        0,
        proxy,
        &format!("{fleet}retry_after = \"1s\"\n"),
    );
    d.start();
    std::thread::sleep(Duration::from_millis(300));
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    let deferred = wait_until(Duration::from_secs(30), || {
        d.log().contains("fleet budget full")
    });
    assert!(deferred, "{name}, {n}: never deferred; log: {}", d.log());
    proxy.take_calls();
    std::thread::sleep(window);
    let calls = proxy.take_calls();
    d.signal(libc::SIGKILL);
    let mut by_op: BTreeMap<String, usize> = BTreeMap::new();
    for c in &calls {
        *by_op.entry(c.op.clone()).or_default() += 1;
    }
    let attempts = by_op
        .get("DescribeAutoScalingGroups")
        .copied()
        .unwrap_or(0)
        .max(1);
    let per: Vec<String> = by_op
        .iter()
        .map(|(op, k)| format!("{op} {:.2}", *k as f64 / attempts as f64))
        .collect();
    println!(
        "{name}, group of {n}: {attempts} attempts in {} s, {:.2} calls per attempt ({})",
        window.as_secs(),
        calls.len() as f64 / attempts as f64,
        per.join(", ")
    );
}
