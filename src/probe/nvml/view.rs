//! What NVML saw at its last poll, for the probes that compare it with another view (ECS's
//! `gpuDevices`, `crate::probe::ecs_gpus`), and how many GPUs the poller expects when
//! `[nvml] expected_gpus` is unset. Both are objects handed at construction to the NVML probe
//! and to the probe that reads or sets them, never statics.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::Notify;

use crate::model::GpuId;

/// One GPU at the last poll.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuView {
    pub gpu: GpuId,
    /// NVML reports it lost (GPU_IS_LOST), or a GPU it knew no longer answers.
    pub lost: bool,
    /// (used, total) bytes of device memory, where NVML answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<(u64, u64)>,
}

/// The GPUs of one poll, by index: those NVML counts, and those it knew that are lost.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewSnapshot {
    /// NVML's device count.
    pub count: u32,
    pub gpus: BTreeMap<u32, GpuView>,
}

impl ViewSnapshot {
    /// The GPU with this ECS GPU id: its UUID (any case), or its index where ECS names GPUs
    /// by index.
    pub fn find(&self, id: &str) -> Option<&GpuView> {
        self.gpus
            .values()
            .find(|g| !g.gpu.uuid.is_empty() && g.gpu.uuid.eq_ignore_ascii_case(id))
            .or_else(|| id.parse::<u32>().ok().and_then(|i| self.gpus.get(&i)))
    }
}

#[derive(Default)]
struct Inner {
    latest: Mutex<Option<ViewSnapshot>>,
    polled: Notify,
}

/// The NVML poller's latest [`ViewSnapshot`], shared with its readers. Clones share one view.
#[derive(Clone, Default)]
pub struct NvmlView(Arc<Inner>);

impl NvmlView {
    pub fn new() -> Self {
        NvmlView::default()
    }

    /// Replaces the view (the poller, after each poll) and wakes who waits for one.
    pub fn publish(&self, snap: ViewSnapshot) {
        *self.0.latest.lock().unwrap_or_else(|p| p.into_inner()) = Some(snap);
        self.0.polled.notify_waiters();
    }

    /// The last poll's view; None before the first poll.
    pub fn latest(&self) -> Option<ViewSnapshot> {
        self.0
            .latest
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The view, waiting up to `wait` for the first poll.
    pub async fn first(&self, wait: std::time::Duration) -> Option<ViewSnapshot> {
        let polled = self.0.polled.notified();
        if let Some(v) = self.latest() {
            return Some(v);
        }
        let _ = tokio::time::timeout(wait, polled).await;
        self.latest()
    }
}

pub use crate::model::gpu_view::Expected;

/// How many GPUs this instance should have when `[nvml] expected_gpus` is unset: set by the
/// probe that learns it (from ECS, else from the instance type), read by the NVML poller each
/// poll. Clones share one value.
#[derive(Clone, Default, Debug)]
pub struct ExpectedGpus(Arc<Mutex<Option<Expected>>>);

impl ExpectedGpus {
    pub fn new() -> Self {
        ExpectedGpus::default()
    }

    pub fn set(&self, count: u32, source: impl Into<String>) {
        let e = Expected {
            count,
            source: source.into(),
        };
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if g.as_ref() != Some(&e) {
            tracing::info!(
                expected_gpus = e.count,
                source = %e.source,
                "expected GPU count ([nvml] expected_gpus unset)"
            );
            *g = Some(e);
        }
    }

    pub fn get(&self) -> Option<Expected> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_are_found_by_uuid_in_any_case_or_by_index() {
        let mut v = ViewSnapshot::default();
        v.gpus.insert(
            2,
            GpuView {
                gpu: GpuId {
                    index: 2,
                    uuid: "GPU-abc".into(),
                    ..GpuId::default()
                },
                lost: false,
                memory: None,
            },
        );
        assert_eq!(v.find("gpu-ABC").map(|g| g.gpu.index), Some(2));
        assert_eq!(v.find("2").map(|g| g.gpu.index), Some(2));
        assert!(v.find("GPU-other").is_none());
    }

    #[tokio::test]
    async fn readers_wait_for_the_first_poll() {
        let v = NvmlView::new();
        assert!(
            v.first(std::time::Duration::from_millis(10))
                .await
                .is_none()
        );
        let w = v.clone();
        let reader = tokio::spawn(async move { w.first(std::time::Duration::from_secs(5)).await });
        tokio::task::yield_now().await;
        v.publish(ViewSnapshot {
            count: 3,
            ..ViewSnapshot::default()
        });
        assert_eq!(reader.await.unwrap().map(|s| s.count), Some(3));
    }
}
