//! CloudWatch Logs, as gpu-medic uses it: a log group and stream created if missing
//! (idempotent), events appended in batches the service accepts ([`Batch`] keeps every limit
//! of PutLogEvents), and FilterLogEvents for the fleet view, filtered server-side and read
//! page by page with a cap on what is read.
//!
//! The limits (PutLogEvents, CloudWatch Logs API reference): at most 10,000 events and
//! 1,048,576 bytes per batch, where each event counts its UTF-8 message plus 26 bytes; the
//! events of one batch span at most 24 hours and are in chronological order. docs/aws.md.
//!
//! Four calls of AWS's JSON protocol through [`super::signed`] (no `aws-sdk-cloudwatchlogs`).

use std::time::Duration;

use aws_config::SdkConfig;
use serde_json::{Value, json};

use super::calls::{CallError, Calls};
use super::signed::{Service, SignedClient};

/// CloudWatch Logs as the SDK names it: `AWS_ENDPOINT_URL_CLOUDWATCH_LOGS`, signed as `logs`.
const SERVICE: Service = Service {
    id: "CloudWatch Logs",
    signing_name: "logs",
};

/// Events per PutLogEvents call.
pub const MAX_BATCH_EVENTS: usize = 10_000;
/// Bytes per PutLogEvents call, counting [`EVENT_OVERHEAD`] per event.
pub const MAX_BATCH_BYTES: usize = 1_048_576;
/// What CloudWatch Logs adds to each event's message size when it sums a batch.
pub const EVENT_OVERHEAD: usize = 26;
/// The span from a batch's first to its last event.
pub const MAX_BATCH_SPAN: Duration = Duration::from_secs(24 * 3600);

/// One event to append.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEvent {
    /// Milliseconds since the Unix epoch.
    pub timestamp_ms: u64,
    pub message: String,
}

/// Why an event does not go into this batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Full {
    /// The batch is full (count, bytes or time span): send it, then start the next one.
    Batch,
    /// The event alone is larger than a batch may be: it can never be sent.
    TooLarge,
}

/// A batch being filled within the PutLogEvents limits. Timestamps are made non-decreasing
/// (an event stamped before the previous one takes the previous one's stamp).
#[derive(Debug, Default)]
pub struct Batch {
    events: Vec<LogEvent>,
    bytes: usize,
    max_events: usize,
}

impl Batch {
    pub fn new() -> Self {
        Batch::with_max_events(MAX_BATCH_EVENTS)
    }

    /// A batch of at most `n` events (≤ [`MAX_BATCH_EVENTS`]).
    pub fn with_max_events(n: usize) -> Self {
        Batch {
            events: Vec::new(),
            bytes: 0,
            max_events: n.clamp(1, MAX_BATCH_EVENTS),
        }
    }

    /// Adds `e`, or says why it does not fit.
    pub fn push(&mut self, mut e: LogEvent) -> Result<(), Full> {
        let size = e.message.len() + EVENT_OVERHEAD;
        if size > MAX_BATCH_BYTES {
            return Err(Full::TooLarge);
        }
        if self.events.len() >= self.max_events || self.bytes + size > MAX_BATCH_BYTES {
            return Err(Full::Batch);
        }
        if let Some(last) = self.events.last() {
            e.timestamp_ms = e.timestamp_ms.max(last.timestamp_ms);
        }
        if let Some(first) = self.events.first()
            && e.timestamp_ms - first.timestamp_ms > MAX_BATCH_SPAN.as_millis() as u64
        {
            return Err(Full::Batch);
        }
        self.bytes += size;
        self.events.push(e);
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Bytes as CloudWatch Logs counts them.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn events(&self) -> &[LogEvent] {
        &self.events
    }
}

/// What PutLogEvents accepted: the events it rejected (too old, too new, past the group's
/// retention) are counted, never retried (they would be rejected again).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Accepted {
    pub rejected: usize,
}

/// One event FilterLogEvents returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub stream: String,
    pub timestamp_ms: u64,
    pub message: String,
}

