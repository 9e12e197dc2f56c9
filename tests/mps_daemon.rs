//! MPS supervision against NVIDIA's real control daemon (`nvidia-cuda-mps-control` from
//! Debian's `nvidia-cuda-mps`, which runs without a GPU). Every test starts its own daemon
//! in its own short pipe directory (`/tmp/gm-mps-XXXXXX/p`; a unix socket path must stay
//! under 107 bytes) and log directory, and a guard stops everything it started, even when
//! the test fails. Facts relied on: tests/support/MPS-FACTS.md.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpu_medic::config::{MpsConfig, MpsManage};
use gpu_medic::model::Signal;
use gpu_medic::mps::PROBE_COMMAND;
use gpu_medic::mps::control::ControlClient;
use gpu_medic::mps::procs::Scanner;
use gpu_medic::probe::mps::MpsProbe;
use gpu_medic::remedy::RemedyError;
use gpu_medic::remedy::mps::MpsDaemon;
use gpu_medic_testkit::mps::{AgentProber, MPS_BIN as BIN, MpsDir, mps_pids, worst_run};
use gpu_medic_testkit::proc::{alive, state_letter};
use gpu_medic_testkit::{Daemon, default_policy, signal, wait_sync};

/// A pipe and log directory of our own in a temp dir, and whatever runs in them (stopped:
/// continued, asked to quit, then killed, when the test ends, even when it failed).
struct Mps {
    root: tempfile::TempDir,
    dir: MpsDir,
}

impl std::ops::Deref for Mps {
    type Target = MpsDir;
    fn deref(&self) -> &MpsDir {
        &self.dir
    }
}

impl Mps {
    fn new() -> Self {
        assert!(
            Path::new(BIN).exists(),
            "{BIN} missing: install Debian's non-free nvidia-cuda-mps (see .ci)"
        );
        let root = tempfile::Builder::new()
            .prefix("gm-mps-")
            .tempdir_in("/tmp")
            .expect("temp dir");
        let dir = MpsDir::new(root.path().to_path_buf());
        Mps { root, dir }
    }

    fn cfg(&self) -> MpsConfig {
        MpsConfig {
            control_binary: PathBuf::from(BIN),
            pipe_directory: self.pipe.clone(),
            log_directory: self.log.clone(),
            probe_interval: Duration::from_millis(500),
            probe_timeout: Duration::from_millis(300),
            manage: MpsManage::Direct,
            quit_timeout: Duration::from_secs(1),
            start_timeout: Duration::from_secs(5),
            ..MpsConfig::default()
        }
    }

    /// Starts a daemon the way an operator would; returns its pid.
    fn start(&self) -> u32 {
        self.dir.start().expect("run nvidia-cuda-mps-control -d");
        let pids = self.daemons();
        assert_eq!(pids.len(), 1, "one daemon expected: {pids:?}");
        pids[0]
    }

    /// The daemons, as gpu-medic's own scanner finds them.
    fn daemons(&self) -> Vec<u32> {
        Scanner::new(Path::new(BIN), &self.pipe)
            .scan_blocking()
            .expect("scan")
            .daemon_pids()
    }

    /// One control session, as an operator would type it.
    fn ask(&self, cmd: &str) -> String {
        self.dir
            .ask(cmd, Duration::from_secs(3))
            .unwrap_or_else(|| panic!("`{cmd}` got no answer in 3 s"))
    }

    /// Every live process whose environment names our pipe directory (daemon, servers,
    /// control clients, wrapper scripts and their children).
    fn processes(&self) -> Vec<u32> {
        mps_pids(&self.pipe)
    }

    fn script(&self, name: &str, body: &str) -> PathBuf {
        let p = self.root.path().join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        // A fork elsewhere in this test process may briefly hold the write descriptor
        // (ETXTBSY); let those children reach exec.
        std::thread::sleep(Duration::from_millis(50));
        p
    }
}

impl Drop for Mps {
    fn drop(&mut self) {
        self.dir.shutdown();
    }
}

fn wait_dead(pid: u32) {
    let what = format!("pid {pid} to die");
    wait_sync(&what, Duration::from_secs(3), || !alive(pid), String::new);
}

/// SIGSTOP takes effect when the process next runs; wait for it.
fn wait_stopped(pid: u32) {
    let what = format!("pid {pid} to stop");
    let stopped = || state_letter(pid) == Some('T');
    wait_sync(&what, Duration::from_secs(3), stopped, String::new);
}

async fn probe_once(cfg: MpsConfig) -> gpu_medic::model::Observation {
    MpsProbe::new(cfg).probe().await.expect("a verdict")
}

#[tokio::test]
async fn healthy_daemon_is_up_with_its_latency() {
    let mps = Mps::new();
    mps.start();
    let obs = probe_once(mps.cfg()).await;
    assert_eq!(obs.signal, Signal::MpsUp, "{obs:?}");
    assert!(obs.value < 300, "latency {} ms", obs.value);
    let detail = obs.detail.unwrap_or_default();
    assert!(detail.contains("answered 100.0"), "{detail}");
    assert!(detail.contains("servers: []"), "{detail}");
    assert_eq!(obs.source, "mps");
}

