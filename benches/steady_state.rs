//! Steady-state cost of `gpu-medic run` on a healthy simulated node, at the default intervals
//! (tick 1 s, NVML poll 10 s, MPS probe 5 s, lifecycle poll 5 s): CPU time per hour and peak
//! RSS, for 1, 8 and 16 GPUs and 0 or 48 MPS clients per GPU (`BENCH_CONFIGS=16x0,16x128`:
//! others). Run with `scripts/bench.sh` (or `cargo bench --bench steady_state`).
//!
//! Each node: the fake libnvidia-ml with N H200s, NVIDIA's real MPS control daemon (manage =
//! "direct", probed every 5 s), the real `/dev/kmsg`, `[aws]` enabled with its identity
//! configured (a healthy node makes no AWS call), a fake IMDS answering the lifecycle probe
//! (`InService`) and a fake ECS agent answering the node probe (`/v1/metadata`), as on EC2. MPS clients are real processes (`sleep`), listed per GPU through
//! `mps_clients` injections, so each poll reads their `/proc/<pid>/cgroup` as it would for
//! CUDA clients.
//!
//! CPU time: utime + stime from `/proc/<pid>/stat` over `BENCH_WINDOW_S` (default 600 s),
//! after `BENCH_WARMUP_S` (default 30 s), scaled to an hour; also with the reaped children
//! (the MPS probe runs `nvidia-cuda-mps-control` every 5 s). The fake library's own injection
//! watcher thread (`fake-nvml-inject`, a readdir every 2 ms, absent from a real libnvidia-ml)
//! is measured per thread and subtracted; it is shown in the last column. Peak RSS: `VmHWM`
//! at the end (the watcher's stack and buffers are included, a few hundred kB at most).
//! The six nodes run at once (`BENCH_PARALLEL=0`: one after another); CPU time is counted
//! per process, so they do not share it, but a busy machine adds some cache and scheduling
//! cost. Clock ticks are 10 ms.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::{Duration, Instant};

use gpu_medic_testkit::imds::{FakeAgent, FakeImds};
use gpu_medic_testkit::mps::{MPS_BIN, MpsDir};
use gpu_medic_testkit::proc::{
    CpuTicks, Sleepers, clk_tck, cpu_ticks, fd_count, status_field, thread_ticks,
};
use gpu_medic_testkit::stats::machine;
use gpu_medic_testkit::{Daemon, default_policy, fake_nvml, gpus_json, inject};

/// The fake libnvidia-ml's injection watcher (polls a folder every 2 ms; no real NVML has it).
const FAKE_THREAD: &str = "fake-nvml-inje";

struct Node {
    gpus: usize,
    clients: usize,
    mps: MpsDir,
    medic: Daemon,
}

fn start(
    gpus: usize,
    clients: usize,
    sleepers: &[u32],
    imds: &FakeImds,
    agent: &FakeAgent,
) -> Node {
    let root = tempfile::Builder::new()
        .prefix("gm-ss-")
        .tempdir_in("/tmp")
        .unwrap();
    let mps = MpsDir::new(root.path().join("m"));
    mps.start().expect("MPS daemon");
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{policy}\"\n\
         [nvml]\nlibrary = \"{lib}\"\nexpected_gpus = {gpus}\n\
         [mps]\ncontrol_binary = \"{MPS_BIN}\"\npipe_directory = \"{pipe}\"\n\
         log_directory = \"{log}\"\nmanage = \"direct\"\n\
         [identity]\ninstance_id = \"i-0123456789abcdef0\"\ncluster = \"bench\"\n\
         container_instance_arn = \"arn:aws:ecs:us-east-1:123456789012:container-instance/bench/0\"\n\
         auto_scaling_group = \"bench\"\n[ecs]\nagent_url = \"{agent}\"\n",
        policy = default_policy().display(),
        lib = fake_nvml().display(),
        pipe = mps.pipe.display(),
        log = mps.log.display(),
        agent = agent.url,
    );
    let mut medic = Daemon::in_temp(root, &config);
    for g in 0..gpus {
        if clients == 0 {
            break;
        }
        let pids: Vec<String> = sleepers[g * clients..(g + 1) * clients]
            .iter()
            .map(|p| p.to_string())
            .collect();
        inject(
            &medic.path("inject"),
            g as u64,
            &format!(r#"{{"gpu": {g}, "mps_clients": [{}]}}"#, pids.join(",")),
        );
    }
    medic
        .aws(Some("http://127.0.0.1:9"))
        .env_remove("AWS_EC2_METADATA_DISABLED")
        .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.url)
        // The daemon's own cost: the fake does not count its polls (a file append each).
        .env_remove("FAKE_NVML_POLLS")
        .gpus(&gpus_json(gpus));
    medic.start();
    Node {
        gpus,
        clients,
        mps,
        medic,
    }
}

struct Measured {
    fake_s_per_h: f64,
    gpus: usize,
    clients: usize,
    own_s_per_h: f64,
    all_s_per_h: f64,
    hwm_kb: u64,
    rss_kb: u64,
    threads: u64,
    fds: usize,
    incidents: usize,
}

