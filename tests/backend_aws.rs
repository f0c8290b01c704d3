//! The AWS backend over real HTTP: [`AwsKinesis`](shardflow::kinesis::aws::AwsKinesis)
//! against kinesalite and [`DynamoLeaseStore`](shardflow::lease::dynamo::DynamoLeaseStore)
//! against dynalite.
//!
//! `scripts/test.sh` starts the emulators and sets `SHARDFLOW_EMULATORS=1` and the
//! `AWS_ENDPOINT_URL_*` variables; without `SHARDFLOW_EMULATORS` every emulator test here
//! returns at once, so a plain `cargo test` passes on a machine without emulators.
//!
//! The `wire_*` tests need no emulator: they talk to a scripted fake endpoint (module
//! `fake`) to prove what kinesalite cannot show — ListShards paging, ChildShards,
//! partial PutRecords failures, throttling and HTTP 500 answers.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, Record, StartingPosition,
};
use shardflow::lease::{Checkpoint, Lease, LeaseError, LeaseStore};
use shardflow::{Aws, Backend, Position, SequenceNumber};
use testkit::unique;

/// No single test may take longer than this (an emulator that hangs fails the test).
const TEST_TIMEOUT: Duration = Duration::from_secs(120);

/// The clients, or `None` (after saying so) when the emulators are not running.
async fn aws() -> Option<Aws> {
    if !testkit::emulators_enabled() {
        return None;
    }
    Some(Aws::from_env().await)
}

/// Runs a test body under [`TEST_TIMEOUT`].
async fn within<F: Future<Output = ()>>(body: F) {
    tokio::time::timeout(TEST_TIMEOUT, body)
        .await
        .expect("the test did not finish in time");
}

fn put(partition_key: &str, data: impl Into<Bytes>) -> PutRecord {
    PutRecord {
        data: data.into(),
        partition_key: partition_key.to_owned(),
        explicit_hash_key: None,
    }
}

/// Writes `records`, asserting every one was stored; returns (shard, sequence) per record.
async fn put_all(
    kinesis: &Arc<dyn KinesisApi>,
    stream: &str,
    records: &[PutRecord],
) -> Vec<(String, SequenceNumber)> {
    let outcomes = kinesis
        .put_records(stream, records)
        .await
        .expect("PutRecords");
    assert_eq!(outcomes.len(), records.len(), "one outcome per record");
    outcomes
        .into_iter()
        .map(|outcome| match outcome {
            PutOutcome::Stored {
                shard_id,
                sequence_number,
            } => (shard_id, sequence_number),
            PutOutcome::Failed { code, message } => panic!("record refused: {code}: {message}"),
        })
        .collect()
}

/// Reads a shard from `from` until `want` records arrived or the shard ended, asserting
/// no read goes backwards. Also returns whether the shard's end was reached.
async fn read(
    kinesis: &Arc<dyn KinesisApi>,
    stream: &str,
    shard: &str,
    from: StartingPosition,
    want: usize,
) -> (Vec<Record>, bool) {
    let mut iterator = kinesis
        .shard_iterator(stream, shard, &from)
        .await
        .expect("GetShardIterator");
    let mut records: Vec<Record> = Vec::new();
    // Emulators answer at once; a few empty reads at the tip end the loop.
    let mut empty_reads = 0;
    while records.len() < want && empty_reads < 3 {
        let page = kinesis
            .get_records(&iterator, 10_000)
            .await
            .expect("GetRecords");
        if page.records.is_empty() {
            empty_reads += 1;
        }
        records.extend(page.records);
        match page.next_iterator {
            Some(next) => iterator = next,
            None => return (records, true),
        }
    }
    (records, false)
}

#[tokio::test]
async fn list_shards_returns_open_shards_covering_the_hash_space() {
    let Some(aws) = aws().await else { return };
    within(async {
        let kinesis = aws.kinesis();
        let admin = aws.admin().unwrap();
        let stream = unique("list");
        admin.create_stream(&stream, 4).await.expect("CreateStream");
        // Creating an existing stream is not an error.
        admin
            .create_stream(&stream, 4)
            .await
            .expect("CreateStream again");
        assert!(!kinesis
            .is_updating(&stream)
            .await
            .expect("DescribeStreamSummary"));

        let mut shards = kinesis.list_shards(&stream).await.expect("ListShards");
        assert_eq!(shards.len(), 4, "{shards:?}");
        shards.sort_by_key(|s| s.starting_hash_key);
        assert_eq!(shards[0].starting_hash_key, 0);
        assert_eq!(shards[3].ending_hash_key, u128::MAX);
        for pair in shards.windows(2) {
            assert_eq!(
                pair[0].ending_hash_key.checked_add(1),
                Some(pair[1].starting_hash_key),
                "shards must tile the hash space: {pair:?}"
            );
        }
        for shard in &shards {
            assert!(!shard.is_closed(), "{shard:?}");
            assert!(shard.parents().is_empty(), "{shard:?}");
            assert!(shard.starting_hash_key <= shard.ending_hash_key);
        }
    })
    .await;
}

#[tokio::test]
async fn records_come_back_in_order_per_shard_with_keys_and_data() {
    let Some(aws) = aws().await else { return };
    within(async {
        let kinesis = aws.kinesis();
        let admin = aws.admin().unwrap();
        let stream = unique("order");
        admin.create_stream(&stream, 4).await.expect("CreateStream");

        let records: Vec<PutRecord> = (0..500)
            .map(|i| put(&format!("key-{}", i % 37), format!("payload {i}")))
            .collect();
        let stored = put_all(&kinesis, &stream, &records).await;

        // What each shard must hold, in sequence order.
        let mut expected: BTreeMap<String, Vec<(SequenceNumber, String, Bytes)>> = BTreeMap::new();
        for ((shard, sequence), record) in stored.iter().zip(&records) {
            expected.entry(shard.clone()).or_default().push((
                sequence.clone(),
                record.partition_key.clone(),
                record.data.clone(),
            ));
        }
        for rows in expected.values_mut() {
            rows.sort_by(|a, b| a.0.cmp(&b.0));
        }
        assert!(
            expected.len() > 1,
            "500 records over 37 keys use several shards"
        );

        // Records of one partition key stay in the order they were put.
        let mut last_per_key: HashMap<&str, &SequenceNumber> = HashMap::new();
        for ((_, sequence), record) in stored.iter().zip(&records) {
            if let Some(previous) = last_per_key.insert(&record.partition_key, sequence) {
                assert!(previous < sequence, "per-key order of PutRecords");
            }
        }

        let mut total = 0;
        for (shard, rows) in &expected {
            let (got, _) = read(
                &kinesis,
                &stream,
                shard,
                StartingPosition::TrimHorizon,
                rows.len(),
            )
            .await;
            let got: Vec<(SequenceNumber, String, Bytes)> = got
                .iter()
                .map(|r| {
                    (
                        r.sequence_number.clone(),
                        r.partition_key.clone(),
                        r.data.clone(),
                    )
                })
                .collect();
            assert_eq!(&got, rows, "shard {shard}");
            total += got.len();
        }
        assert_eq!(total, 500);
    })
    .await;
}

#[tokio::test]
async fn every_starting_position_starts_where_it_says() {
    let Some(aws) = aws().await else { return };
    within(async {
        let kinesis = aws.kinesis();
        let admin = aws.admin().unwrap();
        let stream = unique("positions");
        admin.create_stream(&stream, 1).await.expect("CreateStream");
        let before = SystemTime::now() - Duration::from_secs(60);
        let records: Vec<PutRecord> = (0..10).map(|i| put("k", format!("r{i}"))).collect();
        let stored = put_all(&kinesis, &stream, &records).await;
        let shard = stored[0].0.clone();
        let fourth = stored[3].1.clone();
        let data = |rs: &[Record]| rs.iter().map(|r| r.data.clone()).collect::<Vec<_>>();

        let (got, _) = read(
            &kinesis,
            &stream,
            &shard,
            StartingPosition::AfterSequenceNumber(fourth.clone()),
            6,
        )
        .await;
        assert_eq!(
            data(&got),
            data_of(&records[4..]),
            "AFTER_SEQUENCE_NUMBER starts after the record"
        );

        let (got, _) = read(
            &kinesis,
            &stream,
            &shard,
            StartingPosition::AtSequenceNumber(fourth),
            7,
        )
        .await;
        assert_eq!(
            data(&got),
            data_of(&records[3..]),
            "AT_SEQUENCE_NUMBER starts at the record"
        );

        let (got, _) = read(
            &kinesis,
            &stream,
            &shard,
            StartingPosition::AtTimestamp(before),
            10,
        )
        .await;
        assert_eq!(
            data(&got),
            data_of(&records),
            "AT_TIMESTAMP before the first record"
        );
        assert!(got.iter().all(|r| r.approximate_arrival.is_some()));

        // An AT_TIMESTAMP later than the service's clock is refused (so LATEST's start,
        // which a worker's clock guesses, can be confirmed); the same call works later.
        let ahead = SystemTime::now() + Duration::from_secs(60);
        let refused = kinesis
            .shard_iterator(&stream, &shard, &StartingPosition::AtTimestamp(ahead))
            .await
            .expect_err("GetShardIterator AT_TIMESTAMP a minute ahead");
        assert!(
            matches!(refused, KinesisError::FutureTimestamp(_)) && refused.is_transient(),
            "{refused}"
        );

        // LATEST: only what is written after the iterator was taken.
        let latest = kinesis
            .shard_iterator(&stream, &shard, &StartingPosition::Latest)
            .await
            .expect("GetShardIterator LATEST");
        let page = kinesis.get_records(&latest, 100).await.expect("GetRecords");
        assert!(page.records.is_empty());
        let next = page
            .next_iterator
            .expect("an open shard always has a next iterator");
        put_all(&kinesis, &stream, &[put("k", "after latest")]).await;
        let page = kinesis.get_records(&next, 100).await.expect("GetRecords");
        assert_eq!(data(&page.records), vec![Bytes::from("after latest")]);
    })
    .await;
}

