//! Nothing hangs: hung calls, a deleted lease table, a corrupt lease row, and faults on
//! the wire. The memory tests run under tokio's paused clock; the emulator tests run the
//! real SDK through a fault-injecting HTTP client (`testkit::wire`) in front of kinesalite and
//! dynalite (`scripts/test.sh --test faults`; skipped without the emulators).

use testkit::wire;

use std::collections::{BTreeMap, BTreeSet};
use std::future::IntoFuture;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use shardflow::kinesis::{KinesisApi, StreamAdmin};
use shardflow::lease::{Checkpoint, LeaseError, LeaseStore};
use shardflow::{Aws, AwsTimeouts, Backend, ConsumerError, Memory};
use testkit::*;
use tokio::time::Instant;
use wire::{Fault, FaultClient, FaultPlan, FaultyMemory};

/// No test waits longer than this for anything (virtual time in the memory tests).
const LIMIT: Duration = Duration::from_secs(120);

fn row_of<'a>(rows: &'a [shardflow::lease::Lease], key: &str) -> &'a shardflow::lease::Lease {
    rows.iter().find(|r| r.key == key).expect("a lease row")
}

/// Waits until every value in `0..total` was handled at least once.
async fn wait_all_values(recorder: &Recorder, total: usize, limit: Duration) {
    let all = async {
        loop {
            let seen: BTreeSet<usize> = recorder.snapshot().iter().map(|h| h.value).collect();
            if seen.len() >= total {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    if tokio::time::timeout(limit, all).await.is_err() {
        let seen: BTreeSet<usize> = recorder.snapshot().iter().map(|h| h.value).collect();
        let missing: Vec<usize> = (0..total).filter(|v| !seen.contains(v)).take(5).collect();
        panic!(
            "{} of {total} values handled within {limit:?}; missing e.g. {missing:?}",
            seen.len()
        );
    }
}

// ---------------------------------------------------------------------------------------
// Memory backend, paused clock.

/// A start-up call that never answers (here: the lease table check) is cut by its
/// deadline and tried again, and a shutdown during it returns at once.
#[tokio::test(start_paused = true)]
async fn a_hung_start_up_call_is_cut_and_tried_again() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("hung-start", 1).await.unwrap();
    produce(kinesis.as_ref(), "hung-start", 0..50).await;
    let faulty = FaultyMemory::new(memory.clone());
    faulty.faults.hang_ensure_table.store(1, Ordering::SeqCst);
    let recorder = Recorder::default();
    let consumer = test_consumer(faulty.clone(), "hung-start", "g-hung-start", "w1")
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    // The first check hangs until its deadline; the second answers.
    wait_all_values(&recorder, 50, Duration::from_secs(300)).await;
    run.stop().await;

    // A shutdown while a start-up call hangs does not wait for its deadline.
    faulty.faults.hang_ensure_table.store(1, Ordering::SeqCst);
    let consumer = test_consumer(faulty.clone(), "hung-start", "g-hung-start", "w2")
        .build()
        .unwrap();
    let running = consumer
        .run(tower::service_fn(|_m| async {
            Ok::<_, std::convert::Infallible>(())
        }))
        .spawn();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let asked = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), running.shutdown())
        .await
        .expect("the shutdown returns while the start-up call hangs")
        .expect("a clean stop");
    assert!(asked.elapsed() < Duration::from_secs(5));
}

