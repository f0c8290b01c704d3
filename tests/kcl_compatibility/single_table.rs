//! A KCL 3.5 application in the single-table format (its leader lock, worker metrics,
//! stream metadata and migration states in the lease table, tagged by `entityType`)
//! moves to shardflow in place and back, over real HTTP against the emulators
//! (`scripts/test.sh --test kcl_compatibility single_table`).
//!
//! The table is built from `tests/fixtures/kcl/kcl35_*.json`, the rows exactly as the
//! KCL 3.5 writes them, plus leases with checkpoints. shardflow handles exactly the
//! records after each checkpoint (0 lost, 0 re-read); once it stopped, the KCL's own
//! rows are byte for byte as they were and every lease reads as the KCL 3.5 reads it,
//! the rows shardflow created carrying `entityType = LEASE`. A table in the middle of a
//! KCL migration is refused with a typed error.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::IntoFuture;
use std::time::Duration;

use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType, TableStatus,
};
use shardflow::consumer::{ConsumerError, InitialPosition};
use shardflow::kinesis::ShardInfo;
use shardflow::lease::LeaseError;
use shardflow::Backend;
use testkit::*;

use super::migration::{assert_kcl_reads, read_shard};

const TEST_LIMIT: Duration = Duration::from_secs(600);

/// A row of `tests/fixtures/kcl/`.
fn fixture(name: &str) -> HashMap<String, AttributeValue> {
    testkit::kcl::kcl_fixture(name)
}

fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_owned())
}

/// Creates `table` as the KCL does (hash key `leaseKey`) and waits until it is ACTIVE.
async fn create_kcl_table(aws: &shardflow::Aws, table: &str) {
    aws.dynamodb_client()
        .create_table()
        .table_name(table)
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
    aws.lease_store(table).ensure_table().await.unwrap();
}

async fn put(aws: &shardflow::Aws, table: &str, rows: &[HashMap<String, AttributeValue>]) {
    for row in rows {
        aws.dynamodb_client()
            .put_item()
            .table_name(table)
            .set_item(Some(row.clone()))
            .send()
            .await
            .unwrap();
    }
}

/// Every row of `table` by `leaseKey`.
async fn scan(
    aws: &shardflow::Aws,
    table: &str,
) -> BTreeMap<String, HashMap<String, AttributeValue>> {
    aws.dynamodb_client()
        .scan()
        .table_name(table)
        .consistent_read(true)
        .send()
        .await
        .unwrap()
        .items
        .unwrap_or_default()
        .into_iter()
        .map(|i| {
            let Some(AttributeValue::S(k)) = i.get("leaseKey") else {
                panic!("{i:?}")
            };
            (k.clone(), i)
        })
        .collect()
}

/// The KCL 3.5's own rows of a single-stream application reading `stream`: its leader
/// lock, two workers' metrics, its stream metadata and both migration states, done.
fn kcl_entities(stream: &str) -> Vec<HashMap<String, AttributeValue>> {
    let metrics = fixture("kcl35_worker_metrics.json");
    let mut other_worker = metrics.clone();
    other_worker.insert("leaseKey".into(), s("worker-1"));
    let mut stream_info = fixture("kcl35_stream.json");
    // A single-stream application's stream identifier is the stream's name.
    stream_info.insert("leaseKey".into(), s(stream));
    vec![
        fixture("kcl35_leader.json"),
        metrics,
        other_worker,
        stream_info,
        fixture("kcl35_client_version_migration.json"),
        fixture("kcl35_table_migration_complete.json"),
    ]
}

