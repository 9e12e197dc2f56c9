//! What an active test of the GPUs found (`gpu-medic diagnose`, docs/diagnose.md): per GPU,
//! per test, per tier (DCGM's diagnostics, the built-in CUDA check). Plain data: it travels
//! in a `diagnose` order's outcome into the engine and the journal, and out as `--json`.
//!
//! The one rule that matters: a pass is only ever what a tool was seen to pass. A tier that
//! could not run says why and never counts as a pass; a timeout, a lost GPU or output that
//! cannot be read is "could not tell" ([`DiagResult::Unknown`]), never a pass, and says what it
//! could not read ([`Cause`], the words in `why`). A configuration finding (DCGM's Deployment
//! tests: persistence mode off, an environment variable, ...) is neither a pass nor a hardware
//! failure: "needs configuration" ([`DiagResult::Config`]), reported and never a reason by
//! itself to drain or replace a node.

use serde::{Deserialize, Serialize};

use super::{MAX_ITEMS, MAX_NAME, MAX_TEXT, cut};

/// How deep the test goes: DCGM's run levels 1, 2 and 3 (`dcgmi diag -r`), and the built-in
/// check's share of memory and length of its figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Quick,
    Standard,
    Long,
}

impl Level {
    pub fn as_str(self) -> &'static str {
        match self {
            Level::Quick => "quick",
            Level::Standard => "standard",
            Level::Long => "long",
        }
    }

    /// DCGM's run level (`dcgmi diag -r N`).
    pub fn dcgm_run_level(self) -> u8 {
        match self {
            Level::Quick => 1,
            Level::Standard => 2,
            Level::Long => 3,
        }
    }

    pub fn parse(s: &str) -> Option<Level> {
        match s {
            "quick" | "1" => Some(Level::Quick),
            "standard" | "2" => Some(Level::Standard),
            "long" | "3" => Some(Level::Long),
            _ => None,
        }
    }
}

/// Which tool ran a test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// NVIDIA DCGM's diagnostics through `dcgmi diag`.
    Dcgm,
    /// gpu-medic's own check through the driver's `libcuda.so.1`.
    Cuda,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Dcgm => "dcgm",
            Tier::Cuda => "cuda",
        }
    }
}

/// One test's result on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TestStatus {
    Pass,
    /// The tool passed it with a warning: counted as a pass, the warning kept.
    Warn,
    Fail,
    /// Not run (not applicable at this level, or skipped by the tool): neither pass nor fail.
    Skip,
    /// Ran but could not tell (a timeout, the GPU lost mid-test, unreadable output).
    Unknown,
    /// A configuration finding (DCGM's Deployment category, or an error DCGM files as
    /// configuration: persistence mode off, a CUDA environment variable, ...): not a hardware
    /// failure, and not a pass of the GPU either.
    Config,
}

impl TestStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TestStatus::Pass => "pass",
            TestStatus::Warn => "warn",
            TestStatus::Fail => "fail",
            TestStatus::Skip => "skip",
            TestStatus::Unknown => "unknown",
            TestStatus::Config => "config",
        }
    }
}

/// The answer for a GPU, a tier or the whole diagnosis; also `diagnose`'s exit code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiagResult {
    /// Something ran and passed (exit 0).
    Pass,
    /// A test failed (exit 1).
    Fail,
    /// Nothing could tell (exit 2).
    Unknown,
    /// Every GPU passed its tests, and a tool found configuration to fix (exit 3): "needs
    /// configuration", reported, never a hardware failure.
    Config,
}

impl DiagResult {
    pub fn as_str(self) -> &'static str {
        match self {
            DiagResult::Pass => "pass",
            DiagResult::Fail => "fail",
            DiagResult::Unknown => "unknown",
            DiagResult::Config => "config",
        }
    }

    /// `gpu-medic diagnose`'s exit code.
    pub fn exit_code(self) -> i32 {
        match self {
            DiagResult::Pass => 0,
            DiagResult::Fail => 1,
            DiagResult::Unknown => 2,
            DiagResult::Config => 3,
        }
    }

    /// Whether the GPUs passed what they were tested with (a pass, or a pass with configuration
    /// findings): what returns a node to service.
    pub fn passed(self) -> bool {
        matches!(self, DiagResult::Pass | DiagResult::Config)
    }
}

