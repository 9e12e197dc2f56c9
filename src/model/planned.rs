//! The vocabulary of disruptions AWS plans for this instance, as IMDS announces them
//! (docs/planned-events.md): scheduled events (`events/maintenance/scheduled`), the Spot
//! interruption notice (`spot/instance-action`) and the rebalance recommendation
//! (`events/recommendations/rebalance`); and the ECS agent's own health verdict.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::Timestamp;

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
