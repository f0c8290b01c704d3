//! The outbound adapter: a [`tower::Service`] that writes records to a Kinesis stream
//! with batched PutRecords calls.
//!
//! ```
//! use shardflow::kinesis::StreamAdmin;
//! use shardflow::producer::{Producer, ProducerRecord};
//! use shardflow::Memory;
//! use tower::{Service, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let memory = Memory::new();
//! memory.streams().create_stream("orders", 4).await?;
//!
//! let mut producer = Producer::builder()
//!     .stream("orders")
//!     .backend(memory.clone())      // or Aws::from_env().await
//!     .ordered_per_key(true)        // keep each customer's records in order
//!     .build()?;
//!
//! // As a tower Service (poll_ready waits while the last call's shard is full) ...
//! let stored = producer
//!     .ready()
//!     .await?
//!     .call(ProducerRecord::new("{\"total\":42}", "customer-7"))
//!     .await?;
//! println!("stored in {} at {}", stored.shard_id, stored.sequence_number);
//!
//! // ... or directly.
//! producer.send(ProducerRecord::new("{\"total\":7}", "customer-7")).await?;
//!
//! producer.close().await; // writes everything still buffered, then stops
//! # Ok(())
//! # }
//! ```
//!
//! # How records travel
//!
//! Every handle (the `Producer` is `Clone`) feeds one background task. `call` checks
//! the record first — at most the stream's maximum record size of payload
//! plus partition key ([`ProduceError::TooLarge`]), a partition key of 1 to 256 characters, an explicit
//! hash key that is a decimal number below 2^128 ([`ProduceError::InvalidRecord`]) — so
//! a record Kinesis would refuse is never sent.
//!
//! # Large records
//!
//! Every stream takes records of up to 1 MiB ([`MAX_RECORD_BYTES`]); a stream set for
//! larger ones (`UpdateMaxRecordSize`) up to 10 MiB ([`MAX_LARGE_RECORD_BYTES`]). The
//! producer takes the stream's figure from
//! [`ProducerBuilder::max_record_size`] or, unset, reads it from the stream
//! (DescribeStreamSummary) the first time a record above 1 MiB needs it
//! ([`Producer::max_record_size`]). A record above the batch byte limit goes in a
//! PutRecords call of its own (a call takes up to 10 MiB), never in an aggregate. The
//! shard's write rate does not grow with the record size: Kinesis lets a shard take an
//! occasional large record as a burst and then holds it to 1 MiB per second on
//! average, and the producer's per-shard budget does the same (a 9 MiB record uses up
//! about nine seconds of a shard's writes).
//!
//! The producer holds a bounded number of records *per shard* (taken, in flight or
//! waiting for a resend): [`buffer`](ProducerBuilder::buffer) plus a batch per call in
//! flight and one filling, by default 12,500 (260,000 when aggregating). It predicts each
//! record's shard from the map it lists (see below); a record whose shard is full, or
//! has records waiting already, waits in that shard's line, in the order it was handed
//! over, and goes on as that shard's records are answered. A record of another shard
//! never waits behind that line: a hot shard costs memory up to its bound, never
//! latency elsewhere. A caller is held back through `poll_ready`, which is pending
//! while the shard of the handle's last call has no room (the next record most likely
//! goes there too; records of one line then wait in their callers' futures, a `send`
//! in its caller). Without a shard map (no aggregation and no rate limit, or before
//! the first listing) all records share one line.
//!
//! The task groups records into PutRecords calls of at most 500 records and 5 MiB
//! (both configurable downwards), counted as Kinesis counts them (data plus partition
//! key of each entry) and measured from the encoding as records are added, aggregated
//! or not: a call never passes either limit, whatever the sizes, keys and explicit hash
//! keys. A call goes as soon as a batch is full, or when its
//! oldest record has waited the *linger* (50 ms by default), and up to `max_in_flight`
//! calls run at once.
//!
//! # Failures and retries
//!
//! PutRecords can store some entries and refuse others (a *partial failure*, typically
//! `ProvisionedThroughputExceededException` on a hot shard). Only the refused entries
//! are sent again, after an exponential backoff with jitter, each up to `max_attempts`
//! times; a record that never gets in resolves to [`ProduceError::Failed`] with the
//! last error code. When the whole call fails with a transient error (throttling, a
//! network or service error) every record of the batch is resent, and all sending
//! pauses for a backoff that grows while calls keep failing. Permanent errors (the
//! stream does not exist, the request is invalid, KMS access is denied) fail the
//! records at once.
//!
//! A resend happens when an earlier attempt was not acknowledged; if that attempt did
//! land (an answer lost on the network), the record is stored twice. As with every
//! Kinesis producer, delivery is at least once; consumers that need exactly-once use
//! the dedup layer.
//!
//! # Order
//!
//! By default records are sent in the order they arrive, but a resent record lands
//! after records that arrived later, and concurrent calls may land in any order. With
//! [`ordered_per_key(true)`](ProducerBuilder::ordered_per_key) the records of one
//! partition key are stored in the order they entered the producer, retries included:
//! at most one record per key is in flight (or waiting for a resend) at a time, and the
//! next record of that key goes only after the previous one was answered. Different
//! keys still share batches, so many keys lose nothing; one hot key gets one record per
//! round trip. If a record finally fails, the records of its key already waiting
//! behind it fail too, unsent, with [`ProduceError::AfterFailure`]: a key never has a
//! record stored ahead of one before it that was not stored, so writing the failed
//! records again (a redelivered input) keeps the key's order. Records of the key that
//! arrive after the failure was answered go on as usual. [`Producer::send_all`] hands
//! over several records at once, so that all of them wait behind each other before
//! any can fail.
//!
//! # Aggregation
//!
//! A shard takes 1,000 records/s or 1 MiB/s, whichever comes first: with records of a
//! few hundred bytes the record count is the wall. With
//! [`aggregate(true)`](ProducerBuilder::aggregate) the producer packs many user records
//! into each Kinesis record in the KPL's format (magic, protobuf, MD5; see
//! [`aggregation`](crate::aggregation)), so a shard takes up to its byte limit, and
//! PutRecords is billed per 25 KB payload unit instead of per record. The defaults are
//! the KPL's ([`Aggregation`]): aggregates of at most 51,200 bytes.
//!
//! Records are packed only with records that land in the same shard: the producer lists
//! the stream's shards (ListShards) and predicts each record's shard from its hash key
//! (the MD5 of its partition key, or its own explicit hash key). Each aggregate goes
//! with an explicit hash key inside its shard's range (its first user record's), and
//! keeps every user record's partition key and explicit hash key, so a consumer sees
//! each user record as it was sent. The map is listed again every minute, and at once
//! when a record falls in no known range or an aggregate lands in another shard than
//! predicted (the stream was resharded); a record that cannot be placed goes alone.
//! A record too large to share an aggregate goes alone as a plain record; nothing
//! larger than the stream's record limit is ever sent (the framing counts).
//!
//! Every call still resolves with where its record is: the shard, the sequence number
//! of the Kinesis record holding it and its [`sub_sequence_number`](Stored) in it (0
//! for a record sent alone), the position a consumer reads it at. An aggregate that is
//! refused is resent as the user records it held (each counts an attempt, and may be
//! packed with others on the resend); each caller gets its own record's outcome.
//! `ordered_per_key` holds as without aggregation.
//!
//! What it costs: a record waits up to the linger for others to share its aggregate
//! (without aggregation too), a little CPU to encode, and a consumer that reads
//! aggregates (every KCL, the KPL's de-aggregation libraries and shardflow do). If
//! ListShards fails before a first map exists, records go unaggregated until it works.
//!
//! # Riding the shard's limit
//!
//! A producer faster than a shard would collect refusals
//! (`ProvisionedThroughputExceededException`) and resend them after a backoff. So by
//! default it keeps, per shard, a budget of 150 % of the shard's 1,000 records/s and
//! 1 MiB/s ([`rate_limit(percent)`](ProducerBuilder::rate_limit) changes the share,
//! [`no_rate_limit`](ProducerBuilder::no_rate_limit) turns it off): a token bucket of one
//! second on tokio's clock, where an aggregate counts as one record. The records of a
//! shard over budget wait in the producer, in their place, while other shards' records go
//! on: each shard has its own queue, and a call passes over a shard without budget in
//! one step, however many records it holds. An entry refused for throughput anyway (other producers write to the shard too)
//! empties that shard's budget only. 150 % is the KPL's default: above the quota, to
//! absorb the imprecision of Kinesis' meter; 100 leaves a shard's only writer almost
//! never refused. The budget needs the shard map, so the producer lists the stream's
//! shards before its first call (as for aggregation); if ListShards fails, records go
//! unlimited until it works.
//!
//! # Shutting down
//!
//! [`Producer::flush`] waits until every record handed over before it was answered.
//! [`Producer::close`] stops accepting records (on every handle), writes what is
//! buffered and returns once all of it was answered.
//!
//! One rule for stopping, the same for consumers and producers: an explicit stop
//! (`shutdown().await` on a consumer, `close().await` on a producer) finishes what was
//! started and returns once it is done; dropping the handle (for a producer, its last
//! clone) starts the same stop in the background, which nobody can wait for and which
//! completes only while the tokio runtime is still running.
//!
//! # As a dead-letter sink
//!
//! A producer for another stream ([`Producer::for_stream`]) becomes the sink of the
//! `shardflow-middleware` crate's dead-letter and bisect layers through its
//! `ProducerSink` adapter (`ProducerSink::new(producer.for_stream("orders-dlq")?)`),
//! which writes each dead letter as an envelope (where the record came from, its error,
//! its exact payload) under the record's own partition key; `shardflow stream tail`
//! decodes those envelopes and `shardflow dlq replay` writes them back. The producer
//! itself stays a `Service` of [`ProducerRecord`] only.