fn data_of(records: &[PutRecord]) -> Vec<Bytes> {
    records.iter().map(|r| r.data.clone()).collect()
}

#[tokio::test]
async fn a_split_closes_the_parent_and_reading_it_reaches_its_end() {
    let Some(aws) = aws().await else { return };
    within(async {
        let kinesis = aws.kinesis();
        let admin = aws.admin().unwrap();
        let stream = unique("split");
        admin.create_stream(&stream, 1).await.expect("CreateStream");
        let records: Vec<PutRecord> = (0..5)
            .map(|i| put(&format!("k{i}"), format!("r{i}")))
            .collect();
        let stored = put_all(&kinesis, &stream, &records).await;
        let parent = stored[0].0.clone();

        let middle = 1u128 << 127;
        admin
            .split_shard(&stream, &parent, middle)
            .await
            .expect("SplitShard");
        // split_shard returns once the stream is ACTIVE again.
        assert!(!kinesis
            .is_updating(&stream)
            .await
            .expect("DescribeStreamSummary"));

        let shards = kinesis.list_shards(&stream).await.expect("ListShards");
        assert_eq!(shards.len(), 3, "{shards:?}");
        let closed = shards
            .iter()
            .find(|s| s.shard_id == parent)
            .expect("the parent is still listed");
        let end = closed
            .ending_sequence_number
            .clone()
            .expect("the parent is closed");
        assert!(end >= stored[4].1, "the parent ends after its last record");
        let mut children: Vec<_> = shards.iter().filter(|s| s.shard_id != parent).collect();
        children.sort_by_key(|s| s.starting_hash_key);
        assert_eq!(children.len(), 2);
        for child in &children {
            assert_eq!(child.parent_shard_id.as_deref(), Some(parent.as_str()));
            assert_eq!(child.parents(), vec![parent.clone()]);
            assert!(!child.is_closed());
        }
        assert_eq!(
            (children[0].starting_hash_key, children[0].ending_hash_key),
            (0, middle - 1)
        );
        assert_eq!(
            (children[1].starting_hash_key, children[1].ending_hash_key),
            (middle, u128::MAX)
        );

        // The closed parent: all its records, then no next iterator (kinesalite takes an
        // extra, empty read to say so).
        let (got, ended) = read(
            &kinesis,
            &stream,
            &parent,
            StartingPosition::TrimHorizon,
            usize::MAX,
        )
        .await;
        assert!(ended, "reading a closed shard ends with next_iterator None");
        assert_eq!(got.len(), 5);

        // New records land on the children.
        let after = put_all(&kinesis, &stream, &[put("k0", "after split")]).await;
        assert!(children.iter().any(|c| c.shard_id == after[0].0));

        // Merge the children back: the new shard names both as parents.
        admin
            .merge_shards(&stream, &children[0].shard_id, &children[1].shard_id)
            .await
            .expect("MergeShards");
        let shards = kinesis.list_shards(&stream).await.expect("ListShards");
        assert_eq!(shards.len(), 4, "{shards:?}");
        let merged = shards
            .iter()
            .find(|s| s.adjacent_parent_shard_id.is_some())
            .expect("a merged shard");
        let mut parents = merged.parents();
        parents.sort();
        assert_eq!(
            parents,
            vec![children[0].shard_id.clone(), children[1].shard_id.clone()]
        );
        assert_eq!(
            (merged.starting_hash_key, merged.ending_hash_key),
            (0, u128::MAX)
        );
    })
    .await;
}

#[tokio::test]
async fn bad_requests_are_typed_errors() {
    let Some(aws) = aws().await else { return };
    within(async {
        let kinesis = aws.kinesis();
        let admin = aws.admin().unwrap();
        let stream = unique("errors");
        admin.create_stream(&stream, 1).await.expect("CreateStream");

        let bogus = "AAAAAAAAAAGdzRS0bogus0iterator0that0was0never0issued0by0the0service0AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
        match kinesis.get_records(bogus, 10).await {
            Err(KinesisError::ExpiredIterator(_) | KinesisError::Invalid(_)) => {}
            other => panic!("a bogus iterator: {other:?}"),
        }
        match kinesis.get_records("x", 10).await {
            Err(KinesisError::ExpiredIterator(_) | KinesisError::Invalid(_)) => {}
            other => panic!("a bogus iterator: {other:?}"),
        }

        let missing = unique("missing");
        match kinesis.list_shards(&missing).await {
            Err(KinesisError::NotFound(_)) => {}
            other => panic!("ListShards of a missing stream: {other:?}"),
        }
        match kinesis.shard_iterator(&missing, "shardId-000000000000", &StartingPosition::TrimHorizon).await {
            Err(KinesisError::NotFound(_)) => {}
            other => panic!("GetShardIterator on a missing stream: {other:?}"),
        }

        let too_many: Vec<PutRecord> = (0..501).map(|i| put("k", format!("{i}"))).collect();
        match kinesis.put_records(&stream, &too_many).await {
            Err(KinesisError::Invalid(_)) => {}
            other => panic!("501 records in one PutRecords: {other:?}"),
        }
        assert!(kinesis.put_records(&stream, &[]).await.expect("nothing to put").is_empty());
    })
    .await;
}

async fn lease_store(aws: &Aws) -> Arc<dyn LeaseStore> {
    let store = aws.lease_store(&unique("leases"));
    store.ensure_table().await.expect("ensure_table");
    // A second call finds the table and returns at once.
    store.ensure_table().await.expect("ensure_table again");
    store
}

fn assert_conflict<T: std::fmt::Debug>(result: Result<T, LeaseError>, key: &str, what: &str) {
    match result {
        Err(LeaseError::Conflict(k)) => assert_eq!(k, key, "{what}"),
        other => panic!("{what}: expected a conflict, got {other:?}"),
    }
}

