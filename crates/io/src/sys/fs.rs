//! The one atomic file write, and the one open for appending. Every file gpu-medic rewrites in place (its state, cursors,
//! status files, requests) goes through [`write_atomic`]: the bytes go to a temporary file
//! beside the target, which is then renamed over it, so a reader sees the old file or the
//! new one, never half of either, and a value that cannot be serialised never touches the
//! disk (the caller serialises first).
//!
//! How much a write survives is the caller's explicit choice ([`Durability`]), with the
//! reason at the call site: a restart resumes from some files (they must survive a power
//! loss), while status files are rebuilt on the next reading and may come back old.
//!
//! Files gpu-medic appends to (its journals, the GPU memory history) are opened by
//! [`open_append`]: without blocking, and only onto a regular file.

use std::io::Write;
use std::path::{Path, PathBuf};

/// What a finished [`write_atomic`] survives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// A power loss or kernel crash right after the call: the file's data and the
    /// directory entry are both synced. For what a restart resumes from (`state.json`,
    /// cursors, requests an operator is waiting on).
    Durable,
    /// A crash of gpu-medic, not of the machine: the rename is atomic, nothing is synced,
    /// so after a power loss the old version (or none) may be seen. For status files that
    /// the next reading rewrites anyway.
    Atomic,
}

/// The mode of every file gpu-medic creates: its own only.
pub const PRIVATE_FILE: u32 = 0o600;
/// The mode of every folder gpu-medic creates.
pub const PRIVATE_DIR: u32 = 0o700;

/// Creates `dir` and its missing parents, each new one 0700 whatever the umask.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(PRIVATE_DIR)
        .create(dir)
}

/// Makes the state directory private: created 0700 if missing, else its mode narrowed to
/// 0700, and the regular files directly in it (and in its folders, one level down) narrowed
/// to 0600 (a state directory made by an older run, or under a looser umask). Symlinks are
/// left alone: they are not followed.
pub fn make_private(state_dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    create_private_dir(state_dir)?;
    std::fs::set_permissions(state_dir, std::fs::Permissions::from_mode(PRIVATE_DIR))?;
    let narrow = |p: &Path, m: &std::fs::Metadata, mode: u32| {
        if m.permissions().mode() & 0o077 != 0 {
            let _ = std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode));
        }
    };
    for e in std::fs::read_dir(state_dir)?
        .filter_map(Result::ok)
        .take(4096)
    {
        let p = e.path();
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if m.is_file() {
            narrow(&p, &m, PRIVATE_FILE);
        } else if m.is_dir() {
            narrow(&p, &m, PRIVATE_DIR);
            let Ok(rd) = std::fs::read_dir(&p) else {
                continue;
            };
            for f in rd.filter_map(Result::ok).take(4096) {
                let q = f.path();
                if let Ok(n) = std::fs::symlink_metadata(&q) {
                    if n.is_file() {
                        narrow(&q, &n, PRIVATE_FILE);
                    } else if n.is_dir() {
                        narrow(&q, &n, PRIVATE_DIR);
                    }
                }
            }
        }
    }
    Ok(())
}

/// Opens `path` for appending (created if missing; also for reading with `read`) without
/// blocking (a FIFO put in its place has no reader and would hold the writer for ever), and
/// only onto a regular file: anything else is refused, naming what it is.
pub fn open_append(path: &Path, read: bool) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .read(read)
        .append(true)
        .mode(PRIVATE_FILE)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        return Err(std::io::Error::other(format!(
            "{} is {}, not a regular file",
            path.display(),
            crate::sys::limits::kind_name(kind)
        )));
    }
    Ok(file)
}

/// The temporary file a write of `path` goes through: `.<name>.tmp` in the same folder
/// (a rename stays within one file system).
pub fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.tmp"))
}

/// Replaces `path` with `bytes` atomically, creating its folder if needed. A leftover
/// temporary file of a crashed write is replaced; anything else standing at the temporary's
/// path (a directory) is not gpu-medic's to delete, and the write fails naming it.
pub fn write_atomic(path: &Path, bytes: &[u8], durability: Durability) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    create_private_dir(dir)?;
    let tmp = temp_path(path);
    match std::fs::symlink_metadata(&tmp) {
        Ok(m) if m.is_dir() => {
            return Err(std::io::Error::other(format!(
                "{} is a directory in the way of the write",
                tmp.display()
            )));
        }
        Ok(_) => std::fs::remove_file(&tmp)?,
        Err(_) => {}
    }
    let result = (|| {
        let mut f = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(PRIVATE_FILE)
                .open(&tmp)?
        };
        f.write_all(bytes)?;
        if durability == Durability::Durable {
            f.sync_all()?;
        }
        drop(f);
        std::fs::rename(&tmp, path)?;
        if durability == Durability::Durable {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// [`write_atomic`] of `value` as pretty JSON; a value that cannot be encoded is an error
/// before anything is written.
pub fn write_json_atomic<T: serde::Serialize + ?Sized>(
    path: &Path,
    value: &T,
    durability: Durability,
) -> std::io::Result<()> {
    let body = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    write_atomic(path, &body, durability)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sub").join("saved.json");
        write_atomic(&p, b"old", Durability::Durable).unwrap();
        write_atomic(&p, b"new", Durability::Atomic).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        assert!(!temp_path(&p).exists());
    }

    #[test]
    fn a_leftover_temporary_file_is_replaced_and_a_directory_in_the_way_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("cursor");
        write_atomic(&p, b"1", Durability::Durable).unwrap();
        std::fs::write(temp_path(&p), b"half").unwrap();
        write_atomic(&p, b"2", Durability::Durable).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"2");
        std::fs::create_dir_all(temp_path(&p).join("junk")).unwrap();
        assert!(write_atomic(&p, b"3", Durability::Durable).is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"2", "the old file stands");
        assert!(
            temp_path(&p).join("junk").exists(),
            "nothing of someone else's is deleted"
        );
    }

    #[test]
    fn a_value_that_cannot_be_encoded_leaves_the_old_file() {
        struct Bad;
        impl serde::Serialize for Bad {
            fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
                Err(serde::ser::Error::custom("no"))
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("status.json");
        write_atomic(&p, b"{}", Durability::Atomic).unwrap();
        assert!(write_json_atomic(&p, &Bad, Durability::Atomic).is_err());
        assert_eq!(std::fs::read(&p).unwrap(), b"{}");
    }
}
