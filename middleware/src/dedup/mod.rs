//! The idempotent receiver: turns at-least-once delivery into effectively-once handling
//! for handlers whose side effects must not repeat.
//!
//! Per record:
//!
//! 1. Compute the record's key ([`ByPosition`] by default: stream, shard, sequence and
//!    sub-sequence number; or any [`KeyFn`], e.g. a business id from the payload).
//! 2. [`reserve`](DedupStore::reserve) it: in progress, expiring after
//!    [`in_progress_ttl`](DedupLayer::in_progress_ttl).
//!    * Already **done** → return [`DedupOutcome::Duplicate`] without calling the handler
//!      (counted as `shardflow.deduplicated`). The checkpoint may pass the record: it was
//!      handled.
//!    * **In progress** elsewhere (another consumer during a lease hand-off, a second
//!      delivery) → wait [`wait_interval`](DedupLayer::wait_interval) and look again,
//!      up to [`max_wait`](DedupLayer::max_wait); still in progress → fail with
//!      [`DedupError::InProgress`], a transient error: the shard stops and the record
//!      is delivered again. It is never skipped.
//! 3. Call the handler.
//! 4. Success → [`commit`](DedupStore::commit): done, kept for
//!    [`done_ttl`](DedupLayer::done_ttl). Failure → [`release`](DedupStore::release)
//!    the key so the next delivery can handle it, and return the handler's error.
//!
//! Limits, stated plainly:
//!
//! * A handler that runs longer than `in_progress_ttl` loses its reservation, and a
//!   second delivery may run it again (logged as a warning when the commit notices).
//!   Set the TTL above your slowest handler including its retries.
//! * A consumer that crashes mid-handler leaves the key in progress until the TTL
//!   expires; deliveries of that key fail (and are retried by the consumer) until then.
//!   A call that is merely dropped (an outer timeout) settles its key in a spawned task
//!   instead: released if the handler had not succeeded, committed if it had.
//! * When the commit itself fails after the handler succeeded, the record is reported
//!   handled (the side effect happened; failing would invite a second run) and the
//!   reservation simply expires. A redelivery after that expiry runs the handler again.
//! * Done keys are forgotten after `done_ttl` (and, in [`MemoryDedupStore`], when the
//!   capacity is reached). Keep `done_ttl` at least as long as the stream's retention.
//!
//! # One store per consumer group
//!
//! A store knows keys, not who handled them. Two consumer groups (or two handlers with
//! different side effects) that share a store — one [`MemoryDedupStore`], one DynamoDB
//! table — would find each other's keys done, and the second group's handler would be
//! skipped as a [`Duplicate`](DedupOutcome::Duplicate) although its side effect never
//! happened. Give each group its own store (its own table), or, when a table must be
//! shared, give each group's layer its own [`namespace`](DedupLayer::namespace):
//!
//! ```
//! # use shardflow_middleware::{DedupLayer, MemoryDedupStore};
//! let shared = MemoryDedupStore::new(100_000);
//! let billing = DedupLayer::new(shared.clone()).namespace("billing");
//! let shipping = DedupLayer::new(shared).namespace("shipping");
//! # let _ = (billing, shipping);
//! ```

mod dynamodb;
mod memory;
mod store;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use shardflow::Message;
use tokio::time::Instant;
use tower::{Layer, Service};
use tracing::Instrument;

pub use dynamodb::DynamoDedupStore;
pub use memory::MemoryDedupStore;
pub use store::{Commit, DedupStore, Reservation, StoreError};

use crate::observe::message_span;
use crate::BoxError;

/// What a deduplicated call returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DedupOutcome<R> {
    /// The handler ran and succeeded; its response.
    Handled(R),
    /// The key was already done: the handler was not called.
    Duplicate,
}

impl<R> DedupOutcome<R> {
    /// The handler's response, if it ran.
    pub fn handled(self) -> Option<R> {
        match self {
            DedupOutcome::Handled(r) => Some(r),
            DedupOutcome::Duplicate => None,
        }
    }

    /// Whether the record was skipped as a duplicate.
    pub fn is_duplicate(&self) -> bool {
        matches!(self, DedupOutcome::Duplicate)
    }
}

