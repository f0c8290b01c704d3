//! The embedded lease store: rows in a map, conditional writes like DynamoDB's, and
//! injected faults.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::clock::WallClock;
use crate::lease::{checkpoint_time, Checkpoint, CoordinatorState, Lease, LeaseError, LeaseStore};

use super::MemoryCoordinatorState;

use super::faults::LeaseFaults;
use super::lock;

struct LeaseState {
    rows: BTreeMap<String, Lease>,
    faults: LeaseFaults,
    rng: SmallRng,
    requests: u64,
    read: RowsRead,
}

/// The rows the memory lease store handed out, by kind of read: what a DynamoDB table
/// would bill as read items (a Scan reads every row, a Query of the owner index one
/// key per row it names, a GetItem one row).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RowsRead {
    /// Rows returned by `list` (a Scan of the whole table).
    pub listed: u64,
    /// Keys returned by `owned_keys` (a Query of the owner index).
    pub owned: u64,
    /// Rows returned by `get` (a GetItem).
    pub fetched: u64,
}

/// An in-process lease table with the same conditional-write rules as DynamoDB.
pub struct MemoryLeaseStore {
    state: Mutex<LeaseState>,
    /// The coordinator-state table beside it (the group's leader item).
    coordinator: Arc<MemoryCoordinatorState>,
    /// The clock checkpoint writes read ([`Lease::checkpointed_at`]): the backend's.
    clock: WallClock,
}

impl Default for MemoryLeaseStore {
    fn default() -> Self {
        MemoryLeaseStore {
            state: Mutex::new(LeaseState {
                rows: BTreeMap::new(),
                faults: LeaseFaults::default(),
                rng: SmallRng::seed_from_u64(0),
                requests: 0,
                read: RowsRead::default(),
            }),
            coordinator: Arc::default(),
            clock: WallClock::default(),
        }
    }
}

impl MemoryLeaseStore {
    /// An empty table whose checkpoint writes read `clock` (the backend's, see
    /// [`MemoryBuilder::wall_clock`](super::MemoryBuilder::wall_clock)).
    pub(crate) fn with_clock(clock: WallClock) -> Self {
        MemoryLeaseStore {
            clock,
            ..MemoryLeaseStore::default()
        }
    }

    /// Switches fault injection on (or off, with `LeaseFaults::default()`).
    /// The same faults apply to the coordinator-state table beside it (see
    /// [`Self::coordinator`]), drawn from a generator of its own.
    pub fn set_faults(&self, faults: LeaseFaults) {
        self.coordinator.set_faults(faults.clone());
        let mut s = lock(&self.state);
        s.rng = SmallRng::seed_from_u64(faults.seed);
        s.faults = faults;
    }

    /// How many calls the store has answered (the DynamoDB request count), those of the
    /// coordinator-state table beside it included.
    pub fn requests(&self) -> u64 {
        lock(&self.state).requests + self.coordinator.requests()
    }

    /// The rows read so far, by kind of read (see [`RowsRead`]).
    pub fn rows_read(&self) -> RowsRead {
        lock(&self.state).read
    }

    /// The coordinator-state table beside this lease table, where the group's leader
    /// item lives.
    pub fn coordinator(&self) -> Arc<MemoryCoordinatorState> {
        self.coordinator.clone()
    }

    /// A copy of every row, for assertions (a row made unreadable shows what it holds,
    /// with [`Lease::unreadable`] set).
    pub fn rows(&self) -> Vec<Lease> {
        lock(&self.state).rows.values().cloned().collect()
    }

    /// Makes the row under `key` unreadable, as a row whose attribute was written in the
    /// wrong type or form is in DynamoDB: listings and reads answer
    /// [`Lease::unreadable`] with `reason` in its place, and every write to it is refused
    /// with [`LeaseError::Corrupt`]. What the row held is kept for [`Self::repair`].
    /// Returns whether the row exists.
    pub fn make_unreadable(&self, key: &str, reason: &str) -> bool {
        match lock(&self.state).rows.get_mut(key) {
            Some(row) => {
                row.unreadable = Some(reason.to_owned());
                true
            }
            None => false,
        }
    }

    /// Repairs a row made unreadable by [`Self::make_unreadable`]: it reads as it did
    /// before. Returns whether it was unreadable.
    pub fn repair(&self, key: &str) -> bool {
        lock(&self.state)
            .rows
            .get_mut(key)
            .is_some_and(|row| row.unreadable.take().is_some())
    }

    /// A read: `op` answers from the rows and counts what it handed out in `read`.
    async fn read<T>(
        &self,
        op: impl FnOnce(&BTreeMap<String, Lease>, &mut RowsRead) -> T,
    ) -> Result<T, LeaseError> {
        let mut read = RowsRead::default();
        let answer = self.call(false, |rows| Ok(op(rows, &mut read))).await?;
        let mut s = lock(&self.state);
        s.read.listed += read.listed;
        s.read.owned += read.owned;
        s.read.fetched += read.fetched;
        Ok(answer)
    }

