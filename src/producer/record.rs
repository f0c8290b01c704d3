//! What goes into the producer ([`ProducerRecord`]), what comes out ([`Stored`]) and how a
//! call can fail ([`ProduceError`]), with the checks every record passes before it is
//! buffered.

use std::fmt;

use bytes::Bytes;

use crate::headers::{HeaderValue, Headers};
use crate::kinesis::PutRecord;
use crate::sequence::SequenceNumber;

pub use crate::kinesis::{MAX_LARGE_RECORD_BYTES, MAX_PARTITION_KEY_CHARS, MAX_RECORD_BYTES};

/// A record to write: a payload, the partition key that picks its shard, optionally an
/// explicit hash key that picks the shard instead, and the application's [`Headers`]
/// (written into the record when the producer embeds headers, see
/// [`ProducerBuilder::embed_headers`](crate::ProducerBuilder::embed_headers)).
#[derive(Clone)]
pub struct ProducerRecord {
    /// The payload (never logged, never part of an error): `Data` on the wire, named as
    /// a consumed [`Message`](crate::Message)'s is.
    pub payload: Bytes,
    /// The partition key: 1 to 256 Unicode characters.
    pub partition_key: String,
    /// A decimal number in `0..2^128` that decides the shard instead of the MD5 of the
    /// partition key.
    pub explicit_hash_key: Option<String>,
    /// The application's headers (none by default).
    pub headers: Headers,
}

impl ProducerRecord {
    /// A record routed by its partition key.
    pub fn new(payload: impl Into<Bytes>, partition_key: impl Into<String>) -> Self {
        ProducerRecord {
            payload: payload.into(),
            partition_key: partition_key.into(),
            explicit_hash_key: None,
            headers: Headers::new(),
        }
    }

    /// Sets one header (see [`Headers::insert`]).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<HeaderValue>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Replaces the headers.
    pub fn headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// Routes the record by this hash key (decimal, `0..2^128`) instead.
    pub fn with_explicit_hash_key(mut self, hash_key: impl Into<String>) -> Self {
        self.explicit_hash_key = Some(hash_key.into());
        self
    }

    /// The size Kinesis counts against its limits: payload bytes plus the partition
    /// key's UTF-8 bytes (without the headers' framing, which a producer that embeds
    /// headers adds before it checks the limit).
    pub fn size(&self) -> usize {
        self.payload.len().saturating_add(self.partition_key.len())
    }

    /// Checks the record against Kinesis' limits, with `limit` the largest record the
    /// stream takes; returns its size.
    pub(crate) fn validate(&self, limit: usize) -> Result<usize, ProduceError> {
        let chars = self.partition_key.chars().count();
        if chars == 0 {
            return Err(ProduceError::InvalidRecord(
                InvalidRecord::EmptyPartitionKey,
            ));
        }
        if chars > MAX_PARTITION_KEY_CHARS {
            return Err(ProduceError::InvalidRecord(
                InvalidRecord::PartitionKeyTooLong { chars },
            ));
        }
        if let Some(hash_key) = &self.explicit_hash_key {
            if !is_hash_key(hash_key) {
                return Err(ProduceError::InvalidRecord(InvalidRecord::ExplicitHashKey(
                    hash_key.clone(),
                )));
            }
        }
        let size = self.size();
        if size > limit {
            return Err(ProduceError::TooLarge { size, limit });
        }
        Ok(size)
    }

    /// The record as it goes on the wire: with `embed` and headers, the payload framed
    /// with them in Spring's JSON-headers format (with the `opentelemetry` feature, the
    /// current trace context added first, see [`crate::trace`]); with `embed` and no
    /// headers, the bare payload, unless a reader could take it for a frame: then it is
    /// framed with an empty header map, so that it reads back byte for byte. Without
    /// `embed`, the bare payload.
    pub(crate) fn embedded(mut self, embed: bool) -> Result<ProducerRecord, ProduceError> {
        use crate::headers::spring;
        #[cfg(feature = "opentelemetry")]
        if embed {
            crate::trace::inject_current(&mut self.headers);
        }
        if !embed {
            self.headers = Headers::new();
            return Ok(self);
        }
        let headers = std::mem::take(&mut self.headers);
        if let Some(class) = headers.iter().find_map(|(_, value)| match value {
            HeaderValue::Typed { class, .. } if !spring::is_class_name(class) => Some(class),
            _ => None,
        }) {
            return Err(ProduceError::InvalidRecord(InvalidRecord::HeaderClass(
                class.clone(),
            )));
        }
        self.payload =
            // Fails only for lengths past the framing's 4 GiB: above every stream's limit.
            spring::write_embedded(&headers, &self.payload).ok_or(ProduceError::TooLarge {
                size: self.size(),
                limit: MAX_LARGE_RECORD_BYTES,
            })?;
        Ok(self)
    }

