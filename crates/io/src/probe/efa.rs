//! EFA / RDMA ports from sysfs (docs/fabric.md#efa): every `<root>/<device>/ports/<n>/state`
//! (`[links] infiniband_root`, `/sys/class/infiniband` by default; the Linux RDMA core writes
//! `4: ACTIVE`, `1: DOWN`, ...), and the error counters in `ports/<n>/hw_counters` and
//! `ports/<n>/counters`. A port that is not ACTIVE is `efa-port-down` on every look; state
//! changes within `[links] efa_flap_window` are `efa-port-flapping`; error counters become a
//! rate per minute over `[links] efa_window` (`efa-errors`). An instance without such devices
//! has nothing to watch and reports nothing. Every read is bounded: at most [`MAX_DEVICES`]
//! devices, [`MAX_PORTS`] ports each, [`MAX_COUNTERS`] counters per port, 64 bytes per file.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Instant;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{ProbeError, Snapshot, SnapshotReport, Source};
use crate::config::LinksConfig;
use crate::model::{Observation, Signal};

pub const MAX_DEVICES: usize = 64;
pub const MAX_PORTS: usize = 16;
pub const MAX_COUNTERS: usize = 256;
const MAX_FILE: u64 = 64;

pub use crate::model::links::Port;

/// Whether a counter counts errors (EFA's `*_err`, `*_drops`, `lifespan`-free names; the IB
/// core's `symbol_error`, `link_downed`, `*_errors`, `*_discards`, `link_error_recovery`).
pub fn is_error_counter(name: &str) -> bool {
    let n = name.to_ascii_lowercase();
    n.contains("err") || n.contains("drop") || n.contains("discard") || n == "link_downed"
}

fn small(path: &Path) -> Option<String> {
    crate::sys::limits::read_pseudo(path, MAX_FILE, "sysfs").ok()
}

fn sorted_dirs(dir: &Path, cap: usize) -> Vec<(String, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, PathBuf)> = rd
        .flatten()
        .take(cap * 4)
        .filter_map(|e| Some((e.file_name().into_string().ok()?, e.path())))
        .collect();
    out.sort();
    out.truncate(cap);
    out
}

/// Every port under `root` now.
pub fn read_ports(root: &Path) -> Vec<Port> {
    let mut out = Vec::new();
    for (device, dpath) in sorted_dirs(root, MAX_DEVICES) {
        for (port, ppath) in sorted_dirs(&dpath.join("ports"), MAX_PORTS) {
            let Some(raw) = small(&ppath.join("state")) else {
                continue;
            };
            let state = raw
                .trim()
                .split_once(':')
                .map_or(raw.trim(), |(_, n)| n.trim())
                .to_string();
            let mut errors = BTreeMap::new();
            for sub in ["hw_counters", "counters"] {
                for (name, cpath) in sorted_dirs(&ppath.join(sub), MAX_COUNTERS) {
                    if !is_error_counter(&name) || errors.len() >= MAX_COUNTERS {
                        continue;
                    }
                    if let Some(v) = small(&cpath).and_then(|t| t.trim().parse::<u64>().ok()) {
                        errors.insert(format!("{sub}/{name}"), v);
                    }
                }
            }
            out.push(Port {
                device: device.clone(),
                port,
                state,
                errors,
            });
        }
    }
    out
}

#[derive(Debug, Default)]
struct PortTrack {
    last_state: Option<String>,
    changes: VecDeque<Instant>,
    /// (when, sum of the error counters).
    errors: VecDeque<(Instant, u64)>,
}

/// The watch's memory between looks.
#[derive(Debug)]
pub struct PortWatch {
    cfg: LinksConfig,
    ports: BTreeMap<(String, String), PortTrack>,
}

impl PortWatch {
    pub fn new(cfg: LinksConfig) -> Self {
        PortWatch {
            cfg,
            ports: BTreeMap::new(),
        }
    }

