//! Headers in Spring Cloud Stream's formats: the fixtures under `tests/fixtures/spring/`
//! (built byte for byte from Spring's sources, see the README there) are read, our
//! writer's output is those bytes, what we write we read back, records that are not
//! envelopes arrive unchanged, and headers travel producer -> consumer -> processor ->
//! consumer on the embedded backend.
//!
//! Property tests run with fixed seeds: the same cases on every run and machine.

use std::convert::Infallible;
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use shardflow::headers::spring::{
    read_json, read_legacy, write_embedded, write_json, write_legacy,
};
use shardflow::kinesis::StreamAdmin;
use shardflow::producer::{InvalidRecord, ProduceError, Producer, ProducerRecord};
use shardflow::{HeaderFormat, HeaderValue, Headers, Memory, Message};
use shardflow_middleware::produce::Output;
use shardflow_middleware::ServiceBuilderExt;
use testkit::*;
use tower::ServiceBuilder;

const PAYLOAD: &[u8] = br#"{"id":1}"#;
const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
const UUID: &str = "0b3a94d6-33b4-4bd6-a8e7-4c0d2d8c4c41";
const TIMESTAMP: i64 = 1_764_633_600_000;

fn fixture(name: &str) -> Bytes {
    let path = format!(
        "{}/tests/fixtures/spring/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    Bytes::from(std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e}")))
}

fn names(headers: &Headers) -> Vec<&str> {
    headers.names().collect()
}

/// The fixture's headers in the order Spring's `HashMap` wrote them.
fn typed_headers() -> Headers {
    let mut h = Headers::new();
    h.insert("traceparent", TRACEPARENT);
    h.insert(
        "id",
        HeaderValue::Typed {
            class: "java.util.UUID".into(),
            value: UUID.into(),
        },
    );
    h.insert("contentType", "application/json");
    h.insert("timestamp", TIMESTAMP);
    h
}

// ---------------------------------------------------------------------------------------
// Spring's bytes, read

#[test]
fn spring_json_headers_are_read_and_the_framing_stripped() {
    let (headers, payload) = read_json(&fixture("json_content_type_traceparent.bin")).unwrap();
    assert_eq!(payload.as_ref(), PAYLOAD);
    assert_eq!(headers.get_str("contentType"), Some("application/json"));
    assert_eq!(headers.get_str("traceparent"), Some(TRACEPARENT));
    assert_eq!(
        names(&headers),
        ["traceparent", "contentType"],
        "wire order kept"
    );
}

#[test]
fn spring_typed_id_and_timestamp_are_read_with_their_types() {
    let (headers, payload) = read_json(&fixture("json_typed_id_timestamp.bin")).unwrap();
    assert_eq!(payload.as_ref(), PAYLOAD);
    assert_eq!(headers, typed_headers());
    assert_eq!(headers.get_str("id"), Some(UUID));
    assert_eq!(
        headers.get("timestamp").unwrap().to_json().as_i64(),
        Some(TIMESTAMP)
    );
}

#[test]
fn spring_empty_header_map_is_an_envelope_without_headers() {
    let (headers, payload) = read_json(&fixture("json_empty_headers.bin")).unwrap();
    assert!(headers.is_empty());
    assert_eq!(payload.as_ref(), PAYLOAD);
}

#[test]
fn spring_message_document_is_read_as_headers_and_payload() {
    let (headers, payload) = read_json(&fixture("json_message_document.json")).unwrap();
    assert_eq!(payload.as_ref(), PAYLOAD, "the String payload's text");
    assert_eq!(headers, typed_headers());
}

#[test]
fn spring_legacy_headers_are_read_and_the_framing_stripped() {
    let (headers, payload) = read_legacy(&fixture("legacy_content_type_traceparent.bin")).unwrap();
    assert_eq!(payload.as_ref(), PAYLOAD);
    assert_eq!(names(&headers), ["contentType", "traceparent"]);
    assert_eq!(headers.get_str("contentType"), Some("application/json"));
    assert_eq!(headers.get_str("traceparent"), Some(TRACEPARENT));
}

