//! Application faults judged by who and where, through the shipped default policy: one
//! program again and again stays in service, different programs at one place drain, one
//! program's replicas spread over places or GPUs do not, MPS faults charged to the server,
//! an overlay's `culprit`, XID 45 joining its cause, and a storm of one task.

use std::time::Duration;

use super::super::*;
use crate::engine::tests::gpu;
use crate::model::attribution::{Culprit, Site, Via, XidContext};
use crate::model::{Command, IncidentEvent, IncidentId, Observation, Order, Record};

fn policy(extra: &str) -> Policy {
    let text = format!(
        "{}\n{extra}",
        include_str!("../../../../../policies/default.toml")
    );
    Policy::parse(std::path::Path::new("default.toml"), &text)
        .unwrap_or_else(|e| panic!("default policy: {e}"))
}

struct Run {
    policy: Policy,
    st: State,
    now: Timestamp,
    /// Time between two inputs.
    gap: Duration,
    out: Vec<Action>,
}

impl Run {
    fn new(policy: Policy) -> Run {
        Run {
            policy,
            st: State::default(),
            now: Timestamp(1_700_000_000_000),
            gap: Duration::from_secs(2),
            out: Vec::new(),
        }
    }

    fn feed(&mut self, obs: Observation) -> Vec<Action> {
        self.input(Input::Observation(obs))
    }

    fn input(&mut self, input: Input) -> Vec<Action> {
        self.now = self.now.plus(self.gap);
        let (st, out) = step(&self.st, input, self.now, &self.policy);
        self.st = st;
        self.out.extend(out.clone());
        out
    }

    fn orders(&self) -> Vec<Order> {
        self.out
            .iter()
            .filter_map(|a| match a {
                Action::Execute(o) => Some(o.clone()),
                _ => None,
            })
            .collect()
    }

    fn opened(&self) -> Vec<(String, Verdict, String)> {
        self.out
            .iter()
            .filter_map(|a| match a {
                Action::Log(Record {
                    event:
                        IncidentEvent::Opened {
                            rule,
                            verdict,
                            reason,
                            ..
                        },
                    ..
                }) => Some((rule.clone(), *verdict, reason.clone())),
                _ => None,
            })
            .collect()
    }
}

fn task(id: &str, family: &str) -> Culprit {
    let mut c = Culprit::program("python3", Some(4242));
    c.task = Some(format!("arn:aws:ecs:us-east-1:111122223333:task/c/{id}"));
    c.definition = Some(format!("{family}:3"));
    c
}

fn at(gpc: u32, tpc: u32) -> Option<Site> {
    Some(Site {
        gpc: Some(gpc),
        tpc: Some(tpc),
        ..Site::default()
    })
}

fn fault(code: u32, g: u32, culprit: Culprit, site: Option<Site>) -> Observation {
    let mut o = Observation::new(Signal::xid(code)).on_gpu(gpu(g));
    // NVML's MPS clients of the GPU at that moment: every tenant, not the culprit.
    o.tasks = vec!["other-tenant".into()];
    o.with_xid(XidContext {
        culprit: Some(culprit),
        site,
        after: None,
    })
}

#[test]
fn one_task_faulting_again_and_again_stays_in_service_as_one_incident() {
    let mut r = Run::new(policy(""));
    for i in 0..16 {
        r.feed(fault(13, 0, task("t1", "train"), at(1, i % 3)));
    }
    assert!(r.orders().is_empty(), "{:?}", r.orders());
    let opened = r.opened();
    assert_eq!(opened.len(), 1, "{opened:?}");
    assert_eq!(opened[0].0, "xid-13-graphics-exception");
    assert!(
        opened[0].2.contains("task definition train:3"),
        "{}",
        opened[0].2
    );
    assert!(opened[0].2.contains("application's"), "{}", opened[0].2);
    assert_eq!(r.st.node.phase, NodePhase::InService);
}

#[test]
fn different_programs_at_one_gpc_tpc_drain_for_the_diagnosis() {
    let mut r = Run::new(policy(""));
    for (i, fam) in ["a", "b"].iter().enumerate() {
        r.feed(fault(13, 2, task(&format!("t{i}"), fam), at(4, 2)));
        assert!(r.orders().is_empty());
    }
    // Elsewhere on the GPU, or on another GPU, does not count for that place.
    r.feed(fault(13, 2, task("t8", "x"), at(5, 0)));
    r.feed(fault(13, 3, task("t9", "y"), at(4, 2)));
    assert!(r.orders().is_empty());
    r.feed(fault(13, 2, task("t3", "c"), at(4, 2)));
    let o = r.orders();
    assert_eq!(o.len(), 1, "{o:?}");
    assert_eq!(o[0].command, Command::Quarantine);
    assert_eq!(r.st.node.remediation.map(|m| m.goal), Some(Goal::Drain));
    let last = r.opened().pop().unwrap();
    assert_eq!(last.0, "xid-13-graphics-exception/suspect");
    assert!(last.2.contains("GPC 4, TPC 2"), "{}", last.2);
}

