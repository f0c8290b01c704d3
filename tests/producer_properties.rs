//! Properties of the producer over generated workloads, on the embedded backend with
//! Kinesis' limits on and tokio's paused clock: record sizes from a few bytes (each
//! payload starts with its record's 8-byte index) to the record limit,
//! partition keys and explicit hash keys, aggregation on or off, the per-shard rate limit
//! on or off, ordered or not, partial failures and throttled calls, a split or a merge
//! while records flow, and a `close` or the last handle dropped while calls are in
//! flight. Whatever the workload:
//!
//! * every PutRecords call holds at most 500 entries and 5 MiB (data plus partition
//!   keys), and no more than the producer's `max_batch_records` and `max_batch_bytes`
//!   (also generated) allow, a single larger record alone excepted; every entry fits
//!   the stream's record limit;
//! * every KPL aggregate sent fits the aggregation's size limit, and every aggregate an
//!   answer points at holds only records of the shard it is stored in;
//! * every record answered `Ok` is stored where its answer says (shard, sequence number,
//!   sub-sequence number), byte for byte, with its partition key;
//! * a record answered `Closed` or refused before sending is nowhere in the stream;
//! * in ordered mode, each partition key's records answered `Ok` are stored in the order
//!   they entered the producer, and no record of a key is stored after a record of that
//!   key that finally failed (they are answered `AfterFailure`, unsent);
//! * nothing hangs: every answer comes within a bound on tokio's clock.
//!
//! The cases are drawn from a fixed seed, so the same build and case count always draw
//! the same cases; `PRODUCER_PROPERTIES_CASES` sets how many (default 24, about 5 s of
//! CPU), e.g. `PRODUCER_PROPERTIES_CASES=2000` for a long run. A failing case is shrunk
//! and printed as a `Workload`; one worth keeping becomes a named test like
//! `aggregated_records_with_explicit_hash_keys_fill_calls_within_5_mib`.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use rand::{Rng, SeedableRng};
use shardflow::aggregation::{deaggregate, Deaggregated, MAGIC};
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, Record, ShardInfo, StreamAdmin,
};
use shardflow::memory::{KinesisFaults, KinesisLimits};
use shardflow::producer::{Aggregation, MAX_BATCH_BYTES, MAX_BATCH_RECORDS, MAX_RECORD_BYTES};
use shardflow::{Memory, ProduceError, Producer, ProducerRecord, SequenceNumber, Stored};
use testkit::hooks::{Forward, ForwardKinesis};
use tower::{Service, ServiceExt};

const STREAM: &str = "generated";

/// The seed every run draws its cases from.
const SEED: [u8; 32] = *b"shardflow producer properties 01";

/// How long (tokio's paused clock) a case may take before it counts as hung.
const CASE_LIMIT: Duration = Duration::from_secs(3_600);

/// What happens to the producer before every answer is in.
#[derive(Clone, Copy, Debug)]
enum End {
    /// `close()` once this many records were handed over; the rest are refused.
    CloseAfter(usize),
    /// Every handle dropped once all records were handed over; answers still come.
    Drop,
}

/// A reshard while records flow, once this many records were handed over.
#[derive(Clone, Copy, Debug)]
enum Reshard {
    Split(usize),
    Merge(usize),
}

/// One generated workload: the stream, the producer's settings, the faults, and the
/// shape of the records (drawn from `records_seed` so that a case shrinks by its
/// parameters, not record by record).
#[derive(Clone, Debug)]
struct Workload {
    shards: u32,
    count: usize,
    /// Record sizes (payload plus key) are drawn from `size_low..=size_low + size_span`,
    /// except every `large_every`-th record, drawn up to the record limit.
    size_low: usize,
    size_span: usize,
    large_every: Option<usize>,
    /// Distinct partition keys, and their length in bytes.
    keys: usize,
    key_len: usize,
    /// Percent of records that carry an explicit hash key.
    explicit_hash_keys: u8,
    aggregate: bool,
    rate_limit: bool,
    ordered: bool,
    /// The producer's call limits (`max_batch_records`, `max_batch_bytes`): small ones
    /// make many full calls out of few records.
    batch_records: usize,
    batch_bytes: usize,
    /// Probability of a refused entry, and of a throttled call.
    entry_failures: f64,
    throttles: f64,
    max_attempts: u32,
    reshard: Option<Reshard>,
    end: End,
    records_seed: u64,
}

