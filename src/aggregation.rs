//! KPL aggregation: splitting aggregated Kinesis records into their user records
//! ([`deaggregate`]) and packing user records into aggregated ones ([`Aggregator`]).
//!
//! # The format
//!
//! The Kinesis Producer Library (KPL), and the awslabs `kinesis-aggregation` libraries,
//! pack many small *user records* into one Kinesis record whose data is
//!
//! ```text
//! 0xF3 0x89 0x9A 0xC2 | protobuf AggregatedRecord | MD5 of the protobuf bytes (16 bytes)
//! ```
//!
//! with (proto2, as the KPL's `messages.proto` declares it)
//!
//! ```text
//! message AggregatedRecord { repeated string partition_key_table = 1;
//!                            repeated string explicit_hash_key_table = 2;
//!                            repeated Record records = 3; }
//! message Record { required uint64 partition_key_index = 1;
//!                  optional uint64 explicit_hash_key_index = 2;
//!                  required bytes data = 3;
//!                  repeated Tag tags = 4; }
//! message Tag    { required string key = 1; optional string value = 2; }
//! ```
//!
//! A user record's *sub-sequence number* is its index in `records`, so a shard position
//! is `(sequence number, sub-sequence number)` ([`crate::sequence::Position`]): a
//! checkpoint can stop inside an aggregate, and after a restart the aggregate is read
//! again and only the user records after the checkpoint are delivered: none skipped,
//! none repeated. The numbering never depends on what a consumer keeps or drops (the
//! shard-range rule below), so positions are stable across restarts. Plain records have
//! sub-sequence number 0.
//!
//! The structs are declared by hand with `prost` derives (no build script, no `protoc`),
//! and the user records' data are zero-copy slices of the Kinesis record's [`Bytes`].
//!
//! # Records that carry the magic bytes but are not valid aggregates
//!
//! One rule, whatever is wrong: **the Kinesis record is delivered whole, as a plain
//! record** (its own partition key and data, sub-sequence number 0) and comes back as
//! [`Deaggregated::Corrupt`] with the [`AggregationError`] that says why, so the caller
//! can count it and a handler (or a dead-letter layer) sees the bytes. Nothing of it is
//! dropped and no user record of it is delivered: validation covers the whole aggregate
//! before any user record is handed out. The cases:
//!
//! | what | [`AggregationError`] | KCL 2.x/3.x ([`AggregatorUtil`]) |
//! |---|---|---|
//! | 16 bytes or fewer after the magic | `TooShort` | delivered as plain, not counted |
//! | MD5 trailer does not match (includes truncation) | `DigestMismatch` | delivered as plain, not counted |
//! | body is not a protobuf `AggregatedRecord` | `Malformed` | delivered as plain, not counted |
//! | a key is not UTF-8 | `Malformed` | accepted, bad bytes replaced (Java's proto2 strings) |
//! | a required field (`partition_key_index`, `data`, tag `key`) is missing | `MissingField` | delivered as plain (proto2 parse error) |
//! | a key index points past its table | `…IndexOutOfRange` | user records before the bad one delivered, the rest dropped; an error logged *with the payload* |
//! | an explicit hash key is not a decimal in `0..2^128` | `InvalidExplicitHashKey` | with a shard range: not a number, as above; a number out of range, the whole aggregate discarded (below); without one: passed through |
//! | no user records at all | `NoRecords` | nothing delivered: the record vanishes |
//!
//! The KCL and the awslabs deaggregators deliver a record that fails the magic, length,
//! MD5 or protobuf checks as a plain record; shardflow extends that rule to every way an
//! aggregate can be broken, so that no case loses part of a record, and reports it.
//!
//! # User records outside the shard's hash-key range (after a reshard)
//!
//! Every user record has an *effective hash key*: its explicit hash key when it has one,
//! else the MD5 of its partition key read as a big-endian `u128` (how Kinesis routes
//! records). A user record can sit in a shard that does not own its hash key: the KPL
//! routes an aggregate by its first user record and predicts shards from a cached shard
//! map, so right after a split or merge an aggregate can land in a shard that owns only
//! some of its user records; the awslabs aggregation libraries do not look at shards
//! at all and pack any keys together.
//!
//! **What the KCL does** (awslabs/amazon-kinesis-client, v3.5.1, unchanged since 2.0.0):
//! `ProcessTask.deaggregateAnyKplRecords` (`lifecycle/ProcessTask.java`) passes the
//! lease's shard `hashKeyRange()` to [`AggregatorUtil`]`.deaggregate(records,
//! startingHashKey, endingHashKey)`. That method walks the user records of an aggregate
//! and, at the first one whose effective hash key is outside `[start, end]` (both
//! inclusive), removes the user records of the same aggregate it already emitted and
//! stops: **the whole aggregate is discarded, its in-range user records included**. It
//! is not delivered as a plain record either, nothing is logged or counted, and the
//! checkpoint later moves past it. (When the shard is unknown, e.g. with
//! `skipShardSyncAtWorkerInitializationIfLeasesExist`, nothing is filtered.) ProcessTask
//! calls these "duplicate KPL user records in the event of resharding": the KPL's retrier
//! (awslabs/amazon-kinesis-producer, `aws/kinesis/core/retrier.cc`,
//! `succeed_if_correct_shard`) sends again the user records of an aggregate that landed
//! in another shard than predicted ("Wrong Shard"), so the dropped copies are expected to
//! arrive again in the right shard. That only holds for the KPL: since KPL 0.15.11
//! (commit f4a64f1, 2024) the retrier sends again only the user records outside the
//! actual shard's range and reports the others as stored, which the KCL then discards
//! with the rest of the aggregate; and producers that do not retry (the awslabs
//! `kinesis-aggregation` libraries, whose own `potential_data_loss.md` warns about this,
//! or [`Aggregator`] here) lose every discarded record.
//!
//! **What shardflow does:** [`deaggregate`] never drops a user record; it returns all of
//! them with their sub-sequence numbers, and [`belongs_to_shard`] tells the consumer
//! which ones are outside the shard's range. The consumer delivers those too by default
//! and counts them ([`MisplacedUserRecords`]): discarding loses data with every producer
//! that does not send them again. With the KPL that can deliver a user record twice
//! (here, and again from the right shard after the KPL's retry), which at-least-once
//! delivery and the dedup layer cover. A deployment that knows its producers chooses
//! to skip the misplaced user records only, or the whole aggregate as the KCL does.
//! shardflow's producer, when an aggregate lands in a shard that does not own all its
//! user records, sends all of them again, each packed for its own shard: a KCL
//! consumer (which discards the aggregate) then has each exactly once, and so does a
//! shardflow consumer set to [`MisplacedUserRecords::SkipAggregate`].
//!
//! # Aggregating
//!
//! [`Aggregator`] packs user records (as [`PutRecord`]s) into aggregated records of at
//! most [`MAX_RECORD_BYTES`] bytes (data plus partition key, what Kinesis counts). Like
//! the KPL, the aggregate takes its first user record's partition key and, as explicit
//! hash key, that record's effective hash key, so it lands in the shard that owns its
//! first user record. It does not know the shard map: a producer that wants every user
//! record in its own shard (so that a KCL consumer drops none) keeps one `Aggregator`
//! per shard and picks it by hash key.
//!
//! [`AggregatorUtil`]: https://github.com/awslabs/amazon-kinesis-client/blob/master/amazon-kinesis-client/src/main/java/software/amazon/kinesis/retrieval/AggregatorUtil.java

