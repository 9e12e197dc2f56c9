//! The policy file: which signal leads to which verdict, with debounce, escalation,
//! deadlines and the MPS restart budget. Loading follows `extends` chains through a reader the
//! caller hands in (the daemon's reads files with a size cap: `config::load_policy`); the
//! resulting `Policy` is plain data that the pure engine consults.
//!
//! Errors name the file, line and key, because an operator edits this file by hand.

pub mod attribution;
pub mod limits;
pub mod planned;
pub mod reboot;
pub mod sxid_catalog;
pub mod xid_catalog;

pub use reboot::RebootPolicy;
pub mod diagnose;
pub use diagnose::DiagnosePolicy;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

use crate::error::{FileError, line_of};
use crate::model::{RecoveryAction, Signal, SignalKind, Verdict, XidDecode};

/// The suffixes the engine adds to a rule's name for the verdicts its windows reach:
/// `escalate`, and `suspect` and `culprit` (`policy::attribution`).
pub const RULE_SUFFIXES: [&str; 3] = ["/escalated", "/suspect", "/culprit"];

/// The rule's own name in a name the engine recorded (`xid-13-graphics-exception/suspect`).
pub fn base_rule(name: &str) -> &str {
    RULE_SUFFIXES
        .iter()
        .find_map(|s| name.strip_suffix(s))
        .unwrap_or(name)
}

/// A rule: how one signal (or a set of XIDs) is judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub name: String,
    pub signal: SignalKind,
    /// For `xid` rules: the codes; `None` is the catch-all for XIDs no other rule names.
    pub xids: Option<Vec<u32>>,
    /// For `xid` rules naming codes: the decode classes (`docs/xid-catalog.md`) the rule
    /// judges; `None` matches any. An XID with no decode counts as `undecoded` here.
    pub decode: Option<Vec<XidDecode>>,
    /// For `recovery-action` rules: the driver verdicts; `None` matches any.
    pub recovery: Option<Vec<RecoveryAction>>,
    /// Counter signals: the observation's value must reach this.
    pub threshold: Option<u64>,
    pub action: Verdict,
    pub confirm: Option<Window>,
    pub escalate: Option<Escalation>,
    /// For application-class XID rules: different programs faulting at one place
    /// (`policy::attribution`, docs/attribution.md).
    pub suspect: Option<attribution::Suspect>,
    /// For application-class XID rules: what one program's repeats do to its task.
    pub culprit: Option<attribution::CulpritRule>,
    pub reason: String,
    pub source: String,
    /// The operator's opt-in to judging a fatal signal (`xid_catalog::fatal_signals`) with
    /// `ignore` or `log`; without it such a rule is refused.
    pub silences_fatal: bool,
    /// For `reboot` rules: at most this many reboots for this rule within `[reboot] window`
    /// (e.g. 1: the first time only); `None`: only the node's `[reboot] limit` applies.
    pub reboots: Option<u32>,
    /// For drain, reboot and replace rules: when this rule's remediation collects evidence
    /// (docs/evidence.md), in place of `[evidence] mode`; `None` follows the config. Needs
    /// `[evidence] enabled` on the node either way.
    pub evidence: Option<crate::model::EvidenceMode>,
    /// Where the rule was written, for messages.
    pub origin: String,
}

impl Rule {
    /// How long a sighting counts for this rule: its longest window (`confirm`, `escalate`).
    pub fn window(&self) -> Duration {
        self.confirm
            .map(|c| c.window)
            .into_iter()
            .chain(self.escalate.map(|e| e.window))
            .max()
            .unwrap_or_default()
    }

    /// How long an application rule keeps its faults: its longest window (`suspect`,
    /// `culprit`).
    pub fn app_window(&self) -> Duration {
        self.suspect
            .map(|s| s.window)
            .into_iter()
            .chain(self.culprit.map(|c| c.window))
            .max()
            .unwrap_or_default()
    }
}

