//! DCGM's documents through the real `gpu-medic diagnose` binary (docs/diagnose.md, "How a
//! document is read"): every fixture in tests/fixtures/dcgm, DCGM's own test documents and
//! public captures among them (their sources in tests/fixtures/dcgm/README.md), replayed byte
//! for byte by a stand-in `dcgmi` with the exit code the capture had, and read per GPU of the
//! fake libnvidia-ml's four; DCGM's own 4.x schema applied to the 4.x fixtures and to the
//! documents the tests build; and the MPS daemon around DCGM's run (NVIDIA's real daemon,
//! Debian's `nvidia-cuda-mps`, which runs without a GPU).
//!
//! A double only for what cannot run here: DCGM on a GPU.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use gpu_medic_testkit::bin;
use gpu_medic_testkit::dcgm::{self, Schema};
use gpu_medic_testkit::mps::{MPS_BIN, MPS_PROBE, MpsDir};
use serde_json::Value;

/// One fixture as the tests read it: the exit code dcgmi had, the GPUs asked (`--gpu`; none:
/// every GPU NVML lists, four), the diagnosis' result and cause, each GPU's result, and words
/// the tier or the summary must say.
struct Case {
    file: &'static str,
    exit: i32,
    asked: &'static [u32],
    result: &'static str,
    cause: Option<&'static str>,
    gpus: &'static [(u32, &'static str)],
    says: &'static str,
}

const ALL_FOUR: &[u32] = &[];

const CASES: &[Case] = &[
    Case {
        file: "dcgm4-pass.json",
        exit: 0,
        asked: &[0, 1],
        result: "pass",
        cause: None,
        gpus: &[(0, "pass"), (1, "pass")],
        says: "passed on 2 GPU(s) by dcgm",
    },
    // The same document with four GPUs present: a pass counts only for the GPU it names.
    Case {
        file: "dcgm4-pass.json",
        exit: 0,
        asked: ALL_FOUR,
        result: "unknown",
        cause: Some("missing-gpu"),
        gpus: &[(0, "pass"), (1, "pass"), (2, "unknown"), (3, "unknown")],
        says: "no DCGM result names GPU 2 (DCGM's results name GPU 0, 1)",
    },
    Case {
        file: "dcgm4-fail-gpu1.json",
        exit: 205,
        asked: &[0, 1],
        result: "fail",
        cause: None,
        gpus: &[(0, "pass"), (1, "fail")],
        says: "failed dcgm memory: Found 3 faulty memory elements on GPU 1 (DCGM error 52)",
    },
    Case {
        file: "dcgm4-warn.json",
        exit: 0,
        asked: &[0, 1],
        result: "pass",
        cause: None,
        gpus: &[(0, "pass"), (1, "pass")],
        says: "passed on 2 GPU(s)",
    },
    Case {
        file: "dcgm4-runtime-error.json",
        exit: 217,
        asked: &[0, 1],
        result: "unknown",
        cause: Some("runtime-error"),
        gpus: &[(0, "unknown"), (1, "unknown")],
        says: "could not complete the diagnostic",
    },
    Case {
        file: "dcgm4-config-persistence.json",
        exit: 226,
        asked: &[0, 1],
        result: "config",
        cause: None,
        gpus: &[(0, "config"), (1, "config")],
        says: "needs configuration (not a hardware fault): GPU 0 dcgm software: Persistence Mode: Persistence mode for GPU 0 is disabled",
    },
    Case {
        file: "dcgm4-busy-mps.json",
        exit: 226,
        asked: &[0, 1],
        result: "unknown",
        cause: Some("gpu-busy"),
        gpus: &[(0, "unknown"), (1, "unknown")],
        says: "GPU busy (an MPS server or another process holds it): GPU 0 memory",
    },
    Case {
        file: "dcgm4-unreadable-ids.json",
        exit: 205,
        asked: &[0, 1],
        result: "unknown",
        cause: Some("entity"),
        gpus: &[(0, "pass"), (1, "pass")],
        says: "\"GPU-abc\" is not a GPU id",
    },
    Case {
        file: "dcgm4-issue215-diagnostic.json",
        exit: 0,
        asked: ALL_FOUR,
        result: "pass",
        cause: None,
        gpus: &[(0, "pass"), (1, "pass"), (2, "pass"), (3, "pass")],
        says: "passed on 4 GPU(s) by dcgm",
    },
    Case {
        file: "dcgm3-pass.json",
        exit: 0,
        asked: &[0, 1],
        result: "pass",
        cause: None,
        gpus: &[(0, "pass"), (1, "pass")],
        says: "passed on 2 GPU(s)",
    },
    Case {
        file: "dcgm3-fail-gpu0.json",
        exit: 205,
        asked: &[0, 1],
        result: "fail",
        cause: None,
        gpus: &[(0, "fail"), (1, "pass")],
        says: "Detected 2 volatile double-bit ECC error(s) in GPU 0.",
    },
    Case {
        file: "dcgm3-warn.json",
        exit: 0,
        asked: &[0, 1],
        result: "pass",
        cause: None,
        gpus: &[(0, "pass"), (1, "pass")],
        says: "passed on 2 GPU(s)",
    },
    Case {
        file: "dcgm3-config-persistence.json",
        exit: 226,
        asked: &[0, 1],
        result: "config",
        cause: None,
        gpus: &[(0, "config"), (1, "pass")],
        says: "Persistence mode for GPU 0 is disabled",
    },
    Case {
        file: "dcgm3-unreadable-ids.json",
        exit: 205,
        asked: &[0, 1],
        result: "unknown",
        cause: Some("entity"),
        gpus: &[(0, "pass"), (1, "pass")],
        says: "id -1 is negative",
    },
    Case {
        file: "dcgm3-nvvs-3.1.0-real-output.out",
        exit: 0,
        asked: ALL_FOUR,
        result: "pass",
        cause: None,
        gpus: &[(0, "pass"), (1, "pass"), (2, "pass"), (3, "pass")],
        says: "passed on 4 GPU(s) by dcgm",
    },
    Case {
        file: "dcgm3-nvvs-per-gpu-stress-fail.json",
        exit: 226,
        asked: ALL_FOUR,
        result: "fail",
        cause: None,
        gpus: &[(0, "fail"), (1, "pass"), (2, "fail"), (3, "fail")],
        says: "Max stress level of 2128.7 did not exceed desired stress level of 3000.0 for GPU 0",
    },
    Case {
        file: "dcgm3-nvvs-persistence-mode.json",
        exit: 226,
        asked: ALL_FOUR,
        result: "config",
        cause: None,
        gpus: &[(0, "config"), (1, "config"), (2, "config"), (3, "config")],
        says: "Persistence mode for GPU 1 is currently disabled",
    },
];

