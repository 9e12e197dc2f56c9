//! Who this instance is, to ECS and Auto Scaling: its EC2 instance id, its cluster and
//! container instance ARN, and its Auto Scaling group. Every step can be overridden in
//! `[identity]` (for hosts where discovery cannot work, and for tests):
//!
//! 1. cluster and container instance ARN from the ECS agent's introspection API
//!    (`[ecs] agent_url`, `/v1/metadata`), retried for `[ecs] agent_wait` because the agent
//!    only answers once it has registered;
//! 2. the instance id from IMDSv2 (aws-config's client, which honours
//!    `AWS_EC2_METADATA_SERVICE_ENDPOINT`), or from the container instance when IMDS fails;
//! 3. when the agent did not answer: `ECS_CLUSTER` from `[ecs] ecs_config_file` (the agent's
//!    own default is `default`) and the container instance with this EC2 id, found through
//!    ListContainerInstances and DescribeContainerInstances (moto ignores `filter`);
//! 4. the group from DescribeAutoScalingInstances; none when the instance is in no group.

use std::time::Duration;

use aws_sdk_ecs::config::SharedHttpClient;
use tokio::time::Instant;

use super::asg::Asg;
use super::calls::{CallError, Calls};
use super::ecs::Ecs;
use super::imds;
use crate::config::Config;

/// How long discovery asks IMDS before it falls back to the container instance's record
/// (about one attempt with its retry: the daemon's orders must not wait on a missing IMDS).
const IMDS_WAIT: Duration = Duration::from_secs(1);

/// This instance, as the control plane knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub instance_id: String,
    pub cluster: String,
    pub container_instance_arn: String,
    /// None: the instance is in no Auto Scaling group (replace is then impossible).
    pub auto_scaling_group: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    #[error("cannot find this instance's EC2 id: {0}")]
    InstanceId(String),
    #[error("cannot find this instance's ECS container instance: {0}")]
    NotRegistered(String),
    /// The container instance named (by `[identity]` or the agent) is another EC2 instance's:
    /// a mistake in the configuration, never retried, and nothing is written to ECS for it.
    #[error(
        "the ECS container instance {arn} is EC2 instance {theirs}, not this instance ({ours}); fix [identity] container_instance_arn (or instance_id): nothing is written to ECS until it names this instance"
    )]
    Mismatch {
        arn: String,
        theirs: String,
        ours: String,
    },
    /// `[identity] auto_scaling_group` names another group than the one Auto Scaling puts
    /// this instance in: a mistake in the configuration, never retried.
    #[error(
        "[identity] auto_scaling_group is {named}, but Auto Scaling has {instance} in {theirs}; fix or remove the setting: the fleet budget would count another group's instances"
    )]
    GroupMismatch {
        named: String,
        theirs: String,
        instance: String,
    },
    #[error(transparent)]
    Call(#[from] CallError),
}

impl IdentityError {
    /// IMDS and the agent come up after us at boot, and registration takes a while: all of
    /// these may clear, except a terminal AWS error (permissions, a cluster that is not there).
    pub fn is_retryable(&self) -> bool {
        match self {
            IdentityError::Call(c) => c.retryable,
            IdentityError::Mismatch { .. } | IdentityError::GroupMismatch { .. } => false,
            _ => true,
        }
    }
}

pub use super::agent::AgentMetadata;

/// The cluster and container instance as far as `[identity]` and the ECS agent tell, without
/// a call to AWS. `note` says why the agent did not help, when it did not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentView {
    pub cluster: String,
    pub container_instance_arn: Option<String>,
    pub note: String,
}

/// Steps 1 and 3a: `[identity]`, then the agent's introspection API (retried for
/// `[ecs] agent_wait`), then `ECS_CLUSTER` from the agent's config file.
pub async fn agent_view(cfg: &Config) -> AgentView {
    let ov = &cfg.identity;
    let mut cluster = ov.cluster.clone();
    let mut ci_arn = ov.container_instance_arn.clone();
    let mut note = String::new();
    if cluster.is_none() || ci_arn.is_none() {
        match agent_metadata_retrying(&cfg.ecs.agent_url, cfg.ecs.agent_wait).await {
            Ok(m) => {
                cluster = cluster.or(m.cluster);
                ci_arn = ci_arn.or(m.container_instance_arn);
            }
            Err(e) => {
                tracing::warn!(agent_url = %cfg.ecs.agent_url, "ECS agent introspection: {e}; falling back to {}", cfg.ecs.ecs_config_file.display());
                note = e;
            }
        }
    }
    AgentView {
        cluster: cluster.unwrap_or_else(|| cluster_from_ecs_config(&cfg.ecs.ecs_config_file)),
        container_instance_arn: ci_arn,
        note,
    }
}

