//! Multi-stream mode: one group, one lease table, several streams (`.streams([...])`,
//! `.streams_from(watch)`), keys in the KCL's `account:stream:creationEpoch:shardId` form.
//!
//! The scenario: three workers on three streams, a split on one stream while consuming,
//! then (changing list) a fourth stream added and one removed, records written to the
//! removed one, and the removed one added back. Every record is handled exactly once, in
//! sequence order per shard and parents before children; the removed stream's records
//! written while it was out of the list wait for it, and its rows are kept; at the end
//! every row's checkpoint is at its shard's last record (SHARD_END for a closed
//! parent). On the memory backend under the paused clock, and on the emulators when
//! `scripts/test.sh --test consumer_multi_stream` runs it.

use std::collections::{BTreeMap, HashSet};
use std::convert::Infallible;
use std::future::IntoFuture;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardflow::kinesis::{KinesisApi, StreamAdmin, StreamIdentity};
use shardflow::lease::{Checkpoint, Lease};
use shardflow::{Backend, ConsumerError, Memory, Message, Position, SequenceNumber};
use testkit::*;
use tokio::sync::{watch, Notify};

/// Records per stream and phase.
const RECORDS: usize = 120;

/// One handled record: its stream, shard, sequence number and value.
#[derive(Clone, Debug)]
struct Seen {
    stream: String,
    shard: String,
    sequence: SequenceNumber,
    value: usize,
}

/// What every worker's handler saw, in order.
#[derive(Clone, Default)]
struct Log {
    seen: Arc<Mutex<Vec<Seen>>>,
    changed: Arc<Notify>,
}

