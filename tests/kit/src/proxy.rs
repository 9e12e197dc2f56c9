//! A recording, fault-injecting HTTP/1 proxy in front of moto (or any upstream): it logs each
//! call's operation (ECS JSON `X-Amz-Target` or the awsQuery `Action`), stamps it when the
//! request was read in full (before forwarding: the moment it reached the control plane),
//! answers chosen operations itself (throttling, 5xx, access denied, and the two lifecycle
//! actions moto 5.2.5 lacks), holds back the answer to a chosen call until the test lets it
//! go ([`Proxy::hold`]: a caller stalled between a write and the next step), and forwards the
//! rest. With [`Proxy::weather`] it also throttles as AWS does, adds latency, 5xx bursts and
//! outages ([`crate::throttle`]); every call is recorded with its service, its caller (the
//! access key it was signed with) and its outcome, so the costs and the invariants of a fleet
//! are read from this record, never from gpu-medic's own log.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::http::{close_connection, find, read_message};
use crate::throttle::{HARNESS_KEY, Service, Verdict, Weather, access_key};

/// One call seen by the proxy.
#[derive(Debug, Clone)]
pub struct Call {
    pub op: String,
    pub body: String,
    /// Wall clock (ms) when the request was read in full, before it was forwarded.
    pub arrived_ms: f64,
    /// Wall clock (ms) when the answer was ready, just before it was written back.
    pub answered_ms: f64,
    /// 0 when the upstream did not answer.
    pub status: u16,
    /// Answered by the proxy itself (a fault or a simulated lifecycle action).
    pub injected: bool,
    /// The request line and headers (S3 calls: `x-amz-server-side-encryption`, ...).
    pub head: String,
    /// The service the call was for.
    pub service: Service,
    /// Who called: the access key id it was signed with ("" unsigned).
    pub node: String,
    /// Answered by the proxy's weather as the service answers a throttled call.
    pub throttled: bool,
    /// Bytes of the request body and of the answer (head and body).
    pub request_bytes: usize,
    pub response_bytes: usize,
}

