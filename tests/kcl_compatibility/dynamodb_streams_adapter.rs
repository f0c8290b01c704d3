//! Moving an application on the KCL's DynamoDB Streams Kinesis Adapter to shardflow in
//! place and back, over real HTTP against the DynamoDB emulator
//! (`scripts/test.sh --test kcl_compatibility dynamodb_streams_adapter`; skipped when
//! `SHARDFLOW_EMULATORS` is unset).
//!
//! The lease table is written as the adapter leaves it (the rows of
//! `tests/fixtures/dynamodb_streams_adapter`: 1.x and 2.x rows, DynamoDB Streams shard
//! ids, zero-padded 21-digit sequence numbers, the range 0..1, a finished parent with its
//! single rollover child, a child at `TRIM_HORIZON`, a row of a shard trimmed from the
//! stream, deleted as the adapter deletes it). The table's stream is served by a small in-test source shaped as DynamoDB
//! Streams shapes it (one child per rollover, no hash ranges, a closed empty shard). A
//! shardflow consumer pointed at the table handles exactly the records after each
//! checkpoint (0 lost, 0 re-read), and the rows it leaves are rows the adapter reads and
//! can hand to the DynamoDB Streams API: checkpoints as the API gave them, at most one
//! parent, children at a shard's end, the adapter's own rows intact.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType,
    ScalarAttributeType,
};
use bytes::Bytes;
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, Record, RecordsPage, ShardInfo,
    StartingPosition,
};
use shardflow::lease::LeaseStore;
use shardflow::{Aws, Backend, Consumer, ErrorDetail, SequenceNumber};
use testkit::*;

use super::migration::assert_kcl_reads;

const TEST_LIMIT: Duration = Duration::from_secs(600);

/// A finished parent (its row at SHARD_END, naming its one child).
const P1: &str = "shardId-00000001764820800000-9e1d7c42";
/// P1's rollover child, closed, checkpointed in the middle by a stopped KCL 3 worker.
const C1: &str = "shardId-00000001764835200000-3f9c2a1b";
/// C1's rollover child, open; its row created by the adapter at TRIM_HORIZON.
const G1: &str = "shardId-00000001764849600000-c07a55e3";
/// Another partition's shard, open, checkpointed by an adapter 1.x worker.
const Q: &str = "shardId-00000001764835200000-5b2e9d07";
/// A shard that closed without records, its row at TRIM_HORIZON.
const E: &str = "shardId-00000001764806400000-0d4f6a88";
/// E's child, open, not in the table yet (the adapter had not synced it).
const F: &str = "shardId-00000001764849600000-71e3b0c5";
/// The table's stream.
const STREAM_ARN: &str =
    "arn:aws:dynamodb:us-east-1:123456789012:table/orders/stream/2026-12-04T08:00:00.000";
/// A shard trimmed from the stream (past 24 h), its row not yet deleted.
const TRIMMED: &str = "shardId-00000001764748800000-aa11bb22";

/// One shard of the in-test table stream.
struct FakeShard {
    info: ShardInfo,
    records: Vec<Record>,
    closed: bool,
}

/// A table's stream as the DynamoDB Streams API shows it: shards with one parent at
/// most, the whole hash range, 21-digit zero-padded sequence numbers (DynamoDB Local's
/// form), no aggregation, records appended by the test.
struct TableStream {
    shards: Mutex<Vec<FakeShard>>,
    next_sequence: Mutex<u64>,
}

impl TableStream {
    fn new() -> Self {
        TableStream {
            shards: Mutex::new(Vec::new()),
            next_sequence: Mutex::new(300),
        }
    }

    fn sequence(&self) -> SequenceNumber {
        let mut next = self.next_sequence.lock().unwrap();
        *next += 1;
        SequenceNumber::new(format!("{:021}", *next)).unwrap()
    }

    fn add_shard(&self, id: &str, parent: Option<&str>) {
        let start = self.sequence();
        self.shards.lock().unwrap().push(FakeShard {
            info: ShardInfo {
                shard_id: id.to_owned(),
                parent_shard_id: parent.map(str::to_owned),
                adjacent_parent_shard_id: None,
                starting_hash_key: 0,
                ending_hash_key: u128::MAX,
                starting_sequence_number: start,
                ending_sequence_number: None,
            },
            records: Vec::new(),
            closed: false,
        });
    }

