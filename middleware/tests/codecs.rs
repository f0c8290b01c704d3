//! Typed payloads through the codecs: producer → embedded stream → consumer → the
//! user's type, Spring's contentTypes, corrupt payloads on the dead-letter path, and
//! hostile bytes that never panic a decoder.

mod common;

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{message, within, Rng};
use shardflow::producer::Producer;
use shardflow::{Backend, Consumer, Memory, Message, ProducerRecord};
use shardflow_middleware::codec::{
    Avro, AvroError, EncodeRecord, Encoder, JsonSchema, Protobuf, SchemaFormat, WriterSchema,
};
use shardflow_middleware::dead_letter::DeadLetterRecord;
use shardflow_middleware::decode::CONTENT_TYPE;
use shardflow_middleware::produce::Output;
use shardflow_middleware::{
    DecodeError, DecodeErrorKind, DecodeLayer, Format, Json, ServiceBuilderExt,
};
use tokio::sync::Notify;
use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};

/// The serde / Avro shape of an order.
#[derive(
    Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema,
)]
struct Order {
    id: i64,
    customer: String,
}

/// The same order as a Protobuf message (`message Order { int64 id = 1; string customer = 2; }`).
#[derive(Clone, PartialEq, prost::Message)]
struct OrderPb {
    #[prost(int64, tag = "1")]
    id: i64,
    #[prost(string, tag = "2")]
    customer: String,
}

const ORDER_SCHEMA: &str = r#"{
  "$schema": "https://json-schema.org/draft/2020-12/schema",
  "type": "object",
  "required": ["id", "customer"],
  "properties": {
    "id": {"type": "integer", "minimum": 1},
    "customer": {"type": "string", "minLength": 1}
  }
}"#;

fn orders(n: i64) -> Vec<Order> {
    (1..=n)
        .map(|id| Order {
            id,
            customer: format!("customer-{}", id % 7),
        })
        .collect()
}

