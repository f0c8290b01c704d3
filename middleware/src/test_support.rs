//! Hand-made messages for the unit tests.

use bytes::Bytes;
use shardflow::{Headers, Message};

/// Headers of record `sequence` in shard `shardId-000000000000` of stream `orders`.
pub(crate) fn headers(sequence: u64) -> Headers {
    Headers::builder()
        .stream("orders")
        .shard_id("shardId-000000000000")
        .sequence_number(sequence)
        .partition_key(format!("pk-{sequence}"))
        .build()
}

/// A message with the given sequence number and payload.
pub(crate) fn message(sequence: u64, payload: &[u8]) -> Message<Bytes> {
    Message::new(headers(sequence), Bytes::copy_from_slice(payload))
}
