//! The one-shot verdict: what `gpu-medic check` and the launch gate print. The same policy
//! judges it as the daemon's engine, but without debounce windows or state: one look, every
//! finding taken at its value.
//!
//! - A finding fails the check when its rule's verdict acts ([`Verdict::acts`]: stop tasks,
//!   restart MPS, drain, replace); `log` findings are listed, `ignore` ones are not.
//! - gpu-medic's own faults (`self-fault`) are never findings: they make the probe that saw
//!   them "could not look", so the check cannot tell rather than fail the GPUs.
//! - No probe, or any probe that could not look, is "could not tell" unless a finding fails.
//!
//! Pure: the caller runs the probes and hands in what each saw ([`Look`]).

use serde::Serialize;

use crate::model::{GpuId, Health, Observation, Signal, SignalKind, Verdict};
use crate::policy::Policy;

/// What one probe saw in one look, or why it could not look.
#[derive(Debug, Clone, Default)]
pub struct Look {
    pub probe: &'static str,
    pub observations: Vec<Observation>,
    /// Parts it could not read.
    pub problems: Vec<String>,
    /// What it left out on purpose, to say (records of earlier boots): no problem.
    pub notes: Vec<String>,
    /// The GPUs it saw.
    pub gpus: Vec<GpuId>,
    /// It could not look at all.
    pub error: Option<String>,
}

impl Look {
    /// A probe that could not look, for `why`.
    pub fn failed(probe: &'static str, why: impl Into<String>) -> Look {
        Look {
            probe,
            error: Some(why.into()),
            ..Look::default()
        }
    }
}

/// A signal the policy judges with more than `ignore`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub signal: String,
    pub gpu: Option<u32>,
    pub value: u64,
    pub action: Verdict,
    pub rule: String,
    pub detail: Option<String>,
}

