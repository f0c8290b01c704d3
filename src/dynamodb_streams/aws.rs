//! [`KinesisApi`] over `aws-sdk-dynamodbstreams`: a table's change stream served through
//! the same trait as a Kinesis stream, so the consumer's readers, resharding and leases
//! are the same. The `stream` argument of every call is the stream ARN.
//!
//! What the DynamoDB Streams API does differently is handled here:
//!
//! * shards are listed with DescribeStream, paged by `ExclusiveStartShardId`
//!   (`LastEvaluatedShardId` of the previous page); a shard has no hash-key range, so it is
//!   given the whole range `0..=u128::MAX`; a shard is closed once it has an ending
//!   sequence number; a rolled-over shard has one child, a split one two;
//! * a GetRecords call returns at most 1,000 records (larger limits are lowered);
//! * each record becomes a [`Record`] whose payload is the change's JSON form
//!   ([`ChangeRecord::to_payload`]), whose partition key is derived from the item's keys
//!   ([`ChangeRecord::partition_key`]) and whose arrival is `ApproximateCreationDateTime`;
//! * records are never KPL aggregates, and there is no enhanced fan-out and no writing;
//! * a position older than the 24-hour retention (`TrimmedDataAccessException`) starts at
//!   the oldest record still retained, as Kinesis does for a sequence number past its
//!   retention: what was trimmed is gone either way, and the shard is not held;
//! * the table's stream ARN is DescribeTable's `LatestStreamArn`.
//!
//! | service error code | [`KinesisError`] |
//! |---|---|
//! | `LimitExceededException`, `ThrottlingException`, `ProvisionedThroughputExceededException`, `RequestLimitExceeded` | [`Throttled`](KinesisError::Throttled) |
//! | `ExpiredIteratorException`; `TrimmedDataAccessException` on GetRecords | [`ExpiredIterator`](KinesisError::ExpiredIterator) (the reader asks for a new iterator) |
//! | `ResourceNotFoundException` | [`NotFound`](KinesisError::NotFound) |
//! | `AccessDeniedException` | [`AccessDenied`](KinesisError::AccessDenied) (not retried) |
//! | `ValidationException` saying an `AT_TIMESTAMP` is in the future | [`FutureTimestamp`](KinesisError::FutureTimestamp) |
//! | `ValidationException`, `InvalidArgumentException` | [`Invalid`](KinesisError::Invalid) |
//! | anything else | [`Other`](KinesisError::Other) |

use std::collections::BTreeMap;

use async_trait::async_trait;
use aws_sdk_dynamodbstreams::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodbstreams::primitives::DateTime;
use aws_sdk_dynamodbstreams::types::{self as sdk, ShardIteratorType};

use super::record::{
    AttributeValue, ChangeRecord, EventName, Image, StreamRecord, StreamViewType, UserIdentity,
};
use crate::error::ErrorDetail;
use crate::kinesis::aws::{aws_error_of, describe_sdk_error};
use crate::kinesis::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, Record, RecordsPage, ShardInfo,
    StartingPosition,
};
use crate::sequence::SequenceNumber;

/// The most records one DynamoDB Streams GetRecords call may ask for.
const MAX_GET_RECORDS_LIMIT: u32 = 1_000;

/// A table's change streams through the official SDK (DynamoDB Streams for the shards and
/// records, DynamoDB for the table's current stream ARN).
/// [`Backend::table_streams`](crate::Backend::table_streams) of [`crate::Aws`] gives one
/// with the backend's clients.
#[derive(Clone, Debug)]
pub struct AwsTableStreams {
    streams: aws_sdk_dynamodbstreams::Client,
    dynamodb: aws_sdk_dynamodb::Client,
}

impl AwsTableStreams {
    /// Wraps the clients: `streams` reads the streams, `dynamodb` resolves a table's
    /// stream ARN.
    pub fn new(
        streams: aws_sdk_dynamodbstreams::Client,
        dynamodb: aws_sdk_dynamodb::Client,
    ) -> Self {
        AwsTableStreams { streams, dynamodb }
    }

