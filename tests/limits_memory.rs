//! Kinesis' per-shard throughput limits on the embedded backend: each limit on tokio's
//! paused clock (writes in records and bytes, GetRecords calls and bytes, enhanced
//! fan-out pacing), the backend without limits unchanged, and a consumer at its default
//! settings that still handles every record once from a stream whose reads and writes
//! are limited.

use testkit as common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use common::hooks::{Forward, ForwardKinesis};
use common::*;
use futures_util::StreamExt;
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, RecordsPage, StartingPosition, StreamAdmin,
    Subscription,
};
use shardflow::lease::LeaseStore;
use shardflow::memory::{KinesisLimits, MemoryKinesis};
use shardflow::{Backend, Consumer, Memory};
use tokio::time::Instant;

const STREAM: &str = "limited";
const KIB: usize = 1024;
const MIB: u64 = 1024 * 1024;

async fn memory(shards: u32, limits: KinesisLimits) -> Memory {
    let memory = Memory::builder().limits(limits).build();
    memory
        .streams()
        .create_stream(STREAM, shards)
        .await
        .unwrap();
    memory
}

fn records(n: usize, bytes: usize) -> Vec<PutRecord> {
    (0..n)
        .map(|i| PutRecord {
            data: Bytes::from(vec![b'x'; bytes]),
            partition_key: format!("k{}", i % 10),
            explicit_hash_key: None,
        })
        .collect()
}

/// (stored, refused) of a PutRecords answer; every refusal must be the throughput code.
fn tally(outcomes: &[PutOutcome]) -> (usize, usize) {
    let mut stored = 0;
    let mut refused = 0;
    for o in outcomes {
        match o {
            PutOutcome::Stored { .. } => stored += 1,
            PutOutcome::Failed { code, .. } => {
                assert_eq!(code, "ProvisionedThroughputExceededException");
                refused += 1;
            }
        }
    }
    (stored, refused)
}

/// Puts the records in calls of at most 500 (all at the same instant), as Kinesis
/// takes them; returns how many were stored and refused.
async fn put(kinesis: &MemoryKinesis, records: &[PutRecord]) -> (usize, usize) {
    let (mut stored, mut refused) = (0, 0);
    for call in records.chunks(500) {
        let (s, r) = tally(&kinesis.put_records(STREAM, call).await.unwrap());
        stored += s;
        refused += r;
    }
    (stored, refused)
}

async fn shard_iterator(kinesis: &MemoryKinesis) -> String {
    kinesis
        .shard_iterator(
            STREAM,
            "shardId-000000000000",
            &StartingPosition::TrimHorizon,
        )
        .await
        .unwrap()
}

fn stored_count(kinesis: &MemoryKinesis) -> usize {
    kinesis.records(STREAM, "shardId-000000000000").len()
}

#[tokio::test(start_paused = true)]
async fn a_shard_takes_1000_records_per_second() {
    let memory = memory(1, KinesisLimits::aws()).await;
    let kinesis = memory.streams();
    assert_eq!(put(kinesis, &records(500, 10)).await, (500, 0));
    assert_eq!(put(kinesis, &records(500, 10)).await, (500, 0));
    // The 1,001st record within the second is refused, in the answer.
    let outcomes = kinesis.put_records(STREAM, &records(1, 10)).await.unwrap();
    assert!(
        matches!(&outcomes[0], PutOutcome::Failed { code, message }
            if code == "ProvisionedThroughputExceededException" && message.contains("shardId-000000000000")),
        "{outcomes:?}"
    );
    assert_eq!(stored_count(kinesis), 1_000);

    // Half a second later, half a second's quota is back; a whole second later, all of it.
    tokio::time::advance(Duration::from_millis(500)).await;
    assert_eq!(put(kinesis, &records(600, 10)).await, (500, 100));
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(put(kinesis, &records(1, 10)).await, (1, 0));
    assert_eq!(stored_count(kinesis), 1_501);

    // Idle for a minute: the burst is still one second's quota, not sixty.
    tokio::time::advance(Duration::from_secs(60)).await;
    assert_eq!(put(kinesis, &records(2_000, 10)).await, (1_000, 1_000));
}

