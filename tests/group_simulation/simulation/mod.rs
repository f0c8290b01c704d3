//! A generator of consumer-group histories on the memory backend under tokio's paused
//! clock, seeded and replayable, and the invariants checked after each one.
//!
//! A history: a stream of 1–3 shards resharded (splits, merges, 1 → 2 → 1) to several
//! generations with records written in every generation; an initial position
//! (TRIM_HORIZON, LATEST, AT_TIMESTAMP); workers in `run` or `stream()` mode joining,
//! leaving, killed, frozen past their lease and woken, stopped in the middle of handling
//! (a process freeze), restarted under the same id;
//! faults on both services (see [`backend`]); workers in multi-stream mode (the KCL's
//! multi-stream keys); handlers that hang on a record. Each part is a
//! [`history::Feature`]. With `table-stream` the workers read a DynamoDB table's change
//! stream on the embedded backend instead: item writes, frequent rollovers and
//! partition splits, the group suspended past the 15-minute iterator lifetime, and the
//! 24 h trim (see [`Sim::suspend_the_group`]).
//!
//! Beside the invariants checked at the end ([`invariants`]), one is watched while the
//! history runs: no shard stalls in silence (see [`watch_progress`]).

pub mod backend;
pub mod clock_skew;
pub mod history;
pub mod invariants;
pub mod log;

use std::collections::HashMap;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::{FutureExt, StreamExt};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use shardflow::kinesis::{KinesisApi, ShardInfo, StreamAdmin};
use shardflow::lease::{Checkpoint, LeaseStore};
use shardflow::memory::{KinesisFaults, LeaseFaults};
use shardflow::AckHandle;
use shardflow::{
    Backend, BalanceBy, CheckpointPolicy, Concurrency, Consumer, Health, InitialPosition, Memory,
    Message, Position, SequenceNumber, ShardEvent, ShutdownHandle,
};
use tokio::task::JoinHandle;

use backend::{Control, SimBackend};
use history::{Feature, Features};
use log::Log;

pub const STREAM: &str = "sim";
/// The table whose stream the group reads with feature `table-stream`.
pub const TABLE: &str = "sim-items";
/// How long the whole group is suspended (feature `table-stream`): past the
/// 15-minute lifetime of a table stream's iterators.
const SUSPENSION: Duration = Duration::from_secs(16 * 60);
/// How far the wall clock jumps when a day passes during a suspension: the stream's
/// retention.
const A_DAY: Duration = shardflow::memory::TABLE_STREAM_RETENTION;
pub const GROUP: &str = "sim-group";
pub const LEASE: Duration = Duration::from_secs(4);
/// Simulated time within which every required record must be handled.
const HANDLED_WITHIN: Duration = Duration::from_secs(900);
/// Simulated time within which a whole history (with shutdown) must end.
pub const HISTORY_BOUND: Duration = Duration::from_secs(1_800);
/// The workers' `stuck_after`: short, so that the progress invariant bites.
pub const STUCK_AFTER: Duration = Duration::from_secs(5);
/// The workers' take interval.
const TAKE_INTERVAL: Duration = Duration::from_secs(1);
/// The workers' shutdown timeout (how long a drain waits for a hung handler).
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the progress invariant looks (and the workers publish their health).
const LOOK_EVERY: Duration = Duration::from_millis(250);
/// The longest a shard with records waiting may go with its handled position still and
/// no worker saying so (see [`watch_progress`]): a lost owner's lease expires
/// (`2 × LEASE`: the last renewal may be a lease old when the owner stops), a worker takes
/// it at its next take round (`TAKE_INTERVAL`), a drain may wait for a hung handler
/// (`SHUTDOWN_TIMEOUT`), and a hung handler is reported after `STUCK_AFTER` plus a tick
/// of an eighth of it; plus a second for the looks and the reads themselves.
pub const STALL_BOUND: Duration = Duration::from_millis(
    (2 * LEASE.as_millis()
        + TAKE_INTERVAL.as_millis()
        + SHUTDOWN_TIMEOUT.as_millis()
        + STUCK_AFTER.as_millis() * 9 / 8
        + 1_000) as u64,
);
/// How long a handler that hangs for good hangs before its worker is killed: longer
/// than [`STALL_BOUND`], so that such a hang not reported fails the history.
const HUNG_FOR_GOOD: Duration = Duration::from_secs(25);

/// Counts over one history, summed over the seeds.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub records: usize,
    pub handled: usize,
    pub reshards: usize,
    pub generations: usize,
    pub merge_backs: usize,
    pub joins: usize,
    pub leaves: usize,
    pub kills: usize,
    pub freezes: usize,
    pub restarts_same_id: usize,
    pub stream_workers: usize,
    pub per_key_workers: usize,
    pub handoffs_before_first_checkpoint: usize,
    pub ambiguous_commits: usize,
    pub hung: u64,
    pub stale_lists: u64,
    pub missing_iterators: u64,
    pub ambiguous_puts: u64,
    pub nacks: u64,
    pub dropped_batches: u64,
    pub hung_handlers: u64,
    pub stuck_events: u64,
    pub batch_workers: usize,
    pub dead_lettered: u64,
    pub bisected_batches: u64,
    /// Takes written by the previous owner handing the lease over (planned hand-offs).
    pub planned_handoffs: usize,
    /// Shifts of the per-shard load (feature `skewed-load`).
    pub load_shifts: usize,
    /// Rollovers of a table's stream (every open shard closes, one child each).
    pub rollovers: usize,
    /// Partition splits of a table's stream.
    pub splits: usize,
    /// Shards of the stream over the history (the most in one history, in `add`).
    pub shards: usize,
    /// Shards over all histories.
    pub total_shards: usize,
    /// Suspensions of the whole group past the iterator lifetime.
    pub suspensions: usize,
    /// Outages of the handlers' downstream past the iterator lifetime.
    pub outages: usize,
    /// GetRecords refused because the iterator outlived the stream's lifetime.
    pub expired_iterators: u64,
    /// Trims (a day passed): histories whose older records went past retention.
    pub trims: usize,
    /// Records the trim removed before any handler finished them.
    pub trimmed_unread: usize,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        self.records += o.records;
        self.handled += o.handled;
        self.reshards += o.reshards;
        self.generations = self.generations.max(o.generations);
        self.merge_backs += o.merge_backs;
        self.joins += o.joins;
        self.leaves += o.leaves;
        self.kills += o.kills;
        self.freezes += o.freezes;
        self.restarts_same_id += o.restarts_same_id;
        self.stream_workers += o.stream_workers;
        self.per_key_workers += o.per_key_workers;
        self.handoffs_before_first_checkpoint += o.handoffs_before_first_checkpoint;
        self.ambiguous_commits += o.ambiguous_commits;
        self.hung += o.hung;
        self.stale_lists += o.stale_lists;
        self.missing_iterators += o.missing_iterators;
        self.ambiguous_puts += o.ambiguous_puts;
        self.nacks += o.nacks;
        self.dropped_batches += o.dropped_batches;
        self.hung_handlers += o.hung_handlers;
        self.stuck_events += o.stuck_events;
        self.batch_workers += o.batch_workers;
        self.dead_lettered += o.dead_lettered;
        self.bisected_batches += o.bisected_batches;
        self.planned_handoffs += o.planned_handoffs;
        self.load_shifts += o.load_shifts;
        self.rollovers += o.rollovers;
        self.splits += o.splits;
        self.shards = self.shards.max(o.shards);
        self.total_shards += o.shards;
        self.suspensions += o.suspensions;
        self.outages += o.outages;
        self.expired_iterators += o.expired_iterators;
        self.trims += o.trims;
        self.trimmed_unread += o.trimmed_unread;
    }
}

/// Where the group starts, as the invariants need it.
#[derive(Clone, Debug)]
pub enum Start {
    TrimHorizon,
    Latest,
    AtTimestamp(SystemTime),
}

struct Worker {
    name: String,
    incarnation: String,
    control: Arc<Control>,
    shutdown: ShutdownHandle,
    task: JoinHandle<Result<(), String>>,
    left: bool,
    stream_mode: bool,
    /// Its `Run` future was dropped (the task aborted) without a shutdown.
    dropped: bool,
    /// Its handler may hang for good (and the worker then be killed).
    hangs_for_good: bool,
}

/// What the progress invariant sees of a worker: whether it lives, and its health as
/// it last published it.
struct Probe {
    incarnation: String,
    control: Arc<Control>,
    health: Arc<Mutex<Option<Health>>>,
    /// Its consumer runs (its task neither returned nor was aborted).
    running: Arc<AtomicBool>,
}

impl Probe {
    /// The worker runs and can act: not killed, not frozen.
    fn acts(&self) -> bool {
        self.running.load(Ordering::SeqCst) && !self.control.is_dead() && !self.control.is_frozen()
    }
}

