//! [`KinesisApi`] over `aws-sdk-kinesis`.
//!
//! Every call maps the SDK's answer onto the small value types of [`super`] and
//! classifies failures into [`KinesisError`] by what the caller should do next:
//!
//! | service error code | [`KinesisError`] |
//! |---|---|
//! | `ProvisionedThroughputExceededException`, `LimitExceededException`, `KMSThrottlingException`, `ThrottlingException` | [`Throttled`](KinesisError::Throttled) |
//! | on SubscribeToShard: `ResourceInUseException` (another subscription of the same consumer to the shard is still open, e.g. during a hand-off) | [`Throttled`](KinesisError::Throttled) |
//! | `ExpiredIteratorException`; on GetRecords also `InvalidArgumentException` whose message names the iterator | [`ExpiredIterator`](KinesisError::ExpiredIterator) |
//! | `ResourceNotFoundException` | [`NotFound`](KinesisError::NotFound) |
//! | `AccessDeniedException` | [`AccessDenied`](KinesisError::AccessDenied) (not retried) |
//! | `InvalidArgumentException` saying an `AT_TIMESTAMP` "cannot be greater than the currentTimestampInMillis" (a time later than the service's clock) | [`FutureTimestamp`](KinesisError::FutureTimestamp) |
//! | `InvalidArgumentException`, `ValidationException` | [`Invalid`](KinesisError::Invalid) |
//! | anything else: other service errors, HTTP 5xx, dispatch failures, timeouts | [`Other`](KinesisError::Other) |
//!
//! Emulators (kinesalite, ferrokinesis) answer a malformed or expired iterator with
//! `InvalidArgumentException: Invalid ShardIterator.`; treating that as an expired
//! iterator makes the reader recover from its last delivered position, which is always
//! safe (nothing is skipped).
//!
//! Errors are formatted with [`DisplayErrorContext`] so the whole cause chain reaches the
//! log, but without the raw HTTP response: record payloads are never logged or put into
//! error messages (see `describe_sdk_error`).
//!
//! The SDK's own retry policy (standard mode) still applies underneath: a `Throttled` or
//! `Other` error here means its attempts were used up.
//!
//! Enhanced fan-out: [`register_consumer`](KinesisApi::register_consumer) finds or
//! registers the stream consumer (DescribeStreamConsumer, then RegisterStreamConsumer if
//! it does not exist) and polls until it is ACTIVE;
//! [`subscribe_to_shard`](KinesisApi::subscribe_to_shard) maps the SubscribeToShard event
//! stream onto [`SubscriptionEvent`]s. An error inside the event stream is the stream's
//! last item. The service ends a subscription after five minutes; AWS needs HTTP/2 for
//! it, which the SDK's default HTTPS client negotiates.

use crate::backoff::DeadlinePoll;
use crate::error::{AwsError, ErrorDetail};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use aws_sdk_kinesis::error::{DisplayErrorContext, ProvideErrorMetadata, SdkError};
use aws_sdk_kinesis::primitives::{Blob, DateTime};
use aws_sdk_kinesis::types::{
    ConsumerStatus, PutRecordsRequestEntry, ShardIteratorType, StreamStatus,
    SubscribeToShardEventStream,
};

use super::{
    KinesisApi, KinesisError, PutOutcome, PutRecord, Record, RecordsPage, ShardInfo,
    StartingPosition, StreamAdmin, StreamIdentity, Subscription, SubscriptionEvent,
    MAX_LARGE_RECORD_BYTES, MAX_RECORD_BYTES,
};
use crate::sequence::SequenceNumber;

/// The most records one GetRecords call may ask for.
const MAX_GET_RECORDS_LIMIT: u32 = 10_000;

/// How long [`AwsKinesis::create_stream`], [`AwsKinesis::split_shard`] and
/// [`AwsKinesis::merge_shards`] wait for the stream to become ACTIVE.
const ACTIVE_WAIT: Duration = Duration::from_secs(60);

