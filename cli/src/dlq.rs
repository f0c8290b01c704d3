//! `dlq replay`: reads a dead-letter stream from its oldest record to its tip and
//! re-publishes each [`DeadLetterEnvelope`]'s payload to a stream with its original
//! partition key, through the library's producer. Dead letters written in parts are
//! put back together first; one whose parts are not all in the stream is not replayed
//! (counted as incomplete). A dead letter that kept its record's headers is written
//! back with them, framed as Spring's JSON header mapper frames them (what a consumer
//! reads by default); one without headers is written back as its bare payload.
//!
//! Order: the dead letters of one partition key are written one after the other, in the
//! order they are in the dead-letter stream, each only once the one before it was
//! stored; many keys go at once. The first dead letter that finally fails stops the
//! replay: nothing after it of its key is written, no further dead letter is started,
//! and what was already under way is finished.
//!
//! Resuming: what was re-published is recorded in a DynamoDB item (table
//! `--progress-table`, one item per dead-letter stream and target stream; see
//! [`crate::replayed`]), written as the replay goes and at its end, also when it
//! failed. A rerun skips what the item covers, so a refused write followed by a rerun,
//! or `--limit` runs one after the other, publish every dead letter once. Why an item
//! rather than a position printed for the next run: a rerun is then the same command,
//! nothing to copy by hand, and it works with dead letters of many keys finishing out of
//! order. Why not a dedup key for the consumer: the duplicates would still be in the
//! stream for every other reader. A crash between a write and the next progress write
//! can publish those few dead letters again (at least once, as every Kinesis producer).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use futures_util::stream::{FuturesUnordered, StreamExt};
use serde_json::json;
use shardflow::headers::spring;
use shardflow::kinesis::StartingPosition;
use shardflow::producer::{ProduceError, Producer, ProducerRecord};
use shardflow::{Backend, Position, SequenceNumber};
use shardflow_middleware::dead_letter::envelope::Reassembly;
use shardflow_middleware::DeadLetterEnvelope;

use crate::read::read_to_tip;
use crate::replayed::{LetterId, ProgressItem, Replayed, WINDOW};
use crate::{print_json, progress, CliResult, Context, EXIT_PLAN_ONLY};

/// Progress is written after this many dead letters re-published (and at the end).
const SAVE_EVERY: u64 = 500;

/// `dlq replay`.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// The dead-letter stream.
    #[arg(long)]
    from: String,
    /// The stream to write the payloads to (normally the original stream).
    #[arg(long)]
    to: String,
    /// Replay at most this many dead letters not replayed before (the oldest first).
    #[arg(long)]
    limit: Option<u64>,
    /// The DynamoDB table that records what was replayed, so that a rerun (after a
    /// failed write, or another --limit run) continues instead of repeating: one item
    /// per dead-letter stream and target stream. Created on first use.
    #[arg(
        long,
        env = "SHARDFLOW_REPLAY_TABLE",
        default_value = "shardflow-dlq-replay"
    )]
    progress_table: String,
    /// Forget what earlier runs replayed and replay everything again.
    #[arg(long)]
    restart: bool,
    /// Publish; without it only the plan is printed (exit code 3).
    #[arg(long)]
    yes: bool,
}

/// One dead letter read, and its name in the progress item.
struct Letter {
    id: LetterId,
    envelope: DeadLetterEnvelope,
}

