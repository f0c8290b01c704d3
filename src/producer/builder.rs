//! The producer's configuration and its builder, which refuses bad values with a
//! [`ConfigError`] naming the field.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::error::ConfigError;
use crate::kinesis::KinesisApi;

use super::Producer;

/// The per-shard rate limit unless set: the KPL's default, in percent of the quota.
const DEFAULT_RATE_LIMIT: u32 = 150;

/// PutRecords takes at most this many records per call.
pub const MAX_BATCH_RECORDS: usize = 500;

/// PutRecords takes at most this many bytes (payloads plus partition keys) per call.
pub const MAX_BATCH_BYTES: usize = 5 * 1024 * 1024;

/// A validated producer configuration, shared by the handles and the background task.
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) stream: Arc<str>,
    pub(crate) kinesis: Arc<dyn KinesisApi>,
    pub(crate) linger: Duration,
    pub(crate) max_batch_records: usize,
    pub(crate) max_batch_bytes: usize,
    pub(crate) buffer: usize,
    pub(crate) max_in_flight: usize,
    pub(crate) max_attempts: u32,
    pub(crate) retry_min: Duration,
    pub(crate) retry_max: Duration,
    pub(crate) ordered_per_key: bool,
    pub(crate) aggregation: Option<Aggregation>,
    /// Percent of a shard's write quota the producer allows itself per shard.
    pub(crate) rate_limit: Option<u32>,
    pub(crate) embed_headers: bool,
    pub(crate) seed: u64,
    /// The stream's maximum record size when set on the builder; else read from the
    /// stream when a record needs it.
    pub(crate) max_record_size: Option<usize>,
}

impl Settings {
    /// How many records of one shard the producer holds at once (taken, in flight or
    /// waiting for a resend): the buffer, plus a batch per call in flight and one
    /// filling (a hundred times that when aggregating: an entry then carries many).
    pub(crate) fn room_per_shard(&self) -> usize {
        let per_entry = if self.aggregation.is_some() { 100 } else { 1 };
        self.max_batch_records
            .saturating_mul(per_entry)
            .saturating_mul(self.max_in_flight.saturating_add(1))
            .saturating_add(self.buffer)
    }
}

/// How the producer packs user records into KPL aggregated records
/// ([`ProducerBuilder::aggregation`]). The defaults are the KPL's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Aggregation {
    max_size: usize,
    max_count: u64,
}

impl Default for Aggregation {
    fn default() -> Self {
        Aggregation {
            max_size: DEFAULT_AGGREGATE_BYTES,
            max_count: DEFAULT_AGGREGATE_RECORDS,
        }
    }
}

/// The KPL's `AggregationMaxSize`: aggregates of at most 51,200 bytes.
pub const DEFAULT_AGGREGATE_BYTES: usize = 51_200;

/// The KPL's `AggregationMaxCount`: in effect no limit but the size.
pub const DEFAULT_AGGREGATE_RECORDS: u64 = 4_294_967_295;

impl Aggregation {
    /// The KPL's defaults: aggregates of at most 51,200 bytes, no count limit in effect.
    pub fn new() -> Self {
        Aggregation::default()
    }

    /// At most this many bytes (data with its framing, plus the partition key) per
    /// aggregated record, `1..=1 MiB` (default 51,200). Smaller aggregates spread
    /// better over the shards and cost less to deliver again; a user record that does
    /// not fit in one of its own goes alone, as a plain record.
    pub fn max_size(mut self, bytes: usize) -> Self {
        self.max_size = bytes;
        self
    }

    /// At most this many user records per aggregated record (default 4,294,967,295).
    pub fn max_count(mut self, records: u64) -> Self {
        self.max_count = records;
        self
    }

    /// The size limit.
    pub fn size_limit(&self) -> usize {
        self.max_size
    }

    /// The count limit.
    pub fn count_limit(&self) -> u64 {
        self.max_count
    }
}

