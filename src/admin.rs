//! Operating a consumer group from outside it (what the `shardflow` command line uses):
//! moving a shard's checkpoint safely while the group runs.
//!
//! A checkpoint reset never races the shard's owner. An unowned row (nobody reads the
//! shard, or it is finished at `SHARD_END`) is changed with a write conditional on its
//! counter and on having no owner ([`LeaseStore::reset`]). An owned row gets a reset
//! request ([`LeaseStore::request_reset`], the row's [`Lease::reset_to`], written
//! conditionally on its owner and counter like a hand-off request); the owner, at its
//! next renewal, stops the shard, drains what is in flight, commits it, stores the
//! requested checkpoint with a fenced write and releases the lease, so the shard is read
//! again from the new position by whichever worker takes it next. A row whose owner died
//! keeps the request, and the worker that takes it over applies it the same way.
//!
//! A finished shard reset to an earlier position is read again, and its children are not
//! taken again until it is back at `SHARD_END` (children being read at that moment go on
//! unless they are reset too, which a reset of every shard does).

use crate::lease::{Checkpoint, Lease, LeaseError, LeaseStore};

/// How many times [`reset_checkpoint`] reads the row again after a conditional write
/// lost to the owner's renewal.
const RESET_ATTEMPTS: usize = 10;

/// What [`reset_checkpoint`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResetOutcome {
    /// The row was unowned: its checkpoint is now the new one.
    Applied(Lease),
    /// The row is owned: the request is on the row, and its owner applies it.
    Requested(Lease),
}

/// Errors of the admin calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The lease table has no row for this shard.
    #[error("the lease table has no row for shard {0}")]
    NoSuchLease(String),
    /// The row kept changing under every conditional write (a very busy owner).
    #[error("lease {0} kept changing; try again")]
    Contended(String),
    /// The lease store failed.
    #[error(transparent)]
    Store(#[from] LeaseError),
}

/// Moves shard `key`'s checkpoint to `to`, safely while the group runs (see the
/// [module docs](self)): applied at once on an unowned row, requested from the owner on
/// an owned one. A conditional write that loses to a renewal reads the row again.
pub async fn reset_checkpoint(
    store: &dyn LeaseStore,
    key: &str,
    to: &Checkpoint,
) -> Result<ResetOutcome, AdminError> {
    for _ in 0..RESET_ATTEMPTS {
        let row = store
            .get(key)
            .await?
            .ok_or_else(|| AdminError::NoSuchLease(key.to_owned()))?;
        let result = match row.owner {
            None => store.reset(&row, to).await.map(ResetOutcome::Applied),
            Some(_) => store
                .request_reset(&row, to)
                .await
                .map(ResetOutcome::Requested),
        };
        match result {
            Err(LeaseError::Conflict(_)) => continue,
            other => return Ok(other?),
        }
    }
    Err(AdminError::Contended(key.to_owned()))
}
