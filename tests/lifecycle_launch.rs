//! The launch gate through the real binary: `gpu-medic check --lifecycle` on a node of fake
//! GPUs (tests/fake-nvml), the instance id from the fake IMDS, ECS in moto (through
//! `AWS_ENDPOINT_URL_ECS`), Auto Scaling through a proxy that answers the lifecycle actions
//! moto lacks (through `AWS_ENDPOINT_URL_AUTO_SCALING`; `[aws] endpoint_url` unset). The
//! gate's diagnosis runs the CUDA tier on the fake libcuda (tests/fake-cuda): a double only for
//! what cannot exist here, a GPU's driver.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use aws_config::SdkConfig;
use gpu_medic_testkit::aws::{self, Proxy, Seeded};
use gpu_medic_testkit::imds::FakeImds;
use gpu_medic_testkit::{Daemon, default_policy, fake_cuda, fake_nvml};
use serde_json::Value;

const HOOK: &str = "gpu-medic-launch";

const GPUS: &str = r#"{"driver_version": "570.172.08", "gpus": [
  {"pci_bus_id": "00000000:10:00.0"}, {"pci_bus_id": "00000000:20:00.0"},
  {"pci_bus_id": "00000000:30:00.0"}, {"pci_bus_id": "00000000:40:00.0"}
]}"#;

const XID_79: &str = "4,812,91000000,-;NVRM: Xid (PCI:0000:10:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n";

/// One launching instance: its config, fake GPUs, kernel log and environment (the daemon
/// harness, which also runs the `check` command on the same config).
struct Launch {
    d: Daemon,
    _imds: FakeImds,
}

impl Launch {
    async fn new(s: &Seeded, proxy: &Proxy, node: usize, cluster: &str, extra: &str) -> Launch {
        let dir = tempfile::tempdir().unwrap();
        let config = format!(
            "state_dir = \"state\"\npolicy = \"{}\"\n\
             [nvml]\nlibrary = \"{}\"\nexpected_gpus = 4\nkmsg = \"{}\"\n\
             [mps]\nenabled = false\n\
             [identity]\ncluster = \"{cluster}\"\n\
             [ecs]\nagent_url = \"http://127.0.0.1:9\"\nagent_wait = \"100ms\"\n\
             [lifecycle]\ncheck_deadline = \"2s\"\ncheck_retry_delay = \"300ms\"\n{extra}\n",
            default_policy().display(),
            fake_nvml().display(),
            dir.path().join("kmsg").display(),
        );
        let imds = FakeImds::start(&s.nodes[node].instance_id).await;
        let mut d = Daemon::in_temp(dir, &config);
        d.aws(None)
            .env("AWS_ENDPOINT_URL_ECS", &aws::moto().url)
            .env("AWS_ENDPOINT_URL_AUTO_SCALING", &proxy.url)
            .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.url)
            .gpus(GPUS);
        Launch { d, _imds: imds }
    }

    /// Sets `[lifecycle] check_deadline` (the harness writes 2 s).
    fn check_deadline(&self, deadline: &str) {
        let text = std::fs::read_to_string(self.d.config()).unwrap();
        std::fs::write(
            self.d.config(),
            text.replace(
                "check_deadline = \"2s\"",
                &format!("check_deadline = \"{deadline}\""),
            ),
        )
        .unwrap();
    }

    fn kmsg(&self, text: &str) {
        std::fs::write(self.d.path("kmsg"), text).unwrap();
    }

    /// Starts `gpu-medic run` on the same config until the launch gate's verdict is in the
    /// incident journal (the gate hands it over through state_dir/requests/).
    fn daemon_journals_the_gate(&mut self) -> Value {
        self.d.spawn();
        let record = self.d.wait_record(
            "the daemon to journal the gate",
            Duration::from_secs(20),
            "closed",
            |r| {
                r["summary"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("launch gate:"))
            },
        );
        self.d.signal(libc::SIGKILL);
        record
    }

    /// Runs `check --lifecycle --json`; returns its exit code and report.
    fn check(&self, env: &[(&str, &str)]) -> (i32, Value, String) {
        let mut c = self.d.command();
        c.args(["check", "--lifecycle", "--json", "--config"])
            .arg(self.d.config());
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let report: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}\n{stderr}", String::from_utf8_lossy(&out.stdout)));
        (out.status.code().unwrap_or(-1), report, stderr)
    }
}

