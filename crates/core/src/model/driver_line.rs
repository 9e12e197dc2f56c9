//! The NVIDIA drivers' own kernel-log lines, read by their format: a table of the formats the
//! drivers print ([`FORMATS`], each from the driver's source), and a reader that takes a
//! message (what follows the kernel's record header) and gives the driver's fields.
//!
//! Why a table and not a search: part of an XID line is written by a tenant. The driver
//! copies the process's `comm` (up to [`COMM_MAX`] bytes, any byte but NUL, chosen with
//! `prctl(PR_SET_NAME)`) into `name=`, so the name may hold commas, parentheses, `pid=`,
//! `Xid` and `GPC`. Searching the line for those words lets a tenant steer the verdict; here
//! every field is read from where its format puts it:
//!
//! - the address, code and pid come before the name, in fixed grammars;
//! - the name ends at a `, ` no more than [`COMM_MAX`] bytes after `name=` (counting an
//!   escaped byte, `\xNN` as `/dev/kmsg` writes it or `#ooo` as rsyslog does, as one). When
//!   only one such place exists, or the caller knows the process's comm and it ends at the
//!   last such place, the split is exact; otherwise the name may run into the message, and the
//!   message is only what certainly follows the name ([`Message::Tail`]): a place read from it
//!   is the driver's, the rest is not read;
//! - XID 45's cause is its own trailing ` caused by previous Xid N` (r570.123.01 and later),
//!   which no name can reach (a name is at most 15 bytes, the suffix longer and at the end);
//!   no other code has a cause.
//!
//! The sources: NVIDIA's open-gpu-kernel-modules, `src/nvidia/src/kernel/gpu/rc/kernel_rc.c`
//! (`krcReportXid`) at the tags named in [`FORMATS`], and
//! `src/common/nvswitch/kernel/inc/common_nvswitch.h` (`NVSWITCH_PRINT_SXID`) for SXids;
//! the name is `current->comm` copied when the client was allocated
//! (`kernel-open/nvidia/os-interface.c`, `os_get_current_process_name`), the pid its `tgid`.
//! docs/xid-catalog.md lists the formats; tests/fixtures/driver-lines.tsv holds lines real
//! drivers printed in each (tests/driver_lines.rs reads every one through the kernel log
//! readers).
//!
//! Pure: no I/O. What the kernel knows of a pid (its comm, whether it lives) is asked through
//! the closure the caller hands in.

/// The most bytes of a process name: the kernel's `TASK_COMM_LEN` (16) less its NUL.
pub const COMM_MAX: usize = 15;

/// The cause suffix XID 45 carries from r570.123.01 (`" caused by previous Xid %d"`).
const CAUSE_SUFFIX: &str = " caused by previous Xid ";

/// XID 45, `ROBUST_CHANNEL_PREEMPTIVE_REMOVAL` (nverror.h): the only code the driver gives a
/// cause.
pub const PREEMPTIVE_REMOVAL: u32 = 45;

/// One line format of the drivers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Format {
    /// A short name, recorded with each XID read (`xid-pid-name`, ...).
    pub id: &'static str,
    /// The driver branches that print it.
    pub branches: &'static str,
    /// The format as the driver's source writes it, with its fields named: `{addr}`, `{code}`,
    /// `{pid}`, `{comm}`, `{msg}`, `{cause}`, `{switch}`.
    pub template: &'static str,
    /// Where in NVIDIA's open-gpu-kernel-modules (tag and file).
    pub source: &'static str,
    /// A line of this format.
    pub example: &'static str,
}

