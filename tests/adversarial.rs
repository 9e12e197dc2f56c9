//! The adversarial suite (issue 26, item 7): what a hostile pass tries, as property tests
//! bounded for CI.
//!
//! - **Arbitrary numbers in every persisted file and table item.** Real documents are made by
//!   the real code (an engine run writes the state, the inputs and the records; the exporter's
//!   cursor, an evidence spool entry, a GPU-memory history row, the slot table's item), then
//!   any of their numbers is replaced by an extreme (0, 2^53, 2^62 and either side of it,
//!   i64::MAX, u64::MAX, negatives, fractions, 1e308, numbers past u64). Each is read back by
//!   the reader gpu-medic uses and, when accepted, used: the state stepped through a run of
//!   inputs and saved again, the inputs replayed, the records rebuilt into a state, the
//!   cursor followed, the slot item decided on. Nothing may panic, a number that cannot
//!   advance is refused where it enters, and every state accepted stays within range.
//! - **Every path kind for every file gpu-medic reads.** Each reader gets a missing file, an
//!   empty one, a FIFO, a directory, a socket, a symlink loop, a dangling symlink, symlinks to
//!   `/dev/zero`, `/dev/urandom` and `/dev/null`, a 4 GiB sparse file and invalid UTF-8. Each
//!   must answer within seconds (an open that blocks on a FIFO is a failure, reported as a
//!   hang naming the reader and the kind) without reading past its cap (the process's peak
//!   memory is checked after the matrix).
//! - **The CLI readers through the binary**: `status`, `incidents list`, `tasks` and `policy
//!   simulate` on a state directory whose files carry such numbers, or are of such kinds.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use serde_json::Value;

use gpu_medic::engine::{self, MAX_COUNTER, State};
use gpu_medic::journal::{self, JournaledInput};
use gpu_medic::model::{
    ActionId, Capabilities, GpuId, Input, Observation, Outcome, OutcomeStatus, Record, Signal,
    StampedInput, Timestamp,
};
use gpu_medic::policy::Policy;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn default_policy() -> &'static Policy {
    static P: std::sync::OnceLock<Policy> = std::sync::OnceLock::new();
    P.get_or_init(|| gpu_medic::config::load_policy(&repo().join("policies/default.toml")).unwrap())
}

