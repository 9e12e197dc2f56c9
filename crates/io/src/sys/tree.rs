//! Runs a program with a deadline at which its whole process tree dies, including descendants
//! that left its process group with `setsid()` (a daemonizing helper, a test process a tool
//! forks), which [`super::child::GroupKill`] cannot reach. `gpu-medic diagnose` runs DCGM's
//! `dcgmi diag` this way: a diagnostic that hangs must not leave a stress test running on the
//! GPU after gpu-medic has answered "could not tell".
//!
//! How: for the length of a run the calling process is a child subreaper
//! (`PR_SET_CHILD_SUBREAPER`), so a descendant whose parent dies is reparented to us instead
//! of to init, and stays findable. At the deadline, and once the program has exited (to clear
//! what it left behind), every process of the tree is found through `/proc/<pid>/stat` parent
//! links, stopped (`SIGSTOP`, so it cannot fork while we look) and killed (`SIGKILL`), round
//! after round until none is left (bounded), and those reparented to us are reaped.
//!
//! What counts as the tree: the program and every descendant of it; and every process
//! reparented to us that is provably from it: seen in the tree while its parent lived, still in
//! the program's process group, or carrying the per-run marker variable put in the program's
//! environment ([`MARKER_VAR`]). A descendant that clears its environment, leaves the group and
//! is orphaned between two looks (every [`TRACK_EVERY`]) is the one case this cannot find.
//! Nothing else is ever signalled or reaped: other children of this process are left alone.
//!
//! Not for the daemon: being a subreaper and reaping pids changes which process waits for
//! orphans, which would race tokio's own child handling. Use it in short-lived CLI processes
//! (`gpu-medic diagnose`); runs in one process are serialized.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// The environment variable that marks every process of one run.
pub const MARKER_VAR: &str = "GPU_MEDIC_TREE";
/// How often the tree is looked at while the program runs (to learn descendants before they
/// are orphaned).
pub const TRACK_EVERY: Duration = Duration::from_millis(100);
/// How often the program is polled for its exit.
const POLL: Duration = Duration::from_millis(10);
/// Kill rounds before giving up on a tree that keeps forking.
const MAX_ROUNDS: usize = 64;
/// How long the output readers get, once the tree is dead, to see the end of the pipes.
const READER_GRACE: Duration = Duration::from_secs(2);
/// How long a killed program gets to be reaped.
const REAP_GRACE: Duration = Duration::from_secs(5);
/// At most this many `/proc` entries are looked at per scan.
const MAX_PROCS: usize = 1 << 20;
/// `/proc/<pid>/stat` is one line of well under 1 KiB (the command name is at most 16 bytes).
const MAX_STAT: u64 = 4096;
/// How much of `/proc/<pid>/environ` is searched for the marker.
const MAX_ENVIRON: u64 = 1 << 20;

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// The program exited (or was killed by someone else) before the deadline.
    Exited(ExitStatus),
    /// The deadline passed; the whole tree was killed.
    TimedOut(Duration),
}

/// What a run left: how it ended and its capped output.
#[derive(Debug, Clone)]
pub struct TreeOutput {
    pub ended: Ended,
    /// At most `max_out` bytes of standard output, from its start.
    pub stdout: Vec<u8>,
    /// At most `max_out` bytes of standard error, from its start.
    pub stderr: Vec<u8>,
    /// How many bytes the tree wrote to standard output (kept and discarded).
    pub stdout_total: u64,
    /// How many processes of the tree were killed (at the deadline, or left behind).
    pub killed: usize,
    /// How many were still alive after every kill round (stuck in uninterruptible sleep, as a
    /// process inside a hung GPU driver call can be): they die when they leave it.
    pub unkilled: usize,
    pub elapsed: Duration,
}

impl TreeOutput {
    /// Whether standard output was cut at the cap.
    pub fn stdout_cut(&self) -> bool {
        self.stdout_total > self.stdout.len() as u64
    }
}

/// Why a run has no output.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// The program could not be started (missing, not executable).
    #[error("{0}")]
    Spawn(std::io::Error),
    /// Waiting for it failed.
    #[error("{0}")]
    Wait(std::io::Error),
    /// This process could not be made a child subreaper.
    #[error("cannot become a child subreaper: {0}")]
    Subreaper(std::io::Error),
}

/// One run at a time per process: the subreaper flag is process-wide.
// layout: static allowed: the kernel's child-subreaper flag is one per process; this lock
// only keeps two runs from setting and clearing it under each other, it holds no state.
static RUNS: Mutex<()> = Mutex::new(());