/// One lease whose renewals never return must not cost the worker its other leases:
/// renewals run independently, each under a deadline.
#[tokio::test(start_paused = true)]
async fn a_hung_renewal_costs_the_worker_no_other_lease() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("hung-renew", 2).await.unwrap();
    produce(kinesis.as_ref(), "hung-renew", 0..200).await;
    let faulty = FaultyMemory::new(memory.clone());
    let recorder = Recorder::default();
    let consumer = test_consumer(faulty.clone(), "hung-renew", "g-hung-renew", "w1")
        .build()
        .unwrap();
    let owner = consumer.config().owner().to_owned();
    let run = start(consumer, &recorder);
    recorder.wait_for(200, LIMIT).await;

    let shards = open_shards(kinesis.as_ref(), "hung-renew").await;
    let (hung, healthy) = (&shards[0].shard_id, &shards[1].shard_id);
    *faulty.faults.hang_renewals_of.lock().unwrap() = Some(hung.clone());
    let table = memory.table("g-hung-renew");
    let before = row_of(&table.rows(), healthy).counter;
    // Ten lease durations (3 s each) with one renewal hung for ever.
    tokio::time::sleep(Duration::from_secs(30)).await;
    let rows = table.rows();
    let row = row_of(&rows, healthy);
    assert_eq!(
        row.owner.as_deref(),
        Some(owner.as_str()),
        "the healthy lease is kept"
    );
    assert!(
        row.counter >= before + 20,
        "the healthy lease was renewed about once a second: counter {} -> {}",
        before,
        row.counter
    );
    // And its shard is still read: new records on it are handled.
    produce(kinesis.as_ref(), "hung-renew", 200..400).await;
    let expected = kinesis.records("hung-renew", healthy).len();
    let read = async {
        loop {
            let n = recorder
                .snapshot()
                .iter()
                .filter(|h| h.shard == *healthy)
                .count();
            if n >= expected {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(LIMIT, read)
        .await
        .expect("the healthy shard is still read");
    *faulty.faults.hang_renewals_of.lock().unwrap() = None;
    tokio::time::timeout(LIMIT, run.stop())
        .await
        .expect("the worker stops");
}

/// A renewal that landed but whose answer never came times out (an unknown outcome);
/// the next renewal adopts it, so the worker keeps the lease and the shard is still read.
#[tokio::test(start_paused = true)]
async fn a_renewal_that_landed_but_timed_out_is_adopted() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("lost-answer", 1).await.unwrap();
    produce(kinesis.as_ref(), "lost-answer", 0..100).await;
    let faulty = FaultyMemory::new(memory.clone());
    let recorder = Recorder::default();
    let consumer = test_consumer(faulty.clone(), "lost-answer", "g-lost-answer", "w1")
        .build()
        .unwrap();
    let owner = consumer.config().owner().to_owned();
    let run = start(consumer, &recorder);
    recorder.wait_for(100, LIMIT).await;
    let shard = open_shards(kinesis.as_ref(), "lost-answer").await[0]
        .shard_id
        .clone();
    let table = memory.table("g-lost-answer");
    let before = row_of(&table.rows(), &shard).counter;
    *faulty.faults.lose_answer_of_next_renewal_of.lock().unwrap() = Some(shard.clone());
    // Five lease durations.
    tokio::time::sleep(Duration::from_secs(15)).await;
    assert!(faulty
        .faults
        .lose_answer_of_next_renewal_of
        .lock()
        .unwrap()
        .is_none());
    let row = row_of(&table.rows(), &shard).clone();
    assert_eq!(
        row.owner.as_deref(),
        Some(owner.as_str()),
        "the lease is kept"
    );
    assert!(
        row.counter >= before + 10,
        "renewals went on: {before} -> {}",
        row.counter
    );
    produce(kinesis.as_ref(), "lost-answer", 100..200).await;
    recorder.wait_for(200, LIMIT).await;
    tokio::time::timeout(LIMIT, run.stop())
        .await
        .expect("the worker stops");
    let shards = kinesis.list_shards("lost-answer").await.unwrap();
    assert_exactly_once_in_order(&recorder.snapshot(), 200, &shards);
}

/// A GetRecords call that never returns is abandoned after the read call timeout; the
/// shard goes on from the last delivered record and nothing is lost.
#[tokio::test(start_paused = true)]
async fn a_hung_get_records_is_abandoned_and_the_shard_continues() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("hung-read", 1).await.unwrap();
    produce(kinesis.as_ref(), "hung-read", 0..300).await;
    let faulty = FaultyMemory::new(memory.clone());
    faulty.faults.hang_get_records.store(1, Ordering::SeqCst);
    let recorder = Recorder::default();
    let consumer = test_consumer(faulty.clone(), "hung-read", "g-hung-read", "w1")
        .max_records_per_read(100)
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    recorder.wait_for(300, LIMIT).await;
    assert_eq!(faulty.faults.hung_get_records.load(Ordering::SeqCst), 1);
    tokio::time::timeout(LIMIT, run.stop())
        .await
        .expect("the worker stops");
    let shards = kinesis.list_shards("hung-read").await.unwrap();
    let handled = recorder.snapshot();
    assert_exactly_once_in_order(&handled, 300, &shards);
    let last = handled.last().unwrap().sequence.clone();
    match &memory.table("g-hung-read").rows()[0].checkpoint {
        Checkpoint::At(p) => assert_eq!(p.sequence, last),
        other => panic!("checkpoint {other} after every record was handled"),
    }
}