/// How long [`AwsKinesis::register_consumer`] waits for the consumer to become ACTIVE
/// (AWS takes a few seconds, rarely more than half a minute).
const CONSUMER_ACTIVE_WAIT: Duration = Duration::from_secs(120);

/// Kinesis through the official SDK.
///
/// [`create_stream`](StreamAdmin::create_stream), [`split_shard`](StreamAdmin::split_shard)
/// and [`merge_shards`](StreamAdmin::merge_shards) return once the stream is ACTIVE again
/// (polling DescribeStreamSummary, at most 60 s), so a following
/// [`list_shards`](KinesisApi::list_shards) already sees the new shards — the same
/// behaviour as the embedded backend.
#[derive(Clone, Debug)]
pub struct AwsKinesis {
    client: aws_sdk_kinesis::Client,
}

impl AwsKinesis {
    /// Wraps a client.
    pub fn new(client: aws_sdk_kinesis::Client) -> Self {
        AwsKinesis { client }
    }

    /// The stream's summary, from DescribeStreamSummary.
    async fn describe_summary(
        &self,
        stream: &str,
    ) -> Result<aws_sdk_kinesis::types::StreamDescriptionSummary, KinesisError> {
        let out = self
            .client
            .describe_stream_summary()
            .stream_name(stream)
            .send()
            .await
            .map_err(|e| classify("DescribeStreamSummary", e))?;
        out.stream_description_summary.ok_or_else(|| {
            KinesisError::Other(
                format!("DescribeStreamSummary of {stream}: the answer has no stream description")
                    .into(),
            )
        })
    }

    /// The stream's status.
    async fn stream_status(&self, stream: &str) -> Result<StreamStatus, KinesisError> {
        Ok(self.describe_summary(stream).await?.stream_status)
    }

    /// Polls the stream's status until it is ACTIVE, for at most [`ACTIVE_WAIT`].
    /// A missing stream (DescribeStreamSummary can lag behind CreateStream) and throttling
    /// only mean "not yet".
    async fn wait_until_active(&self, stream: &str) -> Result<(), KinesisError> {
        let mut poll = DeadlinePoll::new(
            ACTIVE_WAIT,
            Duration::from_millis(25),
            Duration::from_millis(250),
        );
        loop {
            let last = match self.stream_status(stream).await {
                Ok(StreamStatus::Active) => return Ok(()),
                Ok(status) => format!("status {}", status.as_str()),
                Err(e @ (KinesisError::NotFound(_) | KinesisError::Throttled(_))) => e.to_string(),
                Err(e) => return Err(e),
            };
            if !poll.pause().await {
                return Err(KinesisError::Other(
                    format!(
                        "stream {stream} not ACTIVE after {} s ({last})",
                        ACTIVE_WAIT.as_secs()
                    )
                    .into(),
                ));
            }
        }
    }

    /// The stream's ARN (the consumer calls need it).
    async fn stream_arn(&self, stream: &str) -> Result<String, KinesisError> {
        Some(self.describe_summary(stream).await?.stream_arn)
            .filter(|arn| !arn.is_empty())
            .ok_or_else(|| {
                KinesisError::Other(
                    format!("DescribeStreamSummary of {stream}: the answer has no stream ARN")
                        .into(),
                )
            })
    }

    /// The consumer's ARN and status, from DescribeStreamConsumer.
    async fn describe_consumer(
        &self,
        stream_arn: &str,
        name: &str,
    ) -> Result<(String, ConsumerStatus), KinesisError> {
        let out = self
            .client
            .describe_stream_consumer()
            .stream_arn(stream_arn)
            .consumer_name(name)
            .send()
            .await
            .map_err(|e| classify("DescribeStreamConsumer", e))?;
        out.consumer_description
            .map(|c| (c.consumer_arn, c.consumer_status))
            .ok_or_else(|| {
                KinesisError::Other(
                    format!(
                        "DescribeStreamConsumer {name}: the answer has no consumer description"
                    )
                    .into(),
                )
            })
    }
}

