//! Shard discovery (the KCL's `HierarchicalShardSyncer`): lists the shards, confirms a
//! listing that may be stale, creates the rows of new shards (parents before children)
//! and checks that the table and the stream are the ones this worker reads.

use futures_util::FutureExt;
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use crate::consumer::config::InitialPosition;
use crate::consumer::latest::resolve_latest;
use crate::consumer::ConsumerError;
use crate::kinesis::{KinesisError, ShardInfo, StreamIdentity};
use crate::lease::{Checkpoint, Lease, LeaseError, StreamScopedStore};

use super::{concurrently, Coordinator, MAX_CONCURRENT_WRITES};

/// How many more ListShards answers a shard sync asks for when a parent is unknown
/// (see `Coordinator::confirm_listing`), and how long it waits before each.
const STALE_LIST_RETRIES: usize = 2;

const STALE_LIST_PAUSE: Duration = Duration::from_millis(50);

impl Coordinator {
    /// Lists the shards and creates a lease for each shard that has none, parents
    /// before children so no worker can see a child without its parent.
    ///
    /// A shard without a row is skipped when any of its descendants (children,
    /// grandchildren, ... in this ListShards answer or named so by the rows' parents)
    /// has a row or gets one in this sync:
    /// the shard was consumed to its end and its row cleaned up (see `clean_up`), and
    /// reading it again would deliver it twice. An open shard has no descendants, so it
    /// always gets a row.
    ///
    /// At the first sync (no rows yet) every shard gets a row, closed or not. LATEST
    /// is read as AT_TIMESTAMP of the moment this worker started (less the clock
    /// margin, and moved back while Kinesis calls it in its future), not of the sync: a first sync delayed by failing calls or a stale
    /// ListShards answer, during which a shard was closed by a reshard, must still read
    /// that shard's records written since the start. At a timestamp a parent closed
    /// after it still holds records to read, and one closed before it yields nothing
    /// and ends at once. Children wait for their parents either way.
    pub(super) async fn sync_shards(&mut self) -> Result<(), ConsumerError> {
        // Decisions below are as old as the older of the two listings.
        let listed_at = Instant::now();
        let mut shards = self.kinesis.list_shards(&self.stream).await?;
        let rows = self.store.list().await?;
        self.check_stream(&rows)?;
        self.claim_rows(&rows, &shards).await;
        self.record_children(&rows, &shards).await;
        let keys: BTreeSet<&str> = rows.iter().map(|r| r.key.as_str()).collect();
        self.confirm_listing(&mut shards, &keys).await?;
        shards.sort_by(|a, b| a.starting_sequence_number.cmp(&b.starting_sequence_number));
        let ids: BTreeSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
        let mut children: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for shard in &shards {
            for parent in [&shard.parent_shard_id, &shard.adjacent_parent_shard_id]
                .into_iter()
                .flatten()
            {
                children
                    .entry(parent.as_str())
                    .or_default()
                    .push(shard.shard_id.as_str());
            }
        }
        // The table's own parent links too: a stale answer can leave a child out (and
        // its row names its parents), and a shard whose child has a row was consumed
        // to its end, whether its own row is still there or was cleaned up.
        for row in &rows {
            for parent in &row.parents {
                let known = children.entry(parent.as_str()).or_default();
                if !known.contains(&row.key.as_str()) {
                    known.push(row.key.as_str());
                }
            }
        }
        let first = rows.is_empty();
        // LATEST is resolved once, here, into the time this worker started (less the
        // clock margin) and written in the rows it creates: every owner, the first
        // included, continues from that time, so no change of owner before the first
        // checkpoint can skip a record.
        // The time is this worker's clock's, confirmed by Kinesis' (see
        // `resolve_latest`): a host clock ahead must not put the start in Kinesis'
        // future. Checked only when a row may be created.
        let initial = match &self.config.initial_position {
            InitialPosition::TrimHorizon => Checkpoint::TrimHorizon,
            InitialPosition::Latest
                if shards.iter().any(|s| !keys.contains(s.shard_id.as_str())) =>
            {
                // Open shards first: any shard tells Kinesis' clock.
                let probes: Vec<&str> = shards
                    .iter()
                    .filter(|s| !s.is_closed())
                    .chain(shards.iter().filter(|s| s.is_closed()))
                    .map(|s| s.shard_id.as_str())
                    .collect();
                resolve_latest(self.kinesis.as_ref(), &self.stream, &probes, self.started).await?
            }
            InitialPosition::Latest => Checkpoint::latest_from(self.started),
            InitialPosition::AtTimestamp(t) => Checkpoint::AtTimestamp(Some(*t)),
        };
        let mut created: BTreeSet<&str> = BTreeSet::new();
        let mut to_create = Vec::new();
        for shard in &shards {
            if keys.contains(shard.shard_id.as_str()) {
                continue;
            }
            let consumed = descendants(&children, &shard.shard_id)
                .any(|d| keys.contains(d) || created.contains(d));
            if consumed {
                continue;
            }
            let parents = shard.parents();
            // After the first sync, a closed shard without a row whose parents have no
            // row either, listed without its children, was consumed and cleaned up past
            // retention (a stale answer lists it without them): it must not come back.
            // One whose children are listed, none with a row (`consumed` is false), was
            // never read: a first sync cut short (a failed create, a shutdown or crash
            // during start-up) left it out.
            if !first
                && shard.is_closed()
                && !children.contains_key(shard.shard_id.as_str())
                && !parents
                    .iter()
                    .any(|p| keys.contains(p.as_str()) || created.contains(p.as_str()))
            {
                continue;
            }
            let checkpoint = if first {
                initial.clone()
            } else if parents
                .iter()
                .any(|p| ids.contains(p.as_str()) || keys.contains(p.as_str()))
            {
                // Parents nobody read yet, still at the group's start time (LATEST's or
                // AT_TIMESTAMP's): the child starts there too, as at the first sync (a
                // first sync cut short left it out); otherwise at its oldest record.
                unread_start(&parents, &rows, &to_create).unwrap_or(Checkpoint::TrimHorizon)
            } else {
                initial.clone()
            };
            let mut lease = Lease::new(shard.shard_id.clone(), parents, checkpoint);
            lease.stream = Some(self.stream.to_string());
            lease.hash_range = Some((shard.starting_hash_key, shard.ending_hash_key));
            to_create.push(lease);
            created.insert(shard.shard_id.as_str());
        }
        let complete = self.create_leases(to_create, listed_at).await?;
        self.shards = shards;
        self.last_sync = Some(Instant::now());
        self.need_sync = !complete;
        Ok(())
    }

