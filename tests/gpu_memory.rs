//! GPU memory per ECS task on MPS-shared GPUs, through the real `gpu-medic run`: the MPS
//! clients are real processes in ECS-shaped cgroups (`kit::proc::EcsTaskProcs`, the cgroup v1
//! `/ecs/<task>/<container>` layout), the fake libnvidia-ml reports each one's used memory
//! (changing over time, as a model loads), and the metrics endpoint shows each task's sum per
//! GPU. The ECS agent is not involved here ([aws] off): series are labelled by task id.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::http::{scrape, series};
use gpu_medic_testkit::proc::EcsTaskProcs;
use gpu_medic_testkit::{Daemon, FOUR_GPUS, wait_sync};

fn clients(pids: &[u32], mib: u64) -> String {
    pids.iter()
        .map(|p| format!(r#"{{"pid": {p}, "used_mib": {mib}}}"#))
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn the_metrics_endpoint_shows_each_tasks_gpu_memory_per_gpu() {
    const TASK_A: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f9";
    const TASK_B: &str = "f9e8d7c6b5a4938271605f4e3d2c1b0a";
    let a = match EcsTaskProcs::start(TASK_A, "c0ffee01", 2) {
        Ok(p) => p,
        // Fails, never passes silently: CI runs as root (scripts/test.sh, .ci/run).
        Err(why) => panic!(
            "real processes in ECS-shaped cgroups need root (run the suite as root, as CI does): {why}"
        ),
    };
    let b = EcsTaskProcs::start(TASK_B, "c0ffee02", 1).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut node = Daemon::fake_gpu_node(
        &format!(
            "tick_interval = \"100ms\"\n[metrics]\nenabled = true\nlisten = \"127.0.0.1:{port}\""
        ),
        "poll_interval = \"200ms\"",
    );
    node.gpus(FOUR_GPUS);
    // Task A's two processes on GPU 1; task B's one on GPU 1 and its memory unknown on GPU 2.
    let (pa, pb) = (a.pids(), b.pids());
    node.inject(&format!(
        r#"[{{"gpu": 1, "mps_clients": [{}, {}]}}, {{"gpu": 2, "mps_clients": [{}]}}]"#,
        clients(&pa, 1024),
        clients(&pb, 512),
        pb[0]
    ));
    node.start();
    let addr = format!("127.0.0.1:{port}");
    let a_on_1 = format!(
        "gpu_medic_task_gpu_memory_bytes{{task=\"{TASK_A}\",family=\"\",revision=\"\",container=\"c0ffee01\",gpu=\"1\""
    );
    let b_on_1 = format!(
        "gpu_medic_task_gpu_memory_bytes{{task=\"{TASK_B}\",family=\"\",revision=\"\",container=\"c0ffee02\",gpu=\"1\""
    );
    wait_sync(
        "task A's memory on GPU 1",
        Duration::from_secs(30),
        || series(&scrape(&addr), &a_on_1) == Some((2048u64 << 20) as f64),
        || format!("{}\n{}", scrape(&addr), node.log()),
    );
    let body = scrape(&addr);
    assert_eq!(
        series(&body, &b_on_1),
        Some((512u64 << 20) as f64),
        "{body}"
    );
    assert!(
        body.contains(&format!("gpu_medic_task_gpu_processes{{task=\"{TASK_B}\",family=\"\",revision=\"\",container=\"c0ffee02\",gpu=\"2\"")),
        "task B's process of unknown memory on GPU 2:\n{body}"
    );
    // A health series for every GPU from the first poll, none of which raised a signal.
    for i in 0..4 {
        assert!(
            body.contains(&format!("gpu_medic_gpu_health{{gpu=\"{i}\"")),
            "GPU {i}:\n{body}"
        );
    }

    // Task A's model grows: the sum follows.
    node.inject(&format!(
        r#"{{"gpu": 1, "mps_clients": [{}, {}]}}"#,
        clients(&pa, 3000),
        clients(&pb, 512)
    ));
    wait_sync(
        "task A's grown memory",
        Duration::from_secs(30),
        || series(&scrape(&addr), &a_on_1) == Some((6000u64 << 20) as f64),
        || scrape(&addr),
    );

    // Task A goes away: its series goes with it.
    drop(a);
    node.inject(&format!(
        r#"{{"gpu": 1, "mps_clients": [{}]}}"#,
        clients(&pb, 512)
    ));
    wait_sync(
        "task A's series gone",
        Duration::from_secs(30),
        || {
            let body = scrape(&addr);
            body.contains(&b_on_1) && !body.contains(TASK_A)
        },
        || scrape(&addr),
    );
}