/// Classifies an SDK error by its service error code (see the module docs). `op` names the
/// operation for the message.
fn classify<E>(op: &str, err: SdkError<E>) -> KinesisError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let code = err.code().unwrap_or_default().to_owned();
    let message = err.message().unwrap_or_default().to_owned();
    let detail = ErrorDetail::from_aws(describe_sdk_error(op, &err), aws_error_of(op, &err));
    classify_code(op, &code, &message, detail)
}

/// What AWS answered to a failed call, for the error's `source()`: its code, message
/// and HTTP status, never the response body. Shared with the DynamoDB lease store.
pub(crate) fn aws_error_of<E>(op: &str, err: &SdkError<E>) -> AwsError
where
    E: ProvideErrorMetadata,
{
    AwsError::new(
        op,
        err.code().map(str::to_owned),
        err.message().map(str::to_owned),
        err.raw_response().map(|r| r.status().as_u16()),
    )
}

/// A one-line description of an SDK error for errors and logs: the operation, what failed,
/// the HTTP status if a response came, and the cause chain through [`DisplayErrorContext`].
///
/// It formats the error's *source*, never the `SdkError` itself: the latter's `Debug`
/// includes the raw HTTP response with its body, and the body of a GetRecords answer that
/// failed to parse holds record payloads, which must never reach a log. Shared with the
/// DynamoDB lease store.
pub(crate) fn describe_sdk_error<E>(op: &str, err: &SdkError<E>) -> String
where
    E: std::error::Error + 'static,
{
    let what = match err {
        SdkError::ConstructionFailure(_) => "the request could not be built",
        SdkError::TimeoutError(_) => "timed out",
        SdkError::DispatchFailure(_) => "the request could not be sent or got no answer",
        SdkError::ResponseError(_) => "the answer could not be read",
        SdkError::ServiceError(_) => "service error",
        _ => "failed",
    };
    let status = err
        .raw_response()
        .map(|response| format!(" (HTTP {})", response.status().as_u16()))
        .unwrap_or_default();
    match std::error::Error::source(err) {
        Some(source) => format!("{op}: {what}{status}: {}", DisplayErrorContext(source)),
        None => format!("{op}: {what}{status}"),
    }
}

/// The classification itself, on the code and message alone (unit-tested below).
fn classify_code(op: &str, code: &str, message: &str, text: ErrorDetail) -> KinesisError {
    match code {
        "ProvisionedThroughputExceededException"
        | "LimitExceededException"
        | "KMSThrottlingException"
        | "ThrottlingException" => KinesisError::Throttled(text),
        "ResourceInUseException" if op == "SubscribeToShard" => KinesisError::Throttled(text),
        "ExpiredIteratorException" => KinesisError::ExpiredIterator(text),
        "InvalidArgumentException"
            if op == "GetRecords" && message.to_ascii_lowercase().contains("iterator") =>
        {
            KinesisError::ExpiredIterator(text)
        }
        "ResourceNotFoundException" => KinesisError::NotFound(text),
        "AccessDeniedException" => KinesisError::AccessDenied(text),
        // An AT_TIMESTAMP later than the service's clock ("The timestampInMillis
        // parameter cannot be greater than the currentTimestampInMillis", from Kinesis
        // and kinesalite alike).
        "InvalidArgumentException"
            if message
                .to_ascii_lowercase()
                .contains("cannot be greater than the currenttimestamp") =>
        {
            KinesisError::FutureTimestamp(text)
        }
        "InvalidArgumentException" | "ValidationException" => KinesisError::Invalid(text),
        _ => KinesisError::Other(text),
    }
}