fn cfg(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

const T0: u64 = 1_780_000_000_000;

/// A run of the engine that leaves a state with most of its parts in use: incidents open and
/// closed, orders in flight and scheduled, sightings, MPS restarts, repeats, a self-fault.
/// Returns every state along the way, the inputs as the supervisor journals them, and the
/// records the run wrote.
fn engine_run() -> (Vec<State>, Vec<JournaledInput>, Vec<Record>) {
    let p = default_policy();
    let gpu = |i| GpuId::index_only(i);
    let mut inputs = vec![
        Input::Started {
            capabilities: Capabilities {
                reboot: true,
                ..Capabilities::default()
            },
        },
        Input::Boot {
            id: "0b5e9c1e-1111-4222-8333-944455556666".into(),
        },
    ];
    for _ in 0..3 {
        inputs.push(Input::Observation(
            Observation::new(Signal::xid(13)).on_gpu(gpu(1)),
        ));
    }
    inputs.push(Input::Observation(
        Observation::new(Signal::xid(31)).on_gpu(gpu(2)),
    ));
    inputs.push(Input::Observation(
        Observation::new(Signal::EccUncorrected)
            .on_gpu(gpu(3))
            .with_value(7),
    ));
    inputs.push(Input::Observation(Observation::new(Signal::MpsDown)));
    inputs.push(Input::Observation(
        Observation::new(Signal::SelfFault {
            component: "nvml".into(),
        })
        .with_detail("cannot load libnvidia-ml.so.1"),
    ));
    inputs.push(Input::Observation(
        Observation::new(Signal::xid(79)).on_gpu(gpu(0)),
    ));
    inputs.push(Input::Tick);

    let mut st = State::default();
    let mut states = Vec::new();
    let mut journaled = Vec::new();
    let mut records = Vec::new();
    let mut seq = 0;
    let mut now = T0;
    let mut queue: std::collections::VecDeque<Input> = inputs.into();
    let mut answered = 0;
    while let Some(input) = queue.pop_front() {
        now += 1_500;
        seq += 1;
        journaled.push(JournaledInput {
            seq,
            stamped: StampedInput {
                at: Timestamp(now),
                input: input.clone(),
            },
        });
        let (next, actions) = engine::step(&st, input, Timestamp(now), p);
        st = next;
        for a in actions {
            match a {
                gpu_medic::model::Action::Log(r) => records.push(r),
                gpu_medic::model::Action::Execute(o) if answered < 6 => {
                    answered += 1;
                    // The first orders succeed, later ones fail: both paths leave traces.
                    let status = if answered < 4 {
                        OutcomeStatus::Done
                    } else {
                        OutcomeStatus::Failed { retryable: true }
                    };
                    queue.push_back(Input::Outcome(outcome(o.id, status)));
                }
                gpu_medic::model::Action::Execute(_) => {}
            }
        }
        states.push(st.clone());
    }
    (states, journaled, records)
}

fn outcome(action: ActionId, status: OutcomeStatus) -> Outcome {
    Outcome {
        action,
        status,
        detail: "adversarial".into(),
        request_ids: vec![],
        evidence: None,
        fleet: None,
        diagnosis: None,
    }
}

/// Numbers no writer of ours produces but a hand, a disk or a hostile peer may.
fn extreme() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(serde_json::json!(0)),
        Just(serde_json::json!(1)),
        Just(serde_json::json!(1u64 << 53)),
        Just(serde_json::json!(MAX_COUNTER - 1)),
        Just(serde_json::json!(MAX_COUNTER)),
        Just(serde_json::json!(MAX_COUNTER + 1)),
        Just(serde_json::json!(u32::MAX)),
        Just(serde_json::json!(u32::MAX as u64 + 1)),
        Just(serde_json::json!(i64::MAX)),
        Just(serde_json::json!(u64::MAX - 1)),
        Just(serde_json::json!(u64::MAX)),
        Just(serde_json::json!(-1)),
        Just(serde_json::json!(i64::MIN)),
        Just(serde_json::json!(0.5)),
        Just(serde_json::json!(1e308)),
        any::<u64>().prop_map(|n| serde_json::json!(n)),
    ]
}

/// JSON pointers to every number in `v`.
fn number_paths(v: &Value, at: String, out: &mut Vec<String>) {
    match v {
        Value::Number(_) => out.push(at),
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                number_paths(x, format!("{at}/{i}"), out);
            }
        }
        Value::Object(m) => {
            for (k, x) in m {
                let k = k.replace('~', "~0").replace('/', "~1");
                number_paths(x, format!("{at}/{k}"), out);
            }
        }
        _ => {}
    }
}

/// `doc` with the numbers `picks` chooses (index modulo the count) replaced.
fn with_numbers(doc: &Value, picks: &[(usize, Value)]) -> Value {
    let mut out = doc.clone();
    let mut paths = Vec::new();
    number_paths(doc, String::new(), &mut paths);
    if paths.is_empty() {
        return out;
    }
    for (i, v) in picks {
        if let Some(slot) = out.pointer_mut(&paths[i % paths.len()]) {
            *slot = v.clone();
        }
    }
    out
}

/// serde_json has no u64-past number; some come as text the reader must refuse.
fn with_raw_numbers(text: &str, picks: &[usize]) -> String {
    let mut out = text.to_string();
    for (n, at) in picks.iter().enumerate() {
        let digits: Vec<(usize, usize)> = digit_runs(&out);
        if digits.is_empty() {
            break;
        }
        let (s, e) = digits[at % digits.len()];
        let big = ["18446744073709551616", "99999999999999999999999", "1e400"][n % 3];
        out.replace_range(s..e, big);
    }
    out
}

fn digit_runs(s: &str) -> Vec<(usize, usize)> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() && (i == 0 || !b[i - 1].is_ascii_alphanumeric()) {
            let s0 = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            if i == b.len() || !b[i].is_ascii_alphanumeric() {
                out.push((s0, i));
            }
        } else {
            i += 1;
        }
    }
    out
}

fn picks() -> impl Strategy<Value = Vec<(usize, Value)>> {
    prop::collection::vec((any::<usize>(), extreme()), 1..6)
}

struct Fixture {
    states: Vec<State>,
    inputs: Vec<JournaledInput>,
    records: Vec<Record>,
}