    /// Appends records with `values` to shard `id`; returns their sequence numbers.
    fn append(&self, id: &str, values: impl IntoIterator<Item = usize>) -> Vec<SequenceNumber> {
        let mut out = Vec::new();
        for value in values {
            let sequence = self.sequence();
            let mut shards = self.shards.lock().unwrap();
            let shard = shards.iter_mut().find(|s| s.info.shard_id == id).unwrap();
            assert!(!shard.closed, "{id} is closed");
            shard.records.push(Record {
                sequence_number: sequence.clone(),
                partition_key: format!("item-{}", value % 7),
                data: Bytes::from(value.to_string()),
                approximate_arrival: None,
            });
            out.push(sequence);
        }
        out
    }

    fn close(&self, id: &str) {
        let end = self.sequence();
        let mut shards = self.shards.lock().unwrap();
        let shard = shards.iter_mut().find(|s| s.info.shard_id == id).unwrap();
        shard.closed = true;
        shard.info.ending_sequence_number = Some(
            shard
                .records
                .last()
                .map(|r| r.sequence_number.clone())
                .unwrap_or(end),
        );
    }
}

fn not_found(what: &str) -> KinesisError {
    KinesisError::NotFound(ErrorDetail::new(what))
}

#[async_trait]
impl KinesisApi for TableStream {
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        if stream != STREAM_ARN {
            return Err(not_found(stream));
        }
        Ok(self
            .shards
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.info.clone())
            .collect())
    }

    async fn is_updating(&self, _stream: &str) -> Result<bool, KinesisError> {
        Ok(false)
    }

    fn records_may_be_aggregated(&self) -> bool {
        false
    }

    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        if stream != STREAM_ARN {
            return Err(not_found(stream));
        }
        let shards = self.shards.lock().unwrap();
        let shard = shards
            .iter()
            .find(|s| s.info.shard_id == shard_id)
            .ok_or_else(|| not_found(shard_id))?;
        let records = &shard.records;
        let index = match from {
            StartingPosition::TrimHorizon => 0,
            StartingPosition::Latest => records.len(),
            StartingPosition::AtSequenceNumber(seq) => {
                records.partition_point(|r| r.sequence_number < *seq)
            }
            StartingPosition::AfterSequenceNumber(seq) => {
                records.partition_point(|r| r.sequence_number <= *seq)
            }
            // Not needed here: every row holds a sequence number or a sentinel.
            StartingPosition::AtTimestamp(_) => {
                return Err(KinesisError::Unsupported("AT_TIMESTAMP".into()))
            }
        };
        Ok(format!("{shard_id}/{index}"))
    }

    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        let (shard_id, index) = iterator
            .rsplit_once('/')
            .and_then(|(s, i)| Some((s, i.parse::<usize>().ok()?)))
            .ok_or_else(|| KinesisError::Invalid(ErrorDetail::new(iterator)))?;
        let shards = self.shards.lock().unwrap();
        let shard = shards
            .iter()
            .find(|s| s.info.shard_id == shard_id)
            .ok_or_else(|| not_found(shard_id))?;
        let end = shard.records.len().min(index + limit as usize);
        let records = shard.records[index.min(end)..end].to_vec();
        let next_iterator = if shard.closed && end == shard.records.len() {
            None
        } else {
            Some(format!("{shard_id}/{end}"))
        };
        Ok(RecordsPage {
            records,
            next_iterator,
            millis_behind_latest: Some(0),
            child_shards: Vec::new(),
        })
    }

    async fn put_records(
        &self,
        _stream: &str,
        _records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        Err(KinesisError::Unsupported(
            "writes to a table's stream".into(),
        ))
    }
}

/// Leases in the emulator's DynamoDB, the table's stream from the test.
#[derive(Clone)]
struct AdapterSetup {
    aws: Aws,
    stream: Arc<TableStream>,
}

impl Backend for AdapterSetup {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        self.aws.kinesis()
    }
    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        self.aws.lease_store(table)
    }
    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        Some(self.stream.clone())
    }
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

