//! Routes records that finally failed to a sink (another stream, a queue, a table), so
//! one bad record does not hold its shard back forever.
//!
//! When the inner service fails with an error the [`DeadLetterPolicy`] accepts, the
//! layer sends a [`DeadLetterRecord`] — the headers, the payload exactly as it was read
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
//! # Dead letters in a stream: the envelope
//!
//! A [`Producer`] is a sink as it is (`.dead_letter(producer.for_stream("orders-dlq"))`):
//! each dead letter is written as a [`DeadLetterEnvelope`], one JSON object that keeps
//! where the record came from and why it failed, with the original partition key as
//! the dead letter's partition key:
//!
//! ```json
//! {"shardflow_dead_letter":1,"stream":"orders","shard":"shardId-000000000001",
//!  "sequence_number":"4959...","sub_sequence":0,"partition_key":"customer-7",
//!  "error":"decode: expected value at line 1 column 1","attempts":4,
//!  "failed_at_ms":1764530000000,"payload_base64":"bm90IGpzb24="}
//! ```
//!
//! `shardflow stream tail` shows envelopes decoded, and `shardflow dlq replay` writes
//! their payloads back to the original stream with their original partition keys. A
//! sink of your own can use [`DeadLetterEnvelope::from_record`] as well.

use std::cell::Cell;
use std::error::Error;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use pin_project_lite::pin_project;
use shardflow::{Headers, Message};
use tower::util::Oneshot;
use tower::{Layer, Service, ServiceExt};

use shardflow::producer::{ProduceError, Producer, ProducerRecord};

use crate::observe::{chain_any, error_chain, message_span};
use crate::BoxError;

/// What the sink receives for a record that failed.
#[derive(Clone)]
pub struct DeadLetterRecord {
    /// The record's headers.
    pub headers: Headers,
    /// The payload as it was read from the stream.
    pub payload: Bytes,
    /// The error and its causes, joined with `": "`.
    pub error: String,
    /// How many calls of the handler failed, when a [`retry`](crate::retry) layer below
    /// reported it (it does when it gives up); `None` otherwise.
    pub attempts: Option<u32>,
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
            .field("headers", &self.headers)
            .field("payload_len", &self.payload.len())
            .field("error", &self.error)
            .field("attempts", &self.attempts)
            .finish()
    }
}

/// A dead letter as written to a stream (see the [module docs](self)): JSON, with the
/// payload in base64. `shardflow_dead_letter` (the format's version, 1) marks a record
/// as an envelope.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct DeadLetterEnvelope {
    /// The envelope format's version: [`DeadLetterEnvelope::VERSION`].
    pub shardflow_dead_letter: u32,
    /// The stream the record was read from.
    pub stream: String,
    /// The shard it was read from.
    pub shard: String,
    /// Its sequence number (decimal digits).
    pub sequence_number: String,
    /// Its sub-sequence number (the user record within a KPL aggregate; 0 otherwise).
    pub sub_sequence: u64,
    /// Its partition key (the dead letter's partition key too).
    pub partition_key: String,
    /// The error and its causes, joined with `": "`.
    pub error: String,
    /// How many calls of the handler failed, where known: reported by a
    /// [`retry`](crate::retry) layer below the dead-letter layer, `null` without one.
    pub attempts: Option<u32>,
    /// When the record was dead-lettered, epoch milliseconds.
    pub failed_at_ms: u64,
    /// The payload exactly as read, base64 (standard alphabet, padded).
    pub payload_base64: String,
}

/// A record that is not a [`DeadLetterEnvelope`].
#[derive(Debug, thiserror::Error)]
#[error("not a shardflow dead-letter envelope: {0}")]
pub struct NotAnEnvelope(String);

impl DeadLetterEnvelope {
    /// The version this crate writes.
    pub const VERSION: u32 = 1;

