//! The built-in CUDA check (docs/diagnose.md): what each GPU does when made to work, through
//! the driver's own `libcuda.so.1`, with no CUDA toolkit on the node.
//!
//! Per GPU, one after the other: a context (`context`, or `mps-client` when the check runs as
//! a client of the node's MPS daemon: a GPU on which the MPS server cannot start fails here),
//! a share of free memory written with five patterns and read back (`memory`), a kernel with
//! a known answer checked element by element (`kernel`), host↔device copy speed
//! (`bandwidth`) and arithmetic speed (`throughput`). The two figures are then held against
//! the median of the GPU's siblings of the same model in the same run (a GPU under half of it
//! is a straggler and fails) and against a low per-model floor ([`FLOORS`]).
//!
//! **Why a child process.** A GPU that hangs hangs the thread that called the driver, and a
//! driver fault can crash the process. The check therefore runs in a worker
//! (`gpu-medic __cuda-worker`, [`worker_main`]) in a process group of its own, which [`run`]
//! kills whole at the deadline. The worker streams one JSON event per line ([`Event`]) as it
//! goes, so what finished before a hang or a crash is kept, and the GPU and test that were
//! under way are named.
//!
//! **Why our own FFI rather than a crate.** The check needs some thirty driver calls
//! ([`ffi`]). `cudarc` would provide them with dynamic loading, but it is a large crate
//! generated for every CUDA version, compiled on every build of a project that fights build
//! time; `libloading` is already in the build (nvml-wrapper uses it) and the bindings are a
//! page of `cuda.h` signatures.
//!
//! **What is never a pass.** A library that cannot be loaded, a driver that cannot start
//! (`cuInit`) or lists no GPU: the tier did not run (a configuration or environment matter,
//! not a GPU fault). A timeout, a crash, unreadable output, or PTX the driver's JIT refuses:
//! could not tell. A GPU NVML lists that the CUDA driver does not, or on which a context
//! cannot be made, fails.

mod ffi;
mod worker;

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::model::diagnosis::{
    Cause, DiagResult, GpuDiagnosis, Level, MAX_RAW, TestResult, TestStatus, Tier, TierRun,
};
use crate::sys::child::GroupKill;

pub use worker::worker_main;

/// What the CUDA tier tests and how.
#[derive(Debug, Clone)]
pub struct CudaPlan {
    /// The driver's library (`libcuda.so.1`, found by the dynamic loader, or a path).
    pub library: PathBuf,
    pub level: Level,
    /// The GPUs asked for (NVML index, UUID); empty: every GPU the driver lists.
    pub gpus: Vec<(u32, String)>,
    pub timeout: Duration,
    /// The node's MPS pipe directory when the check is to run as an MPS client.
    pub mps_pipe: Option<PathBuf>,
    /// The gpu-medic binary whose hidden worker command runs the check in a child.
    pub exe: PathBuf,
    /// More environment for the worker (tests point a fake driver library at its
    /// configuration this way); set after the variables [`run`] sets itself.
    pub env: Vec<(String, String)>,
}

/// `gpu-medic __cuda-worker`: runs the check in this process and prints its events. Hidden:
/// [`run`] starts it.
#[derive(Debug, Clone, clap::Args)]
pub struct WorkerArgs {
    /// The CUDA driver library.
    #[arg(long, value_name = "PATH", default_value = "libcuda.so.1")]
    pub library: PathBuf,
    /// quick, standard or long.
    #[arg(long, default_value = "quick", value_parser = parse_level)]
    pub level: Level,
    /// A GPU to test, by UUID or by CUDA ordinal in PCI bus order (repeat); none: every GPU.
    #[arg(long = "gpu", value_name = "UUID_OR_INDEX")]
    pub gpus: Vec<String>,
    /// The check runs as a client of the node's MPS daemon (CUDA_MPS_PIPE_DIRECTORY is set).
    #[arg(long)]
    pub mps: bool,
}

fn parse_level(s: &str) -> Result<Level, String> {
    Level::parse(s).ok_or_else(|| format!("unknown level {s:?}: quick, standard or long"))
}

/// One line of the worker's output.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum Event {
    /// The tier can tell nothing: the library cannot be loaded, the driver cannot start, no
    /// GPU is listed.
    Unusable { why: String },
    /// The driver refused to start as an MPS client: every GPU asked fails `mps-client`.
    MpsRefused { why: String },
    /// The tests that follow are on this GPU. `asked`: the `--gpu` argument it answers, if
    /// any; `ordinal`: its CUDA ordinal, if the driver lists it.
    Device {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        asked: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ordinal: Option<u32>,
        uuid: String,
        name: String,
    },
    /// A test starts on the current GPU.
    Begin { test: String },
    /// A test's result on the current GPU.
    Test { result: TestResult },
    /// The current GPU's context and memory were released (closes a `teardown` begun).
    Released,
    /// Every GPU was tested.
    End,
}

