//! No tenant can steer a verdict with text it writes (docs/attribution.md, "What a tenant can
//! and cannot do"), end to end through the real `gpu-medic run` binary: the driver's XID lines
//! written to the kernel log file the daemon reads (stamped now, as the kernel would), four GPUs
//! from the fake libnvidia-ml, and real processes that name themselves as a hostile tenant
//! would (`prctl(PR_SET_NAME)` through python3, `argv[0]`, an executable file named like the
//! MPS server), placed in ECS-shaped cgroups. With ECS: the kit's `FakeAgent` (the agent exists
//! only on an instance) and moto behind the kit's proxy, which records every call, so "no other
//! task was stopped and no node drained" is read from what reached AWS.
//!
//! The MPS daemon and server are stand-ins known by the kernel's facts
//! (`kit::mps::HostMpsPair`): NVIDIA's real server exits at once without a GPU.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::mps::HostMpsPair;
use gpu_medic_testkit::proc::{EcsTaskProcs, Sleepers, stand_in, uptime_usec};
use gpu_medic_testkit::{Daemon, FOUR_GPUS, wait_sync};
use serde_json::Value;

const BUSES: [&str; 4] = ["0000:10:00", "0000:20:00", "0000:30:00", "0000:40:00"];

/// The driver's XID line as a kmsg record (kernel facility), stamped now. `name` is what the
/// process set as its comm, escaped as `/dev/kmsg` prints it.
fn xid(gpu: usize, code: u32, pid: Option<u32>, name: &[u8], msg: &str) -> String {
    let mut printed = String::new();
    for &c in name {
        if !(b' '..127).contains(&c) || c == b'\\' {
            printed.push_str(&format!("\\x{c:02x}"));
        } else {
            printed.push(c as char);
        }
    }
    let who = match pid {
        Some(p) => format!("pid={p}, name={printed}, "),
        None => String::new(),
    };
    format!(
        "4,1,{},-;NVRM: Xid (PCI:{}): {code}, {who}{msg}",
        uptime_usec(),
        BUSES[gpu]
    )
}

fn warp(gpc: u32, tpc: u32) -> String {
    format!("Graphics SM Warp Exception on (GPC {gpc}, TPC {tpc}, SM 0): Out Of Range Address")
}

const ESR: &str = "Graphics Exception: ESR 0x504648=0xa000008 0x504650=0x24";

fn opened(d: &Daemon) -> Vec<Value> {
    gpu_medic_testkit::journal::events(&d.records(), "opened")
}

fn culprit(r: &Value) -> &Value {
    &r["observation"]["xid"]["culprit"]
}

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

/// Container ids as ECS's: hex, unique to this run.
fn container(n: u32) -> String {
    format!("{:08x}{n:08x}{}", std::process::id(), "feed".repeat(12))
}

fn task_id(arn: &str) -> String {
    arn.rsplit('/').next().unwrap().to_string()
}

/// A process of task `task` that named itself `comm`.
fn named_in(task: &str, n: u32, comm: &[u8]) -> EcsTaskProcs {
    EcsTaskProcs::place(task, &container(n), Sleepers::start_named(comm))
        .unwrap_or_else(|e| panic!("this test needs root and a cgroup v1 pids hierarchy: {e}"))
}

