//! The producer with KPL aggregation on the memory backend (paused clock): records packed
//! per shard, every answer naming the shard, sequence and sub-sequence number a reader
//! finds the record at, refused aggregates resent as their user records, each key's
//! order kept, a split while aggregating, and records too large to share an aggregate;
//! the per-shard rate limit against Kinesis' limits; a round trip producer to consumer
//! under the limits across a split; and the consumer's choices for user records read
//! from a shard that does not own them. The split while aggregating runs against the
//! Kinesis emulator too (`emulator`).

use testkit as common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use common::Limited;
use futures_util::stream::{FuturesUnordered, StreamExt};
use shardflow::aggregation::{deaggregate, Deaggregated, MisplacedUserRecords, MAGIC};
use shardflow::backend::Backend;
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, ShardInfo, StartingPosition, StreamAdmin,
};
use shardflow::lease::Checkpoint;
use shardflow::memory::{KinesisFaults, KinesisLimits};
use shardflow::producer::{Aggregation, MAX_RECORD_BYTES};
use shardflow::{
    Consumer, Memory, Message, Position, ProduceError, Producer, ProducerBuilder, ProducerRecord,
    SequenceNumber, ShutdownHandle, Stored,
};
use testkit::hooks::{Forward, ForwardKinesis};
use tower::{Service, ServiceExt};

const STREAM: &str = "out";

/// Forwards to the memory backend and keeps every entry it was asked to put (size and
/// the shard it was stored in, if it was).
struct Recording {
    memory: Memory,
    entries: Mutex<Vec<(usize, Option<String>)>>,
}

