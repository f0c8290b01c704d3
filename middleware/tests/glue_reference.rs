//! The AWS Glue Schema Registry's wire format as its reference serializer writes it, both
//! directions, for Avro, JSON Schema and Protobuf.
//!
//! * **Reading**: records in the reference's format (its own published test vectors, and
//!   more records framed here from its documented layout, none and zlib compressed) go
//!   through the real consumer (`Consumer::run`) on the embedded backend and the
//!   `SchemaRegistryLayer` with the embedded registry, and come out as the user's types:
//!   an Avro reader schema newer than the writer's (a field added with a default), JSON
//!   validated against the registered JSON Schema. Records that do not match their schema
//!   are dead-lettered with a schema mismatch, once each; nothing else is lost.
//! * **Writing**: what `SchemaRegistryEncoder` writes is read back by an independent reader
//!   written here from the documented layout (header version byte 3, compression byte,
//!   16-byte schema version id most significant byte first, Protobuf message index,
//!   payload) and by the formats' own libraries, never by shardflow's decoder.
//!
//! The vectors: `avroGenericBytes`, `avroSpecificBytes` and `jsonGenericBytes` of the
//! reference's Kafka Streams serde tests (schema version
//! `b7b4a7f0-9c96-4e4a-a687-fb5de9ef0c63`), written with its `user.avsc` and
//! `person.schema.json` test schemas, reproduced below.

mod common;

use std::io::{Read, Write};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{within, Rng};
use shardflow::kinesis::{PutOutcome, PutRecord};
use shardflow::{Backend, Consumer, Memory, Message};
use shardflow_middleware::codec::{Avro, DataFormat, JsonSchema, Protobuf, WriterSchema};
use shardflow_middleware::dead_letter::DeadLetterRecord;
use shardflow_middleware::schema_registry::{
    CachedRegistry, Compression, MemoryRegistry, SchemaRegistry, SchemaRegistryEncoder,
    SchemaRegistryLayer,
};
use shardflow_middleware::{BoxError, ServiceBuilderExt};
use tokio::sync::Notify;
use tower::{service_fn, ServiceBuilder};
use uuid::Uuid;

/// The schema version id of the reference's vectors.
const REFERENCE_VERSION: &str = "b7b4a7f0-9c96-4e4a-a687-fb5de9ef0c63";

/// The reference's `user.avsc` test schema, the writer's.
const USER_V1: &str = r#"{
  "namespace": "com.amazonaws.services.schemaregistry.serializers.avro",
  "type": "record",
  "name": "User",
  "fields": [
      {"name": "name", "type": "string" },
      {"name": "favorite_number",  "type": ["int", "null"] },
      {"name": "favorite_color", "type": ["string", "null"] }
  ]
}"#;

/// The reader's schema: `user.avsc` with a field added, with a default.
const USER_V2: &str = r#"{
  "namespace": "com.amazonaws.services.schemaregistry.serializers.avro",
  "type": "record",
  "name": "User",
  "fields": [
      {"name": "name", "type": "string" },
      {"name": "favorite_number",  "type": ["int", "null"] },
      {"name": "favorite_color", "type": ["string", "null"] },
      {"name": "favorite_animal", "type": "string", "default": "none" }
  ]
}"#;

/// A writer schema the reader's cannot read: `favorite_number` became a string.
const USER_INCOMPATIBLE: &str = r#"{
  "namespace": "com.amazonaws.services.schemaregistry.serializers.avro",
  "type": "record",
  "name": "User",
  "fields": [
      {"name": "name", "type": "string" },
      {"name": "favorite_number",  "type": "string" },
      {"name": "favorite_color", "type": ["string", "null"] }
  ]
}"#;

/// `avroGenericBytes`: `{name: "sansa", favorite_number: 99, favorite_color: "red"}`.
const AVRO_GENERIC: [i8; 32] = [
    3, 0, -73, -76, -89, -16, -100, -106, 78, 74, -90, -121, -5, 93, -23, -17, 12, 99, 10, 115, 97,
    110, 115, 97, 0, -58, 1, 0, 6, 114, 101, 100,
];
/// `avroSpecificBytes`: `{name: "test", favorite_number: 10, favorite_color: "violet"}`.
const AVRO_SPECIFIC: [i8; 33] = [
    3, 0, -73, -76, -89, -16, -100, -106, 78, 74, -90, -121, -5, 93, -23, -17, 12, 99, 8, 116, 101,
    115, 116, 0, 20, 0, 12, 118, 105, 111, 108, 101, 116,
];

