//! W3C trace context from producer to consumer (the `opentelemetry` feature): the
//! producer writes the current OpenTelemetry context into a record's [`Headers`], and the
//! consumer runs each handler call in a span that continues the record's trace.
//!
//! Only the OpenTelemetry API is used: the application installs the SDK, its exporter
//! and the text-map propagator globally
//! (`opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new())`
//! for W3C `traceparent`/`tracestate`). Without an installed propagator nothing is
//! written and nothing is read; without an installed tracer provider the spans are
//! no-ops.
//!
//! - **Producer**: a producer that embeds headers
//!   ([`ProducerBuilder::embed_headers`](crate::ProducerBuilder::embed_headers), on by
//!   default) injects [`Context::current`] into every record that does not already
//!   carry one of the propagator's fields (a record read elsewhere and written again —
//!   a dead-letter replay — keeps its own). An application that uses `tracing` with
//!   `tracing-opentelemetry` hands a span's context over the same way:
//!   `.with_context(span.context())` on the send. A [`Producer::raw`](crate::Producer::raw)
//!   handle adds nothing: a dead-letter sink puts the context inside its envelope instead
//!   ([`Headers::insert_current_trace_context`]), never in a frame around it.
//! - **[`Consumer::run`](crate::Consumer::run)**: each handler call runs in a
//!   `process` span of kind `Consumer` whose **parent** is the record's context (a
//!   record without one starts a new trace). The span is the current context while the
//!   handler runs, so the handler's own spans are its children and a producer called
//!   from the handler (a processor) carries the trace on to the next stream.
//! - **[`Consumer::run_batches`](crate::Consumer::run_batches)**: a batch has as many
//!   parents as records, and a span has one parent: the batch's span starts a new trace
//!   and has a **link** to each record's context (the OpenTelemetry messaging
//!   conventions' answer for batches), so a trace view leads from every producer to
//!   the batch that handled its record.
//! - **[`Consumer::stream`](crate::Consumer::stream)**: the application's code, so no
//!   span is made for it; [`message_context`] and [`batch_context`] make the same
//!   spans for it to attach.
//!
//! ```no_run
//! # async fn demo(producer: shardflow::Producer) -> Result<(), shardflow::ProduceError> {
//! use opentelemetry::context::FutureExt as _;
//! use opentelemetry::trace::{TraceContextExt as _, Tracer as _};
//! use opentelemetry::{global, Context};
//! use shardflow::ProducerRecord;
//!
//! // A span of the application's: its context goes into the record's headers.
//! let span = global::tracer("orders").start("place order");
//! let cx = Context::current_with_span(span);
//! producer
//!     .send(ProducerRecord::new("{}", "customer-7"))
//!     .with_context(cx)
//!     .await?;
//! # Ok(())
//! # }
//! ```

use std::fmt::Display;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context as TaskContext, Poll};

