//! The dead-letter call's [`ResponseFuture`], and the slot through which the retry
//! layer below reports its attempts.

use std::cell::Cell;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use pin_project_lite::pin_project;
use shardflow::{Headers, Metadata};
use tower::util::Oneshot;
use tower::{Service, ServiceExt};

use crate::observe::error_chain;
use crate::panic::Panicked;
use crate::BoxError;

use super::{
    DeadLetterError, DeadLetterOutcome, DeadLetterPolicy, DeadLetterRecord, Reason, SinkTimedOut,
};

thread_local! {
    /// Where the retry layer below reports its attempts for the call the dead-letter
    /// layer is polling on this thread: `Some` only while the dead-letter layer polls
    /// its inner future (see [`with_attempts_slot`]), so a report from anywhere else is
    /// dropped. No allocation per record: the count lives in the dead-letter future.
    static ATTEMPTS: Cell<Option<u32>> = const { Cell::new(None) };
}

/// Called by the retry layer when it gives a record up after `attempts` calls: the
/// dead-letter layer above, if any, puts it in the dead letter.
pub(crate) fn report_attempts(attempts: u32) {
    ATTEMPTS.with(|slot| {
        if slot.get().is_some() {
            slot.set(Some(attempts));
        }
    });
}

/// Polls `poll` with `attempts` (0 = none reported yet) as this thread's attempts slot,
/// and keeps what the retry layer reported meanwhile. The slot is restored even if
/// `poll` panics.
fn with_attempts_slot<T>(attempts: &mut u32, poll: impl FnOnce() -> T) -> T {
    struct Restore<'a> {
        attempts: &'a mut u32,
        previous: Option<u32>,
    }
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            *self.attempts = ATTEMPTS
                .with(|slot| slot.replace(self.previous))
                .unwrap_or(0);
        }
    }
    let previous = ATTEMPTS.with(|slot| slot.replace(Some(*attempts)));
    let _restore = Restore { attempts, previous };
    poll()
}

pin_project! {
    /// The response future of [`DeadLetter`](super::DeadLetter).
    pub struct ResponseFuture<F, K, P>
    where
        K: Service<DeadLetterRecord>,
    {
        #[pin]
        state: State<F, K>,
        copy: Option<(Metadata, Headers, Bytes)>,
        // What a retry layer below reported (0: nothing).
        attempts: u32,
        sink: K,
        policy: P,
        sink_timeout: Duration,
        span: tracing::Span,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, K>
    where
        K: Service<DeadLetterRecord>,
    {
        Handling { #[pin] future: F },
        // The inner service panicked in `call`: there is no future to poll.
        CallPanicked { panic: Option<Panicked> },
        // Boxed: the rare path should not make every record's future larger.
        Sinking {
            future: Pin<Box<tokio::time::Timeout<Oneshot<K, DeadLetterRecord>>>>,
            position: shardflow::Position,
            original: String,
            stream: std::sync::Arc<str>,
        },
    }
}

impl<F, K, P> ResponseFuture<F, K, P>
where
    K: Service<DeadLetterRecord>,
{
    /// The future of a record the inner service was called with: `called` is the
    /// inner future, or the panic of the inner `call`; `copy` what a dead letter keeps.
    pub(super) fn new(
        called: std::thread::Result<F>,
        copy: (Metadata, Headers, Bytes),
        sink: K,
        policy: P,
        sink_timeout: Duration,
        span: tracing::Span,
    ) -> Self {
        let state = match called {
            Ok(future) => State::Handling { future },
            Err(payload) => State::CallPanicked {
                panic: Some(Panicked::from_payload(&*payload)),
            },
        };
        ResponseFuture {
            state,
            sink_timeout,
            copy: Some(copy),
            attempts: 0,
            sink,
            policy,
            span,
        }
    }
}

impl<F, R, E, K, P> Future for ResponseFuture<F, K, P>
where
    F: Future<Output = Result<R, E>>,
    E: Into<BoxError>,
    K: Service<DeadLetterRecord> + Clone,
    K::Error: Into<BoxError>,
    P: DeadLetterPolicy,
{
    type Output = Result<DeadLetterOutcome<R>, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        loop {
            match this.state.as_mut().project() {
                state @ (StateProj::Handling { .. } | StateProj::CallPanicked { .. }) => {
                    let error: BoxError = match state {
                        StateProj::Handling { future } => {
                            // A panic of the inner future is an error (module docs); the
                            // future is not polled again.
                            let polled = catch_unwind(AssertUnwindSafe(|| {
                                with_attempts_slot(this.attempts, || future.poll(cx))
                            }));
                            match polled {
                                Ok(Poll::Pending) => return Poll::Pending,
                                Ok(Poll::Ready(Ok(response))) => {
                                    return Poll::Ready(Ok(DeadLetterOutcome::Handled(response)))
                                }
                                Ok(Poll::Ready(Err(e))) => e.into(),
                                Err(payload) => Box::new(Panicked::from_payload(&*payload)),
                            }
                        }
                        StateProj::CallPanicked { panic } => match panic.take() {
                            Some(panic) => Box::new(panic),
                            None => return Poll::Pending,
                        },
                        // Not reachable: the outer arm matched one of the two above.
                        _ => return Poll::Pending,
                    };
                    let Some((metadata, headers, payload)) = this.copy.take() else {
                        // Only reachable if polled after completion.
                        return Poll::Ready(Err(error));
                    };
                    if !this.policy.should_dead_letter(&*error, &metadata) {
                        return Poll::Ready(Err(error));
                    }
                    let text = error_chain(&*error);
                    let position = metadata.position();
                    let stream = metadata.stream.clone();
                    let record = DeadLetterRecord {
                        metadata,
                        payload,
                        error: text.clone(),
                        attempts: (*this.attempts > 0).then_some(*this.attempts),
                        headers,
                    };
                    this.state.set(State::Sinking {
                        future: Box::pin(tokio::time::timeout(
                            *this.sink_timeout,
                            this.sink.clone().oneshot(record),
                        )),
                        position,
                        original: text,
                        stream,
                    });
                }
                StateProj::Sinking {
                    future,
                    position,
                    original,
                    stream,
                } => {
                    let answer = match ready!(future.as_mut().poll(cx)) {
                        Ok(answer) => answer.map_err(Into::into),
                        Err(_elapsed) => Err(Box::new(SinkTimedOut {
                            after: *this.sink_timeout,
                        }) as BoxError),
                    };
                    return Poll::Ready(match answer {
                        Ok(_) => {
                            tracing::warn!(error = %original, "record dead-lettered");
                            // Record mode: each record is handled alone (a retry
                            // layer below counts `retries_exhausted` itself).
                            tracing::debug!(
                                monotonic_counter.shardflow.dead_lettered = 1u64,
                                reason = Reason::FailedAlone.as_str(),
                                "dead-lettered",
                            );
                            crate::metrics::dead_lettered(stream, Reason::FailedAlone.as_str());
                            Ok(DeadLetterOutcome::DeadLettered)
                        }
                        Err(e) => Err(Box::new(DeadLetterError {
                            position: position.clone(),
                            original: std::mem::take(original),
                            sink: e,
                        })),
                    });
                }
            }
        }
    }
}
