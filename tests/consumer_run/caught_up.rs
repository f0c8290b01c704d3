//! Waiting until a group has handled and checkpointed everything written to a stream
//! of the embedded backend (`Memory::caught_up`, `Memory::wait_caught_up`).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardflow::lease::{Checkpoint, Lease, LeaseStore};
use shardflow::producer::{Producer, ProducerRecord};
use shardflow::{CheckpointPolicy, Consumer, Memory, Message, Position};

/// Every record written before and after a split is handled by the time the wait
/// ends, and not before: the check is false while a record is unhandled.
#[tokio::test(start_paused = true)]
async fn the_wait_ends_once_every_record_is_handled_and_checkpointed() {
    let memory = Memory::new();
    memory.create_stream("orders", 2).await.unwrap();
    let producer = Producer::builder()
        .stream("orders")
        .backend(memory.clone())
        .build()
        .unwrap();
    let mut written = BTreeSet::new();
    for i in 0..60 {
        let payload = format!("order-{i}");
        producer
            .send(ProducerRecord::new(
                payload.clone(),
                format!("customer-{i}"),
            ))
            .await
            .unwrap();
        written.insert(payload);
    }
    let children = memory
        .split_shard_in_half("orders", "shardId-000000000000")
        .await
        .unwrap();
    assert_eq!(children.len(), 2, "{children:?}");
    for i in 60..120 {
        let payload = format!("order-{i}");
        producer
            .send(ProducerRecord::new(
                payload.clone(),
                format!("customer-{i}"),
            ))
            .await
            .unwrap();
        written.insert(payload);
    }
    producer.close().await;
    assert!(!memory.caught_up("orders", "billing"), "nothing ran yet");

    let handled = Arc::new(Mutex::new(BTreeSet::new()));
    let seen = handled.clone();
    let consumer = Consumer::builder()
        .stream("orders")
        .group("billing")
        .backend(memory.clone())
        .checkpoint(CheckpointPolicy::Interval(Duration::from_secs(5)))
        .build()
        .unwrap();
    let running = consumer
        .run(tower::service_fn(move |msg: Message| {
            let seen = seen.clone();
            async move {
                let payload = String::from_utf8_lossy(&msg.payload).into_owned();
                seen.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(payload);
                Ok::<_, std::io::Error>(())
            }
        }))
        .spawn();
    tokio::time::timeout(
        Duration::from_secs(120),
        memory.wait_caught_up("orders", "billing"),
    )
    .await
    .expect("the group catches up");
    let handled = handled.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert_eq!(handled, written, "every record handled when the wait ends");
    running.shutdown().await.unwrap();
    assert!(memory.caught_up("orders", "billing"));
}

/// A shard whose last record is unhandled is not caught up, whatever the others.
#[tokio::test(start_paused = true)]
async fn a_checkpoint_short_of_the_last_record_is_not_caught_up() {
    let memory = Memory::new();
    memory.create_stream("orders", 1).await.unwrap();
    let producer = Producer::builder()
        .stream("orders")
        .backend(memory.clone())
        .build()
        .unwrap();
    producer
        .send(ProducerRecord::new("first", "customer-1"))
        .await
        .unwrap();
    let second = producer
        .send(ProducerRecord::new("second", "customer-1"))
        .await
        .unwrap();
    producer.close().await;
    let first = memory.streams().records("orders", "shardId-000000000000")[0]
        .sequence_number
        .clone();
    let at = |sequence| {
        let checkpoint = Checkpoint::At(Position::new(sequence, 0));
        Lease::new("shardId-000000000000", vec![], checkpoint)
    };
    let short = memory.table("short");
    assert!(short.create(&at(first)).await.unwrap());
    assert!(!memory.caught_up("orders", "short"));
    let done = memory.table("done");
    assert!(done.create(&at(second.sequence_number)).await.unwrap());
    assert!(memory.caught_up("orders", "done"));
}
