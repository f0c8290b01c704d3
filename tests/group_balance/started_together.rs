//! A fleet started together balances at once: every worker of a consumer group started
//! at the same moment holds its fair share of the leases within three take rounds (the
//! default take interval is the lease duration, 10 s), and every shard delivers its
//! first record right away. Simulated time (tokio's paused clock) with realistic
//! latencies: 8 ms per lease-store call, 25 ms per Kinesis call. A record goes into
//! every shard every second while the leases move: every record is handled, and
//! exactly once (the hand-offs are planned: drain, checkpoint, hand over).

use testkit::fleet;

use std::time::Duration;

use fleet::{leases_per_owner, Fleet};

/// Three rounds at the default take interval (10 s): the start-up target.
const BALANCED_WITHIN: Duration = Duration::from_secs(30);

async fn starts_balanced(shards: u32, workers: usize) {
    let mut running = fleet::start(Fleet {
        feed_every: Some(Duration::from_secs(1)),
        ..Fleet::new(shards, workers)
    })
    .await;
    let reading = running
        .until(Duration::from_secs(60), |r| r.all_delivered())
        .await;
    let balanced = running.until(BALANCED_WITHIN, |r| r.balanced()).await;
    let per_owner = leases_per_owner(&running.memory);
    eprintln!(
        "{shards} shards x {workers} workers: every shard delivered after {reading:?}, balanced after {balanced:?}; leases per worker {:?}",
        per_owner.values().collect::<Vec<_>>()
    );
    assert!(
        reading.is_some_and(|t| t <= Duration::from_secs(1)),
        "every shard should deliver within 1 s of the start, got {reading:?}"
    );
    assert!(
        balanced.is_some(),
        "not balanced within {BALANCED_WITHIN:?}: leases per worker {per_owner:?}"
    );
    running.stop_feed();
    let handled = running
        .until(BALANCED_WITHIN + Duration::from_secs(30), |r| {
            r.all_handled()
        })
        .await;
    assert!(
        handled.is_some(),
        "records not handled: {} of {}",
        running.handled.lock().unwrap().len(),
        running.put.lock().unwrap()
    );
    // Balanced stays balanced (until 45 s, a few rounds on): nothing moves back.
    let unbalanced = running
        .until(BALANCED_WITHIN + Duration::from_secs(15), |r| !r.balanced())
        .await;
    assert_eq!(
        unbalanced,
        None,
        "the balance did not hold: leases per worker {:?}",
        leases_per_owner(&running.memory)
    );
    assert_eq!(
        running.duplicates(),
        vec![],
        "planned hand-offs must not deliver twice"
    );
    running.stop().await;
}

#[tokio::test(start_paused = true)]
async fn two_hundred_shards_and_four_workers_balance_within_three_rounds() {
    starts_balanced(200, 4).await;
}

#[tokio::test(start_paused = true)]
async fn five_hundred_shards_and_ten_workers_balance_within_three_rounds() {
    starts_balanced(500, 10).await;
}

#[tokio::test(start_paused = true)]
async fn a_hundred_shards_and_forty_workers_balance_within_three_rounds() {
    starts_balanced(100, 40).await;
}

#[tokio::test(start_paused = true)]
async fn five_hundred_shards_and_forty_workers_balance_within_three_rounds() {
    starts_balanced(500, 40).await;
}

/// Ten workers join a balanced group of thirty: balanced again within three rounds,
/// every lease moved by a planned hand-off, so no record is handled twice or lost.
#[tokio::test(start_paused = true)]
async fn ten_workers_joining_thirty_balance_again_without_duplicates() {
    let mut running = fleet::start(Fleet {
        feed_every: Some(Duration::from_secs(1)),
        ..Fleet::new(100, 30)
    })
    .await;
    assert!(running
        .until(BALANCED_WITHIN, |r| r.balanced())
        .await
        .is_some());
    let joined_at = tokio::time::Instant::now();
    running.add_workers(10);
    let again = running
        .until(BALANCED_WITHIN * 2, |r| r.balanced())
        .await
        .map(|_| joined_at.elapsed());
    assert!(
        again.is_some_and(|t| t <= BALANCED_WITHIN),
        "not balanced within {BALANCED_WITHIN:?} of the join ({again:?}): {:?}",
        leases_per_owner(&running.memory)
    );
    running.stop_feed();
    assert!(running
        .until(BALANCED_WITHIN * 3, |r| r.all_handled())
        .await
        .is_some());
    assert_eq!(running.duplicates(), vec![]);
    running.stop().await;
}

/// One worker of forty crashes (no release): its shards are read again within the
/// lease duration plus one take round (10 s + 10 s at the defaults; the delivery itself
/// adds a read, 25 ms here, and the one-second record feed adds up to a second).
#[tokio::test(start_paused = true)]
async fn the_shards_of_a_crashed_worker_are_read_again_within_a_lease_and_a_round() {
    let mut running = fleet::start(Fleet {
        feed_every: Some(Duration::from_secs(1)),
        ..Fleet::new(100, 40)
    })
    .await;
    assert!(running
        .until(BALANCED_WITHIN, |r| r.balanced())
        .await
        .is_some());
    let killed_at = tokio::time::Instant::now();
    let orphans = running.kill(7);
    assert!(!orphans.is_empty());
    let read_again = running
        .until(BALANCED_WITHIN * 3, |r| {
            orphans.iter().all(|s| r.delivered_after(s, killed_at))
        })
        .await
        .map(|_| killed_at.elapsed());
    assert!(
        read_again.is_some_and(|t| t <= Duration::from_secs(21)),
        "the crashed worker's shards {orphans:?} read again after {read_again:?}"
    );
    assert!(running
        .until(BALANCED_WITHIN * 3, |r| r.balanced())
        .await
        .is_some());
    running.stop().await;
}
