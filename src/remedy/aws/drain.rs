//! The drain's timing rules as a pure plan, driven in virtual time: what to do after each
//! poll of the container instance, given how long the drain has run. The control plane polls
//! ECS, hands each reading to [`DrainPlan::observe`], carries out the stops it asks for,
//! reports each stop back, and sleeps until [`DrainPlan::next_poll`]. No clock and no I/O here,
//! so every rule is tested by stepping time, not by waiting.
//!
//! The rules (all times from the drain's start in this process):
//! - **drained**: no task listed and none running or pending: done.
//! - **restored**: the instance is ACTIVE again (an operator or `incidents abort`): stop.
//! - **standalone grace**: tasks not started by a service (ECS draining leaves them alone) are
//!   stopped once `standalone_grace` has passed since the drain began (counted from the claim's
//!   time when the drain resumes after a restart);
//! - **force-stop lead**: `force_stop_lead` before the deadline, everything left is stopped once
//!   (again after a retryable failure);
//! - **agent disconnected**: ECS cannot stop tasks on an instance whose agent is gone; after
//!   `agent_disconnected_wait` of that, the drain gives up;
//! - **deadline**: the drain returns a little before the order's deadline (a tenth of the time
//!   left, at most 5 s), so the engine hears the outcome before it escalates.

use std::collections::HashSet;
use std::time::Duration;

use crate::aws::ecs::EcsStatus;

/// The timing settings of a drain (`[ecs]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainTimes {
    pub standalone_grace: Duration,
    pub force_stop_lead: Duration,
    pub agent_disconnected_wait: Duration,
    pub poll_interval: Duration,
}

/// One task as the plan needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskView {
    pub arn: String,
    pub id: String,
    pub service: bool,
}

/// One reading of the container instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reading {
    pub status: EcsStatus,
    pub running: i32,
    pub pending: i32,
    pub agent_connected: bool,
    pub tasks: Vec<TaskView>,
}

/// Why a task is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopKind {
    /// A standalone task, after the grace.
    Standalone,
    /// Whatever was left at the force-stop lead.
    Forced,
}

/// What to do after a reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Stop these tasks (report each with [`DrainPlan::stopped`]), then, if `deadline` says so,
    /// end the drain as incomplete; otherwise poll again at [`DrainPlan::next_poll`].
    Act {
        stop: Vec<(String, StopKind)>,
        deadline: Option<String>,
    },
    /// The drain is over: nothing runs any more.
    Drained(String),
    /// The drain ends without finishing (restored, agent gone).
    GiveUp(String),
}

/// The drain's progress.
#[derive(Debug, Clone)]
pub struct DrainPlan {
    times: DrainTimes,
    grace_at: Duration,
    force_at: Duration,
    end: Duration,
    prefix: &'static str,
    stopped: HashSet<String>,
    forced: bool,
    disconnected_since: Option<Duration>,
    polls: u32,
    transient: u32,
    stopped_standalone: usize,
    stopped_forced: usize,
}

impl DrainPlan {
    /// `remaining`: the time left until the order's deadline; `since_start`: how long ago the
    /// drain began (zero for a new drain, the claim's age for a resumed one).
    pub fn new(
        times: DrainTimes,
        remaining: Duration,
        since_start: Duration,
        resumed: bool,
    ) -> DrainPlan {
        let margin = (remaining / 10).min(Duration::from_secs(5));
        DrainPlan {
            times,
            grace_at: times.standalone_grace.saturating_sub(since_start),
            force_at: remaining.saturating_sub(times.force_stop_lead.max(margin)),
            end: remaining.saturating_sub(margin),
            prefix: if resumed { "resumed drain: " } else { "" },
            stopped: HashSet::new(),
            forced: false,
            disconnected_since: None,
            polls: 0,
            transient: 0,
            stopped_standalone: 0,
            stopped_forced: 0,
        }
    }

    /// When the drain must have ended, from its start.
    pub fn end(&self) -> Duration {
        self.end
    }

    /// A poll that failed with a retryable error at `at`: `Some(message)` when the deadline
    /// has come (the drain ends incomplete).
    pub fn poll_failed(&mut self, at: Duration) -> Option<String> {
        self.polls = self.polls.saturating_add(1);
        self.transient = self.transient.saturating_add(1);
        (at >= self.end).then(|| {
            format!(
                "{}drain incomplete at the deadline: the instance could not be read ({} failed poll(s))",
                self.prefix, self.transient
            )
        })
    }

