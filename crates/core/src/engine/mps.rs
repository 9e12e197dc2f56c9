//! The MPS daemon: restart requests within the restart budget, gpu-medic's own restarts told
//! apart from crashes, and the daemon answering again.

use serde::{Deserialize, Serialize};

use super::{Cx, MPS_NOT_MANAGED, OWN_EXIT_MATCH, RULE_MPS_BUDGET, target_key};
use crate::model::Timestamp;
use crate::model::{Command, IncidentId, IncidentState, Observation, Signal, Verdict};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct MpsState {
    pub phase: MpsPhase,
    /// When each restart was issued (pruned to the budget window).
    pub restarts: Vec<Timestamp>,
    pub incident: Option<IncidentId>,
    /// A restart of ours stops the running daemon; under systemd's `Restart=` the unit then
    /// starts it again and counts it in `NRestarts`. The one `mps-crash` from the unit that
    /// follows is that, not a crash.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub own_exit: Option<OwnExit>,
}

/// A restart of ours whose exit systemd may still report ([`MpsState::own_exit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OwnExit {
    /// When the restart was issued, or when it ended once `ended`.
    pub at: Timestamp,
    pub ended: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum MpsPhase {
    #[default]
    Up,
    Unresponsive,
    Restarting,
    /// The restart budget is spent; the policy's fallback applies.
    Failed,
}

impl MpsPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            MpsPhase::Up => "up",
            MpsPhase::Unresponsive => "unresponsive",
            MpsPhase::Restarting => "restarting",
            MpsPhase::Failed => "failed",
        }
    }
}

impl MpsState {
    /// Whether an `mps-crash` from the unit is the exit a restart of ours caused (the one
    /// report that follows it, within [`OWN_EXIT_MATCH`] of its end); the mark is used up.
    pub fn own_exit(&mut self, obs: &Observation, now: Timestamp) -> bool {
        if obs.signal != Signal::MpsCrash || obs.source != crate::model::MPS_UNIT_SOURCE {
            return false;
        }
        let Some(own) = self.own_exit.take() else {
            return false;
        };
        !own.ended || now.since(own.at) <= OWN_EXIT_MATCH
    }

    /// A restart of ours ended (whatever its outcome): systemd's report of the exit it caused
    /// may still follow.
    pub fn restart_ended(&mut self, now: Timestamp) {
        if let Some(own) = &mut self.own_exit {
            *own = OwnExit {
                at: now,
                ended: true,
            };
        }
    }
}

impl Cx<'_> {
    pub(super) fn mps_request(&mut self, obs: &Observation, rule: &str, reason: &str) {
        if !self.st.capabilities.mps {
            let key = format!("{rule}@{}", target_key(obs));
            if self.st.incidents.log_repeat(&key, obs, self.now) {
                return;
            }
            let id = self.open(obs, rule, reason, Verdict::RestartMps);
            self.st.incidents.remember_log(&key, id, self.now);
            self.would(
                id,
                vec![Command::RestartMps],
                "restarted the MPS control daemon",
                MPS_NOT_MANAGED,
            );
            return;
        }
        if let Some(id) = self.st.mps.incident {
            // Already being handled (restart in flight or scheduled, failed, or observed).
            self.attach(id, obs);
            return;
        }
        let id = self.open(obs, rule, reason, Verdict::RestartMps);
        self.st.mps.incident = Some(id);
        self.mps_try_restart(id);
    }

    /// The daemon restarted and answers: its incident is resolved.
    pub(super) fn mps_restarted(&mut self, incident: IncidentId) {
        self.st.mps.phase = MpsPhase::Up;
        if self.st.mps.incident == Some(incident) {
            self.st.mps.incident = None;
        }
        self.close(
            incident,
            IncidentState::Resolved,
            "MPS control daemon restarted and answering",
        );
    }

    /// A restart failed: tried again while the budget lasts, then declared failed.
    pub(super) fn mps_restart_failed(&mut self, incident: IncidentId, why: &str) {
        self.st.mps.phase = MpsPhase::Unresponsive;
        self.note(incident, format!("MPS restart failed: {why}"));
        let used = u32::try_from(self.st.mps.restarts.len()).unwrap_or(u32::MAX);
        if used < self.policy.mps.restart_budget {
            self.schedule(
                incident,
                Command::RestartMps,
                used.saturating_add(1),
                self.policy.retry.delay,
            );
        } else {
            self.mps_try_restart(incident);
        }
    }

    /// A scheduled restart came due: tried if the daemon is still down for this incident.
    pub(super) fn mps_retry(&mut self, incident: IncidentId) {
        if self.st.mps.phase != MpsPhase::Up && self.st.mps.incident == Some(incident) {
            self.mps_try_restart(incident);
        }
    }

    /// Restarts the daemon if the budget allows; otherwise declares it failed.
    pub(super) fn mps_try_restart(&mut self, incident: IncidentId) {
        let window = self.policy.mps.restart_window;
        let now = self.now;
        self.st.mps.restarts.retain(|t| now.since(*t) < window);
        let used = u32::try_from(self.st.mps.restarts.len()).unwrap_or(u32::MAX);
        if used < self.policy.mps.restart_budget {
            if self
                .issue(incident, Command::RestartMps, used.saturating_add(1))
                .is_some()
            {
                self.st.mps.restarts.push(now);
                self.st.mps.phase = MpsPhase::Restarting;
                self.st.mps.own_exit = Some(OwnExit {
                    at: now,
                    ended: false,
                });
            } else {
                self.close(
                    incident,
                    IncidentState::Observed,
                    "observe-only: would have restarted the MPS control daemon",
                );
            }
            return;
        }
        self.st.mps.phase = MpsPhase::Failed;
        let fallback = self.policy.mps.on_failed;
        let reason = format!(
            "MPS daemon restarted {} times within {} without recovering; declared failed; policy fallback: {}",
            used,
            humantime::format_duration(window),
            fallback
        );
        self.escalated(incident, fallback, RULE_MPS_BUDGET, reason.clone());
        if fallback.is_node_remediation() {
            self.remediate_in(incident, fallback);
        } else {
            self.close(incident, IncidentState::Failed, reason);
        }
    }

    /// The daemon answers: its incident closes unless a restart of ours is still out (its
    /// outcome closes it) or the node's remediation holds it.
    pub(super) fn mps_up(&mut self, obs: &Observation) {
        if self.st.orders.in_flight_any(&Command::RestartMps) {
            return; // the restart's own outcome closes the incident
        }
        self.st
            .orders
            .scheduled
            .retain(|s| s.command != Command::RestartMps);
        let was = self.st.mps.phase;
        self.st.mps.phase = MpsPhase::Up;
        if let Some(id) = self.st.mps.incident.take() {
            let node_owned = self.st.node.remediation.is_some_and(|r| r.incident == id);
            if node_owned {
                self.note(
                    id,
                    "MPS daemon answers again; the node remediation continues",
                );
            } else if self.st.incidents.open.contains_key(&id) {
                self.attach(id, obs);
                self.close(
                    id,
                    IncidentState::Resolved,
                    format!("MPS daemon answers again (was {})", was.as_str()),
                );
            }
        }
    }
}
