//! The incident export against moto's CloudWatch Logs and EventBridge (a rule sending every
//! gpu-medic event to an SQS queue, read back to see what was delivered), through the kit's
//! fault-injecting proxy: an outage (the proxy hangs up on PutLogEvents) and its end,
//! throttling, the terminate hook completed only after the flush (or after the bounded wait),
//! and, through the real `gpu-medic run`, an XID 79 whose incident is read back by the fleet
//! view from another config once the instance is gone.
//!
//! moto 5.2.5 ignores JSON filter patterns (`{ $.incident = 7 }` matches every event): the
//! fleet view filters again on its side, and the tests check the pattern it sends.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use gpu_medic::config::Config;
use gpu_medic::export::Exporter;
use gpu_medic::journal::JsonlWriter;
use gpu_medic::model::{IncidentEvent, IncidentId, IncidentState, Record, Timestamp};
use gpu_medic_testkit::aws::{self, Proxy, Seeded};
use gpu_medic_testkit::export::{delete_log_group, events_to_queue, log_records, take_events};
use gpu_medic_testkit::{Daemon, wait_for};
use serde_json::Value;

/// A config with export on, for `instance` in `cluster`, its state in `dir`.
fn export_config(dir: &Path, identity: &str, extra: &str) -> Config {
    let text = format!(
        "state_dir = \"{}\"\n{identity}\n[export]\nenabled = true\ninterval = \"200ms\"\n{extra}\n",
        dir.display()
    );
    Config::parse(&dir.join("config.toml"), &text).unwrap()
}

fn identity(instance: &str, cluster: &str) -> String {
    format!("[identity]\ninstance_id = \"{instance}\"\ncluster = \"{cluster}\"\n")
}

/// An export of one log group only (events off) through a proxy to moto, for a new cluster
/// named after `name`, in a new temp dir whose journal holds notes 1 to 3.
struct LogsOnly {
    _proxy: Proxy,
    sdk: aws_config::SdkConfig,
    dir: tempfile::TempDir,
    cfg: Config,
    group: String,
    writer: JsonlWriter<Record>,
}

async fn logs_only(name: &str, instance: &str, text: &str) -> LogsOnly {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let cluster = aws::unique(name);
    let dir = tempfile::tempdir().unwrap();
    let cfg = export_config(dir.path(), &identity(instance, &cluster), "events = false");
    let group = format!("/gpu-medic/{cluster}");
    let mut writer = JsonlWriter::open(&cfg.incidents_path()).unwrap();
    for i in 1..=3 {
        writer.append(&note(i, text)).unwrap();
    }
    LogsOnly {
        _proxy: proxy,
        sdk,
        dir,
        cfg,
        group,
        writer,
    }
}

fn note(i: u64, text: &str) -> Record {
    Record {
        at: Timestamp::now(),
        incident: IncidentId(i),
        drill: None,
        event: IncidentEvent::Note { text: text.into() },
    }
}

fn closed(i: u64) -> Record {
    Record {
        at: Timestamp::now(),
        incident: IncidentId(i),
        drill: None,
        event: IncidentEvent::Closed {
            state: IncidentState::Logged,
            summary: format!("incident {i} done"),
        },
    }
}

