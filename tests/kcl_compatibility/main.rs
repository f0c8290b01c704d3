//! Compatibility with the Java KCL's lease table: moving a KCL application over in place,
//! a mixed fleet, and the rows of finished shards as the KCL writes them.

mod migration;
mod mixed_fleet;
mod shard_end;
