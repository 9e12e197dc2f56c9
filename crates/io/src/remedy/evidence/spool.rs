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
//! SHA-256 its record says ([`Spool::verify`]).
//!
//! Every file in the spool counts against its cap ([`Spool::usage`]): gpu-medic's archives,
//! records and collections' scratch folders, and files it did not make, which are reported
//! (never deleted: they are someone's) and leave less room for the archive. Making room drops
//! gpu-medic's own oldest waiting archives, and scratch folders a crashed collection left
//! ([`STALE_SCRATCH`]); what is still not room enough cuts the archive to what is left, and
//! with less than [`MIN_ROOM`] left (or a spool too large to count) no archive is made and the
//! collection says why. The only bytes not counted are the running collection's own parts,
//! each within `part_max_mib`, which exist for the minutes of the collection and are removed
//! once the archive is made.

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
/// A collection's scratch folder older than this was left by a collection that crashed (one
/// runs for its deadline, minutes): gpu-medic's own, removed when room is made.
pub const STALE_SCRATCH: std::time::Duration = std::time::Duration::from_secs(3600);
/// Less room than this left for an archive: none is made (the collection says why).
pub const MIN_ROOM: u64 = 1024 * 1024;
/// Files gpu-medic did not make named in a report (the rest are counted).
const FOREIGN_NAMED: usize = 8;

/// What is in the spool, every file counted ([`Spool::usage`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Bytes of everything counted.
    pub bytes: u64,
    /// Entries gpu-medic did not make: how many, their bytes, the first few names.
    pub foreign: u64,
    pub foreign_bytes: u64,
    pub foreign_named: Vec<String>,
    /// Whether every entry was looked at (a spool of more than [`MAX_SCAN`] entries, or
    /// folders deeper or larger than the walk's bound, cannot be counted whole).
    pub complete: bool,
}

impl Usage {
    /// One line on the files gpu-medic did not make, for the log and the incident; empty
    /// when there are none.
    pub fn foreign_note(&self, max_bytes: u64) -> String {
        if self.foreign == 0 {
            return String::new();
        }
        let more = self.foreign.saturating_sub(self.foreign_named.len() as u64);
        format!(
            "the evidence spool holds {} file(s) gpu-medic did not make, {} of its {} cap ({}{}); they count against the cap and are left alone",
            self.foreign,
            crate::sys::limits::human_bytes(self.foreign_bytes),
            crate::sys::limits::human_bytes(max_bytes),
            self.foreign_named.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        )
    }
}

/// What an entry of the spool is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// An archive, a record or an atomic write's temporary: gpu-medic's.
    Own,
    /// A collection's scratch folder (`work-<name>`).
    Scratch,
    Foreign,
}

fn kind_of(name: &str) -> Kind {
    let own_file = |n: &str| {
        n.strip_suffix(".tar.gz")
            .or_else(|| n.strip_suffix(".json"))
            .is_some_and(valid_name)
    };
    if name.strip_prefix("work-").is_some_and(valid_name) {
        Kind::Scratch
    } else if own_file(name)
        || name
            .strip_prefix('.')
            .and_then(|n| n.strip_suffix(".tmp"))
            .is_some_and(own_file)
    {
        Kind::Own
    } else {
        Kind::Foreign
    }
}

