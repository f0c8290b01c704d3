//! Reads one shard, by polling (iterators and GetRecords) or through enhanced fan-out
//! (SubscribeToShard), and hands what it read to the handlers through one function,
//! `deliver` (in `delivery`). Both loops recover
//! from throttling and transient errors with backoff; polling also from expired
//! iterators, fan-out from subscriptions that end (after about five minutes) or fail.

use std::sync::Arc;

use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::ack::ShardProgress;
use crate::backoff::Backoff;
use crate::kinesis::{KinesisApi, KinesisError, StartingPosition};
use crate::lease::{Checkpoint, HeldLease};
use crate::message::Batch;
use crate::metrics::ShardMetrics;
use crate::sequence::SequenceNumber;

use crate::consumer::config::{Config, InitialPosition};
use crate::consumer::context::{FanOut, WorkerContext};
use crate::consumer::health::HealthState;
use crate::consumer::read_ahead::MESSAGE_OVERHEAD;

/// What a reader waiting for the worker's read-ahead budget waits on (a health reason).
pub(super) const READ_AHEAD: &str =
    "the worker's read-ahead budget (held by unacknowledged batches, perhaps of other shards)";

/// Everything a shard's reader needs.
pub(crate) struct ShardReader {
    pub(crate) config: Arc<Config>,
    pub(crate) worker: WorkerContext,
    pub(crate) kinesis: Arc<dyn KinesisApi>,
    pub(crate) stream: Arc<str>,
    pub(crate) shard_id: Arc<str>,
    /// The shard's hash-key range, to count KPL user records that belong elsewhere.
    pub(crate) hash_range: Option<(u128, u128)>,
    pub(crate) progress: Arc<ShardProgress>,
    pub(crate) out: mpsc::Sender<Batch>,
    pub(crate) lease: Arc<HeldLease>,
    pub(crate) lease_lost: CancellationToken,
    pub(crate) metrics: Arc<ShardMetrics>,
    pub(crate) health: Arc<HealthState>,
}

/// The record limit of a shard's first GetRecords call (see `poll`). Small: the time a
/// GetRecords call takes grows with the records it returns (on Kinesis and even more on
/// an emulator), and a fresh worker's first records wait for that first answer. Each
/// full page doubles the next, so a backlog is read in pages of `max_records_per_read`
/// after a few calls.
const FIRST_READ_LIMIT: u32 = 100;

/// Whether a reader goes on after handing out a read.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Flow {
    /// The read held records not handled before; they went to the handlers.
    Delivered,
    /// Nothing new in the read (empty, or only records already handled).
    NothingNew,
    /// Nobody consumes any more (shutting down) or the lease is lost.
    Stop,
}

/// How many times in a row a shard must be both refused as NotFound and left out of
/// ListShards before it counts as gone (see [`ShardReader::gone_or`]).
pub(super) const GONE_CONFIRMATIONS: u32 = 3;

impl ShardReader {
    /// Reads from just after `start` until the shard ends (then registers the end with
    /// the watermark and returns `Ok`) or a fatal error. Runs until dropped otherwise.
    /// Polls, or subscribes when the consumer was built with
    /// [`fan_out`](crate::consumer::ConsumerBuilder::fan_out).
    pub(crate) async fn read(
        &self,
        start: Checkpoint,
        backoff: &mut Backoff,
    ) -> Result<(), KinesisError> {
        match &self.worker.fan_out {
            Some(fan_out) => self.subscribe(fan_out, start, backoff).await,
            None => self.poll(start, backoff).await,
        }
    }

