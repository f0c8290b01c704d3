use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::Notify;
use tower::{service_fn, ServiceExt};

use super::*;
use crate::test_support::message;

type Handler = tower::util::BoxCloneService<Message<Bytes>, u32, BoxError>;

/// A handler counting its calls; fails while `fail` says so.
fn counting(fail: fn(u32) -> bool) -> (Arc<AtomicU32>, Handler) {
    let calls = Arc::new(AtomicU32::new(0));
    let counter = calls.clone();
    let svc = service_fn(move |_m: Message<Bytes>| {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            if fail(n) {
                Err::<u32, BoxError>("handler failed".into())
            } else {
                Ok(n)
            }
        }
    });
    (calls, tower::util::BoxCloneService::new(svc))
}

#[tokio::test(start_paused = true)]
async fn a_done_key_skips_the_handler() {
    let (calls, handler) = counting(|_| false);
    let svc = DedupLayer::new(MemoryDedupStore::new(100)).layer(handler);
    let first = svc.clone().oneshot(message(1, b"x")).await.unwrap();
    let again = svc.clone().oneshot(message(1, b"x")).await.unwrap();
    let other = svc.oneshot(message(2, b"x")).await.unwrap();
    assert_eq!(first, DedupOutcome::Handled(1));
    assert_eq!(again, DedupOutcome::Duplicate);
    assert_eq!(other, DedupOutcome::Handled(2));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(start_paused = true)]
async fn a_failure_releases_the_key_for_the_next_delivery() {
    let (calls, handler) = counting(|n| n == 1);
    let svc = DedupLayer::new(MemoryDedupStore::new(100)).layer(handler);
    let err = svc.clone().oneshot(message(1, b"x")).await.unwrap_err();
    assert_eq!(err.to_string(), "handler failed");
    let start = tokio::time::Instant::now();
    let ok = svc.oneshot(message(1, b"x")).await.unwrap();
    assert_eq!(ok, DedupOutcome::Handled(2));
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "released: no wait for expiry"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A handler that blocks until `go` is notified.
fn gated(go: Arc<Notify>, calls: Arc<AtomicU32>) -> Handler {
    tower::util::BoxCloneService::new(service_fn(move |_m: Message<Bytes>| {
        let go = go.clone();
        let n = calls.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            go.notified().await;
            Ok::<_, BoxError>(n)
        }
    }))
}

