//! The metrics the consumer records through the [`metrics`] facade: every name, type and
//! label lives here, so the README's table and the code cannot drift apart. Install any
//! `metrics` recorder (Prometheus, OpenTelemetry, StatsD exporters) to collect them;
//! without one every call is a no-op.
//!
//! Labels: `stream` and `group` on every series, `shard` only on the per-shard series
//! ([`MILLIS_BEHIND_LATEST`], [`RECORDS_HANDLED`], [`BYTES_HANDLED`],
//! [`CHECKPOINT_AGE`], [`SHARD_THROUGHPUT_BYTES`], [`SHARD_THROUGHPUT_RECORDS`]), so the number of series grows with the
//! shards a worker held, not with records. Histograms are per worker (never per shard)
//! because each costs a series per bucket.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ::metrics::{Counter, Gauge, Histogram, Label};

/// Gauge, per shard: `MillisBehindLatest` of the shard's last read.
pub const MILLIS_BEHIND_LATEST: &str = "shardflow_millis_behind_latest";
/// Counter, per shard: records acknowledged (handled).
pub const RECORDS_HANDLED: &str = "shardflow_records_handled_total";
/// Counter, per shard: payload bytes of the records acknowledged.
pub const BYTES_HANDLED: &str = "shardflow_bytes_handled_total";
/// Histogram, seconds: one handler call (a record in `run`, a batch in `run_batches`).
pub const HANDLER_DURATION: &str = "shardflow_handler_duration_seconds";
/// Histogram: records per batch handed to the handlers (one read of one shard).
pub const BATCH_RECORDS: &str = "shardflow_batch_records";
/// Counter: handler calls that returned an error.
pub const HANDLER_ERRORS: &str = "shardflow_handler_errors_total";
/// Counter: shard restarts from the checkpoint after a handler failure or a `nack`
/// (the records after the checkpoint are delivered again).
pub const HANDLER_RETRIES: &str = "shardflow_handler_retries_total";
/// Counter, label `outcome` = `ok` | `conflict` (the lease was lost) | `error`:
/// checkpoint writes to the lease table.
pub const CHECKPOINT_WRITES: &str = "shardflow_checkpoint_writes_total";
/// Histogram, seconds: one checkpoint write.
pub const CHECKPOINT_DURATION: &str = "shardflow_checkpoint_duration_seconds";
/// Counter, label `event` = `taken` (an unowned lease) | `expired` (taken from an owner
/// that stopped renewing) | `stolen` (taken after a hand-off request timed out) |
/// `handed_off` (given to another worker after draining) | `lost`.
pub const LEASE_EVENTS: &str = "shardflow_lease_events_total";
/// Counter, label `service` = `kinesis` | `dynamodb`: throttled calls.
pub const THROTTLES: &str = "shardflow_throttles_total";
/// Counter: shard iterators that expired and were acquired again.
pub const ITERATOR_RENEWALS: &str = "shardflow_iterator_renewals_total";
/// Counter, labels `service` and `op` (e.g. `GetRecords`, `checkpoint`): every remote
/// call the consumer made, which is what the bill counts.
pub const REQUESTS: &str = "shardflow_requests_total";
/// Gauge: leases this worker holds.
pub const LEASES_HELD: &str = "shardflow_leases_held";
/// Gauge: records delivered to handlers (or the stream) and neither acknowledged nor
/// given up yet.
pub const RECORDS_IN_FLIGHT: &str = "shardflow_records_in_flight";
/// Gauge: shards of this worker that are stuck (records handed out and none handled
/// for `stuck_after`; see [`ShardHealth::stuck_for`](crate::consumer::ShardHealth::stuck_for)).
pub const SHARDS_STUCK: &str = "shardflow_shards_stuck";

/// Gauge, per shard, seconds: how long the shard's checkpoint has not been current on the
/// worker that holds it. The clock restarts when a checkpoint write lands and whenever
/// the worker finds nothing to commit (every record it read is handled and covered by
/// the stored checkpoint: an idle shard caught up with the tip stays near 0, however
/// long ago its last write was). It grows while handled records are not committed
/// (checkpoint writes failing) or records wait to be handled (a hung or failing handler):
/// those are the records a crash now would deliver again. Refreshed at least every
/// checkpoint interval (every lease duration with `CheckpointPolicy::EveryBatch`); 0 once
/// the shard is no longer read here.
pub const CHECKPOINT_AGE: &str = "shardflow_checkpoint_age_seconds";

