//! The per-poll cost of reading the links between the GPUs (issue 24, docs/fabric.md) at
//! **8 GPUs x 18 NVLinks** (an HGX H100/H200 node: p5.48xlarge, p5e, p5en), against today's
//! poll, in-process with the functions `gpu-medic run` calls: `Poller::poll` on the fake
//! libnvidia-ml with eight Hopper GPUs (18 NVLinks each), in three variants that take turns
//! poll by poll (so drift on a shared machine falls on all alike):
//!
//! - `before`: the NVML poll without `[links]` (`[links] enabled = false`: the counters, ECC,
//!   row remapping, retired pages, thermal and the MPS clients, as before issue 24);
//! - `links` (the default): plus each GPU's fabric registration, its 18 NVLinks' state and
//!   five error counters with their rates, the PCIe link against its maximum and its replay
//!   counter, persistence mode and the clock-event reasons, and the uptime read for the
//!   fabric deadline;
//! - `links+view`: plus what `run` does after each poll with `[links]` on: `links.json`
//!   written atomically for `status` and the metrics.
//!
//! Apart: the CPU time of one scrape of the metrics text with the link series (read from
//! `links.json` at each scrape) against one without them.
//!
//! Per poll: wall time and the thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`), median and p99
//! over `BENCH_POLLS` polls (default 2000) after 50 warm-up polls; CPU seconds per hour at the
//! default 10 s poll from the median. The fake library answers each call from memory: the
//! figures are gpu-medic's own cost plus nvml-wrapper's, not the driver's (a real
//! libnvidia-ml call is an ioctl; `scripts/device-check.sh` runs the real one). The count of
//! NVML calls per poll is printed so the driver's share can be estimated. No injection
//! watcher runs (`FAKE_NVML_INJECT_DIR` unset): the counters stay at zero, which costs the
//! rate code the same as counters that move.
//!
//! Run with `cargo bench --bench link_poll` (release), or build it with the other targets
//! (`cargo build --workspace --all-targets --locked`) and run `target/debug/deps/link_poll-*`
//! for a dev-profile look.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::path::PathBuf;
use std::time::{Duration, Instant};

use gpu_medic::config::{LinksConfig, StateDir};
use gpu_medic::probe::nvml::{Poller, SharedState};
use gpu_medic_testkit::stats::machine;
use gpu_medic_testkit::{fake_nvml, gpus_json};

const GPUS: usize = 8;
const VARIANTS: [&str; 3] = ["before", "links", "links+view"];

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec through a valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn pct(sorted: &[Duration], p: usize) -> Duration {
    let rank = (sorted.len() * p).div_ceil(100).max(1);
    sorted[rank.min(sorted.len()) - 1]
}

fn us(d: Duration) -> String {
    format!("{:.1} µs", d.as_secs_f64() * 1e6)
}

struct Run {
    poller: Poller,
    wall: Vec<Duration>,
    cpu: Vec<Duration>,
}

