//! A LATEST start resolved by one owner and never written is not resolved again by the
//! next, and a start resolved on a clock that runs ahead is not in Kinesis' future
//! (embedded backend, paused clock, wall-clock arrival times).

use std::time::{Duration, SystemTime};

use shardflow::kinesis::{KinesisApi, StreamAdmin};
use shardflow::lease::{Checkpoint, Lease, LeaseError, LeaseStore};
use shardflow::{InitialPosition, Memory};
use testkit::hooks::{Hooked, Hooks};
use testkit::*;

const LIMIT: Duration = Duration::from_secs(60);

/// A lease table whose checkpoint writes all fail (throttled), as for a worker cut off
/// from its table's write capacity; everything else goes through.
struct NoCheckpoints;

#[async_trait::async_trait]
impl Hooks for NoCheckpoints {
    async fn before_lease(&self, op: &'static str, _: Option<&str>) -> Result<(), LeaseError> {
        if op == "checkpoint" {
            return Err(LeaseError::Throttled(
                "injected: no checkpoint writes".into(),
            ));
        }
        Ok(())
    }
}

/// Regression: a LATEST start never written was resolved again by the next owner, skipping records.
///
/// LATEST is resolved into a time only by
/// the task that took the lease, in a separate write after the take. If that write
/// never lands before the owner leaves (here: its checkpoint writes are throttled, and
/// it stops), the next owner resolves "now" again: records written after the group
/// first took the shard, and older than the clock margin, are never handled — against
/// the promise of `InitialPosition::Latest` ("nothing written in between is skipped").
///
/// Arrival times and the margin are wall-clock (`SystemTime`), which tokio's paused
/// clock does not move: the test blocks 2.5 s of real time to age the records.
#[tokio::test(start_paused = true)]

