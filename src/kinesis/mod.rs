//! Reading and writing Kinesis: the small [`KinesisApi`] trait the consumer and producer
//! use, its AWS implementation ([`aws::AwsKinesis`], on `aws-sdk-kinesis`), and the
//! value types that cross it. The embedded implementation is in [`crate::memory`].

pub mod aws;

use crate::error::ErrorDetail;
use std::fmt;
use std::pin::Pin;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::Stream;

use crate::sequence::SequenceNumber;

/// A shard as ListShards describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardInfo {
    /// The shard's id, e.g. `shardId-000000000003`.
    pub shard_id: String,
    /// The shard it was split from, or the first of the two it was merged from.
    pub parent_shard_id: Option<String>,
    /// The second parent of a merge.
    pub adjacent_parent_shard_id: Option<String>,
    /// The lowest hash key the shard owns.
    pub starting_hash_key: u128,
    /// The highest hash key the shard owns.
    pub ending_hash_key: u128,
    /// The first sequence number of the shard.
    pub starting_sequence_number: SequenceNumber,
    /// Set once the shard is closed (split or merged away).
    pub ending_sequence_number: Option<SequenceNumber>,
}

impl ShardInfo {
    /// The shard's parents (none, one for a split, two for a merge).
    pub fn parents(&self) -> Vec<String> {
        self.parent_shard_id
            .iter()
            .chain(self.adjacent_parent_shard_id.iter())
            .cloned()
            .collect()
    }

    /// Whether the shard is closed: no record will be added to it.
    pub fn is_closed(&self) -> bool {
        self.ending_sequence_number.is_some()
    }
}

/// A stream as the KCL's multi-stream mode names it: the account, the stream's name and
/// its creation time in epoch seconds, serialized `account:stream:creationEpoch` (the
/// prefix of every multi-stream lease key and the `streamName` attribute of its rows).
/// The creation time makes a deleted and re-created stream of the same name another
/// stream, with rows of its own.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamIdentity {
    /// The AWS account the stream belongs to (12 digits on AWS).
    pub account: String,
    /// The stream's name.
    pub name: String,
    /// When the stream was created, in seconds since the Unix epoch.
    pub creation_epoch: u64,
}

impl StreamIdentity {
    /// The identity DescribeStreamSummary gives: the account from the stream's ARN
    /// (`arn:aws:kinesis:<region>:<account>:stream/<name>`) and its creation time.
    pub fn from_description(
        name: &str,
        arn: &str,
        created: SystemTime,
    ) -> Result<Self, KinesisError> {
        let account = arn_account(arn).ok_or_else(|| {
            KinesisError::Invalid(format!("stream {name}: {arn:?} is not a stream ARN").into())
        })?;
        let creation_epoch = created
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Ok(StreamIdentity {
            account: account.to_owned(),
            name: name.to_owned(),
            creation_epoch,
        })
    }

    /// Parses `account:stream:creationEpoch` (the KCL's `StreamIdentifier` form: the
    /// account and epoch are digits, the name has no `:`).
    pub fn parse(serialized: &str) -> Option<Self> {
        let mut parts = serialized.split(':');
        let (account, name, epoch) = (parts.next()?, parts.next()?, parts.next()?);
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if parts.next().is_some() || !digits(account) || !digits(epoch) || name.is_empty() {
            return None;
        }
        Some(StreamIdentity {
            account: account.to_owned(),
            name: name.to_owned(),
            creation_epoch: epoch.parse().ok()?,
        })
    }

    /// The lease key of one of its shards: `account:stream:creationEpoch:shardId`.
    pub fn lease_key(&self, shard_id: &str) -> String {
        format!("{self}:{shard_id}")
    }

    /// Splits a multi-stream lease key into the stream and the shard id; `None` for a
    /// single-stream key (a bare shard id).
    pub fn split_lease_key(key: &str) -> Option<(Self, &str)> {
        let (stream, shard) = key.rsplit_once(':')?;
        Some((Self::parse(stream)?, shard))
    }
}

impl fmt::Display for StreamIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.account, self.name, self.creation_epoch)
    }
}

/// The account of a Kinesis stream ARN, `arn:<partition>:kinesis:<region>:<account>:stream/<name>`.
fn arn_account(arn: &str) -> Option<&str> {
    let mut parts = arn.splitn(6, ':');
    let (arn_tag, _partition, service, _region, account, resource) = (
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
    );
    (arn_tag == "arn"
        && service == "kinesis"
        && resource.starts_with("stream/")
        && !account.is_empty())
    .then_some(account)
}

/// The stream name in a Kinesis stream ARN (`...:stream/<name>`), `None` if `arn` is
/// not one.
pub fn stream_name_of_arn(arn: &str) -> Option<&str> {
    arn_account(arn)?;
    arn.rsplit_once(":stream/").map(|(_, name)| name)
}

