//! Incidents that outlive the instance: the journal shipped off it while it runs.
//!
//! Two lanes follow `incidents.jsonl` ([`tail`]), each from its own cursor saved under
//! `state_dir/export/` after each acknowledged batch:
//! - **logs**: every record to CloudWatch Logs, one log group per cluster, one stream per
//!   instance id, in journal order, in batches within PutLogEvents' limits;
//! - **events**: every incident transition to EventBridge (`source` "gpu-medic", one
//!   `detail-type` per transition: [`detail_type`]), the shipped record as the detail, its
//!   strings escaped: pages are plain text written from it ([`event_detail`]).
//!
//! Text others wrote (a process or task name in a reason) is kept as it came in the journal
//! and in CloudWatch Logs (JSON, through [`crate::model::escape::json_safe`]), and escaped in
//! the events.
//!
//! Delivery is at least once: a batch sent but not acknowledged (a crash, a timeout) is sent
//! again, and every message carries a record id (`<instance-id>/<incident>/<seq>`, see
//! [`record_id`]) so a duplicate is harmless (the fleet view drops it; an EventBridge
//! consumer can). While CloudWatch or EventBridge is unreachable or throttling, the journal
//! itself is the buffer: nothing is held in memory, the lane retries with backoff, and only
//! rotation bounds what waits (lines rotated away first are counted and logged).
//!
//! The lanes run beside the supervisor and never block it. Before the instance goes away
//! (the terminate hook completed, the instance marked Unhealthy) the control plane asks for
//! a [`Flush`]: bounded, and the order's detail says how it went.
//!
//! The AWS calls are adapters ([`crate::aws::logs`], [`crate::aws::events`]); this module
//! reads the journal's records and decides nothing about incidents.

pub mod fleet_incidents;
pub mod tail;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{Notify, OnceCell, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use self::tail::{Cursor, Tail};
use crate::aws::calls::{CallError, Calls};
use crate::aws::events::{self, Event, Events};
use crate::aws::logs::{self, Batch, Full, LogEvent, Logs};
use crate::config::Config;
use crate::model::escape::{escape, is_control, is_escaped, json_safe};
use crate::model::{ExportLag, IncidentEvent, OutcomeStatus, Record};
pub use crate::remedy::FlushReport;

/// `detail-type` of an incident's first record.
pub const INCIDENT_OPENED: &str = "GPU Medic Incident Opened";
/// `detail-type` of an order handed to a remedy.
pub const ACTION_STARTED: &str = "GPU Medic Action Started";
/// `detail-type` of an order that failed.
pub const ACTION_FAILED: &str = "GPU Medic Action Failed";
/// `detail-type` of a verdict that went up (an escalation, the MPS restart budget spent, a
/// drain upgraded to a replacement): `docs/paging.md` pages on it.
pub const INCIDENT_ESCALATED: &str = "GPU Medic Incident Escalated";
/// `detail-type` of an incident's last record.
pub const INCIDENT_CLOSED: &str = "GPU Medic Incident Closed";
/// `detail-type` of a finished evidence collection: the detail's outcome carries the S3 URI,
/// size and SHA-256 of the archive (docs/evidence.md).
pub const EVIDENCE_COLLECTED: &str = "GPU Medic Evidence Collected";

/// `detail-type` of a finished diagnosis of the GPUs: the detail's outcome carries each GPU's
/// result per test (docs/diagnose.md).
pub const GPUS_DIAGNOSED: &str = "GPU Medic GPUs Diagnosed";

/// `detail-type` of an incident opened for an application fault judged the program's own
/// (docs/attribution.md): `detail.observation.xid.culprit` names its task definition
/// (`definition`), task and container, so a rule on it pages the program's owner, not on-call
/// for the GPUs. Sent in place of [`INCIDENT_OPENED`].
pub const APPLICATION_FAULT: &str = "GPU Medic Application Fault";

/// The EventBridge `detail-type` of a record, if it is a transition on-call is told about.
pub fn detail_type(e: &IncidentEvent) -> Option<&'static str> {
    match e {
        IncidentEvent::Opened {
            observation,
            verdict,
            ..
        } if *verdict < crate::model::Verdict::Drain
            && observation.culprit().is_some_and(|c| c.is_attributed()) =>
        {
            Some(APPLICATION_FAULT)
        }
        IncidentEvent::Opened { .. } => Some(INCIDENT_OPENED),
        IncidentEvent::ActionStarted { .. } => Some(ACTION_STARTED),
        IncidentEvent::ActionFinished { outcome } if outcome.evidence.is_some() => {
            Some(EVIDENCE_COLLECTED)
        }
        IncidentEvent::ActionFinished { outcome } if outcome.diagnosis.is_some() => {
            Some(GPUS_DIAGNOSED)
        }
        IncidentEvent::Escalated { .. } => Some(INCIDENT_ESCALATED),
        IncidentEvent::ActionFinished { outcome }
            if matches!(outcome.status, OutcomeStatus::Failed { .. }) =>
        {
            Some(ACTION_FAILED)
        }
        IncidentEvent::Closed { .. } => Some(INCIDENT_CLOSED),
        _ => None,
    }
}

