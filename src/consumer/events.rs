//! What happens to a worker's shards, for users who want to see it: the hook set with
//! [`ConsumerBuilder::on_event`](super::ConsumerBuilder::on_event), the way KCL users
//! have `leaseLost`/`shardEnded` and rdkafka users have rebalance callbacks.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::panics::panic_message;

use crate::sequence::SequenceNumber;

/// Something that happened to one of this worker's shards.
///
/// `shard` is the shard id; in multi-stream mode
/// ([`ConsumerBuilder::streams`](super::ConsumerBuilder::streams)) it is
/// `stream/shardId`, so the same shard id in two streams is told apart.
///
/// The hook is called on the worker's own tasks, in the order things happened for a
/// shard: keep it quick (count, log, send on a channel); it must not block. A hook that
/// panics loses that event (the panic is logged) and nothing else: the worker goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShardEvent {
    /// The worker took the shard's lease and starts reading it.
    LeaseTaken {
        /// The shard.
        shard: String,
    },
    /// The lease was lost (another worker holds it now, or a write was refused): what
    /// was not checkpointed is delivered again to the next owner.
    LeaseLost {
        /// The shard.
        shard: String,
    },
    /// The shard was drained, checkpointed and handed over to another worker that asked
    /// for it (a planned rebalance: nothing is delivered twice).
    HandedOff {
        /// The shard.
        shard: String,
        /// The worker it was handed to.
        to: String,
    },
    /// The shard was drained, checkpointed and its lease released (shutdown, or a shard
    /// that could not be read any more).
    Released {
        /// The shard.
        shard: String,
    },
    /// Every record of the closed shard is handled and SHARD_END is committed; its
    /// children can be read.
    ShardEnded {
        /// The shard.
        shard: String,
    },
    /// The shard's lease row exists but does not parse (an attribute of the wrong type
    /// or form): nobody takes or overwrites it, and its children wait for it, until an
    /// operator repairs the row. Sent once by each worker that lists the table and finds
    /// it so (again after a repair and a new breakage).
    RowUnreadable {
        /// The shard.
        shard: String,
        /// Why the row does not parse.
        reason: String,
    },
    /// A handler failed on a record: the shard restarts from its checkpoint and the
    /// record is delivered again (records are never skipped; add a dead-letter layer to
    /// move on from a record that cannot be handled).
    HandlerFailed {
        /// The shard.
        shard: String,
        /// The record that failed, when known (record mode).
        sequence_number: Option<SequenceNumber>,
        /// The handler's error, as text.
        error: String,
    },
    /// Records of the shard were handed out (to a handler, queued for one, or to a
    /// `stream()` user) and none was handled for
    /// [`stuck_after`](super::ConsumerBuilder::stuck_after): a hung handler, a record
    /// the handler fails on every time, a batch held unacknowledged. Sent once; the
    /// shard shows in [`ShardHealth::stuck_for`](super::ShardHealth::stuck_for) and the
    /// worker is not ready until [`ShardEvent::Unstuck`].
    Stuck {
        /// The shard.
        shard: String,
        /// How long its records have waited with none handled.
        waited: Duration,
        /// The handler's last error since the shard last made progress, when one
        /// failed (for example a dead-letter sink refusing the record); `None` when a
        /// call or a held batch has not returned.
        reason: Option<String>,
    },
    /// A stuck shard makes progress again (a record was handled, or nothing waits any
    /// more), or is no longer read by this worker: it ended, was handed off, released
    /// or lost (this event comes before that one). Every `Stuck` is followed by one
    /// `Unstuck`.
    Unstuck {
        /// The shard.
        shard: String,
        /// How long it was stuck for.
        stuck_for: Duration,
    },
}

type Hook = Arc<dyn Fn(&ShardEvent) + Send + Sync>;

/// The hook the user gave [`ConsumerBuilder::on_event`](super::ConsumerBuilder::on_event),
/// as it was given; the worker calls it through an [`EventHook`].
#[derive(Clone)]
pub(crate) struct OnEvent(Hook);

