//! The span every layer opens per record and the helpers shared by the layers' logs.

use std::error::Error;
use std::fmt::Write;
use std::sync::Arc;

use shardflow::Metadata;

/// The per-record span: where the record came from, never what it holds.
pub(crate) fn message_span(layer: &'static str, metadata: &Metadata) -> tracing::Span {
    tracing::debug_span!(
        "shardflow_middleware",
        layer,
        shard = %metadata.shard_id,
        sequence = %metadata.sequence_number,
        sub_sequence = metadata.sub_sequence_number,
    )
}

/// An error and its sources, joined with `": "` (what a dead-letter record carries).
pub(crate) fn error_chain(error: &(dyn Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        // Writing to a String cannot fail.
        let _ = write!(text, ": {cause}");
        source = cause.source();
    }
    text
}

/// Whether `error` or one of its sources is an `E` for which `test` holds.
pub(crate) fn chain_any<E: Error + 'static>(
    error: &(dyn Error + 'static),
    test: impl Fn(&E) -> bool,
) -> bool {
    let mut current = Some(error);
    while let Some(mut e) = current {
        // A shared error (a batch's bulk error, shared by its messages) is in the chain
        // as an `Arc`, whose own `source` skips the error it holds: look inside.
        while let Some(shared) = e.downcast_ref::<Arc<dyn Error + Send + Sync>>() {
            e = &**shared;
        }
        if e.downcast_ref::<E>().is_some_and(&test) {
            return true;
        }
        current = e.source();
    }
    false
}
