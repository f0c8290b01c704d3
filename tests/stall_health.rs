//! A shard that stops making progress says so: records handed out and none handled for
//! `stuck_after` make the shard stuck in its health, the worker not ready, a `Stuck`
//! event and the `shardflow_shards_stuck` gauge; a shard that is idle, or busy with a
//! slow handler that finishes, never is. On the memory backend under tokio's paused
//! clock, each test with a `metrics` recorder of its own.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use shardflow::kinesis::StreamAdmin;
use shardflow::metrics as names;
use shardflow::{Health, Memory, Message, ShardEvent};
use tokio::sync::Notify;

use testkit::{produce, within, Recorder};

const STUCK_AFTER: Duration = Duration::from_secs(10);
/// How long after `STUCK_AFTER` the event and gauge may follow the health (a look every
/// eighth of the threshold), with a margin.
const REPORTED_WITHIN: Duration = Duration::from_millis(1_500);
const LIMIT: Duration = Duration::from_secs(120);

/// Runs `test` on a paused current-thread runtime with a recorder of its own.
fn with_metrics<F: Future<Output = ()>>(test: impl FnOnce(PrometheusHandle) -> F) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(test(handle)));
}

/// The value of the gauge `name` (0 when it was never set).
fn gauge(m: &PrometheusHandle, name: &str) -> f64 {
    m.render()
        .lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// The events a consumer sent, in order.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<ShardEvent>>>);

impl Events {
    fn hook(&self) -> impl Fn(&ShardEvent) + Send + Sync + 'static {
        let events = self.0.clone();
        move |e| events.lock().unwrap().push(e.clone())
    }

    fn stuck(&self) -> Vec<(String, Option<String>)> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match e {
                ShardEvent::Stuck { shard, reason, .. } => Some((shard.clone(), reason.clone())),
                _ => None,
            })
            .collect()
    }

    fn unstuck(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match e {
                ShardEvent::Unstuck { shard, .. } => Some(shard.clone()),
                _ => None,
            })
            .collect()
    }
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

/// Samples `health` every second for `period`, failing if any shard is ever stuck or
/// the worker not ready.
async fn never_stuck(period: Duration, health: impl Fn() -> Health) {
    let mut waited = Duration::ZERO;
    while waited < period {
        let h = health();
        assert!(
            h.is_ready() && h.shards.iter().all(|s| s.stuck_for.is_none()),
            "after {waited:?}: {h:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
        waited += Duration::from_secs(1);
    }
}

/// Regression: a hung handler left the worker ready, its shard's progress a few ms old
/// (a read that found nothing new counted as progress).
#[test]
fn a_hung_handler_makes_its_shard_stuck_until_it_returns() {
    with_metrics(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        produce(memory.streams().as_ref(), "orders", 0..10).await;
        let recorder = Recorder::default();
        let (hanging, release) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let handler = {
            let (recorder, hanging, release) = (recorder.clone(), hanging.clone(), release.clone());
            tower::service_fn(move |msg: Message| {
                let (recorder, hanging, release) =
                    (recorder.clone(), hanging.clone(), release.clone());
                async move {
                    if msg.payload.as_ref() == b"3" {
                        hanging.notify_one();
                        release.notified().await;
                    }
                    recorder.record(&msg);
                    Ok::<_, &str>(())
                }
            })
        };
        let events = Events::default();
        let consumer = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .stuck_after(STUCK_AFTER)
            .on_event(events.hook())
            .build()
            .unwrap();
        let running = consumer.run(handler).spawn();
        within(LIMIT, "the handler hangs on record 3", hanging.notified()).await;
        let hung_at = tokio::time::Instant::now();

        // Not yet: a handler may take a while.
        never_stuck(STUCK_AFTER - Duration::from_secs(1), || running.health()).await;
        assert!(events.stuck().is_empty());

        tokio::time::sleep_until(hung_at + STUCK_AFTER + REPORTED_WITHIN).await;
        let health = running.health();
        assert!(health.is_live(), "{health:?}");
        assert!(
            !health.is_ready(),
            "a stuck shard makes the worker not ready"
        );
        let shard = &health.shards[0];
        assert!(
            shard.stuck_for.is_some() && shard.progress_ago >= STUCK_AFTER,
            "{shard:?}"
        );
        assert_eq!(
            events.stuck(),
            vec![(shard.shard_id.clone(), None)],
            "one event naming the shard, no error: the call has not returned"
        );
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 1.0);
        assert_eq!(recorder.count(), 3);

        // Still stuck later: the event is not repeated.
        tokio::time::sleep(STUCK_AFTER).await;
        assert!(!running.health().is_ready());
        assert_eq!(events.stuck().len(), 1);

        release.notify_one();
        recorder.wait_for(10, LIMIT).await;
        eventually(LIMIT, "ready again", || running.health().is_ready()).await;
        let health = running.health();
        assert_eq!(health.shards[0].stuck_for, None, "{health:?}");
        eventually(LIMIT, "the shard says it recovered", || {
            events.unstuck() == vec![health.shards[0].shard_id.clone()]
        })
        .await;
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 0.0);
        drop(running);
    });
}

