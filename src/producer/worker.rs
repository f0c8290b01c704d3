//! The background task behind every [`Producer`](super::Producer) handle: it takes
//! records from the bounded channel, groups them into PutRecords calls, answers each
//! caller, and resends only what failed.
//!
//! Where a record can be, while the task holds it:
//!
//! ```text
//!   channel ──> blocked[key] ──(key free)──> ready ──launch──> in flight ──stored──> answered
//!      │        (ordered mode)                 ▲                   │
//!      └───────────────(unordered)─────────────┤                   │ failed, attempts left
//!                                              └──(backoff over)── retries
//! ```
//!
//! In ordered mode a partition key is *owned* by at most one record at a time: the one
//! that is ready, in flight or waiting for a resend. Later records of that key wait in
//! `blocked` until the owner is answered, so neither two records of one key in the same
//! call (PutRecords does not promise their order, and a partial failure could store
//! the second but not the first) nor a resend overtaking a later record can reorder a
//! key.

use std::cmp::Reverse;
use std::collections::hash_map::{DefaultHasher, Entry as MapEntry};
use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::Instant;

use crate::backoff::Backoff;
use crate::kinesis::{KinesisError, PutOutcome, PutRecord};

use super::builder::Settings;
use super::record::{ProduceError, Stored};

/// Where a caller waits for its record's fate.
pub(crate) type Reply = oneshot::Sender<Result<Stored, ProduceError>>;

/// What the handles send to the task.
pub(crate) enum Command {
    /// A validated record to write.
    Record {
        record: PutRecord,
        size: usize,
        reply: Reply,
    },
    /// Answer when every record sent before this command has been answered.
    Flush(oneshot::Sender<()>),
    /// Accept nothing more, write everything held, then stop.
    Close,
}

/// Everything about a record except the record itself (which travels in the call).
struct Meta {
    id: u64,
    size: usize,
    /// Hash of the partition key (ordered mode only). Two keys that collide merely wait
    /// for each other: order is still kept.
    key: u64,
    attempts: u32,
    enqueued: Instant,
    epoch: u64,
    reply: Reply,
}

struct Entry {
    record: PutRecord,
    meta: Meta,
}

/// A finished PutRecords call, with the records it carried (moved, not copied).
struct Completed {
    records: Vec<PutRecord>,
    metas: Vec<Meta>,
    result: Result<Vec<PutOutcome>, KinesisError>,
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
    rx: mpsc::Receiver<Command>,
    /// Records that may go in the next call, oldest (or longest waiting) first.
    ready: VecDeque<Entry>,
    ready_bytes: usize,
    /// Ordered mode: the keys that are owned, each with the records waiting behind
    /// its owner.
    blocked: HashMap<u64, VecDeque<Entry>>,
    /// Failed records waiting for their backoff to pass.
    retries: Vec<(Instant, Entry)>,
    in_flight: FuturesUnordered<BoxFuture<'static, Completed>>,
    /// Records taken from the channel and not answered yet.
    held: usize,
    max_held: usize,
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
}

impl Worker {
    pub(crate) fn new(settings: Settings, rx: mpsc::Receiver<Command>) -> Self {
        let max_held = settings
            .max_batch_records
            .saturating_mul(settings.max_in_flight.saturating_add(1));
        let backoff = Backoff::new(settings.retry_min, settings.retry_max, settings.seed);
        Worker {
            settings,
            rx,
            ready: VecDeque::new(),
            ready_bytes: 0,
            blocked: HashMap::new(),
            retries: Vec::new(),
            in_flight: FuturesUnordered::new(),
            held: 0,
            max_held,
            next_id: 0,
            epochs: Epochs::new(),
            flushes: VecDeque::new(),
            closing: false,
            rx_done: false,
            call_failures: 0,
            paused_until: None,
            backoff,
        }
    }

