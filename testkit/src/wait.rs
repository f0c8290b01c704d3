//! Bounded waits: a test that waits fails with a message naming the wait instead of hanging.

use std::time::Duration;

/// How long one wait marked [`Limited::limited`] may take (virtual time under a paused
/// clock) before the test fails.
pub const WAIT_LIMIT: Duration = Duration::from_secs(120);

/// `.limited()` on anything awaitable: the wait fails the test after [`WAIT_LIMIT`],
/// naming the line it was written on, instead of hanging it.
pub trait Limited: std::future::IntoFuture + Sized {
    /// The wait, failing the test after [`WAIT_LIMIT`].
    #[track_caller]
    fn limited(self) -> impl std::future::Future<Output = Self::Output> {
        let at = std::panic::Location::caller();
        let fut = self.into_future();
        async move {
            match tokio::time::timeout(WAIT_LIMIT, fut).await {
                Ok(out) => out,
                Err(_) => panic!("the wait at {at} was not done within {WAIT_LIMIT:?}"),
            }
        }
    }
}

impl<F: std::future::IntoFuture> Limited for F {}

/// Awaits `fut`, panicking with `what` if it is not done within `limit`: a test that
/// waits fails with a message instead of hanging.
pub async fn within<F: std::future::Future>(limit: Duration, what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(out) => out,
        Err(_) => panic!("{what}: not done within {limit:?}"),
    }
}
