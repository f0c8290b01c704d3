//! What to retry ([`Classify`]) and when ([`RetryPolicy`]).

use std::hash::{Hash, Hasher};
use std::time::Duration;

use shardflow::{backoff, Metadata};

/// Whether a failed attempt is worth another try. "Transient" is the one name the
/// workspace uses for "may succeed later" (see the `is_transient` methods of the
/// error types).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// Try again after a delay (a timeout, a throttle, a dependency that was down).
    Transient,
    /// Trying again cannot help (invalid input, a rule the record breaks): give up now.
    Permanent,
}

/// Says whether an error is [`ErrorClass::Transient`] or [`ErrorClass::Permanent`].
///
/// Implemented by [`RetryAll`] (the default) and by every `Fn(&E) -> ErrorClass`.
pub trait Classify<E> {
    /// Classifies one failed attempt.
    fn classify(&self, error: &E) -> ErrorClass;
}

/// The default classifier: every error is retryable (retries are bounded by the
/// [`RetryPolicy`]'s attempts and elapsed time).
#[derive(Clone, Copy, Debug, Default)]
pub struct RetryAll;

impl<E> Classify<E> for RetryAll {
    fn classify(&self, _error: &E) -> ErrorClass {
        ErrorClass::Transient
    }
}

impl<E, F> Classify<E> for F
where
    F: Fn(&E) -> ErrorClass,
{
    fn classify(&self, error: &E) -> ErrorClass {
        self(error)
    }
}

/// The retry layer's policy: exponential backoff with jitter, bounded by a number of
/// attempts and by the time spent retrying, plus the [`Classify`] that picks which
/// errors are retried.
///
/// The `n`-th retry waits `d = min(initial_delay * factor^(n-1), max_delay)`; with
/// jitter on (the default) the wait is drawn uniformly from `[d, 2d]` so that consumers
/// failing together do not retry in lockstep. The delays come from
/// [`shardflow::backoff::Backoff`], the schedule the consumer and producer use too.
///
/// A retry is scheduled only while both bounds hold: fewer than
/// [`max_attempts`](RetryPolicy::max_attempts) calls were made, and the retry would start
/// within [`max_elapsed`](RetryPolicy::max_elapsed) of the first failure (measured on
/// tokio's clock, so tests can pause it).
///
/// Defaults: 3 attempts, 100 ms initial delay, factor 2, 10 s max delay, 60 s max elapsed,
/// jitter on.
///
/// ```
/// use std::time::Duration;
/// use shardflow_middleware::{RetryPolicy, ErrorClass};
///
/// let policy = RetryPolicy::exponential()
///     .max_attempts(5)
///     .initial_delay(Duration::from_millis(50))
///     .classify(|e: &std::io::Error| match e.kind() {
///         std::io::ErrorKind::InvalidData => ErrorClass::Permanent,
///         _ => ErrorClass::Transient,
///     });
/// # let _ = policy;
/// ```
#[derive(Clone, Debug)]
pub struct RetryPolicy<C = RetryAll> {
    pub(crate) initial_delay: Duration,
    pub(crate) factor: f32,
    pub(crate) max_delay: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) max_elapsed: Option<Duration>,
    pub(crate) jitter: bool,
    pub(crate) seed: Option<u64>,
    pub(crate) classify: C,
}

impl RetryPolicy {
    /// The default exponential schedule, retrying every error.
    pub fn exponential() -> Self {
        RetryPolicy {
            initial_delay: Duration::from_millis(100),
            factor: 2.0,
            max_delay: Duration::from_secs(10),
            max_attempts: 3,
            max_elapsed: Some(Duration::from_secs(60)),
            jitter: true,
            seed: None,
            classify: RetryAll,
        }
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::exponential()
    }
}

impl<C> RetryPolicy<C> {
    /// The total number of calls, the first included; `1` means never retry. `0` is
    /// read as `1`.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The wait before the first retry.
    pub fn initial_delay(mut self, delay: Duration) -> Self {
        self.initial_delay = delay;
        self
    }

    /// How much each wait grows; values below 1 (or NaN) are read as 1 (a constant delay).
    pub fn factor(mut self, factor: f32) -> Self {
        self.factor = if factor >= 1.0 { factor } else { 1.0 };
        self
    }

