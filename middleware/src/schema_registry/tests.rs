//! The schema registry layer and encoder with a small test format: what decodes, what is
//! dead-lettered, what goes up to be delivered again, and what the encoder writes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use shardflow::Message;
use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};
use uuid::Uuid;

use super::*;
use crate::codec::{DataFormat, Encoder, SchemaFormat, WriterSchema};
use crate::dead_letter::{DeadLetterLayer, DeadLetterOutcome, DeadLetterRecord};
use crate::decode::{DecodeError, DecodeErrorKind, Format, CONTENT_TYPE};
use crate::test_support::message;
use crate::BoxError;

/// A format of UTF-8 text. With a writer schema it reads `upper` (the text, uppercased)
/// or `lower`; any other definition does not match the payload.
#[derive(Clone, Debug)]
struct Text(DataFormat);

#[derive(Debug, thiserror::Error)]
#[error("not the text the schema says")]
struct NotText;

impl Format<String> for Text {
    type Error = NotText;
    fn name(&self) -> &'static str {
        "text"
    }
    fn decode(&self, payload: &Bytes) -> Result<String, NotText> {
        String::from_utf8(payload.to_vec()).map_err(|_| NotText)
    }
    fn accepts(&self, content_type: &str) -> bool {
        content_type == "text/plain"
    }
}

impl SchemaFormat<String> for Text {
    fn data_format(&self) -> DataFormat {
        self.0
    }
    fn decode_with_schema(&self, payload: &[u8], writer: &WriterSchema) -> Result<String, NotText> {
        let text = std::str::from_utf8(payload).map_err(|_| NotText)?;
        match &*writer.definition {
            "upper" => Ok(text.to_uppercase()),
            "lower" => Ok(text.to_owned()),
            _ => Err(NotText),
        }
    }
}

impl Encoder<String> for Text {
    type Error = NotText;
    fn content_type(&self) -> &str {
        "text/plain"
    }
    fn encode(&self, value: &String) -> Result<Bytes, NotText> {
        Ok(Bytes::copy_from_slice(value.as_bytes()))
    }
    fn writer_schema(&self) -> Option<WriterSchema> {
        Some(schema(self.0, "lower"))
    }
}

fn schema(format: DataFormat, definition: &str) -> WriterSchema {
    WriterSchema {
        format,
        definition: Arc::from(definition),
    }
}

/// A registry that counts `schema_version` calls and is down while `down` is set.
#[derive(Clone, Default)]
struct Flaky {
    inner: MemoryRegistry,
    calls: Arc<AtomicUsize>,
    down: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait]
impl SchemaRegistry for Flaky {
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            return Err(RegistryError::Unavailable("ThrottlingException".into()));
        }
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

type Handled = Arc<Mutex<Vec<String>>>;

fn handler(
    seen: Handled,
) -> impl tower::Service<Message<String>, Response = (), Error = BoxError, Future: Send> + Clone {
    service_fn(move |m: Message<String>| {
        let seen = seen.clone();
        async move {
            seen.lock().unwrap().push(m.payload);
            Ok::<_, BoxError>(())
        }
    })
}

async fn decode_error(layer: SchemaRegistryLayer<String, Text, Flaky>, raw: Bytes) -> DecodeError {
    let seen = Handled::default();
    let err = layer
        .layer(handler(seen.clone()))
        .oneshot(Message::new(message(1, b"").metadata, raw))
        .await
        .unwrap_err();
    assert!(seen.lock().unwrap().is_empty(), "the handler never sees it");
    *err.downcast::<DecodeError>().expect("a DecodeError")
}

