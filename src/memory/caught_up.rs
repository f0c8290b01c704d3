//! What a test of one's own needs from the embedded backend beyond reading and writing:
//! creating and resharding a stream without importing [`StreamAdmin`], and knowing when
//! a consumer group has handled everything written so far.

use std::time::Duration;

use crate::aggregation::{deaggregate, Deaggregated};
use crate::kinesis::{KinesisApi, KinesisError, StreamAdmin};
use crate::lease::{Checkpoint, Lease};
use crate::sequence::Position;

use super::Memory;

/// How often [`Memory::wait_caught_up`] looks again (on tokio's clock, so a test with a
/// paused clock does not wait in real time).
const POLL_INTERVAL: Duration = Duration::from_millis(10);

impl Memory {
    /// Creates `stream` with `shards` shards (an existing stream is left as it is). The
    /// same as [`StreamAdmin::create_stream`] on [`Memory::streams`], without the import.
    pub async fn create_stream(&self, stream: &str, shards: u32) -> Result<(), KinesisError> {
        self.streams().create_stream(stream, shards).await
    }

    /// Splits the open shard `shard_id` of `stream` in the middle of its hash range, as
    /// Kinesis' SplitShard does: the shard is closed and two children share its range.
    /// Returns the children's ids, the lower half's first. For another split point or a
    /// merge, see [`StreamAdmin`] (through [`Memory::streams`]).
    pub async fn split_shard_in_half(
        &self,
        stream: &str,
        shard_id: &str,
    ) -> Result<Vec<String>, KinesisError> {
        let kinesis = self.streams();
        let before = kinesis.shard_ids(stream);
        let shard = kinesis
            .list_shards(stream)
            .await?
            .into_iter()
            .find(|s| s.shard_id == shard_id)
            .ok_or_else(|| {
                KinesisError::NotFound(format!("no open shard {shard_id} in {stream}").into())
            })?;
        let middle =
            shard.starting_hash_key + (shard.ending_hash_key - shard.starting_hash_key) / 2;
        kinesis.split_shard(stream, shard_id, middle + 1).await?;
        Ok(kinesis
            .shard_ids(stream)
            .into_iter()
            .filter(|id| !before.contains(id))
            .collect())
    }

    /// Whether the consumer group whose lease table is `table` (by default the group's
    /// name) has handled and checkpointed every record written to `stream` so far: each
    /// shard that holds records has a lease row whose checkpoint is at its last record
    /// (the last user record of an aggregate) or at `SHARD_END`. A shard without records
    /// counts as caught up. For a single-stream group; faults injected into the backend
    /// do not apply to this check.
    ///
    /// Checkpoints are written at the consumer's [`CheckpointPolicy`](crate::CheckpointPolicy)
    /// (every 5 s by default), so a group catches up a little after its handler finished.
    pub fn caught_up(&self, stream: &str, table: &str) -> bool {
        let rows = self.table(table).rows();
        let kinesis = self.streams();
        kinesis.shard_ids(stream).iter().all(|shard_id| {
            let Some(last) = kinesis.records(stream, shard_id).pop() else {
                return true;
            };
            let Some(row) = rows.iter().find(|row: &&Lease| row.key == *shard_id) else {
                return false;
            };
            match &row.checkpoint {
                Checkpoint::ShardEnd => true,
                Checkpoint::At(position) => *position >= last_position(last),
                Checkpoint::TrimHorizon | Checkpoint::Latest | Checkpoint::AtTimestamp(_) => false,
            }
        })
    }

