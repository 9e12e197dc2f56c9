//! Drills (`gpu-medic drill`): armed, matched to the signal they rehearse, and expired. The
//! incident a drill's signal opens carries its id (`State::drills`).

use serde::{Deserialize, Serialize};

use super::Cx;
use crate::model::IncidentId;
use crate::model::Timestamp;
use crate::model::bounded::{BoundedMap, BoundedVec};
use crate::model::{DRILL_ARM_WINDOW, Drill, Observation};

/// The drills' state: drills armed and waiting for their signal, and the incidents that are
/// drills.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Drills {
    /// Drills asked for (`gpu-medic drill`) whose signal has not opened an incident yet.
    pub armed: BoundedVec<ArmedDrill, MAX_ARMED_DRILLS>,
    /// Incidents that are drills: their records carry the drill's id, and an observe drill's
    /// orders are journaled, not executed. The newest [`MAX_DRILL_INCIDENTS`] are kept.
    pub incidents: BoundedMap<IncidentId, DrillMark, MAX_DRILL_INCIDENTS>,
}

/// Bound on the drills armed at once (the oldest goes first).
pub const MAX_ARMED_DRILLS: usize = 8;
/// Bound on the drill incidents remembered (the oldest goes first).
pub const MAX_DRILL_INCIDENTS: usize = 64;

/// A drill waiting for its signal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArmedDrill {
    pub drill: crate::model::Drill,
    pub at: Timestamp,
}

/// What the engine keeps of a drill once it opened its incident.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrillMark {
    pub id: String,
    #[serde(default)]
    pub observe: bool,
}

impl Drills {
    /// Disarms the drill `id` (if armed).
    pub fn disarm(&mut self, id: &str) {
        self.armed.retain(|a| a.drill.id != id);
    }

    /// Forgets the drills armed longer ago than [`DRILL_ARM_WINDOW`].
    pub fn expire(&mut self, now: Timestamp) {
        self.armed.retain(|a| now.since(a.at) <= DRILL_ARM_WINDOW);
    }

    /// The armed drill an observation from a probe is the signal of, if any.
    pub fn matching(&mut self, obs: &Observation, now: Timestamp) -> Option<String> {
        if self.armed.is_empty() {
            return None;
        }
        self.expire(now);
        self.armed
            .iter()
            .find(|a| a.drill.expect.matches(obs))
            .map(|a| a.drill.id.clone())
    }

    /// The incident `incident` is drill `id`'s (its signal opened it): the drill is taken out
    /// of the armed list and the incident marked as its. `None` when it is no longer armed.
    pub fn claim(&mut self, id: &str, incident: IncidentId) -> Option<Drill> {
        let at = self.armed.iter().position(|a| a.drill.id == id)?;
        let drill = self.armed.remove(at).drill;
        // The oldest drill incident (the smallest id) makes room.
        self.incidents.insert_evicting(
            incident,
            DrillMark {
                id: drill.id.clone(),
                observe: drill.observe,
            },
            |_| (),
        );
        Some(drill)
    }

    /// Whether `incident` is an observe drill's: its orders are journaled, not executed.
    pub fn observes(&self, incident: IncidentId) -> bool {
        self.incidents.get(&incident).is_some_and(|d| d.observe)
    }
}

impl Cx<'_> {
    /// Arms a drill; one that brings its observation is judged at once.
    pub(super) fn drill(&mut self, drill: Drill) {
        self.st.drills.expire(self.now);
        self.st.drills.disarm(&drill.id);
        let inject = drill.inject.clone();
        let id = drill.id.clone();
        self.st.drills.armed.push_evicting(ArmedDrill {
            drill,
            at: self.now,
        });
        if let Some(obs) = inject {
            self.drill = Some(id.clone());
            self.observe(obs);
            self.drill = None;
            // Judged once: it does not wait for another signal.
            self.st.drills.disarm(&id);
        }
    }
}
