//! Prometheus metrics, off by default (`[metrics] enabled`), served on a loopback address.
//! They are derived from what the engine consumes and emits, in the supervisor's one
//! engine task, so they can never disagree with the journal.

mod contract;
mod links;
pub mod server;
mod share;

use std::collections::BTreeMap;
use std::sync::Mutex;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::accounting::usage::Accounting;
use crate::engine::{GpuStatus, State};
use crate::model::{
    Action, ActionId, Command, ExportLag, FleetBudgetView, IncidentEvent, IncidentState, Input,
    OutcomeStatus, Signal, Verdict,
};
use crate::policy::Policy;

type Labels = Vec<(String, String)>;

/// The value a label takes for what is folded into one series: an XID outside NVIDIA's
/// catalog (`code="other"`), the tasks past [`MAX_TASK_SERIES`] (`task="other"`).
pub const OTHER: &str = "other";

/// Task label sets (task, family, revision, container) per scrape in each task family; the
/// rest are summed into `task="other"` (their family, revision and container empty), per GPU.
pub const MAX_TASK_SERIES: usize = 256;

/// `labels` as they are while fewer than [`MAX_TASK_SERIES`] sets were `seen`, else folded
/// into `task="other"`.
fn bounded_task(labels: Labels, seen: &mut std::collections::BTreeSet<Labels>) -> Labels {
    if seen.contains(&labels) || seen.len() < MAX_TASK_SERIES {
        seen.insert(labels.clone());
        return labels;
    }
    labels
        .into_iter()
        .map(|(k, v)| match k.as_str() {
            "task" => (k, OTHER.to_string()),
            "family" | "revision" | "container" => (k, String::new()),
            _ => (k, v),
        })
        .collect()
}

/// A task's (bounded) labels with its container's name; empty when the task was folded into
/// `task="other"`.
fn with_container(task: &Labels, name: &str) -> Labels {
    let folded = task.first().is_some_and(|(_, v)| v == OTHER);
    let mut labels = task.clone();
    labels.push((
        "container".into(),
        if folded {
            String::new()
        } else {
            name.to_string()
        },
    ));
    labels
}

