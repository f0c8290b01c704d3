//! A processor: orders → enrich → shipments. Each order read from the `orders` stream
//! becomes a shipment written to the `shipments` stream, and the order's checkpoint
//! moves only after its shipment is stored.
//!
//! The rule it shows (at least once end to end, exactly once in effect):
//! - `produce_to(shipments)`: the order counts as handled only once Kinesis stored its
//!   shipment. A crash before that reads the order again and writes the shipment again.
//! - Each shipment carries where its order came from (`source`: stream/shard/sequence),
//!   so the warehouse (the consumer of `shipments`) puts a `DedupLayer` keyed on it in
//!   front of its handler: a shipment written twice is handled once.
//! - The producer is `ordered_per_key(true)` and the shipments keep the order's partition
//!   key (the customer), so each customer's shipments are in the order of their orders.
//!
//! Two ways to run it:
//!
//! ```text
//! cargo run --example processor                 # the self-checking demo
//! cargo run --example processor -- --orders O --shipments S --group G
//! ```
//!
//! - **Demo** (no `--orders`): creates both streams, writes `--count` orders, runs the
//!   processor and the warehouse, checks that every order was shipped once and in order
//!   per customer, prints a summary and exits (non-zero when the check fails). Runs on
//!   the embedded backend; set `AWS_ENDPOINT_URL_KINESIS` (or `SHARDFLOW_BACKEND=aws`)
//!   to run it against an emulator or AWS.
//! - **Worker** (`--orders`, `--shipments`, `--group`): one processor process on
//!   existing streams, always on AWS (endpoints and credentials from the standard AWS
//!   environment), until SIGTERM or SIGINT (drain, checkpoint, release, exit 0); run
//!   several with the same `--group` to share the shards. `tests/processor_processes.rs`
//!   kills and restarts it. Nothing is printed on stdout; logs go to stderr.

use std::collections::{BTreeMap, HashMap};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use clap::Parser;
use serde::{Deserialize, Serialize};
use shardflow::kinesis::PutRecord;
use shardflow::producer::Producer;
use shardflow::{Aws, Backend, CheckpointPolicy, Concurrency, Consumer, Memory, Message};
use shardflow_middleware::produce::Output;
use shardflow_middleware::{DedupLayer, MemoryDedupStore, ServiceBuilderExt};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::Notify;
use tower::ServiceBuilder;

/// orders → enrich → shipments, the checkpoint after the shipment is stored.
#[derive(Parser, Debug)]
struct Args {
    /// Run as a processor worker reading this (existing) orders stream.
    #[arg(long, requires_all = ["shipments", "group"])]
    orders: Option<String>,
    /// The (existing) stream the shipments go to (worker mode).
    #[arg(long)]
    shipments: Option<String>,
    /// The processors' consumer group (worker mode).
    #[arg(long)]
    group: Option<String>,
    /// This worker's id (worker mode).
    #[arg(long, default_value = "processor")]
    worker: String,
    /// How many records of different partition keys (customers) each shard handles at
    /// once; one customer's orders are handled one after the other.
    #[arg(long, default_value_t = 32)]
    per_key: usize,
    /// How many orders the demo writes.
    #[arg(long, default_value_t = 1_000)]
    count: u64,
}

/// An order as it arrives: `n` counts the customer's orders (0, 1, 2, ...).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Order {
    id: u64,
    customer: String,
    n: u64,
    items: u32,
}

/// An order enriched for the warehouse, with where it came from.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Shipment {
    order_id: u64,
    customer: String,
    n: u64,
    warehouse: String,
    parcels: u32,
    /// The order's `stream/shard/sequence/sub-sequence`: the warehouse's dedup key.
    source: String,
}

