//! What the tests that run the real binary against the fake libnvidia-ml share: where the
//! binary and the fake library are, and waiting for something to happen.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Four H100-like GPUs for the fake library (`FAKE_NVML_CONFIG`).
pub const GPUS: &str = r#"{"driver_version": "570.172.08", "gpus": [
  {"uuid": "GPU-00000000-aaaa-bbbb-cccc-000000000000", "pci_bus_id": "00000000:10:00.0", "serial": "S0"},
  {"uuid": "GPU-11111111-aaaa-bbbb-cccc-111111111111", "pci_bus_id": "00000000:20:00.0", "serial": "S1"},
  {"uuid": "GPU-22222222-aaaa-bbbb-cccc-222222222222", "pci_bus_id": "00000000:30:00.0", "serial": "S2"},
  {"uuid": "GPU-33333333-aaaa-bbbb-cccc-333333333333", "pci_bus_id": "00000000:40:00.0", "serial": "S3"}
]}"#;

/// Starts the daemon (`cmd` is the whole `gpu-medic run ...` command) with its logs into
/// `log`, and waits until `state_dir` has its first `state.json`.
pub fn start_daemon(mut cmd: Command, log: &Path, state_dir: &Path) -> Child {
    let child = cmd
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap();
    wait_until("the daemon to start", || {
        state_dir.join("state.json").exists()
    });
    child
}

pub fn bin() -> PathBuf {
    assert_cmd::cargo::cargo_bin("gpu-medic")
}

/// The fake libnvidia-ml (tests/fake-nvml), built by `cargo build --workspace`.
pub fn fake_nvml() -> PathBuf {
    let dir = bin().parent().unwrap().to_path_buf();
    [dir.join("libfake_nvml.so"), dir.join("deps/libfake_nvml.so")]
        .into_iter()
        .find(|p| p.exists())
        .unwrap_or_else(|| {
            panic!(
                "libfake_nvml.so not found next to {}: run `cargo build --workspace` (or `cargo test --workspace`)",
                bin().display()
            )
        })
}

/// Polls `f` every 50 ms for up to 20 s; panics naming `what` if it never holds.
pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(20) {
        if f() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("timed out waiting for {what}");
}
