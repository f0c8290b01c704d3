//! Keeps a poison record from holding its shard in batch mode: a failing [`Batch`] is
//! split in halves, recursively, down to the records that fail alone, which go to a
//! dead-letter sink; everything else is handled and the shard moves on.
//!
//! [`Bisect`] wraps the `Service<Batch>` that `Consumer::run_batches` takes (the bulk
//! writer: a database insert of 500 rows) and works inside one call of it:
//!
//! 1. The whole batch goes to the inner service. `Ok`: done.
//! 2. An error the [`DeadLetterPolicy`] accepts (the default, [`PermanentFailures`],
//!    accepts all but transient ones) is about the records: the failed piece is split in
//!    two and the halves are called in order, each narrowed down the same way. When a
//!    first half succeeds, its failed parent's second half must hold the culprit: it is
//!    split at once rather than called whole (one call saved per level).
//! 3. A record that fails alone (or is the one record of a failed piece that the inner
//!    service did not acknowledge: see below) goes to the sink as a
//!    [`DeadLetterRecord`] (reason `failed_alone`), the same record the [`dead_letter`](crate::dead_letter) layer
//!    sends, so a [`ProducerSink`](crate::ProducerSink) writes the same
//!    [`DeadLetterEnvelope`](crate::DeadLetterEnvelope) and `shardflow dlq replay`
//!    reads both modes alike.
//! 4. A transient error (the policy refuses it: a store that is down, a lost lease) says
//!    nothing about the records: the call fails and the consumer delivers the batch
//!    again from its checkpoint, as without this layer. Nothing is dead-lettered.
//!
//! The call returns `Ok` only when every record of the batch was handled or accepted by
//! the sink. Whenever a piece succeeds or a record is dead-lettered, the handled prefix
//! is acknowledged through the batch's handle ([`AckHandle::ack_through`]), so when the
//! call fails (a transient error, a sink that is down) the checkpoint can pass what was
//! finished before the failing piece, never a record after it; the redelivery starts at
//! the first record that was neither handled nor dead-lettered.
//!
//! ```no_run
//! use std::time::Duration;
//! use shardflow::{Batch, Consumer};
//! use shardflow_middleware::bisect::{BisectConfig, BisectLayer};
//! use shardflow_middleware::ProducerSink;
//! use tower::ServiceBuilder;
//!
//! # async fn insert_rows(_: &[shardflow::Message]) -> Result<(), std::io::Error> { Ok(()) }
//! # async fn demo(consumer: Consumer, producer: shardflow::producer::Producer)
//! #     -> Result<(), Box<dyn std::error::Error>> {
//! let config = BisectConfig::new()
//!     .max_attempts(5)
//!     .max_record_age(Duration::from_secs(3600));
//! let handler = ServiceBuilder::new()
//!     .layer(BisectLayer::with_config(ProducerSink::new(producer.for_stream("orders-dlq")?), config)?)
//!     .service_fn(|batch: Batch| async move { insert_rows(&batch.messages).await });
//! consumer.run_batches(handler).await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Why inside one call
//!
//! The checkpoint is the contiguous low-watermark of acknowledged batches. Bisecting by
//! redelivery (fail, read again, try half) would need the consumer to remember how to
//! cut its next reads; inside one call the consumer sees one batch and one verdict, and
//! the layer works with any `Service<Batch>` — including [`Batching`](crate::Batching),
//! which re-chunks each piece for its bulk handler and reports the chunks it wrote.
//!
//! # The pieces the inner service receives
//!
//! Each call gets a real [`Batch`] (same stream, shard and `millis_behind_latest`) with
//! an acknowledgement handle of its own ([`Batch::with_ack`], [`AckLog::handle`]); the
//! layer holds the read's handle (it takes it out of the batch it is given). What the
//! inner service acknowledges through the piece's handle is done even when it then
//! fails: [`Batching`](crate::Batching) acknowledges each chunk it wrote, so when a
//! later chunk fails, the layer acknowledges the written records through the read's
//! handle and splits, retries or dead-letters only the rest of the piece — no record is
//! handled twice in one delivery. A piece acknowledged whole (`ack`) counts as handled
//! whatever the result; after a `nack` nothing more counts, and the result alone decides
//! the rest. A piece is a copy of its records (the batch is kept to split it again), so
//! each call costs a clone of the piece's messages (an `Arc` and a partition key each).
//! With [`Splits::Off`] and no limits, the layer passes the batch through untouched,
//! handle and all.
//!
//! # Limits: attempts and age
//!
//! * [`max_attempts`](BisectConfig::max_attempts) (off by default: retry for ever, as
//!   Lambda's `MaximumRetryAttempts = -1`): a piece that cannot be narrowed down — its
//!   error is transient, or [`Splits::AtMost`] stops the splitting — fails the call, and
//!   the consumer delivers it again. The layer counts, per shard and record, in how many
//!   deliveries such a failing piece held the record; at the limit the record goes to
//!   the sink instead (reason `attempts_exhausted`) and the shard moves on. Reads differ
//!   in size, so the failing pieces of those deliveries may too: only the records that
//!   reached the limit go to the sink; the rest failed fewer times and are delivered
//!   again with their count kept, also past the end of a shorter read.
//! * [`max_record_age`](BisectConfig::max_record_age) (off by default): when a piece
//!   fails, the records at its head that arrived (`approximate_arrival`) longer ago than
//!   the limit go to the sink (reason `too_old`) instead of being retried or delivered
//!   again. The rest of the piece never failed without them, so it is called again as it
//!   is (after an error about the records) and judged by its own result: a record is
//!   dead-lettered only when it is itself too old, failed alone, or used up its own
//!   attempts — never for a neighbour's failure. Age is measured on tokio's clock from
//!   the layer's creation (wall time then, plus tokio's elapsed time), so tests can
//!   pause it.
//!
//! Both need a sink, which the layer always has: a record is never dropped. A sink that
//! fails or does not answer within [`sink_timeout`](BisectConfig::sink_timeout) fails the
//! call with a [`DeadLetterError`]: the record is delivered again, nothing is lost.
//!
//! # A panic
//!
//! A panic of the inner service (in `call` or its future) is an error about the records
//! of the piece ([`Panicked`]): a record that panics the handler is dead-lettered like
//! one that makes it fail.
//!
//! # `stream()` mode
//!
//! With `Consumer::stream` the application acknowledges; this layer does not apply. The
//! same is done by hand with the batch's handle: on a failure, handle halves of
//! `batch.messages`, call [`AckHandle::ack_through`] with the last position of each
//! finished half, send records that fail alone to a dead-letter sink, and `ack` at the
//! end (or wrap the handling in a `Bisect` and call it with a [`Batch::new`] copy).
//!
//! # Metrics
//!
//! `shardflow.batches_split` (a failed piece was split in two) and
//! `shardflow.dead_lettered` with the field `reason` (`failed_alone`, `too_old`,
//! `attempts_exhausted`), as `debug` events (see the crate's metric conventions).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use pin_project_lite::pin_project;
use shardflow::{AckHandle, AckLog, Batch, ConfigError, Message, Position};
use tower::{Layer, Service, ServiceExt};

