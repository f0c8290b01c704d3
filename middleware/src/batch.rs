//! Groups messages for a bulk handler: a `Service<Vec<Message<T>>>` (a database bulk
//! write, a `PutRecords`, an HTTP batch endpoint) behind a single layer that works in
//! both of the consumer's modes.
//!
//! # Batch mode (the usual way): `Service<Batch<T>>`
//!
//! When the consumer hands the service a whole read ([`Batch`]), [`Batching`] re-chunks
//! it: up to [`max_count`](BatchConfig::max_count) messages and
//! [`max_bytes`](BatchConfig::max_bytes) of payload per call, in sequence order, one
//! chunk after the other. Each chunk written is acknowledged through the batch's handle
//! ([`AckHandle::ack_through`](shardflow::AckHandle::ack_through)) before the next is
//! called. The first failing chunk fails the whole read (the later chunks are not
//! called): the consumer delivers the read again from the first record not written, so
//! the chunks that succeeded are not written again (unless the process stops before
//! the checkpoint is stored: at-least-once). Under a [`Bisect`](crate::bisect::Bisect)
//! layer the same acknowledgements tell it which records of a failed piece are already
//! written: it splits and retries only the rest.
//!
//! # Record mode: `Service<Message<T>>`
//!
//! Each call queues its message for a background worker, which collects messages until
//! the batch holds `max_count` messages or `max_bytes` of payload, or
//! [`linger`](BatchConfig::linger) has passed since its first message, and then calls
//! the bulk handler once. Every message's call resolves with its batch's outcome: `Ok`
//! when the bulk call succeeded, [`BatchError::Failed`] (sharing the bulk error) when it
//! did not, and [`BatchError::Unavailable`] (transient) when the bulk handler was not
//! even ready to take it.
//!
//! A bulk call that fails with an error about the records (one the default dead-letter
//! policy, [`PermanentFailures`], would dead-letter) is narrowed down
//! ([`BatchConfig::bisect`], on by default): the batch is split in halves, called again
//! in order, down to single messages, so only a message that fails alone gets
//! [`BatchError::Failed`] (and is dead-lettered by a [`dead_letter`](crate::dead_letter)
//! layer above); the others get `Ok`. A poison record among ten costs about
//! `2·log2(10)` more bulk calls, and its nine neighbours are handled. Transient errors
//! are not narrowed down: every message of the batch gets the error. Record mode needs
//! `T: Clone` for this (each piece is a copy of its messages).
//!
//! The consumer calls a shard's service sequentially by default — it awaits each
//! response before sending the next record — so in record mode a shard's batches only
//! fill when the consumer pipelines calls (or several shards share one service);
//! otherwise each record waits out the linger alone. Prefer batch mode unless you
//! combine records across shards.
//!
//! The worker is started on the first call (it needs a tokio runtime) and is shared by
//! the clones of the service. When the last clone is dropped, messages still queued are
//! flushed before the worker ends, so no call is left without an answer. A bulk handler
//! that panics (in `call` or its future) fails its batch with [`Panicked`], an error
//! about the records: narrowed down like any other, so a record that panics the handler
//! alone is dead-lettered and its neighbours are handled. If the worker dies anyway (the
//! handler's readiness panicked), its pending calls fail with [`BatchError::Closed`]
//! (transient) and the next call starts a new worker.
//!
//! Payload sizes come from the [`Weigh`] trait, implemented for `Bytes`, `Vec<u8>` and
//! `String`; implement it for decoded payload types (returning an estimate, or 0 to
//! batch by count and time only).

use std::error::Error;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use shardflow::{Batch, Message};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::PollSender;
use tower::{Layer, Service, ServiceExt};
use tracing::Instrument;

use crate::dead_letter::{DeadLetterPolicy, PermanentFailures};
use crate::panic::Panicked;
use crate::splits::Splits;
use crate::BoxError;

/// The size of a payload, for [`BatchConfig::max_bytes`].
pub trait Weigh {
    /// The payload's size in bytes (an estimate is fine).
    fn weigh(&self) -> usize;
}

impl Weigh for Bytes {
    fn weigh(&self) -> usize {
        self.len()
    }
}

impl Weigh for Vec<u8> {
    fn weigh(&self) -> usize {
        self.len()
    }
}

impl Weigh for String {
    fn weigh(&self) -> usize {
        self.len()
    }
}

/// The largest record-mode queue: plenty to keep a bulk handler busy, and far below
/// what tokio's channel accepts.
const MAX_QUEUE: usize = 1 << 20;

