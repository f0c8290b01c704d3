//! One stream's view of a multi-stream lease table: its rows, keyed in the table the
//! KCL's multi-stream way (`account:stream:creationEpoch:shardId`, `streamName` holding
//! `account:stream:creationEpoch`), appear as a single-stream table of bare shard ids
//! and stream names, so the coordinator runs per stream exactly as for one stream.

use std::sync::Arc;

use async_trait::async_trait;

use super::{Checkpoint, Lease, LeaseError, LeaseStore};
use crate::kinesis::StreamIdentity;

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

        // A hand-off request and its withdrawal go to the stream's row.
        let asked = orders.request_handoff(&taken, "w#2").await.unwrap();
        assert_eq!(asked.pending_owner.as_deref(), Some("w#2"));
        let withdrawn = orders.withdraw_handoff(&asked, "w#2").await.unwrap();
        assert_eq!(withdrawn.key, "shardId-000000000002");
        assert_eq!(withdrawn.pending_owner, None);
    }
}
