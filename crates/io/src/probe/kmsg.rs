//! XIDs from the kernel log (`/dev/kmsg`): the driver prints
//! `NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.`
//! for every XID, including those raised while no NVML event set was registered (at boot,
//! while gpu-medic restarted). Reading it means such XIDs are not lost, and incidents carry
//! the driver's own text. Each XID carries its position (boot id + sequence number; the byte
//! offset for plain lines of a regular file): the supervisor journals it, then saves the
//! position in `state.json`, so a restart re-reads whatever was not journaled yet and drops
//! what was (at least once, never twice). XIDs already reported by the event watcher are
//! skipped, and remembered in `kmsg.cursor` so that a restart skips them too.
//!
//! The reader reads whatever the log holds before handing anything over, and looks again
//! between slices of a storm: fatal records (by the running policy, [`crate::probe::Urgency`])
//! are handed over first, each marked as journaled ahead of the stream's cursor when records
//! before it are still to come, so a fatal XID written with 50,000 others is decided first
//! and a crash still loses or doubles none.
//!
//! Only the driver's own records are read ([`kernel_message`], [`driver_message`]): a
//! `/dev/kmsg` record at kernel facility, a syslog line under the tag `kernel:`, or a dmesg
//! line, whose message begins with the driver's prefix. What a process writes to `/dev/kmsg`
//! is at user facility, and the driver's text quoted inside another kernel message (an audit
//! record naming a file, a USB product string) does not begin it: neither is an XID.
//!
//! It is also where an XID's verdict that depends on more than its code is decoded
//! ([`decode_xid`]): the NVLink5 XIDs 144-150 by the error status in their text (NVIDIA's
//! decode sheet, `docs/xid-nvlink5-decode.csv`), XID 159 by whether the UVM driver is in use.
//! NVML's XID event carries only the code, so the event watcher holds an NVLink5 XID for up to
//! [`super::nvml::poll::TEXT_WAIT`] until this reader brings its line.

use std::io::{BufReader, Seek};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;

use super::kernel_record::{Boot, BootClock, DriverLine, driver_message};
pub use super::kernel_record::{check_path, kernel_message};
use crate::model::cursor::{Resume, StreamId};
pub use crate::model::driver_line::KernelXid;
use crate::model::{Observation, Signal, XidDecode, driver_line};
use crate::policy::xid_catalog::{self, attributable};
use crate::probe::nvml::poll::{SharedState, lock};

/// The UVM driver's module reference count: every CUDA process holds `/dev/nvidia-uvm` open,
/// so a count above zero means UVM is in use (CHECK_UVM of XID 159).
pub const UVM_REFCNT: &str = "/sys/module/nvidia_uvm/refcnt";

/// Whether an XID's verdict needs its kernel log text (the NVLink5 XIDs).
pub fn needs_text(code: u32) -> bool {
    xid_catalog::NVLINK5.contains(&code)
}

/// Whether the event watcher holds an XID for its kernel log line: its verdict needs the
/// text ([`needs_text`]), or it is charged to the program the line names
/// (`probe::attribution`, docs/attribution.md).
pub fn held_for_text(code: u32) -> bool {
    needs_text(code) || attributable(code)
}

/// The decode of an XID whose catalog action depends on more than its code, with an
/// explanation for the incident; `(None, None)` for every other XID. `text` is the driver's
/// text after the code (absent when the XID came from NVML without a kernel log line).
pub fn decode_xid(
    code: u32,
    text: Option<&str>,
    uvm_refcnt: &Path,
) -> (Option<XidDecode>, Option<String>) {
    if xid_catalog::NVLINK5.contains(&code) {
        let d = xid_catalog::decode_nvlink5(code, text);
        return (Some(d.class), Some(d.explanation));
    }
    if code == xid_catalog::CHECK_UVM_XID {
        let (class, why) =
            match crate::sys::limits::read_pseudo(uvm_refcnt, 4096, "nvidia_uvm refcnt") {
                Ok(t) => match t.trim().parse::<u64>() {
                    Ok(0) => (
                        XidDecode::Ignore,
                        "UVM not in use (nvidia_uvm refcnt 0)".to_string(),
                    ),
                    Ok(n) => (
                        XidDecode::ResetGpu,
                        format!("UVM in use (nvidia_uvm refcnt {n})"),
                    ),
                    Err(_) => (
                        XidDecode::ResetGpu,
                        format!(
                            "UVM use unknown ({}: {:?}); assumed in use",
                            uvm_refcnt.display(),
                            t.trim()
                        ),
                    ),
                },
                Err(e) if e.is_not_found() => (
                    XidDecode::Ignore,
                    "UVM not in use (nvidia_uvm module not loaded)".to_string(),
                ),
                Err(e) => (
                    XidDecode::ResetGpu,
                    format!(
                        "UVM use unknown ({}: {e}); assumed in use",
                        uvm_refcnt.display()
                    ),
                ),
            };
        return (Some(class), Some(format!("CHECK_UVM: {why}")));
    }
    (None, None)
}

/// The XID as an observation: decoded from its text where its verdict depends on it
/// ([`decode_xid`]), `detail` plus why it was decoded so, the process as its pid.
pub fn observation(x: &KernelXid, detail: String) -> Observation {
    let (decode, why) = decode_xid(x.code, Some(&x.text), Path::new(UVM_REFCNT));
    let detail = match why {
        Some(why) => format!("{detail}; {why}"),
        None => detail,
    };
    let obs = Observation::new(Signal::Xid {
        code: x.code,
        decode,
    })
    .with_detail(detail);
    match x.pid {
        Some(pid) => obs.with_pids(vec![pid]),
        None => obs,
    }
}

/// Reads one kmsg record (`prio,seq,usec,flags;message`), syslog line or plain log line by
/// the driver's formats: `None` unless it is the driver's own XID line ([`driver_message`]).
/// Nothing is known of the process: where the name holds `, `, the message is only its
/// certain end ([`parse_line_with`] takes the process's comm).
pub fn parse_line(line: &str) -> Option<KernelXid> {
    parse_line_with(line, &|_| None)
}

/// [`parse_line`] with `comm_of(pid)`: the comm the kernel has for a pid (raw bytes) where
/// the process lives, for an exact split of its name.
pub fn parse_line_with(line: &str, comm_of: &dyn Fn(u32) -> Option<Vec<u8>>) -> Option<KernelXid> {
    let (seq, usec, message, DriverLine::Xid) = driver_message(line)? else {
        return None;
    };
    let f = driver_line::parse(message, comm_of)?;
    (!f.is_sxid()).then(|| KernelXid::of(seq, usec, f))
}

/// Whether the driver's `0000:3b:00` names the same device as NVML's `00000000:3B:00.0`.
pub fn same_pci(kernel: &str, nvml: &str) -> bool {
    fn parts(s: &str) -> Option<(u32, u32, u32)> {
        let s = s.split('.').next()?;
        let mut it = s.split(':').map(|p| u32::from_str_radix(p.trim(), 16));
        let (a, b, c) = (it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?);
        Some((a, b, c))
    }
    match (parts(kernel), parts(nvml)) {
        (Some(k), Some(n)) => k == n,
        _ => false,
    }
}

/// The kmsg reader thread.
pub struct KmsgReader {
    pub path: PathBuf,
    /// The reader's own file in `state_dir` (`StateDir::kmsg_skipped`): the records it
    /// dropped as duplicates of NVML events.
    pub cursor_file: PathBuf,
    /// How far the journal reaches (handed in by the supervisor).
    pub committed: Resume,
    pub shared: SharedState,
    pub tx: mpsc::Sender<Observation>,
    pub stop: Arc<AtomicBool>,
    /// Which records of a burst are handed over first.
    pub urgency: crate::probe::Urgency,
    /// Names the program behind an application-class XID (docs/attribution.md).
    pub attributor: std::cell::RefCell<crate::probe::attribution::Attributor>,
    /// `[repair] boot_id_path`: where a simulated boot's id is written (a file's records are
    /// placed against the boot it tells, [`super::kernel_record::BootClock::now_for`]).
    pub boot_id_path: Option<PathBuf>,
    /// With `path` [`JOURNALD`]: read the journal files in this directory instead of the
    /// system journal (`[nvml] kmsg_journal_directory`).
    pub journal_directory: Option<PathBuf>,
}

