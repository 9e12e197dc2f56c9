//! The daemon's logs: `control.log` and `server.log` in `CUDA_MPS_LOG_DIRECTORY`, tailed for
//! what the control pipe cannot tell: servers that die (each an `mps-crash`), servers that
//! hit a fatal exception, and the Volta+ fatal-fault block naming the poisoned GPUs and the
//! clients with sticky errors (docs/mps.md#log-formats, docs/mps.md#fault-containment-on-volta-and-later).
//!
//! Line format: `[YYYY-MM-DD HH:MM:SS.mmm <Tag> <pid>] <message>`, tag `Control`, `Server`,
//! `Other` or `Legacy Server`, pid right-aligned. Lines that do not parse are skipped; the
//! parser never panics on garbage; lines are read lossily and capped. The first look at a file
//! resumes at the position last journaled for it (`state.json`, see the supervisor), or at
//! its end when there is none (history is not replayed); a file that shrank was truncated
//! (read from 0), a new inode was rotated in (read from 0). At most [`MAX_READ`] is read per
//! poll; a larger backlog is skipped to the file's last [`BACKLOG_KEEP`] with a warning.
//! Under `-f` (ECS's unit) the daemon logs to stdout, not to these files: its lines are read
//! from the unit's journal instead ([`super::journald`]), through the same parser.
//!
//! The devices of a fault block are the daemon's CUDA ordinals. They are reported as
//! `GpuId::index_only(n)`, which is the NVML index when the daemon runs without
//! `CUDA_VISIBLE_DEVICES` (as ECS's unit does) on an instance with identical GPUs (CUDA's
//! fastest-first order then falls back to PCI order, NVML's order).

use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::model::{GpuId, Observation, Resume, Signal, StreamId};

/// A server's exit line and its own failure line name one failure: a pid seen this recently
/// (by the log's own timestamps) is not reported again.
pub const SAME_SERVER: Duration = Duration::from_secs(60);
/// Server pids remembered for that at most.
const RECENT_SERVERS: usize = 64;
/// At most this much is read from one file per poll; the rest waits for the next poll.
pub const MAX_READ: u64 = 8 * 1024 * 1024;
/// A backlog larger than [`MAX_READ`] (a junk flood, a resumed offset far behind) is skipped
/// with a warning, down to this much of the file's end: a fault line written now is read at
/// the next poll, not minutes later.
pub const BACKLOG_KEEP: u64 = 1024 * 1024;
/// Sessions kept between two looks of the probe (the rest of a flood is not needed to
/// learn a cadence).
pub const MAX_SESSIONS: usize = 64;
/// A line longer than this is dropped.
const MAX_LINE: usize = 16 * 1024;

/// One parsed log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLine<'a> {
    /// Milliseconds of the (local, zone-less) timestamp since 1970-01-01 00:00 of that zone;
    /// only differences are meaningful.
    pub at_ms: i64,
    pub tag: &'a str,
    pub pid: u32,
    pub msg: &'a str,
}

/// Parses `[2026-11-30 05:39:57.503 Control 13020] message`; `None` for anything else.
pub fn parse_line(line: &str) -> Option<LogLine<'_>> {
    let rest = line.strip_prefix('[')?;
    let close = rest.find(']')?;
    let (head, tail) = (rest.get(..close)?, rest.get(close + 1..)?);
    let msg = tail
        .strip_prefix(' ')
        .unwrap_or(tail)
        .trim_end_matches('\r');
    let date = head.get(..10)?;
    let time = head.get(11..23)?;
    if head.as_bytes().get(10) != Some(&b' ') {
        return None;
    }
    let who = head.get(23..)?.trim();
    let (tag, pid) = who.rsplit_once(' ')?;
    let tag = tag.trim();
    if tag.is_empty() {
        return None;
    }
    let pid: u32 = pid.parse().ok()?;
    Some(LogLine {
        at_ms: parse_stamp(date, time)?,
        tag,
        pid,
        msg,
    })
}

fn num(s: &str) -> Option<i64> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `2026-11-30`, `05:39:57.503` to milliseconds since the epoch of the same (unknown) zone.
fn parse_stamp(date: &str, time: &str) -> Option<i64> {
    let mut d = date.split('-');
    let (y, mo, da) = (num(d.next()?)?, num(d.next()?)?, num(d.next()?)?);
    let (hms, ms) = time.split_once('.')?;
    let mut t = hms.split(':');
    let (h, mi, s) = (num(t.next()?)?, num(t.next()?)?, num(t.next()?)?);
    let ms = num(ms)?;
    if d.next().is_some()
        || t.next().is_some()
        || !(1..=12).contains(&mo)
        || !(1..=31).contains(&da)
        || h > 23
        || mi > 59
        || s > 60
        || ms > 999
    {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if mo <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (mo + 9) % 12;
    let doy = (153 * mp + 2) / 5 + da - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(((days * 24 + h) * 60 + mi) * 60_000 + s * 1000 + ms)
}

/// What a log line (or a block of them) means for the supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogEvent {
    /// `Server <pid> exited with status <n>`.
    ServerExited { at_ms: i64, pid: u32, status: i64 },
    /// A server could not start (`Failed to start`, `MPS server failed to start`, ...).
    StartFailed { at_ms: i64, pid: u32, line: String },
    /// `Server encountered a fatal exception. Shutting down`.
    FatalException { line: String },
    /// The Volta+ fatal-fault block: devices whose clients are all poisoned.
    Fault {
        devices: Vec<u32>,
        clients: Vec<u32>,
    },
    /// A front-end session the control daemon served (`NEW UI`, its `Cmd:` lines, `UI
    /// closed`): gpu-medic's own probe, the ECS agent's, an operator's. Not a finding; the
    /// probe learns from them when others talk to the daemon ([`super::cadence`]).
    Session(Session),
}

