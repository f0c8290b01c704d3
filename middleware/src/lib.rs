//! Tower layers over shardflow's [`Message`](shardflow::Message) and
//! [`Batch`](shardflow::Batch): decode, dedup, retry, dead-letter and batch, and
//! [`produce`]: processors whose outputs are stored in another stream before the input
//! counts as handled.
//!
//! The consumer calls a `tower::Service<Message>` once per record (or a
//! `Service<Batch>` once per read) and reads the result as a verdict:
//!
//! * `Ok` — the record is handled; the shard's checkpoint may pass it.
//! * `Err` — stop the shard and deliver again from the checkpoint. Nothing is lost.
//!
//! Every layer here keeps that rule. A layer returns `Ok` only when the record really
//! is finished (handled, found already handled by [`dedup`], or accepted by the
//! [`dead_letter`] sink) and returns `Err` for everything else.
//!
//! # A stack
//!
//! ```no_run
//! # use std::convert::Infallible;
//! use shardflow::Message;
//! use shardflow_middleware::{RetryPolicy, MemoryDedupStore, ServiceBuilderExt};
//! use shardflow_middleware::dead_letter::DeadLetterRecord;
//! use tower::ServiceBuilder;
//!
//! #[derive(Clone, serde::Deserialize)]
//! struct Order { id: u64 }
//!
//! # async fn charge(_: &Order) -> Result<(), std::io::Error> { Ok(()) }
//! # fn demo() {
//! let dlq = tower::service_fn(|record: DeadLetterRecord| async move {
//!     // send `record` to another stream, a queue or a table
//!     Ok::<_, Infallible>(())
//! });
//! let handler = ServiceBuilder::new() // outermost first: order is meaning
//!     .dead_letter(dlq) // what still fails below lands here, with its error
//!     .decode::<Order>() // Message<Bytes> -> Message<Order>; bad JSON is an error
//!     .dedup(MemoryDedupStore::new(100_000))
//!     .retry(RetryPolicy::exponential().max_attempts(5))
//!     .service_fn(|msg: Message<Order>| async move { charge(&msg.payload).await });
//! # let _ = handler;
//! # }
//! ```
//!
//! To dead-letter into another Kinesis stream, give the layer a [`ProducerSink`]
//! (`ProducerSink::new(producer.for_stream("orders-dlq")?)`): it writes envelopes that
//! `shardflow stream tail` decodes and `shardflow dlq replay` writes back.
//!
//! Put [`dead_letter`] above [`decode`]: it keeps the raw bytes of each record, so a
//! payload that [`decode`] rejects still reaches the dead-letter sink as it was read.
//! Put [`retry`] innermost, next to the handler: a retry then never re-reserves a
//! [`dedup`] key nor decodes twice.
//!
//! Where [`dedup`] goes is a choice:
//!
//! * **Below [`decode`]** (as above): the key can come from the typed payload (a business
//!   id, to drop duplicates the producer wrote), but a record that was dead-lettered and
//!   is delivered again (its checkpoint had not moved yet) is dead-lettered again: the
//!   sink sees it at least once.
//! * **Outermost**, keyed by position:
//!   `ServiceBuilder::new().dedup(store).dead_letter(sink).decode::<T>().retry(policy)`.
//!   A dead-lettered record then counts as done, so a redelivery skips the sink too:
//!   handler *and* dead-letter sink see each record effectively once.
//!
//! All services are `Clone` when what they wrap is, and `Send` with `Send` futures, as
//! `Consumer::run` needs (it clones the stack per shard). Every layer's error is
//! `Display + Send`.
//!
//! # Batch mode
//!
//! With `Consumer::run_batches` the service receives a whole read
//! ([`Batch`](shardflow::Batch)); [`batch`]'s [`Batching`] re-chunks it for a bulk
//! handler, and [`bisect`]'s [`Bisect`] narrows a failing batch down to the records
//! that fail alone and dead-letters those. The per-record layers (decode, dedup, retry,
//! dead-letter) serve record mode.
//!
//! # Errors
//!
//! Like tower's own middleware, layers that add failures of their own return
//! [`BoxError`]; the concrete errors are small enums and structs you can
//! [`downcast_ref`](std::error::Error) to: [`DecodeError`],
//! [`DedupError`](dedup::DedupError), [`DeadLetterError`](dead_letter::DeadLetterError)
//! (a [`bisect`] sink that failed too),
//! [`BatchError`](batch::BatchError), [`ProduceToError`], [`Panicked`](panic::Panicked).
//! [`Retry`] passes the handler's own error type through unchanged. [`DedupError`](dedup::DedupError) is transient by
//! definition (the store is down or another consumer holds the record), so the default
//! dead-letter policy never dead-letters it: the shard stops and the record comes back.
//!
//! # Observability
//!
//! Layers that do asynchronous work per record run it inside a `debug` span named
//! `shardflow_middleware` with the fields `layer`, `shard`, `sequence` and
//! `sub_sequence`. Payloads and partition keys are never logged; decode errors describe
//! where the input broke, not what it held.
//!
//! Counters are `debug` events with a `monotonic_counter.*` field of value 1 (the
//! convention of `tracing-opentelemetry`'s metrics layer); each event is counted once, by the
//! layer named:
//!
//! | counter | emitted by | when |
//! |---|---|---|
//! | `shardflow.handled` | [`retry`] | the handler returned `Ok` (field `attempts`) |
//! | `shardflow.retried` | [`retry`] | a failed attempt is scheduled again |
//! | `shardflow.retries_exhausted` | [`retry`] | attempts or time ran out; the error goes up |
//! | `shardflow.deduplicated` | [`dedup`] | the key was already done; the handler was skipped |
//! | `shardflow.dead_lettered` | [`dead_letter`], [`bisect`] | the sink accepted a failed record (field `reason`: `failed_alone`, `too_old`, `attempts_exhausted`) |
//! | `shardflow.decode_failed` | [`decode`] | a payload did not decode |
//! | `shardflow.batches` | [`batch`] | a batch was handed to the bulk handler (field `size`) |
//! | `shardflow.batches_split` | [`bisect`], [`batch`] | a failed batch was split in two to find the record that fails alone (field `size`) |
//!
//! Dead letters are also counted through the [`metrics`](https://docs.rs/metrics) facade, as
//! [`metrics::DEAD_LETTERS`] (`shardflow_dead_letters_total`, labels `stream` and `reason`),
//! so the exporter that shows the consumer's `shardflow::metrics` shows them too.

