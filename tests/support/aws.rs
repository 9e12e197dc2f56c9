//! Support for the AWS tests (tests/aws_*.rs):
//! - one `moto_server` per test binary on a free port, stopped by a watcher shell when the
//!   binary exits (statics are never dropped); tests share it with unique cluster/ASG names;
//! - a recording, fault-injecting HTTP proxy in front of moto, per test: it logs each call's
//!   operation, answers chosen operations itself (throttling, 5xx, what moto lacks), and
//!   forwards the rest;
//! - seeding through the AWS SDK: launch configuration + Auto Scaling group (moto creates the
//!   EC2 instances), cluster, container instances registered with those EC2 ids, tasks.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use aws_config::SdkConfig;
use aws_sdk_ecs::config::Credentials;
use gpu_medic::config::{AwsConfig, Config};
use gpu_medic::model::{ActionId, Command, IncidentId, Order, Timestamp};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const REGION: &str = "us-east-1";

pub struct Moto {
    pub url: String,
    pub addr: SocketAddr,
    /// The watcher shell; it reaps moto itself when this binary exits.
    _watcher: std::process::Child,
}

static MOTO: OnceLock<Moto> = OnceLock::new();

/// The binary's moto_server, started on first use.
pub fn moto() -> &'static Moto {
    MOTO.get_or_init(start_moto)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_moto() -> Moto {
    let venv =
        std::env::var("GPU_MEDIC_CI_VENV").unwrap_or_else(|_| "/opt/gpu-medic-ci/venv".into());
    let server = format!("{venv}/bin/moto_server");
    assert!(
        Path::new(&server).exists(),
        "{server} not found: run `sudo bash .ci/install-deps.sh`"
    );
    let port = free_port();
    let log = std::env::temp_dir().join(format!("gpu-medic-moto-{port}.log"));
    // The watcher ends moto once this test binary is gone, however it ended.
    let script = format!(
        "'{server}' -H 127.0.0.1 -p {port} >'{}' 2>&1 & m=$!; trap 'kill $m 2>/dev/null' EXIT; \
         while kill -0 {pid} 2>/dev/null && kill -0 $m 2>/dev/null; do sleep 0.3; done",
        log.display(),
        pid = std::process::id()
    );
    let watcher = std::process::Command::new("bash")
        .arg("-c")
        .arg(script)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start moto_server");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_sync(addr, "GET", "/moto-api/", "").map(|(s, _)| s) != Some(200) {
        assert!(
            Instant::now() < deadline,
            "moto_server did not start; log: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Tasks stay RUNNING until stopped (moto advances lastStatus on every describe otherwise).
    let (s, b) = http_sync(
        addr,
        "POST",
        "/moto-api/state-manager/set-transition",
        r#"{"model_name":"ecs::task","transition":{"progression":"manual","times":1000000}}"#,
    )
    .unwrap();
    assert_eq!(s, 201, "set-transition: {b}");
    Moto {
        url: format!("http://{addr}"),
        addr,
        _watcher: watcher,
    }
}

/// A blocking HTTP/1.0 request; None when nothing answers.
pub fn http_sync(addr: SocketAddr, method: &str, path: &str, body: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split_whitespace().nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// A unique name per test and run (moto is shared by the binary's tests).
pub fn unique(name: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{name}-{}-{n}", std::process::id())
}

// ---------------------------------------------------------------------------------------------
// The proxy

/// One call seen by the proxy.
#[derive(Debug, Clone)]
pub struct Call {
    pub op: String,
    pub body: String,
    pub status: u16,
    pub at: Instant,
}

/// An answer the proxy gives itself, `times` times, for one operation.
#[derive(Debug, Clone)]
pub struct Fault {
    pub op: String,
    pub times: usize,
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Fault {
    fn ecs(op: &str, times: usize, status: u16, code: &str, message: &str) -> Fault {
        Fault {
            op: op.into(),
            times,
            status,
            content_type: "application/x-amz-json-1.1",
            body: format!(r#"{{"__type":"{code}","message":"{message}"}}"#),
        }
    }

    pub fn ecs_throttle(op: &str, times: usize) -> Fault {
        Fault::ecs(op, times, 400, "ThrottlingException", "Rate exceeded")
    }

    pub fn ecs_unavailable(op: &str, times: usize) -> Fault {
        Fault::ecs(op, times, 503, "ServerException", "Service unavailable")
    }

    pub fn ecs_denied(op: &str, times: usize) -> Fault {
        Fault::ecs(op, times, 400, "AccessDeniedException", "not authorized")
    }

    pub fn asg_error(op: &str, times: usize, status: u16, code: &str, message: &str) -> Fault {
        Fault {
            op: op.into(),
            times,
            status,
            content_type: "text/xml",
            body: format!(
                "<ErrorResponse xmlns=\"http://autoscaling.amazonaws.com/doc/2011-01-01/\"><Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error><RequestId>fault</RequestId></ErrorResponse>"
            ),
        }
    }

    /// A successful awsQuery answer with an empty result (what moto does not implement).
    pub fn asg_ok(op: &str, times: usize) -> Fault {
        Fault {
            op: op.into(),
            times,
            status: 200,
            content_type: "text/xml",
            body: format!(
                "<{op}Response xmlns=\"http://autoscaling.amazonaws.com/doc/2011-01-01/\"><{op}Result/><ResponseMetadata><RequestId>canned-{op}</RequestId></ResponseMetadata></{op}Response>"
            ),
        }
    }
}

#[derive(Default)]
struct ProxyState {
    calls: Vec<Call>,
    faults: VecDeque<Fault>,
    served: u64,
    /// Lifecycle actions waiting, as (hook, instance id); `None`: not simulated.
    lifecycle: Option<Vec<(String, String)>>,
}

/// A form field of an awsQuery body (our hook names and instance ids need no decoding).
pub fn form_field<'a>(body: &'a str, key: &str) -> Option<&'a str> {
    body.split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

impl ProxyState {
    /// moto 5.2.5 implements neither CompleteLifecycleAction nor
    /// RecordLifecycleActionHeartbeat: once simulated, the proxy answers them from its list
    /// of waiting actions (a completed action is gone; an unknown one is a ValidationError).
    fn lifecycle_answer(&mut self, op: &str, body: &str) -> Option<Fault> {
        let waiting = self.lifecycle.as_mut()?;
        if op != "CompleteLifecycleAction" && op != "RecordLifecycleActionHeartbeat" {
            return None;
        }
        let hook = form_field(body, "LifecycleHookName").unwrap_or("");
        let iid = form_field(body, "InstanceId").unwrap_or("");
        let pos = waiting.iter().position(|(h, i)| h == hook && i == iid);
        Some(match pos {
            Some(p) => {
                if op == "CompleteLifecycleAction" {
                    waiting.remove(p);
                }
                Fault::asg_ok(op, 1)
            }
            None => Fault::asg_error(
                op,
                1,
                400,
                "ValidationError",
                &format!("No active Lifecycle Action found with instance ID {iid}"),
            ),
        })
    }
}

/// The proxy, running on the test's runtime.
#[derive(Clone)]
pub struct Proxy {
    pub url: String,
    state: Arc<Mutex<ProxyState>>,
}

impl Proxy {
    pub async fn start() -> Proxy {
        let upstream = moto().addr;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(Mutex::new(ProxyState::default()));
        let st = state.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let st = st.clone();
                tokio::spawn(async move {
                    let _ = handle(sock, upstream, st).await;
                });
            }
        });
        Proxy { url, state }
    }

    pub fn fault(&self, f: Fault) {
        self.state.lock().unwrap().faults.push_back(f);
    }

    /// Answers CompleteLifecycleAction and RecordLifecycleActionHeartbeat from now on, with
    /// an action waiting on `hook` for `instance_id` (call again to add more).
    pub fn lifecycle_wait(&self, hook: &str, instance_id: &str) {
        self.state
            .lock()
            .unwrap()
            .lifecycle
            .get_or_insert_with(Vec::new)
            .push((hook.to_string(), instance_id.to_string()));
    }

    /// Answers the two lifecycle actions from now on, with no action waiting.
    pub fn lifecycle_simulate(&self) {
        self.state
            .lock()
            .unwrap()
            .lifecycle
            .get_or_insert_with(Vec::new);
    }

    /// Lifecycle actions still waiting.
    pub fn lifecycle_waiting(&self) -> Vec<(String, String)> {
        self.state
            .lock()
            .unwrap()
            .lifecycle
            .clone()
            .unwrap_or_default()
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().unwrap().calls.clone()
    }

    /// The operations seen, in order.
    pub fn ops(&self) -> Vec<String> {
        self.calls().into_iter().map(|c| c.op).collect()
    }

    pub fn count(&self, op: &str) -> usize {
        self.calls().iter().filter(|c| c.op == op).count()
    }

    /// Calls of `op` whose body contains `needle`.
    pub fn count_with(&self, op: &str, needle: &str) -> usize {
        self.calls()
            .iter()
            .filter(|c| c.op == op && c.body.contains(needle))
            .count()
    }
}

