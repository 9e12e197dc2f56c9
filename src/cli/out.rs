//! Output that survives a closed pipe. std's `println!` panics when stdout is a pipe whose
//! reader has gone (`gpu-medic incidents show 1 | true`): Rust ignores SIGPIPE, so the write
//! fails with EPIPE and the macro turns the error into a panic. Restoring SIGPIPE's default
//! would be worse: the same process writes to its MPS control clients' stdin, and a client
//! that exits early would kill gpu-medic. Here a failed write marks the stream closed and
//! later writes are dropped; the command finishes with its own exit code (a `check` piped
//! into `true` still says healthy or not through its status).

use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

// layout: static allowed: whether this process's own stdout/stderr are gone, a fact about
// the process as global as the streams themselves; no component talks through it.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
// layout: static allowed: as above, for stderr.
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes to stdout; a no-op once stdout has failed.
pub fn stdout(args: fmt::Arguments<'_>) {
    write_to(&mut std::io::stdout().lock(), &STDOUT_CLOSED, args);
}

/// Writes to stderr; a no-op once stderr has failed.
pub fn stderr(args: fmt::Arguments<'_>) {
    write_to(&mut std::io::stderr().lock(), &STDERR_CLOSED, args);
}

/// Whether a write to stdout has failed (its reader is gone).
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

fn write_to(w: &mut dyn Write, closed: &AtomicBool, args: fmt::Arguments<'_>) {
    if closed.load(Ordering::Relaxed) {
        return;
    }
    // Any error (EPIPE, EIO, ENOSPC on a redirected file) ends this stream's output: there is
    // nobody to tell but the other stream, and retrying would fail the same way.
    if w.write_fmt(args).is_err() {
        closed.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose reader has gone.
    struct Broken(u32);

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            self.0 += 1;
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_broken_pipe_ends_output_without_a_panic_and_stops_writing() {
        let closed = AtomicBool::new(false);
        let mut w = Broken(0);
        write_to(&mut w, &closed, format_args!("one {}\n", 1));
        assert!(closed.load(Ordering::Relaxed));
        let tries = w.0;
        write_to(&mut w, &closed, format_args!("two\n"));
        assert_eq!(w.0, tries, "no write after the stream failed");
    }
}
