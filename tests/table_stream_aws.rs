//! A table's DynamoDB stream read by the consumer through the AWS backend, against moto's
//! server (DynamoDB with DynamoDB Streams): every change read once, in per-item order,
//! checkpointed in the lease table; a restart resumes after the checkpoint; a table
//! without a stream is a typed error.
//!
//! `scripts/test.sh` starts moto and sets `SHARDFLOW_TABLE_STREAMS_ENDPOINT`; without it
//! the emulator tests here return at once. The `wire_*` tests need no emulator: they talk
//! to a scripted endpoint (`testkit::fake_endpoint`) to show what moto cannot — paging by
//! `ExclusiveStartShardId`, the service's errors, trimmed positions. The leases are on moto too: one `Aws` backend has one
//! DynamoDB client, which both resolves the table's stream and keeps the leases (as on
//! AWS, where both are the same service).

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::future::IntoFuture;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType, StreamSpecification, StreamViewType,
};
use shardflow::dynamodb_streams::{ChangeRecord, EventName};
use shardflow::kinesis::KinesisError;
use shardflow::lease::Checkpoint;
use shardflow::{Aws, Backend, CheckpointPolicy, Consumer, ConsumerError, Message};
use testkit::unique;

/// No single test may take longer than this (an emulator that hangs fails the test).
const TEST_TIMEOUT: Duration = Duration::from_secs(120);

/// The backend with DynamoDB and DynamoDB Streams on moto, or `None` (after saying so).
async fn moto() -> Option<(Aws, aws_sdk_dynamodb::Client)> {
    let endpoint = testkit::table_streams_endpoint()?;
    let sdk = aws_config::load_defaults(aws_config::BehaviorVersion::latest()).await;
    let dynamodb = aws_sdk_dynamodb::Client::from_conf(
        aws_sdk_dynamodb::config::Builder::from(&sdk)
            .endpoint_url(&endpoint)
            .build(),
    );
    let streams = aws_sdk_dynamodbstreams::Client::from_conf(
        aws_sdk_dynamodbstreams::config::Builder::from(&sdk)
            .endpoint_url(&endpoint)
            .build(),
    );
    let kinesis = aws_sdk_kinesis::Client::new(&sdk);
    let aws = Aws::from_clients(kinesis, dynamodb.clone()).with_streams_client(streams);
    Some((aws, dynamodb))
}

async fn create_table(dynamodb: &aws_sdk_dynamodb::Client, table: &str, stream: bool) {
    let mut request = dynamodb
        .create_table()
        .table_name(table)
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("pk")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("pk")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .billing_mode(BillingMode::PayPerRequest);
    if stream {
        request = request.stream_specification(
            StreamSpecification::builder()
                .stream_enabled(true)
                .stream_view_type(StreamViewType::NewAndOldImages)
                .build()
                .unwrap(),
        );
    }
    request.send().await.expect("CreateTable");
}

/// One write of the test, and the change it must produce.
#[derive(Clone, Copy, Debug)]
enum Write {
    Put(usize, u32),
    Delete(usize),
}

async fn write(dynamodb: &aws_sdk_dynamodb::Client, table: &str, w: Write) {
    match w {
        Write::Put(item, version) => {
            dynamodb
                .put_item()
                .table_name(table)
                .item("pk", AttributeValue::S(format!("item-{item}")))
                .item("version", AttributeValue::N(version.to_string()))
                .send()
                .await
                .expect("PutItem");
        }
        Write::Delete(item) => {
            dynamodb
                .delete_item()
                .table_name(table)
                .key("pk", AttributeValue::S(format!("item-{item}")))
                .send()
                .await
                .expect("DeleteItem");
        }
    }
}

/// One handled change: its sequence number, partition key, event and the new image's
/// `version`.
type Change = (String, String, EventName, Option<u32>);

/// What the handler saw, in order.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<Change>>>);

#[derive(serde::Deserialize)]
struct Item {
    version: u32,
}