#[tokio::test(start_paused = true)]
async fn a_key_in_progress_elsewhere_is_waited_for_then_found_done() {
    let go = Arc::new(Notify::new());
    let calls = Arc::new(AtomicU32::new(0));
    let store = MemoryDedupStore::new(100);
    let layer = DedupLayer::new(store).wait_interval(Duration::from_millis(50));
    let a = layer.layer(gated(go.clone(), calls.clone()));
    let b = a.clone();
    let first = tokio::spawn(a.oneshot(message(1, b"x")));
    tokio::task::yield_now().await; // let A reserve
    let second = tokio::spawn(b.oneshot(message(1, b"x")));
    tokio::time::sleep(Duration::from_millis(500)).await;
    go.notify_one();
    assert_eq!(first.await.unwrap().unwrap(), DedupOutcome::Handled(1));
    assert_eq!(second.await.unwrap().unwrap(), DedupOutcome::Duplicate);
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_key_held_too_long_fails_transiently_without_running_the_handler() {
    let go = Arc::new(Notify::new());
    let calls = Arc::new(AtomicU32::new(0));
    let layer = DedupLayer::new(MemoryDedupStore::new(100)).max_wait(Duration::from_secs(1));
    let a = layer.layer(gated(go.clone(), calls.clone()));
    let first = tokio::spawn(a.clone().oneshot(message(1, b"x")));
    tokio::task::yield_now().await;
    let start = tokio::time::Instant::now();
    let err = a.oneshot(message(1, b"x")).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<DedupError>(),
        Some(DedupError::InProgress { .. })
    ));
    assert_eq!(start.elapsed(), Duration::from_secs(1));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    go.notify_one();
    first.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn an_expired_reservation_is_taken_over() {
    // The first holder "crashed": its reservation is never committed nor released.
    let store = MemoryDedupStore::new(100);
    store
        .reserve(
            "orders/shardId-000000000000/1/0",
            "crashed",
            Duration::from_secs(3),
        )
        .await
        .unwrap();
    let (calls, handler) = counting(|_| false);
    let svc = DedupLayer::new(store)
        .max_wait(Duration::from_secs(10))
        .layer(handler);
    assert_eq!(
        svc.oneshot(message(1, b"x")).await.unwrap(),
        DedupOutcome::Handled(1)
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

struct BrokenStore;

#[async_trait::async_trait]
impl DedupStore for BrokenStore {
    async fn reserve(&self, _: &str, _: &str, _: Duration) -> Result<Reservation, StoreError> {
        Err(StoreError::Backend {
            operation: "reserve",
            source: "connection refused".into(),
        })
    }
    async fn commit(&self, _: &str, _: &str, _: Duration) -> Result<Commit, StoreError> {
        unreachable!("never reserved")
    }
    async fn release(&self, _: &str, _: &str) -> Result<(), StoreError> {
        unreachable!("never reserved")
    }
}

#[tokio::test]
async fn a_store_failure_is_a_transient_error_and_the_handler_does_not_run() {
    let (calls, handler) = counting(|_| false);
    let svc = DedupLayer::new(Arc::new(BrokenStore)).layer(handler);
    let err = svc.oneshot(message(1, b"x")).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<DedupError>(),
        Some(DedupError::Store(_))
    ));
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn a_business_key_dedups_records_at_different_positions() {
    let (calls, handler) = counting(|_| false);
    let svc = DedupLayer::new(MemoryDedupStore::new(100))
        .key(|m: &Message<Bytes>| String::from_utf8_lossy(&m.payload).into_owned())
        .layer(handler);
    let a = svc.clone().oneshot(message(1, b"order-7")).await.unwrap();
    let b = svc.clone().oneshot(message(2, b"order-7")).await.unwrap();
    let c = svc.oneshot(message(3, b"order-8")).await.unwrap();
    assert_eq!(
        (a, b, c),
        (
            DedupOutcome::Handled(1),
            DedupOutcome::Duplicate,
            DedupOutcome::Handled(2)
        )
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// A store where every key is always in progress elsewhere; counts the reserves.
#[derive(Clone, Default)]
struct AlwaysInProgress(Arc<AtomicU32>);

#[async_trait::async_trait]
impl DedupStore for AlwaysInProgress {
    async fn reserve(&self, _: &str, _: &str, _: Duration) -> Result<Reservation, StoreError> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(Reservation::InProgress)
    }
    async fn commit(&self, _: &str, _: &str, _: Duration) -> Result<Commit, StoreError> {
        unreachable!("never reserved")
    }
    async fn release(&self, _: &str, _: &str) -> Result<(), StoreError> {
        Ok(())
    }
}

// The real clock: a paused one would hide a busy loop. (Tokio's timer also rounds a
// zero sleep up to its next millisecond tick; the clamp makes the bound ours, not an
// accident of the timer.)
#[tokio::test]
async fn a_zero_wait_interval_does_not_busy_loop_on_the_store() {
    let store = AlwaysInProgress::default();
    let (calls, handler) = counting(|_| false);
    let svc = DedupLayer::new(store.clone())
        .wait_interval(Duration::ZERO)
        .max_wait(Duration::from_millis(50))
        .layer(handler);
    let err = svc.oneshot(message(1, b"x")).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<DedupError>(),
        Some(DedupError::InProgress { .. })
    ));
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // At most one look per millisecond (with room for a slow machine's timer).
    let reserves = store.0.load(Ordering::SeqCst);
    assert!(reserves <= 60, "{reserves} reserves in 50 ms");
}