/// `[nvml] kmsg = "journald"`: the kernel's records read from the systemd journal, only those
/// of the kernel transport (`_TRANSPORT=kernel`, which journald sets for what it read from
/// `/dev/kmsg` at kernel facility and no process can write) and of this boot (`_BOOT_ID`).
pub const JOURNALD: &str = "journald";

/// The journal's kernel records of this boot, for `journalctl` (`boot`: the kernel's boot id,
/// with or without dashes).
pub fn journal_spec(boot: &str, directory: Option<PathBuf>) -> crate::sys::journalctl::Spec {
    let mut matches = vec!["_TRANSPORT=kernel".to_string()];
    let boot: String = boot.chars().filter(|c| *c != '-').collect();
    if !boot.is_empty() {
        matches.push(format!("_BOOT_ID={boot}"));
    }
    crate::sys::journalctl::Spec {
        journalctl: crate::sys::journalctl::default_journalctl().to_path_buf(),
        unit: String::new(),
        matches,
        directory,
        from_start: true,
    }
}

/// A kernel record of the journal as the `/dev/kmsg` record it was read from
/// (`prio,seq,usec,-;message`), so one reader judges both; `None` for an entry of another
/// transport or boot (the match excludes them; this holds whatever `journalctl` returns).
fn journal_record(e: &crate::sys::journalctl::Entry, boot: &str) -> Option<String> {
    let boot: String = boot.chars().filter(|c| *c != '-').collect();
    if e.transport.as_deref() != Some("kernel")
        || (!boot.is_empty() && e.boot_id.as_deref() != Some(boot.as_str()))
    {
        return None;
    }
    let prio = u64::from(e.facility.unwrap_or(0)) * 8 + u64::from(e.priority.unwrap_or(6));
    let usec = e.monotonic_us.unwrap_or(0);
    // The message is one record: a newline in it would start another line of ours.
    let message = e.message.replace(['\n', '\r'], " ");
    Some(format!("{prio},0,{usec},-;{message}"))
}

/// At most this many dropped duplicates are remembered across a restart.
const MAX_SKIPPED: usize = 256;

/// A line's position in its stream, for the cursor. In a regular file it is the line's end
/// offset, whatever the line says (a sequence number written in a file is text, not the
/// kernel's count). From the kernel log device it is the record's sequence number, which the
/// kernel raises by one per record: one that does not move past the last one read
/// (`last_seq`), or that is past what a position may be (`model::MAX_COUNTER`, 2^62: it
/// could never be passed, and a saved state holding it is refused), is not a position, and the record
/// is journaled without one rather than hiding every later record.
fn position(seq: u64, file: bool, end: u64, last_seq: &mut u64) -> Option<u64> {
    if file {
        return Some(end);
    }
    if seq == 0 {
        return None;
    }
    if seq > crate::model::MAX_COUNTER || seq <= *last_seq {
        tracing::warn!(
            probe = "kmsg",
            seq,
            last = *last_seq,
            "kernel log record with a sequence number that does not advance; journaled without a position"
        );
        return None;
    }
    *last_seq = seq;
    Some(seq)
}

struct Cursors {
    committed: Resume,
    /// Records dropped as duplicates of NVML events, oldest first, and the same as a set:
    /// each record is looked up by its own position, in constant time.
    skipped: std::collections::VecDeque<(StreamId, u64)>,
    skipped_set: std::collections::HashSet<(StreamId, u64)>,
    skip_file: PathBuf,
    /// Skips not yet saved, and when they were last saved: a storm of duplicates costs one
    /// write of the cursor file per [`SKIP_SAVE_EVERY`], not one per record.
    unsaved: bool,
    saved_at: std::time::Instant,
    /// The last kernel sequence number read (see [`position`]).
    last_seq: u64,
}

impl Drop for Cursors {
    fn drop(&mut self) {
        self.save();
    }
}

/// How often dropped duplicates are saved while a storm lasts (and whenever the log is idle).
const SKIP_SAVE_EVERY: Duration = Duration::from_millis(250);

impl Cursors {
    fn load(cursor_file: &Path, committed: Resume) -> Cursors {
        let mut c = Cursors {
            committed,
            skipped: std::collections::VecDeque::new(),
            skipped_set: std::collections::HashSet::new(),
            skip_file: cursor_file.to_path_buf(),
            unsaved: false,
            saved_at: std::time::Instant::now(),
            last_seq: 0,
        };
        if let Ok(text) = crate::sys::limits::read_text(cursor_file, 64 * 1024, "kmsg cursor") {
            for line in text.lines() {
                if let Some((stream, pos)) = line.rsplit_once(' ')
                    && let Ok(pos) = pos.parse()
                    && c.skipped.len() < MAX_SKIPPED
                {
                    c.remember((StreamId::from(stream), pos));
                }
            }
        }
        c
    }

    fn seen(&self, stream: &StreamId, pos: u64) -> bool {
        self.committed.seen(stream, pos)
            || (!self.skipped_set.is_empty() && self.skipped_set.contains(&(stream.clone(), pos)))
    }

    fn remember(&mut self, at: (StreamId, u64)) {
        if !self.skipped_set.insert(at.clone()) {
            return;
        }
        if self.skipped.len() >= MAX_SKIPPED
            && let Some(old) = self.skipped.pop_front()
        {
            self.skipped_set.remove(&old);
        }
        self.skipped.push_back(at);
    }

    fn skip(&mut self, stream: StreamId, pos: u64) {
        self.remember((stream, pos));
        self.unsaved = true;
        if self.saved_at.elapsed() >= SKIP_SAVE_EVERY {
            self.save();
        }
    }

    /// Writes the dropped duplicates out if some are not saved yet.
    fn save(&mut self) {
        if !self.unsaved {
            return;
        }
        self.unsaved = false;
        self.saved_at = std::time::Instant::now();
        let body: String = self
            .skipped
            .iter()
            .map(|(s, p)| format!("{s} {p}\n"))
            .collect();
        // Atomic, not durable: on /dev/kmsg a power loss starts a new boot whose positions
        // these never match; a lost update on a file only lets an XID NVML reported be
        // reported once more.
        if crate::sys::fs::write_atomic(
            &self.skip_file,
            body.as_bytes(),
            crate::sys::fs::Durability::Atomic,
        )
        .is_err()
        {
            tracing::warn!(probe = "kmsg", path = %self.skip_file.display(), "cannot save the kmsg cursor file");
        }
    }
}

/// At most this many kernel log records (XID and SXid lines; other lines are dropped as they
/// are read) wait to be handed over, and at most this many bytes of their text: the memory a
/// storm can hold. Beyond them the reader reads on only as records are handed over.
const BACKLOG_MAX: usize = 65_536;
const BACKLOG_MAX_BYTES: usize = 16 * 1024 * 1024;

/// At most this many records are handed over between two looks at the log, so a fatal record
/// that comes while a storm is handed over waits behind at most these.
const SLICE: usize = 256;

/// At most this many records are handed over before records ahead of them in the log, while
/// a backlog lasts (each is then journaled ahead of its stream's cursor; the supervisor
/// remembers at most [`crate::model::cursor::MAX_AHEAD`] such records at once). Beyond them,
/// fatal records keep their place in the log.
const URGENT_MAX: usize = 64;

/// One XID or SXid line, positioned and judged for urgency; parsed whole when it is handed
/// over (as it is read, a line is only glanced at, [`glance`]).
struct Record {
    line: String,
    pos: Option<u64>,
    /// Handed over before records ahead of it in the log: journaled ahead of the cursor.
    ahead: bool,
    /// A file's record: why it cannot stand alone as the kernel's
    /// ([`super::kernel_record::file_line_doubt`]).
    doubt: Option<String>,
    /// The journal's cursor of a record read from the journal (`Cursor::token`).
    token: Option<String>,
}

/// What a record carries beside its line: why it cannot stand alone, its journal cursor.
#[derive(Default)]
struct Extra {
    doubt: Option<String>,
    token: Option<String>,
}

