//! `[diagnose]` in the policy: where the engine tests the GPUs before it trusts a node again,
//! and what it does with the answer (docs/diagnose.md). The tools and their level are the
//! config's `[diagnose]`; a node with no tool that can run skips the step.
//!
//! NVIDIA's workflow for suspected hardware is an active test (the XID catalog's
//! WORKFLOW_XID_13/_31/_48: run DCGM's diagnostics, then field diagnostics), and so is its
//! peers' gate before a repaired node takes work (NVSentinel, NVIDIA's health-validation
//! readiness gate). Defaults:
//!
//! - `after_reboot = true`: the check after a reboot's boot includes the diagnosis; a failure
//!   replaces the node.
//! - `after_drain = true`: a `drain` verdict becomes drain, diagnose, then back in service or
//!   the next rung, instead of a node kept for an operator for ever (`false` keeps that).
//! - `on_fail = "reboot"`: the next rung after a failed diagnosis of a drained node (the
//!   ladder's limits apply; without the reboot rung it is `replace`). `"replace"` skips it.
//! - `on_unknown = "keep"`: a diagnosis that could not tell (a timeout, no GPU answered)
//!   leaves the node drained for an operator; `"return"` trusts the passive checks and puts it
//!   back; `"replace"` replaces it.

use serde::Deserialize;

use crate::model::Verdict;

/// What a diagnosis that could not tell leads to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnUnknown {
    Keep,
    Return,
    Replace,
}

impl OnUnknown {
    pub fn as_str(self) -> &'static str {
        match self {
            OnUnknown::Keep => "keep",
            OnUnknown::Return => "return",
            OnUnknown::Replace => "replace",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiagnosePolicy {
    pub after_reboot: bool,
    pub after_drain: bool,
    /// `Reboot` or `Replace`.
    pub on_fail: Verdict,
    pub on_unknown: OnUnknown,
}

impl Default for DiagnosePolicy {
    fn default() -> Self {
        DiagnosePolicy {
            after_reboot: true,
            after_drain: true,
            on_fail: Verdict::Reboot,
            on_unknown: OnUnknown::Keep,
        }
    }
}

/// `[diagnose]` as the file says it.
#[derive(Debug, Deserialize, Default, Clone, Copy)]
#[serde(deny_unknown_fields)]
pub(super) struct FileDiagnose {
    pub after_reboot: Option<bool>,
    pub after_drain: Option<bool>,
    pub on_fail: Option<Verdict>,
    pub on_unknown: Option<OnUnknown>,
}

impl FileDiagnose {
    /// Overlay wins key by key.
    pub fn merge(base: Option<FileDiagnose>, overlay: Option<FileDiagnose>) -> FileDiagnose {
        let (b, o) = (base.unwrap_or_default(), overlay.unwrap_or_default());
        FileDiagnose {
            after_reboot: o.after_reboot.or(b.after_reboot),
            after_drain: o.after_drain.or(b.after_drain),
            on_fail: o.on_fail.or(b.on_fail),
            on_unknown: o.on_unknown.or(b.on_unknown),
        }
    }

    pub fn build(self) -> Result<DiagnosePolicy, String> {
        let d = DiagnosePolicy::default();
        let on_fail = self.on_fail.unwrap_or(d.on_fail);
        if !matches!(on_fail, Verdict::Reboot | Verdict::Replace) {
            return Err(format!(
                "[diagnose] on_fail: `{on_fail}` cannot follow a failed diagnosis of a drained node; use reboot or replace"
            ));
        }
        Ok(DiagnosePolicy {
            after_reboot: self.after_reboot.unwrap_or(d.after_reboot),
            after_drain: self.after_drain.unwrap_or(d.after_drain),
            on_fail,
            on_unknown: self.on_unknown.unwrap_or(d.on_unknown),
        })
    }
}
