//! Hand-made messages for the unit tests.

use bytes::Bytes;
use shardflow::{Message, Metadata};

/// Metadata of record `sequence` in shard `shardId-000000000000` of stream `orders`.
pub(crate) fn metadata(sequence: u64) -> Metadata {
    Metadata::builder()
        .stream("orders")
        .shard_id("shardId-000000000000")
        .sequence_number(sequence)
        .partition_key(format!("pk-{sequence}"))
        .build()
}

/// A message with the given sequence number and payload.
pub(crate) fn message(sequence: u64, payload: &[u8]) -> Message<Bytes> {
    Message::new(metadata(sequence), Bytes::copy_from_slice(payload))
}
