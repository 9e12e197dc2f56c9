//! gpu-medic under real systemd, set up as the ECS GPU AMI runs MPS: systemd 252 as PID 1 of a
//! PID and mount namespace over a debootstrapped Debian bookworm root (`scripts/systemd-e2e.sh`,
//! cached under `target/systemd-e2e/`), NVIDIA's real `nvidia-cuda-mps-control` from Debian
//! non-free run by the AMI's `nvidia-mps.service` (`-f`, `Restart=always`, `RestartSec=1`,
//! pipe `/run/mps-ecs`), and the packaged `packaging/gpu-medic.service` unchanged, running the
//! debug `gpu-medic run` with the `ecs-ami` preset.
//!
//! Test doubles, for what cannot exist here: the fake libnvidia-ml (tests/fake-nvml; no GPU)
//! installed as `libnvidia-ml.so.1`; moto behind the kit's proxy for AWS; the kit's
//! `FakeAgent` for the ECS agent's introspection API; and the Volta fatal-fault block, which
//! only a GPU makes: its lines (NVIDIA's documented shape, the daemon's real prefix) are
//! written to the journal by a process placed in `nvidia-mps.service`'s cgroup, as a server of
//! the daemon writes them, so journald files them under the unit. Everything else is real: systemd's restarts and `NRestarts`, journald,
//! `Type=notify`, the watchdog, the unit's sandbox, the daemon's own server-exit lines.
//!
//! Needs root, `unshare`, `nsenter`, overlayfs, and `debootstrap` with Debian's registry for the
//! first build of the root (`bash .ci/install-deps.sh`). `scripts/test.sh` checks first and,
//! where the machine cannot run it, says so and sets `GPU_MEDIC_SYSTEMD_E2E=skip`; without
//! that a missing prerequisite fails these tests with the reason.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::PathBuf;
use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::mps::fault_block;
use gpu_medic_testkit::systemd::{self, Booted};
use gpu_medic_testkit::{now_ms, parse_at};

const MPS: &str = "nvidia-mps.service";
const MEDIC: &str = "gpu-medic.service";
const CONFIG: &str = "/etc/gpu-medic/config.toml";
/// A drop-in for the packaged unit: the unit itself stays as shipped.
const DROPIN: &str = "/etc/systemd/system/gpu-medic.service.d/e2e.conf";

/// Whether to run; false (with a loud line) only when scripts/test.sh found the machine
/// unable and said so.
fn can_run() -> bool {
    match systemd::check() {
        Ok(()) => true,
        Err(why) if std::env::var("GPU_MEDIC_SYSTEMD_E2E").as_deref() == Ok("skip") => {
            eprintln!("SKIPPED: gpu-medic under real systemd cannot run here: {why}");
            false
        }
        Err(why) => panic!(
            "gpu-medic under real systemd cannot run here: {why}\n\
             (scripts/test.sh skips it, saying so, where the machine lacks a prerequisite)"
        ),
    }
}

/// The config every test boots with: the `ecs-ami` preset at its default intervals.
fn config(extra: &str) -> String {
    format!(
        "state_dir = \"/var/lib/gpu-medic\"\npolicy = \"/etc/gpu-medic/policies/default.toml\"\n\
         [mps]\npreset = \"ecs-ami\"\n\
         [export]\nenabled = false\n[lifecycle]\nenabled = false\n{extra}"
    )
}

/// The host's cgroup2 mount (the namespace shares the host's /sys).
fn cgroup2() -> PathBuf {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines()
        .find_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            (right.split_whitespace().next() == Some("cgroup2"))
                .then(|| PathBuf::from(left.split_whitespace().nth(4).unwrap_or("")))
        })
        .expect("no cgroup2 mount")
}