    /// The envelope of a dead letter, failed now.
    pub fn from_record(record: &DeadLetterRecord) -> Self {
        let h = &record.headers;
        DeadLetterEnvelope {
            shardflow_dead_letter: Self::VERSION,
            stream: h.stream.to_string(),
            shard: h.shard_id.to_string(),
            sequence_number: h.sequence_number.as_str().to_owned(),
            sub_sequence: h.sub_sequence_number,
            partition_key: h.partition_key.clone(),
            error: record.error.clone(),
            attempts: record.attempts,
            failed_at_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            payload_base64: aws_smithy_types::base64::encode(&record.payload),
        }
    }

    /// The JSON written to the stream.
    pub fn to_json(&self) -> Bytes {
        // Serializing a struct of strings and integers cannot fail.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }

    /// Reads an envelope from a record's data; an error for anything else (other JSON,
    /// another version, a payload that is not base64).
    pub fn from_json(data: &[u8]) -> Result<Self, NotAnEnvelope> {
        let envelope: DeadLetterEnvelope =
            serde_json::from_slice(data).map_err(|e| NotAnEnvelope(e.to_string()))?;
        if envelope.shardflow_dead_letter != Self::VERSION {
            return Err(NotAnEnvelope(format!(
                "version {}",
                envelope.shardflow_dead_letter
            )));
        }
        envelope.payload()?;
        Ok(envelope)
    }

    /// The original payload.
    pub fn payload(&self) -> Result<Bytes, NotAnEnvelope> {
        aws_smithy_types::base64::decode(&self.payload_base64)
            .map(Bytes::from)
            .map_err(|e| NotAnEnvelope(format!("payload_base64: {e}")))
    }
}

impl fmt::Debug for DeadLetterEnvelope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the payload.
        f.debug_struct("DeadLetterEnvelope")
            .field("stream", &self.stream)
            .field("shard", &self.shard)
            .field("sequence_number", &self.sequence_number)
            .field("sub_sequence", &self.sub_sequence)
            .field("error", &self.error)
            .field("attempts", &self.attempts)
            .field("failed_at_ms", &self.failed_at_ms)
            .field("payload_base64_len", &self.payload_base64.len())
            .finish()
    }
}

/// A producer is a dead-letter sink as it is: each dead letter is written as a
/// [`DeadLetterEnvelope`] under the record's own partition key.
impl Service<DeadLetterRecord> for Producer {
    type Response = shardflow::Stored;
    type Error = ProduceError;
    type Future = shardflow::producer::ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProduceError>> {
        Service::<ProducerRecord>::poll_ready(self, cx)
    }

    fn call(&mut self, record: DeadLetterRecord) -> Self::Future {
        let envelope = DeadLetterEnvelope::from_record(&record);
        Service::<ProducerRecord>::call(
            self,
            ProducerRecord::new(envelope.to_json(), record.headers.partition_key),
        )
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

/// The sink refused a record: the call fails so that the record is delivered again.
#[derive(Debug, thiserror::Error)]
#[error(
    "the dead-letter sink failed for record {position} (the record had failed with: {original})"
)]
pub struct DeadLetterError {
    position: shardflow::Position,
    original: String,
    #[source]
    source: BoxError,
}

