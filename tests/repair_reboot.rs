//! The reboot rung through the real `gpu-medic run` binary (docs/repair.md): the fake
//! libnvidia-ml reports an XID 79, the default policy says reboot (the first time), and
//! gpu-medic quarantines and drains its container instance in moto, then calls EC2
//! `RebootInstances` on itself (moto 5.2.5 answers 200 and changes nothing), all through a
//! recording, fault-injecting proxy.
//!
//! "The boot" is what a reboot does to gpu-medic: it is stopped (SIGTERM, as systemd stops it
//! when the OS goes down, or SIGKILL for a crash) and started again over the same
//! `state_dir` with a new kernel boot id (`[repair] boot_id_path`, a file here: the real one
//! cannot change without rebooting this machine) and an empty kernel log. The fake NVML
//! starts healthy in the new process (healed), or has the GPU lost again (still faulty).
//! A test double only for what cannot exist here: EC2 rebooting an instance.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_medic_testkit::aws::{self, Fault, Proxy, Sampler, Seeded};
use gpu_medic_testkit::journal::started_commands;
use gpu_medic_testkit::{Daemon, default_policy, wait_for};
use serde_json::Value;

/// Node 0 of `s` on the fake GPUs with the reboot rung on, every AWS service at `proxy`;
/// short deadlines (`reboot`: how long a node may stay up after the reboot call).
fn node(s: &Seeded, proxy: &Proxy, reboot_deadline: &str) -> Daemon {
    node_with(s, 0, proxy, reboot_deadline, "", "")
}