fn fixture() -> &'static Fixture {
    static F: std::sync::OnceLock<Fixture> = std::sync::OnceLock::new();
    F.get_or_init(|| {
        let (states, inputs, records) = engine_run();
        assert!(
            states.last().is_some_and(|s| !s.incidents.open.is_empty()),
            "the run leaves incidents open"
        );
        Fixture {
            states,
            inputs,
            records,
        }
    })
}

/// Steps `st` through a few inputs of every kind at `now` and checks what a restart would
/// read back: the state serializes, and saving and loading it never panics.
fn exercise_state(st: State, now: u64, dir: &Path) -> Result<(), TestCaseError> {
    let p = default_policy();
    let f = fixture();
    let mut st = st;
    let ids: Vec<ActionId> = st.orders.in_flight.keys().copied().collect();
    let mut inputs: Vec<Input> = f.inputs.iter().map(|j| j.stamped.input.clone()).collect();
    for id in ids {
        inputs.push(Input::Outcome(outcome(id, OutcomeStatus::Done)));
        inputs.push(Input::Outcome(outcome(
            id,
            OutcomeStatus::Failed { retryable: false },
        )));
    }
    inputs.push(Input::Tick);
    let before = st.incidents.last_id;
    for input in inputs {
        let (next, _) = engine::step(&st, input, Timestamp(now), p);
        st = next;
    }
    prop_assert!(
        st.incidents.last_id >= before,
        "incident ids went backwards: {before} -> {}",
        st.incidents.last_id
    );
    let path = dir.join("state.json");
    journal::save_state(&path, &st).map_err(|e| TestCaseError::fail(e.to_string()))?;
    // A state that reached the ceiling is refused on the next start (and set aside), never
    // wrapped: either way, reading it back does not panic.
    let _ = journal::load_state(&path);
    Ok(())
}

fn now_choice() -> impl Strategy<Value = u64> {
    prop::sample::select(vec![
        0,
        T0,
        T0 + 86_400_000,
        gpu_medic::model::MAX_RFC3339_MS,
        u64::MAX,
    ])
}

