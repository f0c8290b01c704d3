//! The quickstart: runs with no setup on the embedded backend.
//!
//! It writes a few thousand records over four shards, consumes them through a small
//! tower stack, splits a shard midway, and prints what each shard handled and where its
//! checkpoint ended. With `AWS_ENDPOINT_URL_KINESIS` (or `SHARDFLOW_BACKEND=aws`) set it
//! runs the same against an emulator or AWS.
//!
//! ```text
//! cargo run --example quickstart
//! ```

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use shardflow::kinesis::{PutOutcome, PutRecord};
use shardflow::{Aws, Backend, Consumer, Memory, Message};
use tokio::sync::Notify;
use tower::ServiceBuilder;

const RECORDS: usize = 4_000;

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

async fn run(backend: impl Backend + Clone) -> Result<(), Box<dyn std::error::Error>> {
    let suffix = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    let stream = format!("quickstart-{suffix}");
    let group = format!("quickstart-{suffix}");
    let kinesis = backend
        .admin()
        .ok_or("this backend cannot create streams")?;
    kinesis.create_stream(&stream, 4).await?;
    produce(&backend, &stream, 0..RECORDS / 2).await?;

    let per_shard: Arc<Mutex<BTreeMap<String, usize>>> = Arc::default();
    let handled = Arc::new(AtomicUsize::new(0));
    let progress = Arc::new(Notify::new());
    let consumer = Consumer::builder()
        .stream(&stream)
        .group(&group)
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(50))
        .build()?;

    // A small layer stack: a timeout around a handler that counts per shard.
    let handler = ServiceBuilder::new()
        .timeout(Duration::from_secs(5))
        .service_fn({
            let (per_shard, handled, progress) =
                (per_shard.clone(), handled.clone(), progress.clone());
            move |msg: Message| {
                *per_shard
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(msg.headers.shard_id.to_string())
                    .or_default() += 1;
                handled.fetch_add(1, Ordering::SeqCst);
                progress.notify_one();
                async { Ok::<_, Infallible>(()) }
            }
        });
    // Runs in the background until `shutdown()`; dropping `running` would stop it too.
    let running = consumer.run(handler).spawn();

    wait_for(&handled, &progress, RECORDS / 4).await;
    let shards = kinesis.list_shards(&stream).await?;
    let first = &shards[0];
    let middle = first.starting_hash_key + (first.ending_hash_key - first.starting_hash_key) / 2;
    println!(
        "splitting {} after {} records",
        first.shard_id,
        handled.load(Ordering::SeqCst)
    );
    kinesis
        .split_shard(&stream, &first.shard_id, middle)
        .await?;
    while kinesis.is_updating(&stream).await? {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    produce(&backend, &stream, RECORDS / 2..RECORDS).await?;
    wait_for(&handled, &progress, RECORDS).await;

    // Stop reading, let in-flight handlers finish, commit, release: then the result.
    running.shutdown().await?;

    println!("handled per shard:");
    for (shard, n) in per_shard.lock().unwrap_or_else(|p| p.into_inner()).iter() {
        println!("  {shard}: {n}");
    }
    println!("checkpoints:");
    for lease in backend.lease_store(&group).list().await? {
        println!("  {}: {}", lease.key, lease.checkpoint);
    }
    let total = handled.load(Ordering::SeqCst);
    println!("{total} of {RECORDS} records handled");
    if total != RECORDS {
        return Err(format!("expected {RECORDS} records, handled {total}").into());
    }
    Ok(())
}

async fn wait_for(handled: &AtomicUsize, progress: &Notify, n: usize) {
    while handled.load(Ordering::SeqCst) < n {
        progress.notified().await;
    }
}

async fn produce(
    backend: &impl Backend,
    stream: &str,
    values: std::ops::Range<usize>,
) -> Result<(), Box<dyn std::error::Error>> {
    let kinesis = backend.kinesis();
    let values: Vec<usize> = values.collect();
    for chunk in values.chunks(500) {
        let records: Vec<PutRecord> = chunk
            .iter()
            .map(|i| PutRecord {
                data: Bytes::from(format!("{{\"order\":{i}}}")),
                partition_key: format!("customer-{}", i % 100),
                explicit_hash_key: None,
            })
            .collect();
        let outcomes = kinesis.put_records(stream, &records).await?;
        if outcomes
            .iter()
            .any(|o| matches!(o, PutOutcome::Failed { .. }))
        {
            return Err("some records were refused; the producer (issue 5) retries them".into());
        }
    }
    Ok(())
}
