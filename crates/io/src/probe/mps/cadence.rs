//! When others talk to the MPS control daemon, learnt from the daemon's own log, so that
//! gpu-medic's probe keeps away from them.
//!
//! The daemon serves one front-end session at a time; a second one fails
//! (tests/support/MPS-FACTS.md, section 3). The ECS agent probes the same daemon on its
//! own cadence (its health check, once per doctor run), and three failures in a row mark the
//! instance impaired: a probe of ours that lands on the agent's makes the agent's fail. The
//! daemon logs every session it serves (`NEW UI`, the commands, `UI closed`), with a local
//! time stamp; the sessions that are not ours (ours send exactly [`PROBE_COMMAND`] and
//! [`SERVER_LIST_COMMAND`]) give the others' period and phase, and the probe holds while the
//! next of theirs is due. An irregular or too busy prober, or one that stopped, holds nothing:
//! the probe's wait for an open front-end and its one retry still cover it.

use std::collections::VecDeque;
use std::time::Duration;

use super::logs::Session;
use crate::mps::{PROBE_COMMAND, SERVER_LIST_COMMAND};

/// Others' sessions remembered.
const KEEP: usize = 16;
/// A period is learnt from at least this many sessions.
const LEAST: usize = 3;
/// Others that have not been seen for this many periods have stopped.
const STALE_PERIODS: i64 = 4;

/// Others' session times (milliseconds since the epoch, UTC), oldest first.
#[derive(Debug, Default)]
pub struct Cadence {
    others: VecDeque<i64>,
}

impl Cadence {
    /// Learns from sessions read from the log. `utc_offset_s`: the local zone's offset from UTC
    /// now, in seconds (the daemon stamps its lines in local time).
    pub fn seen(&mut self, sessions: &[Session], utc_offset_s: i64) {
        for s in sessions {
            if is_ours(&s.commands) || s.commands.is_empty() {
                continue;
            }
            let at = s.at_ms.saturating_sub(utc_offset_s.saturating_mul(1000));
            if self.others.back().is_some_and(|last| at <= *last) {
                continue; // a log read again, or a clock stepped back: not a new session
            }
            if self.others.len() >= KEEP {
                self.others.pop_front();
            }
            self.others.push_back(at);
        }
    }

    /// The others' period: the median gap between their sessions, once there are enough.
    pub fn period_ms(&self) -> Option<i64> {
        if self.others.len() < LEAST {
            return None;
        }
        let mut gaps: Vec<i64> = self
            .others
            .iter()
            .zip(self.others.iter().skip(1))
            .map(|(a, b)| b.saturating_sub(*a))
            .collect();
        gaps.sort_unstable();
        gaps.get(gaps.len() / 2).copied().filter(|p| *p > 0)
    }

    /// How long a probe about to start at `now_ms` (UTC) holds so that it stays `guard` away
    /// from the others' next session: zero when none is due that close, when their period is
    /// under three guards (too busy to keep away from), or when they stopped.
    pub fn hold(&self, now_ms: i64, guard: Duration) -> Duration {
        let guard_ms = i64::try_from(guard.as_millis()).unwrap_or(i64::MAX);
        let (Some(period), Some(last)) = (self.period_ms(), self.others.back().copied()) else {
            return Duration::ZERO;
        };
        if period < guard_ms.saturating_mul(5) / 2 {
            return Duration::ZERO;
        }
        let since = now_ms.saturating_sub(last);
        if since > period.saturating_mul(STALE_PERIODS) {
            return Duration::ZERO;
        }
        // The due session nearest now.
        let k = since.max(0).saturating_add(period / 2) / period;
        let due = last.saturating_add(k.saturating_mul(period));
        if now_ms >= due.saturating_sub(guard_ms) && now_ms < due.saturating_add(guard_ms) {
            let wait = due.saturating_add(guard_ms).saturating_sub(now_ms);
            return Duration::from_millis(u64::try_from(wait).unwrap_or(0));
        }
        Duration::ZERO
    }
}