use std::collections::HashMap;
use std::fmt;

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message as _;

use crate::kinesis::{partition_hash, PutRecord, Record, MAX_RECORD_BYTES};

/// The four bytes an aggregated record starts with.
pub const MAGIC: [u8; 4] = [0xF3, 0x89, 0x9A, 0xC2];

/// The length of the MD5 trailer.
pub const DIGEST_LEN: usize = 16;

/// The protobuf messages, declared by hand (the KPL's `messages.proto`, proto2). Fields
/// that proto2 declares `required` are `optional` here so that a missing one can be told
/// from a zero and refused, as proto2 parsers do.
mod proto {
    use bytes::Bytes;

    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct AggregatedRecord {
        #[prost(string, repeated, tag = "1")]
        pub partition_key_table: Vec<String>,
        #[prost(string, repeated, tag = "2")]
        pub explicit_hash_key_table: Vec<String>,
        #[prost(message, repeated, tag = "3")]
        pub records: Vec<Record>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Record {
        #[prost(uint64, optional, tag = "1")]
        pub partition_key_index: Option<u64>,
        #[prost(uint64, optional, tag = "2")]
        pub explicit_hash_key_index: Option<u64>,
        #[prost(bytes = "bytes", optional, tag = "3")]
        pub data: Option<Bytes>,
        #[prost(message, repeated, tag = "4")]
        pub tags: Vec<Tag>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub(super) struct Tag {
        #[prost(string, optional, tag = "1")]
        pub key: Option<String>,
        #[prost(string, optional, tag = "2")]
        pub value: Option<String>,
    }
}

/// Why a record that starts with [`MAGIC`] is not a valid aggregate. Such a record is
/// delivered whole as a plain record (see the module docs); the error says what to count.
/// No variant carries payload bytes or keys, so errors can be logged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AggregationError {
    /// Too short to hold a body and the MD5 trailer after the magic bytes.
    #[error("aggregated record too short: {len} bytes, needs more than {}", MAGIC.len() + DIGEST_LEN)]
    TooShort {
        /// The record's data length.
        len: usize,
    },
    /// The MD5 trailer does not match the body (corrupted or truncated).
    #[error("aggregated record's MD5 trailer does not match its body")]
    DigestMismatch,
    /// The body is not a protobuf `AggregatedRecord`.
    #[error("aggregated record's body does not parse: {0}")]
    Malformed(String),
    /// A field proto2 declares `required` is missing.
    #[error("user record {record} of the aggregate lacks its required field `{field}`")]
    MissingField {
        /// The user record's index in the aggregate.
        record: usize,
        /// The missing field.
        field: &'static str,
    },
    /// A user record's partition key index points past the partition key table.
    #[error("user record {record} has partition key index {index}, the table has {table_len}")]
    PartitionKeyIndexOutOfRange {
        /// The user record's index in the aggregate.
        record: usize,
        /// The index it holds.
        index: u64,
        /// The number of partition keys in the table.
        table_len: usize,
    },
    /// A user record's explicit hash key index points past the explicit hash key table.
    #[error("user record {record} has explicit hash key index {index}, the table has {table_len}")]
    ExplicitHashKeyIndexOutOfRange {
        /// The user record's index in the aggregate.
        record: usize,
        /// The index it holds.
        index: u64,
        /// The number of explicit hash keys in the table.
        table_len: usize,
    },
    /// A user record's explicit hash key is not a decimal number in `0..2^128`.
    #[error("user record {record} has an explicit hash key that is not a decimal in 0..2^128")]
    InvalidExplicitHashKey {
        /// The user record's index in the aggregate.
        record: usize,
    },
    /// The aggregate holds no user record.
    #[error("aggregated record holds no user record")]
    NoRecords,
}

/// One user record of an aggregated Kinesis record.
#[derive(Clone, PartialEq, Eq)]
pub struct UserRecord {
    /// Its index in the aggregate: the sub-sequence number of its position.
    pub sub_sequence: u64,
    /// The partition key the producer gave it.
    pub partition_key: String,
    /// The explicit hash key the producer gave it, if any (decimal, as written).
    pub explicit_hash_key: Option<String>,
    /// Its data: a slice of the Kinesis record's data (no copy).
    pub data: Bytes,
}

impl UserRecord {
    /// The effective hash key Kinesis would route this record by: the explicit hash key
    /// when set, else the MD5 of the partition key as a big-endian `u128`. `None` only for
    /// an explicit hash key that is not a decimal in `0..2^128`, which [`deaggregate`]
    /// never returns (it refuses such aggregates) but a hand-built record may hold.
    pub fn hash_key(&self) -> Option<u128> {
        match &self.explicit_hash_key {
            Some(ehk) => parse_hash_key(ehk),
            None => Some(partition_hash(&self.partition_key)),
        }
    }
}

impl fmt::Debug for UserRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Neither data nor partition key (which can be business data) go to logs.
        f.debug_struct("UserRecord")
            .field("sub_sequence", &self.sub_sequence)
            .field("partition_key_len", &self.partition_key.len())
            .field("explicit_hash_key", &self.explicit_hash_key)
            .field("data_len", &self.data.len())
            .finish()
    }
}

