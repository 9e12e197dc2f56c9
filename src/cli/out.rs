//! Output that survives a closed pipe, and shows text others wrote escaped.
//!
//! A closed pipe: std's `println!` panics when stdout is a pipe whose reader has gone
//! (`gpu-medic incidents show 1 | true`): Rust ignores SIGPIPE, so the write fails with EPIPE
//! and the macro turns the error into a panic. Restoring SIGPIPE's default would be worse: the
//! same process writes to its MPS control clients' stdin, and a client that exits early would
//! kill gpu-medic. Here a failed write marks the stream closed and later writes are dropped;
//! the command finishes with its own exit code (a `check` piped into `true` still says healthy
//! or not through its status).
//!
//! Text others wrote: a command's output carries process names, task and container names,
//! driver and MPS messages and AWS errors, any of which can hold a terminal escape or a line
//! break (crate::model::escape). Every line a command prints ([`line`], [`eline`]: the
//! `println!` and `eprintln!` of `crate::cli`) is escaped whole and ended with the one newline
//! it is given, so one `println!` is one line on the terminal whatever its values hold, and
//! none carries a control character. The line's own text is gpu-medic's and escapes to
//! itself; a line break in it is a second `println!`. JSON ([`json`]) is written as JSON, with
//! the characters JSON leaves raw escaped its own way ([`crate::model::escape::json_safe`]).

use std::fmt::{self, Write as _};
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::model::escape::{Escaping, json_safe};

// layout: static allowed: whether this process's own stdout/stderr are gone, a fact about
// the process as global as the streams themselves; no component talks through it.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
// layout: static allowed: as above, for stderr.
static STDERR_CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes one line to stdout, escaped (see the module docs); a no-op once stdout has failed.
pub fn line(args: fmt::Arguments<'_>) {
    let text = escaped(args, "\n");
    write_to(&mut std::io::stdout().lock(), &STDOUT_CLOSED, &text);
}

/// Writes text to stdout, escaped, without ending the line (`print!`).
pub fn text(args: fmt::Arguments<'_>) {
    let text = escaped(args, "");
    write_to(&mut std::io::stdout().lock(), &STDOUT_CLOSED, &text);
}

/// Writes one line to stderr, escaped; a no-op once stderr has failed.
pub fn eline(args: fmt::Arguments<'_>) {
    let text = escaped(args, "\n");
    write_to(&mut std::io::stderr().lock(), &STDERR_CLOSED, &text);
}

/// Writes one JSON document as one line to stdout (see the module docs).
pub fn json(doc: &str) {
    let mut text = json_safe(doc).into_owned();
    text.push('\n');
    write_to(&mut std::io::stdout().lock(), &STDOUT_CLOSED, &text);
}

/// Whether a write to stdout has failed (its reader is gone).
pub fn stdout_closed() -> bool {
    STDOUT_CLOSED.load(Ordering::Relaxed)
}

/// `args` escaped, then `end` as it is.
fn escaped(args: fmt::Arguments<'_>, end: &str) -> String {
    let mut text = String::new();
    // Only a value's own Display can fail; what it wrote until then is kept.
    let _ = Escaping(&mut text).write_fmt(args);
    text.push_str(end);
    text
}

fn write_to(w: &mut dyn Write, closed: &AtomicBool, text: &str) {
    if closed.load(Ordering::Relaxed) {
        return;
    }
    // Any error (EPIPE, EIO, ENOSPC on a redirected file) ends this stream's output: there is
    // nobody to tell but the other stream, and retrying would fail the same way.
    if w.write_all(text.as_bytes()).is_err() {
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
        write_to(&mut w, &closed, "one 1\n");
        assert!(closed.load(Ordering::Relaxed));
        let tries = w.0;
        write_to(&mut w, &closed, "two\n");
        assert_eq!(w.0, tries, "no write after the stream failed");
    }

    #[test]
    fn a_line_is_one_line_without_a_control_character_whatever_its_values_hold() {
        let name = "x\u{1b}[2J\u{1b}[H\nforged row\r\u{202e}";
        let text = escaped(format_args!("{:>4}  {name}  {}", 7, "\\"), "\n");
        assert_eq!(
            text,
            "   7  x\\x1b[2J\\x1b[H\\nforged row\\r\\u{202e}  \\\\\n"
        );
        assert_eq!(text.lines().count(), 1);
        assert!(
            !text
                .trim_end_matches('\n')
                .contains(crate::model::escape::is_control)
        );
    }
}
