//! `run` with per-key (and unordered) concurrency on the embedded backend under the
//! paused clock: per-key order, no loss, the checkpoint never past an unfinished record,
//! redelivery after a failure, a drain without duplicates, and the limits (per shard,
//! worker-wide, the service's own readiness).

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use shardflow::kinesis::KinesisApi;
use shardflow::lease::Checkpoint;
use shardflow::Backend;
use shardflow::{Concurrency, ConsumerBuilder, Memory, Message, SequenceNumber};
use tokio::sync::Semaphore;

const LIMIT: Duration = Duration::from_secs(600);

/// How many calls are in flight, the most seen at once, and whether two calls of one
/// partition key ever overlapped.
#[derive(Clone, Default)]
struct Gauge {
    now: Arc<AtomicUsize>,
    max: Arc<AtomicUsize>,
    keys: Arc<Mutex<HashSet<String>>>,
    overlaps: Arc<AtomicUsize>,
}

impl Gauge {
    fn enter(&self, key: &str) {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.max.fetch_max(now, Ordering::SeqCst);
        if !self.keys.lock().unwrap().insert(key.to_owned()) {
            self.overlaps.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn leave(&self, key: &str) {
        self.keys.lock().unwrap().remove(key);
        self.now.fetch_sub(1, Ordering::SeqCst);
    }

    fn max(&self) -> usize {
        self.max.load(Ordering::SeqCst)
    }

    fn overlaps(&self) -> usize {
        self.overlaps.load(Ordering::SeqCst)
    }
}

fn value(msg: &Message) -> usize {
    std::str::from_utf8(&msg.payload).unwrap().parse().unwrap()
}

/// What the handlers below do with a record.
#[derive(Clone)]
struct Behaviour {
    /// How long a call takes.
    delay: fn(usize) -> Duration,
    /// Values whose first attempt fails.
    fail_once: Arc<Mutex<HashSet<usize>>>,
    /// A value whose call waits until `release` gets a permit.
    blocked: Option<usize>,
    release: Arc<Semaphore>,
}

impl Behaviour {
    fn sleeping(delay: fn(usize) -> Duration) -> Self {
        Behaviour {
            delay,
            fail_once: Arc::default(),
            blocked: None,
            release: Arc::new(Semaphore::new(0)),
        }
    }
}

/// A handler that records every call as it starts (`started`, in call order) and every
/// success as it ends (`handled`), through `gauge`.
fn handler(
    behaviour: Behaviour,
    gauge: Gauge,
    started: Recorder,
    handled: Recorder,
) -> impl tower::Service<Message, Response = (), Error = &'static str, Future = impl Send + 'static>
       + Clone
       + Send
       + 'static {
    tower::service_fn(move |msg: Message| {
        let (behaviour, gauge, handled) = (behaviour.clone(), gauge.clone(), handled.clone());
        started.record(&msg);
        let key = msg.headers.partition_key.clone();
        gauge.enter(&key);
        async move {
            let v = value(&msg);
            tokio::time::sleep((behaviour.delay)(v)).await;
            if behaviour.blocked == Some(v) {
                behaviour.release.acquire().await.unwrap().forget();
            }
            let fail = behaviour.fail_once.lock().unwrap().remove(&v);
            gauge.leave(&key);
            if fail {
                return Err("injected failure");
            }
            handled.record(&msg);
            Ok(())
        }
    })
}

fn consumer(memory: &Memory, stream: &str, worker: &str) -> ConsumerBuilder {
    test_consumer(memory.clone(), stream, &format!("{stream}-group"), worker)
        .max_records_per_read(50)
}

/// Per key, values only ascend among first deliveries: a record delivered again is
/// fine, a new one behind a later one of its key is not.
fn assert_new_records_in_key_order(started: &[Handled]) {
    let mut seen = HashSet::new();
    let mut last: HashMap<&str, usize> = HashMap::new();
    for h in started {
        if !seen.insert(h.value) {
            continue;
        }
        if let Some(prev) = last.insert(&h.partition_key, h.value) {
            assert!(
                prev < h.value,
                "key {} got {} after {prev}",
                h.partition_key,
                h.value
            );
        }
    }
}

/// The stored checkpoint of every shard, by shard.
async fn stored(memory: &Memory, stream: &str) -> HashMap<String, Checkpoint> {
    let rows = memory
        .lease_store(&format!("{stream}-group"))
        .list()
        .await
        .unwrap();
    checkpoints(&rows).into_iter().collect()
}

/// The last sequence number handled per shard.
fn last_handled(handled: &[Handled]) -> HashMap<String, SequenceNumber> {
    let mut last: HashMap<String, SequenceNumber> = HashMap::new();
    for h in handled {
        let entry = last
            .entry(h.shard.clone())
            .or_insert_with(|| h.sequence.clone());
        if h.sequence > *entry {
            *entry = h.sequence.clone();
        }
    }
    last
}

#[tokio::test(start_paused = true)]
async fn per_key_concurrency_keeps_each_keys_order_and_loses_nothing() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("keyed", 4).await.unwrap();
    produce(kinesis.as_ref(), "keyed", 0..4_000).await;
    let (gauge, started, handled) = (Gauge::default(), Recorder::default(), Recorder::default());
    let behaviour = Behaviour::sleeping(|v| Duration::from_millis(1 + (v as u64 * 7) % 13));
    let run = start_service(
        consumer(&memory, "keyed", "w1")
            .concurrency(Concurrency::PerKey(16))
            .build()
            .unwrap(),
        handler(behaviour, gauge.clone(), started.clone(), handled.clone()),
    );
    handled.wait_for(4_000, LIMIT).await;
    run.stop().await;

