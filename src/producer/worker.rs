//! The background task behind every [`Producer`](super::Producer) handle: it takes
//! records from the channel the [gate](super::gate) feeds (which bounds each shard's
//! records), keeps them in one ready queue per shard, groups them into PutRecords calls,
//! answers each caller (giving its shard's room back), and resends only what failed.
//!
//! Where a record can be, while the task holds it:
//!
//! ```text
//!   gate ──> channel ──> blocked[key] ──(key free)──> ready[shard] ──launch──> in flight ──stored──> answered
//!               │        (ordered mode)                    ▲                       │
//!               └───────────────(unordered)────────────────┤                       │ failed, attempts left
//!                                                          └──(backoff over)── retries
//! ```
//!
//! In ordered mode a partition key is *owned* by at most one record at a time: the one
//! that is ready, in flight or waiting for a resend. Later records of that key wait in
//! `blocked` until the owner is answered, so neither two records of one key in the same
//! call (PutRecords does not promise their order, and a partial failure could store
//! the second but not the first) nor a resend overtaking a later record can reorder a
//! key.

use std::cmp::Reverse;
use std::collections::hash_map::Entry as MapEntry;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::aggregation::{Aggregator, Fit};
use crate::backoff::Backoff;
use crate::kinesis::{KinesisError, PutOutcome, PutRecord, ShardInfo};
use crate::sequence::SequenceNumber;

use super::builder::Settings;
use super::gate::{Command, Gate, Line, Reply};
use super::record::{entry_error_is_transient, ProduceError, Stored};
use super::shards::{hash_key, RateLimit, ShardBudget, ShardMap};

/// How often the shard map is listed again even when nothing showed a reshard.
const SHARD_MAP_MAX_AGE: Duration = Duration::from_secs(60);

/// The least time between two listings of the shard map (ListShards allows 100 calls/s
/// per account).
const SHARD_MAP_MIN_INTERVAL: Duration = Duration::from_millis(100);

/// How long a ListShards call may take before it counts as failed: the first listing
/// holds every send (when aggregating or rate-limited), and a failed one lets records go
/// unaggregated and unlimited.
const LISTING_DEADLINE: Duration = Duration::from_secs(10);

/// The least wait for a shard's budget to refill, so that a call carries more than a
/// record or two.
const RATE_WAIT_MIN: Duration = Duration::from_millis(10);

/// The longest the producer waits for a budget before looking at its records again:
/// records of other shards that arrive meanwhile wait at most this long (a large record
/// may need most of a second of refill).
const RATE_WAIT_MAX: Duration = Duration::from_millis(50);

/// How long an aggregate that landed in a shard the map does not know waits for a
/// listing that knows it; then its records are sent again without knowing whether they
/// had to be.
const LANDED_WAIT_MAX: Duration = Duration::from_secs(2);

/// Times a record may land in a shard that does not own it before it fails.
const MAX_MISPLACED: u32 = 5;

/// Everything about a record except the record itself (which travels in the call).
struct Meta {
    id: u64,
    size: usize,
    /// Hash of the partition key (ordered mode only). Two keys that collide merely wait
    /// for each other: order is still kept.
    key: u64,
    /// Sends of the record that were refused or failed. A send again after its
    /// aggregate landed in a shard not owning it is not one (nothing refused it).
    attempts: u32,
    /// Times the record was sent again because its aggregate landed in a shard that
    /// does not own it.
    misplaced: u32,
    enqueued: Instant,
    epoch: u64,
    reply: Reply,
    /// The hash key Kinesis routes it by (computed once).
    hash: Option<u128>,
    /// The gate's line it is counted in.
    line: Line,
}

struct Entry {
    record: PutRecord,
    meta: Meta,
}

/// What one entry of a PutRecords call carries for its callers.
enum Part {
    /// A record sent as it is: the entry is the record, with the shard it was predicted
    /// to land in when the producer knows the map (rate limit without aggregation).
    Plain { meta: Meta, shard: Option<Arc<str>> },
    /// User records packed into the entry (one of them alone: sent as it is), in
    /// order, with the shard the entry was predicted to land in.
    Aggregate { shard: Arc<str>, users: Vec<Entry> },
}

impl Part {
    /// The user records of an entry that was not stored, to resend or fail one by one.
    fn into_entries(self, record: PutRecord) -> Vec<Entry> {
        match self {
            Part::Plain { meta, .. } => vec![Entry { record, meta }],
            Part::Aggregate { users, .. } => users,
        }
    }

    /// The shard the entry was predicted to land in, if the producer predicted one.
    fn predicted(&self) -> Option<&Arc<str>> {
        match self {
            Part::Plain { shard, .. } => shard.as_ref(),
            Part::Aggregate { shard, .. } => Some(shard),
        }
    }
}

/// Records resent and failed after one call.
#[derive(Default)]
struct Tally {
    resent: usize,
    failed: usize,
}

/// A finished PutRecords call, with the records it carried (moved, not copied).
struct Completed {
    records: Vec<PutRecord>,
    parts: Vec<Part>,
    result: Result<Vec<PutOutcome>, KinesisError>,
}

/// An aggregate stored in another shard than predicted, whose user records are not yet
/// known to belong there: it waits for a listing that knows the shard it landed in.
struct Landed {
    shard: String,
    sequence_number: SequenceNumber,
    users: Vec<Entry>,
    /// When its answer came.
    since: Instant,
}

/// An aggregate being filled for one shard while a call is put together.
struct Open {
    shard: Arc<str>,
    aggregator: Aggregator,
    users: Vec<Entry>,
}

