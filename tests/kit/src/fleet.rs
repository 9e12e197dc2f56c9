//! A fleet on one machine (issue 51, docs/fleet-scale.md): N real `gpu-medic run` daemons,
//! each with its own fake libnvidia-ml, kernel log, state directory, boot id, fake IMDS and
//! identity (its own access key, so the proxy's record says whose each call was), against one
//! moto behind the recording proxy ([`crate::proxy`], with its AWS-shaped weather); one Auto
//! Scaling group, one ECS cluster, one DynamoDB slot table. Auto Scaling and the ECS agent of
//! a successor are played here ([`PlayedAsg`]): an instance marked Unhealthy is terminated
//! (moto launches its successor, desired capacity kept) and the successor is registered with
//! ECS. Successors run no gpu-medic of their own.
//!
//! The invariants and the costs are read from the proxy's record ([`Record`]) and from AWS's
//! final state, never from gpu-medic's own log: who drained when (a successful
//! `UpdateContainerInstancesState` DRAINING), who was marked Unhealthy, when each remediation
//! ended (a restore to ACTIVE, or the successor registered), and the calls per node-hour by
//! API, read and write units, log bytes and events.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_config::SdkConfig;
use serde_json::Value;

use crate::aws::{self, Seeded};
use crate::imds::{FakeAgent, FakeImds};
use crate::proxy::{Call, Proxy};
use crate::throttle::{HARNESS_KEY, Service};
use crate::{Daemon, now_ms};

/// How a fleet is configured.
#[derive(Debug, Clone)]
pub struct Opts {
    pub n: usize,
    /// `[fleet] max_parallel` and `max_unhealthy`.
    pub budget: String,
    pub breaker: String,
    /// `[fleet] retry_after`.
    pub retry_after: String,
    /// `[ecs] standalone_grace`: each node runs one standalone task, so a drain lasts this
    /// long at least (a slot is held that long).
    pub grace: String,
    /// `tick_interval` and `[nvml] poll_interval`.
    pub tick: String,
    pub nvml_poll: String,
    /// More `[fleet]` lines (fleet incidents).
    pub fleet_extra: String,
    /// Extra top-level lines, `[ecs]` lines.
    pub ecs_extra: String,
    /// The gpu-medic binary (None: this build's).
    pub binary: Option<std::path::PathBuf>,
    /// Nodes (by index) that run `binary_old` instead (mixed versions), with the policy
    /// `policy_old` shipped with it, and a config without the `[fleet]` keys of fleet
    /// incidents (`fleet_extra`, `driver_version_file`), which an older gpu-medic refuses.
    pub old: BTreeSet<usize>,
    pub binary_old: Option<std::path::PathBuf>,
    pub policy_old: Option<std::path::PathBuf>,
}

impl Opts {
    pub fn new(n: usize) -> Opts {
        Opts {
            n,
            budget: "\"20%\"".into(),
            breaker: "\"20%\"".into(),
            retry_after: "\"2s\"".into(),
            grace: "\"2s\"".into(),
            tick: "\"500ms\"".into(),
            nvml_poll: "\"2s\"".into(),
            fleet_extra: String::new(),
            ecs_extra: String::new(),
            binary: None,
            old: BTreeSet::new(),
            binary_old: None,
            policy_old: None,
        }
    }
}

/// The budget of a group of `desired` at a share `pct` (max(1, floor)).
pub fn budget_of(desired: usize, pct: f64) -> usize {
    ((desired as f64 * pct / 100.0).floor() as usize).max(1)
}

/// The fleet: the proxy, the group, the daemons (index = node), their access keys and IMDS,
/// the shared fake ECS agent, the played Auto Scaling.
pub struct Fleet {
    pub proxy: Proxy,
    /// The harness's SDK, straight to moto (its calls are not in the record).
    pub moto: SdkConfig,
    pub s: Arc<Seeded>,
    pub table: String,
    pub nodes: Vec<Daemon>,
    pub keys: Vec<String>,
    pub imds: Vec<FakeImds>,
    pub agent: FakeAgent,
    pub asg: PlayedAsg,
}

/// The access key of node `i`: the proxy's record names the caller by it.
pub fn key(i: usize) -> String {
    format!("NODE{i:04}")
}