fn workload() -> impl Strategy<Value = Workload> {
    let sizes = (
        prop_oneof![
            // Mostly small records, sometimes around 1 KB (where a record's framing in
            // an aggregate weighs most against the call's limit).
            2 => 0usize..300,
            2 => 850usize..1_000,
            1 => 0usize..60_000,
        ],
        0usize..200,
        proptest::option::weighted(0.2, 200usize..2_000),
    );
    let keys = (
        1usize..=64,
        1usize..=48,
        prop_oneof![1 => Just(0u8), 2 => 0u8..=100],
    );
    let modes = (
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
        prop_oneof![2 => Just(MAX_BATCH_RECORDS), 1 => 1usize..=MAX_BATCH_RECORDS],
        prop_oneof![1 => Just(MAX_BATCH_BYTES), 2 => 4_096usize..=400_000],
    );
    let faults = (
        prop_oneof![1 => Just(0.0), 2 => 0.0..0.3f64],
        prop_oneof![1 => Just(0.0), 2 => 0.0..0.1f64],
        2u32..=10,
    );
    let events = (
        proptest::option::weighted(0.3, (any::<bool>(), 0usize..=100)),
        proptest::option::weighted(0.3, 0usize..=100),
    );
    (
        1u32..=4,
        // Mostly a few hundred records; sometimes enough ~1 KB records for calls of
        // 5 MiB.
        prop_oneof![3 => 1usize..=400, 2 => 400usize..=3_000, 1 => 5_400usize..=6_500],
        sizes,
        keys,
        modes,
        faults,
        events,
        any::<u64>(),
    )
        .prop_map(
            |(
                shards,
                count,
                (size_low, size_span, large_every),
                (keys, key_len, explicit_hash_keys),
                (aggregate, rate_limit, ordered, batch_records, batch_bytes),
                (entry_failures, throttles, max_attempts),
                (reshard, close),
                records_seed,
            )| {
                // Events at a percentage of the records handed over.
                let at = |percent: usize| percent * count / 100;
                Workload {
                    shards,
                    count,
                    size_low,
                    size_span,
                    large_every,
                    keys,
                    key_len,
                    explicit_hash_keys,
                    aggregate,
                    rate_limit,
                    ordered,
                    batch_records,
                    batch_bytes,
                    entry_failures,
                    throttles,
                    max_attempts,
                    reshard: reshard.map(|(split, i)| {
                        if split {
                            Reshard::Split(at(i))
                        } else {
                            Reshard::Merge(at(i))
                        }
                    }),
                    end: close.map_or(End::Drop, |i| End::CloseAfter(at(i))),
                    records_seed,
                }
            },
        )
}

/// The records of a workload. Each payload starts with the record's index (8 bytes,
/// big-endian), so a payload found in the stream names its record.
fn records(w: &Workload) -> Vec<ProducerRecord> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(w.records_seed);
    (0..w.count)
        .map(|i| {
            let key = format!("{:0>width$}", rng.gen_range(0..w.keys), width = w.key_len);
            let size = match w.large_every {
                Some(every) if i % every == every - 1 => rng.gen_range(60_000..=MAX_RECORD_BYTES),
                _ => w.size_low + rng.gen_range(0..=w.size_span),
            };
            let len = size.saturating_sub(key.len()).max(8);
            let mut payload = vec![0u8; len];
            rng.fill(&mut payload[8..]);
            payload[..8].copy_from_slice(&(i as u64).to_be_bytes());
            let record = ProducerRecord::new(payload, key);
            if rng.gen_range(0..100u8) < w.explicit_hash_keys {
                record.with_explicit_hash_key(rng.gen::<u128>().to_string())
            } else {
                record
            }
        })
        .collect()
}

/// One PutRecords call as the stream saw it: each entry's size and whether it is a KPL
/// aggregate.
#[derive(Clone, Debug)]
struct Call {
    entries: Vec<(usize, bool)>,
}

