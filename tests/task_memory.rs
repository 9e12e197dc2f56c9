//! GPU memory reservations and the sizing report, end to end through the real `gpu-medic run`:
//! MPS clients are real processes in ECS-shaped cgroups (`kit::proc::EcsTaskProcs`), the fake
//! libnvidia-ml reports each one's used memory (changed over time by injections), the kit's
//! `FakeAgent` lists the tasks (the ECS agent exists only on an instance: the one double
//! here), and the task definitions live in moto behind the kit's recording proxy. moto keeps
//! container definitions as registered, `sharingStrategy.nvidiaMps` included
//! (docs/aws.md#gpu-memory-reservations-under-mps), so the proxy adds nothing.
//!
//! Task A runs two processes in its `app` container and one in `sidecar`; its definition
//! reserves 2048 + 1024 MiB. Each process stays under its container's per-process limit, but
//! together they cross the task's 3072 MiB: the incident names the task, its reservation and
//! its use. Task B stays under. The EMF lines on stdout carry the same numbers, and
//! `gpu-medic tasks` suggests sizes from the history.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::http::{scrape, series};
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::proc::EcsTaskProcs;
use gpu_medic_testkit::{Daemon, wait_sync};

const MIB: u64 = 1 << 20;

fn clients(pids: &[u32], mib: u64) -> Vec<String> {
    pids.iter()
        .map(|p| format!(r#"{{"pid": {p}, "used_mib": {mib}}}"#))
        .collect()
}

/// A 64-digit Docker container id, unique to this run.
fn docker_id(n: u32) -> String {
    format!("{:08x}{n:08x}{}", std::process::id(), "ab".repeat(24))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_over_its_reservation_is_an_incident_and_tasks_suggests_sizes() {
    let task_a = format!("{:08x}aaaaaaaaaaaaaaaaaaaaaaaa", std::process::id());
    let task_b = format!("{:08x}bbbbbbbbbbbbbbbbbbbbbbbb", std::process::id());
    let (app, sidecar, main) = (docker_id(1), docker_id(2), docker_id(3));
    let a_app = match EcsTaskProcs::start(&task_a, &app, 2) {
        Ok(p) => p,
        Err(why) => panic!("real processes in ECS-shaped cgroups need root: {why}"),
    };
    let a_side = EcsTaskProcs::start(&task_a, &sidecar, 1).unwrap();
    let b_main = EcsTaskProcs::start(&task_b, &main, 1).unwrap();

    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "taskmem", 1).await;
    let ecs = aws_sdk_ecs::Client::new(&sdk);
    let (fam_a, fam_b) = (
        format!("{}-infer", s.cluster),
        format!("{}-batch", s.cluster),
    );
    for (family, defs) in [
        (
            &fam_a,
            vec![
                aws::mps_container("app", 2048, None),
                aws::mps_container("sidecar", 1024, None),
            ],
        ),
        (&fam_b, vec![aws::mps_container("main", 4096, None)]),
    ] {
        ecs.register_task_definition()
            .family(family)
            .set_container_definitions(Some(defs))
            .send()
            .await
            .unwrap();
    }
    let arn = |t: &str| format!("arn:aws:ecs:us-east-1:123456789012:task/{}/{t}", s.cluster);
    let (arn_a, arn_b) = (arn(&task_a), arn(&task_b));
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&s.nodes[0].arn)), 0).await;
    agent.set_tasks(&[
        (&arn_a, &fam_a, &[(&app, "app"), (&sidecar, "sidecar")]),
        (&arn_b, &fam_b, &[(&main, "main")]),
    ]);

    let port = gpu_medic_testkit::free_port();
    let mut d = aws::ecs_gpu_node(
        &s,
        0,
        &agent.url,
        &proxy.url,
        &format!(
            "[lifecycle]\nenabled = false\n[metrics]\nenabled = true\nlisten = \"127.0.0.1:{port}\"\nemf = true"
        ),
    );
    d.keep_stdout();
    let inject = |d: &mut Daemon, app_mib: u64| {
        let mut one = clients(&a_app.pids(), app_mib);
        one.extend(clients(&a_side.pids(), 500));
        d.inject(&format!(
            r#"[{{"gpu": 1, "mps_clients": [{}]}}, {{"gpu": 2, "mps_clients": [{}]}}]"#,
            one.join(","),
            clients(&b_main.pids(), 3000).join(",")
        ));
    };
    // Under: A uses 2 x 900 + 500 = 2300 of 3072 MiB, B 3000 of 4096 MiB.
    inject(&mut d, 900);
    d.start();
    let addr = format!("127.0.0.1:{port}");
    let a_labels = format!("task=\"{arn_a}\",family=\"{fam_a}\",revision=\"1\"");
    let use_a_app =
        format!("gpu_medic_task_gpu_memory_bytes{{{a_labels},container=\"app\",gpu=\"1\"");
    let res_a_app =
        format!("gpu_medic_task_gpu_memory_reserved_bytes{{{a_labels},container=\"app\"}}");
    let res_a_side =
        format!("gpu_medic_task_gpu_memory_reserved_bytes{{{a_labels},container=\"sidecar\"}}");
    let over_a = format!("gpu_medic_task_gpu_memory_over_reservation{{{a_labels}}}");
    wait_sync(
        "task A's use and reservation in the metrics",
        Duration::from_secs(30),
        || {
            let body = scrape(&addr);
            series(&body, &use_a_app) == Some((1800 * MIB) as f64)
                && series(&body, &res_a_app) == Some((2048 * MIB) as f64)
        },
        || format!("{:?}\n{}", proxy.calls(), scrape(&addr)),
    );
    let body = scrape(&addr);
    assert_eq!(
        series(&body, &res_a_side),
        Some((1024 * MIB) as f64),
        "{body}"
    );
    assert_eq!(series(&body, &over_a), Some(0.0), "{body}");
    let res_b = format!(
        "gpu_medic_task_gpu_memory_reserved_bytes{{task=\"{arn_b}\",family=\"{fam_b}\",revision=\"1\",container=\"main\"}}"
    );
    wait_sync(
        "task B's reservation (read in a task of its own)",
        Duration::from_secs(10),
        || series(&scrape(&addr), &res_b) == Some((4096 * MIB) as f64),
        || format!("{}\n{}", scrape(&addr), d.log()),
    );

    // A's app grows: 2 x 1500 + 500 = 3500 MiB, each process under its 2048 MiB limit, the
    // task over its 3072 MiB.
    inject(&mut d, 1500);
    let opened = d.wait_record(
        "the over-reservation incident",
        Duration::from_secs(30),
        "opened",
        |r| r["rule"] == "gpu-memory-over-reservation",
    );
    let detail = opened["observation"]["detail"].as_str().unwrap_or_default();
    for part in [
        format!("task {arn_a} ({fam_a}:1)"),
        "uses 3500 MiB".to_string(),
        "reservation 3072 MiB".to_string(),
        "app 3000 MiB of 2048 MiB".to_string(),
        "sidecar 500 MiB of 1024 MiB".to_string(),
        "on GPU 1 (".to_string(),
    ] {
        assert!(detail.contains(&part), "{part} in {opened:#}");
    }
    assert_eq!(opened["observation"]["tasks"], serde_json::json!([arn_a]));
    assert_eq!(opened["observation"]["gpu"]["index"], 1);
    wait_sync(
        "the over-reservation gauge",
        Duration::from_secs(10),
        || series(&scrape(&addr), &over_a) == Some(1.0),
        || scrape(&addr),
    );
    // It stays over for many polls: still one incident; B never had one.
    d.wait_nvml_polls("polls with task A over its reservation", 8);
    let over: Vec<_> = d
        .records()
        .into_iter()
        .filter(|r| r["event"] == "opened" && r["rule"] == "gpu-memory-over-reservation")
        .collect();
    assert_eq!(over.len(), 1, "{over:#?}");
    // Each revision was read once, whatever the number of polls.
    assert_eq!(
        proxy.count("DescribeTaskDefinition"),
        2,
        "{:?}",
        proxy.ops()
    );

    // The stop keeps the minute in progress; the report suggests sizes from it.
    d.stop(Duration::from_secs(10));
    // `[metrics] emf = true`: every stdout line is an EMF document; task A's app on GPU 1
    // carries its dimensions and numbers (the full spec check is crates/io/src/accounting/emf.rs's unit test).
    let stdout = d.stdout(); // whole: the daemon has stopped
    let docs: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let a_app = docs
        .iter()
        .rev()
        .find(|v| v["TaskArn"] == arn_a.as_str() && v["ContainerName"] == "app")
        .unwrap_or_else(|| panic!("no EMF line for task A's app in\n{stdout}"));
    let directive = &a_app["_aws"]["CloudWatchMetrics"][0];
    assert_eq!(directive["Namespace"], "GpuMedic", "{a_app}");
    for set in directive["Dimensions"].as_array().unwrap() {
        for name in set.as_array().unwrap() {
            assert!(
                a_app[name.as_str().unwrap()].is_string(),
                "{name} is a root string member: {a_app}"
            );
        }
    }
    assert_eq!(a_app["TaskDefinitionFamily"], fam_a.as_str());
    assert_eq!(a_app["TaskGpuMemoryUsed"], 3000 * MIB, "{a_app}");
    assert_eq!(a_app["TaskGpuMemoryReserved"], 2048 * MIB, "{a_app}");
    assert!(a_app["_aws"]["Timestamp"].is_u64());

    let out = d.cli(&["tasks", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let size = |family: &str, container: Option<&str>| {
        report["sizes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["family"] == family && s["container"].as_str() == container)
            .cloned()
            .unwrap_or_else(|| panic!("{family} {container:?} in {report:#}"))
    };
    let app_size = size(&fam_a, Some("app"));
    assert_eq!(app_size["peak_mib"], 3000, "{app_size:#}");
    assert_eq!(app_size["reserved_mib"], 2048);
    assert_eq!(
        app_size["suggested_mib"], 3648,
        "3000 + 20 %, rounded up to 64"
    );
    assert_eq!(app_size["over_reservation"], true);
    let whole_a = size(&fam_a, None);
    assert_eq!(
        (&whole_a["peak_mib"], &whole_a["reserved_mib"]),
        (&serde_json::json!(3500), &serde_json::json!(3072))
    );
    let b = size(&fam_b, Some("main"));
    assert_eq!(
        (&b["peak_mib"], &b["over_reservation"]),
        (&serde_json::json!(3000), &serde_json::json!(false))
    );
    let text = d.cli(&["tasks"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!("{fam_a}:1"))
            && text.contains("3648")
            && text.contains("peak over reservation"),
        "{text}"
    );
}