async fn read_message(s: &mut TcpStream) -> std::io::Result<(Vec<u8>, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i + 4;
        }
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let len: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buf.len() < head_end + len {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = buf.split_off(head_end);
    Ok((buf, body))
}

fn find(h: &[u8], n: &[u8]) -> Option<usize> {
    h.windows(n.len()).position(|w| w == n)
}

/// Replaces any Connection header with `Connection: close`.
fn close_connection(head: &[u8]) -> Vec<u8> {
    let text = String::from_utf8_lossy(head);
    let mut out = String::new();
    for line in text.trim_end_matches("\r\n").split("\r\n") {
        if line.to_ascii_lowercase().starts_with("connection:") {
            continue;
        }
        out.push_str(line);
        out.push_str("\r\n");
    }
    out.push_str("Connection: close\r\n\r\n");
    out.into_bytes()
}

fn operation(head: &str, body: &str) -> String {
    for l in head.lines() {
        if let Some((k, v)) = l.split_once(':')
            && k.eq_ignore_ascii_case("x-amz-target")
        {
            return v.trim().rsplit('.').next().unwrap_or("").to_string();
        }
    }
    body.split('&')
        .find_map(|kv| kv.strip_prefix("Action="))
        .unwrap_or("?")
        .to_string()
}

async fn handle(
    mut client: TcpStream,
    upstream: SocketAddr,
    st: Arc<Mutex<ProxyState>>,
) -> std::io::Result<()> {
    let (head, body) = read_message(&mut client).await?;
    let head_s = String::from_utf8_lossy(&head).to_string();
    let body_s = String::from_utf8_lossy(&body).to_string();
    let op = operation(&head_s, &body_s);
    let fault = {
        let mut g = st.lock().unwrap();
        g.served += 1;
        let served = g.served;
        let pos = g.faults.iter().position(|f| f.op == op && f.times > 0);
        pos.map(|i| {
            g.faults[i].times -= 1;
            g.faults[i].clone()
        })
        .or_else(|| g.lifecycle_answer(&op, &body_s))
        .map(|f| (f, served))
    };
    let (status, response) = match fault {
        Some((f, n)) => {
            let resp = format!(
                "HTTP/1.1 {} Injected\r\nContent-Type: {}\r\nContent-Length: {}\r\nx-amzn-requestid: fault-{n}\r\nConnection: close\r\n\r\n{}",
                f.status,
                f.content_type,
                f.body.len(),
                f.body
            );
            (f.status, resp.into_bytes())
        }
        None => {
            let mut up = TcpStream::connect(upstream).await?;
            up.write_all(&close_connection(&head)).await?;
            up.write_all(&body).await?;
            let mut resp = Vec::new();
            up.read_to_end(&mut resp).await?;
            let split = find(&resp, b"\r\n\r\n").map_or(resp.len(), |i| i + 4);
            let status = String::from_utf8_lossy(&resp[..split])
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            let mut out = close_connection(&resp[..split]);
            out.extend_from_slice(&resp[split..]);
            (status, out)
        }
    };
    st.lock().unwrap().calls.push(Call {
        op,
        body: body_s,
        status,
        at: Instant::now(),
    });
    client.write_all(&response).await?;
    client.shutdown().await
}

