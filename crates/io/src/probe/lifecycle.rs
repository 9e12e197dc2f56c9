//! Auto Scaling's view of this instance, from IMDS: `autoscaling/target-lifecycle-state`
//! says where the group is moving the instance. `Terminated` means termination has begun
//! (the instance waits in `Terminating:Wait` while our hook holds it), whatever the cause:
//! scale-in, instance refresh, our own replacement, Spot rebalancing. The engine answers with
//! a drain and then completes our terminate hook (docs/aws.md#terminating-hook).
//!
//! The source polls every `[lifecycle] poll_interval` through aws-config's IMDSv2 client
//! (session token with its TTL header; `AWS_EC2_METADATA_SERVICE_ENDPOINT` honoured):
//! - `Terminated` → `lifecycle Terminating`, on every poll (the engine ignores repeats, and a
//!   restarted daemon learns it again at once);
//! - `InService` → `lifecycle InService`, once per change (not every poll: each observation
//!   is a line in `inputs.jsonl`);
//! - 404 (not in an Auto Scaling group, or too early after boot) and other states
//!   (`Standby`, `Detached`, `Warmed:*`) → nothing;
//! - IMDS errors → one warning, then quiet retries with backoff (up to 8 x the interval,
//!   30 s at most) until IMDS answers again. A failing IMDS never produces a decision.
//!
//! The probe shares its readings with nobody but the engine: a drain that must learn of a
//! termination beginning mid-drain asks IMDS and Auto Scaling itself
//! (`crates/io/src/remedy/aws/drain.rs`).

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use aws_sdk_ecs::config::SharedHttpClient;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::aws::imds::{TARGET_STATE_PATH, get, imds_client};
use crate::model::{LifecycleState, Observation, Signal};
use crate::probe::Source;

/// Backoff after IMDS errors never exceeds this.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// The lifecycle state an IMDS target state maps to; None: not one the engine acts on.
pub fn signal_for(target: &str) -> Option<LifecycleState> {
    match target {
        "Terminated" => Some(LifecycleState::Terminating),
        "InService" => Some(LifecycleState::InService),
        _ => None,
    }
}

/// The delay before the next poll after `failures` consecutive errors: the interval, plus a
/// full-jitter backoff ([`crate::sys::backoff`]) from the interval doubling per failure, the
/// whole at most 8 intervals or [`MAX_BACKOFF`]. Never below the interval: an error never
/// makes the poller look faster than it does when all is well.
pub fn backoff(interval: Duration, failures: u32) -> Duration {
    if failures == 0 {
        return interval;
    }
    let extra = interval
        .saturating_mul(8)
        .min(MAX_BACKOFF)
        .saturating_sub(interval);
    interval
        .saturating_add(crate::sys::backoff::full_jitter(interval, failures - 1, extra).min(extra))
}

/// The IMDS lifecycle watcher for `gpu-medic run`.
pub struct LifecycleSource {
    interval: Duration,
    http: SharedHttpClient,
}

impl LifecycleSource {
    pub fn new(interval: Duration, http: SharedHttpClient) -> Self {
        LifecycleSource { interval, http }
    }

    async fn watch(self, tx: mpsc::Sender<Observation>, shutdown: CancellationToken) {
        let client = imds_client(self.http.clone(), 2);
        let mut failures = 0u32;
        let mut last: Option<String> = None;
        loop {
            let delay = match get(&client, TARGET_STATE_PATH).await {
                Ok(state) => {
                    if failures > 0 {
                        tracing::info!(
                            probe = "lifecycle",
                            "IMDS answers again after {failures} failed poll(s)"
                        );
                    }
                    failures = 0;
                    let changed = state != last;
                    if changed {
                        // A logged value is capped: IMDS's answer is anything up to its cap.
                        let shown = state.as_deref().map_or_else(
                            || "(none: 404)".to_string(),
                            |s| crate::mps::control::clip(s, 128),
                        );
                        tracing::info!(
                            probe = "lifecycle",
                            target_lifecycle_state = %shown,
                            "Auto Scaling target lifecycle state"
                        );
                    }
                    let signal = state.as_deref().and_then(signal_for);
                    let send = match signal {
                        Some(LifecycleState::Terminating) => true,
                        Some(_) => changed,
                        None => false,
                    };
                    if let (true, Some(s), Some(target)) = (send, signal, state.as_deref()) {
                        let obs = Observation::new(Signal::Lifecycle { state: s })
                            .with_detail(format!(
                                "IMDS autoscaling/target-lifecycle-state = {target}"
                            ))
                            .from_source("imds");
                        if tx.send(obs).await.is_err() {
                            return;
                        }
                    }
                    last = state;
                    self.interval
                }
                Err(e) => {
                    if failures == 0 {
                        tracing::warn!(
                            probe = "lifecycle",
                            "{e}; retrying with backoff (Auto Scaling terminations are noticed once IMDS answers)"
                        );
                    }
                    failures = failures.saturating_add(1);
                    backoff(self.interval, failures)
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }
}

impl Source for LifecycleSource {
    fn name(&self) -> &'static str {
        "lifecycle"
    }

    fn run(
        self: Box<Self>,
        tx: mpsc::Sender<Observation>,
        shutdown: CancellationToken,
        _resume: crate::model::Resume,
    ) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        Box::pin(async move { self.watch(tx, shutdown).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_states_map_to_lifecycle_signals() {
        assert_eq!(signal_for("Terminated"), Some(LifecycleState::Terminating));
        assert_eq!(signal_for("InService"), Some(LifecycleState::InService));
        for other in ["Standby", "Detached", "Warmed:Stopped", ""] {
            assert_eq!(signal_for(other), None, "{other}");
        }
    }

    #[test]
    fn backoff_waits_the_interval_plus_a_jittered_doubling_up_to_its_cap() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        assert_eq!(backoff(s(5), 0), s(5));
        for _ in 0..200 {
            let one = backoff(s(5), 1);
            assert!(one >= s(5) && one <= s(10), "{one:?}");
            let three = backoff(s(5), 3);
            assert!(three >= s(5) && three <= s(25), "{three:?}");
            assert!(backoff(s(5), 40) <= s(30));
            assert!(backoff(ms(200), 10) <= ms(1600));
            assert_eq!(backoff(s(60), 3), s(60), "never below the interval");
        }
        // Jittered: a fleet failing together does not come back together.
        let draws: std::collections::BTreeSet<Duration> =
            (0..50).map(|_| backoff(s(5), 4)).collect();
        assert!(draws.len() > 40, "{draws:?}");
    }
}
