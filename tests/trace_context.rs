//! Trace context from producer to consumer (the `opentelemetry` feature), with the
//! OpenTelemetry SDK's in-memory exporter and the W3C propagator installed globally: a
//! producer's span and the consumer's handler span share one trace (across a processor
//! too, and on the emulators), a batch's span links to every record's context, a failed
//! call's span is marked failed, and records sent outside any span carry no trace headers.
//!
//! The SDK is global, so the tests share one exporter; each looks only at the spans of
//! its own traces and streams.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::StreamExt;
use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{SpanContext, SpanKind, Status, TraceContextExt, TraceId, Tracer};
use opentelemetry::{global, Context};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use shardflow::kinesis::StreamAdmin;
use shardflow::producer::{Producer, ProducerRecord, MAX_RECORD_BYTES};
use shardflow::{Aws, Backend, Batch, HeaderFormat, Memory, Message};
use shardflow_middleware::dead_letter::envelope::Reassembly;
use shardflow_middleware::dead_letter::DeadLetterEnvelope;
use shardflow_middleware::produce::Output;
use shardflow_middleware::ProducerSink;
use shardflow_middleware::ServiceBuilderExt;
use testkit::*;
use tokio::sync::mpsc;
use tower::{ServiceBuilder, ServiceExt as _};

const LIMIT: Duration = Duration::from_secs(60);

/// The exporter every span of this test binary ends in (installed once, globally).
fn exporter() -> &'static InMemorySpanExporter {
    static EXPORTER: OnceLock<InMemorySpanExporter> = OnceLock::new();
    EXPORTER.get_or_init(|| {
        let exporter = InMemorySpanExporter::default();
        let provider = SdkTracerProvider::builder()
            .with_simple_exporter(exporter.clone())
            .build();
        global::set_tracer_provider(provider);
        global::set_text_map_propagator(TraceContextPropagator::new());
        exporter
    })
}

/// The finished spans named `name`.
fn finished(name: &str) -> Vec<SpanData> {
    exporter()
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .filter(|span| span.name == name)
        .collect()
}

/// A started producer-side span, as the application's own code would have one.
fn application_span(name: &'static str) -> Context {
    let tracer = global::tracer("application");
    let span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Producer)
        .start_with_context(&tracer, &Context::new());
    Context::new().with_span(span)
}

fn producer(memory: &Memory, stream: &str) -> Producer {
    Producer::builder()
        .stream(stream)
        .backend(memory.clone())
        .linger(Duration::ZERO)
        .build()
        .unwrap()
}

/// Sends `record` with `context` current (so the producer injects it).
async fn send_in(producer: &Producer, record: ProducerRecord, context: Context) {
    producer
        .send(record)
        .with_context(context)
        .limited()
        .await
        .unwrap();
}

/// A handler that reports the span context current while it runs, and starts a child
/// span of its own.
fn reporting_handler(
    seen: mpsc::UnboundedSender<SpanContext>,
) -> impl tower::Service<Message, Response = (), Error = Infallible, Future: Send> + Clone + Send {
    tower::service_fn(move |_msg: Message| {
        let current = Context::current().span().span_context().clone();
        let _ = seen.send(current);
        global::tracer("application").in_span("charge", |_| {});
        async { Ok::<_, Infallible>(()) }
    })
}

async fn receive(seen: &mut mpsc::UnboundedReceiver<SpanContext>, n: usize) -> Vec<SpanContext> {
    within(LIMIT, "the handler calls", async {
        let mut contexts = Vec::new();
        while contexts.len() < n {
            contexts.push(seen.recv().await.unwrap());
        }
        contexts
    })
    .await
}

#[tokio::test(start_paused = true)]
async fn the_handler_span_is_a_child_of_the_producer_span() {
    exporter();
    let memory = Memory::new();
    memory.streams().create_stream("orders", 1).await.unwrap();
    let orders = producer(&memory, "orders");
    let sent = application_span("send order");
    let sent_context = sent.span().span_context().clone();
    send_in(&orders, ProducerRecord::new("o-1", "k"), sent.clone()).await;
    sent.span().end();
    orders.close().limited().await;

    let (tx, mut seen) = mpsc::unbounded_channel();
    let consumer = test_consumer(memory.clone(), "orders", "billing", "w1")
        .build()
        .unwrap();
    let running = start_service(consumer, reporting_handler(tx));
    let handled = receive(&mut seen, 1).await;
    running.stop().await;

    // The handler ran in the consumer's span, in the producer's trace.
    assert_eq!(handled[0].trace_id(), sent_context.trace_id());
    let process: Vec<_> = finished("process orders")
        .into_iter()
        .filter(|span| span.span_context.trace_id() == sent_context.trace_id())
        .collect();
    assert_eq!(process.len(), 1, "one process span for one record");
    let process = &process[0];
    assert_eq!(process.parent_span_id, sent_context.span_id());
    assert!(process.parent_span_is_remote);
    assert_eq!(process.span_kind, SpanKind::Consumer);
    assert_eq!(process.span_context.span_id(), handled[0].span_id());
    // The handler's own span is a child of the consumer's.
    let charge = finished("charge")
        .into_iter()
        .find(|span| span.span_context.trace_id() == sent_context.trace_id())
        .expect("the handler's span in the producer's trace");
    assert_eq!(charge.parent_span_id, process.span_context.span_id());
}

