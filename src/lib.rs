//! shardflow: AWS Kinesis as a `Stream` of messages, handled by `tower` services, with
//! each shard's checkpoint committed to DynamoDB only after its records were handled.
//!
//! Start with [`Consumer::builder`]; the README has a tour.

pub mod aggregation;
pub mod backend;
mod backoff;
pub mod checkpoint;
pub mod consumer;
pub mod kinesis;
pub mod lease;
pub mod memory;

pub mod message;
pub mod producer;
pub mod sequence;

pub use backend::{Aws, AwsTimeouts, Backend};
pub use consumer::{
    BatchStream, CheckpointPolicy, ConfigError, Consumer, ConsumerBuilder, ConsumerError,
    InitialPosition, Run, Running, ShutdownHandle,
};
pub use memory::Memory;
pub use message::{Batch, Headers, Message};
pub use producer::{ProduceError, Producer, ProducerBuilder, ProducerRecord, Stored};
pub use sequence::{Position, SequenceNumber};
