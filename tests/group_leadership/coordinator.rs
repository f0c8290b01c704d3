//! Whatever fails around leadership, no crash goes uncovered: the coordinator-state
//! table refused or deleted while the group runs (every worker then lists and takes
//! for itself), refused at start-up (a typed error, not a retry loop), a leader stopped
//! while it drains a slow call (it gives the leadership up before it drains), and a
//! take-over whose answer was lost (settled by a read before the worker stops).
//! Memory backend, tokio's paused clock, fixed seeds.

use testkit::fleet;
use testkit::hooks::{Hooked, Hooks};

use std::convert::Infallible;
use std::future::IntoFuture;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fleet::CoordinatorFault;
use shardflow::kinesis::StreamAdmin;
use shardflow::lease::LeaseError;
use shardflow::{Consumer, ConsumerError, Memory, Message};
use tokio::time::Instant;

use super::{balanced_fleet, LEASE, READ, ROUND};

/// The bound after a crash while no leader can be known (every worker lists and takes
/// for itself, without a leader's follow-up listing): two lease durations and a take
/// round.
const AFTER_CRASH: Duration = Duration::from_secs(30);

/// Eight workers, 32 shards; the coordinator-state table starts failing for every
/// worker (`fault`), then a worker that does not lead crashes: its shards are read
/// again within the crash bound, though nobody can lead.
async fn crash_while_the_coordinator_table_fails(fault: CoordinatorFault) {
    let mut running = balanced_fleet(8).await;
    let leader = running.leader().expect("a fleet has a leader");
    *running.coordinator_fault.lock().unwrap() = Some(fault);
    // The leader's renewals of its item fail for a lease duration: it stops leading.
    tokio::time::sleep(LEASE + ROUND).await;
    let victim = (0..8).find(|&i| i != leader).expect("another worker");
    let killed_at = Instant::now();
    let orphans = running.kill(victim);
    assert_eq!(orphans.len(), 4, "a balanced fleet: four shards each");
    let after = running
        .read_again(&orphans, killed_at, AFTER_CRASH + READ)
        .await;
    eprintln!("{fault:?}: read again after {after:?}");
    *running.coordinator_fault.lock().unwrap() = None;
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
}

/// Regression: with the coordinator-state table refused (an IAM policy for the lease
/// table only), a crashed worker's shards were never read again and nobody said so.
#[tokio::test(start_paused = true)]
async fn a_crashed_workers_shards_are_read_again_while_the_coordinator_table_is_refused() {
    crash_while_the_coordinator_table_fails(CoordinatorFault::Denied).await;
}

/// Regression: with the coordinator-state table deleted while the group runs, a crashed
/// worker's shards were never read again and nobody said so.
#[tokio::test(start_paused = true)]
async fn a_crashed_workers_shards_are_read_again_while_the_coordinator_table_is_gone() {
    crash_while_the_coordinator_table_fails(CoordinatorFault::Deleted).await;
}

/// With only the coordinator-state table's writes refused (its reads answer: a policy
/// granting `GetItem` but not `UpdateItem`), the leader cannot renew its item and nobody
/// can take it over: a crashed worker's shards are still read again within the bound.
#[tokio::test(start_paused = true)]
async fn a_crashed_workers_shards_are_read_again_while_leader_item_writes_are_refused() {
    crash_while_the_coordinator_table_fails(CoordinatorFault::WritesDenied).await;
}

/// With only the coordinator-state table's reads refused (a policy granting `UpdateItem`
/// but not `GetItem`): the leader keeps renewing, the others cannot see it; a crashed
/// worker's shards are still read again within the bound.
#[tokio::test(start_paused = true)]
async fn a_crashed_workers_shards_are_read_again_while_leader_item_reads_are_refused() {
    crash_while_the_coordinator_table_fails(CoordinatorFault::ReadsDenied).await;
}

/// Refuses every call to the coordinator-state table.
struct RefuseCoordinator;

