//! Detection-to-action latency through the real `gpu-medic run` (release build), measured from
//! outside the process. Run with `scripts/bench.sh` (or `cargo bench --bench action_latency`);
//! `BENCH_RUNS` (default 200) runs per scenario, `BENCH_ONLY=xid|mps-kill|mps-stop` (comma
//! separated) to pick scenarios.
//!
//! - `xid`: an XID 79 injected into the fake libnvidia-ml (8 GPUs, rotating) until the first
//!   remediation call, the quarantine's ECS `PutAttributes`, reaches the control plane: moto
//!   behind a recording proxy that stamps each request when it has read it in full, before
//!   forwarding. Each run starts a fresh gpu-medic with a fresh state directory (a node
//!   remediation happens once per node) and injects once it is up; the measured path is the
//!   fake library's event, the NVML event thread, the engine, the journal and state writes,
//!   and the SDK's first call (a cold connection, as in production where a healthy node makes
//!   no AWS call). Also reported: injection to the engine's decision (`opened` stamp, ms).
//!   Floor: the fake library polls its injection folder every 2 ms (0-2 ms, mean 1 ms).
//! - `mps-kill` / `mps-stop`: NVIDIA's real MPS control daemon (manage = "direct") is sent
//!   SIGKILL or SIGSTOP; measured to the restart order (`action-started` stamp of
//!   `restart-mps`, ms) and to the daemon answering `get_default_active_thread_percentage`
//!   again (our own probe loop, every 5 ms, 200 ms per try). gpu-medic probes every 500 ms with
//!   a 300 ms timeout (the defaults are 5 s and 3 s). The policy extends default.toml with a
//!   restart budget no run exhausts. Floors: a killed daemon needs two `mps-down` probes
//!   (0.5-1.0 s after the kill, mean 0.75 s); a stopped one two unanswered probes
//!   (0.8-1.3 s, mean 1.05 s).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::Path;
use std::time::{Duration, Instant};

use gpu_medic_testkit::mps::{MPS_BIN, MPS_PROBE, MpsDir, mps_processes};
use gpu_medic_testkit::stats::{Rng, machine, summary};
use gpu_medic_testkit::{
    Daemon, Proxy, aws, bin, default_policy, fake_nvml, gpus_json, journal, now_ms, parse_at,
    signal, wait_until,
};

