//! gpu-medic's test kit: one home for what the integration tests (`tests/*.rs`), the
//! benchmarks (`benches/*.rs`) and the soak (`examples/soak.rs`) need to run the real parts
//! around gpu-medic. A dev-only workspace crate (`publish = false`), like `tests/fake-nvml`.
//!
//! - here: where the binaries are ([`bin`], [`fake_nvml`], [`fake_cuda`], [`repo`], [`default_policy`]),
//!   waiting ([`wait_for`], [`wait_until`], [`wait_sync`]), counting the daemon's looks after a
//!   fact instead of sleeping ([`wait_looks`], [`Looks`]), fake-NVML files ([`gpus_json`],
//!   [`inject`]), the fixtures' tables ([`tsv`]), signals ([`signal`], [`stop_child`]) and wall-clock stamps ([`now_ms`],
//!   [`parse_at`]);
//! - [`daemon`]: `gpu-medic run` in a directory of its own with its config, environment and
//!   logs, always killed on drop, and the CLI pointed at the same config;
//! - [`aws`]: one moto per test binary, the SDK and seeding (Auto Scaling group, cluster,
//!   container instances, tasks), test configs and orders;
//! - [`fleet`]: N daemons of one Auto Scaling group against one moto behind the proxy, Auto
//!   Scaling played, and the record's invariants and costs (docs/fleet-scale.md);
//! - [`proxy`]: the recording, fault-injecting HTTP proxy in front of moto (throttling, 5xx,
//!   and the lifecycle actions moto lacks);
//! - [`throttle`]: AWS-shaped throttling for the proxy (the documented rates, scaled), latency,
//!   5xx bursts and outages;
//! - [`http`]: the small HTTP/1 plumbing both fakes and the proxy use;
//! - [`export`]: the incident export's AWS side (an EventBridge rule to an SQS queue, the
//!   queue and the log group read back);
//! - [`imds`]: a fake IMDSv2 and a fake ECS agent introspection API;
//! - [`mps`]: NVIDIA's real MPS control daemon in a short pipe directory of our own;
//! - [`journal`]: reading a state directory's journal the way tests look at it;
//! - [`journald`]: systemd journal files written by `systemd-journal-remote` from given lines;
//! - [`systemd`]: real systemd as PID 1 of a namespace over a Debian root, set up as the ECS
//!   GPU AMI runs MPS (`scripts/systemd-e2e.sh`);
//! - [`proc`]: `/proc` readings (CPU time, RSS, threads, descriptors, process state);
//! - [`stats`]: a seeded PRNG, percentiles and the machine line of the reports;
//! - [`elf`]: a library's dynamic symbols, and a copy of one with some taken out
//!   ([`fake_nvml_without`]: the fake libnvidia-ml of an older driver).
//!
//! Nothing here is a double for a part a user would have: moto, NVIDIA's MPS daemon and the
//! fake libnvidia-ml (loaded through nvml-wrapper's real code path) are the real parts; the
//! fake IMDS and ECS agent stand for EC2-only services (moto's IMDS lacks the token TTL header
//! aws-config requires and `autoscaling/target-lifecycle-state`).
//!
//! Helpers panic with a message on a broken setup: they run only in tests.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

pub mod aws;
pub mod daemon;
pub mod dcgm;
pub mod elf;
pub mod export;
pub mod fleet;
pub mod http;
pub mod imds;
pub mod journal;
pub mod journald;
pub mod mps;
pub mod proc;
pub mod proxy;
pub mod stats;
pub mod systemd;
pub mod throttle;

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use daemon::Daemon;
pub use proxy::{Call, Fault, Proxy};

// ---------------------------------------------------------------------------------------------
// Paths

/// The gpu-medic repository (the workspace root).
pub fn repo() -> PathBuf {
    let kit = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = kit.join("../..");
    root.canonicalize().unwrap_or(root)
}

/// The shipped default policy.
pub fn default_policy() -> PathBuf {
    repo().join("policies/default.toml")
}

