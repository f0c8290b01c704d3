use tower::service_fn;

use super::*;
use crate::test_support::message;

type Calls = Arc<Mutex<Vec<Vec<String>>>>;

/// A bulk handler recording the sequence numbers of each call; fails the calls whose
/// first sequence number `fail` picks.
fn bulk(
    fail: fn(&str) -> bool,
) -> (
    Calls,
    impl Service<Vec<Message<Bytes>>, Response = usize, Error = BoxError, Future: Send> + Clone,
) {
    let calls: Calls = Arc::default();
    let seen = calls.clone();
    let svc = service_fn(move |messages: Vec<Message<Bytes>>| {
        let sequences: Vec<String> = messages
            .iter()
            .map(|m| m.metadata.sequence_number.to_string())
            .collect();
        let failed = sequences.first().is_some_and(|s| fail(s));
        seen.lock().unwrap().push(sequences);
        async move {
            if failed {
                Err::<usize, BoxError>("bulk write failed".into())
            } else {
                Ok(messages.len())
            }
        }
    });
    (calls, svc)
}

fn sequences(calls: &Calls) -> Vec<Vec<String>> {
    calls.lock().unwrap().clone()
}

fn strings(groups: &[&[u64]]) -> Vec<Vec<String>> {
    groups
        .iter()
        .map(|g| g.iter().map(|n| n.to_string()).collect())
        .collect()
}

