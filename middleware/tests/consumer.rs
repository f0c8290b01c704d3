//! The full stack under the real consumer (`Consumer::run`) on the embedded backend:
//! bad JSON, poison records, a flaky handler, a handler that panics and a flaky
//! dead-letter sink.
//! Every record ends handled exactly once or dead-lettered with its error.

mod common;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{within, Rng};
use shardflow::kinesis::{PutOutcome, PutRecord};
use shardflow::{Backend, Consumer, Memory, Message};
use shardflow_middleware::dead_letter::DeadLetterRecord;
use shardflow_middleware::{
    BoxError, ErrorClass, MemoryDedupStore, RetryPolicy, ServiceBuilderExt,
};
use tokio::sync::Notify;
use tower::{service_fn, ServiceBuilder};

const RECORDS: u64 = 400;

#[derive(Clone, serde::Deserialize)]
struct Order {
    id: u64,
    #[serde(default)]
    poison: bool,
}

#[derive(Debug)]
enum Failure {
    Flaky,
    Poison,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Failure::Flaky => "flaky dependency",
            Failure::Poison => "poison order",
        })
    }
}

impl std::error::Error for Failure {}

#[derive(Default)]
struct Seen {
    effects: HashMap<u64, u32>,
    dead: HashMap<u64, Vec<String>>,
    /// Calls so far per record id, over every delivery: the handler's and the sink's.
    handler_calls: HashMap<u64, u32>,
    sink_calls: HashMap<u64, u32>,
}

/// Whether call number `attempt` for record `id` fails, with probability `p`: a pure
/// function of its arguments, so where the faults fall does not depend on how the two
/// shards' tasks interleave on the two threads. (A record's calls are sequential: it
/// lives on one shard, which the consumer serves one record at a time.)
fn fault(seed: u64, id: u64, attempt: u32, p: f64) -> bool {
    Rng::new(seed ^ id.rotate_left(32) ^ u64::from(attempt)).chance(p)
}