#[tokio::test]
async fn leases_are_fenced_on_owner_and_counter() {
    let Some(aws) = aws().await else { return };
    within(async {
        let store = lease_store(&aws).await;
        let key = "shardId-000000000000";
        let fresh = Lease::new(key, Vec::new(), Checkpoint::TrimHorizon);
        assert!(store.create(&fresh).await.expect("create"));
        assert!(
            !store.create(&fresh).await.expect("create again"),
            "the second create must not overwrite"
        );
        assert_eq!(store.get(key).await.expect("get"), Some(fresh.clone()));
        assert_eq!(store.get("no-such-shard").await.expect("get"), None);

        let taken = store.take(&fresh, "w1").await.expect("take");
        assert_eq!((taken.owner.as_deref(), taken.counter), (Some("w1"), 1));
        let renewed = store.renew(&taken).await.expect("renew");
        assert_eq!((renewed.owner.as_deref(), renewed.counter), (Some("w1"), 2));

        // A resolved start (AT_TIMESTAMP with its time, `checkpointTimestamp`) is
        // written and read back; a record position replaces it (REMOVE of the time).
        let start = Checkpoint::AtTimestamp(Some(
            SystemTime::UNIX_EPOCH + Duration::from_millis(1_764_518_400_123),
        ));
        let started = store.checkpoint(&renewed, &start).await.expect("start");
        assert_eq!(started.checkpoint, start);
        assert_eq!(store.get(key).await.expect("get"), Some(started.clone()));

        // A 129-digit sequence number round-trips through the checkpoint.
        let big = SequenceNumber::new(format!("4{}", "9".repeat(128))).expect("129 digits");
        let position = Checkpoint::At(Position::new(big, 7));
        let before = SystemTime::now() - Duration::from_millis(1);
        let checkpointed = store
            .checkpoint(&renewed, &position)
            .await
            .expect("checkpoint");
        assert_eq!(checkpointed.checkpoint, position);
        // The write's time (`checkpointedAt`) is stored with it, as the table returns it.
        let at = checkpointed
            .checkpointed_at
            .expect("checkpointedAt written");
        assert!(
            (before..=SystemTime::now()).contains(&at),
            "checkpointedAt {at:?} is the time of the write"
        );
        assert_eq!(checkpointed.counter, 2, "a checkpoint keeps the counter");
        assert_eq!(
            store.get(key).await.expect("get"),
            Some(checkpointed.clone())
        );

        // Stale views: an old counter, another owner, or "unowned".
        let old_counter = taken.clone();
        let other_owner = Lease {
            owner: Some("w2".into()),
            ..checkpointed.clone()
        };
        let unowned = Lease {
            owner: None,
            ..checkpointed.clone()
        };
        for (stale, what) in [
            (&old_counter, "old counter"),
            (&other_owner, "other owner"),
            (&unowned, "unowned"),
        ] {
            assert_conflict(store.take(stale, "w3").await, key, &format!("take, {what}"));
            assert_conflict(store.renew(stale).await, key, &format!("renew, {what}"));
            assert_conflict(
                store.checkpoint(stale, &Checkpoint::ShardEnd).await,
                key,
                &format!("checkpoint, {what}"),
            );
            assert_conflict(store.release(stale).await, key, &format!("release, {what}"));
            assert_conflict(
                store.request_handoff(stale, "w3").await,
                key,
                &format!("request_handoff, {what}"),
            );
            assert_conflict(store.delete(stale).await, key, &format!("delete, {what}"));
        }
        assert_eq!(
            store.get(key).await.expect("get"),
            Some(checkpointed.clone()),
            "failed writes change nothing"
        );

        // A hand-off request keeps the owner's token valid.
        let requested = store
            .request_handoff(&checkpointed, "w2")
            .await
            .expect("request_handoff");
        assert_eq!(
            (requested.pending_owner.as_deref(), requested.counter),
            (Some("w2"), 2)
        );
        // The first request wins: another worker asking now is refused, the same one
        // asking again is not.
        assert_conflict(
            store.request_handoff(&requested, "w3").await,
            key,
            "request_handoff while another worker's request is pending",
        );
        let requested = store
            .request_handoff(&requested, "w2")
            .await
            .expect("the same requester asks again");
        assert_eq!(requested.pending_owner.as_deref(), Some("w2"));
        // A request is withdrawn only by its own worker; once withdrawn, a hand-over to
        // that worker fails and the owner keeps the row.
        assert_conflict(
            store.withdraw_handoff(&requested, "w3").await,
            key,
            "withdraw_handoff of another worker's request",
        );
        let withdrawn = store
            .withdraw_handoff(&requested, "w2")
            .await
            .expect("withdraw_handoff");
        assert_eq!(
            (withdrawn.pending_owner.as_deref(), withdrawn.counter),
            (None, 2)
        );
        assert_conflict(
            store.take(&requested, "w2").await,
            key,
            "hand-over after the request was withdrawn",
        );
        let requested = store
            .request_handoff(&withdrawn, "w2")
            .await
            .expect("asked again");
        let requested = store
            .checkpoint(&requested, &position)
            .await
            .expect("checkpoint after a request");

        let released = store.release(&requested).await.expect("release");
        assert_eq!((released.owner.as_deref(), released.counter), (None, 3));
        assert_eq!(
            released.checkpoint, position,
            "a release keeps the checkpoint"
        );
        assert_eq!(
            released.pending_owner.as_deref(),
            Some("w2"),
            "the requester can still see its request"
        );

        let taken2 = store.take(&released, "w2").await.expect("take by w2");
        assert_eq!(
            (
                taken2.owner.as_deref(),
                taken2.counter,
                taken2.pending_owner.as_deref()
            ),
            (Some("w2"), 4, None)
        );
        // The previous owner cannot move the checkpoint any more.
        assert_conflict(
            store.checkpoint(&requested, &Checkpoint::ShardEnd).await,
            key,
            "old owner's checkpoint",
        );

        // A take of a row that does not exist is a conflict too.
        assert_conflict(
            store
                .take(&Lease::new("gone", Vec::new(), Checkpoint::Latest), "w1")
                .await,
            "gone",
            "take of a missing row",
        );

        store.delete(&taken2).await.expect("delete");
        assert_eq!(store.get(key).await.expect("get"), None);
    })
    .await;
}

/// A lease store over `table` whose leader item is placed as `placement` says.
fn placed_store(
    aws: &Aws,
    table: &str,
    placement: shardflow::lease::dynamo::LeaderPlacement,
) -> shardflow::lease::dynamo::DynamoLeaseStore {
    shardflow::lease::dynamo::DynamoLeaseStore::new(aws.dynamodb_client().clone(), table)
        .with_leader_placement(placement)
}

/// The tables whose name starts with `table`.
async fn tables_of(aws: &Aws, table: &str) -> Vec<String> {
    let tables = aws
        .dynamodb_client()
        .list_tables()
        .send()
        .await
        .expect("ListTables");
    let mut names: Vec<String> = tables
        .table_names()
        .iter()
        .filter(|t| t.starts_with(table))
        .cloned()
        .collect();
    names.sort();
    names
}

/// The row `key` of `table` as stored, if any.
async fn raw_row(
    aws: &Aws,
    table: &str,
    key_name: &str,
    key: &str,
) -> Option<HashMap<String, aws_sdk_dynamodb::types::AttributeValue>> {
    aws.dynamodb_client()
        .get_item()
        .table_name(table)
        .key(
            key_name,
            aws_sdk_dynamodb::types::AttributeValue::S(key.to_owned()),
        )
        .consistent_read(true)
        .send()
        .await
        .expect("GetItem")
        .item
}

/// Takes, renews, releases and takes again the leader item of `state`, checking that
/// each write is fenced on owner and counter and that of two takes on one view one
/// lands.
async fn leader_item_is_fenced(state: &dyn shardflow::lease::CoordinatorState) {
    let key = shardflow::lease::LEADER_KEY;
    let absent = state.get(key).await.expect("get");
    let first = state
        .claim(key, absent.as_ref(), "w1#a")
        .await
        .expect("claim");
    assert_eq!(first.owner.as_deref(), Some("w1#a"));
    assert_conflict(
        state.claim(key, absent.as_ref(), "w2#b").await,
        key,
        "a second take on the view before the first",
    );
    let renewed = state.renew(&first).await.expect("renew");
    assert_eq!(renewed.counter, first.counter + 1);
    assert_conflict(
        state.renew(&first).await,
        key,
        "a renewal on an old counter",
    );
    // Two workers saw the same counter: one take lands, the other is fenced.
    let won = state
        .claim(key, Some(&renewed), "w2#b")
        .await
        .expect("take over");
    assert_conflict(
        state.claim(key, Some(&renewed), "w3#c").await,
        key,
        "the second take on the same view",
    );
    assert_conflict(state.renew(&renewed).await, key, "the old leader's renewal");
    assert_eq!(state.get(key).await.expect("get"), Some(won.clone()));
    let released = state.release(&won).await.expect("release");
    assert_eq!(
        (released.owner.as_deref(), released.counter),
        (None, won.counter + 1)
    );
    let again = state
        .claim(key, Some(&released), "w3#c")
        .await
        .expect("take a released item");
    assert_eq!(
        (again.owner.as_deref(), again.counter),
        (Some("w3#c"), released.counter + 1)
    );
}

