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
/// throughput, and checks that the load evens out within two minutes, that every
/// record is handled exactly once and that every shard's checkpoint reaches its last
/// record.
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
    // A minute from here, not from the start: the last records put are still in flight
    // now, and evening out may itself have taken more than a minute.
    let handled = running
        .within(Duration::from_secs(60), |r| {
            r.all_handled() && checkpoints_at_last_handled(r)
        })
        .await;
    let mut per_shard: BTreeMap<String, usize> = BTreeMap::new();
    for (shard, _) in running.handled.lock().unwrap().keys() {
        *per_shard.entry(shard.clone()).or_default() += 1;
    }
    let each = *running.put.lock().unwrap() / shards;
    per_shard.retain(|_, n| *n != each);
    assert!(
        handled.is_some(),
        "records not handled or checkpointed: {} of {}; shards short of {each}: {per_shard:?}; \
         checkpoints {:?}",
        running.handled.lock().unwrap().len(),
        running.put.lock().unwrap(),
        checkpoints(&running)
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

/// The same with another draw (one that took a minute to even out with a meter whose
/// first interval stood for its whole past, leaving the wait for the last records no
/// time when that wait counted from the fleet's start).
#[tokio::test(start_paused = true)]
async fn skewed_shards_with_another_draw_lose_nothing() {
    skewed_fleet_evens_out(6).await;
}

/// Records put while a fleet balanced by count runs into its second minute, the last one
/// put just before the feed stops included, are all handled once, and every shard's
/// checkpoint ends at its last record: the first and the last record of each shard
/// count like any other.
#[tokio::test(start_paused = true)]
async fn records_put_past_the_first_minute_are_all_handled_and_checkpointed() {
    let shards = 4;
    let mut running = fleet::start(Fleet {
        feed_every: Some(Duration::from_secs(1)),
        ..Fleet::new(shards, 2)
    })
    .await;
    // Stop the feed just after its tick at 61 s: that tick's records are not read yet.
    tokio::time::sleep_until(running.started + Duration::from_millis(61_001)).await;
    running.stop_feed();
    let put = *running.put.lock().unwrap();
    assert_eq!(put, shards as usize * 62, "the first records and 61 ticks");
    let done = running
        .within(Duration::from_secs(60), |r| {
            r.all_handled() && checkpoints_at_last_handled(r)
        })
        .await;
    assert!(
        done.is_some(),
        "handled {} of {put}; checkpoints {:?}",
        running.handled.lock().unwrap().len(),
        checkpoints(&running)
    );
    assert_eq!(running.duplicates(), vec![]);
    running.stop().await;
}

/// Each lease's checkpoint as the table holds it (lease key -> sequence number).
fn checkpoints(running: &fleet::Running) -> BTreeMap<String, String> {
    running
        .memory
        .table(fleet::GROUP)
        .rows()
        .into_iter()
        .filter_map(|row| match row.checkpoint {
            shardflow::lease::Checkpoint::At(p) => Some((row.key, p.sequence.to_string())),
            _ => None,
        })
        .collect()
}

/// Whether every shard's checkpoint is the highest sequence number handled in it.
fn checkpoints_at_last_handled(running: &fleet::Running) -> bool {
    let mut last: BTreeMap<String, String> = BTreeMap::new();
    for (shard, sequence) in running.handled.lock().unwrap().keys() {
        let entry = last.entry(shard.clone()).or_default();
        if (sequence.len(), sequence) > (entry.len(), &*entry) {
            *entry = sequence.clone();
        }
    }
    checkpoints(running) == last
}
