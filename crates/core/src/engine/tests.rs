//! Scenario tests and property tests of the engine, driven with an explicit clock.

use std::path::Path;
use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::model::{
    ActionId, Command, GpuId, IncidentEvent, IncidentId, IncidentState, LifecycleHook,
    LifecycleResult, LifecycleState, Observation, OperatorRequest, Order, Outcome, OutcomeStatus,
    Record,
};

fn load(name: &str) -> Policy {
    Policy::load_with(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../policies")
            .join(name),
        &crate::policy::read_file,
    )
    .unwrap_or_else(|e| panic!("{name} loads: {e}"))
}

/// Loaded once: property tests run hundreds of cases.
fn default_policy() -> Policy {
    static P: std::sync::OnceLock<Policy> = std::sync::OnceLock::new();
    P.get_or_init(|| load("default.toml")).clone()
}

fn observe_only() -> Policy {
    static P: std::sync::OnceLock<Policy> = std::sync::OnceLock::new();
    P.get_or_init(|| load("observe-only.toml")).clone()
}

pub(super) fn gpu(i: u32) -> GpuId {
    GpuId {
        index: i,
        uuid: format!("GPU-{i:08x}"),
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x10 + i),
        serial: None,
    }
}

fn xid(g: u32, code: u32) -> Input {
    Input::Observation(Observation::new(Signal::xid(code)).on_gpu(gpu(g)))
}

/// An XID the default policy logs and drains for when it repeats 5 times on one GPU within
/// an hour (an NVLink5 error decoded XID_154_EVAL without a recovery action).
fn repeats_drain(g: u32) -> Input {
    Input::Observation(
        Observation::new(Signal::Xid {
            code: 145,
            decode: Some(crate::model::XidDecode::Xid154Eval),
        })
        .on_gpu(gpu(g)),
    )
}

fn obs(signal: Signal) -> Input {
    Input::Observation(Observation::new(signal))
}

fn done(id: ActionId) -> Input {
    Input::Outcome(Outcome {
        action: id,
        status: OutcomeStatus::Done,
        detail: String::new(),
        request_ids: vec!["req-1".into()],
        evidence: None,
        fleet: None,
        diagnosis: None,
    })
}

fn failed(id: ActionId, retryable: bool) -> Input {
    Input::Outcome(Outcome {
        action: id,
        status: OutcomeStatus::Failed { retryable },
        detail: "boom".into(),
        request_ids: vec![],
        evidence: None,
        fleet: None,
        diagnosis: None,
    })
}

/// Drives the engine and keeps everything it emitted.
struct Run {
    st: State,
    policy: Policy,
    now: Timestamp,
    actions: Vec<Action>,
}

impl Run {
    fn new(policy: Policy) -> Self {
        Run {
            st: State::default(),
            policy,
            now: Timestamp(1_700_000_000_000),
            actions: vec![],
        }
    }

    fn feed(&mut self, input: Input) -> Vec<Action> {
        let (st, out) = step(&self.st, input, self.now, &self.policy);
        self.st = st;
        self.actions.extend(out.clone());
        out
    }

    fn advance(&mut self, d: Duration) -> Vec<Action> {
        self.now = self.now.plus(d);
        self.feed(Input::Tick)
    }

    fn orders(out: &[Action]) -> Vec<Order> {
        out.iter()
            .filter_map(|a| match a {
                Action::Execute(o) => Some(o.clone()),
                _ => None,
            })
            .collect()
    }

    fn only_order(out: &[Action]) -> Order {
        let o = Self::orders(out);
        assert_eq!(o.len(), 1, "expected one order, got {o:?}");
        o[0].clone()
    }

    fn closed(&self) -> Vec<(IncidentId, IncidentState)> {
        self.actions
            .iter()
            .filter_map(|a| match a {
                Action::Log(Record {
                    incident,
                    event: IncidentEvent::Closed { state, .. },
                    ..
                }) => Some((*incident, *state)),
                _ => None,
            })
            .collect()
    }
}

#[test]
fn a_single_application_xid_is_logged_not_acted_on() {
    let mut r = Run::new(default_policy());
    let out = r.feed(xid(0, 13));
    assert!(Run::orders(&out).is_empty());
    assert_eq!(r.closed(), vec![(IncidentId(1), IncidentState::Logged)]);
    assert_eq!(r.st.node.phase, NodePhase::InService);
}

#[test]
fn a_repeating_xid_on_one_gpu_escalates_to_drain() {
    let mut r = Run::new(default_policy());
    for _ in 0..4 {
        assert!(Run::orders(&r.feed(repeats_drain(2))).is_empty());
        r.advance(Duration::from_secs(60));
    }
    // Spread over other GPUs or other XIDs does not count.
    assert!(Run::orders(&r.feed(repeats_drain(3))).is_empty());
    assert!(Run::orders(&r.feed(xid(2, 31))).is_empty());
    let o = Run::only_order(&r.feed(repeats_drain(2)));
    assert_eq!(o.command, Command::Quarantine);
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Drain);
}

/// Application XIDs nobody could be named for (NVML's event without a kernel log line) are
/// logged however often they come: one program's bug is never the node's
/// (`engine::attribution` judges them by who faulted).
#[test]
fn an_unattributed_application_xid_repeating_on_one_gpu_is_logged_only() {
    let mut r = Run::new(default_policy());
    for _ in 0..20 {
        assert!(Run::orders(&r.feed(xid(2, 13))).is_empty());
        r.advance(Duration::from_secs(60));
    }
    assert_eq!(r.st.node.phase, NodePhase::InService);
}

#[test]
fn repeats_outside_the_window_do_not_escalate() {
    let mut r = Run::new(default_policy());
    for _ in 0..10 {
        assert!(Run::orders(&r.feed(xid(1, 13))).is_empty());
        r.advance(Duration::from_secs(20 * 60));
    }
}