/// A node for `gpu-medic diagnose` and `check` in `dir`: `dir/config.toml` with the state in
/// `dir/state`, the shipped policy, the fake libnvidia-ml's four GPUs, an empty kernel log
/// `dir/kmsg`, AWS off, `mps` (the `[mps]` section) and `diagnose` (the `[diagnose]` section's
/// lines). Returns the config's path.
pub fn diagnose_node(dir: &Path, mps: &str, diagnose: &str) -> PathBuf {
    let config = format!(
        "state_dir = \"{state}\"\npolicy = \"{policy}\"\n\
         [nvml]\nlibrary = \"{nvml}\"\nkmsg = \"{kmsg}\"\n\
         {mps}\n[aws]\nenabled = false\n\
         [diagnose]\n{diagnose}\n",
        state = dir.join("state").display(),
        policy = default_policy().display(),
        nvml = fake_nvml().display(),
        kmsg = dir.join("kmsg").display(),
    );
    std::fs::write(dir.join("kmsg"), "").unwrap();
    let path = dir.join("config.toml");
    std::fs::write(&path, config).unwrap();
    path
}

/// The `gpu-medic` binary of the profile the caller was built in.
///
/// A separate crate cannot read `env!("CARGO_BIN_EXE_gpu-medic")` (cargo sets it only for the
/// package's own tests and benches), so this looks next to the running executable: tests and
/// benches run from `target/<profile>/deps/`, examples from `target/<profile>/examples/`, and
/// the binary is `target/<profile>/gpu-medic`. Cargo builds it before the integration tests and
/// benches; an example (the soak) needs `cargo build --workspace` first. `GPU_MEDIC_BIN`
/// overrides the search (an installed binary).
pub fn bin() -> PathBuf {
    if let Some(p) = std::env::var_os("GPU_MEDIC_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("current_exe");
    for dir in exe.ancestors().skip(1).take(3) {
        let p = dir.join("gpu-medic");
        if p.is_file() {
            return p;
        }
    }
    panic!(
        "gpu-medic not found above {}: build it first (cargo build --workspace)",
        exe.display()
    )
}

/// The fake libnvidia-ml (tests/fake-nvml). This crate depends on it, so cargo builds it
/// (`target/<profile>/deps/libfake_nvml.so`) along with whatever uses the kit; a workspace build
/// also leaves a copy at `target/<profile>/libfake_nvml.so`. The fresh `deps/` one comes first.
pub fn fake_nvml() -> PathBuf {
    fake_library("libfake_nvml.so")
}

/// A copy of the fake libnvidia-ml in `dir` whose dynamic symbol table no longer defines
/// `names`, as an older driver's library lacks newer entry points ([`elf::without_symbols`]).
pub fn fake_nvml_without(dir: &Path, names: &[&str]) -> PathBuf {
    let copy = dir.join("libnvidia-ml-without.so");
    elf::without_symbols(&fake_nvml(), &copy, names).unwrap();
    copy
}

/// The fake libcuda (tests/fake-cuda), found as [`fake_nvml`] is: cargo builds the cdylib
/// into `target/<profile>/deps/` for whatever uses the kit.
pub fn fake_cuda() -> PathBuf {
    fake_library("libfake_cuda.so")
}

/// A cdylib of the workspace, `deps/` first, above the running test or next to the binary.
fn fake_library(file: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let mut dirs: Vec<PathBuf> = exe
        .ancestors()
        .skip(1)
        .take(3)
        .map(Path::to_path_buf)
        .collect();
    if let Some(d) = bin().parent() {
        dirs.push(d.to_path_buf());
    }
    dirs.iter()
        .flat_map(|d| [d.join("deps").join(file), d.join(file)])
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{file} not found above {}: build the workspace (cargo build --workspace)",
                exe.display()
            )
        })
}

// ---------------------------------------------------------------------------------------------
// Waiting

