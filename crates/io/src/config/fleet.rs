//! `[fleet]`: the fleet budget (claims or the DynamoDB slot table).

use std::time::Duration;

use serde::Deserialize;

/// The fleet budget: how much of the Auto Scaling group may be in remediation at once.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetConfig {
    /// Most instances in remediation at once: a count (`2`) or a share of desired capacity
    /// (`"20%"`); never less than 1.
    #[serde(default = "default_fleet_share")]
    pub max_parallel: FleetLimit,
    /// Circuit breaker: with more unhealthy instances than this (fleets over 5 instances), no
    /// drain or replace starts; instances stay quarantined.
    #[serde(default = "default_fleet_share")]
    pub max_unhealthy: FleetLimit,
    /// An instance registered with ECS less recently than this counts as in remediation.
    #[serde(default = "default_warmup", with = "humantime_serde")]
    pub warmup: Duration,
    /// An Auto Scaling group tag that pauses drains and replacements (value `true`).
    #[serde(default = "default_pause_tag")]
    pub pause_tag: String,
    /// How long a new claim settles before the claims are re-read and ranked.
    #[serde(default = "default_claim_settle", with = "humantime_serde")]
    pub claim_settle: Duration,
    /// A claim on an instance that never started draining expires after this.
    #[serde(default = "default_claim_ttl", with = "humantime_serde")]
    pub claim_ttl: Duration,
    /// When a full budget, the breaker or a kill switch defers a step, retry after a random
    /// delay below this, the window doubling with each deferral in a row up to 8 times it
    /// (full jitter).
    #[serde(default = "default_fleet_retry_after", with = "humantime_serde")]
    pub retry_after: Duration,
    /// The DynamoDB table of the slot protocol (models/README.md); unset: the claim protocol
    /// on container instance attributes.
    #[serde(default, deserialize_with = "de_table_name")]
    pub table: Option<String>,
    /// Slot table: a reservation this gpu-medic has seen unchanged for this long (its own
    /// monotonic clock) may be taken over. Only has to exceed reserve-to-commit (two writes).
    #[serde(default = "default_reservation_lifetime", with = "humantime_serde")]
    pub reservation_lifetime: Duration,
    /// Fleet incidents (with `table`): the same fatal signal, driver version, AMI and instance
    /// type on this many instances of the group within `pattern_window` is one fleet incident,
    /// and further drains of that fingerprint wait for `gpu-medic fleet ack`; 0 (the default)
    /// turns it off.
    #[serde(default = "default_fingerprint_threshold")]
    pub fingerprint_threshold: u32,
    /// Fleet incidents (with `table`): application faults (judged the program's own) charged
    /// to the same ECS task definition on this many instances within `pattern_window` are ONE
    /// fleet incident naming it (a poison task), paged once; nothing is held. 0 turns it off.
    #[serde(default = "default_task_threshold")]
    pub task_threshold: u32,
    #[serde(default = "default_pattern_window", with = "humantime_serde")]
    pub pattern_window: Duration,
    /// Where the driver's version is read for the fingerprint (its first line).
    #[serde(default = "default_driver_version_file")]
    pub driver_version_file: std::path::PathBuf,
}

/// A number of instances, or a share of the Auto Scaling group's desired capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum FleetLimit {
    Count(u32),
    Percent(f64),
}

impl FleetLimit {
    /// The limit for a group of `desired` instances (shares round down).
    pub fn of(self, desired: u32) -> u32 {
        match self {
            FleetLimit::Count(c) => c,
            FleetLimit::Percent(p) => ((p / 100.0) * f64::from(desired)).floor() as u32,
        }
    }

    pub fn parse(s: &str) -> Result<FleetLimit, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("bad share {s:?}: expected e.g. \"20%\""))?;
            if !(0.0..=100.0).contains(&v) {
                return Err(format!("bad share {s:?}: must be between 0% and 100%"));
            }
            return Ok(FleetLimit::Percent(v));
        }
        t.parse()
            .map(FleetLimit::Count)
            .map_err(|_| format!("bad limit {s:?}: expected a count (2) or a share (\"20%\")"))
    }
}

impl std::fmt::Display for FleetLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FleetLimit::Count(c) => write!(f, "{c}"),
            FleetLimit::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl<'de> Deserialize<'de> for FleetLimit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = FleetLimit;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a count (2) or a share of desired capacity (\"20%\")")
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<FleetLimit, E> {
                u32::try_from(v)
                    .map(FleetLimit::Count)
                    .map_err(|_| E::custom(format!("bad limit {v}: must be 0 or more")))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<FleetLimit, E> {
                u32::try_from(v)
                    .map(FleetLimit::Count)
                    .map_err(|_| E::custom(format!("bad limit {v}: too large")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<FleetLimit, E> {
                FleetLimit::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

fn default_fleet_share() -> FleetLimit {
    FleetLimit::Percent(20.0)
}

fn default_warmup() -> Duration {
    Duration::from_secs(900)
}

fn default_pause_tag() -> String {
    "gpu-medic/paused".to_string()
}

fn default_claim_settle() -> Duration {
    Duration::from_secs(10)
}

fn default_claim_ttl() -> Duration {
    Duration::from_secs(900)
}

fn default_fleet_retry_after() -> Duration {
    Duration::from_secs(60)
}

/// Off by default: holding repairs for an operator is a choice made with the group's own
/// background rate of faults in mind (docs/fleet-scale.md, "Fleet incidents").
fn default_fingerprint_threshold() -> u32 {
    0
}

/// On by default: it holds nothing, and three instances of one task definition faulting
/// within the window is the application's pattern (issue 51, scenario b).
fn default_task_threshold() -> u32 {
    3
}

fn default_pattern_window() -> Duration {
    Duration::from_secs(3600)
}

fn default_driver_version_file() -> std::path::PathBuf {
    std::path::PathBuf::from("/proc/driver/nvidia/version")
}

fn default_reservation_lifetime() -> Duration {
    Duration::from_secs(30)
}

/// A DynamoDB table name: 3 to 255 of `[A-Za-z0-9_.-]`, or a table ARN (DynamoDB accepts
/// either as `TableName`). A typo is caught at startup, not on the first fault.
fn de_table_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    let s = String::deserialize(d)?;
    let name = s.strip_prefix("arn:").map_or(s.as_str(), |arn| {
        arn.rsplit_once(":table/").map_or("", |(_, n)| n)
    });
    let ok = (3..=255).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if !ok {
        return Err(serde::de::Error::custom(format!(
            "{s:?} is not a DynamoDB table name (3 to 255 of A-Z a-z 0-9 _ - .) or table ARN"
        )));
    }
    Ok(Some(s))
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            max_parallel: default_fleet_share(),
            max_unhealthy: default_fleet_share(),
            warmup: default_warmup(),
            pause_tag: default_pause_tag(),
            claim_settle: default_claim_settle(),
            claim_ttl: default_claim_ttl(),
            retry_after: default_fleet_retry_after(),
            table: None,
            reservation_lifetime: default_reservation_lifetime(),
            fingerprint_threshold: default_fingerprint_threshold(),
            task_threshold: default_task_threshold(),
            pattern_window: default_pattern_window(),
            driver_version_file: default_driver_version_file(),
        }
    }
}