#[async_trait]
impl ForwardKinesis for Recording {
    fn inner(&self) -> &dyn KinesisApi {
        self.memory.streams().as_ref()
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

fn recording(memory: &Memory) -> Arc<Forward<Recording>> {
    Arc::new(Forward(Recording {
        memory: memory.clone(),
        entries: Mutex::default(),
    }))
}

/// Forwards to the memory backend, but ListShards answers only its first `answered`
/// calls and fails the others (counted), like a producer without the permission, or
/// (`hang`) never answers them, like a service that stopped answering.
struct FailingListings {
    memory: Memory,
    answered: usize,
    hang: bool,
    listings: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl ForwardKinesis for FailingListings {
    fn inner(&self) -> &dyn KinesisApi {
        self.memory.streams().as_ref()
    }
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        let n = self
            .listings
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if n < self.answered {
            return self.memory.streams().list_shards(stream).await;
        }
        if self.hang {
            return std::future::pending().await;
        }
        Err(KinesisError::Other(
            "AccessDeniedException: not authorized to perform kinesis:ListShards".into(),
        ))
    }
}

fn failing_listings(memory: &Memory, answered: usize) -> Arc<Forward<FailingListings>> {
    Arc::new(Forward(FailingListings {
        memory: memory.clone(),
        answered,
        hang: false,
        listings: Default::default(),
    }))
}

/// Counts ListShards calls; the first `answered` answer and the others never do.
fn hanging_listings(memory: &Memory, answered: usize) -> Arc<Forward<FailingListings>> {
    Arc::new(Forward(FailingListings {
        memory: memory.clone(),
        answered,
        hang: true,
        listings: Default::default(),
    }))
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

/// What a reader that filters like the KCL finds in the stream.
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
    /// The values of the user records in aggregates holding a misplaced one, which the
    /// KCL discards whole (they are not in `at` nor `per_shard`).
    discarded: Vec<usize>,
}

/// Reads every shard (open and closed) from the start and de-aggregates as the KCL
/// does: an aggregate holding a user record outside the hash range of the shard it was
/// read from is discarded whole (and counted).
async fn read_back(api: &dyn KinesisApi, stream: &str) -> ReadBack {
    let mut back = ReadBack {
        at: HashMap::new(),
        per_shard: Vec::new(),
        kinesis_records: 0,
        aggregates: 0,
        misplaced: 0,
        discarded: Vec::new(),
    };
    for shard in api.list_shards(stream).await.unwrap() {
        let mut iterator = api
            .shard_iterator(stream, &shard.shard_id, &StartingPosition::TrimHorizon)
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
                let misplaced = users
                    .iter()
                    .filter(|(_, _, hash, _)| {
                        let hash = hash.unwrap();
                        !(shard.starting_hash_key <= hash && hash <= shard.ending_hash_key)
                    })
                    .count();
                if misplaced > 0 {
                    back.misplaced += misplaced;
                    back.discarded.extend(users.iter().map(|u| u.3));
                    continue;
                }
                for (sub, key, _, value) in users {
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
    let back = read_back(memory.streams().as_ref(), STREAM).await;
    // Each user record lies in its shard's range (checked while reading), each answer
    // names its own place.
    assert_stored_once(n, &answers, &back);
    assert_placed(&back);
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
        let back = read_back(memory.streams().as_ref(), STREAM).await;
        assert_stored_once(n, &answers, &back);
        assert_placed(&back);
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
        let back = read_back(memory.streams().as_ref(), STREAM).await;
        assert_stored_once(n, &answers, &back);
        assert_placed(&back);
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
    let back = read_back(memory.streams().as_ref(), STREAM).await;
    // Aggregates put together before the producer saw the split land in one child with
    // user records of the other. A KCL reader discards them whole; the producer sent
    // their records again, packed for their own shards, and answered with those places.
    assert!(
        back.misplaced > 0,
        "the split caught no aggregate in flight: the test shows nothing"
    );
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

/// Regression: after a merge, aggregates packed for a parent land in the merged shard,
/// which owns all their records; they were sent again as if misplaced, so a KCL reader
/// had each of their records twice.
#[tokio::test(start_paused = true)]
async fn after_a_merge_aggregates_owned_by_their_shard_are_not_sent_again() {
    let memory = memory_with_stream(2).await;
    let api = recording(&memory);
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(api.clone())
        .aggregate(true)
        .ordered_per_key(true)
        .build()
        .unwrap();
    let n = 4_000;
    let key = |i: usize| format!("k{}", i % 300);
    let first = produce_in_order(&producer, (0..n / 2).map(|i| (i, record(i, key(i))))).await;
    let shards = memory.streams().list_shards(STREAM).await.unwrap();
    memory
        .streams()
        .merge_shards(STREAM, &shards[0].shard_id, &shards[1].shard_id)
        .await
        .unwrap();
    let second = produce_in_order(&producer, (n / 2..n).map(|i| (i, record(i, key(i))))).await;
    producer.close().limited().await;
    let answers: Vec<_> = first.into_iter().chain(second).collect();
    let back = read_back(memory.streams().as_ref(), STREAM).await;
    assert_stored_once(n, &answers, &back);
    assert_placed(&back);
    assert_in_order_per_key(&back);
    let merged = memory
        .streams()
        .list_shards(STREAM)
        .await
        .unwrap()
        .into_iter()
        .find(|s| s.ending_sequence_number.is_none())
        .unwrap();
    assert!(
        answers
            .iter()
            .any(|(_, a)| a.as_ref().is_ok_and(|s| s.shard_id == merged.shard_id)),
        "nothing went to the merged shard"
    );
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
    let back = read_back(memory.streams().as_ref(), STREAM).await;
    assert_stored_once(10, &answers, &back);
    assert_placed(&back);
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

/// Forwards to the memory backend and keeps the size of every PutRecords call it is
/// asked to make: entries, and bytes as Kinesis counts them (data plus partition key).
struct CallSizes {
    memory: Memory,
    calls: Mutex<Vec<(usize, usize)>>,
}

#[async_trait]
impl ForwardKinesis for CallSizes {
    fn inner(&self) -> &dyn KinesisApi {
        self.memory.streams().as_ref()
    }
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        let bytes = records
            .iter()
            .map(|r| r.data.len() + r.partition_key.len())
            .sum();
        self.calls.lock().unwrap().push((records.len(), bytes));
        self.memory.streams().put_records(stream, records).await
    }
}

/// A splitmix64 step: the test's fixed-seed generator.
fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Regression: with aggregation on and records carrying explicit hash keys (sizes
/// 900-999 bytes), a call grew past 5 MiB and Kinesis refused it whole: most records
/// ended `Failed`. The call's size was estimated per user record (its size plus 16),
/// while a record with an explicit hash key adds about 52 bytes to its aggregate (and
/// the first of an aggregate more). Now every call stays within its entries and bytes
/// by construction. The same records go at the default 5 MiB per call and at smaller
/// configured limits, where many more calls are put together, and each call is
/// checked against its limit.
#[tokio::test(start_paused = true)]
async fn calls_stay_within_their_byte_limit_whatever_explicit_hash_keys_add() {
    for (max_batch_bytes, seed) in [(5 * 1024 * 1024, 28), (10_000, 29), (100_000, 30)] {
        let n = 6_000;
        let memory = Memory::builder().limits(KinesisLimits::aws()).build();
        memory.streams().create_stream(STREAM, 8).await.unwrap();
        let api = Arc::new(Forward(CallSizes {
            memory: memory.clone(),
            calls: Mutex::default(),
        }));
        let producer = Producer::builder()
            .stream(STREAM)
            .kinesis(api.clone())
            .aggregate(true)
            .max_batch_bytes(max_batch_bytes)
            .max_attempts(1_000)
            .seed(seed)
            .build()
            .unwrap();
        let mut random = seed;
        let records: Vec<ProducerRecord> = (0..n)
            .map(|i| {
                let size = 900 + (next_random(&mut random) % 100) as usize;
                let hash_key = (u128::from(next_random(&mut random)) << 64)
                    | u128::from(next_random(&mut random));
                ProducerRecord::new(format!("{i:<size$}"), format!("k{i}"))
                    .with_explicit_hash_key(hash_key.to_string())
            })
            .collect();
        let answers = futures_util::stream::iter(records.into_iter().enumerate())
            .map(|(i, record)| {
                let p = producer.clone();
                async move { (i, p.oneshot(record).await) }
            })
            .buffer_unordered(n)
            .collect::<Vec<_>>()
            .limited()
            .await;
        producer.close().limited().await;

        let failed: Vec<_> = answers.iter().filter(|(_, a)| a.is_err()).collect();
        assert!(
            failed.is_empty(),
            "limit {max_batch_bytes}: {} of {n} records failed, the first: {:?}",
            failed.len(),
            failed.first()
        );
        let calls = api.0.calls.lock().unwrap().clone();
        for (entries, bytes) in &calls {
            assert!(*entries <= 500, "a call of {entries} entries");
            assert!(
                *bytes <= max_batch_bytes,
                "limit {max_batch_bytes}: a call of {bytes} bytes"
            );
        }
        let largest = calls.iter().map(|c| c.1).max().unwrap_or(0);
        assert!(
            largest * 5 > max_batch_bytes * 4,
            "limit {max_batch_bytes}: the workload never filled a call ({largest} bytes)"
        );
        // Every value once in the stream, at the place its answer names.
        let mut found: HashMap<(String, SequenceNumber, u64), usize> = HashMap::new();
        for shard in memory.streams().list_shards(STREAM).await.unwrap() {
            for r in memory.streams().records(STREAM, &shard.shard_id) {
                let sequence = r.sequence_number.clone();
                match deaggregate(r) {
                    Deaggregated::Plain(r) => {
                        found.insert((shard.shard_id.clone(), sequence, 0), value_of(&r.data));
                    }
                    Deaggregated::Aggregated { user_records, .. } => {
                        for u in user_records {
                            assert!(u.data.len() >= 900, "a payload lost bytes");
                            let at = (shard.shard_id.clone(), sequence.clone(), u.sub_sequence);
                            found.insert(at, value_of(&u.data));
                        }
                    }
                    Deaggregated::Corrupt { reason, .. } => {
                        panic!("corrupt aggregate: {reason}")
                    }
                }
            }
        }
        assert_eq!(found.len(), n, "user records in the stream");
        for (i, answer) in &answers {
            let stored = answer.as_ref().unwrap();
            let at = (
                stored.shard_id.clone(),
                stored.sequence_number.clone(),
                stored.sub_sequence_number,
            );
            assert_eq!(
                found.get(&at),
                Some(i),
                "record {i} is not where its answer says"
            );
        }
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
    let back = read_back(memory.streams().as_ref(), STREAM).await;
    assert_stored_once(n, &answers, &back);
    assert_placed(&back);
    let entries = api.entries.lock().unwrap();
    entries.iter().filter(|(_, shard)| shard.is_none()).count()
}

#[tokio::test(start_paused = true)]
async fn a_rate_limited_producer_waits_instead_of_collecting_refusals() {
    // Two seconds of the four shards' record quota.
    let n = 8_000;
    let unlimited = refused_at_the_limit(|b| b.no_rate_limit(), n).await;
    let at_quota = refused_at_the_limit(|b| b.rate_limit(100), n).await;
    let kpl_default = refused_at_the_limit(|b| b, n).await;
    assert!(unlimited > 1_000, "without a limit: {unlimited} refused");
    assert!(
        at_quota * 20 < unlimited,
        "at the quota: {at_quota} refused, without a limit {unlimited}"
    );
    // The default is the KPL's 150 %: on, and above the quota.
    assert!(
        kpl_default * 2 < unlimited,
        "by default (150 %): {kpl_default} refused, without a limit {unlimited}"
    );
    assert!(
        kpl_default > at_quota,
        "by default (150 %): {kpl_default} refused, at the quota {at_quota}"
    );
}

/// Regression: with the rate limit on, a large record over its shard's budget waited
/// while the smaller records behind it took every refill, so it was stored only once
/// they ran out (or never, under steady load), after records handed over later.
#[tokio::test(start_paused = true)]
async fn a_large_record_over_budget_is_not_overtaken_by_smaller_ones_of_its_shard() {
    let memory = memory_with_stream(1).await;
    let producer = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .build()
        .unwrap();
    let small = |i: usize| ProducerRecord::new(format!("{i:<1000}"), format!("k{i}"));
    // A second and a half of the shard's default budget, then the large record, then
    // four more seconds' worth of small ones, all handed over at once.
    let before = 1_500;
    let after = 6_000;
    let large = before;
    let records = (0..before)
        .map(|i| (i, small(i)))
        .chain(std::iter::once((
            large,
            ProducerRecord::new(vec![b'x'; 1_000_000], "large"),
        )))
        .chain((before + 1..=before + after).map(|i| (i, small(i))));
    let answers = produce_in_order(&producer, records).await;
    producer.close().limited().await;
    let stored: HashMap<usize, Stored> = answers
        .into_iter()
        .map(|(i, answer)| (i, answer.unwrap_or_else(|e| panic!("record {i}: {e}"))))
        .collect();
    let large_at = &stored[&large].sequence_number;
    let overtaken_by = (before + 1..=before + after)
        .filter(|i| stored[i].sequence_number < *large_at)
        .count();
    assert_eq!(
        overtaken_by, 0,
        "records handed over after the large one were stored before it"
    );
}

/// A shard waiting for most of a second of refill (a large record) does not hold the
/// records of other shards that arrive meanwhile.
#[tokio::test(start_paused = true)]
async fn a_shard_over_budget_does_not_hold_other_shards_records() {
    let memory = memory_with_stream(2).await;
    let producer = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .rate_limit(100)
        .build()
        .unwrap();
    let large = || ProducerRecord::new(vec![b'x'; 1_000_000], "large").with_explicit_hash_key("0");
    // The first takes the first shard's whole second of bytes; the second waits for it.
    producer.send(large()).limited().await.unwrap();
    let waiting = {
        let (producer, record) = (producer.clone(), large());
        tokio::spawn(async move { producer.send(record).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let start = tokio::time::Instant::now();
    let other = producer
        .send(record(1, "small").with_explicit_hash_key(u128::MAX.to_string()))
        .limited()
        .await
        .unwrap();
    let waited = start.elapsed();
    let large_at = waiting.limited().await.unwrap().unwrap();
    assert_ne!(other.shard_id, large_at.shard_id);
    assert!(
        waited < Duration::from_millis(200),
        "a record of another shard waited {waited:?}"
    );
    producer.close().limited().await;
}

/// Regression: with 12,000 records waiting for one shard (over its budget), a record
/// for an idle shard waited 8.76 s: the task stopped taking from its first-in first-out
/// channel at 2,500 held records and looked past at most 2,000 waiting ones. Now each
/// shard has its own room and queue: whatever one shard's backlog (12,000 plain records,
/// or 100,000 aggregated), another shard's record is stored within the linger, long
/// before the backlog is.
#[tokio::test(start_paused = true)]
async fn a_hot_shards_backlog_never_holds_another_shards_record() {
    for (aggregate, backlog) in [(false, 12_000), (true, 100_000)] {
        let memory = memory_with_stream(2).await;
        let producer = Producer::builder()
            .stream(STREAM)
            .backend(memory.clone())
            .aggregate(aggregate)
            .build()
            .unwrap();
        // Every record of the backlog for the first shard, handed over at once.
        let hot = {
            let producer = producer.clone();
            let records: Vec<_> = (0..backlog)
                .map(|i| record(i, format!("hot-{i}")).with_explicit_hash_key("0"))
                .collect();
            tokio::spawn(async move { producer.send_all(records).await })
        };
        // The backlog builds up (the shard takes 1,500 records/s at the default limit).
        tokio::time::sleep(Duration::from_millis(200)).await;
        let start = tokio::time::Instant::now();
        let idle = producer
            .send(record(backlog, "idle").with_explicit_hash_key(u128::MAX.to_string()))
            .limited()
            .await
            .unwrap();
        let waited = start.elapsed();
        assert!(
            !hot.is_finished(),
            "aggregate {aggregate}: the backlog was gone before the idle record was sent"
        );
        assert!(
            waited <= Duration::from_millis(60),
            "aggregate {aggregate}: a record of an idle shard waited {waited:?} behind \
             {backlog} records of another"
        );
        let answers = hot.limited().await.unwrap();
        let hot_shard = answers[0].as_ref().unwrap().shard_id.clone();
        assert_ne!(idle.shard_id, hot_shard);
        assert!(answers.iter().all(|a| a.is_ok()), "every hot record stored");
        producer.close().limited().await;
        let mut stored = 0;
        for shard in memory.streams().list_shards(STREAM).await.unwrap() {
            for r in memory.streams().records(STREAM, &shard.shard_id) {
                stored += deaggregate(r).message_count();
            }
        }
        assert_eq!(stored, backlog + 1, "aggregate {aggregate}: records stored");
    }
}

/// The first ListShards holds every send of a rate-limited producer: one that never
/// answers counts as failed after a while, and the records go (unlimited).
#[tokio::test(start_paused = true)]
async fn a_listing_that_never_answers_does_not_hold_the_records() {
    let memory = memory_with_stream(2).await;
    let api = hanging_listings(&memory, 0);
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(api.clone())
        .build()
        .unwrap();
    let start = tokio::time::Instant::now();
    let stored = producer.send(record(1, "k1")).limited().await;
    assert!(stored.is_ok(), "{stored:?}");
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "the record waited {:?} for the listing",
        start.elapsed()
    );
    producer.close().limited().await;
}

/// A rate-limited producer that does not aggregate predicts each record's shard too:
/// a record that lands elsewhere (a split it has not seen) has it list the shards again
/// at once, so that the children's budgets are charged, not the closed parent's until
/// the next periodic listing a minute later.
#[tokio::test(start_paused = true)]
async fn a_record_landing_in_an_unknown_shard_has_the_shards_listed_again() {
    let memory = memory_with_stream(1).await;
    let api = failing_listings(&memory, usize::MAX);
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(api.clone())
        .build()
        .unwrap();
    let start = tokio::time::Instant::now();
    for i in 0..20 {
        producer
            .send(record(i, format!("k{i}")))
            .limited()
            .await
            .unwrap();
    }
    let listed = || api.0.listings.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(listed(), 1);
    memory
        .split_shard_in_half(STREAM, "shardId-000000000000")
        .await
        .unwrap();
    for i in 20..40 {
        producer
            .send(record(i, format!("k{i}")))
            .limited()
            .await
            .unwrap();
    }
    common::within(Duration::from_secs(5), "a listing after the split", async {
        while listed() < 2 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(start.elapsed() < Duration::from_secs(30));
    producer.close().limited().await;
}

/// A payload that is already a KPL aggregate (built with the public `Aggregator`) goes
/// through a producer that does not aggregate exactly as it is, rate limit or not.
#[tokio::test(start_paused = true)]
async fn a_producer_that_does_not_aggregate_sends_a_prebuilt_aggregate_as_it_is() {
    let mut aggregator = shardflow::aggregation::Aggregator::new();
    for i in 0..3 {
        let user = PutRecord {
            data: format!("user-{i}").into(),
            partition_key: format!("k{i}"),
            explicit_hash_key: None,
        };
        assert!(aggregator.add(user).unwrap().is_none());
    }
    let prebuilt = aggregator.flush().unwrap();
    assert!(prebuilt.data.starts_with(&MAGIC));
    for configure in [(|b| b) as fn(ProducerBuilder) -> ProducerBuilder, |b| {
        b.no_rate_limit()
    }] {
        let memory = memory_with_stream(2).await;
        let producer = configure(Producer::builder().stream(STREAM).backend(memory.clone()))
            .build()
            .unwrap();
        let stored = producer
            .send(ProducerRecord::new(
                prebuilt.data.clone(),
                prebuilt.partition_key.clone(),
            ))
            .limited()
            .await
            .unwrap();
        producer.close().limited().await;
        let api = memory.streams();
        let iterator = api
            .shard_iterator(STREAM, &stored.shard_id, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        let page = api.get_records(&iterator, 10).await.unwrap();
        assert_eq!(page.records.len(), 1);
        assert_eq!(
            page.records[0].data, prebuilt.data,
            "the payload was rewritten"
        );
    }
}

/// What the round trip's handler saw, in order.
#[derive(Clone)]
struct Seen {
    shard: String,
    position: Position,
    key: String,
    value: usize,
}

/// A consumer of the round trip's stream on `memory`, recording into `seen`; the
/// aggregates a KCL reader discards are skipped the same way. With `stop_after`, once
/// that many records are seen it stops itself at the next user record that is not the
/// first of its aggregate, and handles slowly from then on, so that its drain ends
/// inside an aggregate.
fn round_trip_consumer(
    memory: &Memory,
    worker: &str,
    seen: &Arc<Mutex<Vec<Seen>>>,
    stop_after: Option<usize>,
) -> (tokio::task::JoinHandle<()>, ShutdownHandle) {
    let consumer = Consumer::builder()
        .stream(STREAM)
        .group("round-trip")
        .worker_id(worker)
        .seed(11)
        .misplaced_user_records(MisplacedUserRecords::SkipAggregate)
        .backend(memory.clone())
        .build()
        .unwrap();
    let shutdown = consumer.shutdown_handle();
    let stop = consumer.shutdown_handle();
    let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = seen.clone();
    let handler = tower::service_fn(move |msg: Message| {
        let slow = stopping.load(std::sync::atomic::Ordering::SeqCst);
        let mut seen = seen.lock().unwrap();
        seen.push(Seen {
            shard: msg.metadata.shard_id.to_string(),
            position: Position::new(
                msg.metadata.sequence_number.clone(),
                msg.metadata.sub_sequence_number,
            ),
            key: msg.metadata.partition_key.clone(),
            value: value_of(&msg.payload),
        });
        if stop_after.is_some_and(|n| seen.len() >= n) && msg.metadata.sub_sequence_number > 0 {
            stop.shutdown();
            stopping.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        async move {
            if slow {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
            Ok::<(), std::convert::Infallible>(())
        }
    });
    let run = consumer.run(handler);
    let task = tokio::spawn(async move { run.await.unwrap() });
    (task, shutdown)
}

async fn wait_until_seen(seen: &Arc<Mutex<Vec<Seen>>>, n: usize) {
    let wait = async {
        while seen.lock().unwrap().len() < n {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };
    wait.limited().await;
}

/// Producer to consumer, both under Kinesis' limits: 100,000 records of 100 bytes on
/// 1,000 keys, aggregated and ordered per key, with a split of a shard in the middle
/// and a consumer stopped and replaced part way. Every record is handled exactly once,
/// in order per key, and the stopped consumer's checkpoints point inside aggregates at
/// the last user record it handled (sub-sequence granularity), from where its
/// successor resumes.
#[tokio::test(start_paused = true)]
async fn a_round_trip_under_the_limits_with_a_split_handles_every_record_once_in_order() {
    let n = 100_000;
    let memory = Memory::builder().limits(KinesisLimits::aws()).build();
    memory.streams().create_stream(STREAM, 2).await.unwrap();
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(memory.streams().clone())
        .aggregate(true)
        .ordered_per_key(true)
        .seed(7)
        .build()
        .unwrap();
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let (first, _) = round_trip_consumer(&memory, "w1", &seen, Some(3 * n / 5));

    let key = |i: usize| format!("k{}", i % 1_000);
    let mut answers = produce_in_order(&producer, (0..n / 2).map(|i| (i, record(i, key(i))))).await;
    let shards = memory.streams().list_shards(STREAM).await.unwrap();
    let parent = &shards[0];
    let middle = parent.starting_hash_key / 2 + parent.ending_hash_key / 2;
    memory
        .streams()
        .split_shard(STREAM, &parent.shard_id, middle)
        .await
        .unwrap();
    answers.extend(produce_in_order(&producer, (n / 2..n).map(|i| (i, record(i, key(i))))).await);
    producer.close().limited().await;
    for (value, answer) in &answers {
        assert!(answer.is_ok(), "record {value} not stored: {answer:?}");
    }

    // The first consumer stops itself part way, inside an aggregate; its checkpoints
    // are where it stopped.
    first.limited().await.unwrap();
    let by_first = seen.lock().unwrap().clone();
    let rows = memory.lease_store("round-trip").list().await.unwrap();
    let mut inside_aggregates = 0;
    for row in &rows {
        let Checkpoint::At(at) = &row.checkpoint else {
            continue;
        };
        let last = by_first
            .iter()
            .rev()
            .find(|s| s.shard == row.key)
            .unwrap_or_else(|| panic!("{} checkpointed with nothing handled", row.key));
        assert_eq!(
            &last.position, at,
            "{}: the checkpoint is the last handled",
            row.key
        );
        if at.sub_sequence > 0 {
            inside_aggregates += 1;
        }
    }
    assert!(
        inside_aggregates > 0,
        "no checkpoint inside an aggregate: {:?}",
        rows.iter()
            .map(|r| r.checkpoint.to_string())
            .collect::<Vec<_>>()
    );

    // Its successor takes over from those checkpoints.
    let (second, stop_second) = round_trip_consumer(&memory, "w2", &seen, None);
    wait_until_seen(&seen, n).await;
    stop_second.shutdown();
    second.limited().await.unwrap();

    let seen = seen.lock().unwrap().clone();
    // The successor resumed inside an aggregate the first one had begun.
    let begun: std::collections::HashSet<(&str, &SequenceNumber)> = by_first
        .iter()
        .map(|s| (s.shard.as_str(), &s.position.sequence))
        .collect();
    assert!(
        seen[by_first.len()..]
            .iter()
            .any(|s| begun.contains(&(s.shard.as_str(), &s.position.sequence))),
        "no aggregate was handled partly by each consumer"
    );
    // Aggregates did land among records of another shard: the skipping was needed.
    memory.streams().set_limits(KinesisLimits::none());
    let back = read_back(memory.streams().as_ref(), STREAM).await;
    assert!(
        back.misplaced > 0,
        "the split caught no aggregate in flight: the test shows nothing"
    );
    let mut count = vec![0u32; n];
    for s in &seen {
        count[s.value] += 1;
    }
    let lost: Vec<usize> = (0..n).filter(|v| count[*v] == 0).collect();
    let twice: Vec<usize> = (0..n).filter(|v| count[*v] > 1).collect();
    assert!(
        lost.is_empty(),
        "{} lost, e.g. {:?}",
        lost.len(),
        &lost[..lost.len().min(5)]
    );
    assert!(
        twice.is_empty(),
        "{} twice, e.g. {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    let mut last: HashMap<&str, usize> = HashMap::new();
    for s in &seen {
        if let Some(previous) = last.insert(&s.key, s.value) {
            assert!(
                previous < s.value,
                "key {}: {} after {previous}",
                s.key,
                s.value
            );
        }
    }
    // Each handled record is where the producer said it stored it.
    let stored: HashMap<usize, &Stored> = answers
        .iter()
        .map(|(v, a)| (*v, a.as_ref().unwrap()))
        .collect();
    for s in &seen {
        let at = stored[&s.value];
        assert_eq!(
            (&at.shard_id, &at.sequence_number, at.sub_sequence_number),
            (&s.shard, &s.position.sequence, s.position.sub_sequence),
            "record {}",
            s.value
        );
    }
}

/// A consumer delivers or skips the user records of an aggregate that landed in a shard
/// not owning all of them, as `misplaced_user_records` says.
#[tokio::test(start_paused = true)]
async fn a_consumer_delivers_or_skips_misplaced_user_records_as_configured() {
    use shardflow::aggregation::Aggregator;
    use shardflow::kinesis::partition_hash;
    let memory = memory_with_stream(2).await;
    let shards = memory.streams().list_shards(STREAM).await.unwrap();
    let first = &shards[0];
    let in_first = |k: &String| {
        let h = partition_hash(k);
        first.starting_hash_key <= h && h <= first.ending_hash_key
    };
    // Ten keys, the first one of the first shard (the aggregate lands there).
    let mut keys: Vec<String> = (0..100).map(|i| format!("k{i}")).collect();
    let lead = keys.iter().position(in_first).unwrap();
    keys.swap(0, lead);
    keys.truncate(10);
    let owned: Vec<usize> = (0..10).filter(|i| in_first(&keys[*i])).collect();
    assert!(owned.len() < 10, "some keys belong to the other shard");
    let mut aggregator = Aggregator::new();
    for (value, key) in keys.iter().enumerate() {
        let put = PutRecord {
            data: format!("{value}").into(),
            partition_key: key.clone(),
            explicit_hash_key: None,
        };
        assert!(aggregator.add(put).unwrap().is_none());
    }
    let after = PutRecord {
        data: "1000".into(),
        partition_key: keys[0].clone(),
        explicit_hash_key: None,
    };
    let records = [aggregator.flush().unwrap(), after];
    for r in &records {
        memory
            .streams()
            .put_records(STREAM, std::slice::from_ref(r))
            .await
            .unwrap();
    }
    for (choice, expected) in [
        (MisplacedUserRecords::Deliver, (0..10).collect::<Vec<_>>()),
        (MisplacedUserRecords::SkipRecords, owned.clone()),
        (MisplacedUserRecords::SkipAggregate, vec![]),
    ] {
        let seen: Arc<Mutex<Vec<usize>>> = Arc::default();
        let consumer = Consumer::builder()
            .stream(STREAM)
            .group(format!("misplaced-{choice:?}"))
            .worker_id("w1")
            .misplaced_user_records(choice)
            .backend(memory.clone())
            .build()
            .unwrap();
        let shutdown = consumer.shutdown_handle();
        let record = seen.clone();
        let run = consumer.run(tower::service_fn(move |msg: Message| {
            record.lock().unwrap().push(value_of(&msg.payload));
            async { Ok::<(), std::convert::Infallible>(()) }
        }));
        let task = tokio::spawn(async move { run.await.unwrap() });
        let wait = async {
            while !seen.lock().unwrap().contains(&1000) {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        };
        wait.limited().await;
        shutdown.shutdown();
        task.limited().await.unwrap();
        let mut got = seen.lock().unwrap().clone();
        got.retain(|v| *v != 1000);
        got.sort_unstable();
        assert_eq!(got, expected, "{choice:?}");
    }
}

/// Regression: a producer without the `kinesis:ListShards` permission (aggregating or
/// rate-limited) listed again and warned every 100 ms for as long as it ran.
#[tokio::test(start_paused = true)]
async fn a_producer_that_cannot_list_shards_backs_off_and_still_stores_everything() {
    let memory = memory_with_stream(2).await;
    let api = failing_listings(&memory, 0);
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(api.clone())
        .aggregate(true)
        .build()
        .unwrap();
    let start = tokio::time::Instant::now();
    let mut answers = Vec::new();
    for minute_part in 0..60 {
        answers.extend(
            produce_in_order(
                &producer,
                (minute_part * 10..minute_part * 10 + 10).map(|i| (i, record(i, format!("k{i}")))),
            )
            .await,
        );
        tokio::time::sleep_until(start + std::time::Duration::from_secs(minute_part as u64 + 1))
            .await;
    }
    producer.close().limited().await;
    let back = read_back(memory.streams().as_ref(), STREAM).await;
    assert_stored_once(600, &answers, &back);
    assert_eq!(back.aggregates, 0, "unaggregated without a shard map");
    let listings = api.listings.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        listings <= 15,
        "{listings} ListShards calls in a minute: the failures were not backed off"
    );
}

/// Regression: aggregates that landed in a shard the map did not know waited for a
/// listing that knew it; with ListShards failing from then on they waited, and `close`
/// with them, for ever.
#[tokio::test(start_paused = true)]
async fn misplaced_aggregates_do_not_wait_for_ever_on_a_listing_that_keeps_failing() {
    let memory = memory_with_stream(2).await;
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(failing_listings(&memory, 1))
        .aggregate(true)
        .build()
        .unwrap();
    let key = |i: usize| format!("k{}", i % 300);
    let mut answers = produce_in_order(&producer, (0..1_000).map(|i| (i, record(i, key(i))))).await;
    let shards = memory.streams().list_shards(STREAM).await.unwrap();
    let parent = &shards[0];
    let middle = parent.starting_hash_key / 2 + parent.ending_hash_key / 2;
    memory
        .streams()
        .split_shard(STREAM, &parent.shard_id, middle)
        .await
        .unwrap();
    answers
        .extend(produce_in_order(&producer, (1_000..2_000).map(|i| (i, record(i, key(i))))).await);
    producer.close().limited().await;
    assert_eq!(answers.len(), 2_000, "every record answered");
    let misplaced = answers
        .iter()
        .filter(|(_, a)| matches!(a, Err(ProduceError::Failed { code, .. }) if code == "MisplacedAggregate"))
        .count();
    assert!(misplaced > 0, "the split caught aggregates in flight");
    for (value, answer) in &answers {
        assert!(
            answer.is_ok()
                || matches!(answer, Err(ProduceError::Failed { code, .. }) if code == "MisplacedAggregate"),
            "record {value}: {answer:?}"
        );
    }
}

/// The producer into the Kinesis emulator over HTTP (run by `scripts/test.sh`).
mod emulator {
    use super::*;
    use testkit::{emulators_enabled, unique};

    /// A split while aggregating, against Kinesis' own routing: aggregates packed for the
    /// parent land in one child with user records of the other, and their records go
    /// again; a reader that discards such aggregates as the KCL does finds every record
    /// once, where its answer says, in order per key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_split_while_aggregating_loses_nothing_and_stores_nothing_twice() {
        if !emulators_enabled() {
            return;
        }
        let aws = shardflow::Aws::from_env().await;
        let api = aws.admin().unwrap();
        let stream = unique("producer-agg-split");
        api.create_stream(&stream, 2).await.unwrap();
        let producer = Producer::builder()
            .stream(&stream)
            .backend(aws.clone())
            .aggregate(true)
            .ordered_per_key(true)
            .build()
            .unwrap();
        let n = 4_000;
        let first = produce_in_order(
            &producer,
            (0..n / 2).map(|i| (i, record(i, format!("k{}", i % 300)))),
        )
        .await;
        let shards = api.list_shards(&stream).await.unwrap();
        let parent = &shards[0];
        let middle = parent.starting_hash_key / 2 + parent.ending_hash_key / 2;
        // Returns once the stream is active again; the producer's map is stale.
        api.split_shard(&stream, &parent.shard_id, middle)
            .await
            .unwrap();
        let second = produce_in_order(
            &producer,
            (n / 2..n).map(|i| (i, record(i, format!("k{}", i % 300)))),
        )
        .await;
        producer.close().limited().await;
        let answers: Vec<_> = first.into_iter().chain(second).collect();
        let back = read_back(api.as_ref(), &stream).await;
        assert!(
            back.misplaced > 0,
            "no aggregate landed in a child that does not own all its records: the test shows nothing"
        );
        assert_stored_once(n, &answers, &back);
        assert_in_order_per_key(&back);
    }
}