#[tokio::test]
async fn framed_records_decode_with_their_writer_schema_fetched_once() {
    let registry = Flaky::default();
    let upper = registry
        .inner
        .register("greetings", schema(DataFormat::Avro, "upper"));
    let lower = registry
        .inner
        .register("greetings", schema(DataFormat::Avro, "lower"));
    let seen = Handled::default();
    let svc = ServiceBuilder::new()
        .layer(SchemaRegistryLayer::new(
            Text(DataFormat::Avro),
            registry.clone(),
        ))
        .service(handler(seen.clone()));
    for i in 0..100u64 {
        let (id, compression) = if i % 2 == 0 {
            (upper, Compression::None)
        } else {
            (lower, Compression::Zlib)
        };
        let framed = framing::write(id, compression, format!("hi {i}").as_bytes()).unwrap();
        svc.clone()
            .oneshot(Message::new(message(i, b"").metadata, framed))
            .await
            .unwrap();
    }
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 100);
    assert_eq!(seen[0], "HI 0");
    assert_eq!(seen[1], "hi 1");
    assert_eq!(
        registry.calls.load(Ordering::SeqCst),
        2,
        "one lookup per version"
    );
}

#[tokio::test]
async fn unframed_records_use_the_plain_format_unless_framing_is_required() {
    let seen = Handled::default();
    let layer = SchemaRegistryLayer::new(Text(DataFormat::Avro), Flaky::default());
    layer
        .layer(handler(seen.clone()))
        .oneshot(message(1, b"plain").with_header(CONTENT_TYPE, "text/plain"))
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), ["plain"]);

    let err = decode_error(
        layer.clone().require_framing(),
        Bytes::from_static(b"plain"),
    )
    .await;
    assert_eq!(err.kind(), &DecodeErrorKind::InvalidFraming);
    let err = SchemaRegistryLayer::new(Text(DataFormat::Avro), Flaky::default())
        .layer(handler(seen))
        .oneshot(message(1, b"plain").with_header(CONTENT_TYPE, "application/json"))
        .await
        .unwrap_err();
    assert!(matches!(
        err.downcast_ref::<DecodeError>().unwrap().kind(),
        DecodeErrorKind::UnsupportedContentType { .. }
    ));
}

#[tokio::test]
async fn broken_framing_and_unknown_versions_are_typed_and_dead_lettered() {
    let registry = Flaky::default();
    let known = registry
        .inner
        .register("g", schema(DataFormat::Avro, "lower"));
    let layer = SchemaRegistryLayer::new(Text(DataFormat::Avro), registry);
    let mut bad_compression = framing::write(known, Compression::None, b"x")
        .unwrap()
        .to_vec();
    bad_compression[1] = 9;
    let mut bad_zlib = framing::write(known, Compression::None, b"not zlib")
        .unwrap()
        .to_vec();
    bad_zlib[1] = framing::COMPRESSION_ZLIB;
    let unknown = Uuid::from_u128(42);
    let cases: Vec<(Vec<u8>, DecodeErrorKind)> = vec![
        (bad_compression, DecodeErrorKind::InvalidFraming),
        (bad_zlib, DecodeErrorKind::InvalidFraming),
        (
            framing::write(unknown, Compression::None, b"x")
                .unwrap()
                .to_vec(),
            DecodeErrorKind::UnknownSchemaVersion {
                schema_version: unknown,
            },
        ),
        (
            framing::write(known, Compression::None, b"\xff\xfe")
                .unwrap()
                .to_vec(),
            DecodeErrorKind::InvalidPayload,
        ),
    ];
    for (raw, kind) in cases {
        let err = decode_error(layer.clone(), Bytes::from(raw.clone())).await;
        assert_eq!(err.kind(), &kind);
        assert!(!err.is_transient());
        assert_eq!(err.raw().as_ref(), &raw[..], "the raw bytes are kept");

        // Under the dead-letter layer with its default policy: dead-lettered.
        let sunk = Arc::new(Mutex::new(Vec::<DeadLetterRecord>::new()));
        let into = sunk.clone();
        let sink = service_fn(move |r: DeadLetterRecord| {
            into.lock().unwrap().push(r);
            async { Ok::<_, BoxError>(()) }
        });
        let outcome = ServiceBuilder::new()
            .layer(DeadLetterLayer::new(sink))
            .layer(layer.clone())
            .service(handler(Handled::default()))
            .oneshot(Message::new(
                message(1, b"").metadata,
                Bytes::from(raw.clone()),
            ))
            .await
            .unwrap();
        assert!(
            matches!(outcome, DeadLetterOutcome::DeadLettered),
            "{kind:?}"
        );
        assert_eq!(sunk.lock().unwrap()[0].payload.as_ref(), &raw[..]);
    }
}

