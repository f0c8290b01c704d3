//! What handlers receive: [`Message`] (metadata, headers and payload) and [`Batch`] (the
//! messages of one read of one shard, with the handle that acknowledges them).
//!
//! A message carries two kinds of facts about its record, kept apart on purpose:
//! [`Metadata`] is what *Kinesis* says (stream, shard, sequence number, partition key,
//! arrival time), filled in by the consumer and read-only in spirit; [`Headers`] is what
//! the *application* says (`contentType`, `correlationId`, a `traceparent`, its own
//! names), written by a producer into the record and read back by the consumer — what
//! Spring calls message headers and Kafka calls record headers.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::headers::{HeaderValue, Headers};
use crate::sequence::{Position, SequenceNumber};

/// Where a record came from and what Kinesis said about it.
///
/// This is what Kinesis knows of the record (filled in by the consumer); the
/// application's own key-values are the message's [`Headers`]. The struct is `#[non_exhaustive]` so that fields can be
/// added later; build one for a test with [`Metadata::builder`]
/// (or [`Message::for_test`]).
#[derive(Clone)]
#[non_exhaustive]
pub struct Metadata {
    /// The stream's name.
    pub stream: Arc<str>,
    /// The shard the record was read from.
    pub shard_id: Arc<str>,
    /// The Kinesis sequence number of the record.
    pub sequence_number: SequenceNumber,
    /// The user record's index inside a KPL aggregate; 0 for plain records.
    pub sub_sequence_number: u64,
    /// The partition key the producer gave.
    pub partition_key: String,
    /// The explicit hash key, when the producer set one (KPL user records).
    pub explicit_hash_key: Option<String>,
    /// When Kinesis accepted the record (approximate).
    pub approximate_arrival: Option<SystemTime>,
    /// How far the read that brought this record was behind the tip of its shard, in
    /// milliseconds, as Kinesis reported it (`MillisBehindLatest`): the consumer's lag.
    /// The same for every record of one read (it is reported per read, not per record),
    /// and the same as [`Batch::millis_behind_latest`]; `None` when Kinesis did not say.
    pub millis_behind_latest: Option<i64>,
    /// Cancelled when this worker loses the shard's lease: in-flight work may finish,
    /// but can stop early because the checkpoint will no longer move for it.
    pub lease_lost: CancellationToken,
}

impl Metadata {
    /// The record's position in its shard: sequence and sub-sequence number.
    pub fn position(&self) -> Position {
        Position::new(self.sequence_number.clone(), self.sub_sequence_number)
    }

    /// Starts building metadata by hand, for unit tests of handlers. The defaults: stream
    /// `test-stream`, shard `shardId-000000000000`, sequence number 1, sub-sequence 0,
    /// partition key `partition-key`, no explicit hash key, no arrival time, and a
    /// `lease_lost` token that is not cancelled.
    pub fn builder() -> MetadataBuilder {
        MetadataBuilder {
            metadata: Metadata {
                stream: Arc::from("test-stream"),
                shard_id: Arc::from("shardId-000000000000"),
                sequence_number: SequenceNumber::from(1),
                sub_sequence_number: 0,
                partition_key: "partition-key".to_owned(),
                explicit_hash_key: None,
                approximate_arrival: None,
                millis_behind_latest: None,
                lease_lost: CancellationToken::new(),
            },
        }
    }
}

/// Builds [`Metadata`] by hand (see [`Metadata::builder`]); for unit tests of handlers.
#[derive(Debug, Clone)]
pub struct MetadataBuilder {
    metadata: Metadata,
}

impl MetadataBuilder {
    /// The stream's name.
    pub fn stream(mut self, stream: impl Into<Arc<str>>) -> Self {
        self.metadata.stream = stream.into();
        self
    }

    /// The shard's id.
    pub fn shard_id(mut self, shard_id: impl Into<Arc<str>>) -> Self {
        self.metadata.shard_id = shard_id.into();
        self
    }

    /// The sequence number (a `u64` or a parsed [`SequenceNumber`]).
    pub fn sequence_number(mut self, sequence_number: impl Into<SequenceNumber>) -> Self {
        self.metadata.sequence_number = sequence_number.into();
        self
    }

    /// The user record's index inside a KPL aggregate.
    pub fn sub_sequence_number(mut self, sub_sequence_number: u64) -> Self {
        self.metadata.sub_sequence_number = sub_sequence_number;
        self
    }

    /// The partition key.
    pub fn partition_key(mut self, partition_key: impl Into<String>) -> Self {
        self.metadata.partition_key = partition_key.into();
        self
    }

