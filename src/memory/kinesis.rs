//! The embedded stream service: streams, shards, records, resharding, iterators,
//! retention, injected faults and enhanced fan-out subscriptions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::SeedableRng;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::clock::WallClock;
use crate::kinesis::{
    partition_hash, KinesisApi, KinesisError, PutOutcome, PutRecord, Record, RecordsPage,
    ShardInfo, StartingPosition, StreamAdmin, StreamIdentity, Subscription, MAX_LARGE_RECORD_BYTES,
    MAX_PUT_RECORDS_BYTES, MAX_PUT_RECORDS_ENTRIES, MAX_RECORD_BYTES,
};
use crate::sequence::SequenceNumber;

use super::fan_out::MemSubscription;
use super::faults::KinesisFaults;
use super::limits::{metered_size, KinesisLimits, Meters, ReadRefusal};
use super::lock;
use super::state::{behind_latest, KinesisState, MemShard, MemStream, StreamOverrides};

/// A table stream's own settings (DynamoDB Streams': 24 h retention, iterators valid
/// for 15 minutes, at most 1,000 records per GetRecords).
#[derive(Clone, Copy, Debug)]
pub(super) struct TableStreamSettings {
    pub(super) retention: Duration,
    pub(super) iterator_ttl: Duration,
    pub(super) max_records_per_read: u32,
}

/// The account every embedded stream belongs to (in its ARN and multi-stream lease keys).
pub const MEMORY_ACCOUNT: &str = "000000000000";

/// An in-process Kinesis: streams of shards holding records.
pub struct MemoryKinesis {
    /// Shared with open subscriptions, which read the shard they follow.
    state: Arc<Mutex<KinesisState>>,
    /// Told about every write, reshard and interruption, so that subscriptions push
    /// records as they arrive.
    changes: watch::Sender<()>,
}

impl Default for MemoryKinesis {
    fn default() -> Self {
        MemoryKinesis {
            state: Arc::new(Mutex::new(KinesisState {
                streams: HashMap::new(),
                next_sequence: 0,
                faults: KinesisFaults::default(),
                rng: SmallRng::seed_from_u64(0),
                iterator_ttl: Duration::from_secs(300),
                latency: Duration::ZERO,
                retention: None,
                epoch: Instant::now(),
                wall_clock: WallClock::default(),
                consumers: HashMap::new(),
                subscription_lifetime: Duration::from_secs(300),
                max_records_per_event: 1_000,
                heartbeat_interval: Duration::from_secs(5),
                report_shard_end: true,
                interruptions: 0,
                cut_short: 0.0,
                stale_list_shards: HashMap::new(),
                shard_not_found: HashMap::new(),
                created: HashMap::new(),
                meters: Meters::default(),
                table_streams: HashMap::new(),
            })),
            changes: watch::channel(()).0,
        }
    }
}

const MAX_HASH: u128 = u128::MAX;

/// What Kinesis validates in a PutRecords request before it stores anything: 1 to 500
/// records, at most [`MAX_PUT_RECORDS_BYTES`] of data and partition keys in all, none
/// larger than the stream's maximum record size. A request that breaks one is refused
/// whole (`ValidationException` / `InvalidArgumentException`).
fn check_put_records(records: &[PutRecord], max_record_bytes: usize) -> Result<(), KinesisError> {
    if records.is_empty() || records.len() > MAX_PUT_RECORDS_ENTRIES {
        return Err(KinesisError::Invalid(
            format!(
                "a PutRecords request holds {} records, 1 to {MAX_PUT_RECORDS_ENTRIES} are allowed",
                records.len()
            )
            .into(),
        ));
    }
    let mut total = 0usize;
    for (index, r) in records.iter().enumerate() {
        let size = r.data.len().saturating_add(r.partition_key.len());
        if size > max_record_bytes {
            return Err(KinesisError::Invalid(
                format!(
                    "record {index} is {size} bytes (data and partition key), the stream takes at most {max_record_bytes}"
                )
                .into(),
            ));
        }
        total = total.saturating_add(size);
    }
    if total > MAX_PUT_RECORDS_BYTES {
        return Err(KinesisError::Invalid(
            format!(
                "a PutRecords request of {total} bytes (data and partition keys), at most {MAX_PUT_RECORDS_BYTES} are allowed"
            )
            .into(),
        ));
    }
    Ok(())
}