/// Gauge, per shard: the shard's recent throughput in record data bytes per second, as
/// this worker measured it for its lease row (smoothed over the renewal intervals; set
/// at each renewal of a shard this worker holds).
pub const SHARD_THROUGHPUT_BYTES: &str = "shardflow_shard_throughput_bytes_per_second";
/// Gauge, per shard: the shard's recent throughput in records per second (as
/// [`SHARD_THROUGHPUT_BYTES`]).
pub const SHARD_THROUGHPUT_RECORDS: &str = "shardflow_shard_throughput_records_per_second";
/// Gauge: this worker's load, the sum of [`SHARD_THROUGHPUT_BYTES`] over the shards it
/// holds (set at each renewal round).
pub const WORKER_LOAD_BYTES: &str = "shardflow_worker_load_bytes_per_second";
/// Gauge: the most loaded worker's load divided by the mean load per worker, as this
/// worker's last full lease round saw the table (1 is perfectly even; with
/// [`BalanceBy::Count`](crate::consumer::BalanceBy::Count) it shows what balancing by
/// throughput would even out). Set only once some lease carries a measurement.
pub const BALANCE_IMBALANCE_RATIO: &str = "shardflow_balance_imbalance_ratio";

/// Gauge: 1 while this worker cannot know the group's leader (the coordinator-state
/// table refuses its calls or is gone) and so lists the lease table and takes expired
/// leases every round itself; 0 otherwise.
pub const LEADER_UNKNOWN: &str = "shardflow_leader_unknown";

/// A lease event, the `event` label of [`LEASE_EVENTS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LeaseEvent {
    Taken,
    Expired,
    Stolen,
    HandedOff,
    Lost,
}

impl LeaseEvent {
    fn label(self) -> &'static str {
        match self {
            LeaseEvent::Taken => "taken",
            LeaseEvent::Expired => "expired",
            LeaseEvent::Stolen => "stolen",
            LeaseEvent::HandedOff => "handed_off",
            LeaseEvent::Lost => "lost",
        }
    }
}

/// The `stream` and `group` labels of one consumer, cheap to clone.
#[derive(Clone, Debug)]
pub(crate) struct Labels {
    stream: Arc<str>,
    group: Arc<str>,
}

impl Labels {
    /// Labels for a unit test's parts.
    #[cfg(test)]
    pub(crate) fn test() -> Self {
        Labels {
            stream: "test".into(),
            group: "test".into(),
        }
    }

    /// The labels of a consumer's metrics: its stream and group.
    pub(crate) fn new(stream: &str, group: &str) -> Self {
        Labels {
            stream: stream.into(),
            group: group.into(),
        }
    }

    fn with(&self, extra: &[(&'static str, &'static str)]) -> Vec<Label> {
        let mut labels = vec![
            Label::new("stream", self.stream.clone()),
            Label::new("group", self.group.clone()),
        ];
        labels.extend(extra.iter().map(|(k, v)| Label::new(*k, *v)));
        labels
    }

    pub(crate) fn counter(&self, name: &'static str) -> Counter {
        ::metrics::counter!(name, self.with(&[]))
    }

    pub(crate) fn gauge(&self, name: &'static str) -> Gauge {
        ::metrics::gauge!(name, self.with(&[]))
    }

    pub(crate) fn histogram(&self, name: &'static str) -> Histogram {
        ::metrics::histogram!(name, self.with(&[]))
    }

    pub(crate) fn lease_event(&self, event: LeaseEvent) {
        ::metrics::counter!(LEASE_EVENTS, self.with(&[("event", event.label())])).increment(1);
    }

    pub(crate) fn leases_held(&self, n: usize) {
        self.gauge(LEASES_HELD).set(n as f64);
    }

    /// Sets `shard`'s throughput gauges ([`SHARD_THROUGHPUT_BYTES`],
    /// [`SHARD_THROUGHPUT_RECORDS`]): `bytes` and `records` per second.
    pub(crate) fn shard_throughput(&self, shard: &str, bytes: f64, records: f64) {
        let labels = || {
            let mut l = self.with(&[]);
            l.push(Label::new("shard", shard.to_owned()));
            l
        };
        ::metrics::gauge!(SHARD_THROUGHPUT_BYTES, labels()).set(bytes);
        ::metrics::gauge!(SHARD_THROUGHPUT_RECORDS, labels()).set(records);
    }

    /// Counts one remote call (and a throttled answer) of `service`.
    pub(crate) fn request(&self, service: &'static str, op: &'static str, throttled: bool) {
        ::metrics::counter!(REQUESTS, self.with(&[("service", service), ("op", op)])).increment(1);
        if throttled {
            ::metrics::counter!(THROTTLES, self.with(&[("service", service)])).increment(1);
        }
    }

