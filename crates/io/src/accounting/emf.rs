//! GPU memory per ECS task as CloudWatch embedded metric format (EMF) lines on stdout
//! (`[metrics] emf = true`): under systemd stdout goes to the journal, and the CloudWatch
//! agent (or any shipper that sends the lines to CloudWatch Logs) turns each line into
//! metrics, so teams without a Prometheus server get per-task numbers that ECS does not emit
//! for MPS-shared GPUs (docs/aws.md#cloudwatch-embedded-metric-format).
//!
//! One line per task, container and GPU per NVML poll (one line per task in the usual MPS
//! case: a task's containers share one GPU): the `_aws` metadata with the timestamp and one
//! metric directive (namespace `GpuMedic`; three dimension sets: the family and container,
//! those on a GPU index, and every dimension; the memory used, the processes, and where known
//! the reservation, the pinned limit in force, the SM use and the thread percentage in force),
//! then the dimension values and the metric values at the root. A dimension whose value is not known
//! (no ECS agent: no family) is left out of the sets, never sent empty.
//! gpu-medic's own log goes to stderr or the journal, never stdout, so the lines stay whole.

use std::io::Write;

use serde::Serialize;

use crate::accounting::usage::Snapshot;

/// The CloudWatch namespace of the metrics.
pub const NAMESPACE: &str = "GpuMedic";

/// One metric definition of a directive.
#[derive(Serialize)]
struct Metric {
    #[serde(rename = "Name")]
    name: &'static str,
    #[serde(rename = "Unit")]
    unit: &'static str,
}

#[derive(Serialize)]
struct Directive {
    #[serde(rename = "Namespace")]
    namespace: &'static str,
    #[serde(rename = "Dimensions")]
    dimensions: Vec<Vec<&'static str>>,
    #[serde(rename = "Metrics")]
    metrics: Vec<Metric>,
}

#[derive(Serialize)]
struct Metadata {
    #[serde(rename = "Timestamp")]
    timestamp: u64,
    #[serde(rename = "CloudWatchMetrics")]
    cloudwatch_metrics: [Directive; 1],
}

/// One line: the metadata, then the dimension values (absent when not known) and the
/// metric values at the root.
#[derive(Serialize)]
struct Line<'a> {
    _aws: Metadata,
    #[serde(rename = "TaskArn")]
    task_arn: &'a str,
    #[serde(rename = "TaskDefinitionFamily", skip_serializing_if = "str::is_empty")]
    family: &'a str,
    #[serde(
        rename = "TaskDefinitionRevision",
        skip_serializing_if = "str::is_empty"
    )]
    revision: &'a str,
    #[serde(rename = "ContainerName", skip_serializing_if = "str::is_empty")]
    container: &'a str,
    #[serde(rename = "GpuUuid", skip_serializing_if = "str::is_empty")]
    gpu_uuid: &'a str,
    /// The GPU's NVML index, as a dimension value (a string): the per-GPU panels.
    #[serde(rename = "GpuIndex")]
    gpu_index: String,
    #[serde(rename = "TaskGpuMemoryUsed")]
    used: u64,
    #[serde(rename = "TaskGpuProcesses")]
    processes: u32,
    #[serde(
        rename = "TaskGpuMemoryReserved",
        skip_serializing_if = "Option::is_none"
    )]
    reserved: Option<u64>,
    /// The container's pinned memory limit in force.
    #[serde(rename = "TaskGpuMemoryLimit", skip_serializing_if = "Option::is_none")]
    limit: Option<u64>,
    #[serde(rename = "TaskGpuSmPercent", skip_serializing_if = "Option::is_none")]
    sm: Option<u32>,
    #[serde(
        rename = "TaskGpuSmLimitPercent",
        skip_serializing_if = "Option::is_none"
    )]
    sm_limit: Option<u32>,
    /// Not a metric: the processes whose memory NVML did not report.
    #[serde(rename = "UnknownMemoryProcesses", skip_serializing_if = "is_zero")]
    unknown: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A metric of a line.
const fn metric(name: &'static str, unit: &'static str) -> Metric {
    Metric { name, unit }
}

