//! The producer side of [`Json`]: `serde_json` writing `application/json`.

use std::fmt;

use bytes::Bytes;
use serde::Serialize;

use super::Encoder;
use crate::decode::Json;

impl<T: Serialize> Encoder<T> for Json {
    type Error = JsonEncodeError;

    fn content_type(&self) -> &str {
        "application/json"
    }

    fn encode(&self, value: &T) -> Result<Bytes, JsonEncodeError> {
        serde_json::to_vec(value)
            .map(Bytes::from)
            .map_err(JsonEncodeError)
    }
}

/// Why a value could not be written as JSON (its `Serialize` failed, or a map has keys
/// that are not strings).
pub struct JsonEncodeError(serde_json::Error);

impl JsonEncodeError {
    /// The `serde_json` error.
    pub fn inner(&self) -> &serde_json::Error {
        &self.0
    }
}

impl fmt::Display for JsonEncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "value cannot be written as JSON: {}", self.0)
    }
}

impl fmt::Debug for JsonEncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "JsonEncodeError({self})")
    }
}

impl std::error::Error for JsonEncodeError {}