/// Forwards to the memory backend and logs every PutRecords call.
struct Recording {
    memory: Memory,
    calls: Mutex<Vec<Call>>,
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
        self.calls.lock().unwrap().push(Call {
            entries: records
                .iter()
                .map(|r| {
                    (
                        r.data.len() + r.partition_key.len(),
                        r.data.starts_with(&MAGIC),
                    )
                })
                .collect(),
        });
        self.memory.streams().put_records(stream, records).await
    }
}

/// What a case produced: each record's answer (in input order), the calls, the shards
/// and every Kinesis record of the stream.
struct Outcome {
    answers: Vec<Result<Stored, ProduceError>>,
    calls: Vec<Call>,
    shards: Vec<ShardInfo>,
    stored: HashMap<String, Vec<Record>>,
}

async fn run_case(w: &Workload, records: Vec<ProducerRecord>) -> Outcome {
    let memory = Memory::builder().limits(KinesisLimits::aws()).build();
    memory.create_stream(STREAM, w.shards).await.unwrap();
    memory.streams().set_faults(KinesisFaults {
        put_entry_failure: w.entry_failures,
        throttle: w.throttles,
        seed: w.records_seed,
        ..Default::default()
    });
    let recording = Arc::new(Forward(Recording {
        memory: memory.clone(),
        calls: Mutex::new(Vec::new()),
    }));
    let mut builder = Producer::builder()
        .stream(STREAM)
        .kinesis(recording.clone())
        .ordered_per_key(w.ordered)
        .max_attempts(w.max_attempts)
        .max_batch_records(w.batch_records)
        .max_batch_bytes(w.batch_bytes)
        .seed(w.records_seed);
    if w.aggregate {
        builder = builder.aggregation(Aggregation::new());
    }
    if !w.rate_limit {
        builder = builder.no_rate_limit();
    }
    let producer = builder.build().unwrap();

    let reshard = |handed: usize| {
        let memory = memory.clone();
        let shards = w.shards;
        async move {
            match w.reshard {
                Some(Reshard::Split(at)) if at == handed => {
                    memory
                        .split_shard_in_half(STREAM, "shardId-000000000000")
                        .await
                        .unwrap();
                }
                Some(Reshard::Merge(at)) if at == handed && shards >= 2 => {
                    memory
                        .streams()
                        .merge_shards(STREAM, "shardId-000000000000", "shardId-000000000001")
                        .await
                        .unwrap();
                }
                _ => {}
            }
        }
    };
    let close_at = match w.end {
        End::CloseAfter(at) => Some(at),
        End::Drop => None,
    };
    let mut closing = None;
    let answers: Vec<Result<Stored, ProduceError>> = if w.ordered {
        // All at once, so that each key's records wait behind each other before any can
        // fail (ordered mode's promise is about records handed over together). A close
        // or reshard happens once they are in.
        let sending = {
            let producer = producer.clone();
            tokio::spawn(async move { producer.send_all(records).await })
        };
        tokio::task::yield_now().await;
        reshard(0).await;
        if close_at.is_some() {
            let p = producer.clone();
            closing = Some(tokio::spawn(async move { p.close().await }));
        }
        drop(producer);
        sending.await.unwrap()
    } else {
        // One by one through the tower interface, each waiting for room, in order.
        let mut handle = producer.clone();
        let mut pending = Vec::with_capacity(records.len());
        for (i, record) in records.into_iter().enumerate() {
            reshard(i).await;
            if close_at == Some(i) {
                let p = producer.clone();
                closing = Some(tokio::spawn(async move { p.close().await }));
                tokio::task::yield_now().await;
            }
            match handle.ready().await {
                Ok(ready) => pending.push(tokio::spawn(ready.call(record))),
                Err(closed) => {
                    pending.push(tokio::spawn(std::future::ready(Err(closed))));
                }
            }
        }
        drop(handle);
        drop(producer);
        let mut answers = Vec::with_capacity(pending.len());
        for answer in pending {
            answers.push(answer.await.unwrap());
        }
        answers
    };
    if let Some(closing) = closing {
        closing.await.unwrap();
    }
    let calls = recording.calls.lock().unwrap().clone();
    let shards = memory.streams().list_shards(STREAM).await.unwrap();
    let stored = shards
        .iter()
        .map(|s| {
            (
                s.shard_id.clone(),
                memory.streams().records(STREAM, &s.shard_id),
            )
        })
        .collect();
    Outcome {
        answers,
        calls,
        shards,
        stored,
    }
}

