//! Positions on the command line: `trim-horizon`, `latest`, `timestamp T` (RFC 3339 with
//! any UTC offset, or epoch milliseconds) and `sequence N`, for `group reset --to` and
//! `stream tail --from`. A number that reads as epoch seconds rather than milliseconds
//! is refused, and a time in the future is warned about.

use std::time::{Duration, SystemTime};

use shardflow::kinesis::StartingPosition;
use shardflow::lease::Checkpoint;
use shardflow::{Position, SequenceNumber};

/// A position given on the command line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Spot {
    /// The oldest retained record.
    TrimHorizon,
    /// The tip: records written from now on.
    Latest,
    /// Records that arrived at or after this time.
    Timestamp(SystemTime),
    /// After this sequence number (a checkpoint at it: it counts as handled).
    Sequence(SequenceNumber),
}

/// Parses `[kind]` or `[kind, value]`.
pub fn parse(words: &[String]) -> Result<Spot, String> {
    match words {
        [kind] if kind == "trim-horizon" => Ok(Spot::TrimHorizon),
        [kind] if kind == "latest" => Ok(Spot::Latest),
        [kind, t] if kind == "timestamp" => parse_time(t).map(Spot::Timestamp),
        [kind, n] if kind == "sequence" => n
            .parse::<SequenceNumber>()
            .map(Spot::Sequence)
            .map_err(|e| format!("sequence {n:?}: {e}")),
        _ => Err(format!(
            "{:?}: expected trim-horizon, latest, timestamp T (RFC 3339 or epoch ms) or sequence N",
            words.join(" ")
        )),
    }
}

/// Epoch milliseconds below this (1973-03-03) are taken for epoch seconds given by
/// mistake (as seconds, the same digits are after the year 5000) and refused.
const SECONDS_NOT_MILLIS: u64 = 100_000_000_000;

/// An RFC 3339 time (`2026-11-30T14:00:00Z`, `2026-11-30T15:00:00.250+01:00`) or epoch
/// milliseconds. A number small enough to be epoch seconds is refused, naming the time
/// it would be as seconds.
pub fn parse_time(text: &str) -> Result<SystemTime, String> {
    if let Ok(ms) = text.parse::<u64>() {
        if ms < SECONDS_NOT_MILLIS {
            let as_seconds = SystemTime::UNIX_EPOCH + Duration::from_secs(ms);
            return Err(format!(
                "timestamp {text:?} would be {} as epoch milliseconds, and looks like epoch seconds ({}): give epoch milliseconds ({}) or RFC 3339",
                rfc3339(SystemTime::UNIX_EPOCH + Duration::from_millis(ms)),
                rfc3339(as_seconds),
                ms.saturating_mul(1000)
            ));
        }
        return Ok(SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
    }
    let t = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
        .map_err(|e| format!("timestamp {text:?}: {e} (use RFC 3339 or epoch milliseconds)"))?;
    Ok(SystemTime::from(t))
}

/// A warning for a time in the future (a reset there skips every record until then;
/// a read there shows nothing before it), or `None`.
pub fn future_warning(spot: &Spot) -> Option<String> {
    let Spot::Timestamp(t) = spot else {
        return None;
    };
    let ahead = t.duration_since(SystemTime::now()).ok()?;
    Some(format!(
        "timestamp {} is in the future ({:.0} s from now): nothing before it is read",
        rfc3339(*t),
        ahead.as_secs_f64().ceil()
    ))
}

/// Epoch milliseconds of `t`.
pub fn millis(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// RFC 3339 text of `t`, to the millisecond.
pub fn rfc3339(t: SystemTime) -> String {
    aws_smithy_types::DateTime::from(t)
        .fmt(aws_smithy_types::date_time::Format::DateTime)
        .unwrap_or_else(|_| format!("{} ms", millis(t)))
}

impl Spot {
    /// The checkpoint a reset to this spot stores: LATEST is resolved now, the way the
    /// consumer resolves it (see [`Checkpoint::latest_from`]).
    pub fn checkpoint(&self) -> Checkpoint {
        match self {
            Spot::TrimHorizon => Checkpoint::TrimHorizon,
            Spot::Latest => Checkpoint::latest_from(SystemTime::now()),
            Spot::Timestamp(t) => Checkpoint::AtTimestamp(Some(*t)),
            Spot::Sequence(n) => Checkpoint::At(Position::new(n.clone(), 0)),
        }
    }

    /// Where a read starts.
    pub fn starting(&self) -> StartingPosition {
        match self {
            Spot::TrimHorizon => StartingPosition::TrimHorizon,
            Spot::Latest => StartingPosition::Latest,
            Spot::Timestamp(t) => StartingPosition::AtTimestamp(*t),
            Spot::Sequence(n) => StartingPosition::AfterSequenceNumber(n.clone()),
        }
    }
}

/// Where a read continuing after `checkpoint` starts; `None` for SHARD_END.
pub fn after_checkpoint(checkpoint: &Checkpoint) -> Option<StartingPosition> {
    Some(match checkpoint {
        Checkpoint::TrimHorizon | Checkpoint::AtTimestamp(None) => StartingPosition::TrimHorizon,
        Checkpoint::Latest => StartingPosition::Latest,
        Checkpoint::AtTimestamp(Some(t)) => StartingPosition::AtTimestamp(*t),
        // Inside a KPL aggregate the rest of the aggregate is not counted as lag.
        Checkpoint::At(p) => StartingPosition::AfterSequenceNumber(p.sequence.clone()),
        Checkpoint::ShardEnd => return None,
    })
}

/// A checkpoint as a person reads it.
pub fn show(checkpoint: &Checkpoint) -> String {
    match checkpoint {
        Checkpoint::AtTimestamp(Some(t)) => format!("AT_TIMESTAMP {}", rfc3339(*t)),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_parse() {
        let w = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        assert_eq!(parse(&w("trim-horizon")), Ok(Spot::TrimHorizon));
        assert_eq!(parse(&w("latest")), Ok(Spot::Latest));
        assert_eq!(
            parse(&w("timestamp 1700000000000")),
            Ok(Spot::Timestamp(
                SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
            ))
        );
        let seconds = parse(&w("timestamp 1700000000")).unwrap_err();
        assert!(
            seconds.contains("epoch seconds (2023-11-14T22:13:20Z)"),
            "{seconds}"
        );
        assert_eq!(
            parse(&w("timestamp 2023-11-14T23:13:20.5+01:00")),
            Ok(Spot::Timestamp(
                SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_500)
            ))
        );
        assert_eq!(
            parse(&w("timestamp 1970-01-01T00:00:02Z")),
            Ok(Spot::Timestamp(
                SystemTime::UNIX_EPOCH + Duration::from_secs(2)
            ))
        );
        assert!(parse(&w("timestamp yesterday")).is_err());
        assert!(parse(&w("sequence 12x")).is_err());
        assert!(parse(&w("somewhere")).is_err());
    }
}