    /// One look: the ports and what they say.
    pub fn look(&mut self, now: Instant) -> (Vec<Port>, Vec<Observation>) {
        let ports = read_ports(&self.cfg.infiniband_root);
        let mut out = Vec::new();
        let mut down = Vec::new();
        let (mut flaps, mut flapper) = (0usize, String::new());
        let (mut rate, mut worst) = (0u64, String::new());
        for p in &ports {
            let name = format!("{}/{}", p.device, p.port);
            if p.state != "ACTIVE" {
                down.push(format!("{name} {}", p.state));
            }
            let t = self
                .ports
                .entry((p.device.clone(), p.port.clone()))
                .or_default();
            if t.last_state.as_ref().is_some_and(|s| *s != p.state) {
                t.changes.push_back(now);
            }
            t.last_state = Some(p.state.clone());
            let fw = self.cfg.efa_flap_window;
            t.changes.retain(|c| now.duration_since(*c) < fw);
            if t.changes.len() > flaps {
                (flaps, flapper) = (t.changes.len(), name.clone());
            }
            let sum: u64 = p.errors.values().fold(0u64, |a, v| a.saturating_add(*v));
            if t.errors.back().is_some_and(|(_, v)| sum < *v) {
                t.errors.clear();
            }
            let w = self.cfg.efa_window;
            while t
                .errors
                .front()
                .is_some_and(|(at, _)| now.duration_since(*at) > w)
            {
                t.errors.pop_front();
            }
            if t.errors.len() >= 1024 {
                t.errors.pop_front();
            }
            t.errors.push_back((now, sum));
            let first = t.errors.front().map_or(sum, |(_, v)| *v);
            let per_min =
                (sum.saturating_sub(first) as f64 * 60.0 / w.as_secs_f64().max(1.0)).round() as u64;
            if per_min > rate {
                (rate, worst) = (per_min, name.clone());
            }
        }
        if !down.is_empty() {
            out.push(
                Observation::new(Signal::EfaPortDown)
                    .with_value(down.len() as u64)
                    .with_detail(format!("RDMA port(s) not ACTIVE: {}", down.join(", "))),
            );
        }
        if flaps > 0 {
            out.push(
                Observation::new(Signal::EfaPortFlapping)
                    .with_value(flaps as u64)
                    .with_detail(format!(
                        "RDMA port {flapper} changed state {flaps} times within {}",
                        humantime::format_duration(self.cfg.efa_flap_window)
                    )),
            );
        }
        if rate > 0 {
            out.push(
                Observation::new(Signal::EfaErrors)
                    .with_value(rate)
                    .with_detail(format!(
                        "RDMA port {worst}: {rate} errors per minute over {}",
                        humantime::format_duration(self.cfg.efa_window)
                    )),
            );
        }
        (ports, out)
    }
}

/// The continuous port watch for `gpu-medic run`.
pub struct EfaSource {
    pub cfg: LinksConfig,
    pub state_dir: PathBuf,
}

impl Source for EfaSource {
    fn name(&self) -> &'static str {
        "efa"
    }

    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        _resume: crate::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let mut watch = PortWatch::new(self.cfg.clone());
            let mut had_ports = false;
            loop {
                let (w, (ports, out)) = match tokio::task::spawn_blocking(move || {
                    let r = watch.look(Instant::now());
                    (watch, r)
                })
                .await
                {
                    Ok(v) => v,
                    Err(e) => {
                        tracing::error!(probe = "efa", "port look failed: {e}");
                        return;
                    }
                };
                watch = w;
                if !ports.is_empty() || had_ports {
                    had_ports = true;
                    crate::config::StateDir::new(&self.state_dir)
                        .save_view(crate::config::View::Ports, &ports);
                }
                for o in out {
                    if tx.send(o.from_source("efa")).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(self.cfg.efa_interval) => {}
                }
            }
        })
    }
}

/// The one-shot look for `check`.
pub struct EfaSnapshot {
    pub cfg: LinksConfig,
}

impl Snapshot for EfaSnapshot {
    fn name(&self) -> &'static str {
        "efa"
    }

    fn snapshot(&mut self) -> Result<SnapshotReport, ProbeError> {
        let (_, observations) = PortWatch::new(self.cfg.clone()).look(Instant::now());
        Ok(SnapshotReport {
            observations: observations
                .into_iter()
                .filter(|o| o.signal == Signal::EfaPortDown)
                .map(|o| o.from_source("efa"))
                .collect(),
            ..SnapshotReport::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn port(root: &Path, dev: &str, n: &str, state: &str, errs: &[(&str, u64)]) {
        let p = root.join(dev).join("ports").join(n);
        std::fs::create_dir_all(p.join("hw_counters")).unwrap();
        std::fs::write(p.join("state"), format!("{state}\n")).unwrap();
        for (k, v) in errs {
            std::fs::write(p.join("hw_counters").join(k), format!("{v}\n")).unwrap();
        }
    }

    #[test]
    fn down_flapping_and_error_rates() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        port(
            root,
            "rdmap16s27",
            "1",
            "4: ACTIVE",
            &[("rdma_read_wr_err", 0), ("tx_bytes", 9)],
        );
        let cfg = LinksConfig {
            infiniband_root: root.to_path_buf(),
            ..LinksConfig::default()
        };
        let mut w = PortWatch::new(cfg);
        let t0 = Instant::now();
        let (ports, obs) = w.look(t0);
        assert_eq!(ports.len(), 1);
        assert_eq!(ports[0].errors.len(), 1, "tx_bytes is no error counter");
        assert!(obs.is_empty(), "{obs:?}");
        port(
            root,
            "rdmap16s27",
            "1",
            "1: DOWN",
            &[("rdma_read_wr_err", 30)],
        );
        let (_, obs) = w.look(t0 + Duration::from_secs(1));
        let kinds: Vec<_> = obs.iter().map(|o| o.signal.kind().as_str()).collect();
        assert_eq!(kinds, ["efa-port-down", "efa-port-flapping", "efa-errors"]);
        assert_eq!(obs[2].value, 30);
        assert!(read_ports(&root.join("missing")).is_empty());
    }
}
