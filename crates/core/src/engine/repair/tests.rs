//! The reboot rung, driven with an explicit clock through the shipped default policy: the
//! steps, the boot, the check after it, the ladder, and the failure paths.

use std::time::Duration;

use super::super::*;
use super::{Ledger, RULE_LADDER, Repair, RepairResult};
use crate::model::{
    Capabilities, Command, GpuId, IncidentEvent, IncidentId, IncidentState, Observation, Order,
    Outcome, OutcomeStatus, Record, RecoveryAction,
};

fn policy() -> Policy {
    Policy::parse(
        std::path::Path::new("default.toml"),
        include_str!("../../../../../policies/default.toml"),
    )
    .unwrap_or_else(|e| panic!("default policy: {e}"))
}

const DAY: Duration = Duration::from_secs(24 * 3600);

struct Run {
    policy: Policy,
    st: State,
    now: Timestamp,
    log: Vec<Action>,
}

impl Run {
    fn new() -> Run {
        Run::with(policy(), true)
    }

    fn with(policy: Policy, reboot: bool) -> Run {
        let mut r = Run {
            policy,
            st: State::default(),
            now: Timestamp(1_700_000_000_000),
            log: vec![],
        };
        r.feed(Input::Started {
            capabilities: Capabilities {
                aws: true,
                mps: true,
                reboot,
                evidence: None,
                diagnose: None,
            },
        });
        r.feed(Input::Boot {
            id: "boot-1".into(),
        });
        r
    }

    fn feed(&mut self, input: Input) -> Vec<Action> {
        let (st, out) = step(&self.st, input, self.now, &self.policy);
        self.st = st;
        self.log.extend(out.clone());
        out
    }

    fn later(&mut self, d: Duration) -> Vec<Action> {
        self.now = self.now.plus(d);
        self.feed(Input::Tick)
    }

    fn order(out: &[Action]) -> Order {
        let o: Vec<Order> = out
            .iter()
            .filter_map(|a| match a {
                Action::Execute(o) => Some(o.clone()),
                Action::Log(_) => None,
            })
            .collect();
        assert_eq!(o.len(), 1, "one order expected: {out:#?}");
        o[0].clone()
    }

    fn outcome(&mut self, o: &Order, status: OutcomeStatus, detail: &str) -> Vec<Action> {
        self.feed(Input::Outcome(Outcome {
            action: o.id,
            status,
            detail: detail.into(),
            request_ids: vec![],
            evidence: None,
            fleet: None,
            diagnosis: None,
        }))
    }

    fn done(&mut self, o: &Order) -> Vec<Action> {
        self.outcome(o, OutcomeStatus::Done, "")
    }

    fn fail(&mut self, o: &Order, detail: &str) -> Vec<Action> {
        self.outcome(o, OutcomeStatus::Failed { retryable: false }, detail)
    }

    fn xid(&mut self, code: u32) -> Vec<Action> {
        self.feed(Input::Observation(
            Observation::new(Signal::xid(code)).on_gpu(GpuId::index_only(0)),
        ))
    }

    /// Quarantine and drain done; the reboot order returned.
    fn through_to_reboot(&mut self, out: Vec<Action>) -> Order {
        let q = Run::order(&out);
        assert_eq!(q.command, Command::Quarantine);
        let d = Run::order(&self.done(&q));
        assert!(matches!(d.command, Command::Drain { .. }), "{d:?}");
        let b = Run::order(&self.done(&d));
        assert_eq!(
            b.command,
            Command::Reboot {
                boot: self.st.repair.boot.clone().unwrap()
            }
        );
        assert_eq!(self.st.node.phase, NodePhase::Rebooting);
        b
    }

    /// The reboot accepted, the node booted (`id`), re-quarantined: the boot check returned.
    fn through_to_boot_check(&mut self, reboot: &Order, id: &str) -> Order {
        assert!(self.done(reboot).iter().all(|a| !a.is_executable()));
        self.now = self.now.plus(Duration::from_secs(90));
        let q = Run::order(&self.feed(Input::Boot { id: id.into() }));
        assert_eq!(q.command, Command::Quarantine);
        assert_eq!(self.st.node.phase, NodePhase::Verifying);
        let c = Run::order(&self.done(&q));
        assert_eq!(c.command, Command::BootCheck);
        c
    }

