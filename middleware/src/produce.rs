//! Processors: a service turns each consumed record into zero, one or many output
//! records, and [`ProduceTo`] stores them in another stream through the
//! [`Producer`] before the input counts as handled.
//!
//! ```no_run
//! # use std::convert::Infallible;
//! use shardflow::producer::Producer;
//! use shardflow::{Memory, Message};
//! use shardflow_middleware::produce::Output;
//! use shardflow_middleware::ServiceBuilderExt;
//! use tower::ServiceBuilder;
//!
//! # fn demo(memory: Memory) -> Result<(), Box<dyn std::error::Error>> {
//! let shipments = Producer::builder()
//!     .stream("shipments")
//!     .backend(memory)
//!     .ordered_per_key(true) // each customer's shipments in the order of their orders
//!     .build()?;
//! let processor = ServiceBuilder::new()
//!     .produce_to(shipments)
//!     .service_fn(|order: Message| async move {
//!         // zero, one or many outputs: an Option, a Vec, an array or one Output
//!         Ok::<_, Infallible>(Output::new(order.payload))
//!     });
//! // consumer.run(processor)
//! # let _ = processor;
//! # Ok(())
//! # }
//! ```
//!
//! # The rule: the checkpoint after the outputs are stored
//!
//! A call of [`ProduceTo`] calls the inner service, hands every output it returned to
//! the producer and resolves `Ok` (with where each output was [`Stored`]) only once
//! Kinesis stored *all* of them. Only then may the consumer's checkpoint pass the input.
//! A crash before that delivers the input again and the function runs again: outputs
//! already stored are written a second time. Delivery end to end is at least once;
//! a consumer of the output stream that needs each output's effect once puts the
//! [`dedup`](crate::dedup) layer in front of its handler, keyed on something the output
//! carries that names its input (Kinesis records have no user attributes, so the output
//! payload has to carry it; `examples/processor.rs` puts the input's
//! `stream/shard/sequence` into each shipment).
//!
//! # Partition keys and order
//!
//! An [`Output`] keeps the input's partition key unless the function chose another
//! ([`Output::partition_key`]). The input's explicit hash key is not copied: it routes
//! in the input stream, not in the output stream.
//!
//! When the consumer delivers a key's records in order (the default, and
//! `Concurrency::PerKey`), the outputs of one key are stored in that order too: the next
//! input of the key is called only after every output of the previous one is stored.
//! The outputs of *one* input are handed over in the order the function returned them;
//! with a producer built with `ordered_per_key(true)` they are handed over all at once
//! ([`Producer::send_all`]: the producer keeps each key's order, retries included); with
//! an unordered producer they go one after the other, each after the previous one was
//! stored, so a retry cannot swap two of them.
//!
//! # Errors and backpressure
//!
//! The inner service's error passes through boxed. An output that Kinesis did not store
//! fails the call with [`ProduceToError`] (the outputs before it may have been stored):
//! the consumer stops the shard and delivers the input again, or a
//! [`dead_letter`](crate::dead_letter) layer above sends it on. Its default policy
//! dead-letters only permanent failures (a record Kinesis refuses, a missing stream);
//! throttling, service errors and a closed producer stop the shard and come back.
//!
//! A full producer buffer makes the call wait for room (nothing is dropped), so the
//! shard reads no further than its bounded prefetch until the producer catches up.
//!
//! # Where an output came from
//!
//! Each call runs in a `debug` span named `shardflow_middleware` with `layer =
//! "produce_to"`, the input's `source_stream`, `shard`, `sequence` and `sub_sequence`
//! and the `target` stream; each stored output is a `debug` event in it with the output
//! stream's shard and sequence number, so a trace links input and outputs.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use shardflow::producer::{ProduceError, Producer, ProducerRecord, Stored};
use shardflow::{HeaderValue, Headers, Message};
use tower::{Layer, Service, ServiceExt};
use tracing::Instrument;

use crate::BoxError;

/// One output record of a processor: a payload, the partition key (or explicit hash
/// key) that routes it when it should not be the input's partition key, and its
/// [`Headers`] (none unless the function sets them: the input's headers are not copied,
/// as a Spring processor's output message starts from its own headers).
///
/// An `Output` is itself an iterator of one output, so a function with exactly one
/// output can return it as it is; `Option<Output>`, `Vec<Output>` and arrays work too.
#[derive(Clone)]
pub struct Output {
    payload: Bytes,
    partition_key: Option<String>,
    explicit_hash_key: Option<String>,
    headers: Headers,
}

