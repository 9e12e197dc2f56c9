//! The vocabulary of disruptions AWS plans for this instance, as IMDS announces them
//! (docs/planned-events.md): scheduled events (`events/maintenance/scheduled`), the Spot
//! interruption notice (`spot/instance-action`) and the rebalance recommendation
//! (`events/recommendations/rebalance`); and the ECS agent's own health verdict.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::Timestamp;

/// How far ahead a Spot interruption time may be and still be AWS's: the notice "is a
/// warning that is issued two minutes before Amazon EC2 stops or terminates your Spot
/// Instance" (Amazon EC2 User Guide, "Spot Instance interruption notices"); ten minutes
/// allows for a clock that is off. A time further ahead is logged as implausible, never
/// drained for (docs/planned-events.md#plausible-notices).
pub const SPOT_MAX_AHEAD: Duration = Duration::from_secs(10 * 60);
/// The longest window (NotAfter - NotBefore) a scheduled event may have and still be
/// AWS's: AWS's windows are hours long (its own event windows are time ranges of at least 2
/// hours, 4 in all: Amazon EC2 User Guide, "Define event windows for scheduled events");
/// a week is far beyond any.
pub const EVENT_MAX_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
/// How far ahead a scheduled event's NotBefore may be: AWS schedules events days to weeks
/// ahead and lets them be moved only up to their deadline (Amazon EC2 User Guide,
/// "Scheduled events for Amazon EC2 instances", "Reschedule a scheduled event"); a year is
/// far beyond that.
pub const EVENT_MAX_AHEAD: Duration = Duration::from_secs(365 * 24 * 3600);

/// Why a scheduled event's times are not AWS's practice (`None`: plausible).
pub fn implausible_event(
    now: Timestamp,
    not_before: Timestamp,
    not_after: Option<Timestamp>,
) -> Option<String> {
    let human = |d: Duration| humantime::format_duration(Duration::from_secs(d.as_secs()));
    if not_before.since(now) > EVENT_MAX_AHEAD {
        return Some(format!(
            "NotBefore {not_before} is {} ahead, more than the {} AWS's scheduled events ever are",
            human(not_before.since(now)),
            human(EVENT_MAX_AHEAD)
        ));
    }
    let end = not_after?;
    if end.since(not_before) > EVENT_MAX_WINDOW {
        return Some(format!(
            "its window NotBefore {not_before} to NotAfter {end} is {} long, more than the {} of any AWS maintenance window",
            human(end.since(not_before)),
            human(EVENT_MAX_WINDOW)
        ));
    }
    None
}

/// Why a Spot interruption time is not AWS's practice (`None`: plausible).
pub fn implausible_spot(now: Timestamp, time: Timestamp) -> Option<String> {
    (time.since(now) > SPOT_MAX_AHEAD).then(|| {
        format!(
            "the time {time} is {} ahead; AWS gives two minutes' notice (at most {} is believed)",
            humantime::format_duration(Duration::from_secs(time.since(now).as_secs())),
            humantime::format_duration(SPOT_MAX_AHEAD)
        )
    })
}

/// The state IMDS gives a scheduled event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EventState {
    Active,
    Completed,
    Canceled,
}

impl EventState {
    /// IMDS's word (`active`, `completed`, `canceled`); None for any other.
    pub fn parse(s: &str) -> Option<EventState> {
        match s.trim().to_ascii_lowercase().as_str() {
            "active" => Some(EventState::Active),
            "completed" => Some(EventState::Completed),
            "canceled" | "cancelled" => Some(EventState::Canceled),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            EventState::Active => "active",
            EventState::Completed => "completed",
            EventState::Canceled => "canceled",
        }
    }
}

/// What a scheduled event does to the instance, by its IMDS `Code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EventClass {
    /// `instance-retirement`, `instance-stop`: the instance stops for good (EBS-backed
    /// instances may be started again elsewhere; an Auto Scaling group replaces it).
    Stop,
    /// `instance-reboot`, `system-reboot`: the instance reboots and comes back on the same host.
    Reboot,
    /// `system-maintenance`: the host is worked on; network or power may be interrupted.
    Maintenance,
    /// A code this gpu-medic does not know.
    Unknown,
}

impl EventClass {
    pub fn of(code: &str) -> EventClass {
        match code {
            "instance-retirement" | "instance-stop" => EventClass::Stop,
            "instance-reboot" | "system-reboot" => EventClass::Reboot,
            "system-maintenance" => EventClass::Maintenance,
            _ => EventClass::Unknown,
        }
    }
}

/// One entry of `events/maintenance/scheduled`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduledEvent {
    /// `EventId` (`instance-event-0d59937288b749b32`).
    pub id: String,
    /// `Code`: `instance-reboot`, `system-reboot`, `system-maintenance`,
    /// `instance-retirement`, `instance-stop`.
    pub code: String,
    pub state: EventState,
    pub not_before: Timestamp,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_after: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
    /// The kernel's boot id when the probe read it: a new one after the event means the
    /// instance rebooted.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub boot_id: String,
}

impl ScheduledEvent {
    pub fn class(&self) -> EventClass {
        EventClass::of(&self.code)
    }
}

impl fmt::Display for ScheduledEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.code, self.state.as_str())
    }
}

/// The ECS agent's verdict on the instance's accelerators (`healthStatus.details[]` of type
/// `ACCELERATED_COMPUTE`, or the overall status where no such detail is given).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentVerdict {
    /// `OK`, `IMPAIRED`, `INSUFFICIENT_DATA`, `INITIALIZING`.
    pub status: String,
    pub since: Timestamp,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl AgentVerdict {
    pub fn impaired(&self) -> bool {
        self.status == "IMPAIRED"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_beyond_aws_practice_are_implausible() {
        let now = Timestamp(1_000_000_000);
        let min = |m: u64| Duration::from_secs(m * 60);
        assert!(implausible_spot(now, now.plus(min(2))).is_none());
        assert!(implausible_spot(now, now.plus(min(11))).is_some());
        assert!(
            implausible_spot(now, Timestamp(0)).is_none(),
            "past: another check"
        );
        let day = Duration::from_secs(86_400);
        assert!(
            implausible_event(now, now.plus(day * 14), Some(now.plus(day * 14 + min(120))))
                .is_none()
        );
        assert!(implausible_event(now, now.plus(min(5)), Some(now.plus(day * 365 * 50))).is_some());
        assert!(implausible_event(now, now.plus(day * 365 * 30), None).is_some());
    }
}