/// A new group keeps its leader item in its lease table: one table, no
/// `<lease table>-coordinator`. The item is a row marked `entityType =
/// SHARDFLOW_LEADER` (the KCL 3.5 reads no such row as a lease) under a key no shard
/// or KCL row has, which shardflow's own listing, reads and owner index skip too; its
/// take, renewal and release are fenced as a lease's.
#[tokio::test]
async fn a_new_group_keeps_its_leader_in_its_lease_table() {
    use aws_sdk_dynamodb::types::AttributeValue;
    use shardflow::lease::dynamo::{LEADER_ENTITY_TYPE, LEADER_ROW_KEY};
    use shardflow::lease::entity::ENTITY_TYPE;
    let Some(aws) = aws().await else { return };
    within(async {
        let table = unique("leases");
        let store = aws.lease_store(&table);
        store.ensure_table().await.expect("ensure_table");
        let state = store.coordinator_state().expect("a leader state");
        state.ensure_table().await.expect("place the leader item");
        state.ensure_table().await.expect("again");
        leader_item_is_fenced(state.as_ref()).await;
        assert_eq!(tables_of(&aws, &table).await, vec![table.clone()]);
        let row = raw_row(&aws, &table, "leaseKey", LEADER_ROW_KEY)
            .await
            .expect("the leader row in the lease table");
        assert_eq!(
            row.get(ENTITY_TYPE),
            Some(&AttributeValue::S(LEADER_ENTITY_TYPE.to_owned()))
        );
        assert_eq!(
            row.get("leaderOwner"),
            Some(&AttributeValue::S("w3#c".to_owned()))
        );
        assert!(!row.contains_key("leaseOwner"), "{row:?}");
        // Not a lease to shardflow either.
        assert!(store.list().await.expect("list").is_empty());
        assert_eq!(store.get(LEADER_ROW_KEY).await.expect("get"), None);
        assert!(store.owned_keys("w3#c").await.expect("owned").is_empty());
    })
    .await;
}

/// A table taken over from a KCL older than 3.5 (rows without `entityType`, which such
/// a KCL parses every one of as a lease) keeps the leader item in
/// `<lease table>-coordinator`, so that a roll-back to that KCL finds nothing but its
/// leases in the lease table; the item there is fenced as before.
#[tokio::test]
async fn a_table_taken_over_from_an_older_kcl_keeps_the_coordinator_table() {
    use aws_sdk_dynamodb::types::AttributeValue;
    use shardflow::lease::dynamo::LEADER_ROW_KEY;
    let Some(aws) = aws().await else { return };
    within(async {
        let table = unique("leases");
        // The KCL 2.x's table and one of its rows, as it writes them.
        placed_store(&aws, &table, Default::default())
            .ensure_table()
            .await
            .expect("create the table");
        let kcl_row = HashMap::from([
            (
                "leaseKey".to_owned(),
                AttributeValue::S("shardId-000000000000".into()),
            ),
            (
                "leaseOwner".to_owned(),
                AttributeValue::S("kcl-worker-1".into()),
            ),
            ("leaseCounter".to_owned(), AttributeValue::N("41".into())),
            (
                "checkpoint".to_owned(),
                AttributeValue::S("TRIM_HORIZON".into()),
            ),
            (
                "checkpointSubSequenceNumber".to_owned(),
                AttributeValue::N("0".into()),
            ),
            (
                "ownerSwitchesSinceCheckpoint".to_owned(),
                AttributeValue::N("0".into()),
            ),
        ]);
        aws.dynamodb_client()
            .put_item()
            .table_name(&table)
            .set_item(Some(kcl_row.clone()))
            .send()
            .await
            .expect("PutItem");
        let store = aws.lease_store(&table);
        store.ensure_table().await.expect("ensure_table");
        let state = store.coordinator_state().expect("a leader state");
        state.ensure_table().await.expect("place the leader item");
        leader_item_is_fenced(state.as_ref()).await;
        let coordinator = format!("{table}-coordinator");
        assert_eq!(
            tables_of(&aws, &table).await,
            vec![table.clone(), coordinator.clone()]
        );
        assert_eq!(
            raw_row(&aws, &table, "leaseKey", LEADER_ROW_KEY).await,
            None
        );
        assert!(
            raw_row(&aws, &coordinator, "key", shardflow::lease::LEADER_KEY)
                .await
                .is_some()
        );
        assert_eq!(
            raw_row(&aws, &table, "leaseKey", "shardId-000000000000").await,
            Some(kcl_row)
        );
    })
    .await;
}

/// A KCL 3.5 single-table table (its rows carry an `entityType`; its own leader lock is
/// the row `Leader`, `entityType = LEADER`) keeps shardflow's leader item in the lease
/// table too, beside the KCL's rows, which stay as they were.
#[tokio::test]
async fn a_kcl_single_table_keeps_the_leader_in_the_lease_table() {
    use aws_sdk_dynamodb::types::AttributeValue;
    use shardflow::lease::dynamo::LEADER_ROW_KEY;
    let Some(aws) = aws().await else { return };
    within(async {
        let table = unique("leases");
        placed_store(&aws, &table, Default::default())
            .ensure_table()
            .await
            .expect("create the table");
        let lease = HashMap::from([
            (
                "leaseKey".to_owned(),
                AttributeValue::S("shardId-000000000000".into()),
            ),
            ("entityType".to_owned(), AttributeValue::S("LEASE".into())),
            ("leaseCounter".to_owned(), AttributeValue::N("3".into())),
            (
                "checkpoint".to_owned(),
                AttributeValue::S("TRIM_HORIZON".into()),
            ),
            (
                "checkpointSubSequenceNumber".to_owned(),
                AttributeValue::N("0".into()),
            ),
            (
                "ownerSwitchesSinceCheckpoint".to_owned(),
                AttributeValue::N("0".into()),
            ),
        ]);
        let kcl_leader = HashMap::from([
            ("leaseKey".to_owned(), AttributeValue::S("Leader".into())),
            ("entityType".to_owned(), AttributeValue::S("LEADER".into())),
            (
                "ownerName".to_owned(),
                AttributeValue::S("kcl-worker-1".into()),
            ),
            (
                "recordVersionNumber".to_owned(),
                AttributeValue::S("7c1f".into()),
            ),
        ]);
        for row in [&lease, &kcl_leader] {
            aws.dynamodb_client()
                .put_item()
                .table_name(&table)
                .set_item(Some(row.clone()))
                .send()
                .await
                .expect("PutItem");
        }
        let store = aws.lease_store(&table);
        store.ensure_table().await.expect("ensure_table");
        let state = store.coordinator_state().expect("a leader state");
        state.ensure_table().await.expect("place the leader item");
        leader_item_is_fenced(state.as_ref()).await;
        assert_eq!(tables_of(&aws, &table).await, vec![table.clone()]);
        assert!(raw_row(&aws, &table, "leaseKey", LEADER_ROW_KEY)
            .await
            .is_some());
        assert_eq!(
            raw_row(&aws, &table, "leaseKey", "Leader").await,
            Some(kcl_leader)
        );
    })
    .await;
}