/// The reference's `person.schema.json` test schema.
const PERSON_SCHEMA: &str = r#"{
  "$id": "https://example.com/person.schema.json",
  "$schema": "http://json-schema.org/draft-07/schema#",
  "title": "Person",
  "type": "object",
  "properties": {
    "firstName": {
      "type": "string",
      "description": "The person's first name."
    },
    "lastName": {
      "type": "string",
      "description": "The person's last name."
    },
    "age": {
      "description": "Age in years which must be equal to or greater than zero.",
      "type": "integer",
      "minimum": 0
    }
  },
  "additionalProperties": false
}"#;

/// `jsonGenericBytes`: `{"firstName":"John","lastName":"Doe","age":21}`.
const JSON_GENERIC: [i8; 64] = [
    3, 0, -73, -76, -89, -16, -100, -106, 78, 74, -90, -121, -5, 93, -23, -17, 12, 99, 123, 34,
    102, 105, 114, 115, 116, 78, 97, 109, 101, 34, 58, 34, 74, 111, 104, 110, 34, 44, 34, 108, 97,
    115, 116, 78, 97, 109, 101, 34, 58, 34, 68, 111, 101, 34, 44, 34, 97, 103, 101, 34, 58, 50, 49,
    125,
];

fn unsigned(signed: &[i8]) -> Vec<u8> {
    signed.iter().map(|&b| b as u8).collect()
}

fn reference_version() -> Uuid {
    Uuid::parse_str(REFERENCE_VERSION).unwrap()
}

/// The user in the reader's shape (`USER_V2`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize, serde::Serialize)]
struct User {
    name: String,
    favorite_number: Option<i32>,
    favorite_color: Option<String>,
    favorite_animal: String,
}

/// The reference's `Person`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Person {
    first_name: String,
    last_name: String,
    age: i64,
}

// ---------------------------------------------------------------------------------------
// The documented layout, written here independently of shardflow's framing module.

const ZLIB: u8 = 5;

/// Frames `data` as the reference's encoder does: version byte 3, compression byte (0
/// none, 5 zlib: `java.util.zip.Deflater` at its default level, a zlib stream), the
/// version id's most then least significant 64 bits big-endian, the (compressed) data.
fn reference_frame(version: Uuid, zlib: bool, data: &[u8]) -> Vec<u8> {
    let (msb, lsb) = version.as_u64_pair();
    let mut out = vec![3, if zlib { ZLIB } else { 0 }];
    out.extend_from_slice(&msb.to_be_bytes());
    out.extend_from_slice(&lsb.to_be_bytes());
    if zlib {
        let mut deflater = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(6));
        deflater.write_all(data).unwrap();
        out.extend_from_slice(&deflater.finish().unwrap());
    } else {
        out.extend_from_slice(data);
    }
    out
}

/// What the reference's decoder reads from a framed record.
#[derive(Debug)]
struct ReferenceRead {
    version: Uuid,
    compressed: bool,
    data: Vec<u8>,
}

/// Reads a framed record as the reference's decoder does, refusing anything else.
fn reference_read(bytes: &[u8]) -> Result<ReferenceRead, String> {
    if bytes.len() < 18 {
        return Err(format!("{} bytes: shorter than the header", bytes.len()));
    }
    if bytes[0] != 3 {
        return Err(format!("header version {}", bytes[0]));
    }
    let compressed = match bytes[1] {
        0 => false,
        ZLIB => true,
        other => return Err(format!("compression byte {other}")),
    };
    let msb = u64::from_be_bytes(bytes[2..10].try_into().unwrap());
    let lsb = u64::from_be_bytes(bytes[10..18].try_into().unwrap());
    let mut data = Vec::new();
    if compressed {
        flate2::read::ZlibDecoder::new(&bytes[18..])
            .read_to_end(&mut data)
            .map_err(|e| format!("zlib: {e}"))?;
    } else {
        data.extend_from_slice(&bytes[18..]);
    }
    Ok(ReferenceRead {
        version: Uuid::from_u64_pair(msb, lsb),
        compressed,
        data,
    })
}