/// What [`deaggregate`] made of a Kinesis record.
#[derive(Clone)]
pub enum Deaggregated {
    /// Not an aggregate (no magic bytes): deliver it as it is, sub-sequence number 0.
    Plain(Record),
    /// Starts with the magic bytes but is not a valid aggregate: deliver it as a plain
    /// record (sub-sequence number 0, its own partition key and data), and count it.
    Corrupt {
        /// The Kinesis record, untouched.
        record: Record,
        /// What is wrong with it.
        reason: AggregationError,
    },
    /// A valid aggregate: deliver its user records, each at `(sequence number of
    /// record, sub_sequence)`.
    Aggregated {
        /// The Kinesis record: its sequence number and arrival time are the user records'.
        /// Its data is the whole aggregate: deliver the user records, not this.
        record: Record,
        /// The user records in order; `sub_sequence` runs 0, 1, 2, …
        user_records: Vec<UserRecord>,
    },
}

impl Deaggregated {
    /// The Kinesis record this came from.
    pub fn record(&self) -> &Record {
        match self {
            Deaggregated::Plain(record)
            | Deaggregated::Corrupt { record, .. }
            | Deaggregated::Aggregated { record, .. } => record,
        }
    }

    /// Why the record is delivered as a plain record although it carries the magic
    /// bytes; `None` unless [`Deaggregated::Corrupt`].
    pub fn corruption(&self) -> Option<&AggregationError> {
        match self {
            Deaggregated::Corrupt { reason, .. } => Some(reason),
            _ => None,
        }
    }

    /// How many messages this delivers: the user records of an aggregate, else one.
    pub fn message_count(&self) -> usize {
        match self {
            Deaggregated::Aggregated { user_records, .. } => user_records.len(),
            _ => 1,
        }
    }
}

impl fmt::Debug for Deaggregated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `Record`'s derived Debug prints its data: keep payloads out of logs.
        let record = self.record();
        let kind = match self {
            Deaggregated::Plain(_) => "Plain",
            Deaggregated::Corrupt { .. } => "Corrupt",
            Deaggregated::Aggregated { .. } => "Aggregated",
        };
        let mut d = f.debug_struct(kind);
        d.field("sequence_number", &record.sequence_number.as_str())
            .field("data_len", &record.data.len());
        match self {
            Deaggregated::Plain(_) => {}
            Deaggregated::Corrupt { reason, .. } => {
                d.field("reason", reason);
            }
            Deaggregated::Aggregated { user_records, .. } => {
                d.field("user_records", &user_records.len());
            }
        }
        d.finish()
    }
}

