//! Peak memory with every file gpu-medic reads at its cap (issue 26, "Measured"): the real
//! `gpu-medic run` (the fake libnvidia-ml, the kernel log a file, AWS and MPS off) and the
//! CLI readers (`status`, `incidents list`, `incidents list --open --json`, `tasks`), on a
//! state directory first as a short run leaves it, then with every file at its cap:
//!
//! - `state.json` at 16 MiB (`MAX_STATE_BYTES`): the run's own state, its confirmation
//!   windows grown far past what the engine keeps (a hand or a corrupt writer could make
//!   them; the daemon sets such a state aside and rebuilds it from the journal);
//! - `inputs.jsonl` and `incidents.jsonl` at 64 MiB each (the default rotation size), filled
//!   with copies of the run's own lines, sequence numbers and incident ids going up;
//! - `gpu-memory.jsonl` at 16 MiB (`MAX_GPU_MEMORY_HISTORY`), rows of one task;
//! - the views (`links.json`, `ports.json`, `gpu-view.json`, `fleet.json`, `slots.json`) at
//!   1 MiB each; the kernel log at 64 MiB of lines that are no XID.
//!
//! Figures: the daemon's peak RSS (`VmHWM`) 5 s after its start, and each CLI command's peak
//! RSS and wall time (GNU time's `%M` and `%e`: `/usr/bin/time`, Debian's `time`; a child
//! forked from this bench would count the bench's own memory). Run with `cargo bench --bench file_caps`
//! (release), or build it with the other targets and run `target/debug/deps/file_caps-*`
//! for the dev profile; `GPU_MEDIC_BIN=path` measures another gpu-medic binary.

#![allow(clippy::unwrap_used, clippy::expect_used)] // bench code: a failed assumption is a failed run

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use gpu_medic_testkit::Daemon;
use gpu_medic_testkit::stats::machine;
use serde_json::Value;

const MIB: u64 = 1024 * 1024;

fn vm_hwm_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Runs a CLI command to its end under GNU time: (exit code, peak RSS in KiB, wall ms).
fn cli(d: &Daemon, args: &[&str]) -> (i32, u64, f64) {
    let inner = d.command();
    let mut c = std::process::Command::new("/usr/bin/time");
    c.args(["-f", "%M %e"])
        .arg(inner.get_program())
        .args(inner.get_args());
    for (k, v) in inner.get_envs() {
        match v {
            Some(v) => c.env(k, v),
            None => c.env_remove(k),
        };
    }
    let out = c
        .args(args)
        .arg("--config")
        .arg(d.config())
        .stdout(std::process::Stdio::null())
        .output()
        .expect("/usr/bin/time (Debian's `time`)");
    let err = String::from_utf8_lossy(&out.stderr);
    let last = err.lines().last().unwrap_or("");
    let mut f = last.split_whitespace();
    let rss = f.next().and_then(|v| v.parse().ok()).unwrap_or(0);
    let secs: f64 = f.next().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN);
    (out.status.code().unwrap_or(-1), rss, secs * 1000.0)
}

/// Appends copies of `line` (its `field` numbered up from `from`) until `path` holds `cap`
/// bytes; returns the last number used.
fn fill_lines(path: &Path, line: &Value, field: &str, from: u64, cap: u64) -> u64 {
    let mut f = std::io::BufWriter::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap(),
    );
    let mut size = std::fs::metadata(path).map_or(0, |m| m.len());
    let mut n = from;
    let mut v = line.clone();
    loop {
        v[field] = Value::from(n);
        let text = v.to_string() + "\n";
        if size + text.len() as u64 > cap {
            break;
        }
        f.write_all(text.as_bytes()).unwrap();
        size += text.len() as u64;
        n += 1;
    }
    n.saturating_sub(1)
}

/// A JSON value padded with spaces to `cap` bytes.
fn padded(value: &str, cap: u64) -> Vec<u8> {
    let mut b = value.as_bytes().to_vec();
    b.resize(cap as usize, b' ');
    b
}

