//! Prometheus metrics, off by default (`[metrics] enabled`), served on a loopback address.
//! They are derived from what the engine consumes and emits, in the supervisor's one
//! engine task, so they can never disagree with the journal.

mod links;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::accounting::usage::Accounting;
use crate::engine::{GpuStatus, State};
use crate::model::{
    Action, ActionId, Command, IncidentEvent, IncidentState, Input, OutcomeStatus, Signal, Verdict,
};
use crate::policy::Policy;

type Labels = Vec<(String, String)>;

/// Every metric gpu-medic exports.
pub struct Metrics {
    registry: Registry,
    gpu_health: Family<Labels, Gauge>,
    xids: Family<Labels, Counter>,
    signals: Family<Labels, Counter>,
    mps_probe_latency: Histogram,
    mps_restarts: Counter,
    remediations: Family<Labels, Counter>,
    /// Node repairs by rung (drain, reboot, replace) and how they ended.
    repairs: Family<Labels, Counter>,
    aws_call_errors: Family<Labels, Counter>,
    incidents_open: Gauge,
    incidents: Family<Labels, Counter>,
    node_phase: Family<Labels, Gauge>,
    self_fault: Family<Labels, Gauge>,
    /// Components that ever had a self-fault (their gauge goes back to 0, not away).
    self_fault_seen: Mutex<std::collections::BTreeSet<String>>,
    /// The health series the engine ever set, by GPU index (back to 0 when the engine
    /// forgets the GPU, e.g. after an abort, never left at its last value).
    gpu_health_seen: Mutex<BTreeMap<u32, Labels>>,
    /// Commands of orders started, to label their outcomes.
    started: Mutex<BTreeMap<ActionId, &'static str>>,
    task_gpu_memory: Family<Labels, Gauge>,
    task_gpu_processes: Family<Labels, Gauge>,
    task_gpu_memory_reserved: Family<Labels, Gauge>,
    task_gpu_memory_over_reservation: Family<Labels, Gauge>,
    /// The NVML poller's latest GPUs and per-task use, read at each scrape.
    accounting: Option<Accounting>,
    /// AWS-planned disruptions (docs/planned-events.md).
    planned: PlannedMetrics,
    /// The fabric, NVLinks, PCIe and RDMA ports (docs/fabric.md), from the link probes' views.
    links: links::LinkMetrics,
    /// Where those views are; `None`: no link series.
    link_views: Option<crate::config::StateDir>,
}

/// The series of AWS-planned disruptions and the ECS agent's verdict.
#[derive(Default)]
struct PlannedMetrics {
    events: Family<Labels, Gauge>,
    next_drain: Gauge,
    agent_impaired: Gauge,
    /// Label sets ever set (back to 0, not left at their last value).
    seen: Mutex<std::collections::BTreeSet<Labels>>,
}

impl PlannedMetrics {
    fn register(registry: &mut Registry) -> Self {
        let p = PlannedMetrics::default();
        registry.register(
            "planned_events",
            "AWS-planned disruptions not yet over, by disruption (stop, reboot, maintenance, spot, rebalance) and phase (waiting, started, drained)",
            p.events.clone(),
        );
        registry.register(
            "planned_next_drain_timestamp_seconds",
            "When the next planned drain starts (Unix seconds; 0: none waiting)",
            p.next_drain.clone(),
        );
        registry.register(
            "ecs_agent_accelerated_impaired",
            "1 while the ECS agent reports ACCELERATED_COMPUTE IMPAIRED (a second opinion, not gpu-medic's verdict)",
            p.agent_impaired.clone(),
        );
        p
    }

