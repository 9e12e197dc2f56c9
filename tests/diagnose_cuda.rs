//! The CUDA diagnose tier end to end: `diagnose::cuda::run` starts the real gpu-medic binary's
//! hidden worker (`__cuda-worker`), which loads the fake libcuda (tests/fake-cuda) as it would
//! the driver's, and the tier judges what the worker streamed back. Each fault of the fake's
//! contract (README.md there) is one test: a wrong kernel answer, a refused allocation, a hung
//! GPU (killed at the deadline, its whole process group gone), a slow GPU (a straggler), a
//! context the MPS server refuses, a driver that cannot start, no library at all.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use gpu_medic::diagnose::cuda::{self, CudaPlan};
use gpu_medic::model::diagnosis::{DiagResult, GpuDiagnosis, Level, TestStatus, TierRun};
use gpu_medic_testkit::{bin, fake_cuda};

const UUIDS: [&str; 4] = [
    "GPU-00000000-aaaa-bbbb-cccc-000000000000",
    "GPU-11111111-aaaa-bbbb-cccc-111111111111",
    "GPU-22222222-aaaa-bbbb-cccc-222222222222",
    "GPU-33333333-aaaa-bbbb-cccc-333333333333",
];

/// Four H200s (64 MiB free each: the quick level tests ~3 MiB) with `faults[i]` on GPU i.
fn config(faults: [Option<&str>; 4]) -> String {
    let gpus: Vec<String> = UUIDS
        .iter()
        .zip(faults)
        .map(|(u, f)| {
            let fault = f.map_or("null".to_string(), |f| format!("\"{f}\""));
            format!(r#"{{"uuid": "{u}", "name": "NVIDIA H200", "free_mib": 64, "fault": {fault}}}"#)
        })
        .collect();
    format!(r#"{{"gpus": [{}]}}"#, gpus.join(","))
}

fn asked() -> Vec<(u32, String)> {
    UUIDS
        .iter()
        .enumerate()
        .map(|(i, u)| (i as u32, u.to_string()))
        .collect()
}

struct Setup {
    dir: tempfile::TempDir,
    plan: CudaPlan,
}

fn setup(config_json: Option<&str>, timeout: Duration) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let mut env = vec![(
        "FAKE_CUDA_PID_FILE".to_string(),
        dir.path().join("pids").display().to_string(),
    )];
    if let Some(json) = config_json {
        let path = dir.path().join("cuda.json");
        std::fs::write(&path, json).unwrap();
        env.push(("FAKE_CUDA_CONFIG".into(), path.display().to_string()));
    } else {
        env.push(("FAKE_CUDA_CONFIG".into(), String::new()));
    }
    let plan = CudaPlan {
        library: fake_cuda(),
        level: Level::Quick,
        gpus: asked(),
        timeout,
        mps_pipe: None,
        exe: bin(),
        env,
    };
    Setup { dir, plan }
}

fn test<'a>(g: &'a GpuDiagnosis, name: &str) -> &'a gpu_medic::model::diagnosis::TestResult {
    g.tests
        .iter()
        .find(|t| t.test == name)
        .unwrap_or_else(|| panic!("GPU {} has no {name} test: {:#?}", g.index, g.tests))
}

fn show(run: &TierRun, gpus: &[GpuDiagnosis]) -> String {
    format!("{run:#?}\n{gpus:#?}")
}

#[test]
fn four_healthy_gpus_pass_with_their_figures() {
    let s = setup(Some(&config([None; 4])), Duration::from_secs(20));
    let t0 = Instant::now();
    let (run, gpus) = cuda::run(&s.plan);
    assert!(run.ran, "{}", show(&run, &gpus));
    assert_eq!(run.result, DiagResult::Pass, "{}", show(&run, &gpus));
    assert_eq!(gpus.len(), 4);
    for (i, g) in gpus.iter().enumerate() {
        assert_eq!(g.index, i as u32);
        assert_eq!(g.uuid, UUIDS[i]);
        assert_eq!(g.result, DiagResult::Pass, "{}", show(&run, &gpus));
        for name in ["context", "memory", "kernel", "bandwidth", "throughput"] {
            let t = test(g, name);
            assert_eq!(t.status, TestStatus::Pass, "{t:?}");
            assert!(t.duration_ms.is_some());
        }
        let bw = test(g, "bandwidth");
        assert_eq!(bw.unit, "GB/s");
        // The fake's simulated clock: 25 GB/s.
        assert!((bw.value.unwrap() - 25.0).abs() < 1.0, "{bw:?}");
        let tp = test(g, "throughput");
        assert_eq!(tp.unit, "GFLOP/s");
        assert!((tp.value.unwrap() - 40_000.0).abs() < 2_000.0, "{tp:?}");
        assert!(
            test(g, "memory").message.contains("5 patterns"),
            "{:?}",
            test(g, "memory")
        );
    }
    assert!(t0.elapsed() < Duration::from_secs(15), "{:?}", t0.elapsed());
}