/// `<instance-id>/<incident>/<seq>`: the same journal line always gets the same id.
pub fn record_id(instance_id: &str, incident: u64, seq: u64) -> String {
    format!("{instance_id}/{incident}/{seq}")
}

/// A journal record as shipped: the record's own fields plus where it comes from. This is
/// the CloudWatch Logs message and the EventBridge detail. Journal records hold no
/// credentials or other secrets (signals, rules, orders, outcomes, request ids).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shipped {
    pub record_id: String,
    pub instance_id: String,
    pub cluster: String,
    #[serde(flatten)]
    pub record: Record,
}

impl Shipped {
    /// The journal line number in the record id (0 if unreadable).
    pub fn seq(&self) -> u64 {
        self.record_id
            .rsplit('/')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }
}

/// Where this instance's records go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Destination {
    pub instance_id: String,
    pub cluster: String,
    pub log_group: String,
}

/// How one lane is doing, as its task publishes it after each round.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Rounds begun and finished (a flush waits for a round begun after it asked).
    pub started: u64,
    pub finished: u64,
    /// The last round reached the journal's end.
    pub caught_up: bool,
    pub error: Option<String>,
    /// Records delivered and lost (rotated away, rejected, too large), since the start.
    pub delivered: u64,
    pub dropped: u64,
}

/// One lane's handle for a flush.
#[derive(Clone)]
struct LaneHandle {
    name: &'static str,
    wake: Arc<Notify>,
    progress: watch::Receiver<Progress>,
}

/// Asks the lanes to deliver what the journal holds now, and waits (bounded). Cloned into
/// the control plane at construction.
#[derive(Clone)]
pub struct Flush {
    lanes: Vec<LaneHandle>,
}

impl crate::remedy::JournalFlush for Flush {
    fn flush(&self, wait: Duration) -> crate::remedy::BoxFuture<'_, FlushReport> {
        Box::pin(Flush::flush(self, wait))
    }
}

impl Flush {
    /// Delivers every record journaled before the call, waiting at most `wait`.
    pub async fn flush(&self, wait: Duration) -> FlushReport {
        let t0 = Instant::now();
        let until = t0 + wait;
        let mut pending: Vec<String> = Vec::new();
        for lane in &self.lanes {
            let mut rx = lane.progress.clone();
            let want = rx.borrow().started + 1;
            lane.wake.notify_one();
            let done = loop {
                let (ok, err) = {
                    let p = rx.borrow_and_update();
                    (p.finished >= want && p.caught_up, p.error.clone())
                };
                if ok {
                    break None;
                }
                match tokio::time::timeout_at(until, rx.changed()).await {
                    Ok(Ok(())) => {
                        let p = rx.borrow().clone();
                        if p.finished >= want && !p.caught_up {
                            // A round failed: try again soon rather than after the backoff.
                            tokio::time::sleep_until(
                                (Instant::now() + Duration::from_millis(200)).min(until),
                            )
                            .await;
                            lane.wake.notify_one();
                        }
                    }
                    Ok(Err(_)) => break Some(format!("{}: export stopped", lane.name)),
                    Err(_) => {
                        break Some(format!(
                            "{}: {}",
                            lane.name,
                            err.unwrap_or_else(|| "still delivering".into())
                        ));
                    }
                }
            };
            if let Some(p) = done {
                pending.push(p);
            }
        }
        let took =
            humantime::format_duration(Duration::from_millis(t0.elapsed().as_millis() as u64));
        let names: Vec<&str> = self.lanes.iter().map(|l| l.name).collect();
        if pending.is_empty() {
            FlushReport {
                complete: true,
                detail: format!("journal flushed to {} ({took})", names.join(" and ")),
            }
        } else {
            FlushReport {
                complete: false,
                detail: format!(
                    "journal not flushed within {} ({}); going ahead, the rest is sent if the instance lives long enough",
                    humantime::format_duration(wait),
                    pending.join("; ")
                ),
            }
        }
    }
}