    /// The polling loop: GetRecords from an iterator, a pause when caught up.
    async fn poll(&self, start: Checkpoint, backoff: &mut Backoff) -> Result<(), KinesisError> {
        // Everything at or before `handled` is dropped record by record: it is either
        // covered by the checkpoint or was already delivered by this reader.
        let mut handled = start;
        let mut iterator: Option<String> = None;
        // The first reads are small, so the first records reach the handler quickly
        // even when a large backlog waits; each full page doubles the next one.
        let mut limit = self.config.max_records_per_read.min(FIRST_READ_LIMIT);
        let mut just_expired = false;
        let mut not_found = 0;
        // After new records came without a next iterator, the next read starts right
        // AFTER them (not AT the last one): only an empty read there proves the end. A
        // read AT the last record holds that record again, and with one record per read
        // it would bring "nothing new" although the shard goes on.
        let mut after_delivered = false;
        // The previous read's size: about what the next one needs of the read-ahead
        // budget, waited for before reading so no shard fetches while it is used up.
        let mut estimate = 0;
        loop {
            let it = match iterator.take() {
                Some(it) => it,
                None => match self.iterator_after(&handled, after_delivered).await {
                    Ok(it) => it,
                    Err(e) if e.is_transient() => {
                        self.pause(&e, backoff).await;
                        continue;
                    }
                    Err(e) => {
                        if self.gone_or(e, &mut not_found, backoff).await? {
                            return Ok(());
                        }
                        continue;
                    }
                },
            };
            let reserved = {
                let _blocked = self.progress.blocked_on(READ_AHEAD);
                self.worker.read_ahead.reserve(estimate).await
            };
            let page = match self.kinesis.get_records(&it, limit).await {
                Ok(page) => page,
                Err(KinesisError::ExpiredIterator(why)) => {
                    self.metrics.iterator_renewals.increment(1);
                    tracing::info!(shard = %self.shard_id, %why, "iterator expired; reading again from the last delivered record");
                    // Twice in a row means something is wrong beyond an old iterator.
                    if std::mem::replace(&mut just_expired, true) {
                        self.pause(&KinesisError::ExpiredIterator(why), backoff)
                            .await;
                    }
                    continue;
                }
                Err(e) if e.is_transient() => {
                    self.pause(&e, backoff).await;
                    iterator = Some(it);
                    continue;
                }
                Err(e) => {
                    if self.gone_or(e, &mut not_found, backoff).await? {
                        return Ok(());
                    }
                    continue;
                }
            };
            backoff.reset();
            just_expired = false;
            not_found = 0;
            after_delivered = false;
            let raw = page.records.len();
            self.lease.record_read(
                page.records.iter().map(|r| r.data.len() as u64).sum(),
                raw as u64,
            );
            estimate = page
                .records
                .iter()
                .map(|r| r.data.len() + r.partition_key.len() + MESSAGE_OVERHEAD)
                .sum();
            let flow = self
                .deliver(
                    page.records,
                    page.millis_behind_latest,
                    &mut handled,
                    Some(reserved),
                )
                .await;
            if flow == Flow::Stop {
                return Ok(());
            }
            match page.next_iterator {
                // Records came, but no way to go on: maybe the end, maybe a page cut
                // short. Only a read right after them that finds nothing new says which.
                None if flow == Flow::Delivered => {
                    tracing::debug!(shard = %self.shard_id, "no next iterator after new records; reading again after them");
                    after_delivered = true;
                    continue;
                }
                None if self.confirm_end(&page.child_shards).await => {
                    self.progress.end_of_shard();
                    return Ok(());
                }
                None => {
                    // No next iterator, yet the shard is open: never take that for an
                    // end. Read again from the last delivered record.
                    self.pause(
                        &KinesisError::Other("no next iterator on an open shard".into()),
                        backoff,
                    )
                    .await;
                }
                Some(next) => iterator = Some(next),
            }
            // A full page means more is waiting, whatever MillisBehindLatest says
            // (emulators report 0, and so does Kinesis within the same millisecond).
            let full = raw >= limit as usize;
            if full {
                limit = limit
                    .saturating_mul(2)
                    .min(self.config.max_records_per_read);
            }
            let caught_up = raw == 0 || (!full && page.millis_behind_latest == Some(0));
            if caught_up {
                tokio::time::sleep(self.config.idle_read_interval).await;
            }
        }
    }

