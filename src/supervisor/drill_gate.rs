//! The daemon decides what a drill request may do. A request file in `state_dir/requests/` is
//! written by whoever can write there, with whatever config they ran `gpu-medic drill` with:
//! the daemon takes a drill only when its own config says `[drill] allow = true` or the
//! instance carries the tag `gpu-medic:drills=allowed` (read through IMDS by the daemon), and
//! takes of the request only what a drill may do ([`clamp`]). The decision is left for the
//! drill command, which plays nothing before it: `requests/<drill id>.armed` (handed to the
//! engine in this tick's batch), or `requests/<drill id>.refused` with the reason (also
//! logged).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::model::{Drill, DrillExpect, OperatorRequest, Signal, SignalKind};

/// How long the instance tag's permission is trusted (a refusal is not kept).
const TAG_FRESH: Duration = Duration::from_secs(60);
/// How long a drill request waits for the tag to be read before it is refused.
const HOLD_MAX: Duration = Duration::from_secs(20);
/// At most this many drill requests wait for the tag.
const HELD_MAX: usize = 16;
/// At most this many decisions are left for drill commands to read.
const DECISION_FILES_MAX: usize = 64;

/// Who asked for a drill, for its refusal.
struct Who {
    id: String,
    class: String,
    by: String,
}

impl Who {
    fn of(d: &Drill) -> Who {
        Who {
            id: d.id.clone(),
            class: d.class.clone(),
            by: d.by.clone(),
        }
    }
}

/// The tag's answer: allowed, or why not.
type TagAnswer = (Instant, Result<(), String>);

pub struct Gate {
    /// The daemon's own `[drill] allow`.
    allow: bool,
    requests_dir: PathBuf,
    tag: Arc<Mutex<Option<TagAnswer>>>,
    reading: Arc<AtomicBool>,
    held: VecDeque<(Instant, Drill)>,
}

impl Gate {
    pub fn new(cfg: &Config) -> Gate {
        Gate {
            allow: cfg.drill.allow,
            requests_dir: crate::journal::requests_dir(&cfg.state_dir),
            tag: Arc::new(Mutex::new(None)),
            reading: Arc::new(AtomicBool::new(false)),
            held: VecDeque::new(),
        }
    }

    /// The requests the engine gets: every request but a drill as it came; a drill clamped
    /// to what a drill may do, and only where this daemon allows drills (one waiting for the
    /// instance tag is handed over at a later tick).
    pub fn admit(&mut self, requests: Vec<OperatorRequest>) -> Vec<OperatorRequest> {
        let mut out = Vec::new();
        for r in requests {
            let drill = match r {
                OperatorRequest::Drill { drill } => drill,
                other => {
                    out.push(other);
                    continue;
                }
            };
            let who = Who::of(&drill);
            let drill = match clamp(drill) {
                Ok(d) => d,
                Err(why) => {
                    self.refuse(&who, &why);
                    continue;
                }
            };
            if self.allow {
                self.decide(&drill.id, None);
                out.push(OperatorRequest::Drill { drill });
            } else if self.held.len() >= HELD_MAX {
                self.refuse(
                    &Who::of(&drill),
                    "too many drill requests wait for the instance tag",
                );
            } else {
                self.held.push_back((Instant::now(), drill));
            }
        }
        if self.held.is_empty() {
            return out;
        }
        let answer = self
            .tag
            .lock()
            .ok()
            .and_then(|t| t.clone())
            .filter(|(at, _)| at.elapsed() < TAG_FRESH);
        match answer {
            Some((_, Ok(()))) => {
                for (_, drill) in std::mem::take(&mut self.held) {
                    self.decide(&drill.id, None);
                    out.push(OperatorRequest::Drill { drill });
                }
            }
            Some((_, Err(why))) => {
                for (_, d) in std::mem::take(&mut self.held) {
                    self.refuse(&Who::of(&d), &why);
                }
                // A refusal is not kept: the next request reads the tag again (an operator
                // who just tagged the instance is not refused for a minute).
                if let Ok(mut t) = self.tag.lock() {
                    *t = None;
                }
            }
            None => {
                while let Some((at, d)) = self.held.front().cloned() {
                    if at.elapsed() < HOLD_MAX {
                        break;
                    }
                    self.held.pop_front();
                    self.refuse(&Who::of(&d), "the instance tag could not be read in time");
                }
                self.read_tag();
            }
        }
        out
    }

