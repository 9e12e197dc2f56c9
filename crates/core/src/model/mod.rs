//! The shared vocabulary: what the probes see (`Observation`), what the engine orders
//! (`Action`), what the remedies report back (`Outcome`), and what the journal keeps
//! (`Record`, `Incident`). Everything here is plain data that serializes to stable JSON,
//! because the same types travel through `inputs.jsonl`, `incidents.jsonl` and `--json`.

pub mod attribution;
pub mod bounded;
mod budget;
pub mod cursor;
pub mod diagnosis;
pub mod driver_line;
pub mod escape;
pub mod gpu_view;
pub mod links;
pub mod mps_view;
pub use budget::FleetBudgetView;
mod export;
pub use export::ExportLag;

pub use cursor::{Cursor, Delivery, Resume, StreamId};

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

mod bounds;

pub use bounds::{
    MAX_COMPOSED, MAX_COUNTER, MAX_ITEMS, MAX_NAME, MAX_OPEN_INCIDENTS, MAX_REBOOT_HISTORY,
    MAX_REBUILT_ID, MAX_TEXT, cut,
};
mod evidence;
pub use evidence::{EvidenceMode, EvidencePlan, EvidenceRef, MissingPart};
pub mod planned;
pub mod repair;
pub use planned::{AgentVerdict, EventClass, EventState, ScheduledEvent};

/// A point in time, in milliseconds since the Unix epoch. The engine never reads a clock:
/// the supervisor stamps every input, and replays reuse the recorded stamps. Arithmetic on it
/// saturates (a deadline far in the future is "never", not a panic), and it is written as
/// RFC 3339, saturated at the last millisecond that form can hold (year 9999).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(pub u64);

/// Milliseconds of 9999-12-31T23:59:59.999Z, the last instant RFC 3339 can write.
pub const MAX_RFC3339_MS: u64 = 253_402_300_799_999;

/// A duration in whole milliseconds, saturated to `u64`.
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Timestamp {
    pub fn now() -> Self {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(millis)
            .unwrap_or(0);
        Timestamp(ms)
    }

    pub fn plus(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_add(millis(d)))
    }

    pub fn minus(self, d: Duration) -> Self {
        Timestamp(self.0.saturating_sub(millis(d)))
    }

    /// Time from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0.min(MAX_RFC3339_MS))
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        let t =
            humantime::parse_rfc3339_weak(s).map_err(|e| format!("bad timestamp {s:?}: {e}"))?;
        let ms = t
            .duration_since(UNIX_EPOCH)
            .map_err(|_| format!("timestamp {s:?} is before 1970"))?;
        let ms = millis(ms);
        Ok(Timestamp(ms))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}",
            humantime::format_rfc3339_millis(self.to_system_time())
        )
    }
}

impl Serialize for Timestamp {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        Timestamp::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// Which GPU, in every form an operator or a tool may search for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct GpuId {
    pub index: u32,
    #[serde(default)]
    pub uuid: String,
    #[serde(default)]
    pub pci_bus_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
}

impl GpuId {
    pub fn index_only(index: u32) -> Self {
        GpuId {
            index,
            ..GpuId::default()
        }
    }
}

impl fmt::Display for GpuId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GPU {}", self.index)?;
        if !self.uuid.is_empty() {
            write!(f, " ({}", self.uuid)?;
            if !self.pci_bus_id.is_empty() {
                write!(f, ", {}", self.pci_bus_id)?;
            }
            write!(f, ")")?;
        }
        Ok(())
    }
}

/// The driver's own verdict (NVML field 230, event 0x8000, XID 154).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecoveryAction {
    None,
    GpuReset,
    NodeReboot,
    DrainP2p,
    DrainAndReset,
}

impl RecoveryAction {
    /// Maps NVML's `nvmlDeviceGpuRecoveryAction_t` value.
    pub fn from_nvml(v: u64) -> Option<Self> {
        Some(match v {
            0 => RecoveryAction::None,
            1 => RecoveryAction::GpuReset,
            2 => RecoveryAction::NodeReboot,
            3 => RecoveryAction::DrainP2p,
            4 => RecoveryAction::DrainAndReset,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryAction::None => "none",
            RecoveryAction::GpuReset => "gpu-reset",
            RecoveryAction::NodeReboot => "node-reboot",
            RecoveryAction::DrainP2p => "drain-p2p",
            RecoveryAction::DrainAndReset => "drain-and-reset",
        }
    }
}

/// What NVIDIA's catalog says one occurrence of an XID needs, where that depends on more than
/// the code: the decode sheet of the NVLink5 XIDs 144-150 (by the error status in the XID's
/// text) and CHECK_UVM of XID 159 (by whether UVM is in use). `docs/xid-catalog.md`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum XidDecode {
    /// The sheet's IGNORE (no action required).
    #[serde(rename = "ignore")]
    Ignore,
    /// XID_154_EVAL: the recovery action a following XID 154 announces decides; without one,
    /// RESTART_APP.
    #[serde(rename = "xid-154-eval")]
    Xid154Eval,
    /// The message could not be decoded (no text, or no row of the sheet matches it).
    #[serde(rename = "undecoded")]
    Undecoded,
    /// RESET_GPU.
    #[serde(rename = "reset-gpu")]
    ResetGpu,
}

impl XidDecode {
    pub const ALL: [XidDecode; 4] = [
        XidDecode::Ignore,
        XidDecode::Xid154Eval,
        XidDecode::Undecoded,
        XidDecode::ResetGpu,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            XidDecode::Ignore => "ignore",
            XidDecode::Xid154Eval => "xid-154-eval",
            XidDecode::Undecoded => "undecoded",
            XidDecode::ResetGpu => "reset-gpu",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        XidDecode::ALL.into_iter().find(|d| d.as_str() == s)
    }
}

/// Auto Scaling lifecycle states gpu-medic reacts to (IMDS `target-lifecycle-state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LifecycleState {
    InService,
    Terminating,
    Pending,
}

/// The source of an [`Signal::MpsCrash`] that systemd's `Restart=` made: the engine does not
/// count the one restart each of gpu-medic's own restarts causes.
pub const MPS_UNIT_SOURCE: &str = "mps-unit";