/// What a fake HTTP server answers: (status, extra headers, body) for (method, path, head).
pub type Handler =
    Arc<dyn Fn(&str, &str, &str) -> (u16, Vec<(String, String)>, String) + Send + Sync>;

/// A tiny HTTP server on the current runtime (fake IMDS, fake ECS agent).
pub async fn serve_http(handler: Handler) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let handler = handler.clone();
            tokio::spawn(async move {
                let Ok((head, _)) = read_message(&mut sock).await else {
                    return;
                };
                let head = String::from_utf8_lossy(&head).to_string();
                let mut first = head.split_whitespace();
                let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
                let (status, headers, body) = handler(method, path, &head);
                let mut resp = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
                    body.len()
                );
                for (k, v) in headers {
                    resp.push_str(&format!("{k}: {v}\r\n"));
                }
                resp.push_str("\r\n");
                resp.push_str(&body);
                let _ = sock.write_all(resp.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    addr
}

// ---------------------------------------------------------------------------------------------
// SDK, seeding, configs, orders

/// An SDK configuration pointed at `endpoint` (moto or a proxy) with test credentials.
pub async fn sdk(endpoint: &str) -> SdkConfig {
    let aws = AwsConfig {
        region: Some(REGION.into()),
        endpoint_url: Some(endpoint.into()),
        ..AwsConfig::default()
    };
    gpu_medic::aws::loader(&aws)
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
        // The SDK's three attempts, with test-sized backoff.
        .retry_config(
            aws_config::retry::RetryConfig::standard()
                .with_max_attempts(3)
                .with_initial_backoff(Duration::from_millis(20)),
        )
        .load()
        .await
}

pub struct Node {
    pub instance_id: String,
    pub arn: String,
}

pub struct Seeded {
    pub cluster: String,
    pub asg: String,
    pub family: String,
    pub nodes: Vec<Node>,
}

/// An Auto Scaling group of `n` instances, each registered in a new cluster.
pub async fn seed(sdk: &SdkConfig, name: &str, n: usize) -> Seeded {
    let name = unique(name);
    let asg = aws_sdk_autoscaling::Client::new(sdk);
    let ecs = aws_sdk_ecs::Client::new(sdk);
    asg.create_launch_configuration()
        .launch_configuration_name(&name)
        .image_id("ami-12c6146b")
        .instance_type("t2.micro")
        .send()
        .await
        .unwrap();
    asg.create_auto_scaling_group()
        .auto_scaling_group_name(&name)
        .launch_configuration_name(&name)
        .min_size(0)
        .max_size(n as i32 * 3)
        .desired_capacity(n as i32)
        .availability_zones("us-east-1a")
        .send()
        .await
        .unwrap();
    ecs.create_cluster()
        .cluster_name(&name)
        .send()
        .await
        .unwrap();
    let ids = asg_instance_ids(sdk, &name).await;
    assert_eq!(ids.len(), n);
    let mut nodes = Vec::new();
    for iid in ids {
        let arn = register(sdk, &name, &iid).await;
        nodes.push(Node {
            instance_id: iid,
            arn,
        });
    }
    let family = format!("{name}-train");
    ecs.register_task_definition()
        .family(&family)
        .container_definitions(
            aws_sdk_ecs::types::ContainerDefinition::builder()
                .name("c")
                .image("busybox")
                .memory(16)
                .cpu(1)
                .build(),
        )
        .send()
        .await
        .unwrap();
    Seeded {
        cluster: name.clone(),
        asg: name,
        family,
        nodes,
    }
}

/// RegisterContainerInstance for an EC2 instance moto created; returns its ARN.
pub async fn register(sdk: &SdkConfig, cluster: &str, instance_id: &str) -> String {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    let doc = format!(r#"{{"instanceId":"{instance_id}","region":"{REGION}"}}"#);
    ecs.register_container_instance()
        .cluster(cluster)
        .instance_identity_document(doc)
        .send()
        .await
        .unwrap()
        .container_instance()
        .unwrap()
        .container_instance_arn()
        .unwrap()
        .to_string()
}

pub async fn asg_instance_ids(sdk: &SdkConfig, group: &str) -> Vec<String> {
    let asg = aws_sdk_autoscaling::Client::new(sdk);
    let r = asg
        .describe_auto_scaling_groups()
        .auto_scaling_group_names(group)
        .send()
        .await
        .unwrap();
    r.auto_scaling_groups()[0]
        .instances()
        .iter()
        .map(|i| i.instance_id().unwrap().to_string())
        .collect()
}

/// ASG health of each instance of the group.
pub async fn asg_health(sdk: &SdkConfig, group: &str) -> Vec<(String, String)> {
    let asg = aws_sdk_autoscaling::Client::new(sdk);
    let r = asg
        .describe_auto_scaling_groups()
        .auto_scaling_group_names(group)
        .send()
        .await
        .unwrap();
    r.auto_scaling_groups()[0]
        .instances()
        .iter()
        .map(|i| {
            (
                i.instance_id().unwrap().to_string(),
                i.health_status().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// StartTask on one instance; `group: Some("service:web")` plays a service's task.
pub async fn start_task(sdk: &SdkConfig, s: &Seeded, arn: &str, group: Option<&str>) -> String {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    ecs.start_task()
        .cluster(&s.cluster)
        .task_definition(&s.family)
        .container_instances(arn)
        .set_group(group.map(str::to_string))
        .send()
        .await
        .unwrap()
        .tasks()[0]
        .task_arn()
        .unwrap()
        .to_string()
}

/// (status, runningTasksCount, attributes) of a container instance.
pub async fn instance(
    sdk: &SdkConfig,
    cluster: &str,
    arn: &str,
) -> (String, i32, Vec<(String, Option<String>)>) {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    let r = ecs
        .describe_container_instances()
        .cluster(cluster)
        .container_instances(arn)
        .send()
        .await
        .unwrap();
    let ci = &r.container_instances()[0];
    (
        ci.status().unwrap().to_string(),
        ci.running_tasks_count(),
        ci.attributes()
            .iter()
            .map(|a| (a.name().to_string(), a.value().map(str::to_string)))
            .collect(),
    )
}

/// The desired status of a task.
pub async fn task_desired(sdk: &SdkConfig, cluster: &str, task: &str) -> String {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    let r = ecs
        .describe_tasks()
        .cluster(cluster)
        .tasks(task)
        .send()
        .await
        .unwrap();
    r.tasks()[0].desired_status().unwrap().to_string()
}

pub async fn stop(sdk: &SdkConfig, cluster: &str, task: &str) {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    ecs.stop_task()
        .cluster(cluster)
        .task(task)
        .send()
        .await
        .unwrap();
}

/// The `[identity]`, `[ecs]` and `[fleet]` sections for node `i`, plus `extra` TOML.
pub fn sections(s: &Seeded, i: usize, extra: &str) -> String {
    format!(
        "[identity]\ninstance_id = \"{}\"\ncluster = \"{}\"\ncontainer_instance_arn = \"{}\"\nauto_scaling_group = \"{}\"\n{extra}\n",
        s.nodes[i].instance_id, s.cluster, s.nodes[i].arn, s.asg,
    )
}

/// A config for node `i`: fast polls, no warmup, short settle. `ecs` and `fleet` are TOML
/// lines for those sections; a key given there replaces the test default.
pub fn config(s: &Seeded, i: usize, ecs: &str, fleet: &str) -> Config {
    let merge = |defaults: &[(&str, &str)], extra: &str| {
        let mut out = String::new();
        for (k, v) in defaults {
            if !extra
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{k} ")))
            {
                out.push_str(&format!("{k} = {v}\n"));
            }
        }
        out.push_str(extra);
        out.push('\n');
        out
    };
    let ecs = merge(
        &[
            ("standalone_grace", "\"300ms\""),
            ("drain_poll_interval", "\"100ms\""),
            ("force_stop_lead", "\"2s\""),
        ],
        ecs,
    );
    let fleet = merge(
        &[
            ("warmup", "\"0s\""),
            ("claim_settle", "\"150ms\""),
            ("retry_after", "\"300ms\""),
        ],
        fleet,
    );
    let text = format!("{}[ecs]\n{ecs}[fleet]\n{fleet}", sections(s, i, ""));
    Config::parse(Path::new("/tmp/gpu-medic-test.toml"), &text).unwrap()
}

pub fn order(command: Command, deadline: Duration) -> Order {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    Order {
        id: ActionId(N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
        incident: IncidentId(1),
        command,
        attempt: 1,
        deadline: Timestamp::now().plus(deadline),
    }
}
