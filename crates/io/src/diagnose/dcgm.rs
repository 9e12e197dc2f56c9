//! DCGM's diagnostics through `dcgmi diag -r N -j` (docs/diagnose.md): the tier that makes the
//! GPUs work with NVIDIA's own tests where DCGM is installed, read from its JSON.
//!
//! `dcgmi` runs in a process tree that is killed whole at the deadline ([`crate::sys::tree`]):
//! the diagnostic's own test processes (`nvvs` under an embedded host engine) die with it. At
//! the deadline `dcgmi` first gets `SIGTERM` and [`TERM_GRACE`]: on that signal it stops the
//! diagnostic it started, which also reaches one run by a standalone `nv-hostengine` (there the
//! tests are the host engine's children, outside our tree).
//!
//! What its output means (DCGM's source, `dcgmi/Diag.cpp`, `nvvs/include/NvvsJsonStrings.h`):
//!
//! - DCGM 4.x: `{"DCGM Diagnostic": {"test_categories": [{"category", "tests": [{"name",
//!   "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": N, "status",
//!   "warnings": [{"warning", "error_id", "error_category", "error_severity"}], "info":
//!   [..]}], "test_summary": {"status", "warnings"}}]}]}, "entity_groups": [{"entity_group":
//!   "GPU", "entities": [{"entity_id", "serial_num", "device_id"}]}], "metadata": {"version",
//!   "Driver Version Detected"}}`.
//! - DCGM 3.x: `{"DCGM GPU Diagnostic": {"test_categories": [...]}, "version", "Driver Version
//!   Detected", "GPU Device IDs": [..], "GPU Device Serials": {"0": ..}}`; per-GPU results are
//!   `{"gpu_id": "0", "status", "warnings": [{"warning", ...}], "info": "text"}`; the
//!   Deployment tests have one result for every GPU (`gpu_id` only when one failed; the
//!   message under `"warnings"` inside each warning).
//! - A run that could not complete: `{"DCGM Diagnostic": {"version", "runtime_error": "..."}}`
//!   (3.x: under `"DCGM GPU Diagnostic"`).
//! - Statuses: `Pass`, `Fail`, `Skip`, `Warn` (printed as `Fail` by `dcgmi -j` itself), and
//!   `Not Run`; results of tests not run are left out.
//! - No UUIDs: GPUs are DCGM's GPU ids, which DCGM numbers in NVML's order (the NVML index).
//!
//! The rule: a failed test fails, whatever the exit code; a JSON with no failure and an exit
//! code that says one is "could not tell"; no host engine, no `dcgmi`, no diagnostic plugin or
//! no permission means the tier did not run (never a hardware fault); a timeout, cut or
//! unreadable output is "could not tell".

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::model::cut;
use crate::model::diagnosis::{
    DiagResult, GpuDiagnosis, Level, MAX_RAW, TestResult, TestStatus, Tier, TierRun,
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
            return (
                tier(false, DiagResult::Unknown, why, ms(start), String::new()),
                Vec::new(),
            );
        }
        Err(TreeError::Subreaper(e)) => {
            let why = format!("cannot run dcgmi with a deadline here: {e}");
            return (
                tier(false, DiagResult::Unknown, why, ms(start), String::new()),
                Vec::new(),
            );
        }
        Err(TreeError::Wait(e)) => {
            let why = format!("lost track of dcgmi: {e}");
            return (
                tier(true, DiagResult::Unknown, why, ms(start), String::new()),
                Vec::new(),
            );
        }
    };
    let raw = raw_output(&plan.binary, &argv, &out);
    let (ran, result, why, gpus) = judge(&out, plan.gpus.as_deref());
    (tier(ran, result, why, ms(start), raw), gpus)
}