/// Classifies an error that arrived inside the SubscribeToShard event stream. Like
/// [`describe_sdk_error`], it formats only the error's source: the raw event message may
/// hold record payloads. Emulators (kinesis-local) send exceptions as event-stream
/// messages without an error code, so the code is also derived from the modeled variant.
fn classify_event_error<R>(
    err: SdkError<aws_sdk_kinesis::types::error::SubscribeToShardEventStreamError, R>,
) -> KinesisError
where
    R: std::fmt::Debug,
{
    use aws_sdk_kinesis::types::error::SubscribeToShardEventStreamError as Event;
    const OP: &str = "SubscribeToShard";
    let modeled = match err.as_service_error() {
        Some(Event::ResourceInUseException(_)) => "ResourceInUseException",
        Some(Event::ResourceNotFoundException(_)) => "ResourceNotFoundException",
        Some(Event::KmsThrottlingException(_)) => "KMSThrottlingException",
        _ => "",
    };
    let code = err.code().unwrap_or(modeled).to_owned();
    let message = err.message().unwrap_or_default().to_owned();
    let what = match &err {
        SdkError::TimeoutError(_) => "timed out",
        SdkError::DispatchFailure(_) => "the connection failed",
        SdkError::ResponseError(_) => "an event could not be read",
        SdkError::ServiceError(_) => "service error",
        _ => "failed",
    };
    let text = match std::error::Error::source(&err) {
        Some(source) => format!("{OP} event stream: {what}: {}", DisplayErrorContext(source)),
        None => format!("{OP} event stream: {what}"),
    };
    let aws = AwsError::new(
        OP,
        Some(code.clone()).filter(|c| !c.is_empty()),
        Some(message.clone()).filter(|m| !m.is_empty()),
        None,
    );
    classify_code(OP, &code, &message, ErrorDetail::from_aws(text, aws))
}

/// Maps a record of a GetRecords answer or a SubscribeToShard event.
fn record(op: &str, record: aws_sdk_kinesis::types::Record) -> Result<Record, KinesisError> {
    let aws_sdk_kinesis::types::Record {
        sequence_number,
        approximate_arrival_timestamp,
        data,
        partition_key,
        ..
    } = record;
    Ok(Record {
        sequence_number: parse_sequence(op, sequence_number)?,
        partition_key: partition_key.unwrap_or_default(),
        // The SDK deserialises into `Bytes`; this hands it over without a copy.
        data: data.into_bytes(),
        approximate_arrival: approximate_arrival_timestamp
            .and_then(|at| SystemTime::try_from(at).ok()),
    })
}

/// Maps one SubscribeToShard event. An absent or empty ContinuationSequenceNumber is the
/// end of a closed shard.
fn subscription_event(
    event: aws_sdk_kinesis::types::SubscribeToShardEvent,
) -> Result<SubscriptionEvent, KinesisError> {
    const OP: &str = "SubscribeToShard";
    let aws_sdk_kinesis::types::SubscribeToShardEvent {
        records,
        continuation_sequence_number,
        millis_behind_latest,
        child_shards,
        ..
    } = event;
    Ok(SubscriptionEvent {
        records: records
            .into_iter()
            .map(|r| record(OP, r))
            .collect::<Result<_, _>>()?,
        continuation: Some(continuation_sequence_number)
            .filter(|c| !c.is_empty())
            .map(|c| parse_sequence(OP, c))
            .transpose()?,
        millis_behind_latest: Some(millis_behind_latest),
        child_shards: child_shards
            .unwrap_or_default()
            .into_iter()
            .map(|child| child.shard_id)
            .collect(),
    })
}

/// Parses a hash key (a decimal string below 2^128).
fn parse_hash_key(shard_id: &str, which: &str, value: &str) -> Result<u128, KinesisError> {
    value.parse::<u128>().map_err(|e| {
        KinesisError::Other(
            format!("ListShards: shard {shard_id} has an invalid {which} hash key {value:?}: {e}")
                .into(),
        )
    })
}

/// Parses a sequence number the service sent.
fn parse_sequence(op: &str, value: String) -> Result<SequenceNumber, KinesisError> {
    SequenceNumber::new(value)
        .map_err(|e| KinesisError::Other(format!("{op}: invalid sequence number: {e}").into()))
}

