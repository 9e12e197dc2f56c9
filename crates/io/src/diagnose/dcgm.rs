//! DCGM's diagnostics through `dcgmi diag -r N -j` (docs/diagnose.md): the tier that makes the
//! GPUs work with NVIDIA's own tests where DCGM is installed, read from its JSON.
//!
//! `dcgmi` runs in a process tree that is killed whole at the deadline ([`crate::sys::tree`]):
//! the diagnostic's own test processes (`nvvs` under an embedded host engine) die with it. At
//! the deadline `dcgmi` first gets `SIGTERM` and [`TERM_GRACE`]: on that signal it stops the
//! diagnostic it started, which also reaches one run by a standalone `nv-hostengine` (there the
//! tests are the host engine's children, outside our tree).
//!
//! What its output means (DCGM's source, `dcgmi/Diag.cpp`, `nvvs/include/NvvsJsonStrings.h`;
//! the 4.x document's schema `testing/python3/dcgm_diag_schema.json`):
//!
//! - DCGM 4.x: `{"DCGM Diagnostic": {"test_categories": [{"category", "tests": [{"name",
//!   "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": N, "status",
//!   "warnings": [{"warning", "error_id", "error_category", "error_severity"}], "info":
//!   [..]}], "test_summary": {"status", "warnings"}}]}]}, "entity_groups": [{"entity_group":
//!   "GPU", "entities": [{"entity_id", "serial_num", "device_id"}]}], "metadata": {"version",
//!   "Driver Version Detected"}}`.
//! - DCGM 3.x dcgmi: `{"DCGM GPU Diagnostic": {"test_categories": [...]}, "version", ...}`;
//!   per-GPU results are `{"gpu_id": "0", "status", "warnings": [{"warning", ...}], "info":
//!   "text"}`; the Deployment tests have one result for the whole run, with no id (`gpu_id`,
//!   an integer, only when one failed).
//! - DCGM 2.x/3.x NVVS: results name their GPUs as `"gpu_ids": "0,1,2"` (or a number).
//! - A run that could not complete: `{"DCGM Diagnostic": {"version", "runtime_error": "..."}}`.
//! - Statuses: `Pass`, `Fail`, `Skip`, `Warn` (printed as `Fail` by `dcgmi -j` itself), and
//!   `Not Run`; results of tests not run are left out.
//! - No UUIDs: GPUs are DCGM's GPU ids, which DCGM numbers in NVML's order (the NVML index).
//!
//! The rules (docs/diagnose.md, "How a document is read"): a result counts only for the GPU
//! it names, and every GPU present needs a pass of its own, else that GPU could not tell,
//! saying what is missing. A result whose id cannot be read (`"GPU-abc"`, `null`, `-1`, `1.5`,
//! a number past `u32`, an entity group that is not a GPU) or that names no GPU present counts
//! for no GPU: its failure could not tell (never a failure of the node, never a pass for every
//! GPU). A failure DCGM files as configuration (its Deployment category; severity
//! `DCGM_ERROR_CONFIG`; category `DCGM_FR_EC_SOFTWARE_CONFIG`) is a configuration finding,
//! "needs configuration", not a hardware fault; dcgmi answers it with exit 226
//! (`DCGM_ST_NVVS_ERROR`). DCGM's words for a busy GPU (CUDA's "busy or unavailable", its MPS
//! errors) could not tell. A failed test of a GPU present fails, whatever the exit code; an
//! exit code the document does not explain could not tell; no host engine, no `dcgmi`, no
//! diagnostic plugin or no permission means the tier did not run (never a hardware fault); a
//! timeout, cut or unreadable output could not tell.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::model::cut;
use crate::model::diagnosis::{
    Cause, DiagResult, GpuDiagnosis, Level, MAX_RAW, TestResult, TestStatus, Tier, TierRun,
};
use crate::sys::tree::{self, Ended, TreeError, TreeOutput};

#[derive(Debug, Clone)]
pub struct DcgmPlan {
    pub binary: PathBuf,
    pub level: Level,
    /// NVML indexes to test; `None`: every GPU DCGM sees.
    pub gpus: Option<Vec<u32>>,
    pub timeout: Duration,
    /// `dcgmi --host`: the host engine to use (`unix:///run/nvidia-dcgm/nv-hostengine` where it
    /// listens on a socket, as on the AL2023 ECS GPU AMI). `None`: dcgmi's default
    /// (`localhost:5555`, or an embedded host engine when none answers there).
    pub host: Option<String>,
}

/// At most this much of dcgmi's standard output is kept (the rest is read and dropped). A
/// level-3 run on 8 GPUs prints well under 1 MiB of JSON.
pub const MAX_OUTPUT: u64 = 4 * 1024 * 1024;
/// How long dcgmi gets, after `SIGTERM` at the deadline, to stop its diagnostic.
pub const TERM_GRACE: Duration = Duration::from_secs(10);
/// `{` positions tried as the start of the document.
const MAX_ATTEMPTS: usize = 256;
/// Text kept from the end of the output for messages.
const TAIL: usize = 400;

/// `dcgmi`'s exit codes: `main` returns the `dcgmReturn_t` of the command (negative, so the
/// exit code is 256 + it), or 128 + a signal (`dcgmi/main_dcgmi.cpp`). Names and texts from
/// `dcgmlib/dcgm_structs.h` and `dcgmlib/src/dcgm_errors.c`.
const EXIT_CODES: &[(i32, &str, &str)] = &[
    (0, "DCGM_ST_OK", "Success"),
    (255, "DCGM_ST_BADPARAM", "Bad parameter passed to function"),
    (254, "-2", "dcgmi rejected its command line"),
    (253, "DCGM_ST_GENERIC_ERROR", "Generic unspecified error"),
    (250, "DCGM_ST_NOT_SUPPORTED", "Feature not supported"),
    (249, "DCGM_ST_INIT_ERROR", "DCGM initialization error"),
    (248, "DCGM_ST_NVML_ERROR", "NVML error"),
    (245, "DCGM_ST_TIMEOUT", "Timeout"),
    (244, "DCGM_ST_VER_MISMATCH", "API version mismatch"),
    (242, "DCGM_ST_NO_DATA", "No data is available"),
    (239, "DCGM_ST_NO_PERMISSION", "No permission"),
    (238, "DCGM_ST_GPU_IS_LOST", "GPU is lost"),
    (237, "DCGM_ST_RESET_REQUIRED", "GPU requires reset"),
    (
        235,
        "DCGM_ST_CONNECTION_NOT_VALID",
        "Host engine connection invalid/disconnected",
    ),
    (
        231,
        "DCGM_ST_LIBRARY_NOT_FOUND",
        "DCGM library could not be found",
    ),
    (
        227,
        "DCGM_ST_REQUIRES_ROOT",
        "Host engine is running as non-root",
    ),
    (
        226,
        "DCGM_ST_NVVS_ERROR",
        "DCGM GPU Diagnostic returned an error",
    ),
    (
        217,
        "DCGM_ST_DIAG_ALREADY_RUNNING",
        "A diag instance is already running",
    ),
    (
        216,
        "DCGM_ST_DIAG_BAD_JSON",
        "The GPU Diagnostic returned Json that cannot be parsed",
    ),
    (
        215,
        "DCGM_ST_DIAG_BAD_LAUNCH",
        "Error while launching the GPU Diagnostic",
    ),
    (
        213,
        "DCGM_ST_DIAG_THRESHOLD_EXCEEDED",
        "A field value met or exceeded the error threshold",
    ),
    (
        205,
        "DCGM_ST_NVVS_ISOLATE_ERROR",
        "The diagnostic returned an error that indicates the need to drain the GPU",
    ),
    (
        204,
        "DCGM_ST_NVVS_BINARY_NOT_FOUND",
        "The NVVS binary was not found",
    ),
    (
        203,
        "DCGM_ST_NVVS_KILLED",
        "The DCGM diagnostic was killed by a signal",
    ),
    (
        200,
        "DCGM_ST_NVML_NOT_LOADED",
        "NVML doesn't exist on this system",
    ),
    (
        198,
        "DCGM_ST_NVVS_NO_AVAILABLE_TEST",
        "Requested tests were not found among possible test choices",
    ),
    (
        190,
        "DCGM_ST_DIAG_STOPPED",
        "The DCGM Diagnostic was stopped",
    ),
];

