//! Apache Avro through the `apache-avro` crate: the reader's schema from the user's type
//! (its `AvroSchema`) or given, the writer's schema from the user or a registry.
//!
//! # What is read
//!
//! * A raw Avro binary datum, as Spring Cloud Stream's Avro converters write it
//!   (`application/avro`, or `application/vnd.<subject>.v<version>+avro` from its
//!   schema-registry converter): the payload carries no schema; the writer's schema is
//!   the one configured with [`Avro::writer_schema`] (by default the reader's), or the
//!   one a registry's framing names ([`SchemaFormat::decode_with_schema`]).
//! * Avro's single-object encoding (`C3 01`, the writer schema's 8-byte Rabin
//!   fingerprint, the datum) when the fingerprint is the configured writer schema's.
//!
//! A schema in a message header (neither Spring nor Glue sends one) is not read.
//!
//! # Hostile payloads
//!
//! Before decoding, the datum is walked with its writer schema: a string, bytes, fixed,
//! array or map that claims more than the payload holds is refused ([`AvroError::Truncated`],
//! [`AvroError::TooManyItems`]) before anything is allocated for it, and values nested
//! deeper than [`MAX_DEPTH`] levels are refused ([`AvroError::TooDeep`]) instead of
//! overflowing the stack. Arrays of zero-width items (nulls, empty records) are allowed
//! [`ZERO_WIDTH_ITEMS`] items more than the payload has bytes.

mod guard;

pub use guard::{MAX_DEPTH, ZERO_WIDTH_ITEMS};

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use apache_avro::headers::{HeaderBuilder, RabinFingerprintHeader};
use apache_avro::{AvroSchema, Schema};
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{essence, DataFormat, Encoder, SchemaCache, SchemaFormat, WriterSchema};
use crate::decode::{DecodeErrorKind, Format};

/// The `contentType` the encoder writes by default (Spring's `AvroSchemaMessageConverter`).
pub const AVRO_CONTENT_TYPE: &str = "application/avro";

/// Whether `content_type` names Avro: `application/avro`, `avro/binary` or any
/// `application/<subtype>+avro`, parameters aside.
pub fn is_avro_content_type(content_type: &str) -> bool {
    let essence = essence(content_type);
    match essence.split_once('/') {
        Some(("application", sub)) => sub == "avro" || (sub.len() > 5 && sub.ends_with("+avro")),
        Some(("avro", "binary")) => true,
        _ => false,
    }
}

/// Avro payloads as `T` (through serde); decodes and encodes.
pub struct Avro<T> {
    reader: Arc<Schema>,
    writer: Arc<Schema>,
    writer_text: Arc<str>,
    single_object_header: Arc<[u8]>,
    content_type: Arc<str>,
    parsed: Arc<SchemaCache<ParsedWriter>>,
    _payload: PhantomData<fn() -> T>,
}

impl<T: AvroSchema> Avro<T> {
    /// Reads and writes with `T`'s own schema (`#[derive(AvroSchema)]`).
    pub fn new() -> Self {
        Avro::with_schema(T::get_schema())
    }
}

impl<T: AvroSchema> Default for Avro<T> {
    fn default() -> Self {
        Avro::new()
    }
}

impl<T> Avro<T> {
    /// Reads into and writes with `schema` (the reader's schema; the writer's too until
    /// [`Avro::writer_schema`] says otherwise).
    pub fn with_schema(schema: Schema) -> Self {
        let writer_text: Arc<str> = schema.canonical_form().into();
        let header = RabinFingerprintHeader::from_schema(&schema).build_header();
        let schema = Arc::new(schema);
        Avro {
            reader: schema.clone(),
            writer: schema,
            writer_text,
            single_object_header: header.into(),
            content_type: AVRO_CONTENT_TYPE.into(),
            parsed: Arc::new(SchemaCache::new()),
            _payload: PhantomData,
        }
    }

