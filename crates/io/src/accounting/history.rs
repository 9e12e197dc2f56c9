//! The GPU memory history behind `gpu-medic tasks`: per minute, the peak GPU memory of each
//! task definition revision's containers (and of the task as a whole, all its containers and
//! GPUs together, what ECS's placement counts), with the reservation, in
//! `state_dir/gpu-memory.jsonl`, one JSON object a line.
//!
//! Bounded: rows older than `RETENTION` are dropped and the file is rewritten (to a temporary
//! file, fsynced, renamed) whenever it grows past `MAX_FILE`, down to half of it, oldest rows
//! first. A minute's rows are appended once the minute is over (one write and one fsync a
//! minute), and the minute in progress when the daemon stops; a minute written twice (a
//! restart within it) is read as its larger peak. At start a file larger than
//! `MAX_FILE_SET_ASIDE`, or with lines that are not rows, is set aside (renamed
//! `gpu-memory.jsonl.corrupt-<unix ms>`, the newest two kept) with a warning and its readable
//! rows are carried over: nothing is lost, nothing panics, and the history goes on.

use std::collections::BTreeMap;
use std::io::{BufRead, Read, Seek, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::reserve::TaskMemory;

/// How long rows are kept.
pub const RETENTION_SECS: u64 = 3 * 24 * 3600;
/// The file is compacted when it grows past this.
pub const MAX_FILE: u64 = crate::sys::limits::MAX_GPU_MEMORY_HISTORY;
/// A file found larger than this at start is set aside rather than read.
pub const MAX_FILE_SET_ASIDE: u64 = crate::sys::limits::MAX_GPU_MEMORY_HISTORY_READ;
/// The longest line read; a longer one is not a row.
pub const MAX_LINE: usize = crate::sys::limits::MAX_GPU_MEMORY_HISTORY_LINE;
/// The longest family, revision or container name recorded (ECS allows 255 characters).
pub const MAX_NAME: usize = 255;
/// Keys (revision, container) recorded per minute at most.
pub const MAX_KEYS: usize = 1024;
/// Set-aside files kept.
pub const KEEP_SET_ASIDE: usize = 2;

/// One minute's peak of one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Row {
    /// Start of the minute, Unix seconds.
    pub minute: u64,
    pub family: String,
    pub revision: String,
    /// The container; `None` for the task as a whole.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// The largest use seen in the minute (of any one task of this revision), bytes.
    pub peak_bytes: u64,
    /// Its reservation (`sharingStrategy.nvidiaMps.memory`; summed for the task), bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
    /// A container's most GPU processes at once in the minute (`None` for the whole task and
    /// in rows of earlier builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub processes: Option<u32>,
    /// A container's pinned memory limit in force (the largest
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` its clients ran with), bytes, when read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_bytes: Option<u64>,
    /// The largest SM utilization seen in the minute (percent of a GPU's SMs, the processes
    /// summed), when NVML's process utilization was read (absent in rows of earlier builds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_sm_percent: Option<u32>,
    /// A container's active thread percentage in force (the largest its clients ran with),
    /// when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_limit_percent: Option<u32>,
}

type Key = (String, String, Option<String>);

/// One key's minute so far: peak use, reservation, most processes, limit in force, peak SM
/// use and the thread percentage in force.
#[derive(Debug, Default)]
struct Peak {
    bytes: u64,
    reserved: Option<u64>,
    processes: Option<u32>,
    limit: Option<u64>,
    sm: Option<u32>,
    sm_limit: Option<u32>,
}

/// The daemon's side: collects each minute's peaks and appends them.
#[derive(Debug)]
pub struct Writer {
    path: PathBuf,
    minute: Option<u64>,
    peaks: BTreeMap<Key, Peak>,
    size: u64,
    warned: bool,
    /// The path is not a file gpu-medic can keep (a directory, a file it could not set
    /// aside): nothing is written, it was said once at start.
    disabled: bool,
}

impl Writer {
    /// The history in `state_dir`, checked (and set aside if unreadable) once, here.
    pub fn open(state_dir: &Path) -> Writer {
        let path = crate::config::StateDir::new(state_dir).gpu_memory_history();
        let size = check_at_start(&path);
        Writer {
            path,
            minute: None,
            peaks: BTreeMap::new(),
            size: size.unwrap_or(0),
            warned: false,
            disabled: size.is_none(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Takes one poll's tasks seen at `now` (Unix seconds). Tasks the ECS agent has not named
    /// (no family) are not recorded: the report is per task definition.
    pub fn observe(&mut self, tasks: &[TaskMemory], now: u64) {
        let minute = now - now % 60;
        if self.minute.is_some_and(|m| m != minute) {
            self.flush();
        }
        self.minute = Some(minute);
        for t in tasks.iter().filter(|t| !t.family.is_empty()) {
            let task_key = (t.family.clone(), t.revision.clone(), None);
            self.peak(task_key, t.used_bytes, t.reserved_bytes, None);
            self.peak_sm(
                &(t.family.clone(), t.revision.clone(), None),
                t.sm_percent,
                None,
            );
            for c in &t.containers {
                let key = (t.family.clone(), t.revision.clone(), Some(c.name.clone()));
                self.peak(key.clone(), c.used_bytes, c.reserved_bytes, Some(c));
                self.peak_sm(&key, c.sm_percent, c.sm_limit_percent);
            }
        }
    }

    fn peak(
        &mut self,
        key: Key,
        bytes: u64,
        reserved: Option<u64>,
        container: Option<&super::reserve::ContainerMemory>,
    ) {
        if !self.peaks.contains_key(&key) && self.peaks.len() >= MAX_KEYS {
            return;
        }
        // ECS names a family or a container in at most 255 characters: a longer one did not
        // come from ECS, and its row could be longer than the reader takes.
        let too_long = |s: &str| s.len() > MAX_NAME;
        if too_long(&key.0) || too_long(&key.1) || key.2.as_deref().is_some_and(too_long) {
            return;
        }
        let e = self.peaks.entry(key).or_default();
        e.bytes = e.bytes.max(bytes);
        if reserved.is_some() {
            e.reserved = reserved;
        }
        if let Some(c) = container {
            e.processes = Some(e.processes.unwrap_or(0).max(c.processes));
            if c.limit_bytes.is_some() {
                e.limit = c.limit_bytes;
            }
        }
    }

    /// A key's SM use and thread limit (the key was taken, or refused, by [`Writer::peak`]).
    fn peak_sm(&mut self, key: &Key, sm: Option<u32>, limit: Option<u32>) {
        if let Some(e) = self.peaks.get_mut(key) {
            e.sm = e.sm.max(sm);
            if limit.is_some() {
                e.sm_limit = limit;
            }
        }
    }

    /// Appends the minute collected so far (at a minute's end, and when the daemon stops).
    pub fn flush(&mut self) {
        let Some(minute) = self.minute else { return };
        if self.peaks.is_empty() || self.disabled {
            self.peaks.clear();
            return;
        }
        let mut text = String::new();
        for ((family, revision, container), p) in std::mem::take(&mut self.peaks) {
            let row = Row {
                minute,
                family,
                revision,
                container,
                peak_bytes: p.bytes,
                reserved_bytes: p.reserved,
                processes: p.processes,
                limit_bytes: p.limit,
                peak_sm_percent: p.sm,
                sm_limit_percent: p.sm_limit,
            };
            // What is written is what the reader takes: never a line over its cap.
            if let Ok(line) = serde_json::to_string(&row)
                && line.len() < MAX_LINE
            {
                text.push_str(&line);
                text.push('\n');
            }
        }
        match append(&self.path, text.as_bytes()) {
            Ok(()) => {
                self.warned = false;
                self.size = self.size.saturating_add(text.len() as u64);
            }
            Err(e) => {
                if !std::mem::replace(&mut self.warned, true) {
                    tracing::warn!(
                        probe = "nvml",
                        "cannot append to {}: {e}; this minute's GPU memory peaks are not kept",
                        self.path.display()
                    );
                }
            }
        }
        if self.size > MAX_FILE {
            match compact(&self.path, minute) {
                Ok(size) => self.size = size,
                Err(e) => tracing::warn!(
                    probe = "nvml",
                    "cannot compact {}: {e}",
                    self.path.display()
                ),
            }
        }
    }
}

/// The minute in progress is kept when the daemon stops, however the probe's task ends
/// (a return, or an abort at shutdown that drops it).
impl Drop for Writer {
    fn drop(&mut self) {
        self.flush();
    }
}

fn append(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = crate::sys::fs::open_append(path, false)?;
    f.write_all(bytes)?;
    f.sync_data()
}

/// Rewrites the file with the rows of the last `RETENTION_SECS` before `now`, the newest
/// fitting in half of `MAX_FILE`; returns its new size.
fn compact(path: &Path, now: u64) -> std::io::Result<u64> {
    let (mut rows, _) = read_rows(path, MAX_FILE_SET_ASIDE)?;
    let from = now.saturating_sub(RETENTION_SECS);
    rows.retain(|r| r.minute >= from);
    let lines: Vec<String> = rows
        .iter()
        .filter_map(|r| serde_json::to_string(r).ok())
        .collect();
    let mut keep = lines.len();
    let mut size = 0u64;
    for (i, l) in lines.iter().enumerate().rev() {
        if size + l.len() as u64 + 1 > MAX_FILE / 2 {
            break;
        }
        size += l.len() as u64 + 1;
        keep = i;
    }
    let mut text = String::with_capacity(size as usize);
    for l in &lines[keep..] {
        text.push_str(l);
        text.push('\n');
    }
    rewrite(path, text.as_bytes())?;
    Ok(text.len() as u64)
}

fn rewrite(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    // Durable: the compacted history replaces hours of rows that exist nowhere else.
    crate::sys::fs::write_atomic(path, bytes, crate::sys::fs::Durability::Durable)?;
    Ok(())
}

/// At start: an oversized or partly unreadable file is set aside and its rows carried over.
/// Returns the file's size afterwards; `None` when the history cannot be kept there.
fn check_at_start(path: &Path) -> Option<u64> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Some(0);
    };
    if !meta.is_file() {
        tracing::warn!(
            probe = "nvml",
            "{} is not a regular file; GPU memory history is not kept",
            path.display()
        );
        return None;
    }
    let (rows, why) = if meta.len() > MAX_FILE_SET_ASIDE {
        (
            Vec::new(),
            format!(
                "{} bytes, over the {} MiB cap",
                meta.len(),
                MAX_FILE_SET_ASIDE >> 20
            ),
        )
    } else {
        match read_rows(path, MAX_FILE_SET_ASIDE) {
            Ok((_, 0)) => return Some(meta.len()),
            Ok((rows, bad)) => (rows, format!("{bad} line(s) that are not history rows")),
            Err(e) => (Vec::new(), format!("unreadable: {e}")),
        }
    };
    let aside = path.with_extension(format!(
        "jsonl.corrupt-{}",
        crate::model::Timestamp::now().0
    ));
    if let Err(e) = std::fs::rename(path, &aside) {
        tracing::warn!(
            probe = "nvml",
            "{} is {why} and cannot be set aside ({e}); GPU memory history is not kept",
            path.display()
        );
        return None;
    }
    tracing::warn!(
        probe = "nvml",
        "{} was {why}: set aside as {}, {} readable row(s) carried over",
        path.display(),
        aside.display(),
        rows.len()
    );
    prune_set_aside(path);
    let mut text = String::new();
    for r in &rows {
        if let Ok(l) = serde_json::to_string(r) {
            text.push_str(&l);
            text.push('\n');
        }
    }
    match rewrite(path, text.as_bytes()) {
        Ok(()) => Some(text.len() as u64),
        Err(e) => {
            tracing::warn!(probe = "nvml", "cannot write {}: {e}", path.display());
            Some(0)
        }
    }
}

/// Deletes all but the newest `KEEP_SET_ASIDE` set-aside files.
fn prune_set_aside(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return;
    };
    let prefix = format!("{}.corrupt-", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut aside: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            let ms = n.strip_prefix(&prefix)?.parse().ok()?;
            Some((ms, e.path()))
        })
        .collect();
    aside.sort();
    let n = aside.len().saturating_sub(KEEP_SET_ASIDE);
    for (_, p) in aside.into_iter().take(n) {
        let _ = std::fs::remove_file(p);
    }
}

/// Reads the rows of `path`, at most its last `cap` bytes (a larger file's first, partial
/// line is skipped); returns them and how many lines were not rows (over `MAX_LINE`, not
/// JSON, not a row). A missing file has no rows.
pub fn read_rows(path: &Path, cap: u64) -> std::io::Result<(Vec<Row>, usize)> {
    // A FIFO or a device in its place is refused without blocking (it would hang or never
    // end); a larger regular file is read from its last `cap` bytes.
    let mut f = match crate::sys::limits::open_checked(
        path,
        crate::sys::limits::Kind::Regular,
        u64::MAX,
        "GPU memory history",
    ) {
        Ok(f) => f,
        Err(e) if e.is_not_found() => return Ok((Vec::new(), 0)),
        Err(e) => return Err(std::io::Error::other(e.to_string())),
    };
    let len = f.metadata()?.len();
    let skip_first = len > cap;
    if skip_first {
        f.seek(std::io::SeekFrom::Start(len - cap))?;
    }
    let mut r = std::io::BufReader::new(f.take(cap));
    let mut rows = Vec::new();
    let mut bad = 0;
    let mut line = Vec::new();
    let mut first = true;
    loop {
        line.clear();
        let n = (&mut r)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)?;
        if n == 0 {
            break;
        }
        let partial_first = std::mem::replace(&mut first, false) && skip_first;
        if line.last() != Some(&b'\n') && line.len() > MAX_LINE {
            // Over the cap: skip the rest of this line.
            let mut rest = Vec::new();
            loop {
                rest.clear();
                let m = (&mut r)
                    .take(MAX_LINE as u64)
                    .read_until(b'\n', &mut rest)?;
                if m == 0 || rest.last() == Some(&b'\n') {
                    break;
                }
            }
            if !partial_first {
                bad += 1;
            }
            continue;
        }
        if partial_first {
            continue;
        }
        let text = String::from_utf8_lossy(&line);
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        match serde_json::from_str::<Row>(text) {
            Ok(row) => rows.push(row),
            Err(_) => bad += 1,
        }
    }
    Ok((rows, bad))
}

#[cfg(test)]
mod tests {
    use super::*;
    /// The file name the state directory gives the history (`config::StateDir`).
    const FILE: &str = "gpu-memory.jsonl";
    use crate::accounting::reserve::ContainerMemory;

    fn task(family: &str, used: u64, reserved: Option<u64>) -> TaskMemory {
        TaskMemory {
            task: "t1".into(),
            arn: "arn:t1".into(),
            family: family.into(),
            revision: "2".into(),
            used_bytes: used,
            unknown: 0,
            gpus: vec![],
            containers: vec![ContainerMemory {
                name: "app".into(),
                used_bytes: used,
                reserved_bytes: reserved,
                processes: 1,
                limit_bytes: None,
                sm_percent: Some(used.min(100) as u32),
                sm_limit_percent: Some(50),
            }],
            reserved_bytes: reserved,
            over: false,
            sm_percent: Some(used.min(100) as u32),
        }
    }

    #[test]
    fn a_minutes_peak_is_appended_when_the_minute_ends() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Writer::open(dir.path());
        w.observe(&[task("infer", 100, Some(1000))], 120);
        w.observe(&[task("infer", 300, Some(1000))], 150);
        w.observe(&[task("infer", 200, Some(1000)), task("", 999, None)], 179);
        assert!(!w.path().exists(), "nothing before the minute ends");
        w.observe(&[task("infer", 50, Some(1000))], 180);
        let (rows, bad) = read_rows(w.path(), MAX_FILE).unwrap();
        assert_eq!(bad, 0);
        assert_eq!(rows.len(), 2, "the task and its container: {rows:?}");
        assert!(rows.iter().all(|r| r.minute == 120 && r.peak_bytes == 300));
        assert!(rows.iter().any(|r| r.container.as_deref() == Some("app")));
        assert!(
            rows.iter().all(|r| r.peak_sm_percent == Some(100)),
            "the minute's SM peak: {rows:?}"
        );
        let app = rows.iter().find(|r| r.container.is_some()).unwrap();
        assert_eq!(app.sm_limit_percent, Some(50));
        w.flush();
        let (rows, _) = read_rows(w.path(), MAX_FILE).unwrap();
        assert_eq!(rows.len(), 4, "the stop flushes the minute in progress");
    }

    #[test]
    fn a_corrupt_or_oversized_file_is_set_aside_and_its_rows_carried_over() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        let good = r#"{"minute":60,"family":"f","revision":"1","peak_bytes":5}"#;
        std::fs::write(
            &path,
            format!("{good}\nnot json\n{}\n{{\"minute\":1}}\n", "x".repeat(9000)),
        )
        .unwrap();
        let w = Writer::open(dir.path());
        let (rows, bad) = read_rows(w.path(), MAX_FILE).unwrap();
        assert_eq!((rows.len(), bad), (1, 0), "the good row carried over");
        let aside: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().contains(".corrupt-"))
            .collect();
        assert_eq!(aside.len(), 1, "the original is kept for a look");

        // Oversized: set aside unread.
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(MAX_FILE_SET_ASIDE + 1).unwrap();
        let w = Writer::open(dir.path());
        assert_eq!(std::fs::metadata(w.path()).unwrap().len(), 0);
        std::thread::sleep(std::time::Duration::from_millis(2));
        std::fs::write(&path, "junk\n").unwrap();
        let _ = Writer::open(dir.path());
        let n = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().contains(".corrupt-"))
            .count();
        assert_eq!(
            n, KEEP_SET_ASIDE,
            "only the newest set-aside files are kept"
        );
    }

    /// Names no ECS task carries (over 255 bytes; the agent's answer is only capped as a
    /// whole) are not recorded: every row written is one the reader takes back, and the file
    /// is never set aside for what the daemon wrote itself.
    #[test]
    fn what_the_writer_appends_the_reader_takes_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = Writer::open(dir.path());
        let mut long = task("infer", 7, None);
        long.containers[0].name = "c".repeat(3 * MAX_LINE);
        let mut long_family = task(&"f".repeat(MAX_NAME + 1), 7, None);
        long_family.revision = "r".repeat(2 * MAX_LINE);
        w.observe(&[long, long_family, task("ok", 9, None)], 60);
        w.observe(&[], 120);
        let (rows, bad) = read_rows(w.path(), MAX_FILE).unwrap();
        assert_eq!(bad, 0);
        let kept: Vec<(&str, Option<&str>)> = rows
            .iter()
            .map(|r| (r.family.as_str(), r.container.as_deref()))
            .collect();
        assert_eq!(kept, [("infer", None), ("ok", None), ("ok", Some("app"))]);
        let _ = Writer::open(dir.path());
        assert_eq!(
            std::fs::read_dir(dir.path()).unwrap().count(),
            1,
            "nothing set aside"
        );
    }

    /// A FIFO put in place of the history after the start check: the append neither blocks
    /// nor writes into it.
    #[test]
    fn an_append_onto_a_fifo_fails_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        crate::sys::limits::mkfifo(&fifo);
        assert!(append(&fifo, b"{}\n").is_err());
        let _reader =
            crate::sys::limits::open_checked(&fifo, crate::sys::limits::Kind::Stream, 0, "test")
                .unwrap();
        let err = append(&fifo, b"{}\n").unwrap_err();
        assert!(
            err.to_string().contains("a FIFO, not a regular file"),
            "{err}"
        );
    }

    #[test]
    fn a_path_that_is_not_a_file_keeps_no_history_and_does_not_fail() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(FILE)).unwrap();
        let mut w = Writer::open(dir.path());
        w.observe(&[task("infer", 1, None)], 60);
        w.observe(&[task("infer", 1, None)], 120);
        w.flush();
        assert!(w.path().is_dir(), "left as it was");
    }

    #[test]
    fn compaction_keeps_the_file_bounded_and_the_newest_rows() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        let now = 10 * RETENTION_SECS;
        let mut text = String::new();
        text.push_str(&format!(
            "{{\"minute\":{},\"family\":\"old\",\"revision\":\"1\",\"peak_bytes\":1}}\n",
            now - RETENTION_SECS - 60
        ));
        let mut minute = now - RETENTION_SECS + 60;
        while (text.len() as u64) < MAX_FILE + 1000 {
            text.push_str(&format!(
                "{{\"minute\":{minute},\"family\":\"f\",\"revision\":\"1\",\"container\":\"app\",\"peak_bytes\":{minute}}}\n"
            ));
            minute += 1;
        }
        std::fs::write(&path, &text).unwrap();
        let size = compact(&path, now).unwrap();
        assert!(size <= MAX_FILE / 2, "{size}");
        let (rows, bad) = read_rows(&path, MAX_FILE).unwrap();
        assert_eq!(bad, 0);
        assert!(rows.iter().all(|r| r.family == "f"), "expired rows dropped");
        assert_eq!(rows.last().unwrap().minute, minute - 1, "the newest kept");
    }

    #[test]
    fn a_file_over_the_read_cap_is_read_from_its_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE);
        let row = |m: u64| {
            format!("{{\"minute\":{m},\"family\":\"f\",\"revision\":\"1\",\"peak_bytes\":1}}\n")
        };
        let text: String = (0..100).map(row).collect();
        std::fs::write(&path, &text).unwrap();
        let cap = (row(99).len() * 10 + 5) as u64;
        let (rows, bad) = read_rows(&path, cap).unwrap();
        assert_eq!(bad, 0, "the partial first line is skipped, not counted");
        assert_eq!(rows.len(), 10);
        assert_eq!(rows[9].minute, 99);
    }
}
