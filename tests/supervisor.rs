//! The supervisor in-process, through its public API (`Supervisor::new`, `add_source`, the
//! `Source` and `Executor` traits, `Remedies`), under tokio's paused clock: the shutdown grace
//! for orders in flight, an order resumed by the next supervisor from `state.json`, operator
//! requests (abort, the launch gate's report) as `gpu-medic incidents abort` and
//! `check --lifecycle` hand them over (`state_dir/requests/`), and a journal that cannot be
//! written.
//!
//! Real parts: the engine, the default policy, the journal files in a temp dir. Doubles, for
//! what these tests are about (when and how orders end, which no real remedy lets a test
//! choose): the source is a channel the test feeds with observations, and the hands hand each
//! order to the test, which answers it when it wants to, or never (a remedy that hangs).
//!
//! Time: tokio's clock is paused and jumps ahead whenever every task waits, so the 20 s
//! shutdown grace and the 100 ms ticks cost no wall time. The supervisor stamps inputs with
//! the clock it is handed: the system's by default, which barely moves here (no engine
//! deadline comes due), or a `TokioClock`, which follows the paused clock, so an order's
//! deadline expires in virtual time (`an_order_that_hangs_overruns_its_deadline_in_virtual_time`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a failed assumption is a failed test

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use gpu_medic::config::Config;
use gpu_medic::journal;
use gpu_medic::model::{
    Command, Observation, OperatorRequest, Order, Outcome, OutcomeStatus, Signal,
};
use gpu_medic::policy::Policy;
use gpu_medic::probe::Source;
use gpu_medic::remedy::Executor;
use gpu_medic::remedy::{BoxFuture, Done, MpsRemedy, Remedies, RemedyError};
use gpu_medic::supervisor::{SHUTDOWN_GRACE, Supervisor};
use gpu_medic_testkit::default_policy;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

// ---------------------------------------------------------------------------------------------
// Doubles

/// A sense the test feeds: forwards what the test sends until shutdown.
struct Feed(mpsc::UnboundedReceiver<Observation>);

impl Source for Feed {
    fn name(&self) -> &'static str {
        "test-feed"
    }

    fn run(
        mut self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        _resume: gpu_medic::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    o = self.0.recv() => match o {
                        Some(o) => { let _ = tx.send(o).await; }
                        None => { shutdown.cancelled().await; return; }
                    },
                }
            }
        })
    }
}

/// One order handed to the hands, waiting for the test to say how it ended. Dropping it
/// without an answer leaves the order running forever (a remedy that hangs).
struct Call {
    order: Order,
    reply: oneshot::Sender<OutcomeStatus>,
}

impl Call {
    fn kind(&self) -> &'static str {
        self.order.command.name()
    }

    fn answer(self, status: OutcomeStatus) {
        let _ = self.reply.send(status);
    }
}

/// Hands that pass every order to the test ([`Call`]).
#[derive(Clone)]
struct Hands(mpsc::UnboundedSender<Call>);

impl Hands {
    fn new() -> (Hands, mpsc::UnboundedReceiver<Call>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Hands(tx), rx)
    }

    async fn call(&self, order: &Order) -> OutcomeStatus {
        let (reply, answer) = oneshot::channel();
        let order = order.clone();
        if self.0.send(Call { order, reply }).is_err() {
            return std::future::pending().await;
        }
        match answer.await {
            Ok(status) => status,
            // Dropped unanswered: the remedy hangs.
            Err(_) => std::future::pending().await,
        }
    }
}

impl Executor for Hands {
    fn execute(&self, order: Order) -> Pin<Box<dyn Future<Output = Outcome> + Send + '_>> {
        Box::pin(async move {
            let status = self.call(&order).await;
            Outcome {
                action: order.id,
                status,
                detail: "answered by the test".into(),
                request_ids: vec![],
                evidence: None,
                fleet: None,
                diagnosis: None,
            }
        })
    }
}