/// What a probe saw. One signal per observation; the engine judges it against the policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Signal {
    /// An XID from NVML's event set or the kernel log. `decode`: NVIDIA's immediate action
    /// for this occurrence, where the catalog makes it depend on the XID's text or the node
    /// (NVLink5 XIDs 144-150, XID 159); absent for every other XID and in records written
    /// before it existed.
    Xid {
        code: u32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        decode: Option<XidDecode>,
    },
    RecoveryAction {
        action: RecoveryAction,
    },
    EccUncorrected,
    EccCorrected,
    RowRemapPending,
    RowRemapFailure,
    RowRemapUncorrectable,
    RetiredPagesPending,
    RetiredPages,
    GpuLost,
    DeviceCountMismatch,
    DriverNotLoaded,
    NvmlEventUnknown,
    Thermal,
    HwSlowdown,
    MpsUnresponsive,
    MpsDown,
    MpsServerFault,
    /// The MPS daemon or one of its servers died: a server's failed start or exit in the
    /// daemon's lines (source `mps`), or a restart of the daemon's unit by systemd's
    /// `Restart=` (source [`MPS_UNIT_SOURCE`]). One per crash: how many make a loop is the
    /// policy's `confirm` window (rule `mps-crash-loop`), not the probe's. Written
    /// `mps-crash-loop` in journals of earlier gpu-medic builds, when the probe counted (read as
    /// this).
    #[serde(alias = "mps-crash-loop")]
    MpsCrash,
    /// The ECS agent does not answer its introspection API (value: consecutive checks).
    EcsAgentDown,
    /// The filesystem holding `state_dir` is nearly full (value: percent used).
    StateDiskFull,
    /// ECS still lists a GPU for placement (DescribeContainerInstances `gpuDevices`, or the
    /// registered `GPU` resource) that NVML reports lost or does not see at all (value: the
    /// containers ECS assigned to it).
    EcsGpuMissing,
    /// ECS and NVML count this instance's GPUs differently (value: the difference).
    EcsGpuCountMismatch,
    /// ECS believes more of a GPU's memory is free for new MPS tasks (`remainingMemoryInMiB`)
    /// than NVML shows free (value: the excess, MiB).
    EcsGpuMemoryInUse,
    /// An ECS task's MPS clients together use more GPU memory than its task definition
    /// reserves (`sharingStrategy.nvidiaMps.memory`, summed over its containers), or more
    /// than `[nvml] reservation_alert` of it (value: percent of the reservation in use;
    /// `tasks`: the task ARN; the detail has the numbers). Reported once per crossing.
    GpuMemoryOverReservation,
    /// A CUDA process runs outside MPS on a GPU that MPS serves: NVML lists it among the
    /// GPU's compute processes but not among its MPS clients (the MPS server, gpu-medic's own
    /// diagnostics and DCGM excepted). It has no memory ceiling and the whole GPU's compute
    /// (docs/mps.md#the-mps-contract-and-what-gpu-medic-checks). Value: 1 when the process
    /// runs in an ECS task (`tasks` names it: stop-tasks stops it, and it starts again
    /// under MPS), 0 when it runs in none. Reported once per process (pid and start time).
    MpsBypass,
    /// An MPS client of an ECS task runs without the limits its task definition asked for:
    /// no `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (or `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` where
    /// `maxComputePercent` is set) in its environment, or a larger one than its container
    /// reserved (value: the limit in force, MiB, 0 when none; `tasks`: the task). Once per
    /// process.
    MpsLimitMismatch,
    /// The GPU processes of one container of an ECS task together use more GPU memory than
    /// the container reserves (`sharingStrategy.nvidiaMps.memory`): each process may stay
    /// under its pinned limit while all of them together do not (value: processes in the
    /// container; `tasks`: the task). Once per crossing.
    ContainerGpuMemoryOverReservation,
    /// MPS's own view against NVML's (docs/mps.md#mpss-own-view): the control daemon lists a
    /// client of one of its servers (`get_client_list`) that NVML lists on no GPU as an MPS
    /// client, on two looks in a row (value: 1 when the process is gone, so the server holds
    /// a client that exited; 0 while it runs; `tasks`: its ECS task). Once per process.
    MpsClientNotOnGpu,
    /// NVML lists an MPS client on a GPU that no server of the control daemon lists, on two
    /// looks in a row: another MPS daemon (another pipe directory) serves it, outside this
    /// daemon's servers (value: 1 when it runs in an ECS task, 0 when not). Once per process.
    MpsClientNoServer,
    /// A server of the control daemon that lists no client holds GPU memory (NVML's compute
    /// list gives its process that much on the GPU; value: MiB), on two looks in a row.
    MpsServerIdleMemory,
    /// A client served by a server of another user: the server runs as a uid other than root
    /// (a per-user server; `-multiuser-server` runs one root server for every uid) and the
    /// client's real uid is another (value: 1 when it runs in an ECS task, 0 when not).
    /// Once per process.
    MpsWrongServer,
    /// The MPS control daemon answered a probe: the all-clear for MPS incidents.
    MpsUp,
    Lifecycle {
        state: LifecycleState,
    },
    /// The GPU's NVLink fabric registration (`nvmlDeviceGetGpuFabricInfo`) has not completed
    /// within `[links] fabric_deadline` after boot (value: seconds since boot). On NVSwitch
    /// systems such a GPU cannot run CUDA work at all, while NVML still lists it.
    FabricNotCompleted,
    /// The fabric registration completed with an error status (value: the `nvmlReturn_t`).
    FabricError,
    /// Fabric Manager (`nvidia-fabricmanager.service`) is not running on an instance type with
    /// NVSwitches (value: consecutive looks).
    FabricManagerDown,
    /// systemd restarted Fabric Manager repeatedly within `[links] fm_flap_window` (value: the
    /// restarts in the window).
    FabricManagerFlapping,
    /// An NVSwitch error (`SXid`) the driver or NVIDIA's table calls non-fatal.
    SxidNonFatal {
        code: u32,
    },
    /// An NVSwitch error the driver printed as `Fatal` (fatal to the port's partition).
    SxidFatal {
        code: u32,
    },
    /// An NVSwitch error NVIDIA documents as always fatal to the whole fabric.
    SxidAlwaysFatal {
        code: u32,
    },
    /// NVLinks of the GPU that were up are down (value: how many).
    NvlinkDown,
    /// NVLink CRC (flit + data) errors per minute over `[links] nvlink_window`, worst link.
    NvlinkCrcErrors,
    /// NVLink replay errors per minute over the window, worst link.
    NvlinkReplayErrors,
    /// NVLink recovery errors per minute over the window, worst link.
    NvlinkRecoveryErrors,
    /// The GPU's PCIe link runs below its maximum width, or below its maximum generation while
    /// the GPU is busy (value: percent of the maximum bandwidth).
    PcieDowntrained,
    /// PCIe replays per minute over `[links] pcie_window`.
    PcieReplays,
    /// Persistence mode is off where `[links] expect_persistence` says it must be on.
    PersistenceOff,
    /// Software thermal slowdown (clock event reason 0x20) set (value: the reasons mask).
    SwThermalSlowdown,
    /// EFA / RDMA ports whose state is not ACTIVE (value: how many).
    EfaPortDown,
    /// EFA / RDMA port state changes within `[links] efa_flap_window` (value: changes).
    EfaPortFlapping,
    /// EFA / RDMA error counters (`hw_counters`) per minute over `[links] efa_window`.
    EfaErrors,
    /// gpu-medic itself cannot do part of its job: a library that no longer loads, a control
    /// binary that went missing, NVML that cannot count the GPUs, a state file set aside.
    /// A fault of gpu-medic or its configuration, never of the hardware: it is journaled once
    /// and shown in `status` and metrics, and nothing is drained, replaced or restarted for it.
    SelfFault {
        /// What fails: `nvml`, `mps-control`, `state-file`, `ecs-gpu-view`.
        component: String,
    },
    /// The component works again: the all-clear for its self-fault.
    SelfRecovered {
        component: String,
    },
    /// The ECS agent's own verdict on the accelerators turned IMPAIRED
    /// (`healthStatus` of DescribeContainerInstances, `ACCELERATED_COMPUTE`): a second opinion
    /// beside gpu-medic's own, judged by the policy (default: corroborating, logged).
    EcsAgentImpaired,
    /// The ECS agent's verdict is no longer IMPAIRED (`status`: OK, INSUFFICIENT_DATA,
    /// INITIALIZING); INSUFFICIENT_DATA is no fault.
    EcsAgentHealth {
        status: String,
    },
    /// AWS scheduled an event for this instance, or changed its state or time
    /// (IMDS `events/maintenance/scheduled`).
    MaintenanceEvent {
        event: ScheduledEvent,
    },
    /// AWS will interrupt this Spot instance at `time` (IMDS `spot/instance-action`).
    SpotInterruption {
        action: String,
        time: Timestamp,
    },
    /// AWS recommends moving work off this Spot instance (IMDS
    /// `events/recommendations/rebalance`).
    RebalanceRecommendation {
        notice: Timestamp,
    },
    /// The Spot interruption notice IMDS gave (`spot/instance-action`) is no longer listed
    /// (404 again) while the instance still runs: AWS did not take it.
    SpotNoticeGone {
        action: String,
        time: Timestamp,
    },
}