#[tokio::test(start_paused = true)]
async fn a_registry_outage_is_transient_and_never_dead_lettered() {
    let registry = Flaky::default();
    let id = registry
        .inner
        .register("g", schema(DataFormat::Avro, "lower"));
    registry.down.store(true, Ordering::SeqCst);
    let framed = framing::write(id, Compression::None, b"later").unwrap();
    let layer = SchemaRegistryLayer::new(Text(DataFormat::Avro), registry.clone());

    let err = decode_error(layer.clone(), framed.clone()).await;
    assert_eq!(err.kind(), &DecodeErrorKind::RegistryUnavailable);
    assert!(err.is_transient());

    let sunk = Arc::new(AtomicUsize::new(0));
    let count = sunk.clone();
    let sink = service_fn(move |_r: DeadLetterRecord| {
        count.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, BoxError>(()) }
    });
    let seen = Handled::default();
    let svc = ServiceBuilder::new()
        .layer(DeadLetterLayer::new(sink))
        .layer(layer)
        .service(handler(seen.clone()));
    let msg = Message::new(message(1, b"").metadata, framed);
    let err = svc.clone().oneshot(msg.clone()).await.unwrap_err();
    assert!(err.to_string().contains("registry"), "{err}");
    assert_eq!(sunk.load(Ordering::SeqCst), 0, "not dead-lettered");

    // Delivered again once the registry is back (and the pause after its failure is
    // over): decoded, the failure was not cached.
    registry.down.store(false, Ordering::SeqCst);
    tokio::time::advance(MIN_OUTAGE_PAUSE).await;
    svc.oneshot(msg).await.unwrap();
    assert_eq!(*seen.lock().unwrap(), ["later"]);
    assert_eq!(sunk.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_writer_schema_of_another_language_is_refused() {
    let registry = Flaky::default();
    let id = registry
        .inner
        .register("g", schema(DataFormat::Protobuf, "lower"));
    let layer = SchemaRegistryLayer::new(Text(DataFormat::Avro), registry);
    let err = decode_error(layer, framing::write(id, Compression::None, b"x").unwrap()).await;
    assert_eq!(err.kind(), &DecodeErrorKind::InvalidPayload);
    let source = std::error::Error::source(&err).unwrap();
    assert!(source.is::<WrongDataFormat>(), "{source}");
}

#[tokio::test]
async fn protobuf_payloads_lose_their_message_index_before_decoding() {
    let registry = Flaky::default();
    let id = registry
        .inner
        .register("g", schema(DataFormat::Protobuf, "lower"));
    let seen = Handled::default();
    let svc = SchemaRegistryLayer::new(Text(DataFormat::Protobuf), registry.clone())
        .layer(handler(seen.clone()));
    let body = framing::write_message_index(2, b"msg");
    let framed = framing::write(id, Compression::Zlib, &body).unwrap();
    svc.oneshot(Message::new(message(1, b"").metadata, framed))
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), ["msg"]);
    // A Protobuf frame whose payload is empty has no index: a framing error.
    let layer = SchemaRegistryLayer::new(Text(DataFormat::Protobuf), registry);
    let err = decode_error(layer, framing::write(id, Compression::None, b"").unwrap()).await;
    assert_eq!(err.kind(), &DecodeErrorKind::InvalidFraming);
}

/// Reads a framed record by the documented layout alone (not with `framing::parse`):
/// version byte 3, compression 0 or 5, the UUID's two big-endian halves, the payload.
fn read_documented(bytes: &[u8]) -> (Uuid, Vec<u8>) {
    use std::io::Read;
    assert_eq!(bytes[0], 3, "header version");
    let msb = u64::from_be_bytes(bytes[2..10].try_into().unwrap());
    let lsb = u64::from_be_bytes(bytes[10..18].try_into().unwrap());
    let payload = match bytes[1] {
        0 => bytes[18..].to_vec(),
        5 => {
            let mut out = Vec::new();
            flate2::read::ZlibDecoder::new(&bytes[18..])
                .read_to_end(&mut out)
                .unwrap();
            out
        }
        other => panic!("compression byte {other}"),
    };
    (Uuid::from_u64_pair(msb, lsb), payload)
}