/// Node `i` of [`node`], with more `[fleet]` lines (a slot table) and more policy text after
/// the deadlines (a `[reboot]` ladder of its own).
fn node_with(
    s: &Seeded,
    i: usize,
    proxy: &Proxy,
    reboot_deadline: &str,
    fleet_extra: &str,
    policy_extra: &str,
) -> Daemon {
    let fleet = format!("claim_settle = \"200ms\"\nretry_after = \"1s\"\n{fleet_extra}");
    let repair = "[repair]\nreboot = \"ec2\"\ncheck_interval = \"200ms\"\nsettle = \"1s\"\n";
    let d = aws::node(s, i, Some(&proxy.url), "", "", &fleet, repair);
    let policy = d.path("policy.toml");
    std::fs::write(
        &policy,
        format!(
            "version = 1\nextends = \"{}\"\n[deadlines]\nreboot = \"{reboot_deadline}\"\nboot_check = \"20s\"\n[retry]\ndelay = \"300ms\"\n{policy_extra}",
            default_policy().display()
        ),
    )
    .unwrap();
    let text = std::fs::read_to_string(d.config()).unwrap();
    let text = text
        .lines()
        .map(|l| {
            if l.starts_with("policy = ") {
                format!("policy = \"{}\"", policy.display())
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    let boot = d.path("boot_id");
    std::fs::write(
        d.config(),
        format!("{text}\nboot_id_path = \"{}\"\n", boot.display()),
    )
    .unwrap();
    std::fs::write(&boot, "boot-1\n").unwrap();
    d
}

fn start(d: &mut Daemon) {
    d.start();
    d.wait_polled();
}

/// The machine rebooted: a new boot id and a new kernel log.
fn boot(d: &mut Daemon, id: &str) {
    std::fs::write(d.path("boot_id"), format!("{id}\n")).unwrap();
    std::fs::write(d.path("kmsg"), "").unwrap();
    d.start();
}

/// The engine's state as last committed (`Null` before the first commit).
fn state(d: &Daemon) -> Value {
    d.state()
}

/// The reboot call accepted: the engine waits for the boot.
async fn wait_accepted(d: &Daemon) {
    wait_for("the reboot accepted", Duration::from_secs(40), || {
        let step = state(d)["remediation"]["step"].clone();
        async move { step == "await-boot" }
    })
    .await;
}

/// Starts `d`, injects an XID 79 and waits for the reboot call's acceptance; then stops it
/// as the OS going down would.
async fn fault_until_rebooted(d: &mut Daemon) {
    start(d);
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_accepted(d).await;
    d.stop(Duration::from_secs(30));
}

async fn wait_phase(d: &Daemon, phase: &str, limit: Duration) {
    wait_for(&format!("node phase {phase}"), limit, || {
        let p = state(d)["node"].clone();
        async move { p == phase }
    })
    .await;
}

fn reboots(proxy: &Proxy, s: &Seeded) -> usize {
    proxy.count_with(
        "RebootInstances",
        &format!("InstanceId.1={}", s.nodes[0].instance_id),
    )
}

fn escalations(inc: &Value) -> Vec<String> {
    inc["records"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["event"] == "escalated")
        .map(|r| format!("{}: {}", r["rule"], r["reason"]))
        .collect()
}

async fn assert_back_in_service(sdk: &aws_config::SdkConfig, s: &Seeded) {
    aws::assert_back_in_service(sdk, s, 0).await;
}

/// Fault -> reboot through EC2 -> boot (healed) -> back in service; a second XID 79 within
/// the ladder's window goes straight to replace, with no second reboot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healed_node_is_back_in_service_after_the_boot_and_the_second_fault_replaces() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "rb-heal", 2).await;
    let mut d = node(&s, &proxy, "10m");
    start(&mut d);
    let t0 = Instant::now();
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_accepted(&d).await;
    let to_reboot = t0.elapsed();
    assert_eq!(reboots(&proxy, &s), 1);
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[0].arn).await.0,
        "DRAINING"
    );
    d.stop(Duration::from_secs(30));

    let t1 = Instant::now();
    boot(&mut d, "boot-2");
    let inc = d.wait_closed(1, Duration::from_secs(30));
    // For BENCHMARKS.md ("Reboot rung vs replace"): the local steps, not asserted.
    eprintln!(
        "measured: fault -> reboot call accepted {} ms; gpu-medic start after the boot -> back in service {} ms",
        to_reboot.as_millis(),
        t1.elapsed().as_millis()
    );
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    assert!(
        inc["summary"]
            .as_str()
            .unwrap()
            .contains("repaired by reboot"),
        "{inc:#}"
    );
    assert_eq!(
        started_commands(&inc),
        [
            "quarantine",
            "drain",
            "reboot",
            "quarantine",
            "boot-check",
            "restore"
        ],
        "{inc:#}"
    );
    assert_eq!(reboots(&proxy, &s), 1, "one reboot");
    assert_back_in_service(&sdk, &s).await;
    let st = state(&d);
    assert_eq!(st["node"], "in-service");
    let h = &st["repair"]["history"];
    assert_eq!(h[0]["result"], "repaired", "{st:#}");
    assert_eq!(h[0]["boot_before"], "boot-1");
    assert_eq!(h[0]["boot_after"], "boot-2");

    // The same fault again within 7 days: rule xid-fallen-off-bus allows one reboot.
    d.wait_polled();
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for("the second incident", Duration::from_secs(20), || async {
        d.incident(2)["action"] == "replace"
    })
    .await;
    let inc = d.incident(2);
    let why = escalations(&inc).join("\n");
    assert!(
        why.contains("reboot-ladder") && why.contains("allows 1 reboot"),
        "{inc:#}"
    );
    // `incidents show` (text) shows the rung, the history and why it went up.
    let out = d.cli(&["incidents", "show", "2"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("rung:") && text.contains("reboot history"),
        "{text}"
    );
    d.stop(Duration::from_secs(10));
    assert_eq!(reboots(&proxy, &s), 1, "no second reboot");
}

/// The ladder forgets: with `[reboot] window = "3s"`, the same XID 79 after the window (and
/// after `recur_within`) reboots again instead of replacing; the history keeps both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_window_the_same_fault_reboots_again() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "rb-window", 2).await;
    let mut d = node_with(
        &s,
        0,
        &proxy,
        "10m",
        "",
        "[reboot]\nwindow = \"3s\"\nrecur_within = \"1s\"\n",
    );
    fault_until_rebooted(&mut d).await;
    boot(&mut d, "boot-2");
    let inc = d.wait_closed(1, Duration::from_secs(30));
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    let returned = Instant::now();

    // The window is time itself: wait it out (3 s from the reboot, 1 s from the return).
    std::thread::sleep(
        Duration::from_secs(3).saturating_sub(returned.elapsed()) + Duration::from_millis(500),
    );
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for(
        "the second reboot accepted",
        Duration::from_secs(40),
        || {
            let st = state(&d);
            let n = reboots(&proxy, &s);
            async move { st["remediation"]["step"] == "await-boot" && n == 2 }
        },
    )
    .await;
    let inc = d.incident(2);
    assert_eq!(inc["action"], "reboot", "{inc:#}");
    assert!(escalations(&inc).is_empty(), "{inc:#}");
    d.stop(Duration::from_secs(30));
    boot(&mut d, "boot-3");
    let inc = d.wait_closed(2, Duration::from_secs(30));
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    assert_back_in_service(&sdk, &s).await;
    let st = state(&d);
    let h = st["repair"]["history"].as_array().unwrap();
    assert_eq!(h.len(), 2, "{st:#}");
    assert_eq!(h[1]["boot_before"], "boot-2");
    assert_eq!(h[1]["boot_after"], "boot-3");
    assert_eq!(reboots(&proxy, &s), 2);
    d.stop(Duration::from_secs(10));
}

