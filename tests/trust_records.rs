//! Issue 4/5 (trust, third pass), through the real binary on the fake libnvidia-ml with the
//! test's `kmsg` file as the kernel log:
//! - only the NVIDIA driver's own records are XIDs or SXids: a record at user facility (what
//!   a process's write to `/dev/kmsg` becomes), the driver's text quoted inside another
//!   kernel message (an AppArmor denial naming a file, a USB product string) and a syslog
//!   line under another tag open nothing; the driver's lines in every log format real nodes
//!   show (kernel facility, kern.log's `kernel:` tag, RFC 3339 syslog, the older address
//!   without `PCI:`) are judged;
//! - a rotated kernel-log file loses nothing: truncated in place (copytruncate), replaced
//!   (renamed away and created anew), truncated while gpu-medic was down;
//! - no start-up race decides a verdict: an NVLink5 XID whose NVML event arrives before the
//!   kernel-log reader has started waits for its line and follows NVIDIA's decode sheet.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::{Daemon, FOUR_GPUS, wait_sync};
use serde_json::Value;

/// Four GPUs at buses 10, 20, 30 and 40; the kernel log is the dir's empty `kmsg` file.
fn node() -> Daemon {
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    d.gpus(FOUR_GPUS);
    std::fs::write(d.path("kmsg"), "").unwrap();
    d
}

