//! Kinesis' per-shard throughput limits for the embedded stream service: what a shard
//! accepts and serves per second, metered the way AWS meters it, so that producer and
//! consumer figures measured on the embedded backend mean what they would on AWS.
//!
//! # What AWS documents, and what is modelled here
//!
//! * **Writes**: each shard takes up to 1,000 records and 1 MiB (data plus partition key)
//!   per second. A PutRecords entry over the shard's budget is refused in the answer with
//!   `ProvisionedThroughputExceededException` while the other entries are stored. A
//!   stream set for records larger than 1 MiB keeps these figures: AWS describes a
//!   shard taking an occasional large record (up to 10 MiB) as a burst past its rate,
//!   paid back at the steady rate afterwards, so that it still averages 1 MiB per second.
//! * **GetRecords**: up to 5 calls and 2 MiB per second per shard, up to 10 MiB in one
//!   answer. A call over 5 per second is refused with
//!   `ProvisionedThroughputExceededException`. The bytes are charged *after* the answer:
//!   AWS returns what was asked (up to 10 MiB) and then refuses the calls that follow
//!   until the shard has earned those bytes back (after a 10 MiB answer, "subsequent
//!   calls made within the next 5 seconds throw ProvisionedThroughputExceededException").
//! * **Enhanced fan-out**: each registered consumer gets up to 2 MiB per second per
//!   shard. SubscribeToShard never refuses for throughput; it paces its events.
//! * **One PutRecords call**: at most 500 entries and 5 MiB, counting the data and
//!   partition key of every entry (not explicit hash keys). A call over either is
//!   refused whole as invalid (`KinesisError::Invalid`), nothing of it stored.
//!
//! AWS speaks of per-second limits and allows "a small burst" without saying how large.
//! Each limit here is a token bucket holding at most one second's quota, refilled
//! continuously at the per-second rate, and full when a shard is first used. Over any
//! interval of `t` seconds a shard thus takes at most `(1 + t)` seconds' worth, which
//! is one second's burst, and a writer that spreads its records evenly at the rate is
//! never refused. Fixed one-second windows were not chosen: they let twice the quota
//! through across a window boundary and reward writers that fire in step with the
//! boundaries, neither of which a real shard does. A refused call or entry takes
//! nothing from any budget. The read budget may go negative (the bytes of an answer
//! are charged in full); calls are refused until it is positive again. So may the
//! write bytes budget: a record larger than one second's quota is taken when the
//! budget is full and charged in full, and the shard takes nothing more until it has
//! earned those bytes back.
//!
//! All times are tokio's ([`tokio::time::Instant`]), so tests can run the meters on the
//! paused clock.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// Kinesis' per-shard throughput limits, as the embedded backend enforces them.
///
/// [`KinesisLimits::aws()`] has AWS' figures; the default has none (every figure `0`),
/// which is how the embedded backend starts, so tests that are not about throughput
/// stay fast. A figure of `0` switches that one limit off. Change single figures from
/// AWS' ones to make a test quicker:
///
/// ```
/// use shardflow::memory::KinesisLimits;
/// use shardflow::Memory;
///
/// let memory = Memory::builder()
///     .limits(KinesisLimits {
///         write_records_per_second: 10,
///         ..KinesisLimits::aws()
///     })
///     .build();
/// # let _ = memory;
/// ```
///
/// See the module `memory::limits` source docs for how they are metered: a token bucket
/// per limit and shard, holding at most one second's quota.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KinesisLimits {
    /// Records a shard accepts per second (AWS: 1,000).
    pub write_records_per_second: u64,
    /// Bytes (data plus partition key) a shard accepts per second (AWS: 1 MiB).
    pub write_bytes_per_second: u64,
    /// GetRecords calls a shard answers per second (AWS: 5).
    pub get_records_calls_per_second: u64,
    /// Bytes (data plus partition key) GetRecords serves per shard per second
    /// (AWS: 2 MiB).
    pub read_bytes_per_second: u64,
    /// The most bytes one GetRecords answer carries (AWS: 10 MiB); at least one record.
    pub max_get_records_bytes: u64,
    /// Bytes an enhanced fan-out subscription delivers per second, per consumer and
    /// shard (AWS: 2 MiB).
    pub fan_out_bytes_per_second: u64,
}

const MIB: u64 = 1024 * 1024;

impl KinesisLimits {
    /// AWS' figures for a provisioned-mode shard: 1,000 records and 1 MiB written per
    /// second; 5 GetRecords calls and 2 MiB read per second, at most 10 MiB per answer;
    /// 2 MiB per second per enhanced fan-out consumer.
    pub fn aws() -> Self {
        KinesisLimits {
            write_records_per_second: 1_000,
            write_bytes_per_second: MIB,
            get_records_calls_per_second: 5,
            read_bytes_per_second: 2 * MIB,
            max_get_records_bytes: 10 * MIB,
            fan_out_bytes_per_second: 2 * MIB,
        }
    }

