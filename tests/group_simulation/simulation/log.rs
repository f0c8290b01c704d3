//! What happened during one history, on one global clock of events (ticks), so that
//! "handled before checkpointed" and "delivered in order within a tenure" can be checked.

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use tokio::time::Instant;

use shardflow::lease::Checkpoint;
use shardflow::{Message, SequenceNumber};

/// A record reaching a handler (run mode) or the caller (stream mode), or being
/// handled (run mode: the handler ran; stream mode: the batch was acknowledged).
#[derive(Clone, Debug)]
pub struct Event {
    pub at: u64,
    /// When the library handed the record over: the tick of the handler call that
    /// received it (run mode: a call held at a frozen gate receives it when it started),
    /// else `at`.
    pub handed: u64,
    pub incarnation: String,
    pub shard: String,
    pub sequence: SequenceNumber,
    pub partition_key: String,
}

/// A take (or hand-over) that landed in the store.
#[derive(Clone, Debug)]
pub struct Take {
    pub at: u64,
    pub time: SystemTime,
    pub key: String,
    pub owner: String,
    /// The lease moved from another owner while its checkpoint was still a sentinel.
    pub before_first_checkpoint: bool,
    /// The incarnation that wrote the take when it was the lease's previous owner
    /// handing it over (a planned hand-off: drained and checkpointed first), rather
    /// than the new owner taking it (a free, expired or overdue lease).
    pub handed_over_by: Option<String>,
}

/// A checkpoint write that landed in the store.
#[derive(Clone, Debug)]
pub struct Commit {
    pub at: u64,
    /// The lease owner the write was fenced on.
    pub worker: String,
    pub incarnation: String,
    pub key: String,
    pub counter: u64,
    pub checkpoint: Checkpoint,
    /// The write landed but its caller saw an error.
    pub ambiguous: bool,
}

/// The time of day at which every history starts on the simulated wall clock, in
/// seconds after the Unix epoch (a day in 2026).
pub const SIM_EPOCH_SECS: u64 = 1_780_000_000;

/// What the 24 h trim of a table's stream (feature `table-stream`) removed: every record
/// that arrived before `cutoff`, and the shards and records there were then (rollovers
/// afterwards drop the shards that closed before the cutoff).
#[derive(Clone, Debug)]
pub struct Trim {
    /// Records that arrived before it are past retention.
    pub cutoff: SystemTime,
    /// The tick of the trim: a record no handler finished by then is gone.
    pub at: u64,
    /// Every record of every shard at the trim: (shard, sequence number, arrival).
    pub records: Vec<(String, SequenceNumber, Option<SystemTime>)>,
    /// The records past retention that no handler had finished: the only records a
    /// history may leave unhandled (they were trimmed before anyone handled them).
    pub unread: HashSet<(String, SequenceNumber)>,
}

#[derive(Default)]
pub struct Log {
    ticks: AtomicU64,
    /// The stream the group reads (a table's stream ARN with feature `table-stream`);
    /// unset: the Kinesis stream [`super::STREAM`].
    stream: OnceLock<String>,
    /// How far the simulated wall clock was moved ahead (a day passing while the group
    /// is suspended, feature `table-stream`), in milliseconds.
    wall_jump: AtomicU64,
    /// The trim of a table's stream, once it happened.
    pub trim: Mutex<Option<Trim>>,
    /// The parents of every shard the history saw, removed ones too.
    pub parents: Mutex<HashMap<String, Vec<String>>>,
    /// GetRecords calls refused because their iterator was older than the stream's
    /// iterator lifetime (not the injected expiries).
    pub expired_iterators: AtomicU64,
    /// The handlers' downstream is down (feature `table-stream`): no progress is due.
    pub outage: std::sync::atomic::AtomicBool,
    /// When the history started on tokio's clock (set by [`Log::start`]): the trace's
    /// timestamps are simulated time since then.
    origin: OnceLock<Instant>,
    /// The ordered history a replay must repeat exactly, one line an event, each with
    /// its simulated time: handler calls and handled records, lease takes, renewals,
    /// checkpoints, refusals, resets and deletions that landed, and the generator's
    /// notes. See [`Log::digest`].
    pub trace: Mutex<Vec<String>>,
    /// Handler calls as the library started them (before the handler's own gate): a
    /// record (run mode), a batch (`run_batches`, stream mode: handed out).
    pub calls: Mutex<Vec<Event>>,
    /// The lease owner name of each incarnation (worker id and nonce).
    pub owners: Mutex<HashMap<String, String>>,
    pub delivered: Mutex<Vec<Event>>,
    pub handled: Mutex<Vec<Event>>,
    pub takes: Mutex<Vec<Take>>,
    pub commits: Mutex<Vec<Commit>>,
    pub hung: AtomicU64,
    pub stale_lists: AtomicU64,
    pub missing_iterators: AtomicU64,
    pub ambiguous_puts: AtomicU64,
    pub nacks: AtomicU64,
    pub dropped_batches: AtomicU64,
    pub history: Mutex<Vec<String>>,
    /// Incarnations whose `Run` was dropped, with the tick by which they must have
    /// stopped delivering.
    pub dropped_runs: Mutex<Vec<(String, u64)>>,
    /// Lease rows deleted (finished shards cleaned up).
    pub deleted: Mutex<std::collections::HashSet<String>>,
    /// Takes, renewals and checkpoint writes the store's fencing refused: (tick,
    /// incarnation).
    pub refused: Mutex<Vec<(u64, String)>>,
    /// When a record of each shard was last handled.
    pub last_handled: Mutex<HashMap<String, Instant>>,
    /// When a hung `GetShardIterator` call on each shard last ended (cut by the worker's
    /// read call timeout, or by the simulation).
    pub hung_reads_ended: Mutex<HashMap<String, Instant>>,
    /// (incarnation, shard) pairs reported stuck and not yet unstuck.
    pub stuck: Mutex<HashSet<(String, String)>>,
    /// Stuck events sent, over the history.
    pub stuck_events: AtomicU64,
    /// Handlers that hung on a record.
    pub hung_handlers: AtomicU64,
    /// Checkpoint resets that landed (an operator's, applied): (tick, shard). The
    /// checkpoint may move back at one.
    pub resets: Mutex<Vec<(u64, String)>>,
    /// Batch-mode deliveries whose records were not each handled or dead-lettered
    /// exactly once (none skipped): what went wrong.
    pub poison_violations: Mutex<Vec<String>>,
    /// Records dead-lettered by batch-mode workers.
    pub dead_lettered: AtomicU64,
    /// Batch-mode calls that returned `Ok` after dead-lettering.
    pub bisected_batches: AtomicU64,
}

