//! Where a stream was read to: one vocabulary for the probes that read streams (the kernel
//! log, the MPS log files, the MPS daemon's journald unit), the supervisor that journals
//! what they read, and the state that remembers it.
//!
//! - [`StreamId`]: which stream (`kmsg:<boot>`, `kmsg-file:<dev>:<ino>`,
//!   `mps-log:<dev>:<ino>:<generation>`, `journald:<unit>`), named only here.
//! - [`Cursor`]: a position in one stream, carried by the observation read there.
//! - [`Delivery`]: how far the journal reaches, saved in the state.
//! - [`Resume`]: the committed cursors the supervisor hands each source when it starts it,
//!   so no source reads the state file.
//!
//! Serialised as before (a stream id is its string): saved states and journals stay readable.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use super::Timestamp;

/// A stream a source reads, by a name that is stable across restarts of gpu-medic.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StreamId(String);

const MPS_LOG: &str = "mps-log:";
const KMSG_FILE: &str = "kmsg-file:";

impl StreamId {
    /// The kernel log of one boot (`/dev/kmsg` sequence numbers restart at each boot).
    pub fn kmsg(boot: &str) -> StreamId {
        StreamId(format!("kmsg:{boot}"))
    }

    /// A regular file read as the kernel log (a copy, tests), by device and inode;
    /// `generation` changes when it is truncated in place or recreated on the same inode, so
    /// positions never repeat within one stream (generation 0 is named as before
    /// generations existed: saved states stay valid).
    pub fn kmsg_file(dev: u64, ino: u64, generation: u64) -> StreamId {
        if generation == 0 {
            StreamId(format!("{KMSG_FILE}{dev}:{ino}"))
        } else {
            StreamId(format!("{KMSG_FILE}{dev}:{ino}:{generation}"))
        }
    }

    /// For a kernel log file stream of this file: its generation.
    pub fn kmsg_file_generation(&self, dev: u64, ino: u64) -> Option<u64> {
        let rest = self
            .0
            .strip_prefix(KMSG_FILE)?
            .strip_prefix(&format!("{dev}:{ino}"))?;
        match rest.strip_prefix(':') {
            None if rest.is_empty() => Some(0),
            None => None,
            Some(g) => g.parse().ok(),
        }
    }

    /// One MPS log file, by device and inode; `generation` changes when it is truncated in
    /// place, so positions never repeat within one stream.
    pub fn mps_log(dev: u64, ino: u64, generation: u64) -> StreamId {
        StreamId(format!("{MPS_LOG}{dev}:{ino}:{generation}"))
    }

    /// The MPS daemon's journald unit.
    pub fn journald(unit: &str) -> StreamId {
        StreamId(format!("journald:{unit}"))
    }

    /// For an MPS log stream of this file: its generation.
    pub fn mps_log_generation(&self, dev: u64, ino: u64) -> Option<u64> {
        self.0
            .strip_prefix(MPS_LOG)?
            .strip_prefix(&format!("{dev}:{ino}:"))?
            .parse()
            .ok()
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Any string read back from a journal or a test names a stream.
impl From<&str> for StreamId {
    fn from(s: &str) -> StreamId {
        StreamId(s.to_string())
    }
}

impl From<String> for StreamId {
    fn from(s: String) -> StreamId {
        StreamId(s)
    }
}

/// A position in a source stream (see `Observation::cursor`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    pub stream: StreamId,
    /// Increasing within the stream (a sequence number or the byte offset after the record).
    pub pos: u64,
    /// The source's own opaque position where it has one (a journald cursor,
    /// `journald:<unit>` streams): the stream resumes after it, so a record read again is
    /// impossible rather than detected, and `pos` only orders streams by age.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    /// Set by the supervisor on a fatal signal it journals before earlier records of its
    /// stream (a storm still waiting): the stream's cursor does not move with it, the record
    /// is remembered as journaled ahead instead ([`Delivery::ahead`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub ahead: bool,
}

/// How far the inputs and the sources are applied to this state. Saved with it, so that the
/// state, the journal and every source's cursor agree after any restart.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Delivery {
    /// The sequence number of the last `inputs.jsonl` entry this state includes.
    #[serde(default)]
    pub applied: u64,
    /// Per source stream, the highest position applied: a record at or below it, read again
    /// after a restart, is a duplicate.
    #[serde(default)]
    pub cursors: BTreeMap<StreamId, StreamCursor>,
    /// Records journaled ahead of their stream's cursor (a fatal signal stepped before the
    /// storm that arrived with it): each is a duplicate when read again, and is forgotten
    /// once the cursor passes it. At most [`MAX_AHEAD`].
    #[serde(default, skip_serializing_if = "std::collections::BTreeSet::is_empty")]
    pub ahead: std::collections::BTreeSet<(StreamId, u64)>,
}