/// Sends each message through its own clone (as a pipelining consumer would).
fn send_all<S>(
    svc: &Batching<S, Bytes>,
    range: std::ops::RangeInclusive<u64>,
    payload: &'static [u8],
) -> Vec<tokio::task::JoinHandle<Result<(), BoxError>>>
where
    S: Service<Vec<Message<Bytes>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
{
    range
        .map(|n| {
            let svc = svc.clone();
            tokio::spawn(ServiceExt::<Message<Bytes>>::oneshot(
                svc,
                message(n, payload),
            ))
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn record_mode_flushes_a_full_batch_at_once() {
    let (calls, handler) = bulk(|_| false);
    let svc = Batching::new(
        handler,
        BatchConfig::new()
            .max_count(3)
            .linger(Duration::from_secs(60)),
    );
    let start = Instant::now();
    for call in send_all(&svc, 1..=3, b"x") {
        call.await.unwrap().unwrap();
    }
    assert_eq!(start.elapsed(), Duration::ZERO);
    assert_eq!(sequences(&calls), strings(&[&[1, 2, 3]]));
}

#[tokio::test(start_paused = true)]
async fn record_mode_flushes_after_the_linger() {
    let (calls, handler) = bulk(|_| false);
    let svc = Batching::new(
        handler,
        BatchConfig::new()
            .max_count(10)
            .linger(Duration::from_millis(100)),
    );
    let start = Instant::now();
    for call in send_all(&svc, 1..=2, b"x") {
        call.await.unwrap().unwrap();
    }
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_eq!(sequences(&calls), strings(&[&[1, 2]]));
}

#[tokio::test(start_paused = true)]
async fn record_mode_respects_the_byte_limit() {
    let (calls, handler) = bulk(|_| false);
    let config = BatchConfig::new()
        .max_count(10)
        .max_bytes(10)
        .linger(Duration::from_millis(100));
    let svc = Batching::new(handler, config);
    let calls_done = send_all(&svc, 1..=3, b"four");
    for call in calls_done {
        call.await.unwrap().unwrap();
    }
    assert_eq!(sequences(&calls), strings(&[&[1, 2], &[3]]));
}

#[tokio::test(start_paused = true)]
async fn every_message_of_a_failed_batch_gets_the_error() {
    let (_, handler) = bulk(|_| true);
    let config = BatchConfig::new().max_count(2).bisect(Splits::Off);
    let svc = Batching::new(handler, config);
    for call in send_all(&svc, 1..=2, b"x") {
        let err = call.await.unwrap().unwrap_err();
        match err.downcast_ref::<BatchError>() {
            Some(e @ BatchError::Failed { size: 2, .. }) => {
                assert!(!e.is_transient());
                assert_eq!(
                    e.source().map(|s| s.to_string()).as_deref(),
                    Some("bulk write failed")
                );
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn dropping_the_service_flushes_what_is_queued() {
    let (calls, handler) = bulk(|_| false);
    let mut svc = Batching::new(
        handler,
        BatchConfig::new()
            .max_count(10)
            .linger(Duration::from_secs(3600)),
    );
    // Queue two messages through the service itself, then drop every handle.
    let mut pending = Vec::new();
    for n in 1..=2 {
        ServiceExt::<Message<Bytes>>::ready(&mut svc).await.unwrap();
        pending.push(Service::<Message<Bytes>>::call(&mut svc, message(n, b"x")));
    }
    drop(svc);
    let start = Instant::now();
    for response in pending {
        response.await.unwrap();
    }
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "flushed on drop, not after the linger"
    );
    assert_eq!(sequences(&calls), strings(&[&[1, 2]]));
}

/// Regression: a bulk handler that panicked on a record ended the worker and failed
/// its batch transiently, so the same batch met the same panic for ever.
#[tokio::test(start_paused = true)]
async fn a_record_that_panics_the_bulk_handler_fails_alone_and_the_others_are_handled() {
    let calls: Calls = Arc::default();
    let seen = calls.clone();
    let handler = service_fn(move |messages: Vec<Message<Bytes>>| {
        let sequences: Vec<String> = messages
            .iter()
            .map(|m| m.metadata.sequence_number.to_string())
            .collect();
        let poisoned = sequences.iter().any(|s| s == "3");
        seen.lock().unwrap().push(sequences);
        if poisoned && messages.len() > 2 {
            panic!("bulk handler bug in call");
        }
        async move {
            if poisoned {
                panic!("bulk handler bug in its future");
            }
            Ok::<_, BoxError>(messages.len())
        }
    });
    let svc = Batching::new(
        handler,
        BatchConfig::new()
            .max_count(4)
            .linger(Duration::from_secs(1)),
    );
    let outcomes = send_all(&svc, 1..=4, b"x");
    let mut failed = Vec::new();
    for (n, outcome) in (1..=4).zip(outcomes) {
        if let Err(error) = outcome.await.unwrap() {
            let error = error.downcast_ref::<BatchError>().expect("a BatchError");
            assert!(!error.is_transient(), "{error:?}");
            let source = std::error::Error::source(error).expect("the panic as source");
            assert!(
                source
                    .to_string()
                    .starts_with("the handler panicked: bulk handler bug"),
                "{source}"
            );
            failed.push(n);
        }
    }
    assert_eq!(failed, [3]);
    let handled: Vec<String> = sequences(&calls)
        .into_iter()
        .filter(|c| !c.iter().any(|s| s == "3"))
        .flatten()
        .collect();
    assert_eq!(handled, ["1", "2", "4"], "each of the others handled once");
}

fn read(range: std::ops::RangeInclusive<u64>, payload: &[u8]) -> Batch<Bytes> {
    Batch::new(
        Arc::from("orders"),
        Arc::from("shardId-000000000000"),
        range.map(|n| message(n, payload)).collect(),
    )
}

#[tokio::test]
async fn batch_mode_rechunks_a_read_in_order() {
    let (calls, handler) = bulk(|_| false);
    let svc = Batching::new(handler, BatchConfig::new().max_count(3));
    ServiceExt::<Batch<Bytes>>::oneshot(svc, read(1..=7, b"x"))
        .await
        .unwrap();
    assert_eq!(sequences(&calls), strings(&[&[1, 2, 3], &[4, 5, 6], &[7]]));
}

#[tokio::test]
async fn batch_mode_respects_bytes_and_accepts_empty_reads() {
    let (calls, handler) = bulk(|_| false);
    let svc = Batching::new(handler, BatchConfig::new().max_count(100).max_bytes(9));
    ServiceExt::<Batch<Bytes>>::oneshot(svc.clone(), read(1..=5, b"four"))
        .await
        .unwrap();
    let empty = Batch::new(
        Arc::from("orders"),
        Arc::from("shardId-000000000000"),
        Vec::new(),
    );
    ServiceExt::<Batch<Bytes>>::oneshot(svc, empty)
        .await
        .unwrap();
    assert_eq!(sequences(&calls), strings(&[&[1, 2], &[3, 4], &[5]]));
}

#[tokio::test]
async fn batch_mode_stops_at_the_first_failing_chunk() {
    let (calls, handler) = bulk(|first| first == "3");
    let svc = Batching::new(handler, BatchConfig::new().max_count(2));
    let err = ServiceExt::<Batch<Bytes>>::oneshot(svc, read(1..=6, b"x"))
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "bulk write failed");
    assert_eq!(sequences(&calls), strings(&[&[1, 2], &[3, 4]]));
}

/// The chunks written before the failing one are acknowledged through the read's
/// handle, so the consumer delivers the read again from the failing chunk and the rows
/// already written are not written again.
#[tokio::test]
async fn batch_mode_acknowledges_the_chunks_written_before_a_failing_one() {
    let (calls, handler) = bulk(|first| first == "5");
    let svc = Batching::new(handler, BatchConfig::new().max_count(2));
    let (input, acks) = Batch::for_test(
        Arc::from("orders"),
        Arc::from("shardId-000000000000"),
        (1..=6).map(|n| message(n, b"x")).collect(),
    );
    ServiceExt::<Batch<Bytes>>::oneshot(svc, input)
        .await
        .unwrap_err();
    assert_eq!(sequences(&calls), strings(&[&[1, 2], &[3, 4], &[5, 6]]));
    let written = &input_positions(1..=4);
    assert_eq!(
        acks.events(),
        [
            shardflow::AckEvent::AckThrough(written[1].clone()),
            shardflow::AckEvent::AckThrough(written[3].clone()),
        ],
        "acknowledged through the last record of each written chunk, nothing past it"
    );
}

fn input_positions(range: std::ops::RangeInclusive<u64>) -> Vec<shardflow::Position> {
    range.map(|n| message(n, b"x").position()).collect()
}

#[tokio::test]
async fn a_call_without_poll_ready_is_an_error_not_a_panic() {
    let (calls, handler) = bulk(|_| false);
    let mut svc = Batching::new(handler, BatchConfig::new());
    let err = Service::<Message<Bytes>>::call(&mut svc, message(1, b"x"))
        .await
        .unwrap_err();
    assert!(matches!(
        err.downcast_ref::<BatchError>(),
        Some(BatchError::NotReady)
    ));
    assert!(sequences(&calls).is_empty());
}

/// A bulk client that is closed: `poll_ready` always fails.
#[derive(Clone)]
struct ClosedClient;

impl Service<Vec<Message<Bytes>>> for ClosedClient {
    type Response = ();
    type Error = BoxError;
    type Future = std::future::Ready<Result<(), BoxError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Err("bulk client closed".into()))
    }

    fn call(&mut self, _: Vec<Message<Bytes>>) -> Self::Future {
        unreachable!("never ready")
    }
}

#[tokio::test(start_paused = true)]
async fn a_bulk_handler_that_is_not_ready_fails_its_records_transiently() {
    let svc = Batching::new(ClosedClient, BatchConfig::new().max_count(2));
    for call in send_all(&svc, 1..=2, b"x") {
        let err = call.await.unwrap().unwrap_err();
        let batch_error = err.downcast_ref::<BatchError>().expect("a BatchError");
        assert!(
            matches!(batch_error, BatchError::Unavailable { size: 2, .. }),
            "{batch_error:?}"
        );
        assert!(batch_error.is_transient());
        // So the default dead-letter policy sends it back to the consumer.
        use crate::dead_letter::{DeadLetterPolicy, PermanentFailures};
        let metadata = message(1, b"x").metadata;
        assert!(!PermanentFailures.should_dead_letter(&*err, &metadata));
    }
}

#[tokio::test(start_paused = true)]
async fn huge_limits_and_queues_do_not_panic() {
    for config in [
        BatchConfig::new().max_count(usize::MAX),
        BatchConfig::new().queue(usize::MAX),
        BatchConfig::new().queue(0),
    ] {
        let (calls, handler) = bulk(|_| false);
        let svc = Batching::new(handler, config.linger(Duration::from_millis(10)));
        for call in send_all(&svc, 1..=2, b"x") {
            call.await.unwrap().unwrap();
        }
        assert_eq!(sequences(&calls), strings(&[&[1, 2]]));
    }
}

/// A bulk handler that fails every call holding sequence number `poison`.
fn bulk_poisoned(
    poison: &'static str,
) -> (
    Calls,
    impl Service<Vec<Message<Bytes>>, Response = (), Error = BoxError, Future: Send> + Clone,
) {
    let calls: Calls = Arc::default();
    let seen = calls.clone();
    let svc = service_fn(move |messages: Vec<Message<Bytes>>| {
        let sequences: Vec<String> = messages
            .iter()
            .map(|m| m.metadata.sequence_number.to_string())
            .collect();
        let failed = sequences.iter().any(|s| s == poison);
        seen.lock().unwrap().push(sequences);
        async move {
            if failed {
                Err::<(), BoxError>("bulk write failed".into())
            } else {
                Ok(())
            }
        }
    });
    (calls, svc)
}

/// Regression: one poison record in a collected batch of ten sent all ten to the
/// dead-letter sink.
#[tokio::test(start_paused = true)]
async fn record_mode_dead_letters_only_the_record_that_fails_alone() {
    use crate::dead_letter::{DeadLetterLayer, DeadLetterOutcome, DeadLetterRecord};

    let sunk: Arc<Mutex<Vec<String>>> = Arc::default();
    let into = sunk.clone();
    let sink = service_fn(move |record: DeadLetterRecord| {
        into.lock()
            .unwrap()
            .push(record.metadata.sequence_number.to_string());
        async { Ok::<_, BoxError>(()) }
    });
    let (calls, handler) = bulk_poisoned("7");
    let batching = Batching::new(
        handler,
        BatchConfig::new()
            .max_count(10)
            .linger(Duration::from_secs(1)),
    );
    let svc = DeadLetterLayer::new(sink).layer(batching);
    let outcomes: Vec<_> = (1..=10)
        .map(|n| tokio::spawn(svc.clone().oneshot(message(n, b"x"))))
        .collect();
    let mut dead_lettered = Vec::new();
    for (n, outcome) in (1..=10).zip(outcomes) {
        if let DeadLetterOutcome::DeadLettered = outcome.await.unwrap().unwrap() {
            dead_lettered.push(n);
        }
    }
    assert_eq!(dead_lettered, [7]);
    assert_eq!(*sunk.lock().unwrap(), ["7"]);
    let calls = sequences(&calls);
    assert_eq!(calls[0].len(), 10, "one collected batch first");
    let handled: Vec<&String> = calls
        .iter()
        .filter(|c| !c.iter().any(|s| s == "7"))
        .flatten()
        .collect();
    assert_eq!(
        handled.len(),
        9,
        "each of the others handled once: {calls:?}"
    );
    assert!(calls.len() - 1 <= 2 * 4, "{} calls", calls.len());
}

#[tokio::test(start_paused = true)]
async fn record_mode_does_not_split_on_a_transient_error() {
    let (calls, handler) = bulk(|_| true);
    let svc = Batching::new(
        tower::ServiceBuilder::new()
            .map_err(|_: BoxError| -> BoxError { Box::new(BatchError::Closed) })
            .service(handler),
        BatchConfig::new().max_count(4),
    );
    for call in send_all(&svc, 1..=4, b"x") {
        call.await.unwrap().unwrap_err();
    }
    assert_eq!(sequences(&calls).len(), 1, "not split");
}

/// Regression: a bulk handler's transient error reached the messages inside the batch's
/// shared error (`Arc<dyn Error>`), whose `source` skips the error it holds, so the
/// dead-letter policy did not see it was transient and dead-lettered every message of
/// the batch instead of letting the consumer deliver them again.
#[tokio::test(start_paused = true)]
async fn record_mode_transient_errors_are_not_dead_lettered() {
    use crate::dead_letter::{DeadLetterLayer, DeadLetterRecord};

    let sunk: Arc<Mutex<Vec<String>>> = Arc::default();
    let into = sunk.clone();
    let sink = service_fn(move |record: DeadLetterRecord| {
        into.lock()
            .unwrap()
            .push(record.metadata.sequence_number.to_string());
        async { Ok::<_, BoxError>(()) }
    });
    let (_, handler) = bulk(|_| true);
    // The bulk handler's own client is a batching layer whose worker stopped.
    let batching = Batching::new(
        tower::ServiceBuilder::new()
            .map_err(|_: BoxError| -> BoxError { Box::new(BatchError::Closed) })
            .service(handler),
        BatchConfig::new().max_count(4),
    );
    let svc = DeadLetterLayer::new(sink).layer(batching);
    let outcomes: Vec<_> = (1..=4)
        .map(|n| tokio::spawn(svc.clone().oneshot(message(n, b"x"))))
        .collect();
    for outcome in outcomes {
        let error = outcome.await.unwrap().unwrap_err();
        assert!(
            matches!(
                error.downcast_ref::<BatchError>(),
                Some(BatchError::Failed { .. })
            ),
            "{error}"
        );
    }
    assert!(
        sunk.lock().unwrap().is_empty(),
        "delivered again, not dead-lettered: {:?}",
        sunk.lock().unwrap()
    );
}

/// Regression: in record mode a failed piece was narrowed down only when its first
/// message's lease was held, so a piece that began with a record of a shard whose
/// lease was lost failed whole, and its records of other shards were dead-lettered
/// with the poison record.
#[tokio::test]
async fn a_piece_led_by_a_lost_lease_is_still_narrowed_down_for_the_other_shards() {
    let (calls, handler) = bulk_poisoned("7");
    let svc = Batching::new(
        handler,
        BatchConfig::new()
            .max_count(4)
            .linger(Duration::from_secs(1)),
    );
    // Record 5 of another shard, whose lease is lost, leads the batch.
    let lost = {
        let mut m = message(5, b"x");
        m.metadata.shard_id = Arc::from("shardId-000000000001");
        m.metadata.lease_lost.cancel();
        m
    };
    let mut outcomes = vec![tokio::spawn(ServiceExt::<Message<Bytes>>::oneshot(
        svc.clone(),
        lost,
    ))];
    tokio::task::yield_now().await;
    outcomes.extend(send_all(&svc, 6..=8, b"x"));
    let mut failed = Vec::new();
    for (n, outcome) in (5..=8).zip(outcomes) {
        if outcome.await.unwrap().is_err() {
            failed.push(n);
        }
    }
    assert_eq!(failed, [7], "calls: {:?}", sequences(&calls));
}
