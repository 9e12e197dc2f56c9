//! The kernel log's records as the kernel frames them, before any driver's text is read: a
//! `/dev/kmsg` record (`prio,seq,usec,flags;message`), a syslog line (`kern.log`, `messages`,
//! `journalctl -k`) under the tag `kernel:`, or a plain dmesg line, each with the kernel's time
//! stamp where it has one; and whether the message is one of the NVIDIA drivers' lines (by how
//! it begins: `model::driver_line`). Shared by the XID reader ([`super::kmsg`]) and the SXid
//! reader ([`super::sxid`]); it imports neither.

use std::path::Path;

use crate::model::driver_line;

/// What the NVSwitch driver's lines begin with (`nvidia-nvswitch3: SXid (PCI:...`), before
/// the switch's number.
pub const NVSWITCH_PREFIX: &str = "nvidia-nvswitch";

/// A kmsg record's priority, sequence number, time stamp (microseconds after boot) and
/// message: `None` unless the line starts with a header of decimal fields
/// (`prio,seq,usec,flags[,...];`).
fn record_header(line: &str) -> Option<(u64, u64, u64, &str)> {
    let (header, msg) = line.split_once(';')?;
    let mut fields = header.split(',');
    let digits = |s: &str| !s.is_empty() && s.len() <= 20 && s.bytes().all(|b| b.is_ascii_digit());
    let (prio, seq, usec) = (fields.next()?, fields.next()?, fields.next()?);
    if !(digits(prio) && digits(seq) && digits(usec)) {
        return None;
    }
    Some((
        prio.parse().ok()?,
        seq.parse().unwrap_or(0),
        usec.parse().unwrap_or(u64::MAX),
        msg,
    ))
}

/// A syslog time stamp at the start of `line` (`Dec  3 12:00:00` or an RFC 3339 one such as
/// `2026-12-03T12:00:00.123456+00:00`); what follows it.
fn syslog_stamp(line: &str) -> Option<&str> {
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let b = line.as_bytes();
    if b.len() > 16
        && MONTHS.iter().any(|m| line.starts_with(m))
        && b[3] == b' '
        && (b[4] == b' ' || b[4].is_ascii_digit())
        && b[5].is_ascii_digit()
        && b[6] == b' '
        && b[7].is_ascii_digit()
        && b[8].is_ascii_digit()
        && b[9] == b':'
        && b[12] == b':'
        && b[15] == b' '
    {
        return line.get(16..);
    }
    if b.len() > 20
        && b[..4].iter().all(u8::is_ascii_digit)
        && b[4] == b'-'
        && b[7] == b'-'
        && b[10] == b'T'
    {
        let (_, rest) = line.split_once(' ')?;
        return Some(rest);
    }
    None
}

/// Strips a leading `[  12.345678]` (the kernel's time stamp as dmesg and syslog print it),
/// and reads it in microseconds.
fn strip_kernel_time(msg: &str) -> (Option<u64>, &str) {
    match msg.strip_prefix('[').and_then(|r| r.split_once(']')) {
        Some((stamp, rest)) => {
            let usec = stamp.trim().split_once('.').and_then(|(s, f)| {
                let secs: u64 = s.parse().ok()?;
                let frac = format!("{f:0<6}");
                let micros: u64 = frac.get(..6)?.parse().ok()?;
                secs.checked_mul(1_000_000)?.checked_add(micros)
            });
            (usec, rest.trim_start())
        }
        None => (None, msg),
    }
}

/// The message of a kernel log line the kernel itself logged, with its sequence number and
/// time stamp (microseconds after boot, when the line has one): a `/dev/kmsg` record at
/// kernel facility (priority 0 to 7: what a process writes to `/dev/kmsg` is at user facility
/// or another it names, never the kernel's, see the kernel's `devkmsg_write`), a syslog line
/// (`kern.log`, `messages`, `journalctl -k`) whose tag is `kernel:`, or a plain dmesg line;
/// after the kernel's time stamp, if any. `None` for a record of any other facility or a
/// syslog line with another tag: a driver's text there was written by someone else.
pub fn kernel_message(line: &str) -> Option<(u64, Option<u64>, &str)> {
    if let Some((prio, seq, usec, msg)) = record_header(line) {
        return (prio < 8).then_some((seq, Some(usec), msg));
    }
    if let Some(rest) = syslog_stamp(line) {
        let (_host, rest) = rest.trim_start().split_once(' ')?;
        let msg = rest.strip_prefix("kernel:")?;
        let (usec, msg) = strip_kernel_time(msg.trim_start());
        return Some((0, usec, msg));
    }
    let (usec, msg) = strip_kernel_time(line);
    Some((0, usec, msg))
}

/// Which of the NVIDIA drivers' lines a kernel message is, by how it begins: only the
/// driver's own message begins with its prefix (a message that quotes the driver's text
/// elsewhere, an audit or AppArmor record naming a file, a USB device's product string, is
/// someone else's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverLine {
    Xid,
    Sxid,
}

/// The driver line a log line carries, with its sequence number, time stamp and message:
/// `None` unless the kernel logged it ([`kernel_message`]) and its message begins as one of
/// the driver's formats do ([`driver_line::begins_driver_line`]).
pub fn driver_message(line: &str) -> Option<(u64, Option<u64>, &str, DriverLine)> {
    let (seq, usec, msg) = kernel_message(line)?;
    if !driver_line::begins_driver_line(msg) {
        return None;
    }
    let kind = if msg.starts_with(NVSWITCH_PREFIX) {
        DriverLine::Sxid
    } else {
        DriverLine::Xid
    };
    Some((seq, usec, msg, kind))
}

/// Whether `path` can be the kernel log: the kernel log device (`/dev/kmsg`, character
/// device 1:11) or a regular file (a copied log, tests). Anything else (a FIFO, a socket, a
/// directory, another character device such as `/dev/zero` or `/dev/urandom`, which never
/// end) is refused with the reason; a missing path is accepted (the reader warns and XIDs
/// come from NVML events).
pub fn check_path(path: &Path) -> Result<(), String> {
    crate::sys::limits::check_path_kind(path, crate::sys::limits::Kind::RegularOrKmsg).map_err(
        |why| {
            format!(
                "[nvml] kmsg {} {why}: give the kernel log device (/dev/kmsg) or a regular file, or \"\" to turn it off",
                path.display()
            )
        },
    )
}
