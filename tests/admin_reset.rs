//! Checkpoint resets through `shardflow::admin` against a running group on the memory
//! backend: an owned shard's owner applies the request (stop, drain, store, read again),
//! an unowned row is changed at once; a request that races the shard's end is applied
//! all the same, and a second request racing the owner's apply wins.
use testkit::hooks;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use hooks::{Hooked, Hooks};
use shardflow::lease::{Lease, LeaseError, LeaseStore};
use shardflow::memory::MemoryLeaseStore;

use shardflow::admin::{reset_checkpoint, ResetOutcome};
use shardflow::kinesis::StreamAdmin;
use shardflow::lease::Checkpoint;
use shardflow::{Backend, Memory, Position};
use testkit::*;

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

/// Writes an operator's reset request on the shard's row the moment its owner committed
/// SHARD_END: after the owner's last renewal, before its release.
struct RequestAtShardEnd {
    table: Arc<MemoryLeaseStore>,
    to: Checkpoint,
    requested: Mutex<bool>,
}

#[async_trait]
impl Hooks for RequestAtShardEnd {
    async fn after_lease(&self, op: &'static str, _: Option<&str>, row: Option<&Lease>) {
        let Some(row) = row.filter(|r| op == "checkpoint" && r.checkpoint == Checkpoint::ShardEnd)
        else {
            return;
        };
        if std::mem::replace(&mut *self.requested.lock().unwrap(), true) {
            return;
        }
        self.table.request_reset(row, &self.to).await.unwrap();
    }
}

/// A reset requested while the shard is owned, landing between its owner's last
/// renewal and the end of the shard, is applied: the shard is read again from the
/// requested start, its children after it, and no request is left on any row.
///
/// Regression: the request stayed on the finished row, which nobody takes, for good.
#[tokio::test(start_paused = true)]
async fn a_reset_requested_as_the_shard_ends_is_applied() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..20).await;
    let hooks = RequestAtShardEnd {
        table: memory.table("billing"),
        to: Checkpoint::TrimHorizon,
        requested: Mutex::new(false),
    };
    let recorder = Recorder::default();
    let running = start(
        test_consumer(
            Hooked::new(memory.clone(), hooks),
            "orders",
            "billing",
            "w1",
        )
        .build()
        .unwrap(),
        &recorder,
    );
    recorder.wait_for(20, LIMIT).await;
    let parent = recorder.snapshot()[0].shard.clone();
    kinesis
        .split_shard("orders", &parent, u128::MAX / 2)
        .await
        .unwrap();
    produce(kinesis.as_ref(), "orders", 20..40).await;
    // The parent read twice (0..20), its children's records at least once.
    recorder.wait_for(60, LIMIT).await;
    let store = memory.lease_store("billing");
    let settled = async {
        loop {
            let rows = store.list().await.unwrap();
            if rows.iter().all(|r| r.reset_to.is_none()) {
                return rows;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let rows = within(LIMIT, "no reset request is left", settled).await;
    running.stop().await;
    let seen = deliveries(&recorder);
    for v in 0..20 {
        assert_eq!(seen.get(&v), Some(&2), "value {v} of the reset parent");
    }
    for v in 20..40 {
        assert!(
            seen.contains_key(&v),
            "value {v} of a child was not handled"
        );
    }
    let parent_row = rows.iter().find(|r| r.key == parent).unwrap();
    assert_eq!(parent_row.checkpoint, Checkpoint::ShardEnd);
}

/// Writes a second reset request on the row just before its owner applies the first.
struct SecondRequestBeforeApply {
    table: Arc<MemoryLeaseStore>,
    second: Checkpoint,
    requested: Mutex<bool>,
}

#[async_trait]
impl Hooks for SecondRequestBeforeApply {
    async fn before_lease(&self, op: &'static str, key: Option<&str>) -> Result<(), LeaseError> {
        if op != "reset" || std::mem::replace(&mut *self.requested.lock().unwrap(), true) {
            return Ok(());
        }
        let Some(key) = key else { return Ok(()) };
        let row = self.table.get(key).await.unwrap().unwrap();
        self.table.request_reset(&row, &self.second).await.unwrap();
        Ok(())
    }
}

/// Two reset requests racing: the second lands after the owner read the first and
/// before it applied it. The later request is the one applied, not silently removed.
///
/// Regression: the owner's apply stored the first request and removed the second.
#[tokio::test(start_paused = true)]
async fn a_second_reset_request_racing_the_apply_is_not_lost() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..20).await;
    let plain = Recorder::default();
    // A first run learns the positions of the records (and leaves the group stopped).
    let running = start(
        test_consumer(memory.clone(), "orders", "probe", "w0")
            .build()
            .unwrap(),
        &plain,
    );
    plain.wait_for(20, LIMIT).await;
    running.stop().await;
    let position = |value: usize| {
        let h = plain
            .snapshot()
            .into_iter()
            .find(|h| h.value == value)
            .unwrap();
        Checkpoint::At(Position::new(h.sequence, 0))
    };
    let (first, second) = (position(9), position(4));
    let hooks = SecondRequestBeforeApply {
        table: memory.table("billing"),
        second: second.clone(),
        requested: Mutex::new(false),
    };
    let recorder = Recorder::default();
    let running = start(
        test_consumer(
            Hooked::new(memory.clone(), hooks),
            "orders",
            "billing",
            "w1",
        )
        .build()
        .unwrap(),
        &recorder,
    );
    recorder.wait_for(20, LIMIT).await;
    let store = memory.lease_store("billing");
    let shard = plain.snapshot()[0].shard.clone();
    let outcome = reset_checkpoint(store.as_ref(), &shard, &first)
        .await
        .unwrap();
    assert!(matches!(outcome, ResetOutcome::Requested(_)), "{outcome:?}");
    // A sentinel: handled once the shard is read again after the reset.
    recorder.wait_for(30, LIMIT).await;
    produce(kinesis.as_ref(), "orders", 20..21).await;
    recorder.wait_for_values(&[20], LIMIT).await;
    running.stop().await;
    let seen = deliveries(&recorder);
    for v in 0..5 {
        assert_eq!(seen[&v], 1, "value {v} is before both requested positions");
    }
    for v in 5..20 {
        assert_eq!(
            seen[&v], 2,
            "value {v} is after the second requested position"
        );
    }
    let row = store.get(&shard).await.unwrap().unwrap();
    assert_eq!(row.reset_to, None);
}