use crate::dead_letter::{
    DeadLetterError, DeadLetterPolicy, DeadLetterRecord, PermanentFailures, SinkTimedOut,
    DEFAULT_SINK_TIMEOUT,
};
use crate::observe::error_chain;
use crate::panic::Panicked;
use crate::BoxError;

/// Why a record was dead-lettered; it lives with the dead-letter vocabulary.
pub use crate::dead_letter::Reason;
/// How far a failing batch may be split; shared with record-mode [`batch`](crate::batch).
pub use crate::splits::Splits;

/// The settings of [`Bisect`]; checked by [`BisectLayer::with_config`].
#[derive(Clone, Debug)]
pub struct BisectConfig {
    splits: Splits,
    max_attempts: Option<u32>,
    max_record_age: Option<Duration>,
    sink_timeout: Duration,
}

impl Default for BisectConfig {
    /// Split down to single records, no attempts or age limit, 30 s sink timeout.
    fn default() -> Self {
        BisectConfig {
            splits: Splits::Full,
            max_attempts: None,
            max_record_age: None,
            sink_timeout: DEFAULT_SINK_TIMEOUT,
        }
    }
}

impl BisectConfig {
    /// The defaults (see [`BisectConfig::default`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// How far a failing batch may be split (default [`Splits::Full`]).
    pub fn splits(mut self, splits: Splits) -> Self {
        self.splits = splits;
        self
    }

