//! Consumer-group coordination: a [`Lease`] per shard in a [`LeaseStore`] (DynamoDB in
//! [`dynamo::DynamoLeaseStore`], memory in [`crate::memory::MemoryLeaseStore`]).
//!
//! A lease row names the shard (`leaseKey`), its owner (`leaseOwner`), a counter the
//! owner bumps on every renewal (`leaseCounter`, the fencing token), and the shard's
//! checkpoint. Every write of the owner or checkpoint is conditional on the owner and
//! counter the writer last saw, so a worker that lost a lease can never move its
//! checkpoint. (A worker withdrawing its own hand-off request is conditional on that
//! request alone.)

pub mod dynamo;
pub mod entity;
mod held;
pub mod leader;
pub(crate) mod meter;
mod scoped;

pub use entity::{EntityKind, EntityRow, RowKind};
pub(crate) use held::{with_retries, HeldLease};
pub use leader::{CoordinatorState, LeaderItem, LEADER_KEY};
pub(crate) use scoped::{OneTableStream, SharedListing, StreamScopedStore};

use crate::error::ErrorDetail;
use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use crate::sequence::{Position, SequenceNumber};

/// How far before the moment LATEST is resolved its durable start lies, for clock
/// skew between this host and Kinesis' arrival timestamps (a few extra records, never a
/// gap).
pub const LATEST_CLOCK_MARGIN: Duration = Duration::from_secs(2);

/// The fewest digits a sequence number is stored with in the `checkpoint` attribute:
/// DynamoDB Streams' sequence numbers are 21 to 40 digits and its API refuses shorter
/// ones, so a number read with leading zeros (DynamoDB Local writes them) goes back as
/// it came. Kinesis' numbers are always longer, so they are stored as they are.
pub(crate) const MIN_CHECKPOINT_DIGITS: usize = 21;

/// How far a shard has been handled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Checkpoint {
    /// Nothing handled yet; start at the oldest retained record.
    TrimHorizon,
    /// Nothing handled yet; start at the tip of the shard. Only ever in a row nobody
    /// took yet: the first owner resolves it into [`Checkpoint::AtTimestamp`] of the
    /// moment it took the lease (see [`crate::InitialPosition::Latest`]).
    Latest,
    /// Nothing handled yet; start at the records that arrived at or after this time
    /// (the `AT_TIMESTAMP` sentinel plus our `checkpointTimestamp` attribute). `None`
    /// (a KCL row, which keeps the time in its config) means the consumer's configured
    /// timestamp; the first owner writes it into the row.
    AtTimestamp(Option<SystemTime>),
    /// Every record up to and including this position is handled.
    At(Position),
    /// The shard is closed and every record of it is handled.
    ShardEnd,
}

impl Checkpoint {
    /// The KCL's string form of the `checkpoint` attribute: a sentinel or the digits
    /// (at least [`MIN_CHECKPOINT_DIGITS`] of them, zero-padded).
    pub(crate) fn as_attribute(&self) -> (String, u64) {
        match self {
            Checkpoint::TrimHorizon => ("TRIM_HORIZON".into(), 0),
            Checkpoint::Latest => ("LATEST".into(), 0),
            Checkpoint::AtTimestamp(_) => ("AT_TIMESTAMP".into(), 0),
            Checkpoint::ShardEnd => ("SHARD_END".into(), 0),
            Checkpoint::At(p) => (
                format!(
                    "{:0>width$}",
                    p.sequence.as_str(),
                    width = MIN_CHECKPOINT_DIGITS
                ),
                p.sub_sequence,
            ),
        }
    }

    /// Parses the `checkpoint` and `checkpointSubSequenceNumber` attributes.
    pub(crate) fn from_attribute(value: &str, sub_sequence: u64) -> Result<Self, LeaseError> {
        Ok(match value {
            "TRIM_HORIZON" => Checkpoint::TrimHorizon,
            "LATEST" => Checkpoint::Latest,
            "AT_TIMESTAMP" => Checkpoint::AtTimestamp(None),
            "SHARD_END" => Checkpoint::ShardEnd,
            digits => Checkpoint::At(Position::new(
                SequenceNumber::from_str(digits)
                    .map_err(|e| LeaseError::Corrupt(format!("checkpoint {digits:?}: {e}")))?,
                sub_sequence,
            )),
        })
    }

