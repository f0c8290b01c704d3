//! The embedded coordinator-state table: the leader items of one lease table (see
//! [`crate::lease::leader`]), with the same conditional writes as the DynamoDB one and
//! the same injected faults as the lease store beside it.

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::lease::{CoordinatorState, LeaderItem, LeaseError};

use super::faults::LeaseFaults;
use super::lock;

struct State {
    items: BTreeMap<String, LeaderItem>,
    faults: LeaseFaults,
    rng: SmallRng,
    requests: u64,
    gets: u64,
}

/// An in-process coordinator-state table (the leader items of a
/// [`MemoryLeaseStore`](super::MemoryLeaseStore)'s group).
pub struct MemoryCoordinatorState {
    state: Mutex<State>,
}

impl Default for MemoryCoordinatorState {
    fn default() -> Self {
        MemoryCoordinatorState {
            state: Mutex::new(State {
                items: BTreeMap::new(),
                faults: LeaseFaults::default(),
                rng: SmallRng::seed_from_u64(0),
                requests: 0,
                gets: 0,
            }),
        }
    }
}

impl MemoryCoordinatorState {
    /// Switches fault injection on (or off, with `LeaseFaults::default()`); the lease
    /// store's [`set_faults`](super::MemoryLeaseStore::set_faults) sets the same here.
    pub fn set_faults(&self, faults: LeaseFaults) {
        let mut s = lock(&self.state);
        s.rng = SmallRng::seed_from_u64(faults.seed ^ 0x1eade7);
        s.faults = faults;
    }

    /// How many calls the table has answered (the DynamoDB request count).
    pub fn requests(&self) -> u64 {
        lock(&self.state).requests
    }

    /// How many `get`s it answered (each a GetItem of one small item).
    pub fn gets(&self) -> u64 {
        lock(&self.state).gets
    }

    /// A copy of the item `key`, for assertions.
    pub fn item(&self, key: &str) -> Option<LeaderItem> {
        lock(&self.state).items.get(key).cloned()
    }

    async fn call<T>(
        &self,
        write: bool,
        op: impl FnOnce(&mut BTreeMap<String, LeaderItem>) -> Result<T, LeaseError>,
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
        let result = op(&mut s.items)?;
        if write && f.fail_after_write > 0.0 && s.rng.gen_bool(f.fail_after_write.min(1.0)) {
            return Err(LeaseError::Other("injected failure after the write".into()));
        }
        Ok(result)
    }
}

/// Applies `change` to the item `key` if it is still as `seen` (`None`: absent).
fn conditional(
    items: &mut BTreeMap<String, LeaderItem>,
    key: &str,
    seen: Option<&LeaderItem>,
    change: impl FnOnce(&mut LeaderItem),
) -> Result<LeaderItem, LeaseError> {
    let current = items.get(key);
    let same = match (current, seen) {
        (None, None) => true,
        (Some(c), Some(s)) => c.owner == s.owner && c.counter == s.counter,
        _ => false,
    };
    if !same {
        return Err(LeaseError::Conflict(key.to_owned()));
    }
    let item = items.entry(key.to_owned()).or_insert_with(|| LeaderItem {
        key: key.to_owned(),
        owner: None,
        counter: 0,
    });
    change(item);
    Ok(item.clone())
}

#[async_trait]
impl CoordinatorState for MemoryCoordinatorState {
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.call(false, |_| Ok(())).await
    }

    async fn get(&self, key: &str) -> Result<Option<LeaderItem>, LeaseError> {
        let item = self
            .call(false, |items| Ok(items.get(key).cloned()))
            .await?;
        lock(&self.state).gets += 1;
        Ok(item)
    }

    async fn claim(
        &self,
        key: &str,
        seen: Option<&LeaderItem>,
        owner: &str,
    ) -> Result<LeaderItem, LeaseError> {
        self.call(true, |items| {
            conditional(items, key, seen, |item| {
                item.owner = Some(owner.to_owned());
                item.counter = item.counter.saturating_add(1);
            })
        })
        .await
    }

    async fn renew(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        self.call(true, |items| {
            if held.owner.is_none() {
                return Err(LeaseError::Conflict(held.key.clone()));
            }
            conditional(items, &held.key, Some(held), |item| {
                item.counter = item.counter.saturating_add(1);
            })
        })
        .await
    }

    async fn release(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        self.call(true, |items| {
            if held.owner.is_none() {
                return Err(LeaseError::Conflict(held.key.clone()));
            }
            conditional(items, &held.key, Some(held), |item| {
                item.owner = None;
                item.counter = item.counter.saturating_add(1);
            })
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn of_two_claims_on_the_same_view_exactly_one_lands_and_only_the_leader_renews() {
        let state = MemoryCoordinatorState::default();
        assert_eq!(state.get("g").await.unwrap(), None);
        let first = state.claim("g", None, "w1#a").await.unwrap();
        assert!(matches!(
            state.claim("g", None, "w2#b").await,
            Err(LeaseError::Conflict(_))
        ));
        assert_eq!((first.owner.as_deref(), first.counter), (Some("w1#a"), 1));
        let renewed = state.renew(&first).await.unwrap();
        // Two workers that saw the same counter race: one wins, the other is fenced.
        let a = state.claim("g", Some(&renewed), "w2#b").await;
        let b = state.claim("g", Some(&renewed), "w3#c").await;
        assert!(a.is_ok() && matches!(b, Err(LeaseError::Conflict(_))));
        // The old leader's token no longer works.
        assert!(matches!(
            state.renew(&renewed).await,
            Err(LeaseError::Conflict(_))
        ));
        let released = state.release(&a.unwrap()).await.unwrap();
        assert_eq!((released.owner, released.counter), (None, 4));
        assert_eq!(state.gets(), 1);
    }
}
