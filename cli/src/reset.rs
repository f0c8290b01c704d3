//! `group reset`: moves checkpoints through [`shardflow::admin::reset_checkpoint`], safe
//! while the group runs (an owned shard's owner applies the reset itself).

use std::process::ExitCode;

use clap::Args;
use serde_json::json;
use shardflow::admin::{reset_checkpoint, ResetOutcome};
use shardflow::lease::{Checkpoint, Lease, LeaseStore};

use crate::position::{parse, show, Spot};
use crate::{print_json, table, CliResult, Context, GroupArgs, EXIT_PLAN_ONLY};

/// `group reset`.
#[derive(Args, Debug)]
pub struct ResetArgs {
    #[command(flatten)]
    group: GroupArgs,
    /// The new position: trim-horizon, latest, timestamp T (RFC 3339 or epoch ms), or
    /// sequence N (N counts as handled: reading goes on after it).
    #[arg(long, num_args = 1..=2, required = true, value_names = ["POSITION", "VALUE"])]
    to: Vec<String>,
    /// Only these shards (repeat for several); every shard of the table by default.
    #[arg(long = "shard", value_name = "ID")]
    shards: Vec<String>,
    /// Make the change; without it only the plan is printed (exit code 3).
    #[arg(long)]
    yes: bool,
}

/// `group reset`.
pub async fn reset(cx: &Context, args: ResetArgs) -> CliResult {
    let spot = match parse(&args.to) {
        Ok(spot) => spot,
        Err(e) => {
            eprintln!("shardflow: error: --to {e}");
            return Ok(ExitCode::from(2));
        }
    };
    let to = spot.checkpoint();
    let store = args.group.store(&cx.aws);
    let rows = store.list().await?;
    for wanted in &args.shards {
        if !rows.iter().any(|r| &r.key == wanted) {
            return Err(format!(
                "the lease table {} has no row for shard {wanted}",
                args.group.table()
            )
            .into());
        }
    }
    // A finished shard read again must be read before its children again: its
    // descendants are reset too (so they wait for it), to the same time, or from their
    // start when the reset names a sequence number of the finished shard.
    let mut chosen: Vec<(&Lease, Checkpoint)> = rows
        .iter()
        .filter(|r| args.shards.is_empty() || args.shards.contains(&r.key))
        .map(|r| (r, to.clone()))
        .collect();
    if !args.shards.is_empty() {
        let below = match spot {
            Spot::Sequence(_) => Checkpoint::TrimHorizon,
            _ => to.clone(),
        };
        let mut todo: Vec<&str> = chosen
            .iter()
            .filter(|(r, _)| r.checkpoint == Checkpoint::ShardEnd)
            .map(|(r, _)| r.key.as_str())
            .collect();
        while let Some(parent) = todo.pop() {
            for child in rows
                .iter()
                .filter(|r| r.parents.iter().any(|p| p == parent))
            {
                if chosen.iter().all(|(r, _)| r.key != child.key) {
                    chosen.push((child, below.clone()));
                    todo.push(&child.key);
                }
            }
        }
    }
    let how = |r: &Lease| {
        if r.owner.is_some() {
            "requested from the owner"
        } else {
            "applied"
        }
    };
    if !args.yes {
        if cx.json {
            let plan: Vec<_> = chosen
                .iter()
                .map(|(r, to)| json!({"shard": r.key, "owner": r.owner, "from": show(&r.checkpoint), "to": show(to), "how": how(r)}))
                .collect();
            print_json(&json!({"plan": plan, "changed": false}));
        } else {
            let mut t = table(&["shard", "owner", "checkpoint now", "new checkpoint", "how"]);
            for (r, to) in &chosen {
                t.add_row(vec![
                    r.key.clone(),
                    r.owner.clone().unwrap_or_else(|| "-".into()),
                    show(&r.checkpoint),
                    show(to),
                    how(r).to_owned(),
                ]);
            }
            println!("{t}");
            println!(
                "plan only, nothing changed: run again with --yes to reset {} shards",
                chosen.len()
            );
        }
        return Ok(ExitCode::from(EXIT_PLAN_ONLY));
    }
    let mut done = Vec::new();
    for (r, to) in &chosen {
        let outcome = reset_checkpoint(store.as_ref() as &dyn LeaseStore, &r.key, to).await?;
        let (how, owner) = match &outcome {
            ResetOutcome::Applied(_) => ("applied", None),
            ResetOutcome::Requested(row) => ("requested from the owner", row.owner.clone()),
            _ => ("done", None),
        };
        done.push(json!({"shard": r.key, "from": show(&r.checkpoint), "to": show(to), "how": how, "owner": owner}));
        if !cx.json {
            println!("{}: {} -> {}: {how}", r.key, show(&r.checkpoint), show(to));
        }
    }
    if cx.json {
        print_json(&json!({"reset": done, "changed": true}));
    }
    Ok(ExitCode::SUCCESS)
}