impl Seen {
    fn handler(
        &self,
    ) -> impl tower::Service<Message, Response = (), Error = Infallible, Future = impl Send>
           + Clone
           + Send
           + 'static {
        let seen = self.0.clone();
        tower::service_fn(move |msg: Message| {
            let change = ChangeRecord::from_payload(&msg.payload).expect("a change record");
            assert_eq!(msg.metadata.partition_key, change.partition_key());
            let version = change
                .new_image_as::<Item>()
                .expect("the new image decodes")
                .map(|item| item.version);
            seen.lock().unwrap().push((
                msg.metadata.sequence_number.to_string(),
                msg.metadata.partition_key.clone(),
                change.event_name,
                version,
            ));
            async { Ok::<_, Infallible>(()) }
        })
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    async fn wait_for(&self, n: usize) {
        let waited = tokio::time::timeout(TEST_TIMEOUT, async {
            while self.len() < n {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        assert!(waited.is_ok(), "only {} of {n} changes handled", self.len());
    }
}

fn consumer(aws: &Aws, table: &str, group: &str) -> Consumer {
    Consumer::builder()
        .table_stream(table)
        .group(group)
        .backend(aws.clone())
        .checkpoint(CheckpointPolicy::EveryBatch)
        .idle_read_interval(Duration::from_millis(100))
        .build()
        .expect("a valid table-stream consumer")
}

/// Runs a consumer until `n` more changes were handled, then stops it gracefully.
async fn run_until(consumer: Consumer, seen: &Seen, n: usize) {
    let shutdown = consumer.shutdown_handle();
    let task = tokio::spawn(consumer.run(seen.handler()).into_future());
    seen.wait_for(n).await;
    shutdown.shutdown();
    tokio::time::timeout(TEST_TIMEOUT, task)
        .await
        .expect("the consumer stops")
        .expect("the consumer task")
        .expect("the consumer ran without error");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_change_is_read_once_in_item_order_and_a_restart_resumes_after_the_checkpoint() {
    let Some((aws, dynamodb)) = moto().await else {
        return;
    };
    let table = unique("orders");
    let group = unique("cdc");
    create_table(&dynamodb, &table, true).await;
    // Four items, each inserted, changed and (two of them) deleted, interleaved.
    let first: Vec<Write> = (0..4)
        .map(|i| Write::Put(i, 1))
        .chain((0..4).map(|i| Write::Put(i, 2)))
        .chain([Write::Delete(1), Write::Delete(3)])
        .collect();
    for w in &first {
        write(&dynamodb, &table, *w).await;
    }
    let seen = Seen::default();
    run_until(consumer(&aws, &table, &group), &seen, first.len()).await;

    // The checkpoint landed in the lease table: the one shard, at the last change.
    let store = aws.lease_store(&group);
    let leases = store.list().await.expect("the lease table");
    assert_eq!(leases.len(), 1, "one shard, one lease: {leases:?}");
    let last_seen = seen.0.lock().unwrap().last().unwrap().0.clone();
    match &leases[0].checkpoint {
        Checkpoint::At(position) => {
            assert_eq!(position.sequence.to_string(), last_seen)
        }
        other => panic!("the checkpoint is {other:?}, not the last change"),
    }

    // Restarted after more writes: only the new changes, none read again.
    let second = [Write::Put(1, 3), Write::Put(0, 3), Write::Delete(0)];
    for w in &second {
        write(&dynamodb, &table, *w).await;
    }
    let before = seen.len();
    run_until(consumer(&aws, &table, &group), &seen, before + second.len()).await;
    // A moment more for anything read twice to show.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let all = seen.0.lock().unwrap().clone();
    assert_eq!(
        all.len(),
        first.len() + second.len(),
        "exactly once: {all:#?}"
    );
    let sequences: BTreeSet<&String> = all.iter().map(|c| &c.0).collect();
    assert_eq!(sequences.len(), all.len(), "no change read twice");
    // Per item, the changes in the order they were made.
    let mut per_item: BTreeMap<String, Vec<(EventName, Option<u32>)>> = BTreeMap::new();
    for (_, key, event, version) in &all {
        per_item
            .entry(key.clone())
            .or_default()
            .push((*event, *version));
    }
    let key = |i: usize| format!(r#"{{"pk":{{"S":"item-{i}"}}}}"#);
    use EventName::{Insert, Modify, Remove};
    let expected: BTreeMap<String, Vec<(EventName, Option<u32>)>> = [
        (
            key(0),
            vec![
                (Insert, Some(1)),
                (Modify, Some(2)),
                (Modify, Some(3)),
                (Remove, None),
            ],
        ),
        (
            key(1),
            vec![
                (Insert, Some(1)),
                (Modify, Some(2)),
                (Remove, None),
                (Insert, Some(3)),
            ],
        ),
        (key(2), vec![(Insert, Some(1)), (Modify, Some(2))]),
        (
            key(3),
            vec![(Insert, Some(1)), (Modify, Some(2)), (Remove, None)],
        ),
    ]
    .into_iter()
    .collect();
    assert_eq!(per_item, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_without_a_stream_is_a_typed_error() {
    let Some((aws, dynamodb)) = moto().await else {
        return;
    };
    let table = unique("plain");
    create_table(&dynamodb, &table, false).await;
    let streams = aws
        .table_streams()
        .expect("the AWS backend serves table streams");
    match streams.resolve_table_stream(&table).await {
        Err(KinesisError::NotFound(detail)) => {
            assert!(detail.to_string().contains(&table), "{detail}")
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    // The consumer stops with it at start, naming the table.
    let run = consumer(&aws, &table, &unique("cdc")).run(Seen::default().handler());
    let result = tokio::time::timeout(TEST_TIMEOUT, run.into_future())
        .await
        .expect("the consumer stops");
    assert!(
        matches!(
            result,
            Err(ConsumerError::Kinesis(KinesisError::NotFound(_)))
        ),
        "{result:?}"
    );
}

/// DynamoDB Streams (and DynamoDB) talking to a scripted endpoint, with the SDK's own
/// retries off so every error surfaces. No emulator needed: these show what moto cannot
/// (paging, the service's errors).
fn streams_at(fake: &testkit::fake_endpoint::Fake) -> shardflow::dynamodb_streams::AwsTableStreams {
    use aws_sdk_dynamodbstreams::config::{
        retry::RetryConfig, BehaviorVersion, Credentials, Region,
    };
    let streams = aws_sdk_dynamodbstreams::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
        .endpoint_url(&fake.url)
        .retry_config(RetryConfig::disabled())
        .build();
    let dynamodb = aws_sdk_dynamodb::Config::builder()
        .behavior_version(aws_sdk_dynamodb::config::BehaviorVersion::latest())
        .region(aws_sdk_dynamodb::config::Region::new("us-east-1"))
        .credentials_provider(aws_sdk_dynamodb::config::Credentials::new(
            "test", "test", None, None, "test",
        ))
        .endpoint_url(&fake.url)
        .build();
    shardflow::dynamodb_streams::AwsTableStreams::new(
        aws_sdk_dynamodbstreams::Client::from_conf(streams),
        aws_sdk_dynamodb::Client::from_conf(dynamodb),
    )
}

const WIRE_ARN: &str =
    "arn:aws:dynamodb:us-east-1:123456789012:table/orders/stream/2026-01-01T00:00:00.000";

fn error(code: &str, message: &str) -> (u16, serde_json::Value) {
    (
        400,
        serde_json::json!({
            "__type": format!("com.amazonaws.dynamodb.v20120810#{code}"),
            "message": message,
        }),
    )
}

#[tokio::test]
async fn wire_describe_stream_pages_by_exclusive_start_shard_id() {
    use shardflow::kinesis::KinesisApi;
    let fake = testkit::fake_endpoint::Fake::start(vec![
        (
            200,
            serde_json::json!({"StreamDescription": {
                "StreamArn": WIRE_ARN,
                "Shards": [{
                    "ShardId": "shardId-0001",
                    "SequenceNumberRange": {"StartingSequenceNumber": "100", "EndingSequenceNumber": "199"},
                }],
                "LastEvaluatedShardId": "shardId-0001",
            }}),
        ),
        (
            200,
            serde_json::json!({"StreamDescription": {
                "StreamArn": WIRE_ARN,
                "Shards": [{
                    "ShardId": "shardId-0002",
                    "ParentShardId": "shardId-0001",
                    "SequenceNumberRange": {"StartingSequenceNumber": "200"},
                }],
            }}),
        ),
    ]);
    let shards = streams_at(&fake).list_shards(WIRE_ARN).await.unwrap();
    let ids: Vec<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
    assert_eq!(ids, ["shardId-0001", "shardId-0002"]);
    assert!(shards[0].is_closed() && !shards[1].is_closed());
    assert_eq!(shards[1].parents(), ["shardId-0001"]);
    assert!(shards
        .iter()
        .all(|s| (s.starting_hash_key, s.ending_hash_key) == (0, u128::MAX)));
    let seen = fake.seen();
    assert_eq!(fake.ops(), ["DescribeStream", "DescribeStream"]);
    assert_eq!(seen[0].body["StreamArn"], WIRE_ARN);
    assert!(seen[0].body.get("ExclusiveStartShardId").is_none());
    assert_eq!(seen[1].body["ExclusiveStartShardId"], "shardId-0001");
}

#[tokio::test]
async fn wire_records_errors_and_trimmed_positions() {
    use shardflow::kinesis::{KinesisApi, StartingPosition};
    let fake = testkit::fake_endpoint::Fake::start(vec![
        // AFTER a sequence number past the retention: read from the horizon instead.
        error("TrimmedDataAccessException", "trimmed"),
        (200, serde_json::json!({"ShardIterator": "it-1"})),
        // A read of at most 1,000 records, mapped to a change record.
        (
            200,
            serde_json::json!({
                "Records": [{
                    "eventID": "e1",
                    "eventName": "INSERT",
                    "eventSource": "aws:dynamodb",
                    "dynamodb": {
                        "ApproximateCreationDateTime": 1_700_000_000,
                        "Keys": {"pk": {"S": "order-7"}},
                        "NewImage": {"pk": {"S": "order-7"}, "blob": {"B": "AAH/"}},
                        "SequenceNumber": "300",
                        "SizeBytes": 20,
                        "StreamViewType": "NEW_IMAGE",
                    },
                }],
                "NextShardIterator": "it-2",
            }),
        ),
        error("ExpiredIteratorException", "expired"),
        error("TrimmedDataAccessException", "trimmed"),
        error("LimitExceededException", "slow down"),
        error("ResourceNotFoundException", "no such stream"),
    ]);
    let streams = streams_at(&fake);
    let after = StartingPosition::AfterSequenceNumber("150".parse().unwrap());
    assert_eq!(
        streams
            .shard_iterator(WIRE_ARN, "shardId-0002", &after)
            .await
            .unwrap(),
        "it-1"
    );
    let page = streams.get_records("it-1", 10_000).await.unwrap();
    assert_eq!(page.next_iterator.as_deref(), Some("it-2"));
    assert_eq!(page.records.len(), 1);
    let record = &page.records[0];
    assert_eq!(record.partition_key, r#"{"pk":{"S":"order-7"}}"#);
    assert_eq!(record.sequence_number.as_str(), "300");
    let change = ChangeRecord::from_payload(&record.data).unwrap();
    assert_eq!(change.event_name, EventName::Insert);
    assert_eq!(
        change.dynamodb.new_image.unwrap()["blob"],
        shardflow::dynamodb_streams::AttributeValue::B(vec![0, 1, 255])
    );
    let read = |_: ()| streams.get_records("it-2", 100);
    assert!(matches!(
        read(()).await,
        Err(KinesisError::ExpiredIterator(_))
    ));
    assert!(matches!(
        read(()).await,
        Err(KinesisError::ExpiredIterator(_))
    ));
    assert!(matches!(read(()).await, Err(KinesisError::Throttled(_))));
    assert!(matches!(read(()).await, Err(KinesisError::NotFound(_))));

    let seen = fake.seen();
    assert_eq!(seen[0].body["ShardIteratorType"], "AFTER_SEQUENCE_NUMBER");
    // Sent back with the 21 digits DynamoDB Streams requires at least.
    assert_eq!(seen[0].body["SequenceNumber"], "000000000000000000150");
    assert_eq!(seen[1].body["ShardIteratorType"], "TRIM_HORIZON");
    assert_eq!(
        seen[2].body["Limit"], 1000,
        "GetRecords asks for at most 1,000"
    );
}
