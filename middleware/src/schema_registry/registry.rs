//! Where writer schemas come from: the [`SchemaRegistry`] trait, the embedded
//! [`MemoryRegistry`] and the bounded [`CachedRegistry`] every lookup of the layer and
//! the encoder goes through.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use crate::codec::{DataFormat, WriterSchema};
use crate::BoxError;

/// A schema registry: writer schemas by version id, and version ids by schema name and
/// definition.
#[async_trait]
pub trait SchemaRegistry: Send + Sync + 'static {
    /// The schema of version `id` (Glue's `GetSchemaVersion`).
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError>;

    /// The version id of `schema` under `schema_name` (Glue's `GetSchemaByDefinition`).
    ///
    /// When it is not registered yet and `register` is true (auto-registration), it is
    /// registered as the reference serializer does: as a new version of the schema
    /// (`RegisterSchemaVersion`) when the schema exists, or by creating the schema with
    /// the definition's data format and this as its first version (`CreateSchema`) when
    /// it does not. With `register` false an unknown definition is
    /// [`RegistryError::NotRegistered`].
    async fn version_id(
        &self,
        schema_name: &str,
        schema: &WriterSchema,
        register: bool,
    ) -> Result<Uuid, RegistryError>;
}

#[async_trait]
impl<R: SchemaRegistry + ?Sized> SchemaRegistry for Arc<R> {
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
        (**self).schema_version(id).await
    }

    async fn version_id(
        &self,
        schema_name: &str,
        schema: &WriterSchema,
        register: bool,
    ) -> Result<Uuid, RegistryError> {
        (**self).version_id(schema_name, schema, register).await
    }
}

/// Why a registry call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The registry knows no schema version with this id. Permanent: the record names a
    /// schema that does not exist (or was deleted).
    #[error("schema version {0} is not in the registry")]
    UnknownVersion(Uuid),
    /// The definition is not registered under the schema name and auto-registration is
    /// off. Permanent until someone registers it.
    #[error("the schema definition is not registered under {schema_name:?} and auto-registration is off")]
    NotRegistered {
        /// The schema name looked up.
        schema_name: String,
    },
    /// The registry refused to register the definition: its compatibility check failed,
    /// the definition is not valid in its data format, or (auto-registration) the schema
    /// exists in another data format. Permanent until the schema, the definition or the
    /// compatibility setting changes.
    #[error("the registry refused the schema version: {0}")]
    Rejected(String),
    /// The registry refused the call or could not be reached (throttled, access denied,
    /// a network error). Transient.
    #[error("the schema registry is unavailable")]
    Unavailable(#[source] BoxError),
    /// The call did not answer within the deadline. Transient.
    #[error("the schema registry did not answer within {0:?}")]
    TimedOut(Duration),
}

impl RegistryError {
    /// Whether the same call may succeed later ([`Unavailable`](Self::Unavailable),
    /// [`TimedOut`](Self::TimedOut)).
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            RegistryError::Unavailable(_) | RegistryError::TimedOut(_)
        )
    }
}

/// An embedded registry for development and tests: no AWS account, nothing persisted.
///
/// Clones share the registry. Version ids are given out in order (not random): the
/// `n`-th registration gets `00000000-0000-4000-8000-00000000000n`, so tests see the
/// same ids on every run. [`MemoryRegistry::insert`] adds a version with an id of your
/// choosing (one read from a record written elsewhere).
#[derive(Clone, Default)]
pub struct MemoryRegistry {
    state: Arc<Mutex<MemoryState>>,
}

#[derive(Default)]
struct MemoryState {
    versions: HashMap<Uuid, WriterSchema>,
    by_definition: HashMap<(String, WriterSchema), Uuid>,
    /// Each schema's data format, set by its first version.
    schemas: HashMap<String, DataFormat>,
    registered: u64,
}

