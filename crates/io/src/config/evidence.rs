//! `[evidence]`: the node's evidence kept off the instance (docs/evidence.md). When a drain,
//! reboot or replace brings a collection (`mode`), what is run (`bug_report`, `nvidia_smi`)
//! and how long each part may take and weigh, the archive's spool under `state_dir` and the
//! S3 bucket, prefix and encryption it is uploaded to.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::model::EvidenceMode;
use crate::sys::error::FileError;

/// Server-side encryption of the uploaded archive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Sse {
    /// SSE-S3 (`AES256`): keys managed by S3.
    #[default]
    #[serde(rename = "AES256", alias = "sse-s3")]
    Aes256,
    /// SSE-KMS (`aws:kms`) with `kms_key_id`.
    #[serde(rename = "aws:kms", alias = "sse-kms")]
    Kms,
}

/// When `nvidia-bug-report.sh` runs with `--safe-mode` (skips the parts NVIDIA says may hang).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SafeMode {
    /// When the incident's signal says a GPU is lost or off the bus (XID 79, gpu-lost, a
    /// device count mismatch): the script's full mode can hang on such a GPU.
    #[default]
    Auto,
    Always,
    Never,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvidenceConfig {
    /// Collect at all (needs `bucket`, and `[aws]` for the upload).
    #[serde(default)]
    pub enabled: bool,
    /// Which drain, reboot or replace verdicts bring a collection: `off`, `on-fatal` (the
    /// incident's signal is fatal in NVIDIA's catalog), `always`.
    #[serde(default = "default_mode")]
    pub mode: EvidenceMode,
    /// The S3 bucket the archives go to.
    #[serde(default)]
    pub bucket: Option<String>,
    /// Key prefix: `<prefix>/<cluster>/<instance>/<incident>.tar.gz`.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// `AES256` (SSE-S3) or `aws:kms` (SSE-KMS with `kms_key_id`).
    #[serde(default)]
    pub sse: Sse,
    /// The KMS key (id, alias or ARN) for `sse = "aws:kms"`.
    #[serde(default)]
    pub kms_key_id: Option<String>,
    /// How long a reboot, replacement or lifecycle completion waits for the collection and
    /// its upload; past it the repair goes on and the incident says what is missing.
    #[serde(default = "default_deadline", with = "humantime_serde")]
    pub deadline: Duration,
    /// NVIDIA's `nvidia-bug-report.sh` (from the driver package); a bare name is looked up
    /// in PATH.
    #[serde(default = "default_bug_report")]
    pub bug_report: PathBuf,
    /// Its deadline; at it the script's whole process group is killed.
    #[serde(default = "default_bug_report_timeout", with = "humantime_serde")]
    pub bug_report_timeout: Duration,
    /// `auto` (on a lost GPU), `always` or `never`.
    #[serde(default)]
    pub bug_report_safe_mode: SafeMode,
    /// `nvidia-smi` (`-q -x` is run); missing, gpu-medic's own NVML readings stand in.
    #[serde(default = "default_nvidia_smi")]
    pub nvidia_smi: PathBuf,
    #[serde(default = "default_nvidia_smi_timeout", with = "humantime_serde")]
    pub nvidia_smi_timeout: Duration,
    /// How far before the incident the kernel log, MPS log and inputs are taken.
    #[serde(default = "default_window", with = "humantime_serde")]
    pub window: Duration,
    /// The kernel log to excerpt; unset: `[nvml] kmsg`.
    #[serde(default)]
    pub kernel_log: Option<PathBuf>,
    /// Cap on any one part of the archive (a larger part is cut and the cut recorded).
    #[serde(default = "default_part_max_mib")]
    pub part_max_mib: u64,
    /// Cap on the whole archive.
    #[serde(default = "default_archive_max_mib")]
    pub archive_max_mib: u64,
    /// Cap on the spool under `state_dir/evidence`; the oldest archive is dropped (logged).
    #[serde(default = "default_spool_max_mib")]
    pub spool_max_mib: u64,
    /// Archives larger than this are uploaded in parts (S3 multipart).
    #[serde(default = "default_multipart_threshold_mib")]
    pub multipart_threshold_mib: u64,
    /// Upload attempts per archive before it waits for the next start or sweep.
    #[serde(default = "default_upload_attempts")]
    pub upload_attempts: u32,
}

impl Default for EvidenceConfig {
    fn default() -> Self {
        EvidenceConfig {
            enabled: false,
            mode: default_mode(),
            bucket: None,
            prefix: default_prefix(),
            sse: Sse::default(),
            kms_key_id: None,
            deadline: default_deadline(),
            bug_report: default_bug_report(),
            bug_report_timeout: default_bug_report_timeout(),
            bug_report_safe_mode: SafeMode::default(),
            nvidia_smi: default_nvidia_smi(),
            nvidia_smi_timeout: default_nvidia_smi_timeout(),
            window: default_window(),
            kernel_log: None,
            part_max_mib: default_part_max_mib(),
            archive_max_mib: default_archive_max_mib(),
            spool_max_mib: default_spool_max_mib(),
            multipart_threshold_mib: default_multipart_threshold_mib(),
            upload_attempts: default_upload_attempts(),
        }
    }
}

