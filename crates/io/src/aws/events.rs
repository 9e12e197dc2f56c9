//! EventBridge PutEvents, as gpu-medic uses it: events with `source` [`SOURCE`] on one bus,
//! in batches the service accepts (at most [`MAX_ENTRIES`] entries and [`MAX_BATCH_BYTES`] per
//! call, each entry counted as its source, detail-type, detail and resources in UTF-8, plus 14
//! bytes for its time). A call can succeed with some entries failed: each failed entry is
//! reported with whether sending it again may work (throttling, internal failure).

use aws_sdk_eventbridge::Client;
use aws_sdk_eventbridge::primitives::DateTime;
use aws_sdk_eventbridge::types::PutEventsRequestEntry;

use super::calls::{CallError, Calls};

/// The `source` of every gpu-medic event.
pub const SOURCE: &str = "gpu-medic";
/// Entries per PutEvents call.
pub const MAX_ENTRIES: usize = 10;
/// Bytes per PutEvents call (all entries, as EventBridge sizes them).
pub const MAX_BATCH_BYTES: usize = 256 * 1024;

/// One event to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub detail_type: &'static str,
    /// A JSON object.
    pub detail: String,
    pub time_ms: u64,
    /// ARNs the event is about (the instance).
    pub resources: Vec<String>,
}

impl Event {
    /// The entry's size as EventBridge counts it.
    pub fn size(&self) -> usize {
        14 + SOURCE.len()
            + self.detail_type.len()
            + self.detail.len()
            + self.resources.iter().map(String::len).sum::<usize>()
    }
}

/// An entry PutEvents did not accept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejected {
    /// Its index in the batch.
    pub index: usize,
    pub code: String,
    pub message: String,
    /// Sending it again may succeed.
    pub retryable: bool,
}

/// Entry error codes that clear by themselves.
const RETRYABLE_ENTRY_CODES: &[&str] = &[
    "ThrottlingException",
    "InternalFailure",
    "InternalException",
];

/// PutEvents on one bus.
#[derive(Clone)]
pub struct Events {
    client: Client,
    bus: String,
}

impl Events {
    /// `bus`: a name or ARN (`default` is the account's default bus).
    pub fn new(client: Client, bus: impl Into<String>) -> Self {
        Events {
            client,
            bus: bus.into(),
        }
    }

    /// Publishes `events` (at most [`MAX_ENTRIES`]); returns the entries not accepted.
    pub async fn put(
        &self,
        calls: &mut Calls,
        events: &[Event],
    ) -> Result<Vec<Rejected>, CallError> {
        if events.len() > MAX_ENTRIES {
            return Err(CallError::terminal(
                "PutEvents",
                format!("{} entries: at most {MAX_ENTRIES} per call", events.len()),
            ));
        }
        let entries: Vec<PutEventsRequestEntry> = events
            .iter()
            .map(|e| {
                PutEventsRequestEntry::builder()
                    .source(SOURCE)
                    .detail_type(e.detail_type)
                    .detail(e.detail.clone())
                    .event_bus_name(&self.bus)
                    .time(DateTime::from_millis(
                        i64::try_from(e.time_ms).unwrap_or(i64::MAX),
                    ))
                    .set_resources((!e.resources.is_empty()).then(|| e.resources.clone()))
                    .build()
            })
            .collect();
        let r = self
            .client
            .put_events()
            .set_entries(Some(entries))
            .send()
            .await;
        let out = calls.quiet("PutEvents", r)?;
        if out.failed_entry_count() == 0 {
            return Ok(Vec::new());
        }
        Ok(out
            .entries()
            .iter()
            .enumerate()
            .filter_map(|(index, e)| {
                let code = e.error_code()?.to_string();
                Some(Rejected {
                    index,
                    retryable: RETRYABLE_ENTRY_CODES.contains(&code.as_str()),
                    message: e.error_message().unwrap_or_default().to_string(),
                    code,
                })
            })
            .collect())
    }
}