/// The running export: its flush handle and its tasks.
pub struct Exporter {
    pub flush: Flush,
    /// Each lane's lag behind the journal after its last round (for the metrics).
    pub lag: Vec<watch::Receiver<ExportLag>>,
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

impl Exporter {
    /// Starts the lanes `[export]` enables (nothing when it is off or `[aws]` is).
    pub async fn start(cfg: &Config) -> Option<Exporter> {
        let x = &cfg.export;
        if !x.enabled || !cfg.aws.enabled || !(x.logs || x.events) {
            return None;
        }
        let sdk = crate::aws::loader(&cfg.aws).load().await;
        Some(Exporter::with_sdk(cfg, &sdk))
    }

    /// Starts the lanes with this SDK configuration (tests point it at moto).
    pub fn with_sdk(cfg: &Config, sdk: &aws_config::SdkConfig) -> Exporter {
        let stop = CancellationToken::new();
        let dest: Arc<OnceCell<Destination>> = Arc::new(OnceCell::new());
        let http = sdk.http_client().unwrap_or_else(crate::aws::http_client);
        let files = cfg.files();
        let mut lanes = Vec::new();
        let mut tasks = Vec::new();
        let mut lag = Vec::new();
        let mut add = |name: &'static str, lane: &str, kind: Kind| {
            let wake = Arc::new(Notify::new());
            let (tx, rx) = watch::channel(Progress::default());
            let (lag_tx, lag_rx) = watch::channel(ExportLag {
                lane: lane.to_string(),
                ..ExportLag::default()
            });
            lag.push(lag_rx);
            let lane = Lane {
                name,
                kind,
                tail: Tail::new(&cfg.incidents_path()),
                cursor_path: files.export_cursor(lane),
                cursor: Cursor::default(),
                dest: dest.clone(),
                cfg: cfg.clone(),
                http: http.clone(),
                delivered: 0,
                rejected: 0,
                dropped: 0,
            };
            tasks.push(tokio::spawn(lane.run(
                wake.clone(),
                (tx, lag_tx),
                cfg.export.interval,
                stop.clone(),
            )));
            lanes.push(LaneHandle {
                name,
                wake,
                progress: rx,
            });
        };
        if cfg.export.logs {
            add(
                "CloudWatch Logs",
                "logs",
                Kind::Logs {
                    logs: Logs::new(sdk),
                    ready: false,
                },
            );
        }
        if cfg.export.events {
            add(
                "EventBridge",
                "events",
                Kind::Events {
                    events: Events::new(sdk, cfg.export.event_bus.clone()),
                },
            );
        }
        Exporter {
            flush: Flush { lanes },
            lag,
            stop,
            tasks,
        }
    }

    /// Flushes (bounded by `wait`), then stops the lanes.
    pub async fn finish(self, wait: Duration) -> FlushReport {
        let r = self.flush.flush(wait).await;
        if r.complete {
            tracing::info!("export: {r}");
        } else {
            tracing::warn!("export: {r}");
        }
        self.stop.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
        r
    }
}

enum Kind {
    Logs { logs: Logs, ready: bool },
    Events { events: Events },
}

struct Lane {
    name: &'static str,
    kind: Kind,
    tail: Tail,
    cursor_path: PathBuf,
    cursor: Cursor,
    dest: Arc<OnceCell<Destination>>,
    cfg: Config,
    http: aws_sdk_ecs::config::SharedHttpClient,
    delivered: u64,
    /// Records the service would not take (never sent again), since the start.
    rejected: u64,
    /// Those plus the lines rotated away before delivery.
    dropped: u64,
}

