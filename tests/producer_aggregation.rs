//! The producer with KPL aggregation on the memory backend (paused clock): records packed
//! per shard, every answer naming the shard, sequence and sub-sequence number a reader
//! finds the record at, refused aggregates resent as their user records, each key's
//! order kept, a split while aggregating, and records too large to share an aggregate;
//! and the per-shard rate limit against Kinesis' limits.

use testkit as common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use common::Limited;
use futures_util::stream::{FuturesUnordered, StreamExt};
use shardflow::aggregation::{deaggregate, Deaggregated, MAGIC};
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, RecordsPage, ShardInfo, StartingPosition,
    StreamAdmin,
};
use shardflow::memory::{KinesisFaults, KinesisLimits};
use shardflow::producer::{Aggregation, MAX_RECORD_BYTES};
use shardflow::{
    Memory, ProduceError, Producer, ProducerBuilder, ProducerRecord, SequenceNumber, Stored,
};
use tower::{Service, ServiceExt};

const STREAM: &str = "out";

/// Forwards to the memory backend and keeps every entry it was asked to put (size and
/// the shard it was stored in, if it was).
struct Recording {
    memory: Memory,
    entries: Mutex<Vec<(usize, Option<String>)>>,
}

#[async_trait]
impl KinesisApi for Recording {
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        self.memory.streams().list_shards(stream).await
    }
    async fn is_updating(&self, stream: &str) -> Result<bool, KinesisError> {
        self.memory.streams().is_updating(stream).await
    }
    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        self.memory
            .streams()
            .shard_iterator(stream, shard_id, from)
            .await
    }
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        self.memory.streams().get_records(iterator, limit).await
    }
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        let result = self.memory.streams().put_records(stream, records).await;
        if let Ok(outcomes) = &result {
            let mut entries = self.entries.lock().unwrap();
            for (record, outcome) in records.iter().zip(outcomes) {
                let shard = match outcome {
                    PutOutcome::Stored { shard_id, .. } => Some(shard_id.clone()),
                    PutOutcome::Failed { .. } => None,
                };
                entries.push((record.data.len() + record.partition_key.len(), shard));
            }
        }
        result
    }
}

fn recording(memory: &Memory) -> Arc<Recording> {
    Arc::new(Recording {
        memory: memory.clone(),
        entries: Mutex::default(),
    })
}

async fn memory_with_stream(shards: u32) -> Memory {
    let memory = Memory::new();
    memory
        .streams()
        .create_stream(STREAM, shards)
        .await
        .unwrap();
    memory
}

/// A 100-byte payload that starts with its value.
fn record(value: usize, key: impl Into<String>) -> ProducerRecord {
    ProducerRecord::new(format!("{value:<100}"), key)
}

fn value_of(data: &[u8]) -> usize {
    std::str::from_utf8(data)
        .unwrap()
        .trim_end()
        .parse()
        .unwrap()
}

/// What a reader finds in the stream.
struct ReadBack {
    /// (shard, sequence, sub-sequence) -> (partition key, value)
    at: HashMap<(String, SequenceNumber, u64), (String, usize)>,
    /// Per shard, the user records in reading order.
    per_shard: Vec<Vec<(String, usize)>>,
    /// Kinesis records (aggregates count one) and how many of them were aggregates.
    kinesis_records: usize,
    aggregates: usize,
    /// User records read from a shard whose hash-key range does not hold theirs.
    misplaced: usize,
}

