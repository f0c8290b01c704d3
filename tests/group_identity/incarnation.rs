//! A durable start for LATEST and AT_TIMESTAMP, and one owner per process incarnation
//! (memory backend, paused clock).
//!
//! - A LATEST (or AT_TIMESTAMP) start is written into the lease row when the lease is
//!   first taken, so whoever owns the shard next continues from it: nothing written
//!   after the first take is skipped, however the first owner left.
//! - Two processes with the same worker id are two owners: they never both commit
//!   under one lease counter, and a checkpoint never moves back.

use testkit::hooks;

use std::collections::BTreeSet;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use hooks::{Hooked, Hooks};
use shardflow::kinesis::StreamAdmin;
use shardflow::lease::{Checkpoint, Lease, LeaseError};
use shardflow::{CheckpointPolicy, InitialPosition, Memory, Message};
use testkit::{produce, recording_handler, test_consumer, Recorder};

/// Virtual time (the clock is paused): generous, and never a real wait.
const LIMIT: Duration = Duration::from_secs(120);

/// One successful checkpoint write: which consumer wrote it, under which counter.
#[derive(Clone, Debug)]
struct Commit {
    writer: usize,
    key: String,
    counter: u64,
    checkpoint: Checkpoint,
}

/// One consumer's view of the memory backend: its checkpoint writes are logged (in the
/// order the store applied them), and once `dead` every lease call fails (a crash, as
/// the table sees it).
struct Observed {
    writer: usize,
    commits: Arc<Mutex<Vec<Commit>>>,
    dead: AtomicBool,
}

impl Observed {
    fn on(
        memory: &Memory,
        writer: usize,
        commits: Arc<Mutex<Vec<Commit>>>,
    ) -> Hooked<Memory, Self> {
        let observed = Observed {
            writer,
            commits,
            dead: AtomicBool::new(false),
        };
        Hooked::new(memory.clone(), observed)
    }
}

#[async_trait]
impl Hooks for Observed {
    async fn before_lease(&self, _: &'static str, _: Option<&str>) -> Result<(), LeaseError> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(LeaseError::Other("crashed".into()));
        }
        Ok(())
    }

    async fn after_lease(&self, op: &'static str, _: Option<&str>, row: Option<&Lease>) {
        // The memory store answers without yielding, so on this single-threaded
        // runtime the log has the order the writes were applied in.
        if let ("checkpoint", Some(row)) = (op, row) {
            self.commits.lock().unwrap().push(Commit {
                writer: self.writer,
                key: row.key.clone(),
                counter: row.counter,
                checkpoint: row.checkpoint.clone(),
            });
        }
    }
}

/// Polls `done` every 10 ms of virtual time; fails the test after `LIMIT`.
async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let wait = async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    if tokio::time::timeout(LIMIT, wait).await.is_err() {
        panic!("timed out waiting until {what}");
    }
}

/// The values below `bound` handled so far.
fn handled_below(recorder: &Recorder, bound: usize) -> BTreeSet<usize> {
    recorder
        .snapshot()
        .iter()
        .map(|h| h.value)
        .filter(|v| *v < bound)
        .collect()
}

/// How the first owner of a LATEST lease leaves before its first checkpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Leave {
    /// A graceful stop before any record came.
    Stop,
    /// Records delivered, never acknowledged; then the process is gone (its lease
    /// calls fail) and the lease expires.
    Crash,
    /// Records delivered, their handler never finishes; a stop's drain times out.
    DrainTimeout,
    /// Every record fails in the handler; then a stop.
    FailureThenStop,
}

