//! The lease table failing a worker's lease rounds while the group runs (an IAM policy
//! changed under a running fleet: `UpdateItem` or `Scan` refused; writes throttled while
//! reads answer): either the shards are still read, or the workers say they are not (not
//! ready, with the cause). Memory backend, tokio's paused clock.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use shardflow::kinesis::{KinesisError, StreamAdmin};
use shardflow::lease::LeaseError;
use shardflow::{Health, Memory};
use testkit::hooks::{Hooked, Hooks};
use testkit::*;

/// Virtual time (the clock is paused): generous, and never a real wait.
const LIMIT: Duration = Duration::from_secs(120);
/// How long a shard may wait unread before its worker must say so: a lease duration
/// (3 s in the test timings) for the lease to be given up, the stuck threshold set below
/// and a few rounds, with a wide margin.
const SAID_WITHIN: Duration = Duration::from_secs(40);
const STUCK_AFTER: Duration = Duration::from_secs(10);

/// The lease-table calls DynamoDB makes with `UpdateItem`.
const UPDATE_ITEM: &[&str] = &[
    "take",
    "renew",
    "checkpoint",
    "release",
    "request_handoff",
    "withdraw_handoff",
    "reset",
    "request_reset",
    "record_children",
];

/// Refuses the lease-table calls named in `refused` (as an IAM policy without that
/// action would), or throttles them while `throttle` is set; once `dead`, no call of this
/// process answers any more (a crash).
#[derive(Default)]
struct Policy {
    refused: Mutex<BTreeSet<&'static str>>,
    throttle: AtomicBool,
    dead: AtomicBool,
}

impl Policy {
    fn refuse(&self, ops: &[&'static str]) {
        self.refused.lock().unwrap().extend(ops.iter().copied());
    }

    fn allow_all(&self) {
        self.refused.lock().unwrap().clear();
    }
}

#[async_trait::async_trait]
impl Hooks for Policy {
    async fn before_lease(&self, op: &'static str, _key: Option<&str>) -> Result<(), LeaseError> {
        if self.dead.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        if self.refused.lock().unwrap().contains(op) && self.throttle.load(Ordering::SeqCst) {
            return Err(LeaseError::Throttled(
                format!("injected: {op} exceeds the table's provisioned write capacity").into(),
            ));
        }
        if self.refused.lock().unwrap().contains(op) {
            return Err(LeaseError::AccessDenied(
                format!("injected: the policy does not allow {op} on the lease table").into(),
            ));
        }
        Ok(())
    }