impl MemoryRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `schema` under `schema_name` (or finds it, when that definition is
    /// there already) and returns its version id.
    pub fn register(&self, schema_name: &str, schema: WriterSchema) -> Uuid {
        let mut state = self.lock();
        let key = (schema_name.to_owned(), schema);
        if let Some(id) = state.by_definition.get(&key) {
            return *id;
        }
        state.registered += 1;
        let id = Uuid::from_u64_pair(
            0x0000_0000_0000_4000,
            0x8000_0000_0000_0000 | state.registered,
        );
        state.versions.insert(id, key.1.clone());
        state.schemas.entry(key.0.clone()).or_insert(key.1.format);
        state.by_definition.insert(key, id);
        id
    }

    /// Adds `schema` as version `id` under `schema_name` (replacing what `id` held).
    pub fn insert(&self, id: Uuid, schema_name: &str, schema: WriterSchema) {
        let mut state = self.lock();
        state.versions.insert(id, schema.clone());
        state
            .schemas
            .entry(schema_name.to_owned())
            .or_insert(schema.format);
        state
            .by_definition
            .insert((schema_name.to_owned(), schema), id);
    }

    /// The data format of the schema named `schema_name`, when the registry has it (set
    /// by its first version).
    pub fn data_format(&self, schema_name: &str) -> Option<DataFormat> {
        self.lock().schemas.get(schema_name).copied()
    }

    /// How many versions the registry holds.
    pub fn len(&self) -> usize {
        self.lock().versions.len()
    }

    /// Whether the registry holds no version.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryState> {
        // A panic while the lock is held cannot leave the maps half-updated (each
        // update is one insert), so a poisoned lock is still consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl fmt::Debug for MemoryRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegistry")
            .field("versions", &self.len())
            .finish()
    }
}

#[async_trait]
impl SchemaRegistry for MemoryRegistry {
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
        self.lock()
            .versions
            .get(&id)
            .cloned()
            .ok_or(RegistryError::UnknownVersion(id))
    }

    async fn version_id(
        &self,
        schema_name: &str,
        schema: &WriterSchema,
        register: bool,
    ) -> Result<Uuid, RegistryError> {
        let (found, format) = {
            let state = self.lock();
            let key = (schema_name.to_owned(), schema.clone());
            (
                state.by_definition.get(&key).copied(),
                state.schemas.get(schema_name).copied(),
            )
        };
        match found {
            Some(id) => Ok(id),
            // A schema has one data format, as in Glue: a definition in another is refused.
            None if register && format.is_some_and(|f| f != schema.format) => {
                Err(RegistryError::Rejected(format!(
                    "schema {schema_name:?} is {:?}, the definition {:?}",
                    format.unwrap_or(schema.format),
                    schema.format
                )))
            }
            // Creates the schema when it has none, adds a version otherwise.
            None if register => Ok(self.register(schema_name, schema.clone())),
            None => Err(RegistryError::NotRegistered {
                schema_name: schema_name.to_owned(),
            }),
        }
    }
}

/// The default number of schema versions (and of definitions) a [`CachedRegistry`] keeps.
pub const DEFAULT_CACHE_CAPACITY: usize = 1_000;
/// The default deadline of one registry call through a [`CachedRegistry`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a [`CachedRegistry`] leaves the registry alone after a transient failure
/// (the first time; the pause doubles while failures go on, up to
/// [`MAX_OUTAGE_PAUSE`]).
pub const MIN_OUTAGE_PAUSE: Duration = Duration::from_secs(1);
/// The longest pause of a [`CachedRegistry`] between calls to a registry that keeps
/// failing.
pub const MAX_OUTAGE_PAUSE: Duration = Duration::from_secs(10);
/// How long a [`CachedRegistry`] remembers that a version id is unknown to the registry.
pub const UNKNOWN_VERSION_TTL: Duration = Duration::from_secs(1);

/// A registry behind two bounded caches (versions by id, ids by name and definition),
/// each call under a deadline.
///
/// A version is fetched once per cache (concurrent misses of one id make one call), so
/// share one `CachedRegistry` (it is `Clone`, and the layer's clones share theirs) for
/// once-per-process lookups. Answers are cached; a version id the registry does not know
/// is remembered for [`UNKNOWN_VERSION_TTL`] only (so that the records waiting on it, and
/// those naming it in the next moment, make one call, and a version registered late is
/// still found). A registry that failed transiently (unavailable,
/// timed out) is not hammered: for a pause after the failure ([`MIN_OUTAGE_PAUSE`],
/// doubling while failures go on, up to [`MAX_OUTAGE_PAUSE`]; reset by an answer) every
/// lookup that would call it fails at once with [`RegistryError::Unavailable`], so the
/// records waiting on one version during an outage make one call, not one each. Schema
/// versions never change in Glue, so entries do not expire; the least recently used go
/// when the cache is full.
///
/// Every lookup is counted in [`metrics::SCHEMA_LOOKUPS`](crate::metrics::SCHEMA_LOOKUPS),
/// and as a hit or a miss.
pub struct CachedRegistry<R> {
    shared: Arc<Cached<R>>,
}

