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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::MemoryLeaseStore;

    fn identity(name: &str, epoch: u64) -> StreamIdentity {
        StreamIdentity {
            account: "123456789012".into(),
            name: name.into(),
            creation_epoch: epoch,
        }
    }

    #[tokio::test]
    async fn each_stream_sees_its_own_rows_under_bare_shard_ids() {
        let table: Arc<dyn LeaseStore> = Arc::new(MemoryLeaseStore::default());
        let orders = StreamScopedStore::new(table.clone(), identity("orders", 1));
        let refunds = StreamScopedStore::new(table.clone(), identity("refunds", 1));
        // The same stream re-created: another identity, none of the old rows.
        let orders_again = StreamScopedStore::new(table.clone(), identity("orders", 2));
        let mut lease = Lease::new(
            "shardId-000000000002",
            vec!["shardId-000000000000".into()],
            Checkpoint::TrimHorizon,
        );
        lease.stream = Some("orders".into());
        assert!(orders.create(&lease).await.unwrap());
        assert!(refunds.create(&lease).await.unwrap());

        let stored: Vec<String> = table
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.key)
            .collect();
        assert!(stored.contains(&"123456789012:orders:1:shardId-000000000002".to_owned()));
        assert!(stored.contains(&"123456789012:refunds:1:shardId-000000000002".to_owned()));
        let raw = table
            .get("123456789012:orders:1:shardId-000000000002")
            .await
            .unwrap()
            .unwrap();
        assert_eq!(raw.stream.as_deref(), Some("123456789012:orders:1"));
        assert_eq!(raw.parents, vec!["shardId-000000000000".to_owned()]);

        let seen = orders.list().await.unwrap();
        assert_eq!(seen, vec![lease.clone()]);
        assert!(orders_again.list().await.unwrap().is_empty());

        let taken = orders.take(&seen[0], "w#1").await.unwrap();
        assert_eq!(taken.key, "shardId-000000000002");
        assert_eq!(taken.stream.as_deref(), Some("orders"));
        let refunds_row = &refunds.list().await.unwrap()[0];
        assert_eq!(
            refunds_row.owner, None,
            "the other stream's row is untouched"
        );

        // The owner's keys, as a filtered listing of the stream's rows gives them: bare
        // shard ids of this stream only (the same owner's row of another stream and of
        // the stream created again are left out).
        refunds.take(refunds_row, "w#1").await.unwrap();
        assert_eq!(
            orders.owned_keys("w#1").await.unwrap(),
            crate::lease::owned_by(orders.list().await.unwrap(), "w#1")
        );
        assert_eq!(
            orders.owned_keys("w#1").await.unwrap(),
            vec!["shardId-000000000002".to_owned()]
        );
        assert!(orders_again.owned_keys("w#1").await.unwrap().is_empty());
        assert_eq!(table.owned_keys("w#1").await.unwrap().len(), 2);

        // A hand-off request and its withdrawal go to the stream's row.
        let asked = orders.request_handoff(&taken, "w#2").await.unwrap();
        assert_eq!(asked.pending_owner.as_deref(), Some("w#2"));
        let withdrawn = orders.withdraw_handoff(&asked, "w#2").await.unwrap();
        assert_eq!(withdrawn.key, "shardId-000000000002");
        assert_eq!(withdrawn.pending_owner, None);
    }

    /// Counts the Scans (`list` calls) that reach the table.
    struct CountingScans {
        inner: Arc<MemoryLeaseStore>,
        scans: Arc<std::sync::atomic::AtomicUsize>,
    }

    #[async_trait]
    impl LeaseStore for CountingScans {
        async fn ensure_table(&self) -> Result<(), LeaseError> {
            self.inner.ensure_table().await
        }
        async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
            self.scans.fetch_add(1, Ordering::SeqCst);
            self.inner.list().await
        }
        async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
            self.inner.get(key).await
        }
        async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
            self.inner.create(lease).await
        }
        async fn take(&self, expected: &Lease, owner: &str) -> Result<Lease, LeaseError> {
            self.inner.take(expected, owner).await
        }
        async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
            self.inner.renew(expected).await
        }
        async fn checkpoint(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
            self.inner.checkpoint(expected, to).await
        }
        async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
            self.inner.release(expected).await
        }
        async fn request_handoff(&self, expected: &Lease, w: &str) -> Result<Lease, LeaseError> {
            self.inner.request_handoff(expected, w).await
        }
        async fn withdraw_handoff(&self, expected: &Lease, w: &str) -> Result<Lease, LeaseError> {
            self.inner.withdraw_handoff(expected, w).await
        }
        async fn request_reset(
            &self,
            expected: &Lease,
            to: &Checkpoint,
        ) -> Result<Lease, LeaseError> {
            self.inner.request_reset(expected, to).await
        }
        async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
            self.inner.reset(expected, to).await
        }
        async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
            self.inner.delete(expected).await
        }
        async fn claim_for_stream(&self, expected: &Lease, s: &str) -> Result<Lease, LeaseError> {
            self.inner.claim_for_stream(expected, s).await
        }
        async fn record_children(
            &self,
            expected: &Lease,
            c: &[String],
        ) -> Result<Lease, LeaseError> {
            self.inner.record_children(expected, c).await
        }
    }

    /// The memory backend with a lease table that counts its Scans.
    #[derive(Clone)]
    struct Counted {
        memory: crate::Memory,
        scans: Arc<std::sync::atomic::AtomicUsize>,
    }

    impl crate::Backend for Counted {
        fn kinesis(&self) -> Arc<dyn crate::kinesis::KinesisApi> {
            self.memory.kinesis()
        }
        fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
            Arc::new(CountingScans {
                inner: self.memory.table(table),
                scans: self.scans.clone(),
            })
        }
    }

    /// A worker reading four streams Scans its table once per lease round, not once per
    /// stream and round, and still reads every stream.
    #[tokio::test(start_paused = true)]
    async fn a_four_stream_worker_scans_once_per_round() {
        use crate::kinesis::{KinesisApi, PutRecord, StreamAdmin};
        use std::sync::atomic::AtomicUsize;
        let backend = Counted {
            memory: crate::Memory::new(),
            scans: Arc::new(AtomicUsize::new(0)),
        };
        let streams: Vec<String> = (0..4).map(|i| format!("s{i}")).collect();
        for stream in &streams {
            backend
                .memory
                .streams()
                .create_stream(stream, 1)
                .await
                .unwrap();
            backend
                .memory
                .streams()
                .put_records(
                    stream,
                    &[PutRecord {
                        data: bytes::Bytes::from_static(b"x"),
                        partition_key: "k".into(),
                        explicit_hash_key: None,
                    }],
                )
                .await
                .unwrap();
        }
        backend
            .memory
            .table("scans")
            .set_faults(crate::memory::LeaseFaults {
                latency: Duration::from_millis(8),
                ..Default::default()
            });
        let (seen, mut handled) = tokio::sync::mpsc::unbounded_channel::<()>();
        let running = crate::Consumer::builder()
            .streams(streams)
            .group("scans")
            .worker_id("w1")
            .seed(3)
            .backend(backend.clone())
            .build()
            .unwrap()
            .run(tower::service_fn(move |_m: crate::Message| {
                let _ = seen.send(());
                async { Ok::<_, std::convert::Infallible>(()) }
            }))
            .spawn();
        // Every stream's record is handled (a shared listing hides no stream's rows).
        tokio::time::timeout(Duration::from_secs(60), async {
            for _ in 0..4 {
                handled.recv().await;
            }
        })
        .await
        .expect("a record of each stream handled");
        // Steady state: 10 minutes of lease rounds, one every take interval (the lease
        // duration, 10 s), plus a shard sync a minute. A Scan per stream would be 4 a
        // round (240 and more).
        tokio::time::sleep(Duration::from_secs(30)).await;
        let before = backend.scans.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_secs(600)).await;
        let scans = backend.scans.load(Ordering::SeqCst) - before;
        assert!(
            (58..=66).contains(&scans),
            "{scans} Scans in 60 lease rounds of a 4-stream worker"
        );
        tokio::time::timeout(Duration::from_secs(60), running.shutdown())
            .await
            .expect("shutdown ends")
            .unwrap();
    }

    /// Calls that waited for a Scan get its rows even when the Scan took longer than the
    /// window: a slow table must not make one worker's coordinators Scan one after
    /// another (six 600 ms Scans in a row would miss the lease-call deadline). A call
    /// after this worker's own write, or after the window, Scans again.
    #[tokio::test(start_paused = true)]
    async fn callers_that_waited_for_a_slow_scan_share_it() {
        let table = Arc::new(MemoryLeaseStore::default());
        table.set_faults(crate::memory::LeaseFaults {
            latency: Duration::from_millis(600),
            ..Default::default()
        });
        let row = Lease::new("a", Vec::new(), Checkpoint::TrimHorizon);
        assert!(table.create(&row).await.unwrap());
        let shared = Arc::new(SharedListing::new(
            table.clone(),
            Duration::from_millis(400),
            crate::metrics::Labels::test(),
        ));
        let started = Instant::now();
        let calls: Vec<_> = (0..6)
            .map(|_| {
                let shared = shared.clone();
                tokio::spawn(async move { shared.list().await })
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.unwrap().unwrap().len(), 1);
        }
        assert!(
            started.elapsed() < Duration::from_millis(700),
            "six callers took {:?}: they Scanned one after another",
            started.elapsed()
        );
        assert_eq!(shared.scans.load(Ordering::SeqCst), 1);
        // An own write (even one answered after a Scan started) makes the next call Scan.
        shared.take(&row, "w#a").await.unwrap();
        let rows = shared.list().await.unwrap();
        assert_eq!(rows[0].owner.as_deref(), Some("w#a"));
        assert_eq!(shared.scans.load(Ordering::SeqCst), 2);
    }
}