impl Log {
    pub fn tick(&self) -> u64 {
        self.ticks.fetch_add(1, Ordering::SeqCst)
    }

    /// Starts the trace's clock at tokio's now (the first call wins).
    pub fn start(&self) {
        self.origin.get_or_init(Instant::now);
    }

    /// Simulated time since [`Log::start`].
    pub fn elapsed(&self) -> Duration {
        self.origin.get_or_init(Instant::now).elapsed()
    }

    /// The simulated wall clock: [`SIM_EPOCH_SECS`] after the Unix epoch plus the
    /// simulated time since [`Log::start`]. The embedded backend stamps arrivals with it
    /// and the workers read it (shifted by their skew), so no time of day comes from the
    /// host and a seed replays exactly.
    pub fn wall_time(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH
            + Duration::from_secs(SIM_EPOCH_SECS)
            + self.elapsed()
            + Duration::from_millis(self.wall_jump.load(Ordering::SeqCst))
    }

    /// Moves the simulated wall clock `by` ahead (for everyone: the service and the
    /// workers), as after a day passed.
    pub fn jump_wall_clock(&self, by: Duration) {
        self.wall_jump
            .fetch_add(by.as_millis() as u64, Ordering::SeqCst);
    }

    /// The stream the group reads.
    pub fn stream(&self) -> &str {
        self.stream.get().map_or(super::STREAM, String::as_str)
    }

    /// Sets the stream the group reads (once, before any worker starts).
    pub fn set_stream(&self, stream: String) {
        let _ = self.stream.set(stream);
    }

    /// Appends one event to the trace, stamped with the simulated time.
    pub fn trace(&self, line: std::fmt::Arguments<'_>) {
        let at = self.elapsed().as_micros();
        self.trace.lock().unwrap().push(format!("{at:>12} {line}"));
    }

    /// A hash of the whole trace, in order: two runs of one seed must give the same.
    pub fn digest(&self) -> u64 {
        // `DefaultHasher::new()` has fixed keys: the same lines give the same digest.
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        self.trace.lock().unwrap().hash(&mut hasher);
        hasher.finish()
    }

    fn event(&self, incarnation: &str, msg: &Message) -> Event {
        let at = self.tick();
        Event {
            at,
            handed: at,
            incarnation: incarnation.to_owned(),
            shard: msg.metadata.shard_id.to_string(),
            sequence: msg.metadata.sequence_number.clone(),
            partition_key: msg.metadata.partition_key.clone(),
        }
    }

    fn trace_event(&self, what: &str, e: &Event) {
        self.trace(format_args!(
            "{what} {} {} {}",
            e.incarnation, e.shard, e.sequence
        ));
    }

    /// The library starts a handler call on `msg` (the first record of a batch).
    pub fn call(&self, incarnation: &str, msg: &Message) -> u64 {
        let e = self.event(incarnation, msg);
        self.trace_event("call", &e);
        let at = e.at;
        self.calls.lock().unwrap().push(e);
        at
    }

    /// [`Log::deliver`] of a record whose handler call started at tick `called`.
    pub fn deliver_called(&self, incarnation: &str, msg: &Message, called: u64) {
        let mut e = self.event(incarnation, msg);
        e.handed = called;
        self.trace_event("deliver", &e);
        self.delivered.lock().unwrap().push(e);
    }

    pub fn deliver(&self, incarnation: &str, msg: &Message) {
        let e = self.event(incarnation, msg);
        self.trace_event("deliver", &e);
        self.delivered.lock().unwrap().push(e);
    }

    pub fn handle(&self, incarnation: &str, msg: &Message) {
        let e = self.event(incarnation, msg);
        self.trace_event("handle", &e);
        self.last_handled
            .lock()
            .unwrap()
            .insert(e.shard.clone(), Instant::now());
        self.handled.lock().unwrap().push(e);
    }

    /// One line of the history, printed when a seed fails.
    pub fn note(&self, line: String) {
        self.trace(format_args!("note {line}"));
        self.history.lock().unwrap().push(line);
    }
}
