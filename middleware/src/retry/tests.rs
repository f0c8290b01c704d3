use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use shardflow::Message;
use tokio::time::Instant;
use tower::{service_fn, Layer, ServiceExt};

use super::*;
use crate::test_support::message;

#[derive(Debug, PartialEq)]
enum Failure {
    Flaky,
    Invalid,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}

/// A handler failing its first `failures` calls with `kind`, counting calls.
fn flaky(
    failures: u32,
    kind: fn() -> Failure,
) -> (
    Arc<AtomicU32>,
    impl Service<Message<Bytes>, Response = u32, Error = Failure, Future: Send> + Clone,
) {
    let calls = Arc::new(AtomicU32::new(0));
    let counter = calls.clone();
    let svc = service_fn(move |_m: Message<Bytes>| {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            if n <= failures {
                Err(kind())
            } else {
                Ok(n)
            }
        }
    });
    (calls, svc)
}

/// Tokio's timer rounds each sleep up to the next millisecond: allow that much per sleep.
fn assert_waited(start: Instant, expected: Duration) {
    let waited = start.elapsed();
    assert!(
        waited >= expected && waited <= expected + Duration::from_millis(5),
        "waited {waited:?}, expected {expected:?}"
    );
}

fn exact() -> RetryPolicy {
    RetryPolicy::exponential()
        .jitter(false)
        .initial_delay(Duration::from_millis(100))
}

#[tokio::test(start_paused = true)]
async fn succeeds_after_transient_failures_with_the_exact_delays() {
    let (calls, handler) = flaky(2, || Failure::Flaky);
    let svc = RetryLayer::new(exact().max_attempts(3)).layer(handler);
    let start = Instant::now();
    let attempt = svc.oneshot(message(1, b"x")).await.unwrap();
    assert_eq!(attempt, 3);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_waited(start, Duration::from_millis(100 + 200));
}

#[tokio::test(start_paused = true)]
async fn gives_up_after_max_attempts_with_the_last_error() {
    let (calls, handler) = flaky(u32::MAX, || Failure::Flaky);
    let svc = RetryLayer::new(exact().max_attempts(4)).layer(handler);
    let err = svc.oneshot(message(1, b"x")).await.unwrap_err();
    assert_eq!(err, Failure::Flaky);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[tokio::test(start_paused = true)]
async fn permanent_errors_are_not_retried() {
    let (calls, handler) = flaky(u32::MAX, || Failure::Invalid);
    let policy = exact().max_attempts(5).classify(|e: &Failure| match e {
        Failure::Invalid => ErrorClass::Permanent,
        Failure::Flaky => ErrorClass::Transient,
    });
    let svc = RetryLayer::new(policy).layer(handler);
    let start = Instant::now();
    assert_eq!(
        svc.oneshot(message(1, b"x")).await.unwrap_err(),
        Failure::Invalid
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(start.elapsed(), Duration::ZERO);
}

#[tokio::test(start_paused = true)]
async fn max_elapsed_stops_before_max_attempts() {
    let (calls, handler) = flaky(u32::MAX, || Failure::Flaky);
    // Delays 100, 200, 400, 800...: within 750 ms of the first failure only 100 + 200
    // (+ 400 would start at 700) fit; the next one would start at 1500.
    let policy = exact()
        .max_attempts(100)
        .max_elapsed(Duration::from_millis(750));
    let svc = RetryLayer::new(policy).layer(handler);
    let start = Instant::now();
    svc.oneshot(message(1, b"x")).await.unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 4);
    assert_waited(start, Duration::from_millis(700));
}

#[tokio::test(start_paused = true)]
async fn a_lost_lease_stops_retrying() {
    let (calls, handler) = flaky(u32::MAX, || Failure::Flaky);
    let svc = RetryLayer::new(exact().max_attempts(5)).layer(handler);
    let msg = message(1, b"x");
    msg.metadata.lease_lost.cancel();
    svc.oneshot(msg).await.unwrap_err();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn a_lease_lost_during_the_backoff_ends_the_wait_with_the_last_error() {
    let (calls, handler) = flaky(u32::MAX, || Failure::Flaky);
    let policy = exact()
        .initial_delay(Duration::from_secs(10))
        .max_attempts(5);
    let svc = RetryLayer::new(policy).layer(handler);
    let msg = message(1, b"x");
    let lease_lost = msg.metadata.lease_lost.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        lease_lost.cancel();
    });
    let start = Instant::now();
    assert_eq!(svc.oneshot(msg).await.unwrap_err(), Failure::Flaky);
    assert_eq!(
        start.elapsed(),
        Duration::from_secs(1),
        "not the whole 10 s"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn jittered_delays_stay_within_bounds() {
    let (calls, handler) = flaky(2, || Failure::Flaky);
    let svc = RetryLayer::new(
        RetryPolicy::exponential()
            .initial_delay(Duration::from_millis(100))
            .max_attempts(3)
            .jitter_seed(7),
    )
    .layer(handler);
    let start = Instant::now();
    svc.oneshot(message(1, b"x")).await.unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(300) && waited < Duration::from_millis(600),
        "{waited:?}"
    );
}

/// A handler that fails every call and, after its first call, is ready again only once
/// `gate` fires (as a service that frees capacity when its shard is given up would).
#[derive(Clone)]
struct GatedAfterFirstCall {
    calls: Arc<AtomicU32>,
    gate: tokio_util::sync::CancellationToken,
    waker: Arc<std::sync::Mutex<Option<std::task::Waker>>>,
}

impl Service<Message<Bytes>> for GatedAfterFirstCall {
    type Response = ();
    type Error = Failure;
    type Future = std::future::Ready<Result<(), Failure>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Failure>> {
        if self.calls.load(Ordering::SeqCst) == 0 || self.gate.is_cancelled() {
            return Poll::Ready(Ok(()));
        }
        *self.waker.lock().unwrap() = Some(cx.waker().clone());
        Poll::Pending
    }

    fn call(&mut self, _m: Message<Bytes>) -> Self::Future {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Err(Failure::Flaky))
    }
}

