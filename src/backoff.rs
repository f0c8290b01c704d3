//! Exponential backoff with full jitter, seeded so simulations replay exactly.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Delays that double from `min` up to `max`, each drawn uniformly from
/// `[base/2, base]` so that many workers backing off together spread out.
#[derive(Debug)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    attempt: u32,
    rng: SmallRng,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration, seed: u64) -> Self {
        Backoff {
            min,
            max: max.max(min),
            attempt: 0,
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// The next delay.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let base = self
            .min
            .saturating_mul(1u32 << self.attempt.min(20))
            .min(self.max);
        self.attempt = self.attempt.saturating_add(1);
        let half = base / 2;
        half + self.rng.gen_range(Duration::ZERO..=half)
    }

    /// Back to the shortest delay after a success.
    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_to_the_cap_and_reset() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1), 1);
        let d: Vec<_> = (0..8).map(|_| b.next_delay()).collect();
        assert!(d[0] >= Duration::from_millis(50) && d[0] <= Duration::from_millis(100));
        assert!(d[7] >= Duration::from_millis(500) && d[7] <= Duration::from_secs(1));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }
}
