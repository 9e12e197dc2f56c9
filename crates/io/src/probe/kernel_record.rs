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

/// Which boot a record of a kernel log *file* belongs to, as far as its stamps tell. A
/// `/dev/kmsg` record is this boot's by construction; a file (a syslog file, a copied log)
/// spans boots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boot {
    /// Stamped (by the syslog daemon's wall clock) after this boot began.
    This,
    /// Stamped before this boot began, or with a kernel stamp later than this boot's uptime:
    /// an earlier boot's, never judged now.
    Earlier,
    /// Its stamps cannot place it (none, a kernel stamp that fits this boot and an earlier one
    /// alike, a wall stamp within [`WALL_SLACK`] of the boot).
    Unknown,
}

/// How far around the boot a wall stamp is not trusted to place a record: the wall clock can
/// be stepped at boot (NTP) and a syslog daemon stamps what it receives.
pub const WALL_SLACK: i64 = 60;

/// This boot, as the records of a file are placed against it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BootClock {
    /// Microseconds since this boot began, now (`CLOCK_BOOTTIME`).
    pub uptime_usec: u64,
    /// When this boot began, in seconds since the epoch (now's wall clock less the uptime).
    pub boot_wall: i64,
    /// Now, in seconds since the epoch.
    pub now_wall: i64,
    /// The local time zone's offset from UTC now, in seconds (a BSD syslog stamp is local).
    pub utc_offset: i64,
}

impl BootClock {
    /// The machine's clocks now. `boot_id` (`[repair] boot_id_path`): where it is a file of
    /// its own rather than the kernel's (`/proc/sys/kernel/random/boot_id`), as the demo and
    /// the tests simulate a reboot by writing it, this boot began when it was last written.
    pub fn now_for(boot_id: Option<&Path>) -> Option<BootClock> {
        let mut c = BootClock::now()?;
        if let Some(written) = boot_id.and_then(simulated_boot) {
            c.boot_wall = c.boot_wall.max(written);
        }
        Some(c)
    }

    /// The machine's clocks now.
    pub fn now() -> Option<BootClock> {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes one timespec into the one we own.
        if unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) } != 0 {
            return None;
        }
        let up = u64::try_from(ts.tv_sec).ok()?;
        let uptime_usec = up
            .saturating_mul(1_000_000)
            .saturating_add(u64::try_from(ts.tv_nsec / 1000).unwrap_or(0));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?
            .as_secs();
        let now_wall = i64::try_from(now).ok()?;
        let mut tm: libc::tm = unsafe_zeroed_tm();
        let t: libc::time_t = now_wall;
        // SAFETY: localtime_r reads one time_t and writes one tm, both ours.
        let utc_offset = if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
            0
        } else {
            tm.tm_gmtoff
        };
        Some(BootClock {
            uptime_usec,
            boot_wall: now_wall - i64::try_from(up).ok()?,
            now_wall,
            utc_offset,
        })
    }
}

/// When a boot id file that is not the kernel's was last written (seconds since the epoch):
/// `None` for the kernel's own file (on procfs, whose times say nothing of the boot).
fn simulated_boot(path: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt;
    const PROC_SUPER_MAGIC: i64 = 0x9fa0;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs is plain old data: all zero bytes is a valid value of it.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: statfs reads a NUL-terminated path that lives across the call and writes one
    // statfs struct we own.
    if unsafe { libc::statfs(c.as_ptr(), &mut fs) } != 0 || fs.f_type as i64 == PROC_SUPER_MAGIC {
        return None;
    }
    let m = std::fs::metadata(path).ok()?;
    use std::os::unix::fs::MetadataExt;
    Some(m.mtime())
}

/// Who besides root can write a kernel log file, when anyone can: a file another user owns or
/// that its group or everyone may write can hold lines nobody's kernel wrote.
pub fn other_writers(meta: &std::fs::Metadata) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    if meta.uid() != 0 {
        return Some(format!("owned by uid {}", meta.uid()));
    }
    let mode = meta.mode() & 0o7777;
    (mode & 0o022 != 0).then(|| format!("writable by its group or by anyone (mode {mode:04o})"))
}