    /// The explicit hash key.
    pub fn explicit_hash_key(mut self, explicit_hash_key: impl Into<String>) -> Self {
        self.metadata.explicit_hash_key = Some(explicit_hash_key.into());
        self
    }

    /// When Kinesis accepted the record.
    pub fn approximate_arrival(mut self, at: SystemTime) -> Self {
        self.metadata.approximate_arrival = Some(at);
        self
    }

    /// The lag of the read that brought the record, in milliseconds.
    pub fn millis_behind_latest(mut self, millis: i64) -> Self {
        self.metadata.millis_behind_latest = Some(millis);
        self
    }

    /// The metadata built so far. Its `lease_lost` token can be cancelled to test a
    /// handler's reaction to a lost lease.
    pub fn build(self) -> Metadata {
        self.metadata
    }

    /// A message with this metadata and `payload`.
    pub fn message<T>(self, payload: T) -> Message<T> {
        Message::new(self.metadata, payload)
    }
}

impl fmt::Debug for Metadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The partition key can be business data (an account id): keep it out of Debug too.
        f.debug_struct("Metadata")
            .field("stream", &self.stream)
            .field("shard_id", &self.shard_id)
            .field("sequence_number", &self.sequence_number.as_str())
            .field("sub_sequence_number", &self.sub_sequence_number)
            .field("partition_key_len", &self.partition_key.len())
            .field("approximate_arrival", &self.approximate_arrival)
            .field("millis_behind_latest", &self.millis_behind_latest)
            .finish()
    }
}

/// One record: metadata, headers and a payload (raw [`Bytes`] until a decode layer types
/// it).
#[derive(Clone)]
pub struct Message<T = Bytes> {
    /// Where the record came from: what Kinesis says about it.
    pub metadata: Metadata,
    /// The application's headers that came with the record (empty when it had none): what
    /// the producer said about it.
    pub headers: Headers,
    /// The record's data (without the headers' framing, when it had some).
    pub payload: T,
}

impl<T> Message<T> {
    /// Builds a message from its parts, without headers.
    pub fn new(metadata: Metadata, payload: T) -> Self {
        Message {
            metadata,
            headers: Headers::new(),
            payload,
        }
    }

    /// Replaces the headers.
    pub fn with_headers(mut self, headers: Headers) -> Self {
        self.headers = headers;
        self
    }

    /// Sets one header (see [`Headers::insert`]).
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<HeaderValue>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// A message with `payload` and the default test metadata of [`Metadata::builder`]:
    /// for unit tests of handlers. Use [`Metadata::builder`] to set the metadata.
    pub fn for_test(payload: T) -> Self {
        Metadata::builder().message(payload)
    }

    /// Replaces the payload, keeping metadata and headers (what a decode layer does).
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Message<U> {
        Message {
            metadata: self.metadata,
            headers: self.headers,
            payload: f(self.payload),
        }
    }

    /// Like [`Message::map`] with a fallible function; on error the metadata and headers
    /// come back with the error so nothing about the record is lost.
    // The error carries metadata and headers by value on purpose: it is the rare path,
    // and the caller (a decode layer) moves them straight into its own error.
    #[allow(clippy::result_large_err, clippy::type_complexity)]
    pub fn try_map<U, E>(
        self,
        f: impl FnOnce(T) -> Result<U, E>,
    ) -> Result<Message<U>, (Metadata, Headers, E)> {
        match f(self.payload) {
            Ok(payload) => Ok(Message {
                metadata: self.metadata,
                headers: self.headers,
                payload,
            }),
            Err(e) => Err((self.metadata, self.headers, e)),
        }
    }

    /// The record's position in its shard.
    pub fn position(&self) -> Position {
        self.metadata.position()
    }
}

impl<T> fmt::Debug for Message<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the payload: messages end up in logs through `?msg`.
        f.debug_struct("Message")
            .field("metadata", &self.metadata)
            .field("headers", &self.headers)
            .finish_non_exhaustive()
    }
}