impl MemoryKinesis {
    /// Waits for the configured call latency ([`KinesisFaults::latency`]).
    async fn delay(&self) {
        let latency = lock(&self.state).latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
    }

    /// Makes every ListShards, GetShardIterator and GetRecords call take `latency`
    /// (a simulated round trip for scale figures under tokio's paused clock; zero by
    /// default).
    pub fn set_latency(&self, latency: Duration) {
        lock(&self.state).latency = latency;
    }

    /// Switches fault injection on (or off, with `KinesisFaults::default()`).
    pub fn set_faults(&self, faults: KinesisFaults) {
        let mut s = lock(&self.state);
        s.rng = SmallRng::seed_from_u64(faults.seed);
        s.faults = faults;
    }

    /// The service's clock for the time of day (default: this host's wall clock): it
    /// stamps each record's arrival, dates a new stream, judges whether an
    /// `AT_TIMESTAMP` is in the future and which records retention keeps. A simulation
    /// that must replay exactly sets a clock on tokio's (paused) time, e.g. a fixed
    /// date plus the time since the simulation started; give its workers the same clock
    /// ([`ConsumerBuilder::wall_clock`](crate::ConsumerBuilder::wall_clock)).
    pub fn set_wall_clock(&self, clock: impl Fn() -> SystemTime + Send + Sync + 'static) {
        lock(&self.state).wall_clock = WallClock::new(clock);
    }

    /// The service's clock (see [`MemoryKinesis::set_wall_clock`]).
    pub(crate) fn wall_clock(&self) -> WallClock {
        lock(&self.state).wall_clock.clone()
    }

    /// Puts Kinesis' per-shard throughput limits in force (or switches them off, with
    /// `KinesisLimits::none()`); every shard's budget starts full. See [`KinesisLimits`].
    pub fn set_limits(&self, limits: KinesisLimits) {
        lock(&self.state).meters.set_limits(limits);
    }

    /// How long an iterator stays valid (Kinesis: 5 minutes).
    pub fn set_iterator_ttl(&self, ttl: Duration) {
        lock(&self.state).iterator_ttl = ttl;
    }

    /// Records older than this are no longer returned (Kinesis: 24 hours by default).
    pub fn set_retention(&self, retention: Option<Duration>) {
        lock(&self.state).retention = retention;
    }

    /// Reports the stream as UPDATING (a reshard in progress) until set back. Splits and
    /// merges here are instant; this lets tests hold the in-between state open.
    pub fn set_updating(&self, stream: &str, updating: bool) {
        if let Some(st) = lock(&self.state).streams.get_mut(stream) {
            st.updating = updating;
        }
    }

    /// How long an enhanced fan-out subscription lasts before it ends and must be renewed
    /// (Kinesis: 5 minutes). Applies to subscriptions opened afterwards.
    pub fn set_subscription_lifetime(&self, lifetime: Duration) {
        lock(&self.state).subscription_lifetime = lifetime;
    }

    /// The most records one subscription event carries (default 1,000; at least 1).
    pub fn set_max_records_per_event(&self, n: usize) {
        lock(&self.state).max_records_per_event = n.max(1);
    }

    /// How long an idle subscription waits before it sends an empty event (default 5 s).
    pub fn set_heartbeat_interval(&self, interval: Duration) {
        lock(&self.state).heartbeat_interval = interval;
    }

    /// Whether a subscription to a closed shard ends with an event without continuation
    /// once it delivered the last record (default: yes, like Kinesis). Some emulators
    /// (kinesis-local) never report it and keep sending heartbeats: switch this off to
    /// see how a reader copes with them. Applies to subscriptions opened afterwards.
    pub fn set_report_shard_end(&self, report: bool) {
        lock(&self.state).report_shard_end = report;
    }

    /// Makes every open subscription fail: its next item is an error, after which it
    /// ends (a dropped connection, as far as the subscriber can tell).
    pub fn interrupt_subscriptions(&self) {
        lock(&self.state).interruptions += 1;
        self.changes.send_replace(());
    }

    /// Probability that a GetRecords page (or a subscription event with records) of a
    /// closed shard that does not reach the shard's end comes without a next iterator
    /// (without a continuation): a read cut short. Records remain after it, so a reader
    /// must not take it for the end of the shard. Drawn from the generator seeded by
    /// [`MemoryKinesis::set_faults`].
    pub fn set_cut_short_reads(&self, probability: f64) {
        lock(&self.state).cut_short = probability;
    }

