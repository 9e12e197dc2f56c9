//! One bound for every record: each string and list that comes from outside gpu-medic (an AWS
//! error message, an MPS or kernel log line, a task name, the clients of an MPS fault block)
//! is cut to a fixed size, with a marker saying how much was cut, before it is stepped,
//! journaled, exported or put in an incident. The sizes are chosen so that the largest
//! bounded record encodes far below the journal's line cap
//! ([`crate::limits::MAX_JOURNAL_LINE`]): whatever the journal writes, it reads back.

use super::{
    Command, Drill, EvidenceRef, GpuId, IncidentEvent, Input, Observation, OperatorRequest, Order,
    Outcome, Record, ScheduledEvent, Signal,
};

/// Free text (a driver message, an AWS error, a log block): 8 KiB.
pub const MAX_TEXT: usize = 8 * 1024;
/// Text the engine composes from such pieces (a reason, a summary, a note): 16 KiB.
pub const MAX_COMPOSED: usize = 16 * 1024;
/// A name or an identifier (a task ARN, a component, a rule, a stream, a request id).
pub const MAX_NAME: usize = 512;
/// Items of a list (pids, tasks, request ids, findings).
pub const MAX_ITEMS: usize = 256;
/// The largest counter or position accepted from a file (`state.json`, `inputs.jsonl`, the
/// export cursor) or a source (a stream position): far beyond what a node's lifetime reaches
/// (2^62 inputs), far enough below `u64::MAX` that every counter can still advance. A larger
/// value is corruption, refused where it is read, never saturated later.
pub const MAX_COUNTER: u64 = 1 << 62;
/// The largest incident or action id a rebuild from the journal trusts: half the ceiling. A
/// journal line numbered above it (forged, corrupt) is left out of the rebuild, so a rebuilt
/// counter keeps 2^61 ids of room below [`MAX_COUNTER`]: a start after a rebuild never writes
/// a counter the next start refuses (which would set the state aside on every start).
pub const MAX_REBUILT_ID: u64 = 1 << 61;
/// Incidents open at once, at most. The engine never comes near it (a node remediation, an MPS
/// restart, stop-tasks per GPU, gpu-medic's own faults); past it the oldest open incident no
/// work holds is closed `abandoned` with a reason, and a rebuild keeps the newest this many, so
/// `state.json` and memory stay bounded whatever the journal holds.
pub const MAX_OPEN_INCIDENTS: usize = 1024;
/// Repairs (reboots) of a node the engine remembers, the oldest forgotten first; far more than
/// any window counts. The policy bounds `[reboot] limit` and a rule's `reboots` by it.
pub const MAX_REBOOT_HISTORY: usize = 32;

/// Cuts `s` to at most `max` bytes (at a character boundary), ending it with a marker that
/// says how many bytes were cut. Returns whether it cut.
pub fn cut(s: &mut String, max: usize) -> bool {
    if s.len() <= max {
        return false;
    }
    let marker = |n: usize| format!(" …[{n} bytes cut]");
    // The marker itself takes room: keep what fits with it.
    let room = max.saturating_sub(marker(s.len()).len());
    let mut at = room.min(s.len());
    while at > 0 && !s.is_char_boundary(at) {
        at -= 1;
    }
    let cut_bytes = s.len() - at;
    s.truncate(at);
    s.push_str(&marker(cut_bytes));
    true
}

/// Cuts a list to [`MAX_ITEMS`], each name to [`MAX_NAME`]; returns how many items went.
fn cut_names(v: &mut Vec<String>) -> usize {
    let gone = v.len().saturating_sub(MAX_ITEMS);
    v.truncate(MAX_ITEMS);
    for s in v.iter_mut() {
        cut(s, MAX_NAME);
    }
    gone
}

fn note_dropped(detail: &mut Option<String>, what: &str, n: usize) {
    if n > 0 {
        let d = detail.get_or_insert_with(String::new);
        if !d.is_empty() {
            d.push_str("; ");
        }
        d.push_str(&format!("{n} more {what} not listed"));
    }
}

impl GpuId {
    pub fn bound(&mut self) {
        cut(&mut self.uuid, MAX_NAME);
        cut(&mut self.pci_bus_id, MAX_NAME);
        if let Some(s) = &mut self.serial {
            cut(s, MAX_NAME);
        }
    }
}

impl Signal {
    pub fn bound(&mut self) {
        match self {
            Signal::SelfFault { component } | Signal::SelfRecovered { component } => {
                cut(component, MAX_NAME);
            }
            Signal::EcsAgentHealth { status: s }
            | Signal::SpotInterruption { action: s, .. }
            | Signal::SpotNoticeGone { action: s, .. } => {
                cut(s, MAX_NAME);
            }
            Signal::MaintenanceEvent { event } => event.bound(),
            _ => {}
        }
    }
}

