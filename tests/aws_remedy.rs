//! `AwsControlPlane` against moto 5.2.5 (one server for this binary, a recording and
//! fault-injecting proxy per test): the quarantine -> drain -> replace sequence with request
//! ids, stop-tasks, the fleet budget with simultaneous claims, the circuit breaker, the kill
//! switches, retries of throttling and 5xx, a drain resumed after a crash, and our lifecycle
//! hook. The tests play the ECS scheduler and Auto Scaling where moto does not.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use gpu_medic::model::{Command, GpuId, LifecycleHook, LifecycleResult};
use gpu_medic::remedy::aws::AwsControlPlane;
use gpu_medic::remedy::{ControlPlane, Done, RemedyError};
use gpu_medic_testkit::aws::{self, Fault, Proxy};

fn ids_of(d: &Done, op: &str) -> Vec<String> {
    d.request_ids
        .iter()
        .filter(|r| r.starts_with(&format!("{op} ")))
        .cloned()
        .collect()
}

fn has_request_id(d: &Done, op: &str) -> bool {
    ids_of(d, op)
        .iter()
        .any(|r| r.len() > op.len() + 10 && !r.contains("no request id"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fatal_fault_quarantines_drains_stops_tasks_and_replaces_in_order() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "flow", 3).await;
    let me = &s.nodes[0];
    let standalone = aws::start_task(&sdk, &s, &me.arn, None).await;
    let service = aws::start_task(&sdk, &s, &me.arn, Some("service:web")).await;
    let other = aws::start_task(&sdk, &s, &s.nodes[1].arn, None).await;
    let cp = AwsControlPlane::new(&sdk, &aws::config(&s, 0, "", ""));

    let q = cp
        .quarantine(&aws::order(Command::Quarantine, Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(has_request_id(&q, "PutAttributes"), "{q:?}");
    let (status, _, attrs) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert_eq!(status, "ACTIVE", "quarantine evicts nothing");
    assert!(attrs.contains(&("gpu-medic.health".into(), Some("faulted".into()))));

    // The ECS scheduler, played: once the instance drains, the service task is replaced.
    let scheduler = {
        let sdk = sdk.clone();
        let (cluster, arn, service) = (s.cluster.clone(), me.arn.clone(), service.clone());
        tokio::spawn(async move {
            loop {
                if aws::instance(&sdk, &cluster, &arn).await.0 == "DRAINING" {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    aws::stop(&sdk, &cluster, &service).await;
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let d = cp
        .drain(&aws::order(
            Command::Drain { terminating: false },
            Duration::from_secs(60),
        ))
        .await
        .unwrap();
    scheduler.await.unwrap();
    assert!(d.detail.contains("drained"), "{d:?}");
    assert!(d.detail.contains("1 standalone task(s) stopped"), "{d:?}");
    for op in ["PutAttributes", "UpdateContainerInstancesState", "StopTask"] {
        assert!(has_request_id(&d, op), "{op} missing in {d:?}");
    }
    assert_eq!(
        aws::task_desired(&sdk, &s.cluster, &standalone).await,
        "STOPPED"
    );
    assert_eq!(aws::task_desired(&sdk, &s.cluster, &other).await, "RUNNING");
    let (status, running, _) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert_eq!((status.as_str(), running), ("DRAINING", 0));

    let r = cp
        .replace(&aws::order(Command::Replace, Duration::from_secs(60)))
        .await
        .unwrap();
    assert!(has_request_id(&r, "SetInstanceHealth"), "{r:?}");
    let health = aws::asg_health(&sdk, &s.asg).await;
    for (iid, h) in &health {
        let want = if iid == &me.instance_id {
            "Unhealthy"
        } else {
            "Healthy"
        };
        assert_eq!(h, want, "{health:?}");
    }
    assert_eq!(
        aws::asg_instance_ids(&sdk, &s.asg).await.len(),
        3,
        "capacity kept"
    );

    // In that order: quarantine, claim, drain, the standalone stop, Unhealthy.
    let ops = proxy.ops();
    let pos = |op: &str| ops.iter().position(|o| o == op).unwrap();
    assert!(
        pos("PutAttributes") < pos("UpdateContainerInstancesState"),
        "{ops:?}"
    );
    assert!(
        pos("UpdateContainerInstancesState") < pos("StopTask"),
        "{ops:?}"
    );
    assert!(
        ops.iter().rposition(|o| o == "StopTask") < Some(pos("SetInstanceHealth")),
        "{ops:?}"
    );
    assert_eq!(proxy.count("UpdateContainerInstancesState"), 1);
    assert_eq!(proxy.count("TerminateInstanceInAutoScalingGroup"), 0);
    assert_eq!(
        proxy.count_with("SetInstanceHealth", "ShouldRespectGracePeriod=false"),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_tasks_stops_the_named_tasks_only() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "stop", 1).await;
    let a = aws::start_task(&sdk, &s, &s.nodes[0].arn, None).await;
    let b = aws::start_task(&sdk, &s, &s.nodes[0].arn, None).await;
    let cp = AwsControlPlane::new(&sdk, &aws::config(&s, 0, "", ""));
    let id = a.rsplit('/').next().unwrap().to_string();
    let d = cp
        .stop_tasks(&aws::order(
            Command::StopTasks {
                gpu: GpuId::index_only(0),
                pids: vec![4242],
                tasks: vec![id.clone()],
            },
            Duration::from_secs(30),
        ))
        .await
        .unwrap();
    assert!(d.detail.contains(&id), "{d:?}");
    assert!(has_request_id(&d, "StopTask"));
    assert_eq!(aws::task_desired(&sdk, &s.cluster, &a).await, "STOPPED");
    assert_eq!(aws::task_desired(&sdk, &s.cluster, &b).await, "RUNNING");
    // No task ids and no gpuIds (moto has none): nothing can be attributed.
    let e = cp
        .stop_tasks(&aws::order(
            Command::StopTasks {
                gpu: GpuId::index_only(1),
                pids: vec![4242],
                tasks: vec![],
            },
            Duration::from_secs(30),
        ))
        .await
        .unwrap_err();
    assert!(matches!(e, RemedyError::Fatal { .. }), "{e:?}");
    assert_eq!(aws::task_desired(&sdk, &s.cluster, &b).await, "RUNNING");
}

/// Ten instances fault at once with max_parallel = 2: never more than two drain or wait for
/// replacement at any moment; the others stay quarantined until Auto Scaling (played here)
/// replaces the finished ones and frees their slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budget_never_lets_more_than_two_of_ten_remediate() {
    let sdk = aws::sdk(&aws::moto().url).await;
    let s = Arc::new(aws::seed(&sdk, "budget", 10).await);
    for n in &s.nodes {
        aws::start_task(&sdk, &s, &n.arn, None).await;
    }
    let fleet = "max_parallel = 2\nmax_unhealthy = \"100%\"\n";
    let done = Arc::new(AtomicUsize::new(0));
    let deferrals = Arc::new(AtomicUsize::new(0));
    let mut nodes = Vec::new();
    for i in 0..10 {
        let cp = AwsControlPlane::new(&sdk, &aws::config(&s, i, "", fleet));
        let (done, deferrals) = (done.clone(), deferrals.clone());
        nodes.push(tokio::spawn(async move {
            cp.quarantine(&aws::order(Command::Quarantine, Duration::from_secs(30)))
                .await
                .unwrap();
            for cmd in [Command::Drain { terminating: false }, Command::Replace] {
                loop {
                    match drain_or_replace(&cp, &cmd).await {
                        Ok(_) => break,
                        Err(RemedyError::Deferred {
                            retry_after,
                            message,
                        }) => {
                            assert!(message.contains("fleet budget full"), "{message}");
                            deferrals.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(retry_after).await;
                        }
                        Err(e) => panic!("node {i}: {e:?}"),
                    }
                }
            }
            done.fetch_add(1, Ordering::Relaxed);
        }));
    }

    // Auto Scaling, played: an Unhealthy instance is terminated and its replacement joins ECS.
    // The monitor counts instances in remediation (DRAINING or Unhealthy, still in the group).
    let stop = Arc::new(AtomicBool::new(false));
    let monitor = {
        let (sdk, s, stop) = (sdk.clone(), s.clone(), stop.clone());
        tokio::spawn(async move {
            let asg = aws_sdk_autoscaling::Client::new(&sdk);
            let ecs = aws_sdk_ecs::Client::new(&sdk);
            let mut max_seen = 0;
            let mut replaced = 0;
            loop {
                let health = aws::asg_health(&sdk, &s.asg).await;
                if stop.load(Ordering::Relaxed) && health.iter().all(|(_, h)| h != "Unhealthy") {
                    break;
                }
                let arns = ecs
                    .list_container_instances()
                    .cluster(&s.cluster)
                    .send()
                    .await
                    .unwrap()
                    .container_instance_arns()
                    .to_vec();
                let cis = ecs
                    .describe_container_instances()
                    .cluster(&s.cluster)
                    .set_container_instances(Some(arns))
                    .send()
                    .await
                    .unwrap();
                let in_group = |iid: &str| health.iter().any(|(i, _)| i == iid);
                let mut busy: std::collections::BTreeSet<String> = cis
                    .container_instances()
                    .iter()
                    .filter(|c| c.status() == Some("DRAINING"))
                    .filter_map(|c| c.ec2_instance_id().map(str::to_string))
                    .filter(|i| in_group(i))
                    .collect();
                busy.extend(
                    health
                        .iter()
                        .filter(|(_, h)| h == "Unhealthy")
                        .map(|(i, _)| i.clone()),
                );
                max_seen = max_seen.max(busy.len());
                assert!(busy.len() <= 2, "more than 2 in remediation: {busy:?}");
                for (iid, h) in &health {
                    if h == "Unhealthy" {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        asg.terminate_instance_in_auto_scaling_group()
                            .instance_id(iid)
                            .should_decrement_desired_capacity(false)
                            .send()
                            .await
                            .unwrap();
                        replaced += 1;
                    }
                }
                let registered: Vec<String> = cis
                    .container_instances()
                    .iter()
                    .filter_map(|c| c.ec2_instance_id().map(str::to_string))
                    .collect();
                for iid in aws::asg_instance_ids(&sdk, &s.asg).await {
                    if !registered.contains(&iid) {
                        aws::register(&sdk, &s.cluster, &iid).await;
                    }
                }
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
            (max_seen, replaced)
        })
    };
    for n in nodes {
        tokio::time::timeout(Duration::from_secs(90), n)
            .await
            .expect("every node is remediated in time")
            .unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let (max_seen, replaced) = monitor.await.unwrap();
    assert_eq!(done.load(Ordering::Relaxed), 10);
    assert_eq!(replaced, 10);
    assert_eq!(max_seen, 2, "the budget is used, not just respected");
    assert!(deferrals.load(Ordering::Relaxed) >= 8, "the rest waited");
}

/// Drain or replace with a generous deadline (the budget test's nodes).
async fn drain_or_replace(cp: &AwsControlPlane, cmd: &Command) -> Result<Done, RemedyError> {
    let o = aws::order(cmd.clone(), Duration::from_secs(60));
    match cmd {
        Command::Drain { .. } => cp.drain(&o).await,
        _ => cp.replace(&o).await,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn circuit_breaker_keeps_faulted_instances_quarantined() {
    let sdk = aws::sdk(&aws::moto().url).await;
    let s = aws::seed(&sdk, "breaker", 10).await;
    // Three of ten quarantined (30% > 20%): perhaps a fleet-wide fault, not three bad
    // instances. The breaker holds them, but for the one repair it always lets through (the
    // lowest instance id, nothing else being in remediation): never none at all.
    for i in 0..3 {
        let cp = AwsControlPlane::new(&sdk, &aws::config(&s, i, "", ""));
        cp.quarantine(&aws::order(Command::Quarantine, Duration::from_secs(30)))
            .await
            .unwrap();
    }
    let first = (0..3)
        .min_by_key(|i| s.nodes[*i].instance_id.clone())
        .unwrap();
    let drain = |i: usize, extra: &'static str| {
        let cp = AwsControlPlane::new(&sdk, &aws::config(&s, i, "", extra));
        async move {
            cp.drain(&aws::order(
                Command::Drain { terminating: false },
                Duration::from_secs(30),
            ))
            .await
        }
    };
    for i in (0..3).filter(|i| *i != first) {
        let e = drain(i, "").await.unwrap_err();
        let RemedyError::Deferred { message, .. } = &e else {
            panic!("{e:?}")
        };
        assert!(
            message.contains("circuit breaker open: 3 of 10"),
            "{message}"
        );
    }
    for n in &s.nodes {
        let (status, _, attrs) = aws::instance(&sdk, &s.cluster, &n.arn).await;
        assert_eq!(status, "ACTIVE");
        assert!(
            !attrs.iter().any(|(n, _)| n.contains(".claim.")),
            "no claim left"
        );
    }
    // The first of the waiting goes ahead; then the others wait for it.
    drain(first, "").await.unwrap();
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[first].arn).await.0,
        "DRAINING"
    );
    let other = (0..3).find(|i| *i != first).unwrap();
    let e = drain(other, "").await.unwrap_err();
    assert!(matches!(e, RemedyError::Deferred { .. }), "{e:?}");
    // Configured higher, the breaker is closed: the budget (20 % of 10: two) decides.
    drain(other, "max_unhealthy = \"50%\"").await.unwrap();
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[other].arn).await.0,
        "DRAINING"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_switches_defer_drain_and_replace() {
    let sdk = aws::sdk(&aws::moto().url).await;
    let s = aws::seed(&sdk, "kill", 3).await;
    let asg = aws_sdk_autoscaling::Client::new(&sdk);
    let cp = AwsControlPlane::new(&sdk, &aws::config(&s, 0, "", ""));
    let deferred = |r: Result<Done, RemedyError>| match r {
        Err(RemedyError::Deferred { message, .. }) => message,
        other => panic!("expected a deferral, got {other:?}"),
    };

    asg.suspend_processes()
        .auto_scaling_group_name(&s.asg)
        .scaling_processes("ReplaceUnhealthy")
        .send()
        .await
        .unwrap();
    let m = deferred(
        cp.drain(&aws::order(
            Command::Drain { terminating: false },
            Duration::from_secs(30),
        ))
        .await,
    );
    assert!(
        m.contains("kill switch") && m.contains("ReplaceUnhealthy"),
        "{m}"
    );
    asg.resume_processes()
        .auto_scaling_group_name(&s.asg)
        .send()
        .await
        .unwrap();

    let tag = |v: &str| {
        aws_sdk_autoscaling::types::Tag::builder()
            .resource_id(&s.asg)
            .resource_type("auto-scaling-group")
            .key("gpu-medic/paused")
            .value(v)
            .propagate_at_launch(false)
            .build()
    };
    asg.create_or_update_tags()
        .tags(tag("true"))
        .send()
        .await
        .unwrap();
    let m = deferred(
        cp.drain(&aws::order(
            Command::Drain { terminating: false },
            Duration::from_secs(30),
        ))
        .await,
    );
    assert!(m.contains("paused"), "{m}");
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[0].arn).await.0,
        "ACTIVE"
    );

    asg.create_or_update_tags()
        .tags(tag("false"))
        .send()
        .await
        .unwrap();
    cp.drain(&aws::order(
        Command::Drain { terminating: false },
        Duration::from_secs(30),
    ))
    .await
    .unwrap();
    assert_eq!(
        aws::instance(&sdk, &s.cluster, &s.nodes[0].arn).await.0,
        "DRAINING"
    );

    // Drained, but the operator suspended health replacement meanwhile: stay drained.
    asg.suspend_processes()
        .auto_scaling_group_name(&s.asg)
        .scaling_processes("HealthCheck")
        .send()
        .await
        .unwrap();
    let m = deferred(
        cp.replace(&aws::order(Command::Replace, Duration::from_secs(30)))
            .await,
    );
    assert!(m.contains("HealthCheck"), "{m}");
    assert!(
        aws::asg_health(&sdk, &s.asg)
            .await
            .iter()
            .all(|(_, h)| h == "Healthy")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throttling_and_5xx_are_retried_and_errors_classified() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "retry", 3).await;
    let cp = AwsControlPlane::new(&sdk, &aws::config(&s, 0, "", ""));

    // Two throttles, then moto: the SDK's retries (on top of which the engine retries) cope.
    proxy.fault(Fault::ecs_throttle("PutAttributes", 2));
    let q = cp
        .quarantine(&aws::order(Command::Quarantine, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(proxy.count("PutAttributes"), 3);
    assert!(has_request_id(&q, "PutAttributes"));
    // 5xx on Auto Scaling, then moto.
    proxy.fault(Fault::asg_error(
        "SetInstanceHealth",
        2,
        503,
        "ServiceUnavailable",
        "try later",
    ));
    cp.replace(&aws::order(Command::Replace, Duration::from_secs(30)))
        .await
        .unwrap();
    assert_eq!(proxy.count("SetInstanceHealth"), 3);

    // Throttled beyond the SDK's attempts: retryable, with the failed call's request id.
    let cp = AwsControlPlane::new(&sdk, &aws::config(&s, 1, "", ""));
    proxy.fault(Fault::ecs_throttle("PutAttributes", 3));
    let e = cp
        .quarantine(&aws::order(Command::Quarantine, Duration::from_secs(30)))
        .await
        .unwrap_err();
    let RemedyError::Retryable {
        message,
        request_ids,
    } = &e
    else {
        panic!("{e:?}")
    };
    assert!(message.contains("ThrottlingException"), "{message}");
    assert!(
        request_ids
            .iter()
            .any(|r| r.starts_with("PutAttributes fault-")),
        "{request_ids:?}"
    );
    // A 5xx that persists: retryable too.
    proxy.fault(Fault::ecs_unavailable("PutAttributes", 3));
    let e = cp
        .quarantine(&aws::order(Command::Quarantine, Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert!(matches!(e, RemedyError::Retryable { .. }), "{e:?}");
    // Permissions: terminal at once, no retry.
    let before = proxy.count("PutAttributes");
    proxy.fault(Fault::ecs_denied("PutAttributes", 1));
    let e = cp
        .quarantine(&aws::order(Command::Quarantine, Duration::from_secs(30)))
        .await
        .unwrap_err();
    assert!(
        matches!(&e, RemedyError::Fatal { message, .. } if message.contains("AccessDenied")),
        "{e:?}"
    );
    assert_eq!(proxy.count("PutAttributes"), before + 1);
}

/// gpu-medic dies mid-drain (the future is dropped, its memory gone) and a fresh control plane
/// resumes the same order: no second claim, no second UpdateContainerInstancesState, the
/// standalone grace counted from the original claim, and the drain still completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_mid_drain_resumes_without_repeating_or_skipping() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "resume", 3).await;
    let me = &s.nodes[0];
    let service = aws::start_task(&sdk, &s, &me.arn, Some("service:web")).await;
    let standalone = aws::start_task(&sdk, &s, &me.arn, None).await;
    let ecs = "standalone_grace = \"3s\"";
    let order = aws::order(
        Command::Drain { terminating: false },
        Duration::from_secs(60),
    );

    let first = std::sync::Arc::new(AwsControlPlane::new(&sdk, &aws::config(&s, 0, ecs, "")));
    let running = {
        let (first, order) = (first.clone(), order.clone());
        tokio::spawn(async move { first.drain(&order).await })
    };
    // "Crash" as soon as the instance is DRAINING (however long the claim took on a busy
    // machine), well before the standalone grace.
    let t = std::time::Instant::now();
    while aws::instance(&sdk, &s.cluster, &me.arn).await.0 != "DRAINING" {
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "never reached DRAINING"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // ... and no earlier than 1 s into the drain, so the grace the restart must honour is
    // about 2 s, not a full 3 s.
    if let Some(left) = Duration::from_secs(1).checked_sub(t.elapsed()) {
        tokio::time::sleep(left).await;
    }
    running.abort();
    assert!(
        running.await.unwrap_err().is_cancelled(),
        "still draining when it 'crashes'"
    );
    drop(first);
    assert_eq!(
        aws::task_desired(&sdk, &s.cluster, &standalone).await,
        "RUNNING"
    );
    let claims = proxy.count_with("PutAttributes", "claim");
    assert_eq!(claims, 1);

    let second = AwsControlPlane::new(&sdk, &aws::config(&s, 0, ecs, ""));
    let resumed = tokio::spawn(async move { second.drain(&order).await });
    // The standalone task is stopped once the original grace is over: the grace counts from
    // the drain's first start, read back from the claim in moto (the rule itself is proven in
    // virtual time by drain.rs `a_resumed_drain_counts_the_grace_from_its_first_start`; no
    // wall-clock bound against moto here).
    let t = std::time::Instant::now();
    while aws::task_desired(&sdk, &s.cluster, &standalone).await != "STOPPED" {
        assert!(t.elapsed() < Duration::from_secs(30), "never stopped");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    aws::stop(&sdk, &s.cluster, &service).await;
    let d = resumed.await.unwrap().unwrap();
    assert!(d.detail.starts_with("resumed drain: drained"), "{d:?}");
    assert_eq!(proxy.count("UpdateContainerInstancesState"), 1);
    assert_eq!(proxy.count_with("PutAttributes", "claim"), 1);
    assert_eq!(
        proxy.count("StopTask"),
        2,
        "ours once, the scheduler's once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_lifecycle_hook_is_completed_and_a_gone_action_is_fine() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "hook", 1).await;
    let cp = AwsControlPlane::new(&sdk, &aws::config(&s, 0, "", ""));
    let order = aws::order(
        Command::CompleteLifecycle {
            hook: LifecycleHook::Terminate,
            result: LifecycleResult::Continue,
        },
        Duration::from_secs(30),
    );
    // moto does not implement CompleteLifecycleAction: the proxy answers for it.
    proxy.fault(Fault::asg_ok("CompleteLifecycleAction", 1));
    let d = cp
        .complete_lifecycle(&order, LifecycleHook::Terminate, LifecycleResult::Continue)
        .await
        .unwrap();
    assert!(
        d.detail
            .contains("gpu-medic-terminate completed with CONTINUE"),
        "{d:?}"
    );
    assert_eq!(
        proxy.count_with(
            "CompleteLifecycleAction",
            "LifecycleHookName=gpu-medic-terminate"
        ),
        1
    );
    assert_eq!(
        proxy.count_with(
            "CompleteLifecycleAction",
            &format!("InstanceId={}", s.nodes[0].instance_id)
        ),
        1
    );
    proxy.fault(Fault::asg_error(
        "CompleteLifecycleAction",
        1,
        400,
        "ValidationError",
        "No active Lifecycle Action found with instance ID i-x",
    ));
    let d = cp
        .complete_lifecycle(&order, LifecycleHook::Terminate, LifecycleResult::Continue)
        .await
        .unwrap();
    assert!(d.detail.contains("already completed"), "{d:?}");
    proxy.fault(Fault::asg_error(
        "CompleteLifecycleAction",
        1,
        400,
        "ValidationError",
        "No hook named gpu-medic-launch",
    ));
    let e = cp
        .complete_lifecycle(&order, LifecycleHook::Launch, LifecycleResult::Abandon)
        .await
        .unwrap_err();
    assert!(matches!(e, RemedyError::Fatal { .. }), "{e:?}");
    assert_eq!(
        proxy.count_with("CompleteLifecycleAction", "LifecycleActionResult=ABANDON"),
        1
    );
}

/// An operator abort mid-drain: restore makes the instance ACTIVE with health=ok and its
/// claim released, and the drain still running notices and stops instead of stopping tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restore_undoes_quarantine_and_drain_and_stops_a_running_drain() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "restore", 3).await;
    let me = &s.nodes[0];
    let service = aws::start_task(&sdk, &s, &me.arn, Some("service:web")).await;
    let cp = std::sync::Arc::new(AwsControlPlane::new(
        &sdk,
        &aws::config(&s, 0, "drain_poll_interval = \"200ms\"", ""),
    ));
    cp.quarantine(&aws::order(Command::Quarantine, Duration::from_secs(30)))
        .await
        .unwrap();
    let drain_order = aws::order(
        Command::Drain { terminating: false },
        Duration::from_secs(60),
    );
    let draining = {
        let cp = cp.clone();
        tokio::spawn(async move { cp.drain(&drain_order).await })
    };
    let t = std::time::Instant::now();
    while aws::instance(&sdk, &s.cluster, &me.arn).await.0 != "DRAINING" {
        assert!(t.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let done = cp
        .restore(&aws::order(Command::Restore, Duration::from_secs(30)))
        .await
        .unwrap();
    assert!(done.detail.contains("now ACTIVE"), "{done:?}");
    assert!(
        done.detail.contains("1 fleet-budget claim(s) released"),
        "{done:?}"
    );
    let (status, _, attrs) = aws::instance(&sdk, &s.cluster, &me.arn).await;
    assert_eq!(status, "ACTIVE");
    assert!(
        attrs.contains(&("gpu-medic.health".to_string(), Some("ok".to_string()))),
        "{attrs:?}"
    );
    assert!(
        !attrs.iter().any(|(n, _)| n.starts_with("gpu-medic.claim.")),
        "{attrs:?}"
    );
    let stopped = draining.await.unwrap().unwrap_err();
    assert!(stopped.to_string().contains("ACTIVE again"), "{stopped}");
    assert_eq!(
        aws::task_desired(&sdk, &s.cluster, &service).await,
        "RUNNING",
        "the aborted drain stopped nothing"
    );
}