    /// Makes the next `answers` ListShards calls leave `shard_id` out, as a stale
    /// (eventually consistent) answer may: the shard still exists and keeps its records.
    pub fn omit_from_list_shards(&self, shard_id: &str, answers: u32) {
        lock(&self.state)
            .stale_list_shards
            .insert(shard_id.to_owned(), answers);
    }

    /// Makes the next `calls` GetShardIterator or SubscribeToShard calls for `shard_id`
    /// answer NotFound (ResourceNotFoundException), as a lagging service node may: the
    /// shard still exists.
    pub fn shard_not_found(&self, shard_id: &str, calls: u32) {
        lock(&self.state)
            .shard_not_found
            .insert(shard_id.to_owned(), calls);
    }

    /// Counts one use of a one-off fault for `shard_id`; whether it applies this time.
    fn use_fault(faults: &mut HashMap<String, u32>, shard_id: &str) -> bool {
        match faults.get_mut(shard_id) {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        }
    }

    /// Sets the largest record `stream` takes, in KiB of data plus partition key, as
    /// Kinesis' `UpdateMaxRecordSize` does: 1,024 (1 MiB, every stream's default) to
    /// 10,240 (10 MiB); anything else is refused as invalid. From then on a PutRecords
    /// call holding a larger record is refused whole, as Kinesis refuses it
    /// (`ValidationException`), and [`KinesisApi::max_record_size`] answers the new
    /// figure. The shards' throughput limits stay as they are (see [`KinesisLimits`]).
    pub fn update_max_record_size(&self, stream: &str, kib: u32) -> Result<(), KinesisError> {
        let bytes = kib as usize * 1024;
        if !(MAX_RECORD_BYTES..=MAX_LARGE_RECORD_BYTES).contains(&bytes) {
            return Err(KinesisError::Invalid(
                format!("MaxRecordSizeInKiB {kib} is outside 1024..=10240").into(),
            ));
        }
        let mut s = lock(&self.state);
        let st = s
            .streams
            .get_mut(stream)
            .ok_or_else(|| KinesisError::NotFound(format!("stream {stream}").into()))?;
        st.max_record_bytes = bytes;
        Ok(())
    }

    /// Deletes a stream with its shards and records. Created again, the stream has a
    /// later creation time: another identity, so multi-stream consumers start it afresh.
    pub fn delete_stream(&self, stream: &str) {
        let mut s = lock(&self.state);
        s.streams.remove(stream);
        s.meters.forget_stream(stream);
        drop(s);
        self.changes.send_replace(());
    }

    /// Removes a shard entirely, as Kinesis does once a closed shard is past retention.
    pub fn remove_shard(&self, stream: &str, shard_id: &str) {
        if let Some(st) = lock(&self.state).streams.get_mut(stream) {
            st.shards.retain(|sh| sh.info.shard_id != shard_id);
        }
    }

