//! Evidence that outlives the instance (docs/evidence.md): for a drain, reboot or replace the
//! engine orders `collect-evidence` beside the drain; this remedy gathers the node's state
//! into one `tar.gz` ([`collect`] the parts, [`archive`] the file), keeps it in a bounded
//! spool under `state_dir` ([`spool`]) and uploads it to
//! `s3://<bucket>/<prefix>/<cluster>/<instance>/<incident>.tar.gz` ([`upload`]). It always
//! reports before the order's deadline: parts still running are cut, an upload that cannot
//! finish is left to the spool (uploaded after the next start, once), and the outcome says
//! what is missing. `gpu-medic evidence <incident>` runs the same collection on demand.

pub mod archive;
pub mod collect;
pub mod spool;
pub mod upload;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use self::collect::Part;
use self::spool::{Entry, Spool};
use super::{BoxFuture, Done, RemedyError};
use crate::aws::s3::{Encryption, S3};
use crate::config::{Config, MpsLogs, SafeMode, Sse};
use crate::model::{
    EvidencePlan, EvidenceRef, Incident, IncidentEvent, IncidentId, MissingPart, Order, Signal,
    Timestamp,
};
use crate::sys::clock::SharedClock;

/// Time kept back at the end of an order for the outcome to reach the engine.
const MARGIN: Duration = Duration::from_secs(2);
/// The most of an order's time that is kept for the upload.
const UPLOAD_RESERVE: Duration = Duration::from_secs(60);
/// How often waiting archives are tried again while the daemon runs.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(300);

/// The evidence remedy as the router sees it.
pub trait EvidenceRemedy: Send + Sync + 'static {
    /// Collects, archives and uploads the order's incident's evidence.
    fn collect(&self, order: &Order) -> BoxFuture<'_, Result<(Done, EvidenceRef), RemedyError>>;
    /// What the engine is told at start: when to order a collection, how long to wait.
    fn plan(&self) -> EvidencePlan;
}

/// What the evidence reads of gpu-medic's own records (the incident journal, the journaled
/// inputs, the engine's saved state). A remedy does not read the journal itself: whoever owns
/// it hands this in at construction (the wiring's `supervisor::evidence::JournalRecords`).
pub trait Records: Send + Sync + 'static {
    /// The incident as the journal tells it; None when the journal has no record of it.
    fn incident(&self, id: IncidentId) -> Option<Incident>;
    /// Writes the inputs journaled at or after `since`, one JSON line each, into `out`, at
    /// most `cap` bytes. Ok(true) when cut at the cap.
    fn inputs_since(
        &self,
        since: Timestamp,
        cap: u64,
        out: &mut dyn std::io::Write,
    ) -> Result<bool, String>;
    /// gpu-medic's own NVML readings: the GPU state the engine holds and the NVML
    /// observations journaled at or after `since` (at most about `cap` bytes of them).
    fn nvml_readings(&self, since: Timestamp, cap: u64) -> serde_json::Value;
}

/// This instance, for the archive and the S3 key.
#[derive(Debug, Clone, Default, Serialize)]
pub struct NodeIdentity {
    pub instance_id: String,
    pub instance_type: String,
    pub ami_id: String,
    pub driver_version: String,
    pub cluster: String,
    pub auto_scaling_group: String,
    pub container_instance_arn: String,
}

pub struct Evidence {
    cfg: Arc<Config>,
    config_file: Option<PathBuf>,
    records: Arc<dyn Records>,
    spool: Spool,
    s3: Option<S3>,
    http: aws_sdk_ecs::config::SharedHttpClient,
    identity: tokio::sync::OnceCell<NodeIdentity>,
    /// One upload at a time (an order's and the sweep's).
    uploading: tokio::sync::Mutex<()>,
    /// The daemon's one clock: an order's deadline is read against it.
    clock: SharedClock,
}