#[test]
fn six_tasks_of_one_family_all_faulting_at_one_place_are_the_gpus() {
    let mut r = Run::new(policy(""));
    for i in 0..6 {
        r.feed(fault(13, 1, task(&format!("r{i}"), "svc"), at(0, 1)));
    }
    assert_eq!(
        r.orders().first().map(|o| o.command.clone()),
        Some(Command::Quarantine)
    );
}

#[test]
fn one_familys_replicas_faulting_all_over_the_gpu_are_the_programs() {
    let mut r = Run::new(policy(""));
    // Each replica's fault lands on several SM clusters, the same ones among them.
    for i in 0..6 {
        for tpc in 0..3 {
            r.feed(fault(13, 1, task(&format!("r{i}"), "svc"), at(0, tpc)));
        }
    }
    assert!(r.orders().is_empty(), "{:?}", r.orders());
}

#[test]
fn one_family_on_four_gpus_is_left_in_service() {
    let mut r = Run::new(policy(""));
    for g in 0..4 {
        for _ in 0..4 {
            r.feed(fault(31, g, task(&format!("t{g}"), "train"), None));
        }
    }
    assert!(r.orders().is_empty());
    assert_eq!(r.st.node.phase, NodePhase::InService);
}

#[test]
fn mmu_faults_of_different_programs_on_one_gpu_drain_but_one_familys_replicas_do_not() {
    let mut r = Run::new(policy(""));
    for i in 0..5 {
        r.feed(fault(31, 0, task(&format!("r{i}"), "svc"), None));
    }
    assert!(
        r.orders().is_empty(),
        "replicas of one program: {:?}",
        r.orders()
    );
    r.feed(fault(31, 0, task("o1", "other"), None));
    assert!(r.orders().is_empty());
    r.feed(fault(31, 0, Culprit::program("ffmpeg", Some(9)), None));
    assert_eq!(r.orders().len(), 1);
}

#[test]
fn faults_charged_to_the_mps_server_with_several_clients_count_for_no_program() {
    let ambiguous = |c: &[&str]| {
        let mut k = Culprit::program("", None);
        k.via = Via::MpsAmbiguous;
        k.candidates = c.iter().map(|s| s.to_string()).collect();
        k
    };
    let mut r = Run::new(policy(""));
    for c in [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]] {
        r.feed(fault(31, 0, ambiguous(&c), None));
    }
    assert!(
        r.orders().is_empty(),
        "nobody could be named: {:?}",
        r.orders()
    );
    // With two named programs beside them, still two.
    r.feed(fault(31, 0, task("t1", "one"), None));
    r.feed(fault(31, 0, task("t2", "two"), None));
    assert!(r.orders().is_empty(), "{:?}", r.orders());
    r.feed(fault(31, 0, task("t3", "three"), None));
    assert_eq!(r.orders().len(), 1, "three named programs");
}

#[test]
fn a_flood_of_one_programs_places_never_evicts_another_programs_fault() {
    let mut r = Run::new(policy(""));
    r.gap = Duration::from_millis(10);
    // Two programs at GPC 1, TPC 1: one short of the suspicion.
    r.feed(fault(13, 0, task("a", "fa"), at(1, 1)));
    r.feed(fault(13, 0, task("b", "fb"), at(1, 1)));
    // One task faulting at every other place of the GPU, far more than the list holds.
    for i in 0..(3 * crate::engine::attribution::MAX_APP_PLACES as u32) {
        r.feed(fault(13, 0, task("flood", "fl"), at(2 + i / 9, i % 9)));
    }
    assert!(r.orders().is_empty(), "{:?}", r.orders());
    // A third program at GPC 1, TPC 1: the two kept faults and this one.
    r.feed(fault(13, 0, task("c", "fc"), at(1, 1)));
    assert_eq!(r.orders().len(), 1, "{:?}", r.opened());
    assert!(r.opened().last().is_some_and(|o| o.0.ends_with("/suspect")));
}

