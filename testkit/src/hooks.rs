//! Forwarding wrappers of a backend's Kinesis API and lease store with hooks around every
//! call: the one base of the tests' frozen, killed, slow, failing or counting backends.
//!
//! A test implements [`Hooks`] (every method defaults to "let the call through") and
//! wraps its backend in [`Hooked`]. A wrapper that changes what a call does or answers
//! (not only around it) implements [`ForwardKinesis`] or [`ForwardStore`], overriding
//! only the calls it changes, and is used as [`Forward`]. A new method of `LeaseStore`
//! or `KinesisApi` needs one forwarding method in each, like its neighbours.

use std::future::Future;
use std::sync::Arc;

use async_trait::async_trait;
use shardflow::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, RecordsPage, ShardInfo, StartingPosition,
    StreamAdmin, StreamIdentity, Subscription,
};
use shardflow::lease::{Checkpoint, CoordinatorState, LeaderItem, Lease, LeaseError, LeaseStore};
use shardflow::Backend;

/// What a test does around the calls of a [`Hooked`] backend. `op` is the name of the
/// trait method called (`"take"`, `"get_records"`, ...).
#[async_trait]
pub trait Hooks: Send + Sync + 'static {
    /// Before a lease-store call on the row `key` (`None` for `list` and
    /// `ensure_table`): an error is returned instead of making the call; waiting here
    /// delays it (never returning hangs it).
    async fn before_lease(&self, op: &'static str, key: Option<&str>) -> Result<(), LeaseError> {
        let _ = (op, key);
        Ok(())
    }

    /// After a lease-store call answered, before its caller sees the answer: `row` is
    /// the row a successful write returned (`None` for an error and for the calls that
    /// return no single row).
    async fn after_lease(&self, op: &'static str, key: Option<&str>, row: Option<&Lease>) {
        let _ = (op, key, row);
    }

    /// Before a Kinesis call, as [`before_lease`](Self::before_lease).
    async fn before_kinesis(&self, op: &'static str) -> Result<(), KinesisError> {
        let _ = op;
        Ok(())
    }

    /// After a Kinesis call answered, before its caller sees the result.
    async fn after_kinesis(&self, op: &'static str) {
        let _ = op;
    }
}

/// A backend whose Kinesis API and lease stores call `hooks` around every call.
pub struct Hooked<B, H> {
    /// The backend whose calls are hooked.
    pub backend: B,
    /// The hooks, shared by every clone.
    pub hooks: Arc<H>,
}

// By hand: a derive would want `H: Clone`, and clones share the one `hooks`.
impl<B: Clone, H> Clone for Hooked<B, H> {
    fn clone(&self) -> Self {
        Hooked {
            backend: self.backend.clone(),
            hooks: self.hooks.clone(),
        }
    }
}

impl<B, H> Hooked<B, H> {
    /// Wraps `backend`, calling `hooks` around every call.
    pub fn new(backend: B, hooks: H) -> Self {
        Hooked {
            backend,
            hooks: Arc::new(hooks),
        }
    }
}

impl<B: Backend, H: Hooks> Backend for Hooked<B, H> {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        Arc::new(HookedKinesis {
            inner: self.backend.kinesis(),
            hooks: self.hooks.clone(),
        })
    }

    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        Arc::new(HookedStore {
            inner: self.backend.lease_store(table),
            hooks: self.hooks.clone(),
        })
    }

    fn admin(&self) -> Option<Arc<dyn StreamAdmin>> {
        self.backend.admin()
    }

    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        let inner = self.backend.table_streams()?;
        Some(Arc::new(HookedKinesis {
            inner,
            hooks: self.hooks.clone(),
        }))
    }
}

/// A lease store calling its hooks around every call of `inner`.
pub struct HookedStore<H> {
    /// The lease store the calls go to.
    pub inner: Arc<dyn LeaseStore>,
    /// The hooks, shared by every clone.
    pub hooks: Arc<H>,
}

impl<H: Hooks> HookedStore<H> {
    async fn call<T: Answer>(
        &self,
        op: &'static str,
        key: Option<&str>,
        call: impl Future<Output = Result<T, LeaseError>>,
    ) -> Result<T, LeaseError> {
        self.hooks.before_lease(op, key).await?;
        let result = call.await;
        let row = result.as_ref().ok().and_then(Answer::row);
        self.hooks.after_lease(op, key, row).await;
        result
    }
}

/// The answer of a lease-store call, for [`Hooks::after_lease`]: the row it returned,
/// if one.
trait Answer: Send + Sync {
    fn row(&self) -> Option<&Lease> {
        None
    }
}

impl Answer for Lease {
    fn row(&self) -> Option<&Lease> {
        Some(self)
    }
}