#![warn(missing_docs)]

pub mod batch;
pub mod bisect;
pub mod codec;
pub mod dead_letter;
pub mod decode;
pub mod dedup;
pub mod metrics;
pub mod panic;
pub mod produce;
pub mod retry;
pub mod schema_registry;

mod builder;
mod observe;
mod splits;

pub use batch::{BatchConfig, BatchLayer, Batching};
pub use bisect::{Bisect, BisectConfig, BisectLayer, LeaseLostWhileSplitting, Splits};
pub use builder::ServiceBuilderExt;
pub use codec::{DataFormat, EncodeRecord, Encoder, SchemaFormat, WriterSchema};
pub use dead_letter::{
    DeadLetter, DeadLetterEnvelope, DeadLetterLayer, DeadLetterOutcome, DeadLetterRecord,
    ProducerSink,
};
pub use decode::{Decode, DecodeError, DecodeErrorKind, DecodeLayer, Format, Json};
pub use dedup::{Dedup, DedupLayer, DedupOutcome, DedupStore, DynamoDedupStore, MemoryDedupStore};
pub use produce::{Output, ProduceTo, ProduceToError, ProduceToLayer};
pub use retry::{Classify, ErrorClass, Retry, RetryLayer, RetryPolicy};

/// The boxed error that layers adding failures of their own return (as tower does).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[cfg(test)]
pub(crate) mod test_support;
