//! One reboot the reboot rung ordered on this instance, as the engine's repair history
//! (`engine::repair::Ledger`) keeps it and as it travels outside `state.json`: the state
//! directory's reboot ledger file and, with `[aws]` on, the instance's tag
//! ([`crate::model::Input::Reboots`] hands them to the engine at start), so that a lost
//! `state.json` and a rotated journal never forget a reboot the ladder counts
//! (docs/repair.md, "Where the reboots are kept").

use serde::{Deserialize, Serialize};

use super::{IncidentId, Timestamp};

/// One reboot ordered for one incident.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Repair {
    pub incident: IncidentId,
    /// The rule that asked for it (without `/escalated`).
    pub rule: String,
    /// When the reboot was ordered.
    pub at: Timestamp,
    pub boot_before: String,
    /// The boot id after the reboot; none while it has not happened (or never did).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_after: Option<String>,
    /// When the node went back into service after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub back_at: Option<Timestamp>,
    pub result: RepairResult,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub why: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RepairResult {
    /// Ordered; the reboot or the check after it is under way.
    Pending,
    /// Back in service after the boot check.
    Repaired,
    /// Rebooted, but the check after the boot failed (or the fault came back): replaced.
    Escalated,
    /// The reboot did not happen (refused, or the node stayed up): replaced.
    NotRebooted,
    /// An operator stopped the repair.
    Aborted,
    /// Known only from the instance's tag (the state directory was lost): ordered, taken as
    /// done (the tag is written just before the call), its outcome not known.
    Unknown,
}

impl RepairResult {
    pub fn as_str(self) -> &'static str {
        match self {
            RepairResult::Pending => "pending",
            RepairResult::Repaired => "repaired",
            RepairResult::Escalated => "escalated",
            RepairResult::NotRebooted => "not-rebooted",
            RepairResult::Aborted => "aborted",
            RepairResult::Unknown => "unknown",
        }
    }
}

impl Repair {
    /// Whether the ladder counts it as a reboot this instance had: its new boot was seen, or
    /// it is known only from the instance's tag (taken as done: the tag is written just
    /// before the call).
    pub fn rebooted(&self) -> bool {
        self.boot_after.is_some() || self.result == RepairResult::Unknown
    }
}

/// The EC2 instance tag that keeps this instance's reboots when `[aws]` is on: it outlives
/// the disk (not the instance). Written by the reboot remedy just before it reboots.
pub const REBOOTS_TAG: &str = "gpu-medic:reboots";
/// EC2's longest tag value, in characters.
pub const TAG_VALUE_MAX: usize = 256;

/// The tag's value for `history` (oldest first): each reboot that happened or is about to
/// (its boot seen, pending, or itself known only from the tag) as `<ordered, unix ms>/<incident>/<rule>`,
/// newest first, separated by spaces, as many as fit in [`TAG_VALUE_MAX`]. What it leaves
/// out: boot ids, the return to service (so `recur_within` needs the state directory's
/// ledger), reboots that never happened.
pub fn tag_value(history: &[Repair]) -> String {
    let mut out = String::new();
    for r in history.iter().rev() {
        if !(r.rebooted() || r.result == RepairResult::Pending) {
            continue;
        }
        let rule: String = r
            .rule
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || "-_.:".contains(*c))
            .collect();
        let item = format!("{}/{}/{rule}", r.at.0, r.incident.0);
        let need = item.len() + usize::from(!out.is_empty());
        if out.len() + need > TAG_VALUE_MAX {
            break;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&item);
    }
    out
}

/// The reboots a tag's value keeps, oldest first, each [`RepairResult::Unknown`] (counted by
/// the ladder, never pending); a malformed item is left out. At most `MAX_REBOOT_HISTORY`.
pub fn from_tag(value: &str) -> Vec<Repair> {
    let mut out: Vec<Repair> = value
        .split_whitespace()
        .take(super::MAX_REBOOT_HISTORY)
        .filter_map(|item| {
            let mut parts = item.splitn(3, '/');
            let at = parts.next()?.parse().ok()?;
            let incident = parts.next()?.parse().ok()?;
            let rule = parts.next().unwrap_or_default();
            Some(Repair {
                incident: IncidentId(incident),
                rule: rule.chars().take(super::MAX_NAME).collect(),
                at: Timestamp(at),
                boot_before: String::new(),
                boot_after: None,
                back_at: None,
                result: RepairResult::Unknown,
                why: format!(
                    "known from the instance tag {REBOOTS_TAG} (the state directory was lost)"
                ),
            })
        })
        .collect();
    out.sort_by_key(|r| r.at);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repair(
        at: u64,
        incident: u64,
        rule: &str,
        boot_after: Option<&str>,
        result: RepairResult,
    ) -> Repair {
        Repair {
            incident: IncidentId(incident),
            rule: rule.into(),
            at: Timestamp(at),
            boot_before: "b".into(),
            boot_after: boot_after.map(Into::into),
            back_at: None,
            result,
            why: String::new(),
        }
    }

    /// The tag keeps the reboots the ladder counts, newest first within 256 characters, and
    /// reads back as reboots counted and never pending.
    #[test]
    fn the_tag_keeps_what_the_ladder_counts_within_its_length() {
        let h = vec![
            repair(
                1_000,
                1,
                "xid-fallen-off-bus",
                Some("b2"),
                RepairResult::Repaired,
            ),
            repair(2_000, 2, "gpu-lost", None, RepairResult::NotRebooted),
            repair(3_000, 3, "row-remap-pending", None, RepairResult::Pending),
        ];
        let v = tag_value(&h);
        assert_eq!(v, "3000/3/row-remap-pending 1000/1/xid-fallen-off-bus");
        let back = from_tag(&v);
        assert_eq!(back.len(), 2);
        assert!(
            back.iter()
                .all(|r| r.rebooted() && r.result == RepairResult::Unknown)
        );
        assert_eq!(
            (back[0].at, back[0].rule.as_str()),
            (Timestamp(1_000), "xid-fallen-off-bus")
        );
        let many: Vec<Repair> = (0..40)
            .map(|i| {
                repair(
                    i * 1_000,
                    i,
                    &"x".repeat(60),
                    Some("b"),
                    RepairResult::Repaired,
                )
            })
            .collect();
        let v = tag_value(&many);
        assert!(v.len() <= TAG_VALUE_MAX, "{}", v.len());
        assert_eq!(
            from_tag(&v).last().unwrap().incident,
            IncidentId(39),
            "the newest kept"
        );
        assert!(from_tag("garbage 12/x/y /3/r 5/6/ok").len() == 1);
        assert!(from_tag(&"1/2/r ".repeat(10_000)).len() <= crate::model::MAX_REBOOT_HISTORY);
    }
}
