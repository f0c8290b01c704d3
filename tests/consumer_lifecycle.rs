//! Stopping and settling on the embedded backend under tokio's paused clock: nacks in
//! stream mode, acknowledgements clamped to their batch, dropped runs, batches that
//! waited through a long pause of the process, and records taken by a drain that timed
//! out while the lease is released.

use testkit::hooks;

use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use hooks::{Hooked, Hooks};
use shardflow::kinesis::{KinesisApi, StreamAdmin};
use shardflow::lease::{self, Checkpoint, LeaseError};
use shardflow::{Backend, Batch, BatchStream, Memory, Message};
use testkit::*;
use tokio::sync::watch;

const LIMIT: Duration = Duration::from_secs(60);

async fn stream_with(name: &str, records: usize) -> Memory {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream(name, 1).await.unwrap();
    produce(kinesis.as_ref(), name, 0..records).await;
    memory
}

fn first_value(batch: &Batch) -> usize {
    std::str::from_utf8(&batch.messages[0].payload)
        .unwrap()
        .parse()
        .unwrap()
}

/// The next batch whose first record is `value`; batches before it are handled (acked).
async fn next_starting_at(batches: &mut BatchStream, value: usize, limit: Duration) -> Batch {
    let find = async {
        loop {
            let batch = batches.next().await.expect("stream open").unwrap();
            if first_value(&batch) == value {
                return batch;
            }
            batch.ack();
        }
    };
    tokio::time::timeout(limit, find)
        .await
        .unwrap_or_else(|_| panic!("record {value} not delivered again within {limit:?}"))
}