    let handled = handled.snapshot();
    let values: HashSet<usize> = handled.iter().map(|h| h.value).collect();
    assert_eq!(handled.len(), 4_000, "each record handled once");
    assert_eq!(values.len(), 4_000, "no record lost");
    // Keys are pk-{value % 64}: within a key, values ascend with sequence numbers.
    assert_partition_key_order(&started.snapshot());
    assert_eq!(gauge.overlaps(), 0, "two calls of one key overlapped");
    assert!(
        gauge.max() > 16 && gauge.max() <= 64,
        "4 shards x PerKey(16): {} calls at once at most",
        gauge.max()
    );
    // Every shard's checkpoint at its last record once everything is handled.
    let stored = stored(&memory, "keyed").await;
    for (shard, last) in last_handled(&handled) {
        assert_eq!(
            stored.get(&shard),
            Some(&Checkpoint::At(shardflow::Position::new(last, 0))),
            "{shard}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn the_checkpoint_never_passes_an_unfinished_record() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("blocked", 1).await.unwrap();
    produce(kinesis.as_ref(), "blocked", 0..300).await;
    let (gauge, started, handled) = (Gauge::default(), Recorder::default(), Recorder::default());
    let mut behaviour = Behaviour::sleeping(|_| Duration::from_millis(5));
    behaviour.blocked = Some(10);
    let release = behaviour.release.clone();
    let run = start_service(
        consumer(&memory, "blocked", "w1")
            .concurrency(Concurrency::PerKey(16))
            .build()
            .unwrap(),
        handler(behaviour, gauge, started, handled.clone()),
    );
    // Value 10 (key pk-10) blocks, and so do the later records of its key (74, 138,
    // 202, 266) behind it; every other record finishes.
    handled.wait_for(295, LIMIT).await;
    // Many checkpoint intervals (100 ms) pass with everything else handled.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let nine = handled
        .snapshot()
        .into_iter()
        .find(|h| h.value == 9)
        .unwrap()
        .sequence;
    let shard = handled.snapshot()[0].shard.clone();
    assert_eq!(
        stored(&memory, "blocked").await.get(&shard),
        Some(&Checkpoint::At(shardflow::Position::new(nine, 0))),
        "the checkpoint stays just before the unfinished record 10"
    );
    release.add_permits(1);
    handled.wait_for(300, LIMIT).await;
    run.stop().await;
    let last = last_handled(&handled.snapshot()).remove(&shard).unwrap();
    assert_eq!(
        stored(&memory, "blocked").await.get(&shard),
        Some(&Checkpoint::At(shardflow::Position::new(last, 0))),
        "once record 10 finished, the checkpoint reaches the end"
    );
}

#[tokio::test(start_paused = true)]
async fn a_failure_in_the_middle_redelivers_from_the_checkpoint_and_skips_nothing() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("failing", 2).await.unwrap();
    produce(kinesis.as_ref(), "failing", 0..2_000).await;
    let (gauge, started, handled) = (Gauge::default(), Recorder::default(), Recorder::default());
    let behaviour = Behaviour::sleeping(|v| Duration::from_millis(1 + (v as u64 * 11) % 7));
    let failing = [333, 1_000, 1_501];
    behaviour.fail_once.lock().unwrap().extend(failing);
    let fail_once = behaviour.fail_once.clone();
    let run = start_service(
        consumer(&memory, "failing", "w1")
            .concurrency(Concurrency::PerKey(32))
            .build()
            .unwrap(),
        handler(behaviour, gauge.clone(), started.clone(), handled.clone()),
    );
    let all: Vec<usize> = (0..2_000).collect();
    handled.wait_for_values(&all, LIMIT).await;
    run.stop().await;

    assert!(
        fail_once.lock().unwrap().is_empty(),
        "every failure injected"
    );
    let started = started.snapshot();
    for v in failing {
        assert!(
            started.iter().filter(|h| h.value == v).count() >= 2,
            "{v} failed and was delivered again"
        );
    }
    assert_new_records_in_key_order(&started);
    assert_eq!(gauge.overlaps(), 0, "two calls of one key overlapped");
    let handled = handled.snapshot();
    let duplicates = handled.len() - 2_000;
    // Redelivered: what finished beyond the failed record, at most the records taken
    // (4 x 32) per failure.
    assert!(
        duplicates <= failing.len() * 4 * 32,
        "{duplicates} records handled twice"
    );
    let stored = stored(&memory, "failing").await;
    for (shard, last) in last_handled(&handled) {
        assert_eq!(
            stored.get(&shard),
            Some(&Checkpoint::At(shardflow::Position::new(last, 0))),
            "{shard}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_drain_finishes_what_was_taken_and_hands_over_without_duplicates() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("drained", 2).await.unwrap();
    produce(kinesis.as_ref(), "drained", 0..2_000).await;
    let first = Recorder::default();
    let behaviour = Behaviour::sleeping(|v| Duration::from_millis(1 + (v as u64 * 13) % 17));
    let run = start_service(
        consumer(&memory, "drained", "w1")
            .concurrency(Concurrency::PerKey(32))
            .build()
            .unwrap(),
        handler(
            behaviour.clone(),
            Gauge::default(),
            Recorder::default(),
            first.clone(),
        ),
    );
    first.wait_for(500, LIMIT).await;
    run.stop().await;
    let before = first.snapshot();
    assert!(before.len() < 2_000, "stopped in the middle");

    let second = Recorder::default();
    let gauge = Gauge::default();
    let run = start_service(
        consumer(&memory, "drained", "w2")
            .concurrency(Concurrency::PerKey(32))
            .build()
            .unwrap(),
        handler(behaviour, gauge, Recorder::default(), second.clone()),
    );
    let rest: Vec<usize> = {
        let done: HashSet<usize> = before.iter().map(|h| h.value).collect();
        (0..2_000).filter(|v| !done.contains(v)).collect()
    };
    second.wait_for_values(&rest, LIMIT).await;
    run.stop().await;
    let mut all: Vec<usize> = before
        .iter()
        .chain(second.snapshot().iter())
        .map(|h| h.value)
        .collect();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..2_000).collect::<Vec<_>>(),
        "every record once over the two owners (none handled again after the drain)"
    );
}

#[tokio::test(start_paused = true)]
async fn the_worker_wide_limit_holds_over_all_shards() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("limited", 4).await.unwrap();
    produce(kinesis.as_ref(), "limited", 0..2_000).await;
    let (gauge, handled) = (Gauge::default(), Recorder::default());
    let run = start_service(
        consumer(&memory, "limited", "w1")
            .concurrency(Concurrency::PerKey(64))
            .max_concurrent_calls(10)
            .build()
            .unwrap(),
        handler(
            Behaviour::sleeping(|_| Duration::from_millis(10)),
            gauge.clone(),
            Recorder::default(),
            handled.clone(),
        ),
    );
    handled.wait_for(2_000, LIMIT).await;
    run.stop().await;
    assert_eq!(
        gauge.max(),
        10,
        "at most (and, with 4 x 64 allowed, exactly) 10 calls at once"
    );
}

