//! The files under `state_dir`:
//! - `incidents.jsonl`: every incident record, append-only, fsynced per record;
//! - `inputs.jsonl`: every input the engine consumed, with its time, so that
//!   `gpu-medic policy simulate` can replay exactly what the daemon saw;
//! - `state.json`: the engine's state, written atomically (temp file, fsync, rename).
//!
//! A crash mid-write leaves at most a torn last line. Readers skip it with a warning; writers
//! start the next record on a fresh line. Nothing here is fatal to the reader.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::engine::State;
use crate::error::JournalError;
use crate::model::OperatorRequest;

/// An append-only JSON-lines file.
pub struct JsonlWriter<T> {
    path: PathBuf,
    file: File,
    _t: PhantomData<fn(&T)>,
}

impl<T: Serialize> JsonlWriter<T> {
    pub fn open(path: &Path) -> Result<Self, JournalError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| JournalError::io(dir, e))?;
        }
        let mut file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(path)
            .map_err(|e| JournalError::io(path, e))?;
        // A torn last line (crash mid-write) must not swallow the next record.
        let len = file
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
            }
        }
        Ok(JsonlWriter {
            path: path.to_path_buf(),
            file,
            _t: PhantomData,
        })
    }

    /// Appends one record and waits until it is on disk.
    pub fn append(&mut self, item: &T) -> Result<(), JournalError> {
        let mut line = serde_json::to_vec(item).map_err(|e| JournalError::Corrupt {
            path: self.path.clone(),
            line: 0,
            message: format!("cannot encode record: {e}"),
        })?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|_| self.file.sync_data())
            .map_err(|e| JournalError::io(&self.path, e))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
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

/// Reads a JSON-lines file. A missing file is empty. Unreadable lines (a torn tail, a
/// hand-edited line) are skipped and reported, never fatal.
pub fn read_jsonl<T: DeserializeOwned>(
    path: &Path,
) -> Result<(Vec<T>, Vec<SkippedLine>), JournalError> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((vec![], vec![])),
        Err(e) => return Err(JournalError::io(path, e)),
    };
    let mut items = Vec::new();
    let mut skipped = Vec::new();
    let mut reader = BufReader::new(file);
    let mut buf = Vec::new();
    let mut n = 0;
    loop {
        buf.clear();
        let read = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| JournalError::io(path, e))?;
        if read == 0 {
            break;
        }
        n += 1;
        let complete = buf.last() == Some(&b'\n');
        let text = String::from_utf8_lossy(&buf);
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        match serde_json::from_str::<T>(text) {
            Ok(v) => items.push(v),
            Err(e) => skipped.push(SkippedLine {
                line: n,
                message: if complete {
                    format!("unreadable record skipped: {e}")
                } else {
                    "torn last record (interrupted write) skipped".to_string()
                },
            }),
        }
    }
    Ok((items, skipped))
}

/// Writes the engine state atomically: readers see the old or the new file, never half.
pub fn save_state(path: &Path, state: &State) -> Result<(), JournalError> {
    let dir = path.parent().unwrap_or_else(|| Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| JournalError::io(dir, e))?;
    let tmp = path.with_extension("json.tmp");
    let body = serde_json::to_vec_pretty(state).map_err(|e| JournalError::Corrupt {
        path: path.to_path_buf(),
        line: 0,
        message: format!("cannot encode state: {e}"),
    })?;
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        File::open(dir)?.sync_all()
    };
    write().map_err(|e| JournalError::io(path, e))
}