    /// The first position of a shard when the asked one was trimmed.
    async fn trim_horizon(&self, stream: &str, shard_id: &str) -> Result<String, KinesisError> {
        let out = self
            .streams
            .get_shard_iterator()
            .stream_arn(stream)
            .shard_id(shard_id)
            .shard_iterator_type(ShardIteratorType::TrimHorizon)
            .send()
            .await
            .map_err(|e| classify("GetShardIterator", e))?;
        iterator_of(stream, shard_id, out.shard_iterator)
    }
}

fn iterator_of(
    stream: &str,
    shard_id: &str,
    iterator: Option<String>,
) -> Result<String, KinesisError> {
    iterator.filter(|it| !it.is_empty()).ok_or_else(|| {
        KinesisError::Other(
            format!("GetShardIterator for {stream}/{shard_id}: the answer has no iterator").into(),
        )
    })
}

fn classify<E>(op: &str, err: SdkError<E>) -> KinesisError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let code = err.code().unwrap_or_default().to_owned();
    let message = err.message().unwrap_or_default().to_owned();
    let detail = ErrorDetail::from_aws(describe_sdk_error(op, &err), aws_error_of(op, &err));
    classify_code(op, &code, &message, detail)
}

/// The classification on the code and message alone (unit-tested below).
fn classify_code(op: &str, code: &str, message: &str, detail: ErrorDetail) -> KinesisError {
    match code {
        "LimitExceededException"
        | "ThrottlingException"
        | "ProvisionedThroughputExceededException"
        | "RequestLimitExceeded" => KinesisError::Throttled(detail),
        "ExpiredIteratorException" => KinesisError::ExpiredIterator(detail),
        // The iterator points before the trim horizon: a new one (from the last position
        // delivered, which then starts at the horizon) is the way on.
        "TrimmedDataAccessException" if op == "GetRecords" => KinesisError::ExpiredIterator(detail),
        "ResourceNotFoundException" => KinesisError::NotFound(detail),
        "AccessDeniedException" => KinesisError::AccessDenied(detail),
        "ValidationException" if message.to_ascii_lowercase().contains("future") => {
            KinesisError::FutureTimestamp(detail)
        }
        // Emulators answer a malformed iterator this way; a new iterator is safe.
        "ValidationException" | "InvalidArgumentException"
            if op == "GetRecords" && message.to_ascii_lowercase().contains("iterator") =>
        {
            KinesisError::ExpiredIterator(detail)
        }
        "ValidationException" | "InvalidArgumentException" => KinesisError::Invalid(detail),
        _ => KinesisError::Other(detail),
    }
}

/// A sequence number as DynamoDB Streams takes it back: at least 21 digits. The API's
/// numbers have 21 to 40 digits, some with leading zeros, which [`SequenceNumber`] drops
/// (it orders numerically); sent back unpadded, a short one would be refused.
fn wire_sequence(seq: &SequenceNumber) -> String {
    format!(
        "{:0>width$}",
        seq.as_str(),
        width = crate::lease::MIN_CHECKPOINT_DIGITS
    )
}

fn parse_sequence(op: &str, value: String) -> Result<SequenceNumber, KinesisError> {
    SequenceNumber::new(value)
        .map_err(|e| KinesisError::Other(format!("{op}: invalid sequence number: {e}").into()))
}

/// Maps one shard of a DescribeStream answer; a table stream's shard owns the whole
/// hash-key range (records go to shards by the item's key, not by a hash range).
fn shard_info(shard: sdk::Shard) -> Result<ShardInfo, KinesisError> {
    const OP: &str = "DescribeStream";
    let shard_id = shard
        .shard_id
        .filter(|id| !id.is_empty())
        .ok_or_else(|| KinesisError::Other(format!("{OP}: a shard has no id").into()))?;
    let (starting, ending) = match shard.sequence_number_range {
        Some(range) => (range.starting_sequence_number, range.ending_sequence_number),
        None => (None, None),
    };
    let starting = starting.ok_or_else(|| {
        KinesisError::Other(
            format!("{OP}: shard {shard_id} has no starting sequence number").into(),
        )
    })?;
    Ok(ShardInfo {
        starting_hash_key: 0,
        ending_hash_key: u128::MAX,
        starting_sequence_number: parse_sequence(OP, starting)?,
        ending_sequence_number: ending
            .filter(|s| !s.is_empty())
            .map(|s| parse_sequence(OP, s))
            .transpose()?,
        parent_shard_id: shard.parent_shard_id.filter(|p| !p.is_empty()),
        adjacent_parent_shard_id: None,
        shard_id,
    })
}

