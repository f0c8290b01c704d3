//! [`MemoryDedupStore`]: a bounded in-process store with expiry, for one process (tests,
//! local development, or a consumer whose duplicates all reach the same process).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::store::{Commit, DedupStore, Reservation, StoreError};

/// An in-memory [`DedupStore`]: at most `capacity` keys, each expiring after its TTL.
///
/// When full, it first forgets the oldest done keys (a record re-delivered after its key
/// was forgotten is handled again: at-least-once, never lost), then expired
/// reservations; if every slot holds a live reservation, `reserve` fails with
/// [`StoreError::Full`] (a transient error: the shard stops and the record comes back).
///
/// Time is tokio's clock, so tests can pause and advance it. Cloning gives another
/// handle to the same store: share it only within one consumer group, unless each
/// group's layer has its own [`namespace`](super::DedupLayer::namespace).
#[derive(Clone)]
pub struct MemoryDedupStore {
    shared: Arc<Mutex<Table>>,
    capacity: usize,
}

struct Table {
    // foldhash: fast on ~100-byte keys, seeded randomly per process (some DoS resistance).
    entries: HashMap<Arc<str>, Entry, foldhash::fast::RandomState>,
    /// Done keys in the order they were committed, for eviction. An item whose stamp
    /// no longer matches its entry is stale and skipped.
    done_order: VecDeque<(Arc<str>, u64)>,
    next_stamp: u64,
}

struct Entry {
    /// The map's own key, kept here so a commit needs a single lookup.
    key: Arc<str>,
    state: State,
    expires: Instant,
    stamp: u64,
}

enum State {
    InProgress { token: Box<str> },
    Done,
}

impl MemoryDedupStore {
    /// A store keeping at most `capacity` keys (at least 1).
    pub fn new(capacity: usize) -> Self {
        MemoryDedupStore {
            shared: Arc::new(Mutex::new(Table {
                entries: HashMap::default(),
                done_order: VecDeque::new(),
                next_stamp: 0,
            })),
            capacity: capacity.max(1),
        }
    }

    /// The number of keys held (done or in progress, expired ones included until they
    /// are swept).
    pub fn len(&self) -> usize {
        self.table().entries.len()
    }

    /// Whether the store holds no key.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // A panic while holding the lock cannot leave the map half-updated (every
        // mutation is a single insert/remove), so a poisoned lock is still usable.
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl std::fmt::Debug for MemoryDedupStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryDedupStore")
            .field("capacity", &self.capacity)
            .field("len", &self.len())
            .finish()
    }
}

impl Table {
    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// Frees one slot; false when every slot holds a live reservation.
    fn make_room(&mut self, capacity: usize, now: Instant) -> bool {
        while self.entries.len() >= capacity {
            match self.done_order.pop_front() {
                Some((key, stamp)) => {
                    let current = self
                        .entries
                        .get(&key)
                        .is_some_and(|e| e.stamp == stamp && matches!(e.state, State::Done));
                    if current {
                        self.entries.remove(&key);
                    }
                }
                None => {
                    self.entries.retain(|_, e| e.expires > now);
                    return self.entries.len() < capacity;
                }
            }
        }
        true
    }

    /// Drops stale eviction items once they outnumber the live ones.
    fn compact(&mut self, capacity: usize) {
        if self.done_order.len() > 2 * capacity {
            let entries = &self.entries;
            self.done_order.retain(|(key, stamp)| {
                entries
                    .get(key)
                    .is_some_and(|e| e.stamp == *stamp && matches!(e.state, State::Done))
            });
        }
    }
}

fn deadline(now: Instant, ttl: Duration) -> Instant {
    // A TTL too large for the clock means "for as long as the process lives".
    now.checked_add(ttl)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 24 * 3600)))
        .unwrap_or(now)
}

#[async_trait]
impl DedupStore for MemoryDedupStore {
    async fn reserve(
        &self,
        key: &str,
        token: &str,
        ttl: Duration,
    ) -> Result<Reservation, StoreError> {
        let now = Instant::now();
        let mut table = self.table();
        let stamp = table.stamp();
        let state = State::InProgress {
            token: Box::from(token),
        };
        let expires = deadline(now, ttl);
        if let Some(entry) = table.entries.get_mut(key) {
            if entry.expires > now {
                return Ok(match &entry.state {
                    State::Done => Reservation::Done,
                    // Ours already: reserving is idempotent per token (see DedupStore).
                    State::InProgress { token: held } if **held == *token => Reservation::Reserved,
                    State::InProgress { .. } => Reservation::InProgress,
                });
            }
            // Expired: the slot is free, and already ours to overwrite.
            entry.state = state;
            entry.expires = expires;
            entry.stamp = stamp;
            return Ok(Reservation::Reserved);
        }
        if !table.make_room(self.capacity, now) {
            return Err(StoreError::Full {
                capacity: self.capacity,
            });
        }
        let key: Arc<str> = Arc::from(key);
        table.entries.insert(
            key.clone(),
            Entry {
                key,
                state,
                expires,
                stamp,
            },
        );
        Ok(Reservation::Reserved)
    }