/// Why the dedup layer could not decide whether to run the handler. Always transient:
/// the record must be delivered again, never dead-lettered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DedupError {
    /// The store failed before the handler ran.
    #[error("the dedup store is unavailable")]
    Store(#[source] StoreError),
    /// Another caller still held the key after waiting.
    #[error("the record is being handled elsewhere (still in progress after {waited:?})")]
    InProgress {
        /// How long this call waited.
        waited: Duration,
    },
}

impl DedupError {
    /// Always true: the record must come again (never dead-lettered); the name is the
    /// one every error type of the workspace uses for "may succeed later".
    pub fn is_transient(&self) -> bool {
        true
    }
}

/// How a record becomes its dedup key.
///
/// Implemented by [`ByPosition`] and by every `Fn(&Message<T>) -> String`.
pub trait KeyFn<T> {
    /// The key of `message`.
    fn key(&self, message: &Message<T>) -> String;
}

/// The default key: `stream/shard/sequence/sub-sequence`, unique per Kinesis record.
/// It removes duplicates caused by re-delivery; duplicates the producer wrote (two
/// records with the same business id) need a key from the payload instead.
///
/// The key does not name the consumer group: a store shared by several groups needs a
/// [`namespace`](DedupLayer::namespace) per group (see the [module docs](self)).
#[derive(Clone, Copy, Debug, Default)]
pub struct ByPosition;

impl<T> KeyFn<T> for ByPosition {
    fn key(&self, message: &Message<T>) -> String {
        use std::fmt::Write;
        let h = &message.metadata;
        let sequence = h.sequence_number.as_str();
        let mut key = String::with_capacity(h.stream.len() + h.shard_id.len() + sequence.len() + 8);
        key.push_str(&h.stream);
        key.push('/');
        key.push_str(&h.shard_id);
        key.push('/');
        key.push_str(sequence);
        // Writing to a String cannot fail.
        let _ = write!(key, "/{}", h.sub_sequence_number);
        key
    }
}

impl<T, F> KeyFn<T> for F
where
    F: Fn(&Message<T>) -> String,
{
    fn key(&self, message: &Message<T>) -> String {
        self(message)
    }
}

/// The shortest [`DedupLayer::wait_interval`].
const MIN_WAIT_INTERVAL: Duration = Duration::from_millis(1);

#[derive(Clone, Copy, Debug)]
struct Timing {
    in_progress_ttl: Duration,
    done_ttl: Duration,
    wait_interval: Duration,
    max_wait: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            in_progress_ttl: Duration::from_secs(120),
            done_ttl: Duration::from_secs(7 * 24 * 3600),
            wait_interval: Duration::from_millis(200),
            max_wait: Duration::from_secs(5),
        }
    }
}

/// Skips records whose key is already done; see the [module docs](self).
pub struct Dedup<S, St, K = ByPosition> {
    inner: S,
    store: St,
    key: Arc<K>,
    namespace: Option<Arc<str>>,
    timing: Timing,
}

impl<S: Clone, St: Clone, K> Clone for Dedup<S, St, K> {
    fn clone(&self) -> Self {
        Dedup {
            inner: self.inner.clone(),
            store: self.store.clone(),
            key: self.key.clone(),
            namespace: self.namespace.clone(),
            timing: self.timing,
        }
    }
}

impl<S: fmt::Debug, St: fmt::Debug, K> fmt::Debug for Dedup<S, St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dedup")
            .field("inner", &self.inner)
            .field("store", &self.store)
            .field("namespace", &self.namespace)
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}

impl<S, St, K> Dedup<S, St, K> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, St, K, T> Service<Message<T>> for Dedup<S, St, K>
where
    S: Service<Message<T>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    S::Response: Send,
    St: DedupStore + Clone,
    K: KeyFn<T>,
    T: Send + 'static,
{
    type Response = DedupOutcome<S::Response>;
    type Error = BoxError;
    type Future = ResponseFuture<S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, message: Message<T>) -> Self::Future {
        let span = message_span("dedup", &message.metadata);
        let key = namespaced(self.namespace.as_deref(), self.key.key(&message));
        let store = self.store.clone();
        let timing = self.timing;
        // The instance driven to readiness goes into the future; `self` keeps a clone.
        let fresh = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, fresh);
        ResponseFuture {
            future: Box::pin(handle_once(inner, store, key, timing, message).instrument(span)),
        }
    }
}

