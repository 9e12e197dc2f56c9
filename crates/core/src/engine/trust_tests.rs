//! Tests of what the engine must never do: remediate gpu-medic's own faults, issue an order
//! this node cannot carry out, report a step that did not happen, or overflow on extreme
//! state values.

use std::time::Duration;

use proptest::prelude::*;

use super::*;
use crate::model::{
    ActionId, Capabilities, Command, GpuId, IncidentEvent, IncidentId, Observation, Order, Outcome,
    OutcomeStatus, Record,
};

fn policy() -> Policy {
    Policy::parse(
        std::path::Path::new("default.toml"),
        include_str!("../../../../policies/default.toml"),
    )
    .unwrap_or_else(|e| panic!("default policy: {e}"))
}

struct Run {
    policy: Policy,
    st: State,
    now: Timestamp,
    log: Vec<Action>,
}

impl Run {
    fn new(capabilities: Capabilities) -> Run {
        let mut r = Run {
            policy: policy(),
            st: State::default(),
            now: Timestamp(1_700_000_000_000),
            log: vec![],
        };
        r.feed(Input::Started { capabilities });
        r
    }

    fn feed(&mut self, input: Input) -> Vec<Action> {
        let (st, out) = step(&self.st, input, self.now, &self.policy);
        self.st = st;
        self.log.extend(out.clone());
        out
    }

    fn orders(out: &[Action]) -> Vec<Order> {
        let executable = out.iter().filter(|a| a.is_executable());
        executable
            .filter_map(|a| match a {
                Action::Execute(o) => Some(o.clone()),
                Action::Log(_) => None,
            })
            .collect()
    }

    fn opened(&self) -> usize {
        self.log
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
            .count()
    }

    fn fail(&mut self, o: &Order) -> Vec<Action> {
        self.feed(Input::Outcome(Outcome {
            action: o.id,
            status: OutcomeStatus::Failed { retryable: false },
            detail: "refused".into(),
            request_ids: vec![],
            evidence: None,
            fleet: None,
            diagnosis: None,
        }))
    }
}

fn fault(component: &str) -> Input {
    Input::Observation(
        Observation::new(Signal::SelfFault {
            component: component.into(),
        })
        .with_detail("cannot load libnvidia-ml.so.1"),
    )
}

fn xid(g: u32, code: u32) -> Input {
    Input::Observation(Observation::new(Signal::xid(code)).on_gpu(GpuId::index_only(g)))
}

#[test]
fn a_self_fault_is_journaled_once_never_remediated_and_closed_when_it_clears() {
    let mut r = Run::new(Capabilities::default());
    for _ in 0..50 {
        let out = r.feed(fault("nvml"));
        assert!(Run::orders(&out).is_empty(), "{out:?}");
        r.now = r.now.plus(Duration::from_secs(10));
        r.feed(Input::Tick);
    }
    assert_eq!(r.opened(), 1, "one incident, not one per poll");
    assert_eq!(r.st.node.phase, NodePhase::InService);
    let f = &r.st.incidents.self_faults["nvml"];
    assert!(r.st.incidents.open.contains_key(&f.incident));
    let id = f.incident;
    // A state that already knows the fault is not changed by another report of it: the
    // supervisor does not even write it to inputs.jsonl.
    let (same, out) = step(&r.st, fault("nvml"), r.now, &r.policy);
    assert_eq!(same, r.st);
    assert!(out.is_empty());
    r.feed(Input::Observation(Observation::new(
        Signal::SelfRecovered {
            component: "nvml".into(),
        },
    )));
    assert!(r.st.incidents.self_faults.is_empty());
    assert!(!r.st.incidents.open.contains_key(&id));
}

#[test]
fn restart_mps_is_never_ordered_when_gpu_medic_does_not_manage_the_daemon() {
    let mut r = Run::new(Capabilities {
        aws: true,
        mps: false,
        evidence: None,
        reboot: false,
        diagnose: None,
    });
    // An uncorrectable ECC error: stop the tasks on the GPU; the stop fails; with MPS
    // unmanaged that must not escalate to restart-mps.
    let out = r.feed(Input::Observation(
        Observation::new(Signal::EccUncorrected)
            .on_gpu(GpuId::index_only(0))
            .with_value(1),
    ));
    let orders = Run::orders(&out);
    assert_eq!(orders.len(), 1, "{out:?}");
    assert!(matches!(orders[0].command, Command::StopTasks { .. }));
    let out = r.fail(&orders[0]);
    assert!(Run::orders(&out).is_empty(), "{out:?}");
    assert_eq!(r.st.mps.phase, MpsPhase::Up, "not claimed unresponsive");
    assert!(r.st.mps.restarts.is_empty());
    // A signal whose rule says restart-mps is recorded as what would have been done.
    let out = r.feed(Input::Observation(
        Observation::new(Signal::MpsDown).with_value(5),
    ));
    assert!(Run::orders(&out).is_empty(), "{out:?}");
    assert!(r.st.mps.incident.is_none());
}