/// Writes `values` with `encoder` through a producer that embeds headers into a fresh
/// embedded stream, consumes it through `DecodeLayer::with_format(format)` and returns
/// what the handler received, in order.
async fn round_trip<T, F, E>(format: F, encoder: E, values: &[T]) -> Vec<T>
where
    T: Clone + Send + Sync + 'static,
    F: Format<T> + Clone + Send + Sync + 'static,
    E: Encoder<T>,
{
    let backend = Memory::new();
    backend
        .admin()
        .unwrap()
        .create_stream("orders", 1)
        .await
        .unwrap();
    let producer = Producer::builder()
        .stream("orders")
        .backend(backend.clone())
        .embed_headers(true)
        .build()
        .unwrap();
    for value in values {
        let record = ProducerRecord::encode(&encoder, value, "customer").unwrap();
        producer.send(record).await.unwrap();
    }

    let seen: Arc<Mutex<Vec<T>>> = Arc::default();
    let progress = Arc::new(Notify::new());
    let handler = service_fn({
        let (seen, progress) = (seen.clone(), progress.clone());
        move |m: Message<T>| {
            seen.lock().unwrap().push(m.payload);
            progress.notify_one();
            async { Ok::<_, Infallible>(()) }
        }
    });
    let stack = ServiceBuilder::new()
        .layer(DecodeLayer::with_format(format))
        .service(handler);
    let consumer = Consumer::builder()
        .stream("orders")
        .group("codecs")
        .backend(backend)
        .idle_read_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = consumer.run(stack).spawn();
    within("every record decoded", async {
        while seen.lock().unwrap().len() < values.len() {
            progress.notified().await;
        }
    })
    .await;
    within("the consumer stops", running.shutdown())
        .await
        .unwrap();
    let seen = seen.lock().unwrap().clone();
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_codec_round_trips_from_producer_to_the_consumers_handler() {
    let sent = orders(50);
    assert_eq!(round_trip(Json, Json, &sent).await, sent, "JSON");
    assert_eq!(
        round_trip(Avro::<Order>::new(), Avro::<Order>::new(), &sent).await,
        sent,
        "Avro"
    );
    let schema = JsonSchema::<Order>::new(ORDER_SCHEMA).unwrap();
    assert_eq!(
        round_trip(schema.clone(), schema, &sent).await,
        sent,
        "JSON Schema"
    );
    let sent_pb: Vec<OrderPb> = sent
        .iter()
        .map(|o| OrderPb {
            id: o.id,
            customer: o.customer.clone(),
        })
        .collect();
    assert_eq!(
        round_trip(
            Protobuf::<OrderPb>::new(),
            Protobuf::<OrderPb>::new(),
            &sent_pb
        )
        .await,
        sent_pb,
        "Protobuf"
    );
}

/// Decodes one record with `format` and the given `contentType` through the layer.
async fn decode_one<T, F>(format: F, content_type: &str, raw: &[u8]) -> Result<T, DecodeError>
where
    T: Send + 'static,
    F: Format<T> + Clone,
{
    let svc = DecodeLayer::with_format(format).layer(service_fn(|m: Message<T>| async move {
        Ok::<_, Infallible>(m.payload)
    }));
    let msg = message("shardId-0", 1, Bytes::copy_from_slice(raw))
        .with_header(CONTENT_TYPE, content_type);
    svc.oneshot(msg).await.map_err(|e| {
        *e.downcast::<DecodeError>()
            .unwrap_or_else(|e| panic!("not a DecodeError: {e}"))
    })
}

// Bytes written by hand from the formats' specifications, not by the encoders above:
// Avro's binary encoding of {id: 7, customer: "c-1"} (zig-zag long 7 = 0x0e, string of
// length 3 = 0x06 then UTF-8), as Spring's Avro converters write a raw datum; and the
// Protobuf wire form (field 1 varint 7, field 2 length-delimited "c-1").
const AVRO_ORDER_7: &[u8] = &[0x0e, 0x06, b'c', b'-', b'1'];
const PROTOBUF_ORDER_7: &[u8] = &[0x08, 0x07, 0x12, 0x03, b'c', b'-', b'1'];

#[tokio::test]
async fn springs_avro_and_protobuf_content_types_decode() {
    let expected = Order {
        id: 7,
        customer: "c-1".into(),
    };
    for content_type in [
        "application/avro",
        "application/vnd.order.v1+avro",
        "application/vnd.orders+avro",
        "avro/binary",
        "Application/AVRO; charset=UTF-8",
    ] {
        let order = decode_one(Avro::<Order>::new(), content_type, AVRO_ORDER_7)
            .await
            .unwrap_or_else(|e| panic!("{content_type}: {e}"));
        assert_eq!(order, expected, "{content_type}");
    }
    for content_type in [
        "application/x-protobuf",
        "application/x-protobuf;charset=UTF-8",
        "application/protobuf",
        "application/vnd.google.protobuf",
    ] {
        let order: OrderPb = decode_one(Protobuf::<OrderPb>::new(), content_type, PROTOBUF_ORDER_7)
            .await
            .unwrap_or_else(|e| panic!("{content_type}: {e}"));
        assert_eq!(
            (order.id, order.customer.as_str()),
            (7, "c-1"),
            "{content_type}"
        );
    }
}

#[tokio::test]
async fn a_content_type_of_another_codec_is_refused_without_decoding() {
    let cases: Vec<(&str, Result<(), DecodeError>)> = vec![
        (
            "application/json",
            decode_one(
                Protobuf::<OrderPb>::new(),
                "application/json",
                PROTOBUF_ORDER_7,
            )
            .await
            .map(drop),
        ),
        (
            "application/x-protobuf",
            decode_one(Avro::<Order>::new(), "application/x-protobuf", AVRO_ORDER_7)
                .await
                .map(drop),
        ),
        (
            "application/avro",
            decode_one(
                JsonSchema::<Order>::new(ORDER_SCHEMA).unwrap(),
                "application/avro",
                br#"{"id":7,"customer":"c-1"}"#,
            )
            .await
            .map(drop),
        ),
    ];
    for (content_type, result) in cases {
        let err = result.expect_err(content_type);
        assert_eq!(
            err.kind(),
            &DecodeErrorKind::UnsupportedContentType {
                content_type: content_type.to_owned()
            }
        );
    }
}

#[tokio::test]
async fn a_payload_that_does_not_match_its_schema_is_dead_lettered_as_a_schema_mismatch() {
    // Valid JSON, but `id` breaks the schema's minimum: the kind says schema, not syntax.
    let schema = JsonSchema::<Order>::new(ORDER_SCHEMA).unwrap();
    let raw: &[u8] = br#"{"id":0,"customer":"secret-name"}"#;
    let err = decode_one(schema.clone(), "application/json", raw)
        .await
        .unwrap_err();
    assert_eq!(err.kind(), &DecodeErrorKind::SchemaMismatch);
    assert_eq!(err.raw().as_ref(), raw);
    assert!(!format!("{err:?} {}", err.source_chain()).contains("secret-name"));
    // Not JSON at all: an invalid payload.
    let err = decode_one(schema.clone(), "application/json", b"{\"id\":")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), &DecodeErrorKind::InvalidPayload);

    // Avro: a datum cut short is an invalid payload; one whose long does not fit an int
    // of the reader's schema would be a mismatch (tested through resolution below).
    let err = decode_one(Avro::<Order>::new(), "application/avro", &AVRO_ORDER_7[..3])
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        &DecodeErrorKind::InvalidPayload,
        "{}",
        err.source_chain()
    );

    // On the dead-letter path: the record reaches the sink byte for byte, with the reason.
    let letters: Arc<Mutex<Vec<DeadLetterRecord>>> = Arc::default();
    let sink = service_fn({
        let letters = letters.clone();
        move |record: DeadLetterRecord| {
            letters.lock().unwrap().push(record);
            async { Ok::<_, Infallible>(()) }
        }
    });
    let handled = Arc::new(Mutex::new(0usize));
    let stack = ServiceBuilder::new()
        .dead_letter(sink)
        .decode_with::<Order, _>(schema)
        .service_fn({
            let handled = handled.clone();
            move |_m: Message<Order>| {
                *handled.lock().unwrap() += 1;
                async { Ok::<_, Infallible>(()) }
            }
        });
    let msg = message("shardId-0", 9, Bytes::from_static(raw))
        .with_header(CONTENT_TYPE, "application/json");
    stack.oneshot(msg).await.expect("the sink took it");
    let letters = letters.lock().unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].payload.as_ref(), raw);
    assert!(
        letters[0]
            .error
            .contains("does not match its JSON Schema schema"),
        "{}",
        letters[0].error
    );
    assert_eq!(*handled.lock().unwrap(), 0, "the handler never sees it");
}

