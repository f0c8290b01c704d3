//! A payment pipeline: the full layer stack under `Consumer::run`.
//!
//! The rule it shows: every good order is charged exactly once and every bad one
//! (undecodable, or declined) lands in the dead-letter stream instead, while payment
//! calls fail and are retried on the way. A record counts as handled, and the checkpoint
//! may pass it, only once it was charged or the dead-letter stream stored it. It prints a
//! line per charge and per dead letter (`tests/examples.rs` checks them). Embedded
//! backend; `AWS_ENDPOINT_URL_KINESIS` or `SHARDFLOW_BACKEND=aws` for AWS.
//!
//! ```text
//! cargo run --example pipeline
//! ```

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{unique, AnyBackend};
use shardflow::{Consumer, Message, Producer};
use shardflow_middleware::dead_letter::DeadLetterOutcome;
use shardflow_middleware::{
    ErrorClass, MemoryDedupStore, ProducerSink, RetryPolicy, ServiceBuilderExt,
};
use tokio::sync::watch;
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
async fn main() -> Result<(), common::Error> {
    common::init_tracing("warn");
    let backend = AnyBackend::from_env().await;
    let (orders, dlq) = (unique("orders"), unique("orders-dlq"));
    let orders_data = (0..ORDERS).map(common::payment_order);
    common::create_stream_with(&backend, &orders, 2, orders_data).await?;
    common::create_stream_with(&backend, &dlq, 1, []).await?;

    // Through `ProducerSink`, a producer is a dead-letter sink: it writes envelopes to the DLQ stream.
    let producer = Producer::builder()
        .stream(&dlq)
        .backend(backend.clone())
        .build()?;
    let (finished, mut progress) = watch::channel(0);
    let calls = Arc::new(AtomicU64::new(0));
    let handler = ServiceBuilder::new()
        .map_response(move |outcome: DeadLetterOutcome<_>| {
            if outcome.is_dead_lettered() {
                println!("dead-lettered a bad order");
            }
            finished.send_modify(|n| *n += 1); // to stop once every order finished
        })
        // What still fails below goes to the DLQ stream as an envelope (payload, origin,
        // error): `shardflow stream tail` shows them, `shardflow dlq replay` writes them back.
        .dead_letter(ProducerSink::new(producer.clone()))
        .decode::<Order>() // bad JSON is a typed error, and so a dead letter
        .dedup(MemoryDedupStore::new(100_000)) // a redelivered order is not charged twice
        // A flaky provider is retried with backoff; a declined card goes to the DLQ at once.
        .retry(
            RetryPolicy::exponential()
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
        .group(unique("billing"))
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(50))
        .build()?;
    // Runs until every order finished, then drains, checkpoints and releases.
    let all_finished = async move { progress.wait_for(|n| *n >= ORDERS).await.map(drop) };
    consumer.run(handler).until(all_finished).await?;
    producer.close().await;
    println!("{ORDERS} orders finished; the dead letters are in {dlq}");
    Ok(())
}