/// A group moves from the coordinator table to one table, and back, by rolling deploys
/// with old and new workers running together, and never has two leaders. Scripted on
/// the leader items as the workers use them (read, take over only what stands still or
/// was released, renew, release at a stop):
/// * step 1: workers with `Both` beside workers with `CoordinatorTable` (the earlier
///   version): the coordinator table's item decides for both kinds;
/// * step 2: workers with `LeaseTable` beside workers with `Both`: the lease table's row
///   decides for both kinds;
/// * and back, the same steps the other way.
#[tokio::test]
async fn a_rolling_move_between_the_tables_keeps_one_leader() {
    use shardflow::lease::dynamo::LeaderPlacement::{Both, CoordinatorTable, LeaseTable};
    use shardflow::lease::{CoordinatorState, LeaderItem, LEADER_KEY as KEY};
    let Some(aws) = aws().await else { return };
    within(async {
        let table = unique("leases");
        let worker = |placement| {
            let store = placed_store(&aws, &table, placement);
            async move {
                store.ensure_table().await.expect("ensure_table");
                let state = store.coordinator_state().expect("a leader state");
                state.ensure_table().await.expect("place the leader item");
                state
            }
        };
        // A worker leads when its last take or renewal landed and named it.
        async fn take(state: &dyn CoordinatorState, me: &str) -> Result<LeaderItem, LeaseError> {
            let seen = state.get(KEY).await?;
            state.claim(KEY, seen.as_ref(), me).await
        }

        // Before: a group of the earlier version; its leader holds the coordinator item.
        let old = worker(CoordinatorTable).await;
        let mut old_lead = take(old.as_ref(), "old#1").await.expect("the old leader");

        // Step 1 starts: a `Both` worker joins. While the old leader renews, the new
        // worker's take (decided on the view it read) fails: one leader.
        let both = worker(Both).await;
        let seen = both.get(KEY).await.expect("get");
        assert_ne!(
            seen.as_ref().and_then(|s| s.owner.as_deref()),
            Some("both#1")
        );
        old_lead = old.renew(&old_lead).await.expect("the old leader renews");
        assert_conflict(
            both.claim(KEY, seen.as_ref(), "both#1").await,
            KEY,
            "a take beside a live old leader",
        );
        // The old leader stops (released at its graceful stop): the new one leads,
        // holding both items, and a second worker of the old version cannot take over.
        old.release(&old_lead).await.expect("release");
        let mut both_lead = take(both.as_ref(), "both#1").await.expect("lead");
        assert_eq!(both_lead.owner.as_deref(), Some("both#1"));
        let old2 = worker(CoordinatorTable).await;
        let seen_old = old2.get(KEY).await.expect("get").expect("the item");
        assert_eq!(seen_old.owner.as_deref(), Some("both#1"));
        both_lead = both.renew(&both_lead).await.expect("renew both");
        assert_conflict(
            old2.claim(KEY, Some(&seen_old), "old#2").await,
            KEY,
            "an old worker's take beside a live leader holding both",
        );

        // Step 2: a `LeaseTable` worker joins the `Both` fleet; same again.
        let one = worker(LeaseTable).await;
        let seen_one = one.get(KEY).await.expect("get").expect("the row");
        assert_eq!(seen_one.owner.as_deref(), Some("both#1"));
        both_lead = both.renew(&both_lead).await.expect("renew both");
        assert_conflict(
            one.claim(KEY, Some(&seen_one), "one#1").await,
            KEY,
            "a one-table take beside a live leader holding both",
        );
        both.release(&both_lead).await.expect("release both");
        let mut one_lead = take(one.as_ref(), "one#1").await.expect("lead");
        // A `Both` worker that tries now sees a leader it is not, and fails its take
        // while that leader renews; the coordinator item it took first is given back.
        let both2 = worker(Both).await;
        let seen_both = both2.get(KEY).await.expect("get");
        assert_ne!(
            seen_both.as_ref().and_then(|s| s.owner.as_deref()),
            Some("both#2")
        );
        one_lead = one.renew(&one_lead).await.expect("renew one");
        assert!(both2
            .claim(KEY, seen_both.as_ref(), "both#2")
            .await
            .is_err());
        let legacy = old2.get(KEY).await.expect("get").expect("the item");
        assert_eq!(legacy.owner, None, "the coordinator item is given back");

        // And back: `Both` workers join the one-table fleet (they wait for the leader
        // to stop), then the earlier version joins them.
        one.release(&one_lead).await.expect("release one");
        let both_lead = take(both2.as_ref(), "both#2").await.expect("lead");
        assert_eq!(both_lead.owner.as_deref(), Some("both#2"));
        let seen_one = one.get(KEY).await.expect("get").expect("the row");
        assert_eq!(seen_one.owner.as_deref(), Some("both#2"));
        let both_lead = both2.renew(&both_lead).await.expect("renew both");
        assert_conflict(
            one.claim(KEY, Some(&seen_one), "one#2").await,
            KEY,
            "a one-table take beside a live leader holding both",
        );
        let old3 = worker(CoordinatorTable).await;
        let seen_old = old3.get(KEY).await.expect("get").expect("the item");
        assert_eq!(seen_old.owner.as_deref(), Some("both#2"));
        both2.renew(&both_lead).await.expect("renew both");
        assert_conflict(
            old3.claim(KEY, Some(&seen_old), "old#3").await,
            KEY,
            "an old worker's take beside a live leader holding both",
        );
    })
    .await;
}

/// Regression: a leader item whose owner was cleared to an empty string could never be taken over.
/// A leader item whose owner was cleared by hand to an empty string (an operator forcing
/// a new election from the console) reads as released: a worker that read it so can
/// take it over, or no worker ever leads again.
#[tokio::test]
async fn a_leader_item_with_an_empty_owner_can_be_taken_over() {
    let Some(aws) = aws().await else { return };
    within(async {
        let table = unique("leases");
        let store = placed_store(
            &aws,
            &table,
            shardflow::lease::dynamo::LeaderPlacement::CoordinatorTable,
        );
        store.ensure_table().await.expect("ensure_table");
        let state = store
            .coordinator_state()
            .expect("a coordinator-state table");
        state
            .ensure_table()
            .await
            .expect("ensure the coordinator table");
        let key = shardflow::lease::LEADER_KEY;
        aws.dynamodb_client()
            .put_item()
            .table_name(format!("{table}-coordinator"))
            .item(
                "key",
                aws_sdk_dynamodb::types::AttributeValue::S(key.to_owned()),
            )
            .item(
                "leaderOwner",
                aws_sdk_dynamodb::types::AttributeValue::S(String::new()),
            )
            .item(
                "leaderCounter",
                aws_sdk_dynamodb::types::AttributeValue::N("7".into()),
            )
            .send()
            .await
            .expect("PutItem");
        let seen = state.get(key).await.expect("get").expect("the item");
        assert_eq!((seen.owner.as_deref(), seen.counter), (None, 7));
        let taken = state
            .claim(key, Some(&seen), "w1#a")
            .await
            .expect("take an item that reads as released");
        assert_eq!((taken.owner.as_deref(), taken.counter), (Some("w1#a"), 8));
    })
    .await;
}

/// A leader item whose counter does not parse (written by hand or by another tool) is
/// reset to released when read, so a worker can lead again.
/// Regression: every read of such an item failed, no take could be conditioned on it,
/// and no worker ever led again.
#[tokio::test]
async fn a_leader_item_whose_counter_does_not_parse_can_be_taken_over() {
    use aws_sdk_dynamodb::types::AttributeValue;
    let Some(aws) = aws().await else { return };
    within(async {
        let table = unique("leases");
        let store = placed_store(
            &aws,
            &table,
            shardflow::lease::dynamo::LeaderPlacement::CoordinatorTable,
        );
        store.ensure_table().await.expect("ensure_table");
        let state = store
            .coordinator_state()
            .expect("a coordinator-state table");
        state
            .ensure_table()
            .await
            .expect("ensure the coordinator table");
        let key = shardflow::lease::LEADER_KEY;
        aws.dynamodb_client()
            .put_item()
            .table_name(format!("{table}-coordinator"))
            .item("key", AttributeValue::S(key.to_owned()))
            .item("leaderOwner", AttributeValue::S("w9#gone".into()))
            .item("leaderCounter", AttributeValue::S("seven".into()))
            .send()
            .await
            .expect("PutItem");
        let seen = state.get(key).await;
        let taken = match seen {
            Ok(seen) => state.claim(key, seen.as_ref(), "w1#a").await,
            Err(e) => Err(e),
        };
        assert!(taken.is_ok(), "no way to lead: {taken:?}");
    })
    .await;
}

#[tokio::test]
async fn list_returns_every_row_with_its_parents() {
    let Some(aws) = aws().await else { return };
    within(async {
        let store = lease_store(&aws).await;
        let mut expected = Vec::new();
        for i in 0..30u32 {
            let parents = match i % 3 {
                0 => Vec::new(),
                1 => vec![format!("shardId-{:012}", 1000 + i)],
                _ => vec![
                    format!("shardId-{:012}", 1000 + i),
                    format!("shardId-{:012}", 2000 + i),
                ],
            };
            let checkpoint = match i % 5 {
                0 => Checkpoint::TrimHorizon,
                1 => Checkpoint::Latest,
                // A KCL row keeps its time in the config; ours in the row.
                2 if i % 2 == 0 => Checkpoint::AtTimestamp(None),
                2 => Checkpoint::AtTimestamp(Some(
                    SystemTime::UNIX_EPOCH
                        + Duration::from_millis(1_764_518_400_000 + u64::from(i)),
                )),
                3 => Checkpoint::ShardEnd,
                _ => Checkpoint::At(Position::new(
                    SequenceNumber::new(format!("{i}{}", "0".repeat(100))).expect("digits"),
                    0,
                )),
            };
            let lease = Lease::new(format!("shardId-{i:012}"), parents, checkpoint);
            assert!(store.create(&lease).await.expect("create"));
            expected.push(lease);
        }
        // One owned row, so owners come back from a scan too.
        let owned = store.take(&expected[0], "w1").await.expect("take");
        expected[0] = owned;

        let mut listed = store.list().await.expect("list");
        listed.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(listed, expected);
    })
    .await;
}

#[tokio::test]
async fn ensure_table_refuses_a_table_with_another_key() {
    let Some(aws) = aws().await else { return };
    within(async {
        use aws_sdk_dynamodb::types::{
            AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
        };
        let table = unique("not-leases");
        aws.dynamodb_client()
            .create_table()
            .table_name(&table)
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name("id")
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .expect("attribute"),
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name("id")
                    .key_type(KeyType::Hash)
                    .build()
                    .expect("key"),
            )
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await
            .expect("CreateTable");
        match aws.lease_store(&table).ensure_table().await {
            Err(LeaseError::Other(message)) => {
                assert!(message.as_str().contains("leaseKey"), "{message}")
            }
            other => panic!("a table with another key: {other:?}"),
        }
    })
    .await;
}

use testkit::fake_endpoint as fake;

