//! Whose fault is it (docs/attribution.md), end to end through the real `gpu-medic run` binary:
//! the driver's XID lines written to the kernel log file the daemon reads, four GPUs from the
//! fake libnvidia-ml, and
//!
//! - with ECS: real processes in ECS-shaped cgroups (`kit::proc::EcsTaskProcs`), the kit's
//!   `FakeAgent` answering `/v1/tasks` (the agent exists only on an instance) and moto behind
//!   the kit's proxy. One task faulting sixteen times leaves the instance ACTIVE and names the
//!   task; one task on four GPUs the same; a fault charged to the MPS server names the GPU's
//!   client task; six tasks faulting at one GPC/TPC drain the instance.
//! - without ECS cgroups (the held-back case): the process name is the unit, also for a name
//!   that is not UTF-8, a pid that is gone or now another program's, and a storm of one
//!   program's XIDs is one incident while an XID 79 after it is decided.
//!
//! The processes stand in for CUDA programs (there is no GPU here); the XID lines are the
//! driver's format (NVIDIA's catalog, public kernel logs).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::io::Write;
use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::mps::HostMpsPair;
use gpu_medic_testkit::proc::EcsTaskProcs;
use gpu_medic_testkit::{Daemon, FOUR_GPUS, wait_sync};
use serde_json::Value;

const BUSES: [&str; 4] = ["0000:10:00", "0000:20:00", "0000:30:00", "0000:40:00"];

/// A kmsg record of the driver's XID line (kernel facility, level 4), stamped now.
fn xid_line(seq: u64, gpu: usize, code: u32, pid: u32, name: &str, text: &str) -> String {
    format!(
        "4,{seq},{},-;NVRM: Xid (PCI:{}): {code}, pid={pid}, name={name}, {text}",
        gpu_medic_testkit::proc::uptime_usec(),
        BUSES[gpu]
    )
}

fn warp(gpc: u32, tpc: u32) -> String {
    format!("Graphics SM Warp Exception on (GPC {gpc}, TPC {tpc}, SM 0): Out Of Range Address")
}

const MMU: &str = "channel 0x0000001a, intr 00000000. MMU Fault: ENGINE GRAPHICS GPC3 GPCCLIENT_T1_5 faulted @ 0x725f_fb800000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ";

/// XID observations journaled so far.
fn xid_inputs(d: &Daemon) -> usize {
    std::fs::read_to_string(d.path("state/inputs.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"kind\":\"xid\""))
        .count()
}

fn wait_inputs(d: &Daemon, n: usize) {
    wait_sync(
        &format!("{n} XIDs journaled"),
        Duration::from_secs(60),
        || xid_inputs(d) >= n,
        || d.log(),
    );
}

fn opened(d: &Daemon) -> Vec<Value> {
    gpu_medic_testkit::journal::events(&d.records(), "opened")
}

fn culprit(r: &Value) -> &Value {
    &r["observation"]["xid"]["culprit"]
}

