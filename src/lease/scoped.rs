//! One stream's view of a multi-stream lease table: its rows, keyed in the table the
//! KCL's multi-stream way (`account:stream:creationEpoch:shardId`, `streamName` holding
//! `account:stream:creationEpoch`), appear as a single-stream table of bare shard ids
//! and stream names, so the coordinator runs per stream exactly as for one stream; and
//! the one listing of the table that all of a worker's streams share in a round.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{Checkpoint, Lease, LeaseError, LeaseStore};
use crate::kinesis::StreamIdentity;
use crate::metrics::Labels;

/// One Scan of the table per worker and round, whatever the number of its streams: the
/// multi-stream worker's coordinators list the table below their [`StreamScopedStore`]s
/// through this one store, and `list()` calls that come together share one Scan
/// (single-flight: a call made while a Scan runs waits for it and gets its rows, however
/// long it took; a call made within `window` of a Scan's start gets its rows too). Every
/// other call goes straight through.
///
/// Why sharing is never less safe than a Scan per coordinator:
/// - Decisions taken on a listing are all conditional writes (on the owner and counter,
///   or on the row's absence for a create), checked by the table when they land, so a
///   row that changed since it was listed makes a write fail, never land on the wrong
///   row; that holds for a listing of any age, and per coordinator it was already so.
/// - What a listing's age could change is how old a coordinator believes its view is
///   (lease expiry counts from when a counter was seen; a create is not sent on a
///   listing older than a renewal interval). A shared listing is older than a Scan of
///   one's own by at most `window` (or, for a call that waited, than the Scan it would
///   have sent itself after the one it waited for), the same as a Scan whose pages came back `window`
///   later; the window is an eighth of the renewal interval, well inside the renewal
///   margin those checks leave.
/// - This worker's own ownership changes are never hidden by a shared listing: a
///   take, release, hand-off request or withdrawal, reset, create or delete made
///   through this store after a Scan started makes that Scan's rows unusable for later
///   calls (only renewals and checkpoints, which change no owner and which the
///   coordinators track from their own writes, do not).
/// - Errors are not shared: a failed Scan fails only the calls that waited for it;
///   the next call Scans again.
pub(crate) struct SharedListing {
    inner: Arc<dyn LeaseStore>,
    window: Duration,
    labels: Labels,
    /// Ownership writes begun through this store (see the type's docs).
    writes: AtomicU64,
    /// Scans finished (good or not): a caller that sees it move while it waited for the
    /// lock gets that Scan's rows.
    scans: AtomicU64,
    /// The last good Scan: when it started, the write count then, its rows. Held while a
    /// Scan runs, which makes concurrent callers wait for it.
    last: tokio::sync::Mutex<Option<(Instant, u64, Vec<Lease>)>>,
}

