//! The producer on the memory backend (seeded partial failures and throttling, paused
//! clock) and, when `SHARDFLOW_EMULATORS` is set (scripts/test.sh), against kinesalite
//! over HTTP.

use testkit as common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use common::Limited;
use futures_util::stream::{FuturesUnordered, StreamExt};
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, StartingPosition, StreamAdmin,
};
use shardflow::memory::KinesisFaults;
use shardflow::producer::{InvalidRecord, MAX_BATCH_BYTES, MAX_RECORD_BYTES};
use shardflow::{
    Backend, ConfigError, Memory, ProduceError, Producer, ProducerRecord, SequenceNumber, Stored,
};
use testkit::hooks::{Forward, ForwardKinesis};
use tokio::sync::Semaphore;
use tokio::time::{timeout, Instant};
use tower::{Service, ServiceExt};

const STREAM: &str = "out";

/// One PutRecords call as the backend saw it.
#[derive(Clone, Debug)]
struct Call {
    records: usize,
    bytes: usize,
    failed_entries: usize,
    call_failed: bool,
}

/// A `KinesisApi` (and `Backend`) that forwards to the memory backend, logs every
/// PutRecords call, and can hold calls at a gate until the test opens it. Used as
/// [`Forward`]`<Recording>`, which derefs to it.
struct Recording {
    memory: Memory,
    calls: Mutex<Vec<Call>>,
    gate: Option<Arc<Semaphore>>,
}

impl Recording {
    fn new(memory: &Memory) -> Arc<Forward<Self>> {
        Arc::new(Forward(Recording {
            memory: memory.clone(),
            calls: Mutex::new(Vec::new()),
            gate: None,
        }))
    }

    fn gated(memory: &Memory, gate: Arc<Semaphore>) -> Arc<Forward<Self>> {
        Arc::new(Forward(Recording {
            memory: memory.clone(),
            calls: Mutex::new(Vec::new()),
            gate: Some(gate),
        }))
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }
}

#[derive(Clone)]
struct RecordingBackend(Arc<Forward<Recording>>);

impl Backend for RecordingBackend {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        self.0.clone()
    }
    fn lease_store(&self, table: &str) -> Arc<dyn shardflow::lease::LeaseStore> {
        self.0.memory.lease_store(table)
    }
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
        let _permit = match &self.gate {
            Some(gate) => Some(gate.acquire().await.unwrap()),
            None => None,
        };
        let result = self.memory.streams().put_records(stream, records).await;
        self.calls.lock().unwrap().push(Call {
            records: records.len(),
            bytes: records
                .iter()
                .map(|r| r.data.len() + r.partition_key.len())
                .sum(),
            failed_entries: result.as_ref().map_or(0, |o| {
                o.iter()
                    .filter(|o| matches!(o, PutOutcome::Failed { .. }))
                    .count()
            }),
            call_failed: result.is_err(),
        });
        result
    }
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

fn record(value: usize, key: impl Into<String>) -> ProducerRecord {
    ProducerRecord::new(value.to_string(), key)
}

/// Every record of the stream: (shard, sequence) -> (partition key, value), and the
/// values per shard in sequence order.
async fn read_back(
    api: &dyn KinesisApi,
) -> (
    HashMap<(String, SequenceNumber), (String, usize)>,
    Vec<Vec<(String, usize)>>,
) {
    let mut at = HashMap::new();
    let mut per_shard = Vec::new();
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
                let value: usize = std::str::from_utf8(&r.data).unwrap().parse().unwrap();
                in_order.push((r.partition_key.clone(), value));
                let previous = at.insert(
                    (shard.shard_id.clone(), r.sequence_number),
                    (r.partition_key, value),
                );
                assert!(previous.is_none(), "a sequence number was read twice");
            }
            match page.next_iterator {
                Some(next) => iterator = next,
                None => break,
            }
        }
        per_shard.push(in_order);
    }
    (at, per_shard)
}

