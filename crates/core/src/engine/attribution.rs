//! Application faults judged by who faulted and where (docs/attribution.md): the rules with
//! `suspect` or `culprit` (`policy::attribution`), NVIDIA's WORKFLOW_XID_13 and _31 on a GPU
//! that many programs share.
//!
//! Per rule and GPU the engine keeps, for each program and place, when it last faulted there
//! (at most [`MAX_APP_PLACES`] pairs: a storm of one program's XIDs is one pair, and when the
//! list is full the program holding the most pairs gives up its stalest, so no flood of one
//! program's pairs evicts another program's). A program is an ECS task (its family, once
//! the agent names it) or, for a process in no task, its host executable: never a pid and
//! never a name the process chose. Different programs faulting at one place are the GPU's:
//! the fewest programs that could have caused the faults at that place reaching
//! `suspect.programs` takes its action. A fault the driver charged to the MPS server while
//! several clients ran is nobody's: recorded, never counted. One program faulting again and
//! again, at one place or many, on one GPU or many, is that program's: the node stays in
//! service, and the incident names its task definition.
//!
//! Only XID 45 joins an earlier XID's incident, and only when the driver itself printed the
//! cause (` caused by previous Xid N`, `model::driver_line`) and its rule takes no action
//! ([`JOIN_WINDOW`]): a fatal XID always stands alone, whatever its text.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Cx;
use super::Sightings;
use crate::model::attribution::{UNATTRIBUTED, Via};
use crate::model::bounded::{BoundedMap, BoundedVec};
use crate::model::{IncidentId, Observation, Signal, Timestamp, Verdict};
use crate::policy::Rule;
use crate::policy::attribution::Place;

/// The (program, place) pairs remembered per rule and GPU.
pub const MAX_APP_PLACES: usize = 128;
/// The rules and GPUs tracked at once (the stalest goes first).
pub const MAX_APP_KEYS: usize = 256;
/// The XIDs remembered for a later XID to join ([`JOIN_WINDOW`]).
pub const MAX_XID_INCIDENTS: usize = 256;
/// How long after an XID a later one that names it as its cause joins its incident.
pub const JOIN_WINDOW: Duration = Duration::from_secs(600);

/// One program's faults at one place of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppSeen {
    /// Who: `task <arn>`, `program <name>`, or `unattributed`.
    pub unit: String,
    /// The programs that may have caused it: the unit's program (its task definition's
    /// family), or, for a fault the driver charged to the MPS server, every client's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub programs: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub place: Option<String>,
    pub last: Timestamp,
    /// The newest faults (at most `policy::limits::MAX_SIGHTINGS`).
    #[serde(default, skip_serializing_if = "Sightings::is_empty")]
    pub times: Sightings,
}

/// What the engine keeps for application faults.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppFaults {
    /// Per `rule@gpu`: the (program, place) pairs within the rule's windows.
    #[serde(default, skip_serializing_if = "BoundedMap::is_empty")]
    pub seen: BoundedMap<String, BoundedVec<AppSeen, MAX_APP_PLACES>, MAX_APP_KEYS>,
    /// Per `gpu<index>/xid<code>`: the incident its last occurrence opened or joined.
    #[serde(default, skip_serializing_if = "BoundedMap::is_empty")]
    pub xid_incidents: BoundedMap<String, (IncidentId, Timestamp), MAX_XID_INCIDENTS>,
}

impl AppFaults {
    /// Incident `id` holds the XID `obs` names (by GPU, code and process), for a later XID
    /// naming it as its cause (the stalest makes room).
    pub fn remember_xid(&mut self, obs: &Observation, id: IncidentId, now: Timestamp) {
        let Some(key) = xid_key(obs) else { return };
        self.xid_incidents.insert_evicting(key, (id, now), |v| v.1);
    }