/// Maps one shard of a ListShards answer.
fn shard_info(shard: aws_sdk_kinesis::types::Shard) -> Result<ShardInfo, KinesisError> {
    let aws_sdk_kinesis::types::Shard {
        shard_id,
        parent_shard_id,
        adjacent_parent_shard_id,
        hash_key_range,
        sequence_number_range,
        ..
    } = shard;
    let range = hash_key_range.ok_or_else(|| {
        KinesisError::Other(format!("ListShards: shard {shard_id} has no hash key range").into())
    })?;
    let sequences = sequence_number_range.ok_or_else(|| {
        KinesisError::Other(
            format!("ListShards: shard {shard_id} has no sequence number range").into(),
        )
    })?;
    Ok(ShardInfo {
        starting_hash_key: parse_hash_key(&shard_id, "starting", &range.starting_hash_key)?,
        ending_hash_key: parse_hash_key(&shard_id, "ending", &range.ending_hash_key)?,
        starting_sequence_number: parse_sequence("ListShards", sequences.starting_sequence_number)?,
        ending_sequence_number: sequences
            .ending_sequence_number
            .map(|s| parse_sequence("ListShards", s))
            .transpose()?,
        shard_id,
        parent_shard_id,
        adjacent_parent_shard_id,
    })
}

#[async_trait]
impl KinesisApi for AwsKinesis {
    async fn list_shards(&self, stream: &str) -> Result<Vec<ShardInfo>, KinesisError> {
        let mut shards = Vec::new();
        let mut next_token: Option<String> = None;
        loop {
            // The API refuses StreamName together with NextToken: the first page is asked
            // for by name, every following one by the token alone.
            let request = match next_token.take() {
                None => self.client.list_shards().stream_name(stream),
                Some(token) => self.client.list_shards().next_token(token),
            };
            let out = request
                .send()
                .await
                .map_err(|e| classify("ListShards", e))?;
            for shard in out.shards.unwrap_or_default() {
                shards.push(shard_info(shard)?);
            }
            match out.next_token {
                Some(token) if !token.is_empty() => next_token = Some(token),
                _ => return Ok(shards),
            }
        }
    }

    async fn is_updating(&self, stream: &str) -> Result<bool, KinesisError> {
        Ok(self.stream_status(stream).await? == StreamStatus::Updating)
    }

    async fn stream_identity(&self, stream: &str) -> Result<StreamIdentity, KinesisError> {
        let summary = self.describe_summary(stream).await?;
        let created = SystemTime::try_from(summary.stream_creation_timestamp).map_err(|e| {
            KinesisError::Other(format!("stream {stream}: creation time: {e}").into())
        })?;
        StreamIdentity::from_description(stream, &summary.stream_arn, created)
    }

    async fn max_record_size(&self, stream: &str) -> Result<usize, KinesisError> {
        let summary = self.describe_summary(stream).await?;
        // Absent from answers of services (and emulators) older than large records: the
        // default then holds. A figure outside the documented range is taken within it.
        Ok(match summary.max_record_size_in_kib() {
            Some(kib) => usize::try_from(kib)
                .unwrap_or(0)
                .saturating_mul(1024)
                .clamp(MAX_RECORD_BYTES, MAX_LARGE_RECORD_BYTES),
            None => MAX_RECORD_BYTES,
        })
    }

    async fn shard_iterator(
        &self,
        stream: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<String, KinesisError> {
        let request = self
            .client
            .get_shard_iterator()
            .stream_name(stream)
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
                .starting_sequence_number(seq.as_str()),
            StartingPosition::AfterSequenceNumber(seq) => request
                .shard_iterator_type(ShardIteratorType::AfterSequenceNumber)
                .starting_sequence_number(seq.as_str()),
        };
        let out = request
            .send()
            .await
            .map_err(|e| classify("GetShardIterator", e))?;
        out.shard_iterator.ok_or_else(|| {
            KinesisError::Other(
                format!("GetShardIterator for {stream}/{shard_id}: the answer has no iterator")
                    .into(),
            )
        })
    }

