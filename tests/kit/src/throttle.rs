//! The control plane's weather for the recording proxy ([`crate::proxy`]): AWS-shaped request
//! throttling (a token bucket per API action, or per service where AWS keeps one bucket for
//! all its actions, from a table of the documented default rates: [`RATES`]), scalable by a
//! factor so that N test daemons are throttled as N / factor real instances would be, and
//! answered exactly as each service answers a throttled call ([`Service::throttled`]); plus
//! added latency, bursts of 5xx answers and an outage switch, per service.
//!
//! Why here and not in moto: moto throttles nothing, and the proxy already sees every call of
//! every daemon. The rates and their sources are in docs/fleet-scale.md ("The rates the proxy
//! enforces"); where AWS publishes no number the table says so and holds a conservative one.
//! Calls the harness itself makes (seeding, the played Auto Scaling and ECS agent) carry the
//! access key [`HARNESS_KEY`] and are never throttled or faulted: they are not gpu-medic's.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::stats::Rng;

/// The access key id of the harness's own SDK calls (the kit's [`crate::aws::sdk`]).
pub const HARNESS_KEY: &str = "test";

/// The AWS service a call is for, from its protocol's markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Service {
    Ecs,
    AutoScaling,
    Ec2,
    DynamoDb,
    Logs,
    Events,
    S3,
    Other,
}

impl Service {
    pub const ALL: [Service; 7] = [
        Service::Ecs,
        Service::AutoScaling,
        Service::Ec2,
        Service::DynamoDb,
        Service::Logs,
        Service::Events,
        Service::S3,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Service::Ecs => "ecs",
            Service::AutoScaling => "autoscaling",
            Service::Ec2 => "ec2",
            Service::DynamoDb => "dynamodb",
            Service::Logs => "logs",
            Service::Events => "events",
            Service::S3 => "s3",
            Service::Other => "other",
        }
    }

    /// The service of a request: the JSON protocols' `X-Amz-Target` prefix, the Query
    /// protocols' `Version` (Auto Scaling 2011-01-01, EC2 2016-11-15), else S3's REST shape.
    pub fn of(target: Option<&str>, form: &str, s3: bool) -> Service {
        if let Some(t) = target {
            let prefix = t.split('.').next().unwrap_or("");
            return match prefix {
                p if p.starts_with("AmazonEC2ContainerService") => Service::Ecs,
                p if p.starts_with("DynamoDB_") => Service::DynamoDb,
                p if p.starts_with("Logs_") => Service::Logs,
                "AWSEvents" => Service::Events,
                _ => Service::Other,
            };
        }
        let version = form
            .split('&')
            .find_map(|kv| kv.strip_prefix("Version="))
            .unwrap_or("");
        match version {
            "2011-01-01" => Service::AutoScaling,
            "2016-11-15" => Service::Ec2,
            _ if s3 => Service::S3,
            _ => Service::Other,
        }
    }

    /// (status, content type, body) of this service's answer to a throttled call:
    /// ECS, CloudWatch Logs and EventBridge (JSON 1.1) `ThrottlingException` with HTTP 400;
    /// DynamoDB (JSON 1.0) its namespaced `ThrottlingException`, HTTP 400 (what an on-demand
    /// table answers; a provisioned one says `ProvisionedThroughputExceededException`);
    /// Auto Scaling's Query XML `Throttling`, HTTP 400; EC2's own error shape
    /// `RequestLimitExceeded`, HTTP 503; S3 `SlowDown`, HTTP 503. None of these services
    /// answers 429 (that is API Gateway's and Lambda's way): docs/fleet-scale.md.
    pub fn throttled(self, op: &str) -> (u16, &'static str, String) {
        match self {
            Service::Ecs | Service::Logs | Service::Events | Service::Other => (
                400,
                "application/x-amz-json-1.1",
                r#"{"__type":"ThrottlingException","message":"Rate exceeded"}"#.to_string(),
            ),
            Service::DynamoDb => (
                400,
                "application/x-amz-json-1.0",
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#ThrottlingException","message":"Throughput exceeds the current capacity of your table or index. DynamoDB is automatically scaling your table or index so please try again shortly."}"#.to_string(),
            ),
            Service::AutoScaling => (400, "text/xml", query_error("Sender", "Throttling", "Rate exceeded")),
            Service::Ec2 => (
                503,
                "text/xml",
                format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>RequestLimitExceeded</Code><Message>Request limit exceeded. Account has been throttled on ec2:{op} because it exceeded its request rate limit.</Message></Error></Errors><RequestID>throttled</RequestID></Response>"
                ),
            ),
            Service::S3 => (
                503,
                "application/xml",
                "<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message><RequestId>throttled</RequestId></Error>".to_string(),
            ),
        }
    }

    /// (status, content type, body) of a server-side failure in this service's words.
    pub fn unavailable(self) -> (u16, &'static str, String) {
        match self {
            Service::Ecs => (
                500,
                "application/x-amz-json-1.1",
                r#"{"__type":"ServerException","message":"Service unavailable"}"#.to_string(),
            ),
            Service::Logs => (
                500,
                "application/x-amz-json-1.1",
                r#"{"__type":"ServiceUnavailableException","message":"Service unavailable"}"#
                    .to_string(),
            ),
            Service::Events | Service::Other => (
                500,
                "application/x-amz-json-1.1",
                r#"{"__type":"InternalException","message":"Internal failure"}"#.to_string(),
            ),
            Service::DynamoDb => (
                500,
                "application/x-amz-json-1.0",
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#InternalServerError","message":"Internal server error"}"#.to_string(),
            ),
            Service::AutoScaling => (
                500,
                "text/xml",
                query_error("Receiver", "InternalFailure", "Internal failure"),
            ),
            Service::Ec2 => (
                503,
                "text/xml",
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>Unavailable</Code><Message>The server is overloaded and can't handle the request.</Message></Error></Errors><RequestID>unavailable</RequestID></Response>".to_string(),
            ),
            Service::S3 => (
                503,
                "application/xml",
                "<Error><Code>ServiceUnavailable</Code><Message>Service unavailable</Message><RequestId>unavailable</RequestId></Error>".to_string(),
            ),
        }
    }
}