/// The ECS agent may register the instance again after the boot (a new container instance
/// ARN, the old one gone): gpu-medic finds itself under the new ARN, quarantines and checks
/// it, and returns it to service; the fleet budget's slot (kept by instance id in the slot
/// table) is released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_under_a_new_container_instance_arn_returns_to_service() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let table = aws::unique("rb-newarn");
    aws::create_slot_table(&sdk, &table).await;
    let s = aws::seed(&sdk, "rb-newarn", 2).await;
    let fleet = aws::table_fleet(&table);
    let mut d = node_with(&s, 0, &proxy, "10m", &fleet, "");
    fault_until_rebooted(&mut d).await;

    // The agent registers the rebooted instance anew; the old record is gone.
    let old = s.nodes[0].arn.clone();
    aws_sdk_ecs::Client::new(&sdk)
        .deregister_container_instance()
        .cluster(&s.cluster)
        .container_instance(&old)
        .force(true)
        .send()
        .await
        .unwrap();
    let new = aws::register(&sdk, &s.cluster, &s.nodes[0].instance_id).await;
    assert_ne!(new, old);
    // What the agent's introspection API would now report ([identity] stands in for it).
    let text = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        text.replace(
            &format!("container_instance_arn = \"{old}\""),
            &format!("container_instance_arn = \"{new}\""),
        ),
    )
    .unwrap();
    boot(&mut d, "boot-2");
    let inc = d.wait_closed(1, Duration::from_secs(30));
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    let (status, _, attrs) = aws::instance(&sdk, &s.cluster, &new).await;
    assert_eq!(status, "ACTIVE", "{attrs:?}");
    assert!(
        attrs.contains(&("gpu-medic.health".into(), Some("ok".into()))),
        "{attrs:?}"
    );
    let item = aws::slot_item(&sdk, &table, &s.asg).await;
    assert!(
        !item.holders.contains_key(&s.nodes[0].instance_id),
        "slot released: {item:?}"
    );
    assert_eq!(reboots(&proxy, &s), 1);
    d.stop(Duration::from_secs(10));
}

/// Still faulty after the boot (the GPU is lost again): replace, the slot held throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_still_faulty_after_the_boot_is_replaced() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "rb-faulty", 2).await;
    let mut d = node(&s, &proxy, "10m");
    fault_until_rebooted(&mut d).await;

    d.inject(r#"{"gpu": 0, "lost": true}"#);
    boot(&mut d, "boot-2");
    wait_for("replaced", Duration::from_secs(40), || async {
        d.incident(1)["state"] == "replaced"
    })
    .await;
    let inc = d.incident(1);
    assert!(
        aws::asg_health(&sdk, &s.asg)
            .await
            .contains(&(s.nodes[0].instance_id.clone(), "Unhealthy".into())),
        "{inc:#}"
    );
    assert_eq!(reboots(&proxy, &s), 1);
    assert!(
        escalations(&inc).join("\n").contains("after the reboot"),
        "{inc:#}"
    );
    assert_eq!(state(&d)["repair"]["history"][0]["result"], "escalated");
    d.stop(Duration::from_secs(10));
}

