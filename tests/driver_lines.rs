//! The drivers' own XID and SXid lines, as real kernels printed them, through gpu-medic's
//! readers: `tests/fixtures/driver-lines.tsv` holds one line a row with the fields the
//! driver put in it (its source, licence and driver branch beside it; the sources:
//! tests/fixtures/README.md). Each line is fed as the four framings gpu-medic meets (a
//! `/dev/kmsg` record, a syslog line tagged `kernel:`, a `dmesg -T` line, the bare message)
//! to `probe::kmsg::parse_line` (XIDs) and `probe::sxid::parse_line` (SXids), and every field
//! must come out as the row says: the format, code, address, MIG instance, pid, name, cause
//! and the place gpu-medic reads from the message.
//!
//! Why: `model::driver_line::FORMATS` was built from the driver's format strings; these are
//! what drivers printed, across branches r418 to r595. A format the table lacks, or a line
//! the reader splits otherwise than the driver wrote it, fails here. Every entry of `FORMATS`
//! must have a real line (a capture, or a maintainer's quote of one) or a row saying why none
//! was found.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::collections::BTreeMap;

use gpu_medic::model::attribution::decode_site;
use gpu_medic::model::driver_line::{self, FORMATS, Pid};
use gpu_medic::probe::{kmsg, sxid};

const TABLE: &str = "tests/fixtures/driver-lines.tsv";
const COLUMNS: [&str; 15] = [
    "kind", "branch", "frame", "source", "licence", "reads", "format", "code", "pci", "mig", "pid",
    "name", "cause", "place", "line",
];

/// One row of the table, by column name.
struct Row {
    at: usize,
    cells: BTreeMap<String, String>,
}

impl Row {
    fn get(&self, column: &str) -> &str {
        self.cells.get(column).map(String::as_str).unwrap_or("")
    }

    /// `-` is "none".
    fn opt(&self, column: &str) -> Option<&str> {
        Some(self.get(column)).filter(|v| *v != "-")
    }

    fn what(&self) -> String {
        format!("{TABLE} row {}: {}", self.at, self.get("line"))
    }
}

fn rows() -> Vec<Row> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(TABLE);
    let rows: Vec<Row> = gpu_medic_testkit::tsv(&path)
        .into_iter()
        .enumerate()
        .map(|(i, cells)| Row { at: i + 1, cells })
        .collect();
    for r in &rows {
        let columns: Vec<&str> = r.cells.keys().map(String::as_str).collect();
        let mut want = COLUMNS.to_vec();
        want.sort_unstable();
        assert_eq!(columns, want, "{TABLE}'s columns");
    }
    rows
}

/// The message in each framing gpu-medic reads a kernel log in.
fn framings(message: &str) -> [String; 4] {
    [
        format!("4,1234,5678901234,-;{message}"),
        format!("Dec  7 10:00:00 ip-10-0-1-17 kernel: [ 5678.901234] {message}"),
        format!("[Sun Feb 23 16:24:18 2025] {message}"),
        message.to_string(),
    ]
}

/// The row's expectation against what the XID reader gave for one framing.
fn check_xid(row: &Row, framed: &str) -> Vec<String> {
    let Some(x) = kmsg::parse_line(framed) else {
        return vec![format!("not read as an XID: {framed}")];
    };
    let mut bad = Vec::new();
    let mut expect = |field: &str, got: String, want: String| {
        if got != want {
            bad.push(format!("{field}: got {got:?}, want {want:?}"));
        }
    };
    expect("format", x.format.into(), row.get("format").into());
    expect("code", x.code.to_string(), row.get("code").into());
    expect("pci", x.pci.clone(), row.get("pci").into());
    let pid = match row.get("pid") {
        "unknown" | "-" => None,
        n => Some(n.to_string()),
    };
    expect(
        "pid",
        format!("{:?}", x.pid.map(|p| p.to_string())),
        format!("{pid:?}"),
    );
    let name = match row.get("name") {
        "unknown" | "-" => None,
        n => Some(n.to_string()),
    };
    expect("name", format!("{:?}", x.process), format!("{name:?}"));
    expect("name exact", x.name_exact.to_string(), "true".into());
    expect("message whole", x.message_whole.to_string(), "true".into());
    expect(
        "cause",
        format!("{:?}", x.cause.map(|c| c.to_string())),
        format!("{:?}", row.opt("cause")),
    );
    let place = decode_site(x.code, &x.text).and_then(|s| s.key());
    expect(
        "place",
        format!("{place:?}"),
        format!("{:?}", row.opt("place").map(str::to_string)),
    );
    // What the record's own reader keeps beyond KernelXid: pid='<unknown>' against no pid at
    // all, and the MIG instance.
    let fields = driver_line::parse(row.get("line"), &|_| None).expect("read above");
    let pid_kind = match fields.pid {
        Pid::Printed(_) => "printed",
        Pid::Unknown => "unknown",
        Pid::Absent => "-",
    };
    let want_kind = match row.get("pid") {
        "unknown" => "unknown",
        "-" => "-",
        _ => "printed",
    };
    expect("pid kind", pid_kind.into(), want_kind.into());
    let mig = match (fields.gpu_instance, fields.compute_instance) {
        (None, None) => "-".to_string(),
        (gi, ci) => format!("{}/{}", show(gi), show(ci)),
    };
    expect("mig", mig, row.get("mig").into());
    bad
}

