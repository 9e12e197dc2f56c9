//! The local spool under `state_dir/evidence`: each archive waits here as
//! `<name>.tar.gz` beside `<name>.json` (the name is the incident's id for the daemon's
//! collection, `<incident>-on-demand-<ms>` for `gpu-medic evidence`) (where it goes, its size and checksum, whether
//! it was uploaded) until S3 has it, so an archive made before a reboot, or while S3 was
//! unreachable, is uploaded after the next start, once. The spool is capped: making room
//! drops the oldest archive with a log line. An uploaded archive's file is removed; its
//! small record stays, so it is never uploaded twice.
//!
//! Nothing leaves the node that gpu-medic did not make: a record only names an archive (by
//! its own file name; the S3 key and bucket are derived again at upload, never taken from
//! it), and the archive is uploaded only when it is a regular file in the spool (not a
//! symlink, not a hard link to a file elsewhere), owned by gpu-medic's user, of the size and
//! SHA-256 its record says ([`Spool::verify`]). Files gpu-medic did not make count against
//! the spool's cap like its own.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What the spool knows about one archive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub incident: u64,
    /// The archive's name in the spool and in its S3 key; empty in records that predate it
    /// (the incident's id then).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    pub bucket: String,
    pub key: String,
    pub bytes: u64,
    pub sha256: String,
    /// Wall clock (ms) when the archive was made.
    pub created_ms: u64,
    #[serde(default)]
    pub uploaded: bool,
    /// The last refusal S3 gave (AccessDenied, a missing bucket): not retried until the next
    /// start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

impl Entry {
    /// The name of the archive's files in the spool.
    pub fn stem(&self) -> String {
        if self.name.is_empty() {
            self.incident.to_string()
        } else {
            self.name.clone()
        }
    }

    pub fn uri(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.key)
    }
}

#[derive(Debug, Clone)]
pub struct Spool {
    dir: PathBuf,
    max_bytes: u64,
}

/// Bound on the records read from the spool directory.
const MAX_ENTRIES: usize = 4096;
/// Bound on the directory entries looked through for them.
const MAX_SCAN: usize = 4 * MAX_ENTRIES;
/// Records of uploaded archives kept.
const KEEP_UPLOADED: usize = 64;
/// Bound on one record's size.
const MAX_RECORD: u64 = 64 * 1024;

impl Spool {
    pub fn new(dir: PathBuf, max_bytes: u64) -> Spool {
        Spool { dir, max_bytes }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn archive_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.tar.gz"))
    }

    fn record_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    /// A scratch folder for one collection's parts (removed by the caller).
    pub fn work_dir(&self, name: &str) -> PathBuf {
        self.dir.join(format!("work-{name}"))
    }

    pub fn ensure(&self) -> std::io::Result<()> {
        std::fs::create_dir_all(&self.dir)
    }

    /// Saves a record atomically and durably: a record that says "uploaded" must survive a
    /// power cut, or the archive would be uploaded twice; one that says "waiting" must not be
    /// torn, or the archive would be orphaned.
    pub fn save(&self, e: &Entry) -> std::io::Result<()> {
        crate::sys::fs::write_json_atomic(
            &self.record_path(&e.stem()),
            e,
            crate::sys::fs::Durability::Durable,
        )
    }

