//! The files under `state_dir`:
//! - `incidents.jsonl`: every incident record, append-only;
//! - `inputs.jsonl`: every input the engine consumed, with its time and a sequence number,
//!   so that `gpu-medic policy simulate` can replay exactly what the daemon saw, and a
//!   restart can replay what `state.json` does not hold yet;
//! - `state.json`: the engine's state, written atomically (temp file, fsync, rename).
//!
//! The supervisor writes in batches: the inputs of a batch (one fsync), then its incident
//! records (one fsync), then the state. Both journals rotate by size (`NAME.1`, `NAME.2`, ...),
//! between batches only; readers stream across the rotated files, one line in memory at a
//! time, each line capped ([`crate::sys::limits::MAX_JOURNAL_LINE`]).
//!
//! A crash mid-write leaves at most a torn last line. Readers skip it with a warning; writers
//! start the next record on a fresh line. Nothing here is fatal to the reader.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::engine::State;
use crate::model::{OperatorRequest, StampedInput};
use crate::sys::error::JournalError;
use crate::sys::fs::{Durability, write_atomic};

/// When a journal file is rotated: at `max_bytes`, the live file becomes `NAME.1` (the
/// older ones shift to `.2`, ...), `keep` rotated files are kept, the oldest is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rotation {
    pub max_bytes: u64,
    pub keep: u32,
}

/// An append-only JSON-lines file. Records are encoded into a buffer by [`JsonlWriter::write`]
/// and reach the disk together at [`JsonlWriter::commit`] (one write, one fsync per batch).
pub struct JsonlWriter<T> {
    path: PathBuf,
    file: File,
    len: u64,
    pending: Vec<u8>,
    /// Lines dropped from `pending` while the disk refused them (see `commit`).
    dropped: u64,
    rotation: Option<Rotation>,
    _t: PhantomData<fn(&T)>,
}

/// At most this many bytes of records wait in memory while the journal cannot be written.
pub const MAX_PENDING: usize = 16 * 1024 * 1024;

impl<T: Serialize> JsonlWriter<T> {
    /// Opens (creates) a journal that is never rotated.
    pub fn open(path: &Path) -> Result<Self, JournalError> {
        Self::open_with(path, None)
    }

    /// Opens (creates) a journal rotated by size (see [`JsonlWriter::rotate_if_due`]).
    pub fn open_rotating(path: &Path, rotation: Rotation) -> Result<Self, JournalError> {
        Self::open_with(path, Some(rotation))
    }

    fn open_with(path: &Path, rotation: Option<Rotation>) -> Result<Self, JournalError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| JournalError::io(dir, e))?;
        }
        // Whatever is in the way that is not a regular file (a FIFO, a directory, a symlink
        // to a device such as /dev/null, which would swallow every record) is set aside: a
        // journal is never opened through it. A symlink to a regular file is followed.
        crate::sys::limits::set_aside_unless_regular(path)
            .map_err(|e| JournalError::io(path, e))?;
        let mut file =
            crate::sys::fs::open_append(path, true).map_err(|e| JournalError::io(path, e))?;
        // A torn last line (crash mid-write) must not swallow the next record.
        let mut len = file
            .metadata()
            .map_err(|e| JournalError::io(path, e))?
            .len();
        if len > 0 {
            let mut last = [0u8; 1];
            file.seek(SeekFrom::Start(len - 1))
                .and_then(|_| file.read_exact(&mut last))
                .map_err(|e| JournalError::io(path, e))?;
            if last[0] != b'\n' {
                file.write_all(b"\n")
                    .map_err(|e| JournalError::io(path, e))?;
                len += 1;
            }
        }
        Ok(JsonlWriter {
            path: path.to_path_buf(),
            file,
            len,
            pending: Vec::new(),
            dropped: 0,
            rotation,
            _t: PhantomData,
        })
    }

    /// Encodes one record into the pending batch; nothing reaches the file before `commit`.
    pub fn write(&mut self, item: &T) -> Result<(), JournalError> {
        let at = self.pending.len();
        serde_json::to_writer(&mut self.pending, item).map_err(|e| JournalError::Corrupt {
            path: self.path.clone(),
            line: 0,
            message: format!("cannot encode record: {e}"),
        })?;
        if self.pending.len() - at > crate::sys::limits::MAX_JOURNAL_LINE {
            // Readers skip lines over the cap: never write one.
            self.pending.truncate(at);
            return Err(JournalError::Corrupt {
                path: self.path.clone(),
                line: 0,
                message: format!(
                    "record larger than the {} line cap",
                    crate::sys::limits::human_bytes(crate::sys::limits::MAX_JOURNAL_LINE as u64)
                ),
            });
        }
        self.pending.push(b'\n');
        Ok(())
    }

    /// Writes the pending batch and waits until it is on disk (one fsync). A write that
    /// fails (a full disk) leaves the file as it was (a partial write is cut off again) and
    /// the batch pending: the next commit writes it first, so records wait in memory, in
    /// order, until the disk takes them. At most [`MAX_PENDING`] bytes wait; past it the
    /// oldest whole lines are dropped, and the count is returned by [`take_dropped`].
    pub fn commit(&mut self) -> Result<(), JournalError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        if let Err(e) = self
            .file
            .write_all(&self.pending)
            .and_then(|_| self.file.sync_data())
        {
            let _ = self.file.set_len(self.len);
            self.bound_pending();
            return Err(JournalError::io(&self.path, e));
        }
        self.len += self.pending.len() as u64;
        self.pending.clear();
        Ok(())
    }

    /// Records waiting in memory for a commit (a full disk), as lines.
    pub fn pending_lines(&self) -> usize {
        self.pending.iter().filter(|b| **b == b'\n').count()
    }

    /// How many waiting lines were dropped (over [`MAX_PENDING`]) since last asked.
    pub fn take_dropped(&mut self) -> u64 {
        std::mem::take(&mut self.dropped)
    }

    fn bound_pending(&mut self) {
        while self.pending.len() > MAX_PENDING {
            match self.pending.iter().position(|b| *b == b'\n') {
                Some(end) => {
                    self.pending.drain(..=end);
                    self.dropped += 1;
                }
                None => {
                    self.pending.clear();
                    self.dropped += 1;
                }
            }
        }
    }

    /// Appends one record and waits until it is on disk.
    pub fn append(&mut self, item: &T) -> Result<(), JournalError> {
        self.write(item)?;
        self.commit()
    }

    /// Rotates the file if it reached its size. Called between batches, never inside one, so
    /// that a batch is never split across two files.
    pub fn rotate_if_due(&mut self) -> Result<bool, JournalError> {
        let Some(rot) = self.rotation else {
            return Ok(false);
        };
        if self.len < rot.max_bytes.max(1) || !self.pending.is_empty() {
            return Ok(false);
        }
        rotate_files(&self.path, rot.keep)?;
        let fresh = Self::open_with(&self.path, self.rotation)?;
        *self = fresh;
        tracing::info!(path = %self.path.display(), keep = rot.keep, "journal rotated");
        Ok(true)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// `NAME.n`: the n-th most recent rotated file of a journal.
pub fn rotated_path(path: &Path, n: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{n}"));
    PathBuf::from(name)
}

/// The most rotated files a journal is looked for in (`NAME.1` ... `NAME.10000`).
pub const MAX_ROTATED: u32 = 10_000;

/// How many rotated files `NAME.1`, `NAME.2`, ... exist in a row (at most [`MAX_ROTATED`]).
fn rotated_count(path: &Path) -> u32 {
    let mut n = 0;
    while n < MAX_ROTATED && rotated_path(path, n + 1).exists() {
        n += 1;
    }
    n
}

/// Shifts `NAME` to `NAME.1`, `NAME.1` to `NAME.2`, ..., keeping `keep` rotated files. The
/// work is one step per file that exists, whatever `keep` says.
fn rotate_files(path: &Path, keep: u32) -> Result<(), JournalError> {
    let io = |p: &Path, e| JournalError::io(p, e);
    let have = rotated_count(path);
    // Files beyond `keep` (also those left by a larger `keep` before) go.
    for n in (keep.max(1)..=have).rev() {
        let p = rotated_path(path, n);
        std::fs::remove_file(&p).map_err(|e| io(&p, e))?;
    }
    let have = have.min(keep.saturating_sub(1));
    if keep == 0 {
        std::fs::remove_file(path).map_err(|e| io(path, e))?;
    } else {
        for i in (1..=have).rev() {
            let from = rotated_path(path, i);
            let to = rotated_path(path, i + 1);
            std::fs::rename(&from, &to).map_err(|e| io(&from, e))?;
        }
        let to = rotated_path(path, 1);
        std::fs::rename(path, &to).map_err(|e| io(path, e))?;
    }
    if let Some(dir) = path.parent() {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io(dir, e))?;
    }
    Ok(())
}