    fn record(&self, state: &State) {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let mut now: BTreeMap<Labels, i64> = seen.iter().map(|l| (l.clone(), 0)).collect();
        let mut next: Option<u64> = None;
        for (_, e) in state.planned.pending() {
            let d = serde_json::to_value(e.disruption)
                .ok()
                .and_then(|v| v.as_str().map(str::to_string))
                .unwrap_or_default();
            let labels: Labels = vec![
                ("disruption".into(), d),
                ("phase".into(), e.phase.as_str().into()),
            ];
            *now.entry(labels).or_default() += 1;
            if e.phase == crate::engine::planned::PlannedPhase::Waiting
                && let Some(t) = e.drain_at
            {
                next = Some(next.map_or(t.0, |n| n.min(t.0)));
            }
        }
        for (labels, n) in now {
            self.events.get_or_create(&labels).set(n);
            seen.insert(labels);
        }
        self.next_drain
            .set(next.map_or(0, |ms| i64::try_from(ms / 1000).unwrap_or(i64::MAX)));
        self.agent_impaired.set(i64::from(
            state
                .planned
                .agent
                .as_ref()
                .is_some_and(crate::model::AgentVerdict::impaired),
        ));
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("gpu_medic");
        let gpu_health = Family::<Labels, Gauge>::default();
        registry.register(
            "gpu_health",
            "GPU health: 0 healthy, 1 suspect (awaiting confirmation), 2 faulted",
            gpu_health.clone(),
        );
        let xids = Family::<Labels, Counter>::default();
        registry.register("xids", "XIDs seen, by GPU and code", xids.clone());
        let signals = Family::<Labels, Counter>::default();
        registry.register(
            "signals",
            "Observations judged, by signal kind",
            signals.clone(),
        );
        let mps_probe_latency =
            Histogram::new([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]);
        registry.register(
            "mps_probe_latency_seconds",
            "Time the MPS control daemon took to answer a probe",
            mps_probe_latency.clone(),
        );
        let mps_restarts = Counter::default();
        registry.register(
            "mps_restarts",
            "MPS daemon restarts started",
            mps_restarts.clone(),
        );
        let remediations = Family::<Labels, Counter>::default();
        registry.register(
            "remediations",
            "Remediation actions, by action and outcome (done, failed, retryable, deferred; not-executed: observe-only, or the remedy is not available on this node)",
            remediations.clone(),
        );
        let repairs = Family::<Labels, Counter>::default();
        registry.register(
            "repairs",
            "Node repairs by rung and result (reboot: repaired, escalated, not-rebooted; replace: replaced; drain: drained)",
            repairs.clone(),
        );
        let aws_call_errors = Family::<Labels, Counter>::default();
        registry.register(
            "aws_call_errors",
            "Control-plane (ECS, Auto Scaling) actions that failed, by action",
            aws_call_errors.clone(),
        );
        let incidents_open = Gauge::default();
        registry.register(
            "incidents_open",
            "Incidents not yet closed",
            incidents_open.clone(),
        );
        let incidents = Family::<Labels, Counter>::default();
        registry.register(
            "incidents",
            "Incidents opened, by first signal kind, verdict at opening and whether it is a drill (drill=\"true\": `gpu-medic drill`)",
            incidents.clone(),
        );
        let node_phase = Family::<Labels, Gauge>::default();
        registry.register(
            "node_phase",
            "1 for the node's current phase (in-service, quarantined, draining, ...)",
            node_phase.clone(),
        );
        let self_fault = Family::<Labels, Gauge>::default();
        registry.register(
            "self_fault",
            "1 while gpu-medic itself cannot do part of its job (component: nvml, mps-control, state-file, ecs-gpu-view): a mistake or a fault of gpu-medic, never remediated",
            self_fault.clone(),
        );
        let task_gpu_memory = Family::<Labels, Gauge>::default();
        registry.register(
            "task_gpu_memory_bytes",
            "GPU memory used by an ECS task's container on a GPU (sum of its MPS client processes, NVML's per-process usedGpuMemory), at the last poll",
            task_gpu_memory.clone(),
        );
        let task_gpu_processes = Family::<Labels, Gauge>::default();
        registry.register(
            "task_gpu_processes",
            "MPS client processes of an ECS task's container on a GPU, at the last poll (unknown=\"true\": NVML did not report their memory)",
            task_gpu_processes.clone(),
        );
        let task_gpu_memory_reserved = Family::<Labels, Gauge>::default();
        registry.register(
            "task_gpu_memory_reserved_bytes",
            "GPU memory an ECS task's container reserves (its task definition's sharingStrategy.nvidiaMps.memory), once its task definition was read",
            task_gpu_memory_reserved.clone(),
        );
        let task_gpu_memory_over_reservation = Family::<Labels, Gauge>::default();
        registry.register(
            "task_gpu_memory_over_reservation",
            "1 while an ECS task's processes together use more GPU memory than [nvml] reservation_alert of its reservation (the sum of its containers'), else 0",
            task_gpu_memory_over_reservation.clone(),
        );
        let planned = PlannedMetrics::register(&mut registry);
        let links = links::LinkMetrics::register(&mut registry);
        Metrics {
            planned,
            links,
            link_views: None,
            task_gpu_memory,
            task_gpu_processes,
            task_gpu_memory_reserved,
            task_gpu_memory_over_reservation,
            accounting: None,
            registry,
            self_fault,
            self_fault_seen: Mutex::new(Default::default()),
            gpu_health_seen: Mutex::new(Default::default()),
            gpu_health,
            xids,
            signals,
            mps_probe_latency,
            mps_restarts,
            remediations,
            repairs,
            aws_call_errors,
            incidents_open,
            incidents,
            node_phase,
            started: Mutex::new(BTreeMap::new()),
        }
    }

