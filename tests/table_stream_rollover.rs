//! A table's stream over simulated hours on the embedded backend, where DynamoDB
//! Streams differs from Kinesis: shards that stay open and empty for hours and roll over
//! empty, parents trimmed away (24 h) while their children are open, and iterators that
//! expire after 15 minutes while a handler is slow. Every change handled, none twice,
//! none skipped; an idle shard is idle (ready, not stuck), read without a busy loop. A
//! group started by table name follows the table when its stream is disabled and
//! enabled again (a new stream); calls refused by a policy are typed errors that make
//! the worker stop (at start) or not ready (reads), never a silent stall; items near
//! the 400 KB limit are handled whole. Tokio's paused clock drives the backend's wall
//! clock too.

use std::collections::HashMap;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use shardflow::dynamodb_streams::ChangeRecord;
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, RecordsPage, ShardInfo, StartingPosition,
};
use shardflow::lease::{Checkpoint, LeaseStore};
use shardflow::{Backend, Consumer, Memory, Message};

use testkit::within;

const LIMIT: Duration = Duration::from_secs(600);
const HOUR: Duration = Duration::from_secs(3600);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Item {
    id: String,
    version: u64,
}

/// The embedded backend with its table streams behind a wrapper that counts the calls.
#[derive(Clone)]
struct Counted {
    memory: Memory,
    api: Arc<Counting>,
}

#[derive(Default)]
struct Calls {
    get_records: AtomicU64,
    shard_iterator: AtomicU64,
    list_shards: AtomicU64,
    /// DescribeTable calls left unanswered (see [`Counting::hang_describe_table`]).
    hung_describe_table: AtomicU64,
}

struct Counting {
    inner: Arc<dyn KinesisApi>,
    calls: Calls,
    /// The call refused with `AccessDenied` (an IAM policy without it), if any.
    deny: Mutex<Option<&'static str>>,
    /// DescribeTable never answers (a hung connection without a client timeout).
    hang_describe_table: AtomicBool,
}

impl Counting {
    fn denied(&self, op: &'static str) -> Result<(), KinesisError> {
        if *self.deny.lock().unwrap() == Some(op) {
            return Err(KinesisError::AccessDenied(
                format!("AccessDeniedException: not authorized to perform dynamodb:{op}").into(),
            ));
        }
        Ok(())
    }
}

impl Counted {
    fn new(memory: &Memory) -> Self {
        let inner: Arc<dyn KinesisApi> = memory.streams().clone();
        Counted {
            memory: memory.clone(),
            api: Arc::new(Counting {
                inner,
                calls: Calls::default(),
                deny: Mutex::new(None),
                hang_describe_table: AtomicBool::new(false),
            }),
        }
    }

    fn get_records(&self) -> u64 {
        self.api.calls.get_records.load(Ordering::SeqCst)
    }

    fn shard_iterators(&self) -> u64 {
        self.api.calls.shard_iterator.load(Ordering::SeqCst)
    }

    fn list_shards(&self) -> u64 {
        self.api.calls.list_shards.load(Ordering::SeqCst)
    }
}

impl Backend for Counted {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        self.memory.kinesis()
    }

    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        self.memory.lease_store(table)
    }

    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        Some(self.api.clone())
    }
}

#[async_trait]
impl KinesisApi for Counting {
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        self.calls.list_shards.fetch_add(1, Ordering::SeqCst);
        self.denied("DescribeStream")?;
        self.inner.list_shards(stream).await
    }

    async fn is_updating(&self, stream: &str) -> Result<bool, KinesisError> {
        self.inner.is_updating(stream).await
    }

    async fn resolve_table_stream(&self, table: &str) -> Result<String, KinesisError> {
        if self.hang_describe_table.load(Ordering::SeqCst) {
            self.calls
                .hung_describe_table
                .fetch_add(1, Ordering::SeqCst);
            return std::future::pending().await;
        }
        self.inner.resolve_table_stream(table).await
    }

    fn records_may_be_aggregated(&self) -> bool {
        self.inner.records_may_be_aggregated()
    }

    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        self.calls.shard_iterator.fetch_add(1, Ordering::SeqCst);
        self.inner.shard_iterator(stream, shard_id, from).await
    }

    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        self.calls.get_records.fetch_add(1, Ordering::SeqCst);
        self.denied("GetRecords")?;
        self.inner.get_records(iterator, limit).await
    }

    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        self.inner.put_records(stream, records).await
    }
}

