//! The MPS daemon's lines read from the systemd journal (`[mps] logs = "journald"`), as on the
//! ECS GPU AMI, whose `nvidia-mps.service` runs the daemon with `-f` (docs/mps.md).
//!
//! Real parts: the lines are NVIDIA's daemon's own stdout under `-f`, captured here with
//! r535 (`tests/fixtures/mps-control-f-crash-loop.log`: `start_server -uid 0` without a GPU,
//! each server exits with status 1); the journal files are written by `systemd-journal-remote`
//! and read by the real `journalctl --follow`. The Volta fatal-fault block cannot be produced
//! without a GPU: its lines are the MPS guide's, with the daemon's real line prefix.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::Path;
use std::time::{Duration, Instant};

use gpu_medic::config::{MpsConfig, MpsLogs};
use gpu_medic::model::{Delivery, Resume};
use gpu_medic::model::{Observation, Signal, Timestamp};
use gpu_medic::probe::mps::journald::stream_of;
use gpu_medic::probe::mps::logs::LogWatch;
use gpu_medic_testkit::journald::JournalDir;

const UNIT: &str = "nvidia-mps.service";

fn captured() -> Vec<String> {
    let text = std::fs::read_to_string(
        gpu_medic_testkit::repo().join("tests/fixtures/mps-control-f-crash-loop.log"),
    )
    .expect("fixture");
    text.lines().map(str::to_string).collect()
}

fn cfg(dir: &Path) -> MpsConfig {
    MpsConfig {
        logs: MpsLogs::Journald,
        journal_directory: Some(dir.to_path_buf()),
        unit: UNIT.into(),
        ..MpsConfig::default()
    }
}

/// The cursor of the journal's last entry, as gpu-medic would have saved it.
fn last_cursor(dir: &Path) -> String {
    let out = std::process::Command::new("journalctl")
        .args(["--output=json", "--lines=1", "--no-pager", "--directory"])
        .arg(dir)
        .output()
        .expect("journalctl");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    v["__CURSOR"].as_str().expect("cursor").to_string()
}

/// What the supervisor hands the MPS source after `cursor` was journaled.
fn delivery_after(cursor: &str) -> Resume {
    let mut d = Delivery::default();
    d.advance_cursor(
        &gpu_medic::model::Cursor {
            stream: stream_of(UNIT),
            pos: 1,
            token: Some(cursor.to_string()),
            ahead: false,
        },
        Timestamp::now(),
    );
    Resume::new(d)
}

/// A server no test's lines name: its exit, written after the lines a test waits for, is
/// read after them (`journalctl` hands entries over in order).
const MARKER: u32 = 99_999;

