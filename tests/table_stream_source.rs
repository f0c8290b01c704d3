//! The table-stream source seam on the embedded backend: a consumer built with
//! `table_stream` / `table_stream_arn` reads through `Backend::table_streams`, resolves a
//! table to its stream at start, and never splits a record as a KPL aggregate.
//!
//! The table streams here are a memory stream named by a stream ARN behind a wrapper
//! that answers as a table-stream source does, so the test needs no emulator.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardflow::aggregation::Aggregator;
use shardflow::kinesis::{KinesisApi, KinesisError, PutRecord, StreamAdmin};
use shardflow::lease::LeaseStore;
use shardflow::{Backend, ConfigError, Consumer, Memory};
use testkit::hooks::{Forward, ForwardKinesis};

const ARN: &str =
    "arn:aws:dynamodb:memory:000000000000:table/orders/stream/2026-01-01T00:00:00.000";

/// A memory stream answering as a table's stream: resolves table `orders` to [`ARN`]
/// (after as many throttled answers as `throttled` says), and its records are never
/// aggregates.
struct TableLike(Arc<dyn KinesisApi>, Arc<AtomicUsize>);

#[async_trait::async_trait]
impl ForwardKinesis for TableLike {
    fn inner(&self) -> &dyn KinesisApi {
        &*self.0
    }
    async fn resolve_table_stream(&self, table: &str) -> Result<String, KinesisError> {
        let throttle = self
            .1
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if throttle {
            return Err(KinesisError::Throttled("DescribeTable: slow down".into()));
        }
        match table {
            "orders" => Ok(ARN.to_owned()),
            other => Err(KinesisError::NotFound(
                format!("table {other} has no stream").into(),
            )),
        }
    }
    fn records_may_be_aggregated(&self) -> bool {
        false
    }
}

/// The embedded backend with [`TableLike`] as its table streams (or none).
#[derive(Clone)]
struct WithTables {
    memory: Memory,
    tables: bool,
    /// Resolutions still to be answered "throttled".
    throttled: Arc<AtomicUsize>,
}

impl Backend for WithTables {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        self.memory.kinesis()
    }
    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        self.memory.lease_store(table)
    }
    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        self.tables.then(|| {
            Arc::new(Forward(TableLike(
                self.memory.kinesis(),
                self.throttled.clone(),
            ))) as Arc<dyn KinesisApi>
        })
    }
}

/// One record holding three "user records" in the KPL's format.
fn aggregate_bytes() -> bytes::Bytes {
    let mut aggregator = Aggregator::new();
    for i in 0..3 {
        let put = PutRecord {
            data: i.to_string().into(),
            partition_key: format!("key-{i}"),
            explicit_hash_key: None,
        };
        assert!(aggregator.add(put).unwrap().is_none());
    }
    aggregator.flush().unwrap().data
}

async fn backend_with_stream() -> WithTables {
    let memory = Memory::new();
    memory.streams().create_stream(ARN, 1).await.unwrap();
    let backend = WithTables {
        memory,
        tables: true,
        throttled: Arc::default(),
    };
    backend
        .memory
        .kinesis()
        .put_records(
            ARN,
            &[PutRecord {
                data: aggregate_bytes(),
                partition_key: "item".into(),
                explicit_hash_key: None,
            }],
        )
        .await
        .unwrap();
    backend
}

/// Runs `consumer` until a record was handled, and returns the (stream, payload) of
/// every record handled.
async fn payloads(consumer: Consumer) -> Vec<(String, bytes::Bytes)> {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let seen = seen.clone();
        tower::service_fn(move |msg: shardflow::Message| {
            seen.lock()
                .unwrap()
                .push((msg.metadata.stream.to_string(), msg.payload.clone()));
            async { Ok::<_, std::convert::Infallible>(()) }
        })
    };
    let running = testkit::start_service(consumer, handler);
    let handled = seen.clone();
    testkit::within(Duration::from_secs(30), "a record is handled", async move {
        while handled.lock().unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    // Long enough for the rest of a split aggregate to arrive, were it split.
    tokio::time::sleep(Duration::from_millis(300)).await;
    running.stop().await;
    let seen = seen.lock().unwrap().clone();
    seen
}

#[tokio::test]
async fn a_table_stream_record_is_never_split_as_an_aggregate() {
    let backend = backend_with_stream().await;
    let consumer = Consumer::builder()
        .table_stream_arn(ARN)
        .group("cdc")
        .backend(backend)
        .idle_read_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let seen = payloads(consumer).await;
    assert_eq!(seen.len(), 1, "one record, delivered whole: {seen:?}");
    assert_eq!(seen[0].1, aggregate_bytes());
}

#[tokio::test]
async fn a_table_is_resolved_to_its_stream_when_the_consumer_starts() {
    let backend = backend_with_stream().await;
    // Throttled twice first: retried, not fatal.
    backend.throttled.store(2, Ordering::SeqCst);
    let throttled = backend.throttled.clone();
    let consumer = Consumer::builder()
        .table_stream("orders")
        .group("cdc")
        .backend(backend)
        .retry_backoff(Duration::from_millis(5), Duration::from_millis(20))
        .idle_read_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let seen = payloads(consumer).await;
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].0, ARN, "messages name the stream ARN");
    assert_eq!(
        throttled.load(Ordering::SeqCst),
        0,
        "both throttled answers were seen"
    );
}

#[test]
fn a_backend_without_table_streams_is_refused_at_build() {
    let backend = WithTables {
        memory: Memory::new(),
        tables: false,
        throttled: Arc::default(),
    };
    match Consumer::builder()
        .table_stream("orders")
        .group("cdc")
        .backend(backend)
        .build()
    {
        Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "backend"),
        other => panic!(
            "expected a refusal naming the backend, got {:?}",
            other.err()
        ),
    }
}
