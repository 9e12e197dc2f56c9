//! A fake IMDSv2 for the lifecycle tests (moto's IMDS sends no token TTL header, which
//! aws-config's client requires, and has no `autoscaling/target-lifecycle-state`):
//! - `PUT /latest/api/token` answers only with the `X-aws-ec2-metadata-token-ttl-seconds`
//!   request header, and echoes it;
//! - `GET /latest/meta-data/...` needs that token (401 otherwise): `instance-id`,
//!   `placement/region`, `autoscaling/target-lifecycle-state` (404 until set), `instance-type`
//!   (404 until set);
//! - any other document the test sets (`set_doc`: the planned-events documents
//!   `events/maintenance/scheduled`, `spot/instance-action`, `events/recommendations/rebalance`;
//!   instance tags, `tags/instance/gpu-medic:drills`), 404 until set;
//! - the test changes the target state at any time, or takes IMDS down (HTTP 500).
//!
//! And a fake ECS agent introspection API (`/v1/metadata`, `/v1/tasks`), which exists only on an
//! instance.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::aws::REGION;
use crate::http::{Handler, header, serve_http};

#[derive(Default)]
struct State {
    instance_id: String,
    target: Option<String>,
    instance_type: Option<String>,
    down: bool,
    tokens: u32,
    /// Documents by path under `/latest/meta-data/` (`events/maintenance/scheduled`).
    docs: std::collections::BTreeMap<String, String>,
    /// (method, path, status) of every request.
    log: Vec<(String, String, u16)>,
}

#[derive(Clone)]
pub struct FakeImds {
    pub url: String,
    state: Arc<Mutex<State>>,
}

impl FakeImds {
    pub async fn start(instance_id: &str) -> FakeImds {
        let state = Arc::new(Mutex::new(State {
            instance_id: instance_id.to_string(),
            ..State::default()
        }));
        let st = state.clone();
        let handler: Handler = Arc::new(move |method: &str, path: &str, head: &str| {
            let mut s = st.lock().unwrap();
            let (status, headers, body) = answer(&mut s, method, path, head);
            s.log.push((method.to_string(), path.to_string(), status));
            (status, headers, body)
        });
        let addr = serve_http(handler).await;
        FakeImds {
            url: format!("http://{addr}"),
            state,
        }
    }

    /// `Some("Terminated")`, `Some("InService")`, or None (404).
    pub fn set_target(&self, target: Option<&str>) {
        self.state.lock().unwrap().target = target.map(str::to_string);
    }

    /// `instance-type` (`p5.48xlarge`), or None (404).
    pub fn set_instance_type(&self, instance_type: Option<&str>) {
        self.state.lock().unwrap().instance_type = instance_type.map(str::to_string);
    }

    /// The document at `/latest/meta-data/<path>` from now on (None: 404).
    pub fn set_doc(&self, path: &str, doc: Option<&str>) {
        let mut s = self.state.lock().unwrap();
        match doc {
            Some(d) => {
                s.docs.insert(path.to_string(), d.to_string());
            }
            None => {
                s.docs.remove(path);
            }
        }
    }

    /// Requests answered for `/latest/meta-data/<path>`, with their statuses.
    pub fn reads(&self, path: &str) -> Vec<u16> {
        let full = format!("/latest/meta-data/{path}");
        self.state
            .lock()
            .unwrap()
            .log
            .iter()
            .filter(|(m, p, _)| m == "GET" && *p == full)
            .map(|(_, _, s)| *s)
            .collect()
    }

    /// Down: every request gets HTTP 500.
    pub fn set_down(&self, down: bool) {
        self.state.lock().unwrap().down = down;
    }

    /// How many target-lifecycle-state reads were answered, and with which status.
    pub fn target_reads(&self) -> Vec<u16> {
        self.state
            .lock()
            .unwrap()
            .log
            .iter()
            .filter(|(m, p, _)| m == "GET" && p.ends_with("target-lifecycle-state"))
            .map(|(_, _, s)| *s)
            .collect()
    }

    /// How many requests were refused with HTTP 500 (IMDS down).
    pub fn refused(&self) -> usize {
        self.state
            .lock()
            .unwrap()
            .log
            .iter()
            .filter(|(_, _, s)| *s == 500)
            .count()
    }

    pub fn tokens_issued(&self) -> u32 {
        self.state.lock().unwrap().tokens
    }
}