/// One front-end session as the control daemon logged it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Session {
    /// When it opened (`NEW UI`), in the log's own local, zone-less milliseconds.
    pub at_ms: i64,
    /// Its commands as typed (at most [`MAX_SESSION_COMMANDS`]).
    pub commands: Vec<String>,
}

/// The commands of one session kept; a front-end that types more is still one session.
pub const MAX_SESSION_COMMANDS: usize = 8;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
enum Block {
    #[default]
    Idle,
    Devices(Vec<u32>),
    Clients(Vec<u32>, Vec<u32>),
}

/// Turns lines into events; holds the state of a fault block spanning several lines.
///
/// A block belongs to the process that began it (the prefix's tag and pid): in the journal
/// of a daemon run with `-f` the control daemon's own lines (a probe's session, a server
/// start) and the server's share one stream and may fall between the block's lines. Those are
/// read as lines of their own and leave the block as it is.
#[derive(Debug, Default)]
pub struct Parser {
    block: Block,
    /// The tag and pid of the line that began the block.
    owner: Option<(String, u32)>,
    /// The front-end session the control daemon serves now.
    session: Option<Session>,
}

impl Parser {
    /// Feeds one raw line. Garbage is skipped.
    pub fn feed(&mut self, raw: &str, out: &mut Vec<LogEvent>) {
        let Some(line) = parse_line(raw) else {
            return;
        };
        let msg = line.msg.trim();
        if line.tag == "Control" && self.session_line(&line, msg, out) {
            return;
        }
        if let Some((tag, pid)) = &self.owner
            && (tag != line.tag || *pid != line.pid)
        {
            // Another process's line in the middle of the block.
            if let Some(ev) = single_line_event(&line, msg) {
                out.push(ev);
            }
            return;
        }
        let bare_number = || -> Option<u32> {
            if msg.is_empty() || !msg.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            msg.parse().ok()
        };
        match &mut self.block {
            Block::Devices(devs) => {
                if let Some(n) = bare_number() {
                    devs.push(n);
                    return;
                }
                if msg.contains("following clients have a sticky error") {
                    let devs = std::mem::take(devs);
                    self.block = Block::Clients(devs, Vec::new());
                    return;
                }
                self.flush(out);
            }
            Block::Clients(_, pids) => {
                if let Some(n) = bare_number() {
                    pids.push(n);
                    return;
                }
                self.flush(out);
            }
            Block::Idle => {}
        }
        if msg.contains("The following devices") {
            self.block = Block::Devices(Vec::new());
            self.owner = Some((line.tag.to_string(), line.pid));
        } else if let Some(ev) = single_line_event(&line, msg) {
            out.push(ev);
        }
    }

    /// A control daemon line that opens, adds to or closes a front-end session; `false` for
    /// any other line. A session never closed (the daemon died) ends when the next opens.
    fn session_line(&mut self, line: &LogLine<'_>, msg: &str, out: &mut Vec<LogEvent>) -> bool {
        if msg == "NEW UI" {
            if let Some(open) = self.session.take() {
                out.push(LogEvent::Session(open));
            }
            self.session = Some(Session {
                at_ms: line.at_ms,
                commands: Vec::new(),
            });
            return true;
        }
        if msg == "UI closed" {
            if let Some(open) = self.session.take() {
                out.push(LogEvent::Session(open));
            }
            return true;
        }
        if let Some(cmd) = msg.strip_prefix("Cmd:")
            && let Some(open) = &mut self.session
        {
            if open.commands.len() < MAX_SESSION_COMMANDS {
                open.commands.push(cmd.trim().chars().take(128).collect());
            }
            return true;
        }
        false
    }

    /// Ends a block in progress (the file went quiet).
    pub fn flush(&mut self, out: &mut Vec<LogEvent>) {
        self.owner = None;
        match std::mem::take(&mut self.block) {
            Block::Idle => {}
            Block::Devices(devices) if devices.is_empty() => {}
            Block::Devices(devices) => out.push(LogEvent::Fault {
                devices,
                clients: Vec::new(),
            }),
            Block::Clients(devices, _) if devices.is_empty() => {}
            Block::Clients(devices, clients) => out.push(LogEvent::Fault { devices, clients }),
        }
    }

    /// Whether a block is waiting for more lines.
    pub fn in_block(&self) -> bool {
        self.block != Block::Idle
    }
}

fn single_line_event(line: &LogLine<'_>, msg: &str) -> Option<LogEvent> {
    if let Some(rest) = msg.strip_prefix("Server ")
        && let Some((pid, status)) = rest.split_once(" exited with status ")
    {
        let pid = pid.trim().parse().ok()?;
        let status = status.trim().parse().ok()?;
        return Some(LogEvent::ServerExited {
            at_ms: line.at_ms,
            pid,
            status,
        });
    }
    if msg.starts_with("Server encountered a fatal exception") {
        return Some(LogEvent::FatalException {
            line: msg.to_string(),
        });
    }
    let lower = msg.to_ascii_lowercase();
    if lower.starts_with("failed to start")
        || lower.contains("server failed to start")
        || lower.contains("failed to create/open shm")
    {
        return Some(LogEvent::StartFailed {
            at_ms: line.at_ms,
            pid: line.pid,
            line: msg.to_string(),
        });
    }
    None
}