/// `key` in `namespace`: `namespace/key`.
fn namespaced(namespace: Option<&str>, key: String) -> String {
    match namespace {
        None => key,
        Some(namespace) => {
            let mut full = String::with_capacity(namespace.len() + 1 + key.len());
            full.push_str(namespace);
            full.push('/');
            full.push_str(&key);
            full
        }
    }
}

async fn handle_once<S, St, T>(
    mut inner: S,
    store: St,
    key: String,
    timing: Timing,
    message: Message<T>,
) -> Result<DedupOutcome<S::Response>, BoxError>
where
    S: Service<Message<T>>,
    S::Error: Into<BoxError>,
    St: DedupStore + Clone,
{
    // From the first reserve on, a drop of this future (an outer timeout, a shard that
    // stopped) releases whatever we may hold instead of leaving the key in progress
    // until it expires. Releasing a key we do not hold does nothing.
    let mut held = Settle {
        store,
        key,
        token: store::new_token(),
        on_drop: Some(Finish::Release),
    };
    let mut waited_since: Option<Instant> = None;
    loop {
        let reserved = held
            .store
            .reserve(&held.key, &held.token, timing.in_progress_ttl)
            .await;
        match reserved {
            Err(e) => {
                held.on_drop = None;
                return Err(Box::new(DedupError::Store(e)));
            }
            Ok(Reservation::Reserved) => break,
            Ok(Reservation::Done) => {
                held.on_drop = None;
                tracing::debug!(
                    monotonic_counter.shardflow.deduplicated = 1u64,
                    "already handled; skipped",
                );
                return Ok(DedupOutcome::Duplicate);
            }
            Ok(Reservation::InProgress) => {
                let since = *waited_since.get_or_insert_with(Instant::now);
                let waited = since.elapsed();
                if waited >= timing.max_wait {
                    held.on_drop = None;
                    tracing::debug!(?waited, "still in progress elsewhere; giving up for now");
                    return Err(Box::new(DedupError::InProgress { waited }));
                }
                tokio::time::sleep(timing.wait_interval.min(timing.max_wait - waited)).await;
            }
        }
    }

    // The handler's error becomes a BoxError (Send) before the next await.
    match inner.call(message).await.map_err(Into::into) {
        Ok(response) => {
            // The side effect happened: from here a drop must mark the key done.
            held.on_drop = Some(Finish::Commit(timing.done_ttl));
            let committed = held
                .store
                .commit(&held.key, &held.token, timing.done_ttl)
                .await;
            held.on_drop = None;
            match committed {
                Ok(Commit::Committed) => {}
                Ok(Commit::Overtaken) => tracing::warn!(
                    "the reservation expired before the handler finished; another delivery \
                     may have run it too (raise in_progress_ttl)",
                ),
                Err(error) => tracing::warn!(
                    error = %crate::observe::error_chain(&error),
                    "handled, but marking it done failed; a redelivery after the \
                     reservation expires would run it again",
                ),
            }
            Ok(DedupOutcome::Handled(response))
        }
        Err(error) => {
            let released = held.store.release(&held.key, &held.token).await;
            held.on_drop = None;
            if let Err(release) = released {
                tracing::warn!(
                    error = %crate::observe::error_chain(&release),
                    "could not release the key after a failure; it frees itself when the \
                     reservation expires",
                );
            }
            Err(error)
        }
    }
}

/// A reservation in the making, and what to do with it if its call is dropped before
/// it settled the key itself.
struct Settle<St: DedupStore + Clone> {
    store: St,
    key: String,
    token: String,
    on_drop: Option<Finish>,
}

enum Finish {
    /// The handler has not succeeded: free the key for the next delivery.
    Release,
    /// The handler succeeded: mark the key done for this long.
    Commit(Duration),
}