/// The metrics of a line: use and processes always, the reservation, the limit in force and
/// the SM use and thread limit only where they are known (a metric without a value is not
/// declared).
fn metrics(reserved: bool, limit: bool, sm: bool, sm_limit: bool) -> Vec<Metric> {
    let mut m = vec![
        metric("TaskGpuMemoryUsed", "Bytes"),
        metric("TaskGpuProcesses", "Count"),
    ];
    for (known, name, unit) in [
        (reserved, "TaskGpuMemoryReserved", "Bytes"),
        (limit, "TaskGpuMemoryLimit", "Bytes"),
        (sm, "TaskGpuSmPercent", "Percent"),
        (sm_limit, "TaskGpuSmLimitPercent", "Percent"),
    ] {
        if known {
            m.push(metric(name, unit));
        }
    }
    m
}

/// The lines for one poll's snapshot taken at `at_ms` (Unix milliseconds).
pub fn lines(snap: &Snapshot, at_ms: u64) -> Vec<String> {
    let mut out = Vec::new();
    for (index, (gpu, tasks)) in &snap.gpus {
        for u in tasks {
            let names = u.names.as_ref();
            let container = names
                .and_then(|n| n.container.as_deref())
                .or(u.container.as_deref())
                .unwrap_or_default();
            let kept = snap
                .tasks
                .iter()
                .find(|t| t.task == u.task)
                .and_then(|t| t.containers.iter().find(|c| c.name == container));
            let reserved = kept.and_then(|c| c.reserved_bytes);
            let limit = kept.and_then(|c| c.limit_bytes);
            let task_arn = names.map_or(u.task.as_str(), |n| n.arn.as_str());
            let family = names.map_or("", |n| n.family.as_str());
            let revision = names.map_or("", |n| n.revision.as_str());
            let gpu_index = index.to_string();
            let line = Line {
                _aws: Metadata {
                    timestamp: at_ms,
                    cloudwatch_metrics: [Directive {
                        namespace: NAMESPACE,
                        dimensions: dimension_sets([
                            ("TaskArn", task_arn),
                            ("TaskDefinitionFamily", family),
                            ("TaskDefinitionRevision", revision),
                            ("ContainerName", container),
                            ("GpuUuid", &gpu.uuid),
                        ]),
                        metrics: metrics(
                            reserved.is_some(),
                            limit.is_some(),
                            u.sm_percent.is_some(),
                            u.sm_limit_percent.is_some(),
                        ),
                    }],
                },
                task_arn,
                family,
                revision,
                container,
                gpu_uuid: &gpu.uuid,
                gpu_index,
                used: u.bytes,
                processes: u.processes,
                reserved,
                limit,
                sm: u.sm_percent,
                sm_limit: u.sm_limit_percent,
                unknown: u.unknown,
            };
            // Task and container names are the agent's: no raw control on the way to the
            // journal's reader (crate::model::escape::json_safe).
            if let Ok(text) = serde_json::to_string(&line) {
                out.push(crate::model::escape::json_safe(&text).into_owned());
            }
        }
    }
    out
}

