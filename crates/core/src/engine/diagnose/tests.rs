//! The diagnose step, driven with an explicit clock through the shipped default policy:
//! after a drain and after a reboot, each answer (pass, fail, could not tell, no answer),
//! the ladder after a failure, and a node with no tool.

use std::time::Duration;

use super::super::*;
use crate::model::diagnosis::{DiagResult, Diagnosis, GpuDiagnosis, Level, TierRun};
use crate::model::{
    Capabilities, Command, IncidentEvent, IncidentState, Observation, Order, Outcome,
    OutcomeStatus, Record, RecoveryAction,
};
use crate::policy::diagnose::OnUnknown;

fn policy() -> Policy {
    Policy::parse(
        std::path::Path::new("default.toml"),
        include_str!("../../../../../policies/default.toml"),
    )
    .unwrap_or_else(|e| panic!("default policy: {e}"))
}

struct Run {
    policy: Policy,
    st: State,
    now: Timestamp,
}

impl Run {
    fn new(diagnose: Option<Level>, reboot: bool) -> Run {
        Run::with(policy(), diagnose, reboot)
    }

    fn with(policy: Policy, diagnose: Option<Level>, reboot: bool) -> Run {
        let mut r = Run {
            policy,
            st: State::default(),
            now: Timestamp(1_700_000_000_000),
        };
        r.feed(Input::Started {
            capabilities: Capabilities {
                reboot,
                diagnose,
                ..Capabilities::default()
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
        out
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

    fn done_with(&mut self, o: &Order, d: Option<Diagnosis>) -> Vec<Action> {
        self.feed(Input::Outcome(Outcome {
            action: o.id,
            status: OutcomeStatus::Done,
            detail: String::new(),
            request_ids: vec![],
            evidence: None,
            fleet: None,
            diagnosis: d.map(Box::new),
        }))
    }

    fn done(&mut self, o: &Order) -> Vec<Action> {
        self.done_with(o, None)
    }

    /// A drain verdict's quarantine and drain done; what follows returned.
    fn drained(&mut self) -> Vec<Action> {
        let out = self.feed(Input::Observation(Observation::new(
            Signal::RecoveryAction {
                action: RecoveryAction::DrainP2p,
            },
        )));
        let q = Run::order(&out);
        assert_eq!(q.command, Command::Quarantine);
        let d = Run::order(&self.done(&q));
        assert!(matches!(d.command, Command::Drain { .. }), "{d:?}");
        self.done(&d)
    }

    fn closed(out: &[Action]) -> Option<(IncidentState, String)> {
        out.iter().find_map(|a| match a {
            Action::Log(Record {
                event: IncidentEvent::Closed { state, summary },
                ..
            }) => Some((*state, summary.clone())),
            _ => None,
        })
    }
}

fn diagnosis(result: DiagResult) -> Diagnosis {
    Diagnosis {
        level: Level::Quick,
        result,
        gpus: vec![GpuDiagnosis {
            index: 0,
            uuid: "GPU-0".into(),
            result,
            tests: vec![],
        }],
        tiers: vec![TierRun {
            tier: crate::model::diagnosis::Tier::Cuda,
            ran: true,
            result,
            why: String::new(),
            cause: None,
            notes: vec![],
            duration_ms: 10,
            raw: String::new(),
        }],
        summary: format!("GPU 0 {}", result.as_str()),
        cause: None,
        duration_ms: 10,
    }
}

/// The default policy with no retry of a diagnosis that could not tell.
fn no_retry() -> Policy {
    let mut p = policy();
    p.diagnose.retry_within = Duration::ZERO;
    p
}

fn notes(out: &[Action]) -> Vec<String> {
    out.iter()
        .filter_map(|a| match a {
            Action::Log(Record {
                event: IncidentEvent::Note { text },
                ..
            }) => Some(text.clone()),
            _ => None,
        })
        .collect()
}

impl Run {
    /// Answers diagnosis `t` "could not tell" and every retry after it the same, a tick each
    /// `retry_delay`, until the step gives up: how many diagnoses were ordered, and what the
    /// last answer led to.
    fn unknown_until_given_up(&mut self, t: Order) -> (u32, Vec<Action>) {
        let mut t = t;
        let mut n = 1;
        loop {
            let out = self.done_with(&t, Some(diagnosis(DiagResult::Unknown)));
            if out.iter().any(|a| a.is_executable()) || Run::closed(&out).is_some() {
                return (n, out);
            }
            assert!(
                notes(&out)
                    .iter()
                    .any(|x| x.contains("diagnosing again in 1m")),
                "{out:#?}"
            );
            self.now = self.now.plus(self.policy.diagnose.retry_delay);
            let again = Run::order(&self.feed(Input::Tick));
            assert!(
                matches!(again.command, Command::Diagnose { .. }),
                "{again:?}"
            );
            assert_eq!(self.st.node.phase, NodePhase::Verifying);
            t = again;
            n += 1;
            assert!(n < 100, "never gave up");
        }
    }

    /// An XID 79's reboot up to the diagnosis after the boot check.
    fn rebooted_to_diagnosis(&mut self) -> Order {
        let out = self.feed(Input::Observation(
            Observation::new(Signal::xid(79)).on_gpu(crate::model::GpuId::index_only(0)),
        ));
        let q = Run::order(&out);
        let d = Run::order(&self.done(&q));
        let b = Run::order(&self.done(&d));
        assert!(matches!(b.command, Command::Reboot { .. }));
        self.done(&b);
        let q = Run::order(&self.feed(Input::Boot {
            id: "boot-2".into(),
        }));
        let c = Run::order(&self.done(&q));
        let t = Run::order(&self.done(&c));
        assert!(matches!(t.command, Command::Diagnose { .. }), "{t:?}");
        t
    }
}

#[test]
fn a_drained_node_that_passes_its_diagnosis_goes_back_into_service() {
    let mut r = Run::new(Some(Level::Standard), true);
    let t = Run::order(&r.drained());
    assert_eq!(
        t.command,
        Command::Diagnose {
            level: Level::Standard
        }
    );
    assert_eq!(r.st.node.phase, NodePhase::Verifying);
    let restore = Run::order(&r.done_with(&t, Some(diagnosis(DiagResult::Pass))));
    assert_eq!(restore.command, Command::Restore);
    let out = r.done(&restore);
    let (state, summary) = Run::closed(&out).unwrap();
    assert_eq!(state, IncidentState::Resolved);
    assert!(summary.contains("diagnosed healthy"), "{summary}");
    assert_eq!(r.st.node.phase, NodePhase::InService);
    assert!(r.st.node.remediation.is_none());
}

#[test]
fn a_failed_diagnosis_climbs_to_a_reboot_then_a_second_failure_replaces() {
    let mut r = Run::new(Some(Level::Quick), true);
    let t = Run::order(&r.drained());
    let out = r.done_with(&t, Some(diagnosis(DiagResult::Fail)));
    let reboot = Run::order(&out);
    assert!(
        matches!(reboot.command, Command::Reboot { .. }),
        "{reboot:?}"
    );
    assert!(
        out.iter().any(|a| matches!(a, Action::Log(Record { event: IncidentEvent::Escalated { rule, .. }, .. }) if rule == super::RULE_DIAGNOSIS_FAILED)),
        "{out:#?}"
    );
    // The reboot, the boot, the quarantine and the boot check; then the diagnosis again.
    assert!(r.done(&reboot).iter().all(|a| !a.is_executable()));
    let q = Run::order(&r.feed(Input::Boot {
        id: "boot-2".into(),
    }));
    assert_eq!(q.command, Command::Quarantine);
    let c = Run::order(&r.done(&q));
    assert_eq!(c.command, Command::BootCheck);
    let t2 = Run::order(&r.done(&c));
    assert_eq!(
        t2.command,
        Command::Diagnose {
            level: Level::Quick
        }
    );
    let out = r.done_with(&t2, Some(diagnosis(DiagResult::Fail)));
    let next = Run::order(&out);
    assert!(matches!(next.command, Command::Drain { .. }), "{next:?}");
    let rep = Run::order(&r.done(&next));
    assert_eq!(rep.command, Command::Replace);
}

#[test]
fn without_the_reboot_rung_a_failed_diagnosis_replaces() {
    let mut r = Run::new(Some(Level::Quick), false);
    let t = Run::order(&r.drained());
    let out = r.done_with(&t, Some(diagnosis(DiagResult::Fail)));
    assert_eq!(Run::order(&out).command, Command::Replace);
}

#[test]
fn could_not_tell_is_tried_again_within_the_bound_then_keeps_the_node_drained() {
    let mut r = Run::new(Some(Level::Quick), true);
    let t = Run::order(&r.drained());
    let t0 = r.now;
    let (n, out) = r.unknown_until_given_up(t);
    // Every minute for ten minutes: t0, t0+1m, ... t0+9m; a tenth retry would end past it.
    assert_eq!(n, 10);
    assert!(r.now.since(t0) < r.policy.diagnose.retry_within);
    assert!(out.iter().all(|a| !a.is_executable()), "{out:#?}");
    let (state, summary) = Run::closed(&out).unwrap();
    assert_eq!(state, IncidentState::Drained);
    assert!(summary.contains("could not tell"), "{summary}");
    assert!(summary.contains("10 diagnosis(es) within 9m"), "{summary}");
    assert_eq!(r.st.node.phase, NodePhase::Drained);
    // A done order that brought no diagnosis is no pass either.
    let mut r = Run::with(no_retry(), Some(Level::Quick), true);
    let t = Run::order(&r.drained());
    let out = r.done_with(&t, None);
    assert_eq!(Run::closed(&out).unwrap().0, IncidentState::Drained);
}

#[test]
fn a_retry_that_passes_returns_the_node() {
    let mut r = Run::new(Some(Level::Quick), true);
    let t = Run::order(&r.drained());
    assert!(
        !r.done_with(&t, Some(diagnosis(DiagResult::Unknown)))
            .iter()
            .any(|a| a.is_executable())
    );
    r.now = r.now.plus(r.policy.diagnose.retry_delay);
    let t = Run::order(&r.feed(Input::Tick));
    let restore = Run::order(&r.done_with(&t, Some(diagnosis(DiagResult::Pass))));
    assert_eq!(restore.command, Command::Restore);
    let (state, summary) = Run::closed(&r.done(&restore)).unwrap();
    assert_eq!(state, IncidentState::Resolved);
    assert!(summary.contains("diagnosed healthy"), "{summary}");
}

#[test]
fn could_not_tell_does_what_the_policy_says() {
    for (on, expect) in [
        (OnUnknown::Return, Command::Restore),
        (OnUnknown::Replace, Command::Replace),
    ] {
        let mut p = no_retry();
        p.diagnose.on_unknown = on;
        let mut r = Run::with(p, Some(Level::Quick), true);
        let t = Run::order(&r.drained());
        let out = r.done_with(&t, Some(diagnosis(DiagResult::Unknown)));
        let o = Run::order(&out);
        assert_eq!(o.command, expect, "{on:?}");
        if on == OnUnknown::Return {
            // Back on the passive checks, and the incident says so (not an operator's abort).
            let (state, summary) = Run::closed(&r.done(&o)).unwrap();
            assert_eq!(state, IncidentState::Resolved, "{summary}");
            assert!(summary.contains("passive checks"), "{summary}");
        }
    }
}

#[test]
fn a_pass_with_configuration_findings_returns_the_node_and_says_so() {
    let mut r = Run::new(Some(Level::Quick), true);
    let t = Run::order(&r.drained());
    let out = r.done_with(&t, Some(diagnosis(DiagResult::Config)));
    assert_eq!(Run::order(&out).command, Command::Restore);
    assert!(
        notes(&out)
            .iter()
            .any(|n| n.contains("needs configuration")),
        "{out:#?}"
    );
}

#[test]
fn a_diagnosis_past_its_deadline_could_not_tell() {
    let mut r = Run::with(no_retry(), Some(Level::Quick), true);
    let t = Run::order(&r.drained());
    assert_eq!(
        t.command,
        Command::Diagnose {
            level: Level::Quick
        }
    );
    r.now = r
        .now
        .plus(r.policy.deadlines.diagnose + Duration::from_secs(1));
    let out = r.feed(Input::Tick);
    let (state, summary) = Run::closed(&out).unwrap();
    assert_eq!(state, IncidentState::Drained);
    assert!(summary.contains("could not run"), "{summary}");
    // Its late outcome changes nothing.
    assert!(
        r.done_with(&t, Some(diagnosis(DiagResult::Pass)))
            .iter()
            .all(|a| !a.is_executable())
    );
    assert_eq!(r.st.node.phase, NodePhase::Drained);
}

#[test]
fn after_a_reboot_could_not_tell_returns_the_node_within_the_bound() {
    let mut r = Run::new(Some(Level::Quick), true);
    let t = r.rebooted_to_diagnosis();
    let t0 = r.now;
    let (n, out) = r.unknown_until_given_up(t);
    assert_eq!(n, 10);
    let restore = Run::order(&out);
    assert_eq!(restore.command, Command::Restore);
    assert!(r.now.since(t0) < r.policy.diagnose.retry_within);
    assert!(
        notes(&out)
            .iter()
            .any(|x| x.contains("boot_on_unknown = \"return\"") && x.contains("slot is released")),
        "{out:#?}"
    );
    let (state, summary) = Run::closed(&r.done(&restore)).unwrap();
    assert_eq!(state, IncidentState::Repaired, "{summary}");
    assert!(
        summary.contains("returned on the passive checks"),
        "{summary}"
    );
    assert!(summary.contains("fleet budget slot released"), "{summary}");
    assert_eq!(r.st.node.phase, NodePhase::InService);
}

#[test]
fn after_a_reboot_could_not_tell_replaces_when_the_policy_says() {
    let mut p = no_retry();
    p.diagnose.boot_on_unknown = OnUnknown::Replace;
    let mut r = Run::with(p, Some(Level::Quick), true);
    let t = r.rebooted_to_diagnosis();
    let out = r.done_with(&t, Some(diagnosis(DiagResult::Unknown)));
    let o = Run::order(&out);
    assert!(
        matches!(o.command, Command::Drain { .. } | Command::Replace),
        "{o:?}"
    );
    // `keep` after a reboot would hold the slot for ever: refused when the policy is read.
    let e = Policy::parse(
        std::path::Path::new("p.toml"),
        "version = 1\n[diagnose]\nboot_on_unknown = \"keep\"\n",
    )
    .unwrap_err();
    assert!(e.to_string().contains("boot_on_unknown"), "{e}");
    // Nor may the retries last longer than a day.
    let e = Policy::parse(
        std::path::Path::new("p.toml"),
        "version = 1\n[diagnose]\nretry_within = \"2d\"\n",
    )
    .unwrap_err();
    assert!(e.to_string().contains("retry_within"), "{e}");
}

#[test]
fn after_a_reboot_the_diagnosis_decides_the_return() {
    let mut r = Run::new(Some(Level::Quick), true);
    let out = r.feed(Input::Observation(
        Observation::new(Signal::xid(79)).on_gpu(crate::model::GpuId::index_only(0)),
    ));
    let q = Run::order(&out);
    let d = Run::order(&r.done(&q));
    let b = Run::order(&r.done(&d));
    assert!(matches!(b.command, Command::Reboot { .. }));
    r.done(&b);
    let q = Run::order(&r.feed(Input::Boot {
        id: "boot-2".into(),
    }));
    let c = Run::order(&r.done(&q));
    let t = Run::order(&r.done(&c));
    assert_eq!(
        t.command,
        Command::Diagnose {
            level: Level::Quick
        }
    );
    let restore = Run::order(&r.done_with(&t, Some(diagnosis(DiagResult::Pass))));
    assert_eq!(restore.command, Command::Restore);
    let (state, summary) = Run::closed(&r.done(&restore)).unwrap();
    assert_eq!(state, IncidentState::Repaired, "{summary}");
}

#[test]
fn a_node_with_no_tool_is_judged_as_before() {
    let mut r = Run::new(None, true);
    let out = r.drained();
    assert!(out.iter().all(|a| !a.is_executable()));
    assert_eq!(Run::closed(&out).unwrap().0, IncidentState::Drained);
    let mut p = policy();
    p.diagnose.after_drain = false;
    let mut r = Run::with(p, Some(Level::Quick), true);
    assert_eq!(Run::closed(&r.drained()).unwrap().0, IncidentState::Drained);
}