#[tokio::test]
async fn the_encoder_writes_what_a_reader_of_the_documented_layout_reads() {
    let registry = MemoryRegistry::new();
    let cache = CachedRegistry::new(registry.clone());
    let encoder = SchemaRegistryEncoder::new(Text(DataFormat::Avro), cache.clone(), "greetings");
    let value = "hello".to_owned();

    // Auto-registration is off by default: an unknown schema is refused.
    let err = encoder.encode(&value).await.unwrap_err();
    assert!(matches!(
        err,
        SchemaEncodeError::Registry(RegistryError::NotRegistered { .. })
    ));
    assert!(registry.is_empty());

    let encoder = encoder.auto_register(true).compression(Compression::Zlib);
    let framed = encoder.encode(&value).await.unwrap();
    let (id, payload) = read_documented(&framed);
    assert_eq!(payload, b"hello");
    assert_eq!(
        registry.schema_version(id).await.unwrap(),
        schema(DataFormat::Avro, "lower")
    );

    // Protobuf: the message index comes first, as a varint.
    let proto = SchemaRegistryEncoder::new(Text(DataFormat::Protobuf), cache, "greetings-proto")
        .auto_register(true)
        .message_index(1);
    let (_, payload) = read_documented(&proto.encode(&value).await.unwrap());
    assert_eq!(payload, b"\x01hello");

    // And the layer reads back what the encoder wrote.
    let seen = Handled::default();
    SchemaRegistryLayer::new(Text(DataFormat::Avro), registry)
        .layer(handler(seen.clone()))
        .oneshot(Message::new(message(1, b"").metadata, framed))
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), ["hello"]);
}

/// A handler that panics on a decoded record is the dead-letter layer's error like any
/// other: the record goes to the sink as it was read (the framed bytes, not the decoded
/// value), with the panic's message.
#[tokio::test]
async fn a_handler_panicking_on_a_decoded_record_dead_letters_its_raw_bytes() {
    let registry = Flaky::default();
    let id = registry
        .inner
        .register("g", schema(DataFormat::Avro, "lower"));
    let framed = framing::write(id, Compression::Zlib, b"poison").unwrap();
    let sunk = Arc::new(Mutex::new(Vec::<DeadLetterRecord>::new()));
    let into = sunk.clone();
    let sink = service_fn(move |r: DeadLetterRecord| {
        into.lock().unwrap().push(r);
        async { Ok::<_, BoxError>(()) }
    });
    let panicking = service_fn(|m: Message<String>| async move {
        if m.payload == "poison" {
            panic!("handler choked on a decoded record");
        }
        Ok::<_, BoxError>(())
    });
    let outcome = ServiceBuilder::new()
        .layer(DeadLetterLayer::new(sink))
        .layer(SchemaRegistryLayer::new(Text(DataFormat::Avro), registry))
        .service(panicking)
        .oneshot(Message::new(message(1, b"").metadata, framed.clone()))
        .await
        .unwrap();
    assert!(matches!(outcome, DeadLetterOutcome::DeadLettered));
    let sunk = sunk.lock().unwrap();
    assert_eq!(sunk.len(), 1);
    assert_eq!(
        sunk[0].payload, framed,
        "the framed bytes as they were read"
    );
    assert!(
        sunk[0].error.contains("handler choked"),
        "{}",
        sunk[0].error
    );
}