/// Polls `f` every 100 ms on the current runtime until it holds; panics after `limit`.
pub async fn wait_for<F, Fut>(what: &str, limit: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < limit, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Polls `f` every `every` (blocking) until it holds; the time it took, or None after `limit`.
pub fn poll(limit: Duration, every: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let t0 = Instant::now();
    loop {
        if f() {
            return Some(t0.elapsed());
        }
        if t0.elapsed() > limit {
            return None;
        }
        std::thread::sleep(every);
    }
}

/// Polls `f` every 5 ms (blocking); whether it held within `limit` (benches, the soak).
pub fn wait_until(limit: Duration, f: impl FnMut() -> bool) -> bool {
    poll(limit, Duration::from_millis(5), f).is_some()
}

/// Polls `f` every 50 ms (blocking) until it holds and returns the time it took; panics after
/// `limit` with `what` and `context()` (a log, a journal).
pub fn wait_sync(
    what: &str,
    limit: Duration,
    f: impl FnMut() -> bool,
    context: impl FnOnce() -> String,
) -> Duration {
    match poll(limit, Duration::from_millis(50), f) {
        Some(d) => d,
        None => panic!("timed out waiting for {what} ({limit:?})\n{}", context()),
    }
}

// ---------------------------------------------------------------------------------------------
// Counting the daemon's looks

/// How long [`wait_looks`] waits at most: generous, for a loaded machine; it returns as soon as
/// the looks are counted.
pub const LOOKS_LIMIT: Duration = Duration::from_secs(30);

/// Waits (blocking, up to [`LOOKS_LIMIT`]) until `looks` counts `n` more than when called: the
/// daemon looked `n` more times since the fact awaited before. Asserting an absence after it
/// (no second incident, no order) means the daemon had `n` chances to do the wrong thing.
/// `looks` is any count of the daemon's own looks: the fake libnvidia-ml's polls
/// ([`Daemon::nvml_polls`]), a counting double ([`Looks`]), the proxy's calls of one operation,
/// the fake IMDS's reads of one path. Returns the time it took; panics with `what` and
/// `context()` after the limit.
pub fn wait_looks(
    what: &str,
    n: usize,
    mut looks: impl FnMut() -> usize,
    context: impl FnOnce() -> String,
) -> Duration {
    let want = looks() + n;
    wait_sync(
        &format!("{what} ({n} more looks)"),
        LOOKS_LIMIT,
        || looks() >= want,
        context,
    )
}

/// [`wait_looks`] on the current runtime (for counts that the runtime's own servers, the proxy
/// and the fake IMDS, keep).
pub async fn wait_looks_async(what: &str, n: usize, mut looks: impl FnMut() -> usize) {
    let want = looks() + n;
    wait_for(&format!("{what} ({n} more looks)"), LOOKS_LIMIT, || {
        let now = looks();
        async move { now >= want }
    })
    .await;
}

/// A double's count of its calls: a file it appends one line to each time it is called (a
/// script made by [`Looks::script`]; the fake libnvidia-ml's `FAKE_NVML_POLLS` writes the
/// same kind of file, one pid a line).
#[derive(Debug, Clone)]
pub struct Looks {
    path: PathBuf,
}

impl Looks {
    /// The count kept in `path` (none yet while it does not exist).
    pub fn at(path: impl Into<PathBuf>) -> Looks {
        Looks { path: path.into() }
    }

    /// A `/bin/sh` script at `script` (mode 0755) that counts each call in `<script>.looks`
    /// (one line, the caller's pid), then runs `body` with the call's arguments; its count.
    pub fn script(script: &Path, body: &str) -> Looks {
        use std::os::unix::fs::PermissionsExt;
        let looks = Looks::at(format!("{}.looks", script.display()));
        std::fs::write(
            script,
            format!(
                "#!/bin/sh\necho $PPID >> '{}'\n{body}\n",
                looks.path.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(script, std::fs::Permissions::from_mode(0o755)).unwrap();
        looks
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Calls counted so far.
    pub fn count(&self) -> usize {
        std::fs::read_to_string(&self.path)
            .unwrap_or_default()
            .lines()
            .count()
    }

    /// Calls counted so far from process `pid` (a daemon, not a CLI run beside it).
    pub fn count_from(&self, pid: u32) -> usize {
        let pid = pid.to_string();
        std::fs::read_to_string(&self.path)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.trim() == pid)
            .count()
    }

    /// [`wait_looks`] on this count.
    pub fn wait_more(&self, what: &str, n: usize, context: impl FnOnce() -> String) -> Duration {
        wait_looks(what, n, || self.count(), context)
    }
}

// ---------------------------------------------------------------------------------------------
// Time

/// Wall clock in milliseconds (f64), comparable with journal stamps.
pub fn now_ms() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64() * 1000.0)
        .unwrap_or(0.0)
}

/// A journal or inputs stamp (`"at"`) in ms.
pub fn parse_at(s: &str) -> Option<f64> {
    let t = humantime::parse_rfc3339_weak(s).ok()?;
    Some(t.duration_since(UNIX_EPOCH).ok()?.as_secs_f64() * 1000.0)
}

// ---------------------------------------------------------------------------------------------
// Fake NVML files

/// A fake NVML configuration of four GPUs with fixed identities (UUID, PCI bus id, serial).
pub const FOUR_GPUS: &str = r#"{"driver_version": "570.172.08", "gpus": [
  {"uuid": "GPU-00000000-aaaa-bbbb-cccc-000000000000", "pci_bus_id": "00000000:10:00.0", "serial": "S0"},
  {"uuid": "GPU-11111111-aaaa-bbbb-cccc-111111111111", "pci_bus_id": "00000000:20:00.0", "serial": "S1"},
  {"uuid": "GPU-22222222-aaaa-bbbb-cccc-222222222222", "pci_bus_id": "00000000:30:00.0", "serial": "S2"},
  {"uuid": "GPU-33333333-aaaa-bbbb-cccc-333333333333", "pci_bus_id": "00000000:40:00.0", "serial": "S3"}
]}"#;

