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
