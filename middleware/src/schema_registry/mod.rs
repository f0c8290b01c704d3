//! The AWS Glue Schema Registry: its framing ([`framing`]), registries that hold the
//! writer schemas ([`SchemaRegistry`]: [`MemoryRegistry`] embedded, `GlueRegistry` on
//! AWS with the `glue` feature, both behind a bounded [`CachedRegistry`]), the decode
//! layer ([`SchemaRegistryLayer`]) and the producer side ([`SchemaRegistryEncoder`]).
//!
//! # Decoding
//!
//! [`SchemaRegistryLayer`] takes the place of [`decode`](crate::decode) in a stack. For
//! each record:
//!
//! * **Framed** (18 bytes or more, the first `0x03`, and no `contentType` the format
//!   reads): the header is read (a zlib payload
//!   inflated), the writer schema fetched by its version id through the cache (one call
//!   per version per cache), the Protobuf message index skipped, and the payload decoded
//!   with the format's [`decode_with_schema`](crate::codec::SchemaFormat::decode_with_schema).
//! * **Unframed**: decoded with the format's plain [`decode`](crate::decode::Format::decode),
//!   after the same `contentType` check as the decode layer, so a stream where some
//!   producers frame and others (Spring, plain JSON) do not still decodes. A record
//!   whose `contentType` the format reads is unframed whatever its first bytes (the
//!   framing carries no `contentType`; a plain Avro datum may start with `0x03`); with
//!   [`require_framing`](SchemaRegistryLayer::require_framing) it is refused instead.
//!
//! Failures are [`DecodeError`](crate::DecodeError)s with a
//! [`DecodeErrorKind`](crate::DecodeErrorKind): a broken header or zlib payload is
//! `InvalidFraming`, a version the registry does not know `UnknownSchemaVersion`, a
//! payload that does not match its schema `InvalidPayload` (or the format's own kind):
//! all about the record, dead-lettered by the default policy. A registry that refuses
//! the call, fails or times out is `RegistryUnavailable`: transient, never
//! dead-lettered; the call fails and the consumer delivers the record again.

pub mod framing;

mod encoder;
#[cfg(feature = "glue")]
mod glue;
mod layer;
mod registry;

pub use encoder::{SchemaEncodeError, SchemaRegistryEncoder};
pub use framing::{Compression, Frame, FramingError};
#[cfg(feature = "glue")]
pub use glue::{GlueRegistry, DEFAULT_COMPATIBILITY, DEFAULT_REGISTRY_NAME};
pub use layer::{ResponseFuture, SchemaRegistryDecode, SchemaRegistryLayer, WrongDataFormat};
pub use registry::{
    CachedRegistry, MemoryRegistry, RegistryError, SchemaRegistry, DEFAULT_CACHE_CAPACITY,
    DEFAULT_CALL_TIMEOUT, MAX_OUTAGE_PAUSE, MIN_OUTAGE_PAUSE, UNKNOWN_VERSION_TTL,
};

#[cfg(test)]
mod tests;
