//! The one backoff every retry loop gpu-medic owns uses: **full jitter**, a delay drawn
//! uniformly from `[0, min(cap, base · 2^n)]` after `n` consecutive failures (AWS's
//! "Exponential Backoff And Jitter"; the AWS SDK's standard retry mode draws the same way).
//! Used by the lifecycle poller after IMDS errors, the incident export after a failed round,
//! the signed client between attempts, the fleet budget's deferrals, the MPS restart and the
//! evidence upload.
//!
//! Why jitter, and why full: a fleet that fails together (a throttled API, an outage) and
//! backs off by the same doubling retries together, in step, and meets the same throttle
//! again; a uniform draw over the whole window spreads the retries of N callers evenly over
//! it. Why our own and not `backon` (which gpu-medic used before): backon's
//! `with_jitter` adds `rand · d` to the delay `d` (a draw from `[d, 2d)`), which keeps every
//! caller's retry after the same floor `d`: the retries of a fleet still arrive in a wave
//! after each doubling. The popular `backoff` crate is unmaintained (RUSTSEC-2025-0012).
//! Ten lines need no dependency (docs/architecture.md, "Design notes").
//!
//! [`spread`] is the other shape: a periodic timer's period, drawn from `[d/2, 3d/2)` so
//! that timers started together drift apart, with the mean kept at `d`.

use std::time::Duration;

/// The window after `failures` consecutive failures: `base` doubled `failures` times, at most
/// `cap` (never below `base`).
pub fn window(base: Duration, failures: u32, cap: Duration) -> Duration {
    let cap = cap.max(base);
    base.saturating_mul(1u32 << failures.min(16)).min(cap)
}

/// Full jitter: a delay uniform in `[0, window(base, failures, cap)]`.
pub fn full_jitter(base: Duration, failures: u32, cap: Duration) -> Duration {
    let w = window(base, failures, cap);
    scaled(w, fastrand::f64()).min(w)
}

/// `d` drawn uniformly from `[d/2, 3d/2)`: a periodic timer's jitter (mean `d`).
pub fn spread(d: Duration) -> Duration {
    scaled(d, 0.5 + fastrand::f64())
}

/// `d · f` for `f` in `[0, 1.5]`, saturating (a `Duration::MAX` window stays finite).
fn scaled(d: Duration, f: f64) -> Duration {
    Duration::try_from_secs_f64(d.as_secs_f64() * f).unwrap_or(d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_doubles_up_to_its_cap_and_never_below_its_base() {
        let s = Duration::from_secs;
        assert_eq!(window(s(1), 0, s(60)), s(1));
        assert_eq!(window(s(1), 3, s(60)), s(8));
        assert_eq!(window(s(1), 6, s(60)), s(60));
        assert_eq!(window(s(1), u32::MAX, s(60)), s(60));
        assert_eq!(window(s(90), 2, s(60)), s(90));
        assert_eq!(window(Duration::MAX, 3, Duration::MAX), Duration::MAX);
    }

    /// Full jitter covers the whole window, evenly: of 4,000 draws after 3 failures (window
    /// 8 s) some fall in its first and some in its last tenth, and each half holds about half
    /// (a doubling without jitter, or backon's `[d, 2d)`, puts none below the floor).
    #[test]
    fn full_jitter_spreads_over_the_whole_window() {
        let s = Duration::from_secs;
        let draws: Vec<Duration> = (0..4000).map(|_| full_jitter(s(1), 3, s(60))).collect();
        assert!(draws.iter().all(|d| *d <= s(8)));
        assert!(draws.iter().any(|d| *d < Duration::from_millis(800)));
        assert!(draws.iter().any(|d| *d > Duration::from_millis(7200)));
        let low = draws.iter().filter(|d| **d < s(4)).count();
        assert!(
            (1600..2400).contains(&low),
            "{low} of 4000 in the lower half"
        );
        // Capped windows stay capped; a huge one stays finite.
        assert!((0..100).all(|_| full_jitter(s(1), 40, s(60)) <= s(60)));
        assert!(full_jitter(Duration::MAX, 3, Duration::MAX) <= Duration::MAX);
    }

    #[test]
    fn a_spread_period_keeps_its_mean() {
        let s = Duration::from_secs;
        let draws: Vec<Duration> = (0..4000).map(|_| spread(s(10))).collect();
        assert!(draws.iter().all(|d| *d >= s(5) && *d < s(15)));
        let mean = draws.iter().map(Duration::as_secs_f64).sum::<f64>() / 4000.0;
        assert!((9.5..10.5).contains(&mean), "{mean}");
    }
}
