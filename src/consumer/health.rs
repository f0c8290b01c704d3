//! The worker's health signal for liveness and readiness probes: whether it still talks
//! to its lease table (renewals, lease rounds) and whether its shards advance, fail or
//! are stuck.
//! [`Running::health`](super::Running::health) and
//! [`BatchStream::health`](super::BatchStream::health) return a [`Health`] snapshot.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::time::Instant;

/// How many failures in a row (reads or handler calls, nothing succeeding in between)
/// make a shard count as failing.
pub const FAILING_AFTER: u32 = 3;

/// A reading shard's progress as health measures it: implemented by the shard's
/// watermark, so health does not depend on the shard's path.
pub(crate) trait Progress: std::fmt::Debug + Send + Sync {
    /// Since when records have waited with none handled; `None` while nothing waits.
    fn waiting_since(&self) -> Option<Instant>;
}

/// A snapshot of a worker's health.
///
/// * live ([`Health::is_live`]): the worker reached its lease table (a lease renewal or a
///   lease round succeeded) within the lease duration. A worker that is not live has
///   lost, or is about to lose, every lease: restart it.
/// * ready ([`Health::is_ready`]): live, started (its first lease round succeeded),
///   none of its shards is failing ([`ShardHealth::failing`]) or stuck
///   ([`ShardHealth::stuck_for`]), its last listing of the lease table found no row
///   that does not parse ([`Health::unreadable_rows`]), and the lease table did not
///   fail its lease rounds ([`Health::lease_rounds_failing`]). Not ready is a reason to look,
///   not always to restart: a poison record keeps its shard failing until the handler
///   accepts it, and a hung handler keeps it stuck until the call returns.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Health {
    /// How long ago the lease table last answered a renewal or a lease round; `None`
    /// before the first success.
    pub lease_table_ok_ago: Option<Duration>,
    /// The lease duration the liveness is measured against.
    pub lease_duration: Duration,
    /// The shards this worker reads, by shard id.
    pub shards: Vec<ShardHealth>,
    /// Multi-stream mode with a changing list
    /// ([`ConsumerBuilder::streams_from`](super::ConsumerBuilder::streams_from)): the
    /// streams that stopped with an error and are not read until the list changes,
    /// with the error.
    pub failed_streams: Vec<(String, String)>,
    /// Lease rows this worker's last listing of the table found but could not parse
    /// (shard id, as [`ShardHealth::shard_id`] names shards, and the reason). Such a row
    /// is left alone and its shard's children wait for it: the group is not healthy
    /// until an operator repairs it.
    pub unreadable_rows: Vec<(String, String)>,
    /// Why this worker's lease rounds fail: the lease table refused a round's call for
    /// lack of permission (an IAM policy without `Scan` or `UpdateItem` on it), or the
    /// rounds failed to list the table or take what they meant to for a lease duration
    /// (writes throttled or timing out while reads answer). Such a worker finds and
    /// takes no lease, so a shard nobody holds stays unread. `None` once a round lists
    /// the table and takes what it meant to.
    pub lease_rounds_failing: Option<String>,
}

/// One held shard's health.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShardHealth {
    /// The shard id; `stream/shardId` in multi-stream mode
    /// ([`ConsumerBuilder::streams`](super::ConsumerBuilder::streams)).
    pub shard_id: String,
    /// How long ago the shard last made progress. A shard makes progress when its
    /// handled position moves (a record or batch is handled and acknowledged), and
    /// while nothing waits to be handled (every record read is acknowledged: zero for an
    /// idle shard caught up with the tip). A shard whose handler hangs, whose handler
    /// keeps failing on a record, or whose `stream()` batches are held unacknowledged,
    /// makes none. Before its first read, the time since the lease was taken.
    pub progress_ago: Duration,
    /// How long the shard has been stuck: records were handed out (delivered to a
    /// handler, queued for one, or given to a `stream()` user) and none was handled for
    /// at least [`stuck_after`](super::ConsumerBuilder::stuck_after); `None` when it is
    /// not. `last_error` then says why when a handler failed (for example a dead-letter
    /// sink that keeps refusing the record); without an error, a handler call or a held
    /// batch has not returned. A stuck shard makes the worker not ready.
    pub stuck_for: Option<Duration>,
    /// Failures in a row (reads that failed, restarts after a handler error), reset by
    /// progress.
    pub failures_in_a_row: u32,
    /// The last failure, if the shard failed since its last progress.
    pub last_error: Option<String>,
}

