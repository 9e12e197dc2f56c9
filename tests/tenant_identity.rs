//! No tenant can steer who it is or which limit is read (issue "1/5 No tenant can steer a
//! verdict"; docs/mps.md#who-may-hold-a-gpu-outside-mps, #how-the-limits-are-read), end to end
//! through the real `gpu-medic run`: the fake libnvidia-ml lists real processes as compute
//! processes beside MPS clients, moto holds the tasks, the kit's `FakeAgent` names them.
//!
//! On a GPU where no MPS client runs yet (MPS serves the node through a client on another GPU):
//! - (a) a process whose `argv[0]` and `comm` are `nv-hostengine` is outside MPS;
//! - (b) a process in a private mount namespace that bind-mounts a copy of `sleep` over the
//!   installed `nvidia-cuda-mps-server`, and one over gpu-medic's own executable, each run
//!   from that path: outside MPS, the finding saying the executable is not the installed file;
//! - (c) the real installed `nvidia-cuda-mps-control` run inside an ECS-shaped container
//!   cgroup: not exempt (it is a task's process: that task, and only it, is stopped);
//! - the real MPS daemon on the host, and an installed `nv-hostengine` (a DCGM install of
//!   our own, `[diagnose] dcgmi`) run from its file on the host: exempt, never reported.
//!
//! And (d): two clients of one task whose environment holds `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`
//! twice (kit's `RawEnvProc`: fork and execve with a raw block): the first entry is read, as
//! CUDA reads it (`0=1G` then `0=64G`: within the container's 2048 MiB; `0=64G` then `0=1G`:
//! larger), and a third with a padded value is no limit, its raw value in the finding.
//!
//! Needs root (cgroups, mount namespaces, bind mounts), the real MPS daemon and moto, as CI
//! has; without them the test fails saying so.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use gpu_medic::config::{DiagnoseConfig, MpsConfig};
use gpu_medic::probe::identity::{self, Installed};
use gpu_medic::sys::procfs::FileId;
use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::mps::MpsDir;
use gpu_medic_testkit::proc::{EcsTaskProcs, Sleepers};
use gpu_medic_testkit::{Daemon, wait_sync};
use serde_json::Value;

/// A 64-digit Docker container id, unique to this run.
fn docker_id(n: u32) -> String {
    format!("{:08x}{n:08x}{}", std::process::id(), "ef".repeat(24))
}

