//! Following `incidents.jsonl` across its rotations from a saved cursor.
//!
//! A cursor names a journal file by its inode (rotation renames `NAME` to `NAME.1`, so the
//! inode follows the file) and a hash of its first line, a byte offset in it, and `seq`: how
//! many journal lines came before, counted since the first export, which numbers every record
//! the same way however often it is read again (the record id is built from it). A cursor is
//! saved only after what it passed over was acknowledged, so after a crash the last batch is
//! read and sent again: at least once.
//!
//! The cursor's file is the one it names only while that inode still holds at least
//! `offset` bytes and the same first line. Otherwise it is gone, and where to go on depends
//! on what happened to it:
//!
//! - **rotated away** (deleted past `keep_files`) before the cursor reached its end: the lines
//!   the cursor had not passed are lost; the tail counts them (it keeps a line count of every
//!   file not yet passed, read incrementally) and carries on with the oldest file left;
//! - **truncated in place** (`: > incidents.jsonl`) or **replaced** (removed and written
//!   again, maybe under the same inode): what it held past the cursor is lost (counted the
//!   same way); the export goes on at the start of the first file newer than the last one the
//!   cursor passed (its first line's hash is in the cursor: `passed`), which is the truncated
//!   or new file itself, so nothing already sent is sent again and nothing written after is
//!   missed;
//! - **copied, then truncated** (logrotate's `copytruncate`): the copy has the cursor's first
//!   line, and the export goes on in the copy at the same offset, then in the truncated file
//!   from its start: no loss, no repeat (beyond what logrotate itself loses between its copy
//!   and its truncation).
//!
//! Every open is checked ([`crate::sys::limits::open_checked`]: a regular file, opened
//! without blocking) and fenced: the opened file must be the inode the listing named, or
//! the read stops and the next one lists the files again.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::journal::{CappedLine, journal_files, read_capped_line};
use crate::model::Record;
use crate::sys::error::JournalError;

/// Where a reader of the journal stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// The file's inode; 0 before the first read (start at the oldest file).
    pub inode: u64,
    /// Bytes of that file already passed.
    pub offset: u64,
    /// Lines of that file already passed.
    pub line: u64,
    /// Journal lines passed in all (this number + 1 is the next line's sequence number).
    pub seq: u64,
    /// Lines lost to rotation before they were passed, in all.
    #[serde(default)]
    pub dropped: u64,
    /// A hash of the file's first line (0: none yet): a deleted file's inode is soon reused
    /// by a new file, and a truncated file starts with another line, which this tells apart.
    #[serde(default)]
    pub head: u64,
    /// The first line's hash of the last file the cursor passed (0: none): where to go on
    /// when the cursor's file was truncated or replaced.
    #[serde(default)]
    pub passed: u64,
}

impl Cursor {
    /// Reads a saved cursor; none (or an unreadable one, which is reported) starts afresh.
    pub fn load(path: &Path) -> Cursor {
        let parsed = match crate::sys::limits::read_text(path, 64 * 1024, "export cursor") {
            Ok(b) => serde_json::from_str::<Cursor>(&b).map_err(|e| e.to_string()),
            Err(e) if e.is_not_found() => return Cursor::default(),
            Err(e) => Err(e.to_string()),
        };
        let checked = parsed.and_then(|c| {
            let max = crate::engine::MAX_COUNTER;
            if [c.offset, c.line, c.seq, c.dropped]
                .iter()
                .any(|v| *v > max)
            {
                Err(format!("a count beyond {max}"))
            } else {
                Ok(c)
            }
        });
        checked.unwrap_or_else(|e| {
            tracing::warn!(path = %path.display(), "export cursor unreadable ({e}); reading the journal from its oldest file (records may be sent again)");
            Cursor::default()
        })
    }

    /// Saves the cursor whole (temp file, fsync, rename).
    pub fn save(&self, path: &Path) -> Result<(), JournalError> {
        let body = serde_json::to_vec(self).map_err(|e| JournalError::Corrupt {
            path: path.to_path_buf(),
            line: 0,
            message: format!("cannot encode cursor: {e}"),
        })?;
        // Durable: a cursor lost to a power loss would ship what was shipped again.
        crate::sys::fs::write_atomic(path, &body, crate::sys::fs::Durability::Durable)
            .map_err(|e| JournalError::io(path, e))
    }
}