#[test]
fn the_default_fake_is_four_gpus_found_without_a_list() {
    let mut s = setup(None, Duration::from_secs(20));
    s.plan.gpus.clear();
    let (run, gpus) = cuda::run(&s.plan);
    assert_eq!(run.result, DiagResult::Pass, "{}", show(&run, &gpus));
    assert_eq!(gpus.len(), 4);
    assert_eq!(
        gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    assert!(
        gpus.iter()
            .all(|g| g.uuid.starts_with("GPU-") && g.uuid.len() == 40)
    );
}

#[test]
fn a_wrong_kernel_answer_fails_that_gpu_by_index_and_uuid() {
    let s = setup(
        Some(&config([None, None, Some("wrong-result"), None])),
        Duration::from_secs(20),
    );
    let (run, gpus) = cuda::run(&s.plan);
    assert!(run.ran);
    assert_eq!(run.result, DiagResult::Fail, "{}", show(&run, &gpus));
    let g = &gpus[2];
    assert_eq!((g.index, g.uuid.as_str()), (2, UUIDS[2]));
    assert_eq!(g.result, DiagResult::Fail);
    let k = test(g, "kernel");
    assert_eq!(k.status, TestStatus::Fail);
    assert!(
        k.message
            .contains("wrong answer at element 4242: expected 12733, got"),
        "{}",
        k.message
    );
    for other in [0, 1, 3] {
        assert_eq!(
            gpus[other].result,
            DiagResult::Pass,
            "{}",
            show(&run, &gpus)
        );
    }
    // Through the whole diagnosis: the summary names the GPU, its UUID and the test.
    let d = gpu_medic::model::diagnosis::Diagnosis::combine(
        Level::Quick,
        &asked(),
        vec![(run, gpus)],
        1,
    );
    assert_eq!(d.result, DiagResult::Fail);
    assert!(
        d.summary
            .contains(&format!("GPU 2 ({}) failed cuda kernel", UUIDS[2])),
        "{}",
        d.summary
    );
}

#[test]
fn a_refused_allocation_fails_the_memory_test() {
    let s = setup(
        Some(&config([Some("alloc-fail"), None, None, None])),
        Duration::from_secs(20),
    );
    let (run, gpus) = cuda::run(&s.plan);
    assert_eq!(run.result, DiagResult::Fail, "{}", show(&run, &gpus));
    let m = test(&gpus[0], "memory");
    assert_eq!(m.status, TestStatus::Fail);
    assert!(
        m.message.contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{}",
        m.message
    );
    assert_eq!(gpus[1].result, DiagResult::Pass);
}

#[test]
fn a_flipped_bit_fails_the_memory_test_naming_offset_and_pattern() {
    let s = setup(
        Some(&config([None, Some("memory-corrupt"), None, None])),
        Duration::from_secs(20),
    );
    let (run, gpus) = cuda::run(&s.plan);
    assert_eq!(run.result, DiagResult::Fail, "{}", show(&run, &gpus));
    let m = test(&gpus[1], "memory");
    assert_eq!(m.status, TestStatus::Fail);
    // The fake's bad cell: device offset 0x100044, bit 3; the first pattern is all zeroes.
    assert!(
        m.message
            .contains("miscompare at offset 0x100044 with pattern 0x00000000: wrote 0x00000000, read 0x00000008"),
        "{}",
        m.message
    );
}

#[test]
fn a_slow_gpu_is_a_straggler() {
    let s = setup(
        Some(&config([None, None, None, Some("slow")])),
        Duration::from_secs(20),
    );
    let (run, gpus) = cuda::run(&s.plan);
    assert_eq!(run.result, DiagResult::Fail, "{}", show(&run, &gpus));
    let g = &gpus[3];
    for name in ["bandwidth", "throughput"] {
        let t = test(g, name);
        assert_eq!(t.status, TestStatus::Fail, "{t:?}");
        assert!(t.message.starts_with("straggler: "), "{}", t.message);
        assert!(t.message.contains("siblings' median"), "{}", t.message);
    }
    assert!(
        test(g, "bandwidth")
            .message
            .contains("2.5 GB/s, siblings' median 25.0 GB/s")
    );
    for other in 0..3 {
        assert_eq!(
            gpus[other].result,
            DiagResult::Pass,
            "{}",
            show(&run, &gpus)
        );
    }
}

#[test]
fn a_context_the_mps_server_refuses_fails_that_gpu() {
    let mut s = setup(
        Some(&config([None, Some("context-fail"), None, None])),
        Duration::from_secs(20),
    );
    // As an MPS client (the fake ignores the pipe; the check names its test for it).
    s.plan.mps_pipe = Some(s.dir.path().join("mps"));
    let (run, gpus) = cuda::run(&s.plan);
    assert_eq!(run.result, DiagResult::Fail, "{}", show(&run, &gpus));
    let c = test(&gpus[1], "mps-client");
    assert_eq!(c.status, TestStatus::Fail);
    assert!(
        c.message.contains("CUDA_ERROR_MPS_CONNECTION_FAILED"),
        "{}",
        c.message
    );
    assert!(
        c.message.contains("MPS server cannot serve this GPU"),
        "{}",
        c.message
    );
    assert_eq!(gpus[1].tests.len(), 1, "no test past a failed context");
    assert_eq!(test(&gpus[0], "mps-client").status, TestStatus::Pass);
}

#[test]
fn a_gpu_the_driver_does_not_list_fails() {
    let mut s = setup(Some(&config([None; 4])), Duration::from_secs(20));
    s.plan.gpus = vec![
        (0, UUIDS[0].to_string()),
        (4, "GPU-44444444-aaaa-bbbb-cccc-444444444444".to_string()),
    ];
    let (run, gpus) = cuda::run(&s.plan);
    assert_eq!(run.result, DiagResult::Fail, "{}", show(&run, &gpus));
    assert_eq!(gpus[0].result, DiagResult::Pass);
    let d = test(&gpus[1], "device");
    assert_eq!(d.status, TestStatus::Fail);
    assert!(d.message.contains("does not list"), "{}", d.message);
}

/// Processes (not zombies) whose process group is `pgid`.
fn group_members(pgid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...: comm may hold spaces, so split after the last ')'.
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.first() != Some(&"Z") && fields.get(2) == Some(&pgid.to_string().as_str()) {
            found.push(pid);
        }
    }
    found
}