/// When a batch is full.
#[derive(Clone, Debug)]
pub struct BatchConfig {
    max_count: usize,
    max_bytes: usize,
    linger: Duration,
    queue: Option<usize>,
    splits: Splits,
}

impl Default for BatchConfig {
    /// 500 messages, 5 MiB, 100 ms linger; record mode splits a failing batch down to
    /// single records.
    fn default() -> Self {
        BatchConfig {
            max_count: 500,
            max_bytes: 5 * 1024 * 1024,
            linger: Duration::from_millis(100),
            queue: None,
            splits: Splits::Full,
        }
    }
}

impl BatchConfig {
    /// The defaults: 500 messages, 5 MiB, 100 ms linger.
    pub fn new() -> Self {
        Self::default()
    }

    /// At most this many messages per batch (at least 1).
    pub fn max_count(mut self, count: usize) -> Self {
        self.max_count = count.max(1);
        self
    }

    /// At most this many payload bytes per batch; a single larger message still goes,
    /// alone.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes.max(1);
        self
    }

    /// Record mode: how long a batch waits for more messages after its first one.
    pub fn linger(mut self, linger: Duration) -> Self {
        self.linger = linger;
        self
    }

    /// Record mode: how many messages may wait for the worker before callers are held
    /// back (default: twice `max_count`; at least 1 and at most 2^20, whatever is asked).
    pub fn queue(mut self, capacity: usize) -> Self {
        self.queue = Some(capacity);
        self
    }

    /// Record mode: how far a failing batch is split to find the messages that fail
    /// alone (default [`Splits::Full`]; see the [module docs](self)). Batch mode: put a
    /// [`Bisect`](crate::bisect::Bisect) above this layer instead.
    pub fn bisect(mut self, splits: Splits) -> Self {
        self.splits = splits;
        self
    }

    fn queue_capacity(&self) -> usize {
        // tokio's channel panics on 0 and on capacities near usize::MAX (which
        // `max_count(usize::MAX)`, "no count limit", would ask for).
        self.queue
            .unwrap_or(self.max_count.saturating_mul(2))
            .clamp(1, MAX_QUEUE)
    }
}

/// A batch's failure, as seen by each of its messages.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// The bulk handler failed for the batch this message was in.
    #[error("the batch of {size} messages failed")]
    Failed {
        /// How many messages the batch held.
        size: usize,
        /// The bulk handler's error, shared by every message of the batch.
        #[source]
        source: Arc<dyn Error + Send + Sync>,
    },
    /// The bulk handler's `poll_ready` failed (a closed or overloaded client), so the
    /// batch was never sent. Transient: it says nothing about the records, which are
    /// delivered again rather than dead-lettered.
    #[error("the bulk handler was not ready for a batch of {size} messages")]
    Unavailable {
        /// How many messages the batch held.
        size: usize,
        /// The readiness error, shared by every message of the batch.
        #[source]
        source: Arc<dyn Error + Send + Sync>,
    },
    /// The worker stopped before answering (the bulk handler's readiness panicked, or
    /// the runtime is shutting down). Transient: deliver the record again.
    #[error("the batching worker stopped before answering")]
    Closed,
    /// Record mode was used outside a tokio runtime.
    #[error("record-mode batching needs a tokio runtime to run its worker")]
    NoRuntime,
    /// `call` came without a successful `poll_ready` first (a caller bug; tower's
    /// contract requires it). The message was not queued.
    #[error("called before poll_ready returned Ready(Ok)")]
    NotReady,
}

impl BatchError {
    /// Whether the error says nothing about the record itself (so it should be retried
    /// by redelivery, not dead-lettered).
    pub fn is_transient(&self) -> bool {
        !matches!(self, BatchError::Failed { .. })
    }
}

type Answer = oneshot::Sender<Result<(), BatchError>>;
type Item<T> = (Message<T>, Answer);

/// Hands messages to a bulk service in groups; see the [module docs](self).
pub struct Batching<S, T> {
    inner: S,
    config: Arc<BatchConfig>,
    worker: Arc<Mutex<Option<mpsc::Sender<Item<T>>>>>,
    sender: Option<PollSender<Item<T>>>,
    /// Whether `sender` holds a queue slot reserved by `poll_ready`.
    reserved: bool,
}

