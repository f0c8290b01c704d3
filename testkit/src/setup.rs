//! Setting up a test: writing records to a stream, waiting for it, and a consumer builder with test-friendly timings.

use std::time::Duration;

use bytes::Bytes;
use shardflow::kinesis::{KinesisApi, PutRecord, ShardInfo, StreamAdmin};
use shardflow::{Backend, CheckpointPolicy, Consumer, ConsumerBuilder};

/// Writes records with values `range`, partition keys `pk-{value % 64}`.
pub async fn produce(kinesis: &dyn KinesisApi, stream: &str, range: std::ops::Range<usize>) {
    let records: Vec<PutRecord> = range
        .map(|v| PutRecord {
            data: Bytes::from(v.to_string()),
            partition_key: format!("pk-{}", v % 64),
            explicit_hash_key: None,
        })
        .collect();
    put_all(kinesis, stream, records).await;
}

/// Writes one sentinel record into each of `shards` (by explicit hash key), with values
/// `first, first + 1, ...` in the order of `shards`, and returns those values.
///
/// A check that nothing was redelivered waits for the sentinels instead of sleeping:
/// within a shard records arrive in sequence order, so a redelivered record would have
/// come before its shard's sentinel.
pub async fn produce_sentinels(
    kinesis: &dyn KinesisApi,
    stream: &str,
    shards: &[ShardInfo],
    first: usize,
) -> Vec<usize> {
    let values: Vec<usize> = (first..first + shards.len()).collect();
    let records = shards
        .iter()
        .zip(&values)
        .map(|(shard, v)| PutRecord {
            data: Bytes::from(v.to_string()),
            partition_key: format!("sentinel-{v}"),
            explicit_hash_key: Some(shard.starting_hash_key.to_string()),
        })
        .collect();
    put_all(kinesis, stream, records).await;
    values
}

/// Writes `records`, retrying what a partial failure refused, until every one is stored.
pub async fn put_all(kinesis: &dyn KinesisApi, stream: &str, records: Vec<PutRecord>) {
    for chunk in records.chunks(500) {
        let mut pending: Vec<PutRecord> = chunk.to_vec();
        // Retry only what failed (partial failures), until everything is stored.
        for _ in 0..100 {
            if pending.is_empty() {
                break;
            }
            match kinesis.put_records(stream, &pending).await {
                Ok(outcomes) => {
                    pending = pending
                        .into_iter()
                        .zip(outcomes)
                        .filter(|(_, o)| matches!(o, shardflow::kinesis::PutOutcome::Failed { .. }))
                        .map(|(r, _)| r)
                        .collect();
                }
                Err(e) => eprintln!("put_records: {e}; retrying"),
            }
            if !pending.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert!(pending.is_empty(), "could not write every record");
    }
}

/// A consumer builder with test-friendly timings.
pub fn test_consumer(
    backend: impl Backend,
    stream: &str,
    group: &str,
    worker: &str,
) -> ConsumerBuilder {
    test_timings(
        Consumer::builder()
            .stream(stream)
            .group(group)
            .worker_id(worker)
            .backend(backend),
    )
}

/// The test-friendly timings of [`test_consumer`], for builders set up otherwise (for
/// example with several streams).
pub fn test_timings(builder: ConsumerBuilder) -> ConsumerBuilder {
    builder
        .idle_read_interval(Duration::from_millis(20))
        .take_interval(Duration::from_millis(300))
        .shard_sync_interval(Duration::from_millis(500))
        .lease_duration(Duration::from_secs(3))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(200))
        .checkpoint(CheckpointPolicy::Interval(Duration::from_millis(100)))
        .seed(7)
}

/// The open shards of `stream`, by hash-key range.
pub async fn open_shards(kinesis: &dyn KinesisApi, stream: &str) -> Vec<ShardInfo> {
    let mut open: Vec<ShardInfo> = kinesis
        .list_shards(stream)
        .await
        .unwrap()
        .into_iter()
        .filter(|s| !s.is_closed())
        .collect();
    open.sort_by_key(|s| s.starting_hash_key);
    open
}

/// Waits until `stream` is active (an emulator creates streams asynchronously).
pub async fn wait_until_active(kinesis: &dyn KinesisApi, stream: &str) {
    for _ in 0..200 {
        if !kinesis.is_updating(stream).await.unwrap() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("stream {stream} stayed UPDATING");
}

/// Splits the only shard of `stream` in the middle of its hash range, with records
/// `0..before` in the parent and `before..total` in the children; returns every shard.
pub async fn split_with_records(
    kinesis: &dyn StreamAdmin,
    stream: &str,
    before: usize,
    total: usize,
) -> (ShardInfo, Vec<ShardInfo>) {
    kinesis.create_stream(stream, 1).await.unwrap();
    let parent = open_shards(kinesis, stream).await.remove(0);
    produce(kinesis, stream, 0..before).await;
    kinesis
        .split_shard(stream, &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    produce(kinesis, stream, before..total).await;
    let shards = kinesis.list_shards(stream).await.unwrap();
    (parent, shards)
}