/// The messages of one read from one shard, in sequence order.
///
/// In `consumer.stream()` mode, call [`Batch::ack`] once they are handled: the shard's
/// checkpoint may then pass them. [`Batch::nack`] asks for redelivery from the
/// checkpoint right away; so does dropping a batch (and every [`AckHandle`] taken from
/// it) without `ack`: its records are delivered again after the backoff, rather than
/// holding the checkpoint back until a restart or hand-off.
///
/// In `consumer.run_batches(service)` mode the service's `Ok` acknowledges the batch and
/// an error gives it up; `ack` and `nack` inside the service work as above (`ack` early,
/// `nack` wins over a later `Ok`). A batch built with [`Batch::new`] (a test) has no
/// handle: `ack` and `nack` do nothing.
pub struct Batch<T = Bytes> {
    /// The stream's name.
    pub stream: Arc<str>,
    /// The shard the messages were read from.
    pub shard_id: Arc<str>,
    /// The messages, in sequence order; never empty when delivered by a consumer.
    pub messages: Vec<Message<T>>,
    /// How far this read was behind the tip of the shard, when Kinesis said.
    pub millis_behind_latest: Option<i64>,
    pub(crate) ack: Option<AckHandle>,
}

impl<T> Batch<T> {
    /// Builds a batch without an acknowledgement handle (for tests of users' handlers).
    pub fn new(stream: Arc<str>, shard_id: Arc<str>, messages: Vec<Message<T>>) -> Self {
        Batch {
            stream,
            shard_id,
            messages,
            millis_behind_latest: None,
            ack: None,
        }
    }

    /// Builds a batch whose acknowledgement handle writes down what is done with it, for
    /// tests of handlers that acknowledge a batch, or part of it, themselves
    /// ([`AckHandle::ack_through`]). The [`AckLog`] reads it back.
    pub fn for_test(
        stream: Arc<str>,
        shard_id: Arc<str>,
        messages: Vec<Message<T>>,
    ) -> (Self, AckLog) {
        let log = AckLog::default();
        let batch = Batch::new(stream, shard_id, messages).with_ack(log.handle());
        (batch, log)
    }

    /// Gives the batch `ack` as its acknowledgement handle, in place of the one it had.
    ///
    /// For a layer that hands pieces of its batch to an inner service (splitting a
    /// failed batch, re-chunking it): it keeps the read's own handle and gives each
    /// piece a handle of its own, made by [`AckLog::handle`], then reads back with
    /// [`AckLog::acknowledged_prefix`] which records of the piece the inner service
    /// finished before it failed — those are handled, and are neither handed out nor
    /// dead-lettered again in the same delivery.
    pub fn with_ack(mut self, ack: AckHandle) -> Self {
        self.ack = Some(ack);
        self
    }

    /// The number of messages.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// Whether the batch holds no messages.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Marks every message of this batch handled: the checkpoint may pass them once all
    /// earlier batches of the shard are acknowledged too. Calling it twice is harmless.
    pub fn ack(&self) {
        if let Some(ack) = &self.ack {
            ack.ack();
        }
    }

    /// Reports that this batch failed: it counts as given up at once (a restart does not
    /// wait for it), and the shard reads again from its checkpoint after a backoff.
    /// A later `ack` of this batch is ignored (its records are delivered again), and so
    /// are acknowledgements of batches delivered before the restart, and a late `nack`
    /// of one of them.
    pub fn nack(&self) {
        if let Some(ack) = &self.ack {
            ack.nack();
        }
    }

    /// Takes the acknowledgement handle out, so the messages can be moved elsewhere and
    /// acknowledged later through the handle.
    pub fn take_ack(&mut self) -> Option<AckHandle> {
        self.ack.take()
    }

    /// Replaces every payload, keeping metadata, headers and the acknowledgement handle.
    pub fn map<U>(self, mut f: impl FnMut(T) -> U) -> Batch<U> {
        Batch {
            stream: self.stream,
            shard_id: self.shard_id,
            messages: self.messages.into_iter().map(|m| m.map(&mut f)).collect(),
            millis_behind_latest: self.millis_behind_latest,
            ack: self.ack,
        }
    }
}

/// Acknowledges one delivered batch. Cheap to clone; acknowledging twice is harmless.
/// Dropping the last clone of a batch neither acknowledged nor given up counts as a
/// [`AckHandle::nack`]: the batch is delivered again from the checkpoint.
#[derive(Clone)]
pub struct AckHandle(Arc<dyn Acknowledge>);

/// What an [`AckHandle`] does, implemented by the consumer's per-shard
/// acknowledgement: the handle lives here, with the batch that carries it, so neither
/// depends on the consumer.
pub(crate) trait Acknowledge: fmt::Debug + Send + Sync {
    fn ack(&self);
    fn ack_through(&self, position: Position);
    fn nack(&self);
    fn nack_because(&self, error: &str);
    fn abandon(&self);
    fn record_handled(&self);
    fn should_start(&self) -> bool;
    fn is_current(&self) -> bool;
    fn wait_start(&self) -> BoxFuture<'_, bool>;
    fn lease_is_fresh(&self) -> bool;
    fn wait_fresh(&self) -> BoxFuture<'_, bool>;
}

