//! Properties of record-mode [`Batching`] over generated work: messages that are fine,
//! fail their bulk call or panic the bulk handler, any count limit and split limit, a bulk
//! handler that is sometimes down (a transient error) or not ready. Whatever happens,
//! every call is answered; a message gets `Ok` exactly when one bulk call that held it
//! succeeded (and then no other did); and a message gets an error the dead-letter layer
//! would dead-letter only for its own reason: it failed alone, or the split limit stopped
//! the narrowing on a piece that held a failing record.
//!
//! A fixed seed and a bounded number of cases run in the suite;
//! `SHARDFLOW_BATCH_CASES=N` runs N cases instead.

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use shardflow::Metadata;

use super::*;
use crate::test_support::{message, run_property};

/// What a message does to a bulk call that holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Fine,
    Poison,
    Panics,
}

#[derive(Clone, Debug)]
struct Scenario {
    kinds: Vec<Kind>,
    max_count: usize,
    splits: Splits,
    /// Whether the bulk handler's n-th call fails with a transient error (later do not).
    transient: Vec<bool>,
    /// Whether the bulk handler's n-th readiness check fails (later do not).
    unready: Vec<bool>,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    let kind = prop_oneof![
        8 => Just(Kind::Fine),
        1 => Just(Kind::Poison),
        1 => Just(Kind::Panics),
    ];
    (
        prop::collection::vec(kind, 1..=40),
        1usize..=12,
        prop_oneof![
            3 => Just(Splits::Full),
            1 => (0u32..=3).prop_map(Splits::AtMost),
            1 => Just(Splits::Off),
        ],
        prop::collection::vec(prop::bool::weighted(0.2), 0..=12),
        prop::collection::vec(prop::bool::weighted(0.1), 0..=12),
    )
        .prop_map(|(kinds, max_count, splits, transient, unready)| Scenario {
            kinds,
            max_count,
            splits,
            transient,
            unready,
        })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Transient,
    Poison,
    Panic,
}

#[derive(Debug)]
struct Call {
    records: Vec<usize>,
    outcome: Outcome,
}

#[derive(Default)]
struct Seen {
    calls: Vec<Call>,
    readiness_checks: usize,
}

/// A bulk handler that follows the scenario and writes down every call.
#[derive(Clone)]
struct Bulk {
    kinds: Arc<Vec<Kind>>,
    transient: Arc<Vec<bool>>,
    unready: Arc<Vec<bool>>,
    seen: Arc<Mutex<Seen>>,
}

impl Bulk {
    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Service<Vec<Message<Bytes>>> for Bulk {
    type Response = ();
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        let mut seen = self.seen();
        let check = seen.readiness_checks;
        seen.readiness_checks += 1;
        if self.unready.get(check).copied().unwrap_or(false) {
            return Poll::Ready(Err("the bulk client is closed".into()));
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, messages: Vec<Message<Bytes>>) -> Self::Future {
        let records: Vec<usize> = messages
            .iter()
            .map(|m| index(m.metadata.sequence_number.as_str()))
            .collect();
        let kinds: Vec<Kind> = records.iter().map(|&r| self.kinds[r]).collect();
        let mut seen = self.seen();
        let outcome = if self
            .transient
            .get(seen.calls.len())
            .copied()
            .unwrap_or(false)
        {
            Outcome::Transient
        } else if kinds.contains(&Kind::Panics) {
            Outcome::Panic
        } else if kinds.contains(&Kind::Poison) {
            Outcome::Poison
        } else {
            Outcome::Ok
        };
        let in_call = seen.calls.len() % 2 == 0;
        seen.calls.push(Call { records, outcome });
        drop(seen);
        // A panic in `call` itself or in its future, alternately.
        if outcome == Outcome::Panic && in_call {
            panic!("poison record (in call)");
        }
        Box::pin(async move {
            match outcome {
                Outcome::Ok => Ok(()),
                // A nested batching layer whose worker stopped: transient.
                Outcome::Transient => Err(Box::new(BatchError::Closed) as BoxError),
                Outcome::Poison => Err("constraint violated".into()),
                Outcome::Panic => panic!("poison record (in the future)"),
            }
        })
    }
}

fn index(sequence: &str) -> usize {
    sequence
        .parse()
        .expect("the tests' sequence numbers are indexes")
}

async fn run(scenario: Scenario) -> Result<(), TestCaseError> {
    let n = scenario.kinds.len();
    let bulk = Bulk {
        kinds: Arc::new(scenario.kinds.clone()),
        transient: Arc::new(scenario.transient.clone()),
        unready: Arc::new(scenario.unready.clone()),
        seen: Arc::default(),
    };
    let config = BatchConfig::new()
        .max_count(scenario.max_count)
        .linger(Duration::from_millis(10))
        .bisect(scenario.splits);
    let svc = Batching::new(bulk.clone(), config);
    let calls: Vec<_> = (0..n)
        .map(|i| {
            let svc = svc.clone();
            tokio::spawn(async move {
                <Batching<Bulk, Bytes> as ServiceExt<Message<Bytes>>>::oneshot(
                    svc,
                    message(i as u64, b"x"),
                )
                .await
            })
        })
        .collect();
    drop(svc);
    let mut answers = Vec::with_capacity(n);
    for (i, call) in calls.into_iter().enumerate() {
        let answer = tokio::time::timeout(Duration::from_secs(3600), call)
            .await
            .map_err(|_| TestCaseError::fail(format!("message {i} was never answered")))?
            .map_err(|e| TestCaseError::fail(format!("message {i}'s task: {e}")))?;
        answers.push(answer);
    }

    let seen = bulk.seen();
    let calls = &seen.calls;
    for (i, answer) in answers.iter().enumerate() {
        let handled = calls
            .iter()
            .filter(|c| c.outcome == Outcome::Ok && c.records.contains(&i))
            .count();
        let last = calls.iter().rev().find(|c| c.records.contains(&i));
        match answer {
            Ok(()) => prop_assert_eq!(handled, 1, "message {} Ok: handled once", i),
            Err(error) => {
                prop_assert_eq!(handled, 0, "message {} failed but was handled", i);
                let metadata: Metadata = message(i as u64, b"x").metadata;
                let dead_lettered = PermanentFailures.should_dead_letter(&**error, &metadata);
                let batch_error = error.downcast_ref::<BatchError>();
                if dead_lettered {
                    // Only for its own failure, or a piece the split limit kept whole.
                    let Some(last) = last else {
                        return Err(TestCaseError::fail(format!(
                            "message {i} fails ({error}) without a bulk call"
                        )));
                    };
                    let own = matches!(last.outcome, Outcome::Poison | Outcome::Panic)
                        && (last.records == [i] || scenario.splits != Splits::Full);
                    prop_assert!(
                        own,
                        "message {} ({:?}) would be dead-lettered for {}; calls: {:?}",
                        i,
                        scenario.kinds[i],
                        error,
                        calls
                    );
                    prop_assert!(
                        matches!(batch_error, Some(BatchError::Failed { .. })),
                        "{error}"
                    );
                } else {
                    // A transient failure: the last call was down, or never made.
                    prop_assert!(
                        matches!(batch_error, Some(BatchError::Unavailable { .. }))
                            || last.is_some_and(|c| c.outcome == Outcome::Transient),
                        "message {} failed transiently ({}) though its last call {:?} did not",
                        i,
                        error,
                        last
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn every_message_is_answered_by_its_own_outcome() {
    run_property("SHARDFLOW_BATCH_CASES", 13, scenario(), run);
}
