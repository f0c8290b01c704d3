//! The command line of the `consumer_group` example: its flags and how they configure the
//! consumer. Other tools and tests (`tests/group_processes.rs`) drive that program, so
//! its interface is kept stable:
//!
//! - **Backend.** Always AWS (Kinesis + DynamoDB through the official SDK). Endpoints,
//!   region and credentials come from the standard AWS environment: `AWS_REGION`,
//!   `AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` or a profile, and for emulators or
//!   LocalStack `AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_KINESIS`, `AWS_ENDPOINT_URL_DYNAMODB`.
//! - **`--create-stream SHARDS`** creates the stream with that many shards if it does not
//!   exist yet (an existing stream is left as it is) and waits until it is active.
//! - **stdout** carries one JSON object per line and nothing else: exactly one line for
//!   every record the worker handles, written and flushed *before* the handler returns:
//!
//!   ```text
//!   {"worker":"w1","shard":"shardId-000000000001","seq":"4968...","sub":0,"pk":"key-17","data":"<payload as UTF-8, lossy>"}
//!   ```
//!
//!   `seq` is the sequence number as a decimal string (up to 129 digits), `sub` the
//!   sub-sequence number (0 for plain records). With `--timestamps` each line also ends
//!   with `"ts_us":<microseconds since the Unix epoch>`, taken while stdout is locked, so
//!   the output of several workers on one machine can be merged in handling order.
//! - **stderr** carries the logs (`tracing`; filter with `RUST_LOG`, default
//!   `warn,shardflow=info,consumer_group=info`).
//! - **SIGTERM or SIGINT** starts the graceful shutdown: reading stops, in-flight records
//!   are drained, checkpoints committed, leases released; then the process exits 0.
//!   A configuration or start-up error (e.g. the stream does not exist) exits 1.
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
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Parser, ValueEnum};
use serde::Serialize;
use shardflow::ConsumerBuilder;
use shardflow::{CheckpointPolicy, InitialPosition, Message};

/// One worker of a shardflow consumer group: prints a JSON line per handled record.
#[derive(Parser, Debug)]
#[command(name = "consumer_group", version)]
pub struct Args {
    /// The Kinesis stream to consume.
    #[arg(long)]
    pub stream: String,
    /// The consumer group: workers with the same group share the shards.
    #[arg(long)]
    pub group: String,
    /// This worker's id, unique within the group; printed as "worker" on every line.
    #[arg(long)]
    pub worker: String,
    /// Create the stream with this many shards if it does not exist yet.
    #[arg(long, value_name = "SHARDS")]
    pub create_stream: Option<u32>,
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
    pub timestamps: bool,
    /// Serve Prometheus metrics (text format) over HTTP on this address.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
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

impl Args {
    /// Applies the options beyond stream, group and worker (position, timings, lease
    /// table, fan-out) to `builder`.
    pub fn options(&self, mut builder: ConsumerBuilder) -> ConsumerBuilder {
        let ms = Duration::from_millis;
        builder = builder
            .initial_position(match self.initial_position {
                Start::TrimHorizon => InitialPosition::TrimHorizon,
                Start::Latest => InitialPosition::Latest,
            })
            .lease_duration(ms(self.lease_duration_ms))
            .take_interval(ms(self.take_interval_ms))
            .idle_read_interval(ms(self.idle_read_interval_ms))
            .shard_sync_interval(ms(self.shard_sync_interval_ms))
            .checkpoint(match self.checkpoint_interval_ms {
                0 => CheckpointPolicy::EveryBatch,
                n => CheckpointPolicy::Interval(ms(n)),
            });
        if let Some(table) = &self.lease_table {
            builder = builder.lease_table(table);
        }
        if let Some(n) = self.renew_interval_ms {
            builder = builder.renew_interval(ms(n));
        }
        if let Some(n) = self.handoff_timeout_ms {
            builder = builder.handoff_timeout(ms(n));
        }
        if let Some(n) = self.max_records_per_read {
            builder = builder.max_records_per_read(n);
        }
        if let Some(n) = self.shutdown_timeout_ms {
            builder = builder.shutdown_timeout(ms(n));
        }
        if let Some(name) = &self.fan_out {
            builder = builder.fan_out(name);
        }
        builder
    }
}

/// One stdout line; field names and order are part of the interface.
#[derive(Serialize)]
pub struct Line<'a> {
    worker: &'a str,
    shard: &'a str,
    seq: &'a str,
    sub: u64,
    pk: &'a str,
    data: Cow<'a, str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ts_us: Option<u64>,
}

impl<'a> Line<'a> {
    /// The line for `msg`, with the wall-clock time when `timestamps`.
    pub fn new(worker: &'a str, msg: &'a Message, timestamps: bool) -> Self {
        let h = &msg.metadata;
        let ts_us = timestamps.then(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64)
        });
        Line {
            worker,
            shard: &h.shard_id,
            seq: h.sequence_number.as_str(),
            sub: h.sub_sequence_number,
            pk: &h.partition_key,
            data: String::from_utf8_lossy(&msg.payload),
            ts_us,
        }
    }
}
