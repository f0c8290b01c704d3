//! The simulation's view of the memory backend: one `SimBackend` per worker incarnation
//! (or for the producer) wraps the shared `Memory` and injects the faults the memory
//! backend itself does not: freezing, death, hung calls, ambiguous PutRecords, missing
//! next iterators on closed shards and stale ListShards answers. It also logs every
//! take and checkpoint that landed, including those whose caller saw an error. Built on
//! the testkit's bases: a hook gates every call, and the Kinesis and lease-store
//! wrappers override only the calls whose answers they change or log.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::FutureExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, RecordsPage, ShardInfo, StartingPosition,
    StreamIdentity,
};
use shardflow::lease::{Checkpoint, Lease, LeaseError, LeaseStore};
use shardflow::memory::TABLE_STREAM_ITERATOR_TTL;
use shardflow::{Backend, Memory};
use testkit::hooks::{Forward, ForwardKinesis, ForwardStore, Hooked, Hooks};
use tokio::sync::Notify;

use super::history::{Feature, Features};
use super::log::{Commit, Log, Take};

/// A generous cap on a hung call, so a history still ends when the library has no
/// deadline of its own (the call then fails as a network error would).
pub const HUNG_CAP: Duration = Duration::from_secs(90);

/// The error of a call the gate cut (it hung): the call was never made.
const CUT: &str = "hung call cut by the simulation";

/// Whether the gate cut the call: nothing landed, there is nothing to log.
fn was_cut<T>(result: &Result<T, LeaseError>) -> bool {
    matches!(result, Err(LeaseError::Other(detail)) if detail.as_str() == CUT)
}

/// Freezing and killing one worker incarnation. Not a `watch` channel: tokio's watch
/// spreads its waiters over several queues picked at random, so the calls and handlers
/// waiting at a frozen gate would resume in a different order on every run; a `Notify`
/// wakes them in the order they came.
pub struct Control {
    frozen: AtomicBool,
    /// Suspended with the whole group (feature `table-stream`): apart from `frozen`, so
    /// a freeze's own wake-up does not end the suspension.
    suspended: AtomicBool,
    /// The handlers' downstream is down (feature `table-stream`): handler calls wait,
    /// the worker itself goes on (renews, takes, reads ahead).
    outage: AtomicBool,
    thawed: Notify,
    dead: AtomicBool,
}

impl Control {
    pub fn new() -> Arc<Self> {
        Arc::new(Control {
            frozen: AtomicBool::new(false),
            suspended: AtomicBool::new(false),
            outage: AtomicBool::new(false),
            thawed: Notify::new(),
            dead: AtomicBool::new(false),
        })
    }

    pub fn freeze(&self, frozen: bool) {
        self.frozen.store(frozen, Ordering::SeqCst);
        if !frozen {
            self.thawed.notify_waiters();
        }
    }

    /// Suspends the process (or resumes it) with the whole group.
    pub fn suspend(&self, suspended: bool) {
        self.suspended.store(suspended, Ordering::SeqCst);
        if !suspended {
            self.thawed.notify_waiters();
        }
    }

    /// The handlers' downstream goes down (or comes back): see [`Control::handler_gate`].
    pub fn set_outage(&self, down: bool) {
        self.outage.store(down, Ordering::SeqCst);
        if !down {
            self.thawed.notify_waiters();
        }
    }

    /// [`Control::gate`] for the handlers: they also wait while their downstream is down.
    pub async fn handler_gate(&self) {
        loop {
            let thawed = self.thawed.notified();
            tokio::pin!(thawed);
            thawed.as_mut().enable();
            if !self.outage.load(Ordering::SeqCst) {
                break;
            }
            thawed.await;
        }
        self.gate().await;
    }

    pub fn is_frozen(&self) -> bool {
        self.frozen.load(Ordering::SeqCst) || self.suspended.load(Ordering::SeqCst)
    }

    /// The process is gone: none of its calls ever lands again.
    pub fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
        self.freeze(false);
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Waits while frozen; never returns once dead.
    pub async fn gate(&self) {
        loop {
            let thawed = self.thawed.notified();
            tokio::pin!(thawed);
            // Registered before the look, so a thaw in between is not missed.
            thawed.as_mut().enable();
            if !self.is_frozen() {
                break;
            }
            thawed.await;
        }
        if self.is_dead() {
            std::future::pending::<()>().await;
        }
    }
}

