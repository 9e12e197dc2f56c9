//! Drills (`gpu-medic drill`): armed, matched to the signal they rehearse, and expired. The
//! incident a drill's signal opens carries its id (`State::drills`).

use super::{ArmedDrill, Cx};
use crate::model::{DRILL_ARM_WINDOW, Drill, Observation};

impl Cx<'_> {
    /// Arms a drill; one that brings its observation is judged at once.
    pub(super) fn drill(&mut self, drill: Drill) {
        self.expire_drills();
        self.st.armed_drills.retain(|a| a.drill.id != drill.id);
        let inject = drill.inject.clone();
        let id = drill.id.clone();
        self.st.armed_drills.push_evicting(ArmedDrill {
            drill,
            at: self.now,
        });
        if let Some(obs) = inject {
            self.drill = Some(id.clone());
            self.observe(obs);
            self.drill = None;
            // Judged once: it does not wait for another signal.
            self.st.armed_drills.retain(|a| a.drill.id != id);
        }
    }

    pub(super) fn expire_drills(&mut self) {
        let now = self.now;
        self.st
            .armed_drills
            .retain(|a| now.since(a.at) <= DRILL_ARM_WINDOW);
    }

    /// The armed drill this step's incident belongs to, taken out of the armed list.
    pub(super) fn take_drill(&mut self) -> Option<Drill> {
        let id = self.drill.take()?;
        let at = self.st.armed_drills.iter().position(|a| a.drill.id == id)?;
        Some(self.st.armed_drills.remove(at).drill)
    }

    /// An observation from a probe: the drill it is the signal of, if one is armed for it.
    pub(super) fn observation(&mut self, obs: Observation) {
        if !self.st.armed_drills.is_empty() {
            self.expire_drills();
            self.drill = self
                .st
                .armed_drills
                .iter()
                .find(|a| a.drill.expect.matches(&obs))
                .map(|a| a.drill.id.clone());
        }
        self.observe(obs);
        self.drill = None;
    }
}