    /// A whole repair that mends the node.
    fn repair(&mut self, out: Vec<Action>, id: &str) {
        let b = self.through_to_reboot(out);
        let c = self.through_to_boot_check(&b, id);
        let restore = Run::order(&self.done(&c));
        assert_eq!(restore.command, Command::Restore);
        assert!(self.done(&restore).iter().all(|a| !a.is_executable()));
    }

    fn closed(&self) -> Vec<(IncidentId, IncidentState, String)> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::Log(Record {
                    incident,
                    event: IncidentEvent::Closed { state, summary },
                    ..
                }) => Some((*incident, *state, summary.clone())),
                _ => None,
            })
            .collect()
    }

    fn escalations(&self) -> Vec<(String, String)> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::Log(Record {
                    event: IncidentEvent::Escalated { rule, reason, .. },
                    ..
                }) => Some((rule.clone(), reason.clone())),
                _ => None,
            })
            .collect()
    }
}

#[test]
fn a_first_xid_79_reboots_and_a_healthy_node_returns_to_service() {
    let mut r = Run::new();
    let out = r.xid(79);
    r.repair(out, "boot-2");
    assert_eq!(r.st.node.phase, NodePhase::InService);
    assert!(r.st.node.remediation.is_none());
    assert!(r.st.gpus.health.is_empty(), "the GPU's fault is cleared");
    let (id, state, summary) = r.closed().pop().unwrap();
    assert_eq!((id, state), (IncidentId(1), IncidentState::Repaired));
    assert!(summary.contains("repaired by reboot"), "{summary}");
    let h = &r.st.repair.history;
    assert_eq!(h.len(), 1);
    assert_eq!(h[0].result, RepairResult::Repaired);
    assert_eq!(
        (h[0].boot_before.as_str(), h[0].boot_after.as_deref()),
        ("boot-1", Some("boot-2"))
    );
    assert_eq!(h[0].rule, "xid-fallen-off-bus");
}

#[test]
fn a_pending_row_remap_is_shown_applied_after_the_reboot() {
    let mut r = Run::new();
    let out = r.feed(Input::Observation(
        Observation::new(Signal::RowRemapPending).on_gpu(GpuId::index_only(0)),
    ));
    r.repair(out, "boot-2");
    let (_, state, summary) = r.closed().pop().unwrap();
    assert_eq!(state, IncidentState::Repaired);
    assert!(
        summary.contains("the pending row remap on GPU 0 applied"),
        "{summary}"
    );
    // An XID 79 repair says nothing of remaps.
    let mut r = Run::new();
    let out = r.xid(79);
    r.repair(out, "boot-2");
    assert!(!r.closed().pop().unwrap().2.contains("row remap"));
}

#[test]
fn a_node_still_faulty_after_the_boot_is_replaced_with_its_slot_held() {
    let mut r = Run::new();
    let out = r.xid(79);
    let b = r.through_to_reboot(out);
    let c = r.through_to_boot_check(&b, "boot-2");
    let d = Run::order(&r.fail(&c, "unhealthy after the boot: gpu-lost on GPU 0"));
    // Drain again first: idempotent on a DRAINING instance (its slot held), and a new
    // container instance ARN after the boot is drained too.
    assert!(matches!(d.command, Command::Drain { .. }), "{d:?}");
    let rep = Run::order(&r.done(&d));
    assert_eq!(rep.command, Command::Replace);
    r.done(&rep);
    assert_eq!(r.st.node.phase, NodePhase::Replaced);
    assert_eq!(r.closed().pop().unwrap().1, IncidentState::Replaced);
    assert_eq!(r.st.repair.history[0].result, RepairResult::Escalated);
    assert!(
        r.escalations()
            .iter()
            .any(|(_, why)| why.contains("not healthy after the reboot")),
        "{:?}",
        r.escalations()
    );
}