    /// The durable start that `InitialPosition::Latest` resolves to when resolved at
    /// `now`: AT_TIMESTAMP of `now` less [`LATEST_CLOCK_MARGIN`], in whole milliseconds
    /// as the lease table stores them.
    pub fn latest_from(now: SystemTime) -> Self {
        let since = now
            .checked_sub(LATEST_CLOCK_MARGIN)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let at = Checkpoint::AtTimestamp(Some(since));
        let millis = at.timestamp_millis();
        at.with_timestamp_millis(millis)
    }

    /// The `checkpointTimestamp` attribute: epoch milliseconds of an
    /// [`Checkpoint::AtTimestamp`] start, if it has one.
    pub(crate) fn timestamp_millis(&self) -> Option<u64> {
        match self {
            Checkpoint::AtTimestamp(Some(t)) => Some(
                t.duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            ),
            _ => None,
        }
    }

    /// Adds the `checkpointTimestamp` attribute (epoch milliseconds) to a parsed
    /// `AT_TIMESTAMP` sentinel; any other checkpoint ignores it.
    pub(crate) fn with_timestamp_millis(self, millis: Option<u64>) -> Self {
        match (self, millis) {
            (Checkpoint::AtTimestamp(_), Some(ms)) => Checkpoint::AtTimestamp(
                SystemTime::UNIX_EPOCH.checked_add(Duration::from_millis(ms)),
            ),
            (other, _) => other,
        }
    }

    /// How far this checkpoint is along the shard, where that is known: every start
    /// sentinel is before every record, records are ordered by position, and
    /// SHARD_END is after them all. Two different start sentinels are not ordered.
    pub fn progress_cmp(&self, other: &Checkpoint) -> Option<Ordering> {
        fn rank(c: &Checkpoint) -> u8 {
            match c {
                Checkpoint::TrimHorizon | Checkpoint::Latest | Checkpoint::AtTimestamp(_) => 0,
                Checkpoint::At(_) => 1,
                Checkpoint::ShardEnd => 2,
            }
        }
        match (self, other) {
            (Checkpoint::At(a), Checkpoint::At(b)) => Some(a.cmp(b)),
            _ if self == other => Some(Ordering::Equal),
            _ if rank(self) == 0 && rank(other) == 0 => None,
            _ => Some(rank(self).cmp(&rank(other))),
        }
    }

    /// Whether the record at `position` is already covered (handled) by this checkpoint.
    pub fn covers(&self, position: &Position) -> bool {
        match self {
            Checkpoint::At(p) => position <= p,
            Checkpoint::ShardEnd => true,
            _ => false,
        }
    }
}

impl fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpoint::At(p) => write!(f, "{p}"),
            Checkpoint::AtTimestamp(Some(_)) => {
                write!(
                    f,
                    "AT_TIMESTAMP({} ms)",
                    self.timestamp_millis().unwrap_or(0)
                )
            }
            other => f.write_str(&other.as_attribute().0),
        }
    }
}

/// Separates the worker id from the incarnation's nonce in `leaseOwner`.
pub(crate) const INCARNATION_SEPARATOR: char = '#';

/// The worker id inside an owner: `leaseOwner` names a process incarnation,
/// `<worker id>#<nonce>` (e.g. `billing-7#k3f9a2`), so a restarted process that keeps
/// its name is a new owner. An owner without a nonce (a KCL worker) is its own worker id.
/// Part of the operating API (see [`crate::admin`]): tools that show who holds what
/// group a table's owners by worker with it.
pub fn worker_of(owner: &str) -> &str {
    owner
        .rsplit_once(INCARNATION_SEPARATOR)
        .map_or(owner, |(worker, _)| worker)
}