/// Regression: a lease lost while the service was getting ready after a backoff still
/// led to another call of the handler.
#[tokio::test(start_paused = true)]
async fn a_lease_lost_while_getting_ready_ends_the_call_without_another_attempt() {
    let msg = message(1, b"x");
    let handler = GatedAfterFirstCall {
        calls: Arc::default(),
        gate: msg.metadata.lease_lost.clone(),
        waker: Arc::default(),
    };
    let (calls, lease_lost, waker) = (
        handler.calls.clone(),
        msg.metadata.lease_lost.clone(),
        handler.waker.clone(),
    );
    let svc = RetryLayer::new(exact().max_attempts(5)).layer(handler);
    // The backoff is 100 ms; the lease goes 1 s in, while the service is not ready.
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        lease_lost.cancel();
        if let Some(waker) = waker.lock().unwrap().take() {
            waker.wake();
        }
    });
    let start = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(60), svc.oneshot(msg))
        .await
        .expect("the call ends once the lease is lost");
    assert_eq!(result.unwrap_err(), Failure::Flaky);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "no call after the lease was lost"
    );
    assert_eq!(start.elapsed(), Duration::from_secs(1));
}

/// A handler that panics on its first `panics` calls, counting calls.
fn panicky(
    panics: u32,
) -> (
    Arc<AtomicU32>,
    impl Service<Message<Bytes>, Response = u32, Error = Failure, Future: Send> + Clone,
) {
    let calls = Arc::new(AtomicU32::new(0));
    let counter = calls.clone();
    let svc = service_fn(move |_m: Message<Bytes>| {
        let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
        async move {
            assert!(n > panics, "panic number {n}");
            Ok(n)
        }
    });
    (calls, svc)
}

#[tokio::test(start_paused = true)]
async fn a_panic_is_a_failed_attempt_and_is_retried() {
    let (calls, handler) = panicky(2);
    let svc = RetryLayer::new(exact().max_attempts(3)).layer(handler);
    let start = Instant::now();
    assert_eq!(svc.oneshot(message(1, b"x")).await, Ok(3));
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert_waited(start, Duration::from_millis(100 + 200));
}

#[tokio::test(start_paused = true)]
async fn a_panic_on_every_attempt_goes_up_unchanged_when_the_attempts_run_out() {
    let (calls, handler) = panicky(u32::MAX);
    let svc = RetryLayer::new(exact().max_attempts(4)).layer(handler);
    let join = tokio::spawn(svc.oneshot(message(1, b"x"))).await;
    let panic = join.expect_err("the panic goes up").into_panic();
    assert_eq!(
        crate::panic::message(&*panic),
        "panic number 4",
        "the last attempt's panic"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[tokio::test(start_paused = true)]
async fn a_panic_after_the_lease_was_lost_is_not_retried() {
    let (calls, handler) = panicky(u32::MAX);
    let svc = RetryLayer::new(exact().max_attempts(5)).layer(handler);
    let msg = message(1, b"x");
    msg.metadata.lease_lost.cancel();
    let join = tokio::spawn(svc.oneshot(msg)).await;
    assert!(join.expect_err("the panic goes up").is_panic());
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