/// The files of a journal, oldest first: `NAME.n`, ..., `NAME.1`, `NAME` (those that exist).
pub fn journal_files(path: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for i in (1..=rotated_count(path)).rev() {
        out.push(rotated_path(path, i));
    }
    if path.exists() {
        out.push(path.to_path_buf());
    }
    out
}

/// A line that could not be read, kept for the warning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedLine {
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for SkippedLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

pub use crate::sys::lines::{CappedLine, read_capped_line};

/// What a journal reader hands over for each line.
#[derive(Debug)]
pub enum Entry<T> {
    Item(T),
    Skipped { path: PathBuf, line: SkippedLine },
}

/// Streams the records of `files` in order, one line in memory at a time; `f` returns
/// `false` to stop. Unreadable lines (a torn tail, a hand-edited or overlong line) are
/// handed over as `Skipped`, never fatal. A missing file is empty. At most `max_bytes` are
/// read in all (`None`: no cap); past it the read stops with an error.
pub fn stream_jsonl<T: DeserializeOwned>(
    files: &[PathBuf],
    max_bytes: Option<u64>,
    f: impl FnMut(Entry<T>) -> bool,
) -> Result<(), JournalError> {
    stream_jsonl_from(files, max_bytes, Window::Whole, f)
}

/// [`stream_jsonl`] over the last `tail` bytes of each file only (from the first line that
/// begins in them): bounded work whatever the file holds before (a start never scans
/// gigabytes for a replay that needs its last lines).
pub fn stream_jsonl_tail<T: DeserializeOwned>(
    files: &[PathBuf],
    tail: u64,
    f: impl FnMut(Entry<T>) -> bool,
) -> Result<(), JournalError> {
    stream_jsonl_from(files, None, Window::Tail(tail), f)
}

/// The most of one journal file a reader reads: the file's own cap (`[journal]
/// max_file_size_mib`) plus one batch that waited in memory ([`MAX_PENDING`]); the writer
/// rotates a file before it grows past that, so only a file it did not write alone is longer
/// (a hand's, a corrupt one's: 2 GB of zeros).
pub fn read_cap(max_file_size_mib: u64) -> u64 {
    max_file_size_mib
        .saturating_mul(1024 * 1024)
        .saturating_add(MAX_PENDING as u64)
}

/// [`stream_jsonl`] over journal files each read within `cap` ([`read_cap`]): a file longer
/// than that is not the writer's alone (it rotates a file before it grows past `cap`) and is
/// read from the first whole line of its last [`OVER_CAP_READ`] bytes (or `cap`, when less),
/// and an `Entry::Skipped` (line 0) first says how much was skipped. Work and time are
/// bounded by `cap` per file whatever the files hold, and by [`OVER_CAP_READ`] for a file
/// over it (a 2 GB file: `gpu-medic run`'s start and `incidents list` stay within their
/// seconds, BENCHMARKS.md).
pub fn stream_journal<T: DeserializeOwned>(
    files: &[PathBuf],
    cap: u64,
    f: impl FnMut(Entry<T>) -> bool,
) -> Result<(), JournalError> {
    stream_jsonl_from(files, None, Window::Capped(cap), f)
}