impl Log {
    fn handler(
        &self,
    ) -> impl tower::Service<
        Message,
        Response = (),
        Error = Infallible,
        Future = impl std::future::Future<Output = Result<(), Infallible>> + Send,
    > + Clone
           + Send
           + 'static {
        let log = self.clone();
        tower::service_fn(move |msg: Message| {
            let value = std::str::from_utf8(&msg.payload).unwrap().parse().unwrap();
            log.seen.lock().unwrap().push(Seen {
                stream: msg.metadata.stream.to_string(),
                shard: msg.metadata.shard_id.to_string(),
                sequence: msg.metadata.sequence_number.clone(),
                value,
            });
            log.changed.notify_waiters();
            async { Ok::<_, Infallible>(()) }
        })
    }

    fn snapshot(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn values(&self) -> HashSet<usize> {
        self.snapshot().iter().map(|s| s.value).collect()
    }

    /// Waits until every value in `values` was handled; fails the test after `limit`.
    async fn wait_for(&self, values: std::ops::Range<usize>, limit: Duration) {
        let wait = async {
            loop {
                let notified = self.changed.notified();
                let seen = self.values();
                if values.clone().all(|v| seen.contains(&v)) {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(limit, wait).await.is_err() {
            let seen = self.values();
            let missing: Vec<usize> = values.filter(|v| !seen.contains(v)).take(10).collect();
            panic!("values not handled within {limit:?}, e.g. {missing:?}");
        }
    }
}

/// The values of stream `i` in phase `phase`: disjoint across streams and phases.
fn values(i: usize, phase: usize) -> std::ops::Range<usize> {
    let first = (i * 10 + phase) * 1_000;
    first..first + RECORDS
}

/// Every value handled once, sequence order within each shard of each stream, and no
/// child's record before its parents' last.
fn assert_exactly_once_in_order(seen: &[Seen], expected: &HashSet<usize>) {
    let mut once = HashSet::new();
    let repeated: Vec<usize> = seen
        .iter()
        .map(|s| s.value)
        .filter(|v| !once.insert(*v))
        .collect();
    assert!(
        repeated.is_empty(),
        "delivered twice: {:?}",
        &repeated[..repeated.len().min(10)]
    );
    let mut lost: Vec<&usize> = expected.difference(&once).collect();
    lost.sort();
    assert!(lost.is_empty(), "lost: {:?}", &lost[..lost.len().min(10)]);
    let unexpected: Vec<&usize> = once.difference(expected).collect();
    assert!(
        unexpected.is_empty(),
        "handled but not expected: {unexpected:?}"
    );
    let mut last: BTreeMap<(&str, &str), &SequenceNumber> = BTreeMap::new();
    for s in seen {
        if let Some(prev) = last.insert((&s.stream, &s.shard), &s.sequence) {
            assert!(
                prev < &s.sequence,
                "{}/{} went back from {prev} to {}",
                s.stream,
                s.shard,
                s.sequence
            );
        }
    }
}

/// Parents' last records before their children's first, per stream.
async fn assert_parents_first(kinesis: &dyn KinesisApi, stream: &str, seen: &[Seen]) {
    let index = |shard: &str, last: bool| {
        let mut positions = seen
            .iter()
            .enumerate()
            .filter(|(_, s)| s.stream == stream && s.shard == shard)
            .map(|(i, _)| i);
        if last {
            positions.next_back()
        } else {
            positions.next()
        }
    };
    for shard in kinesis.list_shards(stream).await.unwrap() {
        for parent in shard.parents() {
            if let (Some(parent_last), Some(child_first)) =
                (index(&parent, true), index(&shard.shard_id, false))
            {
                assert!(
                    parent_last < child_first,
                    "{stream}: child {} started before parent {parent} finished",
                    shard.shard_id
                );
            }
        }
    }
}

/// The rows of `stream` in the raw table, by shard id.
fn rows_of<'a>(rows: &'a [Lease], stream: &str) -> BTreeMap<String, &'a Lease> {
    rows.iter()
        .filter_map(|row| {
            let (identity, shard) = StreamIdentity::split_lease_key(&row.key)?;
            (identity.name == stream).then(|| (shard.to_owned(), row))
        })
        .collect()
}

/// Every row of `stream` is checkpointed at its shard's last handled record, or at
/// SHARD_END for a closed shard; rows carry the KCL's multi-stream `streamName`.
async fn assert_checkpoints(kinesis: &dyn KinesisApi, rows: &[Lease], stream: &str, seen: &[Seen]) {
    let rows = rows_of(rows, stream);
    let shards = kinesis.list_shards(stream).await.unwrap();
    assert_eq!(
        rows.len(),
        shards.len(),
        "{stream}: a row per shard: {rows:?}"
    );
    for shard in shards {
        let row = rows[&shard.shard_id];
        let identity = StreamIdentity::split_lease_key(&row.key).unwrap().0;
        assert_eq!(row.stream.as_deref(), Some(identity.to_string().as_str()));
        assert_eq!(row.owner, None, "released: {row:?}");
        let last = seen
            .iter()
            .filter(|s| s.stream == stream && s.shard == shard.shard_id)
            .map(|s| &s.sequence)
            .max();
        match (shard.is_closed(), last) {
            (true, _) => assert_eq!(row.checkpoint, Checkpoint::ShardEnd, "{row:?}"),
            (false, Some(last)) => assert_eq!(
                row.checkpoint,
                Checkpoint::At(Position::new(last.clone(), 0)),
                "{stream}/{}",
                shard.shard_id
            ),
            (false, None) => {}
        }
    }
}

/// A multi-stream consumer of `streams` in `group` with the tests' timings.
fn multi_consumer<const N: usize>(
    memory: &Memory,
    streams: [&str; N],
    group: &str,
) -> shardflow::ConsumerBuilder {
    test_timings(
        shardflow::Consumer::builder()
            .streams(streams)
            .group(group)
            .backend(memory.clone()),
    )
}

async fn scenario<B: Backend + Clone>(
    backend: B,
    names: [&str; 4],
    workers: usize,
    change_list: bool,
) {
    let limit = Duration::from_secs(240);
    let admin = backend.admin().unwrap();
    let kinesis = backend.kinesis();
    for (i, stream) in names.iter().enumerate() {
        admin
            .create_stream(stream, 1 + (i as u32 % 2))
            .await
            .unwrap();
    }
    for stream in names {
        wait_until_active(kinesis.as_ref(), stream).await;
    }
    let group = unique("pipeline");
    let (first_three, fourth) = (&names[..3], names[3]);
    let (list, _) = watch::channel(
        first_three
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>(),
    );
    let log = Log::default();
    let mut expected = HashSet::new();
    for (i, stream) in first_three.iter().enumerate() {
        produce(kinesis.as_ref(), stream, values(i, 0)).await;
        expected.extend(values(i, 0));
    }
    // The fourth stream has records before it is added: they are read from the start.
    produce(kinesis.as_ref(), fourth, values(3, 0)).await;

    let running: Vec<Running> = (0..workers)
        .map(|w| {
            let builder = shardflow::Consumer::builder()
                .group(&group)
                .worker_id(format!("w{w}"))
                .backend(backend.clone());
            let builder = if change_list {
                builder.streams_from(list.subscribe())
            } else {
                builder.streams(first_three.iter().copied())
            };
            let consumer = test_timings(builder).seed(w as u64).build().unwrap();
            start_service(consumer, log.handler())
        })
        .collect();
    for i in 0..3 {
        log.wait_for(values(i, 0), limit).await;
    }

    // A split on the second stream while consuming.
    let split = first_three[1];
    let open = open_shards(kinesis.as_ref(), split).await;
    let middle =
        open[0].starting_hash_key + (open[0].ending_hash_key - open[0].starting_hash_key) / 2;
    admin
        .split_shard(split, &open[0].shard_id, middle)
        .await
        .unwrap();
    wait_until_active(kinesis.as_ref(), split).await;
    produce(kinesis.as_ref(), split, values(1, 1)).await;
    expected.extend(values(1, 1));
    log.wait_for(values(1, 1), limit).await;

    if change_list {
        // The fourth stream added, the third removed.
        let removed = first_three[2];
        list.send_replace(vec![names[0].into(), names[1].into(), fourth.into()]);
        expected.extend(values(3, 0));
        log.wait_for(values(3, 0), limit).await;
        // Written while the stream is out of the list: nobody reads them...
        produce(kinesis.as_ref(), removed, values(2, 2)).await;
        // ... (the workers settle past a lease duration and several sync rounds) ...
        produce(kinesis.as_ref(), names[0], values(0, 2)).await;
        expected.extend(values(0, 2));
        log.wait_for(values(0, 2), limit).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
        let seen = log.values();
        assert!(
            values(2, 2).all(|v| !seen.contains(&v)),
            "a removed stream is not read"
        );
        // ... its rows stay, released, with their checkpoints ...
        let rows = backend.lease_store(&group).list().await.unwrap();
        let kept = rows_of(&rows, removed);
        assert!(!kept.is_empty(), "a removed stream's rows are kept");
        assert!(kept.values().all(|r| r.owner.is_none()), "{kept:?}");
        assert!(
            kept.values()
                .all(|r| matches!(r.checkpoint, Checkpoint::At(_))),
            "{kept:?}"
        );
        // ... and once it is added back it continues where it left off.
        list.send_replace(names.iter().map(|s| s.to_string()).collect());
        expected.extend(values(2, 2));
        log.wait_for(values(2, 2), limit).await;
    }

    for worker in running {
        worker.stop().await;
    }
    let seen = log.snapshot();
    assert_exactly_once_in_order(&seen, &expected);
    assert_parents_first(kinesis.as_ref(), split, &seen).await;
    let rows = backend.lease_store(&group).list().await.unwrap();
    assert!(
        rows.iter()
            .all(|r| StreamIdentity::split_lease_key(&r.key).is_some()),
        "every key in the multi-stream form: {rows:?}"
    );
    let read: &[&str] = if change_list { &names } else { first_three };
    for stream in read {
        assert_checkpoints(kinesis.as_ref(), &rows, stream, &seen).await;
    }
    if !change_list {
        assert!(
            rows_of(&rows, fourth).is_empty(),
            "a stream not listed gets no rows"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn three_streams_three_workers_a_split_and_a_changing_list() {
    scenario(
        Memory::new(),
        ["orders", "refunds", "audit", "returns"],
        3,
        true,
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_fixed_list_of_three_streams_with_a_split() {
    scenario(
        Memory::new(),
        ["orders", "refunds", "audit", "returns"],
        2,
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_streams_and_a_split_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let aws = shardflow::Aws::from_env().await;
    let names = [
        unique("ms-a"),
        unique("ms-b"),
        unique("ms-c"),
        unique("ms-d"),
    ];
    within(
        Duration::from_secs(900),
        "three streams, three workers on the emulators",
        scenario(aws, [&names[0], &names[1], &names[2], &names[3]], 3, true),
    )
    .await;
}

/// A single-stream consumer and a multi-stream consumer under one group name (so one
/// default lease table) are kept apart: whichever comes second is refused with an error
/// naming the table, both sides and the row, and handles nothing.
#[tokio::test(start_paused = true)]
async fn single_and_multi_stream_consumers_never_share_a_table() {
    for multi_first in [true, false] {
        let memory = Memory::new();
        let admin = memory.streams().clone();
        admin.create_stream("orders", 2).await.unwrap();
        admin.create_stream("refunds", 1).await.unwrap();
        produce(admin.as_ref(), "orders", 0..50).await;
        produce(admin.as_ref(), "refunds", 1_000..1_050).await;
        let single = test_consumer(memory.clone(), "orders", "billing", "single");
        // Second, the multi-stream consumer follows a changing list: the refusal stops
        // it all the same (it is no stream's passing failure).
        let (_list, rx) = watch::channel(vec!["orders".to_owned(), "refunds".to_owned()]);
        let multi = if multi_first {
            multi_consumer(&memory, ["orders", "refunds"], "billing")
        } else {
            test_timings(
                shardflow::Consumer::builder()
                    .streams_from(rx)
                    .group("billing")
                    .backend(memory.clone()),
            )
        }
        .worker_id("multi");
        let (first, second) = if multi_first {
            (multi, single)
        } else {
            (single, multi)
        };
        let first_log = Log::default();
        let consumer = first.build().unwrap();
        let first_run = start_service(consumer, first_log.handler());
        first_log.wait_for(0..50, Duration::from_secs(60)).await;

        let second_log = Log::default();
        let result = within(
            Duration::from_secs(60),
            "the second consumer returns",
            second
                .build()
                .unwrap()
                .run(second_log.handler())
                .into_future(),
        )
        .await;
        match result {
            Err(ConsumerError::TableModeMismatch {
                table,
                consumer,
                rows,
                lease,
            }) => {
                assert_eq!(table, "billing");
                let (expect_consumer, expect_rows) = if multi_first {
                    (
                        "the single stream \"orders\"",
                        "multi-stream rows (of stream 000000000000:",
                    )
                } else {
                    (
                        "in multi-stream mode",
                        "single-stream rows (of stream \"orders\")",
                    )
                };
                assert!(consumer.contains(expect_consumer), "{consumer}");
                assert!(rows.starts_with(expect_rows), "{rows}");
                assert!(!lease.is_empty());
            }
            other => panic!("expected TableModeMismatch, got {other:?}"),
        }
        assert!(
            second_log.snapshot().is_empty(),
            "the refused consumer handled nothing"
        );
        first_run.stop().await;
    }
}

/// Builder checks: a list and a single stream at once, an empty list, a repeated stream
/// and a name that is no stream are refused, naming the field; ARNs are accepted.
#[test]
fn stream_lists_are_checked_at_build() {
    let field =
        |b: shardflow::ConsumerBuilder| match b.group("group1").backend(Memory::new()).build() {
            Err(shardflow::ConfigError::Invalid { field, .. })
            | Err(shardflow::ConfigError::Missing { field }) => field,
            Err(other) => panic!("{other:?}"),
            Ok(_) => "accepted",
        };
    let builder = shardflow::Consumer::builder;
    assert_eq!(field(builder().stream("a").streams(["b"])), "streams");
    assert_eq!(field(builder().streams(Vec::<String>::new())), "streams");
    assert_eq!(field(builder().streams(["a", "a"])), "streams");
    assert_eq!(field(builder().streams(["a", "no spaces"])), "streams");
    let (_tx, rx) = watch::channel(vec!["a".to_owned()]);
    assert_eq!(
        field(builder().streams(["a"]).streams_from(rx)),
        "streams_from"
    );
    assert_eq!(
        field(builder().streams(["a", "arn:aws:kinesis:eu-west-1:123456789012:stream/b"])),
        "accepted"
    );
    let consumer = builder()
        .streams([
            "arn:aws:kinesis:eu-west-1:123456789012:stream/orders",
            "refunds",
        ])
        .group("group1")
        .backend(Memory::new())
        .build()
        .unwrap();
    assert_eq!(
        consumer.config().streams(),
        Some(vec!["orders".to_owned(), "refunds".to_owned()])
    );
}

/// A stream deleted and created again under the same name has a new creation time, so
/// its lease keys have another prefix: once the old stream's rows are all finished, the
/// new stream starts afresh at the initial position instead of reading the old stream's
/// checkpoints. (Unfinished old rows stop it: see the next test.)
#[tokio::test(start_paused = true)]
async fn a_recreated_stream_is_another_stream() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    let before = kinesis.stream_identity("orders").await.unwrap();
    kinesis.delete_stream("orders");
    kinesis.create_stream("orders", 1).await.unwrap();
    let after = kinesis.stream_identity("orders").await.unwrap();
    assert_eq!(
        (before.account.as_str(), before.name.as_str()),
        ("000000000000", "orders")
    );
    assert!(after.creation_epoch > before.creation_epoch);
    assert_ne!(
        before.lease_key("shardId-000000000000"),
        after.lease_key("shardId-000000000000")
    );

    // Rows of the old stream, finished, do not stop the new one from being read.
    let table = memory.lease_store("grp");
    table.ensure_table().await.unwrap();
    let mut old = Lease::new(
        before.lease_key("shardId-000000000000"),
        Vec::new(),
        Checkpoint::ShardEnd,
    );
    old.stream = Some(before.to_string());
    assert!(table.create(&old).await.unwrap());
    produce(kinesis.as_ref(), "orders", 0..30).await;
    let log = Log::default();
    let consumer = multi_consumer(&memory, ["orders"], "grp").build().unwrap();
    let running = start_service(consumer, log.handler());
    log.wait_for(0..30, Duration::from_secs(60)).await;
    running.stop().await;
    let keys: Vec<String> = table
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.key)
        .collect();
    assert!(
        keys.contains(&after.lease_key("shardId-000000000000")),
        "{keys:?}"
    );
}

/// Unfinished rows of an older stream of the same name (or rows a KCL application wrote
/// under its own creation time) are never silently left behind: the consumer refuses
/// with `StreamCreatedAgain`, at start-up and when the stream is deleted and created
/// again while it runs. Before, it started afresh at the initial position and the old
/// rows' positions were skipped (LATEST) or re-read (TRIM_HORIZON) without a word.
#[tokio::test(start_paused = true)]
async fn unfinished_rows_of_another_creation_time_stop_the_stream() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..10).await;
    // While running: the stream is deleted and created again under the consumer.
    let log = Log::default();
    let running = multi_consumer(&memory, ["orders"], "grp")
        .build()
        .unwrap()
        .run(log.handler())
        .spawn();
    log.wait_for(0..10, Duration::from_secs(60)).await;
    let before = kinesis.stream_identity("orders").await.unwrap();
    kinesis.delete_stream("orders");
    kinesis.create_stream("orders", 1).await.unwrap();
    let result = within(
        Duration::from_secs(60),
        "the consumer stops on the re-created stream",
        running.into_future(),
    )
    .await;
    let now = kinesis.stream_identity("orders").await.unwrap();
    match result {
        Err(ConsumerError::StreamCreatedAgain { stream, rows, .. }) => {
            assert_eq!((stream, rows), (now.to_string(), before.to_string()))
        }
        other => panic!("expected StreamCreatedAgain, got {other:?}"),
    }
    // At start-up: the old stream's row is not finished.
    let result = within(
        Duration::from_secs(60),
        "a new consumer refuses",
        multi_consumer(&memory, ["orders"], "grp")
            .build()
            .unwrap()
            .run(Log::default().handler())
            .into_future(),
    )
    .await;
    match result {
        Err(ConsumerError::StreamCreatedAgain {
            stream,
            rows,
            lease,
            ..
        }) => {
            assert_eq!((stream, rows), (now.to_string(), before.to_string()));
            assert_eq!(lease, before.lease_key("shardId-000000000000"));
        }
        other => panic!("expected StreamCreatedAgain, got {other:?}"),
    }
}

/// Events (the coordinators' and the handlers') and health name the shard
/// `stream/shardId` in multi-stream mode, so the same
/// shard id in two streams is told apart.
#[tokio::test(start_paused = true)]
async fn events_and_health_name_the_stream() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    kinesis.create_stream("refunds", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..10).await;
    produce(kinesis.as_ref(), "refunds", 10..20).await;
    let taken = Arc::new(Mutex::new(Vec::new()));
    let failed = Arc::new(Mutex::new(Vec::new()));
    let (events, failures) = (taken.clone(), failed.clone());
    let log = Log::default();
    let consumer = multi_consumer(&memory, ["orders", "refunds"], "grp")
        .on_event(move |event| match event {
            shardflow::ShardEvent::LeaseTaken { shard } => {
                events.lock().unwrap().push(shard.clone())
            }
            shardflow::ShardEvent::HandlerFailed { shard, .. } => {
                failures.lock().unwrap().push(shard.clone())
            }
            _ => {}
        })
        .build()
        .unwrap();
    // The first record of each stream fails once (a HandlerFailed event each).
    let tried = Arc::new(Mutex::new(HashSet::new()));
    let inner = log.handler();
    let handler = tower::service_fn(move |msg: Message| {
        let first = tried
            .lock()
            .unwrap()
            .insert(msg.metadata.stream.to_string());
        let mut inner = inner.clone();
        async move {
            if first {
                return Err("the first try fails");
            }
            tower::Service::call(&mut inner, msg)
                .await
                .map_err(|never| match never {})
        }
    });
    let running = consumer.run(handler).spawn();
    log.wait_for(0..20, Duration::from_secs(60)).await;
    let mut health: Vec<String> = running
        .health()
        .shards
        .into_iter()
        .map(|s| s.shard_id)
        .collect();
    health.sort();
    let expected = vec![
        "orders/shardId-000000000000".to_owned(),
        "refunds/shardId-000000000000".to_owned(),
    ];
    assert_eq!(health, expected);
    let mut taken = taken.lock().unwrap().clone();
    taken.sort();
    assert_eq!(taken, expected);
    let mut failed = failed.lock().unwrap().clone();
    failed.sort();
    assert_eq!(failed, expected, "handler failures name the stream too");
    within(STOP_LIMIT, "the consumer stops", running.shutdown())
        .await
        .unwrap();
}

/// A KCL multi-stream table (rows keyed `account:stream:creationEpoch:shardId`, with the
/// stream identifier in `streamName`) is taken over in place: each shard continues
/// after its committed checkpoint, nothing before it is read again, and the rows keep
/// their keys.
#[tokio::test(start_paused = true)]
async fn a_kcl_multi_stream_table_is_continued_from_its_checkpoints() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    kinesis.create_stream("refunds", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..100).await;
    produce(kinesis.as_ref(), "refunds", 1_000..1_100).await;
    let table = memory.lease_store("kcl-app");
    table.ensure_table().await.unwrap();
    let shard = "shardId-000000000000";
    for (stream, handled) in [("orders", 40), ("refunds", 70)] {
        let identity = kinesis.stream_identity(stream).await.unwrap();
        let last = &memory.streams().records(stream, shard)[handled - 1];
        let mut row = Lease::new(
            identity.lease_key(shard),
            Vec::new(),
            Checkpoint::At(Position::new(last.sequence_number.clone(), 0)),
        );
        row.stream = Some(identity.to_string());
        row.counter = 12;
        assert!(table.create(&row).await.unwrap());
    }
    let log = Log::default();
    let consumer = multi_consumer(&memory, ["orders", "refunds"], "kcl-app")
        .build()
        .unwrap();
    let running = consumer.run(log.handler()).spawn();
    log.wait_for(40..100, Duration::from_secs(60)).await;
    log.wait_for(1_070..1_100, Duration::from_secs(60)).await;
    within(STOP_LIMIT, "the consumer stops", running.shutdown())
        .await
        .unwrap();
    let expected: HashSet<usize> = (40..100).chain(1_070..1_100).collect();
    assert_exactly_once_in_order(&log.snapshot(), &expected);
    let rows = table.list().await.unwrap();
    assert_eq!(rows.len(), 2, "no rows added: {rows:?}");
}

/// `stream()` mode over several streams: one stream of batches from every stream's
/// shards, each batch naming its stream; every record once, and the checkpoints at the
/// end of each shard after the shutdown.
#[tokio::test(start_paused = true)]
async fn batches_of_several_streams_in_stream_mode() {
    use futures_util::StreamExt;
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 2).await.unwrap();
    kinesis.create_stream("refunds", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..RECORDS).await;
    produce(kinesis.as_ref(), "refunds", 1_000..1_000 + RECORDS).await;
    let consumer = multi_consumer(&memory, ["orders", "refunds"], "batches")
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let mut seen = Vec::new();
    within(Duration::from_secs(60), "every record in batches", async {
        while seen.len() < 2 * RECORDS {
            let batch = batches.next().await.unwrap().unwrap();
            for msg in &batch.messages {
                assert_eq!(msg.metadata.stream, batch.stream);
                seen.push(Seen {
                    stream: batch.stream.to_string(),
                    shard: batch.shard_id.to_string(),
                    sequence: msg.metadata.sequence_number.clone(),
                    value: std::str::from_utf8(&msg.payload).unwrap().parse().unwrap(),
                });
            }
            batch.ack();
        }
    })
    .await;
    within(STOP_LIMIT, "the stream shuts down", batches.shutdown())
        .await
        .unwrap();
    let expected: HashSet<usize> = (0..RECORDS).chain(1_000..1_000 + RECORDS).collect();
    assert_exactly_once_in_order(&seen, &expected);
    let rows = memory.lease_store("batches").list().await.unwrap();
    for stream in ["orders", "refunds"] {
        assert_checkpoints(kinesis.as_ref(), &rows, stream, &seen).await;
    }
}

