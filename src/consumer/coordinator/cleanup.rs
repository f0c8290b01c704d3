//! Clean-up and resets (the KCL's `LeaseCleanupManager`): deletes the rows of finished
//! shards past retention, settles what a finished row still carries (a hand-off request,
//! an operator's reset), applies resets, and reports rows that do not parse.

use std::collections::{BTreeMap, BTreeSet};

use tokio::time::Instant;

use crate::consumer::events::ShardEvent;
use crate::kinesis::{KinesisError, ShardInfo, StartingPosition};
use crate::lease::{Checkpoint, HeldLease, Lease, LeaseStore};

use super::discovery::{children_of, listed};
use super::tasks::release;
use super::Coordinator;

impl Coordinator {
    /// Settles what a finished row (at SHARD_END, nobody reading it) still carries:
    ///
    /// - a hand-off request: nothing is left to hand over, so it is withdrawn (by
    ///   whoever lists it first), or its worker would wait for it until the row is
    ///   deleted past retention;
    /// - a checkpoint reset an operator asked for while the shard was still read, which
    ///   its owner did not see before the shard ended (or its owner died at the end):
    ///   applied here, to the row (taken first if its owner's lease expired) and to the
    ///   row's descendants, as an operator's reset of a finished shard does, so the
    ///   shard is read again before its children are (they wait meanwhile, see
    ///   `balance`).
    pub(super) async fn settle_finished(
        &self,
        rows: &[Lease],
        by_key: &BTreeMap<&str, &Lease>,
        expired: impl Fn(&Lease) -> bool,
    ) {
        let me = self.config.owner.as_str();
        for row in rows.iter().filter(|r| {
            r.checkpoint == Checkpoint::ShardEnd
                && r.unreadable.is_none()
                && !self.slots.contains_key(&r.key)
        }) {
            // (The withdrawal keeps the counter: a reset below still applies.)
            if row.owner.is_none() && row.pending_owner.is_some() {
                withdraw_stale_request(self.store.as_ref(), row).await;
            }
            let Some(to) = row.reset_to.clone() else {
                continue;
            };
            let unowned = match &row.owner {
                None => row.clone(),
                Some(_) if expired(row) => match self.store.take(row, me).await {
                    Ok(taken) => taken,
                    Err(e) => {
                        tracing::debug!(lease = %row.key, error = %e, "could not take a finished lease to reset it");
                        continue;
                    }
                },
                Some(_) => continue,
            };
            let applied = self.store.reset(&unowned, &to).await;
            if unowned.owner.is_some() {
                let held = HeldLease::taken_at(
                    applied.as_ref().unwrap_or(&unowned).clone(),
                    self.store.clone(),
                    me,
                    Instant::now(),
                );
                release(&held, &row.key).await;
            }
            match applied {
                Ok(_) => {
                    tracing::info!(lease = %row.key, checkpoint = %to, "checkpoint reset of a finished shard applied");
                    self.reset_descendants(&row.key, &to, by_key).await;
                }
                Err(e) => {
                    tracing::debug!(lease = %row.key, error = %e, "could not apply the reset of a finished shard")
                }
            }
        }
    }

    /// Resets the descendants of `key`, whose reset to `to` was just applied after its
    /// end: to the same start, or from their own start when `to` is a record of the
    /// parent (as `shardflow group reset` does for a finished shard).
    async fn reset_descendants(&self, key: &str, to: &Checkpoint, by_key: &BTreeMap<&str, &Lease>) {
        let below = match to {
            Checkpoint::At(_) | Checkpoint::ShardEnd => Checkpoint::TrimHorizon,
            start => start.clone(),
        };
        let mut todo = vec![key];
        let mut seen: BTreeSet<&str> = BTreeSet::new();
        while let Some(parent) = todo.pop() {
            for child in by_key
                .values()
                .filter(|r| r.parents.iter().any(|p| p == parent))
            {
                if !seen.insert(child.key.as_str()) {
                    continue;
                }
                todo.push(child.key.as_str());
                if let Err(e) =
                    crate::admin::reset_checkpoint(self.store.as_ref(), &child.key, &below).await
                {
                    tracing::warn!(lease = %child.key, error = %e, "could not reset a descendant of a reset finished shard");
                }
            }
        }
    }

    /// Reports the rows of a listing that do not parse: in health (the worker is not
    /// ready while one is listed), and once per row found so in an event and a warning.
    pub(super) fn report_unreadable(&self, rows: &[Lease]) {
        let unreadable: BTreeMap<&str, &str> = rows
            .iter()
            .filter_map(|r| Some((r.key.as_str(), r.unreadable.as_deref()?)))
            .collect();
        for key in self.health.unreadable_rows(unreadable.clone()) {
            let reason = unreadable.get(key.as_str()).copied().unwrap_or_default();
            tracing::warn!(lease = %key, %reason, "a lease row does not parse: its shard and its children are not read until it is repaired");
            self.worker.events.emit(|| ShardEvent::RowUnreadable {
                shard: key.clone(),
                reason: reason.to_owned(),
            });
        }
    }