/// How much of each file a stream reads.
#[derive(Debug, Clone, Copy)]
enum Window {
    /// All of it.
    Whole,
    /// Its last bytes only, quietly (a replay needs the file's last lines).
    Tail(u64),
    /// At most its last bytes, saying what was skipped (a journal file over its cap).
    Capped(u64),
}

/// The most of a journal file over its cap that a capped reader reads: its last 8 MiB. Such
/// a file is not the writer's alone (a hand's, a corrupt one's), and reading the whole cap
/// of it (80 MiB of records by default) took a start 4.7 s and `incidents list` 13.5 s in
/// the dev profile (BENCHMARKS.md, "A journal file far over its cap").
pub const OVER_CAP_READ: u64 = 8 * 1024 * 1024;

impl Window {
    /// The window into a file of `len` bytes.
    fn tail(self, len: u64) -> Option<u64> {
        match self {
            Window::Whole => None,
            Window::Tail(t) => Some(t),
            Window::Capped(c) if len > c => Some(c.min(OVER_CAP_READ)),
            Window::Capped(c) => Some(c),
        }
    }
}

/// Opens one journal file (`stream`: a pipe is allowed too) and, with `tail`, moves to the
/// first whole line of its last `tail` bytes; `None` when it does not exist. Also returns the
/// file's length and how many bytes were skipped.
fn open_window(
    path: &Path,
    stream: bool,
    window: Window,
    buf: &mut Vec<u8>,
) -> Result<Option<(BufReader<std::fs::File>, u64, u64)>, JournalError> {
    // Journals under state_dir are regular files; an input given to `policy simulate`
    // (capped) may also be a pipe.
    let kind = if stream {
        crate::sys::limits::Kind::Stream
    } else {
        crate::sys::limits::Kind::Regular
    };
    let file = match crate::sys::limits::open_checked(path, kind, u64::MAX, "journal") {
        Ok(f) => f,
        Err(e) if e.is_not_found() => return Ok(None),
        Err(e) => {
            return Err(JournalError::Corrupt {
                path: path.to_path_buf(),
                line: 0,
                message: e.to_string(),
            });
        }
    };
    let mut reader = BufReader::new(file);
    let len = reader
        .get_ref()
        .metadata()
        .map_err(|e| JournalError::io(path, e))?
        .len();
    let mut skipped = 0;
    if let Some(t) = window.tail(len)
        && len > t
    {
        skipped = len - t - 1;
        reader
            .seek(SeekFrom::Start(skipped))
            .map_err(|e| JournalError::io(path, e))?;
        // The line the window begins in is not whole: skipped (found within the
        // window, or the window is one overlong line and nothing is read).
        read_capped_line(&mut reader, buf, 0, t.saturating_add(1))
            .map_err(|e| JournalError::io(path, e))?;
    }
    Ok(Some((reader, len, skipped)))
}

