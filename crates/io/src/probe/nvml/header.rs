//! The NVML constants gpu-medic's own code takes from NVIDIA's `nvml.h` (event type bits, the
//! recovery-action field and its values, fabric states, clock event reasons, a struct version
//! word), each under its name in the header. Everything else gpu-medic reads from NVML goes
//! through nvml-wrapper and its bindings (nvml-wrapper-sys), which are checked whole.
//!
//! Why: a value copied from the header by hand is only as good as the copy.
//! `scripts/nvml-header-check.py` compiles NVIDIA's header (pinned releases, fetched from PyPI)
//! and compares every entry here with it; a mismatch fails CI naming the constant
//! (docs/conformance.md). A new constant taken from the header belongs in this list.

use super::{links, poll, raw};
use crate::model::RecoveryAction;

/// The header's name of each clock event reason gpu-medic names (`links::CLOCK_EVENT_REASONS`).
/// The hardware slowdowns kept their `Throttle` names in NVML 13.
const CLOCK_REASON_NAMES: &[(&str, &str)] = &[
    ("gpu-idle", "nvmlClocksEventReasonGpuIdle"),
    (
        "applications-clocks-setting",
        "nvmlClocksEventReasonApplicationsClocksSetting",
    ),
    ("sw-power-cap", "nvmlClocksEventReasonSwPowerCap"),
    ("hw-slowdown", "nvmlClocksThrottleReasonHwSlowdown"),
    ("sync-boost", "nvmlClocksEventReasonSyncBoost"),
    (
        "sw-thermal-slowdown",
        "nvmlClocksEventReasonSwThermalSlowdown",
    ),
    (
        "hw-thermal-slowdown",
        "nvmlClocksThrottleReasonHwThermalSlowdown",
    ),
    (
        "hw-power-brake-slowdown",
        "nvmlClocksThrottleReasonHwPowerBrakeSlowdown",
    ),
    (
        "display-clock-setting",
        "nvmlClocksEventReasonDisplayClockSetting",
    ),
];

/// Every such constant: (its name in `nvml.h`, or a C expression of names there; the value
/// gpu-medic uses). `at least NAME` is a bound: the value must be NAME's or more in every
/// header checked. A clock event reason without a header name here is listed under a name
/// the header cannot have, so the check fails naming it.
pub fn constants() -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = [
        ("nvmlEventTypeXidCriticalError", raw::EVENT_XID),
        ("nvmlEventTypeDoubleBitEccError", raw::EVENT_DOUBLE_BIT_ECC),
        ("nvmlEventTypeGpuRecoveryAction", raw::EVENT_RECOVERY_ACTION),
        (
            "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
            u64::from(poll::FIELD_RECOVERY_ACTION),
        ),
        (
            "NVML_GPU_FABRIC_STATE_NOT_SUPPORTED",
            u64::from(raw::FABRIC_NOT_SUPPORTED),
        ),
        (
            "NVML_GPU_FABRIC_STATE_NOT_STARTED",
            u64::from(raw::FABRIC_NOT_STARTED),
        ),
        (
            "NVML_GPU_FABRIC_STATE_IN_PROGRESS",
            u64::from(raw::FABRIC_IN_PROGRESS),
        ),
        (
            "NVML_GPU_FABRIC_STATE_COMPLETED",
            u64::from(raw::FABRIC_COMPLETED),
        ),
        (
            "nvmlGpuFabricInfo_v3",
            u64::from(raw::FABRIC_INFO_V3_VERSION),
        ),
        // A bound, not a copy: the loop stops at the first link the driver refuses.
        (
            "at least NVML_NVLINK_MAX_LINKS",
            u64::from(links::MAX_NVLINKS),
        ),
        ("nvmlClocksEventReasonGpuIdle", links::REASON_GPU_IDLE),
        (
            "nvmlClocksEventReasonSwThermalSlowdown",
            links::REASON_SW_THERMAL,
        ),
        (
            "nvmlClocksThrottleReasonHwSlowdown | nvmlClocksThrottleReasonHwThermalSlowdown \
             | nvmlClocksThrottleReasonHwPowerBrakeSlowdown",
            poll::HW_SLOWDOWN_MASK,
        ),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_string(), v))
    .collect();
    for (bit, name) in links::CLOCK_EVENT_REASONS {
        let header = CLOCK_REASON_NAMES
            .iter()
            .find(|(n, _)| n == name)
            .map_or_else(
                || format!("<no header name for {name}>"),
                |(_, h)| h.to_string(),
            );
        out.push((header, *bit));
    }
    for v in 0..=u8::MAX {
        if let Some(a) = RecoveryAction::from_nvml(u64::from(v)) {
            let name = a.as_str().to_ascii_uppercase().replace('-', "_");
            out.push((format!("NVML_GPU_RECOVERY_ACTION_{name}"), u64::from(v)));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_clock_reason_and_recovery_action_has_a_header_name() {
        let c = constants();
        assert!(c.iter().all(|(n, _)| !n.starts_with('<')), "{c:?}");
        assert_eq!(
            c.iter()
                .filter(|(n, _)| n.starts_with("NVML_GPU_RECOVERY_ACTION_"))
                .count(),
            5
        );
        assert!(c.contains(&("NVML_GPU_RECOVERY_ACTION_DRAIN_P2P".into(), 3)));
    }
}
