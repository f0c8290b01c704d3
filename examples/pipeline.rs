//! A payment pipeline: the full layer stack under `Consumer::run`.
//!
//! The rule it keeps: every good order is charged exactly once, and every bad order
//! (undecodable, or declined) is written to the dead-letter stream instead of being
//! charged, even though payment calls fail and are retried on the way.
//!
//! Orders arrive as JSON on the `orders` stream. The stack, outermost first:
//! - `dead_letter`: what still fails below is written to the `orders-dlq` stream by the
//!   producer, as a dead-letter envelope (the payload with its origin and error, see
//!   `shardflow_middleware::dead_letter`); the record counts as handled only once the
//!   dead-letter stream stored it. `shardflow stream tail` shows them and
//!   `shardflow dlq replay` writes them back.
//! - `decode::<Order>()`: bad JSON becomes a typed error (and so a dead letter).
//! - `dedup`: a redelivered order (after a crash or a retry) is not charged twice.
//! - `retry`: a flaky payment provider is retried with backoff; a declined card is
//!   permanent and goes straight to the dead-letter stream.
//!
//! It prints one `charged order ID` line per charge, so a double charge shows as a
//! repeated line, then a summary; `tests/examples.rs` runs it and checks the rule from
//! that output.
//!
//! Runs on the embedded backend; set `AWS_ENDPOINT_URL_KINESIS` (or
//! `SHARDFLOW_BACKEND=aws`) to run it against an emulator or AWS.
//!
//! ```text
//! cargo run --example pipeline
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use shardflow::kinesis::{KinesisApi, PutRecord, StartingPosition};
use shardflow::producer::Producer;
use shardflow::{Aws, Backend, Consumer, Memory, Message};
use shardflow_middleware::{Backoff, ErrorClass, MemoryDedupStore, ServiceBuilderExt};
use tokio::sync::Notify;
use tower::ServiceBuilder;

const ORDERS: u64 = 1_000;

#[derive(Clone, Debug, serde::Deserialize)]
struct Order {
    id: u64,
    amount_cents: i64,
}

#[derive(Debug, thiserror::Error)]
enum PaymentError {
    #[error("payment provider timed out")]
    Timeout,
    #[error("card declined")]
    Declined,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    if std::env::var_os("AWS_ENDPOINT_URL_KINESIS").is_some()
        || std::env::var("SHARDFLOW_BACKEND").as_deref() == Ok("aws")
    {
        run(Aws::from_env().await).await
    } else {
        run(Memory::new()).await
    }
}