    /// Per-task GPU memory and a health series for every GPU come from `accounting`.
    pub fn with_accounting(mut self, accounting: Accounting) -> Self {
        self.accounting = Some(accounting);
        self
    }

    /// The link series come from the views the link probes write under `files` (read at
    /// each scrape).
    pub fn with_link_views(mut self, files: crate::config::StateDir) -> Self {
        self.link_views = Some(files);
        self
    }

    /// Updates the metrics from one engine step. An observation counts as a signal only
    /// when a rule of `policy` takes it at its value: a routine reading (a state disk 20 %
    /// used, an MPS probe that answered) is not a signal.
    pub fn record(&self, input: &Input, actions: &[Action], state: &State, policy: &Policy) {
        self.record_input(input, policy);
        self.record_events(actions);
        self.record_state(state);
    }

    /// What an observation counts: signals a rule judges, XIDs by code, MPS probe latency.
    fn record_input(&self, input: &Input, policy: &Policy) {
        if let Input::Observation(o) = input {
            if policy.rule_for(&o.signal, o.value).is_some() {
                self.signals
                    .get_or_create(&vec![("signal".into(), o.signal.kind().as_str().into())])
                    .inc();
            }
            match &o.signal {
                Signal::Xid { code, .. } => {
                    let gpu = o
                        .gpu
                        .as_ref()
                        .map_or("-".to_string(), |g| g.index.to_string());
                    self.xids
                        .get_or_create(&vec![
                            ("gpu".into(), gpu),
                            ("code".into(), code.to_string()),
                        ])
                        .inc();
                }
                Signal::MpsUp => self.mps_probe_latency.observe(o.value as f64 / 1000.0),
                _ => {}
            }
        }
    }

    /// What the journal's records count: incidents, remediations and their outcomes, AWS
    /// call errors, MPS restarts, repairs by rung.
    fn record_events(&self, actions: &[Action]) {
        let mut started = self.started.lock().unwrap_or_else(|p| p.into_inner());
        for a in actions {
            let Action::Log(r) = a else { continue };
            match &r.event {
                IncidentEvent::Opened {
                    observation,
                    verdict,
                    ..
                } => {
                    self.incidents
                        .get_or_create(&vec![
                            ("signal".into(), observation.signal.kind().as_str().into()),
                            ("action".into(), verdict.as_str().into()),
                            ("drill".into(), r.drill.is_some().to_string()),
                        ])
                        .inc();
                }
                IncidentEvent::ActionStarted {
                    order,
                    dry_run: true,
                } => {
                    self.remediations
                        .get_or_create(&vec![
                            ("action".into(), order.command.name().into()),
                            ("outcome".into(), "not-executed".into()),
                        ])
                        .inc();
                }
                IncidentEvent::ActionStarted {
                    order,
                    dry_run: false,
                } => {
                    started.insert(order.id, order.command.name());
                    if order.command == Command::RestartMps {
                        self.mps_restarts.inc();
                    }
                }
                IncidentEvent::ActionFinished { outcome } => {
                    let action = started.remove(&outcome.action).unwrap_or("unknown");
                    let result = match outcome.status {
                        OutcomeStatus::Done => "done",
                        OutcomeStatus::Failed { retryable: true } => "retryable",
                        OutcomeStatus::Failed { retryable: false } => "failed",
                        OutcomeStatus::Deferred { .. } => "deferred",
                    };
                    self.remediations
                        .get_or_create(&vec![
                            ("action".into(), action.into()),
                            ("outcome".into(), result.into()),
                        ])
                        .inc();
                    let aws = !matches!(action, "restart-mps" | "unknown");
                    if aws && matches!(outcome.status, OutcomeStatus::Failed { .. }) {
                        self.aws_call_errors
                            .get_or_create(&vec![("action".into(), action.into())])
                            .inc();
                    }
                }
                IncidentEvent::DeadlineMissed { action, .. } => {
                    started.remove(action);
                }
                IncidentEvent::Escalated { rule, reason, .. }
                    if rule == crate::engine::repair::RULE_REBOOT_FAILED =>
                {
                    let result = if reason.contains("did not happen") {
                        "not-rebooted"
                    } else {
                        "escalated"
                    };
                    self.repair(Verdict::Reboot, result);
                }
                IncidentEvent::Closed { state: s, .. } => match s {
                    IncidentState::Repaired => self.repair(Verdict::Reboot, "repaired"),
                    IncidentState::Replaced => self.repair(Verdict::Replace, "replaced"),
                    IncidentState::Drained => self.repair(Verdict::Drain, "drained"),
                    _ => {}
                },
                _ => {}
            }
        }
        drop(started);
    }

