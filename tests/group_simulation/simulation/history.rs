//! The switchable features of a generated history.
//!
//! `SHARDFLOW_SIM_FEATURES` picks them: unset or `default` = [`DEFAULT_FEATURES`] (what
//! the library passes), `all` = every feature, or a comma-separated list of names
//! where `+name` / `-name` add to / remove from the default set (`latest,hung-calls`
//! alone means exactly those).

use std::fmt;

/// One switchable part of the generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Feature {
    /// Splits and merges of the stream's first shards (children of generation 1),
    /// records written in every generation.
    Reshard,
    /// Reshards of children too: 3+ generations.
    DeepReshard,
    /// 1 → 2 → 1: a split whose two children are merged back.
    MergeBack,
    /// Initial position LATEST.
    Latest,
    /// Initial position AT_TIMESTAMP (with closed shards at the first sync).
    AtTimestamp,
    /// Workers killed: no drain, no release, none of their calls lands again.
    Kill,
    /// Workers frozen past their lease, then woken.
    Freeze,
    /// A gone worker (left or killed) restarted under the same id.
    RestartSameId,
    /// A worker started under the id of a frozen one (two live processes, one id).
    SameIdWhileAlive,
    /// Consumers in `stream()` mode that ack out of order.
    StreamMode,
    /// Stream-mode consumers that nack.
    StreamNack,
    /// Stream-mode consumers that drop a batch (then leave).
    StreamDrop,
    /// Stream-mode consumers that `ack_through` part of a batch (then ack it whole),
    /// or a position past the batch (a user mistake the library must clamp).
    StreamAckThrough,
    /// A `run`-mode worker whose `Run` future is dropped (not shut down): it must stop.
    DropRun,
    /// PutRecords lands, then the caller sees an error.
    AmbiguousPut,
    /// Lease writes land, then the caller sees an error (memory backend fault).
    AmbiguousLease,
    /// GetRecords pages without a next iterator on any shard, closed ones too.
    MissingNextIteratorAnywhere,
    /// ListShards answers that omit a shard once or repeat an old list.
    StaleListShards,
    /// Calls that never return (cut by the wrapper's generous cap).
    HungCalls,
    /// `run`-mode handlers that hang on a chosen record: for a while (then finish), or
    /// for good (then their worker is killed).
    HungHandler,
    /// Run-mode handlers that panic on about one record in 50, twice, then handle it.
    HandlerPanics,
    /// `on_event` hooks that panic on every event (every other worker).
    HookPanics,
    /// Several workers go at once: the first, the last or random k by name (k from 2 to
    /// all but one) crash together or stop gracefully together (a host, a zone, a
    /// rolling deploy).
    CorrelatedCrashes,
    /// A lease row stops parsing for a while (an attribute written in the wrong form),
    /// then is repaired: nobody takes or overwrites it meanwhile, its children wait.
    UnreadableRows,
    /// Checkpoint resets requested on the rows of shards a reshard just closed, while
    /// their owners still read them: applied by the owner or, once the shard ended, by
    /// whoever lists the finished row.
    ResetAtShardEnd,
    /// A process freeze in the middle of handling: records arrive, and while a worker
    /// handles them (handlers then take a few milliseconds per record) it stops for a
    /// drawn time, from half a lease to three, then resumes. Its calls and handler calls
    /// wait at its gate meanwhile; its lease calls keep the longest deadline the
    /// configuration allows, so it often resumes after another worker took its lease
    /// but before it noticed (the zombie's window).
    ProcessFreeze,
    /// `run`-mode workers with `Concurrency::PerKey` (2..16 per shard), a handler that
    /// takes 0..20 ms and fails the first attempt of about one record in 40.
    PerKeyConcurrency,
    /// Workers in multi-stream mode (`.streams([..])`) on the one stream: lease keys
    /// `account:stream:creationEpoch:shardId` through one stream's view of the table.
    MultiStreamKeys,
    /// `run_batches` workers (half of the run-mode ones) whose bulk handler fails every
    /// call that holds a poison record (about one in 30), under a `Bisect` layer whose
    /// dead-letter sink refuses each poison record once: every record of a batch is
    /// handled or dead-lettered exactly once per delivery, none skipped.
    PoisonBatches,
    /// Every worker's wall clock off by a drawn amount, up to 90 s ahead or behind
    /// (see `simulation/clock_skew.rs`): LATEST's start must skip nothing all the same.
    ClockSkew,
    /// Workers balance by throughput (`BalanceBy::Throughput`); each shard carries a
    /// load of its own, drawn from a Zipf distribution (s = 1.2) by a generator seeded
    /// from the history's seed, and the load shifts during the history (the hottest
    /// shard cools, the coldest heats), so the plan moves leases while records flow and
    /// faults happen. Checked: no record is handled again across a planned hand-off.
    SkewedLoad,
    /// The workers read a table's change stream (`.table_stream(..)` on the embedded
    /// backend's tables) instead of a Kinesis stream: the history writes items (put,
    /// update, delete on a set of keys, often a few hot ones, so some shards stay open
    /// and empty for long stretches); the stream rolls over many times per history and
    /// some partitions split; the whole group is suspended past the 15-minute iterator
    /// lifetime (it must come back through fresh iterators from its positions), and in
    /// about half the histories a day passes meanwhile (the simulated wall clock jumps
    /// 24 hours), so the stream's 24 h retention trims every older record and rollovers
    /// drop the shards that closed before. Checked beside the invariants of every
    /// history: parent-first and per-item order (see `invariants.rs`). The Kinesis-only
    /// features are left out with it: see [`NOT_WITH_TABLE_STREAM`].
    TableStream,
}

