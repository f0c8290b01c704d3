//! The worker's lease manager: discovers shards and creates their leases, takes its fair
//! share of leases (and steals towards it through graceful hand-offs), renews what it
//! holds on its own timer, starts a [`ShardTask`] per held lease and winds them down on
//! shutdown.

use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, StreamExt};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backoff::Backoff;
use crate::kinesis::{KinesisApi, KinesisError, ShardInfo, StreamIdentity};
use crate::lease::{
    with_retries, worker_of, Checkpoint, CoordinatorState, HeldLease, LeaderItem, Lease,
    LeaseError, LeaseStore, StreamScopedStore, INCARNATION_SEPARATOR, LEADER_KEY,
};
use crate::message::Batch;
use crate::metrics::{Labels, LeaseEvent};

use super::balance::{self, Candidate};
use super::config::{Config, InitialPosition};
use super::deadline::{BoundedKinesis, BoundedLeaseStore};
use super::events::ShardEvent;
use super::health::HealthState;
use super::panics::panic_message;
use super::shard::{ShardExit, ShardTask};
use super::ConsumerError;

/// Starts the task that hands one shard's batches to the user's service.
pub(crate) type SpawnDispatch = Arc<dyn Fn(mpsc::Receiver<Batch>) -> JoinHandle<()> + Send + Sync>;

/// Where shard tasks deliver batches (shared by the streams of a multi-stream consumer).
#[derive(Clone)]
pub(crate) enum Sink {
    /// `run` mode: a channel and a dispatch task per shard.
    PerShard(SpawnDispatch),
    /// `stream` mode: one channel the user's stream reads.
    Shared(mpsc::Sender<Batch>),
}

enum Event {
    Exit(String, ShardExit),
    HandoffRequested(String, String),
    /// An operator asked for a checkpoint reset on the row (see `crate::admin`).
    ResetRequested(String),
}

struct Slot {
    lease: Arc<HeldLease>,
    stop: CancellationToken,
    /// The shard task: aborted if it did not stop within the shutdown's bound.
    task: JoinHandle<()>,
    handoff_to: Option<String>,
    /// A reset request is being applied: once the task stopped and drained, the
    /// requested checkpoint is stored and the lease released (read again from there).
    reset: bool,
}

/// How many more ListShards answers a shard sync asks for when a parent is unknown
/// (see `Coordinator::confirm_listing`), and how long it waits before each.
const STALE_LIST_RETRIES: usize = 2;
const STALE_LIST_PAUSE: Duration = Duration::from_millis(50);

/// How many lease writes (takes, creates) one worker has in flight at once.
const MAX_CONCURRENT_WRITES: usize = 32;

/// Lease rounds run at once, one after another, after takes lost races (see
/// `Coordinator::raced`); then the usual quick round.
const MAX_RACED_ROUNDS: u32 = 8;

/// Fleets of up to this many live workers: every worker lists the whole table every
/// round, as it always did (every worker's plan deals out what is free or expired).
const SMALL_FLEET: usize = 3;

/// The leader item while this worker holds it, and when its last renewal (or the take)
/// that landed was sent; shared by the coordinator and the leadership renewal task.
type Leading = Arc<Mutex<Option<(LeaderItem, Instant)>>>;

fn lock_leading(leading: &Leading) -> MutexGuard<'_, Option<(LeaderItem, Instant)>> {
    // Poisoning means a panic elsewhere while holding the lock; the value is still whole.
    leading.lock().unwrap_or_else(|p| p.into_inner())
}

type HeldSet = Arc<Mutex<BTreeMap<String, Arc<HeldLease>>>>;

fn lock(held: &HeldSet) -> MutexGuard<'_, BTreeMap<String, Arc<HeldLease>>> {
    // Poisoning means a panic elsewhere while holding the lock; the map is still whole.
    held.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) struct Coordinator {
    config: Arc<Config>,
    kinesis: Arc<dyn KinesisApi>,
    store: Arc<dyn LeaseStore>,
    stream: Arc<str>,
    /// One stream of a multi-stream consumer: `store` is the whole table until
    /// start-up resolved the stream's identity and scoped it to the stream's rows.
    multi_stream: bool,
    /// The last round stopped taking free leases after losing a race for one, having
    /// taken some: the next round runs at once, from a listing that shows the workers
    /// taking too (a round that took nothing waits for the usual quick round).
    raced: bool,
    /// Rounds run at once after a lost race, in a row.
    raced_rounds: u32,
    /// Multi-stream mode, once scoped: the identity the lease keys carry, checked
    /// again at every shard sync (a stream deleted and re-created under the same
    /// name is another stream).
    identity: Option<StreamIdentity>,
    sink: Sink,
    slots: BTreeMap<String, Slot>,
    held: HeldSet,
    /// Last counter seen per lease and when it last changed: a lease whose counter has
    /// not moved for the lease duration is expired (no clocks compared across hosts).
    seen: BTreeMap<String, (u64, Instant)>,
    steals: BTreeMap<String, Instant>,
    /// Leases of a live non-shardflow owner already warned about.
    warned: BTreeSet<String>,
    shards: Vec<ShardInfo>,
    last_sync: Option<Instant>,
    /// When this worker last checked the stream's identity (see `check_identity`).
    last_identity_check: Option<Instant>,
    need_sync: bool,
    /// The stream was UPDATING at the last check: no discovery, no steals.
    updating: bool,
    /// Lease rounds run so far.
    rounds: u64,
    /// The last round left this worker under its fair share with leases to ask for.
    short: bool,
    /// This worker's fair share at its last full listing.
    quota: usize,
    /// The live workers of this worker's last full listing, in name order (owners of
    /// leases not expired, and this worker): how large the fleet is (see
    /// [`Coordinator::lists_every_round`]). Empty before the first.
    live: Vec<String>,
    /// The coordinator-state table holding the group's leader item (see
    /// [`crate::lease::leader`]); `None` for a store without one, where every worker
    /// lists every round.
    coordination: Option<Arc<dyn CoordinatorState>>,
    /// The leader item as this worker last read it (`None`: absent) and when it first
    /// saw it so: an item whose counter stays still for a lease duration (on this
    /// worker's clock, as lease expiry) is taken over.
    leader_seen: Option<(Option<LeaderItem>, Instant)>,
    /// The leader item while this worker leads.
    leading: Leading,
    /// While this worker leads, since when its listings of the lease table fail: a
    /// leader that cannot list covers for nobody, so after a lease duration it gives
    /// the leadership up (see `round`).
    leader_listing_failed_since: Option<Instant>,
    /// Until when this worker does not take the leadership (it gave it up because its
    /// listings failed): another worker takes it meanwhile.
    no_claim_until: Option<Instant>,
    /// This worker became the leader since its last full listing: a round runs a lease
    /// duration after that listing (see `follow_up`).
    took_lead: bool,
    /// When a new leader lists again: a lease duration after its first listing, when
    /// the rows that stood still since (a crashed worker's) count as expired; without it
    /// the take tick, a few milliseconds short of that, would leave them a round more.
    follow_up: Option<Instant>,
    /// The leases that were unowned in this worker's last full listing: a leader takes
    /// those still unowned at its next one (nobody else took them in a round; see
    /// `balance`).
    unowned: BTreeSet<String>,
    /// A leader's view of which workers run: when it last saw a row of each move,
    /// for those seen lately (see `balance`). It hands leases on only to them.
    moved_at: BTreeMap<String, Instant>,
    /// When this worker's last full listing was read.
    last_listing: Option<Instant>,
    /// The leases a leader handed on in its previous round: their counter moves by the
    /// hand-over, not by a renewal of the worker it named.
    handed: BTreeSet<String>,
    /// The leases a leader took to cover for other workers (expired, released, left
    /// unowned) and still runs: the first it hands on when above its share.
    covered: BTreeSet<String>,
    rng: SmallRng,
    /// Since when every lease round found the lease table missing (see `run`).
    table_missing_since: Option<Instant>,
    /// When this worker started: where LATEST begins for the rows it creates.
    started: SystemTime,
    events_tx: mpsc::UnboundedSender<Event>,
    events_rx: mpsc::UnboundedReceiver<Event>,
    labels: Labels,
    health: Arc<HealthState>,
    /// The parent of every shard task's stop token: a child of the token `run` was
    /// given, cancelled too when `run` ends in any way (a panic included).
    tasks: CancellationToken,
    /// The dispatch tasks started for shard tasks (`run` mode): whatever still runs
    /// when the coordinator ends is aborted, so no handler is called after that.
    dispatchers: Dispatchers,
}

/// The handles of a coordinator's dispatch tasks; dropping it aborts those still running.
#[derive(Default)]
struct Dispatchers(Vec<JoinHandle<()>>);

impl Dispatchers {
    fn add(&mut self, task: JoinHandle<()>) {
        self.0.retain(|t| !t.is_finished());
        self.0.push(task);
    }

    /// Aborts every dispatch task still running and waits until each has ended.
    async fn stop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
        for task in self.0.drain(..) {
            let _ = task.await;
        }
    }
}

impl Drop for Dispatchers {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

impl Coordinator {
    pub(crate) fn new(
        config: Arc<Config>,
        kinesis: Arc<dyn KinesisApi>,
        store: Arc<dyn LeaseStore>,
        sink: Sink,
        health: Arc<HealthState>,
        multi_stream: bool,
    ) -> Self {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        // Every remote call the worker and its shards make has a deadline.
        let kinesis: Arc<dyn KinesisApi> = Arc::new(BoundedKinesis::new(
            kinesis,
            config.read_call_timeout,
            Labels::of(&config),
        ));
        let store = BoundedLeaseStore::new(store, config.lease_call_timeout, Labels::of(&config));
        let coordination = store.coordinator_state();
        // Multi-stream: the worker's shared listing counts the Scans (streams.rs).
        let store: Arc<dyn LeaseStore> = Arc::new(if multi_stream {
            store.listing_counted_below()
        } else {
            store
        });
        Coordinator {
            labels: Labels::of(&config),
            health,
            multi_stream,
            identity: None,
            raced: false,
            raced_rounds: 0,
            stream: config.stream.as_str().into(),
            rng: SmallRng::seed_from_u64(config.seed),
            config,
            kinesis,
            store,
            sink,
            slots: BTreeMap::new(),
            held: Arc::default(),
            seen: BTreeMap::new(),
            steals: BTreeMap::new(),
            warned: BTreeSet::new(),
            shards: Vec::new(),
            last_sync: None,
            last_identity_check: None,
            need_sync: true,
            updating: false,
            rounds: 0,
            short: false,
            quota: 0,
            live: Vec::new(),
            unowned: BTreeSet::new(),
            coordination,
            leader_seen: None,
            leading: Arc::default(),
            leader_listing_failed_since: None,
            no_claim_until: None,
            took_lead: false,
            follow_up: None,
            handed: BTreeSet::new(),
            moved_at: BTreeMap::new(),
            last_listing: None,
            covered: BTreeSet::new(),
            table_missing_since: None,
            started: SystemTime::now(),
            events_tx,
            events_rx,
            tasks: CancellationToken::new(),
            dispatchers: Dispatchers::default(),
        }
    }