    /// The schema payloads without a registry's framing were written with (Avro's JSON
    /// schema text); the datum is resolved from it to the reader's schema. The encoder
    /// keeps writing the reader's schema.
    pub fn writer_schema(mut self, definition: &str) -> Result<Self, AvroError> {
        let writer = Schema::parse_str(definition).map_err(AvroError::schema)?;
        self.single_object_header = RabinFingerprintHeader::from_schema(&writer)
            .build_header()
            .into();
        self.writer = Arc::new(writer);
        Ok(self)
    }

    /// The `contentType` the encoder writes, e.g. Spring's
    /// `application/vnd.orders.v1+avro` (default `application/avro`).
    pub fn content_type(mut self, content_type: impl Into<Arc<str>>) -> Self {
        self.content_type = content_type.into();
        self
    }

    fn decode_value(&self, mut payload: &[u8], writer: &Schema) -> Result<T, AvroError>
    where
        T: DeserializeOwned,
    {
        guard::check(writer, payload).map_err(|refusal| match refusal {
            guard::Refusal::Truncated => AvroError::Truncated,
            guard::Refusal::TooDeep => AvroError::TooDeep,
            guard::Refusal::TooManyItems => AvroError::TooManyItems,
        })?;
        let value =
            apache_avro::from_avro_datum(writer, &mut payload, None).map_err(AvroError::Payload)?;
        if !payload.is_empty() {
            return Err(AvroError::TrailingBytes(payload.len()));
        }
        let resolved = if std::ptr::eq(writer, &*self.reader) {
            Ok(value)
        } else {
            value.clone().resolve(&self.reader).map_err(|e| (e, value))
        };
        let result = match resolved {
            Ok(value) => apache_avro::from_value::<T>(&value).map_err(|e| (e, value)),
            Err(failed) => Err(failed),
        };
        result.map_err(|(error, value)| {
            // `apache-avro` reads a datum cut short inside a string or bytes as a null
            // instead of failing: a value that does not fit the writer's own schema is
            // a broken payload, not a schema mismatch. Checked on failure only.
            if value.validate(writer) {
                AvroError::Mismatch(error)
            } else {
                AvroError::Truncated
            }
        })
    }
}

/// A writer schema from a registry, parsed, and whether it is the reader's own.
struct ParsedWriter {
    schema: Schema,
    same_as_reader: bool,
}

impl<T> Clone for Avro<T> {
    fn clone(&self) -> Self {
        Avro {
            reader: self.reader.clone(),
            writer: self.writer.clone(),
            writer_text: self.writer_text.clone(),
            single_object_header: self.single_object_header.clone(),
            content_type: self.content_type.clone(),
            parsed: self.parsed.clone(),
            _payload: PhantomData,
        }
    }
}

impl<T> fmt::Debug for Avro<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Avro")
            .field("payload", &std::any::type_name::<T>())
            .field("reader", &self.reader.canonical_form())
            .field("content_type", &self.content_type)
            .finish()
    }
}

impl<T: DeserializeOwned> Format<T> for Avro<T> {
    type Error = AvroError;

    fn name(&self) -> &'static str {
        "Avro"
    }

    fn decode(&self, payload: &Bytes) -> Result<T, AvroError> {
        let datum = match payload.strip_prefix(&*self.single_object_header) {
            Some(datum) => datum,
            None => payload.as_ref(),
        };
        self.decode_value(datum, &self.writer)
    }

    fn accepts(&self, content_type: &str) -> bool {
        is_avro_content_type(content_type)
    }

    fn error_kind(&self, error: &AvroError) -> DecodeErrorKind {
        error.kind()
    }
}

impl<T: DeserializeOwned> SchemaFormat<T> for Avro<T> {
    fn data_format(&self) -> DataFormat {
        DataFormat::Avro
    }