impl AckHandle {
    pub(crate) fn new(inner: Arc<dyn Acknowledge>) -> Self {
        AckHandle(inner)
    }

    /// Every record of the batch is handled.
    pub fn ack(&self) {
        self.0.ack();
    }

    /// The records up to and including `position` are handled (the rest are not).
    pub fn ack_through(&self, position: Position) {
        self.0.ack_through(position);
    }

    /// The batch failed: whatever of it was not acknowledged (see
    /// [`AckHandle::ack_through`]) is given up for good (a later `ack` is ignored), and
    /// the shard stops and reads again from its watermark.
    /// A late `nack` of a batch delivered before the last restart changes nothing.
    pub fn nack(&self) {
        self.0.nack();
    }

    /// [`AckHandle::nack`] because the handler failed with `error`: kept as the reason
    /// the shard makes no progress until its handled position moves again.
    pub(crate) fn nack_because(&self, error: &str) {
        self.0.nack_because(error);
    }

    /// Gives the batch up: whatever was not acknowledged (see [`AckHandle::ack_through`])
    /// stays unhandled and is delivered again later.
    pub(crate) fn abandon(&self) {
        self.0.abandon();
    }

    /// One record of the batch is handled (the batch is acknowledged when all are): the
    /// shard is making progress even while the watermark waits for the batch's end.
    pub(crate) fn record_handled(&self) {
        self.0.record_handled();
    }

    /// Whether the batch may still be started: false once the shard drains or restarted
    /// after a failure. Work not started then must be given up with [`AckHandle::abandon`].
    pub(crate) fn should_start(&self) -> bool {
        self.0.should_start()
    }

    /// Whether the batch belongs to the shard's current generation (no restart after a
    /// failure since it was delivered): work started on an older one would run beside
    /// its redelivery.
    pub(crate) fn is_current(&self) -> bool {
        self.0.is_current()
    }

    /// Waits until the batch may start, then says whether it may: a batch queued before
    /// a long pause starts only once a renewal proved the lease is still ours; false
    /// (see [`AckHandle::should_start`]) when the shard drains, restarted or lost its
    /// lease meanwhile.
    pub(crate) async fn wait_start(&self) -> bool {
        self.0.wait_start().await
    }

    /// The check before each handler call on the batch's records: true at once while
    /// the lease is not lost and its last successful renewal is younger than the
    /// renewal margin (the common case, without an allocation); otherwise waits until a
    /// renewal proves the lease is still ours (true) or it is lost (false). A process
    /// paused past its lease (a stop signal, a long GC-like pause, a VM migration) so
    /// starts no call on a lease another worker may hold by now.
    pub(crate) async fn lease_held_for_call(&self) -> bool {
        self.0.lease_is_fresh() || self.0.wait_fresh().await
    }
}

/// One thing done with the acknowledgement handle of a batch built by
/// [`Batch::for_test`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum AckEvent {
    /// [`AckHandle::ack`]: the whole batch is handled.
    Ack,
    /// [`AckHandle::ack_through`]: the records up to this position are handled.
    AckThrough(Position),
    /// [`AckHandle::nack`]: the batch failed.
    Nack,
}

/// What was done with an acknowledgement handle made by [`AckLog::handle`] (the one of
/// a batch built by [`Batch::for_test`], or of a piece given its own handle with
/// [`Batch::with_ack`]), in order. Cheap to clone; clones share the log.
///
/// Such a handle only writes down: it moves no checkpoint. Tests of handlers read the
/// log back; a layer that hands a piece of its batch to an inner service reads how far
/// the inner service got ([`AckLog::acknowledged_prefix`]) and acknowledges that much
/// through the read's own handle.
#[derive(Clone, Debug, Default)]
pub struct AckLog(Arc<std::sync::Mutex<Vec<AckEvent>>>);

impl AckLog {
    /// A handle that writes down in this log what is done with it (every clone of it
    /// too). Dropping it writes nothing.
    pub fn handle(&self) -> AckHandle {
        AckHandle::new(Arc::new(self.clone()))
    }