fn query_error(kind: &str, code: &str, message: &str) -> String {
    format!(
        "<ErrorResponse xmlns=\"http://autoscaling.amazonaws.com/doc/2011-01-01/\"><Error><Type>{kind}</Type><Code>{code}</Code><Message>{message}</Message></Error><RequestId>injected</RequestId></ErrorResponse>"
    )
}

/// Whether a rate is AWS's published number or a choice made here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    /// Read on AWS's page (docs/fleet-scale.md cites it).
    Documented,
    /// AWS publishes a rate but the number could not be read here; a conservative stand-in.
    Assumed,
    /// AWS publishes no number; a conservative choice.
    Unpublished,
}

/// One row of the rate table: the actions of `service` it covers ("*": every action of the
/// service not named in another row), the bucket they share, and its default rate.
#[derive(Debug, Clone, Copy)]
pub struct RateRow {
    pub service: Service,
    pub actions: &'static [&'static str],
    /// The bucket's name: actions with the same bucket draw from one bucket.
    pub bucket: &'static str,
    /// Tokens added per second (the sustained rate).
    pub sustained: f64,
    /// The bucket's size (the burst).
    pub burst: f64,
    pub basis: Basis,
}

/// The default rates, per account and Region, of the actions gpu-medic calls
/// (docs/fleet-scale.md, "The rates the proxy enforces", cites each).
pub const RATES: &[RateRow] = &[
    RateRow {
        service: Service::Ecs,
        actions: &["DescribeContainerInstances", "ListContainerInstances"],
        bucket: "ecs:container-instance-read",
        sustained: 20.0,
        burst: 50.0,
        basis: Basis::Assumed,
    },
    RateRow {
        service: Service::Ecs,
        actions: &["DescribeTasks", "ListTasks", "DescribeTaskDefinition"],
        bucket: "ecs:task-read",
        sustained: 20.0,
        burst: 50.0,
        basis: Basis::Assumed,
    },
    RateRow {
        service: Service::Ecs,
        actions: &["DescribeClusters", "ListClusters"],
        bucket: "ecs:cluster-read",
        sustained: 20.0,
        burst: 50.0,
        basis: Basis::Documented,
    },
    RateRow {
        service: Service::Ecs,
        actions: &["*"],
        bucket: "ecs:modify",
        sustained: 1.0,
        burst: 20.0,
        basis: Basis::Assumed,
    },
    RateRow {
        service: Service::AutoScaling,
        actions: &["*"],
        bucket: "autoscaling:all",
        sustained: 5.0,
        burst: 20.0,
        basis: Basis::Unpublished,
    },
    RateRow {
        service: Service::Ec2,
        actions: &["DescribeInstances"],
        bucket: "ec2:DescribeInstances",
        sustained: 20.0,
        burst: 100.0,
        basis: Basis::Documented,
    },
    RateRow {
        service: Service::Ec2,
        actions: &["*"],
        bucket: "ec2:mutating",
        sustained: 5.0,
        burst: 50.0,
        basis: Basis::Assumed,
    },
    RateRow {
        service: Service::DynamoDb,
        actions: &["GetItem"],
        bucket: "dynamodb:read-one-partition",
        sustained: 3000.0,
        burst: 3000.0,
        basis: Basis::Documented,
    },
    RateRow {
        service: Service::DynamoDb,
        actions: &["*"],
        bucket: "dynamodb:write-one-partition",
        sustained: 1000.0,
        burst: 1000.0,
        basis: Basis::Documented,
    },
    RateRow {
        service: Service::Logs,
        actions: &["PutLogEvents"],
        bucket: "logs:PutLogEvents",
        sustained: 800.0,
        burst: 800.0,
        basis: Basis::Assumed,
    },
    RateRow {
        service: Service::Logs,
        actions: &["CreateLogStream"],
        bucket: "logs:CreateLogStream",
        sustained: 50.0,
        burst: 50.0,
        basis: Basis::Documented,
    },
    RateRow {
        service: Service::Logs,
        actions: &["*"],
        bucket: "logs:other",
        sustained: 5.0,
        burst: 5.0,
        basis: Basis::Assumed,
    },
    RateRow {
        service: Service::Events,
        actions: &["*"],
        bucket: "events:PutEvents",
        sustained: 10_000.0,
        burst: 10_000.0,
        basis: Basis::Documented,
    },
];

