//! Where a read becomes batches for the handlers: [`ShardReader::deliver`] splits KPL
//! aggregates into their user records (skipping or counting those of another shard),
//! drops what the checkpoint covers or this reader already delivered, makes each record a
//! [`Message`] (headers recognised), holds everything until the lease is known to be
//! ours, takes the batch's share of the read-ahead budget and registers it with the
//! watermark before sending it.

use tokio::sync::OwnedSemaphorePermit;

use super::ack::Mark;
use super::reader::{Flow, ShardReader, READ_AHEAD};
use crate::aggregation::{self, Deaggregated, MisplacedUserRecords};
use crate::consumer::read_ahead::MESSAGE_OVERHEAD;
use crate::kinesis::Record;
use crate::lease::Checkpoint;
use crate::message::{Batch, Message, Metadata};
use crate::sequence::Position;

impl ShardReader {
    /// Hands one read to the handlers. Drops, record by record, what is at or before
    /// `handled` (covered by the checkpoint, or already delivered by this reader: reads
    /// may overlap after a recovery); if anything is left, waits until the lease is
    /// known to be ours, registers the batch with the watermark, moves `handled` to its
    /// last record and sends it. The batch takes its share of the worker's read-ahead
    /// budget first (from `reserved`, what the reader set aside before reading, and
    /// more if needed), waiting while the budget is used up.
    pub(super) async fn deliver(
        &self,
        records: Vec<Record>,
        millis_behind_latest: Option<i64>,
        handled: &mut Checkpoint,
        reserved: Option<OwnedSemaphorePermit>,
    ) -> Flow {
        let raw = records.len();
        if let Some(ms) = millis_behind_latest {
            self.metrics.millis_behind.set(ms as f64);
        }
        let mut messages = Vec::with_capacity(raw);
        // A table's stream carries change records, never KPL aggregates: one that
        // happened to look like one must not be split.
        let aggregated = self.kinesis.records_may_be_aggregated();
        for record in records {
            if !aggregated {
                self.push_plain(record, handled, &mut messages);
                continue;
            }
            match aggregation::deaggregate(record) {
                Deaggregated::Plain(record) => self.push_plain(record, handled, &mut messages),
                Deaggregated::Corrupt { record, reason } => {
                    tracing::warn!(
                        monotonic_counter.shardflow.kpl_corrupt = 1u64,
                        shard = %self.shard_id,
                        sequence = %record.sequence_number,
                        %reason,
                        "aggregated record does not verify; delivering it as a plain record"
                    );
                    self.push_plain(record, handled, &mut messages);
                }
                Deaggregated::Aggregated {
                    record,
                    user_records,
                } => self.push_user_records(record, user_records, handled, &mut messages),
            }
        }
        // The lag is reported per read: every record of it carries the same value.
        for message in &mut messages {
            message.metadata.millis_behind_latest = millis_behind_latest;
        }
        if raw > messages.len() {
            tracing::debug!(shard = %self.shard_id, skipped = raw - messages.len(), "dropped records already handled");
        }
        let Some(last) = messages.last() else {
            // Caught up (or only records already handled): the shard is healthy, unless
            // what it handed out before still waits to be handled.
            if self.progress.idle() {
                self.health.progress(&self.shard_id);
            }
            return Flow::NothingNew;
        };
        // After a pause longer than the renewal margin the lease may already be
        // someone else's: hand nothing out until a renewal proves it is ours.
        let fresh_for = self.config.lease_fresh_for();
        if !self.lease.hold_until_fresh(fresh_for, "records").await {
            return Flow::Stop;
        }
        let last = last.position();
        let accounted = messages
            .iter()
            .map(|m| m.payload.len() + m.metadata.partition_key.len() + MESSAGE_OVERHEAD)
            .sum();
        let share = {
            let _blocked = self.progress.blocked_on(READ_AHEAD);
            self.worker.read_ahead.take(reserved, accounted).await
        };
        // Room first, then register: a batch registered but never sent (the reader
        // dropped while waiting for room) would hold every drain until its timeout.
        let room = {
            let _blocked = self
                .progress
                .blocked_on("room in the channel to the handlers");
            self.out.reserve().await
        };
        let Ok(permit) = room else {
            return Flow::Stop;
        };
        let bytes = messages.iter().map(|m| m.payload.len()).sum();
        let in_flight = self.metrics.delivered(messages.len(), bytes);
        let ack = self
            .progress
            .register(Mark::At(last.clone()))
            .tracking(in_flight)
            .holding(share)
            .into_handle();
        *handled = Checkpoint::At(last);
        permit.send(Batch {
            stream: self.stream.clone(),
            shard_id: self.shard_id.clone(),
            messages,
            millis_behind_latest,
            ack: Some(ack),
        });
        Flow::Delivered
    }