/// `count` sightings within `window`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub count: u32,
    pub window: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Escalation {
    pub count: u32,
    pub window: Duration,
    pub action: Verdict,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    pub restart_mps: Duration,
    pub stop_tasks: Duration,
    pub quarantine: Duration,
    pub drain: Duration,
    pub replace: Duration,
    pub lifecycle: Duration,
    /// The reboot call, then the instance going down: past it a node still up is replaced.
    pub reboot: Duration,
    /// After the boot: GPUs and the MPS daemon up, the launch gate's checks passed.
    pub boot_check: Duration,
    /// The diagnosis of a drained node (`gpu-medic diagnose`, both tiers); past it the
    /// diagnosis could not tell.
    pub diagnose: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    pub max_attempts: u32,
    pub delay: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpsPolicy {
    pub restart_budget: u32,
    pub restart_window: Duration,
    pub on_failed: Verdict,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The file it came from (or a label for built-in policies).
    pub origin: String,
    pub observe_only: bool,
    pub deadlines: Deadlines,
    pub retry: Retry,
    pub mps: MpsPolicy,
    /// The reboot rung's ladder (`[reboot]`).
    pub reboot: RebootPolicy,
    /// Where the GPUs are tested before a node is trusted again (`[diagnose]`).
    pub diagnose: DiagnosePolicy,
    pub rules: Vec<Rule>,
    /// Disruptions AWS plans (`[planned]` of the config; defaults until the supervisor sets
    /// them).
    pub planned: planned::PlannedRules,
}

impl Default for Deadlines {
    fn default() -> Self {
        Deadlines {
            restart_mps: Duration::from_secs(120),
            stop_tasks: Duration::from_secs(300),
            quarantine: Duration::from_secs(120),
            drain: Duration::from_secs(1800),
            replace: Duration::from_secs(900),
            lifecycle: Duration::from_secs(120),
            reboot: Duration::from_secs(600),
            boot_check: Duration::from_secs(900),
            diagnose: Duration::from_secs(1800),
        }
    }
}

impl Default for Retry {
    fn default() -> Self {
        Retry {
            max_attempts: 5,
            delay: Duration::from_secs(30),
        }
    }
}

impl Default for MpsPolicy {
    fn default() -> Self {
        MpsPolicy {
            restart_budget: 3,
            restart_window: Duration::from_secs(1800),
            on_failed: Verdict::Replace,
        }
    }
}

impl Policy {
    /// The rule that judges `signal` with magnitude `value`, if any.
    ///
    /// XIDs: a rule naming the code wins over the catch-all. Recovery actions: a rule naming
    /// the verdict wins over one without a list. Other signals: among the rules whose
    /// threshold the value reaches, the one with the highest threshold.
    pub fn rule_for(&self, signal: &Signal, value: u64) -> Option<&Rule> {
        let kind = signal.kind();
        let candidates = self.rules.iter().filter(|r| r.signal == kind);
        match signal {
            Signal::Xid { code, decode } => {
                let decode = decode.unwrap_or(XidDecode::Undecoded);
                let mut any_decode = None;
                let mut fallback = None;
                for r in candidates {
                    match (&r.xids, &r.decode) {
                        (Some(list), Some(d)) if list.contains(code) && d.contains(&decode) => {
                            return Some(r);
                        }
                        (Some(list), None) if list.contains(code) => any_decode = Some(r),
                        (None, _) => fallback = fallback.or(Some(r)),
                        _ => {}
                    }
                }
                any_decode.or(fallback.filter(|r| r.threshold.unwrap_or(0) <= value))
            }
            Signal::RecoveryAction { action } => {
                let mut fallback = None;
                for r in candidates {
                    match &r.recovery {
                        Some(list) if list.contains(action) => return Some(r),
                        None => fallback = Some(r),
                        _ => {}
                    }
                }
                fallback
            }
            _ => candidates
                .filter(|r| r.threshold.unwrap_or(0) <= value)
                .max_by_key(|r| r.threshold.unwrap_or(0)),
        }
    }

    /// Whether the rule for `signal` at `value` takes the node out of service (drain or
    /// replace): such observations are stepped first in a batch, before lower classes.
    pub fn is_fatal(&self, signal: &Signal, value: u64) -> bool {
        self.rule_for(signal, value)
            .is_some_and(|r| r.action.is_node_remediation())
    }

    /// Whether `o` is a finding about a GPU or the node's GPUs (a rule takes it at its
    /// value, even with `ignore`): what makes the ECS GPU view look again.
    pub fn is_gpu_finding(&self, o: &crate::model::Observation) -> bool {
        let about_gpus = o.gpu.is_some()
            || matches!(
                o.signal.kind(),
                SignalKind::Xid
                    | SignalKind::GpuLost
                    | SignalKind::DeviceCountMismatch
                    | SignalKind::DriverNotLoaded
                    | SignalKind::RecoveryAction
            );
        about_gpus && self.rule_for(&o.signal, o.value).is_some()
    }

    /// Catalog XIDs (any decode) that only the catch-all judges, or no rule at all.
    pub fn catalog_xids_left_to_catch_all(&self) -> Vec<u32> {
        xid_catalog::xids()
            .iter()
            .map(|x| x.code)
            .filter(|code| {
                let decodes: Vec<Option<XidDecode>> =
                    if xid_catalog::NVLINK5.contains(code) || *code == xid_catalog::CHECK_UVM_XID {
                        XidDecode::ALL.into_iter().map(Some).collect()
                    } else {
                        vec![None]
                    };
                decodes.into_iter().any(|decode| {
                    self.rule_for(
                        &Signal::Xid {
                            code: *code,
                            decode,
                        },
                        u64::MAX,
                    )
                    .is_none_or(|r| r.xids.is_none())
                })
            })
            .collect()
    }

    /// Fatal signals (`xid_catalog::fatal_signals`) this policy judges with less than taking
    /// the node out of service (`ignore`, `log`, or `stop-tasks` and `restart-mps`, which leave
    /// a GPU that needs a reset or a reboot in service), or judges not at all (`None`): what
    /// `policy check` warns about.
    pub fn silenced_fatal_signals(&self) -> Vec<(Signal, Option<&Rule>)> {
        xid_catalog::fatal_signals()
            .into_iter()
            .filter_map(|sig| match self.rule_for(&sig, u64::MAX) {
                Some(r) if !r.action.is_node_remediation() => Some((sig, Some(r))),
                Some(_) => None,
                None => Some((sig, None)),
            })
            .collect()
    }

    pub fn rule_named(&self, name: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| r.name == name)
    }

    /// Signal kinds that no rule judges (the engine then only logs them).
    pub fn uncovered_signals(&self) -> Vec<SignalKind> {
        SignalKind::JUDGED
            .iter()
            .copied()
            .filter(|k| !self.rules.iter().any(|r| r.signal == *k))
            .collect()
    }

    /// Loads a policy file, following `extends`, each file read by `read`.
    pub fn load_with(
        path: &Path,
        read: &dyn Fn(&Path) -> Result<String, Unread>,
    ) -> Result<Policy, FileError> {
        let text = read(path).map_err(|e| FileError::new(path, None, e.message))?;
        let raw = load_raw(path, &text, 0, read)?;
        build(path, raw)
    }

    /// Parses a policy from text that has no `extends` (used by tests and built-ins).
    pub fn parse(label: &Path, text: &str) -> Result<Policy, FileError> {
        let raw = parse_raw(label, text)?;
        if let Some(ext) = &raw.extends {
            return Err(FileError::new(
                label,
                Some(ext.line),
                "`extends` needs a file on disk; load the policy with Policy::load",
            ));
        }
        build(label, raw)
    }
}

