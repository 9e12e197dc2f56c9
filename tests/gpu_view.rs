//! ECS's view of the GPUs against NVML's, through the real `gpu-medic run` (and `check` and
//! `status`): ECS is moto behind the kit's recording proxy, which adds `gpuDevices` to
//! DescribeContainerInstances answers (moto 5.2.5 has no such field: the one test double
//! here besides IMDS), IMDS is the kit's fake (IMDS cannot exist off EC2), the GPUs are the
//! fake libnvidia-ml through nvml-wrapper's real code path.
//!
//! Also here: the metrics an alert can be written on (a health series for every GPU from the
//! first poll; a routine state-disk reading is not a signal).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy, Seeded};
use gpu_medic_testkit::http::scrape;
use gpu_medic_testkit::imds::FakeImds;
use gpu_medic_testkit::proxy::gpu_device;
use gpu_medic_testkit::{
    Daemon, FOUR_GPUS, default_policy, fake_nvml, wait_looks_async, wait_sync,
};
use serde_json::Value;

const UUIDS: [&str; 4] = [
    "GPU-00000000-aaaa-bbbb-cccc-000000000000",
    "GPU-11111111-aaaa-bbbb-cccc-111111111111",
    "GPU-22222222-aaaa-bbbb-cccc-222222222222",
    "GPU-33333333-aaaa-bbbb-cccc-333333333333",
];
/// The fake's H200s.
const H200_MIB: i64 = 143_771;

/// One registered container instance in moto behind a proxy that gives it `devices` as
/// `gpuDevices` (none: moto's own answer), a fake IMDS for it (`instance_type` if given),
/// and the daemon of [`daemon`] on the fake's four GPUs.
async fn node(
    name: &str,
    devices: Vec<Value>,
    instance_type: Option<&str>,
) -> (Proxy, Seeded, FakeImds, Daemon) {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, name, 1).await;
    proxy.gpu_devices(&s.nodes[0].arn, devices);
    let imds = FakeImds::start(&s.nodes[0].instance_id).await;
    imds.set_instance_type(instance_type);
    let mut d = daemon(&s, &proxy, &imds, "");
    d.gpus(FOUR_GPUS);
    (proxy, s, imds, d)
}

/// A few more looks of both sides: three more DescribeContainerInstances calls (each one a
/// comparison of the GPU view) and three more NVML polls (each one a count held to the
/// expected GPUs). Whatever either would decide wrongly, it has had the chance to.
async fn more_looks(proxy: &Proxy, d: &Daemon) {
    wait_looks_async("GPU view comparisons", 3, || {
        proxy.count("DescribeContainerInstances")
    })
    .await;
    d.wait_nvml_polls("polls", 3);
}

/// Every GPU idle, as ECS lists them.
fn idle() -> Vec<Value> {
    UUIDS
        .iter()
        .map(|u| gpu_device(u, "IDLE", H200_MIB, H200_MIB, 0))
        .collect()
}

/// Node 0 of `s` on the fake GPUs, observe-only (decisions are journaled, nothing is
/// executed), ECS through `proxy`, IMDS at `imds`; `nvml`: extra `[nvml]` lines.
fn daemon(s: &Seeded, proxy: &Proxy, imds: &FakeImds, nvml: &str) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\ndry_run = true\n\
         [nvml]\nlibrary = \"{}\"\npoll_interval = \"200ms\"\nkmsg = \"{}\"\n{nvml}\n\
         [mps]\nenabled = false\n[node]\nenabled = false\n[lifecycle]\nenabled = false\n\
         [ecs]\ngpu_view_interval = \"500ms\"\nagent_wait = \"0s\"\n\
         {}",
        default_policy().display(),
        fake_nvml().display(),
        dir.path().join("kmsg").display(),
        aws::sections(s, 0, ""),
    );
    let mut d = Daemon::in_temp(dir, &config);
    d.aws(Some(&proxy.url))
        .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.url);
    d
}

/// The first journaled observation of `kind` (opening an incident or joining one), once
/// there is one.
fn wait_signal(d: &Daemon, kind: &str) -> Value {
    let find = || {
        d.records().into_iter().find_map(|r| {
            let o = r.get("observation")?;
            (o["signal"]["kind"] == kind).then(|| {
                let mut o = o.clone();
                o["incident"] = r["incident"].clone();
                o
            })
        })
    };
    wait_sync(
        &format!("a journaled {kind}"),
        Duration::from_secs(30),
        || find().is_some(),
        || String::from_utf8_lossy(&d.cli(&["incidents", "list"]).stdout).to_string(),
    );
    find().unwrap_or_default()
}