/// Polls until `want` observations arrived (or 15 s); then writes a marker entry (the exit
/// of server [`MARKER`], under daemon `pid`) and polls until it is read: anything the journal
/// gave after the wanted entries (extras, a replay) has been read by then. The marker's
/// observations are left out.
async fn poll_for(w: &mut LogWatch, j: &mut JournalDir, pid: u32, want: usize) -> Vec<Observation> {
    let mut got = Vec::new();
    let end = Instant::now() + Duration::from_secs(15);
    while got.len() < want && Instant::now() < end {
        got.extend(w.poll());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let marker =
        format!("[2026-11-30 23:59:59.000 Control {pid:>5}] Server {MARKER} exited with status 1");
    j.append(UNIT, pid, &[&marker]);
    let is_marker = |o: &Observation| {
        o.detail
            .as_deref()
            .is_some_and(|d| d.contains(&format!("server {MARKER} exited")))
    };
    let end = Instant::now() + Duration::from_secs(30);
    while !got.iter().any(is_marker) {
        assert!(Instant::now() < end, "the marker was never read: {got:#?}");
        got.extend(w.poll());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    got.retain(|o| !is_marker(o));
    got
}

fn crashes_in(obs: &[Observation]) -> Vec<&Observation> {
    obs.iter()
        .filter(|o| o.signal == Signal::MpsCrash)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_from_the_journal_resume_after_their_cursor_without_replay_or_loss() {
    let lines = captured();
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    // The daemon's start-up lines are in the journal before gpu-medic's saved cursor.
    let split = refs
        .iter()
        .position(|l| l.contains("Server 25677 exited"))
        .expect("second exit");
    let mut j = JournalDir::new();
    j.append(UNIT, 25654, &refs[..3]);
    let start = last_cursor(j.path());
    let mut w = LogWatch::for_config(&cfg(j.path()));
    w.resume_from(&delivery_after(&start));
    // The rest arrives while gpu-medic follows: four servers exit with status 1.
    j.append(UNIT, 25654, &refs[3..]);
    let got = poll_for(&mut w, &mut j, 25654, 4).await;
    let crashes = crashes_in(&got);
    let pids = [25663, 25677, 25687, 25702];
    assert_eq!(crashes.len(), 4, "one crash per failed server: {got:#?}");
    for (c, pid) in crashes.iter().zip(pids) {
        let detail = c.detail.as_deref().unwrap_or("");
        assert!(detail.contains(&format!("server {pid} exited")), "{detail}");
        assert_eq!(c.source, "mps");
    }
    let c = crashes[3]
        .cursor
        .clone()
        .expect("a crash carries its journal cursor");
    assert_eq!(c.stream, stream_of(UNIT));
    let token = c.token.expect("a journald cursor");
    assert!(token.contains("i="), "{token}");
    drop(w);
    assert!(split > 3);

    // gpu-medic is down; the daemon goes on failing. The exit written meanwhile is read after
    // the restart (not lost), and nothing up to the journaled cursor is read again.
    j.append(
        UNIT,
        25654,
        &["[2026-11-30 12:35:34.119 Control 25654] Server 25720 exited with status 1"],
    );
    let mut w = LogWatch::for_config(&cfg(j.path()));
    w.resume_from(&delivery_after(&token));
    j.append(
        UNIT,
        25654,
        &[
            "[2026-11-30 12:35:34.519 Control 25654] Server 25731 exited with status 1",
            "[2026-11-30 12:35:34.919 Control 25654] Server 25742 exited with status 1",
        ],
    );
    let got = poll_for(&mut w, &mut j, 25654, 3).await;
    let crashes = crashes_in(&got);
    let details: Vec<&str> = crashes
        .iter()
        .map(|c| c.detail.as_deref().unwrap_or(""))
        .collect();
    assert_eq!(
        crashes.len(),
        3,
        "the exit written while down counts, earlier ones are not replayed: {details:#?}"
    );
    for (d, pid) in details.iter().zip([25720, 25731, 25742]) {
        assert!(d.contains(&format!("server {pid} exited")), "{d}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fault_block_in_the_journal_names_devices_and_sticky_clients() {
    let mut j = JournalDir::new();
    j.append(UNIT, 73, &["[2026-11-30 12:00:00.000 Control    73] Starting control daemon using socket /run/mps-ecs/control"]);
    let start = last_cursor(j.path());
    let mut w = LogWatch::for_config(&cfg(j.path()));
    w.resume_from(&delivery_after(&start));
    let block = [
        "[2026-11-30 12:00:01.000 Server    95] Volta MPS: status of client {11661, 1} is ACTIVE",
        "[2026-11-30 12:00:01.001 Server    95] Volta MPS: Server is handling a fatal GPU error.",
        "[2026-11-30 12:00:01.002 Server    95] Volta MPS: The following devices",
        "[2026-11-30 12:00:01.003 Server    95] 0",
        "[2026-11-30 12:00:01.004 Server    95] 1",
        "[2026-11-30 12:00:01.005 Server    95] Volta MPS: The following clients have a sticky error set:",
        "[2026-11-30 12:00:01.006 Server    95] 11641",
        "[2026-11-30 12:00:01.007 Server    95] 11643",
        "[2026-11-30 12:00:01.008 Server    95] Client {11641, 1} exit",
    ];
    j.append(UNIT, 73, &block);
    let got = poll_for(&mut w, &mut j, 73, 2).await;
    let faults: Vec<&Observation> = got
        .iter()
        .filter(|o| o.signal == Signal::MpsServerFault)
        .collect();
    assert_eq!(faults.len(), 2, "{got:#?}");
    for (f, dev) in faults.iter().zip([0u32, 1]) {
        assert_eq!(f.gpu.as_ref().map(|g| g.index), Some(dev));
        assert_eq!(f.pids, vec![11641, 11643]);
    }
    assert!(
        faults[1]
            .cursor
            .as_ref()
            .and_then(|c| c.token.as_ref())
            .is_some()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journalctl_that_cannot_run_is_one_self_fault_not_a_daemon_fault() {
    let j = JournalDir::new();
    let mut w =
        LogWatch::for_config(&cfg(j.path())).with_journalctl(Path::new("/nonexistent/journalctl"));
    let mut got = w.poll();
    got.extend(w.poll());
    assert_eq!(got.len(), 1, "{got:#?}");
    assert!(
        matches!(&got[0].signal, Signal::SelfFault { component } if component == "mps-journal")
    );
}
