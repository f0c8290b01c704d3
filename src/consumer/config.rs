//! The consumer's configuration and its builder, which refuses bad values with an error
//! naming the field.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::sync::watch;

use super::events::{OnEvent, ShardEvent};
use crate::aggregation::MisplacedUserRecords;
use crate::backend::Backend;
use crate::clock::WallClock;
pub use crate::error::ConfigError;
use crate::headers::HeaderFormat;
use crate::metrics::Labels;

/// The longest duration any setting accepts (one week).
const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The most batches a shard may read ahead.
const MAX_PREFETCH: usize = 1_024;

/// Where a consumer group starts on a shard that has no checkpoint yet: the one way
/// users say where to start ([`ConsumerBuilder::initial_position`]).
///
/// Not to be confused with [`crate::kinesis::StartingPosition`], the position of one
/// shard-iterator request on the [`crate::kinesis::KinesisApi`] trait: the consumer
/// turns an `InitialPosition` into a durable start in the lease row, then into
/// `StartingPosition`s (mostly `AfterSequenceNumber` of the checkpoint) for each read.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum InitialPosition {
    /// The oldest retained record (the default: nothing already in the stream is missed).
    #[default]
    TrimHorizon,
    /// Only records written after the group started. The worker that creates the
    /// lease rows (on a new table) resolves "now" once into a durable start: it writes
    /// `AT_TIMESTAMP` with the moment it started minus a clock margin of a few seconds
    /// (Kinesis arrival times are the service's clock; a time Kinesis calls in its
    /// future, from a host clock that runs ahead, is moved back until Kinesis accepts
    /// it, so the start is never later than Kinesis' "now") into every row, closed shards
    /// included (a shard closed by a reshard since the start still holds records
    /// written since then; one closed before yields nothing and ends at once). A shard
    /// that appears later (a reshard) is read from its start, after its parents. A row
    /// with the KCL's `LATEST` sentinel is resolved when first taken, before anything
    /// is read. Every later owner (after a hand-off, a crash, a drain timeout or a
    /// restart before the first checkpoint) continues from that same point, so nothing
    /// written in between is skipped; the price is that records written within the
    /// margin before the start are delivered too. (The KCL starts at the tip again
    /// in that case and loses those records.)
    Latest,
    /// Records that arrived at or after this time. The time is written into the lease
    /// row when it is created or first taken, so later owners continue from the same
    /// point even if they were configured differently. A row with the `AT_TIMESTAMP`
    /// sentinel but no time (a KCL table) uses this time; with another initial position
    /// configured, such a row starts at TRIM_HORIZON (nothing is missed).
    AtTimestamp(SystemTime),
}

/// When a shard's watermark is written to the lease table. Whatever the policy, a
/// checkpoint is written only when the watermark moved (an idle shard writes none), and
/// always at shard end, hand-off and shutdown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckpointPolicy {
    /// After every acknowledged batch.
    EveryBatch,
    /// At most once per interval (and always at shard end, hand-off and shutdown).
    Interval(Duration),
}

/// The default checkpoint interval: at most 12 writes per shard per minute while records
/// flow (the lease upkeep is about 24 requests per shard per minute), and a crash
/// re-delivers at most about this much of each shard. A planned hand-off or shutdown
/// re-delivers nothing whatever the interval: the checkpoint is written after the drain.
pub const DEFAULT_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(5);

/// The default pause before reading a caught-up shard again (the KCL's default idle time
/// between reads): one GetRecords per second per idle shard, so several applications on
/// one stream stay well under Kinesis' 5 reads per second per shard. A shard that is
/// behind (a full page, or `MillisBehindLatest` above zero) is read again at once.
pub const DEFAULT_IDLE_READ_INTERVAL: Duration = Duration::from_secs(1);

/// The default [`stuck_after`](ConsumerBuilder::stuck_after): 90 s. Longer than what a
/// healthy handler takes on one record, including a retry layer's backoff over several
/// attempts and a dead-letter write after it (tens of seconds at most), and than the
/// default shutdown timeout (30 s), so a slow but working handler never makes a
/// readiness probe flap; short enough that a hung handler or a record that can never be
/// handled is reported within two minutes, well before a backlog of a busy shard grows
/// out of hand.
pub const DEFAULT_STUCK_AFTER: Duration = Duration::from_secs(90);

/// The longest [`stuck_after`](ConsumerBuilder::stuck_after) allowed: a shard making no
/// progress for longer than this must be reported.
pub const MAX_STUCK_AFTER: Duration = Duration::from_secs(300);

impl Default for CheckpointPolicy {
    fn default() -> Self {
        CheckpointPolicy::Interval(DEFAULT_CHECKPOINT_INTERVAL)
    }
}

/// How [`Consumer::run`](super::Consumer::run) hands a shard's records to the service
/// (see [`ConsumerBuilder::concurrency`]). Shards always run concurrently; this is about
/// the records inside one shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Concurrency {
    /// One record at a time, in sequence order (the default).
    #[default]
    Sequential,
    /// Records with the same partition key one at a time in sequence order; records with
    /// different keys concurrently, at most this many calls in flight per shard.
    PerKey(usize),
    /// Up to this many calls in flight per shard, in no particular order (for handlers
    /// with no ordering needs).
    Unordered(usize),
}

/// What the group's lease balancing evens out between workers (see
/// [`ConsumerBuilder::balance_by`] and docs/groups.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BalanceBy {
    /// Lease counts: every worker holds the same number of leases, within one (the
    /// default; the KCL 2's balancing).
    #[default]
    Count,
    /// The sum of the leases' measured throughput (`throughputKBps`, record bytes per
    /// second, each owner's smoothed measurement written at renewal): a worker above the
    /// mean by more than the tolerance ([`ConsumerBuilder::balance_tolerance`]) hands
    /// leases to less loaded workers, a bounded share of the fleet's load at a time.
    /// Leases not measured yet count as the mean of the measured ones; with nothing
    /// measured (a new group, an idle stream) the balancing is by count.
    Throughput,
}

/// The default [`ConsumerBuilder::balance_tolerance`]: 10 % above the mean load.
pub const DEFAULT_BALANCE_TOLERANCE: f64 = 0.10;

/// The most calls in flight per shard [`Concurrency`] accepts.
const MAX_CONCURRENCY: usize = 10_000;

/// The default [`ConsumerBuilder::read_ahead_bytes`]: 64 MiB fits a 256 MiB container
/// beside the runtime and handlers, and still holds six full 10 MB GetRecords reads (the
/// most one call returns), so a backlog on a few shards is read at full speed while one
/// on hundreds cannot exhaust memory.
pub const DEFAULT_READ_AHEAD_BYTES: u64 = 64 * 1024 * 1024;

/// The largest [`ConsumerBuilder::read_ahead_bytes`]: the budget counts whole KiB in a
/// `u32`.
const MAX_READ_AHEAD_BYTES: u64 = u32::MAX as u64 * 1024;

/// The most calls in flight per worker [`ConsumerBuilder::max_concurrent_calls`] accepts.
const MAX_WORKER_CALLS: usize = 1_000_000;

/// The streams of a multi-stream consumer.
#[derive(Clone, Debug)]
pub(crate) enum StreamList {
    /// [`ConsumerBuilder::streams`]: names, validated by `build`.
    Fixed(Vec<String>),
    /// [`ConsumerBuilder::streams_from`]: names or ARNs, read whenever the value changes.
    Watched(watch::Receiver<Vec<String>>),
}

