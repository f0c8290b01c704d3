//! The consumer: a builder, then either `run(service)` (the framework calls a tower
//! service per record or per batch and acknowledges on success) or `stream()` (batches
//! the caller acknowledges).
//!
//! One rule for stopping, the same for consumers and producers: an explicit stop
//! (`shutdown().await` on a consumer, `close().await` on a producer) finishes what was
//! started and returns once it is done; dropping the handle (for a producer, its last
//! clone) starts the same stop in the background, which nobody can wait for and which
//! completes only while the tokio runtime is still running. For a consumer the handle is
//! the [`Running`] that [`Run::spawn`] returns (or the future awaiting a [`Run`]) and the
//! [`BatchStream`]; stopping means: reading stops, in-flight work finishes (at most the
//! shutdown timeout), checkpoints are committed and leases released.
//!
//! ```
//! use shardflow::{Consumer, Memory, Message};
//! use shardflow::kinesis::StreamAdmin;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let memory = Memory::new();                  // the embedded backend, said explicitly
//! memory.streams().create_stream("orders", 2).await?;
//! let consumer = Consumer::builder()
//!     .stream("orders")
//!     .group("billing")
//!     .backend(memory.clone())
//!     .build()?;
//! let handler = tower::service_fn(|msg: Message| async move {
//!     println!("{}", msg.metadata.sequence_number);
//!     Ok::<_, std::convert::Infallible>(())
//! });
//! let running = consumer.run(handler).spawn();
//! // ... later:
//! running.shutdown().await?;                   // drained, committed, released
//! # Ok(())
//! # }
//! ```
//!
//! Inside, a `coordinator` per worker manages leases and starts a task per held lease
//! from `shard`, the per-shard path: the task runs a reader, dispatch hands batches to
//! the service, and the task commits the watermark of acknowledged records.

mod balance;
mod config;
mod context;
mod coordinator;
mod deadline;
mod events;
mod health;
mod latest;
#[cfg(test)]
mod lease_tests;
mod panics;
mod read_ahead;
mod shard;
mod streams;