impl<S, T> Batching<S, T> {
    /// Batches for `inner` according to `config`.
    pub fn new(inner: S, config: BatchConfig) -> Self {
        Batching {
            inner,
            config: Arc::new(config),
            worker: Arc::new(Mutex::new(None)),
            sender: None,
            reserved: false,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &BatchConfig {
        &self.config
    }
}

impl<S: Clone, T> Clone for Batching<S, T> {
    fn clone(&self) -> Self {
        Batching {
            inner: self.inner.clone(),
            config: self.config.clone(),
            worker: self.worker.clone(),
            // Each handle reserves its own queue slots.
            sender: None,
            reserved: false,
        }
    }
}

impl<S: fmt::Debug, T> fmt::Debug for Batching<S, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batching")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<S, T> Batching<S, T>
where
    S: Service<Vec<Message<T>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    T: Weigh + Clone + Send + 'static,
{
    /// The queue of the running worker, starting one if there is none (or it died).
    fn worker_queue(&self) -> Result<mpsc::Sender<Item<T>>, BatchError> {
        let mut slot = self.worker.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(queue) = slot.as_ref().filter(|q| !q.is_closed()) {
            return Ok(queue.clone());
        }
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| BatchError::NoRuntime)?;
        let (queue, received) = mpsc::channel(self.config.queue_capacity());
        runtime.spawn(run_worker(
            self.inner.clone(),
            received,
            self.config.clone(),
        ));
        *slot = Some(queue.clone());
        Ok(queue)
    }
}

impl<S, T> Service<Message<T>> for Batching<S, T>
where
    S: Service<Vec<Message<T>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    T: Weigh + Clone + Send + 'static,
{
    type Response = ();
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        loop {
            let sender = match self.sender.as_mut() {
                Some(sender) => sender,
                None => {
                    let queue = self.worker_queue()?;
                    self.sender.insert(PollSender::new(queue))
                }
            };
            match ready!(sender.poll_reserve(cx)) {
                Ok(()) => {
                    self.reserved = true;
                    return Poll::Ready(Ok(()));
                }
                // The worker died: start another on the next turn.
                Err(_) => self.sender = None,
            }
        }
    }

    fn call(&mut self, message: Message<T>) -> Self::Future {
        let (answer, response) = oneshot::channel();
        let reserved = std::mem::take(&mut self.reserved);
        match self.sender.as_mut() {
            Some(sender) if reserved => {
                // On failure the item, with `answer`, is dropped: the call resolves to Closed.
                let _ = sender.send_item((message, answer));
            }
            // Without a reserved slot `send_item` would panic: answer with an error instead.
            _ => {
                let _ = answer.send(Err(BatchError::NotReady));
            }
        }
        ResponseFuture { response }
    }
}

impl<S, T> Service<Batch<T>> for Batching<S, T>
where
    S: Service<Vec<Message<T>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    T: Weigh + Send + 'static,
{
    type Response = ();
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut batch: Batch<T>) -> Self::Future {
        let config = self.config.clone();
        // The instance driven to readiness makes the first call; `self` keeps a clone.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        let ack = batch.take_ack();
        Box::pin(async move {
            let chunks = Chunks {
                messages: batch.messages.into_iter().peekable(),
                config: &config,
            };
            let mut first = true;
            for chunk in chunks {
                if !first {
                    inner.ready().await.map_err(Into::into)?;
                }
                first = false;
                let last = chunk.last().map(Message::position);
                call_bulk(&mut inner, chunk).await?;
                // Written: should a later chunk fail, these records are not handed out
                // again (the checkpoint, or a bisecting layer above, may pass them).
                if let (Some(ack), Some(last)) = (&ack, last) {
                    ack.ack_through(last);
                }
            }
            Ok(())
        })
    }
}

/// Splits a read into chunks that respect the count and byte limits, in order.
struct Chunks<'a, I: Iterator> {
    messages: std::iter::Peekable<I>,
    config: &'a BatchConfig,
}

impl<T: Weigh, I: Iterator<Item = Message<T>>> Iterator for Chunks<'_, I> {
    type Item = Vec<Message<T>>;

    fn next(&mut self) -> Option<Self::Item> {
        let first = self.messages.next()?;
        let mut bytes = first.payload.weigh();
        let mut chunk = vec![first];
        while chunk.len() < self.config.max_count {
            let fits = self
                .messages
                .peek()
                .is_some_and(|m| bytes.saturating_add(m.payload.weigh()) <= self.config.max_bytes);
            if !fits {
                break;
            }
            if let Some(message) = self.messages.next() {
                bytes += message.payload.weigh();
                chunk.push(message);
            }
        }
        Some(chunk)
    }
}