#[test]
fn a_fatal_xid_quarantines_drains_and_replaces() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    assert_eq!(q.command, Command::Quarantine);
    assert_eq!(r.st.gpus.health[&0].status, GpuStatus::Faulted);
    let d = Run::only_order(&r.feed(done(q.id)));
    assert!(matches!(d.command, Command::Drain { .. }));
    assert_eq!(r.st.node.phase, NodePhase::Draining);
    let rep = Run::only_order(&r.feed(done(d.id)));
    assert_eq!(rep.command, Command::Replace);
    assert!(Run::orders(&r.feed(done(rep.id))).is_empty());
    assert_eq!(r.st.node.phase, NodePhase::Replaced);
    assert_eq!(r.closed(), vec![(IncidentId(1), IncidentState::Replaced)]);
    assert!(r.st.incidents.open.is_empty() && r.st.orders.in_flight.is_empty());
}

#[test]
fn a_second_fault_joins_the_remediation_in_flight() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    assert!(Run::orders(&r.feed(xid(1, 48))).is_empty());
    assert!(Run::orders(&r.feed(xid(0, 79))).is_empty());
    assert_eq!(r.st.incidents.open.len(), 1);
    assert_eq!(r.st.gpus.health[&1].incident, Some(q.incident));
}

#[test]
fn a_drain_verdict_is_upgraded_when_a_fatal_fault_follows() {
    let mut r = Run::new(default_policy());
    for _ in 0..5 {
        r.feed(repeats_drain(2));
    }
    let q = r.st.orders.in_flight.values().next().unwrap().clone();
    r.feed(xid(2, 79));
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Replace);
    let d = Run::only_order(&r.feed(done(q.id)));
    let rep = Run::only_order(&r.feed(done(d.id)));
    assert_eq!(rep.command, Command::Replace);
}

#[test]
fn a_drain_that_overruns_its_deadline_moves_on_to_replace() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    let d = Run::only_order(&r.feed(done(q.id)));
    assert!(Run::orders(&r.advance(Duration::from_secs(29 * 60))).is_empty());
    let rep = Run::only_order(&r.advance(Duration::from_secs(2 * 60)));
    assert_eq!(rep.command, Command::Replace);
    assert!(!r.st.orders.in_flight.contains_key(&d.id));
    // A late outcome for the escalated drain changes nothing.
    assert!(Run::orders(&r.feed(done(d.id))).is_empty());
    assert_eq!(r.st.node.phase, NodePhase::Replacing);
}

#[test]
fn retryable_failures_are_retried_then_give_up() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    let d = Run::only_order(&r.feed(done(q.id)));
    let mut rep = Run::only_order(&r.feed(done(d.id)));
    for attempt in 2..=5 {
        assert!(Run::orders(&r.feed(failed(rep.id, true))).is_empty());
        rep = Run::only_order(&r.advance(Duration::from_secs(31)));
        assert_eq!(rep.attempt, attempt);
    }
    r.feed(failed(rep.id, true));
    assert_eq!(r.closed(), vec![(IncidentId(1), IncidentState::Failed)]);
    assert!(r.st.node.remediation.is_none());
    assert!(Run::orders(&r.advance(Duration::from_secs(3600))).is_empty());
}

#[test]
fn a_deferred_order_waits_without_spending_attempts() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    let d = Run::only_order(&r.feed(done(q.id)));
    for _ in 0..10 {
        r.feed(Input::Outcome(Outcome {
            action: r.st.orders.in_flight.keys().next().copied().unwrap_or(d.id),
            status: OutcomeStatus::Deferred {
                retry_after: Duration::from_secs(60),
            },
            detail: "fleet budget full".into(),
            request_ids: vec![],
            evidence: None,
            fleet: None,
            diagnosis: None,
        }));
        let again = Run::only_order(&r.advance(Duration::from_secs(61)));
        assert!(matches!(again.command, Command::Drain { .. }));
        assert_eq!(again.attempt, 1);
    }
}

#[test]
fn mps_down_restarts_until_the_budget_is_spent_then_replaces() {
    let mut r = Run::new(default_policy());
    assert!(
        Run::orders(&r.feed(obs(Signal::MpsDown))).is_empty(),
        "debounced"
    );
    let first = Run::only_order(&r.feed(obs(Signal::MpsDown)));
    assert_eq!(first.command, Command::RestartMps);
    assert_eq!(r.st.mps.phase, MpsPhase::Restarting);
    // More signals while restarting join the incident.
    assert!(Run::orders(&r.feed(obs(Signal::MpsDown))).is_empty());
    let mut restarts = 1;
    let mut last = first;
    loop {
        let mut out = r.feed(failed(last.id, true));
        out.extend(r.advance(Duration::from_secs(31)));
        let o = Run::only_order(&out);
        if o.command != Command::RestartMps {
            assert_eq!(o.command, Command::Quarantine);
            break;
        }
        restarts += 1;
        last = o;
    }
    assert_eq!(restarts, 3);
    assert_eq!(r.st.mps.phase, MpsPhase::Failed);
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Replace);
}

fn crash(source: &str) -> Input {
    Input::Observation(
        Observation::new(Signal::MpsCrash)
            .with_value(1)
            .from_source(source),
    )
}

#[test]
fn three_crashes_within_a_minute_are_a_loop_and_two_or_slow_ones_are_not() {
    let mut r = Run::new(default_policy());
    assert!(Run::orders(&r.feed(crash("mps"))).is_empty());
    r.advance(Duration::from_secs(20));
    assert!(Run::orders(&r.feed(crash(crate::model::MPS_UNIT_SOURCE))).is_empty());
    r.advance(Duration::from_secs(20));
    let o = Run::only_order(&r.feed(crash("mps")));
    assert_eq!(o.command, Command::RestartMps, "the third within 60 s");

    // The daemon answering between them does not start the count over: a daemon whose
    // servers keep dying answers every probe.
    let mut r = Run::new(default_policy());
    r.feed(crash("mps"));
    r.feed(obs(Signal::MpsUp));
    r.feed(crash("mps"));
    r.feed(obs(Signal::MpsUp));
    let o = Run::only_order(&r.feed(crash("mps")));
    assert_eq!(o.command, Command::RestartMps, "answers in between");

    // Three spread over more than the window: no loop.
    let mut r = Run::new(default_policy());
    for _ in 0..3 {
        assert!(Run::orders(&r.feed(crash("mps"))).is_empty());
        r.advance(Duration::from_secs(40));
    }
}