/// One `mps-crash` per failed server: its exit line and its own failure line are one. How
/// many crashes make a loop is the policy's (`mps-crash-loop`'s `confirm` window), judged by
/// the engine, not here.
#[derive(Debug, Default)]
pub struct ServerFailures {
    recent: VecDeque<(i64, u32)>,
}

impl ServerFailures {
    /// A failure of server `pid` at `at_ms`; `None` when it was already reported.
    pub fn record(&mut self, at_ms: i64, pid: u32, what: String) -> Option<Observation> {
        let horizon = SAME_SERVER.as_millis() as i64;
        self.recent
            .retain(|(t, _)| at_ms.saturating_sub(*t) < horizon && *t <= at_ms);
        if self.recent.iter().any(|(_, p)| *p == pid) {
            return None;
        }
        if self.recent.len() >= RECENT_SERVERS {
            self.recent.pop_front();
        }
        self.recent.push_back((at_ms, pid));
        Some(
            Observation::new(Signal::MpsCrash)
                .with_value(1)
                .with_detail(format!("MPS {what}"))
                .from_source("mps"),
        )
    }
}

/// Turns events into observations; the sessions go to `sessions`.
pub fn observe(
    events: Vec<LogEvent>,
    crashes: &mut ServerFailures,
    sessions: &mut Vec<Session>,
) -> Vec<Observation> {
    let mut out = Vec::new();
    for ev in events {
        match ev {
            LogEvent::Session(s) => {
                if sessions.len() < MAX_SESSIONS {
                    sessions.push(s);
                }
            }
            LogEvent::ServerExited { status: 0, .. } => {}
            LogEvent::ServerExited { at_ms, pid, status } => out.extend(crashes.record(
                at_ms,
                pid,
                format!("server {pid} exited with status {status}"),
            )),
            LogEvent::StartFailed { at_ms, pid, line } => {
                out.extend(crashes.record(at_ms, pid, format!("server {pid}: {line}")))
            }
            LogEvent::FatalException { line } => out.push(
                Observation::new(Signal::MpsServerFault)
                    .with_detail(format!("MPS control daemon: {line}"))
                    .from_source("mps"),
            ),
            LogEvent::Fault { devices, clients } => {
                for d in &devices {
                    out.push(
                        Observation::new(Signal::MpsServerFault)
                            .on_gpu(GpuId::index_only(*d))
                            .with_pids(clients.clone())
                            .with_detail(format!(
                                "MPS server fatal GPU fault on devices {devices:?}; clients with a sticky error: {clients:?}"
                            ))
                            .from_source("mps"),
                    );
                }
            }
        }
    }
    out
}

/// How much of the control log's end is read once for the sessions in it.
pub const SESSION_BACKLOG: u64 = 64 * 1024;

/// The front-end sessions in the last [`SESSION_BACKLOG`] bytes of a control log (only
/// sessions: the faults there were the tail's to read, and it starts at the file's end).
/// Nothing when the file cannot be read.
pub fn recent_sessions(path: &Path) -> Vec<Session> {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = crate::sys::limits::open_checked(
        path,
        crate::sys::limits::Kind::Regular,
        u64::MAX,
        "an MPS log",
    ) else {
        return Vec::new();
    };
    let len = f.metadata().map_or(0, |m| m.len());
    let from = len.saturating_sub(SESSION_BACKLOG);
    let mut buf = Vec::new();
    if f.seek(SeekFrom::Start(from)).is_err()
        || f.take(SESSION_BACKLOG).read_to_end(&mut buf).is_err()
    {
        return Vec::new();
    }
    let text = String::from_utf8_lossy(&buf);
    let mut lines = text.lines();
    if from > 0 {
        lines.next(); // the tail of a line cut by the window
    }
    let mut parser = Parser::default();
    let mut events = Vec::new();
    for l in lines {
        parser.feed(l, &mut events);
    }
    parser.flush(&mut events);
    let mut sessions: Vec<Session> = events
        .into_iter()
        .filter_map(|e| match e {
            LogEvent::Session(s) => Some(s),
            _ => None,
        })
        .collect();
    let extra = sessions.len().saturating_sub(MAX_SESSIONS);
    sessions.drain(..extra);
    sessions
}

