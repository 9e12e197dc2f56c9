//! The one EC2 fact the fleet budget's slot table needs: which instances are terminated;
//! and the one EC2 action the reboot rung takes: `RebootInstances` on this instance.
//!
//! `DescribeInstances` by id: state `terminated`, or the id unknown to EC2
//! (`InvalidInstanceID.NotFound`: a terminated instance stays visible for about an hour, then
//! is gone). Both never revert, and both hold only once the instance, and the gpu-medic on
//! it, can no longer act; `shutting-down` and `stopped` are not enough (a stopped instance
//! starts again with its gpu-medic). Absence from the Auto Scaling group's list is not this
//! fact either (a detached instance still runs).

use std::collections::BTreeSet;

use aws_sdk_ec2::Client;

use super::calls::{CallError, Calls};

#[derive(Debug, Clone)]
pub struct Ec2 {
    pub client: Client,
}

const NOT_FOUND: &str = "InvalidInstanceID.NotFound";

impl Ec2 {
    pub fn new(client: Client) -> Self {
        Ec2 { client }
    }

    /// Which of `ids` are terminated (or unknown to EC2). One call for all of them; when one
    /// id is unknown EC2 fails the whole call, so each id is then asked alone.
    pub async fn terminated(
        &self,
        calls: &mut Calls,
        ids: &[String],
    ) -> Result<BTreeSet<String>, CallError> {
        if ids.is_empty() {
            return Ok(BTreeSet::new());
        }
        match self.describe(calls, ids).await {
            Err(e) if e.code.as_deref() == Some(NOT_FOUND) => {
                let mut out = BTreeSet::new();
                for id in ids {
                    match self.describe(calls, std::slice::from_ref(id)).await {
                        Ok(t) => out.extend(t),
                        Err(e) if e.code.as_deref() == Some(NOT_FOUND) => {
                            out.insert(id.clone());
                        }
                        Err(e) => return Err(e),
                    }
                }
                Ok(out)
            }
            other => other,
        }
    }

    /// Asks EC2 to reboot `id` (the reboot rung reboots only its own instance). EC2 waits
    /// for the OS to shut down and hard-reboots it after about four minutes; the call returns
    /// at once. moto answers it without a state change.
    pub async fn reboot(&self, calls: &mut Calls, id: &str) -> Result<(), CallError> {
        let r = self.client.reboot_instances().instance_ids(id).send().await;
        calls.track("RebootInstances", r)?;
        Ok(())
    }

    async fn describe(
        &self,
        calls: &mut Calls,
        ids: &[String],
    ) -> Result<BTreeSet<String>, CallError> {
        let r = self
            .client
            .describe_instances()
            .set_instance_ids(Some(ids.to_vec()))
            .send()
            .await;
        let r = calls.track("DescribeInstances", r)?;
        Ok(r.reservations()
            .iter()
            .flat_map(|res| res.instances())
            .filter(|i| {
                i.state()
                    .and_then(|s| s.name())
                    .is_some_and(|n| n.as_str() == "terminated")
            })
            .filter_map(|i| i.instance_id().map(str::to_string))
            .collect())
    }
}