/// Step 2: the instance id from `[identity]`, else IMDSv2, retried until `deadline`.
pub async fn instance_id(
    cfg: &Config,
    http: SharedHttpClient,
    deadline: Instant,
) -> Result<String, String> {
    match &cfg.identity.instance_id {
        Some(i) => Ok(i.clone()),
        None => imds::instance_id(http, deadline).await,
    }
}

/// Step 3b: the container instance of `instance_id` in `ecs`'s cluster, searched through
/// ListContainerInstances and DescribeContainerInstances (moto ignores `filter`). None: not
/// registered (yet).
pub async fn find_container_instance(
    ecs: &Ecs,
    instance_id: &str,
    calls: &mut Calls,
) -> Result<Option<String>, CallError> {
    let arns = ecs.list_instances(calls).await?;
    Ok(ecs
        .describe(calls, &arns, false)
        .await?
        .into_iter()
        .find(|s| s.ec2_instance_id.as_deref() == Some(instance_id))
        .map(|s| s.arn))
}

/// Step 4: the Auto Scaling group, from `[identity]` or DescribeAutoScalingInstances. A group
/// named in `[identity]` is checked against what Auto Scaling says of this instance when it
/// says anything: another group's name would run the fleet budget on that group's members.
/// Where Auto Scaling cannot tell (no answer, the instance in no group) the setting stands.
pub async fn group(
    cfg: &Config,
    asg: &Asg,
    instance_id: &str,
    calls: &mut Calls,
) -> Result<Option<String>, IdentityError> {
    match &cfg.identity.auto_scaling_group {
        Some(g) => match asg.instance(calls, instance_id).await {
            Ok(Some((theirs, _))) if theirs != *g => Err(IdentityError::GroupMismatch {
                named: g.clone(),
                theirs,
                instance: instance_id.to_string(),
            }),
            Ok(_) => Ok(Some(g.clone())),
            Err(e) => {
                tracing::warn!(
                    auto_scaling_group = %g,
                    "DescribeAutoScalingInstances: {e}; [identity] auto_scaling_group taken as set"
                );
                Ok(Some(g.clone()))
            }
        },
        None => Ok(asg.instance(calls, instance_id).await?.map(|(g, _)| g)),
    }
}

/// Discovers the identity; `calls` collects the request ids of the AWS calls made.
pub async fn discover(
    cfg: &Config,
    http: SharedHttpClient,
    ecs_client: &aws_sdk_ecs::Client,
    asg: &Asg,
    calls: &mut Calls,
) -> Result<Identity, IdentityError> {
    let view = agent_view(cfg).await;
    let cluster = view.cluster.clone();
    let ecs = Ecs::new(ecs_client.clone(), cluster.clone());

    let imds_deadline = Instant::now() + IMDS_WAIT;
    let instance_id = match instance_id(cfg, http, imds_deadline).await {
        Ok(i) => {
            // A container instance named rather than found: proven to be this instance's
            // before anything is written to it.
            if let Some(arn) = &view.container_instance_arn {
                let theirs = ecs.describe_one(calls, arn, false).await?.ec2_instance_id;
                if theirs.as_deref() != Some(i.as_str()) {
                    return Err(IdentityError::Mismatch {
                        arn: arn.clone(),
                        theirs: theirs.unwrap_or_else(|| "(none named)".into()),
                        ours: i,
                    });
                }
            }
            i
        }
        Err(imds_err) => match &view.container_instance_arn {
            Some(arn) => ecs
                .describe_one(calls, arn, false)
                .await?
                .ec2_instance_id
                .ok_or_else(|| {
                    IdentityError::InstanceId(format!(
                        "IMDS: {imds_err}; {arn} names no EC2 instance"
                    ))
                })?,
            None => return Err(IdentityError::InstanceId(format!("IMDS: {imds_err}"))),
        },
    };

    let container_instance_arn = match view.container_instance_arn {
        Some(a) => a,
        None => find_container_instance(&ecs, &instance_id, calls)
            .await?
            .ok_or_else(|| {
                IdentityError::NotRegistered(format!(
                    "{instance_id} is not registered in cluster {cluster}{}",
                    if view.note.is_empty() {
                        String::new()
                    } else {
                        format!(" (agent: {})", view.note)
                    }
                ))
            })?,
    };

    let auto_scaling_group = group(cfg, asg, &instance_id, calls).await?;
    let id = Identity {
        instance_id,
        cluster,
        container_instance_arn,
        auto_scaling_group,
    };
    tracing::info!(
        instance_id = %id.instance_id,
        cluster = %id.cluster,
        container_instance = %id.container_instance_arn,
        auto_scaling_group = id.auto_scaling_group.as_deref().unwrap_or("(none)"),
        "identity discovered"
    );
    Ok(id)
}

