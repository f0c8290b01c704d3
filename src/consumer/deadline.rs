//! Deadlines on every remote call the consumer makes, whatever the backend: the lease
//! store and the reader's Kinesis calls are wrapped here once, so no caller can wait for
//! ever on a call that never answers (a hung connection, a stuck service). The SDK's own
//! timeouts ([`AwsTimeouts`](crate::backend::AwsTimeouts)) bound the AWS backend as well; these
//! bounds hold for any backend and are tied to the lease timings.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, RecordsPage, ShardInfo, StartingPosition,
    StreamIdentity, Subscription,
};
use crate::lease::{Checkpoint, CoordinatorState, LeaderItem, Lease, LeaseError, LeaseStore};
use crate::metrics::Labels;

/// How long a call that waits for AWS to create something may take in all: the
/// lease table check (which may wait for the table to become ACTIVE) and the
/// registration of an enhanced fan-out consumer. The AWS backends give up on their own
/// after 60 s and 120 s; this bounds any backend.
pub(crate) const SETUP_CALL_TIMEOUT: Duration = Duration::from_secs(180);

/// A lease store whose every call ends within `timeout` ([`LeaseError::TimedOut`]
/// otherwise); `ensure_table` within [`SETUP_CALL_TIMEOUT`].
/// Every call is also counted ([`crate::metrics::REQUESTS`], throttles).
pub(crate) struct BoundedLeaseStore {
    inner: Arc<dyn LeaseStore>,
    timeout: Duration,
    labels: Labels,
    /// Whether `list` calls are counted here (not when a shared listing below counts
    /// the Scans it makes: [`crate::lease::SharedListing`]).
    count_list: bool,
}

impl BoundedLeaseStore {
    pub(crate) fn new(inner: Arc<dyn LeaseStore>, timeout: Duration, labels: Labels) -> Self {
        BoundedLeaseStore {
            inner,
            timeout,
            labels,
            count_list: true,
        }
    }

    /// Leaves `list` calls uncounted: the store below shares Scans between callers and
    /// counts each Scan it makes (one request, however many calls it answered).
    pub(crate) fn listing_counted_below(mut self) -> Self {
        self.count_list = false;
        self
    }

    async fn bound<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, LeaseError>>,
    ) -> Result<T, LeaseError> {
        if op == "list" && !self.count_list {
            return bound_call(op, self.timeout, call).await;
        }
        bound_counted(&self.labels, op, self.timeout, call).await
    }
}

/// The error of a remote call, as the deadlines need it: what a call past its deadline
/// becomes, and what counts as throttled in the request metrics.
trait CallError: Sized {
    /// The `service` label of the request metrics.
    const SERVICE: &'static str;
    fn timed_out(op: &'static str, after: Duration) -> Self;
    fn is_throttled(&self) -> bool;
}

impl CallError for LeaseError {
    const SERVICE: &'static str = "dynamodb";

    fn timed_out(op: &'static str, after: Duration) -> Self {
        tracing::warn!(op, ?after, "lease store call timed out");
        LeaseError::TimedOut { op, after }
    }

    fn is_throttled(&self) -> bool {
        matches!(self, LeaseError::Throttled(_))
    }
}

impl CallError for KinesisError {
    const SERVICE: &'static str = "kinesis";

    fn timed_out(op: &'static str, after: Duration) -> Self {
        KinesisError::Other(format!("{op} did not answer within {after:?}").into())
    }

    fn is_throttled(&self) -> bool {
        matches!(self, KinesisError::Throttled(_))
    }
}

/// `call`, or the error [`CallError::timed_out`] if it has not ended `after` from now.
async fn bound_call<T, E: CallError>(
    op: &'static str,
    after: Duration,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    tokio::time::timeout(after, call)
        .await
        .unwrap_or_else(|_| Err(E::timed_out(op, after)))
}

/// [`bound_call`], counted in the request metrics.
async fn bound_counted<T, E: CallError>(
    labels: &Labels,
    op: &'static str,
    after: Duration,
    call: impl Future<Output = Result<T, E>>,
) -> Result<T, E> {
    let result = bound_call(op, after, call).await;
    let throttled = matches!(&result, Err(e) if e.is_throttled());
    labels.request(E::SERVICE, op, throttled);
    result
}

/// A coordinator-state table whose every call ends within `timeout`
/// ([`LeaseError::TimedOut`] otherwise); `ensure_table` within [`SETUP_CALL_TIMEOUT`].
/// Every call is counted as a DynamoDB request (`leader_get`, `leader_claim`, ...).
pub(crate) struct BoundedCoordinatorState {
    inner: Arc<dyn CoordinatorState>,
    timeout: Duration,
    labels: Labels,
}

#[async_trait]
impl CoordinatorState for BoundedCoordinatorState {
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.labels
            .request("dynamodb", "leader_ensure_table", false);
        bound_call(
            "leader_ensure_table",
            SETUP_CALL_TIMEOUT,
            self.inner.ensure_table(),
        )
        .await
    }

    async fn get(&self, key: &str) -> Result<Option<LeaderItem>, LeaseError> {
        bound_counted(
            &self.labels,
            "leader_get",
            self.timeout,
            self.inner.get(key),
        )
        .await
    }