/// `run` is the daemon's `run`-th start (its log is `daemon-<run>.log`).
fn measure(label: &str, d: &mut Daemon, run: u32) {
    d.spawn();
    let pid = d.pid().unwrap();
    let t = Instant::now();
    let mut started = None;
    while t.elapsed() < Duration::from_secs(60) {
        let log = std::fs::read_to_string(d.path(&format!("daemon-{run}.log"))).unwrap_or_default();
        if log.contains("supervisor started") {
            started = Some(t.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_secs(5));
    let hwm = vm_hwm_kib(pid);
    let stopping = Instant::now();
    d.stop(Duration::from_secs(30));
    println!(
        "| {label} | `run` (5 s after its start) | {} | {:.1} MiB | started in {}, stopped in {:.0} ms |",
        if started.is_some() {
            "started"
        } else {
            "NOT started in 60 s"
        },
        hwm as f64 / 1024.0,
        started.map_or("-".into(), |d| format!(
            "{:.0} ms",
            d.as_secs_f64() * 1000.0
        )),
        stopping.elapsed().as_secs_f64() * 1000.0
    );
    for args in [
        &["status"][..],
        &["incidents", "list"],
        &["incidents", "list", "--open", "--json"],
        &["tasks"],
    ] {
        let (code, rss, ms) = cli(d, args);
        println!(
            "| {label} | `{}` | exit {code} | {:.1} MiB | {ms:.0} ms |",
            args.join(" "),
            rss as f64 / 1024.0
        );
    }
}

fn main() {
    println!("{}", machine());
    let mut d = Daemon::fake_gpu_node("tick_interval = \"1s\"", "");
    d.gpus(gpu_medic_testkit::FOUR_GPUS);
    if let Some(bin) = std::env::var_os("GPU_MEDIC_BIN") {
        d.binary(bin.into());
    }
    std::fs::write(d.path("kmsg"), "").unwrap();
    // A short run that opens an incident, so the files hold the daemon's own lines.
    d.start();
    d.wait_polled();
    std::fs::OpenOptions::new()
        .append(true)
        .open(d.path("kmsg"))
        .unwrap()
        .write_all(
            b"4,900,91000000,-;NVRM: Xid (PCI:0000:10:00): 13, pid=42, name=python3, Graphics Exception\n",
        )
        .unwrap();
    d.wait_record("an incident", Duration::from_secs(30), "opened", |_| true);
    d.stop(Duration::from_secs(10));
    println!("| files | command | result | peak RSS | time |");
    println!("|---|---|---|---|---|");
    measure("as a short run left them", &mut d, 2);

    let state_dir = d.path("state");
    let read = |name: &str| std::fs::read_to_string(state_dir.join(name)).unwrap();
    let last_line =
        |name: &str| -> Value { serde_json::from_str(read(name).lines().last().unwrap()).unwrap() };
    let input = last_line("inputs.jsonl");
    let record = last_line("incidents.jsonl");
    let last_seq = fill_lines(
        &state_dir.join("inputs.jsonl"),
        &input,
        "seq",
        input["seq"].as_u64().unwrap() + 1,
        64 * MIB,
    );
    let last_incident = fill_lines(
        &state_dir.join("incidents.jsonl"),
        &record,
        "incident",
        record["incident"].as_u64().unwrap() + 1,
        64 * MIB,
    );
    let mut state: Value = serde_json::from_str(&read("state.json")).unwrap();
    state["delivery"]["applied"] = Value::from(last_seq);
    state["next_incident"] = Value::from(last_incident + 1);
    let mut repeats = serde_json::Map::new();
    let mut i = 0u64;
    let base = state.to_string().len() as u64;
    let mut size = base;
    while size < 16 * MIB - 64 * 1024 {
        let k = format!("gpu{}/xid{}", i % 4, 100_000 + i);
        size += k.len() as u64 + 40;
        repeats.insert(k, serde_json::json!(["2026-12-01T00:00:00.000Z"]));
        i += 1;
    }
    state["sightings"] = Value::Object(repeats);
    let mut text = serde_json::to_vec(&state).unwrap();
    while text.len() as u64 > 16 * MIB {
        // The estimate ran over: drop entries until the state fits its cap.
        let m = state["sightings"].as_object_mut().unwrap();
        let drop: Vec<String> = m.keys().take(10_000).cloned().collect();
        for k in drop {
            m.remove(&k);
        }
        text = serde_json::to_vec(&state).unwrap();
    }
    std::fs::write(state_dir.join("state.json"), &text).unwrap();
    let row = serde_json::json!({"minute": 1_780_000_000u64, "family": "train", "revision": "3", "container": "main", "peak_bytes": 1u64 << 30, "reserved_bytes": 2u64 << 30});
    fill_lines(
        &state_dir.join("gpu-memory.jsonl"),
        &row,
        "minute",
        1_780_000_000,
        16 * MIB,
    );
    for view in [
        "links.json",
        "ports.json",
        "gpu-view.json",
        "fleet.json",
        "slots.json",
    ] {
        std::fs::write(state_dir.join(view), padded("[]", MIB)).unwrap();
    }
    let mut k = std::io::BufWriter::new(
        std::fs::OpenOptions::new()
            .append(true)
            .open(d.path("kmsg"))
            .unwrap(),
    );
    let mut written = 0u64;
    let mut seq = 1000u64;
    while written < 64 * MIB {
        let l = format!("6,{seq},92000000,-;eth0: link is up, 100 Gbps, flow control off\n");
        written += l.len() as u64;
        seq += 1;
        k.write_all(l.as_bytes()).unwrap();
    }
    drop(k);
    let sizes: Vec<String> = std::fs::read_dir(&state_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let len = e.metadata().ok()?.len();
            (len > MIB / 2).then(|| {
                format!(
                    "{} {:.1} MiB",
                    e.file_name().to_string_lossy(),
                    len as f64 / MIB as f64
                )
            })
        })
        .collect();
    println!("<!-- at the cap: {} -->", sizes.join(", "));
    measure("every file at its cap", &mut d, 3);
}
