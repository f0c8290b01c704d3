//! [`ServiceBuilderExt`]: the layers of this crate as `ServiceBuilder` methods.

use tower::layer::util::Stack;
use tower::ServiceBuilder;

use crate::batch::{BatchConfig, BatchLayer};
use crate::bisect::BisectLayer;
use crate::dead_letter::DeadLetterLayer;
use crate::decode::{DecodeLayer, Json};
use crate::dedup::DedupLayer;
use crate::produce::ProduceToLayer;
use crate::retry::{RetryLayer, RetryPolicy};
use crate::schema_registry::{SchemaRegistry, SchemaRegistryLayer};

mod sealed {
    pub trait Sealed {}
    impl<L> Sealed for tower::ServiceBuilder<L> {}
}

/// Adds this crate's layers to [`tower::ServiceBuilder`]. Layers apply outermost first,
/// so the order of the calls is the order a record passes through them:
///
/// ```no_run
/// # use std::convert::Infallible;
/// # use shardflow::Message;
/// # use shardflow_middleware::{RetryPolicy, MemoryDedupStore, ServiceBuilderExt};
/// # use shardflow_middleware::dead_letter::DeadLetterRecord;
/// # use tower::ServiceBuilder;
/// # #[derive(Clone, serde::Deserialize)] struct Order { id: u64 }
/// # let sink = tower::service_fn(|_r: DeadLetterRecord| async { Ok::<_, Infallible>(()) });
/// let handler = ServiceBuilder::new()
///     .dead_letter(sink)
///     .decode::<Order>()
///     .dedup(MemoryDedupStore::new(100_000))
///     .retry(RetryPolicy::exponential().max_attempts(5))
///     .service_fn(|msg: Message<Order>| async move { Ok::<_, Infallible>(msg.payload.id) });
/// # let _ = handler;
/// ```
///
/// The trait is sealed: only `ServiceBuilder` implements it.
pub trait ServiceBuilderExt<L>: sealed::Sealed + Sized {
    /// Decodes JSON payloads into `T` ([`decode`](crate::decode)).
    fn decode<T>(self) -> ServiceBuilder<Stack<DecodeLayer<T, Json>, L>>;

    /// Decodes payloads into `T` with another [`Format`](crate::decode::Format).
    fn decode_with<T, F>(self, format: F) -> ServiceBuilder<Stack<DecodeLayer<T, F>, L>>;

    /// Decodes records in the AWS Glue Schema Registry framing into `T` with `format` and
    /// the writer schemas of `registry`, unframed ones with `format` alone
    /// ([`schema_registry`](crate::schema_registry)). For a shared cache or to refuse
    /// unframed records, use `.layer(SchemaRegistryLayer::with_cache(..).require_framing())`.
    fn schema_registry<T, F, R: SchemaRegistry>(
        self,
        format: F,
        registry: R,
    ) -> ServiceBuilder<Stack<SchemaRegistryLayer<T, F, R>, L>>;

    /// Skips records already handled, keyed by position, in `store`
    /// ([`dedup`](crate::dedup)); the store must serve this consumer group alone. For
    /// another key, a namespace in a shared store or other timings, use
    /// `.layer(DedupLayer::new(store).key(...).namespace(...))`.
    fn dedup<St>(self, store: St) -> ServiceBuilder<Stack<DedupLayer<St>, L>>;

    /// Retries failed records per `policy` ([`retry`](crate::retry)).
    fn retry<C>(self, policy: RetryPolicy<C>) -> ServiceBuilder<Stack<RetryLayer<C>, L>>;

    /// Sends records that still fail to `sink` ([`dead_letter`](crate::dead_letter)).
    fn dead_letter<K>(self, sink: K) -> ServiceBuilder<Stack<DeadLetterLayer<K>, L>>;

    /// Groups messages for a bulk handler ([`batch`](crate::batch)).
    fn batch<T>(self, config: BatchConfig) -> ServiceBuilder<Stack<BatchLayer<T>, L>>;

    /// Stores the outputs of the service below with `producer` before the input counts
    /// as handled ([`produce`](crate::produce)): a processor.
    fn produce_to(
        self,
        producer: shardflow::producer::Producer,
    ) -> ServiceBuilder<Stack<ProduceToLayer, L>>;

    /// Batch mode: splits a failing batch down to the records that fail alone and sends
    /// those to `sink` ([`bisect`](crate::bisect)). For limits (attempts, record age,
    /// split depth) use `.layer(BisectLayer::with_config(sink, config)?)`.
    fn bisect<K>(self, sink: K) -> ServiceBuilder<Stack<BisectLayer<K>, L>>;
}

impl<L> ServiceBuilderExt<L> for ServiceBuilder<L> {
    fn decode<T>(self) -> ServiceBuilder<Stack<DecodeLayer<T, Json>, L>> {
        self.layer(DecodeLayer::json())
    }

    fn decode_with<T, F>(self, format: F) -> ServiceBuilder<Stack<DecodeLayer<T, F>, L>> {
        self.layer(DecodeLayer::with_format(format))
    }

    fn schema_registry<T, F, R: SchemaRegistry>(
        self,
        format: F,
        registry: R,
    ) -> ServiceBuilder<Stack<SchemaRegistryLayer<T, F, R>, L>> {
        self.layer(SchemaRegistryLayer::new(format, registry))
    }

    fn dedup<St>(self, store: St) -> ServiceBuilder<Stack<DedupLayer<St>, L>> {
        self.layer(DedupLayer::new(store))
    }

    fn retry<C>(self, policy: RetryPolicy<C>) -> ServiceBuilder<Stack<RetryLayer<C>, L>> {
        self.layer(RetryLayer::new(policy))
    }

    fn dead_letter<K>(self, sink: K) -> ServiceBuilder<Stack<DeadLetterLayer<K>, L>> {
        self.layer(DeadLetterLayer::new(sink))
    }

    fn batch<T>(self, config: BatchConfig) -> ServiceBuilder<Stack<BatchLayer<T>, L>> {
        self.layer(BatchLayer::new(config))
    }

    fn produce_to(
        self,
        producer: shardflow::producer::Producer,
    ) -> ServiceBuilder<Stack<ProduceToLayer, L>> {
        self.layer(ProduceToLayer::new(producer))
    }

    fn bisect<K>(self, sink: K) -> ServiceBuilder<Stack<BisectLayer<K>, L>> {
        self.layer(BisectLayer::new(sink))
    }
}
