//! Taking leases (the KCL's `LeaseTaker`): from a full listing, the worker's fair share
//! through [`balance`](crate::consumer::balance)'s plan — free and expired leases taken,
//! hand-offs asked for, and a leader's surplus handed on; from a light round, the leases
//! handed to this worker.

use futures_util::FutureExt;
use rand::seq::SliceRandom;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use crate::consumer::balance::{self, Candidate};
use crate::consumer::BalanceBy;
use crate::lease::{Checkpoint, Lease, LeaseError, LeaseStore, INCARNATION_SEPARATOR};
use crate::metrics::{LeaseEvent, BALANCE_IMBALANCE_RATIO};

use super::{concurrently, Coordinator};

/// Lease rounds run at once, one after another, after takes lost races (see
/// `Coordinator::raced`); then the usual quick round.
const MAX_RACED_ROUNDS: u32 = 8;

impl Coordinator {
    /// A round without a full listing: the keys this worker owns (the owner index), and
    /// a read of each row it owns without running it (handed over to it, by a leader or
    /// by an owner it asked) and of each row it asked for, which it takes anyway once
    /// the owner let the hand-off timeout pass, as in a full round.
    pub(super) async fn light_round(&mut self) {
        let me = self.config.owner.clone();
        let owned = self.store.owned_keys(&me).await;
        let Some(keys) = self.table_answered(owned, "reading this worker's lease keys") else {
            return;
        };
        let mut wanted: BTreeSet<String> = keys
            .into_iter()
            .filter(|k| !self.slots.contains_key(k))
            .collect();
        wanted.extend(
            self.steals
                .keys()
                .filter(|k| !self.slots.contains_key(*k))
                .cloned(),
        );
        let reads: Vec<BoxFuture<'static, _>> = wanted
            .into_iter()
            .map(|key| {
                let store = self.store.clone();
                async move {
                    let row = store.get(&key).await;
                    (key, row)
                }
                .boxed()
            })
            .collect();
        let mut rows = Vec::new();
        for (key, row) in concurrently(reads).await {
            match row {
                Ok(Some(row)) => rows.push(row),
                // Gone: nothing to adopt or wait for.
                Ok(None) => {
                    self.steals.remove(&key);
                }
                Err(e) => tracing::debug!(lease = %key, error = %e, "could not read the lease"),
            }
        }
        let ours: Vec<&Lease> = rows
            .iter()
            .filter(|r| r.owner.as_deref() == Some(&me) && r.checkpoint != Checkpoint::ShardEnd)
            .collect();
        self.adopt(&ours).await;
        let now = Instant::now();
        for row in &rows {
            if !self.steals.contains_key(&row.key) {
                continue;
            }
            if row.pending_owner.as_deref() != Some(&me)
                || row.owner.as_deref() == Some(&me)
                || row.checkpoint == Checkpoint::ShardEnd
            {
                self.steals.remove(&row.key);
                continue;
            }
            self.take_overdue(row, now).await;
        }
    }

    /// Takes the leases the table says are this incarnation's but no task runs: handed
    /// over to it. (Rows of an earlier run of this worker id have another owner name:
    /// like any other worker's, they are taken once expired or handed over on request,
    /// so two live incarnations never take a lease back and forth.)
    async fn adopt(&mut self, ours: &[&Lease]) {
        for (row, result, sent) in self.take_many(ours, false).await {
            self.steals.remove(&row.key);
            match result {
                Ok(taken) => {
                    self.labels.lease_event(LeaseEvent::Taken);
                    self.start(taken, sent)
                }
                Err(e) => tracing::debug!(lease = %row.key, error = %e, "could not adopt"),
            }
        }
    }

    /// A hand-off this worker asked for on `row`: taken anyway once the owner let the
    /// hand-off timeout pass.
    async fn take_overdue(&mut self, row: &Lease, now: Instant) {
        let asked = *self.steals.entry(row.key.clone()).or_insert(now);
        if now.duration_since(asked) >= self.config.handoff_timeout {
            tracing::warn!(lease = %row.key, owner = ?row.owner, "the owner did not hand over in time; taking the lease");
            let sent = Instant::now();
            if let Ok(taken) = self.store.take(row, &self.config.owner).await {
                self.labels.lease_event(LeaseEvent::Stolen);
                self.steals.remove(&row.key);
                self.start(taken, sent);
            }
        }
    }

