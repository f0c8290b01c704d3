//! Hands a shard's batches to the user's service in `run` mode: record by record (in
//! sequence order, each awaited), records concurrently (per partition key or unordered,
//! see [`Concurrency`](crate::consumer::Concurrency)), or batch by batch, turning the outcome into
//! acknowledgements. Every call starts only on a lease proven fresh right before it
//! (see [`AckHandle::lease_held_for_call`]): a process paused mid-batch resumes without
//! handling another record of a lease it may have lost.

use std::collections::{HashMap, VecDeque};
use std::fmt::Display;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::Arc;

use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::{FutureExt, StreamExt};
use tokio::sync::{mpsc, Semaphore};
use tower::{Service, ServiceExt};

use super::ack::RecordMarks;
use crate::consumer::events::{EventHook, ShardEvent};
use crate::message::{AckHandle, Batch, Message};
use crate::sequence::Position;

/// Starts the task that hands one shard's batches to the user's service.
pub(crate) type SpawnDispatch =
    Arc<dyn Fn(mpsc::Receiver<Batch>) -> tokio::task::JoinHandle<()> + Send + Sync>;

/// Where shard tasks deliver batches (shared by the streams of a multi-stream consumer).
#[derive(Clone)]
pub(crate) enum Sink {
    /// `run` mode: a channel and a dispatch task per shard.
    PerShard(SpawnDispatch),
    /// `stream` mode: one channel the user's stream reads.
    Shared(mpsc::Sender<Batch>),
}

/// Calls `service` for every message of every batch, in order. A batch is acknowledged
/// when all its messages succeeded; on the first error the handled prefix is
/// acknowledged, the rest given up, and the shard restarts from its checkpoint.
pub(crate) async fn records<S>(
    mut batches: mpsc::Receiver<Batch>,
    mut service: S,
    events: EventHook,
) where
    S: Service<Message>,
    S::Error: Display + Send,
{
    while let Some(mut batch) = batches.recv().await {
        let Some(ack) = batch.take_ack() else {
            continue;
        };
        if !ack.wait_start().await {
            ack.abandon();
            continue;
        }
        let mut handled = None;
        let mut outcome = Ok(());
        for message in batch.messages {
            if !ack.should_start() {
                outcome = Err(None);
                break;
            }
            let position = message.position();
            let result = match service.ready().await {
                Ok(ready) => {
                    // Checked once the service is ready, right before the call: waiting
                    // for readiness may have taken long.
                    if !ack.lease_held_for_call().await || !ack.should_start() {
                        outcome = Err(None);
                        break;
                    }
                    ready.call(message).await
                }
                Err(e) => Err(e),
            };
            match result {
                Ok(_) => {
                    ack.record_handled();
                    handled = Some(position);
                }
                Err(e) => {
                    outcome = Err(Some((position, e.to_string())));
                    break;
                }
            }
        }
        match outcome {
            Ok(()) => ack.ack(),
            Err(failure) => {
                if let Some(position) = handled {
                    ack.ack_through(position);
                }
                ack.abandon();
                if let Some((position, error)) = failure {
                    tracing::warn!(shard = %batch.shard_id, sequence = %position, %error, "handler failed; the shard restarts from its checkpoint");
                    ack.nack_because(&error);
                    events.emit(|| ShardEvent::HandlerFailed {
                        shard: events.shard_name(&batch.stream, &batch.shard_id),
                        sequence_number: Some(position.sequence.clone()),
                        error,
                    });
                }
            }
        }
    }
}

