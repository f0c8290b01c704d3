//! The stream's open shards by hash-key range, as the producer last listed them: which
//! shard a record will land in, so that aggregation packs only records of one shard
//! together.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::time::Instant;

use crate::kinesis::{partition_hash, PutRecord, ShardInfo};

/// The open shards' hash-key ranges, sorted by their start.
pub(crate) struct ShardMap {
    /// `(starting hash key, ending hash key, shard id)`, both ends inclusive.
    ranges: Vec<(u128, u128, Arc<str>)>,
    /// Every listed shard's range, closed ones too, by id.
    known: HashMap<String, (u128, u128)>,
    /// When ListShards answered.
    pub(crate) fetched: Instant,
}

impl ShardMap {
    /// The map of the open shards among `shards` (closed ones take no writes).
    pub(crate) fn new(shards: &[ShardInfo], fetched: Instant) -> Self {
        let mut ranges: Vec<(u128, u128, Arc<str>)> = shards
            .iter()
            .filter(|s| s.ending_sequence_number.is_none())
            .map(|s| {
                (
                    s.starting_hash_key,
                    s.ending_hash_key,
                    Arc::from(s.shard_id.as_str()),
                )
            })
            .collect();
        ranges.sort_unstable_by_key(|r| r.0);
        let known = shards
            .iter()
            .map(|s| (s.shard_id.clone(), (s.starting_hash_key, s.ending_hash_key)))
            .collect();
        ShardMap {
            ranges,
            known,
            fetched,
        }
    }

    /// How many open shards the map knows.
    pub(crate) fn len(&self) -> usize {
        self.ranges.len()
    }

    /// The index and id of the shard whose range holds `hash`; `None` when no open
    /// shard's does (a gap while the stream is resharded: the map is stale).
    pub(crate) fn shard_of(&self, hash: u128) -> Option<(usize, &Arc<str>)> {
        let after = self.ranges.partition_point(|r| r.0 <= hash);
        let index = after.checked_sub(1)?;
        let (_, end, id) = self.ranges.get(index)?;
        (hash <= *end).then_some((index, id))
    }

    /// The hash-key range of shard `id` (open or closed); `None` when the listing did
    /// not show it (the shard is newer than the map).
    pub(crate) fn range_of(&self, id: &str) -> Option<(u128, u128)> {
        self.known.get(id).copied()
    }

    /// Whether shard `id` is open in the listing: the open shard holding the start of
    /// its range is itself (a closed shard's start lies in a child's or a merged one's).
    pub(crate) fn is_open(&self, id: &str) -> bool {
        self.range_of(id)
            .and_then(|(start, _)| self.shard_of(start))
            .is_some_and(|(_, open)| &**open == id)
    }

    /// Whether the listing showed shard `id`.
    pub(crate) fn knows(&self, id: &str) -> bool {
        self.known.contains_key(id)
    }
}

