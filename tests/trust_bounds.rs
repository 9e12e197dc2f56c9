//! Trust bounds through the real `gpu-medic run` on the fake libnvidia-ml:
//! - gpu-medic's files are private whatever umask it is started with (the packaged unit says
//!   `UMask=0077`; a shell's is often 0022): started under umask 0022 over a state directory an
//!   older run left 0755 with a 0644 file in it, every folder under `state_dir` is 0700 and
//!   every file 0600 once it runs and has journaled an incident;
//! - start-up is bounded: a 2 GiB `inputs.jsonl` of one line (a sparse file) neither delays
//!   the start nor keeps SIGTERM from being answered.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use gpu_medic_testkit::{Daemon, wait_sync};

fn loose(dir: &Path, out: &mut Vec<String>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let m = std::fs::symlink_metadata(&p).unwrap();
        let mode = m.permissions().mode() & 0o777;
        if m.is_dir() {
            if mode & 0o077 != 0 {
                out.push(format!("{} {mode:o}", p.display()));
            }
            loose(&p, out);
        } else if m.is_file() && mode & 0o077 != 0 {
            out.push(format!("{} {mode:o}", p.display()));
        }
    }
}

#[test]
fn state_files_are_private_under_a_loose_umask() {
    // SAFETY: umask(2) has no preconditions; the daemon started below inherits it.
    unsafe {
        libc::umask(0o022);
    }
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    let state = d.path("state");
    std::fs::create_dir_all(&state).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(state.join("old-notes.txt"), "left by an older run").unwrap();
    std::fs::set_permissions(
        state.join("old-notes.txt"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    d.start();
    d.wait_polled();
    d.inject(r#"{"gpu": 1, "xid": 13}"#);
    wait_sync(
        "an incident journaled",
        Duration::from_secs(20),
        || !d.records().is_empty(),
        || d.log(),
    );
    d.stop(Duration::from_secs(10));
    let mode = std::fs::metadata(&state).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "state_dir {mode:o}");
    let mut bad = Vec::new();
    loose(&state, &mut bad);
    assert!(bad.is_empty(), "readable by others: {bad:#?}");
    assert!(state.join("incidents.jsonl").is_file() && state.join("state.json").is_file());
}

/// A 2 GiB `inputs.jsonl` with no line end: the start reads its last 64 MiB only and is
/// quick; a SIGTERM sent as it starts is answered.
#[test]
fn a_two_gigabyte_input_journal_neither_delays_the_start_nor_swallows_sigterm() {
    let make = |d: &Daemon| {
        let state = d.path("state");
        std::fs::create_dir_all(&state).unwrap();
        let f = std::fs::File::create(state.join("inputs.jsonl")).unwrap();
        f.set_len(2 << 30).unwrap();
    };
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    make(&d);
    let t = Instant::now();
    d.start();
    d.wait_polled();
    let took = t.elapsed();
    assert!(took < Duration::from_secs(5), "start took {took:?}");
    d.stop(Duration::from_secs(10));

    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    make(&d);
    d.spawn();
    // SIGTERM once the start has begun on the journal (it holds `inputs.jsonl` open; its
    // signal handlers are installed before that), or is over already.
    let pid = d.pid().unwrap();
    let journal = d.path("state/inputs.jsonl");
    let reading = || {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|fds| {
                fds.flatten()
                    .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|p| p == journal))
            })
            .unwrap_or(false)
    };
    wait_sync(
        "the start to open the journal",
        Duration::from_secs(30),
        || reading() || d.path("state/state.json").exists(),
        || d.log(),
    );
    let t = Instant::now();
    let status = d.stop(Duration::from_secs(10));
    let took = t.elapsed();
    assert!(
        status.is_some() && took < Duration::from_secs(5),
        "SIGTERM answered after {took:?}: {status:?}\n{}",
        d.log()
    );
}

fn policy_check(path: &Path) -> (Option<i32>, String, Duration) {
    let t = Instant::now();
    let out = std::process::Command::new(gpu_medic_testkit::bin())
        .args(["policy", "check"])
        .arg(path)
        .output()
        .unwrap();
    (
        out.status.code(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        t.elapsed(),
    )
}

/// Policies check in linear time: 2,000 rules (threshold rules on one signal, XID rules each
/// with its own code) and a 1 MiB policy are checked in seconds, not tens of them; a
/// refusal in `[mps]` names its line.
#[test]
fn policies_check_in_linear_time_and_refusals_name_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = String::from("version = 1\n");
    for i in 0..1000u32 {
        text.push_str(&format!(
            "[[rule]]\nname = \"hot-{i}\"\nsignal = \"thermal\"\nthreshold = {}\naction = \"log\"\nreason = \"r\"\n\n",
            1000 + i
        ));
    }
    for i in 0..1000u32 {
        text.push_str(&format!(
            "[[rule]]\nname = \"x-{i}\"\nsignal = \"xid\"\nxids = [{}]\naction = \"log\"\nreason = \"r\"\n\n",
            100_000 + i
        ));
    }
    let many = dir.path().join("many.toml");
    std::fs::write(&many, &text).unwrap();
    let (code, out, took) = policy_check(&many);
    assert!(
        took < Duration::from_secs(5),
        "2,000 rules took {took:?}: {out}"
    );
    assert!(code.is_some(), "{out}");

    let mut big = String::from("version = 1\n");
    let reason = "r".repeat(2000);
    let mut i = 0;
    while big.len() < 1_000_000 {
        big.push_str(&format!(
            "[[rule]]\nname = \"warm-{i}\"\nsignal = \"thermal\"\nthreshold = {}\naction = \"log\"\nreason = \"{reason}\"\n\n",
            5000 + i
        ));
        i += 1;
    }
    let p = dir.path().join("big.toml");
    std::fs::write(&p, &big).unwrap();
    let (code, out, took) = policy_check(&p);
    assert!(
        took < Duration::from_secs(5),
        "a 1 MiB policy took {took:?}: {out}"
    );
    assert!(code.is_some(), "{out}");

    let p = dir.path().join("mps.toml");
    std::fs::write(
        &p,
        format!(
            "version = 1\nextends = \"{}\"\n\n[mps]\non_failed = \"restart-mps\"\n",
            gpu_medic_testkit::default_policy().display()
        ),
    )
    .unwrap();
    let (code, out, _) = policy_check(&p);
    assert_eq!(code, Some(78), "{out}");
    assert!(out.contains(&format!("{}:5:", p.display())), "{out}");
}
