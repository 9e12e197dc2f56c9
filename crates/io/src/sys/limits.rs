//! Size caps on everything gpu-medic reads, and the one bounded reader they share. A file
//! that is not what it should be (`/dev/zero` given as a config, a runaway log line, a
//! megabyte of junk in the kernel log) costs at most the cap in memory and gives a clear
//! error or a warning, never a stall or a crash. docs/operations.md, "Limits", lists them.

use std::io::Read;
use std::path::Path;

/// A config file (`config.toml`).
pub const MAX_CONFIG_BYTES: u64 = 1024 * 1024;
/// One policy file (each file of an `extends` chain is capped on its own).
pub const MAX_POLICY_BYTES: u64 = 1024 * 1024;
/// The input of `gpu-medic policy simulate` (a recorded `inputs.jsonl`, streamed).
pub const MAX_SIMULATE_BYTES: u64 = 1024 * 1024 * 1024;
pub use gpu_medic_core::limits::MAX_JOURNAL_LINE;
/// One kernel-log record. The kernel's own records are at most 1 KiB of text plus a header
/// (`PRINTK_MESSAGE_MAX`); `/dev/kmsg` never hands out more than one record per read.
pub const MAX_KMSG_LINE: usize = 8 * 1024;
/// The state file written by gpu-medic itself (`state.json`). The engine keeps it far below:
/// every collection in it is bounded (`State::check_ranges`); at their bounds (1,024 windows
/// of 64 sightings, 256 repeat classes, 32 cursors) it is under 4 MiB. A larger file was not
/// written by the engine, and parsing it would cost several times its size in memory.
pub const MAX_STATE_BYTES: u64 = 16 * 1024 * 1024;
/// The GPU memory history (`gpu-memory.jsonl`) is compacted to half of this when it grows
/// past it.
pub const MAX_GPU_MEMORY_HISTORY: u64 = 16 * 1024 * 1024;
/// A GPU memory history larger than this is set aside at start, and `gpu-medic tasks` reads
/// at most this much of it (its end).
pub const MAX_GPU_MEMORY_HISTORY_READ: u64 = 2 * MAX_GPU_MEMORY_HISTORY;
/// One line of the GPU memory history; a longer one is not a row.
pub const MAX_GPU_MEMORY_HISTORY_LINE: usize = 4 * 1024;

/// One operator request file (`state_dir/requests/*.json`).
pub const MAX_REQUEST_BYTES: u64 = 64 * 1024;
/// The kernel log as `check` reads it once (the ring buffer is at most a few MiB).
pub const MAX_KMSG_SCAN: u64 = 64 * 1024 * 1024;

/// What a path must be before gpu-medic reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A regular file (a symlink to one is followed).
    Regular,
    /// A regular file, or the kernel log device (`/dev/kmsg`, character device 1:11).
    RegularOrKmsg,
    /// A regular file, a FIFO or a character device: a stream the reader caps by itself
    /// (`policy simulate`'s input may come from a pipe).
    Stream,
}

/// Major and minor number of `/dev/kmsg` (Linux `Documentation/admin-guide/devices.txt`).
pub const KMSG_DEVICE: (u32, u32) = (1, 11);

/// The major number of the kernel's memory devices (`/dev/mem`, `/dev/null`, `/dev/zero`,
/// `/dev/urandom`, `/dev/kmsg`, ...; Linux `Documentation/admin-guide/devices.txt`).
const MEMORY_DEVICES: u32 = 1;
/// `/dev/null`: an input that ends at once.
const NULL_DEVICE: (u32, u32) = (1, 3);

/// What a file type is, in words, for messages.
pub fn kind_name(ft: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if ft.is_file() {
        "a regular file"
    } else if ft.is_dir() {
        "a directory"
    } else if ft.is_fifo() {
        "a FIFO"
    } else if ft.is_socket() {
        "a socket"
    } else if ft.is_block_device() {
        "a block device"
    } else if ft.is_char_device() {
        "a character device"
    } else if ft.is_symlink() {
        "a symbolic link"
    } else {
        "not a plain file"
    }
}

