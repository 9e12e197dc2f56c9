//! The S3 calls the evidence upload makes (docs/evidence.md): PutObject for a small archive,
//! CreateMultipartUpload / UploadPart / CompleteMultipartUpload (AbortMultipartUpload on a
//! failure) for a large one, each body read from the spooled file by range, never the whole
//! archive in memory. Server-side encryption is SSE-S3 or SSE-KMS with one key. Calls only:
//! retries, the spool and the decisions live in `remedy::evidence`.

use std::path::Path;

use aws_sdk_s3::Client;
use aws_sdk_s3::primitives::{ByteStream, Length};
use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart, ServerSideEncryption};

use super::calls::{CallError, Calls};

/// How objects are encrypted at rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Encryption {
    /// SSE-S3 (`AES256`).
    S3Managed,
    /// SSE-KMS (`aws:kms`) with this key id, alias or ARN.
    Kms(String),
}

#[derive(Debug, Clone)]
pub struct S3 {
    pub client: Client,
}

impl S3 {
    /// A client on the shared SDK config; `path_style` for endpoints without virtual-host
    /// buckets (moto, some VPC endpoint setups).
    pub fn new(sdk: &aws_config::SdkConfig, path_style: bool) -> Self {
        let conf = aws_sdk_s3::config::Builder::from(sdk)
            .force_path_style(path_style)
            // Our own SHA-256 is recorded in the incident; the SDK's flexible checksums on
            // a streamed body would add aws-chunked encoding some endpoints refuse.
            .request_checksum_calculation(
                aws_sdk_s3::config::RequestChecksumCalculation::WhenRequired,
            )
            .build();
        S3 {
            client: Client::from_conf(conf),
        }
    }

    /// PutObject of the whole file.
    pub async fn put_file(
        &self,
        calls: &mut Calls,
        bucket: &str,
        key: &str,
        file: &Path,
        enc: &Encryption,
    ) -> Result<(), CallError> {
        let body = ByteStream::from_path(file)
            .await
            .map_err(|e| CallError::terminal("PutObject", format!("{}: {e}", file.display())))?;
        let mut req = self
            .client
            .put_object()
            .bucket(bucket)
            .key(key)
            .content_type("application/gzip")
            .body(body);
        req = match enc {
            Encryption::S3Managed => req.server_side_encryption(ServerSideEncryption::Aes256),
            Encryption::Kms(k) => req
                .server_side_encryption(ServerSideEncryption::AwsKms)
                .ssekms_key_id(k),
        };
        calls.track("PutObject", req.send().await).map(|_| ())
    }

    /// Starts a multipart upload; returns its upload id.
    pub async fn create_multipart(
        &self,
        calls: &mut Calls,
        bucket: &str,
        key: &str,
        enc: &Encryption,
    ) -> Result<String, CallError> {
        let mut req = self
            .client
            .create_multipart_upload()
            .bucket(bucket)
            .key(key)
            .content_type("application/gzip");
        req = match enc {
            Encryption::S3Managed => req.server_side_encryption(ServerSideEncryption::Aes256),
            Encryption::Kms(k) => req
                .server_side_encryption(ServerSideEncryption::AwsKms)
                .ssekms_key_id(k),
        };
        let out = calls.track("CreateMultipartUpload", req.send().await)?;
        out.upload_id()
            .map(str::to_string)
            .ok_or_else(|| CallError::terminal("CreateMultipartUpload", "no upload id"))
    }

    /// Uploads bytes `[offset, offset + len)` of `file` as part `number`; returns its ETag.
    #[allow(clippy::too_many_arguments)]
    pub async fn upload_part(
        &self,
        calls: &mut Calls,
        bucket: &str,
        key: &str,
        upload_id: &str,
        number: i32,
        file: &Path,
        offset: u64,
        len: u64,
    ) -> Result<String, CallError> {
        let body = ByteStream::read_from()
            .path(file)
            .offset(offset)
            .length(Length::Exact(len))
            .build()
            .await
            .map_err(|e| CallError::terminal("UploadPart", format!("{}: {e}", file.display())))?;
        let out = calls.quiet(
            "UploadPart",
            self.client
                .upload_part()
                .bucket(bucket)
                .key(key)
                .upload_id(upload_id)
                .part_number(number)
                .content_length(i64::try_from(len).unwrap_or(i64::MAX))
                .body(body)
                .send()
                .await,
        )?;
        out.e_tag()
            .map(str::to_string)
            .ok_or_else(|| CallError::terminal("UploadPart", "no ETag"))
    }

    /// Completes a multipart upload from its parts' (number, ETag).
    pub async fn complete_multipart(
        &self,
        calls: &mut Calls,
        bucket: &str,
        key: &str,
        upload_id: &str,
        parts: &[(i32, String)],
    ) -> Result<(), CallError> {
        let done = CompletedMultipartUpload::builder()
            .set_parts(Some(
                parts
                    .iter()
                    .map(|(n, e)| CompletedPart::builder().part_number(*n).e_tag(e).build())
                    .collect(),
            ))
            .build();
        calls
            .track(
                "CompleteMultipartUpload",
                self.client
                    .complete_multipart_upload()
                    .bucket(bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .multipart_upload(done)
                    .send()
                    .await,
            )
            .map(|_| ())
    }

    /// Abandons a multipart upload so its parts are not stored (and billed).
    pub async fn abort_multipart(
        &self,
        calls: &mut Calls,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> Result<(), CallError> {
        calls
            .track(
                "AbortMultipartUpload",
                self.client
                    .abort_multipart_upload()
                    .bucket(bucket)
                    .key(key)
                    .upload_id(upload_id)
                    .send()
                    .await,
            )
            .map(|_| ())
    }
}