/// The MPS remedy behind `Remedies`, answered by the test the same way.
impl MpsRemedy for Hands {
    fn restart(&self, order: &Order) -> BoxFuture<'_, Result<Done, RemedyError>> {
        let order = order.clone();
        Box::pin(async move {
            match self.call(&order).await {
                OutcomeStatus::Done => Ok(Done::new("restarted by the test")),
                _ => Err(RemedyError::retryable("the test said it failed")),
            }
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Setup

/// A config whose state lives in `dir/state`, ticking every 100 ms (virtual).
fn config(dir: &Path) -> Config {
    let text = format!(
        "state_dir = \"{}\"\npolicy = \"{}\"\ntick_interval = \"100ms\"\n\
         [nvml]\nenabled = false\n[mps]\nenabled = false\n[aws]\nenabled = false\n",
        dir.join("state").display(),
        default_policy().display()
    );
    Config::parse(&dir.join("config.toml"), &text).unwrap()
}

fn policy() -> Policy {
    gpu_medic::config::load_policy(&default_policy()).unwrap()
}

/// A supervisor on `dir` with `executor` and a feed the test sends observations into.
fn supervisor(
    dir: &Path,
    executor: Arc<dyn Executor>,
) -> (Supervisor, mpsc::UnboundedSender<Observation>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let mut s = Supervisor::new(config(dir), policy(), executor);
    s.add_source(Box::new(Feed(rx)));
    (s, tx)
}

/// Two unanswered MPS probes in a row: the default policy restarts the daemon.
fn mps_wedged() -> Observation {
    Observation::new(Signal::MpsUnresponsive).with_value(2)
}

fn xid_79() -> Observation {
    Observation::new(Signal::xid(79)).on_gpu(gpu_medic::model::GpuId {
        index: 0,
        uuid: "GPU-00000000-aaaa-bbbb-cccc-000000000000".into(),
        pci_bus_id: "00000000:10:00.0".into(),
        serial: None,
    })
}

fn records(dir: &Path) -> Vec<Value> {
    gpu_medic_testkit::journal::read(&dir.join("state/incidents.jsonl"))
}

fn state(dir: &Path) -> gpu_medic::engine::State {
    journal::load_state(&dir.join("state/state.json"))
        .unwrap()
        .expect("state.json")
}

/// Waits (in virtual time, so the supervisor keeps ticking) until `f` holds.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "not within 60 s (virtual): {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn next(calls: &mut mpsc::UnboundedReceiver<Call>) -> Call {
    tokio::time::timeout(Duration::from_secs(60), calls.recv())
        .await
        .expect("an order within 60 s (virtual)")
        .expect("the hands are alive")
}

fn closed(dir: &Path) -> Vec<Value> {
    records(dir)
        .into_iter()
        .filter(|r| r["event"] == "closed")
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Shutdown grace

/// An order in flight at shutdown gets to finish: its outcome is journaled and state.json
/// is saved without it, so nothing is resumed on the next start.
#[tokio::test(start_paused = true)]
async fn an_order_in_flight_at_shutdown_finishes_within_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let (hands, mut calls) = Hands::new();
    let remedies = Remedies {
        mps: Some(Arc::new(hands)),
        control_plane: None,
        evidence: None,
        repair: None,
        diagnose: None,
    };
    let (sup, feed) = supervisor(dir.path(), Arc::new(remedies));
    let shutdown = CancellationToken::new();
    let test = async {
        feed.send(mps_wedged()).unwrap();
        let call = next(&mut calls).await;
        assert_eq!(call.kind(), "restart-mps");
        let t0 = Instant::now();
        shutdown.cancel();
        // The restart takes 5 s more (virtual); the supervisor waits for it.
        tokio::time::sleep(Duration::from_secs(5)).await;
        call.answer(OutcomeStatus::Done);
        t0
    };
    let (run, t0) = tokio::join!(sup.run(shutdown.clone(), || {}), test);
    run.unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_secs(5) && waited < SHUTDOWN_GRACE,
        "{waited:?}"
    );
    let st = state(dir.path());
    assert!(st.orders.in_flight.is_empty(), "{:?}", st.orders.in_flight);
    let closed = closed(dir.path());
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert_eq!(closed[0]["state"], "resolved", "{closed:?}");
    assert!(
        records(dir.path())
            .iter()
            .any(|r| r["event"] == "action-finished" && r["outcome"]["status"] == "done"),
        "{:?}",
        records(dir.path())
    );
}

/// An order that does not finish within the grace is abandoned at exactly the grace and left
/// in state.json for the next start.
#[tokio::test(start_paused = true)]
async fn an_order_that_outlasts_the_grace_is_left_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let (hands, mut calls) = Hands::new();
    let (sup, feed) = supervisor(dir.path(), Arc::new(hands));
    let shutdown = CancellationToken::new();
    let test = async {
        feed.send(mps_wedged()).unwrap();
        let call = next(&mut calls).await;
        let t0 = Instant::now();
        shutdown.cancel();
        (call, t0)
    };
    let (run, (call, t0)) = tokio::join!(sup.run(shutdown.clone(), || {}), test);
    run.unwrap();
    let waited = t0.elapsed();
    assert!(
        waited >= SHUTDOWN_GRACE && waited < SHUTDOWN_GRACE + Duration::from_secs(1),
        "{waited:?}"
    );
    let st = state(dir.path());
    assert_eq!(
        st.orders.in_flight.values().collect::<Vec<_>>(),
        [&call.order],
        "left for the next start"
    );
    assert!(closed(dir.path()).is_empty());
}