    /// Waits until [`Memory::caught_up`] is true, looking again every 10 ms of tokio's
    /// clock. It waits for ever when the group never catches up (a handler that keeps
    /// failing, no consumer running): bound it with `tokio::time::timeout`.
    pub async fn wait_caught_up(&self, stream: &str, table: &str) {
        while !self.caught_up(stream, table) {
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

/// The position of the last user record a Kinesis record holds: its last sub-sequence
/// when it is a valid aggregate, 0 otherwise (as the consumer delivers it).
fn last_position(record: crate::kinesis::Record) -> Position {
    match deaggregate(record) {
        Deaggregated::Aggregated {
            record,
            user_records,
        } => Position {
            sequence: record.sequence_number,
            sub_sequence: user_records.len().saturating_sub(1) as u64,
        },
        Deaggregated::Plain(record) | Deaggregated::Corrupt { record, .. } => Position {
            sequence: record.sequence_number,
            sub_sequence: 0,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::lease::LeaseStore;
    use crate::producer::{Producer, ProducerRecord};
    use crate::{CheckpointPolicy, Consumer, Message};

    /// Every record written before and after a split is handled by the time the wait
    /// ends, and not before: the check is false while a record is unhandled.
    #[tokio::test(start_paused = true)]
    async fn the_wait_ends_once_every_record_is_handled_and_checkpointed() {
        let memory = Memory::new();
        memory.create_stream("orders", 2).await.unwrap();
        let producer = Producer::builder()
            .stream("orders")
            .backend(memory.clone())
            .build()
            .unwrap();
        let mut written = BTreeSet::new();
        for i in 0..60 {
            let payload = format!("order-{i}");
            producer
                .send(ProducerRecord::new(
                    payload.clone(),
                    format!("customer-{i}"),
                ))
                .await
                .unwrap();
            written.insert(payload);
        }
        let children = memory
            .split_shard_in_half("orders", "shardId-000000000000")
            .await
            .unwrap();
        assert_eq!(children.len(), 2, "{children:?}");
        for i in 60..120 {
            let payload = format!("order-{i}");
            producer
                .send(ProducerRecord::new(
                    payload.clone(),
                    format!("customer-{i}"),
                ))
                .await
                .unwrap();
            written.insert(payload);
        }
        producer.close().await;
        assert!(!memory.caught_up("orders", "billing"), "nothing ran yet");

        let handled = Arc::new(Mutex::new(BTreeSet::new()));
        let seen = handled.clone();
        let consumer = Consumer::builder()
            .stream("orders")
            .group("billing")
            .backend(memory.clone())
            .checkpoint(CheckpointPolicy::Interval(Duration::from_secs(5)))
            .build()
            .unwrap();
        let running = consumer
            .run(tower::service_fn(move |msg: Message| {
                let seen = seen.clone();
                async move {
                    let payload = String::from_utf8_lossy(&msg.payload).into_owned();
                    seen.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(payload);
                    Ok::<_, std::io::Error>(())
                }
            }))
            .spawn();
        tokio::time::timeout(
            Duration::from_secs(120),
            memory.wait_caught_up("orders", "billing"),
        )
        .await
        .expect("the group catches up");
        let handled = handled.lock().unwrap_or_else(|e| e.into_inner()).clone();
        assert_eq!(handled, written, "every record handled when the wait ends");
        running.shutdown().await.unwrap();
        assert!(memory.caught_up("orders", "billing"));
    }

    /// A shard whose last record is unhandled is not caught up, whatever the others.
    #[tokio::test(start_paused = true)]
    async fn a_checkpoint_short_of_the_last_record_is_not_caught_up() {
        let memory = Memory::new();
        memory.create_stream("orders", 1).await.unwrap();
        let producer = Producer::builder()
            .stream("orders")
            .backend(memory.clone())
            .build()
            .unwrap();
        producer
            .send(ProducerRecord::new("first", "customer-1"))
            .await
            .unwrap();
        let second = producer
            .send(ProducerRecord::new("second", "customer-1"))
            .await
            .unwrap();
        producer.close().await;
        let first = memory.streams().records("orders", "shardId-000000000000")[0]
            .sequence_number
            .clone();
        let at = |sequence| {
            let checkpoint = Checkpoint::At(Position::new(sequence, 0));
            Lease::new("shardId-000000000000", vec![], checkpoint)
        };
        let short = memory.table("short");
        assert!(short.create(&at(first)).await.unwrap());
        assert!(!memory.caught_up("orders", "short"));
        let done = memory.table("done");
        assert!(done.create(&at(second.sequence_number)).await.unwrap());
        assert!(memory.caught_up("orders", "done"));
    }
}