impl Call {
    /// A request header's value (case-insensitive name).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

#[derive(Debug, Clone)]
enum Reply {
    Fixed {
        status: u16,
        content_type: &'static str,
        body: String,
    },
    /// The service's own throttling error ([`Service::throttled`]: ECS
    /// `ThrottlingException`, Auto Scaling `Throttling`, EC2 `RequestLimitExceeded`, ...),
    /// whichever operation it meets.
    Throttle,
    /// No answer: the connection is closed once the request is read (an unreachable
    /// endpoint, as the SDK sees it: a dispatch failure).
    Hangup,
}

/// An answer the proxy gives itself, `times` times, for one operation ("" = any operation).
#[derive(Debug, Clone)]
pub struct Fault {
    pub op: String,
    pub times: usize,
    reply: Reply,
}

impl Fault {
    fn ecs(op: &str, times: usize, status: u16, code: &str, message: &str) -> Fault {
        Fault {
            op: op.into(),
            times,
            reply: Reply::Fixed {
                status,
                content_type: "application/x-amz-json-1.1",
                body: format!(r#"{{"__type":"{code}","message":"{message}"}}"#),
            },
        }
    }

    /// A DynamoDB error (JSON 1.0 protocol), e.g. `ProvisionedThroughputExceededException`.
    pub fn dynamodb(op: &str, times: usize, status: u16, code: &str, message: &str) -> Fault {
        Fault {
            op: op.into(),
            times,
            reply: Reply::Fixed {
                status,
                content_type: "application/x-amz-json-1.0",
                body: format!(
                    r#"{{"__type":"com.amazonaws.dynamodb.v20120810#{code}","message":"{message}"}}"#
                ),
            },
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
            reply: Reply::Fixed {
                status,
                content_type: "text/xml",
                body: format!(
                    "<ErrorResponse xmlns=\"http://autoscaling.amazonaws.com/doc/2011-01-01/\"><Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message></Error><RequestId>fault</RequestId></ErrorResponse>"
                ),
            },
        }
    }

    /// A successful awsQuery answer with an empty result (what moto does not implement).
    pub fn asg_ok(op: &str, times: usize) -> Fault {
        Fault {
            op: op.into(),
            times,
            reply: Reply::Fixed {
                status: 200,
                content_type: "text/xml",
                body: format!(
                    "<{op}Response xmlns=\"http://autoscaling.amazonaws.com/doc/2011-01-01/\"><{op}Result/><ResponseMetadata><RequestId>canned-{op}</RequestId></ResponseMetadata></{op}Response>"
                ),
            },
        }
    }

    /// Answers `op` with this status, content type and body (what moto gets wrong or lacks).
    pub fn canned(
        op: &str,
        times: usize,
        status: u16,
        content_type: &'static str,
        body: String,
    ) -> Fault {
        Fault {
            op: op.into(),
            times,
            reply: Reply::Fixed {
                status,
                content_type,
                body,
            },
        }
    }

    /// The next `times` calls of `op` ("" = any operation) throttled in their protocol's words.
    pub fn throttle(op: &str, times: usize) -> Fault {
        Fault {
            op: op.into(),
            times,
            reply: Reply::Throttle,
        }
    }

    /// The next `times` calls of `op` ("" = any operation) get no answer at all.
    pub fn hangup(op: &str, times: usize) -> Fault {
        Fault {
            op: op.into(),
            times,
            reply: Reply::Hangup,
        }
    }

    /// (status, content type, body) of the answer to a call of `op` to `service`.
    fn answer(&self, service: Service, op: &str) -> (u16, &'static str, String) {
        match &self.reply {
            Reply::Fixed {
                status,
                content_type,
                body,
            } => (*status, content_type, body.clone()),
            Reply::Throttle => service.throttled(op),
            Reply::Hangup => (0, "", String::new()),
        }
    }
}

/// A call whose answer the proxy holds back (see [`Proxy::hold`]).
#[derive(Clone)]
pub struct Hold {
    op: String,
    needles: Vec<String>,
    held: Arc<std::sync::atomic::AtomicBool>,
    gate: Arc<tokio::sync::Notify>,
}

impl Hold {
    /// Whether the call came and its answer is being held.
    pub fn is_held(&self) -> bool {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets the held answer go to the caller.
    pub fn release(&self) {
        self.gate.notify_one();
    }

    fn matches(&self, op: &str, body: &str) -> bool {
        self.op == op && self.needles.iter().all(|n| body.contains(n.as_str()))
    }
}

#[derive(Default)]
struct ProxyState {
    /// Calls whose answers are to be held, each once.
    holds: Vec<Hold>,
    calls: Vec<Call>,
    faults: VecDeque<Fault>,
    answered: u64,
    forwarded: u64,
    /// Lifecycle actions waiting, as (hook, instance id); `None`: not simulated.
    lifecycle: Option<Vec<(String, String)>>,
    /// `gpuDevices` added to DescribeContainerInstances answers, by container instance ARN.
    gpu_devices: Vec<(String, serde_json::Value)>,
    /// `healthStatus` added to DescribeContainerInstances answers, by container instance ARN.
    health: Vec<(String, serde_json::Value)>,
    /// AWS-shaped throttling, latency, 5xx bursts and outages; None: none.
    weather: Option<Weather>,
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

    /// The fault that answers this call, if any (using one of its `times`).
    fn take_fault(&mut self, op: &str, body: &str) -> Option<Fault> {
        let pos = self
            .faults
            .iter()
            .position(|f| f.times > 0 && (f.op.is_empty() || f.op == op));
        let fault = pos.map(|i| {
            self.faults[i].times -= 1;
            self.faults[i].clone()
        });
        self.faults.retain(|f| f.times > 0);
        fault.or_else(|| self.lifecycle_answer(op, body))
    }
}

/// The proxy, running on the runtime that started it.
#[derive(Clone)]
pub struct Proxy {
    pub url: String,
    pub addr: SocketAddr,
    state: Arc<Mutex<ProxyState>>,
}

impl Proxy {
    /// A proxy in front of this binary's moto ([`crate::aws::moto`]).
    pub async fn start() -> Proxy {
        Proxy::to(crate::aws::moto().addr).await
    }