/// The fault generators of one [`SimBackend`]: one per fault kind it injects.
struct FaultRngs {
    hung_calls: Mutex<SmallRng>,
    stale_list_shards: Mutex<SmallRng>,
    missing_next_iterator: Mutex<SmallRng>,
    ambiguous_put: Mutex<SmallRng>,
}

impl FaultRngs {
    fn new(seed: u64) -> Self {
        // Each kind's stream of draws from the seed and a constant of its own.
        let rng = |kind: u64| Mutex::new(SmallRng::seed_from_u64(seed ^ kind));
        FaultRngs {
            hung_calls: rng(0x4a96_c411),
            stale_list_shards: rng(0x57a1_e115),
            missing_next_iterator: rng(0x0e27_17e4),
            ambiguous_put: rng(0xa3b1_9b07),
        }
    }

    /// The generator of `feature`'s fault.
    fn of(&self, feature: Feature) -> &Mutex<SmallRng> {
        match feature {
            Feature::HungCalls => &self.hung_calls,
            Feature::StaleListShards => &self.stale_list_shards,
            Feature::MissingNextIteratorAnywhere => &self.missing_next_iterator,
            Feature::AmbiguousPut => &self.ambiguous_put,
            // Not a fault of this wrapper: `chance` never draws for it with the
            // feature off, and no caller asks for it.
            other => unreachable!("SimBackend injects no {} fault", other.name()),
        }
    }
}

/// One incarnation's (or the producer's) view of the memory backend.
#[derive(Clone)]
pub struct SimBackend {
    pub memory: Memory,
    pub table: String,
    pub worker: String,
    pub incarnation: String,
    pub control: Arc<Control>,
    pub log: Arc<Log>,
    pub features: Features,
    /// One generator per fault kind, each derived from the seed: switching one kind on
    /// or adding a draw to it leaves every other kind's draws as they were.
    rngs: Arc<FaultRngs>,
    last_list: Arc<Mutex<Option<Vec<ShardInfo>>>>,
}

impl SimBackend {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        memory: Memory,
        table: &str,
        worker: &str,
        incarnation: &str,
        control: Arc<Control>,
        log: Arc<Log>,
        features: Features,
        seed: u64,
    ) -> Self {
        SimBackend {
            memory,
            table: table.to_owned(),
            worker: worker.to_owned(),
            incarnation: incarnation.to_owned(),
            control,
            log,
            features,
            rngs: Arc::new(FaultRngs::new(seed)),
            last_list: Arc::new(Mutex::new(None)),
        }
    }

    /// Draws, with probability `p`, whether `feature`'s fault happens (never without
    /// the feature: then nothing is drawn).
    fn chance(&self, feature: Feature, p: f64) -> bool {
        self.features.has(feature) && self.rngs.of(feature).lock().unwrap().gen_bool(p)
    }

    /// Waits while frozen (forever once dead); then maybe hangs, up to [`HUNG_CAP`].
    async fn enter(&self) -> bool {
        self.control.gate().await;
        if self.chance(Feature::HungCalls, 0.004) {
            self.log.hung.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(HUNG_CAP).await;
            self.control.gate().await;
            return false;
        }
        true
    }

    /// [`enter_kinesis`](Self::enter_kinesis) for a read of `shard` (same draws): when
    /// the call hangs, logs when it ends, however it ends (the worker drops it at its
    /// read call timeout).
    async fn enter_read(&self, shard: &str) -> Result<(), KinesisError> {
        /// Logs, when dropped, the end of a hung read of its shard.
        struct HungRead(Arc<Log>, String);
        impl Drop for HungRead {
            fn drop(&mut self) {
                if let Ok(mut ended) = self.0.hung_reads_ended.lock() {
                    ended.insert(std::mem::take(&mut self.1), tokio::time::Instant::now());
                }
            }
        }
        self.control.gate().await;
        if self.chance(Feature::HungCalls, 0.004) {
            self.log.hung.fetch_add(1, Ordering::SeqCst);
            let _ended = HungRead(self.log.clone(), shard.to_owned());
            tokio::time::sleep(HUNG_CAP).await;
            self.control.gate().await;
            return Err(KinesisError::Other(CUT.into()));
        }
        Ok(())
    }

    async fn enter_kinesis(&self) -> Result<(), KinesisError> {
        if self.enter().await {
            Ok(())
        } else {
            Err(KinesisError::Other(CUT.into()))
        }
    }

    async fn enter_store(&self) -> Result<(), LeaseError> {
        if self.enter().await {
            Ok(())
        } else {
            Err(LeaseError::Other(CUT.into()))
        }
    }

    /// Whether the shard a memory iterator (`stream|shard|index|issued`) reads is closed.
    fn is_closed(&self, iterator: &str) -> bool {
        let Some(shard) = iterator.rsplit('|').nth(2) else {
            return false;
        };
        self.memory
            .streams()
            .list_shards(self.log.stream())
            .now_or_never()
            .and_then(Result::ok)
            .is_some_and(|all| all.iter().any(|s| s.shard_id == shard && s.is_closed()))
    }

    fn row(&self, key: &str) -> Option<Lease> {
        self.memory
            .table(&self.table)
            .rows()
            .into_iter()
            .find(|r| r.key == key)
    }
}

