//! The response future of [`Retry`](super::Retry): call, and on a retryable error sleep,
//! wait for readiness and call again. A lease lost during the sleep or while waiting
//! for readiness ends it at once with the last error: the shard's new owner handles
//! the record.
//!
//! A panic of the inner service in `call` or in its future is a failed attempt like an
//! error, retried while attempts, time and the lease allow (the [`Classify`] policy
//! sees only errors, so a panic counts as transient); when no attempt is left the
//! panic is resumed as it was, for the layer above (the dead-letter layer turns it into
//! an error) or the consumer. A panic in `poll_ready` is not caught: the service is
//! then in an unknown state and is not called again; the panic goes up at once (out of
//! `Retry::poll_ready` to whoever polls it; out of the readiness wait between attempts
//! to the layer above, as a panic of this future).

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use shardflow::Message;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;
use tower::Service;

use super::policy::{Classify, ErrorClass, RetryPolicy};

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
        policy: Arc<RetryPolicy<C>>,
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
        // The inner service panicked in `call`: a failed attempt with no future.
        CallPanicked { panic: Option<Panic> },
        Sleeping {
            #[pin]
            sleep: Sleep,
            #[pin]
            lease_lost: WaitForCancellationFutureOwned,
            // The failed attempt's failure: what the call ends with if the lease goes.
            failure: Option<Failure<E>>,
        },
        // Waiting for the service to be ready for the next attempt: a lease lost now
        // ends the call with the last failure as well, before any further call.
        Readying {
            #[pin]
            lease_lost: WaitForCancellationFutureOwned,
            failure: Option<Failure<E>>,
        },
    }
}

/// A caught panic's payload.
type Panic = Box<dyn Any + Send>;

/// How an attempt failed: an error of the inner service, or a panic in its `call` or
/// its future.
enum Failure<E> {
    Error(E),
    Panic(Panic),
}

impl<E> Failure<E> {
    /// The call's end with this failure: the error, or the panic resumed so that the
    /// layer above (the dead-letter layer, or the consumer) sees it as it was.
    fn end<R>(self) -> Poll<Result<R, E>> {
        match self {
            Failure::Error(error) => Poll::Ready(Err(error)),
            Failure::Panic(panic) => resume_unwind(panic),
        }
    }
}

