//! The launch gate through the real binary: `gpu-medic check --lifecycle` on a node of fake
//! GPUs (tests/fake-nvml), the instance id from the fake IMDS, ECS in moto (through
//! `AWS_ENDPOINT_URL_ECS`), Auto Scaling through a proxy that answers the lifecycle actions
//! moto lacks (through `AWS_ENDPOINT_URL_AUTO_SCALING`; `[aws] endpoint_url` unset).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

#[path = "support/aws.rs"]
mod aws;
#[path = "support/imds.rs"]
mod imds;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use aws::{Proxy, Seeded};
use aws_config::SdkConfig;
use imds::FakeImds;
use serde_json::Value;

const HOOK: &str = "gpu-medic-launch";

const GPUS: &str = r#"{"driver_version": "570.172.08", "gpus": [
  {"pci_bus_id": "00000000:10:00.0"}, {"pci_bus_id": "00000000:20:00.0"},
  {"pci_bus_id": "00000000:30:00.0"}, {"pci_bus_id": "00000000:40:00.0"}
]}"#;

const XID_79: &str = "4,812,91000000,-;NVRM: Xid (PCI:0000:10:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n";

fn bin() -> PathBuf {
    assert_cmd::cargo::cargo_bin("gpu-medic")
}

fn fake_nvml() -> PathBuf {
    let dir = bin().parent().unwrap().to_path_buf();
    [
        dir.join("libfake_nvml.so"),
        dir.join("deps/libfake_nvml.so"),
    ]
    .into_iter()
    .find(|p| p.exists())
    .unwrap_or_else(|| panic!("libfake_nvml.so not found: run `cargo build --workspace`"))
}

/// One launching instance: its config, fake GPUs, kernel log and environment.
struct Launch {
    dir: tempfile::TempDir,
    imds: FakeImds,
    asg_url: String,
    n: u32,
}

