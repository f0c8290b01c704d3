//! `dlq replay`: reads a dead-letter stream from its oldest record to its tip and
//! re-publishes each [`DeadLetterEnvelope`]'s payload to a stream with its original
//! partition key, through the library's producer. Dead letters written in parts are
//! put back together first; one whose parts are not all in the stream is not replayed
//! (counted as incomplete).

use std::collections::BTreeMap;
use std::process::ExitCode;

use clap::Args;
use futures_util::stream::{FuturesUnordered, StreamExt};
use serde_json::json;
use shardflow::kinesis::StartingPosition;
use shardflow::producer::{Producer, ProducerRecord};
use shardflow::Backend;
use shardflow_middleware::dead_letter::envelope::Reassembly;
use shardflow_middleware::DeadLetterEnvelope;

use crate::read::read_to_tip;
use crate::{print_json, progress, CliResult, Context, EXIT_PLAN_ONLY};

/// `dlq replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// The dead-letter stream.
    #[arg(long)]
    from: String,
    /// The stream to write the payloads to (normally the original stream).
    #[arg(long)]
    to: String,
    /// Replay at most this many dead letters (the oldest first).
    #[arg(long)]
    limit: Option<u64>,
    /// Publish; without it only the plan is printed (exit code 3).
    #[arg(long)]
    yes: bool,
}

/// `dlq replay`.
pub async fn replay(cx: &Context, args: ReplayArgs) -> CliResult {
    let kinesis = cx.aws.kinesis();
    let limit = args.limit.unwrap_or(u64::MAX);
    let mut letters: Vec<DeadLetterEnvelope> = Vec::new();
    let mut skipped = 0u64;
    let mut parts = Reassembly::new();
    let reading = progress(None, "reading dead letters");
    // Oldest shards first (ListShards lists parents before children).
    for shard in kinesis.list_shards(&args.from).await? {
        if letters.len() as u64 >= limit {
            break;
        }
        read_to_tip(
            kinesis.as_ref(),
            &args.from,
            &shard.shard_id,
            &StartingPosition::TrimHorizon,
            |record| {
                match DeadLetterEnvelope::from_bytes(&record.data) {
                    Ok(envelope) => {
                        if let Some(letter) = parts.push(envelope) {
                            letters.push(letter);
                            reading.inc(1);
                        }
                    }
                    Err(_) => skipped += 1,
                }
                (letters.len() as u64) < limit
            },
        )
        .await?;
    }
    reading.finish_and_clear();
    let mut by_stream: BTreeMap<&str, u64> = BTreeMap::new();
    for letter in &letters {
        *by_stream.entry(letter.stream.as_str()).or_default() += 1;
    }
    let summary = json!({
        "from": args.from,
        "to": args.to,
        "dead_letters": letters.len(),
        "not_envelopes": skipped,
        "incomplete": parts.incomplete(),
        "original_streams": by_stream,
        "published": 0,
    });
    if !args.yes {
        if cx.json {
            print_json(&summary);
        } else {
            println!(
                "would re-publish {} dead letters from {} to {} (originally from: {}); {} records are not dead-letter envelopes and {} dead letters miss parts, and would be skipped; run again with --yes",
                letters.len(),
                args.from,
                args.to,
                by_stream
                    .iter()
                    .map(|(s, n)| format!("{s} {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                skipped,
                parts.incomplete()
            );
        }
        return Ok(ExitCode::from(EXIT_PLAN_ONLY));
    }
    let producer = Producer::builder()
        .stream(&args.to)
        .backend(cx.aws.clone())
        .build()?;
    let bar = progress(Some(letters.len() as u64), "re-publishing");
    let mut sends = FuturesUnordered::new();
    for letter in &letters {
        let payload = letter.payload.clone();
        let producer = producer.clone();
        let key = letter.partition_key.clone();
        sends.push(async move { producer.send(ProducerRecord::new(payload, key)).await });
    }
    let mut published = 0u64;
    let mut failed = None;
    while let Some(result) = sends.next().await {
        match result {
            Ok(_) => {
                published += 1;
                bar.inc(1);
            }
            Err(e) => failed = Some(e),
        }
    }
    drop(sends);
    producer.close().await;
    bar.finish_and_clear();
    if let Some(e) = failed {
        return Err(format!(
            "{published} of {} dead letters re-published; a write failed: {e}",
            letters.len()
        )
        .into());
    }
    if cx.json {
        let mut done = summary;
        done["published"] = json!(published);
        print_json(&done);
    } else {
        println!(
            "re-published {published} dead letters from {} to {}",
            args.from, args.to
        );
    }
    Ok(ExitCode::SUCCESS)
}
