//! Operating a consumer group from outside it (what the `shardflow` command line uses):
//! moving a shard's checkpoint safely while the group runs.
//!
//! A checkpoint reset never races the shard's owner. An unowned row (nobody reads the
//! shard, or it is finished at `SHARD_END`) is changed with a write conditional on its
//! counter and on having no owner ([`LeaseStore::reset`]). An owned row gets a reset
//! request ([`LeaseStore::request_reset`], the row's [`Lease::reset_to`], written
//! conditionally on its owner and counter like a hand-off request); the owner, at its
//! next renewal, stops the shard, drains what is in flight, commits it, stores the
//! requested checkpoint with a fenced write and releases the lease, so the shard is read
//! again from the new position by whichever worker takes it next. A row whose owner died
//! keeps the request, and the worker that takes it over applies it the same way.
//!
//! A finished shard reset to an earlier position is read again, and its children are not
//! taken again until it is back at `SHARD_END` (children being read at that moment go on
//! unless they are reset too, which a reset of every shard does).
//!
//! A multi-stream table (keys `account:stream:creationEpoch:shardId`) names a row by its
//! stream and shard: [`table_rows`] splits each key of a listing into a [`TableRow`], and
//! [`select_rows`] finds the rows an operator means, refusing input that could name rows
//! of several streams. Together with [`reset_checkpoint`] and
//! [`lease::worker_of`](crate::lease::worker_of) (the worker id inside an owner), they are
//! the operating API: what the `shardflow` command line is built on, for tools of your own.
//!
//! A sequence number names a position in one shard only: a shard whose checkpoint is
//! another shard's sequence number cannot be read from it (Kinesis refuses the
//! iterator). [`check_sequence`] checks, before a reset to a sequence number is written,
//! that the shard can be read after it, and names the shard it belongs to when not.

use crate::kinesis::{KinesisApi, KinesisError, StartingPosition, StreamIdentity};
use crate::lease::{Checkpoint, Lease, LeaseError, LeaseStore};
use crate::sequence::SequenceNumber;

/// How many times [`reset_checkpoint`] reads the row again after a conditional write
/// lost to the owner's renewal.
const RESET_ATTEMPTS: usize = 10;

/// What [`reset_checkpoint`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResetOutcome {
    /// The row was unowned: its checkpoint is now the new one.
    Applied(Lease),
    /// The row is owned: the request is on the row, and its owner applies it.
    Requested(Lease),
}

