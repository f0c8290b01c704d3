//! Lease-table reads in a large fleet, where not every worker lists the table every
//! round: paths where a shard stayed unread much longer than the promised bounds, a
//! shard that ran well was moved for nothing, or a live worker lost leases. Each test
//! states the bound it holds the code to. Memory backend,
//! tokio's paused clock, fixed seeds (the fleet's).

use testkit::fleet;

use std::time::Duration;

use fleet::{leases_per_owner, Fleet, Running};

/// The default take round (the lease duration, 10 s).
const ROUND: Duration = Duration::from_secs(10);

/// A fed, balanced fleet of `workers` over 96 shards, a few rounds after it balanced
/// (roles settled: most workers read only their own keys).
async fn balanced_fleet(workers: usize) -> Running {
    let running = fleet::start_balanced(Fleet {
        feed_every: Some(Duration::from_secs(1)),
        ..Fleet::new(96, workers)
    })
    .await;
    tokio::time::sleep(ROUND * 3).await;
    running
}

/// Regression: when the leader and the successor crashed together, their shards waited for another worker's paced listing.
///
/// The leader (w000) and the successor (w001) of a fleet of 12 crash together (one
/// host, one rack, one bad deploy): their shards waited for another worker's paced
/// listing (about 100 s here, 380 s at 40 workers). Leadership is a lease (see
/// `roles.rs`): any worker takes the leader item over once it stops moving, and the
/// first two by name are no different from any other two workers.
#[tokio::test(start_paused = true)]
async fn leader_and_successor_crashing_together_have_their_shards_read_again_within_a_lease_and_a_round(
) {
    let mut running = balanced_fleet(12).await;
    let killed_at = tokio::time::Instant::now();
    let mut orphans = running.kill(0);
    orphans.extend(running.kill(1));
    assert!(orphans.len() >= 14, "{orphans:?}");
    let after = running
        .read_again(&orphans, killed_at, ROUND * 2 + ROUND / 5)
        .await;
    eprintln!("read again after {after:?}");
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
}

/// Regression: when the leader and the successor stopped one after the other, their released shards waited up to 5 rounds.
///
/// The leader and the successor of a fleet of 12 stop gracefully one
/// after the other (a scale-in by two, a deploy in batches of two). Their released
/// leases are taken at once only by a leader; the next one (w002) finds out that it
/// leads only at its next paced listing, so the released shards wait up to 5 rounds
/// (19 at 40 workers) instead of about a round (as when one worker stops:
/// `group_scale::reads::a_stopped_worker_of_twelve_has_its_shards_read_again_within_a_round`).
#[tokio::test(start_paused = true)]
async fn leader_and_successor_stopping_together_have_their_shards_read_again_within_a_round() {
    let mut running = balanced_fleet(12).await;
    let stopped_at = tokio::time::Instant::now();
    let mut released = tokio::time::timeout(Duration::from_secs(60), running.stop_worker(0))
        .await
        .expect("the leader stops");
    released.extend(
        tokio::time::timeout(Duration::from_secs(60), running.stop_worker(1))
            .await
            .expect("the successor stops"),
    );
    let both_stopped = stopped_at.elapsed();
    assert!(released.len() >= 14, "{released:?}");
    let limit = both_stopped + ROUND + ROUND / 5;
    let after = running.read_again(&released, stopped_at, limit).await;
    eprintln!("read again after {after:?} (both stopped after {both_stopped:?})");
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
}

