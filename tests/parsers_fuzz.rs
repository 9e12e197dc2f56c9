//! Property tests of every parser that reads something gpu-medic did not write itself, or
//! that a crash or a person may have mangled (issue 13): the kernel-log line, the MPS log
//! line and fault block, the MPS control reply, the config, the policy, the state file, the
//! journal and `policy simulate`'s input. Each gets arbitrary bytes and mutations of a valid
//! input; none may panic, and what each returns is bounded by what it was given. Case counts
//! keep the whole file within seconds (CI runs it with the rest).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::io::Write;
use std::path::Path;

use proptest::prelude::*;

use gpu_medic::engine::{self, State};
use gpu_medic::journal::{self, CappedLine, Entry};
use gpu_medic::model::{Record, StampedInput};

/// The shipped policy, loaded once.
fn default_policy() -> &'static gpu_medic::policy::Policy {
    static P: std::sync::OnceLock<gpu_medic::policy::Policy> = std::sync::OnceLock::new();
    P.get_or_init(|| {
        gpu_medic::config::load_policy(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/default.toml"),
        )
        .unwrap()
    })
}

fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Bytes that look like text most of the time: printable runs, separators, invalid UTF-8.
fn texty() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        prop_oneof![
            6 => 0x20u8..0x7f,
            1 => Just(b'\n'),
            1 => Just(b','),
            1 => Just(b';'),
            1 => Just(b':'),
            1 => any::<u8>(),
        ],
        0..400,
    )
}

/// A valid input with a few bytes replaced, inserted or cut.
fn mutated(base: &'static str) -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec((any::<usize>(), any::<u8>(), 0u8..3), 0..8).prop_map(move |edits| {
        let mut b = base.as_bytes().to_vec();
        for (at, byte, kind) in edits {
            if b.is_empty() {
                b.push(byte);
                continue;
            }
            let i = at % b.len();
            match kind {
                0 => b[i] = byte,
                1 => b.insert(i, byte),
                _ => b.truncate(i),
            }
        }
        b
    })
}

const KMSG: &str = "4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.";
const MPS_LOG: &str = "[2026-11-30 05:40:29.883 Control 13020] Server 21014 exited with status 1";
const REPLY: &str = "100.0\n4242\n4243\n";
const CONFIG: &str = "state_dir = \"state\"\ntick_interval = \"1s\"\n[nvml]\npoll_interval = \"5s\"\nkmsg = \"\"\n[mps]\nenabled = false\n[journal]\nmax_file_size_mib = 8\nkeep_files = 2\n";
const POLICY: &str = "version = 1\n[[rule]]\nname = \"x\"\nsignal = \"xid\"\nxids = [79]\naction = \"replace\"\nreason = \"r\"\n[[rule]]\nname = \"rest\"\nsignal = \"xid\"\naction = \"log\"\nsilences_fatal = true\nreason = \"r\"\n";
const INPUT: &str = r#"{"seq":3,"at":"2026-11-30T05:00:00.000Z","input":"observation","signal":{"kind":"xid","code":79},"gpu":{"index":0,"uuid":"GPU-0","pci_bus_id":"00000000:10:00.0"},"source":"kmsg","cursor":{"stream":"kmsg:b","pos":7}}"#;
const RECORD: &str = r#"{"at":"2026-11-30T05:00:00.000Z","incident":1,"event":"closed","state":"logged","summary":"s"}"#;

proptest! {
    #![proptest_config(cfg(256))]

    #[test]
    fn kmsg_lines(bytes in prop_oneof![texty(), mutated(KMSG)]) {
        let line = String::from_utf8_lossy(&bytes);
        if let Some(x) = gpu_medic::probe::kmsg::parse_line(&line) {
            prop_assert!(x.text.len() <= line.len());
            prop_assert!(x.pci.len() <= line.len());
        }
    }

    #[test]
    fn mps_log_lines_and_blocks(lines in prop::collection::vec(prop_oneof![texty(), mutated(MPS_LOG)], 0..20)) {
        use gpu_medic::probe::mps::logs::{observe, parse_line, ServerFailures, Parser};
        let mut p = Parser::default();
        let mut events = Vec::new();
        for l in &lines {
            let l = String::from_utf8_lossy(l);
            if let Some(parsed) = parse_line(&l) {
                prop_assert!(parsed.msg.len() <= l.len());
            }
            p.feed(&l, &mut events);
        }
        p.flush(&mut events);
        prop_assert!(events.len() <= lines.len() + 1);
        let _ = observe(events, &mut ServerFailures::default(), &mut Vec::new());
    }

    #[test]
    fn mps_control_replies(bytes in prop_oneof![texty(), mutated(REPLY)]) {
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(a) = gpu_medic::mps::parse_reply(&text) {
            prop_assert!(a.percentage > 0.0 && a.percentage <= 100.0);
            prop_assert!(a.servers.len() + a.noise.len() <= text.lines().count());
            prop_assert!(a.noise.iter().all(|n| n.len() <= 90 * 4));
        }
    }

    #[test]
    fn capped_lines_never_hold_more_than_the_cap(bytes in texty(), cap in 1usize..64) {
        let mut r = std::io::BufReader::with_capacity(7, &bytes[..]);
        let mut buf = Vec::new();
        let mut seen = 0usize;
        while let Some(l) = journal::read_capped_line(&mut r, &mut buf, cap, u64::MAX).unwrap() {
            prop_assert!(buf.len() <= cap);
            match l {
                CappedLine::Text { text, .. } => seen += text.len(),
                CappedLine::TooLong { len } => { prop_assert!(len > cap); seen += len; }
            }
        }
        prop_assert!(seen <= bytes.len() * 3);
    }
}