/// Runs `cmd` (stdin from /dev/null, stdout and stderr captured, each capped at `max_out`
/// bytes kept; the rest is read and discarded so the program never blocks on a full pipe) and
/// waits at most `timeout`. At the deadline the program first gets `SIGTERM` and `term_grace`
/// to stop by itself (a tool that hands work to a daemon can tell it to stop: `dcgmi diag`
/// stops the diagnostic it started in `nv-hostengine`); then the whole tree is killed. Once
/// the program exited, whatever it left behind is killed too.
pub fn output_tree_within(
    cmd: &mut Command,
    timeout: Duration,
    term_grace: Duration,
    max_out: u64,
) -> Result<TreeOutput, TreeError> {
    let _one = RUNS.lock().unwrap_or_else(|e| e.into_inner());
    let start = Instant::now();
    let subreaper = Subreaper::become_one().map_err(TreeError::Subreaper)?;
    // Runs are serialized by RUNS, so the process id and the clock name this run alone.
    let marker = format!("{}-{}", std::process::id(), nanos_now());
    cmd.env(MARKER_VAR, &marker)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: the closure runs in the child between fork and exec and only calls prctl, which
    // is async-signal-safe and touches no memory shared with the parent. The kernel then kills
    // the program if the thread that started it exits.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // A program file just written may still be open for writing in a child another thread
    // is forking (ETXTBSY until that child execs): try again a few times.
    let mut tries = 0;
    let mut child = loop {
        match cmd.spawn() {
            Ok(c) => break c,
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(TreeError::Spawn(e)),
        }
    };
    let pid = child.id();
    let mut tree = Tree::new(pid, marker);
    let out = Capture::start(child.stdout.take(), max_out);
    let err = Capture::start(child.stderr.take(), max_out);

    let deadline = start + timeout;
    let mut next_look = Instant::now();
    let ended = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(Ended::Exited(status)),
            Ok(None) => {}
            Err(e) => break Err(e),
        }
        let now = Instant::now();
        if now >= deadline {
            break Ok(Ended::TimedOut(timeout));
        }
        if now >= next_look {
            tree.track(true);
            next_look = now + TRACK_EVERY;
        }
        std::thread::sleep(POLL.min(deadline.saturating_duration_since(now)));
    };
    let ended = match ended {
        Ok(Ended::TimedOut(t)) => {
            tree.track(true);
            signal(pid, libc::SIGTERM);
            let until = Instant::now() + term_grace;
            while Instant::now() < until {
                if matches!(child.try_wait(), Ok(Some(_)) | Err(_)) {
                    break;
                }
                std::thread::sleep(POLL);
            }
            Ok(Ended::TimedOut(t))
        }
        other => other,
    };
    // Whether the program is still unreaped (its pid is ours until it is).
    let alive = matches!(child.try_wait(), Ok(None));
    let (killed, unkilled) = tree.kill_all(alive);
    // A process in uninterruptible sleep (stuck in the driver) dies only when it leaves it:
    // never wait for it without bound.
    let until = Instant::now() + REAP_GRACE;
    while matches!(child.try_wait(), Ok(None)) && Instant::now() < until {
        std::thread::sleep(POLL);
    }
    tree.reap();
    drop(subreaper);
    let (stdout, stdout_total) = out.finish(READER_GRACE);
    let (stderr, _) = err.finish(READER_GRACE);
    let ended = ended.map_err(TreeError::Wait)?;
    Ok(TreeOutput {
        ended,
        stdout,
        stderr,
        stdout_total,
        killed,
        unkilled,
        elapsed: start.elapsed(),
    })
}

fn nanos_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Sends `sig` to `pid` (never to a group, never to pid 0, 1 or -1).
fn signal(pid: u32, sig: libc::c_int) {
    let Ok(p) = i32::try_from(pid) else { return };
    if p <= 1 {
        return;
    }
    // SAFETY: kill(2) has no memory-safety preconditions; `p` is a single positive pid above
    // init, checked above.
    unsafe {
        libc::kill(p, sig);
    }
}

/// The calling process as a child subreaper for as long as this lives; the flag it had before
/// is put back on drop.
struct Subreaper {
    was: bool,
}

impl Subreaper {
    fn become_one() -> std::io::Result<Subreaper> {
        let mut was: libc::c_int = 0;
        // SAFETY: PR_GET_CHILD_SUBREAPER writes one int through the pointer, which points at
        // a live local of that type.
        let r = unsafe { libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut was as *mut libc::c_int) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let on: libc::c_ulong = 1;
        // SAFETY: PR_SET_CHILD_SUBREAPER takes a plain integer and touches no memory.
        let r = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, on) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Subreaper { was: was != 0 })
    }
}

