//! `group describe` (one row per shard with its owner, lease activity, checkpoint, the
//! age of its last checkpoint write and lag; in a multi-stream table its stream too, and the lag per stream; the group's
//! leader; a summary that counts the shards in error, unreadable or without an owner,
//! and exit code 1 when a shard cannot be read; the rows that are not leases, such as a
//! KCL 3.5 application's, listed apart) and `group delete` (the lease table, refused
//! while leases are live; in a table that also holds another application's rows, only
//! the lease rows, and it says what it leaves).

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use clap::Args;
use serde_json::json;
use shardflow::admin::{select_rows, table_rows, TableRow};
use shardflow::kinesis::{KinesisApi, ShardInfo, StreamIdentity};
use shardflow::lease::dynamo::{DynamoCoordinatorState, DynamoLeaseStore};
use shardflow::lease::entity::summarize;
use shardflow::lease::{
    worker_of, Checkpoint, CoordinatorState, EntityRow, Lease, LeaseError, LeaseStore, LEADER_KEY,
};

use crate::position::{after_checkpoint, show};
use crate::read::read_to_tip;
use crate::{print_json, progress, table, CliResult, Context, GroupArgs, EXIT_PLAN_ONLY};

/// `group describe`.
#[derive(Args, Debug)]
pub struct DescribeArgs {
    #[command(flatten)]
    group: GroupArgs,
    /// Also count the records behind each checkpoint (reads every shard to its tip).
    #[arg(long)]
    count: bool,
    /// How long to watch the lease counters: a counter that moved in this time is
    /// being renewed (0: read once, activity unknown).
    #[arg(long, default_value_t = 4000, value_name = "MS")]
    sample_ms: u64,
}

/// `group delete`.
#[derive(Args, Debug)]
pub struct DeleteArgs {
    #[command(flatten)]
    group: GroupArgs,
    /// Delete it; without this, say what would be deleted.
    #[arg(long)]
    yes: bool,
    /// Delete even while leases are renewed (the group is running).
    #[arg(long)]
    force: bool,
    /// How long to watch the lease counters for live leases.
    #[arg(long, default_value_t = 4000, value_name = "MS")]
    sample_ms: u64,
}

/// The table's rows, read twice `sample` apart: the second read's leases and rows that
/// are not leases (see `shardflow::lease::entity`), and the keys whose counter moved in
/// between (`None` when not sampled). A table in the middle of a KCL migration is read
/// too (the consumer refuses it, the tools show it).
async fn sample_rows(
    store: &DynamoLeaseStore,
    sample: Duration,
) -> Result<(Vec<Lease>, Vec<EntityRow>, Option<BTreeSet<String>>), crate::CliError> {
    let (first, others) = store.rows().await?;
    if sample.is_zero() {
        return Ok((first, others, None));
    }
    tokio::time::sleep(sample).await;
    let (second, others) = store.rows().await?;
    let before: BTreeMap<&str, u64> = first.iter().map(|r| (r.key.as_str(), r.counter)).collect();
    let moved = second
        .iter()
        .filter(|r| before.get(r.key.as_str()) != Some(&r.counter))
        .map(|r| r.key.clone())
        .collect();
    Ok((second, others, Some(moved)))
}

/// The rows that are not leases, for `--json`.
fn others_json(others: &[EntityRow]) -> Vec<serde_json::Value> {
    others
        .iter()
        .map(|r| {
            json!({
                "key": r.key,
                "kind": r.kind.to_string(),
                "owner": r.owner,
                "state": r.state,
            })
        })
        .collect()
}

/// The migration a row says is under way, as a sentence, if any.
fn unfinished_migration(others: &[EntityRow]) -> Option<String> {
    others.iter().find_map(|r| {
        r.unfinished_migration().map(|(what, state)| {
            format!(
                "the table is in the middle of {what} (state {state}, row {}): a shardflow consumer refuses it until the KCL finishes or rolls it back",
                r.key
            )
        })
    })
}

