//! gpu-medic against NVIDIA's real `libnvidia-ml.so.1` (Debian's `libnvidia-ml1`, which CI
//! installs: .ci/install-deps.sh) on a machine without an NVIDIA driver, and against the fake
//! library with entry points taken out, as an older driver's library lacks them.
//!
//! - `run`, `check`, `status` and `diagnose` on the real library: the documented
//!   driver-not-loaded path (nvmlInit_v2 returns NVML_ERROR_DRIVER_NOT_LOADED, 9, here: it finds
//!   no `/sys/module/nvidia` and `/dev/nvidiactl` does not open), its exit codes and messages,
//!   no panic, and no action (AWS off: the decision is journaled as what would have been done).
//! - Every NVML function gpu-medic calls (the fake notes each, `FAKE_NVML_CALLS`, while the
//!   daemon, `check` and `diagnose` run) is in the real library's dynamic symbol table, or
//!   gpu-medic handles its absence: the one R535 lacks has a fallback, shown with the fake
//!   library without it, which also shows a missing entry point read as "not available" for its
//!   reading alone: no incident, no self-fault, the rest watched.
//!
//! Where the real library is missing, the tests fail and say so. On a machine where an NVIDIA
//! driver is loaded the driver-not-loaded path cannot happen: those tests say so and check
//! nothing (the symbol check still runs).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use gpu_medic_testkit::elf::dynamic_symbols;
use gpu_medic_testkit::{Daemon, FOUR_GPUS, default_policy, fake_nvml_without};
use serde_json::Value;

/// NVIDIA's library as Debian installs it (through the alternatives link).
fn real_library() -> PathBuf {
    let path = PathBuf::from(format!(
        "/usr/lib/{}-linux-gnu/libnvidia-ml.so.1",
        std::env::consts::ARCH
    ));
    assert!(
        path.exists(),
        "NVIDIA's libnvidia-ml.so.1 is not at {}: install Debian's libnvidia-ml1 \
         (sudo bash .ci/install-deps.sh; CI does)",
        path.display()
    );
    path
}

/// The NVML functions `lib` defines.
fn defined(lib: &Path) -> BTreeSet<String> {
    dynamic_symbols(lib)
        .unwrap()
        .into_iter()
        .filter(|s| s.defined && s.name.starts_with("nvml"))
        .map(|s| s.name)
        .collect()
}

/// False, and says why, where a driver is loaded: the real library then talks to it.
fn no_driver_here() -> bool {
    let loaded = Path::new("/proc/driver/nvidia/version").exists();
    if loaded {
        eprintln!(
            "an NVIDIA driver is loaded on this machine: the driver-not-loaded path cannot be seen here"
        );
    }
    !loaded
}