/// Whether `data` starts with the aggregation magic bytes (it may still be corrupt).
pub(crate) fn has_magic(data: &[u8]) -> bool {
    data.starts_with(&MAGIC)
}

/// Splits a Kinesis record into its user records if it is a KPL aggregate.
///
/// Never panics and never drops anything: a record without the magic bytes comes back
/// [`Deaggregated::Plain`], a broken aggregate [`Deaggregated::Corrupt`] (to be
/// delivered as a plain record and counted), a valid one [`Deaggregated::Aggregated`]
/// with every user record, whichever shard its hash key belongs to (see
/// [`belongs_to_shard`] and the module docs).
pub fn deaggregate(record: Record) -> Deaggregated {
    if !has_magic(&record.data) {
        return Deaggregated::Plain(record);
    }
    match decode(&record.data) {
        Ok(user_records) => Deaggregated::Aggregated {
            record,
            user_records,
        },
        Err(reason) => Deaggregated::Corrupt { record, reason },
    }
}

/// Decodes data that starts with [`MAGIC`]: checks length, MD5 and every index before
/// returning anything, so a broken aggregate yields no user record at all.
fn decode(data: &Bytes) -> Result<Vec<UserRecord>, AggregationError> {
    let len = data.len();
    // The KCL and the awslabs libraries also require more than the digest after the magic.
    if len <= MAGIC.len() + DIGEST_LEN {
        return Err(AggregationError::TooShort { len });
    }
    let body_end = len - DIGEST_LEN;
    let body = data.slice(MAGIC.len()..body_end);
    if md5::compute(&body).0[..] != data[body_end..] {
        return Err(AggregationError::DigestMismatch);
    }
    // Decoding from a `Bytes` makes each `data` field a slice of `body` (no copy).
    let aggregate = proto::AggregatedRecord::decode(body)
        .map_err(|e| AggregationError::Malformed(e.to_string()))?;
    if aggregate.records.is_empty() {
        return Err(AggregationError::NoRecords);
    }

    let pks = &aggregate.partition_key_table;
    let ehks = &aggregate.explicit_hash_key_table;
    let mut user_records = Vec::with_capacity(aggregate.records.len());
    for (i, r) in aggregate.records.into_iter().enumerate() {
        let missing = |field| AggregationError::MissingField { record: i, field };
        let pk_index = r
            .partition_key_index
            .ok_or_else(|| missing("partition_key_index"))?;
        let partition_key =
            table_entry(pks, pk_index).ok_or(AggregationError::PartitionKeyIndexOutOfRange {
                record: i,
                index: pk_index,
                table_len: pks.len(),
            })?;
        let explicit_hash_key = match r.explicit_hash_key_index {
            None => None,
            Some(index) => {
                let ehk = table_entry(ehks, index).ok_or(
                    AggregationError::ExplicitHashKeyIndexOutOfRange {
                        record: i,
                        index,
                        table_len: ehks.len(),
                    },
                )?;
                if parse_hash_key(ehk).is_none() {
                    return Err(AggregationError::InvalidExplicitHashKey { record: i });
                }
                Some(ehk.clone())
            }
        };
        if r.tags.iter().any(|t| t.key.is_none()) {
            return Err(missing("tags.key"));
        }
        let data = r.data.ok_or_else(|| missing("data"))?;
        user_records.push(UserRecord {
            sub_sequence: i as u64,
            partition_key: partition_key.clone(),
            explicit_hash_key,
            data,
        });
    }
    Ok(user_records)
}

fn table_entry(table: &[String], index: u64) -> Option<&String> {
    usize::try_from(index).ok().and_then(|i| table.get(i))
}

/// Parses a hash key as Kinesis writes it: decimal digits only (leading zeros allowed),
/// at most `2^128 - 1`. `None` for anything else.
pub(crate) fn parse_hash_key(s: &str) -> Option<u128> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None; // u128::from_str would also take a leading '+'
    }
    s.parse().ok()
}

/// Whether a user record belongs to the shard whose hash-key range is `start..=end`
/// (both ends inclusive, as ListShards gives them): its effective hash key
/// ([`UserRecord::hash_key`]) lies in the range.
///
/// A record whose hash key cannot be computed (an explicit hash key that is not a
/// decimal in `0..2^128`, only possible for hand-built records) counts as belonging:
/// it cannot be shown to be misplaced, and shardflow drops nothing on a guess.
///
/// The KCL discards the whole aggregate when one of its user records is outside the
/// range; see the module docs for why shardflow delivers them instead.
pub fn belongs_to_shard(user: &UserRecord, start: u128, end: u128) -> bool {
    match user.hash_key() {
        Some(h) => start <= h && h <= end,
        None => true,
    }
}

