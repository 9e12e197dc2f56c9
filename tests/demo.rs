//! The quick-start demo through the real binary: it tells the whole story and leaves
//! nothing running.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::process::Command;
use std::time::Duration;

#[test]
fn the_demo_plays_its_script_and_cleans_up() {
    let bin = assert_cmd::cargo::cargo_bin("gpu-medic");
    let start = std::time::Instant::now();
    let out = Command::new(&bin).arg("demo").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(start.elapsed() < Duration::from_secs(60));
    assert!(
        text.contains("incident 1: logged (rule `xid-13-graphics-exception`)"),
        "{text}"
    );
    // XID 79: rebooted (recorded), checked and diagnosed after the simulated boot, and back
    // in service: repaired, not replaced.
    assert!(
        text.contains("repaired (rule `xid-fallen-off-bus`)"),
        "{text}"
    );
    assert!(text.contains("ec2:RebootInstances"), "{text}");
    assert!(!text.contains("SetInstanceHealth"), "{text}");
    assert!(text.contains("new boot demo-boot-2"), "{text}");
    assert!(text.contains("healthy after the boot"), "{text}");
    // The diagnosis after the boot: the built-in CUDA check on the fake libcuda, each GPU's
    // tests in the timeline.
    assert!(text.contains("diagnosis (quick) pass"), "{text}");
    for gpu in 0..4 {
        assert!(text.contains(&format!("GPU {gpu} GPU-")), "{text}");
    }
    assert!(text.contains("status=ACTIVE"), "{text}");
    let mps_installed = std::path::Path::new("/usr/bin/nvidia-cuda-mps-control").exists();
    if mps_installed {
        assert!(text.contains("resolved (rule `mps-down`)"), "{text}");
    }
    // Nothing left: no daemon for the demo's pipe directory, no state folder.
    let pid = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("state:"))
        .map(|s| s.trim().to_string())
        .unwrap();
    assert!(!std::path::Path::new(&pid).exists(), "{pid} left behind");
    let demo_dir = std::path::Path::new(&pid)
        .parent()
        .unwrap()
        .display()
        .to_string();
    let mut left = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
        let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
        let zombie = status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z'));
        if !zombie && String::from_utf8_lossy(&env).contains(&demo_dir) {
            left.push(e.file_name().to_string_lossy().to_string());
        }
    }
    assert!(
        left.is_empty(),
        "processes of {demo_dir} left running: {left:?}"
    );
}