/// RebootInstances throttled twice, then accepted: retried, one reboot.
/// RebootInstances refused (no permission): replace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_reboot_is_retried_and_a_refused_one_replaces() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "rb-refuse", 2).await;
    let ec2_error = |code: &str| {
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Response><Errors><Error><Code>{code}</Code><Message>{code} (injected)</Message></Error></Errors><RequestID>inj-{code}</RequestID></Response>"
        )
    };
    // The SDK retries throttling itself (3 attempts), then the engine after [retry] delay.
    proxy.fault(Fault::canned(
        "RebootInstances",
        4,
        503,
        "text/xml",
        ec2_error("RequestLimitExceeded"),
    ));
    let mut d = node(&s, &proxy, "10m");
    start(&mut d);
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_phase(&d, "rebooting", Duration::from_secs(40)).await;
    wait_for("the reboot accepted", Duration::from_secs(20), || async {
        state(&d)["remediation"]["step"] == "await-boot"
    })
    .await;
    assert!(reboots(&proxy, &s) >= 5, "{:?}", proxy.ops());
    d.stop(Duration::from_secs(10));

    let s = aws::seed(&sdk, "rb-refuse2", 2).await;
    proxy.fault(Fault::canned(
        "RebootInstances",
        100,
        403,
        "text/xml",
        ec2_error("UnauthorizedOperation"),
    ));
    let mut d = node(&s, &proxy, "10m");
    start(&mut d);
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for("replaced", Duration::from_secs(40), || async {
        d.incident(1)["state"] == "replaced"
    })
    .await;
    let inc = d.incident(1);
    assert!(
        escalations(&inc)
            .join("\n")
            .contains("the reboot did not happen"),
        "{inc:#}"
    );
    assert_eq!(state(&d)["repair"]["history"][0]["result"], "not-rebooted");
    assert_eq!(reboots(&proxy, &s), 1, "a refusal is not retried");
    d.stop(Duration::from_secs(10));
}

/// The reboot accepted but the instance never goes down: past `[deadlines] reboot`, replace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_never_reboots_is_replaced_at_the_deadline() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "rb-never", 2).await;
    let mut d = node(&s, &proxy, "3s");
    start(&mut d);
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for("replaced", Duration::from_secs(40), || async {
        d.incident(1)["state"] == "replaced"
    })
    .await;
    let inc = d.incident(1);
    assert!(escalations(&inc).join("\n").contains("still up"), "{inc:#}");
    assert_eq!(reboots(&proxy, &s), 1);
    d.stop(Duration::from_secs(10));
}

/// Killed between "reboot recorded" and the call (the call never reached EC2): the same boot
/// at restart resumes the order and makes the call once. Killed after the call reached EC2:
/// the new boot finishes the order; no second reboot, no lost slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_around_the_reboot_call_reboots_once() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "rb-crash", 2).await;
    proxy.fault(Fault::hangup("RebootInstances", 1000));
    let mut d = node(&s, &proxy, "10m");
    start(&mut d);
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for("the reboot call", Duration::from_secs(30), || {
        let n = proxy.count("RebootInstances");
        async move { n >= 1 }
    })
    .await;
    d.signal(libc::SIGKILL);
    proxy.clear_faults();
    let before = proxy.count("RebootInstances");
    // Same boot: the machine did not reboot, so the order is resumed and the call made.
    let hold = proxy.hold("RebootInstances", &[]);
    d.start();
    wait_for("the reboot reaching EC2", Duration::from_secs(30), || {
        let held = hold.is_held();
        async move { held }
    })
    .await;
    // Killed with EC2's answer in flight: EC2 reboots the instance.
    d.signal(libc::SIGKILL);
    hold.release();
    boot(&mut d, "boot-2");
    let inc = d.wait_closed(1, Duration::from_secs(30));
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    assert!(
        proxy.count("RebootInstances") <= before + 1,
        "no reboot after the boot: {:?}",
        proxy.ops()
    );
    let reboot_orders = started_commands(&inc)
        .iter()
        .filter(|c| c.as_str() == "reboot")
        .count();
    assert!(reboot_orders >= 1, "{inc:#}");
    assert_back_in_service(&sdk, &s).await;
    d.stop(Duration::from_secs(10));
}

/// Dry run: the plan names the reboot, nothing is called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_says_what_it_would_reboot() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "rb-dry", 1).await;
    let mut d = node(&s, &proxy, "10m");
    let text = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(d.config(), format!("dry_run = true\n{text}")).unwrap();
    start(&mut d);
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    let inc = d.wait_closed(1, Duration::from_secs(20));
    assert_eq!(inc["state"], "observed", "{inc:#}");
    assert_eq!(started_commands(&inc), ["quarantine", "drain", "reboot"]);
    assert!(
        inc["summary"]
            .as_str()
            .unwrap()
            .contains("rebooted the instance"),
        "{inc:#}"
    );
    assert_eq!(proxy.count("RebootInstances"), 0);
    d.stop(Duration::from_secs(10));
}

