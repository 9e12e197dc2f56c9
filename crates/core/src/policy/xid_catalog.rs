//! NVIDIA's XID catalog, compiled in from `docs/xid-catalog.csv` (every XID, its mnemonic,
//! description and immediate action) and `docs/xid-nvlink5-decode.csv` (the "XID 144-150
//! Decode" sheet). `docs/xid-catalog.md` says where they come from and when they were read.
//!
//! Why it is in the binary: the kernel log and NVML decoders apply the decode sheet to NVLink5
//! XIDs, and `gpu-medic policy check` reports which catalog XIDs a policy leaves to its
//! catch-all and which fatal signals it silences. The tests read the same files, so the data
//! the binary acts on is the data the CI checks.

use std::sync::OnceLock;

use crate::model::{RecoveryAction, Signal, XidDecode};

const CATALOG_CSV: &str = include_str!("../../../../docs/xid-catalog.csv");
const DECODE_CSV: &str = include_str!("../../../../docs/xid-nvlink5-decode.csv");

/// The NVLink5 XIDs, whose action depends on the error status in their text.
pub const NVLINK5: std::ops::RangeInclusive<u32> = 144..=150;
/// CHECK_UVM: "If UVM/vGPU is being utilized, RESET_GPU; otherwise IGNORE".
pub const CHECK_UVM_XID: u32 = 159;

/// Whether an XID is charged to a program (docs/attribution.md): the catalog's RESTART_APP
/// bucket but XID 94 (a contained ECC error: the memory's fault, which only the program that
/// met it must restart for), and the channel faults 43 and 45 (IGNORE, WORKFLOW_XID_45),
/// which name the process whose channel was reset.
pub fn attributable(code: u32) -> bool {
    matches!(code, 43 | 45)
        || (code != 94 && get(code).is_some_and(|x| x.immediate == "RESTART_APP"))
}

/// XIDs whose catalog row gives no immediate action (162-172 in the catalog read) but which
/// gpu-medic treats as fatal like their siblings: 167 PCIE_FATAL_TIMEOUT (158
/// GPU_FATAL_TIMEOUT, RESET_GPU), 168 REDUCED_GPU_MEMORY_CAPACITY (64, RESET_GPU), 169
/// SEC2_HALT_ERROR (62 PMU_HALT_ERROR, same description, RESET_GPU), 171/172 the DRAM/SRAM
/// detail of XID 48.
pub const FATAL_WITHOUT_CLASS: [u32; 5] = [167, 168, 169, 171, 172];

/// NVIDIA's immediate actions that need at least a GPU reset (or a reboot, a VM restart, a
/// mechanical check): on EC2 a drain or a replacement.
pub const FATAL_CLASSES: [&str; 6] = [
    "RESET_GPU",
    "RESTART_BM",
    "RESTART_VM",
    "CHECK_MECHANICALS",
    "WORKFLOW_XID_48",
    "WORKFLOW_NVLINK_ERR",
];

/// One row of the catalog's "Xids" sheet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogXid {
    pub code: u32,
    pub mnemonic: String,
    pub description: String,
    /// Applies to A100, H100, B100, GB200.
    pub applies: [bool; 4],
    /// "Resolution Bucket (Immediate Action)"; empty where the catalog gives none.
    pub immediate: String,
    pub investigatory: String,
    pub xid154_linkage: String,
    pub note: String,
}

impl CatalogXid {
    /// Whether NVIDIA's immediate action needs a reset or more (or, for the rows without a
    /// class, gpu-medic treats the XID like its fatal siblings).
    pub fn is_fatal(&self) -> bool {
        FATAL_CLASSES.contains(&self.immediate.as_str()) || FATAL_WITHOUT_CLASS.contains(&self.code)
    }
}

/// A 32-bit pattern of the decode sheet: `-` bits are not part of the decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mask {
    pub care: u32,
    pub value: u32,
}