/// The name of a stream given by name or ARN (`arn:aws:kinesis:<region>:<account>:stream/<name>`),
/// refused with `field` in the error when it is neither.
pub(crate) fn stream_name(field: &'static str, given: &str) -> Result<String, ConfigError> {
    let name = crate::kinesis::stream_name_of_arn(given).unwrap_or(given);
    if name.is_empty()
        || name.len() > 128
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
    {
        return Err(ConfigError::Invalid {
            field,
            reason: format!(
                "{given:?} is neither a Kinesis stream name (1-128 of a-z A-Z 0-9 _ . -) nor a stream ARN"
            ),
        });
    }
    Ok(name.to_owned())
}

/// How a table-stream consumer names its stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TableStream {
    /// [`ConsumerBuilder::table_stream`]: the table, whose current stream ARN is resolved
    /// when the consumer starts.
    Table(String),
    /// [`ConsumerBuilder::table_stream_arn`]: the stream ARN itself.
    Arn,
}

/// The most records one DynamoDB Streams GetRecords call returns, and so the largest
/// [`ConsumerBuilder::max_records_per_read`] of a table-stream consumer (its default).
pub const MAX_TABLE_STREAM_RECORDS_PER_READ: u32 = 1_000;

/// Whether `arn` looks like a DynamoDB stream ARN,
/// `arn:<partition>:dynamodb:<region>:<account>:table/<table>/stream/<label>`.
pub(crate) fn is_table_stream_arn(arn: &str) -> bool {
    let mut parts = arn.splitn(6, ':');
    let (Some("arn"), Some(_), Some("dynamodb"), Some(_), Some(account), Some(resource)) = (
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
        parts.next(),
    ) else {
        return false;
    };
    let mut resource = resource.splitn(4, '/');
    !account.is_empty()
        && resource.next() == Some("table")
        && resource.next().is_some_and(|t| !t.is_empty())
        && resource.next() == Some("stream")
        && resource.next().is_some_and(|l| !l.is_empty())
}

/// Whether `table` is a DynamoDB table name (3-255 of a-z A-Z 0-9 _ . -).
fn is_table_name(table: &str) -> bool {
    (3..=255).contains(&table.len())
        && table
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
}

/// A validated consumer configuration (see [`ConsumerBuilder`] for each field).
#[derive(Clone, Debug)]
pub struct Config {
    /// The stream of a single-stream consumer, or of one stream's coordinator in
    /// multi-stream mode; empty for a multi-stream consumer as a whole.
    pub(crate) stream: String,
    /// `Some`: a multi-stream consumer (see [`ConsumerBuilder::streams`]).
    pub(crate) streams: Option<StreamList>,
    /// `Some`: the stream is a table's DynamoDB stream, read through
    /// [`Backend::table_streams`]; `stream` is its ARN (or, before the consumer starts,
    /// the table's name when given by table).
    pub(crate) table_stream: Option<TableStream>,
    pub(crate) group: String,
    pub(crate) worker_id: String,
    /// This incarnation's name in `leaseOwner`: the worker id and a per-start nonce.
    pub(crate) owner: String,
    pub(crate) lease_table: String,
    pub(crate) initial_position: InitialPosition,
    pub(crate) max_records_per_read: u32,
    pub(crate) idle_read_interval: Duration,
    /// `Some`: read through enhanced fan-out instead of polling, as this stream
    /// consumer.
    pub(crate) fan_out: Option<String>,
    pub(crate) prefetch_batches: usize,
    pub(crate) read_ahead_bytes: u64,
    pub(crate) checkpoint: CheckpointPolicy,
    pub(crate) lease_duration: Duration,
    pub(crate) renew_interval: Duration,
    pub(crate) take_interval: Duration,
    pub(crate) shard_sync_interval: Duration,
    pub(crate) max_steals_per_round: usize,
    pub(crate) handoff_timeout: Duration,
    pub(crate) balance_by: BalanceBy,
    pub(crate) balance_limits: crate::consumer::balance::LoadLimits,
    pub(crate) retry_min: Duration,
    pub(crate) retry_max: Duration,
    pub(crate) shutdown_timeout: Duration,
    /// Records waiting this long with none handled make the shard stuck.
    pub(crate) stuck_after: Duration,
    pub(crate) lease_call_timeout: Duration,
    pub(crate) read_call_timeout: Duration,
    pub(crate) seed: u64,
    pub(crate) on_event: Option<OnEvent>,
    pub(crate) concurrency: Concurrency,
    pub(crate) max_concurrent_calls: usize,
    pub(crate) header_format: HeaderFormat,
    pub(crate) misplaced_user_records: MisplacedUserRecords,
    pub(crate) wall_clock: WallClock,
}

impl Config {
    /// How old the last successful lease renewal (counted from when it was sent) may be
    /// when records are handed out, a queued batch starts or a handler call starts: the
    /// lease duration less one renew interval, the margin. Past it, the lease may
    /// already be someone else's.
    pub(crate) fn lease_fresh_for(&self) -> Duration {
        self.lease_duration.saturating_sub(self.renew_interval)
    }
    /// The labels of this consumer's metrics.
    /// A table's stream given by table is labelled with the table's name, before and
    /// after its ARN was resolved, so every metric of the consumer carries the same label.
    pub(crate) fn labels(&self) -> Labels {
        match &self.table_stream {
            Some(TableStream::Table(table)) => Labels::new(table, &self.group),
            _ => Labels::new(&self.stream, &self.group),
        }
    }
    /// The stream's name (empty for a multi-stream consumer: see [`Config::streams`]).
    pub fn stream(&self) -> &str {
        &self.stream
    }
    /// The streams of a multi-stream consumer now (for [`ConsumerBuilder::streams_from`],
    /// the list's current value); `None` for a single-stream consumer.
    pub fn streams(&self) -> Option<Vec<String>> {
        self.streams.as_ref().map(|list| match list {
            StreamList::Fixed(names) => names.clone(),
            StreamList::Watched(rx) => rx.borrow().clone(),
        })
    }
    /// A multi-stream consumer's configuration for one of its streams.
    pub(crate) fn for_stream(&self, stream: &str) -> Config {
        let mut config = self.clone();
        config.stream = stream.to_owned();
        config.streams = None;
        config
    }
    /// The consumer group's name.
    pub fn group(&self) -> &str {
        &self.group
    }
    /// This worker's id in the group.
    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }
    /// The name this consumer writes into the lease table's `leaseOwner`: the worker id
    /// and a nonce drawn when the consumer is built, e.g. `billing-7#k3f9a2`
    /// ([`crate::lease::worker_of`] gives the worker id back). Each consumer built is a
    /// new incarnation, so a restarted process that keeps its worker id (a StatefulSet
    /// pod) never mistakes the old process's leases, or its writes, for its own. The
    /// nonce comes from the operating system's random generator, whatever
    /// [`ConsumerBuilder::seed`] says: two consumers built with the same worker id and
    /// seed are two owners (unless [`ConsumerBuilder::owner_nonce`] names the nonce). Leases an older incarnation of the same worker id
    /// still holds are treated like any other worker's: taken once they expire (their
    /// counter did not move for the lease duration) or handed over on request.
    pub fn owner(&self) -> &str {
        &self.owner
    }
    /// The lease table's name.
    pub fn lease_table(&self) -> &str {
        &self.lease_table
    }
    /// How `run` hands a shard's records to the service.
    pub fn concurrency(&self) -> Concurrency {
        self.concurrency
    }
    /// The most handler calls in flight at once over all shards of this worker, with
    /// per-key or unordered concurrency.
    pub fn max_concurrent_calls(&self) -> usize {
        self.max_concurrent_calls
    }
    /// The enhanced fan-out consumer's name, when shards are read through fan-out.
    pub fn fan_out_consumer(&self) -> Option<&str> {
        self.fan_out.as_deref()
    }
    /// Whether the consumer reads a table's DynamoDB stream
    /// ([`ConsumerBuilder::table_stream`], [`ConsumerBuilder::table_stream_arn`]).
    pub fn is_table_stream(&self) -> bool {
        self.table_stream.is_some()
    }
}