/// The `code` label of an XID: its number when NVIDIA's catalog has it, else [`OTHER`]
/// (the code is unbounded: a kernel log can name any number).
fn xid_code_label(code: u32) -> String {
    match crate::policy::xid_catalog::get(code) {
        Some(_) => code.to_string(),
        None => OTHER.to_string(),
    }
}

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
    /// Diagnoses of the GPUs by level and result, and how long they took.
    diagnoses: Family<Labels, Counter>,
    /// Diagnoses that could not tell, by what they could not read.
    diagnosis_unknown: Family<Labels, Counter>,
    diagnosis_duration: Histogram,
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
    /// Each task container's SM use and thread limit per GPU.
    share: share::ShareMetrics,
    /// The MPS contract's series, from the same snapshot.
    contract: contract::ContractMetrics,
    /// The NVML poller's latest GPUs and per-task use, read at each scrape.
    accounting: Option<Accounting>,
    /// AWS-planned disruptions (docs/planned-events.md).
    planned: PlannedMetrics,
    /// The fabric, NVLinks, PCIe and RDMA ports (docs/fabric.md), from the link probes' views.
    links: links::LinkMetrics,
    /// Where those views are; `None`: no link series.
    link_views: Option<crate::config::StateDir>,
    /// The fleet budget as the last drain or replacement read it (from its outcome).
    fleet_in_use: Family<Labels, Gauge>,
    fleet_capacity: Family<Labels, Gauge>,
    /// The export lanes' lag behind the journal, read at each scrape.
    export_lag_seconds: Family<Labels, Gauge>,
    export_lag_records: Family<Labels, Gauge>,
    export_lag: Vec<tokio::sync::watch::Receiver<ExportLag>>,
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
        registry.register(
            "xids",
            "XIDs seen, by GPU and code (code=\"other\": any XID outside NVIDIA's catalog)",
            xids.clone(),
        );
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
        let diagnoses = Family::<Labels, Counter>::default();
        registry.register(
            "diagnoses",
            "Diagnoses of the GPUs (gpu-medic diagnose) the daemon ran, by level (quick, standard, long) and result (pass, fail, unknown, config: passed, needs configuration)",
            diagnoses.clone(),
        );
        // Every level and result from the start at zero: a dashboard's rate has a series to
        // read before the first diagnosis.
        for level in ["quick", "standard", "long"] {
            for result in ["pass", "fail", "unknown", "config"] {
                let _ = diagnoses.get_or_create(&vec![
                    ("level".into(), level.into()),
                    ("result".into(), result.into()),
                ]);
            }
        }
        let diagnosis_unknown = Family::<Labels, Counter>::default();
        registry.register(
            "diagnosis_unknown",
            "Diagnoses that could not tell, by what they could not read (cause: no-tool, host-engine, mps, gpu-busy, timeout, output, runtime-error, entity, missing-gpu, exit-code, no-test, tool)",
            diagnosis_unknown.clone(),
        );
        for cause in crate::model::diagnosis::Cause::ALL {
            let _ = diagnosis_unknown.get_or_create(&vec![("cause".into(), cause.as_str().into())]);
        }
        let diagnosis_duration = Histogram::new([
            1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
        ]);
        registry.register(
            "diagnosis_duration_seconds",
            "How long a diagnosis of the GPUs took, every tier together",
            diagnosis_duration.clone(),
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
            "1 while gpu-medic itself cannot do part of its job (component: nvml, mps-control, state-file, ecs-gpu-view, metrics): a mistake or a fault of gpu-medic, never remediated",
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
        let fleet_in_use = Family::<Labels, Gauge>::default();
        registry.register(
            "fleet_budget_in_use",
            "Instances of the group in remediation (draining, Unhealthy, a live claim, a replacement not yet in the group) when the fleet budget last read it for a drain or replacement of this instance",
            fleet_in_use.clone(),
        );
        let fleet_capacity = Family::<Labels, Gauge>::default();
        registry.register(
            "fleet_budget_capacity",
            "Instances of the group that may be in remediation at once ([fleet] budget of desired capacity), at the same read",
            fleet_capacity.clone(),
        );
        let export_lag_seconds = Family::<Labels, Gauge>::default();
        registry.register(
            "export_lag_seconds",
            "How long the oldest journal record not yet delivered by an export lane (logs: CloudWatch Logs, events: EventBridge) has waited, after the lane's last round (0: caught up)",
            export_lag_seconds.clone(),
        );
        let export_lag_records = Family::<Labels, Gauge>::default();
        registry.register(
            "export_lag_records",
            "Journal lines an export lane had not delivered after its last round (0: caught up)",
            export_lag_records.clone(),
        );
        let planned = PlannedMetrics::register(&mut registry);
        let links = links::LinkMetrics::register(&mut registry);
        let contract = contract::ContractMetrics::register(&mut registry);
        let share = share::ShareMetrics::register(&mut registry);
        Metrics {
            share,
            fleet_in_use,
            fleet_capacity,
            export_lag_seconds,
            export_lag_records,
            export_lag: Vec::new(),
            planned,
            links,
            link_views: None,
            task_gpu_memory,
            task_gpu_processes,
            task_gpu_memory_reserved,
            task_gpu_memory_over_reservation,
            contract,
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
            diagnoses,
            diagnosis_unknown,
            diagnosis_duration,
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

    /// The export lanes' lag comes from these (the exporter's, one per lane).
    pub fn with_export_lag(mut self, lag: Vec<tokio::sync::watch::Receiver<ExportLag>>) -> Self {
        self.export_lag = lag;
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

    /// What an observation counts: signals a rule judges, XIDs by code, MPS probe latency. A
    /// drill's own observation (`gpu-medic drill xid`, `gpu-lost`, ...: it travels in the
    /// request, judged as if its probe had reported it) counts as that observation would.
    fn record_input(&self, input: &Input, policy: &Policy) {
        let observed = match input {
            Input::Observation(o) => Some(o),
            Input::Operator(crate::model::OperatorRequest::Drill { drill }) => {
                drill.inject.as_ref()
            }
            _ => None,
        };
        if let Some(o) = observed {
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
                            ("code".into(), xid_code_label(*code)),
                        ])
                        .inc();
                }
                Signal::MpsUp => self.mps_probe_latency.observe(o.value as f64 / 1000.0),
                _ => {}
            }
        }
    }

    /// A diagnosis the daemon ran: by level and result, what one that could not tell could not
    /// read, and how long it took.
    fn diagnosis(&self, d: &crate::model::diagnosis::Diagnosis) {
        self.diagnoses
            .get_or_create(&vec![
                ("level".into(), d.level.as_str().into()),
                ("result".into(), d.result.as_str().into()),
            ])
            .inc();
        if d.result == crate::model::diagnosis::DiagResult::Unknown {
            let cause = d.cause.unwrap_or(crate::model::diagnosis::Cause::Tool);
            self.diagnosis_unknown
                .get_or_create(&vec![("cause".into(), cause.as_str().into())])
                .inc();
        }
        self.diagnosis_duration
            .observe(d.duration_ms as f64 / 1000.0);
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
                    if let Some(f) = &outcome.fleet {
                        self.fleet_budget(f);
                    }
                    if let Some(d) = &outcome.diagnosis {
                        self.diagnosis(d);
                    }
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
                    let aws = !matches!(action, "restart-mps" | "unknown" | "diagnose");
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
            if !state.gpus.health.contains_key(index) {
                self.gpu_health.get_or_create(labels).set(0);
            }
        }
        for (index, h) in &state.gpus.health {
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
        self.incidents_open.set(state.incidents.open.len() as i64);
        let mut seen = self
            .self_fault_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        seen.extend(state.incidents.self_faults.keys().cloned());
        for c in seen.iter() {
            self.self_fault
                .get_or_create(&vec![("component".into(), c.clone())])
                .set(i64::from(state.incidents.self_faults.contains_key(c)));
        }
        drop(seen);
        for phase in crate::engine::NodePhase::ALL {
            self.node_phase
                .get_or_create(&vec![("phase".into(), phase.as_str().into())])
                .set(i64::from(state.node.phase == phase));
        }
        self.planned.record(state);
    }

    /// One series per gauge: the group the budget last read.
    fn fleet_budget(&self, f: &FleetBudgetView) {
        let labels: Labels = vec![("group".into(), f.group.clone())];
        self.fleet_in_use.clear();
        self.fleet_capacity.clear();
        self.fleet_in_use
            .get_or_create(&labels)
            .set(i64::from(f.in_use));
        self.fleet_capacity
            .get_or_create(&labels)
            .set(i64::from(f.capacity));
    }

    /// The export lanes' lag as their last rounds left it, the wait counted to now.
    fn refresh_export_lag(&self) {
        let now = crate::model::Timestamp::now();
        for rx in &self.export_lag {
            let l = rx.borrow().clone();
            let labels: Labels = vec![("lane".into(), l.lane.clone())];
            self.export_lag_seconds
                .get_or_create(&labels)
                .set(i64::try_from(l.seconds_at(now)).unwrap_or(i64::MAX));
            self.export_lag_records
                .get_or_create(&labels)
                .set(i64::try_from(l.records).unwrap_or(i64::MAX));
        }
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
        self.share.clear();
        self.refresh_reservations(&snap);
        self.contract.refresh(&snap);
        let mut seen = std::collections::BTreeSet::new();
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
                // Cleared above: each series starts at 0 and sums what it stands for.
                let labels = bounded_task(labels, &mut seen);
                self.task_gpu_memory
                    .get_or_create(&labels)
                    .inc_by(i64::try_from(t.bytes).unwrap_or(i64::MAX));
                self.share.record(&labels, t);
                let mut known = labels.clone();
                known.push(("unknown".into(), "false".into()));
                self.task_gpu_processes
                    .get_or_create(&known)
                    .inc_by(i64::from(t.processes.saturating_sub(t.unknown)));
                if t.unknown > 0 {
                    let mut unknown = labels;
                    unknown.push(("unknown".into(), "true".into()));
                    self.task_gpu_processes
                        .get_or_create(&unknown)
                        .inc_by(i64::from(t.unknown));
                }
            }
        }
    }

    /// Reservations and whether each task is over its alert share, for the tasks whose
    /// reservation is known; replaced at each scrape like the use.
    fn refresh_reservations(&self, snap: &crate::accounting::usage::Snapshot) {
        self.task_gpu_memory_reserved.clear();
        self.task_gpu_memory_over_reservation.clear();
        let mut seen = std::collections::BTreeSet::new();
        for t in &snap.tasks {
            if t.reserved_bytes.is_none() {
                continue;
            }
            let task: Labels = vec![
                ("task".into(), t.name().to_string()),
                ("family".into(), t.family.clone()),
                ("revision".into(), t.revision.clone()),
            ];
            let task = bounded_task(task, &mut seen);
            self.task_gpu_memory_over_reservation
                .get_or_create(&task)
                .inc_by(i64::from(t.over));
            for c in &t.containers {
                let Some(r) = c.reserved_bytes else { continue };
                let labels = with_container(&task, &c.name);
                self.task_gpu_memory_reserved
                    .get_or_create(&labels)
                    .inc_by(i64::try_from(r).unwrap_or(i64::MAX));
            }
        }
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        self.refresh_usage();
        self.refresh_export_lag();
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
        crate::config::load_policy(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies/default.toml"),
        )
        .unwrap()
    }

    /// XIDs outside NVIDIA's catalog are one series, however many distinct codes arrive.
    #[test]
    fn unknown_xids_are_folded_into_one_series() {
        let policy = shipped_policy();
        let m = Metrics::new();
        let st = State::default();
        let gpu = GpuId::index_only(0);
        let unknown: Vec<u32> = (100_000..)
            .filter(|c| crate::policy::xid_catalog::get(*c).is_none())
            .take(5000)
            .collect();
        for code in unknown.iter().copied().chain([79]) {
            let input = Input::Observation(Observation::new(Signal::xid(code)).on_gpu(gpu.clone()));
            m.record(&input, &[], &st, &policy);
        }
        let text = m.render();
        let xids = text
            .lines()
            .filter(|l| l.starts_with("gpu_medic_xids_total{"))
            .count();
        assert_eq!(xids, 2, "{text}");
        assert_eq!(
            value(&text, "gpu_medic_xids_total{gpu=\"0\",code=\"other\"}"),
            Some(5000.0)
        );
        assert_eq!(
            value(&text, "gpu_medic_xids_total{gpu=\"0\",code=\"79\"}"),
            Some(1.0)
        );
    }

    /// Past [`MAX_TASK_SERIES`] tasks, the rest are summed into `task="other"`.
    #[test]
    fn task_series_are_capped() {
        use crate::accounting::usage::{Snapshot, TaskUsage};
        let accounting = Accounting::new();
        let m = Metrics::new().with_accounting(accounting.clone());
        let gpu = GpuId {
            index: 0,
            uuid: "GPU-0".into(),
            ..GpuId::default()
        };
        let n = MAX_TASK_SERIES + 100;
        let tasks = (0..n)
            .map(|i| TaskUsage {
                task: format!("t{i:05}"),
                container: Some("c".into()),
                bytes: 1,
                processes: 1,
                unknown: 0,
                names: None,
                sm_percent: Some(1),
                sm_limit_percent: Some(u32::try_from(i % 100).unwrap() + 1),
            })
            .collect();
        let mut snap = Snapshot::default();
        snap.gpus.insert(0, (gpu, tasks));
        accounting.publish(snap);
        let text = m.render();
        let mem: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("gpu_medic_task_gpu_memory_bytes{"))
            .collect();
        assert_eq!(mem.len(), MAX_TASK_SERIES + 1, "{text}");
        let other = "gpu_medic_task_gpu_memory_bytes{task=\"other\",family=\"\",revision=\"\",container=\"\",gpu=\"0\",uuid=\"GPU-0\"}";
        assert_eq!(value(&text, other), Some(100.0), "{text}");
        // The compute share has the same labels, folded alike: the use summed, the limit the
        // largest of the folded ones.
        let sm: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("gpu_medic_task_gpu_sm_percent{"))
            .collect();
        assert_eq!(sm.len(), MAX_TASK_SERIES + 1);
        let other_sm = other.replace("memory_bytes", "sm_percent");
        assert_eq!(value(&text, &other_sm), Some(100.0));
        let other_limit = other.replace("memory_bytes", "sm_limit_percent");
        assert_eq!(value(&text, &other_limit), Some(100.0));
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
                fleet: None,
                diagnosis: None,
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
                fleet: None,
                diagnosis: None,
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

    /// The fleet budget comes from a drain's outcome; the export lag from the lanes' feeds,
    /// its wait counted to the scrape.
    #[test]
    fn the_fleet_budget_and_the_export_lag_are_fed_by_their_owners() {
        let policy = shipped_policy();
        let since = Timestamp::now().minus(Duration::from_secs(30));
        let (_tx, rx) = tokio::sync::watch::channel(ExportLag {
            lane: "logs".into(),
            records: 3,
            behind_since: Some(since),
        });
        let m = Metrics::new().with_export_lag(vec![rx]);
        let fleet = FleetBudgetView {
            group: "Auto Scaling group g".into(),
            desired: 10,
            capacity: 2,
            in_use: 1,
            observed_at: since,
        };
        let record = crate::model::Record {
            at: since,
            incident: crate::model::IncidentId(1),
            drill: None,
            event: IncidentEvent::ActionFinished {
                outcome: Outcome {
                    action: ActionId(7),
                    status: OutcomeStatus::Done,
                    detail: String::new(),
                    request_ids: vec![],
                    evidence: None,
                    fleet: Some(Box::new(fleet)),
                    diagnosis: None,
                },
            },
        };
        m.record(
            &Input::Tick,
            &[Action::Log(record)],
            &State::default(),
            &policy,
        );
        let text = m.render();
        let g = "{group=\"Auto Scaling group g\"}";
        assert_eq!(
            value(&text, &format!("gpu_medic_fleet_budget_in_use{g}")),
            Some(1.0),
            "{text}"
        );
        assert_eq!(
            value(&text, &format!("gpu_medic_fleet_budget_capacity{g}")),
            Some(2.0)
        );
        assert_eq!(
            value(&text, "gpu_medic_export_lag_records{lane=\"logs\"}"),
            Some(3.0)
        );
        let lag = value(&text, "gpu_medic_export_lag_seconds{lane=\"logs\"}").unwrap();
        assert!((30.0..60.0).contains(&lag), "{lag}");
    }

    /// A diagnosis that could not tell is counted by what it could not read, beside its
    /// level and result; every cause has its series from the start.
    #[test]
    fn a_diagnosis_that_could_not_tell_is_counted_by_its_cause() {
        use crate::model::diagnosis::{Cause, DiagResult, Diagnosis, Level};
        let policy = shipped_policy();
        let m = Metrics::new();
        let before = m.render();
        for cause in Cause::ALL {
            let series = format!(
                "gpu_medic_diagnosis_unknown_total{{cause=\"{}\"}}",
                cause.as_str()
            );
            assert_eq!(value(&before, &series), Some(0.0), "{series} in\n{before}");
        }
        let diagnosis = |result, cause| Diagnosis {
            level: Level::Quick,
            result,
            gpus: vec![],
            tiers: vec![],
            summary: String::new(),
            cause,
            duration_ms: 1500,
        };
        for (i, (result, cause)) in [
            (DiagResult::Unknown, Some(Cause::HostEngine)),
            (DiagResult::Unknown, Some(Cause::HostEngine)),
            (DiagResult::Config, None),
        ]
        .into_iter()
        .enumerate()
        {
            let record = crate::model::Record {
                at: Timestamp(1_700_000_000_000),
                incident: crate::model::IncidentId(1),
                drill: None,
                event: IncidentEvent::ActionFinished {
                    outcome: Outcome {
                        action: ActionId(i as u64 + 1),
                        status: OutcomeStatus::Done,
                        detail: String::new(),
                        request_ids: vec![],
                        evidence: None,
                        fleet: None,
                        diagnosis: Some(Box::new(diagnosis(result, cause))),
                    },
                },
            };
            m.record(
                &Input::Tick,
                &[Action::Log(record)],
                &State::default(),
                &policy,
            );
        }
        let text = m.render();
        assert_eq!(
            value(
                &text,
                "gpu_medic_diagnosis_unknown_total{cause=\"host-engine\"}"
            ),
            Some(2.0),
            "{text}"
        );
        assert_eq!(
            value(
                &text,
                "gpu_medic_diagnoses_total{level=\"quick\",result=\"unknown\"}"
            ),
            Some(2.0)
        );
        assert_eq!(
            value(
                &text,
                "gpu_medic_diagnoses_total{level=\"quick\",result=\"config\"}"
            ),
            Some(1.0)
        );
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
        st.gpus.health.insert(
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
        st.gpus.health.clear();
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
                    sm_percent: Some(35),
                    sm_limit_percent: Some(50),
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
        let sm = mem.replace("memory_bytes", "sm_percent");
        let limit = mem.replace("memory_bytes", "sm_limit_percent");
        assert_eq!(value(&text, &sm), Some(35.0), "{text}");
        assert_eq!(value(&text, &limit), Some(50.0), "{text}");
        snap.gpus.get_mut(&1).unwrap().1.clear();
        accounting.publish(snap);
        let text = m.render();
        assert_eq!(value(&text, mem), None, "the task went away:\n{text}");
        assert_eq!(value(&text, &sm), None, "its share too:\n{text}");
    }
}