// ---------------------------------------------------------------------------------------------
// Resume

/// The order one supervisor left in flight (state.json) is handed over again by the next,
/// with no new observation, and its outcome closes the incident once.
#[tokio::test(start_paused = true)]
async fn the_next_supervisor_resumes_an_order_left_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let (hands, mut calls) = Hands::new();
    let (sup, feed) = supervisor(dir.path(), Arc::new(hands));
    let shutdown = CancellationToken::new();
    let test = async {
        feed.send(xid_79()).unwrap();
        let call = next(&mut calls).await;
        assert_eq!(call.kind(), "quarantine");
        shutdown.cancel();
        call // never answered: the remedy was cut off by the stop
    };
    let (run, first) = tokio::join!(sup.run(shutdown.clone(), || {}), test);
    run.unwrap();
    assert_eq!(state(dir.path()).orders.in_flight.len(), 1);
    let started = |dir: &Path| {
        records(dir)
            .iter()
            .filter(|r| r["event"] == "action-started")
            .count()
    };
    assert_eq!(started(dir.path()), 1);

    // The next start: nothing observed, the order comes back as it was.
    let (hands, mut calls) = Hands::new();
    let (sup, _feed) = supervisor(dir.path(), Arc::new(hands));
    let shutdown = CancellationToken::new();
    let test = async {
        let call = next(&mut calls).await;
        assert_eq!(
            call.order, first.order,
            "the same order, same id and attempt"
        );
        call.answer(OutcomeStatus::Done);
        // Quarantined: the remediation goes on with the drain.
        let drain = next(&mut calls).await;
        assert_eq!(drain.kind(), "drain");
        shutdown.cancel();
        drain
    };
    let (run, _drain) = tokio::join!(sup.run(shutdown.clone(), || {}), test);
    run.unwrap();
    assert_eq!(started(dir.path()), 2, "quarantine once, then the drain");
    let finished: Vec<Value> = records(dir.path())
        .into_iter()
        .filter(|r| r["event"] == "action-finished")
        .collect();
    assert_eq!(finished.len(), 1, "{finished:?}");
    assert_eq!(finished[0]["outcome"]["action"], first.order.id.0);
}

// ---------------------------------------------------------------------------------------------
// Operator requests