fn tier(ran: bool, result: DiagResult, why: String, duration_ms: u64, raw: String) -> TierRun {
    let mut why = why;
    cut(&mut why, crate::model::MAX_TEXT);
    TierRun {
        tier: Tier::Dcgm,
        ran,
        result,
        why,
        duration_ms,
        raw,
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

/// What the run says: (ran, result, why, per-GPU tests).
fn judge(out: &TreeOutput, asked: Option<&[u32]>) -> (bool, DiagResult, String, Vec<GpuDiagnosis>) {
    let unknown = |why: String| (true, DiagResult::Unknown, why, Vec::new());
    if let Ended::TimedOut(t) = out.ended {
        let stuck = if out.unkilled > 0 {
            format!(
                "; {} would not die (stuck in the kernel, as in a hung GPU driver call?)",
                out.unkilled
            )
        } else {
            String::new()
        };
        return unknown(format!(
            "timed out after {}; dcgmi's process tree was killed ({} process(es)){stuck}",
            humantime::format_duration(t),
            out.killed
        ));
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
            return unknown(format!(
                "dcgmi's output was over {} ({} bytes written): its JSON was cut",
                crate::sys::limits::human_bytes(MAX_OUTPUT),
                out.stdout_total
            ));
        }
        Found::Cut => {
            return unknown(format!(
                "dcgmi's JSON ends before it is complete{}: {}",
                exit_words(code, signal),
                tail(&text)
            ));
        }
        Found::Absent => None,
    };
    let report = doc.as_ref().map(|d| parse_document(d, asked));
    let has_tests = report
        .as_ref()
        .is_some_and(|r| !r.gpus.is_empty() || !r.node_failures.is_empty());
    // No host engine, no diagnostic, no permission: the tier could not run.
    if !has_tests && let Some(why) = not_set_up(code, signal, report.as_ref(), &text) {
        return (false, DiagResult::Unknown, why, Vec::new());
    }
    let Some(report) = report else {
        if out.stdout_cut() {
            return unknown(format!(
                "dcgmi's output was over {} ({} bytes written) and held no DCGM JSON",
                crate::sys::limits::human_bytes(MAX_OUTPUT),
                out.stdout_total
            ));
        }
        return unknown(format!(
            "dcgmi printed no DCGM JSON{}: {}",
            exit_words(code, signal),
            tail(&text)
        ));
    };
    judge_report(&report, code, signal)
}

/// A document with test results: fail, could not tell or pass, by what it and the exit say.
fn judge_report(
    report: &Report,
    code: Option<i32>,
    signal: Option<i32>,
) -> (bool, DiagResult, String, Vec<GpuDiagnosis>) {
    let gpus: Vec<GpuDiagnosis> = report
        .gpus
        .iter()
        .map(|(index, tests)| {
            let mut g = GpuDiagnosis {
                index: *index,
                uuid: String::new(),
                result: DiagResult::Unknown,
                tests: tests.clone(),
            };
            g.judge();
            g
        })
        .collect();
    let has = |s: TestStatus| gpus.iter().any(|g| g.tests.iter().any(|t| t.status == s));
    let version = report
        .version
        .as_deref()
        .map(|v| format!("DCGM {v}: "))
        .unwrap_or_default();
    if has(TestStatus::Fail) || !report.node_failures.is_empty() {
        let why = if report.node_failures.is_empty() {
            String::new()
        } else {
            format!("{version}failed: {}", report.node_failures.join("; "))
        };
        return (true, DiagResult::Fail, why, gpus);
    }
    if let Some(e) = &report.runtime_error {
        return (
            true,
            DiagResult::Unknown,
            format!("{version}could not complete the diagnostic: {}", e.trim()),
            gpus,
        );
    }
    if has(TestStatus::Unknown) {
        return (
            true,
            DiagResult::Unknown,
            format!("{version}a test's status could not be read"),
            gpus,
        );
    }
    if let Some(c) = code.filter(|c| *c != 0) {
        return (
            true,
            DiagResult::Unknown,
            format!(
                "{version}dcgmi exited with {} but its JSON shows no failure",
                describe_exit(c)
            ),
            gpus,
        );
    }
    if let Some(s) = signal {
        return (
            true,
            DiagResult::Unknown,
            format!("{version}dcgmi was killed by signal {s}"),
            gpus,
        );
    }
    if has(TestStatus::Pass) || has(TestStatus::Warn) {
        return (true, DiagResult::Pass, String::new(), gpus);
    }
    (
        true,
        DiagResult::Unknown,
        format!("{version}DCGM ran no test (every test skipped or not run)"),
        gpus,
    )
}

/// Why dcgmi could not run a diagnostic at all (no host engine, no diagnostic, no permission),
/// when its exit or its words say so.
fn not_set_up(
    code: Option<i32>,
    signal: Option<i32>,
    report: Option<&Report>,
    text: &str,
) -> Option<String> {
    let setup = code.is_some_and(|c| NOT_SET_UP.contains(&c))
        || text.contains("Unable to connect to host engine")
        || text.contains("Unable to start an embedded host engine");
    if !setup {
        return None;
    }
    let said = report
        .and_then(|r| r.runtime_error.clone())
        .or_else(|| error_line(text))
        .unwrap_or_else(|| tail(text));
    let what = if text.contains("embedded host engine") {
        "nv-hostengine is not running and dcgmi could not start an embedded one"
    } else if code == Some(235) || text.contains("host engine") || said.contains("host engine") {
        "nv-hostengine is not running or not reachable"
    } else {
        "DCGM's diagnostic cannot run here"
    };
    Some(format!(
        "{what}: {}{}",
        said.trim(),
        exit_words(code, signal)
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

/// What a DCGM document says.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Report {
    /// DCGM's version, where the document has it.
    pub version: Option<String>,
    /// Every test on every GPU (DCGM's GPU id, the NVML index).
    pub gpus: BTreeMap<u32, Vec<TestResult>>,
    /// Failures DCGM reported on no GPU (a test's summary, the overall result of iterations).
    pub node_failures: Vec<String>,
    /// `runtime_error`: DCGM could not complete the run.
    pub runtime_error: Option<String>,
}

/// Reads a DCGM 3.x or 4.x document (or the `iterations` wrapper of `--iterations`).
/// `asked`: the GPU ids dcgmi was run on, for results that name no GPU.
pub fn parse_document(doc: &Value, asked: Option<&[u32]>) -> Report {
    let mut report = Report::default();
    if let Some(iterations) = doc.get("iterations").and_then(Value::as_array) {
        for it in iterations {
            let one = parse_document(it, asked);
            report.version = report.version.or(one.version);
            for (gpu, tests) in one.gpus {
                report.gpus.entry(gpu).or_default().extend(tests);
            }
            report.node_failures.extend(one.node_failures);
            report.runtime_error = report.runtime_error.or(one.runtime_error);
        }
        let overall = doc.get("Overall Result").and_then(Value::as_str);
        if overall.is_some_and(|s| s.eq_ignore_ascii_case("fail"))
            && report.node_failures.is_empty()
            && !report
                .gpus
                .values()
                .flatten()
                .any(|t| t.status == TestStatus::Fail)
        {
            let said = doc.get("Warning").and_then(Value::as_str).unwrap_or("");
            report
                .node_failures
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
    let all = every_gpu(doc, asked);
    let categories = root
        .get("test_categories")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for category in categories {
        let tests = category
            .get("tests")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for test in tests {
            read_test(test, &all, &mut report);
        }
    }
    report
}

/// The GPUs a run covered: those asked, those the document lists, and those with a result.
fn every_gpu(doc: &Value, asked: Option<&[u32]>) -> BTreeSet<u32> {
    if let Some(asked) = asked.filter(|a| !a.is_empty()) {
        return asked.iter().copied().collect();
    }
    let mut all = BTreeSet::new();
    // 4.x: entity_groups[GPU].entities[].entity_id
    for group in doc
        .get("entity_groups")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        if !is_gpu_group(group) {
            continue;
        }
        for e in group
            .get("entities")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            if let Some(id) = e.get("entity_id").and_then(as_id) {
                all.insert(id);
            }
        }
    }
    // 3.x: "GPU Device Serials" {"0": ..}, "GPU Device IDs" [one per GPU id].
    if let Some(serials) = doc.get("GPU Device Serials").and_then(Value::as_object) {
        all.extend(serials.keys().filter_map(|k| k.trim().parse::<u32>().ok()));
    }
    if let Some(ids) = doc.get("GPU Device IDs").and_then(Value::as_array) {
        all.extend((0..ids.len()).filter_map(|i| u32::try_from(i).ok()));
    }
    // Any GPU a result names.
    let root = doc
        .get("DCGM Diagnostic")
        .or_else(|| doc.get("DCGM GPU Diagnostic"));
    if let Some(cats) = root
        .and_then(|r| r.get("test_categories"))
        .and_then(Value::as_array)
    {
        for r in cats
            .iter()
            .filter_map(|c| c.get("tests").and_then(Value::as_array))
            .flatten()
            .filter_map(|t| t.get("results").and_then(Value::as_array))
            .flatten()
        {
            if let Some(Some(ids)) = result_gpus(r) {
                all.extend(ids);
            }
        }
    }
    all
}

fn is_gpu_group(v: &Value) -> bool {
    match (v.get("entity_group"), v.get("entity_group_id")) {
        (Some(g), _) if g.is_string() => g.as_str().is_some_and(|g| g.eq_ignore_ascii_case("GPU")),
        // DCGM_FE_GPU
        (_, Some(id)) => id.as_u64() == Some(1),
        _ => true,
    }
}

/// A GPU id as DCGM writes it: a number, or a number in a string (3.x `"gpu_id": "0"`).
fn as_id(v: &Value) -> Option<u32> {
    match v {
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// Which GPUs one result is for: `None` when it is for an entity that is not a GPU (a CPU, an
/// NVSwitch: not ours to judge); `Some(None)` when it names no GPU (every GPU of the run).
fn result_gpus(r: &Value) -> Option<Option<Vec<u32>>> {
    if r.get("entity_group").is_some() || r.get("entity_group_id").is_some() {
        if !is_gpu_group(r) {
            return None;
        }
        return Some(r.get("entity_id").and_then(as_id).map(|id| vec![id]));
    }
    if let Some(id) = r.get("gpu_id").and_then(as_id) {
        return Some(Some(vec![id]));
    }
    match r.get("gpu_ids") {
        Some(Value::String(s)) => Some(Some(
            s.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
        )),
        Some(Value::Array(a)) => Some(Some(a.iter().filter_map(as_id).collect())),
        _ => Some(None),
    }
}

fn status_of(v: Option<&Value>) -> (TestStatus, Option<String>) {
    let Some(s) = v.and_then(Value::as_str) else {
        return (TestStatus::Unknown, Some("no status".to_string()));
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
        _ => (TestStatus::Unknown, Some(format!("status {s:?}"))),
    }
}

/// The tool's own words in one result: its warnings, then its info.
fn words(r: &Value) -> (Vec<String>, Vec<String>) {
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
    let list = |v: Option<&Value>| -> Vec<String> {
        match v {
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(text)
                .filter(|s| !s.is_empty())
                .collect(),
            Some(v) => text(v).into_iter().filter(|s| !s.is_empty()).collect(),
            None => Vec::new(),
        }
    };
    (list(r.get("warnings")), list(r.get("info")))
}

fn test_result(name: &str, r: &Value) -> TestResult {
    let (mut status, odd) = status_of(r.get("status"));
    let (warnings, info) = words(r);
    if status == TestStatus::Pass && !warnings.is_empty() {
        status = TestStatus::Warn;
    }
    let mut message: Vec<String> = odd.into_iter().collect();
    message.extend(warnings);
    message.extend(info);
    let mut message = message.join("; ");
    cut(&mut message, crate::model::MAX_TEXT);
    let mut test = name.to_string();
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

fn read_test(test: &Value, all: &BTreeSet<u32>, report: &mut Report) {
    let name = test
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("(unnamed test)");
    let results = test
        .get("results")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut gpu_failed = false;
    let mut any_gpu = false;
    for r in results {
        let Some(gpus) = result_gpus(r) else { continue };
        let t = test_result(name, r);
        let targets: Vec<u32> = match gpus {
            Some(ids) => ids,
            None => all.iter().copied().collect(),
        };
        if targets.is_empty() {
            if t.status == TestStatus::Fail {
                report.node_failures.push(failure_words(&t));
            }
            continue;
        }
        any_gpu = true;
        gpu_failed |= t.status == TestStatus::Fail;
        for id in targets {
            report.gpus.entry(id).or_default().push(t.clone());
        }
    }
    let Some(summary) = test.get("test_summary") else {
        return;
    };
    let t = test_result(name, summary);
    if !any_gpu && results.is_empty() {
        // Only a summary: it is the test's result on every GPU of the run.
        if all.is_empty() {
            if t.status == TestStatus::Fail {
                report.node_failures.push(failure_words(&t));
            }
            return;
        }
        for id in all {
            report.gpus.entry(*id).or_default().push(t.clone());
        }
    } else if t.status == TestStatus::Fail && !gpu_failed {
        report.node_failures.push(failure_words(&t));
    }
}

fn failure_words(t: &TestResult) -> String {
    if t.message.is_empty() {
        t.test.clone()
    } else {
        format!("{}: {}", t.test, t.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn dcgm4_pass() {
        let r = report("dcgm4-pass.json", None);
        assert_eq!(r.gpus.keys().copied().collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(status(&r, 0, "memory"), TestStatus::Pass);
        assert_eq!(status(&r, 1, "software"), TestStatus::Pass);
        assert!(r.node_failures.is_empty());
        assert_eq!(r.version.as_deref(), Some("4.2.3"));
    }

    #[test]
    fn dcgm4_fail_names_the_gpu_and_dcgms_words() {
        let r = report("dcgm4-fail-gpu1.json", None);
        assert_eq!(status(&r, 0, "memory"), TestStatus::Pass);
        assert_eq!(status(&r, 1, "memory"), TestStatus::Fail);
        let t = r.gpus[&1].iter().find(|t| t.test == "memory").unwrap();
        assert!(
            t.message
                .contains("Found 3 faulty memory elements on GPU 1"),
            "{}",
            t.message
        );
        assert!(r.node_failures.is_empty(), "{:?}", r.node_failures);
    }

    #[test]
    fn dcgm3_shapes() {
        let r = report("dcgm3-pass.json", None);
        assert_eq!(r.gpus.keys().copied().collect::<Vec<_>>(), vec![0, 1]);
        // A Deployment test names no GPU: it is every GPU's.
        assert_eq!(status(&r, 1, "Denylist"), TestStatus::Pass);
        assert_eq!(status(&r, 0, "GPU Memory"), TestStatus::Pass);
        assert_eq!(r.version.as_deref(), Some("3.3.8"));
        let r = report("dcgm3-fail-gpu0.json", None);
        assert_eq!(status(&r, 0, "GPU Memory"), TestStatus::Fail);
        assert_eq!(status(&r, 1, "GPU Memory"), TestStatus::Pass);
        let t = r.gpus[&0].iter().find(|t| t.test == "GPU Memory").unwrap();
        assert!(t.message.contains("double-bit ECC"), "{}", t.message);
        let r = report("dcgm3-warn.json", None);
        assert_eq!(status(&r, 0, "Diagnostic"), TestStatus::Warn);
        let t = r.gpus[&0].iter().find(|t| t.test == "Diagnostic").unwrap();
        assert!(t.message.contains("thermal violation"), "{}", t.message);
    }

    #[test]
    fn dcgm4_warn_and_skip() {
        let r = report("dcgm4-warn.json", None);
        assert_eq!(status(&r, 0, "targeted_stress"), TestStatus::Warn);
        assert_eq!(status(&r, 1, "pcie"), TestStatus::Skip);
    }

    #[test]
    fn runtime_error_and_prefixed_text() {
        let r = report("dcgm4-runtime-error.json", None);
        assert!(r.gpus.is_empty());
        assert!(r.runtime_error.unwrap().contains("already running"));
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
    fn odd_documents_never_panic() {
        for doc in [
            serde_json::json!({"DCGM Diagnostic": null}),
            serde_json::json!({"DCGM Diagnostic": {"test_categories": "x"}}),
            serde_json::json!({"DCGM Diagnostic": {"test_categories": [{"tests": [{"results": [{"entity_id": -1, "status": 7}]}]}]}}),
            serde_json::json!({"DCGM GPU Diagnostic": {"test_categories": [{"tests": [{"name": "x", "results": [{"gpu_id": "99999999999", "status": "Fail"}]}]}]}}),
            serde_json::json!({"iterations": [{"DCGM Diagnostic": {}}, 3], "Overall Result": "Fail"}),
        ] {
            let _ = parse_document(&doc, None);
            let _ = parse_document(&doc, Some(&[0]));
        }
        let r = parse_document(
            &serde_json::json!({"iterations": [], "Overall Result": "Fail", "Warning": "x"}),
            None,
        );
        assert_eq!(r.node_failures.len(), 1);
    }

    #[test]
    fn non_gpu_entities_are_not_judged_and_summaries_fail_the_node() {
        let doc = serde_json::json!({"DCGM Diagnostic": {"test_categories": [{"category": "Hardware", "tests": [
            {"name": "cpu_eud", "results": [{"entity_group": "CPU", "entity_group_id": 7, "entity_id": 0, "status": "Fail"}]},
            {"name": "nvbandwidth", "results": [{"entity_group": "GPU", "entity_group_id": 1, "entity_id": 0, "status": "Pass"}],
             "test_summary": {"status": "Fail", "warnings": [{"warning": "NVLink down", "error_id": 1}]}}
        ]}]}});
        let r = parse_document(&doc, None);
        assert_eq!(status(&r, 0, "nvbandwidth"), TestStatus::Pass);
        assert!(!r.gpus[&0].iter().any(|t| t.test == "cpu_eud"));
        assert_eq!(
            r.node_failures,
            vec!["nvbandwidth: NVLink down".to_string()]
        );
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