/// Every value 0..n landed exactly once, and each call's answer names the place where
/// its record is.
fn assert_stored_once(
    n: usize,
    answers: &[(usize, Result<Stored, ProduceError>)],
    at: &HashMap<(String, SequenceNumber), (String, usize)>,
) {
    assert_eq!(at.len(), n, "records in the stream");
    let values: HashSet<usize> = at.values().map(|(_, v)| *v).collect();
    assert_eq!(values.len(), n, "every value exactly once");
    assert_eq!(answers.len(), n);
    for (value, answer) in answers {
        let stored = answer
            .as_ref()
            .unwrap_or_else(|e| panic!("record {value} failed: {e}"));
        let (_, found) = at
            .get(&(stored.shard_id.clone(), stored.sequence_number.clone()))
            .unwrap_or_else(|| panic!("record {value}: nothing at {stored:?}"));
        assert_eq!(found, value, "the answer of {value} points at {found}");
    }
}

/// Calls the producer for each record in order through one handle (the order the
/// records enter the producer), then waits for all answers.
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

fn faults(seed: u64) -> KinesisFaults {
    KinesisFaults {
        put_entry_failure: 0.3,
        throttle: 0.1,
        seed,
        ..Default::default()
    }
}

#[tokio::test(start_paused = true)]
async fn every_record_is_stored_once_where_its_answer_says_despite_faults() {
    for seed in [1, 2, 3] {
        let memory = memory_with_stream(4).await;
        let recording = Recording::new(&memory);
        memory.streams().set_faults(faults(seed));
        let producer = Producer::builder()
            .stream(STREAM)
            .backend(RecordingBackend(recording.clone()))
            .max_attempts(100)
            .seed(seed)
            .build()
            .unwrap();
        let n = 5_000;
        let answers: Vec<_> = futures_util::stream::iter(0..n)
            .map(|i| {
                let p = producer.clone();
                async move { (i, p.oneshot(record(i, format!("key-{}", i % 101))).await) }
            })
            .buffer_unordered(n)
            .collect::<Vec<_>>()
            .limited()
            .await;
        memory.streams().set_faults(KinesisFaults::default());
        let (at, _) = read_back(memory.streams().as_ref()).await;
        assert_stored_once(n, &answers, &at);

        // The faults did happen, and only failed entries were resent: what was sent
        // is exactly what was stored plus what was refused.
        let calls = recording.calls();
        let sent: usize = calls.iter().map(|c| c.records).sum();
        let refused: usize = calls.iter().map(|c| c.failed_entries).sum();
        let thrown: usize = calls
            .iter()
            .filter(|c| c.call_failed)
            .map(|c| c.records)
            .sum();
        assert!(refused > 1_000, "partial failures: {refused}");
        assert!(calls.iter().any(|c| c.call_failed), "no call was throttled");
        assert_eq!(sent, n + refused + thrown);
        producer.close().limited().await;
    }
}

#[tokio::test(start_paused = true)]
async fn ordered_mode_keeps_each_keys_order_through_partial_failures() {
    for seed in [11, 12, 13] {
        let memory = memory_with_stream(4).await;
        memory.streams().set_faults(faults(seed));
        let producer = Producer::builder()
            .stream(STREAM)
            .backend(memory.clone())
            .ordered_per_key(true)
            .max_attempts(100)
            .buffer(1_000)
            .seed(seed)
            .build()
            .unwrap();
        let n = 4_000;
        let keys = 25;
        let answers = produce_in_order(
            &producer,
            (0..n).map(|i| (i, record(i, format!("k{}", i % keys)))),
        )
        .await;
        memory.streams().set_faults(KinesisFaults::default());
        let (at, per_shard) = read_back(memory.streams().as_ref()).await;
        assert_stored_once(n, &answers, &at);
        for shard in per_shard {
            let mut last: BTreeMap<String, usize> = BTreeMap::new();
            for (key, value) in shard {
                if let Some(previous) = last.insert(key.clone(), value) {
                    assert!(
                        previous < value,
                        "seed {seed}: key {key}: {value} stored after {previous}"
                    );
                }
            }
        }
        producer.close().limited().await;
    }
}

/// The same faults do reorder keys when order is not asked for: the test above would
/// catch a producer that ignored `ordered_per_key`.
#[tokio::test(start_paused = true)]
async fn unordered_mode_lets_retries_overtake() {
    let memory = memory_with_stream(4).await;
    memory.streams().set_faults(faults(11));
    let producer = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .max_attempts(100)
        .seed(11)
        .build()
        .unwrap();
    let n = 4_000;
    let answers = produce_in_order(
        &producer,
        (0..n).map(|i| (i, record(i, format!("k{}", i % 25)))),
    )
    .await;
    memory.streams().set_faults(KinesisFaults::default());
    let (at, per_shard) = read_back(memory.streams().as_ref()).await;
    assert_stored_once(n, &answers, &at);
    let reordered = per_shard.iter().any(|shard| {
        let mut last: HashMap<&str, usize> = HashMap::new();
        shard
            .iter()
            .any(|(key, value)| last.insert(key, *value).is_some_and(|p| p > *value))
    });
    assert!(reordered);
}