impl SharedListing {
    /// `window`: how long after a Scan started its rows are still handed out. Each
    /// Scan is counted as a `list` request under `labels` (the coordinators' own
    /// stores then leave `list` uncounted).
    pub(crate) fn new(inner: Arc<dyn LeaseStore>, window: Duration, labels: Labels) -> Self {
        SharedListing {
            inner,
            window,
            labels,
            writes: AtomicU64::new(0),
            scans: AtomicU64::new(0),
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// Scans finished so far.
    #[cfg(test)]
    pub(crate) fn scans(&self) -> u64 {
        self.scans.load(Ordering::SeqCst)
    }

    /// Runs an ownership write, counted when it is sent and again when it is answered,
    /// so a Scan that overlapped it in any way is not handed out afterwards.
    async fn writing<T>(&self, write: impl std::future::Future<Output = T>) -> T {
        self.writes.fetch_add(1, Ordering::SeqCst);
        let result = write.await;
        self.writes.fetch_add(1, Ordering::SeqCst);
        result
    }
}

#[async_trait]
impl LeaseStore for SharedListing {
    /// The table's: one coordinator-state table per lease table.
    fn coordinator_state(&self) -> Option<Arc<dyn super::CoordinatorState>> {
        self.inner.coordinator_state()
    }

    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.inner.ensure_table().await
    }

    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        let scans_before = self.scans.load(Ordering::SeqCst);
        let mut last = self.last.lock().await;
        // A Scan that finished while this call waited for it is handed out whatever
        // its age (a slow Scan must not make the callers behind it Scan one by one);
        // an older one only within the window.
        let waited = self.scans.load(Ordering::SeqCst) != scans_before;
        if let Some((started, writes, rows)) = last.as_ref() {
            if (waited || started.elapsed() <= self.window)
                && *writes == self.writes.load(Ordering::SeqCst)
            {
                return Ok(rows.clone());
            }
        }
        let (started, writes) = (Instant::now(), self.writes.load(Ordering::SeqCst));
        let result = self.inner.list().await;
        self.labels.request(
            "dynamodb",
            "list",
            matches!(result, Err(LeaseError::Throttled(_))),
        );
        *last = match &result {
            Ok(rows) => Some((started, writes, rows.clone())),
            Err(_) => None,
        };
        self.scans.fetch_add(1, Ordering::SeqCst);
        result
    }

    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        self.inner.get(key).await
    }

    /// Straight through: a Query of the owner index is small and never shared (the
    /// rows it names are fetched one by one, fresh).
    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        self.inner.owned_keys(owner).await
    }

    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        self.writing(self.inner.create(lease)).await
    }

    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        self.writing(self.inner.take(expected, new_owner)).await
    }

    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.inner.renew(expected).await
    }

    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError> {
        self.inner.checkpoint(expected, checkpoint).await
    }

    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.writing(self.inner.release(expected)).await
    }

    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.writing(self.inner.request_handoff(expected, worker))
            .await
    }

    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.writing(self.inner.withdraw_handoff(expected, worker))
            .await
    }

    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.writing(self.inner.request_reset(expected, to)).await
    }

    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.writing(self.inner.reset(expected, to)).await
    }

    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        self.writing(self.inner.delete(expected)).await
    }

    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        self.writing(self.inner.claim_for_stream(expected, stream))
            .await
    }

    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        self.writing(self.inner.record_children(expected, children))
            .await
    }
}

/// The rows of one stream in a shared multi-stream table. Rows of other streams (and
/// single-stream rows) are not listed; every key and `streamName` is translated on the
/// way in and out. Parent and child ids are bare shard ids in both forms, as in the KCL.
pub(crate) struct StreamScopedStore {
    inner: Arc<dyn LeaseStore>,
    identity: StreamIdentity,
    /// `account:stream:creationEpoch`.
    serialized: String,
}

impl StreamScopedStore {
    pub(crate) fn new(inner: Arc<dyn LeaseStore>, identity: StreamIdentity) -> Self {
        StreamScopedStore {
            serialized: identity.to_string(),
            inner,
            identity,
        }
    }

    /// The row as stored in the table.
    fn table_row(&self, lease: &Lease) -> Lease {
        let mut row = lease.clone();
        row.key = self.identity.lease_key(&lease.key);
        if row.stream.as_deref() == Some(self.identity.name.as_str()) {
            row.stream = Some(self.serialized.clone());
        }
        row
    }

    /// The table's row as this stream's coordinator sees it, if it is one of ours.
    fn scoped_row(&self, mut row: Lease) -> Option<Lease> {
        let (identity, shard) = StreamIdentity::split_lease_key(&row.key)?;
        if identity != self.identity {
            return None;
        }
        row.key = shard.to_owned();
        if row.stream.as_deref() == Some(self.serialized.as_str()) {
            row.stream = Some(self.identity.name.clone());
        }
        Some(row)
    }

    fn ours(&self, row: Lease) -> Result<Lease, LeaseError> {
        let key = row.key.clone();
        self.scoped_row(row)
            .ok_or_else(|| LeaseError::Corrupt(format!("row {key} is not of this stream")))
    }
}

