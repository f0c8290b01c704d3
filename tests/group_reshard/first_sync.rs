//! Tombstones, the first shard sync and start-up:
//! a first shard sync that created some rows but not a closed shard's (a failed create,
//! a shutdown during start-up) leaves a table on which no later sync ever creates that
//! shard's row, and its children are read at once: the closed shard's records are lost.
//! Embedded backend, tokio's paused clock, every wait bounded.

use testkit::hooks;

use std::collections::{BTreeSet, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hooks::{Hooked, Hooks};
use shardflow::kinesis::{KinesisApi, KinesisError, ShardInfo, StreamAdmin};
use shardflow::lease::LeaseError;
use shardflow::Memory;
use testkit::*;

const LIMIT: Duration = Duration::from_secs(60);

/// How the create of one lease row misbehaves.
#[derive(Clone, Copy)]
enum CreateFault {
    /// The first create fails (throttled) before it is applied.
    FailOnce,
    /// Every create waits (far longer than the test) before it is applied.
    Hang,
}

/// The create of lease row `key` misbehaving.
struct BadCreate {
    key: String,
    fault: CreateFault,
    used: Arc<AtomicBool>,
}

impl BadCreate {
    fn on(memory: &Memory, key: &str, fault: CreateFault) -> Hooked<Memory, BadCreate> {
        let bad = BadCreate {
            key: key.to_owned(),
            fault,
            used: Arc::default(),
        };
        Hooked::new(memory.clone(), bad)
    }
}

#[async_trait::async_trait]
impl Hooks for BadCreate {
    async fn before_lease(&self, op: &'static str, key: Option<&str>) -> Result<(), LeaseError> {
        if op != "create" || key != Some(self.key.as_str()) {
            return Ok(());
        }
        match self.fault {
            CreateFault::FailOnce => {
                if !self.used.swap(true, Ordering::SeqCst) {
                    return Err(LeaseError::Throttled("injected: create throttled".into()));
                }
            }
            CreateFault::Hang => {
                self.used.store(true, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(3_600)).await;
            }
        }
        Ok(())
    }
}

/// A stream of two shards holding values 0..100, the first then split (closed, its
/// two children open) and values 100..200 written; returns the closed shard.
async fn split_history(memory: &Memory, stream: &str) -> ShardInfo {
    let kinesis = memory.streams().clone();
    kinesis.create_stream(stream, 2).await.unwrap();
    let parent = open_shards(kinesis.as_ref(), stream).await.remove(0);
    produce(kinesis.as_ref(), stream, 0..100).await;
    let mid = parent.starting_hash_key / 2 + parent.ending_hash_key / 2;
    kinesis
        .split_shard(stream, &parent.shard_id, mid)
        .await
        .unwrap();
    produce(kinesis.as_ref(), stream, 100..200).await;
    assert!(
        !kinesis.records(stream, &parent.shard_id).is_empty(),
        "the closed shard holds records"
    );
    parent
}

/// Writes a sentinel into each open shard, waits for them (a child's sentinel comes
/// after its parents' records when children wait for their parents), stops the run and
/// checks that every value was handled once, in order.
async fn check_all_handled(memory: &Memory, stream: &str, run: Running, recorder: &Recorder) {
    let kinesis = memory.streams().clone();
    let open = open_shards(kinesis.as_ref(), stream).await;
    let sentinels = produce_sentinels(kinesis.as_ref(), stream, &open, 1_000).await;
    recorder.wait_for_values(&sentinels, LIMIT).await;
    run.stop().await;
    let handled = recorder.snapshot();
    let seen: HashSet<usize> = handled.iter().map(|h| h.value).collect();
    let expected: BTreeSet<usize> = (0..200).chain(sentinels.iter().copied()).collect();
    let missing: Vec<usize> = expected
        .iter()
        .copied()
        .filter(|v| !seen.contains(v))
        .collect();
    assert!(
        missing.is_empty(),
        "{} records lost, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(8)]
    );
    assert_eq!(handled.len(), expected.len(), "some value handled twice");
    let shards = kinesis.list_shards(stream).await.unwrap();
    assert_order(&handled, &shards);
}

/// Regression: a closed shard whose row failed to be created at the first sync was never read.
///
/// One throttled create at the first sync (TRIM_HORIZON, the default): the wave that
/// creates the two root shards' rows creates the open one's and fails on the closed
/// one's. The retried sync sees a table that is not empty (`first` is false), takes the
/// closed shard without a row whose parents have no row for "consumed and cleaned up"
/// and skips it (`sync_shards`, the `!first && shard.is_closed()` rule), then creates
/// its children at TRIM_HORIZON naming a parent without a row: they are read at once
/// and the closed shard is never read.
#[tokio::test(start_paused = true)]
async fn a_closed_shard_whose_first_create_failed_is_still_read() {
    let memory = Memory::new();
    let parent = split_history(&memory, "pf").await;
    let backend = BadCreate::on(&memory, &parent.shard_id, CreateFault::FailOnce);
    let used = backend.hooks.used.clone();
    let recorder = Recorder::default();
    let consumer = test_consumer(backend, "pf", "pf-group", "w1")
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    check_all_handled(&memory, "pf", run, &recorder).await;
    assert!(used.load(Ordering::SeqCst), "the fault was injected");
}

/// Regression: a shutdown during start-up left a table on which the closed shard was never read.
///
/// The same table left by a shutdown during start-up (a shutdown does not wait for a
/// start-up attempt): worker A's first sync created the open root
/// shard's row while the closed shard's create was still under way, and A was shut
/// down. Worker B, started later on that table, never reads the closed shard.
#[tokio::test(start_paused = true)]
async fn a_shutdown_during_start_up_loses_no_closed_shard() {
    let memory = Memory::new();
    let parent = split_history(&memory, "ps").await;
    let table = memory.table("ps-group");
    let slow = BadCreate::on(&memory, &parent.shard_id, CreateFault::Hang);
    let recorder = Recorder::default();
    let a = test_consumer(slow.clone(), "ps", "ps-group", "a")
        .build()
        .unwrap();
    let a_run = start(a, &recorder);
    within(LIMIT, "A created the open root shard's row", async {
        while !slow.hooks.used.load(Ordering::SeqCst) || table.rows().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    a_run.stop().await;
    assert!(
        table.rows().iter().all(|r| r.key != parent.shard_id),
        "the closed shard's create was cut off"
    );
    let b = test_consumer(memory.clone(), "ps", "ps-group", "b")
        .build()
        .unwrap();
    let b_run = start(b, &recorder);
    check_all_handled(&memory, "ps", b_run, &recorder).await;
}

/// Counts ListShards calls.
#[derive(Default)]
struct CountedLists(AtomicUsize);

#[async_trait::async_trait]
impl Hooks for CountedLists {
    async fn before_kinesis(&self, op: &'static str) -> Result<(), KinesisError> {
        if op == "list_shards" {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        Ok(())
    }
}

/// Regression: a finished row past retention with an idle child cost a ListShards call every round, for ever.
///
/// A finished row whose shard is past retention must not make every lease round of
/// every worker call ListShards once more for as long as one of its children has not
/// "started" (checkpoint still TRIM_HORIZON / AT_TIMESTAMP): a child that receives no
/// record never starts, so the extra call would be made every round, for ever, and the
/// row never deleted. The children are checked against the last sync's listing before
/// any extra call.
/// test_consumer: a round every 300 ms, a shard sync (one ListShards) every 500 ms.
#[tokio::test(start_paused = true)]
async fn a_row_past_retention_with_an_idle_child_costs_no_listshards_per_round() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("idle", 1).await.unwrap();
    let parent = open_shards(kinesis.as_ref(), "idle").await.remove(0);
    produce(kinesis.as_ref(), "idle", 0..20).await;
    let backend = Hooked::new(memory.clone(), CountedLists::default());
    let lists = backend.hooks.clone();
    let recorder = Recorder::default();
    let consumer = test_consumer(backend, "idle", "idle-group", "w1")
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    recorder.wait_for(20, LIMIT).await;
    kinesis
        .split_shard("idle", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    // Records reach the lower child only; the upper child stays idle.
    let lower = open_shards(kinesis.as_ref(), "idle").await.remove(0);
    let sentinels = produce_sentinels(kinesis.as_ref(), "idle", &[lower], 100).await;
    recorder.wait_for_values(&sentinels, LIMIT).await;
    // The parent is past retention: Kinesis no longer lists it.
    kinesis.remove_shard("idle", &parent.shard_id);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = lists.0.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(30)).await;
    let calls = lists.0.load(Ordering::SeqCst) - before;
    run.stop().await;
    // 30 s of shard syncs every 500 ms: about 60 calls (and a few rounds run early).
    assert!(
        calls <= 75,
        "{calls} ListShards calls in 30 s for shard syncs due every 500 ms"
    );
}

/// Regression: at LATEST, a child created by a later sync was read from its oldest record.
///
/// A first sync cut short after the closed parent's row was
/// created but before a child's (here: the child's create throttled once) leaves the
/// child to a later sync, which is not `first` and gives a child whose parent is
/// listed TRIM_HORIZON. The child is read from its oldest record: everything written
/// to it before the group started (up to the stream's retention) is delivered to a
/// consumer that asked for LATEST. The child of a parent whose row still holds the
/// group's AT_TIMESTAMP start could take that same start.
///
/// Arrival times and the margin are wall-clock (`SystemTime`), which tokio's paused
/// clock does not move: the test blocks 2.5 s of real time to age the records.
#[tokio::test(start_paused = true)]
async fn latest_reads_no_history_after_a_cut_short_first_sync() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("lh", 1).await.unwrap();
    let parent = open_shards(kinesis.as_ref(), "lh").await.remove(0);
    produce(kinesis.as_ref(), "lh", 0..50).await;
    kinesis
        .split_shard("lh", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    produce(kinesis.as_ref(), "lh", 50..100).await;
    let lower = open_shards(kinesis.as_ref(), "lh").await.remove(0);
    assert!(!kinesis.records("lh", &lower.shard_id).is_empty());
    // Everything so far is older than the clock margin when the worker starts.
    std::thread::sleep(Duration::from_millis(2_500));
    let backend = BadCreate::on(&memory, &lower.shard_id, CreateFault::FailOnce);
    let used = backend.hooks.used.clone();
    let recorder = Recorder::default();
    let consumer = test_consumer(backend, "lh", "lh-group", "w1")
        .initial_position(shardflow::InitialPosition::Latest)
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    within(LIMIT, "the rows are created", async {
        while memory.table("lh-group").rows().len() < 3 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    produce(kinesis.as_ref(), "lh", 100..150).await;
    let open = open_shards(kinesis.as_ref(), "lh").await;
    let sentinels = produce_sentinels(kinesis.as_ref(), "lh", &open, 1_000).await;
    let wanted: Vec<usize> = (100..150).chain(sentinels).collect();
    recorder.wait_for_values(&wanted, LIMIT).await;
    run.stop().await;
    assert!(used.load(Ordering::SeqCst), "the fault was injected");
    let old: Vec<usize> = recorder
        .snapshot()
        .iter()
        .map(|h| h.value)
        .filter(|v| *v < 100)
        .collect();
    assert!(
        old.is_empty(),
        "{} records written before the start delivered under LATEST, e.g. {:?}",
        old.len(),
        &old[..old.len().min(8)]
    );
}
