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

/// The records of one kind of event (`opened`, `action-started`, `closed`, ...) of the
/// scenario under test: a record [`about_the_test_machine`] is left out.
pub fn events(records: &[Value], event: &str) -> Vec<Value> {
    records
        .iter()
        .filter(|r| r["event"] == event && !about_the_test_machine(r))
        .cloned()
        .collect()
}

/// Whether a record is a fact about the machine the tests run on rather than about the
/// scenario: the node probe's reading of the disk under `state_dir` (`state-disk-full`, at
/// 95 % by the default policy). A test's state directory lies on the machine's shared disk,
/// which CI machines run at 95 % full at times; the incident is then true, and no test
/// that counts its scenario's incidents is about it (tests/gpu_view.rs tests the reading).
pub fn about_the_test_machine(r: &Value) -> bool {
    r["observation"]["signal"]["kind"] == "state-disk-full"
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

/// Whether the engine's committed state (`state.json`, read as [`crate::Daemon::state`]
/// gives it) has applied the kernel-log file `kmsg` up to its end: the cursor of the file's
/// current stream (its device and inode, latest generation) at the file's length, and none of
/// its records journaled ahead of that cursor. Once the file ends with a driver's line, every
/// record before it was handed over and journaled, or dropped as a duplicate: the fact a
/// test waits for before it says "nothing more was journaled".
pub fn kmsg_applied(state: &Value, kmsg: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::metadata(kmsg) else {
        return false;
    };
    let file = format!("kmsg-file:{}:{}", meta.dev(), meta.ino());
    let generation = |key: &str| -> Option<u64> {
        let rest = key.strip_prefix(&file)?;
        match rest.strip_prefix(':') {
            None if rest.is_empty() => Some(0),
            None => None,
            Some(g) => g.parse().ok(),
        }
    };
    let delivery = &state["delivery"];
    let Some((stream, cursor)) = delivery["cursors"]
        .as_object()
        .and_then(|c| {
            c.iter()
                .filter_map(|(k, v)| Some((generation(k)?, k, v)))
                .max_by_key(|x| x.0)
        })
        .map(|(_, k, v)| (k.clone(), v))
    else {
        return false;
    };
    let ahead = delivery["ahead"]
        .as_array()
        .is_some_and(|a| a.iter().any(|x| x[0] == stream.as_str()));
    cursor["pos"].as_u64().is_some_and(|p| p >= meta.len()) && !ahead
}
