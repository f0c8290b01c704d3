//! The start-up create storm: workers of a new group started together share
//! the creation of the lease rows instead of each sending one conditional put per
//! shard (10 workers x 500 shards were 5,000 puts for 500 rows), and every shard still
//! gets its row and delivers. Simulated time, default timings, realistic latencies; the
//! fleet's store wrapper logs every call.

use testkit::fleet;

use std::time::Duration;

use fleet::Fleet;

#[tokio::test(start_paused = true)]
async fn workers_started_together_share_the_creation_of_the_rows() {
    let (shards, workers) = (500, 10);
    let running = fleet::start(Fleet::new(shards, workers)).await;
    let delivered = running
        .until(Duration::from_secs(30), |r| r.all_delivered())
        .await;
    let balanced = running
        .until(Duration::from_secs(30), |r| r.balanced())
        .await;
    let rows = running.memory.table(fleet::GROUP).rows().len();
    let creates = running
        .calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.op == "create")
        .count();
    running.stop().await;
    eprintln!("{shards} shards x {workers} workers: {creates} creates");
    assert!(delivered.is_some(), "every shard delivered");
    assert!(balanced.is_some(), "balanced");
    assert_eq!(rows, shards as usize, "one row per shard");
    assert!(
        creates <= 2 * shards as usize,
        "{creates} creates for {shards} rows (at most twice as many; each worker creating every row sends {})",
        shards as usize * workers
    );
}