/// The order id at the start of a payload; bad JSON still starts with it.
fn id_of(payload: &[u8]) -> u64 {
    let text = String::from_utf8_lossy(payload);
    text.trim_start_matches(r#"{"id":"#)
        .split([',', '}'])
        .next()
        .and_then(|n| n.parse().ok())
        .expect("an id in the payload")
}

impl Seen {
    fn finished(&self) -> usize {
        let done: HashSet<u64> = self
            .effects
            .keys()
            .chain(self.dead.keys())
            .copied()
            .collect();
        done.len()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stack_under_the_consumer_loses_nothing_and_repeats_no_side_effect() {
    let backend = Memory::new();
    let kinesis = backend.admin().unwrap();
    kinesis.create_stream("orders", 2).await.unwrap();

    // 5% bad JSON, 5% poison, the rest good; the id is the record's index.
    let mut rng = Rng::new(11);
    let records: Vec<PutRecord> = (0..RECORDS)
        .map(|id| {
            let data = match rng.below(20) {
                0 => format!(r#"{{"id":{id},"#),
                1 => format!(r#"{{"id":{id},"poison":true}}"#),
                _ => format!(r#"{{"id":{id}}}"#),
            };
            PutRecord {
                data: Bytes::from(data),
                partition_key: format!("customer-{}", id % 37),
                explicit_hash_key: None,
            }
        })
        .collect();
    let outcomes = kinesis.put_records("orders", &records).await.unwrap();
    assert!(outcomes
        .iter()
        .all(|o| !matches!(o, PutOutcome::Failed { .. })));

    let seen: Arc<Mutex<Seen>> = Arc::default();
    let progress = Arc::new(Notify::new());

    let sink = service_fn({
        let (seen, progress) = (seen.clone(), progress.clone());
        move |record: DeadLetterRecord| {
            let id = id_of(&record.payload);
            let fail = {
                let mut seen = seen.lock().unwrap();
                let attempt = seen.sink_calls.entry(id).or_default();
                *attempt += 1;
                fault(13, id, *attempt, 0.1)
            };
            let (seen, progress) = (seen.clone(), progress.clone());
            async move {
                if fail {
                    return Err::<(), BoxError>("dead-letter stream throttled".into());
                }
                seen.lock()
                    .unwrap()
                    .dead
                    .entry(id)
                    .or_default()
                    .push(record.error);
                progress.notify_one();
                Ok(())
            }
        }
    });
    let handler = service_fn({
        let (seen, progress) = (seen.clone(), progress.clone());
        move |msg: Message<Order>| {
            let fail = {
                let mut seen = seen.lock().unwrap();
                let attempt = seen.handler_calls.entry(msg.payload.id).or_default();
                *attempt += 1;
                fault(12, msg.payload.id, *attempt, 0.2)
            };
            let (seen, progress) = (seen.clone(), progress.clone());
            async move {
                if msg.payload.poison {
                    return Err(Failure::Poison);
                }
                if fail {
                    return Err(Failure::Flaky);
                }
                *seen
                    .lock()
                    .unwrap()
                    .effects
                    .entry(msg.payload.id)
                    .or_default() += 1;
                progress.notify_one();
                Ok(())
            }
        }
    });
    let stack = ServiceBuilder::new()
        .dead_letter(sink)
        .decode::<Order>()
        .dedup(MemoryDedupStore::new(10_000))
        .retry(
            RetryPolicy::exponential()
                .max_attempts(3)
                .initial_delay(Duration::from_millis(1))
                .jitter_seed(14)
                .classify(|e: &Failure| match e {
                    Failure::Poison => ErrorClass::Permanent,
                    Failure::Flaky => ErrorClass::Transient,
                }),
        )
        .service(handler);

    let consumer = Consumer::builder()
        .stream("orders")
        .group("billing")
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = consumer.run(stack).spawn();

    let all_finished = async {
        while seen.lock().unwrap().finished() < RECORDS as usize {
            progress.notified().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all_finished)
        .await
        .expect("every record finishes within a minute");
    within("the consumer stops", running.shutdown())
        .await
        .unwrap();

    let seen = seen.lock().unwrap();
    let letters: usize = seen.dead.values().map(Vec::len).sum();
    eprintln!(
        "{} handled, {} dead-lettered ({letters} dead letters)",
        seen.effects.len(),
        seen.dead.len()
    );
    assert!(!seen.dead.is_empty());
    for id in 0..RECORDS {
        let effects = seen.effects.get(&id).copied().unwrap_or(0);
        match seen.dead.get(&id) {
            None => assert_eq!(effects, 1, "record {id}: side effects"),
            Some(errors) => {
                // A dead-lettered record never ran its side effect, and is never
                // delivered again: the sink's acceptance acknowledges it, and after a
                // failure the consumer drains and commits what was acknowledged before
                // it reads again from the checkpoint. So one dead letter, no effect.
                assert_eq!(effects, 0, "record {id}: side effects");
                assert_eq!(errors.len(), 1, "record {id}: {errors:?}");
            }
        }
    }
}

/// Regression: a handler that panicked on one record killed its shard's dispatch instead
/// of failing the call, so a poison record that panics could not be dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_panics_the_handler_is_dead_lettered_once_and_the_checkpoint_passes_it() {
    const POISON: u64 = 17;
    const COUNT: u64 = 30;
    let backend = Memory::new();
    let kinesis = backend.admin().unwrap();
    kinesis.create_stream("orders", 1).await.unwrap();
    let records: Vec<PutRecord> = (0..COUNT)
        .map(|id| PutRecord {
            data: Bytes::from(format!(r#"{{"id":{id}}}"#)),
            partition_key: format!("customer-{id}"),
            explicit_hash_key: None,
        })
        .collect();
    let outcomes = kinesis.put_records("orders", &records).await.unwrap();
    let Some(PutOutcome::Stored {
        sequence_number: last,
        ..
    }) = outcomes.last().cloned()
    else {
        panic!("stored: {outcomes:?}")
    };

    let seen: Arc<Mutex<Seen>> = Arc::default();
    let progress = Arc::new(Notify::new());
    let sink = service_fn({
        let (seen, progress) = (seen.clone(), progress.clone());
        move |record: DeadLetterRecord| {
            let mut seen = seen.lock().unwrap();
            seen.dead
                .entry(id_of(&record.payload))
                .or_default()
                .push(format!(
                    "{} after {:?} attempts",
                    record.error, record.attempts
                ));
            progress.notify_one();
            async { Ok::<(), BoxError>(()) }
        }
    });
    let handler = service_fn({
        let (seen, progress) = (seen.clone(), progress.clone());
        move |msg: Message<Order>| {
            let (seen, progress) = (seen.clone(), progress.clone());
            async move {
                *seen
                    .lock()
                    .unwrap()
                    .handler_calls
                    .entry(msg.payload.id)
                    .or_default() += 1;
                if msg.payload.id == POISON {
                    panic!("order {} cannot be charged", msg.payload.id);
                }
                *seen
                    .lock()
                    .unwrap()
                    .effects
                    .entry(msg.payload.id)
                    .or_default() += 1;
                progress.notify_one();
                Ok::<(), Failure>(())
            }
        }
    });
    let stack = ServiceBuilder::new()
        .dead_letter(sink)
        .decode::<Order>()
        .dedup(MemoryDedupStore::new(1_000))
        .retry(
            RetryPolicy::exponential()
                .max_attempts(3)
                .initial_delay(Duration::from_millis(1))
                .jitter_seed(5),
        )
        .service(handler);
    let consumer = Consumer::builder()
        .stream("orders")
        .group("billing")
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = consumer.run(stack).spawn();
    let all_finished = async {
        while seen.lock().unwrap().finished() < COUNT as usize {
            progress.notified().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all_finished)
        .await
        .expect("every record finishes within a minute");
    within("the consumer stops", running.shutdown())
        .await
        .unwrap();

    let rows = backend.lease_store("billing").list().await.unwrap();
    let seen = seen.lock().unwrap();
    for id in (0..COUNT).filter(|&id| id != POISON) {
        assert_eq!(seen.effects.get(&id), Some(&1), "record {id} handled once");
    }
    assert_eq!(seen.effects.get(&POISON), None);
    assert_eq!(seen.handler_calls.get(&POISON), Some(&3), "three attempts");
    assert_eq!(
        seen.dead.get(&POISON),
        Some(&vec![
            "the handler panicked: order 17 cannot be charged after Some(3) attempts".to_owned()
        ]),
        "dead-lettered once, with the panic's message"
    );
    assert_eq!(rows.len(), 1);
    match &rows[0].checkpoint {
        shardflow::lease::Checkpoint::At(position) => {
            assert_eq!(
                position.sequence, last,
                "the checkpoint passed the poison record"
            )
        }
        other => panic!("checkpoint {other:?}"),
    }
}