impl Spool {
    pub fn new(dir: PathBuf, max_bytes: u64) -> Spool {
        Spool { dir, max_bytes }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The spool's cap, in bytes.
    pub fn max_bytes(&self) -> u64 {
        self.max_bytes
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

    /// Bytes in the spool, every entry counted ([`Spool::usage`]).
    pub fn used(&self) -> u64 {
        self.usage("").bytes
    }

    /// What the spool holds: archives, records, scratch folders (but `work-<collecting>`,
    /// the running collection's own) and anything else in it, files gpu-medic did not make
    /// named; symlinks by their own size, folders by what they hold (a bounded walk).
    pub fn usage(&self, collecting: &str) -> Usage {
        let mut u = Usage {
            complete: true,
            ..Usage::default()
        };
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return u;
        };
        let mut budget = MAX_SCAN;
        let mut seen = 0usize;
        let own_scratch = format!("work-{collecting}");
        for d in rd.filter_map(Result::ok) {
            seen += 1;
            if seen > MAX_SCAN {
                u.complete = false;
                break;
            }
            let name = d.file_name().to_string_lossy().into_owned();
            if !collecting.is_empty() && name == own_scratch {
                continue;
            }
            let bytes = match d.path().symlink_metadata() {
                Ok(m) if m.is_dir() => dir_bytes(&d.path(), 4, &mut budget, &mut u.complete),
                Ok(m) => m.len(),
                Err(_) => 0,
            };
            u.bytes = u.bytes.saturating_add(bytes);
            if kind_of(&name) == Kind::Foreign {
                u.foreign += 1;
                u.foreign_bytes = u.foreign_bytes.saturating_add(bytes);
                if u.foreign_named.len() < FOREIGN_NAMED {
                    u.foreign_named.push(format!(
                        "{} ({})",
                        crate::model::escape::escape(&name)
                            .to_string()
                            .chars()
                            .take(80)
                            .collect::<String>(),
                        crate::sys::limits::human_bytes(bytes)
                    ));
                }
            }
        }
        u
    }

    /// Removes the scratch folders of collections that crashed (`work-<name>` older than
    /// [`STALE_SCRATCH`], never `work-<keep>`): gpu-medic's own leftovers, which would
    /// otherwise take the spool's room for ever.
    pub fn sweep_scratch(&self, keep: &str) {
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for d in rd.filter_map(Result::ok).take(MAX_SCAN) {
            let name = d.file_name().to_string_lossy().into_owned();
            let stale = d
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age >= STALE_SCRATCH);
            if kind_of(&name) == Kind::Scratch && name != format!("work-{keep}") && stale {
                match std::fs::remove_dir_all(d.path()) {
                    Ok(()) => tracing::warn!(
                        path = %d.path().display(),
                        "evidence: removed the scratch folder of a collection that did not finish"
                    ),
                    Err(e) => tracing::warn!(
                        path = %d.path().display(),
                        "evidence: cannot remove a stale scratch folder: {e}"
                    ),
                }
            }
        }
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
    /// with a log line each. Returns how much room there is now, every file in the spool
    /// counted but `keep`'s own scratch folder (the parts being archived), and what is in it.
    pub fn make_room(&self, need: u64, keep: &str) -> (u64, Usage) {
        let mut usage = self.usage(keep);
        let mut used = usage.bytes;
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
        usage.bytes = used;
        (self.max_bytes.saturating_sub(used), usage)
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
/// their own size. `complete` turns false when a bound stopped the walk.
fn dir_bytes(dir: &Path, depth: u32, budget: &mut usize, complete: &mut bool) -> u64 {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut total = 0u64;
    for d in rd.filter_map(Result::ok) {
        if *budget == 0 {
            *complete = false;
            break;
        }
        *budget -= 1;
        match d.path().symlink_metadata() {
            Ok(m) if m.is_dir() && depth > 0 => {
                total = total.saturating_add(dir_bytes(&d.path(), depth - 1, budget, complete));
            }
            Ok(m) if m.is_dir() => *complete = false,
            Ok(m) => total = total.saturating_add(m.len()),
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
        assert_eq!(s.make_room(10, "9").0, 15 + r1);
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

    /// Every entry counts: archives, records, other collections' scratch and files gpu-medic
    /// did not make (named), but the running collection's own scratch; a crashed
    /// collection's scratch is swept, a running one's is not.
    #[test]
    fn every_file_counts_and_foreign_ones_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let s = Spool::new(dir.path().to_path_buf(), 1 << 20);
        s.ensure().unwrap();
        std::fs::write(s.archive_path("3"), [0u8; 100]).unwrap();
        std::fs::write(dir.path().join(".3.json.tmp"), [0u8; 10]).unwrap();
        std::fs::write(dir.path().join("core.dump"), [0u8; 1000]).unwrap();
        std::fs::create_dir_all(dir.path().join("work-junk/a/b")).unwrap();
        std::fs::write(dir.path().join("work-junk/a/b/x"), [0u8; 500]).unwrap();
        std::fs::create_dir_all(s.work_dir("7")).unwrap();
        std::fs::write(s.work_dir("7").join("part"), [0u8; 2000]).unwrap();
        std::fs::create_dir_all(s.work_dir("8")).unwrap();
        std::fs::write(s.work_dir("8").join("part"), [0u8; 4000]).unwrap();
        let u = s.usage("7");
        assert!(u.complete);
        assert_eq!(u.bytes, 100 + 10 + 1000 + 500 + 4000, "all but work-7");
        assert_eq!((u.foreign, u.foreign_bytes), (2, 1500));
        let note = u.foreign_note(1 << 20);
        assert!(
            note.contains("2 file(s) gpu-medic did not make") && note.contains("core.dump"),
            "{note}"
        );
        assert_eq!(
            s.used(),
            u.bytes + 2000,
            "without a collection running: everything"
        );
        // work-8 is fresh (a running collection's): kept; an old one is swept.
        s.sweep_scratch("7");
        assert!(s.work_dir("8").exists() && dir.path().join("work-junk").exists());
        let old = std::time::SystemTime::now() - STALE_SCRATCH - std::time::Duration::from_secs(1);
        std::fs::File::open(s.work_dir("8"))
            .unwrap()
            .set_modified(old)
            .unwrap();
        s.sweep_scratch("7");
        assert!(
            !s.work_dir("8").exists(),
            "a crashed collection's scratch is swept"
        );
        assert!(
            dir.path().join("work-junk").exists(),
            "not gpu-medic's: left alone"
        );
        assert!(s.work_dir("7").exists());
    }
}