proptest! {
    #![proptest_config(cfg(96))]

    /// state.json with any number changed: refused where it enters (out of range, not a
    /// number of its kind), or accepted within range and then usable.
    #[test]
    fn state_files_with_arbitrary_numbers(which in any::<usize>(), picks in picks(), raw in prop::collection::vec(any::<usize>(), 0..2), now in now_choice()) {
        let f = fixture();
        let base = serde_json::to_value(&f.states[which % f.states.len()]).unwrap();
        let text = with_raw_numbers(&with_numbers(&base, &picks).to_string(), &raw);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        std::fs::write(&path, &text).unwrap();
        match journal::load_state(&path) {
            Ok(Some(st)) => {
                prop_assert!(st.check_ranges().is_ok(), "accepted out of range: {text}");
                exercise_state(st, now, dir.path())?;
            }
            Ok(None) => prop_assert!(false, "a state file read as none"),
            Err(e) => prop_assert!(e.to_string().contains("state"), "{e}"),
        }
        // The daemon's path: a refused state is set aside, never a refusal to start; a
        // number that makes the file a newer gpu-medic's (its `format`) is refused, never
        // set aside, and read as this version can when the operator accepts it.
        match journal::load_state_or_set_aside(&path, Timestamp(T0), journal::Newer::Refuse) {
            Ok(l) => prop_assert!(l.state.is_some() != l.set_aside.is_some()),
            Err(e) => {
                prop_assert!(matches!(e, gpu_medic::sys::error::JournalError::Newer { .. }), "{e}");
                prop_assert!(path.exists(), "a newer state is never set aside");
                let l = journal::load_state_or_set_aside(&path, Timestamp(T0), journal::Newer::Accept).unwrap();
                prop_assert!(l.state.is_some() != l.set_aside.is_some());
            }
        }
    }

    /// inputs.jsonl lines with any number changed: replay (what a restart does) never panics,
    /// never hands back a sequence number that cannot advance, and the inputs it hands back
    /// step without panicking.
    #[test]
    fn input_journals_with_arbitrary_numbers(picks in prop::collection::vec((any::<usize>(), any::<usize>(), extreme()), 1..6), applied in prop::sample::select(vec![0u64, 3, MAX_COUNTER, u64::MAX]), raw in prop::collection::vec(any::<usize>(), 0..2)) {
        let f = fixture();
        let mut lines: Vec<String> = f.inputs.iter().map(|i| serde_json::to_string(i).unwrap()).collect();
        for (line, at, v) in &picks {
            let i = line % lines.len();
            let doc: Value = serde_json::from_str(&lines[i]).unwrap();
            lines[i] = with_numbers(&doc, &[(*at, v.clone())]).to_string();
        }
        if let Some(first) = raw.first() {
            let i = first % lines.len();
            lines[i] = with_raw_numbers(&lines[i], &raw);
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inputs.jsonl");
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let (tail, last) = journal::inputs_after(&path, applied, 1000).unwrap();
        prop_assert!(last <= MAX_COUNTER, "sequence {last} accepted");
        let mut st = State::default();
        for e in tail {
            prop_assert!(e.seq <= MAX_COUNTER && e.seq > applied.min(MAX_COUNTER));
            let (next, _) = engine::step(&st, e.stamped.input, e.stamped.at, default_policy());
            st = next;
        }
        prop_assert!(serde_json::to_string(&st).is_ok());
    }

    /// incidents.jsonl records with any number changed: the rebuild a restart without a state
    /// does, and `incidents list`'s folding, never panic, and the rebuilt state is in range
    /// (an incident id that cannot advance is not taken up).
    #[test]
    fn incident_journals_with_arbitrary_numbers(picks in prop::collection::vec((any::<usize>(), any::<usize>(), extreme()), 1..6), now in now_choice()) {
        let f = fixture();
        let mut lines: Vec<String> = f.records.iter().map(|r| serde_json::to_string(r).unwrap()).collect();
        for (line, at, v) in &picks {
            let i = line % lines.len();
            let doc: Value = serde_json::from_str(&lines[i]).unwrap();
            lines[i] = with_numbers(&doc, &[(*at, v.clone())]).to_string();
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("incidents.jsonl");
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        let (st, _) = journal::rebuild_from_journal(&path, Timestamp(now), Duration::ZERO, journal::read_cap(64)).unwrap();
        prop_assert!(st.check_ranges().is_ok(), "rebuilt out of range: {:?}", st.check_ranges());
        exercise_state(st, now, dir.path())?;
        let _ = journal::last_records::<Record>(&path, 5).unwrap();
    }

    /// The exporter's cursor with any number changed: loaded (or reset, said) and followed
    /// over a real journal without panicking; a count beyond the ceiling never survives.
    #[test]
    fn export_cursors_with_arbitrary_numbers(picks in picks()) {
        use gpu_medic::export::tail::{Cursor, Tail};
        let f = fixture();
        let dir = tempfile::tempdir().unwrap();
        let journal_path = dir.path().join("incidents.jsonl");
        let text: String = f.records.iter().map(|r| serde_json::to_string(r).unwrap() + "\n").collect();
        std::fs::write(&journal_path, &text).unwrap();
        let mut tail = Tail::new(&journal_path);
        let mut cur = Cursor::default();
        tail.read(&mut cur, |_| true).unwrap();
        let saved = dir.path().join("cursor.json");
        let doc = with_numbers(&serde_json::to_value(cur).unwrap(), &picks);
        std::fs::write(&saved, doc.to_string()).unwrap();
        let mut cur = Cursor::load(&saved);
        prop_assert!([cur.offset, cur.line, cur.seq, cur.dropped].iter().all(|v| *v <= MAX_COUNTER), "{cur:?}");
        let mut tail = Tail::new(&journal_path);
        let _ = tail.read(&mut cur, |_| true);
        let _ = tail.lines_after(&cur);
    }

    /// The slot table's item with any number changed (DynamoDB numbers are text: also past
    /// u64, negative, fractional): parsed strictly, and a version that could not advance, or
    /// a token beyond it, is refused; what is accepted is decided on without panicking, and
    /// a write it decides advances the version.
    #[test]
    fn slot_table_items_with_arbitrary_numbers(version in extreme(), token in extreme(), budget in extreme(), phase in 0u8..2) {
        use aws_sdk_dynamodb::types::AttributeValue;
        use gpu_medic::aws::dynamo::{self, Holder, HolderState, SlotItem};
        use gpu_medic::remedy::budget::slot_rules::{self, Decision, Facts, Phase, Seen, Stamp};
        let item = SlotItem {
            version: 9,
            exists: true,
            holders: [("i-0peer".to_string(), Holder { state: HolderState::Committed, token: 8, incident: Some("4".into()), since: "2026-12-01T00:00:00Z".into() })].into(),
            budget: Some(2),
            updated_by: Some("i-0peer".into()),
            members: Some(3),
        };
        let mut attrs: HashMap<String, AttributeValue> = dynamo::item_attributes("g", &item);
        let n = |v: &Value| AttributeValue::N(v.to_string());
        attrs.insert("version".into(), n(&version));
        attrs.insert("budget".into(), n(&budget));
        if let Some(AttributeValue::M(holders)) = attrs.get_mut("holders")
            && let Some(AttributeValue::M(h)) = holders.get_mut("i-0peer")
        {
            h.insert("token".into(), n(&token));
        }
        match dynamo::parse_item("g", &attrs) {
            Ok(read) => {
                prop_assert!(read.version < dynamo::MAX_VERSION, "version {} accepted", read.version);
                prop_assert!(read.holders.values().all(|h| h.token <= read.version));
                let terminated = Default::default();
                let seen = Seen::default();
                let stamp = Stamp::default();
                let f = Facts {
                    me: "i-0me",
                    phase: [Phase::Wants, Phase::Done][phase as usize],
                    budget: 2,
                    terminated: &terminated,
                    seen: &seen,
                    now: Instant::now(),
                    reservation_lifetime: Duration::from_secs(600),
                    stamp: &stamp,
                };
                if let Decision::Write { item: new, .. } = slot_rules::decide(&read, &f) {
                    prop_assert!(new.version > read.version, "a write that does not advance the version");
                }
            }
            Err(e) => prop_assert!(!e.is_retryable(), "a malformed item is not retried: {e}"),
        }
        // The rules alone, on an item that skipped the parser: a version that cannot advance
        // is never written over.
        if let Some(v) = version.as_u64() {
            let direct = SlotItem { version: v, ..item.clone() };
            let terminated = Default::default();
            let seen = Seen::default();
            let stamp = Stamp::default();
            let f = Facts { me: "i-0me", phase: Phase::Wants, budget: 2, terminated: &terminated, seen: &seen, now: Instant::now(), reservation_lifetime: Duration::from_secs(600), stamp: &stamp };
            match slot_rules::decide(&direct, &f) {
                Decision::Write { item: new, .. } => prop_assert!(new.version > v),
                Decision::Act { token } => prop_assert!(token <= v),
                _ => {}
            }
        }
    }

    /// An evidence spool record and a GPU-memory history row with any number changed: read
    /// back without panicking, and `gpu-medic tasks`' arithmetic over the rows stays whole.
    #[test]
    fn spool_records_and_history_rows_with_arbitrary_numbers(picks in picks(), rows in prop::collection::vec(picks(), 1..4)) {
        use gpu_medic::accounting::history;
        use gpu_medic::remedy::evidence::spool::{Entry, Spool};
        let dir = tempfile::tempdir().unwrap();
        let spool = Spool::new(dir.path().join("evidence"), 1 << 20);
        spool.ensure().unwrap();
        let entry = Entry {
            incident: 4,
            name: "i-0abc-4".into(),
            bucket: "b".into(),
            key: "k/i-0abc-4.tar.gz".into(),
            bytes: 1234,
            sha256: "00".repeat(32),
            created_ms: T0,
            uploaded: false,
            refused: None,
        };
        let doc = with_numbers(&serde_json::to_value(&entry).unwrap(), &picks);
        std::fs::write(dir.path().join("evidence").join(format!("{}.json", entry.stem())), doc.to_string()).unwrap();
        let _ = spool.load(&entry.stem());
        let _ = spool.entries();

        let path = dir.path().join("history.jsonl");
        let row = serde_json::json!({"minute": 1_780_000_000u64, "family": "train", "revision": "3", "peak_bytes": 1u64 << 30, "reserved_bytes": 2u64 << 30});
        let text: String = rows.iter().map(|p| with_numbers(&row, p).to_string() + "\n").collect();
        std::fs::write(&path, text).unwrap();
        if let Ok((rows, _)) = history::read_rows(&path, 1 << 20) {
            for r in rows {
                let s = gpu_medic::cli::tasks::suggest(r.peak_bytes);
                prop_assert!(s >= r.peak_bytes.min(s));
            }
        }
    }
}

// ---- every path kind ----

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PathKind {
    Missing,
    Empty,
    Fifo,
    Dir,
    Socket,
    Loop,
    Dangling,
    DevZero,
    DevUrandom,
    DevNull,
    /// Past every cap but the journals' (64 MiB + 1, the default rotation size and the
    /// state's cap): a reader holds at most its cap.
    Sparse65M,
    /// Far past any cap (4 GiB): refused by its size before a byte is read. The journals'
    /// readers stream a whole file by design (it is bounded by `[journal]` rotation, up to
    /// 1 TiB by configuration) and are not given it.
    Sparse4G,
    NotUtf8,
}

const KINDS: [PathKind; 13] = [
    PathKind::Missing,
    PathKind::Empty,
    PathKind::Fifo,
    PathKind::Dir,
    PathKind::Socket,
    PathKind::Loop,
    PathKind::Dangling,
    PathKind::DevZero,
    PathKind::DevUrandom,
    PathKind::DevNull,
    PathKind::Sparse65M,
    PathKind::Sparse4G,
    PathKind::NotUtf8,
];

/// Makes `path` a thing of `kind`; the socket's listener is returned to keep it alive.
fn make(path: &Path, kind: PathKind) -> Option<std::os::unix::net::UnixListener> {
    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_dir_all(path);
    match kind {
        PathKind::Missing => {}
        PathKind::Empty => std::fs::write(path, b"").unwrap(),
        PathKind::Fifo => {
            let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
            // SAFETY: a valid NUL-terminated path.
            assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        }
        PathKind::Dir => std::fs::create_dir(path).unwrap(),
        PathKind::Socket => return Some(std::os::unix::net::UnixListener::bind(path).unwrap()),
        PathKind::Loop => std::os::unix::fs::symlink(path, path).unwrap(),
        PathKind::Dangling => {
            std::os::unix::fs::symlink(path.with_extension("nowhere"), path).unwrap()
        }
        PathKind::DevZero => std::os::unix::fs::symlink("/dev/zero", path).unwrap(),
        PathKind::DevUrandom => std::os::unix::fs::symlink("/dev/urandom", path).unwrap(),
        PathKind::DevNull => std::os::unix::fs::symlink("/dev/null", path).unwrap(),
        PathKind::Sparse65M => std::fs::File::create(path)
            .unwrap()
            .set_len((65 << 20) + 1)
            .unwrap(),
        PathKind::Sparse4G => std::fs::File::create(path)
            .unwrap()
            .set_len(4 << 30)
            .unwrap(),
        PathKind::NotUtf8 => std::fs::write(path, b"{\"a\": \"\xff\xfe\"}\n").unwrap(),
    }
    None
}

type Reader = Box<dyn Fn(&Path) -> String + Send + Sync>;

/// Every file gpu-medic reads, by the function that reads it. The closure gets the file's
/// path (inside a fresh state directory) and says what happened, for the failure message.
fn readers() -> Vec<(&'static str, &'static str, Reader)> {
    use gpu_medic::config::{StateDir, View};
    let state_dir = |p: &Path| p.parent().unwrap().to_path_buf();
    let r = |f: Reader| f;
    vec![
        (
            "config",
            "config.toml",
            r(Box::new(|p| {
                format!("{:?}", gpu_medic::config::Config::load(p).err())
            })),
        ),
        (
            "policy",
            "policy.toml",
            r(Box::new(|p| {
                format!("{:?}", gpu_medic::config::load_policy(p).err())
            })),
        ),
        (
            "state",
            "state.json",
            r(Box::new(|p| {
                format!(
                    "{:?}",
                    journal::load_state_or_set_aside(p, Timestamp(T0), journal::Newer::Refuse)
                        .map(|l| (l.state.is_some(), l.set_aside))
                )
            })),
        ),
        (
            "inputs",
            "inputs.jsonl",
            r(Box::new(|p| {
                format!(
                    "{:?}",
                    journal::inputs_after(p, 0, 10).map(|(t, l)| (t.len(), l))
                )
            })),
        ),
        (
            "incidents",
            "incidents.jsonl",
            r(Box::new(|p| {
                format!(
                    "{:?} {:?}",
                    journal::last_records::<Record>(p, 3).map(|r| r.len()),
                    journal::rebuild_from_journal(
                        p,
                        Timestamp(T0),
                        Duration::ZERO,
                        journal::read_cap(64)
                    )
                    .map(|(s, _)| s.incidents.last_id)
                )
            })),
        ),
        (
            "committed delivery",
            "state.json",
            r(Box::new(|p| {
                format!("{:?}", journal::committed_delivery(p).applied)
            })),
        ),
        (
            "operator request",
            "requests/1-1.json",
            r(Box::new(move |p| {
                let taken = journal::take_requests(&state_dir(&state_dir(p)));
                format!("{} taken", taken.len())
            })),
        ),
        (
            "export cursor",
            "export-cursor.json",
            r(Box::new(|p| {
                format!("{:?}", gpu_medic::export::tail::Cursor::load(p))
            })),
        ),
        (
            "export tail",
            "incidents.jsonl",
            r(Box::new(|p| {
                let mut cur = gpu_medic::export::tail::Cursor::default();
                let mut n = 0;
                let res = gpu_medic::export::tail::Tail::new(p).read(&mut cur, |_| {
                    n += 1;
                    true
                });
                format!("{} lines, {:?}", n, res.err())
            })),
        ),
        (
            "history",
            "gpu-memory.jsonl",
            r(Box::new(|p| {
                format!(
                    "{:?}",
                    gpu_medic::accounting::history::read_rows(p, 1 << 20)
                        .map(|(r, b)| (r.len(), b))
                )
            })),
        ),
        (
            "views",
            "links.json",
            r(Box::new(move |p| {
                let d = StateDir::new(state_dir(p));
                let mut out = String::new();
                for v in [
                    View::GpuView,
                    View::Fleet,
                    View::Slots,
                    View::Links,
                    View::Ports,
                ] {
                    let target = d.view(v);
                    if target != p {
                        let _ = std::fs::remove_file(&target);
                        let _ = std::os::unix::fs::symlink(p, &target);
                    }
                    out += &format!("{v:?}={} ", d.load_view::<Value>(v).is_some());
                }
                out
            })),
        ),
        (
            "evidence spool",
            "evidence/i-0abc-4.json",
            r(Box::new(|p| {
                let s = gpu_medic::remedy::evidence::spool::Spool::new(
                    p.parent().unwrap().to_path_buf(),
                    1 << 20,
                );
                format!("{:?} {}", s.load("i-0abc-4").is_some(), s.entries().len())
            })),
        ),
        (
            "boot id",
            "boot_id",
            r(Box::new(|p| {
                format!("{:?}", gpu_medic::sys::limits::read_boot_id(p).err())
            })),
        ),
    ]
}

/// The readers whose job is to read a whole journal file (see [`PathKind::Sparse4G`]).
const WHOLE_JOURNAL_READERS: [&str; 3] = ["inputs", "incidents", "export tail"];

fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Runs `f` on a thread; a panic fails the test, and so does an answer later than `limit`.
fn bounded(what: &str, limit: Duration, f: impl FnOnce() -> String + Send + 'static) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || {
        let out = f();
        let _ = tx.send(out);
    });
    match rx.recv_timeout(limit) {
        Ok(out) => {
            handle.join().unwrap();
            out
        }
        Err(_) if handle.is_finished() => panic!("{what}: panicked ({:?})", handle.join().err()),
        // The thread may be stuck in open(2) on a FIFO for good: leave it, fail the test.
        Err(_) => {
            panic!("{what}: still reading after {limit:?} (a blocking open or an endless read)")
        }
    }
}