    /// In how many deliveries a record may be in a failing piece that cannot be narrowed
    /// down before it is dead-lettered (`attempts_exhausted`); at least 1. Unset:
    /// delivered again for ever.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// Records of a failed piece that arrived longer ago than `age` are dead-lettered
    /// (`too_old`) rather than retried; more than zero. Unset: no limit.
    pub fn max_record_age(mut self, age: Duration) -> Self {
        self.max_record_age = Some(age);
        self
    }

    /// How long the sink may take to be ready and accept one record (default 30 s);
    /// more than zero.
    pub fn sink_timeout(mut self, timeout: Duration) -> Self {
        self.sink_timeout = timeout;
        self
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.max_attempts == Some(0) {
            return Err(invalid("max_attempts", "must be at least 1"));
        }
        if self.max_record_age == Some(Duration::ZERO) {
            return Err(invalid("max_record_age", "must be more than zero"));
        }
        if self.sink_timeout.is_zero() {
            return Err(invalid("sink_timeout", "must be more than zero"));
        }
        Ok(())
    }

    /// Whether the layer has nothing to do: the batch passes through untouched.
    fn is_pass_through(&self) -> bool {
        self.splits == Splits::Off && self.max_attempts.is_none() && self.max_record_age.is_none()
    }
}

fn invalid(field: &'static str, reason: &str) -> ConfigError {
    ConfigError::Invalid {
        field,
        reason: reason.to_owned(),
    }
}

/// Wall time that follows tokio's clock: the wall time when it was made plus tokio's
/// elapsed time since (equal to the wall clock at run time; a paused clock in tests).
#[derive(Clone, Copy, Debug)]
struct Clock {
    wall: SystemTime,
    at: tokio::time::Instant,
}

impl Clock {
    fn new() -> Self {
        Clock {
            wall: SystemTime::now(),
            at: tokio::time::Instant::now(),
        }
    }

    fn now(&self) -> SystemTime {
        self.wall
            .checked_add(self.at.elapsed())
            .unwrap_or(self.wall)
    }
}

/// Per shard, the pieces that could not be narrowed down and failed (one per delivery,
/// first and last record) while they still hold records that are not finished: a
/// record's attempts are the failed pieces that held it.
type Stuck = Arc<Mutex<StuckMap>>;
type StuckMap = HashMap<(Arc<str>, Arc<str>), Vec<(Position, Position)>>;

/// Narrows a failing batch down to its poison records; see the [module docs](self).
pub struct Bisect<S, K, P = PermanentFailures> {
    inner: S,
    sink: K,
    policy: P,
    config: Arc<BisectConfig>,
    stuck: Stuck,
    clock: Clock,
}

impl<S: Clone, K: Clone, P: Clone> Clone for Bisect<S, K, P> {
    fn clone(&self) -> Self {
        Bisect {
            inner: self.inner.clone(),
            sink: self.sink.clone(),
            policy: self.policy.clone(),
            config: self.config.clone(),
            stuck: self.stuck.clone(),
            clock: self.clock,
        }
    }
}

impl<S: fmt::Debug, K, P> fmt::Debug for Bisect<S, K, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bisect")
            .field("inner", &self.inner)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<S, K, P> Bisect<S, K, P> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The configuration.
    pub fn config(&self) -> &BisectConfig {
        &self.config
    }
}

/// What a call of [`Bisect`] did with its batch (all of it was handled or dead-lettered).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct BisectOutcome {
    /// Calls of the inner service.
    pub calls: u32,
    /// Failed pieces split in two.
    pub splits: u32,
    /// Records that went to the sink.
    pub dead_lettered: usize,
}