/// What the reader needs of a line as it reads it: its sequence number and, for an XID or
/// SXid line, the signal it carries (for its urgency). `None` for every other line, and for
/// exactly the lines [`parse_line`] and [`super::sxid::parse_line`] refuse.
fn glance(line: &str) -> Option<(u64, Signal)> {
    let (seq, _, message, kind) = driver_message(line)?;
    if kind == DriverLine::Sxid {
        let sx = super::sxid::parse_line(line)?;
        return Some((seq, sx.observation().signal));
    }
    let f = driver_line::parse(message, &|_| None)?;
    if f.is_sxid() {
        return None;
    }
    // Only the XIDs whose verdict depends on their text are decoded now.
    let decode = if needs_text(f.code) || f.code == xid_catalog::CHECK_UVM_XID {
        decode_xid(f.code, Some(f.message.text()), Path::new(UVM_REFCNT)).0
    } else {
        None
    };
    Some((
        seq,
        Signal::Xid {
            code: f.code,
            decode,
        },
    ))
}

/// The records read and not yet handed over: the fatal ones (by the running policy) apart,
/// handed over first. Every record read waits here until the supervisor has it; the cursor
/// moves only once the supervisor has journaled it.
#[derive(Default)]
struct Backlog {
    urgent: std::collections::VecDeque<Record>,
    /// In log order.
    rest: std::collections::VecDeque<Record>,
    /// An observation made from the head of `rest` that the supervisor's channel had no room
    /// for (its XID is claimed already): handed over before anything else of `rest`.
    stalled: Option<Observation>,
    /// Records of `rest` (and `stalled`) with a position: records an urgent one would pass.
    positioned: usize,
    /// Records handed over ahead since the backlog was last empty.
    passed: usize,
    bytes: usize,
}

impl Backlog {
    fn full(&self) -> bool {
        self.urgent.len() + self.rest.len() >= BACKLOG_MAX || self.bytes >= BACKLOG_MAX_BYTES
    }

    fn is_empty(&self) -> bool {
        self.urgent.is_empty() && self.rest.is_empty() && self.stalled.is_none()
    }

    fn push(&mut self, mut r: Record, urgent: bool) {
        self.bytes = self.bytes.saturating_add(r.line.len());
        if urgent && self.passed < URGENT_MAX {
            r.ahead = self.positioned > 0 && r.pos.is_some();
            self.passed += usize::from(r.ahead);
            self.urgent.push_back(r);
        } else {
            self.positioned += usize::from(r.pos.is_some());
            self.rest.push_back(r);
        }
    }

    fn pop_urgent(&mut self) -> Option<Record> {
        let r = self.urgent.pop_front()?;
        self.bytes = self.bytes.saturating_sub(r.line.len());
        Some(r)
    }

    fn pop_rest(&mut self) -> Option<Record> {
        let r = self.rest.pop_front()?;
        self.bytes = self.bytes.saturating_sub(r.line.len());
        if r.pos.is_some() {
            // Still waiting (as `stalled`) until it is sent.
            self.positioned = self.positioned.saturating_sub(1);
        }
        Some(r)
    }

    fn stall(&mut self, o: Observation) {
        self.positioned += usize::from(o.cursor.is_some());
        self.stalled = Some(o);
    }

    fn unstall(&mut self) -> Option<Observation> {
        let o = self.stalled.take()?;
        self.positioned = self
            .positioned
            .saturating_sub(usize::from(o.cursor.is_some()));
        Some(o)
    }
}

/// What a hand-over left.
enum Pump {
    /// Nothing left to hand over.
    Empty,
    /// More to hand over (a slice is done, or the supervisor's channel is full).
    More,
    /// The supervisor is gone.
    Gone,
}

/// A buffered reader that counts the bytes taken from it: each line's end offset without
/// asking the kernel (an `lseek` per line was a large part of reading a storm).
struct Counted<R> {
    inner: BufReader<R>,
    pos: u64,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.pos = self.pos.saturating_add(n as u64);
        Ok(n)
    }
}

impl<R: std::io::Read> std::io::BufRead for Counted<R> {
    fn fill_buf(&mut self) -> std::io::Result<&[u8]> {
        self.inner.fill_buf()
    }

    fn consume(&mut self, n: usize) {
        self.pos = self.pos.saturating_add(n as u64);
        self.inner.consume(n);
    }
}

/// Where the reader's records are: the stream of their positions, and whether it is a
/// regular file (positions are end offsets) or the kernel log device (sequence numbers).
struct Stream {
    id: StreamId,
    file: bool,
    /// A file: who besides root may write it ([`super::kernel_record::other_writers`]).
    writers: Option<String>,
    /// A file: when it was made, where its file system keeps it.
    born: Option<i64>,
}

/// Records of earlier boots a file held, skipped (never judged now).
#[derive(Default)]
struct Skipped {
    earlier: u64,
    told: u64,
}