/// Builds a [`Producer`]. `stream` and a backend (`backend` or `kinesis`) are required;
/// everything else has a default that suits most streams.
///
/// | setting | default | meaning |
/// |---|---|---|
/// | [`linger`](Self::linger) | 50 ms | how long a record may wait for its batch to fill |
/// | [`max_batch_records`](Self::max_batch_records) | 500 | records per PutRecords call (1..=500) |
/// | [`max_batch_bytes`](Self::max_batch_bytes) | 5 MiB | bytes per call (1..=5 MiB) |
/// | [`buffer`](Self::buffer) | 10,000 | records of one shard the producer holds, beyond its batches |
/// | [`max_in_flight`](Self::max_in_flight) | 4 | PutRecords calls at once |
/// | [`max_attempts`](Self::max_attempts) | 10 | sends of one record before it fails |
/// | [`retry_backoff`](Self::retry_backoff) | 100 ms .. 5 s | delay before a resend |
/// | [`ordered_per_key`](Self::ordered_per_key) | off | keep each partition key's order |
/// | [`aggregate`](Self::aggregate) | off | pack records into KPL aggregates per shard |
/// | [`rate_limit`](Self::rate_limit) | 150 % | percent of a shard's write quota to use |
/// | [`embed_headers`](Self::embed_headers) | on | write a record's headers in Spring's JSON framing |
/// | [`max_record_size`](Self::max_record_size) | the stream's | the largest record the stream takes |
pub struct ProducerBuilder {
    stream: Option<String>,
    kinesis: Option<Arc<dyn KinesisApi>>,
    linger: Duration,
    max_batch_records: usize,
    max_batch_bytes: usize,
    buffer: usize,
    max_in_flight: usize,
    max_attempts: u32,
    retry_min: Duration,
    retry_max: Duration,
    ordered_per_key: bool,
    aggregation: Option<Aggregation>,
    rate_limit: Option<u32>,
    embed_headers: bool,
    seed: Option<u64>,
    max_record_size: Option<usize>,
}

impl Default for ProducerBuilder {
    fn default() -> Self {
        ProducerBuilder {
            stream: None,
            kinesis: None,
            linger: Duration::from_millis(50),
            max_batch_records: MAX_BATCH_RECORDS,
            max_batch_bytes: MAX_BATCH_BYTES,
            buffer: 10_000,
            max_in_flight: 4,
            max_attempts: 10,
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(5),
            ordered_per_key: false,
            aggregation: None,
            rate_limit: Some(DEFAULT_RATE_LIMIT),
            embed_headers: true,
            seed: None,
            max_record_size: None,
        }
    }
}

impl ProducerBuilder {
    /// The stream to write to (required).
    pub fn stream(mut self, stream: impl Into<String>) -> Self {
        self.stream = Some(stream.into());
        self
    }

    /// The backend: [`Aws`](crate::Aws) or [`Memory`](crate::Memory). Required, unless
    /// [`kinesis`](Self::kinesis) is given.
    pub fn backend(mut self, backend: impl Backend) -> Self {
        self.kinesis = Some(backend.kinesis());
        self
    }

    /// Writes through this Kinesis API instead of a backend's (e.g. a wrapper that
    /// counts or delays calls).
    pub fn kinesis(mut self, kinesis: Arc<dyn KinesisApi>) -> Self {
        self.kinesis = Some(kinesis);
        self
    }

    /// How long a record may wait for more records to fill its batch (default 50 ms).
    /// A full batch (by count or bytes) goes at once; zero sends whatever is buffered
    /// as soon as a call may start.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// At most this many records per PutRecords call (1..=500, default 500).
    pub fn max_batch_records(mut self, n: usize) -> Self {
        self.max_batch_records = n;
        self
    }

    /// At most this many bytes (payloads plus partition keys) per PutRecords call
    /// (1..=5 MiB, default 5 MiB). A single record larger than this still goes, alone.
    pub fn max_batch_bytes(mut self, bytes: usize) -> Self {
        self.max_batch_bytes = bytes;
        self
    }

    /// How many records of one shard the producer holds beyond its batches (default
    /// 10,000): each shard's room is this plus `max_batch_records × (max_in_flight +
    /// 1)` records (100 times that when aggregating: an entry then carries many), taken,
    /// in flight or waiting to be resent. A record of a full shard waits in that shard's
    /// line without holding any other shard's records, and `poll_ready` is pending
    /// while the shard of the handle's last call is full: that is the backpressure.
    /// See the [module docs](super#how-records-travel).
    pub fn buffer(mut self, capacity: usize) -> Self {
        self.buffer = capacity;
        self
    }