proptest! {
    #![proptest_config(cfg(64))]

    #[test]
    fn config_files(bytes in prop_oneof![texty(), mutated(CONFIG)]) {
        let text = String::from_utf8_lossy(&bytes);
        let path = Path::new("/fuzz/config.toml");
        match gpu_medic::config::Config::parse(path, &text) {
            // A mistake is a clear error: this file, a line within it (when one is named),
            // and words.
            Err(e) => {
                prop_assert_eq!(e.path.as_path(), path);
                prop_assert!(!e.message.trim().is_empty());
                if let Some(l) = e.line {
                    prop_assert!(l >= 1 && l <= text.lines().count().max(1) + 1, "line {} of {}", l, text.lines().count());
                }
                prop_assert!(e.to_string().starts_with("/fuzz/config.toml"));
            }
            Ok(cfg) => prop_assert!(!cfg.state_dir.as_os_str().is_empty()),
        }
    }

    #[test]
    fn policy_files(bytes in prop_oneof![texty(), mutated(POLICY)]) {
        let text = String::from_utf8_lossy(&bytes);
        if let Ok(p) = gpu_medic::policy::Policy::parse(Path::new("/fuzz/policy.toml"), &text) {
            prop_assert!(p.rules.len() <= text.len());
        }
    }

    #[test]
    fn state_files(bytes in prop_oneof![texty(), mutated(r#"{"next_incident":3,"next_action":1,"node":"in-service","gpus":{},"mps":{"phase":"up","restarts":[],"incident":null},"remediation":null,"gpu_jobs":{},"in_flight":{},"scheduled":[],"sightings":{},"open":{},"delivery":{"applied":9,"cursors":{"kmsg:b":{"pos":7,"at":"2026-11-30T05:00:00.000Z"}}}}"#)]) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.json");
        std::fs::write(&p, &bytes).unwrap();
        let _ = journal::load_state(&p);
        let d = journal::committed_delivery(&p);
        prop_assert!(d.cursors.len() <= bytes.len());
    }

    #[test]
    fn journal_and_simulate_input(lines in prop::collection::vec(prop_oneof![texty(), mutated(INPUT), mutated(RECORD)], 0..12)) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("inputs.jsonl");
        let mut f = std::fs::File::create(&p).unwrap();
        for l in &lines {
            f.write_all(l).unwrap();
            f.write_all(b"\n").unwrap();
        }
        drop(f);
        let total: usize = lines.iter().map(|l| l.len() + 1).sum();
        // The journal reader: every line is an item or a warning, never more.
        let mut n = 0;
        journal::stream_jsonl::<Record>(std::slice::from_ref(&p), None, |_| { n += 1; true }).unwrap();
        prop_assert!(n <= total);
        // `policy simulate`: stepping whatever parses never panics.
        let policy = default_policy();
        let mut state = State::default();
        let capped = journal::stream_jsonl::<StampedInput>(std::slice::from_ref(&p), Some(total as u64 / 2 + 1), |e| {
            if let Entry::Item(s) = e {
                state = engine::step(&state, s.input, s.at, policy).0;
            }
            true
        });
        if total >= 3 {
            // Over the cap: a clear error, not a partial silent read.
            prop_assert!(capped.is_err());
        }
        let (after, _) = journal::inputs_after(&p, 0, 100).unwrap();
        prop_assert!(after.len() <= lines.len());
    }
}

#[test]
fn simulate_input_over_the_cap_is_an_error_naming_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("inputs.jsonl");
    std::fs::write(&p, INPUT.repeat(4) + "\n").unwrap();
    let err = journal::stream_jsonl::<StampedInput>(&[p], Some(64), |_| true).unwrap_err();
    assert!(err.to_string().contains("64 bytes cap"), "{err}");
    // An endless device is refused by its kind before a byte is read.
    let err = journal::stream_jsonl::<StampedInput>(
        &[std::path::PathBuf::from("/dev/zero")],
        Some(1 << 20),
        |_| true,
    )
    .unwrap_err();
    assert!(err.to_string().contains("character device"), "{err}");
    // An endless line through a pipe (which the input may be) stops at the cap.
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid, writable array of two descriptors for the call.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: the write end is ours alone from here on; the File closes it.
    let mut w = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fds[1]) };
    let writer = std::thread::spawn(move || {
        use std::io::Write;
        let zeros = [0u8; 64 * 1024];
        while w.write_all(&zeros).is_ok() {}
    });
    let err = journal::stream_jsonl::<StampedInput>(
        &[std::path::PathBuf::from(format!(
            "/proc/self/fd/{}",
            fds[0]
        ))],
        Some(1 << 20),
        |_| true,
    )
    .unwrap_err();
    assert!(err.to_string().contains("1 MiB cap"), "{err}");
    // SAFETY: the read end is ours; closing it ends the writer (EPIPE).
    unsafe { libc::close(fds[0]) };
    writer.join().unwrap();
}
