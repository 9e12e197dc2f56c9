//! `gpu-medic drill` through the real binary, against a running `gpu-medic run`:
//! - `drill xid 79` writes a driver-shaped line to the kernel log the daemon reads (here the
//!   `[nvml] kmsg` file of the test's directory: this machine's real `/dev/kmsg` is shared
//!   with other test runs whose `gpu-medic check` reads the kernel log since boot, so no
//!   drill line is written there); the incident opens from the kernel-log reader, tagged
//!   drill; with `--observe` moto sees no call, without it the drain and SetInstanceHealth
//!   happen;
//! - `drill mps-hang` stops NVIDIA's real MPS control daemon; gpu-medic restarts it;
//! - `drill gpu-lost` hands the daemon the observation;
//! - without `[drill] allow = true` the drill is refused (exit 4) and nothing is played.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::mps::{MPS_BIN, MpsDir};
use gpu_medic_testkit::{Daemon, default_policy, wait_for};
use serde_json::Value;

const ALLOW: &str = "[drill]\nallow = true\n";

/// Runs the CLI off the runtime (the proxy answers the daemon on it meanwhile).
async fn cli(d: &Daemon, args: &[&str]) -> Output {
    let mut c = d.command();
    c.args(args).arg("--config").arg(d.config());
    tokio::task::spawn_blocking(move || c.output().unwrap())
        .await
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn listed(d: &Daemon) -> Vec<Value> {
    let out = d.cli(&["incidents", "list", "--json"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn opened(d: &Daemon, incident: u64) -> Value {
    d.records()
        .into_iter()
        .find(|r| r["event"] == "opened" && r["incident"] == incident)
        .unwrap_or(Value::Null)
}

/// Every record of the drill's incident carries the drill's id.
fn all_tagged(d: &Daemon, incident: u64, drill: &str) {
    let recs: Vec<Value> = d
        .records()
        .into_iter()
        .filter(|r| r["incident"] == incident)
        .collect();
    assert!(!recs.is_empty());
    for r in &recs {
        assert_eq!(r["drill"], drill, "{r}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observe_xid_drill_opens_a_tagged_incident_from_the_kernel_log_and_calls_nothing() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "drill-obs", 2).await;
    let mut d = aws::node(&s, 0, Some(&proxy.url), "", "gpu_view = false", "", ALLOW);
    d.start();
    d.wait_polled();
    let seeded = proxy.calls().len();
    let out = cli(
        &d,
        &[
            "drill",
            "xid",
            "79",
            "--gpu",
            "1",
            "--observe",
            "--wait",
            "30s",
        ],
    )
    .await;
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}\n{}", d.log());
    // It said what the policy would do before doing it.
    assert!(t.contains("policy:  xid 79 -> replace"), "{t}");
    assert!(t.contains("mode:    observe"), "{t}");
    assert!(t.contains("closed:  observed"), "{t}");
    // The line is the driver's shape, naming the drill's pid, in the daemon's kernel log.
    let kmsg = std::fs::read_to_string(d.path("kmsg")).unwrap();
    let line = kmsg.lines().next().unwrap();
    assert!(line.starts_with("NVRM: Xid (PCI:0000:"), "{line}");
    assert!(line.contains("): 79, pid="), "{line}");
    let inc = listed(&d);
    assert_eq!(inc.len(), 1, "{inc:#?}");
    let drill = inc[0]["drill"].as_str().unwrap().to_string();
    assert!(drill.starts_with("drill-"), "{inc:#?}");
    assert_eq!(inc[0]["signal"], "xid 79");
    assert_eq!(inc[0]["gpu"]["index"], 1);
    assert_eq!(inc[0]["state"], "observed");
    let o = opened(&d, 1);
    assert_eq!(o["observation"]["source"], "kmsg", "{o}");
    all_tagged(&d, 1, &drill);
    d.signal(libc::SIGTERM);
    assert_eq!(proxy.calls().len(), seeded, "{:?}", &proxy.ops()[seeded..]);
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[0].arn).await.0,
        "ACTIVE"
    );
    // The table and the timeline say so too.
    let table = String::from_utf8_lossy(&d.cli(&["incidents", "list"]).stdout).to_string();
    assert!(table.contains("xid 79 [drill]"), "{table}");
    let show = String::from_utf8_lossy(&d.cli(&["incidents", "show", "1"]).stdout).to_string();
    assert!(show.contains(&format!("drill:    {drill}")), "{show}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_xid_drill_drains_and_has_auto_scaling_replace_the_instance() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "drill-live", 2).await;
    let me = &s.nodes[0];
    let fleet = "claim_settle = \"200ms\"\nretry_after = \"1s\"";
    let mut d = aws::node(&s, 0, Some(&proxy.url), "", "", fleet, ALLOW);
    d.start();
    d.wait_polled();
    let out = cli(&d, &["drill", "xid", "79", "--gpu", "0", "--wait", "60s"]).await;
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}\n{}", d.log());
    assert!(t.contains("mode:    LIVE"), "{t}");
    assert!(t.contains("closed:  replaced"), "{t}");
    wait_for(
        "Unhealthy in Auto Scaling",
        Duration::from_secs(10),
        || async {
            aws::asg_health(&sdk, &s.asg)
                .await
                .contains(&(me.instance_id.clone(), "Unhealthy".into()))
        },
    )
    .await;
    d.signal(libc::SIGTERM);
    assert_eq!(aws::instance(&sdk, &s.cluster, &me.arn).await.0, "DRAINING");
    assert_eq!(proxy.count("SetInstanceHealth"), 1);
    assert_eq!(proxy.count("UpdateContainerInstancesState"), 1);
    let inc = listed(&d);
    assert_eq!(inc.len(), 1, "{inc:#?}");
    assert_eq!(inc[0]["state"], "replaced");
    let drill = inc[0]["drill"].as_str().unwrap().to_string();
    all_tagged(&d, 1, &drill);
}

#[test]
fn an_mps_hang_drill_stops_the_real_daemon_and_gpu_medic_restarts_it() {
    assert!(Path::new(MPS_BIN).exists(), "{MPS_BIN} missing (see .ci)");
    let root = tempfile::Builder::new()
        .prefix("gm-drill-")
        .tempdir_in("/tmp")
        .unwrap();
    let mps = MpsDir::new(root.path().to_path_buf());
    let first = mps.start().unwrap();
    let mut d = Daemon::new(&format!(
        "state_dir = \"state\"\npolicy = \"{policy}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nenabled = false\n[aws]\nenabled = false\n\
         [mps]\ncontrol_binary = \"{MPS_BIN}\"\npipe_directory = \"{pipe}\"\n\
         log_directory = \"{log}\"\nmanage = \"direct\"\nprobe_interval = \"500ms\"\n\
         probe_timeout = \"300ms\"\nquit_timeout = \"1s\"\nstart_timeout = \"5s\"\n{ALLOW}",
        policy = default_policy().display(),
        pipe = mps.pipe.display(),
        log = mps.log.display(),
    ));
    d.start();
    let out = d.cli(&["drill", "mps-hang", "--wait", "30s"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}\n{}", d.log());
    assert!(
        t.contains(&format!("MPS control daemon pid {first} stopped")),
        "{t}"
    );
    assert!(
        t.contains("policy:  mps-unresponsive -> restart-mps"),
        "{t}"
    );
    assert!(t.contains("closed:  resolved"), "{t}");
    let inc = listed(&d);
    assert_eq!(inc.len(), 1, "{inc:#?}");
    assert_eq!(inc[0]["signal"], "mps-unresponsive");
    assert_eq!(inc[0]["state"], "resolved");
    assert!(inc[0]["drill"].is_string(), "{inc:#?}");
    let now = mps.daemons();
    assert_eq!(now.len(), 1, "{now:?}");
    assert_ne!(now[0], first, "restarted");
    assert!(
        mps.answer(
            "get_default_active_thread_percentage",
            Duration::from_secs(2)
        )
        .is_some()
    );
    d.stop(Duration::from_secs(10));
    mps.shutdown();
}

#[test]
fn a_gpu_lost_drill_is_judged_by_the_daemon_and_tagged() {
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(d.config(), format!("{cfg}{ALLOW}")).unwrap();
    d.start();
    let out = d.cli(&[
        "drill",
        "gpu-lost",
        "--gpu",
        "2",
        "--observe",
        "--wait",
        "20s",
    ]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(0), "{t}\n{}", d.log());
    assert!(t.contains("policy:  gpu-lost -> replace"), "{t}");
    let inc = listed(&d);
    assert_eq!(inc.len(), 1, "{inc:#?}");
    assert_eq!(inc[0]["signal"], "gpu-lost");
    assert_eq!(inc[0]["gpu"]["index"], 2);
    assert_eq!(inc[0]["state"], "observed");
    assert!(inc[0]["drill"].is_string(), "{inc:#?}");
    assert_eq!(opened(&d, 1)["observation"]["source"], "drill");
}

#[test]
fn a_drill_is_refused_unless_the_instance_allows_it() {
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "");
    d.start();
    for args in [
        &["drill", "xid", "79"][..],
        &["drill", "gpu-lost", "--observe"][..],
        &["drill", "mps-crash"][..],
    ] {
        let out = d.cli(args);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(4), "{args:?}: {t}");
        assert!(t.contains("refused") && t.contains("[drill] allow"), "{t}");
    }
    // Nothing was played or asked for.
    assert_eq!(std::fs::read_to_string(d.path("kmsg")).unwrap(), "");
    assert!(
        !d.path("state/requests").exists()
            || std::fs::read_dir(d.path("state/requests"))
                .unwrap()
                .next()
                .is_none()
    );
    assert!(listed(&d).is_empty());
    // A daemon that does not run: the drill says so and plays nothing.
    d.stop(Duration::from_secs(10));
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(d.config(), format!("{cfg}{ALLOW}")).unwrap();
    let out = d.cli(&["drill", "xid", "79", "--wait", "5s"]);
    let t = text(&out);
    assert_eq!(out.status.code(), Some(1), "{t}");
    assert!(t.contains("did not take the drill request"), "{t}");
    assert_eq!(std::fs::read_to_string(d.path("kmsg")).unwrap(), "");
}
