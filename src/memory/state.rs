//! The embedded stream service's state: streams, shards and records, the settings and
//! faults in force; shared by the API calls (`kinesis`) and open enhanced fan-out
//! subscriptions (`fan_out`).

use std::collections::HashMap;
use std::time::Duration;

use rand::rngs::SmallRng;
use rand::Rng;
use tokio::time::Instant;

use crate::clock::WallClock;
use crate::kinesis::{Record, ShardInfo};

use super::faults::KinesisFaults;
use super::limits::Meters;

pub(super) struct MemShard {
    pub(super) info: ShardInfo,
    pub(super) records: Vec<Record>,
}

pub(super) struct MemStream {
    pub(super) shards: Vec<MemShard>,
    /// How many shards the stream ever had: the next shard's id number. Not
    /// `shards.len()`, which shrinks when a shard past retention is removed: a shard id is
    /// never given twice.
    pub(super) shards_created: usize,
    pub(super) updating: bool,
    /// Creation time, epoch seconds (see
    /// [`MemoryKinesis::delete_stream`](super::MemoryKinesis::delete_stream)).
    pub(super) created: u64,
    /// The largest record (data plus partition key) the stream takes (see
    /// [`MemoryKinesis::update_max_record_size`](super::MemoryKinesis::update_max_record_size)).
    pub(super) max_record_bytes: usize,
    /// Settings of this stream that differ from the service's (a table's change stream:
    /// 24 h retention, 15-minute iterators, 1,000 records per GetRecords).
    pub(super) overrides: StreamOverrides,
}

/// A stream's own retention, iterator lifetime and GetRecords cap, where it has one.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct StreamOverrides {
    pub(super) retention: Option<Duration>,
    pub(super) iterator_ttl: Option<Duration>,
    pub(super) max_records_per_read: Option<u32>,
}

pub(super) struct KinesisState {
    pub(super) streams: HashMap<String, MemStream>,
    pub(super) next_sequence: u128,
    pub(super) faults: KinesisFaults,
    pub(super) rng: SmallRng,
    pub(super) iterator_ttl: Duration,
    pub(super) retention: Option<Duration>,
    /// Added to every read call (see
    /// [`MemoryKinesis::set_latency`](super::MemoryKinesis::set_latency)).
    pub(super) latency: Duration,
    pub(super) epoch: Instant,
    /// The service's time of day: it stamps arrivals, dates streams and judges
    /// AT_TIMESTAMP and retention (see
    /// [`MemoryKinesis::set_wall_clock`](super::MemoryKinesis::set_wall_clock)).
    pub(super) wall_clock: WallClock,
    /// Registered enhanced fan-out consumers: ARN to stream name.
    pub(super) consumers: HashMap<String, String>,
    pub(super) subscription_lifetime: Duration,
    pub(super) max_records_per_event: usize,
    pub(super) heartbeat_interval: Duration,
    pub(super) report_shard_end: bool,
    /// Bumped by
    /// [`MemoryKinesis::interrupt_subscriptions`](super::MemoryKinesis::interrupt_subscriptions):
    /// subscriptions opened before fail.
    pub(super) interruptions: u64,
    /// See [`MemoryKinesis::set_cut_short_reads`](super::MemoryKinesis::set_cut_short_reads).
    pub(super) cut_short: f64,
    /// Shards the next ListShards answers leave out, and how many answers still do.
    pub(super) stale_list_shards: HashMap<String, u32>,
    /// Shards GetShardIterator answers NotFound for, and how many calls still get it.
    pub(super) shard_not_found: HashMap<String, u32>,
    /// The creation time of the last stream of each name: a stream created again gets a
    /// later one, as on AWS.
    pub(super) created: HashMap<String, u64>,
    /// Throughput limits in force and every shard's budget (see [`KinesisLimits`]).
    pub(super) meters: Meters,
    /// Tables of the embedded DynamoDB ([`super::tables`]) and their current stream ARN.
    pub(super) table_streams: HashMap<String, String>,
}

impl KinesisState {
    /// Whether the fault `fault` picks strikes this call.
    pub(super) fn draw(&mut self, fault: fn(&KinesisFaults) -> f64) -> bool {
        let probability = fault(&self.faults);
        probability > 0.0 && self.rng.gen_bool(probability.min(1.0))
    }

    pub(super) fn draw_cut_short(&mut self) -> bool {
        self.cut_short > 0.0 && self.rng.gen_bool(self.cut_short.min(1.0))
    }

    /// The retention period of `stream`: its own, or the service's.
    pub(super) fn retention_of(&self, stream: &str) -> Option<Duration> {
        self.streams
            .get(stream)
            .and_then(|st| st.overrides.retention)
            .or(self.retention)
    }

    /// How long an iterator of `stream` stays valid: its own lifetime, or the service's.
    pub(super) fn iterator_ttl_of(&self, stream: &str) -> Duration {
        self.streams
            .get(stream)
            .and_then(|st| st.overrides.iterator_ttl)
            .unwrap_or(self.iterator_ttl)
    }

    /// The index of the first record of `records` (of `stream`) still within the
    /// retention period.
    pub(super) fn first_retained(&self, stream: &str, records: &[Record]) -> usize {
        let retention = self.retention_of(stream);
        match (
            retention,
            self.wall_clock
                .now()
                .checked_sub(retention.unwrap_or_default()),
        ) {
            (Some(_), Some(cutoff)) => {
                records.partition_point(|r| r.approximate_arrival.is_some_and(|t| t < cutoff))
            }
            _ => 0,
        }
    }
}

/// How far a read that ended before `records[end]` is behind the newest record.
pub(super) fn behind_latest(records: &[Record], end: usize) -> Option<i64> {
    match records.last() {
        Some(last) if end < records.len() && end > 0 => last
            .approximate_arrival
            .zip(records[end - 1].approximate_arrival)
            .and_then(|(l, r)| l.duration_since(r).ok())
            .map(|d| d.as_millis() as i64),
        _ => Some(0),
    }
}