#[test]
fn a_refused_reboot_goes_on_to_replace() {
    let mut r = Run::new();
    let out = r.xid(119);
    assert!(
        Run::orders_of(&out).is_empty(),
        "119 confirms on the second sighting"
    );
    let out = r.xid(119);
    let b = r.through_to_reboot(out);
    let rep = Run::order(&r.fail(&b, "UnauthorizedOperation: not allowed to reboot"));
    assert_eq!(rep.command, Command::Replace);
    assert_eq!(r.st.repair.history[0].result, RepairResult::NotRebooted);
    assert!(r.st.repair.history[0].boot_after.is_none());
}

#[test]
fn a_node_still_up_past_the_reboot_deadline_is_replaced() {
    let mut r = Run::new();
    let out = r.xid(79);
    let b = r.through_to_reboot(out);
    assert!(r.done(&b).iter().all(|a| !a.is_executable()));
    assert_eq!(r.st.node.remediation.unwrap().step, Step::AwaitBoot);
    assert!(Run::orders_of(&r.later(Duration::from_secs(300))).is_empty());
    // gpu-medic restarted on the same boot: still waiting.
    assert!(
        Run::orders_of(&r.feed(Input::Boot {
            id: "boot-1".into()
        }))
        .is_empty()
    );
    let rep = Run::order(&r.later(Duration::from_secs(301)));
    assert_eq!(rep.command, Command::Replace);
    assert_eq!(r.st.repair.history[0].result, RepairResult::NotRebooted);
}

#[test]
fn a_reboot_order_in_flight_at_a_new_boot_is_finished_never_resumed() {
    let mut r = Run::new();
    let out = r.xid(79);
    let b = r.through_to_reboot(out);
    // gpu-medic stopped before the call's outcome came back; the instance rebooted.
    let out = r.feed(Input::Boot {
        id: "boot-2".into(),
    });
    let q = Run::order(&out);
    assert_eq!(q.command, Command::Quarantine);
    assert!(
        !r.st.orders.in_flight.contains_key(&b.id),
        "never handed out again"
    );
    assert!(out.iter().any(|a| matches!(a, Action::Log(Record { event: IncidentEvent::ActionFinished { outcome }, .. }) if outcome.action == b.id)));
    // The same boot again (a second restart) changes nothing.
    let before = r.st.clone();
    r.feed(Input::Boot {
        id: "boot-2".into(),
    });
    assert_eq!(r.st.node.remediation, before.node.remediation);
}

#[test]
fn the_same_boot_after_a_crash_resumes_the_reboot_order() {
    let mut r = Run::new();
    let out = r.xid(79);
    let b = r.through_to_reboot(out);
    r.feed(Input::Boot {
        id: "boot-1".into(),
    });
    assert!(
        r.st.orders.in_flight.contains_key(&b.id),
        "the call is made on resume"
    );
    assert_eq!(r.st.node.remediation.unwrap().step, Step::Reboot);
}

#[test]
fn the_ladder_xid_79_twice_within_the_window_is_replaced() {
    let mut r = Run::new();
    let out = r.xid(79);
    r.repair(out, "boot-2");
    // Past the recurrence window, inside the 7-day window: rule xid-fallen-off-bus allows 1.
    r.later(2 * DAY);
    let q = Run::order(&r.xid(79));
    assert_eq!(q.command, Command::Quarantine);
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Replace);
    let (rule, why) = r.escalations().pop().unwrap();
    assert_eq!(rule, RULE_LADDER);
    assert!(why.contains("allows 1 reboot"), "{why}");
}

#[test]
fn the_ladder_past_the_window_reboots_again() {
    let mut r = Run::new();
    let out = r.xid(79);
    r.repair(out, "boot-2");
    r.later(8 * DAY);
    let out = r.xid(79);
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Reboot);
    r.repair(out, "boot-3");
    assert_eq!(r.st.repair.history.len(), 2);
}