struct Cached<R> {
    inner: R,
    versions: quick_cache::sync::Cache<Uuid, WriterSchema>,
    ids: quick_cache::sync::Cache<(Arc<str>, WriterSchema), Uuid>,
    /// Version ids the registry said it does not know, and when.
    unknown: quick_cache::sync::Cache<Uuid, tokio::time::Instant>,
    timeout: Duration,
    outage: Mutex<Outage>,
}

/// The registry's last transient failure: no call before `until`.
struct Outage {
    until: Option<tokio::time::Instant>,
    pauses: shardflow::backoff::Backoff,
}

impl<R> Clone for CachedRegistry<R> {
    fn clone(&self) -> Self {
        CachedRegistry {
            shared: self.shared.clone(),
        }
    }
}

impl<R> fmt::Debug for CachedRegistry<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedRegistry")
            .field("versions", &self.shared.versions.len())
            .field("timeout", &self.shared.timeout)
            .finish()
    }
}

impl<R: SchemaRegistry> CachedRegistry<R> {
    /// Caches `inner`'s answers, [`DEFAULT_CACHE_CAPACITY`] of each kind, each call under
    /// [`DEFAULT_CALL_TIMEOUT`].
    pub fn new(inner: R) -> Self {
        Self::with_limits(inner, DEFAULT_CACHE_CAPACITY, DEFAULT_CALL_TIMEOUT)
    }

    /// Caches at most `capacity` versions (and `capacity` definitions; at least 1), each
    /// call of `inner` under `timeout` ([`RegistryError::TimedOut`] past it).
    pub fn with_limits(inner: R, capacity: usize, timeout: Duration) -> Self {
        let capacity = capacity.max(1);
        CachedRegistry {
            shared: Arc::new(Cached {
                inner,
                versions: quick_cache::sync::Cache::new(capacity),
                ids: quick_cache::sync::Cache::new(capacity),
                unknown: quick_cache::sync::Cache::new(capacity),
                timeout,
                outage: Mutex::new(Outage {
                    until: None,
                    pauses: shardflow::backoff::Backoff::new(MIN_OUTAGE_PAUSE, MAX_OUTAGE_PAUSE, 0)
                        .without_jitter(),
                }),
            }),
        }
    }

    /// The registry below the cache.
    pub fn get_ref(&self) -> &R {
        &self.shared.inner
    }

    /// Calls the registry under the deadline, unless it failed transiently less than a
    /// pause ago.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<T, RegistryError>>,
    ) -> Result<T, RegistryError> {
        if let Some(until) = self.outage().until {
            let now = tokio::time::Instant::now();
            if now < until {
                return Err(RegistryError::Unavailable(
                    format!(
                        "the registry failed a moment ago; not called again for {:?}",
                        until - now
                    )
                    .into(),
                ));
            }
        }
        let answer = match tokio::time::timeout(self.shared.timeout, call).await {
            Ok(answer) => answer,
            Err(_) => Err(RegistryError::TimedOut(self.shared.timeout)),
        };
        let mut outage = self.outage();
        match &answer {
            Err(e) if e.is_transient() => {
                let pause = outage.pauses.next_delay();
                outage.until = Some(tokio::time::Instant::now() + pause);
            }
            _ => {
                outage.until = None;
                outage.pauses.reset();
            }
        }
        answer
    }

    fn outage(&self) -> std::sync::MutexGuard<'_, Outage> {
        // Two plain assignments under the lock: a poisoned lock still holds a valid state.
        self.shared.outage.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn count(missed: bool) {
    ::metrics::counter!(crate::metrics::SCHEMA_LOOKUPS).increment(1);
    if missed {
        ::metrics::counter!(crate::metrics::SCHEMA_MISSES).increment(1);
    } else {
        ::metrics::counter!(crate::metrics::SCHEMA_HITS).increment(1);
    }
}

