//! The error of a configuration or policy file that cannot be used, with its line: shared by
//! the policy here and the daemon's configuration.

use std::fmt;
use std::path::{Path, PathBuf};

/// A configuration or policy file that cannot be used. Displayed as `file:line: message`,
/// the form editors and CI annotations understand. Never retryable: a person must fix it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileError {
    pub path: PathBuf,
    pub line: Option<usize>,
    pub message: String,
}

impl FileError {
    pub fn new(path: &Path, line: Option<usize>, message: impl Into<String>) -> Self {
        FileError {
            path: path.to_path_buf(),
            line,
            message: message.into(),
        }
    }

    /// Builds an error at byte offset `offset` of `text`.
    pub fn at_offset(path: &Path, text: &str, offset: usize, message: impl Into<String>) -> Self {
        FileError::new(path, Some(line_of(text, offset)), message)
    }

    /// Converts a TOML parse or schema error, keeping its position.
    pub fn from_toml(path: &Path, text: &str, err: &toml::de::Error) -> Self {
        let line = err.span().map(|s| line_of(text, s.start));
        FileError::new(path, line, err.message().trim().to_string())
    }
}

/// 1-based line number of a byte offset.
pub fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|b| **b == b'\n')
        .count()
        + 1
}

impl fmt::Display for FileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}", self.path.display(), line, self.message),
            None => write!(f, "{}: {}", self.path.display(), self.message),
        }
    }
}

impl std::error::Error for FileError {}