/// Builds a [`Consumer`](super::Consumer). `stream` (or `streams`/`streams_from`, or a
/// table's stream: `table_stream`/`table_stream_arn`), `group` and `backend` are required
/// (for local development say `.backend(Memory::new())`).
pub struct ConsumerBuilder {
    stream: Option<String>,
    streams: Option<Vec<String>>,
    streams_from: Option<watch::Receiver<Vec<String>>>,
    table_stream: Option<String>,
    table_stream_arn: Option<String>,
    group: Option<String>,
    worker_id: Option<String>,
    lease_table: Option<String>,
    initial_position: InitialPosition,
    max_records_per_read: Option<u32>,
    idle_read_interval: Duration,
    fan_out: Option<String>,
    prefetch_batches: usize,
    read_ahead_bytes: u64,
    checkpoint: CheckpointPolicy,
    lease_duration: Duration,
    renew_interval: Option<Duration>,
    take_interval: Option<Duration>,
    shard_sync_interval: Duration,
    max_steals_per_round: usize,
    handoff_timeout: Option<Duration>,
    balance_by: BalanceBy,
    balance_tolerance: f64,
    retry_min: Duration,
    retry_max: Duration,
    shutdown_timeout: Duration,
    stuck_after: Duration,
    lease_call_timeout: Option<Duration>,
    read_call_timeout: Duration,
    seed: Option<u64>,
    owner_nonce: Option<String>,
    on_event: Option<OnEvent>,
    concurrency: Concurrency,
    max_concurrent_calls: usize,
    header_format: HeaderFormat,
    misplaced_user_records: MisplacedUserRecords,
    wall_clock: WallClock,
    pub(crate) backend: Option<Arc<dyn Backend>>,
}

impl Default for ConsumerBuilder {
    fn default() -> Self {
        ConsumerBuilder {
            stream: None,
            streams: None,
            streams_from: None,
            table_stream: None,
            table_stream_arn: None,
            group: None,
            worker_id: None,
            lease_table: None,
            initial_position: InitialPosition::default(),
            max_records_per_read: None,
            idle_read_interval: DEFAULT_IDLE_READ_INTERVAL,
            fan_out: None,
            prefetch_batches: 2,
            read_ahead_bytes: DEFAULT_READ_AHEAD_BYTES,
            checkpoint: CheckpointPolicy::default(),
            lease_duration: Duration::from_secs(10),
            renew_interval: None,
            take_interval: None,
            shard_sync_interval: Duration::from_secs(60),
            max_steals_per_round: usize::MAX,
            handoff_timeout: None,
            balance_by: BalanceBy::default(),
            balance_tolerance: DEFAULT_BALANCE_TOLERANCE,
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(30),
            stuck_after: DEFAULT_STUCK_AFTER,
            lease_call_timeout: None,
            read_call_timeout: Duration::from_secs(10),
            seed: None,
            owner_nonce: None,
            on_event: None,
            concurrency: Concurrency::Sequential,
            max_concurrent_calls: 1_024,
            header_format: HeaderFormat::Auto,
            misplaced_user_records: MisplacedUserRecords::Deliver,
            wall_clock: WallClock::default(),
            backend: None,
        }
    }
}

impl ConsumerBuilder {
    /// The Kinesis stream to consume (required, unless the consumer reads several
    /// streams or a table's stream).
    pub fn stream(mut self, name: impl Into<String>) -> Self {
        self.stream = Some(name.into());
        self
    }

    /// Reads the DynamoDB stream of table `table` instead of a Kinesis stream: each
    /// message carries one change (see [`crate::dynamodb_streams`]), keyed by the item's
    /// keys so that per-key order is per-item order. The table's current stream ARN
    /// (DescribeTable's `LatestStreamArn`) is resolved when the consumer starts, through
    /// the backend's [`Backend::table_streams`]; a table without a stream stops the
    /// consumer with [`KinesisError::NotFound`](crate::kinesis::KinesisError::NotFound).
    /// The group's leases are keyed by shard id, as for a single Kinesis stream, and the
    /// stream the group reads is the ARN. Enhanced fan-out does not exist for table
    /// streams (refused by `build`, field `fan_out`); reads take at most 1,000 records.
    pub fn table_stream(mut self, table: impl Into<String>) -> Self {
        self.table_stream = Some(table.into());
        self
    }

    /// Like [`ConsumerBuilder::table_stream`], with the stream given by its ARN
    /// (`arn:aws:dynamodb:<region>:<account>:table/<table>/stream/<label>`): the consumer
    /// keeps reading that stream even after the table's stream was disabled and enabled
    /// again (which gives the table a new stream, and a new ARN).
    pub fn table_stream_arn(mut self, arn: impl Into<String>) -> Self {
        self.table_stream_arn = Some(arn.into());
        self
    }

    /// Several streams (names or ARNs) consumed by one group through one lease table
    /// (multi-stream mode, instead of [`ConsumerBuilder::stream`]). Each stream's shards
    /// are leased, balanced over the group's workers, handed off, resharded and
    /// checkpointed exactly as a single stream's; rows are keyed the KCL's multi-stream
    /// way (`account:stream:creationEpoch:shardId`), so a KCL multi-stream table is read
    /// and written as the KCL does. A stream that was deleted and created again has a
    /// new creation time: it starts afresh at the initial position once the old
    /// stream's rows are all finished, and is refused with
    /// [`ConsumerError::StreamCreatedAgain`](super::ConsumerError::StreamCreatedAgain)
    /// while some are not. An ARN names a stream of the backend's own account and
    /// region. Messages, events
    /// and health name the stream (events and health as `stream/shardId`).
    ///
    /// A table of a single-stream consumer is refused (and the other way round) with
    /// [`ConsumerError::TableModeMismatch`](super::ConsumerError::TableModeMismatch).
    pub fn streams<I, S>(mut self, streams: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.streams = Some(streams.into_iter().map(Into::into).collect());
        self
    }

    /// Multi-stream mode with a list that can change while the consumer runs: the
    /// consumer follows the receiver's value (names or ARNs; an invalid one is logged
    /// and left out). A stream that fails (say, it does not exist yet) is logged and
    /// left out until the list changes, while the others go on; a lease table of the
    /// other mode or of another stream stops the consumer as with a fixed list. An
    /// added stream starts at the initial position, or where its
    /// rows say if the group read it before. A removed stream is drained, checkpointed
    /// and its leases released, as at shutdown; its rows (and checkpoints) are kept, so
    /// adding it again continues where it left off. The list is this worker's: give
    /// every worker of the group the same list (a removed stream's leases are otherwise
    /// taken by the workers that still read it).
    pub fn streams_from(mut self, streams: watch::Receiver<Vec<String>>) -> Self {
        self.streams_from = Some(streams);
        self
    }

    /// The consumer group (required): instances with the same group share the shards.
    pub fn group(mut self, name: impl Into<String>) -> Self {
        self.group = Some(name.into());
        self
    }

