//! The engine alone: decisions per second of `gpu_medic::engine::step` on a recorded input
//! stream, with the default policy. Run with `scripts/bench.sh` (or
//! `cargo bench --bench engine_throughput`).
//!
//! The stream is recorded first: a simulated 8-GPU node over simulated days (probe results,
//! ticks, application and fatal XIDs, ECC, thermal, MPS daemon failures), where every order
//! the engine emits is answered with an outcome (mostly done, some retryable failures), and a
//! node that was drained or replaced starts over from a fresh state (a new instance). The
//! recording is then replayed `BENCH_REPEAT` times (default 7), as `gpu-medic policy simulate`
//! does, and the median is reported. `BENCH_INPUTS` sets the stream length (default 200 000);
//! `BENCH_STREAM=path/inputs.jsonl` replays a daemon's own recording instead (e.g. a soak
//! node's `state/inputs.jsonl`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::{Duration, Instant};

use gpu_medic::engine::{State, step};
use gpu_medic::model::{
    Action, GpuId, Input, Observation, Outcome, OutcomeStatus, Signal, StampedInput, Timestamp,
};
use gpu_medic::policy::Policy;
use gpu_medic_testkit::default_policy;
use gpu_medic_testkit::stats::{Rng, machine, median};

/// Runs of inputs, each from a fresh state.
type Stream = Vec<Vec<(Input, Timestamp)>>;

fn gpu(i: u32) -> GpuId {
    GpuId {
        index: i,
        uuid: format!("GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}"),
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + i * 0x10),
        serial: None,
    }
}

fn observation(rng: &mut Rng) -> Option<Observation> {
    let g = gpu(rng.below(8) as u32);
    let r = rng.unit();
    let o = if r < 0.50 {
        Observation::new(Signal::MpsUp).with_value(rng.below(20))
    } else if r < 0.70 {
        let code = *rng.pick(&[13u32, 31, 43, 68, 8, 63, 92]);
        Observation::new(Signal::xid(code))
            .on_gpu(g)
            .with_pids(vec![4000 + rng.below(100) as u32])
            .with_detail("Graphics Exception")
    } else if r < 0.80 {
        Observation::new(Signal::EccCorrected)
            .on_gpu(g)
            .with_value(1 + rng.below(3))
    } else if r < 0.88 {
        Observation::new(Signal::Thermal)
            .on_gpu(g)
            .with_value(85 + rng.below(15))
    } else if r < 0.94 {
        Observation::new(Signal::MpsDown).with_value(1 + rng.below(2))
    } else if r < 0.97 {
        Observation::new(Signal::MpsUnresponsive).with_value(1 + rng.below(2))
    } else if r < 0.995 {
        Observation::new(Signal::EccUncorrected)
            .on_gpu(g)
            .with_value(1)
    } else {
        let code = *rng.pick(&[79u32, 48, 64, 74, 95, 119]);
        Observation::new(Signal::xid(code)).on_gpu(g)
    };
    Some(o.from_source("bench"))
}

/// Records a stream: the engine decides, a simulated executor answers every order.
fn record(policy: &Policy, inputs: usize, seed: u64) -> Stream {
    let mut rng = Rng::new(seed);
    let mut now = Timestamp(1_760_000_000_000);
    let mut state = State::default();
    let mut stream: Stream = vec![Vec::new()];
    let mut pending: Vec<Outcome> = Vec::new();
    let mut n = 0;
    while n < inputs {
        now = now.plus(Duration::from_millis(rng.below(2000)));
        let input = if !pending.is_empty() && rng.unit() < 0.5 {
            Input::Outcome(pending.remove(0))
        } else if rng.unit() < 0.4 {
            Input::Tick
        } else {
            Input::Observation(observation(&mut rng).unwrap())
        };
        let (next, actions) = step(&state, input.clone(), now, policy);
        stream.last_mut().unwrap().push((input, now));
        n += 1;
        for a in actions {
            if let Action::Execute(order) = a {
                let status = if rng.unit() < 0.1 {
                    OutcomeStatus::Failed { retryable: true }
                } else {
                    OutcomeStatus::Done
                };
                pending.push(Outcome {
                    action: order.id,
                    status,
                    detail: "simulated".into(),
                    request_ids: vec![],
                    evidence: None,
                    fleet: None,
                    diagnosis: None,
                });
            }
        }
        state = next;
        let node = state.node.phase.as_str();
        if state.node.remediation.is_none() && matches!(node, "drained" | "replaced" | "terminated")
        {
            // A new instance takes the old one's place.
            state = State::default();
            pending.clear();
            stream.push(Vec::new());
        }
    }
    stream
}

fn load_stream(path: &str) -> Stream {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    vec![
        text.lines()
            .filter_map(|l| serde_json::from_str::<StampedInput>(l).ok())
            .map(|s| (s.input, s.at))
            .collect(),
    ]
}

/// One replay: (inputs, executable orders, journal records, seconds).
fn replay(stream: &Stream, policy: &Policy) -> (usize, usize, usize, f64) {
    let t0 = Instant::now();
    let (mut inputs, mut orders, mut records) = (0, 0, 0);
    for run in stream {
        let mut state = State::default();
        for (input, now) in run {
            let (next, actions) = step(&state, input.clone(), *now, policy);
            inputs += 1;
            for a in &actions {
                match a {
                    Action::Execute(_) => orders += 1,
                    Action::Log(_) => records += 1,
                }
            }
            state = next;
        }
    }
    (inputs, orders, records, t0.elapsed().as_secs_f64())
}

fn main() {
    let policy = gpu_medic::config::load_policy(&default_policy()).expect("default policy");
    let n: usize = std::env::var("BENCH_INPUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let repeat: usize = std::env::var("BENCH_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    let (stream, what) = match std::env::var("BENCH_STREAM") {
        Ok(p) => (load_stream(&p), p),
        Err(_) => (
            record(&policy, n, 42),
            format!("synthetic, {n} inputs, seed 42"),
        ),
    };
    println!("machine: {}", machine());
    let mut rates = Vec::new();
    let mut last = (0, 0, 0);
    for _ in 0..repeat {
        let (inputs, orders, records, secs) = replay(&stream, &policy);
        rates.push(inputs as f64 / secs);
        last = (inputs, orders, records);
    }
    let (inputs, orders, records) = last;
    println!(
        "engine::step on a recorded stream ({what}): {} node lifetimes, {inputs} inputs -> {orders} orders, {records} journal records",
        stream.len()
    );
    let mut sorted = rates.clone();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "  decisions per second: median {:.0}   min {:.0}   max {:.0}   ({repeat} replays; {:.2} us per input at the median)",
        median(&rates),
        sorted[0],
        sorted[sorted.len() - 1],
        1e6 / median(&rates)
    );
}
