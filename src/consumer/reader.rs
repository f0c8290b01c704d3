//! Reads one shard: iterators, GetRecords, the per-record filter against what is
//! already handled, and recovery from throttling and expired iterators.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::checkpoint::{Mark, ShardProgress};
use crate::kinesis::{KinesisApi, KinesisError, StartingPosition};
use crate::lease::{Checkpoint, HeldLease};
use crate::message::{Batch, Headers, Message};
use crate::sequence::Position;

use super::config::{Config, InitialPosition};

/// Everything a shard's reader needs.
pub(crate) struct ShardReader {
    pub(crate) config: Arc<Config>,
    pub(crate) kinesis: Arc<dyn KinesisApi>,
    pub(crate) stream: Arc<str>,
    pub(crate) shard_id: Arc<str>,
    pub(crate) progress: Arc<ShardProgress>,
    pub(crate) out: mpsc::Sender<Batch>,
    pub(crate) lease: Arc<HeldLease>,
    pub(crate) lease_lost: CancellationToken,
}

impl ShardReader {
    /// Reads from just after `start` until the shard ends (then registers the end with
    /// the watermark and returns `Ok`) or a fatal error. Runs until dropped otherwise.
    pub(crate) async fn read(
        &self,
        start: Checkpoint,
        backoff: &mut Backoff,
    ) -> Result<(), KinesisError> {
        // Everything at or before `handled` is dropped record by record: it is either
        // covered by the checkpoint or was already delivered by this reader.
        let mut handled = start;
        let mut iterator: Option<String> = None;
        loop {
            let it = match iterator.take() {
                Some(it) => it,
                None => match self.iterator_after(&handled).await {
                    Ok(it) => it,
                    Err(e) if e.is_retryable() => {
                        self.pause(&e, backoff).await;
                        continue;
                    }
                    Err(e) => return Err(e),
                },
            };
            let page = match self
                .kinesis
                .get_records(&it, self.config.max_records_per_read)
                .await
            {
                Ok(page) => page,
                Err(KinesisError::ExpiredIterator(why)) => {
                    tracing::info!(shard = %self.shard_id, %why, "iterator expired; reading again from the last delivered record");
                    continue;
                }
                Err(e) if e.is_retryable() => {
                    self.pause(&e, backoff).await;
                    iterator = Some(it);
                    continue;
                }
                Err(e) => return Err(e),
            };
            backoff.reset();
            let raw = page.records.len();
            let mut messages = Vec::with_capacity(raw);
            for record in page.records {
                let position = Position::new(record.sequence_number, 0);
                if handled.covers(&position) {
                    continue;
                }
                messages.push(Message {
                    headers: Headers {
                        stream: self.stream.clone(),
                        shard_id: self.shard_id.clone(),
                        sequence_number: position.sequence,
                        sub_sequence_number: 0,
                        partition_key: record.partition_key,
                        explicit_hash_key: None,
                        approximate_arrival: record.approximate_arrival,
                        lease_lost: self.lease_lost.clone(),
                    },
                    payload: record.data,
                });
            }
            if raw > messages.len() {
                tracing::debug!(shard = %self.shard_id, skipped = raw - messages.len(), "dropped records already handled");
            }
            if let Some(last) = messages.last() {
                // After a pause longer than the renewal margin the lease may already be
                // someone else's: hand nothing out until a renewal proves it is ours.
                let max_age = self.config.lease_duration - self.config.renew_interval;
                if !self.lease.is_fresh(max_age) {
                    tracing::info!(shard = %self.shard_id, "lease not renewed recently; holding records until it is");
                    self.lease.wait_fresh(max_age).await;
                    if self.lease_lost.is_cancelled() {
                        return Ok(());
                    }
                }
                let last = last.position();
                let ack = self.progress.register(Mark::At(last.clone()));
                handled = Checkpoint::At(last);
                let batch = Batch {
                    stream: self.stream.clone(),
                    shard_id: self.shard_id.clone(),
                    messages,
                    millis_behind_latest: page.millis_behind_latest,
                    ack: Some(ack),
                };
                if self.out.send(batch).await.is_err() {
                    // Nobody consumes any more (shutting down): stop reading.
                    return Ok(());
                }
            }
            match page.next_iterator {
                None => {
                    tracing::info!(shard = %self.shard_id, children = ?page.child_shards, "reached the end of the shard");
                    self.progress.end_of_shard();
                    return Ok(());
                }
                Some(next) => iterator = Some(next),
            }
            let caught_up = raw == 0 || page.millis_behind_latest == Some(0);
            if caught_up {
                tokio::time::sleep(self.config.idle_read_interval).await;
            }
        }
    }

    async fn pause(&self, error: &KinesisError, backoff: &mut Backoff) {
        let delay = backoff.next_delay();
        match error {
            KinesisError::Throttled(_) => {
                tracing::warn!(shard = %self.shard_id, ?delay, %error, "throttled; backing off")
            }
            _ => tracing::warn!(shard = %self.shard_id, ?delay, %error, "read failed; retrying"),
        }
        tokio::time::sleep(delay).await;
    }

    async fn iterator_after(&self, handled: &Checkpoint) -> Result<String, KinesisError> {
        let from = match handled {
            Checkpoint::TrimHorizon => StartingPosition::TrimHorizon,
            Checkpoint::Latest => StartingPosition::Latest,
            Checkpoint::AtTimestamp => match &self.config.initial_position {
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
        };
        self.kinesis
            .shard_iterator(&self.stream, &self.shard_id, &from)
            .await
    }
}
