//! Routes records that finally failed to a sink (another stream, a queue, a table), so
//! one bad record does not hold its shard back forever.
//!
//! When the inner service fails with an error the [`DeadLetterPolicy`] accepts, the
//! layer sends a [`DeadLetterRecord`] — the metadata, the payload exactly as it was read
//! and the error's text — to the sink service. The record counts as handled (`Ok`) only
//! once the sink accepted it; if the sink fails, the call fails with
//! [`DeadLetterError`] and the consumer delivers the record again. Nothing is lost.
//!
//! Put this layer outermost, above [`decode`](crate::decode): it keeps a copy of the
//! `Message<Bytes>` (cloning `Bytes` is cheap), so even a payload that did not decode
//! reaches the sink intact.
//!
//! The default policy, [`PermanentFailures`], dead-letters every error except transient
//! ones: the [`dedup`](crate::dedup) layer's errors (store down, record in progress
//! elsewhere), a [`batch`](crate::batch) worker that stopped or whose bulk handler was
//! not ready, a [`produce`](crate::produce) output that failed for a transient reason
//! (throttling, a service error, the producer closing), a [`DecodeError`](crate::DecodeError)
//! whose schema registry was unavailable ([`DecodeError::is_transient`](crate::DecodeError::is_transient)), an I/O error that says the
//! other side could not be reached or did not answer in time (a [`std::io::Error`] of
//! kind `ConnectionRefused`, `ConnectionReset`, `TimedOut`, `HostUnreachable` and the
//! like, anywhere in the error's chain: a database that is down), a tokio timeout
//! (`tokio::time::error::Elapsed`), and any error of a record whose lease was lost (its
//! new owner handles it). Those go up so the consumer delivers the record again; a
//! shard that keeps failing so is reported as stuck with its last error, never
//! dead-lettered record by record. A handler whose outage looks different (its client's
//! own error type) passes a policy that names it.
//!
//! # Deadline and panics
//!
//! A sink call (readiness and call) that has not answered after the layer's
//! [`sink_timeout`](DeadLetterLayer::sink_timeout) (30 s by default) fails like a sink
//! error, with [`DeadLetterError::is_timeout`]: the record is delivered again and the
//! shard's last error says why, instead of the shard waiting for ever. The default is
//! above what a [`Producer`](shardflow::producer::Producer) at its default settings can take to store a record while
//! it retries a throttled stream (about 20 s of backoff over 10 attempts) and well below
//! the minute or two after which a consumer reports a shard that does not move.
//!
//! A panic below this layer while a record is being handled — in the inner service's
//! `call` or anywhere in its future, including a [`retry`](crate::retry) layer's
//! readiness wait — is an error to this layer: a [`Panicked`](crate::panic::Panicked) whose text is the panic's
//! message, dead-lettered like any other permanent error. A panic in this layer's own
//! `poll_ready` (the inner service's readiness before a record is given to it) is not
//! caught: no record is involved and the service is in an unknown state, so it goes up
//! to the consumer.
//!
//! # Dead letters in a stream: the envelope
//!
//! A [`Producer`](shardflow::producer::Producer) becomes a sink through [`ProducerSink`]
//! (`.dead_letter(ProducerSink::new(producer.for_stream("orders-dlq")?))`): each dead letter is written as a [`DeadLetterEnvelope`] under the original partition
//! key — a short binary prefix, a JSON header that keeps where the record came from and
//! why it failed, then the payload's raw bytes (see [`envelope`] for the format). Any
//! record Kinesis accepted can be dead-lettered this way: a payload too close to the
//! dead-letter stream's record limit (1 MiB, or up to 10 MiB on a stream set for large
//! records) to fit with its header, or above it, is written in parts cut for that
//! limit, which [`Reassembly`](envelope::Reassembly) puts back together. Envelopes of the earlier
//! JSON format (payload in base64) are still read.
//!
//! The envelope is written as it is, through a [raw](shardflow::producer::Producer::raw)
//! handle of the producer: no header frame and no trace context around it. The record's
//! headers, with the current trace context added when it carries none (the
//! `opentelemetry` feature), travel inside the envelope, and the parts are cut counting
//! every byte that is written.
//!
//! `shardflow stream tail` shows envelopes decoded, and `shardflow dlq replay` writes
//! their payloads back to the original stream with their original partition keys. A
//! sink of your own can use [`DeadLetterEnvelope::from_record`] as well.

pub mod envelope;
mod future;
mod layer;
mod policy;
mod reason;
mod sink;

use std::error::Error;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use shardflow::{Headers, Message, Metadata};
use tower::Service;

use crate::observe::message_span;
use crate::BoxError;

