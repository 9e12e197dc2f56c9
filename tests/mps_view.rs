//! MPS's own view, cross-checked with NVML's, end to end through the real `gpu-medic run`
//! (docs/mps.md#mpss-own-view).
//!
//! NVIDIA's real control daemon runs no server without a GPU (its `get_server_list` is empty,
//! tests/support/MPS-FACTS.md §7), so the servers and their clients are answered by a stand-in
//! control binary: a shell script that answers the probe's two commands, `get_server_list`
//! with the pids of real processes standing for servers, and `get_client_list <pid>` with the
//! client pids of that server, and records each session it serves. The fake libnvidia-ml lists
//! the clients as MPS clients (with their memory and SM samples) and the servers as compute
//! processes; the clients are real processes, in ECS-shaped cgroups or of other uids. The
//! servers that NVML lists run a copy of `sleep` installed as `nvidia-cuda-mps-server` beside
//! the control binary (owned by root, outside any container), so the outside-MPS check knows
//! them as the MPS server by their file, as it would the real one.
//!
//! The real daemon's own part: with no server, the view adds no session to its pipe, and an
//! MPS client NVML lists is one no server of the daemon serves.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::Duration;

use gpu_medic_testkit::http::scrape;
use gpu_medic_testkit::mps::{MPS_BIN, MpsDir};
use gpu_medic_testkit::proc::{EcsTaskProcs, Sleepers, stand_in};
use gpu_medic_testkit::{Daemon, FOUR_GPUS, default_policy, fake_nvml, wait_sync};
use serde_json::Value;