fn stream_jsonl_from<T: DeserializeOwned>(
    files: &[PathBuf],
    max_bytes: Option<u64>,
    window: Window,
    mut f: impl FnMut(Entry<T>) -> bool,
) -> Result<(), JournalError> {
    let mut total: u64 = 0;
    let mut buf = Vec::new();
    for path in files {
        let Some((mut reader, len, skipped)) =
            open_window(path, max_bytes.is_some(), window, &mut buf)?
        else {
            continue;
        };
        if let (Window::Capped(cap), true) = (window, skipped > 0)
            && !f(Entry::Skipped {
                path: path.clone(),
                line: over_cap(skipped, len, cap),
            })
        {
            return Ok(());
        }
        let mut n = 0;
        loop {
            let max_scan = max_bytes.map_or(u64::MAX, |m| m.saturating_sub(total) + 1);
            let Some(line) = read_capped_line(
                &mut reader,
                &mut buf,
                crate::sys::limits::MAX_JOURNAL_LINE,
                max_scan,
            )
            .map_err(|e| JournalError::io(path, e))?
            else {
                break;
            };
            n += 1;
            let (text, complete) = match line {
                CappedLine::Text { text, complete } => {
                    total = total.saturating_add(text.len() as u64 + 1);
                    (text, complete)
                }
                CappedLine::TooLong { len } => {
                    total = total.saturating_add(len as u64 + 1);
                    if let Some(max) = max_bytes
                        && total > max
                    {
                        return Err(too_much(path, n, max));
                    }
                    let skipped = SkippedLine {
                        line: n,
                        message: format!(
                            "line of {len} bytes longer than the {} cap skipped",
                            crate::sys::limits::human_bytes(
                                crate::sys::limits::MAX_JOURNAL_LINE as u64
                            )
                        ),
                    };
                    if !f(Entry::Skipped {
                        path: path.clone(),
                        line: skipped,
                    }) {
                        return Ok(());
                    }
                    continue;
                }
            };
            if let Some(max) = max_bytes
                && total > max
            {
                return Err(too_much(path, n, max));
            }
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            let entry = match serde_json::from_str::<T>(text) {
                Ok(v) => Entry::Item(v),
                Err(e) => Entry::Skipped {
                    path: path.clone(),
                    line: SkippedLine {
                        line: n,
                        message: if complete {
                            format!("unreadable record skipped: {e}")
                        } else {
                            "torn last record (interrupted write) skipped".to_string()
                        },
                    },
                },
            };
            if !f(entry) {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// What a reader says of a journal file over its cap (see [`stream_journal`]).
fn over_cap(skipped: u64, len: u64, cap: u64) -> SkippedLine {
    use crate::sys::limits::human_bytes;
    SkippedLine {
        line: 0,
        message: format!(
            "the first {} of {} skipped: the file is over its cap of {} ([journal] max_file_size_mib and one batch), so only its last {} are read",
            human_bytes(skipped),
            human_bytes(len),
            human_bytes(cap),
            human_bytes(len.saturating_sub(skipped).saturating_sub(1))
        ),
    }
}

fn too_much(path: &Path, line: usize, max: u64) -> JournalError {
    JournalError::Corrupt {
        path: path.to_path_buf(),
        line,
        message: format!(
            "more than the {} cap; is this the right file?",
            crate::sys::limits::human_bytes(max)
        ),
    }
}

/// Reads a JSON-lines file. A missing file is empty. Unreadable lines (a torn tail, a
/// hand-edited line) are skipped and reported, never fatal.
pub fn read_jsonl<T: DeserializeOwned>(
    path: &Path,
) -> Result<(Vec<T>, Vec<SkippedLine>), JournalError> {
    let mut items = Vec::new();
    let mut skipped = Vec::new();
    stream_jsonl(&[path.to_path_buf()], None, |e| {
        match e {
            Entry::Item(v) => items.push(v),
            Entry::Skipped { line, .. } => skipped.push(line),
        }
        true
    })?;
    Ok((items, skipped))
}

/// An input as `inputs.jsonl` holds it: the stamped input and its sequence number (1, 2, ...
/// across restarts and rotations; 0 in journals written before sequence numbers existed).
/// `state.json` records the last sequence number applied, so a restart replays exactly the
/// inputs journaled after it and none twice.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JournaledInput {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub seq: u64,
    #[serde(flatten)]
    pub stamped: StampedInput,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// The inputs of the live `inputs.jsonl` with a sequence number above `applied`, and the
/// highest sequence number the file holds. Streams the file; keeps at most `max` inputs (a
/// crash leaves at most one batch unapplied).
pub fn inputs_after(
    path: &Path,
    applied: u64,
    max: usize,
) -> Result<(Vec<JournaledInput>, u64), JournalError> {
    let mut out = Vec::new();
    let mut last = 0;
    stream_jsonl_tail::<JournaledInput>(&[path.to_path_buf()], REPLAY_SCAN_BYTES, |e| {
        if let Entry::Item(i) = e {
            if i.seq > crate::engine::MAX_COUNTER {
                // Not a number this journal wrote: a later input could never follow it.
                tracing::warn!(path = %path.display(), seq = i.seq, "input with an out-of-range sequence number skipped");
                return true;
            }
            last = last.max(i.seq);
            if i.seq > applied && out.len() < max {
                out.push(i);
            }
        }
        true
    })?;
    Ok((out, last))
}

/// The most of `inputs.jsonl` a start reads for its replay: its last 64 MiB. The inputs a
/// replay needs (those journaled after the last saved state, at most `REPLAY_MAX`) are the
/// file's last lines; whatever lies before (a line of gigabytes) is never scanned.
pub const REPLAY_SCAN_BYTES: u64 = 64 * 1024 * 1024;

/// The last `n` records of the live journal file, oldest first (read from its last
/// [`REPLAY_SCAN_BYTES`] only).
pub fn last_records<T: DeserializeOwned>(path: &Path, n: usize) -> Result<Vec<T>, JournalError> {
    let mut ring = std::collections::VecDeque::with_capacity(n.min(4096));
    if n == 0 {
        return Ok(Vec::new());
    }
    stream_jsonl_tail::<T>(&[path.to_path_buf()], REPLAY_SCAN_BYTES, |e| {
        if let Entry::Item(v) = e {
            if ring.len() == n {
                ring.pop_front();
            }
            ring.push_back(v);
        }
        true
    })?;
    Ok(ring.into())
}

/// Writes the engine state atomically: readers see the old or the new file, never half.
pub fn save_state(path: &Path, state: &State) -> Result<(), JournalError> {
    let body = serde_json::to_vec_pretty(state).map_err(|e| JournalError::Corrupt {
        path: path.to_path_buf(),
        line: 0,
        message: format!("cannot encode state: {e}"),
    })?;
    // Durable: the next start resumes from it, and orders handed out depend on it.
    write_atomic(path, &body, Durability::Durable).map_err(|e| JournalError::io(path, e))
}

/// Reads `state.json`; `None` when there is none yet (first start).
/// Anything that is not a readable state (not a regular file, over its cap, not UTF-8, not
/// the state's JSON, a number out of range, a collection larger than the engine keeps) is
/// `Corrupt`, which the daemon sets aside. One written by a newer gpu-medic is `Newer`
/// ([`read_newer`]), never read.
pub fn load_state(path: &Path) -> Result<Option<State>, JournalError> {
    load_state_as(path, Newer::Refuse).map(|s| s.map(|(s, _)| s))
}

/// What to do with a `state.json` a newer gpu-medic wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Newer {
    /// Refuse it (`JournalError::Newer`): the default.
    Refuse,
    /// Read it as this version can (`gpu-medic run --accept-newer-state`).
    Accept,
}

/// [`load_state`], with what to do about a newer file; an accepted newer file is returned
/// with its writer (`gpu-medic X.Y.Z (state format N)`).
pub fn load_state_as(
    path: &Path,
    newer: Newer,
) -> Result<Option<(State, Option<String>)>, JournalError> {
    let corrupt = |line, message| JournalError::Corrupt {
        path: path.to_path_buf(),
        line,
        message,
    };
    let text = match crate::sys::limits::read_text(
        path,
        crate::sys::limits::MAX_STATE_BYTES,
        "state file",
    ) {
        Ok(t) => t,
        Err(e) if e.is_not_found() => {
            // A dangling symlink reads as missing: that is no first start either.
            if std::fs::symlink_metadata(path).is_ok() {
                return Err(corrupt(0, format!("state file unreadable: {e}")));
            }
            return Ok(None);
        }
        Err(e) => return Err(corrupt(0, format!("state file unreadable: {e}"))),
    };
    // Before anything else: a newer file may not parse as this version's state at all, and
    // must not be set aside as corrupt for that.
    let accepted = match (read_newer(&text), newer) {
        (None, _) => None,
        (Some(found), Newer::Accept) => Some(found),
        (Some(found), Newer::Refuse) => {
            return Err(JournalError::Newer {
                path: path.to_path_buf(),
                found,
                ours: format!(
                    "{} (state format {})",
                    crate::engine::writer(),
                    crate::engine::STATE_FORMAT
                ),
            });
        }
    };
    let state: State = serde_json::from_str(&text)
        .map_err(|e| corrupt(e.line(), format!("state file unreadable: {e}")))?;
    state
        .check_ranges()
        .map_err(|why| corrupt(0, format!("state file out of range: {why}")))?;
    Ok(Some((state, accepted)))
}

/// The writer of a state file newer than this gpu-medic (`gpu-medic X.Y.Z (state format
/// N)`): a later state format than [`crate::engine::STATE_FORMAT`], or a later version than
/// this one (`written_by`, compared as numbers `major.minor.patch`). `None` for this
/// version's files, an older one's (format 1 has neither field), or a file whose header
/// cannot be read (the full read says what is wrong with it).
pub fn read_newer(text: &str) -> Option<String> {
    #[derive(Deserialize)]
    struct Header {
        #[serde(default = "first_format")]
        format: u32,
        #[serde(default)]
        written_by: String,
    }
    fn first_format() -> u32 {
        1
    }
    let h: Header = serde_json::from_str(text).ok()?;
    let version = |w: &str| -> Option<Vec<u64>> {
        let v = w.strip_prefix("gpu-medic ")?;
        let core = v.split(['-', '+']).next()?;
        core.split('.').map(|n| n.parse().ok()).collect()
    };
    let newer_version = match (version(&h.written_by), version(&crate::engine::writer())) {
        (Some(theirs), Some(ours)) => theirs > ours,
        _ => false,
    };
    (h.format > crate::engine::STATE_FORMAT || newer_version).then(|| {
        let who = if h.written_by.is_empty() {
            "an unnamed gpu-medic".to_string()
        } else {
            crate::model::escape::escape(&h.written_by)
                .to_string()
                .chars()
                .take(80)
                .collect()
        };
        format!("{who} (state format {})", h.format)
    })
}

/// A `state.json` that could not be read, moved out of the way.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetAside {
    /// Where the unreadable file now is.
    pub moved_to: PathBuf,
    /// Why it could not be read.
    pub why: String,
}

/// What the daemon's start found in `state.json` ([`load_state_or_set_aside`]).
#[derive(Debug, Default)]
pub struct Loaded {
    /// The state, when one could be read.
    pub state: Option<State>,
    /// An unreadable file, moved out of the way.
    pub set_aside: Option<SetAside>,
    /// A newer gpu-medic's file read anyway ([`Newer::Accept`]): its writer.
    pub newer: Option<String>,
}

/// [`load_state`] for the daemon: an unreadable (corrupt) state file does not keep it from
/// starting. The file is renamed `state.json.corrupt-<unix ms>` (kept for a post-mortem) and
/// no state is returned, with what was done; the caller rebuilds from the journal
/// ([`rebuild_from_journal`]). Anything but a file left at the state's temporary path (a
/// directory a crashed tool left) is set aside too: the atomic write never deletes it, and
/// every save would fail on it. Errors are only those a restart cannot fix either (the folder
/// cannot be read or written), and a newer gpu-medic's file unless `newer` accepts it (it
/// is never set aside: the version that wrote it may still be started).
pub fn load_state_or_set_aside(
    path: &Path,
    now: crate::model::Timestamp,
    newer: Newer,
) -> Result<Loaded, JournalError> {
    let tmp = crate::sys::fs::temp_path(path);
    crate::sys::limits::set_aside_unless_regular(&tmp).map_err(|e| JournalError::io(&tmp, e))?;
    match load_state_as(path, newer) {
        Ok(s) => {
            let (state, newer) = s.map_or((None, None), |(s, n)| (Some(s), n));
            Ok(Loaded {
                state,
                set_aside: None,
                newer,
            })
        }
        Err(JournalError::Corrupt { message, .. }) => {
            let mut name = path.as_os_str().to_os_string();
            name.push(format!(".corrupt-{}", now.0));
            let moved_to = PathBuf::from(name);
            std::fs::rename(path, &moved_to).map_err(|e| JournalError::io(path, e))?;
            Ok(Loaded {
                set_aside: Some(SetAside {
                    moved_to,
                    why: message,
                }),
                ..Loaded::default()
            })
        }
        Err(e) => Err(e),
    }
}

/// What a rebuild from the journal left out, for the `state-file` self-fault.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Rebuilt {
    /// Records whose ids are out of range (`engine::rebuild::Rebuild::add`).
    pub out_of_range: u64,
    /// Incidents open beyond the newest `MAX_OPEN_INCIDENTS`.
    pub abandoned: crate::engine::rebuild::Abandoned,
    /// Journal files read only in part (over their cap), each as the reader said it.
    pub partial: Vec<String>,
}

impl std::fmt::Display for Rebuilt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if self.out_of_range > 0 {
            parts.push(format!(
                "{} record(s) with out-of-range ids (over {}) left out",
                self.out_of_range,
                crate::model::MAX_REBUILT_ID
            ));
        }
        if self.abandoned.count > 0 {
            parts.push(self.abandoned.to_string());
        }
        parts.extend(self.partial.iter().cloned());
        write!(f, "{}", parts.join("; "))
    }
}