/// Whether an open file is what `kind` asks for; the reason when not.
fn check_kind(meta: &std::fs::Metadata, kind: Kind) -> Result<(), String> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let ft = meta.file_type();
    let ok = match kind {
        Kind::Regular => ft.is_file(),
        Kind::RegularOrKmsg => {
            ft.is_file()
                || (ft.is_char_device()
                    && (libc::major(meta.rdev()), libc::minor(meta.rdev())) == KMSG_DEVICE)
        }
        // A terminal or `/dev/null` is a stream that ends; the kernel's memory devices
        // (`/dev/zero`, `/dev/urandom`, `/dev/mem`, ..., major 1) other than `/dev/null`
        // never end or are no input at all.
        Kind::Stream => {
            ft.is_file()
                || ft.is_fifo()
                || (ft.is_char_device()
                    && (libc::major(meta.rdev()) != MEMORY_DEVICES
                        || (libc::major(meta.rdev()), libc::minor(meta.rdev())) == NULL_DEVICE))
        }
    };
    if ok {
        return Ok(());
    }
    let want = match kind {
        Kind::Regular => "a regular file",
        Kind::RegularOrKmsg => "a regular file or the kernel log device (/dev/kmsg)",
        Kind::Stream => "a regular file, a pipe or a terminal",
    };
    let is = if ft.is_char_device() {
        format!(
            "character device {}:{}",
            libc::major(meta.rdev()),
            libc::minor(meta.rdev())
        )
    } else {
        kind_name(ft).to_string()
    };
    Err(format!("is {is}, not {want}"))
}

/// Opens `path` for reading without blocking (a FIFO without a writer would wait forever),
/// and checks it is what `kind` asks for and, for a regular file, at most `limit` bytes,
/// before anything is read. The file is handed back in blocking mode.
pub fn open_checked(
    path: &Path,
    kind: Kind,
    limit: u64,
    what: &'static str,
) -> Result<std::fs::File, ReadError> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    // Looked at before it is opened: opening a device can act by itself (a watchdog is armed
    // by its open), and a path that names the wrong kind of file is refused unopened. The
    // opened file is checked again below, so a swap between the two is caught too.
    if let Ok(meta) = std::fs::metadata(path) {
        check_kind(&meta, kind).map_err(|why| ReadError::NotAFile { what, why })?;
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY)
        .open(path)
        .map_err(|source| ReadError::Io { what, source })?;
    let meta = file
        .metadata()
        .map_err(|source| ReadError::Io { what, source })?;
    check_kind(&meta, kind).map_err(|why| ReadError::NotAFile { what, why })?;
    if meta.is_file() && meta.len() > limit {
        return Err(ReadError::TooLarge { what, limit });
    }
    // SAFETY: F_GETFL/F_SETFL on a descriptor this function owns; no memory is passed.
    unsafe {
        let fd = file.as_raw_fd();
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK);
        }
    }
    Ok(file)
}

/// Whether `path` names what `kind` asks for, following symlinks, without opening it (for
/// paths handed to a library that opens them itself: `dlopen` of a FIFO would hang). A
/// missing path is `Ok` (the library reports it).
pub fn check_path_kind(path: &Path, kind: Kind) -> Result<(), String> {
    match std::fs::metadata(path) {
        Ok(m) => check_kind(&m, kind),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.to_string()),
    }
}

/// Moves whatever is at `path` out of the way when it is not a regular file (a directory, a
/// FIFO, a device, a symlink to one of those, a dangling or looping symlink, left where
/// gpu-medic keeps its own file), as `NAME.bad-<unix ms>`; returns where it went. A missing
/// path, a regular file or a symlink to one (as [`Kind::Regular`] follows it) stays.
pub fn set_aside_unless_regular(path: &Path) -> std::io::Result<Option<std::path::PathBuf>> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_file() => Ok(None),
        Ok(m)
            if m.file_type().is_symlink() && std::fs::metadata(path).is_ok_and(|t| t.is_file()) =>
        {
            Ok(None)
        }
        Ok(m) => {
            let mut name = path.as_os_str().to_os_string();
            // Unix milliseconds, read here: `sys` sits below `model` (src/lib.rs, "Layers").
            let ms = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis());
            name.push(format!(".bad-{ms}"));
            let to = std::path::PathBuf::from(name);
            std::fs::rename(path, &to)?;
            tracing::error!(path = %path.display(), moved_to = %to.display(), "{} was {}; set aside", path.display(), kind_name(m.file_type()));
            Ok(Some(to))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

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
    #[error("{what} {why}")]
    NotAFile { what: &'static str, why: String },
}

