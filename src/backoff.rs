//! Exponential backoff with jitter, seeded so simulations replay exactly: the one delay
//! schedule of the consumer (reads, handler failures, lease calls), the producer
//! (resends) and the middleware's retry layer; and the deadline-bounded poll of the AWS
//! backends' waits for a resource to become ACTIVE.

use std::time::Duration;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Delays that grow by a factor (2 unless [`factor`](Backoff::factor) says otherwise)
/// from `min` up to `max`; with jitter (the default) each delay `d` is drawn uniformly
/// from `[d/2, d]`, so that many workers backing off together spread out.
///
/// Used as a stateful sequence ([`next_delay`](Backoff::next_delay), also as an
/// endless [`Iterator`], [`reset`](Backoff::reset) after a success) or by retry number
/// with a jitter draw of the caller's ([`delay`](Backoff::delay)).
///
/// ```
/// use std::time::Duration;
/// use shardflow::backoff::Backoff;
///
/// let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1), 7);
/// let first = backoff.next_delay();
/// assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
/// ```
#[derive(Clone, Debug)]
pub struct Backoff {
    min: Duration,
    max: Duration,
    factor: f64,
    jitter: bool,
    attempt: u32,
    rng: SmallRng,
}

impl Backoff {
    /// Delays from `min` doubling up to `max` (a `max` below `min` is read as `min`),
    /// with jitter drawn from a generator seeded with `seed`: the same seed gives the
    /// same delays.
    pub fn new(min: Duration, max: Duration, seed: u64) -> Self {
        Backoff {
            min,
            max: max.max(min),
            factor: 2.0,
            jitter: true,
            attempt: 0,
            rng: SmallRng::seed_from_u64(seed),
        }
    }

    /// [`new`](Self::new) with a random seed.
    pub fn unseeded(min: Duration, max: Duration) -> Self {
        Self::new(min, max, rand::random())
    }

    /// How much each delay grows; values below 1 (or NaN) are read as 1 (a constant
    /// delay).
    pub fn factor(mut self, factor: f64) -> Self {
        self.factor = if factor >= 1.0 { factor } else { 1.0 };
        self
    }

    /// No jitter: every delay is exactly its `d`.
    pub fn without_jitter(mut self) -> Self {
        self.jitter = false;
        self
    }

    /// The delay before retry `retry` (0 for the first) without jitter:
    /// `min × factor^retry`, capped at `max`.
    pub fn base(&self, retry: u32) -> Duration {
        let exponent = i32::try_from(retry).unwrap_or(i32::MAX);
        let grown = self.min.as_secs_f64() * self.factor.powi(exponent);
        // Past what a Duration holds (or infinite) is past the cap.
        Duration::try_from_secs_f64(grown)
            .unwrap_or(self.max)
            .min(self.max)
    }

    /// The delay before retry `retry` with the jitter `draw` (in `[0, 1]`): `base(retry)`
    /// scaled into `[d/2, d]`. Callers that retry several things together pass them one
    /// draw, so that they stay together.
    pub fn delay(&self, retry: u32, draw: f64) -> Duration {
        let base = self.base(retry);
        if !self.jitter {
            return base;
        }
        let scale = 0.5 + 0.5 * draw.clamp(0.0, 1.0);
        // At most `base` (scale ≤ 1), unless rounding a delay near Duration::MAX overflows.
        Duration::try_from_secs_f64(base.as_secs_f64() * scale).unwrap_or(base)
    }

    /// A jitter draw in `[0, 1)` from this backoff's generator, for [`delay`](Self::delay).
    pub fn draw(&mut self) -> f64 {
        self.rng.gen()
    }

    /// The next delay of the sequence.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.base(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        if !self.jitter {
            return base;
        }
        let half = base / 2;
        half + self.rng.gen_range(Duration::ZERO..=half)
    }

    /// Back to the shortest delay after a success.
    pub fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// The delays of [`next_delay`](Backoff::next_delay), without end (bound it with
/// [`Iterator::take`]).
impl Iterator for Backoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        Some(self.next_delay())
    }
}

/// Polls with pauses growing by half from `first` up to `cap`, until a deadline: the
/// AWS backends' loops that wait for a stream, stream consumer or table to be ACTIVE.
pub(crate) struct DeadlinePoll {
    deadline: tokio::time::Instant,
    pauses: Backoff,
}

impl DeadlinePoll {
    /// Polls for at most `wait` from now.
    pub(crate) fn new(wait: Duration, first: Duration, cap: Duration) -> Self {
        DeadlinePoll {
            deadline: tokio::time::Instant::now() + wait,
            pauses: Backoff::new(first, cap, 0).factor(1.5).without_jitter(),
        }
    }

    /// Sleeps until the next poll; `false` (at once) when that poll would start past the
    /// deadline: the caller gives up.
    pub(crate) async fn pause(&mut self) -> bool {
        let pause = self.pauses.next_delay();
        if tokio::time::Instant::now() + pause > self.deadline {
            return false;
        }
        tokio::time::sleep(pause).await;
        true
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

    #[test]
    fn the_schedule_by_retry_number_doubles_up_to_the_cap() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(500), 0);
        let bases: Vec<u128> = (0..6).map(|n| b.base(n).as_millis()).collect();
        assert_eq!(bases, [100, 200, 400, 500, 500, 500]);
        assert_eq!(b.base(u32::MAX), Duration::from_millis(500));
        assert_eq!(b.delay(1, 0.0), Duration::from_millis(100));
        assert_eq!(b.delay(1, 1.0), Duration::from_millis(200));
        let exact = b.clone().without_jitter().factor(1.5);
        assert_eq!(exact.delay(1, 0.0), Duration::from_millis(150));
        assert_eq!(
            exact.clone().take(2).collect::<Vec<_>>()[1],
            Duration::from_millis(150)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_deadline_poll_pauses_growing_until_the_deadline() {
        let start = tokio::time::Instant::now();
        let mut poll = DeadlinePoll::new(
            Duration::from_millis(200),
            Duration::from_millis(20),
            Duration::from_millis(40),
        );
        let mut woke = Vec::new();
        while poll.pause().await {
            woke.push(start.elapsed().as_millis());
        }
        // 20, 30, 40, 40, 40 ms pauses; the next would end past 200 ms.
        assert_eq!(woke, [20, 50, 90, 130, 170]);
        assert_eq!(start.elapsed().as_millis(), 170, "giving up does not sleep");
    }

    #[test]
    fn seeded_delays_repeat() {
        let a: Vec<_> = Backoff::new(Duration::from_millis(10), Duration::from_secs(1), 3)
            .take(10)
            .collect();
        let b: Vec<_> = Backoff::new(Duration::from_millis(10), Duration::from_secs(1), 3)
            .take(10)
            .collect();
        assert_eq!(a, b);
    }
}