/// The 4.x fixtures DCGM's schema is applied to, and where each breaks it (none: follows it).
const SCHEMA: &[(&str, Option<&str>)] = &[
    ("dcgm4-pass.json", None),
    ("dcgm4-fail-gpu1.json", None),
    ("dcgm4-warn.json", None),
    ("dcgm4-runtime-error.json", None),
    ("dcgm4-config-persistence.json", None),
    ("dcgm4-busy-mps.json", None),
    ("dcgm4-issue215-diagnostic.json", None),
    (
        "dcgm4-unreadable-ids.json",
        Some(
            "/DCGM Diagnostic/test_categories/0/tests/0/results/2/entity_id: expected integer, found \"GPU-abc\"",
        ),
    ),
];

/// Files in tests/fixtures/dcgm that are no `dcgmi` output.
const NOT_OUTPUT: [&str; 2] = ["README.md", "dcgm_diag_schema.json"];

/// A node: a temp dir with `config.toml` (the fake NVML's four GPUs, AWS off, the CUDA tier
/// off, `mps` its `[mps]` lines) and the stand-in `dcgmi` in it.
struct Node {
    dir: tempfile::TempDir,
}

impl Node {
    fn new(mps: &str) -> Node {
        let dir = tempfile::tempdir().unwrap();
        let dcgmi = dir.path().join("dcgmi");
        gpu_medic_testkit::diagnose_node(
            dir.path(),
            mps,
            &format!(
                "dcgmi = \"{}\"\ndcgm_host = \"\"\ncuda_library = \"\"\ntimeout = \"20s\"",
                dcgmi.display()
            ),
        );
        Node { dir }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// `gpu-medic diagnose --json <args>`: its exit code, the diagnosis, the whole output.
    fn diagnose(&self, args: &[&str]) -> (i32, Value, String) {
        let out = Command::new(bin())
            .arg("diagnose")
            .arg("--json")
            .args(args)
            .arg("--config")
            .arg(self.path("config.toml"))
            .env_remove("GPU_MEDIC_CONFIG")
            .env_remove("FAKE_NVML_CONFIG")
            .env_remove("FAKE_NVML_INIT_ERROR")
            .output()
            .unwrap();
        let shown = show(&out);
        assert!(!shown.contains("panicked"), "{shown}");
        let d = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {shown}"));
        (out.status.code().unwrap_or(-1), d, shown)
    }
}

fn show(out: &Output) -> String {
    format!(
        "{}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn fixture(name: &str) -> PathBuf {
    dcgm::fixtures().join(name)
}

fn tier<'a>(d: &'a Value, name: &str) -> &'a Value {
    d["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == name)
        .unwrap_or_else(|| panic!("no tier {name} in {d:#}"))
}

fn exit_for(result: &str) -> i32 {
    match result {
        "pass" => 0,
        "fail" => 1,
        "unknown" => 2,
        "config" => 3,
        other => panic!("{other}"),
    }
}

#[test]
fn every_fixture_is_read_per_gpu_through_the_binary() {
    for c in CASES {
        let n = Node::new("[mps]\nenabled = false");
        dcgm::replay(n.dir.path(), &fixture(c.file), c.exit);
        let gpus: Vec<String> = c.asked.iter().map(u32::to_string).collect();
        let args: Vec<&str> = gpus.iter().flat_map(|g| ["--gpu", g.as_str()]).collect();
        let (code, d, shown) = n.diagnose(&args);
        let at = format!("{} (exit {}): {shown}", c.file, c.exit);
        assert_eq!(code, exit_for(c.result), "{at}");
        assert_eq!(d["result"], c.result, "{at}");
        assert_eq!(d["cause"].as_str(), c.cause, "{at}");
        let listed: Vec<(u64, String)> = d["gpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|g| {
                (
                    g["index"].as_u64().unwrap(),
                    g["result"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        let want: Vec<(u64, String)> = c
            .gpus
            .iter()
            .map(|(i, r)| (u64::from(*i), (*r).to_string()))
            .collect();
        assert_eq!(listed, want, "{at}");
        let t = tier(&d, "dcgm");
        let words = format!(
            "{} {} {}",
            d["summary"].as_str().unwrap(),
            t["why"].as_str().unwrap_or(""),
            t["notes"]
                .as_array()
                .map(|n| n
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(" "))
                .unwrap_or_default()
        );
        assert!(
            words.contains(c.says),
            "{}: no {:?} in {words}",
            c.file,
            c.says
        );
        // dcgmi ran once, asked for the GPUs asked.
        let calls = dcgm::calls(n.dir.path());
        assert_eq!(calls.len(), 1, "{at}");
        let ids = if c.asked.is_empty() {
            "0,1,2,3".to_string()
        } else {
            gpus.join(",")
        };
        assert_eq!(calls[0], format!("diag -r 1 -j -i {ids}"), "{at}");
        // Could not tell always says what it could not read.
        if c.result == "unknown" {
            assert!(
                !tier(&d, "dcgm")["why"].as_str().unwrap_or("").is_empty(),
                "{at}"
            );
        }
    }
}

#[test]
fn the_text_names_the_cause_of_a_diagnosis_that_could_not_tell() {
    let n = Node::new("[mps]\nenabled = false");
    dcgm::replay(n.dir.path(), &fixture("dcgm4-unreadable-ids.json"), 205);
    let out = Command::new(bin())
        .args(["diagnose", "--gpu", "0", "--gpu", "1", "--config"])
        .arg(n.path("config.toml"))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(text.contains("  dcgm  unknown [entity] ("), "{text}");
    assert!(
        text.contains("could not tell (entity): this is not a pass"),
        "{text}"
    );
    assert!(text.contains("\"GPU-abc\" is not a GPU id"), "{text}");
    assert!(text.contains("entity_group \"CPU\""), "{text}");
}

#[test]
fn the_stand_in_replays_each_capture_byte_for_byte() {
    let mut seen = std::collections::BTreeSet::new();
    for c in CASES {
        if !seen.insert(c.file) {
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        let dcgmi = dcgm::replay(dir.path(), &fixture(c.file), c.exit);
        let out = Command::new(&dcgmi)
            .args(["diag", "-r", "1", "-j"])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(c.exit), "{}", c.file);
        assert_eq!(
            out.stdout,
            std::fs::read(fixture(c.file)).unwrap(),
            "{}",
            c.file
        );
    }
    // Text before the document is kept as dcgmi printed it.
    let real = std::fs::read_to_string(fixture("dcgm3-nvvs-3.1.0-real-output.out")).unwrap();
    assert!(
        real.starts_with("\n\tWARNING: THIS SHOULD NOT HAPPEN\n\t{"),
        "{real:?}"
    );
}

#[test]
fn every_fixture_is_read_in_a_test_and_has_its_source() {
    let readme = std::fs::read_to_string(fixture("README.md")).unwrap();
    let mut files: Vec<String> = std::fs::read_dir(dcgm::fixtures())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|f| !NOT_OUTPUT.contains(&f.as_str()))
        .collect();
    files.sort();
    assert_eq!(files.len(), 16, "{files:?}");
    for f in &files {
        assert!(CASES.iter().any(|c| c.file == f), "{f} is read by no case");
        assert!(
            readme.contains(&format!("`{f}`")),
            "{f} has no source in the README"
        );
        if f.starts_with("dcgm4-") {
            assert!(SCHEMA.iter().any(|(s, _)| s == f), "{f}: no schema check");
        }
    }
    assert!(readme.contains("`dcgm_diag_schema.json`"));
}

fn document_of(bytes: &[u8]) -> Value {
    match gpu_medic::diagnose::dcgm::find_document(bytes) {
        gpu_medic::diagnose::dcgm::Found::Document(d) => d,
        other => panic!("no document: {other:?}"),
    }
}

#[test]
fn the_4x_documents_follow_dcgms_schema_or_say_where_they_break_it() {
    let schema = Schema::dcgm_diag();
    for (file, breaks) in SCHEMA {
        let doc = document_of(&std::fs::read(fixture(file)).unwrap());
        let found = schema.violations(&doc);
        match breaks {
            None => assert!(found.is_empty(), "{file}: {found:#?}"),
            Some(at) => assert!(
                found.iter().any(|v| v == at),
                "{file}: {at} not among {found:#?}"
            ),
        }
    }
    // The documents the tests build.
    for failing in [None, Some(1)] {
        let doc = document_of(dcgm::document(4, failing).as_bytes());
        assert_eq!(schema.violations(&doc), Vec::<String>::new(), "{failing:?}");
    }
    // The validator reads the schema: what it requires, and the types it gives.
    let v = |doc: Value| schema.violations(&doc);
    assert_eq!(
        v(serde_json::json!({"metadata": {}})),
        [
            "/DCGM Diagnostic: required, missing",
            "/metadata/version: required, missing"
        ]
    );
    assert_eq!(
        v(
            serde_json::json!({"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
                {"name": "memory", "results": [{"entity_group": "GPU", "entity_group_id": "1", "entity_id": 0}]}
            ]}]}})
        ),
        [
            "/DCGM Diagnostic/test_categories/0/tests/0/test_summary: required, missing",
            "/DCGM Diagnostic/test_categories/0/tests/0/results/0/status: required, missing",
            "/DCGM Diagnostic/test_categories/0/tests/0/results/0/entity_group_id: expected integer, found \"1\"",
        ]
    );
}