/// At most this much of the worker's stdout is read (its events are a few hundred bytes
/// each); the rest is drained and dropped.
const MAX_STDOUT: usize = 1024 * 1024;
/// The last this-many bytes of the worker's stderr are kept.
const MAX_STDERR: usize = 16 * 1024;
/// How much of the stderr tail goes into a message.
const TAIL_IN_MESSAGE: usize = 600;
/// How long the output readers get once the worker's group is dead.
const READER_GRACE: Duration = Duration::from_secs(2);

/// Runs the check in a worker process and judges what it found.
pub fn run(plan: &CudaPlan) -> (TierRun, Vec<GpuDiagnosis>) {
    let start = Instant::now();
    let mut cmd = worker_command(plan);
    let collected = collect(&mut cmd, plan.timeout);
    let ms = u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
    match collected {
        Ok(c) => assemble(&plan.gpus, plan.timeout, &c, ms),
        Err(e) => (
            TierRun {
                tier: Tier::Cuda,
                ran: false,
                result: DiagResult::Unknown,
                why: format!("cannot start the worker {}: {e}", plan.exe.display()),
                cause: Some(Cause::Tool),
                notes: Vec::new(),
                duration_ms: ms,
                raw: String::new(),
            },
            Vec::new(),
        ),
    }
}

/// The key the worker answers an asked GPU by: its UUID, or its index when NVML gave none.
fn asked_key(index: u32, uuid: &str) -> String {
    if uuid.is_empty() {
        index.to_string()
    } else {
        uuid.to_string()
    }
}

/// The worker's command line and environment. The driver reads its environment at `cuInit`,
/// so what it must see is set here, on the child, not in the worker.
fn worker_command(plan: &CudaPlan) -> Command {
    let mut cmd = Command::new(&plan.exe);
    cmd.arg("__cuda-worker")
        .arg("--library")
        .arg(&plan.library)
        .arg("--level")
        .arg(plan.level.as_str());
    if plan.mps_pipe.is_some() {
        cmd.arg("--mps");
    }
    for (index, uuid) in &plan.gpus {
        cmd.arg("--gpu").arg(asked_key(*index, uuid));
    }
    // CUDA ordinals in PCI bus order, as NVML numbers GPUs; every GPU visible.
    cmd.env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        .env_remove("CUDA_VISIBLE_DEVICES");
    match &plan.mps_pipe {
        // A client of the node's MPS control daemon: the driver connects through this
        // directory's pipes at cuInit.
        Some(dir) => cmd.env("CUDA_MPS_PIPE_DIRECTORY", dir),
        None => cmd.env_remove("CUDA_MPS_PIPE_DIRECTORY"),
    };
    for (k, v) in &plan.env {
        cmd.env(k, v);
    }
    cmd
}

/// How the worker ended.
#[derive(Debug, Clone)]
enum Ending {
    Exited(ExitStatus),
    TimedOut,
    Lost(String),
}

/// What came back from the worker.
#[derive(Debug, Clone)]
struct Collected {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    ending: Ending,
}

/// Reads `r` to its end, keeping at most `cap` bytes: the first ones, or with `tail` the last.
fn read_capped(mut r: impl Read, cap: usize, tail: bool) -> Vec<u8> {
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        match r.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let got = buf.get(..n).unwrap_or_default();
                if tail {
                    kept.extend_from_slice(got);
                    if kept.len() > cap {
                        let extra = kept.len() - cap;
                        kept.drain(..extra);
                    }
                } else if kept.len() < cap {
                    let room = cap - kept.len();
                    kept.extend_from_slice(got.get(..room.min(n)).unwrap_or_default());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
    kept
}

/// Starts the worker in a process group of its own (SIGKILLed should gpu-medic die), waits
/// at most `timeout`, then kills whatever is left of the group either way.
fn collect(cmd: &mut Command, timeout: Duration) -> Result<Collected, std::io::Error> {
    use std::os::unix::process::CommandExt;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl,
    // which is async-signal-safe and touches no memory shared with the parent. The kernel
    // then kills the worker if the thread that spawned it exits; that thread waits for the
    // worker below, so it outlives it.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn()?;
    let mut group = GroupKill::new(Some(child.id()));
    let (out_tx, out_rx) = mpsc::channel();
    let (err_tx, err_rx) = mpsc::channel();
    if let Some(out) = child.stdout.take() {
        std::thread::spawn(move || {
            let _ = out_tx.send(read_capped(out, MAX_STDOUT, false));
        });
    }
    if let Some(err) = child.stderr.take() {
        std::thread::spawn(move || {
            let _ = err_tx.send(read_capped(err, MAX_STDERR, true));
        });
    }
    let until = Instant::now() + timeout;
    let ending = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Ending::Exited(s),
            Ok(None) if Instant::now() < until => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => break Ending::TimedOut,
            Err(e) => break Ending::Lost(e.to_string()),
        }
    };
    // What the worker left in its group (the driver's helpers) holds the pipes open.
    group.kill();
    let _ = child.wait();
    let stdout = out_rx.recv_timeout(READER_GRACE).unwrap_or_default();
    let stderr = err_rx.recv_timeout(READER_GRACE).unwrap_or_default();
    Ok(Collected {
        stdout,
        stderr,
        ending,
    })
}

