//! NVIDIA Fabric Manager (`nvidia-fabricmanager.service`), on the instance types whose GPUs
//! talk through NVSwitches ([`crate::aws::instance_types::has_nvswitch`]): without it no GPU
//! finishes its fabric registration and no CUDA work can start (docs/fabric.md). Its unit is
//! read through the same `systemctl show` adapter as the MPS daemon's
//! ([`crate::sys::systemd`]).
//!
//! Its state is one of three, read only from systemd's own words ([`Activity`]):
//! - running: `active` with a main process;
//! - stopped: `inactive` or `failed`, or a unit that cannot run (`not-found`, `masked`, ...):
//!   `fabric-manager-down` on every look, value the consecutive looks (the policy confirms on
//!   the second);
//! - could not tell: `systemctl` that cannot run, fails, hangs or answers what is not
//!   systemd's words (garbage, `active` with no process): gpu-medic's own fault
//!   (`self-fault fabric-manager`, its detail naming what was read), never Fabric Manager's,
//!   never a drain; recovered by the next readable answer.
//!
//! systemd starting or stopping it (`activating`, `deactivating`) is none of them: not judged
//! on that look (a start that hangs ends `failed` at the unit's timeout). systemd restarting
//! it `[links] fabric_manager_flaps` times within `fabric_manager_flap_window`:
//! `fabric-manager-flapping`.
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
use crate::sys::systemd::{Activity, RestartWindow, Systemctl, SystemctlError, UnitState};

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
    /// systemd is starting or stopping it: not judged on this look.
    Changing(String),
    /// What could not be read, for the self-fault.
    CouldNotTell(String),
}

fn judge(unit: &str, state: &UnitState) -> Look {
    match state.activity(unit) {
        Activity::Running => Look::Running,
        Activity::Stopped(why) => Look::Down(why),
        Activity::Changing(why) => Look::Changing(why),
        Activity::Unknown(why) => Look::CouldNotTell(why),
    }
}

/// What the watch remembers between looks, and what each look reports.
struct Watch {
    restarts: RestartWindow,
    /// Consecutive looks that found it stopped.
    down: u64,
    /// Since when gpu-medic could not tell (a self-fault is open).
    blind: bool,
    flaps: u32,
    flap_window: std::time::Duration,
}

impl Watch {
    fn new(flaps: u32, flap_window: std::time::Duration) -> Watch {
        Watch {
            restarts: RestartWindow::new(flap_window),
            down: 0,
            blind: false,
            flaps,
            flap_window,
        }
    }

    /// The observations of one look: `show` is `systemctl show`'s answer, `binary` and `unit`
    /// name what was asked.
    fn look(
        &mut self,
        show: Result<UnitState, SystemctlError>,
        unit: &str,
        now: std::time::Instant,
    ) -> Vec<Observation> {
        let mut out = Vec::new();
        let look = match &show {
            Ok(state) => judge(unit, state),
            Err(e) => Look::CouldNotTell(e.to_string()),
        };
        if let Look::CouldNotTell(why) = &look {
            if !std::mem::replace(&mut self.blind, true) {
                tracing::error!(
                    probe = "fabric-manager",
                    "could not tell whether Fabric Manager runs ({why}): not watched until systemctl answers in systemd's words (self-fault)"
                );
                out.push(
                    Observation::new(Signal::SelfFault {
                        component: COMPONENT.into(),
                    })
                    .with_detail(format!("could not tell whether Fabric Manager runs: {why}")),
                );
            }
            return out;
        }
        if std::mem::take(&mut self.blind) {
            out.push(
                Observation::new(Signal::SelfRecovered {
                    component: COMPONENT.into(),
                })
                .with_detail(format!("systemctl answers again for {unit}")),
            );
        }
        match look {
            Look::Running => self.down = 0,
            Look::Down(why) => {
                self.down += 1;
                out.push(
                    Observation::new(Signal::FabricManagerDown)
                        .with_value(self.down)
                        .with_detail(format!("Fabric Manager is not running: {why}")),
                );
            }
            Look::Changing(why) => {
                tracing::debug!(probe = "fabric-manager", "not judged this look: {why}");
            }
            Look::CouldNotTell(_) => {}
        }
        if let Ok(state) = &show {
            let n = self.restarts.observe(state.n_restarts, now);
            if n >= self.flaps as usize {
                self.restarts.clear();
                out.push(
                    Observation::new(Signal::FabricManagerFlapping)
                        .with_value(n as u64)
                        .with_detail(format!(
                            "systemd restarted Fabric Manager {n} times within {}: {}",
                            humantime::format_duration(self.flap_window),
                            state.describe(unit)
                        )),
                );
            }
        }
        out
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
            let mut watch =
                Watch::new(links.fabric_manager_flaps, links.fabric_manager_flap_window);
            loop {
                let out = watch.look(sc.show().await, sc.unit(), std::time::Instant::now());
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
            let state = sc.show().await.map_err(|e| ProbeError {
                probe: "fabric-manager",
                message: format!("could not tell whether Fabric Manager runs: {e}"),
                retryable: e.retryable(),
            })?;
            match judge(sc.unit(), &state) {
                Look::Down(why) => {
                    report
                        .problems
                        .push(format!("Fabric Manager is not running: {why}"));
                    Ok(report)
                }
                Look::Running => Ok(report),
                // Starting (at boot), or not systemd's words: not a verdict on the node.
                Look::Changing(why) | Look::CouldNotTell(why) => Err(ProbeError {
                    probe: "fabric-manager",
                    message: format!("could not tell whether Fabric Manager runs: {why}"),
                    retryable: true,
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

    /// Garbage, a failing systemctl and a word systemd has not are one self-fault (its detail
    /// naming what was read), never `fabric-manager-down`; a readable answer recovers it;
    /// starting is not judged, and does not reset the count of stopped looks.
    #[test]
    fn what_cannot_be_told_is_a_self_fault_never_down() {
        let t0 = std::time::Instant::now();
        let mut w = Watch::new(3, std::time::Duration::from_secs(600));
        let kinds = |o: &[Observation]| o.iter().map(|o| o.signal.to_string()).collect::<Vec<_>>();
        let word = |a: &str| {
            UnitState::parse(&format!(
                "LoadState=loaded\nActiveState={a}\nSubState=x\nMainPID=0\n"
            ))
        };
        let out = w.look(Ok(word("banana")), "fm", t0);
        assert_eq!(kinds(&out), ["self-fault fabric-manager"]);
        assert!(
            out[0]
                .detail
                .as_deref()
                .unwrap()
                .contains("ActiveState=banana")
        );
        let failed = Err(SystemctlError::Failed {
            binary: "systemctl".into(),
            args: "show".into(),
            status: "exit status: 1".into(),
            output: "Failed to connect to bus".into(),
        });
        assert!(w.look(failed, "fm", t0).is_empty(), "said once");
        let out = w.look(Ok(word("inactive")), "fm", t0);
        assert_eq!(
            kinds(&out),
            ["self-recovered fabric-manager", "fabric-manager-down"]
        );
        assert!(w.look(Ok(word("activating")), "fm", t0).is_empty());
        let out = w.look(Ok(word("failed")), "fm", t0);
        assert_eq!(out[0].value, 2, "the second look that found it stopped");
    }

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
