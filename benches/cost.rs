//! What one worker costs in requests, in simulated time: DynamoDB requests per shard per
//! hour and GetRecords calls per shard per second, for an idle stream and a busy one, at
//! the old defaults (checkpoint every 500 ms, idle read interval 250 ms) and the current
//! ones, and the same four shards as four streams of one multi-stream consumer. Memory backend (8 ms per lease-store call, 25 ms per Kinesis call), tokio's
//! paused clock, 4 shards, one worker; every remote call is counted by the consumer's own
//! `shardflow_requests_total` metric (read through a local Prometheus recorder).
//!
//! ```text
//! cargo test --bench cost -- --bench          # 10 simulated minutes per case
//! BENCH_MINUTES=60 cargo test --bench cost -- --bench
//! ```
//!
//! Without `--bench` (under `cargo test`) each case runs for one simulated minute.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use shardflow::kinesis::{KinesisApi, PutRecord, StreamAdmin};
use shardflow::memory::LeaseFaults;
use shardflow::{CheckpointPolicy, Consumer, ConsumerBuilder, Memory, Message};

const SHARDS: u32 = 4;
/// Records per second over the whole stream when busy (100 records every 100 ms).
const BUSY_PER_TICK: usize = 100;
const TICK: Duration = Duration::from_millis(100);

/// Requests counted so far, by "service op".
fn requests(m: &PrometheusHandle) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in m.render().lines() {
        let Some(rest) = line.strip_prefix("shardflow_requests_total{") else {
            continue;
        };
        let label = |name: &str| {
            rest.split(',')
                .find_map(|kv| kv.strip_prefix(&format!("{name}=\"")))
                .map(|v| v.split('"').next().unwrap_or_default().to_owned())
                .unwrap_or_default()
        };
        let value: f64 = line
            .rsplit_once(' ')
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(0.0);
        *out.entry(format!("{} {}", label("service"), label("op")))
            .or_default() += value;
    }
    out
}

/// Runs one case; returns (DynamoDB requests per shard per hour by op, GetRecords per
/// shard per second, records handled). `multi`: the shards are four streams of one shard
/// each, read by one multi-stream consumer (idle only).
fn case(old: bool, busy: bool, multi: bool, minutes: u64) -> (BTreeMap<String, f64>, f64, usize) {
    let recorder = PrometheusBuilder::new().build_recorder();
    let m = recorder.handle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime");
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let memory = Memory::new();
            memory.streams().set_latency(Duration::from_millis(25));
            memory.table("cost").set_faults(LeaseFaults {
                latency: Duration::from_millis(8),
                ..LeaseFaults::default()
            });
            let streams: Vec<String> = (0..SHARDS).map(|i| format!("orders-{i}")).collect();
            let builder = if multi {
                for stream in &streams {
                    memory
                        .streams()
                        .create_stream(stream, 1)
                        .await
                        .expect("stream");
                }
                Consumer::builder().streams(streams)
            } else {
                memory
                    .streams()
                    .create_stream("orders", SHARDS)
                    .await
                    .expect("stream");
                Consumer::builder().stream("orders")
            };
            let mut builder: ConsumerBuilder = builder
                .group("cost")
                .worker_id("w1")
                .seed(1)
                .backend(memory.clone());
            if old {
                builder = builder
                    .checkpoint(CheckpointPolicy::Interval(Duration::from_millis(500)))
                    .idle_read_interval(Duration::from_millis(250));
            }
            let handled = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let running = builder
                .build()
                .expect("config")
                .run(tower::service_fn({
                    let handled = handled.clone();
                    move |_m: Message| {
                        handled.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        async { Ok::<_, std::convert::Infallible>(()) }
                    }
                }))
                .spawn();
            // Past the start-up (table, sync, takes): steady state only.
            tokio::time::sleep(Duration::from_secs(30)).await;
            let before = requests(&m);
            let data = Bytes::from(vec![b'x'; common::RECORD_BYTES]);
            for i in 0..minutes * 60_000 / TICK.as_millis() as u64 {
                if busy {
                    let records: Vec<PutRecord> = (0..BUSY_PER_TICK)
                        .map(|k| PutRecord {
                            data: data.clone(),
                            partition_key: format!("pk-{i}-{k}"),
                            explicit_hash_key: None,
                        })
                        .collect();
                    memory
                        .streams()
                        .put_records("orders", &records)
                        .await
                        .expect("put");
                }
                tokio::time::sleep(TICK).await;
            }
            let after = requests(&m);
            drop(running);
            let hours = minutes as f64 / 60.0;
            let per_shard_hour = |v: f64| v / SHARDS as f64 / hours;
            let mut dynamo = BTreeMap::new();
            let mut get_records = 0.0;
            for (op, n) in &after {
                let delta = n - before.get(op).copied().unwrap_or(0.0);
                if op == "kinesis GetRecords" {
                    get_records = delta / SHARDS as f64 / (minutes * 60) as f64;
                } else if let Some(op) = op.strip_prefix("dynamodb ") {
                    dynamo.insert(op.to_owned(), per_shard_hour(delta));
                }
            }
            (
                dynamo,
                get_records,
                handled.load(std::sync::atomic::Ordering::Relaxed),
            )
        })
    })
}

fn main() {
    let minutes = if common::measuring() {
        common::env_or("BENCH_MINUTES", 10)
    } else {
        1
    };
    println!("cost: {SHARDS} shards, one worker, {minutes} simulated minutes per case after a 30 s start-up");
    println!("| defaults | stream | DynamoDB requests/shard/hour (by call) | GetRecords/shard/s | records handled |");
    println!("|---|---|---|---|---|");
    for old in [true, false] {
        for busy in [false, true] {
            let (dynamo, reads, handled) = case(old, busy, false, minutes);
            println!(
                "| {} | {} | {} | **{reads:.2}** | {handled} |",
                if old {
                    "old (500 ms / 250 ms)"
                } else {
                    "new (5 s / 1 s)"
                },
                if busy { "busy, 25 rec/s/shard" } else { "idle" },
                by_call(&dynamo)
            );
            if busy {
                let expected = minutes as usize * 60 * 10 * BUSY_PER_TICK;
                assert!(
                    handled + 10 * BUSY_PER_TICK >= expected,
                    "records lost or stuck: {handled} of {expected}"
                );
            }
        }
    }
    // Multi-stream mode: each stream's coordinator runs its own lease rounds, but they
    // list the table through the worker's shared listing: one Scan per round in all.
    let (dynamo, reads, _) = case(false, false, true, minutes);
    println!(
        "| new, {SHARDS} streams of 1 shard (multi-stream) | idle | {} | **{reads:.2}** | 0 |",
        by_call(&dynamo)
    );
}

/// The table cell of DynamoDB requests per shard and hour: the total, then by call.
fn by_call(dynamo: &BTreeMap<String, f64>) -> String {
    let total: f64 = dynamo.values().sum();
    let by: Vec<String> = dynamo
        .iter()
        .filter(|(_, n)| **n > 0.0)
        .map(|(op, n)| format!("{op} {n:.0}"))
        .collect();
    format!("**{total:.0}** ({})", by.join(", "))
}