fn state(row: &Lease, shard: Option<&ShardInfo>) -> &'static str {
    if row.unreadable.is_some() {
        // A row that does not parse: left alone by the workers, its children wait.
        return "unreadable";
    }
    match (&row.checkpoint, shard) {
        (Checkpoint::ShardEnd, _) => "finished",
        (_, None) => "gone",
        (_, Some(s)) if s.is_closed() => "closed",
        _ => "open",
    }
}

/// Lag of one shard: milliseconds behind the tip (a one-record read at the checkpoint),
/// when asked the records behind, and whether the checkpoint is at the tip (that read
/// found no record after it).
async fn lag(
    kinesis: &dyn KinesisApi,
    stream: &str,
    row: &TableRow,
    count: Option<&indicatif::ProgressBar>,
) -> Result<(Option<i64>, Option<u64>, bool), String> {
    let Some(from) = after_checkpoint(&row.lease.checkpoint) else {
        return Ok((Some(0), Some(0), true));
    };
    let iterator = kinesis
        .shard_iterator(stream, &row.shard, &from)
        .await
        .map_err(|e| e.to_string())?;
    let page = kinesis
        .get_records(&iterator, 1)
        .await
        .map_err(|e| e.to_string())?;
    let millis = page.millis_behind_latest;
    let at_tip = page.records.is_empty() && millis.unwrap_or(0) == 0;
    let Some(bar) = count else {
        return Ok((millis, None, at_tip));
    };
    let mut behind = 0u64;
    read_to_tip(kinesis, stream, &row.shard, &from, |_| {
        behind += 1;
        bar.inc(1);
        true
    })
    .await
    .map_err(|e| e.to_string())?;
    Ok((millis, Some(behind), behind == 0))
}

/// How long ago the row's checkpoint was last written (`checkpointedAt`), `None` when
/// no write recorded its time (a row the KCL wrote, or no checkpoint yet).
fn checkpoint_age(lease: &Lease, now: SystemTime) -> Option<Duration> {
    lease
        .checkpointed_at
        .map(|at| now.duration_since(at).unwrap_or(Duration::ZERO))
}

/// An age for people: `850 ms`, `42 s`, `12 min`, `3 h`, `2 d`.
fn age_text(age: Duration) -> String {
    let s = age.as_secs();
    match s {
        0 => format!("{} ms", age.as_millis()),
        1..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", s / 60),
        7200..=172_799 => format!("{} h", s / 3600),
        _ => format!("{} d", s / 86_400),
    }
}

/// The shards of the streams of `rows`, by stream (`None`: a single-stream table's
/// stream, `single`). The shards of a multi-stream row's stream are those of the
/// stream now under its name only if it is the same incarnation (creation time):
/// otherwise, or when the stream is gone, its rows' shards are gone.
async fn shards_of(
    kinesis: &dyn KinesisApi,
    rows: &[&TableRow],
    single: Option<&str>,
) -> Result<BTreeMap<Option<StreamIdentity>, BTreeMap<String, ShardInfo>>, crate::CliError> {
    let by_id = |shards: Vec<ShardInfo>| {
        shards
            .into_iter()
            .map(|s| (s.shard_id.clone(), s))
            .collect::<BTreeMap<_, _>>()
    };
    let mut out = BTreeMap::new();
    if let Some(stream) = single {
        out.insert(None, by_id(kinesis.list_shards(stream).await?));
        return Ok(out);
    }
    let identities: BTreeSet<&StreamIdentity> =
        rows.iter().filter_map(|r| r.stream.as_ref()).collect();
    for identity in identities {
        let now = kinesis.stream_identity(&identity.name).await.ok();
        let shards = if now.as_ref() == Some(identity) {
            by_id(kinesis.list_shards(&identity.name).await?)
        } else {
            BTreeMap::new()
        };
        out.insert(Some(identity.clone()), shards);
    }
    Ok(out)
}

/// The owner of the group's leader item `key`: in the lease table (`row`, a group of
/// one table) or in the coordinator-state table (`legacy`, a table taken over from a
/// KCL older than 3.5); while a group moves between the two, whichever names an owner,
/// the lease table's first. `Ok(None)` when there is none (no table, no item, or
/// released), the error's text when it cannot be read.
async fn leader(
    row: &DynamoCoordinatorState,
    legacy: &DynamoCoordinatorState,
    key: &str,
) -> Result<Option<String>, String> {
    for state in [row, legacy] {
        match state.get(key).await {
            Ok(Some(item)) if item.owner.is_some() => return Ok(item.owner),
            Ok(_) | Err(LeaseError::TableMissing { .. }) => {}
            Err(e) => return Err(e.to_string()),
        }
    }
    Ok(None)
}

