//! Replace: the instance marked Unhealthy in Auto Scaling (grace period skipped), which
//! replaces it without touching desired capacity, behind the fleet budget's slot and the
//! kill switches; with `[aws] replace_fallback_terminate`, terminated through Auto Scaling
//! (capacity kept) when it has not begun replacing it in time.

use std::time::Duration;

use super::Hands;
use crate::aws::calls::Calls;
use crate::aws::identity::Identity;
use crate::model::Order;
use crate::remedy::budget::{Here, Slot};
use crate::remedy::calls::CallsExt;
use crate::remedy::{Done, RemedyError};

pub(super) async fn run(h: &Hands, id: &Identity, order: Order) -> Result<Done, RemedyError> {
    let Some(group) = id.auto_scaling_group.clone() else {
        return Err(RemedyError::fatal(format!(
            "{} is in no Auto Scaling group: nothing can replace it",
            id.instance_id
        )));
    };
    let ecs = h.ecs_for(id);
    let mut calls = Calls::new();
    let me = match h.asg.instance(&mut calls, &id.instance_id).await {
        Ok(Some((_, i))) => i,
        Ok(None) => {
            return Ok(calls.done(format!(
                "{} is no longer in {group}; nothing to replace",
                id.instance_id
            )));
        }
        Err(e) => return Err(calls.fail(e)),
    };
    let already = me.health.as_deref() == Some("Unhealthy");
    let mut flushed = String::new();
    if already {
        tracing::info!(instance_id = %id.instance_id, "already Unhealthy in Auto Scaling; not marking again");
    } else {
        // Kill switches and, for an instance that holds no slot yet, the budget; none for
        // an AWS-planned disruption (AWS stops the instance anyway).
        let here = Here {
            id,
            ecs: &ecs,
            me: None,
        };
        let slot = if order.planned {
            Slot::None
        } else {
            let first = h.budget.first_reads(id, &ecs).await;
            h.budget.acquire(&mut calls, here, first, &order).await?
        };
        flushed = h.budget.note(&mut calls, here, &slot).await;
        flushed.push_str(&h.flush_export("marking it Unhealthy").await);
        if let Err(e) = h.asg.set_unhealthy(&mut calls, &id.instance_id).await {
            return Err(calls.fail(e));
        }
        tracing::warn!(instance_id = %id.instance_id, auto_scaling_group = %group, incident_id = order.incident.0, "instance marked Unhealthy");
    }
    let mut detail = format!(
        "{}{} marked Unhealthy in {group} (grace period skipped); Auto Scaling replaces it, desired capacity unchanged",
        if already { "already " } else { "" },
        id.instance_id
    );
    detail.push_str(&flushed);
    if h.cfg.aws.replace_fallback_terminate {
        detail = fallback_terminate(h, &mut calls, &order, id, detail).await?;
    }
    Ok(calls.done(detail))
}

/// The flagged fallback: if Auto Scaling has not started terminating the instance within
/// `replace_fallback_after` (bounded by the deadline), terminate it, keeping capacity.
async fn fallback_terminate(
    h: &Hands,
    calls: &mut Calls,
    order: &Order,
    id: &Identity,
    detail: String,
) -> Result<String, RemedyError> {
    let remaining = order.deadline.since(h.now());
    let margin = (remaining / 10).min(Duration::from_secs(5));
    let wait = h
        .cfg
        .aws
        .replace_fallback_after
        .min(remaining.saturating_sub(margin));
    let until = h.clock.instant() + wait;
    loop {
        match h.asg.instance(calls, &id.instance_id).await {
            Ok(None) => return Ok(format!("{detail}; it has left the group")),
            Ok(Some((_, i)))
                if i.lifecycle
                    .as_deref()
                    .is_some_and(|l| l.starts_with("Terminat")) =>
            {
                return Ok(format!("{detail}; Auto Scaling is terminating it"));
            }
            Ok(Some(_)) => {}
            Err(e) if e.retryable => {}
            Err(e) => return Err(std::mem::take(calls).fail(e)),
        }
        if h.clock.instant() >= until {
            break;
        }
        let next = (h.clock.instant() + h.cfg.ecs.drain_poll_interval).min(until);
        tokio::time::sleep_until(next).await;
    }
    match h.asg.terminate_keep_capacity(calls, &id.instance_id).await {
        Ok(()) => Ok(format!(
            "{detail}; not replaced within {}, so terminated through Auto Scaling (replace_fallback_terminate, desired capacity kept)",
            humantime::format_duration(wait)
        )),
        Err(e) => Err(std::mem::take(calls).fail(e)),
    }
}