use std::fmt::Display;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::future::BoxFuture;
use futures_util::{FutureExt, Stream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::Service;

use crate::kinesis::{KinesisApi, KinesisError};
use crate::lease::{LeaseError, LeaseStore};
use crate::message::{Batch, Message};

pub use config::{
    BalanceBy, CheckpointPolicy, Concurrency, Config, ConfigError, ConsumerBuilder,
    InitialPosition, DEFAULT_BALANCE_TOLERANCE, DEFAULT_CHECKPOINT_INTERVAL,
    DEFAULT_IDLE_READ_INTERVAL, DEFAULT_READ_AHEAD_BYTES, DEFAULT_STUCK_AFTER, MAX_STUCK_AFTER,
};
use context::WorkerContext;
pub use events::ShardEvent;
use health::HealthState;
pub use health::{Health, ShardHealth, FAILING_AFTER};
use shard::dispatch::{self, Sink, SpawnDispatch};
use streams::Group;

use crate::metrics::Measured;

/// Why a consumer stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConsumerError {
    /// The configuration was refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The lease table could not be used.
    #[error("lease table: {0}")]
    Lease(#[from] LeaseError),
    /// Kinesis refused (for example: the stream does not exist).
    #[error("kinesis: {0}")]
    Kinesis(#[from] KinesisError),
    /// The lease table is a multi-stream table (keys `account:stream:creationEpoch:shardId`)
    /// and the consumer reads a single stream ([`ConsumerBuilder::stream`]), or the other
    /// way round ([`ConsumerBuilder::streams`]): the two key forms are never mixed in
    /// one table. Use another `.lease_table(..)` (or group) for one of them.
    #[error(
        "lease table {table:?} holds {rows} (row {lease:?}), but this consumer reads {consumer}: \
         single-stream and multi-stream consumers need separate lease tables"
    )]
    TableModeMismatch {
        /// The lease table.
        table: String,
        /// What this consumer reads, e.g. `the single stream "orders"`.
        consumer: String,
        /// What the table holds, e.g. `multi-stream rows (of stream 123456789012:orders:1700000000)`.
        rows: String,
        /// The row that showed it.
        lease: String,
    },
    /// The worker task panicked or was cancelled (or its result was already returned).
    #[error("the worker task failed: {0}")]
    Worker(String),
    /// The lease table holds the leases of another stream (for example two streams
    /// consumed under one group name): the consumer refuses to start rather than read
    /// that stream's checkpoints. Give one of them its own `.lease_table(..)` or `.group(..)`.
    #[error(
        "lease table {table:?} belongs to stream {other_stream:?} (row {lease:?}), \
         not to stream {stream:?}: use another lease table or group for one of them"
    )]
    TableOfAnotherStream {
        /// The lease table.
        table: String,
        /// The stream this consumer reads.
        stream: String,
        /// The stream the table's rows name.
        other_stream: String,
        /// A row of the other stream.
        lease: String,
    },
    /// Multi-stream mode: the table's unfinished rows of this stream name carry another
    /// creation time than the stream has now. Either the stream was deleted and created again (at
    /// start-up, or while the group ran), or the rows were written under another
    /// creation time (a KCL application that configured its own stream identifier).
    /// Starting afresh would skip or re-read what the rows hold, so the stream is not
    /// read: delete the old rows to start the new stream at the initial position.
    #[error(
        "lease table {table:?} holds the leases of stream {rows} (row {lease:?}), \
         but the stream is now {stream} (created at another time): delete those rows to \
         start it afresh"
    )]
    StreamCreatedAgain {
        /// The lease table.
        table: String,
        /// The stream's identity now (`account:name:creationEpoch`).
        stream: String,
        /// The identity the rows carry.
        rows: String,
        /// A row of that identity (empty when found while running).
        lease: String,
    },
}