/// One bulk call, inside a span naming the shard and the sequence range.
/// Calls the bulk handler on `messages`. A panic in its `call` or its future is an
/// error about these records ([`Panicked`]), narrowed down and dead-lettered like any
/// other, instead of ending the worker (which would fail the records transiently and
/// deliver the same batch to the same panic for ever).
async fn call_bulk<S, T>(inner: &mut S, messages: Vec<Message<T>>) -> Result<S::Response, BoxError>
where
    S: Service<Vec<Message<T>>>,
    S::Error: Into<BoxError>,
{
    let size = messages.len();
    let span = match (messages.first(), messages.last()) {
        (Some(first), Some(last)) => tracing::debug_span!(
            "shardflow_middleware",
            layer = "batch",
            shard = %first.metadata.shard_id,
            first_sequence = %first.metadata.sequence_number,
            last_sequence = %last.metadata.sequence_number,
            size,
        ),
        _ => tracing::Span::none(),
    };
    async move {
        tracing::debug!(
            monotonic_counter.shardflow.batches = 1u64,
            size,
            "calling the bulk handler"
        );
        let panicked = |payload: Box<dyn std::any::Any + Send>| -> BoxError {
            Box::new(Panicked::from_payload(&*payload))
        };
        let call = match catch_unwind(AssertUnwindSafe(|| inner.call(messages))) {
            Ok(call) => call,
            Err(payload) => return Err(panicked(payload)),
        };
        let mut call = std::pin::pin!(call);
        std::future::poll_fn(
            |cx| match catch_unwind(AssertUnwindSafe(|| call.as_mut().poll(cx))) {
                Ok(Poll::Ready(result)) => Poll::Ready(result.map_err(Into::into)),
                Ok(Poll::Pending) => Poll::Pending,
                Err(payload) => Poll::Ready(Err(panicked(payload))),
            },
        )
        .await
    }
    .instrument(span)
    .await
}

async fn run_worker<S, T>(
    mut inner: S,
    mut queue: mpsc::Receiver<Item<T>>,
    config: Arc<BatchConfig>,
) where
    S: Service<Vec<Message<T>>>,
    S::Error: Into<BoxError>,
    T: Weigh + Clone,
{
    let mut carried: Option<Item<T>> = None;
    loop {
        let first = match carried.take() {
            Some(item) => item,
            None => match queue.recv().await {
                Some(item) => item,
                // Every handle is gone and the queue is drained.
                None => return,
            },
        };
        let now = Instant::now();
        // A linger too long for the clock flushes at once rather than overflow.
        let deadline = now.checked_add(config.linger).unwrap_or(now);
        let mut bytes = first.0.payload.weigh();
        let mut batch = vec![first];
        while batch.len() < config.max_count && bytes < config.max_bytes {
            match tokio::time::timeout_at(deadline, queue.recv()).await {
                Ok(Some(item)) => {
                    let weight = item.0.payload.weigh();
                    if bytes.saturating_add(weight) > config.max_bytes {
                        carried = Some(item);
                        break;
                    }
                    bytes += weight;
                    batch.push(item);
                }
                // Closed (flush what we have, then end) or lingered long enough.
                Ok(None) | Err(_) => break,
            }
        }
        if config.splits == Splits::Off || batch.len() == 1 {
            flush(&mut inner, batch).await;
        } else {
            flush_bisecting(&mut inner, batch, config.splits).await;
        }
    }
}

/// Like [`flush`], narrowing a failed batch down: a bulk error about the records (one the
/// default dead-letter policy would dead-letter) splits the batch in halves, called in
/// order, down to the messages that fail alone (or to the split limit); each message
/// gets the outcome of the smallest piece it was in. A first half that succeeds means its
/// failed parent's second half holds the culprit: that half is split at once.
async fn flush_bisecting<S, T>(inner: &mut S, batch: Vec<Item<T>>, splits: Splits)
where
    S: Service<Vec<Message<T>>>,
    S::Error: Into<BoxError>,
    T: Clone,
{
    let (messages, mut answers): (Vec<_>, Vec<_>) = batch
        .into_iter()
        .map(|(message, answer)| (message, Some(answer)))
        .unzip();
    // (start, end, depth, second half, known to fail)
    let mut pieces = vec![(0, messages.len(), 0u32, false, false)];
    while let Some((start, end, depth, second_half, known_failed)) = pieces.pop() {
        let size = end - start;
        let can_split = size > 1 && splits.allows(depth);
        if known_failed && can_split {
            split(&mut pieces, start, end, depth, size);
            continue;
        }
        let result: Result<(), (bool, BoxError)> = match inner.ready().await.map_err(Into::into) {
            Ok(ready) => call_bulk(ready, messages[start..end].to_vec())
                .await
                .map(drop)
                .map_err(|e| (false, e)),
            Err(e) => Err((true, e)),
        };
        let error = match result {
            Ok(()) => {
                if !second_half {
                    if let Some(next) = pieces.last_mut() {
                        if next.3 && next.0 == end && next.2 == depth {
                            next.4 = true;
                        }
                    }
                }
                for answer in answers[start..end].iter_mut().filter_map(Option::take) {
                    let _ = answer.send(Ok(()));
                }
                continue;
            }
            Err(error) => error,
        };
        let (unready, error) = error;
        // About the records if the policy would dead-letter any of them: a piece can
        // mix shards, one of them with its lease lost (not dead-lettered, the new owner
        // handles it), and the others must still be narrowed down, not failed whole.
        let about_records = !unready
            && messages[start..end]
                .iter()
                .any(|m| PermanentFailures.should_dead_letter(&*error, &m.metadata));
        if about_records && can_split {
            split(&mut pieces, start, end, depth, size);
            continue;
        }
        tracing::debug!(size, unready, error = %crate::observe::error_chain(&*error), "bulk handler failed");
        let shared: Arc<dyn Error + Send + Sync> = Arc::from(error);
        for answer in answers[start..end].iter_mut().filter_map(Option::take) {
            let source = shared.clone();
            let _ = answer.send(Err(if unready {
                BatchError::Unavailable { size, source }
            } else {
                BatchError::Failed { size, source }
            }));
        }
    }
}

