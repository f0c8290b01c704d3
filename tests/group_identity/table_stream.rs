//! A lease table knows its stream: two consumers with the same group name (so the same
//! default lease table) on two different streams are never mixed. Shard ids repeat
//! across streams (`shardId-000000000000` is in every stream), so without the check the
//! second consumer would read the first's checkpoints and SHARD_END rows as its own.
//!
//! The second consumer is refused at start-up with a typed error naming both streams
//! and the table; the first handles every one of its records. On the memory backend
//! (paused clock) and, when `scripts/test.sh` runs them, on the emulators.

use std::future::IntoFuture;
use std::time::Duration;

use shardflow::kinesis::{KinesisApi, StreamAdmin};
use shardflow::{Backend, ConsumerError, Memory};
use testkit::*;

const RECORDS: usize = 200;

async fn second_stream_is_refused<B: Backend + Clone>(backend: B, orders: &str, refunds: &str) {
    let kinesis = backend.admin().unwrap();
    kinesis.create_stream(orders, 2).await.unwrap();
    kinesis.create_stream(refunds, 2).await.unwrap();
    wait_until_active(kinesis.as_ref(), orders).await;
    wait_until_active(kinesis.as_ref(), refunds).await;
    let group = unique("billing");
    produce(kinesis.as_ref(), orders, 0..RECORDS).await;
    produce(kinesis.as_ref(), refunds, 0..RECORDS).await;

    let recorder = Recorder::default();
    let first = start(
        test_consumer(backend.clone(), orders, &group, "w1")
            .build()
            .unwrap(),
        &recorder,
    );
    recorder.wait_for(RECORDS, Duration::from_secs(120)).await;

    let other = Recorder::default();
    let second = test_consumer(backend.clone(), refunds, &group, "w2")
        .build()
        .unwrap();
    let table = second.config().lease_table().to_owned();
    let result = within(
        Duration::from_secs(120),
        "the consumer of the other stream returns",
        second.run(recording_handler(other.clone())).into_future(),
    )
    .await;
    match result {
        Err(ConsumerError::TableOfAnotherStream {
            table: t,
            stream,
            other_stream,
            ..
        }) => {
            assert_eq!(t, table);
            assert_eq!(stream, refunds);
            assert_eq!(other_stream, orders);
        }
        other => panic!("expected TableOfAnotherStream, got {other:?}"),
    }
    assert_eq!(other.count(), 0, "nothing of the other stream was handled");

    first.stop().await;
    let mut values: Vec<usize> = recorder.snapshot().iter().map(|h| h.value).collect();
    values.sort_unstable();
    values.dedup();
    assert_eq!(
        values,
        (0..RECORDS).collect::<Vec<_>>(),
        "every record of the first stream"
    );
    // The first stream's rows were left alone and still name it.
    let rows = backend.lease_store(&table).list().await.unwrap();
    assert!(!rows.is_empty());
    for row in rows {
        assert_eq!(row.stream.as_deref(), Some(orders), "{row:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_second_stream_under_the_same_group_is_refused_in_memory() {
    second_stream_is_refused(Memory::new(), "orders", "refunds").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_stream_under_the_same_group_is_refused_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    let (orders, refunds) = (unique("orders"), unique("refunds"));
    within(
        Duration::from_secs(600),
        "two streams under one group on the emulators",
        second_stream_is_refused(aws, &orders, &refunds),
    )
    .await;
}

/// A KCL table (rows without `streamName`) taken over by a consumer of "orders" names
/// "orders" afterwards, so a consumer of "refunds" under the same group is refused too.
#[tokio::test(start_paused = true)]
async fn a_kcl_table_taken_over_is_claimed_for_its_stream() {
    use shardflow::lease::{Checkpoint, Lease};
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 2).await.unwrap();
    kinesis.create_stream("refunds", 2).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..RECORDS).await;
    let first = test_consumer(memory.clone(), "orders", "billing", "w1")
        .build()
        .unwrap();
    let table = first.config().lease_table().to_owned();
    let store = memory.lease_store(&table);
    store.ensure_table().await.unwrap();
    for shard in kinesis.list_shards("orders").await.unwrap() {
        let row = Lease::new(shard.shard_id, Vec::new(), Checkpoint::TrimHorizon);
        assert!(store.create(&row).await.unwrap(), "a KCL row, no stream");
    }
    let recorder = Recorder::default();
    let running = start(first, &recorder);
    recorder.wait_for(RECORDS, Duration::from_secs(120)).await;
    running.stop().await;
    for row in store.list().await.unwrap() {
        assert_eq!(row.stream.as_deref(), Some("orders"), "{row:?}");
    }

    let second = test_consumer(memory.clone(), "refunds", "billing", "w2")
        .build()
        .unwrap();
    let result = within(
        Duration::from_secs(120),
        "the consumer of the other stream returns",
        second
            .run(recording_handler(Recorder::default()))
            .into_future(),
    )
    .await;
    assert!(
        matches!(result, Err(ConsumerError::TableOfAnotherStream { .. })),
        "{result:?}"
    );
}

/// Two consumers of two streams start at the same moment on an empty table (both see
/// it empty and create rows): neither reads the other's rows; each is refused in its
/// first lease round, before it took a lease, or (shard ids are the same) keeps only
/// its own rows. Lease-store latency interleaves their start-ups.
#[tokio::test(start_paused = true)]
async fn two_streams_starting_together_on_an_empty_table_are_not_mixed() {
    use shardflow::memory::LeaseFaults;
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 2).await.unwrap();
    kinesis.create_stream("refunds", 2).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..RECORDS).await;
    produce(kinesis.as_ref(), "refunds", RECORDS..2 * RECORDS).await;
    memory.table("billing").set_faults(LeaseFaults {
        latency: Duration::from_millis(5),
        ..LeaseFaults::default()
    });
    let orders = Recorder::default();
    let refunds = Recorder::default();
    let a = test_consumer(memory.clone(), "orders", "billing", "w1")
        .build()
        .unwrap();
    let b = test_consumer(memory.clone(), "refunds", "billing", "w2")
        .build()
        .unwrap();
    let (a_stop, b_stop) = (a.shutdown_handle(), b.shutdown_handle());
    let a = tokio::spawn(a.run(recording_handler(orders.clone())).into_future());
    let b = tokio::spawn(b.run(recording_handler(refunds.clone())).into_future());
    // Both have started and run lease rounds (virtual time).
    tokio::time::sleep(Duration::from_secs(30)).await;
    a_stop.shutdown();
    b_stop.shutdown();
    let a = within(Duration::from_secs(120), "orders stops", a)
        .await
        .unwrap();
    let b = within(Duration::from_secs(120), "refunds stops", b)
        .await
        .unwrap();
    let refused = [&a, &b]
        .iter()
        .filter(|r| matches!(r, Err(ConsumerError::TableOfAnotherStream { .. })))
        .count();
    assert!(refused >= 1, "orders: {a:?}, refunds: {b:?}");
    // Whatever ran read only its own stream.
    assert!(orders.snapshot().iter().all(|h| h.value < RECORDS));
    assert!(refunds.snapshot().iter().all(|h| h.value >= RECORDS));
}
