//! Hand-made messages for the unit tests.

use std::sync::Arc;

use bytes::Bytes;
use shardflow::{Headers, Message, SequenceNumber};
use tokio_util::sync::CancellationToken;

/// Headers of record `sequence` in shard `shardId-000000000000` of stream `orders`.
pub(crate) fn headers(sequence: u64) -> Headers {
    Headers {
        stream: Arc::from("orders"),
        shard_id: Arc::from("shardId-000000000000"),
        sequence_number: SequenceNumber::new(sequence.to_string()).expect("digits"),
        sub_sequence_number: 0,
        partition_key: format!("pk-{sequence}"),
        explicit_hash_key: None,
        approximate_arrival: None,
        lease_lost: CancellationToken::new(),
    }
}

/// A message with the given sequence number and payload.
pub(crate) fn message(sequence: u64, payload: &[u8]) -> Message<Bytes> {
    Message::new(headers(sequence), Bytes::copy_from_slice(payload))
}
