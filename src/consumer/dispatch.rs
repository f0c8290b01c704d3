//! Hands a shard's batches to the user's service in `run` mode: record by record (in
//! sequence order, each awaited) or batch by batch, turning the outcome into
//! acknowledgements.

use std::fmt::Display;

use tokio::sync::mpsc;
use tower::{Service, ServiceExt};

use super::events::{EventHook, ShardEvent};
use crate::message::{Batch, Message};

/// Calls `service` for every message of every batch, in order. A batch is acknowledged
/// when all its messages succeeded; on the first error the handled prefix is
/// acknowledged, the rest given up, and the shard restarts from its checkpoint.
pub(crate) async fn records<S>(
    mut batches: mpsc::Receiver<Batch>,
    mut service: S,
    events: EventHook,
) where
    S: Service<Message>,
    S::Error: Display + Send,
{
    while let Some(mut batch) = batches.recv().await {
        let Some(ack) = batch.take_ack() else {
            continue;
        };
        if !ack.wait_start().await {
            ack.abandon();
            continue;
        }
        let mut handled = None;
        let mut outcome = Ok(());
        for message in batch.messages {
            if !ack.should_start() {
                outcome = Err(None);
                break;
            }
            let position = message.position();
            let result = match service.ready().await {
                Ok(ready) => ready.call(message).await,
                Err(e) => Err(e),
            };
            match result {
                Ok(_) => handled = Some(position),
                Err(e) => {
                    outcome = Err(Some((position, e.to_string())));
                    break;
                }
            }
        }
        match outcome {
            Ok(()) => ack.ack(),
            Err(failure) => {
                if let Some(position) = handled {
                    ack.ack_through(position);
                }
                ack.abandon();
                if let Some((position, error)) = failure {
                    tracing::warn!(shard = %batch.shard_id, sequence = %position, %error, "handler failed; the shard restarts from its checkpoint");
                    ack.nack();
                    events.emit(|| ShardEvent::HandlerFailed {
                        shard: batch.shard_id.to_string(),
                        sequence_number: Some(position.sequence.clone()),
                        error,
                    });
                }
            }
        }
    }
}

/// Calls `service` once per batch; `Ok` acknowledges the whole batch, an error gives it
/// up. The batch keeps (a clone of) its acknowledgement handle, so the handler's own
/// `ack` (earlier than its return) and `nack` (give up, redeliver) mean what they say;
/// `Ok` after a `nack` does not acknowledge (a given-up batch stays given up).
pub(crate) async fn batches<S>(
    mut batches: mpsc::Receiver<Batch>,
    mut service: S,
    events: EventHook,
) where
    S: Service<Batch>,
    S::Error: Display + Send,
{
    while let Some(mut batch) = batches.recv().await {
        let Some(ack) = batch.take_ack() else {
            continue;
        };
        if !ack.wait_start().await {
            ack.abandon();
            continue;
        }
        let shard = batch.shard_id.clone();
        batch.ack = Some(ack.clone());
        let result = match service.ready().await {
            Ok(ready) => ready.call(batch).await,
            Err(e) => Err(e),
        };
        match result {
            Ok(_) => ack.ack(),
            Err(error) => {
                tracing::warn!(%shard, %error, "batch handler failed; the shard restarts from its checkpoint");
                ack.abandon();
                ack.nack();
                events.emit(|| ShardEvent::HandlerFailed {
                    shard: shard.to_string(),
                    sequence_number: None,
                    error: error.to_string(),
                });
            }
        }
    }
}