/// At most this many files read in part are named in [`Rebuilt::partial`].
const MAX_PARTIAL_NAMED: usize = 8;

/// The engine state the incident journal implies (see `engine::rebuild`), streamed one line
/// at a time across its rotated files, oldest first, each read within `cap`
/// ([`read_cap`]); unreadable lines are skipped. Also what was left out.
pub fn rebuild_from_journal(
    incidents: &Path,
    now: crate::model::Timestamp,
    reboot_deadline: std::time::Duration,
    cap: u64,
) -> Result<(State, Rebuilt), JournalError> {
    let mut rebuild = crate::engine::rebuild::Rebuild::new().with_reboot_deadline(reboot_deadline);
    let mut partial = Vec::new();
    stream_journal::<crate::model::Record>(&journal_files(incidents), cap, |e| {
        match e {
            Entry::Item(r) => rebuild.add(&r),
            Entry::Skipped { path, line } if line.line == 0 => {
                tracing::warn!(path = %path.display(), "{}", line.message);
                if partial.len() < MAX_PARTIAL_NAMED {
                    partial.push(format!("{}: {}", path.display(), line.message));
                }
            }
            Entry::Skipped { .. } => {}
        }
        true
    })?;
    if rebuild.skipped() > 0 {
        tracing::warn!(path = %incidents.display(), records = rebuild.skipped(), "records with out-of-range ids left out of the rebuilt state");
    }
    let report = Rebuilt {
        out_of_range: rebuild.skipped(),
        abandoned: rebuild.abandoned(),
        partial,
    };
    Ok((rebuild.finish(now), report))
}

