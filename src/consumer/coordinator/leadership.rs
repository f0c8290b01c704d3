//! Leadership (the KCL's `LeaderDecider`): which worker holds the group's leader item,
//! watched and taken over by the others when it stands still, renewed on its own timer
//! and given up when its holder cannot list; the leader lists every round and covers for
//! the workers that do not.

use std::sync::{Arc, Mutex, MutexGuard};

use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::consumer::config::Config;
use crate::lease::{CoordinatorState, LeaderItem, LeaseError, LEADER_KEY};
use crate::metrics::LEADER_UNKNOWN;

use super::{lock, Coordinator, HeldSet};

/// Fleets of up to this many live workers: every worker lists the whole table every
/// round, as it always did (every worker's plan deals out what is free or expired).
const SMALL_FLEET: usize = 3;

/// The leader item while this worker holds it, and when its last renewal (or the take)
/// that landed was sent; shared by the coordinator and the leadership renewal task.
pub(super) type Leading = Arc<Mutex<Option<(LeaderItem, Instant)>>>;

fn lock_leading(leading: &Leading) -> MutexGuard<'_, Option<(LeaderItem, Instant)>> {
    // Poisoning means a panic elsewhere while holding the lock; the value is still whole.
    leading.lock().unwrap_or_else(|p| p.into_inner())
}

impl Coordinator {
    /// Whether this worker lists the whole table every round: in a fleet of up to
    /// [`SMALL_FLEET`] live workers (or before its first listing), or without a
    /// coordinator-state table, every worker does; in a larger one the leader (the
    /// holder of the leader item), which covers for the workers that do not (it takes
    /// expired leases at once and hands its surplus to the workers below their share).
    ///
    /// So does every worker while no leader can be known (the coordinator-state table
    /// refuses its calls or is gone, see `leader_unknown`): each then lists and takes the
    /// expired leases the shared plan deals it, as in a small fleet, so a crashed
    /// worker's shards are read again within the crash bound with or without a leader.
    pub(super) fn lists_every_round(&self) -> bool {
        self.coordination.is_none()
            || self.live.len() <= SMALL_FLEET
            || self.is_leading()
            || self.leader_unknown.is_some()
            || self.leader_suspect
    }

    /// Notes that the leader cannot be known (`cause`): warned once (and the
    /// [`LEADER_UNKNOWN`](crate::metrics::LEADER_UNKNOWN) gauge set) when it starts.
    fn leader_unknown(&mut self, cause: String) {
        if self.leader_unknown.is_none() {
            tracing::warn!(%cause, "the group's leader cannot be known (the coordinator-state table fails); listing the lease table and taking expired leases every round");
            self.labels.gauge(LEADER_UNKNOWN).set(1.0);
        }
        self.leader_unknown = Some(cause);
    }

    /// Notes that the leader is known again (this worker leads, or read a leader item).
    fn leader_known(&mut self) {
        if self.leader_unknown.take().is_some() {
            tracing::info!("the group's leader can be known again");
            self.labels.gauge(LEADER_UNKNOWN).set(0.0);
        }
    }

    /// Whether this worker holds the leader item.
    fn is_leading(&self) -> bool {
        lock_leading(&self.leading).is_some()
    }

    /// Whether this worker leads: covers for the others (see `balance`). Whatever the
    /// fleet's size in its own view: the others' views of how many workers live are as
    /// old as their last listing, so after workers crash or stop the fleet may look
    /// small to the leader and large to the rest, which then do not list.
    pub(super) fn leads(&self) -> bool {
        self.is_leading()
    }

    /// The key of this group's leader item: one per stream (in a multi-stream table,
    /// the stream's identity), since each stream's coordinator lists and covers only
    /// its own rows.
    fn leader_key(&self) -> String {
        match (&self.identity, self.multi_stream) {
            (Some(identity), true) => identity.to_string(),
            _ => LEADER_KEY.to_owned(),
        }
    }

    /// Whether this worker reads the leader item on its own timer (every renew
    /// interval): it does not lead, and the group has a coordinator-state table.
    pub(super) fn watches_leader(&self) -> bool {
        self.coordination.is_some() && !self.is_leading()
    }

