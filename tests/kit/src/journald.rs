//! Journal files written by the real journald tools: lines (captured from NVIDIA's daemon run
//! with `-f`) become entries of a unit, written in the journal export format and turned into a
//! journal file by `systemd-journal-remote` (Debian package `systemd-journal-remote`), which
//! `journalctl --directory` reads as it reads `/var/log/journal`. Appending to the same file
//! later is what journald does while gpu-medic follows it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// `systemd-journal-remote`, from Debian's package of the same name.
pub fn journal_remote() -> PathBuf {
    for p in [
        "/lib/systemd/systemd-journal-remote",
        "/usr/lib/systemd/systemd-journal-remote",
    ] {
        if Path::new(p).is_file() {
            return PathBuf::from(p);
        }
    }
    panic!(
        "systemd-journal-remote not found: apt-get install systemd-journal-remote (.ci/install-deps.sh)"
    )
}

/// A journal directory with one file, `remote.journal`, entries appended in order.
pub struct JournalDir {
    dir: tempfile::TempDir,
    /// Entries written so far (monotonic stamps continue from it).
    written: u64,
}

impl JournalDir {
    pub fn new() -> JournalDir {
        JournalDir {
            dir: tempfile::tempdir().expect("tempdir"),
            written: 0,
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Appends `lines` as entries of `unit` (as systemd would from the unit's stdout), stamped
    /// now, one microsecond apart.
    pub fn append(&mut self, unit: &str, pid: u32, lines: &[&str]) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_micros() as u64;
        let mut export = Vec::new();
        for l in lines {
            self.written += 1;
            let n = self.written;
            write!(
                export,
                "__REALTIME_TIMESTAMP={}\n__MONOTONIC_TIMESTAMP={}\n_BOOT_ID=5b0c0d3f4e6a4c8e9f2a1b3c4d5e6f70\n_SYSTEMD_UNIT={unit}\n_PID={pid}\nSYSLOG_IDENTIFIER=nvidia-cuda-mps-control\nPRIORITY=6\nMESSAGE={l}\n\n",
                now + n,
                1_000_000 + n
            )
            .expect("write");
        }
        self.write(&export);
    }

    /// Appends kernel records as journald stores what it read from `/dev/kmsg`
    /// (`_TRANSPORT=kernel`, `SYSLOG_FACILITY=0`, the record's own stamp) of boot `boot`
    /// (32 hex digits), and, with `transport` other than `kernel`, entries of that transport
    /// (what `logger -t kernel` makes: `syslog`) with the same text.
    pub fn append_kernel(&mut self, boot: &str, transport: &str, lines: &[&str]) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_micros() as u64;
        let up = crate::proc::uptime_usec();
        let mut export = Vec::new();
        for l in lines {
            self.written += 1;
            let n = self.written;
            let kernel = if transport == "kernel" {
                format!(
                    "_SOURCE_MONOTONIC_TIMESTAMP={}\nSYSLOG_FACILITY=0\n",
                    up + n
                )
            } else {
                "SYSLOG_FACILITY=1\nSYSLOG_IDENTIFIER=kernel\n_PID=4242\n".to_string()
            };
            write!(
                export,
                "__REALTIME_TIMESTAMP={}\n__MONOTONIC_TIMESTAMP={}\n_BOOT_ID={boot}\n_TRANSPORT={transport}\n{kernel}PRIORITY=4\nMESSAGE={l}\n\n",
                now + n,
                up + n
            )
            .expect("write");
        }
        self.write(&export);
    }

    /// Hands entries in the export format to `systemd-journal-remote`, into the directory's
    /// journal file.
    fn write(&self, export: &[u8]) {
        let mut child = Command::new(journal_remote())
            .arg(format!(
                "--output={}",
                self.dir.path().join("remote.journal").display()
            ))
            .arg("-")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("systemd-journal-remote");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(export)
            .expect("feed systemd-journal-remote");
        let out = child.wait_with_output().expect("systemd-journal-remote");
        assert!(
            out.status.success(),
            "systemd-journal-remote: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Default for JournalDir {
    fn default() -> Self {
        JournalDir::new()
    }
}