/// The response future of [`Bisect`].
pub type ResponseFuture = Pin<Box<dyn Future<Output = Result<BisectOutcome, BoxError>> + Send>>;

impl<S, K, P> Service<Batch<Bytes>> for Bisect<S, K, P>
where
    S: Service<Batch<Bytes>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    K: Service<DeadLetterRecord> + Clone + Send + 'static,
    K::Future: Send,
    K::Error: Into<BoxError>,
    P: DeadLetterPolicy + Clone + Send + 'static,
{
    type Response = BisectOutcome;
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, mut batch: Batch<Bytes>) -> Self::Future {
        // The instance driven to readiness makes the first call; `self` keeps a clone.
        let fresh = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, fresh);
        if self.config.is_pass_through() {
            return Box::pin(async move {
                inner.call(batch).await.map_err(Into::into)?;
                Ok(BisectOutcome {
                    calls: 1,
                    ..BisectOutcome::default()
                })
            });
        }
        let ack = batch.take_ack();
        let run = Run {
            inner,
            sink: self.sink.clone(),
            policy: self.policy.clone(),
            config: self.config.clone(),
            stuck: self.stuck.clone(),
            clock: self.clock,
            ack,
            stream: batch.stream.clone(),
            shard: batch.shard_id.clone(),
            millis_behind_latest: batch.millis_behind_latest,
            outcome: BisectOutcome::default(),
        };
        Box::pin(run.run(batch.messages))
    }
}

/// The shard's lease was lost while a failed batch was being split: the pieces not yet
/// handled, and the records not yet dead-lettered, are left to the shard's new owner,
/// which reads them again from the checkpoint (calling the handler or the sink on them
/// here would handle or dead-letter them twice).
#[derive(Clone, Copy, Debug, thiserror::Error)]
#[error("the shard's lease was lost while its batch was being split; the new owner reads the rest")]
#[non_exhaustive]
pub struct LeaseLostWhileSplitting;

/// Whether the lease of the shard `piece`'s records came from was lost.
fn piece_lease_lost(messages: &[Message<Bytes>], piece: &Piece) -> bool {
    messages
        .get(piece.start)
        .is_some_and(|m| m.metadata.lease_lost.is_cancelled())
}

/// A piece of the batch still to be handled: `messages[start..end]`.
#[derive(Clone, Copy, Debug)]
struct Piece {
    start: usize,
    end: usize,
    depth: u32,
    /// Failed calls that held these records so far, in this delivery.
    failures: u32,
    /// A second half whose parent failed: if the first half succeeds, this one must fail.
    second_half: bool,
    /// Known to fail (its first half succeeded): split without calling it whole.
    known_failed: bool,
}

impl Piece {
    fn len(&self) -> usize {
        self.end - self.start
    }
}

/// One call's work.
struct Run<S, K, P> {
    inner: S,
    sink: K,
    policy: P,
    config: Arc<BisectConfig>,
    stuck: Stuck,
    clock: Clock,
    ack: Option<AckHandle>,
    stream: Arc<str>,
    shard: Arc<str>,
    millis_behind_latest: Option<i64>,
    outcome: BisectOutcome,
}

