//! A fleet of workers of one consumer group, as tasks in one process on the embedded
//! backend, for balance and scale figures in simulated time (run it under tokio's paused
//! clock: the store and stream latencies are then exact, and 2 cores cannot distort
//! them).

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use shardflow::kinesis::{KinesisApi, PutRecord, StreamAdmin};
use shardflow::lease::{Lease, LeaseError};

use crate::hooks::{Hooked, Hooks};
use shardflow::memory::LeaseFaults;
use shardflow::{BalanceBy, Consumer, ConsumerError, Memory, Message, ShutdownHandle};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// The stream a fleet reads.
pub const STREAM: &str = "fleet";
/// The consumer group (and lease table) of a fleet.
pub const GROUP: &str = "fleet-group";

/// The shape of a fleet.
#[derive(Clone, Debug)]
pub struct Fleet {
    /// Shards of the stream.
    pub shards: u32,
    /// Workers started together.
    pub workers: usize,
    /// Every lease-store call takes this long.
    pub store_latency: Duration,
    /// Every ListShards, GetShardIterator and GetRecords call takes this long.
    pub read_latency: Duration,
    /// Seed of the workers' jitter and of the injected faults.
    pub seed: u64,
    /// While the fleet runs, put one more record in every shard this often (until
    /// [`Running::stop_feed`]), so hand-offs happen under traffic.
    pub feed_every: Option<Duration>,
    /// The data size of each shard's records (in the stream's shard order; shards past
    /// the end, and all without it, get 1 byte): with [`Fleet::feed_every`], each
    /// shard's throughput. [`Running::set_record_sizes`] changes it while running.
    pub record_sizes: Option<Vec<usize>>,
    /// What the workers' balancing evens out.
    pub balance_by: BalanceBy,
}

impl Fleet {
    /// Realistic latencies: 8 ms per DynamoDB call, 25 ms per Kinesis call.
    pub fn new(shards: u32, workers: usize) -> Self {
        Fleet {
            shards,
            workers,
            store_latency: Duration::from_millis(8),
            read_latency: Duration::from_millis(25),
            seed: 11,
            feed_every: None,
            record_sizes: None,
            balance_by: BalanceBy::Count,
        }
    }
}

/// One lease-store call a worker made: when it was sent, by which worker, which call
/// (`"renew"`, `"create"`, ...) and on which lease (none for `list`, `ensure_table`).
#[derive(Clone, Debug)]
pub struct Call {
    /// When the call was sent.
    pub at: Instant,
    /// The worker that made it.
    pub worker: String,
    /// The call (`"renew"`, `"create"`, `"take"`, ...).
    pub op: &'static str,
    /// The lease it was about, if any.
    pub key: Option<String>,
}

/// A started fleet: the backend, the workers and which shards delivered a record.
pub struct Running {
    /// The embedded backend the fleet runs on.
    pub memory: Memory,
    /// The shape it was started with.
    pub fleet: Fleet,
    /// When it was started.
    pub started: Instant,
    /// When each shard that delivered a record last delivered one (to a live worker).
    pub last_delivery: Arc<Mutex<HashMap<String, Instant>>>,
    /// How often each record (shard, sequence number) was handled.
    pub handled: Arc<Mutex<HashMap<(String, String), usize>>>,
    /// Records put in the stream so far.
    pub put: Arc<Mutex<usize>>,
    /// Every lease-store call of every worker, in the order sent.
    pub calls: Arc<Mutex<Vec<Call>>>,
    /// (worker id, lease key): that worker's renewals of that lease time out (a row
    /// whose renewals fail while the worker's others land).
    pub failing_renewals: Arc<Mutex<Vec<(String, String)>>>,
    /// Worker ids whose writes of the leader item (takes, renewals) time out, while
    /// their lease writes land.
    pub failing_leader_writes: Arc<Mutex<Vec<String>>>,
    /// Worker ids whose listings of the lease table (Scans) time out, while their
    /// other calls land.
    pub failing_lists: Arc<Mutex<Vec<String>>>,
    /// Worker ids whose writes to the lease table (takes, renewals, checkpoints,
    /// releases, ...) time out, while their reads and leader-item writes land.
    pub failing_lease_writes: Arc<Mutex<Vec<String>>>,
    /// While set, every call of every worker to the coordinator-state table (the leader
    /// item's) fails so (an IAM policy for the lease table only, or the table deleted).
    pub coordinator_fault: Arc<Mutex<Option<CoordinatorFault>>>,
    /// Worker id -> how long that worker's next handler call takes (a slow, healthy
    /// call); the entry goes once the call starts.
    pub slow_calls: Arc<Mutex<BTreeMap<String, Duration>>>,
    /// While set, the next take of the leader item that lands has its answer lost: it
    /// comes after the call deadline. The worker that sent it is then noted in
    /// [`Running::lost_claim_answers`].
    pub lose_next_claim_answer: Arc<AtomicBool>,
    /// The workers whose take of the leader item had its answer lost (see
    /// [`Running::lose_next_claim_answer`]).
    pub lost_claim_answers: Arc<Mutex<Vec<String>>>,
    /// Every record a handler finished, in order, with the worker.
    pub deliveries: Arc<Mutex<Vec<Delivery>>>,
    /// Every take, hand-over, release and hand-off request that landed, in order.
    pub lease_events: Arc<Mutex<Vec<LeaseEvent>>>,
    /// Kills, freezes and wake-ups, in order: (when, worker id, what).
    pub faults: Arc<Mutex<Vec<(Instant, String, WorkerFault)>>>,
    feed: Option<JoinHandle<()>>,
    /// The records the feed puts, one per shard.
    records: Arc<Mutex<Vec<PutRecord>>>,
    /// The stream's shards, in the order of [`Fleet::record_sizes`].
    shard_ids: Vec<String>,
    workers: Vec<Worker>,
}