impl Fleet {
    /// Seeds the group, the cluster and the table, and starts every daemon (all spawned, then
    /// each awaited until it saved its first state).
    pub async fn start(o: &Opts) -> Fleet {
        let proxy = Proxy::start().await;
        let moto = aws::sdk(&aws::moto().url).await;
        let table = aws::unique("fleet");
        aws::create_slot_table(&moto, &table).await;
        let s = Arc::new(aws::seed(&moto, "fleet", o.n).await);
        let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, None), 0).await;
        // One standalone task per node: a drain waits `standalone_grace`, then stops it.
        for n in &s.nodes {
            aws::start_task(&moto, &s, &n.arn, None).await;
        }
        let mut nodes = Vec::new();
        let mut imds = Vec::new();
        for i in 0..o.n {
            let m = FakeImds::start(&s.nodes[i].instance_id).await;
            m.set_target(Some("InService"));
            m.set_instance_type(Some("t2.micro"));
            m.set_doc("ami-id", Some("ami-12c6146b"));
            let mut d = node(&s, i, &proxy.url, &table, &agent.url, o);
            d.env("AWS_EC2_METADATA_SERVICE_ENDPOINT", &m.url);
            d.spawn();
            nodes.push(d);
            imds.push(m);
        }
        for d in &mut nodes {
            wait_started(d);
        }
        let asg = PlayedAsg::start(&moto, &s);
        Fleet {
            proxy,
            moto,
            s,
            table,
            nodes,
            keys: (0..o.n).map(key).collect(),
            imds,
            agent,
            asg,
        }
    }

    /// The index of the node with this instance id.
    pub fn index(&self, instance_id: &str) -> Option<usize> {
        self.s
            .nodes
            .iter()
            .position(|n| n.instance_id == instance_id)
    }

    /// Kills node `i`'s gpu-medic (SIGKILL) and starts it again over the same state.
    pub fn restart(&mut self, i: usize) {
        self.nodes[i].signal(libc::SIGKILL);
        self.nodes[i].spawn();
        wait_started(&self.nodes[i]);
    }

    /// The record so far.
    pub fn record(&self) -> Record {
        Record::new(self.proxy.calls(), &self.s, self.asg.events())
    }
}

/// Waits until `d` polled NVML once in this run (its state is loaded, its probes run).
fn wait_started(d: &Daemon) {
    crate::wait_sync(
        "a fleet daemon to start",
        Duration::from_secs(180),
        || d.run_log().contains("first NVML poll done"),
        || d.log(),
    );
}

/// `gpu-medic run` for node `i` of the fleet (not started).
pub fn node(s: &Seeded, i: usize, proxy: &str, table: &str, agent: &str, o: &Opts) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let boot_id = dir.path().join("boot_id");
    let driver = dir.path().join("driver-version");
    std::fs::write(
        &driver,
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.172.08  Tue Jul  8 18:21:20 UTC 2025\n",
    )
    .unwrap();
    std::fs::write(
        &boot_id,
        format!("{:08x}-0000-4000-8000-{:012x}\n", i, now_ms() as u64),
    )
    .unwrap();
    let old = o.old.contains(&i);
    let policy = match &o.policy_old {
        Some(p) if old => p.clone(),
        _ => crate::default_policy(),
    };
    let fleet_lines = if old {
        String::new()
    } else {
        format!(
            "driver_version_file = \"{}\"\n{}",
            driver.display(),
            o.fleet_extra
        )
    };
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{policy}\"\ntick_interval = {tick}\n\
         [nvml]\nlibrary = \"{lib}\"\npoll_interval = {poll}\nkmsg = \"{kmsg}\"\n\
         [mps]\nenabled = false\n\
         {sections}\
         [ecs]\nagent_url = \"{agent}\"\nagent_wait = \"0s\"\ndrain_poll_interval = \"1s\"\n\
         standalone_grace = {grace}\nforce_stop_lead = \"5s\"\n{ecs}\n\
         [fleet]\nwarmup = \"0s\"\ntable = \"{table}\"\nmax_parallel = {budget}\n\
         max_unhealthy = {breaker}\nretry_after = {retry}\nreservation_lifetime = \"5s\"\n\
         {fleet_lines}\n\
         [repair]\nreboot = \"off\"\nboot_id_path = \"{boot}\"\n\
         [export]\nenabled = true\ninterval = \"2s\"\n",
        policy = policy.display(),
        tick = o.tick,
        poll = o.nvml_poll,
        lib = crate::fake_nvml().display(),
        kmsg = dir.path().join("kmsg").display(),
        sections = aws::sections(s, i, ""),
        ecs = o.ecs_extra,
        grace = o.grace,
        budget = o.budget,
        breaker = o.breaker,
        retry = o.retry_after,
        boot = boot_id.display(),
    );
    let mut d = Daemon::in_temp(dir, &config);
    d.aws(Some(proxy)).env("AWS_ACCESS_KEY_ID", key(i));
    if let Some(b) = if old { &o.binary_old } else { &o.binary } {
        d.binary(b.clone());
    }
    d
}

