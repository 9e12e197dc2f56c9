//! The incident export's AWS side in tests: an EventBridge rule on `source` "gpu-medic" with
//! an SQS queue as its target (moto delivers matching events to it), the queue read back, and
//! the records a log group holds, read with FilterLogEvents. Every call is AWS's JSON
//! protocol straight to moto, written here: the test reads what gpu-medic wrote through code
//! of its own, not through gpu-medic's client (and builds no SDK for SQS, EventBridge or
//! CloudWatch Logs).

use serde_json::{Value, json};

use crate::http::http_sync_with;

/// One JSON-protocol call to this binary's moto: `(status, answer)`.
fn moto_json(signing_name: &str, version: &str, target: &str, body: &Value) -> (u16, Value) {
    let addr = crate::aws::moto().addr;
    // moto routes a request by the service its Authorization header names (unsigned, it
    // would take it for S3); the signature itself is not checked.
    let headers = format!(
        "Content-Type: application/x-amz-json-{version}\r\nX-Amz-Target: {target}\r\n\
         Authorization: AWS4-HMAC-SHA256 Credential=testing/20261130/us-east-1/{signing_name}/aws4_request, SignedHeaders=host, Signature=0\r\n"
    );
    let (status, text) = http_sync_with(addr, "POST", "/", &headers, &body.to_string())
        .unwrap_or_else(|| panic!("{target}: moto did not answer"));
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// One SQS call; it must succeed.
fn sqs(op: &str, body: Value) -> Value {
    let (status, out) = moto_json("sqs", "1.0", &format!("AmazonSQS.{op}"), &body);
    assert_eq!(status, 200, "SQS {op}: {out}");
    out
}

/// One EventBridge call: `(status, answer)`.
fn events(op: &str, body: Value) -> (u16, Value) {
    moto_json("events", "1.1", &format!("AWSEvents.{op}"), &body)
}

/// A queue receiving every gpu-medic event on `bus` through a rule; (queue URL, rule name).
pub fn events_to_queue(bus: &str, name: &str) -> String {
    let url = sqs("CreateQueue", json!({ "QueueName": name }))["QueueUrl"]
        .as_str()
        .unwrap()
        .to_string();
    let arn = sqs(
        "GetQueueAttributes",
        json!({ "QueueUrl": url, "AttributeNames": ["QueueArn"] }),
    )["Attributes"]["QueueArn"]
        .as_str()
        .unwrap()
        .to_string();
    if bus != "default" {
        // A bus that already exists is fine.
        events("CreateEventBus", json!({ "Name": bus }));
    }
    let (status, out) = events(
        "PutRule",
        json!({ "Name": name, "EventBusName": bus, "EventPattern": r#"{"source":["gpu-medic"]}"# }),
    );
    assert_eq!(status, 200, "PutRule: {out}");
    let (status, out) = events(
        "PutTargets",
        json!({ "Rule": name, "EventBusName": bus, "Targets": [{ "Id": "queue", "Arn": arn }] }),
    );
    assert_eq!(status, 200, "PutTargets: {out}");
    assert_eq!(
        out["FailedEntryCount"].as_u64().unwrap_or(0),
        0,
        "PutTargets: {out}"
    );
    url
}

/// Every message waiting in the queue (each an EventBridge event), taken off it.
pub fn take_events(queue_url: &str) -> Vec<Value> {
    let mut out = Vec::new();
    loop {
        let r = sqs(
            "ReceiveMessage",
            json!({ "QueueUrl": queue_url, "MaxNumberOfMessages": 10, "WaitTimeSeconds": 0 }),
        );
        let msgs = r["Messages"].as_array().cloned().unwrap_or_default();
        if msgs.is_empty() {
            return out;
        }
        for m in msgs {
            sqs(
                "DeleteMessage",
                json!({ "QueueUrl": queue_url, "ReceiptHandle": m["ReceiptHandle"] }),
            );
            out.push(serde_json::from_str(m["Body"].as_str().unwrap_or("null")).unwrap());
        }
    }
}

/// Deletes a log group, as an operator or a clean-up job may under a running export.
pub fn delete_log_group(group: &str) {
    let body = json!({ "logGroupName": group });
    let (status, out) = moto_json("logs", "1.1", "Logs_20140328.DeleteLogGroup", &body);
    assert_eq!(status, 200, "DeleteLogGroup: {out}");
}

/// Every message of a log group (optionally one stream), parsed as JSON, in the order
/// FilterLogEvents returns them; none while the group does not exist.
pub fn log_records(group: &str, stream: Option<&str>) -> Vec<Value> {
    let mut out = Vec::new();
    let mut token: Option<String> = None;
    loop {
        let mut body = json!({ "logGroupName": group });
        if let Some(s) = stream {
            body["logStreamNames"] = json!([s]);
        }
        if let Some(t) = token.take() {
            body["nextToken"] = json!(t);
        }
        let (status, r) = moto_json("logs", "1.1", "Logs_20140328.FilterLogEvents", &body);
        if status != 200 {
            return out;
        }
        let events = r["events"].as_array().cloned().unwrap_or_default();
        for e in &events {
            out.push(serde_json::from_str(e["message"].as_str().unwrap_or("null")).unwrap());
        }
        match r["nextToken"].as_str() {
            Some(t) if !events.is_empty() => token = Some(t.to_string()),
            _ => return out,
        }
    }
}
