//! The dead-letter layer's tests: what reaches the sink, what goes up, deadlines and
//! panics, and the producer sink's envelopes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardflow::producer::{Producer, ProducerRecord};
use tower::{service_fn, Layer, ServiceExt};

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
        .policy(|e: &(dyn Error + Send + Sync + 'static), _: &Metadata| e.to_string() != "retry me")
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
    let svc = DeadLetterLayer::new(ProducerSink::new(producer.clone()))
        .layer(failing_with(|| "charge refused".into()));
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
    use crate::retry::{RetryLayer, RetryPolicy};
    let (sunk, sink) = recording_sink(false);
    let retried = RetryLayer::new(
        RetryPolicy::exponential()
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
    let svc = DeadLetterLayer::new(ProducerSink::new(producer.clone()))
        .layer(failing_with(|| "charge refused".into()));
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
    let silent = service_fn(|_r: DeadLetterRecord| std::future::pending::<Result<(), BoxError>>());
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
    use crate::retry::{RetryLayer, RetryPolicy};
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
    let policy = RetryPolicy::exponential()
        .max_attempts(3)
        .initial_delay(Duration::from_millis(5));
    let retried =
        DeadLetterLayer::new(sink.clone()).layer(RetryLayer::new(policy.clone()).layer(in_future));
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

/// A store or service that cannot be reached is an outage, not a bad record: the default
/// policy lets the error go up (the record comes back) whether the I/O error is the
/// handler's own error or the source of another, and so does a tokio timeout; an I/O
/// error about the data is dead-lettered as before.
#[tokio::test]
async fn an_outage_is_delivered_again_and_bad_data_is_dead_lettered() {
    #[derive(Debug)]
    struct Insert(std::io::Error);
    impl std::fmt::Display for Insert {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("insert failed")
        }
    }
    impl std::error::Error for Insert {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    let outages: [fn() -> BoxError; 3] = [
        || std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into(),
        || std::io::Error::from(std::io::ErrorKind::TimedOut).into(),
        || Insert(std::io::Error::from(std::io::ErrorKind::ConnectionReset)).into(),
    ];
    for outage in outages {
        let (sunk, sink) = recording_sink(false);
        let svc = DeadLetterLayer::new(sink).layer(failing_with(outage));
        let answer = svc.oneshot(message(4, b"x")).await;
        assert!(answer.is_err(), "an outage comes back: {answer:?}");
        assert!(
            sunk.lock().unwrap().is_empty(),
            "an outage is not dead-lettered"
        );
    }
    // A handler whose call to its store ran out of time.
    let (sunk, sink) = recording_sink(false);
    let svc = DeadLetterLayer::new(sink).layer(service_fn(|_m: Message<Bytes>| async {
        tokio::time::timeout(Duration::from_millis(1), std::future::pending::<()>()).await?;
        Ok::<u8, BoxError>(0)
    }));
    assert!(svc.oneshot(message(6, b"x")).await.is_err());
    assert!(
        sunk.lock().unwrap().is_empty(),
        "a timeout is not dead-lettered"
    );
    let (sunk, sink) = recording_sink(false);
    let svc = DeadLetterLayer::new(sink).layer(failing_with(|| {
        std::io::Error::from(std::io::ErrorKind::InvalidData).into()
    }));
    assert_eq!(
        svc.oneshot(message(5, b"x")).await.unwrap(),
        DeadLetterOutcome::DeadLettered
    );
    assert_eq!(sunk.lock().unwrap().len(), 1);
}

/// Every record a sink accepted is counted in `shardflow_dead_letters_total` by stream and
/// reason, in the recorder the consumer's metrics use; a record the sink refused (it
/// comes back) is not.
#[test]
fn dead_letters_are_counted_by_stream_and_reason() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    ::metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let (sunk, sink) = recording_sink(false);
            let svc = DeadLetterLayer::new(sink).layer(failing_with(|| "boom".into()));
            for sequence in 1..=2 {
                let out = svc.clone().oneshot(message(sequence, b"x")).await.unwrap();
                assert_eq!(out, DeadLetterOutcome::DeadLettered);
            }
            assert_eq!(sunk.lock().unwrap().len(), 2);
            let (_, refusing) = recording_sink(true);
            let svc = DeadLetterLayer::new(refusing).layer(failing_with(|| "boom".into()));
            svc.oneshot(message(3, b"x")).await.unwrap_err();
        })
    });
    let text = handle.render();
    let counted: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with(crate::metrics::DEAD_LETTERS))
        .collect();
    assert_eq!(
        counted,
        [r#"shardflow_dead_letters_total{stream="orders",reason="failed_alone"} 2"#],
        "{text}"
    );
}