/// Records that may go in the next call, in one queue per shard they are predicted to
/// land in (`None`: no map, or no shard known for them), each oldest (or longest
/// waiting) first. A call takes from the queues in the order of their fronts, and
/// passes over a whole queue whose shard is over its budget in one step: however long
/// one shard's queue, the records of the others are reached at once.
#[derive(Default)]
struct Ready {
    queues: HashMap<Line, VecDeque<Entry>>,
    len: usize,
    bytes: usize,
}

impl Ready {
    fn push_back(&mut self, queue: Line, entry: Entry) {
        self.len += 1;
        self.bytes += entry.meta.size;
        self.queues.entry(queue).or_default().push_back(entry);
    }

    fn push_front(&mut self, queue: Line, entry: Entry) {
        self.len += 1;
        self.bytes += entry.meta.size;
        self.queues.entry(queue).or_default().push_front(entry);
    }

    fn front(&self, queue: &Line) -> Option<&Entry> {
        self.queues.get(queue).and_then(VecDeque::front)
    }

    fn pop(&mut self, queue: &Line) -> Option<Entry> {
        let entries = self.queues.get_mut(queue)?;
        let entry = entries.pop_front()?;
        if entries.is_empty() {
            self.queues.remove(queue);
        }
        self.len -= 1;
        self.bytes -= entry.meta.size;
        Some(entry)
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// When the record that has waited longest among the queues' fronts arrived.
    fn oldest(&self) -> Option<Instant> {
        self.queues
            .values()
            .filter_map(|q| q.front().map(|e| e.meta.enqueued))
            .min()
    }

    /// The queues with their fronts' ids, lowest (oldest) first out of the heap.
    fn fronts(&self) -> BinaryHeap<Reverse<(u64, Line)>> {
        self.queues
            .iter()
            .filter_map(|(queue, q)| q.front().map(|e| Reverse((e.meta.id, queue.clone()))))
            .collect()
    }

    /// Puts every record in the queue `queue_of` names now (a new shard map), each
    /// queue in the order the records came.
    fn regroup(&mut self, queue_of: impl Fn(&Entry) -> Line) {
        let mut entries: Vec<Entry> = self.queues.drain().flat_map(|(_, q)| q).collect();
        entries.sort_by_key(|e| e.meta.id);
        self.len = 0;
        self.bytes = 0;
        for entry in entries {
            let queue = queue_of(&entry);
            self.push_back(queue, entry);
        }
    }
}

/// Counts unanswered records per flush epoch, so that a flush waits only for the
/// records that came before it, however they finish (retries answer out of order).
struct Epochs {
    /// The epoch of `counts[0]`.
    base: u64,
    /// Unanswered records of each epoch still open; never empty.
    counts: VecDeque<usize>,
}

impl Epochs {
    fn new() -> Self {
        Epochs {
            base: 0,
            counts: VecDeque::from([0]),
        }
    }

    /// Counts a new record in the current epoch, which it returns.
    fn add(&mut self) -> u64 {
        if let Some(last) = self.counts.back_mut() {
            *last += 1;
        }
        self.base + self.counts.len() as u64 - 1
    }

    /// Ends the current epoch (a flush waits for it) and returns it.
    fn seal(&mut self) -> u64 {
        let sealed = self.base + self.counts.len() as u64 - 1;
        self.counts.push_back(0);
        sealed
    }

    fn answered(&mut self, epoch: u64) {
        let index = epoch.saturating_sub(self.base) as usize;
        if let Some(count) = self.counts.get_mut(index) {
            *count = count.saturating_sub(1);
        }
    }

    /// Whether every record of `epoch` and of the epochs before it has been answered.
    fn settled(&mut self, epoch: u64) -> bool {
        while self.counts.len() > 1 && self.counts.front() == Some(&0) {
            self.counts.pop_front();
            self.base += 1;
        }
        epoch < self.base
    }
}

pub(crate) struct Worker {
    settings: Settings,
    rx: mpsc::UnboundedReceiver<Command>,
    /// Where records wait for room in their shard; told when one is answered.
    gate: Arc<Gate>,
    /// Records that may go in the next call.
    ready: Ready,
    /// Ordered mode: the keys that are owned, each with the records waiting behind
    /// its owner.
    blocked: HashMap<u64, VecDeque<Entry>>,
    /// Failed records waiting for their backoff to pass.
    retries: Vec<(Instant, Entry)>,
    in_flight: FuturesUnordered<BoxFuture<'static, Completed>>,
    /// Records taken from the channel and not answered yet.
    held: usize,
    next_id: u64,
    epochs: Epochs,
    flushes: VecDeque<(u64, oneshot::Sender<()>)>,
    closing: bool,
    /// The channel is closed and empty: every handle is gone.
    rx_done: bool,
    /// Whole calls failing in a row (throttled, service errors); sending pauses after
    /// each for a backoff that grows with the streak.
    call_failures: u32,
    paused_until: Option<Instant>,
    /// The resend delays, and the generator of their jitter.
    backoff: Backoff,
    /// Aggregation: the stream's shards as last listed, a listing under way, and
    /// whether a new one is wanted (a record outside every known range, an aggregate
    /// that landed in another shard than predicted).
    shard_map: Option<Arc<ShardMap>>,
    listing: Option<BoxFuture<'static, Result<Vec<ShardInfo>, KinesisError>>>,
    listing_wanted: bool,
    listed_at: Option<Instant>,
    /// The last listing failed and there is no map: records go unaggregated meanwhile.
    map_unavailable: bool,
    /// Listings failed in a row: the next waits longer (a producer without the
    /// `kinesis:ListShards` permission must not call and warn ten times a second).
    listing_failures: u32,
    /// Aggregates that landed in a shard the map does not know, waiting for a listing
    /// that tells whether that shard owns all their user records.
    awaiting_map: Vec<Landed>,
    /// The per-shard rate limit, each shard's budget, and when one refills enough for a
    /// record that waits (set when none could go).
    rate_limit: Option<RateLimit>,
    budgets: HashMap<Arc<str>, ShardBudget>,
    rate_wait: Option<Instant>,
}

impl Worker {
    pub(crate) fn new(
        settings: Settings,
        rx: mpsc::UnboundedReceiver<Command>,
        gate: Arc<Gate>,
    ) -> Self {
        let backoff = Backoff::new(settings.retry_min, settings.retry_max, settings.seed);
        let rate_limit = settings.rate_limit;
        Worker {
            settings,
            rx,
            gate,
            ready: Ready::default(),
            blocked: HashMap::new(),
            retries: Vec::new(),
            in_flight: FuturesUnordered::new(),
            held: 0,
            next_id: 0,
            epochs: Epochs::new(),
            flushes: VecDeque::new(),
            closing: false,
            rx_done: false,
            call_failures: 0,
            paused_until: None,
            backoff,
            shard_map: None,
            listing: None,
            listing_wanted: false,
            listed_at: None,
            map_unavailable: false,
            listing_failures: 0,
            awaiting_map: Vec::new(),
            rate_limit: rate_limit.map(RateLimit::percent),
            budgets: HashMap::new(),
            rate_wait: None,
        }
    }

