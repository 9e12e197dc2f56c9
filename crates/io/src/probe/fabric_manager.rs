//! NVIDIA Fabric Manager (`nvidia-fabricmanager.service`), on the instance types whose GPUs
//! talk through NVSwitches ([`crate::aws::instance_types::has_nvswitch`]): without it no GPU
//! finishes its fabric registration and no CUDA work can start (docs/fabric.md). Its unit is
//! read through the same `systemctl show` adapter as the MPS daemon's
//! ([`crate::sys::systemd`]).
//!
//! - not running (`active` with a main process): `fabric-manager-down` on every look, value
//!   the consecutive looks (the policy confirms on the second);
//! - systemd restarting it `[links] fabric_manager_flaps` times within
//!   `fabric_manager_flap_window`: `fabric-manager-flapping`;
//! - a `systemctl` that cannot run is gpu-medic's fault (`self-fault fabric-manager`), never
//!   Fabric Manager's.
//!
//! On other instance types, or when the type is unknown (`[links] instance_type` empty and
//! `[aws]` off), nothing is checked and nothing is reported about Fabric Manager.

use std::future::Future;
use std::pin::Pin;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{ProbeError, Snapshot, SnapshotReport, Source};
use crate::aws::instance_types;
use crate::config::Config;
use crate::model::{Observation, Signal};
use crate::sys::systemd::{RestartWindow, Systemctl, SystemctlError, UnitState};

/// The self-fault component of a `systemctl` that cannot be run for Fabric Manager.
pub const COMPONENT: &str = "fabric-manager";

/// The instance type `[links] instance_type` names, else IMDS's (with `[aws]` on).
pub async fn instance_type(cfg: &Config) -> Option<String> {
    let t = cfg.links.instance_type.trim();
    if !t.is_empty() {
        return Some(t.to_string());
    }
    if !cfg.aws.enabled {
        return None;
    }
    crate::aws::imds::instance_type(crate::aws::http_client())
        .await
        .ok()
        .flatten()
}

/// Whether Fabric Manager is expected on `instance_type`.
pub fn expected(cfg: &Config, instance_type: Option<&str>) -> bool {
    cfg.links.fabric_manager && instance_type.is_some_and(instance_types::has_nvswitch)
}

/// One look's verdict.
#[derive(Debug, PartialEq, Eq)]
enum Look {
    Running,
    Down(String),
}

fn judge(unit: &str, state: &UnitState) -> Look {
    if !state.exists() {
        return Look::Down(format!("{unit} is not installed ({})", state.load_state));
    }
    if state.running() {
        Look::Running
    } else {
        Look::Down(state.describe(unit))
    }
}

/// The continuous Fabric Manager watch for `gpu-medic run`.
pub struct FabricManagerSource {
    cfg: Config,
}

impl FabricManagerSource {
    pub fn new(cfg: Config) -> Self {
        FabricManagerSource { cfg }
    }
}

impl Source for FabricManagerSource {
    fn name(&self) -> &'static str {
        "fabric-manager"
    }

    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        _resume: crate::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            let itype = tokio::select! {
                _ = shutdown.cancelled() => return,
                t = instance_type(&self.cfg) => t,
            };
            if !expected(&self.cfg, itype.as_deref()) {
                tracing::debug!(
                    probe = "fabric-manager",
                    instance_type = itype.as_deref().unwrap_or("unknown"),
                    "no NVSwitch on this instance type: Fabric Manager is not checked"
                );
                return;
            }
            let links = &self.cfg.links;
            let sc = Systemctl::new(
                &links.systemctl,
                &links.fabric_manager_unit,
                std::time::Duration::from_secs(10),
            );
            let mut restarts = RestartWindow::new(links.fabric_manager_flap_window);
            let mut down = 0u64;
            let mut unrunnable = false;
            loop {
                let mut out = Vec::new();
                match sc.show().await {
                    Ok(state) => {
                        if std::mem::take(&mut unrunnable) {
                            out.push(
                                Observation::new(Signal::SelfRecovered {
                                    component: COMPONENT.into(),
                                })
                                .with_detail(format!("{} runs again", sc.binary().display())),
                            );
                        }
                        match judge(sc.unit(), &state) {
                            Look::Running => down = 0,
                            Look::Down(why) => {
                                down += 1;
                                out.push(
                                    Observation::new(Signal::FabricManagerDown)
                                        .with_value(down)
                                        .with_detail(format!(
                                            "Fabric Manager is not running: {why}"
                                        )),
                                );
                            }
                        }
                        let n = restarts.observe(state.n_restarts, std::time::Instant::now());
                        if n >= links.fabric_manager_flaps as usize {
                            restarts.clear();
                            out.push(
                                Observation::new(Signal::FabricManagerFlapping)
                                    .with_value(n as u64)
                                    .with_detail(format!(
                                        "systemd restarted Fabric Manager {n} times within {}: {}",
                                        humantime::format_duration(
                                            links.fabric_manager_flap_window
                                        ),
                                        state.describe(sc.unit())
                                    )),
                            );
                        }
                    }
                    // Unrunnable, or its answer unreadable: gpu-medic cannot see the unit,
                    // which says nothing about Fabric Manager (never a drain).
                    Err(e @ (SystemctlError::Spawn { .. } | SystemctlError::Unreadable { .. })) => {
                        if !std::mem::replace(&mut unrunnable, true) {
                            tracing::error!(
                                probe = "fabric-manager",
                                "{e}: Fabric Manager is not watched (self-fault)"
                            );
                            out.push(
                                Observation::new(Signal::SelfFault {
                                    component: COMPONENT.into(),
                                })
                                .with_detail(e.to_string()),
                            );
                        }
                    }
                    Err(e) => {
                        tracing::warn!(probe = "fabric-manager", "cannot read the unit: {e}");
                    }
                }
                for o in out {
                    if tx.send(o.from_source("fabric-manager")).await.is_err() {
                        return;
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(links.fabric_manager_interval) => {}
                }
            }
        })
    }
}