impl KmsgReader {
    /// Reads until `stop`. A regular file (tests, a copied log) is followed like `tail -f`.
    /// Every line is read whole up to [`crate::sys::limits::MAX_KMSG_LINE`] (longer ones are
    /// dropped with a warning), invalid UTF-8 lossily. Whatever the log holds is read before
    /// anything is handed over (up to [`BACKLOG_MAX`] records), and the log is looked at again
    /// after every [`SLICE`] records handed over: fatal records go first.
    pub fn run(self) {
        use std::os::unix::fs::MetadataExt;
        // Held XIDs wait for this reader from the start (the event watcher was told it is
        // configured); however it ends, they are let go.
        struct Active(SharedState);
        impl Drop for Active {
            fn drop(&mut self) {
                let mut s = lock(&self.0);
                s.kmsg_active = false;
                s.kmsg_started = None;
            }
        }
        lock(&self.shared).kmsg_active = true;
        let _active = Active(self.shared.clone());
        if self.path == Path::new(JOURNALD) {
            lock(&self.shared).kmsg_started = Some(std::time::Instant::now());
            let mut cursors = Cursors::load(&self.cursor_file, self.committed.clone());
            self.follow_journal(&mut cursors);
            return;
        }
        if let Err(why) = check_path(&self.path) {
            tracing::error!(probe = "kmsg", path = %self.path.display(), "{why}; XIDs come from NVML events only");
            return;
        }
        let file = match crate::sys::limits::open_checked(
            &self.path,
            crate::sys::limits::Kind::RegularOrKmsg,
            u64::MAX,
            "kernel log",
        ) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!(probe = "kmsg", path = %self.path.display(), "cannot read the kernel log ({e}); XIDs come from NVML events only");
                return;
            }
        };
        // Reading: a held XID waits TEXT_WAIT from now at the earliest.
        lock(&self.shared).kmsg_started = Some(std::time::Instant::now());
        let meta = file.metadata().ok();
        let regular = meta.as_ref().is_some_and(|m| m.is_file());
        let stream = match meta.as_ref().filter(|_| regular) {
            Some(m) => Stream {
                id: StreamId::kmsg_file(
                    m.dev(),
                    m.ino(),
                    file_generation(&self.committed, m.dev(), m.ino(), m.len()),
                ),
                file: true,
                writers: super::kernel_record::other_writers(m),
                born: super::kernel_record::born(m),
            },
            None => Stream {
                id: StreamId::kmsg(self.committed.boot()),
                file: false,
                writers: None,
                born: None,
            },
        };
        if regular {
            tracing::warn!(
                probe = "kmsg",
                path = %self.path.display(),
                "the kernel log is a file: its records of earlier boots are skipped, and an XID from a syslog line, from a file anyone but root may write, or one its stamps cannot place in this boot acts only with a second witness (NVML's event for it); /dev/kmsg is the kernel's own (docs/operations.md, Which kernel log to read)"
            );
        }
        let mut cursors = Cursors::load(&self.cursor_file, self.committed.clone());
        if regular {
            self.follow_file(file, stream, &mut cursors);
        } else {
            self.follow_device(file, &stream, &mut cursors);
        }
    }

    /// `[nvml] kmsg = "journald"`: the journal's kernel records of this boot, followed through
    /// `journalctl` from after the cursor journaled last (this boot's history on a first
    /// start), each read as the `/dev/kmsg` record it was. Positions are the entries'
    /// wall-clock stamps, their journal cursors the tokens a restart resumes after.
    fn follow_journal(&self, cursors: &mut Cursors) {
        use crate::sys::journalctl::Reader;
        let boot = self.committed.boot().to_string();
        let spec = journal_spec(&boot, self.journal_directory.clone());
        let stream = Stream {
            id: StreamId::journald("kernel"),
            file: false,
            writers: None,
            born: None,
        };
        let Ok(rt) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            tracing::error!(
                probe = "kmsg",
                "no runtime to follow the journal; XIDs come from NVML events only"
            );
            return;
        };
        tracing::info!(probe = "kmsg", boot = %boot, "reading the kernel's own records from the systemd journal (_TRANSPORT=kernel, this boot)");
        let mut after = self.committed.token(&stream.id).map(str::to_string);
        let mut reader: Option<Reader> = None;
        let mut backlog = Backlog::default();
        let mut warned = false;
        while !self.stop.load(Ordering::Relaxed) {
            if reader.is_none() {
                let _in = rt.enter();
                match Reader::spawn(&spec, after.as_deref()) {
                    Ok(r) => reader = Some(r),
                    Err(e) => {
                        if !std::mem::replace(&mut warned, true) {
                            tracing::error!(
                                probe = "kmsg",
                                "{e}; the kernel's records in the journal are not read (trying again)"
                            );
                        }
                        rt.block_on(async { tokio::time::sleep(Duration::from_secs(5)).await });
                        continue;
                    }
                }
            }
            rt.block_on(async { tokio::time::sleep(Duration::from_millis(50)).await });
            let entries = match reader.as_mut().map(Reader::drain) {
                Some(Ok(e)) => e,
                _ => {
                    reader = None;
                    continue;
                }
            };
            for e in entries {
                after = Some(e.cursor.clone());
                let Some(line) = journal_record(&e, &boot) else {
                    continue;
                };
                let extra = Extra {
                    doubt: None,
                    token: Some(e.cursor),
                };
                self.take(line, &stream, e.realtime_us, cursors, &mut backlog, extra);
            }
            loop {
                match self.pump(&mut backlog, &stream, cursors) {
                    Pump::Gone => return,
                    Pump::More => {}
                    Pump::Empty => break,
                }
            }
            cursors.save();
        }
    }

    /// `/dev/kmsg`: one record per read, blocking at the end of the buffer.
    fn follow_device(&self, file: std::fs::File, stream: &Stream, cursors: &mut Cursors) {
        let cap = crate::sys::limits::MAX_KMSG_LINE;
        // /dev/kmsg blocks at the end of the buffer: read from a thread we never join
        // and forward lines through a channel, so `stop` is still noticed.
        let (ltx, lrx) = std::sync::mpsc::sync_channel::<Option<String>>(1024);
        let path = self.path.clone();
        let _ = std::thread::Builder::new()
            .name("kmsg-read".into())
            .spawn(move || {
                let mut r = BufReader::with_capacity(2 * cap, file);
                let mut buf = Vec::new();
                loop {
                    match crate::sys::lines::read_capped_line(&mut r, &mut buf, cap, u64::MAX) {
                        Ok(None) => {
                            let _ = ltx.send(None);
                            return;
                        }
                        Ok(Some(crate::sys::lines::CappedLine::Text { text, .. })) => {
                            if ltx.send(Some(text)).is_err() {
                                return;
                            }
                        }
                        Ok(Some(crate::sys::lines::CappedLine::TooLong { len })) => {
                            tracing::warn!(probe = "kmsg", len, "kernel log record longer than {cap} bytes dropped");
                        }
                        // EPIPE: records were overwritten before we read them; go on.
                        Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(e) => {
                            tracing::error!(probe = "kmsg", path = %path.display(), "reading the kernel log failed: {e}; XIDs come from NVML events only");
                            let _ = ltx.send(None);
                            return;
                        }
                    }
                }
            });
        let mut backlog = Backlog::default();
        let mut ended = false;
        while !self.stop.load(Ordering::Relaxed) {
            // What the reading thread has read by now; waiting only with nothing to hand over.
            while !ended && !backlog.full() {
                let next = if backlog.is_empty() {
                    lrx.recv_timeout(Duration::from_millis(500))
                } else {
                    lrx.try_recv().map_err(|e| match e {
                        std::sync::mpsc::TryRecvError::Empty => {
                            std::sync::mpsc::RecvTimeoutError::Timeout
                        }
                        std::sync::mpsc::TryRecvError::Disconnected => {
                            std::sync::mpsc::RecvTimeoutError::Disconnected
                        }
                    })
                };
                match next {
                    Ok(Some(line)) => {
                        self.take(line, stream, 0, cursors, &mut backlog, Extra::default())
                    }
                    Ok(None) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                        ended = true;
                    }
                    Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                        if backlog.is_empty() {
                            cursors.save();
                        }
                        break;
                    }
                }
            }
            match self.pump(&mut backlog, stream, cursors) {
                Pump::Gone => return,
                Pump::More => {}
                Pump::Empty if ended => {
                    tracing::warn!(probe = "kmsg", path = %self.path.display(), "the kernel log ended; XIDs come from NVML events only");
                    return;
                }
                Pump::Empty => {}
            }
        }
    }

    /// A regular file (tests, a saved log): followed by offset like a log file, woken by its
    /// writes (inotify; on a timer where that cannot be had).
    ///
    /// A rotated log loses nothing: a file truncated in place (copytruncate) or recreated on
    /// the same inode (shorter than what was read of it) and a file replaced by another one
    /// (a new inode at the path, once the old one is read to its end) are read from their
    /// start, as a new stream (a new generation: positions in it never repeat the old ones).
    fn follow_file(&self, file: std::fs::File, mut stream: Stream, cursors: &mut Cursors) {
        let cap = crate::sys::limits::MAX_KMSG_LINE;
        let mut writes = crate::sys::watch::Writes::watch(&self.path);
        let mut r = Counted {
            inner: BufReader::with_capacity(64 * 1024, file),
            pos: 0,
        };
        let mut buf = Vec::new();
        let mut backlog = Backlog::default();
        // Offset of the end of the last complete line; a partial last line is read
        // again from there once its writer finishes it.
        let mut offset: u64 = 0;
        let mut skipped = Skipped::default();
        while !self.stop.load(Ordering::Relaxed) {
            // Whether the end of what is written was reached (and how long to wait there).
            let mut idle = None;
            // The clocks the lines read now are placed against.
            let clock = BootClock::now_for(self.boot_id_path.as_deref());
            while idle.is_none() && !backlog.full() {
                match crate::sys::lines::read_capped_line(&mut r, &mut buf, cap, u64::MAX) {
                    Ok(None) => idle = Some(Duration::from_millis(100)),
                    Ok(Some(crate::sys::lines::CappedLine::Text {
                        text,
                        complete: true,
                    })) => {
                        offset = r.pos;
                        let at = (offset, clock);
                        self.take_file_line(text, &stream, at, cursors, &mut backlog, &mut skipped);
                    }
                    Ok(Some(crate::sys::lines::CappedLine::Text { .. })) => {
                        // Not finished yet: read it again whole.
                        if r.inner.seek(std::io::SeekFrom::Start(offset)).is_err() {
                            return;
                        }
                        r.pos = offset;
                        idle = Some(Duration::from_millis(20));
                    }
                    Ok(Some(crate::sys::lines::CappedLine::TooLong { len })) => {
                        offset = r.pos;
                        tracing::warn!(
                            probe = "kmsg",
                            len,
                            "kernel log line longer than {cap} bytes dropped"
                        );
                    }
                    Err(e) => {
                        tracing::warn!(probe = "kmsg", path = %self.path.display(), "reading the kernel log failed: {e}");
                        idle = Some(Duration::from_millis(500));
                    }
                }
            }
            if skipped.earlier > skipped.told {
                tracing::info!(
                    probe = "kmsg",
                    path = %self.path.display(),
                    skipped = skipped.earlier,
                    "driver records of earlier boots in the kernel log file skipped: they are never judged now"
                );
                skipped.told = skipped.earlier;
            }
            match self.pump(&mut backlog, &stream, cursors) {
                Pump::Gone => return,
                Pump::More => {}
                Pump::Empty => {
                    if let Some(wait) = idle {
                        cursors.save();
                        if let Some(rotated) = self.rotation(r.inner.get_ref(), offset) {
                            if self
                                .reopen(rotated, &mut r, &mut stream, &mut writes, offset)
                                .is_none()
                            {
                                return;
                            }
                            offset = 0;
                            continue;
                        }
                        match &writes {
                            Some(w) => w.wait(wait),
                            None => std::thread::sleep(wait.min(Duration::from_millis(25))),
                        }
                    }
                }
            }
        }
    }

    /// One complete line of a followed file: placed against this boot (`at`: its end offset
    /// and the clocks), skipped and counted when an earlier boot's, else taken with why it
    /// cannot stand alone as the kernel's record, if it cannot.
    fn take_file_line(
        &self,
        text: String,
        stream: &Stream,
        at: (u64, Option<BootClock>),
        cursors: &mut Cursors,
        backlog: &mut Backlog,
        skipped: &mut Skipped,
    ) {
        let (end, clock) = at;
        let boot = clock.map_or(Boot::Unknown, |c| {
            super::kernel_record::place(&text, &c, stream.born)
        });
        if boot == Boot::Earlier {
            skipped.earlier += u64::from(glance(&text).is_some());
            return;
        }
        let doubt = super::kernel_record::file_line_doubt(
            &text,
            &self.path,
            stream.writers.as_deref(),
            boot,
        );
        let extra = Extra { doubt, token: None };
        self.take(text, stream, end, cursors, backlog, extra);
    }

    /// Reads a rotated file anew from its start, as a new stream (a new generation); `None`
    /// when it cannot be read any more.
    fn reopen(
        &self,
        rotated: Rotation,
        r: &mut Counted<std::fs::File>,
        stream: &mut Stream,
        writes: &mut Option<crate::sys::watch::Writes>,
        offset: u64,
    ) -> Option<()> {
        let file = match rotated {
            Rotation::Truncated { dev, ino } => {
                tracing::warn!(probe = "kmsg", path = %self.path.display(), offset, "the kernel log file was truncated (copytruncate, or recreated on its inode); read again from its start");
                stream.id = StreamId::kmsg_file(dev, ino, next_generation(&stream.id, dev, ino));
                r.inner.seek(std::io::SeekFrom::Start(0)).ok()?;
                None
            }
            Rotation::Replaced(f) => {
                use std::os::unix::fs::MetadataExt;
                let m = f.metadata().ok()?;
                tracing::warn!(probe = "kmsg", path = %self.path.display(), "the kernel log file was replaced (rotated); reading the new one from its start");
                stream.id = StreamId::kmsg_file(
                    m.dev(),
                    m.ino(),
                    next_generation(&stream.id, m.dev(), m.ino()),
                );
                stream.writers = super::kernel_record::other_writers(&m);
                stream.born = super::kernel_record::born(&m);
                *writes = crate::sys::watch::Writes::watch(&self.path);
                Some(f)
            }
        };
        if let Some(f) = file {
            r.inner = BufReader::with_capacity(64 * 1024, f);
        }
        r.pos = 0;
        Some(())
    }

    /// Whether the followed file was rotated, read to `offset`: truncated (shorter than
    /// that) or replaced at the path by another file (opened here). A path that is gone or not
    /// a regular file now is no rotation yet: the old file is read on.
    fn rotation(&self, open: &std::fs::File, offset: u64) -> Option<Rotation> {
        use std::os::unix::fs::MetadataExt;
        let now = open.metadata().ok()?;
        if now.len() < offset {
            return Some(Rotation::Truncated {
                dev: now.dev(),
                ino: now.ino(),
            });
        }
        let at_path = std::fs::metadata(&self.path).ok()?;
        if !at_path.is_file() || (at_path.dev(), at_path.ino()) == (now.dev(), now.ino()) {
            return None;
        }
        crate::sys::limits::open_checked(
            &self.path,
            crate::sys::limits::Kind::Regular,
            u64::MAX,
            "kernel log",
        )
        .ok()
        .map(Rotation::Replaced)
    }

    /// Takes one line into the backlog: an XID or SXid line, positioned (in log order) and
    /// judged for urgency; a line journaled before gpu-medic restarted, or any other line,
    /// is dropped.
    fn take(
        &self,
        line: String,
        stream: &Stream,
        end: u64,
        cursors: &mut Cursors,
        backlog: &mut Backlog,
        extra: Extra,
    ) {
        let Some((seq, signal)) = glance(&line) else {
            return;
        };
        let pos = position(seq, stream.file, end, &mut cursors.last_seq);
        if let Some(p) = pos
            && cursors.seen(&stream.id, p)
        {
            return; // journaled before gpu-medic restarted
        }
        let record = Record {
            line,
            pos,
            ahead: false,
            doubt: extra.doubt,
            token: extra.token,
        };
        backlog.push(record, self.urgency.is_urgent(&signal));
    }

    /// Hands over every urgent record (waiting for room in the supervisor's channel), then up
    /// to [`SLICE`] others in log order (without waiting: what finds the channel full stays
    /// in the backlog, so the log is read on meanwhile).
    fn pump(&self, backlog: &mut Backlog, stream: &Stream, cursors: &mut Cursors) -> Pump {
        use tokio::sync::mpsc::error::TrySendError;
        while let Some(r) = backlog.pop_urgent() {
            if let Some(obs) = self.observe(r, stream, cursors)
                && self.tx.blocking_send(obs).is_err()
            {
                return Pump::Gone;
            }
        }
        for _ in 0..SLICE {
            let next = match backlog.unstall() {
                Some(o) => Some(o),
                None => match backlog.pop_rest() {
                    Some(r) => self.observe(r, stream, cursors),
                    None => break,
                },
            };
            let Some(obs) = next else { continue };
            match self.tx.try_send(obs) {
                Ok(()) => {}
                Err(TrySendError::Full(obs)) => {
                    // The supervisor is behind: the log is read on after a breath.
                    backlog.stall(obs);
                    std::thread::sleep(Duration::from_millis(1));
                    return Pump::More;
                }
                Err(TrySendError::Closed(_)) => return Pump::Gone,
            }
        }
        if backlog.is_empty() {
            backlog.passed = 0;
            Pump::Empty
        } else {
            Pump::More
        }
    }

    /// The observation of one record, for the supervisor (which moves the cursor once it is
    /// journaled); `None` for an XID the event watcher reported already (remembered, so a
    /// restart does not report it either) or one on a device NVML does not list.
    fn observe(&self, r: Record, stream: &Stream, cursors: &mut Cursors) -> Option<Observation> {
        let cursor = r.pos.map(|pos| crate::model::Cursor {
            stream: stream.id.clone(),
            pos,
            token: r.token.clone(),
            ahead: r.ahead,
        });
        if let Some(sx) = super::sxid::parse_line(&r.line) {
            let mut obs = sx.observation();
            obs.cursor = cursor;
            obs.unwitnessed = r.doubt;
            return Some(obs);
        }
        // The name is split at the comm the kernel has for the pid, when that process was
        // already running when the record was written.
        let usec = driver_message(&r.line).and_then(|(_, u, _, _)| u);
        let x = parse_line_with(&r.line, &|pid| {
            self.attributor.borrow_mut().comm_before(pid, usec)
        })?;
        let index = {
            let s = lock(&self.shared);
            s.gpus
                .values()
                .find(|g| same_pci(&x.pci, &g.pci_bus_id))
                .map(|g| g.index)
        };
        let Some(index) = index else {
            tracing::warn!(probe = "kmsg", pci = %x.pci, xid = x.code, "XID for a device NVML does not list");
            return None;
        };
        let unwitnessed = {
            let mut s = lock(&self.shared);
            // The event watcher holds this XID for its text: it is ours to report, decoded.
            let held = s.take_awaiting(index, x.code);
            let reported = match &r.doubt {
                None => !s.claim_xid(index, x.code, "kmsg"),
                // A doubtful record claims nothing: NVML's event for the same XID, coming
                // later, is reported on its own and acts.
                Some(_) => s.recent_xids.reported_by(index, x.code, "nvml"),
            };
            if reported && !held {
                drop(s);
                if let Some(pos) = r.pos {
                    cursors.skip(stream.id.clone(), pos);
                }
                return None;
            }
            // NVML saw it too (it holds it for this text): a second witness.
            r.doubt.filter(|_| !held)
        };
        let detail = match &x.process {
            Some(p) => format!("{} (process {p})", x.text),
            None => x.text.clone(),
        };
        // What the poller knows of the GPU's MPS clients and of the processes it saw.
        let (clients, seen) = {
            let s = lock(&self.shared);
            let clients = attributable(x.code)
                .then(|| s.clients.get(&index).cloned())
                .flatten();
            (clients, x.pid.and_then(|p| s.seen.get(p)))
        };
        let ctx = self
            .attributor
            .borrow_mut()
            .context(&x, clients.as_ref(), seen.as_ref());
        let obs = observation(&x, detail).with_xid(ctx);
        let mut obs = lock(&self.shared).annotate(obs, index);
        obs.source = "kmsg".into();
        obs.cursor = cursor;
        obs.unwitnessed = unwitnessed;
        Some(obs)
    }
}

