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
//! (throttling, a service error, the producer closing), and any error of a record whose
//! lease was lost (its new owner handles it). Those go up so the consumer delivers the record again.
//!
//! # Deadline and panics
//!
//! A sink call (readiness and call) that has not answered after the layer's
//! [`sink_timeout`](DeadLetterLayer::sink_timeout) (30 s by default) fails like a sink
//! error, with [`DeadLetterError::is_timeout`]: the record is delivered again and the
//! shard's last error says why, instead of the shard waiting for ever. The default is
//! above what a [`Producer`] at its default settings can take to store a record while
//! it retries a throttled stream (about 20 s of backoff over 10 attempts) and well below
//! the minute or two after which a consumer reports a shard that does not move.
//!
//! A panic below this layer while a record is being handled — in the inner service's
//! `call` or anywhere in its future, including a [`retry`](crate::retry) layer's
//! readiness wait — is an error to this layer: a [`Panicked`] whose text is the panic's
//! message, dead-lettered like any other permanent error. A panic in this layer's own
//! `poll_ready` (the inner service's readiness before a record is given to it) is not
//! caught: no record is involved and the service is in an unknown state, so it goes up
//! to the consumer.
//!
//! # Dead letters in a stream: the envelope
//!
//! A [`Producer`] becomes a sink through [`ProducerSink`]
//! (`.dead_letter(ProducerSink::new(producer.for_stream("orders-dlq")?))`): each dead letter is written as a [`DeadLetterEnvelope`] under the original partition
//! key — a short binary prefix, a JSON header that keeps where the record came from and
//! why it failed, then the payload's raw bytes (see [`envelope`] for the format). Any
//! record Kinesis accepted can be dead-lettered this way: a payload too close to the
//! 1 MiB limit to fit with its header is written in two parts, which
//! [`Reassembly`](envelope::Reassembly) puts back together. Envelopes of the earlier
//! JSON format (payload in base64) are still read.
//!
//! `shardflow stream tail` shows envelopes decoded, and `shardflow dlq replay` writes
//! their payloads back to the original stream with their original partition keys. A
//! sink of your own can use [`DeadLetterEnvelope::from_record`] as well.

pub mod envelope;

use std::cell::Cell;
use std::error::Error;
use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use pin_project_lite::pin_project;
use shardflow::{Headers, Message, Metadata};
use tower::util::Oneshot;
use tower::{Layer, Service, ServiceExt};

use shardflow::producer::{ProduceError, Producer, ProducerRecord};

use crate::observe::{chain_any, error_chain, message_span};
use crate::panic::Panicked;
use crate::BoxError;

pub use envelope::{DeadLetterEnvelope, EnvelopeError, NotAnEnvelope};

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

thread_local! {
    /// Where the retry layer below reports its attempts for the call the dead-letter
    /// layer is polling on this thread: `Some` only while the dead-letter layer polls
    /// its inner future (see [`with_attempts_slot`]), so a report from anywhere else is
    /// dropped. No allocation per record: the count lives in the dead-letter future.
    static ATTEMPTS: Cell<Option<u32>> = const { Cell::new(None) };
}

/// Called by the retry layer when it gives a record up after `attempts` calls: the
/// dead-letter layer above, if any, puts it in the dead letter.
pub(crate) fn report_attempts(attempts: u32) {
    ATTEMPTS.with(|slot| {
        if slot.get().is_some() {
            slot.set(Some(attempts));
        }
    });
}

/// Polls `poll` with `attempts` (0 = none reported yet) as this thread's attempts slot,
/// and keeps what the retry layer reported meanwhile. The slot is restored even if
/// `poll` panics.
fn with_attempts_slot<T>(attempts: &mut u32, poll: impl FnOnce() -> T) -> T {
    struct Restore<'a> {
        attempts: &'a mut u32,
        previous: Option<u32>,
    }
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            *self.attempts = ATTEMPTS
                .with(|slot| slot.replace(self.previous))
                .unwrap_or(0);
        }
    }
    let previous = ATTEMPTS.with(|slot| slot.replace(Some(*attempts)));
    let _restore = Restore { attempts, previous };
    poll()
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