#[test]
fn a_record_the_handler_always_fails_on_is_stuck_with_the_error() {
    with_metrics(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        produce(memory.streams().as_ref(), "orders", 0..10).await;
        let recorder = Recorder::default();
        let refusing = Arc::new(AtomicBool::new(true));
        let handler = {
            let (recorder, refusing) = (recorder.clone(), refusing.clone());
            tower::service_fn(move |msg: Message| {
                let refuse = msg.payload.as_ref() == b"4" && refusing.load(Ordering::SeqCst);
                if !refuse {
                    recorder.record(&msg);
                }
                async move {
                    if refuse {
                        Err("the dead-letter sink refuses the record: too large")
                    } else {
                        Ok(())
                    }
                }
            })
        };
        let events = Events::default();
        let consumer = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .stuck_after(STUCK_AFTER)
            .on_event(events.hook())
            .build()
            .unwrap();
        let running = consumer.run(handler).spawn();
        recorder.wait_for(4, LIMIT).await;
        eventually(LIMIT, "stuck", || !events.stuck().is_empty()).await;
        let health = running.health();
        assert!(!health.is_ready(), "{health:?}");
        let reason = "the dead-letter sink refuses the record: too large";
        assert!(health.shards[0].stuck_for.is_some(), "{health:?}");
        assert_eq!(health.shards[0].last_error.as_deref(), Some(reason));
        assert_eq!(
            events.stuck(),
            vec![(health.shards[0].shard_id.clone(), Some(reason.to_owned()))]
        );
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 1.0);

        refusing.store(false, Ordering::SeqCst);
        recorder.wait_for(10, LIMIT).await;
        eventually(LIMIT, "ready again", || running.health().is_ready()).await;
        eventually(LIMIT, "recovered", || events.unstuck().len() == 1).await;
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 0.0);
        drop(running);
    });
}

#[test]
fn an_idle_caught_up_shard_is_never_stuck() {
    with_metrics(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 2).await.unwrap();
        produce(memory.streams().as_ref(), "orders", 0..10).await;
        let recorder = Recorder::default();
        let events = Events::default();
        let consumer = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .stuck_after(STUCK_AFTER)
            .on_event(events.hook())
            .build()
            .unwrap();
        let running = consumer
            .run(testkit::recording_handler(recorder.clone()))
            .spawn();
        recorder.wait_for(10, LIMIT).await;
        eventually(LIMIT, "every shard leased", || {
            running.health().shards.len() == 2
        })
        .await;
        // Caught up: nothing waits, however long nothing new comes.
        never_stuck(STUCK_AFTER * 10, || running.health()).await;
        assert!(running
            .health()
            .shards
            .iter()
            .all(|s| s.progress_ago == Duration::ZERO));
        assert!(events.stuck().is_empty());
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 0.0);
        within(LIMIT, "shutdown", running.shutdown()).await.unwrap();
    });
}

