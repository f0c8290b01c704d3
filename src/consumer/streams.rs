//! The streams a consumer reads: one [`Coordinator`] for a single stream, or, in
//! multi-stream mode, one per stream over the same lease table (each sees only its
//! stream's rows), started and stopped as the stream list changes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::kinesis::{KinesisApi, KinesisError};
use crate::lease::{Checkpoint, LeaseStore, OneTableStream, SharedListing};

use super::config::{stream_name, Config, StreamList, TableStream};
use super::context::WorkerContext;
use super::coordinator::Coordinator;
use super::deadline::{BoundedKinesis, BoundedLeaseStore};
use super::health::HealthState;
use super::shard::dispatch::Sink;
use super::ConsumerError;
use crate::backoff::Backoff;

/// The calls a group following a table makes to decide which of the table's streams to
/// read, each with the coordinator's deadline: a call that never answers is a failed
/// check (the group stays where it is and checks again), not a group waiting for ever.
struct Checks {
    kinesis: BoundedKinesis,
    store: BoundedLeaseStore,
}

/// A consumer's worker: its coordinators and their shared health.
pub(crate) struct Group {
    config: Arc<Config>,
    worker: WorkerContext,
    kinesis: Arc<dyn KinesisApi>,
    store: Arc<dyn LeaseStore>,
    sink: Sink,
    health: Arc<HealthState>,
}

impl Group {
    pub(crate) fn new(
        config: Arc<Config>,
        worker: WorkerContext,
        kinesis: Arc<dyn KinesisApi>,
        store: Arc<dyn LeaseStore>,
        sink: Sink,
    ) -> Self {
        Group {
            health: HealthState::new(config.lease_duration, config.stuck_after),
            config,
            worker,
            kinesis,
            store,
            sink,
        }
    }

    /// The health the worker reports (every stream's shards, in multi-stream mode).
    pub(crate) fn health(&self) -> Arc<HealthState> {
        self.health.clone()
    }