/// Nothing that replaces was journaled (`device-count-mismatch`, `ecs-gpu-missing`), every
/// incident only logged, and `status` does not expect ECS's count of `ecs`.
fn assert_only_logged(d: &Daemon, what: &str, ecs: usize) {
    let records = d.records();
    for kind in ["device-count-mismatch", "ecs-gpu-missing"] {
        assert!(
            !records
                .iter()
                .any(|r| r["observation"]["signal"]["kind"] == kind),
            "{what}: no {kind}: {records:#?}"
        );
    }
    assert!(
        !records
            .iter()
            .any(|r| r["event"] == "opened" && r["verdict"] != "log"),
        "{what}: only logged: {records:#?}"
    );
    let status = stdout(&d.cli(&["status"]));
    assert!(!status.contains(&format!("expected {ecs} ")), "{status}");
}

fn detail(o: &Value) -> &str {
    o["detail"].as_str().unwrap_or_default()
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_ecs_lists_but_nvml_lost_is_reported_with_the_numbers() {
    let devices = vec![
        gpu_device(UUIDS[0], "NVIDIA_MPS", H200_MIB, 100_000, 2),
        gpu_device(UUIDS[1], "IDLE", H200_MIB, H200_MIB, 0),
        gpu_device(UUIDS[2], "NVIDIA_MPS", H200_MIB, 40_000, 3),
        gpu_device(UUIDS[3], "IDLE", H200_MIB, H200_MIB, 0),
    ];
    let (proxy, _s, _imds, mut d) = node("gpuview-lost", devices, None).await;
    d.start();
    // The views agree: status says so, nothing is opened.
    wait_sync(
        "the first comparison",
        Duration::from_secs(20),
        || stdout(&d.cli(&["status"])).contains("the views agree"),
        || stdout(&d.cli(&["status"])),
    );
    assert!(d.incident(1).is_null(), "{:#}", d.incident(1));
    assert!(proxy.count("DescribeContainerInstances") >= 1);

    // GPU 2 falls off the bus; ECS still lists it, with 3 containers on it.
    d.inject(r#"{"gpu": 2, "lost": true}"#);
    // Confirmed on a second read, it joins the lost GPU's incident (one node remediation).
    let o = wait_signal(&d, "ecs-gpu-missing");
    assert_eq!(o["gpu"]["index"], 2, "{o:#}");
    assert_eq!(o["value"], 3, "{o:#}");
    let text = detail(&o);
    assert!(
        text.contains(UUIDS[2])
            && text.contains("3 container(s)")
            && text.contains("40000 of 143771 MiB remaining")
            && text.contains("which NVML reports lost"),
        "{text}"
    );
    let shown = stdout(&d.cli(&["incidents", "show", &o["incident"].to_string()]));
    assert!(shown.contains("ECS still schedules onto"), "{shown}");
    let status = stdout(&d.cli(&["status"]));
    assert!(
        status.contains(&format!("{}: NVML lost (GPU 2)", UUIDS[2]))
            && status.contains("ECS NVIDIA_MPS, 3 container(s), 40000 MiB free to ECS")
            && status.contains("disagrees: ecs-gpu-missing: ECS still schedules onto"),
        "{status}"
    );
    let json: Value = serde_json::from_slice(&d.cli(&["status", "--json"]).stdout).unwrap();
    assert_eq!(json["ecs_gpus"]["gpus"][2]["nvml"], "lost", "{json:#}");

    // The one-shot check sees the same: unhealthy (exit 1), with the finding and the view.
    // (The fake applies an injection in the process that reads it: the daemon is stopped and
    // the check's own fake library loses GPU 2, before NVML could name it: ECS's GPU is then
    // one NVML does not see, or the lost one.)
    d.stop(Duration::from_secs(20));
    d.inject(r#"{"gpu": 2, "lost": true}"#);
    let out = d.cli(&["check", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{v:#}");
    let findings = v["findings"].as_array().unwrap();
    assert!(
        findings.iter().any(|f| f["signal"] == "ecs-gpu-missing"
            && f["action"] == "replace"
            && f["detail"].as_str().unwrap().contains(UUIDS[2])
            && f["detail"]
                .as_str()
                .unwrap()
                .contains("1 GPU(s) lost that it cannot name")),
        "{v:#}"
    );
    assert_eq!(v["ecs_gpus"]["ecs_count"], 4, "{v:#}");
    assert_eq!(v["ecs_gpus"]["gpus"][2]["nvml"], "lost or missing", "{v:#}");
    d.inject(r#"{"gpu": 2, "lost": true}"#);
    let text = stdout(&d.cli(&["check"]));
    assert!(
        text.contains("ecs gpu view: ECS lists 4, NVML counts 4")
            && text.contains(&format!("{}: NVML lost or missing", UUIDS[2])),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_ecs_believes_free_that_nvml_shows_in_use_is_a_signal() {
    // ECS: 120000 MiB of GPU 0 free for new MPS tasks. NVML: 100000 MiB of it in use.
    let mut devices = idle();
    devices[0] = gpu_device(UUIDS[0], "NVIDIA_MPS", H200_MIB, 120_000, 1);
    let (_proxy, _s, _imds, mut d) = node("gpuview-mem", devices, None).await;
    d.start();
    d.inject(r#"{"gpu": 0, "mps_clients": [{"pid": 4242, "used_mib": 100000}]}"#);
    let o = wait_signal(&d, "ecs-gpu-memory-in-use");
    assert_eq!(o["gpu"]["index"], 0, "{o:#}");
    // 143771 - 100000 = 43771 MiB free to NVML (less the few MiB the fake itself counts in
    // use); ECS counts 120000: about 76229 MiB is not there.
    let excess = o["value"].as_u64().unwrap();
    assert!((76_229..76_300).contains(&excess), "{o:#}");
    assert!(detail(&o).contains("ECS believes 120000 MiB"), "{o:#}");
    d.stop(Duration::from_secs(20));
}

/// An instance type the table does not know (IMDS names none) and ECS registering four GPUs
/// where NVML sees three: ECS's registration is an orchestrator's record, not the hardware
/// (the agent keeps it across reboots), so it is never the expected count. The disagreement
/// is `ecs-gpu-count-mismatch` (logged, saying the type's count is not known), never
/// `device-count-mismatch` nor `ecs-gpu-missing` (both replace): a wrong expected count must
/// not replace a healthy node. With `[nvml] expected_gpus = 4` (the operator knows the
/// hardware) the same missing GPU is caught by both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_an_unknown_type_ecs_count_alone_is_logged_and_a_set_count_catches_a_missing_gpu() {
    let (proxy, _s, _imds, mut d) = node("gpuview-boot", idle(), None).await;
    // NVML sees three of the four GPUs ECS registered; expected_gpus is not set.
    let three = FOUR_GPUS.replace(
        ",\n  {\"uuid\": \"GPU-33333333-aaaa-bbbb-cccc-333333333333\", \"pci_bus_id\": \"00000000:40:00.0\", \"serial\": \"S3\"}",
        "",
    );
    assert_ne!(three, FOUR_GPUS);
    d.gpus(&three);
    d.start();
    let o = wait_signal(&d, "ecs-gpu-count-mismatch");
    assert!(
        detail(&o).contains("ECS registered 4 GPU(s) for this instance, NVML counts 3")
            && detail(&o).contains("is not known"),
        "{o:#}"
    );
    more_looks(&proxy, &d).await;
    d.stop(Duration::from_secs(20));
    assert_only_logged(&d, "ECS's count alone", 4);

    // The operator sets the hardware's count: the missing GPU is caught.
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        cfg.replacen("[nvml]\n", "[nvml]\nexpected_gpus = 4\n", 1),
    )
    .unwrap();
    d.start();
    let o = wait_signal(&d, "device-count-mismatch");
    assert!(
        detail(&o).contains("expected 4 GPUs ([nvml] expected_gpus), NVML sees 3"),
        "{o:#}"
    );
    let o = wait_signal(&d, "ecs-gpu-missing");
    assert!(
        detail(&o).contains(UUIDS[3]) && detail(&o).contains("NVML does not see"),
        "{o:#}"
    );
    d.stop(Duration::from_secs(20));
}

/// ECS's count against the hardware's: a g5.12xlarge whose four GPUs NVML sees healthy,
/// ECS registering 8 (`gpuDevices` naming four GPUs that are not there), or an instance
/// ECS says has 10,000: the instance type's 4 is what NVML's count is held to (a count
/// beyond any instance type is never used), and the disagreement is `ecs-gpu-count-mismatch`
/// (logged), never `device-count-mismatch` nor `ecs-gpu-missing` (both replace).
async fn an_orchestrator_count_is_not_the_hardware(
    name: &str,
    ecs: usize,
    instance_type: Option<&str>,
) {
    let mut devices = idle();
    for i in 4..ecs {
        devices.push(gpu_device(
            &format!("GPU-ffffffff-0000-0000-0000-{i:012}"),
            "IDLE",
            H200_MIB,
            H200_MIB,
            0,
        ));
    }
    let (proxy, _s, _imds, mut d) = node(name, devices, instance_type).await;
    d.start();
    let o = wait_signal(&d, "ecs-gpu-count-mismatch");
    assert!(
        detail(&o).contains(&format!(
            "ECS registered {ecs} GPU(s) for this instance, NVML counts 4"
        )),
        "{o:#}"
    );
    // A few more comparisons and polls: still nothing that replaces.
    wait_sync(
        "a few comparisons",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(d.path("state/ecs-gpus.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .is_some_and(|v| v["nvml_count"] == 4)
        },
        String::new,
    );
    more_looks(&proxy, &d).await;
    d.stop(Duration::from_secs(20));
    assert_only_logged(&d, name, ecs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ecs_registering_more_gpus_than_the_instance_type_has_is_only_logged() {
    an_orchestrator_count_is_not_the_hardware("gpuview-ecs8", 8, Some("g5.12xlarge")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ecs_count_beyond_any_instance_type_is_ignored() {
    an_orchestrator_count_is_not_the_hardware("gpuview-ecs10k", 10_000, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_gpu_devices_the_instance_type_gives_the_expected_count() {
    // No gpuDevices (moto's own answer): g5.12xlarge has 4 GPUs, NVML sees 3.
    let (_proxy, _s, _imds, mut d) = node("gpuview-type", vec![], Some("g5.12xlarge")).await;
    d.gpus(&gpu_medic_testkit::gpus_json(3));

    // The one-shot check (the launch gate's) learns it too, before the daemon ever ran.
    let out = d.cli(&["check", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{v:#}");
    let f = v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["signal"] == "device-count-mismatch")
        .cloned()
        .unwrap_or_else(|| panic!("{v:#}"));
    assert!(
        f["detail"]
            .as_str()
            .unwrap()
            .contains("expected 4 GPUs (instance type g5.12xlarge), NVML sees 3"),
        "{f:#}"
    );

    d.start();
    let o = wait_signal(&d, "device-count-mismatch");
    assert!(
        detail(&o).contains("expected 4 GPUs (instance type g5.12xlarge), NVML sees 3"),
        "{o:#}"
    );
    d.stop(Duration::from_secs(20));
    // ECS listed no GPU: nothing of ECS's view was compared.
    let list = stdout(&d.cli(&["incidents", "list"]));
    assert!(!list.contains("ecs-gpu"), "{list}");
}

/// One AMI's config baked for another instance type: `expected_gpus = 8` on a g5.12xlarge
/// (4 GPUs, all there) is gpu-medic's mistake, said once as a self-fault, never a
/// device-count mismatch that would replace every such instance; the instance type's count
/// is what NVML's is held to, so a GPU really missing is still caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expected_count_the_instance_type_contradicts_is_a_mistake_not_a_fault() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "gpuview-baked", 1).await;
    let imds = FakeImds::start(&s.nodes[0].instance_id).await;
    imds.set_instance_type(Some("g5.12xlarge"));
    let mut d = daemon(&s, &proxy, &imds, "expected_gpus = 8");
    d.gpus(FOUR_GPUS);

    let out = d.cli(&["check", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_ne!(out.status.code(), Some(1), "not unhealthy: {v:#}");
    assert!(!v.to_string().contains("device-count-mismatch"), "{v:#}");

    d.start();
    let o = wait_signal(&d, "self-fault");
    assert_eq!(o["signal"]["component"], "expected-gpus", "{o:#}");
    assert!(
        detail(&o).contains(
            "[nvml] expected_gpus = 8 contradicts the instance type g5.12xlarge with 4 GPUs"
        ),
        "{o:#}"
    );
    // Polls go on (a GPU view compared a few times): still no mismatch.
    wait_sync(
        "a few comparisons",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(d.path("state/ecs-gpus.json"))
                .ok()
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .is_some_and(|v| v["nvml_count"] == 4)
        },
        String::new,
    );
    more_looks(&proxy, &d).await;
    d.stop(Duration::from_secs(20));
    assert!(
        !d.records()
            .iter()
            .any(|r| r["observation"]["signal"]["kind"] == "device-count-mismatch"),
        "no mismatch while all 4 GPUs are there"
    );

    // A GPU really missing is held to the instance type's 4.
    d.gpus(&gpu_medic_testkit::gpus_json(3));
    d.start();
    let o = wait_signal(&d, "device-count-mismatch");
    assert!(
        detail(&o).contains("expected 4 GPUs (instance type g5.12xlarge), NVML sees 3"),
        "{o:#}"
    );
    d.stop(Duration::from_secs(20));
    let opened = d
        .records()
        .iter()
        .filter(|r| {
            r["event"] == "opened" && r["observation"]["signal"]["component"] == "expected-gpus"
        })
        .count();
    assert_eq!(opened, 1, "one incident for the mistake");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_ecs_read_is_a_self_fault_never_a_gpu_signal() {
    let (proxy, _s, _imds, mut d) = node("gpuview-throttle", idle(), None).await;
    // Every read throttled (the SDK's own retries included).
    proxy.throttle("DescribeContainerInstances", 100_000);
    d.start();
    let fault = wait_signal(&d, "self-fault");
    assert_eq!(fault["signal"]["component"], "ecs-gpu-view", "{fault:#}");
    let status = stdout(&d.cli(&["status"]));
    assert!(status.contains("self-fault:  ecs-gpu-view"), "{status}");
    // `check` cannot tell (exit 2), and names no GPU finding.
    let out = d.cli(&["check", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(2), "{v:#}");
    assert!(v["findings"].as_array().unwrap().is_empty(), "{v:#}");
    // ECS answers again: the self-fault is resolved; no GPU signal was ever raised.
    proxy.clear_faults();
    wait_sync(
        "the self-fault resolved",
        Duration::from_secs(30),
        || d.incident(fault["incident"].as_u64().unwrap() as u32)["closed_at"].is_string(),
        || d.log(),
    );
    d.stop(Duration::from_secs(20));
    let list = stdout(&d.cli(&["incidents", "list"]));
    assert!(
        !list.contains("ecs-gpu-missing") && !list.contains("ecs-gpu-count"),
        "{list}"
    );
}

/// `absent()` and `> 0` alerts need a series for every GPU from the first poll, and a
/// signal counter that counts findings, not readings: the node probe reads the state disk
/// every 100 ms, and none of it is a signal while that disk is below the policy's 95 %. The
/// disk is this machine's own (CI machines run theirs at 95 % at times): the test reads it
/// with the probe's own function and, when it is that full, leaves that one series out.
#[test]
fn metrics_have_a_health_series_per_gpu_and_count_no_routine_reading() {
    let port = gpu_medic_testkit::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut node = Daemon::fake_gpu_node(
        &format!(
            "tick_interval = \"100ms\"\n[node]\nenabled = true\ninterval = \"100ms\"\n\
             [metrics]\nenabled = true\nlisten = \"{addr}\""
        ),
        "poll_interval = \"200ms\"",
    );
    node.gpus(FOUR_GPUS);
    node.start();
    wait_sync(
        "a health series for each GPU",
        Duration::from_secs(20),
        || {
            let body = scrape(&addr);
            (0..4).all(|i| {
                body.contains(&format!(
                    "gpu_medic_gpu_health{{gpu=\"{i}\",uuid=\"{}\"}} 0",
                    UUIDS[i as usize]
                ))
            })
        },
        || scrape(&addr),
    );
    // Many node readings later (every 100 ms), still no signal counted. The node probe
    // counts its readings nowhere a test can see; the same runtime's NVML polls (every
    // 200 ms) do: ten of them are some twenty readings.
    node.wait_nvml_polls("polls, node readings between them", 10);
    let log = node.log();
    assert!(
        log.contains(r#""source":"node""#),
        "the node probe ran:\n{log}"
    );
    let state = node.path("state");
    let near_full = || gpu_medic::probe::node::percent_used(&state).is_none_or(|p| p >= 94);
    let signals = |body: &str| -> Vec<String> {
        body.lines()
            .filter(|l| l.starts_with("gpu_medic_signals_total{"))
            .filter(|l| !l.contains("signal=\"state-disk-full\""))
            .map(str::to_string)
            .collect()
    };
    let body = scrape(&addr);
    assert_eq!(signals(&body), Vec::<String>::new(), "{body}");
    let was_near_full = near_full();
    // A finding is counted: an XID on GPU 1.
    node.inject(r#"{"gpu": 1, "xid": 13}"#);
    wait_sync(
        "the XID counted as a signal",
        Duration::from_secs(20),
        || scrape(&addr).contains("gpu_medic_signals_total{signal=\"xid\"} 1"),
        || scrape(&addr),
    );
    let body = scrape(&addr);
    assert_eq!(
        signals(&body),
        ["gpu_medic_signals_total{signal=\"xid\"} 1"],
        "{body}"
    );
    if !was_near_full && !near_full() {
        assert!(!body.contains("signal=\"state-disk-full\""), "{body}");
    }
    node.stop(Duration::from_secs(20));
}