/// Reads `state.json`; `None` when there is none yet (first start).
pub fn load_state(path: &Path) -> Result<Option<State>, JournalError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(JournalError::io(path, e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| JournalError::Corrupt {
            path: path.to_path_buf(),
            line: e.line(),
            message: format!("state file unreadable: {e}"),
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

/// [`load_state`] for the daemon: an unreadable (corrupt) state file does not keep it from
/// starting. The file is renamed `state.json.corrupt-<unix ms>` (kept for a post-mortem) and
/// `None` is returned with what was done; the caller rebuilds from the journal
/// ([`rebuild_from_journal`]). Errors are only those a restart cannot fix either (the folder
/// cannot be read or written).
pub fn load_state_or_set_aside(
    path: &Path,
    now: crate::model::Timestamp,
) -> Result<(Option<State>, Option<SetAside>), JournalError> {
    match load_state(path) {
        Ok(s) => Ok((s, None)),
        Err(JournalError::Corrupt { message, .. }) => {
            let mut name = path.as_os_str().to_os_string();
            name.push(format!(".corrupt-{}", now.0));
            let moved_to = PathBuf::from(name);
            std::fs::rename(path, &moved_to).map_err(|e| JournalError::io(path, e))?;
            Ok((
                None,
                Some(SetAside {
                    moved_to,
                    why: message,
                }),
            ))
        }
        Err(e) => Err(e),
    }
}

/// The engine state the incident journal implies (see `engine::recover`), reading the file
/// one line at a time; unreadable lines are skipped.
pub fn rebuild_from_journal(
    incidents: &Path,
    now: crate::model::Timestamp,
) -> Result<State, JournalError> {
    let mut rebuild = crate::engine::recover::Rebuild::new();
    let file = match File::open(incidents) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(rebuild.finish(now)),
        Err(e) => return Err(JournalError::io(incidents, e)),
    };
    let mut reader = BufReader::new(file);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| JournalError::io(incidents, e))?;
        if n == 0 {
            break;
        }
        if let Ok(r) = serde_json::from_slice::<crate::model::Record>(&buf) {
            rebuild.add(&r);
        }
    }
    Ok(rebuild.finish(now))
}

/// Where operator requests wait for the daemon (`gpu-medic incidents abort`).
pub fn requests_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("requests")
}

/// Drops a request for the running daemon, written whole (temp file, then rename).
pub fn submit_request(
    state_dir: &Path,
    request: &OperatorRequest,
) -> Result<PathBuf, JournalError> {
    let dir = requests_dir(state_dir);
    std::fs::create_dir_all(&dir).map_err(|e| JournalError::io(&dir, e))?;
    let name = format!(
        "{}-{}.json",
        crate::model::Timestamp::now().0,
        std::process::id()
    );
    let tmp = dir.join(format!(".{name}.tmp"));
    let dst = dir.join(name);
    let body = serde_json::to_vec(request).map_err(|e| JournalError::Corrupt {
        path: dst.clone(),
        line: 0,
        message: format!("cannot encode request: {e}"),
    })?;
    std::fs::write(&tmp, body)
        .and_then(|_| std::fs::rename(&tmp, &dst))
        .map_err(|e| JournalError::io(&dst, e))?;
    Ok(dst)
}

/// Takes the waiting requests, oldest first, deleting each. An unreadable one is renamed
/// `*.bad` and reported, so it is neither lost nor retried forever.
pub fn take_requests(state_dir: &Path) -> Vec<OperatorRequest> {
    let dir = requests_dir(state_dir);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut names: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter(|p| {
            !p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'))
        })
        .collect();
    names.sort();
    let mut out = Vec::new();
    for p in names {
        match std::fs::read(&p)
            .ok()
            .and_then(|b| serde_json::from_slice::<OperatorRequest>(&b).ok())
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
mod tests {
    use super::*;
    use crate::model::{IncidentEvent, IncidentId, IncidentState, Record, Timestamp};

    fn rec(i: u64) -> Record {
        Record {
            at: Timestamp(1_700_000_000_000 + i),
            incident: IncidentId(i),
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
        let mut f = OpenOptions::new().append(true).open(&p).unwrap();
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

    #[test]
    fn state_is_written_atomically_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("state.json");
        assert_eq!(load_state(&p).unwrap(), None);
        let s = State {
            next_incident: 7,
            ..State::default()
        };
        save_state(&p, &s).unwrap();
        assert_eq!(load_state(&p).unwrap(), Some(s));
        assert!(!p.with_extension("json.tmp").exists());
        std::fs::write(&p, "{ not json").unwrap();
        assert!(!load_state(&p).unwrap_err().is_retryable());
    }
}