/// Whether the S3 client must address buckets by path (an endpoint override: moto, a local
/// double; real S3 takes virtual-hosted names).
fn path_style(cfg: &Config) -> bool {
    cfg.aws.endpoint_url.is_some()
        || std::env::var_os("AWS_ENDPOINT_URL_S3").is_some()
        || std::env::var_os("AWS_ENDPOINT_URL").is_some()
}

impl Evidence {
    pub async fn from_config(
        cfg: &Config,
        config_file: Option<PathBuf>,
        records: Arc<dyn Records>,
    ) -> Evidence {
        let s3 = if cfg.aws.enabled {
            let sdk = crate::aws::loader(&cfg.aws).load().await;
            Some(S3::new(&sdk, path_style(cfg)))
        } else {
            None
        };
        let e = &cfg.evidence;
        Evidence {
            cfg: Arc::new(cfg.clone()),
            config_file,
            records,
            spool: Spool::new(cfg.files().evidence(), e.spool_max_mib * MIB),
            s3,
            http: crate::aws::http_client(),
            identity: tokio::sync::OnceCell::new(),
            uploading: tokio::sync::Mutex::new(()),
            clock: crate::sys::clock::SystemClock::shared(),
        }
    }

    /// Reads order deadlines against `clock` (the supervisor's).
    pub fn with_clock(mut self, clock: SharedClock) -> Self {
        self.clock = clock;
        self
    }

    fn encryption(&self) -> Encryption {
        match (self.cfg.evidence.sse, &self.cfg.evidence.kms_key_id) {
            (Sse::Kms, Some(k)) => Encryption::Kms(k.clone()),
            _ => Encryption::S3Managed,
        }
    }

