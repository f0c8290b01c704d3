//! Decode cost per record of each codec, for a record of about 200 bytes (JSON is the
//! baseline).
//!
//! `cargo bench -p shardflow-middleware --features avro,json-schema --bench codecs`
//! (add `-- <records>` to change the count, 200,000 by default). Each figure is the best
//! of five runs decoding the same payload `records` times through `Format::decode`.
//!
//! Then the same payloads framed in the schema registry's format through
//! `SchemaRegistryLayer` (one record at a time on a current-thread runtime, the writer
//! schema cached after the first lookup): Avro read with its own schema and with an
//! older writer schema resolved to the reader's, Protobuf with the message index
//! checked, JSON Schema validated against the writer schema; with the registry calls
//! counted, for the cache's hit rate.
//!
//! Without `--bench` among its arguments (`cargo test --all-targets` runs this binary
//! without), it makes a smoke run: every codec once over 300 records.

use std::hint::black_box;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use shardflow::{Message, Metadata};
use shardflow_middleware::codec::{
    Avro, DataFormat, Encoder, JsonSchema, Protobuf, SchemaFormat, WriterSchema,
};
use shardflow_middleware::schema_registry::{
    framing, Compression, MemoryRegistry, RegistryError, SchemaRegistry, SchemaRegistryLayer,
};
use shardflow_middleware::{Format, Json};
use tower::{service_fn, Layer, Service, ServiceExt};
use uuid::Uuid;

#[derive(Clone, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema)]
struct Order {
    id: i64,
    customer: String,
    sku: String,
    quantity: i32,
    price_cents: i64,
    address: String,
    note: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct OrderPb {
    #[prost(int64, tag = "1")]
    id: i64,
    #[prost(string, tag = "2")]
    customer: String,
    #[prost(string, tag = "3")]
    sku: String,
    #[prost(int32, tag = "4")]
    quantity: i32,
    #[prost(int64, tag = "5")]
    price_cents: i64,
    #[prost(string, tag = "6")]
    address: String,
    #[prost(string, tag = "7")]
    note: String,
}

impl prost::Name for OrderPb {
    const NAME: &'static str = "Order";
    const PACKAGE: &'static str = "shop";
}

/// `OrderPb`'s `.proto`, with a second message so that the index is not 0.
const PROTO: &str = "syntax = \"proto3\";\npackage shop;\nmessage Ack { int64 id = 1; }\nmessage Order { int64 id = 1; string customer = 2; string sku = 3; int32 quantity = 4; int64 price_cents = 5; string address = 6; string note = 7; }\n";

/// `Order`'s Avro schema before `note` was added (with a default, so the reader's schema
/// resolves it).
const AVRO_V1: &str = r#"{"type":"record","name":"Order","fields":[{"name":"id","type":"long"},{"name":"customer","type":"string"},{"name":"sku","type":"string"},{"name":"quantity","type":"int"},{"name":"price_cents","type":"long"},{"name":"address","type":"string"}]}"#;

/// `Order` as the reader with `note` defaulted, for the resolution row.
const AVRO_V2: &str = r#"{"type":"record","name":"Order","fields":[{"name":"id","type":"long"},{"name":"customer","type":"string"},{"name":"sku","type":"string"},{"name":"quantity","type":"int"},{"name":"price_cents","type":"long"},{"name":"address","type":"string"},{"name":"note","type":"string","default":""}]}"#;

/// The embedded registry, its calls counted.
struct Counting(MemoryRegistry, Arc<AtomicUsize>);

#[async_trait]
impl SchemaRegistry for Counting {
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
        self.1.fetch_add(1, Ordering::Relaxed);
        self.0.schema_version(id).await
    }
    async fn version_id(&self, n: &str, s: &WriterSchema, r: bool) -> Result<Uuid, RegistryError> {
        self.0.version_id(n, s, r).await
    }
}