fn main() {
    let runs: usize = std::env::var("BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let only = std::env::var("BENCH_ONLY").unwrap_or_else(|_| "xid,mps-kill,mps-stop".into());
    println!("machine: {}", machine());
    println!("binary: {}", bin().display());
    if only.split(',').any(|s| s == "xid") {
        xid_to_call(runs);
    }
    for (name, sig) in [("mps-kill", libc::SIGKILL), ("mps-stop", libc::SIGSTOP)] {
        if only.split(',').any(|s| s == name) {
            mps_fault(runs, name, sig);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// XID 79 -> PutAttributes

fn xid_to_call(runs: usize) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let moto = aws::moto();
    let proxy = rt.block_on(Proxy::to(moto.addr));
    let seeded = rt.block_on(async {
        let sdk = aws::sdk(&moto.url).await;
        aws::seed(&sdk, "bench-xid", 1).await
    });
    let lib = fake_nvml();
    let root = tempfile::Builder::new()
        .prefix("gm-bench-xid-")
        .tempdir()
        .unwrap();
    let mut to_call = Vec::new();
    let mut to_decision = Vec::new();
    let mut decision_to_call = Vec::new();
    let t_all = Instant::now();
    for i in 0..runs {
        let dir = root.path().join(format!("run{i}"));
        let config = format!(
            "state_dir = \"state\"\npolicy = \"{policy}\"\n\
             [nvml]\nlibrary = \"{lib}\"\nkmsg = \"{kmsg}\"\n\
             [mps]\nenabled = false\n[lifecycle]\nenabled = false\n{identity}\
             [fleet]\nwarmup = \"0s\"\n",
            policy = default_policy().display(),
            lib = lib.display(),
            kmsg = dir.join("kmsg").display(),
            identity = aws::sections(&seeded, 0, ""),
        );
        let mut d = Daemon::in_dir(dir.clone(), &config);
        d.aws(Some(&proxy.url)).gpus(&gpus_json(8));
        d.start();
        // The event thread registers right after the first state is saved.
        std::thread::sleep(Duration::from_millis(300));
        proxy.take_calls();
        let gpu = i % 8;
        let tmp = d.path("inject/1.json.tmp");
        std::fs::write(&tmp, format!(r#"{{"gpu": {gpu}, "xid": 79}}"#)).unwrap();
        let t0 = now_ms();
        std::fs::rename(&tmp, d.path("inject/1.json")).unwrap();
        let mut arrived = None;
        let ok = wait_until(Duration::from_secs(20), || {
            arrived = proxy
                .calls()
                .iter()
                .find(|c| c.op == "PutAttributes" && c.body.contains("faulted"))
                .map(|c| c.arrived_ms);
            arrived.is_some()
        });
        d.signal(libc::SIGKILL);
        assert!(
            ok,
            "run {i}: no PutAttributes within 20 s; log: {}",
            d.log()
        );
        let arrived = arrived.unwrap();
        let opened = d
            .records()
            .into_iter()
            .find(|r| r["event"] == "opened")
            .and_then(|r| parse_at(r["at"].as_str()?))
            .expect("an opened record");
        to_call.push(arrived - t0);
        to_decision.push((opened - t0).max(0.0));
        decision_to_call.push((arrived - opened).max(0.0));
        drop(d);
        let _ = std::fs::remove_dir_all(&dir);
    }
    println!();
    println!(
        "XID 79 injected -> first remediation call (quarantine PutAttributes) at the proxy, {runs} runs, fresh gpu-medic each ({:.0} s)",
        t_all.elapsed().as_secs_f64()
    );
    println!(
        "  injection -> PutAttributes arrives:  {}",
        summary(&to_call)
    );
    println!(
        "  injection -> engine decision (ms stamp): {}",
        summary(&to_decision)
    );
    println!(
        "  decision -> PutAttributes (ms stamp):   {}",
        summary(&decision_to_call)
    );
    println!("  floor: the fake library polls its injection folder every 2 ms (mean 1 ms)");
}

// ---------------------------------------------------------------------------------------------
// MPS daemon SIGKILL / SIGSTOP -> restart order, and -> answering again

fn mps_fault(runs: usize, name: &str, sig: libc::c_int) {
    let root = tempfile::Builder::new()
        .prefix("gm-lat-")
        .tempdir_in("/tmp")
        .unwrap();
    let mps = MpsDir::new(root.path().join("m"));
    mps.start().expect("MPS daemon");
    let d = root.path();
    std::fs::write(
        d.join("policy.toml"),
        format!(
            "extends = \"{}\"\n[mps]\nrestart_budget = 100\nrestart_window = \"1m\"\n",
            default_policy().display()
        ),
    )
    .unwrap();
    let config = format!(
        "state_dir = \"state\"\npolicy = \"policy.toml\"\n\
         [nvml]\nenabled = false\n[aws]\nenabled = false\n\
         [mps]\ncontrol_binary = \"{MPS_BIN}\"\npipe_directory = \"{pipe}\"\n\
         log_directory = \"{log}\"\nmanage = \"direct\"\nprobe_interval = \"500ms\"\n\
         probe_timeout = \"300ms\"\nquit_timeout = \"1s\"\nstart_timeout = \"5s\"\n",
        pipe = mps.pipe.display(),
        log = mps.log.display(),
    );
    let mut medic = Daemon::in_dir(d.to_path_buf(), &config);
    medic.start();
    let incidents = medic.path("state/incidents.jsonl");
    std::thread::sleep(Duration::from_secs(1));
    let mut rng = Rng::new(0x5eed);
    let mut to_restart = Vec::new();
    let mut to_answer = Vec::new();
    let mut restart_to_answer = Vec::new();
    let mut failures = 0;
    let t_all = Instant::now();
    for i in 0..runs {
        // Start each run at a random phase of gpu-medic's probe schedule.
        std::thread::sleep(rng.range_ms(200, 700));
        let Some(pid) = mps.daemon() else {
            panic!(
                "run {i}: no single MPS daemon: {:?}",
                mps_processes(&mps.pipe)
            )
        };
        let closed_before = count_closed(&incidents);
        let t0 = now_ms();
        signal(pid, sig);
        // The daemon answering again: a new one (the old is dead or frozen).
        let mut answered = None;
        let ok = wait_until(Duration::from_secs(20), || {
            if mps.answer(MPS_PROBE, Duration::from_millis(200)).is_some() {
                answered = Some(now_ms());
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
            false
        });
        assert!(
            ok,
            "run {i}: the daemon did not answer within 20 s; log: {}",
            medic.log()
        );
        // The restart order, and the incident closed.
        let mut restart = None;
        let closed = wait_until(Duration::from_secs(20), || {
            let recs = journal::read(&incidents);
            restart = recs
                .iter()
                .filter(|r| {
                    r["event"] == "action-started" && r["order"]["command"]["kind"] == "restart-mps"
                })
                .filter_map(|r| parse_at(r["at"].as_str()?))
                .find(|at| *at >= t0 - 1.0);
            restart.is_some()
                && recs.iter().filter(|r| r["event"] == "closed").count() > closed_before
        });
        if !closed {
            failures += 1;
            eprintln!("run {i}: no restart order / closed incident seen");
            continue;
        }
        let (answered, restart) = (answered.unwrap(), restart.unwrap());
        to_restart.push(restart - t0);
        to_answer.push(answered - t0);
        restart_to_answer.push(answered - restart);
    }
    let status = medic.stop(Duration::from_secs(25));
    let left = mps.shutdown();
    println!();
    println!(
        "MPS daemon {} ({name}), {runs} runs against one gpu-medic, probe_interval 500ms, probe_timeout 300ms ({:.0} s)",
        if sig == libc::SIGKILL {
            "SIGKILL"
        } else {
            "SIGSTOP"
        },
        t_all.elapsed().as_secs_f64()
    );
    println!(
        "  fault -> restart order (ms stamp):  {}",
        summary(&to_restart)
    );
    println!(
        "  fault -> daemon answers again:      {}",
        summary(&to_answer)
    );
    println!(
        "  restart order -> daemon answers:    {}",
        summary(&restart_to_answer)
    );
    if sig == libc::SIGKILL {
        println!(
            "  floor (restart order): two mps-down probes, 0.5-1.0 s after the fault (mean 0.75 s)"
        );
    } else {
        println!(
            "  floor (restart order): two probes unanswered for 300 ms, 0.8-1.3 s after the fault (mean 1.05 s)"
        );
    }
    println!(
        "  runs without a closed incident: {failures}; gpu-medic exit: {status:?}; MPS processes left at the end: {}",
        left.len()
    );
}

fn count_closed(path: &Path) -> usize {
    journal::read(path)
        .iter()
        .filter(|r| r["event"] == "closed")
        .count()
}
