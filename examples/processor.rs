//! A processor: orders → enrich → shipments, one stream's records becoming another's.
//!
//! The rule it shows (at least once end to end, exactly once in effect): an order counts
//! as handled, and the checkpoint may pass it, only once Kinesis stored its shipment
//! (`produce_to`): a crash repeats a shipment, never loses one. Each shipment names its
//! order (`source`), and the warehouse's `DedupLayer` keyed on it handles a repeat once.
//! The producer is `ordered_per_key`: a customer's shipments keep their orders' order.
//!
//! ```text
//! cargo run --example processor    # the demo (common/processor_demo.rs); prints each shipment
//! cargo run --example processor -- --orders O --shipments S --group G [--worker ID]
//! ```
//! With flags it is one processor process on AWS until SIGTERM or SIGINT
//! (`tests/processor/processes.rs` kills and restarts it).

mod common;
#[path = "common/processor_demo.rs"]
mod processor_demo;

use clap::Parser;
use common::{AnyBackend, Until};
use serde::{Deserialize, Serialize};
use shardflow::{Concurrency, Message, Producer};
use shardflow_middleware::{produce::Output, DedupLayer, MemoryDedupStore, ServiceBuilderExt};
use tokio::sync::watch::Sender;
use tower::ServiceBuilder;

/// How many orders the demo writes.
const ORDERS: usize = 1_000;

/// An order as it arrives: `n` counts the customer's orders (0, 1, 2, ...).
#[derive(Debug, Serialize, Deserialize)]
struct Order {
    id: u64,
    customer: String,
    n: u64,
}

/// An order enriched for the warehouse, with where it came from (`source`).
#[derive(Debug, Serialize, Deserialize)]
struct Shipment {
    #[serde(flatten)]
    order: Order,
    warehouse: String,
    source: String,
}

/// One order in, one shipment out, under the order's partition key (the customer).
async fn enrich(order: Message<Order>) -> Result<Output, serde_json::Error> {
    let h = &order.metadata;
    let source = format!("{}/{}/{}", h.stream, h.shard_id, h.position());
    let warehouse = ["berlin", "lyon", "porto"][(order.payload.id % 3) as usize].to_owned();
    let shipment = Shipment {
        order: order.payload,
        warehouse,
        source,
    };
    Ok(Output::new(serde_json::to_vec(&shipment)?))
}

/// One processor until `until`; then it drains (an order in flight waits for its shipment),
/// checkpoints and releases its leases, and the producer writes what is left.
async fn process(backend: AnyBackend, names: [&str; 4], until: Until) -> common::Result {
    let [orders, shipments, group, worker] = names;
    let producer = Producer::builder()
        .stream(shipments)
        .backend(backend.clone())
        .ordered_per_key(true) // each customer's shipments in the order of their orders
        .build()?;
    let processor = ServiceBuilder::new()
        .produce_to(producer.clone()) // the checkpoint moves after the shipment is stored
        .decode::<Order>()
        .service_fn(enrich);
    let consumer = common::local_consumer(backend, orders, group)
        .worker_id(worker)
        .concurrency(Concurrency::PerKey(32)) // 32 customers at once, each in order
        .build()?;
    consumer.run(processor).until(until).await?;
    producer.close().await;
    Ok(())
}

/// The warehouse: each shipment once (a `DedupLayer` keyed on `source`), until all shipped.
async fn warehouse(backend: AnyBackend, stream: &str, shipped: Sender<usize>) -> common::Result {
    let all_shipped = common::at_least(shipped.subscribe(), ORDERS);
    let dedup = DedupLayer::new(MemoryDedupStore::new(100_000));
    let handler = ServiceBuilder::new()
        .decode::<Shipment>()
        .layer(dedup.key(|m: &Message<Shipment>| m.payload.source.clone()))
        .service_fn(move |m: Message<Shipment>| {
            let (Order { id, customer, n }, from) = (&m.payload.order, &m.payload.warehouse);
            println!("shipped {customer} #{n} (order {id}) from {from}");
            shipped.send_modify(|n| *n += 1);
            async { Ok::<_, std::convert::Infallible>(()) }
        });
    let consumer = common::local_consumer(backend, stream, &common::unique("warehouse"));
    Ok(consumer.build()?.run(handler).until(all_shipped).await?)
}

#[tokio::main]
async fn main() -> common::Result {
    common::init_tracing("warn");
    match processor_demo::Args::parse().worker() {
        // One processor process on AWS, until SIGTERM or SIGINT.
        Some(names) => process(AnyBackend::aws().await, names, common::shutdown_signal()?).await,
        // Fresh streams with the orders, `process` and `warehouse` until all are shipped.
        None => processor_demo::run().await,
    }
}
