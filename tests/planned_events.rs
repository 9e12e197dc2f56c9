//! AWS's own disruptions seen ahead, through the real `gpu-medic run` binary
//! (docs/planned-events.md). IMDS is the kit's fake (IMDS cannot exist off EC2): it serves
//! `events/maintenance/scheduled`, `spot/instance-action` and
//! `events/recommendations/rebalance` and the tests change them over time (posted,
//! rescheduled, canceled, completed). ECS and Auto Scaling are moto behind the kit's recording
//! proxy; moto 5.2.5 has no `healthStatus` in DescribeContainerInstances answers, so the
//! proxy adds it (the ECS agent's verdict: the one double here besides IMDS). Durations are
//! configured short (a lead of seconds) so the rules run in seconds; the same rules are proven
//! in virtual time in `crates/core/src/engine/planned.rs`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_config::SdkConfig;
use gpu_medic_testkit::aws::{self, Proxy, Seeded};
use gpu_medic_testkit::imds::FakeImds;
use gpu_medic_testkit::proxy::{gpu_device, health_status};
use gpu_medic_testkit::{
    Daemon, FOUR_GPUS, default_policy, fake_nvml, wait_for, wait_looks_async, wait_sync,
};
use serde_json::Value;

const SCHEDULED: &str = "events/maintenance/scheduled";
const SPOT: &str = "spot/instance-action";
const REBALANCE: &str = "events/recommendations/rebalance";

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A time `secs` from now as IMDS writes scheduled events' times: `21 Jan 2019 09:00:43 GMT`.
fn imds_time(secs: i64) -> String {
    let t = (unix_now() as i64 + secs) as u64;
    let (days, rem) = ((t / 86_400) as i64, t % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    const M: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    format!(
        "{d} {} {y} {:02}:{:02}:{:02} GMT",
        M[(m - 1) as usize],
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// A time `secs` from now in RFC 3339 (Spot, rebalance).
fn rfc3339(secs: u64) -> String {
    humantime::format_rfc3339_seconds(UNIX_EPOCH + Duration::from_secs(unix_now() + secs))
        .to_string()
}

fn scheduled(id: &str, code: &str, state: &str, nb: &str, na: &str) -> String {
    format!(
        r#"[{{"NotBefore":"{nb}","Code":"{code}","Description":"test event","EventId":"{id}","NotAfter":"{na}","State":"{state}"}}]"#
    )
}

struct Node {
    proxy: Proxy,
    sdk: SdkConfig,
    s: Seeded,
    imds: FakeImds,
    d: Daemon,
}

/// Node 0 of a 2-instance group, no GPUs or MPS: ECS and Auto Scaling through the proxy,
/// IMDS at the fake; `planned`: extra `[planned]` lines (the lead is 10 s unless given).
async fn node(name: &str, planned: &str) -> Node {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, name, 2).await;
    let imds = FakeImds::start(&s.nodes[0].instance_id).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("boot_id"), "boot-1\n").unwrap();
    let lead = if planned.contains("lead") {
        ""
    } else {
        "lead = \"10s\"\n"
    };
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nenabled = false\n[mps]\nenabled = false\n[node]\nenabled = false\n\
         {}\
         [ecs]\ndrain_poll_interval = \"200ms\"\nagent_wait = \"100ms\"\n\
         [fleet]\nwarmup = \"0s\"\nclaim_settle = \"100ms\"\nretry_after = \"300ms\"\n\
         [lifecycle]\npoll_interval = \"200ms\"\n\
         [repair]\nboot_id_path = \"{}\"\n\
         [planned]\npoll_interval = \"200ms\"\n{lead}{planned}\n",
        default_policy().display(),
        aws::sections(&s, 0, ""),
        dir.path().join("boot_id").display(),
    );
    let mut d = Daemon::in_temp(dir, &config);
    d.aws(Some(&proxy.url))
        .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.url);
    Node {
        proxy,
        sdk,
        s,
        imds,
        d,
    }
}

impl Node {
    fn arn(&self) -> &str {
        &self.s.nodes[0].arn
    }