#[tokio::test(start_paused = true)]
async fn a_shard_takes_1_mib_per_second_counting_data_and_partition_key() {
    let memory = memory(2, KinesisLimits::aws()).await;
    let kinesis = memory.streams();
    // 100 KiB of data plus a 2-byte key: 10 fit in 1 MiB, the 11th does not.
    let big = |n| {
        (0..n)
            .map(|_| PutRecord {
                data: Bytes::from(vec![0u8; 100 * KIB]),
                partition_key: "k0".into(),
                explicit_hash_key: None,
            })
            .collect::<Vec<_>>()
    };
    let outcomes = kinesis.put_records(STREAM, &big(11)).await.unwrap();
    assert_eq!(tally(&outcomes), (10, 1));
    assert!(matches!(outcomes[10], PutOutcome::Failed { .. }));
    // A small record still fits in what is left of the byte budget, and the other
    // shard has a budget of its own.
    let other_shard = PutRecord {
        data: Bytes::from(vec![0u8; 100 * KIB]),
        partition_key: "k0".into(),
        explicit_hash_key: Some(u128::MAX.to_string()),
    };
    let outcomes = kinesis
        .put_records(
            STREAM,
            &[
                big(1).remove(0),
                PutRecord {
                    data: Bytes::from_static(b"small"),
                    partition_key: "k0".into(),
                    explicit_hash_key: None,
                },
                other_shard,
            ],
        )
        .await
        .unwrap();
    assert!(matches!(outcomes[0], PutOutcome::Failed { .. }));
    assert!(matches!(outcomes[1], PutOutcome::Stored { .. }));
    assert!(
        matches!(&outcomes[2], PutOutcome::Stored { shard_id, .. } if shard_id == "shardId-000000000001")
    );

    // Half a second earns 512 KiB: five more.
    tokio::time::advance(Duration::from_millis(500)).await;
    assert_eq!(put(kinesis, &big(11)).await, (5, 6));
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(put(kinesis, &big(11)).await, (10, 1));
}

#[tokio::test(start_paused = true)]
async fn a_put_records_call_over_500_entries_or_5_mib_is_refused_whole() {
    let memory = memory(2, KinesisLimits::aws()).await;
    let kinesis = memory.streams();
    let over_count = kinesis.put_records(STREAM, &records(501, 10)).await;
    assert!(
        matches!(over_count, Err(KinesisError::Invalid(_))),
        "{over_count:?}"
    );
    // 5 MiB counts data and partition keys: six records of 1 MiB - 8 bytes with their
    // keys are over it, five are not (and explicit hash keys do not count).
    let mut big = records(6, MIB as usize - 8);
    for r in &mut big {
        r.explicit_hash_key = Some(u128::MAX.to_string());
    }
    let over_bytes = kinesis.put_records(STREAM, &big).await;
    assert!(
        matches!(over_bytes, Err(KinesisError::Invalid(_))),
        "{over_bytes:?}"
    );
    assert_eq!(
        stored_count(kinesis),
        0,
        "nothing of a refused call is stored"
    );
    memory.streams().set_limits(KinesisLimits {
        write_bytes_per_second: 0,
        ..KinesisLimits::aws()
    });
    let at_limit = kinesis.put_records(STREAM, &big[..5]).await.unwrap();
    assert_eq!(tally(&at_limit), (5, 0));
    assert_eq!(
        tally(
            &kinesis
                .put_records(STREAM, &records(500, 10))
                .await
                .unwrap()
        )
        .0,
        500
    );
}

#[tokio::test(start_paused = true)]
async fn get_records_answers_5_calls_per_second_per_shard() {
    let memory = memory(1, KinesisLimits::aws()).await;
    let kinesis = memory.streams();
    assert_eq!(put(kinesis, &records(10, 10)).await, (10, 0));
    let mut iterator = shard_iterator(kinesis).await;
    let mut read = 0;
    for _ in 0..5 {
        let page = kinesis.get_records(&iterator, 2).await.unwrap();
        read += page.records.len();
        iterator = page.next_iterator.unwrap();
    }
    assert_eq!(read, 10);
    let refused = kinesis.get_records(&iterator, 2).await;
    assert!(
        matches!(&refused, Err(KinesisError::Throttled(d)) if d.to_string().contains("ProvisionedThroughputExceededException")),
        "{refused:?}"
    );
    // A refused call costs nothing: 200 ms later one call is allowed again, not two.
    tokio::time::advance(Duration::from_millis(200)).await;
    kinesis.get_records(&iterator, 2).await.unwrap();
    assert!(matches!(
        kinesis.get_records(&iterator, 2).await,
        Err(KinesisError::Throttled(_))
    ));
    tokio::time::advance(Duration::from_secs(1)).await;
    for _ in 0..5 {
        kinesis.get_records(&iterator, 2).await.unwrap();
    }
    assert!(kinesis.get_records(&iterator, 2).await.is_err());
}

