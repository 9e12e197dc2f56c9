//! End to end through the real `gpu-medic run` binary: the fake libnvidia-ml (tests/fake-nvml,
//! built for the test kit) reports XID 79, the default policy says replace, and the
//! daemon quarantines, drains and replaces the instance in moto, reached through the standard
//! AWS environment (AWS_ENDPOINT_URL, static credentials, AWS_REGION). The incident lists each
//! call with its request id. A second test SIGKILLs the daemon mid-drain and restarts it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy, Seeded};
use gpu_medic_testkit::journal::{request_ids, started_commands};
use gpu_medic_testkit::{Daemon, wait_for};
use serde_json::Value;

/// Node 0 of `s` on the fake GPUs, every AWS service at `endpoint`; `ecs`: extra `[ecs]`
/// lines; `top`: top-level keys (`dry_run = true`).
fn daemon(s: &Seeded, endpoint: &str, ecs: &str, top: &str) -> Daemon {
    let fleet = "claim_settle = \"200ms\"\nretry_after = \"1s\"";
    aws::node(s, 0, Some(endpoint), top, ecs, fleet, "")
}

/// Starts it and lets the first NVML poll establish its baselines.
fn start(d: &mut Daemon) {
    d.start();
    d.wait_polled();
}

fn incident(d: &Daemon, id: u32) -> Value {
    let v = d.incident(id);
    assert!(!v.is_null(), "no incident {id}; log: {}", d.log());
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_79_drains_stops_tasks_and_replaces_through_the_real_binary() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "e2e", 3).await;
    let me = &s.nodes[0];
    let standalone = aws::start_task(&sdk, &s, &me.arn, None).await;
    let service = aws::start_task(&sdk, &s, &me.arn, Some("service:web")).await;
    let mut d = daemon(&s, &proxy.url, "standalone_grace = \"500ms\"", "");
    start(&mut d);
    d.inject(r#"{"gpu": 0, "xid": 79}"#);

    // The ECS scheduler, played: the service task is replaced elsewhere once draining starts.
    wait_for("DRAINING", Duration::from_secs(30), || async {
        aws::instance(&sdk, &s.cluster, &me.arn).await.0 == "DRAINING"
    })
    .await;
    aws::stop(&sdk, &s.cluster, &service).await;
    wait_for(
        "Unhealthy in Auto Scaling",
        Duration::from_secs(30),
        || async {
            aws::asg_health(&sdk, &s.asg)
                .await
                .contains(&(me.instance_id.clone(), "Unhealthy".into()))
        },
    )
    .await;
    wait_for("the incident to close", Duration::from_secs(10), || async {
        d.incident(1)["state"] == "replaced"
    })
    .await;
    d.signal(libc::SIGTERM);

    let (status, running, attrs) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert_eq!((status.as_str(), running), ("DRAINING", 0));
    assert!(attrs.contains(&("gpu-medic.health".into(), Some("faulted".into()))));
    assert_eq!(
        aws::task_desired(&sdk, &s.cluster, &standalone).await,
        "STOPPED"
    );
    let inc = incident(&d, 1);
    assert_eq!(inc["signal"], "xid 79", "{inc:#}");
    assert_eq!(
        started_commands(&inc),
        ["quarantine", "drain", "replace"],
        "{inc:#}"
    );
    for op in [
        "PutAttributes",
        "UpdateContainerInstancesState",
        "StopTask",
        "SetInstanceHealth",
    ] {
        let ids = request_ids(&inc, op);
        assert!(
            !ids.is_empty() && ids.iter().all(|r| r.len() > op.len() + 20),
            "{op}: {ids:?} in {inc:#}"
        );
    }
    assert_eq!(request_ids(&inc, "UpdateContainerInstancesState").len(), 1);
    assert_eq!(
        proxy.count_with("SetInstanceHealth", "ShouldRespectGracePeriod=false"),
        1
    );
    assert_eq!(proxy.count("TerminateInstanceInAutoScalingGroup"), 0);
    assert!(!d.log().contains("\"level\":\"ERROR\""), "{}", d.log());
    // `status` shows the node's phase and the fleet budget the gate saw.
    let out = d.cli(&["status", "--json"]);
    let st: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["node_phase"], "replaced", "{st:#}");
    assert!(
        st["fleet"]["group"]
            .as_str()
            .unwrap()
            .ends_with(s.asg.as_str()),
        "{st:#}"
    );
    assert!(st["fleet"]["budget"].as_u64().unwrap() >= 1, "{st:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_drain_and_restart_resumes_without_repeating_a_step() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "e2e-kill", 3).await;
    let me = &s.nodes[0];
    let standalone = aws::start_task(&sdk, &s, &me.arn, None).await;
    let service = aws::start_task(&sdk, &s, &me.arn, Some("service:web")).await;
    let mut d = daemon(&s, &proxy.url, "standalone_grace = \"2s\"", "");
    start(&mut d);
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for("DRAINING", Duration::from_secs(30), || async {
        aws::instance(&sdk, &s.cluster, &me.arn).await.0 == "DRAINING"
    })
    .await;
    d.signal(libc::SIGKILL);
    assert_eq!(
        aws::task_desired(&sdk, &s.cluster, &standalone).await,
        "RUNNING"
    );

    start(&mut d);
    // The standalone grace runs out and the scheduler replaces the service task.
    wait_for(
        "the standalone task to stop",
        Duration::from_secs(15),
        || async { aws::task_desired(&sdk, &s.cluster, &standalone).await == "STOPPED" },
    )
    .await;
    aws::stop(&sdk, &s.cluster, &service).await;
    wait_for(
        "Unhealthy in Auto Scaling",
        Duration::from_secs(30),
        || async {
            aws::asg_health(&sdk, &s.asg)
                .await
                .contains(&(me.instance_id.clone(), "Unhealthy".into()))
        },
    )
    .await;
    wait_for("the incident to close", Duration::from_secs(10), || async {
        d.incident(1)["state"] == "replaced"
    })
    .await;
    d.signal(libc::SIGTERM);

    assert!(
        d.log().contains("resuming order left in flight"),
        "{}",
        d.log()
    );
    let inc = incident(&d, 1);
    assert_eq!(
        started_commands(&inc),
        ["quarantine", "drain", "replace"],
        "{inc:#}"
    );
    // Each step once: one quarantine, one claim, one DRAINING, one stop of ours, one Unhealthy.
    assert_eq!(proxy.count_with("PutAttributes", "health"), 1);
    assert_eq!(proxy.count_with("PutAttributes", "claim"), 1);
    assert_eq!(proxy.count("UpdateContainerInstancesState"), 1);
    assert_eq!(proxy.count_with("StopTask", "standalone"), 1);
    assert_eq!(proxy.count("SetInstanceHealth"), 1);
    let drain = inc["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| {
            r["event"] == "action-finished"
                && r["outcome"]["detail"]
                    .as_str()
                    .is_some_and(|d| d.contains("drain"))
        })
        .unwrap_or_else(|| panic!("{inc:#}"));
    assert!(
        drain["outcome"]["detail"]
            .as_str()
            .unwrap()
            .starts_with("resumed drain: drained"),
        "{drain:#}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_records_the_plan_and_makes_no_call() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "e2e-dry", 3).await;
    // No read either: ECS's GPU view (a read every interval) is off, so any call is a fault.
    let mut d = daemon(&s, &proxy.url, "gpu_view = false", "dry_run = true");
    let seeded = proxy.calls().len();
    start(&mut d);
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for("the incident", Duration::from_secs(20), || async {
        d.incident(1)["state"] == "observed"
    })
    .await;
    d.signal(libc::SIGTERM);
    let inc = incident(&d, 1);
    assert_eq!(
        started_commands(&inc),
        ["quarantine", "drain", "replace"],
        "{inc:#}"
    );
    assert_eq!(proxy.calls().len(), seeded, "{:?}", &proxy.ops()[seeded..]);
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[0].arn).await.0,
        "ACTIVE"
    );
}
