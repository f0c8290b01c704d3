//! Retries a failed record in place, with exponential backoff and jitter, before its
//! error goes up the stack (usually to [`dead_letter`](crate::dead_letter)).
//!
//! Retries happen per record: the request is cloned before each call (so the payload
//! type must be `Clone`; `Bytes` and most decoded types are cheap to clone), and the
//! shard waits while its record is retried, which keeps per-shard order.
//!
//! A retry is scheduled only when the [`Classify`] policy calls the error
//! [`Transient`](ErrorClass::Transient), the [`RetryPolicy`]'s attempts and elapsed time allow
//! it, and the shard's lease is still held (once `lease_lost` fires, the new owner will
//! handle the record: the error goes up at once, even in the middle of a backoff wait).
//!
//! A handler that panics (in `call` or its future) fails its attempt as an error would;
//! a panic is always retryable to the policy, and when the attempts run out it goes up
//! unchanged, for the [`dead_letter`](crate::dead_letter) layer to dead-letter it with
//! its message (or for the consumer to treat it as a failure).
//!
//! Put it below [`dedup`](crate::dedup) so a retry re-runs only the handler.

mod future;
mod policy;

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::task::{Context, Poll};

use shardflow::Message;
use tower::{Layer, Service};

pub use future::ResponseFuture;
pub use policy::{Classify, ErrorClass, RetryAll, RetryPolicy};

use crate::observe::message_span;

/// Retries failed calls of the inner service according to a [`RetryPolicy`].
///
/// Its error is the inner service's last error, unchanged.
pub struct Retry<S, C = RetryAll> {
    inner: S,
    policy: Arc<RetryPolicy<C>>,
}

impl<S, C> Retry<S, C> {
    /// Wraps `inner` with `policy`.
    pub fn new(inner: S, policy: RetryPolicy<C>) -> Self {
        Retry {
            inner,
            policy: Arc::new(policy),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy<C> {
        &self.policy
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, C> Clone for Retry<S, C> {
    fn clone(&self) -> Self {
        Retry {
            inner: self.inner.clone(),
            policy: self.policy.clone(),
        }
    }
}

impl<S: fmt::Debug, C: fmt::Debug> fmt::Debug for Retry<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retry")
            .field("inner", &self.inner)
            .field("policy", &self.policy)
            .finish()
    }
}

impl<S, T, C> Service<Message<T>> for Retry<S, C>
where
    S: Service<Message<T>> + Clone,
    S::Error: fmt::Display,
    T: Clone,
    C: Classify<S::Error>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = ResponseFuture<S, T, C>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, message: Message<T>) -> Self::Future {
        let span = message_span("retry", &message.metadata);
        // The copy for a second attempt: the first one consumes `message`.
        let retained = message.clone();
        // The service that was driven to readiness makes the first call and moves into
        // the future for the retries; `self` keeps a fresh clone.
        let fresh = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, fresh);
        // A panic in `call` is a failed attempt (see the future's docs): the future
        // starts with it, and the same service is made ready again before a retry.
        let first = {
            let _entered = span.enter();
            catch_unwind(AssertUnwindSafe(|| ready.call(message)))
        };
        ResponseFuture::new(first, ready, retained, self.policy.clone(), span)
    }
}

/// Applies [`Retry`] to services.
#[derive(Clone, Debug)]
pub struct RetryLayer<C = RetryAll> {
    policy: Arc<RetryPolicy<C>>,
}

impl<C> RetryLayer<C> {
    /// Retries with `policy`.
    pub fn new(policy: RetryPolicy<C>) -> Self {
        RetryLayer {
            policy: Arc::new(policy),
        }
    }
}

impl<S, C> Layer<S> for RetryLayer<C> {
    type Service = Retry<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        Retry {
            inner,
            policy: self.policy.clone(),
        }
    }
}

#[cfg(test)]
mod tests;
