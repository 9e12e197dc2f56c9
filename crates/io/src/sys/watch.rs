//! Waiting for a regular file to be written (inotify): a follower of a file (the kernel log
//! copied to a file, tests) wakes when a line comes instead of on a timer, so what it reads is
//! handed over at once and an idle follower costs one wake-up per `limit`.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

/// An inotify watch on one file's writes.
pub struct Writes {
    fd: OwnedFd,
}

impl Writes {
    /// Watches `path` for writes (and for being moved, deleted or having its attributes
    /// changed, which a follower also has to look at). `None` where inotify cannot be had
    /// (no descriptors left, no inotify instances): the caller then waits on a timer.
    pub fn watch(path: &Path) -> Option<Writes> {
        let name = CString::new(path.as_os_str().as_bytes()).ok()?;
        // SAFETY: inotify_init1 takes flags only; a negative result is an error.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return None;
        }
        // SAFETY: `raw` was just returned by inotify_init1 and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let mask = libc::IN_MODIFY | libc::IN_ATTRIB | libc::IN_MOVE_SELF | libc::IN_DELETE_SELF;
        // SAFETY: a live inotify descriptor and a NUL-terminated path that outlives the call.
        let wd = unsafe { libc::inotify_add_watch(fd.as_raw_fd(), name.as_ptr(), mask) };
        (wd >= 0).then_some(Writes { fd })
    }

    /// Waits until the file was written since the last wait (at once if it already was) or
    /// `limit` passed, and forgets the events: which write it was does not matter, the
    /// follower reads on from where it is.
    pub fn wait(&self, limit: Duration) {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(limit.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd for the length given.
        let ready = unsafe { libc::poll(&mut p, 1, ms) };
        if ready <= 0 {
            return;
        }
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: reads at most `buf.len()` bytes into `buf` from our own non-blocking
            // descriptor.
            let n = unsafe { libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::time::Instant;

    #[test]
    fn a_write_before_or_during_the_wait_ends_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("log");
        std::fs::write(&p, "").unwrap();
        let w = Writes::watch(&p).expect("inotify");
        // Nothing written: the wait runs its course.
        let t = Instant::now();
        w.wait(Duration::from_millis(50));
        assert!(t.elapsed() >= Duration::from_millis(40));
        // Written before the wait: it ends at once, however long it could have been.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"line\n")
            .unwrap();
        let t = Instant::now();
        w.wait(Duration::from_secs(30));
        assert!(t.elapsed() < Duration::from_secs(10));
        // Written while waiting, from another thread.
        let p2 = p.clone();
        let writer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            std::fs::OpenOptions::new()
                .append(true)
                .open(&p2)
                .unwrap()
                .write_all(b"more\n")
                .unwrap();
        });
        let t = Instant::now();
        w.wait(Duration::from_secs(30));
        assert!(t.elapsed() < Duration::from_secs(10));
        writer.join().unwrap();
        assert!(Writes::watch(&dir.path().join("missing")).is_none());
    }
}
