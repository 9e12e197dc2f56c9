//! The reboot rung's hands (docs/repair.md): the reboot, and the check after the boot.
//!
//! The reboot: EC2 `RebootInstances` on this instance (`[repair] reboot = "ec2"`; EC2
//! hard-reboots an OS that has not shut down within about four minutes) or the OS's own
//! reboot (`"systemd"`: `[repair] command`, `systemctl reboot`). The order carries the boot
//! id the engine saw when it gave it; a different boot id now means the reboot already
//! happened (gpu-medic stopped before it could say so), and nothing is rebooted again. An
//! unreadable boot id is a refusal: a reboot gpu-medic could not tell apart is never made.
//!
//! Before the call, the instance's tag `gpu-medic:reboots` is set from the state directory's
//! reboot ledger (the supervisor wrote it, with this reboot in it, before handing the order
//! out): the count of reboots then outlives a lost disk, as long as the instance keeps its
//! tags ([`read_tag`] gives it back at start; docs/repair.md). A tag that cannot be written
//! does not hold the reboot (the ledger on disk still counts it); the outcome says so.
//!
//! The check after the boot: the same checks as the launch gate (`gpu-medic check`),
//! handed in by the caller as a function, run every `[repair] check_interval` until the node
//! is healthy. Within `[repair] settle` of the first look a finding is looked at again (the
//! GPUs and the MPS daemon are still coming up); after it an unhealthy node fails the check;
//! "could not tell" waits until the order's deadline.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{AwsControlPlane, CallsExt};
use crate::aws::calls::Calls;
use crate::aws::ec2::Ec2;
use crate::config::{Config, RebootMethod};
use crate::model::{Command, Health, Order};
use crate::remedy::{BoxFuture, Done, RemedyError, RepairRemedy};

/// The check after the boot: the node's health and what was found, for the journal.
pub type BootCheck = Arc<dyn Fn() -> (Health, String) + Send + Sync>;

/// How long the OS's reboot command may take to accept the request.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

pub struct Rebooter {
    cfg: Config,
    ec2: Ec2,
    /// For this instance's id (its identity discovery).
    control_plane: Arc<AwsControlPlane>,
    check: BootCheck,
}

impl Rebooter {
    pub async fn from_config(
        cfg: &Config,
        control_plane: Arc<AwsControlPlane>,
        check: BootCheck,
    ) -> Self {
        let sdk = crate::aws::loader(&cfg.aws).load().await;
        Rebooter {
            cfg: cfg.clone(),
            ec2: Ec2::new(&sdk),
            control_plane,
            check,
        }
    }

