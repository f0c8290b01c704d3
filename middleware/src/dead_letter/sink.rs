//! [`ProducerSink`]: a [`Producer`] as a dead-letter sink.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use shardflow::producer::{ProduceError, Producer, ProducerRecord, MAX_RECORD_BYTES};
use tower::Service;

use super::envelope::{DeadLetterEnvelope, EnvelopeError};
use super::DeadLetterRecord;

/// A [`Producer`] as a dead-letter sink: each dead letter is written as a
/// [`DeadLetterEnvelope`] under the record's own partition key, in one record or, for a
/// payload close to the dead-letter stream's record limit or above it, in parts (see
/// [`envelope`](super::envelope)). The response is where the first part was stored.
///
/// The parts are cut for the dead-letter stream's own maximum record size
/// ([`Producer::max_record_size`]: 1 MiB, or up to 10 MiB on a stream set for large
/// records), read before the first dead letter; if it cannot be read, for the 1 MiB
/// every stream takes.
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
pub struct ProducerSink {
    producer: Producer,
    /// The dead-letter stream's maximum record size, once known.
    limit: Option<usize>,
    /// Reading it (in `poll_ready`, before the first dead letter).
    lookup: Option<Pin<Box<dyn Future<Output = usize> + Send>>>,
}

impl Clone for ProducerSink {
    fn clone(&self) -> Self {
        Self {
            producer: self.producer.clone(),
            limit: self.limit,
            lookup: None,
        }
    }
}

impl fmt::Debug for ProducerSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProducerSink")
            .field("producer", &self.producer)
            .field("limit", &self.limit)
            .finish_non_exhaustive()
    }
}

impl ProducerSink {
    /// Writes dead letters through `producer`, to the stream it writes to. The envelope
    /// is written as it is ([`Producer::raw`]): the record's headers, with the current
    /// trace context added (see [`Headers::insert_current_trace_context`]), travel inside
    /// it, never in a frame around it, so every byte written counts against the record
    /// limit where the envelope's parts are cut, and `dlq replay` reads every dead letter.
    ///
    /// [`Headers::insert_current_trace_context`]: shardflow::Headers::insert_current_trace_context
    pub fn new(producer: Producer) -> Self {
        Self {
            producer: producer.raw(),
            limit: None,
            lookup: None,
        }
    }

    /// The producer the dead letters are written through (to flush or close it): a
    /// [raw](Producer::raw) handle of the one given.
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
        if self.limit.is_none() {
            let lookup = self.lookup.get_or_insert_with(|| {
                let producer = self.producer.clone();
                Box::pin(async move {
                    // Unreadable now: parts of 1 MiB fit every stream.
                    producer.max_record_size().await.unwrap_or(MAX_RECORD_BYTES)
                })
            });
            let limit = ready!(lookup.as_mut().poll(cx));
            self.limit = Some(limit);
            self.lookup = None;
        }
        Service::<ProducerRecord>::poll_ready(&mut self.producer, cx)
    }

    fn call(&mut self, mut record: DeadLetterRecord) -> Self::Future {
        // The trace context goes inside the envelope, with the record's other headers.
        record.headers.insert_current_trace_context();
        let envelope = DeadLetterEnvelope::from_record(&record);
        let key = record.metadata.partition_key;
        // Known after `poll_ready`; a call without it cuts parts that fit every stream.
        let limit = self.limit.unwrap_or(MAX_RECORD_BYTES);
        let mut parts = match envelope.to_records_within(limit) {
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
            Service::<ProducerRecord>::call(
                &mut self.producer,
                ProducerRecord::new(data, key.clone()),
            )
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
