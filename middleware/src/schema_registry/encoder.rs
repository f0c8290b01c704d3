//! [`SchemaRegistryEncoder`]: the producer side, an [`Encoder`]'s bytes framed with the
//! version id of its writer schema.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use super::framing::{self, Compression, FramingError};
use super::registry::{CachedRegistry, RegistryError, SchemaRegistry};
use crate::codec::{DataFormat, Encoder};
use crate::BoxError;

/// Frames what an [`Encoder`] writes in the AWS Glue Schema Registry framing, as the
/// reference serializer does: it looks up the version id of the encoder's
/// [`writer_schema`](Encoder::writer_schema) under the schema name (registering it only
/// when [`auto_register`](Self::auto_register) is on; off by default), then writes the
/// header, the Protobuf message index when the schema is Protobuf, and the payload,
/// zlib-compressed when asked.
///
/// Lookups go through a [`CachedRegistry`]: one call per schema per process.
pub struct SchemaRegistryEncoder<E, R> {
    encoder: E,
    registry: CachedRegistry<R>,
    schema_name: Arc<str>,
    register: bool,
    compression: Compression,
    /// Set by [`SchemaRegistryEncoder::message_index`]; otherwise derived from the
    /// encoder's message name, or 0.
    message_index: Option<u32>,
    /// The index derived from the message name, with the `.proto` it was derived from.
    derived: std::sync::OnceLock<(Arc<str>, u32)>,
}

/// Why a value could not be encoded and framed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SchemaEncodeError {
    /// The encoder names no writer schema ([`Encoder::writer_schema`] is `None`).
    #[error("the encoder has no writer schema to register or look up")]
    NoWriterSchema,
    /// The encoder failed.
    #[error("the value did not encode")]
    Encode(#[source] BoxError),
    /// The registry lookup failed ([`RegistryError::is_transient`] says whether to try
    /// again).
    #[error("the writer schema's version id could not be found")]
    Registry(#[source] RegistryError),
    /// Compression failed.
    #[error("the payload could not be framed")]
    Framing(#[source] FramingError),
    /// The encoder's Protobuf message ([`Encoder::message_name`]) is not declared in its
    /// writer schema's `.proto` (or the `.proto` text could not be read), so no message
    /// index says which message the record holds.
    #[error("message {message:?} is not declared in the writer schema's .proto")]
    MessageNotInSchema {
        /// The message's full name.
        message: String,
    },
}

impl SchemaEncodeError {
    /// Whether the same call may succeed later (the registry was unavailable).
    pub fn is_transient(&self) -> bool {
        matches!(self, SchemaEncodeError::Registry(e) if e.is_transient())
    }
}

impl<E, R: SchemaRegistry> SchemaRegistryEncoder<E, R> {
    /// Frames what `encoder` writes, with the version of its writer schema under
    /// `schema_name` in `registry`.
    pub fn new(encoder: E, registry: CachedRegistry<R>, schema_name: impl Into<Arc<str>>) -> Self {
        SchemaRegistryEncoder {
            encoder,
            registry,
            schema_name: schema_name.into(),
            register: false,
            compression: Compression::None,
            message_index: None,
            derived: std::sync::OnceLock::new(),
        }
    }

    /// Registers the writer schema when the registry does not have it, as the reference
    /// serializer does: a new version of the schema, or a new schema with it as its first
    /// version when none has the name (off by default: an unknown definition is
    /// [`RegistryError::NotRegistered`]). See [`SchemaRegistry::version_id`].
    pub fn auto_register(mut self, on: bool) -> Self {
        self.register = on;
        self
    }

    /// Compresses payloads (none by default).
    pub fn compression(mut self, compression: Compression) -> Self {
        self.compression = compression;
        self
    }

    /// For Protobuf: the index of the message type in the writer schema's `.proto` file
    /// (all messages, nested ones included, sorted by full name; 0 by default, right for
    /// a file with one message). See [`framing::read_message_index`].
    ///
    /// Without it, an encoder that names its message ([`Encoder::message_name`]:
    /// `Protobuf::named`, `Protobuf::with_message_name`) gets the index from the writer
    /// schema's `.proto` (`codec::protobuf::message_index`, once per encoder).
    pub fn message_index(mut self, index: u32) -> Self {
        self.message_index = Some(index);
        self
    }

    /// The wrapped encoder.
    pub fn get_ref(&self) -> &E {
        &self.encoder
    }

    /// Encodes `value` and frames it.
    pub async fn encode<T>(&self, value: &T) -> Result<Bytes, SchemaEncodeError>
    where
        E: Encoder<T>,
    {
        let schema = self
            .encoder
            .writer_schema()
            .ok_or(SchemaEncodeError::NoWriterSchema)?;
        let payload = self
            .encoder
            .encode(value)
            .map_err(|e| SchemaEncodeError::Encode(Box::new(e)))?;
        let id = self
            .registry
            .version_id(&self.schema_name, &schema, self.register)
            .await
            .map_err(SchemaEncodeError::Registry)?;
        let framed = if schema.format == DataFormat::Protobuf {
            let index = match (
                self.message_index,
                Encoder::<T>::message_name(&self.encoder),
            ) {
                (Some(index), _) => index,
                (None, Some(name)) => self.derived_index(&schema.definition, name)?,
                (None, None) => 0,
            };
            let indexed = framing::write_message_index(index, &payload);
            framing::write(id, self.compression, &indexed)
        } else {
            framing::write(id, self.compression, &payload)
        };
        framed.map_err(SchemaEncodeError::Framing)
    }

    /// The message index of `name` in `proto`, computed once per encoder (again only if
    /// the encoder's writer schema changes).
    fn derived_index(&self, proto: &Arc<str>, name: &str) -> Result<u32, SchemaEncodeError> {
        if let Some((cached, index)) = self.derived.get() {
            if cached == proto {
                return Ok(*index);
            }
        }
        let not_declared = || SchemaEncodeError::MessageNotInSchema {
            message: name.to_owned(),
        };
        #[cfg(feature = "protobuf")]
        {
            let index = crate::codec::protobuf::message_index(proto, name)
                .ok()
                .flatten()
                .ok_or_else(not_declared)?;
            let _ = self.derived.set((proto.clone(), index));
            Ok(index)
        }
        #[cfg(not(feature = "protobuf"))]
        {
            // Without the Protobuf codec there is no `.proto` reader.
            Err(not_declared())
        }
    }
}

impl<E: fmt::Debug, R> fmt::Debug for SchemaRegistryEncoder<E, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SchemaRegistryEncoder")
            .field("encoder", &self.encoder)
            .field("schema_name", &self.schema_name)
            .field("auto_register", &self.register)
            .field("compression", &self.compression)
            .field("message_index", &self.message_index)
            .finish()
    }
}
