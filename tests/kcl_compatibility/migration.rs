//! Moving a KCL application to shardflow in place, over real HTTP against the emulators
//! (`scripts/test.sh --test kcl_compatibility`; skipped when `SHARDFLOW_EMULATORS` is unset).
//!
//! A lease table exactly as a stopped KCL fleet leaves it (2.x and 3.x attributes, one
//! parent at SHARD_END with open children, checkpoints in the middle of every other
//! shard, a pending checkpoint, a KCL 3 hand-off in progress) is taken over by a
//! shardflow consumer pointed at it with `.lease_table(..)`: it handles exactly the
//! records after each checkpoint (0 lost, 0 re-read). The rows it leaves behind still
//! read as the KCL reads them (names and types), so the application can move back.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType,
};
use shardflow::kinesis::{KinesisApi, ShardInfo, StartingPosition};
use shardflow::Backend;
use testkit::*;

const TEST_LIMIT: Duration = Duration::from_secs(600);

/// Every record of a shard, in order: (value, sequence number).
pub(super) async fn read_shard(
    kinesis: &dyn KinesisApi,
    stream: &str,
    shard: &str,
) -> Vec<(usize, String)> {
    let mut iterator = Some(
        kinesis
            .shard_iterator(stream, shard, &StartingPosition::TrimHorizon)
            .await
            .unwrap(),
    );
    let mut records = Vec::new();
    let mut empty = 0;
    while let Some(it) = iterator.take() {
        let page = kinesis.get_records(&it, 1000).await.unwrap();
        if page.records.is_empty() {
            empty += 1;
            if empty >= 3 {
                break;
            }
        }
        for r in page.records {
            let value = std::str::from_utf8(&r.data).unwrap().parse().unwrap();
            records.push((value, r.sequence_number.as_str().to_owned()));
        }
        iterator = page.next_iterator;
    }
    records
}

fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_owned())
}
fn n(v: &str) -> AttributeValue {
    AttributeValue::N(v.to_owned())
}
fn ss(v: &[&str]) -> AttributeValue {
    AttributeValue::Ss(v.iter().map(|x| x.to_string()).collect())
}

/// The KCL's row for `shard`: what `DynamoDBLeaseSerializer.toDynamoRecord` writes.
fn kcl_row(shard: &ShardInfo, checkpoint: &str) -> HashMap<String, AttributeValue> {
    let mut row = HashMap::from([
        ("leaseKey".to_owned(), s(&shard.shard_id)),
        ("leaseCounter".to_owned(), n("1841")),
        ("ownerSwitchesSinceCheckpoint".to_owned(), n("0")),
        ("checkpoint".to_owned(), s(checkpoint)),
        ("checkpointSubSequenceNumber".to_owned(), n("0")),
        (
            "startingHashKey".to_owned(),
            s(&shard.starting_hash_key.to_string()),
        ),
        (
            "endingHashKey".to_owned(),
            s(&shard.ending_hash_key.to_string()),
        ),
    ]);
    let parents = shard.parents();
    if !parents.is_empty() {
        let parents: Vec<&str> = parents.iter().map(String::as_str).collect();
        row.insert("parentShardId".to_owned(), ss(&parents));
    }
    row
}

