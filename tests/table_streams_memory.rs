//! A table's change stream on the embedded backend, read by consumers as DynamoDB
//! Streams is read: 100,000 item writes across 16 partitions while the stream rolls
//! over 50 times, then a group of workers across rollovers and partition splits; every
//! change handled, in each item's order, nothing lost. Typed images decode, and a change
//! whose image does not fit the type goes to the dead-letter sink. Tokio's paused clock.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use shardflow::dynamodb_streams::{ChangeRecord, ChangeRecordError, EventName};
use shardflow::kinesis::KinesisApi;
use shardflow::lease::Checkpoint;
use shardflow::{Concurrency, Consumer, Memory, Message};
use shardflow_middleware::dead_letter::DeadLetterRecord;
use shardflow_middleware::decode::Format;
use shardflow_middleware::{BoxError, ServiceBuilderExt};
use tower::ServiceBuilder;

use testkit::within;

const LIMIT: Duration = Duration::from_secs(600);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Item {
    id: String,
    version: u64,
}

/// What the handler saw: each item's versions in the order they were handled, and the
/// changes of a child shard handled while a parent was not finished.
#[derive(Clone)]
struct Seen {
    versions: Arc<Mutex<HashMap<String, Vec<u64>>>>,
    early_children: Arc<Mutex<Vec<String>>>,
    memory: Memory,
}

impl Seen {
    fn new(memory: &Memory) -> Self {
        Seen {
            versions: Arc::default(),
            early_children: Arc::default(),
            memory: memory.clone(),
        }
    }

    /// Children start only after their parents finish: when a change of `shard` is
    /// handled, each of its parents' lease rows is at SHARD_END (its last change
    /// checkpointed) or gone (cleaned up after it finished). A closed parent without
    /// changes is finished too, so it holds its children no longer than it takes to
    /// read it.
    fn check_parents_finished(&self, arn: &str, shard: &str) {
        let Some(info) = self.memory.streams().shard_info(arn, shard) else {
            return;
        };
        let rows = self.memory.table("indexer").rows();
        for parent in info.parents() {
            if let Some(row) = rows.iter().find(|r| r.key == parent) {
                if row.checkpoint != Checkpoint::ShardEnd {
                    self.early_children.lock().unwrap().push(format!(
                        "{shard} handled while its parent {parent} is at {:?}",
                        row.checkpoint
                    ));
                }
            }
        }
    }

    fn handler(
        &self,
    ) -> impl tower::Service<Message, Response = (), Error = std::io::Error, Future: Send> + Clone
    {
        let this = self.clone();
        tower::service_fn(move |msg: Message| {
            let this = this.clone();
            async move {
                this.check_parents_finished(&msg.metadata.stream, &msg.metadata.shard_id);
                let seen = &this.versions;
                let change = ChangeRecord::from_payload(&msg.payload).expect("a change record");
                assert_eq!(msg.metadata.partition_key, change.partition_key());
                let item: Item = change
                    .new_image_as()
                    .expect("decodes")
                    .expect("puts carry their new image");
                seen.lock()
                    .unwrap()
                    .entry(item.id)
                    .or_default()
                    .push(item.version);
                Ok(())
            }
        })
    }

    fn versions(&self) -> HashMap<String, Vec<u64>> {
        self.versions.lock().unwrap().clone()
    }
}

fn consumer(memory: &Memory, worker: &str) -> shardflow::ConsumerBuilder {
    testkit::test_timings(
        Consumer::builder()
            .table_stream("orders")
            .group("indexer")
            .worker_id(worker)
            .backend(memory.clone()),
    )
}