async fn run(backend: impl Backend + Clone) -> Result<(), Box<dyn std::error::Error>> {
    let suffix = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let (orders, dlq) = (format!("orders-{suffix}"), format!("orders-dlq-{suffix}"));
    let kinesis = backend
        .admin()
        .ok_or("this backend cannot create streams")?;
    kinesis.create_stream(&orders, 2).await?;
    kinesis.create_stream(&dlq, 1).await?;
    write_orders(kinesis.as_ref(), &orders).await?;

    // The dead-letter sink: the producer, writing the raw record to the DLQ stream.
    let producer = Producer::builder()
        .stream(&dlq)
        .backend(backend.clone())
        .build()?;
    // A producer is a dead-letter sink as it is: it writes envelopes.
    let sink = producer.clone();

    let ledger = Ledger::default();
    let attempts = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let handler = ServiceBuilder::new()
        .dead_letter(sink)
        .decode::<Order>()
        .dedup(MemoryDedupStore::new(100_000))
        .retry(
            Backoff::exponential()
                .max_attempts(4)
                .initial_delay(Duration::from_millis(5))
                .classify(|e: &PaymentError| match e {
                    PaymentError::Timeout => ErrorClass::Transient,
                    PaymentError::Declined => ErrorClass::Permanent,
                }),
        )
        .service_fn({
            let (ledger, attempts) = (ledger.clone(), attempts.clone());
            move |msg: Message<Order>| {
                let ledger = ledger.clone();
                // Every 7th call times out once; negative amounts are declined.
                let call = attempts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async move {
                    if msg.payload.amount_cents < 0 {
                        return Err(PaymentError::Declined);
                    }
                    if call % 7 == 3 {
                        return Err(PaymentError::Timeout);
                    }
                    ledger.charge(&msg.payload);
                    Ok(())
                }
            }
        });

    let consumer = Consumer::builder()
        .stream(&orders)
        .group(format!("billing-{suffix}"))
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(50))
        .build()?;
    let running = consumer.run(handler).spawn();

    // Good orders are charged; the bad ones (every 50th has bad JSON, every 40th is
    // declined) end up in the dead-letter stream.
    let bad: HashSet<u64> = (0..ORDERS).filter(|i| i % 50 == 0 || i % 40 == 0).collect();
    let good = ORDERS as usize - bad.len();
    println!(
        "{ORDERS} orders: {good} good, {} bad (every 50th bad JSON, every 40th declined)",
        bad.len()
    );
    loop {
        let notified = ledger.charged.notified();
        if ledger.orders_charged() >= good && count(kinesis.as_ref(), &dlq).await? >= bad.len() {
            break;
        }
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    running.shutdown().await?;
    producer.close().await;

    let dead = count(kinesis.as_ref(), &dlq).await?;
    println!(
        "{} orders charged ({} more than once), {dead} in the dead-letter stream",
        ledger.orders_charged(),
        ledger.charged_more_than_once()
    );
    Ok(())
}

/// The payment side effect: charges per order, so a second charge of an order is seen.
#[derive(Clone, Default)]
struct Ledger {
    charges: Arc<Mutex<HashMap<u64, u32>>>,
    charged: Arc<Notify>,
}

impl Ledger {
    fn charge(&self, order: &Order) {
        let mut charges = self.charges.lock().unwrap_or_else(|p| p.into_inner());
        *charges.entry(order.id).or_default() += 1;
        println!("charged order {}", order.id);
        self.charged.notify_one();
    }

    /// Orders charged at least once.
    fn orders_charged(&self) -> usize {
        self.charges.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Orders charged twice or more (the rule says none).
    fn charged_more_than_once(&self) -> usize {
        let charges = self.charges.lock().unwrap_or_else(|p| p.into_inner());
        charges.values().filter(|n| **n > 1).count()
    }
}

async fn write_orders(
    kinesis: &dyn KinesisApi,
    stream: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let records: Vec<PutRecord> = (0..ORDERS)
        .map(|i| {
            let data = if i % 50 == 0 {
                format!("{{\"id\":{i},")
            } else if i % 40 == 0 {
                format!("{{\"id\":{i},\"amount_cents\":-100}}")
            } else {
                format!("{{\"id\":{i},\"amount_cents\":{}}}", 100 + i)
            };
            PutRecord {
                data: Bytes::from(data),
                partition_key: format!("customer-{}", i % 31),
                explicit_hash_key: None,
            }
        })
        .collect();
    for chunk in records.chunks(500) {
        kinesis.put_records(stream, chunk).await?;
    }
    Ok(())
}

/// The number of records in a one-shard stream.
async fn count(
    kinesis: &dyn KinesisApi,
    stream: &str,
) -> Result<usize, Box<dyn std::error::Error>> {
    let shards = kinesis.list_shards(stream).await?;
    let mut total = 0;
    for shard in shards {
        let mut iterator = Some(
            kinesis
                .shard_iterator(stream, &shard.shard_id, &StartingPosition::TrimHorizon)
                .await?,
        );
        while let Some(it) = iterator {
            let page = kinesis.get_records(&it, 10_000).await?;
            if page.records.is_empty() {
                break;
            }
            total += page.records.len();
            iterator = page.next_iterator;
        }
    }
    Ok(total)
}