/// Clears a probe's `running` when the worker's task ends, whichever way.
struct Running(Arc<AtomicBool>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Worker {
    fn alive(&self) -> bool {
        !self.left && !self.control.is_dead() && !self.task.is_finished()
    }
    /// Its process surely ended (a dropped `Run` may still be running inside).
    fn gone(&self) -> bool {
        self.control.is_dead() || (self.task.is_finished() && !self.dropped)
    }
}

struct Sim {
    features: Features,
    memory: Memory,
    log: Arc<Log>,
    producer: SimBackend,
    rng: SmallRng,
    workers: Vec<Worker>,
    start: Start,
    checkpoint: CheckpointPolicy,
    next_value: usize,
    incarnations: u64,
    /// The children of the last split, for 1 → 2 → 1.
    last_split: Option<(String, String)>,
    /// Generation of each shard (the stream's first shards are generation 0).
    generation: std::collections::HashMap<String, usize>,
    stats: Stats,
    probes: Arc<Mutex<Vec<Probe>>>,
    /// The start, for the progress invariant once it is decided.
    decided_start: Arc<Mutex<Option<Start>>>,
    /// The workers' wall clocks (feature `clock-skew`).
    clock_skews: clock_skew::ClockSkews,
    /// The owner nonces of the incarnations, from a generator of their own: a replay
    /// gives every incarnation the owner name it had, and the other draws stay as they
    /// were.
    nonces: SmallRng,
    /// The per-shard load of feature `skewed-load`, if on.
    skew: Option<Arc<Mutex<Skew>>>,
    /// The task feeding the shards at their loads (feature `skewed-load`).
    feed: Option<JoinHandle<()>>,
    /// The items the history writes (feature `table-stream`).
    items: usize,
    /// The lease store's faults.
    lease_faults: LeaseFaults,
}

/// How often the feed of feature `skewed-load` writes a record into every open shard.
const FEED_EVERY: Duration = Duration::from_millis(500);

/// Feature `skewed-load`: each shard's weight (by its position among the open shards
/// in id order), drawn from a Zipf distribution (s = 1.2, 1 to 10) by a generator of its
/// own, so the other draws of a history stay as they were.
struct Skew {
    rng: SmallRng,
    weights: Vec<usize>,
}

impl Skew {
    fn weight(&mut self, i: usize) -> usize {
        let zipf = rand_distr::Zipf::new(10, 1.2).expect("valid Zipf parameters");
        while self.weights.len() <= i {
            let w = self.rng.sample(zipf) as usize;
            self.weights.push(w);
        }
        self.weights[i]
    }

    /// The hottest shard cools to the coldest's weight and the coldest heats to the
    /// hottest's; returns the two positions.
    fn shift(&mut self) -> Option<(usize, usize)> {
        let hot = (0..self.weights.len()).max_by_key(|i| (self.weights[*i], *i))?;
        let cold = (0..self.weights.len()).min_by_key(|i| (self.weights[*i], *i))?;
        self.weights.swap(hot, cold);
        Some((hot, cold))
    }
}

/// The messages of the panics the generator's handlers and hooks raise on purpose.
const INTENDED_PANICS: [&str; 2] = ["a handler that panics", "a hook that panics"];

/// Keeps the panics the generator raises on purpose (thousands over the seeds, each
/// caught by the consumer) out of the test's output; any other panic is printed as usual.
fn quiet_intended_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let message = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
            if !message.is_some_and(|m| INTENDED_PANICS.contains(&m)) {
                default(info);
            }
        }));
    });
}

/// Runs one history and checks the invariants; `Err` says which one failed and how.
pub async fn simulate(seed: u64, features: Features) -> Result<Stats, String> {
    simulate_traced(seed, features).await.0
}

/// [`simulate`], with the history's log: its trace (see [`Log::trace`]) is what a
/// replay of the seed must repeat.
pub async fn simulate_traced(seed: u64, features: Features) -> (Result<Stats, String>, Arc<Log>) {
    quiet_intended_panics();
    let mut sim = Sim::new(seed, features).await;
    let outcome = sim.play().await;
    (outcome, sim.log.clone())
}

impl Sim {
    /// Runs the history with the progress watch beside it, then checks the invariants.
    async fn play(&mut self) -> Result<Stats, String> {
        let sim = self;
        let done = Arc::new(AtomicBool::new(false));
        let watch = tokio::spawn(watch_progress(
            sim.memory.clone(),
            sim.log.clone(),
            sim.probes.clone(),
            sim.decided_start.clone(),
            done.clone(),
        ));
        // A table-stream history spends a suspension more.
        let bound = if sim.features.has(Feature::TableStream) {
            HISTORY_BOUND + SUSPENSION
        } else {
            HISTORY_BOUND
        };
        let outcome = tokio::time::timeout(bound, sim.run()).await;
        done.store(true, Ordering::SeqCst);
        let stalled = watch
            .await
            .map_err(|e| format!("the progress watch panicked: {e}"))?;
        let history = sim.log.history.lock().unwrap().join("\n  ");
        match outcome {
            Err(_) => Err(format!(
                "history did not end within {bound:?} of simulated time (a hang)\n  {history}"
            )),
            Ok(Err(e)) => Err(format!("{e}\n  {history}")),
            Ok(Ok(())) => {
                stalled.map_err(|e| format!("{e}\n  {history}"))?;
                invariants::check(&sim.memory, &sim.log, &sim.start)
                    .map_err(|e| format!("{e}\n  {history}"))?;
                if sim.features.has(Feature::TableStream) {
                    invariants::check_table_stream(&sim.memory, &sim.log, &sim.start)
                        .map_err(|e| format!("{e}\n  {history}"))?;
                }
                if sim.features.has(Feature::SkewedLoad) {
                    invariants::check_planned_moves(&sim.log)
                        .map_err(|e| format!("{e}\n  {history}"))?;
                }
                Ok(sim.finish_stats())
            }
        }
    }
}

impl Sim {
    async fn new(seed: u64, features: Features) -> Sim {
        let features = features.effective();
        let log = Arc::new(Log::default());
        log.start();
        // The service's time of day is the simulated one (see `Log::wall_time`).
        let memory = {
            let log = log.clone();
            Memory::builder()
                .wall_clock(move || log.wall_time())
                .build()
        };
        let mut rng = SmallRng::seed_from_u64(seed);
        memory.streams().set_faults(KinesisFaults {
            throttle: 0.05,
            expire_iterator: 0.02,
            error: 0.02,
            put_entry_failure: 0.02,
            // Injected by the wrapper instead, which tells open shards from closed ones.
            missing_next_iterator: 0.0,
            seed,
        });
        let lease_faults = LeaseFaults {
            fail_before_write: 0.03,
            fail_after_write: if features.has(Feature::AmbiguousLease) {
                0.03
            } else {
                0.0
            },
            throttle: 0.02,
            latency: Duration::from_millis(rng.gen_range(1..20)),
            seed: seed ^ 0x5eed,
        };
        memory.table(GROUP).set_faults(lease_faults.clone());
        let producer = SimBackend::new(
            memory.clone(),
            GROUP,
            "producer",
            "producer",
            Control::new(),
            log.clone(),
            features,
            seed ^ 0x9e37,
        );
        let checkpoint = match rng.gen_range(0..3) {
            0 => CheckpointPolicy::EveryBatch,
            1 => CheckpointPolicy::Interval(Duration::from_millis(200)),
            _ => CheckpointPolicy::Interval(Duration::from_secs(3)),
        };
        Sim {
            features,
            memory,
            log,
            producer,
            rng,
            workers: Vec::new(),
            start: Start::TrimHorizon,
            checkpoint,
            next_value: 0,
            incarnations: 0,
            clock_skews: clock_skew::ClockSkews::new(seed),
            nonces: SmallRng::seed_from_u64(seed ^ 0x0_0ce5),
            skew: features.has(Feature::SkewedLoad).then(|| {
                Arc::new(Mutex::new(Skew {
                    rng: SmallRng::seed_from_u64(seed ^ 0x5_4e3d),
                    weights: Vec::new(),
                }))
            }),
            feed: None,
            items: 0,
            lease_faults,
            last_split: None,
            generation: Default::default(),
            stats: Stats::default(),
            probes: Arc::default(),
            decided_start: Arc::default(),
        }
    }

    fn note(&self, line: String) {
        self.log.note(line);
    }

    async fn produce(&mut self, n: usize) {
        if self.features.has(Feature::TableStream) {
            return self.write_items(n);
        }
        let range = self.next_value..self.next_value + n;
        self.next_value += n;
        self.note(format!("produce {n}"));
        testkit::produce(self.producer.kinesis().as_ref(), STREAM, range).await;
    }

    /// Feature `table-stream`: a third of `n` writes to the table's items (the histories
    /// have many more shards: fewer records keep them as cheap), each a put of the item's
    /// next version, an update or a delete (nothing is written to the stream when a
    /// delete finds no item). Half the time only one to three hot items are written, so
    /// the other partitions' shards stay open and empty.
    fn write_items(&mut self, n: usize) {
        let n = n / 3;
        let table = self
            .memory
            .tables()
            .table(TABLE)
            .expect("the history created the table");
        let hot: Vec<usize> = if self.rng.gen_bool(0.5) {
            let k = self.rng.gen_range(1..=3);
            (0..k).map(|_| self.rng.gen_range(0..self.items)).collect()
        } else {
            (0..self.items).collect()
        };
        let mut changes = 0;
        for _ in 0..n {
            let id = format!("k{}", hot[self.rng.gen_range(0..hot.len())]);
            self.next_value += 1;
            let version = self.next_value;
            let written = match self.rng.gen_range(0..10) {
                0 => table.delete(&serde_json::json!({ "id": id })),
                1 | 2 => table.update(
                    &serde_json::json!({ "id": id }),
                    &serde_json::json!({ "v": version, "by": "update" }),
                ),
                _ => table.put(&serde_json::json!({ "id": id, "v": version })),
            };
            changes += usize::from(written.expect("a valid item write").is_some());
        }
        self.note(format!("write {n} items ({changes} changes)"));
    }

