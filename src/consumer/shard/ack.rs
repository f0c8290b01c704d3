//! Acknowledgements, in memory (the durable checkpoint is [`crate::lease::Checkpoint`],
//! written by the shard task): per-shard progress, the [`Watermark`] of acknowledged
//! records, the [`ShardAck`] behind the [`AckHandle`] a batch carries to move it, and
//! [`RecordMarks`] for records of a batch that finish out of order (per-key
//! concurrency).
//!
//! Batches of a shard are registered in delivery order; handlers may acknowledge them in
//! any order. The watermark is the last position of the longest prefix of acknowledged
//! batches (plus the acknowledged part of the first unacknowledged batch), never "the
//! highest acknowledged". The shard task commits it, fenced by the lease (see
//! [`crate::lease::HeldLease`]).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::consumer::health::Progress;
use crate::consumer::read_ahead::ReadAheadShare;
use crate::lease::{Checkpoint, HeldLease};
use crate::message::{AckHandle, Acknowledge};
use crate::metrics::InFlight;
use crate::sequence::Position;

/// What a unit of delivery covers: records up to a position, or the end of the shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Mark {
    At(Position),
    ShardEnd,
}

impl Mark {
    fn checkpoint(&self) -> Checkpoint {
        match self {
            Mark::At(p) => Checkpoint::At(p.clone()),
            Mark::ShardEnd => Checkpoint::ShardEnd,
        }
    }
}

#[derive(Debug)]
struct Unit {
    last: Mark,
    done: bool,
    /// Given up without being (fully) handled: it will be delivered again.
    abandoned: bool,
    /// The last acknowledged position inside a partly handled batch.
    partial: Option<Position>,
}

/// The contiguous low-watermark of acknowledged records of one shard.
#[derive(Debug)]
pub(crate) struct Watermark {
    front_id: u64,
    pending: VecDeque<Unit>,
    acked: Checkpoint,
    generation: u64,
    /// Since when records have been waiting to be handled without the handled position
    /// moving (see [`ShardProgress::waiting_since`]); `None` while nothing waits.
    waiting_since: Option<Instant>,
    /// The handler's last error since the handled position last moved.
    reason: Option<String>,
    /// The count of [`ShardProgress::handled`] the last look at `waiting_since` saw.
    seen_handled: u64,
}

impl Watermark {
    /// Starts at the shard's stored checkpoint.
    pub fn new(start: Checkpoint) -> Self {
        Watermark {
            front_id: 0,
            pending: VecDeque::new(),
            acked: start,
            generation: 0,
            waiting_since: None,
            reason: None,
            seen_handled: 0,
        }
    }

    /// Registers the next delivered unit; returns its id. Units must be registered in
    /// shard order.
    pub(crate) fn register(&mut self, last: Mark, done: bool) -> u64 {
        let id = self.front_id + self.pending.len() as u64;
        if !done && self.waiting_since.is_none() {
            self.waiting_since = Some(Instant::now());
        }
        self.pending.push_back(Unit {
            last,
            done,
            abandoned: false,
            partial: None,
        });
        self.advance();
        id
    }

    fn unit(&mut self, id: u64, generation: u64) -> Option<&mut Unit> {
        if generation != self.generation || id < self.front_id {
            return None;
        }
        self.pending.get_mut((id - self.front_id) as usize)
    }

    /// Marks a unit handled. Stale (pre-reset) or repeated acknowledgements are ignored.
    /// Returns whether the watermark moved.
    /// A unit given up ([`Watermark::abandon`], a nack) stays given up: a later
    /// acknowledgement of it is ignored, so its records are delivered again.
    pub(crate) fn ack(&mut self, id: u64, generation: u64) -> bool {
        match self.unit(id, generation) {
            Some(unit) if !unit.abandoned => unit.done = true,
            _ => return false,
        }
        self.advance()
    }

    /// Marks a unit handled up to and including `position` (a batch that failed midway).
    /// A position at or past the unit's last record acknowledges the whole unit and no
    /// more: it never covers records of later units.
    pub(crate) fn ack_through(&mut self, id: u64, generation: u64, position: Position) -> bool {
        match self.unit(id, generation) {
            Some(unit) if unit.abandoned => return false,
            Some(unit) => match &unit.last {
                Mark::At(last) if position >= *last => unit.done = true,
                _ if unit.partial.as_ref().is_none_or(|p| *p < position) => {
                    unit.partial = Some(position)
                }
                _ => return false,
            },
            None => return false,
        }
        self.advance()
    }

