//! One GPU's state (healthy, suspect, quarantined) and the stop-tasks order that ends the
//! tasks an MPS server fault poisoned.

use super::{AWS_DISABLED, Cx, GpuHealth, GpuStatus};
use crate::model::{Command, GpuId, IncidentId, IncidentState, Observation, Verdict};

impl Cx<'_> {
    pub(super) fn mark_gpu(
        &mut self,
        gpu: &GpuId,
        status: GpuStatus,
        rule: &str,
        verdict: Verdict,
        incident: Option<IncidentId>,
    ) {
        let now = self.now;
        let entry = self.st.gpus.entry(gpu.index).or_insert_with(|| GpuHealth {
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
        if let Some(id) = self.st.gpu_jobs.get(&gpu.index).copied() {
            self.attach(id, &obs);
            return;
        }
        let id = self.open(&obs, rule, reason, Verdict::StopTasks);
        if !self.st.capabilities.aws {
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
        if self.issue(id, command, 1) {
            self.st.gpu_jobs.insert(gpu.index, id);
        } else {
            self.close(
                id,
                IncidentState::Observed,
                format!("observe-only: would have stopped the tasks on {gpu}"),
            );
        }
    }
}