#[test]
fn one_tasks_faults_alone_never_suspect_the_gpu() {
    let mut r = Run::new(policy(""));
    // One task, its processes named as it likes, some gone before they could be looked up
    // (no task, no executable: nobody), at one place.
    for i in 0..20u32 {
        r.feed(fault(13, 0, task("solo", "fs"), at(1, 1)));
        r.feed(fault(
            13,
            0,
            Culprit::program(format!("name{i}"), Some(100 + i)),
            at(1, 1),
        ));
    }
    assert!(r.orders().is_empty(), "{:?}", r.opened());
}

#[test]
fn an_overlays_culprit_stops_exactly_that_task() {
    let mut p = policy("");
    let rule = p
        .rules
        .iter_mut()
        .find(|r| r.name == "xid-13-graphics-exception")
        .unwrap();
    rule.culprit = Some(crate::policy::attribution::CulpritRule {
        count: 3,
        window: Duration::from_secs(3600),
        action: Verdict::StopTasks,
    });
    let mut r = Run::new(p);
    r.input(Input::Started {
        capabilities: crate::model::Capabilities {
            aws: true,
            mps: true,
            ..Default::default()
        },
    });
    for _ in 0..3 {
        r.feed(fault(13, 0, task("bad", "train"), at(1, 1)));
    }
    let o = r.orders();
    let stop = o
        .iter()
        .find_map(|o| match &o.command {
            Command::StopTasks { tasks, pids, .. } => Some((tasks.clone(), pids.clone())),
            _ => None,
        })
        .unwrap_or_else(|| panic!("{o:?}"));
    assert_eq!(
        stop.0,
        vec!["arn:aws:ecs:us-east-1:111122223333:task/c/bad".to_string()]
    );
    assert_eq!(stop.1, vec![4242]);
    assert_eq!(r.st.node.phase, NodePhase::InService);
}

#[test]
fn xid_45_naming_its_cause_joins_that_incident() {
    let mut r = Run::new(policy(""));
    r.feed(fault(13, 0, task("t1", "train"), at(1, 1)));
    let ctx = XidContext {
        culprit: None,
        site: None,
        after: Some(13),
    };
    let out = r.feed(
        Observation::new(Signal::xid(45))
            .on_gpu(gpu(0))
            .with_xid(ctx.clone()),
    );
    assert!(
        out.iter().any(|a| matches!(
            a,
            Action::Log(Record {
                incident: IncidentId(1),
                event: IncidentEvent::Signal { .. },
                ..
            })
        )),
        "{out:?}"
    );
    assert_eq!(r.opened().len(), 1);
    // On another GPU it names no incident of this one's: judged on its own (ignored).
    let out = r.feed(
        Observation::new(Signal::xid(45))
            .on_gpu(gpu(1))
            .with_xid(ctx),
    );
    assert!(out.is_empty(), "{out:?}");
}

#[test]
fn a_fatal_xid_never_joins_another_incident_whatever_it_says() {
    for code in [79, 48, 95, 13] {
        let mut r = Run::new(policy(""));
        r.feed(fault(13, 0, task("t1", "train"), at(1, 1)));
        let out = r.feed(
            Observation::new(Signal::xid(code))
                .on_gpu(gpu(0))
                .with_xid(XidContext {
                    culprit: None,
                    site: None,
                    after: Some(13),
                }),
        );
        assert!(
            out.iter().any(|a| matches!(
                a,
                Action::Log(Record {
                    event: IncidentEvent::Opened { .. },
                    ..
                })
            )),
            "XID {code} stands alone: {out:?}"
        );
        assert!(code == 13 || !r.orders().is_empty(), "XID {code} acts");
    }
}

#[test]
fn a_storm_of_one_task_is_one_incident_and_a_fatal_xid_is_decided_at_once() {
    let mut r = Run::new(policy(""));
    r.gap = Duration::from_millis(10);
    for i in 0..10_000u32 {
        r.feed(fault(13, 0, task("t1", "train"), at(i % 8, i % 9)));
    }
    assert_eq!(r.opened().len(), 1);
    assert!(
        r.st.app
            .seen
            .values()
            .all(|v| v.len() <= super::MAX_APP_PLACES)
    );
    assert!(r.st.check_ranges().is_ok());
    r.feed(Observation::new(Signal::xid(79)).on_gpu(gpu(0)));
    assert!(r.orders().iter().any(|o| o.command == Command::Quarantine));
}