    /// Feature `table-stream`: the table's stream rolls over (every open shard closes
    /// and one child opens in its place), or a partition splits (its shard closes into
    /// two children), up to four partitions.
    fn roll_over(&mut self) {
        let table = self
            .memory
            .tables()
            .table(TABLE)
            .expect("the history created the table");
        let open = table.open_shards();
        if open.len() < 4 && self.rng.gen_bool(0.25) {
            let shard = open[self.rng.gen_range(0..open.len())].clone();
            let children = table.split(&shard).expect("an open shard splits");
            self.note(format!("split partition {shard} into {children:?}"));
            self.stats.splits += 1;
        } else {
            let children = table.rollover().expect("the stream rolls over");
            self.note(format!("rollover {open:?} into {children:?}"));
            self.stats.rollovers += 1;
        }
    }

    /// Feature `table-stream`: a day passes (the simulated wall clock jumps 24 hours
    /// ahead): every record written so far is past the stream's retention. Those no
    /// handler finished are noted as trimmed unread (see [`log::Trim`]).
    async fn pass_a_day(&mut self) {
        // Arrivals are on the wall clock in milliseconds: a second later, every
        // record so far arrived before the cutoff.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let cutoff = self.log.wall_time();
        let handled: std::collections::HashSet<(String, SequenceNumber)> = self
            .log
            .handled
            .lock()
            .unwrap()
            .iter()
            .map(|e| (e.shard.clone(), e.sequence.clone()))
            .collect();
        let records = invariants::written(&self.memory, &self.log);
        let unread = records
            .iter()
            .filter(|(_, _, arrival)| arrival.is_some_and(|a| a < cutoff))
            .map(|(shard, sequence, _)| (shard.clone(), sequence.clone()))
            .filter(|r| !handled.contains(r))
            .collect::<std::collections::HashSet<_>>();
        self.stats.trims += 1;
        self.stats.trimmed_unread += unread.len();
        self.note(format!(
            "a day passes: {} records trimmed, {} of them never handled",
            records.len(),
            unread.len()
        ));
        *self.log.trim.lock().unwrap() = Some(log::Trim {
            cutoff,
            at: self.log.tick(),
            records,
            unread,
        });
        self.log.jump_wall_clock(A_DAY);
    }

    /// Feature `table-stream`: the whole group is suspended (a host paused, a region's
    /// network down) for [`SUSPENSION`], past the 15-minute lifetime of the iterators it
    /// holds; or, with `outage`, only the handlers' downstream is down that long: the
    /// workers keep their leases and the iterators their readers hold for the next
    /// page expire meanwhile. Items are written and the stream rolls over meanwhile.
    /// With `day`, a day passes during it ([`Sim::pass_a_day`]): every record written
    /// before is past the 24 h retention (those no handler finished are the only ones
    /// the history may leave unhandled, see [`log::Trim`]), and the next rollover drops
    /// the shards that closed before.
    async fn suspend_the_group(&mut self, day: bool, outage: bool) {
        // Records arrive, and the group stops before it reads them all (suspended); or
        // the downstream goes down, and a burst arrives that the readers read ahead until
        // their shards' prefetch is full: they then hold the next page's iterator
        // until the handlers take records again.
        if !outage {
            let n = self.rng.gen_range(20..100);
            self.produce(n).await;
        }
        let suspended: Vec<Arc<Control>> = self
            .workers
            .iter()
            .filter(|w| !w.control.is_dead())
            .map(|w| w.control.clone())
            .collect();
        for c in &suspended {
            if outage {
                c.set_outage(true);
            } else {
                c.suspend(true);
            }
        }
        self.log.outage.store(outage, Ordering::SeqCst);
        if outage {
            // Without lease writes that land unseen meanwhile: over the outage's 700-odd
            // renewals one would almost surely cost a lease (its owner then takes it
            // again, with a fresh iterator), and the held iterators are under test.
            self.memory.table(GROUP).set_faults(LeaseFaults {
                fail_after_write: 0.0,
                seed: self.lease_faults.seed ^ 0x0_7a9e,
                ..self.lease_faults.clone()
            });
            // 150 to 450 item writes (`produce` writes a third of its count).
            let n = self.rng.gen_range(450..1350);
            self.produce(n).await;
        }
        self.note(format!(
            "{} for {SUSPENSION:?}{}",
            if outage {
                "the handlers' downstream is down"
            } else {
                "the group is suspended"
            },
            if day { ", and a day passes" } else { "" }
        ));
        if outage {
            self.stats.outages += 1;
        } else {
            self.stats.suspensions += 1;
        }
        // A day passes at once while the group is suspended; while only the downstream
        // is down, after the readers filled their prefetch (so that they hold iterators
        // past their lifetime, and the trim then removes records they did not read).
        if day && !outage {
            self.pass_a_day().await;
        }
        let resume_at = tokio::time::Instant::now() + SUSPENSION;
        for _ in 0..self.rng.gen_range(1..=3) {
            let pause = Duration::from_secs(self.rng.gen_range(10..240));
            tokio::time::sleep(pause).await;
            if day && outage && self.log.trim.lock().unwrap().is_none() {
                self.pass_a_day().await;
            }
            self.roll_over();
            self.record_generations().await;
            let n = self.rng.gen_range(0..60);
            self.produce(n).await;
        }
        tokio::time::sleep_until(resume_at).await;
        for c in &suspended {
            c.suspend(false);
            c.set_outage(false);
        }
        self.log.outage.store(false, Ordering::SeqCst);
        if outage {
            self.memory.table(GROUP).set_faults(LeaseFaults {
                seed: self.lease_faults.seed ^ 0x0_7e5d,
                ..self.lease_faults.clone()
            });
        }
        self.note("the group resumes".into());
    }