/// Defines [`SignalKind`] with each kind's name written once: the policy files' word for it,
/// its serde form and `as_str` all come from the one table below.
macro_rules! signal_kinds {
    (judged: { $($j:ident = $jn:literal,)* } engine: { $($e:ident = $en:literal,)* }) => {
        /// The fieldless name of a signal, as written in policy files (`signal = "xid"`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub enum SignalKind {
            $( #[serde(rename = $jn)] $j, )*
            $( #[serde(rename = $en)] $e, )*
        }

        impl SignalKind {
            /// The kinds a policy judges (the others are handled by the engine itself).
            pub const JUDGED: &'static [SignalKind] = &[$(SignalKind::$j),*];
            /// Every kind.
            pub const ALL: &'static [SignalKind] = &[$(SignalKind::$j,)* $(SignalKind::$e),*];

            pub fn as_str(self) -> &'static str {
                match self {
                    $(SignalKind::$j => $jn,)*
                    $(SignalKind::$e => $en,)*
                }
            }
        }
    };
}

signal_kinds! {
    judged: {
        Xid = "xid",
        RecoveryAction = "recovery-action",
        EccUncorrected = "ecc-uncorrected",
        EccCorrected = "ecc-corrected",
        RowRemapPending = "row-remap-pending",
        RowRemapFailure = "row-remap-failure",
        RowRemapUncorrectable = "row-remap-uncorrectable",
        RetiredPagesPending = "retired-pages-pending",
        RetiredPages = "retired-pages",
        GpuLost = "gpu-lost",
        DeviceCountMismatch = "device-count-mismatch",
        DriverNotLoaded = "driver-not-loaded",
        NvmlEventUnknown = "nvml-event-unknown",
        Thermal = "thermal",
        HwSlowdown = "hw-slowdown",
        MpsUnresponsive = "mps-unresponsive",
        MpsDown = "mps-down",
        MpsServerFault = "mps-server-fault",
        MpsCrash = "mps-crash",
        EcsAgentDown = "ecs-agent-down",
        StateDiskFull = "state-disk-full",
        EcsGpuMissing = "ecs-gpu-missing",
        EcsGpuCountMismatch = "ecs-gpu-count-mismatch",
        EcsGpuMemoryInUse = "ecs-gpu-memory-in-use",
        GpuMemoryOverReservation = "gpu-memory-over-reservation",
        MpsBypass = "mps-bypass",
        MpsLimitMismatch = "mps-limit-mismatch",
        ContainerGpuMemoryOverReservation = "container-gpu-memory-over-reservation",
        MpsClientNotOnGpu = "mps-client-not-on-gpu",
        MpsClientNoServer = "mps-client-no-server",
        MpsServerIdleMemory = "mps-server-idle-memory",
        MpsWrongServer = "mps-wrong-server",
        EcsAgentImpaired = "ecs-agent-impaired",
        FabricNotCompleted = "fabric-not-completed",
        FabricError = "fabric-error",
        FabricManagerDown = "fabric-manager-down",
        FabricManagerFlapping = "fabric-manager-flapping",
        SxidNonFatal = "sxid-non-fatal",
        SxidFatal = "sxid-fatal",
        SxidAlwaysFatal = "sxid-always-fatal",
        NvlinkDown = "nvlink-down",
        NvlinkCrcErrors = "nvlink-crc-errors",
        NvlinkReplayErrors = "nvlink-replay-errors",
        NvlinkRecoveryErrors = "nvlink-recovery-errors",
        PcieDowntrained = "pcie-downtrained",
        PcieReplays = "pcie-replays",
        PersistenceOff = "persistence-off",
        SwThermalSlowdown = "sw-thermal-slowdown",
        EfaPortDown = "efa-port-down",
        EfaPortFlapping = "efa-port-flapping",
        EfaErrors = "efa-errors",
    }
    engine: {
        MpsUp = "mps-up",
        Lifecycle = "lifecycle",
        SelfFault = "self-fault",
        SelfRecovered = "self-recovered",
        EcsAgentHealth = "ecs-agent-health",
        MaintenanceEvent = "maintenance-event",
        SpotInterruption = "spot-interruption",
        RebalanceRecommendation = "rebalance-recommendation",
        SpotNoticeGone = "spot-notice-gone",
    }
}

impl SignalKind {
    /// Whether the signal is about the MPS daemon rather than a GPU.
    pub fn is_mps(self) -> bool {
        matches!(
            self,
            SignalKind::MpsUnresponsive
                | SignalKind::MpsDown
                | SignalKind::MpsServerFault
                | SignalKind::MpsCrash
                | SignalKind::MpsUp
        )
    }
}

impl Signal {
    /// An XID with no decode (every XID but 144-150 and 159).
    pub fn xid(code: u32) -> Signal {
        Signal::Xid { code, decode: None }
    }