impl<E: fmt::Display> fmt::Display for Failure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Error(error) => error.fmt(f),
            Failure::Panic(panic) => write!(f, "panicked: {}", crate::panic::message(&**panic)),
        }
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
    /// `first` is the first call's future, or the panic of that call.
    pub(super) fn new(
        first: Result<S::Future, Panic>,
        service: S,
        request: Message<T>,
        policy: Arc<RetryPolicy<C>>,
        span: tracing::Span,
    ) -> Self {
        let state = match first {
            Ok(future) => State::Calling { future },
            Err(panic) => State::CallPanicked { panic: Some(panic) },
        };
        ResponseFuture {
            state,
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
            let failure = match this.state.as_mut().project() {
                StateProj::Calling { future } => {
                    // A panic is a failed attempt; the future is not polled again.
                    match catch_unwind(AssertUnwindSafe(|| future.poll(cx))) {
                        Ok(Poll::Pending) => return Poll::Pending,
                        Ok(Poll::Ready(Ok(response))) => {
                            tracing::debug!(
                                monotonic_counter.shardflow.handled = 1u64,
                                attempts = *this.attempts,
                                "handled",
                            );
                            return Poll::Ready(Ok(response));
                        }
                        Ok(Poll::Ready(Err(error))) => Failure::Error(error),
                        Err(panic) => Failure::Panic(panic),
                    }
                }
                StateProj::CallPanicked { panic } => match panic.take() {
                    Some(panic) => Failure::Panic(panic),
                    // Only reachable if polled after completion.
                    None => return Poll::Pending,
                },
                StateProj::Sleeping {
                    sleep,
                    lease_lost,
                    failure,
                } => {
                    if lease_lost.poll(cx).is_ready() {
                        if let Some(failure) = failure.take() {
                            tracing::debug!(
                                attempts = *this.attempts,
                                error = %failure,
                                "lease lost while waiting to retry; not retrying (the new \
                                 owner handles the record)",
                            );
                            return failure.end();
                        }
                    }
                    ready!(sleep.poll(cx));
                    let failure = failure.take();
                    this.state.set(State::Readying {
                        lease_lost: this.request.metadata.lease_lost.clone().cancelled_owned(),
                        failure,
                    });
                    continue;
                }
                StateProj::Readying {
                    lease_lost,
                    failure,
                } => {
                    // The lease is looked at before and after readiness: a service that
                    // became ready because the shard is being given up (or at the same
                    // moment) must not be called again.
                    let lost = lease_lost.poll(cx).is_ready();
                    if !lost {
                        ready!(this.service.poll_ready(cx))?;
                    }
                    if lost || this.request.metadata.lease_lost.is_cancelled() {
                        if let Some(failure) = failure.take() {
                            tracing::debug!(
                                attempts = *this.attempts,
                                error = %failure,
                                "lease lost while waiting for the service to be ready; not \
                                 retrying (the new owner handles the record)",
                            );
                            return failure.end();
                        }
                    }
                    *this.attempts += 1;
                    let request = this.request.clone();
                    let service = &mut *this.service;
                    match catch_unwind(AssertUnwindSafe(|| service.call(request))) {
                        Ok(future) => this.state.set(State::Calling { future }),
                        Err(panic) => this.state.set(State::CallPanicked { panic: Some(panic) }),
                    }
                    continue;
                }
            };
            let next = match &failure {
                Failure::Error(error) => next_delay(
                    this.policy,
                    this.schedule,
                    this.request,
                    *this.attempts,
                    Some(error),
                ),
                // A panic is transient to the policy: only attempts, time and the lease
                // limit its retries.
                Failure::Panic(_) => next_delay(
                    this.policy,
                    this.schedule,
                    this.request,
                    *this.attempts,
                    None,
                ),
            };
            match next {
                Ok(delay) => {
                    tracing::debug!(
                        monotonic_counter.shardflow.retried = 1u64,
                        attempt = *this.attempts,
                        delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
                        error = %failure,
                        "attempt failed; retrying",
                    );
                    this.state.set(State::Sleeping {
                        sleep: tokio::time::sleep(delay),
                        lease_lost: this.request.metadata.lease_lost.clone().cancelled_owned(),
                        failure: Some(failure),
                    });
                }
                Err(Stop::Permanent) => {
                    tracing::debug!(
                        attempts = *this.attempts,
                        error = %failure,
                        "permanent error; not retrying",
                    );
                    crate::dead_letter::report_attempts(*this.attempts);
                    return failure.end();
                }
                Err(Stop::LeaseLost) => {
                    tracing::debug!(
                        attempts = *this.attempts,
                        error = %failure,
                        "lease lost; not retrying (the new owner handles the record)",
                    );
                    return failure.end();
                }
                Err(Stop::Exhausted) => {
                    tracing::debug!(
                        monotonic_counter.shardflow.retries_exhausted = 1u64,
                        attempts = *this.attempts,
                        error = %failure,
                        "retries exhausted",
                    );
                    crate::dead_letter::report_attempts(*this.attempts);
                    return failure.end();
                }
            }
        }
    }
}

/// The wait before the next attempt, or why there is none.
fn next_delay<T, C, E>(
    policy: &RetryPolicy<C>,
    schedule: &mut Option<Schedule>,
    request: &Message<T>,
    attempts: u32,
    error: Option<&E>,
) -> Result<Duration, Stop>
where
    C: Classify<E>,
{
    if error.is_some_and(|error| policy.classify.classify(error) == ErrorClass::Permanent) {
        return Err(Stop::Permanent);
    }
    if request.metadata.lease_lost.is_cancelled() {
        return Err(Stop::LeaseLost);
    }
    if attempts >= policy.max_attempts {
        return Err(Stop::Exhausted);
    }
    let schedule = schedule.get_or_insert_with(|| Schedule {
        delays: policy.delays(&request.metadata),
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