/// The longest time any shard of `running` went without a delivery during the next
/// `window`, sampled every 50 ms (shards fed a record a second), leaving out `except`:
/// (shard, gap).
async fn longest_gap(running: &Running, window: Duration, except: &[String]) -> (String, Duration) {
    let start = tokio::time::Instant::now();
    let mut worst = (String::new(), Duration::ZERO);
    while start.elapsed() < window {
        for (shard, last) in running.last_delivery.lock().unwrap().iter() {
            if except.contains(shard) {
                continue;
            }
            let gap = last.elapsed();
            if gap > worst.1 {
                worst = (shard.clone(), gap);
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worst
}

/// Regression: the leader handed on leases it had run all along, each unread until the receiver's next take round.
///
/// In a fleet of 12 one worker stops gracefully; the leader takes its 8 released
/// leases at once and hands what it holds above its share to workers below theirs.
/// Handing on a lease it had run all along left that shard unread until the
/// receiver's next take round (10.4 s, against 1.0 s when no other shard moved); the
/// leader hands on first the leases it took to cover for others. Bound: no shard but the stopped worker's goes more than 5 s (with the 1 s
/// feed) without a delivery.
#[tokio::test(start_paused = true)]
async fn a_lease_the_leader_hands_over_is_read_again_within_a_renew_interval() {
    let mut running = balanced_fleet(12).await;
    let (_, before) = longest_gap(&running, ROUND, &[]).await;
    // The stopped worker's own shards wait for a round (see `group_scale::reads`): left out.
    let released = tokio::time::timeout(Duration::from_secs(60), running.stop_worker(7))
        .await
        .expect("w007 stops");
    let (shard, gap) = longest_gap(&running, ROUND * 6, &released).await;
    eprintln!("longest gap before {before:?}, after the stop {gap:?} ({shard})");
    assert!(
        gap <= Duration::from_secs(5),
        "shard {shard} (not the stopped worker's) went {gap:?} without a delivery while the fleet rebalanced after a graceful stop (before: {before:?})"
    );
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
}

/// The rows of the table owned by an incarnation of worker `id`: (key, owner).
fn rows_of(running: &Running, id: &str) -> Vec<(String, String)> {
    let prefix = format!("{id}#");
    running
        .memory
        .table(fleet::GROUP)
        .rows()
        .into_iter()
        .filter_map(|r| {
            r.owner
                .filter(|o| o.starts_with(&prefix))
                .map(|o| (r.key, o))
        })
        .collect()
}

/// Regression: a leader's healthy leases were taken as expired because one of its rows stopped renewing.
///
/// No lease is inferred expired from other rows: only a row whose own counter stood
/// still for a lease duration is. The leader of a fleet of
/// 12 is alive and renews every lease but one: the renewals of its first row in key
/// order time out for good (a hot item, a store partition in trouble). That row expires
/// and may be taken, as any row not renewed for a lease duration; none of the leader's
/// other rows may be. Bound: no lease of the leader but the stuck one changes owner
/// within 6 rounds.
#[tokio::test(start_paused = true)]
async fn a_leader_whose_watched_row_stops_renewing_keeps_its_other_leases() {
    let running = balanced_fleet(12).await;
    let leader = format!("w{:03}", running.leader().expect("a fleet has a leader"));
    let mut before = rows_of(&running, &leader);
    before.sort();
    assert!(before.len() >= 7, "{before:?}");
    let (stuck, _) = before[0].clone();
    running
        .failing_renewals
        .lock()
        .unwrap()
        .push((leader.clone(), stuck.clone()));
    let others: Vec<(String, String)> = before[1..].to_vec();
    let moved = |r: &Running| {
        let now = rows_of(r, &leader);
        others
            .iter()
            .filter(|o| !now.contains(o))
            .map(|(k, _)| k.clone())
            .collect::<Vec<_>>()
    };
    let lost_at = running
        .until(running.started.elapsed() + ROUND * 6, |r| {
            !moved(r).is_empty()
        })
        .await;
    let taken = moved(&running);
    assert!(
        lost_at.is_none(),
        "the live leader lost {} of its {} healthy leases ({taken:?}) at {lost_at:?} after \
         only the renewals of {stuck} failed; owners now: {:?}",
        taken.len(),
        others.len(),
        leases_per_owner(&running.memory)
    );
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
}

/// Regression: a lease of the live leader whose renewals all failed stayed unread for good.
///
/// A lease no renewal landed on for a lease duration is given up. Same start as the
/// previous test: the renewals of one row of the live leader time out for good. Were
/// the lease kept, the leader would stop delivering that shard (its lease is no longer
/// fresh) but keep it ("a lease we run is ours even if it looks expired"); the other workers
/// see it expired, but only the leader covers for expired leases in a fleet above 3,
/// and every worker is at its share, so nobody would take it: the shard would stay
/// unread for good (promise 7: a stuck call never costs a worker its leases, nor a
/// shard its reader). Bound: the shard is read again within two lease durations and a
/// round of its last renewal. (The leader's role is not the cause: with 3 workers,
/// where every worker lists every round, every worker's plan would deal the "expired"
/// lease back to its owner, then one below its share, which runs it already.)
#[tokio::test(start_paused = true)]
async fn a_leader_row_whose_renewals_fail_is_read_again_by_someone() {
    let running = balanced_fleet(12).await;
    let leader = format!("w{:03}", running.leader().expect("a fleet has a leader"));
    let mut rows = rows_of(&running, &leader);
    rows.sort();
    let (stuck, _) = rows[0].clone();
    let since = tokio::time::Instant::now();
    running
        .failing_renewals
        .lock()
        .unwrap()
        .push((leader.clone(), stuck.clone()));
    let limit = ROUND * 3 + ROUND / 5;
    let read = running
        .until(running.started.elapsed() + limit, |r| {
            r.delivered_after(&stuck, since + ROUND)
        })
        .await;
    let owner = running
        .memory
        .table(fleet::GROUP)
        .rows()
        .into_iter()
        .find(|r| r.key == stuck)
        .and_then(|r| r.owner);
    assert!(
        read.is_some(),
        "{stuck} (renewals by the leader failing) not read again within {limit:?}; owner now {owner:?}"
    );
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
}