    /// The next step after reading the instance at `at`.
    pub fn observe(&mut self, at: Duration, r: &Reading) -> Next {
        self.polls = self.polls.saturating_add(1);
        let prefix = self.prefix;
        if r.status == EcsStatus::Active {
            return Next::GiveUp(format!(
                "{prefix}drain stopped: the container instance is ACTIVE again (an operator, or `gpu-medic incidents abort`, restored it)"
            ));
        }
        if r.tasks.is_empty() && r.running == 0 && r.pending == 0 {
            return Next::Drained(format!(
                "{prefix}drained: no task left; {} standalone task(s) stopped after the grace, {} stopped at the deadline; {} poll(s){}",
                self.stopped_standalone,
                self.stopped_forced,
                self.polls,
                if self.transient > 0 {
                    format!(", {} failed", self.transient)
                } else {
                    String::new()
                }
            ));
        }
        let left = r.tasks.len().max(usize::try_from(r.running).unwrap_or(0));
        if r.agent_connected {
            self.disconnected_since = None;
        } else {
            let since = *self.disconnected_since.get_or_insert(at);
            if at.saturating_sub(since) >= self.times.agent_disconnected_wait {
                return Next::GiveUp(format!(
                    "ECS agent disconnected for {}: ECS cannot stop the {left} task(s) left; giving up the drain",
                    humantime::format_duration(self.times.agent_disconnected_wait),
                ));
            }
        }
        let mut stop = Vec::new();
        if at >= self.grace_at {
            for t in r.tasks.iter().filter(|t| !t.service) {
                if self.stopped.insert(t.arn.clone()) {
                    stop.push((t.arn.clone(), StopKind::Standalone));
                }
            }
        }
        if at >= self.force_at && !self.forced {
            self.forced = true;
            for t in &r.tasks {
                if self.stopped.insert(t.arn.clone()) {
                    stop.push((t.arn.clone(), StopKind::Forced));
                }
            }
        }
        let deadline = (at >= self.end).then(|| {
            let ids: Vec<&str> = r.tasks.iter().map(|t| t.id.as_str()).collect();
            format!(
                "{prefix}drain incomplete at the deadline: {left} task(s) still running ({})",
                ids.join(", ")
            )
        });
        Next::Act { stop, deadline }
    }

    /// How a stop asked for by [`observe`](Self::observe) went. A retryable failure asks for
    /// the stop again at the next poll (and, for a forced stop, the force-stop round again).
    pub fn stopped(&mut self, arn: &str, kind: StopKind, ok: bool) {
        if ok {
            match kind {
                StopKind::Standalone => self.stopped_standalone += 1,
                StopKind::Forced => self.stopped_forced += 1,
            }
        } else {
            self.stopped.remove(arn);
            if kind == StopKind::Forced {
                self.forced = false;
            }
        }
    }