/// With a changing list, a stream that cannot be read (here: it does not exist yet)
/// stops only itself: the others go on, and it is tried again when the list changes.
#[tokio::test(start_paused = true)]
async fn a_missing_stream_in_a_changing_list_does_not_stop_the_others() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 1).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..30).await;
    let (list, rx) = watch::channel(vec!["orders".to_owned(), "later".to_owned()]);
    let consumer = test_timings(
        shardflow::Consumer::builder()
            .streams_from(rx)
            .group("grp")
            .backend(memory.clone()),
    )
    .build()
    .unwrap();
    let log = Log::default();
    let running = consumer.run(log.handler()).spawn();
    log.wait_for(0..30, Duration::from_secs(60)).await;
    // The stream left out shows in the health, and the worker is not ready.
    let left_out = async {
        while running.health().failed_streams.is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    within(Duration::from_secs(60), "the failed stream shows", left_out).await;
    let health = running.health();
    assert_eq!(health.failed_streams.len(), 1);
    assert_eq!(health.failed_streams[0].0, "later");
    assert!(!health.is_ready());
    kinesis.create_stream("later", 1).await.unwrap();
    produce(kinesis.as_ref(), "later", 100..130).await;
    // The same streams, written again: a change, so the failed one is tried again.
    list.send_modify(|_| {});
    log.wait_for(100..130, Duration::from_secs(60)).await;
    assert!(running.health().failed_streams.is_empty());
    within(STOP_LIMIT, "the consumer stops", running.shutdown())
        .await
        .unwrap();
    assert_exactly_once_in_order(&log.snapshot(), &(0..30).chain(100..130).collect());
}