    /// A proxy in front of `upstream`.
    pub async fn to(upstream: SocketAddr) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let state = Arc::new(Mutex::new(ProxyState::default()));
        let st = state.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let _ = sock.set_nodelay(true);
                let st = st.clone();
                tokio::spawn(async move {
                    let _ = handle(sock, upstream, st).await;
                });
            }
        });
        Proxy {
            url: format!("http://{addr}"),
            addr,
            state,
        }
    }

    pub fn fault(&self, f: Fault) {
        self.state.lock().unwrap().faults.push_back(f);
    }

    /// Throttles the next `times` calls of `op` ("" = any operation).
    pub fn throttle(&self, op: &str, times: usize) {
        self.fault(Fault::throttle(op, times));
    }

    /// From now on, every call not signed with the harness's key ([`HARNESS_KEY`]) meets
    /// `w`: AWS's token buckets (scaled), latency, 5xx bursts and outages.
    pub fn weather(&self, w: Weather) {
        self.state.lock().unwrap().weather = Some(w);
    }

    /// Changes the weather (a 5xx burst, an outage, latency); nothing without
    /// [`Proxy::weather`].
    pub fn with_weather(&self, f: impl FnOnce(&mut Weather)) {
        if let Some(w) = self.state.lock().unwrap().weather.as_mut() {
            f(w);
        }
    }

    /// The next call of `op` whose body contains every one of `needles` is forwarded, and the
    /// upstream's answer held back until [`Hold::release`]: the write has happened, the caller
    /// does not know yet.
    pub fn hold(&self, op: &str, needles: &[&str]) -> Hold {
        let h = Hold {
            op: op.into(),
            needles: needles.iter().map(|n| n.to_string()).collect(),
            held: Arc::default(),
            gate: Arc::default(),
        };
        self.state.lock().unwrap().holds.push(h.clone());
        h
    }

    /// Drops every fault not yet used up.
    pub fn clear_faults(&self) {
        self.state.lock().unwrap().faults.clear();
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

    /// Adds `gpuDevices` (ECS's view of each GPU; build entries with [`gpu_device`]) to the
    /// container instance `arn` in every DescribeContainerInstances answer from now on: moto
    /// 5.2.5 has no such field. Call again to change them; an empty list removes them.
    pub fn gpu_devices(&self, arn: &str, devices: Vec<serde_json::Value>) {
        let mut g = self.state.lock().unwrap();
        g.gpu_devices.retain(|(a, _)| a != arn);
        if !devices.is_empty() {
            g.gpu_devices
                .push((arn.to_string(), serde_json::Value::Array(devices)));
        }
    }

    /// Adds `healthStatus` (the ECS agent's health checks; build it with [`health_status`]) to
    /// the container instance `arn` in every DescribeContainerInstances answer from now on:
    /// moto 5.2.5 has no such field. None removes it.
    pub fn health_status(&self, arn: &str, health: Option<serde_json::Value>) {
        let mut g = self.state.lock().unwrap();
        g.health.retain(|(a, _)| a != arn);
        if let Some(h) = health {
            g.health.push((arn.to_string(), h));
        }
    }

    /// The calls recorded since the last take (and forgets them).
    pub fn take_calls(&self) -> Vec<Call> {
        std::mem::take(&mut self.state.lock().unwrap().calls)
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

    /// (calls the proxy answered itself, calls forwarded upstream), since it started.
    pub fn counts(&self) -> (u64, u64) {
        let g = self.state.lock().unwrap();
        (g.answered, g.forwarded)
    }
}

/// The S3 REST operation of a request without a target or an `Action` (path-style: the
/// bucket is the first path segment).
fn s3_operation(head: &str) -> Option<&'static str> {
    let line = head.lines().next()?;
    let mut it = line.split_whitespace();
    let (method, target) = (it.next()?, it.next()?);
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let has = |k: &str| {
        query
            .split('&')
            .any(|kv| kv == k || kv.starts_with(&format!("{k}=")))
    };
    // The SDK names the operation itself (`?x-id=PutObject`) on most object calls.
    if let Some(id) = query.split('&').find_map(|kv| kv.strip_prefix("x-id=")) {
        for known in [
            "PutObject",
            "GetObject",
            "UploadPart",
            "CreateMultipartUpload",
            "CompleteMultipartUpload",
            "AbortMultipartUpload",
            "ListParts",
            "CreateBucket",
        ] {
            if id == known {
                return Some(known);
            }
        }
    }
    // An object has a key after the bucket (`PUT /bucket/` is the bucket itself).
    let object = path
        .trim_start_matches('/')
        .split_once('/')
        .is_some_and(|(_, key)| !key.is_empty());
    Some(match (method, object) {
        ("PUT", true) if has("partNumber") => "UploadPart",
        ("PUT", true) => "PutObject",
        ("POST", true) if has("uploads") => "CreateMultipartUpload",
        ("POST", true) if has("uploadId") => "CompleteMultipartUpload",
        ("DELETE", true) if has("uploadId") => "AbortMultipartUpload",
        ("GET", true) if has("uploadId") => "ListParts",
        ("GET", true) => "GetObject",
        ("HEAD", true) => "HeadObject",
        ("PUT", false) => "CreateBucket",
        ("GET", false) => "ListObjects",
        _ => return None,
    })
}