/// What a diagnosis that could not tell could not read: a closed set, the label of
/// `gpu_medic_diagnosis_unknown_total{cause}` (docs/diagnose.md, "Could not tell").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Cause {
    /// No tier could run here (none installed, all turned off, no GPU found).
    NoTool,
    /// DCGM's host engine (nv-hostengine) is not running or cannot be reached.
    HostEngine,
    /// An MPS server holds the GPUs: the MPS daemon was up and not stopped for DCGM, or could
    /// not be started again after it.
    Mps,
    /// DCGM said a GPU is busy (held by an MPS server or another process).
    GpuBusy,
    /// A tool did not finish within its deadline.
    Timeout,
    /// A tool's output could not be read (no document, cut, garbage, a status it has no word
    /// for).
    Output,
    /// DCGM could not complete its run (`runtime_error`).
    RuntimeError,
    /// A result names an entity that cannot be read, is not a GPU, or is no GPU present.
    Entity,
    /// A GPU present has no pass of its own.
    MissingGpu,
    /// An exit code that contradicts the document.
    ExitCode,
    /// Every test was skipped or not run.
    NoTest,
    /// Anything else a tool could not do (a GPU lost mid-test, a driver call that failed).
    Tool,
}

impl Cause {
    pub const ALL: [Cause; 12] = [
        Cause::NoTool,
        Cause::HostEngine,
        Cause::Mps,
        Cause::GpuBusy,
        Cause::Timeout,
        Cause::Output,
        Cause::RuntimeError,
        Cause::Entity,
        Cause::MissingGpu,
        Cause::ExitCode,
        Cause::NoTest,
        Cause::Tool,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Cause::NoTool => "no-tool",
            Cause::HostEngine => "host-engine",
            Cause::Mps => "mps",
            Cause::GpuBusy => "gpu-busy",
            Cause::Timeout => "timeout",
            Cause::Output => "output",
            Cause::RuntimeError => "runtime-error",
            Cause::Entity => "entity",
            Cause::MissingGpu => "missing-gpu",
            Cause::ExitCode => "exit-code",
            Cause::NoTest => "no-test",
            Cause::Tool => "tool",
        }
    }
}

/// One test of one tier on one GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TestResult {
    pub tier: Tier,
    /// The test's name as its tool says it (`memory`, `pcie`, `kernel`, `bandwidth`, ...).
    pub test: String,
    pub status: TestStatus,
    /// The tool's own message (an error, a warning, a figure), cut to [`MAX_TEXT`].
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duration_ms: Option<u64>,
    /// A measured figure (bandwidth, throughput), with its unit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<f64>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub unit: String,
}

/// Figures are finite ([`Diagnosis::bound`] drops any other), so equality is an equivalence.
impl Eq for TestResult {}

/// Every test on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuDiagnosis {
    /// The GPU's index as NVML and the CUDA driver (in PCI bus order) number it.
    pub index: u32,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub uuid: String,
    pub result: DiagResult,
    #[serde(default)]
    pub tests: Vec<TestResult>,
}

/// One tier's run: whether it ran at all, and why not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierRun {
    pub tier: Tier,
    /// False when the tier could not start (turned off, not installed, no driver, no
    /// host engine): then it tells nothing, pass or fail.
    pub ran: bool,
    pub result: DiagResult,
    /// Why it did not run, or could not tell; the tool's own words where it has some.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub why: String,
    /// What it could not read when it did not run or could not tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<Cause>,
    /// What was done around the run that people should know (the MPS daemon stopped for
    /// DCGM and started again, results counted for no GPU).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    #[serde(default)]
    pub duration_ms: u64,
    /// The tool's raw output (capped), for the evidence bundle; not shown by `incidents show`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub raw: String,
}

/// A whole diagnosis.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Diagnosis {
    pub level: Level,
    pub result: DiagResult,
    /// The GPUs asked for, each with every test any tier ran on it.
    #[serde(default)]
    pub gpus: Vec<GpuDiagnosis>,
    #[serde(default)]
    pub tiers: Vec<TierRun>,
    /// One line for people: what passed, what failed where, or why nothing could tell.
    pub summary: String,
    /// What could not be read, when the diagnosis could not tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cause: Option<Cause>,
    #[serde(default)]
    pub duration_ms: u64,
}

/// The raw output kept per tier in a diagnosis.
pub const MAX_RAW: usize = 64 * 1024;