#[test]
fn the_unit_restart_our_own_restart_causes_is_not_a_crash() {
    let unit = crate::model::MPS_UNIT_SOURCE;
    let mut r = Run::new(default_policy());
    r.feed(obs(Signal::MpsDown));
    let o = Run::only_order(&r.feed(obs(Signal::MpsDown)));
    assert_eq!(o.command, Command::RestartMps);
    // systemd's restart of the daemon our restart stopped, seen while the order runs.
    assert!(Run::orders(&r.feed(crash(unit))).is_empty());
    r.feed(done(o.id));
    // Then three real ones: the loop is seen at the third, not at the second.
    assert!(Run::orders(&r.feed(crash(unit))).is_empty());
    assert!(Run::orders(&r.feed(crash(unit))).is_empty());
    let o = Run::only_order(&r.feed(crash(unit)));
    assert_eq!(o.command, Command::RestartMps);

    // Seen after the order ended, within the match window: also ours, once.
    r.feed(done(o.id));
    r.advance(Duration::from_secs(10));
    assert!(Run::orders(&r.feed(crash(unit))).is_empty());
    assert!(r.st.mps.own_exit.is_none(), "expected once per restart");
    assert!(Run::orders(&r.feed(crash(unit))).is_empty());
    assert!(Run::orders(&r.feed(crash(unit))).is_empty());
    assert_eq!(
        Run::only_order(&r.feed(crash(unit))).command,
        Command::RestartMps
    );
}

#[test]
fn a_servers_crash_in_the_daemons_lines_is_never_taken_for_our_own_restart() {
    let mut r = Run::new(default_policy());
    r.feed(obs(Signal::MpsDown));
    let o = Run::only_order(&r.feed(obs(Signal::MpsDown)));
    r.feed(done(o.id));
    r.feed(crash("mps"));
    r.feed(crash("mps"));
    assert!(r.st.mps.own_exit.is_some(), "still expected from the unit");
    assert_eq!(
        Run::only_order(&r.feed(crash("mps"))).command,
        Command::RestartMps
    );
}

#[test]
fn a_healed_mps_daemon_closes_its_incident() {
    let mut r = Run::new(default_policy());
    r.feed(obs(Signal::MpsDown));
    let o = Run::only_order(&r.feed(obs(Signal::MpsDown)));
    r.feed(done(o.id));
    assert_eq!(r.closed(), vec![(IncidentId(1), IncidentState::Resolved)]);
    assert_eq!(r.st.mps.phase, MpsPhase::Up);
    // A later outage is a new incident with a new restart.
    r.advance(Duration::from_secs(5));
    r.feed(obs(Signal::MpsDown));
    let o2 = Run::only_order(&r.feed(obs(Signal::MpsDown)));
    assert_eq!(o2.incident, IncidentId(2));
}

#[test]
fn one_unanswered_probe_is_not_enough_to_restart() {
    let mut r = Run::new(default_policy());
    let once = Observation::new(Signal::MpsUnresponsive).with_value(1);
    assert!(Run::orders(&r.feed(Input::Observation(once))).is_empty());
    let twice = Observation::new(Signal::MpsUnresponsive).with_value(2);
    let o = Run::only_order(&r.feed(Input::Observation(twice)));
    assert_eq!(o.command, Command::RestartMps);
}

#[test]
fn a_server_fault_stops_the_tasks_on_that_gpu() {
    let mut r = Run::new(default_policy());
    let fault = Observation::new(Signal::MpsServerFault)
        .on_gpu(gpu(1))
        .with_pids(vec![4242, 4343]);
    let o = Run::only_order(&r.feed(Input::Observation(fault)));
    match &o.command {
        Command::StopTasks { gpu, pids, .. } => {
            assert_eq!(gpu.index, 1);
            assert_eq!(pids, &vec![4242, 4343]);
        }
        other => panic!("unexpected {other:?}"),
    }
    r.feed(done(o.id));
    assert_eq!(r.closed(), vec![(IncidentId(1), IncidentState::Resolved)]);
}

/// Without AWS, a stop-tasks that names client pids still goes out: the MPS daemon
/// terminates those clients (the finest repair); one that names no pid is only recorded.
#[test]
fn without_aws_a_fault_naming_clients_still_terminates_them() {
    let mut r = Run::new(default_policy());
    r.feed(Input::Started {
        capabilities: crate::model::Capabilities {
            aws: false,
            ..crate::model::Capabilities::default()
        },
    });
    let named = Observation::new(Signal::MpsServerFault)
        .on_gpu(gpu(1))
        .with_pids(vec![4242]);
    let o = Run::only_order(&r.feed(Input::Observation(named)));
    assert!(matches!(&o.command, Command::StopTasks { pids, .. } if pids == &vec![4242]));
    let unnamed = Observation::new(Signal::MpsServerFault).on_gpu(gpu(2));
    assert!(Run::orders(&r.feed(Input::Observation(unnamed))).is_empty());

    let mut neither = Run::new(default_policy());
    neither.feed(Input::Started {
        capabilities: crate::model::Capabilities {
            aws: false,
            mps: false,
            ..crate::model::Capabilities::default()
        },
    });
    let named = Observation::new(Signal::MpsServerFault)
        .on_gpu(gpu(1))
        .with_pids(vec![4242]);
    assert!(Run::orders(&neither.feed(Input::Observation(named))).is_empty());
}

#[test]
fn terminating_drains_then_completes_the_hook() {
    let mut r = Run::new(default_policy());
    let d = Run::only_order(&r.feed(obs(Signal::Lifecycle {
        state: LifecycleState::Terminating,
    })));
    assert!(matches!(d.command, Command::Drain { .. }));
    let c = Run::only_order(&r.feed(done(d.id)));
    assert_eq!(
        c.command,
        Command::CompleteLifecycle {
            hook: LifecycleHook::Terminate,
            result: LifecycleResult::Continue
        }
    );
    r.feed(done(c.id));
    assert_eq!(r.st.node.phase, NodePhase::Terminated);
    // Repeated lifecycle observations do nothing more.
    assert!(
        Run::orders(&r.feed(obs(Signal::Lifecycle {
            state: LifecycleState::Terminating
        })))
        .is_empty()
    );
}