/// Errors of the admin calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The lease table has no row for this shard (or lease key).
    #[error("the lease table has no row for shard {0}")]
    NoSuchLease(String),
    /// A shard id that rows of several streams have, in a multi-stream table.
    #[error("shard {shard} is in several streams of this multi-stream table ({streams}): name the stream (--stream) or the full lease key")]
    AmbiguousShard {
        /// The shard id given.
        shard: String,
        /// The streams (`account:stream:creationEpoch`) that have it.
        streams: String,
    },
    /// A stream name that rows of several incarnations of the stream have (deleted and
    /// created again: another creation time).
    #[error("stream {stream} has rows of several incarnations ({identities}): name the rows by their full lease keys")]
    AmbiguousStream {
        /// The stream name given.
        stream: String,
        /// Its identities in the table.
        identities: String,
    },
    /// A multi-stream table, and neither a stream nor full lease keys were given.
    #[error("{0} is a multi-stream table: name the stream (--stream) or the shards by their full lease keys")]
    StreamRequired(String),
    /// The table has no row of this stream.
    #[error("the lease table has no row of stream {0}")]
    NoSuchStream(String),
    /// The table holds single-stream and multi-stream rows together.
    #[error("the lease table holds single-stream row {single} and multi-stream row {multi}: it is not a table shardflow wrote")]
    MixedTable {
        /// A single-stream key.
        single: String,
        /// A multi-stream key.
        multi: String,
    },
    /// The row kept changing under every conditional write (a very busy owner).
    #[error("lease {0} kept changing; try again")]
    Contended(String),
    /// The lease store failed.
    #[error(transparent)]
    Store(#[from] LeaseError),
    /// A sequence number of one shard given for another: that shard could not be read
    /// from it.
    #[error("sequence number {sequence} is a position of shard {of}, not of shard {shard}: a checkpoint there could not be read (reset {of} alone: --shard {of})")]
    SequenceOfAnotherShard {
        /// The sequence number given.
        sequence: String,
        /// The shard it was to be stored for.
        shard: String,
        /// The shard that holds it.
        of: String,
    },
    /// A sequence number that no shard of the stream can be read after.
    #[error("sequence number {sequence} is not a readable position of shard {shard} nor of any other shard of stream {stream}")]
    SequenceNotInStream {
        /// The sequence number given.
        sequence: String,
        /// The shard it was to be stored for.
        shard: String,
        /// The stream.
        stream: String,
    },
    /// Kinesis failed while a position was checked.
    #[error(transparent)]
    Kinesis(#[from] KinesisError),
}

/// One row of a lease table as operators name it: its stream (multi-stream tables) and
/// shard.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TableRow {
    /// The stream of a multi-stream row; `None` in a single-stream table.
    pub stream: Option<StreamIdentity>,
    /// The shard id (the whole key in a single-stream table).
    pub shard: String,
    /// The row as stored (its `key` is the full lease key).
    pub lease: Lease,
}

impl TableRow {
    /// The stream's name of a multi-stream row.
    pub fn stream_name(&self) -> Option<&str> {
        self.stream.as_ref().map(|s| s.name.as_str())
    }
}

/// Splits every row's key into stream and shard. A table with both single-stream and
/// multi-stream rows is refused.
pub fn table_rows(rows: Vec<Lease>) -> Result<Vec<TableRow>, AdminError> {
    let out: Vec<TableRow> = rows
        .into_iter()
        .map(|lease| {
            let (stream, shard) = match StreamIdentity::split_lease_key(&lease.key) {
                Some((stream, shard)) => (Some(stream), shard.to_owned()),
                None => (None, lease.key.clone()),
            };
            TableRow {
                stream,
                shard,
                lease,
            }
        })
        .collect();
    let single = out.iter().find(|r| r.stream.is_none());
    let multi = out.iter().find(|r| r.stream.is_some());
    if let (Some(single), Some(multi)) = (single, multi) {
        return Err(AdminError::MixedTable {
            single: single.lease.key.clone(),
            multi: multi.lease.key.clone(),
        });
    }
    Ok(out)
}

/// The rows an operator names in `table` (named `table_name` in errors): every row (no
/// stream, no shards; in a multi-stream table only with a stream), a stream's rows, or
/// the given shards, each a shard id (of `stream` if given) or a full lease key. In a
/// single-stream table `stream` is the table's stream and selects nothing. Refused with
/// an error: a shard id found in several streams without `stream`, a stream name with
/// rows of several incarnations, a stream or shard without rows.
/// A row named twice is selected once.
pub fn select_rows<'a>(
    table: &'a [TableRow],
    table_name: &str,
    stream: Option<&str>,
    shards: &[String],
) -> Result<Vec<&'a TableRow>, AdminError> {
    let mut seen = std::collections::BTreeSet::new();
    let mut rows = pick_rows(table, table_name, stream, shards)?;
    rows.retain(|r| seen.insert(r.lease.key.as_str()));
    Ok(rows)
}

