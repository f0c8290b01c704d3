//! A payment pipeline: the full layer stack under `Consumer::run`.
//!
//! The rule it shows: every good order is charged exactly once, and every bad order
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
//! It prints a `charged order ID` line per charge and a summary; `tests/examples.rs`
//! runs it and checks the rule from that output.
//!
//! Runs on the embedded backend; set `AWS_ENDPOINT_URL_KINESIS` (or
//! `SHARDFLOW_BACKEND=aws`) to run it against an emulator or AWS.
//!
//! ```text
//! cargo run --example pipeline
//! ```

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use shardflow::kinesis::PutRecord;
use shardflow::producer::Producer;
use shardflow::{Aws, Backend, Consumer, Memory, Message};
use shardflow_middleware::dead_letter::DeadLetterOutcome;
use shardflow_middleware::{Backoff, ErrorClass, MemoryDedupStore, ServiceBuilderExt};
use tokio::sync::Notify;
use tower::ServiceBuilder;

const ORDERS: usize = 1_000;

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
    let admin = backend
        .admin()
        .ok_or("this backend cannot create streams")?;
    admin.create_stream(&orders, 2).await?;
    admin.create_stream(&dlq, 1).await?;
    write_orders(&backend, &orders).await?;

    // A producer is a dead-letter sink as it is: it writes envelopes to the DLQ stream.
    let producer = Producer::builder()
        .stream(&dlq)
        .backend(backend.clone())
        .build()?;
    let finished = Finished::default();
    let calls = Arc::new(AtomicU64::new(0));
    let handler = ServiceBuilder::new()
        // Counts the records that finished (charged or dead-lettered), to stop at the end.
        .map_response({
            let finished = finished.clone();
            move |outcome: DeadLetterOutcome<_>| finished.record(outcome.is_dead_lettered())
        })
        .dead_letter(producer.clone())
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
        .service_fn(move |msg: Message<Order>| {
            // Every 7th call times out once; negative amounts are declined.
            let call = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if msg.payload.amount_cents < 0 {
                    return Err(PaymentError::Declined);
                }
                if call % 7 == 3 {
                    return Err(PaymentError::Timeout);
                }
                println!("charged order {}", msg.payload.id);
                Ok(())
            }
        });

    let consumer = Consumer::builder()
        .stream(&orders)
        .group(format!("billing-{suffix}"))
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(50))
        .build()?;
    // Runs until every order finished, then drains, checkpoints and releases.
    consumer
        .run(handler)
        .until(finished.clone().all(ORDERS))
        .await?;
    producer.close().await;
    println!(
        "{ORDERS} orders finished: {} charged, {} dead-lettered to {dlq}",
        ORDERS - finished.dead_lettered.load(Ordering::SeqCst),
        finished.dead_lettered.load(Ordering::SeqCst)
    );
    Ok(())
}

/// The records that finished, for the example to know when to stop.
#[derive(Clone, Default)]
struct Finished {
    records: Arc<AtomicUsize>,
    dead_lettered: Arc<AtomicUsize>,
    progress: Arc<Notify>,
}

impl Finished {
    fn record(&self, dead_lettered: bool) {
        if dead_lettered {
            self.dead_lettered.fetch_add(1, Ordering::SeqCst);
        }
        self.records.fetch_add(1, Ordering::SeqCst);
        self.progress.notify_one();
    }

    async fn all(self, n: usize) {
        while self.records.load(Ordering::SeqCst) < n {
            self.progress.notified().await;
        }
    }
}

/// Orders 0..1000: every 50th is bad JSON, every 40th has a negative amount.
async fn write_orders(
    backend: &impl Backend,
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
        backend.kinesis().put_records(stream, chunk).await?;
    }
    Ok(())
}