    fn message(
        &self,
        position: Position,
        partition_key: String,
        explicit_hash_key: Option<String>,
        approximate_arrival: Option<std::time::SystemTime>,
        payload: bytes::Bytes,
    ) -> Message {
        let (headers, payload) = match self.config.header_format.read(&payload) {
            Some(envelope) => envelope,
            None => (crate::headers::Headers::new(), payload),
        };
        Message {
            metadata: Metadata {
                stream: self.stream.clone(),
                shard_id: self.shard_id.clone(),
                sequence_number: position.sequence,
                sub_sequence_number: position.sub_sequence,
                partition_key,
                explicit_hash_key,
                approximate_arrival,
                millis_behind_latest: None,
                lease_lost: self.lease_lost.clone(),
            },
            headers,
            payload,
        }
    }

    fn push_plain(&self, record: Record, handled: &Checkpoint, messages: &mut Vec<Message>) {
        let position = Position::new(record.sequence_number, 0);
        if !handled.covers(&position) {
            messages.push(self.message(
                position,
                record.partition_key,
                None,
                record.approximate_arrival,
                record.data,
            ));
        }
    }

    /// One message per KPL user record at (sequence, sub-sequence), dropping those
    /// already handled, so a restart inside an aggregate resumes right after the last
    /// handled user record. User records whose hash key belongs to another shard (a
    /// producer's stale shard map around a reshard) are delivered or skipped as
    /// [`MisplacedUserRecords`] says, and counted when debug events are on.
    fn push_user_records(
        &self,
        record: Record,
        user_records: Vec<aggregation::UserRecord>,
        handled: &Checkpoint,
        messages: &mut Vec<Message>,
    ) {
        let choice = self.config.misplaced_user_records;
        let range = self.hash_range.filter(|_| {
            choice != MisplacedUserRecords::Deliver || tracing::enabled!(tracing::Level::DEBUG)
        });
        // Each user record's hash (an MD5 of its partition key) is checked once.
        let misplaced: Vec<bool> = match range {
            Some((start, end)) => user_records
                .iter()
                .map(|user| !aggregation::belongs_to_shard(user, start, end))
                .collect(),
            None => Vec::new(),
        };
        let elsewhere = misplaced.iter().filter(|m| **m).count() as u64;
        let skip_all = elsewhere > 0 && choice == MisplacedUserRecords::SkipAggregate;
        let mut skipped = 0u64;
        for (i, user) in user_records.into_iter().enumerate() {
            let outside = misplaced.get(i).copied().unwrap_or(false);
            if skip_all || (choice == MisplacedUserRecords::SkipRecords && outside) {
                skipped += 1;
                continue;
            }
            let position = Position::new(record.sequence_number.clone(), user.sub_sequence);
            if !handled.covers(&position) {
                messages.push(self.message(
                    position,
                    user.partition_key,
                    user.explicit_hash_key,
                    record.approximate_arrival,
                    user.data,
                ));
            }
        }
        if elsewhere > 0 {
            tracing::debug!(
                monotonic_counter.shardflow.kpl_outside_shard = elsewhere,
                skipped,
                shard = %self.shard_id,
                sequence = %record.sequence_number,
                "KPL user records whose hash key belongs to another shard"
            );
        }
    }
}
