//! The shipped dashboards name only what gpu-medic emits: no panel, alarm or query that
//! silently shows nothing. One real `gpu-medic run` with its subsystems on (the fake
//! libnvidia-ml, the kernel log, ECS and Auto Scaling in moto behind the kit's proxy, the
//! ECS agent (the kit's `FakeAgent`: the one double, it exists only on an instance) naming
//! MPS clients that are real processes in ECS-shaped cgroups, a task definition with an MPS
//! memory reservation, the incident export to CloudWatch Logs and EventBridge in moto, the
//! metrics endpoint and EMF on stdout) rehearses a fatal XID with
//! `gpu-medic drill` while one control-plane call is refused. Then:
//! - every metric and label in `packaging/dashboards/grafana.json` (its exprs, legends and
//!   variable queries) is in the scrape (`instance` and `job` are the labels Prometheus adds
//!   to every target);
//! - every `GpuMedic` metric of `packaging/examples/cloudformation.yaml` (alarms, the
//!   dashboard's SEARCH expressions) is in the EMF lines, with a dimension set they carry;
//! - every field its metric filters, Logs Insights queries and EventBridge input
//!   transformers read is in the records this run journaled (as shipped: plus `record_id`,
//!   `instance_id`, `cluster`), and every `GpuMedic/Incidents` metric the dashboard shows is
//!   one a metric filter makes.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use gpu_medic_testkit::aws::{self, Fault, Proxy};
use gpu_medic_testkit::http::scrape;
use gpu_medic_testkit::imds::FakeAgent;
use gpu_medic_testkit::proc::EcsTaskProcs;
use gpu_medic_testkit::{Daemon, FOUR_GPUS, default_policy, fake_nvml, repo, wait_sync};
use serde_json::Value;

/// Labels Prometheus adds to every scraped series.
const TARGET_LABELS: [&str; 2] = ["instance", "job"];

/// Series name -> the label names it has, from an OpenMetrics exposition.
fn scraped(body: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in body.lines() {
        if line.starts_with('#') || !line.starts_with("gpu_medic_") {
            continue;
        }
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        let labels = out.entry(line[..name_end].to_string()).or_default();
        if let Some(rest) = line[name_end..].strip_prefix('{') {
            let inner = &rest[..rest.find('}').unwrap_or(rest.len())];
            for pair in split_pairs(inner) {
                if let Some((k, _)) = pair.split_once('=') {
                    labels.insert(k.trim().to_string());
                }
            }
        }
    }
    out
}

/// `a="x",b="y,z"` -> its pairs (commas inside quotes kept).
fn split_pairs(s: &str) -> Vec<String> {
    let (mut out, mut cur, mut quoted) = (Vec::new(), String::new(), false);
    for c in s.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                cur.push(c);
            }
            ',' if !quoted => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    if !cur.trim().is_empty() {
        out.push(cur);
    }
    out
}

fn idents(s: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(at) = rest.find(prefix) {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// The label names a PromQL expression (or legend) uses: selector matchers, `by`/`without`
/// groupings, `on`/`ignoring` vector matchings, `{{legend}}` names and `label_values(m, label)`.
fn promql_labels(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == '{' && bytes.get(i + 1) == Some(&'{') {
            let end = expr[i..].find("}}").map(|e| i + e).unwrap_or(bytes.len());
            out.insert(expr[i + 2..end].trim().to_string());
            i = end + 2;
            continue;
        }
        if bytes[i] == '{' {
            let end = expr[i..].find('}').map(|e| i + e).unwrap_or(bytes.len());
            for pair in split_pairs(&expr[i + 1..end]) {
                let name: String = pair
                    .trim()
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() {
                    out.insert(name);
                }
            }
            i = end + 1;
            continue;
        }
        i += 1;
    }
    for kw in [
        "by (",
        "without (",
        "by(",
        "without(",
        " on (",
        " on(",
        "ignoring (",
        "ignoring(",
    ] {
        let mut rest = expr;
        while let Some(at) = rest.find(kw) {
            let tail = &rest[at + kw.len()..];
            let end = tail.find(')').unwrap_or(tail.len());
            for l in tail[..end].split(',') {
                out.insert(l.trim().to_string());
            }
            rest = &tail[end..];
        }
    }
    if let Some(at) = expr.find("label_values(") {
        let tail = &expr[at + "label_values(".len()..];
        if let Some((_, l)) = tail[..tail.find(')').unwrap_or(tail.len())].split_once(',') {
            out.insert(l.trim().to_string());
        }
    }
    out.remove("");
    out
}

/// Every string under `v` found at one of `keys`.
fn strings_at(v: &Value, keys: &[&str], out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                if keys.contains(&k.as_str())
                    && let Some(s) = x.as_str()
                {
                    out.push(s.to_string());
                }
                strings_at(x, keys, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| strings_at(x, keys, out)),
        _ => {}
    }
}

