//! `gpu-medic diagnose` through the binary on the fakes (issue 1 item 5): the fake
//! libnvidia-ml's four GPUs, the CUDA tier on the fake libcuda (tests/fake-cuda: its default
//! four H200s, 64 MiB free each, no fault), the DCGM tier off (`dcgmi = ""`). For each level
//! (quick, standard, long) `gpu-medic diagnose --level L --json` runs `BENCH_RUNS` times
//! (default 10): wall time median and p99 (over so few runs p99 is the slowest), and the CUDA
//! tier's own `duration_ms` as the diagnosis reports it. Then `gpu-medic check --json` (the
//! passive checks the launch gate runs first) the same number of times: what a diagnosis at
//! each level adds to a launch gate's check.
//!
//! The fake libcuda runs the check's kernels and copies on the host with a simulated clock, so
//! these figures are gpu-medic's own overhead (process start, NVML listing, the worker, its
//! host-side buffers and pattern checks, the event stream), not a GPU's speed.
//!
//! `GPU_MEDIC_BIN=path` runs another gpu-medic binary. Run with `cargo bench --bench diagnose`
//! (release), or in the dev profile with `cargo test --locked --bench diagnose` (the bench built
//! and run in the test profile, as the other tests build the binary).

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use gpu_medic_testkit::stats::{machine, percentile};
use gpu_medic_testkit::{bin, default_policy, fake_cuda, fake_nvml};

fn config(dir: &Path) -> std::path::PathBuf {
    let cfg = dir.join("config.toml");
    std::fs::write(dir.join("kmsg"), "").unwrap();
    std::fs::write(
        &cfg,
        format!(
            "state_dir = \"{}\"\npolicy = \"{}\"\n\
             [nvml]\nlibrary = \"{}\"\nkmsg = \"{}\"\n\
             [mps]\nenabled = false\n[aws]\nenabled = false\n\
             [diagnose]\ndcgmi = \"\"\ndcgm_host = \"\"\ncuda_library = \"{}\"\ntimeout = \"300s\"\n",
            dir.join("state").display(),
            default_policy().display(),
            fake_nvml().display(),
            dir.join("kmsg").display(),
            fake_cuda().display(),
        ),
    )
    .unwrap();
    cfg
}

/// One run: wall seconds and stdout; panics on an exit code other than `want`.
fn run(bin: &Path, args: &[&str], cfg: &Path, want: i32) -> (f64, String) {
    let t = Instant::now();
    let out = Command::new(bin)
        .args(args)
        .arg("--config")
        .arg(cfg)
        .env_remove("GPU_MEDIC_CONFIG")
        .env_remove("FAKE_CUDA_CONFIG")
        .env_remove("FAKE_NVML_CONFIG")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let wall = t.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.status.code(),
        Some(want),
        "{args:?}: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    (wall, stdout)
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v
}

fn main() {
    let runs: usize = std::env::var("BENCH_RUNS")
        .unwrap_or_else(|_| "10".into())
        .parse()
        .unwrap();
    let bin = bin();
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    println!("{}", machine());
    println!("binary: {}", bin.display());
    println!("fake libcuda: {}", fake_cuda().display());

    // The passive check first: the launch gate's part before any diagnosis.
    let _ = run(&bin, &["check", "--json"], &cfg, 0); // warm the page cache
    let check = sorted(
        (0..runs)
            .map(|_| run(&bin, &["check", "--json"], &cfg, 0).0)
            .collect(),
    );
    let check_median = percentile(&check, 0.5);

    println!();
    println!(
        "| command | runs | median | p99 | CUDA tier (its duration_ms) median | added to `check` (median) |"
    );
    println!("|---|---|---|---|---|---|");
    println!(
        "| `check --json` | {runs} | {:.3} s | {:.3} s | | |",
        check_median,
        percentile(&check, 0.99)
    );
    for level in ["quick", "standard", "long"] {
        let args = ["diagnose", "--level", level, "--json"];
        let _ = run(&bin, &args, &cfg, 0);
        let mut wall = Vec::new();
        let mut tier = Vec::new();
        for _ in 0..runs {
            let (w, out) = run(&bin, &args, &cfg, 0);
            let d: serde_json::Value = serde_json::from_str(&out).unwrap();
            assert_eq!(d["result"], "pass", "{d:#}");
            let cuda = d["tiers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|t| t["tier"] == "cuda")
                .unwrap();
            tier.push(cuda["duration_ms"].as_f64().unwrap() / 1000.0);
            wall.push(w);
        }
        let wall = sorted(wall);
        let tier = sorted(tier);
        let m = percentile(&wall, 0.5);
        println!(
            "| `diagnose --level {level} --json` | {runs} | {m:.3} s | {:.3} s | {:.3} s | +{m:.3} s ({:.1}x the check) |",
            percentile(&wall, 0.99),
            percentile(&tier, 0.5),
            (check_median + m) / check_median,
        );
    }
}
