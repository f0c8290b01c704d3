use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tower::service_fn;

use super::*;
use crate::test_support::message;

type Sunk = Arc<Mutex<Vec<DeadLetterRecord>>>;
type Calls = Arc<Mutex<Vec<Vec<u64>>>>;

/// A transient error, for the tests' policy.
#[derive(Debug, thiserror::Error)]
#[error("the database is down")]
struct Down;

fn sink(
    down: bool,
) -> (
    Sunk,
    impl Service<DeadLetterRecord, Response = (), Error = BoxError, Future: Send> + Clone,
) {
    let sunk: Sunk = Arc::default();
    let into = sunk.clone();
    let svc = service_fn(move |record: DeadLetterRecord| {
        let into = into.clone();
        async move {
            if down {
                return Err::<(), BoxError>("sink down".into());
            }
            into.lock().unwrap().push(record);
            Ok(())
        }
    });
    (sunk, svc)
}

/// A bulk handler that records each call's sequence numbers and fails a call that holds
/// any record `poison` picks, with the error `error` makes.
fn handler(
    poison: impl Fn(u64) -> bool + Clone + Send + Sync + 'static,
    error: fn() -> BoxError,
) -> (
    Calls,
    impl Service<Batch<Bytes>, Response = (), Error = BoxError, Future: Send> + Clone,
) {
    let calls: Calls = Arc::default();
    let seen = calls.clone();
    let svc = service_fn(move |batch: Batch<Bytes>| {
        let sequences: Vec<u64> = batch
            .messages
            .iter()
            .map(|m| m.metadata.sequence_number.as_str().parse().unwrap())
            .collect();
        let failed = sequences.iter().any(|s| poison(*s));
        seen.lock().unwrap().push(sequences);
        async move {
            if failed {
                Err(error())
            } else {
                Ok(())
            }
        }
    });
    (calls, svc)
}

fn batch(range: std::ops::Range<u64>) -> Batch<Bytes> {
    Batch::new(
        Arc::from("orders"),
        Arc::from("shardId-000000000000"),
        range.map(|n| message(n, b"x")).collect(),
    )
}

fn bad() -> BoxError {
    "constraint violated".into()
}

fn down() -> BoxError {
    Box::new(Down)
}