#[tokio::test(start_paused = true)]
async fn oversize_and_invalid_records_are_refused_before_sending() {
    let memory = memory_with_stream(2).await;
    let recording = Recording::new(&memory);
    let mut producer = Producer::builder()
        .stream(STREAM)
        .kinesis(recording.clone())
        .buffer(1)
        .build()
        .unwrap();

    let too_large = ProducerRecord::new(vec![0u8; MAX_RECORD_BYTES], "k");
    let expected = ProduceError::TooLarge {
        size: MAX_RECORD_BYTES + 1,
        limit: MAX_RECORD_BYTES,
    };
    assert_eq!(
        producer.send(too_large.clone()).limited().await,
        Err(expected.clone())
    );
    // Through the Service: the reserved slot is given back (buffer is 1, and the next
    // poll_ready is ready at once).
    for _ in 0..3 {
        let answer = producer
            .ready()
            .limited()
            .await
            .unwrap()
            .call(too_large.clone())
            .limited()
            .await;
        assert_eq!(answer, Err(expected.clone()));
    }
    // A multi-byte key counts in bytes.
    let key = "ключ";
    let over_by_key = ProducerRecord::new(vec![0u8; MAX_RECORD_BYTES - key.len() + 1], key);
    assert!(matches!(
        producer.send(over_by_key).limited().await,
        Err(ProduceError::TooLarge { .. })
    ));
    let invalid = [
        (
            ProducerRecord::new("x", ""),
            InvalidRecord::EmptyPartitionKey,
        ),
        (
            ProducerRecord::new("x", "k".repeat(257)),
            InvalidRecord::PartitionKeyTooLong { chars: 257 },
        ),
        (
            ProducerRecord::new("x", "k").with_explicit_hash_key("12a"),
            InvalidRecord::ExplicitHashKey("12a".into()),
        ),
        (
            ProducerRecord::new("x", "k")
                .with_explicit_hash_key("340282366920938463463374607431768211456"),
            InvalidRecord::ExplicitHashKey("340282366920938463463374607431768211456".into()),
        ),
    ];
    for (record, why) in invalid {
        let answer = producer.ready().limited().await.unwrap().call(record).await;
        assert_eq!(answer, Err(ProduceError::InvalidRecord(why)));
    }
    assert!(recording.calls().is_empty(), "nothing may be sent");

    // Exactly at the limit is fine.
    let exact = ProducerRecord::new(vec![0u8; MAX_RECORD_BYTES - key.len()], key);
    assert!(producer.send(exact).limited().await.is_ok());
    assert_eq!(recording.calls().len(), 1);
    producer.close().limited().await;
}