/// A node on `library`, MPS and AWS off, no kernel log; `nvml`: extra `[nvml]` lines.
fn node(library: &Path, nvml: &str) -> Daemon {
    Daemon::new(&format!(
        "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nlibrary = \"{}\"\nkmsg = \"\"\npoll_interval = \"200ms\"\n{nvml}\n\
         [mps]\nenabled = false\n[aws]\nenabled = false\n",
        default_policy().display(),
        library.display()
    ))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Neither stream of a command mentions a panic.
fn no_panic(what: &str, out: &Output) {
    let all = text(&out.stdout) + &text(&out.stderr);
    assert!(!all.contains("panicked"), "{what} panicked: {all}");
}

#[test]
fn the_real_library_is_nvidias_not_the_fake() {
    let real = defined(&real_library());
    let fake = defined(&gpu_medic_testkit::fake_nvml());
    assert!(
        real.len() > 2 * fake.len() && real.contains("nvmlInit_v2"),
        "{} NVML functions in {}: is it the fake?",
        real.len(),
        real_library().display()
    );
}

#[test]
fn check_says_the_driver_is_not_loaded_and_exits_1() {
    if !no_driver_here() {
        return;
    }
    let n = node(&real_library(), "");
    let out = n.cli(&["check", "--json"]);
    no_panic("check --json", &out);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verdict"], "unhealthy");
    assert_eq!(v["gpus"], serde_json::json!([]));
    let f = &v["findings"][0];
    assert_eq!(f["signal"], "driver-not-loaded");
    assert_eq!(f["action"], "replace");
    assert_eq!(f["rule"], "driver-not-loaded");
    let detail = f["detail"].as_str().unwrap();
    assert!(
        detail.contains("says the NVIDIA driver is not loaded")
            && detail.contains(&real_library().display().to_string()),
        "expected the real library's DRIVER_NOT_LOADED: {detail}"
    );
    // The library loaded and answered: the probe itself is fine (not "could not tell", 2).
    assert_eq!(v["probes"][0]["ok"], true);
    let out = n.cli(&["check"]);
    no_panic("check", &out);
    assert_eq!(out.status.code(), Some(1));
    let t = text(&out.stdout);
    assert!(
        t.contains("verdict: unhealthy")
            && t.contains("driver-not-loaded")
            && t.contains("replace"),
        "{t}"
    );
}

#[test]
fn diagnose_and_status_cannot_tell_and_say_why() {
    if !no_driver_here() {
        return;
    }
    let n = node(
        &real_library(),
        "[diagnose]\ncuda_library = \"/nonexistent/libcuda.so.1\"",
    );
    let out = n.cli(&["diagnose", "--json"]);
    no_panic("diagnose", &out);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["result"], "unknown", "{v:#}");
    assert_eq!(v["gpus"], serde_json::json!([]));
    let summary = v["summary"].as_str().unwrap();
    assert!(
        summary.starts_with("could not tell: no GPU to test")
            && summary.contains("says the NVIDIA driver is not loaded"),
        "{summary}"
    );
    let out = n.cli(&["diagnose"]);
    assert_eq!(out.status.code(), Some(2));
    let t = text(&out.stdout);
    assert!(
        t.contains("could not tell")
            && t.contains("this is not a pass")
            && t.contains("driver is not loaded"),
        "{t}"
    );
    // No daemon has run with this config: nothing to show, exit 3.
    let out = n.cli(&["status"]);
    no_panic("status", &out);
    assert_eq!(out.status.code(), Some(3));
    assert!(
        text(&out.stderr).contains("no state yet"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn run_journals_a_replace_it_does_not_carry_out() {
    if !no_driver_here() {
        return;
    }
    let mut n = node(&real_library(), "");
    n.start();
    let opened = n.wait_record(
        "the driver-not-loaded incident (3 in 5 min)",
        Duration::from_secs(30),
        "opened",
        |r| r["observation"]["signal"]["kind"] == "driver-not-loaded",
    );
    assert_eq!(opened["verdict"], "replace");
    assert_eq!(opened["rule"], "driver-not-loaded");
    let id = opened["incident"].as_u64().unwrap() as u32;
    let closed = n.wait_closed(id, Duration::from_secs(30));
    assert_eq!(closed["state"], "observed", "{closed:#}");
    assert!(
        closed["summary"]
            .as_str()
            .is_some_and(|s| s.contains("AWS remediation disabled")),
        "{closed:#}"
    );
    // What would have been done, each order a dry run that never finished; the node never
    // left service.
    assert_eq!(
        gpu_medic_testkit::journal::started_commands(&closed),
        ["quarantine", "drain", "replace"]
    );
    let records = closed["records"].as_array().unwrap();
    assert!(
        records
            .iter()
            .filter(|r| r["event"] == "action-started")
            .all(|r| r["dry_run"] == true),
        "{closed:#}"
    );
    assert!(
        !records.iter().any(|r| r["event"] == "action-finished"),
        "{closed:#}"
    );
    let out = n.cli(&["status", "--json"]);
    no_panic("status", &out);
    assert_eq!(out.status.code(), Some(0));
    let s: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["node_phase"], "in-service", "{s:#}");
    assert!(s["remediation"].is_null(), "{s:#}");
    let status = n.stop(Duration::from_secs(30));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}: {}",
        n.log()
    );
    assert!(!n.log().contains("panicked"), "{}", n.log());
}

/// NVML functions gpu-medic calls that R535's library lacks, and what gpu-medic does without
/// them (each shown by `a_library_without_an_entry_point_loses_that_reading_alone`).
const HANDLED_ABSENT: &[(&str, &str)] = &[(
    "nvmlDeviceGetGpuFabricInfoV",
    "the fabric is read through nvmlDeviceGetGpuFabricInfo (probe/nvml/raw.rs)",
)];