impl<S, K, P> Run<S, K, P>
where
    S: Service<Batch<Bytes>>,
    S::Error: Into<BoxError>,
    K: Service<DeadLetterRecord> + Clone,
    K::Error: Into<BoxError>,
    P: DeadLetterPolicy,
{
    async fn run(mut self, messages: Vec<Message<Bytes>>) -> Result<BisectOutcome, BoxError> {
        let mut pieces = vec![Piece {
            start: 0,
            end: messages.len(),
            depth: 0,
            failures: 0,
            second_half: false,
            known_failed: false,
        }];
        while let Some(piece) = pieces.pop() {
            if piece.len() == 0 {
                continue;
            }
            if piece.known_failed && piece.len() > 1 && self.config.splits.allows(piece.depth) {
                self.split(piece, &mut pieces);
                continue;
            }
            if self.outcome.calls > 0 && piece_lease_lost(&messages, &piece) {
                return Err(Box::new(LeaseLostWhileSplitting));
            }
            if self.outcome.calls > 0 {
                // A readiness error is the service's state, not the records': it fails
                // the call and the rest is delivered again.
                self.inner.ready().await.map_err(Into::into)?;
            }
            self.outcome.calls += 1;
            let records = &messages[piece.start..piece.end];
            // The piece's own handle: what the inner service acknowledges through it is
            // done, whatever its result.
            let progress = AckLog::default();
            let mut batch = Batch::new(self.stream.clone(), self.shard.clone(), records.to_vec())
                .with_ack(progress.handle());
            batch.millis_behind_latest = self.millis_behind_latest;
            let result = CatchPanic::new(&mut self.inner, batch)
                .await
                .or_else(|error| match progress.acknowledged_prefix(records) {
                    // Acknowledged whole before it failed: handled, as for the consumer.
                    done if done == records.len() => Ok(()),
                    done => Err((done, error)),
                });
            match result {
                Ok(()) => {
                    if let Some(last) = records.last() {
                        self.acknowledge_through(last.position());
                    }
                    if !piece.second_half {
                        // The failed parent's second half holds the culprit.
                        if let Some(next) = pieces.last_mut() {
                            if next.second_half
                                && next.start == piece.end
                                && next.depth == piece.depth
                            {
                                next.known_failed = true;
                            }
                        }
                    }
                }
                Err((done, error)) => {
                    // The records the inner service finished before it failed (a
                    // batching layer's written chunks) are handled: only the rest of
                    // the piece failed, and only the rest is split or retried.
                    let mut rest = piece;
                    if let Some(last) = done.checked_sub(1).and_then(|i| records.get(i)) {
                        self.acknowledge_through(last.position());
                        rest.start += done;
                    }
                    self.failed(rest, error, &messages, &mut pieces).await?
                }
            }
        }
        // Every record of the read is finished: only the failed pieces that reach past
        // it still count, for the records after it.
        if let Some(last) = messages.last().map(Message::position) {
            let key = (self.stream.clone(), self.shard.clone());
            let mut stuck = self.lock_stuck();
            if let Some(failed) = stuck.get_mut(&key) {
                failed.retain(|(_, end)| *end > last);
                if failed.is_empty() {
                    stuck.remove(&key);
                }
            }
        }
        Ok(self.outcome)
    }

    fn split(&mut self, piece: Piece, pieces: &mut Vec<Piece>) {
        let middle = piece.start + piece.len() / 2;
        let half = |start, end, second_half| Piece {
            start,
            end,
            depth: piece.depth + 1,
            failures: piece.failures,
            second_half,
            known_failed: false,
        };
        // A stack: the first half is handled first.
        pieces.push(half(middle, piece.end, true));
        pieces.push(half(piece.start, middle, false));
        self.outcome.splits += 1;
        tracing::debug!(
            monotonic_counter.shardflow.batches_split = 1u64,
            size = piece.len(),
            "a failed batch is split in two"
        );
    }

    /// A call on `piece` failed with `error`: dead-letter what must be, split what can
    /// be, or fail the call.
    async fn failed(
        &mut self,
        mut piece: Piece,
        error: BoxError,
        messages: &[Message<Bytes>],
        pieces: &mut Vec<Piece>,
    ) -> Result<(), BoxError> {
        piece.failures += 1;
        if piece_lease_lost(messages, &piece) {
            // The new owner delivers these records again: dead-lettering them here (too
            // old, out of attempts) would send them to the sink twice.
            return Err(error);
        }
        let text = error_chain(&*error);
        if let Some(limit) = self.config.max_record_age {
            let now = self.clock.now();
            let old = messages[piece.start..piece.end]
                .iter()
                .take_while(|m| {
                    m.metadata
                        .approximate_arrival
                        .and_then(|arrival| now.duration_since(arrival).ok())
                        .is_some_and(|age| age > limit)
                })
                .count();
            let records = &messages[piece.start..piece.start + old];
            self.dead_letter(records, Reason::TooOld, &text, piece.failures)
                .await?;
            piece.start += old;
            if piece.len() == 0 {
                return Ok(());
            }
            let first = &messages[piece.start];
            if old > 0 && self.policy.should_dead_letter(&*error, &first.metadata) {
                // The rest never failed without the old records just dead-lettered, which
                // may have been the culprits: it is called again as it is, and judged by
                // its own result (never dead-lettered, or split, for its neighbours').
                // Its success says nothing about a sibling half either.
                pieces.push(Piece {
                    second_half: true,
                    known_failed: false,
                    ..piece
                });
                return Ok(());
            }
        }
        let first = &messages[piece.start];
        let about_records = self.policy.should_dead_letter(&*error, &first.metadata);
        if about_records && piece.len() == 1 {
            return self
                .dead_letter(
                    &messages[piece.start..piece.end],
                    Reason::FailedAlone,
                    &text,
                    piece.failures,
                )
                .await;
        }
        if about_records && self.config.splits.allows(piece.depth) {
            self.split(piece, pieces);
            return Ok(());
        }
        // Not narrowed down: delivered again, unless that has failed too often.
        if let Some(max) = self.config.max_attempts {
            let key = (self.stream.clone(), self.shard.clone());
            let records = &messages[piece.start..piece.end];
            let (first, last) = match (records.first(), records.last()) {
                (Some(first), Some(last)) => (first.position(), last.position()),
                _ => return Err(error),
            };
            let (attempts, used_up) = {
                let mut stuck = self.lock_stuck();
                let failed = stuck.entry(key).or_default();
                // A failed piece that ended before this one held none of its records.
                failed.retain(|(_, end)| *end >= first);
                failed.push((first.clone(), last));
                let attempts = |at: &Position| {
                    failed
                        .iter()
                        .filter(|(start, end)| start <= at && at <= end)
                        .count()
                };
                // Reads differ in size, so the failed pieces do: only the records that
                // were in `max` of them used up their attempts; the rest failed fewer
                // times and are delivered again, their count kept.
                let used_up = records
                    .iter()
                    .take_while(|m| attempts(&m.position()) >= max as usize)
                    .count();
                (attempts(&first), used_up)
            };
            if used_up > 0 {
                let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
                self.dead_letter(
                    &records[..used_up],
                    Reason::AttemptsExhausted,
                    &text,
                    attempts,
                )
                .await?;
                if used_up == records.len() {
                    return Ok(());
                }
            }
        }
        Err(error)
    }

    /// Sends `records` to the sink one by one, in order, acknowledging each once the
    /// sink took it.
    async fn dead_letter(
        &mut self,
        records: &[Message<Bytes>],
        reason: Reason,
        error: &str,
        attempts: u32,
    ) -> Result<(), BoxError> {
        for message in records {
            if message.metadata.lease_lost.is_cancelled() {
                // The new owner reads this record again from the checkpoint: sent here
                // too, it would be dead-lettered twice.
                return Err(Box::new(LeaseLostWhileSplitting));
            }
            let text = format!("{reason}: {error}");
            let record = DeadLetterRecord {
                metadata: message.metadata.clone(),
                payload: message.payload.clone(),
                error: text.clone(),
                attempts: Some(attempts),
                headers: message.headers.clone(),
            };
            let timeout = self.config.sink_timeout;
            let answer =
                match tokio::time::timeout(timeout, self.sink.clone().oneshot(record)).await {
                    Ok(answer) => answer.map_err(Into::into),
                    Err(_elapsed) => Err(Box::new(SinkTimedOut { after: timeout }) as BoxError),
                };
            if let Err(sink) = answer {
                return Err(Box::new(DeadLetterError::new(
                    message.position(),
                    text,
                    sink,
                )));
            }
            tracing::warn!(
                shard = %message.metadata.shard_id,
                sequence = %message.metadata.sequence_number,
                %reason,
                "record dead-lettered"
            );
            tracing::debug!(
                monotonic_counter.shardflow.dead_lettered = 1u64,
                reason = reason.as_str(),
                "dead-lettered"
            );
            crate::metrics::dead_lettered(&message.metadata.stream, reason.as_str());
            self.outcome.dead_lettered += 1;
            self.acknowledge_through(message.position());
        }
        Ok(())
    }

    fn acknowledge_through(&self, position: Position) {
        if let Some(ack) = &self.ack {
            ack.ack_through(position);
        }
    }

    fn lock_stuck(&self) -> std::sync::MutexGuard<'_, StuckMap> {
        // The map is consistent between statements: a panic elsewhere leaves it usable.
        self.stuck.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

pin_project! {
    /// One call of the inner service, with a panic (in `call` or the future) as a
    /// [`Panicked`] error.
    struct CatchPanic<F> {
        #[pin]
        future: Option<F>,
        panic: Option<Panicked>,
    }
}

impl<F> CatchPanic<F> {
    fn new<S, R>(inner: &mut S, request: R) -> Self
    where
        S: Service<R, Future = F>,
    {
        match catch_unwind(AssertUnwindSafe(|| inner.call(request))) {
            Ok(future) => CatchPanic {
                future: Some(future),
                panic: None,
            },
            Err(payload) => CatchPanic {
                future: None,
                panic: Some(Panicked::from_payload(&*payload)),
            },
        }
    }
}

impl<F, R, E> Future for CatchPanic<F>
where
    F: Future<Output = Result<R, E>>,
    E: Into<BoxError>,
{
    type Output = Result<(), BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Some(panic) = this.panic.take() {
            return Poll::Ready(Err(Box::new(panic)));
        }
        let Some(future) = this.future.as_mut().as_pin_mut() else {
            // Polled after completion.
            return Poll::Pending;
        };
        let polled = catch_unwind(AssertUnwindSafe(|| future.poll(cx)));
        let output = match polled {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(Ok(_))) => Ok(()),
            Ok(Poll::Ready(Err(e))) => Err(e.into()),
            Err(payload) => Err(Box::new(Panicked::from_payload(&*payload)) as BoxError),
        };
        this.future.set(None);
        Poll::Ready(output)
    }
}