mod builder;
mod future;
mod gate;
mod limit;
mod record;
mod shards;
mod worker;

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio::sync::{mpsc, oneshot, watch};

use crate::error::ConfigError;
use crate::kinesis::PutRecord;

pub use builder::{
    Aggregation, ProducerBuilder, DEFAULT_AGGREGATE_BYTES, DEFAULT_AGGREGATE_RECORDS,
    MAX_BATCH_BYTES, MAX_BATCH_RECORDS,
};
pub use future::ResponseFuture;
pub use record::{
    InvalidRecord, ProduceError, ProducerRecord, Stored, MAX_LARGE_RECORD_BYTES,
    MAX_PARTITION_KEY_CHARS, MAX_RECORD_BYTES,
};

use builder::Settings;
use gate::{Command, Gate, Handed, Line};
use limit::RecordLimit;
use worker::Worker;

/// Writes records to one Kinesis stream in batches; a `tower::Service` whose calls
/// resolve to the shard and sequence number each record got. Cheap to clone: clones
/// share the buffer and the background task. See the [module docs](self).
#[derive(Clone)]
pub struct Producer {
    /// Where records enter, each counted against its shard's room.
    gate: Arc<Gate>,
    /// Closes the producer when the last handle is dropped.
    _handles: Arc<Handles>,
    /// The line of this handle's last call: `poll_ready` waits while it has no room.
    last_line: Option<Line>,
    /// Becomes true (or its sender is dropped) when the background task has stopped.
    done: watch::Receiver<bool>,
    settings: Arc<Settings>,
    /// Whether this handle writes payloads exactly as given ([`Producer::raw`]).
    raw: bool,
    /// The largest record the stream takes (shared by the clones).
    limit: Arc<RecordLimit>,
}