#[tokio::test(start_paused = true)]
async fn groups_sharing_a_store_do_not_skip_each_others_records() {
    let shared = MemoryDedupStore::new(100);
    let (billing_calls, billing) = counting(|_| false);
    let (shipping_calls, shipping) = counting(|_| false);
    let billing = DedupLayer::new(shared.clone())
        .namespace("billing")
        .layer(billing);
    let shipping = DedupLayer::new(shared.clone())
        .namespace("shipping")
        .layer(shipping);
    assert_eq!(
        billing.clone().oneshot(message(1, b"x")).await.unwrap(),
        DedupOutcome::Handled(1)
    );
    assert_eq!(
        shipping.clone().oneshot(message(1, b"x")).await.unwrap(),
        DedupOutcome::Handled(1),
        "the other group's record is not a duplicate"
    );
    // Within a group, dedup still works.
    assert!(billing
        .oneshot(message(1, b"x"))
        .await
        .unwrap()
        .is_duplicate());
    assert!(shipping
        .oneshot(message(1, b"x"))
        .await
        .unwrap()
        .is_duplicate());
    assert_eq!(billing_calls.load(Ordering::SeqCst), 1);
    assert_eq!(shipping_calls.load(Ordering::SeqCst), 1);
    assert_eq!(shared.len(), 2);
}

#[tokio::test(start_paused = true)]
async fn a_call_dropped_mid_handler_releases_its_key() {
    let store = MemoryDedupStore::new(100);
    let stuck = DedupLayer::new(store.clone()).layer(tower::util::BoxCloneService::new(
        service_fn(|_m: Message<Bytes>| std::future::pending::<Result<u32, BoxError>>()),
    ));
    // An outer timeout drops the call while the handler holds the key.
    let timed_out =
        tokio::time::timeout(Duration::from_secs(1), stuck.oneshot(message(1, b"x"))).await;
    assert!(timed_out.is_err());
    tokio::task::yield_now().await; // the spawned release runs
    assert!(store.is_empty(), "the key was released");

    let (calls, handler) = counting(|_| false);
    let svc = DedupLayer::new(store).layer(handler);
    let start = tokio::time::Instant::now();
    assert_eq!(
        svc.oneshot(message(1, b"x")).await.unwrap(),
        DedupOutcome::Handled(1)
    );
    assert_eq!(start.elapsed(), Duration::ZERO, "no wait for the expiry");
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A store whose commits wait for `go`, to drop a call in the middle of one.
#[derive(Clone)]
struct SlowCommit {
    inner: MemoryDedupStore,
    go: Arc<Notify>,
}

#[async_trait::async_trait]
impl DedupStore for SlowCommit {
    async fn reserve(&self, k: &str, t: &str, ttl: Duration) -> Result<Reservation, StoreError> {
        self.inner.reserve(k, t, ttl).await
    }
    async fn commit(&self, k: &str, t: &str, ttl: Duration) -> Result<Commit, StoreError> {
        self.go.notified().await;
        self.inner.commit(k, t, ttl).await
    }
    async fn release(&self, k: &str, t: &str) -> Result<(), StoreError> {
        self.inner.release(k, t).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_call_dropped_after_the_handler_succeeded_still_commits() {
    let go = Arc::new(Notify::new());
    let store = SlowCommit {
        inner: MemoryDedupStore::new(100),
        go: go.clone(),
    };
    let (calls, handler) = counting(|_| false);
    let svc = DedupLayer::new(store.clone()).layer(handler);
    let timed_out = tokio::time::timeout(
        Duration::from_secs(1),
        svc.clone().oneshot(message(1, b"x")),
    )
    .await;
    assert!(timed_out.is_err(), "dropped while committing");
    go.notify_one(); // the spawned commit goes through
    tokio::task::yield_now().await;
    assert!(svc.oneshot(message(1, b"x")).await.unwrap().is_duplicate());
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the side effect ran once");
}