fn pick_rows<'a>(
    table: &'a [TableRow],
    table_name: &str,
    stream: Option<&str>,
    shards: &[String],
) -> Result<Vec<&'a TableRow>, AdminError> {
    let multi = table.iter().any(|r| r.stream.is_some());
    if !multi {
        if shards.is_empty() {
            return Ok(table.iter().collect());
        }
        return shards
            .iter()
            .map(|s| {
                table
                    .iter()
                    .find(|r| &r.shard == s)
                    .ok_or_else(|| AdminError::NoSuchLease(s.clone()))
            })
            .collect();
    }
    // The stream's identity, when a stream is named: exactly one in the table.
    let identity = match stream {
        None => None,
        Some(name) => {
            let mut ids: Vec<&StreamIdentity> = table
                .iter()
                .filter_map(|r| r.stream.as_ref())
                .filter(|id| id.name == name)
                .collect();
            ids.sort();
            ids.dedup();
            match ids.as_slice() {
                [] => return Err(AdminError::NoSuchStream(name.to_owned())),
                [one] => Some(*one),
                many => {
                    // Full keys name one incarnation: no ambiguity.
                    if shards.is_empty() || shards.iter().any(|s| !is_full_key(s)) {
                        return Err(AdminError::AmbiguousStream {
                            stream: name.to_owned(),
                            identities: join(many.iter()),
                        });
                    }
                    None
                }
            }
        }
    };
    if shards.is_empty() {
        return match identity {
            Some(id) => Ok(table
                .iter()
                .filter(|r| r.stream.as_ref() == Some(id))
                .collect()),
            None => Err(AdminError::StreamRequired(table_name.to_owned())),
        };
    }
    shards
        .iter()
        .map(|given| {
            if is_full_key(given) {
                return table
                    .iter()
                    .find(|r| &r.lease.key == given)
                    .filter(|r| stream.is_none_or(|name| r.stream_name() == Some(name)))
                    .ok_or_else(|| AdminError::NoSuchLease(given.clone()));
            }
            let found: Vec<&TableRow> = table
                .iter()
                .filter(|r| &r.shard == given)
                .filter(|r| identity.is_none_or(|id| r.stream.as_ref() == Some(id)))
                .collect();
            match found.as_slice() {
                [] => Err(AdminError::NoSuchLease(match stream {
                    Some(name) => format!("{given} of stream {name}"),
                    None => given.clone(),
                })),
                [one] => Ok(*one),
                many => Err(AdminError::AmbiguousShard {
                    shard: given.clone(),
                    streams: join(many.iter().filter_map(|r| r.stream.as_ref())),
                }),
            }
        })
        .collect()
}

/// Whether `s` is a multi-stream lease key (rather than a bare shard id).
fn is_full_key(s: &str) -> bool {
    StreamIdentity::split_lease_key(s).is_some()
}

fn join<T: std::fmt::Display>(items: impl Iterator<Item = T>) -> String {
    items.map(|i| i.to_string()).collect::<Vec<_>>().join(", ")
}

/// The rows of `table` that descend (children, grandchildren, ...) from `parent`, in
/// the same stream: a finished shard reset to an earlier position is read again before
/// them only if they are reset too.
pub fn descendants<'a>(table: &'a [TableRow], parent: &TableRow) -> Vec<&'a TableRow> {
    let mut out: Vec<&TableRow> = Vec::new();
    let mut todo = vec![parent.shard.as_str()];
    while let Some(p) = todo.pop() {
        for child in table
            .iter()
            .filter(|r| r.stream == parent.stream && r.lease.parents.iter().any(|q| q == p))
        {
            if child.lease.key != parent.lease.key
                && out.iter().all(|o| o.lease.key != child.lease.key)
            {
                out.push(child);
                todo.push(&child.shard);
            }
        }
    }
    out
}

