//! The DCGM tier's runner (`diagnose::dcgm::run`) against stand-in `dcgmi` scripts that print
//! DCGM 3.x and 4.x documents (tests/fixtures/dcgm) after a line of text, hang, print garbage
//! or far too much, or fail the way dcgmi does without a host engine. Every fixture read per
//! GPU through the real binary, replayed byte for byte: tests/dcgm_documents.rs.
#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpu_medic::diagnose::dcgm::{self, DcgmPlan};
use gpu_medic::model::diagnosis::{
    DiagResult, Diagnosis, GpuDiagnosis, Level, MAX_RAW, TestStatus, TierRun,
};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/dcgm")
        .join(name)
}

/// A stand-in `dcgmi` running `body` (after recording its arguments in `args`).
fn dcgmi(dir: &Path, body: &str) -> PathBuf {
    let path = dir.join("dcgmi");
    let script = format!(
        "#!/bin/sh\nprintf '%s\\n' \"$*\" > '{}'\n{body}\n",
        dir.join("args").display()
    );
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn printing(dir: &Path, fixture_name: &str, exit: i32) -> PathBuf {
    dcgmi(
        dir,
        &format!(
            "echo 'Successfully ran diagnostic for group.'\ncat '{}'\nexit {exit}",
            fixture(fixture_name).display()
        ),
    )
}

fn plan(binary: PathBuf, gpus: Option<Vec<u32>>, timeout: Duration) -> DcgmPlan {
    DcgmPlan {
        binary,
        level: Level::Standard,
        gpus,
        timeout,
        host: None,
    }
}

fn test_on<'a>(
    gpus: &'a [GpuDiagnosis],
    gpu: u32,
    test: &str,
) -> &'a gpu_medic::model::diagnosis::TestResult {
    gpus.iter()
        .find(|g| g.index == gpu)
        .and_then(|g| g.tests.iter().find(|t| t.test == test))
        .unwrap_or_else(|| panic!("no {test} on GPU {gpu}: {gpus:#?}"))
}

fn combined(run: (TierRun, Vec<GpuDiagnosis>)) -> Diagnosis {
    let asked = vec![(0, "GPU-aaaa".to_string()), (1, "GPU-bbbb".to_string())];
    Diagnosis::combine(Level::Standard, &asked, vec![run], 1)
}

#[test]
fn dcgm4_pass() {
    let dir = tempfile::tempdir().unwrap();
    let bin = printing(dir.path(), "dcgm4-pass.json", 0);
    let (run, gpus) = dcgm::run(&plan(bin, Some(vec![0, 1]), Duration::from_secs(30)));
    assert!(run.ran, "{run:?}");
    assert_eq!(run.result, DiagResult::Pass, "{}", run.why);
    assert_eq!(gpus.len(), 2);
    assert!(gpus.iter().all(|g| g.result == DiagResult::Pass));
    assert_eq!(test_on(&gpus, 1, "memory").status, TestStatus::Pass);
    let args = std::fs::read_to_string(dir.path().join("args")).unwrap();
    assert_eq!(args.trim(), "diag -r 2 -j -i 0,1");
    assert!(run.raw.contains("\"DCGM Diagnostic\""));
    let d = combined((run, gpus));
    assert_eq!(d.result, DiagResult::Pass, "{}", d.summary);
}

#[test]
fn dcgm3_pass() {
    let dir = tempfile::tempdir().unwrap();
    let bin = printing(dir.path(), "dcgm3-pass.json", 0);
    let (run, gpus) = dcgm::run(&plan(bin, None, Duration::from_secs(30)));
    assert_eq!(run.result, DiagResult::Pass, "{}", run.why);
    assert_eq!(gpus.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 1]);
    // 3.x dcgmi's Deployment tests name no GPU: they pass none, and are said in the notes.
    assert!(
        gpus.iter()
            .all(|g| !g.tests.iter().any(|t| t.test == "Persistence Mode")),
        "{gpus:#?}"
    );
    assert!(
        run.notes
            .iter()
            .any(|n| n.contains("Persistence Mode pass")),
        "{:?}",
        run.notes
    );
    assert_eq!(test_on(&gpus, 0, "GPU Memory").status, TestStatus::Pass);
    let args = std::fs::read_to_string(dir.path().join("args")).unwrap();
    assert_eq!(args.trim(), "diag -r 2 -j");
}