impl ConsumerError {
    /// Whether the same call may succeed later (throttling, network, service errors).
    pub fn is_transient(&self) -> bool {
        match self {
            ConsumerError::Lease(e) => e.is_transient(),
            ConsumerError::Kinesis(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// A consumer of one stream as one worker of a consumer group.
pub struct Consumer {
    config: Arc<Config>,
    worker: WorkerContext,
    kinesis: Arc<dyn KinesisApi>,
    store: Arc<dyn LeaseStore>,
    shutdown: CancellationToken,
}

impl ConsumerBuilder {
    /// Validates the configuration and builds the consumer; a bad value is refused
    /// with an error naming the field.
    pub fn build(mut self) -> Result<Consumer, ConfigError> {
        let config = self.validate()?;
        let backend = self.take_backend()?;
        let kinesis = match &config.table_stream {
            None => backend.kinesis(),
            Some(_) => backend
                .table_streams()
                .ok_or_else(|| ConfigError::Invalid {
                    field: "backend",
                    reason: "this backend does not serve DynamoDB table streams".into(),
                })?,
        };
        Ok(Consumer {
            worker: WorkerContext::new(&config),
            kinesis,
            store: backend.lease_store(&config.lease_table),
            config: Arc::new(config),
            shutdown: CancellationToken::new(),
        })
    }
}

/// Stops a running consumer gracefully: reading stops, in-flight handlers finish,
/// checkpoints are committed and leases released.
#[derive(Clone, Debug)]
pub struct ShutdownHandle(CancellationToken);

impl ShutdownHandle {
    /// Starts the graceful shutdown; `run` returns (or the stream ends) once it is done.
    pub fn shutdown(&self) {
        self.0.cancel();
    }
}

impl Consumer {
    /// The event hook of the handlers' tasks: in multi-stream mode their events name
    /// the shard `stream/shardId`, as the coordinators' do.
    fn handler_events(&self) -> events::EventHook {
        let events = self.worker.events.clone();
        if self.config.streams.is_some() {
            events.naming_streams()
        } else {
            events
        }
    }

    /// Starts configuring a consumer.
    pub fn builder() -> ConsumerBuilder {
        ConsumerBuilder::default()
    }

    /// The validated configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// A handle that stops this consumer gracefully.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle(self.shutdown.clone())
    }

    /// Runs `service` on every record: by default records of a shard one at a time in
    /// sequence order, shards concurrently (one clone of the service each); with
    /// [`ConsumerBuilder::concurrency`] records of different partition keys (or any
    /// records) of a shard concurrently too, each call on its own clone after
    /// `ServiceExt::ready`. `Ok` marks the record handled; an error stops the shard,
    /// which reads again from its checkpoint after a backoff. A panic of the service (in
    /// `poll_ready`, `call` or its future) is such an error too: it is caught, reported
    /// (`HandlerFailed` with the panic's message, health, metrics), and the shard's calls
    /// in flight are given up and delivered again. Await the returned [`Run`]
    /// (add [`Run::until`] to stop on a signal) or [`Run::spawn`] it and later call
    /// [`Running::shutdown`].
    ///
    /// With the `opentelemetry` feature, each call runs in a span whose parent is the
    /// trace context the record carries (module `trace`).
    pub fn run<S>(self, service: S) -> Run
    where
        S: Service<Message> + Clone + Send + 'static,
        S::Future: Send,
        S::Error: Display + Send,
    {
        let events = self.handler_events();
        // Each call in a span that continues the record's (or links the batch's) traces.
        #[cfg(feature = "opentelemetry")]
        let service = crate::trace::Traced::new(service);
        // Inside the metrics, so a panic is timed and counted like any failed call.
        let service = Measured::new(panics::CatchPanic::new(service), &self.config.labels());
        let (per_shard, per_key) = match self.config.concurrency {
            Concurrency::PerKey(n) => (n, true),
            Concurrency::Unordered(n) => (n, false),
            Concurrency::Sequential => {
                return self.run_with(spawn_with(service, move |rx, service| {
                    tokio::spawn(dispatch::records(rx, service, events.clone()))
                }))
            }
        };
        // One semaphore for every shard of this worker: the worker-wide limit.
        let limits = dispatch::Limits {
            per_shard,
            per_key,
            worker: Arc::new(tokio::sync::Semaphore::new(
                self.config.max_concurrent_calls,
            )),
        };
        self.run_with(spawn_with(service, move |rx, service| {
            tokio::spawn(dispatch::concurrent(
                rx,
                service,
                limits.clone(),
                events.clone(),
            ))
        }))
    }

    /// Like [`Consumer::run`], with the service called once per batch (one GetRecords
    /// read of one shard), a shard's batches one at a time in order.
    ///
    /// The service's result is the verdict: `Ok` acknowledges the whole batch; an error
    /// gives it up and the shard reads again from its checkpoint after a backoff (a
    /// panic of the service is caught and counts as an error). The
    /// [`Batch`] the service receives still has its acknowledgement handle, with the same
    /// meaning as in [`Consumer::stream`]: [`Batch::ack`] marks it handled before the
    /// service returns (harmless: `Ok` would do the same), and [`Batch::nack`] gives it
    /// up at once, so it is delivered again even if the service then returns `Ok`. An
    /// acknowledgement cannot be put off past the service's return (`Ok` acknowledges
    /// even when the handle was moved out with [`Batch::take_ack`]): to acknowledge
    /// later, use [`Consumer::stream`].
    ///
    /// Of the `shardflow-middleware` layers, `batch` (`Batching`, which re-chunks a read
    /// for a bulk handler) and `bisect` (`Bisect`, which splits a failing batch down to the
    /// records that fail alone and dead-letters those, so one poison record does not
    /// hold the shard) are `Service<Batch>`s; `decode`, `dedup`, `retry` and
    /// `dead_letter` wrap a `Service<Message>` and so work in [`Consumer::run`] mode (or
    /// below `Batching`'s bulk handler, which receives `Vec<Message>`, not at all).
    ///
    /// With the `opentelemetry` feature, each call runs in a span that links to the trace
    /// context of every record of the batch (a batch has many parents; module `trace`).
    pub fn run_batches<S>(self, service: S) -> Run
    where
        S: Service<Batch> + Clone + Send + 'static,
        S::Future: Send,
        S::Error: Display + Send,
    {
        let events = self.handler_events();
        // Each call in a span that continues the record's (or links the batch's) traces.
        #[cfg(feature = "opentelemetry")]
        let service = crate::trace::Traced::new(service);
        // Inside the metrics, so a panic is timed and counted like any failed call.
        let service = Measured::new(panics::CatchPanic::new(service), &self.config.labels());
        self.run_with(spawn_with(service, move |rx, service| {
            tokio::spawn(dispatch::batches(rx, service, events.clone()))
        }))
    }

    fn run_with(self, spawn: SpawnDispatch) -> Run {
        Run {
            consumer: self,
            spawn,
            until: None,
        }
    }

    /// The records as a stream of batches from all held shards; call [`Batch::ack`] on
    /// each once handled. The consumer starts at once; stop it with
    /// [`BatchStream::shutdown`], or with a [`ShutdownHandle`] while polling on until the
    /// stream ends (so in-flight batches can still be acknowledged).
    pub fn stream(self) -> BatchStream {
        let (tx, rx) = mpsc::channel(self.config.prefetch_batches.max(1) * 4);
        let group = Group::new(
            self.config.clone(),
            self.worker.clone(),
            self.kinesis.clone(),
            self.store.clone(),
            Sink::Shared(tx),
        );
        let health = group.health();
        let worker = tokio::spawn(group.run(self.shutdown.clone()));
        BatchStream {
            health,
            rx,
            worker: Some(worker),
            shutdown: ShutdownHandle(self.shutdown),
            starting: None,
        }
    }
}

/// Wraps the service so each shard's dispatch task gets its own clone. The mutex only
/// makes a `Send` service shareable by the coordinator; it is locked once per shard start.
fn spawn_with<S: Clone + Send + 'static>(
    service: S,
    spawn: impl Fn(mpsc::Receiver<Batch>, S) -> JoinHandle<()> + Send + Sync + 'static,
) -> SpawnDispatch {
    let service = std::sync::Mutex::new(service);
    Arc::new(move |rx| {
        let service = service.lock().unwrap_or_else(|p| p.into_inner()).clone();
        spawn(rx, service)
    })
}

/// A consumer in `run` mode, not started yet. Await it (it runs until stopped, then
/// returns the run's result), or [`Run::spawn`] it to get a [`Running`] handle; add
/// [`Run::until`] to stop on a signal.
///
/// Stopping follows the one rule of the [module docs](self): `shutdown().await` stops
/// and returns the result; dropping the [`Running`] handle (or the future awaiting a
/// `Run`) starts the same graceful stop in the background, which cannot be waited for
/// and completes only while the tokio runtime is still running.
///
/// Forgetting to await or spawn it is a warning (`#[must_use]`), an error under
/// `#![deny(unused_must_use)]`:
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// # fn main() {}
/// # fn start(consumer: shardflow::Consumer) {
/// consumer.run(tower::service_fn(|_m: shardflow::Message| async {
///     Ok::<_, std::convert::Infallible>(())
/// }));
/// # }
/// ```
#[must_use = "a Run does nothing until it is awaited or spawned"]
pub struct Run {
    consumer: Consumer,
    spawn: SpawnDispatch,
    until: Option<BoxFuture<'static, ()>>,
}

impl Run {
    /// Shuts down gracefully when `signal` completes (for example `tokio::signal::ctrl_c()`).
    pub fn until<F>(mut self, signal: F) -> Self
    where
        F: Future + Send + 'static,
    {
        self.until = Some(signal.map(|_| ()).boxed());
        self
    }

    /// Starts the consumer on the current tokio runtime and returns its handle:
    /// [`Running::shutdown`] stops it and returns the result.
    ///
    /// # Panics
    ///
    /// Outside a tokio runtime (like `tokio::spawn`).
    pub fn spawn(self) -> Running {
        let Run {
            consumer,
            spawn,
            until,
        } = self;
        let shutdown = consumer.shutdown.clone();
        let group = Group::new(
            consumer.config,
            consumer.worker,
            consumer.kinesis,
            consumer.store,
            Sink::PerShard(spawn),
        );
        let health = group.health();
        let token = shutdown.clone();
        let worker = tokio::spawn(async move {
            let run = group.run(token.clone());
            tokio::pin!(run);
            if let Some(signal) = until {
                // Biased: a run that ended reports its own result, whatever the signal.
                tokio::select! {
                    biased;
                    result = &mut run => return result,
                    _ = signal => token.cancel(),
                }
            }
            run.await
        });
        Running {
            worker: Some(worker),
            shutdown,
            health,
        }
    }
}

impl IntoFuture for Run {
    type Output = Result<(), ConsumerError>;
    type IntoFuture = Running;

    /// Starts the consumer (see [`Run::spawn`]); the future resolves when it stopped.
    fn into_future(self) -> Running {
        self.spawn()
    }
}

/// A started consumer in `run` mode. Await it to wait until it stops (after
/// [`Run::until`]'s signal or a [`ShutdownHandle`]), or call [`Running::shutdown`].
///
/// Dropping it starts a graceful shutdown in the background (the stopping rule of the [module docs](self)):
/// nothing is left reading and renewing leases for ever, but the drop cannot wait for
/// in-flight handlers, the final checkpoint or the release of the leases.
#[must_use = "dropping a Running stops the consumer; await it or call shutdown()"]
pub struct Running {
    /// `None` once the result was returned.
    worker: Option<JoinHandle<Result<(), ConsumerError>>>,
    shutdown: CancellationToken,
    health: Arc<HealthState>,
}

impl Running {
    /// The worker's health now, for liveness and readiness probes (see [`Health`]).
    pub fn health(&self) -> Health {
        self.health.snapshot()
    }

    /// Stops the consumer gracefully: reading stops, in-flight handlers finish (at most
    /// the shutdown timeout), checkpoints are committed and leases released. Returns the
    /// run's result.
    pub async fn shutdown(self) -> Result<(), ConsumerError> {
        self.shutdown.cancel();
        self.await
    }

    /// A handle that stops this consumer gracefully from elsewhere.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        ShutdownHandle(self.shutdown.clone())
    }
}

impl Future for Running {
    type Output = Result<(), ConsumerError>;