/// A leader for people: its owner, `none`, or why it is unknown.
fn leader_text(leader: &Result<Option<String>, String>) -> String {
    match leader {
        Ok(Some(owner)) => owner.clone(),
        Ok(None) => "none".to_owned(),
        Err(e) => format!("unknown ({e})"),
    }
}

/// One described row: the row, its state, its lag (ms, records) or the error reading it.
type Described<'a> = (
    &'a TableRow,
    &'static str,
    Option<i64>,
    Option<u64>,
    Option<String>,
);

/// `group describe`.
pub async fn describe(cx: &Context, mut args: DescribeArgs) -> CliResult {
    let (group, source) = args.group.resolve(&cx.aws).await?;
    args.group = group;
    let store = args.group.store(&cx.aws);
    let kinesis = source.kinesis;
    let (rows, others, moved) =
        sample_rows(store.as_ref(), Duration::from_millis(args.sample_ms)).await?;
    let all = table_rows(rows)?;
    let multi = all.iter().any(|r| r.stream.is_some());
    // A single-stream table is the stream's; a multi-stream one shows every stream or
    // the one named.
    let single = if multi {
        None
    } else {
        Some(args.group.single_stream()?)
    };
    let rows: Vec<&TableRow> = if multi && args.group.stream.is_some() {
        select_rows(&all, args.group.table(), args.group.stream.as_deref(), &[])?
    } else {
        all.iter().collect()
    };
    let shards = shards_of(kinesis.as_ref(), &rows, single).await?;
    let bar = args
        .count
        .then(|| progress(None, "counting records behind"));
    let mut out: Vec<Described> = Vec::new();
    // The rows whose checkpoint is at the shard's tip (nothing to commit: an old
    // checkpoint write is no alarm there).
    let mut at_tip: BTreeSet<&str> = BTreeSet::new();
    for row in &rows {
        let stream = single.or(row.stream_name()).unwrap_or_default();
        let shard = shards.get(&row.stream).and_then(|s| s.get(&row.shard));
        let state = state(&row.lease, shard);
        let (millis, records, error) = if matches!(state, "gone" | "unreadable") {
            (None, None, None)
        } else {
            match lag(kinesis.as_ref(), stream, row, bar.as_ref()).await {
                Ok((m, r, tip)) => {
                    if tip {
                        at_tip.insert(row.lease.key.as_str());
                    }
                    (m, r, None)
                }
                Err(e) => (None, None, Some(e)),
            }
        };
        out.push((row, state, millis, records, error));
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let mut workers: BTreeMap<&str, usize> = BTreeMap::new();
    // Each worker's load: the sum of its shards' measured throughput (`throughputKBps`).
    let mut loads: BTreeMap<&str, f64> = BTreeMap::new();
    for row in &rows {
        if let Some(owner) = row.lease.owner.as_deref() {
            *workers.entry(worker_of(owner)).or_default() += 1;
            if let Some(kbps) = row.lease.throughput_kbps {
                *loads.entry(worker_of(owner)).or_default() += kbps;
            }
        }
    }
    let total_ms = out.iter().filter_map(|o| o.2).max();
    let total_records: Option<u64> = args.count.then(|| out.iter().filter_map(|o| o.3).sum());
    // Lag per stream (multi-stream tables): shards, max ms behind, records behind.
    let mut per_stream: BTreeMap<String, (usize, Option<i64>, Option<u64>)> = BTreeMap::new();
    if multi {
        for (row, _, millis, records, _) in &out {
            let name = row
                .stream
                .as_ref()
                .map(|s| s.to_string())
                .unwrap_or_default();
            let entry = per_stream
                .entry(name)
                .or_insert((0, None, args.count.then_some(0)));
            entry.0 += 1;
            entry.1 = entry.1.max(*millis);
            if let (Some(sum), Some(r)) = (entry.2.as_mut(), records) {
                *sum += r;
            }
        }
    }
    // The group's leader: one item per group, or per stream in a multi-stream table.
    let client = cx.aws.dynamodb_client().clone();
    let row = DynamoCoordinatorState::in_lease_table(client.clone(), args.group.table());
    let coordinator = DynamoCoordinatorState::new(client, args.group.table());
    let group_leader = if multi {
        None
    } else {
        Some(leader(&row, &coordinator, LEADER_KEY).await)
    };
    let mut stream_leaders: BTreeMap<String, Result<Option<String>, String>> = BTreeMap::new();
    for identity in per_stream.keys() {
        stream_leaders.insert(identity.clone(), leader(&row, &coordinator, identity).await);
    }
    // Shards that cannot be read (lag read failed, or the row does not parse), and
    // unfinished shards nobody holds.
    let in_error: Vec<&str> = out
        .iter()
        .filter(|o| o.4.is_some())
        .map(|o| o.0.lease.key.as_str())
        .collect();
    let unreadable = out.iter().filter(|o| o.1 == "unreadable").count();
    let unowned = out
        .iter()
        .filter(|o| matches!(o.1, "open" | "closed") && o.0.lease.owner.is_none())
        .count();
    // Open shards of the streams described that have no row at all (none of their
    // parents has an unfinished row either, which they would wait for): nobody reads
    // them, and no row above says so (an empty table: the whole stream).
    let mut without_lease: Vec<String> = Vec::new();
    for (identity, by_id) in &shards {
        let row_of = |id: &str| rows.iter().find(|r| r.stream == *identity && r.shard == id);
        for s in by_id.values() {
            let waits = s
                .parents()
                .iter()
                .any(|p| row_of(p).is_some_and(|r| r.lease.checkpoint != Checkpoint::ShardEnd));
            if !s.is_closed() && row_of(&s.shard_id).is_none() && !waits {
                without_lease.push(match identity {
                    Some(i) => format!("{}/{}", i.name, s.shard_id),
                    None => s.shard_id.clone(),
                });
            }
        }
    }
    let code = if in_error.is_empty() && unreadable == 0 {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "shardflow: error: {} cannot be read ({} in error{}, {unreadable} unreadable)",
            count(in_error.len() + unreadable, "shard"),
            in_error.len(),
            if in_error.is_empty() {
                String::new()
            } else {
                format!(": {}", in_error.join(", "))
            },
        );
        ExitCode::FAILURE
    };
    let renewing = |key: &str| moved.as_ref().map(|m| m.contains(key));
    let now = SystemTime::now();
    if cx.json {
        let shards_json: Vec<_> = out
            .iter()
            .map(|(row, state, millis, records, error)| {
                let lease = &row.lease;
                json!({
                    "stream": row.stream_name(),
                    "shard": row.shard,
                    "lease_key": lease.key,
                    "state": state,
                    "parents": lease.parents,
                    "owner": lease.owner,
                    "counter": lease.counter,
                    "renewing": renewing(&lease.key),
                    "pending_owner": lease.pending_owner,
                    "reset_to": lease.reset_to.as_ref().map(show),
                    "checkpoint": lease.unreadable.is_none().then(|| show(&lease.checkpoint)),
                    "checkpointed_at_ms": lease.checkpointed_at.map(epoch_millis),
                    "checkpoint_age_ms": checkpoint_age(lease, now).map(|a| a.as_millis() as u64),
                    "checkpoint_at_tip": (*state != "unreadable" && error.is_none())
                        .then(|| at_tip.contains(lease.key.as_str())),
                    "throughput_kbps": lease.throughput_kbps,
                    "unreadable": lease.unreadable,
                    "millis_behind_latest": millis,
                    "records_behind": records,
                    "error": error,
                })
            })
            .collect();
        let streams_json: Vec<_> = per_stream
            .iter()
            .map(|(identity, (n, ms, records))| {
                json!({
                    "stream": StreamIdentity::parse(identity).map(|i| i.name),
                    "identity": identity,
                    "shards": n,
                    "max_millis_behind_latest": ms,
                    "records_behind": records,
                    "leader": stream_leaders.get(identity).and_then(|l| l.clone().ok().flatten()),
                })
            })
            .collect();
        print_json(&json!({
            "stream": single,
            "multi_stream": multi,
            "streams": streams_json,
            "table": args.group.table(),
            "shards": shards_json,
            "workers": workers,
            "worker_throughput_kbps": loads,
            "max_millis_behind_latest": total_ms,
            "records_behind": total_records,
            "sample_ms": args.sample_ms,
            "leader": group_leader.as_ref().and_then(|l| l.clone().ok().flatten()),
            "shards_in_error": in_error.len(),
            "shards_unreadable": unreadable,
            "shards_without_owner": unowned,
            "shards_without_lease": without_lease,
            "other_rows": others_json(&others),
            "other_rows_summary": summarize(&others),
            "kcl_migration_in_progress": unfinished_migration(&others),
        }));
        return Ok(code);
    }
    let mut header = vec![
        "shard",
        "state",
        "parents",
        "owner",
        "lease",
        "hand-off",
        "checkpoint",
        "ckpt age",
        "KiB/s",
        "lag ms",
        "behind",
    ];
    if multi {
        header.insert(0, "stream");
    }
    let mut t = table(&header);
    for (row, state, millis, records, error) in &out {
        let lease = &row.lease;
        let activity = match (lease.owner.is_some(), renewing(&lease.key)) {
            (false, _) => "-".to_owned(),
            (true, None) => "?".to_owned(),
            (true, Some(true)) => format!("renewed <{} s", args.sample_ms.div_ceil(1000)),
            (true, Some(false)) => format!("idle >={} s", args.sample_ms / 1000),
        };
        let mut checkpoint = match &lease.unreadable {
            Some(reason) => format!("row does not parse: {reason}"),
            None => shorten(&show(&lease.checkpoint)),
        };
        if let Some(to) = &lease.reset_to {
            checkpoint.push_str(&format!(" (reset to {} pending)", shorten(&show(to))));
        }
        let mut cells = vec![
            row.shard.clone(),
            state.to_string(),
            lease.parents.join(" "),
            lease.owner.clone().unwrap_or_else(|| "-".into()),
            activity,
            lease.pending_owner.clone().unwrap_or_else(|| "-".into()),
            checkpoint,
            match checkpoint_age(lease, now) {
                None => "-".to_owned(),
                Some(age) if at_tip.contains(lease.key.as_str()) => {
                    format!("{} (at tip)", age_text(age))
                }
                Some(age) => age_text(age),
            },
            lease
                .throughput_kbps
                .map_or_else(|| "-".into(), |k| format!("{k:.1}")),
            match (millis, error) {
                (_, Some(e)) => format!("error: {e}"),
                (Some(m), None) => m.to_string(),
                (None, None) => "-".into(),
            },
            records.map_or_else(|| "-".into(), |r| r.to_string()),
        ];
        if multi {
            cells.insert(0, row.stream_name().unwrap_or_default().to_owned());
        }
        t.add_row(cells);
    }
    println!("{t}");
    for (identity, (n, ms, records)) in &per_stream {
        println!(
            "stream {identity}: {n} shards, leader {}, max lag {} ms{}",
            stream_leaders
                .get(identity)
                .map_or_else(|| "none".to_owned(), leader_text),
            ms.unwrap_or(0),
            records.map_or_else(String::new, |r| format!(", {r} records behind")),
        );
    }
    let per_worker: Vec<String> = workers
        .iter()
        .map(|(w, n)| match loads.get(w) {
            Some(kbps) => format!("{w}: {n} ({kbps:.1} KiB/s)"),
            None => format!("{w}: {n}"),
        })
        .collect();
    println!(
        "{}{} shards, {} ({}){}, max lag {} ms{}; {} in error, {unreadable} unreadable, {unowned} without an owner{}",
        if multi {
            format!("{} streams, ", per_stream.len())
        } else {
            String::new()
        },
        rows.len(),
        count(workers.len(), "worker"),
        if per_worker.is_empty() {
            "no leases held".to_owned()
        } else {
            per_worker.join(", ")
        },
        group_leader
            .as_ref()
            .map_or_else(String::new, |l| format!(", leader {}", leader_text(l))),
        total_ms.unwrap_or(0),
        total_records.map_or_else(String::new, |r| format!(", {r} records behind")),
        in_error.len(),
        if without_lease.is_empty() {
            String::new()
        } else {
            format!(
                "; {} of the stream without a lease, read by nobody: {}",
                count(without_lease.len(), "open shard"),
                without_lease.join(", ")
            )
        },
    );
    if !others.is_empty() {
        println!(
            "rows that are not leases (left alone): {}",
            summarize(&others).join(", ")
        );
    }
    if let Some(migration) = unfinished_migration(&others) {
        println!("{migration}");
    }
    Ok(code)
}