    /// Reads the leader item (one small read a renew interval, the leader's renewal
    /// pace; none while this worker leads) and takes it over when it is absent,
    /// released (no owner), or its counter stood still for a lease duration since this
    /// worker first saw it so (its holder stopped renewing it: crashed, or its writes
    /// fail). The take is conditional on the item as read, so of the workers that
    /// decide together one wins. A worker that finds itself the holder (a take whose
    /// answer was lost) leads.
    ///
    /// An item that did not move between two reads a renew interval apart makes this
    /// worker a watcher (`leader_suspect`): it lists the table every round from then on
    /// until the item moves again, so that when it takes the leadership over it has
    /// already watched every lease's counter (the old leader's included) for most of a
    /// lease duration, and takes the crashed workers' leases as they expire rather than
    /// a lease duration after its first listing. Returns whether a full round should
    /// run now: this worker just became a watcher or the leader.
    pub(super) async fn watch_leader(&mut self) -> bool {
        let Some(state) = self.coordination.clone() else {
            return false;
        };
        if self.is_leading() {
            return false;
        }
        // Lease writes failing: this worker could not cover for anyone.
        if self
            .no_claim_until
            .is_some_and(|until| Instant::now() < until)
            || lease_writes_failing(&self.config, &self.held)
        {
            return false;
        }
        self.leader_read_at = Some(Instant::now());
        let was_suspect = self.leader_suspect;
        let key = self.leader_key();
        let item = match state.get(&key).await {
            Ok(item) => item,
            Err(e) => {
                // Refused, gone or failing: nobody can tell who leads, so this worker
                // lists and takes for itself until a read answers again.
                self.leader_unknown(format!("reading the leader item failed: {e}"));
                return false;
            }
        };
        // A claim whose outcome was unknown is settled by this read.
        self.claim_unsettled = false;
        let now = Instant::now();
        let me = self.config.owner.as_str();
        let standing_still = match (&self.leader_seen, &item) {
            (Some((Some(seen), since)), Some(current))
                if seen.owner == current.owner && seen.counter == current.counter =>
            {
                now.duration_since(*since) >= self.config.lease_duration
            }
            _ => false,
        };
        let claim = match &item {
            None => true,
            Some(current) if current.owner.as_deref() == Some(me) => {
                tracing::info!(leader_counter = current.counter, "leading the group");
                *lock_leading(&self.leading) = Some((current.clone(), now));
                self.took_lead = true;
                self.leader_known();
                self.leader_suspect = false;
                return true;
            }
            Some(current) => current.owner.is_none() || standing_still,
        };
        if !claim {
            self.leader_known();
            match &self.leader_seen {
                Some((seen, since)) if *seen == item => {
                    self.leader_suspect = item.as_ref().is_some_and(|i| i.owner.is_some())
                        && now.duration_since(*since) >= self.config.renew_interval;
                }
                _ => {
                    self.leader_seen = Some((item, now));
                    self.leader_suspect = false;
                }
            }
            return self.leader_suspect && !was_suspect;
        }
        self.leader_suspect = false;
        let sent = Instant::now();
        match state.claim(&key, item.as_ref(), me).await {
            Ok(taken) => {
                match item.as_ref().and_then(|i| i.owner.as_deref()) {
                    Some(old) => {
                        tracing::info!(from = %old, leader_counter = taken.counter, "took over the leadership of a leader that stopped renewing it")
                    }
                    None => tracing::info!(leader_counter = taken.counter, "leading the group"),
                }
                *lock_leading(&self.leading) = Some((taken, sent));
                self.took_lead = true;
                self.leader_seen = None;
                self.leader_known();
                return true;
            }
            Err(LeaseError::Conflict(_)) => {
                tracing::debug!("did not take the leadership: another worker did");
                // Read again next round: the winner's item differs from what we saw.
                self.leader_seen = None;
            }
            Err(e) => {
                // The outcome is unknown: the write may have landed with its answer
                // lost. Settled now by a read, so that this worker neither leads
                // without knowing it nor stops holding an item nobody releases.
                self.leader_seen = None;
                self.claim_unsettled = true;
                match self.settle_claim(state.as_ref(), &key, sent).await {
                    Ok(true) => return true,
                    Ok(false) => {
                        // Nobody could take the item over (the write was refused):
                        // until a leader is seen again this worker lists for itself.
                        self.leader_unknown(format!("taking the leader item over failed: {e}"))
                    }
                    Err(read) => self.leader_unknown(format!(
                        "taking the leader item over failed ({e}), and reading it too: {read}"
                    )),
                }
            }
        }
        false
    }

