//! A fleet on one machine (issue 51; docs/fleet-scale.md): the recording proxy's AWS-shaped
//! weather (throttling from the documented rates, 5xx bursts, outages) as gpu-medic's own
//! adapters see it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic::aws::calls::{CallError, Calls};
use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::throttle::{Service, Weather};

/// Every service gpu-medic calls, throttled by the proxy's weather, answers in its own words:
/// gpu-medic's adapters (the SDK's clients and its own signed client) read each answer as
/// throttling (the service's code, retryable), after retrying it as many times as their
/// retry mode allows, and the proxy records each attempt as throttled and whose it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_is_throttled_in_its_own_words() {
    let proxy = Proxy::start().await;
    let harness = aws::sdk(&proxy.url).await;
    let s = aws::seed(&harness, "weather", 2).await;
    let table = aws::unique("weather");
    aws::create_slot_table(&harness, &table).await;
    // One token per bucket, refilled about once a day: the first call of each bucket passes,
    // every later one is throttled. The harness's own calls are never throttled.
    proxy.weather(Weather::scaled(1e-6, 51));
    let node = aws::sdk_as(&proxy.url, "NODE0001").await;
    let ecs = gpu_medic::aws::ecs::Ecs::new(aws_sdk_ecs::Client::new(&node), &s.cluster);
    let asg = gpu_medic::aws::asg::Asg::new(aws_sdk_autoscaling::Client::new(&node));
    let ec2 = gpu_medic::aws::ec2::Ec2::new(&node);
    let dynamo =
        gpu_medic::aws::dynamo::SlotTable::new(aws_sdk_dynamodb::Client::new(&node), &table);
    let logs = gpu_medic::aws::logs::Logs::new(&node);
    let mut calls = Calls::new();
    let ids = vec![s.nodes[0].instance_id.clone()];

    // First calls pass (each bucket's one token).
    ecs.list_instances(&mut calls).await.unwrap();
    asg.group(&mut calls, &s.asg).await.unwrap();
    ec2.terminated(&mut calls, &ids).await.unwrap();
    dynamo.read(&mut calls, &s.asg).await.unwrap();
    logs.ensure_group(&mut calls, &table).await.unwrap();

    // Then each is throttled, in its service's words, and classified retryable.
    let expect = |e: CallError, code: &str| {
        assert_eq!(e.code.as_deref(), Some(code), "{e:?}");
        assert!(e.retryable, "{e:?}");
    };
    expect(
        ecs.list_instances(&mut calls).await.unwrap_err(),
        "ThrottlingException",
    );
    expect(
        asg.group(&mut calls, &s.asg).await.unwrap_err(),
        "Throttling",
    );
    expect(
        ec2.terminated(&mut calls, &ids).await.unwrap_err(),
        "RequestLimitExceeded",
    );
    let e = dynamo.read(&mut calls, &s.asg).await.unwrap_err();
    assert!(e.is_retryable(), "{e:?}");
    assert!(e.to_string().contains("ThrottlingException"), "{e}");
    expect(
        logs.ensure_group(&mut calls, &table).await.unwrap_err(),
        "ThrottlingException",
    );
    // Auto Scaling keeps one bucket for all its actions: another action is throttled too.
    expect(
        asg.set_unhealthy(&mut calls, &s.nodes[0].instance_id)
            .await
            .unwrap_err(),
        "Throttling",
    );

    // The record: who called, which service, throttled; each throttled call retried by the
    // client to its attempt limit (3: the SDK's standard mode and the signed client alike).
    let record = proxy.calls();
    let mine: Vec<_> = record.iter().filter(|c| c.node == "NODE0001").collect();
    assert!(
        record
            .iter()
            .filter(|c| c.node == "test")
            .all(|c| !c.throttled)
    );
    for (service, op) in [
        (Service::Ecs, "ListContainerInstances"),
        (Service::AutoScaling, "DescribeAutoScalingGroups"),
        (Service::Ec2, "DescribeInstances"),
        (Service::DynamoDb, "GetItem"),
        (Service::Logs, "CreateLogGroup"),
    ] {
        let of: Vec<_> = mine.iter().filter(|c| c.op == op).collect();
        assert!(of.iter().all(|c| c.service == service), "{op}: {of:?}");
        let throttled = of.iter().filter(|c| c.throttled).count();
        assert_eq!(
            (of.len() - throttled, throttled),
            (1, 3),
            "{op}: one call passed, then three attempts throttled"
        );
    }
    let statuses: Vec<u16> = mine
        .iter()
        .filter(|c| c.throttled && c.service == Service::Ec2)
        .map(|c| c.status)
        .collect();
    assert!(statuses.iter().all(|s| *s == 503), "{statuses:?}");

    // A 5xx burst and an outage, then clear weather (the rates refilled).
    proxy.weather(Weather::scaled(1000.0, 51));
    proxy.with_weather(|w| w.fail_burst(Service::Ecs, 1.0, Duration::from_secs(60)));
    let e = ecs.list_instances(&mut calls).await.unwrap_err();
    assert!(
        e.retryable && e.code.as_deref() == Some("ServerException"),
        "{e:?}"
    );
    proxy.with_weather(|w| {
        w.clear_trouble();
        w.outage(Service::DynamoDb, Duration::from_secs(60));
    });
    let e = dynamo.read(&mut calls, &s.asg).await.unwrap_err();
    assert!(e.is_retryable(), "an outage is worth retrying: {e:?}");
    proxy.with_weather(|w| w.clear_trouble());
    dynamo.read(&mut calls, &s.asg).await.unwrap();
    ecs.list_instances(&mut calls).await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// The fleet harness: N real daemons (GM_FLEET_N, default 20), scenarios sharing one start
// (GM_FLEET_SCENARIOS, default "idle,a,e,f"); scripts/fleet-sim.sh runs it with N = 100 and
// prints the figures (GM_FLEET_REPORT: where the figures go as JSON).

use std::collections::{BTreeMap, BTreeSet};

use gpu_medic_testkit::fleet::{self, Fleet, Opts, Record};
use gpu_medic_testkit::now_ms;
use gpu_medic_testkit::stats::Rng;

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One measured phase: its window and what it was.
struct Phase {
    name: &'static str,
    from: f64,
    to: f64,
}

