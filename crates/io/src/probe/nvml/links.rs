//! The links of each GPU, read with the counters (docs/fabric.md): its NVLink fabric
//! registration (`nvmlDeviceGetGpuFabricInfoV`), every NVLink's state and error counters, the
//! PCIe link against its maximum and its replay counter, persistence mode and the full set of
//! clock event reasons.
//!
//! States (a fabric not completed, a link down that was up, a downtrained PCIe link,
//! persistence off) are reported on every poll, like the other states the poller reads;
//! counters become rates per minute over a window (`[links] nvlink_window`, `pcie_window`):
//! the increase within the window divided by the whole window, so a single burst counts once
//! at its size and a sustained rate is seen as such (DCGM judges NVLink and PCIe errors as
//! rates, docs/fabric.md#thresholds). A counter that goes backwards (a reset) starts its
//! window over.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use nvml_wrapper::Device;
use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::nv_link::ErrorCounter;
use nvml_wrapper::error::NvmlError;

use super::raw;
use crate::config::LinksConfig;
use crate::model::{Observation, Signal};

/// NVLinks a GPU may have: `NVML_NVLINK_MAX_LINKS`, 18 up to NVML 13.0 and 36 from NVML 13.5
/// (scripts/nvml-header-check.py holds this at least the header's). A bound only: the loop
/// stops at the first link the driver refuses (INVALID_ARGUMENT), 18 on Hopper and Blackwell.
pub const MAX_NVLINKS: u32 = 36;
/// Samples kept per rate, whatever the poll interval (a 60 s window at 100 ms polls).
const MAX_SAMPLES: usize = 1024;

/// Clock event reasons (`nvmlClocksEventReason*`, docs/fabric.md#clock-event-reasons).
pub const CLOCK_EVENT_REASONS: &[(u64, &str)] = &[
    (0x1, "gpu-idle"),
    (0x2, "applications-clocks-setting"),
    (0x4, "sw-power-cap"),
    (0x8, "hw-slowdown"),
    (0x10, "sync-boost"),
    (0x20, "sw-thermal-slowdown"),
    (0x40, "hw-thermal-slowdown"),
    (0x80, "hw-power-brake-slowdown"),
    (0x100, "display-clock-setting"),
];
pub(super) const REASON_GPU_IDLE: u64 = 0x1;
pub(super) const REASON_SW_THERMAL: u64 = 0x20;

/// The names of the reasons set in `mask`; bits NVML 13 does not name appear as hex.
pub fn reason_names(mask: u64) -> Vec<String> {
    let mut out: Vec<String> = CLOCK_EVENT_REASONS
        .iter()
        .filter(|(bit, _)| mask & bit != 0)
        .map(|(_, n)| n.to_string())
        .collect();
    let known: u64 = CLOCK_EVENT_REASONS.iter().map(|(b, _)| b).sum();
    if mask & !known != 0 {
        out.push(format!("{:#x}", mask & !known));
    }
    out
}

pub use crate::model::links::GpuLinks;

/// A counter's samples within its window.
#[derive(Debug, Default)]
struct Rate {
    samples: VecDeque<(Instant, u64)>,
}

impl Rate {
    /// Adds a sample; returns the increase within `window`, per minute of the window.
    fn push(&mut self, now: Instant, value: u64, window: Duration) -> u64 {
        if self.samples.back().is_some_and(|(_, v)| value < *v) {
            self.samples.clear(); // reset or wrapped: start over
        }
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > window)
        {
            self.samples.pop_front();
        }
        if self.samples.len() >= MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((now, value));
        let first = self.samples.front().map_or(value, |(_, v)| *v);
        let delta = value.saturating_sub(first);
        let secs = window.as_secs_f64().max(1.0);
        (delta as f64 * 60.0 / secs).round() as u64
    }
}

#[derive(Debug, Default)]
struct NvLinkTrack {
    seen_up: bool,
    crc: Rate,
    replay: Rate,
    recovery: Rate,
}

#[derive(Debug, Default)]
struct GpuTrack {
    links: BTreeMap<u32, NvLinkTrack>,
    pcie_replay: Rate,
}

/// Seconds since boot from a `/proc/uptime`-form file.
pub fn uptime_secs(path: &std::path::Path) -> Option<u64> {
    let text = crate::sys::limits::read_text(path, 4096, "uptime").ok()?;
    let first = text.split_whitespace().next()?;
    let secs: f64 = first.parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then_some(secs as u64)
}