impl GpuDiagnosis {
    /// The GPU's answer from its tests: a failed test fails it; otherwise a test that could
    /// not tell makes it unknown; otherwise it passes when at least one test passed (and needs
    /// configuration when a test found some). A configuration finding alone is no pass.
    pub fn judge(&mut self) {
        let has = |s: TestStatus| self.tests.iter().any(|t| t.status == s);
        self.result = if has(TestStatus::Fail) {
            DiagResult::Fail
        } else if has(TestStatus::Unknown) {
            DiagResult::Unknown
        } else if has(TestStatus::Pass) || has(TestStatus::Warn) {
            if has(TestStatus::Config) {
                DiagResult::Config
            } else {
                DiagResult::Pass
            }
        } else {
            DiagResult::Unknown
        };
    }

    /// Why this GPU could not tell, in words: its tests that could not, or that nothing passed
    /// it (and what it did find).
    pub fn unknown_why(&self) -> String {
        let said: Vec<String> = self
            .tests
            .iter()
            .filter(|t| t.status == TestStatus::Unknown)
            .map(|t| {
                if t.message.is_empty() {
                    format!("{} {}", t.tier.as_str(), t.test)
                } else {
                    format!("{} {}: {}", t.tier.as_str(), t.test, t.message)
                }
            })
            .collect();
        if !said.is_empty() {
            return said.join("; ");
        }
        let found: Vec<String> = self
            .tests
            .iter()
            .map(|t| format!("{} {} {}", t.tier.as_str(), t.test, t.status.as_str()))
            .collect();
        if found.is_empty() {
            "no test ran on it".to_string()
        } else {
            format!("no test passed it ({})", found.join(", "))
        }
    }

    /// The first failed test, for one-line summaries.
    pub fn first_failure(&self) -> Option<&TestResult> {
        self.tests.iter().find(|t| t.status == TestStatus::Fail)
    }
}

impl Diagnosis {
    /// Puts tiers' per-GPU findings together for the GPUs asked (`asked`: index and UUID)
    /// and judges the whole: any failure fails it; a GPU nothing passed, or a tier that ran
    /// and could not tell, makes it unknown; only every asked GPU passed by something that
    /// ran is a pass. No GPU asked (none found) is unknown.
    pub fn combine(
        level: Level,
        asked: &[(u32, String)],
        tiers: Vec<(TierRun, Vec<GpuDiagnosis>)>,
        duration_ms: u64,
    ) -> Diagnosis {
        let mut gpus: Vec<GpuDiagnosis> = asked
            .iter()
            .map(|(index, uuid)| GpuDiagnosis {
                index: *index,
                uuid: uuid.clone(),
                result: DiagResult::Unknown,
                tests: Vec::new(),
            })
            .collect();
        let mut runs = Vec::new();
        for (run, found) in tiers {
            for g in found {
                if let Some(mine) = gpus.iter_mut().find(|m| m.index == g.index) {
                    if mine.uuid.is_empty() {
                        mine.uuid = g.uuid.clone();
                    }
                    mine.tests.extend(g.tests);
                }
            }
            runs.push(run);
        }
        for g in &mut gpus {
            g.judge();
        }
        let ran: Vec<&TierRun> = runs.iter().filter(|r| r.ran).collect();
        let (result, cause) = if gpus.iter().any(|g| g.result == DiagResult::Fail)
            || ran.iter().any(|r| r.result == DiagResult::Fail)
        {
            (DiagResult::Fail, None)
        } else if gpus.is_empty() {
            (DiagResult::Unknown, Some(Cause::NoTool))
        } else if ran.is_empty() {
            // Nothing ran: what kept the first tier that says so from running.
            let cause = runs.iter().find_map(|r| r.cause).unwrap_or(Cause::NoTool);
            (DiagResult::Unknown, Some(cause))
        } else if let Some(r) = ran.iter().find(|r| r.result == DiagResult::Unknown) {
            (DiagResult::Unknown, Some(r.cause.unwrap_or(Cause::Tool)))
        } else if gpus.iter().any(|g| g.result == DiagResult::Unknown) {
            (DiagResult::Unknown, Some(Cause::MissingGpu))
        } else if gpus.iter().any(|g| g.result == DiagResult::Config)
            || ran.iter().any(|r| r.result == DiagResult::Config)
        {
            (DiagResult::Config, None)
        } else {
            (DiagResult::Pass, None)
        };
        let summary = summarize(result, &gpus, &runs);
        let mut d = Diagnosis {
            level,
            result,
            gpus,
            tiers: runs,
            summary,
            cause,
            duration_ms,
        };
        d.bound();
        d
    }

