//! Decode cost per record of each codec, for a record of about 200 bytes (JSON is the
//! baseline).
//!
//! `cargo bench -p shardflow-middleware --features avro,json-schema --bench codecs`
//! (add `-- <records>` to change the count, 200,000 by default). Each figure is the best
//! of five runs decoding the same payload `records` times through `Format::decode`.
//!
//! Without `--bench` among its arguments (`cargo test --all-targets` runs this binary
//! without), it makes a smoke run: every codec once over 300 records.

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use shardflow_middleware::codec::{Avro, Encoder, JsonSchema, Protobuf};
use shardflow_middleware::{Format, Json};

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
    row::<Order, _>(
        "Avro (apache-avro, raw datum)",
        &avro,
        &avro_bytes,
        records,
        json_ns,
    );
}