/// AwsKinesis talking to `fake`, with the SDK's own retries off so every error surfaces.
fn kinesis_at(fake: &fake::Fake) -> shardflow::kinesis::aws::AwsKinesis {
    use aws_sdk_kinesis::config::{retry::RetryConfig, BehaviorVersion, Credentials, Region};
    let config = aws_sdk_kinesis::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
        .endpoint_url(&fake.url)
        .retry_config(RetryConfig::disabled())
        .build();
    shardflow::kinesis::aws::AwsKinesis::new(aws_sdk_kinesis::Client::from_conf(config))
}

fn shard_json(
    id: &str,
    parent: Option<&str>,
    start: &str,
    end: &str,
    ending_sequence: Option<&str>,
) -> serde_json::Value {
    let mut shard = serde_json::json!({
        "ShardId": id,
        "HashKeyRange": {"StartingHashKey": start, "EndingHashKey": end},
        "SequenceNumberRange": {"StartingSequenceNumber": "49590338271490256608559692538361571095921575989136588802"},
    });
    if let Some(parent) = parent {
        shard["ParentShardId"] = parent.into();
    }
    if let Some(end) = ending_sequence {
        shard["SequenceNumberRange"]["EndingSequenceNumber"] = end.into();
    }
    shard
}

#[tokio::test]
async fn wire_list_shards_follows_next_token_without_the_stream_name() {
    within(async {
        let max = u128::MAX.to_string();
        let half = (1u128 << 127).to_string();
        let below_half = ((1u128 << 127) - 1).to_string();
        let fake = fake::Fake::start(vec![
            (200, serde_json::json!({
                "Shards": [shard_json("shardId-000000000000", None, "0", &max, Some("49590338271490256608559692538361571095921575989136588900"))],
                "NextToken": "page-2",
            })),
            (200, serde_json::json!({
                "Shards": [
                    shard_json("shardId-000000000001", Some("shardId-000000000000"), "0", &below_half, None),
                    shard_json("shardId-000000000002", Some("shardId-000000000000"), &half, &max, None),
                ],
            })),
        ]);
        let shards = kinesis_at(&fake).list_shards("orders").await.expect("ListShards");

        let seen = fake.seen();
        assert_eq!(seen.len(), 2);
        assert!(seen.iter().all(|s| s.target.ends_with(".ListShards")));
        assert_eq!(seen[0].body["StreamName"], "orders");
        assert!(seen[0].body.get("NextToken").is_none());
        assert_eq!(seen[1].body, serde_json::json!({"NextToken": "page-2"}), "a follow-up page is asked for by token alone");

        assert_eq!(shards.len(), 3);
        assert!(shards[0].is_closed());
        assert_eq!(shards[0].ending_hash_key, u128::MAX);
        assert_eq!(shards[1].parents(), vec!["shardId-000000000000".to_owned()]);
        assert_eq!((shards[1].starting_hash_key, shards[1].ending_hash_key), (0, (1 << 127) - 1));
        assert_eq!(shards[2].starting_hash_key, 1 << 127);
    })
    .await;
}

#[tokio::test]
async fn wire_get_records_maps_records_child_shards_and_the_end_of_a_shard() {
    within(async {
        let fake = fake::Fake::start(vec![(200, serde_json::json!({
            "Records": [{
                "SequenceNumber": "49590338271490256608559692538361571095921575989136588898",
                "ApproximateArrivalTimestamp": 1.7e9,
                "Data": "aGVsbG8=",
                "PartitionKey": "pk-1",
            }],
            "MillisBehindLatest": 0,
            "ChildShards": [
                {"ShardId": "shardId-000000000001", "ParentShards": ["shardId-000000000000"], "HashKeyRange": {"StartingHashKey": "0", "EndingHashKey": "1"}},
                {"ShardId": "shardId-000000000002", "ParentShards": ["shardId-000000000000"], "HashKeyRange": {"StartingHashKey": "2", "EndingHashKey": "3"}},
            ],
        }))]);
        let page = kinesis_at(&fake).get_records("iterator-1", 50_000).await.expect("GetRecords");
        assert_eq!(fake.seen()[0].body, serde_json::json!({"ShardIterator": "iterator-1", "Limit": 10_000}), "the limit is clamped");
        assert_eq!(page.next_iterator, None, "no NextShardIterator: the shard has ended");
        assert_eq!(page.millis_behind_latest, Some(0));
        assert_eq!(page.child_shards, vec!["shardId-000000000001".to_owned(), "shardId-000000000002".to_owned()]);
        let record = &page.records[0];
        assert_eq!(record.sequence_number.as_str(), "49590338271490256608559692538361571095921575989136588898");
        assert_eq!(record.partition_key, "pk-1");
        assert_eq!(record.data, Bytes::from("hello"));
        assert_eq!(record.approximate_arrival, Some(SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)));
    })
    .await;
}

#[tokio::test]
async fn wire_put_records_reports_each_entry() {
    within(async {
        let fake = fake::Fake::start(vec![(200, serde_json::json!({
            "FailedRecordCount": 1,
            "Records": [
                {"SequenceNumber": "49590338271490256608559692538361571095921575989136588898", "ShardId": "shardId-000000000000"},
                {"ErrorCode": "ProvisionedThroughputExceededException", "ErrorMessage": "Rate exceeded for shard"},
            ],
        }))]);
        let records = [
            put("a", "one"),
            PutRecord { explicit_hash_key: Some("42".into()), ..put("b", "two") },
        ];
        let outcomes = kinesis_at(&fake).put_records("orders", &records).await.expect("PutRecords");
        assert_eq!(
            outcomes,
            vec![
                PutOutcome::Stored {
                    shard_id: "shardId-000000000000".into(),
                    sequence_number: SequenceNumber::new("49590338271490256608559692538361571095921575989136588898").expect("digits"),
                },
                PutOutcome::Failed {
                    code: "ProvisionedThroughputExceededException".into(),
                    message: "Rate exceeded for shard".into(),
                },
            ]
        );
        let body = &fake.seen()[0].body;
        assert_eq!(body["StreamName"], "orders");
        assert_eq!(body["Records"][0], serde_json::json!({"Data": "b25l", "PartitionKey": "a"}));
        assert_eq!(body["Records"][1]["ExplicitHashKey"], "42");
    })
    .await;
}

#[tokio::test]
async fn wire_errors_are_classified() {
    within(async {
        let error = |code: &str, message: &str| {
            (400, serde_json::json!({"__type": code, "message": message}))
        };
        let fake = fake::Fake::start(vec![
            error("ProvisionedThroughputExceededException", "Rate exceeded"),
            error("LimitExceededException", "too many requests"),
            error("KMSThrottlingException", "kms"),
            error("ExpiredIteratorException", "Iterator expired"),
            error("InvalidArgumentException", "Invalid ShardIterator."),
            error("ResourceNotFoundException", "Stream orders not found"),
            (500, serde_json::json!({"message": "boom"})),
        ]);
        let kinesis = kinesis_at(&fake);
        let mut results = Vec::new();
        for _ in 0..7 {
            results.push(
                kinesis
                    .get_records("iterator", 10)
                    .await
                    .expect_err("an error"),
            );
        }
        let shard_iterator = kinesis
            .shard_iterator("orders", "shardId-000000000000", &StartingPosition::Latest)
            .await;
        assert!(
            matches!(&results[0], KinesisError::Throttled(m) if m.as_str().contains("Rate exceeded")),
            "{:?}",
            results[0]
        );
        // What AWS answered is the error's source: its code can be matched.
        let aws = std::error::Error::source(&results[0])
            .and_then(|s| s.downcast_ref::<shardflow::AwsError>())
            .expect("an AWS error as the source");
        assert_eq!(
            aws.code.as_deref(),
            Some("ProvisionedThroughputExceededException")
        );
        assert_eq!(aws.message.as_deref(), Some("Rate exceeded"));
        assert_eq!(aws.operation, "GetRecords");
        assert_eq!(aws.status, Some(400));
        assert!(
            matches!(results[1], KinesisError::Throttled(_)),
            "{:?}",
            results[1]
        );
        assert!(
            matches!(results[2], KinesisError::Throttled(_)),
            "{:?}",
            results[2]
        );
        assert!(
            matches!(results[3], KinesisError::ExpiredIterator(_)),
            "{:?}",
            results[3]
        );
        assert!(
            matches!(results[4], KinesisError::ExpiredIterator(_)),
            "{:?}",
            results[4]
        );
        assert!(
            matches!(results[5], KinesisError::NotFound(_)),
            "{:?}",
            results[5]
        );
        assert!(
            matches!(results[6], KinesisError::Other(_)),
            "{:?}",
            results[6]
        );
        assert!(results[6].is_transient());
        // The fake has run out of answers: HTTP 500 again.
        assert!(
            matches!(shard_iterator, Err(KinesisError::Other(_))),
            "{shard_iterator:?}"
        );
    })
    .await;
}