#[test]
fn terminating_during_a_replacement_completes_the_hook_after_it() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    let d = Run::only_order(&r.feed(done(q.id)));
    let rep = Run::only_order(&r.feed(done(d.id)));
    r.feed(obs(Signal::Lifecycle {
        state: LifecycleState::Terminating,
    }));
    let c = Run::only_order(&r.feed(done(rep.id)));
    assert!(matches!(c.command, Command::CompleteLifecycle { .. }));
}

#[test]
fn observe_only_records_the_decision_and_executes_nothing() {
    let mut r = Run::new(observe_only());
    assert!(Run::orders(&r.feed(xid(0, 79))).is_empty());
    assert!(Run::orders(&r.feed(obs(Signal::MpsDown))).is_empty());
    assert!(Run::orders(&r.feed(obs(Signal::MpsDown))).is_empty());
    assert_eq!(
        r.closed(),
        vec![
            (IncidentId(1), IncidentState::Observed),
            (IncidentId(2), IncidentState::Observed)
        ]
    );
    let would: Vec<_> = r
        .actions
        .iter()
        .filter_map(|a| match a {
            Action::Log(Record {
                event: IncidentEvent::ActionStarted { order, dry_run },
                ..
            }) => Some((order.command.name(), *dry_run)),
            _ => None,
        })
        .collect();
    assert_eq!(
        would,
        vec![
            ("quarantine", true),
            ("drain", true),
            ("replace", true),
            ("restart-mps", true)
        ]
    );
    assert_eq!(r.st.node.phase, NodePhase::InService);
}

#[test]
fn below_threshold_counters_are_not_findings() {
    let mut r = Run::new(default_policy());
    let input = Input::Observation(
        Observation::new(Signal::RowRemapUncorrectable)
            .on_gpu(gpu(0))
            .with_value(3),
    );
    let out = r.feed(input);
    assert!(out.is_empty(), "{out:?}");
}

#[test]
fn state_survives_a_json_round_trip_mid_remediation() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    let json = serde_json::to_string(&r.st).unwrap();
    let back: State = serde_json::from_str(&json).unwrap();
    assert_eq!(back, r.st);
    r.st = back;
    let d = Run::only_order(&r.feed(done(q.id)));
    assert!(matches!(d.command, Command::Drain { .. }));
}

#[test]
fn repeats_of_a_logged_finding_do_not_flood_the_journal() {
    let mut r = Run::new(default_policy());
    for _ in 0..3 {
        r.feed(xid(0, 13));
        r.advance(Duration::from_secs(60));
    }
    assert_eq!(r.closed().len(), 1);
    r.advance(LOG_REPEAT_WINDOW);
    r.feed(xid(0, 13));
    assert_eq!(r.closed().len(), 2);
    assert!(r.actions.iter().any(|a| matches!(
        a,
        Action::Log(Record { event: IncidentEvent::Note { text }, .. }) if text.starts_with("2 repeats")
    )));
}

#[test]
fn a_fault_reported_on_every_poll_appears_once_in_its_incident() {
    let mut r = Run::new(default_policy());
    let lost = || Input::Observation(Observation::new(Signal::GpuLost).on_gpu(gpu(1)));
    let mut orders = 0;
    for _ in 0..5 {
        orders += Run::orders(&r.feed(lost())).len();
        r.advance(Duration::from_secs(10));
    }
    assert_eq!(orders, 1);
    let signals = r
        .actions
        .iter()
        .filter(|a| {
            matches!(
                a,
                Action::Log(Record {
                    event: IncidentEvent::Signal { .. },
                    ..
                })
            )
        })
        .count();
    assert_eq!(signals, 0, "the opening record already names the signal");
    // Once the node is replaced, later signals join that incident instead of opening new ones.
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    let d = Run::only_order(&r.feed(done(q.id)));
    let rep = Run::only_order(&r.feed(done(d.id)));
    r.feed(done(rep.id));
    for _ in 0..3 {
        assert!(Run::orders(&r.feed(lost())).is_empty());
    }
    assert_eq!(r.st.incidents.last_id, 1);
    assert_eq!(r.st.gpus.health[&1].incident, Some(IncidentId(1)));
}

fn abort(id: IncidentId) -> Input {
    Input::Operator(OperatorRequest::Abort {
        incident: id,
        by: "alice".into(),
    })
}

#[test]
fn an_operator_abort_during_the_drain_returns_the_instance_to_service() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    let d = Run::only_order(&r.feed(done(q.id)));
    let restore = Run::only_order(&r.feed(abort(q.incident)));
    assert_eq!(restore.command, Command::Restore);
    assert!(
        !r.st.orders.in_flight.contains_key(&d.id),
        "the drain is no longer awaited"
    );
    // The drain's late outcome changes nothing; the restore finishes the incident.
    assert!(Run::orders(&r.feed(failed(d.id, false))).is_empty());
    r.feed(done(restore.id));
    assert_eq!(r.st.node.phase, NodePhase::InService);
    assert!(r.st.node.remediation.is_none());
    assert!(
        !r.st.gpus.health.contains_key(&0),
        "the GPU is no longer held faulty"
    );
    assert_eq!(r.closed(), vec![(q.incident, IncidentState::Aborted)]);
    // A new fault starts a new remediation.
    let q2 = Run::only_order(&r.feed(xid(1, 79)));
    assert_eq!(q2.command, Command::Quarantine);
}

#[test]
fn an_abort_after_auto_scaling_was_asked_is_refused() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    let d = Run::only_order(&r.feed(done(q.id)));
    let rep = Run::only_order(&r.feed(done(d.id)));
    assert!(Run::orders(&r.feed(abort(q.incident))).is_empty());
    assert!(r.st.orders.in_flight.contains_key(&rep.id));
    assert!(r.actions.iter().any(|a| matches!(
        a,
        Action::Log(Record { event: IncidentEvent::Note { text }, .. }) if text.contains("refused")
    )));
    // Aborting an unknown incident does nothing.
    assert!(r.feed(abort(IncidentId(99))).is_empty());
}