    /// Feature `skewed-load`: while the history runs, a record into each open shard
    /// every [`FEED_EVERY`], its size following the shard's weight (200 bytes per unit),
    /// so the shards' throughputs differ as their weights do and hand-offs happen while
    /// records flow. Stopped by [`Sim::stop_feed`].
    fn start_feed(&mut self) {
        let Some(skew) = self.skew.clone() else {
            return;
        };
        let (memory, kinesis) = (self.memory.clone(), self.producer.kinesis());
        self.feed = Some(tokio::spawn(async move {
            loop {
                tokio::time::sleep(FEED_EVERY).await;
                // The memory backend answers ListShards without faults and without awaiting.
                let mut open: Vec<ShardInfo> = memory
                    .streams()
                    .list_shards(STREAM)
                    .now_or_never()
                    .and_then(Result::ok)
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|s| !s.is_closed())
                    .collect();
                open.sort_by(|a, b| a.shard_id.cmp(&b.shard_id));
                let records: Vec<shardflow::kinesis::PutRecord> = open
                    .iter()
                    .enumerate()
                    .map(|(i, shard)| {
                        let weight = skew.lock().unwrap().weight(i);
                        shardflow::kinesis::PutRecord {
                            data: bytes::Bytes::from(vec![b'l'; 200 * weight]),
                            partition_key: format!("load-{i}"),
                            explicit_hash_key: Some(shard.starting_hash_key.to_string()),
                        }
                    })
                    .collect();
                testkit::put_all(kinesis.as_ref(), STREAM, records).await;
            }
        }));
    }

    /// Stops the feed of [`Sim::start_feed`].
    fn stop_feed(&mut self) {
        if let Some(feed) = self.feed.take() {
            feed.abort();
        }
    }

    async fn open_shards(&self) -> Vec<ShardInfo> {
        let mut open: Vec<ShardInfo> = self
            .memory
            .streams()
            .list_shards(self.log.stream())
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|s| !s.is_closed())
            .collect();
        open.sort_by_key(|s| s.starting_hash_key);
        open
    }

    async fn record_generations(&mut self) {
        let all = self
            .memory
            .streams()
            .list_shards(self.log.stream())
            .await
            .unwrap_or_default();
        {
            let mut parents = self.log.parents.lock().unwrap();
            for s in &all {
                parents
                    .entry(s.shard_id.clone())
                    .or_insert_with(|| s.parents());
            }
        }
        for s in all {
            if self.generation.contains_key(&s.shard_id) {
                continue;
            }
            let g = s
                .parents()
                .iter()
                .filter_map(|p| self.generation.get(p))
                .max()
                .map_or(0, |g| g + 1);
            self.stats.generations = self.stats.generations.max(g);
            self.generation.insert(s.shard_id, g);
        }
    }

    /// One reshard: a merge back of the last split's children, a merge of two adjacent
    /// open shards, or a split (preferring the newest shards, to grow generations).
    async fn reshard(&mut self) {
        if self.features.has(Feature::TableStream) {
            self.roll_over();
            return;
        }
        let open = self.open_shards().await;
        let kinesis = self.memory.streams().clone();
        if self.features.has(Feature::MergeBack) {
            if let Some((a, b)) = self.last_split.take() {
                if open.iter().any(|s| s.shard_id == a) && open.iter().any(|s| s.shard_id == b) {
                    kinesis.merge_shards(STREAM, &a, &b).await.unwrap();
                    self.note(format!("merge back {a} + {b}"));
                    self.stats.merge_backs += 1;
                    self.stats.reshards += 1;
                    return;
                }
            }
        }
        // Without deep resharding only the first shards are resharded (2 generations).
        let open: Vec<ShardInfo> = if self.features.has(Feature::DeepReshard) {
            open
        } else {
            open.into_iter()
                .filter(|s| self.generation.get(&s.shard_id) == Some(&0))
                .collect()
        };
        if open.is_empty() {
            return;
        }
        let pairs: Vec<usize> = (0..open.len() - 1)
            .filter(|i| {
                open[*i].ending_hash_key.checked_add(1) == Some(open[i + 1].starting_hash_key)
            })
            .collect();
        let merge = !pairs.is_empty() && (open.len() >= 4 || self.rng.gen_bool(0.3));
        if merge {
            let i = pairs[self.rng.gen_range(0..pairs.len())];
            let (a, b) = (&open[i].shard_id, &open[i + 1].shard_id);
            kinesis.merge_shards(STREAM, a, b).await.unwrap();
            self.note(format!("merge {a} + {b}"));
        } else {
            let newest = open
                .iter()
                .max_by_key(|s| self.generation.get(&s.shard_id).copied().unwrap_or(0))
                .cloned();
            let s = match newest {
                Some(s) if self.rng.gen_bool(0.7) => s,
                _ => open[self.rng.gen_range(0..open.len())].clone(),
            };
            let at = s.starting_hash_key + (s.ending_hash_key - s.starting_hash_key) / 2;
            kinesis.split_shard(STREAM, &s.shard_id, at).await.unwrap();
            let after = self.open_shards().await;
            let children: Vec<String> = after
                .iter()
                .filter(|c| c.parent_shard_id.as_deref() == Some(s.shard_id.as_str()))
                .map(|c| c.shard_id.clone())
                .collect();
            if let [a, b] = children.as_slice() {
                self.last_split = Some((a.clone(), b.clone()));
            }
            self.note(format!("split {} into {children:?}", s.shard_id));
        }
        self.stats.reshards += 1;
    }

    fn consumer(
        &mut self,
        backend: SimBackend,
        concurrency: Concurrency,
        incarnation: &str,
    ) -> Consumer {
        let position = match &self.start {
            Start::TrimHorizon => InitialPosition::TrimHorizon,
            Start::Latest => InitialPosition::Latest,
            Start::AtTimestamp(t) => InitialPosition::AtTimestamp(*t),
        };
        let builder = if self.features.has(Feature::TableStream) {
            // DynamoDB Streams readers poll about once a second.
            Consumer::builder()
                .table_stream(TABLE)
                .idle_read_interval(Duration::from_secs(1))
        } else if self.features.has(Feature::MultiStreamKeys) {
            Consumer::builder().streams([STREAM])
        } else {
            Consumer::builder().stream(STREAM)
        };
        // Every worker reads the simulated wall clock, shifted by its skew if any.
        let host = {
            let log = self.log.clone();
            move || log.wall_time()
        };
        let builder = if self.features.has(Feature::ClockSkew) {
            let (skew, clock) = self.clock_skews.next_clock(host);
            self.note(format!("{incarnation}'s wall clock is {skew} ms off"));
            builder.wall_clock(clock)
        } else {
            builder.wall_clock(host)
        };
        const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
        let nonce: String = (0..6)
            .map(|_| char::from(DIGITS[self.nonces.gen_range(0..DIGITS.len())]))
            .collect();
        let builder = builder.owner_nonce(nonce);
        // Decided without the generator's random numbers: the histories stay the same.
        let builder = if self.features.has(Feature::HookPanics) && self.incarnations % 2 == 1 {
            builder.on_event(|_| panic!("{}", INTENDED_PANICS[1]))
        } else {
            builder
        };
        let builder = builder
            .group(GROUP)
            .worker_id(backend.worker.clone())
            .backend(backend)
            .initial_position(position)
            .lease_duration(LEASE)
            .take_interval(TAKE_INTERVAL)
            .shard_sync_interval(Duration::from_secs(2))
            .max_records_per_read(self.rng.gen_range(5..60))
            .retry_backoff(Duration::from_millis(50), Duration::from_secs(1))
            .checkpoint(self.checkpoint.clone())
            .shutdown_timeout(SHUTDOWN_TIMEOUT)
            .stuck_after(STUCK_AFTER)
            .on_event(stuck_hook(self.log.clone(), incarnation.to_owned()))
            .seed(self.rng.gen())
            .concurrency(concurrency);
        let builder = if self.features.has(Feature::TableStream) {
            builder
        } else {
            builder.idle_read_interval(Duration::from_millis(100))
        };
        // With process freezes, lease calls get the longest deadline the configuration
        // allows (just under the renewal margin): a frozen worker's renewals, waiting at
        // its gate, are cut later, so it notices a lost lease later than another worker
        // takes it over, as a really frozen process (whose timers stop too) would.
        let builder = if self.features.has(Feature::SkewedLoad) {
            builder.balance_by(BalanceBy::Throughput)
        } else {
            builder
        };
        let builder = if self.features.has(Feature::ProcessFreeze) {
            builder.lease_call_timeout(LEASE * 2 / 3 - Duration::from_millis(100))
        } else {
            builder
        };
        builder.build().unwrap()
    }

    /// Starts a worker called `name` (a new incarnation), in run or stream mode.
    fn join(&mut self, name: String, stream_mode: bool) {
        self.incarnations += 1;
        let incarnation = format!("{name}#{}", self.incarnations);
        let control = Control::new();
        let backend = SimBackend::new(
            self.memory.clone(),
            GROUP,
            &name,
            &incarnation,
            control.clone(),
            self.log.clone(),
            self.features,
            self.rng.gen(),
        );
        // Drawn only with the feature on, so the other histories stay as they were.
        let concurrency = if !stream_mode
            && self.features.has(Feature::PerKeyConcurrency)
            && self.rng.gen_bool(0.5)
        {
            Concurrency::PerKey(self.rng.gen_range(2..16))
        } else {
            Concurrency::Sequential
        };
        // Drawn only with the feature on, so the other histories stay as they were. The
        // final worker, there so that every record gets handled, never hangs.
        let hang = if !stream_mode
            && name != "w-final"
            && self.features.has(Feature::HungHandler)
            && self.rng.gen_bool(0.3)
        {
            let record = self.rng.gen_range(1..150);
            let for_good = self.rng.gen_bool(0.3);
            let millis = STUCK_AFTER.as_millis() as u64;
            let pause = Duration::from_millis(self.rng.gen_range(millis / 2..millis * 6));
            Some((record, (!for_good).then_some(pause)))
        } else {
            None
        };
        // Drawn only with the feature on, so the other histories stay as they were.
        let pace = (!stream_mode && self.features.has(Feature::ProcessFreeze))
            .then(|| Duration::from_millis(self.rng.gen_range(1..5)));
        let consumer = self.consumer(backend, concurrency, &incarnation);
        self.log
            .owners
            .lock()
            .unwrap()
            .insert(consumer.config().owner().to_owned(), incarnation.clone());
        let shutdown = consumer.shutdown_handle();
        let log = self.log.clone();
        let health: Arc<Mutex<Option<Health>>> = Arc::default();
        let running = Arc::new(AtomicBool::new(true));
        self.probes.lock().unwrap().push(Probe {
            incarnation: incarnation.clone(),
            control: control.clone(),
            health: health.clone(),
            running: running.clone(),
        });
        let running = Running(running);
        let batch_workers_before = self.stats.batch_workers;
        let task = if stream_mode {
            self.stats.stream_workers += 1;
            let rng = SmallRng::seed_from_u64(self.rng.gen());
            let worker = stream_worker(
                consumer,
                incarnation.clone(),
                control.clone(),
                log,
                rng,
                self.features,
                health,
            );
            tokio::spawn(async move {
                let _running = running;
                worker.await
            })
        } else {
            let concurrent = concurrency != Concurrency::Sequential;
            self.stats.per_key_workers += usize::from(concurrent);
            let panics = self.features.has(Feature::HandlerPanics);
            let service = handler(
                log.clone(),
                incarnation.clone(),
                control.clone(),
                concurrent,
                hang,
                panics,
                pace,
            );
            // Drawn only with the feature on, so the other histories stay as they were.
            let batches = self.features.has(Feature::PoisonBatches) && self.rng.gen_bool(0.5);
            self.stats.batch_workers += usize::from(batches);
            let run = if batches {
                consumer.run_batches(batch_handler(
                    log.clone(),
                    incarnation.clone(),
                    control.clone(),
                ))
            } else {
                consumer.run(service)
            };
            let mut run = run.into_future();
            tokio::spawn(async move {
                let _running = running;
                loop {
                    *health.lock().unwrap() = Some(run.health());
                    // Biased, as every select on the simulated path: a replay takes
                    // the same branch.
                    tokio::select! {
                        biased;
                        result = &mut run => return result.map_err(|e| e.to_string()),
                        _ = tokio::time::sleep(LOOK_EVERY) => {}
                    }
                }
            })
        };
        self.note(format!(
            "join {incarnation} ({})",
            if stream_mode {
                "stream"
            } else if self.stats.batch_workers > batch_workers_before {
                "run_batches"
            } else {
                "run"
            }
        ));
        self.stats.joins += 1;
        self.workers.push(Worker {
            name,
            incarnation,
            control,
            shutdown,
            task,
            left: false,
            stream_mode,
            dropped: false,
            hangs_for_good: matches!(hang, Some((_, None))),
        });
    }

    fn alive(&self) -> Vec<usize> {
        (0..self.workers.len())
            .filter(|i| self.workers[*i].alive() && !self.workers[*i].control.is_frozen())
            .collect()
    }

    async fn run(&mut self) -> Result<(), String> {
        let kinesis = self.memory.streams().clone();
        let shards = if self.features.has(Feature::MergeBack) {
            1
        } else {
            self.rng.gen_range(1..=3)
        };
        if self.features.has(Feature::TableStream) {
            let table = self
                .memory
                .tables()
                .create(TABLE, "id")
                .partitions(shards as usize)
                .build()
                .map_err(|e| e.to_string())?;
            self.log.set_stream(table.stream_arn());
            self.items = self.rng.gen_range(8..40);
        } else {
            kinesis
                .create_stream(STREAM, shards)
                .await
                .map_err(|e| e.to_string())?;
        }
        self.record_generations().await;
        let mut positions = vec![0];
        if self.features.has(Feature::Latest) {
            positions.push(1);
        }
        if self.features.has(Feature::AtTimestamp) {
            positions.push(2);
        }
        let position = positions[self.rng.gen_range(0..positions.len())];
        let n = self.rng.gen_range(50..200);
        self.produce(n).await;
        match position {
            1 => self.start = Start::Latest,
            2 => {
                // The timestamp falls before a reshard, so a shard closed before the
                // group first syncs still holds records at or after it.
                tokio::time::sleep(Duration::from_millis(10)).await;
                self.start = Start::AtTimestamp(self.log.wall_time());
                let n = self.rng.gen_range(20..100);
                self.produce(n).await;
                if self.features.has(Feature::Reshard) {
                    self.reshard().await;
                    self.record_generations().await;
                }
                let n = self.rng.gen_range(20..100);
                self.produce(n).await;
            }
            _ => {}
        }
        self.note(format!(
            "start {:?}, checkpoint {:?}, {shards} shards",
            self.start, self.checkpoint
        ));
        *self.decided_start.lock().unwrap() = Some(self.start.clone());

        self.start_feed();
        let latest = matches!(self.start, Start::Latest);
        let first = if latest { 2 } else { self.rng.gen_range(1..=2) };
        for w in 0..first {
            let stream_mode = self.features.has(Feature::StreamMode) && self.rng.gen_bool(0.3);
            self.join(format!("w{w}"), stream_mode);
        }

        // The events: at least 3 reshards when resharding is on, then a random mix.
        let mut events: Vec<u8> = Vec::new();
        if self.features.has(Feature::Reshard) || self.features.has(Feature::MergeBack) {
            let n = self.rng.gen_range(3..=5);
            events.extend(std::iter::repeat_n(0, n));
        }
        if self.features.has(Feature::TableStream) {
            // Rollovers and splits, and the group suspended once (with a day passing
            // in about half the histories).
            let n = self.rng.gen_range(4..=7);
            events.extend(std::iter::repeat_n(0, n));
            events.push(14);
        }
        // A table-stream history spends its time in rollovers and the suspension: fewer
        // other events keep it about as cheap as the others.
        let others = if self.features.has(Feature::TableStream) {
            self.rng.gen_range(4..=8)
        } else {
            self.rng.gen_range(6..=12)
        };
        for _ in 0..others {
            events.push(self.rng.gen_range(1..=6));
        }
        if self.features.has(Feature::Kill) || self.features.has(Feature::Freeze) {
            events.push(7);
        }
        if self.features.has(Feature::DropRun) && self.rng.gen_bool(0.5) {
            events.push(8);
        }
        if self.features.has(Feature::CorrelatedCrashes) {
            events.push(9);
        }
        if self.features.has(Feature::UnreadableRows) && self.rng.gen_bool(0.5) {
            events.push(10);
        }
        if self.features.has(Feature::ResetAtShardEnd) && self.rng.gen_bool(0.5) {
            events.push(11);
        }
        if self.features.has(Feature::ProcessFreeze) {
            let n = self.rng.gen_range(1..=2);
            events.extend(std::iter::repeat_n(12, n));
        }
        if self.features.has(Feature::SkewedLoad) {
            let n = self.rng.gen_range(1..=2);
            events.extend(std::iter::repeat_n(13, n));
        }
        for i in (1..events.len()).rev() {
            let j = self.rng.gen_range(0..=i);
            events.swap(i, j);
        }
        // Under LATEST, often lose an owner before its first checkpoint.
        if latest && events.contains(&7) && self.rng.gen_bool(0.5) {
            events.retain(|e| *e != 7);
            events.insert(0, 7);
        }
        for event in events {
            let pause = Duration::from_millis(self.rng.gen_range(100..3_000));
            tokio::time::sleep(pause).await;
            self.step(event).await;
        }

        // The end: everything is woken, one plain worker is surely there, and every
        // required record is handled within a bound.
        self.stop_feed();
        for w in &self.workers {
            if w.control.is_frozen() {
                w.control.freeze(false);
            }
        }
        let runners = self
            .workers
            .iter()
            .filter(|w| w.alive() && !w.stream_mode && !w.hangs_for_good)
            .count();
        if runners == 0 || self.alive().is_empty() {
            self.join("w-final".into(), false);
        }
        let n = self.rng.gen_range(20..100);
        self.produce(n).await;
        self.record_generations().await;
        self.note("wait until every required record is handled".into());
        let mut waited = Duration::ZERO;
        loop {
            let missing = invariants::missing(&self.memory, &self.log, &self.start);
            if missing.is_empty() {
                break;
            }
            if waited >= HANDLED_WITHIN {
                invariants::check(&self.memory, &self.log, &self.start)?;
                return Err(format!(
                    "lost: {} required records not handled within {HANDLED_WITHIN:?}, e.g. {:?}",
                    missing.len(),
                    &missing[..missing.len().min(5)]
                ));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            waited += Duration::from_millis(500);
        }
        for w in &self.workers {
            if w.alive() {
                w.shutdown.shutdown();
            }
        }
        for w in std::mem::take(&mut self.workers) {
            if w.control.is_dead() || w.dropped {
                w.task.abort();
                continue;
            }
            match tokio::time::timeout(Duration::from_secs(120), w.task).await {
                Err(_) => {
                    return Err(format!(
                        "{} did not stop within 120 s of its shutdown",
                        w.incarnation
                    ))
                }
                Ok(Err(e)) => return Err(format!("{} panicked: {e}", w.incarnation)),
                Ok(Ok(Err(e))) => self.note(format!("{} ended with an error: {e}", w.incarnation)),
                Ok(Ok(Ok(()))) => {}
            }
        }
        Ok(())
    }

    async fn step(&mut self, event: u8) {
        match event {
            0 => {
                if self.features.has(Feature::Reshard)
                    || self.features.has(Feature::MergeBack)
                    || self.features.has(Feature::TableStream)
                {
                    self.reshard().await;
                    self.record_generations().await;
                    let n = self.rng.gen_range(20..150);
                    self.produce(n).await;
                }
            }
            1 => {
                let n = self.rng.gen_range(20..200);
                self.produce(n).await;
            }
            2 => {
                if self.workers.iter().filter(|w| w.alive()).count() >= 4 {
                    return;
                }
                let stream_mode = self.features.has(Feature::StreamMode) && self.rng.gen_bool(0.3);
                let reuse: Vec<String> = self
                    .workers
                    .iter()
                    .filter(|w| {
                        (self.features.has(Feature::RestartSameId)
                            && w.gone()
                            && !self.workers.iter().any(|o| o.name == w.name && !o.gone()))
                            || (self.features.has(Feature::SameIdWhileAlive)
                                && w.control.is_frozen())
                    })
                    .map(|w| w.name.clone())
                    .collect();
                let name = if !reuse.is_empty() && self.rng.gen_bool(0.6) {
                    self.stats.restarts_same_id += 1;
                    reuse[self.rng.gen_range(0..reuse.len())].clone()
                } else {
                    format!("w{}", self.workers.len())
                };
                self.join(name, stream_mode);
            }
            3 => {
                let alive = self.alive();
                if alive.len() >= 2 {
                    let i = alive[self.rng.gen_range(0..alive.len())];
                    let w = &mut self.workers[i];
                    w.left = true;
                    w.shutdown.shutdown();
                    self.log.note(format!("leave {}", w.incarnation));
                    self.stats.leaves += 1;
                }
            }
            4 => self.kill_one(),
            5 => self.freeze_one(),
            7 => {
                // Records arrive, and at once (before they are read) a worker dies or
                // freezes past its lease.
                let n = self.rng.gen_range(20..100);
                self.produce(n).await;
                let kill = self.features.has(Feature::Kill)
                    && (!self.features.has(Feature::Freeze) || self.rng.gen_bool(0.5));
                if kill {
                    self.kill_one();
                } else {
                    self.freeze_one();
                }
            }
            8 => {
                // The Run future is dropped, without a shutdown: the worker must stop.
                let runners: Vec<usize> = self
                    .alive()
                    .into_iter()
                    .filter(|i| !self.workers[*i].stream_mode)
                    .collect();
                if self.alive().len() >= 2 && !runners.is_empty() {
                    let i = runners[self.rng.gen_range(0..runners.len())];
                    let w = &mut self.workers[i];
                    w.task.abort();
                    w.left = true;
                    w.dropped = true;
                    let log = self.log.clone();
                    let incarnation = w.incarnation.clone();
                    log.note(format!("drop the Run of {incarnation}"));
                    tokio::spawn(async move {
                        tokio::time::sleep(LEASE * 5).await;
                        let by = log.tick();
                        log.dropped_runs.lock().unwrap().push((incarnation, by));
                    });
                }
            }
            9 => self.correlated(),
            10 => self.unreadable_row_for_a_while(),
            11 => self.reset_as_a_shard_ends().await,
            12 => {
                // Records arrive, and while a worker handles them its process stops.
                let n = self.rng.gen_range(100..300);
                self.produce(n).await;
                let after = Duration::from_millis(self.rng.gen_range(10..300));
                tokio::time::sleep(after).await;
                self.process_freeze();
            }
            13 => {
                // The load shifts, then records flow at the new weights.
                let shifted = self.skew.as_ref().and_then(|s| s.lock().unwrap().shift());
                if let Some((hot, cold)) = shifted {
                    self.note(format!(
                        "load shifts: shard #{hot} cools, shard #{cold} heats"
                    ));
                    self.stats.load_shifts += 1;
                }
                let n = self.rng.gen_range(50..200);
                self.produce(n).await;
            }
            14 => {
                let day = self.rng.gen_bool(0.5);
                let outage = self.rng.gen_bool(0.3);
                self.suspend_the_group(day, outage).await;
            }
            _ => {
                // A quiet period longer than a lease.
                tokio::time::sleep(LEASE).await;
            }
        }
    }

    /// A random lease row stops parsing, and is repaired after half a lease to four.
    fn unreadable_row_for_a_while(&mut self) {
        let table = self.memory.table(GROUP);
        let rows = table.rows();
        if rows.is_empty() {
            return;
        }
        let key = rows[self.rng.gen_range(0..rows.len())].key.clone();
        let lease = LEASE.as_millis() as u64;
        let millis = self.rng.gen_range(lease / 2..lease * 4);
        table.make_unreadable(&key, "an attribute in the wrong form (simulated)");
        self.note(format!("row {key} unreadable for {millis} ms"));
        let log = self.log.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(millis)).await;
            table.repair(&key);
            log.note(format!("row {key} repaired"));
        });
    }

    /// A reshard, and at once a reset (to TRIM_HORIZON) requested on the row of a shard
    /// it closed, which its owner is still reading to its end.
    async fn reset_as_a_shard_ends(&mut self) {
        if !self.features.has(Feature::Reshard)
            && !self.features.has(Feature::MergeBack)
            && !self.features.has(Feature::TableStream)
        {
            return;
        }
        self.reshard().await;
        self.record_generations().await;
        let closed: Vec<String> = self
            .memory
            .streams()
            .list_shards(self.log.stream())
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.is_closed())
            .map(|s| s.shard_id)
            .collect();
        let table = self.memory.table(GROUP);
        let reading: Vec<_> = table
            .rows()
            .into_iter()
            .filter(|r| {
                r.owner.is_some()
                    && r.unreadable.is_none()
                    && r.checkpoint != Checkpoint::ShardEnd
                    && closed.iter().any(|c| r.key.ends_with(c.as_str()))
            })
            .collect();
        if reading.is_empty() {
            return;
        }
        let row = &reading[self.rng.gen_range(0..reading.len())];
        // The store's injected faults may refuse it: then no reset was accepted.
        let asked = table.request_reset(row, &Checkpoint::TrimHorizon).await;
        self.note(format!(
            "reset {} to TRIM_HORIZON as it ends: {asked:?}",
            row.key
        ));
        let n = self.rng.gen_range(20..100);
        self.produce(n).await;
    }

    fn kill_one(&mut self) {
        let alive = self.alive();
        if self.features.has(Feature::Kill) && alive.len() >= 2 {
            let i = alive[self.rng.gen_range(0..alive.len())];
            let w = &self.workers[i];
            w.control.kill();
            w.task.abort();
            self.log.note(format!("kill {}", w.incarnation));
            self.stats.kills += 1;
        }
    }

    /// The first, last or random k of the live workers by name (k from 2 to all but
    /// one) crash together, or stop gracefully together.
    fn correlated(&mut self) {
        let mut alive = self.alive();
        if alive.len() < 3 {
            return;
        }
        alive.sort_by(|a, b| self.workers[*a].name.cmp(&self.workers[*b].name));
        let k = self.rng.gen_range(2..alive.len());
        let which: Vec<usize> = match self.rng.gen_range(0..3) {
            0 => alive[..k].to_vec(),
            1 => alive[alive.len() - k..].to_vec(),
            _ => {
                for i in (1..alive.len()).rev() {
                    let j = self.rng.gen_range(0..=i);
                    alive.swap(i, j);
                }
                alive[..k].to_vec()
            }
        };
        let crash = self.rng.gen_bool(0.5);
        for i in which {
            let w = &mut self.workers[i];
            if crash {
                w.control.kill();
                w.task.abort();
                self.log
                    .note(format!("kill {} (correlated)", w.incarnation));
                self.stats.kills += 1;
            } else {
                w.left = true;
                w.shutdown.shutdown();
                self.log
                    .note(format!("leave {} (correlated)", w.incarnation));
                self.stats.leaves += 1;
            }
        }
    }

    /// A worker's process stops for half a lease to three (see
    /// [`Feature::ProcessFreeze`]), then resumes.
    fn process_freeze(&mut self) {
        let alive = self.alive();
        if alive.len() < 2 {
            return;
        }
        let i = alive[self.rng.gen_range(0..alive.len())];
        let lease = LEASE.as_millis() as u64;
        let millis = self.rng.gen_range(lease / 2..lease * 3);
        let w = &self.workers[i];
        w.control.freeze(true);
        let control = w.control.clone();
        let log = self.log.clone();
        let incarnation = w.incarnation.clone();
        log.note(format!("process of {incarnation} stops for {millis} ms"));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(millis)).await;
            control.freeze(false);
            log.note(format!("process of {incarnation} resumes"));
        });
        self.stats.freezes += 1;
    }

    fn freeze_one(&mut self) {
        let alive = self.alive();
        if self.features.has(Feature::Freeze) && alive.len() >= 2 {
            let i = alive[self.rng.gen_range(0..alive.len())];
            let lease = LEASE.as_millis() as u64;
            let millis = self.rng.gen_range(lease * 3 / 2..lease * 3);
            let w = &self.workers[i];
            w.control.freeze(true);
            let control = w.control.clone();
            let log = self.log.clone();
            let incarnation = w.incarnation.clone();
            log.note(format!("freeze {incarnation} for {millis} ms"));
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(millis)).await;
                control.freeze(false);
                log.note(format!("wake {incarnation}"));
            });
            self.stats.freezes += 1;
        }
    }

    fn finish_stats(&mut self) -> Stats {
        let log = &self.log;
        let mut s = self.stats.clone();
        s.records = invariants::written(&self.memory, &self.log).len();
        s.shards = self.log.parents.lock().unwrap().len();
        s.expired_iterators = log.expired_iterators.load(Ordering::SeqCst);
        s.handled = log.handled.lock().unwrap().len();
        s.handoffs_before_first_checkpoint = log
            .takes
            .lock()
            .unwrap()
            .iter()
            .filter(|t| t.before_first_checkpoint)
            .count();
        s.ambiguous_commits = log
            .commits
            .lock()
            .unwrap()
            .iter()
            .filter(|c| c.ambiguous)
            .count();
        s.hung = log.hung.load(Ordering::SeqCst);
        s.stale_lists = log.stale_lists.load(Ordering::SeqCst);
        s.missing_iterators = log.missing_iterators.load(Ordering::SeqCst);
        s.ambiguous_puts = log.ambiguous_puts.load(Ordering::SeqCst);
        s.nacks = log.nacks.load(Ordering::SeqCst);
        s.dropped_batches = log.dropped_batches.load(Ordering::SeqCst);
        s.hung_handlers = log.hung_handlers.load(Ordering::SeqCst);
        s.stuck_events = log.stuck_events.load(Ordering::SeqCst);
        s.dead_lettered = log.dead_lettered.load(Ordering::SeqCst);
        s.bisected_batches = log.bisected_batches.load(Ordering::SeqCst);
        s.planned_handoffs = log
            .takes
            .lock()
            .unwrap()
            .iter()
            .filter(|t| t.handed_over_by.is_some())
            .count();
        s
    }
}