/// Reads every shard (open and closed) from the start and de-aggregates; counts the
/// user records outside the hash range of the shard they were read from.
async fn read_back(api: &dyn KinesisApi) -> ReadBack {
    let mut back = ReadBack {
        at: HashMap::new(),
        per_shard: Vec::new(),
        kinesis_records: 0,
        aggregates: 0,
        misplaced: 0,
    };
    for shard in api.list_shards(STREAM).await.unwrap() {
        let mut iterator = api
            .shard_iterator(STREAM, &shard.shard_id, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        let mut in_order = Vec::new();
        loop {
            let page = api.get_records(&iterator, 10_000).await.unwrap();
            if page.records.is_empty() {
                break;
            }
            for r in page.records {
                back.kinesis_records += 1;
                let sequence = r.sequence_number.clone();
                let users: Vec<(u64, String, Option<u128>, usize)> = match deaggregate(r) {
                    Deaggregated::Plain(r) => {
                        assert!(r.data.len() + r.partition_key.len() <= MAX_RECORD_BYTES);
                        let hash = shardflow::kinesis::partition_hash(&r.partition_key);
                        vec![(0, r.partition_key, Some(hash), value_of(&r.data))]
                    }
                    Deaggregated::Aggregated { user_records, .. } => {
                        back.aggregates += 1;
                        user_records
                            .into_iter()
                            .map(|u| {
                                let hash = u.hash_key();
                                (u.sub_sequence, u.partition_key, hash, value_of(&u.data))
                            })
                            .collect()
                    }
                    Deaggregated::Corrupt { reason, .. } => panic!("corrupt aggregate: {reason}"),
                };
                for (sub, key, hash, value) in users {
                    let hash = hash.unwrap();
                    if !(shard.starting_hash_key <= hash && hash <= shard.ending_hash_key) {
                        back.misplaced += 1;
                    }
                    in_order.push((key.clone(), value));
                    let previous = back.at.insert(
                        (shard.shard_id.clone(), sequence.clone(), sub),
                        (key, value),
                    );
                    assert!(previous.is_none(), "a position was read twice");
                }
            }
            match page.next_iterator {
                Some(next) => iterator = next,
                None => break,
            }
        }
        back.per_shard.push(in_order);
    }
    back
}

/// Every value 0..n was read exactly once, at the place its answer names.
fn assert_stored_once(
    n: usize,
    answers: &[(usize, Result<Stored, ProduceError>)],
    back: &ReadBack,
) {
    assert_eq!(back.at.len(), n, "user records in the stream");
    assert_placed(back);
    let mut seen = vec![false; n];
    for (_, value) in back.at.values() {
        assert!(!seen[*value], "value {value} stored twice");
        seen[*value] = true;
    }
    assert_eq!(answers.len(), n);
    for (value, answer) in answers {
        let stored = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("record {value} failed: {e}"));
        let key = (
            stored.shard_id.clone(),
            stored.sequence_number.clone(),
            stored.sub_sequence_number,
        );
        let (_, found) = back
            .at
            .get(&key)
            .unwrap_or_else(|| panic!("record {value}: nothing at {stored:?}"));
        assert_eq!(found, value, "the answer of {value} points at {found}");
    }
}

/// Every user record is in the shard its hash key routes to.
fn assert_placed(back: &ReadBack) {
    assert_eq!(
        back.misplaced, 0,
        "user records outside their shard's range"
    );
}

/// Hands the records over in order through one handle, then waits for every answer.
async fn produce_in_order(
    producer: &Producer,
    records: impl IntoIterator<Item = (usize, ProducerRecord)>,
) -> Vec<(usize, Result<Stored, ProduceError>)> {
    let mut handle = producer.clone();
    let pending = FuturesUnordered::new();
    for (value, record) in records {
        handle.ready().limited().await.unwrap();
        let answer = handle.call(record);
        pending.push(async move { (value, answer.limited().await) });
    }
    pending.collect::<Vec<_>>().limited().await
}

/// Per shard, each key's values are read in increasing order.
fn assert_in_order_per_key(back: &ReadBack) {
    for shard in &back.per_shard {
        let mut last: BTreeMap<&str, usize> = BTreeMap::new();
        for (key, value) in shard {
            if let Some(previous) = last.insert(key, *value) {
                assert!(
                    previous < *value,
                    "key {key}: {value} read after {previous}"
                );
            }
        }
    }
}

#[tokio::test(start_paused = true)]
async fn records_are_packed_per_shard_and_answers_name_their_sub_sequence() {
    let memory = memory_with_stream(4).await;
    let api = recording(&memory);
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(api.clone())
        .aggregate(true)
        .build()
        .unwrap();
    let n = 20_000;
    let answers = produce_in_order(
        &producer,
        (0..n).map(|i| (i, record(i, format!("key-{}", i % 1_000)))),
    )
    .await;
    producer.close().limited().await;
    let back = read_back(memory.streams().as_ref()).await;
    // Each user record lies in its shard's range (checked while reading), each answer
    // names its own place.
    assert_stored_once(n, &answers, &back);
    assert!(
        answers
            .iter()
            .any(|(_, a)| a.as_ref().is_ok_and(|s| s.sub_sequence_number > 100)),
        "records share aggregates"
    );
    // 100-byte records in aggregates of at most 51,200 bytes: ~450 per aggregate.
    assert!(
        back.kinesis_records * 100 < n * 2,
        "{} Kinesis records for {n} user records",
        back.kinesis_records
    );
    let entries = api.entries.lock().unwrap();
    assert!(entries.iter().all(|(size, _)| *size <= 51_200));
}