/// `[mps]` for a daemon gpu-medic runs directly in `m`'s pipe and log directories.
fn mps_lines(m: &MpsDir) -> String {
    format!(
        "[mps]\nenabled = true\nmanage = \"direct\"\ncontrol_binary = \"{MPS_BIN}\"\npipe_directory = \"{}\"\nlog_directory = \"{}\"\nstart_timeout = \"10s\"\nquit_timeout = \"2s\"",
        m.pipe.display(),
        m.log.display()
    )
}

/// A stand-in `dcgmi` that writes to `dir/mps-during` whether the MPS daemon of `m`
/// answered while it ran, then replays `dcgm4-pass.json` for GPUs 0 and 1.
fn dcgmi_looking_at_mps(dir: &Path, m: &MpsDir) -> PathBuf {
    let path = dir.join("dcgmi");
    let body = format!(
        "#!/bin/sh\nprintf '%s\\n' \"$*\" >> '{calls}'\n\
         if echo {MPS_PROBE} | CUDA_MPS_PIPE_DIRECTORY='{pipe}' timeout 3 {MPS_BIN} >/dev/null 2>&1; then echo up > '{during}'; else echo down > '{during}'; fi\n\
         cat '{doc}'\n",
        calls = dir.join("calls").display(),
        pipe = m.pipe.display(),
        during = dir.join("mps-during").display(),
        doc = fixture("dcgm4-pass.json").display(),
    );
    std::fs::write(&path, body).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    path
}