    /// How many PutRecords calls may run at once (default 4).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// How many times a record is sent before its call fails with
    /// [`ProduceError::Failed`](super::ProduceError::Failed) (default 10; 1 = no retry).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// The delay before a resend doubles from `min` up to `max`, with jitter (each
    /// delay is drawn from `[d/2, d]`). Default 100 ms .. 5 s.
    pub fn retry_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.retry_min = min;
        self.retry_max = max;
        self
    }

    /// Keeps the order of records with the same partition key, even across retries
    /// (default off). The price: at most one record per partition key is in flight
    /// at a time, so a single hot key gets one record per round trip.
    pub fn ordered_per_key(mut self, ordered: bool) -> Self {
        self.ordered_per_key = ordered;
        self
    }

    /// Packs many user records into each Kinesis record with the KPL's aggregation
    /// format and defaults ([`Aggregation::new`]), grouped by the shard each record
    /// lands in (default off). See the [module docs](super#aggregation).
    pub fn aggregate(mut self, on: bool) -> Self {
        self.aggregation = on.then(Aggregation::new);
        self
    }

    /// Aggregation with these limits (see [`aggregate`](Self::aggregate)).
    pub fn aggregation(mut self, aggregation: Aggregation) -> Self {
        self.aggregation = Some(aggregation);
        self
    }

    /// Writes at most `percent` of a shard's quota (1,000 records and 1 MiB per second)
    /// to each shard, 1..=1000 (default 150, as the KPL's: more than the quota, to
    /// absorb the imprecision of Kinesis' meter; 100 when this producer is the shard's
    /// only writer and refusals should almost never happen). Records of a shard
    /// over its budget wait in the producer (records of other shards go on) instead of
    /// being sent and refused; an entry refused for throughput empties its shard's
    /// budget, so that shard waits while the others go on. The producer lists the
    /// stream's shards to know where each record goes, as for aggregation (so it needs
    /// `kinesis:ListShards`; without it, records go unlimited after one warning).
    pub fn rate_limit(mut self, percent: u32) -> Self {
        self.rate_limit = Some(percent);
        self
    }

    /// No per-shard rate limit: every record goes when its batch does, and a producer
    /// faster than a shard collects refusals and resends them after a backoff. The
    /// producer then lists the stream's shards only to aggregate.
    pub fn no_rate_limit(mut self) -> Self {
        self.rate_limit = None;
        self
    }

    /// Whether a record's headers (set with
    /// [`ProducerRecord::with_header`](crate::ProducerRecord::with_header)) are written
    /// into the record (default on), in Spring Integration's JSON-headers framing: a
    /// 4-byte length, the headers as JSON, a 4-byte length, the payload (see
    /// [`headers::spring`](crate::headers::spring)). A shardflow consumer with the
    /// default [`HeaderFormat::Auto`](crate::HeaderFormat) and a Spring Cloud Stream
    /// Kinesis consumer with its defaults read them back; the framing counts against
    /// the stream's record limit.
    ///
    /// A record without headers is written as its bare payload, so the default costs
    /// nothing to applications that set none, unless a reader could take that payload
    /// for a frame ([`may_be_taken_for_a_frame`](crate::headers::spring::may_be_taken_for_a_frame)):
    /// it is then framed with an empty header map, so that it comes back byte for byte.
    /// A typed header whose class is not a Java class name is refused
    /// ([`InvalidRecord::HeaderClass`](crate::producer::InvalidRecord::HeaderClass)). It is on because Spring's
    /// Kinesis binders embed headers by default too, and because headers an application
    /// set should not vanish silently. Turn it off when the stream's readers are not
    /// Spring or shardflow (a Lambda function, Firehose, Flink) and must see the
    /// payload alone: the headers are then not written at all.
    pub fn embed_headers(mut self, embed: bool) -> Self {
        self.embed_headers = embed;
        self
    }

    /// The largest record the stream takes, in bytes of payload plus partition key
    /// (headers' framing included), `1 MiB..=10 MiB`. Kinesis takes records of up to
    /// 1 MiB on every stream, and up to 10 MiB on a stream set for large records
    /// (`UpdateMaxRecordSize`; its `MaxRecordSizeInKiB` × 1,024 goes here).
    ///
    /// Unset (the default), the producer reads the stream's figure from
    /// DescribeStreamSummary once, the first time a record above 1 MiB needs it (which
    /// needs `kinesis:DescribeStreamSummary`); a backend that cannot tell (an emulator)
    /// gets 1 MiB. A record above the limit is refused before it is sent
    /// ([`ProduceError::TooLarge`](super::ProduceError::TooLarge)). Set it when the
    /// stream's figure cannot be read, or to refuse large records sooner. Records above
    /// [`max_batch_bytes`](Self::max_batch_bytes) go in a PutRecords call of their own
    /// (Kinesis takes 10 MiB per call); the shard's write rate (1 MiB per second) does not
    /// change, so a large record uses up its shard's budget for several seconds.
    pub fn max_record_size(mut self, bytes: usize) -> Self {
        self.max_record_size = Some(bytes);
        self
    }

    /// Seeds the retry jitter (default: random), for reproducible tests.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Validates the configuration and starts the background task. Must be called
    /// inside a tokio runtime.
    pub fn build(self) -> Result<Producer, ConfigError> {
        let settings = self.validate()?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| ConfigError::Invalid {
            field: "build",
            reason: "must be called inside a tokio runtime (the producer spawns its \
                         batching task)"
                .into(),
        })?;
        Ok(Producer::spawn(settings, &runtime))
    }

    pub(crate) fn validate(self) -> Result<Settings, ConfigError> {
        fn at_least_one(field: &'static str, n: usize, max: usize) -> Result<usize, ConfigError> {
            if n == 0 || n > max {
                return Err(ConfigError::Invalid {
                    field,
                    reason: format!("{n} is not in 1..={max}"),
                });
            }
            Ok(n)
        }
        let stream = self
            .stream
            .ok_or(ConfigError::Missing { field: "stream" })?;
        validate_stream_name(&stream)?;
        let kinesis = self
            .kinesis
            .ok_or(ConfigError::Missing { field: "backend" })?;
        if self.retry_min.is_zero() {
            return Err(ConfigError::Invalid {
                field: "retry_backoff",
                reason: "min must be greater than zero".into(),
            });
        }
        if self.retry_max < self.retry_min {
            return Err(ConfigError::Invalid {
                field: "retry_backoff",
                reason: "max is smaller than min".into(),
            });
        }
        if self.max_attempts == 0 {
            return Err(ConfigError::Invalid {
                field: "max_attempts",
                reason: "must be at least 1".into(),
            });
        }
        Ok(Settings {
            stream: stream.into(),
            kinesis,
            linger: self.linger,
            max_batch_records: at_least_one(
                "max_batch_records",
                self.max_batch_records,
                MAX_BATCH_RECORDS,
            )?,
            max_batch_bytes: at_least_one(
                "max_batch_bytes",
                self.max_batch_bytes,
                MAX_BATCH_BYTES,
            )?,
            buffer: at_least_one("buffer", self.buffer, usize::MAX >> 3)?,
            max_in_flight: at_least_one("max_in_flight", self.max_in_flight, 1024)?,
            max_attempts: self.max_attempts,
            retry_min: self.retry_min,
            retry_max: self.retry_max,
            ordered_per_key: self.ordered_per_key,
            aggregation: match self.aggregation {
                Some(aggregation) => {
                    at_least_one(
                        "aggregation.max_size",
                        aggregation.max_size,
                        crate::kinesis::MAX_RECORD_BYTES,
                    )?;
                    if aggregation.max_count == 0 {
                        return Err(ConfigError::Invalid {
                            field: "aggregation.max_count",
                            reason: "0 is not at least 1".into(),
                        });
                    }
                    Some(aggregation)
                }
                None => None,
            },
            rate_limit: match self.rate_limit {
                Some(percent) => Some(at_least_one("rate_limit", percent as usize, 1000)? as u32),
                None => None,
            },
            embed_headers: self.embed_headers,
            seed: self.seed.unwrap_or_else(rand::random),
            max_record_size: match self.max_record_size {
                Some(bytes) => {
                    if !(crate::kinesis::MAX_RECORD_BYTES..=crate::kinesis::MAX_LARGE_RECORD_BYTES)
                        .contains(&bytes)
                    {
                        return Err(ConfigError::Invalid {
                            field: "max_record_size",
                            reason: format!(
                                "{bytes} is not in {}..={} (1 MiB to 10 MiB)",
                                crate::kinesis::MAX_RECORD_BYTES,
                                crate::kinesis::MAX_LARGE_RECORD_BYTES
                            ),
                        });
                    }
                    Some(bytes)
                }
                None => None,
            },
        })
    }
}

