//! The MPS contract, end to end through the real `gpu-medic run` (issue 37,
//! docs/mps.md#the-mps-contract-and-what-gpu-medic-checks): real processes with real
//! environments in ECS-shaped cgroups (`kit::proc::EcsTaskProcs`), the fake libnvidia-ml listing
//! them as MPS clients (`mps_clients`) or as plain compute processes only
//! (`compute_processes`), NVIDIA's real MPS control daemon among those (it is exempt), the kit's
//! `FakeAgent` naming the tasks, and moto holding the task definitions (with
//! `sharingStrategy.nvidiaMps`, `maxComputePercent` included) and the tasks StopTask stops.
//!
//! Task A's container `app` reserves 2048 MiB at 50 % compute: one client runs with exactly
//! that (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M`), one with no pinned limit, one with a
//! larger one, and two with an environment of 1 MiB (the limit at its head: judged and fine;
//! no limit at all: past the 64 KiB read, not judged). Task B's container runs two processes,
//! each under its limit, together over the container's 1024 MiB. Task C runs one process
//! outside MPS: C (only) is stopped. A process in no task outside MPS is logged, once, and
//! again once its pid is taken by a new process. A pid that is gone by the time it is looked
//! at and the MPS daemon itself are never findings, nor is any correctly limited client over
//! the whole run.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::http::{scrape, series};
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::mps::MpsDir;
use gpu_medic_testkit::proc::{EcsTaskProcs, Sleepers};
use gpu_medic_testkit::{Daemon, wait_sync};
use serde_json::Value;

/// A 64-digit Docker container id, unique to this run.
fn docker_id(n: u32) -> String {
    format!("{:08x}{n:08x}{}", std::process::id(), "cd".repeat(24))
}

/// A container's environment as ECS writes it: the pinned limit and thread percentage when
/// given, and `big` bytes of other variables after them.
fn env(limit: Option<&str>, threads: Option<&str>, big: usize) -> Vec<(String, String)> {
    let mut e = vec![("PATH".to_string(), "/usr/bin:/bin".to_string())];
    if let Some(l) = limit {
        e.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), l.into()));
    }
    if let Some(t) = threads {
        e.push(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), t.into()));
    }
    // One variable may hold at most 128 KiB (MAX_ARG_STRLEN): 64 KiB each.
    for i in 0..big.div_ceil(64 << 10) {
        e.push((format!("FILLER_{i}"), "x".repeat(64 << 10)));
    }
    e
}

fn opened(d: &Daemon, rule: &str) -> Vec<Value> {
    d.records()
        .into_iter()
        .filter(|r| r["event"] == "opened" && r["rule"] == rule)
        .collect()
}