/// The owner name of one incarnation of `worker`: the worker id and a nonce of six
/// base-36 characters drawn from the operating system's generator. Never from a
/// configured seed: two processes started with the same worker id and the same seed
/// must still be two owners, or both would read and checkpoint the same shards (a
/// simulation names each incarnation's nonce itself, see
/// [`ConsumerBuilder::owner_nonce`](crate::ConsumerBuilder::owner_nonce)).
pub(crate) fn incarnation(worker: &str) -> String {
    use rand::Rng;
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut rng = rand::rngs::OsRng;
    let nonce: String = (0..6)
        .map(|_| char::from(DIGITS[rng.gen_range(0..DIGITS.len())]))
        .collect();
    format!("{worker}{INCARNATION_SEPARATOR}{nonce}")
}

/// What a take by `new_owner` adds to `ownerSwitchesSinceCheckpoint`: one when the
/// lease changes hands, none when it was unowned or is taken back (the KCL's rule).
pub(crate) fn owner_switch(expected: &Lease, new_owner: &str) -> u64 {
    u64::from(expected.owner.as_deref().is_some_and(|o| o != new_owner))
}

/// One shard's lease row.
#[derive(Clone, Debug, PartialEq)]
pub struct Lease {
    /// The shard id (`leaseKey`). In a multi-stream table the key is the KCL's
    /// `account:stream:creationEpoch:shardId` (see
    /// [`StreamIdentity`](crate::kinesis::StreamIdentity)); a stream's coordinator sees
    /// its rows under the bare shard id.
    pub key: String,
    /// The worker incarnation holding it (`leaseOwner`, see [`worker_of`]), if any.
    pub owner: Option<String>,
    /// Bumped by every renewal, take and release (`leaseCounter`): the fencing token.
    pub counter: u64,
    /// How far the shard has been handled.
    pub checkpoint: Checkpoint,
    /// The shard's parents (`parentShardId`): it is read only after they reach SHARD_END.
    pub parents: Vec<String>,
    /// A worker that wants this lease and asks the owner to hand it over (`pendingOwner`):
    /// the owner drains, checkpoints and hands the lease to it, as long as the request
    /// stands (a stopping worker withdraws its requests).
    pub pending_owner: Option<String>,
    /// The stream the shard belongs to (`streamName`, shardflow's): every row shardflow
    /// creates carries it, so a consumer of another stream pointed at the same table is
    /// refused at start-up. `None` in a row the KCL wrote (accepted as ours). In a
    /// multi-stream table, the KCL's stream identifier `account:stream:creationEpoch`.
    pub stream: Option<String>,
    /// The shard's hash-key range, lowest and highest (`startingHashKey`,
    /// `endingHashKey`, decimal strings as the KCL writes them), where known.
    pub hash_range: Option<(u128, u128)>,
    /// The shard's children (`childShardIds`), as the KCL records them when a shard
    /// ends; shardflow reads them back but finds children through ListShards.
    pub children: Vec<String>,
    /// Owner changes since the last checkpoint (`ownerSwitchesSinceCheckpoint`): a take
    /// from another owner adds one, a checkpoint resets it, as in the KCL.
    pub owner_switches: u64,
    /// The KCL 3 worker still processing the shard during a graceful hand-off to
    /// `owner` (`checkpointOwner`). shardflow never sets it; a take removes it.
    pub checkpoint_owner: Option<String>,
    /// A checkpoint reset requested by an operator (`resetCheckpoint`, shardflow's; see
    /// [`crate::admin`]): the owner stops the shard, drains, stores this checkpoint and
    /// lets the shard be read again from it. Kept by takes, so a new owner applies it.
    pub reset_to: Option<Checkpoint>,
    /// When the checkpoint was last written (`checkpointedAt`, shardflow's, epoch
    /// milliseconds of the writer's clock): set by every checkpoint write and reset,
    /// with the write itself. `None` until the first one, and in a row the KCL wrote.
    /// An idle shard has nothing to commit, so its time stays put while the shard is
    /// healthy: read it together with the shard's lag (see `docs/metrics.md`).
    pub checkpointed_at: Option<SystemTime>,
    /// The shard's recent throughput as its owner measured it (`throughputKBps`, the
    /// KCL 3's attribute with the KCL 3's meaning): KiB (1,024 bytes) of record data
    /// read per second, smoothed over the renewal intervals (see
    /// [`BalanceBy::Throughput`](crate::consumer::BalanceBy::Throughput)). Written by
    /// the owner's renewals once it has read from the shard, kept by every other
    /// write; `None` until an owner measured it. Never negative, never NaN (a row
    /// with such a value does not parse).
    pub throughput_kbps: Option<f64>,
    /// `Some(reason)`: a row exists under this key but does not parse (an attribute of
    /// the wrong type or form, written by hand or by another tool). Only `key` is
    /// meaningful then; the other fields are placeholders. Such a row is never taken,
    /// renewed, overwritten or deleted (every store refuses a write conditioned on it
    /// with [`LeaseError::Corrupt`]), its children wait for it as for an unfinished
    /// parent, and workers report it in their health until it is repaired.
    pub unreadable: Option<String>,
}