#[test]
fn without_aws_a_replace_is_recorded_as_would_have_and_the_node_stays_in_service() {
    let mut r = Run::new(Capabilities {
        aws: false,
        mps: true,
        evidence: None,
        reboot: false,
        diagnose: None,
    });
    let out = r.feed(xid(1, 79));
    assert!(Run::orders(&out).is_empty(), "{out:?}");
    assert_eq!(r.st.node.phase, NodePhase::InService);
    let w =
        r.st.node
            .withheld
            .clone()
            .expect("the decision is kept for status");
    assert_eq!(w.verdict, Verdict::Replace);
    assert!(w.why.contains("AWS remediation disabled"));
    assert!(r.st.incidents.open.is_empty());
    // Later faults join it instead of opening an incident per poll.
    let before = r.opened();
    for g in 0..4 {
        assert!(Run::orders(&r.feed(xid(g, 79))).is_empty());
    }
    assert_eq!(r.opened(), before);
}

#[test]
fn without_aws_a_node_fault_that_stays_is_journaled_once() {
    // A node-level fault that stays (Fabric Manager down, seen on every look) is withheld
    // once; its repeats join it once, not once per look: the journal does not grow while
    // nothing changes (no GPU points at the incident to keep it).
    let mut r = Run::new(Capabilities {
        aws: false,
        mps: true,
        evidence: None,
        reboot: false,
        diagnose: None,
    });
    let signals = |r: &Run| {
        r.log
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
            .count()
    };
    for _ in 0..2 {
        r.feed(Input::Observation(
            Observation::new(Signal::FabricManagerDown).with_value(2),
        ));
    }
    assert_eq!(r.opened(), 1);
    assert!(r.st.node.withheld.is_some());
    let once = signals(&r);
    for _ in 0..5 {
        r.now = r.now.plus(Duration::from_secs(30));
        r.feed(Input::Tick);
        r.feed(Input::Observation(
            Observation::new(Signal::FabricManagerDown).with_value(2),
        ));
    }
    assert_eq!(signals(&r), once, "journaled once while it stays");
    assert_eq!(r.opened(), 1);
}

#[test]
fn a_chain_that_failed_at_every_step_does_not_claim_the_node_drained() {
    let mut r = Run::new(Capabilities::default());
    let q = Run::orders(&r.feed(xid(1, 79))).remove(0);
    assert_eq!(q.command, Command::Quarantine);
    let d = Run::orders(&r.fail(&q)).remove(0);
    assert!(matches!(d.command, Command::Drain { .. }));
    let rep = Run::orders(&r.fail(&d)).remove(0);
    assert_eq!(rep.command, Command::Replace);
    r.fail(&rep);
    assert_eq!(r.st.node.phase, NodePhase::InService, "nothing took effect");
    // And when the quarantine and drain did work, the node is drained.
    let mut r = Run::new(Capabilities::default());
    let q = Run::orders(&r.feed(xid(1, 79))).remove(0);
    let ok = |o: &Order| {
        Input::Outcome(Outcome {
            action: o.id,
            status: OutcomeStatus::Done,
            detail: String::new(),
            request_ids: vec![],
            evidence: None,
            fleet: None,
            diagnosis: None,
        })
    };
    let d = Run::orders(&r.feed(ok(&q))).remove(0);
    let rep = Run::orders(&r.feed(ok(&d))).remove(0);
    r.fail(&rep);
    assert_eq!(r.st.node.phase, NodePhase::Drained);
}

#[test]
fn far_future_times_saturate_and_still_serialize() {
    let t = Timestamp(u64::MAX);
    assert_eq!(t.plus(Duration::MAX), Timestamp(u64::MAX));
    assert_eq!(Timestamp(5).minus(Duration::MAX), Timestamp(0));
    assert_eq!(t.to_string(), "9999-12-31T23:59:59.999Z");
    let back: Timestamp = serde_json::from_str(&serde_json::to_string(&t).unwrap()).unwrap();
    assert_eq!(back, Timestamp(crate::model::MAX_RFC3339_MS));
}

