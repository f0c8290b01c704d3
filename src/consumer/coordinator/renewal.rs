//! Renewal (the KCL's `LeaseRenewer`): renews every held lease on its own timer, paced
//! over the renew interval, and passes the hand-off and reset requests it finds on the
//! rows to the coordinator.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::consumer::config::Config;
use crate::consumer::health::HealthState;
use crate::lease::{HeldLease, LeaseError};
use crate::metrics::WORKER_LOAD_BYTES;

use super::{lock, Event, HeldSet};

/// Ticks per renew interval of [`renew_loop`]: each tick renews only the leases due then,
/// so a worker holding many leases spreads their renewals over the interval (32 ticks:
/// a worker with 200 leases sends about 7 UpdateItems every 100 ms at the defaults,
/// instead of 200 in the same millisecond, which a DynamoDB partition would throttle).
const RENEWAL_TICKS: u32 = 32;

/// Renews every held lease on its own timer, independent of reading and handling, and
/// passes hand-off requests it finds on the rows to the coordinator. Each renewal runs
/// in its own task under the lease call deadline, so one slow or hung renewal never
/// delays the others; a lease whose previous renewal is still in flight is skipped for
/// that tick rather than renewed twice at once.
///
/// Renewals are paced: every lease is renewed once per renew interval, but at its own
/// phase. A lease first seen by the loop is due somewhere in the coming interval (the
/// leases seen together spread evenly over it: renewing early only adds margin), and
/// never later than one interval minus one tick after its take was sent; after
/// that it is due one interval minus one tick after its last renewal was sent, so with
/// the tick's rounding no lease waits longer between renewals than the renew interval,
/// exactly as without pacing.
pub(super) async fn renew_loop(
    config: Arc<Config>,
    health: Arc<HealthState>,
    held: HeldSet,
    events: mpsc::UnboundedSender<Event>,
    shutdown: CancellationToken,
) {
    let step = (config.renew_interval / RENEWAL_TICKS).max(Duration::from_millis(1));
    let period = config.renew_interval.saturating_sub(step).max(step);
    let mut tick = tokio::time::interval_at(Instant::now() + step, step);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    // Dropped (aborting what still runs) when the loop ends.
    let mut renewals: JoinSet<String> = JoinSet::new();
    let mut in_flight: BTreeSet<String> = BTreeSet::new();
    // When each held lease is due for its next renewal.
    let mut due: BTreeMap<String, Instant> = BTreeMap::new();
    let labels = Arc::new(config.labels());
    let worker_load = labels.gauge(WORKER_LOAD_BYTES);
    loop {
        // Biased (a replay takes the same branch): the shutdown first, then the renewals
        // that finished, booked before a tick picks which leases are due and not in
        // flight.
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            Some(done) = renewals.join_next() => {
                if let Ok(key) = done {
                    in_flight.remove(&key);
                }
                continue;
            }
            _ = tick.tick() => {}
        }
        let now = Instant::now();
        let leases: Vec<(String, Arc<HeldLease>)> = {
            let held = lock(&held);
            // This worker's load: the sum of its shards' latest measurements.
            let load: f64 = held
                .values()
                .filter_map(|l| l.throughput())
                .map(|r| r.bytes_per_second)
                .sum();
            worker_load.set(load);
            due.retain(|key, _| held.contains_key(key));
            let new: Vec<(&String, &Arc<HeldLease>)> =
                held.iter().filter(|(k, _)| !due.contains_key(*k)).collect();
            let n = new.len() as f64;
            for (i, (key, lease)) in new.into_iter().enumerate() {
                let spread = now + period.mul_f64((i + 1) as f64 / n);
                due.insert(key.clone(), spread.min(lease.renewed_at() + period));
            }
            held.iter()
                .filter(|(k, _)| due.get(*k).is_some_and(|at| *at <= now))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        for (key, lease) in leases {
            if !in_flight.insert(key.clone()) {
                tracing::debug!(lease = %key, "the previous renewal is still in flight");
                continue;
            }
            due.insert(key.clone(), now + period);
            let events = events.clone();
            let me = config.owner.clone();
            let health = health.clone();
            let lease_duration = config.lease_duration;
            // A requester takes the lease once its hand-off timeout passed since it
            // asked, and it asked after the previous renewal landed (which did not see
            // the request): measured from that renewal's send, less the margin that
            // freshness keeps, no work may start past this (see
            // `HeldLease::note_handoff_request`).
            let handoff_window = config.handoff_timeout.saturating_sub(config.renew_interval);
            let labels = labels.clone();
            renewals.spawn(async move {
                let previous = lease.renewed_at();
                match lease.renew().await {
                    Ok(row) => {
                        health.lease_table_ok();
                        if let Some(rates) = lease.throughput() {
                            labels.shard_throughput(
                                &key,
                                rates.bytes_per_second,
                                rates.records_per_second,
                            );
                        }
                        if row.reset_to.is_some() {
                            let _ = events.send(Event::ResetRequested(key.clone()));
                        }
                        let request = row.pending_owner.filter(|w| *w != me);
                        lease.note_handoff_request(request.as_ref().map(|_| previous + handoff_window));
                        if let Some(to) = request {
                            let _ = events.send(Event::HandoffRequested(key.clone(), to));
                        }
                    }
                    Err(LeaseError::Conflict(_)) => {
                        tracing::info!(lease = %key, "lease lost at renewal")
                    }
                    // Not renewed for a lease duration: the others see it expired, and
                    // as long as this worker kept it, every plan dealt it back here and
                    // nobody read the shard. Given up, it is taken like any expired
                    // lease (maybe by this worker again, once its writes land).
                    Err(e) if !lease.is_fresh(lease_duration) => {
                        tracing::warn!(lease = %key, error = %e, "no renewal landed for a lease duration; giving the lease up");
                        lease.lost().cancel();
                    }
                    Err(e) => {
                        tracing::warn!(lease = %key, error = %e, "renewal failed; will retry")
                    }
                }
                key
            });
        }
    }
}