/// Dotted paths of every field of `v` (`observation.signal.kind`, ...).
fn paths(v: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    if let Value::Object(m) = v {
        for (k, x) in m {
            let p = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            out.insert(p.clone());
            paths(x, &p, out);
        }
    }
}

/// Every object under `v` (depth first).
fn objects<'a>(v: &'a Value, out: &mut Vec<&'a serde_json::Map<String, Value>>) {
    match v {
        Value::Object(m) => {
            out.push(m);
            m.values().for_each(|x| objects(x, out));
        }
        Value::Array(a) => a.iter().for_each(|x| objects(x, out)),
        _ => {}
    }
}

fn check_grafana(scrape: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let text = std::fs::read_to_string(repo().join("packaging/dashboards/grafana.json")).unwrap();
    let dash: Value = serde_json::from_str(&text).unwrap();
    let mut exprs = Vec::new();
    strings_at(&dash, &["expr", "legendFormat", "definition"], &mut exprs);
    assert!(
        exprs.len() > 10,
        "the dashboard's expressions were not found"
    );
    let mut missing = Vec::new();
    // A legend belongs to the expr before it: check both against that expr's metrics.
    let mut metrics: Vec<String> = Vec::new();
    for e in &exprs {
        let named = idents(e, "gpu_medic_");
        if !named.is_empty() {
            metrics = named;
        }
        for m in &metrics {
            if !scrape.contains_key(m) {
                missing.push(format!(
                    "grafana: metric {m} (in `{e}`) is not in the scrape"
                ));
            }
        }
        for l in promql_labels(e) {
            let known = TARGET_LABELS.contains(&l.as_str())
                || metrics
                    .iter()
                    .any(|m| scrape.get(m).is_some_and(|ls| ls.contains(&l)));
            if !known {
                missing.push(format!(
                    "grafana: label {l} (in `{e}`) is on none of {metrics:?} in the scrape"
                ));
            }
        }
    }
    missing
}

/// EMF: metric names and the dimension sets they are emitted with.
fn emf(stdout: &str) -> (BTreeSet<String>, Vec<BTreeSet<String>>) {
    let (mut names, mut sets) = (BTreeSet::new(), Vec::new());
    for line in stdout.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        for d in v["_aws"]["CloudWatchMetrics"]
            .as_array()
            .into_iter()
            .flatten()
        {
            assert_eq!(d["Namespace"], "GpuMedic", "{line}");
            for m in d["Metrics"].as_array().into_iter().flatten() {
                names.insert(m["Name"].as_str().unwrap().to_string());
            }
            for set in d["Dimensions"].as_array().into_iter().flatten() {
                let s: BTreeSet<String> = set
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_str().unwrap().to_string())
                    .collect();
                if !sets.contains(&s) {
                    sets.push(s);
                }
            }
        }
    }
    (names, sets)
}