impl Mask {
    /// Parses the sheet's notation, bit 31 first (`------000000----------0011000010`).
    pub fn parse(s: &str) -> Result<Mask, String> {
        if s.len() != 32 {
            return Err(format!("mask {s:?} is not 32 characters"));
        }
        let (mut care, mut value) = (0u32, 0u32);
        for (i, c) in s.chars().enumerate() {
            let bit = 1u32 << (31 - i);
            match c {
                '0' => care |= bit,
                '1' => {
                    care |= bit;
                    value |= bit;
                }
                '-' => {}
                _ => return Err(format!("mask {s:?}: unexpected {c:?}")),
            }
        }
        Ok(Mask { care, value })
    }

    pub fn matches(self, v: u32) -> bool {
        v & self.care == self.value
    }
}

/// One row of the "XID 144-150 Decode" sheet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeRow {
    pub xid: u32,
    /// The subcode as the message prints it; `V1/V2` where drivers before R575 and from R575
    /// name it differently.
    pub subcode: String,
    /// IntrInfo patterns for drivers before R575 (V1) and from R575 (V2).
    pub intr_v1: Mask,
    pub intr_v2: Mask,
    /// Error status values this row covers; empty: any.
    pub error_status: Vec<u32>,
    pub immediate: String,
    /// A promotable error: when IntrInfo matches these, `action2` applies instead.
    pub action2: Option<(Mask, Mask, String)>,
    pub investigatory: String,
    pub severity: String,
}

impl DecodeRow {
    fn names(&self) -> impl Iterator<Item = &str> {
        self.subcode.split('/').map(str::trim)
    }

    fn class(&self, intr: u32) -> Option<XidDecode> {
        let bucket = match &self.action2 {
            Some((a1, a2, action)) if a1.matches(intr) || a2.matches(intr) => action,
            _ => &self.immediate,
        };
        decode_class(bucket)
    }
}

/// The sheet's immediate actions as gpu-medic's decode classes.
pub fn decode_class(bucket: &str) -> Option<XidDecode> {
    match bucket {
        "RESET_GPU" => Some(XidDecode::ResetGpu),
        "IGNORE" => Some(XidDecode::Ignore),
        "XID_154_EVAL" => Some(XidDecode::Xid154Eval),
        _ => None,
    }
}

struct Data {
    xids: Vec<CatalogXid>,
    decode: Vec<DecodeRow>,
}

fn data() -> &'static Data {
    // layout: static allowed: the compiled-in catalog, parsed once; constant data, no state.
    static DATA: OnceLock<Data> = OnceLock::new();
    DATA.get_or_init(|| {
        let xids = parse_catalog(CATALOG_CSV).unwrap_or_else(|e| {
            // The file is compiled in and parsed by the tests; this cannot happen in a build
            // that passed them. Without it nothing is decoded and no XID is reported as
            // uncovered, which is the state before the catalog existed.
            tracing::error!("docs/xid-catalog.csv: {e}");
            Vec::new()
        });
        let decode = parse_decode(DECODE_CSV).unwrap_or_else(|e| {
            tracing::error!("docs/xid-nvlink5-decode.csv: {e}");
            Vec::new()
        });
        Data { xids, decode }
    })
}

/// Every XID of the catalog, by code.
pub fn xids() -> &'static [CatalogXid] {
    &data().xids
}

pub fn get(code: u32) -> Option<&'static CatalogXid> {
    xids().iter().find(|x| x.code == code)
}

/// The rows of the NVLink5 decode sheet.
pub fn decode_rows() -> &'static [DecodeRow] {
    &data().decode
}

