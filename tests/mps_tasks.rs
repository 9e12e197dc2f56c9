//! A server fault names its tasks, end to end through the real `gpu-medic run` binary: NVIDIA's
//! real MPS control daemon (`-d`, so its lines go to `server.log`), a fatal-fault block in that
//! log whose sticky clients are real processes placed in cgroups shaped as ECS makes them, the
//! kit's `FakeAgent` answering `/v1/tasks` (the agent exists only on an instance), and moto
//! behind the kit's proxy. The incident names the task ARNs and containers, and StopTask is
//! sent for exactly those tasks.
//!
//! The cgroups are real: this test creates them under the machine's cgroup mounts (cgroup v2
//! `ecstasks.slice/ecstasks-<task>.slice/docker-<id>.scope` as on AL2023, cgroup v1
//! `ecs/<task>/<id>`, and Docker's own `system.slice/docker-<id>.scope` for a task without task
//! cgroups), moves `sleep` processes into them, and removes them at the end. That needs root
//! and writable cgroup mounts (as CI has); without them the test fails saying so.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::mps::{MpsDir, fault_block};
use gpu_medic_testkit::proc::Sleepers;
use gpu_medic_testkit::{Daemon, default_policy, wait_for};

/// A cgroup directory this test made; removed (deepest first) on drop, processes gone.
struct Cgroup {
    made: Vec<PathBuf>,
}

impl Cgroup {
    /// Makes `root/rel` (every missing level) and moves `pid` into it.
    fn place(root: &Path, rel: &str, pid: u32) -> Cgroup {
        let mut made = Vec::new();
        let mut at = root.to_path_buf();
        for part in rel.split('/') {
            at.push(part);
            if !at.exists() {
                std::fs::create_dir(&at).unwrap_or_else(|e| {
                    panic!(
                        "cannot create the cgroup {} ({e}): this test needs root and a writable cgroup mount",
                        at.display()
                    )
                });
                made.push(at.clone());
            }
        }
        std::fs::write(at.join("cgroup.procs"), pid.to_string())
            .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", at.display()));
        Cgroup { made }
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for d in self.made.iter().rev() {
            // A cgroup is removable once its processes are gone (killed first, by Sleepers).
            for _ in 0..50 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// The client processes and the cgroups they were placed in: on drop the processes are
/// killed and reaped first, so that the cgroups can be removed, even when the test failed.
struct Placed {
    clients: Sleepers,
    cgroups: Vec<Cgroup>,
}

impl Drop for Placed {
    fn drop(&mut self) {
        self.clients.stop();
        // The last made first: a parent shared with an earlier one empties last.
        while let Some(c) = self.cgroups.pop() {
            drop(c);
        }
    }
}

/// Where a cgroup2 and a cgroup v1 `pids` hierarchy are mounted (from /proc/self/mountinfo).
fn cgroup_mounts() -> (PathBuf, Option<PathBuf>) {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mut v2 = None;
    let mut v1 = None;
    for line in info.lines() {
        let (left, right) = line.split_once(" - ").unwrap_or((line, ""));
        let mount = PathBuf::from(left.split_whitespace().nth(4).unwrap_or(""));
        let mut r = right.split_whitespace();
        let (fstype, opts) = (r.next().unwrap_or(""), r.nth(1).unwrap_or(""));
        if fstype == "cgroup2" && v2.is_none() {
            v2 = Some(mount);
        } else if fstype == "cgroup" && opts.split(',').any(|o| o == "pids") {
            v1 = Some(mount);
        }
    }
    (
        v2.expect("no cgroup2 mount: this test places processes in cgroup v2 paths"),
        v1,
    )
}

/// A 64-digit Docker container id, unique to this run.
fn docker_id(n: u32) -> String {
    format!("{:08x}{n:08x}{}", std::process::id(), "c0ffee".repeat(8))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_fault_names_its_ecs_tasks_and_stops_exactly_those() {
    let (v2, v1) = cgroup_mounts();
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "mpstasks", 1).await;
    let me = &s.nodes[0];
    let mut arns = Vec::new();
    for _ in 0..4 {
        arns.push(aws::start_task(&sdk, &s, &me.arn, None).await);
    }
    let id = |arn: &str| arn.rsplit('/').next().unwrap().to_string();
    let (a, b, c, bystander) = (&arns[0], &arns[1], &arns[2], &arns[3]);

    // Five clients: A in a cgroup v2 task slice, B in a cgroup v1 task path (v2 where the
    // machine has no v1 pids hierarchy), C in Docker's own scope (only the agent knows its
    // task), D outside any container, E gone before the lookup.
    let mut placed = Placed {
        clients: Sleepers::start(4),
        cgroups: Vec::new(),
    };
    let pids = placed.clients.pids();
    let mut gone = Sleepers::start(1);
    let e_pid = gone.pids()[0];
    gone.stop();
    let (cid_a, cid_b, cid_c) = (docker_id(1), docker_id(2), docker_id(3));
    placed.cgroups.push(Cgroup::place(
        &v2,
        &format!(
            "ecstasks.slice/ecstasks-{}.slice/docker-{cid_a}.scope",
            id(a)
        ),
        pids[0],
    ));
    placed.cgroups.push(match &v1 {
        Some(v1) => Cgroup::place(v1, &format!("ecs/{}/{cid_b}", id(b)), pids[1]),
        None => Cgroup::place(
            &v2,
            &format!(
                "ecstasks.slice/ecstasks-{}.slice/docker-{cid_b}.scope",
                id(b)
            ),
            pids[1],
        ),
    });
    placed.cgroups.push(Cgroup::place(
        &v2,
        &format!("system.slice/docker-{cid_c}.scope"),
        pids[2],
    ));

    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&me.arn)), 0).await;
    agent.set_tasks(&[
        (a, "trainer", &[(&cid_a, "main")]),
        (b, "trainer", &[(&cid_b, "main")]),
        (
            c,
            "inference",
            &[(&cid_c, "server"), (&docker_id(9), "log-router")],
        ),
        (bystander, "inference", &[(&docker_id(4), "server")]),
    ]);

