//! The claim protocol (no `[fleet] table`): an instance that may take a slot writes a claim
//! attribute `<prefix>.claim.<unix ms>` on its container instance, waits `claim_settle` for
//! the others' claims to become visible, re-reads the group and goes ahead only when its
//! claim ranks within the budget (the rules: `group_view.rs` `admit`, `rank`, `holds_slot`,
//! `claim_fresh`; the spin model: models/fleet/claims.pml). A claim is released by removing
//! the attribute (restore).

use super::group_view::claim_fresh;
use super::{Common, FirstReads, FleetBudget, Here, Released, Slot};
use crate::aws::calls::Calls;
use crate::aws::ecs::{EcsStatus, InstanceState};
use crate::model::Order;
use crate::remedy::calls::CallsExt;
use crate::remedy::{BoxFuture, RemedyError};

/// The claim protocol.
pub struct ClaimBudget {
    c: Common,
}

impl ClaimBudget {
    pub(crate) fn new(c: Common) -> Self {
        ClaimBudget { c }
    }

    async fn acquire_claim(
        &self,
        calls: &mut Calls,
        here: Here<'_>,
        first: FirstReads,
    ) -> Result<Slot, RemedyError> {
        let fleet = &self.c.cfg.fleet;
        let id = here.id;
        let me = id.instance_id.as_str();
        calls.entries.extend(first.calls.entries);
        let read = async {
            let group = first.group.transpose()?;
            let arns = first.arns.unwrap_or_else(|| Ok(Vec::new()))?;
            self.c.view(calls, here, group, arns).await
        };
        let (view, states) = match read.await {
            Ok(v) => v,
            Err(e) => return Err(std::mem::take(calls).fail(e)),
        };
        let now = self.c.clock.now_ms();
        self.c.record_fleet(&view.summary(now, fleet));
        if let Some(d) = view.kill_switch() {
            return Err(self.c.defer(d.to_string()));
        }
        let mine = match own(&states, &id.container_instance_arn) {
            Some(m) => m,
            None => here
                .ecs
                .describe_one(calls, &id.container_instance_arn, true)
                .await
                .map_err(|e| std::mem::take(calls).fail(e))?,
        };
        let own_claim = mine.claim(self.c.prefix());
        if view.holds_slot(me, now, fleet) {
            match &own_claim {
                Some((name, ms)) if mine.status == EcsStatus::Active => {
                    let (name, ms) = (name.clone(), *ms);
                    // A claim from before a restart. Not yet acted on: settle again and rank
                    // it anew (others may not have seen it yet), unless it is too old to
                    // finish, in which case it is withdrawn and made anew below.
                    if claim_fresh(ms, now, fleet) {
                        return self.settle_and_rank(calls, here, &name, ms).await;
                    }
                    tracing::info!(instance_id = me, claim = %name, "fleet budget: our claim from before a restart is too old to finish; claiming anew");
                }
                Some((_, ms)) => return Ok(Slot::Claim(*ms)),
                None => return Ok(Slot::None),
            }
        }
        if let Some((name, _)) = own_claim {
            // Expired or too old: it no longer counts; remove it before claiming anew.
            let _ = here
                .ecs
                .delete_attribute(calls, &id.container_instance_arn, &name)
                .await;
        }
        if let Err(d) = view.admit(me, now, fleet) {
            return Err(self.c.defer(d.to_string()));
        }
        let claim_ms = self.c.clock.now_ms();
        let claim = format!("{}.claim.{claim_ms}", self.c.prefix());
        if let Err(e) = here
            .ecs
            .put_attribute(calls, &id.container_instance_arn, &claim, None)
            .await
        {
            return Err(std::mem::take(calls).fail(e));
        }
        self.settle_and_rank(calls, here, &claim, claim_ms).await
    }

    /// Waits `claim_settle` for our claim to become visible, re-reads the group and ranks the
    /// claim; withdraws it when outranked, or when it is too old to finish by the time the
    /// ranking is done (checked just before acting). The caller acts at once.
    async fn settle_and_rank(
        &self,
        calls: &mut Calls,
        here: Here<'_>,
        claim: &str,
        claim_ms: u64,
    ) -> Result<Slot, RemedyError> {
        let fleet = &self.c.cfg.fleet;
        let id = here.id;
        let me = id.instance_id.as_str();
        tokio::time::sleep(fleet.claim_settle).await;
        // Everything is read again, our own container instance included (its claim).
        let again = Here { me: None, ..here };
        let first = self.c.group_and_arns(id, here.ecs).await;
        calls.entries.extend(first.calls.entries);
        let read = async {
            let group = first.group.transpose()?;
            let arns = first.arns.unwrap_or_else(|| Ok(Vec::new()))?;
            self.c.view(calls, again, group, arns).await
        };
        let view = match read.await {
            Ok((v, _)) => v,
            Err(e) => return Err(std::mem::take(calls).fail(e)),
        };
        let now = self.c.clock.now_ms();
        // The read with our claim in it: what the outcome reports as the budget in use.
        self.c.record_fleet(&view.summary(now, fleet));
        let verdict = view
            .rank(me, claim_ms, now, fleet)
            .map_err(|d| d.to_string())
            .and_then(|()| {
                claim_fresh(claim_ms, now, fleet).then_some(()).ok_or_else(|| {
                    format!("our claim {claim} is too old to act on safely (the settle and re-read took too long); withdrawn, claiming anew")
                })
            });
        if let Err(why) = verdict {
            let _ = here
                .ecs
                .delete_attribute(calls, &id.container_instance_arn, claim)
                .await;
            return Err(self.c.defer(why));
        }
        tracing::info!(instance_id = me, claim = %claim, "fleet budget: slot taken");
        Ok(Slot::Claim(claim_ms))
    }
}

/// Our own container instance among those described.
fn own(states: &[InstanceState], arn: &str) -> Option<InstanceState> {
    states.iter().find(|s| s.arn == arn).cloned()
}

impl FleetBudget for ClaimBudget {
    fn take_view(&self) -> Option<crate::model::FleetBudgetView> {
        self.c.take_view()
    }

    fn first_reads<'a>(
        &'a self,
        id: &'a crate::aws::identity::Identity,
        ecs: &'a crate::aws::ecs::Ecs,
    ) -> BoxFuture<'a, FirstReads> {
        Box::pin(self.c.group_and_arns(id, ecs))
    }

    fn acquire<'a>(
        &'a self,
        calls: &'a mut Calls,
        here: Here<'a>,
        first: FirstReads,
        _order: &'a Order,
    ) -> BoxFuture<'a, Result<Slot, RemedyError>> {
        Box::pin(async move {
            let slot = self.acquire_claim(calls, here, first).await;
            self.c.settled(&slot);
            slot
        })
    }

    fn note<'a>(
        &'a self,
        _calls: &'a mut Calls,
        _here: Here<'a>,
        _slot: &'a Slot,
    ) -> BoxFuture<'a, String> {
        // The claim attribute is the mark.
        Box::pin(async { String::new() })
    }

    fn release<'a>(
        &'a self,
        calls: &'a mut Calls,
        here: Here<'a>,
    ) -> BoxFuture<'a, Result<Released, RemedyError>> {
        Box::pin(async move {
            match self.c.clear_marks(calls, here).await {
                Ok(marks) => Ok(Released {
                    marks,
                    note: String::new(),
                }),
                Err(e) => Err(std::mem::take(calls).fail(e)),
            }
        })
    }
}
