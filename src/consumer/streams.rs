//! The streams a consumer reads: one [`Coordinator`] for a single stream, or, in
//! multi-stream mode, one per stream over the same lease table (each sees only its
//! stream's rows), started and stopped as the stream list changes.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::kinesis::KinesisApi;
use crate::lease::{LeaseStore, SharedListing};

use super::config::{stream_name, Config, StreamList, TableStream};
use super::context::WorkerContext;
use super::coordinator::Coordinator;
use super::health::HealthState;
use super::shard::dispatch::Sink;
use super::ConsumerError;

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
            let config = match &self.config.table_stream {
                // The table's stream is the one it has when the consumer starts.
                Some(TableStream::Table(table)) => {
                    let Some(arn) = self.resolve_table_stream(table, &shutdown).await? else {
                        return Ok(()); // shut down before it started
                    };
                    tracing::info!(%table, stream = %arn, "reading the table's stream");
                    Arc::new(Config {
                        stream: arn,
                        ..(*self.config).clone()
                    })
                }
                _ => self.config.clone(),
            };
            let coordinator = Coordinator::new(
                config,
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

    /// The table's current stream ARN; a transient failure (throttling, network) is
    /// retried with backoff until `shutdown` (then `None`), any other (no such table, no
    /// stream) is returned.
    async fn resolve_table_stream(
        &self,
        table: &str,
        shutdown: &CancellationToken,
    ) -> Result<Option<String>, ConsumerError> {
        let mut delay = self.config.retry_min;
        loop {
            match self.kinesis.resolve_table_stream(table).await {
                Ok(arn) => return Ok(Some(arn)),
                Err(e) if e.is_transient() => {
                    tracing::warn!(%table, error = %e, "resolving the table's stream failed; retrying");
                }
                Err(e) => return Err(e.into()),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(self.config.retry_max);
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