impl SimBackend {
    /// The memory backend with this incarnation's gate before every call.
    fn hooked(&self) -> Hooked<Memory, SimBackend> {
        Hooked::new(self.memory.clone(), self.clone())
    }
}

impl Backend for SimBackend {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        Arc::new(Forward(SimKinesis {
            backend: self.clone(),
            gated: self.hooked().kinesis(),
        }))
    }
    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        Arc::new(Forward(SimStore {
            backend: self.clone(),
            gated: self.hooked().lease_store(table),
        }))
    }
    /// A table's stream is served by the same wrapped stream service, under its ARN.
    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        Some(self.kinesis())
    }
}

/// Every call (lease store, coordinator state, Kinesis) waits for the gate first: it
/// freezes and dies with the worker, and may hang.
#[async_trait]
impl Hooks for SimBackend {
    async fn before_lease(&self, _: &'static str, _: Option<&str>) -> Result<(), LeaseError> {
        self.enter_store().await
    }
    async fn before_kinesis(&self, _: &'static str) -> Result<(), KinesisError> {
        self.enter_kinesis().await
    }
}

/// The Kinesis API as a simulated worker (or the producer) sees it: stale listings,
/// pages without a next iterator and writes that land although the caller sees an
/// error; the other calls only pass the gate.
struct SimKinesis {
    backend: SimBackend,
    gated: Arc<dyn KinesisApi>,
}