    /// Confirms a ListShards answer where it may be stale: when a shard without a row
    /// names a parent that is neither listed nor in the table, the parent may have
    /// been trimmed (past retention) or the answer may have left it out. Two more
    /// answers, a moment apart, are merged in before the parent is taken for gone; a
    /// child created without its parent would be read before it (lost order, and
    /// the parent's records never read). Tables where every shard has a row never pay
    /// for this.
    async fn confirm_listing(
        &self,
        shards: &mut Vec<ShardInfo>,
        keys: &BTreeSet<&str>,
    ) -> Result<(), KinesisError> {
        for _ in 0..STALE_LIST_RETRIES {
            let listed: BTreeSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
            let unknown_parent = shards
                .iter()
                .filter(|s| !keys.contains(s.shard_id.as_str()))
                .flat_map(|s| [&s.parent_shard_id, &s.adjacent_parent_shard_id])
                .flatten()
                .any(|p| !listed.contains(p.as_str()) && !keys.contains(p.as_str()));
            if !unknown_parent {
                break;
            }
            tokio::time::sleep(STALE_LIST_PAUSE).await;
            let again = self.kinesis.list_shards(&self.stream).await?;
            let missing: Vec<ShardInfo> = again
                .into_iter()
                .filter(|s| !listed.contains(s.shard_id.as_str()))
                .collect();
            if !missing.is_empty() {
                tracing::info!(shards = ?missing.iter().map(|s| &s.shard_id).collect::<Vec<_>>(), "a ListShards answer left shards out; using a newer one");
            }
            shards.extend(missing);
        }
        Ok(())
    }

