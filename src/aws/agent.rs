//! The ECS agent's introspection API on the instance (`http://localhost:51678` by default,
//! `[ecs] agent_url`): `/v1/metadata` (cluster, container instance, see
//! [`crate::aws::identity`]) and `/v1/tasks` (the tasks on this instance with their ARN,
//! family, revision and containers), so per-task GPU memory can be labelled with what an
//! operator knows a task by. docs/mps.md#client-pid-to-ecs-task has the sources.
//!
//! A plain HTTP/1.0 request: the API is local, unencrypted and small, which does not warrant
//! an HTTP client of its own. Answers are read up to 4 MiB (an instance runs at most a few
//! hundred tasks); a larger one is an error, never read further.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Largest answer read.
pub const MAX_ANSWER: u64 = 4 << 20;

/// One `GET <url><path>`, its JSON body parsed; 3 s for the whole exchange.
pub async fn get_json<T: DeserializeOwned>(url: &str, path: &str) -> Result<T, String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| format!("{url}: not an http:// URL"))?;
    let (authority, base) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    let addr = if authority.contains(':') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let io = async {
        let mut s = tokio::net::TcpStream::connect(&addr).await?;
        let req = format!(
            "GET {base}{path} HTTP/1.0\r\nHost: {authority}\r\nAccept: application/json\r\n\r\n"
        );
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        s.take(MAX_ANSWER + 1).read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(buf)
    };
    let buf = tokio::time::timeout(Duration::from_secs(3), io)
        .await
        .map_err(|_| format!("{url}: no answer within 3s"))?
        .map_err(|e| format!("{url}: {e}"))?;
    if buf.len() as u64 > MAX_ANSWER {
        return Err(format!(
            "{url}{path}: answer larger than {MAX_ANSWER} bytes"
        ));
    }
    let text = String::from_utf8_lossy(&buf);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| format!("{url}: malformed HTTP response"))?;
    let status = head.split_whitespace().nth(1).unwrap_or("?");
    if status != "200" {
        return Err(format!("{url}{path}: HTTP {status}"));
    }
    serde_json::from_str(body).map_err(|e| format!("{url}{path}: {e}"))
}

/// A task as `/v1/tasks` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct LocalTask {
    #[serde(rename = "Arn")]
    pub arn: String,
    #[serde(rename = "Family", default)]
    pub family: String,
    /// The task definition revision (a string in the agent's answer).
    #[serde(rename = "Version", default)]
    pub revision: String,
    #[serde(rename = "Containers", default)]
    pub containers: Vec<LocalContainer>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct LocalContainer {
    #[serde(rename = "DockerId", default)]
    pub docker_id: String,
    #[serde(rename = "Name", default)]
    pub name: String,
}

impl LocalTask {
    /// The task id: the last part of the ARN (what the cgroup path names).
    pub fn id(&self) -> &str {
        self.arn.rsplit('/').next().unwrap_or(&self.arn)
    }

    /// Container names by Docker id.
    pub fn container_names(&self) -> BTreeMap<String, String> {
        self.containers
            .iter()
            .map(|c| (c.docker_id.clone(), c.name.clone()))
            .collect()
    }
}

#[derive(Deserialize)]
struct Tasks {
    #[serde(rename = "Tasks", default)]
    tasks: Vec<LocalTask>,
}

/// `GET <url>/v1/tasks`: the tasks on this instance.
pub async fn local_tasks(url: &str) -> Result<Vec<LocalTask>, String> {
    get_json::<Tasks>(url, "/v1/tasks").await.map(|t| t.tasks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_agents_task_list() {
        let body = r#"{"Tasks":[{"Arn":"arn:aws:ecs:us-east-1:123456789012:task/gpu/0f1e2d3c","DesiredStatus":"RUNNING","KnownStatus":"RUNNING","Family":"llm","Version":"7","Containers":[{"DockerId":"c0ffee","DockerName":"ecs-llm-7-model","Name":"model"}]}]}"#;
        let t: Tasks = serde_json::from_str(body).unwrap();
        assert_eq!(t.tasks[0].id(), "0f1e2d3c");
        assert_eq!(t.tasks[0].family, "llm");
        assert_eq!(t.tasks[0].revision, "7");
        assert_eq!(
            t.tasks[0]
                .container_names()
                .get("c0ffee")
                .map(String::as_str),
            Some("model")
        );
    }
}