impl Answer for () {}
impl Answer for bool {}
impl Answer for Vec<Lease> {}
impl Answer for Vec<String> {}
impl Answer for Option<Lease> {}
impl Answer for LeaderItem {}
impl Answer for Option<LeaderItem> {}

#[async_trait]
impl<H: Hooks> LeaseStore for HookedStore<H> {
    fn coordinator_state(&self) -> Option<Arc<dyn CoordinatorState>> {
        Some(Arc::new(HookedState {
            inner: self.inner.coordinator_state()?,
            hooks: self.hooks.clone(),
        }))
    }
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.call("ensure_table", None, self.inner.ensure_table())
            .await
    }
    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        self.call("list", None, self.inner.list()).await
    }
    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        self.call("get", Some(key), self.inner.get(key)).await
    }
    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        self.call("owned_keys", None, self.inner.owned_keys(owner))
            .await
    }
    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        self.call("create", Some(&lease.key), self.inner.create(lease))
            .await
    }
    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        self.call(
            "take",
            Some(&expected.key),
            self.inner.take(expected, new_owner),
        )
        .await
    }
    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.call("renew", Some(&expected.key), self.inner.renew(expected))
            .await
    }
    async fn checkpoint(&self, expected: &Lease, at: &Checkpoint) -> Result<Lease, LeaseError> {
        self.call(
            "checkpoint",
            Some(&expected.key),
            self.inner.checkpoint(expected, at),
        )
        .await
    }
    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.call("release", Some(&expected.key), self.inner.release(expected))
            .await
    }
    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.call(
            "request_handoff",
            Some(&expected.key),
            self.inner.request_handoff(expected, worker),
        )
        .await
    }
    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.call(
            "withdraw_handoff",
            Some(&expected.key),
            self.inner.withdraw_handoff(expected, worker),
        )
        .await
    }
    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.call(
            "request_reset",
            Some(&expected.key),
            self.inner.request_reset(expected, to),
        )
        .await
    }
    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.call("reset", Some(&expected.key), self.inner.reset(expected, to))
            .await
    }
    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        self.call("delete", Some(&expected.key), self.inner.delete(expected))
            .await
    }
    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        self.call(
            "claim_for_stream",
            Some(&expected.key),
            self.inner.claim_for_stream(expected, stream),
        )
        .await
    }
    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        self.call(
            "record_children",
            Some(&expected.key),
            self.inner.record_children(expected, children),
        )
        .await
    }
}

/// A coordinator-state table calling the lease hooks around every call of `inner`, as
/// `leader_get`, `leader_claim`, `leader_renew`, `leader_release` and
/// `leader_ensure_table` on the item's key.
pub struct HookedState<H> {
    /// The coordinator state the calls go to.
    pub inner: Arc<dyn CoordinatorState>,
    /// The hooks, shared by every clone.
    pub hooks: Arc<H>,
}

impl<H: Hooks> HookedState<H> {
    async fn call<T: Answer>(
        &self,
        op: &'static str,
        key: Option<&str>,
        call: impl Future<Output = Result<T, LeaseError>>,
    ) -> Result<T, LeaseError> {
        self.hooks.before_lease(op, key).await?;
        let result = call.await;
        self.hooks.after_lease(op, key, None).await;
        result
    }
}

#[async_trait]
impl<H: Hooks> CoordinatorState for HookedState<H> {
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.call("leader_ensure_table", None, self.inner.ensure_table())
            .await
    }
    async fn get(&self, key: &str) -> Result<Option<LeaderItem>, LeaseError> {
        self.call("leader_get", Some(key), self.inner.get(key))
            .await
    }
    async fn claim(
        &self,
        key: &str,
        seen: Option<&LeaderItem>,
        owner: &str,
    ) -> Result<LeaderItem, LeaseError> {
        self.call(
            "leader_claim",
            Some(key),
            self.inner.claim(key, seen, owner),
        )
        .await
    }
    async fn renew(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        self.call("leader_renew", Some(&held.key), self.inner.renew(held))
            .await
    }
    async fn release(&self, held: &LeaderItem) -> Result<LeaderItem, LeaseError> {
        self.call("leader_release", Some(&held.key), self.inner.release(held))
            .await
    }
}

/// A Kinesis API calling its hooks around every call of `inner`.
pub struct HookedKinesis<H> {
    /// The Kinesis API the calls go to.
    pub inner: Arc<dyn KinesisApi>,
    /// The hooks, shared by every clone.
    pub hooks: Arc<H>,
}

impl<H: Hooks> HookedKinesis<H> {
    async fn call<T>(
        &self,
        op: &'static str,
        call: impl Future<Output = Result<T, KinesisError>>,
    ) -> Result<T, KinesisError> {
        self.hooks.before_kinesis(op).await?;
        let result = call.await;
        self.hooks.after_kinesis(op).await;
        result
    }
}

