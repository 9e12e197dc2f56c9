//! EventBridge PutEvents, as gpu-medic uses it: events with `source` [`SOURCE`] on one bus,
//! in batches the service accepts (at most [`MAX_ENTRIES`] entries and [`MAX_BATCH_BYTES`] per
//! call, each entry counted as its source, detail-type, detail and resources in UTF-8, plus 14
//! bytes for its time). A call can succeed with some entries failed: each failed entry is
//! reported with whether sending it again may work (throttling, internal failure).
//!
//! One call of AWS's JSON protocol through [`super::signed`] (no `aws-sdk-eventbridge`).

use aws_config::SdkConfig;
use serde_json::{Value, json};

use super::calls::{CallError, Calls};
use super::signed::{Service, SignedClient};

/// EventBridge as the SDK names it: `AWS_ENDPOINT_URL_EVENTBRIDGE`, signed as `events`.
const SERVICE: Service = Service {
    id: "EventBridge",
    signing_name: "events",
};

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
    client: SignedClient,
    bus: String,
}

impl Events {
    /// `bus`: a name or ARN (`default` is the account's default bus).
    pub fn new(sdk: &SdkConfig, bus: impl Into<String>) -> Self {
        Events {
            client: SignedClient::new(sdk, SERVICE),
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
        let entries: Vec<Value> = events
            .iter()
            .map(|e| {
                let mut entry = json!({
                    "Source": SOURCE,
                    "DetailType": e.detail_type,
                    "Detail": e.detail,
                    "EventBusName": self.bus,
                    // The JSON protocol's timestamps are seconds since the epoch.
                    "Time": e.time_ms as f64 / 1000.0,
                });
                if !e.resources.is_empty() {
                    entry["Resources"] = json!(e.resources);
                }
                entry
            })
            .collect();
        let r = self
            .client
            .post_json(
                "PutEvents",
                "AWSEvents.PutEvents",
                &json!({ "Entries": entries }),
            )
            .await;
        let (out, _) = calls.quiet_signed(r)?;
        if out["FailedEntryCount"].as_u64().unwrap_or(0) == 0 {
            return Ok(Vec::new());
        }
        Ok(rejected(&out))
    }
}

/// The entries a PutEvents answer says failed, by their index in the batch.
fn rejected(out: &Value) -> Vec<Rejected> {
    out["Entries"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .enumerate()
        .filter_map(|(index, e)| {
            let code = e["ErrorCode"].as_str()?.to_string();
            Some(Rejected {
                index,
                retryable: RETRYABLE_ENTRY_CODES.contains(&code.as_str()),
                message: e["ErrorMessage"].as_str().unwrap_or_default().to_string(),
                code,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_entries_are_found_by_index() {
        let out = json!({
            "FailedEntryCount": 2,
            "Entries": [
                { "EventId": "a" },
                { "ErrorCode": "ThrottlingException", "ErrorMessage": "slow down" },
                { "ErrorCode": "MalformedDetail" },
            ]
        });
        let r = rejected(&out);
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].index, r[0].retryable), (1, true));
        assert_eq!(r[0].message, "slow down");
        assert_eq!((r[1].index, r[1].retryable), (2, false));
        assert!(rejected(&json!({ "FailedEntryCount": 1 })).is_empty());
    }
}
