//! Many streams, one consumer group: one consumer reads three streams through one lease
//! table, then a fourth stream is added and one removed while it runs.
//!
//! Lease keys take the KCL's multi-stream form, `account:stream:creationEpoch:shardId`,
//! and every message names its stream in `msg.headers.stream`. A removed stream's
//! leases are released after its shards drained and checkpointed; its rows stay, so
//! adding it back continues where it left off. It verifies its own totals (it exits
//! non-zero otherwise). On the embedded backend by default; with
//! `AWS_ENDPOINT_URL_KINESIS` (or `SHARDFLOW_BACKEND=aws`) set, against an emulator or AWS.
//!
//! ```text
//! cargo run --example multi_stream
//! ```

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use shardflow::kinesis::{PutOutcome, PutRecord, StreamIdentity};
use shardflow::{Aws, Backend, Consumer, Memory, Message};
use tokio::sync::{watch, Notify};

const RECORDS_PER_STREAM: usize = 500;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let use_aws = std::env::var_os("AWS_ENDPOINT_URL_KINESIS").is_some()
        || std::env::var("SHARDFLOW_BACKEND").as_deref() == Ok("aws");
    if use_aws {
        run(Aws::from_env().await).await
    } else {
        run(Memory::new()).await
    }
}

/// Records handled per stream, and a wake-up for whoever waits on them.
#[derive(Clone, Default)]
struct Counts {
    per_stream: Arc<Mutex<BTreeMap<String, usize>>>,
    changed: Arc<Notify>,
}

impl Counts {
    fn get(&self, stream: &str) -> usize {
        let counts = self.per_stream.lock().unwrap_or_else(|p| p.into_inner());
        counts.get(stream).copied().unwrap_or(0)
    }

    async fn wait_for(&self, stream: &str, n: usize) {
        loop {
            let changed = self.changed.notified();
            if self.get(stream) >= n {
                return;
            }
            changed.await;
        }
    }
}

async fn run(backend: impl Backend + Clone) -> Result<(), Box<dyn std::error::Error>> {
    let suffix = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let [orders, refunds, audit, returns] =
        ["orders", "refunds", "audit", "returns"].map(|s| format!("{s}-{suffix}"));
    let admin = backend
        .admin()
        .ok_or("this backend cannot create streams")?;
    for (stream, shards) in [(&orders, 2), (&refunds, 1), (&audit, 1), (&returns, 2)] {
        admin.create_stream(stream, shards).await?;
        produce(&backend, stream).await?;
    }

    // The stream list: a watch channel, so it can change while the consumer runs (a
    // fixed list is `.streams([...])`).
    let (streams, list) = watch::channel(vec![orders.clone(), refunds.clone(), audit.clone()]);
    let group = format!("pipeline-{suffix}");
    let consumer = Consumer::builder()
        .streams_from(list)
        .group(&group)
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(50))
        .build()?;
    let counts = Counts::default();
    let handler = tower::service_fn({
        let counts = counts.clone();
        move |msg: Message| {
            // Every message names its stream (and shard, sequence number, ...).
            *counts
                .per_stream
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry(msg.headers.stream.to_string())
                .or_default() += 1;
            counts.changed.notify_waiters();
            async { Ok::<_, Infallible>(()) }
        }
    });
    let running = consumer.run(handler).spawn();

    for stream in [&orders, &refunds, &audit] {
        counts.wait_for(stream, RECORDS_PER_STREAM).await;
    }
    println!("read {orders}, {refunds} and {audit}; now adding {returns} and removing {audit}");
    streams.send_replace(vec![orders.clone(), refunds.clone(), returns.clone()]);
    counts.wait_for(&returns, RECORDS_PER_STREAM).await;

    // Stop reading, let in-flight handlers finish, commit, release: then the result.
    running.shutdown().await?;

    println!("handled per stream:");
    for (stream, n) in counts
        .per_stream
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
    {
        println!("  {stream}: {n}");
    }
    println!("checkpoints (lease key: checkpoint):");
    for lease in backend.lease_store(&group).list().await? {
        let stream = StreamIdentity::split_lease_key(&lease.key)
            .map(|(identity, _)| identity.name)
            .unwrap_or_default();
        println!("  {} ({stream}): {}", lease.key, lease.checkpoint);
    }
    let total: usize = [&orders, &refunds, &audit, &returns]
        .iter()
        .map(|s| counts.get(s))
        .sum();
    let expected = 4 * RECORDS_PER_STREAM;
    println!("{total} of {expected} records handled");
    if total != expected {
        return Err(format!("expected {expected} records, handled {total}").into());
    }
    Ok(())
}

async fn produce(backend: &impl Backend, stream: &str) -> Result<(), Box<dyn std::error::Error>> {
    let records: Vec<PutRecord> = (0..RECORDS_PER_STREAM)
        .map(|i| PutRecord {
            data: Bytes::from(format!("{{\"event\":{i}}}")),
            partition_key: format!("key-{}", i % 50),
            explicit_hash_key: None,
        })
        .collect();
    let outcomes = backend.kinesis().put_records(stream, &records).await?;
    if outcomes
        .iter()
        .any(|o| matches!(o, PutOutcome::Failed { .. }))
    {
        return Err("some records were refused; the producer retries them".into());
    }
    Ok(())
}