/// Every known dimension (a non-empty value) in one set, and the family with the container
/// (across tasks) when the family is known.
fn dimension_sets(dims: [(&'static str, &str); 5]) -> Vec<Vec<&'static str>> {
    let all: Vec<&'static str> = dims
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, _)| k)
        .collect();
    let by_family: Vec<&'static str> = all
        .iter()
        .copied()
        .filter(|k| matches!(*k, "TaskDefinitionFamily" | "ContainerName"))
        .collect();
    if by_family.contains(&"TaskDefinitionFamily") && by_family != all {
        // The family and container on each GPU index: the dashboard's panel per GPU.
        let mut by_gpu = by_family.clone();
        by_gpu.push("GpuIndex");
        vec![by_family, by_gpu, all]
    } else {
        vec![all]
    }
}

/// Writes lines to stdout, each whole; once stdout fails (a closed pipe) it stops writing,
/// quietly: the metrics are a convenience, never a reason to stop supervising.
#[derive(Debug, Default)]
pub struct Writer {
    closed: bool,
}

impl Writer {
    pub fn write(&mut self, lines: &[String]) {
        self.write_to(&mut std::io::stdout().lock(), lines);
    }

    fn write_to(&mut self, w: &mut dyn Write, lines: &[String]) {
        if self.closed || lines.is_empty() {
            return;
        }
        let mut text = String::new();
        for l in lines {
            text.push_str(l);
            text.push('\n');
        }
        if w.write_all(text.as_bytes())
            .and_then(|()| w.flush())
            .is_err()
        {
            self.closed = true;
            tracing::warn!("stdout is closed: no more EMF lines");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accounting::reserve::{ContainerMemory, TaskMemory};
    use crate::accounting::usage::{Names, TaskUsage};
    use crate::model::GpuId;
    use serde_json::{Value, json};

    /// Checks a line against the EMF specification's rules: a JSON object; `_aws` with a
    /// numeric `Timestamp` and a `CloudWatchMetrics` array of directives, each with a
    /// `Namespace` (1-255 characters), `Dimensions` (arrays of at most 30 names, each a root
    /// member with a string value) and `Metrics` (at most 100, each `Name` a root member with
    /// a number value, `Unit` a CloudWatch unit).
    pub fn check_emf(line: &str) -> Result<serde_json::Map<String, Value>, String> {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let root = v.as_object().ok_or("not an object")?.clone();
        let aws = root
            .get("_aws")
            .and_then(Value::as_object)
            .ok_or("no _aws object")?;
        aws.get("Timestamp")
            .and_then(Value::as_u64)
            .ok_or("no numeric _aws.Timestamp")?;
        let directives = aws
            .get("CloudWatchMetrics")
            .and_then(Value::as_array)
            .ok_or("no _aws.CloudWatchMetrics array")?;
        for d in directives {
            let ns = d
                .get("Namespace")
                .and_then(Value::as_str)
                .ok_or("no Namespace")?;
            if ns.is_empty() || ns.len() > 255 {
                return Err(format!("bad Namespace {ns:?}"));
            }
            for set in d
                .get("Dimensions")
                .and_then(Value::as_array)
                .ok_or("no Dimensions")?
            {
                let set = set.as_array().ok_or("a dimension set is not an array")?;
                if set.len() > 30 {
                    return Err("more than 30 dimensions".into());
                }
                for name in set {
                    let name = name.as_str().ok_or("a dimension name is not a string")?;
                    match root.get(name) {
                        Some(Value::String(s)) if !s.is_empty() => {}
                        other => return Err(format!("dimension {name}: {other:?}")),
                    }
                }
            }
            let metrics = d
                .get("Metrics")
                .and_then(Value::as_array)
                .ok_or("no Metrics")?;
            if metrics.len() > 100 {
                return Err("more than 100 metrics".into());
            }
            for m in metrics {
                let name = m.get("Name").and_then(Value::as_str).ok_or("no Name")?;
                if !root.get(name).is_some_and(Value::is_number) {
                    return Err(format!("metric {name} has no number at the root"));
                }
                if let Some(u) = m.get("Unit") {
                    let u = u.as_str().ok_or("Unit is not a string")?;
                    if !["Bytes", "Count", "Percent", "None"].contains(&u) {
                        return Err(format!("unit {u} not used here"));
                    }
                }
            }
        }
        Ok(root)
    }

    #[test]
    fn each_line_is_an_emf_document_with_the_task_dimensions() {
        let gpu = GpuId {
            index: 1,
            uuid: "GPU-1".into(),
            ..GpuId::default()
        };
        let mut snap = Snapshot::default();
        snap.gpus.insert(
            1,
            (
                gpu,
                vec![
                    TaskUsage {
                        task: "t1".into(),
                        container: Some("d1".into()),
                        bytes: 3 << 30,
                        processes: 2,
                        unknown: 1,
                        names: Some(Names {
                            arn: "arn:aws:ecs:us-east-1:1:task/c/t1".into(),
                            family: "infer".into(),
                            revision: "3".into(),
                            container: Some("app".into()),
                        }),
                        sm_percent: Some(45),
                        sm_limit_percent: Some(50),
                    },
                    TaskUsage {
                        task: "t2".into(),
                        container: None,
                        bytes: 5,
                        processes: 1,
                        unknown: 0,
                        names: None,
                        sm_percent: None,
                        sm_limit_percent: None,
                    },
                ],
            ),
        );
        snap.tasks = vec![TaskMemory {
            task: "t1".into(),
            arn: String::new(),
            family: "infer".into(),
            revision: "3".into(),
            used_bytes: 3 << 30,
            unknown: 1,
            gpus: vec![],
            containers: vec![ContainerMemory {
                name: "app".into(),
                used_bytes: 3 << 30,
                reserved_bytes: Some(4 << 30),
                processes: 1,
                limit_bytes: Some(4 << 30),
                sm_percent: Some(45),
                sm_limit_percent: Some(50),
            }],
            reserved_bytes: Some(4 << 30),
            over: false,
            sm_percent: Some(45),
        }];
        let lines = lines(&snap, 1_700_000_000_123);
        assert_eq!(lines.len(), 2);
        let a = check_emf(&lines[0]).unwrap();
        assert_eq!(a["TaskArn"], "arn:aws:ecs:us-east-1:1:task/c/t1");
        assert_eq!(a["TaskDefinitionFamily"], "infer");
        assert_eq!(a["TaskDefinitionRevision"], "3");
        assert_eq!(a["ContainerName"], "app");
        assert_eq!(a["GpuUuid"], "GPU-1");
        assert_eq!(a["TaskGpuMemoryUsed"], 3u64 << 30);
        assert_eq!(a["TaskGpuMemoryReserved"], 4u64 << 30);
        assert_eq!(a["TaskGpuProcesses"], 2);
        assert_eq!(a["_aws"]["Timestamp"], 1_700_000_000_123u64);
        assert_eq!(a["TaskGpuMemoryLimit"], 4u64 << 30);
        assert_eq!(
            (
                a["TaskGpuSmPercent"].clone(),
                a["TaskGpuSmLimitPercent"].clone()
            ),
            (json!(45), json!(50))
        );
        assert_eq!(a["GpuIndex"], "1");
        assert_eq!(
            a["_aws"]["CloudWatchMetrics"][0]["Dimensions"][0],
            json!(["TaskDefinitionFamily", "ContainerName"])
        );
        assert_eq!(
            a["_aws"]["CloudWatchMetrics"][0]["Dimensions"][1],
            json!(["TaskDefinitionFamily", "ContainerName", "GpuIndex"])
        );
        let names: Vec<&str> = a["_aws"]["CloudWatchMetrics"][0]["Metrics"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["Name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "TaskGpuMemoryUsed",
                "TaskGpuProcesses",
                "TaskGpuMemoryReserved",
                "TaskGpuMemoryLimit",
                "TaskGpuSmPercent",
                "TaskGpuSmLimitPercent"
            ]
        );
        // No agent: no family, no container name; the set holds what is known, nothing empty.
        let b = check_emf(&lines[1]).unwrap();
        assert_eq!(
            b["_aws"]["CloudWatchMetrics"][0]["Dimensions"],
            json!([["TaskArn", "GpuUuid"]])
        );
        assert!(b.get("TaskGpuMemoryReserved").is_none());
        assert!(b.get("TaskGpuSmPercent").is_none(), "not read: not sent");
        // The checker itself catches what the spec forbids.
        assert!(check_emf(r#"{"_aws":{"Timestamp":1,"CloudWatchMetrics":[{"Namespace":"N","Dimensions":[["D"]],"Metrics":[{"Name":"M"}]}]},"M":1}"#).is_err());
        assert!(check_emf(r#"{"_aws":{"Timestamp":1,"CloudWatchMetrics":[{"Namespace":"N","Dimensions":[],"Metrics":[{"Name":"M"}]}]},"M":"1"}"#).is_err());
    }

    #[test]
    fn a_closed_stdout_ends_the_lines_quietly() {
        // A real pipe whose reader is gone: the write fails with EPIPE (Rust ignores SIGPIPE).
        let (reader, mut writer) = std::io::pipe().unwrap();
        drop(reader);
        let mut w = Writer::default();
        w.write_to(&mut writer, &["{}".to_string()]);
        assert!(w.closed, "the failed write closed the stream");
        w.write_to(&mut writer, &["{}".to_string()]);
    }
}