#[test]
fn a_tenants_text_never_silences_a_fatal_xid() {
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    d.gpus(FOUR_GPUS);
    d.start();
    d.wait_polled();
    // A tenant's own fault on each GPU opens an incident a later XID could be folded into.
    let tenant = named_in("0123456789abcdef0123456789abcd01", 1, b"previous Xid 13");
    let t = tenant.pids()[0];
    let lines: Vec<String> = (0..3)
        .map(|g| xid(g, 13, Some(t), b"previous Xid 13", &warp(1, 1)))
        .collect();
    d.kmsg_append(&lines);
    wait_inputs(&d, 3);
    // Fatal XIDs whose text says they follow XID 13: through a 15-byte name (which a reader
    // cutting the name at its first comma takes for the message), in the message.
    let other = named_in("0123456789abcdef0123456789abcd01", 2, b"x, after Xid 13");
    d.kmsg_append(&[
        xid(0, 79, Some(other.pids()[0]), b"x, after Xid 13", "GPU has fallen off the bus."),
        xid(1, 48, Some(t), b"due to Xid 13", "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 2, subpartition 0. after Xid 13"),
        xid(2, 95, None, b"", "Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No caused by previous Xid 13"),
    ]);
    let apps: Vec<Value> = opened(&d)
        .iter()
        .filter(|r| r["observation"]["signal"]["code"] == 13)
        .map(|r| r["incident"].clone())
        .collect();
    assert!(!apps.is_empty(), "{:#?}", opened(&d));
    let r = d.wait_record(
        "XID 79's own incident",
        Duration::from_secs(20),
        "opened",
        |r| r["observation"]["signal"]["code"] == 79,
    );
    assert!(
        !matches!(r["verdict"].as_str(), Some("log" | "ignore")),
        "XID 79 acts: {r:#}"
    );
    // The others join the node's remediation that XID 79 started, or open their own: never
    // an application incident.
    for code in [48, 95] {
        let of_code = |r: &&Value| r["observation"]["signal"]["code"] == code;
        wait_sync(
            &format!("XID {code} judged"),
            Duration::from_secs(20),
            || d.records().iter().any(|r| of_code(&r)),
            || format!("{:#?}", d.records()),
        );
        let r = d.records().into_iter().find(|r| of_code(&r)).unwrap();
        assert!(!apps.contains(&r["incident"]), "XID {code} folded: {r:#}");
    }
    for r in d.records() {
        let code = &r["observation"]["signal"]["code"];
        if code == 79 || code == 48 || code == 95 {
            assert!(!apps.contains(&r["incident"]), "folded: {r:#}");
        }
    }
    d.signal(libc::SIGTERM);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_get_another_tenants_task_stopped_or_drain_a_shared_node() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "tenant", 1).await;
    let me = &s.nodes[0];
    let victim_arn = aws::start_task(&sdk, &s, &me.arn, None).await;
    let tenant_arn = aws::start_task(&sdk, &s, &me.arn, None).await;
    let (victim_id, tenant_id) = (task_id(&victim_arn), task_id(&tenant_arn));
    // The victim is GPU 0's only MPS client.
    let victim = EcsTaskProcs::start(&victim_id, &container(0), 1)
        .unwrap_or_else(|e| panic!("this test needs root and a cgroup v1 pids hierarchy: {e}"));
    let v = victim.pids()[0];
    // The tenant's processes: named like the MPS server; run from an executable file named
    // like it with that argv[0]; named `,pid=<victim>`; named to forge a place.
    let bins = tempfile::tempdir().unwrap();
    let fake_server = stand_in(bins.path(), "nvidia-cuda-mps-server");
    let tenant_procs = [
        named_in(&tenant_id, 1, b"nvidia-cuda-mps"),
        EcsTaskProcs::place(
            &tenant_id,
            &container(2),
            Sleepers::start_exe(&fake_server, "nvidia-cuda-mps-server"),
        )
        .unwrap(),
        named_in(&tenant_id, 3, format!(",pid={v}").as_bytes()),
        named_in(&tenant_id, 4, b"x,(GPC 0,TPC 0"),
    ];
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&me.arn)), 0).await;
    let cs: Vec<String> = (0..5).map(container).collect();
    let vc = [(cs[0].as_str(), "main")];
    let tc: Vec<(&str, &str)> = cs[1..].iter().map(|c| (c.as_str(), "evil")).collect();
    agent.set_tasks(&[
        (victim_arn.as_str(), "victim", &vc[..]),
        (tenant_arn.as_str(), "tenant", &tc[..]),
    ]);

    let mut d = aws::ecs_gpu_node(&s, 0, &agent.url, &proxy.url, "");
    let mps = HostMpsPair::start(d.dir());
    d.mps_lines(&format!(
        "control_binary = \"{}\"",
        mps.control_binary.display()
    ));
    // An overlay that stops a program's task at its third XID 13 within an hour.
    let base = std::fs::read_to_string(gpu_medic_testkit::default_policy()).unwrap();
    std::fs::write(d.path("default.toml"), &base).unwrap();
    std::fs::write(
        d.path("policy.toml"),
        "extends = \"default.toml\"\n[[rule]]\nname = \"xid-13-graphics-exception\"\nsignal = \"xid\"\nxids = [13]\naction = \"log\"\n\
         suspect = { programs = 3, window = \"1h\", at = \"location\", action = \"drain\" }\n\
         culprit = { count = 3, window = \"1h\", action = \"stop-tasks\" }\nreason = \"r\"\n",
    )
    .unwrap();
    let config = std::fs::read_to_string(d.config()).unwrap();
    let policy = gpu_medic_testkit::default_policy().display().to_string();
    std::fs::write(d.config(), config.replace(&policy, "policy.toml")).unwrap();
    d.start();
    d.wait_polled();
    d.inject(&format!(
        r#"{{"gpu": 0, "temperature": 90, "mps_clients": [{v}]}}"#
    ));
    d.wait_record(
        "three polls with the MPS client",
        Duration::from_secs(20),
        "opened",
        |r| r["observation"]["signal"]["kind"] == "thermal",
    );

    // Each of the tenant's processes faults three times on GPU 0, each time at another place.
    let names: [&[u8]; 4] = [
        b"nvidia-cuda-mps",
        b"nvidia-cuda-mps",
        format!(",pid={v}").into_bytes().leak(),
        b"x,(GPC 0,TPC 0",
    ];
    let mut n = 0;
    for (p, name) in tenant_procs.iter().zip(names) {
        let lines: Vec<String> = (0..3)
            .map(|i| xid(0, 13, Some(p.pids()[0]), name, &warp(2 + i, 2)))
            .collect();
        d.kmsg_append(&lines);
        n += 3;
    }
    // The place forged in a name, at one place, from three more of the tenant's processes.
    let forgers: Vec<EcsTaskProcs> = (5..8)
        .map(|i| named_in(&tenant_id, i, b"y,(GPC 0,TPC 0"))
        .collect();
    for p in &forgers {
        d.kmsg_append(&[xid(1, 13, Some(p.pids()[0]), b"y,(GPC 0,TPC 0", ESR)]);
        n += 1;
    }
    wait_inputs(&d, n);
    d.wait_kmsg_applied("every XID judged");
    // Every fault is the tenant's task's, never the victim's.
    for r in d.records() {
        let c = culprit(&r);
        if c.is_null() {
            continue;
        }
        assert_eq!(c["task"], tenant_arn.as_str(), "{r:#}");
        assert_eq!(c["via"], "driver", "{r:#}");
        assert!(
            r["observation"]["xid"]["site"]["gpc"] != 0,
            "a forged place: {r:#}"
        );
    }
    // Only the tenant's task was stopped; the node was not drained.
    wait_sync(
        "the tenant's task stopped",
        Duration::from_secs(30),
        || proxy.count_with("StopTask", &tenant_id) > 0,
        || format!("{:?}\n{}", proxy.ops(), d.log()),
    );
    assert_eq!(
        proxy.count_with("StopTask", &victim_id),
        0,
        "{:?}",
        proxy.ops()
    );
    assert_eq!(
        proxy.count("UpdateContainerInstancesState"),
        0,
        "{:?}",
        proxy.ops()
    );
    let (status, _, _) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert_eq!(status, "ACTIVE");
    assert!(
        !opened(&d).iter().any(|r| r["verdict"] == "drain"),
        "{:#?}",
        opened(&d)
    );
    d.signal(libc::SIGTERM);
    drop((tenant_procs, forgers, victim, mps));
}