    /// The gauges that follow the engine's state: GPU health, open incidents, self-faults,
    /// the node's phase, AWS-planned disruptions.
    fn record_state(&self, state: &State) {
        let mut health_seen = self
            .gpu_health_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for (index, labels) in health_seen.iter() {
            if !state.gpus.contains_key(index) {
                self.gpu_health.get_or_create(labels).set(0);
            }
        }
        for (index, h) in &state.gpus {
            let v = match h.status {
                GpuStatus::Healthy => 0,
                GpuStatus::Suspect => 1,
                GpuStatus::Faulted => 2,
            };
            // One series per GPU: a signal that did not name the UUID (a kernel-log XID) uses
            // the one the poller's series has.
            let uuid = match (&h.gpu.uuid, &self.accounting) {
                (u, Some(a)) if u.is_empty() => a
                    .snapshot()
                    .gpus
                    .get(index)
                    .map(|(g, _)| g.uuid.clone())
                    .unwrap_or_default(),
                (u, _) => u.clone(),
            };
            let labels: Labels = vec![("gpu".into(), index.to_string()), ("uuid".into(), uuid)];
            self.gpu_health.get_or_create(&labels).set(v);
            health_seen.insert(*index, labels);
        }
        drop(health_seen);
        self.incidents_open.set(state.open.len() as i64);
        let mut seen = self
            .self_fault_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        seen.extend(state.self_faults.keys().cloned());
        for c in seen.iter() {
            self.self_fault
                .get_or_create(&vec![("component".into(), c.clone())])
                .set(i64::from(state.self_faults.contains_key(c)));
        }
        drop(seen);
        for phase in crate::engine::NodePhase::ALL {
            self.node_phase
                .get_or_create(&vec![("phase".into(), phase.as_str().into())])
                .set(i64::from(state.node == phase));
        }
        self.planned.record(state);
    }

    fn repair(&self, rung: Verdict, result: &str) {
        self.repairs
            .get_or_create(&vec![
                ("rung".into(), rung.as_str().into()),
                ("result".into(), result.into()),
            ])
            .inc();
    }

