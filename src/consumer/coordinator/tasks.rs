//! The shard tasks of this worker: one started per lease taken (with its dispatch task in
//! `run` mode), and at shutdown all stopped (drain, checkpoint) and their leases released,
//! with the rows handed to this worker that it never ran.

use futures_util::FutureExt;
use std::sync::Arc;
use tracing::Instrument;

use futures_util::future::BoxFuture;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::consumer::events::ShardEvent;
use crate::consumer::shard::dispatch::Sink;
use crate::consumer::shard::ShardTask;
use crate::lease::{with_retries, HeldLease, Lease, LeaseStore};

use super::{concurrently, lock, Coordinator, Event, Slot};

/// The handles of a coordinator's dispatch tasks; dropping it aborts those still running.
#[derive(Default)]
pub(super) struct Dispatchers(Vec<JoinHandle<()>>);

impl Dispatchers {
    fn add(&mut self, task: JoinHandle<()>) {
        self.0.retain(|t| !t.is_finished());
        self.0.push(task);
    }

    /// Aborts every dispatch task still running and waits until each has ended.
    pub(super) async fn stop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
        for task in self.0.drain(..) {
            let _ = task.await;
        }
    }
}

impl Drop for Dispatchers {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

impl Coordinator {
    /// Starts the shard task of a lease whose take was sent at `sent`.
    pub(super) fn start(&mut self, row: Lease, sent: Instant) {
        let key = row.key.clone();
        let row_range = row.hash_range;
        // A reset requested before this take is applied at once (after the stop).
        let (reset_pending, key_for_reset) = (row.reset_to.is_some(), key.clone());
        let lease = Arc::new(HeldLease::taken_at(
            row,
            self.store.clone(),
            &self.config.owner,
            sent,
        ));
        let out = match &self.sink {
            Sink::PerShard(spawn) => {
                let (tx, rx) = mpsc::channel(self.config.prefetch_batches);
                self.dispatchers.add(spawn(rx));
                tx
            }
            Sink::Shared(tx) => tx.clone(),
        };
        let stop = self.tasks.child_token();
        let hash_range = self
            .shards
            .iter()
            .find(|s| s.shard_id == key)
            .map(|s| (s.starting_hash_key, s.ending_hash_key))
            // A worker that has not listed the shard (not the leader, or started while the
            // stream was updating) has its range from the lease row.
            .or(row_range);
        self.health.shard_started(&key);
        let task = ShardTask {
            labels: self.labels.clone(),
            health: self.health.clone(),
            shard_id: key.as_str().into(),
            config: self.config.clone(),
            worker: self.worker.clone(),
            kinesis: self.kinesis.clone(),
            stream: self.stream.clone(),
            hash_range,
            lease: lease.clone(),
            out,
            stop: stop.clone(),
        };
        let events = self.events_tx.clone();
        let span = tracing::info_span!("shard", shard = %key);
        let exit_key = key.clone();
        let task = tokio::spawn(
            async move {
                let exit = task.run().await;
                let _ = events.send(Event::Exit(exit_key, exit));
            }
            .instrument(span),
        );
        tracing::info!(lease = %key, "reading shard");
        self.worker
            .events
            .emit(|| ShardEvent::LeaseTaken { shard: key.clone() });
        lock(&self.held).insert(key.clone(), lease.clone());
        self.ever_held = true;
        self.slots.insert(
            key,
            Slot {
                lease,
                stop,
                task,
                handoff_to: None,
                reset: false,
            },
        );
        self.labels.leases_held(self.slots.len());
        if reset_pending {
            let _ = self.events_tx.send(Event::ResetRequested(key_for_reset));
        }
    }

