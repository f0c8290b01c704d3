//! Protocol Buffers through `prost`: the user's generated (or derived) message types.

use std::convert::Infallible;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytes::Bytes;

use super::{
    essence, DataFormat, Encoder, MessageIndexMismatch, SchemaCache, SchemaFormat, WriterSchema,
};
use crate::decode::Format;

pub use super::proto_file::{message_index, message_names, ProtoFileError};

/// The `contentType`s read as Protobuf: Spring's `application/x-protobuf` (what its
/// `ProtobufMessageConverter` writes), `application/protobuf` and
/// `application/vnd.google.protobuf`, parameters aside.
pub const PROTOBUF_CONTENT_TYPES: [&str; 3] = [
    "application/x-protobuf",
    "application/protobuf",
    "application/vnd.google.protobuf",
];

/// Protobuf payloads as the `prost::Message` type `T`; decodes and encodes.
///
/// The wire format carries no schema: the type decides. [`SchemaFormat`] therefore
/// reads the payload as `T` whatever the writer's `.proto` says. An optional
/// [`writer_schema`](Protobuf::with_writer_schema) is what the encoder hands a registry.
///
/// # The message index
///
/// A framed record's message index says which message of the writer's `.proto` it holds.
/// Protobuf's wire format does not: bytes of another message often decode as `T`, with
/// wrong or missing fields. Given `T`'s full name ([`named`](Protobuf::named) for a type
/// with `prost::Name`, [`with_message_name`](Protobuf::with_message_name) otherwise), the
/// format checks the index against the message names of the writer's `.proto`
/// ([`message_names`]) and refuses a record of another message as a schema mismatch.
/// The check compares names, not fields: a `T` generated from another file that reuses
/// the name passes. A writer's `.proto` that does not parse is not checked.
pub struct Protobuf<T> {
    schema: Option<WriterSchema>,
    message_name: Option<Arc<str>>,
    names: Arc<SchemaCache<Option<Vec<String>>>>,
    _message: PhantomData<fn() -> T>,
}

impl<T> Protobuf<T> {
    /// A format for `T`.
    pub fn new() -> Self {
        Protobuf {
            schema: None,
            message_name: None,
            names: Arc::new(SchemaCache::new()),
            _message: PhantomData,
        }
    }

    /// Checks framed records' message index against `T`'s full name from `prost::Name`
    /// (`package.Message`; prost-build writes it with `enable_type_names`).
    pub fn named(self) -> Self
    where
        T: prost::Name,
    {
        self.with_message_name(T::full_name())
    }

    /// Checks framed records' message index against `full_name`, the full name
    /// (`package.Message`, `package.Outer.Inner`) of the message `T` was generated from.
    pub fn with_message_name(mut self, full_name: impl Into<Arc<str>>) -> Self {
        self.message_name = Some(full_name.into());
        self
    }

    /// The `.proto` text `T` was generated from, returned by
    /// [`Encoder::writer_schema`] for a registry.
    pub fn with_writer_schema(mut self, proto: impl Into<Arc<str>>) -> Self {
        self.schema = Some(WriterSchema::new(DataFormat::Protobuf, proto));
        self
    }
}

impl<T> Default for Protobuf<T> {
    fn default() -> Self {
        Protobuf::new()
    }
}

impl<T> Clone for Protobuf<T> {
    fn clone(&self) -> Self {
        Protobuf {
            schema: self.schema.clone(),
            message_name: self.message_name.clone(),
            names: self.names.clone(),
            _message: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Protobuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Protobuf")
            .field("message", &std::any::type_name::<T>())
            .field("message_name", &self.message_name)
            .finish()
    }
}

/// Whether `content_type` names Protobuf (see [`PROTOBUF_CONTENT_TYPES`]).
pub fn is_protobuf_content_type(content_type: &str) -> bool {
    let essence = essence(content_type);
    PROTOBUF_CONTENT_TYPES.contains(&essence.as_str())
}

impl<T: prost::Message + Default> Format<T> for Protobuf<T> {
    type Error = ProtobufError;

    fn name(&self) -> &'static str {
        "Protobuf"
    }

    fn decode(&self, payload: &Bytes) -> Result<T, ProtobufError> {
        T::decode(payload.as_ref()).map_err(ProtobufError)
    }

    fn accepts(&self, content_type: &str) -> bool {
        is_protobuf_content_type(content_type)
    }
}

impl<T: prost::Message + Default> SchemaFormat<T> for Protobuf<T> {
    fn data_format(&self) -> DataFormat {
        DataFormat::Protobuf
    }

    fn decode_with_schema(
        &self,
        payload: &[u8],
        _writer: &WriterSchema,
    ) -> Result<T, ProtobufError> {
        T::decode(payload).map_err(ProtobufError)
    }

    fn check_message_index(
        &self,
        index: u32,
        writer: &WriterSchema,
    ) -> Result<(), MessageIndexMismatch> {
        let Some(expected) = &self.message_name else {
            return Ok(());
        };
        let parsed = self
            .names
            .get_or_parse(&writer.definition, |proto| {
                Ok::<_, std::convert::Infallible>(message_names(proto).ok())
            })
            .unwrap_or_else(|never| match never {});
        let Some(names) = parsed.as_ref() else {
            return Ok(());
        };
        let found = usize::try_from(index).ok().and_then(|i| names.get(i));
        if found.is_some_and(|name| **name == **expected) {
            return Ok(());
        }
        Err(MessageIndexMismatch {
            index,
            found: found.cloned(),
            expected: expected.to_string(),
        })
    }
}

impl<T: prost::Message> Encoder<T> for Protobuf<T> {
    /// Encoding a prost message into a growable buffer cannot fail.
    type Error = Infallible;

    fn content_type(&self) -> &str {
        PROTOBUF_CONTENT_TYPES[0]
    }

    fn encode(&self, value: &T) -> Result<Bytes, Infallible> {
        Ok(Bytes::from(value.encode_to_vec()))
    }

    fn writer_schema(&self) -> Option<WriterSchema> {
        self.schema.clone()
    }

    fn message_name(&self) -> Option<&str> {
        self.message_name.as_deref()
    }
}

/// Why a payload is not a valid Protobuf encoding of the message (prost's description:
/// which field, which wire problem; never field values).
#[derive(Debug)]
pub struct ProtobufError(prost::DecodeError);

impl ProtobufError {
    /// The `prost` error.
    pub fn inner(&self) -> &prost::DecodeError {
        &self.0
    }
}

impl fmt::Display for ProtobufError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for ProtobufError {}