/// Applies [`Bisect`] to services.
#[derive(Clone, Debug)]
pub struct BisectLayer<K, P = PermanentFailures> {
    sink: K,
    policy: P,
    config: Arc<BisectConfig>,
    stuck: Stuck,
    clock: Clock,
}

impl<K> BisectLayer<K, PermanentFailures> {
    /// Bisects failing batches down to single records and sends those that fail alone
    /// to `sink`, with the default [`BisectConfig`].
    pub fn new(sink: K) -> Self {
        BisectLayer {
            sink,
            policy: PermanentFailures,
            config: Arc::new(BisectConfig::default()),
            stuck: Stuck::default(),
            clock: Clock::new(),
        }
    }

    /// Like [`BisectLayer::new`] with `config`; refuses a config that cannot work
    /// ([`ConfigError::Invalid`] naming the field).
    pub fn with_config(sink: K, config: BisectConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(BisectLayer {
            config: Arc::new(config),
            ..BisectLayer::new(sink)
        })
    }
}

impl<K, P> BisectLayer<K, P> {
    /// Uses another policy to tell errors about the records (split, dead-letter) from
    /// transient ones (fail the call, deliver again); see
    /// [`DeadLetterLayer::policy`](crate::DeadLetterLayer::policy).
    pub fn policy<P2>(self, policy: P2) -> BisectLayer<K, P2> {
        BisectLayer {
            sink: self.sink,
            policy,
            config: self.config,
            stuck: self.stuck,
            clock: self.clock,
        }
    }
}

impl<S, K: Clone, P: Clone> Layer<S> for BisectLayer<K, P> {
    type Service = Bisect<S, K, P>;

    fn layer(&self, inner: S) -> Self::Service {
        Bisect {
            inner,
            sink: self.sink.clone(),
            policy: self.policy.clone(),
            config: self.config.clone(),
            stuck: self.stuck.clone(),
            clock: self.clock,
        }
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod properties;