/// Where one shard iterator (GetShardIterator, SubscribeToShard) starts: a request
/// parameter of the [`KinesisApi`] trait, for backends and tools.
///
/// Consumers do not use it: they say where a group starts with
/// [`crate::InitialPosition`], which the consumer resolves once into a durable start
/// in the lease row and then into a `StartingPosition` for every read (mostly
/// `AfterSequenceNumber` of the checkpoint).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StartingPosition {
    /// The oldest record still retained.
    TrimHorizon,
    /// Just after the newest record: only records written from now on.
    Latest,
    /// The first record that arrived at or after this time.
    AtTimestamp(SystemTime),
    /// The record with this sequence number.
    AtSequenceNumber(SequenceNumber),
    /// The record just after this sequence number.
    AfterSequenceNumber(SequenceNumber),
}

/// A record as GetRecords returns it.
#[derive(Clone, Debug)]
pub struct Record {
    /// The record's sequence number.
    pub sequence_number: SequenceNumber,
    /// The producer's partition key.
    pub partition_key: String,
    /// The payload.
    pub data: Bytes,
    /// When Kinesis accepted it (approximate).
    pub approximate_arrival: Option<SystemTime>,
}

/// One GetRecords answer.
#[derive(Clone, Debug, Default)]
pub struct RecordsPage {
    /// The records, in sequence order.
    pub records: Vec<Record>,
    /// Where to read next; `None` once a closed shard has been read to its end.
    pub next_iterator: Option<String>,
    /// How far behind the tip of the shard this read was.
    pub millis_behind_latest: Option<i64>,
    /// The shard's children, when the service reports them at the shard's end.
    pub child_shards: Vec<String>,
}

/// One event of an enhanced fan-out subscription (SubscribeToShard).
#[derive(Clone, Debug, Default)]
pub struct SubscriptionEvent {
    /// The records, in sequence order (may be empty: a heartbeat).
    pub records: Vec<Record>,
    /// Where to subscribe again (AFTER this sequence number) once the subscription ends;
    /// `None` once a closed shard has been delivered to its end.
    pub continuation: Option<SequenceNumber>,
    /// How far behind the tip of the shard this event was.
    pub millis_behind_latest: Option<i64>,
    /// The shard's children, reported at its end.
    pub child_shards: Vec<String>,
}

/// The events of one SubscribeToShard call. It ends (after about five minutes on AWS)
/// and is then renewed from the last continuation sequence number.
pub type Subscription = Pin<Box<dyn Stream<Item = Result<SubscriptionEvent, KinesisError>> + Send>>;

/// A record to write with PutRecords.
#[derive(Clone, Debug)]
pub struct PutRecord {
    /// The payload.
    pub data: Bytes,
    /// The partition key: decides the shard unless an explicit hash key is given.
    pub partition_key: String,
    /// A hash key (decimal, 0..2^128) that decides the shard instead of the partition key.
    pub explicit_hash_key: Option<String>,
}

/// What happened to one entry of a PutRecords call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PutOutcome {
    /// Stored: in this shard, at this sequence number.
    Stored {
        /// The shard that took the record.
        shard_id: String,
        /// Its sequence number.
        sequence_number: SequenceNumber,
    },
    /// Refused; the entry may be sent again.
    Failed {
        /// The service's error code, e.g. `ProvisionedThroughputExceededException`.
        code: String,
        /// The service's message.
        message: String,
    },
}

/// Errors of the Kinesis calls, classified by what the caller should do.
///
/// An error that came from an AWS call has what AWS answered (code, message, HTTP
/// status) as its [`source`](std::error::Error::source): an [`AwsError`](crate::AwsError).
#[derive(Debug)]
#[non_exhaustive]
pub enum KinesisError {
    /// Throttled (ProvisionedThroughputExceeded, LimitExceeded, KMS throttling): back off and retry.
    Throttled(ErrorDetail),
    /// The shard iterator expired (or is otherwise no longer valid): get a new one from
    /// the last delivered position.
    ExpiredIterator(ErrorDetail),
    /// The stream or shard does not exist.
    NotFound(ErrorDetail),
    /// The request was refused as invalid.
    Invalid(ErrorDetail),
    /// An `AT_TIMESTAMP` position later than the service's own clock: Kinesis refuses
    /// it (`InvalidArgumentException`: the timestamp "cannot be greater than the
    /// current timestamp"). The same request succeeds once that time has come; a
    /// refusal also proves that the clock which chose the time runs ahead of Kinesis'.
    FutureTimestamp(ErrorDetail),
    /// The backend does not offer this call (for example enhanced fan-out on an emulator).
    Unsupported(String),
    /// The caller is not allowed to make the call (`AccessDeniedException`: an IAM
    /// policy without it on that stream). Not transient: the consumer stops with it at
    /// start; a shard whose reads are refused fails and makes the worker not ready.
    AccessDenied(ErrorDetail),
    /// A network, service or other transient failure: retry with backoff.
    Other(ErrorDetail),
}

