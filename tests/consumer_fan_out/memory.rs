//! Enhanced fan-out on the embedded backend: the memory subscription itself (events,
//! heartbeats, lifetime, shard end), and the consumer built with `.fan_out(...)` across
//! reshards, many subscription renewals, subscription errors and a shard end that is
//! never reported. Paused tokio time where the scenario is about time.

use testkit::hooks;

use std::future::IntoFuture;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt;
use hooks::{Hooked, Hooks};
use shardflow::kinesis::{
    KinesisApi, KinesisError, StartingPosition, StreamAdmin, Subscription, SubscriptionEvent,
};
use shardflow::lease::Checkpoint;
use shardflow::memory::{KinesisFaults, MemoryKinesis};
use shardflow::{ConsumerError, Memory};
use testkit::*;
use tokio::time::Instant;

const LIMIT: Duration = Duration::from_secs(120);

/// Counts subscriptions and GetRecords calls; without `fan_out`, refuses to register a
/// fan-out consumer as a backend without enhanced fan-out does.
struct Counting {
    fan_out: bool,
    subscriptions: AtomicUsize,
    get_records: AtomicUsize,
}

impl Counting {
    fn new(memory: Memory) -> Hooked<Memory, Counting> {
        Self::with_fan_out(memory, true)
    }

    fn with_fan_out(memory: Memory, fan_out: bool) -> Hooked<Memory, Counting> {
        let counting = Counting {
            fan_out,
            subscriptions: AtomicUsize::new(0),
            get_records: AtomicUsize::new(0),
        };
        Hooked::new(memory, counting)
    }

    fn subscriptions(&self) -> usize {
        self.subscriptions.load(Ordering::SeqCst)
    }

    fn get_records(&self) -> usize {
        self.get_records.load(Ordering::SeqCst)
    }
}

#[async_trait]
impl Hooks for Counting {
    async fn before_kinesis(&self, op: &'static str) -> Result<(), KinesisError> {
        match op {
            "register_consumer" if !self.fan_out => {
                return Err(KinesisError::Unsupported("enhanced fan-out".into()))
            }
            "subscribe_to_shard" => {
                self.subscriptions.fetch_add(1, Ordering::SeqCst);
            }
            "get_records" => {
                self.get_records.fetch_add(1, Ordering::SeqCst);
            }
            _ => {}
        }
        Ok(())
    }
}

fn values(event: &SubscriptionEvent) -> Vec<usize> {
    event
        .records
        .iter()
        .map(|r| std::str::from_utf8(&r.data).unwrap().parse().unwrap())
        .collect()
}

async fn next_event(events: &mut Subscription) -> SubscriptionEvent {
    within(LIMIT, "the next subscription event", events.next())
        .await
        .expect("the subscription is open")
        .expect("an event, not an error")
}

