//! Scenarios through the real `gpu-medic` binary and the real NVML bindings, with faults
//! injected into the fake libnvidia-ml (tests/fake-nvml; `cargo test --workspace` builds it).
//! Each test runs its own daemon in its own temp dir.

use std::path::PathBuf;
use std::process::{Child, Command as StdCommand};
use std::time::Duration;

use serde_json::Value;

#[path = "support/node.rs"]
mod node;
use node::{GPUS, bin, fake_nvml, wait_until};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Node {
    dir: tempfile::TempDir,
    daemon: Option<Child>,
    n: u32,
}

impl Node {
    fn new(extra_nvml: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("inject")).unwrap();
        std::fs::write(dir.path().join("gpus.json"), GPUS).unwrap();
        std::fs::write(dir.path().join("kmsg"), "").unwrap();
        std::fs::write(
            dir.path().join("config.toml"),
            format!(
                "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n\
                 [nvml]\nlibrary = \"{}\"\npoll_interval = \"200ms\"\nkmsg = \"{}\"\n{extra_nvml}\n\
                 [mps]\nenabled = false\n[aws]\nenabled = false\n",
                repo().join("policies/default.toml").display(),
                fake_nvml().display(),
                dir.path().join("kmsg").display(),
            ),
        )
        .unwrap();
        Node {
            dir,
            daemon: None,
            n: 0,
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn cmd(&self) -> StdCommand {
        let mut c = StdCommand::new(bin());
        c.env("FAKE_NVML_CONFIG", self.path("gpus.json"))
            .env("FAKE_NVML_INJECT_DIR", self.path("inject"))
            .env_remove("GPU_MEDIC_CONFIG");
        c
    }

    fn start(&mut self) {
        let mut cmd = self.cmd();
        cmd.args(["run", "--log-format", "json", "--config"])
            .arg(self.path("config.toml"));
        let log = self.path("daemon.log");
        self.daemon = Some(node::start_daemon(cmd, &log, &self.path("state")));
        // Let the first poll establish counter baselines.
        std::thread::sleep(Duration::from_millis(600));
    }

    fn inject(&mut self, json: &str) {
        self.n += 1;
        let tmp = self.path(&format!("inject/{:04}.json.tmp", self.n));
        std::fs::write(&tmp, json).unwrap();
        std::fs::rename(&tmp, self.path(&format!("inject/{:04}.json", self.n))).unwrap();
    }

    fn records(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(self.path("state/incidents.jsonl")).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    fn opened(&self) -> Vec<Value> {
        self.records()
            .into_iter()
            .filter(|r| r["event"] == "opened")
            .collect()
    }

    fn wait_opened(&self, what: &str, pred: impl Fn(&Value) -> bool) -> Value {
        wait_until(what, || self.opened().iter().any(&pred));
        self.opened().into_iter().find(|r| pred(r)).unwrap()
    }

    fn stop(&mut self) -> String {
        if let Some(mut c) = self.daemon.take() {
            // SAFETY: signalling our own child by pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let status = c.wait().unwrap();
            assert!(status.success(), "daemon exit {status:?}: {}", self.log());
        }
        self.log()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("daemon.log")).unwrap_or_default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut c) = self.daemon.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn is_xid(r: &Value, code: u64) -> bool {
    r["observation"]["signal"]["kind"] == "xid" && r["observation"]["signal"]["code"] == code
}

#[test]
fn xid_79_is_a_replace_decision_naming_the_gpu() {
    let mut node = Node::new("");
    node.start();
    node.inject(r#"{"gpu": 1, "xid": 79}"#);
    let r = node.wait_opened("the XID 79 incident", |r| is_xid(r, 79));
    assert_eq!(r["verdict"], "replace");
    assert_eq!(r["rule"], "xid-fallen-off-bus");
    let gpu = &r["observation"]["gpu"];
    assert_eq!(gpu["index"], 1);
    assert_eq!(gpu["uuid"], "GPU-11111111-aaaa-bbbb-cccc-111111111111");
    assert_eq!(gpu["pci_bus_id"], "00000000:20:00.0");
    // With [aws] disabled nothing is executed: the incident records what would have been
    // done and why, and the node is not reported as drained.
    wait_until("the would-have outcome", || {
        node.records().iter().any(|r| {
            r["event"] == "closed"
                && r["state"] == "observed"
                && r["summary"]
                    .as_str()
                    .is_some_and(|d| d.contains("AWS remediation disabled"))
        })
    });
    node.stop();
    // The CLI shows it.
    let out = node
        .cmd()
        .args(["incidents", "show", "1", "--config"])
        .arg(node.path("config.toml"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("00000000:20:00.0"), "{text}");
}

#[test]
fn application_xids_are_logged_then_escalate_when_they_repeat() {
    let mut node = Node::new("");
    node.start();
    node.inject(r#"{"gpu": 2, "xid": 13}"#);
    let r = node.wait_opened("the XID 13 incident", |r| is_xid(r, 13));
    assert_eq!(r["verdict"], "log");
    for _ in 0..4 {
        node.inject(r#"{"gpu": 2, "xid": 13}"#);
    }
    let r = node.wait_opened("the escalation", |r| r["verdict"] == "drain");
    assert_eq!(r["rule"], "xid-13-graphics-exception/escalated");
    assert_eq!(r["observation"]["gpu"]["index"], 2);
    node.stop();
}

#[test]
fn a_lost_gpu_and_a_missing_gpu_are_detected() {
    let mut node = Node::new("expected_gpus = 4");
    node.start();
    node.inject(r#"{"gpu": 3, "lost": true}"#);
    let r = node.wait_opened("the lost GPU", |r| {
        r["observation"]["signal"]["kind"] == "gpu-lost"
    });
    assert_eq!(r["observation"]["gpu"]["index"], 3);
    assert_eq!(r["verdict"], "replace");
    node.stop();

    let mut node = Node::new("expected_gpus = 4");
    node.start();
    node.inject(r#"{"count": 3}"#);
    let r = node.wait_opened("the device count mismatch", |r| {
        r["observation"]["signal"]["kind"] == "device-count-mismatch"
    });
    assert_eq!(r["observation"]["value"], 3);
    assert_eq!(r["verdict"], "replace");
    node.stop();
}

#[test]
fn an_uncorrected_ecc_increase_follows_the_policy_and_names_the_mps_clients() {
    let mut node = Node::new("");
    node.start();
    let me = std::process::id();
    node.inject(&format!(r#"{{"gpu": 0, "mps_clients": [{me}]}}"#));
    std::thread::sleep(Duration::from_millis(500));
    node.inject(r#"{"gpu": 0, "ecc": {"uncorrected_volatile": 1}}"#);
    let r = node.wait_opened("the ECC incident", |r| {
        r["observation"]["signal"]["kind"] == "ecc-uncorrected"
    });
    let rule = std::process::Command::new(bin())
        .args([
            "policy",
            "explain",
            "--signal",
            "ecc-uncorrected",
            "--json",
            "--policy",
        ])
        .arg(repo().join("policies/default.toml"))
        .output()
        .unwrap();
    let rule: Value = serde_json::from_slice(&rule.stdout).unwrap();
    assert_eq!(r["verdict"], rule["action"]);
    assert_eq!(r["observation"]["value"], 1);
    assert_eq!(r["observation"]["pids"][0], me);
    node.stop();
    // Counted once, although both the event and the poller saw it.
    let ecc = node
        .records()
        .iter()
        .filter(|r| r["observation"]["signal"]["kind"] == "ecc-uncorrected")
        .count();
    assert_eq!(ecc, 1);
}

#[test]
fn a_counter_that_fails_unexpectedly_is_reported_not_fatal() {
    let mut node = Node::new("");
    node.start();
    node.inject(r#"{"gpu": 3, "fail": {"function": "nvmlDeviceGetTotalEccErrors", "code": 999}}"#);
    wait_until("the warning", || node.log().contains("ECC count failed"));
    // Still watching: an XID after it is judged.
    node.inject(r#"{"gpu": 1, "xid": 79}"#);
    node.wait_opened("the XID 79 incident", |r| is_xid(r, 79));
    let log = node.stop();
    assert!(log.contains("GPU 3"), "{log}");
    // `check` (a new process, so the fault is injected again) reports the problem and cannot
    // call the node healthy.
    node.inject(r#"{"gpu": 3, "fail": {"function": "nvmlDeviceGetTotalEccErrors", "code": 999}}"#);
    let out = node
        .cmd()
        .args(["check", "--json", "--config"])
        .arg(node.path("config.toml"))
        .env("FAKE_NVML_INJECT_DIR", node.path("inject"))
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verdict"], "unknown", "{v}");
    assert_eq!(out.status.code(), Some(2));
    assert!(
        v["probes"][0]["problems"][0]
            .as_str()
            .unwrap()
            .contains("GPU 3"),
        "{v}"
    );
}

#[test]
fn check_reports_per_gpu_health() {
    let node = Node::new("expected_gpus = 4");
    let out = node
        .cmd()
        .args(["check", "--json", "--config"])
        .arg(node.path("config.toml"))
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verdict"], "healthy");
    assert_eq!(v["gpus"].as_array().unwrap().len(), 4);
    assert_eq!(
        v["gpus"][2]["uuid"],
        "GPU-22222222-aaaa-bbbb-cccc-222222222222"
    );
    // A pending row remap is logged (healthy); a remap failure fails the check.
    let mut node = node;
    node.inject(r#"{"gpu": 2, "remapped_rows": {"failure": true}}"#);
    let out = node
        .cmd()
        .args(["check", "--config"])
        .arg(node.path("config.toml"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("faulty") && text.contains("row-remap-failure"),
        "{text}"
    );
}

#[test]
fn the_real_libnvidia_ml_without_a_driver_reports_driver_not_loaded() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"s\"\npolicy = \"{}\"\n[nvml]\nlibrary = \"libnvidia-ml.so.1\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
            repo().join("policies/default.toml").display()
        ),
    )
    .unwrap();
    let out = StdCommand::new(bin())
        .args(["check", "--json", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let f = &v["findings"][0];
    assert_eq!(f["signal"], "driver-not-loaded");
    assert_eq!(f["action"], "replace");
    let detail = f["detail"].as_str().unwrap();
    assert!(
        detail.contains("driver is not loaded"),
        "expected the real library's DRIVER_NOT_LOADED (is Debian's libnvidia-ml1 installed?): {detail}"
    );
}

#[test]
fn simulate_reproduces_the_decisions_the_daemon_made() {
    let mut node = Node::new("expected_gpus = 4");
    node.start();
    node.inject(r#"{"gpu": 2, "xid": 13}"#);
    node.inject(r#"{"gpu": 0, "recovery_action": 2}"#);
    node.inject(r#"{"gpu": 1, "xid": 79}"#);
    node.wait_opened("the recovery action", |r| {
        r["observation"]["signal"]["kind"] == "recovery-action"
    });
    wait_until("the would-have outcome", || {
        node.records().iter().any(|r| r["event"] == "closed")
    });
    node.stop();
    let out = StdCommand::new(bin())
        .args(["policy", "simulate", "--json", "--policy"])
        .arg(repo().join("policies/default.toml"))
        .arg(node.path("state/inputs.jsonl"))
        .output()
        .unwrap();
    assert!(out.status.success());
    let replayed: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|v| v["type"] == "log")
        .map(|mut v| {
            v.as_object_mut().unwrap().remove("type");
            v
        })
        .collect();
    let recorded = node.records();
    assert!(recorded.len() >= 4, "{recorded:?}");
    assert_eq!(replayed, recorded);
}

fn kmsg_append(node: &Node, line: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(node.path("kmsg"))
        .unwrap();
    writeln!(f, "{line}").unwrap();
}

fn xid_inputs(node: &Node, code: u64) -> usize {
    std::fs::read_to_string(node.path("state/inputs.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["signal"]["kind"] == "xid" && v["signal"]["code"] == code)
        .count()
}

#[test]
fn kernel_log_xids_are_reported_once_with_the_drivers_text() {
    let mut node = Node::new("");
    node.start();
    kmsg_append(
        &node,
        "4,100,5000000,-;NVRM: Xid (PCI:0000:20:00): 79, pid=4242, name=train, GPU has fallen off the bus.",
    );
    let r = node.wait_opened("the kernel-log XID", |r| is_xid(r, 79));
    assert_eq!(r["observation"]["source"], "kmsg");
    assert_eq!(r["observation"]["gpu"]["index"], 1);
    assert_eq!(r["observation"]["pids"][0], 4242);
    assert!(
        r["observation"]["detail"]
            .as_str()
            .unwrap()
            .contains("GPU has fallen off the bus. (process train)"),
        "{r}"
    );
    // The same XID from NVML's event and the kernel log is one observation.
    node.inject(r#"{"gpu": 2, "xid": 13}"#);
    wait_until("the event XID", || xid_inputs(&node, 13) == 1);
    kmsg_append(
        &node,
        "4,101,5100000,-;NVRM: Xid (PCI:0000:30:00): 13, pid=77, name=app, Graphics Exception",
    );
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(xid_inputs(&node, 13), 1);
    node.stop();
    // After a restart the old lines are not reported again.
    let before = xid_inputs(&node, 79);
    node.start();
    std::thread::sleep(Duration::from_millis(800));
    kmsg_append(
        &node,
        "4,102,5200000,-;NVRM: Xid (PCI:0000:40:00): 31, pid=78, name=app, MMU Fault",
    );
    wait_until("the new line", || xid_inputs(&node, 31) == 1);
    assert_eq!(xid_inputs(&node, 79), before);
    node.stop();
}

fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
fn the_metrics_endpoint_serves_every_metric_from_the_running_daemon() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut node = Node::new("");
    let cfg = node.path("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        format!("{text}[metrics]\nenabled = true\nlisten = \"127.0.0.1:{port}\"\n"),
    )
    .unwrap();
    node.start();
    node.inject(r#"{"gpu": 1, "xid": 79}"#);
    node.wait_opened("the XID 79 incident", |r| is_xid(r, 79));
    let addr = format!("127.0.0.1:{port}");
    wait_until("the remediation metric", || {
        scrape(&addr).contains("gpu_medic_remediations_total{")
    });
    let body = scrape(&addr);
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    for name in [
        "gpu_medic_gpu_health",
        "gpu_medic_xids_total",
        "gpu_medic_signals_total",
        "gpu_medic_mps_probe_latency_seconds",
        "gpu_medic_mps_restarts_total",
        "gpu_medic_remediations_total",
        // gpu_medic_aws_call_errors_total has no series here: with [aws] disabled no AWS call
        // is made (the replace is recorded as not executed), so none can fail.
        "gpu_medic_incidents_open",
        "gpu_medic_node_phase",
    ] {
        assert!(
            body.contains(&format!("# HELP {}", name.trim_end_matches("_total"))),
            "{name}: {body}"
        );
    }
    assert!(
        body.contains("gpu_medic_xids_total{gpu=\"1\",code=\"79\"} 1"),
        "{body}"
    );
    assert!(body.contains("gpu_medic_gpu_health{gpu=\"1\""), "{body}");
    assert!(
        body.contains(
            "gpu_medic_remediations_total{action=\"replace\",outcome=\"not-executed\"} 1"
        ),
        "{body}"
    );
    assert!(scrape(&addr).starts_with("HTTP/1.1 200"));
    let other = {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    assert!(other.starts_with("HTTP/1.1 404"), "{other}");
    node.stop();
}

#[test]
fn a_metrics_address_that_is_not_loopback_is_refused() {
    let node = Node::new("");
    let cfg = node.path("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        format!("{text}[metrics]\nenabled = true\nlisten = \"0.0.0.0:9400\"\n"),
    )
    .unwrap();
    let out = node
        .cmd()
        .args(["run", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a loopback address"));
}
