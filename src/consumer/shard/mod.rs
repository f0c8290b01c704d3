//! One owned shard's path, from a read to its checkpoint: the shard task (`task`) runs
//! the reader (`reader`), whose reads become batches (`delivery`: what the checkpoint
//! covers dropped, the lease checked fresh, within the worker's read-ahead budget); in `run` mode `dispatch` hands
//! them to the user's service; acknowledgements (`ack`) move the watermark the task
//! commits, fenced by the lease.

pub(crate) mod ack;
mod delivery;
pub(crate) mod dispatch;
mod reader;
mod task;

pub(crate) use task::{ShardExit, ShardTask};
