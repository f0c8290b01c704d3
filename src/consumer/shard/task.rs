//! One owned shard: runs its reader, commits the watermark (fenced by the lease), restarts
//! from the watermark after a handler failure, drains on stop, and says when it is stuck
//! (records handed out and none handled for `stuck_after`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::ack::ShardProgress;
use crate::backoff::Backoff;
use crate::kinesis::{KinesisApi, KinesisError};
use crate::lease::{Checkpoint, HeldLease, LeaseError};
use crate::message::Batch;
use crate::metrics::{Labels, ShardMetrics};

use super::reader::{ShardReader, GONE_CONFIRMATIONS};
use crate::consumer::config::{CheckpointPolicy, Config, InitialPosition};
use crate::consumer::context::WorkerContext;
use crate::consumer::events::{EventHook, ShardEvent};
use crate::consumer::health::HealthState;
use crate::consumer::latest::resolve_latest;

/// How a shard task ended.
#[derive(Debug)]
pub(crate) enum ShardExit {
    /// Every record is handled and SHARD_END is committed.
    Ended,
    /// Stopped on request: in-flight work drained and its checkpoint committed; the
    /// lease is still ours to release or hand over.
    Stopped,
    /// The lease was lost: nothing more may be committed.
    Lost,
    /// The shard cannot be read (deleted stream or shard); the lease is still ours.
    Failed(String),
}

pub(crate) struct ShardTask {
    pub(crate) config: Arc<Config>,
    pub(crate) worker: WorkerContext,
    pub(crate) kinesis: Arc<dyn KinesisApi>,
    pub(crate) stream: Arc<str>,
    /// The shard's hash-key range, when discovery saw the shard.
    pub(crate) hash_range: Option<(u128, u128)>,
    pub(crate) lease: Arc<HeldLease>,
    pub(crate) out: mpsc::Sender<Batch>,
    /// Cancelled to stop gracefully (shutdown or hand-off).
    pub(crate) stop: CancellationToken,
    pub(crate) labels: Labels,
    /// Told when the checkpoint moves (the shard advances) or a handler fails.
    pub(crate) health: Arc<HealthState>,
    pub(crate) shard_id: Arc<str>,
}

/// Attempts at the checkpoint written before a shard is left.
const FINAL_COMMIT_ATTEMPTS: usize = 5;

enum Interrupt {
    Stop,
    Failed,
}