impl ScheduledEvent {
    pub fn bound(&mut self) {
        cut(&mut self.id, MAX_NAME);
        cut(&mut self.code, MAX_NAME);
        cut(&mut self.description, MAX_TEXT);
        cut(&mut self.boot_id, MAX_NAME);
    }
}

impl EvidenceRef {
    pub fn bound(&mut self) {
        cut(&mut self.uri, MAX_TEXT);
        cut(&mut self.sha256, MAX_NAME);
        self.missing.truncate(MAX_ITEMS);
        for m in self.missing.iter_mut() {
            cut(&mut m.part, MAX_NAME);
            cut(&mut m.why, MAX_TEXT);
        }
    }
}

impl Observation {
    /// Bounds every field that carries outside text or lists (see the module docs).
    pub fn bound(&mut self) {
        self.signal.bound();
        if let Some(g) = &mut self.gpu {
            g.bound();
        }
        let pids = self.pids.len().saturating_sub(MAX_ITEMS);
        self.pids.truncate(MAX_ITEMS);
        let tasks = cut_names(&mut self.tasks);
        if let Some(d) = &mut self.detail {
            cut(d, MAX_TEXT);
        }
        note_dropped(&mut self.detail, "processes", pids);
        note_dropped(&mut self.detail, "tasks", tasks);
        cut(&mut self.source, MAX_NAME);
        if let Some(x) = &mut self.xid {
            x.bound();
        }
        if let Some(c) = &mut self.cursor {
            // A stream name or token that does not fit is no position: drop it rather than
            // keep a cut one that would match another stream.
            // Nor is one past what a saved position may be (a state holding it is refused).
            if c.stream.as_str().len() > MAX_NAME
                || c.token.as_ref().is_some_and(|t| t.len() > MAX_TEXT)
                || c.pos > crate::model::MAX_COUNTER
            {
                self.cursor = None;
            }
        }
    }
}

impl super::repair::Repair {
    pub fn bound(&mut self) {
        cut(&mut self.rule, MAX_NAME);
        cut(&mut self.boot_before, MAX_NAME);
        if let Some(b) = &mut self.boot_after {
            cut(b, MAX_NAME);
        }
        cut(&mut self.why, MAX_TEXT);
    }
}

impl Outcome {
    pub fn bound(&mut self) {
        cut(&mut self.detail, MAX_TEXT);
        if let Some(e) = &mut self.evidence {
            e.bound();
        }
        if let Some(f) = &mut self.fleet {
            cut(&mut f.group, MAX_NAME);
        }
        let gone = cut_names(&mut self.request_ids);
        if gone > 0 {
            self.detail.push_str(&format!("; {gone} more request ids"));
        }
    }
}

impl Command {
    pub fn bound(&mut self) {
        if let Command::StopTasks { gpu, pids, tasks } = self {
            gpu.bound();
            pids.truncate(MAX_ITEMS);
            cut_names(tasks);
        }
    }
}

impl Order {
    pub fn bound(&mut self) {
        self.command.bound();
    }
}

impl OperatorRequest {
    pub fn bound(&mut self) {
        match self {
            OperatorRequest::Abort { by, .. } => {
                cut(by, MAX_NAME);
            }
            OperatorRequest::LaunchGate {
                health,
                summary,
                findings,
                request_ids,
            } => {
                cut(health, MAX_NAME);
                cut(summary, MAX_TEXT);
                findings.truncate(MAX_ITEMS);
                for f in findings.iter_mut() {
                    cut(f, MAX_NAME);
                }
                cut_names(request_ids);
            }
            OperatorRequest::Drill { drill } => drill.bound(),
            OperatorRequest::DrillClear { drill, by } => {
                cut(drill, MAX_NAME);
                cut(by, MAX_NAME);
            }
        }
    }
}

impl Drill {
    pub fn bound(&mut self) {
        cut(&mut self.id, MAX_NAME);
        cut(&mut self.class, MAX_NAME);
        cut(&mut self.by, MAX_NAME);
        self.expect.signals.truncate(MAX_ITEMS);
        if let Some(o) = &mut self.inject {
            o.bound();
        }
    }
}

impl Input {
    /// Bounds what came from outside before the engine sees it (the supervisor calls it on
    /// every input).
    pub fn bound(&mut self) {
        match self {
            Input::Observation(o) => o.bound(),
            Input::Outcome(o) => o.bound(),
            Input::Operator(r) => r.bound(),
            Input::Boot { id } => {
                cut(id, MAX_NAME);
            }
            Input::Reboots { reboots, from } => {
                // The newest, as many as the history keeps.
                let gone = reboots.len().saturating_sub(MAX_REBOOT_HISTORY);
                reboots.drain(..gone);
                for r in reboots.iter_mut() {
                    r.bound();
                }
                cut(from, MAX_NAME);
            }
            Input::Started { .. } | Input::Tick => {}
        }
    }
}

