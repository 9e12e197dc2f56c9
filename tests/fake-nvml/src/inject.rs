//! Injections: the JSON files dropped into `FAKE_NVML_INJECT_DIR`, turned
//! into internal [`Command`]s. Parsing is pure; the state module applies
//! commands and watches the directory.
//!
//! A file holds one JSON object (or an array of them, applied in order):
//! `{"gpu": 0, "xid": 79}`. See README.md for every key.

use serde::Deserialize;

/// GPU selector for `fail`: one index or every GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuSel {
    One(u32),
    Any,
}

/// One state change. Several may come from one JSON object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Reset,
    Count {
        n: u32,
    },
    ComputeMode {
        gpu: u32,
        mode: u32,
    },
    Temp {
        gpu: u32,
        celsius: u32,
    },
    Throttle {
        gpu: u32,
        mask: u64,
    },
    PcieReplay {
        gpu: u32,
        n: u32,
    },
    PcieLink {
        gpu: u32,
        generation: Option<u32>,
        width: Option<u32>,
    },
    Persistence {
        gpu: u32,
        on: bool,
    },
    Fabric {
        gpu: u32,
        fabric: FabricChange,
    },
    /// One link (`link`) or every link of the GPU (`None`).
    NvLink {
        gpu: u32,
        link: Option<u32>,
        change: NvLinkChange,
    },
    MpsClients {
        gpu: u32,
        pids: Vec<MpsClient>,
    },
    /// Processes in the plain compute list only (not MPS clients).
    ComputeProcesses {
        gpu: u32,
        pids: Vec<MpsClient>,
    },
    /// Adds to the counters; uncorrected/corrected volatile > 0 raise the
    /// DBE/SBE events.
    Ecc {
        gpu: u32,
        delta: EccDelta,
    },
    RemappedRows {
        gpu: u32,
        rows: RemappedRows,
    },
    RetiredPages {
        gpu: u32,
        sbe: Option<u32>,
        dbe: Option<u32>,
    },
    RetiredPending {
        gpu: u32,
        pending: bool,
    },
    Fail {
        function: String,
        gpu: GpuSel,
        code: u32,
        times: Option<u32>,
    },
    Unfail {
        function: String,
        gpu: GpuSel,
    },
    Recovery {
        gpu: u32,
        action: u32,
    },
    Xid {
        gpu: u32,
        code: u64,
        /// The driver's text after the code, for the kernel log line (`FAKE_NVML_KMSG`).
        message: Option<String>,
    },
    Event {
        gpu: u32,
        event_type: u64,
        data: u64,
    },
    Unknown,
    Lost {
        gpu: u32,
        lost: bool,
    },
}

impl Command {
    /// The GPU index the command addresses, if any.
    pub fn gpu(&self) -> Option<u32> {
        match self {
            Command::Reset | Command::Count { .. } | Command::Unknown => None,
            Command::Fail { gpu, .. } | Command::Unfail { gpu, .. } => match gpu {
                GpuSel::One(i) => Some(*i),
                GpuSel::Any => None,
            },
            Command::ComputeMode { gpu, .. }
            | Command::Temp { gpu, .. }
            | Command::Throttle { gpu, .. }
            | Command::PcieReplay { gpu, .. }
            | Command::PcieLink { gpu, .. }
            | Command::Persistence { gpu, .. }
            | Command::Fabric { gpu, .. }
            | Command::NvLink { gpu, .. }
            | Command::MpsClients { gpu, .. }
            | Command::ComputeProcesses { gpu, .. }
            | Command::Ecc { gpu, .. }
            | Command::RemappedRows { gpu, .. }
            | Command::RetiredPages { gpu, .. }
            | Command::RetiredPending { gpu, .. }
            | Command::Recovery { gpu, .. }
            | Command::Xid { gpu, .. }
            | Command::Event { gpu, .. }
            | Command::Lost { gpu, .. } => Some(*gpu),
        }
    }
}

