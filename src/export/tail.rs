//! Following `incidents.jsonl` across its rotations from a saved cursor.
//!
//! A cursor names a journal file by its inode (rotation renames `NAME` to `NAME.1`, so the
//! inode follows the file), a byte offset in it, and `seq`: how many journal lines came
//! before, counted since the first export, which numbers every record the same way however
//! often it is read again (the record id is built from it). A cursor is saved only after
//! what it passed over was acknowledged, so after a crash the last batch is read and sent
//! again: at least once.
//!
//! A file rotated away (deleted past `keep_files`) before the cursor reached its end loses
//! the lines the cursor had not passed: the tail counts them (it keeps a line count of every
//! file not yet passed, read incrementally) and carries on with the oldest file left.

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
    /// by a new file, which this tells apart.
    #[serde(default)]
    pub head: u64,
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
    /// inode → (bytes counted, lines counted), for the files the cursor has not passed.
    counted: HashMap<u64, (u64, u64)>,
    /// inode → hash of its first line, as last seen.
    heads: HashMap<u64, u64>,
}

/// FNV-1a of a file's first line (at most 256 bytes); 0 while it has no complete line.
fn head_hash(p: &Path) -> u64 {
    let mut buf = [0u8; 256];
    let n = File::open(p)
        .and_then(|mut f| std::io::Read::read(&mut f, &mut buf))
        .unwrap_or(0);
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
            heads: HashMap::new(),
        }
    }

    /// The journal's files, oldest first, with their inodes and sizes. A file whose first
    /// line differs from the one `heads` knows for its inode is another file (the inode was
    /// reused): the old one is recorded as gone under a key no file has.
    fn files(&mut self, cur: &mut Cursor) -> Vec<(PathBuf, u64, u64)> {
        let mut out = Vec::new();
        for p in journal_files(&self.path) {
            let Ok(m) = std::fs::metadata(&p) else {
                continue;
            };
            let (ino, head) = (m.ino(), head_hash(&p));
            if head != 0 {
                if let Some(known) = self.heads.get(&ino).copied()
                    && known != 0
                    && known != head
                {
                    // The inode now names a new file: the old one was deleted.
                    let gone = u64::MAX - ino;
                    if let Some(c) = self.counted.remove(&ino) {
                        self.counted.insert(gone, c);
                    }
                    if cur.inode == ino {
                        cur.inode = gone;
                    }
                }
                self.heads.insert(ino, head);
                if cur.inode == ino && cur.head == 0 {
                    cur.head = head;
                }
            }
            out.push((p, ino, m.len()));
        }
        out
    }

    /// Counts the lines of every file at or after the cursor's (only bytes not counted yet
    /// are read), so a file rotated away can be accounted for.
    fn count(&mut self, files: &[(PathBuf, u64, u64)], from: usize) {
        let live: Vec<u64> = files[from..].iter().map(|f| f.1).collect();
        self.counted.retain(|ino, _| live.contains(ino));
        for (p, ino, len) in &files[from..] {
            let (done, lines) = self.counted.entry(*ino).or_insert((0, 0));
            if *done >= *len {
                continue;
            }
            let Ok(mut f) = File::open(p) else { continue };
            if f.seek(SeekFrom::Start(*done)).is_err() {
                continue;
            }
            let mut buf = [0u8; 64 * 1024];
            let mut left = *len - *done;
            while left > 0 {
                let want = buf.len().min(left as usize);
                match std::io::Read::read(&mut f, &mut buf[..want]) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        *lines += buf[..n].iter().filter(|b| **b == b'\n').count() as u64;
                        *done += n as u64;
                        left -= n as u64;
                    }
                }
            }
        }
    }

    /// The cursor's file (and maybe more) was rotated away before it was passed: counts
    /// the records lost with it, warns once, and moves the cursor to the oldest file left.
    fn skip_rotated(&mut self, cur: &mut Cursor, files: &[(PathBuf, u64, u64)]) -> u64 {
        let lost: u64 = self
            .counted
            .iter()
            .filter(|(ino, _)| !files.iter().any(|f| f.1 == **ino))
            .map(|(ino, (_, lines))| {
                if *ino == cur.inode {
                    lines.saturating_sub(cur.line)
                } else {
                    *lines
                }
            })
            .sum();
        tracing::warn!(
            lost,
            "journal records rotated away before they were exported (raise [journal] max_file_size_mib or keep_files)"
        );
        cur.seq += lost;
        cur.dropped += lost;
        *cur = Cursor {
            inode: files[0].1,
            head: self.heads.get(&files[0].1).copied().unwrap_or(0),
            ..*cur
        };
        cur.offset = 0;
        cur.line = 0;
        lost
    }

    /// Complete journal lines past `cur`, as this tail counted them at its last read (its
    /// count covers the files from the cursor's on).
    pub fn lines_after(&self, cur: &Cursor) -> u64 {
        let total: u64 = self.counted.values().map(|(_, lines)| *lines).sum();
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
        if cur.inode != 0 && cur.head != 0 {
            self.heads.entry(cur.inode).or_insert(cur.head);
        }
        let mut files = self.files(cur);
        if files.is_empty() {
            return Ok(out);
        }
        let mut at = match files.iter().position(|f| f.1 == cur.inode) {
            Some(i) => i,
            None if cur.inode == 0 => 0,
            None => {
                out.dropped = self.skip_rotated(cur, &files);
                0
            }
        };
        if cur.inode == 0 {
            cur.inode = files[0].1;
            cur.head = self.heads.get(&cur.inode).copied().unwrap_or(0);
        }
        self.count(&files, at);
        let mut buf = Vec::new();
        loop {
            let (path, ino, _) = files[at].clone();
            let last = at + 1 == files.len();
            let mut file = match File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // Rotated between the listing and the open: list again.
                    files = self.files(cur);
                    match files.iter().position(|f| f.1 == ino) {
                        Some(i) => {
                            at = i;
                            continue;
                        }
                        None => return Ok(out),
                    }
                }
                Err(e) => return Err(JournalError::io(&path, e)),
            };
            file.seek(SeekFrom::Start(cur.offset))
                .map_err(|e| JournalError::io(&path, e))?;
            let mut r = BufReader::new(file);
            loop {
                let line = read_capped_line(
                    &mut r,
                    &mut buf,
                    crate::sys::limits::MAX_JOURNAL_LINE,
                    u64::MAX,
                )
                .map_err(|e| JournalError::io(&path, e))?;
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
            self.counted.remove(&ino);
            at += 1;
            *cur = Cursor {
                inode: files[at].1,
                head: self.heads.get(&files[at].1).copied().unwrap_or(0),
                offset: 0,
                line: 0,
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
}
