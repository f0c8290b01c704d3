//! Many streams, one consumer group: one consumer reads three streams through one lease
//! table, then a fourth stream is added and one removed while it runs.
//!
//! The rule it shows: the stream list can change at run time; every message names its
//! stream (`msg.metadata.stream`), lease keys take the KCL's multi-stream form
//! `account:stream:creationEpoch:shardId`, and a removed stream's leases are released
//! after its shards drained and checkpointed, its rows kept (adding it back continues
//! where it left off). It prints the records handled per stream and every row's
//! checkpoint (`tests/examples.rs` checks them). Embedded backend;
//! `AWS_ENDPOINT_URL_KINESIS` or `SHARDFLOW_BACKEND=aws` for AWS.
//!
//! ```text
//! cargo run --example multi_stream
//! ```

mod common;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::time::Duration;

use common::{put_orders, unique, AnyBackend};
use shardflow::{Backend, Consumer, Message};
use tokio::sync::watch;

const RECORDS_PER_STREAM: usize = 500;

#[tokio::main]
async fn main() -> Result<(), common::Error> {
    common::init_tracing("warn");
    let backend = AnyBackend::from_env().await;
    let [orders, refunds, audit, returns] = ["orders", "refunds", "audit", "returns"].map(unique);
    let admin = common::admin(&backend)?;
    for (stream, shards) in [(&orders, 2), (&refunds, 1), (&audit, 1), (&returns, 2)] {
        admin.create_stream(stream, shards).await?;
        put_orders(&backend, stream, 0..RECORDS_PER_STREAM).await?;
    }

    // The stream list: a watch channel, so it can change while the consumer runs (a
    // fixed list is `.streams([...])`).
    let (streams, list) = watch::channel(vec![orders.clone(), refunds.clone(), audit.clone()]);
    let group = unique("multi");
    let consumer = Consumer::builder()
        .streams_from(list)
        .group(&group)
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(50))
        .build()?;
    // Records handled per stream: every message names its stream (and shard, ...).
    let (handled, mut per_stream) = watch::channel(BTreeMap::<String, usize>::new());
    let handler = tower::service_fn(move |msg: Message| {
        handled.send_modify(|n| *n.entry(msg.metadata.stream.to_string()).or_default() += 1);
        async { Ok::<_, Infallible>(()) }
    });
    let running = consumer.run(handler).spawn();

    per_stream
        .wait_for(|n| all_read(n, [&orders, &refunds, &audit]))
        .await?;
    println!("read {orders}, {refunds} and {audit}; now adding {returns} and removing {audit}");
    streams.send_replace(vec![orders.clone(), refunds.clone(), returns.clone()]);
    per_stream
        .wait_for(|n| all_read(n, [&orders, &refunds, &returns]))
        .await?;

    // Stop reading, let in-flight handlers finish, commit, release: then the result.
    running.shutdown().await?;
    println!("handled per stream:");
    for (stream, n) in per_stream.borrow().iter() {
        println!("  {stream}: {n}");
    }
    println!("checkpoints (lease key: checkpoint):");
    for lease in backend.lease_store(&group).list().await? {
        println!("  {}: {}", lease.key, lease.checkpoint);
    }
    Ok(())
}

/// Whether every record of these streams was handled.
fn all_read(handled: &BTreeMap<String, usize>, streams: [&String; 3]) -> bool {
    streams
        .iter()
        .all(|s| handled.get(*s) >= Some(&RECORDS_PER_STREAM))
}