impl DeadLetterError {
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
    /// Whether the record with `headers`, which failed with `error`, goes to the sink.
    fn should_dead_letter(
        &self,
        error: &(dyn Error + Send + Sync + 'static),
        headers: &Headers,
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
        headers: &Headers,
    ) -> bool {
        !headers.lease_lost.is_cancelled()
            && !chain_any::<crate::dedup::DedupError>(error, |_| true)
            && !chain_any::<crate::batch::BatchError>(error, |e| e.is_transient())
            && !chain_any::<crate::produce::ProduceToError>(error, |e| e.is_transient())
    }
}

impl<F> DeadLetterPolicy for F
where
    F: Fn(&(dyn Error + Send + Sync + 'static), &Headers) -> bool,
{
    fn should_dead_letter(
        &self,
        error: &(dyn Error + Send + Sync + 'static),
        headers: &Headers,
    ) -> bool {
        self(error, headers)
    }
}

/// Sends what the inner service failed on to a sink service.
#[derive(Clone, Debug)]
pub struct DeadLetter<S, K, P = PermanentFailures> {
    inner: S,
    sink: K,
    policy: P,
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
        let span = message_span("dead_letter", &message.headers);
        let copy = Some((message.headers.clone(), message.payload.clone()));
        let future = {
            let _entered = span.enter();
            self.inner.call(message)
        };
        ResponseFuture {
            state: State::Handling { future },
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
}

impl<K> DeadLetterLayer<K, PermanentFailures> {
    /// Dead-letters permanent failures to `sink`.
    pub fn new(sink: K) -> Self {
        DeadLetterLayer {
            sink,
            policy: PermanentFailures,
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
        }
    }
}

impl<S, K: Clone, P: Clone> Layer<S> for DeadLetterLayer<K, P> {
    type Service = DeadLetter<S, K, P>;

    fn layer(&self, inner: S) -> Self::Service {
        DeadLetter {
            inner,
            sink: self.sink.clone(),
            policy: self.policy.clone(),
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
        copy: Option<(Headers, Bytes)>,
        // What a retry layer below reported (0: nothing).
        attempts: u32,
        sink: K,
        policy: P,
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
        // Boxed: the rare path should not make every record's future larger.
        Sinking {
            future: Pin<Box<Oneshot<K, DeadLetterRecord>>>,
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
                StateProj::Handling { future } => {
                    let polled = with_attempts_slot(this.attempts, || future.poll(cx));
                    let error: BoxError = match ready!(polled) {
                        Ok(response) => {
                            return Poll::Ready(Ok(DeadLetterOutcome::Handled(response)))
                        }
                        Err(e) => e.into(),
                    };
                    let Some((headers, payload)) = this.copy.take() else {
                        // Only reachable if polled after completion.
                        return Poll::Ready(Err(error));
                    };
                    if !this.policy.should_dead_letter(&*error, &headers) {
                        return Poll::Ready(Err(error));
                    }
                    let text = error_chain(&*error);
                    let position = headers.position();
                    let record = DeadLetterRecord {
                        headers,
                        payload,
                        error: text.clone(),
                        attempts: (*this.attempts > 0).then_some(*this.attempts),
                    };
                    this.state.set(State::Sinking {
                        future: Box::pin(this.sink.clone().oneshot(record)),
                        position,
                        original: text,
                    });
                }
                StateProj::Sinking {
                    future,
                    position,
                    original,
                } => {
                    return Poll::Ready(match ready!(future.as_mut().poll(cx)) {
                        Ok(_) => {
                            tracing::warn!(error = %original, "record dead-lettered");
                            tracing::debug!(
                                monotonic_counter.shardflow.dead_lettered = 1u64,
                                "dead-lettered",
                            );
                            Ok(DeadLetterOutcome::DeadLettered)
                        }
                        Err(e) => Err(Box::new(DeadLetterError {
                            position: position.clone(),
                            original: std::mem::take(original),
                            source: e.into(),
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
    use crate::test_support::message;

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
        assert_eq!(sunk[0].headers.sequence_number.as_str(), "9");
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
        assert_eq!(
            err.source().map(|s| s.to_string()).as_deref(),
            Some("sink down")
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
        msg.headers.lease_lost.cancel();
        assert_eq!(svc.oneshot(msg).await.unwrap_err().to_string(), "boom");
        assert!(sunk.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_custom_policy_decides() {
        let (sunk, sink) = recording_sink(false);
        let svc = DeadLetterLayer::new(sink)
            .policy(|e: &(dyn Error + Send + Sync + 'static), _: &Headers| {
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
            DeadLetterLayer::new(producer.clone()).layer(failing_with(|| "charge refused".into()));
        let msg = message(42, b"\x00binary\xff");
        let (stream, shard, pk) = (
            msg.headers.stream.to_string(),
            msg.headers.shard_id.to_string(),
            msg.headers.partition_key.clone(),
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
        let envelope = DeadLetterEnvelope::from_json(&record.data).unwrap();
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
        assert_eq!(&envelope.payload().unwrap()[..], b"\x00binary\xff");
        assert!(DeadLetterEnvelope::from_json(b"{\"id\":1}").is_err());
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
}
