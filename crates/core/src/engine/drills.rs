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

impl Cx<'_> {
    /// Arms a drill; one that brings its observation is judged at once.
    pub(super) fn drill(&mut self, drill: Drill) {
        self.expire_drills();
        self.st.drills.armed.retain(|a| a.drill.id != drill.id);
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
            self.st.drills.armed.retain(|a| a.drill.id != id);
        }
    }

    pub(super) fn expire_drills(&mut self) {
        let now = self.now;
        self.st
            .drills
            .armed
            .retain(|a| now.since(a.at) <= DRILL_ARM_WINDOW);
    }

    /// The armed drill this step's incident belongs to, taken out of the armed list.
    pub(super) fn take_drill(&mut self) -> Option<Drill> {
        let id = self.drill.take()?;
        let at = self.st.drills.armed.iter().position(|a| a.drill.id == id)?;
        Some(self.st.drills.armed.remove(at).drill)
    }

    /// An observation from a probe: the drill it is the signal of, if one is armed for it.
    pub(super) fn observation(&mut self, obs: Observation) {
        if !self.st.drills.armed.is_empty() {
            self.expire_drills();
            self.drill = self
                .st
                .drills
                .armed
                .iter()
                .find(|a| a.drill.expect.matches(&obs))
                .map(|a| a.drill.id.clone());
        }
        self.observe(obs);
        self.drill = None;
    }
}