/// An enhanced fan-out subscription that goes silent (no event, not even a heartbeat)
/// is taken as hung and renewed; the shard goes on and nothing is lost.
#[tokio::test(start_paused = true)]
async fn a_silent_subscription_is_renewed_and_the_shard_continues() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("silent", 1).await.unwrap();
    produce(kinesis.as_ref(), "silent", 0..100).await;
    let faulty = FaultyMemory::new(memory.clone());
    faulty.faults.hang_subscriptions.store(1, Ordering::SeqCst);
    let recorder = Recorder::default();
    let consumer = test_consumer(faulty.clone(), "silent", "g-silent", "w1")
        .fan_out("silent-efo")
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    recorder.wait_for(100, LIMIT).await;
    assert_eq!(faulty.faults.hung_subscriptions.load(Ordering::SeqCst), 1);
    tokio::time::timeout(LIMIT, run.stop())
        .await
        .expect("the worker stops");
    let shards = kinesis.list_shards("silent").await.unwrap();
    assert_exactly_once_in_order(&recorder.snapshot(), 100, &shards);
}

/// A lease table that disappears while the group runs ends `run` with a typed error
/// naming the table, within a lease duration plus a lease round (plus the drain).
#[tokio::test(start_paused = true)]
async fn a_missing_lease_table_ends_run_with_a_typed_error() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("gone", 2).await.unwrap();
    produce(kinesis.as_ref(), "gone", 0..100).await;
    let faulty = FaultyMemory::new(memory.clone());
    let recorder = Recorder::default();
    let consumer = test_consumer(faulty.clone(), "gone", "g-gone", "w1")
        .build()
        .unwrap();
    let run = tokio::spawn(
        consumer
            .run(recording_handler(recorder.clone()))
            .into_future(),
    );
    recorder.wait_for(100, LIMIT).await;
    let rows_before = memory.table("g-gone").rows();
    faulty.faults.table_missing.store(true, Ordering::SeqCst);
    let deleted = Instant::now();
    let result = tokio::time::timeout(LIMIT, run)
        .await
        .expect("run returns instead of waiting for ever")
        .unwrap();
    let took = deleted.elapsed();
    match result {
        Err(ConsumerError::Lease(LeaseError::TableMissing { table })) => {
            assert_eq!(table, "g-gone")
        }
        other => panic!("expected TableMissing, got {other:?}"),
    }
    // lease duration 3 s + take interval 0.3 s + the drain's retries.
    assert!(took <= Duration::from_secs(6), "took {took:?}");
    // Nothing was written while the table was gone (nor re-created).
    let rows_after = memory.table("g-gone").rows();
    assert_eq!(checkpoints(&rows_after), checkpoints(&rows_before));
}

// ---------------------------------------------------------------------------------------
// Emulators over real HTTP.

/// Timeouts short enough that a hung answer ends well inside the test's lease duration.
fn test_timeouts() -> AwsTimeouts {
    AwsTimeouts {
        connect: Duration::from_secs(1),
        read: Duration::from_secs(1),
        attempt: Duration::from_millis(1500),
        operation: Duration::from_secs(4),
    }
}