/// How a followed kernel log file was rotated.
enum Rotation {
    /// Shorter than what was read of it: truncated in place or recreated on its inode.
    Truncated { dev: u64, ino: u64 },
    /// Another file is at the path now, opened.
    Replaced(std::fs::File),
}

/// Milliseconds since the epoch: a new generation of a kernel log file.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A generation for a file rotated while it was followed: new, and past the one followed.
fn next_generation(current: &StreamId, dev: u64, ino: u64) -> u64 {
    let before = current.kmsg_file_generation(dev, ino).unwrap_or(0);
    now_ms().max(before.saturating_add(1))
}

/// The generation of a kernel log file when the reader starts: the one journaled last for
/// this file when the file still reaches that far, a new one when it is shorter now (it was
/// truncated or recreated while gpu-medic was down: what it holds is new), 0 for a file never
/// journaled.
fn file_generation(committed: &Resume, dev: u64, ino: u64, len: u64) -> u64 {
    let last = committed
        .streams()
        .filter_map(|(k, c)| Some((k.kmsg_file_generation(dev, ino)?, c)))
        .max_by_key(|(_, c)| c.at)
        .map(|(generation, c)| (generation, c.pos));
    match last {
        Some((generation, pos)) if pos <= len => generation,
        Some((generation, _)) => now_ms().max(generation.saturating_add(1)),
        None => 0,
    }
}