    /// The enhanced fan-out loop: one subscription after another, each renewed AFTER the
    /// continuation sequence number of the last event (which covers everything the
    /// subscription sent, records or not), or AT the last delivered record if no event
    /// came yet (that record is then dropped by the filter). A subscription that fails
    /// is renewed the same way after a backoff; throttling (including another
    /// subscription still open on the shard, e.g. during a hand-off) is retried too.
    ///
    /// Kinesis ends a closed shard's subscription with an event without continuation.
    /// Emulators may never send it (kinesis-local keeps sending heartbeats), so while
    /// the subscription is idle and caught up the reader asks ListShards, at most once
    /// per shard sync interval, whether the shard is closed; if it is, the rest of the
    /// shard is read by polling, which ends at the iterator's end.
    async fn subscribe(
        &self,
        fan_out: &FanOut,
        start: Checkpoint,
        backoff: &mut Backoff,
    ) -> Result<(), KinesisError> {
        let consumer_arn = loop {
            match fan_out
                .consumer_arn(self.kinesis.as_ref(), &self.stream)
                .await
            {
                Ok(arn) => break arn,
                Err(e) if e.is_transient() => self.pause(&e, backoff).await,
                Err(e) => return Err(e),
            }
        };
        let mut handled = start;
        let mut continuation: Option<SequenceNumber> = None;
        let mut closed_checked = Instant::now();
        let mut not_found = 0;
        loop {
            let from = match &continuation {
                Some(after) => StartingPosition::AfterSequenceNumber(after.clone()),
                None => self.starting_position(&handled)?,
            };
            let mut events = match self
                .kinesis
                .subscribe_to_shard(consumer_arn, &self.shard_id, &from)
                .await
            {
                Ok(events) => events,
                Err(e) if e.is_transient() => {
                    self.pause(&e, backoff).await;
                    continue;
                }
                Err(e) => {
                    if self.gone_or(e, &mut not_found, backoff).await? {
                        return Ok(());
                    }
                    continue;
                }
            };
            // Kinesis sends an event at least every 5 s (a heartbeat when idle): a
            // subscription silent for much longer is hung, and is renewed.
            let silence = self.config.read_call_timeout.saturating_mul(3);
            not_found = 0;
            let failure = loop {
                let event = match tokio::time::timeout(silence, events.next()).await {
                    Err(_) => {
                        break Some(KinesisError::Other(
                            format!("no subscription event within {silence:?}").into(),
                        ))
                    }
                    Ok(None) => break None,
                    Ok(Some(Err(e))) => break Some(e),
                    Ok(Some(Ok(event))) => event,
                };
                backoff.reset();
                let idle = event.records.is_empty() && event.millis_behind_latest == Some(0);
                let flow = self
                    .deliver(
                        event.records,
                        event.millis_behind_latest,
                        &mut handled,
                        None,
                    )
                    .await;
                if flow == Flow::Stop {
                    return Ok(());
                }
                match event.continuation {
                    Some(after) => continuation = Some(after),
                    // New records and no continuation: the end, or an event cut short.
                    // Subscribe again right AFTER the last delivered record (every record
                    // of this event was delivered whole); only an event that brings
                    // nothing new may end the shard, and one AT that record would always
                    // hold it again.
                    None if flow == Flow::Delivered => {
                        continuation = match &handled {
                            Checkpoint::At(p) => Some(p.sequence.clone()),
                            _ => None,
                        };
                        break None;
                    }
                    None if self.confirm_end(&event.child_shards).await => {
                        self.progress.end_of_shard();
                        return Ok(());
                    }
                    // An event without continuation on an open shard is not an end:
                    // subscribe again from where we are.
                    None => {
                        break Some(KinesisError::Other(
                            "event without continuation on an open shard".into(),
                        ))
                    }
                }
                if idle && closed_checked.elapsed() >= self.config.shard_sync_interval {
                    closed_checked = Instant::now();
                    if self.is_closed().await {
                        tracing::info!(shard = %self.shard_id, "the shard is closed but its subscription did not say so; reading its rest by polling");
                        drop(events);
                        return self.poll(handled, backoff).await;
                    }
                }
            };
            drop(events);
            match failure {
                None => {
                    tracing::debug!(shard = %self.shard_id, after = ?continuation, "subscription ended; renewing it")
                }
                Some(e) if e.is_transient() => self.pause(&e, backoff).await,
                Some(e) => return Err(e),
            }
        }
    }

    /// Whether a read that reported no more records, and brought nothing new, really is
    /// the shard's end: the service named children, or ListShards shows the shard
    /// closed. A missing field alone (an emulator's heartbeat) must never end an open
    /// shard, and a read with new records never ends one at all: the reader reads again
    /// right after them, and only that read, if empty, is the end.
    async fn confirm_end(&self, children: &[String]) -> bool {
        let end = !children.is_empty() || self.is_closed().await;
        if end {
            tracing::info!(shard = %self.shard_id, ?children, "reached the end of the shard");
        }
        end
    }