/// The hook that records which shards each incarnation says are stuck.
fn stuck_hook(log: Arc<Log>, incarnation: String) -> impl Fn(&ShardEvent) + Send + Sync {
    move |event| {
        // Multi-stream mode names the shard `stream/shardId`.
        let raw = |shard: &str| shard.rsplit('/').next().unwrap_or(shard).to_owned();
        match event {
            ShardEvent::Stuck { shard, .. } => {
                log.stuck_events.fetch_add(1, Ordering::SeqCst);
                log.stuck
                    .lock()
                    .unwrap()
                    .insert((incarnation.clone(), raw(shard)));
            }
            ShardEvent::Unstuck { shard, .. } => {
                log.stuck
                    .lock()
                    .unwrap()
                    .remove(&(incarnation.clone(), raw(shard)));
            }
            _ => {}
        }
    }
}

/// The progress invariant, watched while the history runs (until `done`): every shard
/// with records waiting (required records not handled yet) has its handled position
/// moving within [`STALL_BOUND`], or a live worker holding it is not ready, shows it
/// stuck in its health and sent a `Stuck` event naming it. The bound's clock for a
/// shard starts when it has records waiting and restarts whenever a record of it or of
/// an ancestor is handled (a child is read only after its parents end), whenever a
/// `GetShardIterator` call on it or an ancestor that the backend left hanging ends,
/// whenever the shard or an ancestor is reported stuck as above, while a live worker, not ready,
/// names the lease row of the shard or an ancestor unreadable (no worker can take a
/// lease whose row does not parse; once it parses again, a taker must see it stand still
/// a lease duration, within the bound), and while no worker runs unfrozen and live
/// (nobody could read it, and every running worker says it is not live): a period of
/// [`STALL_BOUND`] with none of these is a silent stall.
async fn watch_progress(
    memory: Memory,
    log: Arc<Log>,
    probes: Arc<Mutex<Vec<Probe>>>,
    decided_start: Arc<Mutex<Option<Start>>>,
    done: Arc<AtomicBool>,
) -> Result<(), String> {
    let mut since: HashMap<String, tokio::time::Instant> = HashMap::new();
    while !done.load(Ordering::SeqCst) {
        tokio::time::sleep(LOOK_EVERY).await;
        let Some(start) = decided_start.lock().unwrap().clone() else {
            continue;
        };
        let now = tokio::time::Instant::now();
        // Nobody can read (every worker frozen, suspended or gone), or no handler can
        // finish (their downstream is down): no shard stalls in silence meanwhile, and
        // the look below (over every record) is spared.
        if log.outage.load(Ordering::SeqCst) || !probes.lock().unwrap().iter().any(Probe::acts) {
            for clock in since.values_mut() {
                *clock = now;
            }
            continue;
        }
        let shards = memory
            .streams()
            .list_shards(log.stream())
            .now_or_never()
            .and_then(Result::ok)
            .unwrap_or_default();
        let mut waiting: HashMap<String, usize> = HashMap::new();
        for (shard, _) in invariants::missing(&memory, &log, &start) {
            *waiting.entry(shard).or_default() += 1;
        }
        since.retain(|shard, _| waiting.contains_key(shard));
        let last_handled = log.last_handled.lock().unwrap().clone();
        let hung_reads_ended = log.hung_reads_ended.lock().unwrap().clone();
        let parents: HashMap<String, Vec<String>> = shards
            .iter()
            .map(|s| (s.shard_id.clone(), s.parents()))
            .collect();
        let probes = probes.lock().unwrap();
        // A worker that is not live (for example still starting, its first lease table
        // call hung) says so: it cannot read, but it does not stall in silence.
        let someone_acts = probes.iter().any(|p| {
            p.acts()
                && p.health
                    .lock()
                    .unwrap()
                    .as_ref()
                    .is_some_and(Health::is_live)
        });
        let stuck = log.stuck.lock().unwrap().clone();
        // Whether a live worker holds `shard` stuck, not ready, and sent the event.
        let said = |shard: &str| {
            probes.iter().any(|p| {
                !p.control.is_dead()
                    && stuck.contains(&(p.incarnation.clone(), shard.to_owned()))
                    && p.health.lock().unwrap().as_ref().is_some_and(|h| {
                        !h.is_ready()
                            && h.shards.iter().any(|s| {
                                s.shard_id.rsplit('/').next() == Some(shard)
                                    && s.stuck_for.is_some()
                            })
                    })
            })
        };
        // Whether a live worker, not ready, names `shard`'s lease row unreadable: nobody
        // can take a lease whose row does not parse, and the worker says so.
        let unreadable = |shard: &str| {
            probes.iter().any(|p| {
                !p.control.is_dead()
                    && p.health.lock().unwrap().as_ref().is_some_and(|h| {
                        !h.is_ready()
                            && h.unreadable_rows
                                .iter()
                                .any(|(s, _)| s.rsplit('/').next() == Some(shard))
                    })
            })
        };
        for (shard, count) in &waiting {
            let clock = since.entry(shard.clone()).or_insert(now);
            // The newest handling in the shard or an ancestor.
            let mut family = vec![shard.clone()];
            let mut i = 0;
            while i < family.len() {
                family.extend(parents.get(&family[i]).cloned().unwrap_or_default());
                i += 1;
            }
            if let Some(t) = family.iter().filter_map(|s| last_handled.get(s)).max() {
                *clock = (*clock).max(*t);
            }
            // A `GetShardIterator` call the backend leaves hanging holds the shard until
            // the worker drops it at its read call timeout, and the next call may hang
            // again: the time spent in such a call is the backend's, not a stall of the
            // worker (which cuts it, reports it in its health and retries).
            if let Some(t) = family.iter().filter_map(|s| hung_reads_ended.get(s)).max() {
                *clock = (*clock).max(*t);
            }
            if !someone_acts || family.iter().any(|s| said(s) || unreadable(s)) {
                *clock = now;
            }
            let stalled = now - *clock;
            if stalled > STALL_BOUND {
                let health: Vec<String> = probes
                    .iter()
                    .filter(|p| !p.control.is_dead())
                    .map(|p| format!("{}: {:?}", p.incarnation, p.health.lock().unwrap()))
                    .collect();
                return Err(format!(
                    "stalled in silence: shard {shard} has {count} records waiting and \
                     its handled position did not move for {stalled:?} (bound \
                     {STALL_BOUND:?}), and no live worker says it is stuck; health: {health:?}"
                ));
            }
        }
    }
    Ok(())
}

