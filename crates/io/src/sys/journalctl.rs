//! Entries of the systemd journal, read through `journalctl`: the MPS daemon's lines (under
//! the ECS GPU AMI's `nvidia-mps.service` the daemon runs with `-f` and writes every control
//! and server line to stdout, which systemd hands to journald; nothing reaches
//! `CUDA_MPS_LOG_DIRECTORY`, docs/mps.md#logging-under--f), and the kernel's own records
//! (`_TRANSPORT=kernel`, which only the kernel writes: `[nvml] kmsg = "journald"`). This
//! reader follows one unit's entries, or those matching fields, with
//!
//! ```text
//! journalctl --output=json --follow --no-pager [--unit <unit>] [FIELD=value ...]
//!            [--directory <dir>] (--after-cursor <cursor> --lines=all | --lines=0 | --lines=all)
//! ```
//!
//! as a supervised child: its own process group, `PR_SET_PDEATHSIG=SIGKILL`, killed with the
//! group when the reader is dropped; a child that exits is started again by the caller after
//! the last cursor it handed out. Why `journalctl` and not the sd-journal C API through a
//! crate: `journalctl` is the interface systemd documents and keeps stable (JSON output,
//! cursors, `--after-cursor`; <https://systemd.io/JOURNAL_EXPORT_FORMATS/>), it is present
//! wherever journald is, it handles journal file rotation, vacuuming and cursor seeking
//! itself, and it needs neither libsystemd headers at build time nor FFI and a blocking
//! reader thread in gpu-medic. The cost is one long-lived child process.
//!
//! Bounded: a line of JSON longer than [`MAX_LINE`] is dropped; at most [`QUEUE`] entries
//! wait between polls (the child then blocks on its pipe: nothing is lost, journald keeps
//! the entries). A `MESSAGE` that is not UTF-8 comes as a byte array and is read lossily.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use tokio::io::AsyncReadExt;
use tokio::sync::mpsc;

/// A JSON line longer than this is dropped.
pub const MAX_LINE: usize = 64 * 1024;
/// Entries that may wait between two polls before the reader stops reading its pipe.
pub const QUEUE: usize = 4096;

/// One journal entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The line as its writer wrote it.
    pub message: String,
    /// journald's opaque position of this entry (`__CURSOR`).
    pub cursor: String,
    /// `__REALTIME_TIMESTAMP`, microseconds since the epoch.
    pub realtime_us: u64,
    /// The kernel's fields, which journald sets and no writer can: `_TRANSPORT`, `_BOOT_ID`,
    /// and for a kernel record its own stamp (`_SOURCE_MONOTONIC_TIMESTAMP`, microseconds
    /// after boot), `PRIORITY` and `SYSLOG_FACILITY`.
    pub transport: Option<String>,
    pub boot_id: Option<String>,
    pub monotonic_us: Option<u64>,
    pub priority: Option<u8>,
    pub facility: Option<u8>,
}

/// What to follow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    pub journalctl: PathBuf,
    /// The unit whose entries are followed; empty: any (then `matches` select).
    pub unit: String,
    /// Field matches (`_TRANSPORT=kernel`, `_BOOT_ID=<id>`), all of which an entry meets.
    pub matches: Vec<String>,
    /// Read the journal files in this directory instead of the system journal.
    pub directory: Option<PathBuf>,
    /// Without a cursor, read the journal's history too (`--lines=all`), not only what
    /// comes from now on.
    pub from_start: bool,
}

/// Why the reader could not start; `missing` when trying again cannot help until the
/// binary is installed (a configuration fault, not the daemon's).
#[derive(Debug, thiserror::Error)]
#[error("cannot run {binary}: {message}")]
pub struct SpawnError {
    pub binary: String,
    pub message: String,
    pub missing: bool,
}

/// A running `journalctl --follow`.
pub struct Reader {
    rx: mpsc::Receiver<Entry>,
    child: tokio::process::Child,
    /// The child's process group, killed on drop.
    pgid: Option<i32>,
}