    /// A shard that no longer exists (trimmed after a reshard, past retention) has
    /// nothing left to read: it ends, so its children are not held back for ever.
    ///
    /// ListShards is eventually consistent, and a lagging node may answer
    /// ResourceNotFound for a shard that exists, so one such answer proves nothing. The
    /// shard counts as gone only after [`GONE_CONFIRMATIONS`] reads in a row (with a
    /// backoff between them; `strikes` counts them, any successful read resets it) were
    /// refused as NotFound while ListShards left the shard out each time. A ListShards
    /// that lists the shard starts the count again; one that fails ends nothing.
    ///
    /// Returns `Ok(true)` when the shard was ended, `Ok(false)` after a backoff when the
    /// read should be tried again, and any other error (or the stream's own NotFound) as
    /// it is.
    async fn gone_or(
        &self,
        error: KinesisError,
        strikes: &mut u32,
        backoff: &mut Backoff,
    ) -> Result<bool, KinesisError> {
        // Refused by a policy: the shard is kept and retried (a policy may be fixed
        // while the worker runs), each refusal a failure of the shard, so the worker
        // is not ready and says why, instead of giving the shard up and taking it
        // again unseen.
        if matches!(error, KinesisError::AccessDenied(_)) {
            self.pause(&error, backoff).await;
            return Ok(false);
        }
        if !matches!(error, KinesisError::NotFound(_)) {
            return Err(error);
        }
        match self.kinesis.list_shards(&self.stream).await {
            Ok(shards) if shards.iter().any(|s| *s.shard_id == *self.shard_id) => {
                *strikes = 0;
                tracing::info!(shard = %self.shard_id, "the shard is listed but was not found; retrying");
            }
            Ok(_) => {
                *strikes += 1;
                if *strikes >= GONE_CONFIRMATIONS {
                    tracing::warn!(shard = %self.shard_id, "the shard is gone (past retention); treating it as ended");
                    self.progress.end_of_shard();
                    return Ok(true);
                }
                tracing::info!(shard = %self.shard_id, strikes = *strikes, "the shard was not found and is not listed; confirming before ending it");
            }
            // The stream itself is gone: no point in waiting.
            Err(e @ KinesisError::NotFound(_)) => return Err(e),
            Err(e) => {
                tracing::debug!(shard = %self.shard_id, error = %e, "could not check whether the shard is gone; retrying");
            }
        }
        self.pause(&error, backoff).await;
        Ok(false)
    }

    /// Whether ListShards reports the shard closed (an error counts as "not known to be").
    async fn is_closed(&self) -> bool {
        match self.kinesis.list_shards(&self.stream).await {
            Ok(shards) => shards
                .iter()
                .any(|s| *s.shard_id == *self.shard_id && s.is_closed()),
            Err(e) => {
                tracing::debug!(shard = %self.shard_id, error = %e, "could not check whether the shard is closed");
                false
            }
        }
    }

    async fn pause(&self, error: &KinesisError, backoff: &mut Backoff) {
        self.health.failure(&self.shard_id, error);
        let delay = backoff.next_delay();
        match error {
            KinesisError::Throttled(_) => {
                tracing::warn!(shard = %self.shard_id, ?delay, %error, "throttled; backing off")
            }
            _ => tracing::warn!(shard = %self.shard_id, ?delay, %error, "read failed; retrying"),
        }
        tokio::time::sleep(delay).await;
    }

    /// Where to read again from so that nothing after `handled` is missed.
    fn starting_position(&self, handled: &Checkpoint) -> Result<StartingPosition, KinesisError> {
        Ok(match handled {
            Checkpoint::TrimHorizon => StartingPosition::TrimHorizon,
            // The shard task resolves LATEST into a timestamp in the lease row before
            // reading (see `ShardTask::durable_start`); a reader never starts from it.
            Checkpoint::Latest => StartingPosition::Latest,
            Checkpoint::AtTimestamp(Some(t)) => StartingPosition::AtTimestamp(*t),
            Checkpoint::AtTimestamp(None) => match &self.config.initial_position {
                InitialPosition::AtTimestamp(t) => StartingPosition::AtTimestamp(*t),
                _ => StartingPosition::TrimHorizon,
            },
            // AT rather than AFTER: the record itself is dropped by the filter, and an
            // aggregated record handled only in part is read again whole.
            Checkpoint::At(p) => StartingPosition::AtSequenceNumber(p.sequence.clone()),
            Checkpoint::ShardEnd => {
                return Err(KinesisError::Invalid(
                    "the shard is already finished".into(),
                ))
            }
        })
    }

    /// An iterator AT the last handled record (the filter drops it; an aggregate handled
    /// in part is read again whole), or right AFTER it when `after` (every record up to
    /// it was delivered whole).
    async fn iterator_after(
        &self,
        handled: &Checkpoint,
        after: bool,
    ) -> Result<String, KinesisError> {
        let from = match handled {
            Checkpoint::At(p) if after => StartingPosition::AfterSequenceNumber(p.sequence.clone()),
            _ => self.starting_position(handled)?,
        };
        self.kinesis
            .shard_iterator(&self.stream, &self.shard_id, &from)
            .await
    }
}
