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
//! - `on_unknown = "keep"`: a diagnosis of a drained node that still could not tell (a timeout,
//!   no GPU answered) leaves the node drained for an operator; `"return"` trusts the passive
//!   checks and puts it back; `"replace"` replaces it.
//! - `retry_within = "10m"`, `retry_delay = "1m"`: a diagnosis that could not tell (nv-hostengine
//!   not up yet after a boot, a busy GPU) is ordered again every `retry_delay` until
//!   `retry_within` has passed since the step's first diagnosis; then its answer stands.
//!   `"0s"` turns the retries off.
//! - `boot_on_unknown = "return"`: after a reboot's boot check the node must not hold its
//!   fleet-budget slot for ever because the diagnosis cannot run there: once the retries are
//!   spent it goes back into service on the passive checks (which it passed), or with
//!   `"replace"` it is replaced. Never `keep`.
//!
//! A diagnosis that passed with configuration findings (DCGM's Deployment tests: persistence
//! mode off, ...; "needs configuration") returns the node like a pass, the findings in the
//! incident: they are reported, never a reason by themselves to drain or replace.

use std::time::Duration;

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
    /// After a drain, once the retries are spent.
    pub on_unknown: OnUnknown,
    /// After a reboot's boot check, once the retries are spent: `Return` or `Replace`.
    pub boot_on_unknown: OnUnknown,
    /// How long after a step's first diagnosis one that could not tell is ordered again.
    pub retry_within: Duration,
    /// The pause before it is.
    pub retry_delay: Duration,
}

impl Default for DiagnosePolicy {
    fn default() -> Self {
        DiagnosePolicy {
            after_reboot: true,
            after_drain: true,
            on_fail: Verdict::Reboot,
            on_unknown: OnUnknown::Keep,
            boot_on_unknown: OnUnknown::Return,
            retry_within: Duration::from_secs(600),
            retry_delay: Duration::from_secs(60),
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
    pub boot_on_unknown: Option<OnUnknown>,
    #[serde(default, with = "humantime_serde")]
    pub retry_within: Option<Duration>,
    #[serde(default, deserialize_with = "super::limits::de_retry_delay")]
    pub retry_delay: Option<Duration>,
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
            boot_on_unknown: o.boot_on_unknown.or(b.boot_on_unknown),
            retry_within: o.retry_within.or(b.retry_within),
            retry_delay: o.retry_delay.or(b.retry_delay),
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
        let boot_on_unknown = self.boot_on_unknown.unwrap_or(d.boot_on_unknown);
        if boot_on_unknown == OnUnknown::Keep {
            return Err(
                "[diagnose] boot_on_unknown: `keep` would hold the fleet budget's slot for ever after a reboot; use return or replace"
                    .to_string(),
            );
        }
        let retry_within = self.retry_within.unwrap_or(d.retry_within);
        if retry_within > super::limits::MAX_DIAGNOSE_RETRY_WITHIN {
            return Err(format!(
                "[diagnose] retry_within: {} is too long: at most {}",
                humantime::format_duration(retry_within),
                humantime::format_duration(super::limits::MAX_DIAGNOSE_RETRY_WITHIN)
            ));
        }
        Ok(DiagnosePolicy {
            after_reboot: self.after_reboot.unwrap_or(d.after_reboot),
            after_drain: self.after_drain.unwrap_or(d.after_drain),
            on_fail,
            on_unknown: self.on_unknown.unwrap_or(d.on_unknown),
            boot_on_unknown,
            retry_within,
            retry_delay: self.retry_delay.unwrap_or(d.retry_delay),
        })
    }
}