    fn advance(&mut self) -> bool {
        let before = self.acked.clone();
        while self.pending.front().is_some_and(|u| u.done) {
            if let Some(unit) = self.pending.pop_front() {
                self.acked = unit.last.checkpoint();
                self.front_id += 1;
            }
        }
        if let Some(p) = self.pending.front().and_then(|u| u.partial.clone()) {
            if !self.acked.covers(&p) {
                self.acked = Checkpoint::At(p);
            }
        }
        let moved = before != self.acked;
        if moved {
            // Progress: what still waits has waited from now on.
            self.reason = None;
            self.waiting_since = if self.pending.is_empty() {
                None
            } else {
                Some(Instant::now())
            };
        }
        moved
    }

    /// A read found nothing new: when no delivered unit is pending either, nothing waits
    /// to be handled (a restart after a failure forgets its units but not that records
    /// wait: only this, or the handled position moving, ends the wait).
    /// Returns whether nothing waits.
    pub(crate) fn idle(&mut self) -> bool {
        if self.pending.is_empty() {
            self.waiting_since = None;
        }
        self.waiting_since.is_none()
    }

    /// Whether nothing of the shard's own waits to be handled: no delivered unit is
    /// pending and no wait from before a restart goes on (see [`Watermark::idle`]).
    pub(crate) fn settled(&self) -> bool {
        self.pending.is_empty() && self.waiting_since.is_none()
    }

    /// Marks a unit given up: not handled (beyond any `ack_through`), never going to be.
    pub(crate) fn abandon(&mut self, id: u64, generation: u64) {
        if let Some(unit) = self.unit(id, generation) {
            unit.abandoned = true;
        }
    }

    /// Whether unit `id` of `generation` is still being worked on (delivered, neither
    /// acknowledged nor given up, no restart since).
    fn is_open(&self, id: u64, generation: u64) -> bool {
        generation == self.generation
            && id
                .checked_sub(self.front_id)
                .and_then(|i| self.pending.get(usize::try_from(i).ok()?))
                .is_some_and(|u| !u.done && !u.abandoned)
    }

    /// How many units are delivered and still being worked on (neither acknowledged
    /// nor given up): what a drain waits for.
    pub fn open(&self) -> usize {
        self.pending
            .iter()
            .filter(|u| !u.done && !u.abandoned)
            .count()
    }

    /// Forgets every unacknowledged unit (they will be delivered again) and starts a new
    /// generation, so acknowledgements of the forgotten units are ignored.
    pub(crate) fn reset(&mut self) -> u64 {
        self.front_id += self.pending.len() as u64;
        self.pending.clear();
        self.generation += 1;
        self.generation
    }

    /// The current generation (bumped by every reset).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The checkpoint every handled record allows.
    pub fn acked(&self) -> &Checkpoint {
        &self.acked
    }

    /// How many delivered units are not acknowledged yet.
    #[cfg(test)]
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

/// Which records of one delivered batch are handled, when they finish out of order
/// (`run` with per-key or unordered concurrency). The batch's acknowledgement may cover
/// only the contiguous handled prefix: the watermark never passes a record that is not
/// handled, however many later ones are.
#[derive(Debug)]
pub(crate) struct RecordMarks {
    positions: Vec<Position>,
    done: Vec<bool>,
    /// Records `0..prefix` are all handled.
    prefix: usize,
}

impl RecordMarks {
    /// Marks for a batch whose records are at `positions`, in shard order.
    pub(crate) fn new(positions: Vec<Position>) -> Self {
        RecordMarks {
            done: vec![false; positions.len()],
            positions,
            prefix: 0,
        }
    }

    /// The position of record `index`.
    pub(crate) fn position(&self, index: usize) -> Option<&Position> {
        self.positions.get(index)
    }

    /// How many records the batch holds.
    pub(crate) fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether every record is handled.
    pub(crate) fn is_complete(&self) -> bool {
        self.prefix == self.positions.len()
    }

