//! Resolving LATEST into a durable start that Kinesis' clock confirms: the worker's
//! clock gives the first guess, and a guess Kinesis calls "in the future" moves back.

use std::time::{Duration, SystemTime};

use crate::kinesis::{KinesisApi, KinesisError, StartingPosition};
use crate::lease::{Checkpoint, LATEST_CLOCK_MARGIN};

/// How many times a guess may move back: the steps double from the clock margin, so
/// this covers a clock decades ahead, and the loop always ends.
const MAX_STEPS_BACK: u32 = 40;

/// The durable start of `InitialPosition::Latest` resolved at `now` (the worker's wall
/// clock), checked against Kinesis' clock on one of the stream's shards.
///
/// Kinesis stamps arrivals with its own clock and refuses an `AT_TIMESTAMP` later than
/// it. A start later than Kinesis' "now" would skip records written after the group
/// started (a worker whose clock runs a minute ahead would write a start a minute
/// into Kinesis' future, and every owner would skip that minute). So the guess, `now`
/// less [`LATEST_CLOCK_MARGIN`], is offered to GetShardIterator: accepted, it is at or
/// before Kinesis' clock and becomes the start; refused as
/// [`KinesisError::FutureTimestamp`], it moves back by a step that doubles each time
/// (2 s, 4 s, 8 s, ...). A clock ahead by `d` then costs at most about `2 d` of
/// records delivered from before the start, never a gap; a clock behind costs its lag in
/// records from before the start, as before.
///
/// `shards` are tried in order until one answers (a shard a lagging node does not know
/// yet answers NotFound); any other error is returned, for the caller to retry.
pub(crate) async fn resolve_latest(
    kinesis: &dyn KinesisApi,
    stream: &str,
    shards: &[&str],
    now: SystemTime,
) -> Result<Checkpoint, KinesisError> {
    let mut start = Checkpoint::latest_from(now);
    let mut step = LATEST_CLOCK_MARGIN;
    let mut shards = shards.iter().peekable();
    let mut steps = 0;
    loop {
        let Some(shard) = shards.peek() else {
            return Err(KinesisError::NotFound(
                format!("no shard of {stream} to check LATEST's start on").into(),
            ));
        };
        let Checkpoint::AtTimestamp(Some(at)) = start else {
            // `latest_from` always gives a time.
            return Ok(start);
        };
        match kinesis
            .shard_iterator(stream, shard, &StartingPosition::AtTimestamp(at))
            .await
        {
            Ok(_) => {
                if steps > 0 {
                    tracing::warn!(start = %start, "this host's clock runs ahead of Kinesis'; LATEST starts at a time Kinesis accepted");
                }
                return Ok(start);
            }
            Err(KinesisError::FutureTimestamp(why)) => {
                steps += 1;
                if steps > MAX_STEPS_BACK {
                    return Err(KinesisError::Invalid(
                        format!("LATEST's start is still later than Kinesis' clock after {MAX_STEPS_BACK} steps back: {why}").into(),
                    ));
                }
                tracing::debug!(start = %start, %why, "Kinesis refused LATEST's start as in its future; moving it back");
                let earlier = at.checked_sub(step).unwrap_or(SystemTime::UNIX_EPOCH);
                start = Checkpoint::latest_from(earlier + LATEST_CLOCK_MARGIN);
                step = step
                    .saturating_mul(2)
                    .min(Duration::from_secs(u32::MAX.into()));
            }
            Err(KinesisError::NotFound(why)) => {
                tracing::debug!(shard = %shard, %why, "a shard to check LATEST's start on was not found; trying another");
                shards.next();
                if shards.peek().is_none() {
                    return Err(KinesisError::NotFound(why));
                }
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kinesis::StreamAdmin;
    use crate::memory::MemoryKinesis;

    fn millis(c: &Checkpoint) -> u64 {
        c.timestamp_millis().expect("a timestamp")
    }

    #[tokio::test]
    async fn a_clock_ahead_of_kinesis_moves_the_start_back_to_a_time_kinesis_accepts() {
        let kinesis = MemoryKinesis::default();
        kinesis.create_stream("s", 1).await.unwrap();
        let shards = kinesis.list_shards("s").await.unwrap();
        let ids: Vec<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
        let before = SystemTime::now();
        let ahead = before + Duration::from_secs(60);
        let start = resolve_latest(&kinesis, "s", &ids, ahead).await.unwrap();
        let after = SystemTime::now();
        let to_millis = |t: SystemTime| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_millis() as u64
        };
        // At or before the service's clock, and no more than twice the skew back.
        assert!(
            millis(&start) <= to_millis(after),
            "{start} is in Kinesis' future"
        );
        assert!(
            millis(&start) + 2 * 62_000 >= to_millis(before),
            "{start} moved back further than twice the skew"
        );
        // A right clock keeps its guess: now less the margin.
        let right = resolve_latest(&kinesis, "s", &ids, before).await.unwrap();
        assert_eq!(right, Checkpoint::latest_from(before));
    }
}
