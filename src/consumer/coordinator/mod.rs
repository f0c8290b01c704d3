//! The worker's lease manager: discovers shards and creates their leases, takes its fair
//! share of leases (and steals towards it through graceful hand-offs), renews what it
//! holds on its own timer, starts a [`ShardTask`] per held lease and winds them down on
//! shutdown.
//!
//! This file is the round itself: the start-up, the loop of lease rounds and the events
//! of the shard tasks. Each job a round does has a room of its own, as the KCL has a
//! class per job; all of them are `impl Coordinator` blocks over the one state below:
//!
//! | room | job | the KCL's |
//! |---|---|---|
//! | `discovery` | list shards, create rows, check the table and the stream | `HierarchicalShardSyncer` |
//! | `taking` | take the fair share, ask for hand-offs, hand a leader's surplus on | `LeaseTaker` |
//! | `leadership` | hold, watch, renew and give up the leader item | `LeaderDecider` |
//! | `renewal` | renew held leases on their own timer | `LeaseRenewer` |
//! | `cleanup` | delete finished rows, settle and apply resets, report unreadable rows | `LeaseCleanupManager` |
//! | `tasks` | start a shard task per lease; stop them and release at shutdown | the `Scheduler`'s shard consumers |

use futures_util::{FutureExt, StreamExt};
use rand::SeedableRng;
use std::collections::{BTreeMap, BTreeSet};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::SystemTime;
use tracing::Instrument;

use futures_util::future::BoxFuture;
use rand::rngs::SmallRng;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::backoff::Backoff;
use crate::consumer::config::Config;
use crate::consumer::context::WorkerContext;
use crate::consumer::deadline::{BoundedKinesis, BoundedLeaseStore};
use crate::consumer::events::ShardEvent;
use crate::consumer::health::HealthState;
use crate::consumer::panics::panic_message;
use crate::consumer::shard::dispatch::Sink;
use crate::consumer::shard::ShardExit;
use crate::consumer::ConsumerError;
use crate::kinesis::{KinesisApi, ShardInfo, StreamIdentity};
use crate::lease::{worker_of, CoordinatorState, HeldLease, LeaderItem, LeaseError, LeaseStore};
use crate::metrics::{Labels, LeaseEvent};

mod cleanup;
mod discovery;
mod leadership;
mod renewal;
mod taking;
mod tasks;

use cleanup::{apply_reset, withdraw_stale_request};
use leadership::{renew_leadership, Leading};
use renewal::renew_loop;
use tasks::{release, Dispatchers};

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

/// How many lease writes (takes, creates) one worker has in flight at once.
const MAX_CONCURRENT_WRITES: usize = 32;

type HeldSet = Arc<Mutex<BTreeMap<String, Arc<HeldLease>>>>;

fn lock(held: &HeldSet) -> MutexGuard<'_, BTreeMap<String, Arc<HeldLease>>> {
    // Poisoning means a panic elsewhere while holding the lock; the map is still whole.
    held.lock().unwrap_or_else(|p| p.into_inner())
}