trait SourceChain {
    fn source_chain(&self) -> String;
}

impl SourceChain for DecodeError {
    fn source_chain(&self) -> String {
        let mut out = self.to_string();
        let mut next = std::error::Error::source(self);
        while let Some(e) = next {
            out.push_str(": ");
            out.push_str(&e.to_string());
            next = e.source();
        }
        out
    }
}

#[test]
fn avro_resolves_the_writers_schema_to_the_readers() {
    // The writer had a third field the reader's type does not know; the registry (or the
    // user) names the writer's schema, the datum resolves to the reader's.
    let writer = r#"{"type":"record","name":"Order","fields":[
        {"name":"id","type":"long"},
        {"name":"customer","type":"string"},
        {"name":"note","type":"string"}]}"#;
    let mut datum = AVRO_ORDER_7.to_vec();
    datum.extend_from_slice(&[0x04, b'h', b'i']);
    let expected = Order {
        id: 7,
        customer: "c-1".into(),
    };
    let avro = Avro::<Order>::new();
    let schema = WriterSchema::new(shardflow_middleware::DataFormat::Avro, writer);
    assert_eq!(avro.decode_with_schema(&datum, &schema).unwrap(), expected);
    // Without the writer's schema the extra bytes are not silently ignored.
    assert!(matches!(
        avro.decode(&Bytes::from(datum.clone())),
        Err(AvroError::TrailingBytes(3))
    ));
    // Given as the user's writer schema instead.
    let avro = Avro::<Order>::new().writer_schema(writer).unwrap();
    assert_eq!(avro.decode(&Bytes::from(datum)).unwrap(), expected);

    // A writer whose field cannot become the reader's: a schema mismatch.
    let writer = r#"{"type":"record","name":"Order","fields":[
        {"name":"id","type":"string"},
        {"name":"customer","type":"string"}]}"#;
    let schema = WriterSchema::new(shardflow_middleware::DataFormat::Avro, writer);
    let err = Avro::<Order>::new()
        .decode_with_schema(&[0x02, b'x', 0x02, b'y'], &schema)
        .unwrap_err();
    assert_eq!(err.kind(), DecodeErrorKind::SchemaMismatch, "{err}");
}