/// Worker A takes the only (LATEST) lease, leaves in the way given, records are
/// written meanwhile, worker B takes over: every record written after A's first take
/// is handled.
async fn a_latest_start_survives(leave: Leave) {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("latest", 1).await.unwrap();
    produce(kinesis.as_ref(), "latest", 1_000_000..1_000_010).await; // before the group
    let a_view = Observed::on(&memory, 0, Arc::default());
    let a_recorder = Recorder::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (recorder, calls) = (a_recorder.clone(), calls.clone());
        tower::service_fn(move |msg: Message| {
            calls.fetch_add(1, Ordering::SeqCst);
            let recorder = recorder.clone();
            async move {
                match leave {
                    Leave::Stop => {
                        recorder.record(&msg);
                        Ok(())
                    }
                    Leave::Crash | Leave::DrainTimeout => {
                        std::future::pending::<()>().await;
                        Ok(())
                    }
                    Leave::FailureThenStop => Err("injected"),
                }
            }
        })
    };
    let a = test_consumer(a_view.clone(), "latest", "latest-group", "a")
        .initial_position(InitialPosition::Latest)
        .shutdown_timeout(Duration::from_secs(1))
        .seed(1)
        .build()
        .unwrap();
    let a_stop = a.shutdown_handle();
    let a_run = tokio::spawn(a.run(handler).into_future());
    let table = memory.table("latest-group");
    until("A took the lease", || {
        table.rows().first().and_then(|r| r.owner.clone()).is_some()
    })
    .await;

    if leave != Leave::Stop {
        produce(kinesis.as_ref(), "latest", 0..50).await;
        until("A's handler saw records", || {
            calls.load(Ordering::SeqCst) > 0
        })
        .await;
    }
    match leave {
        Leave::Crash => a_view.hooks.dead.store(true, Ordering::SeqCst),
        Leave::Stop | Leave::DrainTimeout | Leave::FailureThenStop => {
            a_stop.shutdown();
            tokio::time::timeout(LIMIT, a_run)
                .await
                .expect("A stops")
                .unwrap()
                .unwrap();
        }
    }
    // Written while nobody reads the shard.
    produce(kinesis.as_ref(), "latest", 50..100).await;

    let b_recorder = Recorder::default();
    let b = test_consumer(memory.clone(), "latest", "latest-group", "b")
        .initial_position(InitialPosition::Latest)
        .seed(2)
        .build()
        .unwrap();
    let b_stop = b.shutdown_handle();
    let b_run = tokio::spawn(b.run(recording_handler(b_recorder.clone())).into_future());
    until("B took the lease", || {
        table
            .rows()
            .first()
            .and_then(|r| r.owner.clone())
            .is_some_and(|o| shardflow::lease::worker_of(&o) == "b")
    })
    .await;
    produce(kinesis.as_ref(), "latest", 100..150).await;

    let all = || {
        let mut seen = handled_below(&a_recorder, 1_000_000);
        seen.extend(handled_below(&b_recorder, 1_000_000));
        seen
    };
    let written = if leave == Leave::Stop {
        50..150
    } else {
        0..150
    };
    let wait = async {
        while !written.clone().all(|v| all().contains(&v)) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let finished = tokio::time::timeout(LIMIT, wait).await;
    let seen = all();
    let lost: Vec<usize> = written.filter(|v| !seen.contains(v)).collect();
    assert!(
        finished.is_ok() && lost.is_empty(),
        "{leave:?}: {} records written after A's first take never handled (first: {:?})",
        lost.len(),
        lost.first()
    );
    b_stop.shutdown();
    tokio::time::timeout(LIMIT, b_run)
        .await
        .expect("B stops")
        .unwrap()
        .unwrap();
}

#[tokio::test(start_paused = true)]
async fn latest_start_survives_a_stop_before_the_first_checkpoint() {
    a_latest_start_survives(Leave::Stop).await;
}

#[tokio::test(start_paused = true)]
async fn latest_start_survives_a_crash_before_the_first_checkpoint() {
    a_latest_start_survives(Leave::Crash).await;
}

#[tokio::test(start_paused = true)]
async fn latest_start_survives_a_drain_timeout_before_the_first_checkpoint() {
    a_latest_start_survives(Leave::DrainTimeout).await;
}

