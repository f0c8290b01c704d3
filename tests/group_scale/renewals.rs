//! Renewal pacing: a worker holding 200 leases spreads their renewals over
//! the renew interval instead of sending 200 UpdateItems in the same millisecond (a
//! DynamoDB partition throttles such bursts), and no lease waits longer between two
//! renewals than the renew interval, so fencing is as strong as before. Simulated time
//! (tokio's paused clock), default timings, 8 ms per lease-store call; every store call
//! is logged by the fleet's store wrapper.

use testkit::fleet;

use std::collections::BTreeMap;
use std::time::Duration;

use fleet::{leases_per_owner, Fleet};
use tokio::time::Instant;

const LEASES: u32 = 200;
/// The default renew interval: a third of the default lease duration (10 s).
const RENEW_INTERVAL: Duration = Duration::from_millis(3_333);
/// At most this many renewals in any 100 ms: 10% of the leases (an even spread over
/// the default interval is 6; 200 at once before pacing).
const MAX_PER_100_MS: usize = 20;

#[tokio::test(start_paused = true)]
async fn two_hundred_leases_are_renewed_spread_over_the_interval() {
    let running = fleet::start(Fleet::new(LEASES, 1)).await;
    let leased = running
        .until(Duration::from_secs(60), |r| {
            leases_per_owner(&r.memory).values().sum::<usize>() == LEASES as usize
        })
        .await;
    assert!(leased.is_some(), "every shard leased within a minute");
    let from = Instant::now();
    // Ten renew intervals of steady state; the lease must never change hands meanwhile.
    let moved = running
        .until(leased.unwrap() + RENEW_INTERVAL * 10, |r| {
            let owners = leases_per_owner(&r.memory);
            owners.len() != 1 || owners.values().sum::<usize>() != LEASES as usize
        })
        .await;
    let calls = running.calls.lock().unwrap().clone();
    running.stop().await;
    assert_eq!(moved, None, "a lease was lost or moved");

    let renewals: Vec<Instant> = calls
        .iter()
        .filter(|c| c.op == "renew" && c.at >= from)
        .map(|c| c.at)
        .collect();
    assert!(
        renewals.len() >= LEASES as usize * 9,
        "every lease renewed about once per interval: {} renewals",
        renewals.len()
    );
    // The busiest 100 ms (sliding window over the sorted send times).
    let mut busiest = 0;
    let mut first = 0;
    for (i, at) in renewals.iter().enumerate() {
        while *at - renewals[first] >= Duration::from_millis(100) {
            first += 1;
        }
        busiest = busiest.max(i + 1 - first);
    }
    eprintln!(
        "{} renewals in {:?}; at most {busiest} in any 100 ms",
        renewals.len(),
        RENEW_INTERVAL * 10
    );
    assert!(
        busiest <= MAX_PER_100_MS,
        "{busiest} renewals within 100 ms (at most {MAX_PER_100_MS})"
    );

    // Fencing: from its take on, no lease waited longer than the renew interval for a
    // renewal (sent; each call takes 8 ms more).
    let mut last: BTreeMap<&str, Instant> = BTreeMap::new();
    let mut longest = Duration::ZERO;
    for call in &calls {
        let (Some(key), "take" | "renew") = (&call.key, call.op) else {
            continue;
        };
        if let Some(before) = last.insert(key, call.at) {
            longest = longest.max(call.at - before);
        }
    }
    assert!(
        longest <= RENEW_INTERVAL + Duration::from_millis(1),
        "a lease waited {longest:?} between renewals (renew interval {RENEW_INTERVAL:?})"
    );
}