/// Splits the failed piece `start..end` into halves on the stack, the first on top.
fn split(
    pieces: &mut Vec<(usize, usize, u32, bool, bool)>,
    start: usize,
    end: usize,
    depth: u32,
    size: usize,
) {
    let middle = start + size / 2;
    pieces.push((middle, end, depth + 1, true, false));
    pieces.push((start, middle, depth + 1, false, false));
    tracing::debug!(
        monotonic_counter.shardflow.batches_split = 1u64,
        size,
        "a failed batch is split in two"
    );
}

async fn flush<S, T>(inner: &mut S, batch: Vec<Item<T>>)
where
    S: Service<Vec<Message<T>>>,
    S::Error: Into<BoxError>,
{
    let size = batch.len();
    let (messages, answers): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
    // Errors become BoxError (Send) at once: the worker's future must be Send. A
    // readiness error is the client's state, not the records' fault: keep it apart.
    let result: Result<(), (bool, BoxError)> = match inner.ready().await.map_err(Into::into) {
        Ok(ready) => call_bulk(ready, messages)
            .await
            .map(drop)
            .map_err(|e| (false, e)),
        Err(e) => Err((true, e)),
    };
    match result {
        Ok(()) => {
            for answer in answers {
                // A caller that stopped waiting does not need the answer.
                let _ = answer.send(Ok(()));
            }
        }
        Err((unready, error)) => {
            tracing::debug!(size, unready, error = %crate::observe::error_chain(&*error), "bulk handler failed");
            let shared: Arc<dyn Error + Send + Sync> = Arc::from(error);
            for answer in answers {
                let source = shared.clone();
                let _ = answer.send(Err(if unready {
                    BatchError::Unavailable { size, source }
                } else {
                    BatchError::Failed { size, source }
                }));
            }
        }
    }
}

/// The response future of [`Batching`] in record mode: resolves with the batch's outcome.
#[derive(Debug)]
pub struct ResponseFuture {
    response: oneshot::Receiver<Result<(), BatchError>>,
}

impl Future for ResponseFuture {
    type Output = Result<(), BoxError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        Poll::Ready(match ready!(Pin::new(&mut self.response).poll(cx)) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Box::new(e)),
            Err(_) => Err(Box::new(BatchError::Closed)),
        })
    }
}

/// Applies [`Batching`] to services.
pub struct BatchLayer<T> {
    config: Arc<BatchConfig>,
    _payload: PhantomData<fn() -> T>,
}

impl<T> BatchLayer<T> {
    /// Batches according to `config`.
    pub fn new(config: BatchConfig) -> Self {
        BatchLayer {
            config: Arc::new(config),
            _payload: PhantomData,
        }
    }
}

impl<T> Clone for BatchLayer<T> {
    fn clone(&self) -> Self {
        BatchLayer {
            config: self.config.clone(),
            _payload: PhantomData,
        }
    }
}

impl<T> fmt::Debug for BatchLayer<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchLayer")
            .field("config", &self.config)
            .finish()
    }
}

impl<S, T> Layer<S> for BatchLayer<T> {
    type Service = Batching<S, T>;

    fn layer(&self, inner: S) -> Self::Service {
        Batching {
            inner,
            config: self.config.clone(),
            worker: Arc::new(Mutex::new(None)),
            sender: None,
            reserved: false,
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod properties;
