//! The fleet budget on the DynamoDB slot table (`[fleet] table`), with real parts: DynamoDB,
//! EC2, ECS and Auto Scaling in moto 5.2.5 (conditional writes are real there: a writer whose
//! condition fails gets ConditionalCheckFailedException), the recording proxy in front of it,
//! real `gpu-medic run` processes on the fake libnvidia-ml with wall clocks skewed by Debian's
//! libfaketime (only the wall clock: FAKETIME_DONT_FAKE_MONOTONIC=1), and real signals
//! (SIGSTOP/SIGCONT, SIGKILL). The ground truth (who is DRAINING) is sampled from moto
//! throughout, never taken from gpu-medic's own word.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_medic::aws::dynamo::HolderState;
use gpu_medic::model::Command;
use gpu_medic::remedy::aws::AwsControlPlane;
use gpu_medic::remedy::{ControlPlane, RemedyError};
use gpu_medic_testkit::aws::{self, Fault, Proxy, Sampler, Seeded, draining};
use gpu_medic_testkit::{Daemon, wait_for};

const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// A recording proxy in front of moto, an SDK through it, a new slot table and a group of `n`.
async fn setup(name: &str, n: usize) -> (Proxy, aws_config::SdkConfig, String, Seeded) {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let table = aws::unique(name);
    aws::create_slot_table(&sdk, &table).await;
    let s = aws::seed(&sdk, name, n).await;
    (proxy, sdk, table, s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_commit_drain_then_restore_releases_and_every_write_is_conditional() {
    let (proxy, sdk, table, s) = setup("slots-flow", 3).await;
    let cp = |i| AwsControlPlane::new(&sdk, &aws::config(&s, i, "", &aws::table_fleet(&table)));
    let (cp0, cp1) = (cp(0), cp(1));
    let drain = || {
        aws::order(
            Command::Drain { terminating: false },
            Duration::from_secs(30),
        )
    };
    let seeded = proxy.calls().len();

    let done = cp0.drain(&drain()).await.unwrap();
    let item = aws::slot_item(&sdk, &table, &s.asg).await;
    let mine = &item.holders[&s.nodes[0].instance_id];
    assert_eq!(mine.state, HolderState::Committed, "{item:?}");
    assert_eq!((item.version, mine.token), (2, 2), "reserve, then commit");
    let slot = format!("{}/{}", s.asg, mine.token);
    assert!(
        done.detail
            .contains(&format!("fleet slot {slot} committed in table {table}")),
        "{done:?}"
    );
    let (status, _, attrs) = aws::instance(&sdk, &s.cluster, &s.nodes[0].arn).await;
    assert_eq!(status, "DRAINING");
    assert!(
        attrs.contains(&("gpu-medic.slot".into(), Some(slot.clone()))),
        "{attrs:?}"
    );
    // The calls: consistent reads; writes all conditional, the first on a missing item.
    let calls = &proxy.calls()[seeded..];
    let gets: Vec<_> = calls.iter().filter(|c| c.op == "GetItem").collect();
    let puts: Vec<_> = calls.iter().filter(|c| c.op == "PutItem").collect();
    assert!(!gets.is_empty());
    assert!(
        gets.iter()
            .all(|c| c.body.contains(r#""ConsistentRead":true"#)),
        "{gets:?}"
    );
    assert_eq!(puts.len(), 2, "{puts:?}");
    assert!(
        puts[0].body.contains("attribute_not_exists(#g)"),
        "{:?}",
        puts[0]
    );
    assert!(puts[1].body.contains("#v = :v") && puts[1].body.contains(r#"":v":{"N":"1"}"#));
    // No claim is written with a table.
    assert_eq!(proxy.count_with("PutAttributes", ".claim."), 0);

    // The budget of one is held: the next instance defers, naming the holder.
    let Err(RemedyError::Deferred { message, .. }) = cp1.drain(&drain()).await else {
        panic!("the slot is held")
    };
    assert!(
        message.contains("fleet budget full")
            && message.contains(&format!("{} committed", s.nodes[0].instance_id)),
        "{message}"
    );
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[1].arn).await.0,
        "ACTIVE"
    );

    // Restore releases the entry and the attribute; then the other instance drains.
    let r = cp0
        .restore(&aws::order(Command::Restore, Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(
        r.detail.contains(&format!("fleet slot {slot} released")),
        "{r:?}"
    );
    assert!(
        aws::slot_item(&sdk, &table, &s.asg)
            .await
            .holders
            .is_empty()
    );
    // The attribute is deleted by name, as AWS documents DeleteAttributes (moto 5.2.5 keeps a
    // valued attribute unless the value is sent too: docs/aws.md, "Quirks").
    assert_eq!(
        proxy.count_with("DeleteAttributes", r#""name":"gpu-medic.slot""#),
        1
    );
    cp1.drain(&drain()).await.unwrap();
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[1].arn).await.0,
        "DRAINING"
    );
    let item = aws::slot_item(&sdk, &table, &s.asg).await;
    assert_eq!(
        item.holders.keys().collect::<Vec<_>>(),
        [&s.nodes[1].instance_id]
    );
}

/// A waiting instance reads the slot table only (issue 51: a fleet of waiting instances
/// must not read the group's Auto Scaling and ECS state at every attempt): while the item
/// shows the budget full of other holders, three attempts in four are one consistent GetItem
/// each and defer; the fourth reads the group in full (and would remove a terminated holder,
/// or see a grown group's budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_instance_reads_the_table_only_three_attempts_in_four() {
    let (proxy, sdk, table, s) = setup("slots-wait", 3).await;
    let cp = |i| AwsControlPlane::new(&sdk, &aws::config(&s, i, "", &aws::table_fleet(&table)));
    let (cp0, cp1) = (cp(0), cp(1));
    let drain = || {
        aws::order(
            Command::Drain { terminating: false },
            Duration::from_secs(30),
        )
    };
    cp0.drain(&drain()).await.unwrap();
    // Node 1 quarantined first (its identity checked once, as a daemon's is at its start).
    cp1.quarantine(&aws::order(Command::Quarantine, Duration::from_secs(30)))
        .await
        .unwrap();
    let mut per_attempt = Vec::new();
    for _ in 0..4 {
        let before = proxy.calls().len();
        let Err(RemedyError::Deferred { message, .. }) = cp1.drain(&drain()).await else {
            panic!("the slot is held")
        };
        assert!(
            message.contains("fleet budget full")
                && message.contains(&format!("{} committed", s.nodes[0].instance_id)),
            "{message}"
        );
        let ops: Vec<String> = proxy.calls()[before..]
            .iter()
            .map(|c| c.op.clone())
            .collect();
        per_attempt.push(ops);
    }
    for ops in &per_attempt[..3] {
        assert_eq!(ops, &["GetItem"], "{per_attempt:?}");
    }
    let full = &per_attempt[3];
    assert!(
        full.contains(&"DescribeAutoScalingGroups".to_string())
            && full.contains(&"DescribeContainerInstances".to_string()),
        "{per_attempt:?}"
    );
    // Its own entry never meets the precheck: the holder's own attempt reads in full.
    let before = proxy.calls().len();
    cp0.drain(&drain()).await.unwrap();
    assert!(
        proxy.calls()[before..]
            .iter()
            .any(|c| c.op == "DescribeContainerInstances"),
        "the holder resumes with its own status read"
    );
}

/// An instance Auto Scaling does not know (no group in its identity) has no budget in the
/// table: with a table set it never drains, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_outside_any_group_does_not_drain_with_a_table() {
    let (proxy, sdk, table, s) = setup("slots-noasg", 2).await;
    // An EC2 instance of no group, registered in the cluster.
    let lone_id = aws::lone_instance(&sdk, "slots-lone").await;
    let lone = aws::register(&sdk, &s.cluster, &lone_id).await;
    let text = format!(
        "[identity]\ninstance_id = \"{lone_id}\"\ncluster = \"{}\"\ncontainer_instance_arn = \"{}\"\n[fleet]\nwarmup = \"0s\"\n{}",
        s.cluster,
        lone,
        aws::table_fleet(&table)
    );
    let cfg = gpu_medic::config::Config::parse(std::path::Path::new("/tmp/t.toml"), &text).unwrap();
    let cp = AwsControlPlane::new(&sdk, &cfg);
    let Err(RemedyError::Deferred { message, .. }) = cp
        .drain(&aws::order(
            Command::Drain { terminating: false },
            Duration::from_secs(30),
        ))
        .await
    else {
        panic!("no group, no drain")
    };
    assert!(
        message.contains("is in no Auto Scaling group") && message.contains("must not drain"),
        "{message}"
    );
    assert_eq!(aws::instance(&sdk, &s.cluster, &lone).await.0, "ACTIVE");
    assert_eq!(proxy.count("PutItem") + proxy.count("GetItem"), 0);
}

/// EC2 refusing DescribeInstances (a policy without it): no holder is removed, and the
/// deferral says why, so a gone instance's slot is not kept silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_describe_instances_is_named_in_the_deferral() {
    let (proxy, sdk, table, s) = setup("slots-ec2", 3).await;
    aws::put_slot_holder(&sdk, &table, &s.asg, &s.nodes[1].instance_id).await;
    aws::terminate(&sdk, &s.nodes[1].instance_id).await;
    proxy.fault(Fault::canned(
        "DescribeInstances",
        1000,
        403,
        "text/xml",
        "<Response><Errors><Error><Code>UnauthorizedOperation</Code><Message>You are not authorized to perform this operation.</Message></Error></Errors><RequestID>denied</RequestID></Response>".into(),
    ));
    let cp = AwsControlPlane::new(&sdk, &aws::config(&s, 0, "", &aws::table_fleet(&table)));
    let drain = || {
        aws::order(
            Command::Drain { terminating: false },
            Duration::from_secs(30),
        )
    };
    let Err(RemedyError::Deferred { message, .. }) = cp.drain(&drain()).await else {
        panic!("the slot is held by an instance nobody can see terminated")
    };
    assert!(
        message.contains("UnauthorizedOperation")
            && message.contains("check the IAM policy: ec2:DescribeInstances"),
        "{message}"
    );
    // With the permission back, the terminated holder is removed and the slot taken.
    proxy.clear_faults();
    cp.drain(&drain()).await.unwrap();
    let item = aws::slot_item(&sdk, &table, &s.asg).await;
    assert_eq!(
        item.holders.keys().collect::<Vec<_>>(),
        [&s.nodes[0].instance_id]
    );
}

/// Node `i` of `s` as a `gpu-medic run` on the fake GPUs, every AWS service at `endpoint`
/// (None: per-service variables set by the caller), its wall clock `skew_s` seconds off.
fn daemon(s: &Seeded, i: usize, endpoint: Option<&str>, table: &str, skew_s: i64) -> Daemon {
    let fleet = format!("retry_after = \"400ms\"\n{}", aws::table_fleet(table));
    let mut d = aws::node(s, i, endpoint, "", "", &fleet, "");
    if skew_s != 0 {
        d.env("LD_PRELOAD", LIBFAKETIME)
            .env("FAKETIME", format!("{skew_s:+}"))
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    }
    d
}

fn xid_79(d: &mut Daemon) {
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
}

/// The attempts at its orders that daemon `d` has journaled as ended (done, failed or
/// deferred by the budget): each deferred drain tries again after `retry_after`, reading the
/// slot table each time.
fn attempts(d: &Daemon) -> usize {
    d.records()
        .iter()
        .filter(|r| r["event"] == "action-finished")
        .count()
}

/// Waits until each of `ds` has ended two more attempts than now: every deferred node has
/// read the table again, and had the chance to drain.
async fn each_tried_again(ds: &[&Daemon]) {
    let before: Vec<usize> = ds.iter().map(|d| attempts(d)).collect();
    wait_for(
        "each deferred node to try again twice",
        gpu_medic_testkit::LOOKS_LIMIT,
        || {
            let done = ds.iter().zip(&before).all(|(d, b)| attempts(d) >= b + 2);
            async move { done }
        },
    )
    .await;
}

/// Issue 17's "done when": five supervisors faulting at once against one moto, wall clocks
/// skewed by up to 90 s, never exceed the budget (1), through a reservation frozen past its
/// lifetime (SIGSTOP between reserve and commit, then SIGCONT: fenced out, it does not drain)
/// and a holder SIGKILLed for ever (its slot released once its instance is terminated).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_supervisors_with_skewed_clocks_never_exceed_the_budget() {
    assert!(
        std::path::Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} not found: run `sudo bash .ci/install-deps.sh` (Debian's faketime)"
    );
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let moto = aws::sdk(&aws::moto().url).await;
    let table = aws::unique("slots5");
    aws::create_slot_table(&sdk, &table).await;
    let s = Arc::new(aws::seed(&sdk, "slots-five", 5).await);
    let skews = [-90, 0, 37, 64, -23];
    let mut ds: Vec<Daemon> = (0..5)
        .map(|i| daemon(&s, i, Some(&proxy.url), &table, skews[i]))
        .collect();
    for d in &mut ds {
        d.start();
    }
    for d in &ds {
        d.wait_polled();
    }
    let sampler = Sampler::start(&moto, &s);
    let id = |i: usize| s.nodes[i].instance_id.clone();

    // 1. Node 4 faults first; its reservation is written, and the answer held back while the
    // process is frozen: reserved, not committed.
    let updated_by = |i: usize| format!(r#""updated_by":{{"S":"{}"}}"#, id(i));
    let hold = proxy.hold("PutItem", &[r#""S":"reserved""#, &updated_by(4)]);
    xid_79(&mut ds[4]);
    wait_for("node 4's reservation", Duration::from_secs(30), || async {
        hold.is_held()
    })
    .await;
    gpu_medic_testkit::signal(ds[4].pid().unwrap(), libc::SIGSTOP);
    let frozen = Instant::now();
    let item = aws::slot_item(&moto, &table, &s.asg).await;
    assert_eq!(
        item.holders[&id(4)].state,
        HolderState::Reserved,
        "{item:?}"
    );

    // 2. The other four fault at once. The item is full (node 4's reservation); each sees it
    // unchanged for reservation_lifetime by its own monotonic clock, and one takes it over.
    for d in &mut ds[..4] {
        xid_79(d);
    }
    wait_for("a takeover to drain", Duration::from_secs(40), || async {
        !draining(&moto, &s).await.is_empty()
    })
    .await;
    let w = draining(&moto, &s).await[0].clone();
    let wi = (0..4)
        .find(|&i| id(i) == w)
        .expect("one of nodes 0-3 drains");
    let item = aws::slot_item(&moto, &table, &s.asg).await;
    assert!(!item.holders.contains_key(&id(4)), "taken over: {item:?}");
    assert_eq!(item.holders[&w].state, HolderState::Committed, "{item:?}");
    let w_token = item.holders[&w].token;
    // The skew is real: each journal is stamped by its own wall clock (the incidents opened
    // within the last 45 s).
    for i in [0, 3] {
        let at = ds[i].records()[0]["at"]
            .as_str()
            .map(str::to_string)
            .unwrap();
        let off = gpu_medic_testkit::parse_at(&at).unwrap() - gpu_medic_testkit::now_ms();
        let want = skews[i] as f64 * 1000.0;
        assert!(
            off > want - 45_000.0 && off < want + 2_000.0,
            "daemon {i}'s clock is not {} s off: {off} ms",
            skews[i]
        );
    }

    // 3. Node 4 wakes and hears that its reservation was written: its commit is conditional
    // on that version, fails, and it does not drain. (The takeover it lost to is in the item
    // and in ECS, both awaited above.)
    assert!(
        frozen.elapsed() < Duration::from_secs(18),
        "frozen {:?}: longer than the SDK's attempt timeout would be another test",
        frozen.elapsed()
    );
    gpu_medic_testkit::signal(ds[4].pid().unwrap(), libc::SIGCONT);
    hold.release();
    let fenced = || {
        proxy.calls().iter().any(|c| {
            c.op == "PutItem"
                && c.body.contains(&updated_by(4))
                && c.body.contains(r#""S":"committed""#)
                && c.status == 400
        })
    };
    wait_for(
        "node 4's commit to be refused",
        Duration::from_secs(20),
        || async { fenced() },
    )
    .await;
    // Node 4 ends that attempt (deferred: the slot is taken) and tries again.
    each_tried_again(&[&ds[4]]).await;
    assert_eq!(
        draining(&moto, &s).await,
        std::slice::from_ref(&w),
        "node 4 is fenced out"
    );
    assert_eq!(
        aws::instance(&moto, &s.cluster, &s.nodes[4].arn).await.0,
        "ACTIVE"
    );

    // 4. The holder dies for ever; Auto Scaling terminates its instance. Another gpu-medic of
    // the group sees the fact in EC2, removes the entry, and the next instance drains.
    ds[wi].signal(libc::SIGKILL);
    aws::terminate(&moto, &w).await;
    wait_for(
        "the next instance to drain",
        Duration::from_secs(40),
        || async { !draining(&moto, &s).await.is_empty() },
    )
    .await;
    let next = draining(&moto, &s).await[0].clone();
    assert_ne!(next, w);
    let item = aws::slot_item(&moto, &table, &s.asg).await;
    assert!(!item.holders.contains_key(&w), "{item:?}");
    assert!(item.holders[&next].token > w_token, "{item:?}");
    // The others, still deferred, each read the table again twice (the sampler watching).
    let others: Vec<&Daemon> = (0..5)
        .filter(|&i| i != wi && id(i) != next)
        .map(|i| &ds[i])
        .collect();
    each_tried_again(&others).await;

    let (max, samples, worst) = sampler.finish().await;
    assert!(samples > 10, "{samples} samples");
    assert_eq!(max, 1, "at most 1 DRAINING at once, saw {worst:?}");
    eprintln!(
        "first holder {w} (token {w_token}), next {next}, {samples} samples of moto, at most {max} DRAINING"
    );
    let removed = ds
        .iter()
        .filter(|d| {
            d.log()
                .contains("removed the entry of a terminated instance")
        })
        .count();
    assert!(removed >= 1, "nobody removed the terminated holder");
    // Every write was conditional.
    let puts: Vec<_> = proxy
        .calls()
        .into_iter()
        .filter(|c| c.op == "PutItem")
        .collect();
    assert!(
        puts.iter().all(|c| c.body.contains("ConditionExpression")),
        "{puts:?}"
    );
    // `status` shows the slot table as the node last read it.
    let out = ds[next_index(&s, &next)].cli(&["status", "--json"]);
    let st: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(st["slots"]["table"], table.as_str(), "{st:#}");
    assert_eq!(
        st["slots"]["holders"][&next]["state"], "committed",
        "{st:#}"
    );
    for d in &mut ds {
        d.signal(libc::SIGKILL);
    }
}

fn next_index(s: &Seeded, id: &str) -> usize {
    s.nodes.iter().position(|n| n.instance_id == id).unwrap()
}

/// The table throttling (ProvisionedThroughputExceededException, answered by the proxy for
/// every DynamoDB read): quarantine only, no drain, and the incident says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_table_means_quarantine_only_with_a_clear_incident() {
    let (proxy, sdk, table, s) = setup("slots-thr", 3).await;
    proxy.fault(Fault::dynamodb(
        "GetItem",
        100_000,
        400,
        "ProvisionedThroughputExceededException",
        "The level of configured provisioned throughput for the table was exceeded.",
    ));
    let mut d = daemon(&s, 0, Some(&proxy.url), &table, 0);
    d.start();
    d.wait_polled();
    xid_79(&mut d);
    expect_quarantine_only(&d, &sdk, &s, "ProvisionedThroughputExceededException").await;
    assert_eq!(proxy.count("PutItem"), 0);
}

/// The table unreachable (its endpoint a closed port; every other service in moto): the
/// same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_table_means_quarantine_only_with_a_clear_incident() {
    let sdk = aws::sdk(&aws::moto().url).await;
    let table = aws::unique("slots-off");
    aws::create_slot_table(&sdk, &table).await;
    let s = aws::seed(&sdk, "slots-off", 3).await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let mut d = daemon(&s, 0, Some(&aws::moto().url), &table, 0);
    d.env(
        "AWS_ENDPOINT_URL_DYNAMODB",
        format!("http://127.0.0.1:{port}"),
    );
    d.start();
    d.wait_polled();
    xid_79(&mut d);
    expect_quarantine_only(&d, &sdk, &s, "table unreachable").await;
}

async fn expect_quarantine_only(d: &Daemon, sdk: &aws_config::SdkConfig, s: &Seeded, why: &str) {
    let me = &s.nodes[0];
    wait_for(
        "the deferral to be journaled",
        Duration::from_secs(40),
        || async { d.incident(1).to_string().contains(why) },
    )
    .await;
    let inc = d.incident(1);
    let text = inc.to_string();
    assert!(
        text.contains("no drain without the table") && text.contains("staying quarantined"),
        "{inc:#}"
    );
    let (status, _, attrs) = aws::instance(sdk, &s.cluster, &me.arn).await;
    assert_eq!(status, "ACTIVE", "no drain");
    assert!(attrs.contains(&("gpu-medic.health".into(), Some("faulted".into()))));
    assert!(
        aws::asg_health(sdk, &s.asg)
            .await
            .iter()
            .all(|(_, h)| h == "Healthy"),
        "no replacement"
    );
}