/// Container ids as ECS's: hex, unique to this run.
fn container(n: u32) -> String {
    format!("{:08x}{n:08x}{}", std::process::id(), "c0ffee".repeat(8))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_task_stays_in_service_and_different_tasks_at_one_place_drain() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "attrib", 1).await;
    let me = &s.nodes[0];
    let mut arns = Vec::new();
    for _ in 0..8 {
        arns.push(aws::start_task(&sdk, &s, &me.arn, None).await);
    }
    let id = |arn: &str| arn.rsplit('/').next().unwrap().to_string();
    // Task 0 is the buggy trainer, 1 to 6 replicas of one batch service, 7 an MPS client.
    let procs: Vec<EcsTaskProcs> = (0..8)
        .map(|i| {
            EcsTaskProcs::start(&id(&arns[i]), &container(i as u32), 1).unwrap_or_else(|e| {
                panic!("this test needs root and a cgroup v1 pids hierarchy: {e}")
            })
        })
        .collect();
    let pid = |i: usize| procs[i].pids()[0];
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&me.arn)), 0).await;
    let containers: Vec<String> = (0..8).map(container).collect();
    let c: Vec<[(&str, &str); 1]> = containers.iter().map(|c| [(c.as_str(), "main")]).collect();
    let family = |i: usize| match i {
        0 => "trainer",
        7 => "inference",
        _ => "batch",
    };
    let listed: Vec<gpu_medic_testkit::imds::AgentTask> = (0..8)
        .map(|i| (arns[i].as_str(), family(i), &c[i][..]))
        .collect();
    agent.set_tasks(&listed);

    let mut d = aws::ecs_gpu_node(&s, 0, &agent.url, &proxy.url, "");
    // The MPS daemon and server as the kernel knows them (executables, parent, cgroup).
    let mps = HostMpsPair::start(d.dir());
    d.mps_lines(&format!(
        "control_binary = \"{}\"",
        mps.control_binary.display()
    ));
    d.start();
    d.wait_polled();

    // One task, sixteen faults on GPU 0, at several places: its own bug. (The processes are
    // `sleep`s standing in for CUDA programs: the driver prints the process's `comm`.)
    let lines: Vec<String> = (0..16)
        .map(|i| xid_line(1 + i, 0, 13, pid(0), "sleep", &warp(i as u32 % 4, 1)))
        .collect();
    d.kmsg_append(&lines);
    wait_inputs(&d, 16);
    let o = opened(&d);
    assert_eq!(o.len(), 1, "{o:#?}");
    assert_eq!(o[0]["rule"], "xid-13-graphics-exception", "{:#}", o[0]);
    assert_eq!(o[0]["verdict"], "log");
    assert_eq!(culprit(&o[0])["task"], arns[0].as_str(), "{:#}", o[0]);
    assert_eq!(culprit(&o[0])["definition"], "trainer:1");
    assert_eq!(culprit(&o[0])["container"], "main");
    assert_eq!(o[0]["observation"]["xid"]["site"]["gpc"], 0);
    // The same task on all four GPUs: still its own.
    let lines: Vec<String> = (0..4)
        .map(|g| xid_line(20 + g as u64, g, 31, pid(0), "sleep", MMU))
        .collect();
    d.kmsg_append(&lines);
    wait_inputs(&d, 20);
    let (status, _, _) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert_eq!(status, "ACTIVE");
    assert_eq!(
        proxy.count("UpdateContainerInstancesState"),
        0,
        "{:?}",
        proxy.ops()
    );
    let show = d.cli(&["incidents", "show", "1"]);
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(show.status.success(), "{show:?}");
    for want in [
        format!("who:      task definition trainer:1 (task {}", arns[0]),
        "where:    GPC 0, TPC 1, SM 0".to_string(),
        "judged:   the application's".to_string(),
    ] {
        assert!(text.contains(&want), "{want:?} not in:\n{text}");
    }

    // The driver names the MPS server: GPU 1's only client task is charged. The polls that
    // read the client list also read the temperature (90 C, logged on the third poll): once
    // that incident is open, the polls have the client.
    d.inject(&format!(
        r#"{{"gpu": 1, "temperature": 90, "mps_clients": [{}]}}"#,
        pid(7)
    ));
    d.wait_record(
        "three polls with the MPS client",
        Duration::from_secs(20),
        "opened",
        |r| r["observation"]["signal"]["kind"] == "thermal",
    );
    d.kmsg_append(&[xid_line(30, 1, 31, mps.server_pid, "nvidia-cuda-mps", MMU)]);
    let r = d.wait_record(
        "the MPS client's fault",
        Duration::from_secs(20),
        "opened",
        |r| culprit(r)["via"] == "mps-client",
    );
    assert_eq!(culprit(&r)["task"], arns[7].as_str(), "{r:#}");
    assert_eq!(culprit(&r)["definition"], "inference:1");

    // Six tasks (replicas of one service) each faulting only at GPC 3, TPC 1 of GPU 2: the
    // place is the GPU's.
    let lines: Vec<String> = (1..=6)
        .map(|i| xid_line(40 + i as u64, 2, 13, pid(i), "sleep", &warp(3, 1)))
        .collect();
    d.kmsg_append(&lines);
    let r = d.wait_record(
        "the hardware suspicion",
        Duration::from_secs(30),
        "opened",
        |r| r["verdict"] == "drain",
    );
    assert_eq!(r["rule"], "xid-13-graphics-exception/suspect", "{r:#}");
    assert!(
        r["reason"].as_str().unwrap().contains("GPC 3, TPC 1"),
        "{r:#}"
    );
    assert_eq!(r["observation"]["gpu"]["index"], 2);
    wait_sync(
        "the instance DRAINING",
        Duration::from_secs(30),
        || proxy.count("UpdateContainerInstancesState") > 0,
        || format!("{:?}\n{}", proxy.ops(), d.log()),
    );
    d.signal(libc::SIGTERM);
    drop(procs);
}