    /// This worker's unique id in the group (default: a random id with the process id).
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.worker_id = Some(id.into());
        self
    }

    /// The lease table (default: the group's name, like the KCL's application name).
    pub fn lease_table(mut self, name: impl Into<String>) -> Self {
        self.lease_table = Some(name.into());
        self
    }

    /// Where to start on shards without a checkpoint (default: trim horizon).
    pub fn initial_position(mut self, position: InitialPosition) -> Self {
        self.initial_position = position;
        self
    }

    /// Records per GetRecords call, 1..=10000 (default 10000); for a table's stream
    /// 1..=1000 (default 1000, the most DynamoDB Streams returns).
    pub fn max_records_per_read(mut self, n: u32) -> Self {
        self.max_records_per_read = Some(n);
        self
    }

    /// The pause before reading again once a shard is caught up: the last read was not
    /// full and Kinesis reported it 0 ms behind the tip (default 1 s,
    /// [`DEFAULT_IDLE_READ_INTERVAL`]). A shard that is behind is read again at once.
    pub fn idle_read_interval(mut self, d: Duration) -> Self {
        self.idle_read_interval = d;
        self
    }

    /// Reads shards through enhanced fan-out as the stream consumer `consumer_name`
    /// instead of polling GetRecords (the default). The consumer is registered (or
    /// found) when the worker starts, and every shard gets its own push subscription
    /// (SubscribeToShard), renewed before its five-minute limit from where the last one
    /// left off. Checkpoints, leases, hand-offs and handlers work as with polling; the
    /// polling settings (`max_records_per_read`, `idle_read_interval`) then do not apply.
    ///
    /// Use one consumer name per consumer group: workers of a group share it, each
    /// subscribing only to the shards it holds. A name is 1-128 of `a-z A-Z 0-9 _ . -`.
    /// A backend without fan-out refuses to start with
    /// [`KinesisError::Unsupported`](crate::kinesis::KinesisError::Unsupported).
    pub fn fan_out(mut self, consumer_name: impl Into<String>) -> Self {
        self.fan_out = Some(consumer_name.into());
        self
    }

    /// Batches read ahead per shard while the handler works (default 2, at least 1).
    pub fn prefetch_batches(mut self, n: usize) -> Self {
        self.prefetch_batches = n;
        self
    }

    /// The most bytes this worker holds read from Kinesis and not yet handled, over all
    /// its shards (default 64 MiB, [`DEFAULT_READ_AHEAD_BYTES`]; at least 1 KiB). A read
    /// counts its payloads and partition keys plus a small fixed amount per record, from
    /// when it is handed out until its batch is acknowledged or given up (a batch
    /// dropped unacknowledged, e.g. after its lease was lost, gives its share back too).
    ///
    /// When the budget is used up, shard readers wait before reading, and a read that
    /// does not fit waits before it is handed out: nothing is dropped, the backlog stays
    /// in Kinesis. A read larger than the whole budget still proceeds, alone. So a worker
    /// holds at most the budget in handed-out batches, plus, while it waits, at most one
    /// read per shard. `prefetch_batches` still bounds each shard; this bounds the sum.
    ///
    /// In `stream()` mode, acknowledge batches (or drop them): a consumer that holds
    /// more unacknowledged batches than the budget while waiting for the next one waits
    /// for ever.
    pub fn read_ahead_bytes(mut self, bytes: u64) -> Self {
        self.read_ahead_bytes = bytes;
        self
    }

    /// When checkpoints are written (default: at most every 5 s,
    /// [`DEFAULT_CHECKPOINT_INTERVAL`]; never while the watermark stands still).
    pub fn checkpoint(mut self, policy: CheckpointPolicy) -> Self {
        self.checkpoint = policy;
        self
    }

    /// How long a lease lives without renewal before others may take it (default 10 s).
    pub fn lease_duration(mut self, d: Duration) -> Self {
        self.lease_duration = d;
        self
    }

    /// How often held leases are renewed (default: a third of the lease duration; at
    /// most half of it).
    pub fn renew_interval(mut self, d: Duration) -> Self {
        self.renew_interval = Some(d);
        self
    }

    /// How often the worker looks for leases to take or steal (default: the lease duration).
    pub fn take_interval(mut self, d: Duration) -> Self {
        self.take_interval = Some(d);
        self
    }

    /// How often ListShards runs to find new shards (default 60 s; also right after a
    /// shard ends).
    pub fn shard_sync_interval(mut self, d: Duration) -> Self {
        self.shard_sync_interval = d;
        self
    }

    /// The most hand-off requests a worker below its quota makes in one round
    /// (default: no limit beyond the leases the shared balancing plan deals to it, so a
    /// fleet started together or a new worker is balanced within a round or two; the
    /// KCL's default is one per round).
    pub fn max_steals_per_round(mut self, n: usize) -> Self {
        self.max_steals_per_round = n;
        self
    }

    /// What the group's balancing evens out between workers: lease counts (the default)
    /// or their measured throughput ([`BalanceBy`]; see docs/groups.md for the choice).
    /// Every worker of a group should use the same setting: the plan is computed by
    /// each from the same listing.
    pub fn balance_by(mut self, by: BalanceBy) -> Self {
        self.balance_by = by;
        self
    }

    /// With [`BalanceBy::Throughput`]: how far above the mean load a worker may be
    /// before leases move away from it, as a fraction of the mean (default 0.10, i.e.
    /// 10 %; accepted from 0.02 to 1.0). A smaller band evens out more closely and
    /// moves more leases.
    pub fn balance_tolerance(mut self, fraction: f64) -> Self {
        self.balance_tolerance = fraction;
        self
    }

    /// How long a requested hand-off may take before the lease is taken anyway
    /// (default: the shutdown timeout plus the lease duration). It must be at least the
    /// shutdown timeout plus the renew interval, the longest an owner may take to see the
    /// request and drain; a shorter value is refused, so a new owner never starts on a
    /// shard the old one still drains.
    pub fn handoff_timeout(mut self, d: Duration) -> Self {
        self.handoff_timeout = Some(d);
        self
    }

    /// Backoff bounds after throttling, service errors and handler failures
    /// (default 100 ms to 10 s, with jitter).
    pub fn retry_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.retry_min = min;
        self.retry_max = max;
        self
    }

    /// How long shutdown (and a hand-off) waits for in-flight handlers before releasing
    /// anyway (default 30 s).
    pub fn shutdown_timeout(mut self, d: Duration) -> Self {
        self.shutdown_timeout = d;
        self
    }

    /// How long a shard may have records handed out (delivered to a handler, queued for
    /// one, or given to a `stream()` user and not acknowledged) with none of them handled
    /// before it is stuck (default [`DEFAULT_STUCK_AFTER`], at most
    /// [`MAX_STUCK_AFTER`]). A stuck shard shows in
    /// [`ShardHealth::stuck_for`](super::ShardHealth::stuck_for), makes the worker not
    /// ready, sends [`ShardEvent::Stuck`](super::ShardEvent::Stuck) once, and counts in
    /// the `shardflow_shards_stuck` gauge, until a record is handled again
    /// ([`ShardEvent::Unstuck`](super::ShardEvent::Unstuck)). A busy shard whose records
    /// are handled slowly is not stuck: one handled record is progress (with
    /// `run_batches` and `stream()`, one acknowledged batch; with concurrent dispatch, the
    /// oldest unfinished record moving on), so this must be longer than the longest
    /// single call (or batch) a healthy handler takes, retries included.
    pub fn stuck_after(mut self, d: Duration) -> Self {
        self.stuck_after = d;
        self
    }

    /// The deadline of every lease table call (renewal, checkpoint, take, list, ...),
    /// whatever the backend (default: half the renewal margin, `(lease_duration -
    /// renew_interval) / 2`; must be shorter than that margin). Renewals run concurrently
    /// and each has its own deadline, so one hung call never costs the worker its other
    /// leases. A call past its deadline is [`LeaseError::TimedOut`](crate::lease::LeaseError::TimedOut):
    /// its outcome is unknown, and a renewal that landed anyway is adopted by the next one.
    pub fn lease_call_timeout(mut self, d: Duration) -> Self {
        self.lease_call_timeout = Some(d);
        self
    }

    /// The deadline of each call a shard reader makes (GetShardIterator, GetRecords,
    /// ListShards, the start of a SubscribeToShard; not the subscription's events)
    /// (default 10 s). A call past it is abandoned and retried with backoff from the last
    /// delivered record, so one hung call cannot stall a shard for ever. An enhanced
    /// fan-out subscription that sends no event for three times this (Kinesis sends a
    /// heartbeat at least every 5 s) is taken as hung and renewed.
    pub fn read_call_timeout(mut self, d: Duration) -> Self {
        self.read_call_timeout = d;
        self
    }

    /// How [`Consumer::run`](super::Consumer::run) calls the service inside a shard
    /// (default [`Concurrency::Sequential`]: one record at a time). With
    /// [`Concurrency::PerKey`]`(n)` records of one partition key are handled in sequence
    /// order and different keys concurrently, at most `n` calls in flight per shard;
    /// [`Concurrency::Unordered`]`(n)` drops the per-key order. `n` is 1..=10000.
    ///
    /// - The checkpoint stays the contiguous low-watermark: it passes a record only
    ///   once it and every earlier record of the shard are handled, however many later
    ///   ones finished first.
    /// - Each call is made on a clone of the service, after `ServiceExt::ready` on that
    ///   clone, so a service's readiness (a concurrency limit, a buffer) is honoured. The
    ///   calls of a shard run concurrently on its dispatch task (like `buffer_unordered`),
    ///   shards in parallel.
    /// - All shards of the worker together make at most
    ///   [`max_concurrent_calls`](Self::max_concurrent_calls) calls at once.
    /// - Memory stays bounded: a shard works at most about `4 * n` records past its
    ///   checkpoint. It takes a new batch (one read) only while the batches it has not
    ///   fully handled hold fewer than `4 * n` records, so a hot key or a record that
    ///   takes long holds the other keys up once the shard is that far past it; the
    ///   reader then waits as it does for a slow sequential handler (`prefetch_batches`).
    /// - A failed record stops the shard from starting anything new; the calls in flight
    ///   finish, then the shard reads again from its checkpoint after a backoff. Records
    ///   that finished beyond the checkpoint (after an unfinished or failed one) are
    ///   delivered again, as are records in flight when a worker crashes: at-least-once,
    ///   with at most `4 * n` plus one read's records delivered again per shard and
    ///   failure.
    /// - A drain (shutdown, hand-off) stops taking records from the batches and
    ///   finishes the ones already taken (at most `4 * n`), as sequential mode finishes
    ///   its record in flight: the checkpoint then reaches the last of them and the next
    ///   owner gets no duplicates. A lost lease or a restart starts nothing more.
    ///
    /// It applies to `run` only: `run_batches` and `stream` hand out whole batches.
    pub fn concurrency(mut self, concurrency: Concurrency) -> Self {
        self.concurrency = concurrency;
        self
    }

    /// The most handler calls in flight at once over all shards of this worker, with
    /// [`Concurrency::PerKey`] or [`Concurrency::Unordered`] (default 1024), so that 200
    /// shards at `PerKey(64)` do not start 12,800 calls. Calls beyond it wait for a free
    /// place (first come, first served). Sequential mode makes one call per shard and
    /// does not count against it.
    pub fn max_concurrent_calls(mut self, n: usize) -> Self {
        self.max_concurrent_calls = n;
        self
    }

    /// Which header framings the consumer recognises in the records it reads (default
    /// [`HeaderFormat::Auto`]: what Spring's maintained Kinesis binder reads by default,
    /// the JSON-headers framing with a typed header map and the whole-message document;
    /// [`HeaderFormat::SpringJsonAndLegacy`] adds the legacy `0xff` framing of binders
    /// 1.x-3.x; [`HeaderFormat::None`] for a stream of binary or foreign records). See
    /// [`headers::spring`](crate::headers::spring) for which records each unwraps, and why.
    ///
    /// Recognition happens where a record becomes a [`Message`](crate::message::Message), before
    /// anything else sees it, so `stream()`, `run` and every layer (a decode layer
    /// reading `contentType`, a dedup key, a dead-letter sink) see the same headers and
    /// the bare payload. A record that is not an envelope (its framing does not add up
    /// exactly, or its JSON does not parse) is delivered unchanged with no headers; a
    /// truncated envelope is therefore delivered raw, framing included, as Spring
    /// delivers it. The check costs a few comparisons for a record that is not an
    /// envelope (see `BENCHMARKS.md`).
    pub fn header_format(mut self, format: HeaderFormat) -> Self {
        self.header_format = format;
        self
    }

    /// What the consumer does with KPL user records read from a shard that does not own
    /// their hash key, found in aggregates packed from a stale shard map around a
    /// reshard (default [`MisplacedUserRecords::Deliver`]: deliver them, lose nothing
    /// whatever the producer does). [`MisplacedUserRecords::SkipAggregate`] is what the
    /// KCL does, exactly once with shardflow's producer, which sends such an aggregate's
    /// records again packed for their own shards. The shard's hash-key range comes from
    /// the consumer's shard listing or from the lease row; a shard whose range is known
    /// from neither (a KCL row without one, on a worker that has not listed it) is read
    /// unfiltered.
    pub fn misplaced_user_records(mut self, choice: MisplacedUserRecords) -> Self {
        self.misplaced_user_records = choice;
        self
    }

    /// Seeds the jitter of backoffs (default: random), for reproducible simulations. The
    /// nonce of this incarnation's owner name is never drawn from this seed (see
    /// [`Config::owner`]); a simulation names it with [`ConsumerBuilder::owner_nonce`].
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// The nonce of this incarnation's owner name (default: six base-36 characters from
    /// the operating system's generator; see [`Config::owner`]): 1 to 16 ASCII letters
    /// and digits. For simulations that must replay a history exactly, which draw each
    /// incarnation's nonce from their own seeded generator. Every incarnation of a
    /// worker id needs a nonce of its own: two processes with one owner name would both
    /// read and checkpoint the same shards.
    ///
    /// ```
    /// # use shardflow::{Consumer, Memory};
    /// let consumer = Consumer::builder()
    ///     .stream("orders")
    ///     .group("billing")
    ///     .worker_id("billing-7")
    ///     .backend(Memory::new())
    ///     .owner_nonce("sim0042")
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(consumer.config().owner(), "billing-7#sim0042");
    /// ```
    pub fn owner_nonce(mut self, nonce: impl Into<String>) -> Self {
        self.owner_nonce = Some(nonce.into());
        self
    }

    /// The wall clock this worker reads for the time of day (default: the system
    /// clock). Only [`InitialPosition::Latest`] reads it, for the first guess of "now"
    /// that Kinesis then confirms (a guess later than Kinesis' own clock is moved back
    /// until Kinesis accepts it), so a host whose clock is wrong cannot skip records.
    /// Tests and simulations set it to play a host whose clock is off:
    ///
    /// ```
    /// # use std::time::{Duration, SystemTime};
    /// # use shardflow::{Consumer, Memory};
    /// let consumer = Consumer::builder()
    ///     .stream("orders")
    ///     .group("billing")
    ///     .backend(Memory::new())
    ///     .wall_clock(|| SystemTime::now() + Duration::from_secs(60))
    ///     .build();
    /// assert!(consumer.is_ok());
    /// ```
    pub fn wall_clock(mut self, clock: impl Fn() -> SystemTime + Send + Sync + 'static) -> Self {
        self.wall_clock = WallClock::new(clock);
        self
    }

    /// Calls `hook` with what happens to this worker's shards: leases taken, lost,
    /// handed off and released, shards ended, handler failures (see [`ShardEvent`]).
    /// The hook runs on the worker's tasks: keep it quick, it must not block.
    ///
    /// ```
    /// # use shardflow::{Consumer, Memory, ShardEvent};
    /// let consumer = Consumer::builder()
    ///     .stream("orders")
    ///     .group("billing")
    ///     .backend(Memory::new())
    ///     .on_event(|event| {
    ///         if let ShardEvent::LeaseLost { shard } = event {
    ///             eprintln!("lost {shard}");
    ///         }
    ///     })
    ///     .build();
    /// assert!(consumer.is_ok());
    /// ```
    pub fn on_event(mut self, hook: impl Fn(&ShardEvent) + Send + Sync + 'static) -> Self {
        self.on_event = Some(OnEvent::new(hook));
        self
    }

    /// The backend, required: [`Aws`](crate::backend::Aws), or [`Memory`](crate::memory::Memory) for local development
    /// and tests. `build` refuses a builder without one.
    pub fn backend(mut self, backend: impl Backend) -> Self {
        self.backend = Some(Arc::new(backend));
        self
    }

    /// Validates the configuration.
    pub(crate) fn validate(&self) -> Result<Config, ConfigError> {
        fn name(field: &'static str, value: &Option<String>) -> Result<String, ConfigError> {
            let v = value.clone().ok_or(ConfigError::Missing { field })?;
            if v.trim().is_empty() {
                return Err(ConfigError::Invalid {
                    field,
                    reason: "must not be empty".into(),
                });
            }
            Ok(v)
        }
        fn positive(field: &'static str, d: Duration) -> Result<Duration, ConfigError> {
            if d.is_zero() {
                return Err(ConfigError::Invalid {
                    field,
                    reason: "must be greater than zero".into(),
                });
            }
            // Far beyond any sensible setting, and small enough that deadlines computed
            // from it never overflow.
            if d > MAX_DURATION {
                return Err(ConfigError::Invalid {
                    field,
                    reason: format!("{d:?} is longer than the limit of {MAX_DURATION:?}"),
                });
            }
            Ok(d)
        }
        let table_stream = match (&self.table_stream, &self.table_stream_arn) {
            (None, None) => None,
            (Some(_), Some(_)) => return Err(ConfigError::Invalid {
                field: "table_stream_arn",
                reason:
                    "set either table_stream (a table) or table_stream_arn (a stream ARN), not both"
                        .into(),
            }),
            (Some(table), None) => {
                if !is_table_name(table) {
                    return Err(ConfigError::Invalid {
                        field: "table_stream",
                        reason: format!(
                            "{table:?} is not a DynamoDB table name (3-255 of a-z A-Z 0-9 _ . -)"
                        ),
                    });
                }
                Some((table.clone(), TableStream::Table(table.clone())))
            }
            (None, Some(arn)) => {
                if !is_table_stream_arn(arn) {
                    return Err(ConfigError::Invalid {
                        field: "table_stream_arn",
                        reason: format!(
                            "{arn:?} is not a DynamoDB stream ARN (arn:aws:dynamodb:<region>:<account>:table/<table>/stream/<label>)"
                        ),
                    });
                }
                Some((arn.clone(), TableStream::Arn))
            }
        };
        if let Some((_, which)) = &table_stream {
            let field = match which {
                TableStream::Table(_) => "table_stream",
                TableStream::Arn => "table_stream_arn",
            };
            if self.stream.is_some() || self.streams.is_some() || self.streams_from.is_some() {
                return Err(ConfigError::Invalid {
                    field,
                    reason: "a consumer reads either a table's stream or Kinesis streams (stream, streams, streams_from), not both".into(),
                });
            }
            if self.fan_out.is_some() {
                return Err(ConfigError::Invalid {
                    field: "fan_out",
                    reason: "DynamoDB Streams has no enhanced fan-out: a table's stream is always polled".into(),
                });
            }
        }
        let max_records_per_read = match (&table_stream, self.max_records_per_read) {
            (None, n) => n.unwrap_or(10_000),
            (Some(_), None) => MAX_TABLE_STREAM_RECORDS_PER_READ,
            (Some(_), Some(n)) if n > MAX_TABLE_STREAM_RECORDS_PER_READ => {
                return Err(ConfigError::Invalid {
                    field: "max_records_per_read",
                    reason: format!(
                        "{n} is more than the {MAX_TABLE_STREAM_RECORDS_PER_READ} records a DynamoDB Streams read returns"
                    ),
                })
            }
            (Some(_), Some(n)) => n,
        };
        let (stream, streams) = match (&self.stream, &self.streams, &self.streams_from) {
            _ if table_stream.is_some() => (
                table_stream
                    .as_ref()
                    .map(|(s, _)| s.clone())
                    .unwrap_or_default(),
                None,
            ),
            (Some(_), None, None) => (stream_name("stream", &name("stream", &self.stream)?)?, None),
            (None, Some(list), None) => {
                if list.is_empty() {
                    return Err(ConfigError::Invalid {
                        field: "streams",
                        reason: "must name at least one stream".into(),
                    });
                }
                let mut names: Vec<String> = Vec::with_capacity(list.len());
                for given in list {
                    let name = stream_name("streams", given)?;
                    if names.contains(&name) {
                        return Err(ConfigError::Invalid {
                            field: "streams",
                            reason: format!("{name:?} is listed twice"),
                        });
                    }
                    names.push(name);
                }
                (String::new(), Some(StreamList::Fixed(names)))
            }
            (None, None, Some(rx)) => (String::new(), Some(StreamList::Watched(rx.clone()))),
            (None, None, None) => return Err(ConfigError::Missing { field: "stream" }),
            (Some(_), _, _) => {
                return Err(ConfigError::Invalid {
                    field: "streams",
                    reason:
                        "set either stream (one stream) or streams/streams_from (several), not both"
                            .into(),
                })
            }
            (None, Some(_), Some(_)) => return Err(ConfigError::Invalid {
                field: "streams_from",
                reason:
                    "set either streams (a fixed list) or streams_from (a changing one), not both"
                        .into(),
            }),
        };
        let group = name("group", &self.group)?;
        let lease_table = match &self.lease_table {
            Some(_) => name("lease_table", &self.lease_table)?,
            None => group.clone(),
        };
        if lease_table.len() < 3
            || lease_table.len() > 255
            || !lease_table
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
        {
            return Err(ConfigError::Invalid {
                field: "lease_table",
                reason: format!("{lease_table:?} is not a DynamoDB table name (3-255 of a-z A-Z 0-9 _ . -); set lease_table explicitly"),
            });
        }
        let fan_out = match &self.fan_out {
            Some(_) => {
                let consumer_name = name("fan_out", &self.fan_out)?;
                if consumer_name.len() > 128
                    || !consumer_name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
                {
                    return Err(ConfigError::Invalid {
                        field: "fan_out",
                        reason: format!(
                            "{consumer_name:?} is not a stream consumer name (1-128 of a-z A-Z 0-9 _ . -)"
                        ),
                    });
                }
                Some(consumer_name)
            }
            None => None,
        };
        let worker_id = match &self.worker_id {
            Some(_) => name("worker_id", &self.worker_id)?,
            None => format!("{}-{:08x}", std::process::id(), rand::random::<u32>()),
        };
        if !(1..=10_000).contains(&max_records_per_read) {
            return Err(ConfigError::Invalid {
                field: "max_records_per_read",
                reason: format!("{max_records_per_read} is outside 1..=10000"),
            });
        }
        if !(1..=MAX_PREFETCH).contains(&self.prefetch_batches) {
            return Err(ConfigError::Invalid {
                field: "prefetch_batches",
                reason: format!("{} is outside 1..={MAX_PREFETCH}", self.prefetch_batches),
            });
        }
        if !(1024..=MAX_READ_AHEAD_BYTES).contains(&self.read_ahead_bytes) {
            return Err(ConfigError::Invalid {
                field: "read_ahead_bytes",
                reason: format!(
                    "{} is outside 1024..={MAX_READ_AHEAD_BYTES}",
                    self.read_ahead_bytes
                ),
            });
        }
        if let CheckpointPolicy::Interval(d) = self.checkpoint {
            positive("checkpoint", d)?;
        }
        let lease_duration = positive("lease_duration", self.lease_duration)?;
        let renew_interval = positive(
            "renew_interval",
            self.renew_interval.unwrap_or(lease_duration / 3),
        )?;
        if renew_interval * 2 > lease_duration {
            return Err(ConfigError::Invalid {
                field: "renew_interval",
                reason: format!(
                    "{renew_interval:?} is more than half the lease duration {lease_duration:?}: one late renewal would lose the lease"
                ),
            });
        }
        let take_interval = positive(
            "take_interval",
            self.take_interval.unwrap_or(lease_duration),
        )?;
        // Renewals and checkpoints must answer (or be given up) well before a lease that
        // was not renewed looks expired to the others.
        let renewal_margin = lease_duration - renew_interval;
        let lease_call_timeout = positive(
            "lease_call_timeout",
            self.lease_call_timeout.unwrap_or(renewal_margin / 2),
        )?;
        if lease_call_timeout >= renewal_margin {
            return Err(ConfigError::Invalid {
                field: "lease_call_timeout",
                reason: format!(
                    "{lease_call_timeout:?} is not shorter than the renewal margin {renewal_margin:?} (lease_duration - renew_interval): a hung renewal would lose the lease"
                ),
            });
        }
        let retry_min = positive("retry_backoff", self.retry_min)?;
        if self.retry_max < retry_min {
            return Err(ConfigError::Invalid {
                field: "retry_backoff",
                reason: "max is smaller than min".into(),
            });
        }
        match self.concurrency {
            Concurrency::PerKey(n) | Concurrency::Unordered(n)
                if !(1..=MAX_CONCURRENCY).contains(&n) =>
            {
                return Err(ConfigError::Invalid {
                    field: "concurrency",
                    reason: format!("{n} calls per shard is outside 1..={MAX_CONCURRENCY}"),
                });
            }
            _ => {}
        }
        if !(1..=MAX_WORKER_CALLS).contains(&self.max_concurrent_calls) {
            return Err(ConfigError::Invalid {
                field: "max_concurrent_calls",
                reason: format!(
                    "{} is outside 1..={MAX_WORKER_CALLS}",
                    self.max_concurrent_calls
                ),
            });
        }
        let seed = self.seed.unwrap_or_else(rand::random);
        let owner = match &self.owner_nonce {
            None => crate::lease::incarnation(&worker_id),
            Some(nonce)
                if (1..=16).contains(&nonce.len())
                    && nonce.chars().all(|c| c.is_ascii_alphanumeric()) =>
            {
                format!("{worker_id}{}{nonce}", crate::lease::INCARNATION_SEPARATOR)
            }
            Some(nonce) => {
                return Err(ConfigError::Invalid {
                    field: "owner_nonce",
                    reason: format!("{nonce:?} is not 1 to 16 ASCII letters and digits"),
                })
            }
        };
        // The owner asked for a hand-off sees the request at its next renewal, then drains
        // for up to the shutdown timeout: a requester taking the lease sooner would read
        // the shard while the old owner still handles it.
        let shutdown_timeout = positive("shutdown_timeout", self.shutdown_timeout)?;
        let handoff_needs = shutdown_timeout.saturating_add(renew_interval);
        let handoff_timeout = match self.handoff_timeout {
            None => shutdown_timeout.saturating_add(lease_duration),
            Some(d) if d < handoff_needs => {
                return Err(ConfigError::Invalid {
                    field: "handoff_timeout",
                    reason: format!(
                        "{d:?} is shorter than the shutdown timeout plus the renew interval \
                         ({handoff_needs:?}): a new owner would start while the old one drains"
                    ),
                })
            }
            Some(d) => positive("handoff_timeout", d)?,
        };
        if !(0.02..=1.0).contains(&self.balance_tolerance) {
            return Err(ConfigError::Invalid {
                field: "balance_tolerance",
                reason: format!(
                    "{} is outside 0.02 to 1.0 (a fraction of the mean load)",
                    self.balance_tolerance
                ),
            });
        }
        let balance_limits = crate::consumer::balance::LoadLimits {
            tolerance: self.balance_tolerance,
            ..crate::consumer::balance::LoadLimits::DEFAULT
        };
        let stuck_after = positive("stuck_after", self.stuck_after)?;
        if stuck_after > MAX_STUCK_AFTER {
            return Err(ConfigError::Invalid {
                field: "stuck_after",
                reason: format!(
                    "{stuck_after:?} is longer than the limit of {MAX_STUCK_AFTER:?}: a shard \
                     that handles nothing for longer must be reported"
                ),
            });
        }
        Ok(Config {
            stream,
            streams,
            table_stream: table_stream.map(|(_, which)| which),
            group,
            owner,
            worker_id,
            lease_table,
            initial_position: self.initial_position.clone(),
            max_records_per_read,
            idle_read_interval: positive("idle_read_interval", self.idle_read_interval)?,
            fan_out,
            prefetch_batches: self.prefetch_batches,
            read_ahead_bytes: self.read_ahead_bytes,
            checkpoint: self.checkpoint.clone(),
            lease_duration,
            renew_interval,
            take_interval,
            shard_sync_interval: positive("shard_sync_interval", self.shard_sync_interval)?,
            max_steals_per_round: self.max_steals_per_round,
            handoff_timeout,
            balance_by: self.balance_by,
            balance_limits,
            retry_min,
            retry_max: positive("retry_backoff", self.retry_max)?,
            shutdown_timeout,
            stuck_after,
            lease_call_timeout,
            read_call_timeout: positive("read_call_timeout", self.read_call_timeout)?,
            seed,
            on_event: self.on_event.clone(),
            concurrency: self.concurrency,
            max_concurrent_calls: self.max_concurrent_calls,
            header_format: self.header_format,
            misplaced_user_records: self.misplaced_user_records,
            wall_clock: self.wall_clock.clone(),
        })
    }

    /// The backend, required: silently using an empty embedded one would make a
    /// misconfigured production consumer look healthy while reading nothing.
    pub(crate) fn take_backend(&mut self) -> Result<Arc<dyn Backend>, ConfigError> {
        self.backend
            .take()
            .ok_or(ConfigError::Missing { field: "backend" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> ConsumerBuilder {
        ConsumerBuilder::default().stream("orders").group("billing")
    }

    #[test]
    fn table_streams_refuse_what_they_cannot_do_naming_the_field() {
        let field = |b: ConsumerBuilder| match b.validate() {
            Err(ConfigError::Missing { field }) | Err(ConfigError::Invalid { field, .. }) => field,
            Ok(_) => "accepted",
        };
        let table = || {
            ConsumerBuilder::default()
                .table_stream("orders")
                .group("cdc")
        };
        let arn =
            "arn:aws:dynamodb:eu-west-1:123456789012:table/orders/stream/2026-01-01T00:00:00.000";
        let by_arn = || {
            ConsumerBuilder::default()
                .table_stream_arn(arn)
                .group("cdc")
        };
        assert_eq!(field(table()), "accepted");
        assert_eq!(field(by_arn()), "accepted");
        assert_eq!(field(table().fan_out("efo")), "fan_out");
        assert_eq!(field(by_arn().fan_out("efo")), "fan_out");
        assert_eq!(field(table().stream("orders")), "table_stream");
        assert_eq!(field(by_arn().streams(["a", "b"])), "table_stream_arn");
        assert_eq!(field(table().table_stream_arn(arn)), "table_stream_arn");
        assert_eq!(
            field(table().max_records_per_read(1_001)),
            "max_records_per_read"
        );
        assert_eq!(field(table().max_records_per_read(1_000)), "accepted");
        assert_eq!(
            field(ConsumerBuilder::default().table_stream("no").group("g")),
            "table_stream"
        );
        for bad in [
            "orders",
            "arn:aws:kinesis:eu-west-1:123456789012:stream/orders",
            "arn:aws:dynamodb:eu-west-1:123456789012:table/orders",
            "arn:aws:dynamodb:eu-west-1::table/orders/stream/x",
            "arn:aws:dynamodb:eu-west-1:123456789012:table/orders/stream/",
        ] {
            assert_eq!(
                field(ConsumerBuilder::default().table_stream_arn(bad).group("g")),
                "table_stream_arn",
                "{bad}"
            );
        }
        let c = table().validate().unwrap();
        assert_eq!(c.max_records_per_read, MAX_TABLE_STREAM_RECORDS_PER_READ);
        assert!(c.is_table_stream());
        assert_eq!(c.table_stream, Some(TableStream::Table("orders".into())));
        assert_eq!(by_arn().validate().unwrap().stream(), arn);
        // A Kinesis consumer keeps its default and its limit.
        assert_eq!(base().validate().unwrap().max_records_per_read, 10_000);
        assert!(!base().validate().unwrap().is_table_stream());
    }

    #[test]
    fn refuses_bad_values_naming_the_field() {
        let field = |b: ConsumerBuilder| match b.validate() {
            Err(ConfigError::Missing { field }) | Err(ConfigError::Invalid { field, .. }) => field,
            Ok(_) => "accepted",
        };
        assert_eq!(field(ConsumerBuilder::default().group("g1")), "stream");
        assert_eq!(field(ConsumerBuilder::default().stream("s")), "group");
        assert_eq!(field(base().stream("has space")), "stream");
        assert_eq!(
            field(base().max_records_per_read(0)),
            "max_records_per_read"
        );
        assert_eq!(
            field(base().max_records_per_read(10_001)),
            "max_records_per_read"
        );
        assert_eq!(
            field(base().lease_duration(Duration::ZERO)),
            "lease_duration"
        );
        assert_eq!(
            field(
                base()
                    .lease_duration(Duration::from_secs(10))
                    .renew_interval(Duration::from_secs(6))
            ),
            "renew_interval"
        );
        assert_eq!(field(base().owner_nonce("")), "owner_nonce");
        assert_eq!(field(base().owner_nonce("a#b")), "owner_nonce");
        assert_eq!(field(base().owner_nonce("x".repeat(17))), "owner_nonce");
        assert_eq!(field(base().owner_nonce("k3f9a2")), "accepted");
        assert_eq!(field(base().prefetch_batches(0)), "prefetch_batches");
        assert_eq!(field(base().read_ahead_bytes(1023)), "read_ahead_bytes");
        assert_eq!(field(base().read_ahead_bytes(u64::MAX)), "read_ahead_bytes");
        assert_eq!(field(base().read_ahead_bytes(1024)), "accepted");
        assert_eq!(
            field(base().prefetch_batches(usize::MAX)),
            "prefetch_batches"
        );
        assert_eq!(
            field(base().shutdown_timeout(Duration::MAX)),
            "shutdown_timeout"
        );
        assert_eq!(field(base().stuck_after(Duration::ZERO)), "stuck_after");
        assert_eq!(
            field(base().stuck_after(MAX_STUCK_AFTER + Duration::from_millis(1))),
            "stuck_after"
        );
        assert_eq!(field(base().stuck_after(MAX_STUCK_AFTER)), "accepted");
        assert_eq!(
            field(base().lease_duration(Duration::MAX)),
            "lease_duration"
        );
        assert_eq!(
            field(base().retry_backoff(Duration::from_millis(1), Duration::MAX)),
            "retry_backoff"
        );
        assert_eq!(
            field(base().checkpoint(CheckpointPolicy::Interval(Duration::ZERO))),
            "checkpoint"
        );
        assert_eq!(
            field(base().lease_call_timeout(Duration::ZERO)),
            "lease_call_timeout"
        );
        assert_eq!(
            field(base().lease_call_timeout(Duration::from_secs(60))),
            "lease_call_timeout"
        );
        assert_eq!(
            field(base().read_call_timeout(Duration::ZERO)),
            "read_call_timeout"
        );
        assert_eq!(
            field(base().read_call_timeout(Duration::MAX)),
            "read_call_timeout"
        );
        assert_eq!(field(base().group("ab")), "lease_table");
        assert_eq!(field(base().worker_id(" ")), "worker_id");
        assert_eq!(field(base().fan_out("")), "fan_out");
        assert_eq!(field(base().fan_out("has space")), "fan_out");
        assert_eq!(field(base().fan_out("x".repeat(129))), "fan_out");
        assert_eq!(field(base().fan_out("billing-efo_1.v2")), "accepted");
        assert_eq!(
            field(base().concurrency(Concurrency::PerKey(0))),
            "concurrency"
        );
        assert_eq!(
            field(base().concurrency(Concurrency::Unordered(10_001))),
            "concurrency"
        );
        assert_eq!(
            field(base().max_concurrent_calls(0)),
            "max_concurrent_calls"
        );
        assert_eq!(
            field(
                base()
                    .concurrency(Concurrency::PerKey(64))
                    .max_concurrent_calls(256)
            ),
            "accepted"
        );
        assert_eq!(field(base()), "accepted");
    }

    #[test]
    fn a_new_owner_never_starts_while_the_old_one_may_still_drain() {
        // The defaults: the hand-off waits out the drain of the old owner.
        let c = base().validate().unwrap();
        assert!(c.handoff_timeout >= c.shutdown_timeout + c.renew_interval);
        let c = base()
            .shutdown_timeout(Duration::from_secs(60))
            .validate()
            .unwrap();
        assert!(c.handoff_timeout >= c.shutdown_timeout + c.renew_interval);
        // An explicit hand-off timeout shorter than that is refused, naming the field.
        let refused = base()
            .lease_duration(Duration::from_secs(10))
            .shutdown_timeout(Duration::from_secs(30))
            .handoff_timeout(Duration::from_secs(10))
            .validate();
        assert!(
            matches!(
                refused,
                Err(ConfigError::Invalid {
                    field: "handoff_timeout",
                    ..
                })
            ),
            "{refused:?}"
        );
        assert!(base()
            .shutdown_timeout(Duration::from_secs(5))
            .handoff_timeout(Duration::from_secs(9))
            .validate()
            .is_ok());
    }

    #[test]
    fn a_consumer_without_a_backend_is_refused() {
        let refused = base().build().map(|_| ());
        assert_eq!(refused, Err(ConfigError::Missing { field: "backend" }));
    }

    #[test]
    fn defaults_follow_the_lease_duration() {
        let c = base()
            .lease_duration(Duration::from_secs(9))
            .validate()
            .unwrap();
        assert_eq!(c.renew_interval, Duration::from_secs(3));
        assert_eq!(c.take_interval, Duration::from_secs(9));
        assert_eq!(c.lease_call_timeout, Duration::from_secs(3));
        assert_eq!(c.lease_table, "billing");
        assert_eq!(c.fan_out_consumer(), None, "polling by default");
        assert_eq!(
            c.concurrency(),
            Concurrency::Sequential,
            "one record at a time"
        );
        assert_eq!(c.max_concurrent_calls(), 1_024);
    }
}