/// Enhanced fan-out over several streams: the stream consumer is registered on each
/// stream and each stream's shards are read through its own registration (one shared
/// consumer ARN would subscribe to the first stream's shards for every stream).
#[tokio::test(start_paused = true)]
async fn fan_out_registers_on_every_stream() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 2).await.unwrap();
    kinesis.create_stream("refunds", 2).await.unwrap();
    produce(kinesis.as_ref(), "orders", 0..RECORDS).await;
    produce(kinesis.as_ref(), "refunds", 1_000..1_000 + RECORDS).await;
    let consumer = multi_consumer(&memory, ["orders", "refunds"], "fan-out")
        .fan_out("billing")
        .build()
        .unwrap();
    let log = Log::default();
    let running = start_service(consumer, log.handler());
    log.wait_for(0..RECORDS, Duration::from_secs(60)).await;
    log.wait_for(1_000..1_000 + RECORDS, Duration::from_secs(60))
        .await;
    running.stop().await;
    let seen = log.snapshot();
    assert_exactly_once_in_order(&seen, &(0..RECORDS).chain(1_000..1_000 + RECORDS).collect());
    assert!(
        seen.iter()
            .all(|s| (s.stream == "orders") == (s.value < 1_000)),
        "each record under its own stream"
    );
}

/// In a fleet larger than three, where only the leader and the successor sync shards
/// periodically, every worker still checks the stream's identity at the sync pace: a
/// stream deleted and created again under 8 workers stops each of them with
/// `StreamCreatedAgain`. Checked only where a worker synced shards, the workers that
/// neither lead nor succeed went on reading the new stream's shards from the old
/// stream's checkpoints, until each came to lead.
#[tokio::test(start_paused = true)]
async fn a_stream_created_again_stops_every_worker_of_a_large_fleet() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("orders", 16).await.unwrap();
    let mut workers = Vec::new();
    for i in 0..8u64 {
        let consumer = multi_consumer(&memory, ["orders"], "grp")
            .worker_id(format!("w{i}"))
            .seed(i)
            .build()
            .unwrap();
        workers.push(tokio::spawn(
            consumer.run(Log::default().handler()).into_future(),
        ));
    }
    // Until every shard is leased by 8 live workers: the roles are in place.
    let spread = async {
        loop {
            let rows = memory.table("grp").rows();
            let owners: HashSet<_> = rows.iter().filter_map(|r| r.owner.clone()).collect();
            if rows.len() == 16 && rows.iter().all(|r| r.owner.is_some()) && owners.len() == 8 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    within(
        Duration::from_secs(60),
        "8 workers share the shards",
        spread,
    )
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    kinesis.delete_stream("orders");
    kinesis.create_stream("orders", 16).await.unwrap();
    for (i, worker) in workers.into_iter().enumerate() {
        let ended = within(Duration::from_secs(10), "the worker stops", worker)
            .await
            .expect("the worker does not panic");
        assert!(
            matches!(ended, Err(ConsumerError::StreamCreatedAgain { .. })),
            "worker {i} ended with {ended:?}"
        );
    }
}
