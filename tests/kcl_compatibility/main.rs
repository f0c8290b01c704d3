//! Compatibility with the Java KCL's lease table: moving a KCL application over in place,
//! a mixed fleet, the rows of finished shards as the KCL writes them, and the KCL 3.5
//! single-table format; the same for the KCL's DynamoDB Streams Kinesis Adapter.

mod dynamodb_streams_adapter;
mod kcl_rs;
mod migration;
mod mixed_fleet;
mod shard_end;
mod single_table;
