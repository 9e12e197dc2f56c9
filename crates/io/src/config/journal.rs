//! `[journal]`: how large the incident journal grows and how many rotations are kept.

use serde::Deserialize;

/// Size-based rotation of `incidents.jsonl` and `inputs.jsonl`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JournalConfig {
    /// A journal file is rotated (`NAME.1`, `NAME.2`, ...) once it reaches this size, in MiB.
    #[serde(default = "default_journal_size", deserialize_with = "de_journal_size")]
    pub max_file_size_mib: u64,
    /// Rotated files kept per journal; the oldest beyond it is deleted. At most
    /// [`MAX_KEEP_FILES`]: the readers look for at most `journal::MAX_ROTATED` files.
    #[serde(default = "default_journal_keep", deserialize_with = "de_journal_keep")]
    pub keep_files: u32,
}

impl Default for JournalConfig {
    fn default() -> Self {
        JournalConfig {
            max_file_size_mib: default_journal_size(),
            keep_files: default_journal_keep(),
        }
    }
}

fn default_journal_size() -> u64 {
    64
}

fn default_journal_keep() -> u32 {
    4
}

fn de_journal_size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let v = u64::deserialize(d)?;
    if !(1..=1024 * 1024).contains(&v) {
        return Err(serde::de::Error::custom(format!(
            "max_file_size_mib: {v} is not in 1..=1048576"
        )));
    }
    Ok(v)
}

/// The most rotated files kept per journal (far below the 10,000 the readers look for).
pub const MAX_KEEP_FILES: u32 = 1000;

fn de_journal_keep<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = u32::deserialize(d)?;
    if v > MAX_KEEP_FILES {
        return Err(serde::de::Error::custom(format!(
            "keep_files: {v} is not in 0..={MAX_KEEP_FILES}"
        )));
    }
    Ok(v)
}