/// An `Aws` whose every request goes through the fault plan.
async fn faulty_aws(plan: Arc<FaultPlan>) -> Aws {
    let config = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(FaultClient::shared(plan))
        .load()
        .await;
    Aws::from_config_with(&config, test_timeouts()).unwrap()
}

/// Over real HTTP, an answer that never comes ends in the SDK's timeout (the operation
/// timeout of [`AwsTimeouts`]), for Kinesis and DynamoDB, and the next call succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_answer_ends_in_a_timeout_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let clean = Aws::from_env().await;
    let stream = unique("wire-hang");
    clean
        .admin()
        .unwrap()
        .create_stream(&stream, 1)
        .await
        .unwrap();
    clean.lease_store(&stream).ensure_table().await.unwrap();
    let plan = FaultPlan::only(Fault::Hang);
    let faulty = faulty_aws(plan.clone()).await;
    let bound = test_timeouts().operation + Duration::from_secs(2);
    let started = Instant::now();
    let listed = tokio::time::timeout(LIMIT, faulty.kinesis().list_shards(&stream))
        .await
        .expect("ListShards does not hang");
    assert!(listed.is_err(), "a hung ListShards is an error");
    assert!(started.elapsed() <= bound, "took {:?}", started.elapsed());
    let started = Instant::now();
    let scanned = tokio::time::timeout(LIMIT, faulty.lease_store(&stream).list())
        .await
        .expect("Scan does not hang");
    assert!(scanned.is_err(), "a hung Scan is an error");
    assert!(started.elapsed() <= bound, "took {:?}", started.elapsed());
    assert!(plan.injected()[&Fault::Hang] >= 2);
    // Recovery: the same clients work once answers come again.
    plan.enabled.store(false, Ordering::SeqCst);
    assert_eq!(
        faulty.kinesis().list_shards(&stream).await.unwrap().len(),
        1
    );
    assert!(faulty.lease_store(&stream).list().await.unwrap().is_empty());
}

/// Lease timings for the wire tests: 6 s leases (2 s renewal, 2 s lease call deadline),
/// so the emulators' latency on a busy machine does not expire leases by itself.
fn wire_consumer(backend: Aws, stream: &str, group: &str, worker: &str) -> shardflow::Consumer {
    test_consumer(backend, stream, group, worker)
        .lease_duration(Duration::from_secs(6))
        .read_call_timeout(Duration::from_secs(5))
        .build()
        .unwrap()
}

/// Each open shard's checkpoint at its last handled record, each closed one at SHARD_END,
/// every lease released.
async fn assert_final_checkpoints(
    store: &Arc<dyn LeaseStore>,
    handled: &[Handled],
    shards: &[shardflow::kinesis::ShardInfo],
) {
    let last: BTreeMap<&str, &shardflow::SequenceNumber> =
        handled.iter().fold(BTreeMap::new(), |mut m, h| {
            let e = m.entry(h.shard.as_str()).or_insert(&h.sequence);
            if h.sequence > **e {
                *e = &h.sequence;
            }
            m
        });
    for row in store.list().await.unwrap() {
        assert_eq!(row.owner, None, "lease {} released", row.key);
        let closed = shards
            .iter()
            .any(|s| s.shard_id == row.key && s.is_closed());
        match (&row.checkpoint, last.get(row.key.as_str())) {
            (Checkpoint::ShardEnd, _) => assert!(closed, "{} ended but is open", row.key),
            (Checkpoint::At(p), Some(last)) if !closed => {
                assert_eq!(&&p.sequence, last, "checkpoint of {}", row.key)
            }
            (cp, last) => assert!(
                last.is_none() && !closed,
                "{}: checkpoint {cp}, last handled {last:?}",
                row.key
            ),
        }
    }
}