impl ShardTask {
    pub(crate) async fn run(self) -> ShardExit {
        let row = self.lease.row().await;
        let shard_id: Arc<str> = row.key.as_str().into();
        if row.checkpoint == Checkpoint::ShardEnd {
            return ShardExit::Ended;
        }
        let seed = self.config.seed ^ hash(&shard_id);
        let start = match self
            .durable_start(
                row.checkpoint,
                &mut Backoff::new(
                    self.config.retry_min,
                    self.config.retry_max,
                    seed.rotate_left(13),
                ),
            )
            .await
        {
            Ok(start) => start,
            Err(exit) => return exit,
        };
        let progress = ShardProgress::new(
            start.clone(),
            self.lease.clone(),
            self.config.lease_fresh_for(),
        );
        let mut committed = start;
        let metrics = self.labels.shard(&shard_id);
        self.health.watch(&shard_id, progress.clone());
        // A few looks per threshold: the event follows the health within an eighth of it.
        let mut tick =
            tokio::time::interval((self.config.stuck_after / 8).max(Duration::from_millis(1)));
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut stuck = StuckWatch {
            shard_id: shard_id.clone(),
            metrics: metrics.clone(),
            events: self.worker.events.clone(),
            since: None,
            tick,
        };
        let mut age = CheckpointAge {
            gauge: metrics.checkpoint_age.clone(),
            current_at: Instant::now(),
            last_written: committed.clone(),
        };
        let reader = ShardReader {
            metrics: metrics.clone(),
            health: self.health.clone(),
            config: self.config.clone(),
            worker: self.worker.clone(),
            kinesis: self.kinesis.clone(),
            stream: self.stream.clone(),
            shard_id: shard_id.clone(),
            hash_range: self.hash_range,
            progress: progress.clone(),
            out: self.out.clone(),
            lease: self.lease.clone(),
            lease_lost: self.lease.lost().clone(),
        };
        let mut read_backoff = Backoff::new(self.config.retry_min, self.config.retry_max, seed);
        let mut failure_backoff = Backoff::new(
            self.config.retry_min,
            self.config.retry_max,
            seed.rotate_left(7),
        );
        let mut commit_tick = tokio::time::interval(match self.config.checkpoint {
            CheckpointPolicy::Interval(d) => d,
            CheckpointPolicy::EveryBatch => self.config.lease_duration,
        });
        commit_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let every_batch = self.config.checkpoint == CheckpointPolicy::EveryBatch;

        loop {
            let start = progress.lock().acked().clone();
            let generation_failed = {
                let read = reader.read(start, &mut read_backoff);
                tokio::pin!(read);
                let mut reading = true;
                loop {
                    tokio::select! {
                        biased;
                        _ = self.lease.lost().cancelled() => {
                            // Queued batches must not start: the checkpoint is no longer ours.
                            progress.set_accepting(false);
                            return ShardExit::Lost;
                        }
                        _ = self.stop.cancelled() => break Interrupt::Stop,
                        result = &mut read, if reading => {
                            reading = false;
                            let failure = match result {
                                Err(e) => Some(format!("the shard cannot be read: {e}")),
                                // The reader stops early only when nobody takes batches any
                                // more (the handler's task ended): give the shard up.
                                Ok(()) if self.out.is_closed() => Some("nothing consumes its batches".to_owned()),
                                Ok(()) => None,
                            };
                            if let Some(why) = failure {
                                tracing::error!(shard = %shard_id, %why, "giving the shard up");
                                progress.set_accepting(false);
                                self.drain(&progress, &mut stuck).await;
                                if let Err(exit) = self.commit_before_leaving(&progress, &mut committed, &mut failure_backoff).await { return exit; }
                                return ShardExit::Failed(why);
                            }
                        }
                        _ = progress.changed.notified() => {
                            if stuck.since.is_some() {
                                stuck.check(&self, &progress);
                            }
                            // Only a failure of this generation restarts it; a late one from
                            // before the last restart was already handled by that restart.
                            let current = progress.lock().generation();
                            if progress.take_failure() == Some(current) {
                                break Interrupt::Failed;
                            }
                            let at_end = *progress.lock().acked() == Checkpoint::ShardEnd;
                            if every_batch || at_end {
                                if let Err(exit) = self.commit(&progress, &mut committed).await { return exit; }
                            }
                            if at_end && committed == Checkpoint::ShardEnd {
                                tracing::info!(shard = %shard_id, "checkpointed at SHARD_END");
                                return ShardExit::Ended;
                            }
                        }
                        _ = stuck.tick.tick() => stuck.check(&self, &progress),
                        _ = commit_tick.tick() => {
                            if let Err(exit) = self.commit(&progress, &mut committed).await { return exit; }
                            if committed == Checkpoint::ShardEnd {
                                return ShardExit::Ended;
                            }
                        }
                    }
                    age.look(&progress, &committed);
                }
            };
            // The reader is dropped here: nothing more is read in this generation. What
            // was delivered finishes (or times out) and its watermark is committed.
            progress.set_accepting(false);
            self.drain(&progress, &mut stuck).await;
            if let Err(exit) = self
                .commit_before_leaving(&progress, &mut committed, &mut failure_backoff)
                .await
            {
                return exit;
            }
            match generation_failed {
                // The drain may have completed the shard: a finished lease is released
                // (a hand-off would leave it owned by a worker that never takes a
                // finished lease, and never cleaned up).
                Interrupt::Stop if committed == Checkpoint::ShardEnd => return ShardExit::Ended,
                Interrupt::Stop => return ShardExit::Stopped,
                Interrupt::Failed => {
                    metrics.retries.increment(1);
                    let reason = progress.reason();
                    self.health
                        .failure(&shard_id, reason.as_deref().unwrap_or("a handler failed"));
                    let delay = failure_backoff.next_delay();
                    tracing::warn!(shard = %shard_id, checkpoint = %committed, ?delay, "a handler failed; reading again from the checkpoint after a pause");
                    tokio::select! {
                        biased;
                        _ = self.lease.lost().cancelled() => return ShardExit::Lost,
                        _ = self.stop.cancelled() => return ShardExit::Stopped,
                        _ = tokio::time::sleep(delay) => {}
                    }
                    progress.reset();
                    progress.set_accepting(true);
                }
            }
        }
    }