/// Follows one file by offset.
#[derive(Debug)]
pub struct Tail {
    path: PathBuf,
    /// `None` before the first look.
    pos: Option<Pos>,
    partial: Vec<u8>,
    /// The bytes before the first line break are the tail of a skipped line.
    skip_to_newline: bool,
    /// Where the first look resumes: the journaled cursors (see [`Tail::resume_from`]).
    resume: Option<Resume>,
    /// Changes when the file is truncated in place, so that positions never repeat within
    /// one stream name.
    generation: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pos {
    ino: u64,
    dev: u64,
    offset: u64,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

impl Tail {
    pub fn new(path: PathBuf) -> Self {
        Tail {
            path,
            pos: None,
            partial: Vec::new(),
            skip_to_newline: false,
            resume: None,
            generation: 0,
        }
    }

    /// The first look resumes at the position last journaled for this file (lines written
    /// while gpu-medic was down are read) instead of at its end.
    pub fn resume_from(&mut self, resume: Resume) {
        self.resume = Some(resume);
    }

    /// The cursor stream of the file now followed.
    pub fn stream(&self) -> Option<StreamId> {
        self.pos
            .filter(|p| p.ino != 0)
            .map(|p| StreamId::mps_log(p.dev, p.ino, self.generation))
    }

    /// The offset just past the last complete line handed out.
    pub fn consumed(&self) -> u64 {
        self.pos
            .map_or(0, |p| p.offset.saturating_sub(self.partial.len() as u64))
    }

    /// Where the first look starts: the journaled position of this file, else its end.
    fn first_offset(&mut self, dev: u64, ino: u64, len: u64) -> u64 {
        let found = self.resume.take().and_then(|r| {
            r.streams()
                .filter_map(|(k, c)| Some((k.mps_log_generation(dev, ino)?, c)))
                .max_by_key(|(_, c)| c.at)
                .map(|(generation, c)| (generation, c.pos))
        });
        match found {
            Some((generation, pos)) if pos <= len => {
                self.generation = generation;
                pos
            }
            Some(_) => {
                self.generation = now_ms(); // truncated while gpu-medic was down
                0
            }
            None => len, // never journaled: start at the end, do not replay history
        }
    }

    /// New complete lines since the last call, each with the offset just past it.
    pub fn read_new(&mut self) -> Vec<(String, u64)> {
        use std::os::unix::fs::MetadataExt;
        // Opened without blocking and checked to be a regular file: a FIFO in its place would
        // hang the probe, a device never ends.
        let Ok(mut f) = crate::sys::limits::open_checked(
            &self.path,
            crate::sys::limits::Kind::Regular,
            u64::MAX,
            "an MPS log",
        ) else {
            // Missing (not yet created, or rotated away), or not a log file: whatever appears
            // next is new.
            self.pos = Some(Pos {
                ino: 0,
                dev: 0,
                offset: 0,
            });
            self.partial.clear();
            self.skip_to_newline = false;
            return Vec::new();
        };
        let Ok(meta) = f.metadata() else {
            return Vec::new();
        };
        let (ino, dev, len) = (meta.ino(), meta.dev(), meta.len());
        let mut offset = match self.pos {
            None => self.first_offset(dev, ino, len),
            Some(p) if p.ino != ino || p.dev != dev => {
                self.partial.clear();
                self.skip_to_newline = false;
                self.generation = 0;
                0 // rotated: a new file
            }
            Some(p) if len < p.offset => {
                self.partial.clear();
                self.skip_to_newline = false;
                self.generation = now_ms();
                0 // truncated
            }
            Some(p) => p.offset,
        };
        if len.saturating_sub(offset) > MAX_READ {
            let to = len - BACKLOG_KEEP;
            tracing::warn!(
                probe = "mps",
                path = %self.path.display(),
                skipped_bytes = to - offset,
                "MPS log backlog too large; skipped to the last {} of the file",
                crate::sys::limits::human_bytes(BACKLOG_KEEP)
            );
            offset = to;
            self.partial.clear();
            self.skip_to_newline = true;
        }
        self.pos = Some(Pos { ino, dev, offset });
        if len == offset {
            return Vec::new();
        }
        if f.seek(SeekFrom::Start(offset)).is_err() {
            return Vec::new();
        }
        let mut buf = Vec::new();
        let n = match f.take(MAX_READ).read_to_end(&mut buf) {
            Ok(n) => n as u64,
            Err(_) => return Vec::new(),
        };
        self.pos = Some(Pos {
            ino,
            dev,
            offset: offset + n,
        });
        self.split(&buf, offset)
    }

    fn split(&mut self, buf: &[u8], start: u64) -> Vec<(String, u64)> {
        let mut lines = Vec::new();
        let mut rest = buf;
        let mut at = start;
        while let Some(i) = rest.iter().position(|b| *b == b'\n') {
            at += i as u64 + 1;
            if std::mem::take(&mut self.skip_to_newline) {
                self.partial.clear();
                rest = &rest[i + 1..];
                continue;
            }
            self.partial.extend_from_slice(&rest[..i]);
            if self.partial.len() <= MAX_LINE {
                lines.push((String::from_utf8_lossy(&self.partial).into_owned(), at));
            }
            self.partial.clear();
            rest = &rest[i + 1..];
        }
        if !self.skip_to_newline {
            self.partial.extend_from_slice(rest);
        }
        if self.partial.len() > MAX_LINE {
            // An endless line: drop it up to its end; its tail is not a line of its own.
            self.partial.clear();
            self.skip_to_newline = true;
        }
        lines
    }
}

/// The daemon's lines: both log files with their parsers, and the unit's journal, with one
/// crash window (a daemon writes to one or the other, never both).
pub struct LogWatch {
    files: Vec<(Tail, Parser)>,
    journal: Option<super::journald::JournalFollow>,
    crashes: ServerFailures,
    sessions: Vec<Session>,
    /// The control log whose recent sessions are read once, at the first poll.
    backlog: Option<PathBuf>,
}

impl LogWatch {
    /// The files in `log_dir` only.
    pub fn new(log_dir: &Path) -> Self {
        LogWatch {
            files: ["control.log", "server.log"]
                .into_iter()
                .map(|n| (Tail::new(log_dir.join(n)), Parser::default()))
                .collect(),
            journal: None,
            crashes: ServerFailures::default(),
            sessions: Vec::new(),
            backlog: Some(log_dir.join("control.log")),
        }
    }

    /// What `cfg` says to read (`[mps] logs`).
    pub fn for_config(cfg: &crate::config::MpsConfig) -> Self {
        let mut w = LogWatch::new(&cfg.log_directory);
        if !cfg.reads_files() {
            w.files.clear();
            w.backlog = None;
        }
        if cfg.reads_journal() {
            w.journal = Some(super::journald::JournalFollow::new(
                crate::sys::journalctl::Spec {
                    matches: Vec::new(),
                    from_start: false,
                    journalctl: crate::sys::journalctl::default_journalctl().to_path_buf(),
                    unit: cfg.unit.clone(),
                    directory: cfg.journal_directory.clone(),
                },
            ));
        }
        w
    }

    /// Uses another `journalctl` (tests: a missing one).
    pub fn with_journalctl(mut self, journalctl: &Path) -> Self {
        if let Some(j) = self.journal.take() {
            let spec = crate::sys::journalctl::Spec {
                matches: Vec::new(),
                from_start: false,
                journalctl: journalctl.to_path_buf(),
                ..j.spec().clone()
            };
            self.journal = Some(super::journald::JournalFollow::new(spec));
        }
        self
    }

    /// Resumes each file at the position last journaled (see [`Tail::resume_from`]), and the
    /// journal after its last journaled cursor.
    pub fn resume_from(&mut self, resume: &Resume) {
        for (tail, _) in &mut self.files {
            tail.resume_from(resume.clone());
        }
        if let Some(j) = &mut self.journal {
            j.resume_from(resume);
        }
    }

    /// Reads what is new; a fault block whose file went quiet for a poll is finished. The
    /// last observation from a file carries the file's position, unless a fault block is
    /// still open (its first lines must be read again after a restart).
    pub fn poll(&mut self) -> Vec<Observation> {
        let mut out = Vec::new();
        if let Some(path) = self.backlog.take() {
            self.sessions.extend(recent_sessions(&path));
        }
        for (tail, parser) in &mut self.files {
            let mut events = Vec::new();
            let lines = tail.read_new();
            if lines.is_empty() {
                parser.flush(&mut events);
            }
            for (l, _) in &lines {
                parser.feed(l, &mut events);
            }
            let mut obs = observe(events, &mut self.crashes, &mut self.sessions);
            if !parser.in_block()
                && let (Some(last), Some(stream)) = (obs.last_mut(), tail.stream())
            {
                last.cursor = Some(crate::model::Cursor {
                    stream,
                    pos: tail.consumed(),
                    token: None,
                    ahead: false,
                });
            }
            out.append(&mut obs);
        }
        if let Some(j) = &mut self.journal {
            out.extend(j.poll(&mut self.crashes, &mut self.sessions));
        }
        out
    }

    /// The front-end sessions read since the last call.
    pub fn take_sessions(&mut self) -> Vec<Session> {
        std::mem::take(&mut self.sessions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn events(lines: &[&str]) -> Vec<LogEvent> {
        let mut p = Parser::default();
        let mut out = Vec::new();
        for l in lines {
            p.feed(l, &mut out);
        }
        p.flush(&mut out);
        out
    }

    #[test]
    fn parses_real_line_formats() {
        let l = parse_line("[2026-11-30 05:39:57.503 Control 13020] Starting control daemon using socket /tmp/p/control").unwrap();
        assert_eq!((l.tag, l.pid), ("Control", 13020));
        assert!(l.msg.starts_with("Starting control daemon"));
        let l = parse_line("[2021-12-19 16:22:21.847 Control     1] NEW UI").unwrap();
        assert_eq!((l.tag, l.pid, l.msg), ("Control", 1, "NEW UI"));
        let l = parse_line(
            "[2024-04-23 06:04:59.389 Legacy Server   425] Failed to start : invalid argument",
        )
        .unwrap();
        assert_eq!((l.tag, l.pid), ("Legacy Server", 425));
        let l = parse_line("[2026-11-30 05:40:29.883 Control 13020] Removed Shm file at ").unwrap();
        assert_eq!(l.msg, "Removed Shm file at ");
        let a = parse_line("[2026-11-30 05:40:29.883 Control 1] x").unwrap();
        let b = parse_line("[2026-12-01 00:00:00.000 Control 1] x").unwrap();
        assert_eq!(b.at_ms - a.at_ms, ((18 * 60 + 19) * 60 + 30) * 1000 + 117);
    }

    #[test]
    fn garbage_is_skipped_never_panics() {
        for bad in [
            "",
            "[",
            "]",
            "[]",
            "[2026-11-30 05:39:57.503 Control] no pid",
            "[2026-11-30 05:39:57.503 13020] no tag",
            "[2026-13-30 05:39:57.503 Control 1] bad month",
            "[2026-11-30 25:39:57.503 Control 1] bad hour",
            "[2026-11-30T05:39:57.503 Control 1] wrong separator",
            "[2026-11-30 05:39:57 Control 1] no millis",
            "[x026-11-30 05:39:57.503 Control 1] letters",
            "[2026-11-30 05:39:57.503 Control 99999999999] pid overflow",
            "no prefix at all: Server 12 exited with status 1",
            "[2026-11-30 05:39:5\u{fffd}\u{fffd}\u{fffd} Control 1] mojibake",
            "[\u{1F600}\u{1F600}\u{1F600}\u{1F600}\u{1F600}\u{1F600}\u{1F600}] emoji",
        ] {
            assert_eq!(parse_line(bad), None, "{bad:?}");
            assert!(events(&[bad]).is_empty(), "{bad:?}");
        }
        // Every prefix of a valid line, cut at any char boundary.
        let good = "[2026-11-30 05:40:29.883 Control 13020] Server 21014 exited with status 1";
        for (i, _) in good.char_indices() {
            let _ = events(&[&good[..i]]);
        }
    }

    /// The Volta fault block from NVIDIA's documentation (docs/mps.md#fatal-fault-block-volta-and-later), with the
    /// normal prefix on every line as the server writes it.
    const FAULT_BLOCK: &[&str] = &[
        "[2026-11-30 06:00:00.001 Server  4428] Volta MPS: status of client {11661, 1} is ACTIVE",
        "[2026-11-30 06:00:00.002 Server  4428] Volta MPS: Server is handling a fatal GPU error.",
        "[2026-11-30 06:00:00.003 Server  4428] Volta MPS: status of client {11641, 1} is INACTIVE",
        "[2026-11-30 06:00:00.004 Server  4428] Volta MPS: The following devices",
        "[2026-11-30 06:00:00.004 Server  4428] 0",
        "[2026-11-30 06:00:00.004 Server  4428] 1",
        "[2026-11-30 06:00:00.005 Server  4428] Volta MPS: The following clients have a sticky error set:",
        "[2026-11-30 06:00:00.005 Server  4428] 11641",
        "[2026-11-30 06:00:00.005 Server  4428] 11643",
        "[2026-11-30 06:00:00.006 Server  4428] Client {11641, 1} exit",
        "[2026-11-30 06:00:00.010 Server  4428] Volta MPS: Destroy server context on device 0",
        "[2026-11-30 06:00:00.020 Server  4428] Volta MPS: Creating server context on device 0",
    ];

    #[test]
    fn fault_block_gives_one_fault_per_gpu_with_the_sticky_clients() {
        let ev = events(FAULT_BLOCK);
        assert_eq!(
            ev,
            vec![LogEvent::Fault {
                devices: vec![0, 1],
                clients: vec![11641, 11643]
            }]
        );
        let obs = observe(ev, &mut ServerFailures::default(), &mut Vec::new());
        assert_eq!(obs.len(), 2);
        for (o, gpu) in obs.iter().zip([0, 1]) {
            assert_eq!(o.signal, Signal::MpsServerFault);
            assert_eq!(o.gpu, Some(GpuId::index_only(gpu)));
            assert_eq!(o.pids, vec![11641, 11643]);
            assert_eq!(o.source, "mps");
        }
    }

    /// The control daemon's session lines as it writes them (tests/support/MPS-FACTS.md,
    /// section 4): one session per `NEW UI`, its commands in order; a fault block whose lines
    /// a session interleaves stays whole.
    #[test]
    fn sessions_are_read_with_their_commands() {
        let mut lines = vec![
            "[2026-11-30 05:40:05.351 Control 13020] Accepting connection...",
            "[2026-11-30 05:40:05.351 Control 13020] NEW UI",
            "[2026-11-30 05:40:05.351 Control 13020] Cmd:get_default_active_thread_percentage",
            "[2026-11-30 05:40:05.351 Control 13020] 100.0",
        ];
        lines.extend_from_slice(&FAULT_BLOCK[..5]);
        lines.extend_from_slice(&[
            "[2026-11-30 05:40:05.352 Control 13020] Cmd:get_server_list",
            "[2026-11-30 05:40:05.352 Control 13020] UI closed",
        ]);
        lines.extend_from_slice(&FAULT_BLOCK[5..]);
        lines.extend_from_slice(&[
            "[2026-11-30 05:40:35.000 Control 13020] NEW UI",
            "[2026-11-30 05:40:35.000 Control 13020] Cmd:get_default_active_thread_percentage",
        ]);
        // The daemon died mid-session: the next one ends it.
        lines.extend_from_slice(&[
            "[2026-11-30 05:41:00.000 Control 13999] NEW UI",
            "[2026-11-30 05:41:00.000 Control 13999] UI closed",
        ]);
        let ev = events(&lines);
        let at = |s: &str| parse_line(s).unwrap().at_ms;
        let session = |t: &str, cmds: &[&str]| {
            LogEvent::Session(Session {
                at_ms: at(t),
                commands: cmds.iter().map(|c| c.to_string()).collect(),
            })
        };
        assert_eq!(
            ev,
            vec![
                session(
                    lines[1],
                    &["get_default_active_thread_percentage", "get_server_list"]
                ),
                LogEvent::Fault {
                    devices: vec![0, 1],
                    clients: vec![11641, 11643]
                },
                session(
                    lines[lines.len() - 4],
                    &["get_default_active_thread_percentage"]
                ),
                session(lines[lines.len() - 2], &[]),
            ]
        );
        let mut sessions = Vec::new();
        let obs = observe(ev, &mut ServerFailures::default(), &mut sessions);
        assert_eq!(obs.len(), 2, "a session is no finding: {obs:?}");
        assert_eq!(sessions.len(), 3);
    }

    #[test]
    fn control_lines_between_a_servers_block_lines_leave_the_block_whole() {
        // Under -f the journal holds the control daemon's lines and the server's in one
        // stream: a probe's session and a server exit fall inside the block.
        let control = [
            "[2026-11-30 06:00:00.004 Control  4400] Accepting connection...",
            "[2026-11-30 06:00:00.004 Control  4400] NEW UI",
            "[2026-11-30 06:00:00.005 Control  4400] Cmd:get_default_active_thread_percentage",
            "[2026-11-30 06:00:00.005 Control  4400] 100",
            "[2026-11-30 06:00:00.005 Control  4400] Server 4399 exited with status 1",
        ];
        let mut lines = FAULT_BLOCK.to_vec();
        lines.insert(5, control[0]);
        lines.insert(6, control[1]);
        lines.insert(9, control[2]);
        lines.insert(10, control[3]);
        lines.insert(12, control[4]);
        assert_eq!(
            events(&lines),
            vec![
                LogEvent::ServerExited {
                    at_ms: parse_line(control[4]).unwrap().at_ms,
                    pid: 4399,
                    status: 1
                },
                LogEvent::Fault {
                    devices: vec![0, 1],
                    clients: vec![11641, 11643]
                }
            ]
        );
    }

    #[test]
    fn fault_block_survives_garbage_and_ends_at_the_file_end() {
        let mut lines = FAULT_BLOCK[..9].to_vec();
        lines.insert(5, "garbled \u{fffd} line");
        lines.insert(8, "");
        // The block is the last thing in the file: flushed when the file goes quiet.
        assert_eq!(
            events(&lines),
            vec![LogEvent::Fault {
                devices: vec![0, 1],
                clients: vec![11641, 11643]
            }]
        );
        // Devices without a client list still name the GPUs.
        let ev = events(&[FAULT_BLOCK[3], FAULT_BLOCK[4], FAULT_BLOCK[9]]);
        assert_eq!(
            ev,
            vec![LogEvent::Fault {
                devices: vec![0],
                clients: vec![]
            }]
        );
        // A header with no devices is nothing.
        assert!(events(&[FAULT_BLOCK[3], FAULT_BLOCK[9]]).is_empty());
    }

    /// The server start-failure loop (k8s-device-plugin #685, #762) in control.log.
    const CRASH_LOOP: &[&str] = &[
        "[2024-04-23 06:04:59.100 Control    72] Starting new server 95 for user 0",
        "[2024-04-23 06:04:59.200 Control    72] Accepting connection...",
        "[2024-04-23 06:04:59.300 Control    72] Server encountered a fatal exception. Shutting down",
        "[2024-04-23 06:04:59.400 Control    72] Server 95 exited with status 1",
        "[2024-04-23 06:04:59.500 Control    72] Starting new server 98 for user 0",
        "[2024-04-23 06:04:59.600 Control    72] Server encountered a fatal exception. Shutting down",
        "[2024-04-23 06:04:59.700 Control    72] Server 98 exited with status 1",
        "[2024-04-23 06:04:59.800 Control    72] Starting new server 101 for user 0",
        "[2024-04-23 06:04:59.900 Control    72] Server encountered a fatal exception. Shutting down",
        "[2024-04-23 06:05:00.000 Control    72] Server 101 exited with status 1",
    ];

    #[test]
    fn every_failed_server_is_one_crash() {
        let mut crashes = ServerFailures::default();
        let obs = observe(events(CRASH_LOOP), &mut crashes, &mut Vec::new());
        let crashed: Vec<_> = obs
            .iter()
            .filter(|o| o.signal == Signal::MpsCrash)
            .collect();
        assert_eq!(crashed.len(), 3, "{obs:?}");
        for (o, pid) in crashed.iter().zip([95, 98, 101]) {
            let d = o.detail.as_deref().unwrap_or("");
            assert!(
                d.contains(&format!("server {pid} exited with status 1")),
                "{d}"
            );
        }
        // Each fatal exception is also reported (without a GPU: the engine records it).
        let faults = obs
            .iter()
            .filter(|o| o.signal == Signal::MpsServerFault)
            .count();
        assert_eq!(faults, 3);
    }

    #[test]
    fn clean_exits_are_no_crash_and_one_server_fails_once() {
        // Clean exits (status 0) never count.
        let clean: Vec<String> = (0..5)
            .map(|i| {
                format!(
                    "[2026-11-30 06:00:0{i}.000 Control 7] Server {} exited with status 0",
                    100 + i
                )
            })
            .collect();
        let clean: Vec<&str> = clean.iter().map(String::as_str).collect();
        assert!(
            observe(
                events(&clean),
                &mut ServerFailures::default(),
                &mut Vec::new()
            )
            .is_empty()
        );
        // A server's own failure line and its exit line are one failure.
        let dup = [
            "[2026-11-30 06:00:00.000 Legacy Server 425] Failed to start : invalid argument",
            "[2026-11-30 06:00:00.100 Control 7] Server 425 exited with status 1",
            "[2026-11-30 06:00:01.000 Other 426] MPS server failed to start",
        ];
        let obs = observe(
            events(&dup),
            &mut ServerFailures::default(),
            &mut Vec::new(),
        );
        assert_eq!(obs.len(), 2, "servers 425 and 426: {obs:?}");
        // The same pid long after is a new failure (a reused pid).
        let later = [
            "[2026-11-30 06:00:00.000 Control 7] Server 9 exited with status 1",
            "[2026-11-30 06:05:00.000 Control 7] Server 9 exited with status 1",
        ];
        assert_eq!(
            observe(
                events(&later),
                &mut ServerFailures::default(),
                &mut Vec::new()
            )
            .len(),
            2
        );
    }

    #[test]
    fn tail_starts_at_the_end_and_follows_truncation_and_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.log");
        let line = |n: u32| {
            format!("[2026-11-30 06:00:00.000 Control 7] Server {n} exited with status 1\n")
        };
        std::fs::write(&path, line(1)).unwrap();
        let mut t = Tail::new(path.clone());
        assert!(t.read_new().is_empty(), "history is not replayed");
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(line(2).as_bytes()).unwrap();
        f.write_all(b"[2026-11-30 06:00:00.000 Control 7] Server 3 exi")
            .unwrap();
        let got = t.read_new();
        assert_eq!(got.len(), 1);
        assert!(got[0].0.contains("Server 2 "));
        f.write_all(b"ted with status 1\n").unwrap();
        let got = t.read_new();
        assert_eq!(got.len(), 1);
        assert!(got[0].0.contains("Server 3 exited"), "{got:?}");
        // Truncated (copytruncate rotation): read from the start.
        std::fs::write(&path, line(4)).unwrap();
        let got = t.read_new();
        assert_eq!(got.len(), 1);
        assert!(got[0].0.contains("Server 4 "));
        // Rotated (rename + new file).
        std::fs::rename(&path, dir.path().join("control.log.1")).unwrap();
        std::fs::write(&path, format!("{}{}", line(5), line(6))).unwrap();
        let got = t.read_new();
        assert_eq!(got.len(), 2, "{got:?}");
        // Missing, then created: everything in it is new.
        std::fs::remove_file(&path).unwrap();
        assert!(t.read_new().is_empty());
        std::fs::write(&path, line(7)).unwrap();
        assert_eq!(t.read_new().len(), 1);
        // A file that did not exist at the first look is read from its start.
        let other = dir.path().join("server.log");
        let mut t2 = Tail::new(other.clone());
        assert!(t2.read_new().is_empty());
        std::fs::write(&other, line(8)).unwrap();
        assert_eq!(t2.read_new().len(), 1);
    }

    #[test]
    fn log_watch_reports_a_fault_written_after_start() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("server.log"), FAULT_BLOCK.join("\n") + "\n").unwrap();
        let mut w = LogWatch::new(dir.path());
        assert!(w.poll().is_empty(), "old faults are not replayed");
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.path().join("server.log"))
            .unwrap();
        f.write_all((FAULT_BLOCK[3..9].join("\n") + "\n").as_bytes())
            .unwrap();
        assert!(w.poll().is_empty(), "the block may continue");
        let obs = w.poll();
        assert_eq!(obs.len(), 2, "{obs:?}");
        assert!(obs.iter().all(|o| o.signal == Signal::MpsServerFault));
    }