/// Checks `item` the way the KCL's `fromDynamoRecord` reads it.
pub(super) fn assert_kcl_reads(item: &HashMap<String, AttributeValue>) {
    let what = format!("{item:?}");
    for required in [
        "leaseKey",
        "leaseCounter",
        "ownerSwitchesSinceCheckpoint",
        "checkpoint",
        "checkpointSubSequenceNumber",
    ] {
        assert!(item.contains_key(required), "{required} missing: {what}");
    }
    for (name, value) in item {
        let ok = match name.as_str() {
            "leaseKey" | "leaseOwner" | "checkpoint" | "pendingCheckpoint" | "startingHashKey"
            | "endingHashKey" | "checkpointOwner" | "streamName" | "pendingOwner" | "shardId" => {
                matches!(value, AttributeValue::S(_))
            }
            "leaseCounter"
            | "ownerSwitchesSinceCheckpoint"
            | "checkpointSubSequenceNumber"
            | "pendingCheckpointSubSequenceNumber"
            | "checkpointTimestamp"
            | "checkpointedAt"
            | "throughputKBps" => {
                matches!(value, AttributeValue::N(v) if v.parse::<f64>().is_ok())
            }
            "parentShardId" | "childShardIds" => matches!(value, AttributeValue::Ss(_)),
            // KCL 3.5: only `LEASE` rows (or rows without it) are leases.
            "entityType" => matches!(value, AttributeValue::S(e) if e == "LEASE"),
            "pendingCheckpointState" => {
                matches!(value, AttributeValue::B(_) | AttributeValue::N(_))
            }
            other => panic!("unknown attribute {other}: {what}"),
        };
        assert!(ok, "{name} has the wrong type: {what}");
    }
    let Some(AttributeValue::S(checkpoint)) = item.get("checkpoint") else {
        panic!("no checkpoint: {what}");
    };
    assert!(
        ["TRIM_HORIZON", "LATEST", "SHARD_END", "AT_TIMESTAMP"].contains(&checkpoint.as_str())
            || checkpoint.bytes().all(|b| b.is_ascii_digit()),
        "{what}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kcl_table_is_taken_over_with_nothing_lost_or_re_read() {
    if !emulators_enabled() {
        return;
    }
    within(TEST_LIMIT, "the KCL migration", migration()).await;
}

async fn migration() {
    let aws = shardflow::Aws::from_env().await;
    let dynamo = aws.dynamodb_client().clone();
    let kinesis = aws.admin().unwrap();
    let stream = unique("kcl");
    let table = unique("kcl-app");

    // A stream with a history: two shards, the first split, records before and after.
    kinesis.create_stream(&stream, 2).await.unwrap();
    wait_until_active(kinesis.as_ref(), &stream).await;
    produce(kinesis.as_ref(), &stream, 0..200).await;
    let first = open_shards(kinesis.as_ref(), &stream).await;
    let parent = first[0].clone();
    kinesis
        .split_shard(
            &stream,
            &parent.shard_id,
            parent.starting_hash_key + (parent.ending_hash_key - parent.starting_hash_key) / 2,
        )
        .await
        .unwrap();
    wait_until_active(kinesis.as_ref(), &stream).await;
    produce(kinesis.as_ref(), &stream, 200..400).await;
    let open = open_shards(kinesis.as_ref(), &stream).await;
    assert_eq!(open.len(), 3, "{open:?}");
    let other = open
        .iter()
        .find(|s| s.parents().is_empty())
        .unwrap()
        .clone();
    let children: Vec<ShardInfo> = open
        .iter()
        .filter(|s| s.parents() == vec![parent.shard_id.clone()])
        .cloned()
        .collect();
    assert_eq!(children.len(), 2);

    // The KCL's table: the parent consumed to its end, the others checkpointed halfway.
    dynamo
        .create_table()
        .table_name(&table)
        .attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name("leaseKey")
                .attribute_type(ScalarAttributeType::S)
                .build()
                .unwrap(),
        )
        .key_schema(
            KeySchemaElement::builder()
                .attribute_name("leaseKey")
                .key_type(KeyType::Hash)
                .build()
                .unwrap(),
        )
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await
        .unwrap();
    // Waits until the table is ACTIVE (it exists, so it is not created again).
    aws.lease_store(&table).ensure_table().await.unwrap();
    let mut expected: BTreeSet<usize> = BTreeSet::new();
    let mut rows = Vec::new();
    let mut parent_row = kcl_row(&parent, "SHARD_END");
    let child_ids: Vec<&str> = children.iter().map(|c| c.shard_id.as_str()).collect();
    parent_row.insert("childShardIds".into(), ss(&child_ids));
    rows.push(parent_row);
    for (i, shard) in std::iter::once(&other).chain(&children).enumerate() {
        let records = read_shard(kinesis.as_ref(), &stream, &shard.shard_id).await;
        assert!(
            records.len() >= 4,
            "{} has {} records",
            shard.shard_id,
            records.len()
        );
        let middle = records.len() / 2;
        expected.extend(records[middle + 1..].iter().map(|(v, _)| *v));
        let mut row = kcl_row(shard, &records[middle].1);
        match i {
            // A dead KCL 2 worker with a prepared, uncommitted checkpoint: ignored.
            0 => {
                row.insert("leaseOwner".into(), s("kcl-worker-1"));
                row.insert("ownerSwitchesSinceCheckpoint".into(), n("2"));
                row.insert("pendingCheckpoint".into(), s(&records[middle + 1].1));
                row.insert("pendingCheckpointSubSequenceNumber".into(), n("0"));
                row.insert(
                    "pendingCheckpointState".into(),
                    AttributeValue::B(aws_sdk_dynamodb::primitives::Blob::new(b"state".to_vec())),
                );
            }
            // Released by the KCL on shutdown.
            1 => {}
            // A KCL 3 hand-off from kcl-worker-1 to kcl-worker-2, both stopped.
            _ => {
                row.insert("leaseOwner".into(), s("kcl-worker-2"));
                row.insert("checkpointOwner".into(), s("kcl-worker-1"));
                row.insert("throughputKBps".into(), n("3.5"));
            }
        }
        rows.push(row);
    }
    for row in &rows {
        assert_kcl_reads(row);
        dynamo
            .put_item()
            .table_name(&table)
            .set_item(Some(row.clone()))
            .send()
            .await
            .unwrap();
    }

    // shardflow, pointed at the KCL application's table.
    let recorder = Recorder::default();
    let group = unique("billing");
    let running = start(
        test_consumer(aws.clone(), &stream, &group, "w1")
            .lease_table(&table)
            .build()
            .unwrap(),
        &recorder,
    );
    recorder
        .wait_for(expected.len(), Duration::from_secs(120))
        .await;
    // Nothing re-read: the sentinels come after anything a shard would deliver twice.
    let readable: Vec<ShardInfo> = std::iter::once(other.clone()).chain(children).collect();
    let sentinels = produce_sentinels(kinesis.as_ref(), &stream, &readable, 1_000).await;
    recorder
        .wait_for_values(&sentinels, Duration::from_secs(120))
        .await;
    running.stop().await;

    let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
    for h in recorder.snapshot() {
        *seen.entry(h.value).or_default() += 1;
    }
    let duplicates: Vec<usize> = seen
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(v, _)| *v)
        .collect();
    let handled: BTreeSet<usize> = seen.keys().copied().filter(|v| *v < 1_000).collect();
    let lost: Vec<&usize> = expected.difference(&handled).collect();
    let re_read: Vec<&usize> = handled.difference(&expected).collect();
    assert!(lost.is_empty(), "lost {} records: {lost:?}", lost.len());
    assert!(
        re_read.is_empty(),
        "re-read {} records: {re_read:?}",
        re_read.len()
    );
    assert!(duplicates.is_empty(), "delivered twice: {duplicates:?}");

    // What shardflow leaves behind still reads as the KCL reads it.
    let items = dynamo
        .scan()
        .table_name(&table)
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .items
        .unwrap_or_default();
    let by_key: BTreeMap<String, HashMap<String, AttributeValue>> = items
        .into_iter()
        .map(|i| {
            let Some(AttributeValue::S(k)) = i.get("leaseKey") else {
                panic!("{i:?}")
            };
            (k.clone(), i)
        })
        .collect();
    for item in by_key.values() {
        assert_kcl_reads(item);
        assert!(
            !item.contains_key("leaseOwner"),
            "released on shutdown: {item:?}"
        );
        assert!(!item.contains_key("checkpointOwner"), "{item:?}");
        assert!(!item.contains_key("pendingCheckpoint"), "{item:?}");
    }
    for shard in &readable {
        let item = &by_key[&shard.shard_id];
        let last = read_shard(kinesis.as_ref(), &stream, &shard.shard_id)
            .await
            .pop()
            .unwrap();
        assert_eq!(item["checkpoint"], s(&last.1), "{item:?}");
        assert_eq!(item["ownerSwitchesSinceCheckpoint"], n("0"), "{item:?}");
        // Claimed for the stream: a consumer of another stream is refused from now on.
        assert_eq!(item.get("streamName"), Some(&s(&stream)), "{item:?}");
        assert_eq!(
            item["startingHashKey"],
            s(&shard.starting_hash_key.to_string())
        );
    }
    // An attribute shardflow does not use is kept.
    assert_eq!(
        by_key[&readable[2].shard_id].get("throughputKBps"),
        Some(&n("3.5"))
    );
    // The finished parent is kept as the KCL left it while the shard is listed.
    assert_eq!(by_key[&parent.shard_id]["checkpoint"], s("SHARD_END"));
}