async fn put_launch_hook(sdk: &SdkConfig, group: &str) {
    let transition = "autoscaling:EC2_INSTANCE_LAUNCHING";
    aws::put_hook(sdk, group, HOOK, transition, 3, "ABANDON").await;
}

async fn abandon_tag(sdk: &SdkConfig, group: &str) -> Vec<u64> {
    aws::asg_group(sdk, group)
        .await
        .tags()
        .iter()
        .find(|t| t.key() == Some("gpu-medic/abandoned-launches"))
        .and_then(|t| t.value())
        .map(|v| v.split(' ').map(|x| x.parse().unwrap()).collect())
        .unwrap_or_default()
}

fn health(attrs: &[(String, Option<String>)]) -> Option<String> {
    attrs
        .iter()
        .find(|(n, _)| n == "gpu-medic.health")
        .and_then(|(_, v)| v.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_launch_continues_and_is_marked_ok() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-ok", 2).await;
    put_launch_hook(&sdk, &s.asg).await;
    proxy.lifecycle_wait(HOOK, &s.nodes[0].instance_id);
    let mut l = Launch::new(&s, &proxy, 0, &s.cluster, "").await;
    let (code, r, stderr) = l.check(&[]);
    assert_eq!(code, 0, "{r:#}\n{stderr}");
    assert_eq!(r["health"], "healthy", "{r:#}");
    assert_eq!(r["decision"], "continue");
    assert_eq!(r["result"], "CONTINUE");
    assert_eq!(r["attribute"], "gpu-medic.health=ok");
    assert_eq!(r["instance_id"], s.nodes[0].instance_id.as_str());
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=CONTINUE"),
        1
    );
    assert!(proxy.lifecycle_waiting().is_empty());
    let (_, _, attrs) = aws::instance(&sdk, &s.cluster, &s.nodes[0].arn).await;
    assert_eq!(health(&attrs).as_deref(), Some("ok"), "{attrs:?}");
    assert!(l.d.path("state/launch-gate.json").exists());
    let closed = l.daemon_journals_the_gate();
    assert!(
        closed["summary"]
            .as_str()
            .unwrap()
            .starts_with("launch gate: healthy; decision Continue"),
        "{closed}"
    );
    assert!(
        r["request_ids"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v.as_str().unwrap().starts_with("CompleteLifecycleAction ")),
        "{r:#}"
    );

    // An instance whose ECS agent has not registered yet: the hook is still completed.
    let empty = aws::unique("lc-ok-empty");
    aws_sdk_ecs::Client::new(&sdk)
        .create_cluster()
        .cluster_name(&empty)
        .send()
        .await
        .unwrap();
    proxy.lifecycle_wait(HOOK, &s.nodes[1].instance_id);
    let l = Launch::new(&s, &proxy, 1, &empty, "").await;
    let (code, r, stderr) = l.check(&[]);
    assert_eq!(code, 0, "{r:#}\n{stderr}");
    assert_eq!(r["result"], "CONTINUE");
    assert!(r["attribute"].is_null());
    assert!(
        r["notes"].to_string().contains("has not registered"),
        "{r:#}"
    );
    assert!(proxy.lifecycle_waiting().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unhealthy_launches_are_abandoned_until_the_breaker_quarantines() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-bad", 1).await;
    let me = &s.nodes[0];
    put_launch_hook(&sdk, &s.asg).await;
    let mut l = Launch::new(&s, &proxy, 0, &s.cluster, "").await;

    // 1: XID 79 in the kernel log since boot (no NVML event: nobody watched at boot).
    l.kmsg(XID_79);
    proxy.lifecycle_wait(HOOK, &me.instance_id);
    let (code, r, stderr) = l.check(&[]);
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["health"], "unhealthy", "{r:#}");
    assert_eq!(r["decision"], "abandon");
    assert_eq!(r["result"], "ABANDON");
    assert!(
        r["check"]["findings"].to_string().contains("xid 79"),
        "{r:#}"
    );
    assert_eq!(abandon_tag(&sdk, &s.asg).await.len(), 1);

    // 2: a lost GPU; 3: a GPU missing from the count.
    l.kmsg("");
    for fault in [r#"{"gpu": 1, "lost": true}"#, r#"{"count": 3}"#] {
        l.d.inject(fault);
        proxy.lifecycle_wait(HOOK, &me.instance_id);
        let (code, r, stderr) = l.check(&[]);
        assert_eq!(
            (code, &r["result"]),
            (1, &Value::from("ABANDON")),
            "{fault}: {r:#}\n{stderr}"
        );
        l.d.inject(r#"{"reset": true}"#);
    }
    assert_eq!(abandon_tag(&sdk, &s.asg).await.len(), 3);
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=ABANDON"),
        3
    );

    // 4: the breaker. Kept in service, quarantined, loudly.
    l.kmsg(XID_79);
    proxy.lifecycle_wait(HOOK, &me.instance_id);
    let (code, r, stderr) = l.check(&[]);
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["decision"], "quarantine", "{r:#}");
    assert_eq!(r["result"], "CONTINUE");
    assert_eq!(r["breaker"]["tripped"], true);
    assert_eq!(r["breaker"]["recent"], 3);
    assert_eq!(r["attribute"], "gpu-medic.health=faulted");
    assert!(
        stderr.contains("LAUNCH-FAILURE BREAKER TRIPPED"),
        "{stderr}"
    );
    assert_eq!(abandon_tag(&sdk, &s.asg).await.len(), 3, "not an abandon");
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=CONTINUE"),
        1
    );
    let (_, _, attrs) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert_eq!(health(&attrs).as_deref(), Some("faulted"), "{attrs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn could_not_tell_is_retried_then_continues_pending() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-unknown", 1).await;
    let me = &s.nodes[0];
    put_launch_hook(&sdk, &s.asg).await;
    proxy.lifecycle_wait(HOOK, &me.instance_id);
    let l = Launch::new(&s, &proxy, 0, &s.cluster, "").await;
    // NVML_ERROR_UNKNOWN at init: the check cannot look.
    let (code, r, stderr) = l.check(&[("FAKE_NVML_INIT_ERROR", "999")]);
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["health"], "unknown", "{r:#}");
    assert_eq!(r["decision"], "continue-pending");
    assert_eq!(r["result"], "CONTINUE");
    assert!(r["attempts"].as_u64().unwrap() >= 3, "{r:#}");
    assert!(r["heartbeats"].as_u64().unwrap() >= 1, "{r:#}");
    assert!(proxy.count_with("RecordLifecycleActionHeartbeat", HOOK) >= 2);
    let (_, _, attrs) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert_eq!(health(&attrs).as_deref(), Some("pending"), "{attrs:?}");
    assert!(abandon_tag(&sdk, &s.asg).await.is_empty());
}