#[tokio::test(start_paused = true)]
async fn batches_stay_within_500_records_and_5_mib() {
    // The default producer (rate-limited per shard: at 150 % a shard takes at most
    // 1.5 MiB a second, which shapes the calls of large records itself), and producers
    // whose large records fill calls up to the byte limit: one rate-limited at 1,000 %
    // (10 MiB a second per shard) and one without the limit.
    for rate_limit in [Some(None), Some(Some(1_000)), None] {
        let memory = memory_with_stream(4).await;
        let recording = Recording::new(&memory);
        let builder = Producer::builder()
            .stream(STREAM)
            .kinesis(recording.clone());
        let producer = match rate_limit {
            Some(None) => builder,
            Some(Some(percent)) => builder.rate_limit(percent),
            None => builder.no_rate_limit(),
        }
        .build()
        .unwrap();

        // Small records: batched up to the count limit (within the shards' budgets).
        let n = 2_100;
        let answers: Vec<_> = futures_util::stream::iter(0..n)
            .map(|i| producer.send(record(i, format!("k{i}"))))
            .buffer_unordered(n)
            .collect::<Vec<_>>()
            .limited()
            .await;
        assert!(answers.iter().all(Result::is_ok));
        let calls = recording.calls();
        assert!(calls.iter().all(|c| c.records <= 500), "{calls:?}");
        assert_eq!(calls.iter().map(|c| c.records).sum::<usize>(), n);
        assert!(
            calls.len() <= 6,
            "records were not batched: {} calls",
            calls.len()
        );
        assert_eq!(calls.iter().map(|c| c.records).max(), Some(500));

        // Large records: at most 5 MiB a call (5 of 900 KiB fit, 6 do not).
        let before = recording.calls().len();
        let big = 40;
        let answers: Vec<_> = futures_util::stream::iter(0..big)
            .map(|i| producer.send(ProducerRecord::new(vec![b'x'; 900 * 1024], format!("b{i}"))))
            .buffer_unordered(big)
            .collect::<Vec<_>>()
            .limited()
            .await;
        assert!(answers.iter().all(Result::is_ok));
        let calls = &recording.calls()[before..];
        assert!(
            calls.iter().all(|c| c.bytes <= MAX_BATCH_BYTES),
            "{calls:?}"
        );
        assert_eq!(calls.iter().map(|c| c.records).sum::<usize>(), big);
        if rate_limit != Some(None) {
            assert_eq!(calls.iter().map(|c| c.records).max(), Some(5));
        }
        producer.close().limited().await;
    }
}

#[tokio::test(start_paused = true)]
async fn configured_limits_and_the_linger_shape_batches() {
    let memory = memory_with_stream(1).await;
    let recording = Recording::new(&memory);
    let producer = Producer::builder()
        .stream(STREAM)
        .kinesis(recording.clone())
        .max_batch_records(10)
        .max_batch_bytes(1_000)
        .linger(Duration::from_millis(200))
        .build()
        .unwrap();
    // 3 records of 400 bytes: 2 fit in 1,000 bytes; the third waits for the linger.
    let start = Instant::now();
    let answers: Vec<_> = futures_util::stream::iter(0..3)
        .map(|i| producer.send(ProducerRecord::new(vec![b'x'; 399], format!("{i}"))))
        .buffer_unordered(3)
        .collect::<Vec<_>>()
        .limited()
        .await;
    assert!(answers.iter().all(Result::is_ok));
    let sizes: Vec<usize> = recording.calls().iter().map(|c| c.records).collect();
    assert_eq!(sizes, [2, 1]);
    assert!(start.elapsed() >= Duration::from_millis(200));
    assert!(start.elapsed() < Duration::from_millis(300));
    producer.close().limited().await;
}

#[tokio::test(start_paused = true)]
async fn a_full_buffer_makes_poll_ready_pending_until_kinesis_answers() {
    let memory = memory_with_stream(1).await;
    let gate = Arc::new(Semaphore::new(0));
    let recording = Recording::gated(&memory, gate.clone());
    let mut producer = Producer::builder()
        .stream(STREAM)
        .kinesis(recording.clone())
        .buffer(3)
        .max_batch_records(2)
        .max_in_flight(1)
        .linger(Duration::ZERO)
        .build()
        .unwrap();

    // The background task holds 2 × (1 + 1) records (one call in flight, one batch
    // ready), the channel 3 more; then poll_ready stays pending (the paused clock runs
    // the 1 s timeout out only once every task is idle).
    let pending = FuturesUnordered::new();
    let mut accepted = 0;
    while let Ok(ready) = timeout(Duration::from_secs(1), producer.ready()).await {
        ready.unwrap();
        pending.push(producer.call(record(accepted, "k")));
        accepted += 1;
        assert!(accepted <= 100, "no backpressure");
    }
    assert_eq!(accepted, 7);
    assert_eq!(
        recording.calls().len(),
        0,
        "the first call is still at the gate"
    );

    gate.add_permits(1_000);
    producer.ready().limited().await.unwrap();
    let answers: Vec<_> = pending.collect::<Vec<_>>().limited().await;
    assert!(answers.iter().all(Result::is_ok));
    assert_eq!(answers.len(), 7);
    producer.close().limited().await;
}

