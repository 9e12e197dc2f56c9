//! What an active test of the GPUs found (`gpu-medic diagnose`, docs/diagnose.md): per GPU,
//! per test, per tier (DCGM's diagnostics, the built-in CUDA check). Plain data: it travels
//! in a `diagnose` order's outcome into the engine and the journal, and out as `--json`.
//!
//! The one rule that matters: a pass is only ever what a tool was seen to pass. A tier that
//! could not run says why and never counts as a pass; a timeout, a lost GPU or output that
//! cannot be read is "could not tell" ([`DiagResult::Unknown`]), never a pass.

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
}

impl TestStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            TestStatus::Pass => "pass",
            TestStatus::Warn => "warn",
            TestStatus::Fail => "fail",
            TestStatus::Skip => "skip",
            TestStatus::Unknown => "unknown",
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
}

impl DiagResult {
    pub fn as_str(self) -> &'static str {
        match self {
            DiagResult::Pass => "pass",
            DiagResult::Fail => "fail",
            DiagResult::Unknown => "unknown",
        }
    }

    /// `gpu-medic diagnose`'s exit code.
    pub fn exit_code(self) -> i32 {
        match self {
            DiagResult::Pass => 0,
            DiagResult::Fail => 1,
            DiagResult::Unknown => 2,
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
    #[serde(default)]
    pub duration_ms: u64,
}

/// The raw output kept per tier in a diagnosis.
pub const MAX_RAW: usize = 64 * 1024;

impl GpuDiagnosis {
    /// The GPU's answer from its tests: a failed test fails it; otherwise a test that could
    /// not tell makes it unknown; otherwise it passes when at least one test passed.
    pub fn judge(&mut self) {
        let has = |s: TestStatus| self.tests.iter().any(|t| t.status == s);
        self.result = if has(TestStatus::Fail) {
            DiagResult::Fail
        } else if has(TestStatus::Unknown) {
            DiagResult::Unknown
        } else if has(TestStatus::Pass) || has(TestStatus::Warn) {
            DiagResult::Pass
        } else {
            DiagResult::Unknown
        };
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
        let result = if gpus.iter().any(|g| g.result == DiagResult::Fail)
            || ran.iter().any(|r| r.result == DiagResult::Fail)
        {
            DiagResult::Fail
        } else if gpus.is_empty()
            || ran.is_empty()
            || ran.iter().any(|r| r.result == DiagResult::Unknown)
            || gpus.iter().any(|g| g.result != DiagResult::Pass)
        {
            DiagResult::Unknown
        } else {
            DiagResult::Pass
        };
        let summary = summarize(result, &gpus, &runs);
        let mut d = Diagnosis {
            level,
            result,
            gpus,
            tiers: runs,
            summary,
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
    let tiers = |ran: bool| {
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
    };
    match result {
        DiagResult::Pass => format!(
            "passed on {} GPU(s) by {}",
            gpus.len(),
            runs.iter()
                .filter(|r| r.ran)
                .map(|r| r.tier.as_str())
                .collect::<Vec<_>>()
                .join(" and ")
        ),
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
                format!("failed: {}", tiers(true))
            } else {
                failed.join("; ")
            }
        }
        DiagResult::Unknown => {
            if gpus.is_empty() {
                "could not tell: no GPU to test".to_string()
            } else if runs.iter().all(|r| !r.ran) {
                format!("could not tell: no test could run: {}", tiers(false))
            } else {
                let open: Vec<String> = gpus
                    .iter()
                    .filter(|g| g.result != DiagResult::Pass)
                    .map(|g| g.index.to_string())
                    .collect();
                let mut s = String::from("could not tell");
                if !open.is_empty() {
                    s.push_str(&format!(" on GPU {}", open.join(", ")));
                }
                let why: Vec<String> = runs
                    .iter()
                    .filter(|r| r.ran && r.result == DiagResult::Unknown)
                    .map(|r| format!("{}: {}", r.tier.as_str(), r.why))
                    .collect();
                if !why.is_empty() {
                    s.push_str(&format!(" ({})", why.join("; ")));
                }
                s
            }
        }
    }
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
