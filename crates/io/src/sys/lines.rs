//! The capped line reader: one line at a time with a length cap, so a file or device with an
//! endless line never grows memory. The journal readers and the kernel log reader use it.

use std::io::BufRead;

/// One line of a file read with a length cap.
#[derive(Debug, PartialEq, Eq)]
pub enum CappedLine {
    /// A line (without its `\n`), read lossily: invalid UTF-8 becomes U+FFFD.
    Text { text: String, complete: bool },
    /// A line longer than the cap: its bytes were read and dropped, never held.
    TooLong { len: usize },
}

/// Reads one line of at most `cap` bytes from `r`; `None` at the end. Memory is at most
/// `cap` bytes whatever the input; at most `max_scan` bytes are consumed looking for the end
/// of an overlong line (then it is `TooLong` with what was consumed).
pub fn read_capped_line(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    cap: usize,
    max_scan: u64,
) -> std::io::Result<Option<CappedLine>> {
    buf.clear();
    let mut len = 0usize;
    let mut complete = false;
    loop {
        let chunk = match r.fill_buf() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if chunk.is_empty() {
            break;
        }
        let (take, done) = match chunk.iter().position(|b| *b == b'\n') {
            Some(i) => (i + 1, true),
            None => (chunk.len(), false),
        };
        let body = if done { &chunk[..take - 1] } else { chunk };
        if len.saturating_add(body.len()) <= cap {
            buf.extend_from_slice(body);
        }
        len = len.saturating_add(body.len());
        r.consume(take);
        if done {
            complete = true;
            break;
        }
        if len as u64 >= max_scan {
            return Ok(Some(CappedLine::TooLong { len }));
        }
    }
    if len == 0 && !complete {
        return Ok(None);
    }
    if len > cap {
        return Ok(Some(CappedLine::TooLong { len }));
    }
    Ok(Some(CappedLine::Text {
        text: String::from_utf8_lossy(buf).into_owned(),
        complete,
    }))
}