    /// A full round's moves, from one listing of the whole table (`rows`), in this order:
    ///
    /// 1. notes which rows moved since the last listing (a lease whose counter has not
    ///    moved for a lease duration is expired: no clocks are compared across hosts),
    ///    reports rows that do not parse and settles finished ones (see
    ///    `settle_finished`);
    /// 2. adopts the leases handed to this worker (see `adopt`);
    /// 3. derives the plan every worker derives from the same listing
    ///    ([`balance::plan`], or [`balance::plan_by_load`] with
    ///    [`BalanceBy::Throughput`]): this worker's fair share, the free leases to take and the
    ///    hand-offs to ask for; and notes the fleet it shows (see `lists_every_round`);
    /// 4. takes free and expired leases, many at once; a leader also those it covers
    ///    for the workers that do not list every round (`cover_for_others`);
    /// 5. takes a hand-off it asked for once the owner let the hand-off timeout pass,
    ///    and asks for hand-offs while below its share (`ask_for_share`);
    /// 6. a leader hands its surplus on to running workers below their share, and asks
    ///    other owners above theirs on those workers' behalf (`hand_on_surplus`);
    /// 7. deletes the rows of finished shards past retention (`clean_up`).
    ///
    /// A failed take or request (not a lost race) ends the round with its error after
    /// the step it failed in; the next round plans again.
    pub(super) async fn balance(&mut self, rows: Vec<Lease>) -> Result<(), LeaseError> {
        let now = Instant::now();
        // This incarnation (worker id and nonce): rows of an older incarnation of the
        // same worker id belong to another owner, which may still be running.
        let me = self.config.owner.clone();
        let by_key: BTreeMap<&str, &Lease> = rows.iter().map(|r| (r.key.as_str(), r)).collect();
        let first_seen = self.note_moves(&rows, &by_key, now);
        self.report_unreadable(&rows);
        self.settle_finished(&rows, &by_key, |row| self.expired(row, now))
            .await;
        let eligible = eligible(&rows, &by_key);

        // Leases the table says are this incarnation's but no task runs: handed over to
        // us (see `adopt`).
        let ours: Vec<&Lease> = eligible
            .iter()
            .copied()
            .filter(|r| r.owner.as_deref() == Some(&me) && !self.slots.contains_key(&r.key))
            .collect();
        self.adopt(&ours).await;

        // The plan every worker derives from this listing (see `balance`): our quota,
        // the free leases to take and the hand-offs to ask for. A lease we run is ours
        // even if it looks expired (after a pause); it is never taken again.
        let candidates: Vec<Candidate> = eligible
            .iter()
            .map(|r| {
                let owner = if self.slots.contains_key(&r.key) {
                    Some(me.as_str())
                } else {
                    r.owner.as_deref().filter(|_| !self.expired(r, now))
                };
                Candidate {
                    key: &r.key,
                    owner,
                    pending: owner.and(r.pending_owner.as_deref()),
                    load: r.throughput_kbps,
                }
            })
            .collect();
        let plan = match self.config.balance_by {
            BalanceBy::Count => balance::plan(&me, &[me.as_str()], &candidates),
            BalanceBy::Throughput => {
                balance::plan_by_load(&me, &[me.as_str()], &candidates, self.config.balance_limits)
            }
        };
        self.note_balance(&candidates);
        self.quota = plan.quota;
        let previous_unowned = self.note_fleet(&candidates, &by_key, &me);
        let leads = self.leads();
        let mut free = self.free_to_take(&plan, &candidates, &by_key);
        if leads {
            let covered = self.cover_for_others(
                &rows,
                &candidates,
                &by_key,
                &free,
                &previous_unowned,
                &first_seen,
                now,
            );
            free.extend(covered);
        }
        // A new leader lists again a lease duration after its first listing: the rows
        // that stood still since then (a crashed worker's, perhaps the old leader's) are
        // expired at that moment, and taken then rather than at a take tick that may
        // fall a few milliseconds short of it and leave them a round more.
        // The rows that stood still since before (a worker that watched the leader
        // item stand still listed every round meanwhile) expire sooner: at the first of
        // those moments.
        if std::mem::take(&mut self.took_lead) && leads {
            let lease = self.config.lease_duration;
            let first_expiry = rows
                .iter()
                .filter(|r| {
                    r.owner.as_deref().is_some_and(|o| o != me)
                        && !self.slots.contains_key(&r.key)
                        && !self.expired(r, now)
                })
                .filter_map(|r| self.seen.get(&r.key).map(|(_, t)| *t + lease))
                .min();
            self.follow_up = Some(first_expiry.unwrap_or(now + lease));
        }
        self.last_listing = Some(now);
        self.handed.clear();
        free.shuffle(&mut self.rng);
        // A worker that sees no other live owner (a fleet started together: each alone
        // in its first view) sends no take after one lost a race: other workers are
        // taking too, and the next round, at once, plans again from a listing that shows
        // them, instead of every worker trying every row (40 workers x 2,000 takes).
        // A worker that sees the others follows the shared plan, where races are rare
        // (a crashed worker's leases are dealt out at once).
        let alone = !candidates
            .iter()
            .any(|c| c.owner.is_some_and(|o| o != me.as_str()));
        let taken = self.take_free(&free, alone).await?;
        self.ask_for_share(&plan, &eligible, &by_key, plan.holds + taken, now)
            .await?;
        if leads && !self.updating {
            self.hand_on_surplus(&plan, &by_key).await;
        }
        self.clean_up(&rows).await;
        Ok(())
    }

