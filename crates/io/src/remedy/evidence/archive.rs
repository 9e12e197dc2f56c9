//! The evidence archive: one `tar.gz` written through the `tar` and `flate2` crates straight
//! to a file in the spool, its SHA-256 computed on the way out, each member read from disk
//! through a size cap. Nothing is held whole in memory; the archive as a whole is capped too
//! (a member that would cross the cap is cut, and the cut is recorded).

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use flate2::Compression;
use flate2::write::GzEncoder;
use sha2::{Digest, Sha256};

/// Counts and hashes what passes through to the file.
struct Hashing<W: Write> {
    inner: W,
    hash: Sha256,
    bytes: u64,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        self.bytes = self.bytes.saturating_add(n as u64);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// What one member became in the archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Added {
    /// Bytes of the member stored.
    pub stored: u64,
    /// Its size on disk (more than `stored` when it was cut).
    pub size: u64,
}

/// A finished archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub path: PathBuf,
    pub bytes: u64,
    pub sha256: String,
}

pub struct Archive {
    tar: tar::Builder<GzEncoder<Hashing<BufWriter<File>>>>,
    path: PathBuf,
    /// Uncompressed bytes the archive may still take (members and their headers).
    budget: u64,
    mtime: u64,
}

impl Archive {
    /// Creates `path` (replacing a torn one from an earlier run); `max` caps the members'
    /// total, so the compressed archive stays below it.
    pub fn create(path: &Path, max: u64, mtime_unix: u64) -> std::io::Result<Archive> {
        let file = File::create(path)?;
        let hashing = Hashing {
            inner: BufWriter::new(file),
            hash: Sha256::new(),
            bytes: 0,
        };
        let mut tar = tar::Builder::new(GzEncoder::new(hashing, Compression::default()));
        tar.mode(tar::HeaderMode::Deterministic);
        Ok(Archive {
            tar,
            path: path.to_path_buf(),
            budget: max,
            mtime: mtime_unix,
        })
    }

    fn header(&self, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_size(size);
        h.set_mode(0o644);
        h.set_mtime(self.mtime);
        h.set_entry_type(tar::EntryType::Regular);
        h
    }

    /// Adds a member from bytes in memory (small parts: the manifest, identity).
    pub fn add_bytes(&mut self, name: &str, data: &[u8]) -> std::io::Result<Added> {
        let size = data.len() as u64;
        let stored = size.min(self.budget.saturating_sub(1024));
        let mut h = self.header(stored);
        self.tar
            .append_data(&mut h, name, &data[..usize::try_from(stored).unwrap_or(0)])?;
        self.budget = self.budget.saturating_sub(stored.saturating_add(1024));
        Ok(Added { stored, size })
    }

    /// Adds a member from a file on disk, at most `cap` bytes of it (and what the archive
    /// cap leaves). Only regular files are read.
    pub fn add_file(&mut self, name: &str, file: &Path, cap: u64) -> std::io::Result<Added> {
        let f = crate::sys::limits::open_checked(
            file,
            crate::sys::limits::Kind::Regular,
            u64::MAX,
            "an evidence part",
        )
        .map_err(|e| std::io::Error::other(format!("{}: {e}", file.display())))?;
        let meta = f.metadata()?;
        let size = meta.len();
        let stored = size.min(cap).min(self.budget.saturating_sub(1024));
        let mut h = self.header(stored);
        // A file that shrank under us would make the tar stream short: pad with zeros.
        let reader = f.take(stored).chain(std::io::repeat(0)).take(stored);
        self.tar.append_data(&mut h, name, reader)?;
        self.budget = self.budget.saturating_sub(stored.saturating_add(1024));
        Ok(Added { stored, size })
    }

    /// Writes the tar trailer and the gzip footer, fsyncs, and returns size and SHA-256.
    pub fn finish(self) -> std::io::Result<Finished> {
        let gz = self.tar.into_inner()?;
        let mut hashing = gz.finish()?;
        hashing.flush()?;
        let Hashing { inner, hash, bytes } = hashing;
        let file = inner.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(Finished {
            path: self.path,
            bytes,
            sha256: hex::encode(hash.finalize()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_capped_and_the_checksum_is_of_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'x'; 100_000]).unwrap();
        let out = dir.path().join("a.tar.gz");
        let mut a = Archive::create(&out, 1 << 20, 0).unwrap();
        let added = a.add_file("big.txt", &big, 10_000).unwrap();
        assert_eq!(
            added,
            Added {
                stored: 10_000,
                size: 100_000
            }
        );
        a.add_bytes("m.json", b"{}").unwrap();
        let f = a.finish().unwrap();
        let bytes = std::fs::read(&out).unwrap();
        assert_eq!(f.bytes, bytes.len() as u64);
        assert_eq!(f.sha256, hex::encode(Sha256::digest(&bytes)));
        let mut t = tar::Archive::new(flate2::read::GzDecoder::new(&bytes[..]));
        let names: Vec<(String, u64)> = t
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (e.path().unwrap().display().to_string(), e.size())
            })
            .collect();
        assert_eq!(names, [("big.txt".into(), 10_000), ("m.json".into(), 2)]);
    }

    #[test]
    fn the_archive_cap_cuts_the_member_that_crosses_it() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'y'; 50_000]).unwrap();
        let mut a = Archive::create(&dir.path().join("a.tar.gz"), 21_024, 0).unwrap();
        assert_eq!(a.add_file("one", &big, u64::MAX).unwrap().stored, 20_000);
        assert_eq!(a.add_file("two", &big, u64::MAX).unwrap().stored, 0);
        a.finish().unwrap();
    }
}