#[test]
fn a_fault_soon_after_a_reboot_is_replaced_and_the_node_limit_holds() {
    let mut r = Run::new();
    let out = r.xid(46);
    r.repair(out, "boot-2");
    r.later(Duration::from_secs(3600));
    Run::order(&r.xid(62));
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Replace);
    assert!(r.escalations().pop().unwrap().1.contains("did not mend it"));

    // The node limit: 2 reboots within 7 days, whatever the rule.
    let mut r = Run::new();
    for (i, code) in [46u32, 62].into_iter().enumerate() {
        let out = r.xid(code);
        assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Reboot, "{code}");
        r.repair(out, &format!("boot-{}", i + 2));
        r.later(2 * DAY);
    }
    Run::order(&r.xid(109));
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Replace);
    assert!(r.escalations().pop().unwrap().1.contains("limit 2"));
}

#[test]
fn the_fault_coming_back_after_the_boot_goes_on_to_replace() {
    let mut r = Run::new();
    let out = r.xid(79);
    let b = r.through_to_reboot(out);
    let c = r.through_to_boot_check(&b, "boot-2");
    // The probes see the GPU lost again while the check runs.
    r.feed(Input::Observation(
        Observation::new(Signal::GpuLost).on_gpu(GpuId::index_only(0)),
    ));
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Replace);
    // The check's own verdict then leads to drain -> replace.
    let d = Run::order(&r.fail(&c, "unhealthy"));
    assert!(matches!(d.command, Command::Drain { .. }));
}

#[test]
fn without_the_rung_a_reboot_verdict_is_a_replace() {
    let mut r = Run::with(policy(), false);
    Run::order(&r.xid(79));
    assert_eq!(r.st.node.remediation.unwrap().goal, Goal::Replace);
    let opened = r.log.iter().find_map(|a| match a {
        Action::Log(Record {
            event: IncidentEvent::Opened {
                verdict, reason, ..
            },
            ..
        }) => Some((*verdict, reason.clone())),
        _ => None,
    });
    let (verdict, reason) = opened.unwrap();
    assert_eq!(verdict, Verdict::Replace);
    assert!(reason.contains("no reboot rung"), "{reason}");
}

#[test]
fn observe_only_says_what_it_would_reboot() {
    let mut p = policy();
    p.observe_only = true;
    let mut r = Run::with(p, true);
    let out = r.feed(Input::Observation(Observation::new(
        Signal::RecoveryAction {
            action: RecoveryAction::NodeReboot,
        },
    )));
    assert!(out.iter().all(|a| !a.is_executable()));
    let would: Vec<&str> = out
        .iter()
        .filter_map(|a| match a {
            Action::Log(Record {
                event:
                    IncidentEvent::ActionStarted {
                        order,
                        dry_run: true,
                    },
                ..
            }) => Some(order.command.name()),
            _ => None,
        })
        .collect();
    assert_eq!(would, ["quarantine", "drain", "reboot"]);
    let (_, state, summary) = r.closed().pop().unwrap();
    assert_eq!(state, IncidentState::Observed);
    assert!(summary.contains("rebooted the instance"), "{summary}");
}

#[test]
fn termination_during_the_wait_for_the_boot_completes_the_hook() {
    let mut r = Run::new();
    let out = r.xid(79);
    let b = r.through_to_reboot(out);
    r.done(&b);
    let out = r.feed(Input::Observation(Observation::new(Signal::Lifecycle {
        state: crate::model::LifecycleState::Terminating,
    })));
    let c = Run::order(&out);
    assert!(
        matches!(c.command, Command::CompleteLifecycle { .. }),
        "{c:?}"
    );
}

#[test]
fn an_unknown_boot_id_never_reboots() {
    let mut r = Run::with(policy(), true);
    r.st.repair.boot = None;
    let q = Run::order(&r.xid(79));
    let d = Run::order(&r.done(&q));
    let next = Run::order(&r.done(&d));
    assert_eq!(next.command, Command::Replace);
    assert!(r.st.repair.history.is_empty());
}