/// A FilterLogEvents query.
#[derive(Debug, Clone, Default)]
pub struct Query {
    pub group: String,
    /// Only these streams (empty: all).
    pub streams: Vec<String>,
    /// A CloudWatch Logs filter pattern, applied by the service.
    pub pattern: Option<String>,
    pub start_ms: Option<u64>,
    /// At most this many events are read; past it `Scan::truncated` says so.
    pub max_events: usize,
}

/// How a query's reading ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Scan {
    pub read: usize,
    pub truncated: bool,
}

/// The CloudWatch Logs calls gpu-medic makes.
#[derive(Clone)]
pub struct Logs {
    client: SignedClient,
}

impl Logs {
    pub fn new(sdk: &SdkConfig) -> Self {
        Logs {
            client: SignedClient::new(sdk, SERVICE),
        }
    }

    async fn call(
        &self,
        op: &'static str,
        body: Value,
    ) -> Result<(Value, Option<String>), CallError> {
        self.client
            .post_json(op, &format!("Logs_20140328.{op}"), &body)
            .await
    }

    /// Creates the log group unless it exists.
    pub async fn ensure_group(&self, calls: &mut Calls, group: &str) -> Result<(), CallError> {
        let op = "CreateLogGroup";
        let r = self.call(op, json!({ "logGroupName": group })).await;
        already_ok(calls.track_signed(op, r, |(_, id)| id.as_deref()))
    }

    /// Creates the log stream unless it exists.
    pub async fn ensure_stream(
        &self,
        calls: &mut Calls,
        group: &str,
        stream: &str,
    ) -> Result<(), CallError> {
        let op = "CreateLogStream";
        let r = self
            .call(
                op,
                json!({ "logGroupName": group, "logStreamName": stream }),
            )
            .await;
        already_ok(calls.track_signed(op, r, |(_, id)| id.as_deref()))
    }

    /// Appends a batch (in order, as [`Batch`] built it).
    pub async fn put(
        &self,
        calls: &mut Calls,
        group: &str,
        stream: &str,
        batch: &Batch,
    ) -> Result<Accepted, CallError> {
        let events: Vec<Value> = batch
            .events()
            .iter()
            .map(|e| json!({ "timestamp": e.timestamp_ms, "message": e.message }))
            .collect();
        let body = json!({
            "logGroupName": group,
            "logStreamName": stream,
            "logEvents": events,
        });
        let (out, _) = calls.quiet_signed(self.call("PutLogEvents", body).await)?;
        Ok(Accepted {
            rejected: rejected(&out["rejectedLogEventsInfo"], batch.len()),
        })
    }