/// The signals a policy must not silence (judge `ignore` or `log`) without opting in: every
/// catalog XID that needs a reset or more, the NVLink5 and CHECK_UVM XIDs decoded as
/// RESET_GPU, a lost or missing GPU, a failed row remap, and the driver's own reset and
/// reboot verdicts.
pub fn fatal_signals() -> Vec<Signal> {
    let mut out: Vec<Signal> = xids()
        .iter()
        .filter(|x| x.is_fatal())
        .map(|x| Signal::xid(x.code))
        .collect();
    for code in NVLINK5.chain([CHECK_UVM_XID]) {
        out.push(Signal::Xid {
            code,
            decode: Some(XidDecode::ResetGpu),
        });
    }
    out.extend([
        Signal::GpuLost,
        Signal::DeviceCountMismatch,
        Signal::DriverNotLoaded,
        Signal::RowRemapFailure,
    ]);
    for action in [
        RecoveryAction::GpuReset,
        RecoveryAction::NodeReboot,
        RecoveryAction::DrainAndReset,
    ] {
        out.push(Signal::RecoveryAction { action });
    }
    out
}

/// What an NVLink5 XID's text says, as the driver prints it after the code:
/// `<subcode> <Fatal|Nonfatal> XC<n> i<n> Link <n> (<intrInfo> <errorStatus> <debug>...)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nvlink5Text {
    pub subcode: String,
    pub intr_info: u32,
    pub error_status: u32,
}

/// Parses an NVLink5 XID's text (the part after `149, `). `None` when it does not have the
/// parenthesised registers.
pub fn parse_nvlink5(text: &str) -> Option<Nvlink5Text> {
    let subcode = text.split_whitespace().next()?.trim_end_matches(',');
    let open = text.find('(')?;
    let close = text[open..].find(')')? + open;
    let mut regs = text[open + 1..close].split_whitespace().map(|w| {
        let w = w.trim_end_matches(',');
        let hex = w.strip_prefix("0x").or_else(|| w.strip_prefix("0X"))?;
        u32::from_str_radix(hex, 16).ok()
    });
    let intr_info = regs.next()??;
    let error_status = regs.next()??;
    Some(Nvlink5Text {
        subcode: subcode.to_string(),
        intr_info,
        error_status,
    })
}

/// The result of decoding one NVLink5 XID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Nvlink5Decode {
    pub class: XidDecode,
    /// For the incident: what was read and which row decided.
    pub explanation: String,
}

/// Applies the decode sheet to an NVLink5 XID's text. Rows match on IntrInfo (either driver
/// generation's pattern) and error status; where the printed subcode names some of them, only
/// those. Matching rows that disagree give the most severe class. No text, no registers or
/// no matching row: `undecoded`.
pub fn decode_nvlink5(code: u32, text: Option<&str>) -> Nvlink5Decode {
    let undecoded = |why: String| Nvlink5Decode {
        class: XidDecode::Undecoded,
        explanation: format!("NVLink5 XID {code} not decoded: {why}"),
    };
    let Some(text) = text else {
        return undecoded("no kernel log text (NVML events carry only the code)".into());
    };
    let Some(m) = parse_nvlink5(text) else {
        return undecoded(format!("no IntrInfo/error status registers in {text:?}"));
    };
    let rows: Vec<&DecodeRow> = decode_rows()
        .iter()
        .filter(|r| r.xid == code)
        .filter(|r| r.intr_v1.matches(m.intr_info) || r.intr_v2.matches(m.intr_info))
        .filter(|r| r.error_status.is_empty() || r.error_status.contains(&m.error_status))
        .collect();
    let named: Vec<&DecodeRow> = rows
        .iter()
        .copied()
        .filter(|r| r.names().any(|n| n.eq_ignore_ascii_case(&m.subcode)))
        .collect();
    let rows = if named.is_empty() { rows } else { named };
    let best = rows
        .iter()
        .filter_map(|r| r.class(m.intr_info).map(|c| (c, *r)))
        .max_by_key(|(c, _)| *c);
    match best {
        Some((class, row)) => Nvlink5Decode {
            class,
            explanation: format!(
                "NVLink5 decode: {} IntrInfo {:#010x} error status {:#010x} -> {} ({}, {}; investigate: {})",
                m.subcode,
                m.intr_info,
                m.error_status,
                class.as_str(),
                row.subcode,
                row.severity,
                row.investigatory
            ),
        },
        None => undecoded(format!(
            "no row of the decode sheet matches {} IntrInfo {:#010x} error status {:#010x}",
            m.subcode, m.intr_info, m.error_status
        )),
    }
}