#[tokio::test(start_paused = true)]
async fn a_record_sent_outside_a_span_carries_no_trace_and_an_own_one_is_kept() {
    exporter();
    let memory = Memory::new();
    memory.streams().create_stream("plain", 1).await.unwrap();
    let plain = producer(&memory, "plain");
    plain
        .send(ProducerRecord::new("bare", "k"))
        .limited()
        .await
        .unwrap();
    // A record that brings its trace (a replayed dead letter) keeps it, in a span or not.
    const OWN: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let other = application_span("send other");
    send_in(
        &plain,
        ProducerRecord::new("traced", "k").with_header("traceparent", OWN),
        other.clone(),
    )
    .await;
    other.span().end();
    plain.close().limited().await;

    let consumer = test_consumer(memory.clone(), "plain", "reader", "w1")
        .header_format(HeaderFormat::Auto)
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let shutdown = batches.shutdown_handle();
    let batch = within(LIMIT, "the first batch", batches.next())
        .await
        .unwrap()
        .unwrap();
    batch.ack();
    shutdown.shutdown();
    within(STOP_LIMIT, "the stream ends", async {
        while let Some(batch) = batches.next().await {
            batch.unwrap().ack();
        }
    })
    .await;
    let messages = &batch.messages;
    assert_eq!(messages.len(), 2);
    assert!(messages[0].headers.is_empty(), "{:?}", messages[0].headers);
    assert_eq!(messages[0].payload.as_ref(), b"bare");
    assert_eq!(messages[1].headers.get_str("traceparent"), Some(OWN));
    assert_eq!(messages[1].headers.len(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_trace_goes_on_through_a_processor() {
    the_trace_goes_on_through_a_processor_on(Memory::new()).await;
}

/// The same over real HTTP, on the emulators `scripts/test.sh` starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_trace_goes_on_through_a_processor_on_the_emulators() {
    if !emulators_enabled() {
        return;
    }
    the_trace_goes_on_through_a_processor_on(Aws::from_env().await).await;
}

/// consumer -> processor -> producer -> consumer on `backend`: the last handler runs in
/// the first producer's trace, each span the child of the one before; the application's
/// headers the processor passes on arrive with the bare payload.
async fn the_trace_goes_on_through_a_processor_on<B: Backend + Clone>(backend: B) {
    exporter();
    let admin = backend.admin().unwrap();
    let (input_stream, output_stream) = (unique("traced-in"), unique("traced-out"));
    admin.create_stream(&input_stream, 1).await.unwrap();
    admin.create_stream(&output_stream, 1).await.unwrap();
    wait_until_active(admin.as_ref(), &input_stream).await;
    wait_until_active(admin.as_ref(), &output_stream).await;
    let producer = |stream: &str| {
        Producer::builder()
            .stream(stream)
            .backend(backend.clone())
            .linger(Duration::ZERO)
            .build()
            .unwrap()
    };
    let input = producer(&input_stream);
    let sent = application_span("send input");
    let trace = sent.span().span_context().trace_id();
    let record = ProducerRecord::new(r#"{"id":1}"#, "k")
        .with_header("contentType", "application/json")
        .with_header("correlationId", "order-1");
    send_in(&input, record, sent.clone()).await;
    sent.span().end();
    input.close().limited().await;

    // The processor passes the application's headers on, as a Spring processor does.
    let processor = ServiceBuilder::new()
        .produce_to(producer(&output_stream))
        .service_fn(|msg: Message| async move {
            let mut output = Output::new(msg.payload);
            for name in ["contentType", "correlationId"] {
                if let Some(value) = msg.headers.get_str(name) {
                    output = output.with_header(name, value.to_owned());
                }
            }
            Ok::<_, Infallible>(output)
        });
    let upstream = test_consumer(backend.clone(), &input_stream, &unique("proc"), "w1")
        .build()
        .unwrap();
    let processing = start_service(upstream, processor);
    let (tx, mut seen) = mpsc::unbounded_channel();
    let downstream = test_consumer(backend.clone(), &output_stream, &unique("sink"), "w1")
        .build()
        .unwrap();
    let (headers_tx, mut headers_seen) = mpsc::unbounded_channel();
    let report = reporting_handler(tx);
    let sink = tower::service_fn(move |msg: Message| {
        let _ = headers_tx.send((msg.headers.clone(), msg.payload.clone()));
        report.clone().oneshot(msg)
    });
    let sinking = start_service(downstream, sink);
    let handled = receive(&mut seen, 1).await;
    processing.stop().await;
    sinking.stop().await;

    // The application's headers and the bare payload arrive at the end of the chain,
    // beside the trace context the producers added.
    let (headers, payload) = headers_seen.try_recv().expect("the downstream handler ran");
    assert_eq!(&payload[..], br#"{"id":1}"#, "the framing is stripped");
    assert_eq!(headers.get_str("contentType"), Some("application/json"));
    assert_eq!(headers.get_str("correlationId"), Some("order-1"));
    assert!(headers.get_str("traceparent").is_some(), "{headers:?}");

    assert_eq!(
        handled[0].trace_id(),
        trace,
        "the last handler is in the first producer's trace"
    );
    let in_trace = |name: String| -> Vec<SpanData> {
        finished(&name)
            .into_iter()
            .filter(|span| span.span_context.trace_id() == trace)
            .collect()
    };
    let processed = in_trace(format!("process {input_stream}"));
    let delivered = in_trace(format!("process {output_stream}"));
    assert_eq!((processed.len(), delivered.len()), (1, 1));
    // Producer span <- processor's span <- downstream handler's span.
    assert_eq!(
        processed[0].parent_span_id,
        sent.span().span_context().span_id()
    );
    assert_eq!(
        delivered[0].parent_span_id,
        processed[0].span_context.span_id()
    );
}

#[tokio::test(start_paused = true)]
async fn a_batch_span_links_to_every_records_context() {
    exporter();
    let memory = Memory::new();
    memory.streams().create_stream("bulk", 1).await.unwrap();
    let bulk = producer(&memory, "bulk");
    let mut sent = Vec::new();
    for name in ["send a", "send b", "send c"] {
        let context = application_span(name);
        send_in(&bulk, ProducerRecord::new(name, "k"), context.clone()).await;
        context.span().end();
        sent.push(context.span().span_context().clone());
    }
    // One record without a trace: no link for it.
    bulk.send(ProducerRecord::new("untraced", "k"))
        .limited()
        .await
        .unwrap();
    bulk.close().limited().await;

    let (tx, mut seen) = mpsc::unbounded_channel();
    let handler = tower::service_fn(move |batch: Batch| {
        let current = Context::current().span().span_context().clone();
        let _ = tx.send((current, batch.messages.len()));
        async { Ok::<_, Infallible>(()) }
    });
    let consumer = test_consumer(memory.clone(), "bulk", "bulk-group", "w1")
        .build()
        .unwrap();
    let running = consumer.run_batches(handler).spawn();
    let (current, len) = within(LIMIT, "the batch call", seen.recv()).await.unwrap();
    within(STOP_LIMIT, "the consumer stops", running.shutdown())
        .await
        .unwrap();
    assert_eq!(len, 4, "the four records come in one read");

    let span = finished("process bulk")
        .into_iter()
        .find(|span| span.span_context.span_id() == current.span_id())
        .expect("the batch's span was current in the handler");
    assert_eq!(span.span_kind, SpanKind::Consumer);
    // A batch has many parents: its span starts a trace of its own and links to each.
    assert_eq!(span.parent_span_id, opentelemetry::trace::SpanId::INVALID);
    assert!(sent
        .iter()
        .all(|s| s.trace_id() != span.span_context.trace_id()));
    let linked: Vec<(TraceId, _)> = span
        .links
        .links
        .iter()
        .map(|link| (link.span_context.trace_id(), link.span_context.span_id()))
        .collect();
    let expected: Vec<(TraceId, _)> = sent.iter().map(|s| (s.trace_id(), s.span_id())).collect();
    assert_eq!(linked, expected);
}

#[tokio::test(start_paused = true)]
async fn a_failed_call_marks_its_span_failed_and_the_redelivery_is_in_the_same_trace() {
    exporter();
    let memory = Memory::new();
    memory.streams().create_stream("flaky", 1).await.unwrap();
    let flaky = producer(&memory, "flaky");
    let sent = application_span("send flaky");
    let trace = sent.span().span_context().trace_id();
    send_in(&flaky, ProducerRecord::new("f-1", "k"), sent.clone()).await;
    sent.span().end();
    flaky.close().limited().await;

    // The first call fails (the shard restarts from its checkpoint), the second succeeds.
    let calls = Arc::new(AtomicUsize::new(0));
    let (tx, mut seen) = mpsc::unbounded_channel();
    let handler = tower::service_fn(move |_msg: Message| {
        let call = calls.fetch_add(1, Ordering::SeqCst);
        let _ = tx.send(Context::current().span().span_context().clone());
        async move {
            if call == 0 {
                Err("declined by the handler")
            } else {
                Ok(())
            }
        }
    });
    let consumer = test_consumer(memory.clone(), "flaky", "flaky-group", "w1")
        .build()
        .unwrap();
    let running = start_service(consumer, handler);
    let handled = receive(&mut seen, 2).await;
    running.stop().await;

    assert!(handled.iter().all(|context| context.trace_id() == trace));
    let spans: Vec<SpanData> = finished("process flaky")
        .into_iter()
        .filter(|span| span.span_context.trace_id() == trace)
        .collect();
    let status_of = |context: &SpanContext| {
        spans
            .iter()
            .find(|span| span.span_context.span_id() == context.span_id())
            .map(|span| span.status.clone())
            .expect("a finished span per call")
    };
    assert_eq!(
        status_of(&handled[0]),
        Status::error("declined by the handler")
    );
    assert_eq!(status_of(&handled[1]), Status::Unset);
}

/// Reads the dead-letter stream raw until `n` dead letters are complete; every record in
/// it must be an envelope.
async fn dead_letters(memory: &Memory, stream: &str, n: usize) -> Vec<DeadLetterEnvelope> {
    let consumer = test_consumer(memory.clone(), stream, "dlq-reader", "r1")
        .header_format(HeaderFormat::None)
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let shutdown = batches.shutdown_handle();
    let letters = within(LIMIT, "every dead letter", async {
        let mut parts = Reassembly::new();
        let mut letters = Vec::new();
        while letters.len() < n {
            let batch = batches.next().await.unwrap().unwrap();
            for message in &batch.messages {
                let envelope = DeadLetterEnvelope::from_bytes(&message.payload)
                    .expect("a dead-letter record is an envelope, not framed");
                assert!(
                    message.payload.len() + message.metadata.partition_key.len()
                        <= MAX_RECORD_BYTES
                );
                letters.extend(parts.push(envelope));
            }
            batch.ack();
        }
        letters
    })
    .await;
    shutdown.shutdown();
    within(LIMIT, "the reader stops", async {
        while let Some(batch) = batches.next().await {
            batch.unwrap().ack();
        }
    })
    .await;
    letters
}

/// Regression: the dead-letter sink's producer framed each envelope with a `traceparent`
/// like any other record, so no reader of the dead-letter stream could read it, and a
/// record at the size limit could never be dead-lettered once the frame was added (its
/// shard retried it for ever). The trace context goes inside the envelope.
#[tokio::test(start_paused = true)]
async fn a_dead_letter_keeps_its_trace_context_inside_its_envelope() {
    exporter();
    let memory = Memory::new();
    memory.streams().create_stream("payments", 1).await.unwrap();
    memory
        .streams()
        .create_stream("payments-dlq", 1)
        .await
        .unwrap();
    let payments = producer(&memory, "payments");
    let sent = application_span("send payment");
    let trace = sent.span().span_context().trace_id();
    send_in(&payments, ProducerRecord::new("p-1", "k"), sent.clone()).await;
    sent.span().end();
    // Sent outside any span, so that it is exactly at the limit as written.
    let largest: bytes::Bytes = (0..MAX_RECORD_BYTES - 1).map(|i| (i % 251) as u8).collect();
    payments
        .send(ProducerRecord::new(largest.clone(), "k"))
        .limited()
        .await
        .unwrap();
    payments.close().limited().await;

    let dlq = producer(&memory, "payments-dlq");
    let handler = ServiceBuilder::new()
        .dead_letter(ProducerSink::new(dlq.clone()))
        .service_fn(|_msg: Message| async { Err::<(), _>(std::io::Error::other("declined")) });
    let consumer = test_consumer(memory.clone(), "payments", "payments-group", "w1")
        .build()
        .unwrap();
    let running = start_service(consumer, handler);
    let letters = dead_letters(&memory, "payments-dlq", 2).await;
    running.stop().await;
    dlq.close().limited().await;

    assert_eq!(letters[0].payload.as_ref(), b"p-1");
    assert_eq!(letters[1].payload, largest);
    for letter in &letters {
        assert_eq!(letter.error, "declined");
        assert!(
            letter.headers.contains("traceparent"),
            "the trace context is inside the envelope: {:?}",
            letter.headers
        );
    }
    // The record's own context is kept: its trace goes on into the dead letter.
    let own = shardflow::trace::extract(&letters[0].headers);
    assert_eq!(own.span().span_context().trace_id(), trace);
}
