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

/// How many GPUs this instance should have: learnt by the probe that learns it (from ECS,
/// else from the instance type), read by the NVML poller each poll; and which GPUs ECS gave
/// whole to one container ([`ExpectedGpus::dedicated`]). The instance type's
/// count is kept apart as well: it is AWS's fact, against which a set `[nvml] expected_gpus`
/// is checked ([`ExpectedGpus::resolve`]). Clones share one value.
#[derive(Clone, Default, Debug)]
pub struct ExpectedGpus(Arc<Mutex<Learnt>>);

#[derive(Default, Debug)]
struct Learnt {
    /// The count to expect while `[nvml] expected_gpus` is unset.
    best: Option<Expected>,
    /// The instance type's count (docs/gpu-instance-types.md), whatever the config says.
    by_type: Option<Expected>,
    /// A probe is about to ask for the instance type and has not asked yet: a set
    /// `[nvml] expected_gpus` is not relied on before it could be checked.
    type_pending: bool,
    /// The GPUs (UUIDs) ECS last said it gave whole to one container (`sharingMode`
    /// `DEDICATED`): such a container runs without MPS by design, so the outside-MPS check
    /// leaves its GPU alone.
    dedicated: std::collections::BTreeSet<String>,
}

/// What to compare NVML's count with, and, when `[nvml] expected_gpus` contradicts the
/// instance type, why that setting is not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub expected: Option<Expected>,
    pub mistake: Option<String>,
}

/// Where a set `[nvml] expected_gpus` came from, in messages and views.
pub const CONFIGURED: &str = "[nvml] expected_gpus";

impl ExpectedGpus {
    pub fn new() -> Self {
        ExpectedGpus::default()
    }

    /// One that a probe will teach the instance type ([`ExpectedGpus::type_asked`] once it
    /// asked): until then no count is held to a set `[nvml] expected_gpus`.
    pub fn learning() -> Self {
        let e = ExpectedGpus::default();
        e.lock().type_pending = true;
        e
    }

    /// The instance type was asked for (answered or not): a set `[nvml] expected_gpus` is
    /// relied on from now where the type's count is not known.
    pub fn type_asked(&self) {
        self.lock().type_pending = false;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Learnt> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set(&self, count: u32, source: impl Into<String>) {
        let e = Expected {
            count,
            source: source.into(),
        };
        let mut g = self.lock();
        if g.best.as_ref() != Some(&e) {
            tracing::info!(
                expected_gpus = e.count,
                source = %e.source,
                "expected GPU count ([nvml] expected_gpus unset)"
            );
            g.best = Some(e);
        }
    }

    /// The instance type's GPU count (`instance_type` names it).
    pub fn set_type(&self, count: u32, instance_type: &str) {
        self.lock().by_type = Some(Expected {
            count,
            source: format!("instance type {instance_type}"),
        });
    }

    pub fn get(&self) -> Option<Expected> {
        self.lock().best.clone()
    }

    /// The GPUs ECS gave whole to one container (`DEDICATED`), by UUID, at its last answer.
    pub fn set_dedicated(&self, uuids: std::collections::BTreeSet<String>) {
        self.lock().dedicated = uuids;
    }

    /// What [`ExpectedGpus::set_dedicated`] last set (none before ECS answered).
    pub fn dedicated(&self) -> std::collections::BTreeSet<String> {
        self.lock().dedicated.clone()
    }

    /// The instance type's count, once known: the hardware's.
    pub fn by_type(&self) -> Option<Expected> {
        self.lock().by_type.clone()
    }

    /// The count to compare NVML's with. Unset in the config: what was learnt. Set: the
    /// config's, unless the instance type says otherwise; then the setting is a mistake (one
    /// AMI's config baked for another instance type), said, and the instance type's count is
    /// used, so that the mistake never replaces a node whose GPUs are all there.
    pub fn resolve(&self, configured: Option<u32>) -> Resolved {
        let g = self.lock();
        match (configured, &g.by_type) {
            (None, _) => Resolved {
                expected: g.best.clone(),
                mistake: None,
            },
            (Some(_), None) if g.type_pending => Resolved {
                expected: None,
                mistake: None,
            },
            (Some(n), Some(t)) if t.count != n => Resolved {
                expected: Some(t.clone()),
                mistake: Some(format!(
                    "{CONFIGURED} = {n} contradicts the {} with {} GPUs (AWS's count, docs/gpu-instance-types.md): the setting is not used; correct or remove it",
                    t.source, t.count
                )),
            },
            (Some(n), _) => Resolved {
                expected: Some(Expected {
                    count: n,
                    source: CONFIGURED.into(),
                }),
                mistake: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_count_is_held_to_the_instance_type() {
        let e = ExpectedGpus::new();
        assert_eq!(e.resolve(None).expected, None);
        let set = e.resolve(Some(8));
        assert_eq!(
            set.expected.map(|x| x.count),
            Some(8),
            "nothing to check it by"
        );
        let early = ExpectedGpus::learning();
        assert_eq!(
            early.resolve(Some(8)).expected,
            None,
            "not before the type is asked"
        );
        early.type_asked();
        assert_eq!(early.resolve(Some(8)).expected.map(|x| x.count), Some(8));
        e.set(7, "a learnt count");
        e.set_type(8, "p5.48xlarge");
        assert_eq!(e.resolve(None).expected.map(|x| x.count), Some(7));
        let agrees = e.resolve(Some(8));
        assert_eq!(agrees.mistake, None);
        assert_eq!(agrees.expected.unwrap().source, CONFIGURED);
        e.set_type(4, "g5.12xlarge");
        let baked = e.resolve(Some(8));
        assert_eq!(baked.expected.as_ref().map(|x| x.count), Some(4));
        assert!(
            baked
                .mistake
                .unwrap()
                .contains("contradicts the instance type g5.12xlarge"),
            "the config's count is not used"
        );
    }

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