    pub(crate) fn checkpoint_written(&self, took: Duration, outcome: &'static str) {
        ::metrics::counter!(CHECKPOINT_WRITES, self.with(&[("outcome", outcome)])).increment(1);
        self.histogram(CHECKPOINT_DURATION)
            .record(took.as_secs_f64());
    }

    /// The handles of one shard's series, registered once per shard task.
    pub(crate) fn shard(&self, shard: &Arc<str>) -> Arc<ShardMetrics> {
        let labels = || {
            let mut l = self.with(&[]);
            l.push(Label::new("shard", shard.clone()));
            l
        };
        Arc::new(ShardMetrics {
            millis_behind: ::metrics::gauge!(MILLIS_BEHIND_LATEST, labels()),
            checkpoint_age: ::metrics::gauge!(CHECKPOINT_AGE, labels()),
            records: ::metrics::counter!(RECORDS_HANDLED, labels()),
            bytes: ::metrics::counter!(BYTES_HANDLED, labels()),
            batch_records: self.histogram(BATCH_RECORDS),
            in_flight: self.gauge(RECORDS_IN_FLIGHT),
            iterator_renewals: self.counter(ITERATOR_RENEWALS),
            retries: self.counter(HANDLER_RETRIES),
            stuck: self.gauge(SHARDS_STUCK),
        })
    }
}

/// One shard's metric handles (recording through a handle costs no lookup).
#[derive(Debug)]
pub(crate) struct ShardMetrics {
    pub(crate) millis_behind: Gauge,
    /// The shard's [`CHECKPOINT_AGE`].
    pub(crate) checkpoint_age: Gauge,
    records: Counter,
    bytes: Counter,
    batch_records: Histogram,
    in_flight: Gauge,
    pub(crate) iterator_renewals: Counter,
    pub(crate) retries: Counter,
    /// The worker's count of stuck shards ([`SHARDS_STUCK`]).
    pub(crate) stuck: Gauge,
}

impl ShardMetrics {
    /// A batch of `records` records (`bytes` of payload) is handed out: it counts as in
    /// flight until the returned guard (kept by its acknowledgement handle) is dropped.
    pub(crate) fn delivered(self: &Arc<Self>, records: usize, bytes: usize) -> Arc<InFlight> {
        self.batch_records.record(records as f64);
        self.in_flight.increment(records as f64);
        Arc::new(InFlight {
            shard: self.clone(),
            records: records as u64,
            bytes: bytes as u64,
            counted: AtomicBool::new(false),
        })
    }
}

/// A delivered batch's share of [`RECORDS_IN_FLIGHT`], and what its acknowledgement
/// adds to [`RECORDS_HANDLED`] and [`BYTES_HANDLED`].
#[derive(Debug)]
pub(crate) struct InFlight {
    shard: Arc<ShardMetrics>,
    records: u64,
    bytes: u64,
    counted: AtomicBool,
}

impl InFlight {
    /// The whole batch was acknowledged (counted once, however often it is called).
    pub(crate) fn handled(&self) {
        if !self.counted.swap(true, Ordering::Relaxed) {
            self.shard.records.increment(self.records);
            self.shard.bytes.increment(self.bytes);
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shard.in_flight.decrement(self.records as f64);
    }
}

/// Wraps the user's handler in `run` and `run_batches` mode: times each call
/// ([`HANDLER_DURATION`]) and counts its errors ([`HANDLER_ERRORS`]).
#[derive(Clone, Debug)]
pub(crate) struct Measured<S> {
    inner: S,
    duration: Histogram,
    errors: Counter,
}

impl<S> Measured<S> {
    pub(crate) fn new(inner: S, labels: &Labels) -> Self {
        Measured {
            inner,
            duration: labels.histogram(HANDLER_DURATION),
            errors: labels.counter(HANDLER_ERRORS),
        }
    }
}

impl<S, R> tower::Service<R> for Measured<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        ResponseFuture {
            inner: self.inner.call(request),
            started: tokio::time::Instant::now(),
            duration: self.duration.clone(),
            errors: self.errors.clone(),
        }
    }
}

pin_project_lite::pin_project! {
    /// The future of a [`Measured`] call.
    pub(crate) struct ResponseFuture<F> {
        #[pin]
        inner: F,
        started: tokio::time::Instant,
        duration: Histogram,
        errors: Counter,
    }
}

impl<F, T, E> std::future::Future for ResponseFuture<F>
where
    F: std::future::Future<Output = Result<T, E>>,
{
    type Output = Result<T, E>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let result = std::task::ready!(this.inner.poll(cx));
        this.duration.record(this.started.elapsed().as_secs_f64());
        if result.is_err() {
            this.errors.increment(1);
        }
        std::task::Poll::Ready(result)
    }
}
