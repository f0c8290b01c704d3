//! A lease row that exists but does not parse (memory backend, paused clock): it is
//! never taken, renewed, overwritten or deleted, its shard's children wait for it as for
//! an unfinished parent, every worker that lists the table reports it (health not ready,
//! an event naming the shard), and once an operator repairs it nothing is lost.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardflow::kinesis::StreamAdmin;
use shardflow::lease::{Checkpoint, LeaseError, LeaseStore};
use shardflow::{Memory, ShardEvent};
use testkit::*;

/// Virtual time (the clock is paused): generous, and never a real wait.
const LIMIT: Duration = Duration::from_secs(120);

/// The store answers a row made unreadable as such, refuses every write to it, and
/// gives back what it held once repaired.
#[tokio::test]
async fn an_unreadable_row_is_listed_as_such_and_never_written() {
    let memory = Memory::new();
    let table = memory.table("rows");
    let row = shardflow::lease::Lease::new("shard-a", Vec::new(), Checkpoint::TrimHorizon);
    assert!(table.create(&row).await.unwrap());
    let held = table.take(&row, "w1#a").await.unwrap();
    assert!(table.make_unreadable("shard-a", "checkpoint \"12x\" is not a number"));
    let listed = table.list().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        listed[0].unreadable.as_deref(),
        Some("checkpoint \"12x\" is not a number")
    );
    let fetched = table.get("shard-a").await.unwrap().unwrap();
    assert!(fetched.unreadable.is_some());
    // Neither with the owner's last view nor with the listing's stand-in.
    for expected in [&held, &fetched] {
        assert!(matches!(
            table.renew(expected).await,
            Err(LeaseError::Corrupt(_))
        ));
        assert!(matches!(
            table.take(expected, "w2#b").await,
            Err(LeaseError::Corrupt(_))
        ));
        assert!(matches!(
            table.checkpoint(expected, &Checkpoint::ShardEnd).await,
            Err(LeaseError::Corrupt(_))
        ));
        assert!(matches!(
            table.release(expected).await,
            Err(LeaseError::Corrupt(_))
        ));
        assert!(matches!(
            table.delete(expected).await,
            Err(LeaseError::Corrupt(_))
        ));
    }
    assert!(!table.create(&row).await.unwrap(), "the row still exists");
    assert!(table.repair("shard-a"));
    assert_eq!(table.get("shard-a").await.unwrap().unwrap(), held);
}

/// A parent shard whose row does not parse, with records its consumer has not handled,
/// is split: neither it nor its children are read while the row stays unreadable, the
/// worker is not ready and names the row in its health and in an event; once the row is
/// repaired, every record is handled, the parent's before its children's.
///
/// Regression: a parent whose row did not parse counted as finished, so its children
/// were read while its own records were not.
#[tokio::test(start_paused = true)]
async fn children_of_an_unreadable_parent_wait_until_it_is_repaired() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("rows", 1).await.unwrap();
    produce(kinesis.as_ref(), "rows", 0..20).await;
    let recorder = Recorder::default();
    let consumer = || test_consumer(memory.clone(), "rows", "rows-group", "w1");
    let running = start(consumer().build().unwrap(), &recorder);
    recorder.wait_for(20, LIMIT).await;
    let parent = recorder.snapshot()[0].shard.clone();
    running.stop().await;

    // While nobody runs: records the parent's consumer never saw, the row goes bad,
    // the parent is split and its children get records too.
    produce(kinesis.as_ref(), "rows", 20..40).await;
    let table = memory.table("rows-group");
    assert!(table.make_unreadable(&parent, "leaseCounter is not a number"));
    kinesis
        .split_shard("rows", &parent, u128::MAX / 2)
        .await
        .unwrap();
    produce(kinesis.as_ref(), "rows", 40..60).await;

    let events: Arc<Mutex<Vec<ShardEvent>>> = Arc::default();
    let seen = events.clone();
    let running = consumer()
        .on_event(move |e| seen.lock().unwrap().push(e.clone()))
        .build()
        .unwrap()
        .run(recording_handler(recorder.clone()))
        .spawn();
    // Many lease rounds later, nothing of the parent or its children is read.
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(
        recorder.count(),
        20,
        "records read past an unreadable parent"
    );
    let health = running.health();
    assert_eq!(
        health.unreadable_rows,
        vec![(parent.clone(), "leaseCounter is not a number".to_owned())]
    );
    assert!(health.is_live(), "{health:?}");
    assert!(!health.is_ready(), "{health:?}");
    let unreadable_events = events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, ShardEvent::RowUnreadable { shard, .. } if *shard == parent))
        .count();
    assert_eq!(unreadable_events, 1, "one event names the row");
    let stored = table.rows();
    let row = stored.iter().find(|r| r.key == parent).unwrap();
    assert_eq!(row.owner, None, "the unreadable row was taken");

    assert!(table.repair(&parent));
    recorder.wait_for(60, LIMIT).await;
    let values: Vec<usize> = recorder.snapshot().iter().map(|h| h.value).collect();
    for v in 0..60 {
        assert!(values.contains(&v), "value {v} was never handled");
    }
    // Per partition key, the parent's records come before its children's.
    let after_repair = &recorder.snapshot()[20..];
    for (i, h) in after_repair.iter().enumerate() {
        if h.shard == parent {
            assert!(
                after_repair[..i]
                    .iter()
                    .all(|e| e.shard == parent || e.partition_key != h.partition_key),
                "value {} of the parent came after a child's record of its key",
                h.value
            );
        }
    }
    within(LIMIT, "ready again", async {
        while !running.health().is_ready() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    running.shutdown().await.unwrap();
}