impl ReadError {
    /// Whether the path holds nothing (a first start), as opposed to something unreadable.
    pub fn is_not_found(&self) -> bool {
        matches!(self, ReadError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound)
    }
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

/// Reads a whole text file of at most `limit` bytes. Anything but a regular file (a FIFO, a
/// socket, a directory, a device such as `/dev/zero`) is refused without blocking, by
/// [`open_checked`]; a file that grows past the cap while read is refused after
/// `limit + 1` bytes.
pub fn read_text(path: &Path, limit: u64, what: &'static str) -> Result<String, ReadError> {
    let buf = read_bytes(path, limit, limit, what)?;
    String::from_utf8(buf).map_err(|e| ReadError::NotText {
        what,
        offset: e.utf8_error().valid_up_to(),
    })
}

/// Reads a kernel pseudo-file (`/proc`, `/sys`) of at most `limit` bytes. Their sizes say
/// nothing (`/proc` files report 0 bytes, a sysfs attribute the page size), so the cap is
/// applied to what is read, never to the size `stat` reports; and bytes that are not UTF-8
/// (a process may name itself, or a cgroup, with any bytes) become U+FFFD instead of failing
/// the read: a live process must never read as gone because of its name.
pub fn read_pseudo(path: &Path, limit: u64, what: &'static str) -> Result<String, ReadError> {
    let buf = read_bytes(path, u64::MAX, limit, what)?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// The first `max` bytes of a regular file (a pseudo-file's head: `/proc/<pid>/cmdline` of
/// megabytes, of which only `argv[0]` is wanted), whatever its size.
pub fn read_head(path: &Path, max: u64, what: &'static str) -> Result<Vec<u8>, ReadError> {
    let file = open_checked(path, Kind::Regular, u64::MAX, what)?;
    let mut buf = Vec::new();
    file.take(max)
        .read_to_end(&mut buf)
        .map_err(|source| ReadError::Io { what, source })?;
    Ok(buf)
}

/// A whole regular file stated at most `stated` bytes, read to at most `limit` bytes (a file
/// that grows past it while read is refused after `limit + 1`).
fn read_bytes(
    path: &Path,
    stated: u64,
    limit: u64,
    what: &'static str,
) -> Result<Vec<u8>, ReadError> {
    let file = open_checked(path, Kind::Regular, stated, what)?;
    let mut buf = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut buf)
        .map_err(|source| ReadError::Io { what, source })?;
    if buf.len() as u64 > limit {
        return Err(ReadError::TooLarge { what, limit });
    }
    Ok(buf)
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

/// Makes a FIFO at `path` (tests: a reader of it must never block).
#[cfg(test)]
pub fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap_or_default();
    // SAFETY: `c` is a valid NUL-terminated path that lives across the call.
    let made = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(made, 0, "mkfifo {}", path.display());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_file_is_refused_before_it_is_read() {
        let err = read_text(Path::new("/dev/zero"), 4096, "config").unwrap_err();
        assert!(
            err.to_string()
                .contains("character device 1:5, not a regular file"),
            "{err}"
        );
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        crate::sys::limits::mkfifo(&fifo);
        let err = read_text(&fifo, 4096, "state file").unwrap_err();
        assert!(err.to_string().contains("is a FIFO"), "{err}");
        let err = read_text(dir.path(), 4096, "state file").unwrap_err();
        assert!(matches!(err, ReadError::NotAFile { .. }), "{err}");
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'a'; 5000]).unwrap();
        let err = read_text(&big, 4096, "config").unwrap_err();
        assert!(err.to_string().contains("4 KiB cap"), "{err}");
        let lp = dir.path().join("loop");
        std::os::unix::fs::symlink(&lp, &lp).unwrap();
        assert!(read_text(&lp, 4096, "config").is_err());
        assert!(check_path_kind(&fifo, Kind::Regular).is_err());
        assert!(check_path_kind(Path::new("/dev/zero"), Kind::RegularOrKmsg).is_err());
        assert!(check_path_kind(&big, Kind::RegularOrKmsg).is_ok());
        assert_eq!(set_aside_unless_regular(&big).unwrap(), None);
        let aside = set_aside_unless_regular(&fifo).unwrap().unwrap();
        assert!(!fifo.exists() && aside.exists());
    }

    #[test]
    fn a_fifo_or_a_directory_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        crate::sys::limits::mkfifo(&fifo);
        // No writer: a blocking open would wait for ever.
        let err = read_text(&fifo, 64, "boot id").unwrap_err();
        assert!(
            matches!(&err, ReadError::NotAFile { why, .. } if why.starts_with("is a FIFO, not")),
            "{err}"
        );
        let err = read_text(dir.path(), 64, "config").unwrap_err();
        assert!(
            matches!(&err, ReadError::NotAFile { why, .. } if why.starts_with("is a directory, not")),
            "{err}"
        );
        let err = read_text(Path::new("/dev/urandom"), 64, "boot id").unwrap_err();
        assert!(matches!(err, ReadError::NotAFile { .. }), "{err}");
    }

    #[test]
    fn a_stream_may_be_a_pipe_or_dev_null_but_never_an_endless_device() {
        for dev in ["/dev/zero", "/dev/urandom", "/dev/full"] {
            let err = open_checked(Path::new(dev), Kind::Stream, 10, "input").unwrap_err();
            assert!(
                err.to_string()
                    .contains("not a regular file, a pipe or a terminal"),
                "{dev}: {err}"
            );
        }
        assert!(open_checked(Path::new("/dev/null"), Kind::Stream, 10, "input").is_ok());
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        crate::sys::limits::mkfifo(&fifo);
        // Opened without blocking; no writer: the read ends at once.
        let mut f = open_checked(&fifo, Kind::Stream, 10, "input").unwrap();
        let mut buf = Vec::new();
        assert_eq!(f.read_to_end(&mut buf).unwrap(), 0);
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

    /// A sysfs attribute reports the page size and a `/proc` file 0 bytes: neither is what
    /// it holds, so the pseudo-file reader caps what it reads; a name that is not UTF-8 is
    /// read with U+FFFD, never refused (a process may call itself anything).
    #[test]
    fn pseudo_files_are_capped_by_what_is_read_not_by_their_stated_size() {
        let attr = Path::new("/sys/class/net/lo/mtu");
        if attr.exists() {
            assert!(std::fs::metadata(attr).unwrap().len() > 64);
            assert!(matches!(
                read_text(attr, 64, "sysfs"),
                Err(ReadError::TooLarge { .. })
            ));
            let mtu = read_pseudo(attr, 64, "sysfs").unwrap();
            assert!(mtu.trim().parse::<u32>().is_ok(), "{mtu:?}");
        }
        let status = read_pseudo(Path::new("/proc/self/status"), 64 << 10, "status").unwrap();
        assert!(status.contains("State:"), "{status}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("comm");
        std::fs::write(&p, b"ab\xffcd\n").unwrap();
        assert_eq!(read_pseudo(&p, 100, "comm").unwrap(), "ab\u{fffd}cd\n");
        std::fs::write(&p, vec![b'a'; 101]).unwrap();
        assert!(matches!(
            read_pseudo(&p, 100, "comm"),
            Err(ReadError::TooLarge { .. })
        ));
        for bad in ["/dev/zero", "/dev/urandom"] {
            assert!(read_pseudo(Path::new(bad), 100, "comm").is_err(), "{bad}");
        }
    }
}