    async fn identity(&self) -> &NodeIdentity {
        self.identity
            .get_or_init(|| async {
                let cfg = &self.cfg;
                let imds = crate::aws::imds::imds_client(self.http.clone(), 1);
                let ask = |path: &'static str| {
                    let imds = imds.clone();
                    async move {
                        match tokio::time::timeout(
                            Duration::from_secs(2),
                            crate::aws::imds::get(&imds, path),
                        )
                        .await
                        {
                            Ok(Ok(Some(v))) => v,
                            Ok(Ok(None)) => "(not in IMDS)".into(),
                            Ok(Err(e)) => format!("unknown ({e})"),
                            Err(_) => "unknown (IMDS timed out)".into(),
                        }
                    }
                };
                let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
                let instance_id = async {
                    crate::aws::identity::instance_id(cfg, self.http.clone(), deadline)
                        .await
                        .unwrap_or_else(|e| format!("unknown ({e})"))
                };
                let view = async {
                    tokio::time::timeout(
                        Duration::from_secs(5),
                        crate::aws::identity::agent_view(cfg),
                    )
                    .await
                    .ok()
                };
                // Side by side: each is bounded, and together they take the longest one's
                // time (at most 5 s, once per process: the identity is kept).
                let (instance_id, view, instance_type, ami_id) = tokio::join!(
                    instance_id,
                    view,
                    ask(crate::aws::imds::INSTANCE_TYPE_PATH),
                    ask("/latest/meta-data/ami-id")
                );
                NodeIdentity {
                    instance_id,
                    instance_type,
                    ami_id,
                    driver_version: driver_version(),
                    cluster: view
                        .as_ref()
                        .map_or_else(|| "unknown".into(), |v| v.cluster.clone()),
                    auto_scaling_group: cfg
                        .identity
                        .auto_scaling_group
                        .clone()
                        .unwrap_or_else(|| "(not configured; see the incident's requests)".into()),
                    container_instance_arn: view
                        .and_then(|v| v.container_instance_arn)
                        .unwrap_or_default(),
                }
            })
            .await
    }

    /// The S3 key of an archive (`name`: the incident's id, or an on-demand collection's).
    pub fn key(&self, ident: &NodeIdentity, name: &str) -> String {
        let clean = |s: &str| -> String {
            s.chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                        c
                    } else {
                        '_'
                    }
                })
                .collect()
        };
        let cluster = clean(ident.cluster.rsplit('/').next().unwrap_or(&ident.cluster));
        format!(
            "{}/{}/{}/{}.tar.gz",
            self.cfg.evidence.prefix.trim_end_matches('/'),
            cluster,
            clean(&ident.instance_id),
            name
        )
    }

    /// Collects, archives and uploads one incident's evidence, reporting by `until`. `name`
    /// names the archive in the spool and in S3: the incident's id for the daemon's
    /// collection, so a retried order replaces its own archive; an on-demand collection's own
    /// name ([`on_demand_name`]), so it never overwrites the archive made at the fault.
    pub async fn collect_until(
        &self,
        id: IncidentId,
        name: &str,
        until: Instant,
    ) -> Result<(EvidenceRef, Vec<String>), RemedyError> {
        if !spool::valid_name(name) {
            return Err(RemedyError::fatal(format!(
                "{name:?} is not an archive name"
            )));
        }
        let e = &self.cfg.evidence;
        let Some(bucket) = e.bucket.clone() else {
            return Err(RemedyError::fatal("[evidence] has no bucket"));
        };
        let incident = self
            .records
            .incident(id)
            .ok_or_else(|| RemedyError::fatal(format!("no incident {id} in the journal")))?;
        let ident = self.identity().await.clone();
        let work = self.fresh_work_dir(name)?;

        let now = Instant::now();
        let total = until.saturating_duration_since(now);
        let reserve = (total / 3).min(UPLOAD_RESERVE);
        let collect_for = total.saturating_sub(reserve);
        let part_cap = e.part_max_mib * MIB;
        let parts = self
            .parts(&incident, &ident, &work, collect_for, part_cap)
            .await;

        let archive_path = self.spool.archive_path(name);
        let max = e.archive_max_mib * MIB;
        let (room, spooled) = match self.room_for(name, max) {
            Ok(r) => r,
            Err(why) => {
                let _ = std::fs::remove_dir_all(&work);
                return Err(RemedyError::fatal(why));
            }
        };
        let archiving = Instant::now();
        let (finished, mut missing) = tokio::task::spawn_blocking({
            let archive_path = archive_path.clone();
            let ident = ident.clone();
            let incident_id = id;
            move || {
                build(
                    &archive_path,
                    // gzip's worst case (stored blocks) is a little larger than its input.
                    max.min(room.saturating_sub(room / 128 + 64 * 1024)),
                    part_cap,
                    &parts,
                    &ident,
                    incident_id,
                )
            }
        })
        .await
        .map_err(|err| RemedyError::fatal(format!("archive: {err}")))?
        .map_err(|err| RemedyError::fatal(format!("archive {}: {err}", archive_path.display())))?;
        let _ = std::fs::remove_dir_all(&work);
        missing.extend(self.foreign_part(&spooled, room));
        tracing::info!(
            incident_id = id.0,
            bytes = finished.bytes,
            collect_ms = duration_ms(archiving.duration_since(now)),
            archive_ms = duration_ms(archiving.elapsed()),
            missing = missing.len(),
            "evidence: archive made"
        );

        let mut entry = Entry {
            incident: id.0,
            name: name.to_string(),
            bucket,
            key: self.key(&ident, name),
            bytes: finished.bytes,
            sha256: finished.sha256.clone(),
            created_ms: Timestamp::now().0,
            uploaded: false,
            refused: None,
        };
        self.spool
            .save(&entry)
            .map_err(|err| RemedyError::fatal(format!("spool: {err}")))?;
        let (uploaded, ids) = self.upload(&mut entry, until).await;
        if let Err(why) = &uploaded {
            missing.push(MissingPart {
                part: "upload".into(),
                why: why.clone(),
            });
        }
        Ok((
            EvidenceRef {
                uri: entry.uri(),
                bytes: entry.bytes,
                sha256: entry.sha256,
                uploaded: uploaded.is_ok(),
                missing,
            },
            ids,
        ))
    }

    /// The spool made, crashed collections' scratch swept, and `name`'s own scratch folder
    /// empty and ready.
    fn fresh_work_dir(&self, name: &str) -> Result<std::path::PathBuf, RemedyError> {
        self.spool
            .ensure()
            .map_err(|err| RemedyError::fatal(format!("{}: {err}", self.spool.dir().display())))?;
        self.spool.sweep_scratch(name);
        let work = self.spool.work_dir(name);
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work)
            .map_err(|err| RemedyError::fatal(format!("{}: {err}", work.display())))?;
        Ok(work)
    }

    /// The evidence's note on files in the spool gpu-medic did not make (they took `room`
    /// from the archive), when there are any.
    fn foreign_part(&self, spooled: &spool::Usage, room: u64) -> Option<MissingPart> {
        let foreign = spooled.foreign_note(self.spool.max_bytes());
        (!foreign.is_empty()).then(|| MissingPart {
            part: "spool".into(),
            why: format!(
                "{foreign}; the archive had {} of room",
                crate::sys::limits::human_bytes(room)
            ),
        })
    }

    /// The room the spool has for archive `name` (at most `max`), every file in it counted,
    /// and what is in it; `Err` saying why no archive is made: less than [`spool::MIN_ROOM`]
    /// left once gpu-medic's own older archives are dropped (files it did not make take the
    /// rest: named), or a spool too large to count.
    fn room_for(&self, name: &str, max: u64) -> Result<(u64, spool::Usage), String> {
        let (room, usage) = self.spool.make_room(max, name);
        let cap = self.spool.max_bytes();
        if !usage.complete {
            return Err(format!(
                "could not count the evidence spool {} (more entries or deeper folders than gpu-medic walks); no archive is made, so the spool cannot go over its {} cap",
                self.spool.dir().display(),
                crate::sys::limits::human_bytes(cap)
            ));
        }
        if room < spool::MIN_ROOM {
            let foreign = usage.foreign_note(cap);
            tracing::error!(
                "evidence: no room in the spool ({} of {} used): {foreign}",
                crate::sys::limits::human_bytes(usage.bytes),
                crate::sys::limits::human_bytes(cap)
            );
            return Err(format!(
                "no room in the evidence spool: {} of its {} cap used{}; no archive is made",
                crate::sys::limits::human_bytes(usage.bytes),
                crate::sys::limits::human_bytes(cap),
                if foreign.is_empty() {
                    String::new()
                } else {
                    format!(" ({foreign})")
                }
            ));
        }
        if usage.foreign > 0 {
            tracing::warn!("evidence: {}", usage.foreign_note(cap));
        }
        Ok((room, usage))
    }

    /// One upload of a spooled archive, serialized with the others.
    async fn upload(&self, entry: &mut Entry, until: Instant) -> (Result<(), String>, Vec<String>) {
        let Some(s3) = &self.s3 else {
            return (
                Err("not uploaded: AWS is disabled ([aws] enabled = false); the archive stays in the spool".into()),
                Vec::new(),
            );
        };
        let _one = self.uploading.lock().await;
        if self
            .spool
            .load(&entry.stem())
            .is_some_and(|e| e.uploaded && e.sha256 == entry.sha256)
        {
            entry.uploaded = true;
            return (Ok(()), Vec::new());
        }
        // Only what gpu-medic made leaves the node: its own regular file in the spool, of the
        // record's size and checksum, under a key derived here (never the record's).
        let Some(bucket) = self.cfg.evidence.bucket.clone() else {
            return (Err("[evidence] has no bucket".into()), Vec::new());
        };
        let verified = tokio::task::spawn_blocking({
            let spool = self.spool.clone();
            let e = entry.clone();
            move || spool.verify(&e)
        })
        .await
        .unwrap_or_else(|err| Err(format!("checking the archive: {err}")));
        let opened = match verified {
            Ok(f) => f,
            Err(why) => {
                let why = format!(
                    "not uploaded: not an archive gpu-medic made ({}); left in the spool",
                    crate::mps::control::clip(&why, 512)
                );
                tracing::warn!(incident_id = entry.incident, "evidence: {why}");
                // Tried again only at the next start, not at every sweep.
                entry.refused = Some(why.clone());
                let _ = self.spool.save(entry);
                return (Err(why), Vec::new());
            }
        };
        let ident = self.identity().await.clone();
        entry.bucket = bucket;
        entry.key = self.key(&ident, &entry.stem());
        let enc = self.encryption();
        let up = upload::Uploader {
            s3,
            encryption: &enc,
            multipart_threshold: self.cfg.evidence.multipart_threshold_mib * MIB,
            attempts: self.cfg.evidence.upload_attempts,
        };
        // The file checked, read through its descriptor: a path swapped since is not followed.
        let file = std::path::PathBuf::from(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&opened)
        ));
        let result = up.upload(entry, &file, until).await;
        drop(opened);
        match result {
            Ok(ids) => {
                if let Err(err) = self.spool.uploaded(entry) {
                    tracing::warn!(
                        incident_id = entry.incident,
                        "evidence: spool record: {err}"
                    );
                }
                tracing::info!(incident_id = entry.incident, uri = %entry.uri(), bytes = entry.bytes, sha256 = %entry.sha256, "evidence: archive uploaded");
                (Ok(()), ids)
            }
            Err(err) => {
                let why = if err.retryable {
                    format!(
                        "upload failed ({}); the archive waits in the spool and is uploaded when S3 answers",
                        err.message
                    )
                } else {
                    entry.refused = Some(err.message.clone());
                    let _ = self.spool.save(entry);
                    format!(
                        "S3 refused the upload ({}); not retried until the next start: check the bucket policy, IAM and KMS key",
                        err.message
                    )
                };
                tracing::warn!(incident_id = entry.incident, uri = %entry.uri(), "evidence: {why}");
                (Err(why), err.request_ids)
            }
        }
    }

    /// Uploads every archive still waiting in the spool (at start, then every
    /// [`SWEEP_INTERVAL`]); refused ones only on the first sweep after a start.
    pub async fn sweep(&self, first: bool) -> usize {
        let mut done = 0;
        for mut e in self.spool.entries() {
            if e.uploaded || (e.refused.is_some() && !first) {
                continue;
            }
            if !self.spool.archive_path(&e.stem()).is_file() {
                continue;
            }
            let until = Instant::now() + self.cfg.evidence.deadline;
            if self.upload(&mut e, until).await.0.is_ok() {
                done += 1;
            }
        }
        done
    }

    /// Every part, gathered side by side within `budget`.
    async fn parts(
        &self,
        incident: &Incident,
        ident: &NodeIdentity,
        work: &Path,
        budget: Duration,
        cap: u64,
    ) -> Vec<Part> {
        let e = &self.cfg.evidence;
        let opened = incident.records.iter().find_map(|r| match &r.event {
            IncidentEvent::Opened { observation, .. } => Some(observation.signal.clone()),
            _ => None,
        });
        let lost = matches!(
            opened,
            Some(Signal::Xid { code: 79, .. })
                | Some(Signal::GpuLost)
                | Some(Signal::DeviceCountMismatch)
                | Some(Signal::DriverNotLoaded)
        );
        let safe = match e.bug_report_safe_mode {
            SafeMode::Always => true,
            SafeMode::Never => false,
            SafeMode::Auto => lost,
        };
        let floor = Duration::from_millis(100);
        let bug_timeout = e.bug_report_timeout.min(budget).max(floor);
        let smi_timeout = e.nvidia_smi_timeout.min(budget).max(floor);
        let since = Timestamp(incident.opened_at.0.saturating_sub(duration_ms(e.window)));
        let (bug, smi, mps) = tokio::join!(
            collect::bug_report(&e.bug_report, work, safe, cap, bug_timeout),
            collect::nvidia_smi(&e.nvidia_smi, work, cap, smi_timeout),
            self.mps_log(work, since, cap, smi_timeout),
        );
        let mut parts = vec![bug];
        match smi {
            Ok(p) => parts.push(p),
            Err(why) => {
                parts.push(Part::failed(
                    "nvidia-smi-q.xml",
                    why.clone(),
                    Duration::ZERO,
                ));
                parts.push(self.nvml_readings(work, since, cap, &why));
            }
        }
        parts.push(mps);
        parts.push(self.kernel_part(work, since, cap));
        parts.push(self.journal_part(incident, work));
        parts.push(self.inputs_part(work, since, cap));
        for (name, path) in [
            ("config.toml", self.config_file.clone()),
            ("policy.toml", Some(self.cfg.policy.clone())),
        ] {
            let t = Instant::now();
            parts.push(match path {
                None => Part::failed(
                    name,
                    "the config file's path is not known here",
                    Duration::ZERO,
                ),
                Some(p) => {
                    // Parsed and written again: no comment (which may hold a secret) and no
                    // secret-named value leaves the node.
                    let out = work.join(name);
                    match collect::scrubbed_toml(&p, &out) {
                        Ok(_) => Part::ok(name, out, t.elapsed()),
                        Err(why) => Part::failed(name, why, t.elapsed()),
                    }
                }
            });
        }
        let out = work.join("identity.json");
        parts.push(
            match std::fs::write(&out, serde_json::to_vec_pretty(ident).unwrap_or_default()) {
                Ok(()) => Part::ok("identity.json", out, Duration::ZERO),
                Err(err) => Part::failed("identity.json", err.to_string(), Duration::ZERO),
            },
        );
        parts
    }

    fn kernel_part(&self, work: &Path, since: Timestamp, cap: u64) -> Part {
        let t = Instant::now();
        let name = "kernel-log.txt";
        let Some(src) = self
            .cfg
            .evidence
            .kernel_log
            .clone()
            .or_else(|| self.cfg.nvml.kmsg.clone())
        else {
            return Part::failed(
                name,
                "no kernel log configured ([nvml] kmsg unset)",
                Duration::ZERO,
            );
        };
        let out = work.join(name);
        match collect::kernel_log(&src, &out, since_boot_us(since), cap) {
            Ok(false) => Part::ok(name, out, t.elapsed()),
            Ok(true) => Part {
                problem: Some(format!("cut at {cap} bytes")),
                ..Part::ok(name, out, t.elapsed())
            },
            Err(why) => Part::failed(name, why, t.elapsed()),
        }
    }

    fn journal_part(&self, incident: &Incident, work: &Path) -> Part {
        let out = work.join("incident.json");
        match serde_json::to_vec_pretty(incident)
            .map_err(|e| e.to_string())
            .and_then(|b| std::fs::write(&out, b).map_err(|e| e.to_string()))
        {
            Ok(()) => Part::ok("incident.json", out, Duration::ZERO),
            Err(why) => Part::failed("incident.json", why, Duration::ZERO),
        }
    }

    fn inputs_part(&self, work: &Path, since: Timestamp, cap: u64) -> Part {
        let t = Instant::now();
        let name = "inputs.jsonl";
        let out = work.join(name);
        let Ok(f) = std::fs::File::create(&out) else {
            return Part::failed(
                name,
                format!("cannot write {}", out.display()),
                Duration::ZERO,
            );
        };
        let mut w = std::io::BufWriter::new(f);
        let r = self.records.inputs_since(since, cap, &mut w);
        let flushed = std::io::Write::flush(&mut w).map_err(|e| e.to_string());
        match r.and_then(|cut| flushed.map(|()| cut)) {
            Err(err) => Part {
                problem: Some(format!("inputs.jsonl: {err}")),
                ..Part::ok(name, out, t.elapsed())
            },
            Ok(true) => Part {
                problem: Some(format!("cut at {cap} bytes")),
                ..Part::ok(name, out, t.elapsed())
            },
            Ok(false) => Part::ok(name, out, t.elapsed()),
        }
    }

    /// gpu-medic's own NVML readings, when `nvidia-smi` cannot run: the GPU state the engine
    /// holds and the NVML observations of the window.
    fn nvml_readings(&self, work: &Path, since: Timestamp, cap: u64, why: &str) -> Part {
        let name = "nvml-readings.json";
        let doc = serde_json::json!({
            "why": format!("nvidia-smi could not run ({why}): gpu-medic's own NVML readings instead"),
            "readings": self.records.nvml_readings(since, cap),
        });
        let out = work.join(name);
        match serde_json::to_vec_pretty(&doc)
            .map_err(|e| e.to_string())
            .and_then(|b| std::fs::write(&out, b).map_err(|e| e.to_string()))
        {
            Ok(()) => Part::ok(name, out, Duration::ZERO),
            Err(err) => Part::failed(name, err, Duration::ZERO),
        }
    }

    /// The MPS daemon's log for the window: its unit's journal, or its log files.
    async fn mps_log(&self, work: &Path, since: Timestamp, cap: u64, timeout: Duration) -> Part {
        let t = Instant::now();
        let name = "mps-daemon.log";
        let out = work.join(name);
        let m = &self.cfg.mps;
        let journal = matches!(m.logs, MpsLogs::Journald)
            || (matches!(m.logs, MpsLogs::Auto) && m.manage == crate::config::MpsManage::Systemd);
        if journal {
            let mut cmd =
                tokio::process::Command::new(crate::sys::journalctl::default_journalctl());
            cmd.args([
                "--no-pager",
                "--output=short-iso-precise",
                "--unit",
                m.unit.as_str(),
            ])
            .arg(format!("--since=@{}", since.0 / 1000));
            if let Some(d) = &m.journal_directory {
                cmd.arg("--directory").arg(d);
            }
            return match collect::run_to_file(cmd, &out, cap, timeout).await {
                collect::Ran::Exited {
                    code: Some(0),
                    cut: false,
                    ..
                } => Part::ok(name, out, t.elapsed()),
                collect::Ran::Exited { code, cut, .. } => Part {
                    problem: Some(if cut {
                        format!("cut at {cap} bytes")
                    } else {
                        format!("journalctl exited with {code:?}")
                    }),
                    ..Part::ok(name, out, t.elapsed())
                },
                collect::Ran::TimedOut { .. } => Part {
                    problem: Some(format!("journalctl cut at {}", shown(timeout))),
                    ..Part::ok(name, out, t.elapsed())
                },
                collect::Ran::Missing(e) => {
                    Part::failed(name, format!("journalctl not run: {e}"), t.elapsed())
                }
            };
        }
        let Ok(mut f) = std::fs::File::create(&out) else {
            return Part::failed(name, format!("cannot write {}", out.display()), t.elapsed());
        };
        let mut problems = Vec::new();
        for file in ["control.log", "server.log"] {
            if let Err(why) = collect::append_tail(&m.log_directory.join(file), &mut f, cap / 2) {
                problems.push(why);
            }
        }
        if problems.len() == 2 {
            return Part::failed(name, problems.join("; "), t.elapsed());
        }
        Part {
            problem: (!problems.is_empty()).then(|| problems.join("; ")),
            ..Part::ok(name, out, t.elapsed())
        }
    }
}