    // The real daemon, run with -d: gpu-medic reads its server.log.
    let root = tempfile::Builder::new()
        .prefix("gm-mt-")
        .tempdir_in("/tmp")
        .unwrap();
    let mps = MpsDir::new(root.path().join("m"));
    let daemon_pid = mps.start().expect("nvidia-cuda-mps-control -d");
    let server_log = mps.log.join("server.log");
    std::fs::write(&server_log, "").unwrap();
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{policy}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nenabled = false\n\
         [mps]\ncontrol_binary = \"{bin}\"\npipe_directory = \"{pipe}\"\n\
         log_directory = \"{log}\"\nlogs = \"files\"\nmanage = \"direct\"\n\
         probe_interval = \"500ms\"\nprobe_timeout = \"300ms\"\n\
         {sections}[ecs]\nagent_url = \"{agent}\"\n",
        policy = default_policy().display(),
        bin = gpu_medic_testkit::mps::MPS_BIN,
        pipe = mps.pipe.display(),
        log = mps.log.display(),
        sections = aws::sections(&s, 0, ""),
        agent = agent.url,
    );
    let mut d = Daemon::in_temp(tempfile::tempdir().unwrap(), &config);
    d.aws(Some(&proxy.url));
    let control_log = mps.log.join("control.log");
    let probes = || {
        std::fs::read_to_string(&control_log)
            .unwrap_or_default()
            .matches("Cmd:get_default_active_thread_percentage")
            .count()
    };
    let before = probes();
    d.start();
    // A second probe reached the daemon: the first turn, whose log tails took their first
    // look after its probe, is over (a turn is the probe, then the tails).
    wait_for("a second probe", Duration::from_secs(15), || async {
        probes() >= before + 2
    })
    .await;

    let named = [pids[0], pids[1], pids[2], pids[3], e_pid];
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&server_log)
            .unwrap();
        f.write_all(fault_block(daemon_pid + 1, &named).as_bytes())
            .unwrap();
    }
    let inc = d.wait_closed(1, Duration::from_secs(20));
    assert_eq!(inc["action"], "stop-tasks", "{inc:#}\n{}", d.log());
    assert_eq!(inc["state"], "resolved", "{inc:#}\n{}", d.log());
    assert_eq!(inc["tasks"], serde_json::json!([a, b, c]), "{inc:#}");

    // Exactly those tasks were stopped; the bystander on the same instance runs on.
    assert_eq!(proxy.count("StopTask"), 3, "{:?}", proxy.ops());
    for t in [a, b, c] {
        assert_eq!(proxy.count_with("StopTask", &id(t)), 1, "{t}");
        assert_eq!(aws::task_desired(&sdk, &s.cluster, t).await, "STOPPED");
    }
    assert_eq!(proxy.count_with("StopTask", &id(bystander)), 0);
    assert_eq!(
        aws::task_desired(&sdk, &s.cluster, bystander).await,
        "RUNNING"
    );
    assert!(agent.requests_for("/v1/tasks") >= 1);

    // The timeline names each task with its containers, and each pid it could not name.
    let out = d.cli(&["incidents", "show", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    eprintln!("{text}");
    for want in [
        format!("{a} (trainer:1; container main; pid {})", pids[0]),
        format!("{b} (trainer:1; container main; pid {})", pids[1]),
        format!("{c} (inference:1; container server; pid {})", pids[2]),
        format!("pid {} (not in a container", pids[3]),
        format!("pid {e_pid} (exited before it could be looked up)"),
    ] {
        assert!(text.contains(&want), "{want:?} not in:\n{text}");
    }
    assert!(!text.contains(&id(bystander)), "{text}");

    d.signal(libc::SIGTERM);
    mps.shutdown();
    drop(placed);
}
