//! JSON validated against a JSON Schema (the `jsonschema` crate), then read with serde.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use bytes::Bytes;
use jsonschema::Validator;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use super::{DataFormat, Encoder, SchemaCache, SchemaFormat, WriterSchema};
use crate::decode::{is_json_content_type, DecodeErrorKind, Format};

/// JSON payloads that must match a JSON Schema, as `T`; decodes and encodes (the encoder
/// validates what it writes too).
pub struct JsonSchema<T> {
    validator: Arc<Validator>,
    definition: Arc<str>,
    parsed: Arc<SchemaCache<Validator>>,
    _payload: PhantomData<fn() -> T>,
}

impl<T> JsonSchema<T> {
    /// Validates against `schema` (a JSON Schema document, draft detected from its
    /// `$schema`; references to other documents are not fetched).
    pub fn new(schema: &str) -> Result<Self, JsonSchemaError> {
        let validator = compile(schema)?;
        Ok(JsonSchema {
            validator: Arc::new(validator),
            definition: schema.into(),
            parsed: Arc::new(SchemaCache::new()),
            _payload: PhantomData,
        })
    }

    fn read(&self, payload: &[u8], validator: &Validator) -> Result<T, JsonSchemaError>
    where
        T: DeserializeOwned,
    {
        let value: Value = serde_json::from_slice(payload).map_err(JsonSchemaError::Syntax)?;
        check(validator, &value)?;
        serde_json::from_value(value).map_err(JsonSchemaError::Type)
    }
}

fn compile(schema: &str) -> Result<Validator, JsonSchemaError> {
    let document: Value =
        serde_json::from_str(schema).map_err(|e| JsonSchemaError::Schema(e.to_string()))?;
    jsonschema::validator_for(&document)
        .map_err(|e| JsonSchemaError::Schema(e.masked().to_string()))
}

fn check(validator: &Validator, value: &Value) -> Result<(), JsonSchemaError> {
    validator
        .validate(value)
        .map_err(|e| JsonSchemaError::Invalid {
            // The masked form names the rule and the place, not the instance's values.
            reason: e.masked().to_string(),
            path: e.instance_path().to_string(),
        })
}

impl<T> Clone for JsonSchema<T> {
    fn clone(&self) -> Self {
        JsonSchema {
            validator: self.validator.clone(),
            definition: self.definition.clone(),
            parsed: self.parsed.clone(),
            _payload: PhantomData,
        }
    }
}

impl<T> fmt::Debug for JsonSchema<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JsonSchema")
            .field("payload", &std::any::type_name::<T>())
            .finish()
    }
}

impl<T: DeserializeOwned> Format<T> for JsonSchema<T> {
    type Error = JsonSchemaError;

    fn name(&self) -> &'static str {
        "JSON Schema"
    }

    fn decode(&self, payload: &Bytes) -> Result<T, JsonSchemaError> {
        self.read(payload, &self.validator)
    }

    fn accepts(&self, content_type: &str) -> bool {
        is_json_content_type(content_type)
    }

    fn error_kind(&self, error: &JsonSchemaError) -> DecodeErrorKind {
        error.kind()
    }
}

impl<T: DeserializeOwned> SchemaFormat<T> for JsonSchema<T> {
    fn data_format(&self) -> DataFormat {
        DataFormat::JsonSchema
    }

    fn decode_with_schema(
        &self,
        payload: &[u8],
        writer: &WriterSchema,
    ) -> Result<T, JsonSchemaError> {
        let validator = self.parsed.get_or_parse(&writer.definition, compile)?;
        self.read(payload, &validator)
    }
}

impl<T: Serialize> Encoder<T> for JsonSchema<T> {
    type Error = JsonSchemaError;

    fn content_type(&self) -> &str {
        "application/json"
    }

    /// JSON of `value`, refused with [`JsonSchemaError::Invalid`] when it does not match
    /// the schema.
    fn encode(&self, value: &T) -> Result<Bytes, JsonSchemaError> {
        let value = serde_json::to_value(value).map_err(JsonSchemaError::Type)?;
        check(&self.validator, &value)?;
        serde_json::to_vec(&value)
            .map(Bytes::from)
            .map_err(JsonSchemaError::Type)
    }

    fn writer_schema(&self) -> Option<WriterSchema> {
        Some(WriterSchema::new(
            DataFormat::JsonSchema,
            self.definition.clone(),
        ))
    }
}

/// Why a JSON Schema payload did not decode (or a value did not encode).
#[derive(Debug)]
#[non_exhaustive]
pub enum JsonSchemaError {
    /// The payload is not JSON.
    Syntax(serde_json::Error),
    /// The JSON does not match the schema.
    Invalid {
        /// The rule that failed, without the instance's values.
        reason: String,
        /// Where in the document (a JSON pointer).
        path: String,
    },
    /// The JSON matches the schema but not the Rust type (or the type does not
    /// serialize).
    Type(serde_json::Error),
    /// The schema text is not a valid JSON Schema.
    Schema(String),
}

impl JsonSchemaError {
    /// The decode error kind it is reported with: a payload that is JSON but does not
    /// match is [`DecodeErrorKind::SchemaMismatch`].
    pub fn kind(&self) -> DecodeErrorKind {
        match self {
            JsonSchemaError::Invalid { .. } | JsonSchemaError::Type(_) => {
                DecodeErrorKind::SchemaMismatch
            }
            _ => DecodeErrorKind::InvalidPayload,
        }
    }
}

impl fmt::Display for JsonSchemaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JsonSchemaError::Syntax(e) => {
                write!(f, "not JSON at line {} column {}", e.line(), e.column())
            }
            JsonSchemaError::Invalid { reason, path } => {
                write!(f, "does not match the schema at {path:?}: {reason}")
            }
            JsonSchemaError::Type(e) => write!(
                f,
                "matches the schema but not the type at line {} column {}",
                e.line(),
                e.column()
            ),
            JsonSchemaError::Schema(e) => write!(f, "invalid JSON Schema: {e}"),
        }
    }
}

impl std::error::Error for JsonSchemaError {}