#[async_trait]
impl ForwardKinesis for SimKinesis {
    fn inner(&self) -> &dyn KinesisApi {
        self.gated.as_ref()
    }
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        let backend = &self.backend;
        let fresh = self.gated.list_shards(stream).await?;
        let previous = backend.last_list.lock().unwrap().replace(fresh.clone());
        if backend.chance(Feature::StaleListShards, 0.08) {
            backend.log.stale_lists.fetch_add(1, Ordering::SeqCst);
            let rng = backend.rngs.of(Feature::StaleListShards);
            let coin = rng.lock().unwrap().gen_bool(0.5);
            match previous {
                // An old shard list: the answer of the previous call.
                Some(old) if coin => return Ok(old),
                // One shard omitted, once.
                _ if !fresh.is_empty() => {
                    let mut answer = fresh;
                    let i = rng.lock().unwrap().gen_range(0..answer.len());
                    answer.remove(i);
                    return Ok(answer);
                }
                _ => {}
            }
        }
        Ok(fresh)
    }
    /// Its own gate, which knows the shard: a hung read logs when it ends.
    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        self.backend.enter_read(shard_id).await?;
        self.backend
            .memory
            .streams()
            .shard_iterator(stream, shard_id, from)
            .await
    }
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        let backend = &self.backend;
        let mut page = match self.gated.get_records(iterator, limit).await {
            Err(KinesisError::ExpiredIterator(detail)) => {
                // A memory iterator is `stream|shard|index|issued`, issued in milliseconds
                // of tokio's clock since the backend was built (with the history's log).
                let issued = iterator
                    .rsplit('|')
                    .next()
                    .and_then(|t| t.parse::<u128>().ok());
                let age = issued.map(|t| backend.log.elapsed().as_millis().saturating_sub(t));
                if age.is_some_and(|age| age > TABLE_STREAM_ITERATOR_TTL.as_millis()) {
                    backend.log.expired_iterators.fetch_add(1, Ordering::SeqCst);
                }
                return Err(KinesisError::ExpiredIterator(detail));
            }
            other => other?,
        };
        // Pages without a next iterator (an emulator bug), on open shards and on closed
        // ones before their end. Only with the feature: even on an open shard, a reshard
        // between the page and the reader's ListShards makes today's reader end the
        // shard early (default seed 338 once did).
        let p = if backend.is_closed(iterator) {
            0.1
        } else {
            0.02
        };
        let drop_next = backend.chance(Feature::MissingNextIteratorAnywhere, p);
        if page.next_iterator.is_some() && page.child_shards.is_empty() && drop_next {
            backend.log.missing_iterators.fetch_add(1, Ordering::SeqCst);
            page.next_iterator = None;
        }
        Ok(page)
    }
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        let backend = &self.backend;
        let outcome = self.gated.put_records(stream, records).await?;
        if backend.chance(Feature::AmbiguousPut, 0.15) {
            backend.log.ambiguous_puts.fetch_add(1, Ordering::SeqCst);
            return Err(KinesisError::Other(
                "timed out after the write landed".into(),
            ));
        }
        Ok(outcome)
    }
}

/// The shard of a lease key, single-stream or multi-stream: the log and the invariants
/// speak of shards.
fn shard_of(key: &str) -> String {
    StreamIdentity::split_lease_key(key)
        .map_or(key, |(_, shard)| shard)
        .to_owned()
}

/// The lease store (and its coordinator state) as a simulated worker sees it: every
/// call passes the gate; takes, checkpoints, resets, creations and deletions that landed
/// are logged, including those whose caller saw an error.
struct SimStore {
    backend: SimBackend,
    gated: Arc<dyn LeaseStore>,
}

impl SimStore {
    fn log_take(&self, expected: &Lease, row: &Lease, owner: &str) {
        let log = &self.backend.log;
        let before_first_checkpoint = !matches!(row.checkpoint, Checkpoint::At(_))
            && expected.owner.as_deref().is_some_and(|o| o != owner);
        log.trace(format_args!(
            "take {} {} by {owner} counter {} at {}",
            self.backend.incarnation, row.key, row.counter, row.checkpoint
        ));
        let handed_over_by = expected
            .owner
            .as_deref()
            .filter(|previous| *previous != owner)
            .and_then(|previous| log.owners.lock().unwrap().get(previous).cloned())
            .filter(|previous| *previous == self.backend.incarnation);
        log.takes.lock().unwrap().push(Take {
            at: log.tick(),
            time: log.wall_time(),
            key: shard_of(&row.key),
            owner: owner.to_owned(),
            before_first_checkpoint,
            handed_over_by,
        });
    }

    /// Logs a write the store's fencing refused.
    fn note_refusal<T>(&self, result: &Result<T, LeaseError>) {
        if matches!(result, Err(LeaseError::Conflict(_))) {
            let log = &self.backend.log;
            log.trace(format_args!("refused {}", self.backend.incarnation));
            let at = log.tick();
            log.refused
                .lock()
                .unwrap()
                .push((at, self.backend.incarnation.clone()));
        }
    }

    fn log_commit(&self, row: &Lease, checkpoint: &Checkpoint, ambiguous: bool) {
        let log = &self.backend.log;
        log.trace(format_args!(
            "checkpoint {} {} by {} counter {} at {checkpoint} ambiguous {ambiguous}",
            self.backend.incarnation,
            row.key,
            row.owner.as_deref().unwrap_or_default(),
            row.counter
        ));
        log.commits.lock().unwrap().push(Commit {
            at: log.tick(),
            // The owner name the write was fenced on (worker id and the process's nonce).
            worker: row.owner.clone().unwrap_or_default(),
            incarnation: self.backend.incarnation.clone(),
            key: shard_of(&row.key),
            counter: row.counter,
            checkpoint: checkpoint.clone(),
            ambiguous,
        });
    }
}

