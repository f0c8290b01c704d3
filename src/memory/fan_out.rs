//! The embedded service's enhanced fan-out: one open SubscribeToShard, pushing a
//! shard's records as they arrive, heartbeats when idle, and the end of a closed shard.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::kinesis::{KinesisError, SubscriptionEvent};

use super::limits::metered_size;
use super::lock;
use super::state::{behind_latest, KinesisState};

/// One open subscription of the memory backend.
pub(super) struct MemSubscription {
    pub(super) state: Arc<Mutex<KinesisState>>,
    pub(super) changes: watch::Receiver<()>,
    pub(super) stream: String,
    /// The fan-out consumer's ARN: its budget per shard paces the events.
    pub(super) consumer: String,
    pub(super) shard_id: String,
    /// The index of the next record to deliver.
    pub(super) next: usize,
    pub(super) ends_at: Instant,
    /// When an event is due even without records.
    pub(super) heartbeat_at: Instant,
    pub(super) max_records: usize,
    pub(super) heartbeat_interval: Duration,
    pub(super) report_shard_end: bool,
    pub(super) interruptions: u64,
    /// When the consumer's throughput budget lets the next records go (see
    /// `KinesisLimits::fan_out_bytes_per_second`); `None` when not held back.
    pub(super) paced_until: Option<Instant>,
}

/// What one look at the shard gave.
enum Step {
    Event(Result<SubscriptionEvent, KinesisError>),
    /// Nothing to send yet.
    Wait,
}

impl MemSubscription {
    /// The next item, and the subscription if it goes on; `None` once it has ended.
    pub(super) async fn next_event(
        mut self,
    ) -> Option<(Result<SubscriptionEvent, KinesisError>, Option<Self>)> {
        loop {
            if Instant::now() >= self.ends_at {
                return None;
            }
            // Marks the current state seen before looking at it: a write after the look
            // wakes the wait below.
            self.changes.borrow_and_update();
            match self.step() {
                Step::Event(Ok(event)) => {
                    self.heartbeat_at = Instant::now() + self.heartbeat_interval;
                    let last = event.continuation.is_none();
                    return Some((Ok(event), (!last).then_some(self)));
                }
                Step::Event(Err(e)) => return Some((Err(e), None)),
                Step::Wait => {}
            }
            // Held back by the throughput limit: the records go as soon as it allows
            // (well within a heartbeat interval), and no heartbeat goes before them.
            let wake_at = self.paced_until.unwrap_or(self.heartbeat_at);
            // Biased: records that arrived go out before a heartbeat or the end.
            tokio::select! {
                biased;
                changed = self.changes.changed() => {
                    if changed.is_err() {
                        return None; // the backend is gone
                    }
                }
                _ = tokio::time::sleep_until(wake_at) => {}
                _ = tokio::time::sleep_until(self.ends_at) => return None,
            }
        }
    }

    /// Looks at the shard once: records to send, the shard's end, a heartbeat that is
    /// due, or nothing.
    fn step(&mut self) -> Step {
        let mut s = lock(&self.state);
        if s.interruptions != self.interruptions {
            return Step::Event(Err(KinesisError::Other(
                "the subscription was interrupted".into(),
            )));
        }
        let s = &mut *s;
        let Some(shard) = s.streams.get(&self.stream).and_then(|st| {
            st.shards
                .iter()
                .find(|sh| sh.info.shard_id == self.shard_id)
        }) else {
            return Step::Event(Err(KinesisError::NotFound(
                format!("shard {} of {}", self.shard_id, self.stream).into(),
            )));
        };
        let start = self
            .next
            .max(s.first_retained(&self.stream, &shard.records));
        let mut end = (start + self.max_records).min(shard.records.len());
        let sizes = shard.records[start..end]
            .iter()
            .map(|r| metered_size(r.data.len(), &r.partition_key));
        match s.meters.fan_out(&self.consumer, &self.shard_id, sizes) {
            Ok(n) => {
                end = start + n;
                self.paced_until = None;
            }
            Err(wait) => {
                self.paced_until = Some(Instant::now() + wait);
                return Step::Wait;
            }
        }
        let at_shard_end =
            self.report_shard_end && end == shard.records.len() && shard.info.is_closed();
        if end == start && !at_shard_end && Instant::now() < self.heartbeat_at {
            return Step::Wait;
        }
        let records = shard.records[start..end].to_vec();
        let continuation = if at_shard_end {
            None
        } else {
            // AFTER this sequence number comes the next record: the last one delivered,
            // or, before any, the last one before the starting point (the shard's own
            // starting sequence number precedes all of its records).
            Some(match end.checked_sub(1) {
                Some(last) => shard.records[last].sequence_number.clone(),
                None => shard.info.starting_sequence_number.clone(),
            })
        };
        let may_cut_short =
            !at_shard_end && end > start && end < shard.records.len() && shard.info.is_closed();
        let child_shards = if at_shard_end {
            s.streams
                .get(&self.stream)
                .map(|st| {
                    st.shards
                        .iter()
                        .filter(|c| c.info.parents().contains(&self.shard_id))
                        .map(|c| c.info.shard_id.clone())
                        .collect()
                })
                .unwrap_or_default()
        } else {
            Vec::new()
        };
        let millis_behind_latest = behind_latest(&shard.records, end);
        if s.draw(|f| f.error) {
            return Step::Event(Err(KinesisError::Other(
                "injected service error in the subscription".into(),
            )));
        }
        let cut_short = may_cut_short && s.draw_cut_short();
        self.next = end;
        Step::Event(Ok(SubscriptionEvent {
            records,
            continuation: continuation.filter(|_| !cut_short),
            millis_behind_latest,
            child_shards,
        }))
    }
}