/// Calls `service` once per batch; `Ok` acknowledges the whole batch, an error gives it
/// up. The batch keeps (a clone of) its acknowledgement handle, so the handler's own
/// `ack` (earlier than its return) and `nack` (give up, redeliver) mean what they say;
/// `Ok` after a `nack` does not acknowledge (a given-up batch stays given up).
pub(crate) async fn batches<S>(
    mut batches: mpsc::Receiver<Batch>,
    mut service: S,
    events: EventHook,
) where
    S: Service<Batch>,
    S::Error: Display + Send,
{
    while let Some(mut batch) = batches.recv().await {
        let Some(ack) = batch.take_ack() else {
            continue;
        };
        if !ack.wait_start().await {
            ack.abandon();
            continue;
        }
        let shard = events.shard_name(&batch.stream, &batch.shard_id);
        batch.ack = Some(ack.clone());
        let result = match service.ready().await {
            // The batch is the unit of a batch handler: the lease is checked once the
            // service is ready, right before the call.
            Ok(ready) => {
                if !ack.lease_held_for_call().await || !ack.should_start() {
                    ack.abandon();
                    continue;
                }
                ready.call(batch).await
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(_) => ack.ack(),
            Err(error) => {
                tracing::warn!(%shard, %error, "batch handler failed; the shard restarts from its checkpoint");
                let error = error.to_string();
                ack.abandon();
                ack.nack_because(&error);
                events.emit(|| ShardEvent::HandlerFailed {
                    shard: shard.to_string(),
                    sequence_number: None,
                    error,
                });
            }
        }
    }
}

/// The limits of concurrent dispatch (see [`Concurrency`](crate::consumer::Concurrency)).
#[derive(Clone, Debug)]
pub(crate) struct Limits {
    /// Calls in flight per shard.
    pub(crate) per_shard: usize,
    /// Records of one partition key one at a time, in sequence order.
    pub(crate) per_key: bool,
    /// Calls in flight over every shard of the worker.
    pub(crate) worker: Arc<Semaphore>,
}

/// Records of a shard's batches not fully handled, per call allowed in flight: a shard
/// takes a new batch only while its open batches hold fewer. This bounds how far it
/// works past its checkpoint (memory, and what a failure or crash delivers again) when
/// a key is hot or a record takes long.
const OPEN_RECORDS_PER_CALL: usize = 4;

/// Hashes the key-queue map's keys, which are hashes already (or counters): one multiply
/// spreads them; hashing them again with SipHash was a tenth of the concurrent path's
/// cost per record.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A batch taken for concurrent dispatch and not fully handled.
struct OpenBatch {
    ack: AckHandle,
    marks: RecordMarks,
    /// Its handled prefix grew since it was last acknowledged.
    moved: bool,
}

/// A record taken from a batch, waiting for its key (or a free place) to start.
struct Waiting {
    batch: u64,
    index: usize,
    message: Message,
}

/// The records of one partition key (or, unordered, of one record) taken and not
/// finished: whether one is in flight, and those waiting behind it in sequence order.
#[derive(Default)]
struct KeyQueue {
    running: bool,
    waiting: VecDeque<Waiting>,
}

enum Outcome {
    Handled,
    Failed(String),
    /// Not called: the shard stopped accepting work before the call could start.
    NotStarted,
}

struct Finished {
    batch: u64,
    index: usize,
    key: u64,
    outcome: Outcome,
}

/// Why a shard stopped starting records: a failure (then the shard reads again from its
/// watermark), a restart or a lost lease.
struct Halt {
    failure: Option<(AckHandle, Option<Position>, String)>,
}

/// The state of one shard's concurrent dispatch.
struct Window {
    limits: Limits,
    /// Open batches by id; `first` is the id of `open[0]`.
    open: VecDeque<OpenBatch>,
    first: u64,
    /// How many records the open batches hold.
    open_records: usize,
    /// The batch records are being taken from: its id and the records not taken yet.
    current: Option<(u64, std::iter::Enumerate<std::vec::IntoIter<Message>>)>,
    keys: HashMap<u64, KeyQueue, BuildHasherDefault<KeyHasher>>,
    /// Keys with a waiting record and none in flight, in the order they became so.
    runnable: VecDeque<u64>,
    taken: usize,
    next_key: u64,
    halt: Option<Halt>,
    /// The shard drains (shutdown, hand-off): nothing more is taken, but the records
    /// already taken are finished, so the watermark reaches the last of them and the
    /// next owner gets no duplicates.
    draining: bool,
}

impl Window {
    fn new(limits: Limits) -> Self {
        Window {
            limits,
            open: VecDeque::new(),
            first: 0,
            open_records: 0,
            current: None,
            keys: HashMap::default(),
            runnable: VecDeque::new(),
            taken: 0,
            next_key: 0,
            halt: None,
            draining: false,
        }
    }

    fn window(&self) -> usize {
        self.limits.per_shard.saturating_mul(OPEN_RECORDS_PER_CALL)
    }

    /// Whether a new batch may be taken.
    fn wants_batch(&self) -> bool {
        self.current.is_none()
            && self.halt.is_none()
            && !self.draining
            && self.open_records < self.window()
    }

    /// Whether the window is done: halted (or drained) with nothing in flight.
    fn settled(&self, in_flight: usize) -> bool {
        in_flight == 0 && (self.halt.is_some() || (self.draining && self.taken == 0))
    }

    /// Where batch `id` is in `open`, while it is open.
    fn slot(&self, id: u64) -> Option<usize> {
        usize::try_from(id.checked_sub(self.first)?).ok()
    }

    /// Takes a batch that may start.
    fn push_batch(&mut self, batch: Batch, ack: AckHandle) {
        if batch.messages.is_empty() {
            ack.ack();
            return;
        }
        let positions = batch.messages.iter().map(Message::position).collect();
        let id = self.first + self.open.len() as u64;
        self.open_records += batch.messages.len();
        self.open.push_back(OpenBatch {
            ack,
            marks: RecordMarks::new(positions),
            moved: false,
        });
        self.current = Some((id, batch.messages.into_iter().enumerate()));
    }

    /// Moves records from the current batch into their key queues while there is room.
    fn take(&mut self) {
        if let Some(ack) = self.open.back().map(|b| &b.ack) {
            if !ack.should_start() {
                self.draining = true;
            }
        }
        if self.halt.is_some() || self.draining {
            return;
        }
        let window = self.window();
        while self.taken < window {
            let Some((batch, records)) = self.current.as_mut() else {
                return;
            };
            let batch = *batch;
            let Some((index, message)) = records.next() else {
                self.current = None;
                return;
            };
            let key = if self.limits.per_key {
                let mut hasher = std::collections::hash_map::DefaultHasher::new();
                message.metadata.partition_key.hash(&mut hasher);
                // Two keys with one hash are merely handled one after the other.
                hasher.finish()
            } else {
                self.next_key = self.next_key.wrapping_add(1);
                self.next_key
            };
            let queue = self.keys.entry(key).or_default();
            if !queue.running && queue.waiting.is_empty() {
                self.runnable.push_back(key);
            }
            queue.waiting.push_back(Waiting {
                batch,
                index,
                message,
            });
            self.taken += 1;
        }
    }

    /// The next record that may start, its key, and its batch's handle; `None` when
    /// nothing may (or the shard stopped accepting: then the window halts).
    fn next_start(&mut self) -> Option<(Waiting, u64, AckHandle)> {
        if self.halt.is_some() {
            return None;
        }
        let key = self.runnable.pop_front()?;
        let queue = self.keys.get_mut(&key)?;
        let waiting = queue.waiting.pop_front()?;
        queue.running = true;
        let slot = self.slot(waiting.batch)?;
        let ack = self.open.get(slot)?.ack.clone();
        if !may_call(&ack, &waiting.message) {
            // A restart or a lost lease: nothing more starts; what was taken is given up
            // once the calls in flight finished.
            self.halt = Some(Halt { failure: None });
            return None;
        }
        if !ack.should_start() {
            self.draining = true;
        }
        Some((waiting, key, ack))
    }

    /// Books a finished call: the key's next record becomes runnable, and the batch's
    /// handled prefix is acknowledged.
    fn finish(&mut self, done: Finished) {
        self.taken = self.taken.saturating_sub(1);
        if let Some(queue) = self.keys.get_mut(&done.key) {
            queue.running = false;
            if queue.waiting.is_empty() {
                self.keys.remove(&done.key);
            } else {
                self.runnable.push_back(done.key);
            }
        }
        let Some(open) = self.slot(done.batch).and_then(|i| self.open.get_mut(i)) else {
            return;
        };
        match done.outcome {
            Outcome::Handled => {
                if open.marks.finish(done.index) {
                    open.moved = true;
                }
            }
            Outcome::Failed(error) => {
                if self.halt.as_ref().is_none_or(|h| h.failure.is_none()) {
                    let position = open.marks.position(done.index).cloned();
                    self.halt = Some(Halt {
                        failure: Some((open.ack.clone(), position, error)),
                    });
                }
            }
            Outcome::NotStarted => {
                self.halt.get_or_insert(Halt { failure: None });
            }
        }
    }

    /// Acknowledges the handled prefix of every batch whose prefix grew: once per
    /// batch for all the calls that finished together, not once per record (each
    /// acknowledgement wakes the shard task).
    fn flush(&mut self) {
        for open in self.open.iter_mut().filter(|b| b.moved) {
            open.moved = false;
            if open.marks.is_complete() {
                open.ack.ack();
            } else if let Some(position) = open.marks.handled_through() {
                open.ack.ack_through(position.clone());
            }
        }
        while self.open.front().is_some_and(|b| b.marks.is_complete()) {
            if let Some(done) = self.open.pop_front() {
                self.open_records = self.open_records.saturating_sub(done.marks.len());
            }
            self.first += 1;
        }
    }

    /// Once the calls in flight finished after a halt: gives up every batch not fully
    /// handled (their handled prefixes are already acknowledged) and, after a failure,
    /// makes the shard read again from its watermark.
    fn settle(&mut self, shard: &str, events: &EventHook) {
        self.flush();
        let halt = self.halt.take().unwrap_or(Halt { failure: None });
        self.first += self.open.len() as u64;
        self.open_records = 0;
        for open in self.open.drain(..) {
            open.ack.abandon();
        }
        self.current = None;
        self.keys.clear();
        self.runnable.clear();
        self.taken = 0;
        self.draining = false;
        if let Some((ack, position, error)) = halt.failure {
            let sequence = position.as_ref().map(|p| p.to_string()).unwrap_or_default();
            tracing::warn!(%shard, %sequence, %error, "handler failed; the shard restarts from its checkpoint");
            ack.nack_because(&error);
            events.emit(|| ShardEvent::HandlerFailed {
                shard: shard.to_owned(),
                sequence_number: position.map(|p| p.sequence.clone()),
                error,
            });
        }
    }
}

/// Calls `service` concurrently for the records of a shard (see
/// [`Concurrency`](crate::consumer::Concurrency)): per partition key in sequence order when
/// `limits.per_key`, at most `limits.per_shard` calls in flight, each holding a place of
/// the worker-wide `limits.worker`. Each batch's handled prefix is acknowledged as it
/// grows; on the first failure nothing new starts, the calls in flight finish, and the
/// batches not fully handled are given up and the shard restarts from its watermark. A
/// drain takes nothing new but finishes the records already taken.
pub(crate) async fn concurrent<S>(
    mut batches: mpsc::Receiver<Batch>,
    service: S,
    limits: Limits,
    events: EventHook,
) where
    S: Service<Message> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Display + Send,
{
    let mut window = Window::new(limits);
    let mut calls = FuturesUnordered::new();
    // A received batch waiting until it may start (see `AckHandle::wait_start`).
    let mut starting: Option<(Batch, AckHandle, BoxFuture<'static, bool>)> = None;
    let mut shard: Arc<str> = Arc::from("");
    let mut closed = false;
    loop {
        window.flush();
        window.take();
        while calls.len() < window.limits.per_shard {
            let Some((waiting, key, ack)) = window.next_start() else {
                break;
            };
            calls.push(call(service.clone(), waiting, key, ack, &window.limits));
        }
        if window.settled(calls.len()) {
            window.settle(&shard, &events);
        }
        if closed && calls.is_empty() {
            // The shard task is gone: whatever is left is given up.
            window.settle(&shard, &events);
            return;
        }
        let receive = !closed && starting.is_none() && window.wants_batch();
        tokio::select! {
            biased;
            Some(done) = calls.next(), if !calls.is_empty() => {
                window.finish(done);
                // Book every call that finished meanwhile before acknowledging.
                while let Some(Some(done)) = calls.next().now_or_never() {
                    window.finish(done);
                }
            }
            may_start = async {
                match starting.as_mut() {
                    Some((_, _, may_start)) => may_start.await,
                    None => false,
                }
            }, if starting.is_some() => {
                if let Some((batch, ack, _)) = starting.take() {
                    if may_start {
                        shard = events.shard_name(&batch.stream, &batch.shard_id).into();
                        window.push_batch(batch, ack);
                    } else {
                        ack.abandon();
                    }
                }
            }
            batch = batches.recv(), if receive => match batch {
                Some(mut batch) => {
                    if let Some(ack) = batch.take_ack() {
                        let waiter = ack.clone();
                        starting = Some((batch, ack, async move { waiter.wait_start().await }.boxed()));
                    }
                }
                None => closed = true,
            },
            // Nothing in flight, nothing to take, nothing to receive: only a closed
            // channel with work that cannot start gets here.
            else => closed = true,
        }
    }
}

/// Whether a taken record may still be handed to the service: not after a restart (it
/// is delivered again) nor once the lease is lost. A drain still finishes what was taken.
fn may_call(ack: &AckHandle, message: &Message) -> bool {
    ack.is_current() && !message.metadata.lease_lost.is_cancelled()
}

/// One call: a place in the worker-wide limit, the service's readiness, the call.
fn call<S>(
    mut service: S,
    waiting: Waiting,
    key: u64,
    ack: AckHandle,
    limits: &Limits,
) -> impl std::future::Future<Output = Finished> + Send
where
    S: Service<Message> + Send + 'static,
    S::Future: Send,
    S::Error: Display + Send,
{
    let worker = limits.worker.clone();
    async move {
        let Waiting {
            batch,
            index,
            message,
        } = waiting;
        let outcome = match worker.acquire_owned().await {
            // The permit is held until the call returned.
            Ok(_permit) if may_call(&ack, &message) => match service.ready().await {
                // Checked again right before the call: the lease must be fresh (the
                // wait for a place or for readiness may have been long).
                Ok(ready) => {
                    if ack.lease_held_for_call().await && may_call(&ack, &message) {
                        match ready.call(message).await {
                            Ok(_) => Outcome::Handled,
                            Err(e) => Outcome::Failed(e.to_string()),
                        }
                    } else {
                        Outcome::NotStarted
                    }
                }
                Err(e) => Outcome::Failed(e.to_string()),
            },
            _ => Outcome::NotStarted,
        };
        Finished {
            batch,
            index,
            key,
            outcome,
        }
    }
}