const MIB: u64 = 1024 * 1024;

/// The archive name of an operator's collection for `incident` made at `at`.
pub fn on_demand_name(incident: IncidentId, at: Timestamp) -> String {
    format!("{}-on-demand-{}", incident.0, at.0)
}

/// A duration as people read it, to the millisecond (`3s 987ms`, not `3s 987ms 332us 461ns`).
pub(crate) fn shown(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_millis(duration_ms(d)))
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// `since` as microseconds after this boot (for `/dev/kmsg` record times), from
/// `/proc/uptime`; None when it cannot be told.
fn since_boot_us(since: Timestamp) -> Option<u64> {
    let up = crate::sys::limits::read_text(Path::new("/proc/uptime"), 4096, "uptime").ok()?;
    let secs: f64 = up.split_whitespace().next()?.parse().ok()?;
    let boot_ms = Timestamp::now().0.saturating_sub((secs * 1000.0) as u64);
    Some(since.0.saturating_sub(boot_ms).saturating_mul(1000))
}

/// The driver's version from `/proc/driver/nvidia/version` (its first line).
fn driver_version() -> String {
    match crate::sys::limits::read_text(
        Path::new("/proc/driver/nvidia/version"),
        64 * 1024,
        "driver version",
    ) {
        Ok(t) => t.lines().next().unwrap_or("").trim().to_string(),
        Err(e) => format!("unknown ({e})"),
    }
}