/// Exit codes that say the diagnostic could not start here (no host engine, DCGM or its
/// diagnostic not installed, no permission): the tier did not run.
const NOT_SET_UP: &[i32] = &[235, 231, 227, 239, 204, 200];

/// An exit code in words: `226 (DCGM_ST_NVVS_ERROR: DCGM GPU Diagnostic returned an error)`.
pub fn describe_exit(code: i32) -> String {
    if let Some((_, name, text)) = EXIT_CODES.iter().find(|(c, _, _)| *c == code) {
        return format!("{code} ({name}: {text})");
    }
    if (129..=159).contains(&code) {
        return format!("{code} (stopped by signal {})", code - 128);
    }
    format!("{code}")
}

/// The arguments `dcgmi` is run with.
pub fn args(plan: &DcgmPlan) -> Vec<String> {
    let mut a = vec![
        "diag".to_string(),
        "-r".to_string(),
        plan.level.dcgm_run_level().to_string(),
        "-j".to_string(),
    ];
    if let Some(gpus) = plan.gpus.as_ref().filter(|g| !g.is_empty()) {
        a.push("-i".to_string());
        a.push(
            gpus.iter()
                .map(|g| g.to_string())
                .collect::<Vec<_>>()
                .join(","),
        );
    }
    if let Some(host) = plan.host.as_ref().filter(|h| !h.is_empty()) {
        a.push("--host".to_string());
        a.push(host.clone());
    }
    a
}

/// Runs `dcgmi diag` and reads its JSON.
pub fn run(plan: &DcgmPlan) -> (TierRun, Vec<GpuDiagnosis>) {
    let start = Instant::now();
    let argv = args(plan);
    let mut cmd = Command::new(&plan.binary);
    cmd.args(&argv);
    let result = tree::output_tree_within(&mut cmd, plan.timeout, TERM_GRACE, MAX_OUTPUT);
    let ms = |start: Instant| u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX);
    let out = match result {
        Ok(out) => out,
        Err(TreeError::Spawn(e)) => {
            let why = spawn_why(&plan.binary, &e);
            let j = Judged::not_run(why, Cause::NoTool);
            return j.into_tier(ms(start), String::new());
        }
        Err(TreeError::Subreaper(e)) => {
            let why = format!("cannot run dcgmi with a deadline here: {e}");
            let j = Judged::not_run(why, Cause::Tool);
            return j.into_tier(ms(start), String::new());
        }
        Err(TreeError::Wait(e)) => {
            let why = format!("lost track of dcgmi: {e}");
            let j = Judged::unknown(why, Cause::Tool);
            return j.into_tier(ms(start), String::new());
        }
    };
    let raw = raw_output(&plan.binary, &argv, &out);
    judge(&out, plan.gpus.as_deref()).into_tier(ms(start), raw)
}

/// What a run of dcgmi says: whether it ran, its answer and why, and each GPU's tests.
#[derive(Debug, Clone, PartialEq)]
pub struct Judged {
    pub ran: bool,
    pub result: DiagResult,
    pub why: String,
    pub cause: Option<Cause>,
    pub notes: Vec<String>,
    pub gpus: Vec<GpuDiagnosis>,
}

impl Judged {
    fn not_run(why: String, cause: Cause) -> Judged {
        Judged {
            ran: false,
            result: DiagResult::Unknown,
            why,
            cause: Some(cause),
            notes: Vec::new(),
            gpus: Vec::new(),
        }
    }

    fn unknown(why: String, cause: Cause) -> Judged {
        Judged {
            ran: true,
            ..Judged::not_run(why, cause)
        }
    }

    fn into_tier(self, duration_ms: u64, raw: String) -> (TierRun, Vec<GpuDiagnosis>) {
        let mut why = self.why;
        cut(&mut why, crate::model::MAX_TEXT);
        (
            TierRun {
                tier: Tier::Dcgm,
                ran: self.ran,
                result: self.result,
                why,
                cause: self.cause,
                notes: self.notes,
                duration_ms,
                raw,
            },
            self.gpus,
        )
    }
}

fn spawn_why(binary: &std::path::Path, e: &std::io::Error) -> String {
    let shown = binary.display();
    match e.kind() {
        std::io::ErrorKind::NotFound if binary.components().count() > 1 => {
            format!("dcgmi not found at {shown} (DCGM is not installed?)")
        }
        std::io::ErrorKind::NotFound => {
            format!("dcgmi not found: no {shown} on PATH (DCGM is not installed?)")
        }
        std::io::ErrorKind::PermissionDenied => {
            format!("dcgmi at {shown} cannot be run: {e} (not executable?)")
        }
        _ => format!("dcgmi at {shown} cannot be started: {e}"),
    }
}

/// What the run says, from its output and its exit. `asked`: the GPUs present (NVML's
/// indexes the diagnosis was asked for).
pub fn judge(out: &TreeOutput, asked: Option<&[u32]>) -> Judged {
    if let Ended::TimedOut(t) = out.ended {
        let stuck = if out.unkilled > 0 {
            format!(
                "; {} would not die (stuck in the kernel, as in a hung GPU driver call?)",
                out.unkilled
            )
        } else {
            String::new()
        };
        return Judged::unknown(
            format!(
                "timed out after {}: dcgmi printed no answer in time; its process tree was killed ({} process(es)){stuck}",
                humantime::format_duration(t),
                out.killed
            ),
            Cause::Timeout,
        );
    }
    let code = match out.ended {
        Ended::Exited(s) => s.code(),
        Ended::TimedOut(_) => None,
    };
    let signal = match out.ended {
        Ended::Exited(s) => std::os::unix::process::ExitStatusExt::signal(&s),
        Ended::TimedOut(_) => None,
    };
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let doc = match find_document(&out.stdout) {
        Found::Document(doc) => Some(doc),
        Found::Cut if out.stdout_cut() => {
            return Judged::unknown(
                format!(
                    "dcgmi's output was over {} ({} bytes written): its JSON was cut, so no result could be read",
                    crate::sys::limits::human_bytes(MAX_OUTPUT),
                    out.stdout_total
                ),
                Cause::Output,
            );
        }
        Found::Cut => {
            return Judged::unknown(
                format!(
                    "dcgmi's JSON ends before it is complete{}, so no result could be read: {}",
                    exit_words(code, signal),
                    tail(&text)
                ),
                Cause::Output,
            );
        }
        Found::Absent => None,
    };
    let report = doc.as_ref().map(|d| parse_document(d, asked));
    let has_tests = report.as_ref().is_some_and(Report::has_results);
    // No host engine, no diagnostic, no permission: the tier could not run.
    if !has_tests && let Some((why, cause)) = not_set_up(code, signal, report.as_ref(), &text) {
        return Judged::not_run(why, cause);
    }
    let Some(report) = report else {
        if let Some(busy) = busy_words(&text) {
            return Judged::unknown(format!("{GPU_BUSY}: dcgmi: {busy}"), Cause::GpuBusy);
        }
        if out.stdout_cut() {
            return Judged::unknown(
                format!(
                    "dcgmi's output was over {} ({} bytes written) and held no DCGM JSON",
                    crate::sys::limits::human_bytes(MAX_OUTPUT),
                    out.stdout_total
                ),
                Cause::Output,
            );
        }
        return Judged::unknown(
            format!(
                "dcgmi printed no DCGM JSON{}: {}",
                exit_words(code, signal),
                tail(&text)
            ),
            Cause::Output,
        );
    };
    judge_report(&report, code, signal)
}

/// How a busy GPU is said: DCGM's tests could not get the GPU (an MPS server holds it, or
/// another process in exclusive compute mode).
pub const GPU_BUSY: &str = "GPU busy (an MPS server or another process holds it)";