/// Kinesis stream names: 1 to 128 characters of `a-z A-Z 0-9 _ . -`.
pub(crate) fn validate_stream_name(stream: &str) -> Result<(), ConfigError> {
    let valid = !stream.is_empty()
        && stream.len() <= 128
        && stream
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if valid {
        Ok(())
    } else {
        Err(ConfigError::Invalid {
            field: "stream",
            reason: format!(
                "{stream:?} is not a Kinesis stream name (1 to 128 of a-z A-Z 0-9 _ . -)"
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::Memory;

    fn field(b: ProducerBuilder) -> &'static str {
        match b.validate() {
            Err(ConfigError::Missing { field } | ConfigError::Invalid { field, .. }) => field,
            Ok(_) => "ok",
        }
    }

    #[test]
    fn refuses_bad_values_naming_the_field() {
        let base = || {
            ProducerBuilder::default()
                .stream("s")
                .backend(Memory::new())
        };
        assert_eq!(field(base()), "ok");
        assert_eq!(
            field(ProducerBuilder::default().backend(Memory::new())),
            "stream"
        );
        assert_eq!(field(ProducerBuilder::default().stream("s")), "backend");
        assert_eq!(field(base().stream("a b")), "stream");
        assert_eq!(field(base().stream("")), "stream");
        assert_eq!(field(base().max_batch_records(0)), "max_batch_records");
        assert_eq!(field(base().max_batch_records(501)), "max_batch_records");
        assert_eq!(
            field(base().max_batch_bytes(MAX_BATCH_BYTES + 1)),
            "max_batch_bytes"
        );
        assert_eq!(field(base().buffer(0)), "buffer");
        assert_eq!(field(base().max_in_flight(0)), "max_in_flight");
        assert_eq!(field(base().max_attempts(0)), "max_attempts");
        let ms = Duration::from_millis;
        assert_eq!(field(base().retry_backoff(ms(0), ms(1))), "retry_backoff");
        assert_eq!(field(base().retry_backoff(ms(10), ms(1))), "retry_backoff");
        assert_eq!(field(base().aggregate(true)), "ok");
        let aggregation = |a: Aggregation| field(base().aggregation(a));
        assert_eq!(
            aggregation(Aggregation::new().max_size(0)),
            "aggregation.max_size"
        );
        assert_eq!(
            aggregation(Aggregation::new().max_size(crate::kinesis::MAX_RECORD_BYTES + 1)),
            "aggregation.max_size"
        );
        assert_eq!(
            aggregation(Aggregation::new().max_count(0)),
            "aggregation.max_count"
        );
        let mib = 1024 * 1024;
        assert_eq!(field(base().max_record_size(10 * mib)), "ok");
        assert_eq!(field(base().max_record_size(mib)), "ok");
        assert_eq!(field(base().max_record_size(mib - 1)), "max_record_size");
        assert_eq!(
            field(base().max_record_size(10 * mib + 1)),
            "max_record_size"
        );
    }

    #[test]
    fn build_outside_a_runtime_is_an_error_not_a_panic() {
        let err = ProducerBuilder::default()
            .stream("s")
            .backend(Memory::new())
            .build()
            .err();
        assert!(matches!(
            err,
            Some(ConfigError::Invalid { field: "build", .. })
        ));
    }
}
