//! Helpers of the multi-process consumer-group test (`tests/group_processes.rs`).

pub mod process;
pub mod proxy;