/// `gpu-medic check --lifecycle` of a new instance `instance_id` of the fleet's group (not
/// run): its own fake GPUs, kernel log and IMDS (`imds`, the caller's), the access key `key`,
/// the group's slot table (its fleet document), the launch-failure breaker at `abandon_limit`.
pub fn launching(
    s: &Seeded,
    instance_id: &str,
    key: &str,
    proxy: &str,
    table: &str,
    imds: &str,
    abandon_limit: u32,
) -> Daemon {
    let dir = tempfile::tempdir().unwrap();
    let driver = dir.path().join("driver-version");
    std::fs::write(
        &driver,
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.172.08  Tue Jul  8 18:21:20 UTC 2025\n",
    )
    .unwrap();
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{policy}\"\n\
         [nvml]\nlibrary = \"{lib}\"\nexpected_gpus = 4\nkmsg = \"{kmsg}\"\n\
         [mps]\nenabled = false\n\
         [identity]\ninstance_id = \"{instance_id}\"\ncluster = \"{cluster}\"\nauto_scaling_group = \"{group}\"\n\
         [ecs]\nagent_url = \"http://127.0.0.1:9\"\nagent_wait = \"100ms\"\n\
         [lifecycle]\ncheck_deadline = \"2s\"\ncheck_retry_delay = \"300ms\"\n\
         abandon_limit = {abandon_limit}\nabandon_window = \"1h\"\n\
         [fleet]\ntable = \"{table}\"\npattern_window = \"1h\"\ndriver_version_file = \"{driver}\"\n\
         [export]\nenabled = true\n",
        policy = crate::default_policy().display(),
        lib = crate::fake_nvml().display(),
        kmsg = dir.path().join("kmsg").display(),
        cluster = s.cluster,
        group = s.asg,
        driver = driver.display(),
    );
    let mut d = Daemon::in_temp(dir, &config);
    d.aws(Some(proxy))
        .env("AWS_ACCESS_KEY_ID", key)
        .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds)
        .gpus(crate::FOUR_GPUS);
    d
}

// ---------------------------------------------------------------------------------------------
// Auto Scaling and the ECS agent of successors, played

/// What the played Auto Scaling did.
#[derive(Debug, Clone, PartialEq)]
pub enum AsgEvent {
    /// It terminated this Unhealthy instance (its successor launched at once, in moto).
    Replaced(String),
    /// It registered this successor with ECS (as its agent would).
    Registered(String),
}