/// The budget holds with the rung: five supervisors of one group on one slot table (moto
/// DynamoDB), budget 1, all faulting at once; nodes 0-2 reboot (each holds its slot from the
/// drain through the boot to its return to service), nodes 3-4 have no rung and are replaced
/// (their slot freed once Auto Scaling has terminated them). Sampled from moto throughout:
/// never more than one instance out of service, every one of the five dealt with in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_supervisors_rebooting_and_replacing_keep_the_budget() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let moto = aws::sdk(&aws::moto().url).await;
    let table = aws::unique("rb-five");
    aws::create_slot_table(&sdk, &table).await;
    let s = Arc::new(aws::seed(&sdk, "rb-five", 5).await);
    let fleet = aws::table_fleet(&table);
    let mut ds: Vec<Daemon> = (0..5)
        .map(|i| {
            if i < 3 {
                node_with(&s, i, &proxy, "10m", &fleet, "")
            } else {
                let fleet = format!("retry_after = \"1s\"\n{fleet}");
                aws::node(&s, i, Some(&proxy.url), "", "", &fleet, "")
            }
        })
        .collect();
    for d in &mut ds {
        d.start();
    }
    for d in &ds {
        d.wait_polled();
    }
    let sampler = Sampler::start(&moto, &s);
    for d in &mut ds {
        d.inject(r#"{"gpu": 0, "xid": 79}"#);
    }
    let t0 = Instant::now();
    let mut booted = [false; 3];
    let mut terminated = [false; 2];
    let mut order = Vec::new();
    loop {
        let mut done = 0;
        for (i, d) in ds.iter_mut().enumerate().take(3) {
            if !booted[i] {
                if state(d)["remediation"]["step"] == "await-boot" {
                    // EC2 reboots it: gpu-medic goes down with the OS and starts on a new boot.
                    d.stop(Duration::from_secs(30));
                    boot(d, "boot-2");
                    booted[i] = true;
                    order.push(format!("{i} rebooted"));
                }
            } else if d.incident(1)["state"] == "repaired" {
                done += 1;
            }
        }
        let health = aws::asg_health(&moto, &s.asg).await;
        for i in 3..5 {
            let id = &s.nodes[i].instance_id;
            if !terminated[i - 3] && health.contains(&(id.clone(), "Unhealthy".into())) {
                // Auto Scaling replaces it.
                aws::terminate(&moto, id).await;
                terminated[i - 3] = true;
                order.push(format!("{i} replaced"));
            }
            done += usize::from(terminated[i - 3]);
        }
        if done == 5 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "not all five dealt with in 180 s: {order:?}; logs: {}",
            ds.iter()
                .map(|d| d.log())
                .collect::<Vec<_>>()
                .join("\n----\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (max, samples, worst) = sampler.finish().await;
    eprintln!(
        "order {order:?}; {samples} samples of moto in {} ms, at most {max} DRAINING",
        t0.elapsed().as_millis()
    );
    assert!(samples > 10, "{samples} samples");
    assert_eq!(max, 1, "at most 1 out of service at once, saw {worst:?}");
    for (i, d) in ds.iter().enumerate().take(3) {
        assert_eq!(
            proxy.count_with(
                "RebootInstances",
                &format!("InstanceId.1={}", s.nodes[i].instance_id)
            ),
            1,
            "node {i} rebooted once"
        );
        let (status, _, attrs) = aws::instance(&moto, &s.cluster, &s.nodes[i].arn).await;
        assert_eq!(status, "ACTIVE", "node {i}: {attrs:?}; {}", d.log());
    }
    for i in 3..5 {
        assert_eq!(
            proxy.count_with(
                "RebootInstances",
                &format!("InstanceId.1={}", s.nodes[i].instance_id)
            ),
            0,
            "node {i} has no rung"
        );
    }
    let item = aws::slot_item(&moto, &table, &s.asg).await;
    for i in 0..3 {
        assert!(
            !item.holders.contains_key(&s.nodes[i].instance_id),
            "node {i} released its slot: {item:?}"
        );
    }
    for d in &mut ds {
        d.signal(libc::SIGKILL);
    }
}

/// What happens to `state.json` between two boots.
#[derive(Clone, Copy, Debug)]
enum Loss {
    Deleted,
    Truncated,
    Empty,
}

fn lose_state(d: &Daemon, loss: Loss) {
    let p = d.path("state/state.json");
    match loss {
        Loss::Deleted => std::fs::remove_file(&p).unwrap(),
        Loss::Truncated => {
            let text = std::fs::read(&p).unwrap();
            std::fs::write(&p, &text[..text.len() / 3]).unwrap();
        }
        Loss::Empty => std::fs::write(&p, "{}").unwrap(),
    }
}

/// Opened records per incident id in the journal: each id once.
fn assert_ids_unique(d: &Daemon) {
    let opened = gpu_medic_testkit::journal::events(&d.records(), "opened");
    let mut ids: Vec<u64> = opened
        .iter()
        .map(|r| r["incident"].as_u64().unwrap())
        .collect();
    let n = ids.len();
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), n, "an incident id reused: {opened:#?}");
}