/// Writes `writes` puts over `items` items (each put the item's next version), rolling
/// the stream over every `writes / rollovers` writes and splitting the partitions named
/// by `splits` (indexes of open shards) halfway, with the consumers running meanwhile.
/// Each item's last version.
async fn write(
    memory: &Memory,
    writes: u64,
    items: u64,
    rollovers: u64,
    splits: &[usize],
) -> HashMap<String, u64> {
    let table = memory.tables().table("orders").unwrap();
    let mut last = HashMap::new();
    let every = writes / rollovers;
    for n in 0..writes {
        // A fixed, spread-out order of items: item n * 7919 mod items.
        let id = format!("item-{}", (n * 7919) % items);
        let version = last.get(&id).copied().unwrap_or(0) + 1;
        table
            .put(&Item {
                id: id.clone(),
                version,
            })
            .unwrap()
            .expect("a new version changes the item");
        last.insert(id, version);
        if (n + 1) % every == 0 {
            table.rollover().unwrap();
        }
        if n == writes / 2 {
            for &index in splits {
                let shard = table.open_shards()[index].clone();
                table.split(&shard).unwrap();
            }
        }
        // Bursts of writes spanning several rollovers: parents still hold unread
        // changes when their children get theirs.
        if n % 10_000 == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    last
}

/// Every version of every item handled at least once, and no version handled before
/// every earlier version of its item was: after redeliveries an item's list may repeat
/// versions, never skip ahead.
fn assert_complete_and_in_item_order(seen: &Seen, last: &HashMap<String, u64>) {
    let early = seen.early_children.lock().unwrap().clone();
    assert!(
        early.is_empty(),
        "children before their parents finished: {early:?}"
    );
    let versions = seen.versions();
    assert_eq!(versions.len(), last.len(), "every item seen");
    for (id, &n) in last {
        let handled = &versions[id];
        let mut highest = 0;
        for &v in handled {
            assert!(
                v <= highest + 1,
                "{id}: {v} handled after only {highest}: {handled:?}"
            );
            highest = highest.max(v);
        }
        assert_eq!(highest, n, "{id}: every version handled");
    }
}

#[tokio::test(start_paused = true)]
async fn a_hundred_thousand_writes_over_16_partitions_and_50_rollovers_are_all_handled_in_item_order(
) {
    let memory = Memory::new();
    let table = memory
        .tables()
        .create("orders", "id")
        .partitions(16)
        .build()
        .unwrap();
    let seen = Seen::new(&memory);
    let running = consumer(&memory, "w1")
        .concurrency(Concurrency::PerKey(64))
        .build()
        .unwrap()
        .run(seen.handler())
        .spawn();
    let last = write(&memory, 100_000, 5_000, 50, &[]).await;
    let arn = table.stream_arn();
    within(LIMIT, "caught up", memory.wait_caught_up(&arn, "indexer")).await;
    running.shutdown().await.unwrap();

    let all_shards = memory.streams().list_shards(&arn).await.unwrap();
    assert_eq!(all_shards.len(), 16 * 51, "16 lineages of 51 shards");
    assert_complete_and_in_item_order(&seen, &last);
    // One worker, no failure: each change exactly once, so each item's versions 1..=n.
    for (id, versions) in seen.versions() {
        let expected: Vec<u64> = (1..=last[&id]).collect();
        assert_eq!(versions, expected, "{id}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_group_of_three_workers_handles_every_change_across_rollovers_and_splits() {
    let memory = Memory::new();
    let table = memory
        .tables()
        .create("orders", "id")
        .partitions(4)
        .build()
        .unwrap();
    let seen = Seen::new(&memory);
    let workers: Vec<_> = ["w1", "w2", "w3"]
        .into_iter()
        .map(|w| {
            consumer(&memory, w)
                .build()
                .unwrap()
                .run(seen.handler())
                .spawn()
        })
        .collect();
    let last = write(&memory, 20_000, 1_000, 10, &[0, 2]).await;
    let arn = table.stream_arn();
    within(LIMIT, "caught up", memory.wait_caught_up(&arn, "indexer")).await;
    for worker in workers {
        worker.shutdown().await.unwrap();
    }
    assert_eq!(table.open_shards().len(), 6, "two partitions split");
    assert_complete_and_in_item_order(&seen, &last);
}

/// A change's new image decoded into `T`: a `Format` for the decode layer.
struct NewImage<T>(PhantomData<fn() -> T>);

impl<T> Clone for NewImage<T> {
    fn clone(&self) -> Self {
        NewImage(PhantomData)
    }
}

impl<T: DeserializeOwned> Format<T> for NewImage<T> {
    type Error = ChangeRecordError;

    fn name(&self) -> &'static str {
        "DynamoDB change (new image)"
    }

    fn decode(&self, payload: &Bytes) -> Result<T, ChangeRecordError> {
        let change = ChangeRecord::from_payload(payload)?;
        // A REMOVE has no new image: the keys stand in for it here.
        match change.new_image_as()? {
            Some(item) => Ok(item),
            None => change.keys_as(),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn typed_images_decode_and_a_change_that_does_not_fit_is_dead_lettered() {
    #[derive(Debug, PartialEq, Serialize, Deserialize)]
    struct Order {
        id: String,
        total: u32,
    }
    let memory = Memory::new();
    let table = memory
        .tables()
        .create("orders", "id")
        .partitions(2)
        .build()
        .unwrap();
    for i in 0..20u32 {
        table
            .put(&Order {
                id: format!("order-{i}"),
                total: i,
            })
            .unwrap();
    }
    // Its total is text: the change does not fit `Order`.
    table
        .put(&serde_json::json!({"id": "order-bad", "total": "twelve"}))
        .unwrap();
    table.rollover().unwrap();
    table
        .put(&Order {
            id: "order-late".into(),
            total: 99,
        })
        .unwrap();

    let handled = Arc::new(Mutex::new(Vec::new()));
    let sunk = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let handled = handled.clone();
        tower::service_fn(move |msg: Message<Order>| {
            let handled = handled.clone();
            async move {
                handled.lock().unwrap().push(msg.payload);
                Ok::<_, BoxError>(())
            }
        })
    };
    let sink = {
        let sunk = sunk.clone();
        tower::service_fn(move |record: DeadLetterRecord| {
            let sunk = sunk.clone();
            async move {
                sunk.lock().unwrap().push(record);
                Ok::<_, BoxError>(())
            }
        })
    };
    let service = ServiceBuilder::new()
        .dead_letter(sink)
        .decode_with(NewImage::<Order>(PhantomData))
        .service(handler);
    let running = consumer(&memory, "w1")
        .build()
        .unwrap()
        .run(service)
        .spawn();
    within(
        LIMIT,
        "caught up",
        memory.wait_caught_up(&table.stream_arn(), "indexer"),
    )
    .await;
    running.shutdown().await.unwrap();

    let handled = handled.lock().unwrap();
    assert_eq!(handled.len(), 21, "20 orders and the late one");
    assert!(handled.contains(&Order {
        id: "order-late".into(),
        total: 99
    }));
    let sunk = sunk.lock().unwrap();
    assert_eq!(sunk.len(), 1, "the bad one, once");
    let change = ChangeRecord::from_payload(&sunk[0].payload).unwrap();
    assert_eq!(change.event_name, EventName::Insert);
    assert_eq!(change.partition_key(), r#"{"id":{"S":"order-bad"}}"#);
    assert!(sunk[0].error.contains("new image"), "{}", sunk[0].error);
}