    /// Refreshes the series fed by the NVML poller: every GPU it answered for has a health
    /// series (0 until the engine says otherwise), and per-task use replaces the last
    /// scrape's, so a task that went away has no series.
    fn refresh_usage(&self) {
        let Some(a) = &self.accounting else { return };
        let snap = a.snapshot();
        self.task_gpu_memory.clear();
        self.task_gpu_processes.clear();
        self.refresh_reservations(&snap);
        for (index, (gpu, tasks)) in &snap.gpus {
            // Created at 0 (healthy) if absent; the engine's value is kept otherwise.
            drop(self.gpu_health.get_or_create(&vec![
                ("gpu".into(), index.to_string()),
                ("uuid".into(), gpu.uuid.clone()),
            ]));
            for t in tasks {
                let (task, family, revision, container) = match &t.names {
                    Some(n) => (
                        n.arn.clone(),
                        n.family.clone(),
                        n.revision.clone(),
                        n.container.clone().or_else(|| t.container.clone()),
                    ),
                    None => (
                        t.task.clone(),
                        String::new(),
                        String::new(),
                        t.container.clone(),
                    ),
                };
                let labels: Labels = vec![
                    ("task".into(), task),
                    ("family".into(), family),
                    ("revision".into(), revision),
                    ("container".into(), container.unwrap_or_default()),
                    ("gpu".into(), index.to_string()),
                    ("uuid".into(), gpu.uuid.clone()),
                ];
                self.task_gpu_memory
                    .get_or_create(&labels)
                    .set(i64::try_from(t.bytes).unwrap_or(i64::MAX));
                let mut known = labels.clone();
                known.push(("unknown".into(), "false".into()));
                self.task_gpu_processes
                    .get_or_create(&known)
                    .set(i64::from(t.processes - t.unknown));
                if t.unknown > 0 {
                    let mut unknown = labels;
                    unknown.push(("unknown".into(), "true".into()));
                    self.task_gpu_processes
                        .get_or_create(&unknown)
                        .set(i64::from(t.unknown));
                }
            }
        }
    }

    /// Reservations and whether each task is over its alert share, for the tasks whose
    /// reservation is known; replaced at each scrape like the use.
    fn refresh_reservations(&self, snap: &crate::accounting::usage::Snapshot) {
        self.task_gpu_memory_reserved.clear();
        self.task_gpu_memory_over_reservation.clear();
        for t in &snap.tasks {
            if t.reserved_bytes.is_none() {
                continue;
            }
            let task: Labels = vec![
                ("task".into(), t.name().to_string()),
                ("family".into(), t.family.clone()),
                ("revision".into(), t.revision.clone()),
            ];
            self.task_gpu_memory_over_reservation
                .get_or_create(&task)
                .set(i64::from(t.over));
            for c in &t.containers {
                let Some(r) = c.reserved_bytes else { continue };
                let mut labels = task.clone();
                labels.push(("container".into(), c.name.clone()));
                self.task_gpu_memory_reserved
                    .get_or_create(&labels)
                    .set(i64::try_from(r).unwrap_or(i64::MAX));
            }
        }
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        self.refresh_usage();
        if let Some(files) = &self.link_views {
            self.links.refresh(files);
        }
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

/// Serves `GET /metrics` on `addr` until shutdown. Loopback addresses only: the config
/// check refuses others.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
) {
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(%addr, "metrics endpoint listening");
    }
    loop {
        let (mut sock, _) = tokio::select! {
            _ = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => { tracing::warn!("metrics accept failed: {e}"); continue; }
            },
        };
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let deadline = std::time::Duration::from_secs(5);
            let Ok(Some(head)) = tokio::time::timeout(deadline, read_head(&mut sock)).await else {
                return;
            };
            let request = String::from_utf8_lossy(&head);
            let path = request.split_whitespace().nth(1).unwrap_or("");
            let (status, body, ctype) = if path == "/metrics" {
                (
                    "200 OK",
                    metrics.render(),
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )
            } else {
                ("404 Not Found", "try /metrics\n".to_string(), "text/plain")
            };
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

/// The longest request head the endpoint reads (a scrape's is a few hundred bytes).
const MAX_REQUEST_HEAD: usize = 8 * 1024;

/// Reads a request head up to its blank line, however many writes the client split it into.
/// `None` when the client closes first, or sends more than [`MAX_REQUEST_HEAD`] without one.
/// Reading the whole head matters: bytes left unread when the socket closes make the close a
/// reset, and the client loses the answer.
async fn read_head<R: tokio::io::AsyncRead + Unpin>(r: &mut R) -> Option<Vec<u8>> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let n = r.read(&mut buf).await.ok()?;
        if n == 0 {
            return None;
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") {
            return Some(head);
        }
        if head.len() > MAX_REQUEST_HEAD {
            return None;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::engine::step;
    use crate::model::{GpuId, Observation, Outcome, Timestamp};
    use crate::policy::Policy;

    fn value(text: &str, name_and_labels: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(name_and_labels))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    fn shipped_policy() -> Policy {
        Policy::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("policies/default.toml"),
        )
        .unwrap()
    }