impl Drop for Subreaper {
    fn drop(&mut self) {
        if !self.was {
            let off: libc::c_ulong = 0;
            // SAFETY: as above, a plain integer argument.
            unsafe {
                libc::prctl(libc::PR_SET_CHILD_SUBREAPER, off);
            }
        }
    }
}

/// One process as `/proc/<pid>/stat` tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    pub pid: u32,
    pub state: char,
    pub ppid: u32,
    pub pgid: u32,
    pub sid: u32,
    /// Start time in clock ticks after boot: with the pid, names one process for good.
    pub start: u64,
}

impl Proc {
    fn dead(&self) -> bool {
        matches!(self.state, 'Z' | 'X' | 'x')
    }
}

/// Parses one `/proc/<pid>/stat` line. The command name is in parentheses and may itself hold
/// spaces and parentheses: the fields are counted from the last `)`.
pub fn parse_stat(text: &str) -> Option<Proc> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    if close < open {
        return None;
    }
    let pid = text.get(..open)?.trim().parse().ok()?;
    let rest: Vec<&str> = text.get(close + 1..)?.split_whitespace().collect();
    // Fields after the name: state(3) ppid(4) pgrp(5) session(6) ... starttime(22).
    let state = rest.first()?.chars().next()?;
    Some(Proc {
        pid,
        state,
        ppid: rest.get(1)?.parse().ok()?,
        pgid: rest.get(2)?.parse().ok()?,
        sid: rest.get(3)?.parse().ok()?,
        start: rest.get(19)?.parse().ok()?,
    })
}

fn read_proc(pid: u32) -> Option<Proc> {
    let path = format!("/proc/{pid}/stat");
    let text =
        crate::sys::limits::read_pseudo(Path::new(&path), MAX_STAT, "a process's stat").ok()?;
    parse_stat(&text)
}

/// Every process `/proc` lists now (thread-group leaders only: threads are not listed).
fn scan() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.take(MAX_PROCS)
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter_map(read_proc)
        .collect()
}

/// Whether `/proc/<pid>/environ` holds `MARKER_VAR=marker`.
fn has_marker(pid: u32, marker: &str) -> bool {
    let path = format!("/proc/{pid}/environ");
    let Ok(env) =
        crate::sys::limits::read_head(Path::new(&path), MAX_ENVIRON, "a process's environment")
    else {
        return false;
    };
    let want = format!("{MARKER_VAR}={marker}");
    env.split(|b| *b == 0).any(|v| v == want.as_bytes())
}

/// The processes of one run.
struct Tree {
    me: u32,
    root: u32,
    /// The program's start time (`None` when it was gone before it could be read).
    root_start: Option<u64>,
    marker: String,
    /// Every (pid, start) ever seen in the tree.
    known: HashSet<(u32, u64)>,
    /// Those signalled, by pid, with their start time.
    killed: HashMap<u32, u64>,
}

impl Tree {
    fn new(root: u32, marker: String) -> Tree {
        Tree {
            me: std::process::id(),
            root,
            root_start: read_proc(root).map(|p| p.start),
            marker,
            known: HashSet::new(),
            killed: HashMap::new(),
        }
    }

    /// The tree's processes now (dead ones included), parents before children.
    /// `root_alive`: the program has not been reaped, so its pid still names it.
    fn members(&mut self, root_alive: bool) -> Vec<Proc> {
        let procs = scan();
        let mut children: HashMap<u32, Vec<usize>> = HashMap::new();
        for (i, p) in procs.iter().enumerate() {
            children.entry(p.ppid).or_default().push(i);
        }
        let mut roots: Vec<usize> = Vec::new();
        for (i, p) in procs.iter().enumerate() {
            if p.pid == self.me {
                continue;
            }
            if p.pid == self.root {
                if root_alive && self.root_start.is_none_or(|s| s == p.start) {
                    roots.push(i);
                }
                continue;
            }
            // Orphans reparented to us: only those provably from the program.
            if p.ppid == self.me && self.of_the_run(p) {
                roots.push(i);
            }
        }
        let mut seen: HashSet<usize> = HashSet::new();
        let mut order = Vec::new();
        let mut queue: std::collections::VecDeque<usize> = roots.into_iter().collect();
        while let Some(i) = queue.pop_front() {
            if !seen.insert(i) {
                continue;
            }
            order.push(i);
            if let Some(p) = procs.get(i)
                && let Some(kids) = children.get(&p.pid)
            {
                queue.extend(kids.iter().copied());
            }
        }
        let members: Vec<Proc> = order
            .into_iter()
            .filter_map(|i| procs.get(i).copied())
            .collect();
        for p in &members {
            self.known.insert((p.pid, p.start));
        }
        members
    }