/// Backoff after a failed round: full jitter over a window doubling from 1 s to 60 s
/// ([`crate::sys::backoff`]): a fleet whose export failed together (an outage of CloudWatch
/// Logs or EventBridge) does not retry together.
fn backoff(failures: u32) -> Duration {
    crate::sys::backoff::full_jitter(Duration::from_secs(1), failures, Duration::from_secs(60))
}

impl Lane {
    async fn run(
        mut self,
        wake: Arc<Notify>,
        (progress, lag): (watch::Sender<Progress>, watch::Sender<ExportLag>),
        interval: Duration,
        stop: CancellationToken,
    ) {
        self.cursor = Cursor::load(&self.cursor_path);
        self.dropped = self.cursor.dropped;
        let mut failures = 0u32;
        loop {
            progress.send_modify(|p| p.started += 1);
            let r = self.round().await;
            let (records, behind_since) = if r.is_ok() { (0, None) } else { self.behind() };
            lag.send_modify(|l| {
                l.records = records;
                l.behind_since = behind_since;
            });
            let (delivered, dropped) = (self.delivered, self.dropped);
            progress.send_modify(|p| {
                p.finished = p.started;
                p.caught_up = r.is_ok();
                p.error = r.as_ref().err().cloned();
                p.delivered = delivered;
                p.dropped = dropped;
            });
            let delay = match &r {
                Ok(()) => {
                    failures = 0;
                    interval
                }
                Err(e) => {
                    let d = backoff(failures);
                    failures = failures.saturating_add(1);
                    tracing::warn!(lane = self.name, retry_in = %humantime::format_duration(d), "export: {e}");
                    d
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = wake.notified() => {}
                _ = stop.cancelled() => return,
            }
        }
    }

    async fn destination(&self) -> Result<Destination, String> {
        self.dest
            .get_or_try_init(|| async {
                // Only the cluster is needed: `[identity]` names it, or the agent does.
                let cluster = match &self.cfg.identity.cluster {
                    Some(c) => c.clone(),
                    None => crate::aws::identity::agent_view(&self.cfg).await.cluster,
                };
                let instance_id = crate::aws::identity::instance_id(
                    &self.cfg,
                    self.http.clone(),
                    Instant::now() + Duration::from_secs(5),
                )
                .await
                .map_err(|e| format!("cannot name this instance's stream: {e}"))?;
                let d = Destination {
                    log_group: self.cfg.export.log_group_for(&cluster),
                    cluster,
                    instance_id,
                };
                tracing::info!(log_group = %d.log_group, stream = %d.instance_id, "export: destination");
                Ok(d)
            })
            .await
            .cloned()
    }

    /// Delivers batches until the journal's end; an error leaves the cursor where the last
    /// acknowledged batch put it.
    async fn round(&mut self) -> Result<(), String> {
        let dest = self.destination().await?;
        loop {
            let more = match &mut self.kind {
                Kind::Logs { logs, ready } => {
                    let logs = logs.clone();
                    if !*ready {
                        // The stream first: the group exists but for the first instance of a
                        // cluster (CreateLogGroup is one of Logs' slow-rate actions, and a
                        // group of 10,000 instances booting together would call it 10,000
                        // times: docs/fleet-scale.md); the group only when the stream says
                        // it is missing.
                        let mut calls = Calls::new();
                        match logs
                            .ensure_stream(&mut calls, &dest.log_group, &dest.instance_id)
                            .await
                        {
                            Ok(()) => {}
                            Err(e) if crate::aws::logs::is_missing(&e) => {
                                logs.ensure_group(&mut calls, &dest.log_group)
                                    .await
                                    .map_err(err)?;
                                logs.ensure_stream(&mut calls, &dest.log_group, &dest.instance_id)
                                    .await
                                    .map_err(err)?;
                            }
                            Err(e) => return Err(err(e)),
                        }
                        *ready = true;
                    }
                    self.logs_batch(&logs, &dest).await?
                }
                Kind::Events { events } => {
                    let events = events.clone();
                    self.events_batch(&events, &dest).await?
                }
            };
            if !more {
                return Ok(());
            }
        }
    }

    /// What the journal holds past the cursor: how many lines, and when the first record
    /// of them was journaled. Reads that one record from a copy of the cursor (the lane's
    /// own stays where the last acknowledged batch put it); the count is the tail's, kept
    /// up to date incrementally, so an outage costs no re-read of the journal.
    fn behind(&mut self) -> (u64, Option<crate::model::Timestamp>) {
        let mut cur = self.cursor;
        let mut first = None;
        let _ = self.tail.read(&mut cur, |line| match line.record {
            Some(r) => {
                first = Some(r.at);
                false
            }
            None => true,
        });
        (self.tail.lines_after(&self.cursor), first)
    }

    fn shipped(dest: &Destination, seq: u64, record: Record) -> Shipped {
        Shipped {
            record_id: record_id(&dest.instance_id, record.incident.0, seq),
            instance_id: dest.instance_id.clone(),
            cluster: dest.cluster.clone(),
            record,
        }
    }

    /// Moves the cursor past an acknowledged batch and saves it.
    fn advance(&mut self, next: Cursor, delivered: u64, rejected: u64) -> Result<(), String> {
        self.cursor = next;
        self.delivered += delivered;
        self.rejected += rejected;
        self.dropped = next.dropped + self.rejected;
        self.cursor
            .save(&self.cursor_path)
            .map_err(|e| format!("cannot save the export cursor: {e}"))
    }

    /// One PutLogEvents batch; whether more is waiting.
    async fn logs_batch(&mut self, logs: &Logs, dest: &Destination) -> Result<bool, String> {
        let mut batch = Batch::new();
        let mut next = self.cursor;
        let mut too_large = 0u64;
        let read = self
            .tail
            .read(&mut next, |line| {
                let Some(record) = line.record else {
                    return true;
                };
                let at = record.at.0;
                // JSON (the fleet view reads it back as it was), without the characters JSON
                // leaves raw that a console would act on (crate::model::escape::json_safe).
                let message = match serde_json::to_string(&Self::shipped(dest, line.seq, record)) {
                    Ok(m) => json_safe(&m).into_owned(),
                    Err(_) => return true,
                };
                match batch.push(LogEvent {
                    timestamp_ms: at,
                    message,
                }) {
                    Ok(()) => true,
                    Err(Full::Batch) => false,
                    Err(Full::TooLarge) => {
                        too_large += 1;
                        true
                    }
                }
            })
            .map_err(|e| e.to_string())?;
        let mut rejected = 0;
        if !batch.is_empty() {
            let mut calls = Calls::new();
            match logs
                .put(&mut calls, &dest.log_group, &dest.instance_id, &batch)
                .await
            {
                Ok(a) => rejected = a.rejected as u64,
                Err(e) => {
                    if logs::is_missing(&e)
                        && let Kind::Logs { ready, .. } = &mut self.kind
                    {
                        *ready = false;
                    }
                    return Err(err(e));
                }
            }
        }
        if rejected + too_large > 0 {
            tracing::warn!(
                rejected,
                too_large,
                "export: CloudWatch Logs did not take some records (outside its time window or over its size)"
            );
        }
        let n = batch.len() as u64;
        self.advance(next, n - rejected, rejected + too_large)?;
        Ok(read.more)
    }

    /// One PutEvents batch of transitions; whether more is waiting.
    async fn events_batch(&mut self, ev: &Events, dest: &Destination) -> Result<bool, String> {
        let mut batch: Vec<Event> = Vec::new();
        let mut bytes = 0usize;
        let mut next = self.cursor;
        let mut too_large = 0u64;
        let read = self
            .tail
            .read(&mut next, |line| {
                let Some(record) = line.record else {
                    return true;
                };
                let Some(detail_type) = detail_type(&record.event) else {
                    return true;
                };
                let time_ms = record.at.0;
                let Some(detail) = event_detail(&Self::shipped(dest, line.seq, record)) else {
                    return true;
                };
                let e = Event {
                    detail_type,
                    detail,
                    time_ms,
                    resources: Vec::new(),
                };
                if e.size() > events::MAX_BATCH_BYTES {
                    too_large += 1;
                    return true;
                }
                if batch.len() == events::MAX_ENTRIES || bytes + e.size() > events::MAX_BATCH_BYTES
                {
                    return false;
                }
                bytes += e.size();
                batch.push(e);
                true
            })
            .map_err(|e| e.to_string())?;
        let mut lost = too_large;
        if !batch.is_empty() {
            let mut calls = Calls::new();
            let rejected = ev.put(&mut calls, &batch).await.map_err(err)?;
            if let Some(r) = rejected.iter().find(|r| r.retryable) {
                // Sent again whole: the accepted ones become duplicates, which their record
                // ids make harmless.
                return Err(format!(
                    "PutEvents: {} of {} entries not accepted ({}: {})",
                    rejected.len(),
                    batch.len(),
                    r.code,
                    r.message
                ));
            }
            for r in &rejected {
                tracing::warn!(code = %r.code, "export: EventBridge refused an event: {}", r.message);
            }
            lost += rejected.len() as u64;
        }
        let n = batch.len() as u64;
        self.advance(next, n.saturating_sub(lost - too_large), lost)?;
        Ok(read.more)
    }
}

/// The EventBridge detail of a shipped record: the record as JSON with every string in it
/// (keys too) escaped ([`crate::model::escape`]). Pages are written from these values, as
/// plain text, by EventBridge's input transformers (`docs/paging.md`): a process or task name
/// a tenant chose reaches on-call's email, Slack or pager as the same visible form the
/// commands show, never as a control character or a line of its own. The journal and
/// CloudWatch Logs keep the values as they came. A detail with nothing to escape (no
/// backslash, no raw control in its JSON) is the record's JSON unchanged.
pub fn event_detail(shipped: &Shipped) -> Option<String> {
    let text = serde_json::to_string(shipped).ok()?;
    if !text.contains(|c: char| c == '\\' || is_control(c)) {
        return Some(text);
    }
    let mut v = serde_json::to_value(shipped).ok()?;
    escape_strings(&mut v);
    serde_json::to_string(&v).ok()
}

fn escape_strings(v: &mut serde_json::Value) {
    use serde_json::Value;
    let shown = |s: &str| escape(s).to_string();
    match v {
        Value::String(s) if s.contains(is_escaped) => *s = shown(s),
        Value::Array(items) => items.iter_mut().for_each(escape_strings),
        Value::Object(map) => {
            if map.keys().any(|k| k.contains(is_escaped)) {
                *map = std::mem::take(map)
                    .into_iter()
                    .map(|(k, v)| (shown(&k), v))
                    .collect();
            }
            map.values_mut().for_each(escape_strings);
        }
        _ => {}
    }
}

fn err(e: CallError) -> String {
    let class = if e.retryable {
        ""
    } else {
        " (not retryable: check the IAM policy and [export])"
    };
    format!("{e}{class}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{IncidentId, Timestamp};

    fn shipped(text: &str) -> Shipped {
        Shipped {
            record_id: "i-1/1/1".into(),
            instance_id: "i-1".into(),
            cluster: "c".into(),
            record: Record {
                at: Timestamp(1),
                incident: IncidentId(1),
                drill: None,
                event: IncidentEvent::Note { text: text.into() },
            },
        }
    }

    #[test]
    fn an_event_detail_carries_text_others_wrote_escaped_and_plain_text_unchanged() {
        let plain = shipped("program trainer (pid 42)");
        assert_eq!(
            event_detail(&plain).unwrap(),
            serde_json::to_string(&plain).unwrap()
        );
        let hostile = shipped("program \u{1b}[2J\nforged\u{202e}\u{9b} a\\b");
        let detail = event_detail(&hostile).unwrap();
        assert!(!detail.contains(is_control), "{detail}");
        let v: serde_json::Value = serde_json::from_str(&detail).unwrap();
        assert_eq!(
            v["text"], "program \\x1b[2J\\nforged\\u{202e}\\u{9b} a\\\\b",
            "{v:#}"
        );
        assert_eq!(v["record_id"], "i-1/1/1");
    }
}