impl Launch {
    async fn new(s: &Seeded, proxy: &Proxy, node: usize, cluster: &str, extra: &str) -> Launch {
        let dir = tempfile::tempdir().unwrap();
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        std::fs::create_dir_all(dir.path().join("inject")).unwrap();
        std::fs::write(dir.path().join("gpus.json"), GPUS).unwrap();
        std::fs::write(dir.path().join("kmsg"), "").unwrap();
        std::fs::write(
            dir.path().join("config.toml"),
            format!(
                "state_dir = \"state\"\npolicy = \"{}\"\n\
                 [nvml]\nlibrary = \"{}\"\nexpected_gpus = 4\nkmsg = \"{}\"\n\
                 [mps]\nenabled = false\n\
                 [identity]\ncluster = \"{cluster}\"\n\
                 [ecs]\nagent_url = \"http://127.0.0.1:9\"\nagent_wait = \"100ms\"\n\
                 [lifecycle]\ncheck_deadline = \"2s\"\ncheck_retry_delay = \"300ms\"\n{extra}\n",
                repo.join("policies/default.toml").display(),
                fake_nvml().display(),
                dir.path().join("kmsg").display(),
            ),
        )
        .unwrap();
        Launch {
            dir,
            imds: FakeImds::start(&s.nodes[node].instance_id).await,
            asg_url: proxy.url.clone(),
            n: 0,
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn kmsg(&self, text: &str) {
        std::fs::write(self.path("kmsg"), text).unwrap();
    }

    /// A fake-NVML injection applied when the next check opens NVML.
    fn inject(&mut self, json: &str) {
        self.n += 1;
        std::fs::write(self.path(&format!("inject/{:04}.json", self.n)), json).unwrap();
    }

    /// Starts `gpu-medic run` on the same config until the launch gate's verdict is in the
    /// incident journal (the gate hands it over through state_dir/requests/).
    async fn daemon_journals_the_gate(&self) -> Value {
        let mut c = self.command(&["run", "--log-format", "json", "--config"]);
        c.arg(self.path("config.toml"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true);
        let mut child = c.spawn().unwrap();
        let t = std::time::Instant::now();
        let journal = self.path("state/incidents.jsonl");
        let record = loop {
            let text = std::fs::read_to_string(&journal).unwrap_or_default();
            if let Some(l) = text
                .lines()
                .find(|l| l.contains("\"summary\":\"launch gate:") && l.contains("\"closed\""))
            {
                break serde_json::from_str::<Value>(l).unwrap();
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the daemon did not journal the gate"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let _ = child.kill().await;
        record
    }

    fn command(&self, args: &[&str]) -> tokio::process::Command {
        let mut c = tokio::process::Command::new(bin());
        c.env_remove("GPU_MEDIC_CONFIG")
            .env_remove("AWS_PROFILE")
            .env_remove("AWS_ENDPOINT_URL")
            .env("AWS_ENDPOINT_URL_ECS", &aws::moto().url)
            .env("AWS_ENDPOINT_URL_AUTO_SCALING", &self.asg_url)
            .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", &self.imds.url)
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", aws::REGION)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("AWS_CONFIG_FILE", self.path("no-aws-config"))
            .env(
                "AWS_SHARED_CREDENTIALS_FILE",
                self.path("no-aws-credentials"),
            )
            .env("FAKE_NVML_CONFIG", self.path("gpus.json"))
            .env("FAKE_NVML_INJECT_DIR", self.path("inject"))
            .args(args);
        c
    }

    /// Runs `check --lifecycle --json`; returns its exit code and report.
    async fn check(&self, env: &[(&str, &str)]) -> (i32, Value, String) {
        let mut c = self.command(&["check", "--lifecycle", "--json", "--config"]);
        c.arg(self.path("config.toml"));
        for (k, v) in env {
            c.env(k, v);
        }
        let out: Output = c.output().await.unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        let report: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}\n{stderr}", String::from_utf8_lossy(&out.stdout)));
        (out.status.code().unwrap_or(-1), report, stderr)
    }
}

async fn put_launch_hook(sdk: &SdkConfig, group: &str) {
    aws_sdk_autoscaling::Client::new(sdk)
        .put_lifecycle_hook()
        .auto_scaling_group_name(group)
        .lifecycle_hook_name(HOOK)
        .lifecycle_transition("autoscaling:EC2_INSTANCE_LAUNCHING")
        .heartbeat_timeout(3)
        .default_result("ABANDON")
        .send()
        .await
        .unwrap();
}

async fn abandon_tag(sdk: &SdkConfig, group: &str) -> Vec<u64> {
    let r = aws_sdk_autoscaling::Client::new(sdk)
        .describe_auto_scaling_groups()
        .auto_scaling_group_names(group)
        .send()
        .await
        .unwrap();
    r.auto_scaling_groups()[0]
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
    let l = Launch::new(&s, &proxy, 0, &s.cluster, "").await;
    let (code, r, stderr) = l.check(&[]).await;
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
    assert!(l.path("state/launch-gate.json").exists());
    let closed = l.daemon_journals_the_gate().await;
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
    let (code, r, stderr) = l.check(&[]).await;
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
    let (code, r, stderr) = l.check(&[]).await;
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
        l.inject(fault);
        proxy.lifecycle_wait(HOOK, &me.instance_id);
        let (code, r, stderr) = l.check(&[]).await;
        assert_eq!(
            (code, &r["result"]),
            (1, &Value::from("ABANDON")),
            "{fault}: {r:#}\n{stderr}"
        );
        l.inject(r#"{"reset": true}"#);
    }
    assert_eq!(abandon_tag(&sdk, &s.asg).await.len(), 3);
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=ABANDON"),
        3
    );

    // 4: the breaker. Kept in service, quarantined, loudly.
    l.kmsg(XID_79);
    proxy.lifecycle_wait(HOOK, &me.instance_id);
    let (code, r, stderr) = l.check(&[]).await;
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
    let (code, r, stderr) = l.check(&[("FAKE_NVML_INIT_ERROR", "999")]).await;
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