#[test]
fn every_reader_answers_every_path_kind_promptly_within_its_cap() {
    let rss_before = peak_rss_kib();
    for (name, file, read) in readers() {
        let read = std::sync::Arc::new(read);
        for kind in KINDS {
            if kind == PathKind::Sparse4G && WHOLE_JOURNAL_READERS.contains(&name) {
                continue;
            }
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("state").join(file);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let _listener = make(&path, kind);
            let what = format!("{name} ({file}) as {kind:?}");
            let (r, p) = (read.clone(), path.clone());
            let said = bounded(&what, Duration::from_secs(10), move || r(&p));
            if kind == PathKind::Fifo {
                // A FIFO never counts as a readable file of ours.
                assert!(
                    !said.contains("Ok(Some") && !said.starts_with("true"),
                    "{what}: {said}"
                );
            }
        }
    }
    let grown = peak_rss_kib().saturating_sub(rss_before);
    assert!(
        grown < 256 * 1024,
        "the matrix grew peak memory by {grown} KiB: some reader read past its cap"
    );
}

// ---- the CLI readers through the binary ----

fn cli(state: &Path, args: &[&str], what: &str) -> (Option<i32>, String) {
    let config = state.parent().unwrap().join("config.toml");
    std::fs::write(
        &config,
        format!(
            "state_dir = \"{}\"\npolicy = \"{}\"\n[nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
            state.display(),
            repo().join("policies/default.toml").display()
        ),
    )
    .unwrap();
    let mut child = Command::new(gpu_medic_testkit::bin())
        .args(args)
        .arg("--config")
        .arg(&config)
        .env_remove("GPU_MEDIC_CONFIG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{args:?} with {what} still running after 20 s: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const CLI_COMMANDS: [&[&str]; 5] = [
    &["status"],
    &["status", "--json"],
    &["incidents", "list"],
    &["incidents", "list", "--open", "--json"],
    &["tasks"],
];

fn assert_no_panic(args: &[&str], code: Option<i32>, err: &str) {
    assert!(
        code.is_some() && code != Some(101) && !err.contains("panicked"),
        "{args:?} exited {code:?}: {err}"
    );
}

/// Every CLI reader on every path kind of the files it reads: an answer (or a clear error)
/// within seconds, never a hang or a panic.
#[test]
fn cli_readers_answer_every_path_kind() {
    let files = [
        "state.json",
        "incidents.jsonl",
        "inputs.jsonl",
        "gpu-memory.jsonl",
        "links.json",
    ];
    for file in files {
        for kind in [
            PathKind::Fifo,
            PathKind::DevZero,
            PathKind::Dir,
            PathKind::Sparse65M,
        ] {
            let dir = tempfile::tempdir().unwrap();
            let state = dir.path().join("state");
            std::fs::create_dir_all(&state).unwrap();
            let _l = make(&state.join(file), kind);
            for args in CLI_COMMANDS {
                let what = format!("{file} as {kind:?}");
                let (code, err) = cli(&state, args, &what);
                assert_no_panic(args, code, &format!("{what}: {err}"));
            }
        }
    }
}

proptest! {
    #![proptest_config(cfg(12))]

    /// The CLI on a state directory whose state, records and history carry arbitrary
    /// numbers: every command answers without a panic.
    #[test]
    fn cli_readers_take_arbitrary_numbers(picks in picks(), which in any::<usize>()) {
        let f = fixture();
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        std::fs::create_dir_all(&state).unwrap();
        let st = serde_json::to_value(&f.states[which % f.states.len()]).unwrap();
        std::fs::write(state.join("state.json"), with_numbers(&st, &picks).to_string()).unwrap();
        let records: String = f.records.iter().enumerate().map(|(i, r)| {
            let doc = serde_json::to_value(r).unwrap();
            let doc = if i % 3 == which % 3 { with_numbers(&doc, &picks) } else { doc };
            doc.to_string() + "\n"
        }).collect();
        std::fs::write(state.join("incidents.jsonl"), records).unwrap();
        let row = serde_json::json!({"minute": 1_780_000_000u64, "family": "train", "revision": "3", "peak_bytes": 1u64 << 30});
        std::fs::write(state.join("gpu-memory.jsonl"), with_numbers(&row, &picks).to_string() + "\n").unwrap();
        for args in CLI_COMMANDS {
            let (code, err) = cli(&state, args, "arbitrary numbers");
            assert_no_panic(args, code, &err);
        }
        let inputs: String = f.inputs.iter().map(|i| with_numbers(&serde_json::to_value(i).unwrap(), &picks).to_string() + "\n").collect();
        let sim = dir.path().join("sim.jsonl");
        std::fs::write(&sim, inputs).unwrap();
        let (code, err) = cli(&state, &["policy", "simulate", sim.to_str().unwrap()], "arbitrary numbers");
        assert_no_panic(&["policy", "simulate"], code, &err);
    }
}
