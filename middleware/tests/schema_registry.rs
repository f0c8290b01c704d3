//! Records in the AWS Glue Schema Registry framing under the real consumer
//! (`Consumer::run`) on the embedded backend, with the embedded registry: framed records
//! decode, a registry outage is delivered again (never dead-lettered), a record naming
//! an unknown schema version is dead-lettered once.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use common::{within, Rng};
use shardflow::kinesis::{PutOutcome, PutRecord};
use shardflow::{Backend, Consumer, Memory, Message};
use shardflow_middleware::codec::{DataFormat, Encoder, SchemaFormat, WriterSchema};
use shardflow_middleware::dead_letter::DeadLetterRecord;
use shardflow_middleware::decode::Format;
use shardflow_middleware::schema_registry::{
    framing, CachedRegistry, Compression, MemoryRegistry, RegistryError, SchemaRegistry,
    SchemaRegistryEncoder,
};
use shardflow_middleware::{BoxError, ServiceBuilderExt};
use tokio::sync::Notify;
use tower::{service_fn, ServiceBuilder};
use uuid::Uuid;

const RECORDS: u64 = 300;
const SCHEMA: &str = r#"{"type":"object","properties":{"id":{"type":"integer"}}}"#;

#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
struct Order {
    id: u64,
}

/// JSON with a JSON Schema writer schema (the schema is not checked: the test is about
/// the framing and the registry).
#[derive(Clone, Debug)]
struct SchemaJson;

#[derive(Debug, thiserror::Error)]
#[error("not an order")]
struct NotAnOrder;

impl Format<Order> for SchemaJson {
    type Error = NotAnOrder;
    fn name(&self) -> &'static str {
        "JSON Schema"
    }
    fn decode(&self, payload: &Bytes) -> Result<Order, NotAnOrder> {
        serde_json::from_slice(payload).map_err(|_| NotAnOrder)
    }
}

impl SchemaFormat<Order> for SchemaJson {
    fn data_format(&self) -> DataFormat {
        DataFormat::JsonSchema
    }
    fn decode_with_schema(&self, payload: &[u8], _: &WriterSchema) -> Result<Order, NotAnOrder> {
        serde_json::from_slice(payload).map_err(|_| NotAnOrder)
    }
}

impl Encoder<Order> for SchemaJson {
    type Error = NotAnOrder;
    fn content_type(&self) -> &str {
        "application/json"
    }
    fn encode(&self, value: &Order) -> Result<Bytes, NotAnOrder> {
        serde_json::to_vec(value)
            .map(Bytes::from)
            .map_err(|_| NotAnOrder)
    }
    fn writer_schema(&self) -> Option<WriterSchema> {
        Some(WriterSchema {
            format: DataFormat::JsonSchema,
            definition: Arc::from(SCHEMA),
        })
    }
}

/// The embedded registry, down for its first `outage` version lookups.
struct Outage {
    inner: MemoryRegistry,
    outage: usize,
    lookups: AtomicUsize,
    served: Arc<AtomicBool>,
}

#[async_trait]
impl SchemaRegistry for Outage {
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
        if self.lookups.fetch_add(1, Ordering::SeqCst) < self.outage {
            return Err(RegistryError::Unavailable("ThrottlingException".into()));
        }
        self.served.store(true, Ordering::SeqCst);
        self.inner.schema_version(id).await
    }
    async fn version_id(
        &self,
        name: &str,
        schema: &WriterSchema,
        register: bool,
    ) -> Result<Uuid, RegistryError> {
        self.inner.version_id(name, schema, register).await
    }
}