/// Best of five: `records` framed copies of `framed` through a `SchemaRegistryLayer` of
/// `format` (a new layer, so a cold cache, per run). Prints the row; returns the registry
/// calls made and the lookups asked.
#[allow(clippy::too_many_arguments)]
fn layer_row<T, F>(
    runtime: &tokio::runtime::Runtime,
    name: &str,
    format: F,
    registry: &MemoryRegistry,
    framed: &Bytes,
    records: usize,
    plain_ns: f64,
) -> (usize, usize)
where
    T: Send + 'static,
    F: SchemaFormat<T> + Clone + Send + Sync + 'static,
    F::Error: Send + Sync + 'static,
{
    let calls = Arc::new(AtomicUsize::new(0));
    let metadata = Metadata::builder()
        .stream("orders")
        .shard_id("shardId-000000000000")
        .build();
    let message = Message::new(metadata, framed.clone());
    let best = runtime.block_on(async {
        let mut best = Duration::MAX;
        for _ in 0..5 {
            let mut svc =
                SchemaRegistryLayer::new(format.clone(), Counting(registry.clone(), calls.clone()))
                    .layer(service_fn(|m: Message<T>| async move {
                        Ok::<_, std::convert::Infallible>(black_box(m.payload))
                    }));
            let start = Instant::now();
            for _ in 0..records {
                let out = svc
                    .ready()
                    .await
                    .expect("ready")
                    .call(message.clone())
                    .await;
                black_box(out.is_ok());
            }
            best = best.min(start.elapsed());
        }
        best
    });
    let ns = best.as_nanos() as f64 / records as f64;
    println!(
        "| {name} | {} | {ns:.0} | {:+.0} |",
        framed.len(),
        ns - plain_ns
    );
    (calls.load(Ordering::Relaxed), 5 * records)
}

const SCHEMA: &str = r#"{"type":"object","required":["id","customer","sku","quantity","price_cents"],
 "properties":{"id":{"type":"integer"},"customer":{"type":"string"},"sku":{"type":"string"},
 "quantity":{"type":"integer","minimum":1},"price_cents":{"type":"integer"},
 "address":{"type":"string"},"note":{"type":"string"}}}"#;

fn order() -> Order {
    Order {
        id: 1_234_567,
        customer: "customer-000042".into(),
        sku: "SKU-2026-BLUE-XL".into(),
        quantity: 3,
        price_cents: 12_999,
        address: "12 Harbour Street, Flat 4, Portsmouth PO1 2AB, United Kingdom".into(),
        note: "leave with the neighbour at number 14 if nobody answers the door".into(),
    }
}

fn best_of_five<T>(records: usize, decode: impl Fn() -> T) -> Duration {
    (0..5)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..records {
                black_box(decode());
            }
            start.elapsed()
        })
        .min()
        .unwrap_or_default()
}