    /// Stops every shard (drain, commit) and releases its lease.
    pub(super) async fn shutdown(&mut self) {
        for slot in self.slots.values() {
            slot.stop.cancel();
        }
        let deadline = Instant::now() + self.config.shutdown_timeout * 2;
        while !self.slots.is_empty() {
            match tokio::time::timeout_at(deadline, self.events_rx.recv()).await {
                Ok(Some(event @ Event::Exit(..))) => {
                    self.on_event(event).await;
                }
                Ok(Some(Event::HandoffRequested(..) | Event::ResetRequested(..))) => {}
                Ok(None) | Err(_) => break,
            }
        }
        for (key, slot) in std::mem::take(&mut self.slots) {
            tracing::warn!(lease = %key, "shard did not stop in time; releasing its lease");
            slot.task.abort();
            let _ = slot.task.await;
            release(&slot.lease, &key).await;
            self.worker
                .events
                .emit(|| ShardEvent::Released { shard: key.clone() });
        }
        self.release_unheld().await;
        tracing::info!("worker stopped; leases released");
    }

    /// The last step of a shutdown, once no shard task runs: withdraws this worker's
    /// hand-off requests, so that no owner hands a lease to a worker that is gone, and
    /// releases the rows the table says are this incarnation's although no task held
    /// them (a hand-over that landed after the last lease round, a take whose answer was
    /// lost). Without it such a row waits a whole lease duration before another worker
    /// takes it. Costs one listing of the table; the calls are retried when they fail
    /// transiently, run [`MAX_CONCURRENT_WRITES`] at a time, and the whole step ends
    /// after one lease duration at most, whatever the store does (by then any such row
    /// has expired and is taken by another worker anyway).
    async fn release_unheld(&self) {
        let (store, me) = (self.store.clone(), self.config.owner.clone());
        let sweep = async {
            let rows = match with_retries(|| store.list()).await {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(error = %e, "could not list the leases at shutdown; a lease handed to this worker meanwhile will expire instead");
                    return;
                }
            };
            let settles: Vec<BoxFuture<'static, ()>> = rows
                .into_iter()
                .filter(|r| {
                    r.owner.as_deref() == Some(&me) || r.pending_owner.as_deref() == Some(&me)
                })
                .map(|row| settle_unheld(store.clone(), me.clone(), row).boxed())
                .collect();
            concurrently(settles).await;
        };
        let limit = self.config.lease_duration;
        if tokio::time::timeout(limit, sweep).await.is_err() {
            tracing::warn!(?limit, "leases handed to this worker at shutdown were not all settled in time; they will expire instead");
        }
    }
}

/// Settles one row a stopping worker found naming it (see
/// [`Coordinator::release_unheld`]): its request on another worker's row is withdrawn;
/// a row that is its own (owned from the start, or handed over before the withdrawal
/// landed) is released.
async fn settle_unheld(store: Arc<dyn LeaseStore>, me: String, row: Lease) {
    let row = if row.owner.as_deref() == Some(&me) {
        row
    } else {
        match with_retries(|| store.withdraw_handoff(&row, &me)).await {
            Ok(_) => return,
            // Handed over meanwhile, or the outcome is unknown: look again.
            Err(e) => match with_retries(|| store.get(&row.key)).await {
                Ok(Some(current)) if current.owner.as_deref() == Some(&me) => current,
                Ok(Some(current)) if current.pending_owner.as_deref() == Some(&me) => {
                    tracing::warn!(lease = %row.key, error = %e, "could not withdraw a hand-off request; if the owner hands the lease over, it will expire instead");
                    return;
                }
                _ => return,
            },
        }
    };
    let key = row.key.clone();
    tracing::info!(lease = %key, "releasing a lease handed to this worker that it never ran");
    // Released like a held lease: retried, and adopted if an answer was lost.
    release(&HeldLease::taken_at(row, store, &me, Instant::now()), &key).await;
}

pub(super) async fn release(lease: &HeldLease, key: &str) {
    if let Err(e) = lease.release().await {
        tracing::warn!(lease = %key, error = %e, "release failed; the lease will expire instead");
    }
}