#[async_trait]
impl ForwardStore for SimStore {
    fn inner(&self) -> &dyn LeaseStore {
        self.gated.as_ref()
    }
    // Three calls stay at `LeaseStore`'s defaults, as they always were here: the owner's
    // keys from a listing, and no stream claim or children written into rows (passing
    // them on to the memory store would add calls, and so change every history).
    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        let rows = self.gated.list().await?;
        Ok(rows
            .into_iter()
            .filter(|row| row.owner.as_deref() == Some(owner))
            .map(|row| row.key)
            .collect())
    }
    async fn claim_for_stream(&self, expected: &Lease, _: &str) -> Result<Lease, LeaseError> {
        Ok(expected.clone())
    }
    async fn record_children(&self, expected: &Lease, _: &[String]) -> Result<Lease, LeaseError> {
        Ok(expected.clone())
    }
    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        let created = self.gated.create(lease).await;
        let log = &self.backend.log;
        if matches!(created, Ok(true)) && log.deleted.lock().unwrap().contains(&lease.key) {
            log.note(format!(
                "{} re-created the lease of {} (deleted as finished) at {}",
                self.backend.incarnation, lease.key, lease.checkpoint
            ));
        }
        created
    }
    async fn take(&self, expected: &Lease, owner: &str) -> Result<Lease, LeaseError> {
        let result = self.gated.take(expected, owner).await;
        if was_cut(&result) {
            return result;
        }
        self.note_refusal(&result);
        match &result {
            Ok(row) => self.log_take(expected, row, owner),
            // A write that landed although the caller saw an error still counts.
            Err(_) => {
                if let Some(row) = self.backend.row(&expected.key) {
                    if row.owner.as_deref() == Some(owner) && row.counter > expected.counter {
                        self.log_take(expected, &row, owner);
                    }
                }
            }
        }
        result
    }
    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        let result = self.gated.renew(expected).await;
        if let Ok(row) = &result {
            self.backend.log.trace(format_args!(
                "renew {} {} counter {}",
                self.backend.incarnation, row.key, row.counter
            ));
        }
        self.note_refusal(&result);
        result
    }
    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError> {
        let result = self.gated.checkpoint(expected, checkpoint).await;
        if was_cut(&result) {
            return result;
        }
        self.note_refusal(&result);
        match &result {
            Ok(row) => self.log_commit(row, checkpoint, false),
            Err(LeaseError::Conflict(_)) => {}
            Err(_) => {
                if let Some(row) = self.backend.row(&expected.key) {
                    if row.owner == expected.owner
                        && row.counter == expected.counter
                        && row.checkpoint == *checkpoint
                        && expected.checkpoint != *checkpoint
                    {
                        self.log_commit(&row, checkpoint, true);
                    }
                }
            }
        }
        result
    }
    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        let result = self.gated.reset(expected, to).await;
        if was_cut(&result) {
            return result;
        }
        // One that landed although the caller saw an error counts too.
        let landed = result.is_ok()
            || self
                .backend
                .row(&expected.key)
                .is_some_and(|row| row.checkpoint == *to && row.reset_to.is_none());
        if landed {
            let log = &self.backend.log;
            log.trace(format_args!(
                "reset {} {} to {to}",
                self.backend.incarnation, expected.key
            ));
            let at = log.tick();
            log.resets
                .lock()
                .unwrap()
                .push((at, shard_of(&expected.key)));
        }
        result
    }
    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        let deleted = self.gated.delete(expected).await;
        if deleted.is_ok() {
            let log = &self.backend.log;
            log.deleted.lock().unwrap().insert(expected.key.clone());
            log.note(format!(
                "{} deleted the finished lease of {}",
                self.backend.incarnation, expected.key
            ));
        }
        deleted
    }
}