// Equality is total: `throughput_kbps`, the one float, is never NaN (the codec refuses
// such a row, and a measured rate is a finite quotient of counts).
impl Eq for Lease {}

impl Lease {
    /// A new, unowned lease for a shard, starting at `checkpoint`.
    pub fn new(key: impl Into<String>, parents: Vec<String>, checkpoint: Checkpoint) -> Self {
        Lease {
            key: key.into(),
            owner: None,
            counter: 0,
            checkpoint,
            parents,
            pending_owner: None,
            stream: None,
            hash_range: None,
            children: Vec::new(),
            owner_switches: 0,
            checkpoint_owner: None,
            reset_to: None,
            checkpointed_at: None,
            throughput_kbps: None,
            unreadable: None,
        }
    }

    /// The listing's stand-in for the row under `key` that does not parse, with the
    /// reason (see [`Lease::unreadable`]).
    pub fn unreadable(key: impl Into<String>, reason: impl Into<String>) -> Self {
        Lease {
            unreadable: Some(reason.into()),
            ..Lease::new(key, Vec::new(), Checkpoint::TrimHorizon)
        }
    }

    /// Refuses a write conditioned on a row that does not parse: such a row is left for
    /// an operator to repair, never overwritten.
    pub(crate) fn refuse_if_unreadable(&self) -> Result<(), LeaseError> {
        match &self.unreadable {
            Some(reason) => Err(LeaseError::Corrupt(format!(
                "lease {}: the row does not parse ({reason}); it is not written until repaired",
                self.key
            ))),
            None => Ok(()),
        }
    }

    /// Whether the row is held by a worker that is not shardflow (a KCL worker): its
    /// owner has no incarnation separator, or a KCL 3 hand-off is under way.
    pub fn has_foreign_owner(&self) -> bool {
        self.checkpoint_owner.is_some()
            || self
                .owner
                .as_deref()
                .is_some_and(|o| !o.contains(INCARNATION_SEPARATOR))
    }
}

/// Errors of the lease store.
///
/// An error that came from an AWS call has what AWS answered (code, message, HTTP
/// status) as its [`source`](std::error::Error::source): an [`AwsError`](crate::AwsError).
#[derive(Debug)]
#[non_exhaustive]
pub enum LeaseError {
    /// The conditional write failed: someone else changed the lease (it was taken,
    /// renewed by another owner, or released). The caller no longer holds it.
    Conflict(String),
    /// Throttled by the store: back off and retry.
    Throttled(ErrorDetail),
    /// A row that does not parse.
    Corrupt(String),
    /// The lease table does not exist (deleted while the group runs). Re-creating it
    /// would restart every shard at its initial position, so it is never done after
    /// start-up: a worker whose table stays missing stops with this error.
    TableMissing {
        /// The table's name.
        table: String,
    },
    /// The call did not answer within its deadline. Its outcome is unknown: a write may
    /// have landed (a renewal or take that landed is found out and adopted).
    TimedOut {
        /// The call (`renew`, `checkpoint`, `list`, ...).
        op: &'static str,
        /// The deadline it missed.
        after: std::time::Duration,
    },
    /// Another failure (network, service error); retry with backoff.
    Other(ErrorDetail),
    /// The store refused the call for lack of permission (DynamoDB's
    /// `AccessDeniedException`: an IAM policy that does not grant it on that table).
    /// Retrying does not help until the policy changes.
    AccessDenied(ErrorDetail),
    /// The table is in the middle of a KCL migration (a KCL 3.5 single-table migration
    /// not `TABLE_MIGRATION_STATUS_COMPLETE`, or a KCL 2.x to 3.x client-version migration
    /// not `CLIENT_VERSION_3X`): its state is split between the KCL's tables and only the
    /// KCL can finish or roll it back. Not taken over: finish the migration with the
    /// KCL (or roll it back) first.
    KclMigrationInProgress {
        /// The lease table.
        table: String,
        /// Which migration, e.g. `the KCL 3.5 single-table migration`.
        migration: String,
        /// Its state as the KCL wrote it, e.g. `TABLE_MIGRATION_STATUS_PENDING`.
        state: String,
        /// The table and key of the row that says so.
        row: String,
    },
}

