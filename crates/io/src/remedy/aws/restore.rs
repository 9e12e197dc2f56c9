//! Restore (an operator abort): the container instance ACTIVE again, `<prefix>.health=ok`,
//! and the fleet budget's slot given back (a running drain sees ACTIVE and stops).

use super::Hands;
use crate::aws::calls::Calls;
use crate::aws::ecs::EcsStatus;
use crate::aws::identity::Identity;
use crate::model::Order;
use crate::remedy::budget::Here;
use crate::remedy::calls::CallsExt;
use crate::remedy::{Done, RemedyError};

pub(super) async fn run(h: &Hands, id: &Identity, order: Order) -> Result<Done, RemedyError> {
    let ecs = h.ecs_for(id);
    let mut calls = Calls::new();
    let arn = &id.container_instance_arn;
    let me = match ecs.describe_one(&mut calls, arn, false).await {
        Ok(m) => m,
        Err(e) => return Err(calls.fail(e)),
    };
    if me.status == EcsStatus::Draining
        && let Err(e) = ecs.set_active(&mut calls, arn).await
    {
        return Err(calls.fail(e));
    }
    let attr = h.health_attr();
    if let Err(e) = ecs.put_attribute(&mut calls, arn, &attr, Some("ok")).await {
        return Err(calls.fail(e));
    }
    let here = Here {
        id,
        ecs: &ecs,
        me: Some(&me),
    };
    let released = h.budget.release(&mut calls, here).await?;
    Ok(calls.done(format!(
        "{arn} was {}, now ACTIVE with {attr}=ok (incident {}); {} fleet-budget claim(s) released{}",
        me.status, order.incident, released.marks, released.note
    )))
}