fn check_cloudformation(stdout: &str, records: &[Value]) -> Vec<String> {
    let out = std::process::Command::new("python3")
        .arg(repo().join("scripts/packaging-lint.py"))
        .arg("--cfn-json")
        .output()
        .expect("python3 (with PyYAML, as scripts/packaging-lint.py needs)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cfn: Value = serde_json::from_slice(&out.stdout).unwrap();
    let (names, sets) = emf(stdout);
    assert!(!names.is_empty(), "no EMF line on stdout");
    let mut missing = Vec::new();
    let mut fields: BTreeSet<String> = ["record_id", "instance_id", "cluster"]
        .map(String::from)
        .into();
    for r in records {
        paths(r, "", &mut fields);
    }

    // Alarms' metrics in the GpuMedic namespace.
    let mut objs = Vec::new();
    objects(&cfn, &mut objs);
    let mut filter_metrics = BTreeSet::new();
    let mut checked = 0;
    for o in &objs {
        if o.get("Namespace").and_then(Value::as_str) == Some("GpuMedic") {
            let m = o["MetricName"].as_str().unwrap_or_default();
            let dims: BTreeSet<String> = o
                .get("Dimensions")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .map(|d| d["Name"].as_str().unwrap_or_default().to_string())
                .collect();
            checked += 1;
            if !names.contains(m) {
                missing.push(format!("cloudformation: EMF metric {m} is not emitted"));
            }
            if !sets.contains(&dims) {
                missing.push(format!(
                    "cloudformation: {m} with dimensions {dims:?}: no EMF line carries that set ({sets:?})"
                ));
            }
        }
        if let Some(t) = o.get("MetricTransformations").and_then(Value::as_array) {
            for x in t {
                filter_metrics.insert(x["MetricName"].as_str().unwrap_or_default().to_string());
            }
        }
        // Metric filter patterns: `$.a.b` paths.
        if let Some(p) = o.get("FilterPattern").and_then(Value::as_str) {
            for f in idents_dotted(p, "$.") {
                if !fields.contains(&f) {
                    missing.push(format!(
                        "cloudformation: metric filter field {f} (in `{p}`) is in no record"
                    ));
                }
            }
        }
        // EventBridge input transformers: `$.detail.a.b`.
        if let Some(m) = o.get("InputPathsMap").and_then(Value::as_object) {
            for p in m.values().filter_map(Value::as_str) {
                let f = p.trim_start_matches("$.detail.");
                if !fields.contains(f) {
                    missing.push(format!(
                        "cloudformation: input transformer path {p} is in no record"
                    ));
                }
            }
        }
    }
    assert!(checked >= 2, "no GpuMedic alarm metric found");

    // The dashboard: SEARCH expressions over EMF, GpuMedic/Incidents metrics, log queries.
    let dash = &cfn["Resources"]["FleetDashboard"]["Properties"]["DashboardBody"]["Fn::Sub"][0];
    let body = dash
        .as_str()
        .expect("DashboardBody is a Fn::Sub [template, vars]");
    let mut plain = String::new();
    let mut rest = body;
    while let Some(at) = rest.find("${") {
        plain.push_str(&rest[..at]);
        plain.push('x');
        rest = &rest[at + rest[at..].find('}').unwrap_or(0) + 1..];
    }
    plain.push_str(rest);
    let dash: Value = serde_json::from_str(&plain).unwrap_or_else(|e| panic!("{e}: {plain}"));
    let mut exprs = Vec::new();
    strings_at(&dash, &["expression"], &mut exprs);
    for e in &exprs {
        let inner = &e[e.find("'{").unwrap() + 2..e.find("}").unwrap()];
        let mut parts = inner.split(',');
        assert_eq!(parts.next(), Some("GpuMedic"), "{e}");
        let dims: BTreeSet<String> = parts.map(String::from).collect();
        let m = &e[e.find("MetricName=\"").unwrap() + 12..];
        let m = &m[..m.find('"').unwrap()];
        if !names.contains(m) || !sets.contains(&dims) {
            missing.push(format!(
                "cloudformation dashboard: `{e}` matches no EMF metric ({names:?}, {sets:?})"
            ));
        }
    }
    for w in dash["widgets"].as_array().unwrap() {
        for m in w["properties"]["metrics"].as_array().into_iter().flatten() {
            if m[0] == "GpuMedic/Incidents" && !filter_metrics.contains(m[1].as_str().unwrap()) {
                missing.push(format!(
                    "cloudformation dashboard: {m} is made by no metric filter"
                ));
            }
        }
        if let Some(q) = w["properties"]["query"].as_str() {
            for f in insights_fields(q) {
                if !fields.contains(&f) {
                    missing.push(format!(
                        "cloudformation dashboard: query field {f} is in no record (`{q}`)"
                    ));
                }
            }
        }
    }
    missing
}

/// `$.a.b` -> `a.b` for every occurrence of `prefix`.
fn idents_dotted(s: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(at) = rest.find(prefix) {
        let tail = &rest[at + prefix.len()..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '.'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

/// The record fields a Logs Insights query reads: the names it filters, groups and lists
/// by, less its own aliases (`as x`), `@` fields and functions.
fn insights_fields(q: &str) -> BTreeSet<String> {
    let mut words = BTreeSet::new();
    let mut aliases = BTreeSet::new();
    for stage in q.split('|').skip(1) {
        let mut prev = "";
        let mut quoted = false;
        let mut token = String::new();
        let mut tokens = Vec::new();
        for c in stage.chars() {
            if c == '\'' || c == '"' {
                quoted = !quoted;
                continue;
            }
            if quoted {
                continue;
            }
            if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == '@' || c == '(' {
                token.push(c);
                if c == '(' {
                    tokens.push(std::mem::take(&mut token));
                }
            } else if !token.is_empty() {
                tokens.push(std::mem::take(&mut token));
            }
        }
        if !token.is_empty() {
            tokens.push(token);
        }
        for t in &tokens {
            if prev == "as" {
                aliases.insert(t.clone());
            } else if !t.ends_with('(')
                && !t.starts_with('@')
                && !t.chars().next().is_some_and(|c| c.is_ascii_digit())
                && ![
                    "fields", "filter", "stats", "by", "as", "sort", "desc", "asc", "and", "or",
                    "not", "in", "limit",
                ]
                .contains(&t.as_str())
            {
                words.insert(t.clone());
            }
            prev = t;
        }
    }
    words.difference(&aliases).cloned().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboards_name_only_metrics_labels_and_fields_a_live_gpu_medic_emits() {
    let task = format!("{:08x}dddddddddddddddddddddddd", std::process::id());
    let docker = format!("{:08x}{:08x}{}", std::process::id(), 7, "cd".repeat(24));
    // Two processes of one container: the first with the limits ECS sets in an MPS container
    // (the pinned memory limit and, with maxComputePercent, the thread percentage: the per-GPU
    // panels draw use against them), the second with none (an MPS client off its limits: the
    // mismatch panel's series).
    let env = [
        ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=4096M"),
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50"),
    ]
    .map(|(k, v)| (k.to_string(), v.to_string()));
    let start = |env: &[(String, String)]| {
        EcsTaskProcs::start_with_env(&task, &docker, 1, env)
            .unwrap_or_else(|why| panic!("real processes in ECS-shaped cgroups need root: {why}"))
    };
    let limited = start(&env);
    let loose = start(&[]);
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "dash", 2).await;
    let family = format!("{}-infer", s.cluster);
    aws_sdk_ecs::Client::new(&sdk)
        .register_task_definition()
        .family(&family)
        .container_definitions(aws::mps_container("app", 4096, Some(50)))
        .send()
        .await
        .unwrap();
    let arn = format!(
        "arn:aws:ecs:us-east-1:123456789012:task/{}/{task}",
        s.cluster
    );
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&s.nodes[0].arn)), 0).await;
    agent.set_tasks(&[(&arn, &family, &[(&docker, "app")])]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{policy}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nlibrary = \"{lib}\"\nkmsg = \"{kmsg}\"\npoll_interval = \"200ms\"\n\
         [mps]\nenabled = false\n\
         [metrics]\nenabled = true\nlisten = \"127.0.0.1:{port}\"\nemf = true\n\
         [drill]\nallow = true\n\
         [export]\nenabled = true\ninterval = \"300ms\"\n\
         [repair]\nreboot = \"off\"\n\
         {sections}[ecs]\nagent_url = \"{agent}\"\ndrain_poll_interval = \"200ms\"\n\
         [fleet]\nwarmup = \"0s\"\nclaim_settle = \"200ms\"\nretry_after = \"1s\"\n",
        policy = default_policy().display(),
        lib = fake_nvml().display(),
        kmsg = dir.path().join("kmsg").display(),
        sections = aws::sections(&s, 0, ""),
        agent = agent.url,
    );
    let mut d = Daemon::in_temp(dir, &config);
    d.aws(Some(&proxy.url));
    d.gpus(FOUR_GPUS);
    d.keep_stdout();
    let clients: Vec<String> = [limited.pids(), loose.pids()]
        .concat()
        .iter()
        .map(|p| format!(r#"{{"pid": {p}, "used_mib": 1500, "sm_percent": 20}}"#))
        .collect();
    d.inject(&format!(
        r#"[{{"gpu": 1, "mps_clients": [{}]}}]"#,
        clients.join(",")
    ));
    d.start();
    let addr = format!("127.0.0.1:{port}");
    wait_sync(
        "the task's use and reservation in the metrics",
        Duration::from_secs(30),
        || scrape(&addr).contains("gpu_medic_task_gpu_memory_reserved_bytes{"),
        || format!("{}\n{}", scrape(&addr), d.log()),
    );
    // The compute share against its limit, with the memory's labels.
    let body = scrape(&addr);
    let share = format!(
        "gpu_medic_task_gpu_sm_percent{{task=\"arn:aws:ecs:us-east-1:123456789012:task/{}/{task}\",family=\"{family}\",revision=\"1\",container=\"app\",gpu=\"1\",",
        s.cluster
    );
    assert!(body.contains(&share), "{share} not in\n{body}");
    assert!(
        body.lines()
            .any(|l| l.starts_with(&share) && l.ends_with(" 40")),
        "two processes at 20 % each: {body}"
    );
    let limit = share.replace("sm_percent", "sm_limit_percent");
    assert!(
        body.lines()
            .any(|l| l.starts_with(&limit) && l.ends_with(" 50")),
        "{limit} at 50 in\n{body}"
    );
    // One program's own fault (an XID 13 the driver charges to the task's process): a log
    // incident naming its task definition, the record `ApplicationFaultRule` reads.
    let pid = limited.pids()[0];
    // Stamped now: a record older than the process on its pid is not that process's.
    d.kmsg_append(&[format!(
        "4,1,{},-;NVRM: Xid (PCI:0000:20:00): 13, pid={pid}, name=sleep, \
         Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
        gpu_medic_testkit::proc::uptime_usec()
    )]);
    d.wait_record(
        "the application fault, charged to the task definition",
        Duration::from_secs(30),
        "opened",
        |r| r["observation"]["xid"]["culprit"]["definition"].is_string(),
    );
    // The quarantine is refused (an AWS call error), then the drill's XID 79 drains and
    // replaces for real (the reboot rung is off: a replacement closes the incident here).
    proxy.fault(Fault::ecs_denied("PutAttributes", 1));
    let mut cli = d.command();
    cli.args([
        "drill", "xid", "79", "--gpu", "0", "--wait", "60s", "--config",
    ])
    .arg(d.config());
    let out = tokio::task::spawn_blocking(move || cli.output().unwrap())
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        d.log()
    );
    let body = scrape(&addr);
    d.signal(libc::SIGTERM);
    let series = scraped(&body);
    for needed in [
        "gpu_medic_incidents_total",
        "gpu_medic_aws_call_errors_total",
        "gpu_medic_task_gpu_memory_bytes",
        "gpu_medic_task_gpu_memory_limit_bytes",
        "gpu_medic_task_gpu_sm_percent",
        "gpu_medic_task_gpu_sm_limit_percent",
        "gpu_medic_fleet_budget_in_use",
        "gpu_medic_export_lag_seconds",
    ] {
        assert!(series.contains_key(needed), "{needed} not scraped:\n{body}");
    }
    let mut missing = check_grafana(&series);
    missing.extend(check_cloudformation(&d.stdout(), &d.records()));
    assert!(
        missing.is_empty(),
        "{}\n\nscrape:\n{body}",
        missing.join("\n")
    );
}

#[test]
fn the_parsers_find_what_the_dashboards_name() {
    let l = promql_labels(
        r#"sum by (signal, action) (increase(gpu_medic_incidents_total{instance=~"$instance",drill="a,b"}[5m])) {{gpu}}"#,
    );
    assert_eq!(
        l,
        ["action", "drill", "gpu", "instance", "signal"]
            .map(String::from)
            .into()
    );
    let l = promql_labels(
        r#"max by (instance, task) (a{x="1"}) and on (instance, container) b ignoring(gpu) c"#,
    );
    assert_eq!(
        l,
        ["container", "gpu", "instance", "task", "x"]
            .map(String::from)
            .into()
    );
    let q = "SOURCE 'g' | filter event = 'closed' and not ispresent(drill) | stats latest(event) as last, count(*) as n by instance_id, bin(1d) | filter last != 'x'";
    assert_eq!(
        insights_fields(q),
        ["drill", "event", "instance_id"].map(String::from).into()
    );
    let s = scraped("# HELP x\ngpu_medic_a_total{x=\"1,2\",y=\"\"} 1\ngpu_medic_b 2\n");
    assert_eq!(s["gpu_medic_a_total"], ["x", "y"].map(String::from).into());
    assert!(s["gpu_medic_b"].is_empty());
}