/// Auto Scaling played every 300 ms, straight to moto: an Unhealthy member is terminated
/// (desired capacity kept: moto launches its successor), and a member not registered with
/// ECS is registered. Its events, stamped, for [`Record`].
pub struct PlayedAsg {
    events: Arc<Mutex<Vec<(f64, AsgEvent)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl PlayedAsg {
    pub fn start(moto: &SdkConfig, s: &Arc<Seeded>) -> PlayedAsg {
        let events: Arc<Mutex<Vec<(f64, AsgEvent)>>> = Arc::default();
        let (sdk, s2, ev) = (moto.clone(), s.clone(), events.clone());
        let task = tokio::spawn(async move {
            loop {
                play_once(&sdk, &s2, &ev).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        });
        PlayedAsg { events, task }
    }

    pub fn events(&self) -> Vec<(f64, AsgEvent)> {
        self.events.lock().unwrap().clone()
    }

    /// Instances it replaced.
    pub fn replaced(&self) -> BTreeSet<String> {
        self.events()
            .into_iter()
            .filter_map(|(_, e)| match e {
                AsgEvent::Replaced(i) => Some(i),
                AsgEvent::Registered(_) => None,
            })
            .collect()
    }
}

impl Drop for PlayedAsg {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn play_once(sdk: &SdkConfig, s: &Seeded, ev: &Mutex<Vec<(f64, AsgEvent)>>) {
    let asg = aws_sdk_autoscaling::Client::new(sdk);
    let Ok(g) = asg
        .describe_auto_scaling_groups()
        .auto_scaling_group_names(&s.asg)
        .send()
        .await
    else {
        return;
    };
    let Some(group) = g.auto_scaling_groups().first() else {
        return;
    };
    for i in group.instances() {
        if i.health_status() == Some("Unhealthy")
            && let Some(id) = i.instance_id()
            && asg
                .terminate_instance_in_auto_scaling_group()
                .instance_id(id)
                .should_decrement_desired_capacity(false)
                .send()
                .await
                .is_ok()
        {
            ev.lock()
                .unwrap()
                .push((now_ms(), AsgEvent::Replaced(id.to_string())));
        }
    }
    let ecs = aws_sdk_ecs::Client::new(sdk);
    let Ok(list) = ecs
        .list_container_instances()
        .cluster(&s.cluster)
        .send()
        .await
    else {
        return;
    };
    let arns = list.container_instance_arns().to_vec();
    let registered: BTreeSet<String> = if arns.is_empty() {
        BTreeSet::new()
    } else {
        match ecs
            .describe_container_instances()
            .cluster(&s.cluster)
            .set_container_instances(Some(arns))
            .send()
            .await
        {
            Ok(d) => d
                .container_instances()
                .iter()
                .filter_map(|c| c.ec2_instance_id().map(str::to_string))
                .collect(),
            Err(_) => return,
        }
    };
    for id in aws::asg_instance_ids(sdk, &s.asg).await {
        if !registered.contains(&id) {
            aws::register(sdk, &s.cluster, &id).await;
            ev.lock()
                .unwrap()
                .push((now_ms(), AsgEvent::Registered(id)));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The record

/// One remediation of one instance, as the record shows it: from its first successful
/// DRAINING or Unhealthy call to its restore to ACTIVE or its successor's registration.
#[derive(Debug, Clone)]
pub struct Episode {
    pub instance: String,
    pub start_ms: f64,
    /// None: still going at the record's end.
    pub end_ms: Option<f64>,
    /// Successful DRAINING calls and Unhealthy marks in it.
    pub drains: usize,
    pub unhealthy: usize,
    pub replaced: bool,
}

/// The proxy's record of a fleet, with the played Auto Scaling's events.
pub struct Record {
    pub calls: Vec<Call>,
    /// Container instance ARN → instance id (the original members).
    arns: BTreeMap<String, String>,
    events: Vec<(f64, AsgEvent)>,
}

impl Record {
    pub fn new(calls: Vec<Call>, s: &Seeded, events: Vec<(f64, AsgEvent)>) -> Record {
        Record {
            calls,
            arns: s
                .nodes
                .iter()
                .map(|n| (n.arn.clone(), n.instance_id.clone()))
                .collect(),
            events,
        }
    }

    /// gpu-medic's calls only (not the harness's), in the window `[from, to)` ms.
    pub fn between(&self, from: f64, to: f64) -> impl Iterator<Item = &Call> {
        self.calls
            .iter()
            .filter(move |c| c.node != HARNESS_KEY && c.arrived_ms >= from && c.arrived_ms < to)
    }

    /// (instance, time) of each successful call that set an instance DRAINING (`status`
    /// "DRAINING") or ACTIVE.
    fn state_calls(&self, status: &str) -> Vec<(String, f64)> {
        self.calls
            .iter()
            .filter(|c| c.op == "UpdateContainerInstancesState" && c.status == 200)
            .filter_map(|c| {
                let v: Value = serde_json::from_str(&c.body).ok()?;
                (v["status"] == status).then_some(())?;
                let arns = v["containerInstances"].as_array()?.clone();
                Some(
                    arns.into_iter()
                        .filter_map(|a| self.arns.get(a.as_str()?).cloned())
                        .map(|i| (i, c.arrived_ms))
                        .collect::<Vec<_>>(),
                )
            })
            .flatten()
            .collect()
    }

    /// (instance, time) of each successful SetInstanceHealth Unhealthy.
    fn unhealthy_calls(&self) -> Vec<(String, f64)> {
        self.calls
            .iter()
            .filter(|c| c.op == "SetInstanceHealth" && c.status == 200)
            .filter(|c| c.body.contains("HealthStatus=Unhealthy"))
            .filter_map(|c| {
                Some((
                    crate::proxy::form_field(&c.body, "InstanceId")?.to_string(),
                    c.arrived_ms,
                ))
            })
            .collect()
    }

    /// Every remediation episode, by instance, in time order.
    pub fn episodes(&self) -> Vec<Episode> {
        let mut marks: Vec<(f64, String, &str)> = Vec::new();
        for (i, t) in self.state_calls("DRAINING") {
            marks.push((t, i, "drain"));
        }
        for (i, t) in self.unhealthy_calls() {
            marks.push((t, i, "unhealthy"));
        }
        for (i, t) in self.state_calls("ACTIVE") {
            marks.push((t, i, "active"));
        }
        let mut replaced_at: BTreeMap<String, f64> = BTreeMap::new();
        let mut registered: Vec<f64> = Vec::new();
        for (t, e) in &self.events {
            match e {
                AsgEvent::Replaced(i) => {
                    replaced_at.insert(i.clone(), *t);
                }
                AsgEvent::Registered(_) => registered.push(*t),
            }
        }
        marks.sort_by(|a, b| a.0.total_cmp(&b.0));
        let mut open: BTreeMap<String, Episode> = BTreeMap::new();
        let mut done = Vec::new();
        for (t, i, what) in marks {
            match what {
                "active" => {
                    if let Some(mut e) = open.remove(&i) {
                        e.end_ms = Some(t);
                        done.push(e);
                    }
                }
                _ => {
                    let e = open.entry(i.clone()).or_insert(Episode {
                        instance: i,
                        start_ms: t,
                        end_ms: None,
                        drains: 0,
                        unhealthy: 0,
                        replaced: false,
                    });
                    if what == "drain" {
                        e.drains += 1;
                    } else {
                        e.unhealthy += 1;
                    }
                }
            }
        }
        for (_, mut e) in open {
            if let Some(t) = replaced_at.get(&e.instance) {
                e.replaced = true;
                // Over once a successor registered after the termination.
                e.end_ms = registered.iter().copied().find(|r| r >= t);
            }
            done.push(e);
        }
        done.sort_by(|a, b| a.start_ms.total_cmp(&b.start_ms));
        done
    }

    /// The most remediations going on at once, and the instances then.
    pub fn most_at_once(&self) -> (usize, Vec<String>) {
        let eps = self.episodes();
        let mut worst = (0, Vec::new());
        for e in &eps {
            let t = e.start_ms;
            let now: Vec<String> = eps
                .iter()
                .filter(|o| o.start_ms <= t && o.end_ms.is_none_or(|end| end > t))
                .map(|o| o.instance.clone())
                .collect();
            if now.len() > worst.0 {
                worst = (now.len(), now);
            }
        }
        worst
    }

    /// Calls per (service, operation) by gpu-medic in `[from, to)`: (calls, throttled).
    pub fn by_api(&self, from: f64, to: f64) -> BTreeMap<(Service, String), (usize, usize)> {
        let mut out: BTreeMap<(Service, String), (usize, usize)> = BTreeMap::new();
        for c in self.between(from, to) {
            let e = out.entry((c.service, c.op.clone())).or_default();
            e.0 += 1;
            e.1 += usize::from(c.throttled);
        }
        out
    }

    /// The most calls one node made within any `window_s` seconds of `[from, to)`, and whose.
    pub fn busiest(&self, from: f64, to: f64, window_s: f64) -> (usize, String) {
        let mut per: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
        for c in self.between(from, to) {
            per.entry(c.node.as_str()).or_default().push(c.arrived_ms);
        }
        let mut worst = (0, String::new());
        for (node, mut ts) in per {
            ts.sort_by(f64::total_cmp);
            let mut lo = 0;
            for hi in 0..ts.len() {
                while ts[hi] - ts[lo] > window_s * 1000.0 {
                    lo += 1;
                }
                if hi - lo + 1 > worst.0 {
                    worst = (hi - lo + 1, node.to_string());
                }
            }
        }
        worst
    }

    /// What the calls of `[from, to)` cost: read and write units, log bytes, events.
    pub fn units(&self, from: f64, to: f64) -> Units {
        let mut u = Units::default();
        for c in self.between(from, to) {
            match (c.service, c.op.as_str()) {
                (Service::DynamoDb, "GetItem") => {
                    // A strongly consistent read: one unit per 4 KB of item (the answer).
                    u.read_units += (c.response_bytes.max(1) as f64 / 4096.0).ceil();
                }
                (Service::DynamoDb, "PutItem") => {
                    // One unit per 1 KB of item (the request carries the whole item).
                    u.write_units += (c.request_bytes.max(1) as f64 / 1024.0).ceil();
                }
                (Service::Logs, "PutLogEvents") => {
                    u.log_bytes += c.request_bytes;
                    u.log_puts += 1;
                }
                (Service::Events, "PutEvents") => {
                    let n = serde_json::from_str::<Value>(&c.body)
                        .ok()
                        .and_then(|v| v["Entries"].as_array().map(Vec::len))
                        .unwrap_or(0);
                    u.events += n;
                }
                _ => {}
            }
        }
        u
    }

    /// Conditional-write conflicts (ConditionalCheckFailedException) in `[from, to)`, and
    /// the writes.
    pub fn conflicts(&self, from: f64, to: f64) -> (usize, usize) {
        let puts: Vec<&Call> = self
            .between(from, to)
            .filter(|c| c.op == "PutItem")
            .collect();
        let lost = puts
            .iter()
            .filter(|c| c.status == 400 && !c.throttled)
            .count();
        (lost, puts.len())
    }
}

/// DynamoDB units, CloudWatch Logs bytes and calls, EventBridge events of a window.
#[derive(Debug, Clone, Default)]
pub struct Units {
    pub read_units: f64,
    pub write_units: f64,
    pub log_bytes: usize,
    pub log_puts: usize,
    pub events: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(op: &str, body: &str, at: f64, status: u16) -> Call {
        Call {
            op: op.into(),
            body: body.into(),
            arrived_ms: at,
            answered_ms: at,
            status,
            injected: false,
            head: String::new(),
            service: Service::Ecs,
            node: "NODE0000".into(),
            throttled: false,
            request_bytes: body.len(),
            response_bytes: 0,
        }
    }

    fn seeded() -> Seeded {
        Seeded {
            cluster: "c".into(),
            asg: "g".into(),
            family: "f".into(),
            nodes: (0..3)
                .map(|i| aws::Node {
                    instance_id: format!("i-{i}"),
                    arn: format!("arn:{i}"),
                })
                .collect(),
        }
    }

    fn drain(i: usize, at: f64) -> Call {
        call(
            "UpdateContainerInstancesState",
            &format!(r#"{{"cluster":"c","containerInstances":["arn:{i}"],"status":"DRAINING"}}"#),
            at,
            200,
        )
    }

    /// Episodes end at a restore or at the successor's registration; overlaps are counted.
    #[test]
    fn episodes_and_the_most_at_once_are_read_from_the_record() {
        let mut active = drain(0, 30.0);
        active.body = active.body.replace("DRAINING", "ACTIVE");
        let mut unhealthy = call(
            "SetInstanceHealth",
            "Action=SetInstanceHealth&InstanceId=i-1&HealthStatus=Unhealthy",
            25.0,
            200,
        );
        unhealthy.service = Service::AutoScaling;
        let calls = vec![
            drain(0, 10.0),
            drain(1, 20.0),
            unhealthy,
            active,
            drain(2, 40.0),
        ];
        let events = vec![
            (26.0, AsgEvent::Replaced("i-1".into())),
            (35.0, AsgEvent::Registered("i-9".into())),
        ];
        let r = Record::new(calls, &seeded(), events);
        let eps = r.episodes();
        assert_eq!(eps.len(), 3);
        assert_eq!(
            (eps[0].instance.as_str(), eps[0].end_ms),
            ("i-0", Some(30.0))
        );
        assert_eq!(
            (eps[1].instance.as_str(), eps[1].end_ms),
            ("i-1", Some(35.0))
        );
        assert!(eps[1].replaced && eps[1].drains == 1 && eps[1].unhealthy == 1);
        assert_eq!(eps[2].end_ms, None);
        // i-0 and i-1 overlap (20..30); i-2 starts after both ended.
        assert_eq!(r.most_at_once().0, 2);
        assert_eq!(
            r.busiest(0.0, 100.0, 15.0).0,
            5,
            "one node, five calls within 30 ms"
        );
    }
}