    /// Marks record `index` handled (an out-of-range or repeated index changes nothing);
    /// returns whether the handled prefix grew.
    pub(crate) fn finish(&mut self, index: usize) -> bool {
        match self.done.get_mut(index) {
            Some(done) if !*done => *done = true,
            _ => return false,
        }
        let before = self.prefix;
        while self.done.get(self.prefix).copied().unwrap_or(false) {
            self.prefix += 1;
        }
        self.prefix != before
    }

    /// The last record of the handled prefix: what the batch may be acknowledged
    /// through (`None` while its first record is unfinished).
    pub(crate) fn handled_through(&self) -> Option<&Position> {
        self.prefix
            .checked_sub(1)
            .and_then(|i| self.positions.get(i))
    }
}

/// A shard's watermark, shared between the shard task and the acknowledgement handles.
pub(crate) struct ShardProgress {
    watermark: Mutex<Watermark>,
    /// Woken when the watermark moves or a batch fails.
    pub(crate) changed: Notify,
    failed: Mutex<Option<u64>>,
    /// False while the shard drains (shutdown, hand-off, restart after a failure):
    /// delivered work not yet started is then given up instead of handled.
    accepting: AtomicBool,
    /// A lock-free copy of the watermark's generation, checked per record.
    generation: AtomicU64,
    /// The shard's lease and how old its last renewal may be when a batch starts.
    lease: Arc<HeldLease>,
    fresh_for: Duration,
    /// Records a sequential handler finished inside batches not yet acknowledged whole:
    /// progress that the watermark only sees at the batch's end.
    handled: AtomicU64,
    /// Since when, and on what, the shard's reader waits for room outside the shard (the
    /// worker's read-ahead budget, the channel to the handlers) before it can read or
    /// hand out a batch; see [`ShardProgress::blocked_on`].
    blocked: Mutex<Option<(Instant, &'static str)>>,
}

impl std::fmt::Debug for ShardProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardProgress")
            .field("watermark", &self.watermark)
            .field("accepting", &self.accepting)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl ShardProgress {
    /// Progress starting at `start`; batches start only while `lease` was renewed within
    /// `fresh_for` (see [`ShardAck::wait_start`]).
    pub(crate) fn new(start: Checkpoint, lease: Arc<HeldLease>, fresh_for: Duration) -> Arc<Self> {
        Arc::new(ShardProgress {
            watermark: Mutex::new(Watermark::new(start)),
            changed: Notify::new(),
            failed: Mutex::new(None),
            accepting: AtomicBool::new(true),
            generation: AtomicU64::new(0),
            lease,
            fresh_for,
            handled: AtomicU64::new(0),
            blocked: Mutex::new(None),
        })
    }

    /// The reader waits on `what` (room outside this shard: the worker's read-ahead
    /// budget, held by other shards' unacknowledged batches, or the channel to the
    /// handlers) until the returned guard is dropped. A shard with nothing of its own
    /// waiting to be handled then counts as waiting since now: the shard is not read,
    /// so a wait longer than `stuck_after` makes it stuck with `what` as the reason,
    /// instead of healthy and unread while another shard's hung handler holds the room.
    pub(crate) fn blocked_on(&self, what: &'static str) -> Blocked<'_> {
        *self.lock_blocked() = Some((Instant::now(), what));
        Blocked(self)
    }

    fn lock_blocked(&self) -> MutexGuard<'_, Option<(Instant, &'static str)>> {
        self.blocked
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Since when records have been waiting to be handled with no progress: read and
    /// delivered (to a handler, or queued for one) and neither the handled position
    /// moved nor a record of an open batch finished since. `None` while nothing waits.
    /// A restart after a handler failure does not end the wait: the failed records
    /// still wait.
    pub(crate) fn waiting_since(&self) -> Option<Instant> {
        let handled = self.handled.load(Ordering::Relaxed);
        let mut w = self.lock();
        if handled != w.seen_handled {
            // A record finished since the last look: it counts as progress now, which
            // is never earlier than when it happened.
            w.seen_handled = handled;
            if w.waiting_since.is_some() {
                w.waiting_since = Some(Instant::now());
            }
        }
        // The shard's own records waiting govern; without any, a reader that waits for
        // room outside the shard leaves it unread (see `blocked_on`).
        w.waiting_since
            .or_else(|| self.lock_blocked().map(|(since, _)| since))
    }

    /// The handler's last error since the handled position last moved, or what the
    /// reader waits on (see [`ShardProgress::blocked_on`]).
    pub(crate) fn reason(&self) -> Option<String> {
        let w = self.lock();
        match (&w.reason, w.waiting_since) {
            (Some(reason), _) => Some(reason.clone()),
            (None, Some(_)) => None,
            (None, None) => self
                .lock_blocked()
                .map(|(_, what)| format!("the reader waits for {what}")),
        }
    }

    /// A read found nothing new; returns whether nothing waits (see [`Watermark::idle`]).
    pub(crate) fn idle(&self) -> bool {
        self.lock().idle()
    }

    /// Stops (or resumes) the start of new work on delivered batches.
    pub(crate) fn set_accepting(&self, accepting: bool) {
        self.accepting.store(accepting, Ordering::SeqCst);
    }

    /// Forgets unacknowledged units and starts a new generation (see [`Watermark::reset`]).
    pub(crate) fn reset(&self) {
        let generation = self.lock().reset();
        self.generation.store(generation, Ordering::SeqCst);
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Watermark> {
        // A poisoned lock only means a thread panicked while holding it; the watermark's
        // invariants hold between statements, so the data is still usable.
        self.watermark
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers a unit and returns the handle that acknowledges it.
    pub(crate) fn register(self: &Arc<Self>, last: Mark) -> ShardAck {
        let mut w = self.lock();
        let generation = w.generation();
        let id = w.register(last, false);
        ShardAck {
            progress: self.clone(),
            id,
            generation,
            in_flight: None,
            read_ahead: None,
            _unsettled: Arc::new(GiveUpOnDrop {
                progress: self.clone(),
                id,
                generation,
            }),
        }
    }

    /// Gives unit `id` up for good and makes the shard read again from its watermark
    /// (see [`ShardAck::nack`]); with `only_open`, only while the unit is still being
    /// worked on. Returns whether it did.
    fn fail(&self, id: u64, generation: u64, only_open: bool) -> bool {
        {
            let mut watermark = self.lock();
            if only_open && !watermark.is_open(id, generation) {
                return false;
            }
            // Given up first, so the drain that the failure starts does not wait for it.
            watermark.abandon(id, generation);
            // Nothing more of this generation may start: a record after the failed one
            // must not reach the handler before the restart delivers the failed one
            // again. Decided under the watermark's lock, so a restart that already began
            // a new generation (and accepts again) is never stopped by a late nack.
            if watermark.generation() == generation {
                self.set_accepting(false);
            }
        }
        {
            let mut failed = self
                .failed
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            // Keep the newest generation: a stale nack must not hide the current failure.
            if failed.is_none_or(|g| g < generation) {
                *failed = Some(generation);
            }
        }
        self.changed.notify_one();
        true
    }

    /// Registers the end of the shard: reached once every earlier unit is acknowledged.
    pub(crate) fn end_of_shard(&self) {
        self.lock().register(Mark::ShardEnd, true);
        self.changed.notify_one();
    }

    /// Takes the failure flag: `Some(generation)` once a batch of that generation failed
    /// (the newest generation that failed, when several did).
    pub(crate) fn take_failure(&self) -> Option<u64> {
        self.failed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take()
    }
}

impl Progress for ShardProgress {
    fn waiting_since(&self) -> Option<Instant> {
        ShardProgress::waiting_since(self)
    }
}

/// While alive, the shard's reader waits for room outside the shard (see
/// [`ShardProgress::blocked_on`]).
pub(crate) struct Blocked<'a>(&'a ShardProgress);

impl Drop for Blocked<'_> {
    fn drop(&mut self) {
        *self.0.lock_blocked() = None;
    }
}

/// Acknowledges one delivered batch of a shard: what an [`AckHandle`] does. Dropping
/// the last [`AckHandle`] of a batch neither acknowledged nor given up counts as a
/// [`ShardAck::nack`]: the batch is delivered again from the checkpoint.
#[derive(Debug)]
pub(crate) struct ShardAck {
    progress: Arc<ShardProgress>,
    id: u64,
    generation: u64,
    /// The batch's metrics: in flight until the last clone is dropped.
    in_flight: Option<Arc<InFlight>>,
    /// The batch's share of the worker's read-ahead budget: given back on `ack`,
    /// `nack` or `abandon`, or when the last clone is dropped.
    read_ahead: Option<Arc<ReadAheadShare>>,
    /// Gives the batch up when the last clone is dropped before it was settled.
    _unsettled: Arc<GiveUpOnDrop>,
}

/// Dropped with the last [`AckHandle`] of a batch: a batch neither acknowledged nor
/// given up then (its holder was dropped: a task that panicked, a `stream()` user that
/// let it go) is failed like a `nack`, so the shard reads it again from its watermark
/// after the backoff instead of waiting for it until a drain times out.
#[derive(Debug)]
struct GiveUpOnDrop {
    progress: Arc<ShardProgress>,
    id: u64,
    generation: u64,
}

impl Drop for GiveUpOnDrop {
    fn drop(&mut self) {
        if self.progress.fail(self.id, self.generation, true) {
            tracing::warn!(
                "a batch was dropped without ack or nack; it is given up and delivered again"
            );
        }
    }
}

impl ShardAck {
    /// The handle a batch carries (shared by its clones).
    pub(crate) fn into_handle(self) -> AckHandle {
        AckHandle::new(Arc::new(self))
    }

    /// Keeps the batch's metrics guard (see [`InFlight`]).
    pub(crate) fn tracking(mut self, in_flight: Arc<InFlight>) -> Self {
        self.in_flight = Some(in_flight);
        self
    }

    /// Keeps the batch's share of the read-ahead budget (see [`ReadAheadShare`]).
    pub(crate) fn holding(mut self, share: ReadAheadShare) -> Self {
        self.read_ahead = Some(Arc::new(share));
        self
    }

    fn release_read_ahead(&self) {
        if let Some(share) = &self.read_ahead {
            share.release();
        }
    }

    /// Every record of the batch is handled.
    pub fn ack(&self) {
        if let Some(m) = &self.in_flight {
            m.handled();
        }
        self.release_read_ahead();
        if self.progress.lock().ack(self.id, self.generation) {
            self.progress.changed.notify_one();
        }
    }

    /// The records up to and including `position` are handled (the rest are not).
    pub fn ack_through(&self, position: Position) {
        if self
            .progress
            .lock()
            .ack_through(self.id, self.generation, position)
        {
            self.progress.changed.notify_one();
        }
    }

    /// Whether the batch may still be started: false once the shard drains or restarted
    /// after a failure. Work not started then must be given up with [`ShardAck::abandon`].
    pub(crate) fn should_start(&self) -> bool {
        self.progress.accepting.load(Ordering::SeqCst)
            && self.progress.generation.load(Ordering::SeqCst) == self.generation
    }

    /// Whether the batch belongs to the shard's current generation (no restart after a
    /// failure since it was delivered): work started on an older one would run beside
    /// its redelivery.
    pub(crate) fn is_current(&self) -> bool {
        self.progress.generation.load(Ordering::SeqCst) == self.generation
    }

    /// Waits until the batch may start, then says whether it may: a batch queued before
    /// a long pause (a stalled process, a GC-like stop) starts only once a renewal proved
    /// the lease is still ours, like a fresh read; false (see [`ShardAck::should_start`])
    /// when the shard drains, restarted or lost its lease meanwhile.
    pub(crate) async fn wait_start(&self) -> bool {
        self.progress
            .lease
            .hold_until_fresh(self.progress.fresh_for, "a queued batch")
            .await;
        self.should_start() && !self.progress.lease.lost().is_cancelled()
    }

    /// Whether a handler call on the batch's records may start now as far as the lease
    /// goes: not lost, and its last successful renewal (counted from when it was sent)
    /// younger than the renewal margin. Checked before every handler call; cheap (a
    /// lock-free load and a clock read under an uncontended lock).
    pub(crate) fn lease_is_fresh(&self) -> bool {
        let lease = &self.progress.lease;
        !lease.lost().is_cancelled() && lease.is_fresh(self.progress.fresh_for)
    }

    /// Waits until the lease is fresh again (see [`ShardAck::lease_is_fresh`]): true once
    /// a renewal proved it is still ours, false when it was lost meanwhile.
    pub(crate) async fn wait_fresh(&self) -> bool {
        let lease = &self.progress.lease;
        lease
            .hold_until_fresh(self.progress.fresh_for, "handler calls")
            .await
            && lease.is_fresh(self.progress.fresh_for)
    }

    /// Gives the batch up: whatever was not acknowledged (see [`ShardAck::ack_through`])
    /// stays unhandled and is delivered again later.
    pub(crate) fn abandon(&self) {
        self.release_read_ahead();
        self.progress.lock().abandon(self.id, self.generation);
        self.progress.changed.notify_one();
    }

    /// One record of the batch is handled (the batch is acknowledged when all are): the
    /// shard is making progress even while the watermark waits for the batch's end.
    pub(crate) fn record_handled(&self) {
        self.progress.handled.fetch_add(1, Ordering::Relaxed);
    }

    /// [`ShardAck::nack`] because the handler failed with `error`: kept as the reason
    /// the shard makes no progress until its handled position moves again.
    pub(crate) fn nack_because(&self, error: &str) {
        self.progress.lock().reason = Some(error.to_owned());
        self.nack();
    }

    /// The batch failed: whatever of it was not acknowledged (see
    /// [`ShardAck::ack_through`]) is given up for good (a later `ack` is ignored), and
    /// the shard stops and reads again from its watermark.
    /// A late `nack` of a batch delivered before the last restart changes nothing.
    pub fn nack(&self) {
        self.release_read_ahead();
        self.progress.fail(self.id, self.generation, false);
    }
}

impl Acknowledge for ShardAck {
    fn ack(&self) {
        ShardAck::ack(self)
    }
    fn ack_through(&self, position: Position) {
        ShardAck::ack_through(self, position)
    }
    fn nack(&self) {
        ShardAck::nack(self)
    }
    fn nack_because(&self, error: &str) {
        ShardAck::nack_because(self, error)
    }
    fn abandon(&self) {
        ShardAck::abandon(self)
    }
    fn record_handled(&self) {
        ShardAck::record_handled(self)
    }
    fn should_start(&self) -> bool {
        ShardAck::should_start(self)
    }
    fn is_current(&self) -> bool {
        ShardAck::is_current(self)
    }
    fn wait_start(&self) -> BoxFuture<'_, bool> {
        Box::pin(ShardAck::wait_start(self))
    }
    fn lease_is_fresh(&self) -> bool {
        ShardAck::lease_is_fresh(self)
    }
    fn wait_fresh(&self) -> BoxFuture<'_, bool> {
        Box::pin(ShardAck::wait_fresh(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sequence::SequenceNumber;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    fn at(n: u64) -> Position {
        Position::new(SequenceNumber::new(n.to_string()).unwrap(), 0)
    }

    #[test]
    fn out_of_order_acks_move_only_the_contiguous_prefix() {
        let mut w = Watermark::new(Checkpoint::TrimHorizon);
        let a = w.register(Mark::At(at(10)), false);
        let b = w.register(Mark::At(at(20)), false);
        let c = w.register(Mark::At(at(30)), false);
        assert!(!w.ack(b, 0));
        assert_eq!(w.acked(), &Checkpoint::TrimHorizon);
        assert!(w.ack(a, 0));
        assert_eq!(w.acked(), &Checkpoint::At(at(20)));
        assert!(w.ack(c, 0));
        assert_eq!(w.acked(), &Checkpoint::At(at(30)));
        assert_eq!(w.in_flight(), 0);
    }

    #[test]
    fn a_given_up_batch_stays_given_up() {
        let mut w = Watermark::new(Checkpoint::TrimHorizon);
        let a = w.register(Mark::At(at(10)), false);
        w.abandon(a, 0);
        assert!(!w.ack(a, 0) && !w.ack_through(a, 0, at(5)));
        assert_eq!(w.acked(), &Checkpoint::TrimHorizon);
    }

    #[test]
    fn shard_end_is_reached_only_after_every_batch() {
        let mut w = Watermark::new(Checkpoint::TrimHorizon);
        let a = w.register(Mark::At(at(10)), false);
        w.register(Mark::ShardEnd, true);
        assert_eq!(w.acked(), &Checkpoint::TrimHorizon);
        w.ack(a, 0);
        assert_eq!(w.acked(), &Checkpoint::ShardEnd);
    }

    #[test]
    fn partial_ack_and_reset_ignore_stale_handles() {
        let mut w = Watermark::new(Checkpoint::TrimHorizon);
        let a = w.register(Mark::At(at(10)), false);
        let b = w.register(Mark::At(at(20)), false);
        assert!(w.ack_through(a, 0, at(5)));
        assert_eq!(w.acked(), &Checkpoint::At(at(5)));
        let g = w.reset();
        assert!(!w.ack(a, 0) && !w.ack(b, 0));
        assert_eq!(w.acked(), &Checkpoint::At(at(5)));
        let c = w.register(Mark::At(at(10)), false);
        assert!(w.ack(c, g));
        assert_eq!(w.acked(), &Checkpoint::At(at(10)));
    }

    #[test]
    fn records_wait_from_delivery_until_handled_or_nothing_is_pending() {
        let mut w = Watermark::new(Checkpoint::TrimHorizon);
        assert!(w.idle() && w.waiting_since.is_none());
        let a = w.register(Mark::At(at(10)), false);
        let first = w.waiting_since;
        assert!(first.is_some());
        let b = w.register(Mark::At(at(20)), false);
        assert_eq!(
            w.waiting_since, first,
            "more records do not restart the wait"
        );
        assert!(!w.idle(), "delivered units are pending");
        // A failure forgets the units, but their records still wait.
        w.reset();
        assert!(!w.ack(a, 0) && !w.ack(b, 0));
        assert_eq!(w.waiting_since, first);
        let g = w.generation();
        let c = w.register(Mark::At(at(10)), false);
        assert_eq!(w.waiting_since, first);
        assert!(w.ack(c, g));
        assert!(w.waiting_since.is_none(), "handled and nothing pending");
        // A read that finds nothing new after a reset ends the wait.
        w.register(Mark::At(at(30)), false);
        w.reset();
        assert!(w.idle() && w.waiting_since.is_none());
    }

    #[test]
    fn record_marks_cover_only_the_contiguous_handled_prefix_for_any_finish_order() {
        let mut runner = TestRunner::new_with_rng(
            Config::with_cases(256),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[5; 32]),
        );
        let orders =
            (1usize..40).prop_flat_map(|n| Just((0..n).collect::<Vec<_>>()).prop_shuffle());
        runner
            .run(&orders, |order| {
                let n = order.len();
                let mut marks = RecordMarks::new((0..n as u64).map(at).collect());
                let mut done = vec![false; n];
                let mut reached = 0;
                for &i in &order {
                    let grew = marks.finish(i);
                    done[i] = true;
                    let now = done.iter().take_while(|d| **d).count();
                    prop_assert_eq!(grew, now > reached);
                    let expected = now.checked_sub(1).map(|k| at(k as u64));
                    prop_assert_eq!(marks.handled_through(), expected.as_ref());
                    prop_assert_eq!(marks.is_complete(), now == n);
                    reached = now;
                    prop_assert!(!marks.finish(i), "a repeat changes nothing");
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn watermark_is_the_contiguous_low_watermark_for_any_ack_order() {
        let mut runner = TestRunner::new_with_rng(
            Config::with_cases(256),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[3; 32]),
        );
        let orders =
            (1usize..40).prop_flat_map(|n| Just((0..n).collect::<Vec<_>>()).prop_shuffle());
        runner
            .run(&orders, |order| {
                let mut w = Watermark::new(Checkpoint::TrimHorizon);
                let ids: Vec<u64> = (0..order.len())
                    .map(|i| w.register(Mark::At(at(i as u64 * 10 + 10)), false))
                    .collect();
                let mut done = vec![false; order.len()];
                for &i in &order {
                    w.ack(ids[i], 0);
                    done[i] = true;
                    let prefix = done.iter().take_while(|d| **d).count();
                    let expected = if prefix == 0 {
                        Checkpoint::TrimHorizon
                    } else {
                        Checkpoint::At(at(prefix as u64 * 10))
                    };
                    prop_assert_eq!(w.acked(), &expected);
                }
                Ok(())
            })
            .unwrap();
    }
}
