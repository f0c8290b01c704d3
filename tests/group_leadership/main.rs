//! Leadership held like a lease: the leader, its successor and the watchers, and how
//! fast every shard is read again whichever workers crash or stop together.

mod coordinator;
mod failover;
mod roles;

use std::time::Duration;

use testkit::fleet::{self, Fleet, Running};

/// The default lease duration, and take round (both 10 s).
const LEASE: Duration = Duration::from_secs(10);
const ROUND: Duration = Duration::from_secs(10);
/// What reading a shard again takes beyond its take (an iterator, a read, a handler
/// call: well under a second here), as the other fleet tests allow.
const READ: Duration = Duration::from_secs(2);

/// A fed, balanced fleet of `workers` with four shards each, a few rounds after it
/// balanced (roles settled: only the leader lists every round).
async fn balanced_fleet(workers: usize) -> Running {
    let running = fleet::start_balanced(Fleet {
        feed_every: Some(Duration::from_secs(1)),
        ..Fleet::new(workers as u32 * 4, workers)
    })
    .await;
    tokio::time::sleep(ROUND * 3).await;
    running
}
