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
//! Two more tests: the reboot rung's OS reboot for real (`systemctl reboot` ends the
//! namespace, which is booted again over the same upper layer: issue 22), and a stand-in
//! `nvidia-fabricmanager.service` under Fabric Manager's real unit name (issue 24).
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

    // Mistakes in what `run` acts through, refused at start against this systemd (exit 78,
    // file:line), never a daemon judged dead: a unit systemd lacks, and a pipe directory the
    // AMI's unit does not give its daemon.
    for (extra, line, why) in [
        (
            "unit = \"nvidia-msp.service\"\n",
            5,
            "[mps] unit nvidia-msp.service: systemd has no such unit",
        ),
        (
            "pipe_directory = \"/run/mps-esc\"\n",
            5,
            "runs the daemon with CUDA_MPS_PIPE_DIRECTORY=/run/mps-ecs",
        ),
    ] {
        let bad = "/etc/gpu-medic/bad.toml";
        std::fs::write(
            sys.path(bad),
            config("[aws]\nenabled = false\n").replace(
                "[mps]\npreset = \"ecs-ami\"\n",
                &format!("[mps]\npreset = \"ecs-ami\"\n{extra}"),
            ),
        )
        .unwrap();
        let out = sys.exec(&["gpu-medic", "run", "--config", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(78), "{extra}: {err}");
        assert!(err.contains(&format!("{bad}:{line}:")), "{err}");
        assert!(err.contains(why), "{err}");
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
        |i| i["rule"] == "mps-crash-loop",
    );
    assert_eq!(inc["action"], "restart-mps", "{inc:#}");
    assert_eq!(inc["state"], "resolved", "{inc:#}\n{}", sys.context());
    let shown = sys.cli(&["incidents", "show", &inc["id"].to_string()]);
    let text = String::from_utf8_lossy(&shown.stdout).into_owned();
    assert!(text.contains("mps-crash"), "{text}");
    assert!(text.contains("MPS server"), "{text}");
    assert!(text.contains("exited with status 1"), "{text}");
    last = inc["id"].as_u64().unwrap();

    // 4. The daemon crash-loops: systemd restarts it each time (NRestarts); each restart is an
    // `mps-crash`, the policy's window makes three a loop, and gpu-medic restarts it once,
    // without racing systemd.
    let before = sys.n_restarts(MPS);
    let third = crash_daemon(&sys, 3);
    let inc = wait_closed(
        &sys,
        "the daemon crash loop",
        last,
        Duration::from_secs(60),
        |i| i["rule"] == "mps-crash-loop",
    );
    assert_eq!(inc["action"], "restart-mps", "{inc:#}\n{}", sys.context());
    assert_eq!(inc["state"], "resolved", "{inc:#}\n{}", sys.context());
    let detail = sys.cli(&["incidents", "show", &inc["id"].to_string()]);
    let text = String::from_utf8_lossy(&detail.stdout).into_owned();
    assert!(text.contains("NRestarts"), "{text}");
    // The restarts of steps 2 and 3 were gpu-medic's own (a stop, then systemd's Restart=):
    // systemd counted them in NRestarts, the engine does not count them as crashes (it knows
    // its own restart orders). The loop is the three kills, so it is seen only after the third.
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

/// The drop-in that points gpu-medic at the test's AWS (moto behind the kit's proxy; on an
/// instance: IMDS credentials) and at the fake NVML's injection folder, `/run/fake-nvml` (a
/// tmpfs: a reboot empties it, as it clears a GPU's state).
fn aws_dropin(proxy: &Proxy) -> String {
    let env: Vec<String> =
        gpu_medic_testkit::daemon::aws_env(Some(&proxy.url), std::path::Path::new("/nonexistent"))
            .into_iter()
            .filter_map(|(k, v)| Some(format!("\"{k}={}\"", v?)))
            .collect();
    format!(
        "# The test's AWS (moto) and the fake NVML's injections.\n\
         [Service]\nEnvironment={} \"FAKE_NVML_INJECT_DIR={INJECT}\"\n",
        env.join(" ")
    )
}

/// The fake NVML's injection folder inside, made at every boot (tmpfiles.d).
const INJECT: &str = "/run/fake-nvml";
const INJECT_TMPFILES: (&str, &str) = (
    "/etc/tmpfiles.d/fake-nvml.conf",
    "d /run/fake-nvml 0755 root root -\n",
);
/// `[repair] boot_id_path`: the kernel's boot id cannot change without rebooting this
/// machine, so the test changes this file between the namespace's boots.
const BOOT_ID: &str = "/etc/gpu-medic/boot_id";

/// Waits for gpu-medic's first NVML poll (`status --json` lists every GPU's links): the
/// baselines an injected fault is judged against.
fn wait_polled(sys: &Booted) {
    sys.wait(
        "gpu-medic's first NVML poll",
        Duration::from_secs(60),
        || {
            let out = sys.cli(&["status", "--json"]);
            serde_json::from_slice::<serde_json::Value>(&out.stdout)
                .is_ok_and(|v| v["links"].as_array().is_some_and(|l| l.len() == 4))
        },
    );
}

/// Issue 22 under real systemd, the OS's own reboot (`[repair] reboot = "systemd"`): the
/// fake NVML reports an XID 79, the default policy says reboot (the first time), and
/// gpu-medic quarantines and drains its container instance in moto, records the reboot, and
/// runs `systemctl reboot` from inside its hardened unit. PID 1 (systemd) stops every unit,
/// gpu-medic saving its state on SIGTERM, and its `systemd-shutdown` calls reboot(2).
///
/// That reboot cannot reboot this machine: PID 1 here is the init of a PID namespace that is
/// not the initial one, and for such a caller Linux's reboot(2) never restarts the kernel:
/// `reboot_pid_ns()` (kernel/pid_namespace.c) records SIGHUP as the namespace's exit and
/// SIGKILLs its init, which ends every process of the namespace. The test relies on exactly
/// that and checks it: unshare, PID 1's parent, dies of SIGHUP (129 in `ns-exit`), which only
/// that kernel path produces (a SIGKILL from outside gives 137). gpu-medic's own unit could not
/// call reboot(2) anyway (`SystemCallFilter=~@reboot`, no CAP_SYS_BOOT): it asks PID 1.
///
/// The namespace is then booted again over the same overlay upper layer (the disk: the
/// journal and state under /var/lib/gpu-medic survive, /run is new) with a new boot id in
/// `[repair] boot_id_path`, and the fake NVML healthy (a new process, no injection): gpu-medic
/// resumes from its journal, knows the boot is new, runs the boot check, and returns the node
/// to service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_79_reboots_the_os_through_systemd_and_the_next_boot_returns_the_node() {
    if !can_run() {
        return;
    }
    let _one = systemd::exclusive();
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "sysd-rb", 3).await;
    let me = &s.nodes[0];
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&me.arn)), 0).await;
    agent.set_tasks(&[]);
    let cfg = config(&format!(
        "{}[ecs]\nagent_url = \"{}\"\nstandalone_grace = \"300ms\"\n\
         drain_poll_interval = \"100ms\"\nforce_stop_lead = \"2s\"\n\
         [fleet]\nwarmup = \"0s\"\nclaim_settle = \"150ms\"\nretry_after = \"300ms\"\n\
         [repair]\nreboot = \"systemd\"\nboot_id_path = \"{BOOT_ID}\"\n\
         check_interval = \"500ms\"\nsettle = \"20s\"\n",
        aws::sections(&s, 0, ""),
        agent.url
    ));
    let dropin = aws_dropin(&proxy);
    let files = [
        (CONFIG, cfg.as_str()),
        (DROPIN, dropin.as_str()),
        INJECT_TMPFILES,
        (BOOT_ID, "e2e-boot-1\n"),
        // A persistent journal (the root's /var/log/journal is missing: volatile), so that the
        // second boot can read what the first logged on its way down.
        ("/var/log/journal/.gpu-medic-e2e", ""),
    ];
    let t0 = std::time::Instant::now();
    let sys = Booted::boot(&files);
    sys.wait("gpu-medic active", Duration::from_secs(60), || {
        sys.state(MEDIC) == "active/running"
    });
    wait_polled(&sys);

    // The fault, through the fake NVML's event set; the fake deletes the file once applied.
    let t_fault = std::time::Instant::now();
    gpu_medic_testkit::inject(&sys.path(INJECT), 1, r#"{"gpu": 0, "xid": 79}"#);
    // PID 1 asked to reboot ends the namespace: the kernel's SIGHUP, not our SIGKILL.
    let exit = sys.wait_ended(Duration::from_secs(120));
    let to_down = t_fault.elapsed();
    let console = std::fs::read_to_string(sys.run_dir().join("namespace.log")).unwrap_or_default();
    assert_eq!(
        exit,
        128 + libc::SIGHUP,
        "the namespace did not end by reboot(2) in a PID namespace (exit {exit})\nconsole:\n{}",
        systemd::tail(&console, 60)
    );
    // The disk as the reboot left it: the reboot recorded (with the boot it ends) before it
    // was made; quarantine and drain done in moto; no EC2 call (the OS's reboot).
    let records =
        gpu_medic_testkit::journal::read(&sys.upper("/var/lib/gpu-medic/incidents.jsonl"));
    let started: Vec<String> = gpu_medic_testkit::journal::events(&records, "action-started")
        .iter()
        .map(|r| {
            r["order"]["command"]["kind"]
                .as_str()
                .unwrap_or("")
                .to_string()
        })
        .collect();
    assert_eq!(started, ["quarantine", "drain", "reboot"], "{records:#?}");
    let reboot = gpu_medic_testkit::journal::events(&records, "action-started")
        .into_iter()
        .find(|r| r["order"]["command"]["kind"] == "reboot")
        .unwrap();
    assert_eq!(
        reboot["order"]["command"]["boot"], "e2e-boot-1",
        "{reboot:#}"
    );
    let opened = gpu_medic_testkit::journal::events(&records, "opened");
    assert_eq!(opened[0]["verdict"], "reboot", "{records:#?}");
    let (status, _, attrs) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert_eq!(status, "DRAINING", "{attrs:?}");
    assert_eq!(proxy.count("RebootInstances"), 0, "{:?}", proxy.ops());

    // The next boot: same disk, a new boot id, healthy GPUs.
    std::fs::write(sys.upper(BOOT_ID), "e2e-boot-2\n").unwrap();
    let t_boot = std::time::Instant::now();
    let sys = sys.boot_again(&[]);
    let inc = wait_closed(&sys, "back in service", 0, Duration::from_secs(90), |i| {
        i["id"] == 1
    });
    let to_service = t_boot.elapsed();
    let inc = sys.incident(inc["id"].as_u64().unwrap() as u32);
    assert_eq!(inc["state"], "repaired", "{inc:#}\n{}", sys.context());
    assert!(
        inc["summary"]
            .as_str()
            .unwrap_or("")
            .contains("repaired by reboot"),
        "{inc:#}"
    );
    assert_eq!(
        gpu_medic_testkit::journal::started_commands(&inc),
        [
            "quarantine",
            "drain",
            "reboot",
            "quarantine",
            "boot-check",
            "restore"
        ],
        "{inc:#}"
    );
    aws::assert_active_and_released(&sdk, &s.cluster, &me.arn).await;
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(sys.path("/var/lib/gpu-medic/state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["node"], "in-service", "{state:#}");
    let h = &state["repair"]["history"][0];
    assert_eq!(h["result"], "repaired", "{state:#}");
    assert_eq!(h["boot_before"], "e2e-boot-1", "{state:#}");
    assert_eq!(h["boot_after"], "e2e-boot-2", "{state:#}");
    assert_eq!(proxy.count("RebootInstances"), 0, "{:?}", proxy.ops());
    assert_eq!(sys.state(MEDIC), "active/running");
    // The first boot's way down, from the persistent journal (one kernel boot id for both:
    // the namespace's boots are not the kernel's): gpu-medic ran the OS's reboot, systemd
    // reached reboot.target, and gpu-medic was stopped and started again.
    let out = sys.exec(&["journalctl", "--no-pager", "-o", "short-precise"]);
    let all = String::from_utf8_lossy(&out.stdout);
    let tail = || systemd::tail(&all, 80);
    assert!(
        all.contains("rebooting the instance (the OS's reboot)"),
        "{}",
        tail()
    );
    assert!(all.contains("reboot.target"), "{}", tail());
    assert_eq!(
        all.matches("Started gpu-medic.service").count(),
        2,
        "{}",
        tail()
    );
    eprintln!(
        "measured: boot -> fault {:?}; fault -> namespace ended by the reboot {to_down:?}; \
         second boot -> back in service {to_service:?}",
        t_fault.duration_since(t0)
    );
}

const FM: &str = "nvidia-fabricmanager.service";
/// Where the stand-in's start fails while this file exists.
const FM_FAIL: &str = "/run/fm-e2e-fail";
/// A stand-in under Fabric Manager's real unit name: the real program needs NVSwitches. A
/// shell that stays up (or, while `FM_FAIL` exists, exits 1 at start), restarted by systemd on
/// failure as NVIDIA's unit is; a start limit so that a failing start ends `failed`.
const FM_UNIT: &str = "[Unit]\n\
    Description=Stand-in for NVIDIA Fabric Manager (gpu-medic systemd e2e: no NVSwitch here)\n\
    StartLimitIntervalSec=60\nStartLimitBurst=6\n\
    [Service]\nType=exec\n\
    ExecStart=/bin/sh -c 'if [ -e /run/fm-e2e-fail ]; then echo \"stand-in: cannot start\"; exit 1; fi; \
    echo \"stand-in Fabric Manager up\"; exec sleep infinity'\n\
    Restart=on-failure\nRestartSec=100ms\n";
/// `[links] systemctl`: the real systemctl, each call counted first (a line in
/// /run/fm-looks), so the test can wait for gpu-medic's looks instead of sleeping.
const FM_SYSTEMCTL: &str =
    "#!/bin/sh\necho \"$*\" >>/run/fm-looks\nexec /usr/bin/systemctl \"$@\"\n";

/// gpu-medic's looks at Fabric Manager so far.
fn fm_looks(sys: &Booted) -> usize {
    std::fs::read_to_string(sys.path("/run/fm-looks"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(FM))
        .count()
}

/// Waits for two more looks: the first of them began after the call, so it has finished
/// reading the unit as it was at the call when the second begins.
fn wait_looks(sys: &Booted, what: &str) {
    let n = fm_looks(sys);
    sys.wait(what, Duration::from_secs(20), || fm_looks(sys) >= n + 2);
}

/// The first `opened` record in the incident journal whose signal is `kind`.
fn wait_opened(sys: &Booted, kind: &str) -> serde_json::Value {
    let find = || {
        sys.records()
            .into_iter()
            .find(|r| r["event"] == "opened" && r["observation"]["signal"]["kind"] == kind)
    };
    sys.wait(
        &format!("an incident opened by {kind}"),
        Duration::from_secs(30),
        || find().is_some(),
    );
    find().unwrap()
}

/// gpu-medic started over with an empty state directory: with `[aws]` off a drain is only
/// recorded (withheld), and later node faults join that incident, so each case gets a node
/// of its own. The state is gone, the units stay as they are.
fn fresh_medic(sys: &Booted) {
    sys.sh(
        "systemctl stop gpu-medic.service && rm -rf /var/lib/gpu-medic/* /run/fm-looks && \
            systemctl start gpu-medic.service",
    );
    sys.wait("gpu-medic active again", Duration::from_secs(60), || {
        sys.state(MEDIC) == "active/running"
    });
    assert!(sys.records().is_empty(), "state left: {:?}", sys.records());
    // The first look sets the NRestarts base.
    wait_looks(sys, "the first looks");
}

/// Issue 24 under real systemd: a stand-in `nvidia-fabricmanager.service` (see `FM_UNIT`) on
/// an instance type with NVSwitches (`[links] instance_type = "p5.48xlarge"`), watched through
/// the real `systemctl show` of PID 1. Stopped (`systemctl stop`): `fabric-manager-down` on
/// the second look, the default policy's rule of that name, drain. Flapping (systemd restarting
/// it after three SIGKILLs, `NRestarts`): `fabric-manager-flapping`, drain. Failing (every start
/// exits 1 until systemd's start limit leaves it `failed`): both signals, drain. Each is in the
/// incident journal with what systemd said. `[aws]` is off: the drain is recorded as what
/// gpu-medic would have done (tests/fabric.rs and tests/aws_e2e.rs carry drains out in moto).
#[test]
fn a_fabric_manager_stopped_flapping_or_failing_under_systemd_is_a_drain() {
    if !can_run() {
        return;
    }
    let _one = systemd::exclusive();
    let cfg = config(
        "[aws]\nenabled = false\n\
         [links]\ninstance_type = \"p5.48xlarge\"\nsystemctl = \"/usr/local/bin/systemctl-counted\"\n\
         fabric_manager_interval = \"500ms\"\nfabric_manager_flaps = 3\n",
    );
    let sys = Booted::boot(&[
        (CONFIG, &cfg),
        ("/etc/systemd/system/nvidia-fabricmanager.service", FM_UNIT),
        // Enabled as `systemctl enable` would (WantedBy=multi-user.target), as a drop-in.
        (
            "/etc/systemd/system/multi-user.target.d/fm.conf",
            "[Unit]\nWants=nvidia-fabricmanager.service\n",
        ),
        ("/usr/local/bin/systemctl-counted", FM_SYSTEMCTL),
    ]);
    sys.wait("gpu-medic active", Duration::from_secs(60), || {
        sys.state(MEDIC) == "active/running"
    });
    assert_eq!(sys.state(FM), "active/running", "{}", sys.context());
    wait_looks(&sys, "gpu-medic's first looks at Fabric Manager");
    assert!(
        sys.records().is_empty(),
        "a running Fabric Manager raised something: {:?}",
        sys.records()
    );

    // 1. Stopped.
    sys.sh("systemctl stop nvidia-fabricmanager.service");
    let r = wait_opened(&sys, "fabric-manager-down");
    assert_eq!(r["rule"], "fabric-manager-down", "{r:#}");
    assert_eq!(r["verdict"], "drain", "{r:#}");
    assert!(r["observation"]["value"].as_u64().unwrap() >= 2, "{r:#}");
    let detail = r["observation"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("inactive/dead") && detail.contains(FM),
        "not systemd's own words: {detail}"
    );
    let inc = wait_closed(&sys, "the stopped case", 0, Duration::from_secs(20), |_| {
        true
    });
    assert_eq!(inc["action"], "drain", "{inc:#}");
    sys.sh("systemctl start nvidia-fabricmanager.service");
    sys.wait(
        "the stand-in running again",
        Duration::from_secs(20),
        || sys.state(FM) == "active/running",
    );

    // 2. Flapping: systemd restarts it after each SIGKILL (Restart=on-failure). Each kill
    // waits for gpu-medic to have looked at it running again, so the down looks stay single
    // (the down rule needs two in a row) and only the restarts add up.
    fresh_medic(&sys);
    for _ in 0..3 {
        let pid = sys.main_pid(FM);
        sys.kill_main(FM, "SIGKILL");
        sys.wait("systemd's restart", Duration::from_secs(20), || {
            let now = sys.main_pid(FM);
            now != 0 && now != pid && sys.state(FM) == "active/running"
        });
        wait_looks(&sys, "a look at the restarted stand-in");
    }
    let r = wait_opened(&sys, "fabric-manager-flapping");
    assert_eq!(r["rule"], "fabric-manager-flapping", "{r:#}");
    assert_eq!(r["verdict"], "drain", "{r:#}");
    let detail = r["observation"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("restarted Fabric Manager 3 times") && detail.contains("NRestarts 3"),
        "{detail}"
    );
    assert!(
        !sys.records()
            .iter()
            .any(|r| r["observation"]["signal"]["kind"] == "fabric-manager-down"),
        "a restart looked like a stop: {:?}",
        sys.records()
    );
    assert_eq!(sys.n_restarts(FM), 3);

    // 3. Failing: every start exits 1; systemd retries until its start limit, then leaves it
    // failed. Both signals, in whichever order the looks saw them; the incident drains.
    fresh_medic(&sys);
    // The start limit counts case 2's starts too: start it over (it is no gpu-medic state).
    sys.sh("systemctl reset-failed nvidia-fabricmanager.service");
    std::fs::write(sys.path(FM_FAIL), "").unwrap();
    sys.kill_main(FM, "SIGKILL");
    sys.wait("the stand-in failed", Duration::from_secs(30), || {
        sys.state(FM) == "failed/failed"
    });
    let journal = sys.journal(FM);
    assert!(
        journal.contains("Start request repeated too quickly"),
        "not systemd's start limit:\n{journal}"
    );
    let seen = |kind: &str| {
        sys.records().into_iter().find(|r| {
            (r["event"] == "opened" || r["event"] == "signal")
                && r["observation"]["signal"]["kind"] == kind
        })
    };
    sys.wait("both signals journaled", Duration::from_secs(30), || {
        seen("fabric-manager-down").is_some() && seen("fabric-manager-flapping").is_some()
    });
    let down = seen("fabric-manager-down").unwrap();
    let detail = down["observation"]["detail"].as_str().unwrap();
    // Seen while systemd retried it (a failed start) or once it gave up.
    assert!(
        detail.contains("last exit status 1") || detail.contains("failed/failed"),
        "{detail}"
    );
    let inc = wait_closed(&sys, "the failing case", 0, Duration::from_secs(20), |_| {
        true
    });
    assert_eq!(inc["action"], "drain", "{inc:#}");
    assert!(
        ["fabric-manager-down", "fabric-manager-flapping"].contains(&inc["rule"].as_str().unwrap()),
        "{inc:#}"
    );
    assert!(journal.contains("stand-in: cannot start"), "{journal}");
    assert_eq!(sys.state(MEDIC), "active/running");
}
