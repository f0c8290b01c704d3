//! A lease this worker holds: every write to it goes through here, one at a time, with
//! the owner and counter last written, so renewals and checkpoints never race each
//! other into false conflicts and a worker that lost the lease can never write again.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::meter::{Rates, ThroughputMeter};
use super::{Checkpoint, Lease, LeaseError, LeaseStore};

/// A held lease: the row as last written by us, and the "lease lost" signal.
pub(crate) struct HeldLease {
    row: Mutex<Lease>,
    store: Arc<dyn LeaseStore>,
    /// This incarnation's owner name (worker id and nonce).
    owner: String,
    lost: CancellationToken,
    /// When the last successful renewal (or the take) was sent: what other workers'
    /// expiry timers are at least as late as.
    renewed_at: std::sync::Mutex<Instant>,
    renewed: Notify,
    /// Set while another worker's hand-off request stands on the row: the instant after
    /// which no work on this lease's records may start (see
    /// [`HeldLease::note_handoff_request`]).
    handoff_deadline: std::sync::Mutex<Option<Instant>>,
    /// A release or hand-over was sent: once it lands another worker may hold the lease,
    /// whatever its answer says and however late it comes.
    leaving: std::sync::atomic::AtomicBool,
    /// What was read from the shard since the take (see [`ThroughputMeter`]).
    meter: ThroughputMeter,
}

/// Attempts at a release (and the other calls of a worker on its way out) before the
/// lease is left to expire.
const RELEASE_ATTEMPTS: u32 = 3;

/// How many newer reset requests [`HeldLease::apply_reset`] follows before it gives up
/// (an operator asking again and again while the owner applies).
const RESET_ATTEMPTS: u32 = 5;

/// The pause before the second release attempt (doubled before the third).
const RELEASE_PAUSE: std::time::Duration = std::time::Duration::from_millis(100);

/// Runs `call` again after a transient failure (throttled, cut by its deadline, a
/// network error), [`RELEASE_ATTEMPTS`] times in all, pausing [`RELEASE_PAUSE`] and then
/// twice that: for the calls of a stopping worker, which has no later round to retry in.
pub(crate) async fn with_retries<T, F, Fut>(mut call: F) -> Result<T, LeaseError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, LeaseError>>,
{
    let mut attempt = 1;
    loop {
        match call().await {
            Err(e) if e.is_transient() && attempt < RELEASE_ATTEMPTS => {
                tokio::time::sleep(RELEASE_PAUSE * attempt).await;
                attempt += 1;
            }
            result => return result,
        }
    }
}

impl HeldLease {
    /// Wraps a row this incarnation took with a take sent at `sent`. Other workers'
    /// expiry timers run from when the take landed, which may be long before its answer
    /// came back: the lease is fresh (see [`HeldLease::is_fresh`]) only as measured from
    /// the send, like a renewal.
    pub fn taken_at(row: Lease, store: Arc<dyn LeaseStore>, owner: &str, sent: Instant) -> Self {
        let meter = ThroughputMeter::new(sent, row.throughput_kbps);
        HeldLease {
            row: Mutex::new(row),
            store,
            owner: owner.to_owned(),
            lost: CancellationToken::new(),
            renewed_at: std::sync::Mutex::new(sent),
            renewed: Notify::new(),
            handoff_deadline: std::sync::Mutex::new(None),
            leaving: std::sync::atomic::AtomicBool::new(false),
            meter,
        }
    }

    /// Whether the last successful renewal is younger than `max_age`. A worker that was
    /// paused (GC, a stopped VM) longer than that may have lost the lease without
    /// knowing yet, so it should not hand out more records until a renewal succeeds.
    /// Never once a release or hand-over was sent (see [`HeldLease::release`]): the
    /// lease may be another worker's as soon as it lands.
    /// Nor past the deadline of a standing hand-off request (see
    /// [`HeldLease::note_handoff_request`]): the requester may take the lease then,
    /// however recently it was renewed.
    pub fn is_fresh(&self, max_age: Duration) -> bool {
        !self.leaving.load(std::sync::atomic::Ordering::SeqCst)
            && self
                .handoff_deadline
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_none_or(|deadline| Instant::now() < deadline)
            && self
                .renewed_at
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .elapsed()
                < max_age
    }