#[tokio::test]
async fn wire_errors_never_carry_record_payloads() {
    within(async {
        // A GetRecords answer that does not parse (Data is not base64), with a payload in
        // it: the error must say what failed without repeating the body.
        let fake = fake::Fake::start(vec![(200, serde_json::json!({
            "Records": [{"SequenceNumber": "1", "Data": "@@ secret-payload @@", "PartitionKey": "pk"}],
        }))]);
        let error = kinesis_at(&fake).get_records("iterator", 10).await.expect_err("an unreadable answer");
        let message = error.to_string();
        assert!(matches!(error, KinesisError::Other(_)), "{message}");
        assert!(message.contains("GetRecords") && message.contains("HTTP 200"), "{message}");
        assert!(!message.contains("secret-payload"), "a payload leaked into an error: {message}");

        // A plain HTTP 500: the status is in the message.
        let fake = fake::Fake::start(Vec::new());
        let message = kinesis_at(&fake).get_records("iterator", 10).await.expect_err("HTTP 500").to_string();
        assert!(message.contains("HTTP 500"), "{message}");
    })
    .await;
}

/// A table shardflow creates has the KCL 3's owner index, and `owned_keys`
/// answers what a filtered listing answers, for single-stream and multi-stream keys
/// alike (dynalite keeps the index and answers Queries on it).
#[tokio::test]
async fn owned_keys_answer_as_a_filtered_listing_on_a_table_with_the_owner_index() {
    let Some(aws) = aws().await else { return };
    within(async {
        let table = unique("owned");
        let store = aws.lease_store(&table);
        store.ensure_table().await.expect("ensure_table");
        let described = aws
            .dynamodb_client()
            .describe_table()
            .table_name(&table)
            .send()
            .await
            .expect("DescribeTable");
        let index = described
            .table()
            .and_then(|t| {
                t.global_secondary_indexes()
                    .iter()
                    .find(|i| i.index_name() == Some("LeaseOwnerToLeaseKeyIndex"))
            })
            .expect("the owner index");
        let keys: Vec<(&str, &str)> = index
            .key_schema()
            .iter()
            .map(|k| (k.attribute_name(), k.key_type().as_str()))
            .collect();
        assert_eq!(keys, vec![("leaseOwner", "HASH"), ("leaseKey", "RANGE")]);
        assert_eq!(
            index
                .projection()
                .and_then(|p| p.projection_type())
                .map(|p| p.as_str()),
            Some("KEYS_ONLY")
        );
        let keys = [
            "shardId-000000000000",
            "shardId-000000000001",
            "123456789012:orders:1700000000:shardId-000000000000",
            "123456789012:orders:1700000000:shardId-000000000001",
            "123456789012:refunds:1700000000:shardId-000000000000",
        ];
        for (i, key) in keys.iter().enumerate() {
            let row = Lease::new(*key, Vec::new(), Checkpoint::TrimHorizon);
            assert!(store.create(&row).await.expect("create"));
            if i != 1 {
                let owner = if i % 2 == 0 { "w1#a" } else { "w2#b" };
                store.take(&row, owner).await.expect("take");
            }
        }
        for owner in ["w1#a", "w2#b", "w3#c"] {
            let mut listed: Vec<String> = store
                .list()
                .await
                .expect("list")
                .into_iter()
                .filter(|r| r.owner.as_deref() == Some(owner))
                .map(|r| r.key)
                .collect();
            listed.sort();
            let mut owned = store.owned_keys(owner).await.expect("owned_keys");
            owned.sort();
            assert_eq!(owned, listed, "{owner}");
        }
        assert_eq!(store.owned_keys("w1#a").await.expect("owned_keys").len(), 3);
    })
    .await;
}

/// DynamoDbClient talking to `fake`, with the SDK's own retries off.
fn dynamodb_at(fake: &fake::Fake) -> aws_sdk_dynamodb::Client {
    use aws_sdk_dynamodb::config::{retry::RetryConfig, BehaviorVersion, Credentials, Region};
    let config = aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "test"))
        .endpoint_url(&fake.url)
        .retry_config(RetryConfig::disabled())
        .build();
    aws_sdk_dynamodb::Client::from_conf(config)
}

/// A DescribeTable answer of an ACTIVE lease table, with the owner index in `index`
/// status, or without it.
fn lease_table_json(index: Option<&str>) -> serde_json::Value {
    let mut table = serde_json::json!({
        "TableName": "old-leases",
        "TableStatus": "ACTIVE",
        "KeySchema": [{"AttributeName": "leaseKey", "KeyType": "HASH"}],
        "AttributeDefinitions": [{"AttributeName": "leaseKey", "AttributeType": "S"}],
    });
    if let Some(status) = index {
        table["GlobalSecondaryIndexes"] = serde_json::json!([{
            "IndexName": "LeaseOwnerToLeaseKeyIndex",
            "IndexStatus": status,
            "KeySchema": [
                {"AttributeName": "leaseOwner", "KeyType": "HASH"},
                {"AttributeName": "leaseKey", "KeyType": "RANGE"}
            ],
            "Projection": {"ProjectionType": "KEYS_ONLY"}
        }]);
    }
    table
}

/// A worker that starts while a peer's upgrade adds the owner index finds the
/// table UPDATING: DynamoDB serves reads and writes meanwhile, so it starts at once
/// (one DescribeTable, no second UpdateTable) and scans until the index is ACTIVE,
/// instead of waiting for the index to build and failing its start-up after a minute.
#[tokio::test]
async fn wire_a_table_being_upgraded_is_used_at_once() {
    use shardflow::lease::dynamo::DynamoLeaseStore;
    let mut updating = lease_table_json(Some("CREATING"));
    updating["TableStatus"] = serde_json::json!("UPDATING");
    let fake = fake::Fake::start(vec![
        (200, serde_json::json!({"Table": updating})),
        (
            200,
            serde_json::json!({"Items": [{"leaseKey": {"S": "shardId-000000000000"}, "leaseOwner": {"S": "w1#a"}, "leaseCounter": {"N": "3"}, "checkpoint": {"S": "TRIM_HORIZON"}}], "Count": 1}),
        ),
    ]);
    let client = dynamodb_at(&fake);
    within(async {
        let store = DynamoLeaseStore::new(client, "old-leases");
        store.ensure_table().await.expect("ensure_table");
        assert_eq!(
            store.owned_keys("w1#a").await.expect("owned_keys"),
            vec!["shardId-000000000000".to_owned()]
        );
    })
    .await;
    assert_eq!(fake.ops(), vec!["DescribeTable", "Scan"]);
}

/// A new group's start-up touches one table: the lease table is described, created
/// once and described until ACTIVE, and the leader item is placed in it (one PutItem);
/// no second table is described, created or waited for.
/// Regression: every new group also created `<lease table>-coordinator` and waited for
/// it to become ACTIVE before its first lease round.
#[tokio::test]
async fn wire_a_new_group_starts_on_one_table() {
    use shardflow::lease::dynamo::DynamoLeaseStore;
    let not_found = serde_json::json!({
        "__type": "com.amazonaws.dynamodb.v20120810#ResourceNotFoundException",
        "message": "Requested resource not found"
    });
    let mut creating = lease_table_json(Some("CREATING"));
    creating["TableStatus"] = serde_json::json!("CREATING");
    let fake = fake::Fake::start(vec![
        (400, not_found),
        (200, serde_json::json!({"TableDescription": creating})),
        (
            200,
            serde_json::json!({"Table": lease_table_json(Some("ACTIVE"))}),
        ),
        (200, serde_json::json!({})),
    ]);
    let client = dynamodb_at(&fake);
    within(async {
        let store = DynamoLeaseStore::new(client, "old-leases");
        store.ensure_table().await.expect("ensure_table");
        let state = store.coordinator_state().expect("a leader state");
        state.ensure_table().await.expect("place the leader item");
    })
    .await;
    assert_eq!(
        fake.ops(),
        vec!["DescribeTable", "CreateTable", "DescribeTable", "PutItem"]
    );
    for request in fake.seen() {
        assert_eq!(
            request.body["TableName"], "old-leases",
            "{}: {}",
            request.target, request.body
        );
    }
    let put = &fake.seen()[3].body;
    assert_eq!(put["Item"]["entityType"]["S"], "SHARDFLOW_LEADER", "{put}");
}