/// The one-shot look for `check`: Fabric Manager not running yet is "could not tell" (it may
/// still be starting at boot); a fabric that never registers without it fails the check
/// through `fabric-not-completed`.
pub struct FabricManagerSnapshot {
    cfg: Config,
}

impl FabricManagerSnapshot {
    pub fn new(cfg: Config) -> Self {
        FabricManagerSnapshot { cfg }
    }
}

impl Snapshot for FabricManagerSnapshot {
    fn name(&self) -> &'static str {
        "fabric-manager"
    }

    fn snapshot(&mut self) -> Result<SnapshotReport, ProbeError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ProbeError {
                probe: "fabric-manager",
                message: format!("cannot start a runtime: {e}"),
                retryable: true,
            })?;
        let cfg = &self.cfg;
        rt.block_on(async {
            let itype = instance_type(cfg).await;
            let mut report = SnapshotReport::default();
            if !expected(cfg, itype.as_deref()) {
                return Ok(report);
            }
            let sc = Systemctl::new(
                &cfg.links.systemctl,
                &cfg.links.fabric_manager_unit,
                std::time::Duration::from_secs(10),
            );
            match sc.show().await {
                Ok(state) => {
                    if let Look::Down(why) = judge(sc.unit(), &state) {
                        report
                            .problems
                            .push(format!("Fabric Manager is not running: {why}"));
                    }
                    Ok(report)
                }
                Err(e) => Err(ProbeError {
                    probe: "fabric-manager",
                    message: e.to_string(),
                    retryable: e.retryable(),
                }),
            }
        })
    }
}

/// Whether the snapshot probe applies (checked before the runtime is built).
pub fn snapshot_enabled(cfg: &Config) -> bool {
    let t = cfg.links.instance_type.trim();
    let possible = if t.is_empty() {
        cfg.aws.enabled
    } else {
        instance_types::has_nvswitch(t)
    };
    cfg.links.fabric_manager && possible
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_unit_that_is_missing_or_stopped_is_down() {
        let up =
            UnitState::parse("LoadState=loaded\nActiveState=active\nSubState=running\nMainPID=9\n");
        assert_eq!(judge("fm", &up), Look::Running);
        let stopped =
            UnitState::parse("LoadState=loaded\nActiveState=inactive\nSubState=dead\nMainPID=0\n");
        assert!(matches!(judge("fm", &stopped), Look::Down(_)));
        let missing = UnitState::parse("LoadState=not-found\nActiveState=inactive\n");
        assert!(matches!(judge("fm", &missing), Look::Down(w) if w.contains("not installed")));
    }

    #[test]
    fn only_nvswitch_types_expect_it() {
        let mut cfg = Config::parse(std::path::Path::new("/tmp/t.toml"), "").unwrap();
        assert!(expected(&cfg, Some("p5.48xlarge")));
        assert!(!expected(&cfg, Some("g6e.12xlarge")));
        assert!(!expected(&cfg, None));
        cfg.links.fabric_manager = false;
        assert!(!expected(&cfg, Some("p5.48xlarge")));
    }
}