/// An SDK attribute value in DynamoDB's JSON form; `None` for a type this crate does not
/// know (a newer service's).
pub(crate) fn attribute_value(value: sdk::AttributeValue) -> Option<AttributeValue> {
    Some(match value {
        sdk::AttributeValue::S(s) => AttributeValue::S(s),
        sdk::AttributeValue::N(n) => AttributeValue::N(n),
        sdk::AttributeValue::B(b) => AttributeValue::B(b.into_inner()),
        sdk::AttributeValue::Bool(b) => AttributeValue::Bool(b),
        sdk::AttributeValue::Null(b) => AttributeValue::Null(b),
        sdk::AttributeValue::M(m) => AttributeValue::M(image(m)?),
        sdk::AttributeValue::L(l) => {
            AttributeValue::L(l.into_iter().map(attribute_value).collect::<Option<_>>()?)
        }
        sdk::AttributeValue::Ss(s) => AttributeValue::Ss(s),
        sdk::AttributeValue::Ns(n) => AttributeValue::Ns(n),
        sdk::AttributeValue::Bs(b) => {
            AttributeValue::Bs(b.into_iter().map(|b| b.into_inner()).collect())
        }
        _ => return None,
    })
}

fn image(item: std::collections::HashMap<String, sdk::AttributeValue>) -> Option<Image> {
    item.into_iter()
        .map(|(name, value)| Some((name, attribute_value(value)?)))
        .collect::<Option<BTreeMap<_, _>>>()
}

/// The change record of one GetRecords record (the JSON form every table-stream source
/// shares), or why it cannot be one.
pub(crate) fn change_record(record: sdk::Record) -> Result<ChangeRecord, String> {
    let event_name = match record.event_name {
        Some(sdk::OperationType::Insert) => EventName::Insert,
        Some(sdk::OperationType::Modify) => EventName::Modify,
        Some(sdk::OperationType::Remove) => EventName::Remove,
        other => return Err(format!("unknown event name {other:?}")),
    };
    let data = record.dynamodb.ok_or("no stream record")?;
    let sequence_number = data
        .sequence_number
        .filter(|s| !s.is_empty())
        .ok_or("no sequence number")?;
    let unknown =
        |part: &str| format!("the {part} hold an attribute type this crate does not know");
    let keys = image(data.keys.unwrap_or_default()).ok_or_else(|| unknown("keys"))?;
    let new_image = data
        .new_image
        .map(|i| image(i).ok_or_else(|| unknown("new image")))
        .transpose()?;
    let old_image = data
        .old_image
        .map(|i| image(i).ok_or_else(|| unknown("old image")))
        .transpose()?;
    let stream_view_type = match data.stream_view_type {
        Some(sdk::StreamViewType::KeysOnly) => Some(StreamViewType::KeysOnly),
        Some(sdk::StreamViewType::NewImage) => Some(StreamViewType::NewImage),
        Some(sdk::StreamViewType::OldImage) => Some(StreamViewType::OldImage),
        Some(sdk::StreamViewType::NewAndOldImages) => Some(StreamViewType::NewAndOldImages),
        _ => None,
    };
    Ok(ChangeRecord {
        event_id: record.event_id.unwrap_or_default(),
        event_name,
        event_version: record.event_version,
        event_source: record.event_source,
        aws_region: record.aws_region,
        dynamodb: StreamRecord {
            approximate_creation_date_time: data
                .approximate_creation_date_time
                .map(|at| at.as_secs_f64()),
            keys,
            new_image,
            old_image,
            sequence_number,
            size_bytes: data.size_bytes.and_then(|s| u64::try_from(s).ok()),
            stream_view_type,
        },
        user_identity: record.user_identity.map(|who| UserIdentity {
            kind: who.r#type.unwrap_or_default(),
            principal_id: who.principal_id.unwrap_or_default(),
        }),
    })
}