/// A producer with a one-hour linger and ten calls waiting in it (plus the handle that
/// made them).
async fn ten_waiting_for_a_long_linger() -> (
    Memory,
    Producer,
    Producer,
    Vec<<Producer as Service<ProducerRecord>>::Future>,
) {
    let memory = memory_with_stream(2).await;
    let producer = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .linger(Duration::from_secs(3_600))
        .build()
        .unwrap();
    let mut handle = producer.clone();
    let mut pending = Vec::new();
    for i in 0..10 {
        handle.ready().limited().await.unwrap();
        pending.push(handle.call(record(i, format!("k{i}"))));
    }
    (memory, producer, handle, pending)
}

#[tokio::test(start_paused = true)]
async fn close_flushes_what_is_buffered_without_waiting_for_the_linger() {
    let (memory, producer, mut handle, pending) = ten_waiting_for_a_long_linger().await;
    let start = Instant::now();
    producer.close().limited().await;
    assert!(start.elapsed() < Duration::from_secs(1));
    for answer in pending {
        assert!(answer.limited().await.is_ok());
    }
    let (at, _) = read_back(memory.streams().as_ref()).await;
    assert_eq!(at.len(), 10);

    // Closed for every handle.
    assert!(producer.is_closed());
    assert_eq!(
        handle.ready().limited().await.err(),
        Some(ProduceError::Closed)
    );
    assert_eq!(
        producer.send(record(99, "k")).limited().await,
        Err(ProduceError::Closed)
    );
    producer.close().limited().await; // twice is fine
    producer.flush().limited().await; // and so is a flush after close
}

#[tokio::test(start_paused = true)]
async fn flush_answers_every_earlier_record_and_the_producer_stays_open() {
    let (_memory, producer, _handle, pending) = ten_waiting_for_a_long_linger().await;
    let start = Instant::now();
    producer.flush().limited().await;
    assert!(start.elapsed() < Duration::from_secs(1));
    for answer in pending {
        let answered = futures_util::FutureExt::now_or_never(answer);
        assert!(matches!(answered, Some(Ok(_))), "{answered:?}");
    }
    assert!(!producer.is_closed());
    // An empty flush returns at once.
    producer.flush().limited().await;
    assert!(start.elapsed() < Duration::from_secs(1));
    producer.close().limited().await;
}

#[tokio::test(start_paused = true)]
async fn dropping_every_handle_flushes() {
    let memory = memory_with_stream(2).await;
    let mut producer = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .linger(Duration::from_secs(3_600))
        .build()
        .unwrap();
    let mut pending = Vec::new();
    for i in 0..10 {
        producer.ready().limited().await.unwrap();
        pending.push(producer.call(record(i, format!("k{i}"))));
    }
    drop(producer);
    let start = Instant::now();
    for answer in pending {
        assert!(answer.limited().await.is_ok());
    }
    assert!(start.elapsed() < Duration::from_secs(1));
    let (at, _) = read_back(memory.streams().as_ref()).await;
    assert_eq!(at.len(), 10);
}

#[tokio::test(start_paused = true)]
async fn call_without_poll_ready_still_waits_for_room() {
    let memory = memory_with_stream(1).await;
    let mut producer = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .buffer(1)
        .build()
        .unwrap();
    let answers: Vec<_> = (0..20).map(|i| producer.call(record(i, "k"))).collect();
    for answer in answers {
        assert!(answer.limited().await.is_ok());
    }
    producer.close().limited().await;
}

#[tokio::test(start_paused = true)]
async fn entries_that_keep_failing_resolve_to_failed_after_max_attempts() {
    let memory = memory_with_stream(1).await;
    memory.streams().set_faults(KinesisFaults {
        put_entry_failure: 1.0,
        ..Default::default()
    });
    let producer = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .max_attempts(3)
        .retry_backoff(Duration::from_millis(100), Duration::from_secs(1))
        .linger(Duration::ZERO)
        .build()
        .unwrap();
    let start = Instant::now();
    let answer = producer.send(record(1, "k")).limited().await;
    assert_eq!(
        answer,
        Err(ProduceError::Failed {
            code: "ProvisionedThroughputExceededException".into(),
            message: "injected partial failure".into(),
            attempts: 3,
        })
    );
    // Two backoffs: at least 50 ms + 100 ms, at most 100 ms + 200 ms.
    let waited = start.elapsed();
    assert!(waited >= Duration::from_millis(150), "{waited:?}");
    assert!(waited <= Duration::from_millis(300), "{waited:?}");

    memory.streams().set_faults(KinesisFaults {
        throttle: 1.0,
        ..Default::default()
    });
    let answer = producer.send(record(2, "k")).limited().await;
    assert!(
        matches!(&answer, Err(ProduceError::Failed { code, attempts: 3, .. }) if code == "Throttled"),
        "{answer:?}"
    );
    producer.close().limited().await;
}