/// A [`Producer`] as a dead-letter sink: each dead letter is written as a
/// [`DeadLetterEnvelope`] under the record's own partition key, in one record or, for a
/// payload close to the 1 MiB limit, in two parts (see [`envelope`]). The response is
/// where the first part was stored.
///
/// A named adapter rather than a second `Service` implementation on [`Producer`] itself:
/// with two, `producer.ready()` would not know which request type is meant.
///
/// ```no_run
/// # async fn demo(producer: shardflow::producer::Producer) -> Result<(), Box<dyn std::error::Error>> {
/// use shardflow_middleware::{ProducerSink, ServiceBuilderExt};
///
/// let dlq = ProducerSink::new(producer.for_stream("orders-dlq")?);
/// let handler = tower::ServiceBuilder::new()
///     .dead_letter(dlq)
///     .service_fn(|_msg: shardflow::Message| async { Ok::<_, std::io::Error>(()) });
/// # let _ = handler;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ProducerSink {
    producer: Producer,
}

impl ProducerSink {
    /// Writes dead letters through `producer`, to the stream it writes to.
    pub fn new(producer: Producer) -> Self {
        Self { producer }
    }

    /// The producer the dead letters are written through (to flush or close it).
    pub fn producer(&self) -> &Producer {
        &self.producer
    }
}

impl From<Producer> for ProducerSink {
    fn from(producer: Producer) -> Self {
        Self::new(producer)
    }
}

impl Service<DeadLetterRecord> for ProducerSink {
    type Response = shardflow::Stored;
    type Error = ProduceError;
    type Future = ProducerSinkFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProduceError>> {
        Service::<ProducerRecord>::poll_ready(&mut self.producer, cx)
    }

    fn call(&mut self, record: DeadLetterRecord) -> Self::Future {
        let envelope = DeadLetterEnvelope::from_record(&record);
        let key = record.metadata.partition_key;
        let mut parts = match envelope.to_records() {
            Ok(parts) => parts.into_iter(),
            Err(e) => {
                let EnvelopeError::HeaderTooLarge {
                    header,
                    partition_key,
                    limit,
                } = e;
                let size = header
                    .saturating_add(partition_key)
                    .saturating_add(record.payload.len());
                return ProducerSinkFuture {
                    inner: Box::pin(std::future::ready(Err(ProduceError::TooLarge {
                        size,
                        limit,
                    }))),
                };
            }
        };
        // `to_records` returns at least one record (so the `Closed` below is never
        // returned); the first uses the slot this handle reserved in `poll_ready`, the
        // others (if any) wait for their own.
        let first = parts.next().map(|data| {
            Service::<ProducerRecord>::call(&mut self.producer, ProducerRecord::new(data, key.clone()))
        });
        let producer = self.producer.clone();
        ProducerSinkFuture {
            inner: Box::pin(async move {
                let Some(first) = first else {
                    return Err(ProduceError::Closed);
                };
                let stored = first.await?;
                for data in parts {
                    producer
                        .send(ProducerRecord::new(data, key.clone()))
                        .await?;
                }
                Ok(stored)
            }),
        }
    }
}

/// The response future of a [`ProducerSink`].
pub struct ProducerSinkFuture {
    inner: Pin<Box<dyn Future<Output = Result<shardflow::Stored, ProduceError>> + Send>>,
}

