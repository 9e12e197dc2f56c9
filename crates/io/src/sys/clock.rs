//! The one clock the daemon's rooms above the engine read, handed in at construction: the
//! wall clock (unix ms, for `Timestamp`s, deadlines and the claim protocol's claims) and the
//! monotonic clock (tokio's, for waits and the slot table's reservation ages).
//!
//! [`SystemClock`] is the real one (`cli/run.rs`). [`TokioClock`] advances its wall clock with
//! tokio's monotonic clock from a fixed origin, so under tokio's paused clock
//! (`#[tokio::test(start_paused = true)]`) an order's deadline moves in virtual time with
//! every `tokio::time::advance`. Never use it in the daemon: it does not follow NTP steps.

use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// Wall and monotonic time, read through one object.
pub trait Clock: Send + Sync + fmt::Debug {
    /// Unix time in milliseconds.
    fn now_ms(&self) -> u64;
    /// The monotonic clock (tokio's: paused and advanced with it in tests).
    fn instant(&self) -> tokio::time::Instant {
        tokio::time::Instant::now()
    }
}

/// A clock shared by the rooms that read it.
pub type SharedClock = Arc<dyn Clock>;

/// The system's wall clock and tokio's monotonic clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl SystemClock {
    pub fn shared() -> SharedClock {
        Arc::new(SystemClock)
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }
}

/// A wall clock that starts at `origin_ms` and moves only with tokio's monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct TokioClock {
    origin_ms: u64,
    origin: tokio::time::Instant,
}

impl TokioClock {
    /// Starts at `origin_ms` now (tokio's now: call it inside the runtime).
    fn starting_at(origin_ms: u64) -> Self {
        TokioClock {
            origin_ms,
            origin: tokio::time::Instant::now(),
        }
    }

    pub fn shared(origin_ms: u64) -> SharedClock {
        Arc::new(TokioClock::starting_at(origin_ms))
    }
}

impl Clock for TokioClock {
    fn now_ms(&self) -> u64 {
        let elapsed = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.origin_ms.saturating_add(elapsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn the_tokio_clock_moves_with_virtual_time_only() {
        let c = TokioClock::starting_at(1_000);
        assert_eq!(c.now_ms(), 1_000);
        tokio::time::advance(Duration::from_secs(90)).await;
        assert_eq!(c.now_ms(), 91_000);
    }

    #[test]
    fn the_system_clock_is_unix_time() {
        let ms = SystemClock.now_ms();
        assert!(ms > 1_700_000_000_000, "{ms}");
    }
}