#[derive(Default)]
struct Seen {
    handled: HashMap<u64, u32>,
    dead: Vec<DeadLetterRecord>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framed_records_decode_outages_are_redelivered_and_unknown_versions_dead_lettered() {
    let backend = Memory::new();
    let kinesis = backend.admin().unwrap();
    kinesis.create_stream("orders", 2).await.unwrap();

    // The producer side: registered once (auto-registration on), every 7th record
    // compressed, every 25th naming a version the registry does not know.
    let registry = MemoryRegistry::new();
    let encoder =
        SchemaRegistryEncoder::new(SchemaJson, CachedRegistry::new(registry.clone()), "orders")
            .auto_register(true);
    let zlib =
        SchemaRegistryEncoder::new(SchemaJson, CachedRegistry::new(registry.clone()), "orders")
            .auto_register(true)
            .compression(Compression::Zlib);
    let mut rng = Rng::new(32);
    let mut unknown = Vec::new();
    let mut records = Vec::new();
    for id in 0..RECORDS {
        let order = Order { id };
        let data = if id % 25 == 24 {
            unknown.push(id);
            let stray = Uuid::from_u128(u128::from(rng.next_u64()));
            framing::write(
                stray,
                Compression::None,
                &SchemaJson.encode(&order).unwrap(),
            )
            .unwrap()
        } else if id % 7 == 0 {
            zlib.encode(&order).await.unwrap()
        } else {
            encoder.encode(&order).await.unwrap()
        };
        records.push(PutRecord {
            data,
            partition_key: format!("customer-{}", id % 37),
            explicit_hash_key: None,
        });
    }
    assert_eq!(registry.len(), 1, "one version, registered once");
    let outcomes = kinesis.put_records("orders", &records).await.unwrap();
    assert!(outcomes
        .iter()
        .all(|o| !matches!(o, PutOutcome::Failed { .. })));

    let seen: Arc<Mutex<Seen>> = Arc::default();
    let progress = Arc::new(Notify::new());
    let sink = service_fn({
        let (seen, progress) = (seen.clone(), progress.clone());
        move |record: DeadLetterRecord| {
            seen.lock().unwrap().dead.push(record);
            progress.notify_one();
            async { Ok::<_, BoxError>(()) }
        }
    });
    let handler = service_fn({
        let (seen, progress) = (seen.clone(), progress.clone());
        move |msg: Message<Order>| {
            *seen
                .lock()
                .unwrap()
                .handled
                .entry(msg.payload.id)
                .or_default() += 1;
            progress.notify_one();
            async { Ok::<_, BoxError>(()) }
        }
    });
    let served = Arc::new(AtomicBool::new(false));
    let stack = ServiceBuilder::new()
        .dead_letter(sink)
        .schema_registry(
            SchemaJson,
            Outage {
                inner: registry,
                outage: 3,
                lookups: AtomicUsize::new(0),
                served: served.clone(),
            },
        )
        .service(handler);

    let consumer = Consumer::builder()
        .stream("orders")
        .group("billing")
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = consumer.run(stack).spawn();
    let all_finished = async {
        loop {
            {
                let seen = seen.lock().unwrap();
                if seen.handled.len() + seen.dead.len() >= RECORDS as usize {
                    break;
                }
            }
            progress.notified().await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all_finished)
        .await
        .expect("every record finishes within a minute");
    within("the consumer stops", running.shutdown())
        .await
        .unwrap();

    assert!(served.load(Ordering::SeqCst), "the registry came back");
    let seen = seen.lock().unwrap();
    for id in 0..RECORDS {
        if unknown.contains(&id) {
            assert!(!seen.handled.contains_key(&id), "record {id} handled");
        } else {
            assert_eq!(seen.handled.get(&id), Some(&1), "record {id}: handled once");
        }
    }
    // Only the unknown versions, each once: no record was dead-lettered for the outage.
    assert_eq!(
        seen.dead.len(),
        unknown.len(),
        "{:?}",
        seen.dead.iter().map(|d| &d.error).collect::<Vec<_>>()
    );
    for dead in &seen.dead {
        assert!(dead.error.contains("does not know"), "{}", dead.error);
        assert!(framing::is_framed(&dead.payload), "the raw framed bytes");
    }
}

/// A Protobuf record framed as the reference serializer writes it (header, message index
/// 1 of a file with two messages, the message's bytes; zlib) decodes into the user's
/// prost type through the codec module's Protobuf format.
#[cfg(feature = "protobuf")]
#[tokio::test]
async fn protobuf_records_framed_by_the_reference_layout_decode_into_prost_types() {
    use shardflow_middleware::codec::Protobuf;
    use shardflow_middleware::schema_registry::SchemaRegistryLayer;
    use tower::{Layer, ServiceExt};

    #[derive(Clone, PartialEq, prost::Message)]
    struct Shipment {
        #[prost(uint64, tag = "1")]
        id: u64,
        #[prost(string, tag = "2")]
        city: String,
    }
    const PROTO: &str = "syntax = \"proto3\";\nmessage Order { uint64 id = 1; }\nmessage Shipment { uint64 id = 1; string city = 2; }\n";

    let registry = MemoryRegistry::new();
    let id = registry.register(
        "shipments",
        WriterSchema {
            format: DataFormat::Protobuf,
            definition: Arc::from(PROTO),
        },
    );
    let shipment = Shipment {
        id: 7,
        city: "Lyon".into(),
    };
    // `Order` is 0 and `Shipment` 1 (messages sorted by full name).
    let mut body = vec![0x01];
    body.extend_from_slice(&prost::Message::encode_to_vec(&shipment));
    let framed = framing::write(id, Compression::Zlib, &body).unwrap();

    let seen: Arc<Mutex<Vec<Shipment>>> = Arc::default();
    let into = seen.clone();
    let svc = SchemaRegistryLayer::new(Protobuf::<Shipment>::new(), registry).layer(service_fn(
        move |m: Message<Shipment>| {
            into.lock().unwrap().push(m.payload);
            async { Ok::<_, BoxError>(()) }
        },
    ));
    svc.oneshot(common::message("shardId-000000000000", 1, framed))
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), [shipment]);
}
