//! A processor in a real process, killed and restarted: `examples/processor.rs` (worker
//! mode) reads 20,000 orders from a 4-shard stream on the emulators and writes one
//! shipment per order to a 2-shard stream. The orders arrive in three waves; right after
//! the second and the third wave are written the test SIGKILLs the running processor
//! (and checks from the shipments stream that it was killed mid-work), starts another,
//! and lets the third process finish (SIGTERM, exit 0).
//! Skipped when `SHARDFLOW_EMULATORS` is unset; run it with
//! `scripts/test.sh --test processor`.
//!
//! A warehouse consumer in this test process reads the shipments as they come, every
//! one (in the order of its partition key), and, through the `DedupLayer` with the
//! DynamoDB store keyed on the shipment's `source` (the order's stream/shard/sequence),
//! each one's effect. Checked: every order has its shipment; per customer, the
//! shipments come in the order of the orders, with repeats only of shipments already
//! seen (a redelivery after a crash writes again from the checkpoint); every order's
//! effect happened exactly once. The repeats are counted and printed.

use testkit::process;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use process::Worker;
use shardflow::kinesis::{KinesisApi, PutRecord, StartingPosition};
use shardflow::{Aws, Backend, Concurrency, Message};
use shardflow_middleware::{DedupLayer, DynamoDedupStore, ServiceBuilderExt};
use testkit::{put_all, test_consumer, unique, wait_until_active, within};
use tokio::sync::Notify;
use tower::ServiceBuilder;

const ORDERS: u64 = 20_000;
const CUSTOMERS: u64 = 97;
/// How long the processors may take for everything (a debug build against emulators).
const RUN_LIMIT: Duration = Duration::from_secs(600);

/// A shipment as the example writes it (the fields this test reads): the order's fields
/// (`id`, `customer`, `n`), its warehouse and `source`.
#[derive(Clone, Debug, serde::Deserialize)]
struct Shipment {
    #[serde(rename = "id")]
    order_id: u64,
    customer: String,
    n: u64,
    source: String,
}

/// What the warehouse saw: every shipment per customer in handling order, and each
/// order's effects behind the dedup layer.
#[derive(Clone, Default)]
struct Warehouse {
    seen: Arc<Mutex<BTreeMap<String, Vec<u64>>>>,
    raw: Arc<Mutex<usize>>,
    effects: Arc<Mutex<HashMap<u64, u32>>>,
    changed: Arc<Notify>,
}

impl Warehouse {
    fn saw(&self, s: &Shipment) {
        let mut seen = self.seen.lock().unwrap();
        seen.entry(s.customer.clone()).or_default().push(s.n);
        *self.raw.lock().unwrap() += 1;
        self.changed.notify_waiters();
    }

    fn effect(&self, s: &Shipment) {
        *self.effects.lock().unwrap().entry(s.order_id).or_default() += 1;
        self.changed.notify_waiters();
    }

    fn raw(&self) -> usize {
        *self.raw.lock().unwrap()
    }

    fn effects(&self) -> usize {
        self.effects.lock().unwrap().len()
    }