#[test]
fn auto_reads_the_json_fixtures_and_none_reads_none() {
    for name in [
        "json_content_type_traceparent.bin",
        "json_typed_id_timestamp.bin",
        "json_empty_headers.bin",
        "json_message_document.json",
        "legacy_content_type_traceparent.bin",
    ] {
        let data = fixture(name);
        let legacy = name.starts_with("legacy");
        let (_, payload) = HeaderFormat::SpringJsonAndLegacy
            .read(&data)
            .unwrap_or_else(|| panic!("{name}"));
        assert_eq!(payload.as_ref(), PAYLOAD, "{name}");
        // The maintained Spring binder never reads the legacy framing; neither does Auto.
        assert_eq!(HeaderFormat::Auto.read(&data).is_some(), !legacy, "{name}");
        assert_eq!(
            HeaderFormat::SpringJson.read(&data).is_some(),
            !legacy,
            "{name}"
        );
        assert_eq!(
            HeaderFormat::SpringLegacy.read(&data).is_some(),
            legacy,
            "{name}"
        );
        assert!(HeaderFormat::None.read(&data).is_none(), "{name}");
    }
}

// ---------------------------------------------------------------------------------------
// Our bytes are Spring's

#[test]
fn our_json_framing_is_the_spring_fixture_byte_for_byte() {
    let mut plain = Headers::new();
    plain.insert("traceparent", TRACEPARENT);
    plain.insert("contentType", "application/json");
    assert_eq!(
        write_json(&plain, PAYLOAD).unwrap(),
        fixture("json_content_type_traceparent.bin")
    );
    assert_eq!(
        write_json(&typed_headers(), PAYLOAD).unwrap(),
        fixture("json_typed_id_timestamp.bin")
    );
    assert_eq!(
        write_json(&Headers::new(), PAYLOAD).unwrap(),
        fixture("json_empty_headers.bin")
    );
}

