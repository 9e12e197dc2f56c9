//! Size caps on everything gpu-medic reads, and the one bounded reader they share. A file
//! that is not what it should be (`/dev/zero` given as a config, a runaway log line, a
//! megabyte of junk in the kernel log) costs at most the cap in memory and gives a clear
//! error or a warning, never a stall or a crash. README.md, "Limits", lists them.

use std::io::Read;
use std::path::Path;

/// A config file (`config.toml`).
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;
/// One policy file (each file of an `extends` chain is capped on its own).
pub const MAX_POLICY_BYTES: u64 = 1024 * 1024;
/// The input of `gpu-medic policy simulate` (a recorded `inputs.jsonl`, streamed).
pub const MAX_SIMULATE_BYTES: u64 = 1024 * 1024 * 1024;
/// One line of a JSON-lines journal (`incidents.jsonl`, `inputs.jsonl`, simulate input).
pub const MAX_JOURNAL_LINE: usize = 1024 * 1024;
/// One kernel-log record. The kernel's own records are at most 1 KiB of text plus a header
/// (`PRINTK_MESSAGE_MAX`); `/dev/kmsg` never hands out more than one record per read.
pub const MAX_KMSG_LINE: usize = 8 * 1024;
/// The state file written by gpu-medic itself (`state.json`); the engine keeps it far below.
pub const MAX_STATE_BYTES: u64 = 64 * 1024 * 1024;
/// The GPU memory history (`gpu-memory.jsonl`) is compacted to half of this when it grows
/// past it.
pub const MAX_GPU_MEMORY_HISTORY: u64 = 16 * 1024 * 1024;
/// A GPU memory history larger than this is set aside at start, and `gpu-medic tasks` reads
/// at most this much of it (its end).
pub const MAX_GPU_MEMORY_HISTORY_READ: u64 = 2 * MAX_GPU_MEMORY_HISTORY;
/// One line of the GPU memory history; a longer one is not a row.
pub const MAX_GPU_MEMORY_HISTORY_LINE: usize = 4 * 1024;

/// Why a capped read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} larger than the {} cap (is this the right file?)", human_bytes(*limit))]
    TooLarge { what: &'static str, limit: u64 },
    #[error("{what} is not UTF-8 text (invalid byte at offset {offset})")]
    NotText { what: &'static str, offset: usize },
    #[error("{what} is a {kind}, not a file (is this the right path?)")]
    NotAFile {
        what: &'static str,
        kind: &'static str,
    },
}

/// A kernel boot id (`/proc/sys/kernel/random/boot_id`) is a 36-character UUID.
const MAX_BOOT_ID_BYTES: u64 = 128;

/// The kernel's boot id, a new one at every boot: the reboot rung tells the boot after a
/// reboot from the one before by it, never by a timer. An empty or oversized file is refused.
pub fn read_boot_id(path: &Path) -> Result<String, String> {
    let text = read_text(path, MAX_BOOT_ID_BYTES, "boot id")
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let id = text.trim();
    if id.is_empty() || id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("{}: not a boot id: {id:?}", path.display()));
    }
    Ok(id.to_string())
}

/// Reads a whole text file of at most `limit` bytes. A bigger file (or an endless device)
/// is refused after reading `limit + 1` bytes.
/// A FIFO, a socket or a directory is refused without blocking (the open does not wait for
/// a writer); a device is read up to the cap like a file.
pub fn read_text(path: &Path, limit: u64, what: &'static str) -> Result<String, ReadError> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|source| ReadError::Io { what, source })?;
    let kind = file
        .metadata()
        .map_err(|source| ReadError::Io { what, source })?
        .file_type();
    let refused = if kind.is_fifo() {
        Some("FIFO")
    } else if kind.is_socket() {
        Some("socket")
    } else if kind.is_dir() {
        Some("directory")
    } else {
        None
    };
    if let Some(kind) = refused {
        return Err(ReadError::NotAFile { what, kind });
    }
    let mut buf = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|source| ReadError::Io { what, source })?;
    if buf.len() as u64 > limit {
        return Err(ReadError::TooLarge { what, limit });
    }
    String::from_utf8(buf).map_err(|e| ReadError::NotText {
        what,
        offset: e.utf8_error().valid_up_to(),
    })
}

/// Formats a byte count for messages (`1 MiB`, `512 KiB`, `17 bytes`).
pub fn human_bytes(n: u64) -> String {
    const K: u64 = 1024;
    if n >= K * K * K && n.is_multiple_of(K * K * K) {
        format!("{} GiB", n / (K * K * K))
    } else if n >= K * K && n.is_multiple_of(K * K) {
        format!("{} MiB", n / (K * K))
    } else if n >= K && n.is_multiple_of(K) {
        format!("{} KiB", n / K)
    } else {
        format!("{n} bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_file_is_refused_at_the_cap() {
        let err = read_text(Path::new("/dev/zero"), 4096, "config").unwrap_err();
        assert!(
            matches!(err, ReadError::TooLarge { limit: 4096, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("4 KiB cap"), "{err}");
    }

    #[test]
    fn a_fifo_or_a_directory_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that lives across the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // No writer: a blocking open would wait for ever.
        let err = read_text(&fifo, 64, "boot id").unwrap_err();
        assert!(
            matches!(err, ReadError::NotAFile { kind: "FIFO", .. }),
            "{err}"
        );
        let err = read_text(dir.path(), 64, "config").unwrap_err();
        assert!(
            matches!(
                err,
                ReadError::NotAFile {
                    kind: "directory",
                    ..
                }
            ),
            "{err}"
        );
        let err = read_text(Path::new("/dev/urandom"), 64, "boot id").unwrap_err();
        assert!(matches!(err, ReadError::TooLarge { .. }), "{err}");
    }

    #[test]
    fn text_within_the_cap_is_read_and_bad_bytes_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, "a = 1\n").unwrap();
        assert_eq!(read_text(&p, 6, "config").unwrap(), "a = 1\n");
        assert!(matches!(
            read_text(&p, 5, "config"),
            Err(ReadError::TooLarge { .. })
        ));
        std::fs::write(&p, b"ab\xffcd").unwrap();
        let err = read_text(&p, 100, "policy").unwrap_err();
        assert!(matches!(err, ReadError::NotText { offset: 2, .. }), "{err}");
        assert!(matches!(
            read_text(&dir.path().join("missing"), 10, "policy"),
            Err(ReadError::Io { .. })
        ));
        assert_eq!(human_bytes(1024 * 1024), "1 MiB");
        assert_eq!(human_bytes(17), "17 bytes");
    }
}