#[async_trait]
impl<H: Hooks> KinesisApi for HookedKinesis<H> {
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        self.call("list_shards", self.inner.list_shards(stream))
            .await
    }
    async fn is_updating(&self, stream: &str) -> Result<bool, KinesisError> {
        self.call("is_updating", self.inner.is_updating(stream))
            .await
    }
    async fn stream_identity(&self, stream: &str) -> Result<StreamIdentity, KinesisError> {
        self.call("stream_identity", self.inner.stream_identity(stream))
            .await
    }
    async fn max_record_size(&self, stream: &str) -> Result<usize, KinesisError> {
        self.call("max_record_size", self.inner.max_record_size(stream))
            .await
    }
    async fn resolve_table_stream(&self, table: &str) -> Result<String, KinesisError> {
        self.call(
            "resolve_table_stream",
            self.inner.resolve_table_stream(table),
        )
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
        self.call(
            "shard_iterator",
            self.inner.shard_iterator(stream, shard_id, from),
        )
        .await
    }
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        self.call("get_records", self.inner.get_records(iterator, limit))
            .await
    }
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        self.call("put_records", self.inner.put_records(stream, records))
            .await
    }
    async fn register_consumer(&self, stream: &str, name: &str) -> Result<String, KinesisError> {
        self.call(
            "register_consumer",
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
        self.call(
            "subscribe_to_shard",
            self.inner.subscribe_to_shard(consumer_arn, shard_id, from),
        )
        .await
    }
}

/// A Kinesis API that passes every call on to [`inner`](Self::inner) unless the
/// implementor overrides it: the base of a test's Kinesis wrapper, which overrides only
/// the calls it changes. Wrap it in [`Forward`] to use it as a [`KinesisApi`]. A new
/// method of `KinesisApi` needs one forwarding default here and one line in `Forward`.
#[async_trait]
pub trait ForwardKinesis: Send + Sync + 'static {
    /// The Kinesis API the calls go to.
    fn inner(&self) -> &dyn KinesisApi;

    /// [`KinesisApi::list_shards`].
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        self.inner().list_shards(stream).await
    }
    /// [`KinesisApi::is_updating`].
    async fn is_updating(&self, stream: &str) -> Result<bool, KinesisError> {
        self.inner().is_updating(stream).await
    }
    /// [`KinesisApi::stream_identity`].
    async fn stream_identity(&self, stream: &str) -> Result<StreamIdentity, KinesisError> {
        self.inner().stream_identity(stream).await
    }
    /// [`KinesisApi::max_record_size`].
    async fn max_record_size(&self, stream: &str) -> Result<usize, KinesisError> {
        self.inner().max_record_size(stream).await
    }
    /// [`KinesisApi::resolve_table_stream`].
    async fn resolve_table_stream(&self, table: &str) -> Result<String, KinesisError> {
        self.inner().resolve_table_stream(table).await
    }
    /// [`KinesisApi::records_may_be_aggregated`].
    fn records_may_be_aggregated(&self) -> bool {
        self.inner().records_may_be_aggregated()
    }
    /// [`KinesisApi::shard_iterator`].
    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        self.inner().shard_iterator(stream, shard_id, from).await
    }
    /// [`KinesisApi::get_records`].
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        self.inner().get_records(iterator, limit).await
    }
    /// [`KinesisApi::put_records`].
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        self.inner().put_records(stream, records).await
    }
    /// [`KinesisApi::register_consumer`].
    async fn register_consumer(&self, stream: &str, name: &str) -> Result<String, KinesisError> {
        self.inner().register_consumer(stream, name).await
    }
    /// [`KinesisApi::subscribe_to_shard`].
    async fn subscribe_to_shard(
        &self,
        consumer_arn: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<Subscription, KinesisError> {
        self.inner()
            .subscribe_to_shard(consumer_arn, shard_id, from)
            .await
    }
}

