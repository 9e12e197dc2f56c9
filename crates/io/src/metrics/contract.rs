//! The MPS contract's series (docs/mps.md#the-mps-contract-and-what-gpu-medic-checks), from
//! the NVML poller's latest snapshot at each scrape, like the per-task use: processes outside
//! MPS per GPU, clients whose limits do not match their reservation per GPU, limit and why,
//! and the pinned memory limit in force per task container. Labels are bounded: GPU indices,
//! two limits, two reasons, and the task labels capped as the other task series are.

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{Labels, bounded_task, with_container};
use crate::accounting::usage::Snapshot;

pub(super) struct ContractMetrics {
    bypass: Family<Labels, Gauge>,
    mismatch: Family<Labels, Gauge>,
    limit: Family<Labels, Gauge>,
}

impl ContractMetrics {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let bypass = Family::<Labels, Gauge>::default();
        registry.register(
            "mps_bypass_processes",
            "CUDA processes outside MPS on a GPU MPS serves (NVML's compute list, not its MPS client list; the MPS server, gpu-medic and DCGM excepted), at the last poll",
            bypass.clone(),
        );
        let mismatch = Family::<Labels, Gauge>::default();
        registry.register(
            "mps_limit_mismatch_clients",
            "MPS clients of ECS tasks running without the limit their container reserved (limit: memory = CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, threads = CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; why: none, larger), at the last poll",
            mismatch.clone(),
        );
        let limit = Family::<Labels, Gauge>::default();
        registry.register(
            "task_gpu_memory_limit_bytes",
            "The pinned GPU memory limit in force in an ECS task's container: the largest CUDA_MPS_PINNED_DEVICE_MEM_LIMIT its MPS clients run with, at the last poll",
            limit.clone(),
        );
        ContractMetrics {
            bypass,
            mismatch,
            limit,
        }
    }

    /// Replaces the series with `snap`'s.
    pub(super) fn refresh(&self, snap: &Snapshot) {
        self.bypass.clear();
        self.mismatch.clear();
        self.limit.clear();
        for (gpu, n) in &snap.outside_mps {
            self.bypass
                .get_or_create(&vec![("gpu".into(), gpu.to_string())])
                .set(i64::from(*n));
        }
        for ((gpu, limit, why), n) in &snap.mismatches {
            let labels: Labels = vec![
                ("gpu".into(), gpu.to_string()),
                ("limit".into(), (*limit).to_string()),
                ("why".into(), (*why).to_string()),
            ];
            self.mismatch.get_or_create(&labels).set(i64::from(*n));
        }
        let mut seen = std::collections::BTreeSet::new();
        for t in &snap.tasks {
            let task: Labels = vec![
                ("task".into(), t.name().to_string()),
                ("family".into(), t.family.clone()),
                ("revision".into(), t.revision.clone()),
            ];
            let task = bounded_task(task, &mut seen);
            for c in &t.containers {
                let Some(b) = c.limit_bytes else { continue };
                let g = self.limit.get_or_create(&with_container(&task, &c.name));
                // Folded containers: the largest limit stands for them.
                g.set(g.get().max(i64::try_from(b).unwrap_or(i64::MAX)));
            }
        }
    }
}