impl Output {
    /// An output routed by its input's partition key.
    pub fn new(payload: impl Into<Bytes>) -> Self {
        Output {
            payload: payload.into(),
            partition_key: None,
            explicit_hash_key: None,
            headers: Headers::new(),
        }
    }

    /// An output holding `value` encoded by `encoder`, with its
    /// [`content_type`](crate::codec::Encoder::content_type) as the `contentType` header,
    /// routed by its input's partition key.
    pub fn encode<T, E>(encoder: &E, value: &T) -> Result<Self, E::Error>
    where
        E: crate::codec::Encoder<T> + ?Sized,
    {
        let payload = encoder.encode(value)?;
        Ok(Output::new(payload).with_header(
            crate::decode::CONTENT_TYPE,
            encoder.content_type().to_owned(),
        ))
    }

    /// Sets one header of the output (see [`Headers::insert`]).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<HeaderValue>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Replaces the output's headers.
    pub fn headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// The output's headers.
    pub fn header_map(&self) -> &Headers {
        &self.headers
    }

    /// Routes the output by this partition key instead of the input's.
    pub fn partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Routes the output by this explicit hash key (decimal, `0..2^128`).
    pub fn explicit_hash_key(mut self, hash_key: impl Into<String>) -> Self {
        self.explicit_hash_key = Some(hash_key.into());
        self
    }

    /// The payload.
    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    fn into_record(self, input_key: &str) -> ProducerRecord {
        let key = self.partition_key.unwrap_or_else(|| input_key.to_owned());
        let record = ProducerRecord::new(self.payload, key).headers(self.headers);
        match self.explicit_hash_key {
            Some(hash_key) => record.with_explicit_hash_key(hash_key),
            None => record,
        }
    }
}

impl fmt::Debug for Output {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the payload.
        f.debug_struct("Output")
            .field("payload_len", &self.payload.len())
            .field("partition_key", &self.partition_key)
            .field("explicit_hash_key", &self.explicit_hash_key)
            .field("headers", &self.headers)
            .finish()
    }
}

impl IntoIterator for Output {
    type Item = Output;
    type IntoIter = std::iter::Once<Output>;

    fn into_iter(self) -> Self::IntoIter {
        std::iter::once(self)
    }
}

impl From<Bytes> for Output {
    fn from(payload: Bytes) -> Self {
        Output::new(payload)
    }
}

impl From<Vec<u8>> for Output {
    fn from(payload: Vec<u8>) -> Self {
        Output::new(payload)
    }
}

impl From<String> for Output {
    fn from(payload: String) -> Self {
        Output::new(payload)
    }
}

/// A record the function built itself, with its own partition key.
impl From<ProducerRecord> for Output {
    fn from(record: ProducerRecord) -> Self {
        Output {
            payload: record.payload,
            partition_key: Some(record.partition_key),
            explicit_hash_key: record.explicit_hash_key,
            headers: record.headers,
        }
    }
}

/// An output the producer did not store; the input is not handled.
///
/// What [`NotStored`](Self::NotStored) leaves behind in the output stream: outputs
/// before `index` may be stored (they are written again when the input comes again),
/// output `index` is not. Outputs after it: with an unordered producer, none was handed
/// over; with `ordered_per_key(true)`, none of output `index`'s partition key was sent
/// (each failed with [`ProduceError::AfterFailure`]), and outputs of *other* keys may be
/// stored (they were independent of the failure, and are written again with the input).
/// When output `index` was refused before sending (too large, invalid), nothing after
/// it was sent, whatever its key. So no key ever has an output stored ahead of an
/// earlier output of that key that failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProduceToError {
    /// Output `index` (from 0) of the input's `outputs` was not stored in `stream`.
    #[error("output {index} of {outputs} was not stored in stream {stream}")]
    NotStored {
        /// The output stream.
        stream: Arc<str>,
        /// Which output failed (the earlier ones may be stored).
        index: usize,
        /// How many outputs the input had.
        outputs: usize,
        /// Why the producer did not store it.
        #[source]
        source: ProduceError,
    },
}

impl ProduceToError {
    /// Whether delivering the input again later may succeed: the producer failed for a
    /// reason that passes with time (throttling, a service error) or was closed (the
    /// process is stopping). A record Kinesis refuses or a missing stream is not.
    pub fn is_transient(&self) -> bool {
        match self {
            ProduceToError::NotStored { source, .. } => {
                source.is_transient() || matches!(source, ProduceError::Closed)
            }
        }
    }
}

