//! Enhanced fan-out over real HTTP: the consumer built with `.fan_out(...)` against
//! kinesis-local (a build of kinesis-mock, which implements RegisterStreamConsumer and
//! SubscribeToShard) for Kinesis and dynalite for the lease table, both started by
//! `scripts/test.sh`. Skipped unless `SHARDFLOW_FANOUT_KINESIS_ENDPOINT` is set (the
//! DynamoDB endpoint comes from `AWS_ENDPOINT_URL_DYNAMODB`, as in the other emulator
//! tests).

use std::future::IntoFuture;
use std::time::Duration;

use futures_util::StreamExt;
use shardflow::kinesis::{KinesisApi, StartingPosition};
use shardflow::lease::Checkpoint;
use shardflow::{Aws, SequenceNumber};
use testkit::*;

const ENDPOINT: &str = "SHARDFLOW_FANOUT_KINESIS_ENDPOINT";
const LIMIT: Duration = Duration::from_secs(120);
/// A whole test, remote calls included: an emulator that stops answering fails it.
const TEST_LIMIT: Duration = Duration::from_secs(600);

/// The emulators' backend: Kinesis at the fan-out emulator, DynamoDB as configured.
async fn backend() -> Option<Aws> {
    let Some(endpoint) = std::env::var_os(ENDPOINT) else {
        eprintln!("skipped: {ENDPOINT} not set (run scripts/test.sh)");
        return None;
    };
    let endpoint = endpoint.into_string().expect("a UTF-8 endpoint");
    let config = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
    let kinesis = aws_sdk_kinesis::Client::from_conf(
        aws_sdk_kinesis::config::Builder::from(&config)
            .endpoint_url(endpoint)
            .build(),
    );
    Some(Aws::from_clients(
        kinesis,
        aws_sdk_dynamodb::Client::new(&config),
    ))
}