/// The hash key Kinesis routes `record` by: its explicit hash key, or the MD5 of its
/// partition key. `None` for an explicit hash key that is not a number in `0..2^128`
/// (refused before a record is buffered, so not expected here).
pub(crate) fn hash_key(record: &PutRecord) -> Option<u128> {
    match &record.explicit_hash_key {
        Some(ehk) => ehk.parse().ok(),
        None => Some(partition_hash(&record.partition_key)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(id: &str, start: u128, end: u128, closed: bool) -> ShardInfo {
        ShardInfo {
            shard_id: id.into(),
            parent_shard_id: None,
            adjacent_parent_shard_id: None,
            starting_hash_key: start,
            ending_hash_key: end,
            starting_sequence_number: "1".parse().unwrap(),
            ending_sequence_number: closed.then(|| "9".parse().unwrap()),
        }
    }

    #[test]
    fn a_hash_maps_to_the_open_shard_whose_range_holds_it() {
        let map = ShardMap::new(
            &[
                shard("b", 100, u128::MAX, false),
                shard("parent", 0, 99, true),
                shard("a", 0, 49, false),
            ],
            Instant::now(),
        );
        assert_eq!(map.len(), 2);
        let id = |h| map.shard_of(h).map(|(_, s)| s.to_string());
        assert_eq!(id(0).as_deref(), Some("a"));
        assert_eq!(id(49).as_deref(), Some("a"));
        assert_eq!(
            id(50),
            None,
            "a gap: the child covering it is not listed yet"
        );
        assert_eq!(id(100).as_deref(), Some("b"));
        assert_eq!(id(u128::MAX).as_deref(), Some("b"));
        assert!(map.is_open("a") && map.is_open("b"));
        assert!(!map.is_open("parent"), "closed, though listed");
        assert!(!map.is_open("unlisted"));
    }
}

/// Kinesis' write quota of one shard: 1,000 records and 1 MiB per second.
const SHARD_RECORDS_PER_SECOND: f64 = 1_000.0;
const SHARD_BYTES_PER_SECOND: f64 = 1_048_576.0;

/// The rate the producer allows itself per shard: a share of the shard's quota.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RateLimit {
    records: f64,
    bytes: f64,
}

impl RateLimit {
    /// `percent` of a shard's quota per second.
    pub(crate) fn percent(percent: u32) -> Self {
        let share = f64::from(percent) / 100.0;
        RateLimit {
            records: SHARD_RECORDS_PER_SECOND * share,
            bytes: SHARD_BYTES_PER_SECOND * share,
        }
    }
}

/// A token bucket of records and bytes for one shard, holding at most one second of
/// its rate, on tokio's clock (so it runs under the paused clock in tests).
pub(crate) struct ShardBudget {
    records: f64,
    bytes: f64,
    at: Instant,
}

impl ShardBudget {
    /// A full bucket.
    pub(crate) fn new(limit: &RateLimit, now: Instant) -> Self {
        ShardBudget {
            records: limit.records,
            bytes: limit.bytes,
            at: now,
        }
    }

    fn refill(&mut self, limit: &RateLimit, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.records = (self.records + elapsed * limit.records).min(limit.records);
        self.bytes = (self.bytes + elapsed * limit.bytes).min(limit.bytes);
        self.at = now;
    }

    /// Takes `records` and `bytes` if the bucket holds them; else returns when it
    /// will. A cost above a full bucket's (a record larger than a second's bytes, on a
    /// stream set for large records) needs a full bucket and is taken in full: the
    /// bucket goes below zero and the shard waits until the burst is paid back, as
    /// Kinesis itself averages a shard's writes to its rate.
    pub(crate) fn take(
        &mut self,
        limit: &RateLimit,
        records: f64,
        bytes: f64,
        now: Instant,
    ) -> Result<(), Instant> {
        self.refill(limit, now);
        let (cost_records, cost_bytes) = (records, bytes);
        let records = records.min(limit.records);
        let bytes = bytes.min(limit.bytes);
        if self.records >= records && self.bytes >= bytes {
            self.records -= cost_records;
            self.bytes -= cost_bytes;
            return Ok(());
        }
        let wait = ((records - self.records) / limit.records)
            .max((bytes - self.bytes) / limit.bytes)
            .max(0.0);
        Err(now + std::time::Duration::from_secs_f64(wait.min(1.0)))
    }

    /// Empties the bucket: Kinesis refused an entry for throughput, so the shard is
    /// busier than the bucket thought (other producers write to it too).
    pub(crate) fn drain(&mut self, limit: &RateLimit, now: Instant) {
        self.refill(limit, now);
        self.records = 0.0;
        self.bytes = 0.0;
    }
}

#[cfg(test)]
mod budget_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn a_budget_gives_a_second_of_its_rate_then_refills_with_time() {
        let limit = RateLimit::percent(150);
        let start = Instant::now();
        let mut budget = ShardBudget::new(&limit, start);
        for _ in 0..1_500 {
            assert!(budget.take(&limit, 1.0, 10.0, start).is_ok());
        }
        let ready = budget.take(&limit, 1.0, 10.0, start).unwrap_err();
        assert!(ready > start && ready <= start + Duration::from_millis(1));
        let later = start + Duration::from_millis(100);
        for _ in 0..150 {
            assert!(budget.take(&limit, 1.0, 10.0, later).is_ok());
        }
        assert!(budget.take(&limit, 1.0, 10.0, later).is_err());
        // Bytes count as well; a cost above a full bucket needs a full bucket.
        let mut budget = ShardBudget::new(&RateLimit::percent(50), start);
        assert!(budget
            .take(&RateLimit::percent(50), 0.0, 1e9, start)
            .is_ok());
        assert!(budget
            .take(&RateLimit::percent(50), 0.0, 1.0, start)
            .is_err());
        budget.drain(&RateLimit::percent(50), start);
    }

    #[test]
    fn a_record_above_a_seconds_bytes_is_paid_back_before_the_next() {
        let limit = RateLimit::percent(100);
        let start = Instant::now();
        let mut budget = ShardBudget::new(&limit, start);
        let nine_mib = 9.0 * SHARD_BYTES_PER_SECOND;
        assert!(budget.take(&limit, 1.0, nine_mib, start).is_ok());
        // A full bucket paid one second of it: eight more seconds of the rate, and the
        // next record waits until they have passed.
        let later = start + Duration::from_millis(7_900);
        assert!(budget.take(&limit, 1.0, 100.0, later).is_err());
        let paid = start + Duration::from_millis(8_100);
        assert!(budget.take(&limit, 1.0, 100.0, paid).is_ok());
    }
}