fn answer(
    s: &mut State,
    method: &str,
    path: &str,
    head: &str,
) -> (u16, Vec<(String, String)>, String) {
    if s.down {
        return (500, vec![], "down".into());
    }
    if method == "PUT" && path == "/latest/api/token" {
        let Some(ttl) = header(head, "x-aws-ec2-metadata-token-ttl-seconds") else {
            return (400, vec![], "missing token TTL".into());
        };
        s.tokens += 1;
        return (
            200,
            vec![(
                "X-aws-ec2-metadata-token-ttl-seconds".to_string(),
                ttl.to_string(),
            )],
            format!("token-{}", s.tokens),
        );
    }
    if method != "GET" {
        return (405, vec![], String::new());
    }
    match header(head, "x-aws-ec2-metadata-token") {
        Some(t) if t.starts_with("token-") => {}
        _ => return (401, vec![], String::new()),
    }
    match path {
        "/latest/meta-data/instance-id" => (200, vec![], s.instance_id.clone()),
        "/latest/meta-data/placement/region" => (200, vec![], REGION.to_string()),
        "/latest/meta-data/instance-type" => match &s.instance_type {
            Some(t) => (200, vec![], t.clone()),
            None => (404, vec![], String::new()),
        },
        "/latest/meta-data/autoscaling/target-lifecycle-state" => match &s.target {
            Some(t) => (200, vec![], t.clone()),
            None => (404, vec![], String::new()),
        },
        other => match other
            .strip_prefix("/latest/meta-data/")
            .and_then(|p| s.docs.get(p))
        {
            Some(d) => (200, vec![], d.clone()),
            None => (404, vec![], String::new()),
        },
    }
}

/// A fake ECS agent introspection API: `GET /v1/metadata` answers `metadata` (JSON) after
/// answering 503 to the first `fail_first` requests (an agent still starting); `GET /v1/tasks`
/// answers the task list set with [`FakeAgent::set_tasks`] (404 until set); any other path is
/// 404.
#[derive(Clone)]
pub struct FakeAgent {
    pub url: String,
    /// While set, every request is answered 503 (an agent restarting, or hung).
    down: Arc<std::sync::atomic::AtomicBool>,
    requests: Arc<AtomicUsize>,
    tasks: Arc<Mutex<Option<String>>>,
    paths: Arc<Mutex<Vec<String>>>,
}

/// One task of `/v1/tasks`: (task ARN, family, containers as (Docker id, container name)).
pub type AgentTask<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

impl FakeAgent {
    pub async fn start(metadata: String, fail_first: usize) -> FakeAgent {
        let requests = Arc::new(AtomicUsize::new(0));
        let tasks: Arc<Mutex<Option<String>>> = Arc::default();
        let paths: Arc<Mutex<Vec<String>>> = Arc::default();
        let down: Arc<std::sync::atomic::AtomicBool> = Arc::default();
        let (seen, list, log, off) = (requests.clone(), tasks.clone(), paths.clone(), down.clone());
        let handler: Handler = Arc::new(move |_, path, _| {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            log.lock().unwrap().push(path.to_string());
            if off.load(Ordering::SeqCst) {
                return (503, vec![], "down".into());
            }
            let json = |body: String| {
                (
                    200,
                    vec![("Content-Type".into(), "application/json".into())],
                    body,
                )
            };
            match path {
                "/v1/metadata" if n < fail_first => (503, vec![], "starting".into()),
                "/v1/metadata" => json(metadata.clone()),
                "/v1/tasks" => match list.lock().unwrap().clone() {
                    Some(body) => json(body),
                    None => (404, vec![], String::new()),
                },
                _ => (404, vec![], String::new()),
            }
        });
        let addr = serve_http(handler).await;
        FakeAgent {
            url: format!("http://{addr}"),
            down,
            requests,
            tasks,
            paths,
        }
    }

    /// What `/v1/tasks` answers from now on: the tasks as the agent lists them (RUNNING,
    /// revision 1), in the format of AWS's introspection page.
    pub fn set_tasks(&self, tasks: &[AgentTask]) {
        let tasks: Vec<serde_json::Value> = tasks
            .iter()
            .map(|(arn, family, containers)| {
                let containers: Vec<serde_json::Value> = containers
                    .iter()
                    .map(|(id, name)| {
                        serde_json::json!({
                            "DockerId": id,
                            "DockerName": format!("ecs-{family}-1-{name}-{}", &id[..8.min(id.len())]),
                            "Name": name,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "Arn": arn, "DesiredStatus": "RUNNING", "KnownStatus": "RUNNING",
                    "Family": family, "Version": "1", "Containers": containers,
                })
            })
            .collect();
        *self.tasks.lock().unwrap() = Some(serde_json::json!({ "Tasks": tasks }).to_string());
    }

    /// Down (every request answered 503) or up again.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// How many requests asked for `path`.
    pub fn requests_for(&self, path: &str) -> usize {
        self.paths
            .lock()
            .unwrap()
            .iter()
            .filter(|p| *p == path)
            .count()
    }

    /// The agent's metadata for a cluster and, once registered, a container instance.
    pub fn metadata(cluster: &str, arn: Option<&str>) -> String {
        match arn {
            Some(arn) => format!(
                r#"{{"Cluster":"{cluster}","ContainerInstanceArn":"{arn}","Version":"Amazon ECS Agent - v1.90.0"}}"#
            ),
            None => format!(r#"{{"Cluster":"{cluster}"}}"#),
        }
    }

    /// Requests answered so far (any path).
    pub fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}