    /// Whether a process reparented to us is from the program.
    fn of_the_run(&self, p: &Proc) -> bool {
        if self.root_start.is_some_and(|s| p.start < s) {
            return false;
        }
        self.known.contains(&(p.pid, p.start))
            || self.killed.get(&p.pid) == Some(&p.start)
            || p.pgid == self.root
            || has_marker(p.pid, &self.marker)
    }

    /// Learns the tree as it is now.
    fn track(&mut self, root_alive: bool) {
        let _ = self.members(root_alive);
    }

    /// Stops and kills every live process of the tree, round after round until none is left;
    /// returns how many processes were killed and how many were still alive at the end.
    fn kill_all(&mut self, root_alive: bool) -> (usize, usize) {
        let mut left = 0;
        for round in 0..=MAX_ROUNDS {
            let live: Vec<Proc> = self
                .members(root_alive)
                .into_iter()
                .filter(|p| !p.dead())
                .collect();
            left = live.len();
            if live.is_empty() || round == MAX_ROUNDS {
                break;
            }
            // Parents first: a stopped parent cannot reap (and so free the pid of) a child
            // between our look and our signal.
            for p in &live {
                signal(p.pid, libc::SIGSTOP);
            }
            for p in &live {
                signal(p.pid, libc::SIGKILL);
                self.killed.insert(p.pid, p.start);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        (self.killed.len(), left)
    }

    /// Reaps the tree's processes that were reparented to us (never the program itself: its
    /// `Child` reaps it), waiting a little for the killed ones to become zombies.
    fn reap(&mut self) {
        for _ in 0..200 {
            let mine: Vec<Proc> = scan()
                .into_iter()
                .filter(|p| p.ppid == self.me && p.pid != self.root && self.of_the_run(p))
                .collect();
            if mine.is_empty() {
                return;
            }
            for p in mine.iter().filter(|p| p.dead()) {
                let Ok(pid) = i32::try_from(p.pid) else {
                    continue;
                };
                let mut status: libc::c_int = 0;
                // SAFETY: waitpid writes one int through the pointer, a live local; `pid` is a
                // positive pid of a zombie child of ours from the tree (checked above), so
                // no other code of this process waits for it.
                unsafe {
                    libc::waitpid(pid, &mut status, libc::WNOHANG);
                }
            }
            if mine.iter().all(|p| p.dead()) {
                continue;
            }
            // One still dying (or stopped and not yet killed): make sure, and wait.
            for p in mine.iter().filter(|p| !p.dead()) {
                if self.killed.get(&p.pid) == Some(&p.start) {
                    signal(p.pid, libc::SIGKILL);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// One output pipe read on a thread of its own: the first `max` bytes kept, the rest counted
/// and dropped.
struct Capture {
    buf: Arc<Mutex<(Vec<u8>, u64)>>,
    done: Option<mpsc::Receiver<()>>,
}

impl Capture {
    fn start<R: Read + Send + 'static>(pipe: Option<R>, max: u64) -> Capture {
        let buf = Arc::new(Mutex::new((Vec::new(), 0u64)));
        let Some(mut pipe) = pipe else {
            return Capture { buf, done: None };
        };
        let (tx, rx) = mpsc::channel();
        let shared = Arc::clone(&buf);
        let spawned = std::thread::Builder::new()
            .name("tree-output".into())
            .spawn(move || {
                let mut chunk = vec![0u8; 64 * 1024];
                loop {
                    match pipe.read(&mut chunk) {
                        Ok(0) => break,
                        Ok(n) => {
                            let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
                            let (kept, total) = &mut *g;
                            *total = total.saturating_add(n as u64);
                            let room = usize::try_from(max.saturating_sub(kept.len() as u64))
                                .unwrap_or(usize::MAX);
                            let take = room.min(n);
                            if let Some(part) = chunk.get(..take) {
                                kept.extend_from_slice(part);
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(_) => break,
                    }
                }
                let _ = tx.send(());
            });
        Capture {
            buf,
            done: spawned.ok().map(|_| rx),
        }
    }

    /// What was read, waiting at most `grace` for the end of the pipe (a process that escaped
    /// the kill may hold it open: its reader is then left behind).
    fn finish(self, grace: Duration) -> (Vec<u8>, u64) {
        if let Some(done) = &self.done {
            let _ = done.recv_timeout(grace);
        }
        let mut g = self.buf.lock().unwrap_or_else(|e| e.into_inner());
        let total = g.1;
        (std::mem::take(&mut g.0), total)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut c = Command::new("/bin/sh");
        c.arg("-c").arg(script);
        c
    }

    fn alive(pid: u32) -> bool {
        read_proc(pid).is_some_and(|p| !p.dead())
    }

    fn exists(pid: u32) -> bool {
        read_proc(pid).is_some()
    }

    fn pid_in(path: &Path) -> u32 {
        for _ in 0..200 {
            if let Ok(s) = std::fs::read_to_string(path)
                && let Ok(p) = s.trim().parse()
            {
                return p;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("no pid written to {}", path.display());
    }

    #[test]
    fn stat_lines_parse_whatever_the_name() {
        let p =
            parse_stat("42 (a) b (c)) S 7 42 42 0 -1 4194560 1 2 3 4 5 6 7 8 20 0 1 0 9999 1 2")
                .unwrap();
        assert_eq!(
            (p.pid, p.state, p.ppid, p.pgid, p.sid),
            (42, 'S', 7, 42, 42)
        );
        assert_eq!(p.start, 9999);
        assert!(parse_stat("garbage").is_none());
        assert!(parse_stat("1 (x) S 0").is_none());
        assert!(parse_stat(")( 1").is_none());
        assert!(read_proc(std::process::id()).is_some());
    }

    #[test]
    fn a_hung_child_and_its_setsid_grandchild_die_at_the_deadline() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("grandchild");
        let mut cmd = sh(&format!(
            "setsid sleep 1000 & echo $! > {}; echo started; sleep 1000",
            pidfile.display()
        ));
        let out = output_tree_within(
            &mut cmd,
            Duration::from_millis(1500),
            Duration::from_millis(200),
            1024,
        )
        .unwrap();
        assert_eq!(out.ended, Ended::TimedOut(Duration::from_millis(1500)));
        assert_eq!(out.stdout, b"started\n");
        let grandchild = pid_in(&pidfile);
        assert!(!alive(grandchild), "the setsid grandchild survived");
        assert!(!exists(grandchild), "the grandchild was not reaped");
        assert!(out.killed >= 2, "killed {}", out.killed);
        assert_eq!(out.unkilled, 0);
        assert!(out.elapsed < Duration::from_secs(10));
    }

    #[test]
    fn what_an_exited_child_left_behind_dies_too() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        // One grandchild setsid'd while its parent lives; one double-forked so it is orphaned
        // at once (reparented to us before anything could see it).
        let mut cmd = sh(&format!(
            "setsid sleep 1000 & echo $! > {a}; (setsid sleep 1000 & echo $! > {b}) ; exit 3",
            a = a.display(),
            b = b.display()
        ));
        let out =
            output_tree_within(&mut cmd, Duration::from_secs(30), Duration::ZERO, 1024).unwrap();
        match out.ended {
            Ended::Exited(s) => assert_eq!(s.code(), Some(3)),
            other => panic!("{other:?}"),
        }
        for p in [pid_in(&a), pid_in(&b)] {
            assert!(!alive(p), "grandchild {p} survived");
        }
        assert!(out.elapsed < Duration::from_secs(10), "{:?}", out.elapsed);
    }

    #[test]
    fn output_is_capped_and_the_rest_drained() {
        let mut cmd = sh("head -c 100000000 /dev/zero; echo done >&2");
        let out =
            output_tree_within(&mut cmd, Duration::from_secs(60), Duration::ZERO, 4096).unwrap();
        assert!(matches!(out.ended, Ended::Exited(s) if s.success()));
        assert_eq!(out.stdout.len(), 4096);
        assert_eq!(out.stdout_total, 100_000_000);
        assert!(out.stdout_cut());
        assert_eq!(out.stderr, b"done\n");
    }

    #[test]
    fn a_missing_program_is_a_spawn_error_and_others_are_untouched() {
        let mut other = Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let r = output_tree_within(
            &mut Command::new("/nonexistent/dcgmi"),
            Duration::from_secs(1),
            Duration::ZERO,
            16,
        );
        assert!(matches!(r, Err(TreeError::Spawn(e)) if e.kind() == std::io::ErrorKind::NotFound));
        // A child of ours that is not from the run is never signalled.
        let out = output_tree_within(
            &mut sh("exit 0"),
            Duration::from_secs(5),
            Duration::ZERO,
            16,
        )
        .unwrap();
        assert_eq!(out.killed, 0);
        assert!(matches!(other.try_wait(), Ok(None)));
        let _ = other.kill();
        let _ = other.wait();
    }
}
