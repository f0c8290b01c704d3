//! `group reset`: moves checkpoints through [`shardflow::admin::reset_checkpoint`], safe
//! while the group runs (an owned shard's owner applies the reset itself), on
//! single-stream and multi-stream tables.

use std::process::ExitCode;

use clap::Args;
use serde_json::json;
use shardflow::admin::{
    check_sequence, descendants, reset_checkpoint, select_rows, table_rows, AdminError,
    ResetOutcome, TableRow,
};
use shardflow::kinesis::KinesisError;
use shardflow::lease::{Checkpoint, LeaseStore};

use crate::position::{future_warning, parse, show, Spot};
use crate::{print_json, table, CliResult, Context, GroupArgs, EXIT_PLAN_ONLY};

/// `group reset`.
#[derive(Args, Debug)]
pub struct ResetArgs {
    #[command(flatten)]
    group: GroupArgs,
    /// The new position: trim-horizon, latest, timestamp T (RFC 3339 with any UTC
    /// offset, or epoch ms; epoch seconds are refused, a future time warned about), or
    /// sequence N of the shard reset (N counts as handled: reading goes on after it).
    #[arg(long, num_args = 1..=2, required = true, value_names = ["POSITION", "VALUE"])]
    to: Vec<String>,
    /// Only these shards (repeat for several); every shard of the table (of --stream on
    /// a multi-stream table) by default. On a multi-stream table a shard id with
    /// --stream, or a full lease key (`account:stream:creationEpoch:shardId`); a shard
    /// id that rows of several streams have is refused (exit code 2).
    #[arg(long = "shard", value_name = "ID")]
    shards: Vec<String>,
    /// Make the change; without it only the plan is printed (exit code 3).
    #[arg(long)]
    yes: bool,
}

/// `group reset`.
pub async fn reset(cx: &Context, mut args: ResetArgs) -> CliResult {
    let spot = match parse(&args.to) {
        Ok(spot) => spot,
        Err(e) => {
            eprintln!("shardflow: error: --to {e}");
            return Ok(ExitCode::from(2));
        }
    };
    if let Some(warning) = future_warning(&spot) {
        eprintln!("shardflow: warning: --to {warning} (the shards skip every record until then)");
    }
    let (group, source) = args.group.resolve(&cx.aws).await?;
    args.group = group;
    let to = spot.checkpoint();
    let store = args.group.store(&cx.aws);
    let table_name = args.group.table();
    let all = table_rows(store.list().await?)?;
    // A shard of a multi-stream table is named by --stream and --shard, or by its full
    // lease key; input that could mean rows of several streams is refused.
    let selected = select_rows(&all, table_name, args.group.stream.as_deref(), &args.shards)?;
    let mut chosen: Vec<(&TableRow, Checkpoint)> =
        selected.into_iter().map(|r| (r, to.clone())).collect();
    // A finished shard read again must be read before its children again: its
    // descendants (in its stream) are reset too (so they wait for it), to the same
    // time, or from their start when the reset names a sequence number of the finished
    // shard.
    if !args.shards.is_empty() {
        let below = match spot {
            Spot::Sequence(_) => Checkpoint::TrimHorizon,
            _ => to.clone(),
        };
        let finished: Vec<&TableRow> = chosen
            .iter()
            .filter(|(r, _)| r.lease.checkpoint == Checkpoint::ShardEnd)
            .map(|(r, _)| *r)
            .collect();
        for parent in finished {
            for child in descendants(&all, parent) {
                if chosen.iter().all(|(r, _)| r.lease.key != child.lease.key) {
                    chosen.push((child, below.clone()));
                }
            }
        }
    }
    // A sequence number is a position of one shard: every row it would be stored in
    // must be readable after it, checked before anything is written (a reset of every
    // shard to one shard's sequence number is refused, naming both shards).
    if let Spot::Sequence(sequence) = &spot {
        let kinesis = source.kinesis.clone();
        for (r, to) in &chosen {
            if *to != Checkpoint::At(shardflow::Position::new(sequence.clone(), 0)) {
                continue;
            }
            let stream = match r.stream_name() {
                Some(stream) => stream,
                None => args.group.single_stream()?,
            };
            match check_sequence(kinesis.as_ref(), stream, &r.shard, sequence).await {
                // A shard no longer in the stream (past its retention) cannot be checked;
                // nothing can be read from it whatever its checkpoint. A stream that is
                // not there (a misspelt --stream) checks nothing: refused.
                Err(AdminError::Kinesis(KinesisError::NotFound(e))) => {
                    match kinesis.list_shards(stream).await {
                        Ok(_) => eprintln!(
                            "shardflow: warning: {}: cannot check that sequence {} is one of its positions: {e}",
                            r.shard,
                            sequence.as_str()
                        ),
                        Err(KinesisError::NotFound(_)) => {
                            return Err(format!(
                                "stream {stream} does not exist, so sequence {} cannot be checked against its shards: nothing was reset (is --stream right?)",
                                sequence.as_str()
                            )
                            .into())
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                other => other?,
            }
        }
    }
    // How a row is named: its shard, and in a multi-stream table `stream/shard` (as
    // the consumer's events and health name it).
    let name = |r: &TableRow| match r.stream_name() {
        Some(stream) => format!("{stream}/{}", r.shard),
        None => r.shard.clone(),
    };
    let how = |r: &TableRow| {
        if r.lease.owner.is_some() {
            "requested from the owner"
        } else {
            "applied"
        }
    };
    if !args.yes {
        if cx.json {
            let plan: Vec<_> = chosen
                .iter()
                .map(|(r, to)| json!({"stream": r.stream_name(), "shard": r.shard, "lease_key": r.lease.key, "owner": r.lease.owner, "from": show(&r.lease.checkpoint), "to": show(to), "how": how(r)}))
                .collect();
            print_json(&json!({"plan": plan, "changed": false}));
        } else {
            let mut t = table(&["shard", "owner", "checkpoint now", "new checkpoint", "how"]);
            for (r, to) in &chosen {
                t.add_row(vec![
                    name(r),
                    r.lease.owner.clone().unwrap_or_else(|| "-".into()),
                    show(&r.lease.checkpoint),
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
        let outcome = reset_checkpoint(store.as_ref() as &dyn LeaseStore, &r.lease.key, to).await?;
        let (how, owner) = match &outcome {
            ResetOutcome::Applied(_) => ("applied", None),
            ResetOutcome::Requested(row) => ("requested from the owner", row.owner.clone()),
            _ => ("done", None),
        };
        done.push(json!({"stream": r.stream_name(), "shard": r.shard, "lease_key": r.lease.key, "from": show(&r.lease.checkpoint), "to": show(to), "how": how, "owner": owner}));
        if !cx.json {
            println!(
                "{}: {} -> {}: {how}",
                name(r),
                show(&r.lease.checkpoint),
                show(to)
            );
        }
    }
    if cx.json {
        print_json(&json!({"reset": done, "changed": true}));
    }
    Ok(ExitCode::SUCCESS)
}
