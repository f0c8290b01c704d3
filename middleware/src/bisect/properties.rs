//! Properties of [`Bisect`] over generated work: batches of fine, failing and panicking
//! records of any age, read back in deliveries of varying size the way a consumer
//! delivers them again from its checkpoint, under transient handler errors, a sink that
//! is sometimes down, and any split and attempts limit, the handler taking whole pieces
//! or being a bulk handler behind batch-mode [`Batching`](crate::batch::Batching) (a
//! record is written by each bulk call that succeeds with it). Whatever happens, each
//! record is handled or dead-lettered exactly once, is dead-lettered only for its own
//! reason (itself too old, failed alone, or its own attempts used up), fails in at most
//! `max_attempts` deliveries, and the checkpoint never passes a record that was
//! neither.
//!
//! A fixed seed and a bounded number of cases run in the suite;
//! `SHARDFLOW_BISECT_CASES=N` runs N cases instead.

use std::collections::BTreeSet;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use shardflow::{AckEvent, AckLog};
use tower::service_fn;
use tower::util::BoxCloneService;

use super::*;
use crate::test_support::{message, run_property};

/// What a record does to a call of the handler that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Fine,
    /// Fails the call with an error about the records.
    Poison,
    /// Panics the handler.
    Panics,
}

/// One generated run.
#[derive(Clone, Debug)]
struct Scenario {
    /// Each record's kind and its age at the start, in steps of [`STEP`].
    records: Vec<(Kind, u32)>,
    /// How many records each delivery holds (cycled): reads differ in size.
    sizes: Vec<usize>,
    /// Whether the handler's n-th call fails with a transient error (later calls do not).
    transient: Vec<bool>,
    /// Whether the sink's n-th call fails (later calls do not).
    sink_down: Vec<bool>,
    splits: Splits,
    max_attempts: Option<u32>,
    max_age: bool,
    /// The handler is a bulk handler behind batch-mode [`Batching`](crate::batch::Batching)
    /// with chunks of at most this many records (each chunk one bulk call).
    chunks: Option<usize>,
}

/// Time between two deliveries, and the unit of the records' ages.
const STEP: Duration = Duration::from_secs(600);
/// The age limit, between two whole steps so no age is ever at the limit.
const MAX_AGE: Duration = Duration::from_secs(3900);
/// More deliveries than any scenario needs to finish.
const MAX_DELIVERIES: usize = 400;

fn scenario() -> impl Strategy<Value = Scenario> {
    let kind = prop_oneof![
        8 => Just(Kind::Fine),
        1 => Just(Kind::Poison),
        1 => Just(Kind::Panics),
    ];
    (
        prop::collection::vec((kind, 0u32..=12), 1..=40),
        prop::collection::vec(1usize..=16, 1..=6),
        prop::collection::vec(prop::bool::weighted(0.2), 0..=20),
        prop::collection::vec(prop::bool::weighted(0.3), 0..=6),
        prop_oneof![
            3 => Just(Splits::Full),
            1 => (0u32..=3).prop_map(Splits::AtMost),
            1 => Just(Splits::Off),
        ],
        prop::option::of(1u32..=4),
        any::<bool>(),
        prop::option::weighted(0.3, 1usize..=6),
    )
        .prop_map(
            |(records, sizes, transient, sink_down, splits, max_attempts, max_age, chunks)| {
                // Without splitting down to single records only the attempts limit moves
                // a shard past a poison record: without it the shard retries for ever.
                let max_attempts = match splits {
                    Splits::Full => max_attempts,
                    _ => Some(max_attempts.unwrap_or(2)),
                };
                Scenario {
                    records,
                    sizes,
                    transient,
                    sink_down,
                    splits,
                    max_attempts,
                    max_age,
                    chunks,
                }
            },
        )
}

/// How a handler call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Transient,
    Poison,
    Panic,
}

#[derive(Debug)]
struct Call {
    delivery: usize,
    records: Vec<usize>,
    outcome: Outcome,
}

/// Everything the handler and the sink saw, and what broke a property.
#[derive(Default)]
struct World {
    kinds: Vec<Kind>,
    calls: Vec<Call>,
    /// The bulk calls behind [`Batching`](crate::batch::Batching), when it is there.
    bulk_calls: Vec<Call>,
    /// Per record: how many times it was handled (in a call that succeeded) or
    /// dead-lettered.
    finished: Vec<u32>,
    /// Per record: the reasons it was dead-lettered for.
    dead: Vec<Vec<String>>,
    /// Per record: the delivery it was finished in, and how (`handled` or the reason).
    finished_in: Vec<Option<(usize, String)>>,
    /// Per record: the deliveries that ended in a failing piece that held it (the
    /// attempts [`BisectConfig::max_attempts`] bounds).
    attempts: Vec<u32>,
    /// Whether the last thing done was a sink call that failed.
    sink_failed_last: bool,
    delivery: usize,
    sink_calls: usize,
    acks: Option<AckLog>,
    broken: Vec<String>,
}