/// The row that governs `op` of `service` (S3 and unknown services: none, never throttled).
pub fn row(service: Service, op: &str) -> Option<&'static RateRow> {
    RATES
        .iter()
        .find(|r| r.service == service && r.actions.contains(&op))
        .or_else(|| {
            RATES
                .iter()
                .find(|r| r.service == service && r.actions.contains(&"*"))
        })
}

/// A token bucket: `burst` tokens at most, `sustained` added per second.
#[derive(Debug, Clone)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// What the weather does to one call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Forward it (after `delay`).
    Pass { delay: Duration },
    /// Answer it as the service answers a throttled call.
    Throttle,
    /// Answer it with a server-side failure (a 5xx burst).
    Fail,
    /// No answer: the connection is closed (an outage, as a client sees an unreachable
    /// endpoint).
    Hangup,
}

/// Per-service trouble that is not throttling.
#[derive(Debug, Clone, Default)]
struct Trouble {
    /// Added latency, a uniform draw in [lo, hi] ms.
    latency_ms: (u64, u64),
    /// Until this instant, this share of the calls fails with a 5xx.
    failing: Option<(Instant, f64)>,
    /// Until this instant, nothing answers.
    outage: Option<Instant>,
}

/// Throttling by the rate table scaled by `factor`, plus latency, 5xx bursts and outages.
#[derive(Debug)]
pub struct Weather {
    /// Rates are multiplied by this (a bucket keeps at least one token of room).
    pub factor: f64,
    buckets: BTreeMap<&'static str, Bucket>,
    trouble: BTreeMap<Service, Trouble>,
    rng: Rng,
}

impl Weather {
    /// Throttling at `factor` times the default rates (1.0: one real account; N / 10,000 to
    /// throttle N daemons as 10,000 instances would be).
    pub fn scaled(factor: f64, seed: u64) -> Weather {
        Weather {
            factor,
            buckets: BTreeMap::new(),
            trouble: BTreeMap::new(),
            rng: Rng::new(seed),
        }
    }

    /// The scaled (sustained, burst) of a row.
    pub fn rate(&self, r: &RateRow) -> (f64, f64) {
        (r.sustained * self.factor, (r.burst * self.factor).max(1.0))
    }

    /// Adds a latency of `lo..=hi` ms to every call of `service`.
    pub fn latency(&mut self, service: Service, lo_ms: u64, hi_ms: u64) {
        self.trouble.entry(service).or_default().latency_ms = (lo_ms, hi_ms.max(lo_ms));
    }

    /// For `how_long` from now, `share` (0 to 1) of the calls of `service` fail with a 5xx.
    pub fn fail_burst(&mut self, service: Service, share: f64, how_long: Duration) {
        self.trouble.entry(service).or_default().failing =
            Some((Instant::now() + how_long, share.clamp(0.0, 1.0)));
    }

    /// For `how_long` from now, nothing of `service` answers.
    pub fn outage(&mut self, service: Service, how_long: Duration) {
        self.trouble.entry(service).or_default().outage = Some(Instant::now() + how_long);
    }

    /// Ends every outage, 5xx burst and latency now (throttling stays).
    pub fn clear_trouble(&mut self) {
        self.trouble.clear();
    }