/// How the coordinator-state table fails (see [`Running::coordinator_fault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoordinatorFault {
    /// Every call is refused for lack of permission.
    Denied,
    /// The table does not exist.
    Deleted,
    /// Its writes (`UpdateItem`: the leader item's take, renewal and release) are
    /// refused for lack of permission; reads answer.
    WritesDenied,
    /// Its reads (`GetItem`) are refused for lack of permission; writes answer.
    ReadsDenied,
}

/// One started worker: its id, its shutdown handle, its task and whether it was killed.
struct Worker {
    id: String,
    shutdown: ShutdownHandle,
    task: JoinHandle<Result<(), ConsumerError>>,
    dead: Arc<AtomicBool>,
    frozen: Arc<AtomicBool>,
}

/// A worker process's view of the lease table: once the process is killed, none of its
/// lease-store calls lands any more (they never answer), so its leases are neither
/// renewed nor released and expire, as after a crash. Every call sent is logged.
struct Killable {
    dead: Arc<AtomicBool>,
    worker: String,
    calls: Arc<Mutex<Vec<Call>>>,
    failing_renewals: Arc<Mutex<Vec<(String, String)>>>,
    failing_leader_writes: Arc<Mutex<Vec<String>>>,
    failing_lists: Arc<Mutex<Vec<String>>>,
    failing_lease_writes: Arc<Mutex<Vec<String>>>,
    coordinator_fault: Arc<Mutex<Option<CoordinatorFault>>>,
    lose_next_claim_answer: Arc<AtomicBool>,
    lost_claim_answers: Arc<Mutex<Vec<String>>>,
    frozen: Arc<AtomicBool>,
    lease_events: Arc<Mutex<Vec<LeaseEvent>>>,
}