#[derive(Serialize)]
struct ManifestPart<'a> {
    name: &'a str,
    stored_bytes: u64,
    size_bytes: u64,
    took_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    problem: Option<String>,
}

/// Writes the archive: every part, then `manifest.json` (each part, its size, what went
/// wrong). Returns the archive and what is missing or cut.
fn build(
    path: &Path,
    max: u64,
    part_cap: u64,
    parts: &[Part],
    ident: &NodeIdentity,
    incident: IncidentId,
) -> std::io::Result<(archive::Finished, Vec<MissingPart>)> {
    let mut a = archive::Archive::create(path, max, Timestamp::now().0 / 1000)?;
    let mut manifest = Vec::new();
    let mut missing = Vec::new();
    for p in parts {
        let mut problem = p.problem.clone();
        let (mut stored, mut size) = (0, 0);
        if let Some(f) = &p.file {
            match a.add_file(&p.name, f, part_cap) {
                Ok(added) => {
                    (stored, size) = (added.stored, added.size);
                    if added.stored < added.size && problem.is_none() {
                        problem = Some(format!(
                            "cut at {} of {} bytes (part or archive cap)",
                            added.stored, added.size
                        ));
                    }
                }
                Err(e) => problem = Some(format!("not archived: {e}")),
            }
        }
        if let Some(why) = &problem {
            missing.push(MissingPart {
                part: p.name.clone(),
                why: why.clone(),
            });
        }
        manifest.push(ManifestPart {
            name: &p.name,
            stored_bytes: stored,
            size_bytes: size,
            took_ms: duration_ms(p.took),
            problem,
        });
    }
    let doc = serde_json::json!({
        "incident": incident,
        "instance": ident,
        "parts": manifest,
        "made_at": Timestamp::now(),
    });
    a.add_bytes(
        "manifest.json",
        &serde_json::to_vec_pretty(&doc).unwrap_or_default(),
    )?;
    Ok((a.finish()?, missing))
}

