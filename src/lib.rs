//! shardflow: AWS Kinesis as a `Stream` of messages, handled by `tower` services, with
//! each shard's checkpoint committed to DynamoDB only after its records were handled.
//!
//! Start with [`Consumer::builder`]; the README has a tour.

pub mod backend;
pub mod checkpoint;
pub mod kinesis;
pub mod lease;
pub mod memory;

pub mod message;
pub mod sequence;

pub use backend::{Aws, Backend};
pub use message::{Batch, Headers, Message};
pub use sequence::{Position, SequenceNumber};