/// `[diagnose]` for the gate: only the CUDA tier, on the fake libcuda.
fn cuda_tier() -> String {
    format!(
        "[diagnose]\ndcgmi = \"\"\ndcgm_host = \"\"\ncuda_library = \"{}\"\nlaunch_level = \"quick\"\ntimeout = \"20s\"\n",
        fake_cuda().display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_diagnoses_the_gpus_and_continues_when_they_pass() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-diag-ok", 1).await;
    put_launch_hook(&sdk, &s.asg).await;
    proxy.lifecycle_wait(HOOK, &s.nodes[0].instance_id);
    let l = Launch::new(&s, &proxy, 0, &s.cluster, &cuda_tier()).await;
    let (code, r, stderr) = l.check(&[]);
    assert_eq!(code, 0, "{r:#}\n{stderr}");
    assert_eq!(r["health"], "healthy", "{r:#}");
    assert_eq!(r["result"], "CONTINUE");
    let d = &r["check"]["diagnosis"];
    assert_eq!(d["result"], "pass", "{r:#}");
    assert_eq!(d["level"], "quick");
    assert_eq!(d["gpus"].as_array().unwrap().len(), 4, "{r:#}");
    assert!(
        d["gpus"][3]["tests"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["tier"] == "cuda" && t["test"] == "kernel" && t["status"] == "pass"),
        "{r:#}"
    );
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=CONTINUE"),
        1
    );
    assert!(abandon_tag(&sdk, &s.asg).await.is_empty());
}