#[test]
fn dcgm4_fail_on_one_gpu_names_it_even_with_exit_0() {
    let dir = tempfile::tempdir().unwrap();
    for exit in [205, 0] {
        let bin = printing(dir.path(), "dcgm4-fail-gpu1.json", exit);
        let (run, gpus) = dcgm::run(&plan(bin, Some(vec![0, 1]), Duration::from_secs(30)));
        assert!(run.ran);
        assert_eq!(run.result, DiagResult::Fail, "exit {exit}: {}", run.why);
        let t = test_on(&gpus, 1, "memory");
        assert_eq!(t.status, TestStatus::Fail);
        assert_eq!(
            t.message,
            "Found 3 faulty memory elements on GPU 1 (DCGM error 52)"
        );
        assert_eq!(test_on(&gpus, 0, "memory").status, TestStatus::Pass);
        let d = combined((run, gpus));
        assert_eq!(d.result, DiagResult::Fail);
        assert!(
            d.summary.contains(
                "GPU 1 (GPU-bbbb) failed dcgm memory: Found 3 faulty memory elements on GPU 1"
            ),
            "{}",
            d.summary
        );
    }
}

#[test]
fn dcgm3_fail_on_one_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let bin = printing(dir.path(), "dcgm3-fail-gpu0.json", 205);
    let (run, gpus) = dcgm::run(&plan(bin, None, Duration::from_secs(30)));
    assert_eq!(run.result, DiagResult::Fail, "{}", run.why);
    let t = test_on(&gpus, 0, "GPU Memory");
    assert_eq!(t.status, TestStatus::Fail);
    assert!(
        t.message
            .contains("Detected 2 volatile double-bit ECC error(s) in GPU 0.")
    );
    // A pending retired page is DCGM's Deployment category: a configuration finding, never a
    // hardware failure by itself (NVML's counters judge it by the policy's rules).
    let t = test_on(&gpus, 0, "Page Retirement/Row Remap");
    assert_eq!(t.status, TestStatus::Config);
    assert!(t.message.contains("pending retired page"), "{}", t.message);
    // GPU 1 is untouched by GPU 0's failures.
    let one = gpus.iter().find(|g| g.index == 1).unwrap();
    assert_eq!(one.result, DiagResult::Pass);
}

#[test]
fn a_warning_is_a_pass_with_the_warning_kept() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["dcgm3-warn.json", "dcgm4-warn.json"] {
        let bin = printing(dir.path(), name, 0);
        let (run, gpus) = dcgm::run(&plan(bin, Some(vec![0, 1]), Duration::from_secs(30)));
        assert_eq!(run.result, DiagResult::Pass, "{name}: {}", run.why);
        let warned: Vec<_> = gpus
            .iter()
            .flat_map(|g| g.tests.iter())
            .filter(|t| t.status == TestStatus::Warn)
            .collect();
        assert_eq!(warned.len(), 1, "{name}: {gpus:#?}");
        assert!(
            warned[0].message.contains("thermal violation in GPU 0"),
            "{}",
            warned[0].message
        );
        let d = combined((run, gpus));
        assert_eq!(d.result, DiagResult::Pass, "{name}: {}", d.summary);
    }
}

#[test]
fn a_hang_is_unknown_and_its_whole_tree_dies() {
    let dir = tempfile::tempdir().unwrap();
    let pidfile = dir.path().join("grandchild.pid");
    let bin = dcgmi(
        dir.path(),
        &format!(
            "setsid sleep 1000 &\necho $! > '{}'\ntrap '' TERM\nsleep 1000",
            pidfile.display()
        ),
    );
    let start = Instant::now();
    let (run, gpus) = dcgm::run(&plan(bin, Some(vec![0]), Duration::from_secs(2)));
    let took = start.elapsed();
    assert!(run.ran);
    assert_eq!(run.result, DiagResult::Unknown);
    assert!(run.why.contains("timed out after 2s"), "{}", run.why);
    assert!(gpus.is_empty());
    // The script ignores SIGTERM: it is killed after the grace.
    assert!(
        took < Duration::from_secs(2) + dcgm::TERM_GRACE + Duration::from_secs(5),
        "{took:?}"
    );
    let pid: u32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    assert!(
        stat.is_empty(),
        "the setsid grandchild is still there: {stat}"
    );
}

#[test]
fn garbage_is_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let bin = dcgmi(
        dir.path(),
        "echo 'Segmentation fault {oops'; printf '\\377\\376{]]'; exit 0",
    );
    let (run, gpus) = dcgm::run(&plan(bin, None, Duration::from_secs(30)));
    assert!(run.ran);
    assert_eq!(run.result, DiagResult::Unknown);
    assert!(run.why.contains("printed no DCGM JSON"), "{}", run.why);
    assert!(gpus.is_empty());
    let bin = dcgmi(dir.path(), "echo 'Error: something odd' >&2; exit 226");
    let (run, _) = dcgm::run(&plan(bin, None, Duration::from_secs(30)));
    assert_eq!(run.result, DiagResult::Unknown);
    assert!(run.why.contains("226 (DCGM_ST_NVVS_ERROR"), "{}", run.why);
    assert!(run.why.contains("Error: something odd"), "{}", run.why);
}