/// Parses one line of `journalctl --output=json`; `None` for anything without a message and
/// a cursor.
pub fn parse_entry(line: &[u8]) -> Option<Entry> {
    let v: serde_json::Value = serde_json::from_slice(line).ok()?;
    let message = match v.get("MESSAGE")? {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(bytes) => {
            let raw: Vec<u8> = bytes
                .iter()
                .filter_map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
                .collect();
            String::from_utf8_lossy(&raw).into_owned()
        }
        _ => return None,
    };
    let cursor = v.get("__CURSOR")?.as_str()?.to_string();
    let text = |k: &str| v.get(k).and_then(|t| t.as_str()).map(str::to_string);
    let number = |k: &str| {
        v.get(k)
            .and_then(|t| t.as_str())
            .and_then(|t| t.parse::<u64>().ok())
    };
    let small = |k: &str| number(k).and_then(|n| u8::try_from(n).ok());
    Some(Entry {
        message,
        cursor,
        realtime_us: number("__REALTIME_TIMESTAMP").unwrap_or(0),
        transport: text("_TRANSPORT"),
        boot_id: text("_BOOT_ID"),
        monotonic_us: number("_SOURCE_MONOTONIC_TIMESTAMP")
            .or_else(|| number("__MONOTONIC_TIMESTAMP")),
        priority: small("PRIORITY"),
        facility: small("SYSLOG_FACILITY"),
    })
}

impl Spec {
    /// The arguments for a follow after `after` (or from now on when `None`).
    pub fn args(&self, after: Option<&str>) -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--output=json".into(),
            "--follow".into(),
            "--no-pager".into(),
        ];
        if !self.unit.is_empty() {
            a.push("--unit".into());
            a.push(self.unit.clone());
        }
        a.extend(self.matches.iter().cloned());
        if let Some(d) = &self.directory {
            a.push("--directory".into());
            a.push(d.display().to_string());
        }
        match after {
            // `--follow` alone shows only the last 10 entries, even after a cursor (systemd
            // 252, seen with the tests' journal files): everything after it is wanted.
            Some(c) => {
                a.push(format!("--after-cursor={c}"));
                a.push("--lines=all".into());
            }
            None if self.from_start => a.push("--lines=all".into()),
            None => a.push("--lines=0".into()),
        }
        a
    }
}

impl Reader {
    /// Starts following `spec` after `after` (a cursor handed out earlier), or from the
    /// journal's end when `None` (history is not replayed).
    pub fn spawn(spec: &Spec, after: Option<&str>) -> Result<Reader, SpawnError> {
        let mut cmd = tokio::process::Command::new(&spec.journalctl);
        cmd.args(spec.args(after))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .env("SYSTEMD_COLORS", "0");
        crate::sys::child::contain(&mut cmd);
        let mut child = cmd.spawn().map_err(|e| SpawnError {
            binary: spec.journalctl.display().to_string(),
            message: e.to_string(),
            missing: matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::PermissionDenied
            ),
        })?;
        let pgid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .filter(|p| *p > 1);
        let (tx, rx) = mpsc::channel(QUEUE);
        if let Some(out) = child.stdout.take() {
            tokio::spawn(pump(out, tx));
        }
        Ok(Reader { rx, child, pgid })
    }

    /// Every entry read since the last call. `Err` once the child has exited and everything
    /// it wrote is handed out (the caller starts a new one after its last cursor).
    pub fn drain(&mut self) -> Result<Vec<Entry>, String> {
        let mut out = Vec::new();
        loop {
            match self.rx.try_recv() {
                Ok(e) => out.push(e),
                Err(mpsc::error::TryRecvError::Empty) => return Ok(out),
                Err(mpsc::error::TryRecvError::Disconnected) => {
                    if !out.is_empty() {
                        return Ok(out);
                    }
                    let status = match self.child.try_wait() {
                        Ok(Some(s)) => s.to_string(),
                        Ok(None) => "closed its output".to_string(),
                        Err(e) => e.to_string(),
                    };
                    return Err(status);
                }
            }
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if let Some(pgid) = self.pgid.take() {
            // SAFETY: kill(2) has no memory-safety preconditions. `-pgid` names the group the
            // child was started in (process_group(0) makes its pid the group id); the child is
            // not reaped before this drop, so the id cannot have been reused.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
        }
    }
}

