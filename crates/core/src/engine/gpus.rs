//! One GPU's state (healthy, suspect, quarantined) and the stop-tasks order that ends the
//! tasks an MPS server fault poisoned.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{AWS_DISABLED, Cx};
use crate::model::Timestamp;
use crate::model::{Command, GpuId, IncidentId, IncidentState, Observation, Verdict};

/// The GPUs' state: each judged GPU's health, and the stop-tasks work per GPU.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Gpus {
    /// GPUs that have been judged (healthy GPUs never seen in a signal are absent;
    /// `state.json`: `gpus`).
    pub health: BTreeMap<u32, GpuHealth>,
    /// Stop-tasks work per GPU index, by incident (`state.json`: `gpu_jobs`).
    pub jobs: BTreeMap<u32, IncidentId>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuHealth {
    pub gpu: GpuId,
    pub status: GpuStatus,
    /// The rule behind the status and its verdict.
    pub rule: String,
    pub verdict: Verdict,
    pub incident: Option<IncidentId>,
    pub since: Timestamp,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuStatus {
    Healthy,
    /// A signal was seen and awaits confirmation.
    Suspect,
    /// Judged faulty; sticky until the instance is replaced.
    Faulted,
}

impl Gpus {
    /// Forgets the GPUs an incident judged (the instance is back in service).
    pub fn forget(&mut self, incident: IncidentId) {
        self.health.retain(|_, g| g.incident != Some(incident));
    }
}

impl Cx<'_> {
    /// The tasks on a GPU were stopped: its stop-tasks work is done.
    pub(super) fn tasks_stopped(&mut self, incident: IncidentId, gpu: &GpuId) {
        self.st.gpus.jobs.remove(&gpu.index);
        self.close(
            incident,
            IncidentState::Resolved,
            format!("tasks on {gpu} stopped; the MPS server can recover"),
        );
    }

    pub(super) fn mark_gpu(
        &mut self,
        gpu: &GpuId,
        status: GpuStatus,
        rule: &str,
        verdict: Verdict,
        incident: Option<IncidentId>,
    ) {
        let now = self.now;
        let entry = self
            .st
            .gpus
            .health
            .entry(gpu.index)
            .or_insert_with(|| GpuHealth {
                gpu: gpu.clone(),
                status: GpuStatus::Healthy,
                rule: String::new(),
                verdict: Verdict::Ignore,
                incident: None,
                since: now,
            });
        if entry.status == GpuStatus::Faulted && status != GpuStatus::Faulted {
            return; // faults are sticky
        }
        if !gpu.uuid.is_empty() {
            entry.gpu = gpu.clone();
        }
        if entry.status != status {
            entry.since = now;
        }
        entry.status = status;
        entry.rule = rule.to_string();
        entry.verdict = entry.verdict.max(verdict);
        if incident.is_some() {
            entry.incident = incident;
        }
    }

    pub(super) fn stop_tasks(&mut self, obs: Observation, rule: &str, reason: &str) {
        let Some(gpu) = obs.gpu.clone() else {
            let id = self.open(&obs, rule, reason, Verdict::Log);
            self.close(
                id,
                IncidentState::Logged,
                "stop-tasks needs a GPU and the signal named none; recorded only",
            );
            return;
        };
        if let Some(id) = self.st.gpus.jobs.get(&gpu.index).copied() {
            self.attach(id, &obs);
            return;
        }
        let id = self.open(&obs, rule, reason, Verdict::StopTasks);
        // Without AWS the order still goes where MPS can terminate the clients it names.
        let finest = self.st.capabilities.mps && !obs.pids.is_empty();
        if !self.st.capabilities.aws && !finest {
            let command = Command::StopTasks {
                gpu: gpu.clone(),
                pids: obs.pids.clone(),
                tasks: obs.tasks.clone(),
            };
            self.would(
                id,
                vec![command],
                &format!("stopped the tasks on {gpu}"),
                AWS_DISABLED,
            );
            return;
        }
        let command = Command::StopTasks {
            gpu: gpu.clone(),
            pids: obs.pids.clone(),
            tasks: obs.tasks.clone(),
        };
        if self.issue(id, command, 1).is_some() {
            self.st.gpus.jobs.insert(gpu.index, id);
        } else {
            self.close(
                id,
                IncidentState::Observed,
                format!("observe-only: would have stopped the tasks on {gpu}"),
            );
        }
    }
}