    /// The ids of every shard of `stream` (open and closed), in creation order; none
    /// for a stream that does not exist. No fault applies.
    pub(super) fn shard_ids(&self, stream: &str) -> Vec<String> {
        let s = lock(&self.state);
        s.streams
            .get(stream)
            .map(|st| {
                st.shards
                    .iter()
                    .map(|sh| sh.info.shard_id.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A shard of `stream` as ListShards describes it (its parents, whether it is
    /// closed), for assertions in tests; `None` if there is no such shard. No fault
    /// applies.
    pub fn shard_info(&self, stream: &str, shard_id: &str) -> Option<ShardInfo> {
        let s = lock(&self.state);
        s.streams
            .get(stream)
            .and_then(|st| st.shards.iter().find(|sh| sh.info.shard_id == shard_id))
            .map(|sh| sh.info.clone())
    }

    /// Every record of a shard, for assertions in tests.
    pub fn records(&self, stream: &str, shard_id: &str) -> Vec<Record> {
        let s = lock(&self.state);
        s.streams
            .get(stream)
            .and_then(|st| st.shards.iter().find(|sh| sh.info.shard_id == shard_id))
            .map(|sh| sh.records.clone())
            .unwrap_or_default()
    }

    /// Creates the change stream `arn` of table `table` with `shards` open shards (each
    /// given the whole hash range: a table's shards have none) and the settings of
    /// DynamoDB Streams; the table's current stream becomes `arn`. The shards' ids, in
    /// order.
    pub(super) fn create_table_stream(
        &self,
        table: &str,
        arn: &str,
        shards: usize,
        overrides: TableStreamSettings,
    ) -> Result<Vec<String>, KinesisError> {
        let mut s = lock(&self.state);
        if s.streams.contains_key(arn) {
            return Err(KinesisError::Invalid(
                format!("stream {arn} exists already").into(),
            ));
        }
        let created = s
            .wall_clock
            .now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        s.streams.insert(
            arn.to_owned(),
            MemStream {
                shards: Vec::new(),
                shards_created: 0,
                updating: false,
                created,
                max_record_bytes: MAX_RECORD_BYTES,
                overrides: StreamOverrides {
                    retention: Some(overrides.retention),
                    iterator_ttl: Some(overrides.iterator_ttl),
                    max_records_per_read: Some(overrides.max_records_per_read),
                },
            },
        );
        s.table_streams.insert(table.to_owned(), arn.to_owned());
        (0..shards)
            .map(|_| Self::add_shard(&mut s, arn, (None, None), (0, MAX_HASH)))
            .collect()
    }

    /// Appends one record to the open shard `shard_id` of `stream`: `build` makes its
    /// partition key and data from the sequence number and arrival time the service
    /// gives it (a change record carries both).
    pub(super) fn append(
        &self,
        stream: &str,
        shard_id: &str,
        build: impl FnOnce(&SequenceNumber, SystemTime) -> (String, Bytes),
    ) -> Result<SequenceNumber, KinesisError> {
        let mut s = lock(&self.state);
        let sequence_number = Self::sequence(&mut s);
        let arrival = s.wall_clock.now();
        let shard = Self::shard_mut(&mut s, stream, shard_id)?;
        if shard.info.is_closed() {
            return Err(KinesisError::Invalid(
                format!("shard {shard_id} is closed").into(),
            ));
        }
        let (partition_key, data) = build(&sequence_number, arrival);
        shard.records.push(Record {
            sequence_number: sequence_number.clone(),
            partition_key,
            data,
            approximate_arrival: Some(arrival),
        });
        drop(s);
        self.changes.send_replace(());
        Ok(sequence_number)
    }

    /// Closes the open shard `shard_id` of `stream` and opens `children` shards with it
    /// as their parent (one for a table stream's rollover, two for a partition split),
    /// each with the whole hash range; their ids.
    pub(super) fn close_into(
        &self,
        stream: &str,
        shard_id: &str,
        children: usize,
    ) -> Result<Vec<String>, KinesisError> {
        let mut s = lock(&self.state);
        Self::close(&mut s, stream, shard_id)?;
        let ids = (0..children)
            .map(|_| {
                Self::add_shard(
                    &mut s,
                    stream,
                    (Some(shard_id.to_owned()), None),
                    (0, MAX_HASH),
                )
            })
            .collect();
        drop(s);
        self.changes.send_replace(());
        ids
    }

    fn sequence(s: &mut KinesisState) -> SequenceNumber {
        s.next_sequence += 1;
        // 56 digits like real sequence numbers; only digits, so `new` cannot fail.
        SequenceNumber::new(format!("49{:054}", s.next_sequence))
            .unwrap_or_else(|_| unreachable!("formatted digits"))
    }

    fn shard_mut<'a>(
        s: &'a mut KinesisState,
        stream: &str,
        shard_id: &str,
    ) -> Result<&'a mut MemShard, KinesisError> {
        s.streams
            .get_mut(stream)
            .ok_or_else(|| KinesisError::NotFound(format!("stream {stream}").into()))?
            .shards
            .iter_mut()
            .find(|sh| sh.info.shard_id == shard_id)
            .ok_or_else(|| KinesisError::NotFound(format!("shard {shard_id} of {stream}").into()))
    }

    fn close(s: &mut KinesisState, stream: &str, shard_id: &str) -> Result<(), KinesisError> {
        let end = Self::sequence(s);
        let shard = Self::shard_mut(s, stream, shard_id)?;
        if shard.info.is_closed() {
            return Err(KinesisError::Invalid(
                format!("shard {shard_id} is closed").into(),
            ));
        }
        shard.info.ending_sequence_number = Some(end);
        Ok(())
    }

    fn add_shard(
        s: &mut KinesisState,
        stream: &str,
        parents: (Option<String>, Option<String>),
        range: (u128, u128),
    ) -> Result<String, KinesisError> {
        let start = Self::sequence(s);
        let st = s
            .streams
            .get_mut(stream)
            .ok_or_else(|| KinesisError::NotFound(format!("stream {stream}").into()))?;
        let shard_id = format!("shardId-{:012}", st.shards_created);
        st.shards_created += 1;
        st.shards.push(MemShard {
            info: ShardInfo {
                shard_id: shard_id.clone(),
                parent_shard_id: parents.0,
                adjacent_parent_shard_id: parents.1,
                starting_hash_key: range.0,
                ending_hash_key: range.1,
                starting_sequence_number: start,
                ending_sequence_number: None,
            },
            records: Vec::new(),
        });
        Ok(shard_id)
    }

    fn iterator(s: &KinesisState, stream: &str, shard: &str, index: usize) -> String {
        let issued = Instant::now().duration_since(s.epoch).as_millis();
        format!("{stream}|{shard}|{index}|{issued}")
    }

    fn parse_iterator(iterator: &str) -> Option<(&str, &str, usize, u128)> {
        let mut parts = iterator.rsplitn(4, '|');
        let issued = parts.next()?.parse().ok()?;
        let index = parts.next()?.parse().ok()?;
        let shard = parts.next()?;
        let stream = parts.next()?;
        Some((stream, shard, index, issued))
    }

    /// The index of the first record at or after `from`. An `AT_TIMESTAMP` later than
    /// the service's clock (this host's wall clock, which also stamps arrivals) is
    /// refused, as Kinesis refuses it with `InvalidArgumentException`.
    fn start_index(
        s: &KinesisState,
        stream: &str,
        records: &[Record],
        from: &StartingPosition,
    ) -> Result<usize, KinesisError> {
        Ok(match from {
            StartingPosition::TrimHorizon => s.first_retained(stream, records),
            StartingPosition::Latest => records.len(),
            StartingPosition::AtTimestamp(t) => {
                let now = s.wall_clock.now();
                if *t > now {
                    let millis = |t: SystemTime| {
                        t.duration_since(SystemTime::UNIX_EPOCH)
                            .map_or(0, |d| d.as_millis())
                    };
                    return Err(KinesisError::FutureTimestamp(
                        format!(
                            "The timestampInMillis parameter cannot be greater than the \
                             currentTimestampInMillis. timestampInMillis: {}, \
                             currentTimestampInMillis: {}",
                            millis(*t),
                            millis(now)
                        )
                        .into(),
                    ));
                }
                records
                    .partition_point(|r| r.approximate_arrival.is_some_and(|a| a < *t))
                    .max(s.first_retained(stream, records))
            }
            StartingPosition::AtSequenceNumber(seq) => {
                records.partition_point(|r| r.sequence_number < *seq)
            }
            StartingPosition::AfterSequenceNumber(seq) => {
                records.partition_point(|r| r.sequence_number <= *seq)
            }
        })
    }
}

#[async_trait]
impl KinesisApi for MemoryKinesis {
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        self.delay().await;
        let mut s = lock(&self.state);
        let s = &mut *s;
        let st = s
            .streams
            .get(stream)
            .ok_or_else(|| KinesisError::NotFound(format!("stream {stream}").into()))?;
        let stale = &mut s.stale_list_shards;
        Ok(st
            .shards
            .iter()
            .filter(|sh| !Self::use_fault(stale, &sh.info.shard_id))
            .map(|sh| sh.info.clone())
            .collect())
    }

    async fn is_updating(&self, stream: &str) -> Result<bool, KinesisError> {
        let s = lock(&self.state);
        s.streams
            .get(stream)
            .map(|st| st.updating)
            .ok_or_else(|| KinesisError::NotFound(format!("stream {stream}").into()))
    }

    async fn stream_identity(&self, stream: &str) -> Result<StreamIdentity, KinesisError> {
        let s = lock(&self.state);
        let st = s
            .streams
            .get(stream)
            .ok_or_else(|| KinesisError::NotFound(format!("stream {stream}").into()))?;
        Ok(StreamIdentity {
            account: MEMORY_ACCOUNT.to_owned(),
            name: stream.to_owned(),
            creation_epoch: st.created,
        })
    }

    /// The stream of a table made with [`Memory::tables`](super::Memory::tables).
    async fn resolve_table_stream(&self, table: &str) -> Result<String, KinesisError> {
        lock(&self.state)
            .table_streams
            .get(table)
            .cloned()
            .ok_or_else(|| KinesisError::NotFound(format!("table {table} (or its stream)").into()))
    }

    async fn max_record_size(&self, stream: &str) -> Result<usize, KinesisError> {
        let s = lock(&self.state);
        s.streams
            .get(stream)
            .map(|st| st.max_record_bytes)
            .ok_or_else(|| KinesisError::NotFound(format!("stream {stream}").into()))
    }

    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        self.delay().await;
        let mut s = lock(&self.state);
        if s.draw(|f| f.error) {
            return Err(KinesisError::Other("injected service error".into()));
        }
        if Self::use_fault(&mut s.shard_not_found, shard_id) {
            return Err(KinesisError::NotFound(
                format!("shard {shard_id} of {stream} (injected)").into(),
            ));
        }
        let shard = Self::shard_mut(&mut s, stream, shard_id)?;
        let records = std::mem::take(&mut shard.records);
        let index = Self::start_index(&s, stream, &records, from);
        Self::shard_mut(&mut s, stream, shard_id)?.records = records;
        Ok(Self::iterator(&s, stream, shard_id, index?))
    }

    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        self.delay().await;
        let mut s = lock(&self.state);
        let (stream, shard_id, index, issued) =
            Self::parse_iterator(iterator).ok_or_else(|| {
                KinesisError::Invalid(format!("bad shard iterator {iterator:?}").into())
            })?;
        let age = Instant::now()
            .duration_since(s.epoch)
            .as_millis()
            .saturating_sub(issued);
        if age > s.iterator_ttl_of(stream).as_millis() || s.draw(|f| f.expire_iterator) {
            return Err(KinesisError::ExpiredIterator(
                format!("iterator for {shard_id} is {age} ms old").into(),
            ));
        }
        if s.draw(|f| f.throttle) {
            return Err(KinesisError::Throttled("injected throttle".into()));
        }
        if s.draw(|f| f.error) {
            return Err(KinesisError::Other("injected service error".into()));
        }
        if let Err(refusal) = s.meters.admit_read(stream, shard_id) {
            return Err(KinesisError::Throttled(
                match refusal {
                    ReadRefusal::Calls => format!(
                        "ProvisionedThroughputExceededException: rate exceeded for shard \
                         {shard_id} in stream {stream}: too many GetRecords calls per second"
                    ),
                    ReadRefusal::Bytes => format!(
                        "ProvisionedThroughputExceededException: rate exceeded for shard \
                         {shard_id} in stream {stream}: the bytes read per second are used up"
                    ),
                }
                .into(),
            ));
        }
        let missing_next = s.draw(|f| f.missing_next_iterator);
        let cut_short = s.draw_cut_short();
        let st = s
            .streams
            .get(stream)
            .ok_or_else(|| KinesisError::NotFound(format!("stream {stream}").into()))?;
        let shard = st
            .shards
            .iter()
            .find(|sh| sh.info.shard_id == shard_id)
            .ok_or_else(|| KinesisError::NotFound(format!("shard {shard_id}").into()))?;
        let start = index
            .max(s.first_retained(stream, &shard.records))
            .min(shard.records.len());
        let limit = st
            .overrides
            .max_records_per_read
            .map_or(limit, |cap| limit.min(cap));
        let mut end = (start + limit.max(1) as usize).min(shard.records.len());
        let mut bytes: u64 = 0;
        if let Some(max) = s.meters.answer_bytes() {
            // At least one record, then as many as fit in one answer.
            for (i, r) in shard.records[start..end].iter().enumerate() {
                let size = metered_size(r.data.len(), &r.partition_key);
                if i > 0 && bytes.saturating_add(size) > max {
                    end = start + i;
                    break;
                }
                bytes += size;
            }
        }
        let records = shard.records[start..end].to_vec();
        let at_end = end == shard.records.len();
        let cut_short = cut_short && !at_end && shard.info.is_closed();
        let (next_iterator, child_shards) = if missing_next || cut_short {
            (None, Vec::new())
        } else if at_end && shard.info.is_closed() {
            let children = st
                .shards
                .iter()
                .filter(|c| c.info.parents().iter().any(|p| p == shard_id))
                .map(|c| c.info.shard_id.clone())
                .collect();
            (None, children)
        } else {
            (Some(Self::iterator(&s, stream, shard_id, end)), Vec::new())
        };
        let millis_behind_latest = behind_latest(&shard.records, end);
        s.meters.charge_read(stream, shard_id, bytes);
        Ok(RecordsPage {
            records,
            next_iterator,
            millis_behind_latest,
            child_shards,
        })
    }

    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        let mut s = lock(&self.state);
        let max_record_bytes = s
            .streams
            .get(stream)
            .map_or(MAX_RECORD_BYTES, |st| st.max_record_bytes);
        check_put_records(records, max_record_bytes)?;
        if s.draw(|f| f.throttle) {
            return Err(KinesisError::Throttled("injected throttle".into()));
        }
        if !s.streams.contains_key(stream) {
            return Err(KinesisError::NotFound(format!("stream {stream}").into()));
        }
        let mut outcomes = Vec::with_capacity(records.len());
        for r in records {
            if s.draw(|f| f.put_entry_failure) {
                outcomes.push(PutOutcome::Failed {
                    code: "ProvisionedThroughputExceededException".into(),
                    message: "injected partial failure".into(),
                });
                continue;
            }
            let hash = match &r.explicit_hash_key {
                Some(h) => h.parse::<u128>().map_err(|_| {
                    KinesisError::Invalid(
                        format!("explicit hash key {h:?} is not a 128-bit number").into(),
                    )
                })?,
                None => partition_hash(&r.partition_key),
            };
            let sequence_number = Self::sequence(&mut s);
            let s = &mut *s;
            let st = s
                .streams
                .get_mut(stream)
                .ok_or_else(|| KinesisError::NotFound(format!("stream {stream}").into()))?;
            let shard = st
                .shards
                .iter_mut()
                .find(|sh| {
                    !sh.info.is_closed()
                        && sh.info.starting_hash_key <= hash
                        && hash <= sh.info.ending_hash_key
                })
                .ok_or_else(|| KinesisError::Other("no open shard owns the hash key".into()))?;
            let size = metered_size(r.data.len(), &r.partition_key);
            if !s.meters.admit_write(stream, &shard.info.shard_id, size) {
                // As AWS answers an entry over the shard's budget; the others are stored.
                outcomes.push(PutOutcome::Failed {
                    code: "ProvisionedThroughputExceededException".into(),
                    message: format!(
                        "Rate exceeded for shard {} in stream {stream} under account \
                         {MEMORY_ACCOUNT}.",
                        shard.info.shard_id
                    ),
                });
                continue;
            }
            let arrival = s.wall_clock.now();
            shard.records.push(Record {
                sequence_number: sequence_number.clone(),
                partition_key: r.partition_key.clone(),
                data: r.data.clone(),
                approximate_arrival: Some(arrival),
            });
            outcomes.push(PutOutcome::Stored {
                shard_id: shard.info.shard_id.clone(),
                sequence_number,
            });
        }
        drop(s);
        self.changes.send_replace(());
        Ok(outcomes)
    }

    /// Any name is accepted; the ARN is made up from the stream and consumer names and
    /// registering again returns the same one.
    async fn register_consumer(&self, stream: &str, name: &str) -> Result<String, KinesisError> {
        if name.is_empty() {
            return Err(KinesisError::Invalid("an empty consumer name".into()));
        }
        let mut s = lock(&self.state);
        if !s.streams.contains_key(stream) {
            return Err(KinesisError::NotFound(format!("stream {stream}").into()));
        }
        let arn = format!("arn:aws:kinesis:memory:000000000000:stream/{stream}/consumer/{name}:1");
        s.consumers.insert(arn.clone(), stream.to_owned());
        Ok(arn)
    }

    async fn subscribe_to_shard(
        &self,
        consumer_arn: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<Subscription, KinesisError> {
        let mut s = lock(&self.state);
        if s.draw(|f| f.throttle) {
            return Err(KinesisError::Throttled(
                "injected throttle (LimitExceededException)".into(),
            ));
        }
        if s.draw(|f| f.error) {
            return Err(KinesisError::Other("injected service error".into()));
        }
        let stream = s
            .consumers
            .get(consumer_arn)
            .cloned()
            .ok_or_else(|| KinesisError::NotFound(format!("consumer {consumer_arn}").into()))?;
        if Self::use_fault(&mut s.shard_not_found, shard_id) {
            return Err(KinesisError::NotFound(
                format!("shard {shard_id} of {stream} (injected)").into(),
            ));
        }
        let shard = s
            .streams
            .get(&stream)
            .and_then(|st| st.shards.iter().find(|sh| sh.info.shard_id == shard_id))
            .ok_or_else(|| {
                KinesisError::NotFound(format!("shard {shard_id} of {stream}").into())
            })?;
        let next = Self::start_index(&s, &stream, &shard.records, from)?;
        let now = Instant::now();
        let subscription = MemSubscription {
            state: self.state.clone(),
            changes: self.changes.subscribe(),
            stream,
            consumer: consumer_arn.to_owned(),
            shard_id: shard_id.to_owned(),
            next,
            ends_at: now + s.subscription_lifetime,
            // The first event comes at once, as on Kinesis: it carries the continuation
            // even when the shard is idle.
            heartbeat_at: now,
            max_records: s.max_records_per_event,
            heartbeat_interval: s.heartbeat_interval,
            report_shard_end: s.report_shard_end,
            interruptions: s.interruptions,
            paced_until: None,
        };
        Ok(Box::pin(futures_util::stream::unfold(
            Some(subscription),
            |subscription| async move { subscription?.next_event().await },
        )))
    }
}

