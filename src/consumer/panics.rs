//! User code is supervised: a panic in the user's service (its `poll_ready`, its `call`
//! or the future it returns) becomes an error of the call, handled like any other
//! (the shard's unfinished work is given up and delivered again from the checkpoint,
//! `HandlerFailed` is sent, health and metrics count it), and the text of a panic is
//! recovered for those reports.
//!
//! Panics are caught where they happen, with `catch_unwind` on the dispatch task, rather
//! than by spawning each call as a task of its own and looking at `JoinError::is_panic`:
//! a spawn per record would cost an allocation and a trip through the scheduler per
//! call (the per-record overhead is a promise), would require `'static` futures, and
//! would move calls off the task that keeps a shard's records in order.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::CatchUnwind;
use futures_util::FutureExt;

/// The text of a panic's payload: the message of `panic!("...")` (a `&str` or a
/// `String`), else `"panic"`.
pub(crate) fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic".to_owned()
    }
}

/// Why a call of a supervised service failed: its own error, or a panic.
#[derive(Debug)]
pub(crate) enum HandlerError<E> {
    /// The service returned an error.
    Failed(E),
    /// The service panicked (in `poll_ready`, `call` or its future), with the message.
    Panicked(String),
}

impl<E: fmt::Display> fmt::Display for HandlerError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerError::Failed(e) => e.fmt(f),
            HandlerError::Panicked(message) => write!(f, "the handler panicked: {message}"),
        }
    }
}

/// Wraps the user's service so that a panic is an error of the call (see the module
/// docs). After a panic the instance is not used again: the next call goes to a fresh
/// clone of the service the wrapper was built with, as a restarted shard would get.
#[derive(Clone)]
pub(crate) struct CatchPanic<S> {
    inner: S,
    pristine: S,
    /// Set when a call's future panicked: the instance is replaced before its next use.
    poisoned: Arc<AtomicBool>,
    /// A panic of `poll_ready`, reported as the error of the call that follows, so the
    /// call's metrics count it like any failed call.
    pending: Option<String>,
}

impl<S: Clone> CatchPanic<S> {
    pub(crate) fn new(service: S) -> Self {
        CatchPanic {
            inner: service.clone(),
            pristine: service,
            poisoned: Arc::new(AtomicBool::new(false)),
            pending: None,
        }
    }

    fn renew_if_poisoned(&mut self) {
        if self.poisoned.swap(false, Ordering::SeqCst) {
            self.inner = self.pristine.clone();
        }
    }
}

impl<S, R> tower::Service<R> for CatchPanic<S>
where
    S: tower::Service<R> + Clone,
{
    type Response = S::Response;
    type Error = HandlerError<S::Error>;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        if self.pending.is_some() {
            return Poll::Ready(Ok(()));
        }
        self.renew_if_poisoned();
        let inner = &mut self.inner;
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.poll_ready(cx))) {
            Ok(ready) => ready.map_err(HandlerError::Failed),
            Err(payload) => {
                self.inner = self.pristine.clone();
                self.pending = Some(panic_message(payload.as_ref()));
                Poll::Ready(Ok(()))
            }
        }
    }

    fn call(&mut self, request: R) -> Self::Future {
        if let Some(message) = self.pending.take() {
            return ResponseFuture::failed(message);
        }
        let inner = &mut self.inner;
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.call(request))) {
            Ok(future) => ResponseFuture {
                state: State::Running {
                    future: AssertUnwindSafe(future).catch_unwind(),
                    poisoned: self.poisoned.clone(),
                },
            },
            Err(payload) => {
                self.inner = self.pristine.clone();
                ResponseFuture::failed(panic_message(payload.as_ref()))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of a [`CatchPanic`] call.
    pub(crate) struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<F> {
        Running {
            #[pin]
            future: CatchUnwind<AssertUnwindSafe<F>>,
            poisoned: Arc<AtomicBool>,
        },
        Failed {
            message: String,
        },
    }
}

impl<F> ResponseFuture<F> {
    fn failed(message: String) -> Self {
        ResponseFuture {
            state: State::Failed { message },
        }
    }
}

impl<F, T, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, E>>,
{
    type Output = Result<T, HandlerError<E>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Running { future, poisoned } => {
                Poll::Ready(match std::task::ready!(future.poll(cx)) {
                    Ok(result) => result.map_err(HandlerError::Failed),
                    Err(payload) => {
                        poisoned.store(true, Ordering::SeqCst);
                        Err(HandlerError::Panicked(panic_message(payload.as_ref())))
                    }
                })
            }
            StateProj::Failed { message } => {
                Poll::Ready(Err(HandlerError::Panicked(std::mem::take(message))))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Service, ServiceExt};

    #[tokio::test]
    async fn a_panic_anywhere_in_a_call_is_its_error_and_the_next_call_works() {
        let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = calls.clone();
        let service = tower::service_fn(move |n: u32| {
            counted.fetch_add(1, Ordering::SeqCst);
            if n == 1 {
                panic!("in call {n}");
            }
            async move {
                if n == 2 {
                    panic!("in the future");
                }
                Ok::<_, std::convert::Infallible>(n)
            }
        });
        let mut caught = CatchPanic::new(service);
        let first = caught.ready().await.unwrap().call(1).await;
        assert_eq!(
            first.unwrap_err().to_string(),
            "the handler panicked: in call 1"
        );
        let second = caught.ready().await.unwrap().call(2).await;
        assert_eq!(
            second.unwrap_err().to_string(),
            "the handler panicked: in the future"
        );
        assert_eq!(caught.ready().await.unwrap().call(3).await.unwrap(), 3);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn the_message_of_any_payload() {
        assert_eq!(panic_message(&"text"), "text");
        assert_eq!(panic_message(&String::from("owned")), "owned");
        assert_eq!(panic_message(&42u8), "panic");
    }
}