    /// The start every owner of the shard continues from, written into the lease row
    /// before anything is read: LATEST becomes AT_TIMESTAMP of now minus a clock margin
    /// (moved back while Kinesis calls it in its future, see `resolve_latest`),
    /// and an `AT_TIMESTAMP` row without a time gets the configured one. Nothing else
    /// needs resolving. A failed write is retried (nothing is delivered meanwhile) until
    /// it lands, the lease is lost or the task is stopped.
    async fn durable_start(
        &self,
        stored: Checkpoint,
        backoff: &mut Backoff,
    ) -> Result<Checkpoint, ShardExit> {
        let now = self.config.wall_clock.now();
        let mut resolved = match (&stored, &self.config.initial_position) {
            // A row with the LATEST sentinel (a KCL table; shardflow itself resolves
            // LATEST when it creates the row): confirmed on this shard below.
            (Checkpoint::Latest, _) => None,
            (Checkpoint::AtTimestamp(None), InitialPosition::AtTimestamp(t)) => {
                Some(Checkpoint::AtTimestamp(Some(*t)))
            }
            _ => return Ok(stored),
        };
        let mut not_found: u32 = 0;
        loop {
            let failure = match &resolved {
                Some(start) => match self.lease.checkpoint(start).await {
                    Ok(row) => {
                        tracing::info!(from = %stored, start = %row.checkpoint, "wrote the shard's durable start");
                        return Ok(row.checkpoint);
                    }
                    Err(LeaseError::Conflict(key)) => {
                        tracing::info!(lease = %key, "lease lost before the start was written");
                        return Err(ShardExit::Lost);
                    }
                    Err(e) => format!("could not write the shard's start: {e}"),
                },
                None => {
                    let shard: &str = &self.shard_id;
                    match resolve_latest(self.kinesis.as_ref(), &self.stream, &[shard], now).await {
                        Ok(start) => {
                            resolved = Some(start);
                            continue;
                        }
                        // A shard Kinesis keeps answering NotFound for is gone (past
                        // retention): nothing can be skipped in it, and the reader
                        // finds it gone and ends it, so its children are not held back.
                        Err(KinesisError::NotFound(why)) if not_found + 1 >= GONE_CONFIRMATIONS => {
                            tracing::info!(shard = %self.shard_id, %why, "the shard was not found; its LATEST start is this host's guess");
                            resolved = Some(Checkpoint::latest_from(now));
                            continue;
                        }
                        Err(e) => {
                            if matches!(e, KinesisError::NotFound(_)) {
                                not_found += 1;
                            }
                            format!("could not check LATEST's start against Kinesis: {e}")
                        }
                    }
                }
            };
            let delay = backoff.next_delay();
            tracing::warn!(error = %failure, ?delay, "the shard's start is not durable yet; retrying before reading");
            tokio::select! {
                biased;
                _ = self.lease.lost().cancelled() => return Err(ShardExit::Lost),
                _ = self.stop.cancelled() => return Err(ShardExit::Stopped),
                _ = tokio::time::sleep(delay) => {}
            }
        }
    }

    /// Waits until no delivered work is in progress, at most the shutdown timeout (still
    /// saying when the shard is stuck meanwhile).
    async fn drain(&self, progress: &ShardProgress, stuck: &mut StuckWatch) {
        let deadline = Instant::now() + self.config.shutdown_timeout;
        loop {
            let open = progress.lock().open();
            if open == 0 {
                return;
            }
            // Biased, in this order: a lost lease ends the wait (nothing can be
            // committed), work that finished counts before the deadline is judged, and a
            // stuck shard is reported before the drain gives up on it.
            tokio::select! {
                biased;
                _ = self.lease.lost().cancelled() => return,
                _ = progress.changed.notified() => {}
                _ = stuck.tick.tick() => stuck.check(self, progress),
                _ = tokio::time::sleep_until(deadline) => {
                    tracing::warn!(open, "in-flight batches did not finish before the timeout; they will be delivered again");
                    return;
                }
            }
        }
    }

    /// Commits the watermark before the lease is released, handed over or the shard
    /// restarted, retrying transient failures a few times: a checkpoint left behind
    /// means the next reader delivers those records again.
    async fn commit_before_leaving(
        &self,
        progress: &ShardProgress,
        committed: &mut Checkpoint,
        backoff: &mut Backoff,
    ) -> Result<(), ShardExit> {
        for _ in 0..FINAL_COMMIT_ATTEMPTS {
            self.commit(progress, committed).await?;
            if *committed == *progress.lock().acked() {
                return Ok(());
            }
            tokio::time::sleep(backoff.next_delay()).await;
        }
        tracing::warn!("could not commit the last checkpoint; its records will be delivered again");
        Ok(())
    }

