//! The keys of an XID rule that judge application faults by who and where
//! (docs/attribution.md), from NVIDIA's WORKFLOW_XID_13 and WORKFLOW_XID_31: one program
//! faulting again and again is the program's bug, on one GPU or on many; different programs
//! faulting at the same place are the GPU's.
//!
//! - `suspect = { programs = 3, window = "1h", at = "location", action = "drain" }`: that many
//!   different programs faulting at one place of one GPU within the window take the `action`
//!   (drain, then the diagnosis of `[diagnose]`). `at = "location"`: the same GPC and TPC of
//!   an XID 13 (NVIDIA: "repeats at the same GPC/TPC"); `at = "gpu"`: the same GPU (XID 31:
//!   "repeated MMU faults on the same GPU").
//! - `culprit = { count = 10, window = "1h", action = "stop-tasks" }`: one program's
//!   `count`-th fault within the window stops its ECS task on this node (an overlay's choice;
//!   the shipped policy only names the task).

use std::time::Duration;

use serde::Deserialize;

use crate::model::Verdict;

/// Where different programs' faults count as one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Place {
    /// The decoded location on one GPU (GPC and TPC, or an MMU fault's engine and GPC).
    Location,
    /// The GPU.
    Gpu,
}

impl Place {
    pub fn as_str(self) -> &'static str {
        match self {
            Place::Location => "location",
            Place::Gpu => "gpu",
        }
    }
}

/// `suspect`: a hardware suspicion from different programs faulting at one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suspect {
    pub programs: u32,
    pub window: Duration,
    pub at: Place,
    pub action: Verdict,
}

/// `culprit`: what one program's repeats do to its task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CulpritRule {
    pub count: u32,
    pub window: Duration,
    pub action: Verdict,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileSuspect {
    programs: u32,
    #[serde(with = "humantime_serde")]
    window: Duration,
    at: Place,
    action: Verdict,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileCulprit {
    count: u32,
    #[serde(with = "humantime_serde")]
    window: Duration,
    action: Verdict,
}

/// The most programs a suspicion may wait for: the engine remembers this many (program,
/// place) pairs per rule and GPU.
pub const MAX_PROGRAMS: u32 = 64;

/// Checks `suspect` of a rule whose own action is `action`, judging `xids`.
pub(super) fn check_suspect(
    s: &FileSuspect,
    action: Verdict,
    xids: Option<&[u32]>,
) -> Result<Suspect, String> {
    check_xids(xids, "suspect")?;
    if !(2..=MAX_PROGRAMS).contains(&s.programs) {
        return Err(format!(
            "suspect: programs must be 2 to {MAX_PROGRAMS} (one program is the program's fault)"
        ));
    }
    super::limits::check_window("suspect", s.window)?;
    if s.action <= action {
        return Err(format!(
            "suspect: action `{}` is not more severe than `{action}`",
            s.action
        ));
    }
    Ok(Suspect {
        programs: s.programs,
        window: s.window,
        at: s.at,
        action: s.action,
    })
}

/// Checks `culprit` of a rule whose own action is `action`, judging `xids`.
pub(super) fn check_culprit(
    c: &FileCulprit,
    action: Verdict,
    xids: Option<&[u32]>,
) -> Result<CulpritRule, String> {
    check_xids(xids, "culprit")?;
    if c.count == 0 {
        return Err("culprit: count must be >= 1".into());
    }
    if c.count > super::limits::MAX_SIGHTINGS as u32 {
        return Err(format!(
            "culprit: count {} is never reached: the engine counts at most {} faults of one program",
            c.count,
            super::limits::MAX_SIGHTINGS
        ));
    }
    super::limits::check_window("culprit", c.window)?;
    if c.action != Verdict::StopTasks {
        return Err(format!(
            "culprit: action `{}`: only `stop-tasks` acts on one program's task (a drain or \
             reboot for one tenant's bug takes every tenant's GPU away)",
            c.action
        ));
    }
    if c.action <= action {
        return Err(format!(
            "culprit: action `{}` is not more severe than `{action}`",
            c.action
        ));
    }
    Ok(CulpritRule {
        count: c.count,
        window: c.window,
        action: c.action,
    })
}

/// Only XIDs the probe charges to a program can be judged by who faulted.
fn check_xids(xids: Option<&[u32]>, key: &str) -> Result<(), String> {
    let Some(xids) = xids else {
        return Err(format!("{key}: only for rules that name their `xids`"));
    };
    match xids.iter().find(|c| !super::xid_catalog::attributable(**c)) {
        Some(c) => Err(format!(
            "{key}: XID {c} is not charged to a program (only application-class XIDs are: \
             NVIDIA's RESTART_APP bucket but 94, and 43, 45; docs/attribution.md)"
        )),
        None => Ok(()),
    }
}