/// A state whose collections hold more than the engine ever keeps was not written by it: it
/// is refused as it is read (and set aside by the daemon) instead of costing its size on every
/// step. The bounded collections refuse while reading; the rest `check_ranges` refuses.
#[test]
fn a_state_larger_than_the_engine_keeps_is_refused() {
    let read = |v: serde_json::Value| {
        serde_json::from_value::<State>(v)
            .map_err(|e| e.to_string())
            .and_then(|st| st.check_ranges().map(|()| st))
    };
    let with = |field: &str, value: serde_json::Value| {
        let mut v = serde_json::to_value(State::default()).unwrap();
        v[field] = value;
        v
    };
    let sightings = |keys: usize, each: usize| {
        let times = vec![Timestamp(1); each];
        with(
            "sightings",
            (0..keys)
                .map(|i| (format!("r@gpu{i}"), serde_json::json!(times)))
                .collect::<serde_json::Map<_, _>>()
                .into(),
        )
    };
    let at_bound = read(sightings(
        MAX_SIGHTING_KEYS,
        crate::policy::limits::MAX_SIGHTINGS,
    ));
    assert_eq!(
        at_bound.map(|st| st.sightings.len()),
        Ok(MAX_SIGHTING_KEYS),
        "at the bound"
    );
    let why = read(sightings(MAX_SIGHTING_KEYS + 1, 1)).unwrap_err();
    assert!(why.contains("more than 1024 entries"), "{why}");
    assert!(read(sightings(1, crate::policy::limits::MAX_SIGHTINGS + 1)).is_err());
    let log = serde_json::json!({"incident": 1, "at": Timestamp(1), "repeats": 0});
    let logs: serde_json::Map<_, _> = (0..=MAX_RECENT_LOGS)
        .map(|i| (format!("c{i}"), log.clone()))
        .collect();
    assert!(read(with("recent_logs", logs.into())).is_err());

    // Records journaled ahead, beyond what the supervisor keeps or beyond a position.
    let stream = crate::model::StreamId::kmsg("boot");
    let mut st = State::default();
    for i in 0..=crate::model::cursor::MAX_AHEAD as u64 {
        st.delivery.ahead.insert((stream.clone(), i));
    }
    assert!(st.check_ranges().unwrap_err().contains("delivery.ahead"));
    let mut st = State::default();
    st.delivery.ahead.insert((stream, u64::MAX));
    assert!(st.check_ranges().unwrap_err().contains("beyond"));
    // A repair history longer than the engine remembers.
    let one = super::repair::Repair {
        incident: IncidentId(1),
        rule: "r".into(),
        at: Timestamp(1),
        boot_before: "b".into(),
        boot_after: None,
        back_at: None,
        result: super::repair::RepairResult::Repaired,
        why: String::new(),
    };
    let history = vec![one; super::repair::MAX_HISTORY + 1];
    let why = read(with("repair", serde_json::json!({ "history": history }))).unwrap_err();
    assert!(why.contains("more than 32 entries"), "{why}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// Extreme counters and times in the state (a hand-edited or corrupt state.json, a replay
    /// at a far-future tick) never panic, and the state still serializes.
    #[test]
    fn extreme_state_values_never_panic(
        next in prop::sample::select(vec![0u64, 1, u64::MAX - 1, u64::MAX]),
        attempt in prop::sample::select(vec![0u32, 1, u32::MAX]),
        now in prop::sample::select(vec![0u64, 1_700_000_000_000, crate::model::MAX_RFC3339_MS, u64::MAX]),
        inputs in prop::collection::vec(0u8..7, 1..30),
    ) {
        let mut st = State::default();
        st.incidents.last_id = next;
        st.orders.last_id = next;
        st.mps.restarts = vec![Timestamp(u64::MAX); 2];
        st.orders.in_flight.insert(ActionId(next), Order {
            id: ActionId(next),
            incident: IncidentId(next),
            command: Command::Replace,
            attempt,
            deadline: Timestamp(u64::MAX),
            planned: false,
        });
        st.orders.scheduled.push(Scheduled { at: Timestamp(0), incident: IncidentId(next), command: Command::RestartMps, attempt });
        st.sightings.insert_evicting("x@gpu0".into(), Sightings::newest(&[Timestamp(u64::MAX), Timestamp(0)]), |_| ());
        let p = policy();
        for i in inputs {
            let input = match i {
                0 => Input::Tick,
                1 => xid(0, 79),
                2 => xid(1, 13),
                3 => Input::Observation(Observation::new(Signal::MpsDown).with_value(u64::MAX)),
                4 => Input::Outcome(Outcome { action: ActionId(next), status: OutcomeStatus::Failed { retryable: true }, detail: String::new(), request_ids: vec![], evidence: None, fleet: None, diagnosis: None }),
                5 => fault("nvml"),
                _ => Input::Observation(Observation::new(Signal::EccUncorrected).on_gpu(GpuId::index_only(u32::MAX)).with_value(u64::MAX)),
            };
            let (s, _) = step(&st, input, Timestamp(now), &p);
            st = s;
            prop_assert!(serde_json::to_string(&st).is_ok());
        }
    }
}
