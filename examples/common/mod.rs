//! What the examples share and is not what they show: the backend chosen from the
//! environment, logging to stderr, unique stream names, and writing their test data.
//! Each example includes it with `mod common;` (cargo builds no example from this folder).

#![allow(dead_code)] // each example uses a part of it

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use shardflow::kinesis::{KinesisApi, PutOutcome, PutRecord, StreamAdmin};
use shardflow::lease::LeaseStore;
use shardflow::{Aws, Backend, CheckpointPolicy, Consumer, ConsumerBuilder, Memory};
use tokio::sync::watch;

/// The embedded backend, or AWS when `AWS_ENDPOINT_URL_KINESIS` (an emulator) or
/// `SHARDFLOW_BACKEND=aws` is set: the same example runs on both.
#[derive(Clone)]
pub enum AnyBackend {
    /// In-process Kinesis and lease store.
    Memory(Memory),
    /// Kinesis and DynamoDB through the AWS SDK (endpoints from the environment).
    Aws(Aws),
}

impl AnyBackend {
    /// Chooses the backend from the environment (see the type's docs).
    pub async fn from_env() -> Self {
        if std::env::var_os("AWS_ENDPOINT_URL_KINESIS").is_some()
            || std::env::var("SHARDFLOW_BACKEND").as_deref() == Ok("aws")
        {
            Self::Aws(Aws::from_env().await)
        } else {
            Self::Memory(Memory::new())
        }
    }

    /// AWS, whatever the environment says (for the examples that run only there).
    pub async fn aws() -> Self {
        Self::Aws(Aws::from_env().await)
    }
}

impl Backend for AnyBackend {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        match self {
            Self::Memory(m) => m.kinesis(),
            Self::Aws(a) => a.kinesis(),
        }
    }

    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        match self {
            Self::Memory(m) => m.lease_store(table),
            Self::Aws(a) => a.lease_store(table),
        }
    }

    fn admin(&self) -> Option<Arc<dyn StreamAdmin>> {
        match self {
            Self::Memory(m) => m.admin(),
            Self::Aws(a) => a.admin(),
        }
    }

    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        match self {
            Self::Memory(m) => m.table_streams(),
            Self::Aws(a) => a.table_streams(),
        }
    }
}

/// The examples' error type.
pub type Error = Box<dyn std::error::Error>;

/// The examples' result type.
pub type Result<T = ()> = std::result::Result<T, Error>;

/// Logs to stderr (in colour only on a terminal), filtered by `RUST_LOG` (`default` when
/// unset); stdout is left to what the example prints.
pub fn init_tracing(default: &str) {
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| default.into()),
        )
        .init();
}

/// Completes on the first SIGTERM or SIGINT. Listening starts at the call, so call it
/// before anything slow: a signal during start-up is then a graceful shutdown too (the
/// default action would kill the process).
pub fn shutdown_signal() -> std::io::Result<Until> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(Box::pin(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(
            signal = name,
            "shutting down: draining, checkpointing, releasing leases"
        );
    }))
}

/// `name-<seconds since the epoch>`: a fresh stream or group on every run (an emulator
/// keeps the previous run's).
pub fn unique(name: &str) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{name}-{secs}")
}

/// The backend's stream administration (create, split); `Memory` and `Aws` offer it.
pub fn admin(backend: &impl Backend) -> Result<Arc<dyn StreamAdmin>> {
    Ok(backend
        .admin()
        .ok_or("this backend cannot create streams")?)
}

/// Creates `stream` with `shards` shards and writes `records` to it (see [`put_all`]).
pub async fn create_stream_with(
    backend: &impl Backend,
    stream: &str,
    shards: u32,
    records: impl IntoIterator<Item = (String, String)>,
) -> Result {
    admin(backend)?.create_stream(stream, shards).await?;
    put_all(backend, stream, records).await
}

/// What a run waits for before it stops (a signal, a count reached).
pub type Until = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Completes once the count in `progress` reached `n` (or its sender is gone: whatever
/// counted has stopped).
pub fn at_least(mut progress: watch::Receiver<usize>, n: usize) -> Until {
    Box::pin(async move {
        let _ = progress.wait_for(|count| *count >= n).await;
    })
}

/// Writes `(partition key, payload)` records to `stream`, 500 per PutRecords call; a
/// refused record is an error (the `Producer` would retry it, the examples' data need not).
pub async fn put_all(
    backend: &impl Backend,
    stream: &str,
    records: impl IntoIterator<Item = (String, String)>,
) -> Result {
    let records: Vec<PutRecord> = records
        .into_iter()
        .map(|(partition_key, data)| PutRecord {
            data: Bytes::from(data),
            partition_key,
            explicit_hash_key: None,
        })
        .collect();
    for chunk in records.chunks(500) {
        let outcomes = backend.kinesis().put_records(stream, chunk).await?;
        if outcomes
            .iter()
            .any(|o| matches!(o, PutOutcome::Failed { .. }))
        {
            return Err(format!("some records were refused by {stream}").into());
        }
    }
    Ok(())
}

/// Writes orders `values` (`{"order":N}`) to `stream`, keyed by 100 customers (so they
/// spread over every shard).
pub async fn put_orders(
    backend: &impl Backend,
    stream: &str,
    values: std::ops::Range<usize>,
) -> Result {
    let orders = values.map(|i| {
        (
            format!("customer-{}", i % 100),
            format!("{{\"order\":{i}}}"),
        )
    });
    put_all(backend, stream, orders).await
}

/// The pipeline's order `i` as `(partition key, JSON)`: every 50th is bad JSON, every
/// 40th has a negative amount (the card is declined).
pub fn payment_order(i: usize) -> (String, String) {
    let json = match i {
        _ if i % 50 == 0 => format!("{{\"id\":{i},"),
        _ if i % 40 == 0 => format!("{{\"id\":{i},\"amount_cents\":-100}}"),
        _ => format!("{{\"id\":{i},\"amount_cents\":{}}}", 100 + i),
    };
    (format!("customer-{}", i % 31), json)
}

/// A consumer of `stream` in `group` with timings for a local run (fail-over within a few
/// seconds, caught-up shards read again after 50 ms); on AWS the defaults cost fewer
/// requests.
pub fn local_consumer(backend: impl Backend, stream: &str, group: &str) -> ConsumerBuilder {
    Consumer::builder()
        .stream(stream)
        .group(group)
        .backend(backend)
        .lease_duration(Duration::from_secs(3))
        .take_interval(Duration::from_millis(500))
        .idle_read_interval(Duration::from_millis(50))
        .shard_sync_interval(Duration::from_secs(1))
        .checkpoint(CheckpointPolicy::Interval(Duration::from_millis(200)))
}

/// Splits the stream's first shard in the middle of its hash range and waits until the
/// stream is active again: returns the parent's id and its two children's.
pub async fn split_first_shard(
    admin: &dyn StreamAdmin,
    stream: &str,
) -> Result<(String, Vec<String>)> {
    let parent = admin.list_shards(stream).await?.remove(0);
    let middle = parent.starting_hash_key + (parent.ending_hash_key - parent.starting_hash_key) / 2;
    admin.split_shard(stream, &parent.shard_id, middle).await?;
    while admin.is_updating(stream).await? {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let children = (admin.list_shards(stream).await?.into_iter())
        .filter(|s| s.parent_shard_id.as_deref() == Some(&*parent.shard_id))
        .map(|s| s.shard_id.to_string())
        .collect();
    Ok((parent.shard_id.to_string(), children))
}
