//! Kinesis sequence numbers and positions within a shard.
//!
//! A sequence number is a decimal string of up to 129 digits: wider than `u128` and than
//! DynamoDB's 38-digit Number. [`SequenceNumber`] keeps the digits and orders them
//! numerically (shorter is smaller, then digit by digit). [`Position`] adds the KPL
//! sub-sequence number so a checkpoint can stop in the middle of an aggregated record.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

/// The largest number of digits Kinesis uses for a sequence number.
pub const MAX_DIGITS: usize = 129;

/// A Kinesis sequence number, ordered numerically.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SequenceNumber(String);

/// Why a string is not a sequence number.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SequenceNumberError {
    /// The string was empty.
    #[error("a sequence number cannot be empty")]
    Empty,
    /// The string was longer than [`MAX_DIGITS`] digits (after leading zeros).
    #[error("a sequence number has at most {MAX_DIGITS} digits, got {0}")]
    TooLong(usize),
    /// The string held something other than ASCII digits.
    #[error("a sequence number holds only decimal digits, got {0:?}")]
    NotDecimal(String),
}

impl SequenceNumber {
    /// Parses a decimal sequence number. Leading zeros are accepted (the padded storage
    /// form has them) and removed, so equal numbers compare and hash equal.
    pub fn new(digits: impl Into<String>) -> Result<Self, SequenceNumberError> {
        let mut digits = digits.into();
        if digits.is_empty() {
            return Err(SequenceNumberError::Empty);
        }
        if !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(SequenceNumberError::NotDecimal(digits));
        }
        let zeros = digits.len() - digits.trim_start_matches('0').len();
        let zeros = zeros.min(digits.len() - 1); // keep one digit of "000"
        if zeros > 0 {
            digits.drain(..zeros);
        }
        if digits.len() > MAX_DIGITS {
            return Err(SequenceNumberError::TooLong(digits.len()));
        }
        Ok(SequenceNumber(digits))
    }

    /// The digits, without leading zeros.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The fixed-width storage form: left-padded with zeros to [`MAX_DIGITS`] digits, so
    /// that string order equals numeric order (for DynamoDB conditions on strings).
    pub fn to_padded(&self) -> String {
        format!("{:0>width$}", self.0, width = MAX_DIGITS)
    }
}

impl Ord for SequenceNumber {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0
            .len()
            .cmp(&other.0.len())
            .then_with(|| self.0.as_bytes().cmp(other.0.as_bytes()))
    }
}

impl PartialOrd for SequenceNumber {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl From<u64> for SequenceNumber {
    /// Any `u64` is a valid sequence number (handy for hand-built test messages).
    fn from(n: u64) -> Self {
        // `to_string` of a u64 is decimal digits without leading zeros (or "0"), at
        // most 20 of them: already the normal form `new` would produce.
        SequenceNumber(n.to_string())
    }
}

impl FromStr for SequenceNumber {
    type Err = SequenceNumberError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SequenceNumber::new(s)
    }
}

impl fmt::Display for SequenceNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SequenceNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SequenceNumber({})", self.0)
    }
}

/// A position within a shard: a sequence number and, for a user record inside a KPL
/// aggregate, its index (`sub_sequence`); plain records have `sub_sequence == 0`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Position {
    /// The Kinesis record's sequence number.
    pub sequence: SequenceNumber,
    /// The user record's index within an aggregated record (0 for plain records).
    pub sub_sequence: u64,
}

impl Position {
    /// A position at a plain (not aggregated) record.
    pub fn new(sequence: SequenceNumber, sub_sequence: u64) -> Self {
        Position {
            sequence,
            sub_sequence,
        }
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.sub_sequence == 0 {
            write!(f, "{}", self.sequence)
        } else {
            write!(f, "{}/{}", self.sequence, self.sub_sequence)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

    fn runner() -> TestRunner {
        // A fixed seed: the same cases on every run and machine.
        TestRunner::new_with_rng(
            Config::with_cases(512),
            TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
        )
    }

    fn digits() -> impl Strategy<Value = String> {
        "[0-9]{1,129}"
    }

    #[test]
    fn rejects_what_is_not_a_sequence_number() {
        assert_eq!(SequenceNumber::new(""), Err(SequenceNumberError::Empty));
        assert!(matches!(
            SequenceNumber::new("12a"),
            Err(SequenceNumberError::NotDecimal(_))
        ));
        assert_eq!(
            SequenceNumber::new("1".repeat(130)),
            Err(SequenceNumberError::TooLong(130))
        );
        assert_eq!(SequenceNumber::new("000").unwrap().as_str(), "0");
        assert_eq!(SequenceNumber::new("0042").unwrap().as_str(), "42");
    }

    #[test]
    fn orders_numerically_beyond_u128() {
        let small: SequenceNumber = "9".parse().unwrap();
        let big: SequenceNumber = "10".parse().unwrap();
        assert!(small < big);
        let huge: SequenceNumber = format!("1{}", "0".repeat(128)).parse().unwrap();
        let huge_minus: SequenceNumber = "9".repeat(128).parse().unwrap();
        assert!(huge_minus < huge);
    }

    #[test]
    fn order_matches_u128_order() {
        runner()
            .run(&(any::<u128>(), any::<u128>()), |(a, b)| {
                let sa = SequenceNumber::new(a.to_string()).unwrap();
                let sb = SequenceNumber::new(b.to_string()).unwrap();
                prop_assert_eq!(sa.cmp(&sb), a.cmp(&b));
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn padded_form_round_trips_and_sorts_as_strings() {
        runner()
            .run(&(digits(), digits()), |(a, b)| {
                let sa = SequenceNumber::new(a).unwrap();
                let sb = SequenceNumber::new(b).unwrap();
                let (pa, pb) = (sa.to_padded(), sb.to_padded());
                prop_assert_eq!(pa.len(), MAX_DIGITS);
                prop_assert_eq!(&SequenceNumber::new(pa.clone()).unwrap(), &sa);
                prop_assert_eq!(pa.cmp(&pb), sa.cmp(&sb));
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn positions_order_by_sequence_then_sub_sequence() {
        let s = |d: &str| SequenceNumber::new(d).unwrap();
        assert!(Position::new(s("5"), 9) < Position::new(s("6"), 0));
        assert!(Position::new(s("6"), 0) < Position::new(s("6"), 1));
    }
}
