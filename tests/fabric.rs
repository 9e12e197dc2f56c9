//! The links between the GPUs, through the real `gpu-medic` binary and the real NVML bindings
//! on the fake libnvidia-ml (fabric info, NVLink state and counters, PCIe link and persistence
//! injected over time), real kernel-log files with SXid lines in the forms NVIDIA's Fabric
//! Manager user guide shows, and a fake sysfs tree for the EFA ports.
//!
//! Fabric Manager's unit is read through a `systemctl` test double (`[links] systemctl`): a
//! script that prints `systemctl show` properties from a file the test rewrites. The real
//! Fabric Manager needs NVSwitches; under real systemd, tests/systemd_e2e.rs runs a stand-in
//! under its unit name and stops, kills and breaks it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::io::Write;
use std::time::Duration;

use gpu_medic_testkit::http::scrape;
use gpu_medic_testkit::{Daemon, FOUR_GPUS, Looks, wait_sync};
use serde_json::Value;

/// A node of four fake Hopper GPUs polled every 200 ms; `links`: extra `[links]` lines.
fn node(links: &str) -> Daemon {
    let top = "tick_interval = \"100ms\"";
    let mut d = Daemon::fake_gpu_node(top, "poll_interval = \"200ms\"");
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    let ib = d.path("infiniband");
    std::fs::create_dir_all(&ib).unwrap();
    std::fs::write(
        d.config(),
        format!(
            "{cfg}[links]\ninfiniband_root = \"{}\"\nefa_interval = \"200ms\"\n{links}\n",
            ib.display()
        ),
    )
    .unwrap();
    d.gpus(FOUR_GPUS);
    d
}

fn uptime(d: &Daemon, secs: u64) -> String {
    let p = d.path("uptime");
    std::fs::write(&p, format!("{secs}.00 1.00\n")).unwrap();
    format!("uptime_file = \"{}\"\n", p.display())
}

fn is_kind(r: &Value, kind: &str) -> bool {
    r["observation"]["signal"]["kind"] == kind
}

fn opened(d: &Daemon, kind: &str) -> Value {
    d.wait_record(kind, Duration::from_secs(30), "opened", |r| {
        is_kind(r, kind)
    })
}

/// A signal of `kind` journaled: the first of an incident, or one joining an incident already
/// open for the node (a drain or replacement in flight takes later signals in).
fn seen(d: &Daemon, kind: &str) -> Value {
    wait_sync(
        kind,
        Duration::from_secs(30),
        || {
            d.records()
                .iter()
                .any(|r| is_kind(r, kind) && (r["event"] == "opened" || r["event"] == "signal"))
        },
        || d.log(),
    );
    d.records()
        .into_iter()
        .find(|r| is_kind(r, kind) && (r["event"] == "opened" || r["event"] == "signal"))
        .unwrap()
}