    pub fn kind(&self) -> SignalKind {
        match self {
            Signal::Xid { .. } => SignalKind::Xid,
            Signal::RecoveryAction { .. } => SignalKind::RecoveryAction,
            Signal::EccUncorrected => SignalKind::EccUncorrected,
            Signal::EccCorrected => SignalKind::EccCorrected,
            Signal::RowRemapPending => SignalKind::RowRemapPending,
            Signal::RowRemapFailure => SignalKind::RowRemapFailure,
            Signal::RowRemapUncorrectable => SignalKind::RowRemapUncorrectable,
            Signal::RetiredPagesPending => SignalKind::RetiredPagesPending,
            Signal::RetiredPages => SignalKind::RetiredPages,
            Signal::GpuLost => SignalKind::GpuLost,
            Signal::DeviceCountMismatch => SignalKind::DeviceCountMismatch,
            Signal::DriverNotLoaded => SignalKind::DriverNotLoaded,
            Signal::NvmlEventUnknown => SignalKind::NvmlEventUnknown,
            Signal::Thermal => SignalKind::Thermal,
            Signal::HwSlowdown => SignalKind::HwSlowdown,
            Signal::MpsUnresponsive => SignalKind::MpsUnresponsive,
            Signal::MpsDown => SignalKind::MpsDown,
            Signal::MpsServerFault => SignalKind::MpsServerFault,
            Signal::MpsCrash => SignalKind::MpsCrash,
            Signal::EcsAgentDown => SignalKind::EcsAgentDown,
            Signal::StateDiskFull => SignalKind::StateDiskFull,
            Signal::EcsGpuMissing => SignalKind::EcsGpuMissing,
            Signal::EcsGpuCountMismatch => SignalKind::EcsGpuCountMismatch,
            Signal::EcsGpuMemoryInUse => SignalKind::EcsGpuMemoryInUse,
            Signal::GpuMemoryOverReservation => SignalKind::GpuMemoryOverReservation,
            Signal::MpsBypass => SignalKind::MpsBypass,
            Signal::MpsLimitMismatch => SignalKind::MpsLimitMismatch,
            Signal::ContainerGpuMemoryOverReservation => {
                SignalKind::ContainerGpuMemoryOverReservation
            }
            Signal::MpsClientNotOnGpu => SignalKind::MpsClientNotOnGpu,
            Signal::MpsClientNoServer => SignalKind::MpsClientNoServer,
            Signal::MpsServerIdleMemory => SignalKind::MpsServerIdleMemory,
            Signal::MpsWrongServer => SignalKind::MpsWrongServer,
            Signal::FabricNotCompleted => SignalKind::FabricNotCompleted,
            Signal::FabricError => SignalKind::FabricError,
            Signal::FabricManagerDown => SignalKind::FabricManagerDown,
            Signal::FabricManagerFlapping => SignalKind::FabricManagerFlapping,
            Signal::SxidNonFatal { .. } => SignalKind::SxidNonFatal,
            Signal::SxidFatal { .. } => SignalKind::SxidFatal,
            Signal::SxidAlwaysFatal { .. } => SignalKind::SxidAlwaysFatal,
            Signal::NvlinkDown => SignalKind::NvlinkDown,
            Signal::NvlinkCrcErrors => SignalKind::NvlinkCrcErrors,
            Signal::NvlinkReplayErrors => SignalKind::NvlinkReplayErrors,
            Signal::NvlinkRecoveryErrors => SignalKind::NvlinkRecoveryErrors,
            Signal::PcieDowntrained => SignalKind::PcieDowntrained,
            Signal::PcieReplays => SignalKind::PcieReplays,
            Signal::PersistenceOff => SignalKind::PersistenceOff,
            Signal::SwThermalSlowdown => SignalKind::SwThermalSlowdown,
            Signal::EfaPortDown => SignalKind::EfaPortDown,
            Signal::EfaPortFlapping => SignalKind::EfaPortFlapping,
            Signal::EfaErrors => SignalKind::EfaErrors,
            Signal::MpsUp => SignalKind::MpsUp,
            Signal::Lifecycle { .. } => SignalKind::Lifecycle,
            Signal::SelfFault { .. } => SignalKind::SelfFault,
            Signal::SelfRecovered { .. } => SignalKind::SelfRecovered,
            Signal::EcsAgentImpaired => SignalKind::EcsAgentImpaired,
            Signal::EcsAgentHealth { .. } => SignalKind::EcsAgentHealth,
            Signal::MaintenanceEvent { .. } => SignalKind::MaintenanceEvent,
            Signal::SpotInterruption { .. } => SignalKind::SpotInterruption,
            Signal::RebalanceRecommendation { .. } => SignalKind::RebalanceRecommendation,
            Signal::SpotNoticeGone { .. } => SignalKind::SpotNoticeGone,
        }
    }
}

impl fmt::Display for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Signal::Xid { code, decode: None } => write!(f, "xid {code}"),
            Signal::Xid {
                code,
                decode: Some(d),
            } => write!(f, "xid {code} ({})", d.as_str()),
            Signal::RecoveryAction { action } => write!(f, "recovery-action {}", action.as_str()),
            Signal::Lifecycle { state } => write!(f, "lifecycle {state:?}"),
            Signal::SelfFault { component } => write!(f, "self-fault {component}"),
            Signal::SxidNonFatal { code }
            | Signal::SxidFatal { code }
            | Signal::SxidAlwaysFatal { code } => write!(f, "{} {code}", self.kind().as_str()),
            Signal::SelfRecovered { component } => write!(f, "self-recovered {component}"),
            Signal::EcsAgentHealth { status } => write!(f, "ecs-agent-health {status}"),
            Signal::MaintenanceEvent { event } => write!(f, "maintenance-event {event}"),
            Signal::SpotInterruption { action, time } => {
                write!(f, "spot-interruption {action} at {time}")
            }
            Signal::RebalanceRecommendation { .. } => f.write_str("rebalance-recommendation"),
            Signal::SpotNoticeGone { action, time } => {
                write!(f, "spot-notice-gone {action} at {time}")
            }
            other => f.write_str(other.kind().as_str()),
        }
    }
}