#[test]
fn an_mps_budget_spent_during_a_node_remediation_closes_its_incident() {
    let mut r = Run::new(default_policy());
    let q = Run::only_order(&r.feed(xid(0, 79)));
    r.feed(obs(Signal::MpsDown));
    let mut last = Run::only_order(&r.feed(obs(Signal::MpsDown)));
    for _ in 0..3 {
        r.feed(failed(last.id, true));
        let out = r.advance(Duration::from_secs(31));
        match Run::orders(&out)
            .into_iter()
            .find(|o| o.command == Command::RestartMps)
        {
            Some(o) => last = o,
            None => break,
        }
    }
    assert_eq!(r.st.mps.phase, MpsPhase::Failed);
    assert_eq!(
        r.st.incidents.open.keys().copied().collect::<Vec<_>>(),
        vec![q.incident]
    );
    assert!(r.closed().iter().any(|(_, s)| *s == IncidentState::Failed));
}

// ---- properties ----

#[derive(Debug, Clone)]
enum Ev {
    Xid(u32, u32),
    Mps(u8),
    /// Outcome for the n-th in-flight order: 0 done, 1 retryable, 2 fatal, 3 deferred.
    Outcome(usize, u8),
    Wait(u32),
    Terminating,
    /// An operator aborts the node remediation in progress (or incident 1).
    Abort,
}

const APP_XIDS: [u32; 6] = [8, 13, 31, 32, 43, 69];
const ALL_XIDS: [u32; 12] = [8, 13, 31, 43, 45, 48, 63, 79, 94, 119, 154, 999];

fn ev(xids: &'static [u32]) -> impl Strategy<Value = Ev> {
    prop_oneof![
        4 => (0u32..4, prop::sample::select(xids)).prop_map(|(g, x)| Ev::Xid(g, x)),
        2 => (0u8..4).prop_map(Ev::Mps),
        3 => (0usize..4, 0u8..4).prop_map(|(i, s)| Ev::Outcome(i, s)),
        3 => (1u32..4000).prop_map(Ev::Wait),
        1 => Just(Ev::Terminating),
        1 => Just(Ev::Abort),
    ]
}

fn to_input(e: &Ev, st: &State) -> Option<(Input, Duration)> {
    Some(match e {
        Ev::Xid(g, x) => (xid(*g, *x), Duration::ZERO),
        Ev::Mps(k) => {
            let s = match k {
                0 => Signal::MpsDown,
                1 => Signal::MpsUp,
                2 => Signal::MpsCrash,
                _ => Signal::MpsUnresponsive,
            };
            (
                Input::Observation(Observation::new(s).with_value(2)),
                Duration::ZERO,
            )
        }
        Ev::Outcome(i, s) => {
            let ids: Vec<ActionId> = st.orders.in_flight.keys().copied().collect();
            let id = *ids.get(i % ids.len().max(1))?;
            let status = match s {
                0 => OutcomeStatus::Done,
                1 => OutcomeStatus::Failed { retryable: true },
                2 => OutcomeStatus::Failed { retryable: false },
                _ => OutcomeStatus::Deferred {
                    retry_after: Duration::from_secs(45),
                },
            };
            (
                Input::Outcome(Outcome {
                    action: id,
                    status,
                    detail: String::new(),
                    request_ids: vec![],
                    evidence: None,
                    fleet: None,
                    diagnosis: None,
                }),
                Duration::ZERO,
            )
        }
        Ev::Wait(s) => (Input::Tick, Duration::from_secs(*s as u64)),
        Ev::Terminating => (
            obs(Signal::Lifecycle {
                state: LifecycleState::Terminating,
            }),
            Duration::ZERO,
        ),
        Ev::Abort => (
            abort(st.node.remediation.map_or(IncidentId(1), |r| r.incident)),
            Duration::ZERO,
        ),
    })
}