/// `gpu-medic incidents abort` mid-drain: the drain is dropped from the orders in flight and
/// a restore is ordered; the restore's outcome returns the node to service.
#[tokio::test(start_paused = true)]
async fn an_abort_request_mid_drain_orders_a_restore() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let (hands, mut calls) = Hands::new();
    let (sup, feed) = supervisor(dir.path(), Arc::new(hands));
    let shutdown = CancellationToken::new();
    let test = async {
        feed.send(xid_79()).unwrap();
        let quarantine = next(&mut calls).await;
        assert_eq!(quarantine.kind(), "quarantine");
        let incident = quarantine.order.incident;
        quarantine.answer(OutcomeStatus::Done);
        let drain = next(&mut calls).await;
        assert_eq!(drain.kind(), "drain");
        // What `gpu-medic incidents abort 1 --by alice` drops into state_dir/requests/.
        let abort = OperatorRequest::Abort {
            incident,
            by: "alice".into(),
        };
        journal::submit_request(&cfg.state_dir, &abort).unwrap();
        let restore = next(&mut calls).await;
        assert_eq!(restore.order.command, Command::Restore);
        assert_eq!(restore.order.incident, incident);
        assert!(
            journal::take_requests(&cfg.state_dir).is_empty(),
            "taken once"
        );
        // The control plane's restore stops its running drain, which then reports.
        restore.answer(OutcomeStatus::Done);
        drain.answer(OutcomeStatus::Failed { retryable: false });
        until("the incident to close", || !closed(dir.path()).is_empty()).await;
        shutdown.cancel();
        incident
    };
    let (run, incident) = tokio::join!(sup.run(shutdown.clone(), || {}), test);
    run.unwrap();
    let recs: Vec<Value> = records(dir.path())
        .into_iter()
        .filter(|r| r["incident"] == incident.0)
        .collect();
    assert!(
        recs.iter().any(|r| r["event"] == "escalated"
            && r["reason"]
                .as_str()
                .is_some_and(|s| s.contains("abort requested by alice"))),
        "{recs:#?}"
    );
    let st = state(dir.path());
    assert!(st.orders.in_flight.is_empty(), "{:?}", st.orders.in_flight);
    assert!(st.node.remediation.is_none(), "{:?}", st.node.remediation);
    assert_eq!(st.node.phase.as_str(), "in-service");
    // The drain's late outcome was not an order in flight any more: not journaled.
    let finished: Vec<&Value> = recs
        .iter()
        .filter(|r| r["event"] == "action-finished")
        .collect();
    assert_eq!(finished.len(), 2, "quarantine and restore: {finished:#?}");
}

/// The launch gate (a separate `check --lifecycle` process) reports through the requests
/// folder; the running supervisor journals it as one closed incident and orders nothing.
/// An unreadable request is set aside, not retried and not fatal.
#[tokio::test(start_paused = true)]
async fn the_launch_gate_report_is_journaled_by_the_running_supervisor() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let (hands, mut calls) = Hands::new();
    let (sup, _feed) = supervisor(dir.path(), Arc::new(hands));
    let shutdown = CancellationToken::new();
    let test = async {
        let gate = OperatorRequest::LaunchGate {
            health: "healthy".into(),
            summary: "launch gate: healthy; decision Continue".into(),
            findings: vec!["4 GPUs, none faulted".into()],
            request_ids: vec!["CompleteLifecycleAction r-1".into()],
        };
        journal::submit_request(&cfg.state_dir, &gate).unwrap();
        let bad = journal::requests_dir(&cfg.state_dir).join("0-torn.json");
        std::fs::write(&bad, "{\"request\":\"abo").unwrap();
        until("the gate's incident", || !closed(dir.path()).is_empty()).await;
        shutdown.cancel();
        bad
    };
    let (run, bad) = tokio::join!(sup.run(shutdown.clone(), || {}), test);
    run.unwrap();
    let closed = closed(dir.path());
    assert_eq!(closed.len(), 1, "{closed:?}");
    assert!(
        closed[0]["summary"]
            .as_str()
            .is_some_and(|s| s.starts_with("launch gate: healthy")),
        "{closed:?}"
    );
    let notes: Vec<String> = records(dir.path())
        .iter()
        .filter(|r| r["event"] == "note")
        .map(|r| r["text"].to_string())
        .collect();
    assert!(
        notes.iter().any(|n| n.contains("4 GPUs, none faulted"))
            && notes
                .iter()
                .any(|n| n.contains("CompleteLifecycleAction r-1")),
        "{notes:?}"
    );
    assert!(bad.with_extension("bad").exists(), "set aside as .bad");
    assert!(calls.try_recv().is_err(), "no order");
}

// ---------------------------------------------------------------------------------------------
// A journal that cannot be written

