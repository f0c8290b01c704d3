//! Leadership of a consumer group, held like a lease: one item (an owner and a counter,
//! the fencing token) in a small coordinator-state table beside the lease table, never
//! in the lease table itself (a KCL worker lists every row of that table as a shard).
//!
//! The leader renews the item on its renewal timer; every other worker reads it at the
//! same pace and takes it over, with a write conditional on the counter it saw, when
//! the counter has not moved for a lease duration (counted on the reader's own clock,
//! as lease expiry is) or the item is released (no owner). Of several workers racing for
//! it, one write lands; the others fail their condition.

use async_trait::async_trait;

use super::LeaseError;

/// The key of the leader item of a single-stream consumer group.
pub const LEADER_KEY: &str = "leader";

/// The leader item of one consumer group (or of one stream of a multi-stream group).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderItem {
    /// The item's key ([`LEADER_KEY`], or the stream's identity in a multi-stream table).
    pub key: String,
    /// The worker incarnation that leads (`leaderOwner`); `None` once released.
    pub owner: Option<String>,
    /// Bumped by every take, renewal and release (`leaderCounter`): the fencing token.
    pub counter: u64,
}

/// Where the leader items live: the coordinator-state table of a lease table. Every
/// write is conditional on the item as the caller last saw it (owner and counter, or
/// its absence), so of two workers racing for leadership exactly one wins, and a leader
/// that lost the item can no longer renew it.
#[async_trait]
pub trait CoordinatorState: Send + Sync + 'static {
    /// Creates the table if it does not exist yet and waits until it can be used.
    async fn ensure_table(&self) -> Result<(), LeaseError>;

    /// The item `key`, if present.
    async fn get(&self, key: &str) -> Result<Option<LeaderItem>, LeaseError>;

    /// Makes `owner` the leader: sets the owner and bumps the counter, if the item is
    /// still as `seen` (`None`: absent, the item is created).
    async fn claim(
        &self,
        key: &str,
        seen: Option<&LeaderItem>,
        owner: &str,
    ) -> Result<LeaderItem, LeaseError>;

    /// Bumps the counter (a heartbeat) if the item is still `held`.
    async fn renew(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError>;

    /// Clears the owner (bumping the counter) if the item is still `held`: the next
    /// worker that reads it takes over at once.
    async fn release(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError>;
}