impl<St: DedupStore + Clone> Drop for Settle<St> {
    fn drop(&mut self) {
        let Some(finish) = self.on_drop.take() else {
            return;
        };
        // Outside a runtime nothing can run the store call: the reservation expires.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::debug!("dropped while holding a dedup key; it frees itself when it expires");
            return;
        };
        let store = self.store.clone();
        let key = std::mem::take(&mut self.key);
        let token = std::mem::take(&mut self.token);
        let settle = async move {
            let result = match finish {
                Finish::Release => store.release(&key, &token).await,
                Finish::Commit(ttl) => store.commit(&key, &token, ttl).await.map(drop),
            };
            if let Err(error) = result {
                tracing::warn!(
                    error = %crate::observe::error_chain(&error),
                    "a dropped call could not settle its dedup key; it frees itself when \
                     the reservation expires",
                );
            }
        };
        runtime.spawn(settle.instrument(tracing::Span::current()));
    }
}

/// Applies [`Dedup`] to services, with a store, a key and timings.
pub struct DedupLayer<St, K = ByPosition> {
    store: St,
    key: Arc<K>,
    namespace: Option<Arc<str>>,
    timing: Timing,
}

impl<St: Clone, K> Clone for DedupLayer<St, K> {
    fn clone(&self) -> Self {
        DedupLayer {
            store: self.store.clone(),
            key: self.key.clone(),
            namespace: self.namespace.clone(),
            timing: self.timing,
        }
    }
}

impl<St: fmt::Debug, K> fmt::Debug for DedupLayer<St, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DedupLayer")
            .field("store", &self.store)
            .field("namespace", &self.namespace)
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}

impl<St> DedupLayer<St, ByPosition> {
    /// Dedups on the record's position, in `store`, with the default timings:
    /// in progress for 2 min, done for 7 days, waiting up to 5 s (every 200 ms) for a
    /// key in progress elsewhere.
    ///
    /// Use a store for this consumer group alone, or set a [`namespace`](Self::namespace).
    pub fn new(store: St) -> Self {
        DedupLayer {
            store,
            key: Arc::new(ByPosition),
            namespace: None,
            timing: Timing::default(),
        }
    }
}

impl<St, K> DedupLayer<St, K> {
    /// Uses another key, e.g. `|m: &Message<Order>| m.payload.order_id.clone()`.
    pub fn key<K2>(self, key: K2) -> DedupLayer<St, K2> {
        DedupLayer {
            store: self.store,
            key: Arc::new(key),
            namespace: self.namespace,
            timing: self.timing,
        }
    }

    /// Prefixes every key with `namespace` and `/`, so that consumer groups (or
    /// handlers with different side effects) can share one store without skipping each
    /// other's records. Use the consumer group's name; without a namespace the store
    /// must serve this group alone (see the [module docs](self)).
    pub fn namespace(mut self, namespace: impl Into<Arc<str>>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// How long a reservation holds a key: longer than the slowest handler, retries
    /// included.
    pub fn in_progress_ttl(mut self, ttl: Duration) -> Self {
        self.timing.in_progress_ttl = ttl;
        self
    }

    /// How long a done key is remembered: at least the stream's retention.
    pub fn done_ttl(mut self, ttl: Duration) -> Self {
        self.timing.done_ttl = ttl;
        self
    }

    /// How often a key in progress elsewhere is looked at again (at least every
    /// millisecond: a shorter interval is read as 1 ms, so a waiting record never
    /// busy-loops on the store).
    pub fn wait_interval(mut self, interval: Duration) -> Self {
        self.timing.wait_interval = interval.max(MIN_WAIT_INTERVAL);
        self
    }

    /// How long to wait for a key in progress elsewhere before failing (transiently).
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.timing.max_wait = wait;
        self
    }
}

impl<S, St: Clone, K> Layer<S> for DedupLayer<St, K> {
    type Service = Dedup<S, St, K>;

    fn layer(&self, inner: S) -> Self::Service {
        Dedup {
            inner,
            store: self.store.clone(),
            key: self.key.clone(),
            namespace: self.namespace.clone(),
            timing: self.timing,
        }
    }
}

/// The response future of [`Dedup`].
pub struct ResponseFuture<R> {
    future: Pin<Box<dyn Future<Output = Result<DedupOutcome<R>, BoxError>> + Send>>,
}

impl<R> Future for ResponseFuture<R> {
    type Output = Result<DedupOutcome<R>, BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.future.as_mut().poll(cx)
    }
}

impl<R> fmt::Debug for ResponseFuture<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;