/// One thing a probe saw, with the context an incident needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Observation {
    pub signal: Signal,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuId>,
    /// The signal's magnitude where it has one (new ECC errors, remapped rows, °C,
    /// consecutive failed probes); compared with a rule's `threshold`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub value: u64,
    /// Processes involved (the XID's pid, MPS clients on a faulted GPU).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pids: Vec<u32>,
    /// ECS task ids of the processes on the GPU at the time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tasks: Vec<String>,
    /// Free text from the source (the driver's XID message, a log line).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Which probe produced it (`nvml`, `kmsg`, `mps`, `imds`, ...).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub source: String,
    /// Where in its source stream it was read (a kernel-log sequence number, a log file
    /// offset): the supervisor moves the source's cursor past it only once it is journaled,
    /// and drops it as a duplicate when a restart reads it again. The engine ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<Cursor>,
    /// For an XID: who caused it, where it struck, the XID it follows from
    /// (`model::attribution`, docs/attribution.md); absent for other signals.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<Box<attribution::XidContext>>,
    /// Why this observation alone may not act: it was read from a source that cannot tell
    /// the kernel's records from ones others wrote (a syslog file: `logger -t kernel`), or
    /// whose stamps cannot place it in this boot, and nothing else saw it (NVML's event for
    /// the same XID is a second witness). The engine records a drastic verdict on it and
    /// does not take it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unwitnessed: Option<String>,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl Observation {
    pub fn new(signal: Signal) -> Self {
        Observation {
            signal,
            gpu: None,
            value: 0,
            pids: Vec::new(),
            tasks: Vec::new(),
            detail: None,
            source: String::new(),
            cursor: None,
            xid: None,
            unwitnessed: None,
        }
    }

    /// Adds what the probe learned of an XID (nothing when there is nothing).
    pub fn with_xid(mut self, ctx: attribution::XidContext) -> Self {
        self.xid = (!ctx.is_empty()).then(|| Box::new(ctx));
        self
    }

    /// The program the XID is charged to, if any.
    pub fn culprit(&self) -> Option<&attribution::Culprit> {
        self.xid.as_ref()?.culprit.as_ref()
    }

    pub fn on_gpu(mut self, gpu: GpuId) -> Self {
        self.gpu = Some(gpu);
        self
    }

    pub fn with_value(mut self, value: u64) -> Self {
        self.value = value;
        self
    }

    pub fn with_detail(mut self, detail: impl Into<String>) -> Self {
        self.detail = Some(detail.into());
        self
    }

    pub fn with_pids(mut self, pids: Vec<u32>) -> Self {
        self.pids = pids;
        self
    }

    pub fn from_source(mut self, source: &str) -> Self {
        self.source = source.to_string();
        self
    }

    pub fn at_cursor(mut self, stream: impl Into<StreamId>, pos: u64) -> Self {
        self.cursor = Some(Cursor {
            stream: stream.into(),
            pos,
            token: None,
            ahead: false,
        });
        self
    }
}

/// What a policy may decide for a signal, in increasing order of severity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Ignore,
    Log,
    /// Stops the tasks on one GPU.
    StopTasks,
    /// Restarts the daemon: every MPS client on the instance is affected.
    RestartMps,
    Drain,
    /// Quarantine, drain, reboot the instance, check it after the boot and return it to
    /// service; `replace` when the reboot does not happen or does not mend it (docs/repair.md).
    Reboot,
    Replace,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ignore => "ignore",
            Verdict::Log => "log",
            Verdict::RestartMps => "restart-mps",
            Verdict::StopTasks => "stop-tasks",
            Verdict::Drain => "drain",
            Verdict::Reboot => "reboot",
            Verdict::Replace => "replace",
        }
    }

    /// Whether the verdict does something to the node (stop tasks, restart MPS, drain,
    /// replace): what fails a one-shot check (`engine::check`).
    pub fn acts(self) -> bool {
        self > Verdict::Log
    }

    /// Drain, reboot and replace take the node out of service; only one may be in flight.
    pub fn is_node_remediation(self) -> bool {
        matches!(self, Verdict::Drain | Verdict::Reboot | Verdict::Replace)
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IncidentId(pub u64);

impl fmt::Display for IncidentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ActionId(pub u64);

impl fmt::Display for ActionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}", self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LifecycleHook {
    Launch,
    Terminate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum LifecycleResult {
    Continue,
    Abandon,
}

/// Something a remedy does to the world.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Command {
    RestartMps,
    StopTasks {
        gpu: GpuId,
        #[serde(default)]
        pids: Vec<u32>,
        #[serde(default)]
        tasks: Vec<String>,
    },
    Quarantine,
    /// `terminating`: the engine knew, when it gave the order, that Auto Scaling is
    /// terminating the instance (the drain then heartbeats our terminate hook).
    Drain {
        #[serde(default)]
        terminating: bool,
    },
    Replace,
    /// Reboots the instance (EC2 `RebootInstances` on itself, or the OS's reboot). `boot` is
    /// the kernel boot id when the order was given: a remedy that finds another boot id
    /// knows the reboot already happened and does not reboot again.
    Reboot {
        #[serde(default)]
        boot: String,
    },
    /// After a reboot: waits for the GPUs and the MPS daemon, then runs the launch gate's
    /// checks; done when the node is healthy.
    BootCheck,
    /// Undoes quarantine and drain: the instance takes tasks again (operator abort, or
    /// back in service after a reboot that mended it).
    Restore,
    CompleteLifecycle {
        hook: LifecycleHook,
        result: LifecycleResult,
    },
    /// Gathers the node's evidence into one archive and uploads it to S3 (docs/evidence.md).
    /// Runs beside the drain; a reboot, replacement or hook completion waits for it at most
    /// until its deadline.
    CollectEvidence,
    /// Tests the GPUs (`gpu-medic diagnose`, docs/diagnose.md) on a drained node before it is
    /// trusted with tasks again: after the boot check of a reboot, after the drain of a
    /// `drain` verdict. Done with the diagnosis, whatever it found; failed only when no
    /// diagnosis could be made.
    Diagnose {
        level: diagnosis::Level,
    },
}

impl Command {
    pub fn name(&self) -> &'static str {
        match self {
            Command::RestartMps => "restart-mps",
            Command::StopTasks { .. } => "stop-tasks",
            Command::Quarantine => "quarantine",
            Command::Drain { .. } => "drain",
            Command::Replace => "replace",
            Command::Reboot { .. } => "reboot",
            Command::BootCheck => "boot-check",
            Command::Restore => "restore",
            Command::CompleteLifecycle { .. } => "complete-lifecycle-action",
            Command::CollectEvidence => "collect-evidence",
            Command::Diagnose { .. } => "diagnose",
        }
    }
}

/// An executable order: the command plus what the engine needs to match its outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Order {
    pub id: ActionId,
    pub incident: IncidentId,
    pub command: Command,
    /// 1 for the first try.
    pub attempt: u32,
    /// The phase deadline; past it the engine escalates whether or not an outcome came.
    pub deadline: Timestamp,
    /// For an AWS-planned disruption (docs/planned-events.md): AWS takes the instance out of
    /// service anyway, so the drain or replacement takes no fleet-budget slot and is never
    /// deferred (the instance still counts as in remediation: it is DRAINING).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub planned: bool,
}

/// What the engine emits. `Log` entries go to the journal; `Execute` orders go to remedies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
#[allow(
    clippy::large_enum_variant,
    reason = "a step returns a handful of actions that are moved once: a box would be one more allocation per decision"
)]
pub enum Action {
    Log(Record),
    Execute(Order),
}

impl Action {
    pub fn is_executable(&self) -> bool {
        matches!(self, Action::Execute(_))
    }
}

