//! An XID storm through the real `gpu-medic run` binary (issue 13, item 3): thousands of
//! distinct XIDs land in the kernel log at once, then, a second later, an XID 79. Measured:
//! how long after it was written the 79 is decided (its `opened` record's stamp), when the
//! storm is absorbed (the process's CPU use falls back to idle), the CPU time the storm cost,
//! and the size of `state.json` after it. Run with `scripts/bench.sh storm` (release build).
//!
//! `BENCH_STORM` (default 3000) distinct XIDs, codes no rule names, on 4 GPUs; the kernel log
//! is a regular file the bench appends to (the reader follows it like `/dev/kmsg`).
//! `BENCH_BIN=path` runs another gpu-medic binary (an older release, for the side-by-side
//! figure in BENCHMARKS.md); `BENCH_TIMEOUT_S` (default 900) bounds the wait for the 79.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const GPUS: &str = r#"{"driver_version": "570.172.08", "gpus": [
  {"uuid": "GPU-00000000-aaaa-bbbb-cccc-000000000000", "pci_bus_id": "00000000:10:00.0", "serial": "S0"},
  {"uuid": "GPU-11111111-aaaa-bbbb-cccc-111111111111", "pci_bus_id": "00000000:20:00.0", "serial": "S1"},
  {"uuid": "GPU-22222222-aaaa-bbbb-cccc-222222222222", "pci_bus_id": "00000000:30:00.0", "serial": "S2"},
  {"uuid": "GPU-33333333-aaaa-bbbb-cccc-333333333333", "pci_bus_id": "00000000:40:00.0", "serial": "S3"}
]}"#;

fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

fn parse_at(s: &str) -> Option<f64> {
    let t = humantime::parse_rfc3339_weak(s).ok()?;
    Some(t.duration_since(UNIX_EPOCH).ok()?.as_secs_f64() * 1000.0)
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds (user + system) the process has used.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Fields after the command: state is f[0]; utime is field 14 overall, f[11] here.
    let ticks: f64 = f.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        + f.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    ticks / hz.max(1.0)
}

fn append(path: &Path, text: &str) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    f.write_all(text.as_bytes()).unwrap();
}

fn main() {
    let storm: u32 = env_or("BENCH_STORM", 3000);
    let timeout = Duration::from_secs(env_or("BENCH_TIMEOUT_S", 900));
    let bin = std::env::var("BENCH_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(env!("CARGO_BIN_EXE_gpu-medic")));
    let lib = PathBuf::from(env!("CARGO_BIN_EXE_gpu-medic"))
        .parent()
        .unwrap()
        .join("libfake_nvml.so");
    assert!(
        lib.exists(),
        "{} missing: build the workspace in this profile first (scripts/bench.sh does)",
        lib.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::create_dir_all(d.join("inject")).unwrap();
    std::fs::write(d.join("gpus.json"), GPUS).unwrap();
    std::fs::write(d.join("kmsg"), "").unwrap();
    let policy = Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/default.toml");
    std::fs::write(
        d.join("config.toml"),
        format!(
            "state_dir = \"state\"\npolicy = \"{}\"\n[nvml]\nlibrary = \"{}\"\nkmsg = \"{}\"\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
            policy.display(),
            lib.display(),
            d.join("kmsg").display()
        ),
    )
    .unwrap();
    let mut child = Command::new(&bin)
        .args(["run", "--log-format", "json", "--config"])
        .arg(d.join("config.toml"))
        .env("FAKE_NVML_CONFIG", d.join("gpus.json"))
        .env("FAKE_NVML_INJECT_DIR", d.join("inject"))
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let start = Instant::now();
    while !d.join("state/state.json").exists() && start.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(2000));
    let cpu_before = cpu_s(pid);

    // The storm: every line at once, as a burst in the kernel log.
    let mut text = String::new();
    for i in 0..storm {
        let bus = [0x10, 0x20, 0x30, 0x40][(i % 4) as usize];
        text.push_str(&format!(
            "4,{},{},-;NVRM: Xid (PCI:0000:{bus:02x}:00): {}, pid={i}, name=app, storm\n",
            100 + i,
            1_000_000 + i,
            100_000 + i
        ));
    }
    let t_storm = Instant::now();
    append(&d.join("kmsg"), &text);
    std::thread::sleep(Duration::from_secs(1));
    let t79 = now_ms();
    append(
        &d.join("kmsg"),
        &format!(
            "4,{},{},-;NVRM: Xid (PCI:0000:20:00): 79, pid=1, name=train, GPU has fallen off the bus.\n",
            100 + storm,
            1_000_000 + storm
        ),
    );
    let t79_instant = Instant::now();

    // Follow the journal for the 79's decision, reading only what is new.
    let journal = d.join("state/incidents.jsonl");
    let mut offset = 0u64;
    let mut pending = String::new();
    let mut opened = 0usize;
    let decided_at = loop {
        let mut found = None;
        if let Ok(mut f) = std::fs::File::open(&journal) {
            let _ = f.seek(SeekFrom::Start(offset));
            let mut buf = String::new();
            if let Ok(n) = f.read_to_string(&mut buf) {
                offset += n as u64;
                pending.push_str(&buf);
            }
            while let Some(i) = pending.find('\n') {
                let line: String = pending.drain(..=i).collect();
                if line.contains("\"opened\"") {
                    opened += 1;
                    if line.contains("\"code\":79") {
                        let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
                        found = parse_at(v["at"].as_str().unwrap());
                    }
                }
            }
        }
        if let Some(at) = found {
            break Some(at);
        }
        if t79_instant.elapsed() > timeout {
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };

    // Absorbed: the first second after which the process used under 2 % of a core.
    let mut absorbed = None;
    let mut last = (Instant::now(), cpu_s(pid));
    while t_storm.elapsed() < timeout + Duration::from_secs(60) {
        std::thread::sleep(Duration::from_secs(1));
        let now = (Instant::now(), cpu_s(pid));
        let rate = (now.1 - last.1) / now.0.duration_since(last.0).as_secs_f64();
        if rate < 0.02 {
            absorbed = Some(last.0.duration_since(t_storm));
            break;
        }
        last = now;
    }
    let storm_cpu = cpu_s(pid) - cpu_before;
    // Idle after: CPU over the next 5 seconds.
    let c0 = cpu_s(pid);
    std::thread::sleep(Duration::from_secs(5));
    let idle_rate = (cpu_s(pid) - c0) / 5.0;
    let opened = std::fs::read_to_string(&journal)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("\"opened\""))
        .count()
        .max(opened);
    let state_bytes = std::fs::metadata(d.join("state/state.json"))
        .map(|m| m.len())
        .unwrap_or(0);
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(pid as i32, libc::SIGTERM) };
    let _ = child.wait();

    println!(
        "XID storm: {storm} distinct XIDs at once, an XID 79 one second later ({})",
        bin.display()
    );
    match decided_at {
        Some(at) => println!("  XID 79 decided {:.0} ms after it was written", at - t79),
        None => println!("  XID 79 not decided within {timeout:?}"),
    }
    match absorbed {
        Some(a) => println!(
            "  storm absorbed (CPU < 2 % of a core) {:.1} s after it began",
            a.as_secs_f64()
        ),
        None => println!("  storm not absorbed within the wait"),
    }
    println!(
        "  CPU time for the storm: {storm_cpu:.2} s; afterwards {:.1} % of a core",
        idle_rate * 100.0
    );
    println!("  incidents opened: {opened}; state.json {state_bytes} bytes");
}