    /// Multi-stream mode: resolves the stream's identity (account and creation time),
    /// refuses a table of single-stream rows and from then on sees only this stream's
    /// rows, under bare shard ids (see [`StreamScopedStore`]).
    pub(super) async fn scope_to_stream(&mut self) -> Result<(), ConsumerError> {
        let identity = self.kinesis.stream_identity(&self.stream).await?;
        let rows = self.store.list().await?;
        // Unfinished rows of this stream name under another creation time, and none
        // under ours: the stream was deleted and created again, or the rows were
        // written with another creation time (a KCL application's own identifier).
        // Starting afresh would skip or re-read what those rows hold, so the consumer
        // refuses. (Old rows that are all finished hold nothing more to read.)
        let keyed = || {
            rows.iter()
                .filter_map(|r| StreamIdentity::split_lease_key(&r.key).map(|(id, _)| (id, r)))
        };
        if !keyed().any(|(id, _)| id == identity) {
            if let Some((found, row)) = keyed().find(|(id, row)| {
                id.name == identity.name
                    && id.account == identity.account
                    && row.checkpoint != Checkpoint::ShardEnd
            }) {
                return Err(ConsumerError::StreamCreatedAgain {
                    table: self.config.lease_table.clone(),
                    stream: identity.to_string(),
                    rows: found.to_string(),
                    lease: row.key.clone(),
                });
            }
        }
        if let Some(row) = rows
            .iter()
            .find(|r| StreamIdentity::split_lease_key(&r.key).is_none())
        {
            return Err(ConsumerError::TableModeMismatch {
                table: self.config.lease_table.clone(),
                consumer: format!("stream {:?} in multi-stream mode", &*self.stream),
                rows: format!(
                    "single-stream rows (of stream {:?})",
                    row.stream.as_deref().unwrap_or("unnamed, a KCL table")
                ),
                lease: row.key.clone(),
            });
        }
        tracing::info!(stream = %identity, "multi-stream mode: this stream's lease keys start with its identity");
        self.multi_stream = false;
        self.identity = Some(identity.clone());
        self.store = Arc::new(StreamScopedStore::new(self.store.clone(), identity));
        Ok(())
    }

    /// Multi-stream mode: stops this stream's coordinator when the stream's identity
    /// changed (deleted and created again while the group runs): its rows hold positions
    /// in the old stream, and a worker started later would key the new stream's shards
    /// differently, so two workers could read one shard. Not knowing (the call failed)
    /// keeps going; the next sync asks again.
    pub(super) async fn check_identity(&self) -> Result<(), ConsumerError> {
        let Some(known) = &self.identity else {
            return Ok(());
        };
        match self.kinesis.stream_identity(&self.stream).await {
            Ok(now) if now != *known => Err(ConsumerError::StreamCreatedAgain {
                table: self.config.lease_table.clone(),
                stream: now.to_string(),
                rows: known.to_string(),
                lease: String::new(),
            }),
            Ok(_) => Ok(()),
            Err(e) => {
                tracing::debug!(error = %e, "could not check the stream's identity; will ask again");
                Ok(())
            }
        }
    }

