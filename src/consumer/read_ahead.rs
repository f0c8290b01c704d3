//! The worker-wide read-ahead budget: bytes read from Kinesis and not yet handled, shared
//! by every shard reader of one worker, so a backlog on hundreds of shards cannot hold
//! shards × prefetch × 10 MB in memory (see [`ConsumerBuilder::read_ahead_bytes`]).
//!
//! [`ConsumerBuilder::read_ahead_bytes`]: super::ConsumerBuilder::read_ahead_bytes

use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Bytes per semaphore permit: a permit count is a `u32` per acquisition, and KiB units
/// let one acquisition (and the budget) reach 4 TiB. Rounding a batch up to whole KiB
/// only ever over-counts it.
const UNIT: u64 = 1024;

/// Accounted bytes per delivered message besides its payload and partition key: the
/// message's struct, its sequence number and the metadata' shared pointers.
pub(crate) const MESSAGE_OVERHEAD: usize = 256;

/// The budget: a semaphore of KiB units shared by the shard readers of one worker.
#[derive(Clone, Debug)]
pub(crate) struct ReadAhead {
    semaphore: Arc<Semaphore>,
    units: u32,
}

impl ReadAhead {
    /// A budget of `bytes` (rounded up to whole KiB; validated by the builder to be at
    /// least one KiB and at most `u32::MAX` KiB).
    pub(crate) fn new(bytes: u64) -> Self {
        let units = u32::try_from(bytes.div_ceil(UNIT))
            .unwrap_or(u32::MAX)
            .max(1);
        ReadAhead {
            semaphore: Arc::new(Semaphore::new(units as usize)),
            units,
        }
    }

    /// The units `bytes` take: at least one, and never more than the whole budget, so a
    /// read larger than the budget still proceeds (alone) instead of waiting for ever.
    fn units_for(&self, bytes: usize) -> u32 {
        let units = (bytes as u64).div_ceil(UNIT).max(1);
        u32::try_from(units).unwrap_or(u32::MAX).min(self.units)
    }

    async fn acquire(&self, units: u32) -> OwnedSemaphorePermit {
        // The semaphore is private to this type and never closed, so acquiring cannot
        // fail.
        self.semaphore
            .clone()
            .acquire_many_owned(units)
            .await
            .expect("the read-ahead semaphore is never closed")
    }

    /// Before a read: waits until about `estimate` bytes (the shard's previous read) fit
    /// in the budget, so readers do not fetch while the budget is used up.
    pub(crate) async fn reserve(&self, estimate: usize) -> OwnedSemaphorePermit {
        self.acquire(self.units_for(estimate)).await
    }

    /// After a read of `bytes`: the batch's share of the budget, from `reserved` (what
    /// [`ReadAhead::reserve`] gave before the read; the rest of it is returned) and, if
    /// that is too little, more from the budget. Waiting for more, the reader holds
    /// nothing: readers each holding a reservation while waiting for the rest could
    /// otherwise use the whole budget and wait on each other for ever.
    pub(crate) async fn take(
        &self,
        reserved: Option<OwnedSemaphorePermit>,
        bytes: usize,
    ) -> ReadAheadShare {
        let units = self.units_for(bytes);
        let permit = match reserved {
            Some(mut held) if held.num_permits() >= units as usize => {
                drop(held.split(held.num_permits() - units as usize));
                held
            }
            Some(mut held) => {
                let more = units - held.num_permits() as u32;
                match self.semaphore.clone().try_acquire_many_owned(more) {
                    Ok(extra) => {
                        held.merge(extra);
                        held
                    }
                    Err(_) => {
                        drop(held);
                        self.acquire(units).await
                    }
                }
            }
            None => self.acquire(units).await,
        };
        ReadAheadShare(Mutex::new(Some(permit)))
    }

    /// Bytes of the budget in use now (whole KiB; for tests and benchmarks).
    #[cfg(test)]
    pub(crate) fn in_use(&self) -> u64 {
        (self.units as u64 - self.semaphore.available_permits() as u64) * UNIT
    }
}

/// One delivered batch's share of the [`ReadAhead`] budget: given back when the batch is
/// acknowledged or given up, or when its last acknowledgement handle is dropped (the
/// batch was dropped, e.g. after the lease was lost).
#[derive(Debug)]
pub(crate) struct ReadAheadShare(Mutex<Option<OwnedSemaphorePermit>>);

impl ReadAheadShare {
    /// Gives the share back now (idempotent).
    pub(crate) fn release(&self) {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .take();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn shares_are_counted_until_released_and_an_oversized_read_proceeds_alone() {
        let budget = ReadAhead::new(10 * 1024);
        let a = budget.take(None, 4 * 1024).await;
        let b = budget.take(None, 5 * 1024).await;
        assert_eq!(budget.in_use(), 9 * 1024);
        // Larger than the whole budget: waits until everything else is released, then
        // takes the whole budget (one such read at a time), never for ever.
        let big = tokio::spawn({
            let budget = budget.clone();
            async move { budget.take(None, 100 * 1024).await }
        });
        tokio::task::yield_now().await;
        assert!(!big.is_finished());
        a.release();
        a.release();
        drop(b);
        let big = tokio::time::timeout(std::time::Duration::from_secs(1), big)
            .await
            .expect("an oversized read proceeds once the budget is free")
            .unwrap();
        assert_eq!(budget.in_use(), 10 * 1024);
        big.release();
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reservation_shrinks_to_the_read_or_is_given_up_while_waiting_for_more() {
        let budget = ReadAhead::new(8 * 1024);
        let reserved = budget.reserve(4 * 1024).await;
        let small = budget.take(Some(reserved), 1024).await;
        assert_eq!(budget.in_use(), 1024, "the unused reservation is returned");
        small.release();
        // Every unit but one is held by reservations and both readers need more than
        // they reserved: holding a reservation while waiting would make them wait on
        // each other for ever.
        let r1 = budget.reserve(3 * 1024).await;
        let r2 = budget.reserve(4 * 1024).await;
        let both = async {
            tokio::join!(
                async { budget.take(Some(r1), 6 * 1024).await.release() },
                async { budget.take(Some(r2), 5 * 1024).await.release() }
            )
        };
        tokio::time::timeout(std::time::Duration::from_secs(1), both)
            .await
            .expect("no reader waits for ever");
        assert_eq!(budget.in_use(), 0);
    }
}
