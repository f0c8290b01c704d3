//! Faults for the "nothing hangs" tests: a fault-injecting HTTP client for the real SDK
//! in front of the emulators, and memory-backend wrappers whose calls never return.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, HttpConnectorSettings, SharedHttpClient,
    SharedHttpConnector,
};
use aws_smithy_runtime_api::client::orchestrator::HttpRequest;
use aws_smithy_runtime_api::client::result::ConnectorError;
use aws_smithy_runtime_api::client::runtime_components::RuntimeComponents;
use aws_smithy_runtime_api::http::{Response, StatusCode};
use aws_smithy_types::body::SdkBody;
use futures_util::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use shardflow::kinesis::{KinesisApi, KinesisError, RecordsPage, StartingPosition, Subscription};
use shardflow::lease::{Checkpoint, Lease, LeaseError, LeaseStore};
use shardflow::{Backend, Memory};

use crate::hooks::{Forward, ForwardKinesis, ForwardStore};

// ---------------------------------------------------------------------------------------
// On the wire.

/// What the fault client does with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// HTTP 400 with the service's throttling error body.
    Throttle,
    /// HTTP 400 `ExpiredIteratorException` (GetRecords only).
    ExpiredIterator,
    /// HTTP 500 `InternalFailure`.
    Status500,
    /// HTTP 503 `ServiceUnavailable`.
    Status503,
    /// The connection is reset before the request is sent.
    Reset,
    /// No answer, ever (the SDK's timeouts must end it).
    Hang,
    /// The request is forwarded (and lands), then the client sees a reset: an ambiguous
    /// outcome.
    WrittenThenError,
}

/// Every kind, for "each happened at least once".
pub const ALL_FAULTS: [Fault; 7] = [
    Fault::Throttle,
    Fault::ExpiredIterator,
    Fault::Status500,
    Fault::Status503,
    Fault::Reset,
    Fault::Hang,
    Fault::WrittenThenError,
];

/// The seeded plan: each request of a faultable operation gets a fault with probability
/// `rate`, its kind drawn from the same generator. Control calls of the tests themselves
/// (creating streams, resharding, writing records) are never faulted.
#[derive(Debug)]
pub struct FaultPlan {
    rng: Mutex<SmallRng>,
    rate: f64,
    /// Every fault is of this kind, when set.
    only: Option<Fault>,
    injected: Mutex<BTreeMap<Fault, usize>>,
    /// When false, every request goes through untouched.
    pub enabled: AtomicBool,
}

impl FaultPlan {
    /// A plan failing about `rate` of the calls, drawn from `seed`.
    pub fn new(seed: u64, rate: f64) -> Arc<Self> {
        Arc::new(FaultPlan {
            rng: Mutex::new(SmallRng::seed_from_u64(seed)),
            rate,
            only: None,
            injected: Mutex::default(),
            enabled: AtomicBool::new(true),
        })
    }

    /// Every faultable request gets `kind`.
    pub fn only(kind: Fault) -> Arc<Self> {
        Arc::new(FaultPlan {
            rng: Mutex::new(SmallRng::seed_from_u64(0)),
            rate: 1.0,
            only: Some(kind),
            injected: Mutex::default(),
            enabled: AtomicBool::new(true),
        })
    }

    /// How many faults of each kind were injected.
    pub fn injected(&self) -> BTreeMap<Fault, usize> {
        self.injected.lock().unwrap().clone()
    }

    /// Panics unless every kind was injected at least once (so a test cannot pass
    /// vacuously).
    pub fn assert_every_kind_injected(&self) {
        let injected = self.injected();
        for kind in ALL_FAULTS {
            assert!(
                injected.get(&kind).copied().unwrap_or(0) > 0,
                "no {kind:?} injected: {injected:?}"
            );
        }
    }