/// A lease table with provisioned capacity (as KCL 1.x creates them) gets
/// the owner index with the table's own capacity: DynamoDB refuses an index without
/// one there, and the workers would scan the table in every light round for good.
#[tokio::test]
async fn wire_a_provisioned_table_gets_an_index_with_capacity() {
    use shardflow::lease::dynamo::DynamoLeaseStore;
    let mut provisioned = lease_table_json(None);
    provisioned["ProvisionedThroughput"] =
        serde_json::json!({"ReadCapacityUnits": 10, "WriteCapacityUnits": 5});
    let fake = fake::Fake::start(vec![
        (200, serde_json::json!({"Table": provisioned})),
        (
            200,
            serde_json::json!({"TableDescription": lease_table_json(Some("CREATING"))}),
        ),
    ]);
    let client = dynamodb_at(&fake);
    within(async {
        let store = DynamoLeaseStore::new(client, "old-leases");
        store.ensure_table().await.expect("ensure_table");
    })
    .await;
    let seen = fake.seen();
    let create = &seen[1].body["GlobalSecondaryIndexUpdates"][0]["Create"];
    assert_eq!(
        create["ProvisionedThroughput"],
        serde_json::json!({"ReadCapacityUnits": 10, "WriteCapacityUnits": 5})
    );
}

/// A lease table without the owner index (an older shardflow's, a KCL 1/2
/// application's) is upgraded in place at start-up: UpdateTable adds the KCL 3's index
/// (keys `leaseOwner` and `leaseKey`, keys only). Until it is ACTIVE `owned_keys` scans
/// and filters; once it is, it queries the index. (dynalite accepts an UpdateTable
/// adding an index but never builds it, so a scripted endpoint plays DynamoDB here.)
#[tokio::test]
async fn wire_a_table_without_the_owner_index_is_upgraded_in_place() {
    use shardflow::lease::dynamo::DynamoLeaseStore;
    let row = |key: &str, owner: &str| {
        serde_json::json!({
            "leaseKey": {"S": key},
            "leaseOwner": {"S": owner},
            "leaseCounter": {"N": "3"},
            "checkpoint": {"S": "TRIM_HORIZON"},
        })
    };
    let fake = fake::Fake::start(vec![
        (200, serde_json::json!({"Table": lease_table_json(None)})),
        (
            200,
            serde_json::json!({"TableDescription": lease_table_json(Some("CREATING"))}),
        ),
        (
            200,
            serde_json::json!({"Items": [row("shardId-000000000000", "w1#a"), row("shardId-000000000001", "w2#b")], "Count": 2}),
        ),
        (
            200,
            serde_json::json!({"Table": lease_table_json(Some("ACTIVE"))}),
        ),
        (
            200,
            serde_json::json!({"Items": [{"leaseKey": {"S": "shardId-000000000000"}, "leaseOwner": {"S": "w1#a"}}], "Count": 1}),
        ),
    ]);
    let client = dynamodb_at(&fake);
    within(async {
        let upgrading = DynamoLeaseStore::new(client.clone(), "old-leases");
        upgrading.ensure_table().await.expect("ensure_table");
        // The index is being built: a Scan, filtered.
        assert_eq!(
            upgrading.owned_keys("w1#a").await.expect("owned_keys"),
            vec!["shardId-000000000000".to_owned()]
        );
        // A store that finds it ACTIVE queries it.
        let upgraded = DynamoLeaseStore::new(client, "old-leases");
        assert_eq!(
            upgraded.owned_keys("w1#a").await.expect("owned_keys"),
            vec!["shardId-000000000000".to_owned()]
        );
    })
    .await;
    let seen = fake.seen();
    assert_eq!(
        fake.ops(),
        vec![
            "DescribeTable",
            "UpdateTable",
            "Scan",
            "DescribeTable",
            "Query"
        ]
    );
    let update = &seen[1].body;
    let create = &update["GlobalSecondaryIndexUpdates"][0]["Create"];
    assert_eq!(create["IndexName"], "LeaseOwnerToLeaseKeyIndex");
    assert_eq!(
        create["KeySchema"],
        serde_json::json!([
            {"AttributeName": "leaseOwner", "KeyType": "HASH"},
            {"AttributeName": "leaseKey", "KeyType": "RANGE"}
        ])
    );
    assert_eq!(create["Projection"]["ProjectionType"], "KEYS_ONLY");
    assert!(
        update["AttributeDefinitions"].as_array().is_some_and(|a| a
            .iter()
            .any(|d| d["AttributeName"] == "leaseOwner" && d["AttributeType"] == "S")),
        "{update}"
    );
    let query = &seen[4].body;
    assert_eq!(query["IndexName"], "LeaseOwnerToLeaseKeyIndex");
    assert_eq!(query["ExpressionAttributeValues"][":owner"]["S"], "w1#a");
}

/// A worker that may not query the owner index (no `dynamodb:Query` on it) lists the
/// table instead: a worker that could not read its own keys would never adopt a lease
/// handed to it.
#[tokio::test]
async fn wire_an_owner_index_that_cannot_be_queried_falls_back_to_a_scan() {
    use shardflow::lease::dynamo::DynamoLeaseStore;
    let fake = fake::Fake::start(vec![
        (
            200,
            serde_json::json!({"Table": lease_table_json(Some("ACTIVE"))}),
        ),
        (
            400,
            serde_json::json!({"__type": "com.amazon.coral.service#AccessDeniedException", "message": "not authorized to perform: dynamodb:Query"}),
        ),
        (
            200,
            serde_json::json!({"Items": [{"leaseKey": {"S": "shardId-000000000007"}, "leaseOwner": {"S": "w1#a"}, "leaseCounter": {"N": "1"}, "checkpoint": {"S": "LATEST"}}], "Count": 1}),
        ),
    ]);
    let store = DynamoLeaseStore::new(dynamodb_at(&fake), "old-leases");
    within(async {
        assert_eq!(
            store.owned_keys("w1#a").await.expect("owned_keys"),
            vec!["shardId-000000000007".to_owned()]
        );
    })
    .await;
    assert_eq!(fake.ops(), vec!["DescribeTable", "Query", "Scan"]);
}

/// A row with a malformed attribute (written by hand or another tool) is listed as
/// unreadable with the reason, not skipped, and no write conditioned on what the
/// listing gave is sent: the item stays exactly as it was.
///
/// Regression: the listing skipped such a row, so a worker counted its shard as
/// finished and read its children.
#[tokio::test]
async fn a_row_with_a_malformed_attribute_is_listed_unreadable_and_never_written() {
    let Some(aws) = aws().await else { return };
    within(async {
        use aws_sdk_dynamodb::types::AttributeValue;
        let table = unique("leases");
        let store = aws.lease_store(&table);
        store.ensure_table().await.expect("ensure_table");
        let good = Lease::new("shardId-000000000001", Vec::new(), Checkpoint::TrimHorizon);
        let bad = Lease::new("shardId-000000000002", Vec::new(), Checkpoint::TrimHorizon);
        assert!(store.create(&good).await.expect("create"));
        assert!(store.create(&bad).await.expect("create"));
        let client = aws.dynamodb_client();
        client
            .update_item()
            .table_name(&table)
            .key("leaseKey", AttributeValue::S(bad.key.clone()))
            .update_expression("SET checkpoint = :n")
            .expression_attribute_values(":n", AttributeValue::N("12".into()))
            .send()
            .await
            .expect("UpdateItem");
        let raw = || async {
            client
                .get_item()
                .table_name(&table)
                .key("leaseKey", AttributeValue::S(bad.key.clone()))
                .consistent_read(true)
                .send()
                .await
                .expect("GetItem")
                .item
        };
        let before = raw().await;

        let mut listed = store.list().await.expect("list");
        listed.sort_by(|a, b| a.key.cmp(&b.key));
        assert_eq!(listed.len(), 2, "{listed:?}");
        assert_eq!(listed[0], good);
        assert_eq!(listed[1].key, bad.key);
        let reason = listed[1].unreadable.clone().expect("listed as unreadable");
        assert!(reason.contains("checkpoint"), "{reason}");
        let fetched = store.get(&bad.key).await.expect("get").expect("the row");
        assert!(fetched.unreadable.is_some(), "{fetched:?}");

        let stand_in = &listed[1];
        assert!(matches!(
            store.take(stand_in, "w1#a").await,
            Err(LeaseError::Corrupt(_))
        ));
        assert!(matches!(
            store.renew(stand_in).await,
            Err(LeaseError::Corrupt(_))
        ));
        assert!(matches!(
            store.checkpoint(stand_in, &Checkpoint::ShardEnd).await,
            Err(LeaseError::Corrupt(_))
        ));
        assert!(matches!(
            store.release(stand_in).await,
            Err(LeaseError::Corrupt(_))
        ));
        assert!(matches!(
            store.delete(stand_in).await,
            Err(LeaseError::Corrupt(_))
        ));
        assert!(!store.create(&bad).await.expect("create"), "the row exists");
        assert_eq!(raw().await, before, "the malformed row was written");
    })
    .await;
}