/// (operation, service) of a request.
fn operation(head: &str, body: &str) -> (String, Service) {
    for l in head.lines() {
        if let Some((k, v)) = l.split_once(':')
            && k.eq_ignore_ascii_case("x-amz-target")
        {
            let target = v.trim();
            let op = target.rsplit('.').next().unwrap_or("").to_string();
            return (op, Service::of(Some(target), "", false));
        }
    }
    let service = Service::of(None, body, s3_operation(head).is_some());
    let op = body
        .split('&')
        .find_map(|kv| kv.strip_prefix("Action="))
        .map(str::to_string)
        .or_else(|| s3_operation(head).map(str::to_string))
        .unwrap_or_else(|| "?".to_string());
    (op, service)
}

/// What answers one call: a queued fault, the weather, or the upstream.
enum Answer {
    Fault(Fault, u64),
    Weather(Verdict),
    Forward(Duration),
}

/// The answer the proxy gives itself: `status` 0 (a hangup) writes nothing.
fn injected(status: u16, content_type: &str, body: &str, n: u64) -> (u16, Vec<u8>) {
    if status == 0 {
        return (0, Vec::new());
    }
    let resp = format!(
        "HTTP/1.1 {status} Injected\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nx-amzn-requestid: fault-{n}\r\nConnection: close\r\n\r\n{body}",
        body.len(),
    );
    (status, resp.into_bytes())
}

/// Decides who answers a call of `op` to `service` by `node`: queued faults first, then the
/// weather (never for the harness's own calls), else the upstream after the weather's delay.
fn decide(st: &Mutex<ProxyState>, op: &str, service: Service, node: &str, body: &str) -> Answer {
    let mut g = st.lock().unwrap();
    if let Some(f) = g.take_fault(op, body) {
        g.answered += 1;
        let n = g.answered;
        return Answer::Fault(f, n);
    }
    let verdict = match g.weather.as_mut() {
        Some(w) if node != HARNESS_KEY => w.judge(service, op),
        _ => Verdict::Pass {
            delay: Duration::ZERO,
        },
    };
    match verdict {
        Verdict::Pass { delay } => {
            g.forwarded += 1;
            Answer::Forward(delay)
        }
        v => {
            g.answered += 1;
            Answer::Weather(v)
        }
    }
}

