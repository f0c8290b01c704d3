//! Second review of the lease-reads change (issue 12): the follow-up fixes (commits
//! 04836a5..824566a: watched rows of the leader and successor, the stalled-row
//! inference, covered leases handed on first). Each test states the promise it holds
//! the fixes to and failed on 824566a. Memory backend, tokio's paused clock, fixed seeds
//! (the fleet's).

mod fleet;

use std::time::Duration;

use fleet::{leases_per_owner, Fleet, Running};

/// The default take round (the lease duration, 10 s).
const ROUND: Duration = Duration::from_secs(10);

/// A fed, balanced fleet of `workers` over 96 shards, a few rounds after it balanced
/// (roles settled: the third and fourth live workers watch the leader and successor).
async fn balanced_fleet(workers: usize) -> Running {
    let running = fleet::start(Fleet {
        feed_every: Some(Duration::from_secs(1)),
        ..Fleet::new(96, workers)
    })
    .await;
    assert!(
        running
            .until(Duration::from_secs(60), |r| r.balanced())
            .await
            .is_some(),
        "not balanced: {:?}",
        leases_per_owner(&running.memory)
    );
    tokio::time::sleep(ROUND * 3).await;
    running
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

/// Finding 1. The leader (w000) of a fleet of 12 is alive and renews every lease but
/// one: the renewals of its first row in key order (the row the third and fourth live
/// workers watch) time out for good (a hot item, a store partition in trouble). That
/// row expires and may be taken, as any row not renewed for a lease duration. But the
/// watchers take its standing still for a crash of the leader and count every other
/// row of the leader expired (`balance`, "A watched row ... stood still"), although
/// those were renewed all along: a live worker's leases are taken, each such shard
/// moves (a drain-less take, read twice up to the fenced renewal), and the leader,
/// now short, takes leases back (churn). Bound: no lease of the leader but the stuck
/// one changes owner within 6 rounds.
#[tokio::test(start_paused = true)]
async fn a_leader_whose_watched_row_stops_renewing_keeps_its_other_leases() {
    let running = balanced_fleet(12).await;
    let mut before = rows_of(&running, "w000");
    before.sort();
    assert!(before.len() >= 7, "{before:?}");
    let (stuck, _) = before[0].clone();
    running
        .failing_renewals
        .lock()
        .unwrap()
        .push(("w000".to_owned(), stuck.clone()));
    let others: Vec<(String, String)> = before[1..].to_vec();
    let moved = |r: &Running| {
        let now = rows_of(r, "w000");
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

/// Finding 2. Same start as finding 1: the renewals of one row of the live leader time
/// out for good. The leader stops delivering that shard (its lease is no longer fresh)
/// but keeps it ("a lease we run is ours even if it looks expired"); the other workers
/// see it expired, but only the leader covers for expired leases in a fleet above 3,
/// and every worker is at its share, so nobody takes it: the shard stays unread for
/// good (promise 7: a stuck call never costs a worker its leases, nor a shard its
/// reader). Bound: the shard is read again within two lease durations and a round of
/// its last renewal. (Not caused by issue 12 or its follow-ups: the same test fails with
/// 3 workers, where every worker lists every round; every worker's plan deals the
/// "expired" lease back to its owner, now one below its share, which runs it already.)
#[tokio::test(start_paused = true)]
async fn a_leader_row_whose_renewals_fail_is_read_again_by_someone() {
    let running = balanced_fleet(12).await;
    let mut rows = rows_of(&running, "w000");
    rows.sort();
    let (stuck, _) = rows[0].clone();
    let since = tokio::time::Instant::now();
    running
        .failing_renewals
        .lock()
        .unwrap()
        .push(("w000".to_owned(), stuck.clone()));
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