/// The KCL 3.5's row for `shard` at `checkpoint`, as `toDynamoRecord` writes it.
fn kcl35_lease(shard: &ShardInfo, checkpoint: &str) -> HashMap<String, AttributeValue> {
    let mut row = fixture("kcl35_lease.json");
    row.insert("leaseKey".into(), s(&shard.shard_id));
    row.insert("checkpoint".into(), s(checkpoint));
    row.insert(
        "startingHashKey".into(),
        s(&shard.starting_hash_key.to_string()),
    );
    row.insert(
        "endingHashKey".into(),
        s(&shard.ending_hash_key.to_string()),
    );
    row
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kcl35_single_table_is_taken_over_and_read_back_as_the_kcl_reads_it() {
    if !emulators_enabled() {
        return;
    }
    within(TEST_LIMIT, "the KCL 3.5 single-table move", single_table()).await;
}

async fn single_table() {
    let aws = shardflow::Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let stream = unique("kcl35");
    let table = unique("kcl35-app");
    kinesis.create_stream(&stream, 3).await.unwrap();
    wait_until_active(kinesis.as_ref(), &stream).await;
    produce(kinesis.as_ref(), &stream, 0..300).await;
    let shards = open_shards(kinesis.as_ref(), &stream).await;
    assert_eq!(shards.len(), 3);
    create_kcl_table(&aws, &table).await;

    // The KCL's entities, and leases: the first a 3.5 LEASE row held by a stopped KCL
    // worker, the second a row an older KCL wrote (no entityType), released; the third
    // shard has no row yet (shardflow creates it from TRIM_HORIZON).
    let entities = kcl_entities(&stream);
    let mut expected: BTreeSet<usize> = BTreeSet::new();
    let mut leases = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let records = read_shard(kinesis.as_ref(), &stream, &shard.shard_id).await;
        assert!(
            records.len() >= 4,
            "{} has {}",
            shard.shard_id,
            records.len()
        );
        if i == 2 {
            expected.extend(records.iter().map(|(v, _)| *v));
            continue;
        }
        let middle = records.len() / 2;
        expected.extend(records[middle + 1..].iter().map(|(v, _)| *v));
        let mut row = kcl35_lease(shard, &records[middle].1);
        if i == 1 {
            row.remove("entityType");
            row.remove("leaseOwner");
            row.remove("throughputKBps");
        }
        assert_kcl_reads(&row);
        leases.push(row);
    }
    put(&aws, &table, &entities).await;
    put(&aws, &table, &leases).await;
    // As DynamoDB stores them (it writes a number in its own form: `14.0` reads `14`).
    let stored = scan(&aws, &table).await;

    // shardflow, pointed at the KCL application's table.
    let recorder = Recorder::default();
    let running = test_consumer(aws.clone(), &stream, &unique("billing"), "w1")
        .lease_table(&table)
        .initial_position(InitialPosition::TrimHorizon)
        .build()
        .unwrap()
        .run(recording_handler(recorder.clone()))
        .spawn();
    recorder
        .wait_for(expected.len(), Duration::from_secs(120))
        .await;
    let sentinels = produce_sentinels(kinesis.as_ref(), &stream, &shards, 1_000).await;
    recorder
        .wait_for_values(&sentinels, Duration::from_secs(120))
        .await;
    // The KCL's rows are no unreadable leases: the worker is ready.
    let health = running.health();
    assert!(health.unreadable_rows.is_empty(), "{health:?}");
    assert!(health.is_ready(), "{health:?}");
    within(STOP_LIMIT, "the consumer stops", running.shutdown())
        .await
        .unwrap();

    assert_each_once(&recorder, &expected, |v| v < 1_000);

    // The table as the KCL 3.5 reads it back.
    let rows = scan(&aws, &table).await;
    // Its own rows, byte for byte as they were stored.
    for entity in &entities {
        let Some(AttributeValue::S(key)) = entity.get("leaseKey") else {
            unreachable!()
        };
        assert_eq!(
            rows.get(key),
            stored.get(key),
            "the KCL's row {key} changed"
        );
        assert_eq!(rows[key].len(), entity.len(), "{key}: {:?}", rows[key]);
    }
    // Nothing else than its rows, one lease per shard and shardflow's leader row,
    // released, of an `entityType` the KCL 3.5 reads as no lease.
    assert_released_leader_row(&rows);
    assert_eq!(rows.len(), entities.len() + shards.len() + 1, "{rows:?}");
    for (i, shard) in shards.iter().enumerate() {
        let item = &rows[&shard.shard_id];
        assert_kcl_reads(item);
        let entity = item.get("entityType");
        match i {
            // The row an older KCL wrote stays without it (a lease to the KCL 3.5 too).
            1 => assert_eq!(entity, None, "{item:?}"),
            // A 3.5 row keeps it; the row shardflow created carries it.
            _ => assert_eq!(entity, Some(&s("LEASE")), "{item:?}"),
        }
        assert!(!item.contains_key("leaseOwner"), "released: {item:?}");
        let last = read_shard(kinesis.as_ref(), &stream, &shard.shard_id)
            .await
            .pop()
            .unwrap();
        assert_eq!(item["checkpoint"], s(&last.1), "{item:?}");
    }
    assert_eq!(
        rows[&shards[0].shard_id].get("throughputKBps"),
        Some(&AttributeValue::N("4.25".into()))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_in_the_middle_of_a_kcl_migration_is_refused() {
    if !emulators_enabled() {
        return;
    }
    within(TEST_LIMIT, "the refusal", refused()).await;
}

async fn refused() {
    let aws = shardflow::Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let stream = unique("kcl35-mid");
    kinesis.create_stream(&stream, 1).await.unwrap();
    wait_until_active(kinesis.as_ref(), &stream).await;
    produce(kinesis.as_ref(), &stream, 0..10).await;
    let shard = open_shards(kinesis.as_ref(), &stream).await.remove(0);
    // The migration's row in the lease table, or (the last case) in the KCL's
    // coordinator-state table, where a 3.4 to 3.5 migration keeps it until it completes
    // while the workers already write their metrics into the lease table.
    for (migration, in_lease_table, state) in [
        (
            "kcl35_client_version_upgrade_from_2x.json",
            true,
            "CLIENT_VERSION_UPGRADE_FROM_2X",
        ),
        (
            "kcl35_table_migration_pending.json",
            true,
            "TABLE_MIGRATION_STATUS_PENDING",
        ),
        (
            "kcl35_table_migration_pending.json",
            false,
            "TABLE_MIGRATION_STATUS_PENDING",
        ),
    ] {
        let table = unique("kcl35-mid-app");
        create_kcl_table(&aws, &table).await;
        let mut before = vec![kcl35_lease(&shard, "TRIM_HORIZON")];
        if in_lease_table {
            before.push(fixture(migration));
        } else {
            before.push(fixture("kcl35_worker_metrics.json"));
            let mut item = fixture(migration);
            let key = item.remove("leaseKey").unwrap();
            item.insert("key".into(), key);
            let legacy = format!("{table}-CoordinatorState");
            aws.dynamodb_client()
                .create_table()
                .table_name(&legacy)
                .attribute_definitions(
                    AttributeDefinition::builder()
                        .attribute_name("key")
                        .attribute_type(ScalarAttributeType::S)
                        .build()
                        .unwrap(),
                )
                .key_schema(
                    KeySchemaElement::builder()
                        .attribute_name("key")
                        .key_type(KeyType::Hash)
                        .build()
                        .unwrap(),
                )
                .billing_mode(BillingMode::PayPerRequest)
                .send()
                .await
                .unwrap();
            within(Duration::from_secs(60), "the table is active", async {
                while aws
                    .dynamodb_client()
                    .describe_table()
                    .table_name(&legacy)
                    .send()
                    .await
                    .unwrap()
                    .table
                    .and_then(|t| t.table_status)
                    != Some(TableStatus::Active)
                {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            })
            .await;
            put(&aws, &legacy, &[item]).await;
        }
        put(&aws, &table, &before).await;
        let stored = scan(&aws, &table).await;
        let recorder = Recorder::default();
        let consumer = test_consumer(aws.clone(), &stream, &unique("billing"), "w1")
            .lease_table(&table)
            .build()
            .unwrap();
        let result = within(
            Duration::from_secs(120),
            "the consumer refuses the table",
            consumer
                .run(recording_handler(recorder.clone()))
                .into_future(),
        )
        .await;
        match result {
            Err(ConsumerError::Lease(LeaseError::KclMigrationInProgress {
                table: t,
                state: s,
                ..
            })) => {
                assert_eq!(t, table);
                assert_eq!(s, state);
            }
            other => panic!("expected KclMigrationInProgress, got {other:?}"),
        }
        assert_eq!(recorder.count(), 0, "nothing handled");
        // Nothing written: the table is as the KCL left it.
        assert_eq!(scan(&aws, &table).await, stored);
        assert_eq!(stored.len(), before.len());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kcl35_multi_stream_single_table_is_taken_over_in_place() {
    if !emulators_enabled() {
        return;
    }
    within(TEST_LIMIT, "the KCL 3.5 multi-stream move", multi_stream()).await;
}

/// A multi-stream KCL 3.5 application: its stream metadata rows are keyed by the
/// stream identifiers (`account:stream:creationEpoch`), the prefix of the leases' keys.
async fn multi_stream() {
    let aws = shardflow::Aws::from_env().await;
    let kinesis = aws.admin().unwrap();
    let (orders, refunds) = (unique("kcl35-orders"), unique("kcl35-refunds"));
    let table = unique("kcl35-multi-app");
    let mut expected: BTreeSet<usize> = BTreeSet::new();
    let mut leases = Vec::new();
    let mut entities = vec![
        fixture("kcl35_leader.json"),
        fixture("kcl35_worker_metrics.json"),
        fixture("kcl35_client_version_migration.json"),
        fixture("kcl35_table_migration_complete.json"),
    ];
    let mut shards = Vec::new();
    for (stream, base) in [(&orders, 0), (&refunds, 1_000)] {
        kinesis.create_stream(stream, 1).await.unwrap();
        wait_until_active(kinesis.as_ref(), stream).await;
        produce(kinesis.as_ref(), stream, base..base + 100).await;
        let identity = kinesis.stream_identity(stream).await.unwrap();
        let shard = open_shards(kinesis.as_ref(), stream).await.remove(0);
        let records = read_shard(kinesis.as_ref(), stream, &shard.shard_id).await;
        let middle = records.len() / 2;
        expected.extend(records[middle + 1..].iter().map(|(v, _)| *v));
        let mut row = fixture("kcl35_multi_stream_lease.json");
        row.insert("leaseKey".into(), s(&identity.lease_key(&shard.shard_id)));
        row.insert("streamName".into(), s(&identity.to_string()));
        row.insert("shardId".into(), s(&shard.shard_id));
        row.insert("checkpoint".into(), s(&records[middle].1));
        row.remove("parentShardId");
        row.insert(
            "startingHashKey".into(),
            s(&shard.starting_hash_key.to_string()),
        );
        row.insert(
            "endingHashKey".into(),
            s(&shard.ending_hash_key.to_string()),
        );
        assert_kcl_reads(&row);
        leases.push(row);
        let mut info = fixture("kcl35_stream.json");
        info.insert("leaseKey".into(), s(&identity.to_string()));
        entities.push(info);
        shards.push((stream.clone(), identity, shard));
    }
    create_kcl_table(&aws, &table).await;
    put(&aws, &table, &entities).await;
    put(&aws, &table, &leases).await;
    let stored = scan(&aws, &table).await;

    let recorder = Recorder::default();
    let running = test_timings(
        shardflow::Consumer::builder()
            .streams([orders.as_str(), refunds.as_str()])
            .group(unique("billing"))
            .worker_id("w1")
            .lease_table(&table)
            .backend(aws.clone()),
    )
    .build()
    .unwrap()
    .run(recording_handler(recorder.clone()))
    .spawn();
    recorder
        .wait_for(expected.len(), Duration::from_secs(120))
        .await;
    let health = running.health();
    assert!(health.unreadable_rows.is_empty(), "{health:?}");
    assert!(health.failed_streams.is_empty(), "{health:?}");
    within(STOP_LIMIT, "the consumer stops", running.shutdown())
        .await
        .unwrap();
    assert_each_once(&recorder, &expected, |_| true);

    let rows = scan(&aws, &table).await;
    assert_released_leader_row(&rows);
    assert_eq!(rows.len(), stored.len() + 1, "{rows:?}");
    for entity in &entities {
        let Some(AttributeValue::S(key)) = entity.get("leaseKey") else {
            unreachable!()
        };
        assert_eq!(
            rows.get(key),
            stored.get(key),
            "the KCL's row {key} changed"
        );
    }
    for (stream, identity, shard) in &shards {
        let item = &rows[&identity.lease_key(&shard.shard_id)];
        assert_kcl_reads(item);
        assert_eq!(item.get("entityType"), Some(&s("LEASE")), "{item:?}");
        assert_eq!(item.get("streamName"), Some(&s(&identity.to_string())));
        let last = read_shard(kinesis.as_ref(), stream, &shard.shard_id)
            .await
            .pop()
            .unwrap();
        assert_eq!(item["checkpoint"], s(&last.1), "{item:?}");
    }
}

/// Shardflow's leader row in a single-table table: marked as no lease (the KCL 3.5
/// skips rows of an `entityType` other than `LEASE`) and released once the fleet
/// stopped.
fn assert_released_leader_row(rows: &BTreeMap<String, HashMap<String, AttributeValue>>) {
    let leader = rows
        .get(shardflow::lease::dynamo::LEADER_ROW_KEY)
        .unwrap_or_else(|| panic!("no leader row: {rows:?}"));
    assert_eq!(
        leader.get(shardflow::lease::entity::ENTITY_TYPE),
        Some(&AttributeValue::S(
            shardflow::lease::dynamo::LEADER_ENTITY_TYPE.to_owned()
        ))
    );
    assert!(!leader.contains_key("leaderOwner"), "{leader:?}");
}

/// Every record of `expected` handled once, none lost, none re-read (the values `counted`
/// keeps: the sentinels written to see the end are left out).
fn assert_each_once(
    recorder: &Recorder,
    expected: &BTreeSet<usize>,
    counted: impl Fn(usize) -> bool,
) {
    let mut seen: BTreeMap<usize, usize> = BTreeMap::new();
    for h in recorder.snapshot() {
        *seen.entry(h.value).or_default() += 1;
    }
    let handled: BTreeSet<usize> = seen.keys().copied().filter(|v| counted(*v)).collect();
    let lost: Vec<&usize> = expected.difference(&handled).collect();
    let re_read: Vec<&usize> = handled.difference(expected).collect();
    let twice: Vec<&usize> = seen
        .iter()
        .filter(|(_, c)| **c > 1)
        .map(|(v, _)| v)
        .collect();
    assert!(lost.is_empty(), "lost {} records: {lost:?}", lost.len());
    assert!(
        re_read.is_empty(),
        "re-read {} records: {re_read:?}",
        re_read.len()
    );
    assert!(twice.is_empty(), "delivered twice: {twice:?}");
}