    /// Runs until every handle is gone (or `Close` arrived) and every record taken has
    /// been answered; then marks `done`.
    pub(crate) async fn run(mut self, done: watch::Sender<bool>) {
        loop {
            let drained = self.drain_channel();
            let now = Instant::now();
            self.promote_retries(now);
            self.dispatch(now);
            self.answer_flushes();
            if self.held == 0 && (self.rx_done || (self.closing && drained)) {
                break;
            }
            let deadline = self.next_deadline(now);
            let can_receive = !self.rx_done && self.held < self.max_held;
            tokio::select! {
                biased;
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
        // Everything taken was answered; a flush still waiting can only be one whose
        // records were all answered too.
        for (_, waiter) in self.flushes.drain(..) {
            let _ = waiter.send(());
        }
        tracing::debug!(stream = %self.settings.stream, "producer stopped");
        let _ = done.send(true);
    }

    /// Takes what the channel holds without waiting, up to the holding limit. Returns
    /// whether the channel was seen empty.
    fn drain_channel(&mut self) -> bool {
        let now = Instant::now();
        while !self.rx_done && self.held < self.max_held {
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
            } => {
                let key = if self.settings.ordered_per_key {
                    let mut hasher = DefaultHasher::new();
                    record.partition_key.hash(&mut hasher);
                    hasher.finish()
                } else {
                    0
                };
                let entry = Entry {
                    record,
                    meta: Meta {
                        id: self.next_id,
                        size,
                        key,
                        attempts: 0,
                        enqueued: now,
                        epoch: self.epochs.add(),
                        reply,
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

    fn push_ready(&mut self, entry: Entry) {
        self.ready_bytes += entry.meta.size;
        self.ready.push_back(entry);
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
            self.ready_bytes += entry.meta.size;
            self.ready.push_front(entry);
        }
    }

    fn dispatch(&mut self, now: Instant) {
        if self.paused_until.is_some_and(|until| until > now) {
            return;
        }
        let urgent = self.urgent();
        while self.in_flight.len() < self.settings.max_in_flight {
            let Some(front) = self.ready.front() else {
                break;
            };
            let full = self.ready.len() >= self.settings.max_batch_records
                || self.ready_bytes >= self.settings.max_batch_bytes;
            let due = urgent || front.meta.enqueued + self.settings.linger <= now;
            if !(full || due) {
                break;
            }
            self.launch();
        }
    }

    /// Sends the next batch from the front of `ready`: at most `max_batch_records`
    /// records and `max_batch_bytes` bytes (a single larger record goes alone).
    fn launch(&mut self) {
        let limit = self.ready.len().min(self.settings.max_batch_records);
        let mut records = Vec::with_capacity(limit);
        let mut metas = Vec::with_capacity(limit);
        let mut bytes = 0usize;
        while records.len() < limit {
            let Some(front) = self.ready.front() else {
                break;
            };
            if !records.is_empty() && bytes + front.meta.size > self.settings.max_batch_bytes {
                break;
            }
            let Some(Entry { record, mut meta }) = self.ready.pop_front() else {
                break;
            };
            bytes += meta.size;
            self.ready_bytes -= meta.size;
            meta.attempts += 1;
            records.push(record);
            metas.push(meta);
        }
        if records.is_empty() {
            return;
        }
        let api = self.settings.kinesis.clone();
        let stream = self.settings.stream.clone();
        self.in_flight.push(Box::pin(async move {
            let result = api.put_records(&stream, &records).await;
            Completed {
                records,
                metas,
                result,
            }
        }));
    }

    fn complete(&mut self, completed: Completed, now: Instant) {
        let Completed {
            records,
            metas,
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
                return self.call_failed(records, metas, error, jitter, now);
            }
            Err(error) => return self.call_failed(records, metas, error, jitter, now),
        };
        self.call_failures = 0;
        let mut resent = 0usize;
        let mut failed = 0usize;
        for ((record, meta), outcome) in records.into_iter().zip(metas).zip(outcomes) {
            match outcome {
                PutOutcome::Stored {
                    shard_id,
                    sequence_number,
                } => self.answer(
                    meta,
                    Ok(Stored {
                        shard_id,
                        sequence_number,
                    }),
                ),
                PutOutcome::Failed { code, message } => {
                    if entry_error_is_transient(&code) && meta.attempts < self.settings.max_attempts
                    {
                        resent += 1;
                        let delay = self.backoff(meta.attempts, jitter);
                        self.retries.push((now + delay, Entry { record, meta }));
                    } else {
                        failed += 1;
                        let attempts = meta.attempts;
                        self.answer(
                            meta,
                            Err(ProduceError::Failed {
                                code,
                                message,
                                attempts,
                            }),
                        );
                    }
                }
            }
        }
        if resent > 0 {
            tracing::debug!(stream = %self.settings.stream, resent, "PutRecords partial failure; resending the failed entries");
        }
        if failed > 0 {
            tracing::warn!(stream = %self.settings.stream, failed, "records not stored: out of attempts or a permanent entry error");
        }
    }

    /// The whole call failed: resend every record (if the error is transient and it
    /// has attempts left) after a pause of all sending, or fail them.
    fn call_failed(
        &mut self,
        records: Vec<PutRecord>,
        metas: Vec<Meta>,
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
        for (record, meta) in records.into_iter().zip(metas) {
            if retryable && meta.attempts < self.settings.max_attempts {
                let delay = self.backoff(meta.attempts, jitter);
                self.retries.push((now + delay, Entry { record, meta }));
            } else {
                let attempts = meta.attempts;
                self.answer(
                    meta,
                    Err(ProduceError::Failed {
                        code: code.to_owned(),
                        message: message.clone(),
                        attempts,
                    }),
                );
            }
        }
    }

    /// Tells the caller, and lets the next record of the key go (ordered mode).
    fn answer(&mut self, meta: Meta, result: Result<Stored, ProduceError>) {
        // A caller that stopped waiting is not an error.
        let _ = meta.reply.send(result);
        self.held = self.held.saturating_sub(1);
        self.epochs.answered(meta.epoch);
        if self.settings.ordered_per_key {
            if let MapEntry::Occupied(mut waiting) = self.blocked.entry(meta.key) {
                match waiting.get_mut().pop_front() {
                    Some(next) => self.push_ready(next),
                    None => {
                        waiting.remove();
                    }
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
            if let Some(front) = self.ready.front() {
                consider(front.meta.enqueued + self.settings.linger);
            }
        }
        for (at, _) in &self.retries {
            consider(*at);
        }
        next
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    if let Some(deadline) = deadline {
        tokio::time::sleep_until(deadline).await;
    }
}

/// PutRecords entry errors: throughput and internal failures pass with time; KMS
/// errors other than throttling (key disabled, not found, access denied) do not.
pub(super) fn entry_error_is_transient(code: &str) -> bool {
    !code.starts_with("KMS") || code == "KMSThrottlingException"
}

/// The `code` of [`ProduceError::Failed`] when the whole call failed.
fn call_error_code(error: &KinesisError) -> &'static str {
    match error {
        KinesisError::Throttled(_) => "Throttled",
        KinesisError::ExpiredIterator(_) => "ExpiredIterator",
        KinesisError::NotFound(_) => "NotFound",
        KinesisError::Invalid(_) => "Invalid",
        KinesisError::Unsupported(_) => "Unsupported",
        KinesisError::Other(_) => "ServiceError",
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