fn check(d: &Daemon) -> (Option<i32>, Value) {
    let out = d.cli(&["check", "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: {} {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out.status.code(), v)
}

fn findings(v: &Value) -> Vec<String> {
    v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["signal"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_fabric_stuck_in_progress_at_boot_fails_the_check_after_its_deadline() {
    let mut d = node("fabric_deadline = \"5m\"");
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(d.config(), format!("{cfg}{}", uptime(&d, 100))).unwrap();
    d.inject(r#"{"gpu": 2, "fabric": {"state": "in-progress"}}"#);
    // 100 s after boot: still registering, the check cannot tell (the launch gate asks again).
    let (code, v) = check(&d);
    assert_eq!(
        (code, v["verdict"].as_str()),
        (Some(2), Some("unknown")),
        "{v}"
    );
    let problems = v["probes"][0]["problems"].to_string();
    assert!(
        problems.contains("GPU 2") && problems.contains("in-progress"),
        "{v}"
    );
    // 400 s after boot: past the deadline, the instance fails; the rule reboots (Fabric Manager
    // registers the GPUs again at boot).
    uptime(&d, 400);
    d.inject(r#"{"gpu": 2, "fabric": {"state": "in-progress"}}"#);
    let (code, v) = check(&d);
    assert_eq!(
        (code, v["verdict"].as_str()),
        (Some(1), Some("unhealthy")),
        "{v}"
    );
    let f = &v["findings"][0];
    assert_eq!(
        (
            f["signal"].as_str(),
            f["gpu"].as_u64(),
            f["action"].as_str()
        ),
        (Some("fabric-not-completed"), Some(2), Some("reboot")),
        "{v}"
    );
    // A completed fabric is healthy.
    d.inject(r#"{"gpu": 2, "fabric": {"state": "completed"}}"#);
    let (code, v) = check(&d);
    assert_eq!(code, Some(0), "{v}");
}

#[test]
fn a_fabric_error_mid_run_replaces_and_links_are_shown_in_status_and_metrics() {
    let port = gpu_medic_testkit::free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut d = node("");
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        format!("{cfg}[metrics]\nenabled = true\nlisten = \"{addr}\"\n"),
    )
    .unwrap();
    d.start();
    d.wait_polled();
    d.inject(r#"{"gpu": 1, "fabric": {"status": 12}}"#);
    let r = opened(&d, "fabric-error");
    // The rule reboots; this node has no reboot rung (no AWS), so it is replaced and says so.
    assert_eq!(r["verdict"], "replace");
    assert!(
        r["reason"]
            .as_str()
            .is_some_and(|t| t.contains("the policy says reboot")),
        "{r}"
    );
    assert_eq!(r["observation"]["gpu"]["index"], 1);
    assert_eq!(r["observation"]["value"], 12);
    let out = d.cli(&["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("fabric completed") && text.contains("status 12"),
        "{text}"
    );
    assert!(text.contains("nvlinks 18 up"), "{text}");
    // The same view in the metrics: the fabric per GPU, its links, its PCIe link.
    let want = [
        "gpu_medic_gpu_fabric_state{gpu=\"1\",state=\"completed\"} 1",
        "gpu_medic_gpu_fabric_status{gpu=\"1\"} 12",
        "gpu_medic_gpu_fabric_status{gpu=\"0\"} 0",
        "gpu_medic_gpu_nvlinks{gpu=\"3\"} 18",
        "gpu_medic_gpu_nvlinks_down{gpu=\"3\"} 0",
        "gpu_medic_gpu_pcie_link_width{gpu=\"0\",link=\"max\"} 16",
        "gpu_medic_links_view_age_seconds{view=\"links\"}",
    ];
    wait_sync(
        "the links in the metrics",
        Duration::from_secs(20),
        || {
            let body = scrape(&addr);
            want.iter().all(|w| body.contains(w))
        },
        || scrape(&addr),
    );
    d.stop(Duration::from_secs(30));
}

#[test]
fn an_nvlink_down_and_crc_rates_over_and_under_the_threshold() {
    let mut d = node("nvlink_window = \"60s\"");
    d.start();
    d.wait_polled();
    // One burst of 500 CRC errors: 500 per minute over the window, under DCGM's 6000: logged.
    d.inject(r#"{"gpu": 0, "nvlink": {"link": 4, "crc_flit": 300, "crc_data": 200}}"#);
    let r = opened(&d, "nvlink-crc-errors");
    assert_eq!(r["verdict"], "log", "{r}");
    assert_eq!(r["rule"], "nvlink-crc-errors-low");
    // Sustained errors on another GPU: above the threshold, replaced.
    for _ in 0..8 {
        d.inject(r#"{"gpu": 3, "nvlink": {"link": 9, "crc_flit": 1000}}"#);
        std::thread::sleep(Duration::from_millis(250));
    }
    d.wait_record("the CRC replace", Duration::from_secs(30), "opened", |r| {
        is_kind(r, "nvlink-crc-errors") && r["verdict"] == "replace"
    });
    d.stop(Duration::from_secs(30));
}

#[test]
fn an_nvlink_that_was_up_going_down_replaces() {
    let mut d = node("");
    d.start();
    d.wait_polled();
    d.inject(r#"{"gpu": 2, "nvlink": {"link": 7, "active": false}}"#);
    let r = opened(&d, "nvlink-down");
    assert_eq!(r["verdict"], "replace");
    assert_eq!(r["observation"]["gpu"]["index"], 2);
    assert!(
        r["observation"]["detail"].as_str().unwrap().contains("[7]"),
        "{r}"
    );
    d.stop(Duration::from_secs(30));
}

#[test]
fn a_pcie_link_downtrained_from_gen5_x16_to_gen4_x8_is_recorded() {
    let mut d = node("");
    d.start();
    d.wait_polled();
    // Busy (no idle reason), so a lower generation is no power saving.
    d.inject(r#"{"gpu": 1, "pcie_link": {"generation": 4, "width": 8}, "throttle": 0}"#);
    let r = opened(&d, "pcie-downtrained");
    assert_eq!(r["verdict"], "log");
    assert_eq!(r["observation"]["value"], 25, "{r}");
    let detail = r["observation"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("Gen4 x8") && detail.contains("Gen5 x16"),
        "{detail}"
    );
    // Persistence mode switched off is recorded too.
    d.inject(r#"{"gpu": 0, "persistence": false}"#);
    opened(&d, "persistence-off");
    d.stop(Duration::from_secs(30));
}

/// A `systemctl` double printing `systemctl show` output from `fm-state` in the node's dir,
/// written into the node's config; its count of calls (gpu-medic's looks at the unit).
fn systemctl_double(d: &Daemon, state: &str) -> Looks {
    std::fs::write(d.path("fm-state"), state).unwrap();
    systemctl_script(d, &format!("cat '{}'", d.path("fm-state").display()))
}

/// A `systemctl` double running `body` (shell), written into the node's config; its count of
/// calls.
fn systemctl_script(d: &Daemon, body: &str) -> Looks {
    let script = d.path("systemctl");
    let looks = Looks::script(&script, body);
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        format!(
            "{cfg}systemctl = \"{}\"\nfabric_manager_interval = \"200ms\"\n",
            script.display()
        ),
    )
    .unwrap();
    looks
}

const FM_RUNNING: &str =
    "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=4242\nNRestarts=0\n";
const FM_STOPPED: &str = "LoadState=loaded\nActiveState=inactive\nSubState=dead\nMainPID=0\nNRestarts=0\nResult=success\n";

#[test]
fn fabric_manager_stopped_on_a_p5_drains_and_flapping_is_seen() {
    let mut d = node("instance_type = \"p5.48xlarge\"\nfabric_manager_flaps = 3");
    systemctl_double(&d, FM_RUNNING);
    d.start();
    d.wait_polled();
    // systemd restarts it three times.
    std::fs::write(
        d.path("fm-state"),
        FM_RUNNING.replace("NRestarts=0", "NRestarts=3"),
    )
    .unwrap();
    let r = opened(&d, "fabric-manager-flapping");
    assert_eq!(r["verdict"], "drain");
    d.stop(Duration::from_secs(30));
    std::fs::write(
        d.path("fm-state"),
        FM_STOPPED.replace("NRestarts=0", "NRestarts=3"),
    )
    .unwrap();
    // `check` on a stopped Fabric Manager cannot call the node healthy.
    let (code, v) = check(&d);
    assert_eq!(code, Some(2), "{v}");
    assert!(
        v.to_string().contains("Fabric Manager is not running"),
        "{v}"
    );
}

/// Unreadable is not down: a `systemctl show` answer of bytes that are not text, one of
/// megabytes, and an empty one, on a p5, are each a self-fault of gpu-medic's view of the
/// unit, never `fabric-manager-down` (which drains).
#[test]
fn an_unreadable_systemctl_answer_is_a_self_fault_not_fabric_manager_down() {
    let mut d = node("instance_type = \"p5.48xlarge\"");
    let looks = systemctl_double(&d, "");
    let binary = [0xff, 0xfe, 0x00, 0x80, b'\n'].repeat(100);
    std::fs::write(d.path("fm-state"), &binary).unwrap();
    d.start();
    d.wait_polled();
    let r = d.wait_record("the self-fault", Duration::from_secs(30), "opened", |r| {
        r["observation"]["signal"]["component"] == "fabric-manager"
    });
    assert!(
        r["observation"]["detail"]
            .as_str()
            .unwrap()
            .contains("unreadable answer"),
        "{r:#}"
    );
    // Each answer read several times (a stopped unit drains on its second look): once a look
    // has begun after the write, the one before it was judged whole.
    let huge = format!("{}{}", FM_STOPPED, "X=y\n".repeat(3 << 20));
    std::fs::write(d.path("fm-state"), huge).unwrap();
    looks.wait_more("looks at the megabytes", 4, || d.log());
    std::fs::write(d.path("fm-state"), "").unwrap();
    looks.wait_more("looks at the empty answer", 4, || d.log());
    d.stop(Duration::from_secs(30));
    assert!(
        !d.records()
            .iter()
            .any(|r| is_kind(r, "fabric-manager-down")),
        "{:#?}",
        d.records()
    );
    assert!(
        !d.records().iter().any(|r| r["event"] == "action-started"),
        "nothing drained: {:#?}",
        d.records()
    );
}

/// Fabric Manager's state is only ever running, stopped (systemd's words) or could not tell:
/// on a p5, a `systemctl` answering words systemd has not (`ActiveState=banana`, a load state
/// of its own), `active` with no main process, and a `systemctl` that fails ("Failed to
/// connect to bus", exit 1) each leave the node in service. gpu-medic says once that it could
/// not tell, naming what it read (the self-fault's detail, and `check`), and recovers at the
/// next readable answer; before, the first two read as stopped and drained on the second look.
#[test]
fn garbage_from_systemctl_is_could_not_tell_never_fabric_manager_down() {
    let mut d = node("instance_type = \"p5.48xlarge\"");
    std::fs::write(d.path("fm-state"), FM_RUNNING).unwrap();
    std::fs::write(d.path("fm-exit"), "0").unwrap();
    let looks = systemctl_script(
        &d,
        &format!(
            "cat '{}'; exit \"$(cat '{}')\"",
            d.path("fm-state").display(),
            d.path("fm-exit").display()
        ),
    );
    d.start();
    d.wait_polled();
    looks.wait_more("looks at a running unit", 2, || d.log());
    let garbage = [
        "LoadState=loaded\nActiveState=banana\nSubState=running\nMainPID=0\nNRestarts=0\n",
        "LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=0\nNRestarts=0\n",
        "LoadState=very-loaded\nActiveState=inactive\nSubState=dead\nMainPID=0\n",
    ];
    for g in garbage {
        std::fs::write(d.path("fm-state"), g).unwrap();
        looks.wait_more("looks at the garbage", 4, || d.log());
    }
    std::fs::write(
        d.path("fm-state"),
        "Failed to connect to bus: No such file or directory\n",
    )
    .unwrap();
    std::fs::write(d.path("fm-exit"), "1").unwrap();
    looks.wait_more("looks at a failing systemctl", 4, || d.log());
    // `check` on the same answer: could not tell, saying what it read.
    let (code, v) = check(&d);
    assert_eq!(code, Some(2), "{v}");
    assert!(
        v.to_string()
            .contains("could not tell whether Fabric Manager runs"),
        "{v}"
    );
    std::fs::write(d.path("fm-exit"), "0").unwrap();
    std::fs::write(d.path("fm-state"), FM_RUNNING).unwrap();
    d.wait_record("the recovery", Duration::from_secs(30), "signal", |r| {
        is_kind(r, "self-recovered") && r["observation"]["signal"]["component"] == "fabric-manager"
    });
    d.stop(Duration::from_secs(30));
    let records = d.records();
    assert!(
        !records.iter().any(|r| is_kind(r, "fabric-manager-down")),
        "{records:#?}"
    );
    assert!(
        !records.iter().any(|r| r["event"] == "action-started"),
        "nothing drained: {records:#?}"
    );
    let faults: Vec<&Value> = records
        .iter()
        .filter(|r| {
            r["event"] == "opened" && r["observation"]["signal"]["component"] == "fabric-manager"
        })
        .collect();
    assert_eq!(faults.len(), 1, "said once: {faults:#?}");
    let detail = faults[0]["observation"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("could not tell whether Fabric Manager runs")
            && detail.contains("ActiveState=banana"),
        "{detail}"
    );
}

#[test]
fn fabric_manager_stopped_from_the_start_drains_on_the_second_look() {
    let mut d = node("instance_type = \"p4d.24xlarge\"");
    systemctl_double(&d, FM_STOPPED);
    d.start();
    let r = opened(&d, "fabric-manager-down");
    assert_eq!(r["verdict"], "drain");
    assert!(r["observation"]["value"].as_u64().unwrap() >= 2, "{r}");
    d.stop(Duration::from_secs(30));
}

#[test]
fn an_instance_type_without_nvswitch_checks_nothing_about_fabric_manager() {
    let mut d = node("instance_type = \"g6e.12xlarge\"");
    let looks = systemctl_double(&d, FM_STOPPED);
    let (code, v) = check(&d);
    assert_eq!(code, Some(0), "{v}");
    assert!(!v.to_string().contains("fabric-manager"), "{v}");
    d.start();
    // Ten NVML polls (2 s at 200 ms) is ten of Fabric Manager's intervals: the unit is never
    // even asked about.
    d.wait_nvml_polls("polls on a type without NVSwitches", 10);
    let pid = d.pid().unwrap();
    d.stop(Duration::from_secs(30));
    assert_eq!(
        looks.count_from(pid),
        0,
        "the daemon asked systemctl about Fabric Manager"
    );
    let any = d.records().iter().any(|r| {
        r["observation"]["signal"]["kind"]
            .as_str()
            .is_some_and(|k| k.starts_with("fabric-manager"))
            || r["observation"]["signal"]["component"] == "fabric-manager"
    });
    assert!(
        !any,
        "Fabric Manager was reported on a type without NVSwitches"
    );
}

fn efa_port(d: &Daemon, state: &str, errors: u64) {
    let p = d.path("infiniband/rdmap16s27/ports/1");
    std::fs::create_dir_all(p.join("hw_counters")).unwrap();
    std::fs::write(p.join("state"), format!("{state}\n")).unwrap();
    std::fs::write(
        p.join("hw_counters/rdma_read_wr_err"),
        format!("{errors}\n"),
    )
    .unwrap();
    std::fs::write(p.join("hw_counters/tx_bytes"), "123456\n").unwrap();
}

/// Waits until the port watch's view (`state/ports.json`) shows the port in `state` with
/// `errors` read errors: it has looked at the port since it was last written.
fn wait_port(d: &Daemon, state: &str, errors: u64) {
    let seen = || {
        let text = std::fs::read_to_string(d.path("state/ports.json")).unwrap_or_default();
        let ports: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        ports.as_array().is_some_and(|a| {
            a.iter().any(|p| {
                p["device"] == "rdmap16s27"
                    && p["port"] == "1"
                    && p["state"] == state
                    && p["errors"]["hw_counters/rdma_read_wr_err"]
                        .as_u64()
                        .unwrap_or(0)
                        == errors
            })
        })
    };
    wait_sync(
        &format!("the port watch to see {state} ({errors} errors)"),
        Duration::from_secs(30),
        seen,
        || std::fs::read_to_string(d.path("state/ports.json")).unwrap_or_default(),
    );
}

#[test]
fn an_efa_port_flapping_drains() {
    let mut d = node("efa_flap_window = \"1m\"");
    efa_port(&d, "4: ACTIVE", 0);
    d.start();
    d.wait_polled();
    // Each state held until the port watch has seen it (its view, `ports.json`).
    for i in 0..3 {
        efa_port(&d, "1: DOWN", i);
        wait_port(&d, "DOWN", i);
        efa_port(&d, "4: ACTIVE", i);
        wait_port(&d, "ACTIVE", i);
    }
    // The first DOWN opened a drain (efa-port-down); the flapping joins it.
    let down = opened(&d, "efa-port-down");
    assert_eq!(down["verdict"], "drain");
    let r = seen(&d, "efa-port-flapping");
    assert!(r["observation"]["value"].as_u64().unwrap() >= 4, "{r}");
    assert!(
        r["observation"]["detail"]
            .as_str()
            .unwrap()
            .contains("rdmap16s27/1"),
        "{r}"
    );
    d.stop(Duration::from_secs(30));
    // A port down fails the launch check.
    efa_port(&d, "1: DOWN", 0);
    let (code, v) = check(&d);
    assert_eq!(code, Some(1), "{v}");
    assert_eq!(findings(&v), ["efa-port-down"], "{v}");
}

/// SXid lines as the Fabric Manager user guide prints them, appended to the kernel log.
#[test]
fn sxid_lines_in_the_kernel_log_are_judged_by_severity_once() {
    let mut d = node("");
    d.start();
    d.wait_polled();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(d.path("kmsg"))
        .unwrap();
    // Stamped now, as the kernel stamps a record (microseconds since boot): a stamp past this
    // boot's uptime is an earlier boot's, skipped.
    let now = gpu_medic_testkit::proc::uptime_usec;
    writeln!(f, "4,901,{},-;nvidia-nvswitch0: SXid (PCI:0000:15:00.0): 11012, Non-fatal, Link 32 single bit ECC error", now()).unwrap();
    writeln!(f, "4,902,{},-;nvidia-nvswitch0: SXid (PCI:0000:15:00.0): 11012, Severity 0 Engine instance 32 Sub-engine instance 00", now()).unwrap();
    f.flush().unwrap();
    // One record at a time: records arriving in one write are issue 26 item 0's (the kernel-log
    // reader's batching), not this test's.
    let nonfatal = |d: &Daemon| {
        std::fs::read_to_string(d.path("state/inputs.jsonl"))
            .unwrap_or_default()
            .contains("sxid-non-fatal")
    };
    wait_sync(
        "the non-fatal SXid",
        Duration::from_secs(30),
        || nonfatal(&d),
        || d.log(),
    );
    writeln!(f, "4,903,{},-;nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 46 LTSSM Fault Up", now()).unwrap();
    drop(f);
    let r = opened(&d, "sxid-fatal");
    // The rule reboots once; without the reboot rung (no AWS here) it is a replacement.
    assert_eq!(r["verdict"], "replace");
    assert!(
        r["reason"]
            .as_str()
            .is_some_and(|t| t.contains("the policy says reboot")),
        "{r}"
    );
    assert_eq!(r["observation"]["signal"]["code"], 20034);
    assert!(
        r["observation"].get("gpu").is_none(),
        "an NVSwitch is no GPU: {r}"
    );
    d.stop(Duration::from_secs(30));
    // The non-fatal one is journaled too, once (the data line after it is part of it).
    let inputs = std::fs::read_to_string(d.path("state/inputs.jsonl")).unwrap_or_default();
    assert_eq!(inputs.matches("\"sxid-non-fatal\"").count(), 1, "{inputs}");
    let count = |recs: &[Value]| {
        recs.iter()
            .filter(|r| {
                r["observation"]["signal"]["kind"]
                    .as_str()
                    .is_some_and(|k| k.starts_with("sxid"))
                    && (r["event"] == "opened" || r["event"] == "signal")
            })
            .count()
    };
    let before = count(&d.records());
    assert!(before >= 1, "{before}");
    // A restart reads the same kernel log again: nothing is journaled twice. A line written
    // after the restart is the fact that the reader has read past the old ones: journaled
    // once, and after it nothing of before.
    d.start();
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(d.path("kmsg"))
        .unwrap();
    writeln!(f, "4,904,{},-;nvidia-nvswitch1: SXid (PCI:0000:16:00.0): 11013, Non-fatal, Link 07 marker after the restart", gpu_medic_testkit::proc::uptime_usec()).unwrap();
    drop(f);
    wait_sync(
        "the SXid written after the restart",
        Duration::from_secs(30),
        || {
            std::fs::read_to_string(d.path("state/inputs.jsonl"))
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .any(|v| v["signal"]["code"] == 11013)
        },
        || d.log(),
    );
    d.stop(Duration::from_secs(30));
    let inputs = std::fs::read_to_string(d.path("state/inputs.jsonl")).unwrap_or_default();
    let sxids = inputs.matches("\"sxid-").count();
    assert_eq!(
        sxids, 3,
        "two SXids, the data line part of the first, journaled once, and the new one: {inputs}"
    );
    let old = |recs: &[Value]| {
        recs.iter()
            .filter(|r| r["observation"]["signal"]["code"] != 11013)
            .cloned()
            .collect::<Vec<_>>()
    };
    assert_eq!(count(&old(&d.records())), before);
}