impl ShardHealth {
    /// Whether the shard failed at least [`FAILING_AFTER`] times in a row.
    pub fn failing(&self) -> bool {
        self.failures_in_a_row >= FAILING_AFTER
    }
}

impl Health {
    /// The worker reached its lease table within the lease duration.
    pub fn is_live(&self) -> bool {
        self.lease_table_ok_ago
            .is_some_and(|ago| ago < self.lease_duration)
    }

    /// Live, started, no shard failing or stuck and no stream left out after an error.
    pub fn is_ready(&self) -> bool {
        self.is_live()
            && !self.shards.iter().any(ShardHealth::failing)
            && !self.shards.iter().any(|s| s.stuck_for.is_some())
            && self.failed_streams.is_empty()
            && self.unreadable_rows.is_empty()
            && self.lease_rounds_failing.is_none()
    }
}

#[derive(Debug)]
struct ShardState {
    progress_at: Instant,
    /// The shard's watermark once it reads (see [`HealthState::watch`]).
    watermark: Option<Arc<dyn Progress>>,
    failures: u32,
    last_error: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    lease_table_ok_at: Option<Instant>,
    shards: BTreeMap<Arc<str>, ShardState>,
    failed_streams: BTreeMap<String, String>,
    unreadable_rows: BTreeMap<Arc<str>, String>,
    lease_rounds_failing: Option<String>,
}

/// What the coordinator, shard tasks and readers report into; shared with the handles.
#[derive(Debug)]
pub(crate) struct HealthState {
    /// Shared by the views of a multi-stream consumer's streams (see `for_stream`).
    state: Arc<Mutex<State>>,
    lease_duration: Duration,
    /// How long records may wait with none handled before the shard is stuck.
    stuck_after: Duration,
    /// `stream/` in one stream's view of a multi-stream consumer's health.
    prefix: Option<Arc<str>>,
}

impl HealthState {
    pub(crate) fn new(lease_duration: Duration, stuck_after: Duration) -> Arc<Self> {
        Arc::new(HealthState {
            state: Arc::default(),
            lease_duration,
            stuck_after,
            prefix: None,
        })
    }

    /// One stream's view of a multi-stream consumer's health: the same state, its
    /// shards named `stream/shardId`.
    pub(crate) fn for_stream(&self, stream: &str) -> Arc<Self> {
        Arc::new(HealthState {
            state: self.state.clone(),
            lease_duration: self.lease_duration,
            stuck_after: self.stuck_after,
            prefix: Some(format!("{stream}/").into()),
        })
    }

