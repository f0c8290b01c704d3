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