/// The XIDs and SXids the kernel log holds of this boot, for one-shot checks (`check`, the
/// launch gate, the check after a reboot), and what was skipped.
#[derive(Debug, Default)]
pub struct SinceBoot {
    /// Each XID with why it cannot stand alone as the kernel's record (a file's line:
    /// [`super::kernel_record::file_line_doubt`]), or `None`.
    pub xids: Vec<(KernelXid, Option<String>)>,
    /// The SXids likewise, the newest [`MAX_SXIDS_SINCE_BOOT`] kept.
    pub sxids: std::collections::VecDeque<(super::sxid::KernelSxid, Option<String>)>,
    /// Driver records of earlier boots a file held: never judged now.
    pub earlier: u64,
}

/// At most this many SXids since boot are kept for a one-shot check (the newest).
pub const MAX_SXIDS_SINCE_BOOT: usize = 1024;

/// Every XID the kernel log still holds of this boot (as far as the ring buffer reaches), for
/// one-shot checks. `/dev/kmsg` is read without blocking: it stops at the end of the buffer,
/// and holds this boot's records only. A regular file's records are placed against this boot
/// (`boot_id`: `[repair] boot_id_path`): an earlier boot's are skipped and counted.
pub fn read_since_boot(path: &Path, boot_id: Option<&Path>) -> std::io::Result<SinceBoot> {
    use std::os::unix::io::AsRawFd;
    let file = crate::sys::limits::open_checked(
        path,
        crate::sys::limits::Kind::RegularOrKmsg,
        u64::MAX,
        "kernel log",
    )
    .map_err(|e| match e {
        crate::sys::limits::ReadError::Io { source, .. } => source,
        other => std::io::Error::new(std::io::ErrorKind::InvalidInput, other.to_string()),
    })?;
    // SAFETY: F_GETFL/F_SETFL on the descriptor just opened; no memory is passed.
    unsafe {
        let fd = file.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
    let meta = file.metadata()?;
    let regular = meta.is_file();
    let (writers, born) = (
        super::kernel_record::other_writers(&meta),
        super::kernel_record::born(&meta),
    );
    let clock = BootClock::now_for(boot_id);
    let mut r = BufReader::new(file);
    let mut out = SinceBoot::default();
    let mut buf = Vec::new();
    let cap = crate::sys::limits::MAX_KMSG_LINE;
    let mut read: u64 = 0;
    while read < crate::sys::limits::MAX_KMSG_SCAN {
        match crate::sys::lines::read_capped_line(&mut r, &mut buf, cap, 2 * cap as u64) {
            Ok(None) => break,
            Ok(Some(crate::sys::lines::CappedLine::Text { text, .. })) => {
                read += text.len() as u64 + 1;
                let Some(x) = parse_line(&text) else { continue };
                if !regular {
                    out.xids.push((x, None));
                    continue;
                }
                let boot = clock.map_or(Boot::Unknown, |c| {
                    super::kernel_record::place(&text, &c, born)
                });
                if boot == Boot::Earlier {
                    out.earlier += 1;
                    continue;
                }
                let doubt =
                    super::kernel_record::file_line_doubt(&text, path, writers.as_deref(), boot);
                out.xids.push((x, doubt));
            }
            Ok(Some(crate::sys::lines::CappedLine::TooLong { len })) => read += len as u64,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // EPIPE: records were overwritten while we read; the next read goes on.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// [`read_since_boot`] for `[nvml] kmsg = "journald"`: the journal's kernel records of this
/// boot (`boot`: its id), read once through `journalctl` (at most
/// [`crate::sys::limits::MAX_KMSG_SCAN`] bytes of its output). Only the kernel writes them:
/// none is doubted.
pub fn read_journal_since_boot(
    boot: &str,
    directory: Option<PathBuf>,
) -> std::io::Result<SinceBoot> {
    use std::io::{BufRead, Read};
    let spec = journal_spec(boot, directory);
    let mut args: Vec<String> = vec!["--output=json".into(), "--no-pager".into()];
    args.extend(spec.matches.iter().cloned());
    if let Some(d) = &spec.directory {
        args.push("--directory".into());
        args.push(d.display().to_string());
    }
    let mut child = std::process::Command::new(&spec.journalctl)
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .env("SYSTEMD_COLORS", "0")
        .spawn()?;
    let mut out = SinceBoot::default();
    if let Some(stdout) = child.stdout.take() {
        let r = BufReader::new(stdout.take(crate::sys::limits::MAX_KMSG_SCAN));
        for line in r.split(b'\n') {
            let Ok(line) = line else { break };
            let Some(entry) = crate::sys::journalctl::parse_entry(&line) else {
                continue;
            };
            let Some(record) = journal_record(&entry, boot) else {
                continue;
            };
            if let Some(x) = parse_line(&record) {
                out.xids.push((x, None));
            } else if let Some(sx) = super::sxid::parse_line(&record) {
                if out.sxids.len() >= MAX_SXIDS_SINCE_BOOT {
                    out.sxids.pop_front();
                }
                out.sxids.push_back((sx, None));
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    Ok(out)
}

/// Where the cursor lives.
pub fn cursor_path(state_dir: &Path) -> PathBuf {
    crate::config::StateDir::new(state_dir).kmsg_skipped()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel sequence number past 2^62 is no position (a saved state holding it would be
    /// refused at the next start): the record is journaled without one, and the positions
    /// after it still count.
    #[test]
    fn a_sequence_past_what_a_position_may_be_is_no_position() {
        let mut last = 0;
        assert_eq!(position(5, false, 0, &mut last), Some(5));
        for seq in [crate::model::MAX_COUNTER + 1, u64::MAX] {
            assert_eq!(position(seq, false, 0, &mut last), None, "{seq}");
        }
        assert_eq!(last, 5, "not taken as the last position");
        assert_eq!(position(6, false, 0, &mut last), Some(6));
        assert_eq!(
            position(crate::model::MAX_COUNTER, false, 0, &mut last),
            Some(crate::model::MAX_COUNTER)
        );
    }

    #[test]
    fn parses_kmsg_records_and_plain_lines() {
        let x = parse_line("4,1234,5678901,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.\n").unwrap();
        assert_eq!(x.seq, 1234);
        assert_eq!(x.pci, "0000:3b:00");
        assert_eq!(x.code, 79);
        assert_eq!(x.pid, Some(1234));
        assert_eq!(x.process.as_deref(), Some("python3"));
        assert_eq!(x.text, "GPU has fallen off the bus.");
        let y = parse_line("[  12.3] NVRM: Xid (PCI:0000:3b:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception: ESR 0x404600=0x80000002").unwrap();
        assert_eq!(
            (y.seq, y.code, y.pid, y.process.clone()),
            (0, 13, None, None)
        );
        assert!(y.text.starts_with("Graphics Exception"));
        let z = parse_line("NVRM: Xid (PCI:0000:10:00): 48, An uncorrectable double bit error")
            .unwrap();
        assert_eq!((z.code, z.pid), (48, None));
    }

    #[test]
    fn ignores_other_and_garbled_lines() {
        for l in [
            "",
            "6,1,2,-;usb 1-1: new device",
            "NVRM: Xid (PCI:0000:3b:00): not-a-number, text",
            "NVRM: Xid (PCI:0000:3b:00",
            "NVRM: loading NVIDIA UNIX x86_64 Kernel Module",
        ] {
            assert_eq!(parse_line(l), None, "{l}");
        }
    }

    /// Issue 4/5 item 1: only the driver's own records are XIDs. A record at user facility
    /// (what a process's write to `/dev/kmsg` becomes), the driver's text quoted inside
    /// another kernel message (an audit or AppArmor denial naming a file, a USB product
    /// string), and a syslog line under another tag are not.
    #[test]
    fn only_the_drivers_own_records_are_xids() {
        for l in [
            "12,900,5,-;NVRM: Xid (PCI:0000:1b:00): 79, pid=1, name=x, GPU has fallen off the bus.",
            "14,901,5,-;NVRM: Xid (PCI:0000:1b:00): 79, GPU has fallen off the bus.",
            "8,902,5,-;NVRM: Xid (PCI:0000:1b:00): 48, An uncorrectable double bit error",
            "191,903,5,-;NVRM: Xid (PCI:0000:1b:00): 79, GPU has fallen off the bus.",
            "5,904,5,-;audit: type=1400 audit(1700000000.123:45): apparmor=\"DENIED\" operation=\"open\" profile=\"p\" name=\"/tmp/NVRM: Xid (PCI:0000:1b:00): 79, GPU has fallen off the bus.\" pid=1",
            "6,905,5,-;usb 1-1: Product: NVRM: Xid (PCI:0000:1b:00): 79, x",
            "6,906,5,-;audit: NVRM: Xid (PCI:0000:1b:00): 79, x",
            "4,907,5,-; NVRM: Xid (PCI:0000:1b:00): 79, x",
            "Dec  3 12:00:00 host myapp[123]: NVRM: Xid (PCI:0000:1b:00): 79, GPU has fallen off the bus.",
            "Dec  3 12:00:00 host root: kernel: NVRM: Xid (PCI:0000:1b:00): 79, x",
            "2026-12-03T12:00:00.123456+00:00 host logger: NVRM: Xid (PCI:0000:1b:00): 79, x",
            "Dec  3 12:00:00 host kernel: [ 1.2] audit: name=\"NVRM: Xid (PCI:0000:1b:00): 79, x\"",
            "x NVRM: Xid (PCI:0000:1b:00): 79, x",
        ] {
            assert_eq!(parse_line(l), None, "{l}");
            assert_eq!(glance(l), None, "{l}");
        }
        for l in [
            "12,900,5,-;nvidia-nvswitch0: SXid (PCI:0000:15:00.0): 20034, Fatal, Link 46 LTSSM Fault Up",
            "6,901,5,-;usb 1-1: Product: nvidia-nvswitch0: SXid (PCI:0000:15:00.0): 20034, Fatal, x",
            "Dec  3 12:00:00 host app: nvidia-nvswitch0: SXid (PCI:0000:15:00.0): 20034, Fatal, x",
            "x nvidia-nvswitch0: SXid (PCI:0000:15:00.0): 20034, Fatal, x",
        ] {
            assert_eq!(super::super::sxid::parse_line(l), None, "{l}");
            assert_eq!(glance(l), None, "{l}");
        }
    }

    /// The driver's lines as real logs show them: `/dev/kmsg` records at kernel facility,
    /// kern.log and `journalctl -k` lines, dmesg lines, the older address without `PCI:`, and
    /// a text that has parentheses and colons of its own.
    #[test]
    fn real_driver_lines_in_every_log_format_are_read() {
        for (l, code, pid, text) in [
            (
                "3,1,2,-;NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
                79,
                Some(1234),
                "GPU has fallen off the bus.",
            ),
            (
                "Dec  3 12:00:00 ip-10-0-0-1 kernel: [12345.678901] NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
                79,
                Some(1234),
                "GPU has fallen off the bus.",
            ),
            (
                "Dec 13 12:00:00 host kernel: NVRM: Xid (PCI:0000:1b:00): 48, An uncorrectable double bit error",
                48,
                None,
                "An uncorrectable double bit error",
            ),
            (
                "2026-12-03T12:00:00.123456+00:00 host kernel: NVRM: Xid (PCI:0000:1b:00): 94, pid=2453, name=app, Contained ECC error.",
                94,
                Some(2453),
                "Contained ECC error.",
            ),
            (
                "[Thu Dec  3 12:00:00 2026] NVRM: Xid (PCI:0000:1b:00): 31, pid=7, name=app, Ch 00000008, intr 10000000. MMU Fault",
                31,
                Some(7),
                "Ch 00000008, intr 10000000. MMU Fault",
            ),
            (
                "NVRM: Xid (0000:1b:00): 79, pid=..., GPU has fallen off the bus.",
                79,
                None,
                "GPU has fallen off the bus.",
            ),
            (
                "[  431.100101] NVRM: Xid (0000:1b:00): 13, 0003 00000000 0000a097 00000f04 00000000 00000000",
                13,
                None,
                "0003 00000000 0000a097 00000f04 00000000 00000000",
            ),
            (
                "4,77,5,-;NVRM: Xid (PCI:0000:1b:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
                13,
                None,
                "Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address",
            ),
            (
                "4,78,5,-;NVRM: Xid (PCI:0000:1b:00): 13, pid='<unknown>', name=<unknown>, Graphics Exception: ESR 0x50da30=0x102000e 0x50da34=0x20 0x50da28=0x0 0x50da2c=0x0",
                13,
                None,
                "Graphics Exception: ESR 0x50da30=0x102000e 0x50da34=0x20 0x50da28=0x0 0x50da2c=0x0",
            ),
        ] {
            let x = parse_line(l).unwrap_or_else(|| panic!("{l}"));
            assert_eq!((x.code, x.pid, x.text.as_str()), (code, pid, text), "{l}");
            assert_eq!(x.pci, "0000:1b:00", "{l}");
            assert!(glance(l).is_some(), "{l}");
        }
        for l in [
            "4,1,2,-;nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 46 LTSSM Fault Up",
            "Dec  3 12:00:00 host kernel: [ 8123.456789] nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 46 LTSSM Fault Up",
            "[ 8123.456789] nvidia-nvswitch3: SXid (PCI:0000:c3:00.0): 20034, Fatal, Link 46 LTSSM Fault Up",
        ] {
            let x = super::super::sxid::parse_line(l).unwrap_or_else(|| panic!("{l}"));
            assert_eq!(
                (x.code, x.switch.as_deref()),
                (20034, Some("nvidia-nvswitch3")),
                "{l}"
            );
        }
    }

    #[test]
    fn a_log_file_is_read_to_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("kmsg");
        std::fs::write(
            &p,
            "6,1,2,-;usb 1-1: new device\n4,7,9,-;NVRM: Xid (PCI:0000:10:00): 79, pid=1, name=x, GPU has fallen off the bus.\n",
        )
        .unwrap();
        let x: Vec<KernelXid> = read_since_boot(&p, None)
            .unwrap()
            .xids
            .into_iter()
            .map(|(x, _)| x)
            .collect();
        assert_eq!(x.len(), 1);
        assert_eq!((x[0].seq, x[0].code), (7, 79));
        assert!(read_since_boot(&dir.path().join("missing"), None).is_err());
    }

    #[test]
    fn nvlink5_lines_are_parsed_and_decoded() {
        let x = parse_line("4,88,5,-;NVRM: Xid (PCI:0018:01:00): 145, RLW_RXPIPE Nonfatal XC0 i0 Link 13 (0x0409a0c2 0x00000008 0x00000001 0x00000000 0x00100000 0x00000004)").unwrap();
        assert_eq!((x.code, x.pid, x.pci.as_str()), (145, None, "0018:01:00"));
        let (d, why) = decode_xid(x.code, Some(&x.text), Path::new("/nonexistent"));
        assert_eq!(d, Some(XidDecode::Ignore), "{why:?}");
        let x = parse_line("NVRM: Xid (PCI:0000:10:00): 149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x00000000 0x00000000 0x00000000 0x00000000 0x00000000)").unwrap();
        let (d, _) = decode_xid(x.code, Some(&x.text), Path::new("/nonexistent"));
        assert_eq!(d, Some(XidDecode::ResetGpu));
        assert_eq!(
            decode_xid(149, None, Path::new("/nonexistent")).0,
            Some(XidDecode::Undecoded)
        );
        assert_eq!(
            decode_xid(79, Some("GPU has fallen off the bus."), Path::new("/x")),
            (None, None)
        );
    }

    #[test]
    fn xid_159_follows_whether_uvm_is_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let refcnt = dir.path().join("refcnt");
        assert_eq!(
            decode_xid(159, None, &refcnt).0,
            Some(XidDecode::Ignore),
            "module not loaded"
        );
        std::fs::write(&refcnt, "0\n").unwrap();
        assert_eq!(decode_xid(159, None, &refcnt).0, Some(XidDecode::Ignore));
        std::fs::write(&refcnt, "3\n").unwrap();
        let (d, why) = decode_xid(159, None, &refcnt);
        assert_eq!(d, Some(XidDecode::ResetGpu));
        assert!(why.unwrap().contains("refcnt 3"));
        std::fs::write(&refcnt, "garbage").unwrap();
        assert_eq!(
            decode_xid(159, None, &refcnt).0,
            Some(XidDecode::ResetGpu),
            "unknown: assumed in use"
        );
    }

    /// Reads `log` to its end with the default policy's urgency and GPU 0 at bus 1b; returns
    /// what was handed over, in order.
    fn read_burst(log: &Path, state: &Path, committed: Resume) -> Vec<Observation> {
        let shared = SharedState::default();
        lock(&shared).gpus.insert(
            0,
            crate::model::GpuId {
                index: 0,
                pci_bus_id: "00000000:1B:00.0".into(),
                ..Default::default()
            },
        );
        let policy = crate::config::load_policy(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("../../policies/default.toml"),
        )
        .unwrap();
        let (tx, mut rx) = mpsc::channel(1 << 17);
        let stop = Arc::new(AtomicBool::new(false));
        let reader = KmsgReader {
            path: log.to_path_buf(),
            cursor_file: state.join("kmsg.cursor"),
            committed,
            shared,
            tx,
            stop: stop.clone(),
            urgency: crate::probe::Urgency::of(&policy),
            attributor: std::cell::RefCell::new(crate::probe::attribution::Attributor::new(
                Path::new("/proc"),
                None,
            )),
            boot_id_path: None,
            journal_directory: None,
        };
        let t = std::thread::spawn(move || reader.run());
        let mut out = Vec::new();
        let mut quiet = 0;
        while quiet < 10 {
            match rx.try_recv() {
                Ok(o) => {
                    out.push(o);
                    quiet = 0;
                }
                Err(_) => {
                    quiet += 1;
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        stop.store(true, Ordering::Relaxed);
        t.join().unwrap();
        out
    }

    /// Issue 26, items 0 and 5: fatal XIDs written with a storm are handed over first, marked
    /// as journaled ahead; every record is handed over once, and a supervisor that journals
    /// them in that order has every one of them seen after a restart (none read again).
    #[test]
    fn fatal_records_of_a_burst_go_first_and_every_record_once() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("kmsg");
        let mut body = String::new();
        for i in 0..3000 {
            body.push_str(&format!(
                "NVRM: Xid (PCI:0000:1b:00): {}, pid={i}, name=p, storm\n",
                1000 + i
            ));
            if i == 1500 {
                body.push_str(
                    "NVRM: Xid (PCI:0000:1b:00): 79, pid=1, name=y, GPU has fallen off the bus.\n",
                );
            }
        }
        body.push_str("NVRM: Xid (PCI:0000:1b:00): 48, An uncorrectable double bit error\n");
        std::fs::write(&log, &body).unwrap();
        let got = read_burst(&log, dir.path(), Resume::new(Default::default()));
        let codes: Vec<u32> = got
            .iter()
            .map(|o| match o.signal {
                Signal::Xid { code, .. } => code,
                _ => 0,
            })
            .collect();
        assert_eq!(codes.len(), 3002);
        assert_eq!(&codes[..2], &[79, 48], "the fatal ones first");
        let mut sorted = codes.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 3002, "each once");
        assert!(got[..2].iter().all(|o| o.cursor.as_ref().unwrap().ahead));
        assert!(got[2..].iter().all(|o| !o.cursor.as_ref().unwrap().ahead));
        // The storm keeps its order.
        assert!(codes[2..].windows(2).all(|w| w[0] < w[1]));
        // Journaled in that order, every record is seen: a restart hands none over again.
        let mut d = crate::model::Delivery::default();
        for o in &got {
            d.advance_cursor(o.cursor.as_ref().unwrap(), crate::model::Timestamp(0));
        }
        for o in &got {
            let c = o.cursor.as_ref().unwrap();
            assert!(d.seen(&c.stream, c.pos), "{c:?}");
        }
        // The 79 is passed by the cursor; the 48, last in the log, is remembered as ahead.
        let last = got[1].cursor.as_ref().unwrap();
        assert_eq!(
            d.ahead.iter().collect::<Vec<_>>(),
            [&(last.stream.clone(), last.pos)]
        );
        assert!(read_burst(&log, dir.path(), Resume::new(d.clone())).is_empty());
        // A crash after only the fatal ones were journaled: the rest is read again, they
        // are not.
        let mut early = crate::model::Delivery::default();
        for o in &got[..2] {
            early.advance_cursor(o.cursor.as_ref().unwrap(), crate::model::Timestamp(0));
        }
        let again = read_burst(&log, dir.path(), Resume::new(early));
        assert_eq!(again.len(), 3000);
        assert!(
            again
                .iter()
                .all(|o| !matches!(o.signal, Signal::Xid { code: 79 | 48, .. }))
        );
    }

    proptest::proptest! {
        /// A line is glanced at as an XID or SXid exactly when it parses as one, with the
        /// same sequence number and code: what is read as a record is what is handed over.
        #[test]
        fn glance_takes_exactly_the_lines_the_parsers_take(
            header in "([0-9]{1,3},[0-9]{0,20},[0-9]{0,5},[-c];)?",
            mark in "(NVRM: Xid \\(PCI:|nvidia-nvswitch2: SXid \\(PCI:|NVRM: Xid \\(PC)",
            pci in "[0-9a-f:.]{0,14}\\)?:?",
            code in "[ 0-9]{0,11}[a-z]?",
            rest in ", ?(Severity|Data|Fatal|pid=[0-9]{0,5}|[a-zA-Z ,=]{0,20}){0,3}",
        ) {
            let line = format!("{header}{mark}{pci}{code}{rest}");
            let sx = super::super::sxid::parse_line(&line);
            let x = parse_line(&line);
            let expected = match (&sx, &x) {
                (Some(sx), _) => Some((sx.seq, super::super::sxid::parse_line(&line).map(|s| s.observation().signal))),
                (None, Some(x)) => Some((x.seq, Some(Signal::Xid { code: x.code, decode: decode_xid(x.code, Some(&x.text), Path::new(UVM_REFCNT)).0 }))),
                (None, None) => None,
            };
            let got = glance(&line).map(|(seq, signal)| (seq, Some(signal)));
            proptest::prop_assert_eq!(got, expected, "{}", line);
        }
    }

    #[test]
    fn kernel_and_nvml_pci_ids_match() {
        assert!(same_pci("0000:3b:00", "00000000:3B:00.0"));
        assert!(!same_pci("0000:3b:00", "00000000:3C:00.0"));
        assert!(!same_pci("garbage", "00000000:3B:00.0"));
    }
}