/// Shared by every clone of one producer; the last one dropped starts the stop.
struct Handles {
    gate: Arc<Gate>,
}

impl Drop for Handles {
    fn drop(&mut self) {
        self.gate.close();
    }
}

impl Producer {
    /// Starts building a producer.
    pub fn builder() -> ProducerBuilder {
        ProducerBuilder::default()
    }

    pub(crate) fn spawn(settings: Settings, runtime: &tokio::runtime::Handle) -> Self {
        let (sender, rx) = mpsc::unbounded_channel();
        let (done_tx, done) = watch::channel(false);
        let gate = Arc::new(Gate::new(
            sender,
            settings.room_per_shard(),
            settings.ordered_per_key,
        ));
        let settings = Arc::new(settings);
        let limit = Arc::new(RecordLimit::new(
            settings.stream.clone(),
            settings.kinesis.clone(),
            settings.max_record_size,
        ));
        runtime.spawn(Worker::new(Settings::clone(&settings), rx, gate.clone()).run(done_tx));
        Producer {
            _handles: Arc::new(Handles { gate: gate.clone() }),
            gate,
            last_line: None,
            done,
            settings,
            raw: false,
            limit,
        }
    }

    /// A handle to this producer (the same buffer, task and settings) that writes each
    /// record's payload exactly as given: no headers framed into it and no trace context
    /// added, whatever [`embed_headers`](ProducerBuilder::embed_headers) says (a record's
    /// headers are not written). For data in a format of its own that carries its
    /// headers inside, such as a dead-letter envelope: a frame around it would hide the
    /// format from its readers and push a record at the size limit over it. Such data
    /// must not look like a Spring frame to the stream's readers (see
    /// [`may_be_taken_for_a_frame`](crate::headers::spring::may_be_taken_for_a_frame)),
    /// or they read it with [`HeaderFormat::None`](crate::HeaderFormat::None).
    pub fn raw(&self) -> Producer {
        Producer {
            raw: true,
            ..self.clone()
        }
    }