/// A stand-in control binary in `dir`: `percent` for the thread percentage, the servers in
/// `dir/servers`, each server's clients in `dir/clients-<pid>`; each session's commands are
/// appended to `dir/sessions` as one line (`|`-separated). `-h` prints the banner gpu-medic's
/// start checks for NVIDIA's binary (crates/io/src/launch/preflight.rs).
fn stand_in_control(dir: &Path, percent: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let script = dir.join("fake-control");
    let d = dir.display();
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             if [ \"$1\" = -h ]; then echo 'CUDA MPS Control (stand-in, tests/mps_view.rs)'; exit 0; fi\n\
             seen=''\n\
             while IFS= read -r cmd; do\n\
               seen=\"$seen|$cmd\"\n\
               case \"$cmd\" in\n\
                 get_default_active_thread_percentage) echo {percent} ;;\n\
                 get_server_list) cat {d}/servers ;;\n\
                 'get_client_list '*) pid=${{cmd#get_client_list }};\n\
                   if [ -f {d}/clients-$pid ]; then cat {d}/clients-$pid; else echo \"Server $pid not found\"; fi ;;\n\
                 *) echo \"Unknown command \\\"$cmd\\\"\" ;;\n\
               esac\n\
             done\n\
             echo \"$seen\" >> {d}/sessions\n"
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

fn write_pids(path: &Path, pids: &[u32]) {
    let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
    std::fs::write(path, text).unwrap();
}

fn opened(d: &Daemon, rule: &str) -> Vec<Value> {
    d.records()
        .into_iter()
        .filter(|r| r["event"] == "opened" && r["rule"] == rule)
        .collect()
}

/// A process of `uid` (a `sleep`), killed on drop.
fn as_user(uid: u32) -> Sleepers {
    Sleepers::command(
        std::process::Command::new("/bin/sleep")
            .arg("1000000")
            .uid(uid),
    )
}

fn port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn config(dir: &Path, control: &Path, pipe: &Path, log: &Path, port: u16) -> String {
    format!(
        "state_dir = \"state\"\npolicy = \"{policy}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nlibrary = \"{lib}\"\nkmsg = \"{kmsg}\"\npoll_interval = \"300ms\"\n\
         [mps]\ncontrol_binary = \"{control}\"\npipe_directory = \"{pipe}\"\n\
         log_directory = \"{log}\"\nlogs = \"files\"\nmanage = \"direct\"\n\
         probe_interval = \"1s\"\nprobe_timeout = \"800ms\"\n\
         [aws]\nenabled = false\n[lifecycle]\nenabled = false\n\
         [metrics]\nenabled = true\nlisten = \"127.0.0.1:{port}\"\n",
        policy = default_policy().display(),
        lib = fake_nvml().display(),
        kmsg = dir.join("kmsg").display(),
        control = control.display(),
        pipe = pipe.display(),
        log = log.display(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mps_s_own_view_is_placed_against_nvml_and_shown() {
    let dir = tempfile::Builder::new()
        .prefix("gm-mv-")
        .tempdir_in("/tmp")
        .unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    // The scripts and the server's file first, before any process is forked (a child
    // between fork and exec holding a write descriptor would make exec fail: ETXTBSY).
    let control = stand_in_control(&bin, "75.0");
    let server_exe = stand_in(&bin, "nvidia-cuda-mps-server");
    let (pipe, log) = (dir.path().join("pipe"), dir.path().join("log"));
    std::fs::create_dir_all(&pipe).unwrap();
    std::fs::create_dir_all(&log).unwrap();

    // Servers: S (root, NVML lists it on GPU 1, serves A and B), I (root, no client, holds
    // 3 GiB on GPU 3), W (a per-user server of uid 1000, serves D of uid 2000).
    let mut s = Sleepers::start_exe(&server_exe, "nvidia-cuda-mps-server");
    let mut i = Sleepers::start_exe(&server_exe, "nvidia-cuda-mps-server");
    let mut w = as_user(1000);
    let (s_pid, i_pid, w_pid) = (s.pids()[0], i.pids()[0], w.pids()[0]);
    // Clients: A in task t1 (NVML: GPU 1), B in task t1 (NVML: on no GPU), C in task t2
    // (NVML: GPU 2, served by no server of this daemon), D of uid 2000 (NVML: GPU 0).
    let t1 = format!("{:08x}aaaaaaaaaaaaaaaaaaaaaaaa", std::process::id());
    let t2 = format!("{:08x}bbbbbbbbbbbbbbbbbbbbbbbb", std::process::id());
    let docker = |n: u32| format!("{:08x}{n:08x}{}", std::process::id(), "cd".repeat(24));
    let in_task = |task: &str, c: &str| {
        EcsTaskProcs::start(task, c, 1)
            .unwrap_or_else(|why| panic!("real processes in ECS-shaped cgroups need root: {why}"))
    };
    let a = in_task(&t1, &docker(1));
    let b = in_task(&t1, &docker(2));
    let c = in_task(&t2, &docker(3));
    let mut dd = as_user(2000);
    let (a_pid, b_pid, c_pid, d_pid) = (a.pids()[0], b.pids()[0], c.pids()[0], dd.pids()[0]);
    write_pids(&bin.join("servers"), &[s_pid, i_pid, w_pid]);
    write_pids(&bin.join(format!("clients-{s_pid}")), &[a_pid, b_pid]);
    write_pids(&bin.join(format!("clients-{i_pid}")), &[]);
    write_pids(&bin.join(format!("clients-{w_pid}")), &[d_pid]);

    let port = port();
    let cfg = config(dir.path(), &control, &pipe, &log, port);
    let mut d = Daemon::in_temp(dir, &cfg);
    d.gpus(FOUR_GPUS);
    d.inject(&format!(
        r#"[{{"gpu": 0, "mps_clients": [{d_pid}]}},
            {{"gpu": 1, "mps_clients": [{{"pid": {a_pid}, "used_mib": 2048, "sm_percent": 30}}],
              "compute_processes": [{{"pid": {s_pid}, "used_mib": 300}}]}},
            {{"gpu": 2, "mps_clients": [{{"pid": {c_pid}, "used_mib": 512}}]}},
            {{"gpu": 3, "compute_processes": [{{"pid": {i_pid}, "used_mib": 3072}}]}}]"#
    ));
    d.start();

    // Each mismatch, once two looks in a row saw it.
    let has = |rule: &str, pid: u32| {
        opened(&d, rule)
            .iter()
            .any(|r| r["observation"]["pids"] == serde_json::json!([pid]))
    };
    wait_sync(
        "the four findings of MPS's view",
        Duration::from_secs(60),
        || {
            has("mps-client-not-on-gpu", b_pid)
                && has("mps-client-no-server", c_pid)
                && has("mps-server-idle-memory", i_pid)
                && has("mps-wrong-server", d_pid)
        },
        || format!("{:#?}\n{}", d.records(), d.log()),
    );
    let one = |rule: &str| {
        let all = opened(&d, rule);
        assert_eq!(all.len(), 1, "{rule}: {all:#?}");
        all[0]["observation"].clone()
    };
    let not_on_gpu = one("mps-client-not-on-gpu");
    assert_eq!(
        not_on_gpu["value"],
        Value::Null,
        "0: it runs: {not_on_gpu:#}"
    );
    assert_eq!(
        not_on_gpu["tasks"],
        serde_json::json!([t1]),
        "{not_on_gpu:#}"
    );
    let no_server = one("mps-client-no-server");
    assert_eq!(no_server["value"], 1, "in an ECS task: {no_server:#}");
    assert_eq!(no_server["tasks"], serde_json::json!([t2]));
    assert_eq!(no_server["gpu"]["index"], 2);
    let detail = no_server["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!("its servers: [{s_pid}, {i_pid}, {w_pid}]")),
        "{detail}"
    );
    let idle = one("mps-server-idle-memory");
    assert_eq!(
        (idle["value"].clone(), idle["gpu"]["index"].clone()),
        (3072.into(), 3.into())
    );
    let wrong = one("mps-wrong-server");
    assert!(
        wrong["detail"].as_str().unwrap().contains(&format!(
            "runs as uid 2000 and is served by server {w_pid}, which runs as uid 1000"
        )),
        "{wrong:#}"
    );
    // A (served, on its GPU) and the servers on their GPUs are no finding; no server is
    // taken for a process outside MPS (the installed server's file).
    for r in d.records().iter().filter(|r| r["event"] == "opened") {
        let pids = &r["observation"]["pids"];
        assert_ne!(pids, &serde_json::json!([a_pid]), "{r:#}");
        assert_ne!(r["rule"], "mps-bypass", "{r:#}");
    }

    // The tree: GPU -> server -> client -> task.
    let out = d.cli(&["status"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "mps view:    listed ".to_string(),
        "default active thread percentage 75.0".into(),
        format!("  server {s_pid} (uid 0), 300 MiB"),
        format!(
            "    client {a_pid} (uid 0) -> task {t1}, container {} (2048 MiB, SM 30%)",
            docker(1)
        ),
        format!("  no server of this daemon: client {c_pid} (uid 0) -> task {t2}"),
        format!("  server {w_pid} (uid 1000)"),
        format!("    client {d_pid} (uid 2000) -> no ECS task"),
        format!("  server {i_pid} (uid 0), 3072 MiB, no clients"),
        format!("on no GPU in NVML's lists: server {s_pid} (uid 0)"),
        format!("    client {b_pid} (uid 0) -> task {t1}"),
    ] {
        assert!(text.contains(&want), "{want:?} not in:\n{text}");
    }
    let json = d.cli(&["status", "--json"]);
    let v: Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["mps_view"]["gpus"][1]["servers"][0]["pid"], s_pid);

    // A's compute share against its limit: no CUDA_MPS_ACTIVE_THREAD_PERCENTAGE of its own,
    // so the daemon's default the probe read (75.0).
    let addr = format!("127.0.0.1:{port}");
    let series = format!(
        "gpu_medic_task_gpu_sm_percent{{task=\"{t1}\",family=\"\",revision=\"\",container=\"{}\",gpu=\"1\"",
        docker(1)
    );
    let limit = series.replace("sm_percent", "sm_limit_percent");
    wait_sync(
        "A's SM use and limit",
        Duration::from_secs(30),
        || {
            let body = scrape(&addr);
            body.lines()
                .any(|l| l.starts_with(&series) && l.ends_with(" 30"))
                && body
                    .lines()
                    .any(|l| l.starts_with(&limit) && l.ends_with(" 75"))
        },
        || scrape(&addr),
    );

    // One session per server listing, apart from the probe's; the clients are listed once
    // per NVML poll at most.
    d.wait_nvml_polls("more polls", 3);
    d.signal(libc::SIGTERM);
    let polls = gpu_medic_testkit::Looks::at(d.path("nvml-polls")).count();
    let sessions = std::fs::read_to_string(bin.join("sessions")).unwrap();
    let probe = "|get_default_active_thread_percentage|get_server_list";
    let mut per_server: std::collections::BTreeMap<String, usize> = Default::default();
    for s in sessions.lines().filter(|s| *s != probe) {
        let one: Vec<&str> = s.trim_start_matches('|').split('|').collect();
        assert_eq!(one.len(), 1, "a listing is a session of its own: {s:?}");
        assert!(one[0].starts_with("get_client_list "), "{s:?}");
        *per_server.entry(one[0].to_string()).or_default() += 1;
    }
    assert_eq!(per_server.len(), 3, "every server listed: {sessions}");
    let most = per_server.values().max().copied().unwrap_or(0);
    assert!(
        most <= polls + 1,
        "{most} listings of a server in {polls} NVML polls: {sessions}"
    );
    s.stop();
    i.stop();
    w.stop();
    dd.stop();
}

/// NVIDIA's real daemon without a GPU runs no server: the view adds no session to its pipe (the
/// daemon's log has the probe's sessions and no other), and an MPS client NVML lists is one
/// that no server of this daemon serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_real_daemon_without_a_server_adds_no_session() {
    let dir = tempfile::Builder::new()
        .prefix("gm-mr-")
        .tempdir_in("/tmp")
        .unwrap();
    let mps = MpsDir::new(dir.path().join("m"));
    mps.start().expect("nvidia-cuda-mps-control -d");
    let client = Sleepers::start(1);
    let pid = client.pids()[0];
    let cfg = config(dir.path(), Path::new(MPS_BIN), &mps.pipe, &mps.log, port());
    let mut d = Daemon::in_temp(dir, &cfg);
    d.gpus(FOUR_GPUS);
    d.inject(&format!(r#"{{"gpu": 0, "mps_clients": [{pid}]}}"#));
    d.start();
    let found = d.wait_record(
        "the client no server serves",
        Duration::from_secs(60),
        "opened",
        |r| r["rule"] == "mps-client-no-server",
    );
    assert_eq!(found["observation"]["pids"], serde_json::json!([pid]));
    assert!(
        found["observation"]["detail"]
            .as_str()
            .unwrap()
            .contains("it runs no server"),
        "{found:#}"
    );
    let out = d.cli(&["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("GPU 0 (")
            && text.contains(&format!("no server of this daemon: client {pid}")),
        "{text}"
    );
    d.signal(libc::SIGTERM);
    let control_log = std::fs::read_to_string(mps.log.join("control.log")).unwrap();
    assert!(
        control_log.matches("Cmd:get_server_list").count() >= 2,
        "{control_log}"
    );
    assert!(!control_log.contains("get_client_list"), "{control_log}");
    mps.shutdown();
}