#[async_trait::async_trait]
impl Hooks for RefuseCoordinator {
    async fn before_lease(&self, op: &'static str, _key: Option<&str>) -> Result<(), LeaseError> {
        if op.starts_with("leader_") {
            return Err(LeaseError::AccessDenied(
                "injected: not authorized to use the coordinator-state table".into(),
            ));
        }
        Ok(())
    }
}

/// A worker whose coordinator-state table is refused at start-up ends with the typed
/// error at once instead of retrying for ever.
#[tokio::test(start_paused = true)]
async fn a_coordinator_table_refused_at_start_up_is_a_typed_error() {
    let memory = Memory::new();
    memory
        .streams()
        .create_stream("orders", 2)
        .await
        .expect("create the stream");
    let consumer = Consumer::builder()
        .stream("orders")
        .group("billing")
        .backend(Hooked::new(memory, RefuseCoordinator))
        .build()
        .expect("a valid configuration");
    let handler = tower::service_fn(|_: Message| async { Ok::<_, Infallible>(()) });
    let ended = tokio::time::timeout(Duration::from_secs(60), consumer.run(handler).into_future())
        .await
        .expect("start-up ends instead of retrying for ever");
    assert!(
        matches!(
            ended,
            Err(ConsumerError::Lease(LeaseError::AccessDenied(_)))
        ),
        "{ended:?}"
    );
}

/// Regression: a leader stopped while a 28 s handler call was in flight kept the leader
/// item through its drain, and a worker that crashed at that moment had its shards read
/// again only after 41 s.
#[tokio::test(start_paused = true)]
async fn a_crash_while_the_leader_drains_a_slow_call_is_covered_within_the_bound() {
    let mut running = balanced_fleet(12).await;
    let leader = running.leader().expect("a fleet has a leader");
    let id = format!("w{leader:03}");
    running
        .slow_calls
        .lock()
        .unwrap()
        .insert(id.clone(), Duration::from_secs(28));
    let started = running
        .until(running.started.elapsed() + ROUND, |r| {
            !r.slow_calls.lock().unwrap().contains_key(&id)
        })
        .await;
    assert!(started.is_some(), "the slow call never started");
    let at = Instant::now();
    running.ask_to_stop(leader);
    let victim = (0..12).find(|&i| i != leader).expect("another worker");
    let orphans = running.kill(victim);
    // The crash bound with a leader (the next one takes over at once): a lease
    // duration and a round.
    let after = running.read_again(&orphans, at, LEASE + ROUND + READ).await;
    eprintln!("read again after {after:?}");
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
}

/// Regression: the leader stopped, the next worker's take of the leader item landed but
/// its answer came after the call deadline, and that worker stopped before its next
/// round without releasing the item: the released shards waited 22.6 s.
#[tokio::test(start_paused = true)]
async fn a_take_over_whose_answer_was_lost_is_released_when_that_worker_stops() {
    let mut running = balanced_fleet(12).await;
    let leader = running.leader().expect("a fleet has a leader");
    running.lose_next_claim_answer.store(true, Ordering::SeqCst);
    let at = Instant::now();
    let mut released =
        tokio::time::timeout(Duration::from_secs(60), running.stop_workers(&[leader]))
            .await
            .expect("the leader stops");
    let claimed = running
        .until(running.started.elapsed() + ROUND * 2, |r| {
            !r.lost_claim_answers.lock().unwrap().is_empty()
        })
        .await;
    assert!(claimed.is_some(), "nobody took the leadership over");
    let who = running.lost_claim_answers.lock().unwrap()[0].clone();
    let next = running.index_of(&who).expect("a worker of the fleet");
    assert_eq!(running.leader(), Some(next), "the take landed");
    released.extend(
        tokio::time::timeout(Duration::from_secs(60), running.stop_workers(&[next]))
            .await
            .expect("the next leader stops"),
    );
    let stopped = at.elapsed();
    // Within a round of the stop (the bound counts from now).
    let after = running.read_again(&released, at, ROUND + READ).await;
    eprintln!("both stopped after {stopped:?}: read again after {after:?}");
    tokio::time::timeout(Duration::from_secs(120), running.stop())
        .await
        .expect("the fleet stops");
}