/// The kernel-log observations journaled so far: (signal kind, code, GPU index).
fn kmsg_inputs(d: &Daemon) -> Vec<(String, u64, Option<u64>)> {
    std::fs::read_to_string(d.path("state/inputs.jsonl"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["source"] == "kmsg")
        .map(|v| {
            (
                v["signal"]["kind"].as_str().unwrap_or("").to_string(),
                v["signal"]["code"].as_u64().unwrap_or(0),
                v["gpu"]["index"].as_u64(),
            )
        })
        .collect()
}

fn wait_inputs(d: &Daemon, what: &str, n: usize) -> Vec<(String, u64, Option<u64>)> {
    wait_sync(
        what,
        Duration::from_secs(20),
        || kmsg_inputs(d).len() >= n,
        || format!("{:?}\n{}", kmsg_inputs(d), d.log()),
    );
    // Every record of the file applied (the last written is a driver's line): anything
    // journaled after them would show here too.
    d.wait_kmsg_applied(&format!("{what}: the whole kernel log applied"));
    kmsg_inputs(d)
}

/// Waits until the daemon's log says `needle` once more than `before` times: the kernel-log
/// reader has seen what the test did to its file.
fn wait_said(d: &Daemon, needle: &str, before: usize) {
    wait_sync(
        needle,
        Duration::from_secs(30),
        || d.log().matches(needle).count() > before,
        || d.log(),
    );
}

/// Item 1: a forged record at user facility, the driver's text quoted inside another kernel
/// message, and a syslog line under another tag open nothing; the real line after them is
/// the only one judged.
#[test]
fn only_the_drivers_own_records_are_xids_or_sxids() {
    let mut d = node();
    d.start();
    d.wait_polled();
    d.kmsg_append(&[
            // What `echo ... > /dev/kmsg` becomes: user facility (1), any level.
            "12,500,1000,-;NVRM: Xid (PCI:0000:10:00): 79, pid=1, name=x, GPU has fallen off the bus.",
            "14,501,1001,-;NVRM: Xid (PCI:0000:20:00): 48, An uncorrectable double bit error",
            "11,502,1002,-;NVRM: Xid (PCI:0000:10:00): 79, GPU has fallen off the bus.",
            // The driver's text quoted by another kernel message.
            "5,503,1003,-;audit: type=1400 audit(1700000000.123:45): apparmor=\"DENIED\" operation=\"open\" profile=\"p\" name=\"/tmp/NVRM: Xid (PCI:0000:10:00): 79, GPU has fallen off the bus.\" pid=4 comm=\"cat\"",
            "6,504,1004,-;usb 1-1: Product: NVRM: Xid (PCI:0000:10:00): 79, GPU has fallen off the bus.",
            "6,505,1005,-;usb 1-1: Product: nvidia-nvswitch0: SXid (PCI:0000:15:00.0): 20034, Fatal, Link 46 LTSSM Fault Up",
            "12,506,1006,-;nvidia-nvswitch0: SXid (PCI:0000:15:00.0): 20034, Fatal, Link 46 LTSSM Fault Up",
            // Syslog lines of another program.
            "Dec  3 12:00:00 ip-10-0-0-1 myapp[123]: NVRM: Xid (PCI:0000:10:00): 79, GPU has fallen off the bus.",
            "2026-12-03T12:00:00.123456+00:00 ip-10-0-0-1 logger: NVRM: Xid (PCI:0000:10:00): 79, GPU has fallen off the bus.",
            "Dec  3 12:00:00 ip-10-0-0-1 root: kernel: NVRM: Xid (PCI:0000:10:00): 79, x",
            // The driver's own line: judged.
            "4,600,2000,-;NVRM: Xid (PCI:0000:30:00): 13, pid=5, name=app, Graphics Exception",
        ],
    );
    let got = wait_inputs(&d, "the driver's XID 13", 1);
    assert_eq!(got, [("xid".to_string(), 13, Some(2))], "{}", d.log());
    let opened = gpu_medic_testkit::journal::events(&d.records(), "opened");
    assert!(
        opened
            .iter()
            .all(|r| r["observation"]["signal"]["code"] == 13),
        "{opened:#?}"
    );
    d.stop(Duration::from_secs(10));
}

/// Item 1 and 12: the driver's lines as real logs show them are all judged: a kernel-facility
/// record, kern.log's `kernel:` tag with the kernel's time stamp, RFC 3339 syslog, dmesg's
/// time stamp, the older address without `PCI:`, and a text with parentheses and colons.
#[test]
fn the_drivers_lines_in_every_log_format_are_judged() {
    let mut d = node();
    d.start();
    d.wait_polled();
    // Stamped now (a syslog line stamped before this boot is an earlier boot's, skipped).
    use gpu_medic_testkit::proc::syslog_now;
    d.kmsg_append(&[
            format!("{} ip-10-0-0-1 kernel: [12345.678901] NVRM: Xid (PCI:0000:10:00): 13, pid=1, name=a, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address", syslog_now(false)),
            format!("{} ip-10-0-0-1 kernel: NVRM: Xid (PCI:0000:20:00): 31, pid=2, name=b, Ch 00000008, intr 10000000. MMU Fault", syslog_now(true)),
            "[  431.100101] NVRM: Xid (0000:30:00): 43, pid=3, Ch 00000008".to_string(),
            "3,700,3000,-;NVRM: Xid (PCI:0000:40:00): 13, pid=4, name=c, Graphics Exception: ESR 0x50da30=0x102000e".to_string(),
        ],
    );
    let mut got = wait_inputs(&d, "four XIDs", 4);
    got.sort_by_key(|g| g.2);
    assert_eq!(
        got,
        [
            ("xid".to_string(), 13, Some(0)),
            ("xid".to_string(), 31, Some(1)),
            ("xid".to_string(), 43, Some(2)),
            ("xid".to_string(), 13, Some(3)),
        ],
        "{}",
        d.log()
    );
    d.stop(Duration::from_secs(10));
}

/// Item 10: a rotated kernel-log file loses nothing. Truncated in place (copytruncate), then
/// an XID: judged. Renamed away and created anew, then an XID: judged. Truncated while
/// gpu-medic was down, then an XID: judged at the start. None is judged twice.
#[test]
fn a_rotated_kernel_log_file_loses_nothing() {
    let mut d = node();
    d.start();
    d.wait_polled();
    let noise: Vec<String> = (0..40)
        .map(|i| {
            format!("6,{i},{i},-;usb 1-1: new high-speed USB device number {i} using xhci_hcd")
        })
        .collect();
    let mut first: Vec<&str> = noise.iter().map(String::as_str).collect();
    first.push("4,100,100,-;NVRM: Xid (PCI:0000:10:00): 13, pid=1, name=a, Graphics Exception");
    d.kmsg_append(&first);
    wait_inputs(&d, "the first XID", 1);
    // copytruncate: the same file, emptied in place (the reader says it saw that), then
    // written again.
    const TRUNCATED: &str = "the kernel log file was truncated";
    let said = d.log().matches(TRUNCATED).count();
    std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(d.path("kmsg"))
        .unwrap();
    wait_said(&d, TRUNCATED, said);
    d.kmsg_append(&["4,1,1,-;NVRM: Xid (PCI:0000:20:00): 31, pid=2, name=b, MMU Fault"]);
    let got = wait_inputs(&d, "the XID after copytruncate", 2);
    assert_eq!(got[1], ("xid".to_string(), 31, Some(1)), "{}", d.log());
    // Renamed away (logrotate's default) and created anew (the reader says it saw that).
    const REPLACED: &str = "the kernel log file was replaced";
    let said = d.log().matches(REPLACED).count();
    std::fs::rename(d.path("kmsg"), d.path("kmsg.1")).unwrap();
    std::fs::write(d.path("kmsg"), "").unwrap();
    wait_said(&d, REPLACED, said);
    d.kmsg_append(&["4,2,2,-;NVRM: Xid (PCI:0000:30:00): 43, pid=3, Ch 00000008"]);
    let got = wait_inputs(&d, "the XID in the new file", 3);
    assert_eq!(got[2], ("xid".to_string(), 43, Some(2)), "{}", d.log());
    // Truncated while gpu-medic was down: what the file holds at the start is new.
    d.stop(Duration::from_secs(10));
    std::fs::write(
        d.path("kmsg"),
        "4,3,3,-;NVRM: Xid (PCI:0000:40:00): 13, pid=4, name=d, Graphics Exception\n",
    )
    .unwrap();
    d.start();
    d.wait_polled();
    let got = wait_inputs(&d, "the XID written while gpu-medic was down", 4);
    assert_eq!(got.len(), 4, "{got:?}\n{}", d.log());
    assert_eq!(got[3], ("xid".to_string(), 13, Some(3)), "{}", d.log());
    d.stop(Duration::from_secs(10));
}

/// Item 14: an NVLink5 XID whose NVML event arrives before the kernel-log reader started
/// (the fake hands an event injected before the start to the first event set registered,
/// which is before NVML's first poll, after which the reader starts) waits for its kernel
/// log line and follows NVIDIA's decode sheet (ignore), instead of being judged without its
/// text (undecoded: drain).
#[test]
fn an_xid_that_needs_its_text_waits_for_a_reader_that_is_still_starting() {
    let mut d = node();
    d.env("FAKE_NVML_KMSG", d.path("kmsg"));
    std::fs::create_dir_all(d.path("inject")).unwrap();
    d.inject(
        r#"{"gpu": 0, "xid": 145, "message": "RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)"}"#,
    );
    d.start();
    let r = d.wait_record(
        "the XID 145 incident",
        Duration::from_secs(20),
        "opened",
        |r| r["observation"]["signal"]["code"] == 145,
    );
    assert_eq!(
        r["observation"]["signal"]["decode"],
        "ignore",
        "{r}\n{}",
        d.log()
    );
    assert_eq!(r["observation"]["source"], "kmsg", "{r}");
    assert_ne!(r["verdict"], "drain", "{r}");
    d.stop(Duration::from_secs(10));
}