    /// Settles a claim of the leader item whose answer was lost (`claim_unsettled`):
    /// reads the item and, if it names this worker, leads from then on (`sent`: when
    /// the claim was sent). Returns whether this worker leads; an error if the read
    /// failed too (the claim stays unsettled).
    async fn settle_claim(
        &mut self,
        state: &dyn CoordinatorState,
        key: &str,
        sent: Instant,
    ) -> Result<bool, LeaseError> {
        let item = state.get(key).await?;
        self.claim_unsettled = false;
        match item {
            Some(current) if current.owner.as_deref() == Some(self.config.owner.as_str()) => {
                tracing::info!(
                    leader_counter = current.counter,
                    "leading the group (the take's answer was lost; it landed)"
                );
                *lock_leading(&self.leading) = Some((current, sent));
                self.took_lead = true;
                self.leader_known();
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// At a stop, before giving the leadership up: a claim whose outcome is still
    /// unknown is settled (a few reads, each under the call deadline), so that an
    /// item this worker took without hearing so is released rather than left to stand
    /// still for a lease duration.
    pub(super) async fn settle_claim_at_stop(&mut self) {
        let Some(state) = self.coordination.clone() else {
            return;
        };
        let key = self.leader_key();
        for _ in 0..3 {
            if !self.claim_unsettled {
                return;
            }
            if let Err(e) = self
                .settle_claim(state.as_ref(), &key, Instant::now())
                .await
            {
                tracing::warn!(error = %e, "could not find out whether this worker leads");
            }
        }
    }

    /// A leader whose listings or takes fail while its leader-item renewals land would
    /// keep the item and cover for nobody (the others do not list while they hold their
    /// share): after a lease duration of failed rounds (`ok`: this round listed and
    /// took what it meant to) it releases the item and leaves it to the others for a
    /// lease duration.
    pub(super) async fn give_up_leading_if_blind(&mut self, ok: bool) {
        if ok || !self.is_leading() {
            self.leader_listing_failed_since = None;
            return;
        }
        let since = *self
            .leader_listing_failed_since
            .get_or_insert_with(Instant::now);
        if since.elapsed() < self.config.lease_duration {
            return;
        }
        tracing::warn!(
            "listing or taking leases failed for a lease duration; giving the leadership up"
        );
        self.leader_listing_failed_since = None;
        self.no_claim_until = Some(Instant::now() + self.config.lease_duration);
        self.resign().await;
    }

    /// Releases the leader item (at a graceful stop, before the drain), so that the
    /// next worker to read it leads at once instead of a lease duration later. A
    /// renewal that landed just before is looked up and the release sent again.
    pub(super) async fn resign(&self) {
        let Some(state) = self.coordination.clone() else {
            return;
        };
        let Some((held, _)) = lock_leading(&self.leading).take() else {
            return;
        };
        let mut item = held;
        for _ in 0..2 {
            match state.release(&item).await {
                Ok(_) => {
                    tracing::info!("released the leadership");
                    return;
                }
                Err(LeaseError::Conflict(_)) => match state.get(&item.key).await {
                    Ok(Some(current)) if current.owner == item.owner => item = current,
                    _ => return,
                },
                Err(e) => {
                    tracing::warn!(error = %e, "could not release the leadership; another worker takes it over once it stops moving");
                    return;
                }
            }
        }
    }
}

/// Renews the leader item every renew interval while this worker holds it (see
/// [`crate::lease::leader`]), on its own timer like the leases. A renewal that finds
/// the item changed (another worker took it over) ends the leadership; so does a lease
/// duration without a renewal landing (the writes fail): by then the others may have
/// taken it over, and a worker that is not sure it leads stops covering for others.
///
/// A leader whose lease writes fail (none of its lease renewals landed for two renew
/// intervals while it holds leases) releases the item: it could take nothing for the
/// others, and its own leases are about to expire. The next worker to read the item
/// leads within a renew interval.
pub(super) async fn renew_leadership(
    config: Arc<Config>,
    state: Arc<dyn CoordinatorState>,
    leading: Leading,
    held: HeldSet,
    shutdown: CancellationToken,
) {
    let mut tick = tokio::time::interval(config.renew_interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        let Some((item, renewed_at)) = lock_leading(&leading).clone() else {
            continue;
        };
        if lease_writes_failing(&config, &held) {
            let Some((item, _)) = lock_leading(&leading).take() else {
                continue;
            };
            tracing::warn!("no lease renewal of this worker landed for two renew intervals; giving the leadership up");
            if let Err(e) = state.release(&item).await {
                tracing::warn!(error = %e, "could not release the leadership; another worker takes it over once it stops moving");
            }
            continue;
        }
        let held = item;
        let sent = Instant::now();
        let renewed = state.renew(&held).await;
        let mut slot = lock_leading(&leading);
        // Resigned or lost meanwhile: nothing to record.
        if slot.as_ref().map(|(item, _)| item) != Some(&held) {
            continue;
        }
        match renewed {
            Ok(item) => *slot = Some((item, sent)),
            Err(LeaseError::Conflict(_)) => {
                tracing::info!("leadership lost: another worker took the leader item over");
                *slot = None;
            }
            Err(e) if sent.duration_since(renewed_at) >= config.lease_duration => {
                tracing::warn!(error = %e, "no renewal of the leader item landed for a lease duration; no longer leading");
                *slot = None;
            }
            Err(e) => tracing::warn!(error = %e, "renewing the leader item failed; will retry"),
        }
    }
}

/// Whether this worker's lease writes fail: it holds leases and none of their renewals
/// (or takes) landed for two renew intervals (each lease is renewed once an interval).
/// Such a worker neither keeps nor takes the leadership: it could cover for nobody.
fn lease_writes_failing(config: &Config, held: &HeldSet) -> bool {
    let held = lock(held);
    let newest = held.values().map(|lease| lease.renewed_at()).max();
    newest.is_some_and(|at| at.elapsed() >= config.renew_interval * 2)
}