/// The reshard scenario (a split and a merge while consuming) with the consumer's every
/// Kinesis and DynamoDB request going through the fault plan: throttling bodies, 5xx,
/// resets, hangs and "written, then an error". Every record handled once, in order;
/// checkpoints end at SHARD_END and at the last records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_under_wire_faults() {
    if !emulators_enabled() {
        return;
    }
    let body = async {
        let clean = Aws::from_env().await;
        let plan = FaultPlan::new(11, 0.08);
        let faulty = faulty_aws(plan.clone()).await;
        let kinesis = clean.admin().unwrap();
        let stream = unique("wire-reshard");
        let group = format!("{stream}-group");
        let total = 2_000;
        let quarter = total / 4;
        kinesis.create_stream(&stream, 4).await.unwrap();
        produce(kinesis.as_ref(), &stream, 0..quarter * 2).await;
        let recorder = Recorder::default();
        let run = start(wire_consumer(faulty, &stream, &group, "w1"), &recorder);

        recorder.wait_for(quarter, LIMIT).await;
        let open = open_shards(kinesis.as_ref(), &stream).await;
        let first = &open[0];
        let middle =
            first.starting_hash_key + (first.ending_hash_key - first.starting_hash_key) / 2;
        kinesis
            .split_shard(&stream, &first.shard_id, middle)
            .await
            .unwrap();
        wait_until_active(kinesis.as_ref(), &stream).await;
        produce(kinesis.as_ref(), &stream, quarter * 2..quarter * 3).await;
        recorder.wait_for(quarter * 2, LIMIT).await;
        let open = open_shards(kinesis.as_ref(), &stream).await;
        let (a, b) = (&open[open.len() - 2], &open[open.len() - 1]);
        kinesis
            .merge_shards(&stream, &a.shard_id, &b.shard_id)
            .await
            .unwrap();
        wait_until_active(kinesis.as_ref(), &stream).await;
        produce(kinesis.as_ref(), &stream, quarter * 3..total).await;
        wait_all_values(&recorder, total, LIMIT).await;

        let store = clean.lease_store(&group);
        let shards = kinesis.list_shards(&stream).await.unwrap();
        let closed: Vec<String> = shards
            .iter()
            .filter(|s| s.is_closed())
            .map(|s| s.shard_id.clone())
            .collect();
        let ended = async {
            loop {
                let cps = checkpoints(&store.list().await.unwrap());
                if closed
                    .iter()
                    .all(|c| cps.get(c).is_none_or(|cp| *cp == Checkpoint::ShardEnd))
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::time::timeout(LIMIT, ended)
            .await
            .expect("closed shards reach SHARD_END");
        plan.wait_every_kind_injected(LIMIT).await;
        // The shutdown's own writes go through the faults too.
        run.stop().await;
        eprintln!("faults injected: {:?}", plan.injected());
        let handled = recorder.snapshot();
        assert_exactly_once_in_order(&handled, total, &shards);
        assert_final_checkpoints(&store, &handled, &shards).await;
        plan.assert_every_kind_injected();
    };
    tokio::time::timeout(Duration::from_secs(300), body)
        .await
        .expect("the test did not finish in time");
}

/// Two workers of one group share four shards through the fault plan: every record is
/// handled (at least once: a lease may change hands when its renewals keep failing),
/// and the checkpoints end at each shard's last record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_under_wire_faults() {
    if !emulators_enabled() {
        return;
    }
    let body = async {
        let clean = Aws::from_env().await;
        let plan = FaultPlan::new(23, 0.08);
        let kinesis = clean.admin().unwrap();
        let stream = unique("wire-group");
        let group = format!("{stream}-group");
        let total = 2_000;
        kinesis.create_stream(&stream, 4).await.unwrap();
        produce(kinesis.as_ref(), &stream, 0..total / 2).await;
        let recorder = Recorder::default();
        let w1 = start(
            wire_consumer(faulty_aws(plan.clone()).await, &stream, &group, "w1"),
            &recorder,
        );
        let w2 = start(
            wire_consumer(faulty_aws(plan.clone()).await, &stream, &group, "w2"),
            &recorder,
        );
        produce(kinesis.as_ref(), &stream, total / 2..total).await;
        wait_all_values(&recorder, total, LIMIT).await;
        let store = clean.lease_store(&group);
        // Both workers hold leases (the group balanced despite the faults).
        let balanced = async {
            loop {
                let rows = store.list().await.unwrap();
                let owners: BTreeSet<_> = rows.iter().filter_map(|r| r.owner.clone()).collect();
                if owners.len() == 2 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        tokio::time::timeout(LIMIT, balanced)
            .await
            .expect("both workers hold leases");
        plan.wait_every_kind_injected(LIMIT).await;
        w1.stop().await;
        w2.stop().await;
        eprintln!("faults injected: {:?}", plan.injected());
        let handled = recorder.snapshot();
        let shards = kinesis.list_shards(&stream).await.unwrap();
        assert_final_checkpoints(&store, &handled, &shards).await;
        plan.assert_every_kind_injected();
    };
    tokio::time::timeout(Duration::from_secs(300), body)
        .await
        .expect("the test did not finish in time");
}

/// The lease table deleted under a running consumer (dynalite): `run` returns
/// `TableMissing` naming the table within a lease duration plus a round and the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_lease_table_ends_run_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let body = async {
        let aws = Aws::from_env().await;
        let kinesis = aws.admin().unwrap();
        let stream = unique("wire-deleted");
        let group = format!("{stream}-group");
        kinesis.create_stream(&stream, 2).await.unwrap();
        produce(kinesis.as_ref(), &stream, 0..100).await;
        let recorder = Recorder::default();
        let consumer = test_consumer(aws.clone(), &stream, &group, "w1")
            .build()
            .unwrap();
        let run = tokio::spawn(
            consumer
                .run(recording_handler(recorder.clone()))
                .into_future(),
        );
        recorder.wait_for(100, LIMIT).await;
        aws.dynamodb_client()
            .delete_table()
            .table_name(&group)
            .send()
            .await
            .unwrap();
        let deleted = Instant::now();
        let result = tokio::time::timeout(LIMIT, run)
            .await
            .expect("run returns instead of waiting for ever")
            .unwrap();
        let took = deleted.elapsed();
        match result {
            Err(ConsumerError::Lease(LeaseError::TableMissing { table })) => {
                assert_eq!(table, group)
            }
            other => panic!("expected TableMissing, got {other:?}"),
        }
        assert!(took <= Duration::from_secs(15), "took {took:?}");
        eprintln!("run ended {took:?} after the table was deleted");
    };
    tokio::time::timeout(LIMIT, body)
        .await
        .expect("the test did not finish in time");
}