    /// Reads the instance tag in the background (once at a time); the answer is taken at a
    /// later tick.
    fn read_tag(&self) {
        if self.reading.swap(true, Ordering::SeqCst) {
            return;
        }
        let (tag, reading) = (self.tag.clone(), self.reading.clone());
        tokio::spawn(async move {
            let client = crate::aws::imds::imds_client(crate::aws::http_client(), 1);
            let read = crate::aws::imds::get(&client, crate::aws::imds::DRILL_TAG_PATH);
            let answer = match tokio::time::timeout(Duration::from_secs(5), read).await {
                Ok(Ok(Some(v))) if v.trim().eq_ignore_ascii_case("allowed") => Ok(()),
                Ok(Ok(Some(v))) => Err(format!(
                    "the instance tag gpu-medic:drills is {:?}, not \"allowed\"",
                    crate::mps::control::clip(v.trim(), 64)
                )),
                Ok(Ok(None)) => Err("IMDS lists no instance tag gpu-medic:drills".into()),
                Ok(Err(e)) => Err(format!("the instance tag could not be read: {e}")),
                Err(_) => {
                    Err("the instance tag could not be read: IMDS did not answer within 5s".into())
                }
            };
            if let Ok(mut t) = tag.lock() {
                *t = Some((Instant::now(), answer));
            }
            reading.store(false, Ordering::SeqCst);
        });
    }

    /// Logs a refused drill and leaves its reason for the drill command.
    fn refuse(&self, d: &Who, why: &str) {
        let why = format!(
            "this daemon does not allow drills ([drill] allow = {}; {why})",
            self.allow
        );
        tracing::error!(
            drill = %crate::mps::control::clip(&d.id, 64),
            class = %crate::mps::control::clip(&d.class, 64),
            by = %crate::mps::control::clip(&d.by, 64),
            "drill request refused: {why}"
        );
        self.decide(&d.id, Some(&why));
    }

    /// Leaves the decision on drill `id` for the drill command: armed (`refused` = `None`)
    /// or refused with the reason.
    fn decide(&self, id: &str, refused: Option<&str>) {
        let Some(name) = decision_name(id, refused.is_none()) else {
            return;
        };
        let room = std::fs::read_dir(&self.requests_dir).map_or(0, |it| {
            it.take(4 * DECISION_FILES_MAX)
                .filter_map(Result::ok)
                .filter(|e| {
                    e.path()
                        .extension()
                        .is_some_and(|x| x == "refused" || x == "armed")
                })
                .count()
        }) < DECISION_FILES_MAX;
        if room {
            let _ = crate::sys::fs::write_atomic(
                &self.requests_dir.join(name),
                refused.unwrap_or("").as_bytes(),
                crate::sys::fs::Durability::Atomic,
            );
        }
    }
}

/// Where the decision on drill `id` is left for the drill command (`<id>.armed` or
/// `<id>.refused` in the requests directory); `None` for an id that is no drill's
/// (`drill-<ms>-<pid>`).
pub fn decision_name(id: &str, armed: bool) -> Option<String> {
    let mut parts = id.strip_prefix("drill-")?.split('-');
    let ok = |p: Option<&str>| {
        p.is_some_and(|p| !p.is_empty() && p.len() <= 20 && p.bytes().all(|b| b.is_ascii_digit()))
    };
    let ext = if armed { "armed" } else { "refused" };
    (ok(parts.next()) && ok(parts.next()) && parts.next().is_none()).then(|| format!("{id}.{ext}"))
}

