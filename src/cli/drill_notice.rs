//! The planned-event drills of `gpu-medic drill` (`spot`, `maintenance`), `drill clear`, and
//! whether this instance allows drills at all.
//!
//! - `spot --action A` hands the daemon a Spot interruption notice shaped like IMDS's
//!   `spot/instance-action` (`{"action": A, "time": now + 2 min}`, the two minutes AWS gives);
//!   `maintenance --code C --in D` a scheduled event shaped like an entry of
//!   `events/maintenance/scheduled` (code C, state active, NotBefore now + D, the drill's id as
//!   its EventId). The engine judges it as if the planned-events probe (crates/io/src/probe/planned.rs)
//!   had read it: the real drain (and replacement for a retirement or stop), never deferred by
//!   the fleet budget, tagged drill.
//! - A rehearsed notice stays until `drill clear <drill-id>`: the engine then treats it as gone,
//!   like a Spot notice IMDS no longer lists (`spot-notice-gone`): what it started is undone
//!   (quarantine lifted, ACTIVE again). Until then `gpu-medic status` names the drill and the
//!   command that clears it.
//! - Drills are allowed by the config (`[drill] allow = true`) or by the EC2 instance tag
//!   `gpu-medic:drills=allowed`, read through IMDS (`tags/instance/gpu-medic:drills`: the
//!   instance's metadata options must allow tags in metadata).

use std::time::{Duration, Instant};

use super::policy::Explanation;
use super::{CliError, ConfigArg, exit};
use crate::config::Config;
use crate::model::{
    Command, EventClass, EventState, IncidentEvent, Observation, OperatorRequest, Record,
    ScheduledEvent, Signal, SignalKind, Timestamp,
};
use crate::policy::Policy;

/// The instance tag that allows drills, and the value it must have.
pub const DRILL_TAG: &str = "gpu-medic:drills";
pub const DRILL_TAG_VALUE: &str = "allowed";
/// How long a Spot interruption notice comes before the interruption.
pub const SPOT_NOTICE: Duration = Duration::from_secs(120);

/// How drills are allowed here (for the drill's first line), or why not.
pub fn allowed(cfg: &Config) -> Result<String, String> {
    if cfg.drill.allow {
        return Ok("[drill] allow = true".into());
    }
    match read_tag() {
        Ok(Some(v)) if v.trim().eq_ignore_ascii_case(DRILL_TAG_VALUE) => {
            Ok(format!("instance tag {DRILL_TAG}={}", v.trim()))
        }
        Ok(Some(v)) => Err(format!(
            "the instance tag {DRILL_TAG} is {v:?}, not \"{DRILL_TAG_VALUE}\""
        )),
        Ok(None) => Err(format!(
            "IMDS lists no instance tag {DRILL_TAG} (tags/instance/)"
        )),
        Err(e) => Err(format!(
            "the instance tag {DRILL_TAG} could not be read: {e}"
        )),
    }
}

/// The refusal: what was found, and both ways to allow drills.
pub fn refusal(config: &std::path::Path, why: &str) -> String {
    format!(
        "gpu-medic drill: refused: drills are not allowed on this instance ({}: [drill] allow is not true; {why}). \
         A drill really drains, restarts or replaces; allow it only on a staging instance, either with \
         `[drill] allow = true` in the config or with the EC2 instance tag `{DRILL_TAG}={DRILL_TAG_VALUE}` \
         (read through IMDS: the instance's metadata options must allow tags in metadata).",
        config.display()
    )
}

/// `tags/instance/gpu-medic:drills` through IMDSv2, one attempt, bounded.
fn read_tag() -> Result<Option<String>, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    rt.block_on(async {
        let client = crate::aws::imds::imds_client(crate::aws::http_client(), 1);
        let read = crate::aws::imds::get(&client, crate::aws::imds::DRILL_TAG_PATH);
        match tokio::time::timeout(Duration::from_secs(5), read).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err("IMDS did not answer within 5s".into()),
        }
    })
}

/// A Spot interruption notice as the planned-events probe reports one.
pub fn spot_observation(action: &str, now: Timestamp) -> Observation {
    let time = now.plus(SPOT_NOTICE);
    Observation::new(Signal::SpotInterruption {
        action: action.to_string(),
        time,
    })
    .with_detail(format!(
        "drill: IMDS spot/instance-action = {{\"action\": \"{action}\", \"time\": \"{time}\"}}, injected by gpu-medic drill"
    ))
    .from_source("drill")
}

/// A scheduled event as the planned-events probe reports one: the drill's id is its EventId.
pub fn maintenance_observation(id: &str, code: &str, not_before: Timestamp) -> Observation {
    let event = ScheduledEvent {
        id: id.to_string(),
        code: code.to_string(),
        state: EventState::Active,
        not_before,
        not_after: None,
        description: "gpu-medic drill".into(),
        boot_id: String::new(),
    };
    Observation::new(Signal::MaintenanceEvent { event })
        .with_detail(format!(
            "drill: IMDS events/maintenance/scheduled: {id} {code} active NotBefore {not_before}, injected by gpu-medic drill"
        ))
        .from_source("drill")
}