#[test]
fn a_busy_shard_with_a_slow_handler_that_finishes_is_never_stuck() {
    with_metrics(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        // One read brings them all: the batch is acknowledged only when every record
        // of it is handled, long after `stuck_after`.
        produce(memory.streams().as_ref(), "orders", 0..40).await;
        let recorder = Recorder::default();
        let handler = {
            let recorder = recorder.clone();
            tower::service_fn(move |msg: Message| {
                let recorder = recorder.clone();
                async move {
                    tokio::time::sleep(STUCK_AFTER * 6 / 10).await;
                    recorder.record(&msg);
                    Ok::<_, &str>(())
                }
            })
        };
        let events = Events::default();
        let consumer = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .stuck_after(STUCK_AFTER)
            .on_event(events.hook())
            .build()
            .unwrap();
        let running = consumer.run(handler).spawn();
        eventually(LIMIT, "started", || running.health().is_ready()).await;
        never_stuck(STUCK_AFTER * 6 / 10 * 40, || running.health()).await;
        recorder.wait_for(40, LIMIT).await;
        assert!(events.stuck().is_empty());
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 0.0);
        drop(running);
    });
}

/// Regression: a `stream()` batch held unacknowledged left the worker ready.
#[test]
fn a_stream_batch_held_unacknowledged_makes_its_shard_stuck() {
    with_metrics(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        produce(memory.streams().as_ref(), "orders", 0..5).await;
        let events = Events::default();
        let consumer = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .stuck_after(STUCK_AFTER)
            .on_event(events.hook())
            .build()
            .unwrap();
        let mut batches = consumer.stream();
        let batch = within(LIMIT, "a batch", batches.next())
            .await
            .unwrap()
            .unwrap();
        let held_at = tokio::time::Instant::now();
        // The stream is polled meanwhile (the reader reads on and finds nothing new),
        // but the batch is held.
        let poll = within(STUCK_AFTER + REPORTED_WITHIN, "", async {
            tokio::select! {
                b = batches.next() => panic!("no second batch was written: {:?}", b.map(|b| b.map(|b| b.messages.len()))),
                _ = tokio::time::sleep_until(held_at + STUCK_AFTER + REPORTED_WITHIN) => {}
            }
        });
        poll.await;
        let health = batches.health();
        assert!(!health.is_ready(), "{health:?}");
        assert!(health.shards[0].stuck_for.is_some(), "{health:?}");
        assert_eq!(events.stuck(), vec![(batch.shard_id.to_string(), None)]);
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 1.0);

        batch.ack();
        let ready = async {
            loop {
                tokio::select! {
                    b = batches.next() => panic!("no second batch was written: {:?}", b.map(|b| b.map(|b| b.messages.len()))),
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
                if batches.health().is_ready() && events.unstuck().len() == 1 {
                    return;
                }
            }
        };
        within(LIMIT, "ready and recovered after the ack", ready).await;
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 0.0);
        within(LIMIT, "shutdown", batches.shutdown()).await.unwrap();
    });
}

/// Writes `values` into the shard whose hash range starts at `starting_hash_key`.
async fn put_into(memory: &Memory, starting_hash_key: u128, values: std::ops::Range<usize>) {
    let records = values
        .map(|v| shardflow::kinesis::PutRecord {
            data: bytes::Bytes::from(v.to_string()),
            partition_key: format!("pk-{v}"),
            explicit_hash_key: Some(starting_hash_key.to_string()),
        })
        .collect();
    testkit::put_all(memory.streams().as_ref(), "orders", records).await;
}