#[test]
fn our_json_framing_in_another_order_differs_only_in_order() {
    let mut reordered = Headers::new();
    reordered.insert("contentType", "application/json");
    reordered.insert("traceparent", TRACEPARENT);
    let ours = write_json(&reordered, PAYLOAD).unwrap();
    let spring = fixture("json_content_type_traceparent.bin");
    assert_eq!(ours.len(), spring.len());
    assert_eq!(ours[..4], spring[..4], "same header length");
    let (mine, _) = read_json(&ours).unwrap();
    let (theirs, _) = read_json(&spring).unwrap();
    let sorted = |h: &Headers| {
        let mut v: Vec<_> = h.iter().map(|(n, v)| (n.to_owned(), v.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    assert_eq!(sorted(&mine), sorted(&theirs));
}

#[test]
fn our_legacy_framing_is_the_spring_fixture_byte_for_byte() {
    let mut h = Headers::new();
    h.insert("contentType", "application/json");
    h.insert("traceparent", TRACEPARENT);
    assert_eq!(
        write_legacy(&h, PAYLOAD).unwrap(),
        fixture("legacy_content_type_traceparent.bin")
    );
}

// ---------------------------------------------------------------------------------------
// Payloads that look like frames, and headers that look like types

/// 16 binary bytes that read as a legacy frame with one header named "" (value `7`).
fn legacy_lookalike() -> Bytes {
    let mut v = vec![0xff, 0x01, 0x00, 0x00, 0x00, 0x00, 0x01, b'7'];
    v.extend_from_slice(&[0xde, 0xad, 0xbe, 0xef, 0x00, 0x01, 0x02, 0x03]);
    Bytes::from(v)
}

/// Two length-prefixed JSON messages (50 bytes): the shape of the JSON framing.
fn two_json_messages() -> Bytes {
    let mut v = Vec::new();
    for message in [&br#"{"order":1,"qty":10}"#[..], br#"{"order":2,"qty":20}"#] {
        v.extend_from_slice(&(message.len() as u32).to_be_bytes());
        v.extend_from_slice(message);
    }
    assert_eq!(v.len(), 48);
    v.extend_from_slice(b"\n\n");
    let len = v.len() - 4 - 4 - 20;
    v[24..28].copy_from_slice(&(len as u32).to_be_bytes());
    Bytes::from(v)
}

/// Regression: the default reader took records that Spring's maintained binder, in its
/// default configuration, delivers whole for frames: a legacy-looking binary payload
/// lost 8 bytes to a header named "", and two length-prefixed JSON messages lost the
/// first one to headers.
#[test]
fn records_spring_delivers_whole_are_delivered_whole_by_default() {
    let two = two_json_messages();
    assert_eq!(two.len(), 50);
    for (what, data) in [
        ("legacy look-alike", legacy_lookalike()),
        ("two JSON messages", two),
    ] {
        assert!(HeaderFormat::Auto.read(&data).is_none(), "{what}");
    }
    // A JSON frame is one when its header object carries the Java map type Spring's
    // reader needs, wherever that member stands.
    let mut typed_later = Vec::new();
    let json = br#"{"contentType":"text/plain","@class":"java.util.HashMap"}"#;
    typed_later.extend_from_slice(&(json.len() as u32).to_be_bytes());
    typed_later.extend_from_slice(json);
    typed_later.extend_from_slice(&2u32.to_be_bytes());
    typed_later.extend_from_slice(b"hi");
    let (headers, payload) = HeaderFormat::Auto.read(&Bytes::from(typed_later)).unwrap();
    assert_eq!(headers.get_str("contentType"), Some("text/plain"));
    assert_eq!(payload.as_ref(), b"hi");
}

/// Regression: a payload sent without headers that a reader could take for a frame
/// arrived short (and with made-up headers); the producer now frames it with an empty
/// header map, so every reader gets it back byte for byte.
#[tokio::test(start_paused = true)]
async fn payloads_that_look_like_frames_arrive_byte_for_byte() {
    let memory = Memory::new();
    memory.streams().create_stream("look", 1).await.unwrap();
    let producer = Producer::builder()
        .stream("look")
        .backend(memory.clone())
        .linger(Duration::ZERO)
        .build()
        .unwrap();
    let payloads = [
        legacy_lookalike(),
        two_json_messages(),
        fixture("json_typed_id_timestamp.bin"),
        fixture("json_message_document.json"),
        fixture("legacy_content_type_traceparent.bin"),
        Bytes::from_static(b"plain"),
    ];
    for payload in &payloads {
        producer
            .send(ProducerRecord::new(payload.clone(), "k"))
            .limited()
            .await
            .unwrap();
    }
    producer.close().limited().await;
    // Every reader of the JSON framing, which is how the producer writes headers.
    for format in [
        HeaderFormat::Auto,
        HeaderFormat::SpringJson,
        HeaderFormat::SpringJsonAndLegacy,
    ] {
        let messages = first_batch(&memory, "look", format).await;
        assert_eq!(messages.len(), payloads.len(), "{format:?}");
        for (i, (message, sent)) in messages.iter().zip(&payloads).enumerate() {
            assert_eq!(&message.payload, sent, "{format:?} payload {i}");
            assert!(message.headers.is_empty(), "{format:?} payload {i}");
        }
    }
    // Only the look-alikes pay for a frame; a plain payload goes bare.
    let raw = first_batch(&memory, "look", HeaderFormat::None).await;
    assert_eq!(raw[5].payload.as_ref(), b"plain");
    assert!(raw[..5]
        .iter()
        .zip(&payloads)
        .all(|(m, p)| m.payload.len() > p.len()));
}

/// Headers that look like Jackson's type information, and typed values of an
/// application's own classes.
fn type_like_headers() -> Headers {
    let mut h = Headers::new();
    h.insert("@class", "com.example.NotAType");
    h.insert(
        "document",
        serde_json::json!({"@class": "com.example.Member", "n": 1, "inner": {"@class": 2}}),
    );
    h.insert(
        "price",
        HeaderValue::Typed {
            class: "com.example.Money".into(),
            value: serde_json::json!({"amount": 12.5, "currency": "EUR"}),
        },
    );
    h.insert(
        "code",
        HeaderValue::Typed {
            class: "com.example.Code".into(),
            value: "A-1".into(),
        },
    );
    h.insert(
        "list",
        HeaderValue::Typed {
            class: "java.util.LinkedList".into(),
            value: serde_json::json!(["a.b", 1]),
        },
    );
    h.insert("", "an empty name");
    h
}

/// Regression: a header named `@class` and a JSON member named `@class` vanished, and a
/// typed value of an application class came back untyped.
#[test]
fn headers_that_look_like_types_come_back_equal() {
    let bytes = write_json(&type_like_headers(), PAYLOAD).unwrap();
    let (read, payload) = HeaderFormat::Auto.read(&bytes).expect("an envelope");
    assert_eq!(read, type_like_headers());
    assert_eq!(payload.as_ref(), PAYLOAD);
}

#[tokio::test(start_paused = true)]
async fn headers_that_look_like_types_travel_through_the_producer() {
    let memory = Memory::new();
    memory.streams().create_stream("types", 1).await.unwrap();
    let producer = Producer::builder()
        .stream("types")
        .backend(memory.clone())
        .linger(Duration::ZERO)
        .build()
        .unwrap();
    producer
        .send(ProducerRecord::new(PAYLOAD, "k").headers(type_like_headers()))
        .limited()
        .await
        .unwrap();
    // A class no Java reader could load is refused before anything is sent.
    let refused = producer
        .send(ProducerRecord::new(PAYLOAD, "k").with_header(
            "bad",
            HeaderValue::Typed {
                class: "not a class".into(),
                value: 1.into(),
            },
        ))
        .limited()
        .await;
    assert_eq!(
        refused,
        Err(ProduceError::InvalidRecord(InvalidRecord::HeaderClass(
            "not a class".into()
        )))
    );
    producer.close().limited().await;
    let messages = first_batch(&memory, "types", HeaderFormat::Auto).await;
    assert_eq!(messages.len(), 1);
    assert_eq!(messages[0].headers, type_like_headers());
    assert_eq!(messages[0].payload.as_ref(), PAYLOAD);
}

// ---------------------------------------------------------------------------------------
// Properties (fixed seeds)

fn runner(seed: u8, cases: u32) -> TestRunner {
    TestRunner::new_with_rng(
        Config::with_cases(cases),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]),
    )
}

/// The runner of a generator: `cases` with the fixed `seed` in the suite; for a longer
/// run on demand, `SHARDFLOW_HEADER_CASES=<n>` sets the number of cases and
/// `SHARDFLOW_HEADER_SEED=<0..=255>` the seed (a failure replays with the same two).
fn generator(seed: u8, cases: u32) -> TestRunner {
    let from_env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok());
    let seed = from_env("SHARDFLOW_HEADER_SEED").map_or(seed, |s| (s % 256) as u8);
    runner(seed, from_env("SHARDFLOW_HEADER_CASES").unwrap_or(cases))
}