#[async_trait]
impl<R: SchemaRegistry> SchemaRegistry for CachedRegistry<R> {
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
        let missed = AtomicBool::new(false);
        let answer = self
            .shared
            .versions
            .get_or_insert_async(&id, async {
                missed.store(true, Ordering::Relaxed);
                let unknown = &self.shared.unknown;
                if let Some(since) = unknown.get(&id) {
                    if since.elapsed() < UNKNOWN_VERSION_TTL {
                        return Err(RegistryError::UnknownVersion(id));
                    }
                }
                let answer = self.bounded(self.shared.inner.schema_version(id)).await;
                if let Err(RegistryError::UnknownVersion(_)) = &answer {
                    unknown.insert(id, tokio::time::Instant::now());
                }
                answer
            })
            .await;
        count(missed.load(Ordering::Relaxed));
        answer
    }

    async fn version_id(
        &self,
        schema_name: &str,
        schema: &WriterSchema,
        register: bool,
    ) -> Result<Uuid, RegistryError> {
        let key = (Arc::<str>::from(schema_name), schema.clone());
        let missed = AtomicBool::new(false);
        let answer = self
            .shared
            .ids
            .get_or_insert_async(&key, async {
                missed.store(true, Ordering::Relaxed);
                self.bounded(self.shared.inner.version_id(schema_name, schema, register))
                    .await
            })
            .await;
        count(missed.load(Ordering::Relaxed));
        if let Ok(id) = &answer {
            // The writer's own schema: a consumer in this process reading it back needs
            // no call either.
            self.shared.versions.insert(*id, schema.clone());
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    fn avro(def: &str) -> WriterSchema {
        WriterSchema {
            format: DataFormat::Avro,
            definition: Arc::from(def),
        }
    }

    /// A registry that counts calls and fails the first `failures` of them.
    struct Counting {
        inner: MemoryRegistry,
        calls: AtomicUsize,
        failures: usize,
    }

    #[async_trait]
    impl SchemaRegistry for Counting {
        async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
            if self.calls.fetch_add(1, Ordering::SeqCst) < self.failures {
                return Err(RegistryError::Unavailable("throttled".into()));
            }
            self.inner.schema_version(id).await
        }
        async fn version_id(
            &self,
            n: &str,
            s: &WriterSchema,
            r: bool,
        ) -> Result<Uuid, RegistryError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.inner.version_id(n, s, r).await
        }
    }

    #[tokio::test]
    async fn memory_registry_registers_once_and_refuses_unknown_definitions() {
        let registry = MemoryRegistry::new();
        let err = registry
            .version_id("orders", &avro("a"), false)
            .await
            .unwrap_err();
        assert!(matches!(err, RegistryError::NotRegistered { .. }), "{err}");
        assert!(
            registry.is_empty(),
            "auto-registration is off: nothing registered"
        );
        let id = registry
            .version_id("orders", &avro("a"), true)
            .await
            .unwrap();
        assert_eq!(
            registry
                .version_id("orders", &avro("a"), false)
                .await
                .unwrap(),
            id
        );
        assert_eq!(registry.register("orders", avro("a")), id);
        assert_ne!(registry.register("orders", avro("b")), id);
        assert_eq!(registry.schema_version(id).await.unwrap(), avro("a"));
        let unknown = Uuid::from_u128(7);
        assert!(matches!(
            registry.schema_version(unknown).await,
            Err(RegistryError::UnknownVersion(u)) if u == unknown
        ));
    }

    /// Auto-registration as the reference serializer does it: off, nothing is created;
    /// on, an unknown schema is created with the definition's data format and a known
    /// one gets a new version; a definition in another data format is refused.
    #[tokio::test]
    async fn auto_registration_creates_missing_schemas_and_adds_versions() {
        let registry = MemoryRegistry::new();
        let json = WriterSchema::new(DataFormat::JsonSchema, r#"{"type":"object"}"#);
        assert!(matches!(
            registry.version_id("people", &json, false).await,
            Err(RegistryError::NotRegistered { .. })
        ));
        assert_eq!(registry.data_format("people"), None, "not created");
        let first = registry.version_id("people", &json, true).await.unwrap();
        assert_eq!(registry.data_format("people"), Some(DataFormat::JsonSchema));
        let v2 = WriterSchema::new(DataFormat::JsonSchema, r#"{"type":"object","title":"P"}"#);
        let second = registry.version_id("people", &v2, true).await.unwrap();
        assert_ne!(first, second, "a new version of the existing schema");
        assert_eq!(registry.len(), 2);
        let err = registry
            .version_id("people", &avro("a"), true)
            .await
            .unwrap_err();
        assert!(matches!(err, RegistryError::Rejected(_)), "{err}");
        assert!(!err.is_transient());
        assert_eq!(registry.len(), 2, "nothing registered");
        // A schema of its own may be Avro.
        registry
            .version_id("orders", &avro("a"), true)
            .await
            .unwrap();
        assert_eq!(registry.data_format("orders"), Some(DataFormat::Avro));
    }

    #[tokio::test(start_paused = true)]
    async fn cache_asks_once_per_version_and_never_caches_errors() {
        let memory = MemoryRegistry::new();
        let id = memory.register("orders", avro("a"));
        let cached = CachedRegistry::new(Counting {
            inner: memory,
            calls: AtomicUsize::new(0),
            failures: 1,
        });
        let err = cached.schema_version(id).await.unwrap_err();
        assert!(err.is_transient());
        // Asked again once the pause after the failure is over.
        tokio::time::advance(MIN_OUTAGE_PAUSE).await;
        for _ in 0..100 {
            assert_eq!(cached.schema_version(id).await.unwrap(), avro("a"));
        }
        assert_eq!(
            cached.get_ref().calls.load(Ordering::SeqCst),
            2,
            "one failure, one fetch"
        );
        let unknown = Uuid::from_u128(1);
        assert!(cached.schema_version(unknown).await.is_err());
        assert!(cached.schema_version(unknown).await.is_err());
        assert_eq!(cached.get_ref().calls.load(Ordering::SeqCst), 3);
        tokio::time::advance(UNKNOWN_VERSION_TTL).await;
        assert!(cached.schema_version(unknown).await.is_err());
        assert_eq!(
            cached.get_ref().calls.load(Ordering::SeqCst),
            4,
            "unknown asked again after a while"
        );
    }

    /// A registry that answers after `delay`, with an outage while `down` is set.
    struct Slow {
        inner: MemoryRegistry,
        calls: AtomicUsize,
        down: AtomicBool,
        delay: Duration,
    }

    #[async_trait]
    impl SchemaRegistry for Slow {
        async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(self.delay).await;
            if self.down.load(Ordering::SeqCst) {
                return Err(RegistryError::Unavailable("ThrottlingException".into()));
            }
            self.inner.schema_version(id).await
        }
        async fn version_id(
            &self,
            n: &str,
            s: &WriterSchema,
            r: bool,
        ) -> Result<Uuid, RegistryError> {
            self.inner.version_id(n, s, r).await
        }
    }

    /// Many records waiting on one version while the registry is down make one call, not
    /// one each; lookups of other versions do not call it either until the pause is over;
    /// the pause doubles while the outage goes on and an answer ends it.
    #[tokio::test(start_paused = true)]
    async fn an_outage_is_one_call_for_all_waiters_then_backs_off() {
        let memory = MemoryRegistry::new();
        let a = memory.register("orders", avro("a"));
        let b = memory.register("orders", avro("b"));
        let cached = CachedRegistry::new(Slow {
            inner: memory,
            calls: AtomicUsize::new(0),
            down: AtomicBool::new(true),
            delay: Duration::from_millis(100),
        });
        let calls = |c: &CachedRegistry<Slow>| c.get_ref().calls.load(Ordering::SeqCst);
        let waiters: Vec<_> = (0..20)
            .map(|_| {
                let cached = cached.clone();
                tokio::spawn(async move { cached.schema_version(a).await })
            })
            .collect();
        for waiter in waiters {
            let err = waiter.await.unwrap().unwrap_err();
            assert!(err.is_transient(), "{err}");
        }
        assert_eq!(calls(&cached), 1, "20 waiters, one call");
        assert!(cached.schema_version(b).await.unwrap_err().is_transient());
        assert_eq!(calls(&cached), 1, "left alone during the pause");

        // The pause is over: asked again, still down; the next pause is twice as long.
        tokio::time::advance(MIN_OUTAGE_PAUSE).await;
        assert!(cached.schema_version(a).await.is_err());
        assert_eq!(calls(&cached), 2);
        tokio::time::advance(MIN_OUTAGE_PAUSE).await;
        assert!(cached.schema_version(a).await.is_err());
        assert_eq!(calls(&cached), 2, "the second pause is longer");

        // Back up: answered, cached, and a later failure starts from the short pause.
        cached.get_ref().down.store(false, Ordering::SeqCst);
        tokio::time::advance(MIN_OUTAGE_PAUSE).await;
        assert_eq!(cached.schema_version(a).await.unwrap(), avro("a"));
        assert_eq!(cached.schema_version(a).await.unwrap(), avro("a"));
        assert_eq!(calls(&cached), 3);
    }

    /// Records naming a version the registry does not know (a deleted one), handled at the
    /// same time, make one call, not one each; the version is asked again a while later
    /// and found if it was registered since.
    #[tokio::test(start_paused = true)]
    async fn concurrent_lookups_of_a_missing_version_make_one_call() {
        let memory = MemoryRegistry::new();
        let cached = CachedRegistry::new(Slow {
            inner: memory.clone(),
            calls: AtomicUsize::new(0),
            down: AtomicBool::new(false),
            delay: Duration::from_millis(100),
        });
        let missing = Uuid::from_u128(0xdead);
        let waiters: Vec<_> = (0..20)
            .map(|_| {
                let cached = cached.clone();
                tokio::spawn(async move { cached.schema_version(missing).await })
            })
            .collect();
        for waiter in waiters {
            let err = waiter.await.unwrap().unwrap_err();
            assert!(matches!(err, RegistryError::UnknownVersion(id) if id == missing));
        }
        let calls = || cached.get_ref().calls.load(Ordering::SeqCst);
        assert_eq!(calls(), 1, "20 records, one call");

        memory.insert(missing, "orders", avro("late"));
        tokio::time::advance(UNKNOWN_VERSION_TTL).await;
        assert_eq!(cached.schema_version(missing).await.unwrap(), avro("late"));
        assert_eq!(calls(), 2);
    }

    /// Looking up 10,000 distinct versions keeps at most the capacity in memory.
    #[tokio::test]
    async fn ten_thousand_versions_stay_within_the_bound() {
        let memory = MemoryRegistry::new();
        let ids: Vec<Uuid> = (0..10_000)
            .map(|i| memory.register("orders", avro(&format!("v{i}"))))
            .collect();
        let cached = CachedRegistry::new(memory);
        for id in &ids {
            cached.schema_version(*id).await.unwrap();
        }
        let held = cached.shared.versions.len();
        assert!(held <= DEFAULT_CACHE_CAPACITY, "{held} versions held");
        assert!(held > 0);
    }

    /// The hit rate's three counters, in the recorder the consumer's metrics use.
    #[test]
    fn lookups_hits_and_misses_are_counted() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        ::metrics::with_local_recorder(&recorder, || {
            runtime.block_on(async {
                let memory = MemoryRegistry::new();
                let a = memory.register("orders", avro("a"));
                let b = memory.register("orders", avro("b"));
                let cached = CachedRegistry::new(memory);
                for _ in 0..10 {
                    cached.schema_version(a).await.unwrap();
                    cached.schema_version(b).await.unwrap();
                }
            })
        });
        let text = handle.render();
        for (name, value) in [
            (crate::metrics::SCHEMA_LOOKUPS, 20),
            (crate::metrics::SCHEMA_HITS, 18),
            (crate::metrics::SCHEMA_MISSES, 2),
        ] {
            assert!(text.contains(&format!("{name} {value}")), "{name}: {text}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_registry_that_never_answers_times_out_as_transient() {
        struct Hung;
        #[async_trait]
        impl SchemaRegistry for Hung {
            async fn schema_version(&self, _: Uuid) -> Result<WriterSchema, RegistryError> {
                std::future::pending().await
            }
            async fn version_id(
                &self,
                _: &str,
                _: &WriterSchema,
                _: bool,
            ) -> Result<Uuid, RegistryError> {
                std::future::pending().await
            }
        }
        let cached = CachedRegistry::with_limits(Hung, 10, Duration::from_secs(2));
        let err = cached.schema_version(Uuid::nil()).await.unwrap_err();
        assert!(matches!(err, RegistryError::TimedOut(d) if d == Duration::from_secs(2)));
        assert!(err.is_transient());
    }
}
