//! What a policy may say, beyond its syntax: floors and ceilings on retry delays, windows and
//! counts, and the rule that no setting may silence a fatal signal through the side door (a
//! confirm count or an escalation no window can reach, a threshold no reading reaches) unless
//! the rule says `silences_fatal = true`. policies/README.md, "Limits", lists them.
//!
//! The numbers are the engine's: it keeps at most [`MAX_SIGHTINGS`] sightings per rule and
//! target, and a probe reports one signal at most about once a second
//! ([`MIN_SIGHTING_GAP`]), so `count` sightings need at least `count - 1` seconds.

use std::time::Duration;

use crate::model::{SignalKind, Verdict};

use super::{Policy, Rule};

/// The sightings the engine keeps per rule and target (the newest): a `confirm` or
/// `escalate` count above it is never reached.
pub const MAX_SIGHTINGS: usize = 64;
/// The shortest time between two sightings of one signal that a window may count on (the
/// fastest poll; events of one kind do not repeat faster in practice).
pub const MIN_SIGHTING_GAP: Duration = Duration::from_secs(1);
/// The longest `confirm` or `escalate` window: the engine keeps sightings as long as the
/// longest window, and a week is the longest any remediation ladder looks back
/// (`[reboot] window`).
pub const MAX_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
/// `[retry] delay`: at least 100 ms (a zero delay retries a throttled call in a busy loop),
/// at most an hour (a remedy retried less often than that never finishes within its
/// deadline).
pub const MIN_RETRY_DELAY: Duration = Duration::from_millis(100);
pub const MAX_RETRY_DELAY: Duration = Duration::from_secs(3600);
/// `[retry] max_attempts`: more than this and a failing action is retried for ever instead
/// of escalating.
pub const MAX_RETRY_ATTEMPTS: u32 = 100;
/// `[mps] restart_window`: at least a minute (a shorter window never holds two restarts, so
/// the budget is never spent and `on_failed` never applies), at most [`MAX_WINDOW`].
pub const MIN_MPS_WINDOW: Duration = Duration::from_secs(60);
/// `[mps] restart_budget`: more restarts than this within the window and `on_failed` never
/// applies in practice.
pub const MAX_MPS_BUDGET: u32 = 100;
/// `[deadlines]`: at most a week. A phase stuck longer is never escalated in practice.
pub const MAX_DEADLINE: Duration = MAX_WINDOW;
/// `[reboot] limit` and a rule's `reboots`: the engine remembers this many reboots of a node
/// ([`crate::model::MAX_REBOOT_HISTORY`]); a limit above it is never reached, and the node would
/// be rebooted for ever instead of replaced.
pub const MAX_REBOOTS: u32 = crate::model::MAX_REBOOT_HISTORY as u32;

/// `[diagnose] retry_within`: at most a day. It is what keeps a node whose diagnosis cannot
/// tell from holding its fleet-budget slot.
pub const MAX_DIAGNOSE_RETRY_WITHIN: Duration = Duration::from_secs(24 * 3600);

/// The hottest reading a GPU reports (°C; GPUs shut down near 100): a `thermal` threshold
/// above it is never reached.
pub const MAX_CELSIUS: u64 = 200;

fn bounded<'de, D: serde::Deserializer<'de>>(
    d: D,
    min: Duration,
    max: Duration,
    what: &str,
) -> Result<Option<Duration>, D::Error> {
    let v: Option<Duration> = humantime_serde::deserialize(d)?;
    match v {
        Some(v) if v < min || v > max => Err(serde::de::Error::custom(format!(
            "{what} of {} is out of range: from {} to {}",
            humantime::format_duration(v),
            humantime::format_duration(min),
            humantime::format_duration(max)
        ))),
        v => Ok(v),
    }
}

pub(super) fn de_retry_delay<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Duration>, D::Error> {
    bounded(d, MIN_RETRY_DELAY, MAX_RETRY_DELAY, "a retry delay")
}

pub(super) fn de_mps_window<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Duration>, D::Error> {
    bounded(d, MIN_MPS_WINDOW, MAX_WINDOW, "a restart window")
}

/// A count of at most `max`; above it, `refused` says why.
fn at_most<'de, D: serde::Deserializer<'de>>(
    d: D,
    max: u32,
    refused: impl Fn(u32) -> String,
) -> Result<Option<u32>, D::Error> {
    let v: Option<u32> = serde::Deserialize::deserialize(d)?;
    match v {
        Some(v) if v > max => Err(serde::de::Error::custom(refused(v))),
        v => Ok(v),
    }
}