/// The per-GPU link reader the poller holds between polls.
#[derive(Debug, Default)]
pub struct LinkReader {
    cfg: LinksConfig,
    gpus: BTreeMap<u32, GpuTrack>,
}

/// What one GPU's links gave this poll.
#[derive(Debug, Default)]
pub struct LinkReport {
    pub observations: Vec<Observation>,
    /// Reads that failed (a counter that stopped answering), and "cannot tell yet" states
    /// (a fabric still registering before its deadline) for `check`.
    pub pending: Vec<String>,
    pub view: GpuLinks,
}

fn fabric_name(state: u8) -> &'static str {
    match state {
        raw::FABRIC_NOT_STARTED => "not-started",
        raw::FABRIC_IN_PROGRESS => "in-progress",
        raw::FABRIC_COMPLETED => "completed",
        _ => "unknown",
    }
}

/// PCIe transfer rate per lane in MT/s by generation (PCI-SIG: 2.5, 5, 8, 16, 32, 64 GT/s).
fn lane_rate(generation: u32) -> u64 {
    match generation {
        1 => 2500,
        2 => 5000,
        3 => 8000,
        4 => 16000,
        5 => 32000,
        6 => 64000,
        _ => 0,
    }
}

impl LinkReader {
    pub fn new(cfg: LinksConfig) -> Self {
        LinkReader {
            cfg,
            gpus: BTreeMap::new(),
        }
    }

    /// Reads GPU `index`'s links. `failed` sorts an error into "not available" or a problem.
    pub fn read(
        &mut self,
        nvml: &Nvml,
        device: &Device<'_>,
        index: u32,
        now: Instant,
        failed: &mut dyn FnMut(&str, &NvmlError),
    ) -> LinkReport {
        let mut r = LinkReport {
            view: GpuLinks {
                index,
                ..GpuLinks::default()
            },
            ..LinkReport::default()
        };
        let cfg = &self.cfg;
        let track = self.gpus.entry(index).or_default();
        fabric(cfg, nvml, device, index, &mut r, failed);
        nvlinks(cfg, device, track, now, &mut r, failed);
        let reasons = clock_reasons(nvml, device, &mut r, failed);
        pcie(cfg, device, track, now, reasons, &mut r, failed);
        persistence(cfg, device, &mut r, failed);
        r
    }
}

/// The fabric registration: not completed past its deadline after boot, or completed with an
/// error status.
fn fabric(
    cfg: &LinksConfig,
    nvml: &Nvml,
    device: &Device<'_>,
    index: u32,
    r: &mut LinkReport,
    failed: &mut dyn FnMut(&str, &NvmlError),
) {
    match raw::fabric_info(nvml, device) {
        Ok(f) if f.state == raw::FABRIC_NOT_SUPPORTED => {}
        Ok(f) => {
            r.view.fabric_state = Some(fabric_name(f.state).into());
            r.view.fabric_status = f.status;
            r.view.clique_id = f.clique_id;
            r.view.cluster_uuid = f.cluster_uuid.iter().map(|b| format!("{b:02x}")).collect();
            if f.state != raw::FABRIC_COMPLETED {
                let up = uptime_secs(&cfg.uptime_file);
                let deadline = cfg.fabric_deadline.as_secs();
                match up {
                        Some(s) if s >= deadline => r.observations.push(
                            Observation::new(Signal::FabricNotCompleted)
                                .with_value(s)
                                .with_detail(format!(
                                    "NVLink fabric registration {} {s} s after boot (deadline {}): the GPU cannot run CUDA work",
                                    fabric_name(f.state),
                                    humantime::format_duration(cfg.fabric_deadline)
                                )),
                        ),
                        Some(s) => r.pending.push(format!(
                            "GPU {index}: NVLink fabric registration {} {s} s after boot (deadline {})",
                            fabric_name(f.state),
                            humantime::format_duration(cfg.fabric_deadline)
                        )),
                        None => r.pending.push(format!(
                            "GPU {index}: NVLink fabric registration {}; time since boot unknown ({})",
                            fabric_name(f.state),
                            cfg.uptime_file.display()
                        )),
                    }
            } else if f.status != 0 {
                r.observations.push(
                    Observation::new(Signal::FabricError)
                        .with_value(u64::from(f.status))
                        .with_detail(format!(
                            "NVLink fabric registration completed with error status {} (clique {})",
                            f.status, f.clique_id
                        )),
                );
            }
        }
        Err(e) => failed("fabric info", &e),
    }
}

