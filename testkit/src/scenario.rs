//! Scenarios run on both backends: the same assertions against the embedded backend and against the emulators over HTTP.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use shardflow::kinesis::PutRecord;
use shardflow::lease::Checkpoint;
use shardflow::{Backend, ConsumerBuilder, Message};

use crate::{
    assert_exactly_once_in_order, assert_partition_key_order, checkpoints, open_shards, produce,
    produce_sentinels, start, test_consumer, wait_until_active, within, Recorder, STOP_LIMIT,
};

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
