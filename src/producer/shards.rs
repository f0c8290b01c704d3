//! The stream's open shards by hash-key range, as the producer last listed them: which
//! shard a record will land in, so that aggregation packs only records of one shard
//! together.

use std::sync::Arc;

use tokio::time::Instant;

use crate::kinesis::{partition_hash, PutRecord, ShardInfo};

/// The open shards' hash-key ranges, sorted by their start.
pub(crate) struct ShardMap {
    /// `(starting hash key, ending hash key, shard id)`, both ends inclusive.
    ranges: Vec<(u128, u128, Arc<str>)>,
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
        ShardMap { ranges, fetched }
    }

    /// How many open shards the map knows.
    pub(crate) fn len(&self) -> usize {
        self.ranges.len()
    }

    /// The index of the shard whose range holds `hash`; `None` when no open shard's
    /// does (a gap while the stream is resharded: the map is stale).
    pub(crate) fn shard_of(&self, hash: u128) -> Option<usize> {
        let after = self.ranges.partition_point(|r| r.0 <= hash);
        let index = after.checked_sub(1)?;
        let (_, end, _) = self.ranges.get(index)?;
        (hash <= *end).then_some(index)
    }

    /// The id of shard `index`.
    pub(crate) fn id(&self, index: usize) -> Option<&Arc<str>> {
        self.ranges.get(index).map(|r| &r.2)
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
        let id = |h| {
            map.shard_of(h)
                .and_then(|i| map.id(i))
                .map(|s| s.to_string())
        };
        assert_eq!(id(0).as_deref(), Some("a"));
        assert_eq!(id(49).as_deref(), Some("a"));
        assert_eq!(
            id(50),
            None,
            "a gap: the child covering it is not listed yet"
        );
        assert_eq!(id(100).as_deref(), Some("b"));
        assert_eq!(id(u128::MAX).as_deref(), Some("b"));
    }
}
