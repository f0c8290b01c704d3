//! The consumer: a builder, then either `run(service)` (the framework calls a tower
//! service per record or per batch and acknowledges on success) or `stream()` (batches
//! the caller acknowledges).
//!
//! Inside, a `coordinator` per worker manages leases and starts a `shard` task per
//! held lease; each shard task runs a `reader` and commits the watermark of
//! acknowledged records.

mod config;
mod coordinator;
mod deadline;
mod dispatch;
mod reader;
mod shard;

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

pub use config::{CheckpointPolicy, Config, ConfigError, ConsumerBuilder, InitialPosition};
use coordinator::{Coordinator, Sink, SpawnDispatch};

/// Why a consumer stopped with an error.
#[derive(Debug, thiserror::Error)]
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
    /// The worker task panicked or was cancelled.
    #[error("the worker task failed: {0}")]
    Worker(String),
}

impl ConsumerError {
    /// Whether the same call may succeed later (throttling, network, service errors).
    pub fn is_transient(&self) -> bool {
        match self {
            ConsumerError::Lease(e) => matches!(
                e,
                LeaseError::Throttled(_) | LeaseError::TimedOut { .. } | LeaseError::Other(_)
            ),
            ConsumerError::Kinesis(e) => e.is_retryable(),
            _ => false,
        }
    }
}

/// A consumer of one stream as one worker of a consumer group.
pub struct Consumer {
    config: Arc<Config>,
    kinesis: Arc<dyn KinesisApi>,
    store: Arc<dyn LeaseStore>,
    shutdown: CancellationToken,
}

impl ConsumerBuilder {
    /// Validates the configuration and builds the consumer; a bad value is refused
    /// with an error naming the field.
    pub fn build(mut self) -> Result<Consumer, ConfigError> {
        let config = self.validate()?;
        let backend = self.take_backend();
        Ok(Consumer {
            kinesis: backend.kinesis(),
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

    /// Runs `service` on every record: records of a shard one at a time in sequence
    /// order, shards concurrently (one clone of the service each). `Ok` marks the
    /// record handled; an error stops the shard, which reads again from its checkpoint
    /// after a backoff. Await the returned [`Run`]; add [`Run::until`] to stop on a signal.
    pub fn run<S>(self, service: S) -> Run
    where
        S: Service<Message> + Clone + Send + 'static,
        S::Future: Send,
        S::Error: Display + Send,
    {
        self.run_with(spawn_with(service, |rx, service| {
            tokio::spawn(dispatch::records(rx, service))
        }))
    }

    /// Like [`Consumer::run`], with the service called once per batch (one GetRecords
    /// read of one shard): `Ok` acknowledges the whole batch.
    pub fn run_batches<S>(self, service: S) -> Run
    where
        S: Service<Batch> + Clone + Send + 'static,
        S::Future: Send,
        S::Error: Display + Send,
    {
        self.run_with(spawn_with(service, |rx, service| {
            tokio::spawn(dispatch::batches(rx, service))
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
    /// each once handled. The stream ends after a graceful shutdown (see
    /// [`Consumer::shutdown_handle`]); keep polling it until then so in-flight batches
    /// can be acknowledged.
    pub fn stream(self) -> BatchStream {
        let (tx, rx) = mpsc::channel(self.config.prefetch_batches.max(1) * 4);
        let coordinator = Coordinator::new(
            self.config.clone(),
            self.kinesis.clone(),
            self.store.clone(),
            Sink::Shared(tx),
        );
        let worker = tokio::spawn(coordinator.run(self.shutdown.clone()));
        BatchStream {
            rx,
            worker: Some(worker),
            shutdown: ShutdownHandle(self.shutdown),
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
    Box::new(move |rx| {
        let service = service.lock().unwrap_or_else(|p| p.into_inner()).clone();
        spawn(rx, service)
    })
}

/// A running consumer in `run` mode; await it.
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
}

impl IntoFuture for Run {
    type Output = Result<(), ConsumerError>;
    type IntoFuture = BoxFuture<'static, Result<(), ConsumerError>>;

    fn into_future(self) -> Self::IntoFuture {
        let Run {
            consumer,
            spawn,
            until,
        } = self;
        let shutdown = consumer.shutdown.clone();
        let coordinator = Coordinator::new(
            consumer.config,
            consumer.kinesis,
            consumer.store,
            Sink::PerShard(spawn),
        );
        async move {
            let run = coordinator.run(shutdown.clone());
            tokio::pin!(run);
            match until {
                Some(signal) => {
                    tokio::select! {
                        result = &mut run => return result,
                        _ = signal => shutdown.cancel(),
                    }
                    run.await
                }
                None => run.await,
            }
        }
        .boxed()
    }
}

/// The batches of a consumer in `stream` mode.
pub struct BatchStream {
    rx: mpsc::Receiver<Batch>,
    worker: Option<JoinHandle<Result<(), ConsumerError>>>,
    shutdown: ShutdownHandle,
}

impl BatchStream {
    /// A handle that stops the consumer gracefully.
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }
}

impl Drop for BatchStream {
    /// Dropping the stream shuts the consumer down gracefully (nothing is left reading
    /// and holding leases in the background).
    fn drop(&mut self) {
        self.shutdown.shutdown();
    }
}

impl Stream for BatchStream {
    type Item = Result<Batch, ConsumerError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            match self.rx.poll_recv(cx) {
                Poll::Ready(Some(batch)) => {
                    // Batches read before a drain or restart are given up, not handed out:
                    // they will be read again by whoever continues the shard.
                    if let Some(ack) = &batch.ack {
                        if !ack.should_start() {
                            ack.abandon();
                            continue;
                        }
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