    /// The longest wait before jitter (jitter can add up to the same again).
    pub fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// Stop retrying once a retry would start later than this after the first failure.
    pub fn max_elapsed(mut self, elapsed: Duration) -> Self {
        self.max_elapsed = Some(elapsed);
        self
    }

    /// Bound retries by attempts only.
    pub fn no_max_elapsed(mut self) -> Self {
        self.max_elapsed = None;
        self
    }

    /// Turns jitter on or off (on by default). Off gives exact, predictable delays.
    pub fn jitter(mut self, on: bool) -> Self {
        self.jitter = on;
        self
    }

    /// Makes the jitter reproducible: each record's delays are drawn from a generator
    /// seeded with `seed` mixed with the record's shard and position, so runs repeat
    /// exactly while records still spread apart. Without a seed, every record gets a
    /// random one.
    pub fn jitter_seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Replaces the classifier deciding which errors are retried.
    pub fn classify<C2>(self, classify: C2) -> RetryPolicy<C2> {
        RetryPolicy {
            initial_delay: self.initial_delay,
            factor: self.factor,
            max_delay: self.max_delay,
            max_attempts: self.max_attempts,
            max_elapsed: self.max_elapsed,
            jitter: self.jitter,
            seed: self.seed,
            classify,
        }
    }

    /// The classifier.
    pub fn classifier(&self) -> &C {
        &self.classify
    }

    /// The delays between the attempts for the record with `metadata` (at most
    /// `max_attempts - 1` of them; `max_elapsed` is applied by the retry layer).
    pub fn delays(&self, metadata: &Metadata) -> std::iter::Take<backoff::Backoff> {
        let retries = self.max_attempts.saturating_sub(1) as usize;
        let delays = if self.jitter {
            // The shared schedule draws from `[d/2, d]`: doubled bounds give `[d, 2d]`.
            let (min, max) = (
                self.initial_delay.saturating_mul(2),
                self.max_delay.saturating_mul(2),
            );
            match self.seed {
                Some(seed) => backoff::Backoff::new(min, max, seed ^ record_hash(metadata)),
                None => backoff::Backoff::unseeded(min, max),
            }
        } else {
            backoff::Backoff::new(self.initial_delay, self.max_delay, 0).without_jitter()
        };
        delays.factor(f64::from(self.factor)).take(retries)
    }
}

/// A hash of the record's identity that is the same on every run (std's `DefaultHasher`
/// built with `new()` uses fixed keys).
fn record_hash(metadata: &Metadata) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    metadata.stream.hash(&mut hasher);
    metadata.shard_id.hash(&mut hasher);
    metadata.sequence_number.hash(&mut hasher);
    metadata.sub_sequence_number.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::metadata;

    #[test]
    fn without_jitter_the_delays_double_up_to_the_cap() {
        let policy = RetryPolicy::exponential()
            .max_attempts(6)
            .initial_delay(Duration::from_millis(100))
            .max_delay(Duration::from_millis(500))
            .jitter(false);
        let delays: Vec<u128> = policy.delays(&metadata(1)).map(|d| d.as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 500, 500]);
    }

    #[test]
    fn seeded_jitter_repeats_per_record_and_stays_in_range() {
        let policy = RetryPolicy::exponential().max_attempts(5).jitter_seed(42);
        let a: Vec<_> = policy.delays(&metadata(1)).collect();
        let b: Vec<_> = policy.delays(&metadata(1)).collect();
        let c: Vec<_> = policy.delays(&metadata(2)).collect();
        assert_eq!(a, b, "same seed, same record: same delays");
        assert_ne!(a, c, "another record draws other delays");
        let plain: Vec<_> = policy.clone().jitter(false).delays(&metadata(1)).collect();
        for (jittered, base) in a.iter().zip(&plain) {
            assert!(
                jittered >= base && *jittered < *base * 2,
                "{jittered:?} vs {base:?}"
            );
        }
    }

    #[test]
    fn zero_attempts_and_bad_factors_are_clamped() {
        let policy = RetryPolicy::exponential().max_attempts(0).factor(f32::NAN);
        assert_eq!(policy.max_attempts, 1);
        assert_eq!(policy.factor, 1.0);
        assert_eq!(policy.delays(&metadata(1)).count(), 0);
    }
}
