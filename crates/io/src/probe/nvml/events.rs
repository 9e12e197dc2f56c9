//! The event watcher: a dedicated blocking thread waiting on an NVML event set for critical
//! XIDs, double-bit ECC errors and the driver's recovery action, forwarding each as an
//! observation within milliseconds. It waits with a timeout so it notices shutdown, names the
//! GPU that was lost when a wait says GPU_IS_LOST, recreates the set after UNKNOWN, and
//! backs off instead of busy-looping when NVML keeps failing. Every event already waiting
//! is taken as one burst, and those the policy takes the node out of service for are handed
//! over first: an XID 79 queued behind a storm of 50,000 is not forwarded last.
//!
//! An XID event carries only the code. The NVLink5 XIDs (144-150) need the error status in
//! the driver's text to be judged, so while the kernel log reader runs the watcher holds them
//! for up to `poll::TEXT_WAIT`; the reader reports them decoded when their line comes, and the
//! watcher reports those whose line did not come as `undecoded`.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
use nvml_wrapper::error::NvmlError;
use tokio::sync::mpsc;

use super::poll::{SharedState, lock};
use super::raw::{self, EVENT_DOUBLE_BIT_ECC, EVENT_RECOVERY_ACTION, EVENT_XID, EventSet, Wait};
use crate::model::{Observation, RecoveryAction, Signal};
use crate::probe::kmsg;

/// The GPUs registered in the current event set, by handle value: an event names its GPU
/// without an NVML call per GPU (a storm of events costs one lookup each).
type Handles = Vec<(usize, u32)>;

/// How long one wait blocks before checking for shutdown.
pub const WAIT_MS: u32 = 1000;
const MAX_BACKOFF: Duration = Duration::from_secs(30);

pub struct Watcher {
    pub nvml: Arc<Nvml>,
    pub shared: SharedState,
    pub tx: mpsc::Sender<Observation>,
    pub stop: Arc<AtomicBool>,
    /// Which events of a burst are handed over first.
    pub urgency: crate::probe::Urgency,
}

/// At most this many events are taken off the set at once (a few words each) before any is
/// handed over, so the fatal ones among those waiting go first.
const BURST_MAX: usize = 65_536;

