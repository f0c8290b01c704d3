//! `group describe` (one row per shard with its owner, lease activity, checkpoint and
//! lag; in a multi-stream table its stream too, and the lag per stream; the group's
//! leader; a summary that counts the shards in error, unreadable or without an owner,
//! and exit code 1 when a shard cannot be read) and `group delete` (the lease table,
//! refused while leases are live).

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde_json::json;
use shardflow::admin::{select_rows, table_rows, TableRow};
use shardflow::kinesis::{KinesisApi, ShardInfo, StreamIdentity};
use shardflow::lease::dynamo::DynamoCoordinatorState;
use shardflow::lease::{
    worker_of, Checkpoint, CoordinatorState, Lease, LeaseError, LeaseStore, LEADER_KEY,
};
use shardflow::Backend;

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

/// The lease rows, read twice `sample` apart: the second read, and the keys whose
/// counter moved in between (`None` when not sampled).
async fn sample_rows(
    store: &dyn LeaseStore,
    sample: Duration,
) -> Result<(Vec<Lease>, Option<BTreeSet<String>>), crate::CliError> {
    let first = store.list().await?;
    if sample.is_zero() {
        return Ok((first, None));
    }
    tokio::time::sleep(sample).await;
    let second = store.list().await?;
    let before: BTreeMap<&str, u64> = first.iter().map(|r| (r.key.as_str(), r.counter)).collect();
    let moved = second
        .iter()
        .filter(|r| before.get(r.key.as_str()) != Some(&r.counter))
        .map(|r| r.key.clone())
        .collect();
    Ok((second, Some(moved)))
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

/// Lag of one shard: milliseconds behind the tip (a one-record read at the checkpoint)
/// and, when asked, the records behind.
async fn lag(
    kinesis: &dyn KinesisApi,
    stream: &str,
    row: &TableRow,
    count: Option<&indicatif::ProgressBar>,
) -> Result<(Option<i64>, Option<u64>), String> {
    let Some(from) = after_checkpoint(&row.lease.checkpoint) else {
        return Ok((Some(0), Some(0)));
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
    let Some(bar) = count else {
        return Ok((millis, None));
    };
    let mut behind = 0u64;
    read_to_tip(kinesis, stream, &row.shard, &from, |_| {
        behind += 1;
        bar.inc(1);
        true
    })
    .await
    .map_err(|e| e.to_string())?;
    Ok((millis, Some(behind)))
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
pub async fn describe(cx: &Context, args: DescribeArgs) -> CliResult {
    let store = args.group.store(&cx.aws);
    let kinesis = cx.aws.kinesis();
    let (rows, moved) = sample_rows(store.as_ref(), Duration::from_millis(args.sample_ms)).await?;
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
    for row in &rows {
        let stream = single.or(row.stream_name()).unwrap_or_default();
        let shard = shards.get(&row.stream).and_then(|s| s.get(&row.shard));
        let state = state(&row.lease, shard);
        let (millis, records, error) = if matches!(state, "gone" | "unreadable") {
            (None, None, None)
        } else {
            match lag(kinesis.as_ref(), stream, row, bar.as_ref()).await {
                Ok((m, r)) => (m, r, None),
                Err(e) => (None, None, Some(e)),
            }
        };
        out.push((row, state, millis, records, error));
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let mut workers: BTreeMap<&str, usize> = BTreeMap::new();
    for row in &rows {
        if let Some(owner) = row.lease.owner.as_deref() {
            *workers.entry(worker_of(owner)).or_default() += 1;
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
            "max_millis_behind_latest": total_ms,
            "records_behind": total_records,
            "sample_ms": args.sample_ms,
            "leader": group_leader.as_ref().and_then(|l| l.clone().ok().flatten()),
            "shards_in_error": in_error.len(),
            "shards_unreadable": unreadable,
            "shards_without_owner": unowned,
            "shards_without_lease": without_lease,
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
    let per_worker: Vec<String> = workers.iter().map(|(w, n)| format!("{w}: {n}")).collect();
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
    Ok(code)
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

/// `group delete`.
pub async fn delete(cx: &Context, args: DeleteArgs) -> CliResult {
    let store = args.group.store(&cx.aws);
    let (rows, moved) = sample_rows(store.as_ref(), Duration::from_millis(args.sample_ms)).await?;
    let live: Vec<&Lease> = rows
        .iter()
        .filter(|r| r.owner.is_some() && moved.as_ref().is_none_or(|m| m.contains(&r.key)))
        .collect();
    let table_name = args.group.table();
    let plan = json!({
        "table": table_name,
        "rows": rows.len(),
        "live_leases": live.iter().map(|r| json!({"shard": r.key, "owner": r.owner})).collect::<Vec<_>>(),
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
        } else {
            println!(
                "would delete lease table {table_name} ({} rows, {} live); run again with --yes",
                rows.len(),
                live.len()
            );
        }
        return Ok(ExitCode::from(EXIT_PLAN_ONLY));
    }
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
    } else {
        println!("deleted lease table {table_name} ({} rows)", rows.len());
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
    fn counts_are_singular_for_one() {
        assert_eq!(count(1, "worker"), "1 worker");
        assert_eq!(count(0, "worker"), "0 workers");
        assert_eq!(count(2, "worker"), "2 workers");
    }
}