/// The formats, most specific first: the reader tries them in this order and takes the first
/// that matches (a driver's message never begins with `pid=`).
pub const FORMATS: &[Format] = &[
    Format {
        id: "xid-unknown-process",
        branches: "r515 to r565",
        template: "NVRM: Xid ({addr}): {code}, pid='<unknown>', name=<unknown>, {msg}",
        source: "535.43.02, 550.40.07, 565.57.01: src/nvidia/src/kernel/gpu/rc/kernel_rc.c",
        example: "NVRM: Xid (PCI:0000:cb:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7, TPC 1, SM 0): Out Of Range Address",
    },
    Format {
        id: "xid-pid-name-cause",
        branches: "r570.123.01 and later (XID 45)",
        template: "NVRM: Xid ({addr}): {code}, pid={pid}, name={comm}, {msg}{cause}",
        source: "570.123.01, 580.65.06, 595.45.04: src/nvidia/src/kernel/gpu/rc/kernel_rc.c",
        example: "NVRM: Xid (PCI:0000:3b:00): 45, pid=4242, name=python3, Ch 00000010 caused by previous Xid 13",
    },
    Format {
        id: "xid-pid-name",
        branches: "r515 and later",
        template: "NVRM: Xid ({addr}): {code}, pid={pid}, name={comm}, {msg}",
        source: "515.43.04 to 595.45.04: src/nvidia/src/kernel/gpu/rc/kernel_rc.c",
        example: "NVRM: Xid (PCI:0000:3b:00): 13, pid=4242, name=python3, Graphics SM Warp Exception on (GPC 0, TPC 1): Misaligned Register",
    },
    Format {
        id: "xid-pid",
        branches: "before r515 for any XID with a process (captures: r450, r510); r515 and later as the driver's own comments show XID 94 and 95",
        template: "NVRM: Xid ({addr}): {code}, pid={pid}, {msg}",
        source: "595.45.04: src/nvidia/src/kernel/gpu/arch/ampere/kern_gpu_error_cont_ga100.c (comment)",
        example: "NVRM: Xid (PCI:0000:01:00): 94, pid=7062, Contained: CE User Channel (0x9). RST: No, D-RST: No",
    },
    Format {
        id: "xid-cause",
        branches: "r570.123.01 and later (XID 45, no process)",
        template: "NVRM: Xid ({addr}): {code}, {msg}{cause}",
        source: "570.123.01, 580.65.06, 595.45.04: src/nvidia/src/kernel/gpu/rc/kernel_rc.c",
        example: "NVRM: Xid (PCI:0000:3b:00): 45,  caused by previous Xid 79",
    },
    Format {
        id: "xid-bare",
        branches: "before r515 for any XID without a process (capture: r418); r570.86.15 and later (no process known)",
        template: "NVRM: Xid ({addr}): {code}, {msg}",
        source: "570.86.15, 580.65.06, 595.45.04: src/nvidia/src/kernel/gpu/rc/kernel_rc.c",
        example: "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
    },
    Format {
        id: "sxid",
        branches: "every NVSwitch driver",
        template: "nvidia-{switch}: SXid (PCI:{addr}): {code}, {msg}",
        source: "595.45.04: src/common/nvswitch/kernel/inc/common_nvswitch.h (NVSWITCH_PRINT_SXID)",
        example: "nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 46 LTSSM Fault Up",
    },
];

/// What the line says of the process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pid {
    /// `pid=<n>`.
    Printed(u32),
    /// `pid='<unknown>'` (r565 and before).
    Unknown,
    /// Left out (r570.86.15 and later when no process is known, drivers before r515; SXids).
    Absent,
}

/// The process name as far as the line tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Name {
    /// No name in the line.
    Absent,
    /// `name=<unknown>` after `pid='<unknown>'`.
    Unknown,
    /// The name as printed (escapes kept), where it ends is certain.
    Exact(String),
    /// Where the name ends is not certain (it may hold `, `): the text from `name=` to where
    /// the message certainly begins, which holds the name and perhaps the message's head.
    Unsure(String),
}

/// The driver's message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// The whole message.
    Whole(String),
    /// Only the end of it that certainly follows the name (the name may hold `, `).
    Tail(String),
}

impl Message {
    pub fn text(&self) -> &str {
        match self {
            Message::Whole(t) | Message::Tail(t) => t,
        }
    }

    pub fn is_whole(&self) -> bool {
        matches!(self, Message::Whole(_))
    }
}

/// An XID or SXid line's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fields {
    /// Which of [`FORMATS`] the line is.
    pub format: &'static Format,
    /// The device's PCI address as printed (`0000:3b:00`; `0000:c3:00.0` for a switch).
    pub pci: String,
    /// MIG: the GPU instance and compute instance the driver attributed it to.
    pub gpu_instance: Option<u32>,
    pub compute_instance: Option<u32>,
    /// The switch (`nvswitch3`) of an SXid.
    pub switch: Option<String>,
    pub code: u32,
    pub pid: Pid,
    pub name: Name,
    pub message: Message,
    /// The earlier XID the driver says this one follows from (XID 45 only).
    pub cause: Option<u32>,
}

