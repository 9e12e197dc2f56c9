//! Detection time of the MPS faults under real systemd at the **default intervals** (MPS probe
//! 5 s, probe timeout 3 s, tick 1 s): the set-up of tests/systemd_e2e.rs (systemd 252 as PID 1
//! of a namespace over a Debian root, NVIDIA's real daemon under the ECS AMI's
//! `nvidia-mps.service`, the packaged `gpu-medic.service`, the `ecs-ami` preset: the daemon's
//! lines from journald, restarts through systemd). `cargo bench --bench mps_systemd_detection`
//! (needs root; `scripts/bench.sh mps_systemd_detection`). `BENCH_RUNS` (default 10) per
//! scenario; `BENCH_ONLY=hang,daemon-loop,server-loop,server-fault` (comma separated).
//!
//! Measured from the fault to the engine's decision: the incident's `opened_at` stamp (ms); for
//! server faults, the stamp of the observation's record in `inputs.jsonl` (see `decided`).
//! Each fault is made at a random phase of the probe schedule (a 0-5 s wait first), once the
//! previous incident is closed and the daemon answers again.
//!
//! - `hang`: `systemctl kill --signal=SIGSTOP` of the daemon -> `mps-unresponsive`. Floor: two
//!   probes unanswered for 3 s each, 5 s apart: 8-13 s after the stop, mean 10.5 s.
//! - `daemon-loop`: the daemon SIGKILLed three times, each once systemd has restarted it
//!   (`RestartSec=1`), measured from the last kill -> the `mps-crash-loop` rule (`NRestarts`). Floor:
//!   systemd's restart 1 s after the kill, then the next probe turn: 1-6 s, mean 3.5 s.
//! - `server-loop`: three `start_server -uid 0` (each server exits with status 1 without a
//!   GPU: the daemon's own lines, through journald), from the third -> the `mps-crash-loop` rule.
//!   Floor: the next probe turn reads the journal: 0-5 s, mean 2.5 s.
//! - `server-fault`: the fatal-fault block (only a GPU makes one) written to the journal by a
//!   process in the unit's cgroup, as a server's lines reach it -> `mps-server-fault`. Floor: 0-5 s, mean
//!   2.5 s.
//!
//! The policy extends default.toml with a restart budget no run exhausts.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::mps::fault_block;
use gpu_medic_testkit::stats::{Rng, machine, summary};
use gpu_medic_testkit::systemd::{self, Booted};
use gpu_medic_testkit::{bin, now_ms, parse_at};

const MPS: &str = "nvidia-mps.service";

fn main() {
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    let only = std::env::var("BENCH_ONLY")
        .unwrap_or_else(|_| "hang,daemon-loop,server-loop,server-fault".into());
    if let Err(why) = systemd::check() {
        panic!("cannot run real systemd here: {why}");
    }
    println!("machine: {}", machine());
    println!("binary: {}", bin().display());
    let config = "state_dir = \"/var/lib/gpu-medic\"\n\
                  policy = \"/etc/gpu-medic/policies/bench.toml\"\n\
                  [mps]\npreset = \"ecs-ami\"\n[aws]\nenabled = false\n\
                  [export]\nenabled = false\n[lifecycle]\nenabled = false\n";
    let policy = "extends = \"default.toml\"\nversion = 1\n[mps]\nrestart_budget = 100\nrestart_window = \"1m\"\n";
    let _one = systemd::exclusive();
    let sys = Booted::boot(&[
        ("/etc/gpu-medic/config.toml", config),
        ("/etc/gpu-medic/policies/bench.toml", policy),
    ]);
    sys.wait("gpu-medic active", Duration::from_secs(60), || {
        sys.state("gpu-medic.service") == "active/running"
    });
    // Two probes: the journal follower starts at the end of the journal at the end of the
    // first turn (no saved cursor), so a line written before then would not be read.
    sys.wait("two probes", Duration::from_secs(30), || {
        sys.journal(MPS)
            .matches("Cmd:get_default_active_thread_percentage")
            .count()
            >= 2
    });
    let mut b = Bench {
        sys,
        rng: Rng::new(0x0515_7e3d),
        last: (0, 0),
    };
    b.settle();
    for (name, signal) in [
        ("hang", "mps-unresponsive"),
        ("daemon-loop", "mps-crash"),
        ("server-loop", "mps-crash"),
        ("server-fault", "mps-server-fault"),
    ] {
        if !only.split(',').any(|s| s == name) {
            continue;
        }
        let mut took = Vec::with_capacity(runs);
        for _ in 0..runs {
            std::thread::sleep(b.rng.range_ms(0, 5000));
            let t0 = b.fault(name);
            took.push(b.decided(signal) - t0);
            b.settle();
        }
        println!("{name}: fault -> decision ({signal}), {runs} runs, default intervals");
        println!("  {}", summary(&took));
    }
}