/// Names of every kind: `@class`, empty, any Unicode (control characters included).
fn header_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("@class".to_owned()),
        Just(String::new()),
        "[a-zA-Z@]{1,8}",
        "\\PC{0,12}",
        any::<String>(),
    ]
}

/// JSON of every kind: integers of any size, floats (any finite, and in [0, 1)),
/// strings of any Unicode, nested arrays and objects whose members may be named
/// `@class` or look like Jackson's type wrappers.
fn json() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i32>().prop_map(Value::from),
        any::<bool>().prop_map(Value::from),
        any::<String>().prop_map(Value::from),
        Just(Value::Null),
        (0.0f64..1.0).prop_map(Value::from),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(Value::from),
        class_name().prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            (class_name(), inner.clone())
                .prop_map(|(class, v)| Value::from(vec![Value::from(class), v])),
            proptest::collection::btree_map(header_name(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Java class names: an application's, the JDK's, the ones the writer implies, Unicode.
fn class_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("com.example.Money".to_owned()),
        Just("java.lang.Long".to_owned()),
        Just("java.util.ArrayList".to_owned()),
        Just("java.util.LinkedHashMap".to_owned()),
        "java\\.(util|lang|time)\\.[A-Z][a-z]{1,8}",
        "[a-zé_$][a-z0-9é_$]{0,6}(\\.[a-zA-Zé_$][a-zA-Z0-9_$]{0,6}){1,3}",
    ]
}

/// Header values of every kind: strings, any JSON (a JSON string too), typed values.
fn header_value() -> impl Strategy<Value = HeaderValue> {
    prop_oneof![
        any::<String>().prop_map(HeaderValue::String),
        json().prop_map(HeaderValue::Json),
        (class_name(), json()).prop_map(|(class, value)| HeaderValue::Typed { class, value }),
    ]
}

fn headers() -> impl Strategy<Value = Headers> {
    proptest::collection::vec((header_name(), header_value()), 0..6)
        .prop_map(|pairs| pairs.into_iter().collect())
}

#[test]
fn what_we_write_we_read_back() {
    runner(1, 512)
        .run(
            &(headers(), proptest::collection::vec(any::<u8>(), 0..200)),
            |(headers, payload)| {
                let bytes = write_json(&headers, &payload).unwrap();
                let (read, body) = HeaderFormat::Auto.read(&bytes).expect("an envelope");
                prop_assert_eq!(&read, &headers);
                prop_assert_eq!(body.as_ref(), &payload[..]);
                Ok(())
            },
        )
        .unwrap();
}

