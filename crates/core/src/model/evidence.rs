//! Evidence of an incident kept off the instance (docs/evidence.md): when the engine orders a
//! collection ([`EvidenceMode`], [`EvidencePlan`]) and what the collection reports back
//! ([`EvidenceRef`]: where the archive is, its size and checksum, what could not be
//! collected). Plain data: it travels in `inputs.jsonl`, `incidents.jsonl` and the shipped
//! records.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// When a drain, reboot or replace verdict brings an evidence collection with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EvidenceMode {
    /// Never.
    #[default]
    Off,
    /// When the incident's first signal is one NVIDIA's catalog calls fatal (a reset or more:
    /// `policy::xid_catalog::fatal_signals`), the faults an RMA or a support case is about.
    OnFatal,
    /// For every drain, reboot or replace.
    Always,
}

impl EvidenceMode {
    pub fn as_str(self) -> &'static str {
        match self {
            EvidenceMode::Off => "off",
            EvidenceMode::OnFatal => "on-fatal",
            EvidenceMode::Always => "always",
        }
    }
}

/// What the supervisor's evidence remedy was started with (`[evidence]`): the engine orders
/// collections by it, and the reboot, replacement or lifecycle completion waits for one at
/// most `deadline`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvidencePlan {
    pub mode: EvidenceMode,
    #[serde(with = "humantime_serde")]
    pub deadline: Duration,
}

/// One part of the archive that is missing or incomplete, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MissingPart {
    pub part: String,
    pub why: String,
}

/// Where an incident's evidence archive is: reported by the collection, recorded in the
/// incident, printed by `incidents show`, carried by the EventBridge event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvidenceRef {
    /// `s3://<bucket>/<prefix>/<cluster>/<instance>/<incident>.tar.gz`.
    pub uri: String,
    /// The archive's size in bytes.
    pub bytes: u64,
    /// Its SHA-256, lowercase hex.
    pub sha256: String,
    /// False when the upload had not finished when the collection reported: the archive
    /// waits in the spool under `state_dir` and is uploaded (once) when S3 answers again.
    pub uploaded: bool,
    /// Parts not collected, cut at a deadline or a size cap, or failed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<MissingPart>,
}

impl EvidenceRef {
    /// One line for people: `s3://... (1.2 MiB, sha256 ab12...)` plus what is missing.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "{} ({} bytes, sha256 {}){}",
            self.uri,
            self.bytes,
            self.sha256,
            if self.uploaded {
                ""
            } else {
                "; upload pending (spooled)"
            }
        );
        if !self.missing.is_empty() {
            let parts: Vec<String> = self
                .missing
                .iter()
                .map(|m| format!("{}: {}", m.part, m.why))
                .collect();
            s.push_str(&format!("; not collected: {}", parts.join("; ")));
        }
        s
    }
}