#[test]
fn avro_single_object_encoding_of_the_writers_schema_is_read() {
    use apache_avro::headers::{HeaderBuilder, RabinFingerprintHeader};
    use apache_avro::AvroSchema;
    let mut payload = RabinFingerprintHeader::from_schema(&Order::get_schema()).build_header();
    assert_eq!(&payload[..2], &[0xc3, 0x01]);
    payload.extend_from_slice(AVRO_ORDER_7);
    let order = Avro::<Order>::new().decode(&Bytes::from(payload)).unwrap();
    assert_eq!(order.id, 7);
}

#[test]
fn encoders_set_the_content_type_and_the_json_schema_encoder_validates() {
    let order = Order {
        id: 7,
        customer: "c-1".into(),
    };
    let record = ProducerRecord::encode(&Avro::<Order>::new(), &order, "k").unwrap();
    assert_eq!(
        record.headers.get_str(CONTENT_TYPE),
        Some("application/avro")
    );
    assert_eq!(
        record.payload.as_ref(),
        AVRO_ORDER_7,
        "a raw datum, as Spring writes"
    );
    let pb = OrderPb {
        id: 7,
        customer: "c-1".into(),
    };
    let output = Output::encode(&Protobuf::<OrderPb>::new(), &pb).unwrap();
    assert_eq!(
        output.header_map().get_str(CONTENT_TYPE),
        Some("application/x-protobuf")
    );
    assert_eq!(output.payload().as_ref(), PROTOBUF_ORDER_7);

    let schema = JsonSchema::<Order>::new(ORDER_SCHEMA).unwrap();
    let bad = Order {
        id: 0,
        customer: String::new(),
    };
    let err = ProducerRecord::encode(&schema, &bad, "k").unwrap_err();
    assert_eq!(err.kind(), DecodeErrorKind::SchemaMismatch, "{err}");
    assert_eq!(
        schema.writer_schema().map(|s| s.format),
        Some(shardflow_middleware::DataFormat::JsonSchema)
    );
}

/// Random bytes, and valid encodings with random bytes changed, into every decoder:
/// each answers Ok or a typed error, never a panic. Fixed seed.
#[test]
fn hostile_bytes_never_panic_a_decoder() {
    let avro = Avro::<Order>::new();
    let schema = JsonSchema::<Order>::new(ORDER_SCHEMA).unwrap();
    let pb = Protobuf::<OrderPb>::new();
    let avro_schema = WriterSchema::new(
        shardflow_middleware::DataFormat::Avro,
        r#"{"type":"record","name":"Order","fields":[{"name":"id","type":"long"},{"name":"customer","type":"string"},{"name":"tags","type":{"type":"array","items":"string"}}]}"#,
    );
    let valid: [&[u8]; 3] = [
        AVRO_ORDER_7,
        PROTOBUF_ORDER_7,
        br#"{"id":7,"customer":"c-1"}"#,
    ];
    let mut rng = Rng::new(32);
    for round in 0..20_000u64 {
        let payload: Vec<u8> = if round % 2 == 0 {
            let len = rng.below(64) as usize;
            (0..len).map(|_| rng.next_u64() as u8).collect()
        } else {
            let mut p = valid[rng.below(3) as usize].to_vec();
            for _ in 0..=rng.below(3) {
                let at = rng.below(p.len() as u64) as usize;
                p[at] = rng.next_u64() as u8;
            }
            p
        };
        let bytes = Bytes::from(payload);
        let _ = Format::<Order>::decode(&avro, &bytes);
        let _ = avro.decode_with_schema(&bytes, &avro_schema);
        let _ = Format::<Order>::decode(&schema, &bytes);
        let _ = Format::<OrderPb>::decode(&pb, &bytes);
        let _ = Format::<Order>::decode(&Json, &bytes);
    }
}

/// A reading whose Avro encoding starts with the framing's version byte when `delta` is
/// -2 (zig-zag long -2 is 0x03), and with a valid compression byte when `flags` is 0
/// (0x00) or -3 (0x05).
#[derive(
    Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize, apache_avro::AvroSchema,
)]
struct Reading {
    delta: i64,
    flags: i64,
    note: String,
}

