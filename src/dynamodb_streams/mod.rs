//! DynamoDB Streams as a source: a table's change stream read like a Kinesis stream, with
//! the same consumer, layers, groups, leases and checkpoints. A message read from a table's
//! stream carries one change as its payload ([`record::ChangeRecord`], in the JSON form the
//! DynamoDB Streams API and Lambda use) and a partition key derived from the item's keys,
//! so per-key order means per-item order.

pub mod aws;
pub mod record;

pub use aws::AwsTableStreams;
pub use record::{
    AttributeValue, ChangeRecord, ChangeRecordError, EventName, Image, StreamViewType,
};