/// Splits one CSV line (RFC 4180: commas, double quotes, `""` inside quotes).
pub fn csv_fields(line: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            (true, '"') => quoted = false,
            (false, '"') if cur.is_empty() => quoted = true,
            (false, ',') => out.push(std::mem::take(&mut cur)),
            (_, c) => cur.push(c),
        }
    }
    if quoted {
        return Err(format!("unterminated quote in {line:?}"));
    }
    out.push(cur);
    Ok(out)
}

/// Rows of a CSV file with a header, as (line number, header -> value) maps.
fn records(text: &str, want: usize) -> Result<Vec<(usize, Vec<String>)>, String> {
    let mut lines = text.lines().enumerate();
    let header = lines.next().ok_or("empty file")?.1;
    let n = csv_fields(header)?.len();
    if n != want {
        return Err(format!("header has {n} columns, expected {want}"));
    }
    let mut out = Vec::new();
    for (i, l) in lines.filter(|(_, l)| !l.trim().is_empty()) {
        let f = csv_fields(l).map_err(|e| format!("line {}: {e}", i + 1))?;
        if f.len() != n {
            return Err(format!("line {}: {} fields, expected {n}", i + 1, f.len()));
        }
        out.push((i + 1, f));
    }
    Ok(out)
}

pub fn parse_catalog(text: &str) -> Result<Vec<CatalogXid>, String> {
    let mut out: Vec<CatalogXid> = Vec::new();
    for (line, f) in records(text, 11)? {
        let code = f[0]
            .parse()
            .map_err(|_| format!("line {line}: bad code {:?}", f[0]))?;
        let yes = |s: &str| -> Result<bool, String> {
            match s {
                "YES" => Ok(true),
                "NO" => Ok(false),
                _ => Err(format!("line {line}: {s:?} is not YES or NO")),
            }
        };
        out.push(CatalogXid {
            code,
            mnemonic: f[1].clone(),
            description: f[2].clone(),
            applies: [yes(&f[3])?, yes(&f[4])?, yes(&f[5])?, yes(&f[6])?],
            immediate: f[7].clone(),
            investigatory: f[8].clone(),
            xid154_linkage: f[9].clone(),
            note: f[10].clone(),
        });
    }
    Ok(out)
}