impl std::fmt::Display for KinesisError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KinesisError::Throttled(d) => write!(f, "throttled by Kinesis: {d}"),
            KinesisError::ExpiredIterator(d) => write!(f, "shard iterator expired: {d}"),
            KinesisError::NotFound(d) => write!(f, "not found: {d}"),
            KinesisError::Invalid(d) => write!(f, "invalid request: {d}"),
            KinesisError::FutureTimestamp(d) => {
                write!(f, "the timestamp is later than Kinesis' clock: {d}")
            }
            KinesisError::Unsupported(what) => write!(f, "not supported: {what}"),
            KinesisError::Other(d) => write!(f, "kinesis call failed: {d}"),
            KinesisError::AccessDenied(d) => write!(f, "access denied: {d}"),
        }
    }
}

impl std::error::Error for KinesisError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KinesisError::Throttled(d)
            | KinesisError::ExpiredIterator(d)
            | KinesisError::NotFound(d)
            | KinesisError::Invalid(d)
            | KinesisError::FutureTimestamp(d)
            | KinesisError::Other(d)
            | KinesisError::AccessDenied(d) => d.source(),
            KinesisError::Unsupported(_) => None,
        }
    }
}

impl KinesisError {
    /// Whether the same call may succeed later (throttling, network, service errors, a
    /// timestamp the service's clock has not reached yet).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            KinesisError::Throttled(_) | KinesisError::Other(_) | KinesisError::FutureTimestamp(_)
        )
    }
}

/// A stream's maximum record size unless it was raised, and the least any stream
/// accepts: data plus partition key, 1 MiB. A stream set for larger records
/// (`UpdateMaxRecordSize`) takes up to [`MAX_LARGE_RECORD_BYTES`]; see
/// [`KinesisApi::max_record_size`].
pub const MAX_RECORD_BYTES: usize = 1024 * 1024;

/// The largest maximum record size a stream can be set to (`UpdateMaxRecordSize`,
/// `MaxRecordSizeInKiB` up to 10,240): data plus partition key, 10 MiB.
pub const MAX_LARGE_RECORD_BYTES: usize = 10 * 1024 * 1024;

/// The most bytes (data plus partition keys) one PutRecords request carries: 10 MiB
/// since Kinesis takes records of up to 10 MiB, so that a record at the largest limit
/// goes in a call of its own. At most 500 records per request either way.
pub const MAX_PUT_RECORDS_BYTES: usize = 10 * 1024 * 1024;

/// The most records one PutRecords request carries.
pub const MAX_PUT_RECORDS_ENTRIES: usize = 500;

/// The longest partition key Kinesis accepts, in Unicode characters.
pub const MAX_PARTITION_KEY_CHARS: usize = 256;

/// The hash key Kinesis derives from a partition key (which shard a record goes to):
/// MD5 as a 128-bit big-endian number.
pub fn partition_hash(partition_key: &str) -> u128 {
    u128::from_be_bytes(md5::compute(partition_key.as_bytes()).0)
}