    /// Runs `q`, handing each event to `f` in the order the service returns them (per
    /// stream, by time). Reads at most `q.max_events` events.
    pub async fn filter(
        &self,
        calls: &mut Calls,
        q: &Query,
        mut f: impl FnMut(Found),
    ) -> Result<Scan, CallError> {
        let mut scan = Scan::default();
        let mut token: Option<String> = None;
        loop {
            let mut body = json!({ "logGroupName": q.group });
            if let Some(p) = &q.pattern {
                body["filterPattern"] = json!(p);
            }
            if let Some(t) = token.take() {
                body["nextToken"] = json!(t);
            }
            if !q.streams.is_empty() {
                body["logStreamNames"] = json!(q.streams);
            }
            if let Some(s) = q.start_ms {
                body["startTime"] = json!(s);
            }
            let (out, _) = calls.quiet_signed(self.call("FilterLogEvents", body).await)?;
            let events = out["events"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default();
            for e in events {
                if scan.read >= q.max_events {
                    scan.truncated = true;
                    return Ok(scan);
                }
                scan.read += 1;
                f(Found {
                    stream: e["logStreamName"].as_str().unwrap_or_default().to_string(),
                    timestamp_ms: e["timestamp"].as_u64().unwrap_or(0),
                    message: e["message"].as_str().unwrap_or_default().to_string(),
                });
            }
            match out["nextToken"].as_str() {
                Some(t) if !t.is_empty() && !events.is_empty() => token = Some(t.to_string()),
                _ => return Ok(scan),
            }
        }
    }
}

/// How many of a batch of `n` events PutLogEvents did not store, from its
/// `rejectedLogEventsInfo`: indexes into the batch, the events up to `tooOld`/`expired`'s end
/// (inclusive) and from `tooNew`'s start on.
fn rejected(info: &Value, n: usize) -> usize {
    if !info.is_object() {
        return 0;
    }
    let index = |k: &str| {
        info[k]
            .as_u64()
            .map(|i| usize::try_from(i).unwrap_or(usize::MAX))
    };
    let old = index("tooOldLogEventEndIndex")
        .max(index("expiredLogEventEndIndex"))
        .map_or(0, |i| i.saturating_add(1).min(n));
    let new = index("tooNewLogEventStartIndex").map_or(0, |i| n.saturating_sub(i.min(n)));
    (old + new).min(n)
}

/// A create call that found the resource already there succeeded.
fn already_ok<T>(r: Result<T, CallError>) -> Result<(), CallError> {
    match r {
        Ok(_) => Ok(()),
        Err(e) if e.code.as_deref() == Some("ResourceAlreadyExistsException") => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether PutLogEvents failed because the group or stream is gone (create them again).
pub fn is_missing(e: &CallError) -> bool {
    e.code.as_deref() == Some("ResourceNotFoundException")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(t: u64, len: usize) -> LogEvent {
        LogEvent {
            timestamp_ms: t,
            message: "x".repeat(len),
        }
    }

    #[test]
    fn a_batch_keeps_every_put_log_events_limit() {
        let mut b = Batch::new();
        for i in 0..MAX_BATCH_EVENTS as u64 {
            b.push(ev(1_000 + i, 1)).unwrap();
        }
        assert_eq!(b.push(ev(20_000, 1)), Err(Full::Batch), "count");

        let mut b = Batch::new();
        let big = MAX_BATCH_BYTES / 4 - EVENT_OVERHEAD;
        for _ in 0..4 {
            b.push(ev(1, big)).unwrap();
        }
        assert_eq!(b.bytes(), MAX_BATCH_BYTES);
        assert_eq!(
            b.push(ev(1, 0)),
            Err(Full::Batch),
            "bytes, overhead counted"
        );
        assert_eq!(
            Batch::new().push(ev(1, MAX_BATCH_BYTES)),
            Err(Full::TooLarge)
        );

        let mut b = Batch::new();
        b.push(ev(0, 1)).unwrap();
        let day = MAX_BATCH_SPAN.as_millis() as u64;
        b.push(ev(day, 1)).unwrap();
        assert_eq!(b.push(ev(day + 1, 1)), Err(Full::Batch), "24 h span");
    }

    #[test]
    fn rejected_events_are_counted_from_their_indexes() {
        assert_eq!(rejected(&Value::Null, 10), 0);
        assert_eq!(rejected(&json!({ "tooOldLogEventEndIndex": 2 }), 10), 3);
        assert_eq!(
            rejected(
                &json!({ "tooOldLogEventEndIndex": 1, "expiredLogEventEndIndex": 3 }),
                10
            ),
            4
        );
        assert_eq!(rejected(&json!({ "tooNewLogEventStartIndex": 7 }), 10), 3);
        assert_eq!(
            rejected(
                &json!({ "tooOldLogEventEndIndex": 8, "tooNewLogEventStartIndex": 2 }),
                10
            ),
            10
        );
        assert_eq!(rejected(&json!({ "tooOldLogEventEndIndex": 99 }), 10), 10);
    }

    #[test]
    fn timestamps_never_go_backwards_within_a_batch() {
        let mut b = Batch::new();
        b.push(ev(500, 1)).unwrap();
        b.push(ev(400, 1)).unwrap();
        b.push(ev(600, 1)).unwrap();
        let t: Vec<u64> = b.events().iter().map(|e| e.timestamp_ms).collect();
        assert_eq!(t, [500, 500, 600]);
    }
}
