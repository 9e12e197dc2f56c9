//! Identity discovery against moto, a fake IMDSv2 (found through the standard
//! `AWS_EC2_METADATA_SERVICE_ENDPOINT`) and a fake ECS agent introspection API: the agent
//! retried until it answers, the `/etc/ecs/ecs.config` + ListContainerInstances fallback, the
//! group from DescribeAutoScalingInstances, and overrides that make no call at all.
//!
//! One test in this binary: it sets the IMDS endpoint variable before any thread reads it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

#[path = "support/aws.rs"]
mod aws;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use aws::Proxy;
use gpu_medic::aws::identity::Identity;
use gpu_medic::config::Config;
use gpu_medic::remedy::aws::AwsControlPlane;

fn fake_imds(instance_id: String) -> aws::Handler {
    Arc::new(move |method, path, head| {
        let head = head.to_ascii_lowercase();
        match (method, path) {
            ("PUT", "/latest/api/token") => (
                200,
                vec![(
                    "X-aws-ec2-metadata-token-ttl-seconds".into(),
                    "21600".into(),
                )],
                "tok-1".into(),
            ),
            ("GET", "/latest/meta-data/instance-id") => {
                if head.contains("x-aws-ec2-metadata-token: tok-1") {
                    (200, vec![], instance_id.clone())
                } else {
                    (401, vec![], String::new())
                }
            }
            _ => (404, vec![], String::new()),
        }
    })
}

/// An agent that answers 503 `fail_first` times (still starting), then its metadata.
fn fake_agent(
    cluster: String,
    arn: String,
    fail_first: usize,
    seen: Arc<AtomicUsize>,
) -> aws::Handler {
    Arc::new(move |_, path, _| {
        let n = seen.fetch_add(1, Ordering::SeqCst);
        if path != "/v1/metadata" {
            return (404, vec![], String::new());
        }
        if n < fail_first {
            return (503, vec![], "starting".into());
        }
        (
            200,
            vec![("Content-Type".into(), "application/json".into())],
            format!(
                r#"{{"Cluster":"{cluster}","ContainerInstanceArn":"{arn}","Version":"Amazon ECS Agent - v1.90.0"}}"#
            ),
        )
    })
}

fn config(text: &str) -> Config {
    Config::parse(std::path::Path::new("/tmp/gpu-medic-test.toml"), text).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_is_discovered_from_imds_the_agent_and_auto_scaling() {
    let proxy = Proxy::start().await;
    let sdk = aws::sdk(&proxy.url).await;
    let s = aws::seed(&sdk, "ident", 2).await;
    let me = &s.nodes[1];
    let imds = aws::serve_http(fake_imds(me.instance_id.clone())).await;
    // SAFETY: the only test of this binary, before anything reads the environment.
    unsafe {
        std::env::set_var(
            "AWS_EC2_METADATA_SERVICE_ENDPOINT",
            format!("http://{imds}"),
        )
    };
    let want = Identity {
        instance_id: me.instance_id.clone(),
        cluster: s.cluster.clone(),
        container_instance_arn: me.arn.clone(),
        auto_scaling_group: Some(s.asg.clone()),
    };

    // 1. The agent is still starting: retried until it answers.
    let seen = Arc::new(AtomicUsize::new(0));
    let agent = aws::serve_http(fake_agent(
        s.cluster.clone(),
        me.arn.clone(),
        3,
        seen.clone(),
    ))
    .await;
    let cp = AwsControlPlane::new(
        &sdk,
        &config(&format!(
            "[ecs]\nagent_url = \"http://{agent}\"\nagent_wait = \"20s\"\n"
        )),
    );
    let before = proxy.calls().len();
    let id = cp.identity().await.unwrap();
    assert_eq!(id, &want);
    assert_eq!(
        seen.load(Ordering::SeqCst),
        4,
        "three refusals, then the answer"
    );
    assert_eq!(proxy.ops()[before..], ["DescribeAutoScalingInstances"]);

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
    let other = aws::serve_http(fake_imds("i-00000000000000000".into())).await;
    // SAFETY: still the only test of this binary; no other thread reads the environment now.
    unsafe {
        std::env::set_var(
            "AWS_EC2_METADATA_SERVICE_ENDPOINT",
            format!("http://{other}"),
        )
    };
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

    // 4. Everything overridden: no call at all.
    let before = proxy.calls().len();
    let cp = AwsControlPlane::new(&sdk, &config(&aws::sections(&s, 1, "")));
    assert_eq!(cp.identity().await.unwrap(), &want);
    assert_eq!(proxy.calls().len(), before);
}
