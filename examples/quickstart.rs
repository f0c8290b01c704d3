//! The quickstart: a stream consumed through a tower stack while one of its shards splits.
//!
//! The rule it shows: a shard's checkpoint moves only past records its handler finished,
//! and a split shard's children are read only once the parent is checkpointed at
//! SHARD_END. It writes 4,000 records over four shards, splits one midway, and prints the
//! split, the records each shard handled, where its checkpoint ended and the time taken.
//! Embedded backend; `AWS_ENDPOINT_URL_KINESIS` or `SHARDFLOW_BACKEND=aws` for AWS.
//!
//! ```text
//! cargo run --example quickstart
//! ```

mod common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use common::{put_orders, unique, AnyBackend};
use shardflow::lease::Checkpoint;
use shardflow::{Backend, Consumer, Message, SequenceNumber};
use tokio::sync::watch;
use tokio::time::Instant;
use tower::ServiceBuilder;

const RECORDS: usize = 4_000;

/// The sequence numbers handled per shard, in handling order.
type PerShard = BTreeMap<String, Vec<SequenceNumber>>;

fn total(handled: &PerShard) -> usize {
    handled.values().map(Vec::len).sum()
}

#[tokio::main]
async fn main() -> Result<(), common::Error> {
    common::init_tracing("warn");
    let backend = AnyBackend::from_env().await;
    let (stream, group) = (unique("quickstart"), unique("quickstart"));
    let kinesis = common::admin(&backend)?;
    kinesis.create_stream(&stream, 4).await?;
    put_orders(&backend, &stream, 0..RECORDS / 2).await?;
    println!("Wrote {} records to {stream} (4 shards).", RECORDS / 2);

    let consumer = Consumer::builder()
        .stream(&stream)
        .group(&group) // the consumer group: its workers share the shards and one lease table
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(50))
        .build()?;
    // The handler notes each record's sequence number under its shard, to tell below
    // which record each checkpoint stopped at. `Ok` means handled: only then may the
    // checkpoint pass the record.
    let (handled, watch_handled) = watch::channel(PerShard::new());
    let handler = ServiceBuilder::new()
        .timeout(Duration::from_secs(5))
        .service_fn(move |msg: Message| {
            handled.send_modify(|shards| {
                let shard = shards.entry(msg.metadata.shard_id.to_string()).or_default();
                shard.push(msg.metadata.sequence_number.clone());
            });
            async { Ok::<_, Infallible>(()) }
        });
    let started = Instant::now();
    let running = consumer.run(handler).spawn(); // in the background until `shutdown()`
    let mut progress = watch_handled.clone();

    // Midway, split a shard in two; new records of its hash range go to the children.
    progress.wait_for(|s| total(s) >= RECORDS / 4).await?;
    let (parent, children) = common::split_first_shard(&*kinesis, &stream).await?;
    println!("Split {parent} → {}.", children.join(" + "));
    put_orders(&backend, &stream, RECORDS / 2..RECORDS).await?;
    println!("Wrote {} more records.", RECORDS - RECORDS / 2);
    progress.wait_for(|s| total(s) >= RECORDS).await?;

    // Stop reading, let in-flight handlers finish, commit the checkpoints, release.
    running.shutdown().await?;
    let elapsed = started.elapsed().as_secs_f64();
    let handled = watch_handled.borrow().clone();
    println!("Handled {} records in {elapsed:.1} s:", total(&handled));
    for lease in backend.lease_store(&group).list().await? {
        let records = handled.get(&lease.key).map_or(&[][..], Vec::as_slice);
        let checkpoint = match &lease.checkpoint {
            Checkpoint::ShardEnd => "SHARD_END (closed, every record handled)".to_owned(),
            Checkpoint::At(at) => match records.iter().position(|s| *s == at.sequence) {
                Some(i) => format!("at record {}", i + 1),
                None => format!("at sequence number {}", at.sequence),
            },
            other => format!("{other} (nothing handled)"),
        };
        let n = records.len();
        println!("  {}: {n} records, checkpoint {checkpoint}", lease.key);
    }
    Ok(())
}