    /// Waits until `done` holds, checked on every change.
    async fn until(&self, done: impl Fn(&Self) -> bool) {
        loop {
            let changed = self.changed.notified();
            if done(self) {
                return;
            }
            changed.await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_processor_killed_twice_ships_every_order_in_order_and_once_in_effect() {
    if !testkit::emulators_enabled() {
        return;
    }
    let aws = Aws::from_env().await;
    let kinesis = aws.kinesis();
    let admin = aws.admin().expect("AWS creates streams");
    let (orders, shipments) = (unique("orders"), unique("shipments"));
    admin.create_stream(&orders, 4).await.unwrap();
    admin.create_stream(&shipments, 2).await.unwrap();
    wait_until_active(kinesis.as_ref(), &orders).await;
    wait_until_active(kinesis.as_ref(), &shipments).await;
    // The orders go in three waves; each kill follows a wave's write at once, so the
    // processor is killed while it works (checked below from the shipments stream).
    let waves = [0..6_000, 6_000..13_000, 13_000..ORDERS];
    write_orders(kinesis.as_ref(), &orders, waves[0].clone()).await;

    // The warehouse: sees every shipment, applies each order's effect once.
    let store = DynamoDedupStore::new(&aws, unique("warehouse-dedup"));
    store.ensure_table().await.unwrap();
    let warehouse = Warehouse::default();
    let handler = ServiceBuilder::new()
        .decode::<Shipment>()
        .map_request({
            let warehouse = warehouse.clone();
            move |m: Message<Shipment>| {
                warehouse.saw(&m.payload);
                m
            }
        })
        .layer(DedupLayer::new(store).key(|m: &Message<Shipment>| m.payload.source.clone()))
        .service_fn({
            let warehouse = warehouse.clone();
            move |m: Message<Shipment>| {
                warehouse.effect(&m.payload);
                async { Ok::<_, std::convert::Infallible>(()) }
            }
        });
    let consumer = test_consumer(aws.clone(), &shipments, &unique("warehouse"), "wh")
        .concurrency(Concurrency::PerKey(32))
        .build()
        .unwrap();
    let reading = testkit::start_service(consumer, handler);

    // The processors.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("processor_processes")
        .join(&orders);
    std::fs::create_dir_all(&dir).unwrap();
    let bin = testkit::build_example("processor", &dir);
    let group = unique("shipping");
    let spawn = |id: &str| {
        let args: Vec<String> = [
            "--orders",
            &orders,
            "--shipments",
            &shipments,
            "--group",
            &group,
            "--worker",
            id,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
        Worker::spawn(
            &bin,
            id,
            &args,
            &[("RUST_LOG", log)],
            dir.join(format!("{id}.log")),
            Arc::default(),
        )
    };
    let mut kills = Vec::new();
    for (id, wave) in [("p1", 1), ("p2", 2)] {
        let worker = spawn(id);
        let before = waves[wave].start as usize;
        within(
            RUN_LIMIT,
            &format!("shipments of the first orders seen while {id} runs"),
            warehouse.until(|w| w.raw() >= before / 3),
        )
        .await;
        write_orders(kinesis.as_ref(), &orders, waves[wave].clone()).await;
        worker.kill();
        let status = worker.wait_exit(Duration::from_secs(30)).await;
        assert!(
            status.is_some(),
            "{id} did not die: {}",
            worker.log_tail(20)
        );
        let stored = count(kinesis.as_ref(), &shipments).await;
        assert!(
            stored < waves[wave].end as usize,
            "{id} was killed while it worked: {stored} orders shipped of {} written",
            waves[wave].end
        );
        kills.push((id, stored));
    }
    let last = spawn("p3");
    within(
        RUN_LIMIT,
        "every order's effect after two SIGKILLs",
        warehouse.until(|w| w.effects() >= ORDERS as usize),
    )
    .await;
    last.terminate();
    let status = last.wait_exit(Duration::from_secs(60)).await;
    assert!(
        status.is_some_and(|s| s.success()),
        "p3 exits 0 after SIGTERM ({status:?}): {}",
        last.log_tail(20)
    );
    reading.stop().await;

    // Every order shipped; per customer in order, repeats only of what was seen.
    let seen = warehouse.seen.lock().unwrap().clone();
    let mut repeats = 0;
    for c in 0..CUSTOMERS {
        let customer = format!("customer-{c}");
        let ns = seen.get(&customer).cloned().unwrap_or_default();
        let mut next = 0;
        for n in &ns {
            if *n == next {
                next += 1;
            } else {
                assert!(
                    *n < next,
                    "{customer}: shipment {n} before {next} (out of order): {ns:?}"
                );
                repeats += 1;
            }
        }
        let orders_of_customer = (ORDERS - c).div_ceil(CUSTOMERS);
        assert_eq!(next, orders_of_customer, "{customer}: every order shipped");
    }
    let effects = warehouse.effects.lock().unwrap().clone();
    let twice: Vec<(u64, u32)> = effects
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, n)| (*id, *n))
        .collect();
    assert!(
        twice.is_empty(),
        "effects applied more than once: {twice:?}"
    );
    assert_eq!(effects.len(), ORDERS as usize);
    eprintln!(
        "{ORDERS} orders through a processor killed at {kills:?} (id, shipments stored \
         then): {} shipments seen, {repeats} repeated after the kills, every order's \
         effect once",
        warehouse.raw()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writes orders `ids` (customer `id % CUSTOMERS`, its `n`-th order).
async fn write_orders(kinesis: &dyn KinesisApi, stream: &str, ids: std::ops::Range<u64>) {
    let records: Vec<PutRecord> = ids
        .map(|id| {
            let c = id % CUSTOMERS;
            let json = format!(
                r#"{{"id":{id},"customer":"customer-{c}","n":{},"items":{}}}"#,
                id / CUSTOMERS,
                1 + id % 9
            );
            PutRecord {
                data: Bytes::from(json),
                partition_key: format!("customer-{c}"),
                explicit_hash_key: None,
            }
        })
        .collect();
    put_all(kinesis, stream, records).await;
}

/// How many orders have a shipment in `stream` (every shard read from its start).
async fn count(kinesis: &dyn KinesisApi, stream: &str) -> usize {
    let mut shipped = std::collections::HashSet::new();
    for shard in kinesis.list_shards(stream).await.unwrap() {
        let mut iterator = kinesis
            .shard_iterator(stream, &shard.shard_id, &StartingPosition::TrimHorizon)
            .await
            .unwrap();
        loop {
            let page = kinesis.get_records(&iterator, 10_000).await.unwrap();
            for record in &page.records {
                let shipment: Shipment = serde_json::from_slice(&record.data).unwrap();
                shipped.insert(shipment.order_id);
            }
            match page.next_iterator {
                Some(next) if !page.records.is_empty() => iterator = next,
                _ => break,
            }
        }
    }
    shipped.len()
}