    async fn call<T>(
        &self,
        write: bool,
        op: impl FnOnce(&mut BTreeMap<String, Lease>) -> Result<T, LeaseError>,
    ) -> Result<T, LeaseError> {
        let latency = lock(&self.state).faults.latency;
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        let mut s = lock(&self.state);
        s.requests += 1;
        let f = s.faults.clone();
        if f.throttle > 0.0 && s.rng.gen_bool(f.throttle.min(1.0)) {
            return Err(LeaseError::Throttled("injected throttle".into()));
        }
        if write && f.fail_before_write > 0.0 && s.rng.gen_bool(f.fail_before_write.min(1.0)) {
            return Err(LeaseError::Other(
                "injected failure before the write".into(),
            ));
        }
        let result = op(&mut s.rows)?;
        if write && f.fail_after_write > 0.0 && s.rng.gen_bool(f.fail_after_write.min(1.0)) {
            return Err(LeaseError::Other("injected failure after the write".into()));
        }
        Ok(result)
    }
}

/// What a read answers for a stored row: the row, or its stand-in when it was made
/// unreadable.
fn as_read(row: &Lease) -> Lease {
    match &row.unreadable {
        Some(reason) => Lease::unreadable(row.key.clone(), reason.clone()),
        None => row.clone(),
    }
}

/// Refuses any write to a row that does not parse (nor to its stand-in): DynamoDB's
/// conditions could not be evaluated against it either.
fn refuse_unreadable(rows: &BTreeMap<String, Lease>, expected: &Lease) -> Result<(), LeaseError> {
    expected.refuse_if_unreadable()?;
    rows.get(&expected.key)
        .map_or(Ok(()), Lease::refuse_if_unreadable)
}

/// Applies `change` to the row if it still has `expected`'s owner and counter.
fn conditional(
    rows: &mut BTreeMap<String, Lease>,
    expected: &Lease,
    change: impl FnOnce(&mut Lease),
) -> Result<Lease, LeaseError> {
    refuse_unreadable(rows, expected)?;
    match rows.get_mut(&expected.key) {
        Some(row) if row.owner == expected.owner && row.counter == expected.counter => {
            change(row);
            Ok(row.clone())
        }
        _ => Err(LeaseError::Conflict(expected.key.clone())),
    }
}