/// The fake libcuda gets GPU 2's kernel answer wrong: the passive checks are healthy, the
/// diagnosis fails the GPU, the launch is abandoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_abandons_a_launch_whose_gpu_fails_the_diagnosis() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-diag-bad", 1).await;
    put_launch_hook(&sdk, &s.asg).await;
    let me = &s.nodes[0];
    proxy.lifecycle_wait(HOOK, &me.instance_id);
    let l = Launch::new(&s, &proxy, 0, &s.cluster, &cuda_tier()).await;
    let faults = l.d.path("cuda.json");
    std::fs::write(
        &faults,
        r#"{"gpus": [{}, {}, {"fault": "wrong-result"}, {}]}"#,
    )
    .unwrap();
    let (code, r, stderr) = l.check(&[("FAKE_CUDA_CONFIG", faults.to_str().unwrap())]);
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["health"], "unhealthy", "{r:#}");
    assert_eq!(r["decision"], "abandon");
    assert_eq!(r["result"], "ABANDON");
    let d = &r["check"]["diagnosis"];
    assert_eq!(d["result"], "fail", "{r:#}");
    let uuid = d["gpus"][2]["uuid"].as_str().unwrap();
    assert!(
        d["summary"]
            .as_str()
            .unwrap()
            .contains(&format!("GPU 2 ({uuid}) failed cuda kernel")),
        "{r:#}"
    );
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=ABANDON"),
        1
    );
    assert_eq!(abandon_tag(&sdk, &s.asg).await.len(), 1);
    assert!(proxy.lifecycle_waiting().is_empty());
}

/// `[diagnose]` for the gate: only the DCGM tier, on a stand-in `dcgmi` in `dir`.
fn dcgm_tier(dir: &std::path::Path) -> String {
    format!(
        "[diagnose]\ndcgmi = \"{}\"\ndcgm_host = \"unix:///run/nvidia-dcgm/nv-hostengine\"\ncuda_library = \"\"\nlaunch_level = \"quick\"\ntimeout = \"10m\"\n",
        dir.join("dcgmi").display()
    )
}

