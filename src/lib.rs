//! shardflow: AWS Kinesis as a `Stream` of messages, handled by `tower` services, with
//! each shard's checkpoint committed to DynamoDB only after its records were handled.
//!
//! Start with [`Consumer::builder`]; the README has a tour.
//!
//! # The public surface
//!
//! | Item | What it is for |
//! |------|----------------|
//! | [`Consumer`], [`ConsumerBuilder`], [`InitialPosition`], [`CheckpointPolicy`], [`Concurrency`], [`BalanceBy`] | configure a worker of a consumer group ([`consumer`] has the rest of the config) |
//! | [`Run`], [`Running`], [`BatchStream`], [`ShutdownHandle`] | run it: a service per record or per batch, or a stream of batches; stop it |
//! | [`ShardEvent`] | what happens to a worker's shards (leases taken, lost, handed off; shards ended; handler failures), for [`ConsumerBuilder::on_event`] |
//! | [`Health`] (`Running::health()`) | liveness and readiness: is the worker renewing, are its shards advancing or failing |
//! | [`metrics`] | the names, types and labels of the metrics recorded through the `metrics` facade |
//! | [`Message`], [`Metadata`], [`MetadataBuilder`], [`Batch`], [`AckHandle`] | what handlers receive, and acknowledging a batch in stream mode; [`Metadata`] is what Kinesis says about a record |
//! | [`Headers`], [`HeaderValue`], [`HeaderFormat`], [`headers`] | what the application says about a record (`contentType`, `correlationId`, its own names), carried inside the record in Spring Cloud Stream's formats |
//! | `trace` (feature `opentelemetry`) | W3C trace context from producer to consumer through the headers: the handler's span continues the record's trace |
//! | [`Producer`], [`ProducerBuilder`], [`ProducerRecord`], [`Stored`] | write to a stream (a `tower` service that batches PutRecords) |
//! | [`Backend`], [`Aws`], [`AwsTimeouts`], [`Memory`], [`MemoryBuilder`], [`KinesisLimits`] | where streams and lease tables live: AWS (with the SDK's timeouts), or the embedded in-process backend (optionally with Kinesis' per-shard throughput limits; [`Memory::wait_caught_up`] for tests of your own) |
//! | [`ConsumerError`], [`ConfigError`], [`ProduceError`] | typed errors; `is_transient()` says whether trying later may succeed |
//! | [`AwsError`], [`ErrorDetail`] | what AWS answered to a failed call (code, message, HTTP status): the `source()` of a Kinesis or lease-store error |
//! | [`SequenceNumber`], [`Position`] | Kinesis sequence numbers (up to 129 digits, ordered numerically) and positions in a shard |
//! | [`kinesis`] ([`kinesis::KinesisApi`], [`kinesis::StreamAdmin`]) | the Kinesis calls shardflow makes, for wrapping or reimplementing a backend; stream administration (create, split, merge) for examples, tests and tools, through [`Backend::admin`] |
//! | [`lease`] ([`lease::LeaseStore`], [`lease::Lease`], [`lease::Checkpoint`]) | the lease table: rows, checkpoints, the store trait |
//! | [`memory`] | the embedded backend's streams and lease tables, with resharding and fault injection |
//! | [`aggregation`] | KPL aggregation and de-aggregation |
//! | [`admin`] | operating a group from outside: checkpoint resets, safe while it runs; reading a table's rows by stream and shard |
//! | [`backoff`] | the exponential backoff with jitter that the consumer, the producer and the middleware's retry layer share |
//! | [`backend`], [`message`], [`producer`], [`sequence`] | the modules of the items above |
//!
//! # Testing your handlers
//!
//! A handler is a `tower` service over [`Message`]; unit-test it with a hand-built
//! message ([`Message::for_test`], or [`Metadata::builder`] to set the metadata), no
//! consumer needed:
//!
//! ```
//! use bytes::Bytes;
//! use shardflow::{Metadata, Message};
//! use tower::{service_fn, Service, ServiceExt};
//!
//! async fn count_bytes(msg: Message) -> Result<usize, std::convert::Infallible> {
//!     Ok(msg.payload.len())
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let mut handler = service_fn(count_bytes);
//! let msg = Message::for_test(Bytes::from_static(b"hello"));
//! assert_eq!(handler.ready().await.unwrap().call(msg).await, Ok(5));
//!
//! // The metadata, when the handler looks at it:
//! let msg = Metadata::builder()
//!     .shard_id("shardId-000000000007")
//!     .sequence_number(42)
//!     .partition_key("customer-1")
//!     .message(Bytes::from_static(b"{}"));
//! assert_eq!(msg.metadata.sequence_number.as_str(), "42");
//! # }
//! ```

#![warn(missing_docs)]

pub mod admin;
pub mod aggregation;
pub mod backend;
pub mod backoff;
mod clock;
pub mod consumer;
pub mod dynamodb_streams;
mod error;
pub mod headers;
pub mod kinesis;
pub mod lease;
pub mod memory;

pub mod message;
pub mod metrics;
pub mod producer;
pub mod sequence;
#[cfg(feature = "opentelemetry")]
pub mod trace;

pub use backend::{Aws, AwsTimeouts, Backend};
pub use consumer::{
    BalanceBy, BatchStream, CheckpointPolicy, Concurrency, ConfigError, Consumer, ConsumerBuilder,
    ConsumerError, Health, InitialPosition, Run, Running, ShardEvent, ShutdownHandle,
};
pub use error::{AwsError, ErrorDetail};
pub use headers::{HeaderFormat, HeaderValue, Headers};
pub use memory::{KinesisLimits, Memory, MemoryBuilder};
pub use message::{AckEvent, AckHandle, AckLog, Batch, Message, Metadata, MetadataBuilder};
pub use producer::{ProduceError, Producer, ProducerBuilder, ProducerRecord, Stored};
pub use sequence::{Position, SequenceNumber};

/// The README's Rust blocks, compiled (and the self-contained ones run) as doc tests, so
/// the code a newcomer copies from the front page keeps compiling.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The DynamoDB Streams guide's Rust blocks, compiled as doc tests like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/dynamodb-streams.md")]
pub struct DynamodbStreamsDoctests;

/// The trace-context page's Rust blocks, compiled as doc tests like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/tracing.md")]
pub struct TracingDoctests;
