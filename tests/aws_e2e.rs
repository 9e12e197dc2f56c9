//! End to end through the real `gpu-medic run` binary: the fake libnvidia-ml (tests/fake-nvml,
//! built by `cargo test --workspace`) reports XID 79, the default policy says replace, and the
//! daemon quarantines, drains and replaces the instance in moto, reached through the standard
//! AWS environment (AWS_ENDPOINT_URL, static credentials, AWS_REGION). The incident lists each
//! call with its request id. A second test SIGKILLs the daemon mid-drain and restarts it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

#[path = "support/aws.rs"]
mod aws;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use aws::{Proxy, Seeded};
use serde_json::Value;

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

struct Daemon {
    dir: tempfile::TempDir,
    child: Option<Child>,
    endpoint: String,
    runs: u32,
}

impl Daemon {
    fn new(s: &Seeded, endpoint: &str, ecs: &str) -> Daemon {
        Daemon::with_top(s, endpoint, ecs, "")
    }

    /// `top`: top-level keys (`dry_run = true`).
    fn with_top(s: &Seeded, endpoint: &str, ecs: &str, top: &str) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("inject")).unwrap();
        std::fs::write(dir.path().join("kmsg"), "").unwrap();
        let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
        std::fs::write(
            dir.path().join("config.toml"),
            format!(
                "{top}\nstate_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n\
                 [nvml]\nlibrary = \"{}\"\npoll_interval = \"200ms\"\nkmsg = \"{}\"\n\
                 [mps]\nenabled = false\n\
                 {}\
                 [ecs]\ndrain_poll_interval = \"200ms\"\n{ecs}\n\
                 [fleet]\nwarmup = \"0s\"\nclaim_settle = \"200ms\"\nretry_after = \"1s\"\n",
                repo.join("policies/default.toml").display(),
                fake_nvml().display(),
                dir.path().join("kmsg").display(),
                aws::sections(s, 0, ""),
            ),
        )
        .unwrap();
        Daemon {
            dir,
            child: None,
            endpoint: endpoint.into(),
            runs: 0,
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn command(&self) -> std::process::Command {
        let mut c = std::process::Command::new(bin());
        c.env_remove("GPU_MEDIC_CONFIG")
            .env_remove("AWS_PROFILE")
            .env("AWS_ENDPOINT_URL", &self.endpoint)
            .env("AWS_ACCESS_KEY_ID", "test")
            .env("AWS_SECRET_ACCESS_KEY", "test")
            .env("AWS_REGION", aws::REGION)
            .env("AWS_EC2_METADATA_DISABLED", "true")
            .env("AWS_CONFIG_FILE", self.path("no-aws-config"))
            .env(
                "AWS_SHARED_CREDENTIALS_FILE",
                self.path("no-aws-credentials"),
            )
            .env("FAKE_NVML_INJECT_DIR", self.path("inject"));
        c
    }

    async fn start(&mut self) {
        self.runs += 1;
        let log = std::fs::File::create(self.path(&format!("daemon-{}.log", self.runs))).unwrap();
        let child = self
            .command()
            .args(["run", "--log-format", "json", "--config"])
            .arg(self.path("config.toml"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let state = self.path("state/state.json");
        wait_for("the daemon to start", Duration::from_secs(20), || {
            let ok = state.exists();
            async move { ok }
        })
        .await;
        tokio::time::sleep(Duration::from_millis(600)).await;
    }

    fn inject(&self, json: &str) {
        let tmp = self.path("inject/x.json.tmp");
        std::fs::write(&tmp, json).unwrap();
        std::fs::rename(&tmp, self.path("inject/x.json")).unwrap();
    }

    fn signal(&mut self, sig: i32) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, sig) };
            let _ = c.wait();
        }
    }

    fn log(&self) -> String {
        (1..=self.runs)
            .map(|n| {
                std::fs::read_to_string(self.path(&format!("daemon-{n}.log"))).unwrap_or_default()
            })
            .collect()
    }

    async fn incident(&self, id: u32) -> Value {
        let v = self.try_incident(id).await;
        assert!(!v.is_null(), "no incident {id}; log: {}", self.log());
        v
    }

    /// The incident, or null while it does not exist yet.
    async fn try_incident(&self, id: u32) -> Value {
        let out = tokio::process::Command::from(self.command())
            .args(["incidents", "show", &id.to_string(), "--json", "--config"])
            .arg(self.path("config.toml"))
            .output()
            .await
            .unwrap();
        if !out.status.success() {
            return Value::Null;
        }
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.signal(libc::SIGKILL);
    }
}

async fn wait_for<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn started_commands(incident: &Value) -> Vec<String> {
    incident["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["event"] == "action-started")
        .map(|r| r["order"]["command"]["kind"].as_str().unwrap().to_string())
        .collect()
}

fn request_ids(incident: &Value, op: &str) -> Vec<String> {
    incident["request_ids"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .filter(|r| r.starts_with(&format!("{op} ")))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_79_drains_stops_tasks_and_replaces_through_the_real_binary() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "e2e", 3).await;
    let me = &s.nodes[0];
    let standalone = aws::start_task(&sdk, &s, &me.arn, None).await;
    let service = aws::start_task(&sdk, &s, &me.arn, Some("service:web")).await;
    let mut d = Daemon::new(&s, &proxy.url, "standalone_grace = \"500ms\"");
    d.start().await;
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
        d.try_incident(1).await["state"] == "replaced"
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
    let inc = d.incident(1).await;
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
    let out = tokio::process::Command::from(d.command())
        .args(["status", "--json", "--config"])
        .arg(d.path("config.toml"))
        .output()
        .await
        .unwrap();
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
    let mut d = Daemon::new(&s, &proxy.url, "standalone_grace = \"2s\"");
    d.start().await;
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

    d.start().await;
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
        d.try_incident(1).await["state"] == "replaced"
    })
    .await;
    d.signal(libc::SIGTERM);

    assert!(
        d.log().contains("resuming order left in flight"),
        "{}",
        d.log()
    );
    let inc = d.incident(1).await;
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
    let mut d = Daemon::with_top(&s, &proxy.url, "", "dry_run = true");
    let seeded = proxy.calls().len();
    d.start().await;
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for("the incident", Duration::from_secs(20), || async {
        d.try_incident(1).await["state"] == "observed"
    })
    .await;
    d.signal(libc::SIGTERM);
    let inc = d.incident(1).await;
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