/// nv-hostengine is not running at the launch: DCGM's diagnosis cannot run. The gate looks
/// again under the hook's heartbeats until `check_deadline`, then completes the hook
/// (CONTINUE, `pending`): never held for ever, and never abandoned for a host engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_host_engine_the_gate_completes_the_hook_within_its_deadline() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-nohe", 1).await;
    let me = &s.nodes[0];
    put_launch_hook(&sdk, &s.asg).await;
    proxy.lifecycle_wait(HOOK, &me.instance_id);
    let tools = tempfile::tempdir().unwrap();
    gpu_medic_testkit::dcgm::no_host_engine(tools.path());
    let l = Launch::new(&s, &proxy, 0, &s.cluster, &dcgm_tier(tools.path())).await;
    l.check_deadline("5s");
    let t0 = std::time::Instant::now();
    let (code, r, stderr) = l.check(&[]);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(5 + 5),
        "{took:?}: {r:#}\n{stderr}"
    );
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["health"], "unknown", "{r:#}");
    assert_eq!(r["decision"], "continue-pending");
    assert_eq!(r["result"], "CONTINUE");
    assert!(r["attempts"].as_u64().unwrap() >= 2, "{r:#}");
    let d = &r["check"]["diagnosis"];
    assert_eq!(d["result"], "unknown", "{r:#}");
    // The last look may have found no time left for another diagnosis; the ones before it
    // could not reach the host engine.
    assert!(
        d["cause"] == "host-engine" || d["cause"] == "timeout",
        "{r:#}"
    );
    let d = if d["cause"] == "timeout" {
        assert!(
            d["summary"].as_str().unwrap().contains("no time left"),
            "{r:#}"
        );
        let asked = gpu_medic_testkit::dcgm::calls(tools.path());
        assert!(asked.len() >= 2, "{asked:?}");
        return finish_no_host_engine(&proxy, &sdk, &s, &r, asked.len() as u64).await;
    } else {
        d
    };
    assert!(
        d["summary"]
            .as_str()
            .unwrap()
            .contains("nv-hostengine is not running or not reachable"),
        "{r:#}"
    );
    assert!(d["summary"].as_str().is_some());
    let calls = gpu_medic_testkit::dcgm::calls(tools.path());
    assert_eq!(
        calls.len() as u64,
        r["attempts"].as_u64().unwrap(),
        "{calls:?}"
    );
    assert!(
        calls[0].ends_with("--host unix:///run/nvidia-dcgm/nv-hostengine"),
        "{calls:?}"
    );
    finish_no_host_engine(&proxy, &sdk, &s, &r, calls.len() as u64).await;
}

/// The end of [`with_no_host_engine_the_gate_completes_the_hook_within_its_deadline`]:
/// dcgmi was asked at the looks that had time for it (`asked`), and the hook was completed
/// once.
async fn finish_no_host_engine(proxy: &Proxy, sdk: &SdkConfig, s: &Seeded, r: &Value, asked: u64) {
    assert!(asked <= r["attempts"].as_u64().unwrap(), "{r:#}");
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=CONTINUE"),
        1
    );
    let (_, _, attrs) = aws::instance(sdk, &s.cluster, &s.nodes[0].arn).await;
    assert_eq!(health(&attrs).as_deref(), Some("pending"), "{attrs:?}");
    assert!(abandon_tag(sdk, &s.asg).await.is_empty());
}

/// A `dcgmi` that hangs (a host engine that accepts and never answers), `[diagnose] timeout`
/// ten minutes: the gate cuts the diagnosis to what is left of `check_deadline` and completes
/// the hook in time, the hang's whole process tree killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_dcgmi_never_holds_the_hook_past_the_gates_deadline() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-hang", 1).await;
    let me = &s.nodes[0];
    put_launch_hook(&sdk, &s.asg).await;
    proxy.lifecycle_wait(HOOK, &me.instance_id);
    let tools = tempfile::tempdir().unwrap();
    let dcgmi = tools.path().join("dcgmi");
    std::fs::write(
        &dcgmi,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{}'\nexec sleep 987654\n",
            tools.path().join("calls").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&dcgmi, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let l = Launch::new(&s, &proxy, 0, &s.cluster, &dcgm_tier(tools.path())).await;
    l.check_deadline("4s");
    // dcgmi runs and is cut at what is left of the gate's 4 s, not at its ten minutes.
    let t0 = std::time::Instant::now();
    let (code, r, stderr) = l.check(&[]);
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(4 + 5),
        "{took:?}: {r:#}\n{stderr}"
    );
    assert_eq!(code, 1, "{r:#}\n{stderr}");
    assert_eq!(r["decision"], "continue-pending", "{r:#}");
    assert_eq!(r["result"], "CONTINUE", "{r:#}");
    let d = &r["check"]["diagnosis"];
    assert_eq!(d["cause"], "timeout", "{r:#}");
    assert!(!gpu_medic_testkit::dcgm::calls(tools.path()).is_empty());
    // No dcgmi of the gate's is left running.
    let left: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.trim() == "sleep 987654")
        .collect();
    assert!(left.is_empty(), "{left:?}");
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=CONTINUE"),
        1
    );
}
