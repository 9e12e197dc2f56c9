//! The diagnose step through the real `gpu-medic run` binary (docs/diagnose.md): a drained
//! or rebooted node's GPUs are tested with `gpu-medic diagnose` (run by the daemon as a child)
//! before the node takes tasks again, against moto behind the kit's recording proxy, the fake
//! libnvidia-ml's four GPUs, and a stand-in `dcgmi` that prints DCGM 4.x's JSON for those
//! four GPUs (passing, or failing one GPU's memory test). A test double only for what cannot
//! exist here: DCGM on a GPU.
//!
//! "The boot" is the one repair_reboot.rs plays: gpu-medic stopped and started again over the
//! same state_dir with a new boot id.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy, Sampler, Seeded};
use gpu_medic_testkit::journal::started_commands;
use gpu_medic_testkit::{Daemon, default_policy, wait_for};
use serde_json::Value;

/// DCGM 4.x's `dcgmi diag -j` document for the fake NVML's four GPUs, the memory test of
/// `failing` failed.
fn dcgm_document(failing: Option<u32>) -> String {
    gpu_medic_testkit::dcgm::document(4, failing)
}

/// The stand-in `dcgmi` in `dir`: prints `dir/<mode>.json` where `dir/mode` says `pass` or
/// `fail`, exits as dcgmi does (0, or 205 for a failed test), and appends its arguments to
/// `dir/calls`.
fn stand_in(dir: &Path) -> PathBuf {
    std::fs::write(dir.join("pass.json"), dcgm_document(None)).unwrap();
    std::fs::write(dir.join("fail.json"), dcgm_document(Some(1))).unwrap();
    std::fs::write(dir.join("mode"), "pass").unwrap();
    let path = dir.join("dcgmi");
    let d = dir.display();
    std::fs::write(
        &path,
        format!(
            "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{d}/calls'\n[ -f '{d}/delay' ] && sleep \"$(cat '{d}/delay')\"\nmode=$(cat '{d}/mode')\ncat \"{d}/$mode.json\"\n[ \"$mode\" = pass ] || exit 205\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

struct Node {
    d: Daemon,
    tools: tempfile::TempDir,
}

impl Node {
    fn mode(&self, m: &str) {
        std::fs::write(self.tools.path().join("mode"), m).unwrap();
    }

    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.tools.path().join("calls"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The machine rebooted: a new boot id and a new kernel log.
    fn boot(&mut self, id: &str) {
        std::fs::write(self.tools.path().join("boot_id"), format!("{id}\n")).unwrap();
        std::fs::write(self.d.path("kmsg"), "").unwrap();
        self.d.start();
    }
}

/// Node 0 of `s` with the reboot rung, the DCGM tier (the stand-in) and no CUDA tier.
fn node(s: &Seeded, proxy: &Proxy, policy_extra: &str) -> Node {
    node_i(s, 0, proxy, "", policy_extra)
}

/// Node `i` of [`node`], with more `[fleet]` lines.
fn node_i(s: &Seeded, i: usize, proxy: &Proxy, fleet_extra: &str, policy_extra: &str) -> Node {
    let tools = tempfile::tempdir().unwrap();
    let dcgmi = stand_in(tools.path());
    let boot = tools.path().join("boot_id");
    std::fs::write(&boot, "boot-1\n").unwrap();
    let rest = format!(
        "[repair]\nreboot = \"ec2\"\ncheck_interval = \"200ms\"\nsettle = \"1s\"\nboot_id_path = \"{}\"\n\
         [diagnose]\ndcgmi = \"{}\"\ndcgm_host = \"\"\ncuda_library = \"\"\ntimeout = \"20s\"\n",
        boot.display(),
        dcgmi.display()
    );
    let fleet = format!("claim_settle = \"200ms\"\nretry_after = \"1s\"\n{fleet_extra}");
    let d = aws::node(s, i, Some(&proxy.url), "", "", &fleet, &rest);
    let policy = d.path("policy.toml");
    std::fs::write(
        &policy,
        format!(
            "version = 1\nextends = \"{}\"\n[deadlines]\nreboot = \"10m\"\nboot_check = \"20s\"\ndiagnose = \"60s\"\n[retry]\ndelay = \"300ms\"\n{policy_extra}",
            default_policy().display()
        ),
    )
    .unwrap();
    let text = std::fs::read_to_string(d.config()).unwrap();
    let text: Vec<String> = text
        .lines()
        .map(|l| {
            if l.starts_with("policy = ") {
                format!("policy = \"{}\"", policy.display())
            } else {
                l.to_string()
            }
        })
        .collect();
    std::fs::write(d.config(), text.join("\n")).unwrap();
    Node { d, tools }
}

fn state(d: &Daemon) -> Value {
    d.state()
}

async fn wait_step(d: &Daemon, step: &str) {
    wait_for(
        &format!("remediation step {step}"),
        Duration::from_secs(40),
        || {
            let s = state(d)["remediation"]["step"].clone();
            async move { s == step }
        },
    )
    .await;
}

async fn assert_back_in_service(sdk: &aws_config::SdkConfig, s: &Seeded) {
    aws::assert_back_in_service(sdk, s, 0).await;
}

fn diagnosis_of(inc: &Value) -> Vec<Value> {
    inc["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|r| r["outcome"].get("diagnosis").cloned())
        .collect()
}

/// The driver asks for a drain (recovery action drain-p2p): quarantine, drain, diagnose at
/// `[diagnose] level` with the slot held, a pass, and the node back in service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_that_passes_its_diagnosis_is_back_in_service() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "dg-pass", 2).await;
    let mut n = node(&s, &proxy, "");
    // The diagnosis takes a moment, long enough for the driver's verdict to clear before the
    // node goes back (a recovery action still asking for a drain would drain it again).
    std::fs::write(n.tools.path().join("delay"), "1").unwrap();
    n.d.start();
    n.d.wait_polled();
    n.d.inject(r#"{"gpu": 0, "recovery_action": "drain-p2p"}"#);
    wait_step(&n.d, "diagnose").await;
    // While the GPUs are tested the instance stays drained and holds its slot.
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[0].arn).await.0,
        "DRAINING"
    );
    assert_eq!(state(&n.d)["node"], "verifying");
    n.d.inject(r#"{"gpu": 0, "recovery_action": "none"}"#);
    let inc = n.d.wait_closed(1, Duration::from_secs(40));
    assert_eq!(inc["state"], "resolved", "{inc:#}");
    assert!(
        inc["summary"]
            .as_str()
            .unwrap()
            .contains("diagnosed healthy"),
        "{inc:#}"
    );
    assert_eq!(
        started_commands(&inc),
        ["quarantine", "drain", "diagnose", "restore"],
        "{inc:#}"
    );
    let d = diagnosis_of(&inc);
    assert_eq!(d.len(), 1, "{inc:#}");
    assert_eq!(d[0]["result"], "pass");
    assert_eq!(d[0]["gpus"].as_array().unwrap().len(), 4, "{:#}", d[0]);
    assert_back_in_service(&sdk, &s).await;
    let calls = n.calls();
    assert!(
        calls.iter().any(|c| c.contains("diag -r 1 -j")),
        "{calls:?}"
    );
    // On-call sees each GPU's result per test.
    let out = n.d.cli(&["incidents", "show", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("GPU 3") && text.contains("memory"), "{text}");
    n.d.stop(Duration::from_secs(10));
}

/// A failed diagnosis of a drained node climbs to the reboot; after the boot the diagnosis
/// fails again (naming GPU 1 and DCGM's own message) and the node is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_gpu_is_rebooted_then_replaced_when_it_fails_again() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "dg-fail", 2).await;
    let mut n = node(&s, &proxy, "");
    n.mode("fail");
    n.d.start();
    n.d.wait_polled();
    n.d.inject(r#"{"gpu": 0, "recovery_action": "drain-p2p"}"#);
    wait_step(&n.d, "await-boot").await;
    n.d.inject(r#"{"gpu": 0, "recovery_action": "none"}"#);
    assert_eq!(
        proxy.count_with(
            "RebootInstances",
            &format!("InstanceId.1={}", s.nodes[0].instance_id)
        ),
        1
    );
    let inc = n.d.incident(1);
    let why: Vec<String> = inc["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["event"] == "escalated")
        .map(|r| format!("{}: {}", r["rule"], r["reason"]))
        .collect();
    let why = why.join("\n");
    assert!(
        why.contains("diagnosis-failed") && why.contains("GPU 1") && why.contains("miscompare"),
        "{why}"
    );
    n.d.stop(Duration::from_secs(30));
    n.boot("boot-2");
    wait_for("replaced", Duration::from_secs(40), || async {
        n.d.incident(1)["state"] == "replaced"
    })
    .await;
    let inc = n.d.incident(1);
    let cmds = started_commands(&inc);
    assert_eq!(
        cmds.iter().filter(|c| *c == "diagnose").count(),
        2,
        "{cmds:?}"
    );
    assert!(
        aws::asg_health(&sdk, &s.asg)
            .await
            .contains(&(s.nodes[0].instance_id.clone(), "Unhealthy".into())),
        "{inc:#}"
    );
    n.d.stop(Duration::from_secs(10));
}

/// XID 79: the reboot, the boot check, then the diagnosis before the node goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_reboot_the_node_returns_only_once_its_diagnosis_passed() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "dg-boot", 2).await;
    let mut n = node(&s, &proxy, "");
    n.d.start();
    n.d.wait_polled();
    n.d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_step(&n.d, "await-boot").await;
    n.d.stop(Duration::from_secs(30));
    n.boot("boot-2");
    let inc = n.d.wait_closed(1, Duration::from_secs(40));
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    assert_eq!(
        started_commands(&inc),
        [
            "quarantine",
            "drain",
            "reboot",
            "quarantine",
            "boot-check",
            "diagnose",
            "restore"
        ],
        "{inc:#}"
    );
    assert_eq!(diagnosis_of(&inc)[0]["result"], "pass");
    assert_back_in_service(&sdk, &s).await;
    n.d.stop(Duration::from_secs(10));
}

/// Three supervisors under a budget of one (the DynamoDB slot table) each drain for the
/// driver's drain-p2p, and each diagnosis takes a while: the slot is held from the drain to the
/// return to service, so moto never shows two instances out of service at once, and all three
/// come back in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_supervisors_diagnosing_at_once_keep_the_budget() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let moto = aws::sdk(&aws::moto().url).await;
    let table = aws::unique("dg-three");
    aws::create_slot_table(&sdk, &table).await;
    let s = std::sync::Arc::new(aws::seed(&sdk, "dg-three", 3).await);
    let fleet = aws::table_fleet(&table);
    let mut ns: Vec<Node> = (0..3).map(|i| node_i(&s, i, &proxy, &fleet, "")).collect();
    for n in &mut ns {
        std::fs::write(n.tools.path().join("delay"), "1.5").unwrap();
        n.d.start();
    }
    for n in &ns {
        n.d.wait_polled();
    }
    let sampler = Sampler::start(&moto, &s);
    for n in &mut ns {
        n.d.inject(r#"{"gpu": 0, "recovery_action": "drain-p2p"}"#);
    }
    let mut cleared = [false; 3];
    let t0 = std::time::Instant::now();
    loop {
        let mut all = true;
        for (i, n) in ns.iter_mut().enumerate() {
            // The driver's verdict clears once the node was drained (a reset would clear it).
            if !cleared[i] && state(&n.d)["remediation"]["step"] == "diagnose" {
                n.d.inject(r#"{"gpu": 0, "recovery_action": "none"}"#);
                cleared[i] = true;
            }
            all &= n.d.incident(1)["state"] == "resolved";
        }
        if all {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(150),
            "not all three back in 150 s: {}",
            ns.iter()
                .map(|n| n.d.log())
                .collect::<Vec<_>>()
                .join("\n----\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (max, samples, worst) = sampler.finish().await;
    assert!(samples > 10, "{samples} samples");
    assert_eq!(max, 1, "at most 1 out of service at once, saw {worst:?}");
    for (i, n) in ns.iter().enumerate() {
        let inc = n.d.incident(1);
        // A drain the budget deferred is started again: once the slot is had, in that order.
        let mut cmds = started_commands(&inc);
        cmds.dedup();
        assert_eq!(
            cmds,
            ["quarantine", "drain", "diagnose", "restore"],
            "node {i}: {inc:#}"
        );
        let (status, _, _) = aws::instance(&moto, &s.cluster, &s.nodes[i].arn).await;
        assert_eq!(status, "ACTIVE", "node {i}");
    }
    let item = aws::slot_item(&moto, &table, &s.asg).await;
    assert!(item.holders.is_empty(), "every slot released: {item:?}");
    for n in &mut ns {
        n.d.stop(Duration::from_secs(10));
    }
}

/// After an XID 79 reboot nv-hostengine is not running, so DCGM's diagnosis cannot run (the
/// stand-in `dcgmi` answers as dcgmi does without a host engine; no CUDA tier). The boot check
/// never holds the node and its fleet-budget slot for ever: the diagnosis is ordered again
/// every `[diagnose] retry_delay` until `retry_within`, then the node goes back into service on
/// the boot check's passive checks (`boot_on_unknown = "return"`), the slot released in the
/// DynamoDB table and nothing replaced, the incident saying which way and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_host_engine_after_a_reboot_the_boot_check_ends_within_its_bound() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let moto = aws::sdk(&aws::moto().url).await;
    let table = aws::unique("dg-nohe");
    aws::create_slot_table(&sdk, &table).await;
    let s = aws::seed(&sdk, "dg-nohe", 2).await;
    let mut n = node_i(
        &s,
        0,
        &proxy,
        &aws::table_fleet(&table),
        "[diagnose]\nretry_within = \"4s\"\nretry_delay = \"1s\"\n",
    );
    gpu_medic_testkit::dcgm::no_host_engine(n.tools.path());
    n.d.start();
    n.d.wait_polled();
    n.d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_step(&n.d, "await-boot").await;
    n.d.stop(Duration::from_secs(30));
    let held = aws::slot_item(&moto, &table, &s.asg).await;
    assert_eq!(held.holders.len(), 1, "the reboot holds the slot: {held:?}");
    let t0 = std::time::Instant::now();
    n.boot("boot-2");
    let inc = n.d.wait_closed(1, Duration::from_secs(40));
    let took = t0.elapsed();
    // The bound: the boot check, `retry_within`, the last diagnosis and the restore.
    assert!(took < Duration::from_secs(25), "{took:?}: {inc:#}");
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    let summary = inc["summary"].as_str().unwrap();
    assert!(
        summary.contains("the diagnosis could not tell")
            && summary.contains("returned on the passive checks")
            && summary.contains("fleet budget slot released"),
        "{summary}"
    );
    let cmds = started_commands(&inc);
    let diagnoses = cmds.iter().filter(|c| *c == "diagnose").count();
    assert!((2..=5).contains(&diagnoses), "{cmds:?}");
    assert_eq!(
        cmds.iter().filter(|c| *c != "diagnose").collect::<Vec<_>>(),
        [
            "quarantine",
            "drain",
            "reboot",
            "quarantine",
            "boot-check",
            "restore"
        ],
        "{cmds:?}"
    );
    // Each diagnosis could not tell, naming what it could not reach.
    let ds = diagnosis_of(&inc);
    assert_eq!(ds.len(), diagnoses, "{inc:#}");
    for d in &ds {
        assert_eq!(d["result"], "unknown", "{d:#}");
        assert_eq!(d["cause"], "host-engine", "{d:#}");
        assert!(
            d["summary"]
                .as_str()
                .unwrap()
                .contains("nv-hostengine is not running or not reachable"),
            "{d:#}"
        );
    }
    let notes: Vec<String> = inc["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["event"] == "note")
        .map(|r| r["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert!(
        notes.iter().any(|t| t.contains("diagnosing again in 1s")),
        "{notes:#?}"
    );
    assert!(
        notes
            .iter()
            .any(|t| t.contains("boot_on_unknown = \"return\"") && t.contains("nv-hostengine")),
        "{notes:#?}"
    );
    // dcgmi was asked each time, for the four GPUs.
    let calls = n.calls();
    assert_eq!(calls.len(), diagnoses, "{calls:?}");
    assert!(
        calls.iter().all(|c| c == "diag -r 1 -j -i 0,1,2,3"),
        "{calls:?}"
    );
    // Back in service, the slot released in the table and its mark deleted, nothing replaced.
    // (moto deletes an attribute only when the call names its value too, which ECS does not
    // ask for: the mark is checked by the call, not by moto's record.)
    let (status, _, attrs) = aws::instance(&sdk, &s.cluster, &s.nodes[0].arn).await;
    assert_eq!(status, "ACTIVE", "{attrs:?}");
    assert!(
        attrs.contains(&("gpu-medic.health".into(), Some("ok".into()))),
        "{attrs:?}"
    );
    assert!(
        aws::asg_health(&sdk, &s.asg)
            .await
            .contains(&(s.nodes[0].instance_id.clone(), "Healthy".into()))
    );
    let item = aws::slot_item(&moto, &table, &s.asg).await;
    assert!(item.holders.is_empty(), "slot released: {item:?}");
    assert_eq!(
        proxy.count_with("DeleteAttributes", "\"name\":\"gpu-medic.slot\""),
        1
    );
    assert_eq!(proxy.count("SetInstanceHealth"), 0);
    // On-call reads the cause in the incident.
    let out = n.d.cli(&["incidents", "show", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("diagnosis (quick): unknown [host-engine]"),
        "{text}"
    );
    n.d.stop(Duration::from_secs(10));
}
