//! The agent's one retry policy: exponential backoff with a cap and jitter.
//!
//! Three places retry, each on its own clock, all with this policy:
//! * a range or listing request that failed transiently ([`crate::source::pipeline`]), where a
//!   server's `Retry-After` (seconds or an HTTP date, parsed with the error) wins over the
//!   computed delay;
//! * a model that failed transiently ([`crate::reconciler`]): the decision core computes the
//!   delay from a jitter value it is given, so its tables stay deterministic;
//! * a state file the disk refused to write (`reconciler::persist`), without jitter: one
//!   process, nothing to spread.
//!
//! Jitter scales the delay to 50..100%, so a node full of failing models or requests does not
//! retry in lockstep; it comes from `fastrand` where it is not given.

use std::time::Duration;

/// `base` doubling per retry, at most `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub base: Duration,
    pub max: Duration,
}

impl Backoff {
    pub const fn new(base: Duration, max: Duration) -> Self {
        Self { base, max }
    }

    /// The delay before retry `n` (1 for the first): `base * 2^(n-1)`, at most `max`.
    pub fn step(&self, n: u32) -> Duration {
        self.base
            .saturating_mul(1u32 << n.saturating_sub(1).min(16))
            .min(self.max)
    }

    /// [`Backoff::step`] scaled by `jitter` (0..1 maps to 50..100%).
    pub fn jittered(&self, n: u32, jitter: f64) -> Duration {
        self.step(n).mul_f64(0.5 + 0.5 * jitter.clamp(0.0, 1.0))
    }

    /// [`Backoff::jittered`] with random jitter.
    pub fn random(&self, n: u32) -> Duration {
        self.jittered(n, fastrand::f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_base_to_the_cap() {
        let b = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
        let steps: Vec<u64> = (1..=8).map(|n| b.step(n).as_secs()).collect();
        assert_eq!(steps, [1, 2, 4, 8, 16, 32, 60, 60]);
        assert_eq!(
            b.step(0),
            Duration::from_secs(1),
            "0 counts as the first retry"
        );
        assert_eq!(b.step(u32::MAX), Duration::from_secs(60), "no overflow");
    }

    #[test]
    fn jitter_spans_half_to_all_of_the_step() {
        let b = Backoff::new(Duration::from_secs(4), Duration::from_secs(60));
        assert_eq!(b.jittered(1, 0.0), Duration::from_secs(2));
        assert_eq!(b.jittered(1, 1.0), Duration::from_secs(4));
        assert_eq!(b.jittered(1, 7.0), Duration::from_secs(4), "clamped");
        for _ in 0..100 {
            let d = b.random(2);
            assert!(
                d >= Duration::from_secs(4) && d <= Duration::from_secs(8),
                "{d:?}"
            );
        }
    }
}
