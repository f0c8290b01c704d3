//! What a running worker shares beside its [`Config`]: the read-ahead budget, the
//! supervised event hook and the enhanced fan-out consumer's ARN, made from the
//! configuration when the consumer is built, so the configuration stays plain values.

use std::sync::Arc;

use tokio::sync::OnceCell;

use super::config::Config;
use super::events::EventHook;
use super::read_ahead::ReadAhead;
use crate::kinesis::{KinesisApi, KinesisError};

/// The worker's shared runtime parts (cloning shares them).
#[derive(Clone, Debug)]
pub(crate) struct WorkerContext {
    /// The worker's read-ahead budget, shared by its shard readers (one budget per
    /// built consumer, over all its streams).
    pub(crate) read_ahead: ReadAhead,
    /// The user's `on_event` hook, supervised (see [`EventHook::supervised`]).
    pub(crate) events: EventHook,
    /// `Some`: shards are read through enhanced fan-out instead of polling.
    pub(crate) fan_out: Option<FanOut>,
}

impl WorkerContext {
    /// The runtime parts of a consumer built with `config`.
    pub(crate) fn new(config: &Config) -> Self {
        WorkerContext {
            read_ahead: ReadAhead::new(config.read_ahead_bytes),
            events: EventHook::supervised(config.on_event.as_ref()),
            fan_out: config.fan_out.as_ref().map(|name| FanOut {
                consumer_name: name.clone(),
                consumer_arn: Arc::default(),
            }),
        }
    }

    /// The context of one stream of a multi-stream consumer: the same budget, events
    /// that name the shard `stream/shardId`, and a fan-out consumer of its own (the
    /// consumer is registered per stream: each gets its own ARN).
    pub(crate) fn for_stream(&self, stream: &str) -> Self {
        WorkerContext {
            read_ahead: self.read_ahead.clone(),
            events: self.events.for_stream(stream),
            fan_out: self.fan_out.as_ref().map(|f| FanOut {
                consumer_name: f.consumer_name.clone(),
                consumer_arn: Arc::default(),
            }),
        }
    }
}

/// Enhanced fan-out (see [`ConsumerBuilder::fan_out`](super::ConsumerBuilder::fan_out)):
/// the stream consumer's name and, once registered, its ARN, shared by every shard
/// reader of the worker.
#[derive(Clone, Debug)]
pub(crate) struct FanOut {
    pub(crate) consumer_name: String,
    consumer_arn: Arc<OnceCell<String>>,
}

impl FanOut {
    /// The consumer's ARN: registered (or found) on first use, then cached. The worker
    /// calls this at start-up, so a backend without fan-out refuses to start; readers
    /// then only read the cache.
    pub(crate) async fn consumer_arn(
        &self,
        kinesis: &dyn KinesisApi,
        stream: &str,
    ) -> Result<&str, KinesisError> {
        self.consumer_arn
            .get_or_try_init(|| async {
                let arn = kinesis
                    .register_consumer(stream, &self.consumer_name)
                    .await?;
                tracing::info!(consumer = %self.consumer_name, %arn, "enhanced fan-out consumer is ACTIVE");
                Ok(arn)
            })
            .await
            .map(String::as_str)
    }
}
