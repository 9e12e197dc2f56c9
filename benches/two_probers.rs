//! Two probers on one MPS pipe (issue 50, item 3; docs/mps.md "One prober on one pipe"):
//! NVIDIA's real control daemon, a fake ECS agent probing it on a fixed cadence as the
//! agent's health check does (`gpu_medic_testkit::mps::AgentProber`: the real control binary,
//! 3 s deadline), and beside it, on another daemon at the same time, each of:
//!
//! - `gpu-medic`: `MpsProbe::tick` every probe interval, as `gpu-medic run` calls it (it learns
//!   the agent's cadence from the daemon's log and keeps away from it, waits while another
//!   front-end talks, retries a failure once after a jittered pause);
//! - `plain`: the same two commands sent every probe interval with no regard for anyone else
//!   (gpu-medic's probe before this change: its own queries serialised, nothing more).
//!
//! Both sides' sessions go through a control binary that holds each session open
//! `BENCH_HOLD_MS` longer (default 200: a slow host), so that collisions are frequent enough
//! to count. Reported per variant: the agent's probes and failures (its worst run: three in a
//! row mark the instance impaired), the prober's probes, its failed verdicts and the restarts
//! they would cause (the default policy restarts at two unresponsive probes in a row).
//!
//! `BENCH_WINDOW_S` (default 600), `BENCH_AGENT_PERIOD_S` (default 10; the real agent probes
//! once per doctor run), `BENCH_INTERVAL_MS` (default 5000, `[mps] probe_interval`'s default).
//! Run with `scripts/bench.sh two_probers`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use gpu_medic::config::{MpsConfig, MpsManage};
use gpu_medic::model::Signal;
use gpu_medic::probe::mps::MpsProbe;
use gpu_medic_testkit::mps::{AgentProber, MPS_BIN, MpsDir, worst_run};
use gpu_medic_testkit::stats::machine;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Default, Debug)]
struct Tally {
    probes: usize,
    failed: usize,
    restarts: usize,
}

struct Setup {
    _root: tempfile::TempDir,
    dir: MpsDir,
}

impl Setup {
    fn new() -> Setup {
        let root = tempfile::Builder::new()
            .prefix("gm-bench-")
            .tempdir_in("/tmp")
            .expect("temp dir");
        let dir = MpsDir::new(root.path().to_path_buf());
        dir.start().expect("start the MPS control daemon");
        Setup { _root: root, dir }
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        self.dir.shutdown();
    }
}

fn gpu_medic(setup: &Setup, slow: &std::path::Path, interval: Duration, until: Instant) -> Tally {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let cfg = MpsConfig {
        control_binary: slow.to_path_buf(),
        pipe_directory: setup.dir.pipe.clone(),
        log_directory: setup.dir.log.clone(),
        probe_interval: interval,
        manage: MpsManage::Direct,
        ..MpsConfig::default()
    };
    rt.block_on(async move {
        let mut probe = MpsProbe::new(cfg);
        let mut t = Tally::default();
        let mut every = tokio::time::interval(interval);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        while Instant::now() < until {
            every.tick().await;
            for obs in probe.tick().await {
                match obs.signal {
                    Signal::MpsUp => t.probes += 1,
                    Signal::MpsUnresponsive | Signal::MpsDown => {
                        t.probes += 1;
                        t.failed += 1;
                        if obs.signal == Signal::MpsDown || obs.value >= 2 {
                            t.restarts += 1;
                        }
                    }
                    _ => {}
                }
            }
        }
        t
    })
}

fn plain(setup: &Setup, slow: &std::path::Path, interval: Duration, until: Instant) -> Tally {
    let mut t = Tally::default();
    let mut run = 0;
    let mut next = Instant::now();
    while Instant::now() < until {
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
        next += interval;
        let out = Command::new(slow)
            .env("CUDA_MPS_PIPE_DIRECTORY", &setup.dir.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &setup.dir.log)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .and_then(|mut c| {
                use std::io::Write;
                c.stdin
                    .take()
                    .unwrap()
                    .write_all(b"get_default_active_thread_percentage\nget_server_list\n")?;
                c.wait_with_output()
            });
        let answered = out.is_ok_and(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .is_some_and(|l| l.trim().parse::<f64>().is_ok())
        });
        t.probes += 1;
        if answered {
            run = 0;
        } else {
            t.failed += 1;
            run += 1;
            if run >= 2 {
                t.restarts += 1;
            }
        }
    }
    t
}

fn main() {
    let window = Duration::from_secs(env_u64("BENCH_WINDOW_S", 600));
    let period = Duration::from_secs(env_u64("BENCH_AGENT_PERIOD_S", 10));
    let interval = Duration::from_millis(env_u64("BENCH_INTERVAL_MS", 5000));
    let hold = Duration::from_millis(env_u64("BENCH_HOLD_MS", 200));
    println!("{}", machine());
    println!(
        "two probers on one pipe: window {window:?}, agent every {period:?}, prober every \
         {interval:?}, sessions held {hold:?} longer; {MPS_BIN}"
    );
    let results: Vec<(&str, Tally, Vec<bool>)> = std::thread::scope(|s| {
        let run = |name: &'static str| {
            s.spawn(move || {
                let setup = Setup::new();
                let slow = setup.dir.slow_control_binary(hold);
                let agent = AgentProber::start(&setup.dir, period);
                let until = Instant::now() + window;
                let tally = match name {
                    "gpu-medic" => gpu_medic(&setup, &slow, interval, until),
                    _ => plain(&setup, &slow, interval, until),
                };
                (name, tally, agent.stop())
            })
        };
        let a = run("gpu-medic");
        let b = run("plain");
        vec![a.join().unwrap(), b.join().unwrap()]
    });
    println!(
        "| prober | agent probes | agent failures | agent worst run | prober probes | prober failures | restarts |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (name, t, agent) in results {
        println!(
            "| {name} | {} | {} | {} | {} | {} | {} |",
            agent.len(),
            agent.iter().filter(|ok| !**ok).count(),
            worst_run(&agent),
            t.probes,
            t.failed,
            t.restarts
        );
    }
}
