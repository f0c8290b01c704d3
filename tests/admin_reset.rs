//! Checkpoint resets through `shardflow::admin` against a running group on the memory
//! backend: an owned shard's owner applies the request (stop, drain, store, read again),
//! an unowned row is changed at once.
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use shardflow::admin::{reset_checkpoint, ResetOutcome};
use shardflow::kinesis::StreamAdmin;
use shardflow::lease::Checkpoint;
use shardflow::{Backend, Memory, Position};

const LIMIT: Duration = Duration::from_secs(60);

/// How many times each value was handled.
fn deliveries(recorder: &Recorder) -> BTreeMap<usize, usize> {
    let mut seen = BTreeMap::new();
    for h in recorder.snapshot() {
        *seen.entry(h.value).or_default() += 1;
    }
    seen
}

/// A reset of an owned shard to a position is applied by its owner: every record after
/// the position is delivered again, none before it, and the row ends with no request.
#[tokio::test(start_paused = true)]
async fn an_owned_shard_is_read_again_from_the_reset_position() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..20).await;
    let recorder = Recorder::default();
    let running = start(
        test_consumer(memory.clone(), "orders", "billing", "w1")
            .build()
            .unwrap(),
        &recorder,
    );
    recorder.wait_for(20, LIMIT).await;
    let store = memory.lease_store("billing");
    // The position of value 9: a reset there re-delivers 10..19.
    let ninth = recorder
        .snapshot()
        .into_iter()
        .find(|h| h.value == 9)
        .unwrap();
    let to = Checkpoint::At(Position::new(ninth.sequence.clone(), 0));
    let shard = ninth.shard.clone();
    let outcome = within(
        LIMIT,
        "reset",
        reset_checkpoint(store.as_ref(), &shard, &to),
    )
    .await
    .unwrap();
    assert!(
        matches!(outcome, ResetOutcome::Requested(ref row) if row.reset_to == Some(to.clone())),
        "an owned row gets a request: {outcome:?}"
    );
    // A sentinel after the reset: the shard is read in order, so once it arrived after
    // the re-read, everything the reset re-delivers has been delivered.
    recorder.wait_for(30, LIMIT).await;
    produce(kinesis.as_ref(), "orders", 20..21).await;
    recorder.wait_for_values(&[20], LIMIT).await;
    let seen = deliveries(&recorder);
    for v in 0..10 {
        assert_eq!(seen[&v], 1, "value {v} is before the reset position");
    }
    for v in 10..20 {
        assert_eq!(seen[&v], 2, "value {v} is after the reset position");
    }
    let row = store.get(&shard).await.unwrap().unwrap();
    assert_eq!(row.reset_to, None, "the owner removed the request");
    running.stop().await;
}

/// An unowned row (the group is stopped) is reset at once with a conditional write, and
/// the next run starts there.
#[tokio::test(start_paused = true)]
async fn an_unowned_row_is_reset_at_once() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..10).await;
    let recorder = Recorder::default();
    let consumer = || {
        test_consumer(memory.clone(), "orders", "billing", "w1")
            .build()
            .unwrap()
    };
    let running = start(consumer(), &recorder);
    recorder.wait_for(10, LIMIT).await;
    running.stop().await;
    let store = memory.lease_store("billing");
    let row = store.list().await.unwrap().remove(0);
    assert_eq!(row.owner, None);
    let outcome = reset_checkpoint(store.as_ref(), &row.key, &Checkpoint::TrimHorizon)
        .await
        .unwrap();
    assert!(
        matches!(outcome, ResetOutcome::Applied(ref r) if r.checkpoint == Checkpoint::TrimHorizon),
        "{outcome:?}"
    );
    let running = start(consumer(), &recorder);
    recorder.wait_for(20, LIMIT).await;
    running.stop().await;
    assert!(deliveries(&recorder).values().all(|n| *n == 2));
}