/// A document read: fail, could not tell, needs configuration or pass, by what it and the
/// exit say; every GPU present needs a pass of its own.
fn judge_report(report: &Report, code: Option<i32>, signal: Option<i32>) -> Judged {
    let version = report
        .version
        .as_deref()
        .map(|v| format!("DCGM {v}: "))
        .unwrap_or_default();
    let notes = report.notes();
    let (gpus, missing) = per_gpu(report);
    let result = |result: DiagResult, why: String, cause: Option<Cause>| Judged {
        ran: true,
        result,
        why,
        cause,
        notes: notes.clone(),
        gpus: gpus.clone(),
    };
    if gpus.iter().any(|g| g.result == DiagResult::Fail) {
        return result(DiagResult::Fail, String::new(), None);
    }
    let config = report.config_findings(&gpus);
    if let Some((why, cause)) = could_not_tell(report, &gpus, &missing, &config, code, signal) {
        return result(DiagResult::Unknown, format!("{version}{why}"), Some(cause));
    }
    if config.is_empty() {
        return result(DiagResult::Pass, String::new(), None);
    }
    result(
        DiagResult::Config,
        format!(
            "{version}needs configuration (not a hardware fault): {}",
            config.join("; ")
        ),
        None,
    )
}

/// Each GPU present: DCGM's results for it, judged, with a `(no pass)` test saying what is
/// missing where none passed it; and those words.
fn per_gpu(report: &Report) -> (Vec<GpuDiagnosis>, Vec<String>) {
    let mut gpus: Vec<GpuDiagnosis> = Vec::new();
    let mut missing: Vec<String> = Vec::new();
    for index in &report.present {
        let mut g = GpuDiagnosis {
            index: *index,
            uuid: String::new(),
            result: DiagResult::Unknown,
            tests: report.gpus.get(index).cloned().unwrap_or_default(),
        };
        g.judge();
        if g.result == DiagResult::Unknown
            && !g.tests.iter().any(|t| t.status == TestStatus::Unknown)
        {
            let said = if g.tests.is_empty() {
                format!(
                    "no DCGM result names GPU {index}{}",
                    report.named_elsewhere()
                )
            } else {
                format!(
                    "no DCGM test passed GPU {index} ({})",
                    g.tests
                        .iter()
                        .map(|t| format!("{} {}", t.test, t.status.as_str()))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            };
            missing.push(said.clone());
            g.tests
                .push(result_word(NO_PASS, TestStatus::Unknown, said));
            g.judge();
        }
        gpus.push(g);
    }
    (gpus, missing)
}

/// The test that says a GPU present has no pass of its own.
const NO_PASS: &str = "(no pass)";

/// Why a document with no failure of a GPU present could not tell, and what it could not
/// read; `None` when it tells.
fn could_not_tell(
    report: &Report,
    gpus: &[GpuDiagnosis],
    missing: &[String],
    config: &[String],
    code: Option<i32>,
    signal: Option<i32>,
) -> Option<(String, Cause)> {
    if let Some(e) = &report.runtime_error {
        let e = e.trim();
        if let Some(busy) = busy_words(e) {
            return Some((format!("{GPU_BUSY}: {busy}"), Cause::GpuBusy));
        }
        return Some((
            format!("could not complete the diagnostic: {e}"),
            Cause::RuntimeError,
        ));
    }
    let unknown = || {
        gpus.iter().flat_map(|g| {
            g.tests
                .iter()
                .filter(|t| t.status == TestStatus::Unknown && t.test != NO_PASS)
                .map(move |t| (g.index, t))
        })
    };
    if let Some((gpu, t)) = unknown().find(|(_, t)| t.message.starts_with(GPU_BUSY)) {
        let said = t
            .message
            .trim_start_matches(GPU_BUSY)
            .trim_start_matches(": ");
        return Some((
            format!("{GPU_BUSY}: GPU {gpu} {}: {said}", t.test),
            Cause::GpuBusy,
        ));
    }
    let bad: Vec<String> = report
        .unplaced
        .iter()
        .filter(|u| matches!(u.test.status, TestStatus::Fail | TestStatus::Unknown))
        .map(Unplaced::words)
        .chain(report.unexplained.iter().cloned())
        .collect();
    if !bad.is_empty() {
        return Some((
            format!(
                "could not tell which GPU DCGM's finding is about (never a failure of the node): {}",
                bad.join("; ")
            ),
            Cause::Entity,
        ));
    }
    if let Some((_, t)) = unknown().next() {
        return Some((
            format!(
                "the status of DCGM's {} test could not be read: {}",
                t.test, t.message
            ),
            Cause::Output,
        ));
    }
    if let Some(c) = code.filter(|c| *c != 0)
        && (config.is_empty() || c != EXIT_FOUND_A_PROBLEM)
    {
        let shows = if config.is_empty() {
            "its JSON shows no failure".to_string()
        } else {
            format!(
                "its JSON shows only configuration findings, which dcgmi answers with {}",
                describe_exit(EXIT_FOUND_A_PROBLEM)
            )
        };
        return Some((
            format!("dcgmi exited with {} but {shows}", describe_exit(c)),
            Cause::ExitCode,
        ));
    }
    if let Some(s) = signal {
        return Some((format!("dcgmi was killed by signal {s}"), Cause::Tool));
    }
    if !missing.is_empty() {
        let none_passed = gpus.iter().all(|g| !g.result.passed());
        if none_passed && report.results().all(|t| t.status == TestStatus::Skip) {
            return Some((
                "DCGM ran no test (every test skipped or not run)".to_string(),
                Cause::NoTest,
            ));
        }
        return Some((missing.join("; "), Cause::MissingGpu));
    }
    if gpus.is_empty() {
        return Some((
            "DCGM's document names no GPU present".to_string(),
            Cause::MissingGpu,
        ));
    }
    None
}

/// dcgmi's answer when the diagnostic found a problem that does not call for isolating the
/// GPU (`DCGM_ST_NVVS_ERROR`, -30): what a configuration finding alone exits with
/// (`Diag::GetFailureResult`, dcgmi/Diag.cpp).
pub const EXIT_FOUND_A_PROBLEM: i32 = 226;

/// Why dcgmi could not run a diagnostic at all (no host engine, no diagnostic, no permission),
/// when its exit or its words say so, and what it could not reach.
fn not_set_up(
    code: Option<i32>,
    signal: Option<i32>,
    report: Option<&Report>,
    text: &str,
) -> Option<(String, Cause)> {
    let setup = code.is_some_and(|c| NOT_SET_UP.contains(&c))
        || text.contains("Unable to connect to host engine")
        || text.contains("Unable to start an embedded host engine")
        || text.contains("Host engine connection invalid");
    if !setup {
        return None;
    }
    let said = report
        .and_then(|r| r.runtime_error.clone())
        .or_else(|| error_line(text))
        .unwrap_or_else(|| tail(text));
    let (what, cause) = if text.contains("embedded host engine") {
        (
            "nv-hostengine is not running and dcgmi could not start an embedded one",
            Cause::HostEngine,
        )
    } else if code == Some(235) || text.contains("host engine") || said.contains("host engine") {
        (
            "nv-hostengine is not running or not reachable",
            Cause::HostEngine,
        )
    } else {
        ("DCGM's diagnostic cannot run here", Cause::NoTool)
    };
    Some((
        format!("{what}: {}{}", said.trim(), exit_words(code, signal)),
        cause,
    ))
}

fn exit_words(code: Option<i32>, signal: Option<i32>) -> String {
    match (code, signal) {
        (Some(c), _) => format!(" (exit {})", describe_exit(c)),
        (None, Some(s)) => format!(" (killed by signal {s})"),
        (None, None) => String::new(),
    }
}

/// The first line that says `Error`, as dcgmi prints its failures.
fn error_line(text: &str) -> Option<String> {
    text.lines()
        .map(str::trim)
        .find(|l| l.starts_with("Error") || l.contains("Error:"))
        .map(|l| {
            let mut l = l.to_string();
            cut(&mut l, TAIL);
            l
        })
}

/// The end of the output, on one line, for messages.
fn tail(text: &str) -> String {
    let t = text.trim();
    if t.is_empty() {
        return "(no output)".to_string();
    }
    let mut at = t.len().saturating_sub(TAIL);
    while at < t.len() && !t.is_char_boundary(at) {
        at += 1;
    }
    let s = t.get(at..).unwrap_or_default();
    let one: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if at > 0 { format!("…{one}") } else { one }
}

/// The raw output kept for the evidence bundle: the command, the head of stdout and the end of
/// stderr.
fn raw_output(binary: &std::path::Path, argv: &[String], out: &TreeOutput) -> String {
    let mut stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    cut(&mut stdout, MAX_RAW - 16 * 1024);
    let mut s = format!("$ {} {}\n{stdout}", binary.display(), argv.join(" "));
    if out.stdout_cut() {
        s.push_str(&format!("\n[stdout: {} bytes written]", out.stdout_total));
    }
    if !out.stderr.is_empty() {
        let err = String::from_utf8_lossy(&out.stderr);
        let mut at = err.len().saturating_sub(8 * 1024);
        while at < err.len() && !err.is_char_boundary(at) {
            at += 1;
        }
        s.push_str("\n--- stderr ---\n");
        s.push_str(err.get(at..).unwrap_or_default());
    }
    cut(&mut s, MAX_RAW);
    s
}

/// Where dcgmi's JSON document is in its output.
#[derive(Debug)]
pub enum Found {
    Document(Value),
    /// A document starts but ends early (the output was cut, or dcgmi died printing it).
    Cut,
    /// No DCGM document at all.
    Absent,
}

fn is_document(v: &Value) -> bool {
    v.get("DCGM Diagnostic").is_some()
        || v.get("DCGM GPU Diagnostic").is_some()
        || v.get("iterations").is_some_and(Value::is_array)
}

/// Finds the first DCGM document in `bytes`: dcgmi may print lines of text before it (a
/// warning, "Successfully ran diagnostic for group."), so each `{` is tried in turn as its
/// start; other JSON objects are stepped over.
pub fn find_document(bytes: &[u8]) -> Found {
    let mut at = 0usize;
    let mut attempts = 0usize;
    while attempts < MAX_ATTEMPTS {
        let Some(rest) = bytes.get(at..) else {
            break;
        };
        let Some(offset) = rest.iter().position(|b| *b == b'{') else {
            break;
        };
        at += offset;
        attempts += 1;
        let Some(rest) = bytes.get(at..) else {
            break;
        };
        let mut stream = serde_json::Deserializer::from_slice(rest).into_iter::<Value>();
        match stream.next() {
            Some(Ok(v)) if is_document(&v) => return Found::Document(v),
            Some(Ok(_)) => at += stream.byte_offset().max(1),
            Some(Err(e)) if e.is_eof() => return Found::Cut,
            _ => at += 1,
        }
    }
    Found::Absent
}

/// What a DCGM document says, per GPU present.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Report {
    /// DCGM's version, where the document has it.
    pub version: Option<String>,
    /// The GPUs present: those asked (NVML's indexes), or without them those the document
    /// lists (4.x `entity_groups`, 3.x `GPU Device Serials`) or its results name.
    pub present: BTreeSet<u32>,
    /// Every result on each GPU present that it names (DCGM's GPU id is NVML's index).
    pub gpus: BTreeMap<u32, Vec<TestResult>>,
    /// Results DCGM gave for no GPU in particular (3.x dcgmi's Deployment tests): they pass
    /// no GPU; a failure among them is a configuration finding of the node.
    pub node: Vec<TestResult>,
    /// Results whose entity cannot be read, is not a GPU, or is no GPU present.
    pub unplaced: Vec<Unplaced>,
    /// Failures DCGM reported for no entity that no result explains (a test's summary, the
    /// overall result of iterations).
    pub unexplained: Vec<String>,
    /// `runtime_error`: DCGM could not complete the run.
    pub runtime_error: Option<String>,
}