fn fds(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .map(|p| p.display().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// `Type=notify` readiness, the sandbox still letting gpu-medic reach the MPS pipe,
/// `/dev/kmsg` and the NVML library, then the watchdog killing and restarting a gpu-medic
/// stopped with SIGSTOP.
#[test]
fn packaged_unit_is_ready_reaches_what_it_watches_and_the_watchdog_restarts_it() {
    if !can_run() {
        return;
    }
    let _one = systemd::exclusive();
    let sys = Booted::boot(&[(CONFIG, &config("[aws]\nenabled = false\n"))]);

    // Type=notify: active/running only after READY=1; both units came up at boot.
    sys.wait("gpu-medic active", Duration::from_secs(60), || {
        sys.state(MEDIC) == "active/running"
    });
    assert_eq!(sys.state(MPS), "active/running", "{}", sys.context());
    assert_eq!(sys.prop(MEDIC, "Type"), "notify");
    assert_eq!(sys.prop(MEDIC, "WatchdogUSec"), "30s");
    assert_eq!(
        sys.prop(MEDIC, "ProtectSystem"),
        "strict",
        "the packaged unit, hardened"
    );
    // The daemon's journal shows gpu-medic's probe reaching it through /run/mps-ecs.
    sys.wait(
        "a probe in the daemon's journal",
        Duration::from_secs(30),
        || {
            sys.journal(MPS)
                .matches("Cmd:get_default_active_thread_percentage")
                .count()
                >= 2
        },
    );
    let main = sys
        .host_pid(sys.main_pid(MEDIC))
        .expect("gpu-medic's host pid");
    // Inside the sandbox: /dev/kmsg is open (DeviceAllow=/dev/kmsg r), the NVML library is
    // mapped (the fake one, as libnvidia-ml.so.1), and the startup checks passed.
    sys.wait("/dev/kmsg open", Duration::from_secs(20), || {
        fds(main).iter().any(|f| f == "/dev/kmsg")
    });
    let maps = std::fs::read_to_string(format!("/proc/{main}/maps")).unwrap();
    assert!(maps.contains("libnvidia-ml.so.1"), "NVML not loaded");
    // gpu-medic's own view: the daemon up through the pipe directory, MPS remedies on.
    let status = sys.cli(&["status", "--json"]);
    assert!(status.status.success(), "{status:?}");
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["mps_phase"], "up", "{status:#}");
    assert_eq!(status["capabilities"]["mps"], true, "{status:#}");
    let log = sys.journal(MEDIC);
    for bad in [
        "Permission denied",
        "Operation not permitted",
        "226/NAMESPACE",
    ] {
        assert!(!log.contains(bad), "{bad} in gpu-medic's journal:\n{log}");
    }

    // The watchdog: a stopped gpu-medic pings no more; systemd kills it (WatchdogSec=30s)
    // and starts it again (Restart=always).
    let before = sys.main_pid(MEDIC);
    sys.kill_main(MEDIC, "SIGSTOP");
    let took = sys.wait("the watchdog restart", Duration::from_secs(150), || {
        let now = sys.main_pid(MEDIC);
        now != 0 && now != before && sys.state(MEDIC) == "active/running"
    });
    eprintln!("SIGSTOP -> gpu-medic running again (watchdog) in {took:?}");
    let log = sys.journal(MEDIC);
    assert!(log.contains("Watchdog timeout"), "{log}");
    assert!(
        took >= Duration::from_secs(29),
        "{took:?}: restarted before the watchdog"
    );
    assert_eq!(sys.n_restarts(MEDIC), 1);
}

/// Waits for the first incident after `after` (by id) that `pred` accepts to close; returns
/// it and the time from the call to its opening stamp is not measured here.
fn wait_closed(
    sys: &Booted,
    what: &str,
    after: u64,
    limit: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let find = || {
        sys.incidents()
            .into_iter()
            .find(|i| i["id"].as_u64().unwrap_or(0) > after && pred(i))
    };
    sys.wait(what, limit, || {
        find().is_some_and(|i| i["closed_at"].is_string())
    });
    find().unwrap()
}

/// Kills the daemon's main process `n` times (SIGKILL, systemd's own `systemctl kill`),
/// each time once systemd has started a new one; the wall-clock ms of the last kill.
fn crash_daemon(sys: &Booted, n: usize) -> f64 {
    let mut last = 0.0;
    for _ in 0..n {
        let pid = sys.main_pid(MPS);
        last = now_ms();
        sys.kill_main(MPS, "SIGKILL");
        sys.wait("systemd's restart", Duration::from_secs(20), || {
            let now = sys.main_pid(MPS);
            now != 0 && now != pid && sys.state(MPS) == "active/running"
        });
        // RestartSec=1 paces systemd; keep the loop under the start limit (5 in 10 s).
        std::thread::sleep(Duration::from_millis(1500));
    }
    last
}

/// The three MPS faults the issue names, each detected and handled through `gpu-medic run`
/// under systemd at the default intervals, in one boot: a server fault whose clients are in
/// ECS-shaped cgroups (the incident names their tasks and exactly those are stopped), a hung
/// daemon (probe deadline, restart through systemd), a crash loop of the servers (the
/// daemon's own lines, from journald) and of the daemon (systemd's `NRestarts`), and the
/// restart budget spent: the node is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_faults_under_systemd_are_handled_end_to_end_and_name_their_tasks() {
    if !can_run() {
        return;
    }
    let _one = systemd::exclusive();
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "sysd", 3).await;
    let me = &s.nodes[0];
    let mut arns = Vec::new();
    for _ in 0..3 {
        arns.push(aws::start_task(&sdk, &s, &me.arn, None).await);
    }
    let id = |arn: &str| arn.rsplit('/').next().unwrap().to_string();
    let (a, b, bystander) = (&arns[0], &arns[1], &arns[2]);
    let cid = |n: u32| format!("{:08x}{n:08x}{}", std::process::id(), "5eed".repeat(12));
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&me.arn)), 0).await;
    agent.set_tasks(&[
        (a, "trainer", &[(&cid(1), "main")]),
        (b, "inference", &[(&cid(2), "server")]),
        (bystander, "inference", &[(&cid(3), "server")]),
    ]);
    let env: Vec<String> =
        gpu_medic_testkit::daemon::aws_env(Some(&proxy.url), std::path::Path::new("/nonexistent"))
            .into_iter()
            .filter_map(|(k, v)| Some(format!("\"{k}={}\"", v?)))
            .collect();
    let dropin = format!(
        "# The test's AWS: moto behind the kit's proxy (on an instance: IMDS credentials).\n\
         [Service]\nEnvironment={}\n",
        env.join(" ")
    );
    let cfg = config(&format!(
        "{}[ecs]\nagent_url = \"{}\"\nstandalone_grace = \"300ms\"\n\
         drain_poll_interval = \"100ms\"\nforce_stop_lead = \"2s\"\n\
         [fleet]\nwarmup = \"0s\"\nclaim_settle = \"150ms\"\nretry_after = \"300ms\"\n",
        aws::sections(&s, 0, ""),
        agent.url
    ));
    let mut sys = Booted::boot(&[(CONFIG, &cfg), (DROPIN, &dropin)]);
    sys.wait("gpu-medic active", Duration::from_secs(60), || {
        sys.state(MEDIC) == "active/running"
    });
    // Two probes: the journal follower starts at the end of the journal at the end of the
    // first turn (no saved cursor), so a line written before then would not be read.
    sys.wait("two probes", Duration::from_secs(30), || {
        sys.journal(MPS)
            .matches("Cmd:get_default_active_thread_percentage")
            .count()
            >= 2
    });

    // 1. Server fault. Two clients in cgroup v2 task slices as ECS makes them on AL2023.
    let v2 = cgroup2();
    let pa = sys.client_in_cgroup(
        &v2,
        &format!(
            "ecstasks.slice/ecstasks-{}.slice/docker-{}.scope",
            id(a),
            cid(1)
        ),
    );
    let pb = sys.client_in_cgroup(
        &v2,
        &format!(
            "ecstasks.slice/ecstasks-{}.slice/docker-{}.scope",
            id(b),
            cid(2)
        ),
    );
    let daemon = sys.main_pid(MPS);
    sys.journal_as(
        MPS,
        "nvidia-cuda-mps-control",
        &fault_block(daemon + 1, &[pa, pb]),
    );
    let inc = wait_closed(&sys, "the server fault", 0, Duration::from_secs(60), |i| {
        i["signal"] == "mps-server-fault"
    });
    assert_eq!(inc["action"], "stop-tasks", "{inc:#}\n{}", sys.context());
    assert_eq!(inc["state"], "resolved", "{inc:#}");
    assert_eq!(inc["tasks"], serde_json::json!([a, b]), "{inc:#}");
    assert_eq!(proxy.count("StopTask"), 2, "{:?}", proxy.ops());
    for t in [a, b] {
        assert_eq!(aws::task_desired(&sdk, &s.cluster, t).await, "STOPPED");
    }
    assert_eq!(
        aws::task_desired(&sdk, &s.cluster, bystander).await,
        "RUNNING"
    );
    let shown = sys.cli(&["incidents", "show", &inc["id"].to_string()]);
    let text = String::from_utf8_lossy(&shown.stdout);
    for want in [
        format!("{a} (trainer:1; container main; pid {pa})"),
        format!("{b} (inference:1; container server; pid {pb})"),
    ] {
        assert!(text.contains(&want), "{want:?} not in:\n{text}");
    }
    let mut last = inc["id"].as_u64().unwrap();

    // 2. Hang: the daemon stopped; systemd sees it running. Two probes past their deadline,
    // then gpu-medic's restart (stop, then `systemctl start` unless systemd already did).
    let hung = sys.main_pid(MPS);
    sys.kill_main(MPS, "SIGSTOP");
    let inc = wait_closed(&sys, "the hang", last, Duration::from_secs(60), |i| {
        i["signal"] == "mps-unresponsive"
    });
    assert_eq!(inc["action"], "restart-mps", "{inc:#}");
    assert_eq!(inc["state"], "resolved", "{inc:#}\n{}", sys.context());
    assert_ne!(sys.main_pid(MPS), hung);
    assert_eq!(sys.state(MPS), "active/running");
    assert_eq!(sys.daemons().len(), 1, "one daemon: {:?}", sys.daemons());
    last = inc["id"].as_u64().unwrap();

    // 3. The servers crash-loop: the daemon's own `Server N exited with status 1` lines (a
    // server cannot start without a GPU), read from its journal.
    sys.sh("for i in 1 2 3 4; do echo 'start_server -uid 0' | \
         CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs nvidia-cuda-mps-control; sleep 0.3; done");
    let inc = wait_closed(
        &sys,
        "the server crash loop",
        last,
        Duration::from_secs(60),
        |i| i["signal"] == "mps-crash-loop",
    );
    assert_eq!(inc["action"], "restart-mps", "{inc:#}");
    assert_eq!(inc["state"], "resolved", "{inc:#}\n{}", sys.context());
    let shown = sys.cli(&["incidents", "show", &inc["id"].to_string()]);
    let text = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(text.contains("MPS servers failed"), "{text}");
    assert!(text.contains("exited with status 1"), "{text}");
    last = inc["id"].as_u64().unwrap();

    // 4. The daemon crash-loops: systemd restarts it each time (NRestarts); gpu-medic counts
    // them and restarts it once, without racing systemd.
    let before = sys.n_restarts(MPS);
    let third = crash_daemon(&sys, 3);
    let inc = wait_closed(
        &sys,
        "the daemon crash loop",
        last,
        Duration::from_secs(60),
        |i| i["signal"] == "mps-crash-loop",
    );
    assert_eq!(inc["action"], "restart-mps", "{inc:#}\n{}", sys.context());
    assert_eq!(inc["state"], "resolved", "{inc:#}\n{}", sys.context());
    let detail = sys.cli(&["incidents", "show", &inc["id"].to_string()]);
    let text = String::from_utf8_lossy(&detail.stdout).into_owned();
    assert!(text.contains("NRestarts"), "{text}");
    // The restarts of steps 2 and 3 were gpu-medic's own (a stop, then systemd's Restart=):
    // systemd counted them in NRestarts, gpu-medic does not count them as crashes. The loop
    // is the three kills, so it is seen only after the third.
    assert!(
        before >= 2,
        "our restarts went through Restart=: NRestarts {before}"
    );
    let opened = parse_at(inc["opened_at"].as_str().unwrap()).unwrap();
    assert!(
        opened >= third,
        "a crash loop before the third kill: our own restarts counted\n{text}"
    );
    last = inc["id"].as_u64().unwrap();

    // 5. Once more: the restart budget (3 in 30 min) is spent, the node is replaced.
    let _ = crash_daemon(&sys, 3);
    let inc = wait_closed(
        &sys,
        "the budget spent",
        last,
        Duration::from_secs(120),
        |i| i["rule"] == "mps-restart-budget" || i["action"] == "replace",
    );
    assert_eq!(inc["action"], "replace", "{inc:#}\n{}", sys.context());
    assert_eq!(inc["state"], "replaced", "{inc:#}\n{}", sys.context());
    let health = aws::asg_health(&sdk, &s.asg).await;
    assert!(
        health
            .iter()
            .any(|(i, h)| *i == me.instance_id && h == "Unhealthy"),
        "{health:?}"
    );

    // systemd and gpu-medic never ran two daemons at once.
    let journal = sys.journal(MPS);
    assert!(
        !journal.contains("An instance of this daemon is already running"),
        "{journal}"
    );
    assert_eq!(sys.state(MEDIC), "active/running");
    eprintln!("{}", systemd::tail(&sys.journal(MEDIC), 40));
}
