//! `incidents list|show --fleet`: the incidents of every instance of a cluster, read from
//! CloudWatch Logs ([`crate::export::fleet_incidents`]), printed like the local commands.

use serde::Serialize;

use super::{CliError, ConfigArg};
use crate::aws::logs::Logs;
use crate::export::fleet_incidents::{FleetQuery, FleetView};
use crate::model::{Incident, Timestamp};

/// `show --fleet --json`: the incident and its instance.
#[derive(Debug, Serialize)]
pub struct Shown<'a> {
    pub instance_id: &'a str,
    #[serde(flatten)]
    pub incident: &'a Incident,
}

/// The cluster whose log group is read: `--cluster`, else `[identity] cluster`, else the ECS
/// agent (one try) or its config file.
async fn cluster(cfg: &crate::config::Config, given: Option<&str>) -> String {
    if let Some(c) = given.or(cfg.identity.cluster.as_deref()) {
        return c.to_string();
    }
    match crate::aws::identity::agent_metadata(&cfg.ecs.agent_url).await {
        Ok(m) if m.cluster.is_some() => m.cluster.unwrap_or_default(),
        _ => crate::aws::identity::cluster_from_ecs_config(&cfg.ecs.ecs_config_file),
    }
}

/// Reads the fleet view: one incident (`only`: instance and id) or every incident since
/// `since`. Warns on stderr when the read was capped or met foreign events.
pub fn read(
    config: &ConfigArg,
    cluster_arg: Option<&str>,
    only: Option<(&str, u64)>,
    since: Option<Timestamp>,
) -> Result<FleetView, CliError> {
    let cfg = config.load()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| CliError::Runtime(format!("cannot start the runtime: {e}")))?;
    rt.block_on(async {
        let cluster = cluster(&cfg, cluster_arg).await;
        let sdk = crate::aws::loader(&cfg.aws).load().await;
        let logs = Logs::new(&sdk);
        let q = FleetQuery {
            log_group: cfg.export.log_group_for(&cluster),
            instance: only.map(|(i, _)| i.to_string()),
            incident: only.map(|(_, n)| n),
            since_ms: since.map(|t| t.0),
        };
        let view = crate::export::fleet_incidents::read(&logs, &q)
            .await
            .map_err(|e| {
                if e.code.as_deref() == Some("ResourceNotFoundException") {
                    CliError::NotFound(format!(
                        "log group {} not found: is [export] on in cluster {cluster}? ({e})",
                        q.log_group
                    ))
                } else {
                    CliError::Runtime(format!("CloudWatch Logs ({}): {e}", q.log_group))
                }
            })?;
        if view.scan.truncated {
            eprintln!(
                "warning: read the first {} events of {} only; narrow with --since",
                view.scan.read, q.log_group
            );
        }
        if view.foreign > 0 {
            eprintln!(
                "warning: {} events in {} are not gpu-medic records (skipped)",
                view.foreign, q.log_group
            );
        }
        Ok(view)
    })
}