/// What a drill may do, whatever its request says: an observation of its own only of the
/// kinds a drill injects (an XID, a lost GPU, one uncorrected ECC error, a Spot or maintenance
/// notice), marked as a drill (source `drill`, its text says so), naming no process or ECS
/// task and no stream position, the drill waiting for that observation alone; without one,
/// waiting only for the MPS daemon's signals (the `mps-hang` and `mps-crash` drills, which
/// stop or kill the daemon for its probe to find). Anything else is refused with the reason.
pub fn clamp(mut d: Drill) -> Result<Drill, String> {
    if decision_name(&d.id, true).is_none() {
        return Err("the request's drill id is not drill-<ms>-<pid>".into());
    }
    match d.inject.take() {
        Some(mut obs) => {
            let kind = obs.signal.kind();
            let (code, value) = match &obs.signal {
                Signal::Xid { code, .. } => (Some(*code), 0),
                Signal::GpuLost => (None, 0),
                Signal::EccUncorrected => (None, 1),
                Signal::SpotInterruption { .. } | Signal::MaintenanceEvent { .. } => {
                    (None, obs.value)
                }
                _ => {
                    let why = format!(
                        "a drill does not inject {}: only an XID, a lost GPU, an uncorrected ECC error, a Spot or maintenance notice",
                        kind.as_str()
                    );
                    return Err(why);
                }
            };
            obs.value = value;
            obs.source = "drill".into();
            obs.detail = Some(match obs.detail.take() {
                Some(t) if t.starts_with("drill:") => t,
                Some(t) => format!("drill: {t}"),
                None => "drill: injected by gpu-medic drill".into(),
            });
            obs.pids.clear();
            obs.tasks.clear();
            obs.cursor = None;
            d.expect = DrillExpect {
                signals: vec![kind],
                code,
                gpu: obs.gpu.as_ref().map(|g| g.index),
                pid: None,
            };
            d.inject = Some(obs);
        }
        None => {
            d.expect
                .signals
                .retain(|k| matches!(k, SignalKind::MpsUnresponsive | SignalKind::MpsDown));
            if d.expect.signals.is_empty() {
                return Err(
                    "a drill without an observation of its own waits only for the MPS daemon's signals".into(),
                );
            }
            d.expect.code = None;
            d.expect.gpu = None;
            d.expect.pid = None;
        }
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{GpuId, Observation};

    fn drill(inject: Option<Observation>, signals: Vec<SignalKind>) -> Drill {
        Drill {
            id: "drill-1700000000000-42".into(),
            class: "x".into(),
            observe: false,
            by: "t".into(),
            expect: DrillExpect {
                signals,
                code: Some(79),
                gpu: Some(3),
                pid: Some(1),
            },
            inject,
        }
    }

    /// Issue 4/5 item 4: a request's contents are never trusted beyond what a drill may do.
    #[test]
    fn a_request_gets_only_what_a_drill_may_do() {
        // An injected XID: marked as a drill, no processes, tasks or stream position.
        let obs = Observation::new(Signal::xid(79))
            .on_gpu(GpuId::index_only(0))
            .with_pids(vec![1, 2])
            .with_detail("GPU has fallen off the bus.")
            .from_source("kmsg");
        let d = clamp(drill(Some(obs), vec![SignalKind::Xid, SignalKind::GpuLost])).unwrap();
        let o = d.inject.as_ref().unwrap();
        assert_eq!(o.source, "drill");
        assert!(o.detail.as_deref().unwrap().starts_with("drill: "));
        assert!(o.pids.is_empty() && o.tasks.is_empty() && o.cursor.is_none());
        assert_eq!(d.expect.signals, vec![SignalKind::Xid]);
        assert_eq!(
            (d.expect.code, d.expect.gpu, d.expect.pid),
            (Some(79), Some(0), None)
        );
        // An ECC drill is one error, whatever the request says.
        let ecc = Observation::new(Signal::EccUncorrected).with_value(1_000_000);
        assert_eq!(
            clamp(drill(Some(ecc), vec![]))
                .unwrap()
                .inject
                .unwrap()
                .value,
            1
        );
        // Nothing a drill does not inject.
        for s in [Signal::MpsDown, Signal::RowRemapFailure] {
            assert!(clamp(drill(Some(Observation::new(s)), vec![])).is_err());
        }
        // Without an observation: armed only for the MPS daemon's signals (never for a real
        // XID, which it would then mark as a drill).
        assert!(clamp(drill(None, vec![SignalKind::Xid])).is_err());
        let m = clamp(drill(None, vec![SignalKind::Xid, SignalKind::MpsDown])).unwrap();
        assert_eq!(m.expect.signals, vec![SignalKind::MpsDown]);
        assert_eq!(
            (m.expect.code, m.expect.gpu, m.expect.pid),
            (None, None, None)
        );
        // An id that is no drill's names no file.
        let mut bad = drill(None, vec![SignalKind::MpsDown]);
        bad.id = "../../etc/x".into();
        assert!(clamp(bad).is_err());
        assert_eq!(
            decision_name("drill-1-2", false).as_deref(),
            Some("drill-1-2.refused")
        );
        assert_eq!(
            decision_name("drill-1-2", true).as_deref(),
            Some("drill-1-2.armed")
        );
        assert_eq!(decision_name("drill-1-2-3", true), None);
        assert_eq!(decision_name("drill-1-/", true), None);
    }
}
