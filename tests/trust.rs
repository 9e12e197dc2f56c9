//! Trust under mistakes and hostile input, through the real binary: a mistake (a missing
//! library or binary, a bad interval) is a configuration error or a self-fault of gpu-medic,
//! never a hardware fault; a closed stdout, a corrupt state file or a far-future replay never
//! panics or keeps the daemon from starting; status never claims what did not happen; SIGHUP
//! reloads only a valid configuration. NVML is the fake libnvidia-ml (tests/fake-nvml) loaded
//! through the real bindings; the MPS control client is a shell script where the test needs
//! one that answers (NVIDIA's daemon cannot be made to vanish mid-run).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use gpu_medic_testkit::{Looks, bin, fake_nvml, gpus_json, wait_looks, wait_sync};

/// Polls `f` for up to 20 s; panics naming `what` if it never holds.
fn wait_until(what: &str, f: impl FnMut() -> bool) {
    wait_sync(what, Duration::from_secs(20), f, String::new);
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn policy() -> PathBuf {
    repo().join("policies/default.toml")
}

/// A node in a temp dir: config, state, the fake NVML's files, a daemon.
struct Node {
    dir: tempfile::TempDir,
    daemon: Option<Child>,
    injected: u32,
    /// Variables added for `run` (`GPU_MEDIC_LOG`).
    run_env: Vec<(String, String)>,
}

impl Node {
    /// `body` is appended to a config with state_dir, policy and a 100 ms tick.
    fn new(body: &str) -> Node {
        let dir = tempfile::Builder::new()
            .prefix("gm-trust-")
            .tempdir_in("/tmp")
            .unwrap();
        std::fs::create_dir_all(dir.path().join("inject")).unwrap();
        std::fs::write(dir.path().join("gpus.json"), gpus_json(2)).unwrap();
        let node = Node {
            dir,
            daemon: None,
            injected: 0,
            run_env: Vec::new(),
        };
        node.write_config(body);
        node
    }

    /// NVML through the fake library, polled every 200 ms; everything else off.
    fn with_fake_nvml() -> Node {
        Node::new(&format!(
            "[nvml]\nlibrary = \"{}\"\npoll_interval = \"200ms\"\nkmsg = \"\"\n\
             [mps]\nenabled = false\n[aws]\nenabled = false\n[node]\nenabled = false\n",
            fake_nvml().display()
        ))
    }

    fn write_config(&self, body: &str) {
        std::fs::write(
            self.path("config.toml"),
            format!(
                "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n{body}",
                policy().display()
            ),
        )
        .unwrap();
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(bin());
        c.args(args)
            .arg("--config")
            .arg(self.path("config.toml"))
            .env("FAKE_NVML_CONFIG", self.path("gpus.json"))
            .env("FAKE_NVML_INJECT_DIR", self.path("inject"))
            .env("FAKE_NVML_POLLS", self.path("nvml-polls"))
            .env_remove("GPU_MEDIC_CONFIG")
            .env_remove("WATCHDOG_USEC");
        c
    }

    fn start(&mut self) {
        let child = self
            .cmd(&["run", "--log-format", "json"])
            .envs(self.run_env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(self.path("daemon.log")).unwrap())
            .spawn()
            .unwrap();
        self.daemon = Some(child);
        let state = self.path("state/state.json");
        wait_until("the daemon to start", || state.exists());
    }

    fn signal(&self, sig: libc::c_int) {
        let pid = self.daemon.as_ref().expect("running").id() as i32;
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(pid, sig) };
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.daemon.take() {
            // SAFETY: signalling our own child by pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let status = c.wait().unwrap();
            assert!(status.success(), "daemon exit {status:?}: {}", self.log());
        }
    }

    /// Waits for the first NVML poll (its log line): counters have their baselines.
    fn wait_polled(&self) {
        wait_until("the first NVML poll", || {
            self.log().contains("first NVML poll done")
        });
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.path("daemon.log")).unwrap_or_default()
    }

    /// Waits until the running daemon has polled NVML `n` more times (the fake counts them).
    fn wait_nvml_polls(&self, what: &str, n: usize) {
        let pid = self.daemon.as_ref().expect("running").id();
        let polls = Looks::at(self.path("nvml-polls"));
        wait_looks(what, n, || polls.count_from(pid), || self.log());
    }

    fn inject(&mut self, json: &str) {
        self.injected += 1;
        let tmp = self.path(&format!("inject/{:04}.json.tmp", self.injected));
        std::fs::write(&tmp, json).unwrap();
        std::fs::rename(
            &tmp,
            self.path(&format!("inject/{:04}.json", self.injected)),
        )
        .unwrap();
    }

    fn records(&self) -> Vec<Value> {
        std::fs::read_to_string(self.path("state/incidents.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    fn text(&self, args: &[&str]) -> (i32, String, String) {
        let out = self.cmd(args).output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
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

fn is_self_fault(r: &Value, component: &str) -> bool {
    r["event"] == "opened"
        && r["observation"]["signal"]["kind"] == "self-fault"
        && r["observation"]["signal"]["component"] == component
}

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join(name);
    std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    p
}

/// The issue's first example: `[nvml] library` naming a missing file made `check` answer
/// `replace` and `run` open a replace incident on every poll. Now both refuse to start.
#[test]
fn a_missing_nvml_library_is_a_configuration_error_not_a_replace() {
    let node = Node::new(
        "[nvml]\nlibrary = \"/nonexistent/libnvidia-ml.so.1\"\nkmsg = \"\"\n\
         [mps]\nenabled = false\n[aws]\nenabled = false\n",
    );
    for args in [&["check", "--json"][..], &["check"], &["run"]] {
        let (code, out, err) = node.text(args);
        assert_eq!(code, 78, "{args:?}: {out}{err}");
        assert!(!out.contains("replace"), "{args:?}: {out}");
        let want = format!("{}:5: [nvml] library", node.path("config.toml").display());
        assert!(err.contains(&want), "{args:?}: {err}");
    }
    assert!(!node.path("state/incidents.jsonl").exists());
    // A file that is not an NVML library at all: the same mistake.
    let junk = node.path("libjunk.so");
    std::fs::write(&junk, "not a library").unwrap();
    node.write_config(&format!(
        "[nvml]\nlibrary = \"{}\"\nkmsg = \"\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
        junk.display()
    ));
    let (code, _, err) = node.text(&["check"]);
    assert_eq!(code, 78, "{err}");
}

/// The issue's second example: a missing `[mps] control_binary` was reported as mps-down,
/// "restarted" three times and then replaced. Now `run` and `check` refuse to start.
#[test]
fn a_missing_control_binary_is_a_configuration_error_at_start() {
    let node = Node::new(
        "[nvml]\nenabled = false\n[aws]\nenabled = false\n[mps]\nmanage = \"direct\"\n\
         control_binary = \"/nonexistent/nvidia-cuda-mps-control\"\n",
    );
    for args in [&["run"][..], &["check", "--json"]] {
        let (code, out, err) = node.text(args);
        assert_eq!(code, 78, "{args:?}: {out}{err}");
        let want = format!(
            "{}:10: [mps] control_binary",
            node.path("config.toml").display()
        );
        assert!(err.contains(&want), "{args:?}: {err}");
    }
    assert!(!node.path("state/incidents.jsonl").exists());
}

/// Issue 26: any executable passed the start check as the MPS control binary (`/bin/true`, a
/// junk script, one that hangs), and its silence was judged a dead daemon: restarted, then
/// `replace`, so the launch gate would abandon every new instance. Now it must show NVIDIA's
/// banner for `-h` first, and a pipe directory that is a regular file is refused too.
#[test]
fn a_control_binary_that_is_not_nvidias_or_a_pipe_dir_that_is_a_file_is_a_mistake() {
    let probe = tempfile::tempdir().unwrap();
    let junk = script(probe.path(), "junk", "echo hello; exit 0");
    let hangs = script(probe.path(), "hangs", "sleep 600");
    let fails = script(probe.path(), "fails", "echo 'CUDA MPS Control'; exit 3");
    for (binary, why) in [
        (PathBuf::from("/bin/true"), "without the"),
        (junk, "first line: \"hello\""),
        (hangs, "did not answer within"),
        (fails, "exited exit status: 3"),
    ] {
        let node = Node::new(&format!(
            "[nvml]\nenabled = false\n[aws]\nenabled = false\n[mps]\nmanage = \"direct\"\n\
             control_binary = \"{}\"\n",
            binary.display()
        ));
        for args in [&["run"][..], &["check", "--json"]] {
            let (code, out, err) = node.text(args);
            assert_eq!(code, 78, "{binary:?} {args:?}: {out}{err}");
            let want = format!(
                "{}:10: [mps] control_binary",
                node.path("config.toml").display()
            );
            assert!(err.contains(&want), "{args:?}: {err}");
            assert!(err.contains("not NVIDIA's MPS control"), "{err}");
            assert!(err.contains(why), "{binary:?}: {err}");
        }
        assert!(!node.path("state/incidents.jsonl").exists());
    }
    // NVIDIA's own binary passes; its pipe directory being a regular file does not.
    let node = Node::new("");
    std::fs::write(node.path("pipe"), "not a directory").unwrap();
    node.write_config(&format!(
        "[nvml]\nenabled = false\n[aws]\nenabled = false\n[mps]\nmanage = \"direct\"\n\
         control_binary = \"/usr/bin/nvidia-cuda-mps-control\"\npipe_directory = \"{}\"\n",
        node.path("pipe").display()
    ));
    let (code, _, err) = node.text(&["check", "--json"]);
    assert_eq!(code, 78, "{err}");
    assert!(
        err.contains("[mps] pipe_directory") && err.contains("not a directory"),
        "{err}"
    );
}

/// A control binary that vanishes while gpu-medic runs (a package removed): one self-fault
/// incident, no mps-down, no restart, status says the daemon's state is unknown; when the
/// binary is back the incident is resolved.
#[test]
fn a_control_binary_that_disappears_is_one_self_fault_never_a_restart() {
    let mut node = Node::new("");
    // A stand-in that shows NVIDIA's banner for `-h` (the start check) and answers probes,
    // counting its calls.
    let control = node.path("mps-control");
    let calls = Looks::script(
        &control,
        "[ \"$1\" = -h ] && { echo 'CUDA MPS Control for Linux/Unix.'; exit 0; }\ncat >/dev/null; echo 100.0",
    );
    // Each probe that cannot run it is a debug line (said once at error level).
    node.run_env.push((
        "GPU_MEDIC_LOG".into(),
        "info,gpu_medic::probe::mps=debug".into(),
    ));
    node.write_config(&format!(
        "[nvml]\nenabled = false\n[aws]\nenabled = false\n[node]\nenabled = false\n\
         [mps]\nmanage = \"direct\"\ncontrol_binary = \"{}\"\npipe_directory = \"{}\"\n\
         log_directory = \"{}\"\nprobe_interval = \"200ms\"\nprobe_timeout = \"150ms\"\n",
        control.display(),
        node.path("pipe").display(),
        node.path("log").display()
    ));
    node.start();
    calls.wait_more("a probe answered", 1, || node.log());
    let aside = node.path("mps-control.removed");
    std::fs::rename(&control, &aside).unwrap();
    wait_until("the self-fault", || {
        node.records()
            .iter()
            .any(|r| is_self_fault(r, "mps-control"))
    });
    // Many probes later: still one incident, and nothing was done about the daemon.
    wait_looks(
        "probes without the binary",
        5,
        || {
            node.log()
                .matches("still cannot run the MPS control client")
                .count()
        },
        || node.log(),
    );
    let records = node.records();
    let opened: Vec<&Value> = records.iter().filter(|r| r["event"] == "opened").collect();
    assert_eq!(opened.len(), 1, "{records:#?}");
    assert!(
        !records.iter().any(|r| r["event"] == "action-started"),
        "{records:#?}"
    );
    let (code, status, _) = node.text(&["status"]);
    assert_eq!(code, 0);
    assert!(status.contains("self-fault:  mps-control"), "{status}");
    assert!(status.contains("mps daemon:  unknown"), "{status}");
    let (_, json, _) = node.text(&["status", "--json"]);
    let v: Value = serde_json::from_str(json.trim()).unwrap();
    assert!(v["self_faults"]["mps-control"]["incident"].is_u64(), "{v}");
    std::fs::rename(&aside, &control).unwrap();
    wait_until("the all-clear", || {
        node.records()
            .iter()
            .any(|r| r["event"] == "closed" && r["state"] == "resolved")
    });
    node.stop();
    let (_, status, _) = node.text(&["status"]);
    assert!(!status.contains("self-fault"), "{status}");
}

/// NVML that cannot count the GPUs: gpu-medic cannot tell anything about them. One
/// self-fault incident (not one per poll), status says the GPUs are unknown instead of "no
/// GPU has raised a signal", and `check` says it could not tell (exit 2).
#[test]
fn nvml_that_cannot_count_the_gpus_is_a_self_fault_and_check_cannot_tell() {
    let mut node = Node::with_fake_nvml();
    node.start();
    node.inject(r#"{"fail": {"function": "nvmlDeviceGetCount_v2", "code": 999}}"#);
    wait_until("the self-fault", || {
        node.records().iter().any(|r| is_self_fault(r, "nvml"))
    });
    node.wait_nvml_polls("polls that cannot count the GPUs", 5);
    let records = node.records();
    assert_eq!(
        records.iter().filter(|r| r["event"] == "opened").count(),
        1,
        "{records:#?}"
    );
    let (_, status, _) = node.text(&["status"]);
    assert!(status.contains("gpus:        unknown"), "{status}");
    assert!(!status.contains("no GPU has raised a signal"), "{status}");
    node.stop();
    // The daemon consumed that injection; the one-shot check gets its own.
    node.inject(r#"{"fail": {"function": "nvmlDeviceGetCount_v2", "code": 999}}"#);
    let (code, out, err) = node.text(&["check", "--json"]);
    assert_eq!(code, 2, "{out}{err}");
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["verdict"], "unknown");
    // Clearing the injection: the next check is healthy again.
    node.inject(r#"{"fail": {"function": "nvmlDeviceGetCount_v2", "code": 0}}"#);
    let (code, out, _) = node.text(&["check", "--json"]);
    assert_eq!(code, 0, "{out}");
}

/// With AWS disabled an XID 79 is recorded as what would have been done; status never says
/// the node was drained, and names why nothing was done.
#[test]
fn without_aws_status_says_would_replace_not_drained() {
    let mut node = Node::with_fake_nvml();
    node.start();
    node.wait_polled();
    node.inject(r#"{"gpu": 1, "xid": 79}"#);
    wait_until("the decision", || {
        node.records()
            .iter()
            .any(|r| r["event"] == "closed" && r["state"] == "observed")
    });
    node.stop();
    let (_, status, _) = node.text(&["status"]);
    assert!(status.contains("node:        in-service"), "{status}");
    assert!(
        status.contains("would replace: AWS remediation disabled"),
        "{status}"
    );
    assert!(!status.contains("drained"), "{status}");
    assert!(
        status.contains("mps daemon:  not managed by gpu-medic"),
        "{status}"
    );
    let (_, shown, _) = node.text(&["incidents", "show", "1"]);
    assert!(shown.contains("AWS remediation disabled"), "{shown}");
}

/// Runs `c` with stdout a pipe whose reader is already gone (every write fails with EPIPE);
/// returns its exit code and stderr.
fn with_closed_stdout(mut c: Command) -> (i32, String) {
    let mut fds = [0; 2];
    // SAFETY: pipe(2) writes two descriptors into the array we own.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: closing the read end we own; the write end is handed to the child below.
    unsafe { libc::close(fds[0]) };
    // SAFETY: fds[1] is a descriptor we own and hand over exactly once.
    let stdout = unsafe { <Stdio as std::os::fd::FromRawFd>::from_raw_fd(fds[1]) };
    let out = c.stdout(stdout).stderr(Stdio::piped()).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `gpu-medic incidents show 1 | true`, `status | true` and every other command end
/// quietly on a closed stdout, with their own exit code.
#[test]
fn a_closed_stdout_ends_every_command_quietly() {
    let mut node = Node::new(
        "[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n[node]\nenabled = false\n",
    );
    node.start();
    node.stop();
    // One incident to show: a journal line written the way the daemon writes them.
    let record = r#"{"at":"2026-01-01T00:00:00.000Z","incident":1,"event":"opened","observation":{"signal":{"kind":"xid","code":13},"gpu":{"index":0}},"rule":"xid-app","reason":"application fault","verdict":"log"}"#;
    std::fs::write(node.path("state/incidents.jsonl"), format!("{record}\n")).unwrap();
    // GPU memory history for `tasks`: a row, and a line that is not one (skipped, said).
    std::fs::write(
        node.path("state/gpu-memory.jsonl"),
        "{\"minute\":60,\"family\":\"infer\",\"revision\":\"3\",\"container\":\"app\",\"peak_bytes\":1048576000,\"reserved_bytes\":2147483648}\nnot a row\n",
    )
    .unwrap();
    let inputs = node.path("inputs.jsonl");
    std::fs::write(
        &inputs,
        "{\"at\":\"2026-01-01T00:00:00Z\",\"input\":\"observation\",\"signal\":{\"kind\":\"xid\",\"code\":79},\"gpu\":{\"index\":1}}\n",
    )
    .unwrap();
    let inputs = inputs.display().to_string();
    let policy = policy().display().to_string();
    let cases: Vec<(Vec<&str>, i32)> = vec![
        (vec!["incidents", "show", "1"], 0),
        (vec!["incidents", "show", "1", "--json"], 0),
        (vec!["incidents", "list"], 0),
        (vec!["incidents", "list", "--json"], 0),
        (vec!["status"], 0),
        (vec!["status", "--json"], 0),
        (vec!["tasks"], 0),
        (vec!["tasks", "--json"], 0),
        // Every probe is off in this config: "could not tell".
        (vec!["check"], 2),
        (vec!["check", "--json"], 2),
    ];
    for (args, want) in cases {
        let (code, err) = with_closed_stdout(node.cmd(&args));
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(code, want, "{args:?}: {err}");
    }
    // Commands without --config.
    for args in [
        &["--help"][..],
        &["--version"],
        &["policy", "check", &policy],
        &["policy", "explain", "--xid", "79"],
        &["policy", "explain", "--xid", "79", "--json"],
        &["policy", "simulate", &inputs],
        &["policy", "simulate", &inputs, "--json"],
        &["demo"],
    ] {
        let mut c = Command::new(bin());
        c.args(args);
        let (code, err) = with_closed_stdout(c);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert_eq!(code, 0, "{args:?}: {err}");
    }
}

/// A corrupt state.json used to keep `run` from starting. Now it is set aside, the daemon
/// starts from what the journal says (the node was replaced, a self-fault is open), and an
/// incident records what happened, numbered after the journal's last one.
#[test]
fn a_corrupt_state_file_is_set_aside_and_run_starts_from_the_journal() {
    let mut node = Node::new(
        "[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n[node]\nenabled = false\n",
    );
    std::fs::create_dir_all(node.path("state")).unwrap();
    std::fs::write(
        node.path("state/state.json"),
        "{\"next_incident\": 7, garbage",
    )
    .unwrap();
    let journal = [
        r#"{"at":"2026-01-01T00:00:00.000Z","incident":6,"event":"opened","observation":{"signal":{"kind":"xid","code":79},"gpu":{"index":1}},"rule":"xid-fallen-off-bus","reason":"r","verdict":"replace"}"#,
        r#"{"at":"2026-01-01T00:01:00.000Z","incident":6,"event":"closed","state":"replaced","summary":"s"}"#,
        r#"{"at":"2026-01-01T00:02:00.000Z","incident":7,"event":"opened","observation":{"signal":{"kind":"self-fault","component":"nvml"},"detail":"cannot load"},"rule":"self-fault","reason":"r","verdict":"log"}"#,
    ];
    std::fs::write(
        node.path("state/incidents.jsonl"),
        journal.join("\n") + "\n",
    )
    .unwrap();
    node.start();
    wait_until("the set-aside incident", || {
        node.records()
            .iter()
            .any(|r| is_self_fault(r, "state-file"))
    });
    node.stop();
    let aside: Vec<PathBuf> = std::fs::read_dir(node.path("state"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("state.json.corrupt-")
        })
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(
        std::fs::read_to_string(&aside[0])
            .unwrap()
            .contains("garbage")
    );
    let records = node.records();
    let fault = records
        .iter()
        .find(|r| is_self_fault(r, "state-file"))
        .unwrap();
    assert_eq!(fault["incident"], 8, "numbered after the journal's last");
    let detail = fault["observation"]["detail"].as_str().unwrap();
    assert!(detail.contains("set aside as"), "{detail}");
    let (code, status, err) = node.text(&["status"]);
    assert_eq!(code, 0, "{err}");
    assert!(status.contains("node:        replaced"), "{status}");
    assert!(status.contains("self-fault:  nvml"), "{status}");
}

/// Intervals, deadlines and the watchdog: each mistake is refused with its file:line.
#[test]
fn intervals_deadlines_and_the_watchdog_are_validated() {
    let base = "[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n";
    let node = Node::new(base);
    let cfg = node.path("config.toml").display().to_string();
    // The tick is line 3 of every config Node writes.
    for (tick, why) in [
        ("60s", "more than half of the packaged unit's WatchdogSec"),
        ("1ns", "below the minimum"),
        ("0s", "must be greater than zero"),
    ] {
        std::fs::write(
            node.path("config.toml"),
            format!(
                "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"{tick}\"\n{base}",
                policy().display()
            ),
        )
        .unwrap();
        let (code, _, err) = node.text(&["check"]);
        assert_eq!(code, 78, "{tick}: {err}");
        assert!(err.contains(&format!("{cfg}:3: tick_interval")), "{err}");
        assert!(err.contains(why), "{tick}: {err}");
    }
    // A tick the packaged unit accepts, but longer than half of this service's watchdog.
    std::fs::write(
        node.path("config.toml"),
        format!(
            "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"10s\"\n{base}",
            policy().display()
        ),
    )
    .unwrap();
    let out = node
        .cmd(&["run"])
        .env("WATCHDOG_USEC", "15000000")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("WATCHDOG_USEC = 15s"));
    // Other intervals: with their section's line.
    node.write_config(&format!("{base}[node]\ninterval = \"1ns\"\n"));
    let (code, _, err) = node.text(&["check"]);
    assert_eq!(code, 78);
    assert!(err.contains(&format!("{cfg}:11: [node] interval")), "{err}");
    // A zero-length policy deadline.
    let p = node.path("p.toml");
    std::fs::write(
        &p,
        format!(
            "extends = \"{}\"\n[deadlines]\ndrain = \"0s\"\n",
            policy().display()
        ),
    )
    .unwrap();
    let out = Command::new(bin())
        .args(["policy", "check"])
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("{}:3:", p.display())),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Mistakes that would end in a fault of the node are refused through the binary with their
/// file:line: a fatal XID judged `restart-mps` (the GPU off the bus left in service), a
/// deadline no phase is escalated by, a reboot limit the engine never counts to, and a
/// reboot command that cannot run (the reboot would fail and the node be replaced).
#[test]
fn side_doors_and_unrunnable_remedies_are_refused_with_their_line() {
    for (body, line, why) in [
        (
            "[[rule]]\nname = \"xid-fallen-off-bus\"\nsignal = \"xid\"\nxids = [79]\naction = \"restart-mps\"\nreason = \"r\"\n",
            6,
            "action `restart-mps` silences `xid 79`",
        ),
        ("[deadlines]\ndrain = \"100years\"\n", 3, "too long"),
        ("[reboot]\nlimit = 4294967295\n", 3, "never reached"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("p.toml");
        std::fs::write(&p, format!("extends = \"{}\"\n{body}", policy().display())).unwrap();
        let out = Command::new(bin())
            .args(["policy", "check"])
            .arg(&p)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{body}: {err}");
        assert!(err.contains(&format!("{}:{line}:", p.display())), "{err}");
        assert!(err.contains(why), "{err}");
    }
    let node = Node::new(
        "[nvml]\nenabled = false\n[mps]\nenabled = false\n[repair]\nreboot = \"systemd\"\ncommand = [\"/sbin/rebot\"]\n",
    );
    let out = node.cmd(&["run"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{err}");
    assert!(
        err.contains(&format!(
            "{}:10: [repair] command",
            node.path("config.toml").display()
        )),
        "{err}"
    );
    assert!(err.contains("does not exist"), "{err}");
    assert!(
        node.records().is_empty(),
        "nothing journaled, nothing acted on"
    );
}

/// The packaged unit's watchdog is the one the config's ceiling is derived from.
#[test]
fn the_packaged_watchdog_matches_the_tick_ceiling() {
    let unit = std::fs::read_to_string(repo().join("packaging/gpu-medic.service")).unwrap();
    let line = unit
        .lines()
        .find(|l| l.starts_with("WatchdogSec="))
        .expect("WatchdogSec");
    let secs: u64 = line
        .trim_start_matches("WatchdogSec=")
        .trim_end_matches('s')
        .parse()
        .unwrap();
    assert_eq!(
        Duration::from_secs(secs),
        gpu_medic::config::PACKAGED_WATCHDOG
    );
    assert!(gpu_medic::config::MAX_TICK * 2 <= gpu_medic::config::PACKAGED_WATCHDOG);
    assert!(unit.contains("ExecReload=/bin/kill -HUP $MAINPID"));
}

/// SIGHUP: a bad config is refused with its file:line and the daemon keeps running; a good
/// one is applied by restarting the supervisor in place; SIGTERM still stops it cleanly.
#[test]
fn sighup_reloads_a_valid_config_and_refuses_a_bad_one() {
    let base = "[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n[node]\nenabled = false\n";
    let mut node = Node::new(base);
    // The signal handlers are installed before the supervisor saves its first state (what
    // `start` waits for): a SIGHUP from now on is a reload.
    node.start();
    node.write_config(&format!("{base}bogus = 1\n"));
    node.signal(libc::SIGHUP);
    wait_until("the refusal", || node.log().contains("reload refused"));
    assert!(
        node.log().contains("config.toml:12: unknown field `bogus`"),
        "{}",
        node.log()
    );
    assert!(
        node.daemon.as_mut().unwrap().try_wait().unwrap().is_none(),
        "still running"
    );
    node.write_config(&format!("dry_run = true\n{base}"));
    node.signal(libc::SIGHUP);
    wait_until("the second start", || {
        node.log().matches("gpu-medic supervisor started").count() == 2
    });
    assert!(
        node.log().contains("supervisor restarted"),
        "{}",
        node.log()
    );
    assert!(
        node.log().contains("\"observe_only\":true"),
        "the new config applies: {}",
        node.log()
    );
    node.stop();
}

/// Issue 26, signals: a SIGHUP whose config, policy or kernel log has become a FIFO, a
/// symlink to /dev/zero or a directory is refused at once (never a hang); the daemon keeps
/// its configuration, and SIGTERM still stops it promptly afterwards.
#[test]
fn sighup_onto_a_fifo_or_an_endless_file_is_refused_and_sigterm_still_stops() {
    let kmsg_line = |node: &Node| format!("kmsg = \"{}\"\n", node.path("kmsg").display());
    for (what, target) in [
        ("config", "config.toml"),
        ("policy", "policy.toml"),
        ("kmsg", "kmsg"),
    ] {
        for kind in ["fifo", "dev-zero", "directory"] {
            let mut node = Node::new("");
            std::fs::write(node.path("kmsg"), "").unwrap();
            std::fs::copy(policy(), node.path("policy.toml")).unwrap();
            let body = format!(
                "[nvml]\nlibrary = \"{}\"\npoll_interval = \"200ms\"\n{}\
                 [mps]\nenabled = false\n[aws]\nenabled = false\n[node]\nenabled = false\n",
                fake_nvml().display(),
                kmsg_line(&node)
            );
            let config = format!(
                "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n{body}",
                node.path("policy.toml").display()
            );
            std::fs::write(node.path("config.toml"), &config).unwrap();
            node.start();
            let path = node.path(target);
            std::fs::remove_file(&path).unwrap();
            match kind {
                "fifo" => {
                    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
                    // SAFETY: a NUL-terminated path this test owns.
                    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
                }
                "dev-zero" => std::os::unix::fs::symlink("/dev/zero", &path).unwrap(),
                _ => std::fs::create_dir(&path).unwrap(),
            }
            node.signal(libc::SIGHUP);
            let refused = gpu_medic_testkit::wait_until(Duration::from_secs(10), || {
                node.log().contains("reload refused")
            });
            assert!(refused, "{what} as {kind}: no refusal\n{}", node.log());
            assert!(
                node.log().contains(&path.display().to_string()),
                "{what} as {kind}: the refusal names the file\n{}",
                node.log()
            );
            // Another SIGHUP while the file is still bad (refused again, at once), then
            // SIGTERM: a prompt, clean stop.
            node.signal(libc::SIGHUP);
            wait_until("the second refusal", || {
                node.log().matches("reload refused").count() >= 2
            });
            let started = std::time::Instant::now();
            let mut child = node.daemon.take().unwrap();
            let status = gpu_medic_testkit::stop_child(&mut child, Duration::from_secs(10));
            assert!(
                status.is_some_and(|s| s.success()),
                "{what} as {kind}: SIGTERM after the refused reload: {status:?}\n{}",
                node.log()
            );
            assert!(started.elapsed() < Duration::from_secs(10));
            assert_eq!(
                node.log().matches("gpu-medic supervisor started").count(),
                1,
                "{what} as {kind}: the supervisor was not restarted\n{}",
                node.log()
            );
        }
    }
}

/// `policy simulate` on an input far in the future, with extreme values, does not panic.
#[test]
fn policy_simulate_on_a_far_future_tick_does_not_panic() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("inputs.jsonl");
    std::fs::write(
        &p,
        "{\"at\":\"2024-01-01T00:00:00Z\",\"input\":\"observation\",\"signal\":{\"kind\":\"xid\",\"code\":79},\"value\":18446744073709551615}\n\
         {\"at\":\"9999-12-31T23:59:59.999Z\",\"input\":\"tick\"}\n",
    )
    .unwrap();
    for json in [false, true] {
        let mut c = Command::new(bin());
        c.args(["policy", "simulate"]).arg(&p);
        if json {
            c.arg("--json");
        }
        let out = c.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(out.status.code(), Some(0), "{err}");
    }
}

/// This round's keys: a slot table name DynamoDB would refuse, a reservation share of nothing,
/// a zero GPU view interval and a zero reservation lifetime are mistakes, refused at start with
/// file:line (exit 78), never a fault of the fleet or of a GPU.
#[test]
fn new_fleet_task_and_gpu_view_keys_are_validated_at_start() {
    let base = "[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n";
    let node = Node::new(base);
    let cfg = node.path("config.toml").display().to_string();
    for (extra, key) in [
        ("[fleet]\ntable = \"no spaces allowed!\"\n", "table"),
        (
            "[fleet]\nreservation_lifetime = \"0s\"\n",
            "reservation_lifetime",
        ),
        ("[ecs]\ngpu_view_interval = \"0s\"\n", "gpu_view_interval"),
    ] {
        node.write_config(&format!("{base}{extra}"));
        let (code, _, err) = node.text(&["check"]);
        assert_eq!(code, 78, "{extra}: {err}");
        assert!(err.contains(&format!("{cfg}:")), "{extra}: {err}");
        assert!(err.contains(key), "{extra}: {err}");
    }
    let base_nvml = "[nvml]\nenabled = false\nreservation_alert = \"0%\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n";
    node.write_config(base_nvml);
    let (code, _, err) = node.text(&["check"]);
    assert_eq!(code, 78, "{err}");
    // Line 6: after the three lines Node writes first, `[nvml]` and `enabled`.
    assert!(err.contains(&format!("{cfg}:6: bad share \"0%\"")), "{err}");
}

/// Issue 26, item 0: kernel-log XIDs that arrive in one write are each journaled once (five
/// XID 13s and an XID 79, the 79 stepped first: the 13s were dropped as "duplicates after
/// restart"), and a restart journals none of them again. A record whose sequence number is
/// u64::MAX hides no later XID (in a file, a line's position is its offset).
#[test]
fn kernel_log_xids_written_together_are_each_journaled_once() {
    use std::io::Write;
    let mut node = Node::new("");
    let kmsg = node.path("kmsg");
    std::fs::write(&kmsg, "").unwrap();
    node.write_config(&format!(
        "[nvml]\nlibrary = \"{}\"\npoll_interval = \"200ms\"\nkmsg = \"{}\"\n\
         [mps]\nenabled = false\n[aws]\nenabled = false\n[node]\nenabled = false\n",
        fake_nvml().display(),
        kmsg.display()
    ));
    node.start();
    let mut body = String::new();
    body.push_str(
        "4,18446744073709551615,1,-;NVRM: Xid (PCI:0000:1b:00): 31, pid=9, name=x, poison\n",
    );
    for i in 0..5 {
        body.push_str(&format!(
            "4,{},2,-;NVRM: Xid (PCI:0000:1b:00): 13, pid={}, name=p{i}, Graphics Exception\n",
            100 + i,
            1000 + i
        ));
    }
    body.push_str(
        "4,105,3,-;NVRM: Xid (PCI:0000:29:00): 79, pid=1, name=y, GPU has fallen off the bus.\n",
    );
    std::fs::OpenOptions::new()
        .append(true)
        .open(&kmsg)
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let kmsg_inputs = |node: &Node| -> Vec<u64> {
        std::fs::read_to_string(node.path("state/inputs.jsonl"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["source"] == "kmsg")
            .map(|v| v["signal"]["code"].as_u64().unwrap_or(0))
            .collect()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while kmsg_inputs(&node).len() < 7 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut codes = kmsg_inputs(&node);
    codes.sort();
    assert_eq!(codes, [13, 13, 13, 13, 13, 31, 79], "{}", node.log());
    node.stop();
    // A restart reads the file again and journals none of it twice; a later XID 79 after
    // the u64::MAX record is still journaled.
    node.start();
    std::fs::OpenOptions::new()
        .append(true)
        .open(&kmsg)
        .unwrap()
        .write_all(b"4,106,4,-;NVRM: Xid (PCI:0000:1b:00): 79, pid=2, name=z, GPU has fallen off the bus.\n")
        .unwrap();
    wait_until("the XID 79 after the restart", || {
        kmsg_inputs(&node).len() >= 8
    });
    // The whole file applied (it ends with that 79): every record before it was journaled
    // or dropped by now, so a second journaling would show.
    wait_sync(
        "the whole kernel log applied",
        gpu_medic_testkit::LOOKS_LIMIT,
        || {
            let state = std::fs::read_to_string(node.path("state/state.json"))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or(Value::Null);
            gpu_medic_testkit::journal::kmsg_applied(&state, &kmsg)
        },
        || node.log(),
    );
    node.stop();
    let mut codes = kmsg_inputs(&node);
    codes.sort();
    assert_eq!(codes, [13, 13, 13, 13, 13, 31, 79, 79], "{}", node.log());
}

/// Issue 26, item 3: a state file of any bad kind (a FIFO, a directory, a symlink loop,
/// invalid UTF-8, a counter at u64::MAX) and a leftover temp directory are set aside; the
/// daemon starts from the journal every time. `check` with the kernel log at /dev/zero or
/// /dev/urandom is refused at once instead of reading for ever.
#[test]
fn a_state_file_of_any_bad_kind_is_set_aside_and_endless_devices_are_refused() {
    for bad in ["fifo", "dir", "loop", "utf8", "max", "tmpdir"] {
        let mut node = Node::new(
            "[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n[node]\nenabled = false\n",
        );
        let state = node.path("state/state.json");
        std::fs::create_dir_all(node.path("state")).unwrap();
        match bad {
            "fifo" => {
                let c = std::ffi::CString::new(state.to_str().unwrap()).unwrap();
                // SAFETY: a valid NUL-terminated path.
                assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
            }
            "dir" => std::fs::create_dir(&state).unwrap(),
            "loop" => std::os::unix::fs::symlink(&state, &state).unwrap(),
            "utf8" => std::fs::write(&state, b"{\"next_incident\": \xff\xfe}").unwrap(),
            "max" => std::fs::write(
                &state,
                format!(
                    "{{\"next_incident\":1,\"next_action\":1,\"delivery\":{{\"applied\":{}}}}}",
                    u64::MAX
                ),
            )
            .unwrap(),
            _ => std::fs::create_dir_all(node.path("state/.state.json.tmp/x")).unwrap(),
        }
        let child = node
            .cmd(&["run", "--log-format", "json"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(node.path("daemon.log")).unwrap())
            .spawn()
            .unwrap();
        node.daemon = Some(child);
        wait_until(&format!("{bad}: a readable state.json"), || {
            std::fs::metadata(&state).is_ok_and(|m| m.is_file())
                && std::fs::read_to_string(&state).is_ok_and(|t| t.contains("next_incident"))
        });
        if bad != "tmpdir" {
            wait_until(&format!("{bad}: the set-aside incident"), || {
                node.records()
                    .iter()
                    .any(|r| is_self_fault(r, "state-file"))
            });
        }
        node.stop();
    }

    let node = Node::new("");
    for dev in ["/dev/zero", "/dev/urandom"] {
        node.write_config(&format!(
            "[nvml]\nlibrary = \"{}\"\nkmsg = \"{dev}\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
            fake_nvml().display()
        ));
        let started = std::time::Instant::now();
        let (_, out, err) = node.text(&["check"]);
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{dev}: {out}{err}"
        );
        let (code, _, err) = node.text(&["run"]);
        assert_eq!(code, 78, "{dev}: {err}");
        assert!(
            err.contains("not a regular file or the kernel log device"),
            "{err}"
        );
    }
}

/// Issue 26, item 4: no setting silences a fatal signal through the side door. A confirm
/// count or an escalation no window can reach, or a threshold that leaves XID 79, `gpu-lost`
/// or a GPU-count mismatch unjudged, on a rule that must act: `policy check` exits 78 naming
/// the key's file:line, and the same rule with `silences_fatal = true` passes. Zero or absurd
/// retry delays, attempts, MPS windows and budgets, and windows longer than the engine keeps,
/// are refused the same way (no opt-in: they silence nothing on purpose).
#[test]
fn settings_that_silence_a_fatal_signal_are_refused_unless_the_rule_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let check = |name: &str, body: &str| {
        let p = dir.path().join(format!("{name}.toml"));
        std::fs::write(
            &p,
            format!("version = 1\nextends = \"{}\"\n{body}", policy().display()),
        )
        .unwrap();
        let out = Command::new(bin())
            .args(["policy", "check"])
            .arg(&p)
            .output()
            .unwrap();
        (
            p,
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    // (case, the rule's lines from line 3, the offending line, what the message says)
    let silencing = [
        (
            "confirm-count",
            "[[rule]]\nname = \"xid-fallen-off-bus\"\nsignal = \"xid\"\nxids = [79]\naction = \"replace\"\nconfirm = { count = 1000, window = \"1h\" }\nreason = \"x\"\n",
            8,
            "the engine keeps the last 64",
        ),
        (
            "confirm-window",
            "[[rule]]\nname = \"gpu-lost\"\nsignal = \"gpu-lost\"\naction = \"replace\"\nconfirm = { count = 10, window = \"2s\" }\nreason = \"x\"\n",
            7,
            "cannot happen",
        ),
        (
            "escalate",
            "[[rule]]\nname = \"xid-13-graphics-exception\"\nsignal = \"xid\"\nxids = [13]\naction = \"log\"\nescalate = { count = 500, window = \"1h\", action = \"drain\" }\nreason = \"x\"\n",
            8,
            "never escalate to `drain`",
        ),
        (
            "gpu-lost-threshold",
            "[[rule]]\nname = \"gpu-lost\"\nsignal = \"gpu-lost\"\nthreshold = 5\naction = \"replace\"\nreason = \"x\"\n",
            6,
            "`gpu-lost` below 5 is judged by no rule",
        ),
        (
            "count-mismatch-threshold",
            "[[rule]]\nname = \"device-count-mismatch\"\nsignal = \"device-count-mismatch\"\nthreshold = 1000\naction = \"replace\"\nreason = \"x\"\n",
            6,
            "judged by no rule",
        ),
        (
            "thermal-threshold",
            "[[rule]]\nname = \"thermal-critical\"\nsignal = \"thermal\"\nthreshold = 5000\naction = \"drain\"\nreason = \"x\"\n",
            6,
            "above any reading",
        ),
    ];
    for (name, body, line, says) in silencing {
        let (p, code, err) = check(name, body);
        assert_eq!(code, Some(78), "{name}: {err}");
        assert!(
            err.contains(&format!("{}:{line}:", p.display())),
            "{name}: {err}"
        );
        assert!(
            err.contains(says) && err.contains("silences_fatal"),
            "{name}: {err}"
        );
        let opted = body.replacen(
            "reason = \"x\"\n",
            "reason = \"x\"\nsilences_fatal = true\n",
            1,
        );
        let (_, code, err) = check(&format!("{name}-opted"), &opted);
        assert_eq!(code, Some(0), "{name} with silences_fatal: {err}");
    }
    let absurd = [
        (
            "retry-delay",
            "[retry]\ndelay = \"0s\"\n",
            4,
            "a retry delay of 0s",
        ),
        (
            "retry-delay-long",
            "[retry]\ndelay = \"30d\"\n",
            4,
            "out of range",
        ),
        (
            "retry-attempts",
            "[retry]\nmax_attempts = 1000000\n",
            4,
            "max_attempts",
        ),
        (
            "retry-attempts-zero",
            "[retry]\nmax_attempts = 0\n",
            4,
            "at least 1",
        ),
        (
            "mps-window",
            "[mps]\nrestart_window = \"0s\"\n",
            4,
            "a restart window of 0s",
        ),
        (
            "mps-window-long",
            "[mps]\nrestart_window = \"365d\"\n",
            4,
            "out of range",
        ),
        (
            "mps-budget",
            "[mps]\nrestart_budget = 4000000\n",
            4,
            "restart_budget",
        ),
        (
            "confirm-too-long",
            "[[rule]]\nname = \"thermal\"\nsignal = \"thermal\"\nthreshold = 85\naction = \"log\"\nconfirm = { count = 3, window = \"30d\" }\nreason = \"x\"\nsilences_fatal = true\n",
            8,
            "longer than the engine keeps",
        ),
    ];
    for (name, body, line, says) in absurd {
        let (p, code, err) = check(name, body);
        assert_eq!(code, Some(78), "{name}: {err}");
        assert!(
            err.contains(&format!("{}:{line}:", p.display())),
            "{name}: {err}"
        );
        assert!(err.contains(says), "{name}: {err}");
    }
    // The packaged policies stand as they are.
    for p in ["policies/default.toml", "policies/observe-only.toml"] {
        let out = Command::new(bin())
            .args(["policy", "check"])
            .arg(repo().join(p))
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{p}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Issue 26, item 2: numbers that cannot advance never hang, wrap or panic. `[journal]
/// keep_files = 4294967295` is refused at the config check (file:line, exit 78) by `check`
/// and `run` at once. An `inputs.jsonl` record with sequence number u64::MAX is skipped with
/// a warning and the next input follows the last good one; one at the largest number
/// gpu-medic accepts (2^62) cannot be followed: `run` stops with an error naming
/// inputs.jsonl, never a panic.
#[test]
fn journal_numbers_that_cannot_advance_are_refused_not_wrapped() {
    let off = "[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n[node]\nenabled = false\n";
    let node = Node::new(&format!("{off}[journal]\nkeep_files = 4294967295\n"));
    let cfg = node.path("config.toml");
    let line = std::fs::read_to_string(&cfg)
        .unwrap()
        .lines()
        .position(|l| l.starts_with("keep_files"))
        .unwrap()
        + 1;
    for args in [&["check"][..], &["run"]] {
        let started = std::time::Instant::now();
        let out = node.cmd(args).timeout_output(Duration::from_secs(20));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{args:?}: {err}");
        assert!(
            err.contains(&format!("{}:{line}:", cfg.display())),
            "{args:?}: {err}"
        );
        assert!(err.contains("keep_files"), "{err}");
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{args:?} took long"
        );
    }

    let mut node = Node::new(off);
    node.start();
    let inputs = node.path("state/inputs.jsonl");
    wait_until("an input journaled", || {
        std::fs::read_to_string(&inputs).is_ok_and(|t| !t.trim().is_empty())
    });
    node.stop();
    let text = std::fs::read_to_string(&inputs).unwrap();
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let good = last["seq"].as_u64().unwrap();
    let with_seq = |seq: u64| {
        let mut v = last.clone();
        v["seq"] = Value::from(seq);
        format!("{text}{v}\n")
    };
    // u64::MAX: not a number this journal wrote; skipped. A launch gate's report is the
    // next input.
    std::fs::write(&inputs, with_seq(u64::MAX)).unwrap();
    let requests = node.path("state/requests");
    let gate = || {
        std::fs::create_dir_all(&requests).unwrap();
        std::fs::write(
            requests.join("1-1.json"),
            r#"{"request":"launch-gate","health":"healthy","summary":"test"}"#,
        )
        .unwrap();
    };
    gate();
    node.start();
    wait_until("a new input after the bad one", || {
        std::fs::read_to_string(&inputs)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .any(|v| v["seq"].as_u64() == Some(good + 1))
    });
    node.stop();
    assert!(!node.log().contains("panicked"), "{}", node.log());
    // 2^62: accepted, but nothing can follow it.
    let text = std::fs::read_to_string(&inputs).unwrap();
    let last: Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
    let mut v = last.clone();
    v["seq"] = Value::from(1u64 << 62);
    std::fs::write(&inputs, format!("{text}{v}\n")).unwrap();
    gate();
    let out = node.cmd(&["run"]).timeout_output(Duration::from_secs(20));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && out.status.code() != Some(101),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.contains("inputs.jsonl") && err.contains("cannot advance"),
        "{err}"
    );
}

/// `Command::output` with a deadline: a command that hangs fails the test instead.
trait TimeoutOutput {
    fn timeout_output(&mut self, limit: Duration) -> std::process::Output;
}

impl TimeoutOutput for Command {
    fn timeout_output(&mut self, limit: Duration) -> std::process::Output {
        let mut child = self
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if started.elapsed() > limit {
                let _ = child.kill();
                let out = child.wait_with_output().unwrap();
                panic!(
                    "still running after {limit:?}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        child.wait_with_output().unwrap()
    }
}

/// Issue 26, item 6 (the CLI reads with the daemon's bounds): `status`, `incidents list`,
/// `incidents show`, `tasks` and `policy simulate` with the file each reads from the state
/// directory replaced by a FIFO (no writer: a blocking open waits for ever) or by a symlink
/// to /dev/zero (a read that never ends) finish at once with an error naming what the file
/// is, never a hang, a balloon or a panic. Each command runs under a 20 s watchdog.
#[test]
fn cli_commands_refuse_a_fifo_or_dev_zero_in_the_state_directory() {
    let cases: [(&str, &[&str]); 6] = [
        ("state.json", &["status"]),
        ("incidents.jsonl", &["incidents", "list"]),
        ("incidents.jsonl", &["incidents", "show", "1"]),
        ("incidents.jsonl.1", &["incidents", "list", "--open"]),
        ("gpu-memory.jsonl", &["tasks"]),
        (
            "inputs.jsonl",
            &["policy", "simulate", "STATE/inputs.jsonl"],
        ),
    ];
    for (file, args) in cases {
        for kind in ["fifo", "zero"] {
            let node = Node::new(
                "[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
            );
            std::fs::create_dir_all(node.path("state")).unwrap();
            if file == "incidents.jsonl.1" {
                std::fs::write(node.path("state/incidents.jsonl"), "").unwrap();
            }
            let at = node.path(&format!("state/{file}"));
            match kind {
                "fifo" => {
                    let c = std::ffi::CString::new(at.to_str().unwrap()).unwrap();
                    // SAFETY: a valid NUL-terminated path.
                    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
                }
                _ => std::os::unix::fs::symlink("/dev/zero", &at).unwrap(),
            }
            let state = node.path("state");
            let args: Vec<String> = args
                .iter()
                .map(|a| a.replace("STATE", state.to_str().unwrap()))
                .collect();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let mut child = node
                .cmd(&args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let started = std::time::Instant::now();
            let status = loop {
                if let Some(s) = child.try_wait().unwrap() {
                    break s;
                }
                if started.elapsed() > Duration::from_secs(20) {
                    let _ = child.kill();
                    let _ = child.wait();
                    panic!("{args:?} with {file} as {kind}: still running after 20 s");
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let out = child.wait_with_output().unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!err.contains("panicked"), "{args:?}: {err}");
            if args[0] == "policy" && kind == "fifo" {
                // `policy simulate` takes a pipe by design: one without a writer has ended.
                assert!(status.success(), "{err}");
                assert!(out.stdout.is_empty());
                continue;
            }
            assert!(!status.success(), "{args:?} with {file} as {kind}: {err}");
            let says = match kind {
                "fifo" => "is a FIFO",
                _ => "character device 1:5",
            };
            assert!(err.contains(says), "{args:?} with {file} as {kind}: {err}");
        }
    }
}