struct Bench {
    sys: Booted,
    rng: Rng,
    /// The highest incident id and input sequence number seen.
    last: (u64, u64),
}

impl Bench {
    /// Makes the fault; the wall-clock ms it counts from.
    fn fault(&mut self, name: &str) -> f64 {
        let sys = &self.sys;
        match name {
            "hang" => {
                let t0 = now_ms();
                sys.kill_main(MPS, "SIGSTOP");
                t0
            }
            "daemon-loop" => {
                let mut t0 = 0.0;
                for _ in 0..3 {
                    let pid = sys.main_pid(MPS);
                    t0 = now_ms();
                    sys.kill_main(MPS, "SIGKILL");
                    sys.wait("systemd's restart", Duration::from_secs(20), || {
                        let now = sys.main_pid(MPS);
                        now != 0 && now != pid
                    });
                    std::thread::sleep(Duration::from_millis(1500));
                }
                t0
            }
            "server-loop" => {
                // Three: the third exit fills the rule's confirm window. Each server exits within
                // milliseconds of its start_server, before the control client returns.
                let mut t0 = 0.0;
                for i in 0..3 {
                    if i > 0 {
                        std::thread::sleep(Duration::from_millis(300));
                    }
                    sys.sh("echo 'start_server -uid 0' | CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs nvidia-cuda-mps-control");
                    t0 = now_ms();
                }
                t0
            }
            _ => {
                let daemon = sys.main_pid(MPS);
                let t0 = now_ms();
                sys.journal_as(
                    MPS,
                    "nvidia-cuda-mps-control",
                    &fault_block(daemon + 1, &[daemon + 2]),
                );
                t0
            }
        }
    }

    /// When the engine decided on the fault (ms): the opening stamp of the next incident of
    /// `signal`, or for a server fault the stamp of its next input of `signal` in
    /// `inputs.jsonl` (repeats of `mps-server-fault` on one GPU escalate or join an incident
    /// instead of opening one each; the engine decides on each input all the same).
    fn decided(&mut self, signal: &str) -> f64 {
        let (incident, input) = self.last;
        let inputs = self.sys.path("/var/lib/gpu-medic/inputs.jsonl");
        let by_input = signal == "mps-server-fault";
        let find = || {
            if by_input {
                gpu_medic_testkit::journal::read(&inputs)
                    .into_iter()
                    .find(|v| {
                        v["seq"].as_u64().unwrap_or(0) > input && v["signal"]["kind"] == signal
                    })
                    .and_then(|v| v["at"].as_str().map(str::to_string))
            } else {
                self.sys
                    .incidents()
                    .into_iter()
                    .find(|i| i["id"].as_u64().unwrap_or(0) > incident && i["signal"] == signal)
                    .and_then(|i| i["opened_at"].as_str().map(str::to_string))
            }
        };
        self.sys
            .wait(signal, Duration::from_secs(90), || find().is_some());
        parse_at(&find().unwrap()).unwrap()
    }

    /// Waits until every incident is closed and the daemon runs, unstopped, under systemd.
    fn settle(&mut self) {
        let sys = &self.sys;
        sys.wait("incidents closed", Duration::from_secs(120), || {
            sys.incidents().iter().all(|i| i["closed_at"].is_string())
                && sys.state(MPS) == "active/running"
                && sys.daemons().len() == 1
        });
        let incident = sys
            .incidents()
            .iter()
            .filter_map(|i| i["id"].as_u64())
            .max()
            .unwrap_or(0);
        let input = gpu_medic_testkit::journal::read(&sys.path("/var/lib/gpu-medic/inputs.jsonl"))
            .iter()
            .filter_map(|v| v["seq"].as_u64())
            .max()
            .unwrap_or(0);
        self.last = (incident, input);
    }
}