impl EvidenceRemedy for Evidence {
    fn plan(&self) -> EvidencePlan {
        EvidencePlan {
            mode: self.cfg.evidence.mode,
            deadline: self.cfg.evidence.deadline,
        }
    }

    fn collect(&self, order: &Order) -> BoxFuture<'_, Result<(Done, EvidenceRef), RemedyError>> {
        let order = order.clone();
        Box::pin(async move {
            let left = order.deadline.since(Timestamp(self.clock.now_ms()));
            let until = Instant::now() + left.saturating_sub(MARGIN);
            let name = order.incident.0.to_string();
            let (r, ids) = self.collect_until(order.incident, &name, until).await?;
            let detail = format!("evidence archive {}", r.summary());
            Ok((
                Done {
                    detail,
                    request_ids: ids,
                },
                r,
            ))
        })
    }
}

/// Uploads what waits in the spool at start, then every [`SWEEP_INTERVAL`], until `stop`.
pub async fn sweep_loop(ev: Arc<Evidence>, stop: tokio_util::sync::CancellationToken) {
    let mut first = true;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            n = ev.sweep(first) => {
                if n > 0 {
                    tracing::info!(archives = n, "evidence: spooled archives uploaded");
                }
            }
        }
        first = false;
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(SWEEP_INTERVAL) => {}
        }
    }
}
