//! Only this boot's kernel records act, and a record that cannot stand alone as the kernel's
//! needs a second witness (docs/operations.md, "Which kernel log to read"), through the real
//! `gpu-medic run` and `gpu-medic check` on the fake libnvidia-ml, with a kernel log *file*
//! as hosts that forward through rsyslog have:
//!
//! - a syslog line in the kernel's shape (what any user's `logger -t kernel` writes) alone is
//!   recorded with the verdict it would have had, never acted on; NVML's event for the same
//!   XID is the second witness, and acts;
//! - records stamped before this boot began are skipped, and `check` says how many;
//! - a reboot simulated by writing the boot id file: the XID 79 that led to it, read again by
//!   the check after the boot, is an earlier boot's and fails nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::time::Duration;

use gpu_medic_testkit::{Daemon, FOUR_GPUS, wait_sync};
use serde_json::Value;

/// Seconds since the epoch now, and the RFC 3339 stamp of `secs` (UTC) as rsyslog writes it.
fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn rfc3339(secs: i64) -> String {
    let out = std::process::Command::new("date")
        .args([
            "-u",
            "-d",
            &format!("@{secs}"),
            "+%Y-%m-%dT%H:%M:%S.000000+00:00",
        ])
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The driver's XID 79 line as rsyslog writes a kernel message to `kern.log`.
fn syslog_79(at: i64, bus: &str) -> String {
    format!(
        "{} ip-10-0-0-1 kernel: NVRM: Xid (PCI:{bus}): 79, pid=1, name=x, GPU has fallen off the bus.",
        rfc3339(at)
    )
}

fn opened(d: &Daemon) -> Vec<Value> {
    gpu_medic_testkit::journal::events(&d.records(), "opened")
}

#[test]
fn a_syslog_line_alone_never_acts_and_nvml_is_its_second_witness() {
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    d.gpus(FOUR_GPUS);
    d.start();
    d.wait_polled();
    // What `logger -t kernel` makes rsyslog write: the kernel's shape, a user's text.
    d.kmsg_append(&[syslog_79(now(), "0000:10:00")]);
    let r = d.wait_record(
        "the unwitnessed XID 79",
        Duration::from_secs(20),
        "opened",
        |r| r["observation"]["signal"]["code"] == 79,
    );
    assert_eq!(r["verdict"], "log", "{r:#}");
    let reason = r["reason"].as_str().unwrap();
    assert!(
        reason.contains("would be `") && reason.contains("logger -t kernel"),
        "{reason}"
    );
    assert!(r["observation"]["unwitnessed"].is_string(), "{r:#}");
    // The same XID on GPU 1 from NVML's event too: it acts.
    d.inject(r#"{"gpu": 1, "xid": 79}"#);
    d.kmsg_append(&[syslog_79(now(), "0000:20:00")]);
    let r = d.wait_record(
        "the witnessed XID 79",
        Duration::from_secs(20),
        "opened",
        |r| {
            r["observation"]["signal"]["code"] == 79
                && r["observation"]["gpu"]["index"] == 1
                && r["verdict"] != "log"
        },
    );
    assert!(r["observation"].get("unwitnessed").is_none(), "{r:#}");
    d.signal(libc::SIGTERM);
}

#[test]
fn records_of_an_earlier_boot_are_skipped_and_check_says_so() {
    let mut d = Daemon::fake_gpu_node("", "expected_gpus = 4");
    d.gpus(FOUR_GPUS);
    // Two days ago: before this machine booted (or, in a container, at least not this boot's).
    let boot = {
        let up: f64 = std::fs::read_to_string("/proc/uptime")
            .unwrap()
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap();
        now() - up as i64
    };
    d.kmsg_append(&[syslog_79(boot - 2 * 86_400, "0000:10:00")]);
    let out = d
        .command()
        .args(["check", "--config"])
        .arg(d.config())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("1 driver record(s) of earlier boots skipped"),
        "{text}"
    );
    assert!(text.contains("the kernel log is a file"), "{text}");
    // The daemon skips it too, and says so in its log.
    d.env("GPU_MEDIC_LOG", "gpu_medic=info");
    d.start();
    d.wait_polled();
    wait_sync(
        "the skip logged",
        Duration::from_secs(20),
        || {
            d.log()
                .contains("records of earlier boots in the kernel log file skipped")
        },
        || d.log(),
    );
    assert!(
        !opened(&d)
            .iter()
            .any(|r| r["observation"]["signal"]["code"] == 79),
        "{:#?}",
        opened(&d)
    );
    d.signal(libc::SIGTERM);
}

#[test]
fn the_check_after_a_simulated_reboot_does_not_read_the_fault_that_led_to_it() {
    let mut d = Daemon::fake_gpu_node("", "expected_gpus = 4");
    d.gpus(FOUR_GPUS);
    let boot_id = d.path("boot_id");
    std::fs::write(&boot_id, "11111111-2222-3333-4444-555555555555\n").unwrap();
    let cfg = std::fs::read_to_string(d.config()).unwrap();
    std::fs::write(
        d.config(),
        format!(
            "{cfg}[repair]\nboot_id_path = \"{}\"\nreboot = \"off\"\n",
            boot_id.display()
        ),
    )
    .unwrap();
    let check = |d: &Daemon| {
        let out = d
            .command()
            .args(["check", "--config"])
            .arg(d.config())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // The fault, logged two minutes before the "reboot".
    d.kmsg_append(&[format!(
        "{} ip-10-0-0-1 kernel: [  100.000000] NVRM: Xid (PCI:0000:10:00): 79, GPU has fallen off the bus.",
        rfc3339(now() - 120)
    )]);
    let (code, text) = check(&d);
    assert_eq!(code, Some(0), "a syslog line fails no check alone: {text}");
    // The reboot: the boot id file is written again, now.
    std::fs::write(&boot_id, "66666666-7777-8888-9999-000000000000\n").unwrap();
    let (code, text) = check(&d);
    assert_eq!(code, Some(0), "{text}");
    assert!(text.contains("of earlier boots skipped"), "{text}");
}

/// `[nvml] kmsg = "journald"`: the kernel's own records of this boot from the systemd journal
/// (journal files written by `systemd-journal-remote`): an XID 79 there acts; the same line
/// from another transport (what `logger -t kernel` makes) or another boot does not, in `run`
/// and in `check`.
#[test]
fn the_journals_kernel_transport_is_the_kernels_own_and_only_this_boots() {
    use gpu_medic_testkit::journald::JournalDir;
    const BOOT: &str = "0123456789abcdef0123456789abcdef";
    const OTHER: &str = "fedcba9876543210fedcba9876543210";
    let mut journal = JournalDir::new();
    let mut d = Daemon::fake_gpu_node("tick_interval = \"100ms\"", "poll_interval = \"200ms\"");
    d.gpus(FOUR_GPUS);
    let boot_id = d.path("boot_id");
    std::fs::write(&boot_id, "01234567-89ab-cdef-0123-456789abcdef\n").unwrap();
    let cfg = std::fs::read_to_string(d.config()).unwrap().replace(
        &format!("kmsg = \"{}\"", d.path("kmsg").display()),
        &format!(
            "kmsg = \"journald\"\nkmsg_journal_directory = \"{}\"",
            journal.path().display()
        ),
    );
    std::fs::write(
        d.config(),
        format!(
            "{cfg}[repair]\nboot_id_path = \"{}\"\nreboot = \"off\"\n",
            boot_id.display()
        ),
    )
    .unwrap();
    let line = |bus: &str| format!("NVRM: Xid (PCI:{bus}): 79, GPU has fallen off the bus.");
    journal.append_kernel(OTHER, "kernel", &[&line("0000:10:00")]);
    journal.append_kernel(BOOT, "syslog", &[&line("0000:20:00")]);
    // check: the other boot's and the forged record fail nothing.
    let out = d
        .command()
        .args(["check", "--config"])
        .arg(d.config())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    d.start();
    d.wait_polled();
    journal.append_kernel(BOOT, "kernel", &[&line("0000:30:00")]);
    let r = d.wait_record(
        "the kernel's own XID 79",
        Duration::from_secs(30),
        "opened",
        |r| r["observation"]["signal"]["code"] == 79,
    );
    assert_eq!(r["observation"]["gpu"]["index"], 2, "{r:#}");
    assert_ne!(r["verdict"], "log", "{r:#}");
    assert!(r["observation"].get("unwitnessed").is_none(), "{r:#}");
    std::thread::sleep(Duration::from_secs(1));
    let of_79: Vec<Value> = d
        .records()
        .into_iter()
        .filter(|r| r["observation"]["signal"]["code"] == 79)
        .collect();
    assert!(
        of_79.iter().all(|r| r["observation"]["gpu"]["index"] == 2),
        "only this boot's kernel record: {of_79:#?}"
    );
    d.signal(libc::SIGTERM);
    // check now fails on it.
    let out = d
        .command()
        .args(["check", "--config"])
        .arg(d.config())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// An XID of this boot at a PCI address where no GPU is: while every expected GPU is listed it
/// is no GPU's, and `check` says so and passes; with a GPU missing it may be the one that fell
/// off, and it fails the check for the node.
#[test]
fn an_xid_where_no_gpu_is_fails_no_check_while_every_gpu_is_listed() {
    let line = format!(
        "4,9,{},-;NVRM: Xid (PCI:0000:ff:00): 79, pid=1, name=x, GPU has fallen off the bus.",
        gpu_medic_testkit::proc::uptime_usec()
    );
    let check = |d: &Daemon| {
        let out = d
            .command()
            .args(["check", "--config"])
            .arg(d.config())
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.code(), text)
    };
    let mut d = Daemon::fake_gpu_node("", "expected_gpus = 4");
    d.gpus(FOUR_GPUS);
    d.kmsg_append(&[&line]);
    let (code, text) = check(&d);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.contains("XID 79 at PCI 0000:ff:00: no GPU is at that address"),
        "{text}"
    );

    let mut d = Daemon::fake_gpu_node("", "expected_gpus = 5");
    d.gpus(FOUR_GPUS);
    d.kmsg_append(&[&line]);
    let (code, text) = check(&d);
    assert_ne!(
        code,
        Some(0),
        "a GPU is missing: the XID may be its own\n{text}"
    );
    assert!(text.contains("79"), "{text}");
}
