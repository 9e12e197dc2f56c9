//! Output that survives a closed pipe. std's `println!` panics when stdout is a pipe whose
//! reader has gone (`gpu-medic incidents show 1 | true`): Rust ignores SIGPIPE, so the write
//! fails with EPIPE and the macro turns the error into a panic. Restoring SIGPIPE's default
//! would be worse: the same process writes to its MPS control clients' stdin, and a client
//! that exits early would kill gpu-medic. Here a failed write is dropped: every later write
//! fails the same way at once (no state is kept), and the command finishes with its own exit
//! code (a `check` piped into `true` still says healthy or not through its status).

use std::fmt;
use std::io::Write;

/// Writes to stdout; a failed write (EPIPE, EIO, ENOSPC on a redirected file) is dropped.
pub fn stdout(args: fmt::Arguments<'_>) {
    write_to(&mut std::io::stdout().lock(), args);
}

/// Writes to stderr; a failed write is dropped.
pub fn stderr(args: fmt::Arguments<'_>) {
    write_to(&mut std::io::stderr().lock(), args);
}

fn write_to(w: &mut dyn Write, args: fmt::Arguments<'_>) {
    // Nobody is left to tell but the other stream, and a retry would fail the same way.
    let _ = w.write_fmt(args);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose reader has gone.
    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
    }

    #[test]
    fn a_broken_pipe_ends_output_without_a_panic() {
        write_to(&mut Broken, format_args!("one {}\n", 1));
        write_to(&mut Broken, format_args!("two\n"));
    }
}