/// Waits while `frozen` is set (a process stopped by the scheduler).
async fn wait_while(frozen: &AtomicBool) {
    while frozen.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[async_trait]
impl Hooks for Killable {
    async fn after_lease(&self, op: &'static str, key: Option<&str>, row: Option<&Lease>) {
        if let (true, Some(key), Some(row)) = (
            matches!(op, "take" | "release" | "request_handoff"),
            key,
            row,
        ) {
            self.lease_events.lock().unwrap().push(LeaseEvent {
                at: Instant::now(),
                worker: self.worker.clone(),
                op,
                key: key.to_owned(),
                owner: row.owner.clone(),
            });
        }
        if op == "leader_claim" && self.lose_next_claim_answer.swap(false, Ordering::SeqCst) {
            self.lost_claim_answers
                .lock()
                .unwrap()
                .push(self.worker.clone());
            // Longer than any call deadline: the caller gives up first.
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
    }

    async fn before_lease(&self, op: &'static str, key: Option<&str>) -> Result<(), LeaseError> {
        wait_while(&self.frozen).await;
        if self.dead.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.calls.lock().unwrap().push(Call {
            at: Instant::now(),
            worker: self.worker.clone(),
            op,
            key: key.map(str::to_owned),
        });
        let failing = op == "renew"
            && key.is_some_and(|k| {
                self.failing_renewals
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|(w, f)| *w == self.worker && f == k)
            });
        let failing = failing
            || (matches!(op, "leader_claim" | "leader_renew")
                && self
                    .failing_leader_writes
                    .lock()
                    .unwrap()
                    .contains(&self.worker));
        let failing =
            failing || (op == "list" && self.failing_lists.lock().unwrap().contains(&self.worker));
        let failing = failing
            || (!matches!(op, "list" | "owned_keys" | "get" | "ensure_table")
                && !op.starts_with("leader_")
                && self
                    .failing_lease_writes
                    .lock()
                    .unwrap()
                    .contains(&self.worker));
        if op.starts_with("leader_") {
            let write = matches!(op, "leader_claim" | "leader_renew" | "leader_release");
            let denied = || {
                Err(LeaseError::AccessDenied(
                    format!("injected: not authorized to call {op} on the coordinator-state table")
                        .into(),
                ))
            };
            match *self.coordinator_fault.lock().unwrap() {
                Some(CoordinatorFault::WritesDenied) if write => return denied(),
                Some(CoordinatorFault::ReadsDenied) if op == "leader_get" => return denied(),
                Some(CoordinatorFault::WritesDenied | CoordinatorFault::ReadsDenied) => {}
                Some(CoordinatorFault::Denied) => {
                    return Err(LeaseError::AccessDenied(
                        "injected: not authorized to use the coordinator-state table".into(),
                    ))
                }
                Some(CoordinatorFault::Deleted) => {
                    return Err(LeaseError::TableMissing {
                        table: format!("{GROUP}-coordinator"),
                    })
                }
                None => {}
            }
        }
        if failing {
            return Err(LeaseError::TimedOut {
                op,
                after: Duration::from_secs(1),
            });
        }
        Ok(())
    }
}

/// A record reaching a worker's handler (see [`Running::deliveries`]).
#[derive(Clone, Debug)]
pub struct Delivery {
    /// When the handler finished it.
    pub at: Instant,
    /// The worker (its id) whose handler ran.
    pub worker: String,
    /// The shard.
    pub shard: String,
    /// The record's sequence number.
    pub sequence: String,
}

/// A lease write that landed (see [`Running::lease_events`]).
#[derive(Clone, Debug)]
pub struct LeaseEvent {
    /// When its answer came back.
    pub at: Instant,
    /// The worker (its id) that made the call.
    pub worker: String,
    /// The call: `"take"` (a take, or the owner handing the lease over when the new
    /// owner is another worker), `"release"`, `"request_handoff"`.
    pub op: &'static str,
    /// The lease.
    pub key: String,
    /// The lease's owner after the write (`id#nonce`), if any.
    pub owner: Option<String>,
}

/// A pause or crash of a worker (see [`Running::faults`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkerFault {
    /// Killed: no drain, no release.
    Killed,
    /// Frozen: its lease calls and handler calls wait until it is woken.
    Frozen,
    /// Woken from a freeze.
    Woken,
}

/// The owner of each lease as the table says: worker id -> leases held.
pub fn leases_per_owner(memory: &Memory) -> BTreeMap<String, usize> {
    let mut per_owner = BTreeMap::new();
    for row in memory.table(GROUP).rows() {
        if let Some(owner) = row.owner {
            *per_owner.entry(owner).or_default() += 1;
        }
    }
    per_owner
}

