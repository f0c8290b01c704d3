//! User code is supervised and no task outlives its consumer: a handler that panics is
//! an error like any other (reported, counted, the record delivered again), a hook that
//! panics changes nothing but that event, a batch dropped without an answer is given up
//! and delivered again, and whatever ends the worker (an error, a panic), its shards are
//! stopped, its leases released and no handler runs once `run` returned. Embedded
//! backend, tokio's paused clock.

use testkit::hooks;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use shardflow::kinesis::{PutRecord, StreamAdmin};
use shardflow::lease::{Checkpoint, Lease, LeaseError};
use shardflow::metrics as names;
use shardflow::{Batch, Concurrency, ConsumerError, Memory, Message, Running, ShardEvent};

use hooks::{Hooked, Hooks};
use testkit::{put_all, within, Recorder};

const LIMIT: Duration = Duration::from_secs(120);

/// Runs `test` on a paused current-thread runtime with a metrics recorder of its own.
fn paused<F: Future<Output = ()>>(test: impl FnOnce(PrometheusHandle) -> F) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(test(handle)));
}

/// The sum of the series named `name` (a histogram: its `_count`).
fn total(m: &PrometheusHandle, name: &str) -> f64 {
    let count = format!("{name}_count");
    m.render()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            let series = key.split('{').next()?;
            (series == name || series == count).then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

/// Polls `cond` every 100 ms of (paused) time for at most `limit`.
async fn eventually(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    within(limit, what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
}

/// Writes values `0..n` with partition keys `pk-{value % 4}`.
async fn produce(memory: &Memory, n: usize) {
    let records = (0..n)
        .map(|v| PutRecord {
            data: Bytes::from(v.to_string()),
            partition_key: format!("pk-{}", v % 4),
            explicit_hash_key: None,
        })
        .collect();
    put_all(memory.streams().as_ref(), "orders", records).await;
}

fn value(msg: &Message) -> usize {
    std::str::from_utf8(&msg.payload).unwrap().parse().unwrap()
}

/// How the handler is run.
#[derive(Clone, Copy, Debug)]
enum Mode {
    Sequential,
    PerKey,
    Batches,
}

/// The handlers' shared state: one value panics the first `times` times it is handled.
#[derive(Clone)]
struct Poison {
    value: usize,
    times: usize,
    attempts: Arc<AtomicUsize>,
    recorder: Recorder,
}

impl Poison {
    fn new(value: usize, times: usize) -> Self {
        Poison {
            value,
            times,
            attempts: Arc::default(),
            recorder: Recorder::default(),
        }
    }

    fn strikes(&self, msg: &Message) -> bool {
        value(msg) == self.value && self.attempts.fetch_add(1, Ordering::SeqCst) < self.times
    }

    /// How many times each value was handled successfully.
    fn counts(&self) -> BTreeMap<usize, usize> {
        let mut counts = BTreeMap::new();
        for h in self.recorder.snapshot() {
            *counts.entry(h.value).or_insert(0) += 1;
        }
        counts
    }
}

type Events = Arc<Mutex<Vec<ShardEvent>>>;

/// Starts worker "w1" of group "billing" in `mode`; the handler panics where `poison`
/// says (in the returned future in sequential mode, in `call` itself per key, in the
/// batch's future in batch mode).
fn start(memory: &Memory, mode: Mode, poison: &Poison, events: &Events) -> Running {
    let events = events.clone();
    let builder = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
        .on_event(move |e| events.lock().unwrap().push(e.clone()));
    let builder = match mode {
        Mode::PerKey => builder.concurrency(Concurrency::PerKey(4)),
        _ => builder,
    };
    let consumer = builder.build().unwrap();
    let poison = poison.clone();
    match mode {
        Mode::Sequential => consumer
            .run(tower::service_fn(move |msg: Message| {
                let poison = poison.clone();
                async move {
                    if poison.strikes(&msg) {
                        panic!("poison {}", value(&msg));
                    }
                    poison.recorder.record(&msg);
                    Ok::<_, Infallible>(())
                }
            }))
            .spawn(),
        Mode::PerKey => consumer
            .run(tower::service_fn(move |msg: Message| {
                if poison.strikes(&msg) {
                    panic!("poison {}", value(&msg));
                }
                poison.recorder.record(&msg);
                async { Ok::<_, Infallible>(()) }
            }))
            .spawn(),
        Mode::Batches => consumer
            .run_batches(tower::service_fn(move |batch: Batch| {
                let poison = poison.clone();
                async move {
                    if let Some(m) = batch.messages.iter().find(|m| poison.strikes(m)) {
                        panic!("poison {}", value(m));
                    }
                    for m in &batch.messages {
                        poison.recorder.record(m);
                    }
                    Ok::<_, Infallible>(())
                }
            }))
            .spawn(),
    }
}

/// The `HandlerFailed` events that carry the panic of `value`.
fn panics_reported(events: &Events, value: usize) -> Vec<ShardEvent> {
    let needle = format!("panicked: poison {value}");
    events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, ShardEvent::HandlerFailed { error, .. } if error.contains(&needle)))
        .cloned()
        .collect()
}

