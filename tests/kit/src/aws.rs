//! AWS in tests: one `moto_server` per test binary on a free port, stopped by a watcher shell
//! when the binary exits (statics are never dropped; tests share it with unique cluster/ASG
//! names), the SDK pointed at it (or at a [`Proxy`] in front of it), seeding (launch
//! configuration + Auto Scaling group, whose EC2 instances moto creates; cluster; container
//! instances registered with those EC2 ids; tasks), and test configs and orders.
//!
//! moto 5.2.5 from `GPU_MEDIC_CI_VENV` (default /opt/gpu-medic-ci/venv; `.ci/install-deps.sh`).

use std::net::{SocketAddr, TcpListener};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use aws_config::SdkConfig;
use aws_sdk_ecs::config::Credentials;
use gpu_medic::config::{AwsConfig, Config};
use gpu_medic::model::{ActionId, Command, IncidentId, Order, Timestamp};

pub use crate::http::{Handler, http_sync, serve_http};
pub use crate::proxy::{Call, Fault, Hold, Proxy, form_field};

pub const REGION: &str = "us-east-1";

pub struct Moto {
    pub url: String,
    pub addr: SocketAddr,
    /// The watcher shell; it reaps moto itself when this binary exits.
    _watcher: std::process::Child,
}

static MOTO: OnceLock<Moto> = OnceLock::new();