/// An embedded backend whose wall clock is tokio's (paused) clock from a fixed date.
fn memory() -> Memory {
    let origin = tokio::time::Instant::now();
    let date = UNIX_EPOCH + Duration::from_secs(1_780_000_000);
    Memory::builder()
        .wall_clock(move || date + origin.elapsed())
        .build()
}

/// Each item's versions in the order they were handled.
type Seen = Arc<Mutex<HashMap<String, Vec<u64>>>>;

fn handler(
    seen: &Seen,
    slow: Option<(String, Duration)>,
) -> impl tower::Service<Message, Response = (), Error = std::io::Error, Future: Send> + Clone {
    let seen = seen.clone();
    let slowed = Arc::new(Mutex::new(false));
    tower::service_fn(move |msg: Message| {
        let (seen, slow, slowed) = (seen.clone(), slow.clone(), slowed.clone());
        async move {
            let change = ChangeRecord::from_payload(&msg.payload).expect("a change record");
            let item: Item = change.new_image_as().expect("decodes").expect("a put");
            if let Some((id, pause)) = slow {
                // Only the first call for that item is slow.
                let first = item.id == id && !std::mem::replace(&mut *slowed.lock().unwrap(), true);
                if first {
                    tokio::time::sleep(pause).await;
                }
            }
            seen.lock()
                .unwrap()
                .entry(item.id)
                .or_default()
                .push(item.version);
            Ok(())
        }
    })
}

fn put(memory: &Memory, id: &str, version: u64) {
    memory
        .tables()
        .table("orders")
        .unwrap()
        .put(&Item {
            id: id.to_owned(),
            version,
        })
        .unwrap()
        .expect("a new version is a change");
}