/// A result that counts for no GPU: its test and status, the id as DCGM wrote it, and why it
/// cannot be placed.
#[derive(Debug, Clone, PartialEq)]
pub struct Unplaced {
    pub test: TestResult,
    pub id: String,
    pub why: String,
}

impl Unplaced {
    fn words(&self) -> String {
        let msg = if self.test.message.is_empty() {
            String::new()
        } else {
            format!(": {}", self.test.message)
        };
        format!(
            "{} {} for {} ({}){msg}",
            self.test.test,
            self.test.status.as_str(),
            self.id,
            self.why
        )
    }
}

impl Report {
    /// Whether the document holds any result at all.
    pub fn has_results(&self) -> bool {
        !self.gpus.is_empty()
            || !self.node.is_empty()
            || !self.unplaced.is_empty()
            || !self.unexplained.is_empty()
    }

    /// Every result read, placed or not.
    fn results(&self) -> impl Iterator<Item = &TestResult> {
        self.gpus
            .values()
            .flatten()
            .chain(self.node.iter())
            .chain(self.unplaced.iter().map(|u| &u.test))
    }

    /// ", DCGM's results name GPU 0, 1" for a GPU no result names.
    fn named_elsewhere(&self) -> String {
        let named: Vec<String> = self.gpus.keys().map(u32::to_string).collect();
        let mut s = if named.is_empty() {
            String::from(" (DCGM's results name no GPU present")
        } else {
            format!(" (DCGM's results name GPU {}", named.join(", "))
        };
        if !self.unplaced.is_empty() {
            let ids: Vec<&str> = self
                .unplaced
                .iter()
                .map(|u| u.id.as_str())
                .take(4)
                .collect();
            s.push_str(&format!(
                ", and entities that are no GPU present: {}",
                ids.join(", ")
            ));
        }
        s.push(')');
        s
    }

    /// What people should know of results that counted for no GPU.
    fn notes(&self) -> Vec<String> {
        let mut notes = Vec::new();
        let passes: Vec<String> = self
            .unplaced
            .iter()
            .filter(|u| {
                matches!(
                    u.test.status,
                    TestStatus::Pass | TestStatus::Skip | TestStatus::Warn
                )
            })
            .map(Unplaced::words)
            .collect();
        if !passes.is_empty() {
            notes.push(format!(
                "counted for no GPU: {}",
                passes.into_iter().take(8).collect::<Vec<_>>().join("; ")
            ));
        }
        let node: Vec<String> = self
            .node
            .iter()
            .filter(|t| t.status != TestStatus::Config)
            .map(|t| format!("{} {}", t.test, t.status.as_str()))
            .collect();
        if !node.is_empty() {
            notes.push(format!(
                "results for the node, no GPU in particular (they pass no GPU): {}",
                node.into_iter().take(12).collect::<Vec<_>>().join(", ")
            ));
        }
        notes
    }

    /// Every configuration finding: on the GPUs, on the node, and counted for no GPU.
    fn config_findings(&self, gpus: &[GpuDiagnosis]) -> Vec<String> {
        let mut found: Vec<String> = Vec::new();
        for g in gpus {
            for t in g.tests.iter().filter(|t| t.status == TestStatus::Config) {
                found.push(format!("GPU {} {}: {}", g.index, t.test, t.message));
            }
        }
        for t in self.node.iter().filter(|t| t.status == TestStatus::Config) {
            found.push(format!("{} (the node): {}", t.test, t.message));
        }
        for u in self
            .unplaced
            .iter()
            .filter(|u| u.test.status == TestStatus::Config)
        {
            found.push(u.words());
        }
        found.dedup();
        found
    }
}

/// Reads a DCGM 2.x/3.x or 4.x document (or the `iterations` wrapper of `--iterations`).
/// `asked`: the GPUs present (NVML's indexes the diagnosis was asked for).
pub fn parse_document(doc: &Value, asked: Option<&[u32]>) -> Report {
    let mut report = Report {
        present: present_gpus(doc, asked),
        ..Report::default()
    };
    if let Some(iterations) = doc.get("iterations").and_then(Value::as_array) {
        let asked: Vec<u32> = report.present.iter().copied().collect();
        for it in iterations.iter().take(MAX_ITERATIONS) {
            let one = parse_document(it, Some(&asked));
            report.version = report.version.or(one.version);
            for (gpu, tests) in one.gpus {
                report.gpus.entry(gpu).or_default().extend(tests);
            }
            report.node.extend(one.node);
            report.unplaced.extend(one.unplaced);
            report.unexplained.extend(one.unexplained);
            report.runtime_error = report.runtime_error.or(one.runtime_error);
        }
        let overall = doc.get("Overall Result").and_then(Value::as_str);
        if overall.is_some_and(|s| s.eq_ignore_ascii_case("fail"))
            && !report
                .results()
                .any(|t| t.status != TestStatus::Pass && t.status != TestStatus::Skip)
        {
            let said = doc.get("Warning").and_then(Value::as_str).unwrap_or("");
            report
                .unexplained
                .push(format!("Overall Result: Fail {said}").trim().to_string());
        }
        return report;
    }
    let Some(root) = doc
        .get("DCGM Diagnostic")
        .or_else(|| doc.get("DCGM GPU Diagnostic"))
    else {
        return report;
    };
    report.version = doc
        .pointer("/metadata/version")
        .or_else(|| doc.get("version"))
        .or_else(|| root.get("version"))
        .and_then(Value::as_str)
        .map(str::to_string);
    report.runtime_error = root
        .get("runtime_error")
        .and_then(Value::as_str)
        .map(str::to_string);
    for category in list(root.get("test_categories")) {
        let name = category
            .get("category")
            .and_then(Value::as_str)
            .unwrap_or("");
        let deployment = name.eq_ignore_ascii_case(DEPLOYMENT);
        for test in list(category.get("tests")) {
            read_test(test, deployment, &mut report);
        }
    }
    report
}

