//! Protocol Buffers through `prost`: the user's generated (or derived) message types.

use std::convert::Infallible;
use std::fmt;
use std::marker::PhantomData;

use bytes::Bytes;

use super::{essence, DataFormat, Encoder, SchemaFormat, WriterSchema};
use crate::decode::Format;

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
/// ignores the writer's `.proto` text (a registry's framing has already picked the
/// message). An optional [`writer_schema`](Protobuf::with_writer_schema) is what the
/// encoder hands a registry.
pub struct Protobuf<T> {
    schema: Option<WriterSchema>,
    _message: PhantomData<fn() -> T>,
}

impl<T> Protobuf<T> {
    /// A format for `T`.
    pub fn new() -> Self {
        Protobuf {
            schema: None,
            _message: PhantomData,
        }
    }

    /// The `.proto` text `T` was generated from, returned by
    /// [`Encoder::writer_schema`] for a registry.
    pub fn with_writer_schema(mut self, proto: impl Into<std::sync::Arc<str>>) -> Self {
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
            _message: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Protobuf<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Protobuf")
            .field("message", &std::any::type_name::<T>())
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