/// Regression: header JSON was parsed without correct rounding, so about one float in ten
/// of [0, 1) came back changed in its last digit.
#[test]
fn float_header_values_come_back_unchanged() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
    let mut changed = Vec::new();
    for i in 0..20_000 {
        let value: f64 = rng.gen();
        let mut headers = Headers::new();
        headers.insert("x", serde_json::Value::from(value));
        let bytes = write_json(&headers, PAYLOAD).unwrap();
        let (read, _) = HeaderFormat::Auto.read(&bytes).expect("an envelope");
        let back = read.get("x").and_then(|v| v.to_json().as_f64());
        if back != Some(value) {
            changed.push((i, value, back));
        }
    }
    assert!(
        changed.is_empty(),
        "{} of 20000 floats changed, e.g. {:?}",
        changed.len(),
        &changed[..changed.len().min(3)]
    );
}

/// Payloads a reader could take for a frame: legacy-shaped bytes, JSON-frame-shaped
/// bytes (with or without a typed header object), real envelopes, Spring's fixtures.
fn look_alike_payload() -> impl Strategy<Value = Vec<u8>> {
    let legacy = (
        1u8..4,
        "\\PC{0,8}",
        json(),
        proptest::collection::vec(any::<u8>(), 0..40),
    )
        .prop_map(|(count, name, value, tail)| {
            let value = serde_json::to_vec(&value).unwrap();
            let mut v = vec![0xff, count, name.len() as u8];
            v.extend_from_slice(name.as_bytes());
            v.extend_from_slice(&(value.len() as u32).to_be_bytes());
            v.extend_from_slice(&value);
            v.extend(tail);
            v
        });
    let json_frame = (
        any::<bool>(),
        proptest::collection::btree_map(header_name(), json(), 0..4),
        proptest::collection::vec(any::<u8>(), 0..40),
    )
        .prop_map(|(typed, members, tail)| {
            let mut object: serde_json::Map<_, _> = members.into_iter().collect();
            if typed {
                object.insert("@class".into(), "java.util.HashMap".into());
            }
            let section = serde_json::to_vec(&object).unwrap();
            let mut v = (section.len() as u32).to_be_bytes().to_vec();
            v.extend_from_slice(&section);
            v.extend_from_slice(&(tail.len() as u32).to_be_bytes());
            v.extend(tail);
            v
        });
    let envelope = (headers(), proptest::collection::vec(any::<u8>(), 0..40))
        .prop_map(|(h, payload)| write_json(&h, &payload).unwrap().to_vec());
    let spring = (0usize..FIXTURES.len()).prop_map(|i| fixture(FIXTURES[i]).to_vec());
    prop_oneof![legacy, json_frame, envelope, spring]
}

const FIXTURES: [&str; 5] = [
    "json_content_type_traceparent.bin",
    "json_typed_id_timestamp.bin",
    "json_empty_headers.bin",
    "json_message_document.json",
    "legacy_content_type_traceparent.bin",
];

/// Any payload: arbitrary bytes, or one that looks like a frame.
fn any_payload() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..300),
        look_alike_payload(),
    ]
}

/// The generator of the header codec: for any payload and any headers, what a producer
/// writes, every reader of the JSON framing (the default one first) reads back equal —
/// the payload byte for byte, the headers equal.
#[test]
fn what_the_producer_writes_a_default_consumer_reads_back() {
    generator(4, 1024)
        .run(&(headers(), any_payload()), |(headers, payload)| {
            let payload = Bytes::from(payload);
            let written = write_embedded(&headers, &payload).expect("valid headers");
            for format in [
                HeaderFormat::Auto,
                HeaderFormat::SpringJson,
                HeaderFormat::SpringJsonAndLegacy,
            ] {
                // As the consumer makes a message of a record.
                let (read, body) = format
                    .read(&written)
                    .unwrap_or_else(|| (Headers::new(), written.clone()));
                prop_assert_eq!(&body, &payload, "{:?}", format);
                prop_assert_eq!(&read, &headers, "{:?}", format);
            }
            Ok(())
        })
        .unwrap();
}

/// The same property end to end: generated records through a producer and a default
/// consumer on the embedded backend.
#[test]
fn generated_records_travel_through_the_producer_and_the_consumer_unchanged() {
    let records = proptest::collection::vec((headers(), any_payload()), 1..6);
    generator(5, 24)
        .run(&records, |records| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            let messages = runtime.block_on(async {
                let memory = Memory::new();
                memory.streams().create_stream("gen", 1).await.unwrap();
                let producer = Producer::builder()
                    .stream("gen")
                    .backend(memory.clone())
                    .linger(Duration::ZERO)
                    .ordered_per_key(true)
                    .build()
                    .unwrap();
                for (headers, payload) in &records {
                    producer
                        .send(ProducerRecord::new(payload.clone(), "k").headers(headers.clone()))
                        .limited()
                        .await
                        .unwrap();
                }
                producer.close().limited().await;
                all_messages(&memory, "gen", HeaderFormat::Auto, records.len()).await
            });
            prop_assert_eq!(messages.len(), records.len());
            for (message, (headers, payload)) in messages.iter().zip(&records) {
                prop_assert_eq!(message.payload.as_ref(), &payload[..]);
                prop_assert_eq!(&message.headers, headers);
            }
            Ok(())
        })
        .unwrap();
}