/// A fake NVML configuration with `n` H200 GPUs (identities from the fake's defaults).
pub fn gpus_json(n: usize) -> String {
    let gpus = vec!["{}"; n].join(",");
    format!(r#"{{"driver_version": "570.172.08", "gpus": [{gpus}]}}"#)
}

/// Rows of a tab-separated table whose first line (after `#` comments and blank lines) names
/// the columns, each row by column name (the fixtures' tables: tests/fixtures/gpus/expected.tsv,
/// tests/fixtures/driver-lines.tsv; `fake_nvml::fixtures::tsv`). A table that cannot be read,
/// or a row of another width, fails naming its line.
pub fn tsv(path: &Path) -> Vec<std::collections::BTreeMap<String, String>> {
    fake_nvml::fixtures::tsv(path).unwrap_or_else(|e| panic!("{e}"))
}

/// Writes `json` into an injection folder atomically (`.tmp`, then rename); the fake library
/// applies files in name order, so `seq` orders them.
pub fn inject(dir: &Path, seq: u64, json: &str) {
    let tmp = dir.join(format!("{seq:08}.json.tmp"));
    std::fs::write(&tmp, json).unwrap();
    std::fs::rename(&tmp, dir.join(format!("{seq:08}.json"))).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Signals

pub fn signal(pid: u32, sig: libc::c_int) {
    if pid == 0 {
        return;
    }
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is a process the caller
    // started (or found by its own pipe directory), never 0 or -1.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// SIGTERM, then SIGKILL after `grace`; returns the exit status if it ended by itself.
pub fn stop_child(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    signal(child.id(), libc::SIGTERM);
    let t0 = Instant::now();
    while t0.elapsed() < grace {
        if let Ok(Some(s)) = child.try_wait() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// A TCP port on 127.0.0.1 that was free a moment ago (for an endpoint a test starts).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}