impl std::fmt::Display for LeaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaseError::Conflict(key) => {
                write!(f, "lease {key} changed under us (conditional write failed)")
            }
            LeaseError::Throttled(d) => write!(f, "lease store throttled: {d}"),
            LeaseError::Corrupt(why) => write!(f, "corrupt lease row: {why}"),
            LeaseError::TableMissing { table } => {
                write!(f, "the lease table {table} does not exist")
            }
            LeaseError::TimedOut { op, after } => {
                write!(f, "lease store call {op} did not answer within {after:?}")
            }
            LeaseError::Other(d) => write!(f, "lease store call failed: {d}"),
            LeaseError::AccessDenied(d) => {
                write!(f, "lease store call refused (access denied): {d}")
            }
            LeaseError::KclMigrationInProgress {
                table,
                migration,
                state,
                row,
            } => write!(
                f,
                "the lease table {table} is in the middle of {migration} (state {state}, row {row}): \
                 finish or roll back the migration with the KCL before moving the application"
            ),
        }
    }
}

impl std::error::Error for LeaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LeaseError::Throttled(d) | LeaseError::Other(d) | LeaseError::AccessDenied(d) => {
                d.source()
            }
            _ => None,
        }
    }
}

impl LeaseError {
    /// Whether the same call may succeed later (throttling, network, service errors).
    /// A [`LeaseError::Conflict`] is not: the lease changed and must be read again.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            LeaseError::Throttled(_) | LeaseError::TimedOut { .. } | LeaseError::Other(_)
        )
    }
}

/// The refusal of a [`LeaseStore`] call the store does not support (the trait's
/// defaults).
fn unsupported(expected: &Lease, what: &str) -> LeaseError {
    LeaseError::Other(format!("lease {}: this lease store cannot {what}", expected.key).into())
}

/// The time a checkpoint write records in [`Lease::checkpointed_at`]: `now` (the
/// writer's clock), to the millisecond the row keeps.
pub(crate) fn checkpoint_time(now: SystemTime) -> SystemTime {
    let millis = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(millis).unwrap_or(u64::MAX))
}

/// The keys of the rows `owner` holds, from a listing.
pub(crate) fn owned_by(rows: Vec<Lease>, owner: &str) -> Vec<String> {
    rows.into_iter()
        .filter(|row| row.owner.as_deref() == Some(owner))
        .map(|row| row.key)
        .collect()
}