    /// A scrape whose request arrives in several writes gets the whole answer.
    #[tokio::test]
    async fn a_request_split_over_several_writes_is_answered() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let server = tokio::spawn(serve(listener, Arc::new(Metrics::new()), stop.clone()));
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        for part in ["GET /metr", "ics HTTP/1.1\r\n", "Host: x\r\n", "\r\n"] {
            s.write_all(part.as_bytes()).await.unwrap();
            s.flush().await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        assert!(out.contains("gpu_medic_"), "{out}");
        stop.cancel();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn a_head_without_end_is_refused_once_over_the_cap() {
        let long = vec![b'a'; MAX_REQUEST_HEAD + 2048];
        assert_eq!(read_head(&mut long.as_slice()).await, None);
        assert_eq!(read_head(&mut &b"GET / HTTP/1.1\r\n"[..]).await, None);
        let ok = b"GET /metrics HTTP/1.1\r\n\r\n";
        assert_eq!(read_head(&mut &ok[..]).await.as_deref(), Some(&ok[..]));
    }

    /// Drives the real engine and checks that every declared metric moves.
    #[test]
    fn every_metric_is_fed_by_the_engine() {
        let policy = shipped_policy();
        let m = Metrics::new();
        let mut st = State::default();
        let mut now = Timestamp(1_700_000_000_000);
        let feed = |input: Input, st: &mut State, now: Timestamp| {
            let (next, actions) = step(st, input.clone(), now, &policy);
            m.record(&input, &actions, &next, &policy);
            *st = next;
            actions
        };
        let gpu = GpuId {
            index: 1,
            uuid: "GPU-1".into(),
            ..GpuId::default()
        };
        feed(
            Input::Observation(Observation::new(Signal::MpsUp).with_value(12)),
            &mut st,
            now,
        );
        feed(
            Input::Observation(Observation::new(Signal::MpsDown)),
            &mut st,
            now,
        );
        let actions = feed(
            Input::Observation(Observation::new(Signal::MpsDown)),
            &mut st,
            now,
        );
        let restart = actions.iter().find_map(|a| match a {
            Action::Execute(o) => Some(o.id),
            _ => None,
        });
        feed(
            Input::Outcome(Outcome {
                action: restart.unwrap(),
                status: OutcomeStatus::Done,
                detail: String::new(),
                request_ids: vec![],
                evidence: None,
            }),
            &mut st,
            now,
        );
        now = now.plus(Duration::from_secs(1));
        let actions = feed(
            Input::Observation(Observation::new(Signal::xid(79)).on_gpu(gpu)),
            &mut st,
            now,
        );
        let quarantine = actions.iter().find_map(|a| match a {
            Action::Execute(o) => Some(o.id),
            _ => None,
        });
        feed(
            Input::Outcome(Outcome {
                action: quarantine.unwrap(),
                status: OutcomeStatus::Failed { retryable: false },
                detail: "AccessDenied".into(),
                request_ids: vec!["r-1".into()],
                evidence: None,
            }),
            &mut st,
            now,
        );
        let text = m.render();
        let expect = [
            ("gpu_medic_gpu_health{gpu=\"1\",uuid=\"GPU-1\"}", 2.0),
            ("gpu_medic_xids_total{gpu=\"1\",code=\"79\"}", 1.0),
            ("gpu_medic_signals_total{signal=\"mps-down\"}", 2.0),
            ("gpu_medic_mps_probe_latency_seconds_count", 1.0),
            ("gpu_medic_mps_restarts_total", 1.0),
            (
                "gpu_medic_remediations_total{action=\"restart-mps\",outcome=\"done\"}",
                1.0,
            ),
            (
                "gpu_medic_remediations_total{action=\"quarantine\",outcome=\"failed\"}",
                1.0,
            ),
            (
                "gpu_medic_aws_call_errors_total{action=\"quarantine\"}",
                1.0,
            ),
            ("gpu_medic_incidents_open", 1.0),
            ("gpu_medic_node_phase{phase=\"draining\"}", 1.0),
            ("gpu_medic_node_phase{phase=\"in-service\"}", 0.0),
        ];
        for (name, want) in expect {
            assert_eq!(value(&text, name), Some(want), "{name} in\n{text}");
        }
    }

    /// A GPU the engine forgets (an operator aborted its incident) is healthy again: its
    /// series goes back to 0 instead of staying faulted; and a signal that did not name the
    /// GPU's UUID updates the poller's series, not a second one.
    #[test]
    fn a_forgotten_gpu_goes_back_to_healthy_and_keeps_one_series() {
        use crate::accounting::usage::Snapshot;
        use crate::engine::{GpuHealth, GpuStatus};
        let policy = shipped_policy();
        let accounting = Accounting::new();
        let mut snap = Snapshot::default();
        let gpu = GpuId {
            index: 3,
            uuid: "GPU-3".into(),
            ..GpuId::default()
        };
        snap.gpus.insert(3, (gpu.clone(), vec![]));
        accounting.publish(snap);
        let m = Metrics::new().with_accounting(accounting);
        let mut st = State::default();
        st.gpus.insert(
            3,
            GpuHealth {
                gpu: GpuId::index_only(3),
                status: GpuStatus::Faulted,
                rule: "xid-fallen-off-bus".into(),
                verdict: crate::model::Verdict::Replace,
                incident: None,
                since: Timestamp(1),
            },
        );
        let tick = Input::Tick;
        m.record(&tick, &[], &st, &policy);
        let series = "gpu_medic_gpu_health{gpu=\"3\",uuid=\"GPU-3\"}";
        let text = m.render();
        assert_eq!(value(&text, series), Some(2.0), "{text}");
        assert!(!text.contains("uuid=\"\""), "one series per GPU:\n{text}");
        st.gpus.clear();
        m.record(&tick, &[], &st, &policy);
        assert_eq!(value(&m.render(), series), Some(0.0));
    }

    #[test]
    fn routine_readings_are_not_signals_and_task_series_follow_the_poller() {
        use crate::accounting::usage::{Snapshot, TaskUsage};
        let policy = shipped_policy();
        let accounting = Accounting::new();
        let m = Metrics::new().with_accounting(accounting.clone());
        let st = State::default();
        let now = Timestamp(1_700_000_000_000);
        for pct in [20, 99] {
            let input = Input::Observation(Observation::new(Signal::StateDiskFull).with_value(pct));
            let (next, actions) = step(&st, input.clone(), now, &policy);
            m.record(&input, &actions, &next, &policy);
        }
        let gpu = |i: u32| GpuId {
            index: i,
            uuid: format!("GPU-{i}"),
            ..GpuId::default()
        };
        let mut snap = Snapshot::default();
        snap.gpus.insert(0, (gpu(0), vec![]));
        snap.gpus.insert(
            1,
            (
                gpu(1),
                vec![TaskUsage {
                    task: "aa11".into(),
                    container: Some("c0".into()),
                    bytes: 3 << 30,
                    processes: 2,
                    unknown: 1,
                    names: None,
                }],
            ),
        );
        accounting.publish(snap.clone());
        let text = m.render();
        assert_eq!(
            value(&text, "gpu_medic_signals_total{signal=\"state-disk-full\"}"),
            Some(1.0),
            "only the 99 % reading is a signal:\n{text}"
        );
        for i in 0..2 {
            let series = format!("gpu_medic_gpu_health{{gpu=\"{i}\",uuid=\"GPU-{i}\"}}");
            assert_eq!(value(&text, &series), Some(0.0), "{series} in\n{text}");
        }
        let mem = "gpu_medic_task_gpu_memory_bytes{task=\"aa11\",family=\"\",revision=\"\",container=\"c0\",gpu=\"1\",uuid=\"GPU-1\"}";
        assert_eq!(value(&text, mem), Some((3u64 << 30) as f64), "{text}");
        assert!(text.contains("unknown=\"true\"} 1"), "{text}");
        snap.gpus.get_mut(&1).unwrap().1.clear();
        accounting.publish(snap);
        let text = m.render();
        assert_eq!(value(&text, mem), None, "the task went away:\n{text}");
    }
}