/// The Kinesis calls shardflow needs. Implemented by [`aws::AwsKinesis`] and
/// [`crate::memory::MemoryKinesis`].
#[async_trait]
pub trait KinesisApi: Send + Sync + 'static {
    /// Every shard of the stream, open and closed (still retained), with parents.
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError>;

    /// Whether the stream is being resharded (status UPDATING).
    async fn is_updating(&self, stream: &str) -> Result<bool, KinesisError>;

    /// The stream's identity (DescribeStreamSummary: its ARN's account and its
    /// creation time), which multi-stream lease keys carry. A backend that cannot tell
    /// (the default) refuses, and so cannot run a multi-stream consumer.
    async fn stream_identity(&self, stream: &str) -> Result<StreamIdentity, KinesisError> {
        let _ = stream;
        Err(KinesisError::Unsupported(
            "stream identity (multi-stream mode)".into(),
        ))
    }

    /// The largest record the stream accepts, in bytes of data plus partition key
    /// (DescribeStreamSummary's `MaxRecordSizeInKiB`, set with `UpdateMaxRecordSize`):
    /// [`MAX_RECORD_BYTES`] unless the stream was set for larger records, at most
    /// [`MAX_LARGE_RECORD_BYTES`]. A backend that cannot tell (the default) answers
    /// `Unsupported`; callers then take the default, [`MAX_RECORD_BYTES`], which every
    /// stream accepts.
    async fn max_record_size(&self, stream: &str) -> Result<usize, KinesisError> {
        let _ = stream;
        Err(KinesisError::Unsupported(
            "the stream's maximum record size".into(),
        ))
    }

    /// The ARN of the table's current stream (DescribeTable's `LatestStreamArn`); sources
    /// that are not table streams answer `Unsupported`. A table without a stream (or no
    /// such table) is `NotFound`.
    async fn resolve_table_stream(&self, table: &str) -> Result<String, KinesisError> {
        let _ = table;
        Err(KinesisError::Unsupported(
            "DynamoDB table streams (resolving a table's stream)".into(),
        ))
    }

    /// Whether records may be KPL-aggregated (false for table streams: never de-aggregate).
    fn records_may_be_aggregated(&self) -> bool {
        true
    }

    /// An iterator into a shard.
    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError>;

    /// Up to `limit` records from an iterator.
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError>;

    /// Writes records; the answer has one outcome per record, in order.
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError>;

    /// Registers (or finds) the enhanced fan-out consumer `name` on the stream, waits
    /// until it is ACTIVE and returns its ARN.
    async fn register_consumer(&self, stream: &str, name: &str) -> Result<String, KinesisError> {
        let _ = (stream, name);
        Err(KinesisError::Unsupported("enhanced fan-out".into()))
    }

    /// Subscribes to a shard through an enhanced fan-out consumer.
    async fn subscribe_to_shard(
        &self,
        consumer_arn: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<Subscription, KinesisError> {
        let _ = (consumer_arn, shard_id, from);
        Err(KinesisError::Unsupported("enhanced fan-out".into()))
    }
}

/// Stream administration on top of [`KinesisApi`]: creating streams and resharding them.
/// Examples, tests and operators' tools use it; the consumer and producer never do (they
/// need only [`KinesisApi`], the trait a wrapper or a new backend implements).
/// Implemented by [`aws::AwsKinesis`] and [`crate::memory::MemoryKinesis`];
/// [`crate::Backend::admin`] gives one.
#[async_trait]
pub trait StreamAdmin: KinesisApi {
    /// Creates a stream with `shards` shards and waits until it is active. Used by
    /// examples and tests; an existing stream is left as it is.
    async fn create_stream(&self, stream: &str, shards: u32) -> Result<(), KinesisError>;
    /// Splits a shard at `new_starting_hash_key`.
    async fn split_shard(
        &self,
        stream: &str,
        shard_id: &str,
        new_starting_hash_key: u128,
    ) -> Result<(), KinesisError>;
    /// Merges two adjacent shards.
    async fn merge_shards(
        &self,
        stream: &str,
        shard_id: &str,
        adjacent_shard_id: &str,
    ) -> Result<(), KinesisError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_identities_and_multi_stream_keys_parse_as_the_kcl_writes_them() {
        let id = StreamIdentity::parse("123456789012:orders:1700000000").unwrap();
        assert_eq!(
            (id.account.as_str(), id.name.as_str(), id.creation_epoch),
            ("123456789012", "orders", 1_700_000_000)
        );
        assert_eq!(id.to_string(), "123456789012:orders:1700000000");
        let key = id.lease_key("shardId-000000000001");
        assert_eq!(key, "123456789012:orders:1700000000:shardId-000000000001");
        assert_eq!(
            StreamIdentity::split_lease_key(&key),
            Some((id, "shardId-000000000001"))
        );
        for not_multi in [
            "shardId-000000000001",
            "orders:1700000000:shardId-000000000001",
            "acct:orders:1700000000:shardId-000000000001",
            "123456789012:orders:soon:shardId-000000000001",
            "123456789012::1700000000:shardId-000000000001",
        ] {
            assert_eq!(
                StreamIdentity::split_lease_key(not_multi),
                None,
                "{not_multi}"
            );
        }
    }

    #[test]
    fn stream_arns_give_the_account_and_name() {
        let arn = "arn:aws:kinesis:eu-west-1:123456789012:stream/orders";
        assert_eq!(stream_name_of_arn(arn), Some("orders"));
        assert_eq!(
            stream_name_of_arn("arn:aws-cn:kinesis:cn-north-1:123456789012:stream/a.b"),
            Some("a.b")
        );
        assert_eq!(stream_name_of_arn("orders"), None);
        assert_eq!(
            stream_name_of_arn("arn:aws:sqs:eu-west-1:123456789012:orders"),
            None
        );
        let created = SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_700_000_000_999);
        let id = StreamIdentity::from_description("orders", arn, created).unwrap();
        assert_eq!(id.to_string(), "123456789012:orders:1700000000");
        assert!(StreamIdentity::from_description("orders", "not an arn", created).is_err());
    }
}