#[tokio::test(start_paused = true)]
async fn a_missing_stream_fails_at_once() {
    let memory = Memory::new();
    let producer = Producer::builder()
        .stream("nowhere")
        .backend(memory)
        .build()
        .unwrap();
    let answer = producer.send(record(1, "k")).limited().await;
    assert!(
        matches!(&answer, Err(ProduceError::Failed { code, attempts: 1, .. }) if code == "NotFound"),
        "{answer:?}"
    );
    producer.close().limited().await;
}

#[tokio::test(start_paused = true)]
async fn explicit_hash_keys_pick_the_shard() {
    let memory = memory_with_stream(4).await;
    let producer = Producer::builder()
        .stream(STREAM)
        .backend(memory.clone())
        .build()
        .unwrap();
    let low = producer
        .send(record(1, "k").with_explicit_hash_key("0"))
        .limited()
        .await
        .unwrap();
    let high = producer
        .send(record(2, "k").with_explicit_hash_key(u128::MAX.to_string()))
        .limited()
        .await
        .unwrap();
    assert_eq!(low.shard_id, "shardId-000000000000");
    assert_eq!(high.shard_id, "shardId-000000000003");

    // for_stream: same backend and settings, another stream.
    memory.streams().create_stream("dlq", 1).await.unwrap();
    let dlq = producer.for_stream("dlq").unwrap();
    assert_eq!(dlq.stream(), "dlq");
    dlq.send(record(3, "k")).limited().await.unwrap();
    assert_eq!(
        memory
            .streams()
            .records("dlq", "shardId-000000000000")
            .len(),
        1
    );
    assert!(matches!(
        producer.for_stream("bad name"),
        Err(ConfigError::Invalid {
            field: "stream",
            ..
        })
    ));
    producer.close().limited().await;
    dlq.close().limited().await;
}

