//! Reading shards for the command line: one shard up to its tip (counting lag, reading a
//! dead-letter stream) and KPL aggregates split into their user records.

use std::time::SystemTime;

use bytes::Bytes;
use shardflow::aggregation::{deaggregate, Deaggregated};
use shardflow::kinesis::{KinesisApi, KinesisError, Record, RecordsPage, StartingPosition};

/// The most records one GetRecords call asks for.
pub const PAGE: u32 = 10_000;

/// One user record: a plain Kinesis record, or one record of a KPL aggregate.
#[derive(Clone, Debug)]
pub struct UserRecord {
    /// Its shard.
    pub shard: String,
    /// The Kinesis record's sequence number.
    pub sequence_number: String,
    /// Its place in an aggregate (0 for a plain record).
    pub sub_sequence: u64,
    /// Its partition key.
    pub partition_key: String,
    /// When the Kinesis record arrived.
    pub arrival: Option<SystemTime>,
    /// Its data.
    pub data: Bytes,
    /// Whether it came out of a KPL aggregate.
    pub aggregated: bool,
}

/// The user records of a Kinesis record of `shard`: an aggregate split (when `aggregates`,
/// false for a table's stream, whose records are never aggregated), anything else (a
/// corrupt aggregate too) as it is.
pub fn user_records(shard: &str, record: Record, aggregates: bool) -> Vec<UserRecord> {
    let one = |r: &Record, sub, pk: &str, data: Bytes, aggregated| UserRecord {
        shard: shard.to_owned(),
        sequence_number: r.sequence_number.as_str().to_owned(),
        sub_sequence: sub,
        partition_key: pk.to_owned(),
        arrival: r.approximate_arrival,
        data,
        aggregated,
    };
    if !aggregates {
        return vec![one(
            &record,
            0,
            &record.partition_key,
            record.data.clone(),
            false,
        )];
    }
    match deaggregate(record) {
        Deaggregated::Aggregated {
            record,
            user_records,
        } => user_records
            .into_iter()
            .map(|u| one(&record, u.sub_sequence, &u.partition_key, u.data, true))
            .collect(),
        other => {
            let r = other.record();
            vec![one(r, 0, &r.partition_key, r.data.clone(), false)]
        }
    }
}

/// Whether a page says the reader is at the tip of its shard: nothing came and nothing
/// is behind, or the shard ended.
pub fn at_tip(page: &RecordsPage) -> bool {
    page.next_iterator.is_none()
        || (page.records.is_empty() && page.millis_behind_latest.unwrap_or(0) == 0)
}

/// Reads `shard` from `from` up to its tip, calling `each` with every user record until
/// it returns `false`. Returns the last page's `MillisBehindLatest`.
pub async fn read_to_tip(
    kinesis: &dyn KinesisApi,
    stream: &str,
    shard: &str,
    from: &StartingPosition,
    mut each: impl FnMut(UserRecord) -> bool,
) -> Result<Option<i64>, KinesisError> {
    let mut iterator = kinesis.shard_iterator(stream, shard, from).await?;
    loop {
        let page = kinesis.get_records(&iterator, PAGE).await?;
        let done = at_tip(&page);
        for record in page.records {
            for user in user_records(shard, record, kinesis.records_may_be_aggregated()) {
                if !each(user) {
                    return Ok(page.millis_behind_latest);
                }
            }
        }
        match page.next_iterator {
            Some(next) if !done => iterator = next,
            _ => return Ok(page.millis_behind_latest),
        }
    }
}