#[async_trait]
impl LeaseStore for StreamScopedStore {
    /// The table's: one coordinator-state table per lease table.
    fn coordinator_state(&self) -> Option<Arc<dyn super::CoordinatorState>> {
        self.inner.coordinator_state()
    }

    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.inner.ensure_table().await
    }

    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        Ok(self
            .inner
            .list()
            .await?
            .into_iter()
            .filter_map(|row| self.scoped_row(row))
            .collect())
    }

    /// The owner's keys of this stream, as bare shard ids (the owner's rows of other
    /// streams in the table are left out).
    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        Ok(self
            .inner
            .owned_keys(owner)
            .await?
            .into_iter()
            .filter_map(|key| {
                let (identity, shard) = StreamIdentity::split_lease_key(&key)?;
                (identity == self.identity).then(|| shard.to_owned())
            })
            .collect())
    }

    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        match self.inner.get(&self.identity.lease_key(key)).await? {
            Some(row) => self.ours(row).map(Some),
            None => Ok(None),
        }
    }

    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        self.inner.create(&self.table_row(lease)).await
    }

    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        let row = self
            .inner
            .take(&self.table_row(expected), new_owner)
            .await?;
        self.ours(row)
    }

    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        let row = self.inner.renew(&self.table_row(expected)).await?;
        self.ours(row)
    }

    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError> {
        let row = self
            .inner
            .checkpoint(&self.table_row(expected), checkpoint)
            .await?;
        self.ours(row)
    }

    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        let row = self.inner.release(&self.table_row(expected)).await?;
        self.ours(row)
    }

    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        let row = self
            .inner
            .request_handoff(&self.table_row(expected), worker)
            .await?;
        self.ours(row)
    }

    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        let row = self
            .inner
            .withdraw_handoff(&self.table_row(expected), worker)
            .await?;
        self.ours(row)
    }

    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        let row = self
            .inner
            .request_reset(&self.table_row(expected), to)
            .await?;
        self.ours(row)
    }

    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        let row = self.inner.reset(&self.table_row(expected), to).await?;
        self.ours(row)
    }

    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        self.inner.delete(&self.table_row(expected)).await
    }

    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        let stream = if stream == self.identity.name {
            self.serialized.as_str()
        } else {
            stream
        };
        let row = self
            .inner
            .claim_for_stream(&self.table_row(expected), stream)
            .await?;
        self.ours(row)
    }

    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        let row = self
            .inner
            .record_children(&self.table_row(expected), children)
            .await?;
        self.ours(row)
    }
}

/// The view of a lease table that the coordinator of one stream of a DynamoDB table
/// gets when the group follows the table ([`ConsumerBuilder::table_stream`]): rows of
/// the table's other streams (the one disabled before this one was enabled, or the one
/// enabled since) are hidden, so that it never takes, reads or cleans up another
/// stream's shards while the group moves from one to the next. Rows of anything else
/// show, so a table of another table's stream is still refused.
///
/// [`ConsumerBuilder::table_stream`]: crate::ConsumerBuilder::table_stream
pub(crate) struct OneTableStream {
    inner: Arc<dyn LeaseStore>,
    stream: String,
    /// `arn:...:table/<name>/stream/`: what every stream ARN of the table starts with.
    prefix: String,
}

impl OneTableStream {
    /// `stream` is one stream ARN of the table.
    pub(crate) fn new(inner: Arc<dyn LeaseStore>, stream: &str) -> Self {
        let prefix = stream
            .rfind("/stream/")
            .map_or(stream, |at| &stream[..at + "/stream/".len()]);
        OneTableStream {
            prefix: prefix.to_owned(),
            stream: stream.to_owned(),
            inner,
        }
    }

    /// Whether `row` is the row of another stream of the same table.
    pub(crate) fn other_stream_of_table(&self, row: &Lease) -> bool {
        row.stream
            .as_deref()
            .is_some_and(|s| s != self.stream && s.starts_with(&self.prefix))
    }
}

#[async_trait]
impl LeaseStore for OneTableStream {
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.inner.ensure_table().await
    }

    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        let mut rows = self.inner.list().await?;
        rows.retain(|row| !self.other_stream_of_table(row));
        Ok(rows)
    }

    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        Ok(self
            .inner
            .get(key)
            .await?
            .filter(|row| !self.other_stream_of_table(row)))
    }

    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        self.inner.owned_keys(owner).await
    }

    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        self.inner.create(lease).await
    }

    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        self.inner.take(expected, new_owner).await
    }

    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.inner.renew(expected).await
    }

    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError> {
        self.inner.checkpoint(expected, checkpoint).await
    }

    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.inner.release(expected).await
    }

    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.inner.request_handoff(expected, worker).await
    }

    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.inner.withdraw_handoff(expected, worker).await
    }

    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.inner.request_reset(expected, to).await
    }

    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.inner.reset(expected, to).await
    }

    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        self.inner.delete(expected).await
    }

    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        self.inner.claim_for_stream(expected, stream).await
    }

    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        self.inner.record_children(expected, children).await
    }

    fn coordinator_state(&self) -> Option<Arc<dyn super::CoordinatorState>> {
        self.inner.coordinator_state()
    }
}
