//! The one backoff: a delay that doubles with each consecutive failure, up to a cap. Used
//! wherever gpu-medic polls or ships something that can fail for a while (IMDS, the export).

use std::time::Duration;

/// `base` doubled `failures` times, at most `cap` and never below `base`.
pub fn doubling(base: Duration, failures: u32, cap: Duration) -> Duration {
    let cap = cap.max(base);
    base.saturating_mul(1u32 << failures.min(16)).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_its_cap_and_never_below_its_base() {
        let s = Duration::from_secs;
        assert_eq!(doubling(s(1), 0, s(60)), s(1));
        assert_eq!(doubling(s(1), 3, s(60)), s(8));
        assert_eq!(doubling(s(1), 6, s(60)), s(60));
        assert_eq!(doubling(s(1), u32::MAX, s(60)), s(60));
        assert_eq!(doubling(s(90), 2, s(60)), s(90));
        assert_eq!(doubling(Duration::MAX, 3, Duration::MAX), Duration::MAX);
    }
}