/// NVLinks: which went down after being up, and the worst link's error rates.
fn nvlinks(
    cfg: &LinksConfig,
    device: &Device<'_>,
    track: &mut GpuTrack,
    now: Instant,
    r: &mut LinkReport,
    failed: &mut dyn FnMut(&str, &NvmlError),
) {
    let window = cfg.nvlink_window;
    let mut worst = [0u64; 3];
    for link in 0..MAX_NVLINKS {
        let l = device.link_wrapper_for(link);
        let active = match l.is_active() {
            Ok(a) => a,
            Err(NvmlError::InvalidArg) => break, // past the last link
            Err(e) => {
                if link == 0 {
                    failed("NVLink state", &e);
                }
                break;
            }
        };
        r.view.nvlinks += 1;
        let t = track.links.entry(link).or_default();
        if active {
            t.seen_up = true;
        } else if t.seen_up {
            r.view.nvlinks_down.push(link);
        }
        let read = |c: ErrorCounter| l.error_counter(c).ok();
        let crc = match (read(ErrorCounter::DlCrcFlit), read(ErrorCounter::DlCrcData)) {
            (Some(a), Some(b)) => Some(a.saturating_add(b)),
            (a, b) => a.or(b),
        };
        let replay = read(ErrorCounter::DlReplay);
        let recovery = read(ErrorCounter::DlRecovery);
        for (i, (value, rate)) in [
            (crc, &mut t.crc),
            (replay, &mut t.replay),
            (recovery, &mut t.recovery),
        ]
        .into_iter()
        .enumerate()
        {
            if let Some(v) = value {
                worst[i] = worst[i].max(rate.push(now, v, window));
            }
        }
    }
    [
        r.view.nvlink_crc_per_min,
        r.view.nvlink_replay_per_min,
        r.view.nvlink_recovery_per_min,
    ] = worst;
    if !r.view.nvlinks_down.is_empty() {
        r.observations.push(
            Observation::new(Signal::NvlinkDown)
                .with_value(r.view.nvlinks_down.len() as u64)
                .with_detail(format!(
                    "NVLink(s) {:?} down after being up ({} links)",
                    r.view.nvlinks_down, r.view.nvlinks
                )),
        );
    }
    let per = humantime::format_duration(window);
    for (signal, what, v) in [
        (Signal::NvlinkCrcErrors, "CRC (flit + data)", worst[0]),
        (Signal::NvlinkReplayErrors, "replay", worst[1]),
        (Signal::NvlinkRecoveryErrors, "recovery", worst[2]),
    ] {
        if v > 0 {
            r.observations
                .push(Observation::new(signal).with_value(v).with_detail(format!(
                    "NVLink {what} errors: {v} per minute over {per} (worst link)"
                )));
        }
    }
}

/// Clock event reasons: the full set for status; software thermal slowdown is a signal (the
/// hardware ones are the poller's hw-slowdown).
fn clock_reasons(
    nvml: &Nvml,
    device: &Device<'_>,
    r: &mut LinkReport,
    failed: &mut dyn FnMut(&str, &NvmlError),
) -> Option<u64> {
    let reasons = match raw::clock_event_reasons(nvml, device) {
        Ok(m) => Some(m),
        Err(e) => {
            failed("clock event reasons", &e);
            None
        }
    };
    if let Some(m) = reasons {
        r.view.clock_event_reasons = reason_names(m);
        if m & REASON_SW_THERMAL != 0 {
            r.observations.push(
                Observation::new(Signal::SwThermalSlowdown)
                    .with_value(m)
                    .with_detail(format!("clock event reasons {:?}", reason_names(m))),
            );
        }
    }
    reasons
}