    /// How many faults `unit` made at `key` (within `window` of `now`, or ever).
    fn unit_faults(&self, key: &str, unit: &str, window: Option<Duration>, now: Timestamp) -> u32 {
        let Some(list) = self.seen.get(key) else {
            return 0;
        };
        let n = list
            .iter()
            .filter(|s| s.unit == unit)
            .map(|s| {
                s.times
                    .iter()
                    .filter(|t| window.is_none_or(|w| now.since(**t) <= w))
                    .count()
            })
            .sum::<usize>();
        u32::try_from(n).unwrap_or(u32::MAX)
    }

    /// Forgets `unit`'s faults at `key`.
    fn forget_unit(&mut self, key: &str, unit: &str) {
        if let Some(list) = self.seen.get_mut(key) {
            list.retain(|s| s.unit != unit);
        }
    }

    /// Whether the candidate lists hold no more than the engine keeps (the other
    /// collections are bounded by their types).
    pub fn check_sizes(&self) -> Result<(), String> {
        if self
            .seen
            .values()
            .any(|v| v.iter().any(|s| s.programs.len() > MAX_CANDIDATES))
        {
            return Err("app_faults holds more than the engine keeps".into());
        }
        Ok(())
    }
}

/// The unit of a fault the driver charged to the MPS server while several clients ran: one
/// of them, not known which.
const MPS_CLIENTS: &str = "one of the MPS clients ";

/// Whether a unit names one program (a task or a process), not an unknown or a set.
fn names_one(unit: &str) -> bool {
    unit != UNATTRIBUTED && !unit.starts_with(MPS_CLIENTS)
}

/// The candidate programs of one fault kept at most.
const MAX_CANDIDATES: usize = 16;

fn xid_key(obs: &Observation) -> Option<String> {
    let Signal::Xid { code, .. } = obs.signal else {
        return None;
    };
    Some(format!("gpu{}/xid{code}", obs.gpu.as_ref()?.index))
}

/// The fewest programs that could have caused every fault of `sets` (each fault's possible
/// programs): a greedy hitting set, exact when every fault names one program.
fn fewest_programs(sets: &[Vec<String>]) -> Vec<String> {
    let mut left: Vec<&Vec<String>> = sets.iter().filter(|s| !s.is_empty()).collect();
    let mut chosen = Vec::new();
    while !left.is_empty() {
        let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
        for s in &left {
            for p in s.iter() {
                *counts.entry(p.as_str()).or_default() += 1;
            }
        }
        let Some((best, _)) = counts
            .into_iter()
            .max_by_key(|(p, n)| (*n, std::cmp::Reverse(*p)))
        else {
            break;
        };
        let best = best.to_string();
        left.retain(|s| !s.contains(&best));
        chosen.push(best);
    }
    chosen
}