async fn handle(
    mut client: TcpStream,
    upstream: SocketAddr,
    st: Arc<Mutex<ProxyState>>,
) -> std::io::Result<()> {
    // One request per connection (we answer `Connection: close`).
    let (head, body) = read_message(&mut client).await?;
    let arrived_ms = crate::now_ms();
    let head_s = String::from_utf8_lossy(&head).to_string();
    // S3 bodies (archive parts) are recorded by size only.
    let body_s = if s3_operation(&head_s).is_some()
        && !head_s.to_ascii_lowercase().contains("x-amz-target")
        && !body.starts_with(b"Action=")
    {
        format!("({} bytes)", body.len())
    } else {
        String::from_utf8_lossy(&body).to_string()
    };
    let (op, service) = operation(
        &head_s,
        &String::from_utf8_lossy(&body[..body.len().min(4096)]),
    );
    let node = access_key(&head_s).unwrap_or("").to_string();
    let answer = decide(&st, &op, service, &node, &body_s);
    let (injected_by_proxy, throttled) = match &answer {
        Answer::Fault(..) => (true, false),
        Answer::Weather(v) => (true, *v == Verdict::Throttle),
        Answer::Forward(_) => (false, false),
    };
    let hold = if injected_by_proxy {
        None
    } else {
        let mut g = st.lock().unwrap();
        let i = g.holds.iter().position(|h| h.matches(&op, &body_s));
        i.map(|i| g.holds.remove(i))
    };
    let (status, response) = match answer {
        Answer::Fault(f, n) => {
            let (status, content_type, text) = f.answer(service, &op);
            injected(status, content_type, &text, n)
        }
        Answer::Weather(Verdict::Throttle) => {
            let (status, content_type, text) = service.throttled(&op);
            injected(status, content_type, &text, 0)
        }
        Answer::Weather(Verdict::Fail) => {
            let (status, content_type, text) = service.unavailable();
            injected(status, content_type, &text, 0)
        }
        Answer::Weather(_) => (0, Vec::new()),
        Answer::Forward(delay) => {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            forward(upstream, &head, &body, &op, &st).await
        }
    };
    if let Some(h) = hold {
        h.held.store(true, std::sync::atomic::Ordering::SeqCst);
        h.gate.notified().await;
    }
    st.lock().unwrap().calls.push(Call {
        op,
        request_bytes: body.len(),
        response_bytes: response.len(),
        body: body_s,
        arrived_ms,
        answered_ms: crate::now_ms(),
        status,
        injected: injected_by_proxy,
        head: head_s,
        service,
        node,
        throttled,
    });
    if !response.is_empty() {
        client.write_all(&response).await?;
    }
    client.shutdown().await
}

/// The upstream's answer to the request (status 0 and nothing when it did not answer), with
/// the fields moto lacks added to DescribeContainerInstances answers.
async fn forward(
    upstream: SocketAddr,
    head: &[u8],
    body: &[u8],
    op: &str,
    st: &Mutex<ProxyState>,
) -> (u16, Vec<u8>) {
    let forwarded = async {
        let mut up = TcpStream::connect(upstream).await?;
        up.write_all(&close_connection(head)).await?;
        up.write_all(body).await?;
        let mut resp = Vec::new();
        up.read_to_end(&mut resp).await?;
        Ok::<_, std::io::Error>(resp)
    }
    .await;
    let Ok(resp) = forwarded else {
        return (0, Vec::new());
    };
    let split = find(&resp, b"\r\n\r\n").map_or(resp.len(), |i| i + 4);
    let status = String::from_utf8_lossy(&resp[..split])
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let (devices, health) = {
        let g = st.lock().unwrap();
        (g.gpu_devices.clone(), g.health.clone())
    };
    let resp = if op == "DescribeContainerInstances" && !devices.is_empty() {
        with_field(&resp[..split], &resp[split..], "gpuDevices", &devices)
    } else {
        resp
    };
    let split = find(&resp, b"\r\n\r\n").map_or(resp.len(), |i| i + 4);
    let resp = if op == "DescribeContainerInstances" && !health.is_empty() {
        with_field(&resp[..split], &resp[split..], "healthStatus", &health)
    } else {
        resp
    };
    let split = find(&resp, b"\r\n\r\n").map_or(resp.len(), |i| i + 4);
    let mut out = close_connection(&resp[..split]);
    out.extend_from_slice(&resp[split..]);
    (status, out)
}