/// At most this many records are journaled ahead of their streams' cursors at once; a fatal
/// signal beyond them is stepped in arrival order.
pub const MAX_AHEAD: usize = 1024;

/// At most this many streams are remembered (a stream of an earlier boot is dropped first).
pub const MAX_STREAMS: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamCursor {
    pub pos: u64,
    /// When it last moved, to drop the stalest stream first.
    pub at: Timestamp,
    /// The source's opaque position (a journald cursor), see [`Cursor::token`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
}

impl Delivery {
    /// Whether the record at `c` is already applied. A stream with a token resumes after its
    /// token (its reader never hands a record out twice), so nothing of it is a duplicate.
    pub fn seen_cursor(&self, c: &Cursor) -> bool {
        c.token.is_none() && self.seen(&c.stream, c.pos)
    }

    /// Remembers the record at `c` as journaled ahead of its stream's cursor. False (and
    /// nothing remembered) when [`MAX_AHEAD`] records already are, or `c` has a token (its
    /// reader never hands a record out twice, so it needs no such memory).
    pub fn mark_ahead(&mut self, c: &Cursor) -> bool {
        if c.token.is_some() || self.ahead.len() >= MAX_AHEAD {
            return false;
        }
        if !self.seen(&c.stream, c.pos) {
            self.ahead.insert((c.stream.clone(), c.pos));
        }
        true
    }

    /// How many more records can be journaled ahead.
    pub fn ahead_left(&self) -> usize {
        MAX_AHEAD.saturating_sub(self.ahead.len())
    }

    /// Moves the stream of `c` past it (a record journaled ahead is remembered instead). A
    /// token stream follows its reader's order (a
    /// journald entry's time stamp may step back with the clock; its cursor still moves).
    pub fn advance_cursor(&mut self, c: &Cursor, at: Timestamp) {
        if c.ahead {
            // Never moved past the records before it; with no room left (the supervisor
            // checks [`Delivery::ahead_left`] first) a restart may read it once more.
            self.mark_ahead(c);
            return;
        }
        if c.token.is_none() {
            self.advance(&c.stream, c.pos, at);
            return;
        }
        self.cursors.remove(&c.stream);
        self.advance(&c.stream, c.pos, at);
        if let Some(sc) = self.cursors.get_mut(&c.stream) {
            sc.token = c.token.clone();
        }
    }

    /// The token last applied for `stream` (a journald cursor to resume after).
    pub fn token(&self, stream: &StreamId) -> Option<&str> {
        self.cursors.get(stream)?.token.as_deref()
    }

    /// Whether `pos` of `stream` is already applied.
    pub fn seen(&self, stream: &StreamId, pos: u64) -> bool {
        self.cursors.get(stream).is_some_and(|c| pos <= c.pos)
            || (!self.ahead.is_empty() && self.ahead.contains(&(stream.clone(), pos)))
    }

    /// Moves a stream's cursor forward (never back), forgetting what was journaled ahead of
    /// it up to there.
    pub fn advance(&mut self, stream: &StreamId, pos: u64, at: Timestamp) {
        if !self.ahead.is_empty() {
            self.ahead.retain(|(s, p)| s != stream || *p > pos);
        }
        match self.cursors.get_mut(stream) {
            Some(c) => {
                if pos > c.pos {
                    c.pos = pos;
                    c.at = at;
                }
            }
            None => {
                while self.cursors.len() >= MAX_STREAMS {
                    let Some(stalest) = self
                        .cursors
                        .iter()
                        .min_by_key(|(_, c)| c.at)
                        .map(|(k, _)| k.clone())
                    else {
                        break;
                    };
                    self.cursors.remove(&stalest);
                    self.ahead.retain(|(s, _)| *s != stalest);
                }
                self.cursors.insert(
                    stream.clone(),
                    StreamCursor {
                        pos,
                        at,
                        token: None,
                    },
                );
            }
        }
    }
}

/// The committed cursors a source resumes from, handed in by the supervisor (which owns the
/// state) when it starts the source, and the kernel's boot id as the supervisor read it once
/// at start (`[repair] boot_id_path`). Empty on a first start: each source then begins where
/// it always does (the kernel log from its start, a log file at its end).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resume {
    delivery: Delivery,
    boot: String,
}