#[tokio::test]
async fn the_builder_names_the_field_it_refuses() {
    let err = Producer::builder()
        .backend(Memory::new())
        .build()
        .unwrap_err();
    assert_eq!(err, ConfigError::Missing { field: "stream" });
    let err = Producer::builder()
        .stream("s")
        .backend(Memory::new())
        .max_batch_records(501)
        .build()
        .unwrap_err();
    assert!(matches!(
        err,
        ConfigError::Invalid {
            field: "max_batch_records",
            ..
        }
    ));
    assert!(err.to_string().contains("max_batch_records"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_5000_records_into_the_emulator_and_reads_them_back() {
    if !common::emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    let api = aws.admin().unwrap();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let stream = format!("producer-{}-{nanos}", std::process::id());
    api.create_stream(&stream, 4).await.unwrap();
    let producer = Producer::builder()
        .stream(&stream)
        .backend(aws.clone())
        .ordered_per_key(true)
        .build()
        .unwrap();
    let n = 5_000;
    let answers = produce_in_order(
        &producer,
        (0..n).map(|i| (i, record(i, format!("key-{}", i % 50)))),
    )
    .await;
    producer.close().limited().await;

    let mut at = HashMap::new();
    for shard in api.list_shards(&stream).await.unwrap() {
        let mut iterator = api
            .shard_iterator(&stream, &shard.shard_id, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        let mut last: HashMap<String, usize> = HashMap::new();
        loop {
            let page = api.get_records(&iterator, 10_000).await.unwrap();
            if page.records.is_empty() {
                break;
            }
            for r in page.records {
                let value: usize = std::str::from_utf8(&r.data).unwrap().parse().unwrap();
                if let Some(previous) = last.insert(r.partition_key.clone(), value) {
                    assert!(
                        previous < value,
                        "{}: {value} after {previous}",
                        r.partition_key
                    );
                }
                at.insert(
                    (shard.shard_id.clone(), r.sequence_number),
                    (r.partition_key, value),
                );
            }
            match page.next_iterator {
                Some(next) => iterator = next,
                None => break,
            }
        }
    }
    assert_stored_once(n, &answers, &at);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_size_records_and_explicit_hash_keys_on_the_emulator() {
    if !common::emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    let api = aws.admin().unwrap();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let stream = format!("producer-big-{}-{nanos}", std::process::id());
    api.create_stream(&stream, 2).await.unwrap();
    let producer = Producer::builder()
        .stream(&stream)
        .backend(aws.clone())
        .build()
        .unwrap();
    // 1 MiB each with the key: five make a call of exactly 5 MiB.
    let answers: Vec<_> = futures_util::stream::iter(0..11)
        .map(|i| {
            let key = format!("big-{i:02}");
            let data = vec![b'a' + i as u8; MAX_RECORD_BYTES - key.len()];
            producer.send(ProducerRecord::new(data, key))
        })
        .buffer_unordered(11)
        .collect::<Vec<_>>()
        .limited()
        .await;
    for answer in &answers {
        assert!(answer.is_ok(), "{answer:?}");
    }
    let low = producer
        .send(record(1, "k").with_explicit_hash_key("0"))
        .limited()
        .await
        .unwrap();
    let high = producer
        .send(record(2, "k").with_explicit_hash_key(u128::MAX.to_string()))
        .limited()
        .await
        .unwrap();
    assert_ne!(low.shard_id, high.shard_id);
    let too_large = ProducerRecord::new(vec![0u8; MAX_RECORD_BYTES], "k");
    assert!(matches!(
        producer.send(too_large).limited().await,
        Err(ProduceError::TooLarge { .. })
    ));
    producer.close().limited().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregated_records_into_the_emulator_read_back_at_their_sub_sequence() {
    use shardflow::aggregation::{deaggregate, Deaggregated};
    if !common::emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    let api = aws.admin().unwrap();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let stream = format!("producer-agg-{}-{nanos}", std::process::id());
    api.create_stream(&stream, 4).await.unwrap();
    let producer = Producer::builder()
        .stream(&stream)
        .backend(aws.clone())
        .aggregate(true)
        .ordered_per_key(true)
        .build()
        .unwrap();
    let n = 5_000;
    let answers = produce_in_order(
        &producer,
        (0..n).map(|i| (i, record(i, format!("key-{}", i % 50)))),
    )
    .await;
    producer.close().limited().await;

    // (shard, sequence, sub-sequence) -> value, each key's values in order per shard.
    let mut at = HashMap::new();
    let mut kinesis_records = 0;
    for shard in api.list_shards(&stream).await.unwrap() {
        let mut iterator = api
            .shard_iterator(&stream, &shard.shard_id, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        let mut last: HashMap<String, usize> = HashMap::new();
        loop {
            let page = api.get_records(&iterator, 10_000).await.unwrap();
            if page.records.is_empty() {
                break;
            }
            for r in page.records {
                kinesis_records += 1;
                let sequence = r.sequence_number.clone();
                let users: Vec<(u64, String, bytes::Bytes)> = match deaggregate(r) {
                    Deaggregated::Plain(r) => vec![(0, r.partition_key, r.data)],
                    Deaggregated::Aggregated { user_records, .. } => user_records
                        .into_iter()
                        .map(|u| (u.sub_sequence, u.partition_key, u.data))
                        .collect(),
                    Deaggregated::Corrupt { reason, .. } => panic!("corrupt: {reason}"),
                };
                for (sub, key, data) in users {
                    let value: usize = std::str::from_utf8(&data).unwrap().parse().unwrap();
                    if let Some(previous) = last.insert(key.clone(), value) {
                        assert!(previous < value, "{key}: {value} after {previous}");
                    }
                    let twice = at.insert((shard.shard_id.clone(), sequence.clone(), sub), value);
                    assert!(twice.is_none());
                }
            }
            match page.next_iterator {
                Some(next) => iterator = next,
                None => break,
            }
        }
    }
    assert_eq!(at.len(), n, "user records in the stream");
    assert!(
        kinesis_records < n / 10,
        "{kinesis_records} Kinesis records"
    );
    for (value, answer) in &answers {
        let stored = answer.as_ref().unwrap();
        let key = (
            stored.shard_id.clone(),
            stored.sequence_number.clone(),
            stored.sub_sequence_number,
        );
        assert_eq!(at.get(&key), Some(value), "the answer of {value}");
    }
}