/// Regression: a handler hung on one shard kept the worker's whole read-ahead budget, so
/// another shard with records waiting was never read again, healthy in its health and
/// named by no event (only the hung shard was reported stuck).
#[test]
fn a_shard_starved_by_a_hung_shard_is_read_or_named() {
    with_metrics(|_| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 2).await.unwrap();
        let shards =
            shardflow::kinesis::KinesisApi::list_shards(memory.streams().as_ref(), "orders")
                .await
                .unwrap();
        let (hung, starved) = (shards[0].clone(), shards[1].clone());
        put_into(&memory, hung.starting_hash_key, 0..5).await;
        put_into(&memory, starved.starting_hash_key, 100..105).await;
        let recorder = Recorder::default();
        let hanging = Arc::new(Notify::new());
        let handler = {
            let (recorder, hanging, hung) =
                (recorder.clone(), hanging.clone(), hung.shard_id.clone());
            tower::service_fn(move |msg: Message| {
                let (recorder, hanging) = (recorder.clone(), hanging.clone());
                let hangs = *msg.metadata.shard_id == *hung;
                async move {
                    if hangs {
                        hanging.notify_one();
                        std::future::pending::<()>().await;
                    }
                    recorder.record(&msg);
                    Ok::<_, &str>(())
                }
            })
        };
        let events = Events::default();
        let consumer = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .stuck_after(STUCK_AFTER)
            // The smallest budget: one batch of a shard takes all of it.
            .read_ahead_bytes(1024)
            .on_event(events.hook())
            .build()
            .unwrap();
        let running = consumer.run(handler).spawn();
        within(
            LIMIT,
            "the handler hangs on the first shard",
            hanging.notified(),
        )
        .await;
        // More records for the other shard, after the hang began.
        put_into(&memory, starved.starting_hash_key, 200..205).await;
        tokio::time::sleep(STUCK_AFTER * 3).await;

        let handled = recorder
            .snapshot()
            .iter()
            .filter(|h| h.value >= 200)
            .count();
        let named: Vec<String> = events.stuck().into_iter().map(|(s, _)| s).collect();
        let health = running.health();
        assert!(
            named.contains(&hung.shard_id),
            "the hung shard is reported: {named:?}"
        );
        assert!(
            handled == 5 || named.contains(&starved.shard_id),
            "{} of 5 records written to {} after the hang were handled in {:?}, and no \
             event named it (stuck: {named:?}); health: {health:?}",
            handled,
            starved.shard_id,
            STUCK_AFTER * 3
        );
        drop(running);
    });
}

/// Regression: a stuck shard handed off to another worker never sent `Unstuck`.
///
/// Every handler call hangs, so both shards of the first worker get stuck. A second
/// worker joins and one shard is handed over to it (its drain times out): the first
/// worker no longer reads that shard, but its `Stuck` was never followed by an
/// `Unstuck`, so a user pairing the two events counted it stuck for ever.
#[test]
fn a_stuck_shard_that_is_handed_off_sends_unstuck() {
    with_metrics(|m| async move {
        let memory = Memory::new();
        memory.streams().create_stream("orders", 2).await.unwrap();
        produce(memory.streams().as_ref(), "orders", 0..20).await;
        let handler = tower::service_fn(|_: Message| async {
            std::future::pending::<()>().await;
            Ok::<_, &str>(())
        });
        let events = Events::default();
        let first = testkit::test_consumer(memory.clone(), "orders", "billing", "w1")
            .stuck_after(STUCK_AFTER)
            .shutdown_timeout(Duration::from_secs(2))
            .on_event(events.hook())
            .build()
            .unwrap()
            .run(handler)
            .spawn();
        eventually(LIMIT, "both shards of the first worker are stuck", || {
            events.stuck().len() == 2
        })
        .await;
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 2.0);
        assert!(events.unstuck().is_empty());

        let second = testkit::test_consumer(memory.clone(), "orders", "billing", "w2")
            .stuck_after(Duration::from_secs(300))
            .shutdown_timeout(Duration::from_secs(2))
            .build()
            .unwrap()
            .run(handler)
            .spawn();
        let left = || -> Vec<String> {
            events
                .0
                .lock()
                .unwrap()
                .iter()
                .filter_map(|e| match e {
                    ShardEvent::HandedOff { shard, .. }
                    | ShardEvent::LeaseLost { shard }
                    | ShardEvent::Released { shard } => Some(shard.clone()),
                    _ => None,
                })
                .collect()
        };
        eventually(LIMIT, "the first worker gives a shard up", || {
            !left().is_empty()
        })
        .await;
        let gone = left();
        assert_eq!(gone.len(), 1, "{gone:?}");
        assert_eq!(
            events.unstuck(),
            gone,
            "the shard no longer read here is no longer stuck here"
        );
        let order: Vec<bool> = events
            .0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|e| match e {
                ShardEvent::Unstuck { .. } => Some(true),
                ShardEvent::HandedOff { .. }
                | ShardEvent::LeaseLost { .. }
                | ShardEvent::Released { .. } => Some(false),
                _ => None,
            })
            .collect();
        assert_eq!(order, vec![true, false], "Unstuck comes first");
        assert_eq!(gauge(&m, names::SHARDS_STUCK), 1.0);
        drop(second);
        drop(first);
    });
}