/// Runs a supervisor on `dir`, calls `break_it` once it has started (its first state saved),
/// feeds it a wedged MPS daemon, and checks it keeps running without handing out the MPS
/// restart (an order that waits for its state, docs/journal.md); then stops it.
async fn run_while_it_cannot_write(dir: &Path, break_it: impl FnOnce()) {
    let (hands, mut calls) = Hands::new();
    let (sup, feed) = supervisor(dir, Arc::new(hands));
    feed.send(mps_wedged()).unwrap();
    let shutdown = CancellationToken::new();
    let test = async {
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(
            calls.try_recv().is_err(),
            "no MPS restart without its state"
        );
        shutdown.cancel();
    };
    let (run, ()) = tokio::join!(sup.run(shutdown.clone(), break_it), test);
    run.expect("a journal that cannot be written does not stop the supervisor");
}

/// The next start on `dir`, once there is room again: the order the journaled input calls
/// for is handed out (once), answered, and its incident closes.
async fn next_start_hands_out_the_restart(dir: &Path) {
    let (hands, mut calls) = Hands::new();
    let (sup, _feed) = supervisor(dir, Arc::new(hands));
    let shutdown = CancellationToken::new();
    let test = async {
        let call = next(&mut calls).await;
        assert_eq!(call.order.command, Command::RestartMps);
        call.answer(OutcomeStatus::Done);
        until("the incident to close", || !closed(dir).is_empty()).await;
        shutdown.cancel();
        assert!(calls.try_recv().is_err(), "handed out once");
    };
    let (run, ()) = tokio::join!(sup.run(shutdown.clone(), || {}), test);
    run.unwrap();
    assert!(state(dir).orders.in_flight.is_empty());
    let recs = records(dir);
    // The MPS incident (the journal's own self-fault, journaled while it failed, aside).
    let opened = recs
        .iter()
        .filter(|r| r["event"] == "opened" && r["observation"]["signal"]["kind"] != "self-fault")
        .count();
    assert_eq!(opened, 1, "journaled once: {recs:#?}");
    assert_eq!(closed(dir)[0]["state"], "resolved");
}

fn inputs(dir: &Path) -> Vec<Value> {
    gpu_medic_testkit::journal::read(&dir.join("state/inputs.jsonl"))
}

/// A regular file that takes no more bytes, as a full disk would refuse them: an empty
/// memfd sealed against growing (every append fails), reached through its `/proc` link. The
/// journal writer opens it like any regular file (a device such as /dev/full, where every
/// write fails too, is set aside instead: it is no journal).
fn a_file_that_cannot_grow() -> (std::fs::File, std::path::PathBuf) {
    use std::os::fd::{AsRawFd, FromRawFd};
    // SAFETY: a valid NUL-terminated name; the descriptor returned is owned by the File.
    let fd = unsafe { libc::memfd_create(c"full".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0, "memfd_create");
    // SAFETY: `fd` was just created and is owned by nothing else.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    // SAFETY: fcntl on an open descriptor; no memory is passed.
    let sealed = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_GROW) };
    assert_eq!(sealed, 0, "F_SEAL_GROW");
    let link = std::path::PathBuf::from(format!(
        "/proc/{}/fd/{}",
        std::process::id(),
        file.as_raw_fd()
    ));
    (file, link)
}

/// Stand-in for a full disk under the incident journal: `incidents.jsonl` is a link to a
/// regular file that cannot grow ([`a_file_that_cannot_grow`]), so every write fails. The
/// batch's input is on disk, its records are not: the supervisor goes on (a self-fault), hands
/// out no MPS restart and, stopping, keeps the last saved state. The next start, with room
/// again, replays the input and hands the order out: nothing recorded is lost, nothing is
/// done twice.
#[tokio::test(start_paused = true)]
async fn a_full_incident_journal_is_a_self_fault_and_the_next_start_replays_the_input() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    std::fs::create_dir_all(&cfg.state_dir).unwrap();
    let (_full, link) = a_file_that_cannot_grow();
    std::os::unix::fs::symlink(&link, cfg.incidents_path()).unwrap();
    run_while_it_cannot_write(dir.path(), || {}).await;
    let st = state(dir.path());
    assert!(
        st.incidents.open.is_empty() && st.orders.in_flight.is_empty(),
        "{st:?}"
    );
    assert!(!inputs(dir.path()).is_empty(), "the input is journaled");

    std::fs::remove_file(cfg.incidents_path()).unwrap();
    next_start_hands_out_the_restart(dir.path()).await;
}