/// Creates the stream with one record in every shard and starts every worker at once
/// with the default configuration.
pub async fn start(fleet: Fleet) -> Running {
    let memory = Memory::new();
    let kinesis = memory.streams().clone();
    kinesis
        .create_stream(STREAM, fleet.shards)
        .await
        .expect("create the stream");
    let shards = kinesis.list_shards(STREAM).await.expect("list shards");
    let records: Vec<PutRecord> = shards
        .iter()
        .enumerate()
        .map(|(i, s)| PutRecord {
            data: record_of(fleet.record_sizes.as_deref(), i),
            partition_key: s.shard_id.clone(),
            explicit_hash_key: Some(s.starting_hash_key.to_string()),
        })
        .collect();
    let put: Arc<Mutex<usize>> = Arc::default();
    put_all(memory.streams(), &records, &put).await;
    kinesis.set_latency(fleet.read_latency);
    memory.table(GROUP).set_faults(LeaseFaults {
        latency: fleet.store_latency,
        ..LeaseFaults::default()
    });
    let started = Instant::now();
    let shard_ids: Vec<String> = shards.iter().map(|s| s.shard_id.clone()).collect();
    let records = Arc::new(Mutex::new(records));
    let feed = fleet.feed_every.map(|every| {
        let (streams, put) = (memory.streams().clone(), put.clone());
        let records = records.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(Instant::now() + every, every);
            loop {
                tick.tick().await;
                let batch = records.lock().unwrap().clone();
                put_all(&streams, &batch, &put).await;
            }
        })
    });
    let mut running = Running {
        memory,
        fleet,
        started,
        last_delivery: Arc::default(),
        handled: Arc::default(),
        put,
        calls: Arc::default(),
        failing_renewals: Arc::default(),
        failing_leader_writes: Arc::default(),
        failing_lists: Arc::default(),
        failing_lease_writes: Arc::default(),
        coordinator_fault: Arc::default(),
        slow_calls: Arc::default(),
        lose_next_claim_answer: Arc::default(),
        lost_claim_answers: Arc::default(),
        deliveries: Arc::default(),
        lease_events: Arc::default(),
        faults: Arc::default(),
        feed,
        records,
        shard_ids,
        workers: Vec::new(),
    };
    running.add_workers(running.fleet.workers);
    running
}

/// `fleet`, started and balanced within a minute (the start-up target is 30 s).
pub async fn start_balanced(fleet: Fleet) -> Running {
    let running = start(fleet).await;
    assert!(
        running
            .until(Duration::from_secs(60), |r| r.balanced())
            .await
            .is_some(),
        "not balanced: {:?}",
        leases_per_owner(&running.memory)
    );
    running
}

/// Record sizes for [`Fleet::record_sizes`] skewed as real streams are: each shard's a
/// draw from a Zipf distribution (exponent 1.2, values 1 to 100) times `unit` bytes,
/// from a generator seeded with `seed`.
pub fn zipf_record_sizes(shards: usize, seed: u64, unit: usize) -> Vec<usize> {
    use rand::{Rng, SeedableRng};
    let zipf = rand_distr::Zipf::new(100, 1.2).expect("valid Zipf parameters");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..shards)
        .map(|_| rng.sample(zipf) as usize * unit)
        .collect()
}

/// The record of the `i`-th shard: `sizes[i]` bytes (1 without a size).
fn record_of(sizes: Option<&[usize]>, i: usize) -> Bytes {
    let size = sizes.and_then(|s| s.get(i)).copied().unwrap_or(1).max(1);
    Bytes::from(vec![b'x'; size])
}

/// Puts `records` (500 per call) and counts them in `put`.
async fn put_all(
    streams: &shardflow::memory::MemoryKinesis,
    records: &[PutRecord],
    put: &Mutex<usize>,
) {
    for chunk in records.chunks(500) {
        streams
            .put_records(STREAM, chunk)
            .await
            .expect("put records");
        *put.lock().unwrap() += chunk.len();
    }
}

impl Running {
    /// Starts `count` more workers of the group (default configuration), named on from
    /// the last one.
    pub fn add_workers(&mut self, count: usize) {
        for _ in 0..count {
            let i = self.workers.len();
            let worker = self.spawn_worker(format!("w{i:03}"), i as u64);
            self.workers.push(worker);
        }
    }

    /// Starts worker `i` again under its id after it was killed or stopped (a process
    /// restarted: a new owner nonce, the same id), with a seed of its own.
    pub fn restart(&mut self, i: usize) {
        let id = self.workers[i].id.clone();
        let restarts = self.workers.len() as u64 + i as u64 * 1_000;
        let worker = self.spawn_worker(id, restarts);
        let old = std::mem::replace(&mut self.workers[i], worker);
        old.task.abort();
    }

    /// Freezes worker `i` (a process paused by its host): its lease-store calls and
    /// handler calls wait until [`Running::wake`]; past the lease duration the others
    /// take its leases.
    pub fn freeze(&mut self, i: usize) {
        let worker = &self.workers[i];
        worker.frozen.store(true, Ordering::SeqCst);
        self.faults
            .lock()
            .unwrap()
            .push((Instant::now(), worker.id.clone(), WorkerFault::Frozen));
    }

