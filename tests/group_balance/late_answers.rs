//! Lease answers that come late and shards that end during a hand-off: no second owner
//! hands records out, no row stays owned (embedded backend, paused clock).

use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shardflow::kinesis::{KinesisApi, StreamAdmin};
use shardflow::lease::{Checkpoint, Lease, LeaseStore};
use shardflow::{Memory, Message};
use testkit::hooks::{Hooked, Hooks};
use testkit::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A lease table whose takes land at once but answer `delay` later (a slow network on
/// the way back, a client retrying a lost reply).
struct SlowTakeReplies(Duration);

#[async_trait::async_trait]
impl Hooks for SlowTakeReplies {
    async fn after_lease(&self, op: &'static str, _: Option<&str>, _: Option<&Lease>) {
        if op == "take" {
            tokio::time::sleep(self.0).await;
        }
    }
}

/// Regression: a take answered after the lease expired made a second owner hand records out.
///
/// A held lease counts as renewed when the task starts, not
/// when the take was sent. A take whose answer comes back later than the lease
/// duration (the write landed at once) gives a lease that other workers already saw
/// expire and took; the late owner still looks fresh and hands the records out again
/// while the new owner handles them (its commits are fenced, its handler calls are not).
#[tokio::test(start_paused = true)]
async fn a_take_answered_after_the_lease_expired_hands_out_nothing() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("f6", 1).await.unwrap();
    produce(kinesis.as_ref(), "f6", 0..20).await;
    let table = memory.table("f6-group");
    let recorder = Recorder::default();
    // test_consumer: lease duration 3 s, renewals every 1 s; A's take answers 4.5 s
    // after it landed (between two of its renewal ticks).
    let a = test_consumer(
        Hooked::new(
            memory.clone(),
            SlowTakeReplies(Duration::from_millis(4_500)),
        ),
        "f6",
        "f6-group",
        "a",
    )
    .build()
    .unwrap();
    let a_run = start(a, &recorder);
    within(LIMIT, "A's take landed", async {
        while table.rows().first().and_then(|r| r.owner.clone()).is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let b = test_consumer(memory.clone(), "f6", "f6-group", "b")
        .build()
        .unwrap();
    let b_run = start(b, &recorder);
    recorder.wait_for(20, LIMIT).await;
    // Past A's late answer and its first renewal: whatever A handed out is in by now.
    let shards = kinesis.list_shards("f6").await.unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    let sentinels = produce_sentinels(kinesis.as_ref(), "f6", &shards, 20).await;
    recorder.wait_for_values(&sentinels, LIMIT).await;
    a_run.stop().await;
    b_run.stop().await;
    assert_no_value_twice(&recorder.snapshot());
}

/// Regression: a shard that ended during a hand-off drain stayed owned for ever.
///
/// A shard that reached SHARD_END while
/// draining for a hand-off was handed over instead of released. The requester never
/// takes a finished lease, so the row stayed owned by it for ever and was never cleaned
/// up. A finished shard is released whatever stopped it.
#[tokio::test(start_paused = true)]
async fn a_shard_ended_during_a_hand_off_drain_is_released() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    let (parent, _) = split_with_records(kinesis.as_ref(), "fe", 10, 10).await;
    let table = memory.table("fe-group");
    let (go, gate) = tokio::sync::watch::channel(false);
    let waiting = Arc::new(AtomicBool::new(false));
    let waiting_in_handler = waiting.clone();
    // The last record of the parent blocks until `go`.
    let handler = tower::service_fn(move |msg: Message| {
        let value: usize = std::str::from_utf8(&msg.payload).unwrap().parse().unwrap();
        let mut gate = gate.clone();
        let waiting = waiting_in_handler.clone();
        async move {
            if value == 9 {
                waiting.store(true, Ordering::SeqCst);
                let _ = gate.wait_for(|go| *go).await;
            }
            Ok::<_, std::convert::Infallible>(())
        }
    });
    let consumer = test_consumer(memory.clone(), "fe", "fe-group", "a")
        .build()
        .unwrap();
    let shutdown = consumer.shutdown_handle();
    let run = tokio::spawn(consumer.run(handler).into_future());
    within(LIMIT, "the parent's last record is being handled", async {
        while !waiting.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // Let the reader find the parent's end (a read after the last record) meanwhile.
    tokio::time::sleep(Duration::from_secs(1)).await;
    within(LIMIT, "a hand-off is requested", async {
        loop {
            let row = table
                .rows()
                .into_iter()
                .find(|r| r.key == parent.shard_id)
                .unwrap();
            if table.request_handoff(&row, "b#zzzzzz").await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // The owner sees the request at its next renewal and drains; the drain ends when
    // the blocked record is handled, which completes the shard.
    tokio::time::sleep(Duration::from_secs(2)).await;
    go.send(true).unwrap();
    let row = within(LIMIT, "the parent's owner lets go", async {
        loop {
            match table.rows().into_iter().find(|r| r.key == parent.shard_id) {
                Some(row)
                    if row.owner.as_deref().is_some_and(|o| o.starts_with("a#"))
                        || row.checkpoint != Checkpoint::ShardEnd =>
                {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                other => return other,
            }
        }
    })
    .await;
    shutdown.shutdown();
    within(LIMIT, "the consumer stops", run)
        .await
        .unwrap()
        .unwrap();
    if let Some(row) = row {
        assert_eq!(
            row.owner, None,
            "a finished shard must be released, not handed over (it would stay owned)"
        );
    }
}