fn node_order(o: &Order) -> bool {
    matches!(
        o.command,
        Command::Quarantine | Command::Drain { .. } | Command::Replace
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn at_most_one_node_remediation_and_restart_budget_holds(events in prop::collection::vec(ev(&ALL_XIDS), 1..120)) {
        let policy = default_policy();
        let mut r = Run::new(policy.clone());
        let mut restarts: Vec<Timestamp> = vec![];
        for e in &events {
            let Some((input, wait)) = to_input(e, &r.st) else { continue };
            r.now = r.now.plus(wait);
            let out = r.feed(input);
            for o in Run::orders(&out) {
                if o.command == Command::RestartMps {
                    restarts.push(r.now);
                }
            }
            let node_in_flight = r.st.orders.in_flight.values().filter(|o| node_order(o)).count();
            prop_assert!(r.st.orders.node_orders_pending() <= 1, "{:?}", r.st);
            prop_assert!(node_in_flight <= 1);
            let window = policy.mps.restart_window;
            let recent = restarts.iter().filter(|t| r.now.since(**t) < window).count() as u32;
            prop_assert!(recent <= policy.mps.restart_budget, "restarts {restarts:?}");
        }
    }

    #[test]
    fn application_xids_below_the_threshold_never_drain(events in prop::collection::vec(
        (0u32..4, prop::sample::select(&APP_XIDS[..]), 0u32..600), 1..200)) {
        let mut r = Run::new(default_policy());
        // Each (gpu, xid) pair may appear at most 4 times: below the escalation count of 5.
        let mut seen = std::collections::BTreeMap::new();
        for (g, x, wait) in events {
            let n = seen.entry((g, x)).or_insert(0);
            if *n >= 4 { continue; }
            *n += 1;
            r.now = r.now.plus(Duration::from_secs(wait as u64));
            let out = r.feed(xid(g, x));
            prop_assert!(Run::orders(&out).is_empty(), "{out:?}");
            r.feed(Input::Tick);
        }
        prop_assert_eq!(r.st.node.phase, NodePhase::InService);
    }

    #[test]
    fn observe_only_emits_no_executable_action(events in prop::collection::vec(ev(&ALL_XIDS), 1..120)) {
        let mut r = Run::new(observe_only());
        for e in &events {
            let Some((input, wait)) = to_input(e, &r.st) else { continue };
            r.now = r.now.plus(wait);
            let out = r.feed(input);
            prop_assert!(out.iter().all(|a| !a.is_executable()), "{out:?}");
        }
        prop_assert!(r.st.orders.in_flight.is_empty());
    }

    #[test]
    fn replay_is_deterministic(events in prop::collection::vec(ev(&ALL_XIDS), 1..60)) {
        let policy = default_policy();
        let mut a = Run::new(policy.clone());
        let mut inputs = vec![];
        for e in &events {
            let Some((input, wait)) = to_input(e, &a.st) else { continue };
            a.now = a.now.plus(wait);
            inputs.push((a.now, input.clone()));
            a.feed(input);
        }
        let mut b = Run::new(policy);
        for (t, input) in inputs {
            b.now = t;
            b.feed(input);
        }
        prop_assert_eq!(a.actions, b.actions);
        prop_assert_eq!(a.st, b.st);
    }
}

/// Issue 13, item 3: a storm of thousands of distinct XIDs (unknown codes and repeats) on
/// every GPU coalesces into one incident per GPU and class, with counts; the state stays
/// small; an XID 79 after it is decided at once.
#[test]
fn a_storm_of_distinct_xids_coalesces_and_state_stays_bounded() {
    let mut r = Run::new(default_policy());
    for i in 0..5_000u32 {
        r.feed(xid(i % 8, 100_000 + i));
        if i % 500 == 0 {
            r.advance(Duration::from_millis(100));
        }
    }
    let opened = r
        .actions
        .iter()
        .filter(|a| {
            matches!(
                a,
                Action::Log(Record {
                    event: IncidentEvent::Opened { .. },
                    ..
                })
            )
        })
        .count();
    assert_eq!(opened, 8, "one incident per GPU and class");
    let size = serde_json::to_vec(&r.st).unwrap().len();
    assert!(size < 64 * 1024, "state grew to {size} bytes");
    assert!(r.st.sightings.len() <= MAX_SIGHTING_KEYS);
    assert!(r.st.incidents.recent_logs.len() <= MAX_RECENT_LOGS);
    assert!(
        r.st.incidents
            .recent_logs
            .values()
            .all(|l| l.counts.len() <= MAX_COUNTED_SIGNALS)
    );
    let out = r.feed(xid(3, 79));
    assert!(matches!(Run::only_order(&out).command, Command::Quarantine));
    // After the window, the next incident of a class says how many repeats it absorbed.
    r.advance(LOG_REPEAT_WINDOW);
    r.feed(xid(0, 100_000));
    let note = r.actions.iter().rev().find_map(|a| match a {
        Action::Log(Record {
            event: IncidentEvent::Note { text },
            ..
        }) => Some(text.clone()),
        _ => None,
    });
    let note = note.expect("a repeats note");
    assert!(note.starts_with("624 repeats"), "{note}");
    assert!(note.contains("others x"), "{note}");
}

#[test]
fn signals_no_rule_judges_coalesce_too() {
    let mut policy = default_policy();
    policy.rules.retain(|r| r.signal != SignalKind::Xid);
    let mut r = Run::new(policy);
    for i in 0..100 {
        r.feed(xid(0, i));
    }
    assert_eq!(r.closed().len(), 1);
    assert_eq!(r.st.incidents.recent_logs.len(), 1);
}

/// A task over its GPU memory reservation is the task's matter: two tasks crossing on one GPU
/// are two incidents (not one coalesced per GPU), the same task again within the window is
/// folded into its first, and the GPU's health is untouched (a sizing matter, not a fault).
#[test]
fn tasks_over_their_reservation_are_one_logged_incident_each() {
    let mut r = Run::new(default_policy());
    let over = |task: &str| {
        let mut o = Observation::new(Signal::GpuMemoryOverReservation)
            .with_value(117)
            .on_gpu(gpu(1));
        o.tasks = vec![task.to_string()];
        Input::Observation(o)
    };
    r.feed(over("arn:task/a"));
    r.feed(over("arn:task/b"));
    r.feed(over("arn:task/a"));
    let closed = r.closed();
    assert_eq!(closed.len(), 2, "{closed:?}");
    assert!(closed.iter().all(|(_, s)| *s == IncidentState::Logged));
    assert!(
        r.st.gpus
            .health
            .get(&1)
            .is_none_or(|h| h.status == GpuStatus::Healthy),
        "{:?}",
        r.st.gpus.health
    );
    r.advance(Duration::from_secs(11 * 60));
    r.feed(over("arn:task/a"));
    assert_eq!(
        r.closed().len(),
        3,
        "a crossing after the window is a new incident"
    );
}

fn with_evidence(mode: crate::model::EvidenceMode) -> Run {
    let mut r = Run::new(default_policy());
    r.feed(Input::Started {
        capabilities: crate::model::Capabilities {
            evidence: Some(crate::model::EvidencePlan {
                mode,
                deadline: Duration::from_secs(300),
            }),
            ..crate::model::Capabilities::default()
        },
    });
    r
}

fn kinds(out: &[Action]) -> Vec<&'static str> {
    Run::orders(out).iter().map(|o| o.command.name()).collect()
}

#[test]
fn the_replacement_waits_for_the_evidence_collection_then_goes() {
    let mut r = with_evidence(crate::model::EvidenceMode::OnFatal);
    let out = r.feed(xid(0, 79));
    assert_eq!(kinds(&out), ["quarantine", "collect-evidence"]);
    let orders = Run::orders(&out);
    let (q, ev) = (orders[0].id, orders[1].id);
    let d = Run::only_order(&r.feed(done(q))).id;
    // The drain is done before the collection: the replacement waits for it.
    assert!(Run::orders(&r.feed(done(d))).is_empty());
    assert_eq!(r.st.node.phase, NodePhase::Draining);
    let out = r.feed(done(ev));
    assert_eq!(kinds(&out), ["replace"]);
}

#[test]
fn the_replacement_goes_at_the_evidence_deadline_without_it() {
    let mut r = with_evidence(crate::model::EvidenceMode::Always);
    let orders = Run::orders(&r.feed(xid(0, 79)));
    let d = Run::only_order(&r.feed(done(orders[0].id))).id;
    assert!(Run::orders(&r.feed(done(d))).is_empty());
    let out = r.advance(Duration::from_secs(301));
    assert_eq!(kinds(&out), ["replace"]);
    let notes: Vec<&str> = out
        .iter()
        .filter_map(|a| match a {
            Action::Log(Record {
                event: IncidentEvent::Note { text },
                ..
            }) => Some(text.as_str()),
            _ => None,
        })
        .collect();
    assert!(
        notes.iter().any(|n| n.contains("no evidence archive")),
        "{notes:?}"
    );
    // A late outcome changes nothing.
    assert!(Run::orders(&r.feed(done(orders[1].id))).is_empty());
}

