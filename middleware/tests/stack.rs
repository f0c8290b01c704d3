//! The whole stack, built with `ServiceBuilder`, over hand-made records with seeded
//! faults: every record ends handled exactly once or dead-lettered with its error.

mod common;

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{message, within, Rng};
use serde::Deserialize;
use shardflow::Message;
use shardflow_middleware::dead_letter::{self, DeadLetterRecord};
use shardflow_middleware::dedup::{self, DedupLayer};
use shardflow_middleware::{
    BoxError, ErrorClass, MemoryDedupStore, RetryPolicy, ServiceBuilderExt,
};
use tower::{service_fn, Service, ServiceBuilder, ServiceExt};

#[derive(Clone, Debug, Deserialize)]
struct Order {
    id: u64,
    #[serde(default)]
    poison: bool,
}

#[derive(Debug)]
enum HandlerError {
    Flaky,
    Poison(u64),
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Flaky => f.write_str("the payment service timed out"),
            HandlerError::Poison(id) => write!(f, "order {id} breaks a business rule"),
        }
    }
}

impl std::error::Error for HandlerError {}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Good,
    Poison,
    BadJson,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ended {
    Handled,
    Duplicate,
    DeadLettered,
}

struct Run {
    kinds: Vec<Kind>,
    effects: HashMap<u64, u32>,
    dead_letters: Vec<DeadLetterRecord>,
    ended: Vec<Ended>,
    redeliveries: u32,
}

const RECORDS: u64 = 300;

