//! The storage behind [`Dedup`](super::Dedup): a key goes from free to in progress
//! (with an expiry) to done (with a TTL), or back to free.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;

use crate::BoxError;

/// What [`DedupStore::reserve`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// The key is ours until the reservation expires: handle the record.
    Reserved,
    /// The key was already handled (within its TTL): skip the record.
    Done,
    /// Another caller (another token) holds an unexpired reservation: wait, then look
    /// again.
    InProgress,
}

/// What [`DedupStore::commit`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Commit {
    /// Our reservation became done.
    Committed,
    /// The key is now done, but our reservation was no longer there (it expired while
    /// the handler ran, and may have been taken by another caller who also ran it).
    Overtaken,
}

/// Why a dedup store could not answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The backend failed (network, throttling, permissions...).
    #[error("dedup store failed to {operation}")]
    Backend {
        /// `"reserve"`, `"commit"`, `"release"`, `"create the table"`...
        operation: &'static str,
        /// The backend's error.
        #[source]
        source: BoxError,
    },
    /// A bounded store is full of reservations that have not expired.
    #[error("dedup store is full ({capacity} keys in progress)")]
    Full {
        /// The store's capacity.
        capacity: usize,
    },
}

impl StoreError {
    /// Always true: a backend failure or a full store passes with time.
    pub fn is_transient(&self) -> bool {
        true
    }
}

/// Where the idempotent receiver keeps its keys.
///
/// The protocol, per record: `reserve` the key (in progress, expiring after `ttl`) →
/// run the handler → on success `commit` (done, kept for `ttl`) → on failure `release`.
/// Implementations must make `reserve` atomic: of two concurrent callers on a free (or
/// expired) key exactly one gets [`Reservation::Reserved`]. An entry, in progress or
/// done, whose expiry has passed counts as free.
///
/// `token` identifies one reservation; `commit` and `release` use it so that a caller
/// whose reservation expired cannot release another caller's. `reserve` is idempotent
/// per token: a key reserved (unexpired) with the same `token` answers
/// [`Reservation::Reserved`] again, so a reserve retried after a lost reply gets its
/// own reservation back instead of waiting for it to expire.
#[async_trait]
pub trait DedupStore: Send + Sync + 'static {
    /// Reserves `key` for `ttl` unless it is done or reserved by someone else.
    async fn reserve(
        &self,
        key: &str,
        token: &str,
        ttl: Duration,
    ) -> Result<Reservation, StoreError>;

    /// Marks `key` done for `ttl` (whether or not the reservation `token` is still there:
    /// the handler did run).
    async fn commit(&self, key: &str, token: &str, ttl: Duration) -> Result<Commit, StoreError>;

    /// Frees `key` if it is still reserved with `token`; does nothing otherwise.
    async fn release(&self, key: &str, token: &str) -> Result<(), StoreError>;
}

#[async_trait]
impl<S: DedupStore + ?Sized> DedupStore for Arc<S> {
    async fn reserve(
        &self,
        key: &str,
        token: &str,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        (**self).reserve(key, token, ttl).await
    }

    async fn commit(&self, key: &str, token: &str, ttl: Duration) -> Result<Commit, StoreError> {
        (**self).commit(key, token, ttl).await
    }

    async fn release(&self, key: &str, token: &str) -> Result<(), StoreError> {
        (**self).release(key, token).await
    }
}

/// A reservation token unique across processes: a random per-process prefix and a counter.
pub(crate) fn new_token() -> String {
    use std::fmt::Write;
    static PREFIX: OnceLock<String> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let prefix = PREFIX.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        // RandomState is seeded from the OS once per process: enough to tell processes
        // apart without a random-number crate.
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        format!("{:016x}-", hasher.finish())
    });
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut token = String::with_capacity(prefix.len() + 16);
    token.push_str(prefix);
    // Writing to a String cannot fail.
    let _ = write!(token, "{n:x}");
    token
}