/// One GPU as the worker reported it.
#[derive(Debug, Clone, Default, PartialEq)]
struct Found {
    asked: Option<String>,
    ordinal: Option<u32>,
    uuid: String,
    name: String,
    tests: Vec<TestResult>,
    /// The test begun and not finished.
    current: Option<String>,
}

/// The worker's events, put together.
#[derive(Debug, Clone, Default, PartialEq)]
struct Folded {
    unusable: Option<String>,
    mps_refused: Option<String>,
    devices: Vec<Found>,
    end: bool,
    /// Lines that were not events (the last, cut one of a killed worker aside): said in
    /// the tier's `why`. Stray output (a library printing on stdout) around a complete event
    /// stream does not change the verdict; without the `end` event nothing is a pass anyway.
    bad_lines: usize,
    first_bad: String,
}

fn fold(stdout: &[u8]) -> Folded {
    let text = String::from_utf8_lossy(stdout);
    let mut f = Folded::default();
    let lines: Vec<&str> = text.split('\n').collect();
    let last = lines.len().saturating_sub(1);
    for (i, line) in lines.iter().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let event: Event = match serde_json::from_str(line) {
            Ok(e) => e,
            Err(_) => {
                // A killed worker may leave half a line last: that is not garbage.
                if i != last {
                    if f.bad_lines == 0 {
                        f.first_bad = line.chars().take(200).collect();
                    }
                    f.bad_lines += 1;
                }
                continue;
            }
        };
        match event {
            Event::Unusable { why } => f.unusable = Some(why),
            Event::MpsRefused { why } => f.mps_refused = Some(why),
            Event::Device {
                asked,
                ordinal,
                uuid,
                name,
            } => f.devices.push(Found {
                asked,
                ordinal,
                uuid,
                name,
                ..Found::default()
            }),
            Event::Begin { test } => {
                if let Some(d) = f.devices.last_mut() {
                    d.current = Some(test);
                }
            }
            Event::Test { mut result } => {
                if let Some(d) = f.devices.last_mut() {
                    d.current = None;
                    result.tier = Tier::Cuda;
                    d.tests.push(result);
                }
            }
            Event::Released => {
                if let Some(d) = f.devices.last_mut() {
                    d.current = None;
                }
            }
            Event::End => f.end = true,
        }
    }
    f
}

fn describe(status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(s)) => format!("was killed by signal {s}"),
        (None, None) => "ended".to_string(),
    }
}

/// The last [`TAIL_IN_MESSAGE`] characters of stderr on one line, or nothing.
fn stderr_tail(stderr: &[u8]) -> String {
    let text = String::from_utf8_lossy(stderr);
    let one: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let n = one.chars().count();
    one.chars()
        .skip(n.saturating_sub(TAIL_IN_MESSAGE))
        .collect()
}

fn unknown(test: &str, message: String) -> TestResult {
    TestResult {
        tier: Tier::Cuda,
        test: test.to_string(),
        status: TestStatus::Unknown,
        message,
        duration_ms: None,
        value: None,
        unit: String::new(),
    }
}

