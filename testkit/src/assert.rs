//! Assertions on what handlers saw: exactly once, order per shard and per partition key.

use std::collections::{BTreeMap, HashMap, HashSet};

use shardflow::kinesis::ShardInfo;
use shardflow::lease::{Checkpoint, Lease};

use crate::Handled;

/// Asserts what a single-instance run must show: every value handled exactly once,
/// sequence order within each shard, and no child record handled before the last
/// record of each of its parents.
pub fn assert_exactly_once_in_order(handled: &[Handled], total: usize, shards: &[ShardInfo]) {
    let mut seen = HashSet::new();
    let duplicates: Vec<usize> = handled
        .iter()
        .filter(|h| !seen.insert(h.value))
        .map(|h| h.value)
        .collect();
    assert!(
        duplicates.is_empty(),
        "{} duplicates, e.g. {:?}",
        duplicates.len(),
        &duplicates[..duplicates.len().min(5)]
    );
    let missing: Vec<usize> = (0..total).filter(|v| !seen.contains(v)).collect();
    assert!(
        missing.is_empty(),
        "{} lost, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    assert_order(handled, shards);
}

/// Sequence order within each shard, and parents finished before children started.
pub fn assert_order(handled: &[Handled], shards: &[ShardInfo]) {
    let mut last: HashMap<&str, &shardflow::SequenceNumber> = HashMap::new();
    for h in handled {
        if let Some(prev) = last.insert(&h.shard, &h.sequence) {
            assert!(
                prev < &h.sequence,
                "shard {} went back from {prev} to {}",
                h.shard,
                h.sequence
            );
        }
    }
    let index_range = |shard: &str| {
        let idx: Vec<usize> = handled
            .iter()
            .enumerate()
            .filter(|(_, h)| h.shard == shard)
            .map(|(i, _)| i)
            .collect();
        idx.first().copied().zip(idx.last().copied())
    };
    for shard in shards {
        for parent in shard.parents() {
            if let (Some((_, parent_last)), Some((child_first, _))) =
                (index_range(&parent), index_range(&shard.shard_id))
            {
                assert!(
                    parent_last < child_first,
                    "child {} started (at #{child_first}) before parent {parent} finished (#{parent_last})",
                    shard.shard_id
                );
            }
        }
    }
}

/// Per partition key, values arrive in the order they were written (values ascend).
pub fn assert_partition_key_order(handled: &[Handled]) {
    let mut last: HashMap<&str, usize> = HashMap::new();
    for h in handled {
        if let Some(prev) = last.insert(&h.partition_key, h.value) {
            assert!(
                prev < h.value,
                "key {} went back from {prev} to {}",
                h.partition_key,
                h.value
            );
        }
    }
}

/// The checkpoint of every lease row, by shard.
pub fn checkpoints(rows: &[Lease]) -> BTreeMap<String, Checkpoint> {
    rows.iter()
        .map(|r| (r.key.clone(), r.checkpoint.clone()))
        .collect()
}

/// No value handled twice (a check for runs that may redeliver nothing).
pub fn assert_no_value_twice(handled: &[Handled]) {
    let mut seen = HashSet::new();
    let twice: Vec<usize> = handled
        .iter()
        .filter(|h| !seen.insert(h.value))
        .map(|h| h.value)
        .collect();
    assert!(
        twice.is_empty(),
        "{} records handled twice, e.g. {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
}
