//! Stale ListShards answers and reads cut short on closed shards: a parent left out of
//! a listing is still read first, a finished parent is not read again, and a closed
//! shard read one record at a time is read to its end (embedded backend, paused clock,
//! fixed seeds, every wait bounded).

use std::time::Duration;

use shardflow::kinesis::{ShardInfo, StreamAdmin};
use shardflow::lease::Checkpoint;
use shardflow::Memory;
use testkit::*;

const LIMIT: Duration = Duration::from_secs(60);

/// Regression: a closed parent missing from the first ListShards answer was never read.
///
/// The first sync of a
/// new group gets a ListShards answer that leaves out a closed parent (a stale,
/// eventually consistent answer, as the reader's `gone_or` already allows for). Its
/// children get rows whose parent has none, so `balance` treats the parent as finished
/// and reads the children at once; the next sync then sees the parent's descendants
/// with rows and skips it as "consumed": the parent's records are never handled.
#[tokio::test(start_paused = true)]
async fn a_parent_left_out_of_the_first_list_shards_is_still_read_first() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    let (parent, shards) = split_with_records(kinesis.as_ref(), "f1", 50, 100).await;
    // The start-up sync's answer is stale: the parent is missing from it.
    kinesis.omit_from_list_shards(&parent.shard_id, 1);
    let recorder = Recorder::default();
    let run = start(
        test_consumer(memory.clone(), "f1", "f1-group", "w1")
            .build()
            .unwrap(),
        &recorder,
    );
    recorder.wait_for(100, LIMIT).await;
    run.stop().await;
    assert_exactly_once_in_order(&recorder.snapshot(), 100, &shards);
}

