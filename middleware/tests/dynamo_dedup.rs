//! `DynamoDedupStore` against a DynamoDB emulator over real HTTP.
//!
//! Runs only when `SHARDFLOW_EMULATORS` is set (scripts/test.sh sets it and points
//! `AWS_ENDPOINT_URL_DYNAMODB` at dynalite); otherwise each test prints "skipped".

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use shardflow_middleware::dedup::{Commit, DedupStore, Reservation};
use shardflow_middleware::DynamoDedupStore;

/// A store on a fresh table, or `None` when the emulators are not running.
async fn fresh_store(name: &str) -> Option<DynamoDedupStore> {
    if std::env::var_os("SHARDFLOW_EMULATORS").is_none() {
        eprintln!("skipped: SHARDFLOW_EMULATORS is not set (run scripts/test.sh)");
        return None;
    }
    let aws = shardflow::Aws::from_env().await;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let store = DynamoDedupStore::new(&aws, format!("dedup-{name}-{nanos}"));
    store.ensure_table().await.expect("create the dedup table");
    Some(store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_consumers_against_dynamodb_run_each_side_effect_once() {
    let Some(store) = common::within("the dedup table", fresh_store("two-consumers")).await else {
        return;
    };
    let report = common::two_consumers(store, 200, Duration::from_millis(20)).await;
    eprintln!(
        "handled {}, duplicates {}, redeliveries {}",
        report.handled, report.duplicates, report.redeliveries
    );
    common::assert_exactly_once(&report, 200);
}

#[tokio::test]
async fn the_dynamodb_store_follows_the_protocol() {
    let Some(store) = common::within("the dedup table", fresh_store("protocol")).await else {
        return;
    };
    common::within("the protocol against the emulator", protocol(store)).await;
}

/// The body of [`the_dynamodb_store_follows_the_protocol`].
async fn protocol(store: DynamoDedupStore) {
    // Creating an existing table is fine.
    store.ensure_table().await.expect("ensure_table twice");

    let ttl = Duration::from_secs(60);
    assert_eq!(
        store.reserve("a", "t1", ttl).await.unwrap(),
        Reservation::Reserved
    );
    assert_eq!(
        store.reserve("a", "t2", ttl).await.unwrap(),
        Reservation::InProgress
    );
    // The holder's reserve sent again (the SDK retrying after a lost reply) fails its
    // condition against the first attempt's item: that is still our reservation.
    assert_eq!(
        store.reserve("a", "t1", ttl).await.unwrap(),
        Reservation::Reserved
    );
    // Only the holder's token releases.
    store.release("a", "t2").await.unwrap();
    assert_eq!(
        store.reserve("a", "t2", ttl).await.unwrap(),
        Reservation::InProgress
    );
    store.release("a", "t1").await.unwrap();
    assert_eq!(
        store.reserve("a", "t2", ttl).await.unwrap(),
        Reservation::Reserved
    );
    assert_eq!(
        store.commit("a", "t2", ttl).await.unwrap(),
        Commit::Committed
    );
    assert_eq!(
        store.reserve("a", "t3", ttl).await.unwrap(),
        Reservation::Done
    );
    // A late release by a former holder changes nothing.
    store.release("a", "t2").await.unwrap();
    assert_eq!(
        store.reserve("a", "t3", ttl).await.unwrap(),
        Reservation::Done
    );
    // A commit without our reservation still marks the key done, and says so.
    assert_eq!(
        store.commit("b", "t9", ttl).await.unwrap(),
        Commit::Overtaken
    );
    assert_eq!(
        store.reserve("b", "t3", ttl).await.unwrap(),
        Reservation::Done
    );
}
