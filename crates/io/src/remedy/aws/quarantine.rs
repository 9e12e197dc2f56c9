//! Quarantine: `<prefix>.health=faulted` on the container instance, so task placements with
//! `memberOf "attribute:<prefix>.health != faulted"` keep new tasks off it. One call.

use super::Hands;
use crate::aws::calls::Calls;
use crate::aws::identity::Identity;
use crate::model::Order;
use crate::remedy::calls::CallsExt;
use crate::remedy::{Done, RemedyError};

pub(super) async fn run(h: &Hands, id: &Identity, order: Order) -> Result<Done, RemedyError> {
    let ecs = h.ecs_for(id);
    let mut calls = Calls::new();
    let attr = h.health_attr();
    match ecs
        .put_attribute(&mut calls, &id.container_instance_arn, &attr, Some("faulted"))
        .await
    {
        Ok(()) => Ok(calls.done(format!(
            "{attr}=faulted on {} (incident {}): placements with memberOf \"attribute:{attr} != faulted\" avoid it",
            id.container_instance_arn, order.incident
        ))),
        Err(e) => Err(calls.fail(e)),
    }
}