fn pids_of(records: &[Value]) -> Vec<u64> {
    let mut p: Vec<u64> = records
        .iter()
        .flat_map(|r| {
            r["observation"]["pids"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|v| v.as_u64())
        .collect();
    p.sort_unstable();
    p
}

/// The observations of `kind` naming `pid` the daemon took in (`state/inputs.jsonl`, which
/// records every input, also the repeats the engine keeps out of new incidents).
fn inputs_naming(d: &Daemon, kind: &str, pid: u32) -> usize {
    fn found(v: &Value, kind: &str, pid: u32) -> bool {
        match v {
            Value::Object(m) => {
                (v["signal"]["kind"] == kind && v["pids"] == serde_json::json!([pid]))
                    || m.values().any(|x| found(x, kind, pid))
            }
            Value::Array(a) => a.iter().any(|x| found(x, kind, pid)),
            _ => false,
        }
    }
    gpu_medic_testkit::journal::read(&d.path("state/inputs.jsonl"))
        .iter()
        .filter(|r| found(r, kind, pid))
        .count()
}

fn client(pid: u32, mib: u64) -> String {
    format!(r#"{{"pid": {pid}, "used_mib": {mib}}}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mps_contract_is_checked_per_process_per_container_and_per_task() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "mpslimits", 1).await;
    let me = &s.nodes[0];
    let ecs = aws_sdk_ecs::Client::new(&sdk);
    let fam = format!("{}-shared", s.cluster);
    ecs.register_task_definition()
        .family(&fam)
        .set_container_definitions(Some(vec![
            aws::mps_container("app", 2048, Some(50)),
            aws::mps_container("pair", 1024, None),
            aws::mps_container("main", 1024, None),
        ]))
        .send()
        .await
        .unwrap();
    let mut arns = Vec::new();
    for _ in 0..3 {
        arns.push(aws::start_task(&sdk, &s, &me.arn, None).await);
    }
    let id = |arn: &str| arn.rsplit('/').next().unwrap().to_string();
    let (arn_a, arn_b, arn_c) = (&arns[0], &arns[1], &arns[2]);
    let (app, pair, main) = (docker_id(1), docker_id(2), docker_id(3));
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&me.arn)), 0).await;
    agent.set_tasks(&[
        (arn_a, &fam, &[(&app, "app")]),
        (arn_b, &fam, &[(&pair, "pair")]),
        (arn_c, &fam, &[(&main, "main")]),
    ]);

    let start = |task: &str, c: &str, n, e: Vec<(String, String)>| {
        EcsTaskProcs::start_with_env(&id(task), c, n, &e)
            .unwrap_or_else(|why| panic!("real processes in ECS-shaped cgroups need root: {why}"))
    };
    let a_good = start(arn_a, &app, 1, env(Some("0=2048M"), Some("50"), 0));
    let a_none = start(arn_a, &app, 1, env(None, Some("50"), 0));
    let a_larger = start(arn_a, &app, 1, env(Some("0=4096M"), Some("50"), 0));
    let a_big_head = start(arn_a, &app, 1, env(Some("0=2G"), Some("50"), 1 << 20));
    let a_big_none = start(arn_a, &app, 1, env(None, None, 1 << 20));
    let b_two = start(arn_b, &pair, 2, env(Some("0=1024M"), None, 0));
    let c_client = start(arn_c, &main, 1, env(Some("0=1024M"), None, 0));
    let c_outside = start(arn_c, &main, 1, env(None, None, 0));
    // The gone process first: the pid reuse below starts the pid counter again at the loose
    // process's pid, and the next process the machine starts must not take the gone one's.
    let mut gone = Sleepers::start(1);
    let gone_pid = gone.pids()[0];
    gone.stop();
    let mut loose = Sleepers::start(1);
    let loose_pid = loose.pids()[0];
    let root = tempfile::Builder::new()
        .prefix("gm-ml-")
        .tempdir_in("/tmp")
        .unwrap();
    let mps = MpsDir::new(root.path().join("m"));
    let mps_pid = mps.start().expect("nvidia-cuda-mps-control -d");

    let port = gpu_medic_testkit::free_port();
    let mut d = aws::ecs_gpu_node(
        &s,
        0,
        &agent.url,
        &proxy.url,
        &format!(
            "[lifecycle]\nenabled = false\n[metrics]\nenabled = true\nlisten = \"127.0.0.1:{port}\""
        ),
    );
    let mut gpu1: Vec<String> = [&a_good, &a_none, &a_larger, &a_big_head, &a_big_none]
        .iter()
        .flat_map(|p| p.pids())
        .map(|p| client(p, 100))
        .collect();
    gpu1.extend(b_two.pids().into_iter().map(|p| client(p, 700)));
    let outside1 = [loose_pid, gone_pid, mps_pid]
        .map(|p| client(p, 300))
        .join(",");
    d.inject(&format!(
        r#"[{{"gpu": 1, "mps_clients": [{}], "compute_processes": [{outside1}]}},
            {{"gpu": 2, "mps_clients": [{}], "compute_processes": [{}]}}]"#,
        gpu1.join(","),
        client(c_client.pids()[0], 100),
        client(c_outside.pids()[0], 900),
    ));
    d.start();
    let addr = format!("127.0.0.1:{port}");

    // C's process outside MPS: C, and only C, is stopped.
    let bypass = d.wait_record(
        "the stop-tasks incident of task C's process outside MPS",
        Duration::from_secs(30),
        "opened",
        |r| r["rule"] == "mps-bypass-task",
    );
    assert_eq!(
        bypass["observation"]["tasks"],
        serde_json::json!([arn_c]),
        "{bypass:#}"
    );
    assert_eq!(
        bypass["observation"]["pids"],
        serde_json::json!([c_outside.pids()[0]])
    );
    assert_eq!(bypass["observation"]["gpu"]["index"], 2);
    let detail = bypass["observation"]["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!(
            "pid {} (sleep) runs outside MPS",
            c_outside.pids()[0]
        )) && detail.contains("900 MiB"),
        "{detail}"
    );
    wait_sync(
        "StopTask for task C",
        Duration::from_secs(30),
        || proxy.count_with("StopTask", &id(arn_c)) == 1,
        || format!("{:?}\n{}", proxy.ops(), d.log()),
    );
    assert_eq!(aws::task_desired(&sdk, &s.cluster, arn_c).await, "STOPPED");

    // The process in no task: logged.
    let loose_rec = d.wait_record(
        "the logged process outside MPS",
        Duration::from_secs(30),
        "opened",
        |r| r["rule"] == "mps-bypass",
    );
    assert_eq!(
        loose_rec["observation"]["pids"],
        serde_json::json!([loose_pid])
    );
    assert_eq!(loose_rec["verdict"], "log", "{loose_rec:#}");
    // Value 0 and no tasks (left out of the record).
    assert!(loose_rec["observation"]["value"].as_u64().unwrap_or(0) == 0);
    assert!(
        loose_rec["observation"]["tasks"]
            .as_array()
            .is_none_or(|t| t.is_empty())
    );

    // Limits: the client without one and the one with a larger one.
    wait_sync(
        "two limit mismatches",
        Duration::from_secs(30),
        || opened(&d, "mps-limit-mismatch").len() >= 2,
        || d.log(),
    );
    let mism = opened(&d, "mps-limit-mismatch");
    let mut want = vec![u64::from(a_none.pids()[0]), u64::from(a_larger.pids()[0])];
    want.sort_unstable();
    assert_eq!(pids_of(&mism), want, "{mism:#?}");
    for m in &mism {
        assert_eq!(m["observation"]["tasks"], serde_json::json!([arn_a]));
        let d = m["observation"]["detail"].as_str().unwrap();
        assert!(d.contains("its container reserves 2048 MiB"), "{d}");
        assert!(
            d.contains(&format!("{fam}:1")) && d.contains("container app"),
            "{d}"
        );
    }
    let larger = mism
        .iter()
        .find(|m| m["observation"]["pids"][0] == a_larger.pids()[0])
        .unwrap();
    assert_eq!(larger["observation"]["value"], 4096);

    // Two processes of B's container over its reservation.
    let pair_rec = d.wait_record(
        "B's container over its reservation",
        Duration::from_secs(30),
        "opened",
        |r| r["rule"] == "container-gpu-memory-over-reservation",
    );
    assert_eq!(pair_rec["observation"]["tasks"], serde_json::json!([arn_b]));
    let detail = pair_rec["observation"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("container pair: its 2 GPU processes together use 1400 MiB, the container reserves 1024 MiB"),
        "{detail}"
    );

    // The metrics: one process outside MPS on GPU 1 (the gone pid and the daemon are not),
    // one client without a memory limit and one with a larger one.
    wait_sync(
        "the contract's metrics",
        Duration::from_secs(10),
        || {
            let body = scrape(&addr);
            series(&body, "gpu_medic_mps_bypass_processes{gpu=\"1\"}") == Some(1.0)
                && series(
                    &body,
                    "gpu_medic_mps_limit_mismatch_clients{gpu=\"1\",limit=\"memory\",why=\"none\"}",
                ) == Some(1.0)
                && series(
                    &body,
                    "gpu_medic_mps_limit_mismatch_clients{gpu=\"1\",limit=\"memory\",why=\"larger\"}",
                ) == Some(1.0)
        },
        || scrape(&addr),
    );

    // A healthy stretch of many polls: nothing more is reported.
    d.wait_nvml_polls("a stretch of polls", 10);
    assert_eq!(opened(&d, "mps-limit-mismatch").len(), 2);
    assert_eq!(opened(&d, "mps-bypass").len(), 1);
    assert_eq!(
        inputs_naming(&d, "mps-bypass", loose_pid),
        1,
        "once per process"
    );
    assert_eq!(opened(&d, "mps-bypass-task").len(), 1);
    assert_eq!(opened(&d, "container-gpu-memory-over-reservation").len(), 1);
    assert_eq!(proxy.count("StopTask"), 1, "{:?}", proxy.ops());
    for t in [arn_a, arn_b] {
        assert_eq!(aws::task_desired(&sdk, &s.cluster, t).await, "RUNNING");
    }

    // The loose process exits and a new process takes its pid: another process, reported.
    loose.stop();
    let _reuse = Sleepers::start_at_pid(loose_pid, 2000)
        .unwrap_or_else(|| panic!("could not spawn a process at pid {loose_pid}"));
    wait_sync(
        "the process that reused the pid, reported",
        Duration::from_secs(30),
        || inputs_naming(&d, "mps-bypass", loose_pid) == 2,
        || d.log(),
    );
    // Within the engine's 10-minute repeat window a log-only repeat opens no new incident
    // (the next incident counts it).
    d.wait_nvml_polls("polls after the repeat", 5);
    assert_eq!(inputs_naming(&d, "mps-bypass", loose_pid), 2);

    // Never a finding for a correctly limited client, the 1 MiB environments, the gone pid or
    // the MPS daemon.
    let quiet = [
        a_good.pids()[0],
        a_big_head.pids()[0],
        a_big_none.pids()[0],
        c_client.pids()[0],
        gone_pid,
        mps_pid,
    ];
    // (NVIDIA's real daemon runs no server without a GPU, tests/support/MPS-FACTS.md §7: MPS's
    // own view finds each MPS client the fake libnvidia-ml lists served by no server of it,
    // `mps-client-no-server`, which tests/mps_view.rs tests; not what this test is about.)
    for r in d
        .records()
        .iter()
        .filter(|r| r["event"] == "opened" && r["rule"] != "mps-client-no-server")
    {
        let pids = pids_of(std::slice::from_ref(r));
        assert!(
            !quiet.iter().any(|q| pids.contains(&u64::from(*q))),
            "{r:#}"
        );
    }
    d.signal(libc::SIGTERM);
    mps.shutdown();
}