/// `ECS_CLUSTER` from the agent's config file; the agent's own default is `default`.
/// The file is read like any other input (a regular file, at most 64 KiB): one that cannot
/// be read is said, then taken as holding no cluster.
pub fn cluster_from_ecs_config(path: &std::path::Path) -> String {
    const MAX_ECS_CONFIG: u64 = 64 * 1024;
    let text = match crate::sys::limits::read_text(path, MAX_ECS_CONFIG, "the ECS agent's config") {
        Ok(text) => Some(text),
        Err(e) if e.is_not_found() => None,
        Err(e) => {
            tracing::warn!(path = %path.display(), "{e}; taking the agent's default cluster");
            None
        }
    };
    text.and_then(|text| parse_ecs_cluster(&text))
        .unwrap_or_else(|| "default".to_string())
}

fn parse_ecs_cluster(text: &str) -> Option<String> {
    text.lines().rev().find_map(|l| {
        let v = l.trim().strip_prefix("ECS_CLUSTER=")?;
        let v = v.trim().trim_matches('"').trim_matches('\'');
        (!v.is_empty()).then(|| v.to_string())
    })
}

/// Asks the agent until it answers with a container instance ARN, or `wait` passes.
pub async fn agent_metadata_retrying(url: &str, wait: Duration) -> Result<AgentMetadata, String> {
    let until = tokio::time::Instant::now() + wait;
    let mut delay = Duration::from_millis(250);
    loop {
        let err = match agent_metadata(url).await {
            Ok(m)
                if m.container_instance_arn
                    .as_deref()
                    .is_some_and(|a| !a.is_empty()) =>
            {
                return Ok(m);
            }
            Ok(_) => "the agent has not registered yet".to_string(),
            Err(e) => e,
        };
        let now = tokio::time::Instant::now();
        if now + delay > until {
            return Err(err);
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(5));
    }
}

/// One `GET <agent_url>/v1/metadata` ([`super::agent::Agent`]).
pub async fn agent_metadata(url: &str) -> Result<AgentMetadata, String> {
    super::agent::Agent::new(url)
        .metadata()
        .await
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ecs_config_names_the_cluster() {
        assert_eq!(
            parse_ecs_cluster("ECS_ENABLE_GPU_SUPPORT=true\nECS_CLUSTER=gpu-prod\n"),
            Some("gpu-prod".into())
        );
        assert_eq!(parse_ecs_cluster("ECS_CLUSTER=\"q\"\n"), Some("q".into()));
        assert_eq!(parse_ecs_cluster("ECS_LOGLEVEL=info\n"), None);
        assert_eq!(
            cluster_from_ecs_config(std::path::Path::new("/nonexistent/ecs.config")),
            "default"
        );
        let dir = tempfile::tempdir().unwrap();
        let ok = dir.path().join("ecs.config");
        std::fs::write(&ok, "ECS_CLUSTER=gpu-prod\n").unwrap();
        assert_eq!(cluster_from_ecs_config(&ok), "gpu-prod");
        // Neither a FIFO (no writer: a plain read waits for ever) nor an endless device is
        // read: both are said and taken as no cluster.
        let fifo = dir.path().join("fifo");
        crate::sys::limits::mkfifo(&fifo);
        assert_eq!(cluster_from_ecs_config(&fifo), "default");
        assert_eq!(
            cluster_from_ecs_config(std::path::Path::new("/dev/zero")),
            "default"
        );
    }
}
