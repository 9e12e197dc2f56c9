//! Each ECS task container's share of a GPU's compute in use, against the share it may use,
//! from the NVML poller's latest snapshot at each scrape, with the labels of
//! `gpu_medic_task_gpu_memory_bytes` (task, family, revision, container, gpu, uuid; capped
//! and folded as that series is): the SM utilization of its processes (NVML's process
//! utilization samples) and the active thread percentage in force (the largest its clients
//! run with: `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`, else the MPS daemon's default).

use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::Labels;
use crate::accounting::usage::TaskUsage;

pub(super) struct ShareMetrics {
    sm: Family<Labels, Gauge>,
    sm_limit: Family<Labels, Gauge>,
}

impl ShareMetrics {
    pub(super) fn register(registry: &mut Registry) -> Self {
        let sm = Family::<Labels, Gauge>::default();
        registry.register(
            "task_gpu_sm_percent",
            "SM utilization of an ECS task's container on a GPU, percent of the GPU's SMs: its MPS client processes' NVML process utilization samples since the previous poll (each process's mean), summed, at the last poll",
            sm.clone(),
        );
        let sm_limit = Family::<Labels, Gauge>::default();
        registry.register(
            "task_gpu_sm_limit_percent",
            "The active thread percentage in force for an ECS task's container on a GPU: the largest its MPS clients run with (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, else the MPS daemon's default), at the last poll",
            sm_limit.clone(),
        );
        ShareMetrics { sm, sm_limit }
    }

    /// Starts a scrape: every series is replaced.
    pub(super) fn clear(&self) {
        self.sm.clear();
        self.sm_limit.clear();
    }

    /// One task container's use on one GPU, under `labels` (already capped): summed into a
    /// folded series, the largest limit standing for the folded ones.
    pub(super) fn record(&self, labels: &Labels, t: &TaskUsage) {
        if let Some(p) = t.sm_percent {
            self.sm.get_or_create(labels).inc_by(i64::from(p));
        }
        if let Some(p) = t.sm_limit_percent {
            let g = self.sm_limit.get_or_create(labels);
            g.set(g.get().max(i64::from(p)));
        }
    }
}