/// What a consumer does with the KPL user records it reads from a shard whose hash-key
/// range does not hold theirs (an aggregate packed from a stale shard map, around a
/// reshard). Which choice delivers every record exactly once depends on what the
/// producers do with such an aggregate; only [`Deliver`](Self::Deliver) loses nothing
/// whatever they do. Set with `ConsumerBuilder::misplaced_user_records`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum MisplacedUserRecords {
    /// Deliver them like any other (the default). Nothing is lost with any producer;
    /// with a producer that sends misplaced records again (the KPL, shardflow's
    /// producer) those records arrive twice.
    #[default]
    Deliver,
    /// Skip the misplaced user records, deliver the rest of their aggregate. Loses
    /// nothing with producers that send at least the misplaced records again: every
    /// KPL version, and shardflow's producer (which sends the whole aggregate again,
    /// so its other records arrive twice).
    SkipRecords,
    /// Skip the whole aggregate that holds a misplaced user record, as the KCL does.
    /// Exactly once with producers that send the whole aggregate again (shardflow's
    /// producer, KPL versions before 0.15.11); loses the aggregate's other records with
    /// producers that do not (KPL 0.15.11 and later send only the misplaced ones again;
    /// the awslabs aggregation libraries send nothing again).
    SkipAggregate,
}

/// Why [`Aggregator::add`] refused a user record. The record comes back unchanged
/// ([`AggregatorError::into_record`]) so the caller can send it on its own.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum AggregatorError {
    /// The record alone, aggregated, would exceed the size limit.
    #[error("a user record of {size} bytes aggregated exceeds the limit of {max_size} bytes")]
    TooLarge {
        /// The refused record.
        record: PutRecord,
        /// Its size inside an aggregate of its own (data, framing and partition key).
        size: usize,
        /// The aggregator's limit.
        max_size: usize,
    },
    /// Its explicit hash key is not a decimal number in `0..2^128`: consumers would
    /// refuse the whole aggregate.
    #[error("explicit hash key is not a decimal number in 0..2^128")]
    InvalidExplicitHashKey {
        /// The refused record.
        record: PutRecord,
    },
}

impl AggregatorError {
    /// The refused record.
    pub fn into_record(self) -> PutRecord {
        match self {
            AggregatorError::TooLarge { record, .. }
            | AggregatorError::InvalidExplicitHashKey { record } => record,
        }
    }
}

impl fmt::Debug for AggregatorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `PutRecord`'s derived Debug prints its data: keep payloads out of logs.
        match self {
            AggregatorError::TooLarge { size, max_size, .. } => f
                .debug_struct("TooLarge")
                .field("size", size)
                .field("max_size", max_size)
                .finish_non_exhaustive(),
            AggregatorError::InvalidExplicitHashKey { .. } => f
                .debug_struct("InvalidExplicitHashKey")
                .finish_non_exhaustive(),
        }
    }
}

/// Packs user records into KPL aggregated records (the producer side of [`deaggregate`]).
///
/// Add records with [`Aggregator::add`]; when one does not fit any more, `add` returns
/// the finished aggregate and starts the next with it. [`Aggregator::flush`] returns
/// what is pending. An aggregate holding a single user record is sent as that plain
/// record (as the KPL does), unless its data starts with [`MAGIC`] (which a consumer
/// would take for an aggregate), so a lone record costs no framing.
///
/// ```
/// use bytes::Bytes;
/// use shardflow::aggregation::{deaggregate, Aggregator, Deaggregated};
/// use shardflow::kinesis::{PutRecord, Record};
///
/// let mut aggregator = Aggregator::new();
/// for i in 0..3 {
///     let user = PutRecord {
///         data: Bytes::from(format!("order {i}")),
///         partition_key: format!("customer-{i}"),
///         explicit_hash_key: None,
///     };
///     assert!(aggregator.add(user).unwrap().is_none()); // all three fit in one
/// }
/// let put = aggregator.flush().unwrap();
///
/// // What a consumer reads back:
/// let record = Record {
///     sequence_number: "1".parse().unwrap(),
///     partition_key: put.partition_key,
///     data: put.data,
///     approximate_arrival: None,
/// };
/// let Deaggregated::Aggregated { user_records, .. } = deaggregate(record) else { panic!() };
/// assert_eq!(user_records[2].sub_sequence, 2);
/// assert_eq!(user_records[2].data, "order 2");
/// ```
#[derive(Clone)]
pub struct Aggregator {
    max_size: usize,
    /// The first user record, whole: the aggregate's routing, or the record itself when
    /// it stays alone.
    first: Option<PutRecord>,
    message: proto::AggregatedRecord,
    partition_keys: HashMap<String, u64>,
    explicit_hash_keys: HashMap<String, u64>,
    /// The encoded length of `message`.
    body_len: usize,
}

impl Default for Aggregator {
    fn default() -> Self {
        Aggregator::new()
    }
}

impl fmt::Debug for Aggregator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Aggregator")
            .field("max_size", &self.max_size)
            .field("user_records", &self.len())
            .field("size", &self.size())
            .finish()
    }
}

impl Aggregator {
    /// An aggregator for records up to [`MAX_RECORD_BYTES`] (1 MiB).
    pub fn new() -> Self {
        Aggregator::with_max_size(MAX_RECORD_BYTES)
    }