/// The run-mode handler: waits while its process is frozen, never finishes once it is
/// dead, and logs each record delivered and handled. With `hang = Some((n, pause))` it
/// hangs on the `n`-th record it receives: for `pause`, or for good (`None`: its worker
/// is killed after [`HUNG_FOR_GOOD`]).
fn handler(
    log: Arc<Log>,
    incarnation: String,
    control: Arc<Control>,
    concurrent: bool,
    hang: Option<(u64, Option<Duration>)>,
    panics: bool,
    pace: Option<Duration>,
) -> impl tower::Service<Message, Response = (), Error = &'static str, Future = impl Send> + Clone + Send
{
    // Records whose first attempt failed (concurrent workers only).
    type Failed = std::collections::HashSet<(Arc<str>, SequenceNumber)>;
    let failed: Arc<std::sync::Mutex<Failed>> = Arc::default();
    let received = Arc::new(AtomicU64::new(0));
    // How often each chosen record panicked (`panics`).
    type Panicked = std::collections::HashMap<(Arc<str>, SequenceNumber), u32>;
    let panicked: Arc<std::sync::Mutex<Panicked>> = Arc::default();
    tower::service_fn(move |msg: Message| {
        // The library starts the call now, whether or not the process is frozen.
        let called = log.call(&incarnation, &msg);
        let log = log.clone();
        let incarnation = incarnation.clone();
        let control = control.clone();
        let failed = failed.clone();
        let received = received.clone();
        let panicked = panicked.clone();
        async move {
            control.handler_gate().await;
            if let Some(pace) = pace {
                tokio::time::sleep(pace).await;
            }
            log.deliver_called(&incarnation, &msg, called);
            let n = received.fetch_add(1, Ordering::SeqCst) + 1;
            if let Some((_, pause)) = hang.filter(|(at, _)| *at == n) {
                log.hung_handlers.fetch_add(1, Ordering::SeqCst);
                let what = format!(
                    "{incarnation}'s handler hangs on {} {}",
                    msg.metadata.shard_id, msg.metadata.sequence_number
                );
                match pause {
                    Some(pause) => {
                        log.note(format!("{what} for {pause:?}"));
                        tokio::time::sleep(pause).await;
                    }
                    None => {
                        log.note(format!("{what} for good"));
                        let (log, control, incarnation) =
                            (log.clone(), control.clone(), incarnation.clone());
                        tokio::spawn(async move {
                            tokio::time::sleep(HUNG_FOR_GOOD).await;
                            if !control.is_dead() {
                                control.kill();
                                log.note(format!("kill {incarnation} (its handler hangs)"));
                            }
                        });
                        std::future::pending::<()>().await;
                    }
                }
            }
            if panics {
                let h = msg
                    .metadata
                    .sequence_number
                    .as_str()
                    .bytes()
                    .fold(7u64, |h, b| h.wrapping_mul(131).wrapping_add(b as u64));
                let key = (
                    msg.metadata.shard_id.clone(),
                    msg.metadata.sequence_number.clone(),
                );
                if h % 50 == 3 {
                    let mut panicked = panicked.lock().unwrap();
                    let n = panicked.entry(key).or_insert(0);
                    *n += 1;
                    if *n <= 2 {
                        drop(panicked);
                        panic!("{}", INTENDED_PANICS[0]);
                    }
                }
            }
            if concurrent {
                // Calls finish out of order, and some fail once: the watermark and the
                // redelivery after a failure are under test.
                let h = msg
                    .metadata
                    .sequence_number
                    .as_str()
                    .bytes()
                    .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64));
                tokio::time::sleep(Duration::from_millis(h % 20)).await;
                let key = (
                    msg.metadata.shard_id.clone(),
                    msg.metadata.sequence_number.clone(),
                );
                if h % 40 == 0 && failed.lock().unwrap().insert(key) {
                    return Err("injected failure");
                }
            }
            log.handle(&incarnation, &msg);
            Ok(())
        }
    })
}