fn main() {
    let polls: usize = std::env::var("BENCH_POLLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    println!("{}", machine());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("gpus.json");
    std::fs::write(&config, gpus_json(GPUS)).unwrap();
    // SAFETY: set before any thread is started and before NVML is opened, which reads it.
    unsafe { std::env::set_var("FAKE_NVML_CONFIG", &config) };
    let nvml = match gpu_medic::probe::nvml::open(fake_nvml().to_str().unwrap()) {
        Ok(n) => n,
        Err(_) => panic!(
            "the fake libnvidia-ml at {} does not open",
            fake_nvml().display()
        ),
    };
    assert_eq!(nvml.device_count().unwrap() as usize, GPUS);
    let files = StateDir::new(dir.path());
    let shared = SharedState::default();
    let proc_root = PathBuf::from("/proc");
    let on = LinksConfig::default();
    let off = LinksConfig {
        enabled: false,
        ..LinksConfig::default()
    };
    let mut runs: Vec<Run> = VARIANTS
        .iter()
        .map(|v| Run {
            poller: Poller::new(
                Some(GPUS as u32),
                proc_root.clone(),
                gpu_medic::probe::identity::Installed::none(),
            )
            .with_links(if *v == "before" {
                off.clone()
            } else {
                on.clone()
            }),
            wall: Vec::with_capacity(polls),
            cpu: Vec::with_capacity(polls),
        })
        .collect();
    let mut nvlinks = 0;
    for i in 0..(polls + 50) {
        for (variant, run) in VARIANTS.iter().zip(runs.iter_mut()) {
            let (t0, c0) = (Instant::now(), thread_cpu());
            let report = run.poller.poll(&nvml, &shared);
            if *variant == "links+view" {
                files.save_view(gpu_medic::config::View::Links, &report.links);
            }
            let (w, c) = (t0.elapsed(), thread_cpu() - c0);
            if *variant == "links" {
                assert_eq!(report.links.len(), GPUS, "every GPU's links read");
                nvlinks = report.links.iter().map(|g| g.nvlinks).sum::<u32>();
                assert!(report.problems.is_empty(), "{:?}", report.problems);
            }
            if *variant == "before" {
                assert!(report.links.is_empty(), "no links read with [links] off");
            }
            std::hint::black_box(report);
            if i >= 50 {
                run.wall.push(w);
                run.cpu.push(c);
            }
        }
    }
    assert_eq!(nvlinks as usize, GPUS * 18, "8 Hopper GPUs x 18 NVLinks");
    let mut before_cpu = Duration::ZERO;
    for (variant, run) in VARIANTS.iter().zip(runs.iter_mut()) {
        run.wall.sort();
        run.cpu.sort();
        let median = pct(&run.cpu, 50);
        if *variant == "before" {
            before_cpu = median;
        }
        let extra = if *variant == "before" {
            String::new()
        } else {
            format!(
                "; +{} CPU per poll over before",
                us(median.saturating_sub(before_cpu))
            )
        };
        println!(
            "{variant:>10}: {GPUS} GPUs x 18 NVLinks, {polls} polls: poll wall median {} p99 {}; poll CPU median {} p99 {}; {:.2} CPU-s/hour at a 10 s poll{extra}",
            us(pct(&run.wall, 50)),
            us(pct(&run.wall, 99)),
            us(median),
            us(pct(&run.cpu, 99)),
            median.as_secs_f64() * 360.0,
        );
    }
    // NVML calls the links add per GPU per poll (crates/io/src/probe/nvml/links.rs): fabric info,
    // 18 x (state + CRC flit, CRC data, replay, recovery), 4 PCIe link queries, the replay
    // counter, persistence, the clock-event reasons.
    let per_gpu = 1 + 18 * 5 + 4 + 1 + 1 + 1;
    println!(
        "NVML calls the links add per poll: {} ({per_gpu} per GPU)",
        GPUS * per_gpu
    );
    // A scrape with the link series (links.json read and 8 GPUs' series built) and without.
    let with = gpu_medic::metrics::Metrics::new().with_link_views(files.clone());
    let without = gpu_medic::metrics::Metrics::new();
    let mut scrapes: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for i in 0..(polls.min(1000) + 20) {
        for (k, m) in [&without, &with].into_iter().enumerate() {
            let c0 = thread_cpu();
            let text = std::hint::black_box(m.render());
            let c = thread_cpu() - c0;
            if k == 1 && i == 0 {
                assert!(
                    text.contains("gpu_medic_gpu_nvlinks{gpu=\"7\"} 18"),
                    "{text}"
                );
            }
            if i >= 20 {
                scrapes[k].push(c);
            }
        }
    }
    for (name, s) in ["without links", "with links"]
        .iter()
        .zip(scrapes.iter_mut())
    {
        s.sort();
        println!(
            "a scrape {name}: CPU median {} p99 {} (n = {})",
            us(pct(s, 50)),
            us(pct(s, 99)),
            s.len()
        );
    }
}