#[test]
fn huge_output_is_capped() {
    let dir = tempfile::tempdir().unwrap();
    // 100 MB of an endless JSON string: cut at the cap, never held whole.
    let bin = dcgmi(
        dir.path(),
        "printf '{\"DCGM Diagnostic\": {\"runtime_error\": \"'; head -c 100000000 /dev/zero | tr '\\0' a; echo '\"}}'",
    );
    let (run, gpus) = dcgm::run(&plan(bin, None, Duration::from_secs(120)));
    assert!(run.ran);
    assert_eq!(run.result, DiagResult::Unknown);
    assert!(run.why.contains("over 4 MiB"), "{}", run.why);
    assert!(run.why.contains("100000"), "{}", run.why);
    assert!(gpus.is_empty());
    assert!(run.raw.len() <= MAX_RAW, "{}", run.raw.len());
    // A whole document first, then junk past the cap: the document is read.
    let bin = dcgmi(
        dir.path(),
        &format!(
            "cat '{}'; head -c 10000000 /dev/zero | tr '\\0' x",
            fixture("dcgm4-fail-gpu1.json").display()
        ),
    );
    let (run, _) = dcgm::run(&plan(bin, None, Duration::from_secs(120)));
    assert_eq!(run.result, DiagResult::Fail, "{}", run.why);
}

#[test]
fn no_host_engine_means_the_tier_did_not_run() {
    let dir = tempfile::tempdir().unwrap();
    // With --host: dcgmi/Command.cpp DoExecuteConnectionFailure, exit -21 (235).
    let bin = dcgmi(
        dir.path(),
        "echo 'Error: Unable to connect to host engine. Host engine connection invalid/disconnected.'; exit 235",
    );
    let mut p = plan(bin, Some(vec![0, 1]), Duration::from_secs(30));
    p.host = Some("unix:///run/nvidia-dcgm/nv-hostengine".into());
    let (run, gpus) = dcgm::run(&p);
    assert!(!run.ran, "{run:?}");
    assert!(
        run.why
            .starts_with("nv-hostengine is not running or not reachable"),
        "{}",
        run.why
    );
    assert!(
        run.why.contains("Unable to connect to host engine"),
        "{}",
        run.why
    );
    assert!(gpus.is_empty());
    let args = std::fs::read_to_string(dir.path().join("args")).unwrap();
    assert!(
        args.contains("--host unix:///run/nvidia-dcgm/nv-hostengine"),
        "{args}"
    );
    // Without --host, none running and no embedded one (dcgmi/Diag.cpp
    // StartDiag::DoExecuteConnectionFailure).
    let bin = dcgmi(
        dir.path(),
        "echo 'Error: Unable to start an embedded host engine. DCGM initialization error.'; exit 249",
    );
    let (run, _) = dcgm::run(&plan(bin, None, Duration::from_secs(30)));
    assert!(!run.ran);
    assert!(
        run.why.contains("could not start an embedded one"),
        "{}",
        run.why
    );
    // It never counts: with nothing else run, the diagnosis could not tell.
    let d = combined((run, Vec::new()));
    assert_eq!(d.result, DiagResult::Unknown);
    assert!(d.summary.contains("no test could run"), "{}", d.summary);
}

#[test]
fn a_runtime_error_could_not_tell() {
    let dir = tempfile::tempdir().unwrap();
    let bin = printing(dir.path(), "dcgm4-runtime-error.json", 217);
    let (run, gpus) = dcgm::run(&plan(bin, None, Duration::from_secs(30)));
    assert!(run.ran);
    assert_eq!(run.result, DiagResult::Unknown);
    assert!(
        run.why.contains("A diag instance is already running"),
        "{}",
        run.why
    );
    assert!(gpus.is_empty());
}

#[test]
fn an_exit_code_that_contradicts_a_clean_document_could_not_tell() {
    let dir = tempfile::tempdir().unwrap();
    let bin = printing(dir.path(), "dcgm4-pass.json", 226);
    let (run, _) = dcgm::run(&plan(bin, None, Duration::from_secs(30)));
    assert_eq!(run.result, DiagResult::Unknown);
    assert!(run.why.contains("shows no failure"), "{}", run.why);
}

#[test]
fn a_missing_binary_did_not_run() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dcgmi");
    let (run, gpus) = dcgm::run(&plan(missing.clone(), None, Duration::from_secs(5)));
    assert!(!run.ran);
    assert_eq!(
        run.why,
        format!(
            "dcgmi not found at {} (DCGM is not installed?)",
            missing.display()
        )
    );
    assert!(gpus.is_empty());
    let not_exec = dir.path().join("dcgmi-not-exec");
    std::fs::write(&not_exec, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&not_exec, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (run, _) = dcgm::run(&plan(not_exec, None, Duration::from_secs(5)));
    assert!(!run.ran);
    assert!(run.why.contains("cannot be run"), "{}", run.why);
}