    /// The verdict for one call of `op` to `service`, arriving now.
    pub fn judge(&mut self, service: Service, op: &str) -> Verdict {
        let now = Instant::now();
        let trouble = self.trouble.get(&service).cloned().unwrap_or_default();
        if trouble.outage.is_some_and(|until| now < until) {
            return Verdict::Hangup;
        }
        if let Some(r) = row(service, op) {
            let (sustained, burst) = self.rate(r);
            let b = self.buckets.entry(r.bucket).or_insert(Bucket {
                tokens: burst,
                at: now,
            });
            let elapsed = now.saturating_duration_since(b.at).as_secs_f64();
            b.tokens = (b.tokens + elapsed * sustained).min(burst);
            b.at = now;
            if b.tokens < 1.0 {
                return Verdict::Throttle;
            }
            b.tokens -= 1.0;
        }
        if let Some((until, share)) = trouble.failing
            && now < until
            && self.rng.unit() < share
        {
            return Verdict::Fail;
        }
        let (lo, hi) = trouble.latency_ms;
        Verdict::Pass {
            delay: if hi == 0 {
                Duration::ZERO
            } else {
                self.rng.range_ms(lo, hi)
            },
        }
    }
}

/// The access key id a SigV4 request was signed with (`Credential=<key>/<date>/...` in its
/// `Authorization` header): who made the call, when each daemon has its own key.
pub fn access_key(head: &str) -> Option<&str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        if !k.trim().eq_ignore_ascii_case("authorization") {
            return None;
        }
        let cred = v.split("Credential=").nth(1)?;
        cred.split('/').next()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_service_is_known_by_its_protocol() {
        let t = |t: &str| Service::of(Some(t), "", false);
        assert_eq!(
            t("AmazonEC2ContainerServiceV20141113.DescribeContainerInstances"),
            Service::Ecs
        );
        assert_eq!(t("DynamoDB_20120810.GetItem"), Service::DynamoDb);
        assert_eq!(t("Logs_20140328.PutLogEvents"), Service::Logs);
        assert_eq!(t("AWSEvents.PutEvents"), Service::Events);
        assert_eq!(
            Service::of(
                None,
                "Action=DescribeAutoScalingGroups&Version=2011-01-01",
                false
            ),
            Service::AutoScaling
        );
        assert_eq!(
            Service::of(None, "Action=DescribeInstances&Version=2016-11-15", false),
            Service::Ec2
        );
        assert_eq!(Service::of(None, "", true), Service::S3);
    }

    #[test]
    fn a_bucket_lets_its_burst_through_then_its_sustained_rate() {
        let mut w = Weather::scaled(1.0, 1);
        // Auto Scaling's one bucket: 20 at once, then throttled.
        let passed = (0..30)
            .filter(|_| {
                w.judge(Service::AutoScaling, "DescribeAutoScalingGroups") != Verdict::Throttle
            })
            .count();
        assert_eq!(passed, 20);
        // Every Auto Scaling action shares it.
        assert_eq!(
            w.judge(Service::AutoScaling, "SetInstanceHealth"),
            Verdict::Throttle
        );
        // Another service's bucket is untouched.
        assert!(matches!(
            w.judge(Service::Ec2, "DescribeInstances"),
            Verdict::Pass { .. }
        ));
        // Scaled down, a bucket still holds one call.
        let mut tiny = Weather::scaled(0.0001, 1);
        assert!(matches!(
            tiny.judge(Service::Ecs, "PutAttributes"),
            Verdict::Pass { .. }
        ));
        assert_eq!(tiny.judge(Service::Ecs, "PutAttributes"), Verdict::Throttle);
    }

    #[test]
    fn outages_and_failures_end_and_throttled_answers_are_the_services_own() {
        let mut w = Weather::scaled(1000.0, 7);
        w.outage(Service::Ecs, Duration::from_secs(60));
        assert_eq!(
            w.judge(Service::Ecs, "ListContainerInstances"),
            Verdict::Hangup
        );
        w.clear_trouble();
        w.fail_burst(Service::DynamoDb, 1.0, Duration::from_secs(60));
        assert_eq!(w.judge(Service::DynamoDb, "GetItem"), Verdict::Fail);
        assert_eq!(Service::Ec2.throttled("DescribeInstances").0, 503);
        assert!(
            Service::Ec2
                .throttled("x")
                .2
                .contains("RequestLimitExceeded")
        );
        assert!(
            Service::AutoScaling
                .throttled("x")
                .2
                .contains("<Code>Throttling</Code>")
        );
        assert!(
            Service::DynamoDb
                .throttled("x")
                .2
                .contains("#ThrottlingException")
        );
        assert_eq!(Service::Ecs.throttled("x").0, 400);
    }

    #[test]
    fn the_caller_is_read_from_the_signature() {
        let head = "POST / HTTP/1.1\r\nAuthorization: AWS4-HMAC-SHA256 Credential=NODE0007/20260101/us-east-1/ecs/aws4_request, SignedHeaders=host, Signature=ab\r\n";
        assert_eq!(access_key(head), Some("NODE0007"));
        assert_eq!(access_key("GET / HTTP/1.1\r\n"), None);
    }
}