/// Whether the incident journal (any of its files) holds anything: a start with no state
/// beside it is not a first start.
pub fn has_records(incidents: &Path) -> bool {
    journal_files(incidents)
        .iter()
        .any(|p| std::fs::metadata(p).is_ok_and(|m| m.len() > 0))
}

/// The stream positions already journaled, as the supervisor last saved them in
/// `state.json`, for a source that resumes reading. Unreadable or missing: none (the source
/// reads from its start or end as it would on a first start; the supervisor still drops what
/// it has seen). Reads the file without setting anything aside.
pub fn committed_delivery(state_file: &Path) -> crate::model::Delivery {
    #[derive(Deserialize)]
    struct Partial {
        #[serde(default)]
        delivery: crate::model::Delivery,
    }
    crate::sys::limits::read_text(
        state_file,
        crate::sys::limits::MAX_STATE_BYTES,
        "state file",
    )
    .ok()
    .and_then(|t| serde_json::from_str::<Partial>(&t).ok())
    .map(|p| p.delivery)
    .unwrap_or_default()
}

/// Where operator requests wait for the daemon (`gpu-medic incidents abort`).
pub fn requests_dir(state_dir: &Path) -> PathBuf {
    crate::config::StateDir::new(state_dir).requests()
}

/// Drops a request for the running daemon, written whole (temp file, then rename).
pub fn submit_request(
    state_dir: &Path,
    request: &OperatorRequest,
) -> Result<PathBuf, JournalError> {
    let dir = requests_dir(state_dir);
    std::fs::create_dir_all(&dir).map_err(|e| JournalError::io(&dir, e))?;
    // Named by time, then process, then a number: two requests in the same millisecond are
    // two files (never one renamed over the other), and names sort in the order submitted.
    let (at, pid) = (crate::model::Timestamp::now().0, std::process::id());
    let dst = (0u32..)
        .map(|n| dir.join(format!("{at:013}-{pid}-{n:06}.json")))
        .find(|p| !p.exists())
        .unwrap_or_else(|| dir.join(format!("{at:013}-{pid}.json")));
    let body = serde_json::to_vec(request).map_err(|e| JournalError::Corrupt {
        path: dst.clone(),
        line: 0,
        message: format!("cannot encode request: {e}"),
    })?;
    // Durable: an operator's request, once acknowledged, must not vanish with a power loss.
    write_atomic(&dst, &body, Durability::Durable).map_err(|e| JournalError::io(&dst, e))?;
    Ok(dst)
}

/// Requests taken in one call (a tick): a flood of request files is worked off over several
/// ticks, never stepped as one unbounded batch.
pub const MAX_REQUESTS_PER_TAKE: usize = 64;
/// Directory entries looked through in one call.
const MAX_REQUEST_SCAN: usize = 16 * 1024;

