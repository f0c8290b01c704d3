//! `group describe` (one row per shard with its owner, lease activity, checkpoint and
//! lag) and `group delete` (the lease table, refused while leases are live).

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use serde_json::json;
use shardflow::kinesis::{KinesisApi, ShardInfo};
use shardflow::lease::{worker_of, Checkpoint, Lease, LeaseStore};
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
    row: &Lease,
    count: Option<&indicatif::ProgressBar>,
) -> Result<(Option<i64>, Option<u64>), String> {
    let Some(from) = after_checkpoint(&row.checkpoint) else {
        return Ok((Some(0), Some(0)));
    };
    let iterator = kinesis
        .shard_iterator(stream, &row.key, &from)
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
    read_to_tip(kinesis, stream, &row.key, &from, |_| {
        behind += 1;
        bar.inc(1);
        true
    })
    .await
    .map_err(|e| e.to_string())?;
    Ok((millis, Some(behind)))
}

/// `group describe`.
pub async fn describe(cx: &Context, args: DescribeArgs) -> CliResult {
    let store = args.group.store(&cx.aws);
    let kinesis = cx.aws.kinesis();
    let stream = args.group.stream.as_str();
    let (rows, moved) = sample_rows(store.as_ref(), Duration::from_millis(args.sample_ms)).await?;
    let shards: BTreeMap<String, ShardInfo> = kinesis
        .list_shards(stream)
        .await?
        .into_iter()
        .map(|s| (s.shard_id.clone(), s))
        .collect();
    let bar = args
        .count
        .then(|| progress(None, "counting records behind"));
    let mut out = Vec::new();
    for row in &rows {
        let shard = shards.get(&row.key);
        let state = state(row, shard);
        let (millis, records, error) = if state == "gone" {
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
        if let Some(owner) = row.owner.as_deref() {
            *workers.entry(worker_of(owner)).or_default() += 1;
        }
    }
    let total_ms = out.iter().filter_map(|o| o.2).max();
    let total_records: Option<u64> = args.count.then(|| out.iter().filter_map(|o| o.3).sum());
    let renewing = |key: &str| moved.as_ref().map(|m| m.contains(key));
    if cx.json {
        let shards_json: Vec<_> = out
            .iter()
            .map(|(row, state, millis, records, error)| {
                json!({
                    "shard": row.key,
                    "state": state,
                    "parents": row.parents,
                    "owner": row.owner,
                    "counter": row.counter,
                    "renewing": renewing(&row.key),
                    "pending_owner": row.pending_owner,
                    "reset_to": row.reset_to.as_ref().map(show),
                    "checkpoint": show(&row.checkpoint),
                    "millis_behind_latest": millis,
                    "records_behind": records,
                    "error": error,
                })
            })
            .collect();
        print_json(&json!({
            "stream": stream,
            "table": args.group.table(),
            "shards": shards_json,
            "workers": workers,
            "max_millis_behind_latest": total_ms,
            "records_behind": total_records,
            "sample_ms": args.sample_ms,
        }));
        return Ok(ExitCode::SUCCESS);
    }
    let mut t = table(&[
        "shard",
        "state",
        "parents",
        "owner",
        "lease",
        "hand-off",
        "checkpoint",
        "lag ms",
        "behind",
    ]);
    for (row, state, millis, records, error) in &out {
        let lease = match (row.owner.is_some(), renewing(&row.key)) {
            (false, _) => "-".to_owned(),
            (true, None) => "?".to_owned(),
            (true, Some(true)) => format!("renewed <{} s", args.sample_ms.div_ceil(1000)),
            (true, Some(false)) => format!("idle >={} s", args.sample_ms / 1000),
        };
        let mut checkpoint = show(&row.checkpoint);
        if let Some(to) = &row.reset_to {
            checkpoint.push_str(&format!(" (reset to {} pending)", show(to)));
        }
        t.add_row(vec![
            row.key.clone(),
            state.to_string(),
            row.parents.join(" "),
            row.owner.clone().unwrap_or_else(|| "-".into()),
            lease,
            row.pending_owner.clone().unwrap_or_else(|| "-".into()),
            checkpoint,
            match (millis, error) {
                (_, Some(e)) => format!("error: {e}"),
                (Some(m), None) => m.to_string(),
                (None, None) => "-".into(),
            },
            records.map_or_else(|| "-".into(), |r| r.to_string()),
        ]);
    }
    println!("{t}");
    let per_worker: Vec<String> = workers.iter().map(|(w, n)| format!("{w}: {n}")).collect();
    println!(
        "{} shards, {} workers ({}), max lag {} ms{}",
        rows.len(),
        workers.len(),
        if per_worker.is_empty() {
            "no leases held".to_owned()
        } else {
            per_worker.join(", ")
        },
        total_ms.unwrap_or(0),
        total_records.map_or_else(String::new, |r| format!(", {r} records behind")),
    );
    Ok(ExitCode::SUCCESS)
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
    if cx.json {
        let mut done = plan;
        done["deleted"] = json!(true);
        print_json(&done);
    } else {
        println!("deleted lease table {table_name} ({} rows)", rows.len());
    }
    Ok(ExitCode::SUCCESS)
}