    /// Sets the imbalance this listing shows ([`BALANCE_IMBALANCE_RATIO`]): the most
    /// loaded worker's load over the mean, by the lease rows' measurements.
    fn note_balance(&self, candidates: &[Candidate]) {
        if let Some(ratio) = balance::imbalance(&[self.config.owner.as_str()], candidates) {
            self.labels.gauge(BALANCE_IMBALANCE_RATIO).set(ratio);
        }
    }

    /// Whether `row` is expired at `now`: owned, and its counter has not moved for a
    /// lease duration (on this worker's clock) since this worker first saw it so.
    fn expired(&self, row: &Lease, now: Instant) -> bool {
        row.owner.is_some()
            && self
                .seen
                .get(&row.key)
                .is_some_and(|(_, t)| now.duration_since(*t) >= self.config.lease_duration)
    }

    /// Notes, per row of the listing, when its counter last changed (see `seen`), and
    /// forgets rows no longer listed. Returns the rows this listing shows for the first
    /// time: whether their owner runs is not known yet (see `moved_at`).
    fn note_moves<'r>(
        &mut self,
        rows: &'r [Lease],
        by_key: &BTreeMap<&str, &Lease>,
        now: Instant,
    ) -> BTreeSet<&'r str> {
        let mut first_seen: BTreeSet<&str> = BTreeSet::new();
        for row in rows {
            let entry = self.seen.entry(row.key.clone()).or_insert_with(|| {
                first_seen.insert(row.key.as_str());
                (row.counter, now)
            });
            if entry.0 != row.counter {
                *entry = (row.counter, now);
            }
        }
        self.seen.retain(|k, _| by_key.contains_key(k.as_str()));
        first_seen
    }

    /// Notes the fleet this listing shows: the leases unowned in it, and the live
    /// shardflow workers (a KCL worker never leads) and this one, in name order (see
    /// `lists_every_round`). Returns the leases unowned at the previous listing.
    fn note_fleet(
        &mut self,
        candidates: &[Candidate],
        by_key: &BTreeMap<&str, &Lease>,
        me: &str,
    ) -> BTreeSet<String> {
        let previous_unowned = std::mem::take(&mut self.unowned);
        self.unowned = candidates
            .iter()
            .filter(|c| by_key.get(c.key).is_some_and(|r| r.owner.is_none()))
            .map(|c| c.key.to_owned())
            .collect();
        let live: BTreeSet<&str> = candidates
            .iter()
            .filter_map(|c| c.owner)
            .filter(|o| o.contains(INCARNATION_SEPARATOR))
            .chain([me])
            .collect();
        self.live = live.into_iter().map(str::to_owned).collect();
        previous_unowned
    }

    /// The free leases this worker takes, many at once: a fleet started together (each
    /// worker alone in its first view) leases every shard within a few store round
    /// trips. Those the plan deals to us, then other free ones up to our quota: a new
    /// child shard (its parent just ended here) is read at once, not only at the round
    /// of the worker the plan dealt it to. The others in random order, so workers
    /// racing for the same rows do not move in lockstep.
    fn free_to_take<'r>(
        &mut self,
        plan: &balance::Plan,
        candidates: &[Candidate],
        by_key: &BTreeMap<&str, &'r Lease>,
    ) -> Vec<&'r Lease> {
        let mut free: Vec<&Lease> = plan
            .take
            .iter()
            .filter_map(|k| by_key.get(k).copied())
            .collect();
        let room = plan
            .quota
            .saturating_sub(plan.holds + free.len() + plan.ask.len());
        if room > 0 {
            let mut others: Vec<&Lease> = candidates
                .iter()
                .filter(|c| c.owner.is_none() && !plan.take.contains(&c.key))
                .filter_map(|c| by_key.get(c.key).copied())
                .collect();
            others.shuffle(&mut self.rng);
            free.extend(others.into_iter().take(room));
        }
        free
    }

    /// A leader covers for the workers that do not list every round: it takes every
    /// expired lease at once (reading resumes within the lease duration and a round
    /// wherever the plan deals it), every lease released by its owner (a counter above
    /// 0: a worker that stopped, a shard given up; read again within a round), and
    /// every lease that was unowned already at its previous listing (a new shard's,
    /// which the plan dealt to a worker that did not take it for a round). Returns
    /// those of them not in `free` already; it hands what it holds above its share to
    /// the workers below theirs (see `hand_on_surplus`), those it took so first.
    ///
    /// It also notes which workers run (see `moved_at`): only those are handed leases.
    #[allow(clippy::too_many_arguments)]
    fn cover_for_others<'r>(
        &mut self,
        rows: &[Lease],
        candidates: &[Candidate],
        by_key: &BTreeMap<&str, &'r Lease>,
        free: &[&Lease],
        previous_unowned: &BTreeSet<String>,
        first_seen: &BTreeSet<&str>,
        now: Instant,
    ) -> Vec<&'r Lease> {
        let planned: BTreeSet<&str> = free.iter().map(|r| r.key.as_str()).collect();
        let covered: Vec<&Lease> = candidates
            .iter()
            .filter(|c| c.owner.is_none() && !planned.contains(c.key))
            .filter_map(|c| by_key.get(c.key).copied())
            .filter(|r| r.owner.is_some() || r.counter > 0 || previous_unowned.contains(&r.key))
            .collect();
        self.covered.extend(covered.iter().map(|r| r.key.clone()));
        // Workers seen renewing lately are running: a live worker renews every renew
        // interval, so one of its rows moves between two listings at least that far
        // apart. A lease this worker handed to one in its previous round does not
        // count, so a worker that just crashed is not kept alive by the leases
        // handed to it. Only running workers are handed leases.
        // Nor does a row first seen now (a new leader's first listing: a crashed
        // worker's rows look as fresh as anyone's).
        for row in rows
            .iter()
            .filter(|r| !self.handed.contains(&r.key) && !first_seen.contains(r.key.as_str()))
        {
            if let (Some(owner), Some((_, t))) = (&row.owner, self.seen.get(&row.key)) {
                if *t == now {
                    self.moved_at.insert(owner.clone(), now);
                }
            }
        }
        let lately = self.config.renew_interval.max(
            self.last_listing
                .map_or(Duration::ZERO, |t| now.duration_since(t)),
        );
        self.moved_at
            .retain(|_, t| now.duration_since(*t) <= lately + lately / 4);
        covered
    }

    /// Takes the leases of `free` (see `balance`); returns how many it took. After a
    /// lost race the next round runs at once (see `raced`): not after a failure (a
    /// throttled table is not hammered), only when this round took something, and a
    /// few times in a row at most. Fails with the last failure of a take, if any.
    async fn take_free(&mut self, free: &[&Lease], alone: bool) -> Result<usize, LeaseError> {
        let mut taken_here = 0;
        let mut failure = None;
        let mut raced = false;
        for (row, result, sent) in self.take_many(free, alone).await {
            match result {
                Ok(taken) => {
                    match &row.owner {
                        Some(old) => {
                            self.labels.lease_event(LeaseEvent::Expired);
                            tracing::info!(lease = %row.key, from = %old, "took an expired lease");
                        }
                        None => self.labels.lease_event(LeaseEvent::Taken),
                    }
                    self.steals.remove(&row.key);
                    self.start(taken, sent);
                    taken_here += 1;
                }
                Err(LeaseError::Conflict(_)) => raced = true,
                Err(e) => failure = Some(e),
            }
        }
        self.raced =
            raced && failure.is_none() && taken_here > 0 && self.raced_rounds < MAX_RACED_ROUNDS;
        self.raced_rounds = if self.raced { self.raced_rounds + 1 } else { 0 };
        match failure {
            Some(e) => Err(e),
            None => Ok(taken_here),
        }
    }

    /// Takes a hand-off this worker asked for once the owner let the hand-off timeout
    /// pass, and, below its quota, asks the owners the plan names for hand-offs, all at
    /// once (bounded by `max_steals_per_round`). A request that loses to another
    /// worker's (whose view differed) is planned again at the next quick round.
    /// `holds`: what this worker holds or asked for so far this round.
    async fn ask_for_share(
        &mut self,
        plan: &balance::Plan<'_>,
        eligible: &[&Lease],
        by_key: &BTreeMap<&str, &Lease>,
        mut holds: usize,
        now: Instant,
    ) -> Result<(), LeaseError> {
        let me = self.config.owner.clone();
        // Hand-offs we asked for: taken anyway once the owner let the timeout pass.
        self.steals.retain(|k, _| {
            by_key.get(k.as_str()).is_some_and(|r| {
                r.pending_owner.as_deref() == Some(&me) && r.checkpoint != Checkpoint::ShardEnd
            })
        });
        for row in eligible
            .iter()
            .filter(|r| r.pending_owner.as_deref() == Some(&me) && r.owner.as_deref() != Some(&me))
        {
            self.take_overdue(row, now).await;
        }

        for row in eligible.iter().filter(|r| {
            r.has_foreign_owner() && !self.expired(r, now) && self.warned.insert(r.key.clone())
        }) {
            tracing::warn!(
                lease = %row.key,
                owner = ?row.owner,
                "the lease is held by a live worker that is not shardflow (a KCL worker?); \
                 a mixed fleet is not supported: stop the KCL fleet, its leases are taken once they expire"
            );
        }
        // A worker that holds nothing and asked for nothing is known only to itself:
        // the others plan without it, and workers in that state (many, in a fleet
        // started together) all plan the same hand-offs for themselves. It first asks
        // for one lease picked at random among those above their owner's quota, which
        // rarely collides and makes it known; the next round's plan is then shared.
        let unknown = plan.holds == 0 && plan.take.is_empty();
        let wanted: Vec<&str> = match plan.surplus.choose(&mut self.rng) {
            Some(one) if unknown && !plan.ask.is_empty() => vec![*one],
            _ => plan.ask.clone(),
        };
        let asks: Vec<Lease> = if self.updating {
            Vec::new()
        } else {
            wanted
                .iter()
                .filter_map(|k| by_key.get(k).copied())
                // A live KCL worker would never answer a hand-off request, and sharing
                // a table with one (a mixed fleet) is not supported: its leases are
                // taken only once they expire (the KCL fleet stopped).
                .filter(|r| !r.has_foreign_owner() && !self.steals.contains_key(&r.key))
                .take(self.config.max_steals_per_round)
                .cloned()
                .collect()
        };
        let requests: Vec<BoxFuture<'static, _>> = asks
            .into_iter()
            .map(|row| {
                let (store, me) = (self.store.clone(), me.clone());
                async move {
                    let asked = ask_for_handoff(store.as_ref(), &row, &me).await;
                    (row, asked)
                }
                .boxed()
            })
            .collect();
        let mut failure = None;
        for (row, asked) in concurrently(requests).await {
            match asked {
                Ok(true) => {
                    tracing::info!(lease = %row.key, from = ?row.owner, "asked for a hand-off");
                    // Timed from the answer, not the round's start: the owner bounds its
                    // work from a renewal sent before the request landed, so the
                    // timeout must not start before the request could have landed.
                    self.steals.insert(row.key.clone(), Instant::now());
                    holds += 1;
                }
                Ok(false) => {}
                Err(e) => failure = Some(e),
            }
        }
        // Still short (a take or request lost to a worker whose view differed, or
        // leases to ask for beyond this round's bound): plan again at a quick round.
        self.short = !self.updating && holds < plan.quota;
        match failure {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// A leader hands what it holds above its share to the workers the plan deals it
    /// to, which may not list the table for rounds: it writes the worker as the row's
    /// hand-off request itself; its renewal finds it, drains the shard and hands the
    /// lease over, and the worker adopts it at its next round (its owner index names
    /// it). The same request the worker would make itself. Only to workers seen running
    /// (see `moved_at`), at most `max_steals_per_round`.
    async fn hand_on_surplus(&mut self, plan: &balance::Plan<'_>, by_key: &BTreeMap<&str, &Lease>) {
        let me = self.config.owner.clone();
        // As many leases to each worker as the plan deals it, those this worker took
        // to cover for others first (they just started: the shortest drain, and no
        // shard that ran here all along moves).
        self.covered.retain(|k| self.slots.contains_key(k));
        let mut keys: Vec<&str> = self.covered.iter().map(String::as_str).collect();
        keys.extend(
            plan.give
                .iter()
                .map(|(key, _)| *key)
                .filter(|k| !self.covered.contains(*k)),
        );
        // And the hand-offs the plan deals from other owners above their share, which
        // the workers below theirs, not listing, would not ask for: the leader asks
        // on their behalf (the same request; the owner drains and hands over).
        let own = keys
            .into_iter()
            .zip(plan.give.iter().map(|(_, to)| *to))
            // A lease taken this round is handed on from the next listing, which
            // shows it as this worker's.
            .filter(|(key, _)| {
                self.slots.contains_key(*key)
                    && by_key
                        .get(key)
                        .is_some_and(|r| r.owner.as_deref() == Some(me.as_str()))
            });
        let others = plan.arrange.iter().copied().filter(|(key, _)| {
            by_key.get(key).is_some_and(|r| {
                r.pending_owner.is_none()
                    && r.owner
                        .as_deref()
                        .is_some_and(|o| o.contains(INCARNATION_SEPARATOR))
            })
        });
        let gives: Vec<BoxFuture<'static, _>> = own
            .chain(others)
            .filter(|(_, to)| to.contains(INCARNATION_SEPARATOR) && self.moved_at.contains_key(*to))
            .filter_map(|(key, to)| by_key.get(key).map(|row| ((*row).clone(), to.to_owned())))
            .take(self.config.max_steals_per_round)
            .map(|(row, to)| {
                let store = self.store.clone();
                async move {
                    let given = ask_for_handoff(store.as_ref(), &row, &to).await;
                    (row, to, given)
                }
                .boxed()
            })
            .collect();
        for (row, to, given) in concurrently(gives).await {
            match given {
                Ok(true) => {
                    tracing::info!(lease = %row.key, %to, "handing a lease to a worker below its share");
                    self.handed.insert(row.key.clone());
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::debug!(lease = %row.key, %to, error = %e, "could not hand the lease over")
                }
            }
        }
    }

    /// Takes `rows` for this worker, [`MAX_CONCURRENT_WRITES`] conditional writes at a
    /// time; returns each row with its outcome and when its take was sent. With
    /// `until_raced`, no take is sent after one lost a race (the rows not tried are left
    /// out of the answer).
    async fn take_many(
        &self,
        rows: &[&Lease],
        until_raced: bool,
    ) -> Vec<(Lease, Result<Lease, LeaseError>, Instant)> {
        let raced = Arc::new(AtomicBool::new(false));
        // Boxed 'static futures: a borrowing closure here trips the compiler's `Send`
        // inference for the spawned worker future.
        let takes: Vec<BoxFuture<'static, _>> = rows
            .iter()
            .map(|row| {
                let (row, store) = ((*row).clone(), self.store.clone());
                let (me, raced) = (self.config.owner.clone(), raced.clone());
                async move {
                    if until_raced && raced.load(Ordering::SeqCst) {
                        return None;
                    }
                    let sent = Instant::now();
                    let result = match store.take(&row, &me).await {
                        // An unknown outcome (a timeout, a lost reply): if the take
                        // landed, the row is ours and nobody else will take it while
                        // its counter moves, so find out rather than take it again.
                        Err(e) if !matches!(e, LeaseError::Conflict(_)) => {
                            match store.get(&row.key).await {
                                Ok(Some(cur))
                                    if cur.owner.as_deref() == Some(me.as_str())
                                        && cur.counter == row.counter.saturating_add(1) =>
                                {
                                    Ok(cur)
                                }
                                _ => Err(e),
                            }
                        }
                        result => result,
                    };
                    if matches!(result, Err(LeaseError::Conflict(_))) {
                        raced.store(true, Ordering::SeqCst);
                    }
                    Some((row, result, sent))
                }
                .boxed()
            })
            .collect();
        concurrently(takes).await.into_iter().flatten().collect()
    }
}

/// Asks the owner of `row` to hand it over to `me`. The row was listed a moment ago and its
/// owner's renewals bump the counter the request is conditional on, so a conflict is
/// checked once against a fresh read: still the same owner and nobody else asking
/// means the request is sent again. Returns whether it was recorded.
async fn ask_for_handoff(
    store: &dyn LeaseStore,
    row: &Lease,
    me: &str,
) -> Result<bool, LeaseError> {
    match store.request_handoff(row, me).await {
        Ok(_) => return Ok(true),
        Err(LeaseError::Conflict(_)) => {}
        Err(e) => return Err(e),
    }
    let Some(fresh) = store.get(&row.key).await? else {
        return Ok(false);
    };
    if fresh.owner != row.owner || fresh.pending_owner.is_some() {
        return Ok(false);
    }
    match store.request_handoff(&fresh, me).await {
        Ok(_) => Ok(true),
        Err(LeaseError::Conflict(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// The rows of a listing that may be run: not finished, parsing, and with every parent
/// that has a row finished. A row that does not parse is never taken, and a parent
/// whose row does not parse is not known to be finished: its children wait, as for any
/// parent not at SHARD_END (a parent without a row was cleaned up after it finished).
/// So do the children of a finished parent with a reset pending: it is read again
/// first.
fn eligible<'r>(rows: &'r [Lease], by_key: &BTreeMap<&str, &Lease>) -> Vec<&'r Lease> {
    rows.iter()
        .filter(|r| r.checkpoint != Checkpoint::ShardEnd && r.unreadable.is_none())
        .filter(|r| {
            r.parents.iter().all(|p| {
                by_key.get(p.as_str()).is_none_or(|parent| {
                    parent.unreadable.is_none()
                        && parent.reset_to.is_none()
                        && parent.checkpoint == Checkpoint::ShardEnd
                })
            })
        })
        .collect()
}