    /// Refuses a table whose rows name another stream. Rows without a stream (written
    /// by the KCL) are accepted: a KCL table is taken over as it is. A single-stream
    /// consumer refuses a multi-stream table (whose rows a scoped store never shows).
    pub(super) fn check_stream(&self, rows: &[Lease]) -> Result<(), ConsumerError> {
        if let Some((row, identity)) = rows
            .iter()
            .find_map(|r| StreamIdentity::split_lease_key(&r.key).map(|(id, _)| (r, id)))
        {
            return Err(ConsumerError::TableModeMismatch {
                table: self.config.lease_table.clone(),
                consumer: format!("the single stream {:?}", &*self.stream),
                rows: format!("multi-stream rows (of stream {identity})"),
                lease: row.key.clone(),
            });
        }
        match rows
            .iter()
            .find(|r| r.stream.as_deref().is_some_and(|s| s != &*self.stream))
        {
            Some(row) => Err(ConsumerError::TableOfAnotherStream {
                table: self.config.lease_table.clone(),
                stream: self.stream.to_string(),
                other_stream: row.stream.clone().unwrap_or_default(),
                lease: row.key.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Records our stream in the rows of our shards that name none (a KCL table taken
    /// over), so that a consumer of another stream is refused on this table from now on.
    /// A row that changed meanwhile (a live owner's renewal) is tried again at the next
    /// sync.
    async fn claim_rows(&self, rows: &[Lease], shards: &[ShardInfo]) {
        let ids: BTreeSet<&str> = shards.iter().map(|s| s.shard_id.as_str()).collect();
        for row in rows.iter().filter(|r| {
            r.stream.is_none() && r.unreadable.is_none() && ids.contains(r.key.as_str())
        }) {
            if let Err(e) = self.store.claim_for_stream(row, &self.stream).await {
                tracing::debug!(lease = %row.key, error = %e, "could not record the stream in the row");
            }
        }
    }

    /// Writes `childShardIds` into our rows at SHARD_END that have none, as the KCL does
    /// when a shard ends, so a KCL application that takes the table back finds them.
    async fn record_children(&self, rows: &[Lease], shards: &[ShardInfo]) {
        for row in rows
            .iter()
            .filter(|r| r.checkpoint == Checkpoint::ShardEnd && r.children.is_empty())
        {
            let mut children: Vec<String> =
                children_of(shards, &row.key).map(str::to_owned).collect();
            if children.is_empty() {
                continue;
            }
            children.sort();
            if let Err(e) = self.store.record_children(row, &children).await {
                tracing::debug!(lease = %row.key, error = %e, "could not record the children");
            }
        }
    }

    /// Creates `leases` (in parent-before-child order), many at once but never a child
    /// before its parents: in waves, each holding the leases whose parents are not
    /// waiting to be created, so no worker can see a child without its parent. A fleet
    /// started on a new table then creates thousands of rows in a few round trips. Each
    /// wave goes out [`MAX_CONCURRENT_WRITES`] creates at a time in a worker's own
    /// random order; once a row turns out to exist already, the rows listed since are
    /// left out, so workers started together share the creation.
    /// Returns whether every lease was sent (or already existed).
    ///
    /// Every decision was taken on the rows listed at `listed_at`. A worker paused
    /// after that (GC, SIGSTOP) could create a row that meanwhile was finished and
    /// cleaned up, and the shard would be read again: a create is not sent once the
    /// listing is older than a renewal interval (the next sync decides again).
    async fn create_leases(
        &mut self,
        mut leases: Vec<Lease>,
        listed_at: Instant,
    ) -> Result<bool, LeaseError> {
        let max_age = self.config.renew_interval;
        while !leases.is_empty() {
            let waiting: BTreeSet<String> = leases.iter().map(|l| l.key.clone()).collect();
            let (mut wave, later): (Vec<Lease>, Vec<Lease>) = leases
                .into_iter()
                .partition(|l| l.parents.iter().all(|p| !waiting.contains(p)));
            leases = later;
            // Each worker starts at its own random place in the wave and goes on in order:
            // workers that start together then create different runs of rows, and meet
            // only where one run reaches the next.
            let from = self.rng.gen_range(0..wave.len().max(1));
            wave.rotate_left(from);
            while !wave.is_empty() {
                let chunk: Vec<Lease> = wave
                    .drain(..wave.len().min(MAX_CONCURRENT_WRITES))
                    .collect();
                let creates: Vec<BoxFuture<'static, _>> = chunk
                    .into_iter()
                    .map(|lease| {
                        let store = self.store.clone();
                        async move {
                            if listed_at.elapsed() > max_age {
                                return (lease, None);
                            }
                            let created = store.create(&lease).await;
                            (lease, Some(created))
                        }
                        .boxed()
                    })
                    .collect();
                let mut complete = true;
                let mut existed = false;
                for (lease, created) in concurrently(creates).await {
                    match created {
                        Some(created) => {
                            if created? {
                                tracing::info!(lease = %lease.key, parents = ?lease.parents, "created a lease for a new shard");
                            } else {
                                existed = true;
                            }
                        }
                        None => complete = false,
                    }
                }
                if !complete {
                    // No child after a parent that was not created; decide again.
                    tracing::info!(
                        "the shard listing is too old to create leases from; syncing again"
                    );
                    return Ok(false);
                }
                // A row that already existed: other workers (a group started together)
                // are creating the same rows. One listing leaves out what they created
                // meanwhile, instead of one conditional put per shard per worker (40
                // workers x 2,000 shards were 80,000 puts). A failed listing changes
                // nothing: the creates go on.
                if existed && !wave.is_empty() {
                    match self.store.list().await {
                        Ok(rows) => {
                            let keys: BTreeSet<&str> =
                                rows.iter().map(|r| r.key.as_str()).collect();
                            wave.retain(|l| !keys.contains(l.key.as_str()));
                        }
                        Err(e) => {
                            tracing::debug!(error = %e, "could not list the rows others created; creating on")
                        }
                    }
                }
            }
        }
        Ok(true)
    }
}

/// The start a child takes from its parents when every parent with a row (listed in
/// `rows` or about to be created) still holds a start time nobody read from: the
/// earliest of those times. `None` when a parent holds anything else (it was read, or
/// starts at TRIM_HORIZON) or no parent has a row.
fn unread_start(parents: &[String], rows: &[Lease], to_create: &[Lease]) -> Option<Checkpoint> {
    let mut earliest: Option<SystemTime> = None;
    for parent in parents {
        match rows
            .iter()
            .chain(to_create)
            .find(|r| &r.key == parent)
            .map(|r| &r.checkpoint)
        {
            Some(Checkpoint::AtTimestamp(Some(t))) => {
                earliest = Some(earliest.map_or(*t, |e| e.min(*t)));
            }
            Some(_) => return None,
            None => {}
        }
    }
    earliest.map(|t| Checkpoint::AtTimestamp(Some(t)))
}

/// Whether `key` is one of `shards`.
pub(super) fn listed(shards: &[ShardInfo], key: &str) -> bool {
    shards.iter().any(|s| s.shard_id == key)
}

/// The ids of `key`'s children (split from it, or merged from it and a neighbour) in a
/// ListShards answer.
pub(super) fn children_of<'a>(
    shards: &'a [ShardInfo],
    key: &'a str,
) -> impl Iterator<Item = &'a str> {
    shards
        .iter()
        .filter(move |s| {
            s.parent_shard_id.as_deref() == Some(key)
                || s.adjacent_parent_shard_id.as_deref() == Some(key)
        })
        .map(|s| s.shard_id.as_str())
}

/// Every descendant of `shard` (children, their children, ...) in a map from parent to
/// children, each once.
fn descendants<'a>(
    children: &'a BTreeMap<&'a str, Vec<&'a str>>,
    shard: &'a str,
) -> impl Iterator<Item = &'a str> + 'a {
    let mut seen: BTreeSet<&str> = BTreeSet::new();
    let mut todo: Vec<&str> = vec![shard];
    std::iter::from_fn(move || {
        while let Some(next) = todo.pop() {
            for child in children.get(next).into_iter().flatten() {
                if seen.insert(child) {
                    todo.push(child);
                }
            }
            if next != shard {
                return Some(next);
            }
        }
        None
    })
}