// ---- raw schema (what the file says) ----

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilePolicy {
    version: Option<Spanned<u32>>,
    extends: Option<Spanned<String>>,
    engine: Option<FileEngine>,
    deadlines: Option<FileDeadlines>,
    retry: Option<FileRetry>,
    mps: Option<FileMps>,
    reboot: Option<reboot::FileReboot>,
    diagnose: Option<diagnose::FileDiagnose>,
    #[serde(default)]
    rule: Vec<Spanned<FileRule>>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileEngine {
    observe_only: Option<bool>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileDeadlines {
    #[serde(default, deserialize_with = "de_deadline")]
    restart_mps: Option<Duration>,
    #[serde(default, deserialize_with = "de_deadline")]
    stop_tasks: Option<Duration>,
    #[serde(default, deserialize_with = "de_deadline")]
    quarantine: Option<Duration>,
    #[serde(default, deserialize_with = "de_deadline")]
    drain: Option<Duration>,
    #[serde(default, deserialize_with = "de_deadline")]
    replace: Option<Duration>,
    #[serde(default, deserialize_with = "de_deadline")]
    lifecycle: Option<Duration>,
    #[serde(default, deserialize_with = "de_deadline")]
    reboot: Option<Duration>,
    #[serde(default, deserialize_with = "de_deadline")]
    boot_check: Option<Duration>,
    #[serde(default, deserialize_with = "de_deadline")]
    diagnose: Option<Duration>,
}

/// The shortest deadline a phase may have: below it every order "overruns" before its remedy
/// could answer, and the engine escalates on nothing.
const MIN_DEADLINE: Duration = Duration::from_secs(1);

fn de_deadline<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let v: Option<Duration> = humantime_serde::deserialize(d)?;
    match v {
        Some(v) if v < MIN_DEADLINE => Err(serde::de::Error::custom(format!(
            "a deadline of {} is too short: at least {}",
            humantime::format_duration(v),
            humantime::format_duration(MIN_DEADLINE)
        ))),
        Some(v) if v > limits::MAX_DEADLINE => Err(serde::de::Error::custom(format!(
            "a deadline of {} is too long: at most {} (a phase stuck that long is never escalated)",
            humantime::format_duration(v),
            humantime::format_duration(limits::MAX_DEADLINE)
        ))),
        v => Ok(v),
    }
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileRetry {
    #[serde(default, deserialize_with = "limits::de_retry_attempts")]
    max_attempts: Option<u32>,
    #[serde(default, deserialize_with = "limits::de_retry_delay")]
    delay: Option<Duration>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct FileMps {
    #[serde(default, deserialize_with = "limits::de_mps_budget")]
    restart_budget: Option<u32>,
    #[serde(default, deserialize_with = "limits::de_mps_window")]
    restart_window: Option<Duration>,
    on_failed: Option<Spanned<Verdict>>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRule {
    name: Spanned<String>,
    signal: Spanned<SignalKind>,
    xids: Option<Spanned<Vec<u32>>>,
    decode: Option<Spanned<Vec<XidDecode>>>,
    recovery: Option<Spanned<Vec<RecoveryAction>>>,
    threshold: Option<Spanned<u64>>,
    action: Spanned<Verdict>,
    confirm: Option<Spanned<FileWindow>>,
    escalate: Option<Spanned<FileEscalation>>,
    suspect: Option<Spanned<attribution::FileSuspect>>,
    culprit: Option<Spanned<attribution::FileCulprit>>,
    reason: String,
    #[serde(default)]
    source: String,
    #[serde(default)]
    silences_fatal: bool,
    reboots: Option<u32>,
    evidence: Option<crate::model::EvidenceMode>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileWindow {
    count: u32,
    #[serde(with = "humantime_serde")]
    window: Duration,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEscalation {
    count: u32,
    #[serde(with = "humantime_serde")]
    window: Duration,
    action: Verdict,
}

/// A parsed file with positions turned into lines, and its rules tagged with their origin.
struct RawPolicy {
    file: FilePolicy,
    extends: Option<LineValue<String>>,
    rules: Vec<RawRule>,
    /// Where `[mps] on_failed` was set (the file that won the merge, and its line).
    on_failed_at: Option<(PathBuf, usize)>,
    /// Where the `[reboot]` and `[diagnose]` tables are (the file that won the merge, and the
    /// table's line): their checks across keys name it.
    tables_at: BTreeMap<&'static str, (PathBuf, usize)>,
}

/// The tables whose checks across keys name the table's line.
const CHECKED_TABLES: [&str; 2] = ["reboot", "diagnose"];

/// The line of each `[table]` of [`CHECKED_TABLES`] in `text`, in one pass.
fn tables_at(path: &Path, text: &str) -> BTreeMap<&'static str, (PathBuf, usize)> {
    let mut out = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let head = line.trim_start();
        for t in CHECKED_TABLES {
            if head
                .strip_prefix('[')
                .and_then(|h| h.strip_prefix(t))
                .is_some_and(|r| r.trim_start().starts_with(']'))
            {
                out.insert(t, (path.to_path_buf(), i + 1));
            }
        }
    }
    out
}

struct LineValue<T> {
    value: T,
    line: usize,
}

#[derive(Clone)]
struct RawRule {
    rule: FileRule,
    path: PathBuf,
    text_line: usize,
    /// Lines of individual keys, for precise messages.
    lines: RuleLines,
}

#[derive(Clone, Copy)]
struct RuleLines {
    name: usize,
    signal: usize,
    xids: usize,
    decode: usize,
    recovery: usize,
    threshold: usize,
    action: usize,
    confirm: usize,
    escalate: usize,
    suspect: usize,
    culprit: usize,
}

const MAX_EXTENDS_DEPTH: usize = 8;

/// Why a policy file could not be read: `missing` when nothing is at the path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unread {
    pub missing: bool,
    pub message: String,
}

fn load_raw(
    path: &Path,
    text: &str,
    depth: usize,
    read: &dyn Fn(&Path) -> Result<String, Unread>,
) -> Result<RawPolicy, FileError> {
    let mut raw = parse_raw(path, text)?;
    if let Some(ext) = raw.extends.take() {
        if depth >= MAX_EXTENDS_DEPTH {
            return Err(FileError::new(
                path,
                Some(ext.line),
                format!("`extends` chain deeper than {MAX_EXTENDS_DEPTH} (a cycle?)"),
            ));
        }
        let base_path = path
            .parent()
            .unwrap_or_else(|| Path::new("."))
            .join(&ext.value);
        let base_text = read(&base_path).map_err(|u| {
            if u.missing {
                FileError::new(
                    path,
                    Some(ext.line),
                    format!("`extends`: {} does not exist", base_path.display()),
                )
            } else {
                FileError::new(&base_path, None, u.message)
            }
        })?;
        let base = load_raw(&base_path, &base_text, depth + 1, read)?;
        raw = merge(base, raw);
    }
    Ok(raw)
}

/// Reads a policy file whole, for tests (the daemon caps the size: `config::load_policy`).
#[cfg(test)]
pub(crate) fn read_file(path: &Path) -> Result<String, Unread> {
    std::fs::read_to_string(path).map_err(|e| Unread {
        missing: e.kind() == std::io::ErrorKind::NotFound,
        message: e.to_string(),
    })
}

fn parse_raw(path: &Path, text: &str) -> Result<RawPolicy, FileError> {
    let file: FilePolicy =
        toml::from_str(text).map_err(|e| FileError::from_toml(path, text, &e))?;
    if let Some(v) = &file.version
        && *v.get_ref() != 1
    {
        return Err(FileError::at_offset(
            path,
            text,
            v.span().start,
            format!(
                "version: this gpu-medic reads policy version 1, not {}",
                v.get_ref()
            ),
        ));
    }
    let extends = file.extends.as_ref().map(|e| LineValue {
        value: e.get_ref().clone(),
        line: line_of(text, e.span().start),
    });
    // Line numbers from one index of the text's line ends: every key's line in O(log n),
    // whatever the size of the file (counting newlines from the start for each key made a
    // large policy quadratic).
    let ends: Vec<usize> = text
        .bytes()
        .enumerate()
        .filter_map(|(i, b)| (b == b'\n').then_some(i))
        .collect();
    let at = |s: std::ops::Range<usize>| ends.partition_point(|&nl| nl < s.start) + 1;
    let on_failed_at = file
        .mps
        .as_ref()
        .and_then(|m| m.on_failed.as_ref())
        .map(|v| (path.to_path_buf(), at(v.span())));
    let rules = file
        .rule
        .iter()
        .map(|spanned| {
            let r = spanned.get_ref();
            RawRule {
                rule: r.clone(),
                path: path.to_path_buf(),
                text_line: at(spanned.span()),
                lines: RuleLines {
                    name: at(r.name.span()),
                    signal: at(r.signal.span()),
                    xids: r.xids.as_ref().map_or(0, |x| at(x.span())),
                    decode: r.decode.as_ref().map_or(0, |x| at(x.span())),
                    recovery: r.recovery.as_ref().map_or(0, |x| at(x.span())),
                    threshold: r.threshold.as_ref().map_or(0, |x| at(x.span())),
                    action: at(r.action.span()),
                    confirm: r.confirm.as_ref().map_or(0, |x| at(x.span())),
                    escalate: r.escalate.as_ref().map_or(0, |x| at(x.span())),
                    suspect: r.suspect.as_ref().map_or(0, |x| at(x.span())),
                    culprit: r.culprit.as_ref().map_or(0, |x| at(x.span())),
                },
            }
        })
        .collect();
    Ok(RawPolicy {
        file,
        extends,
        rules,
        on_failed_at,
        tables_at: tables_at(path, text),
    })
}

/// Overlay wins key by key; a rule with the same name replaces the base's in place.
fn merge(base: RawPolicy, overlay: RawPolicy) -> RawPolicy {
    let b = base.file;
    let o = overlay.file;
    let engine = FileEngine {
        observe_only: pick(
            o.engine.as_ref().and_then(|e| e.observe_only),
            b.engine.as_ref().and_then(|e| e.observe_only),
        ),
    };
    let (bd, od) = (
        b.deadlines.unwrap_or_default(),
        o.deadlines.unwrap_or_default(),
    );
    let deadlines = FileDeadlines {
        restart_mps: pick(od.restart_mps, bd.restart_mps),
        stop_tasks: pick(od.stop_tasks, bd.stop_tasks),
        quarantine: pick(od.quarantine, bd.quarantine),
        drain: pick(od.drain, bd.drain),
        replace: pick(od.replace, bd.replace),
        lifecycle: pick(od.lifecycle, bd.lifecycle),
        reboot: pick(od.reboot, bd.reboot),
        boot_check: pick(od.boot_check, bd.boot_check),
        diagnose: pick(od.diagnose, bd.diagnose),
    };
    let reboot = reboot::FileReboot::merge(b.reboot, o.reboot);
    let diagnose = diagnose::FileDiagnose::merge(b.diagnose, o.diagnose);
    let (br, or) = (b.retry.unwrap_or_default(), o.retry.unwrap_or_default());
    let retry = FileRetry {
        max_attempts: pick(or.max_attempts, br.max_attempts),
        delay: pick(or.delay, br.delay),
    };
    let (bm, om) = (b.mps.unwrap_or_default(), o.mps.unwrap_or_default());
    let om_on_failed_set = om.on_failed.is_some();
    let mps = FileMps {
        restart_budget: pick(om.restart_budget, bm.restart_budget),
        restart_window: pick(om.restart_window, bm.restart_window),
        on_failed: pick(om.on_failed, bm.on_failed),
    };
    let mut rules = base.rules;
    let mut by_name: std::collections::HashMap<String, usize> = rules
        .iter()
        .enumerate()
        .map(|(i, r)| (r.rule.name.get_ref().clone(), i))
        .collect();
    for r in overlay.rules {
        match by_name.get(r.rule.name.get_ref()) {
            Some(&i) => rules[i] = r,
            None => {
                by_name.insert(r.rule.name.get_ref().clone(), rules.len());
                rules.push(r);
            }
        }
    }
    let mut tables = base.tables_at;
    tables.extend(overlay.tables_at);
    RawPolicy {
        tables_at: tables,
        on_failed_at: if om_on_failed_set {
            overlay.on_failed_at
        } else {
            base.on_failed_at
        },
        file: FilePolicy {
            version: o.version.or(b.version),
            extends: None,
            engine: Some(engine),
            deadlines: Some(deadlines),
            retry: Some(retry),
            mps: Some(mps),
            reboot: Some(reboot),
            diagnose: Some(diagnose),
            rule: Vec::new(),
        },
        extends: None,
        rules,
    }
}

fn pick<T>(overlay: Option<T>, base: Option<T>) -> Option<T> {
    overlay.or(base)
}

fn build(path: &Path, raw: RawPolicy) -> Result<Policy, FileError> {
    let f = raw.file;
    let d = f.deadlines.unwrap_or_default();
    let dd = Deadlines::default();
    let deadlines = Deadlines {
        restart_mps: d.restart_mps.unwrap_or(dd.restart_mps),
        stop_tasks: d.stop_tasks.unwrap_or(dd.stop_tasks),
        quarantine: d.quarantine.unwrap_or(dd.quarantine),
        drain: d.drain.unwrap_or(dd.drain),
        replace: d.replace.unwrap_or(dd.replace),
        lifecycle: d.lifecycle.unwrap_or(dd.lifecycle),
        reboot: d.reboot.unwrap_or(dd.reboot),
        boot_check: d.boot_check.unwrap_or(dd.boot_check),
        diagnose: d.diagnose.unwrap_or(dd.diagnose),
    };
    let table_error = |table: &str, m: String| match raw.tables_at.get(table) {
        Some((p, l)) => FileError::new(p, Some(*l), m),
        None => FileError::new(path, None, m),
    };
    let reboot = f
        .reboot
        .unwrap_or_default()
        .build()
        .map_err(|m| table_error("reboot", m))?;
    let diagnose = f
        .diagnose
        .unwrap_or_default()
        .build()
        .map_err(|m| table_error("diagnose", m))?;
    let r = f.retry.unwrap_or_default();
    let retry = Retry {
        max_attempts: r
            .max_attempts
            .unwrap_or(Retry::default().max_attempts)
            .max(1),
        delay: r.delay.unwrap_or(Retry::default().delay),
    };
    let m = f.mps.unwrap_or_default();
    let on_failed = match m.on_failed {
        Some(v) if *v.get_ref() == Verdict::RestartMps || *v.get_ref() == Verdict::StopTasks => {
            let (file, line) = match &raw.on_failed_at {
                Some((p, l)) => (p.as_path(), Some(*l)),
                None => (path, None),
            };
            return Err(FileError::new(
                file,
                line,
                format!(
                    "[mps] on_failed: `{}` cannot follow a failed daemon; use log, drain or replace",
                    v.get_ref()
                ),
            ));
        }
        Some(v) => v.into_inner(),
        None => MpsPolicy::default().on_failed,
    };
    let mps = MpsPolicy {
        restart_budget: m
            .restart_budget
            .unwrap_or(MpsPolicy::default().restart_budget),
        restart_window: m
            .restart_window
            .unwrap_or(MpsPolicy::default().restart_window),
        on_failed,
    };
    let rules = validate_rules(&raw.rules)?;
    let policy = Policy {
        origin: path.display().to_string(),
        observe_only: f.engine.and_then(|e| e.observe_only).unwrap_or(false),
        deadlines,
        retry,
        mps,
        reboot,
        diagnose,
        rules,
        planned: planned::PlannedRules::default(),
    };
    // A rule that silences a fatal signal must say so (`silences_fatal = true`): a typo or a
    // careless overlay must not turn a fallen-off GPU into a log line.
    check_fatal(path, &raw.rules, &policy)?;
    Ok(policy)
}

/// Checks every rule, one check per field, and builds them. The first mistake is the error,
/// with the file and line of the key.
fn validate_rules(raw: &[RawRule]) -> Result<Vec<Rule>, FileError> {
    let mut names = BTreeSet::new();
    let mut xid_owner = XidOwners::default();
    let mut out: Vec<Rule> = Vec::with_capacity(raw.len());
    let mut claims = Claims::default();
    for rr in raw {
        let name = check_name(rr, &mut names)?;
        let signal = check_signal(rr)?;
        check_lists(rr, signal)?;
        claim_xids(rr, &mut xid_owner)?;
        let confirm = check_confirm(rr)?;
        let action = *rr.rule.action.get_ref();
        let escalate = check_escalate(rr, action)?;
        let (suspect, culprit) = check_attribution(rr, action, escalate.is_some())?;
        check_action_keys(
            rr,
            action,
            confirm.is_some() || escalate.is_some() || suspect.is_some() || culprit.is_some(),
        )?;
        check_overlap(rr, signal, &mut claims)?;
        let r = &rr.rule;
        out.push(Rule {
            name,
            signal,
            xids: r.xids.as_ref().map(|x| x.get_ref().clone()),
            decode: r.decode.as_ref().map(|x| x.get_ref().clone()),
            recovery: r.recovery.as_ref().map(|x| x.get_ref().clone()),
            threshold: r.threshold.as_ref().map(|t| *t.get_ref()),
            action,
            confirm,
            escalate,
            suspect,
            culprit,
            reason: r.reason.trim().to_string(),
            source: r.source.trim().to_string(),
            silences_fatal: r.silences_fatal,
            reboots: r.reboots,
            evidence: r.evidence,
            origin: format!("{}:{}", rr.path.display(), rr.text_line),
        });
    }
    Ok(out)
}

/// (XID, decode class or None for "any decode") -> the rule that judges it.
type XidOwners = std::collections::BTreeMap<(u32, Option<XidDecode>), String>;

/// An error about `rr` at `line`, naming the rule.
fn rule_err(rr: &RawRule, line: usize, msg: impl std::fmt::Display) -> FileError {
    let name = rr.rule.name.get_ref();
    FileError::new(&rr.path, Some(line), format!("rule `{name}`: {msg}"))
}

fn check_name(rr: &RawRule, names: &mut BTreeSet<String>) -> Result<String, FileError> {
    let name = rr.rule.name.get_ref().clone();
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
        return Err(rule_err(
            rr,
            rr.lines.name,
            "name must be non-empty kebab-case (letters, digits, -)",
        ));
    }
    if !names.insert(name.clone()) {
        return Err(rule_err(rr, rr.lines.name, "name: defined twice"));
    }
    Ok(name)
}

fn check_signal(rr: &RawRule) -> Result<SignalKind, FileError> {
    let signal = *rr.rule.signal.get_ref();
    if matches!(
        signal,
        SignalKind::MpsUp
            | SignalKind::Lifecycle
            | SignalKind::SelfFault
            | SignalKind::SelfRecovered
    ) {
        return Err(rule_err(
            rr,
            rr.lines.signal,
            format!(
                "signal: `{}` is handled by gpu-medic itself, not by rules",
                signal.as_str()
            ),
        ));
    }
    Ok(signal)
}

/// `xids`, `decode` and `recovery`: each only where it means something, never empty.
fn check_lists(rr: &RawRule, signal: SignalKind) -> Result<(), FileError> {
    let r = &rr.rule;
    if r.xids.is_some() && signal != SignalKind::Xid {
        return Err(rule_err(
            rr,
            rr.lines.xids,
            "xids: only for signal = \"xid\"",
        ));
    }
    if let Some(d) = &r.decode {
        if r.xids.is_none() {
            return Err(rule_err(
                rr,
                rr.lines.decode,
                "decode: only for rules that name their xids",
            ));
        }
        if d.get_ref().is_empty() {
            return Err(rule_err(
                rr,
                rr.lines.decode,
                "decode: empty list (omit the key to judge every decode)",
            ));
        }
    }
    if r.recovery.is_some() && signal != SignalKind::RecoveryAction {
        return Err(rule_err(
            rr,
            rr.lines.recovery,
            "recovery: only for signal = \"recovery-action\"",
        ));
    }
    if r.xids.as_ref().is_some_and(|x| x.get_ref().is_empty()) {
        return Err(rule_err(
            rr,
            rr.lines.xids,
            "xids: empty list (omit the key for the catch-all)",
        ));
    }
    Ok(())
}

/// Each (XID, decode class) is judged by one rule only.
fn claim_xids(rr: &RawRule, owners: &mut XidOwners) -> Result<(), FileError> {
    let r = &rr.rule;
    let Some(xids) = &r.xids else {
        return Ok(());
    };
    let decodes: Vec<Option<XidDecode>> = match &r.decode {
        Some(d) => d.get_ref().iter().copied().map(Some).collect(),
        None => vec![None],
    };
    for x in xids.get_ref() {
        for d in &decodes {
            if let Some(owner) = owners.insert((*x, *d), r.name.get_ref().clone()) {
                let what = match d {
                    Some(d) => format!("XID {x} decoded `{}`", d.as_str()),
                    None => format!("XID {x}"),
                };
                return Err(rule_err(
                    rr,
                    rr.lines.xids,
                    format!("xids: {what} is already judged by rule `{owner}`"),
                ));
            }
        }
    }
    Ok(())
}

fn check_confirm(rr: &RawRule) -> Result<Option<Window>, FileError> {
    let Some(c) = &rr.rule.confirm else {
        return Ok(None);
    };
    let c = c.get_ref();
    if c.count == 0 || c.window.is_zero() {
        return Err(rule_err(
            rr,
            rr.lines.confirm,
            "confirm: count and window must be > 0",
        ));
    }
    limits::check_window("confirm", c.window).map_err(|m| rule_err(rr, rr.lines.confirm, m))?;
    Ok(Some(Window {
        count: c.count,
        window: c.window,
    }))
}

fn check_escalate(rr: &RawRule, action: Verdict) -> Result<Option<Escalation>, FileError> {
    let Some(e) = &rr.rule.escalate else {
        return Ok(None);
    };
    let e = e.get_ref();
    if e.count < 2 || e.window.is_zero() {
        return Err(rule_err(
            rr,
            rr.lines.escalate,
            "escalate: count must be >= 2 and window > 0",
        ));
    }
    limits::check_window("escalate", e.window).map_err(|m| rule_err(rr, rr.lines.escalate, m))?;
    if e.action <= action {
        return Err(rule_err(
            rr,
            rr.lines.escalate,
            format!(
                "escalate: action `{}` is not more severe than `{}`",
                e.action, action
            ),
        ));
    }
    Ok(Some(Escalation {
        count: e.count,
        window: e.window,
        action: e.action,
    }))
}

/// `suspect` and `culprit` (`policy::attribution`): for application-class XIDs, and not
/// beside `escalate`, which counts every program's faults as one.
fn check_attribution(
    rr: &RawRule,
    action: Verdict,
    escalates: bool,
) -> Result<
    (
        Option<attribution::Suspect>,
        Option<attribution::CulpritRule>,
    ),
    FileError,
> {
    let r = &rr.rule;
    let xids = r.xids.as_ref().map(|x| x.get_ref().as_slice());
    let suspect = match &r.suspect {
        Some(_) if escalates => {
            return Err(rule_err(
                rr,
                rr.lines.suspect,
                "suspect: not beside `escalate` (which counts every program's faults on a GPU as one program's)",
            ));
        }
        Some(s) => Some(
            attribution::check_suspect(s.get_ref(), action, xids)
                .map_err(|m| rule_err(rr, rr.lines.suspect, m))?,
        ),
        None => None,
    };
    let culprit = match &r.culprit {
        Some(c) => Some(
            attribution::check_culprit(c.get_ref(), action, xids)
                .map_err(|m| rule_err(rr, rr.lines.culprit, m))?,
        ),
        None => None,
    };
    Ok((suspect, culprit))
}

/// Keys that only some actions take (`reboots`, `evidence`, windows on `ignore`).
fn check_action_keys(rr: &RawRule, action: Verdict, windows: bool) -> Result<(), FileError> {
    let r = &rr.rule;
    if let Some(n) = r.reboots
        && n > limits::MAX_REBOOTS
    {
        return Err(rule_err(
            rr,
            rr.lines.action,
            format!(
                "reboots: {n} is never reached: the engine remembers the last {} reboots of a node",
                limits::MAX_REBOOTS
            ),
        ));
    }
    if r.reboots.is_some() && action != Verdict::Reboot {
        return Err(rule_err(
            rr,
            rr.lines.action,
            "reboots: only for rules whose action is `reboot`",
        ));
    }
    if r.evidence.is_some() && action < Verdict::Drain {
        return Err(rule_err(
            rr,
            rr.lines.action,
            "evidence: only for rules whose action is `drain`, `reboot` or `replace` (the remediations that collect it)",
        ));
    }
    if action == Verdict::Ignore && windows {
        return Err(rule_err(
            rr,
            rr.lines.action,
            "action `ignore` drops the signal; confirm/escalate would never count it",
        ));
    }
    Ok(())
}

/// Two rules for the same non-XID signal must differ (threshold or recovery list). What the
/// rules before claimed, per signal, so each rule is checked in constant time (pairwise
/// checks made thousands of rules quadratic).
#[derive(Default)]
struct Claims {
    /// An XID rule without `xids`, by signal: its name.
    xid_catch_all: Option<String>,
    /// Recovery actions claimed (None: the rule without a list).
    recovery: std::collections::HashMap<Option<RecoveryAction>, String>,
    /// Thresholds claimed per signal.
    thresholds: std::collections::HashMap<(SignalKind, u64), String>,
}

fn check_overlap(rr: &RawRule, signal: SignalKind, claims: &mut Claims) -> Result<(), FileError> {
    let r = &rr.rule;
    let name = r.name.get_ref().clone();
    let clash: Option<String> = match signal {
        SignalKind::Xid => {
            if r.xids.is_none() {
                let prev = claims.xid_catch_all.clone();
                claims.xid_catch_all.get_or_insert(name);
                prev
            } else {
                None
            }
        }
        SignalKind::RecoveryAction => match &r.recovery {
            None => {
                let prev = claims.recovery.get(&None).cloned();
                claims.recovery.entry(None).or_insert(name);
                prev
            }
            Some(list) => {
                let prev = list
                    .get_ref()
                    .iter()
                    .find_map(|a| claims.recovery.get(&Some(*a)).cloned());
                for a in list.get_ref() {
                    claims
                        .recovery
                        .entry(Some(*a))
                        .or_insert_with(|| name.clone());
                }
                prev
            }
        },
        _ => {
            let threshold = r.threshold.as_ref().map_or(0, |t| *t.get_ref());
            let prev = claims.thresholds.get(&(signal, threshold)).cloned();
            claims.thresholds.entry((signal, threshold)).or_insert(name);
            prev
        }
    };
    if let Some(prev) = clash {
        return Err(rule_err(
            rr,
            rr.lines.signal,
            format!(
                "overlaps rule `{prev}` (same signal `{}`); give them different xids, recovery lists or thresholds",
                signal.as_str()
            ),
        ));
    }
    Ok(())
}

/// No rule may silence a fatal signal unless it says `silences_fatal = true`: by judging it
/// `ignore` or `log`, by a threshold that leaves it unjudged at its lowest reading, or by a
/// confirm, escalation or threshold that can never be reached (`limits`).
fn check_fatal(path: &Path, raw: &[RawRule], policy: &Policy) -> Result<(), FileError> {
    let raw_of = |name: &str| raw.iter().find(|x| x.rule.name.get_ref() == name);
    let at = |name: &str, line: fn(&RuleLines) -> usize, msg: String| match raw_of(name) {
        Some(rr) => rule_err(rr, line(&rr.lines), msg),
        None => FileError::new(path, None, format!("rule `{name}`: {msg}")),
    };
    const OPT_IN: &str = "add `silences_fatal = true` to the rule if that is intended";
    for (sig, rule) in policy.silenced_fatal_signals() {
        if let Some(r) = rule.filter(|r| !r.silences_fatal) {
            return Err(at(
                &r.name,
                |l| l.action,
                format!(
                    "action `{}` silences `{sig}`, a fatal signal (NVIDIA: reset, reboot or replace); {OPT_IN}",
                    r.action
                ),
            ));
        }
    }
    if let Some((sig, r)) = limits::fatal_below_threshold(policy).into_iter().next() {
        return Err(at(
            &r.name,
            |l| l.threshold,
            format!(
                "threshold: `{sig}` below {} is judged by no rule, and it is a fatal signal (it is reported at 0); {OPT_IN}",
                r.threshold.unwrap_or(0)
            ),
        ));
    }
    let judges = limits::FatalJudges::new(policy);
    for (idx, r) in policy.rules.iter().enumerate() {
        let (line, msg): (fn(&RuleLines) -> usize, String) = match limits::silencer(&judges, idx, r)
        {
            None => continue,
            Some(limits::Silencer::Confirm(m)) => (|l| l.confirm, m),
            Some(limits::Silencer::Escalate(m)) => (|l| l.escalate, m),
            Some(limits::Silencer::Threshold(m)) => (|l| l.threshold, m),
        };
        return Err(at(
            &r.name,
            line,
            format!(
                "{msg}, and it takes the node out of service or judges a fatal signal; {OPT_IN}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Policy, FileError> {
        Policy::parse(Path::new("p.toml"), text)
    }

    const BASIC: &str = r#"
version = 1
[[rule]]
name = "fatal"
signal = "xid"
xids = [79, 48]
action = "replace"
reason = "bus"

[[rule]]
name = "other-xid"
signal = "xid"
action = "log"
reason = "unknown"
silences_fatal = true

[[rule]]
name = "hot"
signal = "thermal"
threshold = 85
action = "log"
reason = "warm"

[[rule]]
name = "very-hot"
signal = "thermal"
threshold = 95
action = "drain"
reason = "too hot"
"#;

    #[test]
    fn xid_specific_beats_catch_all() {
        let p = parse(BASIC).unwrap();
        assert_eq!(p.rule_for(&Signal::xid(79), 0).unwrap().name, "fatal");
        assert_eq!(p.rule_for(&Signal::xid(13), 0).unwrap().name, "other-xid");
    }

    #[test]
    fn highest_reached_threshold_wins() {
        let p = parse(BASIC).unwrap();
        assert!(p.rule_for(&Signal::Thermal, 80).is_none());
        assert_eq!(p.rule_for(&Signal::Thermal, 90).unwrap().name, "hot");
        assert_eq!(p.rule_for(&Signal::Thermal, 99).unwrap().name, "very-hot");
    }

    #[test]
    fn defaults_apply_when_sections_missing() {
        let p = parse(BASIC).unwrap();
        assert_eq!(p.mps, MpsPolicy::default());
        assert_eq!(p.deadlines, Deadlines::default());
        assert!(!p.observe_only);
    }

    #[test]
    fn checks_across_a_tables_keys_name_its_line() {
        let e = parse("version = 1\n\n[diagnose]\nafter_drain = true\non_fail = \"log\"\n")
            .unwrap_err();
        assert_eq!(e.line, Some(3), "{e}");
        assert!(e.message.contains("[diagnose] on_fail"), "{e}");
        let e = parse("version = 1\n[reboot]\nlimit = 2\nwindow = \"0s\"\n").unwrap_err();
        assert!(e.line.is_some(), "{e}");
        // An overlay's table is named in the overlay.
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.toml");
        std::fs::write(&base, "version = 1\n").unwrap();
        let over = dir.path().join("over.toml");
        std::fs::write(
            &over,
            "version = 1\nextends = \"base.toml\"\n\n\n[diagnose]\non_fail = \"drain\"\n",
        )
        .unwrap();
        let e = Policy::load_with(&over, &read_file).unwrap_err();
        assert_eq!(e.line, Some(5), "{e}");
        assert!(e.to_string().contains("over.toml"), "{e}");
    }

    #[test]
    fn unknown_key_names_line() {
        let e = parse("version = 1\n[engine]\nobserv_only = true\n").unwrap_err();
        assert_eq!(e.line, Some(3), "{e}");
        assert!(e.message.contains("observ_only"), "{e}");
    }

    #[test]
    fn duplicate_xid_names_both_rules() {
        let text = format!(
            "{BASIC}\n[[rule]]\nname = \"again\"\nsignal = \"xid\"\nxids = [48]\naction = \"log\"\nreason = \"x\"\n"
        );
        let e = parse(&text).unwrap_err();
        assert!(
            e.message.contains("XID 48") && e.message.contains("`fatal`"),
            "{e}"
        );
        assert_eq!(e.line, Some(text.lines().count() - 2));
    }

    #[test]
    fn bad_duration_and_bad_action() {
        let e = parse("[deadlines]\ndrain = \"soon\"\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
        // `reboot` is an action now (the reboot rung); `explode` is not.
        let e = parse("[[rule]]\nname=\"a\"\nsignal=\"xid\"\naction=\"explode\"\nreason=\"r\"\n")
            .unwrap_err();
        assert_eq!(e.line, Some(4), "{e}");
        assert!(e.message.contains("explode"), "{e}");
        // `reboots` only on a reboot rule.
        let e = parse(
            "[[rule]]\nname=\"a\"\nsignal=\"xid\"\naction=\"replace\"\nreboots=1\nreason=\"r\"\n",
        )
        .unwrap_err();
        assert!(e.message.contains("reboots: only"), "{e}");
        // `evidence` only where a remediation collects it; a drain, reboot or replace takes it.
        let e = parse(
            "[[rule]]\nname=\"a\"\nsignal=\"xid\"\naction=\"log\"\nevidence=\"always\"\nreason=\"r\"\n",
        )
        .unwrap_err();
        assert!(e.message.contains("evidence: only"), "{e}");
        let p = parse(
            "[[rule]]\nname=\"a\"\nsignal=\"xid\"\naction=\"drain\"\nevidence=\"off\"\nreason=\"r\"\n",
        )
        .unwrap();
        assert_eq!(p.rules[0].evidence, Some(crate::model::EvidenceMode::Off));
    }

    #[test]
    fn suspect_and_culprit_are_for_application_xids_and_say_why_not() {
        let rule = |xids: &str, extra: &str| {
            format!(
                "[[rule]]\nname=\"a\"\nsignal=\"xid\"\nxids={xids}\naction=\"log\"\nreason=\"r\"\n{extra}\n"
            )
        };
        let suspect = "suspect={programs=3, window=\"1h\", at=\"location\", action=\"drain\"}";
        let p = parse(&rule("[13]", suspect)).unwrap();
        let s = p.rules[0].suspect.unwrap();
        assert_eq!(
            (s.programs, s.at, s.action),
            (3, attribution::Place::Location, Verdict::Drain)
        );
        for (xids, extra, says) in [
            ("[79]", suspect, "XID 79 is not charged to a program"),
            ("[94]", suspect, "XID 94 is not charged"),
            (
                "[13]",
                "suspect={programs=1, window=\"1h\", at=\"gpu\", action=\"drain\"}",
                "programs must be 2",
            ),
            (
                "[13]",
                "suspect={programs=3, window=\"1h\", at=\"gpu\", action=\"log\"}",
                "not more severe",
            ),
            (
                "[13]",
                "suspect={programs=3, window=\"1h\", at=\"rack\", action=\"drain\"}",
                "unknown variant",
            ),
            (
                "[13]",
                "culprit={count=3, window=\"1h\", action=\"drain\"}",
                "only `stop-tasks`",
            ),
            (
                "[13]",
                "culprit={count=0, window=\"1h\", action=\"stop-tasks\"}",
                "count must be >= 1",
            ),
            (
                "[13]",
                "culprit={count=1000, window=\"1h\", action=\"stop-tasks\"}",
                "never reached",
            ),
            (
                "[13]",
                &format!("{suspect}\nescalate={{count=5, window=\"1h\", action=\"drain\"}}"),
                "not beside `escalate`",
            ),
        ] {
            let e = parse(&rule(xids, extra)).unwrap_err();
            assert!(e.to_string().contains(says), "{xids} {extra}: {e}");
            assert_eq!(e.line, Some(7), "{e}");
        }
        let p = parse(&rule(
            "[13, 31]",
            "culprit={count=10, window=\"1h\", action=\"stop-tasks\"}",
        ))
        .unwrap();
        assert_eq!(p.rules[0].culprit.unwrap().count, 10);
        assert_eq!(
            base_rule("xid-13-graphics-exception/suspect"),
            "xid-13-graphics-exception"
        );
        assert_eq!(base_rule("a/culprit"), "a");
        assert_eq!(base_rule("a/escalated"), "a");
    }

    #[test]
    fn escalation_must_be_more_severe() {
        let e = parse("[[rule]]\nname=\"a\"\nsignal=\"xid\"\naction=\"drain\"\nreason=\"r\"\nescalate={count=3, window=\"1h\", action=\"log\"}\n")
            .unwrap_err();
        assert_eq!(e.line, Some(6), "{e}");
    }

    #[test]
    fn rules_judging_mps_up_are_rejected() {
        let e = parse("[[rule]]\nname=\"a\"\nsignal=\"mps-up\"\naction=\"log\"\nreason=\"r\"\n")
            .unwrap_err();
        assert_eq!(e.line, Some(3), "{e}");
    }

    #[test]
    fn version_two_is_rejected() {
        let e = parse("version = 2\n").unwrap_err();
        assert_eq!(e.line, Some(1), "{e}");
    }

    #[test]
    fn extends_overrides_and_appends() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("base.toml"), BASIC).unwrap();
        std::fs::write(
            dir.path().join("over.toml"),
            "extends = \"base.toml\"\n[engine]\nobserve_only = true\n[[rule]]\nname = \"other-xid\"\nsignal = \"xid\"\naction = \"ignore\"\nreason = \"quiet\"\nsilences_fatal = true\n",
        )
        .unwrap();
        let p = Policy::load_with(&dir.path().join("over.toml"), &read_file).unwrap();
        assert!(p.observe_only);
        assert_eq!(p.rules.len(), 4);
        let r = p.rule_for(&Signal::xid(13), 0).unwrap();
        assert_eq!(r.action, Verdict::Ignore);
        assert!(r.origin.contains("over.toml:4"), "{}", r.origin);
    }

    #[test]
    fn decode_classes_pick_the_rule_and_may_not_overlap() {
        let text = format!(
            "{BASIC}\n[[rule]]\nname = \"nv-reset\"\nsignal = \"xid\"\nxids = [149]\ndecode = [\"reset-gpu\"]\naction = \"replace\"\nreason = \"r\"\n\
             [[rule]]\nname = \"nv-rest\"\nsignal = \"xid\"\nxids = [149]\ndecode = [\"ignore\", \"undecoded\"]\naction = \"log\"\nreason = \"r\"\n"
        );
        let p = parse(&text).unwrap();
        let judge = |d: Option<XidDecode>| {
            p.rule_for(
                &Signal::Xid {
                    code: 149,
                    decode: d,
                },
                0,
            )
            .unwrap()
            .name
            .clone()
        };
        assert_eq!(judge(Some(XidDecode::ResetGpu)), "nv-reset");
        assert_eq!(judge(Some(XidDecode::Ignore)), "nv-rest");
        assert_eq!(judge(None), "nv-rest", "no decode counts as undecoded");
        assert_eq!(
            judge(Some(XidDecode::Xid154Eval)),
            "other-xid",
            "no rule: the catch-all"
        );
        let e = parse(&format!(
            "{text}[[rule]]\nname = \"again\"\nsignal = \"xid\"\nxids = [149]\ndecode = [\"ignore\"]\naction = \"log\"\nreason = \"r\"\n"
        ))
        .unwrap_err();
        assert!(
            e.message
                .contains("XID 149 decoded `ignore` is already judged by rule `nv-rest`"),
            "{e}"
        );
        let e = parse("[[rule]]\nname = \"a\"\nsignal = \"xid\"\ndecode = [\"ignore\"]\naction = \"log\"\nreason = \"r\"\n")
            .unwrap_err();
        assert!(
            e.message
                .contains("decode: only for rules that name their xids"),
            "{e}"
        );
        assert_eq!(e.line, Some(4));
    }

    #[test]
    fn silencing_a_fatal_signal_needs_the_opt_in() {
        let rule = "[[rule]]\nname = \"bus\"\nsignal = \"xid\"\nxids = [79]\naction = \"log\"\nreason = \"r\"\n";
        let e = parse(rule).unwrap_err();
        assert_eq!(e.line, Some(5), "{e}");
        assert!(e.message.contains("silences `xid 79`"), "{e}");
        let p = parse(&format!("{rule}silences_fatal = true\n")).unwrap();
        let silenced = p.silenced_fatal_signals();
        assert!(
            silenced
                .iter()
                .any(|(s, r)| *s == Signal::xid(79) && r.is_some())
        );
        assert!(
            silenced
                .iter()
                .any(|(s, r)| *s == Signal::GpuLost && r.is_none()),
            "a fatal signal no rule judges is reported too"
        );
        assert!(p.catalog_xids_left_to_catch_all().contains(&13));
        // Acting, but not taking the node out of service, silences it just the same: the GPU
        // that fell off the bus stays in service under tasks stopped or a daemon restarted.
        for action in ["stop-tasks", "restart-mps"] {
            let e = parse(&rule.replace("\"log\"", &format!("{action:?}"))).unwrap_err();
            assert_eq!(e.line, Some(5), "{e}");
            assert!(
                e.message
                    .contains(&format!("action `{action}` silences `xid 79`")),
                "{e}"
            );
        }
        assert!(parse(&rule.replace("\"log\"", "\"drain\"")).is_ok());
    }

    /// Numbers that keep a guarantee from ever holding are refused with their line: a
    /// deadline no phase is escalated by, a reboot limit the engine never counts to.
    #[test]
    fn deadlines_and_reboot_limits_that_cannot_hold_are_refused() {
        let e = parse("[deadlines]\ndrain = \"100years\"\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
        assert!(e.message.contains("too long"), "{e}");
        assert!(parse("[deadlines]\ndrain = \"7days\"\n").is_ok());
        let e = parse("[reboot]\nlimit = 4294967295\n").unwrap_err();
        assert_eq!(e.line, Some(2), "{e}");
        assert!(e.message.contains("never reached"), "{e}");
        assert!(parse("[reboot]\nlimit = 32\n").is_ok());
        let e = parse("[reboot]\nwindow = \"100years\"\n").unwrap_err();
        assert!(e.message.contains("out of range"), "{e}");
        let e = parse(
            "[[rule]]\nname = \"r\"\nsignal = \"xid\"\nxids = [79]\naction = \"reboot\"\nreboots = 1000\nreason = \"r\"\n",
        )
        .unwrap_err();
        assert!(e.message.contains("reboots: 1000 is never reached"), "{e}");
    }

    #[test]
    fn extends_cycle_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("a.toml"), "extends = \"b.toml\"\n").unwrap();
        std::fs::write(dir.path().join("b.toml"), "extends = \"a.toml\"\n").unwrap();
        let e = Policy::load_with(&dir.path().join("a.toml"), &read_file).unwrap_err();
        assert!(e.message.contains("deeper"), "{e}");
    }
}