/// The binary's moto_server, started on first use.
pub fn moto() -> &'static Moto {
    MOTO.get_or_init(start_moto)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_moto() -> Moto {
    let venv =
        std::env::var("GPU_MEDIC_CI_VENV").unwrap_or_else(|_| "/opt/gpu-medic-ci/venv".into());
    let server = format!("{venv}/bin/moto_server");
    assert!(
        Path::new(&server).exists(),
        "{server} not found: run `sudo bash .ci/install-deps.sh`"
    );
    let port = free_port();
    let log = std::env::temp_dir().join(format!("gpu-medic-moto-{port}.log"));
    // The watcher ends moto once this test binary is gone, however it ended.
    let script = format!(
        "'{server}' -H 127.0.0.1 -p {port} >'{}' 2>&1 & m=$!; trap 'kill $m 2>/dev/null' EXIT; \
         while kill -0 {pid} 2>/dev/null && kill -0 $m 2>/dev/null; do sleep 0.3; done",
        log.display(),
        pid = std::process::id()
    );
    let watcher = std::process::Command::new("bash")
        .arg("-c")
        .arg(script)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start moto_server");
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_sync(addr, "GET", "/moto-api/", "").map(|(s, _)| s) != Some(200) {
        assert!(
            Instant::now() < deadline,
            "moto_server did not start; log: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Tasks stay RUNNING until stopped (moto advances lastStatus on every describe otherwise).
    let (s, b) = http_sync(
        addr,
        "POST",
        "/moto-api/state-manager/set-transition",
        r#"{"model_name":"ecs::task","transition":{"progression":"manual","times":1000000}}"#,
    )
    .unwrap();
    assert_eq!(s, 201, "set-transition: {b}");
    Moto {
        url: format!("http://{addr}"),
        addr,
        _watcher: watcher,
    }
}

/// A unique name per test and run (moto is shared by the binary's tests).
pub fn unique(name: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("{name}-{}-{n}", std::process::id())
}

// ---------------------------------------------------------------------------------------------
// SDK, seeding, configs, orders

/// An SDK configuration pointed at `endpoint` (moto or a proxy) with test credentials.
pub async fn sdk(endpoint: &str) -> SdkConfig {
    sdk_as(endpoint, crate::throttle::HARNESS_KEY).await
}

/// The same, signing with the access key id `key`: a proxy's weather applies to any key but
/// the harness's own ([`crate::throttle::HARNESS_KEY`]), and records it as the caller.
pub async fn sdk_as(endpoint: &str, key: &str) -> SdkConfig {
    let aws = AwsConfig {
        region: Some(REGION.into()),
        endpoint_url: Some(endpoint.into()),
        ..AwsConfig::default()
    };
    gpu_medic::aws::loader(&aws)
        .credentials_provider(Credentials::new(key, "test", None, None, "test"))
        // The SDK's three attempts, with test-sized backoff.
        .retry_config(
            aws_config::retry::RetryConfig::standard()
                .with_max_attempts(3)
                .with_initial_backoff(Duration::from_millis(20)),
        )
        .load()
        .await
}

pub struct Node {
    pub instance_id: String,
    pub arn: String,
}

pub struct Seeded {
    pub cluster: String,
    pub asg: String,
    pub family: String,
    pub nodes: Vec<Node>,
}

/// An Auto Scaling group of `n` instances, each registered in a new cluster.
pub async fn seed(sdk: &SdkConfig, name: &str, n: usize) -> Seeded {
    let name = unique(name);
    let asg = aws_sdk_autoscaling::Client::new(sdk);
    let ecs = aws_sdk_ecs::Client::new(sdk);
    asg.create_launch_configuration()
        .launch_configuration_name(&name)
        .image_id("ami-12c6146b")
        .instance_type("t2.micro")
        .send()
        .await
        .unwrap();
    asg.create_auto_scaling_group()
        .auto_scaling_group_name(&name)
        .launch_configuration_name(&name)
        .min_size(0)
        .max_size(n as i32 * 3)
        .desired_capacity(n as i32)
        .availability_zones("us-east-1a")
        .send()
        .await
        .unwrap();
    ecs.create_cluster()
        .cluster_name(&name)
        .send()
        .await
        .unwrap();
    let ids = asg_instance_ids(sdk, &name).await;
    assert_eq!(ids.len(), n);
    let mut nodes = Vec::new();
    for iid in ids {
        let arn = register(sdk, &name, &iid).await;
        nodes.push(Node {
            instance_id: iid,
            arn,
        });
    }
    let family = format!("{name}-train");
    ecs.register_task_definition()
        .family(&family)
        .container_definitions(
            aws_sdk_ecs::types::ContainerDefinition::builder()
                .name("c")
                .image("busybox")
                .memory(16)
                .cpu(1)
                .build(),
        )
        .send()
        .await
        .unwrap();
    Seeded {
        cluster: name.clone(),
        asg: name,
        family,
        nodes,
    }
}

/// RegisterContainerInstance for an EC2 instance moto created; returns its ARN.
pub async fn register(sdk: &SdkConfig, cluster: &str, instance_id: &str) -> String {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    let doc = format!(r#"{{"instanceId":"{instance_id}","region":"{REGION}"}}"#);
    ecs.register_container_instance()
        .cluster(cluster)
        .instance_identity_document(doc)
        .send()
        .await
        .unwrap()
        .container_instance()
        .unwrap()
        .container_instance_arn()
        .unwrap()
        .to_string()
}

/// The Auto Scaling group as DescribeAutoScalingGroups returns it.
pub async fn asg_group(
    sdk: &SdkConfig,
    group: &str,
) -> aws_sdk_autoscaling::types::AutoScalingGroup {
    let asg = aws_sdk_autoscaling::Client::new(sdk);
    let r = asg
        .describe_auto_scaling_groups()
        .auto_scaling_group_names(group)
        .send()
        .await
        .unwrap();
    r.auto_scaling_groups()[0].clone()
}

pub async fn asg_instance_ids(sdk: &SdkConfig, group: &str) -> Vec<String> {
    asg_group(sdk, group)
        .await
        .instances()
        .iter()
        .map(|i| i.instance_id().unwrap().to_string())
        .collect()
}

/// ASG health of each instance of the group.
pub async fn asg_health(sdk: &SdkConfig, group: &str) -> Vec<(String, String)> {
    asg_group(sdk, group)
        .await
        .instances()
        .iter()
        .map(|i| {
            (
                i.instance_id().unwrap().to_string(),
                i.health_status().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// A lifecycle hook on the group: `transition` is `autoscaling:EC2_INSTANCE_LAUNCHING` or
/// `autoscaling:EC2_INSTANCE_TERMINATING`; `default_result` `CONTINUE` or `ABANDON`.
pub async fn put_hook(
    sdk: &SdkConfig,
    group: &str,
    name: &str,
    transition: &str,
    heartbeat_timeout: i32,
    default_result: &str,
) {
    aws_sdk_autoscaling::Client::new(sdk)
        .put_lifecycle_hook()
        .auto_scaling_group_name(group)
        .lifecycle_hook_name(name)
        .lifecycle_transition(transition)
        .heartbeat_timeout(heartbeat_timeout)
        .default_result(default_result)
        .send()
        .await
        .unwrap();
}

/// StartTask on one instance; `group: Some("service:web")` plays a service's task.
pub async fn start_task(sdk: &SdkConfig, s: &Seeded, arn: &str, group: Option<&str>) -> String {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    ecs.start_task()
        .cluster(&s.cluster)
        .task_definition(&s.family)
        .container_instances(arn)
        .set_group(group.map(str::to_string))
        .send()
        .await
        .unwrap()
        .tasks()[0]
        .task_arn()
        .unwrap()
        .to_string()
}

/// (status, runningTasksCount, attributes) of a container instance.
pub async fn instance(
    sdk: &SdkConfig,
    cluster: &str,
    arn: &str,
) -> (String, i32, Vec<(String, Option<String>)>) {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    let r = ecs
        .describe_container_instances()
        .cluster(cluster)
        .container_instances(arn)
        .send()
        .await
        .unwrap();
    let ci = &r.container_instances()[0];
    (
        ci.status().unwrap().to_string(),
        ci.running_tasks_count(),
        ci.attributes()
            .iter()
            .map(|a| (a.name().to_string(), a.value().map(str::to_string)))
            .collect(),
    )
}

/// The desired status of a task.
pub async fn task_desired(sdk: &SdkConfig, cluster: &str, task: &str) -> String {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    let r = ecs
        .describe_tasks()
        .cluster(cluster)
        .tasks(task)
        .send()
        .await
        .unwrap();
    r.tasks()[0].desired_status().unwrap().to_string()
}

pub async fn stop(sdk: &SdkConfig, cluster: &str, task: &str) {
    let ecs = aws_sdk_ecs::Client::new(sdk);
    ecs.stop_task()
        .cluster(cluster)
        .task(task)
        .send()
        .await
        .unwrap();
}

/// The `[identity]`, `[ecs]` and `[fleet]` sections for node `i`, plus `extra` TOML.
/// A container definition sharing a GPU through MPS: `mib` of its memory
/// (`sharingStrategy.nvidiaMps.memory`) and, when given, `maxComputePercent`.
pub fn mps_container(
    name: &str,
    mib: i32,
    percent: Option<i32>,
) -> aws_sdk_ecs::types::ContainerDefinition {
    use aws_sdk_ecs::types::{
        ContainerDefinition, NvidiaMpsAllocation, ResourceRequirement, ResourceType,
        SharingStrategy,
    };
    let mut mps = NvidiaMpsAllocation::builder().memory(mib);
    if let Some(p) = percent {
        mps = mps.max_compute_percent(p);
    }
    ContainerDefinition::builder()
        .name(name)
        .image("busybox")
        .memory(16)
        .resource_requirements(
            ResourceRequirement::builder()
                .r#type(ResourceType::Gpu)
                .sharing_strategy(SharingStrategy::NvidiaMps(mps.build().unwrap()))
                .build()
                .unwrap(),
        )
        .build()
}

/// [`node`] with the ECS agent at `agent`, `extra` config sections (e.g. `[metrics]`), and
/// the fake libnvidia-ml's four GPUs (`FOUR_GPUS`); not started.
pub fn ecs_gpu_node(s: &Seeded, i: usize, agent: &str, proxy: &str, extra: &str) -> crate::Daemon {
    let ecs = format!("agent_url = \"{agent}\"");
    let mut d = node(s, i, Some(proxy), "", &ecs, "", extra);
    d.gpus(crate::FOUR_GPUS);
    d
}

pub fn sections(s: &Seeded, i: usize, extra: &str) -> String {
    format!(
        "[identity]\ninstance_id = \"{}\"\ncluster = \"{}\"\ncontainer_instance_arn = \"{}\"\nauto_scaling_group = \"{}\"\n{extra}\n",
        s.nodes[i].instance_id, s.cluster, s.nodes[i].arn, s.asg,
    )
}

/// A config for node `i`: fast polls, no warmup, short settle. `ecs` and `fleet` are TOML
/// lines for those sections; a key given there replaces the test default.
pub fn config(s: &Seeded, i: usize, ecs: &str, fleet: &str) -> Config {
    let merge = |defaults: &[(&str, &str)], extra: &str| {
        let mut out = String::new();
        for (k, v) in defaults {
            if !extra
                .lines()
                .any(|l| l.trim_start().starts_with(&format!("{k} ")))
            {
                out.push_str(&format!("{k} = {v}\n"));
            }
        }
        out.push_str(extra);
        out.push('\n');
        out
    };
    let ecs = merge(
        &[
            ("standalone_grace", "\"300ms\""),
            ("drain_poll_interval", "\"100ms\""),
            ("force_stop_lead", "\"2s\""),
        ],
        ecs,
    );
    let fleet = merge(
        &[
            ("warmup", "\"0s\""),
            ("claim_settle", "\"150ms\""),
            ("retry_after", "\"300ms\""),
        ],
        fleet,
    );
    let text = format!("{}[ecs]\n{ecs}[fleet]\n{fleet}", sections(s, i, ""));
    Config::parse(Path::new("/tmp/gpu-medic-test.toml"), &text).unwrap()
}

pub fn order(command: Command, deadline: Duration) -> Order {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    Order {
        id: ActionId(N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
        incident: IncidentId(1),
        command,
        attempt: 1,
        deadline: Timestamp::now().plus(deadline),
        planned: false,
    }
}

// ---------------------------------------------------------------------------------------------
// The fleet budget's slot table (DynamoDB in moto: conditional writes are real there)

/// Creates the slot table `name` (partition key `group`, String; on-demand), as
/// packaging/examples/cloudformation.yaml does.
pub async fn create_slot_table(sdk: &SdkConfig, name: &str) {
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    };
    aws_sdk_dynamodb::Client::new(sdk)
        .create_table()
        .table_name(name)
        .billing_mode(BillingMode::PayPerRequest)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("group")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("group")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
}

/// The group's item as gpu-medic reads it (a consistent GetItem); version 0 when absent.
pub async fn slot_item(
    sdk: &SdkConfig,
    table: &str,
    group: &str,
) -> gpu_medic::aws::dynamo::SlotItem {
    let t = gpu_medic::aws::dynamo::SlotTable::new(aws_sdk_dynamodb::Client::new(sdk), table);
    t.read(&mut gpu_medic::aws::calls::Calls::new(), group)
        .await
        .unwrap()
}

/// An EC2 instance of no Auto Scaling group: launched by a group of one, then detached from
/// it (desired capacity decremented, so the group launches no successor).
pub async fn lone_instance(sdk: &SdkConfig, name: &str) -> String {
    let name = unique(name);
    let asg = aws_sdk_autoscaling::Client::new(sdk);
    asg.create_launch_configuration()
        .launch_configuration_name(&name)
        .image_id("ami-12c6146b")
        .instance_type("t2.micro")
        .send()
        .await
        .unwrap();
    asg.create_auto_scaling_group()
        .auto_scaling_group_name(&name)
        .launch_configuration_name(&name)
        .min_size(0)
        .max_size(1)
        .desired_capacity(1)
        .availability_zones("us-east-1a")
        .send()
        .await
        .unwrap();
    let id = asg_instance_ids(sdk, &name).await.remove(0);
    asg.detach_instances()
        .auto_scaling_group_name(&name)
        .instance_ids(&id)
        .should_decrement_desired_capacity(true)
        .send()
        .await
        .unwrap();
    assert!(asg_instance_ids(sdk, &name).await.is_empty());
    id
}

/// TerminateInstanceInAutoScalingGroup, desired capacity decremented (no successor): moto
/// terminates the EC2 instance and drops it from the group.
pub async fn terminate(sdk: &SdkConfig, instance_id: &str) {
    aws_sdk_autoscaling::Client::new(sdk)
        .terminate_instance_in_auto_scaling_group()
        .instance_id(instance_id)
        .should_decrement_desired_capacity(true)
        .send()
        .await
        .unwrap();
}

/// Writes `group`'s item with `holder` committed (version 1), as a gpu-medic that took the
/// slot would have (for benches and tests that start with the budget held).
pub async fn put_slot_holder(sdk: &SdkConfig, table: &str, group: &str, holder: &str) {
    use gpu_medic::aws::dynamo::{Holder, HolderState, SlotItem, SlotTable};
    let t = SlotTable::new(aws_sdk_dynamodb::Client::new(sdk), table);
    let mut calls = gpu_medic::aws::calls::Calls::new();
    let read = t.read(&mut calls, group).await.unwrap();
    let new = SlotItem {
        version: read.version + 1,
        exists: true,
        holders: [(
            holder.to_string(),
            Holder {
                state: HolderState::Committed,
                token: read.version + 1,
                incident: Some("1".into()),
                since: "2026-11-30T00:00:00Z".into(),
            },
        )]
        .into(),
        budget: Some(1),
        updated_by: Some(holder.to_string()),
        members: None,
    };
    t.write(&mut calls, group, &read, &new).await.unwrap();
}

/// `gpu-medic run` for node `i` of `s` on the fake GPUs (not started): MPS off, 100 ms ticks,
/// NVML and drain polls every 200 ms, no warmup; every AWS service at `endpoint` (None: the
/// caller routes them, e.g. per-service `AWS_ENDPOINT_URL_*`). `top`: top-level keys; `ecs`,
/// `fleet`: more lines of those sections; `rest`: more sections (`[export]`). Without a
/// `[repair]` section in `rest` the reboot rung is off (`reboot = "off"`): these nodes are
/// about the replace rung, which a first XID 79 would otherwise not reach
/// (tests/repair_reboot.rs turns it on).
pub fn node(
    s: &Seeded,
    i: usize,
    endpoint: Option<&str>,
    top: &str,
    ecs: &str,
    fleet: &str,
    rest: &str,
) -> crate::Daemon {
    let dir = tempfile::tempdir().unwrap();
    let config = format!(
        "{top}\nstate_dir = \"state\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nlibrary = \"{}\"\npoll_interval = \"200ms\"\nkmsg = \"{}\"\n\
         [mps]\nenabled = false\n\
         {}\
         [ecs]\ndrain_poll_interval = \"200ms\"\n{ecs}\n\
         [fleet]\nwarmup = \"0s\"\n{fleet}\n{repair}{rest}",
        crate::default_policy().display(),
        crate::fake_nvml().display(),
        dir.path().join("kmsg").display(),
        sections(s, i, ""),
        repair = if rest.contains("[repair]") {
            ""
        } else {
            "[repair]\nreboot = \"off\"\n"
        },
    );
    let mut d = crate::Daemon::in_temp(dir, &config);
    d.aws(endpoint);
    d
}

/// `[fleet]` lines for the DynamoDB slot table `table`: budget 1, no breaker, reservations
/// stale after 2 s.
pub fn table_fleet(table: &str) -> String {
    format!(
        "table = \"{table}\"\nmax_parallel = 1\nmax_unhealthy = \"100%\"\nreservation_lifetime = \"2s\"\n"
    )
}

/// Who is DRAINING among the instances still in the group, by moto.
pub async fn draining(sdk: &aws_config::SdkConfig, s: &Seeded) -> Vec<String> {
    let members = asg_instance_ids(sdk, &s.asg).await;
    let ecs = aws_sdk_ecs::Client::new(sdk);
    let r = ecs
        .describe_container_instances()
        .cluster(&s.cluster)
        .set_container_instances(Some(s.nodes.iter().map(|n| n.arn.clone()).collect()))
        .send()
        .await
        .unwrap();
    r.container_instances()
        .iter()
        .filter(|c| c.status() == Some("DRAINING"))
        .filter_map(|c| c.ec2_instance_id().map(str::to_string))
        .filter(|id| members.contains(id))
        .collect()
}

/// The ground truth of a fleet budget, sampled from moto every 50 ms (never gpu-medic's own
/// word): the most instances DRAINING at once.
pub struct Sampler {
    max: Arc<AtomicUsize>,
    samples: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Sampler {
    pub fn start(moto: &aws_config::SdkConfig, s: &Arc<Seeded>) -> Sampler {
        let (max, samples, stop) = (
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicUsize::new(0)),
            Arc::new(AtomicBool::new(false)),
        );
        let task = {
            let (sdk, s) = (moto.clone(), s.clone());
            let (max, samples, stop) = (max.clone(), samples.clone(), stop.clone());
            tokio::spawn(async move {
                let mut worst = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let now = draining(&sdk, &s).await;
                    if now.len() > max.load(Ordering::Relaxed) {
                        max.store(now.len(), Ordering::Relaxed);
                        worst = now;
                    }
                    samples.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                worst
            })
        };
        Sampler {
            max,
            samples,
            stop,
            task,
        }
    }

    /// The most instances DRAINING at once, how many samples, and who they were.
    pub async fn finish(self) -> (usize, usize, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let worst = self.task.await.unwrap();
        (
            self.max.load(Ordering::Relaxed),
            self.samples.load(Ordering::Relaxed),
            worst,
        )
    }
}

/// Node `i` of `s` is back in service after a repair: ACTIVE, `gpu-medic.health=ok`, no
/// fleet-budget claim or slot attribute left, Healthy in Auto Scaling.
pub async fn assert_back_in_service(sdk: &SdkConfig, s: &Seeded, i: usize) {
    assert_active_and_released(sdk, &s.cluster, &s.nodes[i].arn).await;
    let health = asg_health(sdk, &s.asg).await;
    assert!(
        health.contains(&(s.nodes[i].instance_id.clone(), "Healthy".into())),
        "{health:?}"
    );
}

/// The container instance `arn` is ACTIVE, marked `gpu-medic.health=ok`, with no fleet-budget
/// claim or slot attribute left.
pub async fn assert_active_and_released(sdk: &SdkConfig, cluster: &str, arn: &str) {
    let (status, _, attrs) = instance(sdk, cluster, arn).await;
    assert_eq!(status, "ACTIVE", "{attrs:?}");
    assert!(
        attrs.contains(&("gpu-medic.health".into(), Some("ok".into()))),
        "{attrs:?}"
    );
    assert!(
        !attrs
            .iter()
            .any(|(n, _)| n.contains(".claim.") || n.ends_with(".slot")),
        "fleet budget released: {attrs:?}"
    );
}