impl Fields {
    pub fn is_sxid(&self) -> bool {
        self.switch.is_some()
    }

    /// The pid the driver printed.
    pub fn pid(&self) -> Option<u32> {
        match self.pid {
            Pid::Printed(p) => Some(p),
            _ => None,
        }
    }
}

/// One `NVRM: Xid` record as the kernel log reader hands it on: the driver's fields, read by
/// [`parse`], with where the record sits in the kernel's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelXid {
    /// Sequence number of the kmsg record (0 for plain text lines).
    pub seq: u64,
    /// When the kernel logged it, in microseconds after boot: the record's stamp (`/dev/kmsg`,
    /// or `[secs.usecs]` in a syslog or dmesg line); None when the line has none.
    pub usec: Option<u64>,
    /// PCI address as the driver prints it, e.g. `0000:3b:00`.
    pub pci: String,
    pub code: u32,
    /// The pid the driver printed first, in its own field.
    pub pid: Option<u32>,
    /// The process name the driver printed, its escapes decoded (lossy UTF-8): the process's
    /// own choice, shown and never judged by.
    pub process: Option<String>,
    /// Whether where the name ends is certain (see [`Name`]).
    pub name_exact: bool,
    /// The driver's message after the name: the whole of it, or, where the name may hold
    /// `, `, only its end that certainly follows the name (`message_whole` false).
    pub text: String,
    pub message_whole: bool,
    /// The XID the driver says caused this one (XID 45's own trailing field only).
    pub cause: Option<u32>,
    /// Which of the driver's formats the line is (`driver_line::FORMATS`).
    pub format: &'static str,
}

impl KernelXid {
    /// The XID of the driver's fields.
    pub fn of(seq: u64, usec: Option<u64>, f: Fields) -> KernelXid {
        let (process, name_exact) = match &f.name {
            Name::Exact(n) => (Some(printed_name(n)), true),
            Name::Unsure(n) => (Some(printed_name(n)), false),
            Name::Absent | Name::Unknown => (None, true),
        };
        KernelXid {
            seq,
            usec,
            pid: f.pid(),
            pci: f.pci,
            code: f.code,
            process: process.filter(|p| !p.is_empty()),
            name_exact,
            message_whole: f.message.is_whole(),
            text: f.message.text().trim().to_string(),
            cause: f.cause,
            format: f.format.id,
        }
    }
}

/// A printed name as the process set it: escapes decoded, lossy UTF-8.
fn printed_name(printed: &str) -> String {
    String::from_utf8_lossy(&decode_printed(printed)).into_owned()
}

/// Reads a driver message (the kernel record's text, after its header and time stamp) by
/// [`FORMATS`]; `None` when it is none of them. `comm_of(pid)`: the comm the kernel has now
/// for that pid, raw bytes, when the process lives (or the caller saw it), for an exact split
/// of the name; `|_| None` when nothing is known.
pub fn parse(msg: &str, comm_of: &dyn Fn(u32) -> Option<Vec<u8>>) -> Option<Fields> {
    if !begins_driver_line(msg) {
        return None;
    }
    FORMATS.iter().find_map(|f| read(f, msg, comm_of))
}

/// Whether a message begins as one of the driver's lines (an XID or an SXid), without reading
/// it: for skipping the rest of the log cheaply.
pub fn begins_driver_line(msg: &str) -> bool {
    msg.starts_with("NVRM: Xid (") || is_sxid_head(msg)
}

/// `nvidia-nvswitch<N>: SXid (`.
fn is_sxid_head(msg: &str) -> bool {
    msg.strip_prefix("nvidia-nvswitch")
        .map(|r| r.trim_start_matches(|c: char| c.is_ascii_digit()))
        .is_some_and(|r| r.starts_with(": SXid ("))
}

/// A piece of a format's template: literal text or a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Lit(&'static str),
    Addr,
    Code,
    Pid,
    Comm,
    Msg,
    Cause,
    Switch,
}

