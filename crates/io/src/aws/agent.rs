//! A small client for the ECS agent's introspection API on the instance (`[ecs] agent_url`,
//! `http://127.0.0.1:51678` by default): `/v1/metadata` (this instance's cluster and container
//! instance, for [`super::identity`]) and `/v1/tasks` (the tasks on this instance with their
//! containers' Docker ids, to name the tasks a fault hit). docs/mps.md#client-pid-to-ecs-task,
//! <https://docs.aws.amazon.com/AmazonECS/latest/developerguide/ecs-agent-introspection.html>.
//!
//! A plain HTTP/1.0 GET: the API is local, unencrypted and small, which does not warrant an
//! HTTP client of its own. Every request has a deadline and every response a size bound; an
//! answer over the bound is an error, never a truncated document.

use std::time::Duration;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long one request may take, connect to last byte.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(3);

/// The largest response read. `/v1/tasks` lists every task the agent still remembers (stopped
/// ones for a while too) at a few hundred bytes per container: 4 MiB is thousands of tasks.
pub const MAX_RESPONSE: u64 = 4 << 20;

/// Why the agent did not answer with a document.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentError {
    /// `[ecs] agent_url` is not an `http://host[:port][/base]` URL: a configuration mistake.
    #[error("{url}: not an http:// URL")]
    BadUrl { url: String },
    /// Connection refused or reset: the agent is not running (yet).
    #[error("{url}{path}: {message}")]
    Io {
        url: String,
        path: String,
        message: String,
    },
    #[error("{url}{path}: no answer within {}s", timeout.as_secs_f64())]
    Timeout {
        url: String,
        path: String,
        timeout: Duration,
    },
    /// A non-200 status (503 while the agent starts, 404 for an unknown path).
    #[error("{url}{path}: HTTP {status}")]
    Status {
        url: String,
        path: String,
        status: String,
    },
    #[error("{url}{path}: the answer is larger than {max} bytes")]
    TooLarge { url: String, path: String, max: u64 },
    /// Not HTTP, or not the JSON expected.
    #[error("{url}{path}: {message}")]
    Malformed {
        url: String,
        path: String,
        message: String,
    },
}

impl AgentError {
    /// An agent that is starting, restarting or busy may answer later; a bad URL, a missing
    /// path, or an answer too large or not understood will not change by asking again.
    pub fn is_retryable(&self) -> bool {
        match self {
            AgentError::Io { .. } | AgentError::Timeout { .. } => true,
            AgentError::Status { status, .. } => status.starts_with('5'),
            AgentError::BadUrl { .. }
            | AgentError::TooLarge { .. }
            | AgentError::Malformed { .. } => false,
        }
    }
}

/// The agent at one URL.
#[derive(Debug, Clone)]
pub struct Agent {
    url: String,
    timeout: Duration,
    max: u64,
}