#[path = "../fuzz/fuzz_targets/read_headers_check.rs"]
mod read_headers_check;

/// The fuzz target's rules (`fuzz/fuzz_targets/read_headers_check.rs`) on generated
/// records: arbitrary bytes, look-alikes, and Spring's fixtures with one byte changed or
/// cut short.
#[test]
fn the_readers_keep_their_rules_on_generated_records() {
    let mutated = (
        0usize..FIXTURES.len(),
        any::<usize>(),
        any::<u8>(),
        any::<bool>(),
    )
        .prop_map(|(i, at, byte, cut)| {
            let mut data = fixture(FIXTURES[i]).to_vec();
            let at = at % data.len();
            if cut {
                data.truncate(at);
            } else {
                data[at] = byte;
            }
            data
        });
    generator(6, 2048)
        .run(&prop_oneof![any_payload(), mutated], |data| {
            read_headers_check::check(&data);
            Ok(())
        })
        .unwrap();
}

/// Payloads that are not envelopes: random bytes, JSON documents, and bytes starting
/// with `0xff` that do not follow the legacy layout.
fn plain_payload() -> impl Strategy<Value = Vec<u8>> {
    let json = proptest::collection::btree_map("[a-z]{1,8}", any::<i64>(), 0..6)
        .prop_map(|m| serde_json::to_vec(&m).unwrap());
    let ff_random = proptest::collection::vec(any::<u8>(), 0..120).prop_map(|tail| {
        let mut v = vec![0xff];
        v.extend(tail);
        v
    });
    // 0xff, a count, a plausible first header whose value is not JSON or whose value
    // length runs past the end.
    let ff_broken = (
        1u8..5,
        "[a-zA-Z]{1,12}",
        0u32..64,
        "[^\"0-9\\[{tfn -]{1,20}",
    )
        .prop_map(|(count, name, extra, value)| {
            let mut v = vec![0xff, count, name.len() as u8];
            v.extend_from_slice(name.as_bytes());
            v.extend_from_slice(&(value.len() as u32 + extra).to_be_bytes());
            v.extend_from_slice(value.as_bytes());
            v
        });
    prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 0..300),
        2 => json,
        2 => ff_random,
        2 => ff_broken,
    ]
}

#[test]
fn records_that_are_not_envelopes_arrive_unchanged() {
    runner(2, 2048)
        .run(&plain_payload(), |payload| {
            let data = Bytes::from(payload);
            prop_assert!(
                HeaderFormat::SpringJsonAndLegacy.read(&data).is_none(),
                "{:02x?}",
                &data[..]
            );
            Ok(())
        })
        .unwrap();
}