#[tokio::test(start_paused = true)]
async fn reads_over_2_mib_per_second_throttle_the_calls_that_follow() {
    let memory = memory(1, KinesisLimits::none()).await;
    let kinesis = memory.streams();
    // 150 records of 100 KiB + a 2-byte key, written without limits.
    assert_eq!(put(kinesis, &records(150, 100 * KIB)).await, (150, 0));
    let size = (100 * KIB + 2) as u64;
    kinesis.set_limits(KinesisLimits::aws());
    let iterator = shard_iterator(kinesis).await;

    // 30 records (about 2.9 MiB) in one answer: served in full, then the shard's read
    // budget is 0.93 MiB short and the next calls are refused until it is earned back.
    let page = kinesis.get_records(&iterator, 30).await.unwrap();
    assert_eq!(page.records.len(), 30);
    let iterator = page.next_iterator.unwrap();
    let owed = Duration::from_secs_f64((30 * size - 2 * MIB) as f64 / (2 * MIB) as f64);
    let start = Instant::now();
    assert!(matches!(
        kinesis.get_records(&iterator, 1).await,
        Err(KinesisError::Throttled(_))
    ));
    tokio::time::advance(owed - Duration::from_millis(10)).await;
    assert!(matches!(
        kinesis.get_records(&iterator, 1).await,
        Err(KinesisError::Throttled(_))
    ));
    tokio::time::advance(Duration::from_millis(20)).await;
    let page = kinesis.get_records(&iterator, 10_000).await.unwrap();
    assert!(start.elapsed() > owed);

    // That call asked for everything: one answer carries at most 10 MiB (102 records),
    // and as the budget was empty, the calls of the next ~5 s are refused.
    assert_eq!(page.records.len(), 102);
    let iterator = page.next_iterator.unwrap();
    let owed = Duration::from_secs_f64((102 * size) as f64 / (2 * MIB) as f64);
    tokio::time::advance(owed - Duration::from_millis(20)).await;
    assert!(matches!(
        kinesis.get_records(&iterator, 100).await,
        Err(KinesisError::Throttled(_))
    ));
    tokio::time::advance(Duration::from_millis(30)).await;
    let page = kinesis.get_records(&iterator, 100).await.unwrap();
    assert_eq!(page.records.len(), 150 - 30 - 102);
}