impl World {
    /// The checkpoint (what was acknowledged so far) passes no unfinished record.
    fn check_acks(&mut self) {
        let Some(acks) = &self.acks else { return };
        for event in acks.events() {
            let AckEvent::AckThrough(position) = event else {
                self.broken.push(format!("the layer called {event:?}"));
                continue;
            };
            let through = index(position.sequence.as_str());
            if let Some(open) = (0..=through).find(|&i| self.finished[i] == 0) {
                self.broken.push(format!(
                    "acknowledged through {through} while {open} was neither handled nor dead-lettered"
                ));
            }
        }
    }

    /// Counts the attempts `delivery` used: the records of the failing piece that ended
    /// it (a handler call that failed last, not followed by a sink that failed), save
    /// those handled or dead-lettered as too old in it, and the records it dead-lettered
    /// because their attempts ran out. None may have more than `max`.
    fn count_attempts(&mut self, delivery: usize, ok: bool, max: Option<u32>) {
        let mut used: BTreeSet<usize> = (0..self.finished_in.len())
            .filter(|&r| {
                self.finished_in[r]
                    .as_ref()
                    .is_some_and(|(d, how)| *d == delivery && how == "attempts_exhausted")
            })
            .collect();
        let last = self
            .calls
            .last()
            .filter(|c| c.delivery == delivery && c.outcome != Outcome::Ok);
        if let (false, false, Some(last)) = (ok, self.sink_failed_last, last) {
            used.extend(last.records.iter().copied().filter(|&r| {
                !self.finished_in[r].as_ref().is_some_and(|(d, how)| {
                    *d == delivery && (how == "handled" || how == "too_old")
                })
            }));
        }
        for r in used {
            self.attempts[r] += 1;
            if let Some(max) = max.filter(|&max| self.attempts[r] > max) {
                self.broken.push(format!(
                    "record {r} failed in {} deliveries, more than its {max} attempts",
                    self.attempts[r]
                ));
            }
        }
    }

    fn finish(&mut self, record: usize, what: &str) {
        self.finished_in[record] = Some((self.delivery, what.to_owned()));
        self.finished[record] += 1;
        if self.finished[record] > 1 {
            self.broken.push(format!(
                "record {record} finished twice (the second: {what})"
            ));
        }
    }
}

type Shared = Arc<Mutex<World>>;

fn lock(world: &Shared) -> std::sync::MutexGuard<'_, World> {
    world.lock().unwrap_or_else(PoisonError::into_inner)
}

fn index(sequence: &str) -> usize {
    sequence
        .parse()
        .expect("the tests' sequence numbers are indexes")
}

/// A transient error: the store is down.
#[derive(Debug, thiserror::Error)]
#[error("the database is down")]
struct Down;