#[tokio::test]
async fn stopped_daemon_times_out_as_unresponsive_and_no_client_is_left() {
    let mps = Mps::new();
    let pid = mps.start();
    signal(pid, libc::SIGSTOP);
    wait_stopped(pid);
    let cfg = mps.cfg();
    let mut probe = MpsProbe::new(cfg.clone());
    for n in 1..=2u64 {
        let t0 = Instant::now();
        let obs = probe.probe().await.expect("a verdict");
        let took = t0.elapsed();
        assert_eq!(obs.signal, Signal::MpsUnresponsive, "{obs:?}");
        assert_eq!(obs.value, n, "consecutive failures");
        assert!(
            took >= cfg.probe_timeout && took < cfg.probe_timeout + Duration::from_millis(700),
            "probe took {took:?}"
        );
        let detail = obs.detail.unwrap_or_default();
        assert!(detail.contains("no reply within"), "{detail}");
        assert!(
            detail.contains(&format!("pid {pid} (state T, stopped)")),
            "{detail}"
        );
        assert_eq!(
            mps.processes(),
            vec![pid],
            "the timed-out client was killed and reaped"
        );
    }
    signal(pid, libc::SIGCONT);
    let obs = probe.probe().await.expect("a verdict");
    assert_eq!(obs.signal, Signal::MpsUp, "{obs:?}");
    assert_eq!(probe.failures(), 0);
}

#[tokio::test]
async fn killed_daemon_is_down_and_leaves_a_stale_pipe_directory() {
    let mps = Mps::new();
    let pid = mps.start();
    signal(pid, libc::SIGKILL);
    wait_dead(pid); // a zombie until PID 1 reaps it: dead to us
    assert!(
        mps.pipe.join("control").exists(),
        "stale socket after SIGKILL"
    );
    let mut probe = MpsProbe::new(mps.cfg());
    let obs = probe.probe().await.expect("a verdict");
    assert_eq!(obs.signal, Signal::MpsDown, "{obs:?}");
    assert_eq!(obs.value, 1);
    let detail = obs.detail.unwrap_or_default();
    assert!(
        detail.contains("Cannot find MPS control daemon process"),
        "{detail}"
    );
    assert!(detail.contains("stale control socket"), "{detail}");
    assert_eq!(probe.probe().await.map(|o| o.value), Some(2));
}

#[tokio::test]
async fn restart_replaces_a_killed_daemon_cleans_the_stale_dir_and_reapplies_defaults() {
    let mps = Mps::new();
    let old = mps.start();
    signal(old, libc::SIGKILL);
    wait_dead(old);
    let cfg = MpsConfig {
        default_active_thread_percentage: Some(25),
        default_pinned_device_mem_limit: Some("0=2G,1=512M".into()),
        ..mps.cfg()
    };
    let done = MpsDaemon::new(cfg.clone())
        .restart_now()
        .await
        .expect("restart");
    assert!(
        done.detail.contains("no daemon was running"),
        "{}",
        done.detail
    );
    assert!(
        done.detail
            .contains("stale control, control_privileged, control_lock, log removed"),
        "{}",
        done.detail
    );
    assert!(
        done.detail
            .contains("active thread percentage 25, pinned memory 0=2G, pinned memory 1=512M"),
        "{}",
        done.detail
    );
    let now = mps.daemons();
    assert_eq!(now.len(), 1);
    assert_ne!(now[0], old);
    assert_eq!(mps.ask(PROBE_COMMAND), "25.0");
    assert_eq!(mps.ask("get_default_device_pinned_mem_limit 0"), "2G");
    assert_eq!(mps.ask("get_default_device_pinned_mem_limit 1"), "512M");
    assert_eq!(probe_once(cfg).await.signal, Signal::MpsUp);
}

#[tokio::test]
async fn restart_kills_a_hung_daemon_and_leaves_no_hung_process() {
    let mps = Mps::new();
    let old = mps.start();
    signal(old, libc::SIGSTOP);
    wait_stopped(old);
    let t0 = Instant::now();
    let done = MpsDaemon::new(mps.cfg())
        .restart_now()
        .await
        .expect("restart");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    assert!(done.detail.contains("quit skipped"), "{}", done.detail);
    assert!(
        done.detail.contains(&format!("pid {old} ended by SIGTERM")),
        "{}",
        done.detail
    );
    assert!(!alive(old), "the hung daemon is gone");
    let now = mps.daemons();
    assert_eq!(now.len(), 1);
    assert_ne!(now[0], old);
    assert_eq!(
        mps.processes(),
        now,
        "nothing else runs for the pipe directory"
    );
    assert_eq!(mps.ask(PROBE_COMMAND), "100.0");
}

#[tokio::test]
async fn restart_of_a_healthy_daemon_quits_it_gracefully() {
    let mps = Mps::new();
    let old = mps.start();
    let done = MpsDaemon::new(mps.cfg())
        .restart_now()
        .await
        .expect("restart");
    assert!(done.detail.contains("quit"), "{}", done.detail);
    assert!(!done.detail.contains("SIGTERM"), "{}", done.detail);
    assert!(!alive(old));
    assert_eq!(mps.daemons().len(), 1);
}

