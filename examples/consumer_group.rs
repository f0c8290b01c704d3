//! One worker process of a consumer group: run several with the same `--group` and they
//! share the stream's shards through leases in DynamoDB.
//!
//! Other tools and tests drive this program, so its interface is kept stable:
//!
//! ```text
//! cargo run --release --example consumer_group -- \
//!     --stream NAME --group NAME --worker ID [--create-stream SHARDS] [OPTIONS]
//! ```
//!
//! - **Backend.** Always AWS (Kinesis + DynamoDB through the official SDK). Endpoints,
//!   region and credentials come from the standard AWS environment: `AWS_REGION`,
//!   `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` or a profile, and for emulators or
//!   LocalStack `AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_KINESIS`, `AWS_ENDPOINT_URL_DYNAMODB`.
//! - **`--create-stream SHARDS`** creates the stream with that many shards if it does not
//!   exist yet (an existing stream is left as it is) and waits until it is active.
//! - **stdout** carries one JSON object per line and nothing else: exactly one line for
//!   every record the worker handles, written and flushed *before* the handler returns,
//!   so a line is out before the checkpoint can pass its record:
//!
//!   ```text
//!   {"worker":"w1","shard":"shardId-000000000001","seq":"4968...","sub":0,"pk":"key-17","data":"<payload as UTF-8, lossy>"}
//!   ```
//!
//!   `seq` is the sequence number as a decimal string (up to 129 digits), `sub` the
//!   sub-sequence number (0 for plain records). With `--timestamps` each line also ends
//!   with `"ts_us":<microseconds since the Unix epoch>`, taken while stdout is locked, so
//!   the output of several workers on one machine can be merged in handling order.
//!   At-least-once: a record can be printed again (by this or another worker) after a
//!   crash; a graceful shutdown or rebalance hands shards over without repeats.
//! - **stderr** carries the logs (`tracing`; filter with `RUST_LOG`, default
//!   `warn,shardflow=info,consumer_group=info`).
//! - **SIGTERM or SIGINT** starts the graceful shutdown: reading stops, in-flight records
//!   are drained, checkpoints committed, leases released; then the process exits 0.
//!   A configuration or start-up error (e.g. the stream does not exist) exits 1.
//!
//! - **`--metrics-addr ADDR`** serves the metrics (README, "Metrics") as Prometheus text
//!   over HTTP on `ADDR` (e.g. `127.0.0.1:9100`), plus the health signal as two gauges,
//!   `consumer_group_live` and `consumer_group_ready` (1 or 0, updated every second).
//! - **`--fan-out NAME`** reads through enhanced fan-out as the stream consumer `NAME`.
//!
//! The timing options default to values for a local group against emulators (fast
//! fail-over, a few seconds); on AWS something like `--lease-duration-ms 10000
//! --take-interval-ms 10000` costs fewer DynamoDB requests. Every option is listed by
//! `--help`.

use std::borrow::Cow;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Parser, ValueEnum};
use serde::Serialize;
use shardflow::{Aws, Backend, CheckpointPolicy, Consumer, InitialPosition, Message};
use tokio::signal::unix::{signal, SignalKind};

/// One worker of a shardflow consumer group: prints a JSON line per handled record.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    /// The Kinesis stream to consume.
    #[arg(long)]
    stream: String,
    /// The consumer group: workers with the same group share the shards.
    #[arg(long)]
    group: String,
    /// This worker's id, unique within the group; printed as "worker" on every line.
    #[arg(long)]
    worker: String,
    /// Create the stream with this many shards if it does not exist yet.
    #[arg(long, value_name = "SHARDS")]
    create_stream: Option<u32>,
    /// The DynamoDB lease table [default: the group's name].
    #[arg(long)]
    lease_table: Option<String>,
    /// Where to start on shards the group has no checkpoint for yet.
    #[arg(long, value_enum, default_value_t = Start::TrimHorizon)]
    initial_position: Start,
    /// How long a lease lives without renewal before others may take it.
    #[arg(long, default_value_t = 3_000)]
    lease_duration_ms: u64,
    /// How often held leases are renewed [default: a third of the lease duration].
    #[arg(long)]
    renew_interval_ms: Option<u64>,
    /// How often the worker looks for leases to take or steal (one lease round).
    #[arg(long, default_value_t = 1_000)]
    take_interval_ms: u64,
    /// How long a requested hand-off may take before the lease is taken anyway
    /// [default: the lease duration].
    #[arg(long)]
    handoff_timeout_ms: Option<u64>,
    /// The pause before reading a caught-up shard again.
    #[arg(long, default_value_t = 100)]
    idle_read_interval_ms: u64,
    /// Write checkpoints at most this often; 0 writes one after every batch.
    #[arg(long, default_value_t = 500)]
    checkpoint_interval_ms: u64,
    /// How often ListShards looks for new shards (also right after a shard ends).
    #[arg(long, default_value_t = 10_000)]
    shard_sync_interval_ms: u64,
    /// Records per GetRecords call, 1..=10000 [default: 10000].
    #[arg(long)]
    max_records_per_read: Option<u32>,
    /// How long a graceful shutdown waits for in-flight records [default: 30000].
    #[arg(long)]
    shutdown_timeout_ms: Option<u64>,
    /// Add "ts_us" (wall-clock microseconds when the record was handled) to every line.
    #[arg(long)]
    timestamps: bool,
    /// Serve Prometheus metrics (text format) over HTTP on this address.
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Read through enhanced fan-out as this stream consumer instead of polling.
    #[arg(long, value_name = "NAME")]
    fan_out: Option<String>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Start {
    /// The oldest retained record.
    TrimHorizon,
    /// Only records written after the group first started.
    Latest,
}