pub use envelope::{DeadLetterEnvelope, EnvelopeError, NotAnEnvelope};
pub(crate) use future::report_attempts;
pub use future::ResponseFuture;
pub use layer::DeadLetterLayer;
pub use policy::{DeadLetterPolicy, PermanentFailures};
pub use reason::Reason;
pub use sink::{ProducerSink, ProducerSinkFuture};

/// How long a sink call may take by default (see the [module docs](self)).
pub const DEFAULT_SINK_TIMEOUT: Duration = Duration::from_secs(30);

/// What the sink receives for a record that failed.
#[derive(Clone)]
pub struct DeadLetterRecord {
    /// The record's metadata.
    pub metadata: Metadata,
    /// The payload as it was read from the stream.
    pub payload: Bytes,
    /// The error and its causes, joined with `": "`.
    pub error: String,
    /// How many calls of the handler failed, when a [`retry`](crate::retry) layer below
    /// reported it (it does when it gives up); `None` otherwise.
    pub attempts: Option<u32>,
    /// The record's own headers (empty when it had none); the envelope keeps them.
    pub headers: Headers,
}

impl fmt::Debug for DeadLetterRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the payload.
        f.debug_struct("DeadLetterRecord")
            .field("metadata", &self.metadata)
            .field("payload_len", &self.payload.len())
            .field("error", &self.error)
            .field("attempts", &self.attempts)
            .field("headers", &self.headers)
            .finish()
    }
}

/// What a dead-lettering call returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeadLetterOutcome<R> {
    /// The inner service succeeded.
    Handled(R),
    /// The inner service failed and the sink accepted the record.
    DeadLettered,
}

impl<R> DeadLetterOutcome<R> {
    /// Whether the record went to the sink.
    pub fn is_dead_lettered(&self) -> bool {
        matches!(self, DeadLetterOutcome::DeadLettered)
    }
}

/// The sink refused a record, or did not answer in time: the call fails so that the
/// record is delivered again.
///
/// Its text names the sink's reason (a consumer shows an error's text as the shard's
/// last error, so the reason a shard does not move is visible there); the sink's own
/// error is [`sink_error`](Self::sink_error), to downcast.
#[derive(Debug, thiserror::Error)]
#[error(
    "the dead-letter sink failed for record {position}: {sink} (the record had failed with: \
     {original})"
)]
pub struct DeadLetterError {
    position: shardflow::Position,
    original: String,
    sink: BoxError,
}

/// The sink did not answer within the layer's
/// [`sink_timeout`](DeadLetterLayer::sink_timeout): the sink error of a
/// [`DeadLetterError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the dead-letter sink did not answer within {after:?}")]
pub struct SinkTimedOut {
    /// The deadline that passed.
    pub after: Duration,
}

impl DeadLetterError {
    /// The sink failed with `sink` on the record at `position`, which had failed with
    /// `original`.
    pub(crate) fn new(position: shardflow::Position, original: String, sink: BoxError) -> Self {
        DeadLetterError {
            position,
            original,
            sink,
        }
    }

    /// Whether the sink did not answer in time (the sink error is a [`SinkTimedOut`]).
    pub fn is_timeout(&self) -> bool {
        self.sink.is::<SinkTimedOut>()
    }

    /// The sink's error: its own, or a [`SinkTimedOut`].
    pub fn sink_error(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.sink
    }

    /// The text of the error that sent the record to the sink.
    pub fn original(&self) -> &str {
        &self.original
    }

    /// The record's position.
    pub fn position(&self) -> &shardflow::Position {
        &self.position
    }
}

/// Sends what the inner service failed on to a sink service.
#[derive(Clone, Debug)]
pub struct DeadLetter<S, K, P = PermanentFailures> {
    inner: S,
    sink: K,
    policy: P,
    sink_timeout: Duration,
}

impl<S, K, P> DeadLetter<S, K, P> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The sink.
    pub fn sink(&self) -> &K {
        &self.sink
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, K, P> Service<Message<Bytes>> for DeadLetter<S, K, P>
where
    S: Service<Message<Bytes>>,
    S::Error: Into<BoxError>,
    K: Service<DeadLetterRecord> + Clone,
    K::Error: Into<BoxError>,
    P: DeadLetterPolicy + Clone,
{
    type Response = DeadLetterOutcome<S::Response>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, K, P>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // The sink is made ready only when a record fails, inside the future.
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, message: Message<Bytes>) -> Self::Future {
        let span = message_span("dead_letter", &message.metadata);
        let copy = (
            message.metadata.clone(),
            message.headers.clone(),
            message.payload.clone(),
        );
        let called = {
            let _entered = span.enter();
            catch_unwind(AssertUnwindSafe(|| self.inner.call(message)))
        };
        ResponseFuture::new(
            called,
            copy,
            self.sink.clone(),
            self.policy.clone(),
            self.sink_timeout,
            span,
        )
    }
}

#[cfg(test)]
mod tests;