/// The plain refusal of [`at_most`]: `what of v is out of range: at most max`.
fn out_of_range(what: &'static str, max: u32) -> impl Fn(u32) -> String {
    move |v| format!("{what} of {v} is out of range: at most {max}")
}

pub(super) fn de_retry_attempts<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<u32>, D::Error> {
    match at_most(
        d,
        MAX_RETRY_ATTEMPTS,
        out_of_range("max_attempts", MAX_RETRY_ATTEMPTS),
    )? {
        // 0 would be taken for 1 without a word: the operator asked for something else.
        Some(0) => Err(serde::de::Error::custom(
            "max_attempts of 0 is out of range: at least 1 (1: no retry after the first attempt)",
        )),
        v => Ok(v),
    }
}

pub(super) fn de_reboot_limit<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<u32>, D::Error> {
    at_most(d, MAX_REBOOTS, |v| {
        format!(
            "[reboot] limit of {v} is never reached: the engine remembers the last {MAX_REBOOTS} reboots of a node, which would be rebooted for ever instead of replaced"
        )
    })
}

/// `[reboot] window` and `recur_within`: at most [`MAX_WINDOW`] (0 allowed: no ladder, no
/// recurrence).
pub(super) fn de_reboot_window<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Duration>, D::Error> {
    bounded(d, Duration::ZERO, MAX_WINDOW, "a reboot window")
}

pub(super) fn de_mps_budget<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<u32>, D::Error> {
    at_most(
        d,
        MAX_MPS_BUDGET,
        out_of_range("restart_budget", MAX_MPS_BUDGET),
    )
}

/// A `confirm` or `escalate` window's own bounds, for every rule: `Err` says why.
pub(super) fn check_window(key: &str, window: Duration) -> Result<(), String> {
    if window > MAX_WINDOW {
        return Err(format!(
            "{key}: a window of {} is longer than the engine keeps sightings ({})",
            humantime::format_duration(window),
            humantime::format_duration(MAX_WINDOW)
        ));
    }
    Ok(())
}

/// Why `count` sightings within `window` can never be counted, if they cannot.
fn unreachable_count(count: u32, window: Duration) -> Option<String> {
    if count as usize > MAX_SIGHTINGS {
        return Some(format!(
            "{count} sightings are never counted: the engine keeps the last {MAX_SIGHTINGS} per rule and target"
        ));
    }
    let needs = MIN_SIGHTING_GAP.saturating_mul(count.saturating_sub(1));
    if window < needs {
        return Some(format!(
            "{count} sightings within {} cannot happen: a signal is seen at most about once a second, so they need {}",
            humantime::format_duration(window),
            humantime::format_duration(needs)
        ));
    }
    None
}

/// The largest reading a signal can carry: a threshold above it is never reached.
fn max_reading(signal: SignalKind) -> u64 {
    match signal {
        SignalKind::Thermal => MAX_CELSIUS,
        _ => crate::model::MAX_COUNTER,
    }
}

/// Which key of a rule silences a fatal signal, and how.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Silencer {
    Confirm(String),
    Escalate(String),
    Threshold(String),
}

/// Which rule judges each fatal signal (`xid_catalog::fatal_signals`) at a reading, indexed
/// once: what [`must_act`] asks of every rule then costs a lookup, not a scan of every rule
/// (thousands of rules were quadratic). Answers as `Policy::rule_for` does, by rule index.
pub(super) struct FatalJudges {
    per_signal: Vec<Judge>,
}

enum Judge {
    /// An XID: the rule naming it, whatever the reading; else the catch-all rule (no `xids`)
    /// and the threshold it needs.
    Xid {
        found: Option<usize>,
        fallback: Option<(usize, u64)>,
    },
    /// A recovery action: the rule naming it, else the last rule without a list.
    Recovery(Option<usize>),
    /// Other kinds: by threshold, the rule that judges from it (the last of equal ones).
    Levels(std::collections::BTreeMap<u64, usize>),
}