#[tokio::test(start_paused = true)]
async fn memory_subscription_pushes_records_sends_heartbeats_and_reports_the_shard_end() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("push", 1).await.unwrap();
    kinesis.set_max_records_per_event(10);
    kinesis.set_heartbeat_interval(Duration::from_secs(1));
    produce(kinesis.as_ref(), "push", 0..25).await;
    let arn = kinesis.register_consumer("push", "c").await.unwrap();
    assert_eq!(kinesis.register_consumer("push", "c").await.unwrap(), arn);
    let shard = kinesis.list_shards("push").await.unwrap()[0].clone();
    let records = kinesis.records("push", &shard.shard_id);

    let mut events = kinesis
        .subscribe_to_shard(&arn, &shard.shard_id, &StartingPosition::TrimHorizon)
        .await
        .unwrap();
    // The backlog in events of at most 10 records, each continuing after its last.
    for (range, last) in [(0..10, 9), (10..20, 19), (20..25, 24)] {
        let event = next_event(&mut events).await;
        assert_eq!(values(&event), range.collect::<Vec<_>>());
        assert_eq!(
            event.continuation.as_ref(),
            Some(&records[last].sequence_number)
        );
    }
    // Idle: a heartbeat after the interval, with the same continuation.
    let idle_since = Instant::now();
    let heartbeat = next_event(&mut events).await;
    assert!(heartbeat.records.is_empty());
    assert_eq!(idle_since.elapsed(), Duration::from_secs(1));
    assert_eq!(
        heartbeat.continuation.as_ref(),
        Some(&records[24].sequence_number)
    );
    // New records are pushed as they arrive, not at the next heartbeat.
    let written = Instant::now();
    let pushed = tokio::spawn(async move {
        let event = next_event(&mut events).await;
        (event, events)
    });
    produce(kinesis.as_ref(), "push", 25..28).await;
    let (event, mut events) = pushed.await.unwrap();
    assert_eq!(values(&event), vec![25, 26, 27]);
    assert!(written.elapsed() < Duration::from_secs(1));

    // Closed by a split: the last event has no continuation and names the children.
    kinesis
        .split_shard("push", &shard.shard_id, shard.ending_hash_key / 2)
        .await
        .unwrap();
    let end = next_event(&mut events).await;
    assert!(end.records.is_empty());
    assert_eq!(end.continuation, None);
    assert_eq!(
        end.child_shards,
        vec!["shardId-000000000001", "shardId-000000000002"]
    );
    assert!(
        within(LIMIT, "the end of the subscription", events.next())
            .await
            .is_none(),
        "ends after the shard's end"
    );

    // AFTER a continuation: only later records; a subscription ends after its lifetime.
    kinesis.set_subscription_lifetime(Duration::from_secs(3));
    let child = "shardId-000000000002";
    let started = Instant::now();
    let mut events = kinesis
        .subscribe_to_shard(&arn, child, &StartingPosition::TrimHorizon)
        .await
        .unwrap();
    let mut count = 0;
    within(LIMIT, "the subscription ends after its lifetime", async {
        while let Some(event) = events.next().await {
            assert!(event.unwrap().continuation.is_some());
            count += 1;
        }
    })
    .await;
    assert_eq!(started.elapsed(), Duration::from_secs(3));
    assert_eq!(
        count, 3,
        "the first event at once, then a heartbeat a second"
    );

    // An unknown consumer is refused.
    assert!(matches!(
        kinesis
            .subscribe_to_shard("arn:nope", child, &StartingPosition::Latest)
            .await,
        Err(KinesisError::NotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_handles_every_record_once_in_order_across_a_split_and_a_merge() {
    let memory = Memory::new();
    memory.streams().set_max_records_per_event(100);
    let backend = Counting::new(memory);
    reshard_while_consuming_with(backend.clone(), "efo-orders", 10_000, LIMIT, |b| {
        b.fan_out("billing-efo")
    })
    .await;
    assert!(
        backend.hooks.subscriptions() >= 7,
        "one subscription per shard"
    );
    assert_eq!(backend.hooks.get_records(), 0, "nothing was polled");
}

/// Writes values from `first` on in `batches` batches of `per_batch`, `every` apart.
async fn trickle(
    kinesis: Arc<MemoryKinesis>,
    stream: &'static str,
    first: usize,
    (batches, per_batch): (usize, usize),
    every: Duration,
) {
    for i in 0..batches {
        let start = first + i * per_batch;
        produce(kinesis.as_ref(), stream, start..start + per_batch).await;
        tokio::time::sleep(every).await;
    }
}

/// Waits until every shard's checkpoint is its last record.
async fn checkpointed_at_the_end(memory: &Memory, stream: &str, group: &str) {
    let kinesis = memory.streams();
    let table = memory.table(group);
    let done = async {
        loop {
            let rows = table.rows();
            let at_end = !rows.is_empty()
                && rows.iter().all(|row| {
                    let last = kinesis.records(stream, &row.key).last().cloned();
                    match (&row.checkpoint, last) {
                        (Checkpoint::At(p), Some(last)) => p.sequence == last.sequence_number,
                        (Checkpoint::TrimHorizon, None) => true,
                        _ => false,
                    }
                });
            if at_end {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(LIMIT, done)
        .await
        .expect("every shard checkpointed at its last record");
}

#[tokio::test(start_paused = true)]
async fn subscriptions_renew_before_their_lifetime_without_loss_or_duplicates() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("renew", 2).await.unwrap();
    kinesis.set_subscription_lifetime(Duration::from_secs(2));
    kinesis.set_heartbeat_interval(Duration::from_millis(500));
    kinesis.set_max_records_per_event(7);
    let backend = Counting::new(memory.clone());
    let recorder = Recorder::default();
    let consumer = test_consumer(backend.clone(), "renew", "renew-group", "w1")
        .fan_out("renew-efo")
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    // 3,000 records over 30 s: records keep flowing across ~15 renewals per shard.
    let started = Instant::now();
    let producer = tokio::spawn(trickle(
        kinesis.clone(),
        "renew",
        0,
        (120, 25),
        Duration::from_millis(250),
    ));
    recorder.wait_for(3_000, LIMIT).await;
    producer.await.unwrap();
    checkpointed_at_the_end(&memory, "renew", "renew-group").await;
    let elapsed = started.elapsed();
    run.stop().await;

    let shards = kinesis.list_shards("renew").await.unwrap();
    assert_exactly_once_in_order(&recorder.snapshot(), 3_000, &shards);
    assert_partition_key_order(&recorder.snapshot());
    let renewals = backend.hooks.subscriptions();
    let expected = 2 * (elapsed.as_secs() as usize / 2);
    eprintln!("{renewals} subscriptions of 2 shards in {elapsed:?} of paused time");
    assert!(
        renewals >= expected,
        "{renewals} subscriptions in {elapsed:?}; expected at least {expected}"
    );
    assert_eq!(backend.hooks.get_records(), 0, "nothing was polled");
    for row in memory.table("renew-group").rows() {
        assert_eq!(row.owner, None, "lease {} released", row.key);
    }
}

#[tokio::test(start_paused = true)]
async fn the_reader_resumes_after_subscription_errors() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("broken", 2).await.unwrap();
    kinesis.set_max_records_per_event(10);
    produce(kinesis.as_ref(), "broken", 0..500).await;
    let backend = Counting::new(memory.clone());
    let recorder = Recorder::default();
    let consumer = test_consumer(backend.clone(), "broken", "broken-group", "w1")
        .fan_out("broken-efo")
        .build()
        .unwrap();
    let run = start(consumer, &recorder);
    recorder.wait_for(100, LIMIT).await;
    // Break every open subscription again and again while more records arrive.
    for i in 0..10 {
        kinesis.interrupt_subscriptions();
        produce(kinesis.as_ref(), "broken", 500 + i * 50..550 + i * 50).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    recorder.wait_for(1_000, LIMIT).await;
    checkpointed_at_the_end(&memory, "broken", "broken-group").await;
    run.stop().await;
    let shards = kinesis.list_shards("broken").await.unwrap();
    assert_exactly_once_in_order(&recorder.snapshot(), 1_000, &shards);
    assert!(
        backend.hooks.subscriptions() >= 2 + 2 * 10,
        "resubscribed after each interruption: {} subscriptions",
        backend.hooks.subscriptions()
    );
}

#[tokio::test(start_paused = true)]
async fn seeded_subscription_faults_lose_nothing() {
    for seed in 0..6u64 {
        let memory = Memory::new();
        let kinesis = memory.streams().clone();
        kinesis.create_stream("faulty", 3).await.unwrap();
        kinesis.set_max_records_per_event(25);
        kinesis.set_subscription_lifetime(Duration::from_secs(3));
        produce(kinesis.as_ref(), "faulty", 0..1_000).await;
        // Throttled and failing subscribe calls, and errors inside subscriptions.
        kinesis.set_faults(KinesisFaults {
            throttle: 0.2,
            error: 0.1,
            seed,
            ..KinesisFaults::default()
        });
        let recorder = Recorder::default();
        let group = format!("faulty-{seed}");
        let consumer = test_consumer(memory.clone(), "faulty", &group, "w1")
            .fan_out("faulty-efo")
            .build()
            .unwrap();
        let run = start(consumer, &recorder);
        // Half a second apart: many subscriptions come and go meanwhile.
        let producer = tokio::spawn(trickle(
            kinesis.clone(),
            "faulty",
            1_000,
            (10, 50),
            Duration::from_millis(500),
        ));
        producer.await.unwrap();
        recorder.wait_for(1_500, LIMIT).await;
        checkpointed_at_the_end(&memory, "faulty", &group).await;
        run.stop().await;
        let shards = kinesis.list_shards("faulty").await.unwrap();
        assert_exactly_once_in_order(&recorder.snapshot(), 1_500, &shards);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_shard_whose_end_is_never_reported_is_finished_by_polling() {
    // Like kinesis-local: subscriptions to a closed shard keep sending heartbeats.
    let memory = Memory::new();
    memory.streams().set_report_shard_end(false);
    memory
        .streams()
        .set_heartbeat_interval(Duration::from_millis(100));
    memory.streams().set_max_records_per_event(100);
    let backend = Counting::new(memory);
    reshard_while_consuming_with(backend.clone(), "unreported", 4_000, LIMIT, |b| {
        b.fan_out("unreported-efo")
    })
    .await;
    assert!(
        backend.hooks.get_records() > 0,
        "closed shards finished by polling"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_without_fan_out_refuses_to_start() {
    let memory = Memory::new();
    memory.streams().create_stream("plain", 1).await.unwrap();
    let backend = Counting::with_fan_out(memory, false);
    let recorder = Recorder::default();
    let run = test_consumer(backend, "plain", "plain-group", "w1")
        .fan_out("plain-efo")
        .build()
        .unwrap()
        .run(recording_handler(recorder))
        .into_future();
    let err = within(LIMIT, "the consumer refuses to start", run)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ConsumerError::Kinesis(KinesisError::Unsupported(_))),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_second_worker_takes_over_shards_by_hand_off_without_duplicates() {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis.create_stream("shared", 4).await.unwrap();
    kinesis.set_max_records_per_event(20);
    kinesis.set_subscription_lifetime(Duration::from_secs(5));
    let recorder = Recorder::default();
    let worker = |name: &str| {
        let consumer = test_consumer(memory.clone(), "shared", "shared-group", name)
            .fan_out("shared-efo")
            .build()
            .unwrap();
        start(consumer, &recorder)
    };
    let w1 = worker("w1");
    let producer = tokio::spawn(trickle(
        kinesis.clone(),
        "shared",
        0,
        (80, 50),
        Duration::from_millis(100),
    ));
    recorder.wait_for(500, LIMIT).await;
    // w2 joins: it asks w1 for shards, which w1 drains, checkpoints and hands over.
    let w2 = worker("w2");
    let table = memory.table("shared-group");
    let balanced = async {
        loop {
            let w2 = table
                .rows()
                .iter()
                .filter(|r| r.owner.as_deref().map(shardflow::lease::worker_of) == Some("w2"))
                .count();
            if w2 == 2 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(LIMIT, balanced)
        .await
        .expect("w2 holds half of the shards");
    producer.await.unwrap();
    recorder.wait_for(4_000, LIMIT).await;
    checkpointed_at_the_end(&memory, "shared", "shared-group").await;
    w1.shutdown.shutdown();
    w2.stop().await;
    w1.stop().await;
    let shards = kinesis.list_shards("shared").await.unwrap();
    // A planned hand-off (drain, checkpoint, transfer) delivers nothing twice.
    assert_exactly_once_in_order(&recorder.snapshot(), 4_000, &shards);
}