/// The figures of every phase, printed and written as JSON.
fn report(f: &Fleet, phases: &[Phase], extra: serde_json::Value) -> serde_json::Value {
    let r = f.record();
    let n = f.nodes.len() as f64;
    let mut out = serde_json::Map::new();
    for p in phases {
        let hours = (p.to - p.from) / 3_600_000.0;
        let per_node_hour = |c: usize| c as f64 / n / hours;
        let mut apis = serde_json::Map::new();
        eprintln!(
            "\n== {} ({:.0} s, {} nodes): calls per node-hour by API",
            p.name,
            (p.to - p.from) / 1000.0,
            n
        );
        for ((service, op), (calls, throttled)) in r.by_api(p.from, p.to) {
            eprintln!(
                "  {:<12} {:<34} {:>10.1}  ({calls} calls, {throttled} throttled)",
                service.name(),
                op,
                per_node_hour(calls)
            );
            apis.insert(
                format!("{}:{op}", service.name()),
                serde_json::json!({"per_node_hour": per_node_hour(calls), "calls": calls, "throttled": throttled}),
            );
        }
        let u = r.units(p.from, p.to);
        let (lost, puts) = r.conflicts(p.from, p.to);
        let (busiest, who) = r.busiest(p.from, p.to, 10.0);
        eprintln!(
            "  DynamoDB read units {:.0}, write units {:.0}; Logs {} bytes in {} calls; EventBridge {} events; conditional writes lost {lost} of {puts}; busiest node {busiest} calls in 10 s ({who})",
            u.read_units, u.write_units, u.log_bytes, u.log_puts, u.events
        );
        out.insert(
            p.name.to_string(),
            serde_json::json!({
                "seconds": (p.to - p.from) / 1000.0,
                "apis": apis,
                "read_units": u.read_units, "write_units": u.write_units,
                "log_bytes": u.log_bytes, "log_calls": u.log_puts, "events": u.events,
                "conflicts": lost, "puts": puts, "busiest_10s": busiest,
            }),
        );
    }
    out.insert("extra".into(), extra);
    out.insert("n".into(), serde_json::json!(f.nodes.len()));
    serde_json::Value::Object(out)
}