    async fn commit(&self, key: &str, token: &str, ttl: Duration) -> Result<Commit, StoreError> {
        let now = Instant::now();
        let mut table = self.table();
        let stamp = table.stamp();
        let expires = deadline(now, ttl);
        let (key, ours) = match table.entries.get_mut(key) {
            Some(entry) => {
                let ours = entry.expires > now
                    && matches!(&entry.state, State::InProgress { token: t } if &**t == token);
                entry.state = State::Done;
                entry.expires = expires;
                entry.stamp = stamp;
                (entry.key.clone(), ours)
            }
            None => {
                // The entry was evicted or expired and swept: it still becomes done, so
                // make room for it; if none can be made the handler's work is still done.
                let _ = table.make_room(self.capacity, now);
                let key: Arc<str> = Arc::from(key);
                table.entries.insert(
                    key.clone(),
                    Entry {
                        key: key.clone(),
                        state: State::Done,
                        expires,
                        stamp,
                    },
                );
                (key, false)
            }
        };
        table.done_order.push_back((key, stamp));
        table.compact(self.capacity);
        Ok(if ours {
            Commit::Committed
        } else {
            Commit::Overtaken
        })
    }

    async fn release(&self, key: &str, token: &str) -> Result<(), StoreError> {
        let mut table = self.table();
        let ours = table
            .entries
            .get(key)
            .is_some_and(|e| matches!(&e.state, State::InProgress { token: t } if &**t == token));
        if ours {
            table.entries.remove(key);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);

    #[tokio::test(start_paused = true)]
    async fn reserve_commit_release_follow_the_protocol() {
        let store = MemoryDedupStore::new(10);
        assert_eq!(
            store.reserve("a", "t1", TTL).await.unwrap(),
            Reservation::Reserved
        );
        assert_eq!(
            store.reserve("a", "t2", TTL).await.unwrap(),
            Reservation::InProgress
        );
        // The holder reserving again (a retry after a lost reply) gets it back.
        assert_eq!(
            store.reserve("a", "t1", TTL).await.unwrap(),
            Reservation::Reserved
        );
        // Only the holder's token releases.
        store.release("a", "t2").await.unwrap();
        assert_eq!(
            store.reserve("a", "t2", TTL).await.unwrap(),
            Reservation::InProgress
        );
        store.release("a", "t1").await.unwrap();
        assert_eq!(
            store.reserve("a", "t2", TTL).await.unwrap(),
            Reservation::Reserved
        );
        assert_eq!(
            store.commit("a", "t2", TTL).await.unwrap(),
            Commit::Committed
        );
        assert_eq!(
            store.reserve("a", "t3", TTL).await.unwrap(),
            Reservation::Done
        );
        // A release after commit changes nothing.
        store.release("a", "t2").await.unwrap();
        assert_eq!(
            store.reserve("a", "t3", TTL).await.unwrap(),
            Reservation::Done
        );
    }

    #[tokio::test(start_paused = true)]
    async fn expired_entries_count_as_free() {
        let store = MemoryDedupStore::new(10);
        store.reserve("a", "t1", TTL).await.unwrap();
        tokio::time::advance(TTL).await;
        assert_eq!(
            store.reserve("a", "t2", TTL).await.unwrap(),
            Reservation::Reserved
        );
        // t1's late commit still marks it done, but says it was overtaken.
        assert_eq!(
            store.commit("a", "t1", TTL).await.unwrap(),
            Commit::Overtaken
        );
        assert_eq!(
            store.reserve("a", "t3", TTL).await.unwrap(),
            Reservation::Done
        );
        tokio::time::advance(TTL).await;
        assert_eq!(
            store.reserve("a", "t3", TTL).await.unwrap(),
            Reservation::Reserved
        );
    }

    #[tokio::test(start_paused = true)]
    async fn capacity_evicts_oldest_done_keys_but_never_live_reservations() {
        let store = MemoryDedupStore::new(3);
        for key in ["a", "b", "c"] {
            store.reserve(key, key, TTL).await.unwrap();
        }
        // Full of live reservations: a new key is refused, transiently.
        assert!(matches!(
            store.reserve("d", "d", TTL).await,
            Err(StoreError::Full { capacity: 3 })
        ));
        store.commit("a", "a", TTL).await.unwrap();
        store.commit("b", "b", TTL).await.unwrap();
        // "a" is the oldest done key: it goes first.
        assert_eq!(
            store.reserve("d", "d", TTL).await.unwrap(),
            Reservation::Reserved
        );
        assert_eq!(store.len(), 3);
        assert_eq!(
            store.reserve("b", "x", TTL).await.unwrap(),
            Reservation::Done
        );
        assert_eq!(
            store.reserve("c", "x", TTL).await.unwrap(),
            Reservation::InProgress
        );
    }

    #[tokio::test(start_paused = true)]
    async fn eviction_queue_stays_bounded_under_repeated_commits() {
        let store = MemoryDedupStore::new(4);
        for i in 0..1000 {
            let token = format!("t{i}");
            store.reserve("k", &token, Duration::ZERO).await.unwrap();
            store.commit("k", &token, Duration::ZERO).await.unwrap();
        }
        assert!(store.table().done_order.len() <= 2 * 4 + 1);
    }
}