impl Finding {
    /// Whether this finding fails the check.
    pub fn fails(&self) -> bool {
        self.action.acts()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuHealthLine {
    #[serde(flatten)]
    pub gpu: GpuId,
    /// `ok` or `faulty`.
    pub health: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProbeResult {
    pub probe: &'static str,
    pub ok: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub problems: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// The verdict of one look.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Checked {
    /// `healthy`, `unhealthy` or `unknown`.
    pub verdict: Health,
    pub gpus: Vec<GpuHealthLine>,
    pub findings: Vec<Finding>,
    pub probes: Vec<ProbeResult>,
}

/// Judges `looks` (one per probe) and `extra` (findings from no single probe: the ECS GPU
/// view's comparison) with `policy`.
pub fn check(looks: Vec<Look>, extra: Vec<Observation>, policy: &Policy) -> Checked {
    let mut probes = Vec::new();
    let mut seen = Vec::new();
    let mut gpus: Vec<GpuId> = Vec::new();
    for look in looks {
        let (result, observations, saw) = sort_look(look);
        probes.push(result);
        seen.extend(observations);
        gpus.extend(saw);
    }
    seen.extend(extra);
    let findings = findings(&seen, policy, &mut gpus);
    let unhealthy = findings.iter().any(Finding::fails);
    let could_not_look = probes.is_empty() || probes.iter().any(|r| !r.ok);
    let verdict = if unhealthy {
        Health::Unhealthy
    } else if could_not_look {
        Health::Unknown
    } else {
        Health::Healthy
    };
    gpus.sort_by_key(|g| g.index);
    let gpus = gpus
        .into_iter()
        .map(|g| {
            let bad = findings.iter().any(|f| f.gpu == Some(g.index) && f.fails());
            GpuHealthLine {
                gpu: g,
                health: if bad { "faulty" } else { "ok" },
            }
        })
        .collect();
    Checked {
        verdict,
        gpus,
        findings,
        probes,
    }
}

/// A probe's result line, the observations to judge (not its own faults: they become
/// problems) and the GPUs it saw.
fn sort_look(look: Look) -> (ProbeResult, Vec<Observation>, Vec<GpuId>) {
    if let Some(error) = look.error {
        let result = ProbeResult {
            probe: look.probe,
            ok: false,
            error: Some(error),
            problems: vec![],
            notes: look.notes,
        };
        return (result, vec![], vec![]);
    }
    let mut problems = look.problems;
    let (own, observations): (Vec<Observation>, Vec<Observation>) =
        look.observations.into_iter().partition(|o| {
            matches!(
                o.signal.kind(),
                SignalKind::SelfFault | SignalKind::SelfRecovered
            )
        });
    for o in own {
        if let Signal::SelfFault { component } = &o.signal {
            let detail = o.detail.unwrap_or_default();
            if !problems.contains(&detail) {
                problems.push(format!("self-fault {component}: {detail}"));
            }
        }
    }
    let result = ProbeResult {
        probe: look.probe,
        ok: problems.is_empty(),
        error: None,
        problems,
        notes: look.notes,
    };
    (result, observations, look.gpus)
}

/// The findings among `seen`; a GPU named only by a finding joins `gpus`.
fn findings(seen: &[Observation], policy: &Policy, gpus: &mut Vec<GpuId>) -> Vec<Finding> {
    let mut out = Vec::new();
    for o in seen {
        let Some(rule) = policy.rule_for(&o.signal, o.value) else {
            continue;
        };
        if rule.action == Verdict::Ignore {
            continue;
        }
        // A record nothing else witnessed is listed, never failing (`Observation::unwitnessed`).
        let (action, detail) = match &o.unwitnessed {
            Some(why) if rule.action.acts() => (
                Verdict::Log,
                Some(format!(
                    "{}; would be `{}`, not taken: {why}",
                    o.detail.as_deref().unwrap_or(""),
                    rule.action.as_str()
                )),
            ),
            _ => (rule.action, o.detail.clone()),
        };
        out.push(Finding {
            signal: o.signal.to_string(),
            gpu: o.gpu.as_ref().map(|g| g.index),
            value: o.value,
            action,
            rule: rule.name.clone(),
            detail,
        });
        if let Some(g) = &o.gpu
            && !gpus.iter().any(|x| x.index == g.index)
        {
            gpus.push(g.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy::parse(
            std::path::Path::new("test.toml"),
            r#"
[[rule]]
name = "fatal-xid"
signal = "xid"
xids = [79]
action = "drain"
reason = "fallen off the bus"

[[rule]]
name = "other-xid"
signal = "xid"
xids = [13, 31]
action = "log"
reason = "unknown"

[[rule]]
name = "quiet-ecc"
signal = "ecc-corrected"
action = "ignore"
reason = "corrected"

[[rule]]
name = "mps-down"
signal = "mps-down"
action = "restart-mps"
reason = "daemon gone"
"#,
        )
        .unwrap()
    }

    fn gpu(index: u32) -> GpuId {
        GpuId {
            index,
            uuid: format!("GPU-{index}"),
            pci_bus_id: format!("0000:0{index}:00.0"),
            serial: None,
        }
    }

    fn xid(code: u32, on: u32) -> Observation {
        Observation::new(Signal::Xid { code, decode: None }).on_gpu(gpu(on))
    }

    fn look(observations: Vec<Observation>, gpus: Vec<GpuId>) -> Look {
        Look {
            probe: "nvml",
            observations,
            gpus,
            ..Look::default()
        }
    }

    #[test]
    fn an_acting_verdict_fails_the_check_and_marks_its_gpu() {
        let c = check(
            vec![look(vec![xid(79, 1)], vec![gpu(0), gpu(1)])],
            vec![],
            &policy(),
        );
        assert_eq!(c.verdict, Health::Unhealthy);
        assert_eq!(c.findings.len(), 1);
        assert_eq!(c.findings[0].action, Verdict::Drain);
        assert_eq!(c.findings[0].rule, "fatal-xid");
        let health: Vec<_> = c.gpus.iter().map(|g| (g.gpu.index, g.health)).collect();
        assert_eq!(health, [(0, "ok"), (1, "faulty")]);
    }

    #[test]
    fn log_findings_are_listed_but_pass_and_ignored_ones_are_not_listed() {
        let ecc = Observation::new(Signal::EccCorrected)
            .on_gpu(gpu(0))
            .with_value(5);
        let c = check(
            vec![look(vec![xid(13, 0), ecc], vec![gpu(0)])],
            vec![],
            &policy(),
        );
        assert_eq!(c.verdict, Health::Healthy);
        assert_eq!(c.findings.len(), 1, "{:?}", c.findings);
        assert_eq!(c.findings[0].action, Verdict::Log);
        assert_eq!(c.gpus[0].health, "ok");
    }

    #[test]
    fn a_probe_that_could_not_look_is_unknown_unless_something_fails() {
        let failed = Look::failed("mps", "no daemon binary");
        let c = check(vec![look(vec![], vec![gpu(0)]), failed], vec![], &policy());
        assert_eq!(c.verdict, Health::Unknown);
        assert!(!c.probes[1].ok);
        let failed = Look::failed("mps", "no daemon binary");
        let c = check(
            vec![look(vec![xid(79, 0)], vec![]), failed],
            vec![],
            &policy(),
        );
        assert_eq!(c.verdict, Health::Unhealthy);
    }

    #[test]
    fn no_probe_at_all_cannot_tell() {
        assert_eq!(check(vec![], vec![], &policy()).verdict, Health::Unknown);
    }

    #[test]
    fn own_faults_are_problems_never_findings() {
        let own = Observation::new(Signal::SelfFault {
            component: "mps-control".into(),
        })
        .with_detail("cannot run it");
        let c = check(vec![look(vec![own], vec![])], vec![], &policy());
        assert_eq!(c.verdict, Health::Unknown);
        assert!(c.findings.is_empty());
        assert_eq!(
            c.probes[0].problems,
            ["self-fault mps-control: cannot run it"]
        );
    }

    #[test]
    fn extra_findings_are_judged_and_name_their_gpus() {
        let down = Observation::new(Signal::MpsDown);
        let c = check(
            vec![look(vec![], vec![])],
            vec![down, xid(79, 3)],
            &policy(),
        );
        assert_eq!(c.verdict, Health::Unhealthy);
        assert_eq!(c.findings[0].action, Verdict::RestartMps);
        assert_eq!(c.gpus.len(), 1);
        assert_eq!(c.gpus[0].gpu.index, 3);
        assert_eq!(c.gpus[0].health, "faulty");
    }

    #[test]
    fn findings_serialise_with_the_action_names_check_always_printed() {
        let c = check(vec![look(vec![xid(79, 0)], vec![])], vec![], &policy());
        let json = serde_json::to_value(&c.findings[0]).unwrap();
        assert_eq!(json["action"], "drain");
    }
}