/// Regression: a finished parent was read again from its start after a stale ListShards.
///
/// Once a parent
/// was read to its end and its row cleaned up, a ListShards answer that still lists the
/// parent but not yet (or no longer) its children made `sync_shards` create the
/// parent's row again, at the initial position: the parent was read a second time from
/// TRIM_HORIZON. A finished row now stays (SHARD_END) while its shard is listed.
#[tokio::test(start_paused = true)]
async fn a_finished_parent_is_not_read_again_after_a_stale_list_shards() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    let (parent, shards) = split_with_records(kinesis.as_ref(), "f2", 50, 100).await;
    let table = memory.table("f2-group");
    let recorder = Recorder::default();
    let run = start(
        test_consumer(memory.clone(), "f2", "f2-group", "w1")
            .build()
            .unwrap(),
        &recorder,
    );
    recorder.wait_for(100, LIMIT).await;
    // The finished parent's row stays at SHARD_END (a tombstone while the shard is
    // listed) once both children started.
    within(
        LIMIT,
        "the parent finishes and both children start",
        async {
            loop {
                let rows = table.rows();
                let at = |key: &str| {
                    rows.iter()
                        .find(|r| r.key == key)
                        .map(|r| r.checkpoint.clone())
                };
                let started = shards
                    .iter()
                    .filter(|s| !s.is_closed())
                    .all(|s| matches!(at(&s.shard_id), Some(Checkpoint::At(_))));
                if started && at(&parent.shard_id) == Some(Checkpoint::ShardEnd) {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        },
    )
    .await;
    // One stale answer (the next sync's) without the children.
    let children: Vec<&ShardInfo> = shards.iter().filter(|s| !s.is_closed()).collect();
    for child in &children {
        kinesis.omit_from_list_shards(&child.shard_id, 1);
    }
    // The stale answer is used by one of the next syncs; ten sync intervals of virtual
    // time (absence can only be checked over a window).
    let back = tokio::time::timeout(Duration::from_secs(5), async {
        while table
            .rows()
            .iter()
            .any(|r| r.key == parent.shard_id && r.checkpoint == Checkpoint::ShardEnd)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    // A restart (or any failover of the children): the group goes on from its table.
    run.stop().await;
    let run = start(
        test_consumer(memory.clone(), "f2", "f2-group", "w2")
            .build()
            .unwrap(),
        &recorder,
    );
    let open = open_shards(kinesis.as_ref(), "f2").await;
    let sentinels = produce_sentinels(kinesis.as_ref(), "f2", &open, 100).await;
    recorder.wait_for_values(&sentinels, LIMIT).await;
    run.stop().await;
    assert_no_value_twice(&recorder.snapshot());
    assert!(
        back.is_err(),
        "the finished parent's row was removed or moved back from SHARD_END"
    );
}

/// Regression: two stale ListShards answers let a finished parent's row go, and the parent was read twice.
///
/// The parent is read to its end while every ListShards answer leaves its
/// new children out (no child row exists yet, and the row names no child); then two
/// answers in a row leave the parent out too. `clean_up` took the parent for past
/// retention and deleted its row although the shard was still in the stream; once the
/// answers were whole again, the parent (listed, closed, no row, children without rows)
/// got a row again and was read a second time from its start. A row whose children are
/// known nowhere now goes only when GetShardIterator also says the shard is gone.
#[tokio::test(start_paused = true)]
async fn a_finished_row_is_kept_while_stale_listings_leave_out_it_and_its_children() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("f4", 1).await.unwrap();
    let parent = open_shards(kinesis.as_ref(), "f4").await.remove(0);
    produce(kinesis.as_ref(), "f4", 0..50).await;
    let table = memory.table("f4-group");
    let recorder = Recorder::default();
    let run = start(
        test_consumer(memory.clone(), "f4", "f4-group", "w1")
            .build()
            .unwrap(),
        &recorder,
    );
    recorder.wait_for(50, LIMIT).await;
    // The embedded backend numbers shards in creation order: the split's children are
    // the next two ids. Every answer leaves them out until the test says otherwise.
    let children = ["shardId-000000000001", "shardId-000000000002"];
    for child in children {
        kinesis.omit_from_list_shards(child, u32::MAX);
    }
    kinesis
        .split_shard("f4", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    within(LIMIT, "the parent is read to its end and released", async {
        while !table.rows().iter().any(|r| {
            r.key == parent.shard_id && r.checkpoint == Checkpoint::ShardEnd && r.owner.is_none()
        }) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // The next answers leave the parent out as well.
    kinesis.omit_from_list_shards(&parent.shard_id, 4);
    let deleted = tokio::time::timeout(Duration::from_secs(5), async {
        while table.rows().iter().any(|r| r.key == parent.shard_id) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    for child in children {
        kinesis.omit_from_list_shards(child, 0);
    }
    let open = open_shards(kinesis.as_ref(), "f4").await;
    assert_eq!(
        open.iter().map(|s| s.shard_id.as_str()).collect::<Vec<_>>(),
        children
    );
    let sentinels = produce_sentinels(kinesis.as_ref(), "f4", &open, 50).await;
    recorder.wait_for_values(&sentinels, LIMIT).await;
    run.stop().await;
    assert_no_value_twice(&recorder.snapshot());
    assert!(
        deleted.is_err(),
        "the finished parent's row was deleted while its shard was still in the stream"
    );
}

/// After a read cut short (records but no
/// next iterator / continuation) the reader reads again AT the last delivered record;
/// with one record per read (`max_records_per_read(1)`, or one record per fan-out
/// event) that read holds only the record already delivered, so it "brings nothing
/// new", and when it is cut short too (the shard is closed) the reader takes it for the
/// shard's end: the rest of the closed shard is never read.
async fn one_record_reads_cut_short_do_not_end_a_closed_shard(fan_out: bool) {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    let (_, shards) = split_with_records(kinesis.as_ref(), "f3", 20, 30).await;
    kinesis.set_max_records_per_event(1);
    kinesis.set_cut_short_reads(1.0);
    let recorder = Recorder::default();
    let mut builder = test_consumer(memory.clone(), "f3", "f3-group", "w1").max_records_per_read(1);
    if fan_out {
        builder = builder.fan_out("f3-app");
    }
    let run = start(builder.build().unwrap(), &recorder);
    recorder.wait_for(30, LIMIT).await;
    run.stop().await;
    assert_exactly_once_in_order(&recorder.snapshot(), 30, &shards);
}

/// Regression: a closed shard read one record per page ended after its first cut-short read.
#[tokio::test(start_paused = true)]
async fn one_record_pages_cut_short_do_not_end_a_closed_shard() {
    one_record_reads_cut_short_do_not_end_a_closed_shard(false).await;
}

/// Regression: a closed shard read one record per event ended after its first cut-short read.
#[tokio::test(start_paused = true)]
async fn one_record_events_cut_short_do_not_end_a_closed_shard() {
    one_record_reads_cut_short_do_not_end_a_closed_shard(true).await;
}