    /// Wakes worker `i` from [`Running::freeze`].
    pub fn wake(&mut self, i: usize) {
        let worker = &self.workers[i];
        worker.frozen.store(false, Ordering::SeqCst);
        self.faults
            .lock()
            .unwrap()
            .push((Instant::now(), worker.id.clone(), WorkerFault::Woken));
    }

    /// Builds and starts one worker named `id` (default configuration, the fleet's
    /// seed plus `salt`).
    fn spawn_worker(&mut self, id: String, salt: u64) -> Worker {
        let dead = Arc::new(AtomicBool::new(false));
        let frozen = Arc::new(AtomicBool::new(false));
        let consumer = Consumer::builder()
            .stream(STREAM)
            .group(GROUP)
            .worker_id(&id)
            .backend(Hooked::new(
                self.memory.clone(),
                Killable {
                    dead: dead.clone(),
                    worker: id.clone(),
                    calls: self.calls.clone(),
                    failing_renewals: self.failing_renewals.clone(),
                    failing_leader_writes: self.failing_leader_writes.clone(),
                    failing_lists: self.failing_lists.clone(),
                    failing_lease_writes: self.failing_lease_writes.clone(),
                    coordinator_fault: self.coordinator_fault.clone(),
                    lose_next_claim_answer: self.lose_next_claim_answer.clone(),
                    lost_claim_answers: self.lost_claim_answers.clone(),
                    frozen: frozen.clone(),
                    lease_events: self.lease_events.clone(),
                },
            ))
            .seed(self.fleet.seed.wrapping_add(salt))
            .balance_by(self.fleet.balance_by)
            .build()
            .expect("a valid configuration");
        let (last, counts, gone, pause) = (
            self.last_delivery.clone(),
            self.handled.clone(),
            dead.clone(),
            frozen.clone(),
        );
        let deliveries = self.deliveries.clone();
        let (slow, me) = (self.slow_calls.clone(), id.clone());
        let handler = tower::service_fn(move |msg: Message| {
            let (last, counts, gone, pause) =
                (last.clone(), counts.clone(), gone.clone(), pause.clone());
            let (deliveries, me) = (deliveries.clone(), me.clone());
            let slow = slow.lock().unwrap().remove(&me);
            async move {
                if let Some(slow) = slow {
                    tokio::time::sleep(slow).await;
                }
                wait_while(&pause).await;
                // A killed process handles nothing more (and acknowledges nothing).
                if gone.load(Ordering::SeqCst) {
                    std::future::pending::<()>().await;
                }
                let shard = msg.metadata.shard_id.to_string();
                let sequence = msg.metadata.sequence_number.to_string();
                *counts
                    .lock()
                    .unwrap()
                    .entry((shard.clone(), sequence.clone()))
                    .or_default() += 1;
                last.lock().unwrap().insert(shard.clone(), Instant::now());
                deliveries.lock().unwrap().push(Delivery {
                    at: Instant::now(),
                    worker: me,
                    shard,
                    sequence,
                });
                Ok::<_, Infallible>(())
            }
        });
        let shutdown = consumer.shutdown_handle();
        let task = tokio::spawn(consumer.run(handler).into_future());
        Worker {
            id,
            shutdown,
            task,
            dead,
            frozen,
        }
    }

    /// Kills worker `i` (a crash: no drain, no release; its lease-store calls never land
    /// again and its handler never finishes). Returns the leases it held then.
    pub fn kill(&mut self, i: usize) -> Vec<String> {
        let worker = &self.workers[i];
        worker.dead.store(true, Ordering::SeqCst);
        self.faults
            .lock()
            .unwrap()
            .push((Instant::now(), worker.id.clone(), WorkerFault::Killed));
        let prefix = format!("{}#", worker.id);
        self.memory
            .table(GROUP)
            .rows()
            .into_iter()
            .filter(|r| r.owner.as_deref().is_some_and(|o| o.starts_with(&prefix)))
            .map(|r| r.key)
            .collect()
    }