    /// Deletes rows of finished shards once Kinesis no longer lists the shard (it is
    /// past retention) and, as the KCL's `LeaseCleanupManager` asks, every child has a
    /// row that moved past its start (its checkpoint is a record or SHARD_END, not a
    /// start sentinel) and no parent of the shard still has a row (parents go first,
    /// so a child's row is there whenever its parent's is judged).
    ///
    /// Until then the row stays as a tombstone: SHARD_END says the shard was read. A
    /// worker that decided to create a shard's row from an older listing and was paused
    /// before the create landed (GC, SIGSTOP, a slow network) would otherwise create
    /// the row again after its deletion, and the whole shard would be read a second
    /// time; the create is conditional on the row's absence, so a tombstone refuses it.
    /// Once the shard is past retention, a row created again that way finds nothing to
    /// read. The cost is one small row per finished shard for the retention period.
    ///
    /// ListShards answers may be stale, and two in a row may leave out the shard and
    /// its children alike. So a shard whose children are known nowhere (neither in the
    /// row, nor in either answer), and a child that has no row, count as gone only when
    /// GetShardIterator, a third answer from another call, says NotFound too.
    pub(super) async fn clean_up(&self, rows: &[Lease]) {
        let by_key: BTreeMap<&str, &Lease> = rows.iter().map(|r| (r.key.as_str(), r)).collect();
        let progressed =
            |l: &Lease| matches!(l.checkpoint, Checkpoint::At(_) | Checkpoint::ShardEnd);
        let children = |row: &'_ Lease, fresh: &[ShardInfo]| -> BTreeSet<String> {
            children_of(&self.shards, &row.key)
                .chain(children_of(fresh, &row.key))
                .chain(row.children.iter().map(String::as_str))
                .map(str::to_owned)
                .collect()
        };
        let waits = |row: &Lease, fresh: &[ShardInfo]| {
            row.parents.iter().any(|p| by_key.contains_key(p.as_str()))
                || children(row, fresh)
                    .iter()
                    .any(|c| match by_key.get(c.as_str()) {
                        Some(child) => !progressed(child),
                        // Its row is still to be created.
                        None => listed(fresh, c) || listed(&self.shards, c),
                    })
        };
        let finished: Vec<&Lease> = rows
            .iter()
            .filter(|r| r.checkpoint == Checkpoint::ShardEnd && r.owner.is_none())
            .filter(|r| !listed(&self.shards, &r.key))
            // Judged on the last sync's listing first: no extra ListShards each round
            // while a child has not started (an idle child may never start).
            .filter(|r| !waits(r, &[]))
            .collect();
        if finished.is_empty() {
            return;
        }
        // A ListShards answer that left the shard out, or a child that has not
        // started, would let a row go while it still holds a child back (the child,
        // its parent's row gone, would not wait for it): a second answer must agree.
        let fresh = match self.kinesis.list_shards(&self.stream).await {
            Ok(fresh) => fresh,
            Err(e) => {
                tracing::debug!(error = %e, "could not confirm finished shards past retention");
                return;
            }
        };
        for row in finished {
            if listed(&fresh, &row.key) {
                continue;
            }
            if waits(row, &fresh) {
                continue;
            }
            let known = children(row, &fresh);
            let mut unconfirmed: Vec<&str> = known
                .iter()
                .map(String::as_str)
                .filter(|c| !by_key.contains_key(c))
                .collect();
            if known.is_empty() {
                unconfirmed.push(row.key.as_str());
            }
            let mut confirmed = true;
            for shard in unconfirmed {
                if !self.shard_gone(shard).await {
                    tracing::debug!(lease = %row.key, %shard, "a shard missing from ListShards is still found; keeping the finished lease");
                    confirmed = false;
                    break;
                }
            }
            if !confirmed {
                continue;
            }
            match self.store.delete(row).await {
                Ok(()) => {
                    tracing::debug!(lease = %row.key, "removed the lease of a shard past retention")
                }
                Err(e) => {
                    tracing::debug!(lease = %row.key, error = %e, "could not remove a finished lease")
                }
            }
        }
    }

    /// Whether GetShardIterator says the shard does not exist (any other answer, an
    /// error included, counts as "not known to be gone").
    async fn shard_gone(&self, shard: &str) -> bool {
        matches!(
            self.kinesis
                .shard_iterator(&self.stream, shard, &StartingPosition::TrimHorizon)
                .await,
            Err(KinesisError::NotFound(_))
        )
    }
}

/// Stores the checkpoint an operator asked for on a stopped shard's lease.
pub(super) async fn apply_reset(lease: &HeldLease, key: &str) {
    match lease.apply_reset().await {
        Ok(row) => {
            tracing::info!(lease = %key, checkpoint = %row.checkpoint, "checkpoint reset applied")
        }
        Err(e) => {
            tracing::warn!(lease = %key, error = %e, "could not apply the checkpoint reset; the next owner will")
        }
    }
}

/// Withdraws the hand-off request on a finished row (conditional on the request alone).
pub(super) async fn withdraw_stale_request(store: &dyn LeaseStore, row: &Lease) {
    let Some(worker) = row.pending_owner.as_deref() else {
        return;
    };
    match store.withdraw_handoff(row, worker).await {
        Ok(_) => {
            tracing::debug!(lease = %row.key, %worker, "withdrew a hand-off request on a finished shard")
        }
        Err(e) => {
            tracing::debug!(lease = %row.key, error = %e, "could not withdraw a hand-off request on a finished shard")
        }
    }
}