    /// Whether this handle writes payloads exactly as given ([`Producer::raw`]).
    pub fn is_raw(&self) -> bool {
        self.raw
    }

    /// The stream this producer writes to.
    pub fn stream(&self) -> &str {
        &self.settings.stream
    }

    /// A producer with the same backend and settings for another stream (e.g. a
    /// dead-letter stream), with its own buffer and background task. Must be called
    /// inside a tokio runtime. The other stream's maximum record size is its own: read
    /// from it when needed, not taken from
    /// [`ProducerBuilder::max_record_size`].
    pub fn for_stream(&self, stream: impl Into<String>) -> Result<Producer, ConfigError> {
        let stream = stream.into();
        builder::validate_stream_name(&stream)?;
        let runtime = tokio::runtime::Handle::try_current().map_err(|_| ConfigError::Invalid {
            field: "build",
            reason: "must be called inside a tokio runtime".into(),
        })?;
        let mut settings = Settings::clone(&self.settings);
        settings.stream = stream.into();
        settings.seed = rand::random();
        settings.max_record_size = None;
        Ok(Producer::spawn(settings, &runtime))
    }

    /// The largest record the stream takes, in bytes of payload plus partition key:
    /// [`ProducerBuilder::max_record_size`] when set, else the stream's own figure,
    /// read once (DescribeStreamSummary; [`MAX_RECORD_BYTES`] from a backend that
    /// cannot tell). Records up to [`MAX_RECORD_BYTES`] never wait for it; calling this
    /// first makes a larger record's check immediate. Fails
    /// ([`ProduceError::Failed`]) when the stream's figure cannot be read now.
    pub async fn max_record_size(&self) -> Result<usize, ProduceError> {
        self.limit.get().await
    }

    /// What every way in does to a record before it enters the producer: its headers
    /// framed into the payload (and, with the `opentelemetry` feature, the current trace
    /// context added) unless this handle is [`raw`](Producer::raw), then its size checked
    /// against Kinesis' limits, up to the largest any stream takes (the stream's own limit
    /// is [`RecordLimit`]'s to check). Returns the record as sent and its size.
    fn prepare(&self, record: ProducerRecord) -> Result<(PutRecord, usize), ProduceError> {
        let record = record.embedded(self.settings.embed_headers && !self.raw)?;
        let size = record.validate(MAX_LARGE_RECORD_BYTES)?;
        Ok((record.into_put_record(), size))
    }

    /// A prepared record as the gate takes it, and where its answer comes.
    fn handed(
        &self,
        record: PutRecord,
        size: usize,
    ) -> (Handed, oneshot::Receiver<Result<Stored, ProduceError>>) {
        let (reply, answer) = oneshot::channel();
        let key = self.gate.key_of(&record);
        let handed = Handed {
            record,
            size,
            reply,
            key,
        };
        (handed, answer)
    }

    /// Writes one record: hands it over at once (it waits in its shard's line if that
    /// shard has no room), then waits for Kinesis' answer. Like
    /// `ready().await?.call(record).await`, without needing `&mut self`.
    pub async fn send(&self, record: ProducerRecord) -> Result<Stored, ProduceError> {
        let (record, size) = self.prepare(record)?;
        self.limit.admit(size).await?;
        let (handed, answer) = self.handed(record, size);
        self.gate.submit(vec![handed])?;
        answer.await.unwrap_or(Err(ProduceError::Closed))
    }