#[tokio::test(start_paused = true)]
async fn refused_aggregates_resend_their_records_and_each_caller_sees_its_own() {
    for seed in [1, 2, 3] {
        let memory = memory_with_stream(4).await;
        memory.streams().set_faults(KinesisFaults {
            put_entry_failure: 0.3,
            throttle: 0.1,
            seed,
            ..Default::default()
        });
        let producer = Producer::builder()
            .stream(STREAM)
            .backend(memory.clone())
            .aggregation(Aggregation::new().max_size(5_000))
            .max_attempts(100)
            .seed(seed)
            .build()
            .unwrap();
        let n = 5_000;
        let answers = futures_util::stream::iter(0..n)
            .map(|i| {
                let p = producer.clone();
                async move { (i, p.oneshot(record(i, format!("key-{}", i % 101))).await) }
            })
            .buffer_unordered(n)
            .collect::<Vec<_>>()
            .limited()
            .await;
        producer.close().limited().await;
        memory.streams().set_faults(KinesisFaults::default());
        let back = read_back(memory.streams().as_ref()).await;
        assert_stored_once(n, &answers, &back);
        assert!(back.aggregates > 0);
    }
}

#[tokio::test(start_paused = true)]
async fn each_keys_order_holds_across_aggregation_and_refusals() {
    for seed in [11, 12] {
        let memory = memory_with_stream(4).await;
        memory.streams().set_faults(KinesisFaults {
            put_entry_failure: 0.2,
            throttle: 0.05,
            seed,
            ..Default::default()
        });
        let producer = Producer::builder()
            .stream(STREAM)
            .backend(memory.clone())
            .aggregate(true)
            .ordered_per_key(true)
            .max_attempts(100)
            .seed(seed)
            .build()
            .unwrap();
        let n = 6_000;
        let answers = produce_in_order(
            &producer,
            (0..n).map(|i| (i, record(i, format!("k{}", i % 40)))),
        )
        .await;
        producer.close().limited().await;
        memory.streams().set_faults(KinesisFaults::default());
        let back = read_back(memory.streams().as_ref()).await;
        assert_stored_once(n, &answers, &back);
        assert_in_order_per_key(&back);
        assert!(back.aggregates > 0);
    }
}