/// Subscribes from `from` and collects `n` record values, and the last continuation.
/// Retries while the emulator still counts the previous subscription as open (it says
/// so with ResourceInUseException, which shardflow classifies as throttling).
async fn collect(
    kinesis: &dyn KinesisApi,
    arn: &str,
    shard: &str,
    from: StartingPosition,
    n: usize,
) -> (Vec<usize>, Option<SequenceNumber>) {
    let mut values = Vec::new();
    let mut continuation = None;
    let mut refused = 0;
    'subscribe: loop {
        let mut events = match kinesis.subscribe_to_shard(arn, shard, &from).await {
            Ok(events) => events,
            Err(e) if e.is_transient() && refused < 50 => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        while values.len() < n {
            let event = tokio::time::timeout(LIMIT, events.next())
                .await
                .expect("an event in time")
                .expect("the subscription is open");
            let event = match event {
                Ok(event) => event,
                Err(e) if e.is_transient() && values.is_empty() && refused < 50 => {
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue 'subscribe;
                }
                Err(e) => panic!("{e}"),
            };
            for record in &event.records {
                let value = std::str::from_utf8(&record.data).unwrap();
                values.push(value.parse::<usize>().unwrap());
            }
            assert!(
                event.continuation.is_some(),
                "an open shard has a continuation"
            );
            continuation = event.continuation;
        }
        return (values, continuation);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_to_shard_delivers_records_and_continuations() {
    let Some(aws) = backend().await else { return };
    within(
        TEST_LIMIT,
        "subscribing and collecting the records",
        body_of_subscribe_to_shard_delivers_records_and_continuations(aws),
    )
    .await;
}

/// The body of [`subscribe_to_shard_delivers_records_and_continuations`].
async fn body_of_subscribe_to_shard_delivers_records_and_continuations(aws: Aws) {
    let kinesis = shardflow::Backend::admin(&aws).unwrap();
    let stream = unique("efo-api");
    kinesis.create_stream(&stream, 1).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..20).await;
    let arn = kinesis.register_consumer(&stream, "efo-api").await.unwrap();
    // Registering again finds the same consumer.
    assert_eq!(
        kinesis.register_consumer(&stream, "efo-api").await.unwrap(),
        arn
    );
    let shard = kinesis.list_shards(&stream).await.unwrap()[0]
        .shard_id
        .clone();
    let (values, continuation) = collect(
        kinesis.as_ref(),
        &arn,
        &shard,
        StartingPosition::TrimHorizon,
        20,
    )
    .await;
    assert_eq!(values, (0..20).collect::<Vec<_>>());

    // AFTER the continuation: only what was written since.
    produce(kinesis.as_ref(), &stream, 20..25).await;
    let (more, _) = collect(
        kinesis.as_ref(),
        &arn,
        &shard,
        StartingPosition::AfterSequenceNumber(continuation.unwrap()),
        5,
    )
    .await;
    assert_eq!(more, (20..25).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_consumer_handles_records_written_before_and_during_consumption() {
    let Some(aws) = backend().await else { return };
    within(
        TEST_LIMIT,
        "the fan-out consumer scenario",
        body_of_fan_out_consumer_handles_records_written_before_and_during_consumption(aws),
    )
    .await;
}

/// The body of [`fan_out_consumer_handles_records_written_before_and_during_consumption`].
async fn body_of_fan_out_consumer_handles_records_written_before_and_during_consumption(aws: Aws) {
    let kinesis = shardflow::Backend::admin(&aws).unwrap();
    let stream = unique("efo");
    let group = format!("{stream}-group");
    kinesis.create_stream(&stream, 3).await.unwrap();
    produce(kinesis.as_ref(), &stream, 0..600).await;

    let recorder = Recorder::default();
    let consumer = test_consumer(aws.clone(), &stream, &group, "w1")
        .fan_out("efo-billing")
        .build()
        .unwrap();
    let shutdown = consumer.shutdown_handle();
    let started = std::time::Instant::now();
    let run = tokio::spawn(
        consumer
            .run(recording_handler(recorder.clone()))
            .into_future(),
    );
    recorder.wait_for(600, LIMIT).await;
    let backlog = started.elapsed();
    produce(kinesis.as_ref(), &stream, 600..1_200).await;
    recorder.wait_for(1_200, LIMIT).await;
    eprintln!(
        "fan-out on the emulator: 600 records already written handled in {backlog:?}, all 1200 in {:?}",
        started.elapsed()
    );

    // The checkpoints reach each shard's last record (the interval is 100 ms).
    let store = shardflow::Backend::lease_store(&aws, &group);
    let handled = recorder.snapshot();
    let last_of = |shard: &str| {
        handled
            .iter()
            .filter(|h| h.shard == shard)
            .map(|h| h.sequence.clone())
            .max()
    };
    let committed = async {
        loop {
            let rows = store.list().await.unwrap();
            if rows.len() == 3
                && rows.iter().all(|r| match (&r.checkpoint, last_of(&r.key)) {
                    (Checkpoint::At(p), Some(last)) => p.sequence == last,
                    _ => false,
                })
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(LIMIT, committed)
        .await
        .expect("every shard checkpointed at its last handled record");
    shutdown.shutdown();
    within(STOP_LIMIT, "the consumer stops", run)
        .await
        .unwrap()
        .unwrap();

    let shards = kinesis.list_shards(&stream).await.unwrap();
    assert_exactly_once_in_order(&recorder.snapshot(), 1_200, &shards);
    assert_partition_key_order(&recorder.snapshot());
    for row in store.list().await.unwrap() {
        assert_eq!(row.owner, None, "lease {} released at shutdown", row.key);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fan_out_reshard_while_consuming_on_emulator() {
    let Some(aws) = backend().await else { return };
    // Small: kinesis-local's PutRecords slows down as shards fill.
    let stream = unique("efo-reshard");
    let scenario =
        reshard_while_consuming_with(aws, &stream, 2_000, LIMIT, |b| b.fan_out("efo-reshard"));
    within(TEST_LIMIT, "the fan-out reshard scenario", scenario).await;
}