/// Plain Avro records labelled `application/avro` (as Spring writes them) that look like
/// the registry's framing (18 bytes or more, first byte 0x03) are decoded as what was
/// sent by the registry layer, not unframed into a lookup of a made-up schema version or
/// a framing error.
#[tokio::test]
async fn labelled_plain_avro_that_looks_framed_is_read_as_it_was_sent() {
    use shardflow_middleware::schema_registry::{framing, MemoryRegistry, SchemaRegistryLayer};

    let layer =
        SchemaRegistryLayer::<Reading, _, _>::new(Avro::<Reading>::new(), MemoryRegistry::new());
    for (flags, header) in [(0, "no compression"), (-3, "zlib"), (1, "unknown")] {
        let sent = Reading {
            delta: -2,
            flags,
            note: "north-gate-sensor-17".into(),
        };
        let bytes = Encoder::<Reading>::encode(&Avro::<Reading>::new(), &sent).unwrap();
        assert!(framing::is_framed(&bytes), "{header}: looks framed");
        let svc = layer
            .clone()
            .layer(service_fn(|m: Message<Reading>| async move {
                Ok::<_, Infallible>(m.payload)
            }));
        let msg = message("shardId-0", 1, bytes).with_header(CONTENT_TYPE, "application/avro");
        let got = svc
            .oneshot(msg)
            .await
            .unwrap_or_else(|e| panic!("{header}: {e}"));
        assert_eq!(got, sent, "{header}");
    }
}

/// Zig-zag varint, Avro's encoding of a long.
fn avro_long(n: i64) -> Vec<u8> {
    let mut v = ((n << 1) ^ (n >> 63)) as u64;
    let mut out = Vec::new();
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
    out
}

#[derive(Debug, serde::Deserialize)]
struct Bag {
    #[allow(dead_code)]
    counts: std::collections::HashMap<String, i64>,
}