use opentelemetry::context::{FutureExt as _, WithContext};
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{Link, SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{global, Context, KeyValue};
use pin_project_lite::pin_project;
use tower::Service;

use crate::headers::Headers;
use crate::message::{Batch, Message};

/// The instrumentation scope of the consumer's spans.
const TRACER: &str = "shardflow";

impl Injector for Headers {
    /// Sets the header to the string `value` (a propagator's fields are strings).
    fn set(&mut self, key: &str, value: String) {
        self.insert(key, value);
    }
}

impl Extractor for Headers {
    /// The header's value when it is a string.
    fn get(&self, key: &str) -> Option<&str> {
        self.get_str(key)
    }

    fn keys(&self) -> Vec<&str> {
        self.names().collect()
    }
}

/// Writes [`Context::current`] into `headers` through the global propagator, unless
/// they already carry one of its fields (the context of the record's origin is kept).
/// What the producer does to each record when it embeds headers.
pub fn inject_current(headers: &mut Headers) {
    global::get_text_map_propagator(|propagator| {
        if propagator.fields().any(|field| headers.contains(field)) {
            return;
        }
        propagator.inject_context(&Context::current(), headers);
    });
}

impl Headers {
    /// Adds the current trace context, as a producer that embeds headers does to every
    /// record: through the globally installed propagator, unless one of its fields is
    /// present already (a record's own context is kept). For a writer of its own format
    /// that carries headers inside (the dead-letter envelope), whose records a
    /// [raw](crate::Producer::raw) producer writes. Without the `opentelemetry` feature
    /// the same method does nothing.
    pub fn insert_current_trace_context(&mut self) {
        inject_current(self);
    }
}

/// The context a record's headers carry (through the global propagator); an empty
/// context when they carry none.
pub fn extract(headers: &Headers) -> Context {
    global::get_text_map_propagator(|propagator| {
        propagator.extract_with_context(&Context::new(), headers)
    })
}

/// A started `process` span for one record, child of the record's context, as the
/// current span of the returned context: what [`Consumer::run`](crate::Consumer::run)
/// makes around each handler call. Attach it (`context.attach()`, or
/// `opentelemetry::context::FutureExt::with_context` on a future); the span ends when
/// the last clone of the context is dropped, or at `context.span().end()`.
pub fn message_context<T>(message: &Message<T>) -> Context {
    let parent = extract(&message.headers);
    let metadata = &message.metadata;
    let tracer = global::tracer(TRACER);
    let span = tracer
        .span_builder(format!("process {}", metadata.stream))
        .with_kind(SpanKind::Consumer)
        .with_attributes([
            KeyValue::new("messaging.system", "aws_kinesis"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.destination.name", metadata.stream.to_string()),
            KeyValue::new(
                "messaging.destination.partition.id",
                metadata.shard_id.to_string(),
            ),
            KeyValue::new("messaging.message.id", metadata.sequence_number.to_string()),
        ])
        .start_with_context(&tracer, &parent);
    parent.with_span(span)
}

/// A started `process` span for a batch, with a link to the context of each record that
/// carries one (a batch has many parents; the span starts a new trace), as the current
/// span of the returned context: what
/// [`Consumer::run_batches`](crate::Consumer::run_batches) makes around each call.
pub fn batch_context<T>(batch: &Batch<T>) -> Context {
    let links = batch
        .messages
        .iter()
        .filter_map(|message| {
            let context = extract(&message.headers);
            let span_context = context.span().span_context().clone();
            span_context.is_valid().then(|| {
                let sequence = message.metadata.sequence_number.to_string();
                Link::new(
                    span_context,
                    vec![KeyValue::new("messaging.message.id", sequence)],
                    0,
                )
            })
        })
        .collect();
    let count = i64::try_from(batch.messages.len()).unwrap_or(i64::MAX);
    let tracer = global::tracer(TRACER);
    let span = tracer
        .span_builder(format!("process {}", batch.stream))
        .with_kind(SpanKind::Consumer)
        .with_attributes([
            KeyValue::new("messaging.system", "aws_kinesis"),
            KeyValue::new("messaging.operation.type", "process"),
            KeyValue::new("messaging.destination.name", batch.stream.to_string()),
            KeyValue::new(
                "messaging.destination.partition.id",
                batch.shard_id.to_string(),
            ),
            KeyValue::new("messaging.batch.message_count", count),
        ])
        .with_links(links)
        .start_with_context(&tracer, &Context::new());
    Context::new().with_span(span)
}

/// Runs each call of the inner service in the span of [`message_context`] (a record)
/// or [`batch_context`] (a batch); an error marks the span failed.
#[derive(Clone, Debug)]
pub(crate) struct Traced<S> {
    inner: S,
}

impl<S> Traced<S> {
    pub(crate) fn new(inner: S) -> Self {
        Traced { inner }
    }

    fn call_in<R>(&mut self, context: Context, request: R) -> TracedFuture<S::Future>
    where
        S: Service<R>,
    {
        // The inner call itself (not only its future) runs with the span current.
        let future = {
            let _current = context.clone().attach();
            self.inner.call(request)
        };
        TracedFuture {
            inner: future.with_context(context.clone()),
            context,
        }
    }
}

impl<S, T> Service<Message<T>> for Traced<S>
where
    S: Service<Message<T>>,
    S::Error: Display,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = TracedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, message: Message<T>) -> Self::Future {
        let context = message_context(&message);
        self.call_in(context, message)
    }
}

impl<S, T> Service<Batch<T>> for Traced<S>
where
    S: Service<Batch<T>>,
    S::Error: Display,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = TracedFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, batch: Batch<T>) -> Self::Future {
        let context = batch_context(&batch);
        self.call_in(context, batch)
    }
}

pin_project! {
    /// The future of a [`Traced`] call: the inner future with its span current while it
    /// is polled; the span ends when it completes (or is dropped).
    pub(crate) struct TracedFuture<F> {
        #[pin]
        inner: WithContext<F>,
        context: Context,
    }
}

impl<F, R, E> Future for TracedFuture<F>
where
    F: Future<Output = Result<R, E>>,
    E: Display,
{
    type Output = Result<R, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let output = ready!(this.inner.poll(cx));
        let span = this.context.span();
        if let Err(error) = &output {
            span.set_status(Status::error(error.to_string()));
        }
        span.end();
        Poll::Ready(output)
    }
}