    pub(crate) async fn run(mut self, shutdown: CancellationToken) -> Result<(), ConsumerError> {
        let worker = self.config.owner.clone();
        let span = tracing::info_span!("worker", %worker, stream = %self.stream);
        // Whatever ends `run` (a return or a panic), the shard tasks are told to stop.
        self.tasks = shutdown.child_token();
        let _stop_tasks = self.tasks.clone().drop_guard();
        let body = async {
            // Transient failures (throttling, a flaky network) are retried; a missing
            // stream or a refused request fails fast instead of polling forever.
            let mut backoff = Backoff::new(
                self.config.retry_min,
                self.config.retry_max,
                self.config.seed,
            );
            loop {
                // A shutdown does not wait for a start-up call (each has a deadline,
                // some of minutes: a table or fan-out consumer being created).
                let attempt = tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    attempt = self.start_up() => attempt,
                };
                match attempt {
                    Ok(()) => break,
                    Err(e) if e.is_transient() => {
                        let delay = backoff.next_delay();
                        tracing::warn!(error = %e, ?delay, "start-up call failed; retrying");
                        tokio::select! {
                            _ = shutdown.cancelled() => return Ok(()),
                            _ = tokio::time::sleep(delay) => {}
                        }
                    }
                    Err(e) => return Err(e),
                }
            }
            // Renewal goes on through the shutdown's drain (which may outlast a lease
            // duration) and stops only once every lease is released.
            let renewing = CancellationToken::new();
            // Stops the renewer even if the shutdown below does not complete (a panic).
            let _stop_renewing = renewing.clone().drop_guard();
            let renewer = tokio::spawn(renew_loop(
                self.config.clone(),
                self.health.clone(),
                self.held.clone(),
                self.events_tx.clone(),
                renewing.clone(),
            ));
            let leadership = self.coordination.clone().map(|state| {
                tokio::spawn(renew_leadership(
                    self.config.clone(),
                    state,
                    self.leading.clone(),
                    renewing.clone(),
                ))
            });
            let mut take_tick = tokio::time::interval(self.config.take_interval);
            take_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let outcome = loop {
                // Right after the start (workers started together only see each other
                // once each took something), while hand-offs we asked for are under way
                // and while short of the fair share, look again after one renewal
                // interval (when the owners have seen the requests) rather than a whole
                // take interval: a fleet started together balances in a few seconds.
                // The second round comes sooner (a quarter of that): the first was a
                // race for free leases, and a worker that lost it everywhere makes
                // itself known with a request before the owners' first renewal.
                let settle = tokio::time::sleep(if self.rounds == 1 {
                    self.config.renew_interval / 4
                } else {
                    self.config.renew_interval
                });
                let settling = self.rounds < 2 || self.short || !self.steals.is_empty();
                let round = tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break Ok(()),
                    Some(event) = self.events_rx.recv() => {
                        if self.on_event(event).await {
                            self.round().await
                        } else {
                            Ok(())
                        }
                    }
                    _ = std::future::ready(()), if self.raced => {
                        self.raced = false;
                        self.round().await
                    }
                    _ = take_tick.tick() => self.round().await,
                    _ = settle, if settling => self.round().await,
                    _ = sleep_until_some(self.follow_up), if self.follow_up.is_some() => {
                        self.follow_up = None;
                        self.round().await
                    }
                };
                if let Err(e) = round {
                    break Err(e);
                }
                // A lease table deleted under a running group is not re-created (that
                // would restart every shard at its initial position): once lease rounds
                // found it missing for a whole lease duration, the worker stops (its
                // shards drain; their checkpoint writes fail, nothing is written
                // elsewhere) and `run` ends with the error. With the default timings that
                // is within lease_duration + take_interval of the deletion, plus the drain.
                if let Some(since) = self.table_missing_since {
                    if since.elapsed() >= self.config.lease_duration {
                        tracing::error!(table = %self.config.lease_table, "the lease table is missing; stopping the worker");
                        break Err(ConsumerError::Lease(LeaseError::TableMissing {
                            table: self.config.lease_table.clone(),
                        }));
                    }
                }
            };
            self.shutdown().await;
            renewing.cancel();
            renewer.abort();
            // Leadership last, once every lease is released: the worker that takes it
            // over (at its next round) finds them all free and takes them at once.
            if let Some(task) = leadership {
                task.abort();
                let _ = task.await;
                self.resign().await;
            }
            outcome
        };
        // A panic anywhere in the rounds (or in the shutdown) ends the worker like an
        // error does: through the same drain and release as a shutdown, with a renewer
        // of its own meanwhile (the first one stopped when the panic dropped it).
        let outcome = match AssertUnwindSafe(body.instrument(span.clone()))
            .catch_unwind()
            .await
        {
            Ok(outcome) => outcome,
            Err(payload) => {
                let message = panic_message(payload.as_ref());
                async {
                    tracing::error!(%message, "the worker panicked; draining and releasing its leases");
                    let renewing = CancellationToken::new();
                    let _stop_renewing = renewing.clone().drop_guard();
                    let renewer = tokio::spawn(renew_loop(
                        self.config.clone(),
                        self.health.clone(),
                        self.held.clone(),
                        self.events_tx.clone(),
                        renewing.clone(),
                    ));
                    self.tasks.cancel();
                    self.shutdown().await;
                    renewing.cancel();
                    renewer.abort();
                }
                .instrument(span)
                .await;
                Err(ConsumerError::Worker(format!(
                    "the worker panicked: {message}"
                )))
            }
        };
        // No handler runs once `run` returned.
        self.dispatchers.stop().await;
        outcome
    }

    /// The calls before the first lease round: the table exists, the shards have
    /// rows, and (enhanced fan-out) the stream consumer is registered, so that a
    /// backend without fan-out refuses to start.
    async fn start_up(&mut self) -> Result<(), ConsumerError> {
        self.store.ensure_table().await?;
        if let Some(state) = &self.coordination {
            state.ensure_table().await?;
        }
        if self.multi_stream {
            self.scope_to_stream().await?;
        }
        self.sync_shards().await?;
        if let Some(fan_out) = &self.config.fan_out {
            fan_out
                .consumer_arn(self.kinesis.as_ref(), &self.stream)
                .await?;
        }
        Ok(())
    }

    /// Handles a shard task's exit or a hand-off request; returns whether a lease round
    /// should run right away (a shard ended, so its children may be ready; a hand-over
    /// failed, so the lease may still be ours to run).
    async fn on_event(&mut self, event: Event) -> bool {
        match event {
            Event::HandoffRequested(key, to) => {
                if let Some(slot) = self.slots.get_mut(&key) {
                    if slot.handoff_to.is_none() {
                        tracing::info!(lease = %key, to = %to, "handing the shard over");
                        slot.handoff_to = Some(to);
                        slot.stop.cancel();
                    }
                }
                false
            }
            Event::ResetRequested(key) => {
                if let Some(slot) = self.slots.get_mut(&key) {
                    if !slot.reset {
                        tracing::info!(lease = %key, "checkpoint reset requested; stopping the shard to apply it");
                        slot.reset = true;
                        slot.stop.cancel();
                    }
                }
                false
            }
            Event::Exit(key, exit) => {
                let Some(slot) = self.slots.remove(&key) else {
                    return false;
                };
                lock(&self.held).remove(&key);
                self.labels.leases_held(self.slots.len());
                self.health.shard_stopped(&key);
                if slot.reset && matches!(exit, ShardExit::Stopped | ShardExit::Ended) {
                    apply_reset(&slot.lease, &key).await;
                    self.need_sync = true;
                }
                // A round runs at once after a shard ended (its children may be ready)
                // and after a failed hand-over (the lease may still be ours to run).
                let mut round_now = matches!(exit, ShardExit::Ended);
                let events = &self.config.events;
                let shard = || key.clone();
                match exit {
                    ShardExit::Lost => {
                        self.labels.lease_event(LeaseEvent::Lost);
                        tracing::info!(lease = %key, "lease lost");
                        events.emit(|| ShardEvent::LeaseLost { shard: shard() });
                    }
                    ShardExit::Stopped => match &slot.handoff_to {
                        Some(to) => match slot.lease.transfer(to).await {
                            Ok(_) => {
                                self.labels.lease_event(LeaseEvent::HandedOff);
                                tracing::info!(lease = %key, to = %to, "handed over after draining");
                                events.emit(|| ShardEvent::HandedOff {
                                    shard: shard(),
                                    to: worker_of(to).to_owned(),
                                });
                            }
                            Err(e) => {
                                round_now = true;
                                tracing::warn!(lease = %key, error = %e, "hand-off failed");
                                self.labels.lease_event(LeaseEvent::Lost);
                                events.emit(|| ShardEvent::LeaseLost { shard: shard() });
                            }
                        },
                        None => {
                            release(&slot.lease, &key).await;
                            events.emit(|| ShardEvent::Released { shard: shard() });
                        }
                    },
                    ShardExit::Ended => {
                        self.need_sync = true;
                        events.emit(|| ShardEvent::ShardEnded { shard: shard() });
                        match slot.lease.release().await {
                            // A hand-off asked for a shard that ended has nothing left to
                            // hand: the request goes, or its worker would keep waiting
                            // for it (and planning around it) until the row is deleted.
                            Ok(row) if row.pending_owner.is_some() => {
                                withdraw_stale_request(self.store.as_ref(), &row).await;
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(lease = %key, error = %e, "release failed; the lease will expire instead")
                            }
                        }
                    }
                    ShardExit::Failed(why) => {
                        tracing::warn!(lease = %key, %why, "giving the shard up");
                        self.need_sync = true;
                        release(&slot.lease, &key).await;
                        events.emit(|| ShardEvent::Released { shard: shard() });
                    }
                }
                round_now
            }
        }
    }

    /// One lease round: discover shards if due, then take, steal and clean up. Fails
    /// only when the table turns out to hold another stream's rows: a consumer of that
    /// stream created them at the moment this one started (both saw the table empty).
    /// The first round runs right after start-up, before any lease is taken.
    async fn round(&mut self) -> Result<(), ConsumerError> {
        self.rounds += 1;
        self.watch_leader().await;
        // The periodic shard sync (which lists the table too) is the leader's; every
        // worker syncs at start-up and when one of its shards ended.
        let steering = self.lists_every_round();
        let sync_due = self
            .last_sync
            .is_none_or(|t| steering && t.elapsed() >= self.config.shard_sync_interval);
        let synced = self.need_sync || sync_due;
        // Every worker, whatever its role, checks the stream's identity at the sync pace
        // (in a light round too): one reading a stream deleted and created again stops
        // within an interval, not when it comes to lead.
        let identity_due = self
            .last_identity_check
            .is_none_or(|t| t.elapsed() >= self.config.shard_sync_interval);
        if synced || identity_due {
            self.check_identity().await?;
            self.last_identity_check = Some(Instant::now());
        }
        // Who lists the whole table this round (see `lists_every_round`): besides the
        // leader, a worker that holds nothing, is short of its share, lost a race or
        // syncs. The rest only look for the leases handed to them.
        let full = synced
            || steering
            || self.slots.is_empty()
            || self.short
            // Below its share with nothing asked for (a hand-off it asked for went
            // elsewhere): plan again from a listing.
            || self.slots.len() + self.steals.len() < self.quota
            || self.raced_rounds > 0;
        if !full {
            self.light_round().await;
            return Ok(());
        }
        if synced {
            // While a reshard is in progress, keep reading what we hold and leave the
            // shard map and other workers' leases alone until the stream is ACTIVE.
            self.updating = matches!(self.kinesis.is_updating(&self.stream).await, Ok(true));
            if self.updating {
                tracing::debug!("stream is UPDATING; postponing shard discovery and steals");
            } else if let Err(e) = self.sync_shards().await {
                tracing::warn!(error = %e, "shard discovery failed; will retry");
            }
        }
        let listed = self.store.list().await;
        if listed.is_err() {
            self.give_up_leading_if_blind(false).await;
        }
        let Some(rows) = self.table_answered(listed, "listing leases") else {
            return Ok(());
        };
        self.check_stream(&rows)?;
        let balanced = self.balance(rows).await;
        self.give_up_leading_if_blind(balanced.is_ok()).await;
        if let Err(e) = balanced {
            tracing::warn!(error = %e, "lease round failed; will retry");
        }
        Ok(())
    }

    /// The answer of the read a lease round starts with (`what`), noting whether the
    /// table answered (see `run`: a table missing for a lease duration stops the
    /// worker); `None` after a failure, which the next round retries.
    fn table_answered<T>(&mut self, answer: Result<T, LeaseError>, what: &str) -> Option<T> {
        match answer {
            Ok(answer) => {
                self.table_missing_since = None;
                self.health.lease_table_ok();
                Some(answer)
            }
            Err(e) => {
                if matches!(e, LeaseError::TableMissing { .. }) {
                    self.table_missing_since.get_or_insert_with(Instant::now);
                }
                tracing::warn!(error = %e, "{what} failed; will retry");
                None
            }
        }
    }

    /// Whether this worker lists the whole table every round: in a fleet of up to
    /// [`SMALL_FLEET`] live workers (or before its first listing), or without a
    /// coordinator-state table, every worker does; in a larger one the leader (the
    /// holder of the leader item), which covers for the workers that do not (it takes
    /// expired leases at once and hands its surplus to the workers below their share).
    fn lists_every_round(&self) -> bool {
        self.coordination.is_none() || self.live.len() <= SMALL_FLEET || self.is_leading()
    }

    /// Whether this worker holds the leader item.
    fn is_leading(&self) -> bool {
        lock_leading(&self.leading).is_some()
    }

    /// Whether this worker leads: covers for the others (see `balance`). Whatever the
    /// fleet's size in its own view: the others' views of how many workers live are as
    /// old as their last listing, so after workers crash or stop the fleet may look
    /// small to the leader and large to the rest, which then do not list.
    fn leads(&self) -> bool {
        self.is_leading()
    }

    /// The key of this group's leader item: one per stream (in a multi-stream table,
    /// the stream's identity), since each stream's coordinator lists and covers only
    /// its own rows.
    fn leader_key(&self) -> String {
        match (&self.identity, self.multi_stream) {
            (Some(identity), true) => identity.to_string(),
            _ => LEADER_KEY.to_owned(),
        }
    }

    /// Reads the leader item (one small read a round; none while this worker leads) and
    /// takes it over when it is absent, released (no owner), or its counter stood still
    /// for a lease duration since this worker first saw it so (its holder stopped
    /// renewing it: crashed, or its writes fail). The take is conditional on the item
    /// as read, so of the workers that decide together one wins. A worker that finds
    /// itself the holder (a take whose answer was lost) leads.
    async fn watch_leader(&mut self) {
        let Some(state) = self.coordination.clone() else {
            return;
        };
        if self.is_leading() {
            return;
        }
        if self
            .no_claim_until
            .is_some_and(|until| Instant::now() < until)
        {
            return;
        }
        let key = self.leader_key();
        let item = match state.get(&key).await {
            Ok(item) => item,
            Err(e) => {
                tracing::debug!(error = %e, "could not read the leader item");
                return;
            }
        };
        let now = Instant::now();
        let me = self.config.owner.as_str();
        let standing_still = match (&self.leader_seen, &item) {
            (Some((Some(seen), since)), Some(current))
                if seen.owner == current.owner && seen.counter == current.counter =>
            {
                now.duration_since(*since) >= self.config.lease_duration
            }
            _ => false,
        };
        let claim = match &item {
            None => true,
            Some(current) if current.owner.as_deref() == Some(me) => {
                tracing::info!(leader_counter = current.counter, "leading the group");
                *lock_leading(&self.leading) = Some((current.clone(), now));
                self.took_lead = true;
                return;
            }
            Some(current) => current.owner.is_none() || standing_still,
        };
        if !claim {
            let moved = !matches!(&self.leader_seen, Some((seen, _)) if *seen == item);
            if moved {
                self.leader_seen = Some((item, now));
            }
            return;
        }
        let sent = Instant::now();
        match state.claim(&key, item.as_ref(), me).await {
            Ok(taken) => {
                match item.as_ref().and_then(|i| i.owner.as_deref()) {
                    Some(old) => {
                        tracing::info!(from = %old, leader_counter = taken.counter, "took over the leadership of a leader that stopped renewing it")
                    }
                    None => tracing::info!(leader_counter = taken.counter, "leading the group"),
                }
                *lock_leading(&self.leading) = Some((taken, sent));
                self.took_lead = true;
                self.leader_seen = None;
            }
            Err(e) => {
                tracing::debug!(error = %e, "did not take the leadership (another worker did, or the write failed)");
                // Read again next round: the winner's item differs from what we saw.
                self.leader_seen = None;
            }
        }
    }

    /// A leader whose listings or takes fail while its leader-item renewals land would
    /// keep the item and cover for nobody (the others do not list while they hold their
    /// share): after a lease duration of failed rounds (`ok`: this round listed and
    /// took what it meant to) it releases the item and leaves it to the others for a
    /// lease duration.
    async fn give_up_leading_if_blind(&mut self, ok: bool) {
        if ok || !self.is_leading() {
            self.leader_listing_failed_since = None;
            return;
        }
        let since = *self
            .leader_listing_failed_since
            .get_or_insert_with(Instant::now);
        if since.elapsed() < self.config.lease_duration {
            return;
        }
        tracing::warn!(
            "listing or taking leases failed for a lease duration; giving the leadership up"
        );
        self.leader_listing_failed_since = None;
        self.no_claim_until = Some(Instant::now() + self.config.lease_duration);
        self.resign().await;
    }

    /// Releases the leader item at a graceful stop, once every lease is released, so
    /// that the next worker to read it leads at once (within a round) instead of a
    /// lease duration later. A renewal that landed just before is looked up and the
    /// release sent again.
    async fn resign(&self) {
        let Some(state) = self.coordination.clone() else {
            return;
        };
        let Some((held, _)) = lock_leading(&self.leading).take() else {
            return;
        };
        let mut item = held;
        for _ in 0..2 {
            match state.release(&item).await {
                Ok(_) => {
                    tracing::info!("released the leadership");
                    return;
                }
                Err(LeaseError::Conflict(_)) => match state.get(&item.key).await {
                    Ok(Some(current)) if current.owner == item.owner => item = current,
                    _ => return,
                },
                Err(e) => {
                    tracing::warn!(error = %e, "could not release the leadership; another worker takes it over once it stops moving");
                    return;
                }
            }
        }
    }

    /// A round without a full listing: the keys this worker owns (the owner index), and
    /// a read of each row it owns without running it (handed over to it, by a leader or
    /// by an owner it asked) and of each row it asked for, which it takes anyway once
    /// the owner let the hand-off timeout pass, as in a full round.
    async fn light_round(&mut self) {
        let me = self.config.owner.clone();
        let owned = self.store.owned_keys(&me).await;
        let Some(keys) = self.table_answered(owned, "reading this worker's lease keys") else {
            return;
        };
        let mut wanted: BTreeSet<String> = keys
            .into_iter()
            .filter(|k| !self.slots.contains_key(k))
            .collect();
        wanted.extend(
            self.steals
                .keys()
                .filter(|k| !self.slots.contains_key(*k))
                .cloned(),
        );
        let reads: Vec<BoxFuture<'static, _>> = wanted
            .into_iter()
            .map(|key| {
                let store = self.store.clone();
                async move {
                    let row = store.get(&key).await;
                    (key, row)
                }
                .boxed()
            })
            .collect();
        let mut rows = Vec::new();
        for (key, row) in concurrently(reads).await {
            match row {
                Ok(Some(row)) => rows.push(row),
                // Gone: nothing to adopt or wait for.
                Ok(None) => {
                    self.steals.remove(&key);
                }
                Err(e) => tracing::debug!(lease = %key, error = %e, "could not read the lease"),
            }
        }
        let ours: Vec<&Lease> = rows
            .iter()
            .filter(|r| r.owner.as_deref() == Some(&me) && r.checkpoint != Checkpoint::ShardEnd)
            .collect();
        self.adopt(&ours).await;
        let now = Instant::now();
        for row in &rows {
            if !self.steals.contains_key(&row.key) {
                continue;
            }
            if row.pending_owner.as_deref() != Some(&me)
                || row.owner.as_deref() == Some(&me)
                || row.checkpoint == Checkpoint::ShardEnd
            {
                self.steals.remove(&row.key);
                continue;
            }
            self.take_overdue(row, now).await;
        }
    }

    /// Takes the leases the table says are this incarnation's but no task runs: handed
    /// over to it. (Rows of an earlier run of this worker id have another owner name:
    /// like any other worker's, they are taken once expired or handed over on request,
    /// so two live incarnations never take a lease back and forth.)
    async fn adopt(&mut self, ours: &[&Lease]) {
        for (row, result, sent) in self.take_many(ours, false).await {
            self.steals.remove(&row.key);
            match result {
                Ok(taken) => {
                    self.labels.lease_event(LeaseEvent::Taken);
                    self.start(taken, sent)
                }
                Err(e) => tracing::debug!(lease = %row.key, error = %e, "could not adopt"),
            }
        }
    }

    /// A hand-off this worker asked for on `row`: taken anyway once the owner let the
    /// hand-off timeout pass.
    async fn take_overdue(&mut self, row: &Lease, now: Instant) {
        let asked = *self.steals.entry(row.key.clone()).or_insert(now);
        if now.duration_since(asked) >= self.config.handoff_timeout {
            tracing::warn!(lease = %row.key, owner = ?row.owner, "the owner did not hand over in time; taking the lease");
            let sent = Instant::now();
            if let Ok(taken) = self.store.take(row, &self.config.owner).await {
                self.labels.lease_event(LeaseEvent::Stolen);
                self.steals.remove(&row.key);
                self.start(taken, sent);
            }
        }
    }

    async fn balance(&mut self, rows: Vec<Lease>) -> Result<(), LeaseError> {
        let now = Instant::now();
        // This incarnation (worker id and nonce): rows of an older incarnation of the
        // same worker id belong to another owner, which may still be running.
        let me = self.config.owner.clone();
        let by_key: BTreeMap<&str, &Lease> = rows.iter().map(|r| (r.key.as_str(), r)).collect();
        // Rows this listing shows for the first time: whether their owner runs is not
        // known yet (see `moved_at`).
        let mut first_seen: BTreeSet<&str> = BTreeSet::new();
        for row in &rows {
            let entry = self.seen.entry(row.key.clone()).or_insert_with(|| {
                first_seen.insert(row.key.as_str());
                (row.counter, now)
            });
            if entry.0 != row.counter {
                *entry = (row.counter, now);
            }
        }
        self.seen.retain(|k, _| by_key.contains_key(k.as_str()));
        let lease_duration = self.config.lease_duration;
        let expired = |row: &Lease, seen: &BTreeMap<String, (u64, Instant)>| {
            row.owner.is_some()
                && seen
                    .get(&row.key)
                    .is_some_and(|(_, t)| now.duration_since(*t) >= lease_duration)
        };
        self.report_unreadable(&rows);
        self.settle_finished(&rows, &by_key, |row| expired(row, &self.seen))
            .await;
        // A row that does not parse is never taken, and a parent whose row does not
        // parse is not known to be finished: its children wait, as for any parent not
        // at SHARD_END (a parent without a row was cleaned up after it finished). So do
        // the children of a finished parent with a reset pending: it is read again first.
        let eligible: Vec<&Lease> = rows
            .iter()
            .filter(|r| r.checkpoint != Checkpoint::ShardEnd && r.unreadable.is_none())
            .filter(|r| {
                r.parents.iter().all(|p| {
                    by_key.get(p.as_str()).is_none_or(|parent| {
                        parent.unreadable.is_none()
                            && parent.reset_to.is_none()
                            && parent.checkpoint == Checkpoint::ShardEnd
                    })
                })
            })
            .collect();

        // Leases the table says are this incarnation's but no task runs: handed over to
        // us (see `adopt`).
        let ours: Vec<&Lease> = eligible
            .iter()
            .copied()
            .filter(|r| r.owner.as_deref() == Some(&me) && !self.slots.contains_key(&r.key))
            .collect();
        self.adopt(&ours).await;

        // The plan every worker derives from this listing (see `balance`): our quota,
        // the free leases to take and the hand-offs to ask for. A lease we run is ours
        // even if it looks expired (after a pause); it is never taken again.
        let candidates: Vec<Candidate> = eligible
            .iter()
            .map(|r| {
                let owner = if self.slots.contains_key(&r.key) {
                    Some(me.as_str())
                } else {
                    r.owner.as_deref().filter(|_| !expired(r, &self.seen))
                };
                Candidate {
                    key: &r.key,
                    owner,
                    pending: owner.and(r.pending_owner.as_deref()),
                }
            })
            .collect();
        let plan = balance::plan(&me, &[me.as_str()], &candidates);
        let mut holds = plan.holds;
        self.quota = plan.quota;

        // The roles of this listing: the live shardflow workers (a KCL worker never
        // leads) and this one, in name order.
        let previous_unowned = std::mem::take(&mut self.unowned);
        self.unowned = candidates
            .iter()
            .filter(|c| by_key.get(c.key).is_some_and(|r| r.owner.is_none()))
            .map(|c| c.key.to_owned())
            .collect();
        let live: BTreeSet<&str> = candidates
            .iter()
            .filter_map(|c| c.owner)
            .filter(|o| o.contains(INCARNATION_SEPARATOR))
            .chain([me.as_str()])
            .collect();
        self.live = live.into_iter().map(str::to_owned).collect();
        let leads = self.leads();
        // Free leases, many at once: a fleet started together (each worker alone in its
        // first view) leases every shard within a few store round trips. Those the plan
        // deals to us, then other free ones up to our quota: a new child shard (its
        // parent just ended here) is read at once, not only at the round of the worker
        // the plan dealt it to. In random order, so workers racing for the same rows do
        // not move in lockstep.
        let mut free: Vec<&Lease> = plan
            .take
            .iter()
            .filter_map(|k| by_key.get(k).copied())
            .collect();
        let room = plan
            .quota
            .saturating_sub(plan.holds + free.len() + plan.ask.len());
        if room > 0 {
            let mut others: Vec<&Lease> = candidates
                .iter()
                .filter(|c| c.owner.is_none() && !plan.take.contains(&c.key))
                .filter_map(|c| by_key.get(c.key).copied())
                .collect();
            others.shuffle(&mut self.rng);
            free.extend(others.into_iter().take(room));
        }
        // A leader covers for the workers that do not list every round: it takes every
        // expired lease at once (reading resumes within the lease duration and a round
        // wherever the plan deals it), every lease released by its owner (a counter
        // above 0: a worker that stopped, a shard given up; read again within a round),
        // and every lease that was unowned already at its previous listing (a new
        // shard's, which the plan dealt to a worker that did not take it for a round).
        // It hands what it holds above its share to the workers below theirs (below),
        // those it took so first.
        if leads {
            let planned: BTreeSet<&str> = free.iter().map(|r| r.key.as_str()).collect();
            let covered: Vec<&Lease> = candidates
                .iter()
                .filter(|c| c.owner.is_none() && !planned.contains(c.key))
                .filter_map(|c| by_key.get(c.key).copied())
                .filter(|r| r.owner.is_some() || r.counter > 0 || previous_unowned.contains(&r.key))
                .collect();
            self.covered.extend(covered.iter().map(|r| r.key.clone()));
            free.extend(covered);
            // Workers seen renewing lately are running: a live worker renews every renew
            // interval, so one of its rows moves between two listings at least that far
            // apart. A lease this worker handed to one in its previous round does not
            // count, so a worker that just crashed is not kept alive by the leases
            // handed to it. Only running workers are handed leases.
            // Nor does a row first seen now (a new leader's first listing: a crashed
            // worker's rows look as fresh as anyone's).
            for row in rows
                .iter()
                .filter(|r| !self.handed.contains(&r.key) && !first_seen.contains(r.key.as_str()))
            {
                if let (Some(owner), Some((_, t))) = (&row.owner, self.seen.get(&row.key)) {
                    if *t == now {
                        self.moved_at.insert(owner.clone(), now);
                    }
                }
            }
            let lately = self.config.renew_interval.max(
                self.last_listing
                    .map_or(Duration::ZERO, |t| now.duration_since(t)),
            );
            self.moved_at
                .retain(|_, t| now.duration_since(*t) <= lately + lately / 4);
        }
        // A new leader lists again a lease duration after its first listing: the rows
        // that stood still since then (a crashed worker's, perhaps the old leader's) are
        // expired at that moment, and taken then rather than at a take tick that may
        // fall a few milliseconds short of it and leave them a round more.
        if std::mem::take(&mut self.took_lead) && leads {
            self.follow_up = Some(now + lease_duration);
        }
        self.last_listing = Some(now);
        self.handed.clear();
        free.shuffle(&mut self.rng);
        // A worker that sees no other live owner (a fleet started together: each alone
        // in its first view) sends no take after one lost a race: other workers are
        // taking too, and the next round, at once, plans again from a listing that shows
        // them, instead of every worker trying every row (40 workers x 2,000 takes).
        // A worker that sees the others follows the shared plan, where races are rare
        // (a crashed worker's leases are dealt out at once).
        let alone = !candidates
            .iter()
            .any(|c| c.owner.is_some_and(|o| o != me.as_str()));
        let mut failure = None;
        let mut raced = false;
        for (row, result, sent) in self.take_many(&free, alone).await {
            match result {
                Ok(taken) => {
                    match &row.owner {
                        Some(old) => {
                            self.labels.lease_event(LeaseEvent::Expired);
                            tracing::info!(lease = %row.key, from = %old, "took an expired lease");
                        }
                        None => self.labels.lease_event(LeaseEvent::Taken),
                    }
                    self.steals.remove(&row.key);
                    self.start(taken, sent);
                    holds += 1;
                }
                Err(LeaseError::Conflict(_)) => raced = true,
                Err(e) => failure = Some(e),
            }
        }
        // Not after a failure (a throttled table is not hammered), only when this round
        // took something, and a few times in a row at most.
        self.raced = raced
            && failure.is_none()
            && holds > plan.holds
            && self.raced_rounds < MAX_RACED_ROUNDS;
        self.raced_rounds = if self.raced { self.raced_rounds + 1 } else { 0 };
        if let Some(e) = failure {
            return Err(e);
        }

        // Hand-offs we asked for: taken anyway once the owner let the timeout pass.
        self.steals.retain(|k, _| {
            by_key.get(k.as_str()).is_some_and(|r| {
                r.pending_owner.as_deref() == Some(&me) && r.checkpoint != Checkpoint::ShardEnd
            })
        });
        for row in eligible
            .iter()
            .filter(|r| r.pending_owner.as_deref() == Some(&me) && r.owner.as_deref() != Some(&me))
        {
            self.take_overdue(row, now).await;
        }

        // Below our quota: ask the owners the plan names for hand-offs, all at once
        // (bounded by `max_steals_per_round`). A request that loses to another
        // worker's (whose view differed) is planned again at the next quick round.
        for row in eligible.iter().filter(|r| {
            r.has_foreign_owner() && !expired(r, &self.seen) && self.warned.insert(r.key.clone())
        }) {
            tracing::warn!(
                lease = %row.key,
                owner = ?row.owner,
                "the lease is held by a live worker that is not shardflow (a KCL worker?); \
                 a mixed fleet is not supported: stop the KCL fleet, its leases are taken once they expire"
            );
        }
        // A worker that holds nothing and asked for nothing is known only to itself:
        // the others plan without it, and workers in that state (many, in a fleet
        // started together) all plan the same hand-offs for themselves. It first asks
        // for one lease picked at random among those above their owner's quota, which
        // rarely collides and makes it known; the next round's plan is then shared.
        let unknown = plan.holds == 0 && plan.take.is_empty();
        let wanted: Vec<&str> = match plan.surplus.choose(&mut self.rng) {
            Some(one) if unknown && !plan.ask.is_empty() => vec![*one],
            _ => plan.ask.clone(),
        };
        let asks: Vec<Lease> = if self.updating {
            Vec::new()
        } else {
            wanted
                .iter()
                .filter_map(|k| by_key.get(k).copied())
                // A live KCL worker would never answer a hand-off request, and sharing
                // a table with one (a mixed fleet) is not supported: its leases are
                // taken only once they expire (the KCL fleet stopped).
                .filter(|r| !r.has_foreign_owner() && !self.steals.contains_key(&r.key))
                .take(self.config.max_steals_per_round)
                .cloned()
                .collect()
        };
        let requests: Vec<BoxFuture<'static, _>> = asks
            .into_iter()
            .map(|row| {
                let (store, me) = (self.store.clone(), me.clone());
                async move {
                    let asked = ask_for_handoff(store.as_ref(), &row, &me).await;
                    (row, asked)
                }
                .boxed()
            })
            .collect();
        for (row, asked) in concurrently(requests).await {
            match asked {
                Ok(true) => {
                    tracing::info!(lease = %row.key, from = ?row.owner, "asked for a hand-off");
                    self.steals.insert(row.key.clone(), now);
                    holds += 1;
                }
                Ok(false) => {}
                Err(e) => failure = Some(e),
            }
        }
        // Still short (a take or request lost to a worker whose view differed, or
        // leases to ask for beyond this round's bound): plan again at a quick round.
        self.short = !self.updating && holds < plan.quota;
        if let Some(e) = failure {
            return Err(e);
        }

        // A leader hands what it holds above its share to the workers the plan deals
        // it to, which may not list the table for rounds: it writes the worker as the
        // row's hand-off request itself; its renewal finds it, drains the shard and
        // hands the lease over, and the worker adopts it at its next round (its
        // owner index names it). The same request the worker would make itself.
        if leads && !self.updating {
            // As many leases to each worker as the plan deals it, those this worker took
            // to cover for others first (they just started: the shortest drain, and no
            // shard that ran here all along moves).
            self.covered.retain(|k| self.slots.contains_key(k));
            let mut keys: Vec<&str> = self.covered.iter().map(String::as_str).collect();
            keys.extend(
                plan.give
                    .iter()
                    .map(|(key, _)| *key)
                    .filter(|k| !self.covered.contains(*k)),
            );
            // And the hand-offs the plan deals from other owners above their share, which
            // the workers below theirs, not listing, would not ask for: the leader asks
            // on their behalf (the same request; the owner drains and hands over).
            let own = keys
                .into_iter()
                .zip(plan.give.iter().map(|(_, to)| *to))
                // A lease taken this round is handed on from the next listing, which
                // shows it as this worker's.
                .filter(|(key, _)| {
                    self.slots.contains_key(*key)
                        && by_key
                            .get(key)
                            .is_some_and(|r| r.owner.as_deref() == Some(me.as_str()))
                });
            let others = plan.arrange.iter().copied().filter(|(key, _)| {
                by_key.get(key).is_some_and(|r| {
                    r.pending_owner.is_none()
                        && r.owner
                            .as_deref()
                            .is_some_and(|o| o.contains(INCARNATION_SEPARATOR))
                })
            });
            let gives: Vec<BoxFuture<'static, _>> = own
                .chain(others)
                .filter(|(_, to)| {
                    to.contains(INCARNATION_SEPARATOR) && self.moved_at.contains_key(*to)
                })
                .filter_map(|(key, to)| by_key.get(key).map(|row| ((*row).clone(), to.to_owned())))
                .take(self.config.max_steals_per_round)
                .map(|(row, to)| {
                    let store = self.store.clone();
                    async move {
                        let given = ask_for_handoff(store.as_ref(), &row, &to).await;
                        (row, to, given)
                    }
                    .boxed()
                })
                .collect();
            for (row, to, given) in concurrently(gives).await {
                match given {
                    Ok(true) => {
                        tracing::info!(lease = %row.key, %to, "handing a lease to a worker below its share");
                        self.handed.insert(row.key.clone());
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::debug!(lease = %row.key, %to, error = %e, "could not hand the lease over")
                    }
                }
            }
        }

        self.clean_up(&rows).await;
        Ok(())
    }

    /// Settles what a finished row (at SHARD_END, nobody reading it) still carries:
    ///
    /// - a hand-off request: nothing is left to hand over, so it is withdrawn (by
    ///   whoever lists it first), or its worker would wait for it until the row is
    ///   deleted past retention;
    /// - a checkpoint reset an operator asked for while the shard was still read, which
    ///   its owner did not see before the shard ended (or its owner died at the end):
    ///   applied here, to the row (taken first if its owner's lease expired) and to the
    ///   row's descendants, as an operator's reset of a finished shard does, so the
    ///   shard is read again before its children are (they wait meanwhile, see
    ///   `balance`).
    async fn settle_finished(
        &self,
        rows: &[Lease],
        by_key: &BTreeMap<&str, &Lease>,
        expired: impl Fn(&Lease) -> bool,
    ) {
        let me = self.config.owner.as_str();
        for row in rows.iter().filter(|r| {
            r.checkpoint == Checkpoint::ShardEnd
                && r.unreadable.is_none()
                && !self.slots.contains_key(&r.key)
        }) {
            // (The withdrawal keeps the counter: a reset below still applies.)
            if row.owner.is_none() && row.pending_owner.is_some() {
                withdraw_stale_request(self.store.as_ref(), row).await;
            }
            let Some(to) = row.reset_to.clone() else {
                continue;
            };
            let unowned = match &row.owner {
                None => row.clone(),
                Some(_) if expired(row) => match self.store.take(row, me).await {
                    Ok(taken) => taken,
                    Err(e) => {
                        tracing::debug!(lease = %row.key, error = %e, "could not take a finished lease to reset it");
                        continue;
                    }
                },
                Some(_) => continue,
            };
            let applied = self.store.reset(&unowned, &to).await;
            if unowned.owner.is_some() {
                let held = HeldLease::taken_at(
                    applied.as_ref().unwrap_or(&unowned).clone(),
                    self.store.clone(),
                    me,
                    Instant::now(),
                );
                release(&held, &row.key).await;
            }
            match applied {
                Ok(_) => {
                    tracing::info!(lease = %row.key, checkpoint = %to, "checkpoint reset of a finished shard applied");
                    self.reset_descendants(&row.key, &to, by_key).await;
                }
                Err(e) => {
                    tracing::debug!(lease = %row.key, error = %e, "could not apply the reset of a finished shard")
                }
            }
        }
    }

    /// Resets the descendants of `key`, whose reset to `to` was just applied after its
    /// end: to the same start, or from their own start when `to` is a record of the
    /// parent (as `shardflow group reset` does for a finished shard).
    async fn reset_descendants(&self, key: &str, to: &Checkpoint, by_key: &BTreeMap<&str, &Lease>) {
        let below = match to {
            Checkpoint::At(_) | Checkpoint::ShardEnd => Checkpoint::TrimHorizon,
            start => start.clone(),
        };
        let mut todo = vec![key];
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        while let Some(parent) = todo.pop() {
            for child in by_key
                .values()
                .filter(|r| r.parents.iter().any(|p| p == parent))
            {
                if !seen.insert(child.key.as_str()) {
                    continue;
                }
                todo.push(child.key.as_str());
                if let Err(e) =
                    crate::admin::reset_checkpoint(self.store.as_ref(), &child.key, &below).await
                {
                    tracing::warn!(lease = %child.key, error = %e, "could not reset a descendant of a reset finished shard");
                }
            }
        }
    }

    /// Reports the rows of a listing that do not parse: in health (the worker is not
    /// ready while one is listed), and once per row found so in an event and a warning.
    fn report_unreadable(&self, rows: &[Lease]) {
        let unreadable: BTreeMap<&str, &str> = rows
            .iter()
            .filter_map(|r| Some((r.key.as_str(), r.unreadable.as_deref()?)))
            .collect();
        for key in self.health.unreadable_rows(unreadable.clone()) {
            let reason = unreadable.get(key.as_str()).copied().unwrap_or_default();
            tracing::warn!(lease = %key, %reason, "a lease row does not parse: its shard and its children are not read until it is repaired");
            self.config.events.emit(|| ShardEvent::RowUnreadable {
                shard: key.clone(),
                reason: reason.to_owned(),
            });
        }
    }

    /// Deletes rows of finished shards once Kinesis no longer lists the shard (it is
    /// past retention) and every child still listed has started (its checkpoint moved).
    ///
    /// Until then the row stays as a tombstone: SHARD_END says the shard was read. A
    /// worker that decided to create a shard's row from an older listing and was paused
    /// before the create landed (GC, SIGSTOP, a slow network) would otherwise create
    /// the row again after its deletion, and the whole shard would be read a second
    /// time; the create is conditional on the row's absence, so a tombstone refuses it.
    /// Once the shard is past retention, a row created again that way finds nothing to
    /// read. The cost is one small row per finished shard for the retention period.
    async fn clean_up(&self, rows: &[Lease]) {
        let by_key: BTreeMap<&str, &Lease> = rows.iter().map(|r| (r.key.as_str(), r)).collect();
        let started = |child: &str| {
            by_key
                .get(child)
                .is_some_and(|l| matches!(l.checkpoint, Checkpoint::At(_) | Checkpoint::ShardEnd))
        };
        let waits = |row: &Lease, fresh: &[ShardInfo]| {
            children_of(&self.shards, &row.key)
                .chain(children_of(fresh, &row.key))
                .chain(row.children.iter().map(String::as_str))
                .any(|c| (listed(fresh, c) || listed(&self.shards, c)) && !started(c))
        };
        let finished: Vec<&Lease> = rows
            .iter()
            .filter(|r| r.checkpoint == Checkpoint::ShardEnd && r.owner.is_none())
            .filter(|r| !listed(&self.shards, &r.key))
            // Judged on the last sync's listing first: no extra ListShards each round
            // while a child has not started (an idle child may never start).
            .filter(|r| !waits(r, &[]))
            .collect();
        if finished.is_empty() {
            return;
        }
        // A ListShards answer that left the shard out, or a child that has not
        // started, would let a row go while it still holds a child back (the child,
        // its parent's row gone, would not wait for it): a second answer must agree.
        let fresh = match self.kinesis.list_shards(&self.stream).await {
            Ok(fresh) => fresh,
            Err(e) => {
                tracing::debug!(error = %e, "could not confirm finished shards past retention");
                return;
            }
        };
        for row in finished {
            if listed(&fresh, &row.key) {
                continue;
            }
            if waits(row, &fresh) {
                continue;
            }
            match self.store.delete(row).await {
                Ok(()) => {
                    tracing::debug!(lease = %row.key, "removed the lease of a shard past retention")
                }
                Err(e) => {
                    tracing::debug!(lease = %row.key, error = %e, "could not remove a finished lease")
                }
            }
        }
    }

    /// Lists the shards and creates a lease for each shard that has none, parents
    /// before children so no worker can see a child without its parent.
    ///
    /// A shard without a row is skipped when any of its descendants (children,
    /// grandchildren, ... in this ListShards answer or named so by the rows' parents)
    /// has a row or gets one in this sync:
    /// the shard was consumed to its end and its row cleaned up (see `clean_up`), and
    /// reading it again would deliver it twice. An open shard has no descendants, so it
    /// always gets a row.
    ///
    /// At the first sync (no rows yet) every shard gets a row, closed or not. LATEST
    /// is read as AT_TIMESTAMP of the moment this worker started (less the clock
    /// margin), not of the sync: a first sync delayed by failing calls or a stale
    /// ListShards answer, during which a shard was closed by a reshard, must still read
    /// that shard's records written since the start. At a timestamp a parent closed
    /// after it still holds records to read, and one closed before it yields nothing
    /// and ends at once. Children wait for their parents either way.
    async fn sync_shards(&mut self) -> Result<(), ConsumerError> {
        // Decisions below are as old as the older of the two listings.
        let listed_at = Instant::now();
        let mut shards = self.kinesis.list_shards(&self.stream).await?;
        let rows = self.store.list().await?;
        self.check_stream(&rows)?;
        self.claim_rows(&rows, &shards).await;
        self.record_children(&rows, &shards).await;
        let keys: BTreeSet<&str> = rows.iter().map(|r| r.key.as_str()).collect();
        self.confirm_listing(&mut shards, &keys).await?;
        shards.sort_by(|a, b| a.starting_sequence_number.cmp(&b.starting_sequence_number));
        let ids: BTreeSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
        let mut children: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for shard in &shards {
            for parent in [&shard.parent_shard_id, &shard.adjacent_parent_shard_id]
                .into_iter()
                .flatten()
            {
                children
                    .entry(parent.as_str())
                    .or_default()
                    .push(shard.shard_id.as_str());
            }
        }
        // The table's own parent links too: a stale answer can leave a child out (and
        // its row names its parents), and a shard whose child has a row was consumed
        // to its end, whether its own row is still there or was cleaned up.
        for row in &rows {
            for parent in &row.parents {
                let known = children.entry(parent.as_str()).or_default();
                if !known.contains(&row.key.as_str()) {
                    known.push(row.key.as_str());
                }
            }
        }
        let first = rows.is_empty();
        // LATEST is resolved once, here, into the time this worker started (less the
        // clock margin) and written in the rows it creates: every owner, the first
        // included, continues from that time, so no change of owner before the first
        // checkpoint can skip a record.
        let initial = match &self.config.initial_position {
            InitialPosition::TrimHorizon => Checkpoint::TrimHorizon,
            InitialPosition::Latest => Checkpoint::latest_from(self.started),
            InitialPosition::AtTimestamp(t) => Checkpoint::AtTimestamp(Some(*t)),
        };
        let mut created: BTreeSet<&str> = BTreeSet::new();
        let mut to_create = Vec::new();
        for shard in &shards {
            if keys.contains(shard.shard_id.as_str()) {
                continue;
            }
            let consumed = descendants(&children, &shard.shard_id)
                .any(|d| keys.contains(d) || created.contains(d));
            if consumed {
                continue;
            }
            let parents = shard.parents();
            // After the first sync, a closed shard without a row whose parents have no
            // row either, listed without its children, was consumed and cleaned up past
            // retention (a stale answer lists it without them): it must not come back.
            // One whose children are listed, none with a row (`consumed` is false), was
            // never read: a first sync cut short (a failed create, a shutdown or crash
            // during start-up) left it out.
            if !first
                && shard.is_closed()
                && !children.contains_key(shard.shard_id.as_str())
                && !parents
                    .iter()
                    .any(|p| keys.contains(p.as_str()) || created.contains(p.as_str()))
            {
                continue;
            }
            let checkpoint = if first {
                initial.clone()
            } else if parents
                .iter()
                .any(|p| ids.contains(p.as_str()) || keys.contains(p.as_str()))
            {
                // Parents nobody read yet, still at the group's start time (LATEST's or
                // AT_TIMESTAMP's): the child starts there too, as at the first sync (a
                // first sync cut short left it out); otherwise at its oldest record.
                unread_start(&parents, &rows, &to_create).unwrap_or(Checkpoint::TrimHorizon)
            } else {
                initial.clone()
            };
            let mut lease = Lease::new(shard.shard_id.clone(), parents, checkpoint);
            lease.stream = Some(self.stream.to_string());
            lease.hash_range = Some((shard.starting_hash_key, shard.ending_hash_key));
            to_create.push(lease);
            created.insert(shard.shard_id.as_str());
        }
        let complete = self.create_leases(to_create, listed_at).await?;
        self.shards = shards;
        self.last_sync = Some(Instant::now());
        self.need_sync = !complete;
        Ok(())
    }

    /// Confirms a ListShards answer where it may be stale: when a shard without a row
    /// names a parent that is neither listed nor in the table, the parent may have
    /// been trimmed (past retention) or the answer may have left it out. Two more
    /// answers, a moment apart, are merged in before the parent is taken for gone; a
    /// child created without its parent would be read before it (lost order, and
    /// the parent's records never read). Tables where every shard has a row never pay
    /// for this.
    async fn confirm_listing(
        &self,
        shards: &mut Vec<ShardInfo>,
        keys: &BTreeSet<&str>,
    ) -> Result<(), KinesisError> {
        for _ in 0..STALE_LIST_RETRIES {
            let listed: BTreeSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
            let unknown_parent = shards
                .iter()
                .filter(|s| !keys.contains(s.shard_id.as_str()))
                .flat_map(|s| [&s.parent_shard_id, &s.adjacent_parent_shard_id])
                .flatten()
                .any(|p| !listed.contains(p.as_str()) && !keys.contains(p.as_str()));
            if !unknown_parent {
                break;
            }
            tokio::time::sleep(STALE_LIST_PAUSE).await;
            let again = self.kinesis.list_shards(&self.stream).await?;
            let missing: Vec<ShardInfo> = again
                .into_iter()
                .filter(|s| !listed.contains(s.shard_id.as_str()))
                .collect();
            if !missing.is_empty() {
                tracing::info!(shards = ?missing.iter().map(|s| &s.shard_id).collect::<Vec<_>>(), "a ListShards answer left shards out; using a newer one");
            }
            shards.extend(missing);
        }
        Ok(())
    }

    /// Multi-stream mode: resolves the stream's identity (account and creation time),
    /// refuses a table of single-stream rows and from then on sees only this stream's
    /// rows, under bare shard ids (see [`StreamScopedStore`]).
    async fn scope_to_stream(&mut self) -> Result<(), ConsumerError> {
        let identity = self.kinesis.stream_identity(&self.stream).await?;
        let rows = self.store.list().await?;
        // Unfinished rows of this stream name under another creation time, and none
        // under ours: the stream was deleted and created again, or the rows were
        // written with another creation time (a KCL application's own identifier).
        // Starting afresh would skip or re-read what those rows hold, so the consumer
        // refuses. (Old rows that are all finished hold nothing more to read.)
        let keyed = || {
            rows.iter()
                .filter_map(|r| StreamIdentity::split_lease_key(&r.key).map(|(id, _)| (id, r)))
        };
        if !keyed().any(|(id, _)| id == identity) {
            if let Some((found, row)) = keyed().find(|(id, row)| {
                id.name == identity.name
                    && id.account == identity.account
                    && row.checkpoint != Checkpoint::ShardEnd
            }) {
                return Err(ConsumerError::StreamCreatedAgain {
                    table: self.config.lease_table.clone(),
                    stream: identity.to_string(),
                    rows: found.to_string(),
                    lease: row.key.clone(),
                });
            }
        }
        if let Some(row) = rows
            .iter()
            .find(|r| StreamIdentity::split_lease_key(&r.key).is_none())
        {
            return Err(ConsumerError::TableModeMismatch {
                table: self.config.lease_table.clone(),
                consumer: format!("stream {:?} in multi-stream mode", &*self.stream),
                rows: format!(
                    "single-stream rows (of stream {:?})",
                    row.stream.as_deref().unwrap_or("unnamed, a KCL table")
                ),
                lease: row.key.clone(),
            });
        }
        tracing::info!(stream = %identity, "multi-stream mode: this stream's lease keys start with its identity");
        self.multi_stream = false;
        self.identity = Some(identity.clone());
        self.store = Arc::new(StreamScopedStore::new(self.store.clone(), identity));
        Ok(())
    }

    /// Multi-stream mode: stops this stream's coordinator when the stream's identity
    /// changed (deleted and created again while the group runs): its rows hold positions
    /// in the old stream, and a worker started later would key the new stream's shards
    /// differently, so two workers could read one shard. Not knowing (the call failed)
    /// keeps going; the next sync asks again.
    async fn check_identity(&self) -> Result<(), ConsumerError> {
        let Some(known) = &self.identity else {
            return Ok(());
        };
        match self.kinesis.stream_identity(&self.stream).await {
            Ok(now) if now != *known => Err(ConsumerError::StreamCreatedAgain {
                table: self.config.lease_table.clone(),
                stream: now.to_string(),
                rows: known.to_string(),
                lease: String::new(),
            }),
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::debug!(error = %e, "could not check the stream's identity; will ask again");
                Ok(())
            }
        }
    }

    /// Refuses a table whose rows name another stream. Rows without a stream (written
    /// by the KCL) are accepted: a KCL table is taken over as it is. A single-stream
    /// consumer refuses a multi-stream table (whose rows a scoped store never shows).
    fn check_stream(&self, rows: &[Lease]) -> Result<(), ConsumerError> {
        if let Some((row, identity)) = rows
            .iter()
            .find_map(|r| StreamIdentity::split_lease_key(&r.key).map(|(id, _)| (r, id)))
        {
            return Err(ConsumerError::TableModeMismatch {
                table: self.config.lease_table.clone(),
                consumer: format!("the single stream {:?}", &*self.stream),
                rows: format!("multi-stream rows (of stream {identity})"),
                lease: row.key.clone(),
            });
        }
        match rows
            .iter()
            .find(|r| r.stream.as_deref().is_some_and(|s| s != &*self.stream))
        {
            Some(row) => Err(ConsumerError::TableOfAnotherStream {
                table: self.config.lease_table.clone(),
                stream: self.stream.to_string(),
                other_stream: row.stream.clone().unwrap_or_default(),
                lease: row.key.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Records our stream in the rows of our shards that name none (a KCL table taken
    /// over), so that a consumer of another stream is refused on this table from now on.
    /// A row that changed meanwhile (a live owner's renewal) is tried again at the next
    /// sync.
    async fn claim_rows(&self, rows: &[Lease], shards: &[ShardInfo]) {
        let ids: BTreeSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
        for row in rows.iter().filter(|r| {
            r.stream.is_none() && r.unreadable.is_none() && ids.contains(r.key.as_str())
        }) {
            if let Err(e) = self.store.claim_for_stream(row, &self.stream).await {
                tracing::debug!(lease = %row.key, error = %e, "could not record the stream in the row");
            }
        }
    }

    /// Writes `childShardIds` into our rows at SHARD_END that have none, as the KCL does
    /// when a shard ends, so a KCL application that takes the table back finds them.
    async fn record_children(&self, rows: &[Lease], shards: &[ShardInfo]) {
        for row in rows
            .iter()
            .filter(|r| r.checkpoint == Checkpoint::ShardEnd && r.children.is_empty())
        {
            let mut children: Vec<String> =
                children_of(shards, &row.key).map(str::to_owned).collect();
            if children.is_empty() {
                continue;
            }
            children.sort();
            if let Err(e) = self.store.record_children(row, &children).await {
                tracing::debug!(lease = %row.key, error = %e, "could not record the children");
            }
        }
    }

    /// Creates `leases` (in parent-before-child order), many at once but never a child
    /// before its parents: in waves, each holding the leases whose parents are not
    /// waiting to be created, so no worker can see a child without its parent. A fleet
    /// started on a new table then creates thousands of rows in a few round trips. Each
    /// wave goes out [`MAX_CONCURRENT_WRITES`] creates at a time in a worker's own
    /// random order; once a row turns out to exist already, the rows listed since are
    /// left out, so workers started together share the creation.
    /// Returns whether every lease was sent (or already existed).
    ///
    /// Every decision was taken on the rows listed at `listed_at`. A worker paused
    /// after that (GC, SIGSTOP) could create a row that meanwhile was finished and
    /// cleaned up, and the shard would be read again: a create is not sent once the
    /// listing is older than a renewal interval (the next sync decides again).
    async fn create_leases(
        &mut self,
        mut leases: Vec<Lease>,
        listed_at: Instant,
    ) -> Result<bool, LeaseError> {
        let max_age = self.config.renew_interval;
        while !leases.is_empty() {
            let waiting: BTreeSet<String> = leases.iter().map(|l| l.key.clone()).collect();
            let (mut wave, later): (Vec<Lease>, Vec<Lease>) = leases
                .into_iter()
                .partition(|l| l.parents.iter().all(|p| !waiting.contains(p)));
            leases = later;
            // Each worker starts at its own random place in the wave and goes on in order:
            // workers that start together then create different runs of rows, and meet
            // only where one run reaches the next.
            let from = self.rng.gen_range(0..wave.len().max(1));
            wave.rotate_left(from);
            while !wave.is_empty() {
                let chunk: Vec<Lease> = wave
                    .drain(..wave.len().min(MAX_CONCURRENT_WRITES))
                    .collect();
                let creates: Vec<BoxFuture<'static, _>> = chunk
                    .into_iter()
                    .map(|lease| {
                        let store = self.store.clone();
                        async move {
                            if listed_at.elapsed() > max_age {
                                return (lease, None);
                            }
                            let created = store.create(&lease).await;
                            (lease, Some(created))
                        }
                        .boxed()
                    })
                    .collect();
                let mut complete = true;
                let mut existed = false;
                for (lease, created) in concurrently(creates).await {
                    match created {
                        Some(created) => {
                            if created? {
                                tracing::info!(lease = %lease.key, parents = ?lease.parents, "created a lease for a new shard");
                            } else {
                                existed = true;
                            }
                        }
                        None => complete = false,
                    }
                }
                if !complete {
                    // No child after a parent that was not created; decide again.
                    tracing::info!(
                        "the shard listing is too old to create leases from; syncing again"
                    );
                    return Ok(false);
                }
                // A row that already existed: other workers (a group started together)
                // are creating the same rows. One listing leaves out what they created
                // meanwhile, instead of one conditional put per shard per worker (40
                // workers x 2,000 shards were 80,000 puts). A failed listing changes
                // nothing: the creates go on.
                if existed && !wave.is_empty() {
                    match self.store.list().await {
                        Ok(rows) => {
                            let keys: BTreeSet<&str> =
                                rows.iter().map(|r| r.key.as_str()).collect();
                            wave.retain(|l| !keys.contains(l.key.as_str()));
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "could not list the rows others created; creating on")
                        }
                    }
                }
            }
        }
        Ok(true)
    }

    /// Takes `rows` for this worker, [`MAX_CONCURRENT_WRITES`] conditional writes at a
    /// time; returns each row with its outcome and when its take was sent. With
    /// `until_raced`, no take is sent after one lost a race (the rows not tried are left
    /// out of the answer).
    async fn take_many(
        &self,
        rows: &[&Lease],
        until_raced: bool,
    ) -> Vec<(Lease, Result<Lease, LeaseError>, Instant)> {
        let raced = Arc::new(AtomicBool::new(false));
        // Boxed 'static futures: a borrowing closure here trips the compiler's `Send`
        // inference for the spawned worker future.
        let takes: Vec<BoxFuture<'static, _>> = rows
            .iter()
            .map(|row| {
                let (row, store) = ((*row).clone(), self.store.clone());
                let (me, raced) = (self.config.owner.clone(), raced.clone());
                async move {
                    if until_raced && raced.load(Ordering::SeqCst) {
                        return None;
                    }
                    let sent = Instant::now();
                    let result = match store.take(&row, &me).await {
                        // An unknown outcome (a timeout, a lost reply): if the take
                        // landed, the row is ours and nobody else will take it while
                        // its counter moves, so find out rather than take it again.
                        Err(e) if !matches!(e, LeaseError::Conflict(_)) => {
                            match store.get(&row.key).await {
                                Ok(Some(cur))
                                    if cur.owner.as_deref() == Some(me.as_str())
                                        && cur.counter == row.counter.saturating_add(1) =>
                                {
                                    Ok(cur)
                                }
                                _ => Err(e),
                            }
                        }
                        result => result,
                    };
                    if matches!(result, Err(LeaseError::Conflict(_))) {
                        raced.store(true, Ordering::SeqCst);
                    }
                    Some((row, result, sent))
                }
                .boxed()
            })
            .collect();
        concurrently(takes).await.into_iter().flatten().collect()
    }

    /// Starts the shard task of a lease whose take was sent at `sent`.
    fn start(&mut self, row: Lease, sent: Instant) {
        let key = row.key.clone();
        // A reset requested before this take is applied at once (after the stop).
        let (reset_pending, key_for_reset) = (row.reset_to.is_some(), key.clone());
        let lease = Arc::new(HeldLease::taken_at(
            row,
            self.store.clone(),
            &self.config.owner,
            sent,
        ));
        let out = match &self.sink {
            Sink::PerShard(spawn) => {
                let (tx, rx) = mpsc::channel(self.config.prefetch_batches);
                self.dispatchers.add(spawn(rx));
                tx
            }
            Sink::Shared(tx) => tx.clone(),
        };
        let stop = self.tasks.child_token();
        let hash_range = self
            .shards
            .iter()
            .find(|s| s.shard_id == key)
            .map(|s| (s.starting_hash_key, s.ending_hash_key));
        self.health.shard_started(&key);
        let task = ShardTask {
            labels: self.labels.clone(),
            health: self.health.clone(),
            shard_id: key.as_str().into(),
            config: self.config.clone(),
            kinesis: self.kinesis.clone(),
            stream: self.stream.clone(),
            hash_range,
            lease: lease.clone(),
            out,
            stop: stop.clone(),
        };
        let events = self.events_tx.clone();
        let span = tracing::info_span!("shard", shard = %key);
        let exit_key = key.clone();
        let task = tokio::spawn(
            async move {
                let exit = task.run().await;
                let _ = events.send(Event::Exit(exit_key, exit));
            }
            .instrument(span),
        );
        tracing::info!(lease = %key, "reading shard");
        self.config
            .events
            .emit(|| ShardEvent::LeaseTaken { shard: key.clone() });
        lock(&self.held).insert(key.clone(), lease.clone());
        self.slots.insert(
            key,
            Slot {
                lease,
                stop,
                task,
                handoff_to: None,
                reset: false,
            },
        );
        self.labels.leases_held(self.slots.len());
        if reset_pending {
            let _ = self.events_tx.send(Event::ResetRequested(key_for_reset));
        }
    }

    /// Stops every shard (drain, commit) and releases its lease.
    async fn shutdown(&mut self) {
        for slot in self.slots.values() {
            slot.stop.cancel();
        }
        let deadline = Instant::now() + self.config.shutdown_timeout * 2;
        while !self.slots.is_empty() {
            match tokio::time::timeout_at(deadline, self.events_rx.recv()).await {
                Ok(Some(event @ Event::Exit(..))) => {
                    self.on_event(event).await;
                }
                Ok(Some(Event::HandoffRequested(..) | Event::ResetRequested(..))) => {}
                Ok(None) | Err(_) => break,
            }
        }
        for (key, slot) in std::mem::take(&mut self.slots) {
            tracing::warn!(lease = %key, "shard did not stop in time; releasing its lease");
            slot.task.abort();
            let _ = slot.task.await;
            release(&slot.lease, &key).await;
            self.config
                .events
                .emit(|| ShardEvent::Released { shard: key.clone() });
        }
        self.release_unheld().await;
        tracing::info!("worker stopped; leases released");
    }

    /// The last step of a shutdown, once no shard task runs: withdraws this worker's
    /// hand-off requests, so that no owner hands a lease to a worker that is gone, and
    /// releases the rows the table says are this incarnation's although no task held
    /// them (a hand-over that landed after the last lease round, a take whose answer was
    /// lost). Without it such a row waits a whole lease duration before another worker
    /// takes it. Costs one listing of the table; the calls are retried when they fail
    /// transiently, run [`MAX_CONCURRENT_WRITES`] at a time, and the whole step ends
    /// after one lease duration at most, whatever the store does (by then any such row
    /// has expired and is taken by another worker anyway).
    async fn release_unheld(&self) {
        let (store, me) = (self.store.clone(), self.config.owner.clone());
        let sweep = async {
            let rows = match with_retries(|| store.list()).await {
                Ok(rows) => rows,
                Err(e) => {
                    tracing::warn!(error = %e, "could not list the leases at shutdown; a lease handed to this worker meanwhile will expire instead");
                    return;
                }
            };
            let settles: Vec<BoxFuture<'static, ()>> = rows
                .into_iter()
                .filter(|r| {
                    r.owner.as_deref() == Some(&me) || r.pending_owner.as_deref() == Some(&me)
                })
                .map(|row| settle_unheld(store.clone(), me.clone(), row).boxed())
                .collect();
            concurrently(settles).await;
        };
        let limit = self.config.lease_duration;
        if tokio::time::timeout(limit, sweep).await.is_err() {
            tracing::warn!(?limit, "leases handed to this worker at shutdown were not all settled in time; they will expire instead");
        }
    }
}

/// Asks the owner of `row` to hand it over to `me`. The row was listed a moment ago and its
/// owner's renewals bump the counter the request is conditional on, so a conflict is
/// checked once against a fresh read: still the same owner and nobody else asking
/// means the request is sent again. Returns whether it was recorded.
async fn ask_for_handoff(
    store: &dyn LeaseStore,
    row: &Lease,
    me: &str,
) -> Result<bool, LeaseError> {
    match store.request_handoff(row, me).await {
        Ok(_) => return Ok(true),
        Err(LeaseError::Conflict(_)) => {}
        Err(e) => return Err(e),
    }
    let Some(fresh) = store.get(&row.key).await? else {
        return Ok(false);
    };
    if fresh.owner != row.owner || fresh.pending_owner.is_some() {
        return Ok(false);
    }
    match store.request_handoff(&fresh, me).await {
        Ok(_) => Ok(true),
        Err(LeaseError::Conflict(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Runs lease writes, [`MAX_CONCURRENT_WRITES`] at a time; their outputs in the order
/// they finish.
async fn concurrently<T>(writes: Vec<BoxFuture<'static, T>>) -> Vec<T> {
    futures_util::stream::iter(writes)
        .buffer_unordered(MAX_CONCURRENT_WRITES)
        .collect()
        .await
}

/// The start a child takes from its parents when every parent with a row (listed in
/// `rows` or about to be created) still holds a start time nobody read from: the
/// earliest of those times. `None` when a parent holds anything else (it was read, or
/// starts at TRIM_HORIZON) or no parent has a row.
fn unread_start(parents: &[String], rows: &[Lease], to_create: &[Lease]) -> Option<Checkpoint> {
    let mut earliest: Option<SystemTime> = None;
    for parent in parents {
        match rows
            .iter()
            .chain(to_create)
            .find(|r| &r.key == parent)
            .map(|r| &r.checkpoint)
        {
            Some(Checkpoint::AtTimestamp(Some(t))) => {
                earliest = Some(earliest.map_or(*t, |e| e.min(*t)));
            }
            Some(_) => return None,
            None => {}
        }
    }
    earliest.map(|t| Checkpoint::AtTimestamp(Some(t)))
}

/// Whether `key` is one of `shards`.
fn listed(shards: &[ShardInfo], key: &str) -> bool {
    shards.iter().any(|s| s.shard_id == key)
}

/// The ids of `key`'s children (split from it, or merged from it and a neighbour) in a
/// ListShards answer.
fn children_of<'a>(shards: &'a [ShardInfo], key: &'a str) -> impl Iterator<Item = &'a str> {
    shards
        .iter()
        .filter(move |s| {
            s.parent_shard_id.as_deref() == Some(key)
                || s.adjacent_parent_shard_id.as_deref() == Some(key)
        })
        .map(|s| s.shard_id.as_str())
}

/// Every descendant of `shard` (children, their children, ...) in a map from parent to
/// children, each once.
fn descendants<'a>(
    children: &'a BTreeMap<&'a str, Vec<&'a str>>,
    shard: &'a str,
) -> impl Iterator<Item = &'a str> + 'a {
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let mut todo: Vec<&str> = vec![shard];
    std::iter::from_fn(move || {
        while let Some(next) = todo.pop() {
            for child in children.get(next).into_iter().flatten() {
                if seen.insert(child) {
                    todo.push(child);
                }
            }
            if next != shard {
                return Some(next);
            }
        }
        None
    })
}

/// Stores the checkpoint an operator asked for on a stopped shard's lease.
async fn apply_reset(lease: &HeldLease, key: &str) {
    match lease.apply_reset().await {
        Ok(row) => {
            tracing::info!(lease = %key, checkpoint = %row.checkpoint, "checkpoint reset applied")
        }
        Err(e) => {
            tracing::warn!(lease = %key, error = %e, "could not apply the checkpoint reset; the next owner will")
        }
    }
}

/// Settles one row a stopping worker found naming it (see
/// [`Coordinator::release_unheld`]): its request on another worker's row is withdrawn;
/// a row that is its own (owned from the start, or handed over before the withdrawal
/// landed) is released.
async fn settle_unheld(store: Arc<dyn LeaseStore>, me: String, row: Lease) {
    let row = if row.owner.as_deref() == Some(&me) {
        row
    } else {
        match with_retries(|| store.withdraw_handoff(&row, &me)).await {
            Ok(_) => return,
            // Handed over meanwhile, or the outcome is unknown: look again.
            Err(e) => match with_retries(|| store.get(&row.key)).await {
                Ok(Some(current)) if current.owner.as_deref() == Some(&me) => current,
                Ok(Some(current)) if current.pending_owner.as_deref() == Some(&me) => {
                    tracing::warn!(lease = %row.key, error = %e, "could not withdraw a hand-off request; if the owner hands the lease over, it will expire instead");
                    return;
                }
                _ => return,
            },
        }
    };
    let key = row.key.clone();
    tracing::info!(lease = %key, "releasing a lease handed to this worker that it never ran");
    // Released like a held lease: retried, and adopted if an answer was lost.
    release(&HeldLease::taken_at(row, store, &me, Instant::now()), &key).await;
}

/// Withdraws the hand-off request on a finished row (conditional on the request alone).
async fn withdraw_stale_request(store: &dyn LeaseStore, row: &Lease) {
    let Some(worker) = row.pending_owner.as_deref() else {
        return;
    };
    match store.withdraw_handoff(row, worker).await {
        Ok(_) => {
            tracing::debug!(lease = %row.key, %worker, "withdrew a hand-off request on a finished shard")
        }
        Err(e) => {
            tracing::debug!(lease = %row.key, error = %e, "could not withdraw a hand-off request on a finished shard")
        }
    }
}

async fn release(lease: &HeldLease, key: &str) {
    if let Err(e) = lease.release().await {
        tracing::warn!(lease = %key, error = %e, "release failed; the lease will expire instead");
    }
}

/// Ticks per renew interval of [`renew_loop`]: each tick renews only the leases due then,
/// so a worker holding many leases spreads their renewals over the interval (32 ticks:
/// a worker with 200 leases sends about 7 UpdateItems every 100 ms at the defaults,
/// instead of 200 in the same millisecond, which a DynamoDB partition would throttle).
const RENEWAL_TICKS: u32 = 32;

/// Renews every held lease on its own timer, independent of reading and handling, and
/// passes hand-off requests it finds on the rows to the coordinator. Each renewal runs
/// in its own task under the lease call deadline, so one slow or hung renewal never
/// delays the others; a lease whose previous renewal is still in flight is skipped for
/// that tick rather than renewed twice at once.
///
/// Renewals are paced: every lease is renewed once per renew interval, but at its own
/// phase. A lease first seen by the loop is due somewhere in the coming interval (the
/// leases seen together spread evenly over it: renewing early only adds margin), and
/// never later than one interval minus one tick after its take was sent; after
/// that it is due one interval minus one tick after its last renewal was sent, so with
/// the tick's rounding no lease waits longer between renewals than the renew interval,
/// exactly as without pacing.
async fn renew_loop(
    config: Arc<Config>,
    health: Arc<HealthState>,
    held: HeldSet,
    events: mpsc::UnboundedSender<Event>,
    shutdown: CancellationToken,
) {
    let step = (config.renew_interval / RENEWAL_TICKS).max(Duration::from_millis(1));
    let period = config.renew_interval.saturating_sub(step).max(step);
    let mut tick = tokio::time::interval_at(Instant::now() + step, step);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // Dropped (aborting what still runs) when the loop ends.
    let mut renewals: JoinSet<String> = JoinSet::new();
    let mut in_flight: BTreeSet<String> = BTreeSet::new();
    // When each held lease is due for its next renewal.
    let mut due: BTreeMap<String, Instant> = BTreeMap::new();
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            Some(done) = renewals.join_next() => {
                if let Ok(key) = done {
                    in_flight.remove(&key);
                }
                continue;
            }
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        let leases: Vec<(String, Arc<HeldLease>)> = {
            let held = lock(&held);
            due.retain(|key, _| held.contains_key(key));
            let new: Vec<(&String, &Arc<HeldLease>)> =
                held.iter().filter(|(k, _)| !due.contains_key(*k)).collect();
            let n = new.len() as f64;
            for (i, (key, lease)) in new.into_iter().enumerate() {
                let spread = now + period.mul_f64((i + 1) as f64 / n);
                due.insert(key.clone(), spread.min(lease.renewed_at() + period));
            }
            held.iter()
                .filter(|(k, _)| due.get(*k).is_some_and(|at| *at <= now))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        for (key, lease) in leases {
            if !in_flight.insert(key.clone()) {
                tracing::debug!(lease = %key, "the previous renewal is still in flight");
                continue;
            }
            due.insert(key.clone(), now + period);
            let events = events.clone();
            let me = config.owner.clone();
            let health = health.clone();
            let lease_duration = config.lease_duration;
            renewals.spawn(async move {
                match lease.renew().await {
                    Ok(row) => {
                        health.lease_table_ok();
                        if row.reset_to.is_some() {
                            let _ = events.send(Event::ResetRequested(key.clone()));
                        }
                        if let Some(to) = row.pending_owner.filter(|w| *w != me) {
                            let _ = events.send(Event::HandoffRequested(key.clone(), to));
                        }
                    }
                    Err(LeaseError::Conflict(_)) => {
                        tracing::info!(lease = %key, "lease lost at renewal")
                    }
                    // Not renewed for a lease duration: the others see it expired, and
                    // as long as this worker kept it, every plan dealt it back here and
                    // nobody read the shard. Given up, it is taken like any expired
                    // lease (maybe by this worker again, once its writes land).
                    Err(e) if !lease.is_fresh(lease_duration) => {
                        tracing::warn!(lease = %key, error = %e, "no renewal landed for a lease duration; giving the lease up");
                        lease.lost().cancel();
                    }
                    Err(e) => {
                        tracing::warn!(lease = %key, error = %e, "renewal failed; will retry")
                    }
                }
                key
            });
        }
    }
}

/// Sleeps until `at` (for ever when `None`: the `select!` branch is disabled then).
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Renews the leader item every renew interval while this worker holds it (see
/// [`crate::lease::leader`]), on its own timer like the leases. A renewal that finds
/// the item changed (another worker took it over) ends the leadership; so does a lease
/// duration without a renewal landing (the writes fail): by then the others may have
/// taken it over, and a worker that is not sure it leads stops covering for others.
async fn renew_leadership(
    config: Arc<Config>,
    state: Arc<dyn CoordinatorState>,
    leading: Leading,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(config.renew_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Some((held, renewed_at)) = lock_leading(&leading).clone() else {
            continue;
        };
        let sent = Instant::now();
        let renewed = state.renew(&held).await;
        let mut slot = lock_leading(&leading);
        // Resigned or lost meanwhile: nothing to record.
        if slot.as_ref().map(|(item, _)| item) != Some(&held) {
            continue;
        }
        match renewed {
            Ok(item) => *slot = Some((item, sent)),
            Err(LeaseError::Conflict(_)) => {
                tracing::info!("leadership lost: another worker took the leader item over");
                *slot = None;
            }
            Err(e) if sent.duration_since(renewed_at) >= config.lease_duration => {
                tracing::warn!(error = %e, "no renewal of the leader item landed for a lease duration; no longer leading");
                *slot = None;
            }
            Err(e) => tracing::warn!(error = %e, "renewing the leader item failed; will retry"),
        }
    }
}
