//! Auto Scaling terminating the instance, through the real `gpu-medic run` binary: the fake
//! IMDS flips `autoscaling/target-lifecycle-state` to `Terminated`; gpu-medic drains the
//! container instance (ECS: moto, through `AWS_ENDPOINT_URL_ECS`), heartbeats our terminate
//! hook and completes it with CONTINUE (Auto Scaling: a proxy in front of moto that answers
//! the two lifecycle actions moto lacks, through `AWS_ENDPOINT_URL_AUTO_SCALING`).
//! `[aws] endpoint_url` is unset: the per-service variables are what routes the calls.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::{Duration, Instant};

use aws_config::SdkConfig;
use gpu_medic_testkit::aws::{self, Fault, Proxy, Seeded};
use gpu_medic_testkit::imds::FakeImds;
use gpu_medic_testkit::journal::{finished_details, request_ids};
use gpu_medic_testkit::{Daemon, default_policy, wait_for};

const OUR_HOOK: &str = "gpu-medic-terminate";
const ECS_HOOK: &str = "ecs-managed-draining-termination-hook";

/// Node 0 of `s` without GPUs or MPS: ECS at moto, Auto Scaling through `proxy`, IMDS at
/// `imds`; `ecs`: extra `[ecs]` lines.
fn daemon(s: &Seeded, proxy: &Proxy, imds: &FakeImds, ecs: &str) -> Daemon {
    let n = &s.nodes[0];
    let mut d = Daemon::new(&format!(
        "state_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nenabled = false\n[mps]\nenabled = false\n\
         [identity]\ncluster = \"{}\"\ncontainer_instance_arn = \"{}\"\nauto_scaling_group = \"{}\"\n\
         [ecs]\ndrain_poll_interval = \"200ms\"\nagent_wait = \"100ms\"\n{ecs}\n\
         [fleet]\nwarmup = \"0s\"\nclaim_settle = \"100ms\"\nretry_after = \"300ms\"\n\
         [lifecycle]\npoll_interval = \"200ms\"\n",
        default_policy().display(),
        s.cluster,
        n.arn,
        s.asg,
    ));
    d.aws(None)
        .env("AWS_ENDPOINT_URL_ECS", &aws::moto().url)
        .env("AWS_ENDPOINT_URL_AUTO_SCALING", &proxy.url)
        .env("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.url);
    d
}

async fn put_hook(sdk: &SdkConfig, group: &str, name: &str, heartbeat_timeout: i32) {
    let transition = "autoscaling:EC2_INSTANCE_TERMINATING";
    aws::put_hook(sdk, group, name, transition, heartbeat_timeout, "CONTINUE").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn termination_drains_heartbeats_and_completes_only_our_hook() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-term", 2).await;
    let me = &s.nodes[0];
    // 3 s heartbeat timeout: a heartbeat every second.
    put_hook(&sdk, &s.asg, OUR_HOOK, 3).await;
    put_hook(&sdk, &s.asg, ECS_HOOK, 300).await;
    proxy.lifecycle_wait(OUR_HOOK, &me.instance_id);
    proxy.lifecycle_wait(ECS_HOOK, &me.instance_id);
    let service = aws::start_task(&sdk, &s, &me.arn, Some("service:web")).await;
    let imds = FakeImds::start(&me.instance_id).await;
    imds.set_target(Some("InService"));

    let mut d = daemon(&s, &proxy, &imds, "");
    d.start();
    wait_for("IMDS polls", Duration::from_secs(10), || {
        let n = imds.target_reads().len();
        async move { n >= 3 }
    })
    .await;
    assert_eq!(aws::instance(&sdk, &s.cluster, &me.arn).await.0, "ACTIVE");
    assert!(d.incident(1).is_null(), "InService decides nothing");

    let t0 = Instant::now();
    imds.set_target(Some("Terminated"));
    wait_for("DRAINING", Duration::from_secs(15), || async {
        aws::instance(&sdk, &s.cluster, &me.arn).await.0 == "DRAINING"
    })
    .await;
    wait_for("two heartbeats", Duration::from_secs(10), || {
        let n = proxy.count_with("RecordLifecycleActionHeartbeat", OUR_HOOK);
        async move { n >= 2 }
    })
    .await;
    // The ECS scheduler, played: the service task moves elsewhere.
    aws::stop(&sdk, &s.cluster, &service).await;
    let inc = d.wait_closed(1, Duration::from_secs(20));
    let took = t0.elapsed();
    d.stop(Duration::from_secs(30));

    assert_eq!(inc["state"], "terminated", "{inc:#}");
    assert_eq!(inc["signal"], "lifecycle Terminating", "{inc:#}");
    assert_eq!(
        proxy.count_with(
            "CompleteLifecycleAction",
            &format!("LifecycleHookName={OUR_HOOK}")
        ),
        1
    );
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=CONTINUE"),
        1
    );
    // ECS's own hook: never heartbeated, never completed, still waiting.
    assert_eq!(proxy.count_with("CompleteLifecycleAction", ECS_HOOK), 0);
    assert_eq!(
        proxy.count_with("RecordLifecycleActionHeartbeat", ECS_HOOK),
        0
    );
    assert_eq!(
        proxy.lifecycle_waiting(),
        [(ECS_HOOK.to_string(), me.instance_id.clone())]
    );
    let details = finished_details(&inc).join("\n");
    assert!(
        details.contains("drained: no task left")
            && details.contains("heartbeat(s) for lifecycle hook gpu-medic-terminate (every 1s)"),
        "{details}"
    );
    assert!(
        details.contains("lifecycle hook gpu-medic-terminate completed with CONTINUE"),
        "{details}"
    );
    assert!(
        request_ids(&inc, "RecordLifecycleActionHeartbeat").len() >= 2,
        "{inc:#}"
    );
    assert_eq!(
        request_ids(&inc, "CompleteLifecycleAction").len(),
        1,
        "{inc:#}"
    );
    assert!(!request_ids(&inc, "UpdateContainerInstancesState").is_empty());
    // A terminating instance drains without a fleet-budget claim.
    let (_, _, attrs) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert!(
        !attrs.iter().any(|(n, _)| n.contains(".claim.")),
        "{attrs:?}"
    );
    // ECS went to moto directly (AWS_ENDPOINT_URL_ECS), Auto Scaling through the proxy.
    for op in ["UpdateContainerInstancesState", "ListTasks"] {
        assert_eq!(
            proxy.count(op),
            0,
            "{op} went through the Auto Scaling endpoint"
        );
    }
    assert!(proxy.count("DescribeLifecycleHooks") >= 1);
    assert!(took < Duration::from_secs(20), "{took:?}");
    assert!(!d.log().contains("\"level\":\"ERROR\""), "{}", d.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn imds_outage_decides_nothing_and_a_gone_action_is_success() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-gone", 1).await;
    let me = &s.nodes[0];
    put_hook(&sdk, &s.asg, OUR_HOOK, 3).await;
    // Someone (an operator, a timeout) already ended the action: nothing waits.
    proxy.lifecycle_simulate();
    let imds = FakeImds::start(&me.instance_id).await;
    imds.set_down(true);

    let mut d = daemon(&s, &proxy, &imds, "");
    d.start();
    // The daemon has asked IMDS several times while it was down, and its probe has given up
    // on one turn and said so: facts, not a pause (the IMDS client's own retries refuse
    // several reads within one turn, before the probe sees the error).
    wait_for(
        "IMDS refusing three reads and the probe's warning",
        Duration::from_secs(20),
        || async { imds.refused() >= 3 && d.log().contains("retrying with backoff") },
    )
    .await;
    assert!(d.incident(1).is_null(), "an IMDS outage decides nothing");
    assert_eq!(aws::instance(&sdk, &s.cluster, &me.arn).await.0, "ACTIVE");
    imds.set_down(false);
    imds.set_target(Some("Terminated"));
    let inc = d.wait_closed(1, Duration::from_secs(20));
    d.stop(Duration::from_secs(30));

    assert_eq!(inc["state"], "terminated", "{inc:#}");
    let details = finished_details(&inc).join("\n");
    assert!(
        details.contains("no active lifecycle action for hook gpu-medic-terminate"),
        "{details}"
    );
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=CONTINUE"),
        1
    );
    assert!(imds.refused() >= 2, "IMDS was down: {}", imds.refused());
    let log = d.log();
    assert_eq!(
        log.matches("retrying with backoff").count(),
        1,
        "one warning per outage: {log}"
    );
    assert!(log.contains("IMDS answers again"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_outlasting_the_hook_is_completed_before_its_global_timeout() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-long", 1).await;
    let me = &s.nodes[0];
    proxy.lifecycle_wait(OUR_HOOK, &me.instance_id);
    // A hook that can wait 8 s in all (real hooks: min(48 h, 100 x heartbeat timeout)).
    proxy.fault(Fault::canned(
        "DescribeLifecycleHooks",
        1000,
        200,
        "text/xml",
        format!(
            "<DescribeLifecycleHooksResponse xmlns=\"http://autoscaling.amazonaws.com/doc/2011-01-01/\"><DescribeLifecycleHooksResult><LifecycleHooks><member><LifecycleHookName>{OUR_HOOK}</LifecycleHookName><AutoScalingGroupName>{}</AutoScalingGroupName><LifecycleTransition>autoscaling:EC2_INSTANCE_TERMINATING</LifecycleTransition><HeartbeatTimeout>3</HeartbeatTimeout><GlobalTimeout>8</GlobalTimeout><DefaultResult>CONTINUE</DefaultResult></member></LifecycleHooks></DescribeLifecycleHooksResult><ResponseMetadata><RequestId>hooks-1</RequestId></ResponseMetadata></DescribeLifecycleHooksResponse>",
            s.asg
        ),
    ));
    // A service task nobody moves (minimumHealthyPercent 100, no room elsewhere).
    let stuck = aws::start_task(&sdk, &s, &me.arn, Some("service:web")).await;
    let imds = FakeImds::start(&me.instance_id).await;
    imds.set_target(Some("InService"));
    let mut d = daemon(
        &s,
        &proxy,
        &imds,
        "standalone_grace = \"60s\"\nforce_stop_lead = \"2s\"",
    );
    d.start();
    let t0 = Instant::now();
    imds.set_target(Some("Terminated"));
    let inc = d.wait_closed(1, Duration::from_secs(15));
    let took = t0.elapsed();
    d.stop(Duration::from_secs(30));

    assert_eq!(inc["state"], "terminated", "{inc:#}");
    assert!(
        took < Duration::from_secs(8),
        "completed after {took:?}, past the hook's global timeout"
    );
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=CONTINUE"),
        1
    );
    assert!(proxy.lifecycle_waiting().is_empty());
    assert_eq!(
        aws::task_desired(&sdk, &s.cluster, &stuck).await,
        "STOPPED",
        "tasks still running are stopped before the hook runs out"
    );
    let details = finished_details(&inc).join("\n");
    assert!(details.contains("stopped at the deadline"), "{details}");
}

/// A drain already running (a replacement) when Auto Scaling starts terminating the instance
/// (moto never reports `Terminating:Wait`: the proxy does): the drain starts heartbeating our
/// hook and reports it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_termination_during_a_running_drain_starts_the_heartbeats() {
    use gpu_medic::model::Command;
    use gpu_medic::remedy::ControlPlane;
    use gpu_medic::remedy::aws::AwsControlPlane;

    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "lc-mid", 1).await;
    let me = s.nodes[0].instance_id.clone();
    put_hook(&sdk, &s.asg, OUR_HOOK, 3).await;
    proxy.lifecycle_wait(OUR_HOOK, &me);
    let service = aws::start_task(&sdk, &s, &s.nodes[0].arn, Some("service:web")).await;
    proxy.fault(Fault::canned(
        "DescribeAutoScalingInstances",
        1000,
        200,
        "text/xml",
        format!(
            "<DescribeAutoScalingInstancesResponse xmlns=\"http://autoscaling.amazonaws.com/doc/2011-01-01/\"><DescribeAutoScalingInstancesResult><AutoScalingInstances><member><InstanceId>{me}</InstanceId><AutoScalingGroupName>{}</AutoScalingGroupName><AvailabilityZone>us-east-1a</AvailabilityZone><LifecycleState>Terminating:Wait</LifecycleState><HealthStatus>HEALTHY</HealthStatus><ProtectedFromScaleIn>false</ProtectedFromScaleIn></member></AutoScalingInstances></DescribeAutoScalingInstancesResult><ResponseMetadata><RequestId>asi-1</RequestId></ResponseMetadata></DescribeAutoScalingInstancesResponse>",
            s.asg
        ),
    ));
    let cp = AwsControlPlane::new(&sdk, &aws::config(&s, 0, "", ""));
    let drain = tokio::spawn(async move {
        cp.drain(&aws::order(
            Command::Drain { terminating: false },
            Duration::from_secs(60),
        ))
        .await
    });
    wait_for("two heartbeats", Duration::from_secs(10), || {
        let n = proxy.count_with("RecordLifecycleActionHeartbeat", OUR_HOOK);
        async move { n >= 2 }
    })
    .await;
    aws::stop(&sdk, &s.cluster, &service).await;
    let d = drain.await.unwrap().unwrap();
    assert!(d.detail.contains("drained: no task left"), "{d:?}");
    assert!(
        d.detail
            .contains("heartbeat(s) for lifecycle hook gpu-medic-terminate (every 1s)"),
        "{d:?}"
    );
    assert!(
        d.request_ids
            .iter()
            .any(|r| r.starts_with("RecordLifecycleActionHeartbeat ")),
        "{d:?}"
    );
    assert_eq!(
        proxy.count("CompleteLifecycleAction"),
        0,
        "the engine's next step"
    );
}