/// Why a line read from a kernel log *file* cannot stand alone as the kernel's record (its
/// XID then needs a second witness, `model::Observation::unwitnessed`), or `None` when it can:
/// a `/dev/kmsg`-format or dmesg copy placed in this boot, in a file only root can write.
/// A syslog line cannot: the syslog daemon writes `logger -t kernel` lines from any user the
/// same way as the kernel's.
pub fn file_line_doubt(
    line: &str,
    path: &Path,
    writers: Option<&str>,
    boot: Boot,
) -> Option<String> {
    if syslog_stamp(line).is_some() {
        return Some(format!(
            "read from a syslog file ({}), where any user's `logger -t kernel` writes the same line as the kernel",
            path.display()
        ));
    }
    if let Some(w) = writers {
        return Some(format!("read from {}, a file {w}", path.display()));
    }
    (boot == Boot::Unknown).then(|| {
        format!(
            "read from {}, and its stamps cannot place it in this boot",
            path.display()
        )
    })
}

fn unsafe_zeroed_tm() -> libc::tm {
    // SAFETY: libc::tm is plain old data (integers and one pointer, which zero makes null).
    unsafe { std::mem::zeroed() }
}

/// Which boot a line of a kernel log file belongs to ([`Boot`]), by its wall stamp (a syslog
/// daemon's) when it has one, else by its kernel stamp (microseconds after some boot: one past
/// this boot's uptime is an earlier boot's; one within it cannot be told from an earlier
/// boot's that ran as long). `born`: when the file was made (seconds since the epoch, where the
/// file system keeps it): a file made after this boot began holds only this boot's records.
pub fn place(line: &str, clock: &BootClock, born: Option<i64>) -> Boot {
    let placed = place_by_stamps(line, clock);
    match born {
        Some(b) if b >= clock.boot_wall && placed != Boot::Earlier => Boot::This,
        _ => placed,
    }
}

/// When a file was made, in seconds since the epoch, where its file system keeps it.
pub fn born(meta: &std::fs::Metadata) -> Option<i64> {
    let t = meta.created().ok()?;
    let secs = t.duration_since(std::time::UNIX_EPOCH).ok()?.as_secs();
    i64::try_from(secs).ok()
}

fn place_by_stamps(line: &str, clock: &BootClock) -> Boot {
    if let Some(wall) = wall_stamp(line, clock) {
        return if wall < clock.boot_wall - WALL_SLACK {
            Boot::Earlier
        } else if wall > clock.boot_wall + WALL_SLACK {
            Boot::This
        } else {
            Boot::Unknown
        };
    }
    match kernel_message(line).and_then(|(_, usec, _)| usec) {
        Some(u)
            if u > clock
                .uptime_usec
                .saturating_add(WALL_SLACK.unsigned_abs() * 1_000_000) =>
        {
            Boot::Earlier
        }
        _ => Boot::Unknown,
    }
}

/// The wall time a syslog line was stamped at, in seconds since the epoch: RFC 3339
/// (`2026-12-03T12:00:00.123456+00:00`, rsyslog's high-precision format) or BSD
/// (`Dec  3 12:00:00`, local time, no year: the year that puts it not after now).
fn wall_stamp(line: &str, clock: &BootClock) -> Option<i64> {
    syslog_stamp(line)?;
    let b = line.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let s = line.get(r)?.trim_start();
        if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    if b.get(10) == Some(&b'T') {
        let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        let (h, mi, s) = (num(11..13)?, num(14..16)?, num(17..19)?);
        let zone = line.get(19..)?.split(' ').next()?;
        let zone = zone.trim_start_matches(|c: char| c == '.' || c.is_ascii_digit());
        let offset = match zone {
            "Z" | "z" => 0,
            z if z.len() == 6 && (z.starts_with('+') || z.starts_with('-')) => {
                let sign = if z.starts_with('-') { -1 } else { 1 };
                sign * (num_at(z, 1..3)? * 3600 + num_at(z, 4..6)? * 60)
            }
            _ => return None,
        };
        return Some(epoch(y, mo, d, h, mi, s)? - offset);
    }
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let mo = MONTHS.iter().position(|m| line.starts_with(m))? as i64 + 1;
    let (d, h, mi, s) = (num(4..6)?, num(7..9)?, num(10..12)?, num(13..15)?);
    let year_now = civil_year(clock.now_wall + clock.utc_offset);
    for y in [year_now, year_now - 1] {
        let t = epoch(y, mo, d, h, mi, s)? - clock.utc_offset;
        if t <= clock.now_wall + 86_400 {
            return Some(t);
        }
    }
    None
}