/// The processor function: one order in, one shipment out.
async fn enrich(order: Message<Order>) -> Result<Output, serde_json::Error> {
    let h = &order.headers;
    let warehouses = ["berlin", "lyon", "porto"];
    let shipment = Shipment {
        order_id: order.payload.id,
        customer: order.payload.customer.clone(),
        n: order.payload.n,
        warehouse: warehouses[(order.payload.id % 3) as usize].to_owned(),
        parcels: order.payload.items.div_ceil(4),
        source: format!(
            "{}/{}/{}/{}",
            h.stream, h.shard_id, h.sequence_number, h.sub_sequence_number
        ),
    };
    // The shipment keeps the order's partition key (the customer): no
    // `.partition_key(...)` needed.
    Ok(Output::new(serde_json::to_vec(&shipment)?))
}

/// The processors' consumer: timings for a local run (fast fail-over).
fn processor_consumer(
    backend: impl Backend,
    orders: &str,
    group: &str,
    worker: &str,
    per_key: usize,
) -> Result<Consumer, shardflow::ConfigError> {
    Consumer::builder()
        .stream(orders)
        .group(group)
        .worker_id(worker)
        .backend(backend)
        .lease_duration(Duration::from_secs(3))
        .take_interval(Duration::from_millis(500))
        .idle_read_interval(Duration::from_millis(50))
        .shard_sync_interval(Duration::from_secs(1))
        .checkpoint(CheckpointPolicy::Interval(Duration::from_millis(200)))
        .concurrency(Concurrency::PerKey(per_key))
        .build()
}