    async fn before_kinesis(&self, _op: &'static str) -> Result<(), KinesisError> {
        if self.dead.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// Whether every record of `values` was handled.
fn all_handled(recorder: &Recorder, values: std::ops::Range<usize>) -> bool {
    let seen: BTreeSet<usize> = recorder.snapshot().iter().map(|h| h.value).collect();
    values.into_iter().all(|v| seen.contains(&v))
}

/// Waits up to `SAID_WITHIN` for the records `values` to be handled or `health` to say
/// the worker is not ready; panics (with the health) when neither happens.
async fn read_or_said(
    recorder: &Recorder,
    values: std::ops::Range<usize>,
    health: impl Fn() -> Health,
) {
    let mut waited = Duration::ZERO;
    while waited < SAID_WITHIN {
        if all_handled(recorder, values.clone()) || !health().is_ready() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        waited += Duration::from_millis(500);
    }
    panic!(
        "records {values:?} waited {SAID_WITHIN:?} unread while the worker said it was ready: {:?}",
        health()
    );
}

/// `UpdateItem` on the lease table refused while a worker runs: no lease can be renewed,
/// taken or checkpointed, so nothing is read any more; the worker must say so, with the
/// cause, and read on (ready again) once the policy allows the writes again.
#[tokio::test(start_paused = true)]
async fn lease_writes_refused_mid_run_leave_no_shard_unread_while_ready() {
    lease_writes_fail_mid_run(false, "access denied").await;
}

/// The lease table's writes throttled for good (its write capacity exhausted) while its
/// reads answer: as with `UpdateItem` refused, no lease is renewed or taken; the worker
/// says so once its rounds failed for a lease duration, and reads on once writes land.
#[tokio::test(start_paused = true)]
async fn lease_writes_throttled_for_good_leave_no_shard_unread_while_ready() {
    lease_writes_fail_mid_run(true, "throttled").await;
}

/// One worker reads 10 records, then its lease-table writes fail (refused, or throttled
/// with `throttle`) for longer than a lease: 10 more records are read or the worker is
/// not ready with `cause` named; once the writes land again it reads them and is ready.
async fn lease_writes_fail_mid_run(throttle: bool, cause: &str) {
    let memory = Memory::new();
    memory.streams().create_stream("orders", 2).await.unwrap();
    produce(memory.streams().as_ref(), "orders", 0..10).await;
    let backend = Hooked::new(memory.clone(), Policy::default());
    let policy = backend.hooks.clone();
    let recorder = Recorder::default();
    let consumer = test_consumer(backend, "orders", "billing", "w1")
        .stuck_after(STUCK_AFTER)
        .build()
        .unwrap();
    let running = consumer.run(recording_handler(recorder.clone())).spawn();
    recorder.wait_for(10, LIMIT).await;

    policy.throttle.store(throttle, Ordering::SeqCst);
    policy.refuse(UPDATE_ITEM);
    // Long enough for every held lease to be given up (no renewal lands).
    tokio::time::sleep(Duration::from_secs(10)).await;
    produce(memory.streams().as_ref(), "orders", 10..20).await;
    read_or_said(&recorder, 10..20, || running.health()).await;
    let health = running.health();
    assert!(
        health
            .lease_rounds_failing
            .as_deref()
            .is_some_and(|named| named.contains(cause)),
        "the cause is named: {health:?}"
    );

    policy.allow_all();
    recorder
        .wait_for_values(&(10..20).collect::<Vec<_>>(), LIMIT)
        .await;
    within(LIMIT, "ready again once the writes land", async {
        while !running.health().is_ready() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert_eq!(running.health().lease_rounds_failing, None);
    drop(running);
}

/// `Scan` on the lease table refused for every worker, then one of two workers
/// crashes: its leases expire, and nobody can list the table to find them. Either the
/// survivor reads them, or it says it cannot.
#[tokio::test(start_paused = true)]
async fn a_crash_while_scans_are_refused_leaves_no_shard_unread_while_ready() {
    let memory = Memory::new();
    memory.streams().create_stream("orders", 4).await.unwrap();
    produce(memory.streams().as_ref(), "orders", 0..40).await;
    let recorder = Recorder::default();
    let start = |id: &str| {
        let backend = Hooked::new(memory.clone(), Policy::default());
        let policy = backend.hooks.clone();
        let consumer = test_consumer(backend, "orders", "billing", id)
            .stuck_after(STUCK_AFTER)
            .build()
            .unwrap();
        (
            policy,
            consumer.run(recording_handler(recorder.clone())).spawn(),
        )
    };
    let (p1, w1) = start("w1");
    let (p2, w2) = start("w2");
    within(LIMIT, "two shards each", async {
        loop {
            let (a, b) = (w1.health().shards.len(), w2.health().shards.len());
            if a == 2 && b == 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    recorder.wait_for(40, LIMIT).await;

    p1.refuse(&["list"]);
    p2.refuse(&["list"]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    p2.dead.store(true, Ordering::SeqCst);
    produce(memory.streams().as_ref(), "orders", 40..80).await;
    read_or_said(&recorder, 40..80, || w1.health()).await;
    drop((w1, w2));
}

/// A worker whose policy does not allow `Scan` on the lease table at start-up cannot
/// find a lease: like a coordinator-state table refused at start-up, `run` ends with the
/// typed error within the start-up deadline instead of retrying for ever.
#[tokio::test(start_paused = true)]
async fn a_lease_table_refused_at_start_up_is_a_typed_error() {
    let memory = Memory::new();
    memory.streams().create_stream("orders", 2).await.unwrap();
    let policy = Policy::default();
    policy.refuse(&["list"]);
    let consumer = test_consumer(Hooked::new(memory, policy), "orders", "billing", "w1")
        .build()
        .unwrap();
    let recorder = Recorder::default();
    let ended = tokio::time::timeout(
        Duration::from_secs(60),
        std::future::IntoFuture::into_future(consumer.run(recording_handler(recorder))),
    )
    .await
    .expect("start-up ends instead of retrying for ever");
    assert!(
        matches!(
            ended,
            Err(shardflow::ConsumerError::Lease(LeaseError::AccessDenied(_)))
        ),
        "{ended:?}"
    );
}

/// A worker whose policy does not allow `UpdateItem` on the lease table at start-up can
/// list the table and create its rows but take no lease: `run` ends with the typed
/// error within the start-up deadline instead of retrying for ever.
#[tokio::test(start_paused = true)]
async fn lease_writes_refused_at_start_up_are_a_typed_error() {
    let memory = Memory::new();
    memory.streams().create_stream("orders", 2).await.unwrap();
    let policy = Policy::default();
    policy.refuse(UPDATE_ITEM);
    let consumer = test_consumer(Hooked::new(memory, policy), "orders", "billing", "w1")
        .build()
        .unwrap();
    let recorder = Recorder::default();
    let ended = tokio::time::timeout(
        Duration::from_secs(60),
        std::future::IntoFuture::into_future(consumer.run(recording_handler(recorder))),
    )
    .await
    .expect("start-up ends instead of retrying for ever");
    assert!(
        matches!(
            ended,
            Err(shardflow::ConsumerError::Lease(LeaseError::AccessDenied(_)))
        ),
        "{ended:?}"
    );
}