    /// An aggregator for records up to `max_size` bytes (data plus partition key);
    /// values above [`MAX_RECORD_BYTES`] are lowered to it (Kinesis refuses more). The
    /// KPL's default is 51,200 bytes: smaller aggregates spread better over shards and
    /// cost less to re-deliver.
    pub fn with_max_size(max_size: usize) -> Self {
        Aggregator {
            max_size: max_size.min(MAX_RECORD_BYTES),
            first: None,
            message: proto::AggregatedRecord::default(),
            partition_keys: HashMap::new(),
            explicit_hash_keys: HashMap::new(),
            body_len: 0,
        }
    }

    /// The size limit.
    pub fn max_size(&self) -> usize {
        self.max_size
    }

    /// How many user records are pending.
    pub fn len(&self) -> usize {
        self.message.records.len()
    }

    /// Whether no user record is pending.
    pub fn is_empty(&self) -> bool {
        self.message.records.is_empty()
    }

    /// The size, as Kinesis counts it (data plus partition key), of the aggregated
    /// record the pending user records make; 0 when empty.
    pub fn size(&self) -> usize {
        match &self.first {
            None => 0,
            Some(first) => framed_len(self.body_len) + first.partition_key.len(),
        }
    }

    /// Adds a user record. Returns the finished aggregate when the record did not fit in
    /// the pending one (the record then starts the next), else `None`.
    ///
    /// Refuses, and gives back, a record with an invalid explicit hash key and one too
    /// large for an aggregate of its own; the pending aggregate is left as it was.
    pub fn add(&mut self, record: PutRecord) -> Result<Option<PutRecord>, AggregatorError> {
        if let Some(ehk) = &record.explicit_hash_key {
            if parse_hash_key(ehk).is_none() {
                return Err(AggregatorError::InvalidExplicitHashKey { record });
            }
        }
        let alone = self.growth(&record, true);
        let alone_size = framed_len(alone) + record.partition_key.len();
        if alone_size > self.max_size {
            return Err(AggregatorError::TooLarge {
                record,
                size: alone_size,
                max_size: self.max_size,
            });
        }
        let finished =
            if !self.is_empty() && self.size() + self.growth(&record, false) > self.max_size {
                self.flush()
            } else {
                None
            };
        self.push(record);
        Ok(finished)
    }

    /// What [`add`](Self::add) would do with `record`, and the exact size (as Kinesis
    /// counts it) of the Kinesis record it would end up in, without adding it.
    pub(crate) fn fit(&self, record: &PutRecord) -> Fit {
        if let Some(ehk) = &record.explicit_hash_key {
            if parse_hash_key(ehk).is_none() {
                return Fit::Alone;
            }
        }
        let alone = framed_len(self.growth(record, true)) + record.partition_key.len();
        if alone > self.max_size {
            return Fit::Alone;
        }
        if !self.is_empty() {
            let joined = self.size() + self.growth(record, false);
            if joined <= self.max_size {
                return Fit::Joins(joined);
            }
        }
        // A lone user record goes as it is (see `flush`), unless it carries the magic.
        let lone = if has_magic(&record.data) {
            alone
        } else {
            record.data.len() + record.partition_key.len()
        };
        Fit::StartsNext(lone)
    }

    /// The exact size, as Kinesis counts it (data plus partition key), of the record
    /// [`flush`](Self::flush) would return now; 0 when empty. Unlike [`size`](Self::size)
    /// it counts a lone user record as the plain record it is sent as.
    pub(crate) fn wire_size(&self) -> usize {
        match &self.first {
            Some(first) if self.len() == 1 && !has_magic(&first.data) => {
                first.data.len() + first.partition_key.len()
            }
            _ => self.size(),
        }
    }

    /// Returns the pending user records as one Kinesis record (plain if there is just
    /// one, see [`Aggregator`]), and empties the aggregator; `None` when empty.
    pub fn flush(&mut self) -> Option<PutRecord> {
        let first = self.first.take()?;
        let message = std::mem::take(&mut self.message);
        let body_len = std::mem::replace(&mut self.body_len, 0);
        self.partition_keys.clear();
        self.explicit_hash_keys.clear();
        if message.records.len() == 1 && !has_magic(&first.data) {
            return Some(first);
        }

        let mut data = BytesMut::with_capacity(framed_len(body_len));
        data.put_slice(&MAGIC);
        message
            .encode(&mut data)
            // Cannot fail: encode only refuses a buffer without room, and a BytesMut
            // grows on demand (its remaining_mut() is usize::MAX - len).
            .expect("BytesMut grows as needed");
        let digest = md5::compute(&data[MAGIC.len()..]);
        data.put_slice(&digest.0);
        // Route the aggregate as its first user record would be routed.
        let hash_key = match first.explicit_hash_key.as_deref().and_then(parse_hash_key) {
            Some(h) => h,
            None => partition_hash(&first.partition_key),
        };
        Some(PutRecord {
            data: data.freeze(),
            partition_key: first.partition_key,
            explicit_hash_key: Some(hash_key.to_string()),
        })
    }