/// The features a table-stream history leaves out, and why.
pub const NOT_WITH_TABLE_STREAM: &[(Feature, &str)] = &[
    (
        Feature::Reshard,
        "a table's stream is not resharded: it rolls over and its partitions split instead",
    ),
    (Feature::DeepReshard, "the same: no Kinesis reshards"),
    (Feature::MergeBack, "DynamoDB Streams never merges shards"),
    (
        Feature::AmbiguousPut,
        "items are written to the table, not put through PutRecords",
    ),
    (
        Feature::MultiStreamKeys,
        "a table's stream is read by a single-stream consumer (the builder refuses both)",
    ),
    (
        Feature::SkewedLoad,
        "its feed writes by explicit hash key, which a table's shards do not have",
    ),
];

impl Feature {
    pub const ALL: [Feature; 32] = [
        Feature::Reshard,
        Feature::DeepReshard,
        Feature::MergeBack,
        Feature::Latest,
        Feature::AtTimestamp,
        Feature::Kill,
        Feature::Freeze,
        Feature::RestartSameId,
        Feature::SameIdWhileAlive,
        Feature::StreamMode,
        Feature::StreamNack,
        Feature::StreamDrop,
        Feature::StreamAckThrough,
        Feature::DropRun,
        Feature::AmbiguousPut,
        Feature::AmbiguousLease,
        Feature::MissingNextIteratorAnywhere,
        Feature::StaleListShards,
        Feature::HungCalls,
        Feature::HungHandler,
        Feature::HandlerPanics,
        Feature::HookPanics,
        Feature::CorrelatedCrashes,
        Feature::UnreadableRows,
        Feature::ResetAtShardEnd,
        Feature::ProcessFreeze,
        Feature::PerKeyConcurrency,
        Feature::MultiStreamKeys,
        Feature::PoisonBatches,
        Feature::ClockSkew,
        Feature::SkewedLoad,
        Feature::TableStream,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Feature::Reshard => "reshard",
            Feature::DeepReshard => "deep-reshard",
            Feature::MergeBack => "merge-back",
            Feature::Latest => "latest",
            Feature::AtTimestamp => "at-timestamp",
            Feature::Kill => "kill",
            Feature::Freeze => "freeze",
            Feature::RestartSameId => "restart-same-id",
            Feature::SameIdWhileAlive => "same-id-while-alive",
            Feature::StreamMode => "stream-mode",
            Feature::StreamNack => "stream-nack",
            Feature::StreamDrop => "stream-drop",
            Feature::StreamAckThrough => "stream-ack-through",
            Feature::DropRun => "drop-run",
            Feature::AmbiguousPut => "ambiguous-put",
            Feature::AmbiguousLease => "ambiguous-lease",
            Feature::MissingNextIteratorAnywhere => "missing-next-iterator-anywhere",
            Feature::StaleListShards => "stale-list-shards",
            Feature::HungCalls => "hung-calls",
            Feature::HungHandler => "hung-handler",
            Feature::HandlerPanics => "handler-panics",
            Feature::HookPanics => "hook-panics",
            Feature::CorrelatedCrashes => "correlated-crashes",
            Feature::UnreadableRows => "unreadable-rows",
            Feature::ResetAtShardEnd => "reset-at-shard-end",
            Feature::ProcessFreeze => "process-freeze",
            Feature::PerKeyConcurrency => "per-key-concurrency",
            Feature::MultiStreamKeys => "multi-stream-keys",
            Feature::PoisonBatches => "poison-batches",
            Feature::ClockSkew => "clock-skew",
            Feature::SkewedLoad => "skewed-load",
            Feature::TableStream => "table-stream",
        }
    }
}