/// Record ids of a log group's messages, with how often each appears.
fn id_counts(records: &[Value]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for r in records {
        *m.entry(r["record_id"].as_str().unwrap().to_string())
            .or_default() += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_loses_nothing_and_the_fleet_view_drops_duplicates() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let cluster = aws::unique("outage");
    let dir = tempfile::tempdir().unwrap();
    let cfg = export_config(
        dir.path(),
        &identity("i-outage", &cluster),
        "events = false",
    );
    let group = format!("/gpu-medic/{cluster}");
    let mut w = JsonlWriter::open(&cfg.incidents_path()).unwrap();
    for i in 1..=3 {
        w.append(&note(i, "before the outage")).unwrap();
    }
    let x = Exporter::with_sdk(&cfg, &sdk);
    let r = x.flush.flush(Duration::from_secs(10)).await;
    assert!(r.complete, "{r}");
    assert_eq!(log_records(&group, None).len(), 3);
    let cursor = std::fs::read(dir.path().join("export/logs.cursor.json")).unwrap();

    // CloudWatch Logs unreachable: the records wait in the journal.
    proxy.fault(aws::Fault::hangup("PutLogEvents", 100_000));
    for i in 4..=20 {
        w.append(&note(i, "during the outage")).unwrap();
    }
    let r = x.flush.flush(Duration::from_millis(1500)).await;
    assert!(!r.complete, "{r}");
    assert!(r.detail.contains("not flushed within"), "{r}");
    assert!(proxy.count("PutLogEvents") >= 2);
    assert_eq!(log_records(&group, None).len(), 3);
    // The lane's lag (gpu_medic_export_lag_*): the 17 records waiting, since the first of them.
    let lag = x.lag[0].clone();
    wait_for(
        "the lag behind the journal",
        Duration::from_secs(10),
        || async { lag.borrow().records == 17 },
    )
    .await;
    assert_eq!(lag.borrow().lane, "logs");
    assert!(lag.borrow().behind_since.is_some());
    proxy.clear_faults();
    let r = x.flush.flush(Duration::from_secs(15)).await;
    assert!(r.complete, "{r}");
    assert_eq!(
        *lag.borrow(),
        gpu_medic::model::ExportLag {
            lane: "logs".into(),
            ..Default::default()
        },
        "caught up"
    );
    x.finish(Duration::from_secs(1)).await;
    let recs = log_records(&group, Some("i-outage"));
    let counts = id_counts(&recs);
    assert_eq!(counts.len(), 20, "{counts:?}");
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    // In journal order.
    let seqs: Vec<u64> = recs
        .iter()
        .map(|r| {
            r["record_id"]
                .as_str()
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(seqs, (1..=20).collect::<Vec<_>>());

    // A crash after a delivery but before its cursor was saved: sent again (at least once).
    std::fs::write(dir.path().join("export/logs.cursor.json"), cursor).unwrap();
    w.append(&closed(20)).unwrap();
    let x = Exporter::with_sdk(&cfg, &sdk);
    let r = x.flush.flush(Duration::from_secs(10)).await;
    assert!(r.complete, "{r}");
    x.finish(Duration::from_secs(1)).await;
    let counts = id_counts(&log_records(&group, None));
    assert_eq!(counts.len(), 21);
    assert!(
        counts.values().any(|n| *n == 2),
        "duplicates were sent: {counts:?}"
    );

    // The fleet view shows each record once.
    let logs = gpu_medic::aws::logs::Logs::new(&sdk);
    let q = gpu_medic::export::fleet_incidents::FleetQuery {
        log_group: group.clone(),
        instance: Some("i-outage".into()),
        incident: Some(20),
        since_ms: None,
    };
    let view = gpu_medic::export::fleet_incidents::read(&logs, &q)
        .await
        .unwrap();
    assert_eq!(view.incidents.len(), 1);
    let inc = &view.incidents[0].incident;
    assert_eq!(inc.records.len(), 2, "{inc:#?}");
    assert_eq!(inc.state, IncidentState::Logged);
    assert!(view.duplicates >= 1);
    assert!(
        proxy.count_with("FilterLogEvents", "$.incident = 20") >= 1,
        "the pattern is sent to the service"
    );
}

/// Issue 26, item 2: an export cursor at u64::MAX (or any count beyond what a journal can
/// hold) cannot advance: it is refused with a warning and the export starts again from the
/// journal's oldest file, never a panic or a wrapped sequence. The records keep their ids
/// (a record's id is its line in the journal), so what is sent again is the same record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_cursor_that_cannot_advance_starts_again_without_a_panic() {
    let LogsOnly {
        sdk,
        dir,
        cfg,
        group,
        _proxy,
        ..
    } = logs_only("maxcursor", "i-max", "before").await;
    std::fs::create_dir_all(dir.path().join("export")).unwrap();
    std::fs::write(
        dir.path().join("export/logs.cursor.json"),
        format!(
            "{{\"inode\":1,\"offset\":{m},\"line\":{m},\"seq\":{m},\"dropped\":{m},\"head\":0}}",
            m = u64::MAX
        ),
    )
    .unwrap();
    let x = Exporter::with_sdk(&cfg, &sdk);
    let r = x.flush.flush(Duration::from_secs(10)).await;
    assert!(r.complete, "{r}");
    x.finish(Duration::from_secs(1)).await;
    let recs = log_records(&group, Some("i-max"));
    let ids: Vec<String> = recs
        .iter()
        .map(|r| {
            r["record_id"]
                .as_str()
                .unwrap()
                .rsplit('/')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(ids, ["1", "2", "3"], "{recs:?}");
}

/// A log group deleted under a running export (an operator, a clean-up job) is created again
/// and what follows reaches it: CloudWatch Logs' refusal (`ResourceNotFoundException` in the
/// JSON protocol's `__type`) is read as "gone, create it", not as a failure to retry forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_group_deleted_under_the_export_is_created_again() {
    let mut t = logs_only("deleted", "i-del", "before the deletion").await;
    let x = Exporter::with_sdk(&t.cfg, &t.sdk);
    let r = x.flush.flush(Duration::from_secs(10)).await;
    assert!(r.complete, "{r}");
    assert_eq!(log_records(&t.group, None).len(), 3);
    delete_log_group(&t.group);
    assert!(log_records(&t.group, None).is_empty());
    for i in 4..=5 {
        t.writer.append(&note(i, "after the deletion")).unwrap();
    }
    let r = x.flush.flush(Duration::from_secs(10)).await;
    assert!(r.complete, "{r}");
    x.finish(Duration::from_secs(1)).await;
    let incidents: Vec<u64> = log_records(&t.group, Some("i-del"))
        .iter()
        .map(|r| r["incident"].as_u64().unwrap())
        .collect();
    assert_eq!(incidents, [4, 5]);
}

/// Issue 26: records appended after `incidents.jsonl` is truncated in place (the writer
/// goes on at the new end), or after logrotate's copy-and-truncate, are exported, each once;
/// nothing sent before is sent again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_after_a_truncation_or_a_copy_truncate_are_exported_once() {
    let LogsOnly {
        sdk,
        cfg,
        group,
        writer: mut w,
        _proxy,
        dir: _dir,
    } = logs_only("truncate", "i-trunc", "before the truncation").await;
    let journal = cfg.incidents_path();
    let x = Exporter::with_sdk(&cfg, &sdk);
    let r = x.flush.flush(Duration::from_secs(10)).await;
    assert!(r.complete, "{r}");
    // Truncated under the running writer, which goes on appending.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&journal)
        .unwrap()
        .set_len(0)
        .unwrap();
    for i in 4..=5 {
        w.append(&note(i, "after the truncation")).unwrap();
    }
    let r = x.flush.flush(Duration::from_secs(10)).await;
    assert!(r.complete, "{r}");
    // logrotate's copytruncate: the copy becomes NAME.1, NAME starts again.
    w.append(&note(6, "copied, not yet exported")).unwrap();
    std::fs::copy(&journal, gpu_medic::journal::rotated_path(&journal, 1)).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&journal)
        .unwrap()
        .set_len(0)
        .unwrap();
    w.append(&note(7, "after the copy-truncate")).unwrap();
    let r = x.flush.flush(Duration::from_secs(10)).await;
    assert!(r.complete, "{r}");
    x.finish(Duration::from_secs(1)).await;
    let recs = log_records(&group, Some("i-trunc"));
    let counts = id_counts(&recs);
    assert!(counts.values().all(|n| *n == 1), "{counts:?}");
    let incidents: Vec<u64> = recs
        .iter()
        .map(|r| r["incident"].as_u64().unwrap())
        .collect();
    assert_eq!(incidents, [1, 2, 3, 4, 5, 6, 7], "{recs:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_is_retried_and_events_reach_the_bus() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let cluster = aws::unique("throttle");
    let queue = events_to_queue("default", &aws::unique("q"));
    let dir = tempfile::tempdir().unwrap();
    let cfg = export_config(dir.path(), &identity("i-throttle", &cluster), "");
    let mut w = JsonlWriter::open(&cfg.incidents_path()).unwrap();
    proxy.throttle("PutLogEvents", 4);
    proxy.throttle("PutEvents", 4);
    w.append(&note(1, "a note is not an event")).unwrap();
    w.append(&closed(1)).unwrap();
    let x = Exporter::with_sdk(&cfg, &sdk);
    let r = x.flush.flush(Duration::from_secs(30)).await;
    assert!(r.complete, "{r}");
    x.finish(Duration::from_secs(1)).await;
    let injected = proxy.calls().iter().filter(|c| c.injected).count();
    assert_eq!(injected, 8, "{:?}", proxy.ops());
    let group = format!("/gpu-medic/{cluster}");
    assert_eq!(log_records(&group, None).len(), 2);
    let events = take_events(&queue);
    let mine: Vec<&Value> = events
        .iter()
        .filter(|e| e["detail"]["instance_id"] == "i-throttle")
        .collect();
    assert_eq!(mine.len(), 1, "{events:#?}");
    assert_eq!(mine[0]["source"], "gpu-medic");
    assert_eq!(mine[0]["detail-type"], "GPU Medic Incident Closed");
    assert_eq!(mine[0]["detail"]["record_id"], "i-throttle/1/2");
    assert_eq!(mine[0]["detail"]["state"], "logged");
}

/// The terminate hook's completion waits for the flush: after CloudWatch comes back, or,
/// when it stays down, after `flush_wait`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_terminate_hook_is_completed_after_the_flush_or_the_bounded_wait() {
    use gpu_medic::model::{Command, LifecycleHook, LifecycleResult};
    use gpu_medic::remedy::ControlPlane;
    use gpu_medic::remedy::aws::AwsControlPlane;
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "export-hook", 2).await;
    for (i, stays_down) in [(0usize, false), (1, true)] {
        let me = &s.nodes[i];
        let dir = tempfile::tempdir().unwrap();
        // Back after 0.8 s: the wait is long enough for the SDK's own retry of the hung-up
        // call on a loaded machine (2 s flaked); staying down: the bound itself is the test.
        let wait = if stays_down { "2s" } else { "15s" };
        let cfg = export_config(
            dir.path(),
            &aws::sections(&s, i, ""),
            &format!("events = false\nflush_wait = \"{wait}\""),
        );
        let group = format!("/gpu-medic/{}", s.cluster);
        let mut w = JsonlWriter::open(&cfg.incidents_path()).unwrap();
        w.append(&note(1, "before the hook")).unwrap();
        let x = Exporter::with_sdk(&cfg, &sdk);
        let r = x.flush.flush(Duration::from_secs(10)).await;
        assert!(r.complete, "{r}");
        proxy.lifecycle_wait(&cfg.lifecycle.terminate_hook, &me.instance_id);
        proxy.fault(aws::Fault::hangup("PutLogEvents", 100_000));
        w.append(&note(1, "the last words")).unwrap();
        if !stays_down {
            let p = proxy.clone();
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(800)).await;
                p.clear_faults();
            });
        }
        let cp = AwsControlPlane::new(&sdk, &cfg).with_flush(x.flush.clone());
        proxy.take_calls();
        let order = aws::order(
            Command::CompleteLifecycle {
                hook: LifecycleHook::Terminate,
                result: LifecycleResult::Continue,
            },
            Duration::from_secs(30),
        );
        let t0 = std::time::Instant::now();
        let done = cp
            .complete_lifecycle(&order, LifecycleHook::Terminate, LifecycleResult::Continue)
            .await
            .unwrap();
        let took = t0.elapsed();
        let calls = proxy.calls();
        let complete_at = calls
            .iter()
            .position(|c| c.op == "CompleteLifecycleAction")
            .unwrap();
        let delivered_at = calls
            .iter()
            .position(|c| c.op == "PutLogEvents" && c.status == 200);
        let stored = log_records(&group, Some(&me.instance_id));
        if stays_down {
            assert!(
                done.detail.contains("not flushed within 2s"),
                "{}",
                done.detail
            );
            assert!(took >= Duration::from_secs(2), "{took:?}");
            assert_eq!(delivered_at, None);
            assert_eq!(stored.len(), 1);
            proxy.clear_faults();
        } else {
            assert!(
                done.detail.contains("journal flushed to CloudWatch Logs"),
                "{}",
                done.detail
            );
            assert!(delivered_at.unwrap() < complete_at, "{:?}", proxy.ops());
            assert_eq!(stored.len(), 2);
        }
        assert!(proxy.lifecycle_waiting().is_empty());
        x.finish(Duration::from_secs(1)).await;
    }
}