/// A lease row that does not parse is listed as unreadable and never taken or written;
/// the other shards are still balanced over two workers and read (dynalite).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_lease_row_is_listed_unreadable_and_left_alone_on_emulators() {
    if !emulators_enabled() {
        return;
    }
    let body = async {
        let aws = Aws::from_env().await;
        let kinesis = aws.admin().unwrap();
        let stream = unique("wire-corrupt");
        let group = format!("{stream}-group");
        kinesis.create_stream(&stream, 2).await.unwrap();
        produce(kinesis.as_ref(), &stream, 0..200).await;
        let store = aws.lease_store(&group);
        store.ensure_table().await.unwrap();
        aws.dynamodb_client()
            .put_item()
            .table_name(&group)
            .item("leaseKey", AttributeValue::S("shardId-corrupt".into()))
            .item("leaseCounter", AttributeValue::S("not a number".into()))
            .item("checkpoint", AttributeValue::S("TRIM_HORIZON".into()))
            .send()
            .await
            .unwrap();
        let recorder = Recorder::default();
        let w1 = start(
            test_consumer(aws.clone(), &stream, &group, "w1")
                .build()
                .unwrap(),
            &recorder,
        );
        let w2 = start(
            test_consumer(aws.clone(), &stream, &group, "w2")
                .build()
                .unwrap(),
            &recorder,
        );
        wait_all_values(&recorder, 200, LIMIT).await;
        let balanced = async {
            loop {
                let rows = store.list().await.unwrap();
                let owners: BTreeSet<_> = rows.iter().filter_map(|r| r.owner.clone()).collect();
                if owners.len() == 2 {
                    return rows;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };
        let rows = tokio::time::timeout(LIMIT, balanced)
            .await
            .expect("the two workers share the shards");
        // Listed as what it is, never taken or written: the two workers share the
        // readable rows and the corrupt one stays as it was put.
        assert_eq!(rows.len(), 3, "every row is listed: {rows:?}");
        let corrupt: Vec<_> = rows.iter().filter(|r| r.unreadable.is_some()).collect();
        assert_eq!(corrupt.len(), 1, "one row does not parse: {rows:?}");
        assert_eq!(corrupt[0].key, "shardId-corrupt");
        assert_eq!(corrupt[0].owner, None, "nobody took the corrupt row");
        w1.stop().await;
        w2.stop().await;
    };
    tokio::time::timeout(LIMIT, body)
        .await
        .expect("the test did not finish in time");
}

/// No per-service settings from the environment.
#[derive(Debug)]
struct NoServiceEnv;

impl aws_types::service_config::LoadServiceConfig for NoServiceEnv {
    fn load_config(&self, _key: aws_types::service_config::ServiceConfigKey<'_>) -> Option<String> {
        None
    }
}

/// A SubscribeToShard (enhanced fan-out, kinesis-local) outlives the SDK's operation,
/// attempt and read timeouts: they bound the call until its first answer, not the
/// event stream that follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_outlives_the_sdk_timeouts_on_emulators() {
    let Some(endpoint) = std::env::var_os("SHARDFLOW_FANOUT_KINESIS_ENDPOINT") else {
        eprintln!("skipped: SHARDFLOW_FANOUT_KINESIS_ENDPOINT not set (run scripts/test.sh)");
        return;
    };
    let body = async {
        use futures_util::StreamExt;
        let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest())
            .await
            .into_builder()
            // Without the environment's per-service endpoints (AWS_ENDPOINT_URL_KINESIS
            // points at kinesalite, which has no fan-out).
            .service_config(NoServiceEnv)
            .endpoint_url(endpoint.into_string().unwrap())
            .build();
        let timeouts = AwsTimeouts {
            connect: Duration::from_secs(1),
            read: Duration::from_secs(1),
            attempt: Duration::from_secs(2),
            operation: Duration::from_secs(2),
        };
        let aws = Aws::from_config_with(&config, timeouts).unwrap();
        let kinesis = aws.admin().unwrap();
        let stream = unique("wire-efo");
        kinesis.create_stream(&stream, 1).await.unwrap();
        let arn = kinesis
            .register_consumer(&stream, "wire-efo")
            .await
            .unwrap();
        let shard = open_shards(kinesis.as_ref(), &stream).await[0]
            .shard_id
            .clone();
        let mut events = kinesis
            .subscribe_to_shard(
                &arn,
                &shard,
                &shardflow::kinesis::StartingPosition::TrimHorizon,
            )
            .await
            .unwrap();
        // Three operation timeouts long, records written as it goes.
        let started = Instant::now();
        let mut next_value = 0;
        let mut received = 0;
        while started.elapsed() < timeouts.operation * 3 {
            produce(kinesis.as_ref(), &stream, next_value..next_value + 1).await;
            next_value += 1;
            let event = tokio::time::timeout(LIMIT, events.next())
                .await
                .expect("an event in time")
                .expect("the subscription is still open");
            received += event
                .expect("no error on the open subscription")
                .records
                .len();
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert!(received > 0, "records arrived over the subscription");
        eprintln!(
            "subscription open for {:?}, {received} records",
            started.elapsed()
        );
    };
    tokio::time::timeout(LIMIT, body)
        .await
        .expect("the test did not finish in time");
}