fn measure(nodes: &mut [Node], warmup: Duration, window: Duration) -> Vec<Measured> {
    std::thread::sleep(warmup);
    let tck = clk_tck();
    let before: Vec<(CpuTicks, u64)> = nodes
        .iter()
        .map(|n| {
            let pid = n.medic.pid().expect("gpu-medic running");
            (
                cpu_ticks(pid).expect("gpu-medic exited"),
                thread_ticks(pid, FAKE_THREAD),
            )
        })
        .collect();
    let t0 = Instant::now();
    std::thread::sleep(window);
    let secs = t0.elapsed().as_secs_f64();
    let mut out = Vec::new();
    for (n, (b, fake_b)) in nodes.iter_mut().zip(before) {
        let pid = n.medic.pid().expect("gpu-medic running");
        let a = cpu_ticks(pid)
            .unwrap_or_else(|| panic!("gpu-medic ({} GPUs) exited: {}", n.gpus, n.medic.log()));
        let fake = thread_ticks(pid, FAKE_THREAD).saturating_sub(fake_b) as f64 / tck;
        let total = (a.own - b.own) as f64 / tck;
        let own = total - fake;
        let all = own + (a.children - b.children) as f64 / tck;
        let state = n.medic.path("state/incidents.jsonl");
        out.push(Measured {
            fake_s_per_h: fake * 3600.0 / secs,
            gpus: n.gpus,
            clients: n.clients,
            own_s_per_h: own * 3600.0 / secs,
            all_s_per_h: all * 3600.0 / secs,
            hwm_kb: status_field(pid, "VmHWM").unwrap_or(0),
            rss_kb: status_field(pid, "VmRSS").unwrap_or(0),
            threads: status_field(pid, "Threads").unwrap_or(0),
            fds: fd_count(pid).unwrap_or(0),
            incidents: std::fs::read_to_string(state)
                .unwrap_or_default()
                .lines()
                .count(),
        });
    }
    out
}

fn main() {
    let env_s = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let window = Duration::from_secs(env_s("BENCH_WINDOW_S", 600));
    let warmup = Duration::from_secs(env_s("BENCH_WARMUP_S", 30));
    let parallel = std::env::var("BENCH_PARALLEL").map_or(true, |v| v != "0");
    println!("machine: {}", machine());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // IMDS answers the lifecycle probe, the ECS agent the node probe (every 30 s), as on EC2.
    let imds = rt.block_on(FakeImds::start("i-0123456789abcdef0"));
    imds.set_target(Some("InService"));
    let agent = rt.block_on(FakeAgent::start(
        FakeAgent::metadata(
            "bench",
            Some("arn:aws:ecs:us-east-1:123456789012:container-instance/bench/0"),
        ),
        0,
    ));
    // `BENCH_CONFIGS=16x0,16x128`: other GPUs x clients per GPU than the default six.
    let configs: Vec<(usize, usize)> = match std::env::var("BENCH_CONFIGS") {
        Ok(v) => v
            .split(',')
            .map(|c| {
                let (g, n) = c
                    .trim()
                    .split_once('x')
                    .expect("BENCH_CONFIGS: GPUSxCLIENTS,...");
                (g.parse().unwrap(), n.parse().unwrap())
            })
            .collect(),
        Err(_) => vec![(1, 0), (8, 0), (16, 0), (1, 48), (8, 48), (16, 48)],
    };
    // Real processes to stand for MPS clients, shared by nodes.
    let most = configs.iter().map(|(g, c)| g * c).max().unwrap_or(0);
    let mut sleepers = Sleepers::start(most.max(1));
    let pids = sleepers.pids();
    let mut results = Vec::new();
    if parallel {
        let mut nodes: Vec<Node> = configs
            .iter()
            .map(|(g, c)| start(*g, *c, &pids, &imds, &agent))
            .collect();
        results = measure(&mut nodes, warmup, window);
        for mut n in nodes {
            n.medic.stop(Duration::from_secs(25));
            n.mps.shutdown();
        }
    } else {
        for &(g, c) in &configs {
            let mut nodes = vec![start(g, c, &pids, &imds, &agent)];
            results.extend(measure(&mut nodes, warmup, window));
            for mut n in nodes {
                n.medic.stop(Duration::from_secs(25));
                n.mps.shutdown();
            }
        }
    }
    sleepers.stop();
    println!(
        "steady state at the default intervals, healthy node, {} s window after {} s warm-up, {}",
        window.as_secs(),
        warmup.as_secs(),
        if parallel {
            format!("{} nodes at once", configs.len())
        } else {
            "one node at a time".to_string()
        }
    );
    println!(
        "  GPUs | MPS clients/GPU | CPU s/hour (own) | CPU s/hour (+ probe children) | % of a core | VmHWM MiB | VmRSS MiB | threads | fds | journal lines | fake-nvml thread s/hour (excluded)"
    );
    for r in &results {
        println!(
            "  {:>4} | {:>15} | {:>16.2} | {:>29.2} | {:>10.3}% | {:>9.1} | {:>9.1} | {:>7} | {:>3} | {:>13} | {:.1}",
            r.gpus,
            r.clients,
            r.own_s_per_h,
            r.all_s_per_h,
            r.all_s_per_h / 36.0,
            r.hwm_kb as f64 / 1024.0,
            r.rss_kb as f64 / 1024.0,
            r.threads,
            r.fds,
            r.incidents,
            r.fake_s_per_h
        );
    }
}