/// DCGM's category of the software (deployment) tests: `PLUGIN_CATEGORY_DEPLOYMENT`
/// (nvvs/include/PluginStrings.h), `DISPLAY_DEPLOYMENT` in 3.x's dcgmi/Diag.cpp.
const DEPLOYMENT: &str = "Deployment";
/// Iterations of `--iterations` read (gpu-medic never asks for more than one).
const MAX_ITERATIONS: usize = 64;

/// An array's items, or none (a missing key, a `null`, anything else).
fn list(v: Option<&Value>) -> &[Value] {
    v.and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// The GPUs present: those asked; without them, those the document lists, and failing that
/// every GPU id a result names.
fn present_gpus(doc: &Value, asked: Option<&[u32]>) -> BTreeSet<u32> {
    if let Some(asked) = asked.filter(|a| !a.is_empty()) {
        return asked.iter().copied().collect();
    }
    let mut all = BTreeSet::new();
    // 4.x: entity_groups[GPU].entities[].entity_id
    for group in list(doc.get("entity_groups")) {
        if entity_group(group) != Ok(true) {
            continue;
        }
        for e in list(group.get("entities")) {
            if let Some(Ok(id)) = e.get("entity_id").map(read_id) {
                all.insert(id);
            }
        }
    }
    // 3.x: "GPU Device Serials" {"0": ..}
    if let Some(serials) = doc.get("GPU Device Serials").and_then(Value::as_object) {
        all.extend(
            serials
                .keys()
                .filter_map(|k| read_id(&Value::String(k.clone())).ok()),
        );
    }
    if !all.is_empty() {
        return all;
    }
    // Any GPU a result names.
    let root = doc
        .get("DCGM Diagnostic")
        .or_else(|| doc.get("DCGM GPU Diagnostic"))
        .or_else(|| {
            doc.get("iterations")
                .and_then(Value::as_array)
                .and_then(|a| a.first())
                .and_then(|d| {
                    d.get("DCGM Diagnostic")
                        .or_else(|| d.get("DCGM GPU Diagnostic"))
                })
        });
    for r in list(root.and_then(|r| r.get("test_categories")))
        .iter()
        .flat_map(|c| list(c.get("tests")))
        .flat_map(|t| list(t.get("results")))
    {
        if let Place::Gpus(ids) = place(r, false) {
            all.extend(ids);
        }
    }
    all
}

/// Where one result belongs.
#[derive(Debug, Clone, PartialEq)]
enum Place {
    /// The GPUs it names (DCGM's GPU ids).
    Gpus(Vec<u32>),
    /// No GPU in particular: a 3.x dcgmi Deployment result, which carries no id.
    Node,
    /// It cannot be placed: the id as written, and why.
    Nowhere(String, String),
}

/// Whether a value names DCGM's GPU entity group: `Ok(true)`, `Ok(false)` for another group
/// (a CPU, an NVSwitch), `Err` when it cannot be read. `entity_group` is DCGM's name
/// (`"GPU"`), `entity_group_id` its number (`DCGM_FE_GPU` = 1, dcgmlib/dcgm_fields.h).
fn entity_group(v: &Value) -> Result<bool, String> {
    let name = match v.get("entity_group") {
        None => None,
        Some(Value::String(s)) => Some(s.eq_ignore_ascii_case("GPU")),
        Some(other) => return Err(format!("entity_group {other} cannot be read")),
    };
    let id = match v.get("entity_group_id") {
        None => None,
        Some(n) => match n.as_u64() {
            Some(id) => Some(id == DCGM_FE_GPU),
            None => return Err(format!("entity_group_id {n} cannot be read")),
        },
    };
    match (name, id) {
        (Some(a), Some(b)) if a != b => Err(format!(
            "entity_group {} and entity_group_id {} disagree",
            v.get("entity_group").unwrap_or(&Value::Null),
            v.get("entity_group_id").unwrap_or(&Value::Null)
        )),
        (Some(a), _) | (None, Some(a)) => Ok(a),
        (None, None) => Ok(true),
    }
}

/// `DCGM_FE_GPU` (dcgmlib/dcgm_fields.h).
const DCGM_FE_GPU: u64 = 1;

/// A GPU id as DCGM writes it: a whole number, or one in a string (3.x `"gpu_id": "0"`).
/// Anything else (a UUID, `null`, a negative or fractional number, one past `u32`) cannot
/// be read, and says so.
fn read_id(v: &Value) -> Result<u32, String> {
    match v {
        Value::Number(n) => match n.as_u64() {
            Some(x) => u32::try_from(x).map_err(|_| format!("id {n} is out of range")),
            None if n.is_i64() => Err(format!("id {n} is negative")),
            None => Err(format!("id {n} is not a whole number")),
        },
        Value::String(s) => {
            let t = s.trim();
            if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
                t.parse::<u32>()
                    .map_err(|_| format!("id {s:?} is out of range"))
            } else {
                Err(format!("{s:?} is not a GPU id"))
            }
        }
        Value::Null => Err("the id is null".to_string()),
        other => Err(format!("id {other} cannot be read")),
    }
}

/// The id of a result as written, for messages.
fn id_as_written(r: &Value) -> String {
    let mut parts = Vec::new();
    for key in [
        "entity_group",
        "entity_group_id",
        "entity_id",
        "gpu_id",
        "gpu_ids",
    ] {
        if let Some(v) = r.get(key) {
            let mut s = format!("{key} {v}");
            cut(&mut s, 80);
            parts.push(s);
        }
    }
    if parts.is_empty() {
        "no entity".to_string()
    } else {
        parts.join(", ")
    }
}

/// Where one result belongs (before the GPUs present are looked at).
fn place(r: &Value, deployment: bool) -> Place {
    let nowhere = |why: String| Place::Nowhere(id_as_written(r), why);
    let entity = r.get("entity_group").is_some()
        || r.get("entity_group_id").is_some()
        || r.get("entity_id").is_some();
    if entity {
        match entity_group(r) {
            Err(why) => return nowhere(why),
            Ok(false) => return nowhere("not a GPU".to_string()),
            Ok(true) => {}
        }
        return match r.get("entity_id").map(read_id) {
            None => nowhere("it has no entity_id".to_string()),
            Some(Err(why)) => nowhere(why),
            Some(Ok(id)) => Place::Gpus(vec![id]),
        };
    }
    if let Some(v) = r.get("gpu_id") {
        return match read_id(v) {
            Ok(id) => Place::Gpus(vec![id]),
            Err(why) => nowhere(why),
        };
    }
    if let Some(v) = r.get("gpu_ids") {
        let ids: Result<Vec<u32>, String> = match v {
            Value::String(s) => s
                .split(',')
                .map(|x| read_id(&Value::String(x.to_string())))
                .collect(),
            Value::Array(a) => a.iter().map(read_id).collect(),
            other => read_id(other).map(|id| vec![id]),
        };
        return match ids {
            Ok(ids) if ids.is_empty() => nowhere("it names no GPU".to_string()),
            Ok(ids) => Place::Gpus(ids),
            Err(why) => nowhere(why),
        };
    }
    if deployment {
        Place::Node
    } else {
        nowhere("it names no GPU".to_string())
    }
}

fn status_of(v: Option<&Value>) -> (TestStatus, Option<String>) {
    let Some(s) = v.and_then(Value::as_str) else {
        let shown = v.map_or_else(|| "none".to_string(), Value::to_string);
        return (
            TestStatus::Unknown,
            Some(format!("status {shown} cannot be read")),
        );
    };
    let norm: String = s
        .chars()
        .filter(|c| c.is_ascii_alphabetic())
        .collect::<String>()
        .to_ascii_lowercase();
    match norm.as_str() {
        "pass" | "passed" => (TestStatus::Pass, None),
        "warn" | "warning" => (TestStatus::Warn, None),
        "fail" | "failed" => (TestStatus::Fail, None),
        "skip" | "skipped" | "notrun" => (TestStatus::Skip, None),
        _ => (
            TestStatus::Unknown,
            Some(format!("status {s:?} is no word DCGM uses")),
        ),
    }
}

