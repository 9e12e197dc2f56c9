//! Uploading a spooled archive (docs/evidence.md): PutObject below the multipart threshold,
//! else a multipart upload in parts read from the file by range (aborted on failure so no
//! orphan parts stay billed). Transient failures (throttling, 5xx, timeouts, an unreachable
//! endpoint) are retried with full-jitter backoff (`sys::backoff`) up to `upload_attempts` and never
//! past the caller's deadline; a refusal (AccessDenied, NoSuchBucket, a KMS key we may not
//! use) is not retried: it is recorded once and waits for the next start.

use std::time::{Duration, Instant};

use super::spool::Entry;
use crate::aws::calls::{CallError, Calls};
use crate::aws::s3::{Encryption, S3};

/// S3's smallest part (but the last) is 5 MiB; 8 MiB keeps a 256 MiB archive in 32 parts.
pub const PART_BYTES: u64 = 8 * 1024 * 1024;
/// S3's most parts per upload.
const MAX_PARTS: u64 = 10_000;

/// Why an upload did not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct UploadError {
    pub message: String,
    /// False for a refusal: retrying cannot help until someone changes IAM, KMS or the bucket.
    pub retryable: bool,
    pub request_ids: Vec<String>,
}

impl From<(CallError, &Calls)> for UploadError {
    fn from((e, calls): (CallError, &Calls)) -> Self {
        UploadError {
            message: match &e.code {
                Some(c) => format!("{}: {c}: {}", e.op, e.message),
                None => e.to_string(),
            },
            retryable: e.retryable,
            request_ids: calls.entries.clone(),
        }
    }
}

pub struct Uploader<'a> {
    pub s3: &'a S3,
    pub encryption: &'a Encryption,
    pub multipart_threshold: u64,
    pub attempts: u32,
}

impl Uploader<'_> {
    /// Uploads `file` to `entry`'s key, retrying transient failures until `until`. Returns the
    /// request ids of the calls that finished it.
    pub async fn upload(
        &self,
        entry: &Entry,
        file: &std::path::Path,
        until: Instant,
    ) -> Result<Vec<String>, UploadError> {
        // Full jitter over a window doubling from 500 ms to 20 s (`sys::backoff`).
        let mut retries = 0u32;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(UploadError {
                    message: "no time left before the deadline".into(),
                    retryable: true,
                    request_ids: Vec::new(),
                });
            }
            let e = match tokio::time::timeout(left, self.attempt(entry, file)).await {
                Ok(Ok(ids)) => return Ok(ids),
                Ok(Err(e)) => e,
                Err(_) => UploadError {
                    message: format!("upload cut at the deadline after {}", super::shown(left)),
                    retryable: true,
                    request_ids: Vec::new(),
                },
            };
            // A refusal is not retried; nor is anything once the attempts are spent or the
            // next wait would end past the deadline (the caller must hear before it).
            if !e.retryable || retries.saturating_add(1) >= self.attempts {
                return Err(e);
            }
            let delay = crate::sys::backoff::full_jitter(
                Duration::from_millis(500),
                retries,
                Duration::from_secs(20),
            );
            retries += 1;
            if Instant::now() + delay >= until {
                return Err(e);
            }
            tracing::warn!(
                incident_id = entry.incident,
                uri = %entry.uri(),
                "evidence: upload failed: {e}; retrying in {delay:?}"
            );
            tokio::time::sleep(delay).await;
        }
    }

    async fn attempt(
        &self,
        entry: &Entry,
        file: &std::path::Path,
    ) -> Result<Vec<String>, UploadError> {
        let mut calls = Calls::new();
        let (bucket, key) = (entry.bucket.as_str(), entry.key.as_str());
        let size = std::fs::metadata(file)
            .map_err(|e| UploadError {
                message: format!("{}: {e}", file.display()),
                retryable: false,
                request_ids: Vec::new(),
            })?
            .len();
        if size < self.multipart_threshold {
            return match self
                .s3
                .put_file(&mut calls, bucket, key, file, self.encryption)
                .await
            {
                Ok(()) => Ok(calls.entries),
                Err(e) => Err((e, &calls).into()),
            };
        }
        let upload_id = match self
            .s3
            .create_multipart(&mut calls, bucket, key, self.encryption)
            .await
        {
            Ok(id) => id,
            Err(e) => return Err((e, &calls).into()),
        };
        let part = PART_BYTES.max(size.div_ceil(MAX_PARTS));
        let mut parts = Vec::new();
        let mut offset = 0;
        let mut number = 1i32;
        let result = async {
            while offset < size {
                let len = part.min(size - offset);
                let etag = self
                    .s3
                    .upload_part(
                        &mut calls, bucket, key, &upload_id, number, file, offset, len,
                    )
                    .await?;
                parts.push((number, etag));
                offset += len;
                number = number.saturating_add(1);
            }
            self.s3
                .complete_multipart(&mut calls, bucket, key, &upload_id, &parts)
                .await
        }
        .await;
        match result {
            Ok(()) => Ok(calls.entries),
            Err(e) => {
                let err: UploadError = (e, &calls).into();
                if let Err(a) = self
                    .s3
                    .abort_multipart(&mut calls, bucket, key, &upload_id)
                    .await
                {
                    tracing::warn!(uri = %entry.uri(), "evidence: could not abort the multipart upload: {a}");
                }
                Err(err)
            }
        }
    }
}
