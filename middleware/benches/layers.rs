//! Per-record cost of each layer against a bare `service_fn`.
//!
//! `cargo bench -p shardflow-middleware --bench layers` (add `-- <records>` to change the
//! count, 200,000 by default). Each figure is the best of five runs over the same
//! records, driven one at a time on a current-thread runtime (as the consumer drives a
//! shard): ready, call, await.
//!
//! Without `--bench` among its arguments (`cargo bench` passes it; `cargo test
//! --all-targets` runs this binary without), it makes a smoke run instead: every row
//! once over 300 records. That proves the bench works without costing the test suite
//! the measurement.

use std::convert::Infallible;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use shardflow::{Batch, Message, Metadata, SequenceNumber};
use shardflow_middleware::dead_letter::{DeadLetterLayer, DeadLetterRecord};
use shardflow_middleware::dedup::DedupLayer;
use shardflow_middleware::{
    BatchConfig, Batching, DecodeLayer, DedupStore, MemoryDedupStore, RetryLayer, RetryPolicy,
    ServiceBuilderExt,
};
use tower::{service_fn, Layer, Service, ServiceBuilder, ServiceExt};

#[derive(Clone, serde::Deserialize)]
#[allow(dead_code)] // decoded, then only looked at through black_box
struct Order {
    id: u64,
    amount: u64,
    currency: String,
}

const RUNS: usize = 5;

fn records(count: u64) -> Vec<Message<Bytes>> {
    let stream: Arc<str> = Arc::from("orders");
    let shard: Arc<str> = Arc::from("shardId-000000000000");
    (0..count)
        .map(|i| {
            let metadata = Metadata::builder()
                .stream(stream.clone())
                .shard_id(shard.clone())
                .sequence_number(
                    SequenceNumber::new(format!(
                        "49590338271490256608559692538361571095921575989136588898{i:010}"
                    ))
                    .expect("digits"),
                )
                .partition_key(format!("customer-{}", i % 1000))
                .build();
            let payload = format!(r#"{{"id":{i},"amount":4200,"currency":"EUR"}}"#);
            Message::new(metadata, Bytes::from(payload))
        })
        .collect()
}

/// Best-of-`runs` time per record of driving `make()`'s service over `messages`.
async fn measure<S, F>(runs: usize, messages: &[Message<Bytes>], make: F) -> f64
where
    F: Fn() -> S,
    S: Service<Message<Bytes>>,
    S::Error: std::fmt::Debug,
{
    let mut best = Duration::MAX;
    for _ in 0..runs {
        let batch = messages.to_vec();
        let mut svc = make();
        let start = Instant::now();
        for message in batch {
            let ready = svc.ready().await.expect("ready");
            black_box(ready.call(message).await.expect("handled"));
        }
        best = best.min(start.elapsed());
    }
    best.as_nanos() as f64 / messages.len() as f64
}

fn bare() -> impl Service<Message<Bytes>, Response = (), Error = Infallible, Future: Send> + Clone {
    service_fn(|m: Message<Bytes>| async move {
        black_box(&m);
        Ok::<_, Infallible>(())
    })
}

fn typed() -> impl Service<Message<Order>, Response = (), Error = Infallible, Future: Send> + Clone
{
    service_fn(|m: Message<Order>| async move {
        black_box(&m.payload);
        Ok::<_, Infallible>(())
    })
}

fn sink() -> impl Service<DeadLetterRecord, Response = (), Error = Infallible, Future: Send> + Clone
{
    service_fn(|r: DeadLetterRecord| async move {
        black_box(&r);
        Ok::<_, Infallible>(())
    })
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test` runs this binary without arguments.
    let (count, runs): (u64, usize) = if std::env::args().skip(1).any(|a| a == "--bench") {
        let count = std::env::args()
            .skip(1)
            .find_map(|a| a.parse().ok())
            .unwrap_or(200_000);
        (count, RUNS)
    } else {
        println!("layers: smoke run (not a measurement: run `cargo bench -p shardflow-middleware --bench layers`)");
        (300, 1)
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    let messages = records(count);

    runtime.block_on(async {
        let base = measure(runs, &messages, bare).await;
        let rows = [
            (
                "decode (JSON, 3 fields)",
                measure(runs, &messages, || {
                    DecodeLayer::<Order>::json().layer(typed())
                })
                .await,
            ),
            (
                "dedup (memory store)",
                measure(runs, &messages, || {
                    DedupLayer::new(MemoryDedupStore::new(count as usize * 2)).layer(bare())
                })
                .await,
            ),
            (
                "retry (no failures)",
                measure(runs, &messages, || {
                    RetryLayer::new(RetryPolicy::exponential()).layer(bare())
                })
                .await,
            ),
            (
                "dead_letter (no failures)",
                measure(runs, &messages, || {
                    DeadLetterLayer::new(sink()).layer(bare())
                })
                .await,
            ),
            (
                "full stack (all four)",
                measure(runs, &messages, || {
                    ServiceBuilder::new()
                        .dead_letter(sink())
                        .decode::<Order>()
                        .dedup(MemoryDedupStore::new(count as usize * 2))
                        .retry(RetryPolicy::exponential())
                        .service(typed())
                })
                .await,
            ),
        ];

        // The memory store alone: reserve + commit of a fresh key per record.
        let keys: Vec<String> = (0..count).map(|i| format!("orders/shard/{i}/0")).collect();
        let mut best = Duration::MAX;
        for _ in 0..runs {
            let store = MemoryDedupStore::new(count as usize * 2);
            let ttl = Duration::from_secs(60);
            let start = Instant::now();
            for key in &keys {
                black_box(store.reserve(key, "token", ttl).await.expect("reserve"));
                black_box(store.commit(key, "token", ttl).await.expect("commit"));
            }
            best = best.min(start.elapsed());
        }
        let store_ns = best.as_nanos() as f64 / count as f64;

        // Batch mode: reads of 500 records re-chunked into bulk calls of 100.
        let reads: Vec<Vec<Message<Bytes>>> = messages.chunks(500).map(<[_]>::to_vec).collect();
        let mut best = Duration::MAX;
        for _ in 0..runs {
            let reads = reads.clone();
            let mut svc = Batching::new(
                service_fn(|ms: Vec<Message<Bytes>>| async move {
                    black_box(&ms);
                    Ok::<_, Infallible>(())
                }),
                BatchConfig::new().max_count(100),
            );
            let start = Instant::now();
            for read in reads {
                let batch =
                    Batch::new(Arc::from("orders"), Arc::from("shardId-000000000000"), read);
                ServiceExt::<Batch<Bytes>>::ready(&mut svc)
                    .await
                    .expect("ready");
                Service::<Batch<Bytes>>::call(&mut svc, batch)
                    .await
                    .expect("handled");
            }
            best = best.min(start.elapsed());
        }
        let batch_ns = best.as_nanos() as f64 / messages.len() as f64;

        println!("per-record cost over {count} records (best of {runs} runs)");
        println!("{:<28} {:>10} {:>12}", "layer", "ns/record", "vs bare");
        println!("{:<28} {:>10.0} {:>12}", "bare service_fn", base, "-");
        for (name, ns) in rows {
            println!("{:<28} {:>10.0} {:>+12.0}", name, ns, ns - base);
        }
        println!(
            "{:<28} {:>10.0} {:>12}",
            "memory store reserve+commit", store_ns, "alone"
        );
        println!(
            "{:<28} {:>10.0} {:>12}",
            "batch (read 500 -> 5 x 100)", batch_ns, "per record"
        );
    });
}
