//! Consumer-group coordination: a [`Lease`] per shard in a [`LeaseStore`] (DynamoDB in
//! [`dynamo::DynamoLeaseStore`], memory in [`crate::memory::MemoryLeaseStore`]).
//!
//! A lease row names the shard (`leaseKey`), its owner (`leaseOwner`), a counter the
//! owner bumps on every renewal (`leaseCounter`, the fencing token), and the shard's
//! checkpoint. Every write is conditional on the owner and counter the writer last
//! saw, so a worker that lost a lease can never move its checkpoint.

pub mod dynamo;
mod held;

pub use held::HeldLease;

use std::fmt;
use std::str::FromStr;

use async_trait::async_trait;

use crate::sequence::{Position, SequenceNumber};

/// How far a shard has been handled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Checkpoint {
    /// Nothing handled yet; start at the oldest retained record.
    TrimHorizon,
    /// Nothing handled yet; start at the tip of the shard.
    Latest,
    /// Nothing handled yet; start at the consumer's configured timestamp.
    AtTimestamp,
    /// Every record up to and including this position is handled.
    At(Position),
    /// The shard is closed and every record of it is handled.
    ShardEnd,
}

impl Checkpoint {
    /// The KCL's string form of the `checkpoint` attribute: a sentinel or the digits.
    pub fn as_attribute(&self) -> (String, u64) {
        match self {
            Checkpoint::TrimHorizon => ("TRIM_HORIZON".into(), 0),
            Checkpoint::Latest => ("LATEST".into(), 0),
            Checkpoint::AtTimestamp => ("AT_TIMESTAMP".into(), 0),
            Checkpoint::ShardEnd => ("SHARD_END".into(), 0),
            Checkpoint::At(p) => (p.sequence.as_str().to_owned(), p.sub_sequence),
        }
    }

    /// Parses the `checkpoint` and `checkpointSubSequenceNumber` attributes.
    pub fn from_attribute(value: &str, sub_sequence: u64) -> Result<Self, LeaseError> {
        Ok(match value {
            "TRIM_HORIZON" => Checkpoint::TrimHorizon,
            "LATEST" => Checkpoint::Latest,
            "AT_TIMESTAMP" => Checkpoint::AtTimestamp,
            "SHARD_END" => Checkpoint::ShardEnd,
            digits => Checkpoint::At(Position::new(
                SequenceNumber::from_str(digits)
                    .map_err(|e| LeaseError::Corrupt(format!("checkpoint {digits:?}: {e}")))?,
                sub_sequence,
            )),
        })
    }

    /// Whether the record at `position` is already covered (handled) by this checkpoint.
    pub fn covers(&self, position: &Position) -> bool {
        match self {
            Checkpoint::At(p) => position <= p,
            Checkpoint::ShardEnd => true,
            _ => false,
        }
    }
}

impl fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpoint::At(p) => write!(f, "{p}"),
            other => f.write_str(&other.as_attribute().0),
        }
    }
}

/// One shard's lease row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The shard id (`leaseKey`).
    pub key: String,
    /// The worker holding it (`leaseOwner`), if any.
    pub owner: Option<String>,
    /// Bumped by every renewal, take and release (`leaseCounter`): the fencing token.
    pub counter: u64,
    /// How far the shard has been handled.
    pub checkpoint: Checkpoint,
    /// The shard's parents (`parentShardId`): it is read only after they reach SHARD_END.
    pub parents: Vec<String>,
    /// A worker that wants this lease and asks the owner to hand it over (`pendingOwner`):
    /// the owner drains, checkpoints and releases to it.
    pub pending_owner: Option<String>,
}

impl Lease {
    /// A new, unowned lease for a shard, starting at `checkpoint`.
    pub fn new(key: impl Into<String>, parents: Vec<String>, checkpoint: Checkpoint) -> Self {
        Lease {
            key: key.into(),
            owner: None,
            counter: 0,
            checkpoint,
            parents,
            pending_owner: None,
        }
    }
}

/// Errors of the lease store.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// The conditional write failed: someone else changed the lease (it was taken,
    /// renewed by another owner, or released). The caller no longer holds it.
    #[error("lease {0} changed under us (conditional write failed)")]
    Conflict(String),
    /// Throttled by the store: back off and retry.
    #[error("lease store throttled: {0}")]
    Throttled(String),
    /// A row that does not parse.
    #[error("corrupt lease row: {0}")]
    Corrupt(String),
    /// The lease table does not exist (deleted while the group runs). Re-creating it
    /// would restart every shard at its initial position, so it is never done after
    /// start-up: a worker whose table stays missing stops with this error.
    #[error("the lease table {table} does not exist")]
    TableMissing {
        /// The table's name.
        table: String,
    },
    /// The call did not answer within its deadline. Its outcome is unknown: a write may
    /// have landed (see [`HeldLease`] for how a renewal that landed is adopted).
    #[error("lease store call {op} did not answer within {after:?}")]
    TimedOut {
        /// The call (`renew`, `checkpoint`, `list`, ...).
        op: &'static str,
        /// The deadline it missed.
        after: std::time::Duration,
    },
    /// Another failure (network, service error); retry with backoff.
    #[error("lease store call failed: {0}")]
    Other(String),
}

/// Where leases and checkpoints live. Every write is conditional: `expected` is the
/// lease as the caller last saw it, and the write happens only if the stored row still
/// has the same owner and counter. On success the new row is returned.
#[async_trait]
pub trait LeaseStore: Send + Sync + 'static {
    /// Creates the table if it does not exist yet and waits until it can be used.
    async fn ensure_table(&self) -> Result<(), LeaseError>;

    /// Every lease row.
    async fn list(&self) -> Result<Vec<Lease>, LeaseError>;

    /// One lease row, if present.
    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError>;

    /// Creates the row unless one with the same key exists; returns whether it created it.
    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError>;

    /// Sets the owner to `new_owner`, bumps the counter and clears `pending_owner`,
    /// if the row still matches `expected`.
    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError>;

    /// Bumps the counter (a heartbeat) if the row still matches `expected`.
    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError>;

    /// Stores a checkpoint if the row still matches `expected` (the counter is kept).
    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError>;

    /// Clears the owner (bumping the counter) if the row still matches `expected`.
    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError>;

    /// Records that `worker` asks for a hand-off, if the row still matches `expected`
    /// (the counter is kept so the owner's fencing token stays valid).
    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError>;

    /// Deletes the row if it still matches `expected` (clean-up of finished shards).
    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError>;
}