/// One `gpuDevices` entry as ECS writes it (API type `GpuDevice`).
pub fn gpu_device(
    gpu_id: &str,
    sharing_mode: &str,
    total_mib: i64,
    remaining_mib: i64,
    containers: i64,
) -> serde_json::Value {
    serde_json::json!({
        "gpuId": gpu_id,
        "sharingMode": sharing_mode,
        "totalMemoryInMiB": total_mib,
        "remainingMemoryInMiB": remaining_mib,
        "containerCount": containers,
    })
}

/// One `healthStatus` as ECS writes it (API type `ContainerInstanceHealthStatus`): the overall
/// status and one `ACCELERATED_COMPUTE` detail with `accelerated` as its status.
pub fn health_status(overall: &str, accelerated: &str) -> serde_json::Value {
    serde_json::json!({
        "overallStatus": overall,
        "details": [
            {"type": "CONTAINER_RUNTIME", "status": "OK"},
            {"type": "ACCELERATED_COMPUTE", "status": accelerated,
             "lastStatusChange": 1_700_000_000.0, "lastUpdated": 1_700_000_000.0},
        ],
    })
}

/// moto's DescribeContainerInstances answer (`head`, `body`) with `field` added to the
/// container instances named in `devices`, and the Content-Length made to fit. An answer
/// that is not the JSON expected is passed on unchanged.
fn with_field(
    head: &[u8],
    body: &[u8],
    field: &str,
    devices: &[(String, serde_json::Value)],
) -> Vec<u8> {
    let unchanged = || [head, body].concat();
    let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return unchanged();
    };
    let Some(list) = v
        .get_mut("containerInstances")
        .and_then(|c| c.as_array_mut())
    else {
        return unchanged();
    };
    for ci in list {
        let arn = ci
            .get("containerInstanceArn")
            .and_then(|a| a.as_str())
            .unwrap_or("")
            .to_string();
        if let Some((_, d)) = devices.iter().find(|(a, _)| *a == arn)
            && let Some(obj) = ci.as_object_mut()
        {
            obj.insert(field.into(), d.clone());
        }
    }
    let body = serde_json::to_vec(&v).unwrap();
    let text = String::from_utf8_lossy(head);
    let kept: Vec<&str> = text
        .split("\r\n")
        .filter(|l| !l.is_empty() && !l.to_ascii_lowercase().starts_with("content-length:"))
        .collect();
    let head = format!(
        "{}\r\nContent-Length: {}\r\n\r\n",
        kept.join("\r\n"),
        body.len()
    );
    [head.into_bytes(), body].concat()
}

#[cfg(test)]
mod tests {
    use super::s3_operation;

    #[test]
    fn s3_calls_are_named_by_their_operation_not_their_method() {
        let op = |line: &str| s3_operation(&format!("{line} HTTP/1.1\r\nhost: x\r\n"));
        // The SDK's CreateBucket is `PUT /bucket/` (path-style): not an object.
        assert_eq!(op("PUT /b/"), Some("CreateBucket"));
        assert_eq!(op("PUT /b"), Some("CreateBucket"));
        assert_eq!(op("PUT /b/k/1.tar.gz?x-id=PutObject"), Some("PutObject"));
        assert_eq!(op("PUT /b/k?partNumber=2&uploadId=u"), Some("UploadPart"));
        assert_eq!(op("POST /b/k?uploads"), Some("CreateMultipartUpload"));
        assert_eq!(op("GET /b/k?x-id=GetObject"), Some("GetObject"));
        assert_eq!(op("GET /b/?list-type=2"), Some("ListObjects"));
    }
}