#[async_trait]
impl LeaseStore for MemoryLeaseStore {
    fn coordinator_state(&self) -> Option<Arc<dyn CoordinatorState>> {
        Some(self.coordinator.clone())
    }

    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.call(false, |_| Ok(())).await
    }

    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        self.read(|rows, read| {
            read.listed += rows.len() as u64;
            rows.values().map(as_read).collect()
        })
        .await
    }

    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        self.read(|rows, read| {
            let row = rows.get(key).map(as_read);
            read.fetched += u64::from(row.is_some());
            row
        })
        .await
    }

    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        self.read(|rows, read| {
            let keys: Vec<String> = rows
                .values()
                .filter(|row| row.unreadable.is_none() && row.owner.as_deref() == Some(owner))
                .map(|row| row.key.clone())
                .collect();
            read.owned += keys.len() as u64;
            keys
        })
        .await
    }

    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        self.call(true, |rows| {
            if rows.contains_key(&lease.key) {
                return Ok(false);
            }
            rows.insert(lease.key.clone(), lease.clone());
            Ok(true)
        })
        .await
    }

    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            refuse_unreadable(rows, expected)?;
            // A hand-over needs the new owner's request to still stand.
            let handover = expected.pending_owner.as_deref() == Some(new_owner);
            let withdrawn = rows
                .get(&expected.key)
                .is_some_and(|row| row.pending_owner.as_deref() != Some(new_owner));
            if handover && withdrawn {
                return Err(LeaseError::Conflict(expected.key.clone()));
            }
            conditional(rows, expected, |row| {
                row.owner_switches = row
                    .owner_switches
                    .saturating_add(crate::lease::owner_switch(row, new_owner));
                row.owner = Some(new_owner.to_owned());
                row.counter = row.counter.saturating_add(1);
                row.pending_owner = None;
                row.checkpoint_owner = None;
            })
        })
        .await
    }

    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            conditional(rows, expected, |row| {
                row.counter = row.counter.saturating_add(1);
                if expected.throughput_kbps.is_some() {
                    row.throughput_kbps = expected.throughput_kbps;
                }
            })
        })
        .await
    }

    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            conditional(rows, expected, |row| {
                row.checkpoint = checkpoint.clone();
                row.owner_switches = 0;
                row.checkpointed_at = Some(checkpoint_time(self.clock.now()));
            })
        })
        .await
    }

    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            conditional(rows, expected, |row| {
                row.owner = None;
                row.counter = row.counter.saturating_add(1);
                row.checkpoint_owner = None;
            })
        })
        .await
    }

    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            refuse_unreadable(rows, expected)?;
            // The first request wins, as in the DynamoDB store.
            let asked_by_another = rows.get(&expected.key).is_some_and(|row| {
                row.pending_owner
                    .as_deref()
                    .is_some_and(|pending| pending != worker)
            });
            if asked_by_another {
                return Err(LeaseError::Conflict(expected.key.clone()));
            }
            conditional(rows, expected, |row| {
                row.pending_owner = Some(worker.to_owned())
            })
        })
        .await
    }

    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            refuse_unreadable(rows, expected)?;
            match rows.get_mut(&expected.key) {
                Some(row) if row.pending_owner.as_deref() == Some(worker) => {
                    row.pending_owner = None;
                    Ok(row.clone())
                }
                _ => Err(LeaseError::Conflict(expected.key.clone())),
            }
        })
        .await
    }

    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            conditional(rows, expected, |row| row.reset_to = Some(to.clone()))
        })
        .await
    }

    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            // Conditional on the request it applies too, as in the DynamoDB store.
            let asked_again = rows
                .get(&expected.key)
                .is_some_and(|row| row.reset_to != expected.reset_to);
            if asked_again {
                return Err(LeaseError::Conflict(expected.key.clone()));
            }
            conditional(rows, expected, |row| {
                row.checkpoint = to.clone();
                row.owner_switches = 0;
                row.reset_to = None;
                row.checkpointed_at = Some(checkpoint_time(self.clock.now()));
            })
        })
        .await
    }

    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            conditional(rows, expected, |row| {
                row.stream.get_or_insert_with(|| stream.to_owned());
            })
        })
        .await
    }

    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        self.call(true, |rows| {
            conditional(rows, expected, |row| {
                let mut children = children.to_vec();
                children.sort();
                row.children = children;
            })
        })
        .await
    }

    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        self.call(true, |rows| {
            conditional(rows, expected, |_| ())?;
            rows.remove(&expected.key);
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn owned_keys_answer_as_a_filtered_listing_and_every_read_is_counted() {
        let store = MemoryLeaseStore::default();
        for (i, owner) in ["w1#a", "w2#b", "w1#a", "", "w1#b"].iter().enumerate() {
            let row = Lease::new(format!("shard-{i}"), Vec::new(), Checkpoint::TrimHorizon);
            assert!(store.create(&row).await.unwrap());
            if !owner.is_empty() {
                store.take(&row, owner).await.unwrap();
            }
        }
        let listed: Vec<String> = crate::lease::owned_by(store.list().await.unwrap(), "w1#a");
        assert_eq!(store.owned_keys("w1#a").await.unwrap(), listed);
        assert_eq!(listed, vec!["shard-0".to_owned(), "shard-2".to_owned()]);
        assert!(store.owned_keys("w9#z").await.unwrap().is_empty());
        assert!(store.get("shard-1").await.unwrap().is_some());
        assert!(store.get("nothing").await.unwrap().is_none());
        assert_eq!(
            store.rows_read(),
            RowsRead {
                listed: 5,
                owned: 2,
                fetched: 1
            }
        );
    }

    #[tokio::test]
    async fn the_first_hand_off_request_wins_and_only_its_worker_withdraws_it() {
        let store = MemoryLeaseStore::default();
        let fresh = Lease::new("shard-a", Vec::new(), Checkpoint::TrimHorizon);
        assert!(store.create(&fresh).await.unwrap());
        let taken = store.take(&fresh, "w1#a").await.unwrap();
        let asked = store.request_handoff(&taken, "w2#b").await.unwrap();
        assert_eq!(asked.pending_owner.as_deref(), Some("w2#b"));
        assert!(matches!(
            store.request_handoff(&asked, "w3#c").await,
            Err(LeaseError::Conflict(_))
        ));
        let again = store.request_handoff(&asked, "w2#b").await.unwrap();
        assert_eq!(again.pending_owner.as_deref(), Some("w2#b"));
        // Withdrawn by its own worker only; a hand-over after that fails.
        assert!(matches!(
            store.withdraw_handoff(&again, "w3#c").await,
            Err(LeaseError::Conflict(_))
        ));
        let withdrawn = store.withdraw_handoff(&again, "w2#b").await.unwrap();
        assert_eq!(
            (withdrawn.pending_owner, withdrawn.counter),
            (None, again.counter)
        );
        assert!(matches!(
            store.take(&again, "w2#b").await,
            Err(LeaseError::Conflict(_))
        ));
    }
}