#[test]
fn without_ecs_the_executable_is_the_unit_and_a_name_is_nobody() {
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    d.gpus(FOUR_GPUS);
    d.start();
    d.wait_polled();
    // A program with no process left (the pid is gone): sixteen faults, one incident, and
    // nobody charged: the name is the process's own choice.
    let lines: Vec<String> = (0..16)
        .map(|i| xid_line(1 + i, 0, 13, 4_000_000 + i as u32, "trainer", &warp(1, 2)))
        .collect();
    d.kmsg_append(&lines);
    wait_inputs(&d, 16);
    let o = opened(&d);
    assert_eq!(o.len(), 1, "{o:#?}");
    assert_eq!(culprit(&o[0])["program"], "trainer");
    assert!(
        culprit(&o[0])["why"].as_str().unwrap().contains("exited"),
        "{:#}",
        o[0]
    );
    assert!(culprit(&o[0]).get("task").is_none() && culprit(&o[0]).get("exe").is_none());

    // A record stamped before this test's own process started names its pid: another
    // process had it then.
    let me = std::process::id();
    d.kmsg_append(&[format!(
        "4,30,1,-;NVRM: Xid (PCI:{}): 31, pid={me}, name=python3, {MMU}",
        BUSES[1]
    )]);
    let r = d.wait_record("the reused pid", Duration::from_secs(20), "opened", |r| {
        culprit(r)["program"] == "python3"
    });
    assert!(
        culprit(&r)["why"].as_str().unwrap().contains("reused"),
        "{r:#}"
    );
    assert!(culprit(&r).get("task").is_none(), "{r:#}");
    assert!(culprit(&r).get("exe").is_none(), "{r:#}");

    // Three processes gone before they could be looked up, each with another name (one not
    // UTF-8), at GPC 1, TPC 2 of GPU 0: three names are not three programs.
    let mut raw = format!(
        "4,40,{},-;NVRM: Xid (PCI:0000:10:00): 13, pid=4100000, name=tr",
        gpu_medic_testkit::proc::uptime_usec()
    )
    .into_bytes();
    raw.extend_from_slice(b"\xff\xfein, ");
    raw.extend_from_slice(warp(1, 2).as_bytes());
    raw.push(b'\n');
    std::fs::OpenOptions::new()
        .append(true)
        .open(d.path("kmsg"))
        .unwrap()
        .write_all(&raw)
        .unwrap();
    d.kmsg_append(&[xid_line(41, 0, 13, 4_100_001, "ffmpeg", &warp(1, 2))]);
    wait_inputs(&d, 19);
    assert!(
        !d.records()
            .iter()
            .any(|r| r["rule"] == "xid-13-graphics-exception/suspect"),
        "names alone drained the node: {:#?}",
        opened(&d)
    );

    // Three live programs outside ECS, each from an executable of its own, at GPC 5, TPC 5
    // of GPU 1: the place is the GPU's.
    let bins = tempfile::tempdir().unwrap();
    let mut progs = gpu_medic_testkit::proc::Sleepers::start(0);
    for name in ["render", "encode", "infer"] {
        let exe = gpu_medic_testkit::proc::stand_in(bins.path(), name);
        progs.join(gpu_medic_testkit::proc::Sleepers::start_exe(&exe, name));
    }
    let lines: Vec<String> = progs
        .pids()
        .iter()
        .enumerate()
        .map(|(i, p)| xid_line(50 + i as u64, 1, 13, *p, "same-name", &warp(5, 5)))
        .collect();
    d.kmsg_append(&lines);
    let r = d.wait_record(
        "the hardware suspicion",
        Duration::from_secs(20),
        "opened",
        |r| r["rule"] == "xid-13-graphics-exception/suspect",
    );
    assert_eq!(r["verdict"], "drain", "{r:#}");
    assert!(
        culprit(&r)["exe"]
            .as_str()
            .is_some_and(|e| e.contains("infer") || e.contains("render") || e.contains("encode")),
        "{r:#}"
    );
    drop(progs);

    // A storm of one program's XID 13 on GPU 2, then an XID 79 on GPU 3: one incident for the
    // storm, and the fallen GPU decided (first: it overtakes the storm).
    let mut lines: Vec<String> = (0..10_000u64)
        .map(|i| {
            xid_line(
                100 + i,
                2,
                13,
                4_200_000,
                "storm",
                &warp((i % 8) as u32, (i % 9) as u32),
            )
        })
        .collect();
    lines.push(xid_line(
        20_000,
        3,
        79,
        0,
        "<unknown>",
        "GPU has fallen off the bus.",
    ));
    d.kmsg_append(&lines);
    d.wait_record("the XID 79", Duration::from_secs(120), "opened", |r| {
        r["observation"]["signal"]["code"] == 79
    });
    wait_inputs(&d, 22 + 10_001);
    let storm = opened(&d)
        .into_iter()
        .filter(|r| culprit(r)["program"] == "storm")
        .count();
    assert_eq!(storm, 1);
    d.signal(libc::SIGTERM);

    // The journaled inputs replay to the same judgement; `policy explain` gives the workflow.
    let inputs = d.path("state/inputs.jsonl");
    let out = d.cli(&["policy", "simulate", inputs.to_str().unwrap()]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(text.contains("xid-13-graphics-exception/suspect"), "{text}");
    let out = d.cli(&["policy", "explain", "--xid", "13"]);
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "workflow:",
        "WORKFLOW_XID_13",
        "3 different programs",
        "diagnose:",
    ] {
        assert!(text.contains(want), "{want:?} not in:\n{text}");
    }
}