    async fn do_reboot(&self, order: &Order) -> Result<Done, RemedyError> {
        let Command::Reboot { boot } = &order.command else {
            return Err(RemedyError::fatal("internal: not a reboot order"));
        };
        let now = crate::sys::limits::read_boot_id(&self.cfg.repair.boot_id_path).map_err(|e| {
            RemedyError::fatal(format!(
                "cannot read the kernel boot id ({e}): gpu-medic could not tell the boot after a reboot apart, so it does not reboot"
            ))
        })?;
        if !boot.is_empty() && &now != boot {
            return Ok(Done::new(format!(
                "the instance already rebooted (boot id {now}; the order was given in boot {boot}); not rebooting again"
            )));
        }
        match self.cfg.repair.reboot {
            RebootMethod::Off => Err(RemedyError::fatal(
                "the reboot rung is off ([repair] reboot = \"off\")",
            )),
            RebootMethod::Ec2 => {
                let id = self.control_plane.identity().await?;
                let mut calls = Calls::new();
                let tagged = self.tag(&mut calls, &id.instance_id).await;
                tracing::warn!(instance_id = %id.instance_id, incident_id = order.incident.0, "rebooting the instance (EC2 RebootInstances)");
                match self.ec2.reboot(&mut calls, &id.instance_id).await {
                    Ok(()) => Ok(calls.done(format!(
                        "RebootInstances accepted for {} (boot {now}): EC2 reboots it, hard after about four minutes if the OS does not shut down; {tagged}",
                        id.instance_id
                    ))),
                    Err(e) => Err(calls.fail(e)),
                }
            }
            RebootMethod::Systemd => {
                let argv = &self.cfg.repair.command;
                let Some((program, args)) = argv.split_first() else {
                    return Err(RemedyError::fatal("[repair] command is empty"));
                };
                let tagged = match self.control_plane.identity().await {
                    Ok(id) => self.tag(&mut Calls::new(), &id.instance_id).await,
                    Err(e) => format!("the reboot count is not in the instance's tags: {e}"),
                };
                tracing::warn!(command = %argv.join(" "), incident_id = order.incident.0, "rebooting the instance (the OS's reboot)");
                let mut cmd = tokio::process::Command::new(program);
                cmd.args(args);
                let shown = argv.join(" ");
                match crate::sys::child::output_within(
                    &mut cmd,
                    COMMAND_TIMEOUT,
                    crate::sys::child::AfterExit::KeepGroup,
                )
                .await
                {
                    Ok(out) if out.status.success() => Ok(Done::new(format!(
                        "`{shown}` accepted (boot {now}): the OS reboots; {tagged}"
                    ))),
                    Ok(out) => Err(RemedyError::fatal(format!(
                        "`{shown}` refused the reboot ({}): {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    ))),
                    Err(crate::sys::child::RunError::Spawn(e)) => Err(RemedyError::fatal(format!(
                        "`{shown}` could not be started: {e}"
                    ))),
                    Err(e) => Err(RemedyError::retryable(format!("`{shown}`: {e}"))),
                }
            }
        }
    }

    /// Sets the instance's reboots tag from the reboot ledger; says what was done, for the
    /// outcome (a failure is said, never a refusal of the reboot).
    async fn tag(&self, calls: &mut Calls, instance_id: &str) -> String {
        let history = match self.cfg.files().load_reboots() {
            Ok(Some(h)) => h,
            Ok(None) => return "no reboot ledger to copy into the instance's tags".into(),
            Err(e) => return format!("the reboot count is not in the instance's tags: {e}"),
        };
        let value = crate::model::repair::tag_value(&history);
        match self
            .ec2
            .tag(
                calls,
                instance_id,
                crate::model::repair::REBOOTS_TAG,
                &value,
            )
            .await
        {
            Ok(()) => format!(
                "the instance's tag {} now keeps its reboots",
                crate::model::repair::REBOOTS_TAG
            ),
            Err(e) => {
                tracing::warn!(
                    "cannot keep the reboot count in the instance's tags ({e}); the state directory's reboot ledger keeps it"
                );
                format!(
                    "the reboot count is not in the instance's tags ({e}); the state directory's reboot ledger keeps it"
                )
            }
        }
    }

    async fn do_boot_check(&self, order: &Order) -> Result<Done, RemedyError> {
        let r = &self.cfg.repair;
        let t0 = Instant::now();
        let left = order.deadline.since(self.control_plane.hands.now());
        // Answer a little before the deadline, so the engine hears the check, not its timer.
        let until = t0 + left.saturating_sub((left / 20).min(Duration::from_secs(5)));
        let mut looks = 0u32;
        loop {
            looks = looks.saturating_add(1);
            let check = self.check.clone();
            let (health, found) = tokio::task::spawn_blocking(move || (*check)())
                .await
                .unwrap_or_else(|e| (Health::Unknown, format!("the check panicked: {e}")));
            let waited = humantime::format_duration(Duration::from_secs(t0.elapsed().as_secs()));
            match health {
                Health::Healthy => {
                    return Ok(Done::new(format!(
                        "healthy after the boot ({looks} look(s), {waited}): {found}"
                    )));
                }
                Health::Unhealthy if t0.elapsed() >= r.settle => {
                    return Err(RemedyError::fatal(format!(
                        "unhealthy after the boot ({looks} look(s), {waited}): {found}"
                    )));
                }
                _ => {}
            }
            if Instant::now() + r.check_interval > until {
                return Err(RemedyError::fatal(format!(
                    "not healthy within the boot check's deadline ({looks} look(s), {waited}; last: {health}): {found}"
                )));
            }
            tracing::info!(
                health = health.as_str(),
                "after the boot: not healthy yet ({found}); looking again"
            );
            tokio::time::sleep(r.check_interval).await;
        }
    }
}

/// The reboots this instance's tag keeps (`gpu-medic:reboots`), read at start when the state
/// directory has no reboot ledger (a lost disk): `Ok(None)` when the instance has no such
/// tag; an error says why it could not be read (the caller logs it and goes on without).
/// Bounded by `within` (IMDS for the instance id, one DescribeTags).
pub async fn read_tag(
    cfg: &Config,
    within: Duration,
) -> Result<Option<Vec<crate::model::repair::Repair>>, String> {
    let read = async {
        let deadline = Instant::now() + within;
        let id =
            crate::aws::identity::instance_id(cfg, crate::aws::http_client(), deadline).await?;
        let sdk = crate::aws::loader(&cfg.aws).load().await;
        let value = Ec2::new(&sdk)
            .tag_value(&mut Calls::new(), &id, crate::model::repair::REBOOTS_TAG)
            .await
            .map_err(|e| e.to_string())?;
        Ok(value.map(|v| crate::model::repair::from_tag(&v)))
    };
    tokio::time::timeout(within, read)
        .await
        .map_err(|_| format!("no answer within {}", humantime::format_duration(within)))?
}

impl RepairRemedy for Rebooter {
    fn reboot(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.do_reboot(&order).await })
    }

    fn boot_check(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move { self.do_boot_check(&order).await })
    }
}