async fn wait_handled(seen: &Seen, id: &str, version: u64) {
    within(LIMIT, &format!("{id} v{version} handled"), async {
        while !seen
            .lock()
            .unwrap()
            .get(id)
            .is_some_and(|v| v.contains(&version))
        {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_shard_open_and_empty_for_hours_is_idle_not_stuck_and_read_without_a_busy_loop() {
    let memory = memory();
    memory
        .tables()
        .create("orders", "id")
        .rollover_every(4 * HOUR)
        .build()
        .unwrap();
    let backend = Counted::new(&memory);
    let seen = Seen::default();
    let running = Consumer::builder()
        .table_stream("orders")
        .group("indexer")
        .worker_id("w1")
        .backend(backend.clone())
        .build()
        .unwrap()
        .run(handler(&seen, None))
        .spawn();
    put(&memory, "a", 1);
    wait_handled(&seen, "a", 1).await;

    // Nine quiet hours: two rollovers of shards that closed with no record.
    let (reads, iterators) = (backend.get_records(), backend.shard_iterators());
    for hour in 1..=9 {
        tokio::time::sleep(HOUR).await;
        let health = running.health();
        assert!(health.is_ready(), "hour {hour}: {health:?}");
        assert!(
            health.shards.iter().all(|s| s.stuck_for.is_none()),
            "hour {hour}: an idle shard is not stuck: {health:?}"
        );
    }
    let reads = backend.get_records() - reads;
    let iterators = backend.shard_iterators() - iterators;
    // One shard of the lineage is read at a time, once per idle read interval (1 s);
    // a busy loop would read as often as the service lets it (5 a second).
    let seconds = 9 * 3600;
    assert!(
        reads <= seconds + seconds / 10,
        "{reads} GetRecords calls in {seconds} idle seconds"
    );
    assert!(
        reads >= seconds / 2,
        "the open shard is still read: {reads} calls"
    );
    // Polling goes on with each answer's next iterator: no new iterator is asked for
    // except for each new shard (three, with a few for a shard's start and end), not one
    // per 15-minute expiry, nor per read.
    assert!(
        iterators <= 16,
        "{iterators} GetShardIterator calls in 9 idle hours"
    );
    assert!(
        backend.list_shards() < 9 * 3600,
        "{} DescribeStream calls",
        backend.list_shards()
    );

    // The next change, after the quiet hours, is handled, once.
    put(&memory, "a", 2);
    wait_handled(&seen, "a", 2).await;
    running.shutdown().await.unwrap();
    assert_eq!(seen.lock().unwrap()["a"], vec![1, 2]);
    // Every shard that closed empty is finished.
    let arn = memory.tables().table("orders").unwrap().stream_arn();
    let rows = memory.table("indexer").rows();
    for shard in memory.streams().list_shards(&arn).await.unwrap() {
        if shard.is_closed() {
            let row = rows.iter().find(|r| r.key == shard.shard_id);
            assert!(
                row.is_none_or(|r| r.checkpoint == Checkpoint::ShardEnd),
                "{}: {row:?}",
                shard.shard_id
            );
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_group_started_after_its_oldest_parents_were_trimmed_reads_every_retained_change() {
    let memory = memory();
    let table = memory
        .tables()
        .create("orders", "id")
        .partitions(2)
        .rollover_every(4 * HOUR)
        .build()
        .unwrap();
    // 34 hours of writes, 10 an hour over 20 items, while nobody reads: by the end the
    // first shards closed more than a day ago and are gone, their children's records
    // partly trimmed, and the lineages' oldest retained shards have parents that are
    // not listed any more.
    let mut written: Vec<(tokio::time::Instant, String, u64)> = Vec::new();
    let mut versions: HashMap<String, u64> = HashMap::new();
    for hour in 0..34u64 {
        for n in 0..10u64 {
            let id = format!("item-{}", (hour * 10 + n) * 7 % 20);
            let version = versions.get(&id).copied().unwrap_or(0) + 1;
            put(&memory, &id, version);
            versions.insert(id.clone(), version);
            written.push((tokio::time::Instant::now(), id, version));
        }
        tokio::time::sleep(HOUR).await;
    }
    let arn = table.stream_arn();
    let listed = memory.streams().list_shards(&arn).await.unwrap();
    let orphans = listed
        .iter()
        .filter(|s| {
            s.parent_shard_id
                .as_ref()
                .is_some_and(|p| listed.iter().all(|l| &l.shard_id != p))
        })
        .count();
    assert!(orphans >= 2, "some shards' parents are gone: {listed:?}");

    let seen = Seen::default();
    let running = testkit::test_timings(
        Consumer::builder()
            .table_stream("orders")
            .group("late")
            .worker_id("w1")
            .backend(memory.clone()),
    )
    .build()
    .unwrap()
    .run(handler(&seen, None))
    .spawn();
    within(LIMIT, "caught up", memory.wait_caught_up(&arn, "late")).await;
    running.shutdown().await.unwrap();

    let seen = seen.lock().unwrap().clone();
    // Everything written within the last 23 hours is still retained: every such change
    // handled, once; nothing handled twice at all; each item's versions in order.
    let now = tokio::time::Instant::now();
    for (at, id, version) in &written {
        if now.duration_since(*at) < 23 * HOUR {
            let handled = seen.get(id).cloned().unwrap_or_default();
            assert_eq!(
                handled.iter().filter(|v| *v == version).count(),
                1,
                "{id} v{version}, written {:?} ago: {handled:?}",
                now.duration_since(*at)
            );
        }
    }
    for (id, handled) in &seen {
        assert!(
            handled.windows(2).all(|w| w[0] < w[1]),
            "{id}: in order, none twice: {handled:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn an_iterator_that_expires_while_the_handler_is_slow_is_renewed_from_the_last_handled_change(
) {
    let memory = memory();
    memory.tables().create("orders", "id").build().unwrap();
    let backend = Counted::new(&memory);
    for i in 0..50u64 {
        put(&memory, &format!("item-{i}"), 1);
    }
    let seen = Seen::default();
    // One change takes 20 minutes to handle: the reader's iterator (15 minutes) has
    // expired when it reads on.
    let running = testkit::test_timings(
        Consumer::builder()
            .table_stream("orders")
            .group("indexer")
            .worker_id("w1")
            .max_records_per_read(5)
            .backend(backend.clone()),
    )
    .lease_duration(Duration::from_secs(10))
    .build()
    .unwrap()
    .run(handler(
        &seen,
        Some(("item-7".into(), 20 * 60 * Duration::from_secs(1))),
    ))
    .spawn();
    let arn = memory.tables().table("orders").unwrap().stream_arn();
    within(HOUR, "caught up", memory.wait_caught_up(&arn, "indexer")).await;
    for i in 50..60u64 {
        put(&memory, &format!("item-{i}"), 1);
    }
    within(LIMIT, "caught up", memory.wait_caught_up(&arn, "indexer")).await;
    running.shutdown().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    for i in 0..60u64 {
        assert_eq!(
            seen.get(&format!("item-{i}")),
            Some(&vec![1]),
            "item-{i} handled once"
        );
    }
    assert!(
        backend.shard_iterators() >= 2,
        "the iterator was renewed after the slow change ({} GetShardIterator calls)",
        backend.shard_iterators()
    );
}

fn by_table(memory: &Memory, group: &str) -> shardflow::ConsumerBuilder {
    testkit::test_timings(
        Consumer::builder()
            .table_stream("orders")
            .group(group)
            .worker_id("w1")
            .backend(memory.clone()),
    )
}

async fn wait_all(seen: &Seen, items: u64, version: u64) {
    for i in 0..items {
        wait_handled(seen, &format!("item-{i}"), version).await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_group_started_by_table_name_follows_the_table_to_its_re_enabled_stream() {
    let memory = memory();
    let table = memory
        .tables()
        .create("orders", "id")
        .partitions(2)
        .build()
        .unwrap();
    let first = table.stream_arn();
    let seen = Seen::default();
    let running = by_table(&memory, "indexer")
        .build()
        .unwrap()
        .run(handler(&seen, None))
        .spawn();
    for i in 0..10 {
        put(&memory, &format!("item-{i}"), 1);
    }
    wait_all(&seen, 10, 1).await;
    // Disabled: the writes meanwhile are in no stream. Enabled again: a new stream,
    // which the group reads once the old one is finished.
    table.disable_stream().unwrap();
    for i in 0..10 {
        assert!(table
            .put(&Item {
                id: format!("item-{i}"),
                version: 2
            })
            .unwrap()
            .is_none());
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let second = table.enable_stream().unwrap();
    assert_ne!(second, first);
    for i in 0..10 {
        put(&memory, &format!("item-{i}"), 3);
    }
    wait_all(&seen, 10, 3).await;
    within(
        LIMIT,
        "caught up",
        memory.wait_caught_up(&second, "indexer"),
    )
    .await;
    assert!(running.health().is_ready(), "{:?}", running.health());
    running.shutdown().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    for i in 0..10 {
        assert_eq!(seen[&format!("item-{i}")], vec![1, 3], "item-{i}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_group_restarted_by_table_name_reads_the_rest_of_the_earlier_stream_then_the_new_one() {
    let memory = memory();
    let table = memory
        .tables()
        .create("orders", "id")
        .partitions(2)
        .build()
        .unwrap();
    let first = table.stream_arn();
    let seen = Seen::default();
    let running = by_table(&memory, "indexer")
        .build()
        .unwrap()
        .run(handler(&seen, None))
        .spawn();
    for i in 0..10 {
        put(&memory, &format!("item-{i}"), 1);
    }
    wait_all(&seen, 10, 1).await;
    running.shutdown().await.unwrap();
    // While the group is stopped: changes in the old stream, then a new stream with
    // more changes.
    for i in 0..10 {
        put(&memory, &format!("item-{i}"), 2);
    }
    table.disable_stream().unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    let second = table.enable_stream().unwrap();
    for i in 0..10 {
        put(&memory, &format!("item-{i}"), 3);
    }
    let running = by_table(&memory, "indexer")
        .build()
        .unwrap()
        .run(handler(&seen, None))
        .spawn();
    wait_all(&seen, 10, 3).await;
    within(
        LIMIT,
        "caught up",
        memory.wait_caught_up(&second, "indexer"),
    )
    .await;
    running.shutdown().await.unwrap();
    let handled = seen.lock().unwrap().clone();
    for i in 0..10 {
        assert_eq!(
            handled[&format!("item-{i}")],
            vec![1, 2, 3],
            "item-{i}: the old stream's rest, then the new stream, each once"
        );
    }

    // A group started by the old stream's ARN stays on it.
    let by_arn = Seen::default();
    let running = testkit::test_timings(
        Consumer::builder()
            .table_stream_arn(&first)
            .group("by-arn")
            .worker_id("w1")
            .backend(memory.clone()),
    )
    .build()
    .unwrap()
    .run(handler(&by_arn, None))
    .spawn();
    wait_all(&by_arn, 10, 2).await;
    within(LIMIT, "caught up", memory.wait_caught_up(&first, "by-arn")).await;
    tokio::time::sleep(Duration::from_secs(30)).await;
    running.shutdown().await.unwrap();
    let by_arn = by_arn.lock().unwrap().clone();
    for i in 0..10 {
        assert_eq!(by_arn[&format!("item-{i}")], vec![1, 2], "item-{i}");
    }
}

/// A group following a table by name checks now and then whether the table has a newer
/// stream; a check whose call never answers leaves the group reading its stream: the
/// shards a rollover opens meanwhile are taken and their changes handled.
#[tokio::test(start_paused = true)]
async fn a_table_check_that_never_answers_does_not_stop_the_group_taking_new_shards() {
    let memory = memory();
    let table = memory
        .tables()
        .create("orders", "id")
        .partitions(2)
        .build()
        .unwrap();
    let backend = Counted::new(&memory);
    let seen = Seen::default();
    let running = testkit::test_timings(
        Consumer::builder()
            .table_stream("orders")
            .group("indexer")
            .worker_id("w1")
            .backend(backend.clone()),
    )
    .build()
    .unwrap()
    .run(handler(&seen, None))
    .spawn();
    for i in 0..10 {
        put(&memory, &format!("item-{i}"), 1);
    }
    wait_all(&seen, 10, 1).await;
    // From now on DescribeTable hangs; the table rolls over to new shards, written to.
    backend
        .api
        .hang_describe_table
        .store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(2)).await;
    table.rollover().unwrap();
    for i in 0..10 {
        put(&memory, &format!("item-{i}"), 2);
    }
    wait_all(&seen, 10, 2).await;
    assert!(
        backend.api.calls.hung_describe_table.load(Ordering::SeqCst) >= 1,
        "a check hung while the new shards were waiting"
    );
    within(
        LIMIT,
        "caught up",
        memory.wait_caught_up(&table.stream_arn(), "indexer"),
    )
    .await;
    running.shutdown().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    for i in 0..10 {
        assert_eq!(seen[&format!("item-{i}")], vec![1, 2], "item-{i}");
    }
}

#[tokio::test(start_paused = true)]
async fn access_denied_on_describe_stream_stops_the_consumer_with_a_typed_error() {
    let memory = memory();
    memory.tables().create("orders", "id").build().unwrap();
    let backend = Counted::new(&memory);
    *backend.api.deny.lock().unwrap() = Some("DescribeStream");
    let seen = Seen::default();
    let result = within(
        LIMIT,
        "the consumer stops",
        testkit::test_timings(
            Consumer::builder()
                .table_stream("orders")
                .group("indexer")
                .worker_id("w1")
                .backend(backend.clone()),
        )
        .build()
        .unwrap()
        .run(handler(&seen, None))
        .into_future(),
    )
    .await;
    assert!(
        matches!(
            result,
            Err(shardflow::ConsumerError::Kinesis(
                KinesisError::AccessDenied(_)
            ))
        ),
        "{result:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn access_denied_on_get_records_makes_the_worker_not_ready_and_loses_nothing() {
    let memory = memory();
    memory.tables().create("orders", "id").build().unwrap();
    let backend = Counted::new(&memory);
    let seen = Seen::default();
    let running = testkit::test_timings(
        Consumer::builder()
            .table_stream("orders")
            .group("indexer")
            .worker_id("w1")
            .backend(backend.clone()),
    )
    .build()
    .unwrap()
    .run(handler(&seen, None))
    .spawn();
    put(&memory, "a", 1);
    wait_handled(&seen, "a", 1).await;
    *backend.api.deny.lock().unwrap() = Some("GetRecords");
    put(&memory, "a", 2);
    within(LIMIT, "not ready, saying why", async {
        loop {
            let health = running.health();
            if !health.is_ready()
                && health.shards.iter().any(|s| {
                    s.last_error
                        .as_deref()
                        .is_some_and(|e| e.contains("access denied"))
                })
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    // Granted again: the change made meanwhile is handled, once.
    *backend.api.deny.lock().unwrap() = None;
    wait_handled(&seen, "a", 2).await;
    running.shutdown().await.unwrap();
    assert_eq!(seen.lock().unwrap()["a"], vec![1, 2]);
}

#[tokio::test(start_paused = true)]
async fn items_of_400_kb_with_both_images_are_handled_whole() {
    #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
    struct Big {
        id: String,
        version: u8,
        plain: String,
        escaped: String,
    }
    let memory = memory();
    let table = memory.tables().create("orders", "id").build().unwrap();
    // Near DynamoDB's 400 KB item limit, half of it text that the JSON form escapes
    // (6 bytes a character): a MODIFY's payload with both images is over 2 MiB.
    let big = |version: u8| Big {
        id: "big".into(),
        version,
        plain: "x".repeat(190 * 1024),
        escaped: "\u{1}".repeat(190 * 1024),
    };
    table.put(&big(1)).unwrap().expect("an insert");
    table.put(&big(2)).unwrap().expect("a modify");
    let handled = Arc::new(Mutex::new(Vec::new()));
    let handler = {
        let handled = handled.clone();
        tower::service_fn(move |msg: Message| {
            let handled = handled.clone();
            async move {
                let change = ChangeRecord::from_payload(&msg.payload).expect("a change record");
                let new: Big = change.new_image_as().unwrap().unwrap();
                let old: Option<Big> = change.old_image_as().unwrap();
                handled.lock().unwrap().push((
                    msg.payload.len(),
                    new.version,
                    old.map(|o| o.version),
                ));
                assert_eq!(new.escaped.len(), 190 * 1024);
                Ok::<_, std::io::Error>(())
            }
        })
    };
    let running = testkit::test_timings(
        Consumer::builder()
            .table_stream("orders")
            .group("indexer")
            .worker_id("w1")
            .backend(memory.clone()),
    )
    .build()
    .unwrap()
    .run(handler)
    .spawn();
    within(
        LIMIT,
        "caught up",
        memory.wait_caught_up(&table.stream_arn(), "indexer"),
    )
    .await;
    running.shutdown().await.unwrap();
    let handled = handled.lock().unwrap().clone();
    assert_eq!(handled.len(), 2, "{handled:?}");
    assert_eq!((handled[0].1, handled[0].2), (1, None));
    assert_eq!((handled[1].1, handled[1].2), (2, Some(1)));
    assert!(
        handled[1].0 > 2 * 1024 * 1024,
        "both images: {} bytes",
        handled[1].0
    );
}
