//! Balancing by throughput: a fleet whose shards carry very different loads (record
//! sizes drawn from a Zipf distribution, a record into every shard every second) evens
//! out the load per worker once the owners' measurements are on the lease rows, with
//! planned hand-offs only: every record handled, none twice. Simulated time.

use testkit::fleet;

use std::collections::BTreeMap;
use std::time::Duration;

use fleet::{zipf_record_sizes, Fleet};
use shardflow::BalanceBy;

/// The target of the plan's band (10 %) with room for the measurements' smoothing.
const EVEN: f64 = 1.15;

/// Runs 40 shards x 4 workers with record sizes drawn with `seed`, balancing by
/// throughput, and checks that the load evens out within two minutes and that every
/// record is handled exactly once.
async fn skewed_fleet_evens_out(seed: u64) {
    let (shards, workers) = (40, 4);
    let mut running = fleet::start(Fleet {
        feed_every: Some(Duration::from_secs(1)),
        record_sizes: Some(zipf_record_sizes(shards, seed, 100)),
        balance_by: BalanceBy::Throughput,
        ..Fleet::new(shards as u32, workers)
    })
    .await;
    // Every shard leased, by count at first (nothing measured yet).
    let leased = running
        .until(Duration::from_secs(30), |r| r.load_ratio().is_some())
        .await;
    assert!(leased.is_some(), "not every shard was leased");
    let at_start = running.load_ratio().unwrap_or(f64::MAX);
    // Then by load, within a few rounds (10 s each) of the measurements.
    let even = running
        .until(Duration::from_secs(120), |r| {
            r.table_loads().len() == workers && r.load_ratio().is_some_and(|x| x <= EVEN)
        })
        .await;
    eprintln!(
        "{shards} shards x {workers} workers: max/mean load {at_start:.2} at the start, {:.2} \
         after {even:?}; table loads (KiB/s) {:?}",
        running.load_ratio().unwrap_or(f64::NAN),
        running.table_loads()
    );
    running.stop_feed();
    let handled = running
        .until(Duration::from_secs(60), |r| r.all_handled())
        .await;
    let mut per_shard: BTreeMap<String, usize> = BTreeMap::new();
    for (shard, _) in running.handled.lock().unwrap().keys() {
        *per_shard.entry(shard.clone()).or_default() += 1;
    }
    let each = *running.put.lock().unwrap() / shards;
    per_shard.retain(|_, n| *n != each);
    assert!(
        handled.is_some(),
        "records not handled: {} of {}; shards short of {each}: {per_shard:?}",
        running.handled.lock().unwrap().len(),
        running.put.lock().unwrap()
    );
    assert_eq!(
        running.duplicates(),
        vec![],
        "planned hand-offs must not deliver twice"
    );
    assert!(
        even.is_some(),
        "the load was not evened out: max/mean {:?}, table loads {:?}",
        running.load_ratio(),
        running.table_loads()
    );
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn skewed_shards_are_spread_by_throughput_without_duplicates() {
    skewed_fleet_evens_out(5).await;
}

/// The same with another draw: the first record of a shard, put before the fleet
/// started, is never handled (one shard whose lease moved twice in the first seconds;
/// with `RUST_LOG=shardflow=trace` and a subscriber installed, the first record of every
/// shard, lease moved or not). Balancing by count, the same runs lose nothing.
#[tokio::test(start_paused = true)]
#[ignore = "reproduces a lost record after early planned hand-offs; not fixed yet"]
async fn skewed_shards_with_another_draw_lose_nothing() {
    skewed_fleet_evens_out(6).await;
}