/// Node `i`'s incidents (`incidents list --json`: one object per line).
fn incidents(f: &Fleet, i: usize) -> Vec<serde_json::Value> {
    let out = f.nodes[i].cli(&["incidents", "list", "--json"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Whether node `i`'s journal (its incidents' records: deferrals, outcomes) says any of `words`.
fn journal_says(f: &Fleet, i: usize, words: &[&str]) -> bool {
    f.nodes[i]
        .records()
        .iter()
        .any(|r| words.iter().any(|w| r.to_string().contains(w)))
}

/// Each instance's last pass of the fleet gate for the pattern whose slot starts with
/// `prefix`: the time of its sighting in the group's fleet document (ms).
async fn last_passes(f: &Fleet, prefix: &str) -> BTreeMap<String, u64> {
    fleet_doc(f)
        .await
        .sightings
        .into_iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .flat_map(|(_, seen)| seen)
        .collect()
}

/// Waits until every node of `which` is replaced, or has an incident saying why it stays
/// (`held`: the words), up to `limit`; returns those replaced.
async fn wait_resolved(
    f: &Fleet,
    which: &BTreeSet<usize>,
    held: &[&str],
    limit: Duration,
) -> BTreeSet<usize> {
    let ids: BTreeMap<usize, String> = which
        .iter()
        .map(|i| (*i, f.s.nodes[*i].instance_id.clone()))
        .collect();
    let resolved = || {
        let replaced = f.asg.replaced();
        ids.iter()
            .all(|(i, id)| replaced.contains(id) || (!held.is_empty() && journal_says(f, *i, held)))
    };
    let t0 = std::time::Instant::now();
    while !resolved() && t0.elapsed() < limit {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let replaced = f.asg.replaced();
    ids.into_iter()
        .filter(|(_, id)| replaced.contains(id))
        .map(|(i, _)| i)
        .collect()
}

/// The record's invariants: never more than `budget` remediations at once; no instance
/// remediated twice; only `faulted` instances remediated.
fn check_budget(r: &Record, budget: usize, faulted: &BTreeSet<String>) {
    let (most, who) = r.most_at_once();
    assert!(most <= budget, "{most} at once (budget {budget}): {who:?}");
    let eps = r.episodes();
    let mut per: BTreeMap<&str, usize> = BTreeMap::new();
    for e in &eps {
        *per.entry(e.instance.as_str()).or_default() += 1;
        assert!(
            faulted.contains(&e.instance),
            "{} was remediated without a fault: {e:?}",
            e.instance
        );
    }
    for (i, k) in per {
        assert_eq!(k, 1, "{i} remediated {k} times: {eps:?}");
    }
}

/// Scenario a: XID 79 on 30 % of the nodes within 10 s, gpu-medic restarted (SIGKILL) on
/// three random nodes mid-way. Every faulted node ends replaced (the breaker lets one repair
/// through at a time while open, then the budget); never more than the budget out at once.
async fn scenario_a(
    f: &mut Fleet,
    rng: &mut Rng,
    budget: usize,
) -> (BTreeSet<usize>, serde_json::Value) {
    let n = f.nodes.len();
    let k = (n * 3).div_ceil(10);
    let mut all: Vec<usize> = (0..n).collect();
    let mut faulted = BTreeSet::new();
    while faulted.len() < k {
        let i = all.remove(rng.below(all.len() as u64) as usize);
        faulted.insert(i);
    }
    let t0 = now_ms();
    let gap = Duration::from_millis(10_000 / k as u64);
    let restarts: Vec<usize> = (0..3).map(|_| rng.below(n as u64) as usize).collect();
    for (j, i) in faulted.iter().enumerate() {
        f.nodes[*i].inject(r#"{"gpu": 0, "xid": 79}"#);
        if j == k / 2 {
            for r in &restarts {
                f.restart(*r);
            }
        }
        tokio::time::sleep(gap).await;
    }
    let limit = Duration::from_secs(env_or("GM_FLEET_A_LIMIT_S", 120 + 20 * k as u64));
    let replaced = wait_resolved(f, &faulted, &[], limit).await;
    // Time from the burst to every slot in use (the budget's slots all held at once).
    let r = f.record();
    let full = r.episodes().iter().find_map(|e| {
        let t = e.start_ms;
        let now = r
            .episodes()
            .iter()
            .filter(|o| o.start_ms <= t && o.end_ms.is_none_or(|end| end > t))
            .count();
        (now >= budget.min(k)).then_some(t - t0)
    });
    let ids: BTreeSet<String> = faulted
        .iter()
        .map(|i| f.s.nodes[*i].instance_id.clone())
        .collect();
    check_budget(&r, budget, &ids);
    assert_eq!(
        replaced, faulted,
        "every faulted node replaced; restarted: {restarts:?}"
    );
    eprintln!(
        "scenario a: {k} of {n} faulted, restarted {restarts:?}, all replaced in {:.0} s; most at once {} (budget {budget}); every slot in use {:?} ms after the burst",
        (now_ms() - t0) / 1000.0,
        r.most_at_once().0,
        full
    );
    (
        faulted,
        serde_json::json!({"faulted": k, "replaced_s": (now_ms() - t0) / 1000.0,
            "most_at_once": r.most_at_once().0, "budget": budget,
            "all_slots_in_use_ms": full}),
    )
}

/// Nodes not in `used`, `k` of them, drawn with `rng`.
fn pick(rng: &mut Rng, n: usize, used: &BTreeSet<usize>, k: usize) -> BTreeSet<usize> {
    let mut free: Vec<usize> = (0..n).filter(|i| !used.contains(i)).collect();
    let mut out = BTreeSet::new();
    while out.len() < k && !free.is_empty() {
        out.insert(free.remove(rng.below(free.len() as u64) as usize));
    }
    out
}

/// Scenario e: control-plane trouble. Throttling as a fleet of 10,000 would meet it
/// (the rates scaled by N / 10,000), a 30 % 5xx burst on every service for 20 s, then a 60 s
/// outage of every service; two nodes fault at the start. No busy loop (the busiest node's
/// calls in any 10 s), no duplicate drain, and each of the two ends replaced or with an
/// incident that says why not.
async fn scenario_e(
    f: &mut Fleet,
    rng: &mut Rng,
    used: &BTreeSet<usize>,
    budget: usize,
) -> (BTreeSet<usize>, serde_json::Value) {
    let n = f.nodes.len();
    let outage = Duration::from_secs(env_or("GM_FLEET_OUTAGE_S", 60));
    let faulted = pick(rng, n, used, 2);
    let t0 = now_ms();
    f.proxy.weather(Weather::scaled(n as f64 / 10_000.0, 51));
    f.proxy.with_weather(|w| {
        for s in Service::ALL {
            w.fail_burst(s, 0.3, Duration::from_secs(20));
            w.latency(s, 0, 200);
        }
    });
    // XID 64 (replace): a fingerprint of its own, apart from scenario a's and c's.
    for i in &faulted {
        f.nodes[*i].inject(r#"{"gpu": 0, "xid": 64}"#);
    }
    tokio::time::sleep(Duration::from_secs(20)).await;
    f.proxy.with_weather(|w| {
        for s in Service::ALL {
            w.outage(s, outage);
        }
    });
    tokio::time::sleep(outage).await;
    let trouble_end = now_ms();
    // Clear weather: an account's own rates (not scaled down).
    f.proxy.weather(Weather::scaled(1.0, 51));
    let limit = Duration::from_secs(env_or("GM_FLEET_E_LIMIT_S", 240));
    // Carried out (replaced), or abandoned with words that say so (never a passing deferral).
    let why = ["gave up", "giving up"];
    let replaced = wait_resolved(f, &faulted, &why, limit).await;
    let r = f.record();
    let (busiest, who) = r.busiest(t0, trouble_end, 10.0);
    let throttled = r.between(t0, trouble_end).filter(|c| c.throttled).count();
    let all = r.between(t0, trouble_end).count();
    eprintln!(
        "scenario e: {} of 2 replaced; {throttled} of {all} calls throttled; busiest node {busiest} calls in 10 s ({who})",
        replaced.len()
    );
    // No busy loop: a node's retries are paced (SDK attempts, the engine's retry delay, the
    // deferrals' full jitter), never a tight loop against a failing API.
    assert!(busiest <= 100, "{who}: {busiest} calls within 10 s");
    let _ = budget;
    (
        faulted,
        serde_json::json!({"replaced": replaced.len(), "throttled": throttled, "calls": all,
            "busiest_10s": busiest, "outage_s": outage.as_secs()}),
    )
}

/// The group's fleet document, read by the harness (straight from moto).
async fn fleet_doc(f: &Fleet) -> gpu_medic::remedy::budget::patterns::Doc {
    let t =
        gpu_medic::aws::dynamo::SlotTable::new(aws_sdk_dynamodb::Client::new(&f.moto), &f.table);
    let item = t.read_fleet(&mut Calls::new(), &f.s.asg).await.unwrap();
    serde_json::from_str(&item.doc).unwrap()
}

/// Scenario c: a fingerprint. XID 48 (replace) on `threshold` nodes within 10 s, with the
/// same driver, AMI and instance type: ONE fleet incident, opened by one conditional write and
/// paged once (one EventBridge event); no drain of those nodes starts after it opened while
/// it is not acknowledged, and another fault (XID 79 on one more node) goes on within the
/// budget meanwhile; `fleet status` shows it unacknowledged; after `fleet ack` every held node
/// is replaced.
async fn scenario_c(
    f: &mut Fleet,
    rng: &mut Rng,
    used: &BTreeSet<usize>,
    threshold: usize,
) -> (BTreeSet<usize>, serde_json::Value) {
    let n = f.nodes.len();
    let t0 = now_ms();
    let nodes = pick(rng, n, used, threshold);
    assert_eq!(nodes.len(), threshold, "too few nodes left for scenario c");
    let gap = Duration::from_millis(10_000 / threshold as u64);
    for i in &nodes {
        f.nodes[*i].inject(r#"{"gpu": 0, "xid": 48}"#);
        tokio::time::sleep(gap).await;
    }
    let mut opened = None;
    let t = std::time::Instant::now();
    let limit = Duration::from_secs(env_or("GM_FLEET_C_LIMIT_S", 180));
    while opened.is_none() && t.elapsed() < limit {
        opened = fleet_doc(f)
            .await
            .incidents
            .into_values()
            .find(|i| i.key.starts_with("xid 48 |"));
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let Some(inc) = opened else {
        let doc = fleet_doc(f).await;
        let seen: Vec<(&String, usize)> = doc.sightings.iter().map(|(k, v)| (k, v.len())).collect();
        let recorded: BTreeSet<&String> = doc.sightings.values().flat_map(|v| v.keys()).collect();
        let unseen: Vec<usize> = nodes
            .iter()
            .copied()
            .filter(|i| !recorded.contains(&f.s.nodes[*i].instance_id))
            .collect();
        let log = f.nodes[*unseen.first().or(nodes.iter().next_back()).unwrap_or(&0)].run_log();
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        panic!(
            "no fleet incident for the XID 48 fingerprint on {threshold} nodes within {limit:?}; \
             sightings {seen:?}; nodes not recorded {unseen:?}; the first one's log, newest first:\n{}",
            tail.join("\n")
        );
    };
    // Every node of the fingerprint ends held (an incident saying so) or on its way: it
    // passed the gate before the incident opened. The gate is the first thing a drain does
    // and writes the instance's sighting with its time at every pass, so the document's
    // last sighting of an instance is its last pass: at or before the opening, the drain
    // goes on (its slot and DRAINING may come a minute later on a loaded machine), after it
    // the instance is held.
    let held_words = ["held for an operator"];
    let ids: BTreeMap<usize, String> = nodes
        .iter()
        .map(|i| (*i, f.s.nodes[*i].instance_id.clone()))
        .collect();
    let open_ms = inc.opened_ms as f64;
    let t = std::time::Instant::now();
    let (unsettled, passes) = loop {
        let passes = last_passes(f, "fp:xid 48 |").await;
        let eps = f.record().episodes();
        let unsettled: Vec<usize> = ids
            .iter()
            .filter(|(i, id)| {
                let passed_before = passes.get(*id).is_some_and(|ms| *ms as f64 <= open_ms);
                let on_its_way = eps
                    .iter()
                    .any(|e| &e.instance == *id && (e.start_ms <= open_ms || passed_before));
                !on_its_way && !journal_says(f, **i, &held_words)
            })
            .map(|(i, _)| *i)
            .collect();
        if unsettled.is_empty() || t.elapsed() >= limit {
            break (unsettled, passes);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    if !unsettled.is_empty() {
        let report: Vec<String> = unsettled
            .iter()
            .map(|i| {
                let id = &ids[i];
                let log = f.nodes[*i].run_log();
                let tail: Vec<&str> = log.lines().rev().take(8).collect();
                format!(
                    "node {i} ({id}; last gate pass {:?} ms, the incident opened at {open_ms} ms), newest first:\n{}",
                    passes.get(id),
                    tail.join("\n")
                )
            })
            .collect();
        panic!(
            "nodes of the fingerprint neither held nor on their way when {} opened, within {limit:?}:\n{}",
            inc.id,
            report.join("\n\n")
        );
    }
    // Another fault goes on within the budget meanwhile.
    let other = pick(rng, n, &used.union(&nodes).copied().collect(), 1);
    for i in &other {
        f.nodes[*i].inject(r#"{"gpu": 0, "xid": 79}"#);
    }
    let replaced = wait_resolved(f, &other, &[], Duration::from_secs(240)).await;
    assert_eq!(
        replaced, other,
        "another fault is not held by the fleet incident"
    );
    // No drain of the fingerprint passed the gate after the incident opened: one that
    // started later passed it before (its last sighting is at or before the opening).
    let passes = last_passes(f, "fp:xid 48 |").await;
    let late: Vec<_> = f
        .record()
        .episodes()
        .into_iter()
        .filter(|e| {
            ids.values().any(|id| *id == e.instance)
                && e.start_ms > open_ms + 1000.0
                && passes
                    .get(&e.instance)
                    .is_none_or(|ms| *ms as f64 > open_ms)
        })
        .collect();
    assert!(
        late.is_empty(),
        "drains held by {} started: {late:?}",
        inc.id
    );
    // One incident, one page.
    let doc = fleet_doc(f).await;
    let ours: Vec<_> = doc
        .incidents
        .values()
        .filter(|i| i.key.starts_with("xid 48 |"))
        .collect();
    assert_eq!(ours.len(), 1, "{doc:?}");
    let pages: usize = f
        .proxy
        .calls()
        .iter()
        .filter(|c| c.op == "PutEvents" && c.body.contains("GPU Medic Fleet Incident Opened"))
        .count();
    assert_eq!(pages, 1, "paged once");
    // `fleet status` shows it unacknowledged; `fleet ack` lets the held drains go.
    let asker = *nodes.iter().next().unwrap();
    let out = f.nodes[asker].cli(&["fleet", "status", "--json"]);
    let st: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    let shown = st["fleet_incidents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == inc.id.as_str())
        .cloned()
        .unwrap_or_default();
    assert!(shown["acked"].is_null(), "{st:#}");
    let text =
        String::from_utf8_lossy(&f.nodes[asker].cli(&["fleet", "status"]).stdout).to_string();
    assert!(
        text.contains("NOT acknowledged") && text.contains(&inc.id),
        "{text}"
    );
    let out = f.nodes[asker].cli(&["fleet", "ack", &inc.id, "--by", "on-call"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let acked = fleet_doc(f).await.incidents[&inc.id].acked.clone();
    assert_eq!(acked.map(|a| a.by), Some("on-call".into()));
    let limit = Duration::from_secs(env_or("GM_FLEET_C_LIMIT_S", 120 + 30 * threshold as u64));
    let replaced = wait_resolved(f, &nodes, &[], limit).await;
    assert_eq!(
        replaced, nodes,
        "every node of the fingerprint replaced after the ack"
    );
    eprintln!(
        "scenario c: {} ({} instances) opened {:.1} s after the first fault, paged once; other fault replaced while held; all {} replaced after the ack ({:.0} s in all)",
        inc.id,
        inc.instances.len(),
        (inc.opened_ms as f64 - t0) / 1000.0,
        nodes.len(),
        (now_ms() - t0) / 1000.0
    );
    let mut all = nodes.clone();
    all.extend(other);
    (
        all,
        serde_json::json!({"threshold": threshold, "opened_after_s": (inc.opened_ms as f64 - t0) / 1000.0,
            "pages": pages, "fleet_incident": inc.id}),
    )
}

/// Node `i`'s fleet status, as JSON, and the fleet incident `id` in it.
fn status_shows(f: &Fleet, i: usize, id: &str) -> serde_json::Value {
    let out = f.nodes[i].cli(&["fleet", "status", "--json"]);
    let st: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    st["fleet_incidents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("{id} not in fleet status: {st:#}"))
}

/// The pages (EventBridge `GPU Medic Fleet Incident Opened`) that name fleet incident `id`.
fn pages_of(f: &Fleet, id: &str) -> usize {
    f.proxy
        .calls()
        .iter()
        .filter(|c| {
            c.op == "PutEvents"
                && c.body.contains("GPU Medic Fleet Incident Opened")
                && c.body.contains(id)
        })
        .count()
}

/// Waits (up to `limit`) for the group's fleet document to hold an incident of `kind` and
/// `key`.
async fn wait_fleet_incident(
    f: &Fleet,
    kind: gpu_medic::remedy::budget::patterns::Kind,
    key: &str,
    limit: Duration,
) -> Option<gpu_medic::remedy::budget::patterns::FleetIncident> {
    let t = std::time::Instant::now();
    loop {
        let found = fleet_doc(f)
            .await
            .incidents
            .into_values()
            .find(|i| i.kind == kind && i.key == key);
        if found.is_some() || t.elapsed() > limit {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Scenario b: a poison task. One task definition's application XID (13, at a GPC/TPC) on
/// `threshold` nodes, each in a task of that definition on that node (real processes in
/// ECS-shaped cgroups, named by the shared ECS agent): ONE fleet incident naming the task
/// definition, paged once, `fleet status` showing it, acknowledged by `fleet ack`; no node
/// drained or marked Unhealthy for it, each ACTIVE. The driver's line names the process
/// `decoy:9`: the definition is gpu-medic's own attribution (cgroup, agent), never that name.
async fn scenario_b(
    f: &mut Fleet,
    rng: &mut Rng,
    used: &BTreeSet<usize>,
    threshold: usize,
) -> serde_json::Value {
    use gpu_medic::remedy::budget::patterns::Kind;
    use gpu_medic_testkit::proc::EcsTaskProcs;
    let n = f.nodes.len();
    let t0 = now_ms();
    let nodes = pick(rng, n, used, threshold);
    assert_eq!(nodes.len(), threshold, "too few nodes left for scenario b");
    // One task of definition `poison:1` per node, its process in the task's cgroup.
    let task_id = |i: usize| format!("{:016x}{:016x}", std::process::id(), 0xb000 + i);
    let container = |i: usize| {
        format!(
            "{:08x}{:08x}{}",
            std::process::id(),
            0xb000 + i,
            "b0".repeat(24)
        )
    };
    let procs: Vec<(usize, EcsTaskProcs)> = nodes
        .iter()
        .map(|i| {
            let p = EcsTaskProcs::start(&task_id(*i), &container(*i), 1).unwrap_or_else(|e| {
                panic!("scenario b needs root and a cgroup v1 pids hierarchy: {e}")
            });
            (*i, p)
        })
        .collect();
    let arns: Vec<String> = nodes
        .iter()
        .map(|i| {
            format!(
                "arn:aws:ecs:us-east-1:123456789012:task/{}/{}",
                f.s.cluster,
                task_id(*i)
            )
        })
        .collect();
    let containers: Vec<[(String, &str); 1]> =
        nodes.iter().map(|i| [(container(*i), "main")]).collect();
    let c: Vec<Vec<(&str, &str)>> = containers
        .iter()
        .map(|x| x.iter().map(|(a, b)| (a.as_str(), *b)).collect())
        .collect();
    let listed: Vec<gpu_medic_testkit::imds::AgentTask> = arns
        .iter()
        .zip(&c)
        .map(|(a, c)| (a.as_str(), "poison", &c[..]))
        .collect();
    f.agent.set_tasks(&listed);
    for (i, p) in &procs {
        let line = format!(
            "4,{},{},-;NVRM: Xid (PCI:0000:1b:00): 13, pid={}, name=decoy:9, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
            1000 + i,
            gpu_medic_testkit::proc::uptime_usec(),
            p.pids()[0]
        );
        f.nodes[*i].kmsg_append(&[line]);
    }
    let inc = wait_fleet_incident(f, Kind::Task, "poison:1", Duration::from_secs(120))
        .await
        .unwrap_or_else(|| {
            panic!(
                "a fleet incident for task definition poison:1; the nodes' incidents: {:#?}\nlogs: {}",
                nodes.iter().map(|i| incidents(f, *i)).collect::<Vec<_>>(),
                nodes
                    .iter()
                    .map(|i| f.nodes[*i]
                        .run_log()
                        .lines()
                        .filter(|l| l.contains("xid") || l.contains("kmsg") || l.contains("fleet") || l.contains("ERROR") || l.contains("WARN"))
                        .collect::<Vec<_>>()
                        .join("\n"))
                    .collect::<Vec<_>>()
                    .join("\n---\n")
            )
        });
    let opened_s = (inc.opened_ms as f64 - t0) / 1000.0;
    let ids: BTreeSet<String> = nodes
        .iter()
        .map(|i| f.s.nodes[*i].instance_id.clone())
        .collect();
    assert_eq!(
        inc.instances.iter().cloned().collect::<BTreeSet<_>>(),
        ids,
        "{inc:?}"
    );
    // Each node judged it the application's: an incident naming the definition, verdict log.
    for i in &nodes {
        assert!(
            journal_says(f, *i, &["\"definition\":\"poison:1\""]),
            "node {i}: {:#?}",
            incidents(f, *i)
        );
    }
    // Paged once; nothing in the document keyed by the process's own name.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let doc = fleet_doc(f).await;
    let ours: Vec<_> = doc
        .incidents
        .values()
        .filter(|i| i.kind == Kind::Task)
        .collect();
    assert_eq!(ours.len(), 1, "{doc:?}");
    assert!(
        !serde_json::to_string(&doc).unwrap().contains("decoy"),
        "{doc:?}"
    );
    assert_eq!(pages_of(f, &inc.id), 1, "paged once");
    // No node drained or marked Unhealthy for it; each ACTIVE.
    let touched: Vec<_> = f
        .record()
        .episodes()
        .into_iter()
        .filter(|e| ids.contains(&e.instance) && e.start_ms >= t0)
        .collect();
    assert!(touched.is_empty(), "drained for a poison task: {touched:?}");
    for i in &nodes {
        let (status, _, _) = aws::instance(&f.moto, &f.s.cluster, &f.s.nodes[*i].arn).await;
        assert_eq!(status, "ACTIVE", "node {i}");
    }
    // `fleet status` shows it unacknowledged; `fleet ack` acknowledges it.
    let asker = *nodes.iter().next().unwrap();
    assert!(status_shows(f, asker, &inc.id)["acked"].is_null());
    let text =
        String::from_utf8_lossy(&f.nodes[asker].cli(&["fleet", "status"]).stdout).to_string();
    assert!(
        text.contains("task definition poison:1") && text.contains("NOT acknowledged"),
        "{text}"
    );
    let out = f.nodes[asker].cli(&["fleet", "ack", &inc.id, "--by", "owner"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(status_shows(f, asker, &inc.id)["acked"]["by"], "owner");
    drop(procs);
    eprintln!(
        "scenario b: {} (task definition poison:1 on {} instances) opened {opened_s:.1} s after the faults, paged once, no node drained",
        inc.id,
        inc.instances.len()
    );
    serde_json::json!({"threshold": threshold, "opened_after_s": opened_s, "fleet_incident": inc.id})
}

/// Scenario d: a bad image. The group gains new instances from `ami-0badbad0` whose GPUs
/// fail the launch gate (XID 79 in the kernel log since boot): each runs
/// `gpu-medic check --lifecycle`; an abandoned launch is terminated and its successor launched
/// (played here, desired capacity kept), as Auto Scaling does. The launch-failure breaker
/// (`abandon_limit`) trips at the next one: that instance is kept, quarantined, and the
/// replacements stop. ONE fleet incident for the AMI, paged once (a second tripped launch
/// opens nothing new), shown by `fleet status`; no instance launched after the trip.
async fn scenario_d(f: &mut Fleet, abandon_limit: u32) -> serde_json::Value {
    use gpu_medic::remedy::budget::patterns::Kind;
    use gpu_medic_testkit::imds::FakeImds;
    const HOOK: &str = "gpu-medic-launch";
    const AMI: &str = "ami-0badbad0";
    let t0 = now_ms();
    let asg = aws_sdk_autoscaling::Client::new(&f.moto);
    aws::put_hook(
        &f.moto,
        &f.s.asg,
        HOOK,
        "autoscaling:EC2_INSTANCE_LAUNCHING",
        30,
        "ABANDON",
    )
    .await;
    let members = || async { aws::asg_instance_ids(&f.moto, &f.s.asg).await };
    let desired = aws::asg_group(&f.moto, &f.s.asg)
        .await
        .desired_capacity()
        .unwrap_or(0);
    // Two new instances asked for (a scale-out); each launch that is abandoned is replaced.
    let before: BTreeSet<String> = members().await.into_iter().collect();
    asg.set_desired_capacity()
        .auto_scaling_group_name(&f.s.asg)
        .desired_capacity(desired + 2)
        .send()
        .await
        .unwrap();
    let mut seen = before.clone();
    let mut launches: Vec<(String, String)> = Vec::new(); // (instance, decision)
    let mut waiting: Vec<String> = members()
        .await
        .into_iter()
        .filter(|i| !before.contains(i))
        .collect();
    seen.extend(waiting.iter().cloned());
    let most = abandon_limit as usize + 4;
    while let Some(id) = waiting.pop() {
        assert!(launches.len() < most, "churn: {launches:?}");
        let imds = FakeImds::start(&id).await;
        imds.set_target(Some("Pending:Wait"));
        imds.set_instance_type(Some("t2.micro"));
        imds.set_doc("ami-id", Some(AMI));
        let key = format!("LAUNCH{:02}", launches.len());
        let d = fleet::launching(
            &f.s,
            &id,
            &key,
            &f.proxy.url,
            &f.table,
            &imds.url,
            abandon_limit,
        );
        d.kmsg_append(&["4,812,91000000,-;NVRM: Xid (PCI:0000:10:00): 79, pid=1234, name=python3, GPU has fallen off the bus."]);
        f.proxy.lifecycle_wait(HOOK, &id);
        let out = d
            .command()
            .args(["check", "--lifecycle", "--json", "--config"])
            .arg(d.config())
            .output()
            .unwrap();
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{e}: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            )
        });
        let decision = r["decision"].as_str().unwrap_or("").to_string();
        launches.push((id.clone(), decision.clone()));
        if decision == "abandon" {
            // Auto Scaling terminates an abandoned launch and launches another.
            asg.terminate_instance_in_auto_scaling_group()
                .instance_id(&id)
                .should_decrement_desired_capacity(false)
                .send()
                .await
                .unwrap();
            let next: Vec<String> = members()
                .await
                .into_iter()
                .filter(|i| !seen.contains(i))
                .collect();
            seen.extend(next.iter().cloned());
            waiting.extend(next);
        } else {
            assert_eq!(decision, "quarantine", "{r:#}");
            assert_eq!(r["breaker"]["tripped"], true, "{r:#}");
            assert!(
                r["fleet_incident"]
                    .as_str()
                    .is_some_and(|x| x.starts_with("img-")),
                "{r:#}"
            );
        }
    }
    // The first `abandon_limit` launches abandoned, every later one kept: the two asked for
    // and the abandoned ones' successors, no more.
    let abandoned = launches.iter().filter(|(_, d)| d == "abandon").count();
    assert_eq!(abandoned, abandon_limit as usize, "{launches:?}");
    assert_eq!(launches.len(), abandon_limit as usize + 2, "{launches:?}");
    // No churn: nothing launched since the last gate.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after: BTreeSet<String> = members().await.into_iter().collect();
    assert!(
        after.is_subset(&seen),
        "launched after the breaker tripped: {:?}",
        after.difference(&seen).collect::<Vec<_>>()
    );
    let inc = wait_fleet_incident(f, Kind::Image, AMI, Duration::from_secs(5))
        .await
        .expect("a fleet incident for the AMI");
    let doc = fleet_doc(f).await;
    let ours: Vec<_> = doc
        .incidents
        .values()
        .filter(|i| i.kind == Kind::Image)
        .collect();
    assert_eq!(ours.len(), 1, "once: {doc:?}");
    assert_eq!(
        inc.instances.len(),
        launches.len(),
        "every failed launch named: {inc:?}"
    );
    assert_eq!(pages_of(f, &inc.id), 1, "paged once");
    let st = status_shows(f, 0, &inc.id);
    assert!(st["acked"].is_null(), "{st:#}");
    // The operator's part, played: the quarantined launches are removed and the group's size
    // put back with them (a SetDesiredCapacity would let Auto Scaling pick which to end).
    for (id, d) in &launches {
        if d == "quarantine" {
            asg.terminate_instance_in_auto_scaling_group()
                .instance_id(id)
                .should_decrement_desired_capacity(true)
                .send()
                .await
                .unwrap();
        }
    }
    assert_eq!(
        aws::asg_group(&f.moto, &f.s.asg).await.desired_capacity(),
        Some(desired)
    );
    eprintln!(
        "scenario d: {} ({AMI}): {abandoned} launches abandoned, then the breaker kept {} quarantined; paged once; no launch after the trip ({:.0} s)",
        inc.id,
        launches.len() - abandoned,
        (now_ms() - t0) / 1000.0
    );
    serde_json::json!({"abandon_limit": abandon_limit, "launches": launches.len(), "fleet_incident": inc.id})
}

/// Scenario f: a source outage (NVML, the ECS agent, IMDS) on 30 % of the other nodes for
/// 90 s: none is taken out of service, and each is back to healthy after (no operator).
async fn scenario_f(f: &mut Fleet, rng: &mut Rng, used: &BTreeSet<usize>) -> serde_json::Value {
    let n = f.nodes.len();
    let dark = pick(rng, n, used, (n * 3).div_ceil(10));
    let outage = Duration::from_secs(env_or("GM_FLEET_SOURCE_OUTAGE_S", 90));
    let t0 = now_ms();
    for i in &dark {
        f.nodes[*i].inject(r#"{"fail": {"function": "nvmlDeviceGetCount_v2", "code": 999}}"#);
        f.imds[*i].set_down(true);
    }
    f.agent.set_down(true);
    tokio::time::sleep(outage).await;
    for i in &dark {
        f.nodes[*i].inject(r#"{"fail": {"function": "nvmlDeviceGetCount_v2", "code": 0}}"#);
        f.imds[*i].set_down(false);
    }
    f.agent.set_down(false);
    // Each dark node polls NVML a few times more after the sources are back (all counted
    // from now, awaited together).
    let before: Vec<(usize, usize)> = dark
        .iter()
        .map(|i| (*i, f.nodes[*i].nvml_polls()))
        .collect();
    gpu_medic_testkit::wait_sync(
        "every dark node to poll NVML three more times",
        Duration::from_secs(120),
        || {
            before
                .iter()
                .all(|(i, b)| f.nodes[*i].nvml_polls() >= b + 3)
        },
        String::new,
    );
    let r = f.record();
    let ids: BTreeSet<String> = dark
        .iter()
        .map(|i| f.s.nodes[*i].instance_id.clone())
        .collect();
    let touched: Vec<_> = r
        .episodes()
        .into_iter()
        .filter(|e| ids.contains(&e.instance) && e.start_ms >= t0)
        .collect();
    assert!(
        touched.is_empty(),
        "a source outage took nodes out: {touched:?}"
    );
    // Back in service: ACTIVE, not marked faulted, Healthy.
    let health = aws::asg_health(&f.moto, &f.s.asg).await;
    for i in &dark {
        let (status, _, attrs) = aws::instance(&f.moto, &f.s.cluster, &f.s.nodes[*i].arn).await;
        assert_eq!(status, "ACTIVE", "node {i}");
        assert!(
            !attrs.contains(&("gpu-medic.health".into(), Some("faulted".into()))),
            "node {i} latched out of service: {attrs:?}\n{:#?}",
            incidents(f, *i)
        );
        assert!(
            health.contains(&(f.s.nodes[*i].instance_id.clone(), "Healthy".into())),
            "node {i}: {health:?}"
        );
    }
    eprintln!(
        "scenario f: {} nodes without NVML, IMDS and the ECS agent for {} s: none taken out of service",
        dark.len(),
        outage.as_secs()
    );
    serde_json::json!({"dark": dark.len(), "outage_s": outage.as_secs()})
}

/// The fleet: N daemons, the scenarios in turn on one start, the invariants checked from the
/// proxy's record and AWS's final state, and the figures (calls per node-hour by API, units,
/// bytes, events) printed for each phase.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fleet_of_n_daemons() {
    let n: usize = env_or("GM_FLEET_N", 20);
    let scenarios: String = env_or("GM_FLEET_SCENARIOS", "idle,a,e,c,b,d,f".to_string());
    let has = |s: &str| scenarios.split(',').any(|x| x.trim() == s);
    let mut o = Opts::new(n);
    // Fleet incidents: a fingerprint on more instances than scenario a faults (30 %) and the
    // one other XID 79 of scenario c (a and c must not meet: XID 79 is a's fingerprint).
    let threshold = (n * 3).div_ceil(10) + 2;
    // A poison task (scenario b): one task definition's application faults on this many.
    let task_threshold: usize = env_or("GM_FLEET_TASK_THRESHOLD", 3);
    o.fleet_extra = format!(
        "fingerprint_threshold = {threshold}\ntask_threshold = {task_threshold}\npattern_window = \"1h\"\n"
    );
    o.budget = env_or("GM_FLEET_BUDGET", "\"20%\"".to_string());
    o.breaker = env_or("GM_FLEET_BREAKER", "\"20%\"".to_string());
    o.retry_after = env_or("GM_FLEET_RETRY_AFTER", o.retry_after.clone());
    o.tick = env_or("GM_FLEET_TICK", o.tick.clone());
    o.grace = env_or("GM_FLEET_GRACE", o.grace.clone());
    o.nvml_poll = env_or("GM_FLEET_NVML_POLL", o.nvml_poll.clone());
    // Mixed versions (scenario g, not in CI): the even nodes run an older gpu-medic.
    if let Ok(old) = std::env::var("GM_FLEET_OLD_BIN") {
        o.binary_old = Some(old.into());
        o.policy_old = std::env::var("GM_FLEET_OLD_POLICY").ok().map(Into::into);
        o.old = (0..n).step_by(2).collect();
    }
    let pct = |s: &str| {
        s.trim_matches('"')
            .trim_end_matches('%')
            .parse::<f64>()
            .unwrap_or(20.0)
    };
    let budget = fleet::budget_of(n, pct(&o.budget));
    let t_start = now_ms();
    let mut f = Fleet::start(&o).await;
    let started = now_ms();
    eprintln!(
        "{n} daemons started in {:.1} s",
        (started - t_start) / 1000.0
    );
    let mut rng = Rng::new(env_or("GM_FLEET_SEED", 51));
    let mut phases = vec![];
    let mut extra = serde_json::Map::new();
    extra.insert(
        "start_s".into(),
        serde_json::json!((started - t_start) / 1000.0),
    );
    // The calls of the start (identity checks, the first ECS GPU view, the first sweep),
    // then the steady state.
    tokio::time::sleep(Duration::from_secs(env_or("GM_FLEET_SETTLE_S", 10))).await;
    phases.push(Phase {
        name: "start",
        from: t_start,
        to: now_ms(),
    });
    if has("idle") {
        let idle = Duration::from_secs(env_or("GM_FLEET_IDLE_S", 30));
        let from = now_ms();
        tokio::time::sleep(idle).await;
        phases.push(Phase {
            name: "idle",
            from,
            to: now_ms(),
        });
        extra.insert("footprint".into(), footprint(&f));
    }
    let mut used = BTreeSet::new();
    if has("a") {
        let from = now_ms();
        let (faulted, x) = scenario_a(&mut f, &mut rng, budget).await;
        used.extend(faulted);
        phases.push(Phase {
            name: "a",
            from,
            to: now_ms(),
        });
        extra.insert("a".into(), x);
    }
    if has("e") {
        let from = now_ms();
        let (faulted, x) = scenario_e(&mut f, &mut rng, &used, budget).await;
        used.extend(faulted);
        phases.push(Phase {
            name: "e",
            from,
            to: now_ms(),
        });
        extra.insert("e".into(), x);
    }
    if has("c") {
        let from = now_ms();
        let (faulted, x) = scenario_c(&mut f, &mut rng, &used, threshold).await;
        used.extend(faulted);
        phases.push(Phase {
            name: "c",
            from,
            to: now_ms(),
        });
        extra.insert("c".into(), x);
    }
    if has("b") {
        let from = now_ms();
        let x = scenario_b(&mut f, &mut rng, &used, task_threshold).await;
        phases.push(Phase {
            name: "b",
            from,
            to: now_ms(),
        });
        extra.insert("b".into(), x);
    }
    if has("d") {
        let from = now_ms();
        let x = scenario_d(&mut f, env_or("GM_FLEET_ABANDON_LIMIT", 3)).await;
        phases.push(Phase {
            name: "d",
            from,
            to: now_ms(),
        });
        extra.insert("d".into(), x);
    }
    if has("f") {
        let from = now_ms();
        let x = scenario_f(&mut f, &mut rng, &used).await;
        phases.push(Phase {
            name: "f",
            from,
            to: now_ms(),
        });
        extra.insert("f".into(), x);
    }
    // The whole run: the budget never exceeded, nobody remediated twice or without a fault.
    let ids: BTreeSet<String> = used
        .iter()
        .map(|i| f.s.nodes[*i].instance_id.clone())
        .collect();
    check_budget(&f.record(), budget, &ids);
    final_state(&f).await;
    let out = report(&f, &phases, serde_json::Value::Object(extra));
    if let Ok(path) = std::env::var("GM_FLEET_REPORT") {
        std::fs::write(path, serde_json::to_string_pretty(&out).unwrap()).unwrap();
    }
}

/// Memory and CPU per daemon: peak RSS and CPU seconds so far, averaged and at most.
fn footprint(f: &Fleet) -> serde_json::Value {
    use gpu_medic_testkit::proc;
    let mut rss = vec![];
    let mut cpu = vec![];
    for d in &f.nodes {
        let Some(pid) = d.pid() else { continue };
        if let Some(kb) = proc::status_field(pid, "VmHWM") {
            rss.push(kb as f64 / 1024.0);
        }
        if let (Some(t), Some(start)) = (proc::cpu_ticks(pid), proc::start_secs(pid)) {
            let up = (proc::uptime_secs() - start).max(1.0);
            cpu.push(t.own as f64 / proc::clk_tck() / up * 3600.0);
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    eprintln!(
        "per daemon: peak RSS mean {:.1} MiB (max {:.1}); CPU {:.1} s per hour (max {:.1})",
        mean(&rss),
        max(&rss),
        mean(&cpu),
        max(&cpu)
    );
    serde_json::json!({"rss_mib_mean": mean(&rss), "rss_mib_max": max(&rss),
        "cpu_s_per_hour_mean": mean(&cpu), "cpu_s_per_hour_max": max(&cpu)})
}

/// Nothing left DRAINING or Unhealthy without an open incident on its node that says why.
async fn final_state(f: &Fleet) {
    let draining = aws::draining(&f.moto, &f.s).await;
    let health = aws::asg_health(&f.moto, &f.s.asg).await;
    let unhealthy: Vec<String> = health
        .iter()
        .filter(|(_, h)| h == "Unhealthy")
        .map(|(i, _)| i.clone())
        .collect();
    for id in draining.iter().chain(&unhealthy) {
        let Some(i) = f.index(id) else { continue };
        let open = incidents(f, i)
            .into_iter()
            .filter(|inc| inc["closed_at"].is_null())
            .count();
        assert!(open > 0, "{id} is out of service with no open incident");
    }
}
