//! Codecs behind one seam: how typed values become payloads and back, for plain formats
//! named by the record's `contentType` and for schema languages whose writer schema a
//! registry or the user supplies.
//!
//! The decode side is [`Format`] (read by
//! [`DecodeLayer`](crate::DecodeLayer)); a format that can also read a payload written
//! with a given writer schema implements [`SchemaFormat`]. The producer side is
//! [`Encoder`]: a value to bytes plus the `contentType` it writes, used by
//! [`EncodeRecord`] for a [`ProducerRecord`] and by
//! [`Output::encode`](crate::produce::Output::encode) for a processor's outputs.

use std::fmt;
use std::sync::Arc;

use shardflow::ProducerRecord;

use crate::decode::{Format, CONTENT_TYPE};

#[cfg(feature = "avro")]
pub mod avro;
mod json;
#[cfg(feature = "json-schema")]
pub mod json_schema;
#[cfg(feature = "protobuf")]
mod proto_file;
#[cfg(feature = "protobuf")]
pub mod protobuf;

#[cfg(feature = "avro")]
pub use avro::{Avro, AvroError};
pub use json::JsonEncodeError;
#[cfg(feature = "json-schema")]
pub use json_schema::{JsonSchema, JsonSchemaError};
#[cfg(feature = "protobuf")]
pub use protobuf::{Protobuf, ProtobufError};

/// The schema languages the Glue Schema Registry knows (its `DataFormat`: AVRO, JSON,
/// PROTOBUF).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataFormat {
    /// Apache Avro: the schema is Avro's JSON schema text.
    Avro,
    /// JSON payloads described by a JSON Schema document.
    JsonSchema,
    /// Protocol Buffers: the schema is `.proto` text.
    Protobuf,
}

/// A writer's schema: its language and its text (Avro JSON, JSON Schema JSON, `.proto`
/// text).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WriterSchema {
    /// The schema language.
    pub format: DataFormat,
    /// The schema's text, as the writer registered it.
    pub definition: Arc<str>,
}

impl WriterSchema {
    /// A schema of `format` with the text `definition`.
    pub fn new(format: DataFormat, definition: impl Into<Arc<str>>) -> Self {
        WriterSchema {
            format,
            definition: definition.into(),
        }
    }
}

/// A decode format that can read a payload written with a schema the framing names.
pub trait SchemaFormat<T>: Format<T> {
    /// The schema language this format reads.
    fn data_format(&self) -> DataFormat;

    /// Decodes a payload written with `writer` (Avro resolves writer → reader schema;
    /// JSON Schema validates against `writer` then deserializes; Protobuf may ignore it).
    fn decode_with_schema(&self, payload: &[u8], writer: &WriterSchema) -> Result<T, Self::Error>;

    /// For Protobuf: checks that message `index` of the writer's `.proto` (the framing's
    /// message index) is the message this format decodes into. The default checks
    /// nothing; [`Protobuf`] checks when it knows its message's name
    /// ([`Protobuf::named`]).
    fn check_message_index(
        &self,
        index: u32,
        writer: &WriterSchema,
    ) -> Result<(), MessageIndexMismatch> {
        let _ = (index, writer);
        Ok(())
    }
}

/// A framed Protobuf record whose message index names another message than the one the
/// format decodes into.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MessageIndexMismatch {
    /// The record's message index.
    pub index: u32,
    /// The message the index names in the writer's `.proto`, when it names one.
    pub found: Option<String>,
    /// The message the format decodes into (its full name).
    pub expected: String,
}

impl fmt::Display for MessageIndexMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.found {
            Some(found) => write!(
                f,
                "message index {} names {found}, the format decodes {}",
                self.index, self.expected
            ),
            None => write!(
                f,
                "message index {} names no message of the writer's schema; the format decodes {}",
                self.index, self.expected
            ),
        }
    }
}

impl std::error::Error for MessageIndexMismatch {}

/// The producer side of a format: a typed value to bytes, with the `contentType` it
/// writes.
pub trait Encoder<T> {
    /// Why a value could not be encoded.
    type Error: std::error::Error + Send + Sync + 'static;

