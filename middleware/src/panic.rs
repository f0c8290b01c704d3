//! A panic of the inner service as an error: what the [`retry`](crate::retry) and
//! [`dead_letter`](crate::dead_letter) layers use to treat a handler that panics like one
//! that fails, so that a poison record that panics is retried and dead-lettered like one
//! that returns an error.

use std::any::Any;

/// The inner service panicked while handling a record (in `call` or in its future).
///
/// The [`dead_letter`](crate::dead_letter) layer dead-letters it like any other
/// permanent error, with the panic's message as the error text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the handler panicked: {message}")]
pub struct Panicked {
    message: String,
}

impl Panicked {
    /// The error for a caught panic's payload.
    pub(crate) fn from_payload(payload: &(dyn Any + Send)) -> Self {
        Panicked {
            message: message(payload),
        }
    }

    /// The panic's message (`"<not a string>"` when the panic carried another value).
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// The message of a panic's payload: `panic!` carries a `&str` or a `String`.
pub(crate) fn message(payload: &(dyn Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_owned()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "<not a string>".to_owned()
    }
}
