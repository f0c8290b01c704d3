//! One owned shard's path, from a read to its checkpoint: the shard task (`task`) runs
//! the reader (`reader`), which drops what the checkpoint covers and delivers batches
//! within the worker's read-ahead budget; in `run` mode `dispatch` hands
//! them to the user's service; acknowledgements (`ack`) move the watermark the task
//! commits, fenced by the lease.

pub(crate) mod ack;
pub(crate) mod dispatch;
mod reader;
mod task;

pub(crate) use task::{ShardExit, ShardTask};