/// The Protobuf message index before the message: protobuf's `uint32` varint.
fn reference_message_index(data: &[u8]) -> Result<(u32, &[u8]), String> {
    let mut value = 0u32;
    for (i, &byte) in data.iter().enumerate().take(5) {
        value |= u32::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Ok((value, &data[i + 1..]));
        }
    }
    Err("no message index".into())
}

// ---------------------------------------------------------------------------------------
// The consumer run.

struct Seen<T> {
    handled: Vec<T>,
    dead: Vec<DeadLetterRecord>,
}

/// Puts `records` on a new stream of the embedded backend, runs a consumer with
/// `dead_letter → schema registry(format, registry) → handler` until every record was
/// handled or dead-lettered, and returns what each saw.
async fn consume<T, F>(records: Vec<Vec<u8>>, format: F, registry: MemoryRegistry) -> Seen<T>
where
    T: Send + 'static,
    F: shardflow_middleware::codec::SchemaFormat<T> + Send + Sync + 'static,
    F::Error: Send + Sync + 'static,
{
    let backend = Memory::new();
    let kinesis = backend.admin().unwrap();
    kinesis.create_stream("people", 2).await.unwrap();
    let total = records.len();
    let puts: Vec<PutRecord> = records
        .into_iter()
        .enumerate()
        .map(|(i, data)| PutRecord {
            data: Bytes::from(data),
            partition_key: format!("pk-{}", i % 13),
            explicit_hash_key: None,
        })
        .collect();
    for chunk in puts.chunks(500) {
        let outcomes = kinesis.put_records("people", chunk).await.unwrap();
        assert!(outcomes
            .iter()
            .all(|o| !matches!(o, PutOutcome::Failed { .. })));
    }

    let seen: Arc<Mutex<Seen<T>>> = Arc::new(Mutex::new(Seen {
        handled: Vec::new(),
        dead: Vec::new(),
    }));
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
        move |msg: Message<T>| {
            seen.lock().unwrap().handled.push(msg.payload);
            progress.notify_one();
            async { Ok::<_, BoxError>(()) }
        }
    });
    let stack = ServiceBuilder::new()
        .dead_letter(sink)
        .schema_registry(format, registry)
        .service(handler);
    let consumer = Consumer::builder()
        .stream("people")
        .group("readers")
        .backend(backend.clone())
        .idle_read_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let running = consumer.run(stack).spawn();
    let all_finished = async {
        loop {
            {
                let seen = seen.lock().unwrap();
                if seen.handled.len() + seen.dead.len() >= total {
                    break;
                }
            }
            progress.notified().await;
        }
    };
    within("every record is handled or dead-lettered", all_finished).await;
    within("the consumer stops", running.shutdown())
        .await
        .unwrap();
    let mut seen = seen.lock().unwrap();
    Seen {
        handled: std::mem::take(&mut seen.handled),
        dead: std::mem::take(&mut seen.dead),
    }
}

impl<T> Seen<T> {
    fn dead_errors(&self) -> Vec<&str> {
        self.dead.iter().map(|d| d.error.as_str()).collect()
    }
}

fn avro_datum(schema: &apache_avro::Schema, value: apache_avro::types::Value) -> Vec<u8> {
    apache_avro::to_avro_datum(schema, value).unwrap()
}

fn v1_user(name: &str, number: Option<i32>, color: Option<&str>) -> apache_avro::types::Value {
    use apache_avro::types::Value;
    Value::Record(vec![
        ("name".into(), Value::String(name.into())),
        (
            "favorite_number".into(),
            match number {
                Some(n) => Value::Union(0, Box::new(Value::Int(n))),
                None => Value::Union(1, Box::new(Value::Null)),
            },
        ),
        (
            "favorite_color".into(),
            match color {
                Some(c) => Value::Union(0, Box::new(Value::String(c.into()))),
                None => Value::Union(1, Box::new(Value::Null)),
            },
        ),
    ])
}