/// What the engine's planned-event rules will do with `signal`, in the words of
/// `policy explain` (the rules are `[planned]` of the policy, not a rule per signal).
pub fn explain(policy: &Policy, signal: &Signal, id: &str) -> Explanation {
    let rules = policy.planned;
    let lead = humantime::format_duration(rules.lead);
    let margin = humantime::format_duration(rules.margin);
    let clear = format!("`gpu-medic drill clear {id}` ends it (as if IMDS no longer listed it)");
    let (rule, action, reason) = match signal {
        Signal::SpotInterruption { action, time } => (
            "planned-spot-interruption".to_string(),
            "drain",
            format!(
                "AWS interrupts this Spot instance ({action}) at {time}: drained at once, and what still runs {margin} before that time is stopped; never deferred by the fleet budget; the instance stays drained until {clear}"
            ),
        ),
        Signal::MaintenanceEvent { event } => {
            let stop = event.class() == EventClass::Stop;
            let action = if stop && rules.replace_on_stop {
                "replace"
            } else {
                "drain"
            };
            let after = if stop && rules.replace_on_stop {
                "then Auto Scaling replaces the instance".to_string()
            } else if stop {
                "the instance is left drained ([planned] replace_on_stop = false)".to_string()
            } else {
                format!("the instance stays drained until {clear}")
            };
            (
                format!("planned-{}", event.code),
                action,
                format!(
                    "AWS scheduled {} for {}: drained from {lead} before it (at once when sooner), never deferred by the fleet budget; {after}",
                    event.code, event.not_before
                ),
            )
        }
        other => (String::new(), "log", format!("{other} is no planned event")),
    };
    Explanation {
        signal: signal.to_string(),
        action: action.into(),
        rule,
        reason,
        source: String::new(),
        origin: format!("[planned] of {}", policy.origin),
        threshold: None,
        confirm: None,
        escalate: None,
        ladder: None,
        diagnosis: None,
        workflow: None,
    }
}

/// `gpu-medic drill clear <id>`: tells the daemon the drill's notice is gone, and follows
/// what the engine undoes.
pub fn clear(
    config: &ConfigArg,
    drill: &str,
    by: Option<String>,
    wait: Duration,
) -> Result<i32, CliError> {
    let cfg = config.load()?;
    let path = cfg.incidents_path();
    let recs: Vec<Record> = crate::journal::last_records(&path, 4096)?;
    let opened = recs.iter().find_map(|r| match &r.event {
        IncidentEvent::Opened { observation, .. } if r.drill.as_deref() == Some(drill) => {
            Some((r.incident, observation.signal.clone()))
        }
        _ => None,
    });
    let Some((incident, signal)) = opened else {
        return Err(CliError::NotFound(format!(
            "no incident of drill {drill} in {} (see `gpu-medic incidents list`)",
            path.display()
        )));
    };
    if !matches!(
        signal.kind(),
        SignalKind::SpotInterruption | SignalKind::MaintenanceEvent
    ) {
        return Err(CliError::Usage(format!(
            "drill {drill} rehearsed `{signal}`: only the spot and maintenance drills leave a notice to clear"
        )));
    }
    println!("drill {drill}: clearing its notice ({signal}), incident {incident}");
    let request = OperatorRequest::DrillClear {
        drill: drill.to_string(),
        by: by.unwrap_or_else(super::drill::whoami),
    };
    let seen = recs.iter().filter(|r| r.incident == incident).count();
    super::drill::arm(&cfg, &request, "clear request", "nothing was cleared")?;
    follow_clear(&cfg, incident, seen, wait)
}

/// Prints the incident's records after the first `seen` until the return to service ends
/// (or there is none to wait for).
fn follow_clear(
    cfg: &Config,
    incident: crate::model::IncidentId,
    seen: usize,
    wait: Duration,
) -> Result<i32, CliError> {
    let t0 = Instant::now();
    let mut printed = seen;
    let mut noted: Option<Instant> = None;
    let mut restore: Option<crate::model::ActionId> = None;
    loop {
        let recs: Vec<Record> = crate::journal::last_records(&cfg.incidents_path(), 4096)?;
        let mine: Vec<&Record> = recs.iter().filter(|r| r.incident == incident).collect();
        for r in mine.iter().skip(printed) {
            println!("    {}  {}", r.at, super::policy::event_line(&r.event));
            match &r.event {
                IncidentEvent::Note { text } if text.contains("cleared by") => {
                    noted = Some(Instant::now());
                }
                IncidentEvent::ActionStarted { order, dry_run }
                    if order.command == Command::Restore =>
                {
                    if *dry_run {
                        println!("  cleared: observe: nothing was executed");
                        return Ok(exit::OK);
                    }
                    restore = Some(order.id);
                }
                IncidentEvent::ActionFinished { outcome } if Some(outcome.action) == restore => {
                    let ok = outcome.status == crate::model::OutcomeStatus::Done;
                    println!(
                        "  cleared: {}",
                        if ok {
                            "the instance is back in service"
                        } else {
                            "the return to service did not finish; see `gpu-medic incidents show`"
                        }
                    );
                    return Ok(if ok { exit::OK } else { exit::UNHEALTHY });
                }
                _ => {}
            }
        }
        printed = printed.max(mine.len());
        // The note and the order it starts come in one step: no order soon after the note,
        // none is coming.
        if restore.is_none() && noted.is_some_and(|t| t.elapsed() > Duration::from_secs(2)) {
            println!("  cleared: nothing held the instance out of service for it");
            return Ok(exit::OK);
        }
        if t0.elapsed() > wait {
            println!(
                "  still going after {}: follow with `gpu-medic incidents show {incident}`",
                humantime::format_duration(wait)
            );
            return Ok(exit::OK);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}