impl FatalJudges {
    pub(super) fn new(policy: &Policy) -> FatalJudges {
        use crate::model::{Signal, XidDecode};
        let per_signal = super::xid_catalog::fatal_signals()
            .iter()
            .map(|sig| {
                let kind = sig.kind();
                let candidates = policy
                    .rules
                    .iter()
                    .enumerate()
                    .filter(|(_, r)| r.signal == kind);
                match sig {
                    Signal::Xid { code, decode } => {
                        let decode = decode.unwrap_or(XidDecode::Undecoded);
                        let (mut exact, mut any_decode, mut fallback) = (None, None, None);
                        for (i, r) in candidates {
                            match (&r.xids, &r.decode) {
                                (Some(list), Some(d))
                                    if list.contains(code) && d.contains(&decode) =>
                                {
                                    exact = exact.or(Some(i));
                                }
                                (Some(list), None) if list.contains(code) => any_decode = Some(i),
                                (None, _) => {
                                    fallback = fallback.or(Some((i, r.threshold.unwrap_or(0))));
                                }
                                _ => {}
                            }
                        }
                        Judge::Xid {
                            found: exact.or(any_decode),
                            fallback,
                        }
                    }
                    Signal::RecoveryAction { action } => {
                        let (mut named, mut fallback) = (None, None);
                        for (i, r) in candidates {
                            match &r.recovery {
                                Some(list) if list.contains(action) => {
                                    named = named.or(Some(i));
                                }
                                None => fallback = Some(i),
                                _ => {}
                            }
                        }
                        Judge::Recovery(named.or(fallback))
                    }
                    _ => Judge::Levels(
                        candidates
                            .map(|(i, r)| (r.threshold.unwrap_or(0), i))
                            .collect(),
                    ),
                }
            })
            .collect();
        FatalJudges { per_signal }
    }

    /// Whether rule `idx` judges some fatal signal at reading `value`.
    fn judges(&self, idx: usize, value: u64) -> bool {
        self.per_signal.iter().any(|j| {
            let judge = match j {
                Judge::Xid { found, fallback } => {
                    found.or(fallback.filter(|(_, t)| *t <= value).map(|(i, _)| i))
                }
                Judge::Recovery(r) => *r,
                Judge::Levels(m) => m.range(..=value).next_back().map(|(_, i)| *i),
            };
            judge == Some(idx)
        })
    }
}

/// Whether rule `idx` takes the node out of service (itself or by escalation) or judges a
/// fatal signal (`xid_catalog::fatal_signals`): a rule that must be able to act.
fn must_act(judges: &FatalJudges, idx: usize, rule: &Rule) -> bool {
    rule.action.is_node_remediation()
        || rule
            .escalate
            .is_some_and(|e| e.action.is_node_remediation())
        || [0, u64::MAX]
            .into_iter()
            .chain(rule.threshold)
            .any(|v| judges.judges(idx, v))
}

/// The first setting of rule `idx` that keeps it from ever acting when it must act
/// ([`must_act`]) and does not say `silences_fatal = true`.
pub(super) fn silencer(judges: &FatalJudges, idx: usize, rule: &Rule) -> Option<Silencer> {
    if rule.silences_fatal || !must_act(judges, idx, rule) {
        return None;
    }
    if let Some(c) = rule.confirm
        && let Some(why) = unreachable_count(c.count, c.window)
    {
        return Some(Silencer::Confirm(format!(
            "confirm: {why}; the rule would never act"
        )));
    }
    if let Some(e) = rule.escalate
        && e.action.is_node_remediation()
        && let Some(why) = unreachable_count(e.count, e.window)
    {
        return Some(Silencer::Escalate(format!(
            "escalate: {why}; it would never escalate to `{}`",
            e.action
        )));
    }
    if let Some(t) = rule.threshold
        && t > max_reading(rule.signal)
    {
        return Some(Silencer::Threshold(format!(
            "threshold: {t} is above any reading `{}` carries ({}); the rule would never act",
            rule.signal.as_str(),
            max_reading(rule.signal)
        )));
    }
    None
}

/// Fatal signals no rule judges at their lowest reading (0: an XID, a lost GPU, no GPU left)
/// while a rule for their kind has a threshold: that rule's threshold is what silences them.
pub(super) fn fatal_below_threshold(policy: &Policy) -> Vec<(crate::model::Signal, &Rule)> {
    super::xid_catalog::fatal_signals()
        .into_iter()
        .filter(|sig| policy.rule_for(sig, 0).is_none())
        .filter_map(|sig| {
            let kind = sig.kind();
            let r = policy
                .rules
                .iter()
                .filter(|r| r.signal == kind && r.threshold.unwrap_or(0) > 0)
                .filter(|r| !r.silences_fatal && r.action > Verdict::Log)
                .min_by_key(|r| r.threshold)?;
            Some((sig, r))
        })
        .collect()
}