    /// No limit at all (the default).
    pub fn none() -> Self {
        Self::default()
    }
}

/// The size Kinesis meters for a record: its data plus its partition key.
pub(super) fn metered_size(data: usize, partition_key: &str) -> u64 {
    (data + partition_key.len()) as u64
}

/// One limit's budget: tokens refilled continuously at `rate` per second, up to `rate`
/// (one second's quota).
#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn full(rate: u64, now: Instant) -> Self {
        Bucket {
            tokens: rate as f64,
            at: now,
        }
    }

    fn refill(&mut self, rate: u64, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * rate as f64).min(rate as f64);
        self.at = now;
    }

    /// Takes `n` tokens if the bucket holds them.
    fn take(&mut self, rate: u64, n: u64, now: Instant) -> bool {
        self.refill(rate, now);
        if self.tokens >= n as f64 {
            self.tokens -= n as f64;
            true
        } else {
            false
        }
    }

    /// Takes `n` tokens if the bucket holds them, or, for more than one second's quota,
    /// if it is full; the bucket may then go negative (a burst paid back over time).
    fn take_burst(&mut self, rate: u64, n: u64, now: Instant) -> bool {
        self.refill(rate, now);
        if self.tokens >= n.min(rate) as f64 {
            self.tokens -= n as f64;
            true
        } else {
            false
        }
    }

    /// How long until the bucket holds `n` tokens (capped at one second's quota, so
    /// that a single item larger than the quota still passes once the bucket is full).
    fn wait_for(&mut self, rate: u64, n: u64, now: Instant) -> Duration {
        self.refill(rate, now);
        let missing = n.min(rate) as f64 - self.tokens;
        if missing <= 0.0 {
            Duration::ZERO
        } else {
            // `rate` is not zero: callers skip a limit whose rate is zero.
            Duration::from_secs_f64(missing / rate as f64)
        }
    }
}

/// The budgets of one shard.
#[derive(Debug)]
struct ShardMeter {
    write_records: Bucket,
    write_bytes: Bucket,
    read_calls: Bucket,
    read_bytes: Bucket,
}

impl ShardMeter {
    fn new(limits: &KinesisLimits, now: Instant) -> Self {
        ShardMeter {
            write_records: Bucket::full(limits.write_records_per_second, now),
            write_bytes: Bucket::full(limits.write_bytes_per_second, now),
            read_calls: Bucket::full(limits.get_records_calls_per_second, now),
            read_bytes: Bucket::full(limits.read_bytes_per_second, now),
        }
    }
}

/// Why a GetRecords call is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ReadRefusal {
    /// More than the allowed calls per second.
    Calls,
    /// The bytes already served are not yet earned back.
    Bytes,
}

/// The budgets of every shard and fan-out consumer, under the limits in force.
#[derive(Debug, Default)]
pub(super) struct Meters {
    limits: KinesisLimits,
    /// By (stream, shard id).
    shards: HashMap<(String, String), ShardMeter>,
    /// By (consumer ARN, shard id).
    fan_out: HashMap<(String, String), Bucket>,
}

impl Meters {
    /// Puts `limits` in force; every budget starts full again.
    pub(super) fn set_limits(&mut self, limits: KinesisLimits) {
        self.limits = limits;
        self.shards.clear();
        self.fan_out.clear();
    }

    /// Forgets the budgets of a deleted stream's shards.
    pub(super) fn forget_stream(&mut self, stream: &str) {
        self.shards.retain(|(s, _), _| s != stream);
    }

    fn shard(&mut self, stream: &str, shard_id: &str, now: Instant) -> &mut ShardMeter {
        let limits = &self.limits;
        self.shards
            .entry((stream.to_owned(), shard_id.to_owned()))
            .or_insert_with(|| ShardMeter::new(limits, now))
    }

    /// Whether the shard accepts one more record of `bytes` now; if so, it is charged.
    pub(super) fn admit_write(&mut self, stream: &str, shard_id: &str, bytes: u64) -> bool {
        let (records, per_second) = (
            self.limits.write_records_per_second,
            self.limits.write_bytes_per_second,
        );
        if records == 0 && per_second == 0 {
            return true;
        }
        let now = Instant::now();
        let meter = self.shard(stream, shard_id, now);
        // Both budgets are looked at before either is charged: a refused entry costs
        // nothing.
        let mut r = meter.write_records;
        let mut b = meter.write_bytes;
        let fits = (records == 0 || r.take(records, 1, now))
            && (per_second == 0 || b.take_burst(per_second, bytes, now));
        if fits {
            meter.write_records = r;
            meter.write_bytes = b;
        }
        fits
    }