    /// How many bytes `record` adds to the encoded body: to the pending aggregate, or to
    /// an empty one when `alone`. Protobuf fields encode independently, so the body's
    /// length is the sum of these.
    fn growth(&self, record: &PutRecord, alone: bool) -> usize {
        let mut len = 0;
        let pk_index = match self.partition_keys.get(&record.partition_key) {
            Some(&index) if !alone => index,
            _ => {
                len += prost::encoding::string::encoded_len(1, &record.partition_key);
                if alone {
                    0
                } else {
                    self.message.partition_key_table.len() as u64
                }
            }
        };
        let ehk_index = match &record.explicit_hash_key {
            None => None,
            Some(ehk) => match self.explicit_hash_keys.get(ehk) {
                Some(&index) if !alone => Some(index),
                _ => {
                    len += prost::encoding::string::encoded_len(2, ehk);
                    Some(if alone {
                        0
                    } else {
                        self.message.explicit_hash_key_table.len() as u64
                    })
                }
            },
        };
        len + prost::encoding::message::encoded_len(
            3,
            &proto::Record {
                partition_key_index: Some(pk_index),
                explicit_hash_key_index: ehk_index,
                data: Some(record.data.clone()),
                tags: Vec::new(),
            },
        )
    }

    fn push(&mut self, record: PutRecord) {
        self.body_len += self.growth(&record, self.is_empty());
        let pk_index = index_of(
            &mut self.partition_keys,
            &mut self.message.partition_key_table,
            &record.partition_key,
        );
        let ehk_index = record.explicit_hash_key.as_ref().map(|ehk| {
            index_of(
                &mut self.explicit_hash_keys,
                &mut self.message.explicit_hash_key_table,
                ehk,
            )
        });
        self.message.records.push(proto::Record {
            partition_key_index: Some(pk_index),
            explicit_hash_key_index: ehk_index,
            data: Some(record.data.clone()),
            tags: Vec::new(),
        });
        if self.first.is_none() {
            self.first = Some(record);
        }
    }
}

/// Where [`Aggregator::add`] would put a user record ([`Aggregator::fit`]), with the
/// exact size of the Kinesis record it would make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fit {
    /// It joins the pending aggregate, which then has this size.
    Joins(usize),
    /// The pending aggregate (if any) is finished as it is, and the record starts the
    /// next, which then has this size.
    StartsNext(usize),
    /// Refused: it goes on its own, as the plain record it is.
    Alone,
}

/// The index of `key` in a key table, adding it when new.
fn index_of(index: &mut HashMap<String, u64>, table: &mut Vec<String>, key: &str) -> u64 {
    if let Some(&i) = index.get(key) {
        return i;
    }
    let i = table.len() as u64;
    table.push(key.to_owned());
    index.insert(key.to_owned(), i);
    i
}