/// One journal line handed to a reader.
#[derive(Debug)]
pub struct Line {
    /// 1, 2, ... across the journal's life (see [`Cursor::seq`]).
    pub seq: u64,
    /// None: the line could not be read (torn, hand-edited, overlong); it is passed over.
    pub record: Option<Record>,
}

/// What a read did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Read {
    /// Lines newly counted as lost to rotation.
    pub dropped: u64,
    /// The reader stopped before the journal's end (the batch was full).
    pub more: bool,
}

/// A follower of one journal.
pub struct Tail {
    path: PathBuf,
    /// inode → what was counted of it, for the files the cursor has not passed.
    counted: HashMap<u64, Counted>,
}

/// The lines counted in one journal file, incrementally.
#[derive(Debug, Clone, Copy, Default)]
struct Counted {
    bytes: u64,
    lines: u64,
    /// Its first line's hash when it was counted (0: none yet).
    head: u64,
}

/// One journal file as listed: path, inode, size, first line's hash.
#[derive(Debug, Clone)]
struct Listed {
    path: PathBuf,
    ino: u64,
    len: u64,
    head: u64,
}

/// Opens a journal file as every journal read does: a regular file, without blocking.
fn open(p: &Path) -> Result<File, crate::sys::limits::ReadError> {
    crate::sys::limits::open_checked(
        p,
        crate::sys::limits::Kind::Regular,
        u64::MAX,
        "incident journal",
    )
}

