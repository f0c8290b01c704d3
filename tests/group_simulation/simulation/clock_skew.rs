//! The clock-skew fault: each worker's wall clock is off by an amount drawn for its
//! incarnation, up to [`MAX_SKEW`] ahead of or behind the host's (whose clock the
//! embedded Kinesis stamps arrivals with; the simulated wall clock). Only LATEST's start reads that clock; the
//! no-loss invariant over LATEST then says a clock ahead skipped nothing.

use std::time::{Duration, SystemTime};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The largest skew drawn, either way.
pub const MAX_SKEW: Duration = Duration::from_secs(90);

/// The skews of one history, from a generator of their own (seeded by the history's
/// seed), so switching the fault on leaves every other draw of the history as it was.
pub struct ClockSkews(SmallRng);

impl ClockSkews {
    pub fn new(seed: u64) -> Self {
        ClockSkews(SmallRng::seed_from_u64(seed ^ 0xc10c_5ce3))
    }

    /// The next worker's skew in milliseconds (negative: behind) and its wall clock:
    /// `host` (the simulated wall clock) shifted by the skew.
    pub fn next_clock(
        &mut self,
        host: impl Fn() -> SystemTime + Send + Sync + 'static,
    ) -> (i64, impl Fn() -> SystemTime + Send + Sync + 'static) {
        let max = i64::try_from(MAX_SKEW.as_millis()).unwrap_or(i64::MAX);
        let skew = self.0.gen_range(-max..=max);
        let offset = Duration::from_millis(skew.unsigned_abs());
        let clock = move || {
            let now = host();
            if skew >= 0 {
                now + offset
            } else {
                now - offset
            }
        };
        (skew, clock)
    }
}