/// Takes the waiting requests, oldest first, deleting each: at most
/// [`MAX_REQUESTS_PER_TAKE`] a call, the rest at the next. An unreadable one is renamed
/// `*.bad` and reported, so it is neither lost nor retried forever.
pub fn take_requests(state_dir: &Path) -> Vec<OperatorRequest> {
    let dir = requests_dir(state_dir);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut names: Vec<PathBuf> = entries
        .take(MAX_REQUEST_SCAN)
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    names.sort();
    names.truncate(MAX_REQUESTS_PER_TAKE);
    let mut out = Vec::new();
    for p in names {
        match crate::sys::limits::read_text(
            &p,
            crate::sys::limits::MAX_REQUEST_BYTES,
            "operator request",
        )
        .ok()
        .and_then(|b| serde_json::from_str::<OperatorRequest>(&b).ok())
        {
            Some(r) => {
                let _ = std::fs::remove_file(&p);
                out.push(r);
            }
            None => {
                tracing::warn!(path = %p.display(), "unreadable operator request; renamed to .bad");
                let _ = std::fs::rename(&p, p.with_extension("bad"));
            }
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::model::{IncidentEvent, IncidentId, IncidentState, Record, Timestamp};

    /// A closed-incident record numbered `i` (also the export tail's tests' record).
    pub(crate) fn rec(i: u64) -> Record {
        Record {
            at: Timestamp(1_700_000_000_000 + i),
            incident: IncidentId(i),
            drill: None,
            event: IncidentEvent::Closed {
                state: IncidentState::Logged,
                summary: format!("r{i}"),
            },
        }
    }

    #[test]
    fn appends_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub/incidents.jsonl");
        let mut w = JsonlWriter::open(&p).unwrap();
        w.append(&rec(1)).unwrap();
        w.append(&rec(2)).unwrap();
        let (items, skipped) = read_jsonl::<Record>(&p).unwrap();
        assert_eq!(items, vec![rec(1), rec(2)]);
        assert!(skipped.is_empty());
    }

    #[test]
    fn a_torn_last_line_is_skipped_and_the_next_record_is_intact() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        let mut w = JsonlWriter::open(&p).unwrap();
        w.append(&rec(1)).unwrap();
        drop(w);
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(br#"{"at":"2026-11-30T00:00:00.000Z","incid"#)
            .unwrap();
        drop(f);
        let (items, skipped) = read_jsonl::<Record>(&p).unwrap();
        assert_eq!(items, vec![rec(1)]);
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].message.contains("torn"), "{}", skipped[0]);
        let mut w = JsonlWriter::open(&p).unwrap();
        w.append(&rec(3)).unwrap();
        let (items, skipped) = read_jsonl::<Record>(&p).unwrap();
        assert_eq!(items, vec![rec(1), rec(3)]);
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].message.contains("unreadable"));
    }

    #[test]
    fn requests_are_taken_once_in_order_and_bad_ones_set_aside() {
        let dir = tempfile::tempdir().unwrap();
        let a = OperatorRequest::Abort {
            incident: IncidentId(3),
            by: "alice".into(),
        };
        submit_request(dir.path(), &a).unwrap();
        std::fs::write(requests_dir(dir.path()).join("zzz.json"), "{nope").unwrap();
        assert_eq!(take_requests(dir.path()), vec![a]);
        assert!(take_requests(dir.path()).is_empty());
        assert!(requests_dir(dir.path()).join("zzz.bad").exists());
    }

    /// A flood of requests is taken a bounded number at a time, oldest first, none lost.
    #[test]
    fn a_flood_of_requests_is_taken_a_bounded_batch_at_a_time() {
        let dir = tempfile::tempdir().unwrap();
        let n = 3 * MAX_REQUESTS_PER_TAKE + 5;
        for i in 0..n {
            submit_request(
                dir.path(),
                &OperatorRequest::Abort {
                    incident: IncidentId(i as u64),
                    by: "alice".into(),
                },
            )
            .unwrap();
        }
        let mut taken = Vec::new();
        loop {
            let batch = take_requests(dir.path());
            assert!(batch.len() <= MAX_REQUESTS_PER_TAKE);
            if batch.is_empty() {
                break;
            }
            taken.extend(batch);
        }
        let ids: Vec<u64> = taken
            .iter()
            .map(|r| match r {
                OperatorRequest::Abort { incident, .. } => incident.0,
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(ids, (0..n as u64).collect::<Vec<_>>());
    }

    #[test]
    fn state_is_written_atomically_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.json");
        assert_eq!(load_state(&p).unwrap(), None);
        let mut s = State::default();
        s.incidents.last_id = 7;
        save_state(&p, &s).unwrap();
        assert_eq!(load_state(&p).unwrap(), Some(s));
        assert!(!p.with_extension("json.tmp").exists());
        std::fs::write(&p, "{ not json").unwrap();
        assert!(!load_state(&p).unwrap_err().is_retryable());
    }

    /// Newer is a later format or a later version; this version's, an older one's (format 1
    /// has neither field) and an unreadable header are not.
    #[test]
    fn a_newer_state_is_told_by_its_format_or_its_writer() {
        let ours = crate::engine::writer();
        assert_eq!(read_newer("{}"), None);
        assert_eq!(read_newer("not json"), None);
        assert_eq!(
            read_newer(&format!(r#"{{"format":2,"written_by":"{ours}"}}"#)),
            None
        );
        assert_eq!(
            read_newer(r#"{"format":2,"written_by":"gpu-medic 0.0.9"}"#),
            None
        );
        let newer = read_newer(r#"{"format":99,"written_by":"gpu-medic 0.0.1"}"#).unwrap();
        assert!(newer.contains("state format 99"), "{newer}");
        let newer = read_newer(r#"{"format":2,"written_by":"gpu-medic 0.10.0"}"#).unwrap();
        assert_eq!(newer, "gpu-medic 0.10.0 (state format 2)");
        // Refused, never set aside; accepted, read with its writer.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.json");
        let mut v = serde_json::to_value(State::default()).unwrap();
        v["format"] = serde_json::json!(99);
        std::fs::write(&p, v.to_string()).unwrap();
        let e = load_state_or_set_aside(&p, crate::model::Timestamp(1), Newer::Refuse).unwrap_err();
        assert!(e.is_newer() && !e.is_retryable(), "{e}");
        assert!(e.to_string().contains("--accept-newer-state"), "{e}");
        let l = load_state_or_set_aside(&p, crate::model::Timestamp(1), Newer::Accept).unwrap();
        assert!(l.state.is_some() && l.set_aside.is_none());
        assert!(l.newer.unwrap().contains("format 99"));
    }

    /// A file over its cap is read in its last `cap` bytes; the reader says what it skipped
    /// first, and the records there are read.
    #[test]
    fn a_journal_file_over_its_cap_is_read_in_its_last_part_saying_so() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        let mut body = vec![0u8; 100_000];
        body.push(b'\n');
        for i in 1..=3 {
            body.extend_from_slice(&serde_json::to_vec(&rec(i)).unwrap());
            body.push(b'\n');
        }
        std::fs::write(&p, &body).unwrap();
        let (mut items, mut said) = (Vec::new(), Vec::new());
        stream_journal::<Record>(std::slice::from_ref(&p), 4096, |e| {
            match e {
                Entry::Item(r) => items.push(r.incident.0),
                Entry::Skipped { line, .. } => said.push(line),
            }
            true
        })
        .unwrap();
        assert_eq!(items, [1, 2, 3]);
        assert_eq!(said[0].line, 0);
        assert!(
            said[0].message.contains("over its cap of 4 KiB"),
            "{}",
            said[0]
        );
        // Within its cap: read whole, nothing said.
        let (mut n, mut skipped) = (0, 0);
        stream_journal::<Record>(&[p], 1 << 20, |e| {
            match e {
                Entry::Item(_) => n += 1,
                Entry::Skipped { .. } => skipped += 1,
            }
            true
        })
        .unwrap();
        assert_eq!(n, 3);
        assert_eq!(
            skipped, 1,
            "the line of zeros, too long, is the only one skipped"
        );
    }

    /// A file over a cap larger than [`OVER_CAP_READ`] is read in its last `OVER_CAP_READ`
    /// bytes only: it is not the writer's alone, and its size must not set the reader's time.
    #[test]
    fn a_file_over_a_large_cap_is_read_in_its_last_eight_mib_only() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        let line = |i: u64| {
            let mut l = serde_json::to_vec(&rec(i)).unwrap();
            l.push(b'\n');
            l
        };
        let mut w = std::io::BufWriter::new(std::fs::File::create(&p).unwrap());
        let mut written = 0u64;
        let mut i = 0;
        while written < 3 * OVER_CAP_READ {
            i += 1;
            let l = line(i);
            written += l.len() as u64;
            w.write_all(&l).unwrap();
        }
        drop(w);
        let (mut items, mut said) = (Vec::new(), Vec::new());
        let cap = 2 * OVER_CAP_READ;
        stream_journal::<Record>(&[p], cap, |e| {
            match e {
                Entry::Item(r) => items.push(r.incident.0),
                Entry::Skipped { line, .. } => said.push(line),
            }
            true
        })
        .unwrap();
        let per_line = line(i).len() as u64;
        let read = items.len() as u64 * per_line;
        assert!(
            read <= OVER_CAP_READ && read + 2 * per_line > OVER_CAP_READ,
            "{read} bytes of records read"
        );
        assert_eq!(items.last(), Some(&i), "the newest records are read");
        assert_eq!(said.len(), 1, "{said:?}");
        assert!(
            said[0].message.contains("over its cap of 16 MiB")
                && said[0].message.contains("only its last 8 MiB are read"),
            "{}",
            said[0]
        );
    }

    #[test]
    fn journals_rotate_by_size_keep_n_files_and_read_across_them() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        let rot = Rotation {
            max_bytes: 300,
            keep: 2,
        };
        let mut w = JsonlWriter::open_rotating(&p, rot).unwrap();
        let mut rotations = 0;
        for i in 0..40 {
            if w.rotate_if_due().unwrap() {
                rotations += 1;
            }
            w.write(&rec(i)).unwrap();
            w.commit().unwrap();
        }
        assert!(rotations >= 3, "{rotations}");
        let files = journal_files(&p);
        assert_eq!(
            files,
            vec![rotated_path(&p, 2), rotated_path(&p, 1), p.clone()],
            "two rotated files kept, oldest first"
        );
        assert!(!rotated_path(&p, 3).exists());
        let mut ids = Vec::new();
        stream_jsonl::<Record>(&files, None, |e| {
            if let Entry::Item(r) = e {
                ids.push(r.incident.0);
            }
            true
        })
        .unwrap();
        // The newest records, in order, with no gap: only the oldest files went.
        assert_eq!(ids.last(), Some(&39));
        assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
        for f in &files {
            assert!(std::fs::metadata(f).unwrap().len() <= 300 + 200);
        }
        // A batch is never split: nothing rotates while records wait for their commit.
        w.write(&rec(40)).unwrap();
        assert!(!w.rotate_if_due().unwrap());
    }

    #[test]
    fn rotation_costs_one_step_per_file_whatever_keep_says() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("inputs.jsonl");
        for keep in [u32::MAX, 3, 0] {
            std::fs::write(&p, "{}\n").unwrap();
            let started = std::time::Instant::now();
            rotate_files(&p, keep).unwrap();
            assert!(
                started.elapsed() < std::time::Duration::from_secs(5),
                "{keep}"
            );
        }
        // u32::MAX and 3 kept both rotations; 0 then removed every file.
        assert!(journal_files(&p).is_empty(), "{:?}", journal_files(&p));
        for _ in 0..5 {
            std::fs::write(&p, "{}\n").unwrap();
            rotate_files(&p, 3).unwrap();
        }
        assert_eq!(rotated_count(&p), 3);
    }

    #[test]
    fn an_overlong_line_is_skipped_without_being_held_and_the_next_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        let mut body = vec![b'x'; crate::sys::limits::MAX_JOURNAL_LINE + 10];
        body.push(b'\n');
        body.extend_from_slice(&serde_json::to_vec(&rec(5)).unwrap());
        body.push(b'\n');
        std::fs::write(&p, body).unwrap();
        let (items, skipped) = read_jsonl::<Record>(&p).unwrap();
        assert_eq!(items, vec![rec(5)]);
        assert_eq!(skipped.len(), 1);
        assert!(skipped[0].message.contains("longer than"), "{}", skipped[0]);
    }

    #[test]
    fn inputs_carry_sequence_numbers_and_the_unapplied_tail_is_found() {
        use crate::model::{Input, StampedInput};
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("inputs.jsonl");
        let mut w = JsonlWriter::open(&p).unwrap();
        for seq in 1..=5 {
            w.write(&JournaledInput {
                seq,
                stamped: StampedInput {
                    at: Timestamp(1_700_000_000_000 + seq),
                    input: Input::Tick,
                },
            })
            .unwrap();
        }
        w.commit().unwrap();
        let (tail, last) = inputs_after(&p, 3, 100).unwrap();
        assert_eq!(last, 5);
        assert_eq!(tail.iter().map(|i| i.seq).collect::<Vec<_>>(), vec![4, 5]);
        // `policy simulate` reads the same lines as plain stamped inputs.
        let (plain, skipped) = read_jsonl::<StampedInput>(&p).unwrap();
        assert_eq!(plain.len(), 5);
        assert!(skipped.is_empty());
    }
}