fn user(name: &str, number: Option<i32>, color: Option<&str>) -> User {
    User {
        name: name.into(),
        favorite_number: number,
        favorite_color: color.map(Into::into),
        favorite_animal: "none".into(),
    }
}

/// Avro records in the reference's format decode into the reader's type through
/// `Consumer::run`: the reference's two vectors as published and zlib-compressed, 200
/// more written with the reference's schema (v1) and framed from the documented layout,
/// resolved to the reader's schema (v2, a field added with a default). Records written
/// with an incompatible schema version are dead-lettered as schema mismatches, a datum
/// cut short as an invalid payload; each once, nothing else lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn avro_in_the_reference_format_decodes_with_schema_evolution() {
    let v1 = apache_avro::Schema::parse_str(USER_V1).unwrap();
    let registry = MemoryRegistry::new();
    registry.insert(
        reference_version(),
        "User-Topic",
        WriterSchema::new(DataFormat::Avro, USER_V1),
    );
    let incompatible = registry.register(
        "User-Topic",
        WriterSchema::new(DataFormat::Avro, USER_INCOMPATIBLE),
    );

    let mut records = Vec::new();
    let mut expected = Vec::new();
    for vector in [&AVRO_GENERIC[..], &AVRO_SPECIFIC[..]] {
        let bytes = unsigned(vector);
        records.push(bytes.clone());
        records.push(reference_frame(reference_version(), true, &bytes[18..]));
    }
    expected.extend([
        user("sansa", Some(99), Some("red")),
        user("sansa", Some(99), Some("red")),
        user("test", Some(10), Some("violet")),
        user("test", Some(10), Some("violet")),
    ]);
    let mut rng = Rng::new(32);
    for i in 0..200 {
        let name = format!("user-{i}-{}", "x".repeat(rng.below(150) as usize));
        let number = rng.chance(0.8).then(|| rng.next_u64() as i32);
        let color = rng.chance(0.5).then_some("teal");
        let datum = avro_datum(&v1, v1_user(&name, number, color));
        records.push(reference_frame(
            reference_version(),
            rng.chance(0.5),
            &datum,
        ));
        expected.push(user(&name, number, color));
    }
    // Written with a version whose `favorite_number` the reader cannot read.
    let bad_schema = apache_avro::Schema::parse_str(USER_INCOMPATIBLE).unwrap();
    for i in 0..5 {
        use apache_avro::types::Value;
        let datum = avro_datum(
            &bad_schema,
            Value::Record(vec![
                ("name".into(), Value::String(format!("bad-{i}"))),
                ("favorite_number".into(), Value::String("many".into())),
                (
                    "favorite_color".into(),
                    Value::Union(1, Box::new(Value::Null)),
                ),
            ]),
        );
        records.push(reference_frame(incompatible, i % 2 == 0, &datum));
    }
    // A datum cut short inside its name.
    let cut = avro_datum(&v1, v1_user("truncated-name", Some(1), None));
    records.push(reference_frame(reference_version(), false, &cut[..6]));

    let reader = Avro::<User>::with_schema(apache_avro::Schema::parse_str(USER_V2).unwrap());
    let mut seen = consume(records, reader, registry).await;

    seen.handled.sort();
    expected.sort();
    assert_eq!(seen.handled, expected, "every compatible record, once");
    let errors = seen.dead_errors();
    assert_eq!(errors.len(), 6, "{errors:?}");
    let mismatches = errors
        .iter()
        .filter(|e| e.contains("does not match its Avro schema"))
        .count();
    assert_eq!(mismatches, 5, "{errors:?}");
    assert_eq!(
        errors
            .iter()
            .filter(|e| e.contains("is not valid Avro"))
            .count(),
        1,
        "{errors:?}"
    );
}