impl Future for ProducerSinkFuture {
    type Output = Result<shardflow::Stored, ProduceError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ProducerSinkFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProducerSinkFuture").finish_non_exhaustive()
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

/// Decides which errors are dead-lettered; the others go up (the consumer redelivers).
pub trait DeadLetterPolicy {
    /// Whether the record with `metadata`, which failed with `error`, goes to the sink.
    fn should_dead_letter(
        &self,
        error: &(dyn Error + Send + Sync + 'static),
        metadata: &Metadata,
    ) -> bool;
}

/// The default policy: every error except the transient ones named in the
/// [module docs](self).
#[derive(Clone, Copy, Debug, Default)]
pub struct PermanentFailures;

impl DeadLetterPolicy for PermanentFailures {
    fn should_dead_letter(
        &self,
        error: &(dyn Error + Send + Sync + 'static),
        metadata: &Metadata,
    ) -> bool {
        !metadata.lease_lost.is_cancelled()
            && !chain_any::<crate::dedup::DedupError>(error, |_| true)
            && !chain_any::<crate::batch::BatchError>(error, |e| e.is_transient())
            && !chain_any::<crate::produce::ProduceToError>(error, |e| e.is_transient())
    }
}

impl<F> DeadLetterPolicy for F
where
    F: Fn(&(dyn Error + Send + Sync + 'static), &Metadata) -> bool,
{
    fn should_dead_letter(
        &self,
        error: &(dyn Error + Send + Sync + 'static),
        metadata: &Metadata,
    ) -> bool {
        self(error, metadata)
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
        let copy = Some((
            message.metadata.clone(),
            message.headers.clone(),
            message.payload.clone(),
        ));
        let called = {
            let _entered = span.enter();
            catch_unwind(AssertUnwindSafe(|| self.inner.call(message)))
        };
        let state = match called {
            Ok(future) => State::Handling { future },
            Err(payload) => State::CallPanicked {
                panic: Some(Panicked::from_payload(&*payload)),
            },
        };
        ResponseFuture {
            state,
            sink_timeout: self.sink_timeout,
            copy,
            attempts: 0,
            sink: self.sink.clone(),
            policy: self.policy.clone(),
            span,
        }
    }
}

/// Applies [`DeadLetter`] to services.
#[derive(Clone, Debug)]
pub struct DeadLetterLayer<K, P = PermanentFailures> {
    sink: K,
    policy: P,
    sink_timeout: Duration,
}

impl<K> DeadLetterLayer<K, PermanentFailures> {
    /// Dead-letters permanent failures to `sink`.
    pub fn new(sink: K) -> Self {
        DeadLetterLayer {
            sink,
            policy: PermanentFailures,
            sink_timeout: DEFAULT_SINK_TIMEOUT,
        }
    }
}

impl<K, P> DeadLetterLayer<K, P> {
    /// Uses another policy, e.g. the default one plus your own transient errors:
    ///
    /// ```
    /// # use shardflow_middleware::dead_letter::{DeadLetterLayer, DeadLetterPolicy, PermanentFailures};
    /// # #[derive(Debug)] struct Throttled;
    /// # impl std::fmt::Display for Throttled { fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str("throttled") } }
    /// # impl std::error::Error for Throttled {}
    /// # let sink = ();
    /// let layer = DeadLetterLayer::new(sink).policy(|e: &(dyn std::error::Error + Send + Sync + 'static), h: &_| {
    ///     PermanentFailures.should_dead_letter(e, h) && !e.is::<Throttled>()
    /// });
    /// # let _ = layer;
    /// ```
    pub fn policy<P2>(self, policy: P2) -> DeadLetterLayer<K, P2> {
        DeadLetterLayer {
            sink: self.sink,
            policy,
            sink_timeout: self.sink_timeout,
        }
    }

    /// How long the sink may take to be ready and accept a record
    /// ([`DEFAULT_SINK_TIMEOUT`] unless set; at least 1 ms). Past it the call fails with
    /// a [`DeadLetterError`] whose [`is_timeout`](DeadLetterError::is_timeout) holds,
    /// and the record is delivered again.
    pub fn sink_timeout(mut self, timeout: Duration) -> Self {
        self.sink_timeout = timeout.max(Duration::from_millis(1));
        self
    }
}

impl<S, K: Clone, P: Clone> Layer<S> for DeadLetterLayer<K, P> {
    type Service = DeadLetter<S, K, P>;

    fn layer(&self, inner: S) -> Self::Service {
        DeadLetter {
            inner,
            sink: self.sink.clone(),
            policy: self.policy.clone(),
            sink_timeout: self.sink_timeout,
        }
    }
}

pin_project! {
    /// The response future of [`DeadLetter`].
    pub struct ResponseFuture<F, K, P>
    where
        K: Service<DeadLetterRecord>,
    {
        #[pin]
        state: State<F, K>,
        copy: Option<(Metadata, Headers, Bytes)>,
        // What a retry layer below reported (0: nothing).
        attempts: u32,
        sink: K,
        policy: P,
        sink_timeout: Duration,
        span: tracing::Span,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, K>
    where
        K: Service<DeadLetterRecord>,
    {
        Handling { #[pin] future: F },
        // The inner service panicked in `call`: there is no future to poll.
        CallPanicked { panic: Option<Panicked> },
        // Boxed: the rare path should not make every record's future larger.
        Sinking {
            future: Pin<Box<tokio::time::Timeout<Oneshot<K, DeadLetterRecord>>>>,
            position: shardflow::Position,
            original: String,
        },
    }
}

impl<F, R, E, K, P> Future for ResponseFuture<F, K, P>
where
    F: Future<Output = Result<R, E>>,
    E: Into<BoxError>,
    K: Service<DeadLetterRecord> + Clone,
    K::Error: Into<BoxError>,
    P: DeadLetterPolicy,
{
    type Output = Result<DeadLetterOutcome<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        loop {
            match this.state.as_mut().project() {
                state @ (StateProj::Handling { .. } | StateProj::CallPanicked { .. }) => {
                    let error: BoxError = match state {
                        StateProj::Handling { future } => {
                            // A panic of the inner future is an error (module docs); the
                            // future is not polled again.
                            let polled = catch_unwind(AssertUnwindSafe(|| {
                                with_attempts_slot(this.attempts, || future.poll(cx))
                            }));
                            match polled {
                                Ok(Poll::Pending) => return Poll::Pending,
                                Ok(Poll::Ready(Ok(response))) => {
                                    return Poll::Ready(Ok(DeadLetterOutcome::Handled(response)))
                                }
                                Ok(Poll::Ready(Err(e))) => e.into(),
                                Err(payload) => Box::new(Panicked::from_payload(&*payload)),
                            }
                        }
                        StateProj::CallPanicked { panic } => match panic.take() {
                            Some(panic) => Box::new(panic),
                            None => return Poll::Pending,
                        },
                        // Not reachable: the outer arm matched one of the two above.
                        _ => return Poll::Pending,
                    };
                    let Some((metadata, headers, payload)) = this.copy.take() else {
                        // Only reachable if polled after completion.
                        return Poll::Ready(Err(error));
                    };
                    if !this.policy.should_dead_letter(&*error, &metadata) {
                        return Poll::Ready(Err(error));
                    }
                    let text = error_chain(&*error);
                    let position = metadata.position();
                    let record = DeadLetterRecord {
                        metadata,
                        payload,
                        error: text.clone(),
                        attempts: (*this.attempts > 0).then_some(*this.attempts),
                        headers,
                    };
                    this.state.set(State::Sinking {
                        future: Box::pin(tokio::time::timeout(
                            *this.sink_timeout,
                            this.sink.clone().oneshot(record),
                        )),
                        position,
                        original: text,
                    });
                }
                StateProj::Sinking {
                    future,
                    position,
                    original,
                } => {
                    let answer = match ready!(future.as_mut().poll(cx)) {
                        Ok(answer) => answer.map_err(Into::into),
                        Err(_elapsed) => Err(Box::new(SinkTimedOut {
                            after: *this.sink_timeout,
                        }) as BoxError),
                    };
                    return Poll::Ready(match answer {
                        Ok(_) => {
                            tracing::warn!(error = %original, "record dead-lettered");
                            // Record mode: each record is handled alone (a retry
                            // layer below counts `retries_exhausted` itself).
                            tracing::debug!(
                                monotonic_counter.shardflow.dead_lettered = 1u64,
                                reason = crate::bisect::Reason::FailedAlone.as_str(),
                                "dead-lettered",
                            );
                            Ok(DeadLetterOutcome::DeadLettered)
                        }
                        Err(e) => Err(Box::new(DeadLetterError {
                            position: position.clone(),
                            original: std::mem::take(original),
                            sink: e,
                        })),
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tower::service_fn;

    use super::*;
    use crate::decode::DecodeLayer;
    use crate::dedup::DedupError;
    use crate::test_support::{message, metadata};

    type Sunk = Arc<Mutex<Vec<DeadLetterRecord>>>;

    fn recording_sink(
        fail: bool,
    ) -> (
        Sunk,
        impl Service<DeadLetterRecord, Response = (), Error = BoxError, Future: Send> + Clone,
    ) {
        let sunk: Sunk = Arc::default();
        let into = sunk.clone();
        let sink = service_fn(move |record: DeadLetterRecord| {
            let into = into.clone();
            async move {
                if fail {
                    return Err::<(), BoxError>("sink down".into());
                }
                into.lock().unwrap().push(record);
                Ok(())
            }
        });
        (sunk, sink)
    }

    fn failing_with(
        error: fn() -> BoxError,
    ) -> impl Service<Message<Bytes>, Response = u8, Error = BoxError, Future: Send> + Clone {
        service_fn(move |_m: Message<Bytes>| async move { Err::<u8, _>(error()) })
    }

    #[tokio::test]
    async fn success_passes_through_and_the_sink_is_untouched() {
        let (sunk, sink) = recording_sink(false);
        let svc = DeadLetterLayer::new(sink).layer(service_fn(|_m: Message<Bytes>| async {
            Ok::<_, BoxError>(5u8)
        }));
        assert_eq!(
            svc.oneshot(message(1, b"x")).await.unwrap(),
            DeadLetterOutcome::Handled(5)
        );
        assert!(sunk.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_failure_reaches_the_sink_with_headers_payload_and_error() {
        let (sunk, sink) = recording_sink(false);
        let svc = DeadLetterLayer::new(sink).layer(failing_with(|| "boom".into()));
        let out = svc.oneshot(message(9, b"raw bytes")).await.unwrap();
        assert_eq!(out, DeadLetterOutcome::DeadLettered);
        let sunk = sunk.lock().unwrap();
        assert_eq!(sunk.len(), 1);
        assert_eq!(sunk[0].metadata.sequence_number.as_str(), "9");
        assert_eq!(&sunk[0].payload[..], b"raw bytes");
        assert_eq!(sunk[0].error, "boom");
        assert!(!format!("{:?}", sunk[0]).contains("raw bytes"));
    }

    #[tokio::test]
    async fn a_failing_sink_fails_the_call_so_the_record_comes_back() {
        let (_, sink) = recording_sink(true);
        let svc = DeadLetterLayer::new(sink).layer(failing_with(|| "boom".into()));
        let err = svc.oneshot(message(3, b"x")).await.unwrap_err();
        let err = err
            .downcast_ref::<DeadLetterError>()
            .expect("a DeadLetterError");
        assert_eq!(err.original(), "boom");
        assert_eq!(err.position().sequence.as_str(), "3");
        assert_eq!(err.sink_error().to_string(), "sink down");
        assert!(
            err.to_string()
                .contains("failed for record 3: sink down (the record had failed"),
            "the reason is in the text a consumer shows: {err}"
        );
    }

    #[tokio::test]
    async fn transient_errors_and_lost_leases_are_not_dead_lettered() {
        let (sunk, sink) = recording_sink(false);
        let svc = DeadLetterLayer::new(sink.clone()).layer(failing_with(|| {
            Box::new(DedupError::InProgress {
                waited: Duration::from_secs(1),
            })
        }));
        let err = svc.oneshot(message(1, b"x")).await.unwrap_err();
        assert!(err.is::<DedupError>());

        let svc = DeadLetterLayer::new(sink).layer(failing_with(|| "boom".into()));
        let msg = message(2, b"x");
        msg.metadata.lease_lost.cancel();
        assert_eq!(svc.oneshot(msg).await.unwrap_err().to_string(), "boom");
        assert!(sunk.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_custom_policy_decides() {
        let (sunk, sink) = recording_sink(false);
        let svc = DeadLetterLayer::new(sink)
            .policy(|e: &(dyn Error + Send + Sync + 'static), _: &Metadata| {
                e.to_string() != "retry me"
            })
            .layer(failing_with(|| "retry me".into()));
        assert!(svc.oneshot(message(1, b"x")).await.is_err());
        assert!(sunk.lock().unwrap().is_empty());
    }

    #[derive(serde::Deserialize, Clone)]
    struct Order {
        #[allow(dead_code)]
        id: u64,
    }

    #[tokio::test]
    async fn an_undecodable_payload_reaches_the_sink_raw() {
        let (sunk, sink) = recording_sink(false);
        let decode = DecodeLayer::<Order>::json().layer(service_fn(|_m: Message<Order>| async {
            Ok::<_, BoxError>(())
        }));
        let svc = DeadLetterLayer::new(sink).layer(decode);
        let out = svc.oneshot(message(4, b"{not json")).await.unwrap();
        assert!(out.is_dead_lettered());
        let sunk = sunk.lock().unwrap();
        assert_eq!(&sunk[0].payload[..], b"{not json");
        assert!(
            sunk[0].error.starts_with("payload of record 4"),
            "{}",
            sunk[0].error
        );
        assert!(sunk[0].error.contains("line 1 column"), "{}", sunk[0].error);
    }

    /// Regression: `producer.ready()` did not compile (E0283) in a crate linking the
    /// middleware, because a `Producer` was a `Service` of two request types.
    #[tokio::test(start_paused = true)]
    async fn a_producer_stays_a_service_of_one_request_type() {
        use shardflow::kinesis::StreamAdmin;
        use shardflow::Memory;
        let memory = Memory::new();
        memory.streams().create_stream("orders", 1).await.unwrap();
        let mut producer = Producer::builder()
            .stream("orders")
            .backend(memory.clone())
            .build()
            .unwrap();
        // No request type named: the producer's only one is `ProducerRecord`.
        let stored = producer
            .ready()
            .await
            .unwrap()
            .call(ProducerRecord::new("order", "customer-1"))
            .await
            .unwrap();
        assert_eq!(stored.sub_sequence_number, 0);
        let mut sink = ProducerSink::from(producer.clone());
        let stored = sink
            .ready()
            .await
            .unwrap()
            .call(DeadLetterRecord {
                metadata: metadata(7),
                payload: Bytes::from_static(b"order"),
                error: "refused".into(),
                attempts: None,
                headers: Headers::new(),
            })
            .await
            .unwrap();
        assert_eq!(stored.shard_id, "shardId-000000000000");
        producer.close().await;
    }

    /// A producer sink writes each dead letter as an envelope that keeps the record's
    /// origin, error and exact payload, under the original partition key.
    #[tokio::test(start_paused = true)]
    async fn a_producer_sink_writes_the_envelope() {
        use shardflow::kinesis::{KinesisApi, StartingPosition, StreamAdmin};
        use shardflow::Memory;
        let memory = Memory::new();
        let kinesis = memory.streams().clone();
        kinesis.create_stream("dlq", 1).await.unwrap();
        let producer = Producer::builder()
            .stream("dlq")
            .backend(memory.clone())
            .build()
            .unwrap();
        let svc =
            DeadLetterLayer::new(ProducerSink::new(producer.clone())).layer(failing_with(|| "charge refused".into()));
        let msg = message(42, b"\x00binary\xff");
        let (stream, shard, pk) = (
            msg.metadata.stream.to_string(),
            msg.metadata.shard_id.to_string(),
            msg.metadata.partition_key.clone(),
        );
        assert!(svc.oneshot(msg).await.unwrap().is_dead_lettered());
        producer.close().await;
        let shard_id = kinesis.list_shards("dlq").await.unwrap()[0]
            .shard_id
            .clone();
        let it = kinesis
            .shard_iterator("dlq", &shard_id, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        let page = kinesis.get_records(&it, 10).await.unwrap();
        assert_eq!(page.records.len(), 1);
        let record = &page.records[0];
        assert_eq!(record.partition_key, pk);
        let envelope = DeadLetterEnvelope::from_bytes(&record.data).unwrap();
        assert_eq!(
            (
                envelope.stream.as_str(),
                envelope.shard.as_str(),
                envelope.sequence_number.as_str(),
                envelope.sub_sequence,
                envelope.partition_key.as_str(),
            ),
            (stream.as_str(), shard.as_str(), "42", 0, pk.as_str())
        );
        assert!(
            envelope.error.contains("charge refused"),
            "{}",
            envelope.error
        );
        assert_eq!(&envelope.payload[..], b"\x00binary\xff");
        assert!(DeadLetterEnvelope::from_bytes(b"{\"id\":1}").is_err());
    }

    /// The retry layer below reports how many calls failed; without one it is unknown.
    #[tokio::test(start_paused = true)]
    async fn the_dead_letter_carries_the_retry_layers_attempts() {
        use crate::retry::{Backoff, RetryLayer};
        let (sunk, sink) = recording_sink(false);
        let retried = RetryLayer::new(
            Backoff::exponential()
                .max_attempts(3)
                .initial_delay(Duration::from_millis(5)),
        )
        .layer(failing_with(|| "still failing".into()));
        let svc = DeadLetterLayer::new(sink.clone()).layer(retried);
        assert!(svc
            .oneshot(message(7, b"x"))
            .await
            .unwrap()
            .is_dead_lettered());
        let svc = DeadLetterLayer::new(sink).layer(failing_with(|| "no retry".into()));
        assert!(svc
            .oneshot(message(8, b"y"))
            .await
            .unwrap()
            .is_dead_lettered());
        let sunk = sunk.lock().unwrap();
        assert_eq!(
            sunk.iter().map(|r| r.attempts).collect::<Vec<_>>(),
            vec![Some(3), None]
        );
        assert_eq!(
            DeadLetterEnvelope::from_record(&sunk[0]).attempts,
            Some(3),
            "the envelope keeps them"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_dead_letter_keeps_the_records_headers() {
        let (sunk, sink) = recording_sink(false);
        let svc = DeadLetterLayer::new(sink).layer(failing_with(|| "refused".into()));
        let failing = message(9, b"x")
            .with_header("contentType", "application/json")
            .with_header("correlationId", "c-9");
        assert!(svc.oneshot(failing).await.unwrap().is_dead_lettered());
        let sunk = sunk.lock().unwrap();
        let expected: Headers = [
            ("contentType", "application/json"),
            ("correlationId", "c-9"),
        ]
        .into_iter()
        .collect();
        assert_eq!(sunk[0].headers, expected);
        let envelope = DeadLetterEnvelope::from_record(&sunk[0]);
        let records = envelope.to_records().unwrap();
        let back = DeadLetterEnvelope::from_bytes(&records[0]).unwrap();
        assert_eq!(back.headers, expected, "the envelope keeps them");
    }

    /// Reads every record of the one-shard stream `stream` from its start.
    async fn read_stream(
        kinesis: &shardflow::memory::MemoryKinesis,
        stream: &str,
    ) -> Vec<shardflow::kinesis::Record> {
        use shardflow::kinesis::{KinesisApi, StartingPosition};
        let shard_id = kinesis.list_shards(stream).await.unwrap()[0]
            .shard_id
            .clone();
        let it = kinesis
            .shard_iterator(stream, &shard_id, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        kinesis.get_records(&it, 100).await.unwrap().records
    }

    /// Regression: a payload over about 786 KB made an envelope over the record limit,
    /// so the dead letter was refused and the record delivered again for ever.
    #[tokio::test(start_paused = true)]
    async fn a_record_of_any_accepted_size_is_dead_lettered_to_a_stream_byte_exact() {
        use shardflow::kinesis::StreamAdmin;
        use shardflow::producer::MAX_RECORD_BYTES;
        use shardflow::Memory;
        let memory = Memory::new();
        let kinesis = memory.streams().clone();
        kinesis.create_stream("dlq", 1).await.unwrap();
        let producer = Producer::builder()
            .stream("dlq")
            .backend(memory.clone())
            .build()
            .unwrap();
        let svc =
            DeadLetterLayer::new(ProducerSink::new(producer.clone())).layer(failing_with(|| "charge refused".into()));
        // A 256-character key (the most Kinesis takes) of 384 bytes.
        let key = "ключ".repeat(32) + &"k".repeat(128);
        let payload = |len: usize| -> Bytes { (0..len).map(|i| (i * 7 % 256) as u8).collect() };
        let sizes = [1_000_000, MAX_RECORD_BYTES - key.len()];
        for (sequence, size) in (1u64..).zip(sizes) {
            let mut msg = Message::new(metadata(sequence), payload(size));
            msg.metadata.partition_key = key.clone();
            let svc = svc.clone();
            assert!(svc.oneshot(msg).await.unwrap().is_dead_lettered());
        }
        producer.close().await;
        let records = read_stream(&kinesis, "dlq").await;
        assert_eq!(
            records.len(),
            3,
            "one record, then the largest in two parts"
        );
        let mut parts = envelope::Reassembly::new();
        let mut letters = Vec::new();
        for record in &records {
            assert_eq!(record.partition_key, key);
            assert!(record.data.len() + key.len() <= MAX_RECORD_BYTES);
            letters.extend(parts.push(DeadLetterEnvelope::from_bytes(&record.data).unwrap()));
        }
        assert_eq!(parts.incomplete(), 0);
        letters.sort_by(|a, b| a.sequence_number.cmp(&b.sequence_number));
        assert_eq!(letters.len(), 2);
        for ((sequence, size), letter) in (1u64..).zip(sizes).zip(&letters) {
            assert_eq!(letter.payload, payload(size), "byte-exact");
            assert_eq!(
                (
                    letter.stream.as_str(),
                    letter.shard.as_str(),
                    letter.sequence_number.clone(),
                    letter.partition_key.as_str(),
                    letter.error.as_str(),
                ),
                (
                    "orders",
                    "shardId-000000000000",
                    sequence.to_string(),
                    key.as_str(),
                    "charge refused"
                )
            );
        }
    }

    /// Regression: a dead-letter sink that never answered stalled its shard for good.
    #[tokio::test(start_paused = true)]
    async fn a_sink_that_never_answers_fails_the_call_after_the_sink_timeout() {
        let silent =
            service_fn(|_r: DeadLetterRecord| std::future::pending::<Result<(), BoxError>>());
        for (layer, deadline) in [
            (DeadLetterLayer::new(silent), DEFAULT_SINK_TIMEOUT),
            (
                DeadLetterLayer::new(silent).sink_timeout(Duration::from_secs(5)),
                Duration::from_secs(5),
            ),
        ] {
            let svc = layer.layer(failing_with(|| "boom".into()));
            let start = tokio::time::Instant::now();
            let err = tokio::time::timeout(Duration::from_secs(600), svc.oneshot(message(3, b"x")))
                .await
                .expect("the call ends")
                .unwrap_err();
            assert_eq!(start.elapsed(), deadline);
            let err = err
                .downcast_ref::<DeadLetterError>()
                .expect("a DeadLetterError");
            assert!(err.is_timeout(), "{err}");
            assert_eq!(err.original(), "boom");
            assert_eq!(
                err.sink_error().to_string(),
                format!("the dead-letter sink did not answer within {deadline:?}")
            );
            assert!(err.to_string().contains("did not answer within"), "{err}");
        }
    }

    /// A sink that is never ready is bounded by the same deadline.
    #[tokio::test(start_paused = true)]
    async fn a_sink_that_is_never_ready_fails_the_call_after_the_sink_timeout() {
        #[derive(Clone)]
        struct NeverReady;
        impl Service<DeadLetterRecord> for NeverReady {
            type Response = ();
            type Error = BoxError;
            type Future = std::future::Ready<Result<(), BoxError>>;
            fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
                Poll::Pending
            }
            fn call(&mut self, _r: DeadLetterRecord) -> Self::Future {
                std::future::ready(Ok(()))
            }
        }
        let svc = DeadLetterLayer::new(NeverReady).layer(failing_with(|| "boom".into()));
        let err = tokio::time::timeout(Duration::from_secs(600), svc.oneshot(message(3, b"x")))
            .await
            .expect("the call ends")
            .unwrap_err();
        assert!(err
            .downcast_ref::<DeadLetterError>()
            .is_some_and(DeadLetterError::is_timeout));
    }

    /// A handler that panics, in its future or in `call`, is dead-lettered with the
    /// panic's message; under a retry layer after its attempts, which it reports.
    #[tokio::test(start_paused = true)]
    async fn a_panicking_handler_is_dead_lettered_with_the_panic_message() {
        use crate::retry::{Backoff, RetryLayer};
        #[derive(Clone)]
        struct PanicsInCall;
        impl Service<Message<Bytes>> for PanicsInCall {
            type Response = ();
            type Error = BoxError;
            type Future = std::future::Ready<Result<(), BoxError>>;
            fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
                Poll::Ready(Ok(()))
            }
            fn call(&mut self, _m: Message<Bytes>) -> Self::Future {
                panic!("poison in call")
            }
        }
        let (sunk, sink) = recording_sink(false);
        let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = calls.clone();
        let in_future = service_fn(move |m: Message<Bytes>| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async move {
                if m.metadata.sequence_number.as_str() == "2" {
                    panic!("poison record {}", m.metadata.sequence_number);
                }
                Ok::<_, BoxError>(())
            }
        });
        let policy = Backoff::exponential()
            .max_attempts(3)
            .initial_delay(Duration::from_millis(5));
        let retried = DeadLetterLayer::new(sink.clone())
            .layer(RetryLayer::new(policy.clone()).layer(in_future));
        for sequence in 1..=3 {
            let out = retried
                .clone()
                .oneshot(message(sequence, b"x"))
                .await
                .unwrap();
            assert_eq!(out.is_dead_lettered(), sequence == 2);
        }
        assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1 + 3 + 1);
        let bare = DeadLetterLayer::new(sink.clone()).layer(PanicsInCall);
        assert!(bare
            .oneshot(message(4, b"y"))
            .await
            .unwrap()
            .is_dead_lettered());
        let in_call = DeadLetterLayer::new(sink).layer(RetryLayer::new(policy).layer(PanicsInCall));
        assert!(in_call
            .oneshot(message(5, b"z"))
            .await
            .unwrap()
            .is_dead_lettered());
        let sunk = sunk.lock().unwrap();
        assert_eq!(
            sunk.iter()
                .map(|r| (
                    r.metadata.sequence_number.as_str(),
                    r.error.as_str(),
                    r.attempts
                ))
                .collect::<Vec<_>>(),
            vec![
                ("2", "the handler panicked: poison record 2", Some(3)),
                ("4", "the handler panicked: poison in call", None),
                ("5", "the handler panicked: poison in call", Some(3)),
            ]
        );
    }
}