impl Agent {
    pub fn new(url: &str) -> Agent {
        Agent {
            url: url.trim_end_matches('/').to_string(),
            timeout: DEFAULT_TIMEOUT,
            max: MAX_RESPONSE,
        }
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Agent {
        self.timeout = timeout;
        self
    }

    /// Another response bound (tests).
    #[cfg(test)]
    pub fn with_max_response(mut self, max: u64) -> Agent {
        self.max = max;
        self
    }

    /// `GET <url><path>`, the body parsed as `T`.
    pub async fn get_json<T: DeserializeOwned>(&self, path: &str) -> Result<T, AgentError> {
        let body = self.get(path).await?;
        serde_json::from_slice(&body).map_err(|e| self.malformed(path, e.to_string()))
    }

    /// The agent's `/v1/metadata`.
    pub async fn metadata(&self) -> Result<AgentMetadata, AgentError> {
        self.get_json("/v1/metadata").await
    }

    /// The tasks the agent knows on this instance (`/v1/tasks`).
    pub async fn tasks(&self) -> Result<Vec<AgentTask>, AgentError> {
        Ok(self.get_json::<AgentTasks>("/v1/tasks").await?.tasks)
    }

    /// The body of a 200 answer to `GET <url><path>`.
    async fn get(&self, path: &str) -> Result<Vec<u8>, AgentError> {
        let rest = self
            .url
            .strip_prefix("http://")
            .ok_or_else(|| AgentError::BadUrl {
                url: self.url.clone(),
            })?;
        let (authority, base) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        if authority.is_empty() {
            return Err(AgentError::BadUrl {
                url: self.url.clone(),
            });
        }
        let addr = if authority.contains(':') {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        let max = self.max;
        let io = async {
            let mut s = tokio::net::TcpStream::connect(&addr).await?;
            let req = format!(
                "GET {base}{path} HTTP/1.0\r\nHost: {authority}\r\nAccept: application/json\r\n\r\n"
            );
            s.write_all(req.as_bytes()).await?;
            let mut buf = Vec::new();
            s.take(max.saturating_add(1)).read_to_end(&mut buf).await?;
            Ok::<_, std::io::Error>(buf)
        };
        let buf = tokio::time::timeout(self.timeout, io)
            .await
            .map_err(|_| AgentError::Timeout {
                url: self.url.clone(),
                path: path.to_string(),
                timeout: self.timeout,
            })?
            .map_err(|e| AgentError::Io {
                url: self.url.clone(),
                path: path.to_string(),
                message: e.to_string(),
            })?;
        if buf.len() as u64 > max {
            return Err(AgentError::TooLarge {
                url: self.url.clone(),
                path: path.to_string(),
                max,
            });
        }
        let split = buf
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| self.malformed(path, "malformed HTTP response".into()))?;
        let head = String::from_utf8_lossy(&buf[..split]);
        let status = head.split_whitespace().nth(1).unwrap_or("?").to_string();
        if status != "200" {
            return Err(AgentError::Status {
                url: self.url.clone(),
                path: path.to_string(),
                status,
            });
        }
        Ok(buf[split + 4..].to_vec())
    }

    fn malformed(&self, path: &str, message: String) -> AgentError {
        AgentError::Malformed {
            url: self.url.clone(),
            path: path.to_string(),
            message,
        }
    }
}

/// What the ECS agent's `/v1/metadata` returns.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct AgentMetadata {
    #[serde(rename = "Cluster", default)]
    pub cluster: Option<String>,
    #[serde(rename = "ContainerInstanceArn", default)]
    pub container_instance_arn: Option<String>,
}

#[derive(Debug, Deserialize)]
struct AgentTasks {
    #[serde(rename = "Tasks", default)]
    tasks: Vec<AgentTask>,
}

/// One task in `/v1/tasks`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct AgentTask {
    #[serde(rename = "Arn")]
    pub arn: String,
    #[serde(rename = "Family", default)]
    pub family: String,
    #[serde(rename = "Version", default)]
    pub version: String,
    #[serde(rename = "DesiredStatus", default)]
    pub desired_status: String,
    #[serde(rename = "KnownStatus", default)]
    pub known_status: String,
    #[serde(rename = "Containers", alias = "containers", default)]
    pub containers: Vec<AgentContainer>,
}

/// One container of a task in `/v1/tasks`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct AgentContainer {
    /// The full Docker container id (64 hex digits); empty before the container is created.
    #[serde(rename = "DockerId", default)]
    pub docker_id: String,
    #[serde(rename = "DockerName", default)]
    pub docker_name: String,
    /// The container's name in the task definition.
    #[serde(rename = "Name", default)]
    pub name: String,
}

impl AgentTask {
    /// The last part of the ARN: the task id ECS also puts in task cgroup paths.
    pub fn id(&self) -> &str {
        self.arn.rsplit('/').next().unwrap_or(&self.arn)
    }

    /// The container with this Docker id (full, or a prefix of at least 12 digits as
    /// `docker ps` shortens it).
    pub fn container(&self, docker_id: &str) -> Option<&AgentContainer> {
        if docker_id.len() < 12 {
            return None;
        }
        self.containers
            .iter()
            .find(|c| !c.docker_id.is_empty() && c.docker_id.starts_with(docker_id))
    }
}

// How the ECS agent names the cgroups of its tasks' processes.

/// The ECS task id in a cgroup file's text, if the process runs in an ECS task.
pub fn task_id_from_cgroup(text: &str) -> Option<String> {
    task_and_container_from_cgroup(text).map(|(task, _)| task)
}

/// The ECS task id and, where the path names it, the container (Docker) id in a cgroup
/// file's text: `ecstasks-<task>.slice/docker-<container>.scope` (v2) or
/// `/ecs/<task>/<container>` (v1).
pub fn task_and_container_from_cgroup(text: &str) -> Option<(String, Option<String>)> {
    for line in text.lines() {
        let path = line.splitn(3, ':').nth(2).unwrap_or("");
        let mut parts = path.split('/');
        while let Some(part) = parts.next() {
            if let Some(rest) = part.strip_prefix("ecstasks-")
                && let Some(id) = rest.strip_suffix(".slice")
                && is_task_id(id)
            {
                let container = parts
                    .next()
                    .and_then(|c| c.strip_prefix("docker-"))
                    .and_then(|c| c.strip_suffix(".scope"))
                    .filter(|c| is_task_id(c))
                    .map(str::to_string);
                return Some((id.to_string(), container));
            }
        }
        let mut parts = path.split('/').skip_while(|p| *p != "ecs");
        if parts.next().is_some()
            && let Some(id) = parts.next()
            && is_task_id(id)
        {
            let container = parts.next().filter(|c| is_task_id(c)).map(str::to_string);
            return Some((id.to_string(), container));
        }
    }
    None
}

