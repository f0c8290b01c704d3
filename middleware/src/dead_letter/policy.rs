//! Which errors are dead-lettered: [`DeadLetterPolicy`] and its default.

use std::error::Error;

use shardflow::Metadata;

use crate::observe::chain_any;

/// Decides which errors are dead-lettered; the others go up (the consumer redelivers).
pub trait DeadLetterPolicy {
    /// Whether the record with `metadata`, which failed with `error`, goes to the sink.
    fn should_dead_letter(
        &self,
        error: &(dyn Error + Send + Sync + 'static),
        metadata: &Metadata,
    ) -> bool;
}

/// The default policy: every error except the transient ones named in the
/// [module docs](super).
#[derive(Clone, Copy, Debug, Default)]
pub struct PermanentFailures;

impl DeadLetterPolicy for PermanentFailures {
    fn should_dead_letter(
        &self,
        error: &(dyn Error + Send + Sync + 'static),
        metadata: &Metadata,
    ) -> bool {
        !metadata.lease_lost.is_cancelled()
            && !chain_any::<crate::dedup::DedupError>(error, |_| true)
            && !chain_any::<crate::decode::DecodeError>(error, |e| e.is_transient())
            && !chain_any::<crate::batch::BatchError>(error, |e| e.is_transient())
            && !chain_any::<crate::produce::ProduceToError>(error, |e| e.is_transient())
            && !chain_any::<std::io::Error>(error, |e| is_unreachable(e.kind()))
            && !chain_any::<tokio::time::error::Elapsed>(error, |_| true)
    }
}

/// Whether an I/O error says the other side could not be reached or did not answer in
/// time (a store or service that is down, restarting or overloaded), not that the record
/// is bad: the same call can succeed later.
fn is_unreachable(kind: std::io::ErrorKind) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        kind,
        ConnectionRefused
            | ConnectionReset
            | ConnectionAborted
            | NotConnected
            | BrokenPipe
            | TimedOut
            | Interrupted
            | WouldBlock
            | AddrNotAvailable
            | HostUnreachable
            | NetworkUnreachable
            | NetworkDown
    )
}

impl<F> DeadLetterPolicy for F
where
    F: Fn(&(dyn Error + Send + Sync + 'static), &Metadata) -> bool,
{
    fn should_dead_letter(
        &self,
        error: &(dyn Error + Send + Sync + 'static),
        metadata: &Metadata,
    ) -> bool {
        self(error, metadata)
    }
}