/// The features on by default: every one but `per-key-concurrency`,
/// `multi-stream-keys`, `poison-batches`, `clock-skew`, `skewed-load` and `table-stream`
/// (the last six of [`Feature::ALL`]), which their own tests run, so the default
/// histories stay those the seeds always named.
pub const DEFAULT_FEATURES: &[Feature] = Feature::ALL.split_at(Feature::ALL.len() - 6).0;

/// A set of features.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Features(u32);

impl Features {
    pub fn of(list: &[Feature]) -> Self {
        Features(list.iter().fold(0, |m, f| m | 1 << *f as u32))
    }

    pub fn has(self, f: Feature) -> bool {
        self.0 & (1 << f as u32) != 0
    }

    /// The features a history really runs: with `table-stream`, those of
    /// [`NOT_WITH_TABLE_STREAM`] are off.
    pub fn effective(self) -> Self {
        if !self.has(Feature::TableStream) {
            return self;
        }
        NOT_WITH_TABLE_STREAM
            .iter()
            .fold(self, |set, (f, _)| set.with(*f, false))
    }

    fn with(self, f: Feature, on: bool) -> Self {
        if on {
            Features(self.0 | 1 << f as u32)
        } else {
            Features(self.0 & !(1 << f as u32))
        }
    }

    /// Parses `SHARDFLOW_SIM_FEATURES` (see the module docs).
    pub fn parse(spec: &str) -> Result<Self, String> {
        let spec = spec.trim();
        if spec.is_empty() || spec == "default" {
            return Ok(Features::of(DEFAULT_FEATURES));
        }
        if spec == "all" {
            return Ok(Features::of(&Feature::ALL));
        }
        let items: Vec<&str> = spec.split(',').map(str::trim).collect();
        let relative = items
            .iter()
            .all(|i| i.starts_with('+') || i.starts_with('-'));
        let mut set = if relative {
            Features::of(DEFAULT_FEATURES)
        } else {
            Features(0)
        };
        for item in items {
            let (on, name) = match item.strip_prefix('-') {
                Some(n) => (false, n),
                None => (true, item.trim_start_matches('+')),
            };
            let f = Feature::ALL
                .into_iter()
                .find(|f| f.name() == name)
                .ok_or_else(|| format!("unknown simulation feature {name:?}"))?;
            set = set.with(f, on);
        }
        Ok(set)
    }

    pub fn from_env() -> Self {
        match std::env::var("SHARDFLOW_SIM_FEATURES") {
            Ok(spec) => Features::parse(&spec).unwrap_or_else(|e| panic!("{e}")),
            Err(_) => Features::of(DEFAULT_FEATURES),
        }
    }
}

impl fmt::Display for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = Feature::ALL
            .into_iter()
            .filter(|x| self.has(*x))
            .map(Feature::name)
            .collect();
        f.write_str(&names.join(","))
    }
}