/// `dlq replay`.
pub async fn replay(cx: &Context, args: ReplayArgs) -> CliResult {
    let kinesis = cx.aws.kinesis();
    let limit = args.limit.unwrap_or(u64::MAX);
    let mut item = ProgressItem::new(
        cx.aws.dynamodb_client().clone(),
        &args.progress_table,
        &args.from,
        &args.to,
    );
    let mut replayed = if args.restart {
        Replayed::default()
    } else {
        item.load().await?
    };
    // Every dead letter read, in stream order (for the progress item), and those to
    // replay.
    let mut read: Vec<LetterId> = Vec::new();
    let mut letters: Vec<Letter> = Vec::new();
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
                            // A sequence number Kinesis gave is decimal digits.
                            let Ok(sequence) = SequenceNumber::new(record.sequence_number) else {
                                skipped += 1;
                                return (letters.len() as u64) < limit;
                            };
                            let id = LetterId {
                                shard: record.shard,
                                position: Position::new(sequence, record.sub_sequence),
                            };
                            read.push(id.clone());
                            if !replayed.covers(&id) {
                                letters.push(Letter {
                                    id,
                                    envelope: letter,
                                });
                                reading.inc(1);
                            }
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
    let already = read.len() - letters.len();
    let mut by_stream: BTreeMap<&str, u64> = BTreeMap::new();
    for letter in &letters {
        *by_stream
            .entry(letter.envelope.stream.as_str())
            .or_default() += 1;
    }
    let summary = json!({
        "from": args.from,
        "to": args.to,
        "dead_letters": letters.len(),
        "replayed_before": already,
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
                "would re-publish {} dead letters from {} to {} (originally from: {}); {} were replayed by earlier runs, {} records are not dead-letter envelopes and {} dead letters miss parts, and would be skipped; run again with --yes",
                letters.len(),
                args.from,
                args.to,
                by_stream
                    .iter()
                    .map(|(s, n)| format!("{s} {n}"))
                    .collect::<Vec<_>>()
                    .join(", "),
                already,
                skipped,
                parts.incomplete()
            );
        }
        return Ok(ExitCode::from(EXIT_PLAN_ONLY));
    }
    if args.restart {
        item.clear().await?;
    }
    let producer = Producer::builder()
        .stream(&args.to)
        .backend(cx.aws.clone())
        .ordered_per_key(true)
        // One key's dead letters go one per round trip: do not wait to fill batches.
        .linger(Duration::from_millis(5))
        .build()?;
    let bar = progress(Some(letters.len() as u64), "re-publishing");
    let outcome = publish(&producer, &letters, &mut replayed, &read, &mut item, &bar).await;
    producer.close().await;
    bar.finish_and_clear();
    replayed.compact(&read);
    item.save(&replayed).await?;
    let (published, failed) = outcome?;
    if let Some(e) = failed {
        return Err(format!(
            "{published} of {} dead letters re-published; a write failed: {e}; nothing after it of its partition key was written and no other dead letter was started; run the same command again to continue (what was re-published is recorded in table {})",
            letters.len(),
            args.progress_table
        )
        .into());
    }
    if cx.json {
        let mut done = summary;
        done["published"] = json!(published);
        print_json(&done);
    } else {
        println!(
            "re-published {published} dead letters from {} to {} ({already} replayed by earlier runs)",
            args.from, args.to
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes `letters` in per-key order (see the module docs), marking each one stored in
/// `replayed` and saving it every [`SAVE_EVERY`]. Returns how many were published and
/// the error of the first that finally failed.
async fn publish(
    producer: &Producer,
    letters: &[Letter],
    replayed: &mut Replayed,
    read: &[LetterId],
    item: &mut ProgressItem,
    bar: &indicatif::ProgressBar,
) -> Result<(u64, Option<ProduceError>), crate::CliError> {
    let send = |index: usize| {
        let letter = &letters[index].envelope;
        let data = if letter.headers.is_empty() {
            Some(letter.payload.clone())
        } else {
            spring::write_json(&letter.headers, &letter.payload)
        };
        let key = letter.partition_key.clone();
        async move {
            let result = match data {
                Some(data) => producer.send(ProducerRecord::new(data, key)).await,
                // Headers or payload beyond the framing's 4 GiB length fields: far more
                // than any record Kinesis takes.
                None => Err(ProduceError::TooLarge {
                    size: usize::MAX,
                    limit: shardflow::producer::MAX_RECORD_BYTES,
                }),
            };
            (index, result)
        }
    };
    let mut done = vec![false; letters.len()];
    // The oldest dead letter not yet stored, and the next one to admit.
    let (mut oldest, mut admitted) = (0usize, 0usize);
    // Per key with a dead letter in flight: its admitted dead letters waiting for it.
    let mut waiting: HashMap<&str, VecDeque<usize>> = HashMap::new();
    let mut in_flight = FuturesUnordered::new();
    let mut failed: Option<ProduceError> = None;
    let mut published = 0u64;
    loop {
        while failed.is_none() && admitted < letters.len() && admitted < oldest + WINDOW {
            let key = letters[admitted].envelope.partition_key.as_str();
            match waiting.get_mut(key) {
                Some(queue) => queue.push_back(admitted),
                None => {
                    waiting.insert(key, VecDeque::new());
                    in_flight.push(send(admitted));
                }
            }
            admitted += 1;
        }
        let Some((index, result)) = in_flight.next().await else {
            break;
        };
        let key = letters[index].envelope.partition_key.as_str();
        match result {
            Ok(_) => {
                done[index] = true;
                published += 1;
                bar.inc(1);
                replayed.mark(letters[index].id.clone());
                while oldest < done.len() && done[oldest] {
                    oldest += 1;
                }
                let next = match (&failed, waiting.get_mut(key)) {
                    (None, Some(queue)) => queue.pop_front(),
                    _ => None,
                };
                match next {
                    Some(next) => in_flight.push(send(next)),
                    None => {
                        waiting.remove(key);
                    }
                }
                if published % SAVE_EVERY == 0 {
                    replayed.compact(read);
                    item.save(replayed).await?;
                }
            }
            Err(e) => {
                // Nothing after it of its key goes; the first failure is the one reported.
                waiting.remove(key);
                failed.get_or_insert(e);
            }
        }
    }
    Ok((published, failed))
}
