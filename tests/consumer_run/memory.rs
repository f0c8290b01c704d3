//! The single-instance consumer on the embedded backend: reshards, seeded faults,
//! handler failures, the stream mode and shutdown.

use testkit::hooks;

use std::convert::Infallible;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use hooks::{Hooked, Hooks};
use shardflow::kinesis::{KinesisApi, StreamAdmin};
use shardflow::lease::Checkpoint;
use shardflow::lease::LeaseStore;
use shardflow::memory::{KinesisFaults, LeaseFaults};
use shardflow::{Memory, Message};
use testkit::*;

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshard_while_consuming_on_memory() {
    reshard_while_consuming(Memory::new(), "orders", 10_000, LIMIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_faults_lose_nothing() {
    for seed in 0..8u64 {
        let memory = Memory::new();
        memory.streams().set_faults(KinesisFaults {
            throttle: 0.2,
            expire_iterator: 0.1,
            error: 0.05,
            put_entry_failure: 0.05,
            missing_next_iterator: 0.05,
            seed,
        });
        let group = format!("faults-{seed}");
        memory.table(&group).set_faults(LeaseFaults {
            fail_before_write: 0.1,
            fail_after_write: 0.1,
            throttle: 0.05,
            latency: Duration::from_millis(1),
            seed,
        });
        let kinesis = memory.streams().clone();
        kinesis.create_stream("faulty", 3).await.unwrap();
        produce(kinesis.as_ref(), "faulty", 0..3_000).await;
        let recorder = Recorder::default();
        let consumer = test_consumer(memory.clone(), "faulty", &group, "w1")
            .max_records_per_read(100)
            .build()
            .unwrap();
        let run = start(consumer, &recorder);
        recorder.wait_for(3_000, LIMIT).await;
        run.stop().await;
        let handled = recorder.snapshot();
        let shards = kinesis.list_shards("faulty").await.unwrap();
        // Faults may cause re-reads; the per-record filter must keep them from reaching
        // the handler twice in a single-instance run.
        assert_exactly_once_in_order(&handled, 3_000, &shards);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_handler_redelivers_from_the_checkpoint_and_skips_nothing() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("flaky", 2).await.unwrap();
    produce(kinesis.as_ref(), "flaky", 0..1_000).await;
    let recorder = Recorder::default();
    let failures = Arc::new(AtomicUsize::new(0));
    let handler = {
        let recorder = recorder.clone();
        let failures = failures.clone();
        tower::service_fn(move |msg: Message| {
            let value: usize = std::str::from_utf8(&msg.payload).unwrap().parse().unwrap();
            // Every 97th value fails on its first attempt.
            let fail = value % 97 == 0
                && !recorder
                    .snapshot()
                    .iter()
                    .any(|h| h.value == value + 1_000_000);
            if fail {
                failures.fetch_add(1, Ordering::SeqCst);
                recorder.handled.lock().unwrap().push(Handled {
                    shard: String::new(),
                    sequence: msg.metadata.sequence_number.clone(),
                    partition_key: String::new(),
                    value: value + 1_000_000,
                });
            } else {
                recorder.record(&msg);
            }
            async move {
                if fail {
                    Err("injected failure")
                } else {
                    Ok(())
                }
            }
        })
    };
    let consumer = test_consumer(memory.clone(), "flaky", "flaky-group", "w1")
        .build()
        .unwrap();
    let shutdown = consumer.shutdown_handle();
    let run = tokio::spawn(consumer.run(handler).into_future());
    let wait_all = async {
        loop {
            let ok = recorder
                .snapshot()
                .iter()
                .filter(|h| h.value < 1_000_000)
                .count();
            if ok >= 1_000 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    within(LIMIT, "every value handled", wait_all).await;
    shutdown.shutdown();
    within(STOP_LIMIT, "the consumer stops", run)
        .await
        .unwrap()
        .unwrap();
    let handled: Vec<Handled> = recorder
        .snapshot()
        .into_iter()
        .filter(|h| h.value < 1_000_000)
        .collect();
    assert!(failures.load(Ordering::SeqCst) >= 10);
    let shards = kinesis.list_shards("flaky").await.unwrap();
    assert_exactly_once_in_order(&handled, 1_000, &shards);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_mode_checkpoints_only_the_contiguous_acked_prefix() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("acks", 1).await.unwrap();
    produce(kinesis.as_ref(), "acks", 0..300).await;
    let consumer = test_consumer(memory.clone(), "acks", "acks-group", "w1")
        .max_records_per_read(100)
        .prefetch_batches(3)
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let shutdown = batches.shutdown_handle();
    let mut held = Vec::new();
    while held.len() < 3 {
        let next = within(LIMIT, "the next batch", batches.next()).await;
        held.push(next.unwrap().unwrap());
    }
    // Acknowledge the 2nd and 3rd batch, not the 1st: the checkpoint may not move.
    held[1].ack();
    held[2].ack();
    let table = memory.table("acks-group");
    tokio::time::sleep(Duration::from_millis(300)).await; // several checkpoint intervals
    assert_eq!(table.rows()[0].checkpoint, Checkpoint::TrimHorizon);
    held[0].ack();
    let last = held[2].messages.last().unwrap().position();
    let moved = async {
        loop {
            if table.rows()[0].checkpoint == Checkpoint::At(last.clone()) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(LIMIT, moved)
        .await
        .expect("checkpoint reaches the end of the 3rd batch");
    shutdown.shutdown();
    within(STOP_LIMIT, "the stream ends after shutdown()", async {
        while let Some(batch) = batches.next().await {
            batch.unwrap().ack();
        }
    })
    .await;
    assert_eq!(table.rows()[0].owner, None, "released at shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refuses_a_missing_stream_with_a_typed_error() {
    let consumer = test_consumer(Memory::new(), "missing", "g-missing", "w1")
        .build()
        .unwrap();
    let run = consumer
        .run(tower::service_fn(|_m: Message| async {
            Ok::<_, Infallible>(())
        }))
        .into_future();
    let err = within(LIMIT, "the consumer refuses the missing stream", run)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            shardflow::ConsumerError::Kinesis(shardflow::kinesis::KinesisError::NotFound(_))
        ),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_stream_is_updating_held_shards_continue_and_no_leases_churn() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("updating", 2).await.unwrap();
    produce(kinesis.as_ref(), "updating", 0..200).await;
    let recorder = Recorder::default();
    let consumer = test_consumer(memory.clone(), "updating", "updating-group", "w1")
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    recorder.wait_for(200, LIMIT).await;

    memory.streams().set_updating("updating", true);
    let open = open_shards(kinesis.as_ref(), "updating").await;
    let s = &open[0];
    kinesis
        .split_shard(
            "updating",
            &s.shard_id,
            s.starting_hash_key + (s.ending_hash_key - s.starting_hash_key) / 2,
        )
        .await
        .unwrap();
    produce(kinesis.as_ref(), "updating", 200..400).await;
    // The open shard keeps being read while the stream is UPDATING...
    let unsplit = open[1].shard_id.clone();
    let expected_on_unsplit = kinesis.records("updating", &unsplit).len();
    let wait = async {
        while recorder
            .snapshot()
            .iter()
            .filter(|h| h.shard == unsplit)
            .count()
            < expected_on_unsplit
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(LIMIT, wait)
        .await
        .expect("held shards keep going while UPDATING");
    // ...but no lease is created for the children (absence needs a window: several
    // 300 ms lease rounds).
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(
        memory.table("updating-group").rows().len(),
        2,
        "no new leases while UPDATING"
    );

    memory.streams().set_updating("updating", false);
    recorder.wait_for(400, LIMIT).await;
    run.stop().await;
    let shards = kinesis.list_shards("updating").await.unwrap();
    assert_exactly_once_in_order(&recorder.snapshot(), 400, &shards);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kpl_aggregates_resume_inside_an_aggregate_on_memory() {
    kpl_aggregates_resume_inside_an_aggregate(Memory::new(), "kpl", LIMIT).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_latest_a_failure_before_the_first_checkpoint_skips_nothing_written_since() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("latest", 1).await.unwrap();
    produce(kinesis.as_ref(), "latest", 1_000_000..1_000_010).await; // before the group
    let recorder = Recorder::default();
    let failed = Arc::new(AtomicUsize::new(0));
    let handler = {
        let (recorder, failed) = (recorder.clone(), failed.clone());
        tower::service_fn(move |msg: Message| {
            // The very first record fails once: the shard restarts before any checkpoint.
            let fail = failed.fetch_add(1, Ordering::SeqCst) == 0;
            if !fail {
                recorder.record(&msg);
            }
            async move {
                if fail {
                    Err("injected")
                } else {
                    Ok(())
                }
            }
        })
    };
    let backend = Hooked::new(
        memory.clone(),
        IteratorsSeen(tokio::sync::watch::channel(0).0),
    );
    let mut iterators = backend.hooks.0.subscribe();
    let consumer = test_consumer(backend, "latest", "latest-group", "w1")
        .initial_position(shardflow::InitialPosition::Latest)
        .build()
        .unwrap();
    let shutdown = consumer.shutdown_handle();
    let run = tokio::spawn(consumer.run(handler).into_future());
    let table = memory.table("latest-group");
    let taken = async {
        while table.rows().first().and_then(|r| r.owner.clone()).is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    within(LIMIT, "the lease taken", taken).await;
    // The reader needs its first (LATEST) iterator before records count as "new".
    let first_iterator = iterators.wait_for(|n| *n > 0);
    within(
        LIMIT,
        "the reader's first (LATEST) iterator",
        first_iterator,
    )
    .await
    .unwrap();
    produce(kinesis.as_ref(), "latest", 0..100).await;
    // The restart reads from the first iterator's time minus a clock-skew margin, so
    // records written just before the start may come too: extra records, never a gap.
    let after_start = || -> Vec<usize> {
        recorder
            .snapshot()
            .iter()
            .map(|h| h.value)
            .filter(|v| *v < 1_000_000)
            .collect()
    };
    let all = async {
        while after_start().len() < 100 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    within(LIMIT, "every record written after the start", all).await;
    shutdown.shutdown();
    within(STOP_LIMIT, "the consumer stops", run)
        .await
        .unwrap()
        .unwrap();
    assert!(
        failed.load(Ordering::SeqCst) > 1,
        "the first record failed and came back"
    );
    assert_eq!(
        after_start(),
        (0..100).collect::<Vec<_>>(),
        "once each, in order"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_past_retention_does_not_hold_its_children_back() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("trimmed", 1).await.unwrap();
    let parent = open_shards(kinesis.as_ref(), "trimmed").await.remove(0);
    kinesis
        .split_shard("trimmed", &parent.shard_id, u128::MAX / 2)
        .await
        .unwrap();
    produce(kinesis.as_ref(), "trimmed", 0..200).await; // all in the children
                                                        // Leases as an earlier run left them: the parent not yet finished...
    let table = memory.table("trimmed-group");
    for shard in kinesis.list_shards("trimmed").await.unwrap() {
        let lease = shardflow::lease::Lease::new(
            shard.shard_id.clone(),
            shard.parents(),
            Checkpoint::TrimHorizon,
        );
        table.create(&lease).await.unwrap();
    }
    // ...and then the parent aged out of the stream.
    kinesis.remove_shard("trimmed", &parent.shard_id);
    let recorder = Recorder::default();
    let consumer = test_consumer(memory.clone(), "trimmed", "trimmed-group", "w1")
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    recorder.wait_for(200, LIMIT).await;
    run.stop().await;
    let parent_row = table.rows().into_iter().find(|r| r.key == parent.shard_id);
    assert!(parent_row.is_none_or(|r| r.checkpoint == Checkpoint::ShardEnd));
}

/// Counts GetShardIterator calls in a watch channel: a test awaits the reader's first
/// iterator instead of sleeping until it probably has one.
struct IteratorsSeen(tokio::sync::watch::Sender<usize>);

#[async_trait::async_trait]
impl Hooks for IteratorsSeen {
    async fn after_kinesis(&self, op: &'static str) {
        if op == "shard_iterator" {
            self.0.send_modify(|n| *n += 1);
        }
    }
}

/// Record mode sees the consumer's lag too: every message carries the
/// `millis_behind_latest` of the read that brought it (before, only `Batch` had it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn record_mode_messages_carry_the_lag_of_their_read() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("lag", 1).await.unwrap();
    produce(kinesis.as_ref(), "lag", 0..300).await;
    let (seen, mut lags) = tokio::sync::mpsc::unbounded_channel();
    let handler = tower::service_fn(move |msg: Message| {
        let _ = seen.send(msg.metadata.millis_behind_latest);
        async { Ok::<_, Infallible>(()) }
    });
    let consumer = test_consumer(memory.clone(), "lag", "lag-group", "w1")
        .max_records_per_read(100)
        .build()
        .unwrap();
    let running = consumer.run(handler).spawn();
    for i in 0..300 {
        let lag = within(LIMIT, "the next record", lags.recv()).await.unwrap();
        assert!(lag.is_some(), "record {i} has no millis_behind_latest");
    }
    within(STOP_LIMIT, "the consumer stops", running.shutdown())
        .await
        .unwrap();
}