/// JSON Schema records in the reference's format decode into the user's type through
/// `Consumer::run`, validated against the registered schema: the reference's vector as
/// published and zlib-compressed, and 200 more framed from the documented layout. Records
/// that break the schema (a negative age, an extra property) are dead-lettered as schema
/// mismatches, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_in_the_reference_format_decodes_and_mismatches_are_dead_lettered() {
    let registry = MemoryRegistry::new();
    registry.insert(
        reference_version(),
        "Person-Topic",
        WriterSchema::new(DataFormat::JsonSchema, PERSON_SCHEMA),
    );
    let john = Person {
        first_name: "John".into(),
        last_name: "Doe".into(),
        age: 21,
    };
    let vector = unsigned(&JSON_GENERIC);
    let mut records = vec![
        vector.clone(),
        reference_frame(reference_version(), true, &vector[18..]),
    ];
    let mut expected = vec![john.clone(), john];
    let mut rng = Rng::new(32);
    for i in 0..200 {
        let person = Person {
            first_name: format!("first-{i}"),
            last_name: "l".repeat(rng.below(120) as usize),
            age: rng.below(100) as i64,
        };
        let json = serde_json::to_vec(&person).unwrap();
        records.push(reference_frame(reference_version(), rng.chance(0.5), &json));
        expected.push(person);
    }
    for (i, bad) in [
        r#"{"firstName":"Ann","lastName":"Lee","age":-1}"#,
        r#"{"firstName":"Ann","lastName":"Lee","age":30,"nickname":"al"}"#,
        r#"{"firstName":"Ann","lastName":"Lee","age":"thirty"}"#,
    ]
    .iter()
    .enumerate()
    {
        records.push(reference_frame(reference_version(), i == 1, bad.as_bytes()));
    }

    let format = JsonSchema::<Person>::new(PERSON_SCHEMA).unwrap();
    let mut seen = consume(records, format, registry).await;

    seen.handled.sort();
    expected.sort();
    assert_eq!(seen.handled, expected, "every valid record, once");
    let errors = seen.dead_errors();
    assert_eq!(errors.len(), 3, "{errors:?}");
    assert!(
        errors
            .iter()
            .all(|e| e.contains("does not match its JSON Schema schema")),
        "{errors:?}"
    );
}

/// Protobuf test type: `message Person { string name = 1; int32 age = 2; }`.
#[derive(Clone, PartialEq, prost::Message)]
struct PersonPb {
    #[prost(string, tag = "1")]
    name: String,
    #[prost(int32, tag = "2")]
    age: i32,
}

const PERSON_PROTO: &str = "syntax = \"proto3\";\npackage people;\n\nmessage Address {\n  string city = 1;\n}\n\nmessage Person {\n  string name = 1;\n  int32 age = 2;\n}\n";