/// A worker's lease manager for one stream (see the module docs).
pub(crate) struct Coordinator {
    config: Arc<Config>,
    /// The worker's runtime parts (events, read-ahead budget, fan-out consumer).
    worker: WorkerContext,
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
    /// Why the group's leader cannot be known (the coordinator-state table refused a
    /// read or a take-over, or is gone), while it cannot: every worker then lists and
    /// takes for itself (see `lists_every_round`).
    leader_unknown: Option<String>,
    /// The leader item did not move between two of this worker's reads: it lists every
    /// round until it moves again or this worker takes it over (see `watch_leader`).
    leader_suspect: bool,
    /// When this worker last read the leader item.
    leader_read_at: Option<Instant>,
    /// A take of the leader item whose answer was lost and not yet settled by a read
    /// (see `settle_claim_at_stop`).
    claim_unsettled: bool,
    /// This worker became the leader since its last full listing: a round runs a lease
    /// duration after that listing (see `follow_up`).
    took_lead: bool,
    /// This worker took a lease since it started (see `round`: a worker refused its
    /// writes before that ends with the error).
    ever_held: bool,
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
    /// Since when every full lease round failed to list the table or to take what it
    /// meant to (see `round_failed`).
    rounds_failing_since: Option<Instant>,
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

impl Coordinator {
    pub(crate) fn new(
        config: Arc<Config>,
        worker: WorkerContext,
        kinesis: Arc<dyn KinesisApi>,
        store: Arc<dyn LeaseStore>,
        sink: Sink,
        health: Arc<HealthState>,
        multi_stream: bool,
    ) -> Self {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let started = config.wall_clock.now();
        // Every remote call the worker and its shards make has a deadline.
        let kinesis: Arc<dyn KinesisApi> = Arc::new(BoundedKinesis::new(
            kinesis,
            config.read_call_timeout,
            config.labels(),
        ));
        let store = BoundedLeaseStore::new(store, config.lease_call_timeout, config.labels());
        let coordination = store.coordinator_state();
        // Multi-stream: the worker's shared listing counts the Scans (streams.rs).
        let store: Arc<dyn LeaseStore> = Arc::new(if multi_stream {
            store.listing_counted_below()
        } else {
            store
        });
        Coordinator {
            labels: config.labels(),
            health,
            multi_stream,
            identity: None,
            raced: false,
            raced_rounds: 0,
            stream: config.stream.as_str().into(),
            rng: SmallRng::seed_from_u64(config.seed),
            config,
            worker,
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
            leader_unknown: None,
            leader_suspect: false,
            leader_read_at: None,
            claim_unsettled: false,
            took_lead: false,
            ever_held: false,
            follow_up: None,
            handed: BTreeSet::new(),
            moved_at: BTreeMap::new(),
            last_listing: None,
            covered: BTreeSet::new(),
            table_missing_since: None,
            rounds_failing_since: None,
            started,
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
                    biased;
                    _ = shutdown.cancelled() => return Ok(()),
                    attempt = self.start_up() => attempt,
                };
                match attempt {
                    Ok(()) => break,
                    Err(e) if e.is_transient() => {
                        let delay = backoff.next_delay();
                        tracing::warn!(error = %e, ?delay, "start-up call failed; retrying");
                        tokio::select! {
                            biased;
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
                    self.held.clone(),
                    renewing.clone(),
                ))
            });
            let mut take_tick = tokio::time::interval(self.config.take_interval);
            take_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            // A worker that does not lead reads the leader item at the leader's renewal
            // pace (see `watch_leader`); the first tick is the first round's.
            let mut leader_tick = tokio::time::interval_at(
                Instant::now() + self.config.renew_interval,
                self.config.renew_interval,
            );
            leader_tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let mut settle_from = Instant::now();
            let outcome = loop {
                // Right after the start (workers started together only see each other
                // once each took something), while hand-offs we asked for are under way
                // and while short of the fair share, look again after one renewal
                // interval (when the owners have seen the requests) rather than a whole
                // take interval: a fleet started together balances in a few seconds.
                // The second round comes sooner (a quarter of that): the first was a
                // race for free leases, and a worker that lost it everywhere makes
                // itself known with a request before the owners' first renewal.
                // Counted from the last pass that did more than read the leader item.
                let settle = tokio::time::sleep_until(
                    settle_from
                        + if self.rounds == 1 {
                            self.config.renew_interval / 4
                        } else {
                            self.config.renew_interval
                        },
                );
                let mut watched_only = false;
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
                    _ = leader_tick.tick(), if self.watches_leader() => {
                        if self.watch_leader().await {
                            self.round().await
                        } else {
                            watched_only = true;
                            Ok(())
                        }
                    }
                    _ = settle, if settling => self.round().await,
                    _ = sleep_until_some(self.follow_up), if self.follow_up.is_some() => {
                        self.follow_up = None;
                        self.round().await
                    }
                };
                if !watched_only {
                    settle_from = Instant::now();
                }
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
            // Leadership first, as soon as this worker stops taking work and before it
            // drains (a slow handler call may take up to the shutdown timeout): a
            // stopping worker covers for nobody, so the next worker to read the
            // released item leads and covers for any worker that crashes meanwhile,
            // and takes this worker's leases as they are released. A take of the item
            // whose answer was lost is settled first, so an item taken unheard is
            // released too.
            self.settle_claim_at_stop().await;
            self.resign().await;
            self.shutdown().await;
            renewing.cancel();
            renewer.abort();
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
        if let Some(fan_out) = &self.worker.fan_out {
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
                let events = &self.worker.events;
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
        // The leader item is read on its own timer; here only when that read is not
        // fresh (the first round, or a round run for an event).
        if self
            .leader_read_at
            .is_none_or(|t| t.elapsed() >= self.config.renew_interval / 2)
        {
            self.watch_leader().await;
        }
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
        if let Err(e) = &listed {
            self.round_failed(e);
            self.give_up_leading_if_blind(false).await;
        }
        let Some(rows) = self.table_answered(listed, "listing leases") else {
            return Ok(());
        };
        self.check_stream(&rows)?;
        let balanced = self.balance(rows).await;
        match &balanced {
            Ok(()) => {
                self.rounds_failing_since = None;
                self.health.lease_rounds_failing(None);
            }
            Err(e) => self.round_failed(e),
        }
        self.give_up_leading_if_blind(balanced.is_ok()).await;
        if let Err(e) = balanced {
            // Refused before this worker ever held a lease (a policy without
            // `UpdateItem` on the lease table): it cannot start, and like a
            // coordinator-state table refused at start-up it ends with the typed error
            // instead of retrying for ever.
            if matches!(e, LeaseError::AccessDenied(_)) && !self.ever_held {
                tracing::error!(error = %e, "the lease table refuses this worker's writes; stopping");
                return Err(ConsumerError::Lease(e));
            }
            tracing::warn!(error = %e, "lease round failed; will retry");
        }
        Ok(())
    }

    /// A full lease round failed to list the table or to take what it meant to (not a
    /// lost race). A worker whose rounds keep failing finds and takes no lease, so a
    /// shard nobody holds would stay unread in silence: it is not ready (see
    /// [`Health::lease_rounds_failing`](crate::Health::lease_rounds_failing)) at once when
    /// the table refuses the call for lack of permission (`Scan` or `UpdateItem` taken
    /// away while it runs), and after a lease duration of failed rounds otherwise (its
    /// writes throttled or timing out while its reads answer), until a round succeeds.
    fn round_failed(&mut self, error: &LeaseError) {
        let since = *self.rounds_failing_since.get_or_insert_with(Instant::now);
        let failing = matches!(error, LeaseError::AccessDenied(_))
            || since.elapsed() >= self.config.lease_duration;
        if failing && self.health.lease_rounds_failing(Some(error.to_string())) {
            tracing::warn!(%error, "this worker's lease rounds fail: it can take no lease; not ready until a round succeeds");
        }
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
}

/// Runs lease writes, [`MAX_CONCURRENT_WRITES`] at a time; their outputs in the order
/// they finish.
async fn concurrently<T>(writes: Vec<BoxFuture<'static, T>>) -> Vec<T> {
    futures_util::stream::iter(writes)
        .buffer_unordered(MAX_CONCURRENT_WRITES)
        .collect()
        .await
}

/// Sleeps until `at` (for ever when `None`: the `select!` branch is disabled then).
async fn sleep_until_some(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