#[async_trait]
impl StreamAdmin for MemoryKinesis {
    async fn create_stream(&self, stream: &str, shards: u32) -> Result<(), KinesisError> {
        if shards == 0 {
            return Err(KinesisError::Invalid(
                "a stream needs at least one shard".into(),
            ));
        }
        let mut s = lock(&self.state);
        if s.streams.contains_key(stream) {
            return Ok(());
        }
        let now = s
            .wall_clock
            .now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let created = match s.created.get(stream) {
            Some(last) => now.max(last + 1),
            None => now,
        };
        s.created.insert(stream.to_owned(), created);
        s.streams.insert(
            stream.to_owned(),
            MemStream {
                shards: Vec::new(),
                shards_created: 0,
                updating: false,
                created,
                max_record_bytes: MAX_RECORD_BYTES,
                overrides: StreamOverrides::default(),
            },
        );
        let width = MAX_HASH / shards as u128;
        for i in 0..shards as u128 {
            let end = if i + 1 == shards as u128 {
                MAX_HASH
            } else {
                (i + 1) * width - 1
            };
            Self::add_shard(&mut s, stream, (None, None), (i * width, end))?;
        }
        Ok(())
    }
    async fn split_shard(
        &self,
        stream: &str,
        shard_id: &str,
        new_starting_hash_key: u128,
    ) -> Result<(), KinesisError> {
        let mut s = lock(&self.state);
        let info = Self::shard_mut(&mut s, stream, shard_id)?.info.clone();
        if new_starting_hash_key <= info.starting_hash_key
            || new_starting_hash_key > info.ending_hash_key
        {
            return Err(KinesisError::Invalid(
                format!("hash key {new_starting_hash_key} is not inside {shard_id}").into(),
            ));
        }
        Self::close(&mut s, stream, shard_id)?;
        let parent = Some(shard_id.to_owned());
        Self::add_shard(
            &mut s,
            stream,
            (parent.clone(), None),
            (info.starting_hash_key, new_starting_hash_key - 1),
        )?;
        Self::add_shard(
            &mut s,
            stream,
            (parent, None),
            (new_starting_hash_key, info.ending_hash_key),
        )?;
        drop(s);
        self.changes.send_replace(());
        Ok(())
    }
    async fn merge_shards(
        &self,
        stream: &str,
        shard_id: &str,
        adjacent_shard_id: &str,
    ) -> Result<(), KinesisError> {
        let mut s = lock(&self.state);
        let a = Self::shard_mut(&mut s, stream, shard_id)?.info.clone();
        let b = Self::shard_mut(&mut s, stream, adjacent_shard_id)?
            .info
            .clone();
        let adjacent = a.ending_hash_key.checked_add(1) == Some(b.starting_hash_key)
            || b.ending_hash_key.checked_add(1) == Some(a.starting_hash_key);
        if !adjacent || a.is_closed() || b.is_closed() {
            return Err(KinesisError::Invalid(
                format!("{shard_id} and {adjacent_shard_id} are not adjacent open shards").into(),
            ));
        }
        Self::close(&mut s, stream, shard_id)?;
        Self::close(&mut s, stream, adjacent_shard_id)?;
        Self::add_shard(
            &mut s,
            stream,
            (
                Some(shard_id.to_owned()),
                Some(adjacent_shard_id.to_owned()),
            ),
            (
                a.starting_hash_key.min(b.starting_hash_key),
                a.ending_hash_key.max(b.ending_hash_key),
            ),
        )?;
        drop(s);
        self.changes.send_replace(());
        Ok(())
    }
}