/// How an order ended, as reported by its remedy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "kebab-case")]
pub enum OutcomeStatus {
    Done,
    Failed {
        retryable: bool,
    },
    /// Not attempted yet for a reason that will pass (the fleet budget is full).
    Deferred {
        #[serde(with = "humantime_serde")]
        retry_after: Duration,
    },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    pub action: ActionId,
    #[serde(flatten)]
    pub status: OutcomeStatus,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// AWS request ids of the calls made, for support cases and CloudTrail.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub request_ids: Vec<String>,
    /// A `collect-evidence` order's archive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<Box<EvidenceRef>>,
    /// A drain's or replacement's fleet budget: the group as the budget read it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fleet: Option<Box<FleetBudgetView>>,
    /// A `diagnose` order's diagnosis (without the tools' raw output).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnosis: Option<Box<diagnosis::Diagnosis>>,
}

/// What this node's remedies can carry out. A verdict whose remedy is missing is recorded as
/// what would have been done, never half-executed and never reported as done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// ECS and Auto Scaling (`[aws] enabled`): stop-tasks, quarantine, drain, replace,
    /// lifecycle hooks.
    pub aws: bool,
    /// gpu-medic manages the MPS control daemon (`[mps] enabled`): restart-mps, and a
    /// stop-tasks that names client pids (the daemon terminates them first, even without AWS).
    pub mps: bool,
    /// Evidence collection (`[evidence]`): collect-evidence, and how long a repair waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<EvidencePlan>,
    /// The reboot rung (`[repair] reboot`, with `[aws]`): reboot and boot-check. Without it a
    /// `reboot` verdict is carried out as `replace`. Off until a supervisor says it has the
    /// rung, and absent in inputs recorded before the rung existed (those nodes replaced).
    #[serde(default)]
    pub reboot: bool,
    /// The active test of the GPUs (`[diagnose]`, a tier that can run here) and the level it
    /// runs at; none: a drained or rebooted node is judged by the passive checks alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnose: Option<diagnosis::Level>,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            aws: true,
            mps: true,
            evidence: None,
            reboot: false,
            diagnose: None,
        }
    }
}

/// Everything the engine consumes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "input", rename_all = "kebab-case")]
#[allow(
    clippy::large_enum_variant,
    reason = "each input is built once and moved through the channel to the engine: a box would be one more allocation per signal"
)]
pub enum Input {
    Observation(Observation),
    Outcome(Outcome),
    /// The supervisor started with these remedies. Recorded in `inputs.jsonl` when it changes
    /// the state, so a replay judges with what the node could do.
    Started {
        capabilities: Capabilities,
    },
    /// Time passes: deadlines and scheduled retries are checked.
    Tick,
    /// The kernel's boot id at the supervisor's start (`/proc/sys/kernel/random/boot_id`):
    /// a new one after a reboot the engine ordered resumes the repair after the boot.
    Boot {
        id: String,
    },
    /// A person asked for something (`gpu-medic incidents abort`).
    Operator(OperatorRequest),
    /// The reboots kept outside `state.json`, read by the supervisor at start: the state
    /// directory's reboot ledger (`reboots.json`) or, when that is gone too, the instance's
    /// tag. Merged into the repair history, so that a lost `state.json` and a rotated journal
    /// never give back a reboot the ladder counts (docs/repair.md).
    Reboots {
        reboots: Vec<repair::Repair>,
        /// Where they were read (for the journal and the log).
        #[serde(default)]
        from: String,
    },
}

/// Requests from an operator, delivered through `state_dir/requests/`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "kebab-case")]
#[allow(
    clippy::large_enum_variant,
    reason = "an operator request is read once from its file and moved to the engine: a box would buy nothing"
)]
pub enum OperatorRequest {
    /// Stop a node remediation that has not reached Auto Scaling and return the instance
    /// to service (the fault was a false alarm, or was fixed by hand).
    Abort {
        incident: IncidentId,
        #[serde(default)]
        by: String,
    },
    /// The launch gate (`gpu-medic check --lifecycle`, a separate process) reports what it
    /// decided, so the journal has it: one incident per gate run.
    LaunchGate {
        /// `healthy`, `unhealthy` or `unknown`.
        health: String,
        /// What was done with the launch hook and the instance, for people.
        summary: String,
        #[serde(default)]
        findings: Vec<String>,
        #[serde(default)]
        request_ids: Vec<String>,
    },
    /// `gpu-medic drill`: a rehearsal on this instance. The incident the drill's signal opens
    /// carries the drill's id in every record; with `observe` its orders are journaled and
    /// none is executed.
    Drill { drill: Drill },
    /// `gpu-medic drill clear <id>`: the planned-event notice a drill rehearsed (`spot`,
    /// `maintenance`) is gone, as if IMDS no longer listed it: what it started is undone.
    DrillClear {
        drill: String,
        #[serde(default)]
        by: String,
    },
}

/// A rehearsal asked for by `gpu-medic drill` ([`OperatorRequest::Drill`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Drill {
    /// `drill-<ms>-<pid>`: unique per run of the command; tags the incident.
    pub id: String,
    /// What is rehearsed, for people: `xid 79`, `mps-hang`, `gpu-lost`, ...
    pub class: String,
    /// Journal every order, execute none (for this incident only).
    #[serde(default)]
    pub observe: bool,
    /// Who asked (the user running the command).
    #[serde(default)]
    pub by: String,
    /// Which observation is the drill's: the first one matching, within
    /// [`DRILL_ARM_WINDOW`] of the request, that opens an incident.
    pub expect: DrillExpect,
    /// The observation itself, for drills that cannot be played through a real source
    /// (`gpu-lost`, `ecc`): judged at once, as if a probe had reported it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inject: Option<Observation>,
}

/// How long an armed drill waits for its signal (the kernel log line, the MPS probe).
pub const DRILL_ARM_WINDOW: Duration = Duration::from_secs(120);

/// What a drill's observation looks like: one of `signals`, and where given the XID code,
/// the GPU index and the process id (a drill's kernel-log XID names the drill's own pid, so
/// a real XID is never mistaken for it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrillExpect {
    pub signals: Vec<SignalKind>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
}

impl DrillExpect {
    pub fn matches(&self, obs: &Observation) -> bool {
        let code = match &obs.signal {
            Signal::Xid { code, .. } => Some(*code),
            _ => None,
        };
        self.signals.contains(&obs.signal.kind())
            && self.code.is_none_or(|c| code == Some(c))
            && self
                .gpu
                .is_none_or(|g| obs.gpu.as_ref().is_some_and(|x| x.index == g))
            && self.pid.is_none_or(|p| obs.pids.contains(&p))
    }
}

/// One line of `inputs.jsonl`: an input with the time the supervisor saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StampedInput {
    pub at: Timestamp,
    #[serde(flatten)]
    pub input: Input,
}