#[tokio::test(start_paused = true)]
async fn latest_start_survives_a_handler_failure_then_a_stop() {
    a_latest_start_survives(Leave::FailureThenStop).await;
}

/// An AT_TIMESTAMP start is the group's, not one worker's config: a later owner
/// configured with TRIM_HORIZON continues from the timestamp.
#[tokio::test(start_paused = true)]
async fn an_at_timestamp_start_is_kept_for_owners_with_another_config() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("ts", 1).await.unwrap();
    produce(kinesis.as_ref(), "ts", 1_000_000..1_000_010).await; // before the start
    let start = SystemTime::now();
    let a = test_consumer(memory.clone(), "ts", "ts-group", "a")
        .initial_position(InitialPosition::AtTimestamp(start))
        .seed(1)
        .build()
        .unwrap();
    let a_recorder = Recorder::default();
    let a_stop = a.shutdown_handle();
    let a_run = tokio::spawn(a.run(recording_handler(a_recorder.clone())).into_future());
    let table = memory.table("ts-group");
    until("A took the lease", || {
        table.rows().first().and_then(|r| r.owner.clone()).is_some()
    })
    .await;
    a_stop.shutdown();
    tokio::time::timeout(LIMIT, a_run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    produce(kinesis.as_ref(), "ts", 0..20).await;
    let b_recorder = Recorder::default();
    let b = test_consumer(memory.clone(), "ts", "ts-group", "b")
        .initial_position(InitialPosition::TrimHorizon)
        .seed(2)
        .build()
        .unwrap();
    let b_stop = b.shutdown_handle();
    let b_run = tokio::spawn(b.run(recording_handler(b_recorder.clone())).into_future());
    b_recorder.wait_for(20, LIMIT).await;
    b_stop.shutdown();
    tokio::time::timeout(LIMIT, b_run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let before: Vec<usize> = b_recorder
        .snapshot()
        .iter()
        .chain(a_recorder.snapshot().iter())
        .map(|h| h.value)
        .filter(|v| *v >= 1_000_000)
        .collect();
    assert!(
        before.is_empty(),
        "records from before the start handled: {before:?}"
    );
    assert_eq!(
        handled_below(&b_recorder, 1_000_000),
        (0..20).collect::<BTreeSet<_>>()
    );
}

/// The same worker id in two processes (a restarted pod that keeps its name, while the
/// old one still runs): every record is handled, the stored checkpoint never moves
/// back, and no two processes commit under the same lease counter.
#[tokio::test(start_paused = true)]
async fn two_incarnations_of_one_worker_id_never_move_a_checkpoint_back() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("twins", 4).await.unwrap();
    let commits: Arc<Mutex<Vec<Commit>>> = Arc::default();
    let recorder = Recorder::default();
    let consumer = |writer: usize| {
        let view = Observed::on(&memory, writer, commits.clone());
        test_consumer(view, "twins", "twins-group", "billing-7")
            .checkpoint(CheckpointPolicy::EveryBatch)
            .max_records_per_read(20)
            .seed(100 + writer as u64)
            .build()
            .unwrap()
    };
    let first = consumer(0);
    let first_stop = first.shutdown_handle();
    let first_run = tokio::spawn(first.run(recording_handler(recorder.clone())).into_future());
    produce(kinesis.as_ref(), "twins", 0..400).await;
    recorder.wait_for(100, LIMIT).await;

    let second = consumer(1);
    let second_stop = second.shutdown_handle();
    let second_run = tokio::spawn(
        second
            .run(recording_handler(recorder.clone()))
            .into_future(),
    );
    for chunk in 0..16 {
        produce(
            kinesis.as_ref(),
            "twins",
            400 + chunk * 100..500 + chunk * 100,
        )
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let total = 2_000;
    let wait = async {
        while handled_below(&recorder, total).len() < total {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let finished = tokio::time::timeout(LIMIT, wait).await.is_ok();
    // Let both run on a while, so late writes of either show in the log.
    tokio::time::sleep(Duration::from_secs(10)).await;
    first_stop.shutdown();
    second_stop.shutdown();
    let _ = tokio::time::timeout(LIMIT, first_run).await;
    let _ = tokio::time::timeout(LIMIT, second_run).await;

    assert!(
        finished,
        "only {} of {total} records handled",
        handled_below(&recorder, total).len()
    );
    let commits = commits.lock().unwrap().clone();
    let mut problems = Vec::new();
    let keys: BTreeSet<&str> = commits.iter().map(|c| c.key.as_str()).collect();
    for key in keys {
        let mine: Vec<&Commit> = commits.iter().filter(|c| c.key == key).collect();
        for pair in mine.windows(2) {
            let (before, after) = (&pair[0].checkpoint, &pair[1].checkpoint);
            if after.progress_cmp(before) == Some(std::cmp::Ordering::Less) {
                problems.push(format!(
                    "{key}: checkpoint moved back from {before} to {after}"
                ));
            }
        }
        for c in &mine {
            if mine
                .iter()
                .any(|o| o.counter == c.counter && o.writer != c.writer)
            {
                problems.push(format!(
                    "{key}: both processes committed at counter {}",
                    c.counter
                ));
                break;
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
    let writers: BTreeSet<usize> = commits.iter().map(|c| c.writer).collect();
    assert_eq!(writers.len(), 2, "both processes held leases");
}

/// Two consumers built with the same worker id and the same seed (two pods of one
/// StatefulSet name, started from one config): they are two owners, so the shards are
/// shared between them, each read by one of them at a time — no record is handled by
/// both.
///
/// Regression: the seed also drew the incarnation nonce, making both one owner.
#[tokio::test(start_paused = true)]
async fn same_worker_id_and_seed_are_two_owners_that_never_both_read_a_shard() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("clones", 4).await.unwrap();
    let build = || {
        test_consumer(memory.clone(), "clones", "clones-group", "billing-7")
            .seed(42)
            .build()
            .unwrap()
    };
    let (first, second) = (build(), build());
    assert_ne!(first.config().owner(), second.config().owner());
    let owners = [
        first.config().owner().to_owned(),
        second.config().owner().to_owned(),
    ];
    let recorders = [Recorder::default(), Recorder::default()];
    let stops = [first.shutdown_handle(), second.shutdown_handle()];
    let first_run = tokio::spawn(
        first
            .run(recording_handler(recorders[0].clone()))
            .into_future(),
    );
    let second_run = tokio::spawn(
        second
            .run(recording_handler(recorders[1].clone()))
            .into_future(),
    );
    let total = 800;
    for chunk in 0..8 {
        produce(kinesis.as_ref(), "clones", chunk * 100..(chunk + 1) * 100).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let both = || {
        let mut all = handled_below(&recorders[0], total);
        all.extend(handled_below(&recorders[1], total));
        all.len()
    };
    until("every record is handled", || both() == total).await;
    // Both hold leases: the shards are shared, not read twice.
    let holders: BTreeSet<String> = memory
        .table("clones-group")
        .rows()
        .into_iter()
        .filter_map(|row| row.owner)
        .collect();
    stops.iter().for_each(|stop| stop.shutdown());
    let _ = tokio::time::timeout(LIMIT, first_run).await;
    let _ = tokio::time::timeout(LIMIT, second_run).await;

    let twice: BTreeSet<usize> = handled_below(&recorders[0], total)
        .intersection(&handled_below(&recorders[1], total))
        .copied()
        .collect();
    assert!(twice.is_empty(), "handled by both consumers: {twice:?}");
    assert_eq!(
        holders,
        owners.iter().cloned().collect::<BTreeSet<_>>(),
        "both owners hold leases"
    );
}