/// Regression: a cut-off envelope must not lose its tail or be taken for a smaller one.
#[test]
fn truncated_envelopes_arrive_raw() {
    for name in [
        "json_content_type_traceparent.bin",
        "json_typed_id_timestamp.bin",
        "legacy_content_type_traceparent.bin",
    ] {
        let data = fixture(name);
        for cut in 0..data.len() {
            let truncated = data.slice(..cut);
            // A cut inside the payload of the legacy framing still has every header: the
            // legacy framing has no payload length, so Spring reads it the same way.
            if name.starts_with("legacy") && cut >= data.len() - PAYLOAD.len() {
                continue;
            }
            assert!(
                HeaderFormat::SpringJsonAndLegacy.read(&truncated).is_none(),
                "{name} cut at {cut}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Through the consumer and the producer

const LIMIT: Duration = Duration::from_secs(60);

async fn first_batch(memory: &Memory, stream: &str, format: HeaderFormat) -> Vec<Message> {
    let consumer = test_consumer(memory.clone(), stream, &unique("g"), "w1")
        .header_format(format)
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let shutdown = batches.shutdown_handle();
    let batch = within(LIMIT, "the first batch", batches.next())
        .await
        .unwrap()
        .unwrap();
    batch.ack();
    shutdown.shutdown();
    within(STOP_LIMIT, "the stream ends", async {
        while let Some(batch) = batches.next().await {
            batch.unwrap().ack();
        }
    })
    .await;
    batch.messages
}

/// Every message of `stream` up to `n`, read by a consumer with `format`.
async fn all_messages(
    memory: &Memory,
    stream: &str,
    format: HeaderFormat,
    n: usize,
) -> Vec<Message> {
    let consumer = test_consumer(memory.clone(), stream, &unique("g"), "w1")
        .header_format(format)
        .build()
        .unwrap();
    let mut batches = consumer.stream();
    let shutdown = batches.shutdown_handle();
    let mut messages = Vec::new();
    within(LIMIT, "every message", async {
        while messages.len() < n {
            let batch = batches.next().await.unwrap().unwrap();
            messages.extend(batch.messages.iter().cloned());
            batch.ack();
        }
    })
    .await;
    shutdown.shutdown();
    within(STOP_LIMIT, "the stream ends", async {
        while let Some(batch) = batches.next().await {
            batch.unwrap().ack();
        }
    })
    .await;
    messages
}

#[tokio::test(start_paused = true)]
async fn headers_go_from_producer_to_consumer_and_spring_records_are_read() {
    let memory = Memory::new();
    memory.streams().create_stream("s", 1).await.unwrap();
    let producer = Producer::builder()
        .stream("s")
        .backend(memory.clone())
        .linger(Duration::ZERO)
        .build()
        .unwrap();
    producer
        .send(
            ProducerRecord::new(PAYLOAD, "k")
                .with_header("contentType", "application/json")
                .with_header("traceparent", TRACEPARENT),
        )
        .limited()
        .await
        .unwrap();
    producer
        .send(ProducerRecord::new("plain", "k"))
        .limited()
        .await
        .unwrap();
    // What a Spring producer wrote, as raw bytes.
    for name in [
        "json_typed_id_timestamp.bin",
        "legacy_content_type_traceparent.bin",
    ] {
        producer
            .raw()
            .send(ProducerRecord::new(fixture(name), "k"))
            .limited()
            .await
            .unwrap();
    }
    producer.close().limited().await;

    let messages = first_batch(&memory, "s", HeaderFormat::Auto).await;
    assert_eq!(messages.len(), 4);
    assert_eq!(messages[0].payload.as_ref(), PAYLOAD);
    assert_eq!(names(&messages[0].headers), ["contentType", "traceparent"]);
    assert_eq!(messages[1].payload.as_ref(), b"plain");
    assert!(messages[1].headers.is_empty());
    assert_eq!(messages[2].headers, typed_headers());
    assert_eq!(messages[2].payload.as_ref(), PAYLOAD);
    // The legacy framing only when asked for, as Spring's maintained binder reads it.
    assert!(messages[3].headers.is_empty());
    assert_eq!(
        messages[3].payload,
        fixture("legacy_content_type_traceparent.bin")
    );
    let both = first_batch(&memory, "s", HeaderFormat::SpringJsonAndLegacy).await;
    assert_eq!(both[3].headers.get_str("traceparent"), Some(TRACEPARENT));
    assert_eq!(both[3].payload.as_ref(), PAYLOAD);
    // Debug shows the headers' names, never the payload.
    let shown = format!("{:?}", messages[0]);
    assert!(
        shown.contains("traceparent") && !shown.contains("\"id\":1"),
        "{shown}"
    );

    // Raw mode: the framing is the payload.
    let raw = first_batch(&memory, "s", HeaderFormat::None).await;
    assert!(raw.iter().all(|m| m.headers.is_empty()));
    assert_eq!(raw[2].payload, fixture("json_typed_id_timestamp.bin"));
    assert_eq!(raw[1].payload.as_ref(), b"plain");
}

#[tokio::test(start_paused = true)]
async fn a_producer_that_does_not_embed_writes_the_bare_payload() {
    let memory = Memory::new();
    memory.streams().create_stream("bare", 1).await.unwrap();
    let producer = Producer::builder()
        .stream("bare")
        .backend(memory.clone())
        .embed_headers(false)
        .linger(Duration::ZERO)
        .build()
        .unwrap();
    producer
        .send(ProducerRecord::new(PAYLOAD, "k").with_header("contentType", "text/plain"))
        .limited()
        .await
        .unwrap();
    producer.close().limited().await;
    let messages = first_batch(&memory, "bare", HeaderFormat::Auto).await;
    assert_eq!(messages[0].payload.as_ref(), PAYLOAD);
    assert!(messages[0].headers.is_empty());
}

#[tokio::test(start_paused = true)]
async fn headers_travel_through_a_processor() {
    let memory = Memory::new();
    memory.streams().create_stream("in", 1).await.unwrap();
    memory.streams().create_stream("out", 1).await.unwrap();
    let input = Producer::builder()
        .stream("in")
        .backend(memory.clone())
        .linger(Duration::ZERO)
        .build()
        .unwrap();
    for i in 0..3 {
        input
            .send(
                ProducerRecord::new(format!("{i}"), "k")
                    .with_header("correlationId", format!("order-{i}")),
            )
            .limited()
            .await
            .unwrap();
    }
    input.close().limited().await;

    let output = Producer::builder()
        .stream("out")
        .backend(memory.clone())
        .linger(Duration::ZERO)
        .build()
        .unwrap();
    // The processor copies the correlation id and says what the output is.
    let processor =
        ServiceBuilder::new()
            .produce_to(output)
            .service_fn(|msg: Message| async move {
                let correlation = msg
                    .headers
                    .get_str("correlationId")
                    .unwrap_or("")
                    .to_owned();
                Ok::<_, Infallible>(
                    Output::new(msg.payload)
                        .with_header("correlationId", correlation)
                        .with_header("contentType", "text/plain"),
                )
            });
    let consumer = test_consumer(memory.clone(), "in", "proc", "w1")
        .build()
        .unwrap();
    let running = start_service(consumer, processor);
    let stored = async {
        while memory
            .streams()
            .records("out", "shardId-000000000000")
            .len()
            < 3
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    within(LIMIT, "three outputs stored", stored).await;
    running.stop().await;

    let messages = first_batch(&memory, "out", HeaderFormat::Auto).await;
    let seen: Vec<(String, Option<&str>, Option<&str>)> = messages
        .iter()
        .map(|m| {
            (
                String::from_utf8_lossy(&m.payload).into_owned(),
                m.headers.get_str("correlationId"),
                m.headers.get_str("contentType"),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("0".to_owned(), Some("order-0"), Some("text/plain")),
            ("1".to_owned(), Some("order-1"), Some("text/plain")),
            ("2".to_owned(), Some("order-2"), Some("text/plain")),
        ]
    );
}

/// Regression: a processor whose ordered producer received several outputs at once wrote
/// them without their headers.
#[tokio::test(start_paused = true)]
async fn several_outputs_of_an_ordered_processor_keep_their_headers() {
    let memory = Memory::new();
    memory.streams().create_stream("in", 1).await.unwrap();
    memory.streams().create_stream("out", 1).await.unwrap();
    let input = Producer::builder()
        .stream("in")
        .backend(memory.clone())
        .linger(Duration::ZERO)
        .build()
        .unwrap();
    input
        .send(ProducerRecord::new("order", "k").with_header("correlationId", "order-1"))
        .limited()
        .await
        .unwrap();
    input.close().limited().await;

    let output = Producer::builder()
        .stream("out")
        .backend(memory.clone())
        .linger(Duration::ZERO)
        .ordered_per_key(true)
        .build()
        .unwrap();
    let processor =
        ServiceBuilder::new()
            .produce_to(output)
            .service_fn(|msg: Message| async move {
                let correlation = msg
                    .headers
                    .get_str("correlationId")
                    .unwrap_or("")
                    .to_owned();
                let outputs: Vec<Output> = ["charged", "shipped"]
                    .into_iter()
                    .map(|step| {
                        Output::new(step)
                            .with_header("correlationId", correlation.clone())
                            .with_header("step", step)
                    })
                    .collect();
                Ok::<_, Infallible>(outputs)
            });
    let consumer = test_consumer(memory.clone(), "in", "proc", "w1")
        .build()
        .unwrap();
    let running = start_service(consumer, processor);
    let stored = async {
        while memory
            .streams()
            .records("out", "shardId-000000000000")
            .len()
            < 2
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    within(LIMIT, "two outputs stored", stored).await;
    running.stop().await;

    let messages = first_batch(&memory, "out", HeaderFormat::Auto).await;
    let seen: Vec<(String, Option<&str>, Option<&str>)> = messages
        .iter()
        .map(|m| {
            (
                String::from_utf8_lossy(&m.payload).into_owned(),
                m.headers.get_str("correlationId"),
                m.headers.get_str("step"),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            ("charged".to_owned(), Some("order-1"), Some("charged")),
            ("shipped".to_owned(), Some("order-1"), Some("shipped")),
        ]
    );
}