    async fn claim(
        &self,
        key: &str,
        seen: Option<&LeaderItem>,
        owner: &str,
    ) -> Result<LeaderItem, LeaseError> {
        let call = self.inner.claim(key, seen, owner);
        bound_counted(&self.labels, "leader_claim", self.timeout, call).await
    }

    async fn renew(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        bound_counted(
            &self.labels,
            "leader_renew",
            self.timeout,
            self.inner.renew(held),
        )
        .await
    }

    async fn release(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        let call = self.inner.release(held);
        bound_counted(&self.labels, "leader_release", self.timeout, call).await
    }
}

#[async_trait]
impl LeaseStore for BoundedLeaseStore {
    /// The coordinator-state table below, its calls under the same deadline.
    fn coordinator_state(&self) -> Option<Arc<dyn CoordinatorState>> {
        let inner = self.inner.coordinator_state()?;
        Some(Arc::new(BoundedCoordinatorState {
            inner,
            timeout: self.timeout,
            labels: self.labels.clone(),
        }))
    }

    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.labels.request("dynamodb", "ensure_table", false);
        bound_call(
            "ensure_table",
            SETUP_CALL_TIMEOUT,
            self.inner.ensure_table(),
        )
        .await
    }

    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        self.bound("list", self.inner.list()).await
    }

    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        self.bound("owned_keys", self.inner.owned_keys(owner)).await
    }

    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        self.bound("get", self.inner.get(key)).await
    }

    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        self.bound("create", self.inner.create(lease)).await
    }

    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        self.bound("take", self.inner.take(expected, new_owner))
            .await
    }

    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.bound("renew", self.inner.renew(expected)).await
    }

    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError> {
        self.bound("checkpoint", self.inner.checkpoint(expected, checkpoint))
            .await
    }

    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.bound("release", self.inner.release(expected)).await
    }

    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.bound(
            "request_handoff",
            self.inner.request_handoff(expected, worker),
        )
        .await
    }

    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.bound(
            "withdraw_handoff",
            self.inner.withdraw_handoff(expected, worker),
        )
        .await
    }

    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        self.bound("delete", self.inner.delete(expected)).await
    }

    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.bound("request_reset", self.inner.request_reset(expected, to))
            .await
    }

    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.bound("reset", self.inner.reset(expected, to)).await
    }

    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        self.bound(
            "claim_for_stream",
            self.inner.claim_for_stream(expected, stream),
        )
        .await
    }

    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        self.bound(
            "record_children",
            self.inner.record_children(expected, children),
        )
        .await
    }
}

/// The Kinesis calls of the readers and the coordinator, each ending within `timeout`
/// (a retryable [`KinesisError::Other`] otherwise, so the reader backs off and reads
/// again from its last delivered record). Calls that wait on purpose (creating a stream,
/// registering a fan-out consumer, resharding) and the events of a subscription (a
/// long-lived stream) are passed through unbounded.
/// Every bounded call is also counted ([`crate::metrics::REQUESTS`], throttles).
pub(crate) struct BoundedKinesis {
    inner: Arc<dyn KinesisApi>,
    timeout: Duration,
    labels: Labels,
}

impl BoundedKinesis {
    pub(crate) fn new(inner: Arc<dyn KinesisApi>, timeout: Duration, labels: Labels) -> Self {
        BoundedKinesis {
            inner,
            timeout,
            labels,
        }
    }

    async fn bound<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, KinesisError>>,
    ) -> Result<T, KinesisError> {
        bound_counted(&self.labels, op, self.timeout, call).await
    }
}

#[async_trait]
impl KinesisApi for BoundedKinesis {
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        self.bound("ListShards", self.inner.list_shards(stream))
            .await
    }

    async fn is_updating(&self, stream: &str) -> Result<bool, KinesisError> {
        self.bound("DescribeStreamSummary", self.inner.is_updating(stream))
            .await
    }

    async fn stream_identity(&self, stream: &str) -> Result<StreamIdentity, KinesisError> {
        self.bound("DescribeStreamSummary", self.inner.stream_identity(stream))
            .await
    }

    async fn max_record_size(&self, stream: &str) -> Result<usize, KinesisError> {
        self.bound("DescribeStreamSummary", self.inner.max_record_size(stream))
            .await
    }

    async fn resolve_table_stream(&self, table: &str) -> Result<String, KinesisError> {
        self.bound("DescribeTable", self.inner.resolve_table_stream(table))
            .await
    }

    fn records_may_be_aggregated(&self) -> bool {
        self.inner.records_may_be_aggregated()
    }

    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        self.bound(
            "GetShardIterator",
            self.inner.shard_iterator(stream, shard_id, from),
        )
        .await
    }

    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        self.bound("GetRecords", self.inner.get_records(iterator, limit))
            .await
    }

    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        self.bound("PutRecords", self.inner.put_records(stream, records))
            .await
    }

    async fn register_consumer(&self, stream: &str, name: &str) -> Result<String, KinesisError> {
        bound_call(
            "RegisterStreamConsumer",
            SETUP_CALL_TIMEOUT,
            self.inner.register_consumer(stream, name),
        )
        .await
    }

    async fn subscribe_to_shard(
        &self,
        consumer_arn: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<Subscription, KinesisError> {
        self.bound(
            "SubscribeToShard",
            self.inner.subscribe_to_shard(consumer_arn, shard_id, from),
        )
        .await
    }
}
