//! A handler that records what it saw, and a consumer running it in a task.

use std::collections::HashSet;
use std::convert::Infallible;
use std::future::IntoFuture;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use shardflow::{Consumer, Message};
use tokio::sync::Notify;

use crate::within;

/// One handled record, in the order the handler saw it.
#[derive(Clone, Debug)]
pub struct Handled {
    /// The shard the record came from.
    pub shard: String,
    /// Its sequence number.
    pub sequence: shardflow::SequenceNumber,
    /// Its partition key.
    pub partition_key: String,
    /// Its value (the payload, a decimal number).
    pub value: usize,
}

/// Collects what a handler saw and wakes waiters when a count is reached.
#[derive(Clone, Default)]
pub struct Recorder {
    /// Every handled record, in order.
    pub handled: Arc<Mutex<Vec<Handled>>>,
    count: Arc<AtomicUsize>,
    changed: Arc<Notify>,
}

impl Recorder {
    /// Records `msg` (its payload must be a decimal number) and wakes waiters.
    pub fn record(&self, msg: &Message) {
        let value = std::str::from_utf8(&msg.payload).unwrap().parse().unwrap();
        self.handled.lock().unwrap().push(Handled {
            shard: msg.metadata.shard_id.to_string(),
            sequence: msg.metadata.sequence_number.clone(),
            partition_key: msg.metadata.partition_key.clone(),
            value,
        });
        self.count.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    /// How many records were handled.
    pub fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    /// Waits until at least `n` records were handled; panics after `limit`.
    pub async fn wait_for(&self, n: usize, limit: Duration) {
        let wait = async {
            loop {
                let notified = self.changed.notified();
                if self.count() >= n {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(limit, wait).await.is_err() {
            // Most tests write the values 0, 1, 2, ...: name the first ones still missing.
            let seen: HashSet<usize> = self.snapshot().iter().map(|h| h.value).collect();
            let missing: Vec<usize> = (0..n).filter(|v| !seen.contains(v)).take(10).collect();
            panic!(
                "only {} of {n} records handled within {limit:?}; the first values of 0..{n} \
                 not handled: {missing:?}",
                self.count()
            );
        }
    }

    /// Waits until every one of `values` was handled; panics after `limit`, naming the
    /// values still missing.
    pub async fn wait_for_values(&self, values: &[usize], limit: Duration) {
        let missing = || -> Vec<usize> {
            let seen: HashSet<usize> = self.snapshot().iter().map(|h| h.value).collect();
            values
                .iter()
                .copied()
                .filter(|v| !seen.contains(v))
                .collect()
        };
        let wait = async {
            loop {
                let notified = self.changed.notified();
                if missing().is_empty() {
                    return;
                }
                notified.await;
            }
        };
        if tokio::time::timeout(limit, wait).await.is_err() {
            panic!("values {:?} not handled within {limit:?}", missing());
        }
    }

    /// A copy of what was handled so far.
    pub fn snapshot(&self) -> Vec<Handled> {
        self.handled.lock().unwrap().clone()
    }
}

/// A handler service that records every message.
pub fn recording_handler(
    recorder: Recorder,
) -> impl tower::Service<Message, Response = (), Error = Infallible, Future = impl Send>
       + Clone
       + Send
       + 'static {
    tower::service_fn(move |msg: Message| {
        recorder.record(&msg);
        async { Ok::<_, Infallible>(()) }
    })
}

/// A consumer running `recording_handler` in a task.
pub struct Running {
    /// Stops the consumer.
    pub shutdown: shardflow::ShutdownHandle,
    task: tokio::task::JoinHandle<Result<(), shardflow::ConsumerError>>,
}

/// How long a graceful shutdown (drain, checkpoint, release) may take in a test.
pub const STOP_LIMIT: Duration = Duration::from_secs(60);

impl Running {
    /// Shuts down gracefully and waits (at most [`STOP_LIMIT`]) until the run returned
    /// without error.
    pub async fn stop(self) {
        self.shutdown.shutdown();
        within(STOP_LIMIT, "the consumer stops after shutdown()", self.task)
            .await
            .unwrap()
            .unwrap();
    }
}
/// Runs `consumer` with a handler that records into `recorder`.
pub fn start(consumer: Consumer, recorder: &Recorder) -> Running {
    start_service(consumer, recording_handler(recorder.clone()))
}

/// Runs `consumer` with `service` in a task.
pub fn start_service<S>(consumer: Consumer, service: S) -> Running
where
    S: tower::Service<Message> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display + Send,
{
    let shutdown = consumer.shutdown_handle();
    let task = tokio::spawn(consumer.run(service).into_future());
    Running { shutdown, task }
}