    /// Writes several records handed over together (a processor's outputs) and returns
    /// each one's answer, in order. They are handed over in one step: those whose shard
    /// has room enter the producer together, the others wait in their shards' lines. A record refused before sending (too large, invalid) is
    /// answered with its error and every record after it with
    /// [`ProduceError::AfterFailure`], none of those sent. With
    /// [`ordered_per_key(true)`](ProducerBuilder::ordered_per_key) each key's records are
    /// stored in the order given, and when one finally fails the records of its key
    /// after it are not sent either ([`ProduceError::AfterFailure`]): nothing of a key is
    /// stored ahead of a record that failed, so writing the same records again later
    /// keeps the key's order. Records of other keys are independent of the failure.
    pub async fn send_all(
        &self,
        records: impl IntoIterator<Item = ProducerRecord>,
    ) -> Vec<Result<Stored, ProduceError>> {
        let mut commands = Vec::new();
        let mut answers = Vec::new();
        let mut refused: Option<ProduceError> = None;
        for record in records {
            if let Some(cause) = &refused {
                answers.push(Err(ProduceError::AfterFailure(Box::new(cause.clone()))));
                continue;
            }
            let prepared = match self.prepare(record) {
                Ok((record, size)) => self.limit.admit(size).await.map(|()| (record, size)),
                Err(error) => Err(error),
            };
            match prepared {
                Ok((record, size)) => {
                    let (handed, answer) = self.handed(record, size);
                    commands.push(handed);
                    answers.push(Ok(answer));
                }
                Err(error) => {
                    refused = Some(error.clone());
                    answers.push(Err(error));
                }
            }
        }
        let sent = commands.is_empty() || self.gate.submit(commands).is_ok();
        let mut results = Vec::with_capacity(answers.len());
        for answer in answers {
            results.push(match answer {
                Ok(answer) if sent => answer.await.unwrap_or(Err(ProduceError::Closed)),
                Ok(_) => Err(ProduceError::Closed),
                Err(error) => Err(error),
            });
        }
        results
    }

    /// Sends everything buffered now (without waiting for the linger) and returns once
    /// every record handed over before this call has been answered, stored or failed.
    pub async fn flush(&self) {
        let (waiter, flushed) = oneshot::channel();
        if self.gate.flush(Command::Flush(waiter)).is_ok() && flushed.await.is_ok() {
            return;
        }
        // Closed: the task answers everything it took before it stops.
        self.stopped().await;
    }

    /// Stops accepting records on every handle (they fail with
    /// [`ProduceError::Closed`]), writes everything buffered and returns once all of
    /// it was answered and the background task stopped.
    pub async fn close(&self) {
        // Closed already: just wait for the end.
        self.gate.close();
        self.stopped().await;
    }

    /// Whether the producer keeps each partition key's records in order
    /// ([`ProducerBuilder::ordered_per_key`]): a caller that hands over several records
    /// of one key at once (a processor's outputs) may then do so without waiting for
    /// each answer.
    pub fn is_ordered_per_key(&self) -> bool {
        self.settings.ordered_per_key
    }

    /// Whether the producer no longer accepts records.
    pub fn is_closed(&self) -> bool {
        self.gate.is_closed()
    }

    async fn stopped(&self) {
        let mut done = self.done.clone();
        // An error means the task is gone (its sender dropped): stopped as well.
        let _ = done.wait_for(|stopped| *stopped).await;
    }
}

impl fmt::Debug for Producer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Producer")
            .field("stream", &self.settings.stream)
            .field("closed", &self.is_closed())
            .finish()
    }
}

impl tower::Service<ProducerRecord> for Producer {
    type Response = Stored;
    type Error = ProduceError;
    type Future = ResponseFuture;

    /// Ready unless the shard of this handle's last call has no room (its records
    /// fill their share of the producer, or some wait for it): the next record most
    /// likely goes there too. [`ProduceError::Closed`] once the producer is closed.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), ProduceError>> {
        if self.gate.is_closed() {
            return Poll::Ready(Err(ProduceError::Closed));
        }
        match &self.last_line {
            Some(line) if !self.gate.has_room(line, cx.waker()) => Poll::Pending,
            _ => Poll::Ready(Ok(())),
        }
    }

    /// Hands the record over at once: it goes on, or waits in line behind the earlier
    /// records of its shard (never behind another shard's), inside the response future.
    fn call(&mut self, record: ProducerRecord) -> ResponseFuture {
        let (record, size) = match self.prepare(record) {
            Ok(ready) => ready,
            Err(refused) => return ResponseFuture::failed(refused),
        };
        match self.limit.admit_now(size) {
            Some(Ok(())) => {}
            Some(Err(refused)) => return ResponseFuture::failed(refused),
            None => {
                // Above 1 MiB before the stream's limit is known: the record is handed
                // over once it is (records handed over meanwhile may go first).
                let this = self.clone();
                return ResponseFuture::sending(async move {
                    this.limit.admit(size).await?;
                    let (handed, answer) = this.handed(record, size);
                    this.gate.submit(vec![handed])?;
                    answer.await.unwrap_or(Err(ProduceError::Closed))
                });
            }
        }
        let (handed, answer) = self.handed(record, size);
        match self.gate.submit(vec![handed]) {
            Ok(line) => {
                self.last_line = Some(line);
                ResponseFuture::waiting(answer)
            }
            Err(error) => ResponseFuture::failed(error),
        }
    }
}