    /// The MIME type of what [`Encoder::encode`] writes, set as the record's
    /// `contentType` header.
    fn content_type(&self) -> &str;

    /// Encodes one value.
    fn encode(&self, value: &T) -> Result<bytes::Bytes, Self::Error>;

    /// The schema the encoder writes with, for a registry to register or look up.
    fn writer_schema(&self) -> Option<WriterSchema> {
        None
    }

    /// For Protobuf: the full name (`package.Message`) of the message the encoder
    /// writes, from which a schema registry's framing derives its message index. `None`
    /// by default.
    fn message_name(&self) -> Option<&str> {
        None
    }
}

/// A [`ProducerRecord`] from a typed value: the encoder's bytes as the payload and its
/// [`content_type`](Encoder::content_type) as the `contentType` header.
///
/// ```
/// use shardflow::ProducerRecord;
/// use shardflow_middleware::codec::EncodeRecord;
/// use shardflow_middleware::Json;
///
/// #[derive(serde::Serialize)]
/// struct Order { id: u64 }
///
/// let record = ProducerRecord::encode(&Json, &Order { id: 7 }, "customer-7")?;
/// assert_eq!(record.headers.get_str("contentType"), Some("application/json"));
/// # Ok::<_, Box<dyn std::error::Error>>(())
/// ```
///
/// The header reaches the consumer when the producer embeds headers
/// ([`ProducerBuilder::embed_headers`](shardflow::ProducerBuilder::embed_headers)).
pub trait EncodeRecord: Sized {
    /// Encodes `value` with `encoder` into a record routed by `partition_key`.
    fn encode<T, E: Encoder<T> + ?Sized>(
        encoder: &E,
        value: &T,
        partition_key: impl Into<String>,
    ) -> Result<Self, E::Error>;
}

impl EncodeRecord for ProducerRecord {
    fn encode<T, E: Encoder<T> + ?Sized>(
        encoder: &E,
        value: &T,
        partition_key: impl Into<String>,
    ) -> Result<Self, E::Error> {
        let payload = encoder.encode(value)?;
        Ok(ProducerRecord::new(payload, partition_key)
            .with_header(CONTENT_TYPE, encoder.content_type().to_owned()))
    }
}

/// The MIME type's essence: type and subtype, lower-cased, parameters
/// (`;charset=UTF-8`) aside.
#[cfg(any(feature = "protobuf", feature = "avro"))]
pub(crate) fn essence(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

/// A small map of parsed writer schemas keyed by their text, so that a schema named by
/// every record of a stream is parsed once per process, not per record. Bounded: past
/// `CACHED_SCHEMAS` distinct schemas it starts over.
#[cfg(any(feature = "avro", feature = "json-schema", feature = "protobuf"))]
pub(crate) struct SchemaCache<S> {
    parsed: std::sync::Mutex<std::collections::HashMap<Arc<str>, Arc<S>>>,
}

#[cfg(any(feature = "avro", feature = "json-schema", feature = "protobuf"))]
const CACHED_SCHEMAS: usize = 64;

#[cfg(any(feature = "avro", feature = "json-schema", feature = "protobuf"))]
impl<S> SchemaCache<S> {
    pub(crate) fn new() -> Self {
        SchemaCache {
            parsed: std::sync::Mutex::new(std::collections::HashMap::new()),
        }
    }

    pub(crate) fn get_or_parse<E>(
        &self,
        definition: &Arc<str>,
        parse: impl FnOnce(&str) -> Result<S, E>,
    ) -> Result<Arc<S>, E> {
        // A panic while the lock was held cannot leave the map half-written (insert and
        // clear are single calls): the poisoned map is still valid.
        let lookup =
            |map: &std::collections::HashMap<Arc<str>, Arc<S>>| map.get(definition).cloned();
        if let Some(hit) = lookup(&self.parsed.lock().unwrap_or_else(|p| p.into_inner())) {
            return Ok(hit);
        }
        let parsed = Arc::new(parse(definition)?);
        let mut map = self.parsed.lock().unwrap_or_else(|p| p.into_inner());
        if map.len() >= CACHED_SCHEMAS {
            map.clear();
        }
        map.insert(definition.clone(), parsed.clone());
        Ok(parsed)
    }
}
