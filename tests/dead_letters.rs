//! A poison record never holds a shard in batch mode: `Consumer::run_batches` with a
//! `Bisect` layer over a bulk handler. The other records are handled and acknowledged,
//! the poison record goes to the dead-letter sink once, and the checkpoint passes it —
//! or, when the sink is down, stops just before it and loses nothing. Embedded backend,
//! tokio's paused clock.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rand::{Rng, SeedableRng};
use shardflow::kinesis::{PutRecord, StreamAdmin};
use shardflow::lease::Checkpoint;
use shardflow::{Batch, Memory, Message, Metadata, SequenceNumber};
use shardflow_middleware::bisect::{BisectConfig, BisectLayer};
use shardflow_middleware::dead_letter::DeadLetterRecord;
use shardflow_middleware::{BatchConfig, Batching, BoxError, ServiceBuilderExt};
use tower::{Layer, ServiceBuilder};

use testkit::{put_all, within};

const LIMIT: Duration = Duration::from_secs(120);

/// A transient failure of the bulk handler's store.
#[derive(Debug, thiserror::Error)]
#[error("the database is down")]
struct Down;

fn not_down(e: &(dyn std::error::Error + Send + Sync + 'static), _: &Metadata) -> bool {
    !e.is::<Down>()
}

fn value(msg: &Message) -> usize {
    std::str::from_utf8(&msg.payload).unwrap().parse().unwrap()
}

/// One handler call: the values of its batch and whether it failed.
type Call = (Vec<usize>, bool);

/// What the handler and the sink saw.
#[derive(Clone, Default)]
struct Seen {
    /// Every call: the values of its batch and whether it failed.
    calls: Arc<Mutex<Vec<Call>>>,
    /// Values handled (in successful calls), with their sequence numbers.
    handled: Arc<Mutex<Vec<(usize, SequenceNumber)>>>,
    /// Dead letters: value and error text.
    sunk: Arc<Mutex<Vec<(usize, String)>>>,
    sink_failures: Arc<AtomicUsize>,
    done: Arc<tokio::sync::Notify>,
}

impl Seen {
    fn handled_counts(&self) -> BTreeMap<usize, usize> {
        let mut counts = BTreeMap::new();
        for (v, _) in self.handled.lock().unwrap().iter() {
            *counts.entry(*v).or_insert(0) += 1;
        }
        counts
    }

    fn sunk_values(&self) -> Vec<usize> {
        self.sunk.lock().unwrap().iter().map(|(v, _)| *v).collect()
    }

    /// Waits until `handled` distinct values were handled and `sunk` dead-lettered.
    async fn wait(&self, handled: usize, sunk: usize) {
        within(LIMIT, "every record handled or dead-lettered", async {
            loop {
                let notified = self.done.notified();
                if self.handled_counts().len() >= handled && self.sunk.lock().unwrap().len() >= sunk
                {
                    return;
                }
                notified.await;
            }
        })
        .await
    }
}

/// A bulk handler failing a batch that holds one of `poison` (an error about the
/// records), or — while `down` is set — every batch (transient).
fn handler(
    seen: &Seen,
    poison: Vec<usize>,
    down: Arc<AtomicBool>,
) -> impl tower::Service<Batch, Response = (), Error = BoxError, Future: Send> + Clone {
    let seen = seen.clone();
    tower::service_fn(move |batch: Batch| {
        let values: Vec<usize> = batch.messages.iter().map(value).collect();
        let transient = down.swap(false, Ordering::SeqCst);
        let bad = values.iter().any(|v| poison.contains(v));
        seen.calls
            .lock()
            .unwrap()
            .push((values.clone(), transient || bad));
        if !(transient || bad) {
            let mut handled = seen.handled.lock().unwrap();
            for m in &batch.messages {
                handled.push((value(m), m.metadata.sequence_number.clone()));
            }
        }
        seen.done.notify_waiters();
        async move {
            if transient {
                Err::<(), BoxError>(Box::new(Down))
            } else if bad {
                Err("constraint violated".into())
            } else {
                Ok(())
            }
        }
    })
}

/// A sink recording dead letters; fails while `down` is set.
fn sink(
    seen: &Seen,
    down: Arc<AtomicBool>,
) -> impl tower::Service<DeadLetterRecord, Response = (), Error = BoxError, Future: Send> + Clone {
    let seen = seen.clone();
    tower::service_fn(move |record: DeadLetterRecord| {
        let seen = seen.clone();
        let down = down.clone();
        async move {
            if down.load(Ordering::SeqCst) {
                seen.sink_failures.fetch_add(1, Ordering::SeqCst);
                seen.done.notify_waiters();
                return Err::<(), BoxError>("the dead-letter stream is down".into());
            }
            let v = std::str::from_utf8(&record.payload)
                .unwrap()
                .parse()
                .unwrap();
            seen.sunk.lock().unwrap().push((v, record.error));
            seen.done.notify_waiters();
            Ok(())
        }
    })
}

async fn stream_with(n: usize) -> Memory {
    let memory = Memory::new();
    memory.streams().create_stream("orders", 1).await.unwrap();
    let records = (0..n)
        .map(|v| PutRecord {
            data: Bytes::from(v.to_string()),
            partition_key: format!("pk-{}", v % 8),
            explicit_hash_key: None,
        })
        .collect();
    put_all(memory.streams().as_ref(), "orders", records).await;
    memory
}

fn consumer(memory: &Memory) -> shardflow::Consumer {
    testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
        .max_records_per_read(500)
        .build()
        .unwrap()
}

/// The shard's stored checkpoint.
fn checkpoint(memory: &Memory) -> Checkpoint {
    let rows = memory.table("billing").rows();
    assert_eq!(rows.len(), 1);
    rows[0].checkpoint.clone()
}

fn sequence_of(seen: &Seen, v: usize) -> SequenceNumber {
    seen.handled
        .lock()
        .unwrap()
        .iter()
        .find(|(x, _)| *x == v)
        .map(|(_, s)| s.clone())
        .unwrap()
}

fn at(sequence: &SequenceNumber) -> Checkpoint {
    Checkpoint::At(shardflow::Position::new(sequence.clone(), 0))
}

#[tokio::test(start_paused = true)]
async fn one_poison_record_in_500_is_dead_lettered_and_the_checkpoint_passes_it() {
    let poison = rand::rngs::SmallRng::seed_from_u64(21).gen_range(0..499);
    let memory = stream_with(500).await;
    let seen = Seen::default();
    let service = ServiceBuilder::new()
        .bisect(sink(&seen, Arc::default()))
        .service(handler(&seen, vec![poison], Arc::default()));
    let running = consumer(&memory).run_batches(service).spawn();
    seen.wait(499, 1).await;
    within(LIMIT, "shutdown", running.shutdown()).await.unwrap();

    assert_eq!(seen.sunk_values(), [poison], "dead-lettered once");
    let counts = seen.handled_counts();
    assert_eq!(counts.len(), 499);
    assert!(counts.values().all(|n| *n == 1), "handled once each");
    assert!(!counts.contains_key(&poison));
    let calls = seen.calls.lock().unwrap().clone();
    // The shard is read in three batches: a first read of 100 records, then pages
    // doubling up to the limit of 500 (100, 200, 200); only the poison's is split.
    assert_eq!(calls[0].0.len(), 100, "a first batch of 100");
    let bound = 2 * 200f64.log2().ceil() as usize;
    assert!(
        calls.len() - 3 <= bound,
        "{} calls besides the three batches' first (poison at {poison})",
        calls.len() - 3
    );
    assert_eq!(
        checkpoint(&memory),
        at(&sequence_of(&seen, 499)),
        "past the poison record"
    );
}

#[tokio::test(start_paused = true)]
async fn two_poison_records_in_one_batch_are_each_dead_lettered_once() {
    let memory = stream_with(500).await;
    let seen = Seen::default();
    let service = ServiceBuilder::new()
        .bisect(sink(&seen, Arc::default()))
        .service(handler(&seen, vec![37, 401], Arc::default()));
    let running = consumer(&memory).run_batches(service).spawn();
    seen.wait(498, 2).await;
    within(LIMIT, "shutdown", running.shutdown()).await.unwrap();

    assert_eq!(seen.sunk_values(), [37, 401]);
    let counts = seen.handled_counts();
    assert_eq!(counts.len(), 498);
    assert!(counts.values().all(|n| *n == 1));
    assert_eq!(checkpoint(&memory), at(&sequence_of(&seen, 499)));
}

#[tokio::test(start_paused = true)]
async fn a_transient_failure_retries_the_whole_batch_and_dead_letters_nothing_for_it() {
    let memory = stream_with(500).await;
    let seen = Seen::default();
    // The first call fails for a reason that is not about the records.
    let down = Arc::new(AtomicBool::new(true));
    let layer = BisectLayer::new(sink(&seen, Arc::default())).policy(not_down);
    let service = layer.layer(handler(&seen, vec![250], down));
    let running = consumer(&memory).run_batches(service).spawn();
    seen.wait(499, 1).await;
    within(LIMIT, "shutdown", running.shutdown()).await.unwrap();

    let calls = seen.calls.lock().unwrap().clone();
    // The first batch (a first read of 100 records) is the one that failed.
    assert_eq!(calls[0].0.len(), 100);
    assert_eq!(
        calls[1].0, calls[0].0,
        "the whole batch is delivered again, not split"
    );
    assert_eq!(seen.sunk_values(), [250], "only the poison record, once");
    assert!(seen.handled_counts().values().all(|n| *n == 1));
    assert_eq!(checkpoint(&memory), at(&sequence_of(&seen, 499)));
}

#[tokio::test(start_paused = true)]
async fn a_sink_that_is_down_holds_the_checkpoint_just_before_the_record_and_loses_nothing() {
    let memory = stream_with(100).await;
    let seen = Seen::default();
    let sink_down = Arc::new(AtomicBool::new(true));
    let service = ServiceBuilder::new()
        .bisect(sink(&seen, sink_down.clone()))
        .service(handler(&seen, vec![60], Arc::default()));
    let running = consumer(&memory).run_batches(service.clone()).spawn();
    // The sink refuses the poison record three deliveries in a row.
    within(LIMIT, "three refusals", async {
        loop {
            let notified = seen.done.notified();
            if seen.sink_failures.load(Ordering::SeqCst) >= 3 {
                return;
            }
            notified.await;
        }
    })
    .await;
    within(LIMIT, "shutdown", running.shutdown()).await.unwrap();
    assert!(seen.sunk_values().is_empty());
    let before = sequence_of(&seen, 59);
    assert_eq!(
        checkpoint(&memory),
        at(&before),
        "up to the record before the poison one"
    );
    let counts = seen.handled_counts();
    assert_eq!(
        counts.keys().copied().collect::<Vec<_>>(),
        (0..60).collect::<Vec<_>>()
    );
    assert!(
        counts.values().all(|n| *n == 1),
        "nothing after the record handled"
    );

    // The sink is back: a new run dead-letters the record and handles the rest.
    sink_down.store(false, Ordering::SeqCst);
    let running = consumer(&memory).run_batches(service).spawn();
    seen.wait(99, 1).await;
    within(LIMIT, "shutdown", running.shutdown()).await.unwrap();
    assert_eq!(seen.sunk_values(), [60]);
    let counts = seen.handled_counts();
    assert_eq!(counts.len(), 99);
    assert!(counts.values().all(|n| *n == 1), "none twice: {counts:?}");
    assert_eq!(checkpoint(&memory), at(&sequence_of(&seen, 99)));
}

#[tokio::test(start_paused = true)]
async fn records_older_than_the_maximum_age_go_to_the_sink_instead_of_being_retried() {
    let memory = stream_with(10).await;
    let seen = Seen::default();
    let layer = BisectLayer::with_config(
        sink(&seen, Arc::default()),
        BisectConfig::new().max_record_age(Duration::from_secs(60)),
    )
    .unwrap()
    .policy(not_down);
    // Every call fails for a transient reason: the batch is delivered again and again.
    let always_down = tower::service_fn({
        let seen = seen.clone();
        move |batch: Batch| {
            seen.calls
                .lock()
                .unwrap()
                .push((batch.messages.iter().map(value).collect(), true));
            async { Err::<(), BoxError>(Box::new(Down)) }
        }
    });
    let start = tokio::time::Instant::now();
    let running = consumer(&memory)
        .run_batches(layer.layer(always_down))
        .spawn();
    seen.wait(0, 10).await;
    let waited = start.elapsed();
    within(LIMIT, "shutdown", running.shutdown()).await.unwrap();

    assert!(
        waited >= Duration::from_secs(60),
        "not before the limit: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(62),
        "at the first retry past it: {waited:?}"
    );
    let sunk = seen.sunk.lock().unwrap().clone();
    assert_eq!(
        sunk.iter().map(|(v, _)| *v).collect::<Vec<_>>(),
        (0..10).collect::<Vec<_>>()
    );
    assert!(sunk
        .iter()
        .all(|(_, e)| e.starts_with("too_old: the database is down")));
    assert!(seen.calls.lock().unwrap().len() > 2, "retried until then");
    assert!(
        matches!(checkpoint(&memory), Checkpoint::At(_)),
        "past them"
    );
}

#[tokio::test(start_paused = true)]
async fn a_batch_that_keeps_failing_is_dead_lettered_after_the_maximum_attempts() {
    let memory = stream_with(10).await;
    let seen = Seen::default();
    let layer = BisectLayer::with_config(
        sink(&seen, Arc::default()),
        BisectConfig::new().max_attempts(3),
    )
    .unwrap()
    .policy(|_: &(dyn std::error::Error + Send + Sync + 'static), _: &Metadata| false);
    // Every error counts as transient: nothing is split, the batch is delivered again.
    let service = layer.layer(handler(&seen, vec![4], Arc::default()));
    let running = consumer(&memory).run_batches(service).spawn();
    seen.wait(0, 10).await;
    within(LIMIT, "shutdown", running.shutdown()).await.unwrap();

    let calls = seen.calls.lock().unwrap().clone();
    assert_eq!(calls.len(), 3, "three deliveries: {calls:?}");
    let sunk = seen.sunk.lock().unwrap().clone();
    assert_eq!(sunk.len(), 10);
    assert!(sunk
        .iter()
        .all(|(_, e)| e.starts_with("attempts_exhausted: ")));
    assert!(matches!(checkpoint(&memory), Checkpoint::At(_)));
}

/// `bisect` over batch-mode `Batching` (chunks of 50) over a bulk insert: the store is
/// down for the fourth bulk call, after three chunks were written, and one record is
/// poison. The written chunks are acknowledged as they go, so the read comes back from
/// the chunk that failed, and the split that finds the poison record calls only what
/// was not written: every other row is written exactly once.
#[tokio::test(start_paused = true)]
async fn behind_batching_each_row_is_written_once_across_a_redelivery_and_a_split() {
    let poison = rand::rngs::SmallRng::seed_from_u64(5).gen_range(200..499);
    let memory = stream_with(500).await;
    let seen = Seen::default();
    let bulk_calls = Arc::new(AtomicUsize::new(0));
    let writes = seen.clone();
    let bulk = tower::service_fn(move |messages: Vec<Message>| {
        let values: Vec<usize> = messages.iter().map(value).collect();
        let transient = bulk_calls.fetch_add(1, Ordering::SeqCst) == 3;
        let bad = values.contains(&poison);
        writes
            .calls
            .lock()
            .unwrap()
            .push((values.clone(), transient || bad));
        if !(transient || bad) {
            let mut handled = writes.handled.lock().unwrap();
            for m in &messages {
                handled.push((value(m), m.metadata.sequence_number.clone()));
            }
        }
        writes.done.notify_waiters();
        async move {
            if transient {
                Err::<(), BoxError>(Box::new(Down))
            } else if bad {
                Err("constraint violated".into())
            } else {
                Ok(())
            }
        }
    });
    let service = BisectLayer::new(sink(&seen, Arc::default()))
        .policy(not_down)
        .layer(Batching::new(bulk, BatchConfig::new().max_count(50)));
    let running = consumer(&memory).run_batches(service).spawn();
    seen.wait(499, 1).await;
    within(LIMIT, "shutdown", running.shutdown()).await.unwrap();

    assert_eq!(seen.sunk_values(), [poison], "only the poison record, once");
    let counts = seen.handled_counts();
    assert_eq!(counts.len(), 499);
    let again: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(again.is_empty(), "rows written more than once: {again:?}");
    assert_eq!(checkpoint(&memory), at(&sequence_of(&seen, 499)));
}