    /// Runs until `shutdown` (or a coordinator fails), then returns once every stream
    /// drained, committed and released.
    pub(crate) async fn run(self, shutdown: CancellationToken) -> Result<(), ConsumerError> {
        let Some(list) = self.config.streams.clone() else {
            if let Some(TableStream::Table(table)) = &self.config.table_stream {
                return self.follow_table(table, shutdown).await;
            }
            let coordinator = Coordinator::new(
                self.config.clone(),
                self.worker.clone(),
                self.kinesis.clone(),
                self.store.clone(),
                self.sink.clone(),
                self.health.clone(),
                false,
            );
            return coordinator.run(shutdown).await;
        };
        // One Scan of the table per round for all the streams' coordinators (see
        // SharedListing for why sharing it is as safe as a Scan each). The window covers
        // coordinators whose rounds are a little apart, at an eighth of the renewal
        // interval.
        let store: Arc<dyn LeaseStore> = Arc::new(SharedListing::new(
            self.store.clone(),
            self.config.renew_interval / 8,
            self.config.labels(),
        ));
        let (mut watched, tolerant) = match list {
            StreamList::Fixed(names) => (watch::channel(names).1, false),
            StreamList::Watched(rx) => (rx, true),
        };
        let mut running: BTreeMap<String, CancellationToken> = BTreeMap::new();
        let mut tasks: JoinSet<(String, Result<(), ConsumerError>)> = JoinSet::new();
        // Streams that stopped with an error (changing list only): left out until the
        // list changes.
        let mut failed: BTreeSet<String> = BTreeSet::new();
        let mut list_open = true;
        let mut failure = None;
        while !shutdown.is_cancelled() {
            // Start the streams added, stop those removed. A stream removed and added
            // again before it stopped is started again once it has.
            let wanted = self.wanted(&watched.borrow_and_update());
            for (stream, stop) in &running {
                if !wanted.iter().any(|w| w == stream) && !stop.is_cancelled() {
                    tracing::info!(%stream, "stream removed from the list: draining and releasing its leases");
                    stop.cancel();
                }
            }
            for stream in &wanted {
                if !running.contains_key(stream) && !failed.contains(stream) {
                    tracing::info!(%stream, "reading stream");
                    self.health.stream_retried(stream);
                    let stop = shutdown.child_token();
                    running.insert(stream.clone(), stop.clone());
                    let coordinator = Coordinator::new(
                        Arc::new(self.config.for_stream(stream)),
                        self.worker.for_stream(stream),
                        self.kinesis.clone(),
                        store.clone(),
                        self.sink.clone(),
                        self.health.for_stream(stream),
                        true,
                    );
                    let stream = stream.clone();
                    tasks.spawn(async move { (stream, coordinator.run(stop).await) });
                }
            }
            // Biased: the shutdown first; then a new list, then a stream's coordinator
            // that ended.
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                changed = watched.changed(), if list_open => {
                    // A dropped sender keeps the last list.
                    list_open = changed.is_ok();
                    failed.clear();
                }
                Some(done) = tasks.join_next() => {
                    let (stream, result) = match done {
                        Ok(done) => done,
                        Err(e) => (String::new(), Err(ConsumerError::Worker(e.to_string()))),
                    };
                    running.remove(&stream);
                    if let Err(e) = result {
                        // A table of another kind or stream is a configuration
                        // error for every stream: it always stops the consumer.
                        let fatal = matches!(
                            e,
                            ConsumerError::Worker(_)
                                | ConsumerError::Config(_)
                                | ConsumerError::TableModeMismatch { .. }
                                | ConsumerError::TableOfAnotherStream { .. }
                        );
                        if tolerant && !fatal {
                            // A changing list keeps the other streams going; the stream
                            // is tried again once the list changes.
                            tracing::error!(%stream, error = %e, "stream stopped with an error; left out until the list changes");
                            self.health.stream_failed(&stream, &e);
                            failed.insert(stream);
                            continue;
                        }
                        failure = Some(e);
                        break;
                    }
                }
            }
        }
        // Shutdown, or one stream failed: every stream drains, commits and releases.
        for stop in running.values() {
            stop.cancel();
        }
        while let Some(done) = tasks.join_next().await {
            let result = done
                .map_err(|e| ConsumerError::Worker(e.to_string()))
                .and_then(|(_, result)| result);
            if let (Err(e), None) = (result, &failure) {
                failure = Some(e);
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Reads the streams of `table` one after the other (a consumer started by table
    /// name): the table's current stream; but first, an earlier stream of the table
    /// (disabled before the current one was enabled) whose rows in the lease table are
    /// not finished, so that what it still holds is read before the changes made since.
    /// A stream is left once the table has a newer one and every shard of it is
    /// finished (a disabled stream's shards all close) or the stream is gone (past its
    /// 24 hours); each coordinator sees only its stream's rows ([`OneTableStream`]).
    async fn follow_table(
        &self,
        table: &str,
        shutdown: CancellationToken,
    ) -> Result<(), ConsumerError> {
        let calls = Checks {
            kinesis: BoundedKinesis::new(
                self.kinesis.clone(),
                self.config.read_call_timeout,
                self.config.labels(),
            ),
            store: BoundedLeaseStore::new(
                self.store.clone(),
                self.config.lease_call_timeout,
                self.config.labels(),
            ),
        };
        loop {
            let Some(current) = self.resolve_table_stream(table, &calls, &shutdown).await? else {
                return Ok(()); // shut down before it started
            };
            let arn = match self.unfinished_earlier_stream(&current, &calls).await {
                Some(earlier) => {
                    tracing::info!(%table, stream = %earlier, current = %current, "reading the rest of the table's earlier stream first");
                    earlier
                }
                None => current,
            };
            tracing::info!(%table, stream = %arn, "reading the table's stream");
            let config = Arc::new(Config {
                stream: arn.clone(),
                ..(*self.config).clone()
            });
            let store: Arc<dyn LeaseStore> =
                Arc::new(OneTableStream::new(self.store.clone(), &arn));
            let stop = shutdown.child_token();
            let coordinator = Coordinator::new(
                config,
                self.worker.clone(),
                self.kinesis.clone(),
                store,
                self.sink.clone(),
                self.health.clone(),
                false,
            );
            let mut run = std::pin::pin!(coordinator.run(stop.clone()));
            let mut ticks = tokio::time::interval(self.config.shard_sync_interval);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                // The check runs beside the coordinator, never instead of it: while its
                // calls wait (a slow or unanswered DescribeTable, DescribeStream or
                // Scan), the coordinator goes on taking, syncing and handing over
                // shards; polled only between checks, it stood still for as long as a
                // call hung, and the shards nobody held yet stayed unread.
                let check = async {
                    ticks.tick().await;
                    self.moved_on(table, &arn, &calls).await
                };
                let moved = tokio::select! {
                    biased;
                    result = &mut run => return result,
                    moved = check => moved,
                };
                if moved {
                    tracing::info!(%table, stream = %arn, "the table has a newer stream and this one is finished: moving on");
                    stop.cancel();
                    run.await?;
                    break;
                }
            }
            if shutdown.is_cancelled() {
                return Ok(());
            }
        }
    }

    /// An earlier stream of the table of `current` (same table, another ARN) whose
    /// rows are not all finished and that is still readable. Not knowing (a call
    /// failed) gives `None`: the coordinator of `current` then refuses a table holding
    /// unfinished rows of another stream rather than skip them.
    async fn unfinished_earlier_stream(&self, current: &str, calls: &Checks) -> Option<String> {
        let view = OneTableStream::new(self.store.clone(), current);
        let rows = calls.store.list().await.ok()?;
        let mut earlier: Vec<String> = rows
            .iter()
            .filter(|r| view.other_stream_of_table(r) && r.checkpoint != Checkpoint::ShardEnd)
            .filter_map(|r| r.stream.clone())
            .collect();
        earlier.sort();
        earlier.dedup();
        for stream in earlier {
            match calls.kinesis.list_shards(&stream).await {
                Err(KinesisError::NotFound(_)) => {
                    tracing::warn!(%stream, "an earlier stream of the table is gone (past its retention); its unread changes with it");
                }
                _ => return Some(stream),
            }
        }
        None
    }

    /// Whether the group should leave `stream`: the table's stream is another one now
    /// (a failure to tell, or no stream at all, says no), and every shard of `stream`
    /// is closed with its row finished, or the stream is gone.
    async fn moved_on(&self, table: &str, stream: &str, calls: &Checks) -> bool {
        match calls.kinesis.resolve_table_stream(table).await {
            Ok(now) if now != stream => {}
            _ => return false,
        }
        let shards = match calls.kinesis.list_shards(stream).await {
            Ok(shards) => shards,
            Err(KinesisError::NotFound(_)) => return true,
            Err(_) => return false,
        };
        let Ok(rows) = calls.store.list().await else {
            return false;
        };
        let ours = |shard: &str| {
            rows.iter()
                .find(|r| r.key == shard && r.stream.as_deref().is_none_or(|s| s == stream))
        };
        // Every shard closed, every row of them finished, and every last shard of a
        // lineage (nobody's parent) finished: a shard before it without a row was
        // left out on purpose (a group started at LATEST).
        let is_parent = |id: &str| shards.iter().any(|s| s.parents().iter().any(|p| p == id));
        shards.iter().all(|shard| {
            let row = ours(&shard.shard_id);
            shard.is_closed()
                && row.is_none_or(|r| r.checkpoint == Checkpoint::ShardEnd)
                && (row.is_some() || is_parent(&shard.shard_id))
        })
    }

    /// The table's current stream ARN; a transient failure (throttling, network) is
    /// retried with backoff until `shutdown` (then `None`), any other (no such table, no
    /// stream) is returned.
    async fn resolve_table_stream(
        &self,
        table: &str,
        calls: &Checks,
        shutdown: &CancellationToken,
    ) -> Result<Option<String>, ConsumerError> {
        let mut backoff = Backoff::new(
            self.config.retry_min,
            self.config.retry_max,
            self.config.seed,
        );
        loop {
            match calls.kinesis.resolve_table_stream(table).await {
                Ok(arn) => return Ok(Some(arn)),
                Err(e) if e.is_transient() => {
                    tracing::warn!(%table, error = %e, "resolving the table's stream failed; retrying");
                }
                Err(e) => return Err(e.into()),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                _ = tokio::time::sleep(backoff.next_delay()) => {}
            }
        }
    }

    /// The stream names in `list`: ARNs become names; invalid entries and repeats are
    /// left out (and logged).
    fn wanted(&self, list: &[String]) -> Vec<String> {
        let mut names: Vec<String> = Vec::with_capacity(list.len());
        for given in list {
            match stream_name("streams", given) {
                Ok(name) if !names.contains(&name) => names.push(name),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "leaving an invalid stream out"),
            }
        }
        names
    }
}