async fn a_latest_start_not_yet_written_is_not_resolved_again_later() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("f5", 1).await.unwrap();
    let table = memory.table("f5-group");
    let a = test_consumer(
        Hooked::new(memory.clone(), NoCheckpoints),
        "f5",
        "f5-group",
        "a",
    )
    .initial_position(InitialPosition::Latest)
    .build()
    .unwrap();
    let recorder = Recorder::default();
    let a_run = start(a, &recorder);
    within(LIMIT, "A took the lease", async {
        while table.rows().first().and_then(|r| r.owner.clone()).is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // Written after the group took the shard.
    produce(kinesis.as_ref(), "f5", 0..20).await;
    a_run.stop().await;
    std::thread::sleep(Duration::from_millis(2_500));
    let b = test_consumer(memory.clone(), "f5", "f5-group", "b")
        .initial_position(InitialPosition::Latest)
        .build()
        .unwrap();
    let b_run = start(b, &recorder);
    let shards = kinesis.list_shards("f5").await.unwrap();
    let sentinels = produce_sentinels(kinesis.as_ref(), "f5", &shards, 20).await;
    recorder.wait_for_values(&sentinels, LIMIT).await;
    b_run.stop().await;
    assert_exactly_once_in_order(&recorder.snapshot(), 21, &shards);
}

/// A worker whose clock runs a minute ahead resolves LATEST (in the rows it creates,
/// or, with `kcl_rows`, in rows a KCL table left at the `LATEST` sentinel) and stops
/// before any record comes; 100 records are written; the next worker, with a right
/// clock, continues from the rows and must handle all of them.
async fn a_start_resolved_on_a_clock_a_minute_ahead(stream: &str, kcl_rows: bool) {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream(stream, 2).await.unwrap();
    let shards = kinesis.list_shards(stream).await.unwrap();
    let group = format!("{stream}-group");
    let table = memory.table(&group);
    if kcl_rows {
        table.ensure_table().await.unwrap();
        for shard in &shards {
            let row = Lease::new(shard.shard_id.clone(), Vec::new(), Checkpoint::Latest);
            assert!(table.create(&row).await.unwrap());
        }
    }
    let a = test_consumer(memory.clone(), stream, &group, "a")
        .initial_position(InitialPosition::Latest)
        .wall_clock(|| SystemTime::now() + Duration::from_secs(60))
        .build()
        .unwrap();
    let recorder = Recorder::default();
    let a_run = start(a, &recorder);
    within(LIMIT, "A made the start of every shard durable", async {
        loop {
            let rows = table.rows();
            if rows.len() == shards.len()
                && rows
                    .iter()
                    .all(|r| matches!(r.checkpoint, Checkpoint::AtTimestamp(Some(_))))
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    a_run.stop().await;
    // Written after the group started, on Kinesis' clock.
    produce(kinesis.as_ref(), stream, 0..100).await;
    let b = test_consumer(memory.clone(), stream, &group, "b")
        .initial_position(InitialPosition::Latest)
        .build()
        .unwrap();
    let b_run = start(b, &recorder);
    recorder.wait_for(100, LIMIT).await;
    b_run.stop().await;
    assert_exactly_once_in_order(&recorder.snapshot(), 100, &shards);
}

/// Regression: a worker whose clock ran a minute ahead put LATEST's start a minute into Kinesis' future.
///
/// The first worker resolved LATEST on its own clock into `AT_TIMESTAMP` of its "now"
/// less the 2 s margin and made that durable; it then stopped before any record
/// came. Records written right after arrived (on Kinesis' clock) before that start,
/// so the next worker, continuing from the row, skipped every one of them (0 of 100).
/// The start is now confirmed by Kinesis, which refuses a time in its future.
#[tokio::test(start_paused = true)]
async fn a_latest_start_resolved_on_a_clock_a_minute_ahead_skips_nothing() {
    a_start_resolved_on_a_clock_a_minute_ahead("skew", false).await;
}

/// Regression: a KCL table's LATEST sentinel resolved on a clock a minute ahead skipped that minute.
///
/// The task that first takes such a row resolves it before reading, on its own clock,
/// the same way the rows shardflow creates were resolved.
#[tokio::test(start_paused = true)]
async fn a_kcl_latest_sentinel_resolved_on_a_clock_a_minute_ahead_skips_nothing() {
    a_start_resolved_on_a_clock_a_minute_ahead("kcl-skew", true).await;
}

/// A KCL table's LATEST row for a shard already past retention (Kinesis answers
/// NotFound for it) does not hold its children back: checking its start against
/// Kinesis' clock gives up after a few NotFound answers, the reader finds the shard
/// gone and ends it, and its children are read.
#[tokio::test(start_paused = true)]
async fn a_kcl_latest_row_of_a_shard_past_retention_does_not_hold_its_children_back() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("gone", 1).await.unwrap();
    let parent = kinesis.list_shards("gone").await.unwrap().remove(0);
    kinesis
        .split_shard("gone", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    let children: Vec<_> = kinesis
        .list_shards("gone")
        .await
        .unwrap()
        .into_iter()
        .filter(|s| !s.is_closed())
        .collect();
    let table = memory.table("gone-group");
    table.ensure_table().await.unwrap();
    let row = Lease::new(parent.shard_id.clone(), Vec::new(), Checkpoint::Latest);
    assert!(table.create(&row).await.unwrap());
    for child in &children {
        let row = Lease::new(
            child.shard_id.clone(),
            vec![parent.shard_id.clone()],
            Checkpoint::Latest,
        );
        assert!(table.create(&row).await.unwrap());
    }
    kinesis.remove_shard("gone", &parent.shard_id);
    let recorder = Recorder::default();
    let run = start(
        test_consumer(memory.clone(), "gone", "gone-group", "w1")
            .initial_position(InitialPosition::Latest)
            .build()
            .unwrap(),
        &recorder,
    );
    within(LIMIT, "the children have their durable start", async {
        loop {
            let rows = table.rows();
            let started = children.iter().all(|c| {
                rows.iter().any(|r| {
                    r.key == c.shard_id && matches!(r.checkpoint, Checkpoint::AtTimestamp(Some(_)))
                })
            });
            if started {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let sentinels = produce_sentinels(kinesis.as_ref(), "gone", &children, 20).await;
    recorder.wait_for_values(&sentinels, LIMIT).await;
    run.stop().await;
    assert_no_value_twice(&recorder.snapshot());
}
