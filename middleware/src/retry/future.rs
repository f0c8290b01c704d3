//! The response future of [`Retry`](super::Retry): call, and on a retryable error sleep,
//! wait for readiness and call again. A lease lost during the sleep ends it at once
//! with the last error: the shard's new owner handles the record.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use shardflow::Message;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;
use tower::Service;

use super::policy::{Backoff, Classify, ErrorClass};

pin_project! {
    /// The response future of [`Retry`](super::Retry).
    pub struct ResponseFuture<S, T, C>
    where
        S: Service<Message<T>>,
    {
        #[pin]
        state: State<S::Future, S::Error>,
        service: S,
        request: Message<T>,
        policy: Arc<Backoff<C>>,
        // Built at the first failure, so a call that succeeds pays nothing for it.
        schedule: Option<Schedule>,
        attempts: u32,
        span: tracing::Span,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, E> {
        Calling { #[pin] future: F },
        Sleeping {
            #[pin]
            sleep: Sleep,
            #[pin]
            lease_lost: WaitForCancellationFutureOwned,
            // The failed attempt's error: what the call returns if the lease goes.
            error: Option<E>,
        },
        Readying,
    }
}

struct Schedule {
    delays: std::iter::Take<shardflow::backoff::Backoff>,
    deadline: Option<Instant>,
}

impl<S, T, C> ResponseFuture<S, T, C>
where
    S: Service<Message<T>>,
{
    pub(super) fn new(
        first: S::Future,
        service: S,
        request: Message<T>,
        policy: Arc<Backoff<C>>,
        span: tracing::Span,
    ) -> Self {
        ResponseFuture {
            state: State::Calling { future: first },
            service,
            request,
            policy,
            schedule: None,
            attempts: 1,
            span,
        }
    }
}

/// Why no further attempt is made.
enum Stop {
    Permanent,
    LeaseLost,
    Exhausted,
}

impl<S, T, C> Future for ResponseFuture<S, T, C>
where
    S: Service<Message<T>>,
    S::Error: fmt::Display,
    T: Clone,
    C: Classify<S::Error>,
{
    type Output = Result<S::Response, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        loop {
            match this.state.as_mut().project() {
                StateProj::Calling { future } => match ready!(future.poll(cx)) {
                    Ok(response) => {
                        tracing::debug!(
                            monotonic_counter.shardflow.handled = 1u64,
                            attempts = *this.attempts,
                            "handled",
                        );
                        return Poll::Ready(Ok(response));
                    }
                    Err(error) => {
                        let next = next_delay(
                            this.policy,
                            this.schedule,
                            this.request,
                            *this.attempts,
                            &error,
                        );
                        match next {
                            Ok(delay) => {
                                tracing::debug!(
                                    monotonic_counter.shardflow.retried = 1u64,
                                    attempt = *this.attempts,
                                    delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                                    %error,
                                    "attempt failed; retrying",
                                );
                                this.state.set(State::Sleeping {
                                    sleep: tokio::time::sleep(delay),
                                    lease_lost: this
                                        .request
                                        .headers
                                        .lease_lost
                                        .clone()
                                        .cancelled_owned(),
                                    error: Some(error),
                                });
                            }
                            Err(Stop::Permanent) => {
                                tracing::debug!(
                                    attempts = *this.attempts,
                                    %error,
                                    "permanent error; not retrying",
                                );
                                crate::dead_letter::report_attempts(*this.attempts);
                                return Poll::Ready(Err(error));
                            }
                            Err(Stop::LeaseLost) => {
                                tracing::debug!(
                                    attempts = *this.attempts,
                                    %error,
                                    "lease lost; not retrying (the new owner handles the record)",
                                );
                                return Poll::Ready(Err(error));
                            }
                            Err(Stop::Exhausted) => {
                                tracing::debug!(
                                    monotonic_counter.shardflow.retries_exhausted = 1u64,
                                    attempts = *this.attempts,
                                    %error,
                                    "retries exhausted",
                                );
                                crate::dead_letter::report_attempts(*this.attempts);
                                return Poll::Ready(Err(error));
                            }
                        }
                    }
                },
                StateProj::Sleeping {
                    sleep,
                    lease_lost,
                    error,
                } => {
                    if lease_lost.poll(cx).is_ready() {
                        if let Some(error) = error.take() {
                            tracing::debug!(
                                attempts = *this.attempts,
                                %error,
                                "lease lost while waiting to retry; not retrying (the new \
                                 owner handles the record)",
                            );
                            return Poll::Ready(Err(error));
                        }
                    }
                    ready!(sleep.poll(cx));
                    this.state.set(State::Readying);
                }
                StateProj::Readying => {
                    ready!(this.service.poll_ready(cx))?;
                    *this.attempts += 1;
                    let future = this.service.call(this.request.clone());
                    this.state.set(State::Calling { future });
                }
            }
        }
    }
}

/// The wait before the next attempt, or why there is none.
fn next_delay<T, C, E>(
    policy: &Backoff<C>,
    schedule: &mut Option<Schedule>,
    request: &Message<T>,
    attempts: u32,
    error: &E,
) -> Result<Duration, Stop>
where
    C: Classify<E>,
{
    if policy.classify.classify(error) == ErrorClass::Permanent {
        return Err(Stop::Permanent);
    }
    if request.headers.lease_lost.is_cancelled() {
        return Err(Stop::LeaseLost);
    }
    if attempts >= policy.max_attempts {
        return Err(Stop::Exhausted);
    }
    let schedule = schedule.get_or_insert_with(|| Schedule {
        delays: policy.delays(&request.headers),
        deadline: policy
            .max_elapsed
            .and_then(|elapsed| Instant::now().checked_add(elapsed)),
    });
    let delay = schedule.delays.next().ok_or(Stop::Exhausted)?;
    if let Some(deadline) = schedule.deadline {
        match Instant::now().checked_add(delay) {
            Some(start) if start <= deadline => {}
            _ => return Err(Stop::Exhausted),
        }
    }
    Ok(delay)
}