/// Where an incident ended up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum IncidentState {
    /// Being handled: an action is in flight or scheduled.
    Open,
    /// Recorded only; the policy asked for no action.
    Logged,
    /// The fault cleared (the MPS daemon answers again, tasks were stopped).
    Resolved,
    /// The node was drained and is left for an operator.
    Drained,
    /// Auto Scaling was told to replace the node.
    Replaced,
    /// The node was handed back to Auto Scaling for termination.
    Terminated,
    /// Observe-only: the decision was recorded and nothing was done.
    Observed,
    /// An operator stopped the remediation and the instance was returned to service.
    Aborted,
    /// Rebooted, checked after the boot, and returned to service.
    Repaired,
    /// gpu-medic gave up; an operator is needed.
    Failed,
    /// Left behind: more than [`MAX_OPEN_INCIDENTS`] incidents were open, and this was the
    /// oldest that no work held (the close's summary says so).
    Abandoned,
}

impl IncidentState {
    pub fn as_str(self) -> &'static str {
        match self {
            IncidentState::Open => "open",
            IncidentState::Logged => "logged",
            IncidentState::Resolved => "resolved",
            IncidentState::Drained => "drained",
            IncidentState::Replaced => "replaced",
            IncidentState::Terminated => "terminated",
            IncidentState::Observed => "observed",
            IncidentState::Aborted => "aborted",
            IncidentState::Repaired => "repaired",
            IncidentState::Failed => "failed",
            IncidentState::Abandoned => "abandoned",
        }
    }
}

/// One journal line: something that happened to one incident.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    pub at: Timestamp,
    pub incident: IncidentId,
    /// The drill's id when the incident is a rehearsal (`gpu-medic drill`), on every record
    /// of it, so whatever reads one record (CloudWatch Logs, EventBridge) can tell.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drill: Option<String>,
    #[serde(flatten)]
    pub event: IncidentEvent,
}

impl Record {
    /// A record of an incident that is not a drill.
    pub fn new(at: Timestamp, incident: IncidentId, event: IncidentEvent) -> Record {
        Record {
            at,
            incident,
            drill: None,
            event,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "kebab-case")]
pub enum IncidentEvent {
    /// The first signal, the rule that fired, and the verdict.
    Opened {
        observation: Observation,
        rule: String,
        reason: String,
        verdict: Verdict,
    },
    /// A later signal that belongs to the same incident.
    Signal {
        observation: Observation,
    },
    /// The verdict changed (escalation, budget exhausted, upgrade from drain to replace).
    Escalated {
        verdict: Verdict,
        rule: String,
        reason: String,
    },
    /// An order was handed to a remedy (or, observe-only, would have been).
    ActionStarted {
        order: Order,
        dry_run: bool,
    },
    ActionFinished {
        outcome: Outcome,
    },
    /// A phase overran its deadline; what the engine does instead.
    DeadlineMissed {
        action: ActionId,
        escalation: String,
    },
    /// A note for the operator (budget waits, skipped steps).
    Note {
        text: String,
    },
    Closed {
        state: IncidentState,
        summary: String,
    },
}

/// An incident as the journal tells it: folded from its records, first signal to outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Incident {
    pub id: IncidentId,
    pub opened_at: Timestamp,
    /// The first signal, e.g. `xid 79`.
    pub signal: String,
    pub gpu: Option<GpuId>,
    pub rule: String,
    pub reason: String,
    /// The verdict in force (after escalations), e.g. `replace`.
    pub action: Verdict,
    pub state: IncidentState,
    pub closed_at: Option<Timestamp>,
    pub summary: String,
    /// ECS tasks and processes named by the incident's signals.
    pub tasks: Vec<String>,
    pub pids: Vec<u32>,
    pub request_ids: Vec<String>,
    /// The evidence archive, once a collection reported one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<EvidenceRef>,
    /// The drill's id when the incident is a rehearsal (`gpu-medic drill`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drill: Option<String>,
    /// Who caused the first signal, for an application-class XID (docs/attribution.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub culprit: Option<attribution::Culprit>,
    /// Where on the GPU the first signal struck, when its text said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site: Option<attribution::Site>,
    pub records: Vec<Record>,
}

impl Incident {
    /// An application fault: charged to a named program and judged its own (not taken
    /// for the GPU's): what `incidents list --fleet` groups by task definition.
    pub fn application_fault(&self) -> Option<&attribution::Culprit> {
        let c = self.culprit.as_ref()?;
        (c.is_attributed() && self.action < Verdict::Drain).then_some(c)
    }

    /// How the engine judged an application-class XID, in words; `None` for other signals.
    pub fn judgement(&self) -> Option<&'static str> {
        self.culprit.as_ref()?;
        Some(if self.rule.ends_with("/suspect") {
            "the GPU's: different programs faulted at the same place (drained for the diagnosis)"
        } else if self.rule.ends_with("/culprit") {
            "the application's: one program faulted again and again; its task was stopped"
        } else if self.application_fault().is_some() {
            "the application's: one program's fault; the node and every other tenant stay in service"
        } else {
            "no program could be named; counted as no program's"
        })
    }

    /// Folds journal records (in file order) into incidents, oldest first. Records of an
    /// incident whose `opened` line is missing (a rotated or torn journal) start a stub.
    pub fn fold(records: impl IntoIterator<Item = Record>) -> Vec<Incident> {
        let mut out: std::collections::BTreeMap<IncidentId, Incident> = Default::default();
        for rec in records {
            out.entry(rec.incident)
                .or_insert_with(|| Incident::stub(&rec))
                .push(rec);
        }
        out.into_values().collect()
    }

    /// An incident known only by one record so far (its `opened` record may follow, or be
    /// missing from a rotated or torn journal).
    pub fn stub(rec: &Record) -> Incident {
        Incident {
            id: rec.incident,
            opened_at: rec.at,
            signal: "(unknown: opening record missing)".into(),
            gpu: None,
            rule: String::new(),
            reason: String::new(),
            action: Verdict::Log,
            state: IncidentState::Open,
            closed_at: None,
            summary: String::new(),
            tasks: Vec::new(),
            pids: Vec::new(),
            request_ids: Vec::new(),
            evidence: None,
            drill: rec.drill.clone(),
            culprit: None,
            site: None,
            records: Vec::new(),
        }
    }

    /// Folds one more record (in file order) into the incident, keeping it in the timeline.
    pub fn push(&mut self, rec: Record) {
        self.fold_record(&rec);
        self.records.push(rec);
    }

    /// Folds one more record (in file order) into the incident's summary without keeping
    /// it (`incidents list` needs no timeline).
    pub fn fold_record(&mut self, rec: &Record) {
        let inc = self;
        if inc.drill.is_none() {
            inc.drill.clone_from(&rec.drill);
        }
        match &rec.event {
            IncidentEvent::Opened {
                observation,
                rule,
                reason,
                verdict,
            } => {
                inc.opened_at = rec.at;
                inc.signal = observation.signal.to_string();
                inc.gpu = observation.gpu.clone();
                inc.rule = rule.clone();
                inc.reason = reason.clone();
                inc.action = *verdict;
                if let Some(x) = &observation.xid {
                    inc.culprit.clone_from(&x.culprit);
                    inc.site.clone_from(&x.site);
                }
                inc.absorb(observation);
            }
            IncidentEvent::Signal { observation } => inc.absorb(observation),
            IncidentEvent::Escalated { verdict, .. } => inc.action = inc.action.max(*verdict),
            IncidentEvent::ActionFinished { outcome } => {
                if let Some(e) = &outcome.evidence {
                    inc.evidence = Some((**e).clone());
                }
                for r in &outcome.request_ids {
                    if !inc.request_ids.contains(r) {
                        inc.request_ids.push(r.clone());
                    }
                }
            }
            IncidentEvent::Closed { state, summary } => {
                inc.state = *state;
                inc.closed_at = Some(rec.at);
                inc.summary = summary.clone();
            }
            _ => {}
        }
    }

    fn absorb(&mut self, obs: &Observation) {
        merge_unique(&mut self.tasks, &obs.tasks);
        merge_unique(&mut self.pids, &obs.pids);
    }
}

