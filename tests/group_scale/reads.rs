//! Lease-table reads that do not grow with the fleet: in a fleet of more
//! than three workers only the leader and the successor list the whole table every
//! round, the others once every few rounds, and between those they read only the keys
//! they own (the owner index) and the few rows handed to them. The tests prove that the
//! rows read per shard and round stay flat from 4 to 16 workers, and that a crash (of
//! any worker or of the leader) or a graceful stop still has every shard read again
//! within the usual bounds, nothing lost, the fleet balanced again through hand-offs
//! without duplicates. Simulated time (tokio's paused clock), 8 ms per lease-store call,
//! 25 ms per Kinesis call, fixed seeds.

use testkit::fleet;

use std::time::Duration;

use fleet::{leases_per_owner, Fleet, Running};

/// The default take round (the lease duration, 10 s).
const ROUND: Duration = Duration::from_secs(10);

/// Rows read per shard and per take round by a balanced idle fleet, over `rounds`
/// rounds after it settled: (by listings, by the owner index, by gets).
async fn rows_read_per_shard_and_round(shards: u32, workers: usize, rounds: u32) -> [f64; 3] {
    let running = fleet::start_balanced(Fleet::new(shards, workers)).await;
    tokio::time::sleep(Duration::from_secs(60)).await;
    let before = running.memory.table(fleet::GROUP).rows_read();
    tokio::time::sleep(ROUND * rounds).await;
    let after = running.memory.table(fleet::GROUP).rows_read();
    let per = |n: u64| n as f64 / f64::from(shards) / f64::from(rounds);
    let read = [
        per(after.listed - before.listed),
        per(after.owned - before.owned),
        per(after.fetched - before.fetched),
    ];
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
    read
}

/// (a) Every worker listing the table every round read `workers` rows per shard and
/// round (16 workers: 16 and more with the shard syncs). Now a fleet of 16 reads no more
/// rows than a fleet of 4 (where every worker still lists every round), plus at most one
/// key per shard and round from the owner index (each worker's own keys, in the rounds
/// it does not list the table), and at most 6 in all.
#[tokio::test(start_paused = true)]
async fn rows_read_per_shard_and_round_do_not_grow_from_four_to_sixteen_workers() {
    let four = rows_read_per_shard_and_round(96, 4, 30).await;
    let sixteen = rows_read_per_shard_and_round(96, 16, 30).await;
    eprintln!("rows read per shard and round (lists, owner index, gets): 4 workers {four:?}, 16 workers {sixteen:?}");
    let rows = |r: [f64; 3]| r[0] + r[2];
    assert!(
        rows(sixteen) <= rows(four) * 1.1 && sixteen[1] <= 1.0,
        "16 workers read {sixteen:?} rows per shard and round, 4 workers {four:?}"
    );
    assert!(sixteen.iter().sum::<f64>() <= 6.0, "{sixteen:?}");
}

/// A fed, balanced fleet of 12 workers over 96 shards.
async fn balanced_fleet_of_twelve() -> Running {
    let running = fleet::start_balanced(Fleet {
        feed_every: Some(Duration::from_secs(1)),
        ..Fleet::new(96, 12)
    })
    .await;
    // A few rounds on: the roles are settled, most workers read only their own keys.
    tokio::time::sleep(ROUND * 3).await;
    running
}

/// After a crash or a stop: balanced again within a few rounds, every record handled,
/// and records handled twice only on the shards of a crashed worker (what was in flight
/// there); the planned hand-offs that rebalance deliver nothing twice.
async fn rebalances_without_loss(mut running: Running, gone: &[String], crashed: bool) {
    let at = tokio::time::Instant::now();
    let balanced = running
        .until(running.started.elapsed() + ROUND * 6, |r| r.balanced())
        .await;
    assert!(
        balanced.is_some(),
        "not balanced again within six rounds: {:?}",
        leases_per_owner(&running.memory)
    );
    eprintln!("balanced again {:?} after", at.elapsed());
    running.stop_feed();
    let handled = running
        .until(running.started.elapsed() + ROUND * 6, |r| r.all_handled())
        .await;
    assert!(
        handled.is_some(),
        "records lost: {} of {} handled",
        running.handled.lock().unwrap().len(),
        running.put.lock().unwrap()
    );
    let twice = running.duplicates();
    let elsewhere: Vec<_> = twice
        .iter()
        .filter(|(shard, ..)| !crashed || !gone.contains(shard))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "records handled twice outside a crashed worker's shards: {elsewhere:?}"
    );
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
}

/// Worker `i` of a balanced fleet of 12 crashes: its shards are read again within the
/// lease duration and a round (plus the read and the one-second feed), and the fleet
/// rebalances without loss.
async fn crash_is_covered(i: usize) {
    let mut running = balanced_fleet_of_twelve().await;
    let killed_at = tokio::time::Instant::now();
    let orphans = running.kill(i);
    assert!(!orphans.is_empty());
    let after = running
        .read_again(&orphans, killed_at, ROUND * 2 + ROUND / 5)
        .await;
    eprintln!("read again after {after:?}");
    rebalances_without_loss(running, &orphans, true).await;
}

/// (b) One worker of 12 that is neither leader nor successor (w007) crashes: the
/// leader takes its expired leases at once.
#[tokio::test(start_paused = true)]
async fn a_crashed_worker_of_twelve_has_its_shards_read_again_within_a_lease_and_a_round() {
    crash_is_covered(7).await;
}

/// (c) The leader (w000, first by name) crashes: the successor finds its leases expired
/// within the lease duration and a round, leads, and takes them at once.
#[tokio::test(start_paused = true)]
async fn a_crashed_leader_has_its_shards_read_again_within_a_lease_and_a_round() {
    crash_is_covered(0).await;
}

/// (d) One worker of 12 stops gracefully (drains, checkpoints, releases): its shards
/// are read again within a round (the leader takes released leases at its next
/// listing, if no worker listing the table took them before), and nothing is delivered
/// twice.
#[tokio::test(start_paused = true)]
async fn a_stopped_worker_of_twelve_has_its_shards_read_again_within_a_round() {
    let mut running = balanced_fleet_of_twelve().await;
    let stopped_at = tokio::time::Instant::now();
    let released = tokio::time::timeout(Duration::from_secs(60), running.stop_worker(7))
        .await
        .expect("the worker stops");
    assert!(!released.is_empty());
    let after = running
        .read_again(&released, stopped_at, ROUND + ROUND / 5)
        .await;
    eprintln!("read again after {after:?}");
    rebalances_without_loss(running, &released, false).await;
}