    fn decode_with_schema(&self, payload: &[u8], writer: &WriterSchema) -> Result<T, AvroError> {
        let parsed = self.parsed.get_or_parse(&writer.definition, |text| {
            let schema = Schema::parse_str(text).map_err(AvroError::schema)?;
            // Once per writer schema: the same schema as the reader's needs no resolution.
            let same_as_reader = schema.canonical_form() == self.reader.canonical_form();
            Ok(ParsedWriter {
                schema,
                same_as_reader,
            })
        })?;
        let schema = if parsed.same_as_reader {
            &*self.reader
        } else {
            &parsed.schema
        };
        self.decode_value(payload, schema)
    }
}

impl<T: Serialize> Encoder<T> for Avro<T> {
    type Error = AvroError;

    fn content_type(&self) -> &str {
        &self.content_type
    }

    /// A raw datum written with the reader's schema; a value that does not fit it is an
    /// error.
    fn encode(&self, value: &T) -> Result<Bytes, AvroError> {
        let mut out = Vec::new();
        apache_avro::write_avro_datum_ref(&self.reader, value, &mut out)
            .map_err(AvroError::mismatch)?;
        Ok(Bytes::from(out))
    }

    fn writer_schema(&self) -> Option<WriterSchema> {
        Some(WriterSchema::new(
            DataFormat::Avro,
            self.writer_text.clone(),
        ))
    }
}

/// Why an Avro payload did not decode (or a value did not encode).
///
/// `Display` names the problem, not the data: `apache-avro`'s own messages can quote
/// values, so they are kept behind [`AvroError::inner`].
#[derive(Debug)]
#[non_exhaustive]
pub enum AvroError {
    /// The bytes are not a datum of the writer's schema (truncated, bad lengths...).
    Payload(apache_avro::Error),
    /// The datum does not resolve to the reader's schema or the user's type (or, when
    /// encoding, the value does not fit the schema).
    Mismatch(apache_avro::Error),
    /// A schema's text does not parse as an Avro schema.
    Schema(apache_avro::Error),
    /// The datum ended before the payload did: this many bytes were left.
    TrailingBytes(usize),
    /// The payload ended before the datum did (or a length in it is longer than the rest
    /// of the payload).
    Truncated,
    /// Values nest deeper than [`MAX_DEPTH`] levels.
    TooDeep,
    /// Arrays and maps claim more items in all than the payload has bytes (plus
    /// [`ZERO_WIDTH_ITEMS`] items of no width: nulls, empty records).
    TooManyItems,
}

impl AvroError {
    fn mismatch(e: apache_avro::Error) -> Self {
        AvroError::Mismatch(e)
    }

    fn schema(e: apache_avro::Error) -> Self {
        AvroError::Schema(e)
    }

    /// The `apache-avro` error, if there is one. Its `Display` may quote data.
    pub fn inner(&self) -> Option<&apache_avro::Error> {
        match self {
            AvroError::Payload(e) | AvroError::Mismatch(e) | AvroError::Schema(e) => Some(e),
            AvroError::TrailingBytes(_)
            | AvroError::Truncated
            | AvroError::TooDeep
            | AvroError::TooManyItems => None,
        }
    }

    /// The decode error kind it is reported with.
    pub fn kind(&self) -> DecodeErrorKind {
        match self {
            AvroError::Mismatch(_) => DecodeErrorKind::SchemaMismatch,
            _ => DecodeErrorKind::InvalidPayload,
        }
    }
}

impl fmt::Display for AvroError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AvroError::Payload(_) => f.write_str("bytes are not a datum of the writer's schema"),
            AvroError::Mismatch(_) => {
                f.write_str("datum does not match the reader's schema or type")
            }
            AvroError::Schema(_) => f.write_str("schema text is not a valid Avro schema"),
            AvroError::TrailingBytes(n) => write!(f, "{n} bytes left after the datum"),
            AvroError::Truncated => f.write_str("payload ends before the datum does"),
            AvroError::TooDeep => write!(f, "values nest deeper than {MAX_DEPTH} levels"),
            AvroError::TooManyItems => {
                f.write_str("arrays and maps claim more items than the payload has bytes")
            }
        }
    }
}

impl std::error::Error for AvroError {}