#[tokio::test(start_paused = true)]
async fn a_nacked_batch_comes_again_without_waiting_for_the_shutdown_timeout() {
    let memory = stream_with("nack", 30).await;
    let consumer = test_consumer(memory.clone(), "nack", "nack-group", "w1")
        .max_records_per_read(10)
        .prefetch_batches(2)
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let first = next_starting_at(&mut batches, 0, LIMIT).await;
    first.nack();
    drop(first);
    // Well under the 30 s shutdown timeout: the nacked batch does not hold the drain.
    let again = next_starting_at(&mut batches, 0, Duration::from_secs(5)).await;
    again.ack();
    tokio::time::timeout(LIMIT, batches.shutdown())
        .await
        .expect("shutdown finishes")
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_late_nack_of_an_old_delivery_does_not_hide_the_current_failure() {
    let memory = stream_with("stale", 30).await;
    let consumer = test_consumer(memory.clone(), "stale", "stale-group", "w1")
        .max_records_per_read(10)
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let old = next_starting_at(&mut batches, 0, LIMIT).await;
    old.nack();
    let current = next_starting_at(&mut batches, 0, LIMIT).await;
    // The current delivery fails, and a late nack of the old one arrives right after.
    current.nack();
    old.nack();
    drop((old, current));
    let again = next_starting_at(&mut batches, 0, LIMIT).await;
    again.ack();
    tokio::time::timeout(LIMIT, batches.shutdown())
        .await
        .expect("shutdown finishes")
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn ack_through_past_its_batch_never_covers_records_of_later_batches() {
    let memory = stream_with("clamp", 30).await;
    let consumer = test_consumer(memory.clone(), "clamp", "clamp-group", "w1")
        .max_records_per_read(10)
        .prefetch_batches(2)
        .shutdown_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let mut first = next_starting_at(&mut batches, 0, LIMIT).await;
    let second = next_starting_at(&mut batches, 10, LIMIT).await;
    let end_of_first = first.messages.last().unwrap().position();
    let end_of_second = second.messages.last().unwrap().position();
    // A position beyond the first batch: only the first batch counts as handled.
    first.take_ack().unwrap().ack_through(end_of_second);
    drop(second);
    tokio::time::timeout(LIMIT, batches.shutdown())
        .await
        .expect("shutdown finishes")
        .unwrap();
    let rows = memory.table("clamp-group").rows();
    assert_eq!(rows[0].checkpoint, Checkpoint::At(end_of_first));
}

#[tokio::test(start_paused = true)]
async fn dropping_a_running_consumer_stops_it_and_releases_its_leases() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("drop", 2).await.unwrap();
    produce(kinesis.as_ref(), "drop", 0..40).await;
    let consumer = test_consumer(memory.clone(), "drop", "drop-group", "w1")
        .build()
        .unwrap();
    let recorder = Recorder::default();
    let run = consumer
        .run(recording_handler(recorder.clone()))
        .into_future();
    tokio::select! {
        result = run => panic!("the consumer stopped by itself: {result:?}"),
        _ = recorder.wait_for(40, LIMIT) => {}
    }
    // The run was dropped without a shutdown: it stops in the background, commits and
    // releases every lease (so another worker takes them at once).
    let table = memory.table("drop-group");
    let released = async {
        loop {
            let rows = table.rows();
            if rows.len() == 2 && rows.iter().all(|r| r.owner.is_none()) {
                return rows;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let rows = tokio::time::timeout(LIMIT, released)
        .await
        .expect("leases released after the drop");
    assert!(rows
        .iter()
        .all(|r| matches!(r.checkpoint, Checkpoint::At(_))));
}

/// Lease calls that hang while `frozen` is true: a worker whose lease renewals stall (a
/// stopped process, a long GC pause) while others go on.
struct Freezable(watch::Receiver<bool>);

#[async_trait]
impl Hooks for Freezable {
    async fn before_lease(&self, _: &'static str, _: Option<&str>) -> Result<(), LeaseError> {
        let _ = self.0.clone().wait_for(|frozen| !frozen).await;
        Ok(())
    }
}

#[tokio::test(start_paused = true)]
async fn a_batch_queued_before_a_long_pause_does_not_start_on_a_lease_taken_meanwhile() {
    let memory = stream_with("pause", 20).await;
    let (freeze, frozen) = watch::channel(false);
    let a_backend = Hooked::new(memory.clone(), Freezable(frozen));
    // Worker a: its handler stalls on record 9, the last of its first batch, while the
    // second batch waits in its queue.
    let (unstall, stalled) = watch::channel(false);
    let a_seen = Recorder::default();
    let a_handler = {
        let a_seen = a_seen.clone();
        tower::service_fn(move |msg: Message| {
            a_seen.record(&msg);
            let mut stalled = stalled.clone();
            let stall = msg.payload.as_ref() == b"9";
            async move {
                if stall {
                    let _ = stalled.wait_for(|go| *go).await;
                }
                Ok::<_, std::convert::Infallible>(())
            }
        })
    };
    let a = test_consumer(a_backend, "pause", "pause-group", "a")
        .max_records_per_read(10)
        .prefetch_batches(2)
        .build()
        .unwrap()
        .run(a_handler)
        .spawn();
    a_seen.wait_for(10, LIMIT).await;
    // The whole of a stalls: its lease calls hang too. Worker b takes the shard once the
    // lease expired and handles every record.
    freeze.send_replace(true);
    let b_seen = Recorder::default();
    let b = test_consumer(memory.clone(), "pause", "pause-group", "b")
        .build()
        .unwrap()
        .run(recording_handler(b_seen.clone()))
        .spawn();
    b_seen.wait_for(20, LIMIT).await;
    // a wakes up: the batch it had queued must not start on a lease that is b's now.
    freeze.send_replace(false);
    unstall.send_replace(true);
    tokio::time::timeout(LIMIT, a.shutdown())
        .await
        .expect("a stops")
        .unwrap();
    tokio::time::timeout(LIMIT, b.shutdown())
        .await
        .expect("b stops")
        .unwrap();
    let late: Vec<usize> = a_seen
        .snapshot()
        .iter()
        .map(|h| h.value)
        .filter(|v| *v >= 10)
        .collect();
    assert_eq!(late, Vec::<usize>::new(), "a handled records of b's lease");
}

#[tokio::test(start_paused = true)]
async fn in_stream_mode_a_batch_queued_before_a_long_pause_is_not_handed_out_on_a_lost_lease() {
    let memory = stream_with("pause-stream", 20).await;
    let (freeze, frozen) = watch::channel(false);
    let a_backend = Hooked::new(memory.clone(), Freezable(frozen));
    let mut a = test_consumer(a_backend, "pause-stream", "pause-stream-group", "a")
        .max_records_per_read(10)
        .prefetch_batches(2)
        .build()
        .unwrap()
        .stream();
    // a holds its first batch through a long pause while the second waits in its queue.
    let first = next_starting_at(&mut a, 0, LIMIT).await;
    freeze.send_replace(true);
    let b_seen = Recorder::default();
    let b = test_consumer(memory.clone(), "pause-stream", "pause-stream-group", "b")
        .build()
        .unwrap()
        .run(recording_handler(b_seen.clone()))
        .spawn();
    b_seen.wait_for(20, LIMIT).await;
    // a wakes up: the queued batch is b's now and must not be handed out.
    freeze.send_replace(false);
    first.ack();
    if let Ok(next) = tokio::time::timeout(Duration::from_secs(5), a.next()).await {
        let batch = next.expect("stream open").unwrap();
        assert_ne!(first_value(&batch), 10, "a handed out a batch of b's lease");
    }
    tokio::time::timeout(LIMIT, a.shutdown())
        .await
        .expect("a stops")
        .unwrap();
    tokio::time::timeout(LIMIT, b.shutdown())
        .await
        .expect("b stops")
        .unwrap();
}

/// A handler that records every message and takes `slow` over the first record it
/// handles of each shard.
fn slow_first_record_per_shard(
    seen: &Recorder,
    slow: Duration,
) -> impl tower::Service<
    Message,
    Response = (),
    Error = std::convert::Infallible,
    Future = impl std::future::Future<Output = Result<(), std::convert::Infallible>> + Send,
> + Clone
       + Send
       + 'static {
    let seen = seen.clone();
    let started = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
    tower::service_fn(move |msg: Message| {
        seen.record(&msg);
        let first = started
            .lock()
            .unwrap()
            .insert(msg.metadata.shard_id.to_string());
        async move {
            if first {
                tokio::time::sleep(slow).await;
            }
            Ok(())
        }
    })
}

#[tokio::test(start_paused = true)]
async fn a_hand_off_waits_for_the_old_owner_to_drain_with_the_default_timeouts() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("handoff", 2).await.unwrap();
    produce(kinesis.as_ref(), "handoff", 0..40).await;
    // Worker a owns both shards; the first record it handles of each takes 20 s: within
    // the 30 s shutdown timeout, but longer than the lease duration.
    let a_seen = Recorder::default();
    let a_handler = slow_first_record_per_shard(&a_seen, Duration::from_secs(20));
    let a = test_consumer(memory.clone(), "handoff", "handoff-group", "a")
        .build()
        .unwrap()
        .run(a_handler)
        .spawn();
    a_seen.wait_for(2, LIMIT).await;
    // Worker b joins and asks for its fair share: a drains, commits and hands over.
    let b_seen = Recorder::default();
    let b = test_consumer(memory.clone(), "handoff", "handoff-group", "b")
        .build()
        .unwrap()
        .run(recording_handler(b_seen.clone()))
        .spawn();
    let handled = || {
        let mut values: Vec<usize> = a_seen.snapshot().iter().map(|h| h.value).collect();
        values.extend(b_seen.snapshot().iter().map(|h| h.value));
        values.sort_unstable();
        values
    };
    let all_handled = async {
        loop {
            let mut values = handled();
            values.dedup();
            if values.len() == 40 && b_seen.count() > 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(LIMIT, all_handled)
        .await
        .expect("every record handled, and b got a shard");
    tokio::time::timeout(LIMIT, a.shutdown())
        .await
        .expect("a stops")
        .unwrap();
    tokio::time::timeout(LIMIT, b.shutdown())
        .await
        .expect("b stops")
        .unwrap();
    assert_eq!(
        handled(),
        (0..40).collect::<Vec<_>>(),
        "a planned hand-off duplicates nothing"
    );
}

/// In `run_batches` the batch a handler receives can be nacked: the nack wins over the
/// handler's `Ok`, and the records come again (before, the handle was taken out first,
/// so `nack` silently did nothing and `Ok` acknowledged records the handler gave up).
/// Afterwards every record is handled and the checkpoint reaches the last one.
#[tokio::test(start_paused = true)]
async fn in_batch_mode_a_nack_from_the_handler_redelivers_even_when_it_returns_ok() {
    let memory = stream_with("bnack", 30).await;
    let (seen, mut delivered) = tokio::sync::mpsc::unbounded_channel();
    let nacks = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let handler = tower::service_fn(move |batch: Batch| {
        let first = first_value(&batch);
        // The handler gives up the first delivery of the first read, and returns Ok.
        if first == 0 && nacks.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
            batch.nack();
        }
        let last = batch.messages.last().map(|m| m.position());
        let last_value: usize = std::str::from_utf8(&batch.messages[batch.len() - 1].payload)
            .unwrap()
            .parse()
            .unwrap();
        let _ = seen.send((first, last_value, last));
        async { Ok::<_, std::convert::Infallible>(()) }
    });
    let consumer = test_consumer(memory.clone(), "bnack", "bnack-group", "w1")
        .max_records_per_read(10)
        .build()
        .unwrap();
    let running = consumer.run_batches(handler).spawn();
    let mut firsts = Vec::new();
    // Until record 0 came a second time, and then the last record (29).
    let end = loop {
        let (first, last_value, last) = tokio::time::timeout(LIMIT, delivered.recv())
            .await
            .unwrap_or_else(|_| panic!("no delivery within {LIMIT:?}; so far {firsts:?}"))
            .expect("handler alive");
        firsts.push(first);
        if firsts.iter().filter(|&&f| f == 0).count() == 2 && last_value == 29 {
            break last;
        }
    };
    tokio::time::timeout(LIMIT, running.shutdown())
        .await
        .expect("shutdown finishes")
        .unwrap();
    let rows = memory.table("bnack-group").rows();
    assert_eq!(rows[0].checkpoint, Checkpoint::At(end.unwrap()));
}

/// The event hook sees a shard's life on a worker: taken, a handler failure (with the
/// record and the error), the shard ended by a split, a child handed over to a worker
/// that joined, and the rest released at shutdown.
#[tokio::test(start_paused = true)]
async fn the_event_hook_sees_leases_failures_shard_ends_and_hand_offs() {
    use shardflow::ShardEvent;
    use std::sync::Mutex;
    let memory = stream_with("events", 40).await;
    let kinesis = memory.streams().clone();
    let parent = open_shards(kinesis.as_ref(), "events").await.remove(0);
    let seen: Arc<Mutex<Vec<ShardEvent>>> = Arc::default();
    let hook = {
        let seen = seen.clone();
        move |e: &ShardEvent| seen.lock().unwrap().push(e.clone())
    };
    let recorder = Recorder::default();
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let handler = {
        let recorder = recorder.clone();
        let failed_once = failed_once.clone();
        tower::service_fn(move |msg: Message| {
            let fail = std::str::from_utf8(&msg.payload) == Ok("5")
                && !failed_once.swap(true, std::sync::atomic::Ordering::SeqCst);
            if !fail {
                recorder.record(&msg);
            }
            async move {
                if fail {
                    Err("value 5 refused once")
                } else {
                    Ok(())
                }
            }
        })
    };
    let consumer = test_consumer(memory.clone(), "events", "events-group", "w1")
        .on_event(hook)
        .build()
        .unwrap();
    let w1 = consumer.run(handler).spawn();
    recorder.wait_for(40, LIMIT).await;
    kinesis
        .split_shard("events", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    let children: Vec<String> = kinesis
        .list_shards("events")
        .await
        .unwrap()
        .into_iter()
        .filter(|s| !s.is_closed())
        .map(|s| s.shard_id)
        .collect();
    let has = |want: &dyn Fn(&ShardEvent) -> bool| seen.lock().unwrap().iter().any(want);
    within(LIMIT, "both children taken by w1", async {
        while !children
            .iter()
            .all(|c| has(&|e| matches!(e, ShardEvent::LeaseTaken { shard } if shard == c)))
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let w2 = start(
        test_consumer(memory.clone(), "events", "events-group", "w2")
            .build()
            .unwrap(),
        &recorder,
    );
    within(LIMIT, "a child handed over to w2", async {
        while !has(&|e| matches!(e, ShardEvent::HandedOff { to, .. } if to == "w2")) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    w1.shutdown().await.unwrap();
    w2.stop().await;

    let events = seen.lock().unwrap().clone();
    let of = |shard: &str| -> Vec<ShardEvent> {
        events
            .iter()
            .filter(|e| match e {
                ShardEvent::LeaseTaken { shard: s }
                | ShardEvent::LeaseLost { shard: s }
                | ShardEvent::HandedOff { shard: s, .. }
                | ShardEvent::Released { shard: s }
                | ShardEvent::ShardEnded { shard: s }
                | ShardEvent::HandlerFailed { shard: s, .. } => s == shard,
                _ => false,
            })
            .cloned()
            .collect()
    };
    let p = parent.shard_id.clone();
    let five = memory.streams().records("events", &p)[5]
        .sequence_number
        .clone();
    assert_eq!(
        of(&p),
        vec![
            ShardEvent::LeaseTaken { shard: p.clone() },
            ShardEvent::HandlerFailed {
                shard: p.clone(),
                sequence_number: Some(five),
                error: "value 5 refused once".into(),
            },
            ShardEvent::ShardEnded { shard: p.clone() },
        ]
    );
    // One child went to w2, the other stayed with w1 until its shutdown released it.
    let mut ends: Vec<ShardEvent> = children
        .iter()
        .map(|c| of(c).last().cloned().unwrap())
        .collect();
    ends.sort_by_key(|e| matches!(e, ShardEvent::Released { .. }));
    assert!(
        matches!(&ends[..], [ShardEvent::HandedOff { to, .. }, ShardEvent::Released { .. }] if to == "w2"),
        "{events:?}"
    );
    assert!(!events
        .iter()
        .any(|e| matches!(e, ShardEvent::LeaseLost { .. })));
}

/// A worker that stops while its hand-off request is pending withdraws it: the owner,
/// once drained, keeps the lease (and reads on) instead of handing it to a worker that
/// is gone, where it would sit unread until it expired. Before, the hand-over landed
/// after the requester stopped and the row named the stopped worker.
#[tokio::test(start_paused = true)]
async fn a_stopped_worker_is_never_handed_a_lease() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("withdraw", 2).await.unwrap();
    produce(kinesis.as_ref(), "withdraw", 0..20).await;
    // Worker a owns both shards; the first record of each takes 5 s to handle.
    let a_seen = Recorder::default();
    let a_handler = slow_first_record_per_shard(&a_seen, Duration::from_secs(5));
    let a = test_consumer(memory.clone(), "withdraw", "withdraw-group", "a")
        .build()
        .unwrap()
        .run(a_handler)
        .spawn();
    a_seen.wait_for(2, LIMIT).await;
    // Worker b joins, asks a for one shard, and stops while a is still draining it.
    let b = test_consumer(memory.clone(), "withdraw", "withdraw-group", "b")
        .build()
        .unwrap()
        .run(recording_handler(Recorder::default()))
        .spawn();
    let store = memory.lease_store("withdraw-group");
    let asked = async {
        loop {
            let rows = store.list().await.unwrap();
            if rows.iter().any(|r| {
                r.pending_owner
                    .as_deref()
                    .is_some_and(|p| lease::worker_of(p) == "b")
            }) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    tokio::time::timeout(LIMIT, asked)
        .await
        .expect("b asks for a shard");
    tokio::time::timeout(LIMIT, b.shutdown())
        .await
        .expect("b stops")
        .unwrap();
    // From now on no row names b, and a reads everything, records written later too.
    produce(kinesis.as_ref(), "withdraw", 20..40).await;
    let watch = async {
        loop {
            for row in store.list().await.unwrap() {
                assert!(
                    row.owner
                        .as_deref()
                        .is_none_or(|o| lease::worker_of(o) != "b"),
                    "lease {} handed to the stopped worker",
                    row.key
                );
            }
            let mut values: Vec<usize> = a_seen.snapshot().iter().map(|h| h.value).collect();
            values.sort_unstable();
            values.dedup();
            if values.len() == 40 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    // Well within one lease duration (3 s) after a's 5 s drain.
    tokio::time::timeout(Duration::from_secs(7), watch)
        .await
        .expect("a reads every record without waiting for a lease to expire");
    tokio::time::timeout(LIMIT, a.shutdown())
        .await
        .expect("a stops")
        .unwrap();
    for row in store.list().await.unwrap() {
        assert_eq!(row.owner, None, "lease {} released", row.key);
    }
}

/// Delays the answer of a release that landed, while `slow` is set (a slow network or a
/// DynamoDB latency spike, within the call deadline).
struct SlowReleaseAnswer(Arc<std::sync::atomic::AtomicBool>);

#[async_trait]
impl Hooks for SlowReleaseAnswer {
    async fn after_lease(&self, op: &'static str, _: Option<&str>, _: Option<&lease::Lease>) {
        if op == "release" && self.0.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
        }
    }
}

/// A concurrent shard stopped while a call hangs: its drain times out with records taken
/// and not started, and the lease is released. Once the release landed, another worker
/// may hold the lease, so no taken record may start any more, even while the release's
/// answer is on its way (here, slow) and the hung call returns meanwhile.
#[tokio::test(start_paused = true)]
async fn no_taken_record_starts_once_the_lease_is_released_after_a_drain_timeout() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    use tokio::sync::Notify;

    let memory = stream_with("release", 20).await;
    let slow = Arc::new(AtomicBool::new(false));
    // In order: a's call starts (`Some(value)`) and b's take of the lease (`None`).
    let calls: Arc<Mutex<Vec<Option<usize>>>> = Arc::default();
    let (hung, release_hung) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
    let a = test_consumer(
        Hooked::new(memory.clone(), SlowReleaseAnswer(slow.clone())),
        "release",
        "release-group",
        "a",
    )
    .concurrency(shardflow::Concurrency::PerKey(1))
    .shutdown_timeout(Duration::from_secs(2))
    .build()
    .unwrap();
    let a_stop = a.shutdown_handle();
    let handler = {
        let (calls, hung, release_hung) = (calls.clone(), hung.clone(), release_hung.clone());
        tower::service_fn(move |msg: Message| {
            let (calls, hung, release_hung) = (calls.clone(), hung.clone(), release_hung.clone());
            async move {
                let v: usize = std::str::from_utf8(&msg.payload).unwrap().parse().unwrap();
                calls.lock().unwrap().push(Some(v));
                if v == 0 {
                    hung.notify_one();
                    release_hung.notified().await;
                }
                Ok::<_, std::convert::Infallible>(())
            }
        })
    };
    let a_run = tokio::spawn(a.run(handler).into_future());
    within(LIMIT, "a's first call hangs", hung.notified()).await;

    let b_seen = Recorder::default();
    let took = Arc::new(Notify::new());
    let b = test_consumer(memory.clone(), "release", "release-group", "b")
        .on_event({
            let (calls, took) = (calls.clone(), took.clone());
            move |e| {
                if let shardflow::ShardEvent::LeaseTaken { .. } = e {
                    calls.lock().unwrap().push(None);
                    took.notify_one();
                }
            }
        })
        .build()
        .unwrap()
        .run(recording_handler(b_seen.clone()))
        .spawn();

    // a stops: the hung call outlasts the drain, the lease is released (its answer slow),
    // b takes it, and only then does the hung call return.
    slow.store(true, Ordering::SeqCst);
    a_stop.shutdown();
    within(LIMIT, "b takes the released lease", took.notified()).await;
    release_hung.notify_one();
    b_seen
        .wait_for_values(&(0..20).collect::<Vec<_>>(), LIMIT)
        .await;
    within(LIMIT, "a stops", a_run).await.unwrap().unwrap();

    let calls = calls.lock().unwrap().clone();
    let b_took = calls
        .iter()
        .position(Option::is_none)
        .expect("b took the lease");
    let late: Vec<usize> = calls[b_took..].iter().flatten().copied().collect();
    assert_eq!(late, Vec::<usize>::new(), "a started calls on b's lease");
    b.shutdown().await.unwrap();
}