    /// Cuts every string and list to the record bounds.
    pub fn bound(&mut self) {
        self.gpus.truncate(MAX_ITEMS);
        for g in &mut self.gpus {
            cut(&mut g.uuid, MAX_NAME);
            g.tests.truncate(MAX_ITEMS);
            for t in &mut g.tests {
                cut(&mut t.test, MAX_NAME);
                cut(&mut t.message, MAX_TEXT);
                cut(&mut t.unit, MAX_NAME);
                if t.value.is_some_and(|v| !v.is_finite()) {
                    t.value = None;
                }
            }
        }
        self.tiers.truncate(MAX_ITEMS);
        for r in &mut self.tiers {
            cut(&mut r.why, MAX_TEXT);
            cut(&mut r.raw, MAX_RAW);
            r.notes.truncate(MAX_ITEMS);
            for n in &mut r.notes {
                cut(n, MAX_TEXT);
            }
        }
        cut(&mut self.summary, MAX_TEXT);
    }

    /// The same diagnosis without the tools' raw output (what the journal keeps; the raw
    /// output goes to the evidence bundle).
    pub fn without_raw(&self) -> Diagnosis {
        let mut d = self.clone();
        for r in &mut d.tiers {
            r.raw.clear();
        }
        d
    }
}

fn summarize(result: DiagResult, gpus: &[GpuDiagnosis], runs: &[TierRun]) -> String {
    match result {
        DiagResult::Pass => passed_words(gpus, runs),
        DiagResult::Config => config_words(gpus, runs),
        DiagResult::Fail => {
            let failed: Vec<String> = gpus
                .iter()
                .filter(|g| g.result == DiagResult::Fail)
                .map(|g| match g.first_failure() {
                    Some(t) => format!(
                        "GPU {} ({}) failed {} {}: {}",
                        g.index,
                        if g.uuid.is_empty() { "?" } else { &g.uuid },
                        t.tier.as_str(),
                        t.test,
                        t.message
                    ),
                    None => format!("GPU {} failed", g.index),
                })
                .collect();
            if failed.is_empty() {
                format!("failed: {}", tier_words(runs, true))
            } else {
                failed.join("; ")
            }
        }
        DiagResult::Unknown => unknown_words(gpus, runs),
    }
}

