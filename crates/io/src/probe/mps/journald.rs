//! The daemon's lines from the systemd journal of its unit (`[mps] logs = "journald"` or
//! `"auto"` under systemd): what the ECS GPU AMI's `nvidia-mps.service` gives, since its
//! daemon runs with `-f` and writes no log files (docs/mps.md#logging-under--f).
//!
//! The lines go through the same [`Parser`] and [`ServerFailures`] as the files' lines. Each
//! observation read from the journal carries the entry's journald cursor as its
//! [`Cursor::token`](crate::model::Cursor) (stream `journald:<unit>`); the supervisor saves it
//! with the state only once the observation is journaled, and a restarted gpu-medic follows
//! after it (`journalctl --after-cursor`): nothing is replayed or lost across restarts, as with
//! the kernel log. Without a saved cursor the journal is followed from its end (history is
//! not replayed). A fault block still open at the end of a poll keeps the cursor back, so a
//! restart reads its first lines again. Within one run a `journalctl` that exits is started
//! again after the last entry read. A `journalctl` that cannot be run is a self-fault
//! (component `mps-journal`), reported once; the reader is the adapter [`crate::sys::journalctl`].

use std::time::{Duration, Instant};

use super::logs::{Parser, ServerFailures, observe};
use crate::model::{Cursor, Observation, Signal};
use crate::sys::journalctl::{Reader, Spec};

/// The self-fault component of a journal that cannot be read.
pub const COMPONENT: &str = "mps-journal";
/// How long a reader that failed to start waits before the next try.
const RESPAWN_DELAY: Duration = Duration::from_secs(5);

/// Follows one unit's journal.
pub struct JournalFollow {
    spec: Spec,
    reader: Option<Reader>,
    parser: Parser,
    /// The last entry read: a reader started again resumes after it.
    after: Option<String>,
    stream: crate::model::StreamId,
    /// `journalctl` could not be run on the last try (a self-fault is open).
    unrunnable: bool,
    /// The reader exited or failed to start: warned once until it reads again.
    warned: bool,
    not_before: Option<Instant>,
}

impl JournalFollow {
    pub fn new(spec: Spec) -> Self {
        JournalFollow {
            stream: stream_of(&spec.unit),
            spec,
            reader: None,
            parser: Parser::default(),
            after: None,
            unrunnable: false,
            warned: false,
            not_before: None,
        }
    }

    /// Follows after the cursor journaled last for this unit, if any.
    pub fn resume_from(&mut self, resume: &crate::model::Resume) {
        if let Some(t) = resume.token(&self.stream) {
            self.after = Some(t.to_string());
        }
    }

    /// What it follows (`with_journalctl` builds another from it).
    pub fn spec(&self) -> &Spec {
        &self.spec
    }

    /// Reads what is new; starts the reader first when none runs.
    pub fn poll(
        &mut self,
        crashes: &mut ServerFailures,
        sessions: &mut Vec<super::logs::Session>,
    ) -> Vec<Observation> {
        let mut out = Vec::new();
        if self.reader.is_none() {
            if self.not_before.is_some_and(|t| Instant::now() < t) {
                return out;
            }
            match Reader::spawn(&self.spec, self.after.as_deref()) {
                Ok(r) => {
                    self.reader = Some(r);
                    if std::mem::take(&mut self.unrunnable) {
                        out.push(
                            Observation::new(Signal::SelfRecovered {
                                component: COMPONENT.into(),
                            })
                            .with_detail(format!("{} runs again", self.spec.journalctl.display()))
                            .from_source("mps"),
                        );
                    }
                }
                Err(e) => {
                    self.not_before = Some(Instant::now() + RESPAWN_DELAY);
                    if e.missing {
                        if !self.unrunnable {
                            tracing::error!(
                                probe = "mps",
                                "{e}; the MPS daemon's journal of {} is not read (self-fault)",
                                self.spec.unit
                            );
                            out.push(
                                Observation::new(Signal::SelfFault {
                                    component: COMPONENT.into(),
                                })
                                .with_detail(format!(
                                    "{e}; server faults and crash loops in the journal of {} are not seen",
                                    self.spec.unit
                                ))
                                .from_source("mps"),
                            );
                        }
                        self.unrunnable = true;
                    } else if !std::mem::replace(&mut self.warned, true) {
                        tracing::warn!(probe = "mps", "{e}; trying again");
                    }
                    return out;
                }
            }
        }
        let Some(reader) = self.reader.as_mut() else {
            return out;
        };
        let entries = match reader.drain() {
            Ok(e) => e,
            Err(status) => {
                if !std::mem::replace(&mut self.warned, true) {
                    tracing::warn!(
                        probe = "mps",
                        unit = %self.spec.unit,
                        "journalctl following the MPS daemon's journal exited ({status}); starting it again"
                    );
                }
                self.reader = None;
                self.not_before = Some(Instant::now() + Duration::from_secs(1));
                Vec::new()
            }
        };
        let mut events = Vec::new();
        if entries.is_empty() {
            self.parser.flush(&mut events);
        } else {
            self.warned = false;
        }
        let mut last = None;
        for e in entries {
            self.parser.feed(&e.message, &mut events);
            last = Some((e.cursor, e.realtime_us));
        }
        let mut obs = observe(events, crashes, sessions);
        if let Some((cursor, realtime_us)) = last {
            if !self.parser.in_block()
                && let Some(o) = obs.last_mut()
            {
                o.cursor = Some(Cursor {
                    stream: self.stream.clone(),
                    pos: realtime_us,
                    token: Some(cursor.clone()),
                    ahead: false,
                });
            }
            self.after = Some(cursor);
        }
        out.append(&mut obs);
        out
    }
}

/// The cursor stream of a unit's journal.
pub fn stream_of(unit: &str) -> crate::model::StreamId {
    crate::model::StreamId::journald(unit)
}