fn rows(memory: &Memory) -> Vec<Lease> {
    memory.table("billing").rows()
}

/// Regression: a handler that panicked killed its shard's dispatch, and the record was
/// not delivered again, nor the failure reported.
fn a_record_that_panics_twice_is_delivered_again_and_reported(mode: Mode) {
    paused(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 2).await.unwrap();
        produce(&memory, 60).await;
        let poison = Poison::new(17, 2);
        let events = Events::default();
        let running = start(&memory, mode, &poison, &events);
        let all: Vec<usize> = (0..60).collect();
        poison.recorder.wait_for_values(&all, LIMIT).await;
        within(LIMIT, "shutdown", running.shutdown()).await.unwrap();

        assert_eq!(poison.attempts.load(Ordering::SeqCst), 3, "{mode:?}");
        let counts = poison.counts();
        assert_eq!(counts.get(&17), Some(&1), "{mode:?}");
        match mode {
            // Records of other keys in flight beside the panicking call may come again.
            Mode::PerKey => assert!(counts.values().all(|n| *n >= 1)),
            _ => assert!(counts.values().all(|n| *n == 1), "{mode:?}: {counts:?}"),
        }
        assert_eq!(counts.len(), 60);
        let reported = panics_reported(&events, 17);
        assert_eq!(reported.len(), 2, "{mode:?}: {reported:?}");
        let poisoned = poison
            .recorder
            .snapshot()
            .into_iter()
            .find(|h| h.value == 17)
            .unwrap();
        if !matches!(mode, Mode::Batches) {
            for e in &reported {
                assert!(
                    matches!(e, ShardEvent::HandlerFailed { sequence_number: Some(s), shard, .. }
                        if *s == poisoned.sequence && *shard == poisoned.shard),
                    "{e:?}"
                );
            }
        }
        assert_eq!(total(&m, names::HANDLER_ERRORS), 2.0, "{mode:?}");
        assert_eq!(total(&m, names::HANDLER_RETRIES), 2.0, "{mode:?}");
        // Every shard checkpointed at its last record, past the one that panicked.
        let mut last: BTreeMap<String, shardflow::SequenceNumber> = BTreeMap::new();
        for h in poison.recorder.snapshot() {
            let entry = last.entry(h.shard).or_insert(h.sequence.clone());
            if h.sequence > *entry {
                *entry = h.sequence;
            }
        }
        for row in rows(&memory) {
            assert!(
                matches!(&row.checkpoint, Checkpoint::At(p) if p.sequence == last[&row.key]),
                "{mode:?}: {row:?}"
            );
            assert_eq!(row.owner, None, "released");
        }
    });
}

#[test]
fn a_sequential_handler_that_panics_is_an_error() {
    a_record_that_panics_twice_is_delivered_again_and_reported(Mode::Sequential);
}

#[test]
fn a_per_key_handler_that_panics_is_an_error() {
    a_record_that_panics_twice_is_delivered_again_and_reported(Mode::PerKey);
}

#[test]
fn a_batch_handler_that_panics_is_an_error() {
    a_record_that_panics_twice_is_delivered_again_and_reported(Mode::Batches);
}

/// Regression: a record whose handler always panicked left its shard waiting, with the
/// worker ready and no failure counted.
fn a_record_that_always_panics_makes_its_shard_failing(mode: Mode) {
    paused(|_| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        produce(&memory, 20).await;
        let poison = Poison::new(5, usize::MAX);
        let events = Events::default();
        let running = start(&memory, mode, &poison, &events);
        eventually(LIMIT, "the shard failing", || {
            running.health().shards.iter().any(|s| s.failing())
        })
        .await;
        let health = running.health();
        assert!(!health.is_ready(), "{mode:?}: {health:?}");
        assert!(health.shards[0].last_error.is_some(), "{health:?}");
        assert!(panics_reported(&events, 5).len() >= 3, "{mode:?}");
        within(LIMIT, "shutdown", running.shutdown()).await.unwrap();
        let counts = poison.counts();
        assert!(!counts.contains_key(&5), "{mode:?}: {counts:?}");
        if !matches!(mode, Mode::PerKey) {
            // Other keys may go on beside it per key; in order, nothing after it runs.
            assert!(counts.keys().all(|v| *v < 5), "{mode:?}: {counts:?}");
        }
        // Nothing at or after the poison record is checkpointed.
        let fifth = rows(&memory)[0].checkpoint.clone();
        let handled = poison.recorder.snapshot();
        match mode {
            Mode::Batches => assert_eq!(fifth, Checkpoint::TrimHorizon, "{mode:?}"),
            _ => {
                let fourth = handled.iter().find(|h| h.value == 4).unwrap();
                assert!(
                    matches!(&fifth, Checkpoint::At(p) if p.sequence == fourth.sequence),
                    "{mode:?}: {fifth:?}"
                );
            }
        }
    });
}