    pub(crate) fn into_put_record(self) -> PutRecord {
        PutRecord {
            data: self.payload,
            partition_key: self.partition_key,
            explicit_hash_key: self.explicit_hash_key,
        }
    }
}

impl fmt::Debug for ProducerRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the payload.
        f.debug_struct("ProducerRecord")
            .field("data_len", &self.payload.len())
            .field("partition_key", &self.partition_key)
            .field("explicit_hash_key", &self.explicit_hash_key)
            .field("headers", &self.headers)
            .finish()
    }
}

/// Kinesis' pattern for an explicit hash key, `0|([1-9]\d{0,38})`, and at most 2^128-1.
fn is_hash_key(s: &str) -> bool {
    let digits = !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let canonical = s == "0" || !s.starts_with('0');
    digits && canonical && s.parse::<u128>().is_ok()
}

/// Where Kinesis stored a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The shard that took the record.
    pub shard_id: String,
    /// The sequence number of the Kinesis record that holds it in that shard.
    pub sequence_number: SequenceNumber,
    /// Its place inside that Kinesis record when the producer aggregated it (from 0,
    /// as a consumer's [`Position`](crate::Position) names it); 0 for a plain record.
    pub sub_sequence_number: u64,
}

/// Why a record was refused before it was buffered.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidRecord {
    /// The partition key is empty.
    #[error("the partition key is empty")]
    EmptyPartitionKey,
    /// The partition key has more than 256 Unicode characters.
    #[error(
        "the partition key has {chars} characters, at most {MAX_PARTITION_KEY_CHARS} are allowed"
    )]
    PartitionKeyTooLong {
        /// Its length in characters.
        chars: usize,
    },
    /// The explicit hash key is not a decimal number in `0..2^128` (without leading zeros).
    #[error("the explicit hash key {0:?} is not a decimal number in 0..2^128")]
    ExplicitHashKey(String),
    /// A [`HeaderValue::Typed`] header's class is not a Java class name (dot-separated
    /// identifiers, see [`is_class_name`](crate::headers::spring::is_class_name)): no
    /// reader could take it for one.
    #[error("a typed header's class {0:?} is not a Java class name")]
    HeaderClass(String),
}

/// How a produce call failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProduceError {
    /// The record (payload plus partition key) is larger than its stream accepts.
    /// Refused before anything was sent.
    #[error("the record is {size} bytes (payload and partition key), the limit is {limit}")]
    TooLarge {
        /// The record's size in bytes.
        size: usize,
        /// The stream's maximum record size: [`MAX_RECORD_BYTES`] unless the stream was
        /// set for larger records (see
        /// [`ProducerBuilder::max_record_size`](crate::ProducerBuilder::max_record_size)).
        limit: usize,
    },
    /// The record breaks another Kinesis rule. Refused before anything was sent.
    #[error("invalid record: {0}")]
    InvalidRecord(InvalidRecord),
    /// Kinesis did not store the record: the last entry error (e.g.
    /// `ProvisionedThroughputExceededException`, `KMSAccessDeniedException`) after
    /// `attempts` sends, or, when the whole call failed, the kind of failure (`Throttled`,
    /// `NotFound`, `Invalid`, `ServiceError`) and its message.
    #[error("Kinesis did not store the record after {attempts} attempt(s): {code}: {message}")]
    Failed {
        /// The error code.
        code: String,
        /// The error message.
        message: String,
        /// How many sends of the record were refused or failed (a send again after its
        /// aggregate landed in a shard not owning it is not counted: nothing refused it).
        attempts: u32,
    },
    /// The producer was closed (or its background task stopped) before the record was
    /// accepted or answered.
    #[error("the producer is closed")]
    Closed,
    /// Not sent, so that it is not stored ahead of a record before it that was not
    /// stored (the cause): with `ordered_per_key(true)`, a record of the same partition
    /// key that finally failed while this one waited behind it; or, in
    /// [`Producer::send_all`](super::Producer::send_all), an earlier record of the same
    /// call that was refused before sending.
    #[error("not sent: a record before it was not stored ({0})")]
    AfterFailure(Box<ProduceError>),
}