fn pids(dir: &Path) -> Vec<(String, u32)> {
    let text = std::fs::read_to_string(dir.join("pids")).unwrap_or_default();
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

#[test]
fn a_hung_gpu_is_unknown_and_the_workers_whole_group_is_killed() {
    let s = setup(
        Some(&config([None, Some("hang"), None, None])),
        // Long enough for GPU 0's tests on a loaded machine (about 1.5 s alone).
        Duration::from_secs(10),
    );
    let t0 = Instant::now();
    let (run, gpus) = cuda::run(&s.plan);
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_secs(10) && took < Duration::from_secs(30),
        "{took:?}"
    );
    assert!(run.ran);
    assert_eq!(run.result, DiagResult::Unknown, "{}", show(&run, &gpus));
    assert!(run.why.contains("timed out after 10s"), "{}", run.why);
    // What finished before the hang is kept; the GPU under test and those after it could
    // not tell.
    assert_eq!(gpus[0].result, DiagResult::Pass, "{}", show(&run, &gpus));
    assert_eq!(gpus[1].result, DiagResult::Unknown);
    let k = test(&gpus[1], "kernel");
    assert_eq!(k.status, TestStatus::Unknown);
    assert!(
        k.message.contains("during the kernel test"),
        "{}",
        k.message
    );
    for later in [2, 3] {
        assert_eq!(gpus[later].result, DiagResult::Unknown);
        assert!(
            gpus[later].tests[0]
                .message
                .starts_with("not reached: timed out")
        );
    }
    // The worker and the helper it started are gone with their group.
    let p = pids(s.dir.path());
    let worker = p
        .iter()
        .find(|(k, _)| k == "worker")
        .expect("the fake wrote its pid")
        .1;
    assert!(p.iter().any(|(k, _)| k == "helper"), "{p:?}");
    let left = group_members(worker);
    assert!(
        left.is_empty(),
        "left in the worker's group {worker}: {left:?}"
    );
}

