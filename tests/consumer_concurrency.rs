//! `run` with per-key (and unordered) concurrency on the embedded backend under the
//! paused clock: per-key order, no loss, the checkpoint never past an unfinished record,
//! redelivery after a failure, a drain without duplicates, and the limits (per shard,
//! worker-wide, the service's own readiness).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardflow::kinesis::StreamAdmin;
use shardflow::lease::Checkpoint;
use shardflow::Backend;
use shardflow::{Concurrency, ConsumerBuilder, Memory, Message, SequenceNumber};
use testkit::*;
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
        let key = msg.metadata.partition_key.clone();
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

/// What a test watches: calls at once (and overlaps per key), every call as it
/// starts, every success as it ends.
#[derive(Clone, Default)]
struct Probe {
    gauge: Gauge,
    started: Recorder,
    handled: Recorder,
}

/// A memory backend with stream `stream` of `shards` shards holding the values
/// `0..records` (partition keys `pk-{value % 64}`).
async fn stream_of(stream: &str, shards: u32, records: usize) -> Memory {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream(stream, shards).await.unwrap();
    produce(kinesis.as_ref(), stream, 0..records).await;
    memory
}

/// Runs worker `worker` on `stream` with `concurrency` (and `tweak` applied to the
/// builder), its handler doing `behaviour` and reporting to `probe`.
fn run(
    memory: &Memory,
    stream: &str,
    worker: &str,
    concurrency: Concurrency,
    tweak: impl FnOnce(ConsumerBuilder) -> ConsumerBuilder,
    behaviour: Behaviour,
    probe: &Probe,
) -> Running {
    let builder = test_consumer(memory.clone(), stream, &format!("{stream}-group"), worker)
        .max_records_per_read(50)
        .concurrency(concurrency);
    let service = handler(
        behaviour,
        probe.gauge.clone(),
        probe.started.clone(),
        probe.handled.clone(),
    );
    start_service(tweak(builder).build().unwrap(), service)
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

/// Asserts that every shard's stored checkpoint is at the last record handled in it.
async fn assert_checkpoints_at_the_last_handled(
    memory: &Memory,
    stream: &str,
    handled: &[Handled],
) {
    let stored = stored(memory, stream).await;
    for (shard, last) in last_handled(handled) {
        assert_eq!(
            stored.get(&shard),
            Some(&Checkpoint::At(shardflow::Position::new(last, 0))),
            "{shard}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn per_key_concurrency_keeps_each_keys_order_and_loses_nothing() {
    let memory = stream_of("keyed", 4, 4_000).await;
    let probe = Probe::default();
    let behaviour = Behaviour::sleeping(|v| Duration::from_millis(1 + (v as u64 * 7) % 13));
    let running = run(
        &memory,
        "keyed",
        "w1",
        Concurrency::PerKey(16),
        |b| b,
        behaviour,
        &probe,
    );
    probe.handled.wait_for(4_000, LIMIT).await;
    running.stop().await;

    let handled = probe.handled.snapshot();
    let values: HashSet<usize> = handled.iter().map(|h| h.value).collect();
    assert_eq!(handled.len(), 4_000, "each record handled once");
    assert_eq!(values.len(), 4_000, "no record lost");
    // Keys are pk-{value % 64}: within a key, values ascend with sequence numbers.
    assert_partition_key_order(&probe.started.snapshot());
    assert_eq!(probe.gauge.overlaps(), 0, "two calls of one key overlapped");
    let max = probe.gauge.max();
    assert!(
        max > 16 && max <= 64,
        "4 shards x PerKey(16): {max} calls at once"
    );
    assert_checkpoints_at_the_last_handled(&memory, "keyed", &handled).await;
}

#[tokio::test(start_paused = true)]
async fn the_checkpoint_never_passes_an_unfinished_record() {
    let memory = stream_of("blocked", 1, 300).await;
    let probe = Probe::default();
    let mut behaviour = Behaviour::sleeping(|_| Duration::from_millis(5));
    behaviour.blocked = Some(10);
    let release = behaviour.release.clone();
    let running = run(
        &memory,
        "blocked",
        "w1",
        Concurrency::PerKey(16),
        |b| b,
        behaviour,
        &probe,
    );
    // Value 10 (key pk-10) blocks, and so does 74 (same key) behind it. Reads bring 50
    // records; with 4 x 16 places the shard takes a second read (50 < 64 records open)
    // but no third (100): every other record of 0..100 finishes, nothing beyond.
    probe.handled.wait_for(98, LIMIT).await;
    // Many checkpoint intervals (100 ms) pass with everything else handled.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let handled = probe.handled.snapshot();
    assert_eq!(
        handled.len(),
        98,
        "the shard works no further than 4 x 16 records (plus one read) past its checkpoint"
    );
    let nine = handled
        .iter()
        .find(|h| h.value == 9)
        .unwrap()
        .sequence
        .clone();
    let shard = handled[0].shard.clone();
    assert_eq!(
        stored(&memory, "blocked").await.get(&shard),
        Some(&Checkpoint::At(shardflow::Position::new(nine, 0))),
        "the checkpoint stays just before the unfinished record 10"
    );
    release.add_permits(1);
    probe.handled.wait_for(300, LIMIT).await;
    running.stop().await;
    // Once record 10 finished, the checkpoint reaches the end.
    assert_checkpoints_at_the_last_handled(&memory, "blocked", &probe.handled.snapshot()).await;
}

#[tokio::test(start_paused = true)]
async fn a_failure_in_the_middle_redelivers_from_the_checkpoint_and_skips_nothing() {
    let memory = stream_of("failing", 2, 2_000).await;
    let probe = Probe::default();
    let behaviour = Behaviour::sleeping(|v| Duration::from_millis(1 + (v as u64 * 11) % 7));
    let failing = [333, 1_000, 1_501];
    behaviour.fail_once.lock().unwrap().extend(failing);
    let fail_once = behaviour.fail_once.clone();
    let running = run(
        &memory,
        "failing",
        "w1",
        Concurrency::PerKey(32),
        |b| b,
        behaviour,
        &probe,
    );
    let all: Vec<usize> = (0..2_000).collect();
    probe.handled.wait_for_values(&all, LIMIT).await;
    running.stop().await;

    assert!(
        fail_once.lock().unwrap().is_empty(),
        "every failure injected"
    );
    let started = probe.started.snapshot();
    for v in failing {
        assert!(
            started.iter().filter(|h| h.value == v).count() >= 2,
            "{v} failed and was delivered again"
        );
    }
    assert_new_records_in_key_order(&started);
    assert_eq!(probe.gauge.overlaps(), 0, "two calls of one key overlapped");
    let handled = probe.handled.snapshot();
    let duplicates = handled.len() - 2_000;
    // Redelivered: what finished beyond the failed record, at most the records of the
    // open batches (4 x 32, plus one read of 50) per failure.
    assert!(
        duplicates <= failing.len() * (4 * 32 + 50),
        "{duplicates} records handled twice"
    );
    assert_checkpoints_at_the_last_handled(&memory, "failing", &handled).await;
}

#[tokio::test(start_paused = true)]
async fn a_drain_finishes_what_was_taken_and_hands_over_without_duplicates() {
    let memory = stream_of("drained", 2, 2_000).await;
    let behaviour = Behaviour::sleeping(|v| Duration::from_millis(1 + (v as u64 * 13) % 17));
    let first = Probe::default();
    let running = run(
        &memory,
        "drained",
        "w1",
        Concurrency::PerKey(32),
        |b| b,
        behaviour.clone(),
        &first,
    );
    first.handled.wait_for(500, LIMIT).await;
    running.stop().await;
    let before = first.handled.snapshot();
    assert!(before.len() < 2_000, "stopped in the middle");

    let second = Probe::default();
    let running = run(
        &memory,
        "drained",
        "w2",
        Concurrency::PerKey(32),
        |b| b,
        behaviour,
        &second,
    );
    let rest: Vec<usize> = {
        let done: HashSet<usize> = before.iter().map(|h| h.value).collect();
        (0..2_000).filter(|v| !done.contains(v)).collect()
    };
    second.handled.wait_for_values(&rest, LIMIT).await;
    running.stop().await;
    let mut all: Vec<usize> = before
        .iter()
        .chain(second.handled.snapshot().iter())
        .map(|h| h.value)
        .collect();
    all.sort_unstable();
    let twice: Vec<usize> = all
        .windows(2)
        .filter(|w| w[0] == w[1])
        .map(|w| w[0])
        .collect();
    assert!(
        twice.is_empty(),
        "{} records handled by both owners (the drain should have finished them), e.g. {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    all.dedup();
    assert_eq!(all.len(), 2_000, "every record handled");
}

#[tokio::test(start_paused = true)]
async fn the_worker_wide_limit_holds_over_all_shards() {
    let memory = stream_of("limited", 4, 2_000).await;
    let probe = Probe::default();
    let behaviour = Behaviour::sleeping(|_| Duration::from_millis(10));
    let running = run(
        &memory,
        "limited",
        "w1",
        Concurrency::PerKey(64),
        |b| b.max_concurrent_calls(10),
        behaviour,
        &probe,
    );
    probe.handled.wait_for(2_000, LIMIT).await;
    running.stop().await;
    assert_eq!(
        probe.gauge.max(),
        10,
        "at most (and, with 4 x 64 allowed, exactly) 10 calls at once"
    );
}

#[tokio::test(start_paused = true)]
async fn unordered_concurrency_is_limited_per_shard() {
    let memory = stream_of("unordered", 4, 1_000).await;
    let probe = Probe::default();
    let behaviour = Behaviour::sleeping(|_| Duration::from_millis(10));
    let running = run(
        &memory,
        "unordered",
        "w1",
        Concurrency::Unordered(3),
        |b| b,
        behaviour,
        &probe,
    );
    probe.handled.wait_for(1_000, LIMIT).await;
    running.stop().await;
    let values: HashSet<usize> = probe.handled.snapshot().iter().map(|h| h.value).collect();
    assert_eq!(values.len(), 1_000);
    assert_eq!(probe.gauge.max(), 12, "4 shards x 3 calls");
}

#[tokio::test(start_paused = true)]
async fn the_services_readiness_is_honoured() {
    let memory = stream_of("ready", 2, 500).await;
    let probe = Probe::default();
    let service = tower::ServiceBuilder::new()
        .concurrency_limit(3)
        .service(handler(
            Behaviour::sleeping(|_| Duration::from_millis(10)),
            probe.gauge.clone(),
            probe.started.clone(),
            probe.handled.clone(),
        ));
    let consumer = test_consumer(memory.clone(), "ready", "ready-group", "w1")
        .concurrency(Concurrency::PerKey(64))
        .build()
        .unwrap();
    let running = start_service(consumer, service);
    probe.handled.wait_for(500, LIMIT).await;
    running.stop().await;
    assert_eq!(
        probe.gauge.max(),
        3,
        "the ConcurrencyLimit(3) is ready for 3 calls at once"
    );
}
