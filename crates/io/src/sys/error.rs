//! Typed errors shared across modules. Each error says whether trying again may help,
//! so callers (and the engine, through `Outcome`) can tell a throttle from a bad request.

use std::path::{Path, PathBuf};

pub use gpu_medic_core::error::{FileError, line_of};

/// Errors of the journal and state files.
#[derive(Debug, thiserror::Error)]
pub enum JournalError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {message}")]
    Corrupt {
        path: PathBuf,
        line: usize,
        message: String,
    },
    /// `state.json` written by a newer gpu-medic (a later state format or version): reading
    /// it could drop what this version does not know, so it is refused (never set aside).
    /// Not retried: the operator starts the version that wrote it, or opts in
    /// (`gpu-medic run --accept-newer-state`). `run` exits 78 on it.
    #[error(
        "{path}: written by {found}; this is {ours}: it may hold what this version would drop, so it is not read. Start the gpu-medic that wrote it, or run `gpu-medic run --accept-newer-state` to read it as this version can (what it does not know is dropped, and the file is written back in this version's format)"
    )]
    Newer {
        path: PathBuf,
        /// `gpu-medic X.Y.Z (state format N)` as the file says.
        found: String,
        /// This version and the newest format it reads.
        ours: String,
    },
}

impl JournalError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        JournalError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// A full disk or a busy file may clear; a corrupt file will not, nor a newer one.
    pub fn is_retryable(&self) -> bool {
        matches!(self, JournalError::Io { .. })
    }

    /// A state file of a newer gpu-medic: a decision for the operator (exit 78), not a fault.
    pub fn is_newer(&self) -> bool {
        matches!(self, JournalError::Newer { .. })
    }

    /// The file system is full, or the quota reached (`ENOSPC`, `EDQUOT`): space may come
    /// back, while a permission or a missing directory is a mistake to say at once.
    pub fn is_out_of_space(&self) -> bool {
        matches!(self, JournalError::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)))
    }
}