#[test]
fn an_abort_is_refused_while_rebooting_and_the_history_is_bounded() {
    let mut r = Run::new();
    let out = r.xid(79);
    let b = r.through_to_reboot(out);
    r.done(&b);
    let out = r.feed(Input::Operator(crate::model::OperatorRequest::Abort {
        incident: IncidentId(1),
        by: "op".into(),
    }));
    assert!(out.iter().all(|a| !a.is_executable()));
    assert_eq!(r.st.node.remediation.unwrap().step, Step::AwaitBoot);

    let mut r = Run::new();
    for i in 0..(super::MAX_HISTORY + 5) {
        let out = r.xid(46);
        r.repair(out, &format!("b{i}"));
        r.later(8 * DAY);
    }
    assert_eq!(r.st.repair.history.len(), super::MAX_HISTORY);
}

impl Run {
    fn orders_of(out: &[Action]) -> Vec<Order> {
        out.iter()
            .filter_map(|a| match a {
                Action::Execute(o) => Some(o.clone()),
                Action::Log(_) => None,
            })
            .collect()
    }
}

/// The state lost and the journal rotated: the history is empty, but the reboot ledger
/// (`Input::Reboots`) gives back the reboot this instance had, so a second XID 79 within the
/// window is replaced, not rebooted. The same from the instance's tag (result `unknown`). A
/// history that already has the reboot is not doubled, and a kept copy completes it.
#[test]
fn reboots_kept_outside_the_state_stop_a_second_reboot() {
    let mut first = Run::new();
    let out = first.xid(79);
    first.repair(out, "boot-2");
    let kept: Vec<Repair> = first.st.repair.history.to_vec();
    assert_eq!(kept.len(), 1);

    // What a rebuild from a rotated journal knows: nothing about the reboot.
    let mut r = Run::new();
    r.now = first.now.plus(Duration::from_secs(3600));
    r.feed(Input::Reboots {
        reboots: kept.clone(),
        from: "reboots.json".into(),
    });
    assert_eq!(r.st.repair.history.to_vec(), kept);
    r.xid(79);
    let inc = r.st.incidents.open.values().next().unwrap();
    assert_eq!(inc.verdict, Verdict::Replace);
    assert!(
        r.escalations()
            .iter()
            .any(|(rule, why)| rule == RULE_LADDER && why.contains("allows 1 reboot")),
        "{:#?}",
        r.escalations()
    );

    // From the tag: counted as done, never pending.
    let tagged = crate::model::repair::from_tag(&crate::model::repair::tag_value(&kept));
    let mut t = Run::new();
    t.now = r.now;
    t.feed(Input::Reboots {
        reboots: tagged,
        from: "tag".into(),
    });
    t.xid(79);
    assert_eq!(
        t.st.incidents.open.values().next().unwrap().verdict,
        Verdict::Replace
    );

    // Merged twice, or into a history that has it: once. A pending copy is completed.
    let mut pending = kept[0].clone();
    pending.boot_after = None;
    pending.back_at = None;
    pending.result = RepairResult::Pending;
    let mut l = Ledger::default();
    l.merge(vec![pending]);
    l.merge(kept.clone());
    l.merge(kept.clone());
    assert_eq!(l.history.to_vec(), kept);
}

/// More reboots kept than the history holds: the newest stay, oldest first.
#[test]
fn a_merge_keeps_the_newest_reboots() {
    let mut l = Ledger::default();
    let one = |i: u64| Repair {
        incident: IncidentId(i),
        rule: "r".into(),
        at: Timestamp(i),
        boot_before: "b".into(),
        boot_after: Some("c".into()),
        back_at: None,
        result: RepairResult::Repaired,
        why: String::new(),
    };
    l.merge((0..40).rev().map(one).collect());
    assert_eq!(l.history.len(), super::MAX_HISTORY);
    assert_eq!(l.history[0].at, Timestamp(40 - super::MAX_HISTORY as u64));
    assert_eq!(l.history.last().unwrap().at, Timestamp(39));
}