/// PCIe: the link against its maximum (an idle GPU's lowered generation excepted), and replays.
fn pcie(
    cfg: &LinksConfig,
    device: &Device<'_>,
    track: &mut GpuTrack,
    now: Instant,
    reasons: Option<u64>,
    r: &mut LinkReport,
    failed: &mut dyn FnMut(&str, &NvmlError),
) {
    let pcie = [
        device.current_pcie_link_gen(),
        device.current_pcie_link_width(),
        device.max_pcie_link_gen(),
        device.max_pcie_link_width(),
    ];
    let mut got = [0u32; 4];
    let mut complete = true;
    for (i, v) in pcie.into_iter().enumerate() {
        match v {
            Ok(v) => got[i] = v,
            Err(e) => {
                complete = false;
                if i == 0 {
                    failed("PCIe link", &e);
                }
            }
        }
    }
    r.view.pcie = got;
    let [cur_gen, cur_w, max_gen, max_w] = got;
    // An idle GPU lowers its link generation to save power; its width stays.
    let idle = reasons.is_some_and(|m| m & REASON_GPU_IDLE != 0);
    if complete
        && max_w > 0
        && lane_rate(max_gen) > 0
        && (cur_w < max_w || (cur_gen < max_gen && !idle))
    {
        let now_bw = lane_rate(cur_gen) * u64::from(cur_w);
        let max_bw = lane_rate(max_gen) * u64::from(max_w);
        let pct = (now_bw * 100 / max_bw).min(100);
        r.observations.push(
                Observation::new(Signal::PcieDowntrained)
                    .with_value(pct)
                    .with_detail(format!(
                        "PCIe link Gen{cur_gen} x{cur_w}, maximum Gen{max_gen} x{max_w} ({pct}% of its bandwidth)"
                    )),
            );
    }
    match device.pcie_replay_counter() {
        Ok(n) => {
            let v = track.pcie_replay.push(now, u64::from(n), cfg.pcie_window);
            r.view.pcie_replays_per_min = v;
            if v > 0 {
                r.observations.push(
                    Observation::new(Signal::PcieReplays)
                        .with_value(v)
                        .with_detail(format!(
                            "PCIe replays: {v} per minute over {} (counter {n})",
                            humantime::format_duration(cfg.pcie_window)
                        )),
                );
            }
        }
        Err(e) => failed("PCIe replay counter", &e),
    }
}

/// Persistence mode, a signal when `[links] expect_persistence` and it is off.
fn persistence(
    cfg: &LinksConfig,
    device: &Device<'_>,
    r: &mut LinkReport,
    failed: &mut dyn FnMut(&str, &NvmlError),
) {
    match device.is_in_persistent_mode() {
        Ok(on) => {
            r.view.persistence = Some(on);
            if !on && cfg.expect_persistence {
                r.observations.push(
                    Observation::new(Signal::PersistenceOff)
                        .with_detail("persistence mode is off ([links] expect_persistence)"),
                );
            }
        }
        Err(e) => failed("persistence mode", &e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_counts_once_and_a_sustained_rate_is_seen() {
        let w = Duration::from_secs(60);
        let t0 = Instant::now();
        let mut r = Rate::default();
        assert_eq!(r.push(t0, 0, w), 0);
        assert_eq!(r.push(t0 + Duration::from_secs(1), 500, w), 500);
        assert_eq!(r.push(t0 + Duration::from_secs(30), 500, w), 500);
        assert_eq!(
            r.push(t0 + Duration::from_secs(62), 500, w),
            0,
            "out of the window"
        );
        let mut s = Rate::default();
        for i in 0..=60u64 {
            s.push(t0 + Duration::from_secs(i), i * 200, w);
        }
        assert_eq!(s.push(t0 + Duration::from_secs(61), 61 * 200, w), 12_000);
        assert_eq!(s.push(t0 + Duration::from_secs(62), 3, w), 0, "reset");
    }

    #[test]
    fn reasons_are_named_and_unknown_bits_kept() {
        assert_eq!(reason_names(0x1), ["gpu-idle"]);
        assert_eq!(
            reason_names(0x20 | 0x8 | 0x1000),
            ["hw-slowdown", "sw-thermal-slowdown", "0x1000"]
        );
    }

    #[test]
    fn uptime_is_the_first_number() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("uptime");
        std::fs::write(&p, "12345.67 99.0\n").unwrap();
        assert_eq!(uptime_secs(&p), Some(12345));
        std::fs::write(&p, "nan 1\n").unwrap();
        assert_eq!(uptime_secs(&p), None);
        assert_eq!(uptime_secs(&dir.path().join("missing")), None);
    }
}