fn not_down(e: &(dyn std::error::Error + Send + Sync + 'static), _: &shardflow::Metadata) -> bool {
    !e.is::<Down>()
}

fn sunk_sequences(sunk: &Sunk) -> Vec<u64> {
    sunk.lock()
        .unwrap()
        .iter()
        .map(|r| r.metadata.sequence_number.as_str().parse().unwrap())
        .collect()
}

fn handled(calls: &Calls, poison: impl Fn(&[u64]) -> bool) -> Vec<u64> {
    calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| !poison(c))
        .flatten()
        .copied()
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_poison_record_fails_alone_and_only_it_is_dead_lettered() {
    let (sunk, sink) = sink(false);
    let (calls, inner) = handler(|s| s == 7, bad);
    let svc = BisectLayer::new(sink).layer(inner);
    let outcome = svc.oneshot(batch(0..16)).await.unwrap();
    assert_eq!(sunk_sequences(&sunk), [7]);
    let record = &sunk.lock().unwrap()[0];
    assert!(
        record
            .error
            .starts_with("failed_alone: constraint violated"),
        "{}",
        record.error
    );
    // Whole (fail), [0..8) (fail), [0..4) ok, [4..8) split at once, [4..6) ok, [6..8)
    // split at once, [6] ok, [7] fails alone, [8..16) ok: three failed calls held 7.
    assert_eq!(record.attempts, Some(3));
    let ok = handled(&calls, |c| c.contains(&7));
    assert_eq!(
        ok,
        (0..16).filter(|s| *s != 7).collect::<Vec<_>>(),
        "in order, once each"
    );
    assert_eq!(outcome.calls, 7);
    assert_eq!(outcome.dead_lettered, 1);
}

#[tokio::test(start_paused = true)]
async fn a_transient_error_fails_the_call_and_dead_letters_nothing() {
    let (sunk, sink) = sink(false);
    let (calls, inner) = handler(|s| s == 7, down);
    let svc = BisectLayer::new(sink).policy(not_down).layer(inner);
    let error = svc.oneshot(batch(0..16)).await.unwrap_err();
    assert!(error.is::<Down>());
    assert!(sunk.lock().unwrap().is_empty());
    assert_eq!(calls.lock().unwrap().len(), 1, "not split");
}

#[tokio::test(start_paused = true)]
async fn a_sink_that_is_down_fails_the_call_at_the_poison_record() {
    let (_, sink) = sink(true);
    let (calls, inner) = handler(|s| s == 5, bad);
    let svc = BisectLayer::new(sink).layer(inner);
    let error = svc.oneshot(batch(0..16)).await.unwrap_err();
    let error = error
        .downcast_ref::<DeadLetterError>()
        .expect("a sink error");
    assert_eq!(error.position().sequence.as_str(), "5");
    let ok = handled(&calls, |c| c.contains(&5));
    assert_eq!(ok, [0, 1, 2, 3, 4], "nothing after the record was handled");
}

#[tokio::test(start_paused = true)]
async fn records_older_than_the_limit_go_to_the_sink_instead_of_being_retried() {
    let (sunk, sink) = sink(false);
    let (calls, inner) = handler(|_| true, down);
    let layer = BisectLayer::with_config(
        sink,
        BisectConfig::new().max_record_age(Duration::from_secs(3600)),
    )
    .unwrap()
    .policy(not_down);
    let svc = layer.layer(inner);
    let now = SystemTime::now();
    let mut old = batch(0..6);
    for (i, m) in old.messages.iter_mut().enumerate() {
        // Records 0..3 arrived two hours ago, 3..6 just now.
        let age = if i < 3 {
            Duration::from_secs(7200)
        } else {
            Duration::ZERO
        };
        m.metadata.approximate_arrival = Some(now - age);
    }
    let error = svc.clone().oneshot(old).await.unwrap_err();
    assert!(error.is::<Down>());
    assert_eq!(sunk_sequences(&sunk), [0, 1, 2]);
    assert!(sunk.lock().unwrap()[0].error.starts_with("too_old: "));
    assert_eq!(calls.lock().unwrap().len(), 1);
    // An hour and a bit later (tokio's clock) the others are too old as well.
    tokio::time::advance(Duration::from_secs(3601)).await;
    let mut rest = batch(3..6);
    for m in &mut rest.messages {
        m.metadata.approximate_arrival = Some(now);
    }
    let outcome = svc.oneshot(rest).await.unwrap();
    assert_eq!(sunk_sequences(&sunk), [0, 1, 2, 3, 4, 5]);
    assert_eq!(outcome.dead_lettered, 3);
}

#[tokio::test(start_paused = true)]
async fn a_piece_that_keeps_failing_is_dead_lettered_after_max_attempts_deliveries() {
    let (sunk, sink) = sink(false);
    let (calls, inner) = handler(|s| s == 5, down);
    let layer = BisectLayer::with_config(sink, BisectConfig::new().max_attempts(3))
        .unwrap()
        .policy(not_down);
    let svc = layer.layer(inner);
    for _ in 0..2 {
        svc.clone().oneshot(batch(0..8)).await.unwrap_err();
    }
    assert!(sunk.lock().unwrap().is_empty());
    let outcome = svc.clone().oneshot(batch(0..8)).await.unwrap();
    assert_eq!(
        outcome.dead_lettered, 8,
        "the piece that could not be narrowed down"
    );
    let sunk_records = sunk.lock().unwrap().clone();
    assert!(sunk_records.iter().all(|r| r.attempts == Some(3)
        && r.error
            .starts_with("attempts_exhausted: the database is down")));
    assert_eq!(calls.lock().unwrap().len(), 3);
    // The count starts again for the next stuck record.
    svc.oneshot(batch(5..8)).await.unwrap_err();
}

#[tokio::test(start_paused = true)]
async fn a_split_limit_stops_narrowing_and_the_attempts_limit_ends_it() {
    let (sunk, sink) = sink(false);
    let (calls, inner) = handler(|s| s == 5, bad);
    let config = BisectConfig::new()
        .splits(Splits::AtMost(1))
        .max_attempts(2);
    let svc = BisectLayer::with_config(sink, config).unwrap().layer(inner);
    // [0..8) fails, [0..4) ok, [4..8) is at the limit: called, fails, delivered again.
    svc.clone().oneshot(batch(0..8)).await.unwrap_err();
    assert!(sunk.lock().unwrap().is_empty());
    // The redelivery starts at 4 (the consumer's checkpoint passed 0..4).
    svc.oneshot(batch(4..8)).await.unwrap();
    // [4..8) fails, [4..6) fails at the limit (second time at 4): dead-lettered; [6..8) ok.
    assert_eq!(sunk_sequences(&sunk), [4, 5]);
    assert_eq!(handled(&calls, |c| c.contains(&5)), [0, 1, 2, 3, 6, 7]);
}

#[tokio::test(start_paused = true)]
async fn a_handler_that_panics_on_a_record_is_a_failure_of_that_record() {
    let (sunk, sink) = sink(false);
    let seen = Arc::new(AtomicU32::new(0));
    let count = seen.clone();
    let inner = service_fn(move |batch: Batch<Bytes>| {
        count.fetch_add(1, Ordering::SeqCst);
        let poisoned = batch
            .messages
            .iter()
            .any(|m| m.metadata.sequence_number.as_str() == "3");
        async move {
            assert!(!poisoned, "poison");
            Ok::<_, BoxError>(())
        }
    });
    let svc = BisectLayer::new(sink).layer(inner);
    svc.oneshot(batch(0..4)).await.unwrap();
    assert_eq!(sunk_sequences(&sunk), [3]);
    assert!(sunk.lock().unwrap()[0]
        .error
        .contains("the handler panicked"));
}

#[tokio::test(start_paused = true)]
async fn two_poison_records_are_each_dead_lettered_once() {
    let (sunk, sink) = sink(false);
    let (calls, inner) = handler(|s| s == 2 || s == 11, bad);
    let svc = BisectLayer::new(sink).layer(inner);
    svc.oneshot(batch(0..16)).await.unwrap();
    assert_eq!(sunk_sequences(&sunk), [2, 11]);
    let ok: BTreeSet<u64> = handled(&calls, |c| c.contains(&2) || c.contains(&11))
        .into_iter()
        .collect();
    assert_eq!(ok.len(), 14);
}

#[test]
fn limits_that_cannot_work_are_refused_naming_the_field() {
    for (config, field) in [
        (BisectConfig::new().max_attempts(0), "max_attempts"),
        (
            BisectConfig::new().max_record_age(Duration::ZERO),
            "max_record_age",
        ),
        (
            BisectConfig::new().sink_timeout(Duration::ZERO),
            "sink_timeout",
        ),
    ] {
        match BisectLayer::with_config((), config) {
            Err(ConfigError::Invalid { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
}

/// Regression: a batch whose lease was lost while it was being split went on calling the
/// handler on its pieces, which the shard's new owner handles again.
#[tokio::test(start_paused = true)]
async fn a_lost_lease_stops_the_split_before_the_next_piece() {
    let (sunk, sink) = sink(false);
    let lease_lost = tokio_util::sync::CancellationToken::new();
    let mut input = batch(0..8);
    for m in &mut input.messages {
        m.metadata.lease_lost = lease_lost.clone();
    }
    let (calls, failing) = handler(|s| s == 5, bad);
    // The whole batch fails; the lease is lost while its first half (0..4) is handled.
    let inner = tower::ServiceBuilder::new()
        .map_request(move |batch: Batch<Bytes>| {
            if batch.len() == 4 {
                lease_lost.cancel();
            }
            batch
        })
        .service(failing);
    let svc = BisectLayer::new(sink).layer(inner);
    let error = svc.oneshot(input).await.unwrap_err();
    assert!(error.is::<LeaseLostWhileSplitting>(), "{error}");
    assert_eq!(
        *calls.lock().unwrap(),
        [vec![0, 1, 2, 3, 4, 5, 6, 7], vec![0, 1, 2, 3]],
        "no piece called after the loss"
    );
    assert!(sunk.lock().unwrap().is_empty(), "nothing dead-lettered");
}

/// Regression: the age cut dropped the old head of a failed piece and then took the one
/// young record left for one that had failed alone, dead-lettering it for its
/// neighbours' failure without ever calling the handler on it.
#[tokio::test(start_paused = true)]
async fn a_young_record_behind_old_ones_is_called_again_not_dead_lettered() {
    let (sunk, sink) = sink(false);
    let (calls, inner) = handler(|s| s == 2, bad);
    let config = BisectConfig::new().max_record_age(Duration::from_secs(3600));
    let svc = BisectLayer::with_config(sink, config).unwrap().layer(inner);
    let now = SystemTime::now();
    let messages = (0..4)
        .map(|n| {
            // Records 0..3 arrived two hours ago (2 is the poison), 3 just now.
            let age = if n < 3 { 7200 } else { 0 };
            let mut m = message(n, b"x");
            m.metadata.approximate_arrival = Some(now - Duration::from_secs(age));
            m
        })
        .collect();
    let (input, acks) = Batch::for_test(
        Arc::from("orders"),
        Arc::from("shardId-000000000000"),
        messages,
    );
    let outcome = svc.oneshot(input).await.unwrap();
    assert_eq!(sunk_sequences(&sunk), [0, 1, 2], "only the old records");
    assert!(sunk
        .lock()
        .unwrap()
        .iter()
        .all(|r| r.error.starts_with("too_old: ")));
    assert_eq!(handled(&calls, |c| c.contains(&2)), [3], "3 was handled");
    assert_eq!(outcome.dead_lettered, 3);
    let through = acks.acked_through().expect("acknowledged");
    assert_eq!(
        through.sequence.as_str(),
        "3",
        "the checkpoint may pass all four"
    );
}

/// Regression: the attempts limit counted failed deliveries by their first record only,
/// so when a longer read came after a short one, records that had failed once were
/// dead-lettered with the short read's records as `attempts_exhausted`.
#[tokio::test(start_paused = true)]
async fn only_records_that_used_up_their_own_attempts_are_dead_lettered() {
    let (sunk, sink) = sink(false);
    let (calls, inner) = handler(|_| true, down);
    let layer = BisectLayer::with_config(sink, BisectConfig::new().max_attempts(2))
        .unwrap()
        .policy(not_down);
    let svc = layer.layer(inner);
    // A read of two records fails, then a read of eight from the same place.
    svc.clone().oneshot(batch(0..2)).await.unwrap_err();
    let (longer, acks) = Batch::for_test(
        Arc::from("orders"),
        Arc::from("shardId-000000000000"),
        (0..8).map(|n| message(n, b"x")).collect(),
    );
    let error = svc.clone().oneshot(longer).await.unwrap_err();
    assert!(error.is::<Down>(), "{error}");
    assert_eq!(sunk_sequences(&sunk), [0, 1], "the two that failed twice");
    let through = acks.acked_through().expect("the dead letters acknowledged");
    assert_eq!(through.sequence.as_str(), "1", "2..8 are delivered again");
    // Delivered again from 2, those records fail a second time: now they are out.
    svc.oneshot(batch(2..8)).await.unwrap();
    assert_eq!(sunk_sequences(&sunk), (0..8).collect::<Vec<_>>());
    assert_eq!(calls.lock().unwrap().len(), 3);
}

/// A bulk handler behind batch-mode `Batching` writes each chunk as it goes, so when a
/// later chunk of a piece fails, the chunks before it are already written: Batching
/// acknowledges them through the piece's handle, and the layer splits and retries only
/// the rest of the piece, so no record is written twice in one delivery.
#[tokio::test(start_paused = true)]
async fn a_chunk_written_before_a_failing_chunk_is_not_written_again_in_the_delivery() {
    let (sunk, sink) = sink(false);
    let written: Arc<Mutex<Vec<u64>>> = Arc::default();
    let into = written.clone();
    let bulk = service_fn(move |messages: Vec<Message<Bytes>>| {
        let sequences: Vec<u64> = messages
            .iter()
            .map(|m| m.metadata.sequence_number.as_str().parse().unwrap())
            .collect();
        let poison = sequences.contains(&5);
        if !poison {
            // The rows are in the table once the bulk call succeeds.
            into.lock().unwrap().extend(sequences);
        }
        async move {
            if poison {
                Err::<(), BoxError>("constraint violated".into())
            } else {
                Ok(())
            }
        }
    });
    let inner = crate::batch::Batching::new(bulk, crate::batch::BatchConfig::new().max_count(2));
    let svc = BisectLayer::new(sink).layer(inner);
    svc.oneshot(batch(0..8)).await.unwrap();
    assert_eq!(sunk_sequences(&sunk), [5]);
    let written = written.lock().unwrap().clone();
    for record in [0u64, 1, 2, 3, 4, 6, 7] {
        assert_eq!(
            written.iter().filter(|&&s| s == record).count(),
            1,
            "record {record} written once in one delivery; writes: {written:?}"
        );
    }
}

/// The README's bulk handler (an insert that fails with an `io::Error`) behind the
/// default `bisect` layer: while the database is down the batch is not split and nothing
/// is dead-lettered; the whole batch comes back. Regression: every record "failed
/// alone" and the whole batch was dead-lettered.
#[tokio::test(start_paused = true)]
async fn a_database_that_is_down_dead_letters_nothing_with_the_default_policy() {
    let (sunk, sink) = sink(false);
    let inner = service_fn(|_: Batch<Bytes>| async {
        Err::<(), std::io::Error>(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "connection refused",
        ))
    });
    let svc = BisectLayer::new(sink).layer(inner);
    let answer = svc.oneshot(batch(0..8)).await;
    assert!(
        sunk.lock().unwrap().is_empty(),
        "dead-lettered while the store was down: {:?}",
        sunk_sequences(&sunk)
    );
    assert!(answer.is_err(), "the batch comes back");
}

/// Reads of different sizes, the handler down throughout: with `max_attempts(2)` a
/// record must go to the sink once it failed in two deliveries. Regression: when a short
/// read's piece used up its attempts, the count of the records after it was forgotten,
/// so the last record failed in nine deliveries before it went.
#[tokio::test(start_paused = true)]
async fn no_record_fails_in_more_deliveries_than_the_attempts_limit() {
    let (sunk, sink) = sink(false);
    let (calls, inner) = handler(|_| true, down);
    let layer = BisectLayer::with_config(sink, BisectConfig::new().max_attempts(2))
        .unwrap()
        .policy(not_down);
    let svc = layer.layer(inner);
    // The consumer's reads alternate between eight records and one, from the checkpoint.
    let mut next = 0u64;
    let mut failed_in = [0u32; 8];
    for delivery in 0..40 {
        if next >= 8 {
            break;
        }
        let size = if delivery % 2 == 0 { 8 } else { 1 };
        let end = (next + size).min(8);
        let (input, acks) = Batch::for_test(
            Arc::from("orders"),
            Arc::from("shardId-000000000000"),
            (next..end).map(|n| message(n, b"x")).collect(),
        );
        let before = calls.lock().unwrap().len();
        let answer = svc.clone().oneshot(input).await;
        for call in &calls.lock().unwrap()[before..] {
            for &s in call {
                failed_in[s as usize] += 1;
            }
        }
        next = match answer {
            Ok(_) => end,
            Err(_) => acks
                .acked_through()
                .map_or(next, |p| p.sequence.as_str().parse::<u64>().unwrap() + 1),
        };
    }
    assert_eq!(sunk_sequences(&sunk), (0..8).collect::<Vec<_>>());
    for (record, &n) in failed_in.iter().enumerate() {
        assert!(
            n <= 2,
            "record {record} failed in {n} deliveries before it was dead-lettered: {failed_in:?}"
        );
    }
}

/// Regression: the layer checked the lease before dead-lettering a run of records (too
/// old, out of attempts) but not between them, so when the lease was lost while the
/// sink took the first of them, the others went to the sink too, and the new owner,
/// reading from the checkpoint, dead-letters them again.
#[tokio::test(start_paused = true)]
async fn a_lease_lost_while_dead_lettering_stops_before_the_next_record() {
    let lease_lost = tokio_util::sync::CancellationToken::new();
    let sunk: Sunk = Arc::default();
    let into = sunk.clone();
    let lose = lease_lost.clone();
    let sink = service_fn(move |record: DeadLetterRecord| {
        into.lock().unwrap().push(record);
        // The lease is lost while the sink stores the first record.
        lose.cancel();
        async { Ok::<(), BoxError>(()) }
    });
    let (_, inner) = handler(|_| true, bad);
    let config = BisectConfig::new().max_record_age(Duration::from_secs(3600));
    let svc = BisectLayer::with_config(sink, config).unwrap().layer(inner);
    let now = SystemTime::now();
    let mut input = batch(0..4);
    for m in &mut input.messages {
        m.metadata.approximate_arrival = Some(now - Duration::from_secs(7200));
        m.metadata.lease_lost = lease_lost.clone();
    }
    let error = svc.oneshot(input).await.unwrap_err();
    assert!(error.is::<LeaseLostWhileSplitting>(), "{error}");
    assert_eq!(
        sunk_sequences(&sunk),
        [0],
        "nothing sent to the sink once the lease was lost"
    );
}

/// Each record bisect dead-letters is counted in `shardflow_dead_letters_total`, by its
/// stream and reason.
#[test]
fn dead_letters_are_counted_in_the_metrics() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    ::metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let (sunk, sink) = sink(false);
            let (_, inner) = handler(|s| s == 2 || s == 11, bad);
            let svc = BisectLayer::new(sink).layer(inner);
            svc.oneshot(batch(0..16)).await.unwrap();
            assert_eq!(sunk_sequences(&sunk), [2, 11]);
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