    /// Notes what a successful renewal found on the row about a hand-off request from
    /// another worker: `Some(deadline)` while one stands, `None` once none does (it was
    /// withdrawn). The requester takes the lease anyway once its hand-off timeout passed
    /// since it asked, without waiting for the lease to expire; renewals keep succeeding
    /// until then, so freshness alone would let this worker start calls after the take
    /// when its hand-over is late (the task that hands over busy elsewhere). The first
    /// deadline seen is kept while the request stands: it is the earliest, computed from
    /// the renewal before the one that first saw the request.
    pub(crate) fn note_handoff_request(&self, deadline: Option<Instant>) {
        let mut current = self
            .handoff_deadline
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match deadline {
            Some(d) => {
                current.get_or_insert(d);
            }
            // Withdrawn: a call waiting for freshness may go on now, not at the next
            // renewal.
            None => {
                if current.take().is_some() {
                    drop(current);
                    self.renewed.notify_waiters();
                }
            }
        }
    }

    /// When the last successful renewal (or the take) was sent.
    pub fn renewed_at(&self) -> Instant {
        *self.renewed_at.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until the lease is fresh again (a renewal succeeded) or lost.
    pub async fn wait_fresh(&self, max_age: Duration) {
        loop {
            let renewed = self.renewed.notified();
            if self.is_fresh(max_age) || self.lost.is_cancelled() {
                return;
            }
            // Biased, loss first: a lease lost while a renewal landed is lost.
            tokio::select! {
                biased;
                _ = self.lost.cancelled() => return,
                _ = renewed => {}
            }
        }
    }

    /// The one freshness check before work on this lease's records starts (records read
    /// and about to be handed out, a batch that waited in a queue): after a pause longer
    /// than `max_age` since the last renewal another worker may own the lease, so this
    /// waits until a renewal proves it is still ours. Returns `false` when it waited and
    /// the lease was lost meanwhile; `holding` names what waits, for the log.
    pub(crate) async fn hold_until_fresh(&self, max_age: Duration, holding: &str) -> bool {
        if self.is_fresh(max_age) {
            return true;
        }
        tracing::info!("lease not renewed recently (or being given up); holding {holding} until a renewal lands or it is lost");
        self.wait_fresh(max_age).await;
        !self.lost.is_cancelled()
    }

    /// Cancelled once the lease is known lost (another owner, or released).
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// The row as last written by this worker.
    pub async fn row(&self) -> Lease {
        self.row.lock().await.clone()
    }

    /// Notes a page read from the shard: `records` records of `bytes` data bytes.
    pub(crate) fn record_read(&self, bytes: u64, records: u64) {
        self.meter.add(bytes, records);
    }

    /// The shard's smoothed throughput as of the last renewal, once measured.
    pub(crate) fn throughput(&self) -> Option<Rates> {
        self.meter.latest()
    }

    /// Renews (bumps the counter), writing the shard's throughput measured since the
    /// previous renewal with it (`throughputKBps`, see [`ThroughputMeter`]). Returns the
    /// new row; it may carry a hand-off request.
    pub async fn renew(&self) -> Result<Lease, LeaseError> {
        let sent = Instant::now();
        let kbps = self.meter.sample(sent).map(|r| r.kbps());
        let row = self
            .write(move |store, mut row| {
                if kbps.is_some() {
                    row.throughput_kbps = kbps;
                }
                Box::pin(async move { store.renew(&row).await })
            })
            .await?;
        *self.renewed_at.lock().unwrap_or_else(|p| p.into_inner()) = sent;
        self.renewed.notify_waiters();
        Ok(row)
    }

    /// Commits a checkpoint, fenced by owner and counter. A checkpoint behind the one in
    /// the row as last read or written (a record position before the stored one, a start
    /// sentinel after records were handled) is never written: the row is returned as it
    /// is, so the checkpoint can only move forward. (The stores' conditions cannot
    /// compare positions: DynamoDB's numbers hold 38 digits, sequence numbers up to 129;
    /// fencing on the counter leaves this row as the only one we write over.)
    pub async fn checkpoint(&self, checkpoint: &Checkpoint) -> Result<Lease, LeaseError> {
        let cp = checkpoint.clone();
        self.write(move |store, row| {
            let cp = cp.clone();
            Box::pin(async move {
                if cp.progress_cmp(&row.checkpoint) == Some(std::cmp::Ordering::Less) {
                    tracing::warn!(lease = %row.key, stored = %row.checkpoint, refused = %cp, "not moving the checkpoint backwards");
                    return Ok(row);
                }
                store.checkpoint(&row, &cp).await
            })
        })
        .await
    }

    /// Applies the operator's reset request on the row as last read (see
    /// [`Lease::reset_to`](super::Lease::reset_to)): stores its checkpoint, fenced like
    /// every write, and removes the request. Call it only once the shard task stopped
    /// and drained. Returns the row unchanged when there is no request.
    ///
    /// The write is conditional on the request it applies: when another request landed
    /// since the row was read (the owner and counter unchanged), the row is read again
    /// and the newer request applied instead, so an operator's later request is never
    /// overwritten by an earlier one. A request that landed after the last renewal
    /// (none on the row as last read) is found the same way.
    pub async fn apply_reset(&self) -> Result<Lease, LeaseError> {
        self.write(|store, row| {
            Box::pin(async move {
                let mut row = row;
                for _ in 0..RESET_ATTEMPTS {
                    let Some(to) = row.reset_to.clone() else {
                        // Perhaps asked for since the row was read: look once.
                        match store.get(&row.key).await? {
                            Some(cur)
                                if cur.reset_to.is_some()
                                    && cur.owner == row.owner
                                    && cur.counter == row.counter =>
                            {
                                row = cur;
                                continue;
                            }
                            _ => return Ok(row),
                        }
                    };
                    match store.reset(&row, &to).await {
                        Err(LeaseError::Conflict(key)) => match store.get(&key).await? {
                            // Only the request changed: apply the one on the row now.
                            Some(cur) if cur.owner == row.owner && cur.counter == row.counter => {
                                row = cur;
                            }
                            _ => return Err(LeaseError::Conflict(key)),
                        },
                        result => return result,
                    }
                }
                Err(LeaseError::Conflict(row.key))
            })
        })
        .await
    }

    /// Gives the lease up (to nobody). Marks it lost for this worker either way; from
    /// the moment it is sent the lease is no longer fresh (see [`HeldLease::is_fresh`]),
    /// so nothing starts on it while the answer is on its way.
    ///
    /// A release that failed transiently (throttled, cut by its deadline, a network
    /// error) is tried again, [`RELEASE_ATTEMPTS`] times in all: a lease left owned
    /// waits a whole lease duration before another worker takes it. One that landed
    /// although an error was seen shows as a conflict on the next attempt.
    pub async fn release(&self) -> Result<Lease, LeaseError> {
        self.leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let result = with_retries(|| {
            self.write(|store, row| Box::pin(async move { store.release(&row).await }))
        })
        .await;
        self.lost.cancel();
        result
    }

    /// Hands the lease straight to `worker` (the graceful end of a steal), as long as
    /// `worker`'s request still stands: a worker that stopped meanwhile withdrew it, and
    /// the hand-over fails with a conflict (the row stays ours, unheld, for the next
    /// lease round to take back or the shutdown to release).
    pub async fn transfer(&self, worker: &str) -> Result<Lease, LeaseError> {
        // Not fresh from the send on, as for a release.
        self.leaving
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let to = worker.to_owned();
        let result = self
            .write(move |store, row| {
                let to = to.clone();
                // The store checks that the request naming `to` is still on the row.
                let row = Lease {
                    pending_owner: Some(to.clone()),
                    ..row
                };
                Box::pin(async move { store.take(&row, &to).await })
            })
            .await;
        self.lost.cancel();
        result
    }

    /// Runs one conditional write with the current row, holding the row lock so writes
    /// never interleave. Nothing is written once the lease is lost or no longer ours
    /// (after a release or transfer). On a conflict the row is read back: if the only
    /// change is our own renewal that landed although we saw an error (same owner,
    /// counter one higher), the row is adopted and the write tried once more; any other
    /// change means someone else wrote, and the lease is lost. The owner is this
    /// incarnation's own name (worker id and nonce), so a take by another process with
    /// the same worker id is never mistaken for our renewal.
    async fn write<F>(&self, op: F) -> Result<Lease, LeaseError>
    where
        F: Fn(
            Arc<dyn LeaseStore>,
            Lease,
        ) -> futures_util::future::BoxFuture<'static, Result<Lease, LeaseError>>,
    {
        let mut row = self.row.lock().await;
        if self.lost.is_cancelled() || row.owner.as_deref() != Some(&self.owner) {
            return Err(LeaseError::Conflict(row.key.clone()));
        }
        let mut adopted = false;
        loop {
            match op(self.store.clone(), row.clone()).await {
                Ok(new) => {
                    *row = new.clone();
                    return Ok(new);
                }
                Err(LeaseError::Conflict(key)) => match self.store.get(&key).await? {
                    Some(cur)
                        if !adopted
                            && cur.owner == row.owner
                            && cur.counter == row.counter.saturating_add(1) =>
                    {
                        tracing::debug!(lease = %key, "adopting our own renewal that was reported failed");
                        adopted = true;
                        *row = cur;
                    }
                    _ => {
                        self.lost.cancel();
                        return Err(LeaseError::Conflict(key));
                    }
                },
                Err(e) => return Err(e),
            }
        }
    }
}