    /// Stops worker `i` gracefully (drain, checkpoint, release) and waits until it
    /// stopped; from then on it counts as gone, as a killed one. Returns the leases it
    /// held when asked to stop.
    pub async fn stop_worker(&mut self, i: usize) -> Vec<String> {
        let prefix = format!("{}#", self.workers[i].id);
        let held = self
            .memory
            .table(GROUP)
            .rows()
            .into_iter()
            .filter(|r| r.owner.as_deref().is_some_and(|o| o.starts_with(&prefix)))
            .map(|r| r.key)
            .collect();
        let worker = &mut self.workers[i];
        worker.shutdown.shutdown();
        match (&mut worker.task).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => panic!("worker {} failed: {e}", worker.id),
            Err(e) => panic!("worker {} panicked: {e}", worker.id),
        }
        worker.dead.store(true, Ordering::SeqCst);
        held
    }

    /// Asks worker `i` to stop gracefully without waiting for it (it drains,
    /// checkpoints and releases meanwhile; [`Running::stop`] waits for it).
    pub fn ask_to_stop(&self, i: usize) {
        self.workers[i].shutdown.shutdown();
    }

    /// The index of the worker named `id`.
    pub fn index_of(&self, id: &str) -> Option<usize> {
        self.workers.iter().position(|w| w.id == id)
    }

    /// Stops the workers `which` gracefully all at once (a deploy stopping several
    /// pods together) and waits until each stopped; returns the leases they held when
    /// asked to stop.
    pub async fn stop_workers(&mut self, which: &[usize]) -> Vec<String> {
        let mut held = Vec::new();
        for &i in which {
            let prefix = format!("{}#", self.workers[i].id);
            held.extend(
                self.memory
                    .table(GROUP)
                    .rows()
                    .into_iter()
                    .filter(|r| r.owner.as_deref().is_some_and(|o| o.starts_with(&prefix)))
                    .map(|r| r.key),
            );
            self.workers[i].shutdown.shutdown();
        }
        for &i in which {
            let worker = &mut self.workers[i];
            match (&mut worker.task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("worker {} failed: {e}", worker.id),
                Err(e) => panic!("worker {} panicked: {e}", worker.id),
            }
            worker.dead.store(true, Ordering::SeqCst);
        }
        held
    }

    /// The index of the worker that holds the group's leader item, if any.
    pub fn leader(&self) -> Option<usize> {
        let item = self
            .memory
            .table(GROUP)
            .coordinator()
            .item(shardflow::lease::LEADER_KEY)?;
        let owner = item.owner?;
        self.workers
            .iter()
            .position(|w| owner.starts_with(&format!("{}#", w.id)))
    }

    /// Waits until every shard of `gone` delivered a record after `since`; the time that
    /// took, or a failure naming the shards still waiting after `limit`.
    pub async fn read_again(&self, gone: &[String], since: Instant, limit: Duration) -> Duration {
        let done = self
            .until(self.started.elapsed() + limit, |r| {
                gone.iter().all(|s| r.delivered_after(s, since))
            })
            .await;
        let waiting: Vec<&String> = gone
            .iter()
            .filter(|s| !self.delivered_after(s, since))
            .collect();
        assert!(
            done.is_some(),
            "shards {waiting:?} not read again within {limit:?}"
        );
        since.elapsed()
    }

    /// Workers started and not killed.
    pub fn live(&self) -> usize {
        self.workers
            .iter()
            .filter(|w| !w.dead.load(Ordering::SeqCst))
            .count()
    }

    /// Whether every live worker holds its fair share: between floor and ceil of
    /// shards / workers (so within one of each other).
    pub fn balanced(&self) -> bool {
        let per_owner = leases_per_owner(&self.memory);
        let n = self.fleet.shards as usize;
        let live = self.live();
        let (low, high) = (n / live, n.div_ceil(live));
        per_owner.len() == live
            && per_owner.values().sum::<usize>() == n
            && per_owner.values().all(|c| (low..=high).contains(c))
    }

    /// Whether every shard delivered its record.
    pub fn all_delivered(&self) -> bool {
        self.last_delivery.lock().unwrap().len() == self.fleet.shards as usize
    }

    /// Whether `shard` delivered a record (to a live worker) after `since`.
    pub fn delivered_after(&self, shard: &str, since: Instant) -> bool {
        self.last_delivery
            .lock()
            .unwrap()
            .get(shard)
            .is_some_and(|t| *t > since)
    }

    /// Waits (checking every 50 ms of simulated time) until `done` holds; returns the
    /// time since the fleet started, or `None` once `limit` has passed **since the fleet
    /// started** (a deadline on the fleet's clock: called after `limit`, it checks once).
    /// To wait a span from now, use [`Running::within`].
    pub async fn until(
        &self,
        limit: Duration,
        done: impl FnMut(&Self) -> bool,
    ) -> Option<Duration> {
        self.until_deadline(self.started + limit, done).await
    }

    /// Waits (checking every 50 ms of simulated time) until `done` holds, for at most
    /// `limit` from now; returns the time since the fleet started, or `None` after
    /// `limit`. For a phase that starts after others, whatever they took.
    pub async fn within(
        &self,
        limit: Duration,
        done: impl FnMut(&Self) -> bool,
    ) -> Option<Duration> {
        self.until_deadline(Instant::now() + limit, done).await
    }

    async fn until_deadline(
        &self,
        deadline: Instant,
        mut done: impl FnMut(&Self) -> bool,
    ) -> Option<Duration> {
        loop {
            if done(self) {
                return Some(self.started.elapsed());
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Changes the data size of each shard's records from the next feed on (see
    /// [`Fleet::record_sizes`]).
    pub fn set_record_sizes(&mut self, sizes: Vec<usize>) {
        for (i, record) in self.records.lock().unwrap().iter_mut().enumerate() {
            record.data = record_of(Some(&sizes), i);
        }
        self.fleet.record_sizes = Some(sizes);
    }

    /// Each worker's load as the lease table shows it: the sum of `throughputKBps` over
    /// the leases it owns (worker id -> KiB/s); workers without a measured lease are
    /// absent.
    pub fn table_loads(&self) -> BTreeMap<String, f64> {
        let mut loads = BTreeMap::new();
        for row in self.memory.table(GROUP).rows() {
            if let (Some(owner), Some(kbps)) = (row.owner, row.throughput_kbps) {
                *loads.entry(owner).or_default() += kbps;
            }
        }
        loads
    }

    /// The most loaded live worker's load over the mean load of the live workers, by
    /// the loads the feed puts (each shard's record size, see [`Fleet::record_sizes`])
    /// and the owners the table names; `None` while a shard has no owner.
    pub fn load_ratio(&self) -> Option<f64> {
        let size: HashMap<&str, usize> = self
            .shard_ids
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let sizes = self.fleet.record_sizes.as_deref();
                (
                    id.as_str(),
                    sizes.and_then(|s| s.get(i)).copied().unwrap_or(1).max(1),
                )
            })
            .collect();
        let mut loads: BTreeMap<String, f64> = BTreeMap::new();
        for row in self.memory.table(GROUP).rows() {
            let owner = row.owner?;
            *loads.entry(owner).or_default() += *size.get(row.key.as_str())? as f64;
        }
        if loads.is_empty() {
            return None;
        }
        let workers = self.live().max(loads.len());
        let mean = loads.values().sum::<f64>() / workers as f64;
        let max = loads.values().copied().fold(0.0, f64::max);
        Some(max / mean)
    }

    /// The owner of each lease, as the table names it (lease key -> owner).
    pub fn owners(&self) -> BTreeMap<String, Option<String>> {
        self.memory
            .table(GROUP)
            .rows()
            .into_iter()
            .map(|r| (r.key, r.owner))
            .collect()
    }

    /// Stops putting records (see [`Fleet::feed_every`]).
    pub fn stop_feed(&mut self) {
        if let Some(feed) = self.feed.take() {
            feed.abort();
        }
    }

    /// Whether every record put so far was handled at least once.
    pub fn all_handled(&self) -> bool {
        self.handled.lock().unwrap().len() == *self.put.lock().unwrap()
    }

    /// Records handled more than once: (shard, sequence number, times).
    pub fn duplicates(&self) -> Vec<(String, String, usize)> {
        let mut twice: Vec<_> = self
            .handled
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|((shard, seq), n)| (shard.clone(), seq.clone(), *n))
            .collect();
        twice.sort();
        twice
    }

    /// Stops every worker gracefully.
    pub async fn stop(mut self) {
        self.stop_feed();
        for worker in &self.workers {
            worker.shutdown.shutdown();
        }
        for Worker { id, task, dead, .. } in self.workers {
            if dead.load(Ordering::SeqCst) {
                task.abort();
                continue;
            }
            match task.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("worker {id} failed: {e}"),
                Err(e) => panic!("worker {id} panicked: {e}"),
            }
        }
    }
}