impl Record {
    /// Bounds a record before it is journaled: its observation as on input, the engine's
    /// composed text to [`MAX_COMPOSED`].
    pub fn bound(&mut self) {
        if let Some(d) = &mut self.drill {
            cut(d, MAX_NAME);
        }
        match &mut self.event {
            IncidentEvent::Opened {
                observation,
                rule,
                reason,
                ..
            } => {
                observation.bound();
                cut(rule, MAX_NAME);
                cut(reason, MAX_COMPOSED);
            }
            IncidentEvent::Signal { observation } => observation.bound(),
            IncidentEvent::Escalated { rule, reason, .. } => {
                cut(rule, MAX_NAME);
                cut(reason, MAX_COMPOSED);
            }
            IncidentEvent::ActionStarted { order, .. } => order.bound(),
            IncidentEvent::ActionFinished { outcome } => outcome.bound(),
            IncidentEvent::DeadlineMissed { escalation, .. } => {
                cut(escalation, MAX_COMPOSED);
            }
            IncidentEvent::Note { text } => {
                cut(text, MAX_COMPOSED);
            }
            IncidentEvent::Closed { summary, .. } => {
                cut(summary, MAX_COMPOSED);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ActionId, IncidentId, OutcomeStatus, Timestamp};

    /// A cursor past what a saved position may be is dropped, never journaled.
    #[test]
    fn a_cursor_past_the_counter_ceiling_is_no_position() {
        use crate::model::cursor::{Cursor, StreamId};
        let with = |pos: u64| {
            let mut o = Observation::new(Signal::xid(13));
            o.cursor = Some(Cursor {
                stream: StreamId::kmsg("b"),
                pos,
                token: None,
                ahead: false,
            });
            o.bound();
            o.cursor
        };
        assert!(with(crate::model::MAX_COUNTER).is_some());
        assert!(with(crate::model::MAX_COUNTER + 1).is_none());
        assert!(with(u64::MAX).is_none());
    }

    #[test]
    fn text_is_cut_at_a_character_boundary_with_a_marker() {
        let mut s = "é".repeat(10_000);
        assert!(cut(&mut s, 100));
        assert!(s.len() <= 100, "{}", s.len());
        assert!(s.ends_with("bytes cut]"), "{s}");
        let mut short = "abc".to_string();
        assert!(!cut(&mut short, 3));
        assert_eq!(short, "abc");
        for max in 30..60 {
            let mut s = "x".repeat(50);
            cut(&mut s, max);
            assert!(s.len() <= max, "{max}: {s}");
        }
    }

    /// The largest bounded record encodes well below the journal's line cap.
    #[test]
    fn a_record_of_huge_parts_encodes_below_the_line_cap() {
        let huge = "x".repeat(3 * 1024 * 1024);
        // Names in long lists: over their own cap, but small enough that a list of thousands
        // stays cheap to build (thousands of 3 MiB strings would be gigabytes).
        let long_name = "n".repeat(4 * MAX_NAME);
        let mut obs = Observation::new(Signal::SelfFault {
            component: huge.clone(),
        })
        .with_detail(huge.clone())
        .with_pids((0..50_000).collect());
        obs.tasks = vec![long_name.clone(); 1000];
        obs.source = huge.clone();
        obs.gpu = Some(GpuId {
            index: 0,
            uuid: huge.clone(),
            pci_bus_id: huge.clone(),
            serial: Some(huge.clone()),
        });
        let mut r = Record {
            at: Timestamp(0),
            incident: IncidentId(1),
            drill: Some(huge.clone()),
            event: IncidentEvent::Opened {
                observation: obs,
                rule: huge.clone(),
                reason: huge.clone(),
                verdict: crate::model::Verdict::Log,
            },
        };
        r.bound();
        let n = serde_json::to_vec(&r).unwrap().len();
        assert!(n < crate::limits::MAX_JOURNAL_LINE / 2, "{n}");
        let IncidentEvent::Opened { observation, .. } = &r.event else {
            unreachable!()
        };
        let d = observation.detail.as_deref().unwrap();
        assert!(d.contains("bytes cut]"), "{}", &d[d.len() - 90..]);
        assert!(d.ends_with("49744 more processes not listed; 744 more tasks not listed"));
        assert_eq!(observation.pids.len(), MAX_ITEMS);

        let mut out = Outcome {
            action: ActionId(1),
            status: OutcomeStatus::Failed { retryable: true },
            detail: huge.clone(),
            request_ids: vec![long_name; 10_000],
            evidence: None,
            fleet: None,
            diagnosis: None,
        };
        out.bound();
        assert!(serde_json::to_vec(&out).unwrap().len() < 256 * 1024);
    }
}