    async fn ecs_status(&self) -> String {
        aws::instance(&self.sdk, &self.s.cluster, self.arn())
            .await
            .0
    }

    async fn health_attr(&self) -> Option<String> {
        aws::instance(&self.sdk, &self.s.cluster, self.arn())
            .await
            .2
            .into_iter()
            .find(|(k, _)| k == "gpu-medic.health")
            .and_then(|(_, v)| v)
    }

    async fn wait_status(&self, want: &str, limit: Duration) {
        wait_for(want, limit, || async { self.ecs_status().await == want }).await;
    }

    /// Waits until the daemon has read the IMDS document at `path` `n` more times (its
    /// planned-events poll, every 200 ms here): "many polls later", counted.
    async fn wait_reads(&self, path: &str, n: usize) {
        wait_looks_async(&format!("reads of {path}"), n, || {
            self.imds.reads(path).len()
        })
        .await;
    }

    fn status(&self) -> String {
        String::from_utf8_lossy(&self.d.cli(&["status"]).stdout).to_string()
    }

    fn notes(&self, id: u32) -> String {
        self.d.incident(id)["records"]
            .as_array()
            .map(|r| {
                r.iter()
                    .filter_map(|x| x["text"].as_str().map(str::to_string))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default()
    }

    fn started(&self) -> usize {
        self.d
            .records()
            .iter()
            .filter(|r| r["event"] == "action-started")
            .count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retirement_drains_at_the_lead_and_is_replaced_before_not_before() {
    // NotBefore 20 s ahead, lead 10 s: the drain starts 10 s from now.
    let mut n = node("pl-retire", "").await;
    let nb = unix_now() + 20;
    n.imds.set_doc(
        SCHEDULED,
        Some(&scheduled(
            "instance-event-1",
            "instance-retirement",
            "active",
            &imds_time(20),
            &imds_time(620),
        )),
    );
    n.d.start();
    wait_sync(
        "the plan",
        Duration::from_secs(10),
        || n.status().contains("drain starts at"),
        || n.status(),
    );
    let status = n.status();
    assert!(
        status.contains("instance-retirement instance-event-1 (active)"),
        "{status}"
    );
    assert!(
        status.contains("then Auto Scaling replaces the instance"),
        "{status}"
    );
    // Before the lead: still in service, the event read again and again (a drain before the
    // lead also fails `drained_at` below).
    n.wait_reads(SCHEDULED, 5).await;
    assert!(unix_now() + 10 < nb, "the lead came before the check");
    assert_eq!(n.ecs_status().await, "ACTIVE", "{}", n.d.log());
    n.wait_status("DRAINING", Duration::from_secs(15)).await;
    let drained_at = unix_now();
    assert!(drained_at + 2 >= nb - 10, "not before the lead");
    let inc = n.d.wait_closed(1, Duration::from_secs(20));
    assert!(unix_now() < nb, "replaced before NotBefore");
    assert_eq!(inc["state"], "replaced", "{inc:#}");
    assert_eq!(inc["rule"], "planned-instance-retirement", "{inc:#}");
    assert!(
        inc["signal"]
            .as_str()
            .unwrap()
            .starts_with("maintenance-event instance-retirement"),
        "{inc:#}"
    );
    assert!(
        inc["summary"]
            .as_str()
            .unwrap()
            .contains("before AWS stops it"),
        "{inc:#}"
    );
    let health = aws::asg_health(&n.sdk, &n.s.asg).await;
    assert!(
        health.contains(&(n.s.nodes[0].instance_id.clone(), "Unhealthy".into())),
        "{health:?}"
    );
    // The planned drain took no fleet-budget claim.
    assert_eq!(n.proxy.count_with("PutAttributes", "claim"), 0);
    n.d.stop(Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_reboot_then_completed_after_a_new_boot_is_back_in_service() {
    let mut n = node("pl-reboot", "").await;
    let (nb, na) = (imds_time(5), imds_time(600));
    n.imds.set_doc(
        SCHEDULED,
        Some(&scheduled(
            "instance-event-2",
            "system-reboot",
            "active",
            &nb,
            &na,
        )),
    );
    n.d.start();
    n.wait_status("DRAINING", Duration::from_secs(15)).await;
    wait_sync(
        "drained ahead",
        Duration::from_secs(15),
        || n.status().contains("drained; back in service"),
        || n.status(),
    );
    assert!(
        n.d.incident(1)["closed_at"].is_null(),
        "open until the reboot is over"
    );
    // AWS completes the event but this is the same boot: the instance stays out.
    n.imds.set_doc(
        SCHEDULED,
        Some(&scheduled(
            "instance-event-2",
            "system-reboot",
            "completed",
            &nb,
            &na,
        )),
    );
    wait_sync(
        "the same boot noted",
        Duration::from_secs(10),
        || n.notes(1).contains("same boot id"),
        || n.notes(1),
    );
    assert_eq!(n.ecs_status().await, "DRAINING");
    // The reboot: gpu-medic stops, the boot id changes, gpu-medic starts again.
    n.d.stop(Duration::from_secs(20));
    std::fs::write(n.d.path("boot_id"), "boot-2\n").unwrap();
    n.d.start();
    let inc = n.d.wait_closed(1, Duration::from_secs(20));
    assert_eq!(inc["state"], "resolved", "{inc:#}");
    assert!(
        inc["summary"]
            .as_str()
            .unwrap()
            .contains("rebooted (new boot id)"),
        "{inc:#}"
    );
    assert_eq!(n.ecs_status().await, "ACTIVE");
    assert_eq!(n.health_attr().await.as_deref(), Some("ok"));
    n.d.stop(Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spot_notice_stops_a_standalone_task_before_the_deadline() {
    let mut n = node("pl-spot", "").await;
    let task = aws::start_task(&n.sdk, &n.s, &n.s.nodes[0].arn.clone(), None).await;
    n.d.start();
    let deadline = unix_now() + 40;
    n.imds.set_doc(
        SPOT,
        Some(&format!(
            r#"{{"action":"terminate","time":"{}"}}"#,
            rfc3339(40)
        )),
    );
    n.wait_status("DRAINING", Duration::from_secs(15)).await;
    wait_for(
        "the standalone task stopped",
        Duration::from_secs(30),
        || async { aws::task_desired(&n.sdk, &n.s.cluster, &task).await == "STOPPED" },
    )
    .await;
    assert!(unix_now() < deadline, "stopped before the interruption");
    let inc = n.d.wait_closed(1, Duration::from_secs(30));
    assert_eq!(inc["rule"], "planned-spot-interruption", "{inc:#}");
    assert_eq!(inc["state"], "drained", "{inc:#}");
    assert!(
        inc["summary"]
            .as_str()
            .unwrap()
            .contains("AWS reclaims the instance"),
        "{inc:#}"
    );
    // The notice is no longer listed and the instance still runs (a Spot stop it came back
    // from): spot-notice-gone, and the instance drained for it returns to service.
    n.imds.set_doc(SPOT, None);
    n.wait_status("ACTIVE", Duration::from_secs(20)).await;
    assert_eq!(n.health_attr().await.as_deref(), Some("ok"));
    let signals: Vec<Value> =
        n.d.records()
            .into_iter()
            .filter(|r| r["observation"]["signal"]["kind"] == "spot-notice-gone")
            .collect();
    assert_eq!(signals.len(), 1, "{:#?}", n.d.records());
    n.d.stop(Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_canceled_event_is_undone() {
    // Lead 5 m, NotBefore 4 m ahead: the drain starts at once and has minutes to run.
    let mut n = node("pl-cancel", "lead = \"5m\"").await;
    // A service task keeps the drain running (moto does not play the scheduler).
    let arn = n.s.nodes[0].arn.clone();
    aws::start_task(&n.sdk, &n.s, &arn, Some("service:web")).await;
    let (nb, na) = (imds_time(240), imds_time(600));
    n.imds.set_doc(
        SCHEDULED,
        Some(&scheduled(
            "instance-event-3",
            "instance-stop",
            "active",
            &nb,
            &na,
        )),
    );
    n.d.start();
    n.wait_status("DRAINING", Duration::from_secs(15)).await;
    assert_eq!(n.health_attr().await.as_deref(), Some("faulted"));
    n.imds.set_doc(
        SCHEDULED,
        Some(&scheduled(
            "instance-event-3",
            "instance-stop",
            "canceled",
            &nb,
            &na,
        )),
    );
    let inc = n.d.wait_closed(1, Duration::from_secs(20));
    assert_eq!(inc["state"], "resolved", "{inc:#}");
    assert!(
        inc["summary"].as_str().unwrap().contains("AWS canceled"),
        "{inc:#}"
    );
    assert_eq!(n.ecs_status().await, "ACTIVE");
    assert_eq!(n.health_attr().await.as_deref(), Some("ok"));
    n.d.stop(Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_is_logged_by_default_and_drained_when_configured() {
    let doc = format!(r#"{{"noticeTime":"{}"}}"#, rfc3339(0));
    let mut n = node("pl-rebal-log", "").await;
    n.imds.set_doc(REBALANCE, Some(&doc));
    n.d.start();
    let inc = n.d.wait_closed(1, Duration::from_secs(15));
    assert_eq!(inc["state"], "logged", "{inc:#}");
    assert_eq!(inc["rule"], "planned-rebalance-recommendation", "{inc:#}");
    n.wait_reads(REBALANCE, 5).await;
    assert_eq!(n.ecs_status().await, "ACTIVE");
    assert_eq!(n.started(), 0);
    n.d.stop(Duration::from_secs(20));

    let mut n = node("pl-rebal-drain", "rebalance = \"drain\"").await;
    n.imds.set_doc(REBALANCE, Some(&doc));
    n.d.start();
    n.wait_status("DRAINING", Duration::from_secs(15)).await;
    // Within the fleet budget: a claim was taken.
    assert!(n.proxy.count_with("PutAttributes", "claim") >= 1);
    n.d.stop(Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imds_trouble_and_past_events_decide_nothing() {
    let mut n = node("pl-trouble", "").await;
    n.imds.set_down(true);
    n.d.start();
    wait_sync(
        "a warning for IMDS down",
        Duration::from_secs(10),
        || {
            n.d.log()
                .contains("planned-events poll backs off (planned disruptions")
        },
        || n.d.log(),
    );
    n.imds.set_down(false);
    n.imds
        .set_doc(SCHEDULED, Some("[{\"Code\": \"system-reboot\", oops"));
    wait_sync(
        "a warning for malformed JSON",
        Duration::from_secs(10),
        || n.d.log().contains("not the JSON IMDS documents"),
        || n.d.log(),
    );
    let big = format!("[{}]", " ".repeat(10 * 1024 * 1024));
    n.imds.set_doc(SCHEDULED, Some(&big));
    wait_sync(
        "a warning for 10 MB",
        Duration::from_secs(20),
        || n.d.log().contains("exceeds [planned] max_document"),
        || n.d.log(),
    );
    n.imds.set_doc(
        SCHEDULED,
        Some(&scheduled(
            "instance-event-4",
            "instance-retirement",
            "active",
            &imds_time(-7200),
            &imds_time(-3600),
        )),
    );
    let inc = n.d.wait_closed(1, Duration::from_secs(15));
    assert_eq!(inc["state"], "logged", "{inc:#}");
    assert!(
        inc["reason"]
            .as_str()
            .unwrap()
            .contains("an event in the past"),
        "{inc:#}"
    );
    assert!(
        n.d.log()
            .contains("an event in the past, nothing is drained")
    );
    n.wait_reads(SCHEDULED, 5).await;
    assert_eq!(n.ecs_status().await, "ACTIVE");
    assert_eq!(n.started(), 0, "nothing was ordered");
    n.d.stop(Duration::from_secs(20));
}

/// Implausible notices are not notices: a Spot interruption dated years ahead, a scheduled
/// event whose window is fifty years long and one scheduled decades ahead are each a logged
/// incident that says why (docs/planned-events.md#plausible-notices); nothing is drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn implausible_notices_are_logged_and_drain_nothing() {
    let mut n = node("pl-implausible", "").await;
    n.d.start();
    let years = 3 * 365 * 24 * 3600;
    n.imds.set_doc(
        SPOT,
        Some(&format!(
            r#"{{"action": "terminate", "time": "{}"}}"#,
            rfc3339(years)
        )),
    );
    let inc = n.d.wait_closed(1, Duration::from_secs(15));
    assert_eq!(inc["state"], "logged", "{inc:#}");
    assert!(
        inc["reason"]
            .as_str()
            .unwrap()
            .contains("implausible notice"),
        "{inc:#}"
    );
    n.imds.set_doc(SPOT, None);
    let not_before = unix_now() + 20;
    n.imds.set_doc(
        SCHEDULED,
        Some(&format!(
            "[{}, {}]",
            scheduled(
                "instance-event-50y",
                "system-maintenance",
                "active",
                &imds_time(20),
                &imds_time(50 * 365 * 24 * 3600),
            )
            .trim_matches(|c| c == '[' || c == ']'),
            scheduled(
                "instance-event-far",
                "instance-retirement",
                "active",
                &imds_time(30 * 365 * 24 * 3600),
                &imds_time(30 * 365 * 24 * 3600 + 3600),
            )
            .trim_matches(|c| c == '[' || c == ']'),
        )),
    );
    wait_sync(
        "both events logged",
        Duration::from_secs(15),
        || {
            n.d.records()
                .iter()
                .filter(|r| {
                    r["event"] == "closed"
                        && r["summary"]
                            .as_str()
                            .is_some_and(|t| t.contains("implausible notice"))
                })
                .count()
                >= 3
        },
        || n.d.log(),
    );
    // Past NotBefore of the 50-year window (wall time: the rule looks at the clock), and read
    // again after it: still nothing drained.
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    tokio::time::sleep(Duration::from_secs(not_before + 1).saturating_sub(now)).await;
    n.wait_reads(SCHEDULED, 5).await;
    assert_eq!(n.ecs_status().await, "ACTIVE");
    assert_eq!(n.started(), 0, "nothing was ordered: {:#?}", n.d.records());
    n.d.stop(Duration::from_secs(20));
}

/// A node on the fake GPUs with the ECS GPU view on (it reads `healthStatus`), observe-only.
async fn gpu_node(name: &str) -> (Proxy, Seeded, FakeImds, Daemon) {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, name, 1).await;
    let uuids = [
        "GPU-00000000-aaaa-bbbb-cccc-000000000000",
        "GPU-11111111-aaaa-bbbb-cccc-111111111111",
        "GPU-22222222-aaaa-bbbb-cccc-222222222222",
        "GPU-33333333-aaaa-bbbb-cccc-333333333333",
    ];
    proxy.gpu_devices(
        &s.nodes[0].arn,
        uuids
            .iter()
            .map(|u| gpu_device(u, "IDLE", 143_771, 143_771, 0))
            .collect(),
    );
    let imds = FakeImds::start(&s.nodes[0].instance_id).await;
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\ndry_run = true\n\
         [nvml]\nlibrary = \"{}\"\npoll_interval = \"200ms\"\nkmsg = \"{}\"\n\
         [mps]\nenabled = false\n[node]\nenabled = false\n[lifecycle]\nenabled = false\n\
         [planned]\nenabled = false\n\
         [ecs]\ngpu_view_interval = \"500ms\"\nagent_wait = \"0s\"\n{}",
        default_policy().display(),
        fake_nvml().display(),
        dir.path().join("kmsg").display(),
        aws::sections(&s, 0, ""),
    );
    let mut d = Daemon::in_temp(dir, &config);
    d.aws(Some(&proxy.url))
        .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.url);
    d.gpus(FOUR_GPUS);
    (proxy, s, imds, d)
}

fn texts(inc: &Value) -> String {
    inc["records"]
        .as_array()
        .map(|r| {
            r.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_impaired_alone_is_logged_and_shown_and_drains_nothing() {
    let (proxy, s, _imds, mut d) = gpu_node("pl-agent-alone").await;
    // moto has no healthStatus: the proxy adds the agent's verdict.
    proxy.health_status(&s.nodes[0].arn, Some(health_status("IMPAIRED", "IMPAIRED")));
    d.start();
    let inc = d.wait_closed(1, Duration::from_secs(20));
    assert_eq!(inc["rule"], "ecs-agent-impaired", "{inc:#}");
    assert_eq!(inc["state"], "logged", "{inc:#}");
    let status = String::from_utf8_lossy(&d.cli(&["status"]).stdout).to_string();
    assert!(
        status.contains("ecs agent:   ACCELERATED_COMPUTE IMPAIRED")
            && status.contains("gpu-medic: no GPU fault"),
        "{status}"
    );
    assert!(
        d.records().iter().all(|r| r["event"] != "action-started"),
        "no order, not even a dry one"
    );
    assert!(
        proxy.count_with("DescribeContainerInstances", "CONTAINER_INSTANCE_HEALTH") >= 1,
        "the GPU view's call asks for the health"
    );
    d.stop(Duration::from_secs(20));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_impaired_with_an_xid_shows_both_verdicts() {
    let (proxy, s, _imds, mut d) = gpu_node("pl-agent-xid").await;
    proxy.health_status(&s.nodes[0].arn, Some(health_status("IMPAIRED", "IMPAIRED")));
    d.start();
    d.wait_closed(1, Duration::from_secs(20));
    d.inject(r#"{"gpu": 0, "xid": 79}"#);
    let xid = (2..6).map(|i| d.incident(i)).find(|x| {
        x["signal"]
            .as_str()
            .is_some_and(|s| s.starts_with("xid 79"))
    });
    let xid = match xid {
        Some(x) => x,
        None => {
            wait_sync(
                "an XID incident",
                Duration::from_secs(20),
                || {
                    (2..6).any(|i| {
                        d.incident(i)["signal"]
                            .as_str()
                            .is_some_and(|s| s.starts_with("xid 79"))
                    })
                },
                || d.log(),
            );
            (2..6)
                .map(|i| d.incident(i))
                .find(|x| {
                    x["signal"]
                        .as_str()
                        .is_some_and(|s| s.starts_with("xid 79"))
                })
                .unwrap()
        }
    };
    let t = texts(&xid);
    assert!(
        t.contains("the ECS agent's own: ACCELERATED_COMPUTE IMPAIRED"),
        "{t}"
    );
    d.stop(Duration::from_secs(20));
}

/// Caps before parsing: a 64 MiB lifecycle answer from IMDS and a 10 MB scheduled-events
/// document of whitespace around a valid event are refused as they are read; the daemon's
/// memory stays small, no log line carries them, nothing is drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imds_answers_are_capped_as_they_are_read() {
    let mut n = node("pl-caps", "").await;
    n.d.start();
    n.imds.set_target(Some(&"T".repeat(64 << 20)));
    let event = scheduled(
        "instance-event-big",
        "instance-retirement",
        "active",
        &imds_time(5),
        &imds_time(3600),
    );
    n.imds
        .set_doc(SCHEDULED, Some(&format!("{event}{}", " ".repeat(10 << 20))));
    wait_sync(
        "the oversized document refused",
        Duration::from_secs(20),
        || n.d.log().contains("exceeds [planned] max_document"),
        || n.d.log(),
    );
    // Both read again several times: the peak is of many reads, not one.
    n.wait_reads(SCHEDULED, 5).await;
    wait_looks_async("64 MiB lifecycle answers", 5, || {
        n.imds.target_reads().len()
    })
    .await;
    let pid = n.d.pid().unwrap();
    let hwm_kib = gpu_medic_testkit::proc::status_field(pid, "VmHWM").unwrap();
    n.d.stop(Duration::from_secs(20));
    assert!(hwm_kib < 120 * 1024, "peak memory {hwm_kib} KiB");
    let longest = n.d.log().lines().map(str::len).max().unwrap_or(0);
    assert!(longest < 16 * 1024, "a log line of {longest} bytes");
    assert_eq!(n.started(), 0, "nothing was ordered");
    assert!(
        !n.d.records()
            .iter()
            .any(|r| r["observation"]["signal"]["kind"] == "maintenance-event"),
        "the oversized document decided nothing"
    );
}