/// Stand-in for a state directory that takes no new file (full, or remounted read-only; the
/// tests run as root, which permissions do not stop): once the supervisor has started, a
/// directory stands where the new `state.json` is written first (`.state.json.tmp`). An XID 79
/// has its quarantine handed out all the same (a restart would decide it again); the MPS
/// restart waits, and is handed out once the state can be saved again.
#[tokio::test(start_paused = true)]
async fn a_state_that_cannot_be_saved_still_runs_fatal_orders_and_holds_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = config(dir.path());
    let tmp = gpu_medic::sys::fs::temp_path(&cfg.state_path());
    let block = tmp.clone();
    let (hands, mut calls) = Hands::new();
    let (sup, feed) = supervisor(dir.path(), Arc::new(hands));
    let shutdown = CancellationToken::new();
    let test = async {
        feed.send(mps_wedged()).unwrap();
        feed.send(xid_79()).unwrap();
        let first = next(&mut calls).await;
        assert_eq!(first.kind(), "quarantine", "the fatal order runs unsaved");
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(calls.try_recv().is_err(), "the MPS restart waits");
        std::fs::remove_dir(&tmp).unwrap();
        let released = next(&mut calls).await;
        assert_eq!(released.order.command, Command::RestartMps);
        drop((first, released));
        shutdown.cancel();
    };
    let (run, ()) = tokio::join!(
        sup.run(shutdown.clone(), move || std::fs::create_dir_all(&block)
            .unwrap()),
        test
    );
    run.unwrap();
    assert!(
        records(dir.path()).iter().any(|r| r["event"] == "opened"
            && r["observation"]["signal"]["component"] == "journal"),
        "the self-fault is journaled once the state saves"
    );
}

// ---------------------------------------------------------------------------------------------
// Deadlines in virtual time

/// The supervisor stamps inputs with the clock handed in: with one that follows tokio's
/// paused clock, a quarantine the hands never finish overruns its deadline (2 min in the
/// default policy) in virtual time, and the engine moves on to the drain.
#[tokio::test(start_paused = true)]
async fn an_order_that_hangs_overruns_its_deadline_in_virtual_time() {
    use gpu_medic::sys::clock::TokioClock;
    let dir = tempfile::tempdir().unwrap();
    let (hands, mut calls) = Hands::new();
    let (mut sup, feed) = supervisor(dir.path(), Arc::new(hands));
    sup.with_clock(TokioClock::shared(1_700_000_000_000));
    let shutdown = CancellationToken::new();
    let test = async {
        feed.send(xid_79()).unwrap();
        let quarantine = next(&mut calls).await;
        assert_eq!(quarantine.kind(), "quarantine");
        let deadline = quarantine.order.deadline;
        let t0 = Instant::now();
        // Never answered: the remedy hangs.
        let drain = tokio::time::timeout(Duration::from_secs(600), calls.recv())
            .await
            .expect("the engine moves on within 10 min (virtual)")
            .expect("the hands are alive");
        assert_eq!(drain.kind(), "drain");
        assert!(
            t0.elapsed() >= Duration::from_secs(110),
            "only after the quarantine's deadline: {:?}",
            t0.elapsed()
        );
        assert!(drain.order.deadline > deadline);
        drop(quarantine);
        shutdown.cancel();
        drain
    };
    let (run, _drain) = tokio::join!(sup.run(shutdown.clone(), || {}), test);
    run.unwrap();
    let missed: Vec<Value> = records(dir.path())
        .into_iter()
        .filter(|r| r["event"] == "deadline-missed")
        .collect();
    assert_eq!(missed.len(), 1, "{missed:#?}");
    assert!(
        missed[0]["escalation"]
            .as_str()
            .is_some_and(|s| s.contains("moving on to the drain")),
        "{missed:#?}"
    );
}