/// Where leases and checkpoints live. Every write is conditional: `expected` is the
/// lease as the caller last saw it, and the write happens only if the stored row still
/// has the same owner and counter ([`Self::withdraw_handoff`], conditional on the
/// request alone, is the one exception). On success the new row is returned.
#[async_trait]
pub trait LeaseStore: Send + Sync + 'static {
    /// Creates the table if it does not exist yet and waits until it can be used.
    async fn ensure_table(&self) -> Result<(), LeaseError>;

    /// Every lease row.
    async fn list(&self) -> Result<Vec<Lease>, LeaseError>;

    /// One lease row, if present.
    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError>;

    /// The keys of the rows `owner` holds (the KCL 3's `listLeaseKeysForWorker`): what a
    /// worker that does not list the whole table in a round reads to find the leases
    /// handed to it. Only keys, as the KCL's `LeaseOwnerToLeaseKeyIndex` projects them
    /// (no write to the index when a renewal bumps the counter); the caller fetches the
    /// few rows it does not run yet with [`Self::get`]. The default lists the table and
    /// filters it, so any store answers correctly; the DynamoDB store queries the index.
    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        Ok(owned_by(self.list().await?, owner))
    }

    /// Creates the row unless one with the same key exists; returns whether it created it.
    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError>;

    /// Sets the owner to `new_owner`, bumps the counter and clears `pending_owner`,
    /// if the row still matches `expected`. When `expected` carries `new_owner`'s own
    /// hand-off request (a hand-over, or the requester taking the row itself), that
    /// request must still stand: a worker that withdrew it on its way out (see
    /// [`Self::withdraw_handoff`]) is never handed the lease after it stopped.
    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError>;

    /// Bumps the counter (a heartbeat) if the row still matches `expected`, and stores
    /// `expected`'s [`Lease::throughput_kbps`] with it when that is `Some` (the owner's
    /// latest measurement rides on the renewal; `None` keeps the stored value).
    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError>;

    /// Stores a checkpoint if the row still matches `expected` (the counter is kept).
    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError>;

    /// Clears the owner (bumping the counter) if the row still matches `expected`.
    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError>;

    /// Records that `worker` asks for a hand-off, if the row still matches `expected`
    /// and no other worker asked already (the first request wins; the counter is kept
    /// so the owner's fencing token stays valid).
    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError>;

    /// Removes `worker`'s hand-off request from the row, if it is still the row's request
    /// (the owner and counter are not checked, and the counter is kept, so the owner's
    /// fencing token stays valid). A stopping worker withdraws its requests so that no
    /// lease is handed to it after it is gone. A store that cannot do it (the default)
    /// refuses.
    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        let _ = worker;
        Err(unsupported(expected, "withdraw hand-off requests"))
    }

    /// Records an operator's request to move the checkpoint of an owned row to `to`
    /// (`reset_to`), if the row still matches `expected`. The counter is kept, so the
    /// owner's fencing token stays valid; the owner applies it with [`Self::reset`]. A
    /// store that cannot record it (the default) refuses.
    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        let _ = to;
        Err(unsupported(expected, "reset checkpoints"))
    }

    /// Stores `to` as the checkpoint, whatever the stored one (it may move backwards),
    /// and removes a reset request, if the row still matches `expected` (the counter is
    /// kept) and still carries `expected`'s reset request (or none, if it had none): a
    /// second request that landed since `expected` was read is a conflict, never
    /// removed unapplied. Used by an operator on an unowned row and by the owner applying a
    /// request. A store that cannot do it (the default) refuses.
    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        let _ = to;
        Err(unsupported(expected, "reset checkpoints"))
    }

    /// Deletes the row if it still matches `expected` (clean-up of finished shards).
    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError>;

    /// Records `stream` in a row that names none (a row the KCL wrote), if the row still
    /// matches `expected` (the counter is kept). Afterwards a consumer of another stream
    /// is refused on this table. A store that cannot record it (the default) keeps the
    /// row as it is.
    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        let _ = stream;
        Ok(expected.clone())
    }

    /// Records an ended shard's children (`childShardIds`, as the KCL does when a shard
    /// ends) if the row still matches `expected` (the counter is kept), so a KCL
    /// application that takes the table back finds them. A store that cannot record
    /// them (the default) keeps the row as it is.
    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        let _ = children;
        Ok(expected.clone())
    }

    /// The coordinator-state table beside this lease table, where the group's leader
    /// item lives (see [`leader`]). A store without one (the default) has no leader:
    /// every worker then lists the whole table every round, as a small fleet does.
    fn coordinator_state(&self) -> Option<Arc<dyn CoordinatorState>> {
        None
    }
}