/// Whether a record is poison for the batch-mode handler (about one in 30).
fn is_poison(msg: &Message) -> bool {
    let h = msg
        .metadata
        .sequence_number
        .as_str()
        .bytes()
        .fold(11u64, |h, b| h.wrapping_mul(137).wrapping_add(b as u64));
    h % 30 == 7
}

/// A record's identity within its shard: shard, sequence and sub-sequence number.
type RecordId = (Arc<str>, String, u64);

fn record_id(msg: &Message) -> RecordId {
    (
        msg.metadata.shard_id.clone(),
        msg.metadata.sequence_number.as_str().to_owned(),
        msg.metadata.sub_sequence_number,
    )
}

/// The batch-mode handler: a `Bisect` layer over a bulk handler that fails every call
/// holding a poison record, with a dead-letter sink that refuses each poison record the
/// first time. Around it, a check that each delivery's records were each handled or
/// dead-lettered exactly once (all of them on `Ok`, a prefix on an error).
fn batch_handler(
    log: Arc<Log>,
    incarnation: String,
    control: Arc<Control>,
) -> impl tower::Service<shardflow::Batch, Response = (), Error = String, Future = impl Send>
       + Clone
       + Send {
    use shardflow_middleware::dead_letter::DeadLetterRecord;
    use shardflow_middleware::ServiceBuilderExt;

    // What the current call of each shard finished, in order.
    type Finished = HashMap<Arc<str>, Vec<RecordId>>;
    let finished: Arc<Mutex<Finished>> = Arc::default();
    let refused: Arc<Mutex<std::collections::HashSet<RecordId>>> = Arc::default();
    let bulk = {
        let (log, incarnation, control, finished) = (
            log.clone(),
            incarnation.clone(),
            control.clone(),
            finished.clone(),
        );
        tower::service_fn(move |batch: shardflow::Batch| {
            let (log, incarnation, control, finished) = (
                log.clone(),
                incarnation.clone(),
                control.clone(),
                finished.clone(),
            );
            async move {
                control.handler_gate().await;
                for m in &batch.messages {
                    log.deliver(&incarnation, m);
                }
                if batch.messages.iter().any(is_poison) {
                    return Err::<(), &'static str>("poison record");
                }
                let mut finished = finished.lock().unwrap();
                for m in &batch.messages {
                    log.handle(&incarnation, m);
                    finished
                        .entry(batch.shard_id.clone())
                        .or_default()
                        .push(record_id(m));
                }
                Ok(())
            }
        })
    };
    let sink = {
        let (log, incarnation, control, finished) = (
            log.clone(),
            incarnation.clone(),
            control.clone(),
            finished.clone(),
        );
        tower::service_fn(move |record: DeadLetterRecord| {
            let (log, incarnation, control, finished, refused) = (
                log.clone(),
                incarnation.clone(),
                control.clone(),
                finished.clone(),
                refused.clone(),
            );
            async move {
                control.handler_gate().await;
                let msg = Message::new(record.metadata, record.payload);
                if refused.lock().unwrap().insert(record_id(&msg)) {
                    return Err::<(), &'static str>("the dead-letter stream is down");
                }
                log.handle(&incarnation, &msg);
                log.dead_lettered.fetch_add(1, Ordering::SeqCst);
                finished
                    .lock()
                    .unwrap()
                    .entry(msg.metadata.shard_id.clone())
                    .or_default()
                    .push(record_id(&msg));
                Ok(())
            }
        })
    };
    let bisect = tower::ServiceBuilder::new().bisect(sink).service(bulk);
    tower::service_fn(move |batch: shardflow::Batch| {
        if let Some(first) = batch.messages.first() {
            log.call(&incarnation, first);
        }
        let (log, incarnation, finished) = (log.clone(), incarnation.clone(), finished.clone());
        let expected: Vec<RecordId> = batch.messages.iter().map(record_id).collect();
        let shard = batch.shard_id.clone();
        finished.lock().unwrap().remove(&shard);
        let call = tower::ServiceExt::oneshot(bisect.clone(), batch);
        async move {
            let result = call.await;
            let done = finished.lock().unwrap().remove(&shard).unwrap_or_default();
            let ok = match &result {
                Ok(outcome) => {
                    if outcome.dead_lettered > 0 {
                        log.bisected_batches.fetch_add(1, Ordering::SeqCst);
                    }
                    done == expected
                }
                Err(_) => expected.starts_with(&done),
            };
            if !ok {
                log.poison_violations.lock().unwrap().push(format!(
                    "{incarnation} on {shard}: delivered {expected:?}, finished {done:?} ({})",
                    if result.is_ok() { "ok" } else { "failed" }
                ));
            }
            result.map(drop).map_err(|e| e.to_string())
        }
    })
}