/// FNV-1a of a file's first line (at most 256 bytes); 0 while it has no complete line.
fn head_hash(f: &mut File) -> u64 {
    let mut buf = [0u8; 256];
    let n = std::io::Read::read(f, &mut buf).unwrap_or(0);
    let Some(end) = buf[..n].iter().position(|b| *b == b'\n') else {
        return 0;
    };
    buf[..end].iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Tail {
    pub fn new(path: &Path) -> Tail {
        Tail {
            path: path.to_path_buf(),
            counted: HashMap::new(),
        }
    }

    /// The journal's files, oldest first, with their inodes, sizes and first lines. A file
    /// that is not a regular one (or vanished since the listing) is left out.
    fn files(&self) -> Vec<Listed> {
        let mut out = Vec::new();
        for p in journal_files(&self.path) {
            let Ok(mut f) = open(&p) else { continue };
            let Ok(m) = f.metadata() else { continue };
            let head = head_hash(&mut f);
            out.push(Listed {
                path: p,
                ino: m.ino(),
                len: m.len(),
                head,
            });
        }
        out
    }

    /// Where the cursor's file is in `files`, moving the cursor when that file is gone (see
    /// the module's doc); returns its index and the lines newly found lost.
    fn locate(&mut self, cur: &mut Cursor, files: &[Listed]) -> (usize, u64) {
        if cur.inode == 0 {
            cur.inode = files[0].ino;
            cur.head = files[0].head;
            return (0, 0);
        }
        if let Some(i) = files.iter().position(|f| f.ino == cur.inode) {
            let f = &files[i];
            // A file's first line never goes away: one that lost it was truncated.
            if f.len >= cur.offset && (cur.head == 0 || f.head == cur.head) {
                if cur.head == 0 {
                    cur.head = f.head;
                }
                return (i, 0);
            }
        }
        // A copy of it (copy-truncate): another file starting with its first line.
        if cur.head != 0
            && let Some(i) = files
                .iter()
                .position(|f| f.ino != cur.inode && f.head == cur.head)
        {
            self.counted.remove(&cur.inode);
            if files[i].len >= cur.offset {
                cur.inode = files[i].ino;
                return (i, 0);
            }
            // The copy ends before the cursor: all of it was passed.
            tracing::warn!(
                "the incident journal was copied and truncated past what was exported; going on after the copy"
            );
            return (self.resume(cur, files, i + 1), 0);
        }
        // Lost: what the tail counted past the cursor in its file (when the count is of that
        // file: the same first line).
        let lost = match self.counted.remove(&cur.inode) {
            Some(c) if cur.head == 0 || c.head == 0 || c.head == cur.head => {
                c.lines.saturating_sub(cur.line)
            }
            _ => 0,
        };
        let after = if cur.passed == 0 {
            None
        } else {
            files.iter().position(|f| f.head == cur.passed)
        };
        let at = self.resume(cur, files, after.map_or(0, |i| i + 1));
        tracing::warn!(
            lost,
            "the exported incident journal file was rotated away, truncated or replaced before it was passed; going on with {}",
            files[at].path.display()
        );
        (at, lost)
    }

    /// Puts the cursor at the start of `files[at]` (the last file's end when `at` is past
    /// it).
    fn resume(&self, cur: &mut Cursor, files: &[Listed], at: usize) -> usize {
        let i = at.min(files.len() - 1);
        let f = &files[i];
        cur.inode = f.ino;
        cur.head = f.head;
        cur.line = 0;
        cur.offset = if i < at { f.len } else { 0 };
        i
    }

    /// Counts the lines of every file at or after `from` (only bytes not counted yet are
    /// read), so a file rotated away can be accounted for. A counted file now shorter or
    /// starting with another line was truncated or replaced, and one no longer listed was
    /// deleted: what was counted of it is lost (unless another file holds its first line:
    /// a copy) and returned; the cursor's own file is [`Tail::locate`]'s.
    fn count(&mut self, files: &[Listed], from: usize, cursor_ino: u64) -> u64 {
        let mut lost = 0u64;
        let copied =
            |head: u64, ino: u64| head != 0 && files.iter().any(|f| f.head == head && f.ino != ino);
        let live: Vec<u64> = files[from..].iter().map(|f| f.ino).collect();
        let passed: Vec<u64> = files[..from].iter().map(|f| f.ino).collect();
        self.counted.retain(|ino, c| {
            if live.contains(ino) || passed.contains(ino) || *ino == cursor_ino {
                return live.contains(ino);
            }
            if !copied(c.head, *ino) {
                lost = lost.saturating_add(c.lines);
            }
            false
        });
        for f in &files[from..] {
            let c = self.counted.entry(f.ino).or_insert(Counted {
                head: f.head,
                ..Counted::default()
            });
            let replaced = f.len < c.bytes || (c.head != 0 && f.head != 0 && f.head != c.head);
            if replaced {
                if f.ino != cursor_ino && !copied(c.head, f.ino) {
                    lost = lost.saturating_add(c.lines);
                }
                *c = Counted {
                    head: f.head,
                    ..Counted::default()
                };
            }
            if c.head == 0 {
                c.head = f.head;
            }
            if c.bytes >= f.len {
                continue;
            }
            let Ok(mut file) = open(&f.path) else {
                continue;
            };
            if file.metadata().map(|m| m.ino()).ok() != Some(f.ino)
                || file.seek(SeekFrom::Start(c.bytes)).is_err()
            {
                continue;
            }
            let mut buf = [0u8; 64 * 1024];
            let mut left = f.len - c.bytes;
            while left > 0 {
                let want = buf.len().min(left as usize);
                match std::io::Read::read(&mut file, &mut buf[..want]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        c.lines += buf[..n].iter().filter(|b| **b == b'\n').count() as u64;
                        c.bytes += n as u64;
                        left -= n as u64;
                    }
                }
            }
        }
        lost
    }

    /// Complete journal lines past `cur`, as this tail counted them at its last read (its
    /// count covers the files from the cursor's on).
    pub fn lines_after(&self, cur: &Cursor) -> u64 {
        let total: u64 = self.counted.values().map(|c| c.lines).sum();
        total.saturating_sub(cur.line)
    }

    /// Reads from `cur` (moved along), handing each line to `f`; `f` returns false to stop
    /// before that line (it is read again next time). Stops at the journal's end: at a last
    /// line still being written, or at the end of the live file.
    pub fn read(
        &mut self,
        cur: &mut Cursor,
        mut f: impl FnMut(Line) -> bool,
    ) -> Result<Read, JournalError> {
        let mut out = Read::default();
        let files = self.files();
        if files.is_empty() {
            return Ok(out);
        }
        let (mut at, lost) = self.locate(cur, &files);
        let lost = lost.saturating_add(self.count(&files, at, cur.inode));
        if lost > 0 {
            out.dropped = lost;
            cur.seq += lost;
            cur.dropped += lost;
        }
        let mut buf = Vec::new();
        loop {
            let listed = &files[at];
            let last = at + 1 == files.len();
            let file = match open(&listed.path) {
                Ok(f) => f,
                // Rotated between the listing and the open: the next read lists again.
                Err(e) if e.is_not_found() => return Ok(out),
                Err(e) => {
                    return Err(JournalError::Corrupt {
                        path: listed.path.clone(),
                        line: 0,
                        message: e.to_string(),
                    });
                }
            };
            // Fenced: the path must still name the file listed, as long as the cursor says
            // (a rename, truncation or replacement since would put the offset elsewhere).
            let mut file = file;
            match file.metadata() {
                Ok(m) if m.ino() == listed.ino && m.len() >= cur.offset => {}
                _ => return Ok(out),
            }
            file.seek(SeekFrom::Start(cur.offset))
                .map_err(|e| JournalError::io(&listed.path, e))?;
            let mut r = BufReader::new(file);
            loop {
                let line = read_capped_line(
                    &mut r,
                    &mut buf,
                    crate::sys::limits::MAX_JOURNAL_LINE,
                    u64::MAX,
                )
                .map_err(|e| JournalError::io(&listed.path, e))?;
                let Some(line) = line else { break };
                let (record, used) = match line {
                    CappedLine::Text { complete, .. } if !complete && last => {
                        // Being written (or torn until the writer's next open ends it).
                        return Ok(out);
                    }
                    CappedLine::Text { text, complete } => (
                        serde_json::from_str::<Record>(text.trim()).ok(),
                        buf.len() as u64 + u64::from(complete),
                    ),
                    CappedLine::TooLong { len } => (None, len as u64 + 1),
                };
                let blank = record.is_none() && buf.iter().all(u8::is_ascii_whitespace);
                if !blank
                    && !f(Line {
                        seq: cur.seq + 1,
                        record,
                    })
                {
                    out.more = true;
                    return Ok(out);
                }
                cur.offset += used;
                cur.line += 1;
                if !blank {
                    cur.seq += 1;
                }
            }
            if last {
                return Ok(out);
            }
            // This file is passed: on to the next newer one.
            self.counted.remove(&listed.ino);
            let passed = listed.head;
            at += 1;
            *cur = Cursor {
                inode: files[at].ino,
                head: files[at].head,
                offset: 0,
                line: 0,
                passed,
                ..*cur
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::tests::rec;
    use crate::journal::{JsonlWriter, Rotation};
    use std::io::Write;

    fn drain(tail: &mut Tail, cur: &mut Cursor, max: usize) -> (Vec<(u64, u64)>, Read) {
        let mut got = Vec::new();
        let r = tail
            .read(cur, |l| {
                if got.len() == max {
                    return false;
                }
                got.push((l.seq, l.record.map_or(0, |r| r.incident.0)));
                true
            })
            .unwrap();
        (got, r)
    }

    #[test]
    fn follows_rotation_numbers_lines_stably_and_resumes_from_a_saved_cursor() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        let rot = Rotation {
            max_bytes: 400,
            keep: 10,
        };
        let mut w = JsonlWriter::open_rotating(&p, rot).unwrap();
        let mut tail = Tail::new(&p);
        let mut cur = Cursor::default();
        let mut seen = Vec::new();
        for i in 1..=30 {
            w.rotate_if_due().unwrap();
            w.append(&rec(i)).unwrap();
            if i % 7 == 0 {
                let (got, _) = drain(&mut tail, &mut cur, 3);
                seen.extend(got);
                // A restart: the cursor comes back from disk.
                cur.save(&dir.path().join("c.json")).unwrap();
                cur = Cursor::load(&dir.path().join("c.json"));
                tail = Tail::new(&p);
            }
        }
        loop {
            let (got, r) = drain(&mut tail, &mut cur, 4);
            seen.extend(got);
            if !r.more {
                break;
            }
        }
        assert_eq!(seen, (1..=30).map(|i| (i, i)).collect::<Vec<_>>());
        assert_eq!(cur.dropped, 0);
    }

    #[test]
    fn records_rotated_away_before_export_are_counted_and_numbering_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        let rot = Rotation {
            max_bytes: 300,
            keep: 1,
        };
        let mut w = JsonlWriter::open_rotating(&p, rot).unwrap();
        let mut tail = Tail::new(&p);
        let mut cur = Cursor::default();
        w.append(&rec(1)).unwrap();
        let (got, _) = drain(&mut tail, &mut cur, 1);
        assert_eq!(got, [(1, 1)]);
        // More is written while nothing is exported; the tail counts it as it goes.
        let mut dropped = 0;
        for i in 2..=20 {
            w.rotate_if_due().unwrap();
            w.append(&rec(i)).unwrap();
            dropped += drain(&mut tail, &mut cur, 0).1.dropped;
        }
        let (got, r) = drain(&mut tail, &mut cur, 100);
        dropped += r.dropped;
        assert!(dropped > 0);
        assert_eq!(cur.dropped, dropped);
        // Every line has its number: the lost ones' numbers are skipped, none reused.
        let (first_seq, first_id) = got[0];
        assert_eq!(first_seq, first_id, "{got:?}");
        assert_eq!(got.last().unwrap().0, 20);
        assert_eq!(
            first_seq - 2,
            dropped,
            "lines 2..first were lost and counted"
        );
    }

    #[test]
    fn a_line_being_written_is_left_for_later_and_a_bad_line_is_passed_over() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        let mut body = serde_json::to_string(&rec(1)).unwrap();
        body.push_str("\n{not json}\n");
        let partial = serde_json::to_string(&rec(3)).unwrap();
        body.push_str(&partial[..10]);
        std::fs::write(&p, &body).unwrap();
        let mut tail = Tail::new(&p);
        let mut cur = Cursor::default();
        let (got, _) = drain(&mut tail, &mut cur, 10);
        assert_eq!(got, [(1, 1), (2, 0)]);
        let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
        f.write_all(&partial.as_bytes()[10..]).unwrap();
        f.write_all(b"\n").unwrap();
        let (got, _) = drain(&mut tail, &mut cur, 10);
        assert_eq!(got, [(3, 3)]);
    }

    fn append(p: &Path, ids: std::ops::RangeInclusive<u64>) {
        let mut w = JsonlWriter::open(p).unwrap();
        for i in ids {
            w.append(&rec(i)).unwrap();
        }
    }

    /// Everything readable, as (seq, incident) pairs.
    fn all(tail: &mut Tail, cur: &mut Cursor) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        loop {
            let (got, r) = drain(tail, cur, 1000);
            out.extend(got);
            if !r.more {
                return out;
            }
        }
    }

    fn ids(v: &[(u64, u64)]) -> Vec<u64> {
        v.iter().map(|x| x.1).collect()
    }

    #[test]
    fn records_written_after_a_truncation_are_read_once_and_the_loss_is_counted() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        append(&p, 1..=3);
        let mut tail = Tail::new(&p);
        let mut cur = Cursor::default();
        assert_eq!(ids(&all(&mut tail, &mut cur)), [1, 2, 3]);
        // Two more, counted but not read, then the file is truncated in place.
        append(&p, 4..=5);
        assert_eq!(drain(&mut tail, &mut cur, 0).0, []);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(0)
            .unwrap();
        // Nothing yet: the tail notices the file is shorter than the cursor.
        assert_eq!(drain(&mut tail, &mut cur, 100).0, []);
        assert_eq!(cur.dropped, 2, "4 and 5 were lost with the truncation");
        append(&p, 6..=7);
        let got = all(&mut tail, &mut cur);
        assert_eq!(ids(&got), [6, 7]);
        // Numbering goes on past the lost lines: no id is reused.
        assert_eq!(got[0].0, 6);

        // Truncated and written again past the old offset before the tail looked: the first
        // line differs, which tells it apart.
        std::fs::write(&p, "").unwrap();
        append(&p, 100..=110);
        assert_eq!(
            ids(&all(&mut tail, &mut cur)),
            (100..=110).collect::<Vec<_>>()
        );
        assert_eq!(cur.dropped, 2);
    }

    #[test]
    fn a_replaced_live_file_is_read_from_its_start_and_older_files_are_not_read_again() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        let rot = Rotation {
            max_bytes: 200,
            keep: 5,
        };
        let mut w = JsonlWriter::open_rotating(&p, rot).unwrap();
        for i in 1..=6 {
            w.rotate_if_due().unwrap();
            w.append(&rec(i)).unwrap();
        }
        drop(w);
        assert!(crate::journal::journal_files(&p).len() > 1);
        let mut tail = Tail::new(&p);
        let mut cur = Cursor::default();
        assert_eq!(ids(&all(&mut tail, &mut cur)), [1, 2, 3, 4, 5, 6]);
        // Saved and loaded: a restart in between.
        let cp = dir.path().join("c.json");
        cur.save(&cp).unwrap();
        let mut cur = Cursor::load(&cp);
        let mut tail = Tail::new(&p);
        // The live file removed and written again (its inode may well be the old one).
        std::fs::remove_file(&p).unwrap();
        append(&p, 7..=8);
        assert_eq!(ids(&all(&mut tail, &mut cur)), [7, 8]);
        // And replaced by a rename of another file (a new inode).
        let other = dir.path().join("other");
        std::fs::write(&other, "").unwrap();
        append(&other, 9..=9);
        std::fs::rename(&other, &p).unwrap();
        assert_eq!(ids(&all(&mut tail, &mut cur)), [9]);
        assert_eq!(cur.dropped, 0);
    }

    #[test]
    fn copy_truncate_goes_on_in_the_copy_without_a_loss_or_a_repeat() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        append(&p, 1..=4);
        let mut tail = Tail::new(&p);
        let mut cur = Cursor::default();
        assert_eq!(ids(&drain(&mut tail, &mut cur, 2).0), [1, 2]);
        // logrotate copytruncate: copy to NAME.1, truncate NAME, writing goes on in NAME.
        std::fs::copy(&p, crate::journal::rotated_path(&p, 1)).unwrap();
        std::fs::write(&p, "").unwrap();
        append(&p, 5..=6);
        let got = all(&mut tail, &mut cur);
        assert_eq!(ids(&got), [3, 4, 5, 6]);
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [3, 4, 5, 6]);
        assert_eq!(cur.dropped, 0);
        append(&p, 7..=7);
        assert_eq!(ids(&all(&mut tail, &mut cur)), [7]);

        // The same when the cursor had read past what the copy holds.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        append(&p, 1..=2);
        let mut tail = Tail::new(&p);
        let mut cur = Cursor::default();
        assert_eq!(ids(&all(&mut tail, &mut cur)), [1, 2]);
        std::fs::copy(&p, crate::journal::rotated_path(&p, 1)).unwrap();
        append(&p, 3..=3); // between logrotate's copy and its truncation
        assert_eq!(ids(&all(&mut tail, &mut cur)), [3]);
        std::fs::write(&p, "").unwrap();
        append(&p, 4..=4);
        assert_eq!(
            ids(&all(&mut tail, &mut cur)),
            [4],
            "the copy is not read again"
        );
    }

    #[test]
    fn a_journal_file_that_is_not_a_regular_file_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("incidents.jsonl");
        append(&p, 1..=2);
        let rotated = crate::journal::rotated_path(&p, 1);
        crate::sys::limits::mkfifo(&rotated);
        let mut tail = Tail::new(&p);
        let mut cur = Cursor::default();
        // The FIFO is left out (a blocking open would wait for ever); the live file is read.
        assert_eq!(ids(&all(&mut tail, &mut cur)), [1, 2]);
        std::fs::remove_file(&rotated).unwrap();
        std::os::unix::fs::symlink("/dev/zero", &rotated).unwrap();
        assert_eq!(ids(&all(&mut tail, &mut cur)), Vec::<u64>::new());
    }
}