impl Watcher {
    fn send(&self, obs: Observation) -> bool {
        self.tx.blocking_send(obs).is_ok()
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Sleeps up to `d`, waking early on shutdown.
    fn pause(&self, d: Duration) {
        let step = Duration::from_millis(100);
        let mut left = d;
        while !self.stopped() && !left.is_zero() {
            let s = left.min(step);
            std::thread::sleep(s);
            left -= s;
        }
    }

    /// Runs until `stop` is set or the receiver is gone.
    pub fn run(self) {
        let mut lost: BTreeSet<u32> = BTreeSet::new();
        let mut unknown_in_a_row: u64 = 0;
        let mut warned: BTreeSet<String> = BTreeSet::new();
        while !self.stopped() {
            let mut handles = Handles::new();
            let set = match self.build_set(&lost, &mut warned, &mut handles) {
                Ok(Some(s)) => s,
                Ok(None) => {
                    // Nothing to watch (no GPU supports events, or all are lost): poll only.
                    self.pause(MAX_BACKOFF);
                    continue;
                }
                Err(e) => {
                    if warned.insert(format!("create:{e}")) {
                        tracing::warn!(probe = "nvml", "cannot create an NVML event set: {e}");
                    }
                    self.pause(Duration::from_secs(5));
                    continue;
                }
            };
            // What ended the last burst (an error), judged as the next wait's answer.
            let mut carried: Option<Wait> = None;
            loop {
                if self.stopped() {
                    return;
                }
                if !self.flush_held() {
                    return;
                }
                match carried.take().unwrap_or_else(|| set.wait(WAIT_MS)) {
                    Wait::Timeout => {}
                    Wait::Event(ev) => {
                        unknown_in_a_row = 0;
                        // Every event already waiting is one burst.
                        let mut burst = vec![ev];
                        while burst.len() < BURST_MAX {
                            match set.wait(0) {
                                Wait::Event(ev) => burst.push(ev),
                                Wait::Timeout => break,
                                other => {
                                    carried = Some(other);
                                    break;
                                }
                            }
                        }
                        if !self.forward_burst(burst, &handles) {
                            return;
                        }
                    }
                    Wait::Error(NvmlError::GpuLost) => {
                        let newly = self.find_lost(&mut lost);
                        if newly == 0 {
                            // NVML says lost but every GPU answers: do not spin.
                            self.pause(Duration::from_secs(1));
                        }
                        break; // rebuild without the lost GPUs
                    }
                    Wait::Error(NvmlError::Unknown) => {
                        unknown_in_a_row += 1;
                        let obs = Observation::new(Signal::NvmlEventUnknown)
                            .with_value(unknown_in_a_row)
                            .with_detail(
                                "NVML event wait returned UNKNOWN; the event set was recreated",
                            )
                            .from_source("nvml");
                        if !self.send(obs) {
                            return;
                        }
                        let backoff = Duration::from_secs(unknown_in_a_row.min(30));
                        self.pause(backoff);
                        break;
                    }
                    Wait::Error(e) => {
                        if warned.insert(format!("wait:{e}")) {
                            tracing::warn!(probe = "nvml", "NVML event wait failed: {e}");
                        }
                        self.pause(Duration::from_secs(1));
                        break;
                    }
                }
            }
        }
    }

    /// Creates a set registered on every GPU that is not lost, for the supported types.
    fn build_set(
        &self,
        lost: &BTreeSet<u32>,
        warned: &mut BTreeSet<String>,
        handles: &mut Handles,
    ) -> Result<Option<EventSet<'_>>, NvmlError> {
        let set = EventSet::create(&self.nvml)?;
        let count = self.nvml.device_count()?;
        let wanted = EVENT_XID | EVENT_DOUBLE_BIT_ECC | EVENT_RECOVERY_ACTION;
        let mut registered = 0;
        for index in (0..count).filter(|i| !lost.contains(i)) {
            let device = match self.nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => {
                    if warned.insert(format!("handle:{index}:{e}")) {
                        tracing::warn!(
                            probe = "nvml",
                            gpu_index = index,
                            "no handle for events: {e}"
                        );
                    }
                    continue;
                }
            };
            let types = match set.supported(&device, wanted) {
                Ok(t) => t,
                Err(e) => {
                    if warned.insert(format!("supported:{index}:{e}")) {
                        tracing::warn!(
                            probe = "nvml",
                            gpu_index = index,
                            "event types unknown ({e}); assuming XIDs only"
                        );
                    }
                    EVENT_XID
                }
            };
            if types == 0 {
                if warned.insert(format!("none:{index}")) {
                    tracing::warn!(
                        probe = "nvml",
                        gpu_index = index,
                        "GPU supports none of the watched events; counters are still polled"
                    );
                }
                continue;
            }
            match set.register(&device, types) {
                Ok(()) => {
                    registered += 1;
                    // SAFETY: the handle's value only, to find its index again; nothing is
                    // dereferenced.
                    handles.push((unsafe { device.handle() } as usize, index));
                    if warned.insert(format!("registered:{index}:{types:#x}")) {
                        tracing::info!(
                            probe = "nvml",
                            gpu_index = index,
                            event_types = format!("{types:#x}").as_str(),
                            xid = types & EVENT_XID != 0,
                            recovery_action = types & EVENT_RECOVERY_ACTION != 0,
                            "NVML events registered"
                        );
                    }
                }
                Err(e) => {
                    if warned.insert(format!("register:{index}:{e}")) {
                        tracing::warn!(
                            probe = "nvml",
                            gpu_index = index,
                            "cannot register events: {e}"
                        );
                    }
                }
            }
        }
        Ok((registered > 0).then_some(set))
    }

    /// Forwards a burst of events: those the policy takes the node out of service for
    /// first, then the others in the order NVML gave them. False when the receiver is gone.
    fn forward_burst(&self, burst: Vec<raw::Event>, handles: &Handles) -> bool {
        let (first, rest): (Vec<raw::Event>, Vec<raw::Event>) =
            burst.into_iter().partition(|ev| self.urgent(ev));
        first
            .into_iter()
            .chain(rest)
            .all(|ev| self.forward(ev, handles))
    }

    /// Whether an event carries a signal the policy takes the node out of service for.
    fn urgent(&self, ev: &raw::Event) -> bool {
        let u = &self.urgency;
        (ev.event_type & EVENT_XID != 0
            && u32::try_from(ev.data)
                .is_ok_and(|code| u.is_urgent(&Signal::Xid { code, decode: None })))
            || (ev.event_type & EVENT_RECOVERY_ACTION != 0
                && RecoveryAction::from_nvml(ev.data)
                    .is_some_and(|action| u.is_urgent(&Signal::RecoveryAction { action })))
            || (ev.event_type & EVENT_DOUBLE_BIT_ECC != 0 && u.is_urgent(&Signal::EccUncorrected))
    }

    /// Turns one event into an observation. Returns false when the receiver is gone.
    fn forward(&self, ev: raw::Event, handles: &Handles) -> bool {
        let known = handles
            .iter()
            .find(|(h, _)| *h == ev.device as usize)
            .map(|(_, i)| *i);
        let Some(index) = known.or_else(|| self.index_of(ev.device)) else {
            tracing::warn!(
                probe = "nvml",
                event_type = ev.event_type,
                "event from an unknown device"
            );
            return true;
        };
        let mut out = Vec::new();
        // An XID is a 32-bit code: a value past it is no XID (cut to 32 bits, 0x1_0000_004F
        // would read as 79 and take the node out of service).
        let xid = (ev.event_type & EVENT_XID != 0)
            .then(|| match u32::try_from(ev.data) {
                Ok(code) => Some(code),
                Err(_) => {
                    tracing::warn!(
                        probe = "nvml",
                        gpu_index = index,
                        value = ev.data,
                        "XID event whose code does not fit 32 bits; not an XID, ignored"
                    );
                    None
                }
            })
            .flatten();
        if let Some(code) = xid {
            let mut s = lock(&self.shared);
            if s.claim_xid(index, code, "nvml") {
                if kmsg::held_for_text(code) && s.kmsg_active {
                    s.awaiting_text
                        .push_back((index, code, std::time::Instant::now()));
                } else {
                    out.push(xid_without_text(code, "NVML event; no kernel log reader"));
                }
            }
        }
        if ev.event_type & EVENT_RECOVERY_ACTION != 0 {
            match RecoveryAction::from_nvml(ev.data) {
                Some(action) => out.push(Observation::new(Signal::RecoveryAction { action })),
                None => tracing::warn!(
                    probe = "nvml",
                    gpu_index = index,
                    value = ev.data,
                    "unknown recovery action"
                ),
            }
        }
        if ev.event_type & EVENT_DOUBLE_BIT_ECC != 0
            && let Some(obs) = self.ecc_delta(index)
        {
            out.push(obs);
        }
        let s = lock(&self.shared);
        let annotated: Vec<Observation> = out.into_iter().map(|o| s.annotate(o, index)).collect();
        drop(s);
        annotated.into_iter().all(|o| self.send(o))
    }

    /// Reports the held NVLink5 XIDs whose kernel log line did not come in time, undecoded.
    /// Returns false when the receiver is gone.
    fn flush_held(&self) -> bool {
        let expired = lock(&self.shared).expired_awaiting(super::poll::TEXT_WAIT);
        for (index, code) in expired {
            let obs = xid_without_text(code, "no kernel log line within 2 s of the NVML event");
            let obs = lock(&self.shared).annotate(obs, index);
            if !self.send(obs) {
                return false;
            }
        }
        true
    }

    /// Reads the uncorrected counter right away so the error is reported now, once.
    fn ecc_delta(&self, index: u32) -> Option<Observation> {
        let device = self.nvml.device_by_index(index).ok()?;
        let now = device
            .total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile)
            .ok();
        let mut s = lock(&self.shared);
        let delta = match now {
            Some(now) => now.saturating_sub(s.ecc_uncorrected.insert(index, now).unwrap_or(0)),
            // The counter cannot be read: the event itself is the evidence of one error.
            None => 1,
        };
        (delta > 0).then(|| {
            Observation::new(Signal::EccUncorrected)
                .with_value(delta)
                .with_detail("double-bit ECC event")
        })
    }

    fn index_of(&self, handle: nvml_wrapper_sys::bindings::nvmlDevice_t) -> Option<u32> {
        let count = self.nvml.device_count().ok()?;
        (0..count).find(|i| {
            self.nvml
                .device_by_index(*i)
                // SAFETY: comparing handle values only; nothing is dereferenced.
                .map(|d| unsafe { d.handle() } == handle)
                .unwrap_or(false)
        })
    }

    /// Finds the GPUs that answer GPU_IS_LOST, reports each once. Returns how many are new.
    fn find_lost(&self, lost: &mut BTreeSet<u32>) -> usize {
        let count = self.nvml.device_count().unwrap_or(0);
        let known: Vec<u32> = lock(&self.shared).gpus.keys().copied().collect();
        let mut newly = 0;
        for index in (0..count).chain(known) {
            if lost.contains(&index) {
                continue;
            }
            let gone = match self.nvml.device_by_index(index) {
                Err(NvmlError::GpuLost) => true,
                Ok(d) => matches!(d.uuid(), Err(NvmlError::GpuLost)),
                Err(_) => false,
            };
            if gone {
                lost.insert(index);
                newly += 1;
                let obs = lock(&self.shared).annotate(
                    Observation::new(Signal::GpuLost)
                        .with_detail("event wait returned GPU_IS_LOST"),
                    index,
                );
                if !self.send(obs) {
                    break;
                }
            }
        }
        newly
    }
}

/// An XID seen by NVML only: decoded as far as the code and the node allow.
fn xid_without_text(code: u32, why: &str) -> Observation {
    let (decode, detail) = kmsg::decode_xid(code, None, std::path::Path::new(kmsg::UVM_REFCNT));
    let obs = Observation::new(Signal::Xid { code, decode });
    match detail {
        Some(d) => obs.with_detail(format!("{d} ({why})")),
        None => obs,
    }
}
