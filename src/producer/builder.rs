//! The producer's configuration and its builder, which refuses bad values with a
//! [`ConfigError`] naming the field.

use std::sync::Arc;
use std::time::Duration;

use crate::backend::Backend;
use crate::error::ConfigError;
use crate::kinesis::KinesisApi;

use super::Producer;

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
    pub(crate) embed_headers: bool,
    pub(crate) seed: u64,
}

/// Builds a [`Producer`]. `stream` and a backend (`backend` or `kinesis`) are required;
/// everything else has a default that suits most streams.
///
/// | setting | default | meaning |
/// |---|---|---|
/// | [`linger`](Self::linger) | 50 ms | how long a record may wait for its batch to fill |
/// | [`max_batch_records`](Self::max_batch_records) | 500 | records per PutRecords call (1..=500) |
/// | [`max_batch_bytes`](Self::max_batch_bytes) | 5 MiB | bytes per call (1..=5 MiB) |
/// | [`buffer`](Self::buffer) | 10,000 | records waiting for the background task |
/// | [`max_in_flight`](Self::max_in_flight) | 4 | PutRecords calls at once |
/// | [`max_attempts`](Self::max_attempts) | 10 | sends of one record before it fails |
/// | [`retry_backoff`](Self::retry_backoff) | 100 ms .. 5 s | delay before a resend |
/// | [`ordered_per_key`](Self::ordered_per_key) | off | keep each partition key's order |
/// | [`embed_headers`](Self::embed_headers) | on | write a record's headers in Spring's JSON framing |
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
    embed_headers: bool,
    seed: Option<u64>,
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
            embed_headers: true,
            seed: None,
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

    /// How many records may wait in the channel to the background task (default
    /// 10,000). The task itself holds at most `max_batch_records × (max_in_flight + 1)`
    /// records (in flight, filling a batch, or waiting to be resent); when both are full
    /// `poll_ready` is pending: that is the backpressure.
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

    /// Whether a record's [`headers`](crate::ProducerRecord::headers) are written into
    /// the record (default on), in Spring Integration's JSON-headers framing: a 4-byte
    /// length, the headers as JSON, a 4-byte length, the payload (see
    /// [`headers::spring`](crate::headers::spring)). A shardflow consumer with the
    /// default [`HeaderFormat::Auto`](crate::HeaderFormat) and a Spring Cloud Stream
    /// Kinesis consumer with its defaults read them back; the framing counts against
    /// the 1 MiB record limit.
    ///
    /// A record without headers is written as its bare payload either way, so the
    /// default costs nothing to applications that set none. It is on because Spring's
    /// Kinesis binders embed headers by default too, and because headers an application
    /// set should not vanish silently. Turn it off when the stream's readers are not
    /// Spring or shardflow (a Lambda function, Firehose, Flink) and must see the
    /// payload alone: the headers are then not written at all.
    pub fn embed_headers(mut self, embed: bool) -> Self {
        self.embed_headers = embed;
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
            embed_headers: self.embed_headers,
            seed: self.seed.unwrap_or_else(rand::random),
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