fn default_mode() -> EvidenceMode {
    EvidenceMode::OnFatal
}
fn default_prefix() -> String {
    "gpu-medic/evidence".to_string()
}
fn default_deadline() -> Duration {
    Duration::from_secs(300)
}
fn default_bug_report() -> PathBuf {
    PathBuf::from("nvidia-bug-report.sh")
}
fn default_bug_report_timeout() -> Duration {
    Duration::from_secs(180)
}
fn default_nvidia_smi() -> PathBuf {
    PathBuf::from("nvidia-smi")
}
fn default_nvidia_smi_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_window() -> Duration {
    Duration::from_secs(900)
}
fn default_part_max_mib() -> u64 {
    128
}
fn default_archive_max_mib() -> u64 {
    512
}
fn default_spool_max_mib() -> u64 {
    2048
}
fn default_multipart_threshold_mib() -> u64 {
    16
}
fn default_upload_attempts() -> u32 {
    4
}

impl EvidenceConfig {
    /// Values S3, KMS or the collection would reject or misread, with file:line.
    pub fn check(&self, path: &Path, text: &str) -> Result<(), FileError> {
        let err = |key: &str, msg: String| {
            FileError::new(path, super::key_line(text, Some("evidence"), key), msg)
        };
        if let Some(b) = &self.bucket
            && !valid_bucket(b)
        {
            return Err(err(
                "bucket",
                format!(
                    "bucket: {b:?} is not an S3 bucket name (3-63 of a-z 0-9 . -, starting and ending with a letter or digit)"
                ),
            ));
        }
        if self.enabled && self.bucket.is_none() {
            return Err(err("enabled", "enabled: [evidence] needs a bucket".into()));
        }
        if self.prefix.len() > 512
            || self.prefix.starts_with('/')
            || self.prefix.contains("//")
            || self.prefix.chars().any(|c| c.is_control())
        {
            return Err(err(
                "prefix",
                format!(
                    "prefix: {:?} must be a relative key prefix without empty segments, at most 512 characters",
                    self.prefix
                ),
            ));
        }
        match (self.sse, &self.kms_key_id) {
            (Sse::Kms, None) => {
                return Err(err("sse", "sse: \"aws:kms\" needs kms_key_id".into()));
            }
            (Sse::Aes256, Some(_)) => {
                return Err(err(
                    "kms_key_id",
                    "kms_key_id: only used with sse = \"aws:kms\"".into(),
                ));
            }
            _ => {}
        }
        let min = Duration::from_secs(1);
        let max = Duration::from_secs(3600);
        for (key, d) in [
            ("deadline", self.deadline),
            ("bug_report_timeout", self.bug_report_timeout),
            ("nvidia_smi_timeout", self.nvidia_smi_timeout),
        ] {
            if d < min || d > max {
                return Err(err(
                    key,
                    format!(
                        "{key}: {} is not between 1s and 1h",
                        humantime::format_duration(d)
                    ),
                ));
            }
        }
        if self.window < min || self.window > Duration::from_secs(7 * 24 * 3600) {
            return Err(err(
                "window",
                "window: must be between 1s and 7 days".into(),
            ));
        }
        for (key, v, lo, hi) in [
            ("part_max_mib", self.part_max_mib, 1, 4096),
            ("archive_max_mib", self.archive_max_mib, 1, 16384),
            ("spool_max_mib", self.spool_max_mib, 1, 65536),
            (
                "multipart_threshold_mib",
                self.multipart_threshold_mib,
                5,
                4096,
            ),
            ("upload_attempts", u64::from(self.upload_attempts), 1, 20),
        ] {
            if !(lo..=hi).contains(&v) {
                return Err(err(key, format!("{key}: {v} is not between {lo} and {hi}")));
            }
        }
        if self.archive_max_mib > self.spool_max_mib {
            return Err(err(
                "archive_max_mib",
                "archive_max_mib: must not exceed spool_max_mib".into(),
            ));
        }
        Ok(())
    }
}

/// S3's bucket naming rules (general purpose buckets): 3-63 characters of lowercase
/// letters, digits, dots and hyphens, starting and ending with a letter or digit, no `..`.
pub fn valid_bucket(b: &str) -> bool {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    (3..=63).contains(&b.len())
        && b.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-')
        && edge(b.chars().next())
        && edge(b.chars().last())
        && !b.contains("..")
}
