//! The incident export's AWS side in tests: an EventBridge rule on `source` "gpu-medic" with
//! an SQS queue as its target (moto delivers matching events to it), the queue read back
//! (SQS's JSON protocol, straight to moto: the SDK for SQS is not a dependency), and the
//! records a log group holds, read with FilterLogEvents.

use aws_config::SdkConfig;
use serde_json::{Value, json};

use crate::http::http_sync_with;

/// One SQS call (JSON protocol) to this binary's moto.
fn sqs(op: &str, body: Value) -> Value {
    let addr = crate::aws::moto().addr;
    // moto routes a request by the service its Authorization header names (unsigned, it
    // would take it for S3); the signature itself is not checked.
    let headers = format!(
        "Content-Type: application/x-amz-json-1.0\r\nX-Amz-Target: AmazonSQS.{op}\r\n\
         Authorization: AWS4-HMAC-SHA256 Credential=testing/20261130/us-east-1/sqs/aws4_request, SignedHeaders=host, Signature=0\r\n"
    );
    let (status, text) = http_sync_with(addr, "POST", "/", &headers, &body.to_string())
        .unwrap_or_else(|| panic!("SQS {op}: moto did not answer"));
    assert_eq!(status, 200, "SQS {op}: {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

/// A queue receiving every gpu-medic event on `bus` through a rule; (queue URL, rule name).
pub async fn events_to_queue(sdk: &SdkConfig, bus: &str, name: &str) -> String {
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
    let eb = aws_sdk_eventbridge::Client::new(sdk);
    if bus != "default" {
        let _ = eb.create_event_bus().name(bus).send().await;
    }
    eb.put_rule()
        .name(name)
        .event_bus_name(bus)
        .event_pattern(r#"{"source":["gpu-medic"]}"#)
        .send()
        .await
        .unwrap();
    eb.put_targets()
        .rule(name)
        .event_bus_name(bus)
        .targets(
            aws_sdk_eventbridge::types::Target::builder()
                .id("queue")
                .arn(arn)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
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

/// Every message of a log group (optionally one stream), parsed as JSON, in the order
/// FilterLogEvents returns them.
pub async fn log_records(sdk: &SdkConfig, group: &str, stream: Option<&str>) -> Vec<Value> {
    let logs = aws_sdk_cloudwatchlogs::Client::new(sdk);
    let mut out = Vec::new();
    let mut token = None;
    loop {
        let r = match logs
            .filter_log_events()
            .log_group_name(group)
            .set_log_stream_names(stream.map(|s| vec![s.to_string()]))
            .set_next_token(token.take())
            .send()
            .await
        {
            Ok(r) => r,
            Err(_) => return out,
        };
        for e in r.events() {
            out.push(serde_json::from_str(e.message().unwrap_or("null")).unwrap());
        }
        match r.next_token() {
            Some(t) if !r.events().is_empty() => token = Some(t.to_string()),
            _ => return out,
        }
    }
}
