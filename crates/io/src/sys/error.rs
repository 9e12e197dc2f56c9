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
}

impl JournalError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        JournalError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// A full disk or a busy file may clear; a corrupt file will not.
    pub fn is_retryable(&self) -> bool {
        matches!(self, JournalError::Io { .. })
    }

    /// The file system is full, or the quota reached (`ENOSPC`, `EDQUOT`): space may come
    /// back, while a permission or a missing directory is a mistake to say at once.
    pub fn is_out_of_space(&self) -> bool {
        matches!(self, JournalError::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)))
    }
}
