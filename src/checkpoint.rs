//! Per-shard progress.

/// Acknowledges the records of a batch.
pub struct AckHandle {}
impl AckHandle {
    /// Ack.
    pub fn ack(&self) {}
    /// Nack.
    pub fn nack(&self) {}
}