fn num_at(s: &str, r: std::ops::Range<usize>) -> Option<i64> {
    s.get(r)?.parse().ok()
}

/// Seconds since the epoch of a UTC civil date and time (Howard Hinnant's days-from-civil).
fn epoch(y: i64, mo: i64, d: i64, h: i64, mi: i64, s: i64) -> Option<i64> {
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) || h > 23 || mi > 59 || s > 60 {
        return None;
    }
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + mi * 60 + s)
}

/// The civil year of a time in seconds since the epoch.
fn civil_year(t: i64) -> i64 {
    let days = t.div_euclid(86_400) + 719_468;
    let era = days.div_euclid(146_097);
    let doe = days - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let y = yoe + era * 400;
    if mp >= 10 { y + 1 } else { y }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A boot at 2026-12-07 00:00:00 UTC, 10 hours ago, in UTC.
    fn clock() -> BootClock {
        let boot = epoch(2026, 12, 7, 0, 0, 0).unwrap();
        BootClock {
            uptime_usec: 36_000 * 1_000_000,
            boot_wall: boot,
            now_wall: boot + 36_000,
            utc_offset: 0,
        }
    }

    #[test]
    fn civil_dates_round_trip() {
        assert_eq!(epoch(1970, 1, 1, 0, 0, 0), Some(0));
        assert_eq!(epoch(2000, 3, 1, 0, 0, 0), Some(951_868_800));
        assert_eq!(civil_year(951_868_800), 2000);
        assert_eq!(civil_year(epoch(2026, 12, 31, 23, 59, 59).unwrap()), 2026);
        assert_eq!(civil_year(epoch(2027, 1, 1, 0, 0, 0).unwrap()), 2027);
        assert_eq!(epoch(2026, 13, 1, 0, 0, 0), None);
    }

    #[test]
    fn file_records_are_placed_by_their_stamps() {
        let c = clock();
        let x = "NVRM: Xid (PCI:0000:10:00): 79, GPU has fallen off the bus.";
        for (line, want) in [
            (
                format!("2026-12-07T09:00:00.123456+00:00 host kernel: {x}"),
                Boot::This,
            ),
            (
                format!("2026-12-07T10:00:00+01:00 host kernel: {x}"),
                Boot::This,
            ),
            (
                format!("2026-12-06T23:00:00Z host kernel: {x}"),
                Boot::Earlier,
            ),
            (
                format!("2026-12-07T00:00:30Z host kernel: {x}"),
                Boot::Unknown,
            ),
            (
                format!("Dec  7 09:00:00 host kernel: [32400.000001] {x}"),
                Boot::This,
            ),
            (
                format!("Dec  6 23:00:00 host kernel: [ 5.000001] {x}"),
                Boot::Earlier,
            ),
            (format!("Dec 31 23:00:00 host kernel: {x}"), Boot::Earlier),
            (
                format!("4,1,{},-;{x}", 40_000u64 * 1_000_000),
                Boot::Earlier,
            ),
            (
                format!("4,1,{},-;{x}", 30_000u64 * 1_000_000),
                Boot::Unknown,
            ),
            (format!("[99999.000000] {x}"), Boot::Earlier),
            (x.to_string(), Boot::Unknown),
        ] {
            assert_eq!(place(&line, &c, None), want, "{line}");
            // A file made after the boot began holds this boot's records only.
            let born = Some(c.boot_wall + 5);
            let want = if want == Boot::Earlier {
                Boot::Earlier
            } else {
                Boot::This
            };
            assert_eq!(place(&line, &c, born), want, "{line}");
        }
        // A BSD stamp in local time: 09:00 in UTC+2 is 07:00 UTC.
        let mut east = c;
        east.utc_offset = 7200;
        assert_eq!(
            wall_stamp(&format!("Dec  7 09:00:00 host kernel: {x}"), &east),
            Some(epoch(2026, 12, 7, 7, 0, 0).unwrap())
        );
    }

    #[test]
    fn the_clock_of_this_machine_reads() {
        let c = BootClock::now().unwrap();
        assert!(c.boot_wall <= c.now_wall);
        assert!(c.uptime_usec > 0);
    }
}