/// Turns what came back into the tier's run and its per-GPU findings (pure: no process).
fn assemble(
    asked: &[(u32, String)],
    timeout: Duration,
    c: &Collected,
    ms: u64,
) -> (TierRun, Vec<GpuDiagnosis>) {
    let mut f = fold(&c.stdout);
    let mut raw = String::from_utf8_lossy(&c.stdout).into_owned();
    if !c.stderr.is_empty() {
        raw.push_str("\n--- stderr ---\n");
        raw.push_str(&String::from_utf8_lossy(&c.stderr));
    }
    crate::model::cut(&mut raw, MAX_RAW);
    let timed_out = matches!(c.ending, Ending::TimedOut);
    let tier = |ran: bool, result: DiagResult, why: String| TierRun {
        tier: Tier::Cuda,
        ran,
        result,
        why,
        cause: match (ran, result) {
            (false, _) => Some(Cause::NoTool),
            (true, DiagResult::Unknown) if timed_out => Some(Cause::Timeout),
            (true, DiagResult::Unknown) => Some(Cause::Tool),
            _ => None,
        },
        notes: Vec::new(),
        duration_ms: ms,
        raw: raw.clone(),
    };
    if let Some(why) = f.unusable.take() {
        return (tier(false, DiagResult::Unknown, why), Vec::new());
    }
    let interrupted = interruption(&f, &c.ending, timeout, &stderr_tail(&c.stderr));
    if let Some(why) = f.mps_refused.take() {
        return (
            tier(true, DiagResult::Fail, why.clone()),
            mps_refused(asked, &why),
        );
    }
    // Where the worker was cut off, the test under way could not tell.
    if let Some(why) = &interrupted {
        for d in &mut f.devices {
            if let Some(test) = d.current.take() {
                d.tests
                    .push(unknown(&test, format!("{why} during the {test} test")));
            }
        }
    }
    judge_figures(&mut f.devices);
    let gpus = per_gpu(asked, &f.devices, interrupted.as_deref());
    if gpus.is_empty() && interrupted.is_none() {
        return (
            tier(false, DiagResult::Unknown, "the worker found no GPU".into()),
            gpus,
        );
    }
    let mut why = interrupted.clone().unwrap_or_default();
    if f.bad_lines > 0 {
        let bad = format!(
            "{} unreadable line(s) from the worker, first: {:?}",
            f.bad_lines, f.first_bad
        );
        why = if why.is_empty() {
            bad
        } else {
            format!("{why}; {bad}")
        };
    }
    let result = if gpus.iter().any(|g| g.result == DiagResult::Fail) {
        DiagResult::Fail
    } else if interrupted.is_some() || gpus.is_empty() || gpus.iter().any(|g| !g.result.passed()) {
        DiagResult::Unknown
    } else {
        DiagResult::Pass
    };
    if why.is_empty() && result == DiagResult::Unknown {
        why = "could not tell on every GPU".to_string();
    }
    (tier(true, result, why), gpus)
}

/// Why the worker did not finish, if it did not.
fn interruption(f: &Folded, ending: &Ending, timeout: Duration, tail: &str) -> Option<String> {
    if f.end {
        return None;
    }
    let with_tail = |s: String| {
        if tail.is_empty() {
            s
        } else {
            format!("{s}: {tail}")
        }
    };
    Some(match ending {
        Ending::TimedOut => format!(
            "timed out after {} (the worker's process group was killed)",
            humantime::format_duration(timeout)
        ),
        Ending::Exited(s) => with_tail(format!("the worker {} before finishing", describe(s))),
        Ending::Lost(e) => with_tail(format!("lost the worker: {e}")),
    })
}

/// Every GPU asked fails `mps-client`: the driver would not start as an MPS client.
fn mps_refused(asked: &[(u32, String)], why: &str) -> Vec<GpuDiagnosis> {
    asked
        .iter()
        .map(|(index, uuid)| {
            let mut g = GpuDiagnosis {
                index: *index,
                uuid: uuid.clone(),
                result: DiagResult::Unknown,
                tests: vec![TestResult {
                    status: TestStatus::Fail,
                    ..unknown("mps-client", why.to_string())
                }],
            };
            g.judge();
            g
        })
        .collect()
}

/// The findings per GPU asked (or per GPU the worker found, when none was asked), judged.
fn per_gpu(
    asked: &[(u32, String)],
    devices: &[Found],
    interrupted: Option<&str>,
) -> Vec<GpuDiagnosis> {
    let mut gpus: Vec<GpuDiagnosis> = Vec::new();
    if asked.is_empty() {
        for d in devices {
            let Some(ordinal) = d.ordinal else { continue };
            gpus.push(GpuDiagnosis {
                index: ordinal,
                uuid: d.uuid.clone(),
                result: DiagResult::Unknown,
                tests: d.tests.clone(),
            });
        }
    } else {
        for (index, uuid) in asked {
            let key = asked_key(*index, uuid);
            let found = devices.iter().find(|d| d.asked.as_deref() == Some(&key));
            let tests = match found {
                Some(d) => d.tests.clone(),
                None => vec![unknown(
                    "cuda",
                    match interrupted {
                        Some(why) => format!("not reached: {why}"),
                        None => "the worker did not report this GPU".to_string(),
                    },
                )],
            };
            let uuid = match (uuid.is_empty(), found) {
                (true, Some(d)) => d.uuid.clone(),
                _ => uuid.clone(),
            };
            gpus.push(GpuDiagnosis {
                index: *index,
                uuid,
                result: DiagResult::Unknown,
                tests,
            });
        }
    }
    for g in &mut gpus {
        g.judge();
    }
    gpus
}