/// One stdout line; field names and order are part of the interface.
#[derive(Serialize)]
struct Line<'a> {
    worker: &'a str,
    shard: &'a str,
    seq: &'a str,
    sub: u64,
    pk: &'a str,
    data: Cow<'a, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ts_us: Option<u64>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,shardflow=info,consumer_group=info".into()),
        )
        .init();
    // Listen for the signals before anything slow, so a SIGTERM during start-up is a
    // graceful shutdown too (the default action would kill the process).
    let shutdown = match shutdown_signal() {
        Ok(signal) => signal,
        Err(e) => {
            tracing::error!(error = %e, "cannot listen for SIGTERM/SIGINT");
            return ExitCode::FAILURE;
        }
    };
    match run(args, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "the worker stopped with an error");
            ExitCode::FAILURE
        }
    }
}

/// Completes on the first SIGTERM or SIGINT.
fn shutdown_signal() -> std::io::Result<impl std::future::Future<Output = ()> + Send + 'static> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(
            signal = name,
            "shutting down: draining, checkpointing, releasing leases"
        );
    })
}

async fn run(
    args: Args,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error>> {
    if let Some(addr) = args.metrics_addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()?;
        tracing::info!(%addr, "serving Prometheus metrics");
    }
    let aws = Aws::from_env().await;
    if let Some(shards) = args.create_stream {
        let admin = aws.admin().ok_or("this backend cannot create streams")?;
        admin.create_stream(&args.stream, shards).await?;
    }

    let ms = Duration::from_millis;
    let mut builder = Consumer::builder()
        .stream(&args.stream)
        .group(&args.group)
        .worker_id(&args.worker)
        .backend(aws)
        .initial_position(match args.initial_position {
            Start::TrimHorizon => InitialPosition::TrimHorizon,
            Start::Latest => InitialPosition::Latest,
        })
        .lease_duration(ms(args.lease_duration_ms))
        .take_interval(ms(args.take_interval_ms))
        .idle_read_interval(ms(args.idle_read_interval_ms))
        .shard_sync_interval(ms(args.shard_sync_interval_ms))
        .checkpoint(match args.checkpoint_interval_ms {
            0 => CheckpointPolicy::EveryBatch,
            n => CheckpointPolicy::Interval(ms(n)),
        });
    if let Some(table) = &args.lease_table {
        builder = builder.lease_table(table);
    }
    if let Some(n) = args.renew_interval_ms {
        builder = builder.renew_interval(ms(n));
    }
    if let Some(n) = args.handoff_timeout_ms {
        builder = builder.handoff_timeout(ms(n));
    }
    if let Some(n) = args.max_records_per_read {
        builder = builder.max_records_per_read(n);
    }
    if let Some(n) = args.shutdown_timeout_ms {
        builder = builder.shutdown_timeout(ms(n));
    }
    if let Some(name) = &args.fan_out {
        builder = builder.fan_out(name);
    }
    let consumer = builder.build()?;
    tracing::info!(
        stream = %args.stream,
        group = %args.group,
        worker = %args.worker,
        lease_table = consumer.config().lease_table(),
        "worker starting"
    );

    let worker: Arc<str> = args.worker.as_str().into();
    let timestamps = args.timestamps;
    // The line is written and flushed inside `call`, before the (already finished)
    // future reports `Ok`: only then may the checkpoint pass the record. A failed write
    // (stdout closed) is a handler error: the record is not handled, the shard reads
    // again from its checkpoint after a backoff.
    let handler = tower::service_fn(move |msg: Message| {
        let printed = print_line(&worker, &msg, timestamps);
        async move { printed }
    });
    let mut running = consumer.run(handler).until(shutdown).spawn();
    // The health signal as gauges, for a probe that scrapes the metrics.
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            result = &mut running => break result?,
            _ = tick.tick() => {
                let health = running.health();
                metrics::gauge!("consumer_group_live").set(f64::from(u8::from(health.is_live())));
                metrics::gauge!("consumer_group_ready").set(f64::from(u8::from(health.is_ready())));
            }
        }
    }
    tracing::info!("worker stopped");
    Ok(())
}

fn print_line(worker: &str, msg: &Message, timestamps: bool) -> std::io::Result<()> {
    let h = &msg.headers;
    let mut out = std::io::stdout().lock();
    // Taken under the lock: within one process, line order is timestamp order.
    let ts_us = timestamps.then(|| {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64)
    });
    let line = Line {
        worker,
        shard: &h.shard_id,
        seq: h.sequence_number.as_str(),
        sub: h.sub_sequence_number,
        pk: &h.partition_key,
        data: String::from_utf8_lossy(&msg.payload),
        ts_us,
    };
    serde_json::to_writer(&mut out, &line)?;
    out.write_all(b"\n")?;
    out.flush()
}