/// What `SchemaRegistryEncoder` writes, the reference's layout reads: for each format and
/// both compressions, the header read byte by byte names the version the registry gave the
/// writer schema, and the data after it is a valid encoding in the format's own library
/// (apache-avro with the registered writer schema, serde_json, prost after the message
/// index). The Avro bytes are those of the reference's own vector.
#[tokio::test]
async fn what_the_encoder_writes_the_reference_layout_reads() {
    let registry = MemoryRegistry::new();
    let cache = CachedRegistry::new(registry.clone());

    // Avro: the reference's schema under the reference's version id; encoding the
    // reference's record gives the reference's bytes.
    #[derive(serde::Serialize)]
    struct UserV1 {
        name: String,
        favorite_number: Option<i32>,
        favorite_color: Option<String>,
    }
    let v1 = apache_avro::Schema::parse_str(USER_V1).unwrap();
    let avro = Avro::<UserV1>::with_schema(v1.clone());
    let avro_schema = shardflow_middleware::codec::Encoder::writer_schema(&avro).unwrap();
    registry.insert(reference_version(), "User-Topic", avro_schema);
    let sansa = UserV1 {
        name: "sansa".into(),
        favorite_number: Some(99),
        favorite_color: Some("red".into()),
    };
    for compression in [Compression::None, Compression::Zlib] {
        let encoder = SchemaRegistryEncoder::new(avro.clone(), cache.clone(), "User-Topic")
            .compression(compression);
        let framed = encoder.encode(&sansa).await.unwrap();
        let read = reference_read(&framed).unwrap();
        assert_eq!(read.version, reference_version());
        assert_eq!(read.compressed, compression == Compression::Zlib);
        assert_eq!(read.data, unsigned(&AVRO_GENERIC)[18..], "the datum");
        if compression == Compression::None {
            assert_eq!(framed.as_ref(), unsigned(&AVRO_GENERIC), "the vector");
        }
        let value = apache_avro::from_avro_datum(&v1, &mut read.data.as_slice(), None).unwrap();
        assert_eq!(value, v1_user("sansa", Some(99), Some("red")));
    }

    // JSON Schema: the data is the JSON of the value.
    let json = JsonSchema::<Person>::new(PERSON_SCHEMA).unwrap();
    let person = Person {
        first_name: "John".into(),
        last_name: "Doe".into(),
        age: 21,
    };
    for compression in [Compression::None, Compression::Zlib] {
        let encoder = SchemaRegistryEncoder::new(json.clone(), cache.clone(), "Person-Topic")
            .auto_register(true)
            .compression(compression);
        let framed = encoder.encode(&person).await.unwrap();
        let read = reference_read(&framed).unwrap();
        assert_eq!(read.compressed, compression == Compression::Zlib);
        let registered = registered(
            &registry,
            "Person-Topic",
            DataFormat::JsonSchema,
            PERSON_SCHEMA,
        );
        assert_eq!(read.version, registered.await, "the registered version");
        let value: serde_json::Value = serde_json::from_slice(&read.data).unwrap();
        let vector: serde_json::Value =
            serde_json::from_slice(&unsigned(&JSON_GENERIC)[18..]).unwrap();
        assert_eq!(value, vector, "the vector's document");
    }

    // Protobuf: message index 1 (`people.Address` 0, `people.Person` 1), then the message;
    // the index derived from the message's name.
    let pb = Protobuf::<PersonPb>::new()
        .with_writer_schema(PERSON_PROTO)
        .named();
    let ann = PersonPb {
        name: "Ann".into(),
        age: 30,
    };
    for compression in [Compression::None, Compression::Zlib] {
        let encoder = SchemaRegistryEncoder::new(pb.clone(), cache.clone(), "Person-Proto")
            .auto_register(true)
            .compression(compression);
        let framed = encoder.encode(&ann).await.unwrap();
        let read = reference_read(&framed).unwrap();
        assert_eq!(read.compressed, compression == Compression::Zlib);
        let registered = registered(
            &registry,
            "Person-Proto",
            DataFormat::Protobuf,
            PERSON_PROTO,
        );
        assert_eq!(read.version, registered.await);
        let (index, message) = reference_message_index(&read.data).unwrap();
        assert_eq!(index, 1);
        assert_eq!(<PersonPb as prost::Message>::decode(message).unwrap(), ann);
    }
}

/// The version id `registry` holds for `definition` under `name`.
async fn registered(
    registry: &MemoryRegistry,
    name: &str,
    format: DataFormat,
    definition: &str,
) -> Uuid {
    registry
        .version_id(name, &WriterSchema::new(format, definition), false)
        .await
        .unwrap()
}

/// The reader written here refuses what the reference refuses, so the check above can fail.
#[test]
fn the_independent_reader_refuses_broken_headers() {
    let good = unsigned(&AVRO_GENERIC);
    assert!(reference_read(&good).is_ok());
    assert!(reference_read(&good[..17]).is_err());
    let mut v = good.clone();
    v[0] = 2;
    assert!(reference_read(&v).is_err());
    let mut v = good.clone();
    v[1] = 1;
    assert!(reference_read(&v).is_err());
    let mut v = good;
    v[1] = ZLIB;
    assert!(reference_read(&v).is_err(), "not a zlib stream");
}

impl prost::Name for PersonPb {
    const NAME: &'static str = "Person";
    const PACKAGE: &'static str = "people";
}

/// `message Address { string city = 1; }` of `PERSON_PROTO`.
#[derive(Clone, PartialEq, prost::Message)]
struct AddressPb {
    #[prost(string, tag = "1")]
    city: String,
}