/// Low floors per GPU model for the two figures: (model token in the CUDA device name,
/// host↔device GB/s, GFLOP/s of the FP32 FMA loop). A figure under its floor warns; under a
/// quarter of it, it fails.
///
/// Copy floors are about 40 % of what page-locked copies reach on the model's PCIe link
/// (Gen5 x16 ≈ 50 GB/s: H100, H200; Gen4 x16 ≈ 25 GB/s: A100, A10G, L4, L40S; Gen3 x16 ≈
/// 12 GB/s: T4), so that pageable copies on a busy host still clear them. Arithmetic floors
/// are about 20 % of NVIDIA's published FP32 peak (H100/H200 SXM 67 TFLOPS, A100 19.5,
/// A10G 31.2, L4 30.3, L40S 91.6, T4 8.1): the loop does not reach peak, and L4 and T4 are
/// power-capped well below it.
pub const FLOORS: &[(&str, f64, f64)] = &[
    ("H200", 20.0, 10_000.0),
    ("H100", 20.0, 10_000.0),
    ("A100", 10.0, 4_000.0),
    ("A10G", 10.0, 6_000.0),
    ("L40S", 10.0, 18_000.0),
    ("L4", 10.0, 6_000.0),
    ("T4", 5.0, 1_600.0),
];

/// The floor of `test` (`bandwidth` or `throughput`) for a GPU named `name`, with the model.
fn floor_for(name: &str, test: &str) -> Option<(&'static str, f64)> {
    let tokens: Vec<&str> = name
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| !t.is_empty())
        .collect();
    FLOORS
        .iter()
        .find(|(model, _, _)| tokens.iter().any(|t| t.eq_ignore_ascii_case(model)))
        .and_then(|(model, copy, flops)| match test {
            "bandwidth" => Some((*model, *copy)),
            "throughput" => Some((*model, *flops)),
            _ => None,
        })
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let mid = v.get(n / 2).copied()?;
    if n % 2 == 1 {
        Some(mid)
    } else {
        Some((v.get(n / 2 - 1).copied()? + mid) / 2.0)
    }
}

/// A straggler is under this share of its siblings' median.
const STRAGGLER_SHARE: f64 = 0.5;
/// Under this share of its model's floor a figure fails; under the floor it warns.
const FLOOR_FAIL_SHARE: f64 = 0.25;

/// Holds each GPU's `bandwidth` and `throughput` figures against its siblings (same model
/// name, same run) and its model's floor; a measured figure that passed may become a warning
/// or a failure, with the comparison in its message.
fn judge_figures(devices: &mut [Found]) {
    for test in ["bandwidth", "throughput"] {
        let figures: Vec<(usize, String, f64)> = devices
            .iter()
            .enumerate()
            .filter_map(|(i, d)| {
                d.tests
                    .iter()
                    .find(|t| t.test == test && t.status == TestStatus::Pass)
                    .and_then(|t| t.value)
                    .filter(|v| v.is_finite())
                    .map(|v| (i, d.name.clone(), v))
            })
            .collect();
        for (i, name, v) in &figures {
            let siblings: Vec<f64> = figures
                .iter()
                .filter(|(j, n, _)| j != i && n == name)
                .map(|(_, _, v)| *v)
                .collect();
            let Some(t) = devices
                .get_mut(*i)
                .and_then(|d| d.tests.iter_mut().find(|t| t.test == test))
            else {
                continue;
            };
            let unit = t.unit.clone();
            if let Some(m) = median(siblings)
                && *v < STRAGGLER_SHARE * m
            {
                t.status = TestStatus::Fail;
                t.message = format!(
                    "straggler: {v:.1} {unit}, siblings' median {m:.1} {unit} ({}); {}",
                    name, t.message
                );
                continue;
            }
            if let Some((model, floor)) = floor_for(name, test) {
                if *v < FLOOR_FAIL_SHARE * floor {
                    t.status = TestStatus::Fail;
                    t.message = format!(
                        "{v:.1} {unit}, far below the {model} floor of {floor:.0} {unit}; {}",
                        t.message
                    );
                } else if *v < floor {
                    t.status = TestStatus::Warn;
                    t.message = format!(
                        "{v:.1} {unit}, below the {model} floor of {floor:.0} {unit}; {}",
                        t.message
                    );
                }
            }
        }
    }
}