    /// `limit` is clamped to 1..=10,000, the range GetRecords accepts.
    async fn get_records(&self, iterator: &str, limit: u32) -> Result<RecordsPage, KinesisError> {
        let limit = limit.clamp(1, MAX_GET_RECORDS_LIMIT);
        let out = self
            .client
            .get_records()
            .shard_iterator(iterator)
            // Cannot fail: `limit` is at most 10,000 after the clamp above.
            .limit(i32::try_from(limit).unwrap_or(i32::MAX))
            .send()
            .await
            .map_err(|e| classify("GetRecords", e))?;
        let records = out
            .records
            .into_iter()
            .map(|r| record("GetRecords", r))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RecordsPage {
            records,
            next_iterator: out.next_shard_iterator.filter(|it| !it.is_empty()),
            millis_behind_latest: out.millis_behind_latest,
            child_shards: out
                .child_shards
                .unwrap_or_default()
                .into_iter()
                .map(|child| child.shard_id)
                .collect(),
        })
    }

    /// An empty `records` is answered with an empty outcome list without a call (the
    /// service refuses empty batches); more than 500 records are refused by the service
    /// as [`KinesisError::Invalid`].
    async fn put_records(
        &self,
        stream: &str,
        records: &[PutRecord],
    ) -> Result<Vec<PutOutcome>, KinesisError> {
        if records.is_empty() {
            return Ok(Vec::new());
        }
        let mut entries = Vec::with_capacity(records.len());
        for record in records {
            let entry = PutRecordsRequestEntry::builder()
                // `Bytes` is shared, not copied.
                .data(Blob::from_maybe_shared(record.data.clone()))
                .partition_key(record.partition_key.clone())
                .set_explicit_hash_key(record.explicit_hash_key.clone())
                .build()
                .map_err(|e| {
                    KinesisError::Invalid(format!("PutRecords: {}", DisplayErrorContext(&e)).into())
                })?;
            entries.push(entry);
        }
        let out = self
            .client
            .put_records()
            .stream_name(stream)
            .set_records(Some(entries))
            .send()
            .await
            .map_err(|e| classify("PutRecords", e))?;
        if out.records.len() != records.len() {
            return Err(KinesisError::Other(
                format!(
                    "PutRecords to {stream}: sent {} records, the answer has {} results",
                    records.len(),
                    out.records.len()
                )
                .into(),
            ));
        }
        out.records
            .into_iter()
            .map(
                |entry| match (entry.error_code, entry.shard_id, entry.sequence_number) {
                    (None, Some(shard_id), Some(sequence)) => Ok(PutOutcome::Stored {
                        shard_id,
                        sequence_number: parse_sequence("PutRecords", sequence)?,
                    }),
                    (code, _, _) => Ok(PutOutcome::Failed {
                        code: code.unwrap_or_else(|| "MissingResult".to_owned()),
                        message: entry.error_message.unwrap_or_default(),
                    }),
                },
            )
            .collect()
    }

    /// Describes the consumer first and registers it only if it does not exist, then
    /// polls DescribeStreamConsumer until it is ACTIVE (at most two minutes). A consumer
    /// being deleted is waited out and registered again.
    async fn register_consumer(&self, stream: &str, name: &str) -> Result<String, KinesisError> {
        let stream_arn = self.stream_arn(stream).await?;
        let mut poll = DeadlinePoll::new(
            CONSUMER_ACTIVE_WAIT,
            Duration::from_millis(100),
            Duration::from_secs(2),
        );
        loop {
            let last = match self.describe_consumer(&stream_arn, name).await {
                Ok((arn, ConsumerStatus::Active)) => return Ok(arn),
                Ok((_, status)) => format!("status {}", status.as_str()),
                Err(KinesisError::NotFound(_)) => {
                    match self
                        .client
                        .register_stream_consumer()
                        .stream_arn(&stream_arn)
                        .consumer_name(name)
                        .send()
                        .await
                    {
                        Ok(out) => match out.consumer {
                            Some(c) if c.consumer_status == ConsumerStatus::Active => {
                                return Ok(c.consumer_arn)
                            }
                            Some(c) => format!("registered, status {}", c.consumer_status.as_str()),
                            None => "registered".to_owned(),
                        },
                        // Registered meanwhile by another worker (or still being deleted).
                        Err(e) if e.code() == Some("ResourceInUseException") => {
                            "being registered or deleted elsewhere".to_owned()
                        }
                        Err(e) => match classify("RegisterStreamConsumer", e) {
                            e @ KinesisError::Throttled(_) => e.to_string(),
                            e => return Err(e),
                        },
                    }
                }
                Err(e @ KinesisError::Throttled(_)) => e.to_string(),
                Err(e) => return Err(e),
            };
            tracing::debug!(consumer = name, %last, "waiting for the stream consumer to be ACTIVE");
            if !poll.pause().await {
                return Err(KinesisError::Other(
                    format!(
                        "stream consumer {name} of {stream} not ACTIVE after {} s ({last})",
                        CONSUMER_ACTIVE_WAIT.as_secs()
                    )
                    .into(),
                ));
            }
        }
    }

    /// Events whose record list fails to map (an invalid sequence number) end the
    /// subscription with that error; unknown event types are skipped.
    async fn subscribe_to_shard(
        &self,
        consumer_arn: &str,
        shard_id: &str,
        from: &StartingPosition,
    ) -> Result<Subscription, KinesisError> {
        use aws_sdk_kinesis::types::StartingPosition as Start;
        let start = match from {
            StartingPosition::TrimHorizon => {
                Start::builder().r#type(ShardIteratorType::TrimHorizon)
            }
            StartingPosition::Latest => Start::builder().r#type(ShardIteratorType::Latest),
            StartingPosition::AtTimestamp(at) => Start::builder()
                .r#type(ShardIteratorType::AtTimestamp)
                .timestamp(DateTime::from(*at)),
            StartingPosition::AtSequenceNumber(seq) => Start::builder()
                .r#type(ShardIteratorType::AtSequenceNumber)
                .sequence_number(seq.as_str()),
            StartingPosition::AfterSequenceNumber(seq) => Start::builder()
                .r#type(ShardIteratorType::AfterSequenceNumber)
                .sequence_number(seq.as_str()),
        }
        .build()
        .map_err(|e| {
            KinesisError::Invalid(format!("SubscribeToShard: {}", DisplayErrorContext(&e)).into())
        })?;
        let out = self
            .client
            .subscribe_to_shard()
            .consumer_arn(consumer_arn)
            .shard_id(shard_id)
            .starting_position(start)
            .send()
            .await
            .map_err(|e| classify("SubscribeToShard", e))?;
        let events = futures_util::stream::unfold(Some(out.event_stream), |receiver| async move {
            let mut receiver = receiver?;
            loop {
                match receiver.recv().await {
                    Ok(Some(SubscribeToShardEventStream::SubscribeToShardEvent(event))) => {
                        return match subscription_event(event) {
                            Ok(event) => Some((Ok(event), Some(receiver))),
                            Err(e) => Some((Err(e), None)),
                        };
                    }
                    // Not logged with its content: a future event type may carry records.
                    Ok(Some(_)) => tracing::debug!("SubscribeToShard: skipped an unknown event"),
                    Ok(None) => return None,
                    Err(e) => return Some((Err(classify_event_error(e)), None)),
                }
            }
        });
        Ok(Box::pin(events))
    }
}

