//! Reading what a daemon journaled, the way tests look at it: the records of `incidents.jsonl`
//! (a torn or unreadable line is skipped, as gpu-medic's own reader does) and the parts of an
//! incident (`gpu-medic incidents show --json`) the assertions name.

use std::path::Path;

use serde_json::Value;

/// Every readable line of a JSON-lines file (none when it does not exist yet).
pub fn read(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The records of one kind of event (`opened`, `action-started`, `closed`, ...).
pub fn events(records: &[Value], event: &str) -> Vec<Value> {
    records
        .iter()
        .filter(|r| r["event"] == event)
        .cloned()
        .collect()
}

/// The incident's request ids of one operation (`"PutAttributes <id>"` entries).
pub fn request_ids(incident: &Value, op: &str) -> Vec<String> {
    incident["request_ids"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .filter(|r| r.starts_with(&format!("{op} ")))
        .map(str::to_string)
        .collect()
}

/// The kinds of the orders the incident started, in order.
pub fn started_commands(incident: &Value) -> Vec<String> {
    events(incident["records"].as_array().unwrap(), "action-started")
        .iter()
        .map(|r| r["order"]["command"]["kind"].as_str().unwrap().to_string())
        .collect()
}

/// The details of the incident's finished actions, in order.
pub fn finished_details(incident: &Value) -> Vec<String> {
    events(incident["records"].as_array().unwrap(), "action-finished")
        .iter()
        .map(|r| r["outcome"]["detail"].as_str().unwrap_or("").to_string())
        .collect()
}