/// The index a payload names (its first 8 bytes).
fn index_of(data: &[u8]) -> Option<u64> {
    Some(u64::from_be_bytes(data.get(..8)?.try_into().ok()?))
}

/// Checks every invariant of the module docs; the first broken one as an error.
fn check(w: &Workload, sent: &[ProducerRecord], out: &Outcome) -> Result<(), TestCaseError> {
    // Calls within PutRecords' limits; aggregates within the aggregation's.
    for (n, call) in out.calls.iter().enumerate() {
        let bytes: usize = call.entries.iter().map(|(size, _)| size).sum();
        let aggregates = call.entries.iter().filter(|(_, a)| *a).count();
        prop_assert!(
            call.entries.len() <= w.batch_records.min(MAX_BATCH_RECORDS),
            "call {n} has {} entries",
            call.entries.len()
        );
        prop_assert!(
            bytes <= MAX_BATCH_BYTES,
            "call {n} of {} entries ({aggregates} aggregates) is {bytes} bytes, more than {MAX_BATCH_BYTES}",
            call.entries.len(),
        );
        // Only a record larger than the configured limit goes beyond it, alone.
        prop_assert!(
            bytes <= w.batch_bytes || call.entries.len() == 1,
            "call {n} of {} entries ({aggregates} aggregates) is {bytes} bytes, more than the {} configured",
            call.entries.len(),
            w.batch_bytes
        );
        for (size, aggregate) in &call.entries {
            prop_assert!(
                *size <= MAX_RECORD_BYTES,
                "call {n}: an entry of {size} bytes"
            );
            if *aggregate && w.aggregate {
                prop_assert!(
                    *size <= Aggregation::new().size_limit(),
                    "call {n}: an aggregate of {size} bytes"
                );
            }
        }
    }

    // Every user record in the stream, by position, and where each index was stored.
    let ranges: HashMap<&str, (u128, u128)> = out
        .shards
        .iter()
        .map(|s| {
            (
                s.shard_id.as_str(),
                (s.starting_hash_key, s.ending_hash_key),
            )
        })
        .collect();
    let mut at: HashMap<(String, SequenceNumber, u64), (Bytes, String, bool)> = HashMap::new();
    let mut found: HashMap<u64, usize> = HashMap::new();
    for (shard, records) in &out.stored {
        let (start, end) = ranges[shard.as_str()];
        for record in records {
            let sequence = record.sequence_number.clone();
            match deaggregate(record.clone()) {
                Deaggregated::Aggregated { user_records, .. } => {
                    let whole = user_records
                        .iter()
                        .all(|u| u.hash_key().is_some_and(|h| start <= h && h <= end));
                    for u in user_records {
                        *found
                            .entry(index_of(&u.data).unwrap_or(u64::MAX))
                            .or_default() += 1;
                        at.insert(
                            (shard.clone(), sequence.clone(), u.sub_sequence),
                            (u.data, u.partition_key, whole),
                        );
                    }
                }
                other => {
                    let r = other.record();
                    *found
                        .entry(index_of(&r.data).unwrap_or(u64::MAX))
                        .or_default() += 1;
                    at.insert(
                        (shard.clone(), sequence, 0),
                        (r.data.clone(), r.partition_key.clone(), true),
                    );
                }
            }
        }
    }

    // Answers: stored where they say, whole aggregates; refused ones nowhere.
    let mut placed: Vec<Option<(SequenceNumber, u64)>> = vec![None; sent.len()];
    for (i, (record, answer)) in sent.iter().zip(&out.answers).enumerate() {
        match answer {
            Ok(stored) => {
                let key = (
                    stored.shard_id.clone(),
                    stored.sequence_number.clone(),
                    stored.sub_sequence_number,
                );
                let Some((data, partition_key, whole)) = at.get(&key) else {
                    return Err(TestCaseError::fail(format!(
                        "record {i} answered {stored:?}: nothing stored there"
                    )));
                };
                prop_assert!(
                    *data == record.payload && *partition_key == record.partition_key,
                    "record {i}: another record at {stored:?}"
                );
                prop_assert!(
                    *whole,
                    "record {i} answered {stored:?}: its aggregate holds records of other shards"
                );
                placed[i] = Some((stored.sequence_number.clone(), stored.sub_sequence_number));
            }
            Err(ProduceError::Closed)
            | Err(ProduceError::AfterFailure(_))
            | Err(ProduceError::TooLarge { .. })
            | Err(ProduceError::InvalidRecord(_)) => {
                prop_assert!(
                    !found.contains_key(&(i as u64)),
                    "record {i} answered {answer:?} but is in the stream"
                );
            }
            Err(ProduceError::Failed { .. }) => {}
            Err(other) => {
                return Err(TestCaseError::fail(format!("record {i}: {other:?}")));
            }
        }
    }

    if w.ordered {
        // Per key, in the order handed over: positions answered rise, and nothing is
        // stored after a record that finally failed.
        let mut by_key: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, r) in sent.iter().enumerate() {
            by_key.entry(r.partition_key.as_str()).or_default().push(i);
        }
        for (key, indices) in by_key {
            let mut last: Option<(SequenceNumber, u64, usize)> = None;
            let mut failed: Option<usize> = None;
            for i in indices {
                if let Some(f) = failed {
                    prop_assert!(
                        placed[i].is_none() && !found.contains_key(&(i as u64)),
                        "key {key:?}: record {i} stored after record {f}, which failed: {:?}",
                        out.answers[f]
                    );
                }
                if let Some((sequence, sub)) = &placed[i] {
                    if let Some((ls, lsub, li)) = &last {
                        prop_assert!(
                            (ls, lsub) < (sequence, sub),
                            "key {key:?}: record {i} stored before record {li}"
                        );
                    }
                    last = Some((sequence.clone(), *sub, i));
                }
                if matches!(out.answers[i], Err(ProduceError::Failed { .. })) {
                    failed = failed.or(Some(i));
                }
            }
        }
    }
    Ok(())
}