fn is_task_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One HTTP answer, raw, to whoever connects first.
    async fn serve_once(answer: Vec<u8>) -> String {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await;
            let _ = s.write_all(&answer).await;
        });
        format!("http://{addr}")
    }

    fn ok(body: &str) -> Vec<u8> {
        format!("HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{body}").into_bytes()
    }

    /// The example answer in AWS's introspection page, shortened.
    const TASKS: &str = r#"{"Tasks":[{"Arn":"arn:aws:ecs:us-west-2:123456789012:task/090eff9b-1ce3-4db6-848a-a8d14064fd24","DesiredStatus":"RUNNING","KnownStatus":"RUNNING","Family":"console-sample-app-static","Version":"6","Containers":[{"DockerId":"189a8ff4b5f04affe40e5160a5ffadca395136eb5faf4950c57963c06f82c76d","DockerName":"ecs-console-sample-app-static-6-simple-app-86caf9bcabe3e9c61600","Name":"simple-app"}]}]}"#;

    #[tokio::test]
    async fn tasks_parse_and_containers_match_by_docker_id() {
        let url = serve_once(ok(TASKS)).await;
        let tasks = Agent::new(&url).tasks().await.unwrap();
        assert_eq!(tasks.len(), 1);
        let t = &tasks[0];
        assert_eq!(t.id(), "090eff9b-1ce3-4db6-848a-a8d14064fd24");
        assert_eq!(
            (t.family.as_str(), t.version.as_str()),
            ("console-sample-app-static", "6")
        );
        assert_eq!(t.container("189a8ff4b5f0").unwrap().name, "simple-app");
        assert!(t.container("189a8ff").is_none(), "too short to be an id");
        assert!(t.container("f7f1f8a7a245c5da").is_none());
    }

    #[tokio::test]
    async fn errors_say_what_and_whether_to_retry() {
        let url = serve_once(b"HTTP/1.0 503 Service Unavailable\r\n\r\nstarting".to_vec()).await;
        let e = Agent::new(&url).tasks().await.unwrap_err();
        assert!(
            matches!(&e, AgentError::Status { status, .. } if status == "503"),
            "{e}"
        );
        assert!(e.is_retryable());

        let url = serve_once(b"HTTP/1.0 404 Not Found\r\n\r\n".to_vec()).await;
        let e = Agent::new(&url).tasks().await.unwrap_err();
        assert!(!e.is_retryable(), "{e}");

        let url = serve_once(ok("{\"Tasks\": [{\"no\": 1}]}")).await;
        let e = Agent::new(&url).tasks().await.unwrap_err();
        assert!(matches!(e, AgentError::Malformed { .. }), "{e}");

        let url = serve_once(b"garbage without a header end".to_vec()).await;
        let e = Agent::new(&url).tasks().await.unwrap_err();
        assert!(matches!(e, AgentError::Malformed { .. }), "{e}");

        let e = Agent::new("https://x").tasks().await.unwrap_err();
        assert!(matches!(e, AgentError::BadUrl { .. }) && !e.is_retryable());
        let e = Agent::new("http://").tasks().await.unwrap_err();
        assert!(matches!(e, AgentError::BadUrl { .. }), "{e}");
    }

    #[tokio::test]
    async fn an_answer_over_the_bound_is_refused_not_truncated() {
        let big = format!("{{\"Tasks\":[],\"pad\":\"{}\"}}", "x".repeat(5000));
        let url = serve_once(ok(&big)).await;
        let e = Agent::new(&url)
            .with_max_response(4096)
            .tasks()
            .await
            .unwrap_err();
        assert!(matches!(e, AgentError::TooLarge { max: 4096, .. }), "{e}");
        assert!(!e.is_retryable());
    }

    #[tokio::test]
    async fn a_silent_agent_times_out() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let hold = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(5)).await;
            drop(s);
        });
        let e = Agent::new(&url)
            .with_timeout(Duration::from_millis(200))
            .metadata()
            .await
            .unwrap_err();
        assert!(
            matches!(e, AgentError::Timeout { .. }) && e.is_retryable(),
            "{e}"
        );
        hold.abort();
    }
}
