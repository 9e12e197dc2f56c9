//! Identity discovery against moto, a fake IMDSv2 (found through the standard
//! `AWS_EC2_METADATA_SERVICE_ENDPOINT`) and a fake ECS agent introspection API: the agent
//! retried until it answers, the `/etc/ecs/ecs.config` + ListContainerInstances fallback, the
//! group from DescribeAutoScalingInstances, and overrides that make no call at all.
//!
//! One test in this binary: it sets the IMDS endpoint variable before any thread reads it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use gpu_medic::aws::identity::Identity;
use gpu_medic::config::Config;
use gpu_medic::remedy::aws::AwsControlPlane;
use gpu_medic_testkit::aws::{self, Proxy};
use gpu_medic_testkit::imds::{FakeAgent, FakeImds};

fn config(text: &str) -> Config {
    Config::parse(std::path::Path::new("/tmp/gpu-medic-test.toml"), text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_is_discovered_from_imds_the_agent_and_auto_scaling() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ident", 2).await;
    let me = &s.nodes[1];
    let imds = FakeImds::start(&me.instance_id).await;
    // SAFETY: the only test of this binary, before anything reads the environment.
    unsafe { std::env::set_var("AWS_EC2_METADATA_SERVICE_ENDPOINT", &imds.url) };
    let want = Identity {
        instance_id: me.instance_id.clone(),
        cluster: s.cluster.clone(),
        container_instance_arn: me.arn.clone(),
        auto_scaling_group: Some(s.asg.clone()),
    };

    // 1. The agent is still starting: retried until it answers.
    let agent = FakeAgent::start(FakeAgent::metadata(&s.cluster, Some(&me.arn)), 3).await;
    let cp = AwsControlPlane::new(
        &sdk,
        &config(&format!(
            "[ecs]\nagent_url = \"{}\"\nagent_wait = \"20s\"\n",
            agent.url
        )),
    );
    let before = proxy.calls().len();
    let id = cp.identity().await.unwrap();
    assert_eq!(id, &want);
    assert_eq!(agent.requests(), 4, "three refusals, then the answer");
    assert_eq!(
        proxy.ops()[before..],
        ["DescribeContainerInstances", "DescribeAutoScalingInstances"],
        "the agent's container instance is checked to be this instance's"
    );

    // 2. No agent: ECS_CLUSTER from ecs.config, the instance found by its EC2 id.
    let dir = tempfile::tempdir().unwrap();
    let ecs_config = dir.path().join("ecs.config");
    std::fs::write(
        &ecs_config,
        format!("ECS_ENABLE_GPU_SUPPORT=true\nECS_CLUSTER={}\n", s.cluster),
    )
    .unwrap();
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cp = AwsControlPlane::new(
        &sdk,
        &config(&format!(
            "[ecs]\nagent_url = \"http://{closed}\"\nagent_wait = \"300ms\"\necs_config_file = \"{}\"\n",
            ecs_config.display()
        )),
    );
    let before = proxy.calls().len();
    assert_eq!(cp.identity().await.unwrap(), &want);
    assert_eq!(
        proxy.ops()[before..],
        [
            "ListContainerInstances",
            "DescribeContainerInstances",
            "DescribeAutoScalingInstances"
        ]
    );

    // 3. An instance that is not registered: a retryable error (the agent may register later).
    std::fs::write(&ecs_config, format!("ECS_CLUSTER={}\n", s.cluster)).unwrap();
    let other = FakeImds::start("i-00000000000000000").await;
    // SAFETY: as above; no other thread reads the environment between these steps.
    unsafe { std::env::set_var("AWS_EC2_METADATA_SERVICE_ENDPOINT", &other.url) };
    let cp = AwsControlPlane::new(
        &sdk,
        &config(&format!(
            "[ecs]\nagent_url = \"http://{closed}\"\nagent_wait = \"100ms\"\necs_config_file = \"{}\"\n",
            ecs_config.display()
        )),
    );
    let e = cp.identity().await.unwrap_err();
    assert!(
        matches!(&e, gpu_medic::remedy::RemedyError::Retryable { message, .. } if message.contains("not registered")),
        "{e:?}"
    );

    // 4. Everything overridden: two reads, the container instance and the group checked to
    // be this one's.
    let before = proxy.calls().len();
    let cp = AwsControlPlane::new(&sdk, &config(&aws::sections(&s, 1, "")));
    assert_eq!(cp.identity().await.unwrap(), &want);
    assert_eq!(
        proxy.ops()[before..],
        ["DescribeContainerInstances", "DescribeAutoScalingInstances"]
    );

    // 5. A container instance ARN that is another instance's (a copied config): refused for
    // good, and nothing is written to ECS for either instance.
    let other = &s.nodes[0];
    let wrong = aws::sections(&s, 1, "").replace(&me.arn, &other.arn);
    assert!(wrong.contains(&other.arn), "{wrong}");
    let before = proxy.calls().len();
    let cp = AwsControlPlane::new(&sdk, &config(&wrong));
    let e = cp.identity().await.unwrap_err();
    assert!(
        matches!(&e, gpu_medic::remedy::RemedyError::Fatal { message, .. }
            if message.contains(&other.instance_id) && message.contains(&me.instance_id)),
        "{e:?}"
    );
    assert_eq!(proxy.ops()[before..], ["DescribeContainerInstances"]);

    // 6. A group that Auto Scaling does not have this instance in (a copied config): refused
    // for good, naming both; the fleet budget never counts another group's instances.
    let wrong = aws::sections(&s, 1, "").replace(
        &format!("auto_scaling_group = \"{}\"", s.asg),
        "auto_scaling_group = \"gpu-other-group\"",
    );
    assert!(wrong.contains("gpu-other-group"), "{wrong}");
    let cp = AwsControlPlane::new(&sdk, &config(&wrong));
    let e = cp.identity().await.unwrap_err();
    assert!(
        matches!(&e, gpu_medic::remedy::RemedyError::Fatal { message, .. }
            if message.contains("gpu-other-group") && message.contains(&s.asg)),
        "{e:?}"
    );
}