/// Appends the items of `from` not yet in `into`, in order. Linear: an incident folded from
/// thousands of signals naming thousands of pids does not cost their product.
fn merge_unique<T: Clone + Eq + std::hash::Hash>(into: &mut Vec<T>, from: &[T]) {
    if from.is_empty() {
        return;
    }
    if into.len().saturating_mul(from.len()) <= 256 {
        for x in from {
            if !into.contains(x) {
                into.push(x.clone());
            }
        }
        return;
    }
    let mut seen: std::collections::HashSet<T> = into.iter().cloned().collect();
    for x in from {
        if seen.insert(x.clone()) {
            into.push(x.clone());
        }
    }
}

/// A node's health as `gpu-medic check` and the launch gate judge it (JSON: `healthy`,
/// `unhealthy`, `unknown`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    Healthy,
    Unhealthy,
    /// Could not tell (a probe could not look).
    Unknown,
}

impl Health {
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Healthy => "healthy",
            Health::Unhealthy => "unhealthy",
            Health::Unknown => "unknown",
        }
    }
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Signal`'s serde tag and `SignalKind`'s name are one word per kind: the tag is derived
    /// from the variant, the name from the table in `signal_kinds!`; this keeps them equal.
    #[test]
    fn every_signal_kind_has_one_name() {
        let samples = [
            Signal::xid(79),
            Signal::RecoveryAction {
                action: RecoveryAction::GpuReset,
            },
            Signal::EccUncorrected,
            Signal::EccCorrected,
            Signal::RowRemapPending,
            Signal::RowRemapFailure,
            Signal::RowRemapUncorrectable,
            Signal::RetiredPagesPending,
            Signal::RetiredPages,
            Signal::GpuLost,
            Signal::DeviceCountMismatch,
            Signal::DriverNotLoaded,
            Signal::NvmlEventUnknown,
            Signal::Thermal,
            Signal::HwSlowdown,
            Signal::MpsUnresponsive,
            Signal::MpsDown,
            Signal::MpsServerFault,
            Signal::MpsCrash,
            Signal::EcsAgentDown,
            Signal::StateDiskFull,
            Signal::EcsGpuMissing,
            Signal::EcsGpuCountMismatch,
            Signal::EcsGpuMemoryInUse,
            Signal::GpuMemoryOverReservation,
            Signal::MpsBypass,
            Signal::MpsLimitMismatch,
            Signal::ContainerGpuMemoryOverReservation,
            Signal::MpsClientNotOnGpu,
            Signal::MpsClientNoServer,
            Signal::MpsServerIdleMemory,
            Signal::MpsWrongServer,
            Signal::MpsUp,
            Signal::Lifecycle {
                state: LifecycleState::Terminating,
            },
            Signal::SelfFault {
                component: "nvml".into(),
            },
            Signal::SelfRecovered {
                component: "nvml".into(),
            },
            Signal::EcsAgentImpaired,
            Signal::FabricNotCompleted,
            Signal::FabricError,
            Signal::FabricManagerDown,
            Signal::FabricManagerFlapping,
            Signal::SxidNonFatal { code: 11 },
            Signal::SxidFatal { code: 24 },
            Signal::SxidAlwaysFatal { code: 22013 },
            Signal::NvlinkDown,
            Signal::NvlinkCrcErrors,
            Signal::NvlinkReplayErrors,
            Signal::NvlinkRecoveryErrors,
            Signal::PcieDowntrained,
            Signal::PcieReplays,
            Signal::PersistenceOff,
            Signal::SwThermalSlowdown,
            Signal::EfaPortDown,
            Signal::EfaPortFlapping,
            Signal::EfaErrors,
            Signal::EcsAgentHealth {
                status: "OK".into(),
            },
            Signal::MaintenanceEvent {
                event: ScheduledEvent {
                    id: "instance-event-1".into(),
                    code: "system-reboot".into(),
                    state: EventState::Active,
                    not_before: Timestamp(0),
                    not_after: None,
                    description: String::new(),
                    boot_id: String::new(),
                },
            },
            Signal::SpotInterruption {
                action: "terminate".into(),
                time: Timestamp(0),
            },
            Signal::RebalanceRecommendation {
                notice: Timestamp(0),
            },
            Signal::SpotNoticeGone {
                action: "terminate".into(),
                time: Timestamp(0),
            },
        ];
        let mut kinds: Vec<SignalKind> = samples.iter().map(Signal::kind).collect();
        kinds.sort();
        kinds.dedup();
        assert_eq!(kinds, SignalKind::ALL, "a sample of every kind");
        for s in &samples {
            let v = serde_json::to_value(s).unwrap();
            assert_eq!(v["kind"], s.kind().as_str(), "{s:?}");
            let k = serde_json::to_value(s.kind()).unwrap();
            assert_eq!(k, s.kind().as_str());
            let back: SignalKind = serde_json::from_value(k).unwrap();
            assert_eq!(back, s.kind());
        }
    }

    /// Records written before the XID decode existed still load, and an XID without a decode
    /// is written exactly as before.
    #[test]
    fn xid_signals_stay_backward_compatible() {
        let old = r#"{"at":"2025-01-01T00:00:00.000Z","input":"observation","signal":{"kind":"xid","code":79},"source":"nvml"}"#;
        let s: StampedInput = serde_json::from_str(old).unwrap();
        let Input::Observation(o) = &s.input else {
            panic!("{s:?}")
        };
        assert_eq!(o.signal, Signal::xid(79));
        assert_eq!(serde_json::to_string(&s).unwrap(), old);
        let new = Signal::Xid {
            code: 149,
            decode: Some(XidDecode::ResetGpu),
        };
        let text = serde_json::to_string(&new).unwrap();
        assert_eq!(text, r#"{"kind":"xid","code":149,"decode":"reset-gpu"}"#);
        assert_eq!(serde_json::from_str::<Signal>(&text).unwrap(), new);
        assert_eq!(new.to_string(), "xid 149 (reset-gpu)");
    }
}