fn show(n: Option<u32>) -> String {
    n.map_or_else(|| "-".into(), |n| n.to_string())
}

/// An SXid's first line, or one of the lines that carry its data (never an SXid of its own).
fn check_sxid(row: &Row, framed: &str, data_line: bool) -> Vec<String> {
    let mut bad = Vec::new();
    if kmsg::parse_line(framed).is_some() {
        bad.push(format!("an SXid read as an XID: {framed}"));
    }
    let fields = driver_line::parse(row.get("line"), &|_| None);
    match fields {
        Some(f) if f.format.id == row.get("format") && f.code.to_string() == row.get("code") => {}
        other => bad.push(format!(
            "the driver's line reads as {:?}",
            other.map(|f| (f.format.id, f.code))
        )),
    }
    match (sxid::parse_line(framed), data_line) {
        (None, true) => {}
        (Some(s), true) => bad.push(format!("a data line read as an SXid of its own: {s:?}")),
        (None, false) => bad.push(format!("not read as an SXid: {framed}")),
        (Some(s), false) => {
            let got = (s.code.to_string(), s.pci.clone(), s.switch.clone());
            let want = (
                row.get("code").to_string(),
                row.get("pci").to_string(),
                row.opt("name").map(str::to_string),
            );
            if got != want {
                bad.push(format!("(code, pci, switch): got {got:?}, want {want:?}"));
            }
        }
    }
    bad
}

#[test]
fn every_real_line_gives_the_fields_the_driver_printed() {
    let rows = rows();
    assert!(rows.len() >= 20, "{} rows", rows.len());
    let mut bad = Vec::new();
    for row in &rows {
        for framed in framings(row.get("line")) {
            let found = match row.get("reads") {
                "xid" => check_xid(row, &framed),
                "sxid" => check_sxid(row, &framed, false),
                "sxid-data" => check_sxid(row, &framed, true),
                other => vec![format!("unknown `reads` {other:?}")],
            };
            bad.extend(
                found
                    .into_iter()
                    .map(|b| format!("{}\n    {b}", row.what())),
            );
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Each format has a line a real driver printed, or a row that says why none was found.
#[test]
fn every_format_has_a_real_line_or_says_why_not() {
    let rows = rows();
    let known: Vec<&str> = FORMATS.iter().map(|f| f.id).collect();
    let mut bad = Vec::new();
    for row in &rows {
        if !known.contains(&row.get("format")) {
            bad.push(format!(
                "{}: no such format {:?}",
                row.what(),
                row.get("format")
            ));
        }
        if !["capture", "quote", "doc", "missing"].contains(&row.get("kind")) {
            bad.push(format!(
                "{}: unknown kind {:?}",
                row.what(),
                row.get("kind")
            ));
        }
        if row.get("source").is_empty() || row.get("licence").is_empty() {
            bad.push(format!("{}: no source or licence", row.what()));
        }
    }
    for f in FORMATS {
        let of = |kinds: &[&str]| {
            rows.iter()
                .filter(|r| r.get("format") == f.id && kinds.contains(&r.get("kind")))
                .count()
        };
        if of(&["capture", "quote"]) == 0 && of(&["missing"]) == 0 {
            bad.push(format!(
                "format {}: no real line in {TABLE}, and no `missing` row saying why",
                f.id
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The table holds what the issue asks for: a MIG-attributed line, `pid='<unknown>'`, the
/// r570 form without pid and name, XID 45 naming its cause, and SXids with their data lines.
#[test]
fn the_table_holds_each_shape_the_drivers_print() {
    let rows = rows();
    let has = |what: &str, pred: &dyn Fn(&Row) -> bool| {
        assert!(rows.iter().any(pred), "{TABLE} has no {what}");
    };
    has("MIG-attributed line", &|r| r.get("mig") != "-");
    has("pid='<unknown>' capture", &|r| {
        r.get("pid") == "unknown" && r.get("kind") == "capture"
    });
    has("line without pid and name", &|r| {
        r.get("reads") == "xid" && r.get("pid") == "-" && r.get("name") == "-"
    });
    has("XID 45 naming its cause", &|r| {
        r.get("code") == "45" && r.get("cause") != "-" && r.get("kind") == "capture"
    });
    has("SXid", &|r| r.get("reads") == "sxid");
    has("SXid data line", &|r| r.get("reads") == "sxid-data");
}