#[tokio::test(start_paused = true)]
async fn unordered_concurrency_is_limited_per_shard() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("unordered", 4).await.unwrap();
    produce(kinesis.as_ref(), "unordered", 0..1_000).await;
    let (gauge, handled) = (Gauge::default(), Recorder::default());
    let run = start_service(
        consumer(&memory, "unordered", "w1")
            .concurrency(Concurrency::Unordered(3))
            .build()
            .unwrap(),
        handler(
            Behaviour::sleeping(|_| Duration::from_millis(10)),
            gauge.clone(),
            Recorder::default(),
            handled.clone(),
        ),
    );
    handled.wait_for(1_000, LIMIT).await;
    run.stop().await;
    let values: HashSet<usize> = handled.snapshot().iter().map(|h| h.value).collect();
    assert_eq!(values.len(), 1_000);
    assert_eq!(gauge.max(), 12, "4 shards x 3 calls");
}

#[tokio::test(start_paused = true)]
async fn the_services_readiness_is_honoured() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("ready", 2).await.unwrap();
    produce(kinesis.as_ref(), "ready", 0..500).await;
    let (gauge, handled) = (Gauge::default(), Recorder::default());
    let service = tower::ServiceBuilder::new()
        .concurrency_limit(3)
        .service(handler(
            Behaviour::sleeping(|_| Duration::from_millis(10)),
            gauge.clone(),
            Recorder::default(),
            handled.clone(),
        ));
    let run = start_service(
        consumer(&memory, "ready", "w1")
            .concurrency(Concurrency::PerKey(64))
            .build()
            .unwrap(),
        service,
    );
    handled.wait_for(500, LIMIT).await;
    run.stop().await;
    assert_eq!(
        gauge.max(),
        3,
        "the ConcurrencyLimit(3) is ready for 3 calls at once"
    );
}