/// Reboot, healed, then `state.json` lost; at the next boot a second XID 79 within the
/// ladder's window still replaces (the repair history is rebuilt from the journal), and its
/// incident is 2, not a second incident 1.
async fn lost_state_keeps_the_ladder(loss: Loss, name: &str) {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, name, 2).await;
    let mut d = node(&s, &proxy, "10m");
    fault_until_rebooted(&mut d).await;
    boot(&mut d, "boot-2");
    let inc = d.wait_closed(1, Duration::from_secs(30));
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    d.wait_polled();
    d.stop(Duration::from_secs(10));
    lose_state(&d, loss);
    boot(&mut d, "boot-3");
    d.wait_polled();
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    let xid79 = |d: &Daemon| {
        gpu_medic_testkit::journal::events(&d.records(), "opened")
            .into_iter()
            .filter(|r| r["observation"]["signal"]["code"] == 79)
            .collect::<Vec<_>>()
    };
    wait_for(
        "the second XID 79's incident",
        Duration::from_secs(20),
        || {
            let n = xid79(&d).len();
            async move { n >= 2 }
        },
    )
    .await;
    let second = xid79(&d)[1].clone();
    // Incident 2 is the lost state (a self-fault, already over); the XID comes after it.
    let id = second["incident"].as_u64().unwrap() as u32;
    assert!(id > 1, "{loss:?}: {second:#}");
    assert_ids_unique(&d);
    let lost = d.incident(2);
    assert!(
        lost["summary"].to_string().contains("state")
            || lost
                .to_string()
                .contains("resumed from the incident journal"),
        "{loss:?}: {lost:#}"
    );
    wait_for(
        "the second incident replaced",
        Duration::from_secs(20),
        || {
            let action = d.incident(id)["action"].clone();
            async move { action == "replace" }
        },
    )
    .await;
    let inc = d.incident(id);
    let why = escalations(&inc).join("\n");
    assert!(
        why.contains("reboot-ladder") && why.contains("allows 1 reboot"),
        "{loss:?}: {inc:#}\n{}",
        d.log()
    );
    assert_ids_unique(&d);
    d.stop(Duration::from_secs(10));
    assert_eq!(reboots(&proxy, &s), 1, "{loss:?}: no second reboot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_state_keeps_the_reboot_ladder_and_the_incident_ids() {
    lost_state_keeps_the_ladder(Loss::Deleted, "rb-lost-del").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_state_keeps_the_reboot_ladder_and_the_incident_ids() {
    lost_state_keeps_the_ladder(Loss::Truncated, "rb-lost-trunc").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_state_keeps_the_reboot_ladder_and_the_incident_ids() {
    lost_state_keeps_the_ladder(Loss::Empty, "rb-lost-empty").await;
}

/// `state.json` lost while the accepted reboot was under way: the new boot finishes the
/// repair (quarantine, boot check, restore) with no second reboot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_state_lost_during_the_reboot_does_not_reboot_again() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "rb-lost-mid", 2).await;
    let mut d = node(&s, &proxy, "10m");
    fault_until_rebooted(&mut d).await;
    lose_state(&d, Loss::Deleted);
    boot(&mut d, "boot-2");
    let inc = d.wait_closed(1, Duration::from_secs(30));
    assert_eq!(inc["state"], "repaired", "{inc:#}\n{}", d.log());
    assert_eq!(reboots(&proxy, &s), 1, "one reboot");
    let st = state(&d);
    assert_eq!(st["repair"]["history"][0]["result"], "repaired", "{st:#}");
    assert_eq!(st["repair"]["history"][0]["boot_after"], "boot-2", "{st:#}");
    assert_back_in_service(&sdk, &s).await;
    d.stop(Duration::from_secs(10));
}

/// The ladder survives anything short of the disk, and with `[aws]` on, the disk too:
/// after a repaired reboot, `state.json` is deleted and the journal rotated away by
/// gpu-medic itself (`[journal] keep_files = 0`, a journal padded past its 1 MiB cap); the
/// rebuilt state knows no reboot, but the reboot ledger (`state/reboots.json`) does, so the
/// second XID 79 is replaced, not rebooted. Then the whole state directory is lost (a new
/// disk): the instance's tag `gpu-medic:reboots` (set before the reboot call, read back with
/// DescribeTags at start) still counts it. One RebootInstances in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reboot_count_outlives_a_lost_state_a_rotated_journal_and_a_lost_disk() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "rb-lost", 2).await;
    let mut d = node(&s, &proxy, "10m");
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        format!("{cfg}\n[journal]\nmax_file_size_mib = 1\nkeep_files = 0\n"),
    )
    .unwrap();
    fault_until_rebooted(&mut d).await;
    assert_eq!(
        proxy.count_with("CreateTags", "gpu-medic%3Areboots"),
        1,
        "the tag set before the call"
    );
    boot(&mut d, "boot-2");
    let inc = d.wait_closed(1, Duration::from_secs(30));
    assert_eq!(inc["state"], "repaired", "{inc:#}");
    d.stop(Duration::from_secs(30));
    let ledger = std::fs::read_to_string(d.path("state/reboots.json")).unwrap();
    assert!(ledger.contains("\"boot_after\": \"boot-2\""), "{ledger}");

    // Padded past its cap: the next start's first commit rotates the journal, and with
    // keep_files = 0 the rotated file (the reboot's records) is deleted.
    let journal = d.path("state/incidents.jsonl");
    let mut pad = std::fs::OpenOptions::new()
        .append(true)
        .open(&journal)
        .unwrap();
    let summary = "x".repeat(1000);
    for i in 0..1200 {
        use std::io::Write;
        writeln!(
            pad,
            r#"{{"at":"2026-12-01T00:00:00.000Z","incident":{},"event":"closed","state":"logged","summary":"{summary}"}}"#,
            100 + i
        )
        .unwrap();
    }
    drop(pad);
    start(&mut d);
    d.stop(Duration::from_secs(30));
    let left = std::fs::read_to_string(&journal).unwrap_or_default();
    assert!(
        !left.contains("xid-fallen-off-bus") && !d.path("state/incidents.jsonl.1").exists(),
        "the reboot's records were rotated away"
    );
    std::fs::remove_file(d.path("state/state.json")).unwrap();
    start(&mut d);
    assert!(
        state(&d)["repair"]["history"][0]["boot_after"] == "boot-2",
        "the ledger gave the reboot back: {:#}",
        state(&d)["repair"]
    );
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    let replaced = |d: &Daemon| {
        let st = state(d);
        async move { st["remediation"]["goal"] == "replace" }
    };
    wait_for("the second fault replaced", Duration::from_secs(30), || {
        replaced(&d)
    })
    .await;
    let why: Vec<String> = d
        .records()
        .iter()
        .filter(|r| r["event"] == "escalated")
        .map(|r| format!("{}: {}", r["rule"], r["reason"]))
        .collect();
    assert!(
        why.iter()
            .any(|w| w.contains("reboot-ladder") && w.contains("allows 1 reboot")),
        "{why:#?}"
    );
    d.stop(Duration::from_secs(30));
    assert_eq!(reboots(&proxy, &s), 1, "no second reboot");

    // A new disk: nothing under state_dir. The tag still counts the reboot.
    std::fs::remove_dir_all(d.path("state")).unwrap();
    boot(&mut d, "boot-3");
    wait_for("the tag read at start", Duration::from_secs(30), || {
        let st = state(&d);
        async move { st["repair"]["history"][0]["result"] == "unknown" }
    })
    .await;
    assert!(proxy.count("DescribeTags") >= 1);
    d.wait_polled();
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    wait_for(
        "the fault after the lost disk replaced",
        Duration::from_secs(30),
        || replaced(&d),
    )
    .await;
    d.stop(Duration::from_secs(30));
    assert_eq!(
        reboots(&proxy, &s),
        1,
        "no second reboot after the lost disk"
    );
}