/// A GetRecords record as a [`Record`]: the change's JSON form as payload, the key
/// derived from the item's keys, the creation time as arrival.
fn record(record: sdk::Record) -> Result<Record, KinesisError> {
    let change = change_record(record).map_err(|why| {
        KinesisError::Other(format!("GetRecords: a record is not a change record: {why}").into())
    })?;
    Ok(Record {
        sequence_number: parse_sequence("GetRecords", change.dynamodb.sequence_number.clone())?,
        partition_key: change.partition_key(),
        approximate_arrival: change.approximate_creation_time(),
        data: change.to_payload(),
    })
}

#[async_trait]
impl KinesisApi for AwsTableStreams {
    /// DescribeStream, page after page (`ExclusiveStartShardId`).
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        let mut shards: Vec<ShardInfo> = Vec::new();
        let mut start: Option<String> = None;
        loop {
            let out = self
                .streams
                .describe_stream()
                .stream_arn(stream)
                .set_exclusive_start_shard_id(start.take())
                .send()
                .await
                .map_err(|e| classify("DescribeStream", e))?;
            let description = out.stream_description.ok_or_else(|| {
                KinesisError::Other(
                    format!("DescribeStream of {stream}: the answer has no description").into(),
                )
            })?;
            for shard in description.shards.unwrap_or_default() {
                let shard = shard_info(shard)?;
                // A service that ignores ExclusiveStartShardId would repeat shards.
                if !shards.iter().any(|s| s.shard_id == shard.shard_id) {
                    shards.push(shard);
                }
            }
            match description.last_evaluated_shard_id {
                Some(last) if !last.is_empty() => start = Some(last),
                _ => return Ok(shards),
            }
        }
    }

    /// Never: a table stream's shards change without an UPDATING state.
    async fn is_updating(&self, _stream: &str) -> Result<bool, KinesisError> {
        Ok(false)
    }

    async fn resolve_table_stream(&self, table: &str) -> Result<String, KinesisError> {
        let out = self
            .dynamodb
            .describe_table()
            .table_name(table)
            .send()
            .await
            .map_err(|e| classify("DescribeTable", e))?;
        let no_stream = || {
            KinesisError::NotFound(
                format!("table {table} has no stream enabled (StreamSpecification)").into(),
            )
        };
        let description = out.table.ok_or_else(no_stream)?;
        // A stream that was disabled stays readable for a day, but is no longer the
        // table's: its ARN is not the table's current stream.
        let disabled = description
            .stream_specification
            .as_ref()
            .is_some_and(|s| !s.stream_enabled);
        match description.latest_stream_arn.filter(|a| !a.is_empty()) {
            Some(arn) if !disabled => Ok(arn),
            _ => Err(no_stream()),
        }
    }

    fn records_may_be_aggregated(&self) -> bool {
        false
    }

    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        let request = self
            .streams
            .get_shard_iterator()
            .stream_arn(stream)
            .shard_id(shard_id);
        let request = match from {
            StartingPosition::TrimHorizon => {
                request.shard_iterator_type(ShardIteratorType::TrimHorizon)
            }
            StartingPosition::Latest => request.shard_iterator_type(ShardIteratorType::Latest),
            StartingPosition::AtTimestamp(at) => request
                .shard_iterator_type(ShardIteratorType::AtTimestamp)
                .timestamp(DateTime::from(*at)),
            StartingPosition::AtSequenceNumber(seq) => request
                .shard_iterator_type(ShardIteratorType::AtSequenceNumber)
                .sequence_number(wire_sequence(seq)),
            StartingPosition::AfterSequenceNumber(seq) => request
                .shard_iterator_type(ShardIteratorType::AfterSequenceNumber)
                .sequence_number(wire_sequence(seq)),
        };
        match request.send().await {
            Ok(out) => iterator_of(stream, shard_id, out.shard_iterator),
            Err(e) if e.code() == Some("TrimmedDataAccessException") => {
                tracing::warn!(
                    %stream,
                    shard = shard_id,
                    position = ?from,
                    "the position is older than the stream's retention: reading from the oldest record retained"
                );
                self.trim_horizon(stream, shard_id).await
            }
            Err(e) => Err(classify("GetShardIterator", e)),
        }
    }

    /// `limit` is clamped to 1..=1,000, the range DynamoDB Streams accepts.
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        let limit = limit.clamp(1, MAX_GET_RECORDS_LIMIT);
        let out = self
            .streams
            .get_records()
            .shard_iterator(iterator)
            // Cannot fail: `limit` is at most 1,000 after the clamp above.
            .limit(i32::try_from(limit).unwrap_or(1_000))
            .send()
            .await
            .map_err(|e| classify("GetRecords", e))?;
        let records = out
            .records
            .unwrap_or_default()
            .into_iter()
            .map(record)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RecordsPage {
            records,
            next_iterator: out.next_shard_iterator.filter(|it| !it.is_empty()),
            // DynamoDB Streams does not report the lag.
            millis_behind_latest: None,
            child_shards: Vec::new(),
        })
    }

    /// Refused: a table's stream is written through the table.
    async fn put_records(
        &self,
        stream: &str,
        _records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        Err(KinesisError::Unsupported(format!(
            "writing to {stream}: a table's stream is written through the table"
        )))
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn sequence_numbers_go_back_with_at_least_21_digits() {
        let padded = SequenceNumber::new("000000000000000000317".to_owned()).unwrap();
        assert_eq!(wire_sequence(&padded), "000000000000000000317");
        let long = SequenceNumber::new("4000000000000000000123456".to_owned()).unwrap();
        assert_eq!(wire_sequence(&long), "4000000000000000000123456");
    }

    use super::*;
    use std::collections::HashMap;
    use std::time::SystemTime;

    fn kind(op: &str, code: &str, message: &str) -> KinesisError {
        classify_code(op, code, message, ErrorDetail::new("x"))
    }

    #[test]
    fn classifies_service_errors_by_what_the_caller_should_do() {
        assert!(matches!(
            kind("GetRecords", "LimitExceededException", ""),
            KinesisError::Throttled(_)
        ));
        assert!(matches!(
            kind("GetRecords", "ExpiredIteratorException", ""),
            KinesisError::ExpiredIterator(_)
        ));
        assert!(matches!(
            kind("GetRecords", "TrimmedDataAccessException", ""),
            KinesisError::ExpiredIterator(_)
        ));
        assert!(matches!(
            kind("DescribeStream", "ResourceNotFoundException", ""),
            KinesisError::NotFound(_)
        ));
        assert!(matches!(
            kind(
                "GetShardIterator",
                "ValidationException",
                "The timestamp is in the future"
            ),
            KinesisError::FutureTimestamp(_)
        ));
        assert!(matches!(
            kind("GetShardIterator", "ValidationException", "bad shard id"),
            KinesisError::Invalid(_)
        ));
        assert!(matches!(
            kind("GetRecords", "InternalServerError", ""),
            KinesisError::Other(_)
        ));
    }

    #[test]
    fn access_denied_is_typed_and_not_retried() {
        for op in [
            "DescribeStream",
            "GetShardIterator",
            "GetRecords",
            "DescribeTable",
        ] {
            let error = kind(op, "AccessDeniedException", "User is not authorized");
            assert!(!error.is_transient(), "{op}: {error}");
            assert!(
                matches!(error, KinesisError::AccessDenied(_)),
                "{op}: {error}"
            );
        }
    }

    #[test]
    fn records_become_change_records_with_every_attribute_type() {
        use aws_sdk_dynamodbstreams::primitives::Blob;
        let nested = sdk::AttributeValue::M(HashMap::from([
            (
                "l".to_owned(),
                sdk::AttributeValue::L(vec![
                    sdk::AttributeValue::N("1".into()),
                    sdk::AttributeValue::Null(true),
                ]),
            ),
            ("b".to_owned(), sdk::AttributeValue::Bool(false)),
        ]));
        let item = HashMap::from([
            ("pk".to_owned(), sdk::AttributeValue::S("order-7".into())),
            (
                "bin".to_owned(),
                sdk::AttributeValue::B(Blob::new(vec![0, 1, 255])),
            ),
            (
                "ss".to_owned(),
                sdk::AttributeValue::Ss(vec!["a".into(), "b".into()]),
            ),
            ("ns".to_owned(), sdk::AttributeValue::Ns(vec!["2.5".into()])),
            (
                "bs".to_owned(),
                sdk::AttributeValue::Bs(vec![Blob::new(vec![7]), Blob::new(vec![])]),
            ),
            ("m".to_owned(), nested),
        ]);
        let sdk_record = sdk::Record::builder()
            .event_id("e1")
            .event_name(sdk::OperationType::Modify)
            .event_source("aws:dynamodb")
            .dynamodb(
                sdk::StreamRecord::builder()
                    .keys("pk", sdk::AttributeValue::S("order-7".into()))
                    .set_new_image(Some(item))
                    .sequence_number("100000000000000000001")
                    .size_bytes(42)
                    .approximate_creation_date_time(DateTime::from_secs(1_700_000_000))
                    .stream_view_type(sdk::StreamViewType::NewAndOldImages)
                    .build(),
            )
            .build();
        let mapped = record(sdk_record).unwrap();
        let change = ChangeRecord::from_payload(&mapped.data).unwrap();
        assert_eq!(change.event_name, EventName::Modify);
        assert_eq!(mapped.partition_key, r#"{"pk":{"S":"order-7"}}"#);
        assert_eq!(mapped.sequence_number.as_str(), "100000000000000000001");
        assert_eq!(
            mapped.approximate_arrival,
            Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000))
        );
        let new = change.dynamodb.new_image.unwrap();
        assert_eq!(new["bin"], AttributeValue::B(vec![0, 1, 255]));
        assert_eq!(new["bs"], AttributeValue::Bs(vec![vec![7], vec![]]));
        assert_eq!(new["ss"], AttributeValue::Ss(vec!["a".into(), "b".into()]));
        assert_eq!(new["ns"], AttributeValue::Ns(vec!["2.5".into()]));
        assert_eq!(
            new["m"],
            AttributeValue::M(BTreeMap::from([
                ("b".to_owned(), AttributeValue::Bool(false)),
                (
                    "l".to_owned(),
                    AttributeValue::L(vec![
                        AttributeValue::N("1".into()),
                        AttributeValue::Null(true)
                    ])
                ),
            ]))
        );
        assert_eq!(change.dynamodb.size_bytes, Some(42));
        assert_eq!(
            change.dynamodb.stream_view_type,
            Some(StreamViewType::NewAndOldImages)
        );
    }

    #[test]
    fn shards_own_the_whole_hash_range_and_close_with_an_ending_sequence() {
        let shard = sdk::Shard::builder()
            .shard_id("shardId-00000001700000000000-aaaa")
            .parent_shard_id("shardId-00000001600000000000-bbbb")
            .sequence_number_range(
                sdk::SequenceNumberRange::builder()
                    .starting_sequence_number("100")
                    .ending_sequence_number("200")
                    .build(),
            )
            .build();
        let info = shard_info(shard).unwrap();
        assert_eq!(
            (info.starting_hash_key, info.ending_hash_key),
            (0, u128::MAX)
        );
        assert!(info.is_closed());
        assert_eq!(info.parents(), vec!["shardId-00000001600000000000-bbbb"]);
    }
}