    #[test]
    fn a_huge_backlog_is_skipped_and_the_fault_after_it_is_read_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("server.log");
        std::fs::write(&path, "").unwrap();
        let mut w = LogWatch::new(dir.path());
        assert!(w.poll().is_empty());
        let junk = "[2026-11-30 06:00:00.000 Server 7] junk junk junk junk junk junk junk\n";
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        let mut body = junk.repeat((MAX_READ as usize * 2) / junk.len());
        body.push_str(&FAULT_BLOCK[3..9].join("\n"));
        body.push('\n');
        f.write_all(body.as_bytes()).unwrap();
        // One poll reads past the junk to the block; the next (quiet) finishes it.
        assert!(w.poll().is_empty(), "the block may continue");
        let obs = w.poll();
        assert_eq!(obs.len(), 2, "{obs:?}");
        // The last observation of a finished block carries the file's position.
        let c = obs[1].cursor.clone().expect("a cursor");
        assert!(c.stream.as_str().starts_with("mps-log:"), "{c:?}");
        assert_eq!(c.pos, std::fs::metadata(&path).unwrap().len());
    }

    #[test]
    fn a_restart_resumes_at_the_journaled_position() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.log");
        let line = |n: u32| {
            format!("[2026-11-30 06:00:0{n}.000 Control 7] Server {n} exited with status 1\n")
        };
        std::fs::write(&path, line(1)).unwrap();
        let mut t = Tail::new(path.clone());
        assert!(t.read_new().is_empty());
        let stream = t.stream().unwrap();
        let journaled = t.consumed();
        // Written while gpu-medic was down.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        f.write_all(line(2).as_bytes()).unwrap();
        let mut delivery = crate::model::Delivery::default();
        delivery.advance(&stream, journaled, crate::model::Timestamp(1));
        let mut again = Tail::new(path.clone());
        again.resume_from(Resume::new(delivery));
        let got = again.read_new();
        assert_eq!(got.len(), 1, "{got:?}");
        assert!(got[0].0.contains("Server 2 "));
        // Truncated while down: read from the start under a new stream name.
        std::fs::write(&path, line(3)).unwrap();
        let mut t3 = Tail::new(path.clone());
        let mut d = crate::model::Delivery::default();
        d.advance(&stream, 10_000, crate::model::Timestamp(1));
        t3.resume_from(Resume::new(d));
        assert_eq!(t3.read_new().len(), 1);
        assert_ne!(t3.stream(), Some(stream));
    }

    /// A FIFO (or a directory) where the log should be is read as no log, at once: the
    /// probe is never held by it, and the log written there afterwards is followed.
    #[test]
    fn a_fifo_in_place_of_the_log_is_no_log_and_never_blocks() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.log");
        crate::sys::limits::mkfifo(&path);
        let mut t = Tail::new(path.clone());
        let started = std::time::Instant::now();
        assert!(t.read_new().is_empty());
        assert!(t.read_new().is_empty());
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        std::fs::remove_file(&path).unwrap();
        std::fs::write(
            &path,
            "[2026-11-30 06:00:01.000 Control 7] Server 1 exited with status 1\n",
        )
        .unwrap();
        assert_eq!(
            t.read_new().len(),
            1,
            "the real log is followed from its start"
        );
    }
}