fn payload(id: u64, kind: Kind) -> Bytes {
    match kind {
        Kind::Good => format!(r#"{{"id":{id}}}"#).into(),
        Kind::Poison => format!(r#"{{"id":{id},"poison":true}}"#).into(),
        Kind::BadJson => format!(r#"{{"id":{id},"#).into(),
    }
}

/// One consumer over `RECORDS` records, delivering again after every `Err`, then a
/// replay of the whole shard (as after a crash before the checkpoint was written).
async fn run(seed: u64) -> Run {
    let mut rng = Rng::new(seed);
    let kinds: Vec<Kind> = (0..RECORDS)
        .map(|_| match rng.below(100) {
            0..=4 => Kind::BadJson,
            5..=9 => Kind::Poison,
            _ => Kind::Good,
        })
        .collect();

    let faults = Arc::new(Mutex::new(Rng::new(seed ^ 0xFA17)));
    let effects: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
    let dead_letters: Arc<Mutex<Vec<DeadLetterRecord>>> = Arc::default();

    let sink_faults = faults.clone();
    let sunk = dead_letters.clone();
    let sink = service_fn(move |record: DeadLetterRecord| {
        let fail = sink_faults.lock().unwrap().chance(0.2);
        let sunk = sunk.clone();
        async move {
            if fail {
                return Err::<(), BoxError>("dead-letter stream throttled".into());
            }
            sunk.lock().unwrap().push(record);
            Ok(())
        }
    });

    let handler_faults = faults.clone();
    let done = effects.clone();
    let handler = service_fn(move |msg: Message<Order>| {
        let fail = handler_faults.lock().unwrap().chance(0.3);
        let done = done.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(1)).await;
            if msg.payload.poison {
                return Err(HandlerError::Poison(msg.payload.id));
            }
            if fail {
                return Err(HandlerError::Flaky);
            }
            *done.lock().unwrap().entry(msg.payload.id).or_default() += 1;
            Ok(msg.payload.id)
        }
    });

    let policy = RetryPolicy::exponential()
        .max_attempts(4)
        .initial_delay(Duration::from_millis(10))
        .jitter_seed(seed)
        .classify(|e: &HandlerError| match e {
            HandlerError::Poison(_) => ErrorClass::Permanent,
            HandlerError::Flaky => ErrorClass::Transient,
        });
    let mut stack = ServiceBuilder::new()
        .dead_letter(sink)
        .decode::<Order>()
        .dedup(MemoryDedupStore::new(10_000))
        .retry(policy)
        .service(handler);

    let messages: Vec<Message<Bytes>> = kinds
        .iter()
        .enumerate()
        .map(|(i, kind)| message("shardId-000000000000", i as u64, payload(i as u64, *kind)))
        .collect();

    let mut ended: Vec<Ended> = Vec::new();
    let mut redeliveries = 0;
    for pass in 0..2 {
        for (i, msg) in messages.iter().enumerate() {
            // The replay re-delivers what was handled (a crash before the checkpoint).
            if pass == 1 && ended[i] != Ended::Handled {
                continue;
            }
            let mut deliveries = 0;
            let outcome = loop {
                deliveries += 1;
                assert!(deliveries < 50, "seed {seed} record {i} never finished");
                let svc = stack.ready().await.expect("always ready");
                match within("a call through the stack", svc.call(msg.clone())).await {
                    Ok(outcome) => break outcome,
                    // The consumer stops the shard and delivers again from the checkpoint.
                    Err(_) => redeliveries += 1,
                }
            };
            let outcome = match outcome {
                dead_letter::DeadLetterOutcome::Handled(dedup::DedupOutcome::Handled(_)) => {
                    Ended::Handled
                }
                dead_letter::DeadLetterOutcome::Handled(dedup::DedupOutcome::Duplicate) => {
                    Ended::Duplicate
                }
                dead_letter::DeadLetterOutcome::DeadLettered => Ended::DeadLettered,
            };
            if pass == 0 {
                ended.push(outcome);
            } else {
                assert_eq!(
                    outcome,
                    Ended::Duplicate,
                    "seed {seed} record {i}: replayed"
                );
            }
        }
    }

    let effects = effects.lock().unwrap().clone();
    let dead_letters = dead_letters.lock().unwrap().clone();
    Run {
        kinds,
        effects,
        dead_letters,
        ended,
        redeliveries,
    }
}

#[tokio::test(start_paused = true)]
async fn every_record_is_handled_exactly_once_or_dead_lettered_with_its_error() {
    for seed in 1..=5 {
        let run = run(seed).await;
        let mut handled = 0;
        let mut dead = 0;
        for (i, kind) in run.kinds.iter().enumerate() {
            let id = i as u64;
            let effects = run.effects.get(&id).copied().unwrap_or(0);
            let letters: Vec<_> = run
                .dead_letters
                .iter()
                .filter(|r| msg_index_of(r) == i)
                .collect();
            match run.ended[i] {
                Ended::Handled => {
                    assert_eq!(*kind, Kind::Good, "seed {seed} record {i}");
                    assert_eq!(effects, 1, "seed {seed} record {i}: side effects");
                    handled += 1;
                }
                Ended::DeadLettered => {
                    assert_eq!(
                        effects, 0,
                        "seed {seed} record {i}: dead-lettered after an effect"
                    );
                    assert_eq!(letters.len(), 1, "seed {seed} record {i}: dead letters");
                    let expected = match kind {
                        Kind::BadJson => "is not valid JSON",
                        Kind::Poison => "breaks a business rule",
                        Kind::Good => "the payment service timed out",
                    };
                    for letter in &letters {
                        assert!(
                            letter.error.contains(expected),
                            "seed {seed} record {i}: {}",
                            letter.error
                        );
                        assert_eq!(letter.payload, payload(id, *kind), "raw payload kept");
                    }
                    dead += 1;
                }
                Ended::Duplicate => panic!("seed {seed} record {i}: a duplicate on first delivery"),
            }
        }
        eprintln!(
            "seed {seed}: {handled} handled, {dead} dead-lettered, {} redeliveries",
            run.redeliveries
        );
        // None lost: every record ended one way or the other.
        assert_eq!(handled + dead, RECORDS, "seed {seed}");
        assert!(
            dead > 0 && run.redeliveries > 0,
            "seed {seed}: the faults were exercised"
        );
        // Every good record that was not unlucky four times in a row was handled.
        let bad = run.kinds.iter().filter(|k| **k != Kind::Good).count() as u64;
        assert!(
            handled >= RECORDS - bad - 10,
            "seed {seed}: handled {handled}"
        );
    }
}

fn msg_index_of(record: &DeadLetterRecord) -> usize {
    record.metadata.sequence_number.as_str()[4..]
        .parse()
        .expect("a test sequence number")
}

#[tokio::test(start_paused = true)]
async fn two_consumers_with_a_memory_store_run_each_side_effect_once() {
    let report =
        common::two_consumers(MemoryDedupStore::new(1_000), 200, Duration::from_millis(1)).await;
    common::assert_exactly_once(&report, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_on_two_threads_run_each_side_effect_once() {
    let report =
        common::two_consumers(MemoryDedupStore::new(1_000), 200, Duration::from_millis(1)).await;
    common::assert_exactly_once(&report, 200);
}

#[tokio::test(start_paused = true)]
async fn a_business_key_from_the_decoded_payload_dedups_producer_duplicates() {
    let effects: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
    let done = effects.clone();
    let mut stack = ServiceBuilder::new()
        .decode::<Order>()
        .layer(
            DedupLayer::new(MemoryDedupStore::new(100))
                .key(|m: &Message<Order>| format!("order-{}", m.payload.id)),
        )
        .service_fn(move |msg: Message<Order>| {
            let done = done.clone();
            async move {
                *done.lock().unwrap().entry(msg.payload.id).or_default() += 1;
                Ok::<_, BoxError>(())
            }
        });
    // The producer wrote order 7 twice: two records at different positions.
    for (seq, id) in [(1, 7), (2, 8), (3, 7)] {
        let svc = stack.ready().await.unwrap();
        let call = svc.call(message(
            "shardId-000000000000",
            seq,
            payload(id, Kind::Good),
        ));
        within("a call through the stack", call).await.unwrap();
    }
    assert_eq!(*effects.lock().unwrap(), HashMap::from([(7, 1), (8, 1)]));
}

#[tokio::test(start_paused = true)]
async fn dedup_above_dead_letter_makes_dead_lettering_effectively_once_too() {
    let letters: Arc<Mutex<Vec<DeadLetterRecord>>> = Arc::default();
    let sunk = letters.clone();
    let sink = service_fn(move |record: DeadLetterRecord| {
        let sunk = sunk.clone();
        async move {
            sunk.lock().unwrap().push(record);
            Ok::<_, BoxError>(())
        }
    });
    let mut stack = ServiceBuilder::new()
        .dedup(MemoryDedupStore::new(100))
        .dead_letter(sink)
        .decode::<Order>()
        .retry(RetryPolicy::exponential().max_attempts(2).jitter(false))
        .service_fn(|msg: Message<Order>| async move {
            if msg.payload.poison {
                Err(HandlerError::Poison(msg.payload.id))
            } else {
                Ok(())
            }
        });
    // A poison record and an undecodable one, each delivered twice (a replay).
    for _ in 0..2 {
        for (seq, kind) in [(1, Kind::Poison), (2, Kind::BadJson)] {
            let svc = stack.ready().await.unwrap();
            let call = svc.call(message("shardId-000000000000", seq, payload(seq, kind)));
            within("a call through the stack", call).await.unwrap();
        }
    }
    let letters = letters.lock().unwrap();
    let sequences: Vec<_> = letters.iter().map(msg_index_of).collect();
    assert_eq!(sequences, [1, 2], "each dead-lettered once");
}