impl OnEvent {
    pub(crate) fn new(hook: impl Fn(&ShardEvent) + Send + Sync + 'static) -> Self {
        OnEvent(Arc::new(hook))
    }
}

impl fmt::Debug for OnEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<hook>")
    }
}

/// The user's hook, shared by the worker's tasks, and whether events built from a batch
/// name the shard `stream/shardId` (multi-stream mode).
#[derive(Clone)]
pub(crate) struct EventHook(Option<Hook>, bool);

impl EventHook {
    pub(crate) fn none() -> Self {
        EventHook(None, false)
    }

    /// The user's hook, supervised: a panic in it is caught and logged (a warning at the
    /// 1st, 2nd, 4th, 8th, ... panic, so a hook that always panics does not flood the
    /// log), and the worker goes on as if the hook had returned.
    pub(crate) fn new(hook: impl Fn(&ShardEvent) + Send + Sync + 'static) -> Self {
        let panics = AtomicU64::new(0);
        EventHook(
            Some(Arc::new(move |event: &ShardEvent| {
                let called = std::panic::catch_unwind(AssertUnwindSafe(|| hook(event)));
                if let Err(payload) = called {
                    let n = panics.fetch_add(1, Ordering::Relaxed).saturating_add(1);
                    if n.is_power_of_two() {
                        let message = panic_message(payload.as_ref());
                        tracing::warn!(panics = n, %message, "the on_event hook panicked; the event is dropped and the worker goes on");
                    }
                }
            })),
            false,
        )
    }

    /// The user's hook, if any, supervised as [`Self::new`] says.
    pub(crate) fn supervised(hook: Option<&OnEvent>) -> Self {
        match hook {
            Some(OnEvent(hook)) => {
                let hook = hook.clone();
                EventHook::new(move |event: &ShardEvent| hook(event))
            }
            None => EventHook::none(),
        }
    }

    /// The hook for the handlers of a multi-stream consumer: [`Self::shard_name`] names
    /// a batch's shard `stream/shardId`.
    pub(crate) fn naming_streams(self) -> Self {
        EventHook(self.0, true)
    }

    /// The name events give a batch's shard: `stream/shardId` in multi-stream mode, the
    /// shard id otherwise.
    pub(crate) fn shard_name(&self, stream: &str, shard: &str) -> String {
        if self.1 {
            format!("{stream}/{shard}")
        } else {
            shard.to_owned()
        }
    }

    /// Calls the hook, if any, with the event `make` builds (built only when there is a
    /// hook).
    pub(crate) fn emit(&self, make: impl FnOnce() -> ShardEvent) {
        if let Some(hook) = &self.0 {
            hook(&make());
        }
    }
}

impl ShardEvent {
    /// The event with its shard named `stream/shard` (multi-stream mode).
    fn in_stream(&self, stream: &str) -> ShardEvent {
        let mut event = self.clone();
        let shard = match &mut event {
            ShardEvent::LeaseTaken { shard }
            | ShardEvent::LeaseLost { shard }
            | ShardEvent::HandedOff { shard, .. }
            | ShardEvent::Released { shard }
            | ShardEvent::ShardEnded { shard }
            | ShardEvent::RowUnreadable { shard, .. }
            | ShardEvent::HandlerFailed { shard, .. }
            | ShardEvent::Stuck { shard, .. }
            | ShardEvent::Unstuck { shard, .. } => shard,
        };
        *shard = format!("{stream}/{shard}");
        event
    }
}

impl EventHook {
    /// The hook of one stream of a multi-stream consumer: its events name the shard
    /// `stream/shardId`, so shards of different streams are told apart.
    pub(crate) fn for_stream(&self, stream: &str) -> Self {
        match &self.0 {
            None => EventHook(None, false),
            Some(hook) => {
                let (hook, stream) = (hook.clone(), stream.to_owned());
                EventHook(
                    Some(Arc::new(move |event: &ShardEvent| {
                        hook(&event.in_stream(&stream))
                    })),
                    false,
                )
            }
        }
    }
}

impl fmt::Debug for EventHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() {
            "Some(<hook>)"
        } else {
            "None"
        })
    }
}
