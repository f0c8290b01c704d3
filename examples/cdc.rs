//! Change data capture: an outbox table's inserts published to a Kinesis stream.
//!
//! The application writes each order to an `outbox` table (and later marks it sent: a
//! MODIFY, which is not published). A processor reads the table's change stream, turns
//! each INSERT into an event on the `order-events` stream (`produce_to`), and its
//! checkpoint passes a change only once Kinesis stored the event: a crash publishes an
//! order again, never loses one. Each event names the change it came from (`source`, the
//! change's event id), and the subscriber's `DedupLayer` keyed on it handles a repeat
//! once: each order once in effect. The table's stream rolls over while the demo runs,
//! as DynamoDB Streams' shards do every few hours.
//!
//! ```text
//! cargo run --example cdc    # on the embedded backend; prints each order published
//! ```

mod common;

use std::time::Duration;

use common::AnyBackend;
use serde::{Deserialize, Serialize};
use shardflow::dynamodb_streams::{ChangeRecord, EventName};
use shardflow::kinesis::StreamAdmin;
use shardflow::{CheckpointPolicy, Concurrency, Consumer, Memory, Message, Producer};
use shardflow_middleware::{produce::Output, DedupLayer, MemoryDedupStore, ServiceBuilderExt};
use tower::ServiceBuilder;

/// How many orders the demo writes.
const ORDERS: usize = 500;

/// An order as the application stores it in the outbox table.
#[derive(Debug, Serialize, Deserialize)]
struct Order {
    id: String,
    customer: String,
    total: u32,
    sent: bool,
}

/// The event published for an order, with the change it came from (`source`).
#[derive(Debug, Serialize, Deserialize)]
struct OrderPlaced {
    order: Order,
    source: String,
}

/// One change in, the order's event out when it is an INSERT, nothing otherwise; keyed
/// by the customer so each customer's events keep their order.
async fn publish(
    change: Message,
) -> Result<Option<Output>, Box<dyn std::error::Error + Send + Sync>> {
    let change = ChangeRecord::from_payload(&change.payload)?;
    if change.event_name != EventName::Insert {
        return Ok(None);
    }
    let Some(order) = change.new_image_as::<Order>()? else {
        return Ok(None);
    };
    let customer = order.customer.clone();
    let event = OrderPlaced {
        order,
        source: change.event_id,
    };
    Ok(Some(
        Output::new(serde_json::to_vec(&event)?).partition_key(customer),
    ))
}

#[tokio::main]
async fn main() -> common::Result {
    common::init_tracing("warn");
    let memory = Memory::new();
    let backend = AnyBackend::Memory(memory.clone());
    memory.streams().create_stream("order-events", 2).await?;
    let outbox = memory
        .tables()
        .create("outbox", "id")
        .partitions(4)
        .build()?;

    // The processor: the outbox's changes → order events.
    let producer = Producer::builder()
        .stream("order-events")
        .backend(backend.clone())
        .ordered_per_key(true)
        .build()?;
    let processor = ServiceBuilder::new()
        .produce_to(producer.clone()) // the checkpoint moves after the event is stored
        .service_fn(publish);
    let processor = Consumer::builder()
        .table_stream("outbox") // the table's current stream, resolved at start
        .group("outbox-publisher")
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(50))
        .shard_sync_interval(Duration::from_millis(200))
        .checkpoint(CheckpointPolicy::Interval(Duration::from_millis(200)))
        .concurrency(Concurrency::PerKey(16)) // 16 orders at once, each item in order
        .build()?
        .run(processor)
        .spawn();

    // The subscriber: each order once, whatever the processor repeated.
    let (published, progress) = tokio::sync::watch::channel(0usize);
    let dedup = DedupLayer::new(MemoryDedupStore::new(100_000));
    let subscriber = ServiceBuilder::new()
        .decode::<OrderPlaced>()
        .layer(dedup.key(|m: &Message<OrderPlaced>| m.payload.source.clone()))
        .service_fn(move |m: Message<OrderPlaced>| {
            let order = &m.payload.order;
            println!(
                "published order {} of {} ({})",
                order.id, order.customer, order.total
            );
            published.send_modify(|n| *n += 1);
            async { Ok::<_, std::convert::Infallible>(()) }
        });
    let subscriber = common::local_consumer(backend, "order-events", "fulfilment")
        .build()?
        .run(subscriber)
        .until(common::at_least(progress, ORDERS));

    // The application: orders written to the outbox, each marked sent afterwards (a
    // MODIFY, not published), the table's stream rolling over now and then.
    let writer = async {
        for i in 0..ORDERS {
            let id = format!("order-{i}");
            let order = Order {
                id: id.clone(),
                customer: format!("customer-{}", i % 23),
                total: (i as u32 * 37) % 500,
                sent: false,
            };
            outbox.put(&order)?;
            if i >= 10 {
                let sent = format!("order-{}", i - 10);
                outbox.update(
                    &serde_json::json!({ "id": sent }),
                    &serde_json::json!({ "sent": true }),
                )?;
            }
            if i % 100 == 99 {
                outbox.rollover()?;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        Ok::<_, common::Error>(())
    };
    let (written, subscribed) = tokio::join!(writer, subscriber);
    written?;
    subscribed?;
    processor.shutdown().await?;
    producer.close().await;
    Ok(())
}