/// Magic, body and digest.
fn framed_len(body_len: usize) -> usize {
    MAGIC.len() + body_len + DIGEST_LEN
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(data: impl Into<Bytes>) -> Record {
        Record {
            sequence_number: "49590338271490256608559692538361571095921575989136588898"
                .parse()
                .unwrap(),
            partition_key: "outer".into(),
            data: data.into(),
            approximate_arrival: None,
        }
    }

    fn put(pk: &str, ehk: Option<&str>, data: &'static [u8]) -> PutRecord {
        PutRecord {
            data: Bytes::from_static(data),
            partition_key: pk.into(),
            explicit_hash_key: ehk.map(str::to_owned),
        }
    }

    fn frame(body: &[u8]) -> Bytes {
        let mut v = MAGIC.to_vec();
        v.extend_from_slice(body);
        v.extend_from_slice(&md5::compute(body).0);
        v.into()
    }

    #[test]
    fn user_data_are_slices_of_the_record() {
        let mut agg = Aggregator::new();
        agg.add(put("a", None, b"one")).unwrap();
        agg.add(put("b", Some("7"), b"two")).unwrap();
        let data = agg.flush().unwrap().data;
        let range = data.as_ptr() as usize..data.as_ptr() as usize + data.len();
        let Deaggregated::Aggregated { user_records, .. } = deaggregate(record(data.clone()))
        else {
            panic!("not aggregated")
        };
        for u in &user_records {
            assert!(range.contains(&(u.data.as_ptr() as usize)), "copied");
        }
    }

    #[test]
    fn size_accounting_matches_the_encoding() {
        let mut agg = Aggregator::new();
        let inputs = [
            put("a", None, b""),
            put("a", Some("1"), b"xx"),
            put("bb", Some("1"), &[0; 300]),
            put("ccc", Some("340282366920938463463374607431768211455"), b"y"),
            put("a", None, &[1; 130]),
        ];
        for (n, p) in inputs.into_iter().enumerate() {
            agg.add(p).unwrap();
            let size = agg.size();
            let out = agg.clone().flush().unwrap();
            if n > 0 {
                assert!(out.data.starts_with(&MAGIC));
                assert_eq!(out.data.len() + out.partition_key.len(), size, "after {n}");
            }
        }
    }

    #[test]
    fn fit_tells_the_exact_size_of_the_record_a_user_record_ends_up_in() {
        // Keys and explicit hash keys new and repeated, a payload with the magic, and a
        // small limit so that aggregates finish and records go alone.
        let big: &'static [u8] = &[7; 150];
        let magic: &'static [u8] = &[0xF3, 0x89, 0x9A, 0xC2, 1];
        let inputs = [
            put("a", Some("340282366920938463463374607431768211455"), b"x"),
            put("bb", Some("17"), big),
            put("a", Some("17"), b"yy"),
            put("c", None, magic),
            put("dddd", Some("99999999999999999999999999999999"), big),
            put("e", None, &[1; 400]),
            put("f", Some("not a number"), b"z"),
            put("a", None, b""),
        ];
        let mut agg = Aggregator::with_max_size(300);
        for (n, p) in inputs.into_iter().enumerate() {
            let fit = agg.fit(&p);
            let pending = agg.clone().flush();
            assert_eq!(
                agg.wire_size(),
                pending
                    .as_ref()
                    .map_or(0, |r| r.data.len() + r.partition_key.len()),
                "before {n}"
            );
            match agg.add(p) {
                Err(_) => assert_eq!(fit, Fit::Alone, "input {n}"),
                Ok(finished) => {
                    let now = agg.clone().flush().unwrap();
                    let size = now.data.len() + now.partition_key.len();
                    assert_eq!(agg.wire_size(), size, "after {n}");
                    match fit {
                        Fit::Joins(s) => {
                            assert!(finished.is_none(), "input {n}");
                            assert_eq!(s, size, "input {n}");
                        }
                        Fit::StartsNext(s) => {
                            assert_eq!(finished.is_some(), pending.is_some(), "input {n}");
                            assert_eq!(s, size, "input {n}");
                        }
                        Fit::Alone => panic!("input {n} was added"),
                    }
                    assert!(size <= 300);
                }
            }
        }
    }

    #[test]
    fn missing_required_fields_are_refused() {
        let no_index = proto::AggregatedRecord {
            partition_key_table: vec!["k".into()],
            explicit_hash_key_table: vec![],
            records: vec![proto::Record {
                partition_key_index: None,
                explicit_hash_key_index: None,
                data: Some(Bytes::from_static(b"d")),
                tags: vec![],
            }],
        };
        let d = deaggregate(record(frame(&no_index.encode_to_vec())));
        assert_eq!(
            d.corruption(),
            Some(&AggregationError::MissingField {
                record: 0,
                field: "partition_key_index"
            })
        );

        let tag_without_key = proto::AggregatedRecord {
            records: vec![proto::Record {
                partition_key_index: Some(0),
                explicit_hash_key_index: None,
                data: Some(Bytes::new()),
                tags: vec![proto::Tag {
                    key: None,
                    value: Some("v".into()),
                }],
            }],
            ..no_index
        };
        let d = deaggregate(record(frame(&tag_without_key.encode_to_vec())));
        assert!(matches!(
            d.corruption(),
            Some(AggregationError::MissingField {
                field: "tags.key",
                ..
            })
        ));
    }

    #[test]
    fn tags_are_accepted_and_ignored() {
        let with_tag = proto::AggregatedRecord {
            partition_key_table: vec!["k".into()],
            explicit_hash_key_table: vec![],
            records: vec![proto::Record {
                partition_key_index: Some(0),
                explicit_hash_key_index: None,
                data: Some(Bytes::from_static(b"d")),
                tags: vec![proto::Tag {
                    key: Some("t".into()),
                    value: None,
                }],
            }],
        };
        let d = deaggregate(record(frame(&with_tag.encode_to_vec())));
        assert_eq!(d.message_count(), 1);
        assert!(d.corruption().is_none());
    }

    #[test]
    fn hash_keys_parse_like_kinesis_writes_them() {
        assert_eq!(parse_hash_key("0"), Some(0));
        assert_eq!(parse_hash_key("000123"), Some(123));
        assert_eq!(parse_hash_key(&u128::MAX.to_string()), Some(u128::MAX));
        assert_eq!(
            parse_hash_key("340282366920938463463374607431768211456"),
            None
        );
        assert_eq!(parse_hash_key("+1"), None);
        assert_eq!(parse_hash_key("-1"), None);
        assert_eq!(parse_hash_key(""), None);
        assert_eq!(parse_hash_key("1 "), None);
    }

    #[test]
    fn debug_output_has_no_payload() {
        let mut agg = Aggregator::new();
        agg.add(put("secret-key", None, b"secret-data")).unwrap();
        agg.add(put("secret-key", None, b"secret-data")).unwrap();
        let d = deaggregate(record(agg.flush().unwrap().data));
        let text = format!("{d:?}");
        assert!(!text.contains("secret"), "{text}");
        let Deaggregated::Aggregated { user_records, .. } = d else {
            panic!()
        };
        let text = format!("{user_records:?}");
        assert!(!text.contains("secret"), "{text}");
        let err = Aggregator::with_max_size(10)
            .add(put("secret-key", None, b"secret-data"))
            .unwrap_err();
        assert!(!format!("{err:?} {err}").contains("secret"));
    }
}