/// Epoch milliseconds of `at`.
fn epoch_millis(at: SystemTime) -> u64 {
    at.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// `n thing` or `n things`.
fn count(n: usize, thing: &str) -> String {
    if n == 1 {
        format!("1 {thing}")
    } else {
        format!("{n} {thing}s")
    }
}

/// A checkpoint as the table shows it: sequence numbers (up to 129 digits, 56 on AWS)
/// shortened to their first 4 and last 10 digits around an ellipsis, so a row fits on
/// one line; `--json` gives them whole. Shorter runs of digits are left as they are.
fn shorten(checkpoint: &str) -> String {
    const HEAD: usize = 4;
    const TAIL: usize = 10;
    let mut out = String::with_capacity(checkpoint.len().min(64));
    let mut digits = String::new();
    let flush = |digits: &mut String, out: &mut String| {
        if digits.len() > HEAD + TAIL + 1 {
            out.push_str(&digits[..HEAD]);
            out.push('…');
            out.push_str(&digits[digits.len() - TAIL..]);
        } else {
            out.push_str(digits);
        }
        digits.clear();
    };
    for c in checkpoint.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
        } else {
            flush(&mut digits, &mut out);
            out.push(c);
        }
    }
    flush(&mut digits, &mut out);
    out
}

/// `group delete`: the lease table with the group's coordinator-state table; in a
/// table that also holds rows that are not the group's (a KCL 3.5 application's leader,
/// worker metrics, migration states), only the lease rows, each deleted on the counter
/// read, and the table stays with those rows.
pub async fn delete(cx: &Context, mut args: DeleteArgs) -> CliResult {
    // `--table-stream` names the stream the group reads: the table's current stream
    // must exist, and a lease table holding another stream's rows is not deleted.
    let stream = if args.group.table_stream.is_some() {
        let (group, source) = args.group.resolve(&cx.aws).await?;
        args.group = group;
        Some(source.stream)
    } else {
        None
    };
    let store = args.group.store(&cx.aws);
    let (rows, others, moved) =
        sample_rows(store.as_ref(), Duration::from_millis(args.sample_ms)).await?;
    if let Some(stream) = &stream {
        if let Some(row) = rows
            .iter()
            .find(|r| r.stream.as_deref().is_some_and(|s| s != stream))
        {
            return Err(format!(
                "lease table {} holds the leases of stream {} (row {}), not of {stream}: nothing deleted",
                args.group.table(),
                row.stream.as_deref().unwrap_or_default(),
                row.key,
            )
            .into());
        }
    }
    let live: Vec<&Lease> = rows
        .iter()
        .filter(|r| r.owner.is_some() && moved.as_ref().is_none_or(|m| m.contains(&r.key)))
        .collect();
    let table_name = args.group.table();
    // Rows of another application stay, and so does the table that holds them.
    let kept: Vec<EntityRow> = others
        .iter()
        .filter(|r| !r.kind.is_shardflow())
        .cloned()
        .collect();
    let left = summarize(&kept);
    let plan = json!({
        "table": table_name,
        "rows": rows.len(),
        "live_leases": live.iter().map(|r| json!({"shard": r.key, "owner": r.owner})).collect::<Vec<_>>(),
        "deletes_table": kept.is_empty(),
        "left": left,
        "deleted": false,
    });
    if !live.is_empty() && !args.force {
        return Err(format!(
            "{} of {} leases in {table_name} are live (renewed within {} ms, e.g. {} by {}): stop the group first, or --force",
            live.len(),
            rows.len(),
            args.sample_ms,
            live[0].key,
            live[0].owner.as_deref().unwrap_or("?"),
        )
        .into());
    }
    if !args.yes {
        if cx.json {
            print_json(&plan);
        } else if kept.is_empty() {
            println!(
                "would delete lease table {table_name} ({} rows, {} live); run again with --yes",
                rows.len(),
                live.len()
            );
        } else {
            println!(
                "would delete the {} lease rows of {table_name} ({} live) and leave the table with {} rows that are not the group's: {}; run again with --yes",
                rows.len(),
                live.len(),
                kept.len(),
                left.join(", ")
            );
        }
        return Ok(ExitCode::from(EXIT_PLAN_ONLY));
    }
    if kept.is_empty() {
        cx.aws
            .dynamodb_client()
            .delete_table()
            .table_name(table_name)
            .send()
            .await
            .map_err(|e| {
                format!(
                    "DeleteTable {table_name}: {}",
                    aws_sdk_dynamodb::error::DisplayErrorContext(e)
                )
            })?;
    } else {
        // Each lease row on the owner and counter read: a row written since is not
        // deleted, and a row that does not parse is left for an operator.
        let mut failed = Vec::new();
        for row in &rows {
            if let Err(e) = store.delete(row).await {
                failed.push(format!("{}: {e}", row.key));
            }
        }
        if !failed.is_empty() {
            return Err(format!(
                "{} of {} lease rows of {table_name} were not deleted: {}",
                failed.len(),
                rows.len(),
                failed.join("; ")
            )
            .into());
        }
    }
    // The group's coordinator-state table (its leader item) goes with it; a group that
    // never ran a worker of this version has none.
    let coordinator = shardflow::lease::dynamo::coordinator_table(table_name);
    if let Err(e) = cx
        .aws
        .dynamodb_client()
        .delete_table()
        .table_name(&coordinator)
        .send()
        .await
    {
        use aws_sdk_dynamodb::error::ProvideErrorMetadata;
        if e.code() != Some("ResourceNotFoundException") {
            return Err(format!(
                "DeleteTable {coordinator}: {}",
                aws_sdk_dynamodb::error::DisplayErrorContext(e)
            )
            .into());
        }
    }
    if cx.json {
        let mut done = plan;
        done["deleted"] = json!(true);
        print_json(&done);
    } else if kept.is_empty() {
        println!("deleted lease table {table_name} ({} rows)", rows.len());
    } else {
        println!(
            "deleted the {} lease rows of {table_name}; left the table with {} rows that are not the group's: {}",
            rows.len(),
            kept.len(),
            left.join(", ")
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_sequence_numbers_are_shortened_in_the_table() {
        let long = "49654565409398421111118436223087298347873486795513266178";
        assert_eq!(shorten(long), "4965…5513266178");
        assert_eq!(
            shorten(&format!("{long}/3")),
            "4965…5513266178/3",
            "a sub-sequence number stays"
        );
        assert_eq!(shorten("TRIM_HORIZON"), "TRIM_HORIZON");
        assert_eq!(shorten("SHARD_END"), "SHARD_END");
        assert_eq!(shorten("123456789012345"), "123456789012345");
    }

    #[test]
    fn ages_read_in_the_unit_that_fits() {
        let secs = Duration::from_secs;
        assert_eq!(age_text(Duration::from_millis(850)), "850 ms");
        assert_eq!(age_text(secs(42)), "42 s");
        assert_eq!(age_text(secs(119)), "119 s");
        assert_eq!(age_text(secs(12 * 60 + 30)), "12 min");
        assert_eq!(age_text(secs(3 * 3600 + 10)), "3 h");
        assert_eq!(age_text(secs(2 * 86_400 + 5)), "2 d");
    }

    #[test]
    fn counts_are_singular_for_one() {
        assert_eq!(count(1, "worker"), "1 worker");
        assert_eq!(count(0, "worker"), "0 workers");
        assert_eq!(count(2, "worker"), "2 workers");
    }
}