/// An adapter 2.x row (KCL 3.4's serializer with the adapter's range 0..1).
fn v2_row(shard: &str, checkpoint: &str, parent: Option<&str>) -> HashMap<String, AttributeValue> {
    let mut row = HashMap::from([
        ("leaseKey".to_owned(), s(shard)),
        ("leaseCounter".to_owned(), n("0")),
        ("ownerSwitchesSinceCheckpoint".to_owned(), n("0")),
        ("checkpoint".to_owned(), s(checkpoint)),
        ("checkpointSubSequenceNumber".to_owned(), n("0")),
        ("startingHashKey".to_owned(), s("0")),
        ("endingHashKey".to_owned(), s("1")),
    ]);
    if let Some(parent) = parent {
        row.insert("parentShardId".to_owned(), ss(&[parent]));
    }
    row
}

/// Checks `item` is a row the adapter reads and can resume from: the KCL's names and
/// types, a checkpoint the DynamoDB Streams API accepts (a sentinel, or 21 to 40
/// digits), no sub-sequence, at most one parent.
fn assert_adapter_reads(item: &HashMap<String, AttributeValue>) {
    assert_kcl_reads(item);
    let what = format!("{item:?}");
    let Some(AttributeValue::S(checkpoint)) = item.get("checkpoint") else {
        panic!("{what}")
    };
    assert!(
        ["TRIM_HORIZON", "LATEST", "SHARD_END", "AT_TIMESTAMP"].contains(&checkpoint.as_str())
            || (21..=40).contains(&checkpoint.len()),
        "a checkpoint DynamoDB Streams refuses: {what}"
    );
    assert_eq!(item["checkpointSubSequenceNumber"], n("0"), "{what}");
    if let Some(AttributeValue::Ss(parents)) = item.get("parentShardId") {
        assert_eq!(parents.len(), 1, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapter_table_is_taken_over_with_nothing_lost_or_re_read_and_handed_back() {
    if !emulators_enabled() {
        return;
    }
    within(TEST_LIMIT, "the adapter take-over", take_over()).await;
}

async fn take_over() {
    let aws = Aws::from_env().await;
    let dynamo = aws.dynamodb_client().clone();
    let table = unique("ddb-adapter-app");

    // The table's stream: two rollovers on one partition, an open shard on another, a
    // shard that closed empty and its child.
    let source = Arc::new(TableStream::new());
    source.add_shard(P1, None);
    source.append(P1, 0..10);
    source.close(P1);
    source.add_shard(C1, Some(P1));
    let c1 = source.append(C1, 10..20);
    source.close(C1);
    source.add_shard(G1, Some(C1));
    source.append(G1, 20..30);
    source.add_shard(Q, None);
    let q = source.append(Q, 100..110);
    source.add_shard(E, None);
    source.close(E);
    source.add_shard(F, Some(E));
    source.append(F, 200..205);
    let expected: BTreeSet<usize> = (15..30).chain(105..110).chain(200..205).collect();

    // The adapter's table, as its stopped fleet left it.
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
    aws.lease_store(&table).ensure_table().await.unwrap();
    let mut p1 = v2_row(P1, "SHARD_END", None);
    p1.insert("leaseCounter".into(), n("3388"));
    p1.insert("childShardIds".into(), ss(&[C1]));
    // A stopped KCL 3 worker's row in the middle of C1.
    let mut c1_row = v2_row(C1, c1[4].as_str(), Some(P1));
    c1_row.insert("checkpoint".into(), s(&format!("{:0>21}", c1[4].as_str())));
    c1_row.insert(
        "leaseOwner".into(),
        s("5d0e4b8a-1c2f-4e6a-8b3d-7f9a0c1e2d3b"),
    );
    c1_row.insert("leaseCounter".into(), n("871"));
    c1_row.insert("ownerSwitchesSinceCheckpoint".into(), n("1"));
    c1_row.insert("throughputKBps".into(), n("0.8125"));
    let g1 = v2_row(G1, "TRIM_HORIZON", Some(C1));
    // An adapter 1.x row (no range), kept through a move from 1.x to 2.x.
    let q_row = HashMap::from([
        ("leaseKey".to_owned(), s(Q)),
        (
            "leaseOwner".to_owned(),
            s("ip-10-0-1-17:2b7e5f0c-8d41-4a3e-9c6f-5a1d2e3f4b5c"),
        ),
        ("leaseCounter".to_owned(), n("2214")),
        ("ownerSwitchesSinceCheckpoint".to_owned(), n("0")),
        (
            "checkpoint".to_owned(),
            s(&format!("{:0>21}", q[4].as_str())),
        ),
        ("checkpointSubSequenceNumber".to_owned(), n("0")),
    ]);
    let e = v2_row(E, "TRIM_HORIZON", None);
    let mut trimmed = v2_row(TRIMMED, "SHARD_END", None);
    trimmed.insert("childShardIds".into(), ss(&[P1]));
    let written = [p1, c1_row, g1, q_row, e, trimmed];
    for row in &written {
        assert_adapter_reads(row);
        dynamo
            .put_item()
            .table_name(&table)
            .set_item(Some(row.clone()))
            .send()
            .await
            .unwrap();
    }

    // shardflow, pointed at the adapter application's table.
    let setup = AdapterSetup {
        aws: aws.clone(),
        stream: source.clone(),
    };
    let recorder = Recorder::default();
    let group = unique("orders-cdc");
    let running = start(
        test_timings(
            Consumer::builder()
                .table_stream_arn(STREAM_ARN)
                .group(&group)
                .worker_id("w1")
                .backend(setup),
        )
        .lease_table(&table)
        .build()
        .unwrap(),
        &recorder,
    );
    recorder
        .wait_for(expected.len(), Duration::from_secs(120))
        .await;
    // Nothing re-read: within a shard records arrive in order, so a record delivered
    // twice would come before its shard's sentinel.
    let mut sentinels = Vec::new();
    for (i, shard) in [G1, Q, F].into_iter().enumerate() {
        source.append(shard, [1_000 + i]);
        sentinels.push(1_000 + i);
    }
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

    // Handed back: every row is one the adapter reads and resumes from.
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
        assert_adapter_reads(item);
        // Claimed for the stream (the adapter's single-stream reader ignores it).
        if let Some(stream) = item.get("streamName") {
            assert_eq!(stream, &s(STREAM_ARN), "{item:?}");
        }
        assert!(
            !item.contains_key("leaseOwner"),
            "released on shutdown: {item:?}"
        );
    }
    // Where each shard was left: the last record's sequence number as the API gave it,
    // or SHARD_END for a closed shard read to its end, naming its one child.
    let last_of = |shard: &str| {
        let shards = source.shards.lock().unwrap();
        let shard = shards.iter().find(|s| s.info.shard_id == shard).unwrap();
        format!(
            "{:0>21}",
            shard.records.last().unwrap().sequence_number.as_str()
        )
    };
    for shard in [G1, Q, F] {
        assert_eq!(by_key[shard]["checkpoint"], s(&last_of(shard)), "{shard}");
        assert_eq!(by_key[shard]["ownerSwitchesSinceCheckpoint"], n("0"));
    }
    assert_eq!(by_key[C1]["checkpoint"], s("SHARD_END"));
    assert_eq!(by_key[C1].get("childShardIds"), Some(&ss(&[G1])));
    assert_eq!(by_key[E]["checkpoint"], s("SHARD_END"));
    assert_eq!(by_key[E].get("childShardIds"), Some(&ss(&[F])));
    // The row shardflow created for the adapter's missing child names its parent.
    assert_eq!(by_key[F].get("parentShardId"), Some(&ss(&[E])));
    // The adapter's attributes on the rows shardflow advanced are kept: its range, and
    // the KCL 3 throughput it balances by.
    assert_eq!(by_key[C1]["endingHashKey"], s("1"));
    assert_eq!(by_key[G1]["endingHashKey"], s("1"));
    assert_eq!(by_key[C1].get("throughputKBps"), Some(&n("0.8125")));
    // The adapter's own finished rows are as it left them.
    let stripped = |item: &HashMap<String, AttributeValue>| {
        let mut item = item.clone();
        item.remove("streamName");
        item
    };
    assert_eq!(
        by_key.get(P1).map(stripped).as_ref(),
        Some(&written[0]),
        "{:?}",
        by_key.keys()
    );
    // The row of a shard trimmed from the stream is deleted, finished and its child
    // started, as the adapter's shard syncer deletes it.
    assert!(!by_key.contains_key(TRIMMED), "{:?}", by_key.keys());
}