#[test]
fn evidence_off_or_a_non_fatal_signal_under_on_fatal_orders_no_collection() {
    let mut r = with_evidence(crate::model::EvidenceMode::Off);
    assert_eq!(kinds(&r.feed(xid(0, 79))), ["quarantine"]);
    // A repeating XID escalates to a drain; it is not fatal.
    let mut r = with_evidence(crate::model::EvidenceMode::OnFatal);
    for _ in 0..4 {
        r.feed(repeats_drain(2));
        r.advance(Duration::from_secs(60));
    }
    assert_eq!(kinds(&r.feed(repeats_drain(2))), ["quarantine"]);
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Drain);
    // Under `always` the same drain collects.
    let mut r = with_evidence(crate::model::EvidenceMode::Always);
    for _ in 0..4 {
        r.feed(repeats_drain(2));
        r.advance(Duration::from_secs(60));
    }
    assert_eq!(
        kinds(&r.feed(repeats_drain(2))),
        ["quarantine", "collect-evidence"]
    );
}

#[test]
fn the_reboot_waits_for_the_evidence_collection_too() {
    let mut r = Run::new(default_policy());
    r.feed(Input::Started {
        capabilities: crate::model::Capabilities {
            reboot: true,
            evidence: Some(crate::model::EvidencePlan {
                mode: crate::model::EvidenceMode::OnFatal,
                deadline: Duration::from_secs(300),
            }),
            ..crate::model::Capabilities::default()
        },
    });
    r.feed(Input::Boot {
        id: "boot-1".into(),
    });
    // XID 79 the first time: the default policy reboots.
    let out = r.feed(xid(0, 79));
    assert_eq!(kinds(&out), ["quarantine", "collect-evidence"]);
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Reboot);
    let orders = Run::orders(&out);
    let (q, ev) = (orders[0].id, orders[1].id);
    let d = Run::only_order(&r.feed(done(q))).id;
    assert!(Run::orders(&r.feed(done(d))).is_empty(), "held");
    let out = r.feed(done(ev));
    assert_eq!(kinds(&out), ["reboot"]);
}

#[test]
fn the_terminate_hook_completes_after_the_evidence_collection_or_its_deadline() {
    let mut r = with_evidence(crate::model::EvidenceMode::OnFatal);
    let orders = Run::orders(&r.feed(xid(0, 79)));
    let (q, ev) = (orders[0].id, orders[1].id);
    let d = Run::only_order(&r.feed(done(q))).id;
    // Auto Scaling terminates the instance mid-drain: the hook waits for the collection.
    r.feed(obs(Signal::Lifecycle {
        state: LifecycleState::Terminating,
    }));
    let held: Vec<Order> = Run::orders(&r.feed(done(d)));
    assert!(
        held.iter()
            .all(|o| !matches!(o.command, Command::CompleteLifecycle { .. })),
        "{held:?}"
    );
    let out = r.feed(done(ev));
    assert!(
        Run::orders(&out)
            .iter()
            .any(|o| matches!(o.command, Command::CompleteLifecycle { .. })),
        "{out:?}"
    );
}

#[test]
fn a_rule_of_its_own_evidence_mode_overrides_the_config() {
    let plan = |mode| crate::model::Capabilities {
        evidence: Some(crate::model::EvidencePlan {
            mode,
            deadline: Duration::from_secs(300),
        }),
        ..crate::model::Capabilities::default()
    };
    let with_rule = |mode| {
        let mut p = default_policy();
        let rule = p
            .rules
            .iter_mut()
            .find(|r| r.name == "xid-fallen-off-bus")
            .expect("the default policy's XID 79 rule");
        rule.evidence = Some(mode);
        p
    };
    // The config says always; the rule says off: no collection.
    let mut r = Run::new(with_rule(crate::model::EvidenceMode::Off));
    r.feed(Input::Started {
        capabilities: plan(crate::model::EvidenceMode::Always),
    });
    assert_eq!(kinds(&r.feed(xid(0, 79))), ["quarantine"]);
    // The config says off; the rule says always: collected.
    let mut r = Run::new(with_rule(crate::model::EvidenceMode::Always));
    r.feed(Input::Started {
        capabilities: plan(crate::model::EvidenceMode::Off),
    });
    assert_eq!(
        kinds(&r.feed(xid(0, 79))),
        ["quarantine", "collect-evidence"]
    );
}

#[test]
fn a_drain_closes_without_waiting_and_the_archive_is_recorded_after() {
    // A drain destroys nothing on the node: its incident closes when the drain is done, and
    // the collection's outcome (with the archive) is recorded when it comes.
    let mut r = with_evidence(crate::model::EvidenceMode::Always);
    for _ in 0..4 {
        r.feed(repeats_drain(2));
        r.advance(Duration::from_secs(60));
    }
    let orders = Run::orders(&r.feed(repeats_drain(2)));
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Drain);
    let (q, ev) = (orders[0].id, orders[1].id);
    let d = Run::only_order(&r.feed(done(q))).id;
    r.feed(done(d));
    let id = orders[0].incident;
    assert!(
        r.closed().contains(&(id, IncidentState::Drained)),
        "{:?}",
        r.closed()
    );
    let mut o = done(ev);
    if let Input::Outcome(out) = &mut o {
        out.evidence = Some(Box::new(crate::model::EvidenceRef {
            uri: "s3://b/k/1.tar.gz".into(),
            bytes: 10,
            sha256: "ab".into(),
            uploaded: true,
            missing: vec![],
        }));
    }
    let out = r.feed(o);
    assert!(
        out.iter().any(|a| matches!(a, Action::Log(Record {
            event: IncidentEvent::ActionFinished { outcome }, ..
        }) if outcome.evidence.is_some())),
        "{out:?}"
    );
    assert!(r.st.evidence.is_none());
}