impl Resume {
    pub fn new(delivery: Delivery) -> Resume {
        Resume {
            delivery,
            boot: String::new(),
        }
    }

    /// This boot's id (empty when it could not be read: a reboot is then not told apart).
    pub fn with_boot(mut self, boot: impl Into<String>) -> Resume {
        self.boot = boot.into();
        self
    }

    /// The kernel's boot id of this boot, one reading for every source.
    pub fn boot(&self) -> &str {
        &self.boot
    }

    /// Whether `pos` of `stream` is already journaled (a record read again is a duplicate).
    pub fn seen(&self, stream: &StreamId, pos: u64) -> bool {
        self.delivery.seen(stream, pos)
    }

    /// The token journaled last for `stream`.
    pub fn token(&self, stream: &StreamId) -> Option<&str> {
        self.delivery.token(stream)
    }

    /// Every committed stream and its position.
    pub fn streams(&self) -> impl Iterator<Item = (&StreamId, &StreamCursor)> {
        self.delivery.cursors.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_ids_serialise_as_the_strings_saved_states_hold() {
        let mut d = Delivery::default();
        d.advance(&StreamId::kmsg("b1"), 7, Timestamp(1));
        let json = serde_json::to_string(&d).unwrap();
        assert!(json.contains("\"kmsg:b1\""), "{json}");
        let mut m = Delivery::default();
        m.advance(&StreamId::mps_log(1, 2, 0), 9, Timestamp(5));
        let json = serde_json::to_string(&m).unwrap();
        assert!(json.contains("\"mps-log:1:2:0\""), "{json}");
        let back: Delivery = serde_json::from_str(&json).unwrap();
        assert!(back.seen(&StreamId::mps_log(1, 2, 0), 9));
        assert!(!back.seen(&StreamId::mps_log(1, 2, 0), 10));
    }

    /// A record journaled ahead of its stream is seen (a duplicate when read again) while
    /// the records before it are not, and is forgotten once the cursor passes it.
    #[test]
    fn a_record_journaled_ahead_is_seen_until_the_cursor_passes_it() {
        let s = StreamId::kmsg("b");
        let mut d = Delivery::default();
        d.advance(&s, 10, Timestamp(1));
        let fatal = Cursor {
            stream: s.clone(),
            pos: 50,
            token: None,
            ahead: true,
        };
        d.advance_cursor(&fatal, Timestamp(2));
        assert!(d.seen(&s, 50) && d.seen(&s, 10));
        assert!(!d.seen(&s, 11) && !d.seen(&s, 49) && !d.seen(&s, 51));
        let back: Delivery = serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
        assert_eq!(back, d);
        d.advance(&s, 49, Timestamp(3));
        assert!(d.seen(&s, 50) && !d.ahead.is_empty());
        d.advance(&s, 51, Timestamp(4));
        assert!(d.ahead.is_empty() && d.seen(&s, 50));
        // Bounded: beyond MAX_AHEAD a record is not remembered.
        for p in 0..MAX_AHEAD as u64 {
            assert!(d.mark_ahead(&Cursor {
                pos: 1000 + p,
                ..fatal.clone()
            }));
        }
        assert_eq!(d.ahead_left(), 0);
        assert!(!d.mark_ahead(&Cursor {
            pos: 5000,
            ..fatal.clone()
        }));
        assert_eq!(d.ahead.len(), MAX_AHEAD);
    }

    #[test]
    fn an_mps_log_stream_names_its_generation() {
        let s = StreamId::mps_log(3, 4, 2);
        assert_eq!(s.mps_log_generation(3, 4), Some(2));
        assert_eq!(StreamId::kmsg_file(3, 4, 0).as_str(), "kmsg-file:3:4");
        assert_eq!(
            StreamId::kmsg_file(3, 4, 0).kmsg_file_generation(3, 4),
            Some(0)
        );
        assert_eq!(
            StreamId::kmsg_file(3, 4, 9).kmsg_file_generation(3, 4),
            Some(9)
        );
        assert_eq!(
            StreamId::kmsg_file(3, 45, 9).kmsg_file_generation(3, 4),
            None
        );
        assert_eq!(
            StreamId::kmsg_file(3, 4, 9).kmsg_file_generation(3, 45),
            None
        );
        assert_eq!(s.mps_log_generation(3, 5), None);
        assert_eq!(StreamId::kmsg("3:4:2").mps_log_generation(3, 4), None);
    }
}