/// The tiers that ran (or did not), each with why where it says.
fn tier_words(runs: &[TierRun], ran: bool) -> String {
    runs.iter()
        .filter(|r| r.ran == ran)
        .map(|r| {
            if r.why.is_empty() {
                r.tier.as_str().to_string()
            } else {
                format!("{} ({})", r.tier.as_str(), r.why)
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn passed_words(gpus: &[GpuDiagnosis], runs: &[TierRun]) -> String {
    format!(
        "passed on {} GPU(s) by {}",
        gpus.len(),
        runs.iter()
            .filter(|r| r.ran)
            .map(|r| r.tier.as_str())
            .collect::<Vec<_>>()
            .join(" and ")
    )
}

/// A pass with configuration findings: the pass, then the first findings.
fn config_words(gpus: &[GpuDiagnosis], runs: &[TierRun]) -> String {
    let mut found: Vec<String> = gpus
        .iter()
        .flat_map(|g| {
            g.tests
                .iter()
                .filter(|t| t.status == TestStatus::Config)
                .map(move |t| {
                    format!(
                        "GPU {} {} {}: {}",
                        g.index,
                        t.tier.as_str(),
                        t.test,
                        t.message
                    )
                })
        })
        .collect();
    found.extend(
        runs.iter()
            .filter(|r| r.ran && r.result == DiagResult::Config && !r.why.is_empty())
            .map(|r| format!("{}: {}", r.tier.as_str(), r.why)),
    );
    found.dedup();
    found.truncate(4);
    format!(
        "{}; needs configuration (not a hardware fault): {}",
        passed_words(gpus, runs),
        found.join("; ")
    )
}

/// Could not tell: on which GPUs, and what the tiers (or, where none says, each GPU) could not
/// read.
fn unknown_words(gpus: &[GpuDiagnosis], runs: &[TierRun]) -> String {
    if gpus.is_empty() {
        return "could not tell: no GPU to test".to_string();
    }
    if runs.iter().all(|r| !r.ran) {
        return format!(
            "could not tell: no test could run: {}",
            tier_words(runs, false)
        );
    }
    let open: Vec<&GpuDiagnosis> = gpus.iter().filter(|g| !g.result.passed()).collect();
    let mut s = String::from("could not tell");
    if !open.is_empty() {
        s.push_str(&format!(
            " on GPU {}",
            open.iter()
                .map(|g| g.index.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let why: Vec<String> = runs
        .iter()
        .filter(|r| r.ran && r.result == DiagResult::Unknown)
        .map(|r| format!("{}: {}", r.tier.as_str(), r.why))
        .collect();
    let why = if why.is_empty() {
        open.iter()
            .take(4)
            .map(|g| format!("GPU {}: {}", g.index, g.unknown_why()))
            .collect()
    } else {
        why
    };
    if !why.is_empty() {
        s.push_str(&format!(" ({})", why.join("; ")));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn test(tier: Tier, status: TestStatus) -> TestResult {
        TestResult {
            tier,
            test: "memory".into(),
            status,
            message: String::new(),
            duration_ms: None,
            value: None,
            unit: String::new(),
        }
    }

    fn run(tier: Tier, ran: bool, result: DiagResult) -> TierRun {
        TierRun {
            tier,
            ran,
            result,
            why: if ran {
                String::new()
            } else {
                "not installed".into()
            },
            cause: None,
            notes: Vec::new(),
            duration_ms: 0,
            raw: String::new(),
        }
    }

    fn gpu(index: u32, tests: Vec<TestResult>) -> GpuDiagnosis {
        GpuDiagnosis {
            index,
            uuid: format!("GPU-{index}"),
            result: DiagResult::Unknown,
            tests,
        }
    }

    fn asked(n: u32) -> Vec<(u32, String)> {
        (0..n).map(|i| (i, format!("GPU-{i}"))).collect()
    }

    #[test]
    fn a_pass_needs_every_gpu_passed_by_a_tier_that_ran() {
        let d = Diagnosis::combine(
            Level::Quick,
            &asked(2),
            vec![
                (
                    run(Tier::Cuda, true, DiagResult::Pass),
                    vec![
                        gpu(0, vec![test(Tier::Cuda, TestStatus::Pass)]),
                        gpu(1, vec![test(Tier::Cuda, TestStatus::Warn)]),
                    ],
                ),
                (run(Tier::Dcgm, false, DiagResult::Unknown), vec![]),
            ],
            5,
        );
        assert_eq!(d.result, DiagResult::Pass, "{}", d.summary);
        // One GPU nothing tested: could not tell.
        let d = Diagnosis::combine(
            Level::Quick,
            &asked(2),
            vec![(
                run(Tier::Cuda, true, DiagResult::Pass),
                vec![gpu(0, vec![test(Tier::Cuda, TestStatus::Pass)])],
            )],
            5,
        );
        assert_eq!(d.result, DiagResult::Unknown);
        assert!(d.summary.contains("GPU 1"), "{}", d.summary);
    }

    #[test]
    fn nothing_ran_is_never_a_pass() {
        let d = Diagnosis::combine(
            Level::Quick,
            &asked(1),
            vec![
                (run(Tier::Cuda, false, DiagResult::Unknown), vec![]),
                (run(Tier::Dcgm, false, DiagResult::Unknown), vec![]),
            ],
            1,
        );
        assert_eq!(d.result, DiagResult::Unknown);
        assert!(d.summary.contains("no test could run"), "{}", d.summary);
        let d = Diagnosis::combine(Level::Quick, &[], vec![], 1);
        assert_eq!(d.result, DiagResult::Unknown);
    }

    #[test]
    fn a_failure_anywhere_fails_and_is_named() {
        let mut bad = test(Tier::Dcgm, TestStatus::Fail);
        bad.message = "miscompare at 0x1000".into();
        let d = Diagnosis::combine(
            Level::Standard,
            &asked(2),
            vec![
                (
                    run(Tier::Dcgm, true, DiagResult::Fail),
                    vec![
                        gpu(1, vec![bad]),
                        gpu(0, vec![test(Tier::Dcgm, TestStatus::Pass)]),
                    ],
                ),
                (
                    run(Tier::Cuda, true, DiagResult::Unknown),
                    vec![gpu(0, vec![test(Tier::Cuda, TestStatus::Unknown)])],
                ),
            ],
            1,
        );
        assert_eq!(d.result, DiagResult::Fail);
        assert!(
            d.summary
                .contains("GPU 1 (GPU-1) failed dcgm memory: miscompare"),
            "{}",
            d.summary
        );
        assert_eq!(d.result.exit_code(), 1);
    }

    #[test]
    fn a_tier_that_could_not_tell_is_not_outvoted() {
        let d = Diagnosis::combine(
            Level::Quick,
            &asked(1),
            vec![
                (
                    run(Tier::Dcgm, true, DiagResult::Pass),
                    vec![gpu(0, vec![test(Tier::Dcgm, TestStatus::Pass)])],
                ),
                (
                    TierRun {
                        why: "timed out after 30s".into(),
                        ..run(Tier::Cuda, true, DiagResult::Unknown)
                    },
                    vec![],
                ),
            ],
            1,
        );
        assert_eq!(d.result, DiagResult::Unknown);
        assert!(d.summary.contains("timed out"), "{}", d.summary);
    }

    #[test]
    fn configuration_findings_need_a_pass_and_are_never_a_failure() {
        let mut config = test(Tier::Dcgm, TestStatus::Config);
        config.test = "software".into();
        config.message = "Persistence mode for GPU 0 is disabled".into();
        let d = Diagnosis::combine(
            Level::Quick,
            &asked(1),
            vec![(
                run(Tier::Dcgm, true, DiagResult::Config),
                vec![gpu(
                    0,
                    vec![config.clone(), test(Tier::Dcgm, TestStatus::Pass)],
                )],
            )],
            1,
        );
        assert_eq!(d.result, DiagResult::Config, "{}", d.summary);
        assert_eq!(d.result.exit_code(), 3);
        assert!(d.result.passed());
        assert!(d.summary.contains("needs configuration"), "{}", d.summary);
        assert!(d.summary.contains("Persistence mode"), "{}", d.summary);
        // A configuration finding alone passes nothing: could not tell, saying what it found.
        let d = Diagnosis::combine(
            Level::Quick,
            &asked(1),
            vec![(
                run(Tier::Dcgm, true, DiagResult::Pass),
                vec![gpu(0, vec![config])],
            )],
            1,
        );
        assert_eq!(d.result, DiagResult::Unknown);
        assert_eq!(d.cause, Some(Cause::MissingGpu));
        assert!(
            d.summary
                .contains("no test passed it (dcgm software config)"),
            "{}",
            d.summary
        );
    }

    #[test]
    fn could_not_tell_names_its_cause() {
        let mut engine_down = run(Tier::Dcgm, false, DiagResult::Unknown);
        engine_down.cause = Some(Cause::HostEngine);
        engine_down.why = "nv-hostengine is not running".into();
        let d = Diagnosis::combine(
            Level::Quick,
            &asked(1),
            vec![
                (engine_down, vec![]),
                (run(Tier::Cuda, false, DiagResult::Unknown), vec![]),
            ],
            1,
        );
        assert_eq!(d.cause, Some(Cause::HostEngine));
        assert!(
            d.summary.contains("nv-hostengine is not running"),
            "{}",
            d.summary
        );
        let d = Diagnosis::combine(Level::Quick, &[], vec![], 1);
        assert_eq!(d.cause, Some(Cause::NoTool));
        // Each cause has its own word, for the metric's label.
        let words: std::collections::BTreeSet<&str> =
            Cause::ALL.iter().map(|c| c.as_str()).collect();
        assert_eq!(words.len(), Cause::ALL.len());
    }

    #[test]
    fn bounded() {
        let mut t = test(Tier::Cuda, TestStatus::Fail);
        t.message = "x".repeat(MAX_TEXT * 4);
        t.value = Some(f64::NAN);
        let mut r = run(Tier::Cuda, true, DiagResult::Fail);
        r.raw = "y".repeat(MAX_RAW * 3);
        let d = Diagnosis::combine(Level::Long, &asked(1), vec![(r, vec![gpu(0, vec![t])])], 1);
        assert!(d.gpus[0].tests[0].message.len() <= MAX_TEXT);
        assert!(d.gpus[0].tests[0].value.is_none());
        assert!(d.tiers[0].raw.len() <= MAX_RAW);
        assert!(d.without_raw().tiers[0].raw.is_empty());
    }
}