/// The pieces of a template, in order, without allocating (every line is read by up to
/// every format: a storm of them must cost no allocation per try).
#[derive(Clone)]
struct Parts(&'static str);

impl Iterator for Parts {
    type Item = Part;

    fn next(&mut self) -> Option<Part> {
        let rest = self.0;
        if rest.is_empty() {
            return None;
        }
        if let Some(field) = rest.strip_prefix('{') {
            let end = field.find('}').unwrap_or(field.len());
            self.0 = field.get(end + 1..).unwrap_or("");
            return Some(match &field[..end] {
                "addr" => Part::Addr,
                "code" => Part::Code,
                "pid" => Part::Pid,
                "comm" => Part::Comm,
                "msg" => Part::Msg,
                "cause" => Part::Cause,
                _ => Part::Switch,
            });
        }
        let end = rest.find('{').unwrap_or(rest.len());
        self.0 = &rest[end..];
        Some(Part::Lit(&rest[..end]))
    }
}

/// Reads `msg` by `format`'s template; None when it does not match.
fn read(
    format: &'static Format,
    msg: &str,
    comm_of: &dyn Fn(u32) -> Option<Vec<u8>>,
) -> Option<Fields> {
    let mut f = Fields {
        format,
        pci: String::new(),
        gpu_instance: None,
        compute_instance: None,
        switch: None,
        code: 0,
        pid: Pid::Absent,
        name: Name::Absent,
        message: Message::Whole(String::new()),
        cause: None,
    };
    if format.template.contains("pid='<unknown>'") {
        f.pid = Pid::Unknown;
        f.name = Name::Unknown;
    }
    let mut rest = msg;
    let mut parts = Parts(format.template);
    while let Some(part) = parts.next() {
        match part {
            Part::Lit(l) => rest = rest.strip_prefix(l)?,
            Part::Addr => {
                let (pci, gi, ci, r) = address(rest)?;
                (f.pci, f.gpu_instance, f.compute_instance) = (pci.to_string(), gi, ci);
                rest = r;
            }
            Part::Code => (f.code, rest) = number(rest, 10)?,
            Part::Pid => match number(rest, 10) {
                Some((n, r)) => (f.pid, rest) = (Pid::Printed(n), r),
                // A pid blanked out in a copied log (`pid=...`): no process.
                None => {
                    let end = rest.find(", ").filter(|e| *e <= 16)?;
                    (f.pid, rest) = (Pid::Unknown, &rest[end..]);
                }
            },
            Part::Switch => {
                let n = rest.find(": ")?;
                let sw = &rest[..n];
                if !sw.starts_with("nvswitch") || sw.len() > 32 {
                    return None;
                }
                (f.switch, rest) = (Some(sw.to_string()), &rest[n..]);
            }
            Part::Comm => {
                // The comm is followed by `, ` and then the message: both read here.
                if parts.next() != Some(Part::Lit(", ")) || parts.next() != Some(Part::Msg) {
                    return None;
                }
                let known = f.pid().and_then(comm_of);
                let (name, (message, whole)) = split_name(rest, known.as_deref());
                f.name = name;
                return finish_msg(f, message, whole, parts);
            }
            Part::Msg => return finish_msg(f, rest, true, parts),
            Part::Cause => return None,
        }
    }
    Some(f)
}

/// The message from `rest` (`whole`: it is the message's start), and the cause where the
/// template's `after` the message has one.
fn finish_msg(mut f: Fields, rest: &str, whole: bool, mut after: Parts) -> Option<Fields> {
    let mut text = rest;
    match (after.next(), after.next()) {
        (None, _) => {}
        (Some(Part::Cause), None) => {
            if f.code != PREEMPTIVE_REMOVAL {
                return None;
            }
            let at = text.rfind(CAUSE_SUFFIX)?;
            let (n, tail) = number(&text[at + CAUSE_SUFFIX.len()..], 10)?;
            if !tail.trim_end().is_empty() {
                return None;
            }
            f.cause = Some(n);
            text = &text[..at];
        }
        _ => return None,
    }
    let text = text.trim_end_matches(['\n', '\r']).to_string();
    f.message = if whole {
        Message::Whole(text)
    } else {
        Message::Tail(text)
    };
    Some(f)
}

/// A decimal (or hex) number of at most 10 digits at the start of `s`.
fn number(s: &str, radix: u32) -> Option<(u32, &str)> {
    let end = s.find(|c: char| !c.is_digit(radix)).unwrap_or(s.len());
    if end == 0 || end > 10 {
        return None;
    }
    Some((u32::from_str_radix(&s[..end], radix).ok()?, &s[end..]))
}

/// `[PCI:]dddd:bb:dd[.f][ GPU-I:nn[ GPU-CI:nn]]` up to the `)`.
fn address(s: &str) -> Option<(&str, Option<u32>, Option<u32>, &str)> {
    let s = s.strip_prefix("PCI:").unwrap_or(s);
    let end = s.find(|c: char| !(c.is_ascii_hexdigit() || c == ':' || c == '.'))?;
    let pci = &s[..end];
    if pci.is_empty() || pci.len() > 16 || !pci.contains(':') {
        return None;
    }
    let mut rest = &s[end..];
    let mut mig = [None, None];
    for (slot, tag) in mig.iter_mut().zip([" GPU-I:", " GPU-CI:"]) {
        if let Some(r) = rest.strip_prefix(tag) {
            let (n, r) = number(r, 10)?;
            *slot = Some(n);
            rest = r;
        }
    }
    Some((pci, mig[0], mig[1], rest))
}

/// How many bytes of the process's comm `printed` stands for: an escaped byte (`\xNN` as
/// `/dev/kmsg` and dmesg write it, `#ooo` as rsyslog does) and a U+FFFD (an invalid byte or
/// run read lossily) count one, any other character its UTF-8 length. Never more than the
/// bytes it was printed from, so the true end of a name is always within [`COMM_MAX`].
fn comm_bytes(printed: &str) -> usize {
    let b = printed.as_bytes();
    let (mut i, mut n) = (0, 0);
    while i < b.len() {
        if escape_at(b, i).is_some() {
            i += 4;
            n += 1;
            continue;
        }
        let c = printed[i..]
            .chars()
            .next()
            .unwrap_or(char::REPLACEMENT_CHARACTER);
        i += c.len_utf8();
        n += if c == char::REPLACEMENT_CHARACTER {
            1
        } else {
            c.len_utf8()
        };
    }
    n
}

/// The byte an escape at `b[i..]` stands for: `\xNN` (hex) or `#ooo` (octal, at most 0o377).
fn escape_at(b: &[u8], i: usize) -> Option<u8> {
    let digits = b.get(i + 1..i + 4)?;
    match b[i] {
        b'\\' if digits[0] == b'x' => {
            let h = std::str::from_utf8(&digits[1..]).ok()?;
            if !h.bytes().all(|c| c.is_ascii_hexdigit()) {
                return None;
            }
            u8::from_str_radix(h, 16).ok()
        }
        b'#' if digits.iter().all(|c| (b'0'..=b'7').contains(c)) => {
            u8::from_str_radix(std::str::from_utf8(digits).ok()?, 8).ok()
        }
        _ => None,
    }
}

/// The raw bytes a printed name stands for (`\xNN` and `#ooo` decoded), to compare with a
/// process's comm.
pub fn decode_printed(printed: &str) -> Vec<u8> {
    let b = printed.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match escape_at(b, i) {
            Some(v) => {
                out.push(v);
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    out
}

/// Splits what follows `name=` into the name and the message: (name, (message, whole)).
///
/// The name ends at a `, ` that stands at most [`COMM_MAX`] bytes of comm after `name=`
/// (the driver prints `name=%s, %s`): the true end is always one of these places. One place:
/// the split is exact. Several: the name may hold `, ` (or the message may, early on); the
/// message certainly begins after the last place, and the name is exact only where the
/// process's comm as the kernel has it (`known`) ends there.
fn split_name<'a>(rest: &'a str, known: Option<&[u8]>) -> (Name, (&'a str, bool)) {
    let places: Vec<usize> = rest
        .match_indices(", ")
        .map(|(i, _)| i)
        .take_while(|i| comm_bytes(&rest[..*i]) <= COMM_MAX)
        .collect();
    let Some(&last) = places.last() else {
        // No end within a comm's length: not the driver's format.
        return (Name::Unsure(rest.to_string()), ("", false));
    };
    let message = &rest[last + 2..];
    let name = &rest[..last];
    if places.len() == 1 || known.is_some_and(|k| decode_printed(name) == k) {
        (Name::Exact(name.to_string()), (message, true))
    } else {
        (Name::Unsure(name.to_string()), (message, false))
    }
}

#[cfg(test)]
mod tests;