/// Applies [`ProduceTo`]: `ServiceBuilder::new().produce_to(producer)` (see
/// [`ServiceBuilderExt`](crate::ServiceBuilderExt)) or `.layer(ProduceToLayer::new(producer))`.
#[derive(Clone, Debug)]
pub struct ProduceToLayer {
    producer: Producer,
}

impl ProduceToLayer {
    /// Stores the outputs of the wrapped service with `producer`.
    pub fn new(producer: Producer) -> Self {
        ProduceToLayer { producer }
    }
}

impl<S> Layer<S> for ProduceToLayer {
    type Service = ProduceTo<S>;

    fn layer(&self, inner: S) -> ProduceTo<S> {
        ProduceTo {
            inner,
            producer: self.producer.clone(),
        }
    }
}

/// Calls the inner service and stores its outputs with the producer; resolves once all
/// of them are stored. See the [module docs](self).
#[derive(Clone, Debug)]
pub struct ProduceTo<S> {
    inner: S,
    producer: Producer,
}

impl<S> ProduceTo<S> {
    /// Wraps `inner`: its outputs go to `producer`.
    pub fn new(inner: S, producer: Producer) -> Self {
        ProduceTo { inner, producer }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The producer the outputs go to.
    pub fn producer(&self) -> &Producer {
        &self.producer
    }
}

impl<S, T, R> Service<Message<T>> for ProduceTo<S>
where
    S: Service<Message<T>, Response = R>,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
    R: IntoIterator,
    R::Item: Into<Output>,
{
    /// Where each output was stored, in the order the function returned them.
    type Response = Vec<Stored>;
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, message: Message<T>) -> ResponseFuture {
        let metadata = &message.metadata;
        let span = tracing::debug_span!(
            "shardflow_middleware",
            layer = "produce_to",
            source_stream = %metadata.stream,
            shard = %metadata.shard_id,
            sequence = %metadata.sequence_number,
            sub_sequence = metadata.sub_sequence_number,
            target = self.producer.stream(),
        );
        let input_key = metadata.partition_key.clone();
        let producer = self.producer.clone();
        let called = self.inner.call(message);
        let produce = async move {
            let response = called.await.map_err(Into::into)?;
            let records: Vec<ProducerRecord> = response
                .into_iter()
                .map(|output| output.into().into_record(&input_key))
                .collect();
            store_all(producer, records).await.map_err(BoxError::from)
        };
        ResponseFuture {
            inner: Box::pin(produce.instrument(span)),
        }
    }
}

/// Hands `records` to the producer in order and waits until every one is stored.
async fn store_all(
    mut producer: Producer,
    records: Vec<ProducerRecord>,
) -> Result<Vec<Stored>, ProduceToError> {
    let outputs = records.len();
    let stream: Arc<str> = Arc::from(producer.stream());
    let failed = |index: usize| {
        let stream = stream.clone();
        move |source| ProduceToError::NotStored {
            stream,
            index,
            outputs,
            source,
        }
    };
    let mut stored = Vec::with_capacity(outputs);
    if outputs <= 1 {
        // One output: through `ready` (which waits for room in the buffer: the
        // backpressure) and `call`.
        for (index, record) in records.into_iter().enumerate() {
            let ready = ServiceExt::<ProducerRecord>::ready(&mut producer)
                .await
                .map_err(failed(index))?;
            stored.push(ready.call(record).await.map_err(failed(index))?);
        }
    } else if producer.is_ordered_per_key() {
        // The producer keeps each key's order: hand everything over in one step (so that
        // when one output finally fails, the outputs of its key after it are not sent,
        // nor stored ahead of it when the input comes again), then collect the answers.
        for (index, answer) in producer.send_all(records).await.into_iter().enumerate() {
            stored.push(answer.map_err(failed(index))?);
        }
    } else {
        // An unordered producer may swap two records of a key on a retry: one at a time.
        for (index, record) in records.into_iter().enumerate() {
            let answer = producer.send(record).await;
            stored.push(answer.map_err(failed(index))?);
        }
    }
    for (index, at) in stored.iter().enumerate() {
        tracing::debug!(
            output = index,
            target_shard = %at.shard_id,
            target_sequence = %at.sequence_number,
            "output stored",
        );
    }
    Ok(stored)
}

/// The future of a [`ProduceTo`] call: the inner call, then the outputs' answers.
pub struct ResponseFuture {
    inner: Pin<Box<dyn Future<Output = Result<Vec<Stored>, BoxError>> + Send>>,
}

impl Future for ResponseFuture {
    type Output = Result<Vec<Stored>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