fn not_down(e: &(dyn std::error::Error + Send + Sync + 'static), _: &shardflow::Metadata) -> bool {
    !e.is::<Down>()
}

/// The inner service of the layer under test.
type Inner = BoxCloneService<Batch<Bytes>, (), BoxError>;

/// How a call holding records of these kinds ends: the `call`-th call may be down.
fn verdict(transient: &[bool], call: usize, kinds: &[Kind]) -> Outcome {
    if transient.get(call).copied().unwrap_or(false) {
        Outcome::Transient
    } else if kinds.contains(&Kind::Panics) {
        Outcome::Panic
    } else if kinds.contains(&Kind::Poison) {
        Outcome::Poison
    } else {
        Outcome::Ok
    }
}

/// Calls with `outcome`; panics (in `call` itself or in its future, alternately by
/// `call`) when the outcome is a panic.
fn answer(outcome: Outcome, call: usize) -> impl Future<Output = Result<(), BoxError>> {
    if outcome == Outcome::Panic && call % 2 == 0 {
        panic!("poison record (in call)");
    }
    async move {
        match outcome {
            Outcome::Ok => Ok(()),
            Outcome::Transient => Err(Box::new(Down) as BoxError),
            Outcome::Poison => Err("constraint violated".into()),
            Outcome::Panic => panic!("poison record (in the future)"),
        }
    }
}

fn indexes(messages: &[Message<Bytes>]) -> Vec<usize> {
    messages
        .iter()
        .map(|m| index(m.metadata.sequence_number.as_str()))
        .collect()
}

/// A handler of whole pieces.
fn whole(world: Shared, transient: Vec<bool>) -> Inner {
    BoxCloneService::new(service_fn(move |batch: Batch<Bytes>| {
        let mut w = lock(&world);
        w.check_acks();
        w.sink_failed_last = false;
        let records = indexes(&batch.messages);
        let kinds: Vec<Kind> = records.iter().map(|&r| w.kinds[r]).collect();
        let call = w.calls.len();
        let outcome = verdict(&transient, call, &kinds);
        if outcome == Outcome::Ok {
            for &r in &records {
                w.finish(r, "handled");
            }
        }
        let delivery = w.delivery;
        w.calls.push(Call {
            delivery,
            records,
            outcome,
        });
        drop(w);
        answer(outcome, call)
    }))
}

/// A bulk handler behind batch-mode [`Batching`](crate::batch::Batching), chunks of at most
/// `max` records: a record is handled (written) by each bulk call that succeeds with it,
/// even when a later chunk of the same piece fails.
fn chunked(world: Shared, transient: Vec<bool>, max: usize) -> Inner {
    let kinds = Arc::new(lock(&world).kinds.clone());
    let bulk_calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let writes = world.clone();
    let bulk = service_fn(move |messages: Vec<Message<Bytes>>| {
        let call = bulk_calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let records = indexes(&messages);
        let chunk: Vec<Kind> = records.iter().map(|&r| kinds[r]).collect();
        let outcome = verdict(&transient, call, &chunk);
        let mut w = lock(&writes);
        w.check_acks();
        if outcome == Outcome::Ok {
            for &r in &records {
                w.finish(r, "handled");
            }
        }
        let delivery = w.delivery;
        w.bulk_calls.push(Call {
            delivery,
            records,
            outcome,
        });
        drop(w);
        answer(outcome, call)
    });
    let batching =
        crate::batch::Batching::new(bulk, crate::batch::BatchConfig::new().max_count(max));
    BoxCloneService::new(service_fn(move |batch: Batch<Bytes>| {
        let mut w = lock(&world);
        w.check_acks();
        w.sink_failed_last = false;
        let records = indexes(&batch.messages);
        let at = w.calls.len();
        let delivery = w.delivery;
        w.calls.push(Call {
            delivery,
            records,
            outcome: Outcome::Ok,
        });
        drop(w);
        let batching = batching.clone();
        let world = world.clone();
        async move {
            let result = ServiceExt::<Batch<Bytes>>::oneshot(batching, batch).await;
            let outcome = match &result {
                Ok(()) => Outcome::Ok,
                Err(e) if e.is::<Down>() => Outcome::Transient,
                Err(e) if e.is::<Panicked>() => Outcome::Panic,
                Err(_) => Outcome::Poison,
            };
            lock(&world).calls[at].outcome = outcome;
            result
        }
    }))
}

/// Runs one scenario the way a consumer would: deliver from the checkpoint, call, move the
/// checkpoint to what was acknowledged (all of the batch on `Ok`), wait, deliver again.
async fn run(scenario: Scenario) -> Result<(), TestCaseError> {
    let n = scenario.records.len();
    let world: Shared = Arc::new(Mutex::new(World {
        kinds: scenario.records.iter().map(|(kind, _)| *kind).collect(),
        finished: vec![0; n],
        finished_in: vec![None; n],
        attempts: vec![0; n],
        dead: vec![Vec::new(); n],
        ..World::default()
    }));
    let start_wall = SystemTime::now();
    let start = tokio::time::Instant::now();
    let now = move || start_wall + start.elapsed();
    let ages: Vec<Duration> = scenario
        .records
        .iter()
        .map(|(_, age)| STEP * *age)
        .collect();

    let handler = match scenario.chunks {
        None => whole(world.clone(), scenario.transient.clone()),
        Some(max) => chunked(world.clone(), scenario.transient.clone(), max),
    };

    let sunk = world.clone();
    let sink_down = scenario.sink_down.clone();
    let sink = service_fn(move |record: DeadLetterRecord| {
        let mut w = lock(&sunk);
        w.check_acks();
        let call = w.sink_calls;
        w.sink_calls += 1;
        let down = sink_down.get(call).copied().unwrap_or(false);
        w.sink_failed_last = down;
        if !down {
            let r = index(record.metadata.sequence_number.as_str());
            let reason = record
                .error
                .split(':')
                .next()
                .unwrap_or_default()
                .to_owned();
            w.dead[r].push(reason.clone());
            w.finish(r, &reason);
        }
        async move {
            if down {
                Err::<(), BoxError>("the sink is down".into())
            } else {
                Ok(())
            }
        }
    });

    let mut config = BisectConfig::new().splits(scenario.splits);
    if let Some(max) = scenario.max_attempts {
        config = config.max_attempts(max);
    }
    if scenario.max_age {
        config = config.max_record_age(MAX_AGE);
    }
    let layer = BisectLayer::with_config(sink, config)
        .map_err(|e| TestCaseError::fail(e.to_string()))?
        .policy(
            not_down
                as fn(
                    &(dyn std::error::Error + Send + Sync + 'static),
                    &shardflow::Metadata,
                ) -> bool,
        );
    let svc = layer.layer(handler);

    let mut next = 0;
    let mut delivery = 0;
    while next < n {
        prop_assert!(
            delivery < MAX_DELIVERIES,
            "no progress past record {next} after {delivery} deliveries"
        );
        let size = scenario.sizes[delivery % scenario.sizes.len()];
        let end = (next + size).min(n);
        let messages = (next..end)
            .map(|i| {
                let mut m = message(i as u64, b"x");
                m.metadata.approximate_arrival = Some(start_wall - ages[i]);
                m
            })
            .collect();
        let (batch, acks) = Batch::for_test(
            Arc::from("orders"),
            Arc::from("shardId-000000000000"),
            messages,
        );
        {
            let mut w = lock(&world);
            w.delivery = delivery;
            w.acks = Some(acks.clone());
        }
        let answer =
            tokio::time::timeout(Duration::from_secs(24 * 3600), svc.clone().oneshot(batch))
                .await
                .map_err(|_| TestCaseError::fail(format!("delivery {delivery} did not end")))?;
        {
            let mut w = lock(&world);
            w.check_acks();
            w.count_attempts(delivery, answer.is_ok(), scenario.max_attempts);
            match answer {
                Ok(_) => {
                    if let Some(open) = (next..end).find(|&i| w.finished[i] == 0) {
                        w.broken.push(format!(
                            "Ok while record {open} was neither handled nor dead-lettered"
                        ));
                    }
                    next = end;
                }
                Err(_) => {
                    let from = acks
                        .acked_through()
                        .map_or(next, |p| index(p.sequence.as_str()) + 1);
                    if let Some(done) = (from..end).find(|&i| w.finished[i] > 0) {
                        w.broken.push(format!(
                            "record {done} was finished but the checkpoint stops before it"
                        ));
                    }
                    next = from;
                }
            }
            prop_assert!(w.broken.is_empty(), "{:?}", w.broken);
        }
        delivery += 1;
        tokio::time::advance(STEP).await;
    }

    let w = lock(&world);
    let at_end = now();
    for (r, age) in ages.iter().enumerate() {
        prop_assert_eq!(
            w.finished[r],
            1,
            "record {} handled or dead-lettered once",
            r
        );
        for reason in &w.dead[r] {
            let own = match reason.as_str() {
                "failed_alone" => {
                    // Behind Batching, the call that failed alone is a bulk call.
                    let calls = match scenario.chunks {
                        Some(_) => &w.bulk_calls,
                        None => &w.calls,
                    };
                    let last = calls.iter().rev().find(|c| c.records.contains(&r));
                    w.kinds[r] != Kind::Fine
                        && last.is_some_and(|c| {
                            c.records == [r]
                                && matches!(c.outcome, Outcome::Poison | Outcome::Panic)
                        })
                }
                // Ages only grow: too old at the end if it was when dead-lettered, and
                // a record that was young at the end was young throughout.
                "too_old" => {
                    scenario.max_age
                        && at_end
                            .duration_since(start_wall - *age)
                            .is_ok_and(|age| age > MAX_AGE)
                }
                "attempts_exhausted" => {
                    let failed_in: BTreeSet<usize> = w
                        .calls
                        .iter()
                        .filter(|c| c.outcome != Outcome::Ok && c.records.contains(&r))
                        .map(|c| c.delivery)
                        .collect();
                    scenario
                        .max_attempts
                        .is_some_and(|max| failed_in.len() >= max as usize)
                }
                _ => false,
            };
            prop_assert!(
                own,
                "record {} ({:?}) dead-lettered as {} not for its own reason; calls: {:?}",
                r,
                w.kinds[r],
                reason,
                w.calls
            );
        }
    }
    Ok(())
}

#[test]
fn every_record_is_handled_or_dead_lettered_once_for_its_own_reason() {
    run_property("SHARDFLOW_BISECT_CASES", 11, scenario(), run);
}