    pub fn load(&self, name: &str) -> Option<Entry> {
        let text = crate::sys::limits::read_text(
            &self.record_path(name),
            MAX_RECORD,
            "evidence spool record",
        )
        .ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Every record, oldest first: at most [`MAX_ENTRIES`], archives still waiting before
    /// uploaded ones (an uploaded record only guards against a second upload), whatever
    /// order the directory lists them in.
    pub fn entries(&self) -> Vec<Entry> {
        let mut out = self.records();
        out.truncate(MAX_ENTRIES);
        out.sort_by_key(|e| (e.created_ms, e.incident));
        out
    }

    /// The records among the first [`MAX_SCAN`] directory entries, waiting ones first.
    fn records(&self) -> Vec<Entry> {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out: Vec<Entry> = rd
            .filter_map(Result::ok)
            .take(MAX_SCAN)
            .filter_map(|d| {
                let name = d.file_name().into_string().ok()?;
                let stem = name.strip_suffix(".json")?;
                // A record names the archive beside it, never another.
                valid_name(stem)
                    .then(|| self.load(stem))?
                    .filter(|e| e.stem() == stem && valid_name(&e.stem()))
            })
            .collect();
        out.sort_by_key(|e| (e.uploaded, e.created_ms, e.incident));
        out
    }

    /// Removes the records of uploaded archives but the newest [`KEEP_UPLOADED`]: their
    /// archives are gone, and a record is only needed while a second upload of the same
    /// archive could still be under way.
    fn prune_uploaded(&self) {
        let mut done: Vec<Entry> = self.records().into_iter().filter(|e| e.uploaded).collect();
        if done.len() <= KEEP_UPLOADED {
            return;
        }
        done.sort_by_key(|e| std::cmp::Reverse((e.created_ms, e.incident)));
        for e in &done[KEEP_UPLOADED..] {
            let _ = std::fs::remove_file(self.record_path(&e.stem()));
        }
    }

    /// Bytes in the spool: its archives, records and anything else in it (a file gpu-medic
    /// did not make counts against the cap too), symlinks by their own size, folders but the
    /// collections' scratch ones by what they hold (a bounded walk).
    pub fn used(&self) -> u64 {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return 0;
        };
        let mut budget = MAX_SCAN;
        let mut total = 0u64;
        for d in rd.filter_map(Result::ok).take(MAX_SCAN) {
            let scratch = d.file_name().to_string_lossy().starts_with("work-");
            match d.path().symlink_metadata() {
                Ok(m) if m.is_dir() && !scratch => {
                    total = total.saturating_add(dir_bytes(&d.path(), 4, &mut budget));
                }
                Ok(m) if !m.is_dir() => total = total.saturating_add(m.len()),
                _ => {}
            }
        }
        total
    }

    /// The archive of `e`, opened for upload when it is gpu-medic's own: a regular file (the
    /// path's last component is not followed) with one link, in the spool under the record's
    /// own name, owned by this process's user, of the record's size and SHA-256. The file
    /// stays open: the upload reads this file, whatever happens to the path meanwhile.
    pub fn verify(&self, e: &Entry) -> Result<std::fs::File, String> {
        use sha2::Digest;
        use std::io::Read;
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let stem = e.stem();
        if !valid_name(&stem) {
            return Err(format!("{stem:?} is not an archive name"));
        }
        let path = self.archive_path(&stem);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
            .map_err(|err| {
                format!(
                    "{}: {err} (not a regular file gpu-medic wrote?)",
                    path.display()
                )
            })?;
        let m = file
            .metadata()
            .map_err(|err| format!("{}: {err}", path.display()))?;
        // SAFETY: geteuid(2) has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        let why = if !m.is_file() {
            Some(format!(
                "is a {}, not a regular file",
                crate::sys::limits::kind_name(m.file_type())
            ))
        } else if m.nlink() != 1 {
            Some(format!(
                "has {} links (a file elsewhere linked in)",
                m.nlink()
            ))
        } else if m.uid() != me {
            Some(format!("is owned by uid {}, not gpu-medic's {me}", m.uid()))
        } else if m.len() != e.bytes {
            Some(format!(
                "holds {} bytes, its record says {}",
                m.len(),
                e.bytes
            ))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(format!("{} {why}", path.display()));
        }
        let mut hash = sha2::Sha256::new();
        let mut buf = vec![0u8; 256 * 1024];
        let mut f = &file;
        loop {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => hash.update(&buf[..n]),
                Err(err) => return Err(format!("{}: {err}", path.display())),
            }
        }
        let sum = hex::encode(hash.finalize());
        if e.sha256.is_empty() || !sum.eq_ignore_ascii_case(&e.sha256) {
            return Err(format!(
                "{}: SHA-256 {sum} is not the {:?} its record says",
                path.display(),
                e.sha256
            ));
        }
        Ok(file)
    }

    /// Makes room for `need` more bytes: drops the oldest waiting archives (never `keep`)
    /// with a log line each. Returns how much room there is now.
    pub fn make_room(&self, need: u64, keep: &str) -> u64 {
        let mut used = self.used();
        for e in self.entries() {
            if used.saturating_add(need) <= self.max_bytes {
                break;
            }
            if e.uploaded || e.stem() == keep {
                continue;
            }
            let path = self.archive_path(&e.stem());
            let len = std::fs::symlink_metadata(&path)
                .map(|m| m.len())
                .unwrap_or(0);
            if std::fs::remove_file(&path).is_ok() {
                let record = self.record_path(&e.stem());
                let rec_len = std::fs::symlink_metadata(&record)
                    .map(|m| m.len())
                    .unwrap_or(0);
                if std::fs::remove_file(&record).is_ok() {
                    used = used.saturating_sub(rec_len);
                }
                used = used.saturating_sub(len);
                tracing::warn!(
                    incident_id = e.incident,
                    uri = %e.uri(),
                    bytes = len,
                    "evidence: spool full; dropped the oldest archive, never uploaded"
                );
            }
        }
        self.max_bytes.saturating_sub(used)
    }

    /// Marks an archive uploaded and removes its file.
    pub fn uploaded(&self, e: &mut Entry) -> std::io::Result<()> {
        e.uploaded = true;
        e.refused = None;
        self.save(e)?;
        let _ = std::fs::remove_file(self.archive_path(&e.stem()));
        self.prune_uploaded();
        Ok(())
    }
}

