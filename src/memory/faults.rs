//! The faults the embedded backend injects, drawn from seeded generators: the stream
//! service's ([`KinesisFaults`]) and the lease and coordinator-state tables'
//! ([`LeaseFaults`]).

use std::time::Duration;

/// Faults the memory stream injects, drawn from a seeded generator.
#[derive(Clone, Debug, Default)]
pub struct KinesisFaults {
    /// Probability that a GetRecords, PutRecords or SubscribeToShard call is throttled.
    pub throttle: f64,
    /// Probability that a GetRecords call finds its iterator expired.
    pub expire_iterator: f64,
    /// Probability that a call fails with a transient service error; for a subscription,
    /// that one of its events is an error instead (which ends the subscription).
    pub error: f64,
    /// Probability that one entry of a PutRecords call fails (a partial failure).
    pub put_entry_failure: f64,
    /// Probability that GetRecords on an open shard answers without a next iterator
    /// (an emulator bug; a reader must not take it for the end of the shard).
    pub missing_next_iterator: f64,
    /// Seed of the generator.
    pub seed: u64,
}

/// Faults the memory lease store injects, drawn from a seeded generator.
#[derive(Clone, Debug, Default)]
pub struct LeaseFaults {
    /// Probability that a write fails before it is applied.
    pub fail_before_write: f64,
    /// Probability that a write is applied but the caller sees an error (a timeout
    /// after the write landed: the ambiguous case).
    pub fail_after_write: f64,
    /// Probability that a call is throttled.
    pub throttle: f64,
    /// Delay added to every call (simulated round trip; honours tokio's paused clock).
    pub latency: Duration,
    /// Seed of the generator.
    pub seed: u64,
}