    /// The run's result once it stopped; polled again after that (say, awaited and then
    /// shut down), an error saying the result was already returned.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(worker) = self.worker.as_mut() else {
            return Poll::Ready(Err(ConsumerError::Worker(
                "the run's result was already returned".to_owned(),
            )));
        };
        let joined = std::task::ready!(worker.poll_unpin(cx));
        self.worker = None;
        Poll::Ready(match joined {
            Ok(result) => result,
            Err(e) => Err(ConsumerError::Worker(e.to_string())),
        })
    }
}

impl Drop for Running {
    /// Starts the graceful shutdown in the background (harmless once it has stopped).
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A batch received but not handed out yet: it waits until it may start.
type Starting = (Batch, BoxFuture<'static, bool>);

/// The batches of a consumer in `stream` mode. Stopping follows the rule of the [module docs](self):
/// [`BatchStream::shutdown`] stops and returns the result; dropping the stream starts
/// the same graceful stop in the background.
#[must_use = "streams do nothing unless polled"]
pub struct BatchStream {
    rx: mpsc::Receiver<Batch>,
    worker: Option<JoinHandle<Result<(), ConsumerError>>>,
    shutdown: ShutdownHandle,
    starting: Option<Starting>,
    health: Arc<HealthState>,
}

impl BatchStream {
    /// The worker's health now, for liveness and readiness probes (see [`Health`]).
    pub fn health(&self) -> Health {
        self.health.snapshot()
    }

    /// A handle that stops the consumer gracefully.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Stops the consumer gracefully: reading stops, batches not handed out yet are
    /// given up (they are delivered again to whoever reads the shard next), batches
    /// already handed out may still be acknowledged until the shutdown timeout,
    /// checkpoints are committed and leases released. Returns the run's result.
    pub async fn shutdown(mut self) -> Result<(), ConsumerError> {
        self.shutdown.shutdown();
        self.give_up_queued();
        while let Some(batch) = self.rx.recv().await {
            abandon(&batch);
        }
        match self.worker.take() {
            Some(worker) => match worker.await {
                Ok(result) => result,
                Err(e) => Err(ConsumerError::Worker(e.to_string())),
            },
            None => Ok(()),
        }
    }

    /// Gives up every batch received but not handed out, so no shard's drain waits for it.
    fn give_up_queued(&mut self) {
        if let Some((batch, _)) = self.starting.take() {
            abandon(&batch);
        }
        while let Ok(batch) = self.rx.try_recv() {
            abandon(&batch);
        }
    }
}

fn abandon(batch: &Batch) {
    if let Some(ack) = &batch.ack {
        ack.abandon();
    }
}

impl Drop for BatchStream {
    /// Dropping the stream shuts the consumer down gracefully in the background (nothing
    /// is left reading and holding leases); batches not handed out are given up.
    fn drop(&mut self) {
        self.shutdown.shutdown();
        self.rx.close();
        self.give_up_queued();
    }
}

impl Stream for BatchStream {
    type Item = Result<Batch, ConsumerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some((_, may_start)) = self.starting.as_mut() {
                let may_start = std::task::ready!(may_start.poll_unpin(cx));
                if let Some((batch, _)) = self.starting.take() {
                    if may_start {
                        return Poll::Ready(Some(Ok(batch)));
                    }
                    // Batches read before a drain, restart or lost lease are given up,
                    // not handed out: whoever continues the shard reads them again.
                    abandon(&batch);
                }
                continue;
            }
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(batch)) => {
                    // Like a fresh read, a queued batch starts only on a lease known to be
                    // ours (it may have waited through a long pause of the process).
                    if let Some(ack) = batch.ack.clone() {
                        self.starting =
                            Some((batch, async move { ack.wait_start().await }.boxed()));
                        continue;
                    }
                    return Poll::Ready(Some(Ok(batch)));
                }
                Poll::Ready(None) => {
                    let Some(worker) = self.worker.as_mut() else {
                        return Poll::Ready(None);
                    };
                    let result = std::task::ready!(worker.poll_unpin(cx));
                    self.worker = None;
                    return Poll::Ready(match result {
                        Ok(Ok(())) => None,
                        Ok(Err(e)) => Some(Err(e)),
                        Err(e) => Some(Err(ConsumerError::Worker(e.to_string()))),
                    });
                }
                Poll::Pending => {
                    // The worker may have failed before delivering anything.
                    if let Some(worker) = self.worker.as_mut() {
                        if let Poll::Ready(result) = worker.poll_unpin(cx) {
                            self.worker = None;
                            match result {
                                Ok(Ok(())) => {}
                                Ok(Err(e)) => return Poll::Ready(Some(Err(e))),
                                Err(e) => {
                                    return Poll::Ready(Some(Err(ConsumerError::Worker(
                                        e.to_string(),
                                    ))))
                                }
                            }
                        }
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}