#[test]
fn a_driver_that_cannot_start_tells_nothing() {
    let mut s = setup(Some(&config([None; 4])), Duration::from_secs(20));
    s.plan
        .env
        .push(("FAKE_CUDA_INIT_ERROR".into(), "100".into()));
    let (run, gpus) = cuda::run(&s.plan);
    assert!(!run.ran, "{}", show(&run, &gpus));
    assert_eq!(run.result, DiagResult::Unknown);
    assert!(run.why.contains("CUDA_ERROR_NO_DEVICE"), "{}", run.why);
    assert!(gpus.is_empty());
    // As an MPS client, a driver refused by the MPS daemon fails every GPU asked.
    let mut s = setup(Some(&config([None; 4])), Duration::from_secs(20));
    s.plan
        .env
        .push(("FAKE_CUDA_INIT_ERROR".into(), "805".into()));
    s.plan.mps_pipe = Some(s.dir.path().join("mps"));
    let (run, gpus) = cuda::run(&s.plan);
    assert!(run.ran);
    assert_eq!(run.result, DiagResult::Fail, "{}", show(&run, &gpus));
    assert_eq!(gpus.len(), 4);
    assert!(gpus.iter().all(|g| {
        test(g, "mps-client")
            .message
            .contains("MPS_CONNECTION_FAILED")
    }));
    // Not an MPS client: the same code is a driver that cannot start.
    let mut s = setup(Some(&config([None; 4])), Duration::from_secs(20));
    s.plan
        .env
        .push(("FAKE_CUDA_INIT_ERROR".into(), "805".into()));
    let (run, _) = cuda::run(&s.plan);
    assert!(!run.ran);
    assert_ne!(run.result, DiagResult::Pass);
}

#[test]
fn no_library_is_not_run_and_never_a_pass() {
    let mut s = setup(None, Duration::from_secs(20));
    s.plan.library = PathBuf::from("/nonexistent/libcuda.so.1");
    let (run, gpus) = cuda::run(&s.plan);
    assert!(!run.ran, "{}", show(&run, &gpus));
    assert_eq!(run.result, DiagResult::Unknown);
    assert!(
        run.why.contains("cannot load /nonexistent/libcuda.so.1"),
        "{}",
        run.why
    );
    assert!(gpus.is_empty());
    // Nor a worker binary that cannot start.
    let mut s = setup(None, Duration::from_secs(20));
    s.plan.exe = PathBuf::from("/nonexistent/gpu-medic");
    let (run, _) = cuda::run(&s.plan);
    assert!(!run.ran);
    assert!(run.why.contains("cannot start the worker"), "{}", run.why);
}

#[test]
fn the_long_level_tests_more_and_measures_longer() {
    let mut s = setup(Some(&config([None; 4])), Duration::from_secs(20));
    s.plan.level = Level::Long;
    s.plan.gpus.truncate(1);
    let (run, gpus) = cuda::run(&s.plan);
    assert_eq!(run.result, DiagResult::Pass, "{}", show(&run, &gpus));
    // Half of the 64 MiB free, 16 timed copies each way, the best of 10 arithmetic runs.
    assert!(
        test(&gpus[0], "memory")
            .message
            .starts_with("32 MiB of 64 MiB free"),
        "{:?}",
        gpus[0]
    );
    assert!(
        test(&gpus[0], "bandwidth").message.contains("(16 x "),
        "{:?}",
        gpus[0]
    );
    assert!(
        test(&gpus[0], "throughput")
            .message
            .contains("best of 10 runs"),
        "{:?}",
        gpus[0]
    );
}