    /// Whether the shard answers a GetRecords call now; if so, the call is counted.
    pub(super) fn admit_read(&mut self, stream: &str, shard_id: &str) -> Result<(), ReadRefusal> {
        let (calls, per_second) = (
            self.limits.get_records_calls_per_second,
            self.limits.read_bytes_per_second,
        );
        if calls == 0 && per_second == 0 {
            return Ok(());
        }
        let now = Instant::now();
        let meter = self.shard(stream, shard_id, now);
        if per_second != 0 {
            meter.read_bytes.refill(per_second, now);
            if meter.read_bytes.tokens <= 0.0 {
                return Err(ReadRefusal::Bytes);
            }
        }
        if calls != 0 && !meter.read_calls.take(calls, 1, now) {
            return Err(ReadRefusal::Calls);
        }
        Ok(())
    }

    /// Charges the bytes of a GetRecords answer to its shard (the budget may go
    /// negative: the calls that follow are refused until it is earned back).
    pub(super) fn charge_read(&mut self, stream: &str, shard_id: &str, bytes: u64) {
        let per_second = self.limits.read_bytes_per_second;
        if per_second == 0 {
            return;
        }
        let now = Instant::now();
        let meter = self.shard(stream, shard_id, now);
        meter.read_bytes.refill(per_second, now);
        meter.read_bytes.tokens -= bytes as f64;
    }

    /// Whether GetRecords answers are metered in bytes, and if so the most bytes one
    /// answer carries (`u64::MAX` when only the read rate is limited).
    pub(super) fn answer_bytes(&self) -> Option<u64> {
        match (
            self.limits.max_get_records_bytes,
            self.limits.read_bytes_per_second,
        ) {
            (0, 0) => None,
            (0, _) => Some(u64::MAX),
            (max, _) => Some(max),
        }
    }

    /// How many of `sizes` (the next records' metered sizes, in order) a fan-out
    /// consumer's subscription to a shard may deliver now; they are charged. When it
    /// may deliver none, how long until the first of them can go.
    pub(super) fn fan_out(
        &mut self,
        consumer: &str,
        shard_id: &str,
        sizes: impl Iterator<Item = u64>,
    ) -> Result<usize, Duration> {
        let rate = self.limits.fan_out_bytes_per_second;
        if rate == 0 {
            return Ok(sizes.count());
        }
        let now = Instant::now();
        let bucket = self
            .fan_out
            .entry((consumer.to_owned(), shard_id.to_owned()))
            .or_insert_with(|| Bucket::full(rate, now));
        let mut sizes = sizes.peekable();
        let Some(&first) = sizes.peek() else {
            return Ok(0);
        };
        let wait = bucket.wait_for(rate, first, now);
        if !wait.is_zero() {
            return Err(wait);
        }
        // The first record goes (even one larger than the quota, once the bucket is
        // full); the others while they fit.
        let mut count = 0;
        let mut charged = 0.0;
        for size in sizes {
            if count > 0 && charged + size as f64 > bucket.tokens {
                break;
            }
            charged += size as f64;
            count += 1;
        }
        bucket.tokens -= charged;
        Ok(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_bucket_refills_at_its_rate_up_to_one_seconds_quota() {
        let now = Instant::now();
        let mut b = Bucket::full(10, now);
        assert!(b.take(10, 10, now));
        assert!(!b.take(10, 1, now));
        let later = now + Duration::from_millis(500);
        assert!(b.take(10, 5, later));
        assert!(!b.take(10, 1, later));
        // Idle for a minute: still only one second's quota.
        let much_later = later + Duration::from_secs(60);
        assert!(b.take(10, 10, much_later));
        assert!(!b.take(10, 1, much_later));
    }

    #[tokio::test(start_paused = true)]
    async fn a_record_above_a_seconds_write_quota_takes_a_full_budget_and_is_paid_back() {
        let mut m = Meters::default();
        m.set_limits(KinesisLimits::aws());
        let large = 9 * MIB;
        assert!(m.admit_write("s", "shard", large), "a full budget takes it");
        assert!(
            !m.admit_write("s", "shard", 1),
            "the burst is paid back first"
        );
        // 9 MiB at 1 MiB per second: still in debt after 7.9 s, even again after 8 s.
        tokio::time::advance(Duration::from_millis(7_900)).await;
        assert!(!m.admit_write("s", "shard", 1));
        tokio::time::advance(Duration::from_millis(200)).await;
        assert!(m.admit_write("s", "shard", 50 * 1024));
        assert!(
            !m.admit_write("s", "shard", large),
            "not before the budget is full"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn no_limits_admit_everything() {
        let mut m = Meters::default();
        for _ in 0..100_000 {
            assert!(m.admit_write("s", "shard", 1 << 20));
            assert_eq!(m.admit_read("s", "shard"), Ok(()));
            m.charge_read("s", "shard", 10 << 20);
        }
        assert_eq!(m.fan_out("c", "shard", [5 << 20; 3].into_iter()), Ok(3));
        assert!(m.shards.is_empty() && m.fan_out.is_empty());
    }
}