/// How many cases: `PRODUCER_PROPERTIES_CASES`, 24 unless set.
fn cases() -> u32 {
    std::env::var("PRODUCER_PROPERTIES_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(24)
}

#[test]
fn the_producer_keeps_its_promises_for_any_workload() {
    let config = Config {
        cases: cases(),
        // Each shrink step replays a whole workload: enough to reach a small one.
        max_shrink_iters: 400,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &SEED));
    let result = runner.run(&workload(), |w| run_one(&w));
    if let Err(failure) = result {
        panic!("{failure}");
    }
}

/// Runs one workload on a fresh backend and checks it.
fn run_one(w: &Workload) -> Result<(), TestCaseError> {
    let records = records(w);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let out = runtime.block_on(async {
        match tokio::time::timeout(CASE_LIMIT, run_case(w, records.clone())).await {
            Ok(out) => Ok(out),
            Err(_) => Err(TestCaseError::fail(format!(
                "not every record was answered within {CASE_LIMIT:?}"
            ))),
        }
    })?;
    check(w, &records, &out)
}

/// A workload that overflowed a call, kept as a regression: 6,000 aggregated records of
/// 900 to 999 bytes, each with an explicit hash key, make a full call of 106 aggregates
/// that the producer's size estimate put 25 bytes past 5 MiB.
#[test]
fn aggregated_records_with_explicit_hash_keys_fill_calls_within_5_mib() {
    let w = Workload {
        shards: 4,
        count: 6_000,
        size_low: 900,
        size_span: 99,
        large_every: None,
        keys: 6_000,
        key_len: 3,
        explicit_hash_keys: 100,
        aggregate: true,
        rate_limit: false,
        ordered: false,
        batch_records: MAX_BATCH_RECORDS,
        batch_bytes: MAX_BATCH_BYTES,
        entry_failures: 0.0,
        throttles: 0.0,
        max_attempts: 10,
        reshard: None,
        end: End::Drop,
        records_seed: 21,
    };
    if let Err(failure) = run_one(&w) {
        panic!("{failure}");
    }
}