impl Cx<'_> {
    /// XID 45 naming its cause in the driver's own field joins that XID's incident (true).
    /// No other code joins, and none whose rule acts: a fatal XID stands alone.
    pub(super) fn join_cause(&mut self, obs: &Observation) -> bool {
        let Signal::Xid { code, .. } = obs.signal else {
            return false;
        };
        if code != crate::model::driver_line::PREEMPTIVE_REMOVAL
            || self
                .policy
                .rule_for(&obs.signal, obs.value)
                .is_some_and(|r| r.action.acts())
        {
            return false;
        }
        let Some(after) = obs.xid.as_ref().and_then(|x| x.after) else {
            return false;
        };
        let Some(gpu) = &obs.gpu else { return false };
        let key = format!("gpu{}/xid{after}", gpu.index);
        let Some((id, at)) = self.st.app.xid_incidents.get(&key).copied() else {
            return false;
        };
        if self.now.since(at) > JOIN_WINDOW {
            return false;
        }
        self.attach(id, obs);
        true
    }

    /// Judges an application-class XID by a rule with `suspect` or `culprit`.
    pub(super) fn judge_app(&mut self, mut obs: Observation, rule: &Rule) {
        let gpu = obs
            .gpu
            .as_ref()
            .map_or("node".to_string(), |g| format!("gpu{}", g.index));
        let culprit = obs.culprit().cloned();
        let unit = match &culprit {
            // Whichever of these clients faulted: the set is the unit, so another set of
            // tenants faulting at the same place is told apart.
            Some(c) if c.via == Via::MpsAmbiguous => {
                let mut set: Vec<&str> = c.candidates.iter().map(String::as_str).collect();
                set.sort_unstable();
                format!("{MPS_CLIENTS}{}", set.join(", "))
            }
            Some(c) => c.unit(),
            None => UNATTRIBUTED.to_string(),
        };
        // A fault that could be any of several clients' names no program: never counted.
        let programs = match &culprit {
            Some(c) if c.is_attributed() => vec![c.program_key()],
            _ => Vec::new(),
        };
        let place = match rule.suspect.map(|s| s.at) {
            Some(Place::Gpu) | None => Some(gpu.clone()),
            Some(Place::Location) => obs
                .xid
                .as_ref()
                .and_then(|x| x.site.as_ref())
                .and_then(|s| s.key()),
        };
        let key = format!("{}@{gpu}", rule.name);
        self.app_seen(&key, rule.app_window(), &unit, programs, place.clone());
        if let Some(p) = &place
            && let Some((verdict, reason)) = self.suspected(rule, &key, p)
        {
            self.st.app.seen.remove(&key);
            let rule_name = format!("{}/suspect", rule.name);
            let class = format!("{rule_name}@{gpu}");
            self.dispatch(obs, verdict, &rule_name, &reason, &class);
            return;
        }
        let repeats =
            self.st
                .app
                .unit_faults(&key, &unit, rule.culprit.map(|c| c.window), self.now);
        let who = culprit
            .as_ref()
            .map_or("an unnamed process".to_string(), |c| c.describe());
        if let Some(c) = rule.culprit
            && let Some(task) = culprit.as_ref().and_then(|c| c.task.clone())
            && culprit.as_ref().is_some_and(|c| c.is_attributed())
            && repeats >= c.count
        {
            self.st.app.forget_unit(&key, &unit);
            obs.tasks = vec![task];
            obs.pids = culprit.as_ref().and_then(|c| c.pid).into_iter().collect();
            let reason = format!(
                "{} faulted {repeats} times within {}: its own bug; its task on this node is \
                 stopped (rule `{}`, `culprit`), every other tenant keeps the GPU",
                who,
                humantime::format_duration(c.window),
                rule.name
            );
            let rule_name = format!("{}/culprit", rule.name);
            let class = format!("{rule_name}@{unit}");
            self.dispatch(obs, c.action, &rule_name, &reason, &class);
            return;
        }
        let at = place.map_or(String::new(), |p| format!(" at {p}"));
        let reason = if !names_one(&unit) {
            format!(
                "{} from {who}{at}: no program could be named, so it is counted with no \
                 program's ({})",
                obs.signal, rule.reason
            )
        } else {
            format!(
                "{} from {who}{at}: judged the application's, one program's fault ({} within \
                 the window); the node stays in service ({})",
                obs.signal,
                repeats.max(1),
                rule.reason
            )
        };
        // One incident per program and rule while it keeps faulting, on every GPU.
        let class = if !names_one(&unit) {
            format!("{}@{gpu}", rule.name)
        } else {
            format!("{}@{unit}", rule.name)
        };
        if rule.action == Verdict::Log && self.st.incidents.log_repeat(&class, &obs, self.now) {
            if let Some(r) = self.st.incidents.recent_logs.get(&class) {
                let id = r.incident;
                self.st.app.remember_xid(&obs, id, self.now);
            }
            return;
        }
        self.dispatch(obs, rule.action, &rule.name, &reason, &class);
    }

    /// The rule's `suspect` verdict and why, when enough different programs faulted at
    /// `place`.
    fn suspected(&self, rule: &Rule, key: &str, place: &str) -> Option<(Verdict, String)> {
        let s = rule.suspect?;
        let found = self.suspicion(key, place, s.window, s.at)?;
        if found.len() < s.programs as usize {
            return None;
        }
        let reason = format!(
            "{} different programs faulted at {place} within {} ({}): the same place for \
             different programs points at the GPU, not at one program (rule `{}`, NVIDIA's \
             WORKFLOW_XID_13/_31: run the GPU's diagnostics): {}",
            found.len(),
            humantime::format_duration(s.window),
            found.join(", "),
            rule.name,
            rule.reason
        );
        Some((s.action, reason))
    }

    /// Records one fault of `unit` at `place` under `key`, dropping what left the window.
    fn app_seen(
        &mut self,
        key: &str,
        keep: Duration,
        unit: &str,
        programs: Vec<String>,
        place: Option<String>,
    ) {
        let now = self.now;
        let list =
            self.st
                .app
                .seen
                .get_or_insert_evicting(key.to_string(), BoundedVec::default, |v| {
                    v.iter().map(|s| s.last).max()
                });
        list.retain(|s| now.since(s.last) <= keep);
        for s in list.iter_mut() {
            s.times.retain(|t| now.since(*t) <= keep);
        }
        let at = match list.iter().position(|s| s.unit == unit && s.place == place) {
            Some(i) => i,
            None => {
                // A new pair in a full list takes the place of the stalest pair of the unit
                // holding the most: a flood of one unit's pairs evicts only its own.
                let mut held: BTreeMap<String, usize> = BTreeMap::new();
                for s in list.iter() {
                    *held.entry(s.unit.clone()).or_default() += 1;
                }
                list.push_evicting_by(
                    AppSeen {
                        unit: unit.to_string(),
                        programs,
                        place,
                        last: now,
                        times: Sightings::default(),
                    },
                    |s| {
                        (
                            std::cmp::Reverse(held.get(&s.unit).copied().unwrap_or(0)),
                            s.last,
                        )
                    },
                );
                list.len() - 1
            }
        };
        if let Some(entry) = list.get_mut(at) {
            entry.last = now;
            entry.times.push_evicting(now);
        }
    }

    /// The fewest programs that explain the faults at `place` within `window`. At a
    /// location, a task whose every fault fell there counts by itself (several tasks of one
    /// program all faulting at one SM cluster is the cluster's doing); a task that faulted
    /// elsewhere too counts as its program (one program's bug lands where its work runs).
    fn suspicion(
        &self,
        key: &str,
        place: &str,
        window: Duration,
        at: Place,
    ) -> Option<Vec<String>> {
        let now = self.now;
        let list = self.st.app.seen.get(key)?;
        let recent = |s: &&AppSeen| now.since(s.last) <= window;
        let sets: Vec<Vec<String>> = list
            .iter()
            .filter(recent)
            .filter(|s| s.place.as_deref() == Some(place))
            // A fault that could be any of several MPS clients' counts for no program.
            .filter(|s| !s.unit.starts_with(MPS_CLIENTS))
            .map(|s| {
                let only_here = at == Place::Location
                    && names_one(&s.unit)
                    && list
                        .iter()
                        .filter(recent)
                        .filter(|o| o.unit == s.unit && o.place.is_some())
                        .all(|o| o.place.as_deref() == Some(place));
                if only_here {
                    vec![s.unit.clone()]
                } else if s.programs.is_empty() {
                    vec![UNATTRIBUTED.to_string()]
                } else {
                    s.programs.clone()
                }
            })
            .collect();
        Some(fewest_programs(&sets))
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod hitting_set_tests {
    use super::*;

    fn set(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_fewest_programs_explain_the_faults() {
        assert_eq!(
            fewest_programs(&[set(&["a"]), set(&["a"]), set(&["a"])]).len(),
            1
        );
        assert_eq!(
            fewest_programs(&[set(&["a"]), set(&["b"]), set(&["c"])]).len(),
            3
        );
        // MPS faults charged to the server: one client on every list could be all of them.
        assert_eq!(
            fewest_programs(&[set(&["a", "b"]), set(&["a", "c"]), set(&["a", "d"])]),
            set(&["a"])
        );
        assert_eq!(
            fewest_programs(&[set(&["a", "b"]), set(&["c", "d"]), set(&["e"])]).len(),
            3
        );
        assert!(fewest_programs(&[Vec::new()]).is_empty());
    }
}