/// A lease store that passes every call on to [`inner`](Self::inner) unless the
/// implementor overrides it: the base of a test's lease-store wrapper, which overrides
/// only the calls it changes. Wrap it in [`Forward`] to use it as a [`LeaseStore`]. A
/// new method of `LeaseStore` needs one forwarding default here and one line in
/// `Forward`.
#[async_trait]
pub trait ForwardStore: Send + Sync + 'static {
    /// The lease store the calls go to.
    fn inner(&self) -> &dyn LeaseStore;

    /// [`LeaseStore::coordinator_state`].
    fn coordinator_state(&self) -> Option<Arc<dyn CoordinatorState>> {
        self.inner().coordinator_state()
    }
    /// [`LeaseStore::ensure_table`].
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.inner().ensure_table().await
    }
    /// [`LeaseStore::list`].
    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        self.inner().list().await
    }
    /// [`LeaseStore::get`].
    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        self.inner().get(key).await
    }
    /// [`LeaseStore::owned_keys`].
    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        self.inner().owned_keys(owner).await
    }
    /// [`LeaseStore::create`].
    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        self.inner().create(lease).await
    }
    /// [`LeaseStore::take`].
    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        self.inner().take(expected, new_owner).await
    }
    /// [`LeaseStore::renew`].
    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.inner().renew(expected).await
    }
    /// [`LeaseStore::checkpoint`].
    async fn checkpoint(&self, expected: &Lease, at: &Checkpoint) -> Result<Lease, LeaseError> {
        self.inner().checkpoint(expected, at).await
    }
    /// [`LeaseStore::release`].
    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.inner().release(expected).await
    }
    /// [`LeaseStore::request_handoff`].
    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.inner().request_handoff(expected, worker).await
    }
    /// [`LeaseStore::withdraw_handoff`].
    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.inner().withdraw_handoff(expected, worker).await
    }
    /// [`LeaseStore::request_reset`].
    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.inner().request_reset(expected, to).await
    }
    /// [`LeaseStore::reset`].
    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.inner().reset(expected, to).await
    }
    /// [`LeaseStore::delete`].
    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        self.inner().delete(expected).await
    }
    /// [`LeaseStore::claim_for_stream`].
    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        self.inner().claim_for_stream(expected, stream).await
    }
    /// [`LeaseStore::record_children`].
    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        self.inner().record_children(expected, children).await
    }
}

/// A [`ForwardKinesis`] as a [`KinesisApi`], a [`ForwardStore`] as a [`LeaseStore`];
/// derefs to the wrapper, so a test reaches the wrapper's own fields through it.
pub struct Forward<T>(pub T);

impl<T> std::ops::Deref for Forward<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

#[async_trait]
impl<T: ForwardKinesis> KinesisApi for Forward<T> {
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        self.0.list_shards(stream).await
    }
    async fn is_updating(&self, stream: &str) -> Result<bool, KinesisError> {
        self.0.is_updating(stream).await
    }
    async fn stream_identity(&self, stream: &str) -> Result<StreamIdentity, KinesisError> {
        self.0.stream_identity(stream).await
    }
    async fn max_record_size(&self, stream: &str) -> Result<usize, KinesisError> {
        self.0.max_record_size(stream).await
    }
    async fn resolve_table_stream(&self, table: &str) -> Result<String, KinesisError> {
        self.0.resolve_table_stream(table).await
    }
    fn records_may_be_aggregated(&self) -> bool {
        self.0.records_may_be_aggregated()
    }
    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        self.0.shard_iterator(stream, shard_id, from).await
    }
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        self.0.get_records(iterator, limit).await
    }
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        self.0.put_records(stream, records).await
    }
    async fn register_consumer(&self, stream: &str, name: &str) -> Result<String, KinesisError> {
        self.0.register_consumer(stream, name).await
    }
    async fn subscribe_to_shard(
        &self,
        consumer_arn: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<Subscription, KinesisError> {
        self.0
            .subscribe_to_shard(consumer_arn, shard_id, from)
            .await
    }
}

#[async_trait]
impl<T: ForwardStore> LeaseStore for Forward<T> {
    fn coordinator_state(&self) -> Option<Arc<dyn CoordinatorState>> {
        self.0.coordinator_state()
    }
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.0.ensure_table().await
    }
    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        self.0.list().await
    }
    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        self.0.get(key).await
    }
    async fn owned_keys(&self, owner: &str) -> Result<Vec<String>, LeaseError> {
        self.0.owned_keys(owner).await
    }
    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        self.0.create(lease).await
    }
    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        self.0.take(expected, new_owner).await
    }
    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.0.renew(expected).await
    }
    async fn checkpoint(&self, expected: &Lease, at: &Checkpoint) -> Result<Lease, LeaseError> {
        self.0.checkpoint(expected, at).await
    }
    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.0.release(expected).await
    }
    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.0.request_handoff(expected, worker).await
    }
    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.0.withdraw_handoff(expected, worker).await
    }
    async fn request_reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.0.request_reset(expected, to).await
    }
    async fn reset(&self, expected: &Lease, to: &Checkpoint) -> Result<Lease, LeaseError> {
        self.0.reset(expected, to).await
    }
    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        self.0.delete(expected).await
    }
    async fn claim_for_stream(&self, expected: &Lease, stream: &str) -> Result<Lease, LeaseError> {
        self.0.claim_for_stream(expected, stream).await
    }
    async fn record_children(
        &self,
        expected: &Lease,
        children: &[String],
    ) -> Result<Lease, LeaseError> {
        self.0.record_children(expected, children).await
    }
}