    /// Runs until every handle is gone (or `Close` arrived) and every record taken has
    /// been answered; then marks `done`.
    pub(crate) async fn run(mut self, done: watch::Sender<bool>) {
        loop {
            let drained = self.drain_channel();
            let now = Instant::now();
            self.promote_retries(now);
            if !self.awaiting_map.is_empty() {
                self.place_landed(now);
            }
            self.list_shards_if_due(now);
            self.dispatch(now);
            self.answer_flushes();
            if self.held == 0 && (self.rx_done || (self.closing && drained)) {
                break;
            }
            let deadline = self.next_deadline(now);
            // The gate bounds what each shard has in the channel and here.
            let can_receive = !self.rx_done;
            tokio::select! {
                biased;
                // First: a busy producer would never come to it otherwise.
                listed = poll_listing(&mut self.listing), if self.listing.is_some() => {
                    self.listing = None;
                    self.listed(listed, Instant::now());
                }
                Some(completed) = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    self.complete(completed, Instant::now());
                }
                command = self.rx.recv(), if can_receive => match command {
                    Some(command) => self.handle(command, Instant::now()),
                    None => self.rx_done = true,
                },
                () = sleep_until(deadline), if deadline.is_some() => {}
                else => {
                    // Unreachable by the invariants above (something held is always
                    // in flight, timed or able to go); never spin or panic if not.
                    tracing::error!(stream = %self.settings.stream, held = self.held, "producer task has nothing to wait for");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        // Nothing more gets in (a handle still alive sees the producer closed).
        self.gate.close();
        // Everything taken was answered; a flush still waiting can only be one whose
        // records were all answered too.
        for (_, waiter) in self.flushes.drain(..) {
            let _ = waiter.send(());
        }
        tracing::debug!(stream = %self.settings.stream, "producer stopped");
        let _ = done.send(true);
    }

    /// Takes what the channel holds without waiting. Returns whether the channel was
    /// seen empty.
    fn drain_channel(&mut self) -> bool {
        let now = Instant::now();
        while !self.rx_done {
            match self.rx.try_recv() {
                Ok(command) => self.handle(command, now),
                Err(TryRecvError::Empty) => return true,
                Err(TryRecvError::Disconnected) => self.rx_done = true,
            }
        }
        self.rx_done
    }

    fn handle(&mut self, command: Command, now: Instant) {
        match command {
            Command::Record {
                record,
                size,
                reply,
                line,
            } => self.take(record, size, reply, line, now),
            Command::Records(records) => {
                for (record, size, reply, line) in records {
                    self.take(record, size, reply, line, now);
                }
            }
            Command::Flush(waiter) => {
                let epoch = self.epochs.seal();
                self.flushes.push_back((epoch, waiter));
            }
            Command::Close => {
                self.closing = true;
                // Handles now see the producer closed; what is in the channel is
                // still taken and written.
                self.rx.close();
            }
        }
    }

    /// Holds a new record: ready to go, or (ordered mode) behind its key's owner.
    fn take(&mut self, record: PutRecord, size: usize, reply: Reply, line: Line, now: Instant) {
        let key = self.gate.key_of(&record);
        let hash = hash_key(&record);
        // A new record may be of a shard with budget: look again.
        self.rate_wait = None;
        let entry = Entry {
            record,
            meta: Meta {
                id: self.next_id,
                size,
                key,
                attempts: 0,
                misplaced: 0,
                enqueued: now,
                epoch: self.epochs.add(),
                reply,
                hash,
                line,
            },
        };
        self.next_id += 1;
        self.held += 1;
        if self.settings.ordered_per_key {
            match self.blocked.entry(key) {
                MapEntry::Occupied(mut waiting) => waiting.get_mut().push_back(entry),
                MapEntry::Vacant(free) => {
                    free.insert(VecDeque::new());
                    self.push_ready(entry);
                }
            }
        } else {
            self.push_ready(entry);
        }
    }

    fn push_ready(&mut self, entry: Entry) {
        let queue = self.queue_of(&entry);
        self.ready.push_back(queue, entry);
    }

    /// The ready queue of a record: the shard the map predicts for it.
    fn queue_of(&self, entry: &Entry) -> Line {
        match (&self.shard_map, entry.meta.hash) {
            (Some(map), Some(hash)) if self.uses_shard_map() => {
                map.shard_of(hash).map(|(_, shard)| shard.clone())
            }
            _ => None,
        }
    }

    /// Send without waiting for the linger: someone waits for a flush or close.
    fn urgent(&self) -> bool {
        !self.flushes.is_empty() || self.closing || self.rx_done
    }

    fn promote_retries(&mut self, now: Instant) {
        if self.retries.is_empty() {
            return;
        }
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.retries.len() {
            if self.retries[i].0 <= now {
                due.push(self.retries.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        // Oldest first, ahead of everything newer.
        due.sort_unstable_by_key(|e| Reverse(e.meta.id));
        for entry in due {
            let queue = self.queue_of(&entry);
            self.ready.push_front(queue, entry);
        }
        self.rate_wait = None;
    }

    fn dispatch(&mut self, now: Instant) {
        if self.paused_until.is_some_and(|until| until > now) {
            return;
        }
        if self.uses_shard_map() && self.shard_map.is_none() && !self.map_unavailable {
            // The first listing is under way: its answer wakes the loop.
            return;
        }
        let urgent = self.urgent();
        let per_entry = if self.settings.aggregation.is_some() {
            100
        } else {
            1
        };
        while self.in_flight.len() < self.settings.max_in_flight {
            let Some(oldest) = self.ready.oldest() else {
                break;
            };
            let full = self.ready.len >= self.settings.max_batch_records * per_entry
                || self.ready.bytes >= self.settings.max_batch_bytes;
            let due = urgent || oldest + self.settings.linger <= now;
            if !(full || due) {
                break;
            }
            if self.rate_wait.is_some_and(|at| at > now) {
                // Every shard with records waiting is over its budget.
                break;
            }
            let calls = self.in_flight.len();
            self.launch(now);
            if self.in_flight.len() == calls {
                break;
            }
        }
    }

    /// Sends the next batch from the front of `ready`: at most `max_batch_records`
    /// records and `max_batch_bytes` bytes (a single larger record goes alone).
    fn launch(&mut self, now: Instant) {
        match (self.uses_shard_map(), &self.shard_map) {
            (true, Some(map)) => {
                let map = map.clone();
                self.launch_aggregated(&map, now);
            }
            _ => self.launch_plain(),
        }
    }

    /// Aggregation and the per-shard rate limit both need to know each record's shard.
    fn uses_shard_map(&self) -> bool {
        self.settings.aggregation.is_some() || self.rate_limit.is_some()
    }

    fn launch_plain(&mut self) {
        let limit = self.ready.len.min(self.settings.max_batch_records);
        let mut records = Vec::with_capacity(limit);
        let mut metas = Vec::with_capacity(limit);
        let mut bytes = 0usize;
        let mut fronts = self.ready.fronts();
        while records.len() < limit {
            let Some(Reverse((_, queue))) = fronts.pop() else {
                break;
            };
            let Some(front) = self.ready.front(&queue) else {
                continue;
            };
            if !records.is_empty() && bytes + front.meta.size > self.settings.max_batch_bytes {
                break;
            }
            let Some(Entry { record, meta }) = self.ready.pop(&queue) else {
                continue;
            };
            if let Some(next) = self.ready.front(&queue) {
                fronts.push(Reverse((next.meta.id, queue)));
            }
            bytes += meta.size;
            records.push(record);
            metas.push(Part::Plain { meta, shard: None });
        }
        self.put(records, metas);
    }

    /// Sends the next batch from the front of `ready`, each record predicted to land in
    /// a shard and, when aggregating, packed into an aggregate of that shard: at most
    /// `max_batch_records` entries and about `max_batch_bytes` bytes.
    ///
    /// With a rate limit, a record whose shard has no budget left stays in `ready` (in
    /// its place), and so do the later records of that shard (a large record is not
    /// starved by smaller ones taking each refill); the other shards' records go on.
    /// `rate_wait` is when a budget refills.
    fn launch_aggregated(&mut self, map: &ShardMap, now: Instant) {
        // Without aggregation (rate limit only), each record goes as it is.
        let (max_size, max_count) = match &self.settings.aggregation {
            Some(a) => (a.size_limit(), a.count_limit()),
            None => (crate::kinesis::MAX_RECORD_BYTES, 1),
        };
        let aggregating = self.settings.aggregation.is_some();
        // Shards over budget in this scan: their later records wait too.
        let mut waiting: HashSet<usize> = HashSet::new();
        let mut wake: Option<Instant> = None;
        let mut records = Vec::new();
        let mut parts = Vec::new();
        let mut open: HashMap<usize, Open> = HashMap::new();
        // Bytes of the finished entries, and of the open aggregates.
        let mut bytes = 0usize;
        let mut pending = 0usize;
        let mut fronts = self.ready.fronts();
        while let Some(Reverse((_, queue))) = fronts.pop() {
            let Some(front) = self.ready.front(&queue) else {
                continue;
            };
            let predicted = front
                .meta
                .hash
                .and_then(|h| map.shard_of(h))
                .map(|(index, shard)| (index, shard.clone()));
            // What the record adds to the call, exactly: a new entry or not, and the
            // bytes Kinesis counts (data plus partition key of each entry).
            let fit = match &predicted {
                Some((index, _)) if aggregating => Some(match open.get(index) {
                    // A full aggregate is finished first: the record starts the next.
                    Some(slot) if (slot.aggregator.len() as u64) < max_count => {
                        slot.aggregator.fit(&front.record)
                    }
                    _ => Aggregator::with_max_size(max_size).fit(&front.record),
                }),
                _ => None,
            };
            let (new_entry, added) = match fit {
                Some(Fit::Joins(size)) => {
                    let before = predicted
                        .as_ref()
                        .and_then(|(index, _)| open.get(index))
                        .map_or(0, |slot| slot.aggregator.wire_size());
                    (false, size.saturating_sub(before))
                }
                Some(Fit::StartsNext(size)) => (true, size),
                Some(Fit::Alone) | None => (true, front.meta.size),
            };
            let taken = records.len() + open.len() > 0;
            if taken
                && ((new_entry && records.len() + open.len() >= self.settings.max_batch_records)
                    || bytes + pending + added > self.settings.max_batch_bytes)
            {
                break;
            }
            if let (Some(limit), Some((index, shard))) = (&self.rate_limit, &predicted) {
                // A new Kinesis record costs one record of the budget; every user
                // record its bytes (with a little framing when aggregated).
                let cost_records = if new_entry { 1.0 } else { 0.0 };
                let cost_bytes = front.meta.size as f64;
                let over = waiting.contains(index) || {
                    let budget = self
                        .budgets
                        .entry(shard.clone())
                        .or_insert_with(|| ShardBudget::new(limit, now));
                    match budget.take(limit, cost_records, cost_bytes, now) {
                        Ok(()) => false,
                        Err(ready_at) => {
                            // Not sooner than a few milliseconds: a budget refills a
                            // record per millisecond, and a call should carry more.
                            let ready_at = ready_at.max(now + RATE_WAIT_MIN);
                            wake = Some(wake.map_or(ready_at, |w| w.min(ready_at)));
                            waiting.insert(*index);
                            true
                        }
                    }
                };
                if over {
                    // The record and the rest of its queue keep their place; the
                    // other queues go on.
                    continue;
                }
            }
            let Some(Entry { record, meta }) = self.ready.pop(&queue) else {
                continue;
            };
            if let Some(next) = self.ready.front(&queue) {
                fronts.push(Reverse((next.meta.id, queue)));
            }
            let Some((index, shard)) = predicted else {
                // Outside every known range: the map is stale. Sent alone, where
                // Kinesis routes it.
                self.listing_wanted = true;
                bytes += meta.size;
                records.push(record);
                parts.push(Part::Plain { meta, shard: None });
                continue;
            };
            if !aggregating {
                // As it is, whatever its payload (a record that is already a KPL
                // aggregate stays one).
                bytes += meta.size;
                records.push(record);
                parts.push(Part::Plain {
                    meta,
                    shard: Some(shard),
                });
                continue;
            }
            let slot = open.entry(index).or_insert_with(|| Open {
                shard: shard.clone(),
                aggregator: Aggregator::with_max_size(max_size),
                users: Vec::new(),
            });
            let before = slot.aggregator.wire_size();
            if slot.aggregator.len() as u64 >= max_count {
                if let Some(full) = slot.aggregator.flush() {
                    bytes += full.data.len() + full.partition_key.len();
                    records.push(full);
                    parts.push(Part::Aggregate {
                        shard: shard.clone(),
                        users: std::mem::take(&mut slot.users),
                    });
                }
            }
            let size = meta.size;
            match slot.aggregator.add(record.clone()) {
                Ok(finished) => {
                    if let Some(full) = finished {
                        bytes += full.data.len() + full.partition_key.len();
                        records.push(full);
                        parts.push(Part::Aggregate {
                            shard,
                            users: std::mem::take(&mut slot.users),
                        });
                    }
                    slot.users.push(Entry { record, meta });
                }
                Err(refused) => {
                    // Too large to share an aggregate (its own would pass the limit
                    // with the framing): alone, as it is (at most 1 MiB: validated).
                    bytes += size;
                    records.push(refused.into_record());
                    parts.push(Part::Plain {
                        meta,
                        shard: Some(shard),
                    });
                }
            }
            pending = pending.saturating_sub(before) + slot.aggregator.wire_size();
        }
        self.rate_wait = wake
            .map(|at| at.min(now + RATE_WAIT_MAX))
            .filter(|_| records.is_empty() && open.is_empty());
        for slot in open.into_values() {
            let Open {
                shard,
                mut aggregator,
                users,
            } = slot;
            if let Some(full) = aggregator.flush() {
                records.push(full);
                parts.push(Part::Aggregate { shard, users });
            }
        }
        self.put(records, parts);
    }

    fn put(&mut self, records: Vec<PutRecord>, parts: Vec<Part>) {
        if records.is_empty() {
            return;
        }
        let api = self.settings.kinesis.clone();
        let stream = self.settings.stream.clone();
        self.in_flight.push(Box::pin(async move {
            let result = api.put_records(&stream, &records).await;
            Completed {
                records,
                parts,
                result,
            }
        }));
    }

    /// The least time between two listings: [`SHARD_MAP_MIN_INTERVAL`], doubled for
    /// each listing failed in a row, at most [`SHARD_MAP_MAX_AGE`].
    fn listing_interval(&self) -> Duration {
        SHARD_MAP_MIN_INTERVAL
            .saturating_mul(1 << self.listing_failures.min(10))
            .min(SHARD_MAP_MAX_AGE)
    }

    /// Starts listing the shards when aggregating and the map is missing, stale, or
    /// shown wrong (at most once per [`SHARD_MAP_MIN_INTERVAL`]).
    fn list_shards_if_due(&mut self, now: Instant) {
        if !self.uses_shard_map() || self.listing.is_some() {
            return;
        }
        let due = match &self.shard_map {
            None => true,
            Some(map) => self.listing_wanted || map.fetched + SHARD_MAP_MAX_AGE <= now,
        };
        let too_soon = self
            .listed_at
            .is_some_and(|at| now < at + self.listing_interval());
        if !due || too_soon {
            return;
        }
        self.listed_at = Some(now);
        self.listing_wanted = false;
        let api = self.settings.kinesis.clone();
        let stream = self.settings.stream.clone();
        self.listing = Some(Box::pin(async move {
            match tokio::time::timeout(LISTING_DEADLINE, api.list_shards(&stream)).await {
                Ok(listed) => listed,
                Err(_) => Err(KinesisError::Other(
                    format!("ListShards did not answer within {LISTING_DEADLINE:?}").into(),
                )),
            }
        }));
    }

    fn listed(&mut self, listed: Result<Vec<ShardInfo>, KinesisError>, now: Instant) {
        match listed {
            Ok(shards) => {
                let map = ShardMap::new(&shards, now);
                tracing::debug!(stream = %self.settings.stream, shards = map.len(), "shard map listed");
                // Closed shards take no more writes: their budgets go.
                self.budgets.retain(|shard, _| map.is_open(shard));
                let map = Arc::new(map);
                self.gate.set_map(map.clone());
                self.shard_map = Some(map);
                // Each record to the queue of the shard the new map predicts.
                if !self.ready.is_empty() {
                    let ready = std::mem::take(&mut self.ready);
                    let mut regrouped = ready;
                    regrouped.regroup(|entry| self.queue_of(entry));
                    self.ready = regrouped;
                }
                self.map_unavailable = false;
                self.listing_failures = 0;
            }
            Err(error) => {
                // Records go unaggregated until a listing works (never wait on it); the
                // first failure in a row is worth a warning, the retries are not.
                self.listing_failures = self.listing_failures.saturating_add(1);
                if self.listing_failures == 1 {
                    tracing::warn!(stream = %self.settings.stream, %error, "ListShards failed; sending records unaggregated (and not rate-limited) until it works");
                } else {
                    tracing::debug!(stream = %self.settings.stream, %error, failures = self.listing_failures, "ListShards failed again");
                }
                self.map_unavailable = self.shard_map.is_none();
                self.listing_wanted = true;
            }
        }
        self.place_landed(now);
    }

    /// Decides, for each aggregate waiting for a map that knows where it landed, whether
    /// its records are stored for good (every one owned by that shard) or go again.
    /// After [`LANDED_WAIT_MAX`] without such a map they go again (duplicates at worst,
    /// never a record only a lenient reader has): a ListShards that keeps failing must
    /// not hold them, and a `flush` or `close` waiting for them, for ever.
    fn place_landed(&mut self, now: Instant) {
        for landed in std::mem::take(&mut self.awaiting_map) {
            match self.placement(&landed.users, &landed.shard) {
                Some(true) => {
                    self.answer_stored(landed.users, &landed.shard, &landed.sequence_number)
                }
                Some(false) => {
                    self.send_again(landed.users, &landed.shard, &landed.sequence_number, now)
                }
                None => {
                    if now >= landed.since + LANDED_WAIT_MAX {
                        self.send_again(landed.users, &landed.shard, &landed.sequence_number, now);
                    } else {
                        self.listing_wanted = true;
                        self.awaiting_map.push(landed);
                    }
                }
            }
        }
    }

    fn complete(&mut self, completed: Completed, now: Instant) {
        let Completed {
            records,
            parts,
            result,
        } = completed;
        // One jitter draw per call keeps the records that failed together together.
        let jitter = self.backoff.draw();
        let outcomes = match result {
            Ok(outcomes) if outcomes.len() == records.len() => outcomes,
            Ok(outcomes) => {
                let error = KinesisError::Other(
                    format!(
                        "PutRecords sent {} records, the answer has {} results",
                        records.len(),
                        outcomes.len()
                    )
                    .into(),
                );
                return self.call_failed(records, parts, error, jitter, now);
            }
            Err(error) => return self.call_failed(records, parts, error, jitter, now),
        };
        self.call_failures = 0;
        let mut tally = Tally::default();
        for ((record, part), outcome) in records.into_iter().zip(parts).zip(outcomes) {
            match outcome {
                PutOutcome::Stored {
                    shard_id,
                    sequence_number,
                } => match part {
                    Part::Plain { meta, shard } => {
                        if shard.is_some_and(|s| *s != *shard_id) {
                            // Landed elsewhere than predicted: the stream was resharded,
                            // and the rate limit charges the wrong shard until relisted.
                            self.want_listing_for(&shard_id);
                        }
                        self.answer(
                            meta,
                            Ok(Stored {
                                shard_id,
                                sequence_number,
                                sub_sequence_number: 0,
                            }),
                        )
                    }
                    Part::Aggregate { shard, users } => {
                        if *shard != *shard_id {
                            // Landed elsewhere than predicted: the stream was resharded.
                            self.want_listing_for(&shard_id);
                            // A lone user record is sent as it is: Kinesis routed it by
                            // its own key. Several may include some of another shard,
                            // and a KCL reader discards such an aggregate whole.
                            if users.len() > 1 {
                                match self.placement(&users, &shard_id) {
                                    Some(true) => {}
                                    Some(false) => {
                                        self.send_again(users, &shard_id, &sequence_number, now);
                                        continue;
                                    }
                                    None => {
                                        self.awaiting_map.push(Landed {
                                            shard: shard_id,
                                            sequence_number,
                                            users,
                                            since: now,
                                        });
                                        continue;
                                    }
                                }
                            }
                        }
                        self.answer_stored(users, &shard_id, &sequence_number);
                    }
                },
                PutOutcome::Failed { code, message } => {
                    let transient = entry_error_is_transient(&code);
                    if let (Some(limit), Some(shard)) = (&self.rate_limit, part.predicted()) {
                        if code == "ProvisionedThroughputExceededException" {
                            // The shard is busier than its budget said: it waits, the
                            // others go on.
                            if let Some(budget) = self.budgets.get_mut(shard) {
                                budget.drain(limit, now);
                            }
                        }
                    }
                    for entry in part.into_entries(record) {
                        self.not_stored(entry, transient, &code, &message, jitter, now, &mut tally);
                    }
                }
            }
        }
        if tally.resent > 0 {
            tracing::debug!(stream = %self.settings.stream, resent = tally.resent, "PutRecords partial failure; resending the failed entries");
        }
        if tally.failed > 0 {
            tracing::warn!(stream = %self.settings.stream, failed = tally.failed, "records not stored: out of attempts or a permanent entry error");
        }
    }

    /// Asks for a listing when the map does not know `landed`, a shard an entry landed in
    /// instead of the one predicted.
    fn want_listing_for(&mut self, landed: &str) {
        if self.shard_map.as_ref().is_none_or(|m| !m.knows(landed)) {
            self.listing_wanted = true;
        }
    }

    /// Answers the user records of an aggregate stored at `sequence_number` in `shard`
    /// (a lone one was sent as it is: sub-sequence 0 too).
    fn answer_stored(&mut self, users: Vec<Entry>, shard: &str, sequence_number: &SequenceNumber) {
        for (sub, entry) in (0u64..).zip(users) {
            self.answer(
                entry.meta,
                Ok(Stored {
                    shard_id: shard.to_owned(),
                    sequence_number: sequence_number.clone(),
                    sub_sequence_number: sub,
                }),
            );
        }
    }

    /// Whether every user record of an aggregate that landed in `landed` belongs to that
    /// shard's hash-key range; `None` while the map does not know `landed`.
    fn placement(&self, users: &[Entry], landed: &str) -> Option<bool> {
        let (start, end) = self.shard_map.as_ref()?.range_of(landed)?;
        Some(
            users
                .iter()
                .all(|u| hash_key(&u.record).is_some_and(|h| start <= h && h <= end)),
        )
    }

    /// The user records of an aggregate that landed in a shard not owning all of them
    /// (which a KCL reader discards whole) go again, each packed for its own shard by
    /// the current map; their key stays owned meanwhile (ordered mode). This is not an
    /// attempt (nothing refused them), but a record misplaced [`MAX_MISPLACED`] times
    /// fails: it is stored only where a KCL reader discards it.
    fn send_again(
        &mut self,
        users: Vec<Entry>,
        landed: &str,
        sequence_number: &SequenceNumber,
        now: Instant,
    ) {
        tracing::debug!(stream = %self.settings.stream, shard = %landed, sequence = %sequence_number, records = users.len(), "an aggregate landed in a shard that does not own all its records (a reshard); sending them again");
        for mut entry in users {
            entry.meta.misplaced += 1;
            if entry.meta.misplaced >= MAX_MISPLACED {
                let attempts = entry.meta.attempts;
                self.answer(
                    entry.meta,
                    Err(ProduceError::Failed {
                        code: "MisplacedAggregate".to_owned(),
                        message: format!(
                            "stored in {landed} at {sequence_number} inside an aggregate with records of another shard, which a KCL consumer discards; landed outside its shard {MAX_MISPLACED} times"
                        ),
                        attempts,
                    }),
                );
            } else {
                self.retries.push((now, entry));
            }
        }
    }

    /// A record that was not stored: back for a resend after its backoff if the error
    /// passes with time and it has attempts left, else answered with the error.
    #[allow(clippy::too_many_arguments)]
    fn not_stored(
        &mut self,
        mut entry: Entry,
        transient: bool,
        code: &str,
        message: &str,
        jitter: f64,
        now: Instant,
        tally: &mut Tally,
    ) {
        entry.meta.attempts += 1;
        if transient && entry.meta.attempts < self.settings.max_attempts {
            tally.resent += 1;
            let delay = self.backoff(entry.meta.attempts, jitter);
            self.retries.push((now + delay, entry));
        } else {
            tally.failed += 1;
            let attempts = entry.meta.attempts;
            self.answer(
                entry.meta,
                Err(ProduceError::Failed {
                    code: code.to_owned(),
                    message: message.to_owned(),
                    attempts,
                }),
            );
        }
    }

    /// The whole call failed: resend every record (if the error is transient and it
    /// has attempts left) after a pause of all sending, or fail them.
    fn call_failed(
        &mut self,
        records: Vec<PutRecord>,
        parts: Vec<Part>,
        error: KinesisError,
        jitter: f64,
        now: Instant,
    ) {
        let retryable = error.is_transient();
        if retryable {
            self.call_failures = self.call_failures.saturating_add(1);
            let pause = self.backoff(self.call_failures, jitter);
            self.paused_until = Some(now + pause);
            tracing::debug!(stream = %self.settings.stream, records = records.len(), ?pause, %error, "PutRecords failed; pausing, then resending the batch");
        } else {
            tracing::warn!(stream = %self.settings.stream, records = records.len(), %error, "PutRecords refused; failing the batch");
        }
        let code = call_error_code(&error);
        let message = error.to_string();
        let mut tally = Tally::default();
        for (record, part) in records.into_iter().zip(parts) {
            for entry in part.into_entries(record) {
                self.not_stored(entry, retryable, code, &message, jitter, now, &mut tally);
            }
        }
    }

    /// Tells the caller, and lets the next record of the key go (ordered mode). When
    /// the record finally failed, the records of its key waiting behind it fail too,
    /// unsent ([`ProduceError::AfterFailure`]): sent now, they would be stored ahead of
    /// the failed one if it is written again (a redelivered input), and a key's order
    /// would break.
    fn answer(&mut self, meta: Meta, result: Result<Stored, ProduceError>) {
        let failure = match (&result, self.settings.ordered_per_key) {
            (Err(error), true) => Some(error.clone()),
            _ => None,
        };
        // A caller that stopped waiting is not an error.
        let _ = meta.reply.send(result);
        self.held = self.held.saturating_sub(1);
        self.epochs.answered(meta.epoch);
        self.gate.release(&meta.line);
        if !self.settings.ordered_per_key {
            return;
        }
        if let Some(cause) = failure {
            if let Some(waiting) = self.blocked.remove(&meta.key) {
                if !waiting.is_empty() {
                    tracing::warn!(stream = %self.settings.stream, unsent = waiting.len(), "a record finally failed: failing the records of its key behind it");
                }
                let after = Box::new(cause.clone());
                for entry in waiting {
                    let _ = entry
                        .meta
                        .reply
                        .send(Err(ProduceError::AfterFailure(after.clone())));
                    self.held = self.held.saturating_sub(1);
                    self.epochs.answered(entry.meta.epoch);
                    self.gate.release(&entry.meta.line);
                }
            }
            // And those still waiting for room in the gate.
            self.gate.fail_key(meta.key, &cause);
            return;
        }
        if let MapEntry::Occupied(mut waiting) = self.blocked.entry(meta.key) {
            match waiting.get_mut().pop_front() {
                Some(next) => self.push_ready(next),
                None => {
                    waiting.remove();
                }
            }
        }
    }

    fn answer_flushes(&mut self) {
        while let Some((epoch, _)) = self.flushes.front() {
            if !self.epochs.settled(*epoch) {
                break;
            }
            if let Some((_, waiter)) = self.flushes.pop_front() {
                let _ = waiter.send(());
            }
        }
    }

    /// The delay before attempt `attempts + 1`: `min × 2^(attempts-1)`, capped at
    /// `max`, scaled into `[d/2, d]` by `jitter` (in `[0, 1)`).
    fn backoff(&self, attempts: u32, jitter: f64) -> Duration {
        self.backoff.delay(attempts.saturating_sub(1), jitter)
    }

    /// When the loop must wake up without any other event: a linger running out, a
    /// pause ending, a backoff passing.
    fn next_deadline(&self, now: Instant) -> Option<Instant> {
        let mut next: Option<Instant> = None;
        let mut consider = |t: Instant| {
            if t > now && next.is_none_or(|n| t < n) {
                next = Some(t);
            }
        };
        if let Some(until) = self.paused_until {
            consider(until);
        }
        if self.in_flight.len() < self.settings.max_in_flight {
            if let Some(oldest) = self.ready.oldest() {
                consider(oldest + self.settings.linger);
            }
        }
        for (at, _) in &self.retries {
            consider(*at);
        }
        for landed in &self.awaiting_map {
            consider(landed.since + LANDED_WAIT_MAX);
        }
        if let Some(at) = self.rate_wait {
            consider(at);
        }
        if self.uses_shard_map() && self.listing.is_none() {
            // A listing wanted but too soon after the last one.
            if let (true, Some(at)) = (self.listing_wanted || self.map_unavailable, self.listed_at)
            {
                consider(at + self.listing_interval());
            }
        }
        next
    }
}

/// The listing under way's answer (never ready without one).
async fn poll_listing(
    listing: &mut Option<BoxFuture<'static, Result<Vec<ShardInfo>, KinesisError>>>,
) -> Result<Vec<ShardInfo>, KinesisError> {
    match listing {
        Some(listing) => listing.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    if let Some(deadline) = deadline {
        tokio::time::sleep_until(deadline).await;
    }
}

/// The `code` of [`ProduceError::Failed`] when the whole call failed.
pub(super) fn call_error_code(error: &KinesisError) -> &'static str {
    match error {
        KinesisError::Throttled(_) => "Throttled",
        KinesisError::ExpiredIterator(_) => "ExpiredIterator",
        KinesisError::NotFound(_) => "NotFound",
        KinesisError::Invalid(_) => "Invalid",
        KinesisError::FutureTimestamp(_) => "FutureTimestamp",
        KinesisError::Unsupported(_) => "Unsupported",
        KinesisError::Other(_) => "ServiceError",
        KinesisError::AccessDenied(_) => "AccessDenied",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flush_waits_only_for_earlier_records() {
        let mut epochs = Epochs::new();
        let a = epochs.add();
        let b = epochs.add();
        let flush = epochs.seal();
        let c = epochs.add();
        assert!(!epochs.settled(flush));
        epochs.answered(c);
        epochs.answered(b);
        assert!(!epochs.settled(flush));
        epochs.answered(a);
        assert!(epochs.settled(flush));
    }

    #[test]
    fn an_empty_flush_is_settled_at_once() {
        let mut epochs = Epochs::new();
        let flush = epochs.seal();
        assert!(epochs.settled(flush));
        let later = epochs.add();
        let second = epochs.seal();
        assert!(!epochs.settled(second));
        epochs.answered(later);
        assert!(epochs.settled(second));
    }

    #[test]
    fn kms_errors_other_than_throttling_are_permanent() {
        assert!(entry_error_is_transient(
            "ProvisionedThroughputExceededException"
        ));
        assert!(entry_error_is_transient("InternalFailure"));
        assert!(entry_error_is_transient("KMSThrottlingException"));
        assert!(!entry_error_is_transient("KMSAccessDeniedException"));
        assert!(!entry_error_is_transient("KMSDisabledException"));
    }
}