#[tokio::test(start_paused = true)]
async fn fan_out_paces_each_consumer_to_2_mib_per_second_per_shard() {
    let memory = memory(1, KinesisLimits::none()).await;
    let kinesis = memory.streams();
    let total = 60;
    assert_eq!(put(kinesis, &records(total, 100 * KIB)).await, (total, 0));
    let size = (100 * KIB + 2) as u64;
    kinesis.set_limits(KinesisLimits::aws());

    let mut readers = Vec::new();
    for name in ["a", "b"] {
        let arn = kinesis.register_consumer(STREAM, name).await.unwrap();
        let subscription = kinesis
            .subscribe_to_shard(&arn, "shardId-000000000000", &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        readers.push(tokio::spawn(deliveries(subscription, total)));
    }
    for reader in readers {
        let deliveries = within(Duration::from_secs(60), "fan-out delivers", reader)
            .await
            .unwrap();
        // Never ahead of the budget: one second's burst plus 2 MiB per second since.
        for &(at, delivered) in &deliveries {
            let allowed = 2.0 * MIB as f64 * (1.0 + at.as_secs_f64());
            assert!(
                (delivered * size) as f64 <= allowed,
                "{delivered} records after {at:?}"
            );
        }
        // And not slower: each consumer has its own budget, so both get everything
        // (about 5.9 MiB) in about 1.9 s, not twice that.
        let (first_at, first) = deliveries[0];
        assert_eq!((first_at, first), (Duration::ZERO, 20), "the first burst");
        let (last_at, last) = *deliveries.last().unwrap();
        assert_eq!(last, total as u64);
        let expected = (total as u64 * size - 2 * MIB) as f64 / (2 * MIB) as f64;
        assert!(
            (last_at.as_secs_f64() - expected).abs() < 0.1,
            "all delivered after {last_at:?}, expected about {expected:.2} s"
        );
    }
}

/// (time since the start, records delivered so far) after each event with records,
/// until `total` records came.
async fn deliveries(mut subscription: Subscription, total: usize) -> Vec<(Duration, u64)> {
    let start = Instant::now();
    let mut delivered = 0;
    let mut out = Vec::new();
    while delivered < total {
        let event = subscription.next().await.unwrap().unwrap();
        if !event.records.is_empty() {
            delivered += event.records.len();
            out.push((start.elapsed(), delivered as u64));
        }
    }
    out
}

#[tokio::test(start_paused = true)]
async fn without_limits_nothing_is_refused_or_paced() {
    assert_eq!(KinesisLimits::default(), KinesisLimits::none());
    for memory in [Memory::new(), Memory::builder().build()] {
        let kinesis = memory.streams();
        kinesis.create_stream(STREAM, 1).await.unwrap();
        let start = Instant::now();
        for _ in 0..10 {
            assert_eq!(put(kinesis, &records(500, 10)).await, (500, 0));
        }
        assert_eq!(put(kinesis, &records(30, MIB as usize)).await, (30, 0));
        let mut iterator = shard_iterator(kinesis).await;
        for _ in 0..50 {
            let page = kinesis.get_records(&iterator, 100).await.unwrap();
            iterator = page.next_iterator.unwrap();
        }
        // All 30 MiB in one answer (no 10 MiB cap without limits).
        let iterator = shard_iterator(kinesis).await;
        let page = kinesis.get_records(&iterator, 10_000).await.unwrap();
        assert_eq!(page.records.len(), 5_030);
        let arn = kinesis.register_consumer(STREAM, "c").await.unwrap();
        let mut subscription = kinesis
            .subscribe_to_shard(&arn, "shardId-000000000000", &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        let mut delivered = 0;
        while delivered < 5_030 {
            delivered += subscription.next().await.unwrap().unwrap().records.len();
        }
        assert_eq!(start.elapsed(), Duration::ZERO, "no time passed");
    }
}

#[tokio::test(start_paused = true)]
async fn a_consumer_at_default_settings_handles_every_record_once_under_the_limits() {
    let backend = consume_under_limits(None).await;
    assert!(
        backend.throttled() > 0,
        "the limits never throttled a read: the test proves nothing"
    );
}

#[tokio::test(start_paused = true)]
async fn a_fan_out_consumer_handles_every_record_once_at_the_paced_rate() {
    let start = Instant::now();
    consume_under_limits(Some("limited-app")).await;
    // About 6 MiB per shard at 2 MiB per second after a one-second burst: the pacing
    // held the consumer back.
    assert!(
        start.elapsed() > Duration::from_secs(2),
        "done after {:?}: fan-out was not paced",
        start.elapsed()
    );
}

/// A consumer at its default settings (through enhanced fan-out when `fan_out` names
/// its consumer) reads a backlog of a stream with AWS' limits while a writer adds to it
/// at the write limit: every record is handled once, in order per shard.
async fn consume_under_limits(fan_out: Option<&str>) -> Throttles {
    let memory = memory(2, KinesisLimits::none()).await;
    // A backlog of 12,000 records of 1 KiB (about 6 MiB per shard), written before the
    // limits are switched on: the default read of 10,000 records per call is far more
    // than 2 MiB, so the reader is throttled and must back off and resume.
    let value = |v: usize| Bytes::from(format!("{v:01024}"));
    let backlog = 12_000;
    let write = |range: std::ops::Range<usize>| {
        range
            .map(|v| PutRecord {
                data: value(v),
                partition_key: format!("pk-{}", v % 1_000),
                explicit_hash_key: None,
            })
            .collect::<Vec<_>>()
    };
    put_all(memory.streams().as_ref(), STREAM, write(0..backlog)).await;
    memory.streams().set_limits(KinesisLimits::aws());

    let backend = Throttles::new(memory.clone());
    let mut builder = Consumer::builder()
        .stream(STREAM)
        .group("limited")
        .worker_id("w1")
        .backend(backend.clone());
    if let Some(name) = fan_out {
        builder = builder.fan_out(name);
    }
    let consumer = builder.build().unwrap();
    let recorder = Recorder::default();
    let running = start(consumer, &recorder);

    // Meanwhile a writer at the write limit: 4,000 more records, retrying refusals.
    let total = backlog + 4_000;
    let writer = {
        let kinesis = memory.streams().clone();
        let more = write(backlog..total);
        tokio::spawn(async move {
            put_all(kinesis.as_ref(), STREAM, more).await;
        })
    };
    recorder.wait_for(total, Duration::from_secs(600)).await;
    within(Duration::from_secs(60), "the writer ends", writer)
        .await
        .unwrap();
    running.stop().await;

    let shards = open_shards(memory.streams().as_ref(), STREAM).await;
    assert_exactly_once_in_order(&recorder.snapshot(), total, &shards);
    backend
}

/// The embedded backend, counting the GetRecords calls refused as throttled.
#[derive(Clone)]
struct Throttles {
    memory: Memory,
    throttled: Arc<AtomicUsize>,
}

impl Throttles {
    fn new(memory: Memory) -> Self {
        Throttles {
            memory,
            throttled: Arc::default(),
        }
    }

    fn throttled(&self) -> usize {
        self.throttled.load(Ordering::SeqCst)
    }
}

impl Backend for Throttles {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        Arc::new(Forward(self.clone()))
    }
    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        self.memory.lease_store(table)
    }
    fn admin(&self) -> Option<Arc<dyn StreamAdmin>> {
        self.memory.admin()
    }
}

#[async_trait]
impl ForwardKinesis for Throttles {
    fn inner(&self) -> &dyn KinesisApi {
        self.memory.streams().as_ref()
    }
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        let page = self.memory.streams().get_records(iterator, limit).await;
        if let Err(KinesisError::Throttled(_)) = page {
            self.throttled.fetch_add(1, Ordering::SeqCst);
        }
        page
    }
}
