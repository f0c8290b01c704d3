//! A shard shardflow read to its end carries `childShardIds` in its row, as the KCL
//! writes it when a shard ends, so a KCL application that takes the table back finds
//! the children of a finished parent. Memory backend, paused clock.

use std::time::Duration;

use shardflow::kinesis::{KinesisApi, StreamAdmin};
use shardflow::lease::Checkpoint;
use shardflow::{Backend, Memory};
use testkit::*;

#[tokio::test(start_paused = true)]
async fn an_ended_shard_records_its_children_like_the_kcl() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..50).await;
    let consumer = test_consumer(memory.clone(), "orders", "billing", "w1")
        .build()
        .unwrap();
    let store = memory.lease_store(consumer.config().lease_table());
    let recorder = Recorder::default();
    let running = start(consumer, &recorder);
    recorder.wait_for(50, Duration::from_secs(120)).await;

    let parent = kinesis.list_shards("orders").await.unwrap().remove(0);
    kinesis
        .split_shard("orders", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    let mut children: Vec<String> = kinesis
        .list_shards("orders")
        .await
        .unwrap()
        .into_iter()
        .filter(|s| s.parents().contains(&parent.shard_id))
        .map(|s| s.shard_id)
        .collect();
    children.sort();
    assert_eq!(children.len(), 2);
    // The parent's row stays (it is deleted only past retention) and is read until it
    // names its children.
    let row = within(
        Duration::from_secs(120),
        "the parent's row names its children",
        async {
            loop {
                let row = store.get(&parent.shard_id).await.unwrap().unwrap();
                if row.checkpoint == Checkpoint::ShardEnd && !row.children.is_empty() {
                    return row;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        },
    )
    .await;
    assert_eq!(row.children, children);
    running.stop().await;
}