/// One warning as DCGM writes it: its words and, where given, `error_id` (a `dcgmError_t`),
/// `error_category` and `error_severity` (dcgmlib/dcgm_errors.h).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Warning {
    text: String,
    id: Option<u64>,
    category: Option<u64>,
    severity: Option<u64>,
}

impl Warning {
    /// DCGM files it as configuration: severity `DCGM_ERROR_CONFIG` (5), category
    /// `DCGM_FR_EC_SOFTWARE_CONFIG` (3), or, where neither is written, an error id whose
    /// severity is `DCGM_ERROR_CONFIG` in dcgmlib/src/dcgm_errors.c.
    fn is_config(&self) -> bool {
        match (self.severity, self.category) {
            (Some(s), _) if s == SEVERITY_CONFIG => true,
            (_, Some(c)) if c == CATEGORY_SOFTWARE_CONFIG => true,
            (Some(_), _) => false,
            (None, _) => self.id.is_some_and(|id| CONFIG_ERRORS.contains(&id)),
        }
    }
}

/// `DCGM_ERROR_CONFIG` (`dcgmErrorSeverity_t`, dcgmlib/dcgm_errors.h): "This error can be
/// configured".
const SEVERITY_CONFIG: u64 = 5;
/// `DCGM_FR_EC_SOFTWARE_CONFIG` (`dcgmErrorCategory_t`).
const CATEGORY_SOFTWARE_CONFIG: u64 = 3;
/// The `dcgmError_t` codes whose severity is `DCGM_ERROR_CONFIG` in DCGM's error table
/// (dcgmlib/src/dcgm_errors.c, DCGM 4.x): for documents that write no severity (3.x).
/// 18 NO_ACCESS_TO_FILE, 20 DEVICE_COUNT_MISMATCH, 23 DENYLISTED_DRIVER, 28 BAD_CUDA_ENV,
/// 29 PERSISTENCE_MODE, 46 PCIE_WIDTH, 47 ABORTED, 48 TEST_DISABLED, 55 ECC_DISABLED,
/// 60 ECC_UNSUPPORTED, 68 CONCURRENT_GPUS, 72 ENFORCED_POWER_LIMIT, 78 L1TAG_UNSUPPORTED,
/// 82 EMPTY_GPU_LIST, 96 FILE_CREATE_PERMISSIONS, 112 FABRIC_MANAGER_TRAINING_ERROR,
/// 117 TEST_SKIPPED.
const CONFIG_ERRORS: &[u64] = &[
    18, 20, 23, 28, 29, 46, 47, 48, 55, 60, 68, 72, 78, 82, 96, 112, 117,
];

/// The tool's own words in one result: its warnings, then its info.
fn words(r: &Value) -> (Vec<Warning>, Vec<String>) {
    let text = |v: &Value| -> Option<String> {
        match v {
            Value::String(s) => Some(s.trim().to_string()),
            // 4.x and 3.x per-GPU: "warning"; 3.x Deployment: "warnings" inside the entry.
            Value::Object(o) => o
                .get("warning")
                .or_else(|| o.get("warnings"))
                .or_else(|| o.get("msg"))
                .and_then(Value::as_str)
                .map(|s| s.trim().to_string()),
            _ => None,
        }
    };
    let warning = |v: &Value| -> Option<Warning> {
        let t = text(v).filter(|s| !s.is_empty())?;
        Some(Warning {
            text: t,
            id: v.get("error_id").and_then(Value::as_u64),
            category: v.get("error_category").and_then(Value::as_u64),
            severity: v.get("error_severity").and_then(Value::as_u64),
        })
    };
    let warnings: Vec<Warning> = match r.get("warnings") {
        Some(Value::Array(a)) => a.iter().filter_map(warning).collect(),
        Some(v) => warning(v).into_iter().collect(),
        None => Vec::new(),
    };
    let info: Vec<String> = match r.get("info") {
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(text)
            .filter(|s| !s.is_empty())
            .collect(),
        Some(v) => text(v).into_iter().filter(|s| !s.is_empty()).collect(),
        None => Vec::new(),
    };
    (warnings, info)
}

/// DCGM's words that say a GPU was busy, not broken: CUDA's `cudaErrorDevicesUnavailable` /
/// `CUDA_ERROR_DEVICE_UNAVAILABLE` ("CUDA-capable device(s) is/are busy or unavailable": a
/// GPU in exclusive-process compute mode that an MPS server or another process holds, as in
/// NVIDIA/DCGM issue #224 and NVIDIA/go-dcgm issue #52), and CUDA's MPS client errors.
const BUSY_WORDS: &[&str] = &[
    "busy or unavailable",
    "cuda_error_device_unavailable",
    "cudaerrordevicesunavailable",
    "cuda_error_mps_",
    "cudaerrormps",
    "mps client failed",
    "mps server",
    "mps control daemon",
];

/// The first line of `text` that says a GPU was busy, if any.
pub fn busy_words(text: &str) -> Option<String> {
    text.lines().map(str::trim).find_map(|l| {
        let lower = l.to_ascii_lowercase();
        BUSY_WORDS.iter().any(|w| lower.contains(w)).then(|| {
            let mut l = l.to_string();
            cut(&mut l, TAIL);
            l
        })
    })
}

/// A result of DCGM's, as gpu-medic reads it.
fn result_word(test: &str, status: TestStatus, message: String) -> TestResult {
    let mut message = message;
    cut(&mut message, crate::model::MAX_TEXT);
    let mut test = test.to_string();
    cut(&mut test, crate::model::MAX_NAME);
    TestResult {
        tier: Tier::Dcgm,
        test,
        status,
        message,
        duration_ms: None,
        value: None,
        unit: String::new(),
    }
}