/// Node `i` of `s` on the fake GPUs with export on, every AWS service at `endpoint`.
fn daemon(s: &Seeded, i: usize, endpoint: &str) -> Daemon {
    aws::node(
        s,
        i,
        Some(endpoint),
        "",
        "standalone_grace = \"300ms\"",
        "claim_settle = \"200ms\"\nretry_after = \"1s\"",
        "[export]\nenabled = true\ninterval = \"300ms\"\n",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xid_79_reaches_cloudwatch_and_eventbridge_and_outlives_the_instance() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "export-e2e", 3).await;
    let queue = events_to_queue("default", &aws::unique("q"));
    let me = s.nodes[0].instance_id.clone();
    let mut d = daemon(&s, 0, &proxy.url);
    d.start();
    d.wait_polled();
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for("the incident to close", Duration::from_secs(60), || async {
        d.incident(1)["state"] == "replaced"
    })
    .await;
    d.stop(Duration::from_secs(20));
    let local = d.incident(1);
    assert_eq!(local["signal"], "xid 79", "{local:#}");
    // The replace order waited for the flush and says so.
    let finished = gpu_medic_testkit::journal::finished_details(&local);
    assert!(
        finished
            .iter()
            .any(|f| f.contains("before marking it Unhealthy: journal flushed")),
        "{finished:#?}"
    );
    // Every local record is in CloudWatch Logs, once, in order (the stop flushed the rest).
    let group = format!("/gpu-medic/{}", s.cluster);
    let local_n = gpu_medic_testkit::journal::read(&d.path("state/incidents.jsonl")).len();
    let stored = log_records(&group, Some(&me));
    assert_eq!(stored.len(), local_n, "{stored:#?}");
    assert_eq!(stored[0]["event"], "opened");
    assert_eq!(stored[0]["record_id"], format!("{me}/1/1"));
    // On-call was told: opened, each action started, closed.
    let mut types: Vec<String> = Vec::new();
    wait_for("the events", Duration::from_secs(10), || {
        types.extend(
            take_events(&queue)
                .iter()
                .filter(|e| e["detail"]["instance_id"] == me.as_str())
                .map(|e| e["detail-type"].as_str().unwrap().to_string()),
        );
        let done = types.iter().any(|t| t == "GPU Medic Incident Closed");
        async move { done }
    })
    .await;
    assert_eq!(types[0], "GPU Medic Incident Opened", "{types:?}");
    assert!(
        types
            .iter()
            .filter(|t| *t == "GPU Medic Action Started")
            .count()
            >= 3,
        "{types:?}"
    );

    // The instance goes away, its disk with it.
    aws_sdk_autoscaling::Client::new(&sdk)
        .terminate_instance_in_auto_scaling_group()
        .instance_id(&me)
        .should_decrement_desired_capacity(false)
        .send()
        .await
        .unwrap();
    drop(d);

    // Another instance's config reads the fleet view.
    let other = daemon(&s, 1, &proxy.url);
    let out = other.cli(&["incidents", "list", "--fleet", "--since", "1h", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let row = lines
        .iter()
        .find(|l| l["instance_id"] == me.as_str())
        .unwrap_or_else(|| panic!("{lines:#?}"));
    assert_eq!(row["id"], 1);
    assert_eq!(row["signal"], "xid 79");
    assert_eq!(row["state"], "replaced");
    let out = other.cli(&["incidents", "list", "--fleet", "--cluster", &s.cluster]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(&format!("{me}/1")) && text.contains("replaced"),
        "{text}"
    );
    let out = other.cli(&["incidents", "show", "--fleet", &format!("{me}/1")]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.starts_with(&format!("Instance {me}")), "{text}");
    assert!(
        text.contains("timeline:") && text.contains("replace"),
        "{text}"
    );
    let out = other.cli(&["incidents", "show", "--fleet", &format!("{me}/99")]);
    assert_eq!(out.status.code(), Some(3));
}

/// One program's application faults on two instances (issue 36, docs/attribution.md): each
/// is judged the program's own, EventBridge says `GPU Medic Application Fault` (for its
/// owner, not on-call), and the fleet view lists them as one line for the program, read by a
/// third instance from CloudWatch Logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_programs_faults_on_two_instances_are_one_fleet_line_and_its_own_event() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "export-app", 3).await;
    let queue = events_to_queue("default", &aws::unique("q"));
    let mut nodes = Vec::new();
    // One program outside ECS, from an executable of its own, running on both "instances".
    let bins = tempfile::tempdir().unwrap();
    let exe = gpu_medic_testkit::proc::stand_in(bins.path(), "trainer");
    let trainer = gpu_medic_testkit::proc::Sleepers::start_exe(&exe, "trainer");
    for i in 0..2 {
        let mut d = daemon(&s, i, &proxy.url);
        d.gpus(gpu_medic_testkit::FOUR_GPUS);
        d.start();
        d.wait_polled();
        let line = format!(
            "4,1,{},-;NVRM: Xid (PCI:0000:10:00): 13, pid={}, name=trainer, \
             Graphics SM Warp Exception on (GPC 1, TPC 2, SM 0): Out Of Range Address\n",
            gpu_medic_testkit::proc::uptime_usec(),
            trainer.pids()[0]
        );
        std::fs::write(d.path("kmsg"), line).unwrap();
        let r = d.wait_record("the fault", Duration::from_secs(30), "opened", |r| {
            r["observation"]["signal"]["code"] == 13
        });
        assert_eq!(r["verdict"], "log", "{r:#}");
        nodes.push(d);
    }
    let group = format!("/gpu-medic/{}", s.cluster);
    for (i, d) in nodes.iter_mut().enumerate() {
        d.stop(Duration::from_secs(20));
        let stored = log_records(&group, Some(&s.nodes[i].instance_id));
        assert!(!stored.is_empty(), "node {i}: nothing exported");
    }
    let mut types: Vec<String> = Vec::new();
    wait_for("the two events", Duration::from_secs(10), || {
        types.extend(
            take_events(&queue)
                .iter()
                .filter_map(|e| e["detail-type"].as_str().map(str::to_string)),
        );
        let n = types
            .iter()
            .filter(|t| *t == "GPU Medic Application Fault")
            .count();
        async move { n == 2 }
    })
    .await;
    assert!(
        !types.iter().any(|t| t == "GPU Medic Incident Opened"),
        "{types:?}"
    );

    let other = daemon(&s, 2, &proxy.url);
    let out = other.cli(&["incidents", "list", "--fleet", "--since", "1h"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains(&format!(
            "executable {}: 2 incidents on 2 instances (xid 13 x2)",
            exe.display()
        )),
        "{text}"
    );
    let out = other.cli(&["incidents", "list", "--fleet", "--since", "1h", "--json"]);
    let groups: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &Value| v["kind"] == "application-faults")
        .collect();
    assert_eq!(groups.len(), 1, "{groups:#?}");
    assert_eq!(groups[0]["instances"].as_array().unwrap().len(), 2);
    // --ungrouped lists each instance's incident.
    let out = other.cli(&[
        "incidents",
        "list",
        "--fleet",
        "--since",
        "1h",
        "--ungrouped",
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    for n in &s.nodes[..2] {
        assert!(text.contains(&format!("{}/1", n.instance_id)), "{text}");
    }
}