/// Bytes under `dir`, at most `depth` folders down and `budget` entries in all; symlinks by
/// their own size.
fn dir_bytes(dir: &Path, depth: u32, budget: &mut usize) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut total = 0u64;
    for d in rd.filter_map(Result::ok) {
        if *budget == 0 {
            break;
        }
        *budget -= 1;
        match d.path().symlink_metadata() {
            Ok(m) if m.is_dir() && depth > 0 => {
                total = total.saturating_add(dir_bytes(&d.path(), depth - 1, budget));
            }
            Ok(m) if !m.is_dir() => total = total.saturating_add(m.len()),
            _ => {}
        }
    }
    total
}

/// Whether `name` is an archive's name: an incident id, or `<id>-on-demand-<ms>`.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(incident: u64, created_ms: u64) -> Entry {
        Entry {
            incident,
            name: String::new(),
            bucket: "b".into(),
            key: format!("k/{incident}.tar.gz"),
            bytes: 10,
            sha256: String::new(),
            created_ms,
            uploaded: false,
            refused: None,
        }
    }

    #[test]
    fn a_full_spool_drops_the_oldest_waiting_archive() {
        let dir = tempfile::tempdir().unwrap();
        let s = Spool::new(dir.path().to_path_buf(), 25);
        s.ensure().unwrap();
        for (i, at) in [(1, 100), (2, 200), (3, 300)] {
            std::fs::write(s.archive_path(&i.to_string()), [0u8; 10]).unwrap();
            s.save(&entry(i, at)).unwrap();
        }
        let mut done = s.load("3").unwrap();
        s.uploaded(&mut done).unwrap();
        assert!(!s.archive_path("3").exists());
        let records: u64 = (1..=3)
            .map(|i| {
                std::fs::metadata(s.record_path(&i.to_string()))
                    .unwrap()
                    .len()
            })
            .sum();
        assert_eq!(s.used(), 20 + records, "archives and records");
        let s = Spool::new(dir.path().to_path_buf(), 25 + records);
        // 10 more bytes need one archive out: the oldest waiting, 1.
        let r1 = std::fs::metadata(s.record_path("1")).unwrap().len();
        assert_eq!(s.make_room(10, "9"), 15 + r1);
        assert!(!s.archive_path("1").exists() && s.load("1").is_none());
        assert!(s.archive_path("2").exists());
        assert!(s.load("3").unwrap().uploaded, "the uploaded record stays");
        // An on-demand collection's archive has a name of its own beside the incident's.
        let mut od = entry(2, 400);
        od.name = "2-on-demand-400".into();
        s.save(&od).unwrap();
        assert_eq!(s.entries().len(), 3);
        assert_eq!(s.load("2-on-demand-400").unwrap().stem(), "2-on-demand-400");
        assert!(!valid_name("../x") && !valid_name("") && valid_name("7"));
    }

    /// Records of uploaded archives do not pile up, and an archive still waiting is found
    /// however many records there are.
    #[test]
    fn uploaded_records_are_pruned_and_waiting_ones_always_listed() {
        let dir = tempfile::tempdir().unwrap();
        let s = Spool::new(dir.path().to_path_buf(), 1 << 20);
        s.ensure().unwrap();
        for i in 1..=(MAX_ENTRIES as u64 + 10) {
            let mut e = entry(i, 1_000 + i);
            e.uploaded = true;
            s.save(&e).unwrap();
        }
        std::fs::write(s.archive_path("1"), [0u8; 10]).unwrap();
        s.save(&entry(1, 1)).unwrap(); // waiting, and the oldest of all
        let waiting: Vec<u64> = s
            .entries()
            .iter()
            .filter(|e| !e.uploaded)
            .map(|e| e.incident)
            .collect();
        assert_eq!(waiting, [1]);
        assert!(s.used() >= 10, "the archive and every record");
        let mut one = s.load("2").unwrap();
        s.uploaded(&mut one).unwrap();
        let left = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(
            left,
            KEEP_UPLOADED + 2,
            "kept: the newest uploaded, the waiting one and its archive"
        );
        assert!(s.load("1").is_some_and(|e| !e.uploaded));
    }
}
