//! The quickstart: runs with no setup on the embedded backend.
//!
//! It writes a few thousand records over four shards, consumes them through a small
//! tower stack, splits a shard midway, and prints what happened: the split, the records
//! each shard handled, where each shard's checkpoint ended, and the time taken
//! (`tests/examples.rs` runs it and checks that output). With `AWS_ENDPOINT_URL_KINESIS` (or `SHARDFLOW_BACKEND=aws`) set it
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
use shardflow::lease::Checkpoint;
use shardflow::{Aws, Backend, Consumer, Memory, Message, SequenceNumber};
use tokio::sync::Notify;
use tokio::time::Instant;
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
    println!(
        "Wrote {} records to stream {stream} (4 shards).",
        RECORDS / 2
    );

    // What each shard handled: its sequence numbers, in the order handled.
    let per_shard: Arc<Mutex<BTreeMap<String, Vec<SequenceNumber>>>> = Arc::default();
    let handled = Arc::new(AtomicUsize::new(0));
    let progress = Arc::new(Notify::new());
    let consumer = Consumer::builder()
        .stream(&stream)
        .group(&group)
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(50))
        .build()?;

    // A small layer stack: a timeout around a handler that notes each record.
    let handler = ServiceBuilder::new()
        .timeout(Duration::from_secs(5))
        .service_fn({
            let (per_shard, handled, progress) =
                (per_shard.clone(), handled.clone(), progress.clone());
            move |msg: Message| {
                per_shard
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(msg.headers.shard_id.to_string())
                    .or_default()
                    .push(msg.headers.sequence_number.clone());
                handled.fetch_add(1, Ordering::SeqCst);
                progress.notify_one();
                async { Ok::<_, Infallible>(()) }
            }
        });
    let started = Instant::now();
    // Runs in the background until `shutdown()`; dropping `running` would stop it too.
    let running = consumer.run(handler).spawn();

    // Midway, split a shard in two: its children are read once it is finished.
    wait_for(&handled, &progress, RECORDS / 4).await;
    let shards = kinesis.list_shards(&stream).await?;
    let parent = &shards[0];
    let middle = parent.starting_hash_key + (parent.ending_hash_key - parent.starting_hash_key) / 2;
    let handled_before = handled.load(Ordering::SeqCst);
    kinesis
        .split_shard(&stream, &parent.shard_id, middle)
        .await?;
    while kinesis.is_updating(&stream).await? {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let children: Vec<String> = kinesis
        .list_shards(&stream)
        .await?
        .into_iter()
        .filter(|s| s.parent_shard_id.as_deref() == Some(parent.shard_id.as_str()))
        .map(|s| s.shard_id)
        .collect();
    println!(
        "Split {} into {} after {handled_before} records were handled.",
        parent.shard_id,
        children.join(" and ")
    );
    produce(&backend, &stream, RECORDS / 2..RECORDS).await?;
    println!("Wrote {} more records.", RECORDS - RECORDS / 2);
    wait_for(&handled, &progress, RECORDS).await;

    // Stop reading, let in-flight handlers finish, commit, release: then the result.
    running.shutdown().await?;

    println!(
        "Handled {} of {RECORDS} records in {:.1} s. Per shard, with the checkpoint stored in the lease table {group}:",
        handled.load(Ordering::SeqCst),
        started.elapsed().as_secs_f64()
    );
    let per_shard = std::mem::take(&mut *per_shard.lock().unwrap_or_else(|p| p.into_inner()));
    for lease in backend.lease_store(&group).list().await? {
        let seen = per_shard
            .get(&lease.key)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let checkpoint = match &lease.checkpoint {
            Checkpoint::ShardEnd => "SHARD_END (closed, every record handled)".to_owned(),
            Checkpoint::At(at) => match seen.iter().position(|s| *s == at.sequence) {
                Some(i) => format!("at record {}", i + 1),
                None => format!("at sequence number {}", at.sequence),
            },
            other => format!("{other} (nothing handled yet)"),
        };
        println!(
            "  {}: {} records handled, checkpoint {checkpoint}",
            lease.key,
            seen.len()
        );
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