/// Moves the checkpoint of the row with lease key `key` (a shard id, or the full
/// `account:stream:creationEpoch:shardId` key of a multi-stream table) to `to`, safely
/// while the group runs (see the [module docs](self)): applied at once on an unowned row, requested from the owner on
/// an owned one. A conditional write that loses to a renewal reads the row again.
pub async fn reset_checkpoint(
    store: &dyn LeaseStore,
    key: &str,
    to: &Checkpoint,
) -> Result<ResetOutcome, AdminError> {
    for _ in 0..RESET_ATTEMPTS {
        let row = store
            .get(key)
            .await?
            .ok_or_else(|| AdminError::NoSuchLease(key.to_owned()))?;
        let result = match row.owner {
            None => store.reset(&row, to).await.map(ResetOutcome::Applied),
            Some(_) => store
                .request_reset(&row, to)
                .await
                .map(ResetOutcome::Requested),
        };
        match result {
            Err(LeaseError::Conflict(_)) => continue,
            other => return Ok(other?),
        }
    }
    Err(AdminError::Contended(key.to_owned()))
}

/// Checks that `shard` of `stream` can be read after `sequence` (what a worker does with
/// a checkpoint at it), before a reset to it is written. When Kinesis refuses the
/// position as invalid for the shard, the stream's other shards are tried and the error
/// names the one it belongs to ([`AdminError::SequenceOfAnotherShard`]), or says that
/// none does ([`AdminError::SequenceNotInStream`]). Other Kinesis failures are returned
/// as they are.
pub async fn check_sequence(
    kinesis: &dyn KinesisApi,
    stream: &str,
    shard: &str,
    sequence: &SequenceNumber,
) -> Result<(), AdminError> {
    let after = StartingPosition::AfterSequenceNumber(sequence.clone());
    match kinesis.shard_iterator(stream, shard, &after).await {
        Ok(_) => return Ok(()),
        Err(KinesisError::Invalid(_)) => {}
        Err(e) => return Err(e.into()),
    }
    for other in kinesis.list_shards(stream).await? {
        if other.shard_id == shard {
            continue;
        }
        match kinesis
            .shard_iterator(stream, &other.shard_id, &after)
            .await
        {
            Ok(_) => {
                return Err(AdminError::SequenceOfAnotherShard {
                    sequence: sequence.as_str().to_owned(),
                    shard: shard.to_owned(),
                    of: other.shard_id,
                })
            }
            Err(KinesisError::Invalid(_)) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Err(AdminError::SequenceNotInStream {
        sequence: sequence.as_str().to_owned(),
        shard: shard.to_owned(),
        stream: stream.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &str, parents: &[&str]) -> Lease {
        Lease::new(
            key,
            parents.iter().map(|p| p.to_string()).collect(),
            Checkpoint::ShardEnd,
        )
    }

    /// Two streams with the same shard ids, one of them also in an older incarnation.
    fn multi_table() -> Vec<TableRow> {
        table_rows(vec![
            row("1:orders:10:shardId-0", &[]),
            row("1:orders:10:shardId-1", &["shardId-0"]),
            row("1:orders:10:shardId-2", &["shardId-1"]),
            row("1:refunds:20:shardId-0", &[]),
            row("1:refunds:20:shardId-1", &["shardId-0"]),
            row("1:audit:5:shardId-0", &[]),
            row("1:audit:6:shardId-0", &[]),
        ])
        .unwrap()
    }

    fn keys(rows: &[&TableRow]) -> Vec<String> {
        rows.iter().map(|r| r.lease.key.clone()).collect()
    }

    #[test]
    fn a_shard_of_a_multi_stream_table_is_named_by_stream_and_shard_or_full_key() {
        let t = multi_table();
        let shard = |s: &str| vec![s.to_owned()];
        let picked = select_rows(&t, "tbl", Some("refunds"), &shard("shardId-1")).unwrap();
        assert_eq!(keys(&picked), ["1:refunds:20:shardId-1"]);
        let picked = select_rows(&t, "tbl", None, &shard("1:orders:10:shardId-1")).unwrap();
        assert_eq!(keys(&picked), ["1:orders:10:shardId-1"]);
        // Named twice (by key and by stream and shard): once.
        let twice = ["1:orders:10:shardId-1".to_owned(), "shardId-1".to_owned()];
        let picked = select_rows(&t, "tbl", Some("orders"), &twice).unwrap();
        assert_eq!(keys(&picked), ["1:orders:10:shardId-1"]);
        // Only orders has shardId-2: unambiguous without a stream.
        let picked = select_rows(&t, "tbl", None, &shard("shardId-2")).unwrap();
        assert_eq!(keys(&picked), ["1:orders:10:shardId-2"]);
        // A stream without shards: its rows.
        let picked = select_rows(&t, "tbl", Some("refunds"), &[]).unwrap();
        assert_eq!(keys(&picked).len(), 2);

        let err = select_rows(&t, "tbl", None, &shard("shardId-1")).unwrap_err();
        assert!(matches!(err, AdminError::AmbiguousShard { .. }), "{err}");
        assert!(err.to_string().contains("1:orders:10"), "{err}");
        assert!(err.to_string().contains("1:refunds:20"), "{err}");
        let err = select_rows(&t, "tbl", None, &[]).unwrap_err();
        assert!(matches!(err, AdminError::StreamRequired(_)), "{err}");
        let err = select_rows(&t, "tbl", Some("audit"), &shard("shardId-0")).unwrap_err();
        assert!(matches!(err, AdminError::AmbiguousStream { .. }), "{err}");
        let picked = select_rows(&t, "tbl", Some("audit"), &shard("1:audit:6:shardId-0")).unwrap();
        assert_eq!(keys(&picked), ["1:audit:6:shardId-0"]);
        let err = select_rows(&t, "tbl", Some("nope"), &[]).unwrap_err();
        assert!(matches!(err, AdminError::NoSuchStream(_)), "{err}");
        let err = select_rows(&t, "tbl", Some("refunds"), &shard("shardId-2")).unwrap_err();
        assert!(matches!(err, AdminError::NoSuchLease(_)), "{err}");
        // A full key of another stream than the one named.
        let err =
            select_rows(&t, "tbl", Some("refunds"), &shard("1:orders:10:shardId-1")).unwrap_err();
        assert!(matches!(err, AdminError::NoSuchLease(_)), "{err}");

        let mixed = table_rows(vec![row("shardId-0", &[]), row("1:a:1:shardId-0", &[])]);
        assert!(matches!(mixed, Err(AdminError::MixedTable { .. })));
    }

    #[test]
    fn descendants_stay_within_the_stream() {
        let t = multi_table();
        let orders0 = t
            .iter()
            .find(|r| r.lease.key == "1:orders:10:shardId-0")
            .unwrap();
        assert_eq!(
            keys(&descendants(&t, orders0)),
            ["1:orders:10:shardId-1", "1:orders:10:shardId-2"]
        );
        let refunds0 = t
            .iter()
            .find(|r| r.lease.key == "1:refunds:20:shardId-0")
            .unwrap();
        assert_eq!(keys(&descendants(&t, refunds0)), ["1:refunds:20:shardId-1"]);
    }

    #[tokio::test]
    async fn reset_checkpoint_moves_the_row_of_a_full_key_only() {
        let store = crate::memory::MemoryLeaseStore::default();
        for r in [
            row("1:orders:10:shardId-0", &[]),
            row("1:refunds:20:shardId-0", &[]),
        ] {
            assert!(store.create(&r).await.unwrap());
        }
        let done = reset_checkpoint(&store, "1:refunds:20:shardId-0", &Checkpoint::TrimHorizon)
            .await
            .unwrap();
        assert!(matches!(done, ResetOutcome::Applied(_)));
        let rows = store.rows();
        let of = |k: &str| rows.iter().find(|r| r.key == k).unwrap().checkpoint.clone();
        assert_eq!(of("1:refunds:20:shardId-0"), Checkpoint::TrimHorizon);
        assert_eq!(of("1:orders:10:shardId-0"), Checkpoint::ShardEnd);
    }
}