    /// Writes the watermark if it moved. Throttling and transient errors keep the
    /// watermark for the next attempt; a conflict means the lease is lost.
    async fn commit(
        &self,
        progress: &ShardProgress,
        committed: &mut Checkpoint,
    ) -> Result<(), ShardExit> {
        let acked = progress.lock().acked().clone();
        if acked == *committed {
            return Ok(());
        }
        let sent = Instant::now();
        let written = self.lease.checkpoint(&acked).await;
        let outcome = match &written {
            Ok(_) => "ok",
            Err(LeaseError::Conflict(_)) => "conflict",
            Err(_) => "error",
        };
        self.labels.checkpoint_written(sent.elapsed(), outcome);
        match written {
            Ok(_) => {
                self.health.progress(&self.shard_id);
                tracing::debug!(checkpoint = %acked, "checkpoint committed");
                *committed = acked;
                Ok(())
            }
            Err(LeaseError::Conflict(key)) => {
                progress.set_accepting(false);
                tracing::warn!(lease = %key, "lease lost; the checkpoint is left to the new owner");
                Err(ShardExit::Lost)
            }
            Err(e) => {
                tracing::warn!(error = %e, "checkpoint write failed; will retry");
                Ok(())
            }
        }
    }
}

/// The shard's [`CHECKPOINT_AGE`](crate::metrics::CHECKPOINT_AGE): since when its
/// stored checkpoint has not been current. It is current right after a checkpoint write
/// lands and whenever the task finds nothing to commit: the watermark is the committed
/// checkpoint and nothing delivered waits to be handled (an idle shard caught up with
/// the tip, so it never alarms for lack of writes). Dropped with the shard task: a shard
/// no longer read here reports 0, not a stale age.
struct CheckpointAge {
    gauge: ::metrics::Gauge,
    /// When the checkpoint was last known current.
    current_at: Instant,
    /// The committed checkpoint at the last look: a change is a write that landed.
    last_written: Checkpoint,
}

impl CheckpointAge {
    /// Looks at the shard after each event of its task (reads, acknowledgements, the
    /// commit and stuck ticks, so at least every checkpoint interval) and sets the gauge.
    fn look(&mut self, progress: &ShardProgress, committed: &Checkpoint) {
        let written = *committed != self.last_written;
        if written {
            self.last_written = committed.clone();
        }
        let nothing_to_commit = || {
            let w = progress.lock();
            w.acked() == committed && w.settled()
        };
        if written || nothing_to_commit() {
            self.current_at = Instant::now();
        }
        self.gauge.set(self.current_at.elapsed().as_secs_f64());
    }
}

impl Drop for CheckpointAge {
    fn drop(&mut self) {
        self.gauge.set(0.0);
    }
}

/// Whether a shard is stuck, as last reported (event and gauge): each transition is
/// reported once. Dropped with the shard task, when a stuck shard stops counting and
/// says so: every `Stuck` is followed by one `Unstuck`, whether the shard made progress
/// again or its task ended (the shard ended, was handed off, released or lost).
struct StuckWatch {
    shard_id: Arc<str>,
    metrics: Arc<ShardMetrics>,
    events: EventHook,
    /// When the shard was reported stuck; `None` while it is not.
    since: Option<Instant>,
    /// When to look next.
    tick: tokio::time::Interval,
}

impl StuckWatch {
    /// Compares the shard's progress with the threshold and reports a change.
    fn check(&mut self, task: &ShardTask, progress: &ShardProgress) {
        let stuck_for = task.health.stuck_for(progress.waiting_since());
        match (self.since, stuck_for) {
            (None, Some(waited)) => {
                let reason = progress.reason();
                tracing::warn!(shard = %self.shard_id, ?waited, reason = reason.as_deref().unwrap_or("a handler call has not returned"), "shard stuck: records wait and none was handled");
                self.since = Some(Instant::now());
                self.metrics.stuck.increment(1.0);
                task.worker.events.emit(|| ShardEvent::Stuck {
                    shard: self.shard_id.to_string(),
                    waited,
                    reason,
                });
            }
            (Some(since), None) => {
                let stuck_for = since.elapsed();
                tracing::info!(shard = %self.shard_id, ?stuck_for, "shard makes progress again");
                self.since = None;
                self.metrics.stuck.decrement(1.0);
                task.worker.events.emit(|| ShardEvent::Unstuck {
                    shard: self.shard_id.to_string(),
                    stuck_for,
                });
            }
            _ => {}
        }
    }
}

impl Drop for StuckWatch {
    fn drop(&mut self) {
        if let Some(since) = self.since.take() {
            let stuck_for = since.elapsed();
            tracing::info!(shard = %self.shard_id, ?stuck_for, "a stuck shard is no longer read here");
            self.metrics.stuck.decrement(1.0);
            // Before the event of the task's exit, which the coordinator sends after.
            self.events.emit(|| ShardEvent::Unstuck {
                shard: self.shard_id.to_string(),
                stuck_for,
            });
        }
    }
}

fn hash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}