/// The producer of shipments.
fn shipments_producer(
    backend: impl Backend,
    stream: &str,
) -> Result<Producer, shardflow::ConfigError> {
    Producer::builder()
        .stream(stream)
        .backend(backend)
        .ordered_per_key(true) // each customer's shipments in the order of their orders
        .linger(Duration::from_millis(10))
        .build()
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let result = match (&args.orders, &args.shipments, &args.group) {
        (Some(orders), Some(shipments), Some(group)) => {
            worker(Aws::from_env().await, orders, shipments, group, &args).await
        }
        _ if std::env::var_os("AWS_ENDPOINT_URL_KINESIS").is_some()
            || std::env::var("SHARDFLOW_BACKEND").as_deref() == Ok("aws") =>
        {
            demo(Aws::from_env().await, &args).await
        }
        _ => demo(Memory::new(), &args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("processor: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One processor process, until SIGTERM or SIGINT.
async fn worker(
    aws: Aws,
    orders: &str,
    shipments: &str,
    group: &str,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    let id = args.worker.as_str();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    };
    let producer = shipments_producer(aws.clone(), shipments)?;
    let processor = ServiceBuilder::new()
        .produce_to(producer.clone())
        .decode::<Order>()
        .service_fn(enrich);
    let consumer = processor_consumer(aws, orders, group, id, args.per_key)?;
    tracing::info!(orders, shipments, group, worker = id, "processor starting");
    // Drains in-flight orders (each waits for its shipment), checkpoints, releases;
    // then the producer has nothing left to write.
    consumer.run(processor).until(shutdown).await?;
    producer.close().await;
    Ok(())
}

/// Writes the orders, runs the processor and the warehouse, checks the rule.
async fn demo(
    backend: impl Backend + Clone,
    args: &Args,
) -> Result<(), Box<dyn std::error::Error>> {
    let count = args.count;
    let suffix = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis() % 1_000_000_000;
    let (orders, shipments) = (format!("orders-{suffix}"), format!("shipments-{suffix}"));
    let admin = backend
        .admin()
        .ok_or("this backend cannot create streams")?;
    admin.create_stream(&orders, 2).await?;
    admin.create_stream(&shipments, 2).await?;
    write_orders(backend.kinesis().as_ref(), &orders, count).await?;

    // The processor.
    let producer = shipments_producer(backend.clone(), &shipments)?;
    let processor = ServiceBuilder::new()
        .produce_to(producer.clone())
        .decode::<Order>()
        .service_fn(enrich);
    let processing = processor_consumer(
        backend.clone(),
        &orders,
        &format!("shipping-{suffix}"),
        "p1",
        args.per_key,
    )?
    .run(processor)
    .spawn();

    // The warehouse: handles each shipment once, keyed on the order it came from.
    let warehouse = Warehouse::default();
    let handler = ServiceBuilder::new()
        .decode::<Shipment>()
        .layer(
            DedupLayer::new(MemoryDedupStore::new(100_000))
                .key(|m: &Message<Shipment>| m.payload.source.clone()),
        )
        .service_fn({
            let warehouse = warehouse.clone();
            move |m: Message<Shipment>| {
                warehouse.ship(m.payload);
                async { Ok::<_, std::convert::Infallible>(()) }
            }
        });
    let shipping = processor_consumer(
        backend.clone(),
        &shipments,
        &format!("warehouse-{suffix}"),
        "w1",
        args.per_key,
    )?
    .run(handler)
    .spawn();

    let waited =
        tokio::time::timeout(Duration::from_secs(60), warehouse.until(count as usize)).await;
    processing.shutdown().await?;
    shipping.shutdown().await?;
    producer.close().await;
    if waited.is_err() {
        return Err(format!(
            "only {} of {count} orders shipped within 60 s",
            warehouse.orders()
        )
        .into());
    }
    let (twice, out_of_order) = warehouse.check();
    println!(
        "{count} orders, {} shipped, {twice} shipped more than once, {out_of_order} customers out of order",
        warehouse.orders()
    );
    if twice > 0 || out_of_order > 0 {
        return Err("the rule was broken".into());
    }
    Ok(())
}

/// The warehouse's side effect: shipments handled per order, and per customer in order.
#[derive(Clone, Default)]
struct Warehouse {
    shipped: Arc<Mutex<HashMap<u64, u32>>>,
    per_customer: Arc<Mutex<BTreeMap<String, Vec<u64>>>>,
    changed: Arc<Notify>,
}

impl Warehouse {
    fn ship(&self, shipment: Shipment) {
        *self.lock_shipped().entry(shipment.order_id).or_default() += 1;
        self.per_customer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(shipment.customer)
            .or_default()
            .push(shipment.n);
        self.changed.notify_waiters();
    }

    fn lock_shipped(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u32>> {
        self.shipped.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Orders shipped at least once.
    fn orders(&self) -> usize {
        self.lock_shipped().len()
    }

    async fn until(&self, n: usize) {
        loop {
            let changed = self.changed.notified();
            if self.orders() >= n {
                return;
            }
            changed.await;
        }
    }

    /// Orders shipped more than once, and customers whose shipments came out of order.
    fn check(&self) -> (usize, usize) {
        let twice = self.lock_shipped().values().filter(|n| **n > 1).count();
        let per_customer = self.per_customer.lock().unwrap_or_else(|p| p.into_inner());
        let out_of_order = per_customer
            .values()
            .filter(|ns| ns.windows(2).any(|w| w[0] >= w[1]))
            .count();
        (twice, out_of_order)
    }
}

/// `count` orders of 37 customers; `n` counts each customer's orders.
async fn write_orders(
    kinesis: &dyn shardflow::kinesis::KinesisApi,
    stream: &str,
    count: u64,
) -> Result<(), Box<dyn std::error::Error>> {
    let records: Vec<PutRecord> = (0..count)
        .map(|id| {
            let customer = format!("customer-{}", id % 37);
            let order = Order {
                id,
                customer: customer.clone(),
                n: id / 37,
                items: 1 + (id % 9) as u32,
            };
            Ok(PutRecord {
                data: Bytes::from(serde_json::to_vec(&order)?),
                partition_key: customer,
                explicit_hash_key: None,
            })
        })
        .collect::<Result<_, serde_json::Error>>()?;
    for chunk in records.chunks(500) {
        kinesis.put_records(stream, chunk).await?;
    }
    Ok(())
}