#[tokio::test(start_paused = true)]
async fn a_split_while_aggregating_loses_nothing_and_stores_nothing_twice() {
    let memory = memory_with_stream(2).await;
    let api = recording(&memory);
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(api.clone())
        .aggregate(true)
        .ordered_per_key(true)
        .build()
        .unwrap();
    let n = 10_000;
    let first = produce_in_order(
        &producer,
        (0..n / 2).map(|i| (i, record(i, format!("k{}", i % 300)))),
    )
    .await;
    // Split the first shard in the middle of its range; the producer's map is stale.
    let shards = memory.streams().list_shards(STREAM).await.unwrap();
    let parent = &shards[0];
    let middle = parent.starting_hash_key / 2 + parent.ending_hash_key / 2;
    memory
        .streams()
        .split_shard(STREAM, &parent.shard_id, middle)
        .await
        .unwrap();
    let second = produce_in_order(
        &producer,
        (n / 2..n).map(|i| (i, record(i, format!("k{}", i % 300)))),
    )
    .await;
    producer.close().limited().await;
    let answers: Vec<_> = first.into_iter().chain(second).collect();
    let mut back = read_back(memory.streams().as_ref()).await;
    // Aggregates put together before the producer saw the split land in one child
    // with user records of the other (a reader delivers them all); the first answer
    // that names a child refreshes the map, so only the first aggregates after the
    // split can be like that (300 keys: one record each per round trip).
    assert!(
        back.misplaced < 300,
        "{} user records in the wrong child",
        back.misplaced
    );
    back.misplaced = 0;
    assert_stored_once(n, &answers, &back);
    assert_in_order_per_key(&back);
    // Records went to the children after the split.
    let open: Vec<String> = memory
        .streams()
        .list_shards(STREAM)
        .await
        .unwrap()
        .into_iter()
        .filter(|s| s.ending_sequence_number.is_none() && s.parent_shard_id.is_some())
        .map(|s| s.shard_id)
        .collect();
    assert_eq!(open.len(), 2);
    for child in &open {
        assert!(
            answers
                .iter()
                .any(|(_, a)| a.as_ref().is_ok_and(|s| &s.shard_id == child)),
            "nothing went to {child}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn records_too_large_to_share_an_aggregate_go_alone() {
    let memory = memory_with_stream(1).await;
    let api = recording(&memory);
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(api.clone())
        .aggregate(true)
        .build()
        .unwrap();
    // The largest record Kinesis takes, one over the aggregate size, and small ones
    // around them.
    let key = "k";
    let largest = MAX_RECORD_BYTES - key.len();
    let payloads: Vec<Vec<u8>> = (0..10)
        .map(|i| {
            let len = match i {
                3 => largest,
                6 => 60_000,
                _ => 100,
            };
            let mut data = format!("{i:<100}").into_bytes();
            data.resize(len, b' ');
            data
        })
        .collect();
    let answers = produce_in_order(
        &producer,
        payloads
            .into_iter()
            .enumerate()
            .map(|(i, data)| (i, ProducerRecord::new(data, key))),
    )
    .await;
    producer.close().limited().await;
    let back = read_back(memory.streams().as_ref()).await;
    assert_stored_once(10, &answers, &back);
    let entries = api.entries.lock().unwrap();
    assert!(entries.iter().all(|(size, _)| *size <= MAX_RECORD_BYTES));
    for big in [3, 6] {
        let (_, answer) = answers.iter().find(|(v, _)| *v == big).unwrap();
        let stored = answer.as_ref().unwrap();
        assert_eq!(stored.sub_sequence_number, 0, "record {big} went alone");
        let raw = memory.streams().records(STREAM, &stored.shard_id);
        let alone = raw
            .iter()
            .find(|r| r.sequence_number == stored.sequence_number)
            .unwrap();
        assert!(!alone.data.starts_with(&MAGIC), "sent as a plain record");
    }
}

/// Writes `n` 100-byte records as fast as the producer takes them into a 4-shard
/// stream with Kinesis' limits on; returns the entries Kinesis refused.
async fn refused_at_the_limit(
    configure: fn(ProducerBuilder) -> ProducerBuilder,
    n: usize,
) -> usize {
    let memory = Memory::builder().limits(KinesisLimits::aws()).build();
    memory.streams().create_stream(STREAM, 4).await.unwrap();
    let api = recording(&memory);
    let producer = configure(
        Producer::builder()
            .stream(STREAM)
            .kinesis(api.clone())
            .max_attempts(1_000)
            .seed(5),
    )
    .build()
    .unwrap();
    let answers = futures_util::stream::iter(0..n)
        .map(|i| {
            let p = producer.clone();
            async move { (i, p.oneshot(record(i, format!("key-{}", i % 1_000))).await) }
        })
        .buffer_unordered(n)
        .collect::<Vec<_>>()
        .limited()
        .await;
    producer.close().limited().await;
    let back = read_back(memory.streams().as_ref()).await;
    assert_stored_once(n, &answers, &back);
    let entries = api.entries.lock().unwrap();
    entries.iter().filter(|(_, shard)| shard.is_none()).count()
}

#[tokio::test(start_paused = true)]
async fn a_rate_limited_producer_waits_instead_of_collecting_refusals() {
    // Two seconds of the four shards' record quota.
    let n = 8_000;
    let unlimited = refused_at_the_limit(|b| b, n).await;
    let at_quota = refused_at_the_limit(|b| b.rate_limit(100), n).await;
    let kpl_default = refused_at_the_limit(|b| b.rate_limit(150), n).await;
    assert!(unlimited > 1_000, "without a limit: {unlimited} refused");
    assert!(
        at_quota * 20 < unlimited,
        "at the quota: {at_quota} refused, without a limit {unlimited}"
    );
    assert!(
        kpl_default < unlimited,
        "at 150 %: {kpl_default} refused, without a limit {unlimited}"
    );
}