#[tokio::test]
async fn restart_creates_a_missing_pipe_dir_and_removes_junk_left_in_it() {
    let mps = Mps::new();
    // Never started: the pipe directory does not exist (the daemon would not create it).
    assert!(!mps.pipe.exists());
    MpsDaemon::new(mps.cfg())
        .restart_now()
        .await
        .expect("restart from nothing");
    assert_eq!(mps.ask(PROBE_COMMAND), "100.0");
    // Stale entries that are not even sockets, with no daemon holding the lock.
    for pid in mps.daemons() {
        signal(pid, libc::SIGKILL);
        wait_dead(pid);
    }
    for name in ["control", "control_privileged", "log"] {
        let _ = std::fs::remove_file(mps.pipe.join(name));
        std::fs::write(mps.pipe.join(name), b"junk").unwrap();
    }
    let done = MpsDaemon::new(mps.cfg())
        .restart_now()
        .await
        .expect("restart over junk");
    assert!(done.detail.contains("removed"), "{}", done.detail);
    assert_eq!(mps.ask(PROBE_COMMAND), "100.0");
}

#[tokio::test]
async fn daemon_that_cannot_start_fails_with_a_clear_fatal_error() {
    let mps = Mps::new();
    // A binary that does not exist.
    let cfg = MpsConfig {
        control_binary: PathBuf::from("/nonexistent/nvidia-cuda-mps-control"),
        ..mps.cfg()
    };
    let e = MpsDaemon::new(cfg).restart_now().await.unwrap_err();
    assert!(matches!(e, RemedyError::Fatal { .. }), "{e:?}");
    assert!(e.to_string().contains("cannot run"), "{e}");
    assert!(e.to_string().contains("1 attempt(s)"), "{e}");
    // A pipe directory that cannot be created (its parent is a file).
    std::fs::write(mps.root.path().join("f"), b"").unwrap();
    let cfg = MpsConfig {
        pipe_directory: mps.root.path().join("f/p"),
        ..mps.cfg()
    };
    let e = MpsDaemon::new(cfg).restart_now().await.unwrap_err();
    assert!(matches!(e, RemedyError::Fatal { .. }), "{e:?}");
    assert!(e.to_string().contains("cannot create"), "{e}");
    // A daemon that starts but never answers (a wrapper that only sleeps) is retried once,
    // then reported as retryable: the engine's budget decides.
    let sleeper = mps.script("sleeper", "sleep 0.2; exit 0");
    let cfg = MpsConfig {
        control_binary: sleeper,
        start_timeout: Duration::from_millis(400),
        ..mps.cfg()
    };
    let t0 = Instant::now();
    let e = MpsDaemon::new(cfg)
        .with_attempts(2, Duration::from_millis(50))
        .restart_now()
        .await
        .unwrap_err();
    assert!(matches!(e, RemedyError::Retryable { .. }), "{e:?}");
    assert!(e.to_string().contains("2 attempt(s)"), "{e}");
    assert!(e.to_string().contains("did not answer"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    assert!(mps.processes().is_empty(), "{:?}", mps.processes());
}

#[tokio::test]
async fn garbage_empty_and_hanging_replies_are_reported_not_crashed_on() {
    let mps = Mps::new();
    let pid = mps.start();
    let cases = [
        (
            "garbage",
            "cat >/dev/null; echo 'garbage reply'",
            "unexpected reply",
        ),
        ("empty", "cat >/dev/null; exit 0", "empty reply"),
        (
            "fails",
            "echo 'Cannot send command to MPS control daemon process' >&2; exit 1",
            "exit status: 1",
        ),
        // The wrapper's child must die with it: the whole process group is killed.
        ("hangs", "sleep 30", "no reply within"),
        // A client that ignores SIGTERM and forks helpers: all of them are gone after the
        // timed-out probe (the group gets SIGKILL, which cannot be trapped).
        (
            "ignores-term",
            "trap '' TERM; (trap '' TERM; sleep 30) & sleep 30 & wait",
            "no reply within",
        ),
        // A client that answers garbage but leaves a helper running: the helper goes too.
        (
            "leaves-helper",
            "cat >/dev/null; (trap '' TERM; sleep 30) >/dev/null 2>&1 & echo 'garbage reply'",
            "unexpected reply",
        ),
    ];
    for (name, body, expect) in cases {
        let cfg = MpsConfig {
            control_binary: mps.script(name, body),
            ..mps.cfg()
        };
        let obs = probe_once(cfg).await;
        assert_eq!(obs.signal, Signal::MpsUnresponsive, "{name}: {obs:?}");
        let detail = obs.detail.unwrap_or_default();
        assert!(detail.contains(expect), "{name}: {detail}");
        assert!(detail.contains(&format!("pid {pid}")), "{name}: {detail}");
        // The wrapper's own child dies with its group a moment after the wrapper.
        let t0 = Instant::now();
        while mps.processes() != vec![pid] && t0.elapsed() < Duration::from_secs(1) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            mps.processes(),
            vec![pid],
            "{name}: a client process was left"
        );
    }
    // A control binary that does not exist is a mistake, not a daemon fault: a self-fault.
    let cfg = MpsConfig {
        control_binary: PathBuf::from("/nonexistent/mps"),
        ..mps.cfg()
    };
    let obs = probe_once(cfg).await;
    assert!(
        matches!(&obs.signal, Signal::SelfFault { component } if component == "mps-control"),
        "{obs:?}"
    );
    assert!(
        obs.detail
            .as_deref()
            .unwrap_or_default()
            .contains("/nonexistent/mps"),
        "{obs:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_calls_are_serialized_between_probes_and_a_restart() {
    let mps = Mps::new();
    mps.start();
    let cfg = mps.cfg();
    // Unserialized, 8 parallel clients fail most of the time (MPS-FACTS §3).
    let client = ControlClient::new(&cfg);
    let mut calls = Vec::new();
    for _ in 0..8 {
        let c = client.clone();
        calls.push(tokio::spawn(async move {
            c.send_locked(&[PROBE_COMMAND], Duration::from_secs(2))
                .await
        }));
    }
    for c in calls {
        let reply = c.await.unwrap().expect("serialized call");
        assert_eq!(reply.stdout.trim(), "100.0");
    }
    // A restart holds the lock: a probe handed the same client (as `gpu-medic run` wires
    // them) waits its turn and then gives no verdict instead of a false failure. (A slow unit
    // start makes the restart outlast the probe's timeout.)
    let systemctl = mps.script(
        "systemctl",
        &format!(
            "[ \"$1\" = start ] || exit 0\nsleep 0.8\n\
             CUDA_MPS_PIPE_DIRECTORY={} CUDA_MPS_LOG_DIRECTORY={} exec {BIN} -d",
            mps.pipe.display(),
            mps.log.display()
        ),
    );
    let remedy = std::sync::Arc::new(
        MpsDaemon::with_client(
            MpsConfig {
                default_active_thread_percentage: Some(50),
                manage: MpsManage::Systemd,
                ..cfg.clone()
            },
            client.clone(),
        )
        .with_systemctl(systemctl),
    );
    let r = remedy.clone();
    let restart = tokio::spawn(async move { r.restart_now().await });
    let t0 = Instant::now();
    while !remedy.client().is_busy() {
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "restart never took the lock"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let mut probe = MpsProbe::with_client(cfg.clone(), client.clone());
    assert_eq!(probe.probe().await, None, "no verdict while restarting");
    restart.await.unwrap().expect("restart");
    let obs = probe.probe().await.expect("a verdict");
    assert_eq!(obs.signal, Signal::MpsUp, "{obs:?}");
    assert!(obs.detail.unwrap_or_default().contains("answered 50.0"));
}

#[tokio::test]
async fn started_daemon_inherits_none_of_our_descriptors() {
    let mps = Mps::new();
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: pipe(2) writes two descriptors into the 2-element array it is given.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // Neither end is close-on-exec: a careless spawn would hand them to the daemon.
    let inode = std::fs::metadata(format!("/proc/self/fd/{}", fds[1]))
        .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
        .unwrap();
    MpsDaemon::new(mps.cfg())
        .restart_now()
        .await
        .expect("restart");
    let pid = mps.daemons()[0];
    let leaked: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .filter(|l| l == &format!("pipe:[{inode}]"))
        .collect();
    for fd in fds {
        // SAFETY: closing the two descriptors pipe(2) gave this test.
        unsafe {
            libc::close(fd);
        }
    }
    assert!(leaked.is_empty(), "daemon {pid} holds our pipe");
}

#[tokio::test]
async fn systemd_mode_restarts_the_unit_through_systemctl() {
    let mps = Mps::new();
    let old = mps.start();
    signal(old, libc::SIGKILL);
    wait_dead(old);
    let log = mps.root.path().join("systemctl.log");
    // Stands in for systemctl + nvidia-mps.service: the unit runs the daemon with -d.
    let systemctl = mps.script(
        "systemctl",
        &format!(
            "echo \"$@\" >> {log}\n\
             case \"$1 $2\" in\n\
               'reset-failed mps-test.service') exit 0 ;;\n\
               'start mps-test.service') \
                 CUDA_MPS_PIPE_DIRECTORY={pipe} CUDA_MPS_LOG_DIRECTORY={logdir} exec {BIN} -d ;;\n\
               *) echo \"Failed to restart $2: Unit $2 not found.\" >&2; exit 5 ;;\n\
             esac",
            log = log.display(),
            pipe = mps.pipe.display(),
            logdir = mps.log.display(),
        ),
    );
    let cfg = MpsConfig {
        manage: MpsManage::Systemd,
        unit: "mps-test.service".into(),
        default_active_thread_percentage: Some(75),
        ..mps.cfg()
    };
    let done = MpsDaemon::new(cfg.clone())
        .with_systemctl(&systemctl)
        .restart_now()
        .await
        .expect("systemd restart");
    assert!(
        done.detail.contains("`systemctl start mps-test.service`"),
        "{}",
        done.detail
    );
    let calls: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("show "))
        .map(str::to_string)
        .collect();
    assert_eq!(
        calls,
        ["reset-failed mps-test.service", "start mps-test.service"]
    );
    assert_eq!(mps.ask(PROBE_COMMAND), "75.0");
    // An unknown unit is a configuration error: fatal, one attempt.
    let e = MpsDaemon::new(MpsConfig {
        unit: "nope.service".into(),
        ..cfg
    })
    .with_systemctl(&systemctl)
    .restart_now()
    .await
    .unwrap_err();
    assert!(matches!(e, RemedyError::Fatal { .. }), "{e:?}");
    assert!(e.to_string().contains("not found"), "{e}");
}

/// The whole loop through the real binary: a daemon killed with SIGKILL, then one frozen
/// with SIGSTOP, each detected, restarted and journaled as a resolved incident.
#[test]
fn gpu_medic_run_heals_a_killed_and_a_frozen_daemon() {
    let mps = Mps::new();
    let first = mps.start();
    let mut medic = Daemon::new(&format!(
        "state_dir = \"state\"\npolicy = \"{policy}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nenabled = false\n[aws]\nenabled = false\n\
         [mps]\ncontrol_binary = \"{BIN}\"\npipe_directory = \"{pipe}\"\n\
         log_directory = \"{log}\"\nmanage = \"direct\"\nprobe_interval = \"500ms\"\n\
         probe_timeout = \"300ms\"\nquit_timeout = \"1s\"\nstart_timeout = \"5s\"\n\
         default_active_thread_percentage = 40\n",
        policy = default_policy().display(),
        pipe = mps.pipe.display(),
        log = mps.log.display(),
    ));
    medic.log_format("text").env("GPU_MEDIC_LOG", "info");
    medic.spawn();
    let journal_path = medic.path("state/incidents.jsonl");
    let incidents = || std::fs::read_to_string(&journal_path).unwrap_or_default();
    let wait_for = |what: &str, ok: &dyn Fn() -> bool, within: Duration| {
        wait_sync(what, within, ok, || {
            format!(
                "incidents:\n{}\ngpu-medic log:\n{}",
                incidents(),
                medic.log()
            )
        })
    };
    // A healthy probe changes nothing, so it is not written to inputs.jsonl: the daemon's
    // own log shows that gpu-medic's probe reached it.
    let control_log = || std::fs::read_to_string(mps.log.join("control.log")).unwrap_or_default();
    wait_for(
        "first probe answered",
        &|| control_log().contains("Cmd:get_default_active_thread_percentage"),
        Duration::from_secs(10),
    );

    // 1. Crash: SIGKILL. Two down probes confirm, the remedy restarts, the incident closes.
    signal(first, libc::SIGKILL);
    let healed = wait_for(
        "crash healed",
        &|| incidents().matches("\"resolved\"").count() >= 1,
        Duration::from_secs(15),
    );
    let second = mps.daemons();
    assert_eq!(second.len(), 1, "{second:?}");
    assert_ne!(second[0], first);
    assert_eq!(mps.ask(PROBE_COMMAND), "40.0", "defaults re-applied");
    eprintln!("crash detected and healed in {healed:?}");

    // 2. Hang: SIGSTOP. Two unanswered probes, the frozen daemon is killed and replaced.
    signal(second[0], libc::SIGSTOP);
    let healed = wait_for(
        "hang healed",
        &|| incidents().matches("\"resolved\"").count() >= 2,
        Duration::from_secs(15),
    );
    eprintln!("hang detected and healed in {healed:?}");
    assert!(!alive(second[0]), "the frozen daemon is gone");
    let third = mps.daemons();
    assert_eq!(third.len(), 1, "{third:?}");
    assert_eq!(mps.ask(PROBE_COMMAND), "40.0");

    // Stop gpu-medic gracefully.
    let status = medic.stop(Duration::from_secs(10));
    assert!(
        status.is_some(),
        "gpu-medic did not stop on SIGTERM:\n{}",
        medic.log()
    );

    let out = medic.cli(&["incidents", "list", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mps_incidents: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|v| v["action"] == "restart-mps")
        .collect();
    assert_eq!(mps_incidents.len(), 2, "{lines:#?}");
    assert_eq!(mps_incidents[0]["signal"], "mps-down");
    assert_eq!(mps_incidents[1]["signal"], "mps-unresponsive");
    // The restart started the probe's count over: the hang needed two failures of its own.
    let journal = incidents();
    let opened: Vec<serde_json::Value> = journal
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["event"] == "opened")
        .filter(|v| !gpu_medic_testkit::journal::about_the_test_machine(v))
        .collect();
    assert_eq!(opened[1]["observation"]["value"], 2, "{journal}");
    for i in &mps_incidents {
        assert_eq!(i["state"], "resolved", "{i}");
        assert!(i["closed_at"].is_string(), "{i}");
    }

    let pipe = mps.pipe.clone();
    drop(mps);
    assert_eq!(mps_pids(&pipe), Vec::<u32>::new(), "nothing left running");
}

/// A `systemctl` that hangs, ignores SIGTERM and forks a helper that does too: the restart
/// gives up at `start_timeout` and neither is left running (the whole process group is
/// SIGKILLed). The fake stands in for systemctl, which cannot run without systemd here.
#[tokio::test]
async fn a_hung_systemctl_that_ignores_sigterm_leaves_nothing_behind() {
    let mps = Mps::new();
    let pids = mps.root.path().join("pids");
    let systemctl = mps.script(
        "systemctl",
        &format!(
            "trap '' TERM\n\
             case \"$1\" in reset-failed) exit 0 ;; esac\n\
             (trap '' TERM; sleep 60) &\n\
             echo $! >> {p}\n\
             echo $$ >> {p}\n\
             sleep 60",
            p = pids.display()
        ),
    );
    let cfg = MpsConfig {
        manage: MpsManage::Systemd,
        unit: "mps-test.service".into(),
        start_timeout: Duration::from_millis(500),
        ..mps.cfg()
    };
    let e = MpsDaemon::new(cfg)
        .with_systemctl(&systemctl)
        .with_attempts(1, Duration::from_millis(10))
        .restart_now()
        .await
        .unwrap_err();
    assert!(e.to_string().contains("did not return within"), "{e}");
    let left: Vec<u32> = std::fs::read_to_string(&pids)
        .unwrap()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    // Each systemctl call that hung left a script and its forked sleep (a restart may ask
    // systemctl more than once: show, then start).
    assert!(!left.is_empty() && left.len().is_multiple_of(2), "{left:?}");
    for pid in left {
        wait_dead(pid);
    }
}

/// The restart reads its order's deadline on the clock the supervisor stamps orders with (here
/// tokio's paused clock): with a control binary that never answers, the restart ends at the
/// deadline in virtual time, with the deadline's message, not at whatever the wall clock says.
#[tokio::test(start_paused = true)]
async fn a_restart_ends_at_its_orders_deadline_in_virtual_time() {
    use gpu_medic::model::{ActionId, Command, IncidentId, Order, Timestamp};
    use gpu_medic::remedy::MpsRemedy;
    use gpu_medic::sys::clock::TokioClock;
    let mps = Mps::new();
    let hangs = mps.script("hangs", "exec sleep 3600");
    let cfg = MpsConfig {
        control_binary: hangs,
        ..mps.cfg()
    };
    // 2023: far from the wall clock, so a deadline read on the wall clock is long past.
    let clock = TokioClock::shared(1_700_000_000_000);
    let remedy = MpsDaemon::new(cfg)
        .with_attempts(1_000, Duration::from_millis(500))
        .with_clock(clock.clone());
    let order = Order {
        id: ActionId(1),
        incident: IncidentId(1),
        command: Command::RestartMps,
        attempt: 1,
        deadline: Timestamp(clock.now_ms() + 20_000),
        planned: false,
    };
    let t0 = tokio::time::Instant::now();
    let err = remedy.restart(&order).await.expect_err("a hung binary");
    let took = t0.elapsed();
    assert!(
        err.to_string()
            .contains("did not finish before its deadline"),
        "{err}"
    );
    assert!(
        took >= Duration::from_secs(20) && took < Duration::from_secs(21),
        "virtual {took:?}"
    );
}

/// The ECS agent probes the same daemon (`get_default_active_thread_percentage`, 3 s
/// deadline) and the daemon serves one front-end session at a time (MPS-FACTS §3): a probe
/// that collides with the agent's fails through no fault of the daemon. A fake agent loop
/// (the real control binary, as the agent runs it, 50 ms apart: far busier than the agent)
/// beside gpu-medic's own probe, itself 20 ms apart: a probe may still fail now and then
/// (both sides start sessions blindly), but never twice in a row, so the daemon is never
/// restarted for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probing_beside_the_ecs_agents_prober_raises_no_false_alarm() {
    let mps = Mps::new();
    mps.start();
    let agent = AgentProber::start(&mps, Duration::from_millis(50));
    let cfg = MpsConfig {
        probe_timeout: Duration::from_secs(2),
        ..mps.cfg()
    };
    let mut probe = MpsProbe::new(cfg);
    let mut verdicts = Vec::new();
    for _ in 0..30 {
        let obs = probe.probe().await.expect("a verdict");
        verdicts.push((obs.signal, obs.value, obs.detail.unwrap_or_default()));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let outcomes = agent.stop();
    let failed = outcomes.iter().filter(|ok| !**ok).count();
    let single = verdicts.iter().filter(|v| v.0 != Signal::MpsUp).count();
    eprintln!(
        "agent: {failed} of {} probes failed (worst run {}); gpu-medic: {single} of {} probes \
         failed after their retry",
        outcomes.len(),
        worst_run(&outcomes),
        verdicts.len()
    );
    // The default policy restarts at two unresponsive probes in a row (value 2); the daemon
    // is never taken for down.
    let restarts: Vec<_> = verdicts
        .iter()
        .filter(|(s, value, _)| {
            *s == Signal::MpsDown || (*s == Signal::MpsUnresponsive && *value >= 2)
        })
        .collect();
    assert!(restarts.is_empty(), "{verdicts:#?}");
}

/// A front-end left open (an operator's session, an agent's probe that has not finished)
/// makes every other session fail until it exits (MPS-FACTS §3): the probe waits for it
/// and then gets its answer, where a probe straight away would have reported the daemon
/// unresponsive.
#[tokio::test]
async fn a_probe_waits_for_another_open_front_end() {
    use std::io::Write;
    let mps = Mps::new();
    mps.start();
    let mut open = std::process::Command::new(BIN)
        .env("CUDA_MPS_PIPE_DIRECTORY", &mps.pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", &mps.log)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = open.stdin.take().unwrap();
    stdin
        .write_all(format!("{PROBE_COMMAND}\n").as_bytes())
        .unwrap();
    // The session is open once the daemon logs it.
    let control_log = || std::fs::read_to_string(mps.log.join("control.log")).unwrap_or_default();
    wait_sync(
        "the open session to reach the daemon",
        Duration::from_secs(5),
        || control_log().contains("Cmd:get_default_active_thread_percentage"),
        control_log,
    );
    assert_eq!(
        mps.answer(PROBE_COMMAND, Duration::from_secs(1)),
        None,
        "a second session fails while one is open"
    );
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        drop(stdin);
        open.wait()
    });
    let t0 = Instant::now();
    let obs = probe_once(MpsConfig {
        probe_timeout: Duration::from_secs(1),
        ..mps.cfg()
    })
    .await;
    let waited = t0.elapsed();
    closer.join().unwrap().unwrap();
    assert_eq!(obs.signal, Signal::MpsUp, "{obs:?}");
    assert!(
        waited >= Duration::from_millis(1000),
        "answered after {waited:?}: it did not wait"
    );
}

/// A fake ECS agent probing at a fixed cadence (every 3 s: the real one probes once per
/// doctor run, far less often) and gpu-medic's probe every 500 ms through a control binary
/// whose sessions last 200 ms (a slow host): without keeping away, about two in five of the
/// agent's probes would land in one of ours and fail. gpu-medic learns the agent's cadence
/// from the daemon's log (the agent probed before gpu-medic started, as at boot) and keeps
/// its probes away: the agent sees no failure and gpu-medic no false alarm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_cadence_is_kept_away_from() {
    let mps = Mps::new();
    mps.start();
    let slow = mps.slow_control_binary(Duration::from_millis(200));
    let agent = AgentProber::start(&mps, Duration::from_secs(3));
    // Three of the agent's probes in the log before gpu-medic starts.
    let control_log = || std::fs::read_to_string(mps.log.join("control.log")).unwrap_or_default();
    wait_sync(
        "three agent probes",
        Duration::from_secs(15),
        || control_log().matches("NEW UI").count() >= 3,
        control_log,
    );
    let mut probe = MpsProbe::new(MpsConfig {
        control_binary: slow.clone(),
        probe_timeout: Duration::from_secs(2),
        ..mps.cfg()
    });
    let mut verdicts = Vec::new();
    let until = Instant::now() + Duration::from_secs(24);
    while Instant::now() < until {
        for obs in probe.tick().await {
            verdicts.push((obs.signal, obs.detail.unwrap_or_default()));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let outcomes = agent.stop();
    let ours = control_log().matches("Cmd:get_server_list").count();
    eprintln!(
        "agent: {} of {} probes failed; gpu-medic: {ours} probes answered",
        outcomes.iter().filter(|ok| !**ok).count(),
        outcomes.len()
    );
    assert!(ours >= 10, "gpu-medic probed {ours} times");
    assert!(
        outcomes.iter().all(|ok| *ok),
        "the agent's probes: {outcomes:?}\n{}",
        control_log()
    );
    let false_alarms: Vec<_> = verdicts
        .iter()
        .filter(|(s, _)| *s != Signal::MpsUp)
        .collect();
    assert!(false_alarms.is_empty(), "{false_alarms:#?}");
}

/// A front-end that never closes its session keeps every other one out: after its wait and
/// its retry the probe reports the daemon unresponsive, and names the front-end by pid.
#[tokio::test]
async fn a_front_end_held_open_is_named() {
    use std::io::Write;
    let mps = Mps::new();
    mps.start();
    let mut open = std::process::Command::new(BIN)
        .env("CUDA_MPS_PIPE_DIRECTORY", &mps.pipe)
        .env("CUDA_MPS_LOG_DIRECTORY", &mps.log)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = open.stdin.take().unwrap();
    stdin
        .write_all(format!("{PROBE_COMMAND}\n").as_bytes())
        .unwrap();
    let control_log = || std::fs::read_to_string(mps.log.join("control.log")).unwrap_or_default();
    wait_sync(
        "the open session to reach the daemon",
        Duration::from_secs(5),
        || control_log().contains("Cmd:get_default_active_thread_percentage"),
        control_log,
    );
    let obs = probe_once(MpsConfig {
        probe_timeout: Duration::from_secs(1),
        ..mps.cfg()
    })
    .await;
    drop(stdin);
    let _ = open.wait();
    assert_eq!(obs.signal, Signal::MpsUnresponsive, "{obs:?}");
    let detail = obs.detail.unwrap_or_default();
    assert!(
        detail.contains(&format!(
            "another front-end holds a session with it: pid {}",
            open.id()
        )),
        "{detail}"
    );
}

/// A control binary that plays a daemon with one server (4242) and the clients listed in
/// `root/clients`, logging every command to `root/commands`: the real daemon runs no server
/// without a GPU (MPS-FACTS §4), so the server and client lists cannot be had from it here.
/// `sticky`: terminate_client answers but the client stays listed.
fn daemon_with_clients(mps: &Mps, clients: &[u32], sticky: bool) -> PathBuf {
    let root = mps.root.path();
    let list: String = clients.iter().map(|c| format!("{c}\n")).collect();
    std::fs::write(root.join("clients"), list).unwrap();
    let remove = if sticky {
        String::new()
    } else {
        "grep -vx \"$pid\" \"$state\" > \"$state.new\"; mv \"$state.new\" \"$state\"".to_string()
    };
    mps.script(
        "fake-control",
        &format!(
            "state={root}/clients\n\
             while IFS= read -r cmd; do\n\
               echo \"$cmd\" >> {root}/commands\n\
               case \"$cmd\" in\n\
                 get_server_list) echo 4242 ;;\n\
                 'get_client_list 4242') cat \"$state\" ;;\n\
                 'terminate_client 4242 '*) pid=${{cmd#terminate_client 4242 }}; {remove} ;;\n\
                 get_client_list*|terminate_client*) echo \"Server ${{cmd#* }} not found\" ;;\n\
                 *) echo \"Unknown command \\\"$cmd\\\"\" ;;\n\
               esac\n\
             done",
            root = root.display()
        ),
    )
}

/// The finest repair: the daemon terminates the client a fault is charged to, found in its
/// server's client list; a pid it does not serve is said to be no client; a client still
/// listed after its termination is reported, not taken for done.
#[tokio::test]
async fn terminate_client_stops_only_the_named_clients_of_their_server() {
    use gpu_medic::remedy::MpsRemedy;
    let mps = Mps::new();
    let fake = daemon_with_clients(&mps, &[1111, 2222], false);
    let remedy = MpsDaemon::new(MpsConfig {
        control_binary: fake.clone(),
        ..mps.cfg()
    });
    let done = remedy.terminate_clients(&[1111, 3333]).await.unwrap();
    assert_eq!(
        done.detail,
        "terminated MPS client 1111 of server 4242; pid 3333 is no client of the MPS daemon \
         (servers [4242])"
    );
    let commands = std::fs::read_to_string(mps.root.path().join("commands")).unwrap();
    assert_eq!(
        commands.lines().collect::<Vec<_>>(),
        [
            "get_server_list",
            "get_client_list 4242",
            "terminate_client 4242 1111",
            "get_client_list 4242",
        ]
    );
    let left = std::fs::read_to_string(mps.root.path().join("clients")).unwrap();
    assert_eq!(left, "2222\n", "the other client is left alone");

    let sticky = Mps::new();
    let fake = daemon_with_clients(&sticky, &[1111], true);
    let remedy = MpsDaemon::new(MpsConfig {
        control_binary: fake,
        ..sticky.cfg()
    });
    let done = remedy.terminate_clients(&[1111]).await.unwrap();
    assert!(
        done.detail
            .contains("answered, but the server still lists it"),
        "{}",
        done.detail
    );
}

/// NVIDIA's real daemon without a GPU runs no server: the pids are no clients of it, and
/// nothing else is touched.
#[tokio::test]
async fn terminate_client_on_the_real_daemon_without_servers() {
    use gpu_medic::remedy::MpsRemedy;
    let mps = Mps::new();
    let pid = mps.start();
    let done = MpsDaemon::new(mps.cfg())
        .terminate_clients(&[1111])
        .await
        .unwrap();
    assert_eq!(
        done.detail,
        "pid 1111 is no client of the MPS daemon (it runs no server)"
    );
    assert_eq!(mps.daemons(), vec![pid]);
    // A daemon that is not there cannot be asked: retryable.
    let gone = Mps::new();
    let err = MpsDaemon::new(gone.cfg())
        .terminate_clients(&[1111])
        .await
        .expect_err("no daemon");
    assert!(matches!(err, RemedyError::Retryable { .. }), "{err:?}");
}

/// A stop-tasks order that names client pids goes to the MPS daemon first: the outcome says
/// which clients were terminated and, without AWS, that no task was stopped.
#[tokio::test]
async fn a_stop_tasks_order_terminates_its_clients_first() {
    use gpu_medic::model::{ActionId, Command, GpuId, IncidentId, Order, OutcomeStatus, Timestamp};
    use gpu_medic::remedy::{Executor, Remedies};
    let mps = Mps::new();
    let fake = daemon_with_clients(&mps, &[1111], false);
    let remedies = Remedies {
        mps: Some(std::sync::Arc::new(MpsDaemon::new(MpsConfig {
            control_binary: fake,
            ..mps.cfg()
        }))),
        ..Remedies::default()
    };
    let order = Order {
        id: ActionId(1),
        incident: IncidentId(1),
        command: Command::StopTasks {
            gpu: GpuId::index_only(0),
            pids: vec![1111],
            tasks: vec![],
        },
        attempt: 1,
        deadline: Timestamp(u64::MAX),
        planned: false,
    };
    let outcome = remedies.execute(order).await;
    assert_eq!(outcome.status, OutcomeStatus::Done, "{outcome:?}");
    assert_eq!(
        outcome.detail,
        "MPS: terminated MPS client 1111 of server 4242; ECS: tasks not stopped: AWS \
         remediation is disabled ([aws] enabled = false)"
    );
}
