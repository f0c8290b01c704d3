//! Scenarios shared by the memory-backend and emulator tests: the same assertions run
//! against the embedded backend and against Kinesis/DynamoDB emulators over HTTP.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap, HashSet};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use shardflow::kinesis::{KinesisApi, PutRecord, ShardInfo};
use shardflow::lease::{Checkpoint, Lease};
use shardflow::{Backend, CheckpointPolicy, Consumer, ConsumerBuilder, Message};
use tokio::sync::Notify;

/// One handled record, in the order the handler saw it.
#[derive(Clone, Debug)]
pub struct Handled {
    pub shard: String,
    pub sequence: shardflow::SequenceNumber,
    pub partition_key: String,
    pub value: usize,
}

/// Collects what a handler saw and wakes waiters when a count is reached.
#[derive(Clone, Default)]
pub struct Recorder {
    pub handled: Arc<Mutex<Vec<Handled>>>,
    count: Arc<AtomicUsize>,
    changed: Arc<Notify>,
}

impl Recorder {
    pub fn record(&self, msg: &Message) {
        let value = std::str::from_utf8(&msg.payload).unwrap().parse().unwrap();
        self.handled.lock().unwrap().push(Handled {
            shard: msg.metadata.shard_id.to_string(),
            sequence: msg.metadata.sequence_number.clone(),
            partition_key: msg.metadata.partition_key.clone(),
            value,
        });
        self.count.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` records were handled; panics after `limit`.
    pub async fn wait_for(&self, n: usize, limit: Duration) {
        let wait = async {
            loop {
                let notified = self.changed.notified();
                if self.count() >= n {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(limit, wait).await.is_err() {
            // Most tests write the values 0, 1, 2, ...: name the first ones still missing.
            let seen: HashSet<usize> = self.snapshot().iter().map(|h| h.value).collect();
            let missing: Vec<usize> = (0..n).filter(|v| !seen.contains(v)).take(10).collect();
            panic!(
                "only {} of {n} records handled within {limit:?}; the first values of 0..{n} \
                 not handled: {missing:?}",
                self.count()
            );
        }
    }

    /// Waits until every one of `values` was handled; panics after `limit`, naming the
    /// values still missing.
    pub async fn wait_for_values(&self, values: &[usize], limit: Duration) {
        let missing = || -> Vec<usize> {
            let seen: HashSet<usize> = self.snapshot().iter().map(|h| h.value).collect();
            values
                .iter()
                .copied()
                .filter(|v| !seen.contains(v))
                .collect()
        };
        let wait = async {
            loop {
                let notified = self.changed.notified();
                if missing().is_empty() {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(limit, wait).await.is_err() {
            panic!("values {:?} not handled within {limit:?}", missing());
        }
    }

    pub fn snapshot(&self) -> Vec<Handled> {
        self.handled.lock().unwrap().clone()
    }
}

/// A handler service that records every message.
pub fn recording_handler(
    recorder: Recorder,
) -> impl tower::Service<Message, Response = (), Error = Infallible, Future = impl Send>
       + Clone
       + Send
       + 'static {
    tower::service_fn(move |msg: Message| {
        recorder.record(&msg);
        async { Ok::<_, Infallible>(()) }
    })
}

/// Writes records with values `range`, partition keys `pk-{value % 64}`.
pub async fn produce(kinesis: &dyn KinesisApi, stream: &str, range: std::ops::Range<usize>) {
    let records: Vec<PutRecord> = range
        .map(|v| PutRecord {
            data: Bytes::from(v.to_string()),
            partition_key: format!("pk-{}", v % 64),
            explicit_hash_key: None,
        })
        .collect();
    put_all(kinesis, stream, records).await;
}

/// Writes one sentinel record into each of `shards` (by explicit hash key), with values
/// `first, first + 1, ...` in the order of `shards`, and returns those values.
///
/// A check that nothing was redelivered waits for the sentinels instead of sleeping:
/// within a shard records arrive in sequence order, so a redelivered record would have
/// come before its shard's sentinel.
pub async fn produce_sentinels(
    kinesis: &dyn KinesisApi,
    stream: &str,
    shards: &[ShardInfo],
    first: usize,
) -> Vec<usize> {
    let values: Vec<usize> = (first..first + shards.len()).collect();
    let records = shards
        .iter()
        .zip(&values)
        .map(|(shard, v)| PutRecord {
            data: Bytes::from(v.to_string()),
            partition_key: format!("sentinel-{v}"),
            explicit_hash_key: Some(shard.starting_hash_key.to_string()),
        })
        .collect();
    put_all(kinesis, stream, records).await;
    values
}

/// Writes `records`, retrying what a partial failure refused, until every one is stored.
pub async fn put_all(kinesis: &dyn KinesisApi, stream: &str, records: Vec<PutRecord>) {
    for chunk in records.chunks(500) {
        let mut pending: Vec<PutRecord> = chunk.to_vec();
        // Retry only what failed (partial failures), until everything is stored.
        for _ in 0..100 {
            if pending.is_empty() {
                break;
            }
            match kinesis.put_records(stream, &pending).await {
                Ok(outcomes) => {
                    pending = pending
                        .into_iter()
                        .zip(outcomes)
                        .filter(|(_, o)| matches!(o, shardflow::kinesis::PutOutcome::Failed { .. }))
                        .map(|(r, _)| r)
                        .collect();
                }
                Err(e) => eprintln!("put_records: {e}; retrying"),
            }
            if !pending.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert!(pending.is_empty(), "could not write every record");
    }
}

/// A consumer builder with test-friendly timings.
pub fn test_consumer(
    backend: impl Backend,
    stream: &str,
    group: &str,
    worker: &str,
) -> ConsumerBuilder {
    test_timings(
        Consumer::builder()
            .stream(stream)
            .group(group)
            .worker_id(worker)
            .backend(backend),
    )
}

/// The test-friendly timings of [`test_consumer`], for builders set up otherwise (for
/// example with several streams).
pub fn test_timings(builder: ConsumerBuilder) -> ConsumerBuilder {
    builder
        .idle_read_interval(Duration::from_millis(20))
        .take_interval(Duration::from_millis(300))
        .shard_sync_interval(Duration::from_millis(500))
        .lease_duration(Duration::from_secs(3))
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(200))
        .checkpoint(CheckpointPolicy::Interval(Duration::from_millis(100)))
        .seed(7)
}

pub async fn open_shards(kinesis: &dyn KinesisApi, stream: &str) -> Vec<ShardInfo> {
    let mut open: Vec<ShardInfo> = kinesis
        .list_shards(stream)
        .await
        .unwrap()
        .into_iter()
        .filter(|s| !s.is_closed())
        .collect();
    open.sort_by_key(|s| s.starting_hash_key);
    open
}

/// Asserts what a single-instance run must show: every value handled exactly once,
/// sequence order within each shard, and no child record handled before the last
/// record of each of its parents.
pub fn assert_exactly_once_in_order(handled: &[Handled], total: usize, shards: &[ShardInfo]) {
    let mut seen = HashSet::new();
    let duplicates: Vec<usize> = handled
        .iter()
        .filter(|h| !seen.insert(h.value))
        .map(|h| h.value)
        .collect();
    assert!(
        duplicates.is_empty(),
        "{} duplicates, e.g. {:?}",
        duplicates.len(),
        &duplicates[..duplicates.len().min(5)]
    );
    let missing: Vec<usize> = (0..total).filter(|v| !seen.contains(v)).collect();
    assert!(
        missing.is_empty(),
        "{} lost, e.g. {:?}",
        missing.len(),
        &missing[..missing.len().min(5)]
    );
    assert_order(handled, shards);
}

/// Sequence order within each shard, and parents finished before children started.
pub fn assert_order(handled: &[Handled], shards: &[ShardInfo]) {
    let mut last: HashMap<&str, &shardflow::SequenceNumber> = HashMap::new();
    for h in handled {
        if let Some(prev) = last.insert(&h.shard, &h.sequence) {
            assert!(
                prev < &h.sequence,
                "shard {} went back from {prev} to {}",
                h.shard,
                h.sequence
            );
        }
    }
    let index_range = |shard: &str| {
        let idx: Vec<usize> = handled
            .iter()
            .enumerate()
            .filter(|(_, h)| h.shard == shard)
            .map(|(i, _)| i)
            .collect();
        idx.first().copied().zip(idx.last().copied())
    };
    for shard in shards {
        for parent in shard.parents() {
            if let (Some((_, parent_last)), Some((child_first, _))) =
                (index_range(&parent), index_range(&shard.shard_id))
            {
                assert!(
                    parent_last < child_first,
                    "child {} started (at #{child_first}) before parent {parent} finished (#{parent_last})",
                    shard.shard_id
                );
            }
        }
    }
}

/// Per partition key, values arrive in the order they were written (values ascend).
pub fn assert_partition_key_order(handled: &[Handled]) {
    let mut last: HashMap<&str, usize> = HashMap::new();
    for h in handled {
        if let Some(prev) = last.insert(&h.partition_key, h.value) {
            assert!(
                prev < h.value,
                "key {} went back from {prev} to {}",
                h.partition_key,
                h.value
            );
        }
    }
}

/// The checkpoint of every lease row, by shard.
pub fn checkpoints(rows: &[Lease]) -> BTreeMap<String, Checkpoint> {
    rows.iter()
        .map(|r| (r.key.clone(), r.checkpoint.clone()))
        .collect()
}

/// The single-instance reshard scenario: 4 shards, `total` records, a split and a merge
/// while consuming, then a restart from the committed checkpoints.
pub async fn reshard_while_consuming<B: Backend + Clone>(
    backend: B,
    stream: &str,
    total: usize,
    limit: Duration,
) {
    reshard_while_consuming_with(backend, stream, total, limit, |b| b).await;
}

/// [`reshard_while_consuming`] with `tweak` applied to both consumers' builders (for
/// example to read through enhanced fan-out).
pub async fn reshard_while_consuming_with<B: Backend + Clone>(
    backend: B,
    stream: &str,
    total: usize,
    limit: Duration,
    tweak: impl Fn(ConsumerBuilder) -> ConsumerBuilder,
) {
    let kinesis = backend.kinesis();
    let admin = backend
        .admin()
        .expect("the backend offers stream administration");
    admin.create_stream(stream, 4).await.unwrap();
    let group = format!("{stream}-group");
    let quarter = total / 4;
    produce(kinesis.as_ref(), stream, 0..quarter * 2).await;

    let recorder = Recorder::default();
    let consumer = tweak(test_consumer(backend.clone(), stream, &group, "w1"))
        .build()
        .unwrap();
    let run = start(consumer, &recorder);

    recorder.wait_for(quarter, limit).await;
    let open = open_shards(kinesis.as_ref(), stream).await;
    let first = &open[0];
    let middle = first.starting_hash_key + (first.ending_hash_key - first.starting_hash_key) / 2;
    admin
        .split_shard(stream, &first.shard_id, middle)
        .await
        .unwrap();
    wait_until_active(kinesis.as_ref(), stream).await;
    produce(kinesis.as_ref(), stream, quarter * 2..quarter * 3).await;

    recorder.wait_for(quarter * 2, limit).await;
    let open = open_shards(kinesis.as_ref(), stream).await;
    let (a, b) = (&open[open.len() - 2], &open[open.len() - 1]);
    admin
        .merge_shards(stream, &a.shard_id, &b.shard_id)
        .await
        .unwrap();
    wait_until_active(kinesis.as_ref(), stream).await;
    produce(kinesis.as_ref(), stream, quarter * 3..total).await;

    recorder.wait_for(total, limit).await;
    // Let the closed shards reach SHARD_END before stopping (their ends are read after
    // their last records).
    let store = backend.lease_store(&group);
    let shards = kinesis.list_shards(stream).await.unwrap();
    let closed: Vec<String> = shards
        .iter()
        .filter(|s| s.is_closed())
        .map(|s| s.shard_id.clone())
        .collect();
    let ended = async {
        loop {
            let rows = store.list().await.unwrap();
            let cps = checkpoints(&rows);
            if closed
                .iter()
                .all(|c| cps.get(c).is_none_or(|cp| *cp == Checkpoint::ShardEnd))
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(limit, ended)
        .await
        .expect("closed shards reach SHARD_END");
    run.stop().await;

    let handled = recorder.snapshot();
    assert_exactly_once_in_order(&handled, total, &shards);
    assert_partition_key_order(&handled);

    // Final checkpoints: each open shard at its last handled record, leases released.
    let rows = store.list().await.unwrap();
    for row in &rows {
        assert_eq!(row.owner, None, "lease {} released at shutdown", row.key);
        let last = handled
            .iter()
            .filter(|h| h.shard == row.key)
            .map(|h| h.sequence.clone())
            .max();
        match (&row.checkpoint, last) {
            (Checkpoint::ShardEnd, _) => assert!(closed.contains(&row.key)),
            (Checkpoint::At(p), Some(last)) => {
                assert_eq!(p.sequence, last, "checkpoint of {}", row.key)
            }
            (cp, last) => assert!(
                last.is_none(),
                "{}: checkpoint {cp} but records handled",
                row.key
            ),
        }
    }

    // A restart from the committed checkpoints redelivers nothing.
    let again = Recorder::default();
    let consumer = tweak(test_consumer(backend.clone(), stream, &group, "w2"))
        .build()
        .unwrap();
    let run = start(consumer, &again);
    let open_count = open_shards(kinesis.as_ref(), stream).await.len();
    let taken = async {
        loop {
            let rows = store.list().await.unwrap();
            if rows
                .iter()
                .filter(|r| r.owner.as_deref().map(shardflow::lease::worker_of) == Some("w2"))
                .count()
                >= open_count
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(limit, taken)
        .await
        .expect("the restarted worker takes every open shard");
    // One sentinel per open shard: once each arrived, a redelivered record (earlier in
    // its shard) would have arrived too. Closed shards are at SHARD_END and not read.
    let open = open_shards(kinesis.as_ref(), stream).await;
    let sentinels = produce_sentinels(kinesis.as_ref(), stream, &open, total).await;
    again.wait_for_values(&sentinels, limit).await;
    run.stop().await;
    let mut after_restart: Vec<usize> = again.snapshot().iter().map(|h| h.value).collect();
    after_restart.sort_unstable();
    assert_eq!(
        after_restart, sentinels,
        "after a restart only the sentinels, each once (anything else was redelivered)"
    );
}

pub async fn wait_until_active(kinesis: &dyn KinesisApi, stream: &str) {
    for _ in 0..200 {
        if !kinesis.is_updating(stream).await.unwrap() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("stream {stream} stayed UPDATING");
}

use std::future::IntoFuture;

/// KPL aggregates through the consumer: 20 aggregates of 50 user records and one record
/// that carries the magic bytes but does not verify. A handler failure in the middle of
/// an aggregate, and a shutdown in the middle of another followed by a restart, must
/// neither skip nor repeat user records; the corrupt record arrives once, whole.
pub async fn kpl_aggregates_resume_inside_an_aggregate<B: Backend + Clone>(
    backend: B,
    stream: &str,
    limit: Duration,
) {
    use shardflow::aggregation::{Aggregator, MAGIC};
    let kinesis = backend.kinesis();
    let admin = backend
        .admin()
        .expect("the backend offers stream administration");
    admin.create_stream(stream, 1).await.unwrap();
    let mut records = Vec::new();
    for a in 0..20 {
        let mut agg = Aggregator::new();
        for v in a * 50..(a + 1) * 50 {
            let put = PutRecord {
                data: Bytes::from(v.to_string()),
                partition_key: format!("pk-{}", v % 64),
                explicit_hash_key: None,
            };
            assert!(
                agg.add(put).unwrap().is_none(),
                "small records fit one aggregate"
            );
        }
        records.push(agg.flush().unwrap());
    }
    let mut corrupt = MAGIC.to_vec();
    corrupt.extend_from_slice(b"not a protobuf, and no valid digest either");
    records.push(PutRecord {
        data: Bytes::from(corrupt.clone()),
        partition_key: "pk-corrupt".into(),
        explicit_hash_key: None,
    });
    for r in &records {
        let out = kinesis
            .put_records(stream, std::slice::from_ref(r))
            .await
            .unwrap();
        assert!(matches!(
            out[0],
            shardflow::kinesis::PutOutcome::Stored { .. }
        ));
    }

    let group = format!("{stream}-group");
    let seen: Arc<Mutex<Vec<(Bytes, u64)>>> = Arc::default();
    let failed_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let run_once = |worker: &'static str, stop_at: Option<usize>| {
        let consumer = test_consumer(backend.clone(), stream, &group, worker)
            .build()
            .unwrap();
        let shutdown = consumer.shutdown_handle();
        let (seen, failed_once) = (seen.clone(), failed_once.clone());
        let stopping = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let handler = tower::service_fn(move |msg: Message| {
            let value = std::str::from_utf8(&msg.payload)
                .ok()
                .and_then(|s| s.parse::<usize>().ok());
            // Value 525 (sub-sequence 25 of aggregate 10) fails on its first attempt.
            let fail = value == Some(525) && !failed_once.swap(true, Ordering::SeqCst);
            let slow = stopping.load(Ordering::SeqCst);
            if !fail {
                seen.lock()
                    .unwrap()
                    .push((msg.payload.clone(), msg.metadata.sub_sequence_number));
                if value.is_some() && value == stop_at {
                    shutdown.shutdown();
                    stopping.store(true, Ordering::SeqCst);
                }
            }
            async move {
                if slow {
                    // Once stopping, handlers are slow, so the drain stops inside this
                    // aggregate rather than after it.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                if fail {
                    Err("injected")
                } else {
                    Ok(())
                }
            }
        });
        let stop = consumer.shutdown_handle();
        (tokio::spawn(consumer.run(handler).into_future()), stop)
    };

    // First run: stops itself right after handling value 777 (inside aggregate 15).
    let (first, _) = run_once("w1", Some(777));
    tokio::time::timeout(limit, first)
        .await
        .expect("first run stops")
        .unwrap()
        .unwrap();
    let after_first = seen.lock().unwrap().len();
    assert!(
        after_first < 800,
        "the first run stopped inside aggregate 15, after {after_first}"
    );
    let rows = backend.lease_store(&group).list().await.unwrap();
    match &rows[0].checkpoint {
        Checkpoint::At(p) => assert!(p.sub_sequence > 0, "checkpoint {p} inside an aggregate"),
        other => panic!("unexpected checkpoint {other}"),
    }

    // Second run: from the committed (sequence, sub-sequence) checkpoints.
    let (second, stop) = run_once("w2", None);
    let all = async {
        while seen.lock().unwrap().len() < 1_001 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(limit, all)
        .await
        .expect("every user record handled");
    stop.shutdown();
    within(STOP_LIMIT, "the second run stops", second)
        .await
        .unwrap()
        .unwrap();

    let seen = seen.lock().unwrap().clone();
    let mut values: Vec<usize> = seen
        .iter()
        .filter_map(|(p, _)| std::str::from_utf8(p).ok().and_then(|s| s.parse().ok()))
        .collect();
    values.sort_unstable();
    assert_eq!(
        values,
        (0..1_000).collect::<Vec<_>>(),
        "each user record exactly once"
    );
    let corrupt_seen: Vec<_> = seen
        .iter()
        .filter(|(p, _)| p.as_ref() == corrupt.as_slice())
        .collect();
    assert_eq!(
        corrupt_seen.len(),
        1,
        "the corrupt aggregate is delivered once, whole"
    );
    assert_eq!(corrupt_seen[0].1, 0, "as a plain record");
    let subs: HashSet<u64> = seen.iter().map(|(_, s)| *s).collect();
    assert_eq!(
        subs.len(),
        50,
        "user records carry their sub-sequence numbers"
    );
}

/// A consumer running `recording_handler` in a task.
pub struct Running {
    pub shutdown: shardflow::ShutdownHandle,
    task: tokio::task::JoinHandle<Result<(), shardflow::ConsumerError>>,
}

/// How long a graceful shutdown (drain, checkpoint, release) may take in a test.
pub const STOP_LIMIT: Duration = Duration::from_secs(60);

impl Running {
    /// Shuts down gracefully and waits (at most [`STOP_LIMIT`]) until the run returned
    /// without error.
    pub async fn stop(self) {
        self.shutdown.shutdown();
        within(STOP_LIMIT, "the consumer stops after shutdown()", self.task)
            .await
            .unwrap()
            .unwrap();
    }
}

/// How long one wait marked [`Limited::limited`] may take (virtual time under a paused
/// clock) before the test fails.
pub const WAIT_LIMIT: Duration = Duration::from_secs(120);

/// `.limited()` on anything awaitable: the wait fails the test after [`WAIT_LIMIT`],
/// naming the line it was written on, instead of hanging it.
pub trait Limited: std::future::IntoFuture + Sized {
    #[track_caller]
    fn limited(self) -> impl std::future::Future<Output = Self::Output> {
        let at = std::panic::Location::caller();
        let fut = self.into_future();
        async move {
            match tokio::time::timeout(WAIT_LIMIT, fut).await {
                Ok(out) => out,
                Err(_) => panic!("the wait at {at} was not done within {WAIT_LIMIT:?}"),
            }
        }
    }
}

impl<F: std::future::IntoFuture> Limited for F {}

/// Awaits `fut`, panicking with `what` if it is not done within `limit`: a test that
/// waits fails with a message instead of hanging.
pub async fn within<F: std::future::Future>(limit: Duration, what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(out) => out,
        Err(_) => panic!("{what}: not done within {limit:?}"),
    }
}

/// Runs `consumer` with a handler that records into `recorder`.
pub fn start(consumer: Consumer, recorder: &Recorder) -> Running {
    start_service(consumer, recording_handler(recorder.clone()))
}

/// Runs `consumer` with `service` in a task.
pub fn start_service<S>(consumer: Consumer, service: S) -> Running
where
    S: tower::Service<Message> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display + Send,
{
    let shutdown = consumer.shutdown_handle();
    let task = tokio::spawn(consumer.run(service).into_future());
    Running { shutdown, task }
}

// ---------------------------------------------------------------------------------------
// Shared by the emulator and process tests.

/// Whether the emulators `scripts/test.sh` starts are there (`SHARDFLOW_EMULATORS` set);
/// says so on stderr when not, so a skipped emulator test shows in `--nocapture` output.
pub fn emulators_enabled() -> bool {
    let on = std::env::var_os("SHARDFLOW_EMULATORS").is_some();
    if !on {
        eprintln!("skipped: SHARDFLOW_EMULATORS not set (run scripts/test.sh)");
    }
    on
}

/// A stream, table or group name no other test of this process, no concurrent run and no
/// earlier run against the same long-lived emulator uses: the prefix, the process id, the
/// wall clock (milliseconds, modulo 10^9) and a counter.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() % 1_000_000_000)
        .unwrap_or(0);
    format!(
        "{prefix}-{}-{millis}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Builds example `name` with the profile this test was built with (debug unless the
/// suite runs with `--release`) into the same target directory, and returns the
/// binary. Always built, never skipped: a test runs neither a binary left over from an
/// earlier build nor nothing. `--workspace` gives the dependencies the same features as
/// the `cargo test --workspace` of `scripts/test.sh` (without it the AWS SDK is compiled a
/// second time), so the build is fresh (a no-op) when the suite already built the
/// examples.
///
/// The binary is hard-linked (or copied) into `dir` and run from there: a build of the
/// same example elsewhere (another checkout sharing the target directory, a concurrent
/// `cargo build`) replaces `target/debug/examples/<name>` but not this link.
pub fn build_example(name: &str, dir: &std::path::Path) -> std::path::PathBuf {
    use std::path::{Path, PathBuf};
    use std::process::{Command, Stdio};

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // `<target-dir>/tmp`: also right when the suite was started with `--target-dir`.
    let target_dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("the target directory")
        .to_owned();
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--workspace", "--example", name])
        .arg("--message-format=json-render-diagnostics")
        .arg("--target-dir")
        .arg(&target_dir)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if !cfg!(debug_assertions) {
        cmd.arg("--release");
    }
    // `cargo test` gives this process the package's CARGO_MANIFEST_DIR, CARGO_PKG_NAME,
    // CARGO_PKG_VERSION_*, ...; build scripts (ring's) watch some of them, so passing
    // them on would make the inner cargo rebuild the TLS and AWS SDK crates, and the
    // next ordinary build rebuild them back.
    const SET_FOR_THIS_CRATE: [&str; 5] = [
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "OUT_DIR",
    ];
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy();
        if key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_MANIFEST_")
            || SET_FOR_THIS_CRATE.contains(&&*key)
        {
            cmd.env_remove(&*key);
        }
    }
    let out = cmd.output().expect("cargo runs");
    assert!(out.status.success(), "cargo build --example {name} failed");
    let mut executable = None;
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] == "compiler-artifact" && msg["target"]["name"] == name {
            if let Some(path) = msg["executable"].as_str() {
                executable = Some(PathBuf::from(path));
            }
        }
    }
    let built = executable.unwrap_or_else(|| panic!("cargo did not report the {name} executable"));
    std::fs::create_dir_all(dir).expect("create the directory for the example binary");
    let private = dir.join(name);
    let _ = std::fs::remove_file(&private);
    if std::fs::hard_link(&built, &private).is_err() {
        std::fs::copy(&built, &private).expect("copy the example binary");
    }
    private
}