#[test]
fn a_sequential_record_that_always_panics_makes_its_shard_failing() {
    a_record_that_always_panics_makes_its_shard_failing(Mode::Sequential);
}

#[test]
fn a_per_key_record_that_always_panics_makes_its_shard_failing() {
    a_record_that_always_panics_makes_its_shard_failing(Mode::PerKey);
}

#[test]
fn a_batch_that_always_panics_makes_its_shard_failing() {
    a_record_that_always_panics_makes_its_shard_failing(Mode::Batches);
}

/// A service whose `poll_ready` panics the first time it is asked.
#[derive(Clone)]
struct PanicsWhenFirstReady {
    panicked: Arc<AtomicBool>,
    recorder: Recorder,
}

impl tower::Service<Message> for PanicsWhenFirstReady {
    type Response = ();
    type Error = Infallible;
    type Future = std::future::Ready<Result<(), Infallible>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Infallible>> {
        if !self.panicked.swap(true, Ordering::SeqCst) {
            panic!("not ready");
        }
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, msg: Message) -> Self::Future {
        self.recorder.record(&msg);
        std::future::ready(Ok(()))
    }
}

/// Regression: a service that panicked while getting ready killed its shard's dispatch.
#[test]
fn a_service_that_panics_getting_ready_is_an_error() {
    paused(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        produce(&memory, 10).await;
        let events = Events::default();
        let hook = events.clone();
        let recorder = Recorder::default();
        let running = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .on_event(move |e| hook.lock().unwrap().push(e.clone()))
            .build()
            .unwrap()
            .run(PanicsWhenFirstReady {
                panicked: Arc::default(),
                recorder: recorder.clone(),
            })
            .spawn();
        recorder
            .wait_for_values(&(0..10).collect::<Vec<_>>(), LIMIT)
            .await;
        within(LIMIT, "shutdown", running.shutdown()).await.unwrap();
        assert_eq!(recorder.count(), 10, "each record once");
        let failed = events.lock().unwrap().iter().any(|e| {
            matches!(e, ShardEvent::HandlerFailed { error, .. } if error.contains("panicked: not ready"))
        });
        assert!(failed);
        assert_eq!(total(&m, names::HANDLER_ERRORS), 1.0);
    });
}

/// Regression: an `on_event` hook that panicked ended the worker at once, and its shard
/// tasks and renewer went on in the background.
#[test]
fn a_hook_that_panics_on_every_event_changes_nothing_else() {
    paused(|_| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 2).await.unwrap();
        produce(&memory, 40).await;
        let calls = Arc::new(AtomicUsize::new(0));
        let recorder = Recorder::default();
        let failed_once = Arc::new(AtomicBool::new(false));
        let handler = {
            let (recorder, failed_once) = (recorder.clone(), failed_once.clone());
            tower::service_fn(move |msg: Message| {
                // One error, so the handler's task reports an event too.
                let fail = value(&msg) == 7 && !failed_once.swap(true, Ordering::SeqCst);
                if !fail {
                    recorder.record(&msg);
                }
                async move {
                    if fail {
                        Err("once")
                    } else {
                        Ok(())
                    }
                }
            })
        };
        let hook_calls = calls.clone();
        let running = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .on_event(move |_| {
                hook_calls.fetch_add(1, Ordering::SeqCst);
                panic!("the hook is broken");
            })
            .build()
            .unwrap()
            .run(handler)
            .spawn();
        recorder
            .wait_for_values(&(0..40).collect::<Vec<_>>(), LIMIT)
            .await;
        assert!(running.health().is_ready(), "{:?}", running.health());
        within(LIMIT, "shutdown", running.shutdown())
            .await
            .expect("a panicking hook is not an error of the consumer");
        // Two leases taken, one handler failure, two releases.
        assert!(calls.load(Ordering::SeqCst) >= 5);
        for row in rows(&memory) {
            assert_eq!(row.owner, None, "released: {row:?}");
        }
    });
}