fn client(pid: u32, mib: u64) -> String {
    format!(r#"{{"pid": {pid}, "used_mib": {mib}}}"#)
}

/// NVIDIA's real daemon runs no server without a GPU (tests/support/MPS-FACTS.md §7), so MPS's
/// own view finds every MPS client the fake libnvidia-ml lists served by no server of it
/// (`mps-client-no-server`, tested in tests/mps_view.rs): true of this test's world, and not
/// what this test is about.
fn of_this_test(r: &Value) -> bool {
    r["rule"] != "mps-client-no-server"
}

fn opened(d: &Daemon) -> Vec<Value> {
    gpu_medic_testkit::journal::events(&d.records(), "opened")
        .into_iter()
        .filter(of_this_test)
        .collect()
}

/// The opened record naming `pid`, waited for.
fn finding(d: &Daemon, what: &str, pid: u32) -> Value {
    d.wait_record(what, Duration::from_secs(30), "opened", |r| {
        r["observation"]["pids"] == serde_json::json!([pid]) && of_this_test(r)
    })
}

/// A copy of `from` at `to`, executable (another file: another inode).
fn copy_exe(from: &Path, to: &Path) {
    std::fs::copy(from, to).unwrap();
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// Waits until `pid` has executed a program whose `argv[0]` is `argv0`.
fn wait_argv0(pid: u32, argv0: &str) {
    wait_sync(
        &format!("pid {pid} to run as {argv0}"),
        Duration::from_secs(10),
        || {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|b| b.split(|c| *c == 0).next() == Some(argv0.as_bytes()))
        },
        || format!("{:?}", std::fs::read(format!("/proc/{pid}/cmdline"))),
    );
}

/// `unshare -m` with a private mount: `impostor` bind-mounted over `target`, then run from
/// `target` (`sleep`'s arguments), in that namespace only.
fn bind_mounted(impostor: &Path, target: &Path) -> Sleepers {
    let script = format!(
        "mount --bind '{}' '{}' && exec '{}' 1000000",
        impostor.display(),
        target.display(),
        target.display()
    );
    let p = Sleepers::command(
        Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c"])
            .arg(script),
    );
    let pid = p.pids()[0];
    let want = FileId::of(impostor).unwrap();
    wait_sync(
        &format!(
            "pid {pid} to run {} from {}",
            impostor.display(),
            target.display()
        ),
        Duration::from_secs(10),
        || gpu_medic::sys::procfs::exe(Path::new("/proc"), pid).is_some_and(|e| e.id == want),
        || "unshare -m and mount --bind need root".into(),
    );
    wait_argv0(pid, &target.display().to_string());
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_steer_who_it_is_or_which_limit_is_read() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root: cgroups, mount namespaces and bind mounts (CI runs as root)"
    );
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "tenantid", 1).await;
    let me = &s.nodes[0];
    let ecs = aws_sdk_ecs::Client::new(&sdk);
    let fam = format!("{}-tenant", s.cluster);
    ecs.register_task_definition()
        .family(&fam)
        .set_container_definitions(Some(vec![
            aws::mps_container("app", 2048, None),
            aws::mps_container("rogue", 1024, None),
        ]))
        .send()
        .await
        .unwrap();
    let arn_c = aws::start_task(&sdk, &s, &me.arn, None).await;
    let arn_d = aws::start_task(&sdk, &s, &me.arn, None).await;
    let id = |arn: &str| arn.rsplit('/').next().unwrap().to_string();
    let (rogue, app) = (docker_id(1), docker_id(2));
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&me.arn)), 0).await;
    agent.set_tasks(&[
        (&arn_c, &fam, &[(&rogue, "rogue")]),
        (&arn_d, &fam, &[(&app, "app")]),
    ]);

    let root = tempfile::Builder::new()
        .prefix("gm-ti-")
        .tempdir_in("/tmp")
        .unwrap();
    let sleep = PathBuf::from("/bin/sleep");
    // A DCGM install of our own: dcgmi (never run here) and nv-hostengine beside it.
    let dcgm = root.path().join("dcgm/bin");
    std::fs::create_dir_all(&dcgm).unwrap();
    std::fs::write(dcgm.join("dcgmi"), "#!/bin/sh\nexit 1\n").unwrap();
    std::fs::set_permissions(dcgm.join("dcgmi"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let engine = dcgm.join("nv-hostengine");
    copy_exe(&sleep, &engine);
    let impostor = root.path().join("impostor");
    copy_exe(&sleep, &impostor);
    // What gpu-medic finds installed on this host (the same lookup, the same config).
    let diagnose = DiagnoseConfig {
        dcgmi: dcgm.join("dcgmi"),
        ..DiagnoseConfig::default()
    };
    let installed = Installed::from_config(&MpsConfig::default(), &diagnose);
    let (server, server_id) = installed
        .installed(identity::MPS_SERVER)
        .map(|(p, id)| (p.to_path_buf(), id))
        .expect("NVIDIA's nvidia-cuda-mps-server installed (scripts/test.sh installs it)");

    // MPS serves the node: one client on GPU 0.
    let mps_client = Sleepers::start(1);
    // (a) argv[0] and comm nv-hostengine, the file /bin/sleep: `exec -a` sets argv[0], and
    // the kernel names a process (comm) after the last part of the path it executed, here a
    // symlink to sleep (a process cannot set another's comm: /proc/<pid>/comm is its own).
    let alias = root.path().join("alias");
    std::fs::create_dir_all(&alias).unwrap();
    std::os::unix::fs::symlink(&sleep, alias.join("nv-hostengine")).unwrap();
    let named = Sleepers::command(Command::new("bash").arg("-c").arg(format!(
        "exec -a nv-hostengine '{}' 1000000",
        alias.join("nv-hostengine").display()
    )));
    let named_pid = named.pids()[0];
    wait_argv0(named_pid, "nv-hostengine");
    assert_eq!(
        std::fs::read_to_string(format!("/proc/{named_pid}/comm")).unwrap(),
        "nv-hostengine\n"
    );
    // (b) a copy of sleep at the installed server's path and at gpu-medic's own.
    let as_server = bind_mounted(&impostor, &server);
    let as_medic = bind_mounted(&impostor, &gpu_medic_testkit::bin());
    // (c) the real control daemon, in task C's container.
    let pipe = root.path().join("c-pipe");
    std::fs::create_dir_all(&pipe).unwrap();
    let in_task = EcsTaskProcs::start_command(
        &id(&arn_c),
        &rogue,
        Command::new(gpu_medic_testkit::mps::MPS_BIN)
            .arg("-f")
            .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", root.path().join("c-log")),
    )
    .unwrap_or_else(|why| panic!("real processes in ECS-shaped cgroups need root: {why}"));
    let in_task_pid = in_task.pids()[0];
    // The exempt: the real MPS daemon and the installed nv-hostengine, on the host.
    let mps = MpsDir::new(root.path().join("m"));
    let mps_pid = mps.start().expect("nvidia-cuda-mps-control -d");
    let real_engine = Sleepers::command(Command::new(&engine).arg("1000000"));
    let real_engine_pid = real_engine.pids()[0];
    // (d) task D's clients with the pinned limit twice, each way round, and a padded one.
    let limit = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT";
    let (first_small, first_large, padded) = (
        [format!("{limit}=0=1G"), format!("{limit}=0=64G")],
        [format!("{limit}=0=64G"), format!("{limit}=0=1G")],
        [format!("{limit}=0=1G "), "PATH=/bin".to_string()],
    );
    fn block(e: &[String; 2]) -> Vec<&str> {
        vec!["PATH=/usr/bin:/bin", &e[0], &e[1]]
    }
    let (b1, b2, b3) = (block(&first_small), block(&first_large), block(&padded));
    let d_procs = EcsTaskProcs::start_with_raw_env(&id(&arn_d), &app, &[&b1, &b2, &b3])
        .unwrap_or_else(|why| panic!("real processes in ECS-shaped cgroups need root: {why}"));
    let [d_small, d_large, d_padded] = d_procs.pids()[..] else {
        panic!("three clients")
    };
    let environ = std::fs::read(format!("/proc/{d_small}/environ")).unwrap();
    assert_eq!(
        environ
            .split(|b| *b == 0)
            .filter(|e| e.starts_with(limit.as_bytes()))
            .count(),
        2,
        "the raw block keeps both entries"
    );

    let mut d = aws::ecs_gpu_node(
        &s,
        0,
        &agent.url,
        &proxy.url,
        &format!(
            "[lifecycle]\nenabled = false\n[diagnose]\ndcgmi = \"{}\"\n",
            dcgm.join("dcgmi").display()
        ),
    );
    let gpu0: Vec<String> = [mps_client.pids()[0], d_small, d_large, d_padded]
        .iter()
        .map(|p| client(*p, 100))
        .collect();
    let gpu1: Vec<String> = [
        named_pid,
        as_server.pids()[0],
        as_medic.pids()[0],
        in_task_pid,
        mps_pid,
        real_engine_pid,
    ]
    .iter()
    .map(|p| client(*p, 300))
    .collect();
    d.inject(&format!(
        r#"[{{"gpu": 0, "mps_clients": [{}]}}, {{"gpu": 1, "compute_processes": [{}]}}]"#,
        gpu0.join(","),
        gpu1.join(","),
    ));
    d.start();

    // (a): the name exempts nothing; the finding says the file is not the installed one.
    let a = finding(&d, "the process named nv-hostengine", named_pid);
    assert_eq!(a["rule"], "mps-bypass", "{a:#}");
    assert_eq!(a["verdict"], "log", "{a:#}");
    let detail = a["observation"]["detail"].as_str().unwrap();
    let engine_id = FileId::of(&engine).unwrap();
    assert!(
        detail.contains(&format!(
            "pid {named_pid} (nv-hostengine) runs outside MPS on GPU 1"
        )) && detail
            .contains("no MPS client runs on this GPU yet, and MPS serves this node (GPU 0)")
            && detail.contains("not exempt: argv[0] says nv-hostengine but its executable is ")
            && detail.contains(&format!(
                "not the installed {} ({engine_id})",
                engine.display()
            )),
        "{detail}"
    );
    // (b): a bind mount forges the path, not the file.
    let impostor_id = FileId::of(&impostor).unwrap();
    for (p, name, installed_at, installed_id) in [
        (&as_server, identity::MPS_SERVER, server.clone(), server_id),
        (
            &as_medic,
            identity::GPU_MEDIC,
            gpu_medic_testkit::bin(),
            FileId::of(&gpu_medic_testkit::bin()).unwrap(),
        ),
    ] {
        let pid = p.pids()[0];
        let r = finding(&d, &format!("the impostor at {name}'s path"), pid);
        assert_eq!(r["rule"], "mps-bypass", "{r:#}");
        let detail = r["observation"]["detail"].as_str().unwrap();
        assert!(
            detail.contains(&format!(
                "not exempt: argv[0] says {name} but its executable is {impostor_id} "
            )) && detail.contains(&format!(
                "not the installed {} ({installed_id})",
                installed_at.display()
            )),
            "{detail}"
        );
    }
    // (c): the real binary in a task's container: that task's process, stopped.
    let c = finding(&d, "the installed daemon in a task", in_task_pid);
    assert_eq!(c["rule"], "mps-bypass-task", "{c:#}");
    assert_eq!(c["observation"]["tasks"], serde_json::json!([arn_c]));
    let detail = c["observation"]["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!(
            "not exempt: it runs the installed {} but in container cgroup ",
            gpu_medic_testkit::mps::MPS_BIN
        )) && detail.contains(&format!("/ecs/{}/{rogue}", id(&arn_c))),
        "{detail}"
    );
    wait_sync(
        "StopTask for task C",
        Duration::from_secs(30),
        || proxy.count_with("StopTask", &id(&arn_c)) == 1,
        || format!("{:?}\n{}", proxy.ops(), d.log()),
    );
    // (d): the first entry is read.
    let large = finding(&d, "the client whose first limit is 64G", d_large);
    assert_eq!(large["rule"], "mps-limit-mismatch", "{large:#}");
    assert_eq!(large["observation"]["value"], 65536);
    let detail = large["observation"]["detail"].as_str().unwrap();
    assert!(
        detail.contains("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=64G, its container reserves 2048 MiB"),
        "{detail}"
    );
    let pad = finding(&d, "the client with a padded limit", d_padded);
    let detail = pad["observation"]["detail"].as_str().unwrap();
    assert!(
        detail.contains(
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=\"0=1G \" (unreadable: spaces or control characters in it; counted as no limit)"
        ),
        "{detail}"
    );

    // A stretch of polls: nothing about the exempt, the client read as 1G, or MPS clients;
    // only task C stopped; the node neither drained nor marked unhealthy.
    d.wait_nvml_polls("a stretch of polls", 10);
    let quiet = [mps_pid, real_engine_pid, d_small, mps_client.pids()[0]];
    let all = opened(&d);
    for r in &all {
        let pids: Vec<u64> = r["observation"]["pids"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .iter()
            .filter_map(Value::as_u64)
            .collect();
        assert!(
            !quiet.iter().any(|q| pids.contains(&u64::from(*q))),
            "{r:#}"
        );
        assert!(
            ["mps-bypass", "mps-bypass-task", "mps-limit-mismatch"]
                .contains(&r["rule"].as_str().unwrap_or("")),
            "nothing else: {r:#}"
        );
    }
    assert_eq!(all.len(), 6, "{all:#?}");
    assert_eq!(proxy.count("StopTask"), 1, "{:?}", proxy.ops());
    assert_eq!(aws::task_desired(&sdk, &s.cluster, &arn_d).await, "RUNNING");
    for op in ["UpdateContainerInstancesState", "SetInstanceHealth"] {
        assert_eq!(
            proxy.count(op),
            0,
            "no drain, no replacement: {:?}",
            proxy.ops()
        );
    }
    d.signal(libc::SIGTERM);
    mps.shutdown();
}
