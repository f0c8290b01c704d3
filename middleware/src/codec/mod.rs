//! The schema-aware side of decoding and encoding: the schema languages
//! ([`DataFormat`]), a writer's schema ([`WriterSchema`]), formats that decode with it
//! ([`SchemaFormat`]) and the producer side ([`Encoder`]).

/// The schema languages the Glue Schema Registry knows (its `DataFormat`: AVRO, JSON, PROTOBUF).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DataFormat {
    /// Apache Avro.
    Avro,
    /// JSON Schema.
    JsonSchema,
    /// Protocol Buffers.
    Protobuf,
}

/// A writer's schema: its language and its text (Avro JSON, JSON Schema JSON, .proto text).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WriterSchema {
    /// The schema's language.
    pub format: DataFormat,
    /// The schema's text.
    pub definition: std::sync::Arc<str>,
}

/// A decode format that can read a payload written with a schema the framing names.
pub trait SchemaFormat<T>: crate::decode::Format<T> {
    /// The schema language this format reads.
    fn data_format(&self) -> DataFormat;
    /// Decodes a payload written with `writer` (Avro resolves writer → reader schema;
    /// JSON Schema validates against `writer` then deserializes; Protobuf may ignore it).
    fn decode_with_schema(&self, payload: &[u8], writer: &WriterSchema) -> Result<T, Self::Error>;
}

/// The producer side of a format: a typed value to bytes, with the `contentType` it writes.
pub trait Encoder<T> {
    /// Why a value could not be encoded.
    type Error: std::error::Error + Send + Sync + 'static;
    /// The `contentType` of what it writes.
    fn content_type(&self) -> &str;
    /// Encodes one value.
    fn encode(&self, value: &T) -> Result<bytes::Bytes, Self::Error>;
    /// The schema the encoder writes with, for a registry to register or look up.
    fn writer_schema(&self) -> Option<WriterSchema> {
        None
    }
}
