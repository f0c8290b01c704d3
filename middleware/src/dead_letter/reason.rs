//! Why a record went to the dead-letter sink: the vocabulary the dead-letter layer and
//! [`bisect`](crate::bisect) share.

use std::fmt;

/// Why a record went to the dead-letter sink (the `reason` field of the
/// `shardflow.dead_lettered` metric, and the head of the record's error text).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// The record failed in a call that held it alone.
    FailedAlone,
    /// The record arrived longer ago than
    /// [`BisectConfig::max_record_age`](crate::bisect::BisectConfig::max_record_age) when
    /// it would have been retried.
    TooOld,
    /// The record failed in
    /// [`BisectConfig::max_attempts`](crate::bisect::BisectConfig::max_attempts)
    /// deliveries (in pieces that could not be narrowed down).
    AttemptsExhausted,
}

impl Reason {
    /// The name used in metrics and error texts.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::FailedAlone => "failed_alone",
            Reason::TooOld => "too_old",
            Reason::AttemptsExhausted => "attempts_exhausted",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