/// A CUDA UUID (`CUuuid`'s 16 bytes) as NVML writes it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-
/// xxxxxxxxxxxx`.
pub fn format_uuid(b: &[u8; 16]) -> String {
    let hex = |r: std::ops::Range<usize>| -> String {
        b.get(r)
            .unwrap_or_default()
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn pass(test: &str, value: Option<f64>, unit: &str) -> TestResult {
        TestResult {
            tier: Tier::Cuda,
            test: test.into(),
            status: TestStatus::Pass,
            message: "measured".into(),
            duration_ms: Some(1),
            value,
            unit: unit.into(),
        }
    }

    fn line(e: &Event) -> String {
        serde_json::to_string(e).unwrap() + "\n"
    }

    fn device(asked: Option<&str>, ordinal: u32, name: &str) -> Event {
        Event::Device {
            asked: asked.map(str::to_string),
            ordinal: Some(ordinal),
            uuid: format!("GPU-{ordinal}"),
            name: name.into(),
        }
    }

    fn full_gpu(out: &mut String, asked: Option<&str>, ordinal: u32, gbps: f64, gflops: f64) {
        out.push_str(&line(&device(asked, ordinal, "NVIDIA H200")));
        for t in ["context", "memory", "kernel"] {
            out.push_str(&line(&Event::Begin { test: t.into() }));
            out.push_str(&line(&Event::Test {
                result: pass(t, None, ""),
            }));
        }
        out.push_str(&line(&Event::Test {
            result: pass("bandwidth", Some(gbps), "GB/s"),
        }));
        out.push_str(&line(&Event::Test {
            result: pass("throughput", Some(gflops), "GFLOP/s"),
        }));
    }

    fn collected(stdout: String, ending: Ending) -> Collected {
        Collected {
            stdout: stdout.into_bytes(),
            stderr: Vec::new(),
            ending,
        }
    }

    fn exited(code: i32) -> Ending {
        Ending::Exited(ExitStatus::from_raw(code << 8))
    }

    fn asked(n: u32) -> Vec<(u32, String)> {
        (0..n).map(|i| (i, format!("GPU-{i}"))).collect()
    }

    #[test]
    fn uuid_is_formatted_as_nvml_does() {
        let b: [u8; 16] = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ];
        assert_eq!(format_uuid(&b), "GPU-12345678-9abc-def0-0123-456789abcdef");
        assert_eq!(
            format_uuid(&[0; 16]),
            "GPU-00000000-0000-0000-0000-000000000000"
        );
    }

    #[test]
    fn a_full_run_passes_every_gpu() {
        let mut out = String::new();
        for i in 0..4 {
            full_gpu(&mut out, Some(&format!("GPU-{i}")), i, 50.0, 40_000.0);
        }
        out.push_str(&line(&Event::End));
        let (run, gpus) = assemble(
            &asked(4),
            Duration::from_secs(9),
            &collected(out, exited(0)),
            5,
        );
        assert!(run.ran);
        assert_eq!(run.result, DiagResult::Pass, "{run:?}");
        assert_eq!(gpus.len(), 4);
        assert!(gpus.iter().all(|g| g.result == DiagResult::Pass));
        assert_eq!(gpus[2].tests.len(), 5);
    }

    #[test]
    fn a_straggler_fails_against_its_siblings() {
        let mut out = String::new();
        for i in 0..4 {
            let gbps = if i == 1 { 5.0 } else { 50.0 };
            full_gpu(&mut out, None, i, gbps, 40_000.0);
        }
        out.push_str(&line(&Event::End));
        let (run, gpus) = assemble(&[], Duration::from_secs(9), &collected(out, exited(0)), 5);
        assert_eq!(run.result, DiagResult::Fail);
        let bw = gpus[1]
            .tests
            .iter()
            .find(|t| t.test == "bandwidth")
            .unwrap();
        assert_eq!(bw.status, TestStatus::Fail);
        assert!(
            bw.message
                .contains("straggler: 5.0 GB/s, siblings' median 50.0 GB/s"),
            "{}",
            bw.message
        );
        assert_eq!(gpus[0].result, DiagResult::Pass);
    }

    #[test]
    fn figures_against_the_model_floor() {
        let mk = |name: &str, gbps: f64| Found {
            name: name.into(),
            tests: vec![pass("bandwidth", Some(gbps), "GB/s")],
            ..Found::default()
        };
        // Alone (no siblings): only the floor. Under it warns, far under fails.
        let mut d = vec![mk("NVIDIA H200", 12.0)];
        judge_figures(&mut d);
        assert_eq!(d[0].tests[0].status, TestStatus::Warn);
        let mut d = vec![mk("NVIDIA H200", 4.0)];
        judge_figures(&mut d);
        assert_eq!(d[0].tests[0].status, TestStatus::Fail);
        assert!(d[0].tests[0].message.contains("far below the H200 floor"));
        // A model without a floor: only siblings.
        let mut d = vec![mk("Some GPU", 0.5)];
        judge_figures(&mut d);
        assert_eq!(d[0].tests[0].status, TestStatus::Pass);
        // Siblings are the same model only.
        let mut d = vec![mk("NVIDIA L4", 20.0), mk("NVIDIA L40S", 50.0)];
        judge_figures(&mut d);
        assert!(d.iter().all(|g| g.tests[0].status == TestStatus::Pass));
        assert_eq!(
            floor_for("NVIDIA L40S", "throughput"),
            Some(("L40S", 18_000.0))
        );
        assert_eq!(floor_for("NVIDIA L4", "bandwidth"), Some(("L4", 10.0)));
        assert_eq!(
            floor_for("NVIDIA A100-SXM4-80GB", "bandwidth"),
            Some(("A100", 10.0))
        );
        assert_eq!(floor_for("Tesla T4", "throughput"), Some(("T4", 1_600.0)));
        assert_eq!(
            floor_for("NVIDIA H100 80GB HBM3", "bandwidth"),
            Some(("H100", 20.0))
        );
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![f64::NAN]), None);
    }

    #[test]
    fn a_timeout_keeps_what_finished_and_names_what_was_under_way() {
        let mut out = String::new();
        full_gpu(&mut out, Some("GPU-0"), 0, 50.0, 40_000.0);
        out.push_str(&line(&device(Some("GPU-1"), 1, "NVIDIA H200")));
        out.push_str(&line(&Event::Begin {
            test: "kernel".into(),
        }));
        out.push_str("{\"event\":\"te"); // cut mid-line by the kill
        let (run, gpus) = assemble(
            &asked(3),
            Duration::from_secs(3),
            &collected(out, Ending::TimedOut),
            3000,
        );
        assert!(run.ran);
        assert_eq!(run.result, DiagResult::Unknown);
        assert!(run.why.contains("timed out after 3s"), "{}", run.why);
        assert!(!run.why.contains("unreadable"), "{}", run.why);
        assert_eq!(gpus[0].result, DiagResult::Pass);
        assert_eq!(gpus[1].result, DiagResult::Unknown);
        let k = gpus[1].tests.iter().find(|t| t.test == "kernel").unwrap();
        assert_eq!(k.status, TestStatus::Unknown);
        assert!(
            k.message.contains("during the kernel test"),
            "{}",
            k.message
        );
        assert_eq!(gpus[2].result, DiagResult::Unknown);
        assert!(
            gpus[2].tests[0]
                .message
                .starts_with("not reached: timed out")
        );
    }

    #[test]
    fn a_hang_releasing_a_gpu_is_charged_to_it() {
        let mut out = String::new();
        full_gpu(&mut out, Some("GPU-0"), 0, 50.0, 40_000.0);
        out.push_str(&line(&Event::Begin {
            test: "teardown".into(),
        }));
        out.push_str(&line(&Event::Released));
        full_gpu(&mut out, Some("GPU-1"), 1, 50.0, 40_000.0);
        out.push_str(&line(&Event::Begin {
            test: "teardown".into(),
        }));
        let (run, gpus) = assemble(
            &asked(2),
            Duration::from_secs(3),
            &collected(out, Ending::TimedOut),
            1,
        );
        assert_eq!(run.result, DiagResult::Unknown);
        assert_eq!(gpus[0].result, DiagResult::Pass, "{gpus:#?}");
        assert_eq!(gpus[1].result, DiagResult::Unknown);
        assert!(
            gpus[1]
                .tests
                .iter()
                .any(|t| t.test == "teardown" && t.message.contains("timed out after 3s"))
        );
    }

    #[test]
    fn a_crash_or_garbage_is_unknown_with_the_stderr_tail() {
        let c = Collected {
            stdout: b"Segmentation fault\n".to_vec(),
            stderr: b"libcuda: something broke\n".to_vec(),
            ending: Ending::Exited(ExitStatus::from_raw(11)),
        };
        let (run, gpus) = assemble(&asked(1), Duration::from_secs(3), &c, 1);
        assert!(run.ran);
        assert_eq!(run.result, DiagResult::Unknown);
        assert!(run.why.contains("killed by signal 11"), "{}", run.why);
        assert!(run.why.contains("something broke"), "{}", run.why);
        assert!(run.why.contains("unreadable"), "{}", run.why);
        assert_eq!(gpus[0].result, DiagResult::Unknown);
        // Nothing at all on stdout, exit 0: still not a pass.
        let (run, _) = assemble(
            &asked(1),
            Duration::from_secs(3),
            &collected(String::new(), exited(0)),
            1,
        );
        assert_eq!(run.result, DiagResult::Unknown);
    }

    #[test]
    fn stray_lines_around_a_complete_run_are_said_not_fatal() {
        let mut out = String::from("driver says hello\n");
        full_gpu(&mut out, Some("GPU-0"), 0, 50.0, 40_000.0);
        out.push_str(&line(&Event::End));
        let (run, gpus) = assemble(
            &asked(1),
            Duration::from_secs(3),
            &collected(out, exited(0)),
            1,
        );
        assert_eq!(run.result, DiagResult::Pass, "{run:?}");
        assert!(run.why.contains("1 unreadable line(s)"), "{}", run.why);
        assert_eq!(gpus[0].result, DiagResult::Pass);
    }

    #[test]
    fn unusable_is_not_run_and_mps_refusal_fails_every_gpu() {
        let out = line(&Event::Unusable {
            why: "cannot load /nope: no such file".into(),
        }) + &line(&Event::End);
        let (run, gpus) = assemble(
            &asked(2),
            Duration::from_secs(3),
            &collected(out, exited(0)),
            1,
        );
        assert!(!run.ran);
        assert_eq!(run.result, DiagResult::Unknown);
        assert!(gpus.is_empty());
        let out = line(&Event::MpsRefused {
            why: "cuInit: CUDA_ERROR_MPS_CONNECTION_FAILED (x)".into(),
        }) + &line(&Event::End);
        let (run, gpus) = assemble(
            &asked(2),
            Duration::from_secs(3),
            &collected(out, exited(0)),
            1,
        );
        assert!(run.ran);
        assert_eq!(run.result, DiagResult::Fail);
        assert_eq!(gpus.len(), 2);
        assert!(gpus.iter().all(|g| g.result == DiagResult::Fail
            && g.tests[0].test == "mps-client"
            && g.tests[0].message.contains("MPS_CONNECTION_FAILED")));
    }

    #[test]
    fn gpus_asked_by_index_take_the_uuid_the_worker_found() {
        let mut out = String::new();
        full_gpu(&mut out, Some("0"), 0, 50.0, 40_000.0);
        out.push_str(&line(&Event::End));
        let (run, gpus) = assemble(
            &[(0, String::new())],
            Duration::from_secs(3),
            &collected(out, exited(0)),
            1,
        );
        assert_eq!(run.result, DiagResult::Pass);
        assert_eq!(gpus[0].uuid, "GPU-0");
    }

    #[test]
    fn the_worker_command_sets_the_driver_environment() {
        let plan = CudaPlan {
            library: "/lib/libcuda.so.1".into(),
            level: Level::Standard,
            gpus: vec![(0, "GPU-a".into()), (3, String::new())],
            timeout: Duration::from_secs(1),
            mps_pipe: Some("/run/mps".into()),
            exe: "/usr/bin/gpu-medic".into(),
            env: vec![("X".into(), "1".into())],
        };
        let cmd = worker_command(&plan);
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "__cuda-worker",
                "--library",
                "/lib/libcuda.so.1",
                "--level",
                "standard",
                "--mps",
                "--gpu",
                "GPU-a",
                "--gpu",
                "3"
            ]
        );
        let env: Vec<(String, Option<String>)> = cmd
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into_owned(),
                    v.map(|v| v.to_string_lossy().into_owned()),
                )
            })
            .collect();
        assert!(env.contains(&("CUDA_DEVICE_ORDER".into(), Some("PCI_BUS_ID".into()))));
        assert!(env.contains(&("CUDA_VISIBLE_DEVICES".into(), None)));
        assert!(env.contains(&("CUDA_MPS_PIPE_DIRECTORY".into(), Some("/run/mps".into()))));
        assert!(env.contains(&("X".into(), Some("1".into()))));
    }

    #[test]
    fn capped_reads_keep_the_head_or_the_tail() {
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
        let head = read_capped(&data[..], 100, false);
        assert_eq!(head, data[..100]);
        let tail = read_capped(&data[..], 100, true);
        assert_eq!(tail, data[data.len() - 100..]);
    }
}