/// A framed Protobuf record whose message index names another message of the writer's
/// `.proto` than the one the format decodes into is a schema mismatch when the format
/// knows its message's name; without the name the same bytes decode into the wrong type
/// (an `Address`'s city read as a `Person`'s name), which is why the check exists.
#[tokio::test]
async fn a_protobuf_message_index_naming_another_message_is_a_schema_mismatch() {
    use shardflow_middleware::codec::protobuf::message_index;
    use shardflow_middleware::{DecodeError, DecodeErrorKind};
    use tower::{Layer, ServiceExt};

    let registry = MemoryRegistry::new();
    let version = registry.register(
        "people",
        WriterSchema::new(DataFormat::Protobuf, PERSON_PROTO),
    );
    assert_eq!(
        message_index(PERSON_PROTO, "people.Address").unwrap(),
        Some(0)
    );
    assert_eq!(
        message_index(PERSON_PROTO, "people.Person").unwrap(),
        Some(1)
    );
    let frame = |index: u8, message: Vec<u8>| {
        let mut data = vec![index];
        data.extend_from_slice(&message);
        Bytes::from(reference_frame(version, false, &data))
    };
    let address = frame(
        0,
        prost::Message::encode_to_vec(&AddressPb {
            city: "Lyon".into(),
        }),
    );
    let ann = PersonPb {
        name: "Ann".into(),
        age: 30,
    };
    let person = frame(1, prost::Message::encode_to_vec(&ann));
    let out_of_range = frame(7, prost::Message::encode_to_vec(&ann));

    let decode = |format: Protobuf<PersonPb>, bytes: Bytes| {
        let svc = SchemaRegistryLayer::new(format, registry.clone()).layer(service_fn(
            |m: Message<PersonPb>| async move { Ok::<_, BoxError>(m.payload) },
        ));
        svc.oneshot(common::message("shardId-000000000000", 1, bytes))
    };
    let kind = |err: BoxError| {
        err.downcast_ref::<DecodeError>()
            .map(|e| e.kind().clone())
            .expect("a DecodeError")
    };

    // Unnamed: the Address decodes as a Person with the city as its name.
    let wrong = decode(Protobuf::new(), address.clone()).await.unwrap();
    assert_eq!(wrong.name, "Lyon");

    let named = Protobuf::<PersonPb>::new().named();
    assert_eq!(decode(named.clone(), person).await.unwrap(), ann);
    let err = decode(named.clone(), address).await.unwrap_err();
    assert_eq!(kind(err), DecodeErrorKind::SchemaMismatch);
    let err = decode(named, out_of_range).await.unwrap_err();
    let reason = std::error::Error::source(&*err).map(|s| s.to_string());
    assert!(
        reason
            .as_deref()
            .is_some_and(|s| s.contains("names no message")),
        "{reason:?}"
    );
    assert_eq!(kind(err), DecodeErrorKind::SchemaMismatch);
}

/// The encoder derives the message index from the message's name; a message the writer's
/// `.proto` does not declare is refused before anything is written.
#[tokio::test]
async fn the_encoder_refuses_a_message_its_proto_does_not_declare() {
    use shardflow_middleware::schema_registry::SchemaEncodeError;
    let cache = CachedRegistry::new(MemoryRegistry::new());
    let ann = PersonPb {
        name: "Ann".into(),
        age: 30,
    };
    let stray = Protobuf::<PersonPb>::new()
        .with_writer_schema(PERSON_PROTO)
        .with_message_name("people.Customer");
    let encoder = SchemaRegistryEncoder::new(stray, cache.clone(), "people").auto_register(true);
    let err = encoder.encode(&ann).await.unwrap_err();
    assert!(
        matches!(&err, SchemaEncodeError::MessageNotInSchema { message } if message == "people.Customer"),
        "{err}"
    );
    // An explicit index wins over the name.
    let pinned = SchemaRegistryEncoder::new(
        Protobuf::<PersonPb>::new()
            .with_writer_schema(PERSON_PROTO)
            .with_message_name("people.Customer"),
        cache,
        "people",
    )
    .auto_register(true)
    .message_index(1);
    let framed = pinned.encode(&ann).await.unwrap();
    let read = reference_read(&framed).unwrap();
    assert_eq!(reference_message_index(&read.data).unwrap().0, 1);
}