#[test]
fn an_abort_while_the_replacement_waits_for_the_evidence_drops_the_replacement() {
    let mut r = with_evidence(crate::model::EvidenceMode::OnFatal);
    let orders = Run::orders(&r.feed(xid(0, 79)));
    let (q, ev) = (orders[0].id, orders[1].id);
    let d = Run::only_order(&r.feed(done(q))).id;
    assert!(Run::orders(&r.feed(done(d))).is_empty(), "replacement held");
    let restore = Run::only_order(&r.feed(abort(orders[0].incident)));
    assert_eq!(restore.command, Command::Restore);
    assert!(
        r.st.orders.in_flight.contains_key(&ev),
        "the collection runs on"
    );
    // The collection ends: recorded, and no replacement of an instance the operator kept.
    let out = r.feed(done(ev));
    assert!(
        Run::orders(&out)
            .iter()
            .all(|o| o.command != Command::Replace),
        "{out:?}"
    );
    assert!(out.iter().any(|a| matches!(
        a,
        Action::Log(Record {
            event: IncidentEvent::ActionFinished { .. },
            ..
        })
    )));
    r.feed(done(restore.id));
    assert_eq!(r.st.node.phase, NodePhase::InService);
    assert!(r.st.evidence.is_none());
}

/// A storm of distinct lesser signals joining a node remediation fills at most
/// `MAX_ATTACHED_PER_INCIDENT` places in its timeline; a fatal signal after the storm (another
/// GPU off the bus) still has its own place there.
#[test]
fn a_fatal_signal_after_a_storm_still_joins_the_node_incidents_timeline() {
    let mut r = Run::new(default_policy());
    r.feed(xid(2, 79));
    let node = r.st.node.incident.expect("a node remediation");
    for i in 0..5_000 {
        r.feed(xid(i % 2, 200_000 + i));
    }
    let out = r.feed(xid(3, 79));
    let joined = out.iter().any(|a| {
        matches!(a, Action::Log(Record { incident, event: IncidentEvent::Signal { observation }, .. })
            if *incident == node && observation.gpu.as_ref().is_some_and(|g| g.index == 3))
    });
    assert!(
        joined,
        "the second GPU off the bus is not in the timeline: {out:?}"
    );
    assert!(r.st.check_ranges().is_ok());
}

/// Every caller of `step` (the live loop, the replay at start, `policy simulate`) gets the
/// same bound: an input journaled unbounded (by an older build, or by hand) steps to the
/// records the bounded one gives, each within the journal's line cap, so a replay finds the
/// records already journaled instead of appending them again.
#[test]
fn step_bounds_what_comes_in_and_what_goes_out_for_every_caller() {
    let policy = default_policy();
    let huge = "x".repeat(3 * 1024 * 1024);
    let unbounded = Input::Observation(
        Observation::new(Signal::xid(79))
            .on_gpu(gpu(0))
            .with_detail(huge.clone())
            .with_pids((0..10_000).collect()),
    );
    let mut bounded = unbounded.clone();
    bounded.bound();
    let st = State::default();
    let (s1, a1) = step(&st, unbounded, Timestamp(1_000), &policy);
    let (s2, a2) = step(&st, bounded, Timestamp(1_000), &policy);
    assert_eq!(s1, s2);
    assert_eq!(a1, a2);
    assert!(!a1.is_empty());
    for a in &a1 {
        let n = match a {
            Action::Log(r) => serde_json::to_vec(r).unwrap().len(),
            Action::Execute(o) => serde_json::to_vec(o).unwrap().len(),
        };
        assert!(n < crate::limits::MAX_JOURNAL_LINE / 2, "{n}");
    }
    // An outcome's AWS message of 2 MiB: the records it makes are cut the same way.
    let orders: Vec<ActionId> = a1
        .iter()
        .filter_map(|a| match a {
            Action::Execute(o) => Some(o.id),
            Action::Log(_) => None,
        })
        .collect();
    assert!(!orders.is_empty(), "an XID 79 is acted on: {a1:?}");
    for id in orders {
        let outcome = Input::Outcome(Outcome {
            action: id,
            status: OutcomeStatus::Failed { retryable: false },
            detail: huge.clone(),
            request_ids: vec![huge.clone(); 3],
            evidence: None,
            fleet: None,
            diagnosis: None,
        });
        let (_, out) = step(&s1, outcome, Timestamp(2_000), &policy);
        for a in &out {
            if let Action::Log(r) = a {
                assert!(serde_json::to_vec(r).unwrap().len() < crate::limits::MAX_JOURNAL_LINE / 2);
            }
        }
    }
}

/// More than `MAX_OPEN_INCIDENTS` open (a state the engine did not write: here filled by
/// hand): the next incident closes the oldest one no work holds `abandoned`, with a record
/// saying why; the one a remediation holds stays open whatever its age.
#[test]
fn past_the_open_bound_the_oldest_unheld_incident_is_abandoned() {
    let p = default_policy();
    let mut st = State::default();
    let (s, _) = step(&st, obs(Signal::GpuLost), Timestamp(1), &p);
    st = s;
    let held = st.node.remediation.map(|r| r.incident).unwrap();
    for i in 1..crate::model::MAX_OPEN_INCIDENTS as u64 {
        st.incidents.last_id += 1;
        st.incidents.open.insert(
            IncidentId(st.incidents.last_id),
            OpenIncident {
                opened_at: Timestamp(2 + i),
                verdict: Verdict::Log,
                rule: "by-hand".into(),
                gpu: None,
            },
        );
    }
    let (st, out) = step(
        &st,
        Input::Observation(Observation::new(Signal::SelfFault {
            component: "c".into(),
        })),
        Timestamp(5_000),
        &p,
    );
    assert_eq!(st.incidents.open.len(), crate::model::MAX_OPEN_INCIDENTS);
    assert!(
        st.incidents.open.contains_key(&held),
        "held by the remediation"
    );
    let abandoned: Vec<(IncidentId, String)> = out
        .iter()
        .filter_map(|a| match a {
            Action::Log(Record {
                incident,
                event:
                    IncidentEvent::Closed {
                        state: IncidentState::Abandoned,
                        summary,
                    },
                ..
            }) => Some((*incident, summary.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(abandoned.len(), 1, "{out:#?}");
    assert_eq!(abandoned[0].0, IncidentId(held.0 + 1), "the oldest unheld");
    assert!(
        abandoned[0]
            .1
            .contains("more than 1024 incidents were open")
    );
    st.check_ranges().unwrap();
}