    /// When to poll next, from the drain's start, after a poll at `at`.
    pub fn next_poll(&self, at: Duration) -> Duration {
        at.saturating_add(self.times.poll_interval).min(self.end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    fn times() -> DrainTimes {
        DrainTimes {
            standalone_grace: 60 * S,
            force_stop_lead: 30 * S,
            agent_disconnected_wait: 20 * S,
            poll_interval: 5 * S,
        }
    }

    fn task(n: u32, service: bool) -> TaskView {
        TaskView {
            arn: format!("arn:task/{n}"),
            id: n.to_string(),
            service,
        }
    }

    fn draining(tasks: Vec<TaskView>) -> Reading {
        Reading {
            status: EcsStatus::Draining,
            running: tasks.len() as i32,
            pending: 0,
            agent_connected: true,
            tasks,
        }
    }

    fn stops(n: &Next) -> Vec<(String, StopKind)> {
        match n {
            Next::Act { stop, .. } => stop.clone(),
            other => panic!("expected Act, got {other:?}"),
        }
    }

    #[test]
    fn standalone_tasks_wait_for_the_grace_and_services_for_the_force_lead() {
        // 600 s to the deadline: margin 5 s, force at 570 s, end at 595 s.
        let mut p = DrainPlan::new(times(), 600 * S, Duration::ZERO, false);
        let r = draining(vec![task(1, true), task(2, false)]);
        assert!(stops(&p.observe(59 * S, &r)).is_empty(), "within the grace");
        assert_eq!(
            stops(&p.observe(60 * S, &r)),
            [("arn:task/2".to_string(), StopKind::Standalone)]
        );
        p.stopped("arn:task/2", StopKind::Standalone, true);
        assert!(
            stops(&p.observe(65 * S, &r)).is_empty(),
            "stopped once only"
        );
        assert_eq!(
            stops(&p.observe(570 * S, &r)),
            [("arn:task/1".to_string(), StopKind::Forced)]
        );
        p.stopped("arn:task/1", StopKind::Forced, true);
        let Next::Act { deadline, .. } = p.observe(595 * S, &r) else {
            panic!()
        };
        assert!(deadline.unwrap().contains("incomplete at the deadline"));
        let Next::Drained(msg) = p.observe(596 * S, &draining(vec![])) else {
            panic!()
        };
        assert!(
            msg.contains("1 standalone task(s) stopped after the grace, 1 stopped at the deadline"),
            "{msg}"
        );
    }

    #[test]
    fn a_resumed_drain_counts_the_grace_from_its_first_start() {
        let mut p = DrainPlan::new(times(), 600 * S, 50 * S, true);
        let r = draining(vec![task(2, false)]);
        assert_eq!(
            stops(&p.observe(10 * S, &r)).len(),
            1,
            "50 s + 10 s = the grace"
        );
        let Next::Drained(msg) = p.observe(11 * S, &draining(vec![])) else {
            panic!()
        };
        assert!(msg.starts_with("resumed drain: "), "{msg}");
    }

    #[test]
    fn a_failed_stop_is_asked_for_again() {
        let mut p = DrainPlan::new(times(), 600 * S, Duration::ZERO, false);
        let r = draining(vec![task(1, true)]);
        assert_eq!(stops(&p.observe(570 * S, &r)).len(), 1);
        p.stopped("arn:task/1", StopKind::Forced, false);
        assert_eq!(stops(&p.observe(575 * S, &r)).len(), 1, "forced again");
    }

    #[test]
    fn a_disconnected_agent_ends_the_drain_after_its_wait_and_reconnecting_resets_it() {
        let mut p = DrainPlan::new(times(), 600 * S, Duration::ZERO, false);
        let mut r = draining(vec![task(1, true)]);
        r.agent_connected = false;
        assert!(matches!(p.observe(10 * S, &r), Next::Act { .. }));
        r.agent_connected = true;
        assert!(matches!(p.observe(25 * S, &r), Next::Act { .. }));
        r.agent_connected = false;
        assert!(matches!(p.observe(30 * S, &r), Next::Act { .. }));
        assert!(matches!(p.observe(49 * S, &r), Next::Act { .. }));
        let Next::GiveUp(msg) = p.observe(50 * S, &r) else {
            panic!()
        };
        assert!(msg.contains("ECS agent disconnected for 20s"), "{msg}");
    }

    #[test]
    fn an_instance_active_again_stops_the_drain() {
        let mut p = DrainPlan::new(times(), 600 * S, Duration::ZERO, false);
        let mut r = draining(vec![task(1, true)]);
        r.status = EcsStatus::Active;
        assert!(matches!(p.observe(S, &r), Next::GiveUp(m) if m.contains("ACTIVE again")));
    }

    #[test]
    fn failed_polls_end_at_the_deadline_and_polls_never_pass_it() {
        let mut p = DrainPlan::new(times(), 20 * S, Duration::ZERO, false);
        // 20 s left: margin 2 s, end at 18 s; the force lead (30 s) is already due.
        assert_eq!(p.end(), 18 * S);
        assert_eq!(p.next_poll(15 * S), 18 * S);
        assert_eq!(p.poll_failed(10 * S), None);
        let msg = p.poll_failed(18 * S).unwrap();
        assert!(msg.contains("2 failed poll(s)"), "{msg}");
        let r = draining(vec![task(1, true)]);
        assert_eq!(stops(&p.observe(S, &r)).len(), 1, "forced at once");
    }

    #[test]
    fn no_time_left_is_no_panic() {
        let mut p = DrainPlan::new(times(), Duration::ZERO, Duration::MAX, false);
        assert_eq!(p.end(), Duration::ZERO);
        let r = draining(vec![task(1, false)]);
        let Next::Act { stop, deadline } = p.observe(Duration::ZERO, &r) else {
            panic!()
        };
        assert_eq!(stop.len(), 1);
        assert!(deadline.is_some());
        assert_eq!(p.next_poll(Duration::MAX), Duration::ZERO);
    }
}