/// Every NVML function the fake saw called (`FAKE_NVML_CALLS`) while a daemon polled, took
/// an XID and a recovery action through its event set, and `check` and `diagnose` ran (the
/// CUDA tier finds no libcuda here; NVML lists the GPU first); with the names gpu-medic looked
/// up and did not find (its "undefined symbol" warnings).
fn functions_gpu_medic_calls() -> BTreeSet<String> {
    let mut n = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    n.gpus(FOUR_GPUS);
    let calls = n.path("nvml-calls");
    n.env("FAKE_NVML_CALLS", &calls);
    n.start();
    n.wait_polled();
    n.inject(r#"{"gpu": 1, "xid": 79}"#);
    n.inject(r#"{"gpu": 0, "recovery_action": 2}"#);
    // Both through the event set; the second joins the first's node incident.
    gpu_medic_testkit::wait_sync(
        "the XID and the recovery action",
        Duration::from_secs(20),
        || {
            let log = n.log();
            log.contains(r#""signal":"xid 79""#)
                && log.contains(r#""signal":"recovery-action node-reboot""#)
        },
        || n.log(),
    );
    n.wait_nvml_polls("more polls", 2);
    // `check` and `diagnose` (which has NVML list the GPUs): only their NVML calls matter.
    no_panic("check", &n.cli(&["check", "--json"]));
    no_panic("diagnose", &n.cli(&["diagnose", "--json", "--gpu", "0"]));
    assert!(n.stop(Duration::from_secs(30)).is_some_and(|s| s.success()));
    let mut names: BTreeSet<String> = std::fs::read_to_string(&calls)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    for l in n.log().lines() {
        if let Some((_, rest)) = l.split_once("undefined symbol: ") {
            names.insert(
                rest.chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_')
                    .collect(),
            );
        }
    }
    names
}

#[test]
fn every_nvml_function_gpu_medic_calls_is_in_the_real_library_or_handled() {
    let real = defined(&real_library());
    let called = functions_gpu_medic_calls();
    eprintln!("NVML functions gpu-medic called: {called:?}");
    // The recording saw the paths it should: the versioned entry points nvml-wrapper resolves.
    for f in [
        "nvmlInit_v2",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetPciInfo_v3",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlEventSetWait_v2",
        "nvmlDeviceGetFieldValues",
        "nvmlDeviceGetRemappedRows",
    ] {
        assert!(called.contains(f), "{f} not called: {called:?}");
    }
    let missing: Vec<&String> = called.iter().filter(|f| !real.contains(*f)).collect();
    let unhandled: Vec<&&String> = missing
        .iter()
        .filter(|f| !HANDLED_ABSENT.iter().any(|(h, _)| *h == f.as_str()))
        .collect();
    assert!(
        unhandled.is_empty(),
        "gpu-medic calls {unhandled:?}, which {} does not define, and nothing says how it does without",
        real_library().display()
    );
    for (f, how) in HANDLED_ABSENT {
        eprintln!(
            "{f}: {} in the real library; without it {how}",
            if real.contains(*f) {
                "present"
            } else {
                "absent"
            }
        );
    }
}

#[test]
fn a_library_without_an_entry_point_loses_that_reading_alone() {
    let dir = tempfile::tempdir().unwrap();
    let gone = [
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetGpuFabricInfoV",
    ];
    let lib = fake_nvml_without(dir.path(), &gone);
    let mut n = node(&lib, "");
    n.start();
    n.wait_polled();
    n.wait_nvml_polls("polls without the entry points", 3);
    let log = n.log();
    for (what, symbol) in [("memory info", gone[0]), ("MPS client list", gone[1])] {
        let line = format!("GPU 0: {what} is not available");
        assert!(
            log.lines()
                .any(|l| l.contains(&line) && l.contains(&format!("undefined symbol: {symbol}"))),
            "no warning that {what} is not available: {log}"
        );
        assert_eq!(log.matches(&line).count(), 1, "warned once per GPU: {log}");
    }
    // The fabric is read through the older entry point instead.
    let out = n.cli(&["status"]);
    assert_eq!(out.status.code(), Some(0));
    let t = text(&out.stdout);
    assert!(t.contains("GPU 0: fabric completed"), "{t}");
    // Not a finding, not a fault of gpu-medic's: nothing opened, nothing to fix.
    assert!(n.records().is_empty(), "{:?}", n.records());
    assert_eq!(n.state()["self_faults"], serde_json::json!({}));
    let out = n.cli(&["check", "--json"]);
    no_panic("check", &out);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    // The rest is watched: an XID still arrives through the event set.
    n.inject(r#"{"gpu": 1, "xid": 79}"#);
    let r = n.wait_record("the XID 79", Duration::from_secs(20), "opened", |r| {
        r["observation"]["signal"]["code"] == 79
    });
    assert_eq!(r["verdict"], "replace");
    assert!(n.stop(Duration::from_secs(30)).is_some_and(|s| s.success()));
    assert!(!n.log().contains("panicked"));
}