/// One MPS client (or compute process): a bare pid (`123`, memory NOT_AVAILABLE, no SM use) or
/// `{"pid": 123, "used_mib": 2048, "sm_percent": 40}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(from = "ClientForm")]
pub struct MpsClient {
    pub pid: u32,
    pub used_mib: Option<u64>,
    /// Its SM utilization in `nvmlDeviceGetProcessUtilization`'s samples (0 or absent: no
    /// sample, as NVML gives none for a process that did not use the SMs).
    pub sm_percent: Option<u32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum ClientForm {
    Pid(u32),
    Full {
        pid: u32,
        used_mib: Option<u64>,
        sm_percent: Option<u32>,
    },
}

impl From<ClientForm> for MpsClient {
    fn from(f: ClientForm) -> Self {
        match f {
            ClientForm::Pid(pid) => MpsClient {
                pid,
                used_mib: None,
                sm_percent: None,
            },
            ClientForm::Full {
                pid,
                used_mib,
                sm_percent,
            } => MpsClient {
                pid,
                used_mib,
                sm_percent,
            },
        }
    }
}

/// `"fabric": {...}`: absolute values; absent keys keep theirs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FabricChange {
    pub state: Option<u8>,
    pub status: Option<u32>,
    pub clique_id: Option<u32>,
    pub cluster_uuid: Option<[u8; 16]>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FabricStateForm {
    Code(u8),
    Name(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFabric {
    state: Option<FabricStateForm>,
    status: Option<u32>,
    clique_id: Option<u32>,
    /// 32 hex digits (dashes allowed).
    cluster_uuid: Option<String>,
}

impl RawFabric {
    fn change(self) -> Result<FabricChange, String> {
        let state = match self.state {
            None => None,
            Some(FabricStateForm::Code(c)) if c <= 3 => Some(c),
            Some(FabricStateForm::Code(c)) => return Err(format!("fabric.state {c} is not 0..=3")),
            Some(FabricStateForm::Name(n)) => {
                Some(match n.to_ascii_lowercase().replace('_', "-").as_str() {
                    "not-supported" => 0,
                    "not-started" => 1,
                    "in-progress" => 2,
                    "completed" => 3,
                    _ => {
                        return Err(format!(
                            "unknown fabric.state {n:?} (not-supported, not-started, in-progress, completed)"
                        ));
                    }
                })
            }
        };
        let cluster_uuid = match self.cluster_uuid {
            None => None,
            Some(u) => {
                let hex: String = u.chars().filter(|c| *c != '-').collect();
                if hex.len() != 32 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
                    return Err(format!("fabric.cluster_uuid {u:?} is not 32 hex digits"));
                }
                let mut out = [0u8; 16];
                for (i, b) in out.iter_mut().enumerate() {
                    *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                        .map_err(|e| e.to_string())?;
                }
                Some(out)
            }
        };
        Ok(FabricChange {
            state,
            status: self.status,
            clique_id: self.clique_id,
            cluster_uuid,
        })
    }
}

/// `"nvlink": {...}`: `active` sets the link state; the counters are added.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NvLinkChange {
    pub active: Option<bool>,
    /// DL_REPLAY, DL_RECOVERY, DL_CRC_FLIT, DL_CRC_DATA, DL_ECC_DATA.
    pub counters: [u64; 5],
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNvLink {
    link: Option<u32>,
    active: Option<bool>,
    #[serde(default)]
    replay: u64,
    #[serde(default)]
    recovery: u64,
    #[serde(default)]
    crc_flit: u64,
    #[serde(default)]
    crc_data: u64,
    #[serde(default)]
    ecc_data: u64,
}

/// `"ecc": {...}`: amounts added to each counter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EccDelta {
    pub corrected_volatile: u64,
    pub uncorrected_volatile: u64,
    pub corrected_aggregate: u64,
    pub uncorrected_aggregate: u64,
}

/// `"remapped_rows": {...}`: absolute values; absent keys stay as they are.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemappedRows {
    pub correctable: Option<u32>,
    pub uncorrectable: Option<u32>,
    pub pending: Option<bool>,
    pub failure: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RetiredPages {
    sbe: Option<u32>,
    dbe: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fail {
    function: String,
    code: u32,
    times: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEvent {
    #[serde(rename = "type")]
    event_type: u64,
    #[serde(default)]
    data: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PcieLink {
    generation: Option<u32>,
    width: Option<u32>,
}

/// `recovery_action`: a number or a name.
#[derive(Deserialize)]
#[serde(untagged)]
enum Recovery {
    Code(u32),
    Name(String),
}

/// One injection object. Keys are applied in the order of the fields here.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Injection {
    gpu: Option<u32>,
    reset: Option<bool>,
    count: Option<u32>,
    compute_mode: Option<u32>,
    temperature: Option<u32>,
    throttle: Option<u64>,
    pcie_replay: Option<u32>,
    pcie_link: Option<PcieLink>,
    persistence: Option<bool>,
    fabric: Option<RawFabric>,
    nvlink: Option<RawNvLink>,
    mps_clients: Option<Vec<MpsClient>>,
    compute_processes: Option<Vec<MpsClient>>,
    ecc: Option<EccDelta>,
    remapped_rows: Option<RemappedRows>,
    retired_pages: Option<RetiredPages>,
    retired_pages_pending: Option<bool>,
    fail: Option<Fail>,
    recovery_action: Option<Recovery>,
    xid: Option<u64>,
    message: Option<String>,
    event: Option<RawEvent>,
    unknown: Option<bool>,
    lost: Option<bool>,
}

fn recovery_code(r: Recovery) -> Result<u32, String> {
    match r {
        Recovery::Code(c) => Ok(c),
        Recovery::Name(n) => match n.to_ascii_lowercase().replace('_', "-").as_str() {
            "none" => Ok(0),
            "gpu-reset" | "reset" => Ok(1),
            "node-reboot" | "reboot" => Ok(2),
            "drain-p2p" => Ok(3),
            "drain-and-reset" => Ok(4),
            _ => Err(format!(
                "unknown recovery_action {n:?} (0-4, none, gpu-reset, node-reboot, drain-p2p, drain-and-reset)"
            )),
        },
    }
}

impl Injection {
    fn commands(self) -> Result<Vec<Command>, String> {
        let mut out = Vec::new();
        let gpu_opt = self.gpu;
        let gpu = |key: &str| gpu_opt.ok_or_else(|| format!("{key:?} needs a \"gpu\" index"));
        if self.reset == Some(true) {
            out.push(Command::Reset);
        }
        if let Some(n) = self.count {
            out.push(Command::Count { n });
        }
        if let Some(mode) = self.compute_mode {
            if mode > 3 {
                return Err(format!("compute_mode {mode} is not 0..=3"));
            }
            out.push(Command::ComputeMode {
                gpu: gpu("compute_mode")?,
                mode,
            });
        }
        if let Some(celsius) = self.temperature {
            out.push(Command::Temp {
                gpu: gpu("temperature")?,
                celsius,
            });
        }
        if let Some(mask) = self.throttle {
            out.push(Command::Throttle {
                gpu: gpu("throttle")?,
                mask,
            });
        }
        if let Some(n) = self.pcie_replay {
            out.push(Command::PcieReplay {
                gpu: gpu("pcie_replay")?,
                n,
            });
        }
        if let Some(l) = self.pcie_link {
            out.push(Command::PcieLink {
                gpu: gpu("pcie_link")?,
                generation: l.generation,
                width: l.width,
            });
        }
        if let Some(on) = self.persistence {
            out.push(Command::Persistence {
                gpu: gpu("persistence")?,
                on,
            });
        }
        if let Some(f) = self.fabric {
            out.push(Command::Fabric {
                gpu: gpu("fabric")?,
                fabric: f.change()?,
            });
        }
        if let Some(l) = self.nvlink {
            out.push(Command::NvLink {
                gpu: gpu("nvlink")?,
                link: l.link,
                change: NvLinkChange {
                    active: l.active,
                    counters: [l.replay, l.recovery, l.crc_flit, l.crc_data, l.ecc_data],
                },
            });
        }
        if let Some(pids) = self.mps_clients {
            out.push(Command::MpsClients {
                gpu: gpu("mps_clients")?,
                pids,
            });
        }
        if let Some(pids) = self.compute_processes {
            out.push(Command::ComputeProcesses {
                gpu: gpu("compute_processes")?,
                pids,
            });
        }
        if let Some(delta) = self.ecc {
            out.push(Command::Ecc {
                gpu: gpu("ecc")?,
                delta,
            });
        }
        if let Some(rows) = self.remapped_rows {
            out.push(Command::RemappedRows {
                gpu: gpu("remapped_rows")?,
                rows,
            });
        }
        if let Some(r) = self.retired_pages {
            out.push(Command::RetiredPages {
                gpu: gpu("retired_pages")?,
                sbe: r.sbe,
                dbe: r.dbe,
            });
        }
        if let Some(pending) = self.retired_pages_pending {
            out.push(Command::RetiredPending {
                gpu: gpu("retired_pages_pending")?,
                pending,
            });
        }
        if let Some(f) = self.fail {
            if !f.function.starts_with("nvml") {
                return Err(format!(
                    "fail.function {:?} is not an nvml* function",
                    f.function
                ));
            }
            let sel = gpu_opt.map_or(GpuSel::Any, GpuSel::One);
            out.push(if f.code == 0 || f.times == Some(0) {
                Command::Unfail {
                    function: f.function,
                    gpu: sel,
                }
            } else {
                Command::Fail {
                    function: f.function,
                    gpu: sel,
                    code: f.code,
                    times: f.times,
                }
            });
        }
        if let Some(r) = self.recovery_action {
            out.push(Command::Recovery {
                gpu: gpu("recovery_action")?,
                action: recovery_code(r)?,
            });
        }
        if self.message.is_some() && self.xid.is_none() {
            return Err("`message` is the text of an `xid`; give both".into());
        }
        if let Some(code) = self.xid {
            out.push(Command::Xid {
                gpu: gpu("xid")?,
                code,
                message: self.message.clone(),
            });
        }
        if let Some(e) = self.event {
            out.push(Command::Event {
                gpu: gpu("event")?,
                event_type: e.event_type,
                data: e.data,
            });
        }
        if self.unknown == Some(true) {
            out.push(Command::Unknown);
        }
        if let Some(lost) = self.lost {
            out.push(Command::Lost {
                gpu: gpu("lost")?,
                lost,
            });
        }
        if out.is_empty() {
            return Err("no injection key in object".to_string());
        }
        Ok(out)
    }
}

/// Parses the text of one injection file: an object, or an array of objects.
pub fn parse(text: &str) -> Result<Vec<Command>, String> {
    from_value(serde_json::from_str(text).map_err(|e| e.to_string())?)
}

/// [`parse`] for an already-parsed JSON document.
pub fn from_value(value: serde_json::Value) -> Result<Vec<Command>, String> {
    let (objects, is_array) = match value {
        serde_json::Value::Array(items) => (items, true),
        other => (vec![other], false),
    };
    if objects.is_empty() {
        return Err("empty array".to_string());
    }
    let mut out = Vec::new();
    for (k, obj) in objects.into_iter().enumerate() {
        let at = |e: String| if is_array { format!("[{k}]: {e}") } else { e };
        let inj: Injection = serde_json::from_value(obj).map_err(|e| at(e.to_string()))?;
        out.extend(inj.commands().map_err(at)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(s: &str) -> Command {
        let mut v = parse(s).unwrap();
        assert_eq!(v.len(), 1, "{s}");
        v.remove(0)
    }

    #[test]
    fn contract_keys() {
        assert_eq!(
            one(r#"{"gpu": 2, "xid": 79}"#),
            Command::Xid {
                gpu: 2,
                code: 79,
                message: None
            }
        );
        assert_eq!(
            one(
                r#"{"gpu": 1, "xid": 149, "message": "NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x0)"}"#
            ),
            Command::Xid {
                gpu: 1,
                code: 149,
                message: Some("NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x0)".into())
            }
        );
        assert_eq!(
            one(r#"{"gpu": 1, "lost": true}"#),
            Command::Lost { gpu: 1, lost: true }
        );
        assert_eq!(
            one(r#"{"gpu": 0, "ecc": {"uncorrected_volatile": 1, "corrected_aggregate": 5}}"#),
            Command::Ecc {
                gpu: 0,
                delta: EccDelta {
                    uncorrected_volatile: 1,
                    corrected_aggregate: 5,
                    ..Default::default()
                }
            }
        );
        assert_eq!(
            one(
                r#"{"gpu": 0, "remapped_rows": {"pending": true, "failure": true, "uncorrectable": 3}}"#
            ),
            Command::RemappedRows {
                gpu: 0,
                rows: RemappedRows {
                    correctable: None,
                    uncorrectable: Some(3),
                    pending: Some(true),
                    failure: Some(true)
                }
            }
        );
        assert_eq!(
            one(r#"{"gpu": 3, "retired_pages_pending": true}"#),
            Command::RetiredPending {
                gpu: 3,
                pending: true
            }
        );
        assert_eq!(
            one(r#"{"gpu": 0, "recovery_action": 2}"#),
            Command::Recovery { gpu: 0, action: 2 }
        );
        assert_eq!(
            one(r#"{"gpu": 0, "recovery_action": "drain_and_reset"}"#),
            Command::Recovery { gpu: 0, action: 4 }
        );
        assert_eq!(
            one(r#"{"gpu": 1, "temperature": 95}"#),
            Command::Temp {
                gpu: 1,
                celsius: 95
            }
        );
        assert_eq!(
            one(
                r#"{"gpu": 1, "mps_clients": [10, {"pid": 20, "used_mib": 2048}, {"pid": 21, "sm_percent": 35}]}"#
            ),
            Command::MpsClients {
                gpu: 1,
                pids: vec![
                    MpsClient {
                        pid: 10,
                        used_mib: None,
                        sm_percent: None
                    },
                    MpsClient {
                        pid: 20,
                        used_mib: Some(2048),
                        sm_percent: None
                    },
                    MpsClient {
                        pid: 21,
                        used_mib: None,
                        sm_percent: Some(35)
                    }
                ]
            }
        );
        assert_eq!(
            one(r#"{"gpu": 2, "compute_processes": [30, {"pid": 40, "used_mib": 512}]}"#),
            Command::ComputeProcesses {
                gpu: 2,
                pids: vec![
                    MpsClient {
                        pid: 30,
                        used_mib: None,
                        sm_percent: None
                    },
                    MpsClient {
                        pid: 40,
                        used_mib: Some(512),
                        sm_percent: None
                    }
                ]
            }
        );
        assert_eq!(
            one(r#"{"gpu": 1, "fail": {"function": "nvmlDeviceGetTotalEccErrors", "code": 999}}"#),
            Command::Fail {
                function: "nvmlDeviceGetTotalEccErrors".into(),
                gpu: GpuSel::One(1),
                code: 999,
                times: None
            }
        );
    }

    #[test]
    fn extras() {
        assert_eq!(one(r#"{"count": 3}"#), Command::Count { n: 3 });
        assert_eq!(one(r#"{"unknown": true}"#), Command::Unknown);
        assert_eq!(one(r#"{"reset": true}"#), Command::Reset);
        assert_eq!(
            one(r#"{"gpu": 0, "throttle": 72}"#),
            Command::Throttle { gpu: 0, mask: 72 }
        );
        assert_eq!(
            one(r#"{"gpu": 0, "retired_pages": {"sbe": 2, "dbe": 1}}"#),
            Command::RetiredPages {
                gpu: 0,
                sbe: Some(2),
                dbe: Some(1)
            }
        );
        assert_eq!(
            one(r#"{"gpu": 0, "event": {"type": 8192, "data": 7}}"#),
            Command::Event {
                gpu: 0,
                event_type: 0x2000,
                data: 7
            }
        );
        assert_eq!(
            one(r#"{"fail": {"function": "nvmlDeviceGetCount_v2", "code": 999, "times": 2}}"#),
            Command::Fail {
                function: "nvmlDeviceGetCount_v2".into(),
                gpu: GpuSel::Any,
                code: 999,
                times: Some(2)
            }
        );
        assert_eq!(
            one(r#"{"fail": {"function": "nvmlDeviceGetCount_v2", "code": 0}}"#),
            Command::Unfail {
                function: "nvmlDeviceGetCount_v2".into(),
                gpu: GpuSel::Any
            }
        );
    }

    #[test]
    fn links() {
        assert_eq!(
            one(r#"{"gpu": 1, "persistence": false}"#),
            Command::Persistence { gpu: 1, on: false }
        );
        assert_eq!(
            one(
                r#"{"gpu": 0, "fabric": {"state": "in-progress", "status": 3, "cluster_uuid": "00112233-4455-6677-8899-aabbccddeeff"}}"#
            ),
            Command::Fabric {
                gpu: 0,
                fabric: FabricChange {
                    state: Some(2),
                    status: Some(3),
                    clique_id: None,
                    cluster_uuid: Some([
                        0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb,
                        0xcc, 0xdd, 0xee, 0xff
                    ]),
                }
            }
        );
        assert_eq!(
            one(
                r#"{"gpu": 2, "nvlink": {"link": 7, "active": false, "crc_flit": 5, "replay": 1}}"#
            ),
            Command::NvLink {
                gpu: 2,
                link: Some(7),
                change: NvLinkChange {
                    active: Some(false),
                    counters: [1, 0, 5, 0, 0]
                }
            }
        );
        for bad in [
            r#"{"gpu": 0, "fabric": {"state": "done"}}"#,
            r#"{"gpu": 0, "fabric": {"state": 9}}"#,
            r#"{"gpu": 0, "fabric": {"cluster_uuid": "xyz"}}"#,
            r#"{"gpu": 0, "nvlink": {"crc": 1}}"#,
            r#"{"nvlink": {"link": 0, "active": false}}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn several_keys_and_arrays_keep_a_fixed_order() {
        let v =
            parse(r#"[{"gpu": 0, "lost": true, "xid": 79, "temperature": 90}, {"reset": true}]"#)
                .unwrap();
        assert_eq!(
            v,
            [
                Command::Temp {
                    gpu: 0,
                    celsius: 90
                },
                Command::Xid {
                    gpu: 0,
                    code: 79,
                    message: None
                },
                Command::Lost { gpu: 0, lost: true },
                Command::Reset,
            ]
        );
    }

    #[test]
    fn rejects_garbage() {
        for bad in [
            "",
            "{",
            "[]",
            "{}",
            "42",
            r#"{"gpu": 0}"#,
            r#"{"xid": 79}"#,
            r#"{"gpu": 0, "xid": "79"}"#,
            r#"{"gpu": 0, "frobnicate": 1}"#,
            r#"{"gpu": -1, "xid": 79}"#,
            r#"{"gpu": 0, "ecc": {"uncorrected": 1}}"#,
            r#"{"gpu": 0, "recovery_action": "explode"}"#,
            r#"{"gpu": 0, "fail": {"function": "getTemp", "code": 999}}"#,
            r#"{"gpu": 0, "compute_mode": 9}"#,
            r#"[{"reset": true}, {"gpu": 0}]"#,
            r#"{"gpu": 0, "message": "text without an xid"}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