/// PutRecords entry errors: throughput and internal failures pass with time; KMS
/// errors other than throttling (key disabled, not found, access denied) do not.
pub(super) fn entry_error_is_transient(code: &str) -> bool {
    !code.starts_with("KMS") || code == "KMSThrottlingException"
}

impl ProduceError {
    /// Whether sending the same record again later may succeed: Kinesis did not store
    /// it for a reason that passes with time (throttling, an internal or network
    /// failure, KMS throttling). A refused record, a missing stream, a KMS key that is
    /// disabled or not allowed, or a closed producer is not.
    pub fn is_transient(&self) -> bool {
        match self {
            ProduceError::Failed { code, .. } => {
                !matches!(
                    code.as_str(),
                    "NotFound" | "Invalid" | "Unsupported" | "ExpiredIterator"
                ) && entry_error_is_transient(code)
            }
            // As transient as what it waited for.
            ProduceError::AfterFailure(cause) => cause.is_transient(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_produce_errors_are_the_ones_that_pass_with_time() {
        let failed = |code: &str| ProduceError::Failed {
            code: code.to_owned(),
            message: String::new(),
            attempts: 3,
        };
        for code in [
            "ProvisionedThroughputExceededException",
            "InternalFailure",
            "KMSThrottlingException",
            "Throttled",
            "ServiceError",
        ] {
            assert!(failed(code).is_transient(), "{code}");
        }
        for code in ["KMSAccessDeniedException", "NotFound", "Invalid"] {
            assert!(!failed(code).is_transient(), "{code}");
        }
        assert!(!ProduceError::Closed.is_transient());
    }

    #[test]
    fn hash_keys_follow_the_kinesis_pattern() {
        for ok in ["0", "1", "340282366920938463463374607431768211455"] {
            assert!(is_hash_key(ok), "{ok}");
        }
        let too_big = "340282366920938463463374607431768211456";
        for bad in ["", "01", "+1", "-1", "1.0", "abc", " 1", too_big] {
            assert!(!is_hash_key(bad), "{bad}");
        }
    }

    #[test]
    fn size_counts_payload_and_key_bytes() {
        let r = ProducerRecord::new(vec![0u8; 10], "ключ");
        assert_eq!(r.size(), 10 + "ключ".len());
        let exact = ProducerRecord::new(vec![0u8; MAX_RECORD_BYTES - 1], "k");
        assert_eq!(exact.validate(MAX_RECORD_BYTES), Ok(MAX_RECORD_BYTES));
        let over = ProducerRecord::new(vec![0u8; MAX_RECORD_BYTES], "k");
        assert_eq!(
            over.validate(MAX_RECORD_BYTES),
            Err(ProduceError::TooLarge {
                size: MAX_RECORD_BYTES + 1,
                limit: MAX_RECORD_BYTES
            })
        );
    }

    #[test]
    fn partition_keys_are_counted_in_characters() {
        assert!(ProducerRecord::new("x", "é".repeat(256))
            .validate(MAX_RECORD_BYTES)
            .is_ok());
        assert_eq!(
            ProducerRecord::new("x", "é".repeat(257)).validate(MAX_RECORD_BYTES),
            Err(ProduceError::InvalidRecord(
                InvalidRecord::PartitionKeyTooLong { chars: 257 }
            ))
        );
        assert_eq!(
            ProducerRecord::new("x", "").validate(MAX_RECORD_BYTES),
            Err(ProduceError::InvalidRecord(
                InvalidRecord::EmptyPartitionKey
            ))
        );
    }
}