/// Ten-byte Avro payloads claiming 2^29 - 1 map entries, array items or string bytes are
/// refused with a typed error before anything is allocated for them (the decoder
/// reserves what the count claims: about 80 GB for the map, which aborts the process).
#[test]
fn avro_counts_and_lengths_past_the_payload_are_refused_before_allocating() {
    let claim = (1i64 << 29) - 1;
    let padded = |mut v: Vec<u8>| {
        v.extend_from_slice(&[0x02, b'a', 0x02, 0x02, b'b']);
        v.truncate(10);
        v
    };
    let map = Avro::<Bag>::with_schema(
        apache_avro::Schema::parse_str(
            r#"{"type":"record","name":"Bag","fields":[{"name":"counts","type":{"type":"map","values":"long"}}]}"#,
        )
        .unwrap(),
    );
    let payload = Bytes::from(padded(avro_long(claim)));
    assert_eq!(payload.len(), 10);
    let err = Format::<Bag>::decode(&map, &payload).unwrap_err();
    assert!(matches!(err, AvroError::TooManyItems), "{err:?}");
    assert_eq!(err.kind(), DecodeErrorKind::InvalidPayload);

    let longs = Avro::<Vec<i64>>::with_schema(
        apache_avro::Schema::parse_str(r#"{"type":"array","items":"long"}"#).unwrap(),
    );
    let err = Format::<Vec<i64>>::decode(&longs, &payload).unwrap_err();
    assert!(matches!(err, AvroError::TooManyItems), "{err:?}");

    let text = Avro::<String>::with_schema(apache_avro::Schema::String);
    let err = Format::<String>::decode(&text, &payload).unwrap_err();
    assert!(matches!(err, AvroError::Truncated), "{err:?}");

    // Items of no width (nulls) take no bytes: a bounded number more than the payload
    // has bytes.
    let nulls = Avro::<Vec<()>>::with_schema(
        apache_avro::Schema::parse_str(r#"{"type":"array","items":"null"}"#).unwrap(),
    );
    let err = Format::<Vec<()>>::decode(&nulls, &payload).unwrap_err();
    assert!(matches!(err, AvroError::TooManyItems), "{err:?}");
    // A real one decodes, through the registry's path too.
    let thousand: Vec<u8> = [avro_long(1000), vec![0]].concat();
    assert_eq!(
        Format::<Vec<()>>::decode(&nulls, &Bytes::from(thousand.clone())).unwrap(),
        vec![(); 1000]
    );
    let writer = WriterSchema::new(
        shardflow_middleware::DataFormat::Avro,
        r#"{"type":"array","items":"null"}"#,
    );
    assert_eq!(
        nulls.decode_with_schema(&thousand, &writer).unwrap().len(),
        1000
    );
}

/// A writer schema may name a `fixed` of any size (here 2^40 bytes, valid Avro): read
/// with it, a 4-byte payload is refused as truncated instead of the decoder allocating
/// the schema's size before reading (which aborts the process).
#[test]
fn avro_fixed_larger_than_the_payload_is_refused_before_allocating() {
    let blob = r#"{"type":"record","name":"Blob","fields":[{"name":"data","type":{"type":"fixed","name":"Data","size":1099511627776}}]}"#;
    let format = Avro::<Bag>::with_schema(apache_avro::Schema::parse_str(blob).unwrap());
    let err = Format::<Bag>::decode(&format, &Bytes::from_static(b"\x00\x01\x02\x03")).unwrap_err();
    assert!(matches!(err, AvroError::Truncated), "{err:?}");
    let writer = WriterSchema::new(shardflow_middleware::DataFormat::Avro, blob);
    let err = format
        .decode_with_schema(b"\x00\x01\x02\x03", &writer)
        .unwrap_err();
    assert!(matches!(err, AvroError::Truncated), "{err:?}");
}

#[derive(Debug, serde::Deserialize)]
struct Node {
    next: Option<Box<Node>>,
}

const NODE_SCHEMA: &str =
    r#"{"type":"record","name":"Node","fields":[{"name":"next","type":["null","Node"]}]}"#;

/// A recursive schema and a payload of one byte per level (union branch 1, "another
/// node"): 100,000 levels in 100 KB are refused with a typed error instead of
/// overflowing the stack of the thread decoding them (2 MiB, a tokio worker's), which
/// aborts the process (in a debug build a list of 30 nodes already does). A list of
/// 16 nodes, at the limit, still decodes.
#[test]
fn avro_values_nested_past_the_limit_are_refused_not_a_stack_overflow() {
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(|| {
            let format =
                Avro::<Node>::with_schema(apache_avro::Schema::parse_str(NODE_SCHEMA).unwrap());
            let writer = WriterSchema::new(shardflow_middleware::DataFormat::Avro, NODE_SCHEMA);
            let list = |levels: usize| {
                let mut v = vec![0x02; levels];
                v.push(0x00);
                v
            };
            let deep = list(100_000);
            let err = Format::<Node>::decode(&format, &Bytes::from(deep.clone())).unwrap_err();
            assert!(matches!(err, AvroError::TooDeep), "{err:?}");
            let err = format.decode_with_schema(&deep, &writer).unwrap_err();
            assert!(matches!(err, AvroError::TooDeep), "{err:?}");

            // At the limit: 16 nodes (a record and a union each) decode, 17 do not.
            let mut node = Format::<Node>::decode(&format, &Bytes::from(list(15))).unwrap();
            let mut length = 1;
            while let Some(next) = node.next {
                node = *next;
                length += 1;
            }
            assert_eq!(length, 16);
            let err = Format::<Node>::decode(&format, &Bytes::from(list(16))).unwrap_err();
            assert!(matches!(err, AvroError::TooDeep), "{err:?}");
        })
        .unwrap()
        .join()
        .unwrap();
}

/// Records in the registry framing, written by a producer that embeds headers (Spring's
/// header framing around the registry's), reach the handler as the values sent with
/// their headers; one naming a version the registry does not know is dead-lettered with
/// its framed bytes exactly as they were written and its headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registry_framing_inside_embedded_headers_arrives_as_it_was_sent() {
    use shardflow_middleware::schema_registry::{
        framing, CachedRegistry, Compression, MemoryRegistry, SchemaRegistryEncoder,
    };

    let backend = Memory::new();
    backend
        .admin()
        .unwrap()
        .create_stream("orders", 1)
        .await
        .unwrap();
    let producer = Producer::builder()
        .stream("orders")
        .backend(backend.clone())
        .embed_headers(true)
        .build()
        .unwrap();
    let registry = MemoryRegistry::new();
    let cache = CachedRegistry::new(registry.clone());
    let plain = SchemaRegistryEncoder::new(Avro::<Order>::new(), cache.clone(), "orders")
        .auto_register(true);
    let zlib = SchemaRegistryEncoder::new(Avro::<Order>::new(), cache, "orders")
        .auto_register(true)
        .compression(Compression::Zlib);
    let sent = orders(20);
    for (i, order) in sent.iter().enumerate() {
        let encoder = if i % 2 == 0 { &plain } else { &zlib };
        let data = encoder.encode(order).await.unwrap();
        let record = ProducerRecord::new(data, "customer").with_header("traceId", format!("t-{i}"));
        producer.send(record).await.unwrap();
    }
    let stray = framing::write(
        uuid::Uuid::from_u128(0x5eed),
        Compression::None,
        &Encoder::<Order>::encode(&Avro::<Order>::new(), &sent[0]).unwrap(),
    )
    .unwrap();
    producer
        .send(ProducerRecord::new(stray.clone(), "customer").with_header("traceId", "stray"))
        .await
        .unwrap();

    type Seen = (Vec<(Order, String)>, Vec<DeadLetterRecord>);
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let progress = Arc::new(Notify::new());
    let handler = service_fn({
        let (seen, progress) = (seen.clone(), progress.clone());
        move |m: Message<Order>| {
            let trace = m.headers.get_str("traceId").unwrap_or_default().to_owned();
            seen.lock().unwrap().0.push((m.payload, trace));
            progress.notify_one();
            async { Ok::<_, Infallible>(()) }
        }
    });
    let sink = service_fn({
        let (seen, progress) = (seen.clone(), progress.clone());
        move |record: DeadLetterRecord| {
            seen.lock().unwrap().1.push(record);
            progress.notify_one();
            async { Ok::<_, shardflow_middleware::BoxError>(()) }
        }
    });
    let stack = ServiceBuilder::new()
        .dead_letter(sink)
        .schema_registry(Avro::<Order>::new(), registry)
        .service(handler);
    let consumer = Consumer::builder()
        .stream("orders")
        .group("codecs")
        .backend(backend)
        .idle_read_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = consumer.run(stack).spawn();
    within("every record handled or dead-lettered", async {
        loop {
            {
                let seen = seen.lock().unwrap();
                if seen.0.len() + seen.1.len() > sent.len() {
                    break;
                }
            }
            progress.notified().await;
        }
    })
    .await;
    within("the consumer stops", running.shutdown())
        .await
        .unwrap();
    let seen = seen.lock().unwrap();
    let expected: Vec<(Order, String)> = sent
        .iter()
        .enumerate()
        .map(|(i, o)| (o.clone(), format!("t-{i}")))
        .collect();
    assert_eq!(seen.0, expected);
    assert_eq!(seen.1.len(), 1);
    assert_eq!(seen.1[0].payload, stray, "the framed bytes as written");
    assert_eq!(seen.1[0].headers.get_str("traceId"), Some("stray"));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: 64,
        rng_seed: proptest::test_runner::RngSeed::Fixed(32),
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Any order goes through each codec's encoder and comes back from its decoder, plain
    /// and inside the registry framing (zlib or not, a Protobuf message index first).
    #[test]
    fn each_codec_round_trips_any_value_plain_and_framed(
        id in 1i64..,
        customer in "\\PC{1,40}",
        zlib in proptest::prelude::any::<bool>(),
        version in proptest::prelude::any::<u128>(),
    ) {
        use shardflow_middleware::schema_registry::{framing, Compression};
        use shardflow_middleware::DataFormat;

        let order = Order { id, customer };
        let pb = OrderPb { id: order.id, customer: order.customer.clone() };
        let compression = if zlib { Compression::Zlib } else { Compression::None };
        let version = uuid::Uuid::from_u128(version);
        let frame = |bytes: &[u8], index: bool| {
            let body = if index { framing::write_message_index(0, bytes) } else { bytes.to_vec() };
            let frame = framing::parse(&framing::write(version, compression, &body).unwrap()).unwrap();
            assert_eq!(frame.schema_version, version);
            if index { framing::read_message_index(&frame.payload).unwrap().1 } else { frame.payload }
        };

        let avro = Avro::<Order>::new();
        let bytes = Encoder::<Order>::encode(&avro, &order).unwrap();
        proptest::prop_assert_eq!(&Format::<Order>::decode(&avro, &bytes).unwrap(), &order);
        let writer = Encoder::<Order>::writer_schema(&avro).unwrap();
        proptest::prop_assert_eq!(&avro.decode_with_schema(&frame(&bytes, false), &writer).unwrap(), &order);

        let schema = JsonSchema::<Order>::new(ORDER_SCHEMA).unwrap();
        let bytes = Encoder::<Order>::encode(&schema, &order).unwrap();
        proptest::prop_assert_eq!(&Format::<Order>::decode(&schema, &bytes).unwrap(), &order);
        let writer = Encoder::<Order>::writer_schema(&schema).unwrap();
        proptest::prop_assert_eq!(&schema.decode_with_schema(&frame(&bytes, false), &writer).unwrap(), &order);

        let bytes = Encoder::<Order>::encode(&Json, &order).unwrap();
        proptest::prop_assert_eq!(&Format::<Order>::decode(&Json, &bytes).unwrap(), &order);

        let protobuf = Protobuf::<OrderPb>::new();
        let bytes = Encoder::<OrderPb>::encode(&protobuf, &pb).unwrap();
        proptest::prop_assert_eq!(&Format::<OrderPb>::decode(&protobuf, &bytes).unwrap(), &pb);
        let writer = WriterSchema::new(DataFormat::Protobuf, "syntax = \"proto3\"; message Order { int64 id = 1; string customer = 2; }");
        proptest::prop_assert_eq!(&protobuf.decode_with_schema(&frame(&bytes, true), &writer).unwrap(), &pb);
    }
}

/// JSON nested as deep as `serde_json` reads (127 levels) against a recursive JSON Schema,
/// and deeper: a typed error or a value, never a stack overflow of the 2 MiB thread
/// (a tokio worker's) decoding it.
#[test]
fn deep_json_against_a_recursive_schema_never_overflows_the_stack() {
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(|| {
            let schema = r##"{"type":"array","items":{"$ref":"#"}}"##;
            let format = JsonSchema::<serde_json::Value>::new(schema).unwrap();
            let writer = WriterSchema::new(shardflow_middleware::DataFormat::JsonSchema, schema);
            for depth in [100usize, 127, 128, 100_000] {
                let payload = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
                let plain =
                    Format::<serde_json::Value>::decode(&format, &Bytes::from(payload.clone()));
                let framed = format.decode_with_schema(payload.as_bytes(), &writer);
                let json = Format::<serde_json::Value>::decode(&Json, &Bytes::from(payload));
                let readable = depth <= 127;
                assert_eq!(plain.is_ok(), readable, "{depth}");
                assert_eq!(framed.is_ok(), readable, "{depth}");
                assert_eq!(json.is_ok(), readable, "{depth}");
                if let Err(e) = plain {
                    assert_eq!(e.kind(), DecodeErrorKind::InvalidPayload, "{depth}");
                }
            }
        })
        .unwrap()
        .join()
        .unwrap();
}

/// A recursive Protobuf message.
#[derive(Clone, PartialEq, prost::Message)]
struct NodePb {
    #[prost(message, optional, boxed, tag = "1")]
    next: Option<Box<NodePb>>,
}

/// Protobuf nested past prost's recursion limit (100) is a typed error, and within it a
/// value, never a stack overflow of a 2 MiB thread, plain or framed.
#[test]
fn deep_protobuf_never_overflows_the_stack() {
    std::thread::Builder::new()
        .stack_size(2 << 20)
        .spawn(|| {
            let format = Protobuf::<NodePb>::new();
            let writer = WriterSchema::new(
                shardflow_middleware::DataFormat::Protobuf,
                "syntax = \"proto3\"; message Node { Node next = 1; }",
            );
            for depth in [99usize, 100, 10_000] {
                // Field 1, length-delimited, around the level below, from the inside out.
                let mut bytes: Vec<u8> = Vec::new();
                for _ in 0..depth {
                    let mut outer = vec![0x0a];
                    prost::encoding::encode_varint(bytes.len() as u64, &mut outer);
                    outer.extend_from_slice(&bytes);
                    bytes = outer;
                }
                let plain = Format::<NodePb>::decode(&format, &Bytes::from(bytes.clone()));
                let framed = format.decode_with_schema(&bytes, &writer);
                let readable = depth <= 100;
                assert_eq!(plain.is_ok(), readable, "{depth}");
                assert_eq!(framed.is_ok(), readable, "{depth}");
            }
        })
        .unwrap()
        .join()
        .unwrap();
}