/// One result: its status as DCGM wrote it, read with its words. A failure DCGM files as
/// configuration (every warning so filed, or any failure of the Deployment category) is a
/// configuration finding; a failure in DCGM's words for a busy GPU could not tell.
fn test_result(name: &str, deployment: bool, r: &Value) -> TestResult {
    let (mut status, odd) = status_of(r.get("status"));
    let (warnings, info) = words(r);
    let said: Vec<String> = odd
        .into_iter()
        .chain(warnings.iter().map(|w| match w.id {
            Some(id) => format!("{} (DCGM error {id})", w.text),
            None => w.text.clone(),
        }))
        .chain(info.iter().cloned())
        .collect();
    let mut message = said.join("; ");
    match status {
        TestStatus::Pass if !warnings.is_empty() => status = TestStatus::Warn,
        TestStatus::Fail | TestStatus::Warn => {
            let all_text = warnings
                .iter()
                .map(|w| w.text.as_str())
                .chain(info.iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join("\n");
            if let Some(busy) = busy_words(&all_text) {
                status = TestStatus::Unknown;
                message = format!("{GPU_BUSY}: {busy}");
            } else if deployment
                || (!warnings.is_empty() && warnings.iter().all(Warning::is_config))
            {
                status = TestStatus::Config;
                if message.is_empty() {
                    message = "DCGM gave no words".to_string();
                }
            }
        }
        _ => {}
    }
    result_word(name, status, message)
}

fn read_test(test: &Value, deployment: bool, report: &mut Report) {
    let name = test
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("(unnamed test)");
    let results = list(test.get("results"));
    let mut explained = false;
    for r in results {
        if r.is_null() {
            continue;
        }
        let t = test_result(name, deployment, r);
        explained |= t.status != TestStatus::Pass && t.status != TestStatus::Skip;
        match place(r, deployment) {
            Place::Node => report.node.push(t),
            Place::Nowhere(id, why) => report.unplaced.push(Unplaced { test: t, id, why }),
            Place::Gpus(ids) => {
                for id in ids {
                    if report.present.contains(&id) {
                        report.gpus.entry(id).or_default().push(t.clone());
                    } else {
                        let present: Vec<String> =
                            report.present.iter().map(u32::to_string).collect();
                        report.unplaced.push(Unplaced {
                            test: t.clone(),
                            id: format!("GPU {id}"),
                            why: format!(
                                "no GPU present has that id (present: {})",
                                present.join(", ")
                            ),
                        });
                    }
                }
            }
        }
    }
    // 4.x's per-test summary names no GPU: a failure that no result explains cannot be
    // placed; a pass passes no GPU.
    if let Some(summary) = test.get("test_summary").filter(|s| !s.is_null()) {
        let t = test_result(name, deployment, summary);
        if matches!(t.status, TestStatus::Fail | TestStatus::Unknown) && !explained {
            let msg = if t.message.is_empty() {
                String::new()
            } else {
                format!(": {}", t.message)
            };
            report.unexplained.push(format!(
                "{name}'s summary says {} for no GPU{msg}",
                t.status.as_str()
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fixture(name: &str) -> Vec<u8> {
        let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/dcgm")
            .join(name);
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    fn report(name: &str, asked: Option<&[u32]>) -> Report {
        match find_document(&fixture(name)) {
            Found::Document(d) => parse_document(&d, asked),
            other => panic!("{name}: {other:?}"),
        }
    }

    fn status(r: &Report, gpu: u32, test: &str) -> TestStatus {
        r.gpus
            .get(&gpu)
            .and_then(|t| t.iter().find(|t| t.test == test))
            .map(|t| t.status)
            .unwrap_or_else(|| panic!("no {test} on GPU {gpu}: {r:?}"))
    }

    /// A 4.x document with one test whose results are `results`.
    fn doc4(results: serde_json::Value) -> Value {
        json!({"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
            {"name": "memory", "results": results, "test_summary": {"status": "Pass"}}
        ]}]}})
    }

    fn pass4(id: serde_json::Value) -> serde_json::Value {
        json!({"entity_group": "GPU", "entity_group_id": 1, "entity_id": id, "status": "Pass"})
    }

    fn fail4(id: serde_json::Value) -> serde_json::Value {
        json!({"entity_group": "GPU", "entity_group_id": 1, "entity_id": id, "status": "Fail",
               "warnings": [{"warning": "Found 3 faulty memory elements", "error_id": 52, "error_category": 10, "error_severity": 2}]})
    }

    #[test]
    fn dcgm4_pass() {
        let r = report("dcgm4-pass.json", None);
        assert_eq!(r.gpus.keys().copied().collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(status(&r, 0, "memory"), TestStatus::Pass);
        assert_eq!(status(&r, 1, "software"), TestStatus::Pass);
        assert!(r.unplaced.is_empty() && r.unexplained.is_empty());
        assert_eq!(r.version.as_deref(), Some("4.2.3"));
        let j = judge_report(&r, Some(0), None);
        assert_eq!(j.result, DiagResult::Pass, "{j:?}");
    }

    #[test]
    fn a_pass_counts_only_for_the_gpu_it_names() {
        // GPU 1 is present, but only GPU 0 has results: GPU 1 could not tell, naming why.
        let r = parse_document(&doc4(json!([pass4(json!(0))])), Some(&[0, 1]));
        let j = judge_report(&r, Some(0), None);
        assert_eq!(j.result, DiagResult::Unknown);
        assert_eq!(j.cause, Some(Cause::MissingGpu));
        assert!(j.why.contains("no DCGM result names GPU 1"), "{}", j.why);
        assert!(j.why.contains("name GPU 0"), "{}", j.why);
        let one = j.gpus.iter().find(|g| g.index == 1).unwrap();
        assert_eq!(one.result, DiagResult::Unknown);
        let zero = j.gpus.iter().find(|g| g.index == 0).unwrap();
        assert_eq!(zero.result, DiagResult::Pass);
    }

    #[test]
    fn ids_that_cannot_be_read_are_never_a_pass_nor_a_failure_of_the_node() {
        for (id, said) in [
            (json!("GPU-abc"), "\"GPU-abc\" is not a GPU id"),
            (json!(null), "the id is null"),
            (json!(-1), "is negative"),
            (json!(1.5), "not a whole number"),
            (json!(99_999_999_999u64), "out of range"),
            (json!(7), "no GPU present has that id"),
        ] {
            // A failure for an entity that cannot be placed: could not tell, never a fail.
            let r = parse_document(
                &doc4(json!([pass4(json!(0)), pass4(json!(1)), fail4(id.clone())])),
                Some(&[0, 1]),
            );
            let j = judge_report(&r, Some(205), None);
            assert_eq!(j.result, DiagResult::Unknown, "{id}: {j:?}");
            assert_eq!(j.cause, Some(Cause::Entity), "{id}");
            assert!(j.why.contains(said), "{id}: {}", j.why);
            assert!(j.gpus.iter().all(|g| g.result == DiagResult::Pass), "{id}");
            // A pass for it passes no GPU: GPU 1 without its own could not tell.
            let r = parse_document(
                &doc4(json!([pass4(json!(0)), pass4(id.clone())])),
                Some(&[0, 1]),
            );
            let j = judge_report(&r, Some(0), None);
            assert_eq!(j.result, DiagResult::Unknown, "{id}");
            assert_eq!(j.cause, Some(Cause::MissingGpu), "{id}");
            assert!(
                j.notes.iter().any(|n| n.contains("counted for no GPU")),
                "{id}: {:?}",
                j.notes
            );
        }
    }

    #[test]
    fn entities_that_are_not_gpus_are_no_gpu() {
        let cpu =
            json!({"entity_group": "CPU", "entity_group_id": 7, "entity_id": 0, "status": "Fail"});
        let r = parse_document(&doc4(json!([pass4(json!(0)), cpu])), Some(&[0]));
        assert_eq!(r.unplaced.len(), 1);
        assert_eq!(r.unplaced[0].why, "not a GPU");
        let j = judge_report(&r, Some(226), None);
        assert_eq!(j.result, DiagResult::Unknown);
        assert_eq!(j.cause, Some(Cause::Entity));
        // Disagreeing group name and number, and group numbers that cannot be read.
        for bad in [
            json!({"entity_group": "GPU", "entity_group_id": 7, "entity_id": 0, "status": "Pass"}),
            json!({"entity_group": 1, "entity_id": 0, "status": "Pass"}),
            json!({"entity_group_id": "GPU", "entity_id": 0, "status": "Pass"}),
            json!({"entity_group": "GPU", "status": "Pass"}),
        ] {
            assert!(matches!(place(&bad, false), Place::Nowhere(..)), "{bad}");
        }
        // 3.x and NVVS ids.
        assert_eq!(place(&json!({"gpu_id": "3"}), false), Place::Gpus(vec![3]));
        assert_eq!(
            place(&json!({"gpu_ids": "0,1,2"}), false),
            Place::Gpus(vec![0, 1, 2])
        );
        assert_eq!(place(&json!({"gpu_ids": 5}), false), Place::Gpus(vec![5]));
        assert!(matches!(
            place(&json!({"gpu_ids": "0,x"}), false),
            Place::Nowhere(..)
        ));
        assert!(matches!(
            place(&json!({"gpu_ids": ""}), false),
            Place::Nowhere(..)
        ));
        assert_eq!(place(&json!({"status": "Pass"}), true), Place::Node);
        assert!(matches!(
            place(&json!({"status": "Pass"}), false),
            Place::Nowhere(..)
        ));
    }

    #[test]
    fn configuration_findings_are_not_hardware_failures() {
        // DCGM 4.x's software test: persistence mode off (DCGM_FR_PERSISTENCE_MODE 29,
        // severity DCGM_ERROR_CONFIG 5, category DCGM_FR_EC_SOFTWARE_OTHER 8), dcgmi exit 226.
        let software = json!({"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Fail",
            "warnings": [{"warning": "Persistence Mode: Persistence mode for GPU 0 is disabled.", "error_id": 29, "error_category": 8, "error_severity": 5}]});
        let doc = json!({"DCGM Diagnostic": {"test_categories": [
            {"category": "Deployment", "tests": [{"name": "software", "results": [software], "test_summary": {"status": "Fail"}}]},
            {"category": "Hardware", "tests": [{"name": "memory", "results": [pass4(json!(0))], "test_summary": {"status": "Pass"}}]}
        ]}});
        let r = parse_document(&doc, Some(&[0]));
        assert_eq!(status(&r, 0, "software"), TestStatus::Config);
        assert!(r.unexplained.is_empty(), "{:?}", r.unexplained);
        let j = judge_report(&r, Some(226), None);
        assert_eq!(j.result, DiagResult::Config, "{j:?}");
        assert!(
            j.why.contains("Persistence mode for GPU 0 is disabled"),
            "{}",
            j.why
        );
        // Exit 205 (an isolating error) is not what a configuration finding alone exits with.
        let j = judge_report(&r, Some(205), None);
        assert_eq!(j.result, DiagResult::Unknown);
        assert_eq!(j.cause, Some(Cause::ExitCode));
        // A configuration finding alone is no pass of the GPU.
        let only = json!({"DCGM Diagnostic": {"test_categories": [
            {"category": "Deployment", "tests": [{"name": "software", "results": [doc["DCGM Diagnostic"]["test_categories"][0]["tests"][0]["results"][0].clone()]}]}]}});
        let j = judge_report(&parse_document(&only, Some(&[0])), Some(226), None);
        assert_eq!(j.result, DiagResult::Unknown, "{j:?}");
        assert!(
            j.why
                .contains("no DCGM test passed GPU 0 (software config)"),
            "{}",
            j.why
        );
        // Outside the Deployment category: config only when DCGM files every warning so.
        let ecc_off = json!({"entity_group": "GPU", "entity_id": 0, "status": "Fail",
            "warnings": [{"warning": "ECC memory on GPU 0 is not currently active", "error_id": 55}]});
        assert_eq!(
            test_result("memory", false, &ecc_off).status,
            TestStatus::Config
        );
        assert_eq!(
            test_result("memory", false, &fail4(json!(0))).status,
            TestStatus::Fail
        );
    }

    #[test]
    fn dcgms_words_for_a_busy_gpu_could_not_tell() {
        // NVIDIA/go-dcgm#52, NVIDIA/DCGM#224: CUDA's words for a GPU another process holds.
        let busy = json!({"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Fail",
            "warnings": [{"warning": "GPU 0 Error using CUDA API cuCtxCreate Check DCGM and system logs for errors. Reset GPU. Restart DCGM. Rerun diagnostics. Unable to create CUDA context: 'CUDA-capable device(s) is/are busy or unavailable'.", "error_id": 51, "error_category": 6, "error_severity": 1}]});
        let r = parse_document(&doc4(json!([busy])), Some(&[0]));
        let t = &r.gpus[&0][0];
        assert_eq!(t.status, TestStatus::Unknown);
        assert!(t.message.starts_with(GPU_BUSY), "{}", t.message);
        let j = judge_report(&r, Some(226), None);
        assert_eq!(j.result, DiagResult::Unknown);
        assert_eq!(j.cause, Some(Cause::GpuBusy));
        assert!(j.why.contains("busy or unavailable"), "{}", j.why);
        assert!(
            busy_words("MPS client failed to connect to the MPS control daemon or the MPS server")
                .is_some()
        );
        assert!(busy_words("Found 3 faulty memory elements on GPU 1").is_none());
    }

    #[test]
    fn a_summary_failure_no_result_explains_cannot_be_placed() {
        let doc = json!({"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
            {"name": "nvbandwidth", "results": [pass4(json!(0))],
             "test_summary": {"status": "Fail", "warnings": [{"warning": "NVLink down", "error_id": 14}]}}
        ]}]}});
        let r = parse_document(&doc, Some(&[0]));
        assert_eq!(r.unexplained.len(), 1, "{r:?}");
        let j = judge_report(&r, Some(226), None);
        assert_eq!(j.result, DiagResult::Unknown);
        assert_eq!(j.cause, Some(Cause::Entity));
        assert!(j.why.contains("NVLink down"), "{}", j.why);
        // Iterations whose overall result fails with nothing failing in them: the same.
        let r = parse_document(
            &json!({"iterations": [], "Overall Result": "Fail", "Warning": "x"}),
            None,
        );
        assert_eq!(r.unexplained.len(), 1);
    }

    #[test]
    fn dcgm3_dcgmi_deployment_results_pass_no_gpu() {
        let r = report("dcgm3-pass.json", None);
        assert_eq!(r.present.iter().copied().collect::<Vec<_>>(), vec![0, 1]);
        assert!(!r.gpus[&0].iter().any(|t| t.test == "Denylist"));
        assert!(r.node.iter().any(|t| t.test == "Denylist"));
        assert_eq!(status(&r, 0, "GPU Memory"), TestStatus::Pass);
        assert_eq!(r.version.as_deref(), Some("3.3.8"));
        let j = judge_report(&r, Some(0), None);
        assert_eq!(j.result, DiagResult::Pass, "{j:?}");
        assert!(
            j.notes.iter().any(|n| n.contains("Denylist pass")),
            "{:?}",
            j.notes
        );
        let r = report("dcgm3-fail-gpu0.json", None);
        assert_eq!(status(&r, 0, "GPU Memory"), TestStatus::Fail);
        assert_eq!(status(&r, 1, "GPU Memory"), TestStatus::Pass);
    }

    #[test]
    fn runtime_error_and_prefixed_text() {
        let r = report("dcgm4-runtime-error.json", None);
        assert!(r.gpus.is_empty());
        assert!(r.runtime_error.clone().unwrap().contains("already running"));
        let j = judge_report(&r, Some(217), None);
        assert_eq!(j.cause, Some(Cause::RuntimeError));
        let mut text = b"Successfully ran diagnostic for group.\n{ not json {\"a\": 1}\n".to_vec();
        text.extend(fixture("dcgm4-pass.json"));
        assert!(matches!(find_document(&text), Found::Document(_)));
        let pass = fixture("dcgm4-pass.json");
        assert!(matches!(find_document(&pass[..pass.len() / 2]), Found::Cut));
        assert!(matches!(
            find_document(b"garbage {{{ ]]] \xff\xfe"),
            Found::Absent
        ));
        assert!(matches!(
            find_document(&[b'{'; 100_000]),
            Found::Absent | Found::Cut
        ));
        assert!(matches!(find_document(b"{\"other\": 1}"), Found::Absent));
    }

    #[test]
    fn odd_documents_never_panic_and_never_pass() {
        for doc in [
            json!({"DCGM Diagnostic": null}),
            json!({"DCGM Diagnostic": {"test_categories": "x"}}),
            json!({"DCGM Diagnostic": {"test_categories": [null, 3, {"tests": [null, {"results": [null, 7, {"entity_id": -1, "status": 7}]}]}]}}),
            json!({"DCGM GPU Diagnostic": {"test_categories": [{"tests": [{"name": "x", "results": [{"gpu_id": "99999999999", "status": "Fail"}]}]}]}}),
            json!({"iterations": [{"DCGM Diagnostic": {}}, 3], "Overall Result": "Fail"}),
            json!({"entity_groups": [{"entity_group": "GPU", "entities": [{"entity_id": "GPU-x"}, null]}], "DCGM Diagnostic": {}}),
        ] {
            for asked in [None, Some(&[0u32][..])] {
                let r = parse_document(&doc, asked);
                let j = judge_report(&r, Some(0), None);
                assert_ne!(j.result, DiagResult::Pass, "{doc}");
                assert_ne!(j.result, DiagResult::Fail, "{doc}");
            }
        }
    }

    #[test]
    fn exit_codes_in_words() {
        assert!(describe_exit(226).contains("DCGM_ST_NVVS_ERROR"));
        assert!(describe_exit(235).contains("Host engine connection invalid"));
        assert_eq!(describe_exit(143), "143 (stopped by signal 15)");
        assert_eq!(describe_exit(7), "7");
    }

    #[test]
    fn arguments() {
        let plan = DcgmPlan {
            binary: "dcgmi".into(),
            level: Level::Standard,
            gpus: Some(vec![0, 3]),
            timeout: Duration::from_secs(1),
            host: Some("unix:///run/nvidia-dcgm/nv-hostengine".into()),
        };
        assert_eq!(
            args(&plan).join(" "),
            "diag -r 2 -j -i 0,3 --host unix:///run/nvidia-dcgm/nv-hostengine"
        );
        let plan = DcgmPlan {
            gpus: None,
            host: None,
            level: Level::Long,
            ..plan
        };
        assert_eq!(args(&plan).join(" "), "diag -r 3 -j");
    }
}