#[test]
fn while_mps_is_up_dcgm_does_not_run_unless_the_node_is_drained() {
    let root = tempfile::tempdir().unwrap();
    let m = MpsDir::new(root.path().to_path_buf());
    let first = m.start().unwrap();
    let n = Node::new(&mps_lines(&m));
    dcgmi_looking_at_mps(n.dir.path(), &m);

    // By hand: the daemon is left alone and DCGM does not run ("MPS up"), never a pass.
    let (code, d, shown) = n.diagnose(&["--gpu", "0", "--gpu", "1"]);
    assert_eq!(code, 2, "{shown}");
    assert_eq!(d["cause"], "mps", "{shown}");
    let t = tier(&d, "dcgm");
    assert_eq!(t["ran"], false, "{shown}");
    let why = t["why"].as_str().unwrap();
    assert!(
        why.starts_with("MPS up: the MPS control daemon (pid ["),
        "{why}"
    );
    assert!(why.contains("--stop-mps"), "{why}");
    assert!(
        dcgm::calls(n.dir.path()).is_empty(),
        "dcgmi ran while MPS was up"
    );
    assert_eq!(m.daemon(), Some(first), "the daemon was left alone");

    // On a drained node: stopped for DCGM's run, started again after, and said so.
    let (code, d, shown) = n.diagnose(&["--gpu", "0", "--gpu", "1", "--stop-mps"]);
    assert_eq!(code, 0, "{shown}");
    assert_eq!(d["result"], "pass", "{shown}");
    assert_eq!(
        std::fs::read_to_string(n.path("mps-during"))
            .unwrap()
            .trim(),
        "down",
        "the MPS daemon answered while DCGM ran"
    );
    let notes: Vec<&str> = tier(&d, "dcgm")["notes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert!(
        notes[0].contains("was stopped for DCGM's run")
            && notes[0].contains(&format!("pid {first}")),
        "{notes:#?}"
    );
    assert!(
        notes
            .iter()
            .any(|n| n.starts_with("the MPS daemon was started again after DCGM's run")),
        "{notes:#?}"
    );
    let again = m.daemon().expect("the daemon was not started again");
    assert_ne!(again, first);
    assert!(m.answer(MPS_PROBE, Duration::from_secs(3)).is_some());

    // Where gpu-medic does not manage MPS, DCGM runs while the daemon is up, and its answer
    // that the GPUs are busy could not tell: never a failure, the daemon left alone.
    let n = Node::new("[mps]\nenabled = false");
    dcgm::replay(n.dir.path(), &fixture("dcgm4-busy-mps.json"), 226);
    let (code, d, shown) = n.diagnose(&["--gpu", "0", "--gpu", "1"]);
    assert_eq!(code, 2, "{shown}");
    assert_eq!(d["cause"], "gpu-busy", "{shown}");
    assert!(
        d["summary"]
            .as_str()
            .unwrap()
            .contains("GPU busy (an MPS server or another process holds it): GPU 0 memory"),
        "{shown}"
    );
    assert_eq!(m.daemon(), Some(again), "the daemon was left alone");
    m.shutdown();
}