pub fn parse_decode(text: &str) -> Result<Vec<DecodeRow>, String> {
    let mut out = Vec::new();
    for (line, f) in records(text, 13)? {
        let at = |e: String| format!("line {line}: {e}");
        let status = if f[4].is_empty() {
            Vec::new()
        } else {
            f[4].split('/')
                .map(|s| {
                    let h = s.trim().trim_start_matches("0x");
                    u32::from_str_radix(h, 16).map_err(|_| at(format!("bad error status {s:?}")))
                })
                .collect::<Result<_, _>>()?
        };
        let action2 = if f[8].is_empty() {
            None
        } else {
            Some((
                Mask::parse(&f[6]).map_err(at)?,
                Mask::parse(&f[7]).map_err(at)?,
                f[8].clone(),
            ))
        };
        out.push(DecodeRow {
            xid: f[0]
                .parse()
                .map_err(|_| at(format!("bad xid {:?}", f[0])))?,
            subcode: f[1].clone(),
            intr_v1: Mask::parse(&f[2]).map_err(at)?,
            intr_v2: Mask::parse(&f[3]).map_err(at)?,
            error_status: status,
            immediate: f[5].clone(),
            action2,
            investigatory: f[9].clone(),
            severity: f[10].clone(),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compiled_in_files_parse_and_cover_every_code() {
        let x = parse_catalog(CATALOG_CSV).unwrap();
        assert_eq!(
            x.iter().map(|x| x.code).collect::<Vec<_>>(),
            (1..=172).collect::<Vec<_>>()
        );
        let d = parse_decode(DECODE_CSV).unwrap();
        for code in NVLINK5 {
            assert!(d.iter().any(|r| r.xid == code), "{code}");
        }
        for r in &d {
            assert!(decode_class(&r.immediate).is_some(), "{r:?}");
        }
    }

    #[test]
    fn csv_quotes() {
        assert_eq!(
            csv_fields(r#"1,"a, ""b""",,c"#).unwrap(),
            vec!["1", "a, \"b\"", "", "c"]
        );
        assert!(csv_fields(r#"1,"a"#).is_err());
    }

    /// Real kernel log lines (leptonai/gpud PR #1174, captured on GB200 nodes).
    #[test]
    fn public_captures_decode_as_the_sheet_says() {
        let d = decode_nvlink5(
            149,
            Some(
                "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
            ),
        );
        assert_eq!(d.class, XidDecode::ResetGpu, "{}", d.explanation);
        assert!(
            d.explanation.contains("INVESTIGATE_PEER_DEVICE"),
            "{}",
            d.explanation
        );
        let d = decode_nvlink5(
            149,
            Some(
                "NETIR Fatal XC0 i0 Link -1 (0x000fe406 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)",
            ),
        );
        assert_eq!(d.class, XidDecode::ResetGpu, "{}", d.explanation);
        let d = decode_nvlink5(
            145,
            Some(
                "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)",
            ),
        );
        assert_eq!(d.class, XidDecode::Ignore, "{}", d.explanation);
    }

    #[test]
    fn promotable_errors_and_undecodable_text() {
        // RLW_RXPIPE status 0x1: IGNORE, unless IntrInfo bit 10 promotes it to RESET_GPU.
        let text =
            |intr: u32| format!("RLW_RXPIPE Nonfatal XC0 i0 Link 13 ({intr:#010x} 0x00000001 0x0)");
        assert_eq!(
            decode_nvlink5(145, Some(&text(0x0409a0c2))).class,
            XidDecode::Ignore
        );
        assert_eq!(
            decode_nvlink5(145, Some(&text(0x0409a0c2 | 0x400))).class,
            XidDecode::ResetGpu
        );
        // V2 (R575+) encoding of the same subcode.
        assert_eq!(
            decode_nvlink5(
                145,
                Some("RLW_RXPIPE Nonfatal XC0 i0 Link 2 (0x00000006 0x00000008 0x0)")
            )
            .class,
            XidDecode::Ignore
        );
        // 147 TREX, 148 NVLPW: IGNORE.
        assert_eq!(
            decode_nvlink5(
                148,
                Some("NVLPW Nonfatal XC0 i0 Link 3 (0x0000000f 0x80000000 0x0)")
            )
            .class,
            XidDecode::Ignore
        );
        // RLW_REMAP 0x4: XID_154_EVAL.
        assert_eq!(
            decode_nvlink5(
                145,
                Some("RLW_REMAP Nonfatal XC0 i0 Link 1 (0x00000082 0x00000004 0x0)")
            )
            .class,
            XidDecode::Xid154Eval
        );
        for (code, text) in [
            (149, None),
            (149, Some("NETIR Fatal")),
            (149, Some("NETIR Fatal (zz 0x0)")),
            (
                144,
                Some("SAW_MVB Nonfatal XC0 i0 Link 0 (0x00000021 0x00000040)"),
            ),
            (149, Some("NETIR (0x")),
            (149, Some("")),
        ] {
            assert_eq!(
                decode_nvlink5(code, text).class,
                XidDecode::Undecoded,
                "{text:?}"
            );
        }
    }

    #[test]
    fn fatal_signals_include_the_catalogs_reset_classes_and_167_169() {
        let f = fatal_signals();
        for code in [79, 48, 95, 119, 120, 140, 62, 167, 169, 54, 151, 74] {
            assert!(f.contains(&Signal::xid(code)), "{code}");
        }
        for code in [13, 31, 43, 45, 63, 94, 154, 78] {
            assert!(!f.contains(&Signal::xid(code)), "{code}");
        }
        assert!(f.contains(&Signal::GpuLost));
    }
}