/// Regression: a `stream()` batch dropped without `ack` or `nack` held its shard back
/// until a restart or hand-off.
#[test]
fn a_batch_dropped_without_an_answer_is_delivered_again() {
    paused(|_| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        produce(&memory, 10).await;
        let mut stream = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .build()
            .unwrap()
            .stream();
        let first = within(LIMIT, "a batch", stream.next())
            .await
            .unwrap()
            .unwrap();
        let dropped: Vec<usize> = first.messages.iter().map(value).collect();
        drop(first);
        let mut seen = Vec::new();
        // Well within the shutdown timeout and the lease duration: only a restart of the
        // shard brings the records again so soon.
        within(Duration::from_secs(2), "the dropped batch again", async {
            while !dropped.iter().all(|v| seen.contains(v)) {
                let batch = stream.next().await.unwrap().unwrap();
                seen.extend(batch.messages.iter().map(value));
                batch.ack();
            }
        })
        .await;
        within(LIMIT, "shutdown", stream.shutdown()).await.unwrap();
    });
}

/// Makes the lease table's listing fail as if the table were missing, or panic once, once
/// armed; every other call goes through.
#[derive(Default)]
struct BrokenListing {
    missing: AtomicBool,
    panic_once: AtomicBool,
}

#[async_trait]
impl Hooks for BrokenListing {
    async fn before_lease(&self, op: &'static str, _: Option<&str>) -> Result<(), LeaseError> {
        if op == "list" && self.panic_once.swap(false, Ordering::SeqCst) {
            panic!("listing exploded");
        }
        if op == "list" && self.missing.load(Ordering::SeqCst) {
            return Err(LeaseError::TableMissing {
                table: "billing".to_owned(),
            });
        }
        Ok(())
    }
}

/// Sets a flag when dropped: whether a handler's future was dropped.
struct DroppedFlag(Arc<AtomicBool>);

impl Drop for DroppedFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Runs a worker whose handler hangs on value 3, breaks the table with `arm` once the
/// hung call started, and checks what is left once `run` returned: no handler call in
/// progress or started since, every lease released and no longer renewed.
fn after_the_worker_ends(arm: fn(&BrokenListing), expect: fn(&ConsumerError) -> bool) {
    paused(|_| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 2).await.unwrap();
        produce(&memory, 20).await;
        let broken = Hooked::new(memory.clone(), BrokenListing::default());
        let recorder = Recorder::default();
        let hung = Arc::new(AtomicBool::new(false));
        let dropped = Arc::new(AtomicBool::new(false));
        let handler = {
            let (recorder, hung, dropped) = (recorder.clone(), hung.clone(), dropped.clone());
            tower::service_fn(move |msg: Message| {
                recorder.record(&msg);
                let hang = value(&msg) == 3 && !hung.swap(true, Ordering::SeqCst);
                let flag = hang.then(|| DroppedFlag(dropped.clone()));
                async move {
                    if let Some(_flag) = flag {
                        std::future::pending::<()>().await;
                    }
                    Ok::<_, Infallible>(())
                }
            })
        };
        let running = testkit::test_consumer(broken.clone(), "orders", "billing", "w1")
            .shutdown_timeout(Duration::from_secs(5))
            .build()
            .unwrap()
            .run(handler)
            .spawn();
        eventually(LIMIT, "the hung call", || hung.load(Ordering::SeqCst)).await;
        assert_eq!(
            rows(&memory).iter().filter(|r| r.owner.is_some()).count(),
            2
        );
        arm(&broken.hooks);
        let result = within(LIMIT, "the worker ends", running).await;
        assert!(matches!(&result, Err(e) if expect(e)), "{result:?}");
        let handled = recorder.count();
        assert!(
            dropped.load(Ordering::SeqCst),
            "the hung call was dropped before run returned"
        );
        let after: Vec<(String, Option<String>, u64)> = rows(&memory)
            .into_iter()
            .map(|r| (r.key, r.owner, r.counter))
            .collect();
        assert!(
            after.iter().all(|(_, owner, _)| owner.is_none()),
            "{after:?}"
        );
        // Three lease durations later nothing was renewed, read or handled.
        tokio::time::sleep(Duration::from_secs(10)).await;
        let later: Vec<(String, Option<String>, u64)> = rows(&memory)
            .into_iter()
            .map(|r| (r.key, r.owner, r.counter))
            .collect();
        assert_eq!(later, after);
        assert_eq!(
            recorder.count(),
            handled,
            "no handler called after run returned"
        );
    });
}

/// Regression: a worker that stopped with an error left a hung handler call running
/// after `run` returned.
#[test]
fn a_worker_that_ends_with_an_error_stops_everything_it_started() {
    after_the_worker_ends(
        |b| b.missing.store(true, Ordering::SeqCst),
        |e| matches!(e, ConsumerError::Lease(LeaseError::TableMissing { .. })),
    );
}

/// Regression: a worker whose lease rounds panicked ended at once, its shard tasks and
/// renewer still reading and renewing in the background.
#[test]
fn a_worker_that_panics_stops_everything_it_started_and_releases() {
    after_the_worker_ends(
        |b| b.panic_once.store(true, Ordering::SeqCst),
        |e| matches!(e, ConsumerError::Worker(w) if w.contains("listing exploded")),
    );
}