#[async_trait]
impl StreamAdmin for AwsKinesis {
    async fn create_stream(&self, stream: &str, shards: u32) -> Result<(), KinesisError> {
        let shard_count = i32::try_from(shards).map_err(|_| {
            KinesisError::Invalid(
                format!("CreateStream {stream}: {shards} shards is too many").into(),
            )
        })?;
        match self
            .client
            .create_stream()
            .stream_name(stream)
            .shard_count(shard_count)
            .send()
            .await
        {
            Ok(_) => {}
            Err(e) if e.code() == Some("ResourceInUseException") => {
                tracing::debug!(stream, "CreateStream: the stream exists already");
            }
            Err(e) => return Err(classify("CreateStream", e)),
        }
        self.wait_until_active(stream).await
    }
    async fn split_shard(
        &self,
        stream: &str,
        shard_id: &str,
        new_starting_hash_key: u128,
    ) -> Result<(), KinesisError> {
        self.client
            .split_shard()
            .stream_name(stream)
            .shard_to_split(shard_id)
            .new_starting_hash_key(new_starting_hash_key.to_string())
            .send()
            .await
            .map_err(|e| classify("SplitShard", e))?;
        self.wait_until_active(stream).await
    }
    async fn merge_shards(
        &self,
        stream: &str,
        shard_id: &str,
        adjacent_shard_id: &str,
    ) -> Result<(), KinesisError> {
        self.client
            .merge_shards()
            .stream_name(stream)
            .shard_to_merge(shard_id)
            .adjacent_shard_to_merge(adjacent_shard_id)
            .send()
            .await
            .map_err(|e| classify("MergeShards", e))?;
        self.wait_until_active(stream).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kind(op: &str, code: &str, message: &str) -> KinesisError {
        classify_code(op, code, message, ErrorDetail::new(""))
    }

    #[test]
    fn classifies_service_errors_by_what_the_caller_should_do() {
        for code in [
            "ProvisionedThroughputExceededException",
            "LimitExceededException",
            "KMSThrottlingException",
        ] {
            assert!(matches!(
                kind("GetRecords", code, ""),
                KinesisError::Throttled(_)
            ));
        }
        assert!(matches!(
            kind(
                "GetRecords",
                "ExpiredIteratorException",
                "Iterator expired."
            ),
            KinesisError::ExpiredIterator(_)
        ));
        assert!(matches!(
            kind(
                "GetRecords",
                "InvalidArgumentException",
                "Invalid ShardIterator."
            ),
            KinesisError::ExpiredIterator(_)
        ));
        // Outside GetRecords an invalid argument is the caller's mistake.
        assert!(matches!(
            kind(
                "GetShardIterator",
                "InvalidArgumentException",
                "bad ShardIteratorType"
            ),
            KinesisError::Invalid(_)
        ));
        assert!(matches!(
            kind("GetRecords", "InvalidArgumentException", "Limit too large"),
            KinesisError::Invalid(_)
        ));
        // An AT_TIMESTAMP ahead of the service's clock: the same call works later.
        assert!(matches!(
            kind(
                "GetShardIterator",
                "InvalidArgumentException",
                "The timestampInMillis parameter cannot be greater than the \
                 currentTimestampInMillis. timestampInMillis: 1700000060000, \
                 currentTimestampInMillis: 1700000000000"
            ),
            KinesisError::FutureTimestamp(_)
        ));
        assert!(matches!(
            kind("ListShards", "ResourceNotFoundException", ""),
            KinesisError::NotFound(_)
        ));
        // Another subscription of the consumer to the shard is still open: wait and retry.
        assert!(matches!(
            kind("SubscribeToShard", "ResourceInUseException", ""),
            KinesisError::Throttled(_)
        ));
        assert!(matches!(
            kind("SubscribeToShard", "LimitExceededException", ""),
            KinesisError::Throttled(_)
        ));
        assert!(matches!(kind("GetRecords", "", ""), KinesisError::Other(_)));
        assert!(matches!(
            kind("GetRecords", "InternalFailure", ""),
            KinesisError::Other(_)
        ));
    }
}
