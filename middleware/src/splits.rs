//! How far a failing batch may be split to find the records that fail alone: the
//! setting [`bisect`](crate::bisect) (batch mode) and record-mode
//! [`batch`](crate::batch) share.

/// How far a failing batch may be split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Splits {
    /// Never split: a failing batch fails the call (delivered again), as without
    /// bisecting.
    Off,
    /// Split down to single records (at most `⌈log2(n)⌉` levels for `n` records).
    #[default]
    Full,
    /// Split at most this many levels deep: pieces of a batch of `n` records are never
    /// smaller than `n / 2^levels`. A piece at the limit that fails is not narrowed
    /// further; it fails the call (see
    /// [`BisectConfig::max_attempts`](crate::bisect::BisectConfig::max_attempts)).
    AtMost(u32),
}

impl Splits {
    /// Whether a piece `depth` levels deep may be split again.
    pub(crate) fn allows(self, depth: u32) -> bool {
        match self {
            Splits::Off => false,
            Splits::Full => true,
            Splits::AtMost(levels) => depth < levels,
        }
    }
}
