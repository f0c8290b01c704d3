//! The largest record the producer's stream takes: set on the builder, or read from the
//! stream once (DescribeStreamSummary) when a record above the 1 MiB every stream takes
//! first needs it.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::OnceCell;

use crate::kinesis::{KinesisApi, KinesisError, MAX_RECORD_BYTES};

use super::record::ProduceError;

/// How long the lookup of a stream's maximum record size may take before it counts as
/// failed (the record waiting for it fails, and the next large record asks again).
const LOOKUP_DEADLINE: Duration = Duration::from_secs(10);

/// A stream's maximum record size, as far as the producer knows it.
pub(crate) struct RecordLimit {
    stream: Arc<str>,
    kinesis: Arc<dyn KinesisApi>,
    /// Set on the builder ([`ProducerBuilder::max_record_size`](super::ProducerBuilder::max_record_size)),
    /// or read from the stream: written once.
    known: OnceCell<usize>,
}

impl RecordLimit {
    pub(crate) fn new(
        stream: Arc<str>,
        kinesis: Arc<dyn KinesisApi>,
        configured: Option<usize>,
    ) -> Self {
        RecordLimit {
            stream,
            kinesis,
            known: match configured {
                Some(bytes) => OnceCell::new_with(Some(bytes)),
                None => OnceCell::new(),
            },
        }
    }

    /// Whether a record of `size` bytes fits, without waiting: `None` when that takes the
    /// stream's limit and it is not known yet. A record of at most [`MAX_RECORD_BYTES`]
    /// fits every stream.
    pub(crate) fn admit_now(&self, size: usize) -> Option<Result<(), ProduceError>> {
        if size <= MAX_RECORD_BYTES {
            return Some(Ok(()));
        }
        self.known.get().map(|limit| fits(size, *limit))
    }

    /// Whether a record of `size` bytes fits, reading the stream's limit first if that
    /// takes it.
    pub(crate) async fn admit(&self, size: usize) -> Result<(), ProduceError> {
        if let Some(answer) = self.admit_now(size) {
            return answer;
        }
        fits(size, self.get().await?)
    }

    /// The stream's maximum record size: set on the builder, or read from the stream
    /// (once; a backend that cannot tell gets the default, [`MAX_RECORD_BYTES`]).
    pub(crate) async fn get(&self) -> Result<usize, ProduceError> {
        self.known
            .get_or_try_init(|| async {
                let lookup = self.kinesis.max_record_size(&self.stream);
                match tokio::time::timeout(LOOKUP_DEADLINE, lookup).await {
                    Ok(Ok(bytes)) => Ok(bytes),
                    Ok(Err(KinesisError::Unsupported(_))) => Ok(MAX_RECORD_BYTES),
                    Ok(Err(error)) => Err(lookup_failed(&error)),
                    Err(_) => Err(lookup_failed(&KinesisError::Other(
                        format!("DescribeStreamSummary did not answer within {LOOKUP_DEADLINE:?}")
                            .into(),
                    ))),
                }
            })
            .await
            .copied()
    }
}

fn fits(size: usize, limit: usize) -> Result<(), ProduceError> {
    if size > limit {
        Err(ProduceError::TooLarge { size, limit })
    } else {
        Ok(())
    }
}

/// The record was not sent: the stream's limit, which it needed, could not be read.
fn lookup_failed(error: &KinesisError) -> ProduceError {
    ProduceError::Failed {
        code: super::worker::call_error_code(error).to_owned(),
        message: format!("reading the stream's maximum record size: {error}"),
        attempts: 0,
    }
}