/// Reads the child's stdout into entries, line by line, each capped at [`MAX_LINE`].
async fn pump(mut out: tokio::process::ChildStdout, tx: mpsc::Sender<Entry>) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut line: Vec<u8> = Vec::new();
    let mut skipping = false;
    loop {
        let n = match out.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut rest = &buf[..n];
        while let Some(i) = rest.iter().position(|b| *b == b'\n') {
            if !std::mem::take(&mut skipping) {
                line.extend_from_slice(&rest[..i]);
                if line.len() <= MAX_LINE
                    && let Some(e) = parse_entry(&line)
                    && tx.send(e).await.is_err()
                {
                    return;
                }
            }
            line.clear();
            rest = &rest[i + 1..];
        }
        if !skipping {
            line.extend_from_slice(rest);
            if line.len() > MAX_LINE {
                line.clear();
                skipping = true;
            }
        }
    }
}

/// The default `journalctl`.
pub fn default_journalctl() -> &'static Path {
    Path::new("journalctl")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_parse_strings_and_byte_arrays_and_skip_the_rest() {
        let e = parse_entry(br#"{"MESSAGE":"[2026-11-30 12:35:32.426 Control 25654] Server 25663 exited with status 1","__CURSOR":"s=a;i=2","__REALTIME_TIMESTAMP":"1796042140264232"}"#).unwrap();
        assert_eq!(e.cursor, "s=a;i=2");
        assert_eq!(e.realtime_us, 1_796_042_140_264_232);
        assert!(e.message.ends_with("status 1"));
        let e = parse_entry(br#"{"MESSAGE":[104,105,255],"__CURSOR":"c"}"#).unwrap();
        assert_eq!(e.message, "hi\u{fffd}");
        for bad in [
            &b""[..],
            b"{",
            b"[]",
            br#"{"MESSAGE":"x"}"#,
            br#"{"__CURSOR":"c"}"#,
            br#"{"MESSAGE":null,"__CURSOR":"c"}"#,
            br#"{"MESSAGE":"x","__CURSOR":7}"#,
        ] {
            assert!(parse_entry(bad).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn follows_after_a_cursor_or_from_the_end() {
        let spec = Spec {
            journalctl: "journalctl".into(),
            unit: "nvidia-mps.service".into(),
            matches: Vec::new(),
            directory: Some("/j".into()),
            from_start: false,
        };
        let a = spec.args(None);
        assert!(a.contains(&"--lines=0".to_string()));
        // The kernel's records: no unit, the matches, this boot's history too.
        let kernel = Spec {
            unit: String::new(),
            matches: vec!["_TRANSPORT=kernel".into(), "_BOOT_ID=ab".into()],
            from_start: true,
            ..spec.clone()
        };
        let k = kernel.args(None);
        assert!(!k.contains(&"--unit".to_string()), "{k:?}");
        assert!(
            k.contains(&"_TRANSPORT=kernel".to_string()) && k.contains(&"--lines=all".to_string()),
            "{k:?}"
        );
        assert!(a.windows(2).any(|w| w[0] == "--directory" && w[1] == "/j"));
        let a = spec.args(Some("s=x;i=3"));
        assert!(a.contains(&"--after-cursor=s=x;i=3".to_string()));
        assert!(
            a.contains(&"--lines=all".to_string()),
            "--follow alone stops at 10"
        );
        assert!(!a.contains(&"--lines=0".to_string()));
    }
}