/// Records that start with the framing's version byte but are shorter than its header
/// (1, 2 and 17 bytes), and one of exactly the header: never a panic; a short one is
/// the plain format's (here not text: dead-lettered with its bytes) or, with framing
/// required, `InvalidFraming`; the header alone is a framed empty payload.
#[tokio::test]
async fn records_around_the_header_length_are_typed_or_decoded() {
    let registry = Flaky::default();
    let id = registry
        .inner
        .register("g", schema(DataFormat::Avro, "lower"));
    let header = framing::write(id, Compression::None, b"").unwrap();
    assert_eq!(header.len(), framing::HEADER_LEN);
    let layer = SchemaRegistryLayer::new(Text(DataFormat::Avro), registry);
    for len in [1, 2, 17] {
        let raw = header.slice(..len);
        let err = decode_error(layer.clone().require_framing(), raw.clone()).await;
        assert_eq!(err.kind(), &DecodeErrorKind::InvalidFraming, "{len}");
        let source = std::error::Error::source(&err).unwrap();
        assert!(
            matches!(source.downcast_ref::<FramingError>(), Some(FramingError::Truncated(n)) if *n == len),
            "{len}: {source}"
        );
        assert_eq!(err.raw(), &raw);
        // Not required: the plain format's. The id's bytes are not UTF-8 past 8 bytes.
        let seen = Handled::default();
        let plain = layer
            .clone()
            .layer(handler(seen.clone()))
            .oneshot(Message::new(message(1, b"").metadata, raw.clone()))
            .await;
        match plain {
            Ok(()) => assert_eq!(seen.lock().unwrap()[0].as_bytes(), raw.as_ref()),
            Err(e) => {
                let e = e.downcast::<DecodeError>().unwrap();
                assert_eq!(e.kind(), &DecodeErrorKind::InvalidPayload, "{len}");
                assert_eq!(e.raw(), &raw);
            }
        }
    }
    let seen = Handled::default();
    layer
        .require_framing()
        .layer(handler(seen.clone()))
        .oneshot(Message::new(message(1, b"").metadata, header))
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), [""]);
}

/// A registry that registers the first definition it is asked for, then loses the
/// answer (the call fails as if it had timed out).
#[derive(Clone, Default)]
struct LosesFirstAnswer {
    inner: MemoryRegistry,
    calls: Arc<AtomicUsize>,
}

#[async_trait]
impl SchemaRegistry for LosesFirstAnswer {
    async fn schema_version(&self, id: Uuid) -> Result<WriterSchema, RegistryError> {
        self.inner.schema_version(id).await
    }
    async fn version_id(
        &self,
        name: &str,
        schema: &WriterSchema,
        register: bool,
    ) -> Result<Uuid, RegistryError> {
        let id = self.inner.version_id(name, schema, register).await?;
        if self.calls.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err(RegistryError::TimedOut(std::time::Duration::from_secs(10)));
        }
        Ok(id)
    }
}

/// On the producer side a failed lookup writes nothing and says it is transient; the
/// retry (after the pause) frames the value with the version registered the first time:
/// one version in the registry, one framed record, which decodes to what was sent.
#[tokio::test(start_paused = true)]
async fn an_encoder_lookup_that_fails_writes_nothing_and_its_retry_registers_no_duplicate() {
    let registry = LosesFirstAnswer::default();
    let encoder = SchemaRegistryEncoder::new(
        Text(DataFormat::Avro),
        CachedRegistry::new(registry.clone()),
        "greetings",
    )
    .auto_register(true);
    let value = "hello".to_owned();
    let err = encoder.encode(&value).await.unwrap_err();
    assert!(err.is_transient(), "{err}");
    assert_eq!(registry.inner.len(), 1, "registered, answer lost");

    tokio::time::advance(MIN_OUTAGE_PAUSE).await;
    let framed = encoder.encode(&value).await.unwrap();
    assert_eq!(registry.inner.len(), 1, "no second version");
    let frame = framing::parse(&framed).unwrap();
    assert_eq!(
        registry
            .inner
            .schema_version(frame.schema_version)
            .await
            .unwrap(),
        schema(DataFormat::Avro, "lower")
    );
    let seen = Handled::default();
    SchemaRegistryLayer::new(Text(DataFormat::Avro), registry.inner.clone())
        .layer(handler(seen.clone()))
        .oneshot(Message::new(message(1, b"").metadata, framed))
        .await
        .unwrap();
    assert_eq!(*seen.lock().unwrap(), ["hello"]);
}