    /// Waits (at most `limit`) until every kind was injected at least once, while the
    /// consumers keep running (idle polling keeps the requests coming).
    pub async fn wait_every_kind_injected(&self, limit: std::time::Duration) {
        let all = async {
            while !ALL_FAULTS
                .iter()
                .all(|k| self.injected().get(k).copied().unwrap_or(0) > 0)
            {
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        };
        if tokio::time::timeout(limit, all).await.is_err() {
            self.assert_every_kind_injected();
        }
    }

    fn draw(&self, target: &str) -> Option<Fault> {
        if !self.enabled.load(Ordering::SeqCst) {
            return None;
        }
        let op = target.rsplit('.').next().unwrap_or("");
        let faultable = matches!(
            op,
            "GetShardIterator"
                | "GetRecords"
                | "ListShards"
                | "Scan"
                | "GetItem"
                | "UpdateItem"
                | "PutItem"
                | "DeleteItem"
        );
        if !faultable {
            return None;
        }
        let mut rng = self.rng.lock().unwrap();
        if !rng.gen_bool(self.rate) {
            return None;
        }
        let kind = match self.only {
            Some(kind) => kind,
            None => match rng.gen_range(0..7) {
                0 => Fault::Throttle,
                1 if op == "GetRecords" => Fault::ExpiredIterator,
                1 | 2 => Fault::Status500,
                3 => Fault::Status503,
                4 => Fault::Reset,
                5 => Fault::Hang,
                _ => Fault::WrittenThenError,
            },
        };
        drop(rng);
        *self.injected.lock().unwrap().entry(kind).or_default() += 1;
        Some(kind)
    }
}

/// An SDK `HttpClient` that wraps the default (plain HTTP) client and applies a
/// [`FaultPlan`].
#[derive(Debug, Clone)]
pub struct FaultClient {
    inner: SharedHttpClient,
    plan: Arc<FaultPlan>,
}

impl FaultClient {
    /// An HTTP client for the SDK that fails calls as `plan` says.
    pub fn shared(plan: Arc<FaultPlan>) -> SharedHttpClient {
        SharedHttpClient::new(FaultClient {
            inner: aws_smithy_http_client::Builder::new().build_http(),
            plan,
        })
    }
}

impl HttpClient for FaultClient {
    fn http_connector(
        &self,
        settings: &HttpConnectorSettings,
        components: &RuntimeComponents,
    ) -> SharedHttpConnector {
        SharedHttpConnector::new(FaultConnector {
            inner: self.inner.http_connector(settings, components),
            plan: self.plan.clone(),
        })
    }
}

#[derive(Debug)]
struct FaultConnector {
    inner: SharedHttpConnector,
    plan: Arc<FaultPlan>,
}

/// The error answer a service sends, in its awsJson dialect.
fn error_response(status: u16, json_version: &'static str, code: &str) -> Response<SdkBody> {
    let body = format!(r#"{{"__type":"{code}","message":"injected by the test's fault client"}}"#);
    let mut response = Response::new(
        StatusCode::try_from(status).expect("a valid status"),
        SdkBody::from(body),
    );
    response.headers_mut().insert("content-type", json_version);
    response
}

fn reset() -> ConnectorError {
    ConnectorError::io(Box::new(std::io::Error::new(
        std::io::ErrorKind::ConnectionReset,
        "connection reset (injected)",
    )))
}

impl HttpConnector for FaultConnector {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        let target = request
            .headers()
            .get("x-amz-target")
            .unwrap_or("")
            .to_owned();
        let dynamodb = target.starts_with("DynamoDB");
        let json = if dynamodb {
            "application/x-amz-json-1.0"
        } else {
            "application/x-amz-json-1.1"
        };
        let Some(fault) = self.plan.draw(&target) else {
            return self.inner.call(request);
        };
        let answer =
            |status, code: &str| HttpConnectorFuture::ready(Ok(error_response(status, json, code)));
        match fault {
            Fault::Throttle if dynamodb && target.ends_with("UpdateItem") => answer(
                400,
                "com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceededException",
            ),
            Fault::Throttle if dynamodb => {
                answer(400, "com.amazonaws.dynamodb.v20120810#ThrottlingException")
            }
            Fault::Throttle => {
                if target.ends_with("GetRecords") {
                    answer(400, "ProvisionedThroughputExceededException")
                } else {
                    answer(400, "LimitExceededException")
                }
            }
            Fault::ExpiredIterator => answer(400, "ExpiredIteratorException"),
            Fault::Status500 => answer(500, "InternalFailure"),
            Fault::Status503 => answer(503, "ServiceUnavailable"),
            Fault::Reset => HttpConnectorFuture::ready(Err(reset())),
            Fault::Hang => HttpConnectorFuture::new(std::future::pending()),
            Fault::WrittenThenError => {
                let sent = self.inner.call(request);
                HttpConnectorFuture::new(async move {
                    let _ = sent.await;
                    Err(reset())
                })
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// In memory: calls that never return, and a table that disappears.

/// A memory backend whose lease store and Kinesis can be told to hang or to lose the
/// table.
#[derive(Clone)]
pub struct FaultyMemory {
    /// The memory backend underneath.
    pub memory: Memory,
    /// What is hanging or missing now.
    pub faults: Arc<MemoryFaults>,
}

/// What [`FaultyMemory`] does wrong.
#[derive(Default)]
pub struct MemoryFaults {
    /// Renewals of this lease never return.
    pub hang_renewals_of: Mutex<Option<String>>,
    /// The next renewal of this lease is written, then its answer never comes (an
    /// ambiguous outcome: it landed, the caller times out).
    pub lose_answer_of_next_renewal_of: Mutex<Option<String>>,
    /// This many of the next GetRecords calls never return.
    pub hang_get_records: AtomicUsize,
    /// This many of the next subscriptions never send an event.
    pub hang_subscriptions: AtomicUsize,
    /// Subscriptions that were left silent.
    pub hung_subscriptions: AtomicUsize,
    /// GetRecords calls that were left hanging.
    pub hung_get_records: AtomicUsize,
    /// This many of the next `ensure_table` calls never return.
    pub hang_ensure_table: AtomicUsize,
    /// Every lease store call fails with `TableMissing`.
    pub table_missing: AtomicBool,
}

impl FaultyMemory {
    /// `memory`, with nothing hanging yet.
    pub fn new(memory: Memory) -> Self {
        FaultyMemory {
            memory,
            faults: Arc::default(),
        }
    }
}

impl Backend for FaultyMemory {
    fn kinesis(&self) -> Arc<dyn KinesisApi> {
        Arc::new(Forward(FaultyKinesis {
            inner: self.memory.kinesis(),
            faults: self.faults.clone(),
        }))
    }

    fn table_streams(&self) -> Option<Arc<dyn KinesisApi>> {
        let inner = self.memory.table_streams()?;
        Some(Arc::new(Forward(FaultyKinesis {
            inner,
            faults: self.faults.clone(),
        })))
    }

    fn lease_store(&self, table: &str) -> Arc<dyn LeaseStore> {
        Arc::new(Forward(FaultyStore {
            inner: self.memory.lease_store(table),
            table: table.to_owned(),
            faults: self.faults.clone(),
        }))
    }
}

struct FaultyStore {
    inner: Arc<dyn LeaseStore>,
    table: String,
    faults: Arc<MemoryFaults>,
}

impl FaultyStore {
    fn check(&self) -> Result<(), LeaseError> {
        if self.faults.table_missing.load(Ordering::SeqCst) {
            return Err(LeaseError::TableMissing {
                table: self.table.clone(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl ForwardStore for FaultyStore {
    fn inner(&self) -> &dyn LeaseStore {
        &*self.inner
    }
    async fn ensure_table(&self) -> Result<(), LeaseError> {
        self.check()?;
        let hangs = &self.faults.hang_ensure_table;
        if hangs
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            return std::future::pending().await;
        }
        self.inner.ensure_table().await
    }
    async fn list(&self) -> Result<Vec<Lease>, LeaseError> {
        self.check()?;
        self.inner.list().await
    }
    async fn get(&self, key: &str) -> Result<Option<Lease>, LeaseError> {
        self.check()?;
        self.inner.get(key).await
    }
    async fn create(&self, lease: &Lease) -> Result<bool, LeaseError> {
        self.check()?;
        self.inner.create(lease).await
    }
    async fn take(&self, expected: &Lease, new_owner: &str) -> Result<Lease, LeaseError> {
        self.check()?;
        self.inner.take(expected, new_owner).await
    }
    async fn renew(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.check()?;
        let hang = self.faults.hang_renewals_of.lock().unwrap().clone();
        if hang.as_deref() == Some(expected.key.as_str()) {
            return std::future::pending().await;
        }
        let lose = {
            let mut lose = self.faults.lose_answer_of_next_renewal_of.lock().unwrap();
            if lose.as_deref() == Some(expected.key.as_str()) {
                lose.take()
            } else {
                None
            }
        };
        let renewed = self.inner.renew(expected).await;
        if lose.is_some() {
            return std::future::pending().await;
        }
        renewed
    }
    async fn checkpoint(
        &self,
        expected: &Lease,
        checkpoint: &Checkpoint,
    ) -> Result<Lease, LeaseError> {
        self.check()?;
        self.inner.checkpoint(expected, checkpoint).await
    }
    async fn release(&self, expected: &Lease) -> Result<Lease, LeaseError> {
        self.check()?;
        self.inner.release(expected).await
    }
    async fn request_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.check()?;
        self.inner.request_handoff(expected, worker).await
    }
    async fn withdraw_handoff(&self, expected: &Lease, worker: &str) -> Result<Lease, LeaseError> {
        self.check()?;
        self.inner.withdraw_handoff(expected, worker).await
    }
    async fn delete(&self, expected: &Lease) -> Result<(), LeaseError> {
        self.check()?;
        self.inner.delete(expected).await
    }
}

struct FaultyKinesis {
    inner: Arc<dyn KinesisApi>,
    faults: Arc<MemoryFaults>,
}

#[async_trait]
impl ForwardKinesis for FaultyKinesis {
    fn inner(&self) -> &dyn KinesisApi {
        &*self.inner
    }
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        let hang = self
            .faults
            .hang_get_records
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if hang {
            self.faults.hung_get_records.fetch_add(1, Ordering::SeqCst);
            return std::future::pending().await;
        }
        self.inner.get_records(iterator, limit).await
    }
    async fn subscribe_to_shard(
        &self,
        consumer_arn: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<Subscription, KinesisError> {
        let events = self
            .inner
            .subscribe_to_shard(consumer_arn, shard_id, from)
            .await?;
        let hang = self
            .faults
            .hang_subscriptions
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if hang {
            self.faults
                .hung_subscriptions
                .fetch_add(1, Ordering::SeqCst);
            // Open, but silent for ever (the real subscription is kept alive meanwhile).
            return Ok(Box::pin(futures_util::stream::pending::<()>().map(
                move |_| {
                    let _keep = &events;
                    unreachable!()
                },
            )));
        }
        Ok(events)
    }
}