    /// How many of `messages` — the messages of the batch this log's handle went with,
    /// in sequence order — were acknowledged through the handle: all of them after an
    /// [`ack`](AckHandle::ack), else those up to the furthest
    /// [`ack_through`](AckHandle::ack_through) position (0 when there was none). As for
    /// a consumer's handle, nothing done after a [`nack`](AckHandle::nack) counts.
    pub fn acknowledged_prefix<T>(&self, messages: &[Message<T>]) -> usize {
        let mut through: Option<Position> = None;
        for event in self.lock().iter() {
            match event {
                AckEvent::Ack => return messages.len(),
                AckEvent::AckThrough(position) => {
                    if through.as_ref().is_none_or(|t| t < position) {
                        through = Some(position.clone());
                    }
                }
                AckEvent::Nack => break,
            }
        }
        match through {
            Some(through) => messages.partition_point(|m| m.position() <= through),
            None => 0,
        }
    }

    /// Everything done with the handle so far, in order.
    pub fn events(&self) -> Vec<AckEvent> {
        self.lock().clone()
    }

    /// The last position passed to [`AckHandle::ack_through`] so far, if any.
    pub fn acked_through(&self) -> Option<Position> {
        self.lock().iter().rev().find_map(|event| match event {
            AckEvent::AckThrough(position) => Some(position.clone()),
            _ => None,
        })
    }

    fn push(&self, event: AckEvent) {
        self.lock().push(event);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<AckEvent>> {
        // A push cannot leave the log half-written: a panic elsewhere leaves it usable.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Acknowledge for AckLog {
    fn ack(&self) {
        self.push(AckEvent::Ack);
    }

    fn ack_through(&self, position: Position) {
        self.push(AckEvent::AckThrough(position));
    }

    fn nack(&self) {
        self.push(AckEvent::Nack);
    }

    fn nack_because(&self, _error: &str) {
        self.push(AckEvent::Nack);
    }

    // The consumer's own bookkeeping: nothing a handler does, nothing to write down.
    fn abandon(&self) {}

    fn record_handled(&self) {}

    fn should_start(&self) -> bool {
        true
    }

    fn is_current(&self) -> bool {
        true
    }

    fn wait_start(&self) -> BoxFuture<'_, bool> {
        Box::pin(std::future::ready(true))
    }

    // A test batch has no lease: it is always held.
    fn lease_is_fresh(&self) -> bool {
        true
    }

    fn wait_fresh(&self) -> BoxFuture<'_, bool> {
        Box::pin(std::future::ready(true))
    }
}

impl fmt::Debug for AckHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AckHandle").field(&self.0).finish()
    }
}

impl<T> fmt::Debug for Batch<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Batch")
            .field("stream", &self.stream)
            .field("shard_id", &self.shard_id)
            .field("len", &self.messages.len())
            .field(
                "first",
                &self
                    .messages
                    .first()
                    .map(|m| m.metadata.sequence_number.as_str()),
            )
            .field(
                "last",
                &self
                    .messages
                    .last()
                    .map(|m| m.metadata.sequence_number.as_str()),
            )
            .field("millis_behind_latest", &self.millis_behind_latest)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(range: std::ops::RangeInclusive<u64>) -> Vec<Message<()>> {
        range
            .map(|n| Metadata::builder().sequence_number(n).message(()))
            .collect()
    }

    #[test]
    fn a_piece_handle_reports_the_prefix_it_acknowledged() {
        let piece = messages(10..=15);
        let log = AckLog::default();
        let handle = log.handle();
        assert_eq!(
            log.acknowledged_prefix(&piece),
            0,
            "nothing acknowledged yet"
        );
        handle.ack_through(piece[2].position());
        // An earlier position after a later one takes nothing back.
        handle.ack_through(piece[0].position());
        assert_eq!(log.acknowledged_prefix(&piece), 3);
        // A position past the piece covers the piece and no more.
        handle.ack_through(
            Metadata::builder()
                .sequence_number(99u64)
                .build()
                .position(),
        );
        assert_eq!(log.acknowledged_prefix(&piece), piece.len());
    }

    #[test]
    fn nothing_acknowledged_after_a_nack_counts() {
        let piece = messages(1..=4);
        let log = AckLog::default();
        let batch = Batch::new(Arc::from("s"), Arc::from("shard"), piece).with_ack(log.handle());
        if let Some(ack) = &batch.ack {
            ack.ack_through(batch.messages[0].position());
        }
        batch.nack();
        batch.ack();
        assert_eq!(log.acknowledged_prefix(&batch.messages), 1);
        let whole = AckLog::default();
        let batch = batch.with_ack(whole.handle());
        batch.ack();
        assert_eq!(whole.acknowledged_prefix(&batch.messages), batch.len());
    }
}