/// A `stream()`-mode consumer: holds a few batches and acknowledges them in random
/// order; with the features on, nacks some and drops one (then leaves).
async fn stream_worker(
    consumer: Consumer,
    incarnation: String,
    control: Arc<Control>,
    log: Arc<Log>,
    mut rng: SmallRng,
    features: Features,
    health: Arc<Mutex<Option<Health>>>,
) -> Result<(), String> {
    let shutdown = consumer.shutdown_handle();
    let mut stream = consumer.stream();
    let mut held: Vec<(shardflow::Batch, Option<AckHandle>)> = Vec::new();
    let hold = rng.gen_range(1..=4);
    let mut ended = false;
    let mut result = Ok(());
    while !ended || !held.is_empty() {
        *health.lock().unwrap() = Some(stream.health());
        let mut tick = false;
        if !ended {
            match tokio::time::timeout(Duration::from_millis(100), stream.next()).await {
                Ok(Some(Ok(mut batch))) => {
                    // Handed out: the stream's unit of a handler call.
                    if let Some(first) = batch.messages.first() {
                        log.call(&incarnation, first);
                    }
                    control.handler_gate().await;
                    for m in &batch.messages {
                        log.deliver(&incarnation, m);
                    }
                    let ack = batch.take_ack();
                    held.push((batch, ack));
                }
                Ok(Some(Err(e))) => {
                    result = Err(e.to_string());
                }
                Ok(None) => ended = true,
                Err(_) => tick = true,
            }
        } else {
            tick = true;
        }
        control.handler_gate().await;
        while !held.is_empty() && (held.len() > hold || tick) {
            tick = false;
            let (batch, ack) = held.swap_remove(rng.gen_range(0..held.len()));
            let Some(ack) = ack else { continue };
            if features.has(Feature::StreamNack) && rng.gen_bool(0.05) {
                log.nacks.fetch_add(1, Ordering::SeqCst);
                ack.nack();
            } else if features.has(Feature::StreamDrop) && rng.gen_bool(0.03) {
                log.dropped_batches.fetch_add(1, Ordering::SeqCst);
                log.note(format!("{incarnation} drops a batch and leaves"));
                drop((batch, ack));
                shutdown.shutdown();
            } else if features.has(Feature::StreamAckThrough) && rng.gen_bool(0.1) {
                let last = batch.messages.len() - 1;
                if rng.gen_bool(0.5) {
                    // Part of the batch now, the whole of it later.
                    let k = rng.gen_range(0..=last);
                    for m in &batch.messages[..=k] {
                        log.handle(&incarnation, m);
                    }
                    ack.ack_through(batch.messages[k].position());
                    held.push((batch, Some(ack)));
                } else {
                    // Past the batch (a user mistake): only its own records are handled.
                    for m in &batch.messages {
                        log.handle(&incarnation, m);
                    }
                    log.note(format!(
                        "{incarnation} acks {} through a position past its batch",
                        batch.shard_id
                    ));
                    let digits = batch.messages[last].metadata.sequence_number.as_str().len();
                    if let Ok(beyond) = SequenceNumber::new("9".repeat(digits)) {
                        ack.ack_through(Position::new(beyond, 0));
                    }
                    // Acknowledged whole later, like the partial case.
                    held.push((batch, Some(ack)));
                }
            } else {
                for m in &batch.messages {
                    log.handle(&incarnation, m);
                }
                ack.ack();
            }
        }
    }
    result
}