/// Whether a session is gpu-medic's own probe.
fn is_ours(commands: &[String]) -> bool {
    commands.len() == 2 && commands[0] == PROBE_COMMAND && commands[1] == SERVER_LIST_COMMAND
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(at_ms: i64, commands: &[&str]) -> Session {
        Session {
            at_ms,
            commands: commands.iter().map(|c| c.to_string()).collect(),
        }
    }

    fn agent(at_ms: i64) -> Session {
        session(at_ms, &[PROBE_COMMAND])
    }

    const GUARD: Duration = Duration::from_secs(1);

    #[test]
    fn a_regular_prober_is_kept_away_from() {
        let mut c = Cadence::default();
        // Local time one hour ahead of UTC.
        c.seen(
            &[agent(3_600_000 + 10_000), agent(3_600_000 + 40_000)],
            3600,
        );
        assert_eq!(c.period_ms(), None, "two sessions are not a cadence");
        c.seen(&[agent(3_600_000 + 70_000)], 3600);
        assert_eq!(c.period_ms(), Some(30_000));
        // The next is due at 100 000 (UTC).
        assert_eq!(c.hold(99_500, GUARD), Duration::from_millis(1500));
        assert_eq!(c.hold(100_200, GUARD), Duration::from_millis(800));
        assert_eq!(c.hold(98_900, GUARD), Duration::ZERO);
        assert_eq!(c.hold(101_000, GUARD), Duration::ZERO);
        assert_eq!(c.hold(85_000, GUARD), Duration::ZERO);
        // Two periods on, still kept away from.
        assert_eq!(c.hold(130_000, GUARD), Duration::from_millis(1000));
    }

    #[test]
    fn our_own_sessions_and_empty_ones_teach_nothing() {
        let mut c = Cadence::default();
        let ours = [PROBE_COMMAND, SERVER_LIST_COMMAND];
        c.seen(
            &[
                session(0, &ours),
                session(1_000, &ours),
                session(2_000, &[]),
                session(3_000, &ours),
            ],
            0,
        );
        assert_eq!(c.period_ms(), None);
        assert_eq!(c.hold(4_000, GUARD), Duration::ZERO);
    }

    #[test]
    fn a_busy_irregular_or_stopped_prober_holds_nothing() {
        let mut busy = Cadence::default();
        busy.seen(&[agent(0), agent(1_000), agent(2_000), agent(3_000)], 0);
        assert_eq!(
            busy.hold(4_000, GUARD),
            Duration::ZERO,
            "period under 3 guards"
        );

        let mut stopped = Cadence::default();
        stopped.seen(&[agent(0), agent(30_000), agent(60_000)], 0);
        assert_eq!(stopped.hold(60_000 + 5 * 30_000, GUARD), Duration::ZERO);

        // A log read again adds nothing; a clock stepped back is not a session.
        let mut again = Cadence::default();
        again.seen(&[agent(0), agent(30_000), agent(60_000)], 0);
        again.seen(&[agent(30_000), agent(60_000)], 0);
        assert_eq!(again.others.len(), 3);
    }

    #[test]
    fn the_median_gap_survives_an_odd_session() {
        // The agent's health check every 30 s and one task's start gate in between.
        let mut c = Cadence::default();
        c.seen(
            &[
                agent(0),
                agent(30_000),
                agent(41_000),
                agent(60_000),
                agent(90_000),
            ],
            0,
        );
        assert_eq!(c.period_ms(), Some(30_000));
    }

    #[test]
    fn no_input_overflows() {
        let mut c = Cadence::default();
        c.seen(&[agent(i64::MIN), agent(0), agent(i64::MAX)], i64::MIN);
        c.seen(&[agent(i64::MAX)], i64::MAX);
        let _ = c.period_ms();
        for now in [i64::MIN, -1, 0, i64::MAX] {
            let _ = c.hold(now, Duration::MAX);
            let _ = c.hold(now, Duration::ZERO);
        }
    }
}