fn row<T, F: Format<T>>(
    name: &str,
    format: &F,
    payload: &Bytes,
    records: usize,
    json_ns: f64,
) -> f64 {
    let took = best_of_five(records, || format.decode(black_box(payload)).ok());
    let ns = took.as_nanos() as f64 / records as f64;
    println!(
        "| {name} | {} | {ns:.0} | {:.2}x |",
        payload.len(),
        if json_ns > 0.0 { ns / json_ns } else { 1.0 }
    );
    ns
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let measure = args.iter().any(|a| a == "--bench");
    let records = if measure {
        args.iter()
            .skip(1)
            .find_map(|a| a.parse().ok())
            .unwrap_or(200_000)
    } else {
        300
    };
    let order = order();
    let pb = OrderPb {
        id: order.id,
        customer: order.customer.clone(),
        sku: order.sku.clone(),
        quantity: order.quantity,
        price_cents: order.price_cents,
        address: order.address.clone(),
        note: order.note.clone(),
    };
    let json_schema = JsonSchema::<Order>::new(SCHEMA).expect("the bench's schema compiles");
    let avro = Avro::<Order>::new();
    let protobuf = Protobuf::<OrderPb>::new();
    let json_bytes = Encoder::<Order>::encode(&Json, &order).expect("encodes");
    let avro_bytes = avro.encode(&order).expect("encodes");
    let pb_bytes = Encoder::encode(&protobuf, &pb).expect("encodes");

    println!("{records} records, best of 5, decode only (Format::decode)\n");
    println!("| codec | payload bytes | ns/record | vs JSON |");
    println!("|---|---|---|---|");
    let json_ns = row::<Order, _>("JSON (serde_json)", &Json, &json_bytes, records, 0.0);
    row::<Order, _>(
        "JSON Schema (validate + serde)",
        &json_schema,
        &json_bytes,
        records,
        json_ns,
    );
    row::<OrderPb, _>("Protobuf (prost)", &protobuf, &pb_bytes, records, json_ns);
    let avro_ns = row::<Order, _>(
        "Avro (apache-avro, raw datum)",
        &avro,
        &avro_bytes,
        records,
        json_ns,
    );
    let pb_ns = best_of_five(records, || protobuf.decode(black_box(&pb_bytes)).ok()).as_nanos()
        as f64
        / records as f64;
    let json_schema_ns = best_of_five(records, || {
        Format::<Order>::decode(&json_schema, black_box(&json_bytes)).ok()
    })
    .as_nanos() as f64
        / records as f64;

    // The same payloads framed, through the schema registry layer.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
    let registry = MemoryRegistry::new();
    let avro_own = registry.register(
        "orders-avro",
        Encoder::<Order>::writer_schema(&avro).expect("Avro has a schema"),
    );
    let avro_old = registry.register("orders-avro", WriterSchema::new(DataFormat::Avro, AVRO_V1));
    let pb_id = registry.register("orders-pb", WriterSchema::new(DataFormat::Protobuf, PROTO));
    let json_id = registry.register(
        "orders-json",
        WriterSchema::new(DataFormat::JsonSchema, SCHEMA),
    );
    let v1 = apache_avro::Schema::parse_str(AVRO_V1).expect("v1 parses");
    let v1_bytes = {
        use apache_avro::types::Value;
        let datum = Value::Record(vec![
            ("id".into(), Value::Long(order.id)),
            ("customer".into(), Value::String(order.customer.clone())),
            ("sku".into(), Value::String(order.sku.clone())),
            ("quantity".into(), Value::Int(order.quantity)),
            ("price_cents".into(), Value::Long(order.price_cents)),
            ("address".into(), Value::String(order.address.clone())),
        ]);
        apache_avro::to_avro_datum(&v1, datum).expect("v1 datum")
    };
    let frame =
        |id: Uuid, data: &[u8]| framing::write(id, Compression::None, data).expect("framed");
    let pb_index = shardflow_middleware::codec::protobuf::message_index(PROTO, "shop.Order")
        .expect("the bench's .proto parses")
        .expect("it declares shop.Order");
    let reader_v2 =
        Avro::<Order>::with_schema(apache_avro::Schema::parse_str(AVRO_V2).expect("v2 parses"));

    println!(
        "\n{records} records framed (no compression), best of 5, through SchemaRegistryLayer\n"
    );
    println!("| codec | framed bytes | ns/record | vs its plain decode |");
    println!("|---|---|---|---|");
    let mut calls = 0;
    let mut lookups = 0;
    for (c, l) in [
        layer_row::<Order, _>(
            &runtime,
            "Avro, writer schema = reader's",
            avro.clone(),
            &registry,
            &frame(avro_own, &avro_bytes),
            records,
            avro_ns,
        ),
        layer_row::<Order, _>(
            &runtime,
            "Avro, older writer schema resolved",
            reader_v2,
            &registry,
            &frame(avro_old, &v1_bytes),
            records,
            avro_ns,
        ),
        layer_row::<OrderPb, _>(
            &runtime,
            "Protobuf, message index checked",
            Protobuf::<OrderPb>::new().named(),
            &registry,
            &frame(pb_id, &framing::write_message_index(pb_index, &pb_bytes)),
            records,
            pb_ns,
        ),
        layer_row::<Order, _>(
            &runtime,
            "JSON Schema, writer schema's validator",
            json_schema.clone(),
            &registry,
            &frame(json_id, &json_bytes),
            records,
            json_schema_ns,
        ),
    ] {
        calls += c;
        lookups += l;
    }
    println!(
        "\nregistry calls: {calls} for {lookups} lookups (hit rate {:.4} %)",
        100.0 * (lookups - calls) as f64 / lookups as f64
    );
    assert_eq!(calls, 4 * 5, "one call per version per layer (cache)");
}