    /// The name `shard` has in the health report.
    fn name(&self, shard: &str) -> Arc<str> {
        match &self.prefix {
            Some(prefix) => format!("{prefix}{shard}").into(),
            None => shard.into(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves plain data: still usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A renewal or a lease round succeeded.
    pub(crate) fn lease_table_ok(&self) {
        self.lock().lease_table_ok_at = Some(Instant::now());
    }

    /// The worker's lease rounds fail (`Some`, the cause; see
    /// [`Health::lease_rounds_failing`]), or a round listed the table and took what it
    /// meant to (`None`). Returns whether they were not failing before.
    pub(crate) fn lease_rounds_failing(&self, cause: Option<String>) -> bool {
        std::mem::replace(&mut self.lock().lease_rounds_failing, cause).is_none()
    }

    /// The worker started reading `shard` (its lease was taken).
    pub(crate) fn shard_started(&self, shard: &str) {
        self.lock().shards.insert(
            self.name(shard),
            ShardState {
                progress_at: Instant::now(),
                watermark: None,
                failures: 0,
                last_error: None,
            },
        );
    }

    /// The worker no longer reads `shard`.
    pub(crate) fn shard_stopped(&self, shard: &str) {
        self.lock().shards.remove(&self.name(shard));
    }

    /// `shard` reads: its progress is measured on `watermark` from now on.
    pub(crate) fn watch(&self, shard: &str, watermark: Arc<dyn Progress>) {
        if let Some(s) = self.lock().shards.get_mut(&self.name(shard)) {
            s.watermark = Some(watermark);
        }
    }

    /// How long `shard`'s records have waited with none handled, when that is at least
    /// the stuck threshold.
    pub(crate) fn stuck_for(&self, waiting_since: Option<Instant>) -> Option<Duration> {
        waiting_since
            .map(|t| t.elapsed())
            .filter(|waited| *waited >= self.stuck_after)
    }

    /// `shard`'s checkpoint was written, or a read of it found nothing new with nothing
    /// waiting to be handled.
    pub(crate) fn progress(&self, shard: &str) {
        if let Some(s) = self.lock().shards.get_mut(&self.name(shard)) {
            s.progress_at = Instant::now();
            s.failures = 0;
            s.last_error = None;
        }
    }

    /// A read of `shard` or a handler call on it failed.
    pub(crate) fn failure(&self, shard: &str, error: impl std::fmt::Display) {
        if let Some(s) = self.lock().shards.get_mut(&self.name(shard)) {
            s.failures = s.failures.saturating_add(1);
            s.last_error = Some(error.to_string());
        }
    }

    /// A stream of a changing list stopped with `error` and is left out.
    pub(crate) fn stream_failed(&self, stream: &str, error: impl std::fmt::Display) {
        self.lock()
            .failed_streams
            .insert(stream.to_owned(), error.to_string());
    }

    /// A stream is (again) started.
    pub(crate) fn stream_retried(&self, stream: &str) {
        self.lock().failed_streams.remove(stream);
    }

    /// The rows of this view's stream that a listing found unreadable, by shard id, with
    /// the reason (replacing what the previous listing found). Returns the shards newly
    /// found so.
    pub(crate) fn unreadable_rows(&self, rows: BTreeMap<&str, &str>) -> Vec<String> {
        let mut state = self.lock();
        let prefix = self.prefix.as_deref().unwrap_or("");
        let before: BTreeMap<Arc<str>, String> = std::mem::take(&mut state.unreadable_rows);
        let mut new = Vec::new();
        // Other streams' rows (multi-stream mode) are theirs to report.
        for (name, reason) in &before {
            if !name.starts_with(prefix) {
                state.unreadable_rows.insert(name.clone(), reason.clone());
            }
        }
        for (shard, reason) in rows {
            let name = self.name(shard);
            if !before.contains_key(&name) {
                new.push(shard.to_owned());
            }
            state.unreadable_rows.insert(name, reason.to_owned());
        }
        new
    }

    pub(crate) fn snapshot(&self) -> Health {
        let state = self.lock();
        Health {
            lease_table_ok_ago: state.lease_table_ok_at.map(|t| t.elapsed()),
            lease_duration: self.lease_duration,
            shards: state
                .shards
                .iter()
                .map(|(id, s)| {
                    let waiting_since = s.watermark.as_ref().map(|w| w.waiting_since());
                    ShardHealth {
                        shard_id: id.to_string(),
                        progress_ago: match waiting_since {
                            None => s.progress_at.elapsed(),
                            Some(since) => since.map_or(Duration::ZERO, |t| t.elapsed()),
                        },
                        stuck_for: self.stuck_for(waiting_since.flatten()),
                        failures_in_a_row: s.failures,
                        last_error: s.last_error.clone(),
                    }
                })
                .collect(),
            failed_streams: state
                .failed_streams
                .iter()
                .map(|(stream, error)| (stream.clone(), error.clone()))
                .collect(),
            unreadable_rows: state
                .unreadable_rows
                .iter()
                .map(|(shard, reason)| (shard.to_string(), reason.clone()))
                .collect(),
            lease_rounds_failing: state.lease_rounds_failing.clone(),
        }
    }
}
